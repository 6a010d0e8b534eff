"""A GEMM whose input is also a residual: one autograd node for both uses, so the input's two
gradients are summed by the input-gradient GEMM instead of by a kernel of their own.

In a post-LN BERT layer the layer input x feeds the QKV GEMM and, as the residual, the LayerNorm
after attention; that LayerNorm's output h feeds the FFN's first GEMM and, as the residual, the
LayerNorm after the FFN. Under plain autograd each gets two gradients, the LayerNorm backward's
and dy @ W, which the engine adds in an [N, H] pass of its own (reads two, writes one: 12 bytes an
element in bf16, twice a layer: 1.6 ms of a BERT-large step as docs/perf-model.md predicts it for
an H100). ``linear`` returns
y = x @ W^T (+ b) and x again as outputs of one node, so its backward receives both gradients
and forms dx with one addmm (beta = 1): the GEMM reads the residual's gradient in its epilogue. It
adds into that gradient in place where the op that made it handed it over (bertfast.ops._common
hand_over: the LayerNorm op's, with dropout); torch.addmm would first copy it into a new output.

Autocast is honoured as F.linear would be (floating inputs cast to the autocast dtype, the
weights' casts made once and saved for the backward, as autocast's own cast would be); the
backward runs in the dtypes the forward saved. Parameter gradients come back in each parameter's
dtype; the bias gradient is summed in fp32. Several weights (the query, key and value) run as one
GEMM, each cast into its rows of one buffer (no concatenation after the casts). The weight
gradient of fp32 weights under bf16 or fp16 autocast comes from an fp32-out GEMM where the device
has one (CUDA: cuBLAS accumulates in fp32 anyway), not rounded to bf16 and then cast back by
autograd in a pass of its own (6 bytes a parameter; on the H100 that cast ran at half the copy
bandwidth). Where the optimizer keeps bf16 working copies of the weights
(bertfast.model.working_weights), the forward reads them instead of casting. ``dense`` is the same node
for a GEMM whose input is no residual (the attention's and the FFN's output projections), for its
weight gradient.

``ffn`` is one node for the whole FFN before its output bias, GELU(x @ W1^T + b1) @ W2^T, keeping x
as the residual too, where the bias_gelu op's backend has GEMMs with that op's math in their
epilogues (gemm_bias_gelu_fwd and gemm_gelu_bwd: Triton's): the up-projection writes GELU's input
and output from its accumulator, and the backward's dy @ W2 multiplies by GELU' as it stores, so the
bias_gelu row kernel's passes over the [N, 4H] activations go.

Gradient accumulation (``weight_grads_added_in_place``, which ``training.TrainStep`` turns on in
one process): a weight that already holds a gradient (a global batch's second and later
micro-batches) has the new one added by its weight-gradient GEMM into that ``.grad``, in place
(beta = 1, fp32-out from bf16 operands where the device has it), not formed apart for autograd's
accumulation to add in a pass of its own (12 bytes a parameter: both read, the sum written).

Only for what is differentiated: with no gradient to record there is nothing to fold, and
``fused_qkv`` writes the QKV columns without concatenating weights.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from bertfast import dispatch
from bertfast.model import working_weights
from bertfast.ops._common import PLAIN_TYPES, fp32_gemm_caps, take_over

Tensor = torch.Tensor


def records_grad(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd will record an op on these tensors (grad mode on and one of them needs a gradient)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _compute_dtype(x: Tensor) -> Optional[torch.dtype]:
    """The dtype F.linear would compute in under the current autocast state (None: the inputs' own)."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _cast_dtype(t: Tensor, dtype: Optional[torch.dtype]) -> torch.dtype:
    # autocast casts floating tensors but fp64
    return dtype if dtype is not None and t.is_floating_point() and t.dtype != torch.float64 else t.dtype


def _cast(t: Tensor, dtype: Optional[torch.dtype]) -> Tensor:
    return t.to(_cast_dtype(t, dtype))


def _cast_cat(parts: Sequence[Tensor], dtype: Optional[torch.dtype]) -> Tensor:
    """The parts concatenated along dim 0, each cast as autocast would: one part cast alone, several
    cast straight into their rows of one buffer (no cast copies concatenated in a pass of their own)."""
    if len(parts) == 1:
        return _cast(parts[0], dtype)
    dtypes = {_cast_dtype(p, dtype) for p in parts}
    if len(dtypes) != 1:
        return torch.cat([_cast(p, dtype) for p in parts])
    out = parts[0].new_empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=dtypes.pop())
    for part, rows in zip(parts, out.split([p.shape[0] for p in parts])):
        rows.copy_(part)
    return out


def _cast_or_copy(parts: Sequence[Tensor], dtype: Optional[torch.dtype]) -> Tensor:
    """The parts concatenated and cast as autocast would: their working copy where the optimizer
    keeps a fresh one (bertfast.model.working_weights), else ``_cast_cat``."""
    copy = working_weights.lookup(parts, dtype)
    return copy if copy is not None else _cast_cat(parts, dtype)


def _weight_grad(dy: Tensor, x: Tensor, dtype: torch.dtype) -> Tensor:
    """dy^T @ x for a weight of ``dtype``: written in fp32 by the GEMM when the weight is fp32 and
    dy of lower precision on a device with fp32-out GEMMs (on plain tensors only, not while
    torch.compile traces or on fake tensors: the probe runs real GEMMs); else in dy's dtype, which
    autograd then casts to the weight's."""
    if (dtype == torch.float32 and dy.dtype in (torch.bfloat16, torch.float16)
            and not torch.compiler.is_compiling() and type(dy) in PLAIN_TYPES and type(x) in PLAIN_TYPES
            and fp32_gemm_caps(dy.device, dy.dtype)[1]):
        return _mm_fp32(dy.t(), x)
    return dy.t().mm(x)


def _mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b written in fp32 by the GEMM (fp32_gemm_caps says the device has it)."""
    out = torch.empty((a.shape[0], b.shape[1]), dtype=torch.float32, device=a.device)
    return torch.mm(a, b, out_dtype=torch.float32, out=out)


# ------------------------------------------------------------------ weight gradients added in place
_ADD_INTO_GRADS = False  # module-wide, not per thread: CUDA backward passes run on autograd's device threads


@contextlib.contextmanager
def weight_grads_added_in_place(enabled: bool = True) -> Iterator[None]:
    """While on, a backward that accumulates into the parameters (``loss.backward()``; not
    ``torch.autograd.grad``, which hands gradients back) adds each GEMM weight's gradient into the
    ``.grad`` it already holds, in the weight-gradient GEMM (module note). Never for a weight a hook
    watches (``register_hook``, ``register_post_accumulate_grad_hook``: it would see no gradient).
    DDP's and FSDP's reducers hook the accumulation where Python cannot see it: the caller turns
    this on only without them."""
    global _ADD_INTO_GRADS
    was, _ADD_INTO_GRADS = _ADD_INTO_GRADS, enabled
    try:
        yield
    finally:
        _ADD_INTO_GRADS = was


def _grad_to_add_into(param: Tensor, dy: Tensor) -> Optional[Tensor]:
    """The ``.grad`` this backward adds ``param``'s weight gradient into (weight_grads_added_in_place),
    or None: the gradient goes back to autograd."""
    if not _ADD_INTO_GRADS or not param.is_leaf or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    grad = param.grad
    hooked = param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None)
    if (grad is None or hooked or type(grad) not in PLAIN_TYPES or grad.shape != param.shape
            or grad.dtype != param.dtype or not grad.is_contiguous()):
        return None
    if grad.dtype != dy.dtype and not (grad.dtype == torch.float32 and type(dy) in PLAIN_TYPES
                                       and fp32_gemm_caps(dy.device, dy.dtype)[0]):
        return None
    try:
        accumulates = torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(param).node)
    except RuntimeError:  # torch.autograd.grad (it asks this of no leaf): nothing is accumulated
        return None
    return grad if accumulates else None


def _weight_grads(dy: Tensor, x: Tensor, weights: Sequence[Tensor], needed: Sequence[bool]) -> List[Optional[Tensor]]:
    """Each weight's gradient, dy^T @ x split by its rows (None where not needed), or, where every
    needed weight holds a ``.grad`` to add into (weight_grads_added_in_place), each added there by a
    GEMM of its own (its columns of dy) and None handed back."""
    out_features = [w.shape[0] for w in weights]
    into = [_grad_to_add_into(w, dy) if need else None for w, need in zip(weights, needed)]
    if all(g is not None for g, need in zip(into, needed) if need):
        for grad, dy_part in zip(into, dy.split(out_features, dim=1)):
            if grad is None:
                continue
            if grad.dtype == dy.dtype:
                grad.addmm_(dy_part.t(), x)
            else:
                torch.addmm(grad, dy_part.t(), x, out_dtype=grad.dtype, out=grad)
        return [None] * len(weights)
    dw = _weight_grad(dy, x, weights[0].dtype)
    parts = dw.split(out_features) if len(weights) > 1 else (dw,)
    return [part if need else None for part, need in zip(parts, needed)]


def weight_grad_summary() -> str:
    """One line for `bertfast info`: how the GEMM weights' gradients are written and accumulated under
    bf16 autocast on this machine's GPU (the fp32-out GEMM forms torch has there: fp32_gemm_caps)."""
    head = "GEMM weight gradients under bf16 autocast: "
    if not torch.cuda.is_available():
        return head + "no GPU here (fp32 training: written by the GEMM, added in place in TrainStep's accumulation)"
    can_addmm, can_mm = fp32_gemm_caps(torch.device("cuda"), torch.bfloat16)
    return (head + ("fp32 from fp32-out GEMMs" if can_mm else "bf16 GEMMs, cast to fp32 by autograd (this torch "
                    "has no fp32-out mm on CUDA)") + "; TrainStep's accumulation (one process): "
            + ("added in place by the weight-gradient GEMMs" if can_addmm else
               "added by autograd (this torch's CUDA addmm takes no fp32 input with bf16 operands)"))


def _input_grad(dy: Tensor, weight: Tensor, dres: Optional[Tensor], shape) -> Tensor:
    """dy @ weight (+ dres, the residual's gradient, summed by the GEMM) in ``shape``."""
    flat_res = None if dres is None else dres.reshape(-1, dres.shape[-1])
    if flat_res is None:
        dx = dy.mm(weight)
    elif flat_res.dtype == dy.dtype:  # the residual's gradient summed by the GEMM ...
        if take_over(dres):  # ... in place where its producer handed it over (no copy of it)
            dx = flat_res.addmm_(dy, weight)
        else:  # addmm copies flat_res into a new output first
            dx = torch.addmm(flat_res, dy, weight)
    else:  # an fp32 input under autocast: its gradient is fp32, the GEMM's bf16
        dx = flat_res + dy.mm(weight).to(flat_res.dtype)
    return dx.view(shape)


class _LinearKeepingInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, count: int, has_bias: bool, bias_grad: bool, *params: Tensor) -> Tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        dtype = _compute_dtype(x)
        weight = _cast_or_copy(params[:count], dtype)
        bias = _cast_or_copy(params[count:], dtype) if has_bias else None
        xc = _cast(x, dtype)
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(xc, weight, bias)
        ctx.save_for_backward(xc, weight)
        ctx.count, ctx.has_bias, ctx.out_features = count, has_bias, [w.shape[0] for w in params[:count]]
        ctx.bias_grad = bias_grad
        ctx.weights = params[:count]  # for their .grad, where the GEMM adds into it
        return y, x  # x as-is: autograd makes it a view whose gradient comes to this node

    @staticmethod
    def backward(ctx, dy: Optional[Tensor], dres: Optional[Tensor]):
        xc, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        count = ctx.count
        none: List[Optional[Tensor]] = [None] * (count * (2 if ctx.has_bias else 1))
        if dy is None:  # y unused: only the residual's gradient flows through
            return (dres if needs[0] else None, None, None, None, *none)
        dy = dy.reshape(-1, dy.shape[-1])
        with torch.autocast(dy.device.type, enabled=False):
            dx = _input_grad(dy, weight, dres, xc.shape) if needs[0] else None
            grads = list(none)
            weights_needed = needs[4:4 + count]
            if any(weights_needed):
                grads[:count] = _weight_grads(dy, xc.reshape(-1, xc.shape[-1]), ctx.weights, weights_needed)
            if ctx.has_bias and ctx.bias_grad and any(needs[4 + count:]):
                db = dy.sum(0, dtype=torch.float32)
                for i, part in enumerate(db.split(ctx.out_features) if count > 1 else (db,)):
                    grads[count + i] = part if needs[4 + count + i] else None
        return (dx, None, None, None, *grads)


def linear(x: Tensor, weights: Sequence[Tensor], biases: Optional[Sequence[Tensor]] = None,
           bias_grad: bool = True) -> Tuple[Tensor, Tensor]:
    """(x @ cat(weights)^T + cat(biases), x): the GEMM's output and x to use as the residual, whose
    gradient the backward adds in the input-gradient GEMM. ``biases`` None: no bias in the GEMM.
    bias_grad False: the biases' gradient is formed by the op that takes the output (the attention:
    bertfast.ops.attention_varlen's qkv_bias) and this node gives them none."""
    if biases is not None and len(biases) != len(weights):
        raise ValueError(f"residual_linear: expected one bias per weight ({len(weights)}), got {len(biases)}")
    params = list(weights) + (list(biases) if biases is not None else [])
    return _LinearKeepingInput.apply(x, len(weights), biases is not None, bias_grad, *params)


def dense(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x @ W^T (+ b) through the same node, its input no residual: for the weight gradient."""
    return linear(x, [weight], None if bias is None else [bias])[0]


# ------------------------------------------------------------------ the FFN with GELU in its GEMMs
class _FfnKeepingInput(torch.autograd.Function):
    """GELU(x @ W1^T + b1) @ W2^T and x (the residual), where ``gemms`` (ffn_gemms: the bias_gelu
    op's backend, bertfast.kernels.bias_gelu) runs the up-projection with bias and GELU in its epilogue
    and, backward, dy @ W2 with GELU' in its epilogue. The other GEMMs are cuBLAS's, as in
    _LinearKeepingInput; the output projection's bias goes to the LayerNorm op after it."""

    @staticmethod
    def forward(ctx, x: Tensor, approximate: str, gemms, w1: Tensor, b1: Tensor, w2: Tensor) -> Tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        dtype = _compute_dtype(x)
        w1c, b1c, w2c = (_cast_or_copy([p], dtype) for p in (w1, b1, w2))
        xc = _cast(x, dtype)
        a, z = gemms.gemm_bias_gelu_fwd(xc.reshape(-1, xc.shape[-1]), w1c, b1c, approximate)
        with torch.autocast(x.device.type, enabled=False):
            y = a.mm(w2c.t())
        ctx.save_for_backward(xc, w1c, w2c, z, a)
        ctx.approximate, ctx.gemms = approximate, gemms
        ctx.weights = (w1, w2)  # for their .grad, where the GEMM adds into it
        ctx.bias_dtype = b1.dtype
        return y.view(*x.shape[:-1], y.shape[-1]), x

    @staticmethod
    def backward(ctx, dy: Optional[Tensor], dres: Optional[Tensor]):
        xc, w1c, w2c, z, a = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if dy is None:
            return dres if needs[0] else None, None, None, None, None, None
        dy = dy.reshape(-1, dy.shape[-1])
        w1, w2 = ctx.weights
        with torch.autocast(dy.device.type, enabled=False):
            dz, db1 = ctx.gemms.gemm_gelu_bwd(dy, w2c, z, ctx.approximate, bias_dtype=ctx.bias_dtype)
            dw2 = _weight_grads(dy, a, [w2], [True])[0] if needs[5] else None
            dx = _input_grad(dz, w1c, dres, xc.shape) if needs[0] else None
            dw1 = _weight_grads(dz, xc.reshape(-1, xc.shape[-1]), [w1], [True])[0] if needs[3] else None
        return dx, None, None, dw1, db1 if needs[4] else None, dw2


def ffn_gemms(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor):
    """The backend module that runs the FFN's GEMMs with GELU in their epilogues for these tensors
    (``ffn``), or None: the bias_gelu backend dispatch gives the up-projection's output, where it has
    such GEMMs (gemm_bias_gelu_fwd, gemm_gelu_bwd: Triton's), on plain tensors in eager mode whose
    compute dtype (autocast's, else their own) is one (on a GPU, bf16 or fp16), the weights' widths
    multiples of 8 (16-byte rows)."""
    if torch.compiler.is_compiling() or any(type(t) not in PLAIN_TYPES for t in (x, w1, b1, w2)):
        return None
    dtype = _compute_dtype(x)
    dtypes = {_cast_dtype(t, dtype) for t in (x, w1, b1, w2)}
    if len(dtypes) != 1 or w1.shape[1] % 8 or w1.shape[0] % 8:
        return None
    if x.device.type == "cuda" and dtypes.pop() not in (torch.bfloat16, torch.float16):
        return None  # fp32 GEMMs are cuBLAS's (IEEE fp32 FMAs: no tensor cores for the epilogue to ride on)
    out = x.new_empty((0, w1.shape[0]), dtype=_cast_dtype(x, dtype))  # the up-projection's output, as bias_gelu gets it
    impl = dispatch.get("bias_gelu", dispatch.select("bias_gelu", x=out, bias=b1)).impl
    return impl if hasattr(impl, "gemm_bias_gelu_fwd") else None


def ffn_summary() -> str:
    """One line for `bertfast info`: where the FFN's GEMMs apply the bias and GELU."""
    return ("FFN in training: bias and GELU in the GEMMs' epilogues where the bias_gelu op's backend has "
            "such GEMMs (triton: kernels/bias_gelu.py; see below), else GEMM, then the op")


def ffn(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, approximate: str, gemms) -> Tuple[Tensor, Tensor]:
    """(GELU(x @ W1^T + b1) @ W2^T, x): the FFN before its output bias, and x to use as the residual
    (its gradient summed in the input-gradient GEMM, as ``linear``'s); ``gemms`` from ffn_gemms."""
    return _FfnKeepingInput.apply(x, approximate, gemms, w1, b1, w2)
