"""What every op module shares: the dropout seed policy, empty outputs, and the helpers of the
torch backends.

An op module ``bertfast/ops/<op>.py`` is the op's contract: it validates once, defines the
torch.library custom op with its fake and autograd, and holds the op's ``torch`` backend
(``<op>_fwd`` / ``<op>_bwd`` in plain PyTorch). The fused backends implement the same launcher
functions in ``bertfast.kernels.<op>`` (Triton) and ``bertfast.cuda.<op>`` (CUDA C++), and each
declares its limits in ``unsupported(inputs)``. bertfast.registry lists the ops; dispatch registers
their backends from it.
"""
from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import Dict, Optional, Sequence, Tuple

import torch



PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)  # not subclasses: FakeTensor, DTensor, ...


def launch_directly(*tensors: Optional[torch.Tensor]) -> bool:
    """True when an op entry may call its backend's forward launcher itself instead of the custom op:
    eager, plain tensors, nothing that needs a gradient (inference). The custom op's dispatch costs
    tens of microseconds per call, which is what a whole layer's row op takes at batch 1 on a CPU,
    and buys nothing there: it exists for autograd and for tracing (torch.compile, fake tensors)."""
    return not torch.compiler.is_compiling() and plain(tensors) and not needs_grad(tensors)


def plain(tensors: Sequence[Optional[torch.Tensor]]) -> bool:
    """Every tensor a plain one (None skipped): what an op may launch on outside the custom op."""
    return all(t is None or type(t) in PLAIN_TYPES for t in tensors)


def needs_grad(tensors: Sequence[Optional[torch.Tensor]]) -> bool:
    """Whether autograd would record a call on these tensors (None skipped)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# False: every call of a FusedOp goes through its custom op (tests compare the two ways; the overhead
# suite times both).
EAGER_FUNCTIONS = True
FUSED_OPS: Dict[str, "FusedOp"] = {}  # name -> op, every op module's


class FusedOp:
    """A torch.library custom op (``bertfast::<name>``) and the plain function it was made from.

    Called like the custom op. Eager, on plain tensors, outside torch.func's transforms, the call
    runs the same function, its setup_context and backward under a torch.autograd.Function instead
    of the custom op's dispatch (the function itself when nothing needs a gradient): the same code,
    outputs and gradients, without the dispatcher's round trips, the alias check and the
    dynamo-disabled wrappers (60-200 µs less host time per forward and backward of an op on a CPU,
    6% of a small model's eager step: benchmarks/host-overhead/cpu-2026-12-06.md). Under
    torch.compile, fake tensors or tensor subclasses, and with EAGER_FUNCTIONS False, the custom op
    runs. A backward that records itself (create_graph) calls the backward op's custom op, as
    before. Profiles name the call ``bertfast::<name>`` either way. A list of tensors among the
    arguments (attention's qkv_bias) takes a gradient per tensor."""

    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn
        self.custom = torch.library.custom_op(name, mutates_args=())(fn)
        self._function = None
        # Whether an argument is a list of tensors (its schema's list[Tensor]), which the
        # autograd.Function takes spread out; most ops have none and skip the spreading.
        self._lists = any(str(p.annotation).lower().startswith("list")
                          for p in inspect.signature(fn).parameters.values())
        FUSED_OPS[name] = self

    def register_fake(self, fake):
        return self.custom.register_fake(fake)

    def register_autograd(self, backward, *, setup_context) -> None:
        self.custom.register_autograd(backward, setup_context=setup_context)
        fn = self.fn

        class Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx, spec, *flat):
                args = flat if spec is None else _unflatten(flat, spec)
                output = fn(*args)
                setup_context(ctx, args, output)
                ctx.spec = spec
                return output

            @staticmethod
            def backward(ctx, *grads):
                got = backward(ctx, *grads)
                return (None, *(got if ctx.spec is None else _flatten_grads(got, ctx.spec)))

        Function.__name__ = Function.__qualname__ = self.name.split("::")[-1]
        self._function = Function

    def __call__(self, *args):
        if EAGER_FUNCTIONS and not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active():
            flat, spec = _flatten(args) if self._lists else (args, None)
            tensors = [t for t in flat if isinstance(t, torch.Tensor)]
            if plain(tensors):
                grad = needs_grad(tensors)
                if not grad or self._function is not None:
                    with _named(self.name):
                        return self._function.apply(spec, *flat) if grad else self.fn(*args)
        return self.custom(*args)


def _named(name: str):
    """record_function(name) while a profiler runs (what the custom op shows), else nothing to pay."""
    return torch.autograd.profiler.record_function(name) if torch.autograd.profiler._is_profiler_enabled else _NOTHING


_NOTHING = contextlib.nullcontext()


def _flatten(values):
    """Arguments -> (flat values, spec): each list or tuple of tensors spread out, its length in spec
    (None for a single value)."""
    flat, lengths = [], []
    for value in values:
        n = len(value) if isinstance(value, (list, tuple)) else None
        if n is None:
            flat.append(value)
        else:
            flat.extend(value)
        lengths.append(n)
    return flat, tuple(lengths)


def _flatten_grads(grads, spec) -> list:
    """A backward's gradients, one per argument, spread out as _flatten spread the arguments: a list's
    gradients one per tensor (its None a None for each)."""
    flat = []
    for grad, n in zip(grads, spec):
        if n is None:
            flat.append(grad)
        else:
            flat.extend([None] * n if grad is None else grad)
    return flat


def _unflatten(flat, spec) -> list:
    args, i = [], 0
    for n in spec:
        args.append(flat[i] if n is None else list(flat[i:i + n]))
        i += 1 if n is None else n
    return args


def fused_op(name: str):
    """Decorator: a FusedOp named ``name`` over the function (mutates nothing)."""
    return lambda fn: FusedOp(name, fn)


# Gradients an op's backward allocated for one input alone and hands to autograd, in eager mode on
# plain tensors: data_ptr -> (weak reference, numel); an entry goes with its tensor. The node that
# receives one (or autograd's view of it: a reshape on the way makes a new tensor of the same
# memory) may write into it (take_over) instead of copying it: torch.addmm(C, A, B) copies C into a
# new output before its GEMM adds into it, and bertfast.model.residual_linear's residual-gradient sums
# were 48 such copies of a [tokens, 1024] activation per BERT-large step in the H200 trace of
# 2026-11-27.
_HANDED_OVER: Dict[int, Tuple["weakref.ReferenceType[torch.Tensor]", int]] = {}


def hand_over(grad: torch.Tensor) -> torch.Tensor:
    """Mark ``grad``, a contiguous gradient the caller allocated and returns for one input with no
    other reference kept, as the receiving node's to write (take_over); returns it."""
    if type(grad) in PLAIN_TYPES and not torch.compiler.is_compiling() and grad.is_contiguous() and grad.numel():
        key = grad.data_ptr()

        def forget(ref, key=key):
            if _HANDED_OVER.get(key, (None,))[0] is ref:
                del _HANDED_OVER[key]
        _HANDED_OVER[key] = (weakref.ref(grad, forget), grad.numel())
    return grad


def take_over(grad: Optional[torch.Tensor]) -> bool:
    """Whether ``grad`` is a handed-over gradient (hand_over), or a view of all of it, and so the
    caller's to write in place: true once per handed-over tensor."""
    if (grad is None or type(grad) not in PLAIN_TYPES or not grad.is_contiguous() or not grad.numel()
            or torch.is_grad_enabled()):  # a backward that records itself (create_graph): no in-place writes
        return False
    entry = _HANDED_OVER.get(grad.data_ptr())
    if entry is None or entry[0]() is None or entry[1] != grad.numel():
        return False
    del _HANDED_OVER[grad.data_ptr()]
    return True


# False: GEMMs of low-precision inputs write the input dtype, as on CPU. Only the GPU check's
# racecheck sets it (compute-sanitizer's racecheck fails inside cuBLAS's bf16-in, fp32-out GEMM:
# bertfast.gpucheck.sanitize --no-fp32-out-gemms).
FP32_OUT_GEMMS = True
_FP32_GEMM_CAPS = {}


def fp32_gemm_caps(device: torch.device, dtype: torch.dtype) -> Tuple[bool, bool]:
    """(addmm accumulates into an fp32 buffer, mm writes an fp32 out=) for low-precision
    inputs on this device; probed once on tiny tensors. CUDA torch has out_dtype GEMMs
    (which forms accept an fp32 self differs between versions); CPU torch has neither.
    """
    if not FP32_OUT_GEMMS:
        return False, False
    key = (device.type, device.index, dtype)
    if key not in _FP32_GEMM_CAPS:
        a = torch.ones(16, 8, device=device, dtype=dtype)
        b = torch.ones(8, 16, device=device, dtype=dtype)
        can_addmm = can_mm = False
        try:
            acc = torch.full((16, 16), 1.0, device=device, dtype=torch.float32)
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            can_addmm = bool((acc == 9.0).all())
        except (RuntimeError, TypeError, NotImplementedError):
            pass
        try:
            out = torch.empty(16, 16, device=device, dtype=torch.float32)
            torch.mm(a, b, out_dtype=torch.float32, out=out)
            can_mm = bool((out == 8.0).all())
        except (RuntimeError, TypeError, NotImplementedError):
            pass
        _FP32_GEMM_CAPS[key] = (can_addmm, can_mm)
    return _FP32_GEMM_CAPS[key]


def new_seed(device: torch.device) -> torch.Tensor:
    """A fresh dropout seed, int64 [1] on ``device``.

    Drawn from torch's generator for that device, so ``torch.manual_seed`` makes runs
    reproducible, every call advances the stream, and on CUDA the draw is graph-safe (the
    kernels read the seed from device memory, never from the host).
    """
    return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device)


def seed_for(dropout_p: float, device: torch.device) -> Optional[torch.Tensor]:
    return new_seed(device) if dropout_p > 0.0 else None


def empty(like: torch.Tensor) -> torch.Tensor:
    """Placeholder for an absent optional output (custom ops return tensors, not None)."""
    return like.new_empty((0,))


def or_none(t: torch.Tensor) -> Optional[torch.Tensor]:
    return None if t.numel() == 0 and t.dim() == 1 else t


def distinct(outputs, inputs=()):
    """Custom ops may not return tensors that share storage with an input or with each other.

    Launchers may legitimately return views of one buffer (e.g. two reductions computed
    together); clone only the outputs that would alias."""
    seen = {id(t) for t in inputs if isinstance(t, torch.Tensor)}
    seen |= {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor) and t.numel()}
    result = []
    for t in outputs:
        if isinstance(t, torch.Tensor):
            key = t.untyped_storage().data_ptr() if t.numel() else id(t)
            if key in seen or id(t) in seen:
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr() if t.numel() else id(t))
        result.append(t)
    return tuple(result)


def no_zero_grads(ctx) -> None:
    """For a custom op's setup_context: hand the backward None for outputs nothing differentiated
    (the saved statistics, pre_norm, lse), not zeros that autograd would otherwise allocate and fill
    (an [N, H] fill for pre_norm's gradient in every LayerNorm backward; [V, H] fp32 for the MLM
    loss's saved weight gradient). The backward then returns None for every input when even its
    main output's gradient is None."""
    ctx.set_materialize_grads(False)


# ------------------------------------------------------------------ shared by the torch backends
def keep_mask(shape: Sequence[int], dropout_p: float, seed: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    """The torch backend's dropout keep-mask for a seed (None when p == 0): torch.rand under a
    torch.Generator seeded with the seed's value, so a backward draws the forward's mask again."""
    if dropout_p == 0.0:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed.item()))
    return torch.rand(tuple(shape), generator=gen, device=device) >= dropout_p


def layer_norm_fwd(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm of fp32 rows h [N, H]: (y fp32, mean [N], rstd [N]), by aten's fused kernel."""
    y, mean, rstd = torch.native_layer_norm(h, (h.shape[-1],), weight.float(), bias.float(), eps)
    return y, mean.view(-1), rstd.view(-1)


def layer_norm_bwd(g: torch.Tensor, h: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                   weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm backward of fp32 rows h from the forward's statistics: (d h, d weight, d bias), fp32."""
    if h.shape[0] == 0:  # aten leaves the parameter gradients undefined for 0 rows
        zeros = torch.zeros(h.shape[-1], dtype=torch.float32, device=h.device)
        return torch.zeros_like(h), zeros, zeros.clone()
    w = weight.float()
    # aten reads the bias argument only for whether it is defined, so w stands in for it.
    return torch.ops.aten.native_layer_norm_backward(g, h, (h.shape[-1],), mean[:, None], rstd[:, None], w, w,
                                                     [True, True, True])
