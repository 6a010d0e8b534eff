"""The kernel of mlm_head_loss: softmax cross-entropy over the vocabulary for one chunk of
decoder logits, with its gradient written in place.

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

The chunked driver around it (logits = x @ weight.T + bias chunk by chunk, the gradients of x,
weight and bias) is backend-independent and lives in bertfast/ops/mlm_head_loss.py.

Limits: logits rows must have stride 1 along V (any row stride); any V >= 1. Statistics are
computed in fp32 whatever the logits dtype. Labels outside [0, V) are treated like ignored
rows, so the kernel never reads out of bounds (the driver rejects them first). A row whose
logits are all -inf yields NaN loss, as torch does.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from bertfast.contract import ID_DTYPES, check_logits, check_tensor

from ._common import autotune, launch

# Under the interpreter autotune cannot run: one fixed block size. 1024 makes V <= 1024
# take the single-block path and larger V the looped one.
_INTERPRET_BLOCK_V = 1024


def unsupported(inputs) -> list:
    """Dispatch: reasons these inputs exceed this backend's limits: none (any vocabulary)."""
    return []


@triton.jit
def _mlm_head_loss_fwd_kernel(
    logits_ptr,   # [M, V] activation dtype, row stride stride_row; overwritten by dz when COMPUTE_GRAD
    labels_ptr,   # [M] int64, -100 = ignored
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
_fwd_tuned = autotune(_GPU_CONFIGS, ["V", "COMPUTE_GRAD"])(_mlm_head_loss_fwd_kernel)


def mlm_head_loss_fwd(logits: torch.Tensor, labels: torch.Tensor, grad_scale: float, compute_grad: bool,
                      block_v: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row softmax cross-entropy; with compute_grad, logits is overwritten by its gradient.

    logits: [M, V] float (fp32/fp16/bf16), stride 1 along V, MODIFIED IN PLACE when
    compute_grad: grad_scale * (softmax(logits) - onehot(label)) on labelled rows, 0 on
    ignored rows (label -100). labels: [M] int64 (int32 accepted); values are not checked
    here (that would sync): anything outside [0, V) is treated as ignored.
    Returns (loss [M] fp32, 0 at ignored rows; lse [M] fp32; correct [M] bool).
    block_v: a fixed block size (tests reach both code paths with it); None autotunes on GPU
    and uses _INTERPRET_BLOCK_V under the interpreter.
    """
    M, V = check_logits(logits)
    check_tensor("labels", labels, dtypes=ID_DTYPES, shape=(M,), device=logits.device)
    labels = labels.to(torch.int64).contiguous()
    loss = torch.empty(M, dtype=torch.float32, device=logits.device)
    lse = torch.empty(M, dtype=torch.float32, device=logits.device)
    correct = torch.empty(M, dtype=torch.uint8, device=logits.device)
    if M == 0:
        return loss, lse, correct.view(torch.bool)
    args = (logits, labels, loss, lse, correct, logits.stride(0), float(grad_scale))
    consts = dict(V=V, COMPUTE_GRAD=bool(compute_grad))
    if block_v is None:
        launch(_fwd_tuned, (M,), args, consts, interp={"BLOCK_V": _INTERPRET_BLOCK_V},
               scratch=("logits_ptr",) if compute_grad else ())
    else:
        launch(_mlm_head_loss_fwd_kernel, (M,), args,
               dict(consts, BLOCK_V=block_v, num_warps=max(1, min(32, block_v // 256))))
    return loss, lse, correct.view(torch.bool)
