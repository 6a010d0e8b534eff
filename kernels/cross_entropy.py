"""Softmax cross-entropy over the vocabulary for the masked-LM head, and its chunked
linear + cross-entropy driver.

Math, for one row of logits z [V] with label y (y == -100: ignored row):

    lse     = log(sum_v exp(z_v))                 (online: running max m, running sum s)
    loss    = lse - z_y                           (0 on ignored rows)
    correct = (argmax_v z_v == y)                 (ties: lowest index, as torch.argmax)
    dz_v    = grad_scale * (exp(z_v - lse) - [v == y])   (0 on ignored rows)

dz is the gradient of grad_scale * sum_rows(loss); grad_scale = 1 / (number of labelled
rows) gives the mean loss of torch's CrossEntropyLoss(ignore_index=-100). The gradient is
computed eagerly, in the forward pass, and written over the logits, so no second [M, V]
buffer exists. One program per row. When a block covers the row (BLOCK_V >= V: small
vocabularies) the row is read once into registers and written once; otherwise pass 1
streams over vocabulary blocks (online max / sum-exp / argmax) and pass 2 re-reads each
block (meant to hit L2) and writes the gradient. Block size and warps are autotuned on GPU
(BERT's 30522 takes the two-pass path: a block that covers it spills on sm_90).

The driver, linear_cross_entropy_fwd, handles logits = x @ weight.T + bias chunk by chunk
(chunk_rows rows at a time), so the logits of all M rows never exist at once:

    logits_c     = x_c @ weight.T + bias            cuBLAS, activation dtype  [rows, V]
    dlogits_c    = the kernel above, in place over logits_c                 [rows, V]
    grad_x_c     = dlogits_c @ weight                                       [rows, H]
    grad_weight += dlogits_c.T @ x_c                fp32 accumulation       [V, H]
    grad_bias   += dlogits_c.sum(0)                 fp32 accumulation       [V]

Limits: logits rows must have stride 1 along V (any row stride). Statistics are computed
in fp32 whatever the logits dtype. Labels outside [0, V) other than -100 are rejected by
the driver (one device sync); the kernel alone treats them like ignored rows, so it never
reads out of bounds. A row whose logits are all -inf yields NaN loss, as torch does.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, autotune, check_tensor, launch

IGNORE_INDEX = -100
LABEL_DTYPES = (torch.int64, torch.int32)

# Default size of one chunk of logits: chunk_rows * V * element_size <= 256 MiB.
CHUNK_BYTES = 256 * 2**20
CHUNK_ROW_MULTIPLE = 64

# Under the interpreter autotune cannot run: one fixed block size. 1024 makes V <= 1024
# take the single-block path and larger V the looped one.
_INTERPRET_BLOCK_V = 1024


@triton.jit
def _softmax_cross_entropy_kernel(
    logits_ptr,   # [M, V] activation dtype, row stride stride_row; overwritten by dz when COMPUTE_GRAD
    labels_ptr,   # [M] int64/int32, -100 = ignored
    loss_ptr,     # [M] fp32 out: per-row loss, 0 on ignored rows
    lse_ptr,      # [M] fp32 out: log-sum-exp of the row
    correct_ptr,  # [M] uint8 out: 1 where labelled and argmax == label
    stride_row,
    grad_scale,
    V: tl.constexpr,
    BLOCK_V: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    label = tl.load(labels_ptr + row).to(tl.int32)
    # Out-of-range labels (the driver rejects them) count as ignored: no out-of-bounds read.
    labelled = (label >= 0) & (label < V)
    # Exact 0 gradient on ignored rows, whatever grad_scale (inf when no row is labelled).
    row_scale = tl.where(labelled, grad_scale, 0.0)
    cols = tl.arange(0, BLOCK_V)

    if BLOCK_V >= V:
        # The whole row fits one block: read once, keep exp(z - m) for the gradient.
        z = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m, arg = tl.max(z, 0, return_indices=True, return_indices_tie_break_left=True)
        # z_label from the tile itself (no separate load racing the in-place store below).
        z_label = tl.sum(tl.where(cols == label, z, 0.0), 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)  # all -inf row: no inf - inf
        e = tl.exp(z - m_safe)
        s = tl.sum(e, 0)
        lse = m_safe + tl.log(s)
        if COMPUTE_GRAD:
            p = e / s
            dz = tl.where(cols == label, p - 1.0, p) * row_scale
            tl.store(row_ptr + cols, dz.to(logits_ptr.dtype.element_ty), mask=cols < V)
    else:
        # Pass 1: online max / sum-exp and running argmax over vocabulary blocks.
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        arg = tl.zeros((), tl.int32)
        z_label = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            z = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf"),
                        eviction_policy="evict_last").to(tl.float32)  # keep for pass 2
            bmax, barg = tl.max(z, 0, return_indices=True, return_indices_tie_break_left=True)
            # Strictly greater: an earlier block keeps a tie (lowest index wins).
            arg = tl.where(bmax > m, start + barg, arg)
            z_label += tl.sum(tl.where(idx == label, z, 0.0), 0)
            m_new = tl.maximum(m, bmax)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(z - m_safe), 0)
            m = m_new
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        lse = m_safe + tl.log(s)
        if COMPUTE_GRAD:
            # Pass 2: dz = grad_scale * (softmax - onehot), written over the logits.
            for start in range(0, V, BLOCK_V):
                idx = start + cols
                z = tl.load(row_ptr + idx, mask=idx < V, other=0.0,
                            eviction_policy="evict_first").to(tl.float32)
                p = tl.exp(z - lse)
                dz = tl.where(idx == label, p - 1.0, p) * row_scale
                tl.store(row_ptr + idx, dz.to(logits_ptr.dtype.element_ty), mask=idx < V)

    tl.store(loss_ptr + row, tl.where(labelled, lse - z_label, 0.0))
    tl.store(lse_ptr + row, lse)
    tl.store(correct_ptr + row, (labelled & (arg == label)).to(tl.uint8))


# GPU: (BLOCK_V, num_warps), the first the default. Smaller blocks than V loop twice over the row
# (the second pass meant to hit L2). No BLOCK_V >= 30522: a 32768-wide block needs 32 warps, which
# caps registers at 64 per thread, and it spills on sm_90 (compile report, triton 3.9).
# The kernel overwrites its logits: launch() tunes it on a scratch copy.
_GPU_CONFIGS = [
    triton.Config({"BLOCK_V": block_v}, num_warps=warps)
    for block_v, warps in [(8192, 16), (4096, 8), (4096, 16), (8192, 32), (16384, 16), (16384, 32)]
]
_softmax_cross_entropy_tuned = autotune(_GPU_CONFIGS, ["V", "COMPUTE_GRAD"])(_softmax_cross_entropy_kernel)


def _launch_softmax_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, grad_scale: float,
                                  compute_grad: bool, block_v: Optional[int] = None
                                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Allocate the per-row outputs and launch one program per row.

    block_v: a fixed block size (tests use it to reach both code paths); None autotunes on
    GPU and uses _INTERPRET_BLOCK_V under the interpreter.
    """
    M, V = logits.shape
    loss = torch.empty(M, dtype=torch.float32, device=logits.device)
    lse = torch.empty(M, dtype=torch.float32, device=logits.device)
    correct = torch.empty(M, dtype=torch.uint8, device=logits.device)
    if M == 0:
        return loss, lse, correct.view(torch.bool)
    args = (logits, labels, loss, lse, correct, logits.stride(0), float(grad_scale))
    consts = dict(V=V, COMPUTE_GRAD=bool(compute_grad))
    if block_v is None:
        launch(_softmax_cross_entropy_tuned, (M,), args, consts, interp={"BLOCK_V": _INTERPRET_BLOCK_V},
               scratch=("logits_ptr",) if compute_grad else ())
    else:
        launch(_softmax_cross_entropy_kernel, (M,), args,
               dict(consts, BLOCK_V=block_v, num_warps=max(1, min(32, block_v // 256))))
    return loss, lse, correct.view(torch.bool)


def _checked_labels(labels: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    check_tensor("labels", labels, dtypes=LABEL_DTYPES, shape=(rows,), device=device)
    return labels.contiguous()


def softmax_cross_entropy_(logits: torch.Tensor, labels: torch.Tensor, grad_scale: float,
                           compute_grad: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row softmax cross-entropy; with compute_grad, logits is overwritten by its gradient.

    logits: [M, V] float (fp32/fp16/bf16), stride 1 along V, MODIFIED IN PLACE when
    compute_grad: grad_scale * (softmax(logits) - onehot(label)) on labelled rows, 0 on
    ignored rows (label -100). labels: [M] int64 (int32 accepted); values are not checked
    here (that would sync): anything outside [0, V) is treated as ignored.
    Returns (loss [M] fp32, 0 at ignored rows; lse [M] fp32; correct [M] bool).
    """
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, ndim=2)
    if logits.shape[1] == 0:
        raise ValueError("logits: expected a non-empty vocabulary dimension, got shape "
                         f"{tuple(logits.shape)}")
    if logits.stride(1) != 1:
        raise ValueError(f"logits: expected stride 1 along the vocabulary, got strides {logits.stride()}")
    labels = _checked_labels(labels, logits.shape[0], logits.device)
    return _launch_softmax_cross_entropy(logits, labels, grad_scale, compute_grad)


# --------------------------------------------------------------------------- driver
def default_chunk_rows(num_rows: int, vocab_size: int, element_size: int,
                       budget_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk when the caller passes chunk_rows=None.

    The cap is the largest multiple of 64 rows whose logits fit budget_bytes (256 MiB:
    4352 rows for V=30522 in bf16), at least 64. Rows are then spread evenly over the
    chunks the cap requires (rounded up to a multiple of 64, never above the cap), so
    e.g. 4915 rows run as 2 chunks of 2496 + 2419 rather than 4352 + 563.
    """
    cap = max(CHUNK_ROW_MULTIPLE,
              budget_bytes // max(1, vocab_size * element_size) // CHUNK_ROW_MULTIPLE * CHUNK_ROW_MULTIPLE)
    if num_rows <= cap:
        return max(1, num_rows)
    n_chunks = -(-num_rows // cap)
    per_chunk = -(-num_rows // n_chunks)
    return min(cap, -(-per_chunk // CHUNK_ROW_MULTIPLE) * CHUNK_ROW_MULTIPLE)


_FP32_GEMM_CAPS = {}


def _fp32_gemm_caps(device: torch.device, dtype: torch.dtype) -> Tuple[bool, bool]:
    """(addmm accumulates into an fp32 buffer, mm writes an fp32 out=) for low-precision
    inputs on this device; probed once on tiny tensors. CUDA torch has out_dtype GEMMs
    (which forms accept an fp32 self differs between versions); CPU torch has neither.
    """
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


def _accumulate_grad_weight(acc: torch.Tensor, dlogits_t: torch.Tensor, x_c: torch.Tensor,
                            first: bool) -> None:
    """acc [V, H] fp32 = (first) or += dlogits_t [V, rows] @ x_c [rows, H].

    Low-precision inputs: cuBLAS accumulates in fp32 and, where torch allows out_dtype,
    writes or adds its fp32 result straight into acc; otherwise (CPU) each chunk's product
    is rounded to the input dtype once before the fp32 add.
    """
    if x_c.dtype == torch.float32:
        if first:
            torch.mm(dlogits_t, x_c, out=acc)
        else:
            acc.addmm_(dlogits_t, x_c)
        return
    can_addmm, can_mm = _fp32_gemm_caps(x_c.device, x_c.dtype)
    if first and can_mm:
        torch.mm(dlogits_t, x_c, out_dtype=torch.float32, out=acc)
    elif first:
        acc.copy_(torch.mm(dlogits_t, x_c))
    elif can_addmm:
        torch.addmm(acc, dlogits_t, x_c, out_dtype=torch.float32, out=acc)
    elif can_mm:
        acc.add_(torch.mm(dlogits_t, x_c, out_dtype=torch.float32))
    else:
        acc.add_(torch.mm(dlogits_t, x_c))


def _check_label_range(labels: torch.Tensor, vocab_size: int) -> None:
    """ValueError when a label is neither -100 nor in [0, V). One device sync (.any())."""
    bad = (labels >= vocab_size) | ((labels < 0) & (labels != IGNORE_INDEX))
    if bool(bad.any()):
        value = int(labels[bad][0])
        raise ValueError(f"labels: expected values in [0, {vocab_size}) or {IGNORE_INDEX} (ignored), "
                         f"got {value} (at row {int(bad.nonzero()[0, 0])})")


def linear_cross_entropy_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                             labels: torch.Tensor, chunk_rows: Optional[int], compute_grad: bool,
                             grad_scale: float):
    """Sum of softmax cross-entropy of x @ weight.T + bias over labelled rows, chunk by chunk.

    x: [M, H] activations (fp32/fp16/bf16); weight: [V, H]; bias: [V] or None (parameters,
    any float dtype: the GEMMs run in x's dtype); labels: [M] int64 (-100 = ignored);
    chunk_rows: rows per chunk, or None for default_chunk_rows (logits chunk <= 256 MiB).
    compute_grad: also return the gradients of grad_scale * loss_sum, computed here, in the
    forward pass (grad_scale = 1 / number of labelled rows gives the mean loss).

    Returns (loss_sum fp32 scalar, n_correct int64 scalar, grad_x [M, H] in x's dtype,
    grad_weight [V, H] in weight's dtype, grad_bias [V] in bias's dtype); the three grads
    are None without compute_grad (grad_bias also without bias).
    Raises ValueError for a label outside [0, V) other than -100 (this check syncs).
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    M, H = x.shape
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=2, device=x.device)
    V = weight.shape[0]
    if weight.shape[1] != H or V == 0:
        raise ValueError(f"weight: expected shape (V > 0, {H}) matching x [M, H] = {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES, shape=(V,), device=x.device)
    labels = _checked_labels(labels, M, x.device)
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(M, V, x.element_size())
    if not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool) or chunk_rows < 1:
        raise ValueError(f"chunk_rows: expected a positive int or None, got {chunk_rows!r}")
    grad_scale = float(grad_scale)
    _check_label_range(labels, V)

    dev = x.device
    loss_sum = torch.zeros((), dtype=torch.float32, device=dev)
    n_correct = torch.zeros((), dtype=torch.int64, device=dev)
    grad_x = grad_w_acc = grad_b_acc = None
    if compute_grad:
        grad_x = torch.empty(M, H, dtype=x.dtype, device=dev)
        # The first chunk writes every element; zeros only for M == 0 (no chunk at all).
        grad_w_acc = (torch.empty if M else torch.zeros)(V, H, dtype=torch.float32, device=dev)
        if bias is not None:
            grad_b_acc = torch.zeros(V, dtype=torch.float32, device=dev)

    # GEMMs run in the activation dtype (fp32 master weights under autocast are cast once).
    w = weight.to(x.dtype)                                   # [V, H]
    b = bias.to(x.dtype) if bias is not None else None       # [V]
    logits_buf = torch.empty(min(chunk_rows, M), V, dtype=x.dtype, device=dev)
    for r0 in range(0, M, chunk_rows):
        r1 = min(r0 + chunk_rows, M)
        x_c = x[r0:r1]                                       # [rows, H]
        logits = logits_buf[: r1 - r0]                       # [rows, V], contiguous
        if b is not None:
            torch.addmm(b, x_c, w.t(), out=logits)
        else:
            torch.mm(x_c, w.t(), out=logits)
        loss, _, correct = _launch_softmax_cross_entropy(logits, labels[r0:r1], grad_scale, compute_grad)
        loss_sum += loss.sum()
        n_correct += correct.sum()
        if compute_grad:                                     # logits now hold dlogits
            torch.mm(logits, w, out=grad_x[r0:r1])           # [rows, H]
            _accumulate_grad_weight(grad_w_acc, logits.t(), x_c, first=(r0 == 0))
            if grad_b_acc is not None:
                grad_b_acc += logits.sum(0, dtype=torch.float32)

    if not compute_grad:
        return loss_sum, n_correct, None, None, None
    grad_weight = grad_w_acc.to(weight.dtype)
    grad_bias = grad_b_acc.to(bias.dtype) if grad_b_acc is not None else None
    return loss_sum, n_correct, grad_x, grad_weight, grad_bias
