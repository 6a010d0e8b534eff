"""Small calls of every fused op on one backend, forward and backward, dropout on.

The GPU check runs this under ``compute-sanitizer`` (memcheck, then racecheck) with the CUDA
backend forced, so every CUDA kernel of bertfast runs at least once on awkward shapes: ragged
sequences with an empty one, odd widths, head dims 26/32/64/80/128/256, ignored labels. It
checks only that every call finishes with finite results; correctness is the tests' job.

    python -m bertfast.gpucheck.sanitize --backend cuda          # what the GPU check runs
    python -m bertfast.gpucheck.sanitize --backend torch --device cpu   # the CPU dry run
    python -m bertfast.gpucheck.sanitize --case mlm_head_loss --dtype bfloat16  # one failing call alone

``--no-fp32-out-gemms`` (the racecheck step): the MLM loss's weight gradient (and any layer's,
bertfast.model.residual_linear) uses bf16-out GEMMs.
In all three GPU runs (H200 twice, H100) racecheck failed inside torch's bf16-in, fp32-out cuBLAS
GEMM ("The Sanitizer failed to handle a hardware exception", then CUBLAS_STATUS_INTERNAL_ERROR);
memcheck passes it. Every bertfast kernel of the op still runs and is checked; if racecheck still
fails there, the fault is not that GEMM's. It did, once in four runs with the flag (H200, 2026-11-27,
third loan): the same sanitizer error, then CUDA error 700 reported by the check after
``mlm_head_loss_fwd``'s launch, an error that any earlier launch (the decoder's cuBLAS GEMM among
them) could have left; memcheck passed the same calls. The racecheck step now runs with
``CUDA_LAUNCH_BLOCKING=1``, so the next failure is reported at the launch that made it.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, List, Optional, Tuple

import torch

Case = Tuple[str, Callable[[torch.device, torch.dtype], List[torch.Tensor]]]


def _leaf(*shape, device, dtype, scale=1.0):
    return (scale * torch.randn(*shape, device=device)).to(dtype).requires_grad_(True)


def _grads(out: torch.Tensor, leaves: List[torch.Tensor]) -> List[torch.Tensor]:
    grads = torch.autograd.grad(out.float().square().sum(), leaves, allow_unused=True)
    return [out] + [g for g in grads if g is not None]


def attention_varlen(device, dtype):
    from bertfast.ops import attention_varlen as op
    out = []
    short = [5, 0, 17, 1, 33]
    # head dim 64 also at the CUDA backward's other kernels: one pass with two warpgroups (65 to 128
    # tokens), dQ and dK/dV beyond 128
    for heads, head_dim, lengths in ((2, 26, short), (3, 32, short), (2, 64, short), (2, 64, [100, 0, 7]),
                                     (1, 64, [150, 3]), (1, 80, short), (1, 128, short), (1, 256, short)):
        cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
        qkv = _leaf(sum(lengths), 3, heads, head_dim, device=device, dtype=dtype)
        out += _grads(op(qkv, cu, max(lengths), dropout_p=0.1), [qkv])
    return out


def attention_padded(device, dtype):
    from bertfast.ops import attention as op
    batch, seqlen, heads, head_dim = 3, 19, 2, 64
    q, k, v = (_leaf(batch, seqlen, heads, head_dim, device=device, dtype=dtype) for _ in range(3))
    mask = torch.arange(seqlen, device=device)[None, :] < torch.tensor([19, 7, 0], device=device)[:, None]
    return _grads(op(q, k, v, mask, dropout_p=0.1), [q, k, v])


def bias_gelu(device, dtype):
    from bertfast.model import residual_linear
    from bertfast.ops import bias_gelu as op
    out = []
    for approximate in ("none", "tanh"):
        x, bias = _leaf(37, 300, device=device, dtype=dtype), _leaf(300, device=device, dtype=torch.float32)
        out += _grads(op(x, bias, approximate), [x, bias])
    # and inside the FFN's GEMMs where the backend has them (Triton, bf16): ragged tiles every way
    x, w1, b1, w2 = (_leaf(*shape, device=device, dtype=dtype, scale=0.2)
                     for shape in ((37, 40), (48, 40), (48,), (40, 48)))
    gemms = residual_linear.ffn_gemms(x, w1, b1, w2)
    if gemms is not None:
        out += _grads(residual_linear.ffn(x, w1, b1, w2, "none", gemms)[0], [x, w1, b1, w2])
    return out


def bias_dropout_residual_layernorm(device, dtype):
    from bertfast.ops import bias_dropout_residual_layernorm as op
    n, h = 41, 100
    x, res = _leaf(n, h, device=device, dtype=dtype), _leaf(n, h, device=device, dtype=dtype)
    bias, w, b = (_leaf(h, device=device, dtype=torch.float32) for _ in range(3))
    out = _grads(op(x, bias, res, w, b, 1e-12, dropout_p=0.1), [x, res, bias, w, b])
    return out + _grads(op(x, None, None, w, b, 1e-12), [x, w, b])


def embeddings(device, dtype):
    from bertfast.ops import embeddings as op
    t, h, vocab, positions = 45, 100, 97, 32
    ids = torch.randint(0, vocab, (t,), device=device)
    pos = torch.arange(t, device=device) % positions
    types = (torch.arange(t, device=device) % 3 == 0).long()
    tables = [_leaf(vocab, h, device=device, dtype=torch.float32, scale=0.02),
              _leaf(positions, h, device=device, dtype=torch.float32, scale=0.02),
              _leaf(2, h, device=device, dtype=torch.float32, scale=0.02)]
    w, b = _leaf(h, device=device, dtype=torch.float32), _leaf(h, device=device, dtype=torch.float32)
    y = op(ids, pos, types, *tables, w, b, 1e-12, dropout_p=0.1, out_dtype=dtype)
    return _grads(y, tables + [w, b])


def mlm_head_loss(device, dtype):
    from bertfast.ops import mlm_head_loss_decoder as op
    m, h, vocab = 29, 64, 1031
    x = _leaf(m, h, device=device, dtype=dtype)
    w, b = _leaf(vocab, h, device=device, dtype=dtype, scale=0.05), _leaf(vocab, device=device, dtype=dtype)
    labels = torch.randint(0, vocab, (m,), device=device)
    labels[::4] = -100
    loss_sum, _ = op(x, w, b, labels, chunk_rows=8)
    return _grads(loss_sum, [x, w, b])


def registered_cases() -> List[Case]:
    """Every op's calls, as bertfast.registry lists them (each op's ``sanitize``), in its order."""
    from bertfast import registry
    return list(registry.functions("sanitize").items())


def run(backend: str, device: torch.device, dtypes=(torch.float32, torch.bfloat16), log=print,
        cases: Optional[List[str]] = None) -> List[str]:
    """Every case (or those named) on ``backend``; returns the failures (an exception or a non-finite
    result)."""
    from bertfast.ops import use_backend

    failures = []
    torch.manual_seed(0)
    for dtype in dtypes:
        for name, case in registered_cases():
            if cases and name not in cases:
                continue
            label = f"{name} {str(dtype).replace('torch.', '')}"
            try:
                with use_backend(backend):
                    results = case(device, dtype)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                bad = [i for i, t in enumerate(results) if not torch.isfinite(t.float()).all()]
                if bad:
                    raise AssertionError(f"non-finite values in results {bad}")
            except Exception as exc:  # noqa: BLE001 - every failure is reported, the rest still runs
                failures.append(f"{label}: {type(exc).__name__}: {exc}")
                log(f"FAILED {label}: {type(exc).__name__}: {exc}")
                continue
            log(f"ok     {label} ({backend} on {device.type})")
    return failures


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bertfast.gpucheck.sanitize", description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=("cuda", "triton", "torch"), default="cuda")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--case", action="append", choices=[name for name, _ in registered_cases()],
                   help="only this op's calls (repeat for several): to look at one failure alone")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="only this dtype")
    p.add_argument("--no-fp32-out-gemms", action="store_true",
                   help="the MLM loss's weight gradient through bf16-out GEMMs (racecheck fails in cuBLAS's "
                        "fp32-out one)")
    args = p.parse_args(argv)
    if args.no_fp32_out_gemms:
        from bertfast.ops import _common
        _common.FP32_OUT_GEMMS = False
        print("mlm_head_loss: the weight gradient's GEMMs write the input dtype (--no-fp32-out-gemms)")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("sanitize: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    dtypes = (torch.float32, torch.bfloat16) if args.device == "cuda" else (torch.float32,)
    if args.dtype:
        dtypes = (getattr(torch, args.dtype),)
    failures = run(args.backend, torch.device(args.device), dtypes, cases=args.case)
    print(f"{len(failures)} failing call(s)" if failures else "every call finished with finite results")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
