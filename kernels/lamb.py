"""LAMB's update over many parameter tensors in three launches (bertfast.training.optim.Lamb).

Math, per tensor w with gradient g, moments m and v (fp32), in fp32 after upcasting loads and
rounded as the reference (``Lamb`` with implementation="reference") rounds it:

  m = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2
  u = (m / c1) / (sqrt(v / c2) + eps) + wd w      c1 = 1 - b1^t, c2 = 1 - b2^t (1 without bias correction)
  r = ||w|| / ||u||, 1 when either norm is 0, then min(r, max_trust_ratio)
  w = w + to_param_dtype(u * (-lr r))             the update is rounded to w's dtype, then added

Tables (built on the host, cached in ``LambTables``; rebuilt only when a tensor's storage changes):
  TENSORS  int64 [T, 6]: addresses of w, g, m, v; the tensor's first chunk and one past its last
  CHUNKS   int64 [C, 3]: tensor index, first element, element count (at most CHUNK elements)
The kernels cast the addresses to typed pointers in-kernel, so one launch covers every tensor of
a group (one device, parameter dtype and gradient dtype).

Launches per step and group:
  1. _lamb_moments_kernel, one program per chunk: updates m and v in place, and writes the
     chunk's sums of w^2 and u^2 to PARTIALS [C, 2].
  2. _lamb_trust_kernel, one program per tensor: adds its chunks' partials in chunk order, then
     the trust ratio to TRUST [T].
  3. _lamb_apply_kernel, one program per chunk: recomputes u from m, v and w (no [numel] scratch
     buffer) and writes w.
No atomics and fixed block sizes (no autotuning): every sum is taken in the same order in every
run, so a run and its resumption from a checkpoint compute the same bits. c1, c2 and lr are
kernel arguments: a step reads nothing back from the device.

Device scalars (``Lamb(capturable=True)``, for a step captured in a CUDA graph, where a kernel
argument would be frozen at its capture value): BIAS fp32 [T, 2] holds each tensor's (c1, c2),
LR an fp32 device scalar, and FOUND_INF an fp32 device scalar that, when not 0, makes every
program update nothing (the skipped step of ``--on-nonfinite skip``, as fused AdamW's found_inf).

Memory traffic per element: 24 B (fp32 w, g) in launch 1 and 16 B in launch 3; a one-pass
optimizer (AdamW) moves 28 B.

Limits: w fp32/fp16/bf16, g fp32/fp16/bf16, m and v fp32, all contiguous with w's shape, on one
device; anything else is a ValueError. Devices are the caller's business (CUDA, or CPU tensors
under TRITON_INTERPRET=1).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import triton
import triton.language as tl

from bertfast.contract import FLOAT_DTYPES, check_tensor

from . import _common

# GPU: 1024-element tiles (4 per thread at 8 warps: one 16-byte load of fp32; at 4 warps triton 3.6
# spilled the fp32 moments kernel by 20-24 bytes on sm_90), 16 tiles per chunk, so BERT-base's 110M
# parameters make ~7000 programs (many waves, a short tail).
BLOCK, CHUNK, NUM_WARPS = 1024, 16 * 1024, 8
# Interpreter: small chunks, so small test tensors span several chunks, full tiles and a tail.
INTERP_BLOCK, INTERP_CHUNK = 64, 2 * 64
TRUST_BLOCK = 256  # partials summed per iteration of the trust kernel
ALIGNMENT = 16  # bytes: every address a multiple of it lets the kernels use 16-byte loads and stores
_TORCH_TO_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


# --------------------------------------------------------------------------- kernels
@triton.jit
def _pointers(TENSORS, tensor, PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Typed pointers to the tensor's w, g, m and v."""
    row = TENSORS + tensor * 6
    p = tl.load(row).to(tl.pointer_type(PARAM_DTYPE))
    g = tl.load(row + 1).to(tl.pointer_type(GRAD_DTYPE))
    m = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    if ALIGNED:  # on the pointers: a hint on the integer address does not survive the cast
        p, g, m, v = tl.multiple_of(p, 16), tl.multiple_of(g, 16), tl.multiple_of(m, 16), tl.multiple_of(v, 16)
    return p, g, m, v


@triton.jit
def _scalars(BIAS, FOUND_INF, tensor, count, c1, c2, DEVICE_BIAS: tl.constexpr, HAS_FOUND_INF: tl.constexpr):
    """(c1, c2, count) of a program's tensor and chunk: the bias corrections from BIAS when they are
    on the device, and no elements at all when FOUND_INF is set."""
    if DEVICE_BIAS:
        c1 = tl.load(BIAS + tensor * 2)
        c2 = tl.load(BIAS + tensor * 2 + 1)
    if HAS_FOUND_INF:
        count = tl.where(tl.load(FOUND_INF) != 0, 0, count)
    return c1, c2, count


@triton.jit
def _direction(m, v, w, c1, c2, eps, weight_decay, HAS_DECAY: tl.constexpr):
    """u = (m / c1) / (sqrt(v / c2) + eps) + wd w, with IEEE division and square root as torch's."""
    u = tl.div_rn(tl.div_rn(m, c1), tl.sqrt_rn(tl.div_rn(v, c2)) + eps)
    if HAS_DECAY:
        u += weight_decay * w
    return u


@triton.jit
def _moments_tile(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, other, acc_w, acc_u, beta1, one_minus_beta1, beta2,
                  one_minus_beta2, c1, c2, eps, weight_decay, HAS_DECAY: tl.constexpr):
    """One tile of launch 1; mask and other are None for a full tile (unmasked 16-byte accesses)."""
    w = tl.load(p_ptr + offs, mask=mask, other=other).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=other).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=other) * beta1 + one_minus_beta1 * g
    v = tl.load(v_ptr + offs, mask=mask, other=other) * beta2 + one_minus_beta2 * g * g
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    u = _direction(m, v, w, c1, c2, eps, weight_decay, HAS_DECAY)
    if mask is not None:
        u = tl.where(mask, u, 0.0)  # with eps = 0, 0 / 0 past the end would poison the sum
    return acc_w + w * w, acc_u + u * u


@triton.jit
def _lamb_moments_kernel(
    CHUNKS,    # int64 [C, 3]: tensor index, first element, element count
    TENSORS,   # int64 [T, 6]: addresses of w, g, m, v; first chunk, end chunk
    PARTIALS,  # fp32 [C, 2]: out, the chunk's sum of w^2 and of u^2
    BIAS,      # fp32 [T, 2]: each tensor's c1, c2 (DEVICE_BIAS), else None and c1, c2 below
    FOUND_INF,  # fp32 []: not 0 skips the step (HAS_FOUND_INF), else None
    beta1, one_minus_beta1, beta2, one_minus_beta2, c1, c2, eps, weight_decay,
    PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr, HAS_DECAY: tl.constexpr, ALIGNED: tl.constexpr,
    DEVICE_BIAS: tl.constexpr, HAS_FOUND_INF: tl.constexpr, BLOCK: tl.constexpr,
):
    chunk = tl.program_id(0)
    tensor = tl.load(CHUNKS + chunk * 3)
    start = tl.load(CHUNKS + chunk * 3 + 1)
    count = tl.load(CHUNKS + chunk * 3 + 2)
    c1, c2, count = _scalars(BIAS, FOUND_INF, tensor, count, c1, c2, DEVICE_BIAS, HAS_FOUND_INF)
    if ALIGNED:
        start = tl.multiple_of(start, BLOCK)  # chunks start at multiples of CHUNK, itself one of BLOCK
    p_ptr, g_ptr, m_ptr, v_ptr = _pointers(TENSORS, tensor, PARAM_DTYPE, GRAD_DTYPE, ALIGNED)
    acc_w = tl.zeros([BLOCK], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK], dtype=tl.float32)
    full = count // BLOCK
    # Full tiles unmasked (a mask against a loaded bound would forbid vector loads), then the tail.
    for i in range(0, full):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        acc_w, acc_u = _moments_tile(p_ptr, g_ptr, m_ptr, v_ptr, offs, None, None, acc_w, acc_u, beta1,
                                     one_minus_beta1, beta2, one_minus_beta2, c1, c2, eps, weight_decay, HAS_DECAY)
    if full * BLOCK < count:
        offs = start + full * BLOCK + tl.arange(0, BLOCK)
        acc_w, acc_u = _moments_tile(p_ptr, g_ptr, m_ptr, v_ptr, offs, offs < start + count, 0.0, acc_w, acc_u,
                                     beta1, one_minus_beta1, beta2, one_minus_beta2, c1, c2, eps, weight_decay,
                                     HAS_DECAY)
    tl.store(PARTIALS + chunk * 2, tl.sum(acc_w, axis=0))
    tl.store(PARTIALS + chunk * 2 + 1, tl.sum(acc_u, axis=0))


@triton.jit
def _lamb_trust_kernel(
    TENSORS,   # int64 [T, 6]: columns 4 and 5 are the tensor's first and end chunk
    PARTIALS,  # fp32 [C, 2]
    TRUST,     # fp32 [T]: out, the trust ratio
    max_trust,  # +inf for no limit
    BLOCK: tl.constexpr,
):
    tensor = tl.program_id(0)
    first = tl.load(TENSORS + tensor * 6 + 4)
    end = tl.load(TENSORS + tensor * 6 + 5)
    acc_w = tl.zeros([BLOCK], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(first, end, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        acc_w += tl.load(PARTIALS + c * 2, mask=c < end, other=0.0)
        acc_u += tl.load(PARTIALS + c * 2 + 1, mask=c < end, other=0.0)
    w_norm = tl.sqrt_rn(tl.sum(acc_w, axis=0))
    u_norm = tl.sqrt_rn(tl.sum(acc_u, axis=0))
    both = (w_norm > 0) & (u_norm > 0)
    trust = tl.where(both, tl.div_rn(w_norm, tl.where(both, u_norm, 1.0)), 1.0)
    # NaN stays NaN, as torch.clamp keeps it (min.f32 would drop it), so a diverging run shows.
    tl.store(TRUST + tensor, tl.minimum(trust, max_trust, propagate_nan=tl.PropagateNan.ALL))


@triton.jit
def _apply_tile(p_ptr, m_ptr, v_ptr, offs, mask, other, scale, c1, c2, eps, weight_decay, HAS_DECAY: tl.constexpr):
    """One tile of launch 3; mask and other are None for a full tile."""
    w = tl.load(p_ptr + offs, mask=mask, other=other).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=other)
    v = tl.load(v_ptr + offs, mask=mask, other=other)
    u = _direction(m, v, w, c1, c2, eps, weight_decay, HAS_DECAY)
    step = (u * scale).to(p_ptr.dtype.element_ty).to(tl.float32)  # rounded to w's dtype, as the reference
    tl.store(p_ptr + offs, (w + step).to(p_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lamb_apply_kernel(
    CHUNKS, TENSORS,
    TRUST,     # fp32 [T]
    BIAS, FOUND_INF,  # as in _lamb_moments_kernel
    LR,        # fp32 []: the learning rate (DEVICE_LR), else None and neg_lr below
    neg_lr, c1, c2, eps, weight_decay,
    PARAM_DTYPE: tl.constexpr, HAS_DECAY: tl.constexpr, ALIGNED: tl.constexpr, DEVICE_BIAS: tl.constexpr,
    DEVICE_LR: tl.constexpr, HAS_FOUND_INF: tl.constexpr, BLOCK: tl.constexpr,
):
    chunk = tl.program_id(0)
    tensor = tl.load(CHUNKS + chunk * 3)
    start = tl.load(CHUNKS + chunk * 3 + 1)
    count = tl.load(CHUNKS + chunk * 3 + 2)
    c1, c2, count = _scalars(BIAS, FOUND_INF, tensor, count, c1, c2, DEVICE_BIAS, HAS_FOUND_INF)
    if DEVICE_LR:
        neg_lr = -tl.load(LR).to(tl.float32)
    if ALIGNED:
        start = tl.multiple_of(start, BLOCK)
    p_ptr, _, m_ptr, v_ptr = _pointers(TENSORS, tensor, PARAM_DTYPE, tl.float32, ALIGNED)  # g is not read
    scale = neg_lr * tl.load(TRUST + tensor)
    full = count // BLOCK
    for i in range(0, full):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        _apply_tile(p_ptr, m_ptr, v_ptr, offs, None, None, scale, c1, c2, eps, weight_decay, HAS_DECAY)
    if full * BLOCK < count:
        offs = start + full * BLOCK + tl.arange(0, BLOCK)
        _apply_tile(p_ptr, m_ptr, v_ptr, offs, offs < start + count, 0.0, scale, c1, c2, eps, weight_decay,
                    HAS_DECAY)


# --------------------------------------------------------------------------- tables
def check_lamb_tensors(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                       exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor]) -> None:
    """One group: equal-length lists, the parameters in one float dtype and the gradients in one,
    fp32 moments, every tensor contiguous with its parameter's shape on one device; ValueError
    naming the first tensor that is not."""
    if not (len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs)):
        raise ValueError(f"LAMB tables: expected as many gradients and moments as parameters, got "
                         f"{len(params)} parameters, {len(grads)} gradients, {len(exp_avgs)} exp_avg and "
                         f"{len(exp_avg_sqs)} exp_avg_sq")
    if not params:
        return
    dtype, grad_dtype, device = params[0].dtype, grads[0].dtype, params[0].device
    for name, d in (("parameters", dtype), ("gradients", grad_dtype)):
        if d not in FLOAT_DTYPES:
            raise ValueError(f"LAMB {name}: expected dtype in {[str(f) for f in FLOAT_DTYPES]}, got {d}")
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        check_tensor(f"parameter {i}", p, dtypes=(dtype,), device=device)
        check_tensor(f"gradient {i}", g, dtypes=(grad_dtype,), shape=p.shape, device=device)
        check_tensor(f"exp_avg {i}", m, dtypes=(torch.float32,), shape=p.shape, device=device)
        check_tensor(f"exp_avg_sq {i}", v, dtypes=(torch.float32,), shape=p.shape, device=device)
        for name, t in (("parameter", p), ("gradient", g), ("exp_avg", m), ("exp_avg_sq", v)):
            if not t.is_contiguous():
                raise ValueError(f"{name} {i}: expected a contiguous tensor, got shape {tuple(t.shape)} "
                                 f"with strides {t.stride()}")


def chunk_table(numels: Sequence[int], chunk: int) -> Tuple[List[Tuple[int, int, int]], List[Tuple[int, int]]]:
    """([(tensor, first element, count)] per chunk, [(first chunk, end chunk)] per tensor)."""
    chunks, ranges = [], []
    for t, n in enumerate(numels):
        first = len(chunks)
        chunks += [(t, start, min(chunk, n - start)) for start in range(0, n, chunk)]
        ranges.append((first, len(chunks)))
    return chunks, ranges


def _upload(rows, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    table = torch.tensor(rows, dtype=dtype)
    if device.type == "cuda":  # pinned + non_blocking: no wait for the queued work
        return table.pin_memory().to(device, non_blocking=True)
    return table


class TensorTables:
    """The device tables of one set of tensors, kept between steps: the chunk table, and a row per
    tensor of its addresses (the parameter's, then one from each other list given to ``update``;
    None is address 0) followed by ``extra_columns``. Shared by the LAMB and AdamW kernels.

    ``update`` compares the tensors' addresses with the last step's (gradients are often new
    tensors each step) and rebuilds only what changed: the chunk table (and ``resized`` scratch)
    when the tensors' sizes change, the address table when any storage moved. Subclasses name
    themselves (``NAME``, ``CAPTURE_HINT``) and check their tensors (``check``).
    """

    NAME = ""
    CAPTURE_HINT = ""

    def __init__(self):
        self.sizes: Optional[Tuple[int, ...]] = None
        self.addresses: Optional[Tuple[int, ...]] = None
        self.block = self.chunk = self.n_chunks = 0
        self.chunks = self.tensors = None
        self.ranges: List[Tuple[int, int]] = []  # each kept tensor's first and end chunk
        self.kept: List[int] = []  # the tables' tensors, as indices into the lists given to update
        self.aligned = True
        self.param_dtype = self.grad_dtype = None

    def check(self, params: Sequence[torch.Tensor], *others: Sequence[Optional[torch.Tensor]]) -> None:
        raise NotImplementedError

    def resized(self, n_chunks: int, n_tensors: int, device: torch.device) -> None:
        """The chunk table was rebuilt for n_chunks chunks of n_tensors tensors: scratch to size."""

    def extra_columns(self, tensor: int) -> Tuple[int, ...]:
        """Columns after the addresses in the kept tensor's row."""
        return ()

    def update(self, params: Sequence[torch.Tensor], *others: Sequence[Optional[torch.Tensor]]) -> bool:
        """Tables for these tensors (``others[0]`` the gradients); True when anything was rebuilt."""
        # Checked every step, so kept cheap: tuples of plain ints (~50 ns per tensor).
        sizes = tuple(map(torch.Tensor.numel, params))
        addresses = tuple(map(torch.Tensor.data_ptr, params)) + tuple(
            0 if t is None else t.data_ptr() for ts in others for t in ts)
        block, chunk = (INTERP_BLOCK, INTERP_CHUNK) if _common.interpreting() else (BLOCK, CHUNK)
        if addresses == self.addresses and sizes == self.sizes and chunk == self.chunk:
            return False
        if params and params[0].is_cuda and torch.cuda.is_current_stream_capturing():
            # The upload below would be captured as a copy from a host buffer the graph does not own.
            raise RuntimeError(f"{self.NAME}: the tensors moved during a CUDA graph capture, so its device tables "
                               f"would have to be rebuilt inside the graph; {self.CAPTURE_HINT}")
        self.check(params, *others)
        kept = [i for i, n in enumerate(sizes) if n]  # empty tensors have nothing to update
        if sizes != self.sizes or chunk != self.chunk:
            rows, self.ranges = chunk_table([sizes[i] for i in kept], chunk)
            self.n_chunks = len(rows)
            if kept:
                self.chunks = _upload(rows, torch.int64, params[0].device)
                self.resized(len(rows), len(kept), params[0].device)
        n, columns = len(params), 1 + len(others)
        if kept:
            self.tensors = _upload([tuple(addresses[i + k * n] for k in range(columns)) + self.extra_columns(j)
                                    for j, i in enumerate(kept)], torch.int64, params[0].device)
        self.aligned = all(addresses[i + k * n] % ALIGNMENT == 0 for i in kept for k in range(columns))
        self.param_dtype, self.grad_dtype = (params[0].dtype, others[0][0].dtype) if params else (None, None)
        self.sizes, self.addresses, self.block, self.chunk, self.kept = sizes, addresses, block, chunk, kept
        return True

    @property
    def count(self) -> int:
        """The tensors in the tables: those with elements."""
        return len(self.kept)


class LambTables(TensorTables):
    """LAMB's tables (see the module docstring): addresses of w, g, m, v and each tensor's chunk
    range; PARTIALS and TRUST sized with them."""

    NAME = "LAMB"
    CAPTURE_HINT = ("give the gradients fixed buffers and call Lamb.prepare_tables() before capturing "
                    "(GraphedTrainStep does)")

    def __init__(self):
        super().__init__()
        self.partials = self.trust = None

    def check(self, params, grads, exp_avgs, exp_avg_sqs) -> None:
        check_lamb_tensors(params, grads, exp_avgs, exp_avg_sqs)

    def resized(self, n_chunks: int, n_tensors: int, device: torch.device) -> None:
        self.partials = torch.empty((n_chunks, 2), dtype=torch.float32, device=device)
        self.trust = torch.empty((n_tensors,), dtype=torch.float32, device=device)

    def extra_columns(self, tensor: int) -> Tuple[int, ...]:
        return self.ranges[tensor]


# --------------------------------------------------------------------------- launcher
def lamb_step(tables: LambTables, *, lr: Union[float, torch.Tensor], beta1: float, beta2: float, eps: float,
              weight_decay: float, max_trust_ratio: Optional[float], bias_correction1: float = 1.0,
              bias_correction2: float = 1.0, bias: Optional[torch.Tensor] = None,
              found_inf: Optional[torch.Tensor] = None) -> None:
    """One LAMB step over the tensors of ``tables`` (after ``tables.update``), in place.

    bias_correction1/2: 1 - beta^t of the tensors' common step t (1.0 without bias correction);
    or ``bias``, fp32 [tables.count, 2] on the device: each table tensor's own (c1, c2).
    lr: a float, or an fp32 device scalar the kernel reads. found_inf: an fp32 device scalar; where
    it is not 0 the step changes nothing.
    """
    if not tables.count:
        return
    n_chunks, n_tensors = tables.partials.shape[0], tables.count
    device = tables.partials.device
    if bias is not None:
        check_tensor("LAMB bias corrections", bias, dtypes=(torch.float32,), shape=(n_tensors, 2), device=device)
    if isinstance(lr, torch.Tensor):
        check_tensor("LAMB learning rate", lr, dtypes=(torch.float32,), shape=(), device=device)
    if found_inf is not None:
        check_tensor("LAMB found_inf", found_inf, dtypes=(torch.float32,), shape=(), device=device)
    # Python floats (an int 0 would compile another variant); fp32 in-kernel, as torch's scalars.
    beta1, beta2, eps, weight_decay = float(beta1), float(beta2), float(eps), float(weight_decay)
    device_lr = isinstance(lr, torch.Tensor)
    neg_lr = 0.0 if device_lr else -float(lr)
    c1, c2 = (1.0, 1.0) if bias is not None else (float(bias_correction1), float(bias_correction2))
    decay = weight_decay != 0
    common = dict(HAS_DECAY=decay, ALIGNED=tables.aligned, DEVICE_BIAS=bias is not None,
                  HAS_FOUND_INF=found_inf is not None, BLOCK=tables.block, num_warps=NUM_WARPS)
    param_dtype = _TORCH_TO_TL[tables.param_dtype]
    _common.launch(_lamb_moments_kernel, (n_chunks,),
                   (tables.chunks, tables.tensors, tables.partials, bias, found_inf, beta1, 1.0 - beta1, beta2,
                    1.0 - beta2, c1, c2, eps, weight_decay),
                   dict(PARAM_DTYPE=param_dtype, GRAD_DTYPE=_TORCH_TO_TL[tables.grad_dtype], **common))
    _common.launch(_lamb_trust_kernel, (n_tensors,),
                   (tables.tensors, tables.partials, tables.trust,
                    float("inf") if max_trust_ratio is None else max_trust_ratio),
                   dict(BLOCK=TRUST_BLOCK, num_warps=NUM_WARPS))
    _common.launch(_lamb_apply_kernel, (n_chunks,),
                   (tables.chunks, tables.tensors, tables.trust, bias, found_inf, lr if device_lr else None, neg_lr,
                    c1, c2, eps, weight_decay),
                   dict(PARAM_DTYPE=param_dtype, DEVICE_LR=device_lr, **common))
