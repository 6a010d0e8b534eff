"""AdamW's update over many parameter tensors in one launch, writing each fp32 weight's bf16
working copy as it writes the weight (bertfast.training.optim.AdamW, bertfast.model.working_weights).

Math, per element, in fp32 after upcasting loads, in the order of torch's fused AdamW (so its
state dict and its hyper-parameters mean what torch's do):

  g = g / grad_scale                      (GRAD_SCALE: the clipping factor's inverse; g is not written back)
  w = w - lr wd w
  m = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2
  w = w - (lr / c1) m / (sqrt(v) / c2s + eps)     c1 = 1 - b1^t, c2s = sqrt(1 - b2^t)
  copy = bf16(w)                          (where the tensor has a working copy: rounded to nearest even)

Tables (kernels.lamb's TensorTables, cached in ``AdamWTables``; rebuilt only when a tensor's storage moves):
  TENSORS  int64 [T, 5]: addresses of w, g, m, v and of w's working copy (0: none)
  CHUNKS   int64 [C, 3]: tensor index, first element, element count (at most CHUNK elements)
  BIAS     fp32 [T, 2]: each tensor's (c1, c2s), computed on the device from its step count
Every scalar that changes between steps (the learning rate, the bias corrections, found_inf,
grad_scale) is read on the device: a step reads nothing back and can be captured in a CUDA graph.
FOUND_INF not 0 makes every program update nothing (the skipped step of ``--on-nonfinite skip``).

Memory traffic per element: 28 B (fp32 w, g, m, v read; w, m, v written) and 2 B for a working
copy. torch's fused AdamW writes the gradient back when it is handed a grad_scale (4 B more) and
the forward then casts each weight to bf16 (6 B more).

Limits: w fp32/fp16/bf16, g of w's dtype or fp32, m and v fp32, copies bf16 or fp16, all
contiguous with w's numel, on one device; anything else is a ValueError.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import triton
import triton.language as tl

from bertfast.contract import FLOAT_DTYPES, check_tensor

from . import _common
from .lamb import NUM_WARPS, _TORCH_TO_TL, TensorTables

COPY_DTYPES = (torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------- kernel
@triton.jit
def _to_bf16_rne(x):
    """fp32 -> bf16 rounded to nearest even, as torch casts (the Triton interpreter truncates);
    NaN becomes torch's 0x7FC0."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    half = tl.where(x != x, 0x7FC0, rounded)
    return half.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, offs, mask, other, has_copy, grad_scale, decay, step_size, c2s,
                beta1, one_minus_beta1, beta2, one_minus_beta2, eps, COPY_DTYPE: tl.constexpr,
                HAS_GRAD_SCALE: tl.constexpr):
    """One tile; mask and other are None for a full tile (unmasked 16-byte accesses)."""
    w = tl.load(p_ptr + offs, mask=mask, other=other).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=other).to(tl.float32)
    if HAS_GRAD_SCALE:
        g = tl.div_rn(g, grad_scale)
    w = w - decay * w
    m = beta1 * tl.load(m_ptr + offs, mask=mask, other=other) + one_minus_beta1 * g
    v = beta2 * tl.load(v_ptr + offs, mask=mask, other=other) + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), c2s) + eps
    w = w - step_size * tl.div_rn(m, denom)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    tl.store(p_ptr + offs, w.to(p_ptr.dtype.element_ty), mask=mask)
    if has_copy:
        if COPY_DTYPE == tl.bfloat16:
            tl.store(c_ptr + offs, _to_bf16_rne(w), mask=mask)
        else:
            tl.store(c_ptr + offs, w.to(COPY_DTYPE), mask=mask)


@triton.jit
def _adamw_kernel(
    CHUNKS,      # int64 [C, 3]: tensor index, first element, element count
    TENSORS,     # int64 [T, 5]: addresses of w, g, m, v, copy (0: none)
    BIAS,        # fp32 [T, 2]: each tensor's c1, c2s
    LR,          # fp32 []: the learning rate (DEVICE_LR), else None and lr below
    FOUND_INF,   # fp32 []: not 0 skips the step (HAS_FOUND_INF), else None
    GRAD_SCALE,  # fp32 []: the gradients are divided by it (HAS_GRAD_SCALE), else None
    lr, weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
    PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr, COPY_DTYPE: tl.constexpr, ALIGNED: tl.constexpr,
    DEVICE_LR: tl.constexpr, HAS_FOUND_INF: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr, BLOCK: tl.constexpr,
):
    chunk = tl.program_id(0)
    tensor = tl.load(CHUNKS + chunk * 3)
    start = tl.load(CHUNKS + chunk * 3 + 1)
    count = tl.load(CHUNKS + chunk * 3 + 2)
    if HAS_FOUND_INF:
        count = tl.where(tl.load(FOUND_INF) != 0, 0, count)
    if ALIGNED:
        start = tl.multiple_of(start, BLOCK)  # chunks start at multiples of CHUNK, itself one of BLOCK
    row = TENSORS + tensor * 5
    p_ptr = tl.load(row).to(tl.pointer_type(PARAM_DTYPE))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(GRAD_DTYPE))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    copy_address = tl.load(row + 4)
    c_ptr = copy_address.to(tl.pointer_type(COPY_DTYPE))
    if ALIGNED:  # on the pointers: a hint on the integer address does not survive the cast
        p_ptr, g_ptr = tl.multiple_of(p_ptr, 16), tl.multiple_of(g_ptr, 16)
        m_ptr, v_ptr, c_ptr = tl.multiple_of(m_ptr, 16), tl.multiple_of(v_ptr, 16), tl.multiple_of(c_ptr, 16)
    has_copy = copy_address != 0
    if DEVICE_LR:
        lr = tl.load(LR).to(tl.float32)
    grad_scale = 1.0
    if HAS_GRAD_SCALE:
        grad_scale = tl.load(GRAD_SCALE).to(tl.float32)
    c1 = tl.load(BIAS + tensor * 2)
    c2s = tl.load(BIAS + tensor * 2 + 1)
    decay = lr * weight_decay
    step_size = tl.div_rn(lr, c1)
    full = count // BLOCK
    # Full tiles unmasked (a mask against a loaded bound would forbid vector loads), then the tail.
    for i in range(0, full):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, offs, None, None, has_copy, grad_scale, decay, step_size, c2s,
                    beta1, one_minus_beta1, beta2, one_minus_beta2, eps, COPY_DTYPE, HAS_GRAD_SCALE)
    if full * BLOCK < count:
        offs = start + full * BLOCK + tl.arange(0, BLOCK)
        _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, offs, offs < start + count, 0.0, has_copy, grad_scale, decay,
                    step_size, c2s, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, COPY_DTYPE,
                    HAS_GRAD_SCALE)


# --------------------------------------------------------------------------- tables
def check_adamw_tensors(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                        exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                        copies: Sequence[Optional[torch.Tensor]]) -> None:
    """One set: equal-length lists, the parameters in one float dtype, the gradients in theirs or
    fp32, fp32 moments, copies (or None) in one of COPY_DTYPES, every tensor contiguous with its
    parameter's numel on one device; ValueError naming the first tensor that is not."""
    if not (len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(copies)):
        raise ValueError(f"AdamW tables: expected as many gradients, moments and copies as parameters, got "
                         f"{len(params)} parameters, {len(grads)} gradients, {len(exp_avgs)} exp_avg, "
                         f"{len(exp_avg_sqs)} exp_avg_sq and {len(copies)} copies")
    if not params:
        return
    dtype, grad_dtype, device = params[0].dtype, grads[0].dtype, params[0].device
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"AdamW parameters: expected dtype in {[str(f) for f in FLOAT_DTYPES]}, got {dtype}")
    if grad_dtype not in (dtype, torch.float32):
        raise ValueError(f"AdamW gradients: expected {dtype} (the parameters') or torch.float32, got {grad_dtype}")
    copy_dtypes = {c.dtype for c in copies if c is not None}
    if len(copy_dtypes) > 1 or not copy_dtypes <= set(COPY_DTYPES):
        raise ValueError(f"AdamW working copies: expected one dtype of {[str(d) for d in COPY_DTYPES]}, "
                         f"got {sorted(map(str, copy_dtypes))}")
    for i, (p, g, m, v, c) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, copies)):
        check_tensor(f"parameter {i}", p, dtypes=(dtype,), device=device)
        check_tensor(f"gradient {i}", g, dtypes=(grad_dtype,), shape=p.shape, device=device)
        check_tensor(f"exp_avg {i}", m, dtypes=(torch.float32,), shape=p.shape, device=device)
        check_tensor(f"exp_avg_sq {i}", v, dtypes=(torch.float32,), shape=p.shape, device=device)
        if c is not None:
            check_tensor(f"working copy {i}", c, device=device)
            if c.numel() != p.numel():
                raise ValueError(f"working copy {i}: expected {p.numel()} elements (its parameter's), got "
                                 f"{c.numel()} (shape {tuple(c.shape)})")
        for name, t in (("parameter", p), ("gradient", g), ("exp_avg", m), ("exp_avg_sq", v), ("working copy", c)):
            if t is not None and not t.is_contiguous():
                raise ValueError(f"{name} {i}: expected a contiguous tensor, got shape {tuple(t.shape)} "
                                 f"with strides {t.stride()}")


class AdamWTables(TensorTables):
    """AdamW's tables (see the module docstring): addresses of w, g, m, v and of w's working copy."""

    NAME = "AdamW"
    CAPTURE_HINT = ("call AdamW.prepare_tables() before capturing with the gradients the captured step "
                    "will write")

    def __init__(self):
        super().__init__()
        self.copy_dtype = None

    def check(self, params, grads, exp_avgs, exp_avg_sqs, copies) -> None:
        check_adamw_tensors(params, grads, exp_avgs, exp_avg_sqs, copies)

    def update(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
               exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
               copies: Sequence[Optional[torch.Tensor]]) -> bool:
        rebuilt = super().update(params, grads, exp_avgs, exp_avg_sqs, copies)
        if rebuilt:
            self.copy_dtype = next((c.dtype for c in copies if c is not None), None)
        return rebuilt


# --------------------------------------------------------------------------- launcher
def adamw_step(tables: AdamWTables, *, lr: Union[float, torch.Tensor], beta1: float, beta2: float, eps: float,
               weight_decay: float, bias: torch.Tensor, found_inf: Optional[torch.Tensor] = None,
               grad_scale: Optional[torch.Tensor] = None) -> None:
    """One AdamW step over the tensors of ``tables`` (after ``tables.update``), in place.

    bias: fp32 [tables.count, 2] on the device, each table tensor's (1 - b1^t, sqrt(1 - b2^t)).
    lr: a float, or an fp32 device scalar. found_inf: an fp32 device scalar; where it is not 0 the
    step changes nothing. grad_scale: an fp32 device scalar the gradients are divided by.
    """
    if not tables.count:
        return
    device = tables.chunks.device
    check_tensor("AdamW bias corrections", bias, dtypes=(torch.float32,), shape=(tables.count, 2), device=device)
    for name, t in (("learning rate", lr), ("found_inf", found_inf), ("grad_scale", grad_scale)):
        if isinstance(t, torch.Tensor):
            check_tensor(f"AdamW {name}", t, dtypes=(torch.float32,), shape=(), device=device)
    device_lr = isinstance(lr, torch.Tensor)
    # Python floats (an int 0 would compile another variant); fp32 in-kernel, as torch's scalars.
    beta1, beta2, eps, weight_decay = float(beta1), float(beta2), float(eps), float(weight_decay)
    _common.launch(_adamw_kernel, (tables.n_chunks,),
                   (tables.chunks, tables.tensors, bias, lr if device_lr else None, found_inf, grad_scale,
                    0.0 if device_lr else float(lr), weight_decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps),
                   dict(PARAM_DTYPE=_TORCH_TO_TL[tables.param_dtype], GRAD_DTYPE=_TORCH_TO_TL[tables.grad_dtype],
                        COPY_DTYPE=_TORCH_TO_TL[tables.copy_dtype or torch.bfloat16], ALIGNED=tables.aligned,
                        DEVICE_LR=device_lr, HAS_FOUND_INF=found_inf is not None,
                        HAS_GRAD_SCALE=grad_scale is not None, BLOCK=tables.block, num_warps=NUM_WARPS))
