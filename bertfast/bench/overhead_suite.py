"""Overhead suite: microseconds of host time per call of each public op, on tiny inputs.

With inputs this small the device work is negligible, so what a call costs is its Python and
dispatcher time: input checks, the backend choice (``bertfast.dispatch.select``), the
torch.library custom op, autograd. For every op the suite times, on the same inputs:

  select    ``dispatch.select`` alone, with the inputs the op passes it (impl ``bertfast:<backend>``):
            a cached choice after the first call;
  decide    the same choice made afresh, without the cache (what a cache miss costs, and what
            every call cost before the cache);
  fwd       the op's forward under no_grad, and the plain-PyTorch math of the op (``torch eager``);
  fwd+bwd   forward with grad, then ``torch.autograd.grad``, for both; and the bertfast op once more
            through its torch.library custom ops (impl ``bertfast:<backend> custom op``), the way
            every training call went before ``ops._common.FusedOp``'s eager path: the difference
            is what that path saves a call.

The bertfast path runs the backend that dispatch picks by default (torch on CPU, a fused one
on a GPU), so the difference between its row and the torch eager row is the op's overhead.

How: after warm-up calls, ``calls`` calls back to back between two ``time.perf_counter``
readings, no synchronisation inside; on a GPU one ``torch.cuda.synchronize`` after each sample,
outside the timed region (so the launch queue never fills). The figure is host µs per call
(median, p20, p80 over the samples); on a GPU it leaves out the device time, on a CPU it is all
of it. Before timing, the bertfast forward is compared with the torch eager one (a loose check:
the kernel suite's gate is the strict one); a mismatch becomes a FAILED PARITY row.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from bertfast import dispatch, registry
from bertfast import ops as bf
from bertfast.bench.common import Stopped, SuiteContext, dtype_name, short_error
from bertfast.bench.results import ERROR, FAILED_PARITY, TORCH_EAGER, Row, bertfast_impl, skipped
from bertfast.bench.timing import Stat, summarize
from bertfast.ops import _common

SUITE = "overhead"
SELECT, DECIDE, FWD, FWD_BWD = "select", "decide", "fwd", "fwd+bwd"
DIRECTIONS = (SELECT, DECIDE, FWD, FWD_BWD)
HOST_LOOP = "host perf_counter, back to back, no sync in the loop"
CUSTOM_OP = "custom op"  # the variant of the bertfast impl timed through the torch.library custom ops
EPS = 1e-12

Tensor = torch.Tensor


@dataclass
class OverheadCase:
    """One op on tiny inputs: how dispatch is asked, the op, and its plain-PyTorch equivalent."""

    op: str  # the public name (bertfast.ops.<op>)
    dispatch_op: str  # the name dispatch knows it by
    case: Dict[str, object]
    select_inputs: Dict[str, Optional[Tensor]]  # what the op passes dispatch.select
    leaves: List[Tensor]  # the inputs that take gradients
    bertfast: Callable[[], Tensor]
    eager: Callable[[], Tensor]


def _timing_counts(ctx: SuiteContext):
    """(warm-up calls, calls per sample, samples); on a CPU, ``--reps`` samples (at least 3)."""
    if ctx.device.is_cuda:
        return 20, 200, 10
    return 10, 50, max(3, ctx.policy.cpu_reps)


def host_us_per_call(fn: Callable[[], object], device: torch.device, calls: int, samples: int,
                     warmup: int) -> Stat:
    """Host microseconds per call of ``fn``: ``calls`` calls per timed sample, no sync inside it."""
    cuda = torch.device(device).type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    sync()
    values = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        values.append((time.perf_counter() - t0) / calls * 1e6)
        sync()  # outside the timed region: the device catches up before the next sample
    return summarize(values)


# --------------------------------------------------------------------------- the cases
def _randn(gen: torch.Generator, *shape, dtype, device, grad=False, scale=1.0) -> Tensor:
    t = (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)
    return t.requires_grad_(grad)


def bias_gelu_case(gen, dtype, dev) -> OverheadCase:
    n, h = 8, 64
    x, b = _randn(gen, n, h, dtype=dtype, device=dev, grad=True), _randn(gen, h, dtype=dtype, device=dev, grad=True)
    return OverheadCase("bias_gelu", "bias_gelu", {"rows": n, "h": h}, {"x": x, "bias": b}, [x, b],
                        lambda: bf.bias_gelu(x, b), lambda: F.gelu(x + b))


def bias_dropout_residual_layernorm_case(gen, dtype, dev) -> OverheadCase:
    n, h = 8, 64
    x, b, res = (_randn(gen, *s, dtype=dtype, device=dev, grad=True) for s in ((n, h), (h,), (n, h)))
    w = (1.0 + _randn(gen, h, dtype=dtype, device=dev, scale=0.1)).requires_grad_(True)
    lb = _randn(gen, h, dtype=dtype, device=dev, grad=True)
    return OverheadCase(
        "bias_dropout_residual_layernorm", "bias_dropout_residual_layernorm", {"rows": n, "h": h, "dropout": 0.0},
        {"x": x, "bias": b, "residual": res, "weight": w, "ln_bias": lb}, [x, b, res, w, lb],
        lambda: bf.bias_dropout_residual_layernorm(x, b, res, w, lb, EPS),
        lambda: F.layer_norm(res + (x + b), (h,), w, lb, EPS))


def embeddings_case(gen, dtype, dev) -> OverheadCase:
    t, h, vocab, positions = 8, 64, 32, 16
    ids = torch.randint(0, vocab, (t,), generator=gen).to(dev)
    pids = torch.arange(t).to(dev)
    tids = torch.randint(0, 2, (t,), generator=gen).to(dev)
    word, pos, tt = (_randn(gen, rows, h, dtype=dtype, device=dev, grad=True) for rows in (vocab, positions, 2))
    w = (1.0 + _randn(gen, h, dtype=dtype, device=dev, scale=0.1)).requires_grad_(True)
    lb = _randn(gen, h, dtype=dtype, device=dev, grad=True)
    return OverheadCase(
        "embeddings", "embeddings", {"tokens": t, "h": h, "vocab": vocab},
        {"input_ids": ids, "word": word, "pos": pos, "token_type": tt, "ln_weight": w, "ln_bias": lb},
        [word, pos, tt, w, lb],
        lambda: bf.embeddings(ids, pids, tids, word, pos, tt, w, lb, EPS),
        lambda: F.layer_norm(F.embedding(ids, word) + F.embedding(pids, pos) + F.embedding(tids, tt), (h,), w, lb, EPS))


def attention_varlen_case(gen, dtype, dev) -> OverheadCase:
    lengths, heads, d = (3, 5), 2, 16
    t = sum(lengths)
    qkv = _randn(gen, t, 3, heads, d, dtype=dtype, device=dev, grad=True)
    cu = torch.tensor([0, lengths[0], t], dtype=torch.int32, device=dev)
    # The plain-PyTorch equivalent: SDPA over the packed tokens with a block-diagonal mask (built once).
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(dev)
    same = (seq[:, None] == seq[None, :])[None, None]

    def eager() -> Tensor:
        q, k, v = (u.transpose(0, 1)[None] for u in qkv.unbind(1))  # [1, A, T, D]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=same)[0].transpose(0, 1)

    return OverheadCase("attention_varlen", "attention_varlen",
                        {"tokens": t, "seqs": len(lengths), "heads": heads, "head_dim": d},
                        {"q": qkv, "cu_seqlens": cu}, [qkv],
                        lambda: bf.attention_varlen(qkv, cu, max(lengths)), eager)


def attention_padded_case(gen, dtype, dev) -> OverheadCase:
    b, s, heads, d = 2, 5, 2, 16
    q, k, v = (_randn(gen, b, s, heads, d, dtype=dtype, device=dev, grad=True) for _ in range(3))
    mask = torch.tensor([[1] * s, [1] * 3 + [0] * (s - 3)], dtype=torch.bool, device=dev)
    key_mask = mask[:, None, None, :]

    def eager() -> Tensor:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=key_mask)
        return out.transpose(1, 2)

    return OverheadCase("attention", "attention_padded", {"batch": b, "seqlen": s, "heads": heads, "head_dim": d},
                        {"q": q, "k": k, "v": v, "key_padding_mask": mask}, [q, k, v],
                        lambda: bf.attention(q, k, v, mask), eager)


def mlm_head_loss_case(gen, dtype, dev) -> OverheadCase:
    b, s, h, vocab = 2, 4, 64, 32
    hidden = _randn(gen, b, s, h, dtype=dtype, device=dev, grad=True)
    labels = torch.randint(0, vocab, (b, s), generator=gen)
    labels[:, ::2] = -100
    labels = labels.to(dev)
    dw = _randn(gen, h, h, dtype=dtype, device=dev, grad=True, scale=h ** -0.5)
    db, lb = _randn(gen, h, dtype=dtype, device=dev, grad=True), _randn(gen, h, dtype=dtype, device=dev, grad=True)
    lw = (1.0 + _randn(gen, h, dtype=dtype, device=dev, scale=0.1)).requires_grad_(True)
    decw = _randn(gen, vocab, h, dtype=dtype, device=dev, grad=True, scale=h ** -0.5)
    decb = _randn(gen, vocab, dtype=dtype, device=dev, grad=True)
    leaves = [hidden, dw, db, lw, lb, decw, decb]
    # What the op passes dispatch for its decoder stage (its GELU and LayerNorm stages dispatch too).
    rows = hidden.detach().reshape(-1, h)[: b * s // 2]
    picked = labels.reshape(-1)[: b * s // 2]

    def eager() -> Tensor:
        flat = labels.reshape(-1)
        picked_rows = hidden.reshape(-1, h)[flat != -100]
        x = F.layer_norm(F.gelu(F.linear(picked_rows, dw, db)), (h,), lw, lb, EPS)
        return F.cross_entropy(F.linear(x, decw, decb).float(), flat[flat != -100])

    return OverheadCase("mlm_head_loss", "mlm_head_loss", {"batch": b, "seqlen": s, "h": h, "vocab": vocab},
                        {"x": rows, "weight": decw, "bias": decb, "labels": picked}, leaves,
                        lambda: bf.mlm_head_loss(hidden, labels, dw, db, lw, lb, EPS, decw, decb).loss, eager)


def case_builders() -> Dict[str, Callable[[torch.Generator, torch.dtype, torch.device], OverheadCase]]:
    """Every case name -> its builder, as bertfast.registry lists them (each op's ``overhead``), in its order."""
    return registry.functions("overhead")


# --------------------------------------------------------------------------- running
def _grad_step(forward: Callable[[], Tensor], leaves: Sequence[Tensor]) -> Callable[[], None]:
    def step() -> None:
        out = forward()
        torch.autograd.grad(out, leaves, torch.ones_like(out))
    return step


def _through_custom_ops(step: Callable[[], None]) -> Callable[[], None]:
    def through() -> None:
        before, _common.EAGER_FUNCTIONS = _common.EAGER_FUNCTIONS, False
        try:
            step()
        finally:
            _common.EAGER_FUNCTIONS = before
    return through


def _no_grad(forward: Callable[[], Tensor]) -> Callable[[], None]:
    def fwd() -> None:
        with torch.no_grad():
            forward()
    return fwd


def _check(oc: OverheadCase, dtype: torch.dtype) -> Optional[str]:
    """None when the bertfast forward matches the plain-PyTorch one (loosely), else the mismatch."""
    with torch.no_grad():
        got, want = oc.bertfast().float(), oc.eager().float()
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    if got.shape != want.shape or not torch.allclose(got, want, atol=tol, rtol=tol):
        worst = (got - want).abs().max().item() if got.shape == want.shape else math.nan
        return f"bertfast {tuple(got.shape)} vs torch eager {tuple(want.shape)}: max |diff| {worst:.3g} > {tol}"
    return None


def _row(ctx: SuiteContext, oc: OverheadCase, direction: str, impl: str, host: Stat) -> Row:
    ctx.log(f"  {oc.op:32s} {direction:8s} {impl:16s} {host.median:9.1f} us/call")
    return Row(SUITE, oc.op, dict(oc.case), direction, impl, time_ms=host.scaled(1e-3), metrics={"host_us": host},
               timing=HOST_LOOP)


def _plans(oc: OverheadCase, backend: str) -> List[Tuple[str, str, Callable[[], object]]]:
    """A case's rows in order: (direction, impl, what is timed), for the backend dispatch chose."""
    ours = bertfast_impl(backend)
    return [(SELECT, ours, lambda: dispatch.select(oc.dispatch_op, **oc.select_inputs)),
            (DECIDE, ours, lambda: dispatch._select(oc.dispatch_op, dispatch.forced_backend(oc.dispatch_op),
                                                    **oc.select_inputs)),
            (FWD, ours, _no_grad(oc.bertfast)), (FWD, TORCH_EAGER, _no_grad(oc.eager)),
            (FWD_BWD, ours, _grad_step(oc.bertfast, oc.leaves)),
            (FWD_BWD, TORCH_EAGER, _grad_step(oc.eager, oc.leaves)),
            (FWD_BWD, bertfast_impl(backend, CUSTOM_OP), _through_custom_ops(_grad_step(oc.bertfast, oc.leaves)))]


def run_case(ctx: SuiteContext, oc: OverheadCase) -> List[Row]:
    dev = ctx.torch_device
    warmup, calls, samples = _timing_counts(ctx)
    try:
        chosen = dispatch.select(oc.dispatch_op, **oc.select_inputs)
    except Exception as exc:  # noqa: BLE001 - a visible row, not a crash
        return [Row(SUITE, oc.op, dict(oc.case), d, bertfast_impl("?"), status=ERROR,
                    reason=f"dispatch.select: {short_error(exc)}") for d in DIRECTIONS]
    ours = bertfast_impl(chosen)
    try:
        mismatch = _check(oc, ctx.dtype)
    except Exception as exc:  # noqa: BLE001
        return [Row(SUITE, oc.op, dict(oc.case), d, ours, status=ERROR, reason=f"while checking: {short_error(exc)}")
                for d in DIRECTIONS]
    rows: List[Row] = []
    for direction, impl, fn in _plans(oc, chosen):
        if not ctx.wants(impl):
            continue
        if mismatch and impl.startswith(ours) and direction not in (SELECT, DECIDE):
            rows.append(Row(SUITE, oc.op, dict(oc.case), direction, impl, status=FAILED_PARITY, reason=mismatch))
            continue
        try:
            rows.append(_row(ctx, oc, direction, impl, host_us_per_call(fn, dev, calls, samples, warmup)))
        except Exception as exc:  # noqa: BLE001
            rows.append(Row(SUITE, oc.op, dict(oc.case), direction, impl, status=ERROR,
                            reason=f"while timing: {short_error(exc)}"))
    return rows


def run(ctx: SuiteContext) -> List[Row]:
    warmup, calls, samples = _timing_counts(ctx)
    ctx.note(f"overhead suite: host microseconds per call on tiny inputs ({ctx.device.kind}, "
             f"{dtype_name(ctx.dtype)}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads): "
             f"{samples} samples of {calls} back-to-back calls after {warmup} warm-up calls, no synchronisation "
             "in the timed loop; select = dispatch.select alone (cached), decide = the same choice without the "
             "cache, fwd under no_grad, fwd+bwd = forward + "
             "autograd.grad; bertfast runs the backend dispatch picks by default ('custom op': fwd+bwd through "
             "the torch.library custom ops, not the eager autograd.Function)"
             + ("" if ctx.device.is_cuda else "; on a CPU the figures include the (tiny) compute"))
    rows: List[Row] = []
    for op, builder in case_builders().items():
        if ctx.ops is not None and op not in ctx.ops:
            continue
        if ctx.budget_spent():
            ctx.log(f"  time budget spent: overhead case {op} not run")
            continue
        ctx.log(f"[overhead] {op}")
        gen = torch.Generator().manual_seed(0)
        oc = builder(gen, ctx.dtype, ctx.torch_device)
        oc.case["dtype"] = dtype_name(ctx.dtype)
        if not ctx.wants_case(oc.case):
            continue
        try:
            case_rows = run_case(ctx, oc)
        except Stopped as stop:  # dispatch's choice may not be known yet: bertfast:?
            ctx.record([skipped(SUITE, oc.op, dict(oc.case), d, impl, stop.reason(running=True))
                        for d, impl, _ in _plans(oc, "?") if ctx.wants(impl)])
            raise
        rows += ctx.record(case_rows)
    return rows
