"""The kernel suite's cases: for every fused op, the shapes (BERT-base/large sizes on a GPU,
tiny ones on CPU), the inputs, the reference and the implementations compared.

Implementations: ``bertfast:<backend>`` (the public op under ``bertfast.ops.use_backend``),
``torch eager`` (the reference math: what a plain PyTorch model runs), ``torch.compile`` of
that same math, and for attention torch SDPA with the flash backend (equal-length batches
only: it takes no mask), the memory-efficient backend (with the padding mask) and the cuDNN
backend. The MLM head adds the transformers-style full-sequence head and its GEMM floor.
The optimizer steps (adamw, lamb; direction ``step``) are bertfast/bench/optimizer_cases.py's, on this
module's OpCase, Impl and OptimizerStep.

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
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from bertfast import reference, registry
from bertfast.bench import flops as W
from bertfast.bench.common import (SuiteContext, compile_skip_reason, cu_seqlens, describe_lengths, dtype_name,
                                   generator_for, mask_from, sequence_lengths)
from bertfast.bench.results import (FULL_HEAD, GEMM_FLOOR, SDPA_CUDNN, SDPA_FLASH, SDPA_MEM_EFFICIENT, TORCH_COMPILE,
                                    TORCH_EAGER, bertfast_impl)
from bertfast.contract import checks_on_device

Tensor = torch.Tensor
SUITE = "kernels"
ALL_DIRECTIONS = ("fwd", "bwd", "fwd+bwd")
STEP = "step"  # the optimizer cases' one direction: one optimizer step
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
    # entered around every forward and backward of the path (the attention's atomic dQ: its backward reads
    # BERTFAST_ATTENTION_DQ when it runs)
    context: Callable[[], ContextManager] = contextlib.nullcontext

    def run_once(self) -> Dict[str, Tensor]:
        with self.context():
            out = self.forward()
            grads = torch.autograd.grad(out, self.leaves, self.grad_out, allow_unused=True)
        return {k: v.detach().float() for k, v in self.canon(out.detach(), grads).items()}


@dataclass
class OptimizerStep(Prepared):
    """An optimizer path: ``forward`` runs one step. Its outputs are each parameter's change in
    units of the learning rate (``canon`` names the parameters): the weights themselves barely
    move in one step, so comparing them would let a wrong update through the gate."""

    lr: float = 1.0

    def run_once(self) -> Dict[str, Tensor]:
        before = {k: v.detach().double() for k, v in self.canon(None, ()).items()}  # fp64: exact differences
        self.forward()
        return {f"{k} step/lr": ((v.detach().double() - before[k]) / self.lr).float()
                for k, v in self.canon(None, ()).items()}


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
                   variant: str = "", backends: Optional[Sequence[str]] = None,
                   context: Optional[Callable[[], ContextManager]] = None) -> List[Impl]:
    """One impl per requested bertfast backend (of ``backends``, when given), the builder run under
    use_backend({op: backend}), its forward and backward inside ``context`` (Prepared.context)."""
    from bertfast.ops import use_backend

    impls = []
    for backend in ctx.backends if backends is None else [b for b in backends if b in ctx.backends]:
        inner = make()

        def build(dtype, inner=inner, backend=backend):
            p = inner(dtype)
            forward = p.forward

            def forced():
                with use_backend({op: backend for op in op_names}):
                    return forward()
            p.forward = forced
            if context is not None:
                p.context = context
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
    """Head dim 64 first (BERT's), each at p = 0 and, where listed, again with dropout. On a GPU the
    issue's target comes first (BERT-large's 16 heads at seq 512: equal lengths against SDPA flash and
    cuDNN, then pre-training padding against SDPA memory-efficient with its mask), so a --time-budget
    that cuts the list still times it; then BERT-base's seq 512, then seq 128, then other head dims."""
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
        shapes = [(32, 512, 16, 64), (32, 512, 12, 64), (128, 128, 16, 64), (128, 128, 12, 64),
                  (128, 128, 8, 128), (32, 512, 8, 128), (128, 128, 32, 32), (32, 512, 32, 32)]
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


def _atomic_dq_impls(ctx: SuiteContext, seqlen: int, varlen_path: Callable[[], Builder]) -> List[Impl]:
    """``bertfast:triton varlen atomic-dq``: the varlen path with the Triton backward's atomic dQ
    (BERTFAST_ATTENTION_DQ=atomic, kernels/attention.py), where the sequences are longer than the one-pass
    backward takes (elsewhere it is the same kernels as ``bertfast:triton varlen``)."""
    if "triton" not in ctx.backends:
        return []
    try:
        from bertfast.kernels.attention import FUSED_BWD_MAX_SEQLEN, using_dq
    except ImportError:  # no Triton: the triton rows say why
        return []
    if seqlen <= FUSED_BWD_MAX_SEQLEN[ctx.dtype == torch.float32]:
        return []
    return _backend_impls(ctx, ["attention_varlen"], varlen_path, "varlen atomic-dq", ["triton"],
                          lambda: using_dq("atomic"))


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
    impls += _atomic_dq_impls(ctx, seqlen, varlen_path)
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


def _ffn_reference(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor) -> Tensor:
    return F.linear(reference.bias_gelu(F.linear(x, w1), b1), w2)


def _ffn_fast(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor) -> Tensor:
    """The FFN as the encoder trains it: one node with the bias and GELU in its GEMMs where the
    backend has them (bertfast.model.residual_linear.ffn), else GEMM, the bias_gelu op, GEMM."""
    from bertfast import ops
    from bertfast.model import residual_linear
    gemms = residual_linear.ffn_gemms(x, w1, b1, w2)
    if gemms is not None:
        return residual_linear.ffn(x, w1, b1, w2, "none", gemms)[0]
    return F.linear(ops.bias_gelu(F.linear(x, w1), b1), w2)


def ffn_cases(ctx: SuiteContext) -> List[OpCase]:
    """BERT's FFN before its output bias (which the LayerNorm op takes): GELU(x W1^T + b1) W2^T, the
    weights in the activations' dtype as the optimizer's working copies are. ``bertfast:<backend>``
    runs bias_gelu on that backend: on Triton inside the GEMMs, on the others after cuBLAS's GEMM."""
    dev, out = ctx.torch_device, []
    for n, h, f in _row_shapes(ctx, [(16384, 1024, 4096), (16384, 768, 3072)], [(16384, 1024, 4096)], [(64, 32, 128)]):
        gen = generator_for("ffn", n, h, f)
        data = {"x": torch.randn(n, h, generator=gen), "w1": torch.randn(f, h, generator=gen) / math.sqrt(h),
                "b1": torch.randn(f, generator=gen), "w2": torch.randn(h, f, generator=gen) / math.sqrt(f)}
        data = {k: v.to(dev) for k, v in data.items()}
        dy = torch.randn(n, h, generator=gen).to(dev)

        def make(fn, data=data, dy=dy):
            return lambda dtype: _simple(fn, ["x", "w1", "b1", "w2"], data, dtype, dy)
        impls = _backend_impls(ctx, ["bias_gelu"], lambda make=make: make(_ffn_fast))
        impls.append(Impl(TORCH_EAGER, make(_ffn_reference)))
        impls.append(_compile_impl(ctx, _ffn_reference, make))
        out.append(OpCase("ffn", {"tokens": n, "hidden": h, "features": f, "dtype": dtype_name(ctx.dtype)},
                          make(_ffn_reference), impls,
                          lambda d, n=n, h=h, f=f: {"flops": W.ffn_flops(n, h, f, d)}))
    return out


def bias_dropout_residual_layernorm_cases(ctx: SuiteContext) -> List[OpCase]:
    """BERT's residual LayerNorm: p = 0 for each shape and parameter mode, then with dropout."""
    dev, out = ctx.torch_device, []
    names = ["x", "bias", "residual", "weight", "ln_bias"]
    for n, h in _row_shapes(ctx, [(16384, 1024), (16384, 768), (4096, 768)], [(16384, 1024)], [(64, 32)]):
        gen = generator_for("bias_dropout_residual_layernorm", n, h)
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
        # the rows each table's gather reads from DRAM: its distinct ids' (flops.embeddings_bytes)
        distinct = tuple(int(ids[name].unique().numel()) for name in ("input_ids", "position_ids", "token_type_ids"))
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
                              lambda d, t=t, h=h, vocab=vocab, positions=positions, act=act, par=par,
                              distinct=distinct: {
                                  "bytes": W.embeddings_bytes(t, h, vocab, positions, 2, 8, par, act, d, distinct)}))
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
        # the labels' range checked on the device, as a training step checks them: no host read in the call
        impls = _backend_impls(ctx, ["mlm_head_loss"], lambda make=make: make(ops_fn), context=checks_on_device)
        impls.append(Impl(TORCH_EAGER, make(eager)))
        impls.append(_compile_impl(ctx, eager, make))
        out.append(OpCase("mlm_head_loss_decoder", {"rows": m, "hidden": h, "vocab": vocab,
                                                   "dtype": dtype_name(ctx.dtype)},
                          make(eager), impls,
                          lambda d, m=m, h=h, vocab=vocab: {"flops": W.mlm_head_loss_decoder_flops(m, h, vocab, d)},
                          directions=GRAD_IN_FORWARD))
    return out


def mlm_predictions_per_seq(seqlen: int) -> int:
    """The MLM head case's labelled positions in each sequence: BERT's 15% of a full one, rounded."""
    return max(1, round(0.15 * seqlen))


@contextlib.contextmanager
def _fused_head():
    """``bertfast:triton fused``: the decoder's GEMMs with the loss inside them
    (BERTFAST_MLM_HEAD=fused, ops/mlm_head_loss.py), its checks on the device as the other rows'."""
    from bertfast.ops.mlm_head_loss import using_head_mode
    with checks_on_device(), using_head_mode("fused"):
        yield


def mlm_head_loss_cases(ctx: SuiteContext) -> List[OpCase]:
    dev, out = ctx.torch_device, []
    names = ["hidden", "dense_w", "dense_b", "ln_w", "ln_b", "decoder_w", "decoder_b"]
    for model, batch, seqlen, h, vocab in _row_shapes(
            ctx, [("bert-base", 128, 128, 768, 30522), ("bert-large", 128, 128, 1024, 30522)],
            [("bert-base", 64, 128, 768, 30522)], [("tiny", 2, 16, 32, 100)]):
        gen = generator_for("mlm_head_loss", batch, seqlen, h, vocab)
        tokens = batch * seqlen
        # BERT's masking labels round(15%) of a full sequence's tokens (data/masking.py): k in each, so the op
        # takes its static gather (max_predictions_per_seq=k) with its checks on the device, as a pre-training
        # step runs it. The call then waits on nothing, and its time queued ahead of the host is the device's.
        k = mlm_predictions_per_seq(seqlen)
        m = batch * k
        labels = torch.full((batch, seqlen), reference.IGNORE_INDEX, dtype=torch.long)
        labels.scatter_(1, torch.rand(batch, seqlen, generator=gen).argsort(1)[:, :k],
                        torch.randint(0, vocab, (batch, k), generator=gen))
        labels = labels.to(dev)
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

        def ops_fn(hidden, dw, db, lw, lb, decw, decb, labels, k=k):
            from bertfast.ops import mlm_head_loss
            return mlm_head_loss(hidden, labels, dw, db, lw, lb, EPS, decw, decb, max_predictions_per_seq=k).loss

        def floor(dtype, data=data, m=m, h=h, vocab=vocab):
            """The head's GEMMs alone at the labelled rows: transform dense + decoder, fwd and bwd (cuBLAS),
            over the vocabulary padded to whole 16-byte rows as the op pads it (at BERT's 30522 cuBLAS runs
            slower kernels: ops.mlm_head_loss.padded_vocab). Every loop value it reads is bound here: a
            later case must not see this one's sizes."""
            from bertfast.ops.mlm_head_loss import padded_vocab
            padded = padded_vocab(vocab, torch.empty((), dtype=dtype).element_size())
            g = generator_for("mlm_floor", m, h, vocab)
            rows = torch.randn(m, h, generator=g).to(dev, dtype).requires_grad_(True)
            dw = _leaf(data["dense_w"], dtype)
            decw = _leaf(F.pad(data["decoder_w"], (0, 0, 0, padded - vocab)), dtype)
            dlogits = torch.randn(m, padded, generator=g).to(dev, dtype)
            return Prepared([rows, dw, decw], lambda: (rows @ dw.t()) @ decw.t(), dlogits,
                            lambda o, grads: {}, gated=False)

        head_ops = ["bias_gelu", "bias_dropout_residual_layernorm", "mlm_head_loss"]
        impls = _backend_impls(ctx, head_ops, lambda make=make: make(ops_fn), context=checks_on_device)
        impls += _backend_impls(ctx, head_ops, lambda make=make: make(ops_fn), "fused", ["triton"], _fused_head)
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


def case_builders() -> Dict[str, Callable[[SuiteContext], List[OpCase]]]:
    """Every case name -> its builder, as bertfast.registry lists them (each op's ``bench``), in its order."""
    return registry.functions("bench")
