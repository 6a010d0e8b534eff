"""Kernel suite: every fused op, forward and backward, each bertfast backend against baselines.

For each op and case the suite builds one set of random inputs (fp32 masters, cast to the
run's dtype), runs the reference (``bertfast.reference``) in fp32 and in the run's dtype,
then for every implementation:

  1. the parity gate (``bertfast.bench.gate``): outputs and input gradients vs the fp32
     reference; a path that fails gets a FAILED PARITY row per direction and is never timed;
  2. timing of ``fwd`` (forward under no_grad), ``bwd`` (``autograd.grad`` on a retained
     graph) and ``fwd+bwd`` (forward with grad + ``autograd.grad``).

Implementations: ``bertfast:<backend>`` (the public op under ``bertfast.ops.use_backend``),
``torch eager`` (the reference math: what a plain PyTorch model runs), ``torch.compile`` of
that same math, and for attention torch SDPA with the flash backend (equal-length batches
only: it takes no mask), the memory-efficient backend (with the padding mask) and the cuDNN
backend. The MLM head adds the transformers-style full-sequence head and its GEMM floor.

Dropout cases (attention, bias_dropout_residual_layernorm at p = 0.1) cannot be compared with
the reference element by element (every implementation draws its own mask): an implementation
is timed with dropout only after passing the gate on the same inputs at p = 0. Row-op cases
with ``params=fp32`` keep the parameters in fp32 beside low-precision activations, the path
training takes under autocast.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from bertfast import reference
from bertfast.bench import flops as W
from bertfast.bench.common import (SuiteContext, compile_skip_reason, cu_seqlens, describe_lengths, dtype_name,
                                   free_memory, generator_for, mask_from, sequence_lengths, short_error,
                                   strict_fp32)
from bertfast.bench.gate import compare
from bertfast.bench.results import (ERROR, FAILED_PARITY, FULL_HEAD, GEMM_FLOOR, SDPA_CUDNN, SDPA_FLASH,
                                    SDPA_MEM_EFFICIENT, TORCH_COMPILE, TORCH_EAGER, Row, bertfast_impl, skipped)
from bertfast.bench.timing import (COLD_L2, PERF_COUNTER, SMALL_KERNEL_MS, host_overhead_us, peak_memory, time_fn,
                                   time_small)

Tensor = torch.Tensor
SUITE = "kernels"
OPS = ("attention", "bias_gelu", "bias_dropout_residual_layernorm", "embeddings", "mlm_head_loss_decoder",
       "mlm_head_loss")
ALL_DIRECTIONS = ("fwd", "bwd", "fwd+bwd")
GRAD_IN_FORWARD = ("fwd", "fwd+bwd")  # ops whose gradients are computed inside the forward pass
EPS = 1e-12
DROPOUT_P = 0.1  # BERT's, for the dropout cases


# --------------------------------------------------------------------------- one path
@dataclass
class Prepared:
    """A path ready to run: leaves to differentiate, the forward, dout, and a canonical view.

    canon(output, grads) -> named tensors in the layout the reference uses (valid tokens only).
    """

    leaves: List[Tensor]
    forward: Callable[[], Tensor]
    grad_out: Optional[Tensor]
    canon: Callable[[Tensor, Sequence[Optional[Tensor]]], Dict[str, Tensor]]
    gated: bool = True  # False for the GEMM floor, which is not the op

    def run_once(self) -> Dict[str, Tensor]:
        out = self.forward()
        grads = torch.autograd.grad(out, self.leaves, self.grad_out, allow_unused=True)
        return {k: v.detach().float() for k, v in self.canon(out.detach(), grads).items()}


Builder = Callable[[torch.dtype], Prepared]


@dataclass
class Impl:
    name: str
    build: Optional[Builder] = None
    skip: str = ""  # when set, the row is skipped with this reason
    env_dependent: bool = False  # torch.compile / SDPA: an exception means "cannot run here", not "broken"


@dataclass
class OpCase:
    group: str
    case: Dict[str, Any]
    reference: Builder  # the oracle, in the given dtype
    impls: List[Impl]
    work: Callable[[str], Dict[str, float]]  # direction -> {"bytes": n} | {"flops": f}
    directions: Tuple[str, ...] = ALL_DIRECTIONS
    gate_case: Optional["OpCase"] = None  # dropout cases: the same inputs at p = 0, where the gate runs


def _leaf(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t.detach().to(dtype).requires_grad_(True)


def _grad_names(names: Sequence[str], grads: Sequence[Optional[Tensor]], like: Sequence[Tensor]) -> Dict[str, Tensor]:
    return {f"d{n}": (g if g is not None else torch.zeros_like(t)) for n, g, t in zip(names, grads, like)}


def _simple(fn: Callable[..., Tensor], names: Sequence[str], data: Dict[str, Tensor], dtype: torch.dtype,
            grad_out: Optional[Tensor], extra: Optional[Dict[str, Any]] = None, out_name: str = "y",
            fp32_names: Sequence[str] = ()) -> Prepared:
    """A path whose leaves are ``data[names]`` cast to dtype (fp32 for ``fp32_names``: parameters kept
    in fp32 as under autocast) and whose output is fn(*leaves, **extra)."""
    leaves = [_leaf(data[n], torch.float32 if n in fp32_names else dtype) for n in names]
    extra = extra or {}
    return Prepared(leaves, lambda: fn(*leaves, **extra),
                    None if grad_out is None else grad_out.to(dtype),
                    lambda out, grads: {out_name: out, **_grad_names(names, grads, leaves)})


def _backend_impls(ctx: SuiteContext, op_names: Sequence[str], make: Callable[[], Builder],
                   variant: str = "") -> List[Impl]:
    """One impl per requested bertfast backend, the builder run under use_backend({op: backend})."""
    from bertfast.ops import use_backend

    impls = []
    for backend in ctx.backends:
        inner = make()

        def build(dtype, inner=inner, backend=backend):
            p = inner(dtype)
            forward = p.forward

            def forced():
                with use_backend({op: backend for op in op_names}):
                    return forward()
            p.forward = forced
            return p
        impls.append(Impl(bertfast_impl(backend, variant), build))
    return impls


def _fresh_compile(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    import torch._dynamo as dynamo
    dynamo.reset()  # a fresh cache per case: no silent fall-back to eager at the recompile limit
    return torch.compile(fn, dynamic=False)


def _compile_impl(ctx: SuiteContext, fn: Callable[..., Tensor], make: Callable[[Callable[..., Tensor]], Builder]) -> Impl:
    reason = compile_skip_reason(ctx)
    if reason:
        return Impl(TORCH_COMPILE, skip=reason)

    def build(dtype):
        return make(_fresh_compile(fn))(dtype)
    return Impl(TORCH_COMPILE, build, env_dependent=True)


# --------------------------------------------------------------------------- attention
def attention_cases(ctx: SuiteContext) -> List[OpCase]:
    """Head dim 64 first (BERT's), each at p = 0 and, where listed, again with dropout."""
    dev = ctx.torch_device
    if not ctx.device.is_cuda:
        shapes = [(2, 16, 2, 16)]  # batch, seqlen, heads, head_dim
        modes = {16: ("none", "finetune")}
        dropout = {(16, "none")}
    elif ctx.quick:
        shapes = [(32, 128, 12, 64), (8, 512, 12, 64)]
        modes = {64: ("none", "finetune")}
        dropout = {(64, "none")}
    else:
        shapes = [(b, s, a, d) for a, d in ((12, 64), (16, 64), (8, 128), (32, 32)) for s, b in ((128, 128), (512, 32))]
        modes = {64: ("none", "pretrain", "finetune"), 128: ("none", "finetune"), 32: ("none", "finetune")}
        dropout = {(64, "none"), (64, "pretrain")}
    out = []
    for batch, seqlen, heads, head_dim in shapes:
        for mode in modes[head_dim]:
            plain = _attention_case(ctx, dev, batch, seqlen, heads, head_dim, mode, 0.0)
            out.append(plain)
            if (head_dim, mode) in dropout:
                with_dropout = _attention_case(ctx, dev, batch, seqlen, heads, head_dim, mode, DROPOUT_P)
                with_dropout.gate_case = plain
                out.append(with_dropout)
    return out


def _attention_case(ctx, dev, batch, seqlen, heads, head_dim, mode, dropout_p) -> OpCase:
    gen = generator_for("attention", batch, seqlen, heads, head_dim, mode)  # same inputs at every p
    lengths = sequence_lengths(mode, batch, seqlen, gen)
    total = sum(lengths)
    q, k, v, dout = (torch.randn(total, heads, head_dim, generator=gen).to(dev) for _ in range(4))
    cu = cu_seqlens(lengths, dev)
    mask = mask_from(lengths, seqlen, dev)
    case = {"batch": batch, "seqlen": seqlen, "heads": heads, "head_dim": head_dim, "padding": mode,
            **describe_lengths(lengths, seqlen), "dropout": dropout_p, "dtype": dtype_name(ctx.dtype)}

    def padded(x: Tensor) -> Tensor:  # [T, A, D] -> [B, S, A, D], zeros at pads
        outp = x.new_zeros(batch, seqlen, heads, head_dim)
        outp[mask] = x
        return outp

    qp, kp, vp, doutp = padded(q), padded(k), padded(v), padded(dout)

    def padded_path(fn: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Builder:
        def build(dtype):
            leaves = [_leaf(t, dtype) for t in (qp, kp, vp)]

            def canon(o, grads):
                return {"out": o[mask], "dq": grads[0][mask], "dk": grads[1][mask], "dv": grads[2][mask]}
            return Prepared(leaves, lambda: fn(*leaves), doutp.to(dtype), canon)
        return build

    def varlen_path() -> Builder:
        from bertfast.ops import attention_varlen

        def build(dtype):
            qkv = _leaf(torch.stack([q, k, v], dim=1), dtype)  # [T, 3, A, D]

            def canon(o, grads):
                g = grads[0]
                return {"out": o, "dq": g[:, 0], "dk": g[:, 1], "dv": g[:, 2]}
            return Prepared([qkv], lambda: attention_varlen(qkv, cu, seqlen, dropout_p), dout.to(dtype), canon)
        return build

    def eager(a, b, c):
        return reference.attention(a, b, c, mask, dropout_p=dropout_p)

    def ops_padded(a, b, c):
        from bertfast.ops import attention
        return attention(a, b, c, mask, dropout_p)

    def sdpa(backend_name: str, use_mask: bool) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = getattr(SDPBackend, backend_name)
        attn_mask = mask[:, None, None, :] if use_mask else None

        def fn(a, b, c):
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2),
                                                   attn_mask=attn_mask, dropout_p=dropout_p)
            return o.transpose(1, 2)
        return fn

    impls = _backend_impls(ctx, ["attention_varlen"], varlen_path, "varlen")
    impls += _backend_impls(ctx, ["attention_padded"], lambda: padded_path(ops_padded), "padded")
    impls.append(Impl(TORCH_EAGER, padded_path(eager)))
    impls.append(_compile_impl(ctx, eager, padded_path))
    if mode == "none":
        impls.append(Impl(SDPA_FLASH, padded_path(sdpa("FLASH_ATTENTION", False)), env_dependent=True))
    else:
        impls.append(Impl(SDPA_FLASH, skip="flash SDPA takes no padding mask: compared on the equal-length "
                                           "(padding=none) cases"))
    impls.append(Impl(SDPA_MEM_EFFICIENT, padded_path(sdpa("EFFICIENT_ATTENTION", mode != "none")),
                      env_dependent=True))
    from torch.nn.attention import SDPBackend
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        impls.append(Impl(SDPA_CUDNN, padded_path(sdpa("CUDNN_ATTENTION", mode != "none")), env_dependent=True))
    else:
        impls.append(Impl(SDPA_CUDNN, skip=f"torch {torch.__version__} has no cuDNN SDPA backend"))
    return OpCase("attention", case, padded_path(eager), impls,
                  lambda d: {"flops": W.attention_flops(lengths, heads, head_dim, d), "tokens": total})


# --------------------------------------------------------------------------- row ops
def _row_shapes(ctx: SuiteContext, gpu_full, gpu_quick, cpu):
    if not ctx.device.is_cuda:
        return cpu
    return gpu_quick if ctx.quick else gpu_full


def _param_modes(ctx: SuiteContext) -> Tuple[str, ...]:
    """'act': parameters in the activation dtype; 'fp32': fp32 parameters beside low-precision
    activations, as under autocast (only where the two differ)."""
    return ("act",) if ctx.dtype == torch.float32 else ("act", "fp32")


def _sizes(ctx: SuiteContext, params: str) -> Tuple[int, int]:
    """(activation bytes, parameter bytes) per element."""
    act = torch.empty((), dtype=ctx.dtype).element_size()
    return act, 4 if params == "fp32" else act


def bias_gelu_cases(ctx: SuiteContext) -> List[OpCase]:
    dev, out = ctx.torch_device, []
    for n, f in _row_shapes(ctx, [(16384, 3072), (16384, 4096), (4096, 3072)], [(16384, 3072)], [(64, 128)]):
        gen = generator_for("bias_gelu", n, f)
        data = {"x": torch.randn(n, f, generator=gen).to(dev), "bias": torch.randn(f, generator=gen).to(dev)}
        dy = torch.randn(n, f, generator=gen).to(dev)
        for params in _param_modes(ctx):
            fp32 = ("bias",) if params == "fp32" else ()

            def make(fn, data=data, dy=dy, fp32=fp32):
                return lambda dtype: _simple(fn, ["x", "bias"], data, dtype, dy, fp32_names=fp32)

            def ops_fn(x, b):
                from bertfast.ops import bias_gelu
                return bias_gelu(x, b)
            impls = _backend_impls(ctx, ["bias_gelu"], lambda make=make: make(ops_fn))
            impls.append(Impl(TORCH_EAGER, make(reference.bias_gelu)))
            impls.append(_compile_impl(ctx, reference.bias_gelu, make))
            act, par = _sizes(ctx, params)
            # The gate's oracle keeps every leaf in the run's dtype (the low-precision rule's reference).
            out.append(OpCase("bias_gelu", {"tokens": n, "features": f, "params": params, "dtype": dtype_name(ctx.dtype)},
                              make(reference.bias_gelu, fp32=()), impls,
                              lambda d, n=n, f=f, act=act, par=par: {"bytes": W.bias_gelu_bytes(n, f, act, par, d)}))
    return out


def bdrln_cases(ctx: SuiteContext) -> List[OpCase]:
    """BERT's residual LayerNorm: p = 0 for each shape and parameter mode, then with dropout."""
    dev, out = ctx.torch_device, []
    names = ["x", "bias", "residual", "weight", "ln_bias"]
    for n, h in _row_shapes(ctx, [(16384, 1024), (16384, 768), (4096, 768)], [(16384, 1024)], [(64, 32)]):
        gen = generator_for("bdrln", n, h)
        data = {"x": torch.randn(n, h, generator=gen), "bias": torch.randn(h, generator=gen),
                "residual": torch.randn(n, h, generator=gen), "weight": 1 + 0.1 * torch.randn(h, generator=gen),
                "ln_bias": 0.1 * torch.randn(h, generator=gen)}
        data = {k: v.to(dev) for k, v in data.items()}
        dy = torch.randn(n, h, generator=gen).to(dev)
        for params in _param_modes(ctx):
            fp32 = ("bias", "weight", "ln_bias") if params == "fp32" else ()
            plain = None
            for p in (0.0, DROPOUT_P):
                def make(fn, data=data, dy=dy, fp32=fp32):
                    return lambda dtype: _simple(fn, names, data, dtype, dy, fp32_names=fp32)

                def eager(x, b, r, w, lb, p=p):
                    return reference.bias_dropout_residual_layernorm(x, b, r, w, lb, EPS, p)

                def ops_fn(x, b, r, w, lb, p=p):
                    from bertfast.ops import bias_dropout_residual_layernorm
                    return bias_dropout_residual_layernorm(x, b, r, w, lb, EPS, p)
                impls = _backend_impls(ctx, ["bias_dropout_residual_layernorm"], lambda make=make, f=ops_fn: make(f))
                impls.append(Impl(TORCH_EAGER, make(eager)))
                impls.append(_compile_impl(ctx, eager, make))
                act, par = _sizes(ctx, params)
                oc = OpCase("bias_dropout_residual_layernorm",
                            {"tokens": n, "hidden": h, "params": params, "dropout": p, "dtype": dtype_name(ctx.dtype)},
                            make(eager, fp32=()), impls,
                            lambda d, n=n, h=h, act=act, par=par: {
                                "bytes": W.bias_dropout_residual_layernorm_bytes(n, h, act, par, d)},
                            gate_case=plain)
                out.append(oc)
                plain = oc
    return out


def embeddings_cases(ctx: SuiteContext) -> List[OpCase]:
    dev, out = ctx.torch_device, []
    names = ["word", "pos", "token_type", "ln_weight", "ln_bias"]
    for t, h, vocab, positions in _row_shapes(ctx, [(16384, 1024, 30522, 512), (16384, 768, 30522, 512),
                                                    (4096, 768, 30522, 512)],
                                              [(16384, 1024, 30522, 512)], [(64, 32, 100, 32)]):
        gen = generator_for("embeddings", t, h, vocab)
        seqlen = min(128, positions)
        ids = {"input_ids": torch.randint(0, vocab, (t,), generator=gen).to(dev),
               "position_ids": (torch.arange(t) % seqlen).to(dev),
               "token_type_ids": (torch.arange(t) % seqlen >= seqlen // 2).long().to(dev)}
        data = {"word": 0.02 * torch.randn(vocab, h, generator=gen), "pos": 0.02 * torch.randn(positions, h, generator=gen),
                "token_type": 0.02 * torch.randn(2, h, generator=gen), "ln_weight": 1 + 0.1 * torch.randn(h, generator=gen),
                "ln_bias": 0.1 * torch.randn(h, generator=gen)}
        data = {k: v.to(dev) for k, v in data.items()}
        dy = torch.randn(t, h, generator=gen).to(dev)
        for params in _param_modes(ctx):
            fp32 = tuple(names) if params == "fp32" else ()
            act, par = _sizes(ctx, params)
            out_dtype = ctx.dtype

            def make(fn, data=data, dy=dy, ids=ids, fp32=fp32):
                return lambda dtype: _simple(fn, names, data, dtype, dy, extra=ids, fp32_names=fp32)

            def eager(word, pos, tt, lw, lb, input_ids, position_ids, token_type_ids):
                return reference.embeddings(input_ids, position_ids, token_type_ids, word, pos, tt, lw, lb, EPS)

            def ops_fn(word, pos, tt, lw, lb, input_ids, position_ids, token_type_ids, out_dtype=out_dtype):
                from bertfast.ops import embeddings
                return embeddings(input_ids, position_ids, token_type_ids, word, pos, tt, lw, lb, EPS,
                                  out_dtype=out_dtype)
            impls = _backend_impls(ctx, ["embeddings"], lambda make=make, f=ops_fn: make(f))
            impls.append(Impl(TORCH_EAGER, make(eager)))
            impls.append(_compile_impl(ctx, eager, make))
            out.append(OpCase("embeddings", {"tokens": t, "hidden": h, "vocab": vocab, "params": params,
                                             "dtype": dtype_name(ctx.dtype)},
                              make(eager, fp32=()), impls,
                              lambda d, t=t, h=h, vocab=vocab, positions=positions, act=act, par=par: {
                                  "bytes": W.embeddings_bytes(t, h, vocab, positions, 2, 8, par, act, d)}))
    return out


# --------------------------------------------------------------------------- GEMM-bound
def mlm_head_loss_decoder_cases(ctx: SuiteContext) -> List[OpCase]:
    dev, out = ctx.torch_device, []
    names = ["x", "weight", "bias"]
    for m, h, vocab in _row_shapes(ctx, [(2458, 768, 30522), (2458, 1024, 30522)], [(2458, 1024, 30522)],
                                   [(16, 32, 100)]):
        gen = generator_for("lce", m, h, vocab)
        data = {"x": torch.randn(m, h, generator=gen), "weight": 0.05 * torch.randn(vocab, h, generator=gen),
                "bias": 0.1 * torch.randn(vocab, generator=gen)}
        data = {k: v.to(dev) for k, v in data.items()}
        labels = torch.randint(0, vocab, (m,), generator=gen)
        labels[::7] = reference.IGNORE_INDEX  # some ignored rows, as in real batches
        labels = labels.to(dev)

        def make(fn, data=data, labels=labels):
            return lambda dtype: _simple(fn, names, data, dtype, None, extra={"labels": labels}, out_name="loss")

        def eager(x, w, b, labels):
            return reference.mlm_head_loss_decoder(x, w, b, labels)[0]

        def ops_fn(x, w, b, labels):
            from bertfast.ops import mlm_head_loss_decoder
            return mlm_head_loss_decoder(x, w, b, labels)[0]
        impls = _backend_impls(ctx, ["mlm_head_loss"], lambda make=make: make(ops_fn))
        impls.append(Impl(TORCH_EAGER, make(eager)))
        impls.append(_compile_impl(ctx, eager, make))
        out.append(OpCase("mlm_head_loss_decoder", {"rows": m, "hidden": h, "vocab": vocab,
                                                   "dtype": dtype_name(ctx.dtype)},
                          make(eager), impls,
                          lambda d, m=m, h=h, vocab=vocab: {"flops": W.mlm_head_loss_decoder_flops(m, h, vocab, d)},
                          directions=GRAD_IN_FORWARD))
    return out


def mlm_head_loss_cases(ctx: SuiteContext) -> List[OpCase]:
    dev, out = ctx.torch_device, []
    names = ["hidden", "dense_w", "dense_b", "ln_w", "ln_b", "decoder_w", "decoder_b"]
    for model, batch, seqlen, h, vocab in _row_shapes(
            ctx, [("bert-base", 128, 128, 768, 30522), ("bert-large", 128, 128, 1024, 30522)],
            [("bert-base", 64, 128, 768, 30522)], [("tiny", 2, 16, 32, 100)]):
        gen = generator_for("mlm_head_loss", batch, seqlen, h, vocab)
        tokens = batch * seqlen
        m = max(1, round(0.15 * tokens))
        labels = torch.full((tokens,), reference.IGNORE_INDEX, dtype=torch.long)
        chosen = torch.randperm(tokens, generator=gen)[:m]
        labels[chosen] = torch.randint(0, vocab, (m,), generator=gen)
        labels = labels.view(batch, seqlen).to(dev)
        data = {"hidden": torch.randn(batch, seqlen, h, generator=gen),
                "dense_w": torch.randn(h, h, generator=gen) / math.sqrt(h), "dense_b": 0.1 * torch.randn(h, generator=gen),
                "ln_w": 1 + 0.1 * torch.randn(h, generator=gen), "ln_b": 0.1 * torch.randn(h, generator=gen),
                "decoder_w": 0.05 * torch.randn(vocab, h, generator=gen),
                "decoder_b": 0.1 * torch.randn(vocab, generator=gen)}
        data = {k: v.to(dev) for k, v in data.items()}

        def make(fn, data=data, labels=labels):
            return lambda dtype: _simple(fn, names, data, dtype, None, extra={"labels": labels}, out_name="loss")

        def eager(hidden, dw, db, lw, lb, decw, decb, labels):
            """The masked-only head in plain PyTorch: gather labelled rows, transform, decoder + CE."""
            flat = labels.reshape(-1)
            pos = (flat != reference.IGNORE_INDEX).nonzero().flatten()
            rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, pos)
            x = reference.layer_norm(reference.bias_gelu(F.linear(rows, dw), db), lw, lb, EPS)
            loss_sum, _ = reference.mlm_head_loss_decoder(x, decw, decb, flat.index_select(0, pos))
            return loss_sum / pos.numel()

        def full_head(hidden, dw, db, lw, lb, decw, decb, labels):
            """transformers' BertLMPredictionHead on every token, CE (fp32 as under autocast) with -100 ignored."""
            x = F.layer_norm(F.gelu(F.linear(hidden, dw, db)), (hidden.shape[-1],), lw, lb, EPS)
            logits = F.linear(x, decw, decb)  # [B, S, V]
            return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1),
                                   ignore_index=reference.IGNORE_INDEX)

        def ops_fn(hidden, dw, db, lw, lb, decw, decb, labels):
            from bertfast.ops import mlm_head_loss
            return mlm_head_loss(hidden, labels, dw, db, lw, lb, EPS, decw, decb).loss

        def floor(dtype, data=data, m=m):
            """The head's GEMMs alone at the labelled rows: transform dense + decoder, fwd and bwd (cuBLAS)."""
            g = generator_for("mlm_floor", m, h, vocab)
            rows = torch.randn(m, h, generator=g).to(dev, dtype).requires_grad_(True)
            dw = _leaf(data["dense_w"], dtype)
            decw = _leaf(data["decoder_w"], dtype)
            dlogits = torch.randn(m, vocab, generator=g).to(dev, dtype)
            return Prepared([rows, dw, decw], lambda: (rows @ dw.t()) @ decw.t(), dlogits,
                            lambda o, grads: {}, gated=False)

        impls = _backend_impls(ctx, ["bias_gelu", "bias_dropout_residual_layernorm", "mlm_head_loss"],
                               lambda make=make: make(ops_fn))
        impls.append(Impl(TORCH_EAGER, make(eager)))
        impls.append(_compile_impl(ctx, eager, make))
        impls.append(Impl(FULL_HEAD, make(full_head)))
        impls.append(Impl(GEMM_FLOOR, floor))
        out.append(OpCase("mlm_head_loss", {"model": model, "tokens": tokens, "predictions": m, "hidden": h,
                                       "vocab": vocab, "dtype": dtype_name(ctx.dtype)},
                          make(eager), impls,
                          lambda d, m=m, h=h, vocab=vocab: {"flops": W.mlm_head_loss_flops(m, h, vocab, d)},
                          directions=GRAD_IN_FORWARD))
    return out


CASE_BUILDERS = {
    "attention": attention_cases,
    "bias_gelu": bias_gelu_cases,
    "bias_dropout_residual_layernorm": bdrln_cases,
    "embeddings": embeddings_cases,
    "mlm_head_loss_decoder": mlm_head_loss_decoder_cases,
    "mlm_head_loss": mlm_head_loss_cases,
}


# --------------------------------------------------------------------------- running
def metrics_for(ctx: SuiteContext, t, work: Dict[str, float]):
    metrics = {}
    if "bytes" in work:
        metrics["gbps"] = t.rate(work["bytes"] / 1e6)  # bytes / ms -> GB/s
        bw = ctx.device.copy_bandwidth_gbps
        if bw is not None:
            metrics["pct_copy_bw"] = metrics["gbps"].scaled(100.0 / bw.median)
    if "flops" in work:
        metrics["tflops"] = t.rate(work["flops"] / 1e9)  # flops / ms -> TFLOP/s
    return metrics


def direction_callable(p: Prepared, direction: str) -> Callable[[], None]:
    """What one timed call of a direction runs (bwd: autograd.grad on a graph built once, retained)."""
    if direction == "fwd":
        def fwd() -> None:
            with torch.no_grad():
                p.forward()
        return fwd
    if direction == "bwd":
        out = p.forward()

        def bwd() -> None:
            torch.autograd.grad(out, p.leaves, p.grad_out, retain_graph=True)
        return bwd
    if direction == "fwd+bwd":
        def step() -> None:
            torch.autograd.grad(p.forward(), p.leaves, p.grad_out)
        return step
    raise ValueError(f"direction must be one of {ALL_DIRECTIONS}, got {direction!r}")


def _time_direction(ctx: SuiteContext, p: Prepared, direction: str):
    """(time Stat, timing method, host overhead Stat or None, peak memory or None).

    Cold-L2 CUDA events per call; a figure under SMALL_KERNEL_MS is re-timed by graph replay (or
    back to back), its host overhead measured apart. CPU: perf_counter."""
    fn = direction_callable(p, direction)
    dev = ctx.torch_device
    t = time_fn(fn, dev, ctx.policy)
    method, host = (COLD_L2 if ctx.device.is_cuda else PERF_COUNTER), None
    if ctx.device.is_cuda and t.median < SMALL_KERNEL_MS:
        t, method = time_small(fn, dev)
        host = host_overhead_us(fn, dev)
    return t, method, host, (peak_memory(fn, dev) if direction == "fwd+bwd" else None)


def compile_settings():
    """Compiled backward graphs must allow autograd.grad(retain_graph=True) (the bwd timing): no donated
    buffers (an AOTAutograd memory optimisation that forbids retaining the graph)."""
    try:
        import torch._functorch.config as functorch_config
    except Exception:  # noqa: BLE001
        return contextlib.nullcontext()
    if not hasattr(functorch_config, "donated_buffer"):
        return contextlib.nullcontext()
    return functorch_config.patch(donated_buffer=False)


class _References:
    """The fp32 and run-dtype references of a case, computed on first use."""

    def __init__(self, ctx: SuiteContext, oc: OpCase):
        self.ctx, self.oc, self._values = ctx, oc, None

    def get(self):
        if self._values is None:
            with strict_fp32():
                ref32 = self.oc.reference(torch.float32).run_once()
            lowp = self.ctx.dtype
            ref_lowp = self.oc.reference(lowp).run_once() if lowp != torch.float32 else None
            self._values = (ref32, ref_lowp)
        return self._values


def run_case(ctx: SuiteContext, oc: OpCase) -> List[Row]:
    """Every selected implementation: gate (on this case, or at p = 0 for a dropout case), then time."""
    refs = _References(ctx, oc.gate_case or oc)
    rows: List[Row] = []
    for impl in oc.impls:
        if not ctx.wants(impl.name):
            continue
        with compile_settings() if impl.name == TORCH_COMPILE else contextlib.nullcontext():
            rows += _run_impl(ctx, oc, impl, refs)
        free_memory()
    return rows


def _gate_key(oc: OpCase, impl: Impl) -> Tuple:
    return (oc.group, repr(sorted(oc.case.items())), impl.name)


def _gate(ctx: SuiteContext, oc: OpCase, impl: Impl,
          refs: _References) -> Tuple[str, str, Dict[str, Any], Optional[Prepared]]:
    """(status, reason, parity, the path it built) of an implementation on its case's inputs:
    "ok", "skipped" (cannot run here), "error" or FAILED PARITY. The verdict is remembered per
    case, so a dropout case reuses its p = 0 gate (the path is then None: not built again)."""
    from bertfast.dispatch import NoBackendError

    key = _gate_key(oc, impl)
    if key in ctx.gates:
        return (*ctx.gates[key], None)
    p = None
    try:
        p = impl.build(ctx.dtype)
        got = p.run_once()
    except NoBackendError as exc:
        result = ("skipped", short_error(exc), {})
    except Exception as exc:  # noqa: BLE001 - every failure becomes a visible row
        if impl.name == TORCH_COMPILE:
            ctx.note(f"torch.compile failed on this machine ({short_error(exc, 200)}); its rows are skipped")
            result = ("skipped", f"torch.compile cannot run here: {short_error(exc)}", {})
        elif impl.env_dependent:
            result = ("skipped", f"cannot run here: {short_error(exc)}", {})
        else:
            result = (ERROR, f"while checking parity: {short_error(exc)}", {})
    else:
        result = ("ok", "", {"gate": "not applicable (GEMMs only, not the op)"})
        if p.gated:
            gate = compare(got, *refs.get())
            result = ("ok" if gate.ok else FAILED_PARITY, gate.message, gate.to_dict())
            if not gate.ok:
                ctx.log(f"  {oc.group} {impl.name}: FAILED PARITY: {gate.message}")
        del got
    ctx.gates[key] = result
    return (*result, p)


def _run_impl(ctx: SuiteContext, oc: OpCase, impl: Impl, refs: _References) -> List[Row]:
    def all_rows(status: str, reason: str, parity=None) -> List[Row]:
        return [Row(SUITE, oc.group, dict(oc.case), d, impl.name, status=status, reason=reason,
                    parity=parity or {}, work=oc.work(d)) for d in oc.directions]

    if impl.skip:
        return [skipped(SUITE, oc.group, dict(oc.case), d, impl.name, impl.skip) for d in oc.directions]
    gate_case = oc.gate_case or oc
    sibling = next((i for i in gate_case.impls if i.name == impl.name), None)
    if sibling is None or sibling.skip:
        return all_rows("skipped", f"no gate: {impl.name} does not run at p = 0 on these inputs")
    status, reason, parity, gated = _gate(ctx, gate_case, sibling, refs)
    if oc.gate_case is not None:
        parity = {"gate": "p=0 on the same inputs (dropout masks are implementation-specific)", **parity}
        reason = reason and f"at p = 0: {reason}"
    if status != "ok":
        return all_rows(status, reason, parity)
    try:
        if oc.gate_case is None and gated is not None:
            p = gated  # the path the gate just checked
        else:
            p = impl.build(ctx.dtype)
        if oc.gate_case is not None:  # this path has not run with dropout yet
            p.run_once()
    except Exception as exc:  # noqa: BLE001
        if impl.env_dependent or impl.name == TORCH_COMPILE:
            return all_rows("skipped", f"cannot run here with these settings: {short_error(exc)}", parity)
        return all_rows(ERROR, f"while building: {short_error(exc)}", parity)
    rows: List[Row] = []
    for direction in oc.directions:
        work = oc.work(direction)
        try:
            t, method, host, mem = _time_direction(ctx, p, direction)
        except Exception as exc:  # noqa: BLE001
            rows.append(Row(SUITE, oc.group, dict(oc.case), direction, impl.name, status=ERROR,
                            reason=f"while timing: {short_error(exc)}", parity=parity, work=work))
            continue
        metrics = metrics_for(ctx, t, work)
        if host is not None:
            metrics["host_us"] = host
        rows.append(Row(SUITE, oc.group, dict(oc.case), direction, impl.name, time_ms=t, metrics=metrics,
                        memory=mem, parity=parity, work=work, timing=method))
        ctx.log(f"  {oc.group} {direction:8s} {impl.name:28s} {t.median:9.4f} ms")
    return rows


def _skipped_case(ctx: SuiteContext, oc: OpCase, reason: str) -> List[Row]:
    return [skipped(SUITE, oc.group, dict(oc.case), d, impl.name, reason)
            for impl in oc.impls if ctx.wants(impl.name) for d in oc.directions]


def run(ctx: SuiteContext) -> List[Row]:
    if not ctx.device.is_cuda:
        ctx.note("kernel suite on CPU: tiny shapes, fp32; bertfast:triton runs only under TRITON_INTERPRET=1 "
                 "(the Triton interpreter), bertfast:cuda needs a GPU")
    ctx.note("kernel suite: params=act puts the parameters in the activation dtype, params=fp32 keeps them in "
             "fp32 (autocast); a dropout case is timed only for implementations that passed the gate on the same "
             "inputs at p = 0; fwd = forward under no_grad, bwd = autograd.grad on a retained graph, fwd+bwd = both")
    ctx.note("mlm_head_loss_decoder / mlm_head_loss: bertfast computes the gradients inside the forward pass, so they "
             "have fwd (no grad) and fwd+bwd rows only; TFLOP/s counts the labelled rows' GEMMs for every "
             "implementation (the full-sequence head does more work for the same result)")
    rows: List[Row] = []
    for op in OPS:
        if ctx.ops is not None and op not in ctx.ops:
            continue
        ctx.log(f"[kernels] {op}")
        cases = [oc for oc in CASE_BUILDERS[op](ctx) if ctx.wants_case(oc.case)]
        for i, oc in enumerate(cases):
            if ctx.budget_spent():
                ctx.log(f"  time budget spent: {len(cases) - i} {op} case(s) not run")
                for rest in cases[i:]:
                    rows += _skipped_case(ctx, rest, ctx.budget_reason())
                break
            rows += run_case(ctx, oc)
            free_memory()
    return rows
