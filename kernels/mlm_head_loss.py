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
weight and bias) is backend-independent and lives in bertfast/ops/mlm_head_loss.py. Its fused form
(BERTFAST_MLM_HEAD=fused: the forward GEMM with the loss in its epilogue, the backward GEMMs forming the
logits' gradient as they load the softmax) is the second part of this file, "the loss in the GEMM's
epilogue".

Limits: logits rows must have stride 1 along V (any row stride); any V >= 1. Statistics are
computed in fp32 whatever the logits dtype. Labels outside [0, V) are treated like ignored
rows, so the kernel never reads out of bounds (the driver rejects them first). A row whose
logits are all -inf yields NaN loss, as torch does.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from bertfast.contract import ID_DTYPES, check_logits, check_rows, check_tensor

from . import _common
from ._common import autotune, cdiv, interpreting, launch, next_power_of_2
from ._gemm import INTERP_TILE, gemm_flags, grouped_tile, tile_product
from ._rows import n_bucket

# Under the interpreter autotune cannot run: one fixed block size. 1024 makes V <= 1024
# take the single-block path and larger V the looped one.
_INTERPRET_BLOCK_V = 1024
_LOG2E = tl.constexpr(1.4426950408889634)


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


# --------------------------------------------------------------------------- the loss in the GEMM's epilogue
# BERTFAST_MLM_HEAD=fused (bertfast/ops/mlm_head_loss.py): one chunk's decoder as three GEMMs of bertfast's
# own, without the loss kernel's pass over the logits, the bias gradient's column sum or any [M, V] gradient.
# The softmax is split by tiles of TILE_N columns: p = u * c, where u = exp(z - m_t) in [0, 1] for the
# row's max m_t over its tile t, and c = exp(m_t - lse) one factor per row and tile (0 on ignored rows).
#
#   mlm_logits_gemm_fwd    z = x @ W^T + b; the epilogue writes u in the activations' dtype (the logits
#                          themselves never), and per row and tile m_t, the sum of the u it stored and the
#                          first argmax; _logits_stats_kernel combines them into each row's lse and
#                          correct and the factors c, and takes z at the label as x's row times W's (fp32
#                          products of the same operands) for the loss.
#   mlm_softmax_gemms_bwd  for g = grad * (u * c - onehot(label)), never formed in memory:
#                          dx = g @ W: u's rows scaled by c in registers on their way to the tensor cores
#                          (one c per row in each BLOCK_K step), the one-hot's part minus W's row at each
#                          label in the epilogue; the vocabulary split over programs where [M, H] makes
#                          too few tiles for the SMs, each writing an fp32 partial, the last of a tile's
#                          splits to finish adding them in split order.
#                          dW^T = x^T @ g: a program's BLOCK_N vocabulary columns lie in one tile, so c
#                          is a column scale of the A operand x^T, and u goes to the tensor cores as
#                          stored; a column of ones beside x makes row H of the product the bias
#                          gradient; the one-hot's part, minus x's rows at their labels, is a short dot
#                          over the rows sorted by label. grad (the loss's incoming gradient) is applied
#                          in both epilogues.
# Where the loss kernel's gradient is exp(z - lse) of logits rounded to the activations' dtype (a
# relative error of |z| * 2^-8 in bf16), g here is u rounded (2^-8) times an fp32 factor rounded once
# more for the tensor cores, and the loss and argmax come from fp32 logits (the label's recomputed in fp32,
# above). c is computed from the sums of the u stored, so the p the gradient forms sum to 1 over the row. No
# atomics but the input gradient's counts of splits done: deterministic. The GEMMs' tile is kernels/_gemm.py's,
# as the FFN GEMM's (kernels/bias_gelu.py); the forward's main loop too.
@triton.jit
def _mlm_logits_gemm_kernel(
    X,          # [M, H] activations, row stride stride_xm, column stride 1
    W,          # [V, H] decoder weight in X's dtype, row stride stride_wv, column stride 1
    BIAS,       # [V] in X's dtype (HAS_BIAS)
    U,          # [M, stride_um] out: exp(z - the row's max over its tile) in X's dtype, 0 past V (stride_um:
                #   whole tiles)
    TILE_MAX,   # [cdiv(V, BLOCK_N), M] fp32 out: each tile's row max of z
    TILE_SUM,   # [cdiv(V, BLOCK_N), M] fp32 out: the sum of the tile's stored u
    TILE_ARG,   # [cdiv(V, BLOCK_N), M] int32 out: the column of the max (first of ties)
    M, V, H, stride_xm, stride_wv, stride_um,
    m_bucket,  # autotune key only
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    rows, cols, _, pid_n = grouped_tile(M, stride_um, BLOCK_M, BLOCK_N, GROUP_M)  # u's whole width: its 0s past V
    acc = tile_product(X, W, rows, cols, M, V, H, stride_xm, 1, stride_wv, EVEN_K, UPCAST, DOT_PREC, BLOCK_M,
                       BLOCK_N, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < V
    # -inf past V by the bias's add: one add an element both masks the columns and adds the bias
    col_add = tl.where(col_ok, 0.0, float("-inf"))
    if HAS_BIAS:
        col_add += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)
    z = acc + col_add[None, :]
    t_max, t_arg = tl.max(z, 1, return_indices=True, return_indices_tie_break_left=True)
    stat = pid_n * M + rows
    stat_ok = row_ok & (rows * 0 + pid_n * BLOCK_N < V)  # a tile past V (the interpreter's small tiles): its 0s only
    tl.store(TILE_MAX + stat, t_max, mask=stat_ok)
    tl.store(TILE_ARG + stat, pid_n * BLOCK_N + t_arg, mask=stat_ok)
    # u last, z's last use: with the statistics above taken first z and u are never live together (with u
    # first: 251 registers, two programs an SM at 64 x 128)
    m_safe = tl.where(t_max == float("-inf"), 0.0, t_max)  # a tile of -inf logits: no inf - inf
    # exp2 (MUFU.EX2 alone, denormals flushed; tl.exp adds a range check and two multiplies an element) of one
    # FMA an element
    u = tl.exp2(z * _LOG2E - (m_safe * _LOG2E)[:, None]).to(U.dtype.element_ty)
    tl.store(U + rows.to(tl.int64)[:, None] * stride_um + cols[None, :], u, mask=row_ok[:, None])  # whole tiles
    tl.store(TILE_SUM + stat, tl.sum(u.to(tl.float32), 1), mask=stat_ok)


@triton.jit
def _logits_stats_kernel(
    TILE_MAX, TILE_SUM, TILE_ARG,  # as _mlm_logits_gemm_kernel wrote them
    X, W, BIAS, LABELS,  # as _mlm_logits_gemm_kernel read them
    LOSS,        # [M] fp32 out: lse - z[label], 0 on ignored rows
    LSE,         # [M] fp32 out
    CORRECT,     # [M] uint8 out: labelled and the first argmax is the label
    TILE_SCALE,  # [TILES, M] fp32 out: c = exp(m_t - lse), so that p = u * c; 0 on ignored rows
    LABEL_OK,    # [M] uint8 out (CHECK_LABELS): the label is -100 or in [0, V)
    M, V, H, TILES, stride_xm, stride_wv,
    HAS_BIAS: tl.constexpr, CHECK_LABELS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < M
    label = tl.load(LABELS + rows, mask=row_ok, other=-100)
    labelled = (label >= 0) & (label < V)
    if CHECK_LABELS:
        tl.store(LABEL_OK + rows, (labelled | (label == -100)).to(tl.uint8), mask=row_ok)
    # z at the label, x's row times the label's row of W (fp32 products of the same operands; the GEMM's
    # epilogue would pay a compare, a select and an add for each of its logits to pick it out)
    lab = tl.where(labelled, label, 0).to(tl.int64)
    z_label = tl.zeros([BLOCK_R], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        ok = labelled[:, None] & (hs < H)[None, :]
        xs = tl.load(X + rows.to(tl.int64)[:, None] * stride_xm + hs[None, :], mask=ok, other=0.0)
        ws = tl.load(W + lab[:, None] * stride_wv + hs[None, :], mask=ok, other=0.0)
        z_label += tl.sum(xs.to(tl.float32) * ws.to(tl.float32), 1)
    if HAS_BIAS:
        z_label += tl.load(BIAS + lab, mask=labelled, other=0.0).to(tl.float32)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_R], tl.float32)
    arg = tl.zeros([BLOCK_R], tl.int32)
    for t0 in range(0, TILES, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        ok = (ts < TILES)[:, None] & row_ok[None, :]
        offs = ts[:, None] * M + rows[None, :]
        t_max = tl.load(TILE_MAX + offs, mask=ok, other=float("-inf"))
        t_sum = tl.load(TILE_SUM + offs, mask=ok, other=0.0)
        t_arg = tl.load(TILE_ARG + offs, mask=ok, other=0)
        b_max, b_at = tl.max(t_max, 0, return_indices=True, return_indices_tie_break_left=True)
        b_arg = tl.sum(tl.where(tl.arange(0, BLOCK_T)[:, None] == b_at[None, :], t_arg, 0), 0)
        arg = tl.where(b_max > m, b_arg, arg)  # strictly greater: an earlier tile keeps a tie
        m_new = tl.maximum(m, b_max)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(t_sum * tl.exp(t_max - m_safe[None, :]), 0)
        m = m_new
    lse = tl.where(m == float("-inf"), 0.0, m) + tl.log(tl.where(row_ok, s, 1.0))  # no log(0) past the rows
    for t0 in range(0, TILES, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        ok = (ts < TILES)[:, None] & row_ok[None, :]
        offs = ts[:, None] * M + rows[None, :]
        t_max = tl.load(TILE_MAX + offs, mask=ok, other=0.0)
        tl.store(TILE_SCALE + offs, tl.where(labelled[None, :], tl.exp(t_max - lse[None, :]), 0.0), mask=ok)
    # lse >= the row's max >= z at the label; recomputed, z may exceed the GEMM's max by a rounding (NaN kept)
    loss = tl.maximum(lse - z_label, 0.0, propagate_nan=tl.PropagateNan.ALL)
    tl.store(LOSS + rows, tl.where(labelled, loss, 0.0), mask=row_ok)
    tl.store(LSE + rows, lse, mask=row_ok)
    tl.store(CORRECT + rows, (labelled & (arg == label)).to(tl.uint8), mask=row_ok)


# GPU candidates, the first the default, all at BLOCK_N = TILE_N (the statistics are per TILE_N columns
# whatever the candidate); under the interpreter small tiles, several programs per test.
TILE_N = 128


def softmax_width(v: int) -> int:
    """u's row length for a vocabulary of ``v``: whole tiles of TILE_N (the weight gradient's GEMM reads u's
    columns in whole tiles, unmasked and unwrapped: its loads stay 16 bytes wide)."""
    return cdiv(v, TILE_N) * TILE_N


def softmax_shapes(m: int, v: int) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """The shapes of DecoderSoftmax's u and c for m rows over a vocabulary of v (the op's fake)."""
    return (m, softmax_width(v)), (cdiv(v, _tile_n()), m)


def _tile_n() -> int:
    """The statistics' tile: the launches' BLOCK_N (launch()'s own test of the interpreter decides which runs)."""
    return INTERP_TILE["BLOCK_N"] if _common.interpreting() else TILE_N


def _logits_configs():
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": TILE_N, "BLOCK_K": k, "GROUP_M": 8}, num_stages=s,
                          num_warps=w)
            for m, k, s, w in ((64, 64, 3, 4), (64, 32, 4, 4), (64, 64, 4, 4), (128, 64, 3, 8))]


_logits_tuned = autotune(_logits_configs(), ["V", "H", "m_bucket", "HAS_BIAS"])(_mlm_logits_gemm_kernel)


class DecoderSoftmax(NamedTuple):
    """The softmax mlm_logits_gemm_fwd keeps for the gradient: p = u * c, by tiles of TILE_N columns."""
    u: torch.Tensor  # [M, softmax_width(V)] in the activations' dtype, 0 past V
    c: torch.Tensor  # [cdiv(V, TILE_N), M] fp32
    vocab: int       # V


def mlm_logits_gemm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
                        labels_ok: Optional[torch.Tensor] = None
                        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecoderSoftmax]:
    """The decoder's forward with the loss in its GEMM's epilogue: x [M, H] (H >= 1), weight [V, H] and
    bias [V] (or None) in x's dtype, labels [M] int64 (-100 ignored; anything else outside [0, V) counts
    as ignored, as in mlm_head_loss_fwd). Returns (loss [M] fp32, lse [M] fp32, correct [M] bool, the
    softmax as the backward takes it). labels_ok: a [M] bool tensor to fill with whether each label is -100
    or in [0, V) (the range check on the device, in the statistics kernel's pass over the labels)."""
    m, h = check_rows("x", x)
    check_tensor("weight", weight, dtypes=(x.dtype,), ndim=2, device=x.device)
    v = weight.shape[0]
    if weight.shape[1] != h or v == 0:
        raise ValueError(f"weight: expected shape (V > 0, {h}) matching x [M, H] = {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")
    check_rows("weight", weight)
    if h == 0:
        raise ValueError(f"x: expected a hidden size H >= 1, got shape {tuple(x.shape)}")
    if bias is not None:
        check_tensor("bias", bias, dtypes=(x.dtype,), shape=(v,), device=x.device)
        bias = bias.contiguous()
    check_tensor("labels", labels, dtypes=(torch.int64,), shape=(m,), device=x.device)
    if labels_ok is not None:
        check_tensor("labels_ok", labels_ok, dtypes=(torch.bool,), shape=(m,), device=x.device)
    dev = x.device
    u_shape, c_shape = softmax_shapes(m, v)
    tiles = c_shape[0]
    u = torch.empty(u_shape, dtype=x.dtype, device=dev)
    c = torch.empty(c_shape, dtype=torch.float32, device=dev)
    loss = torch.empty((m,), dtype=torch.float32, device=dev)
    lse = torch.empty((m,), dtype=torch.float32, device=dev)
    correct = torch.empty((m,), dtype=torch.uint8, device=dev)
    if m == 0:
        return loss, lse, correct.view(torch.bool), DecoderSoftmax(u, c, v)
    t_max = torch.empty((tiles, m), dtype=torch.float32, device=dev)
    t_sum = torch.empty_like(t_max)
    t_arg = torch.empty((tiles, m), dtype=torch.int32, device=dev)
    args = (x, weight, x if bias is None else bias, u, t_max, t_sum, t_arg, m, v, h, x.stride(0), weight.stride(0),
            u.stride(0), n_bucket(m))
    launch(_logits_tuned, lambda meta: (cdiv(m, meta["BLOCK_M"]) * cdiv(u.shape[1], meta["BLOCK_N"]),), args,
           dict(HAS_BIAS=bias is not None, **gemm_flags(x.dtype, h)), interp=INTERP_TILE)
    block_r, block_t, block_h = (4, 4, 16) if interpreting() else (8, 64, min(next_power_of_2(h), 1024))
    launch(_logits_stats_kernel, (cdiv(m, block_r),),
           (t_max, t_sum, t_arg, x, weight, x if bias is None else bias, labels, loss, lse, correct, c,
            correct if labels_ok is None else labels_ok.view(torch.uint8), m, v, h, tiles, x.stride(0),
            weight.stride(0)),
           dict(HAS_BIAS=bias is not None, CHECK_LABELS=labels_ok is not None, BLOCK_R=block_r, BLOCK_T=block_t,
                BLOCK_H=block_h, num_warps=4))
    return loss, lse, correct.view(torch.bool), DecoderSoftmax(u, c, v)


# --------------------------------------------------------------------------- the gradient inside the backward GEMMs
@triton.jit
def _scaled_dot(a, b, c, acc, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc + (a's rows scaled by c) @ b, the scaled operand rounded to b's dtype as the tensor cores take it."""
    a = (a.to(tl.float32) * c[:, None]).to(b.dtype)
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PREC)


@triton.jit
def _softmax_dx_gemm_kernel(
    U,       # [M, stride_um] the forward's u, 0 past V
    C,       # [cdiv(V, TILE_N), M] fp32: the forward's c, 0 on ignored rows
    LABELS,  # [M] int64, -100 ignored
    W,       # [V, H] in U's dtype, row stride stride_wv, column stride 1
    GRAD,    # [] fp32: the loss's incoming gradient
    PART,    # [SPLIT, M, H] fp32: each split's partial (SPLIT > 1)
    COUNTS,  # [>= programs along axis 0] int32, zeros: how many of a tile's splits are done, 0 again at the end
             # (SPLIT > 1)
    DX,      # [M, H] out, in x's dtype
    M, V, H, stride_um, stride_wv, tiles_per_split,
    m_bucket,  # autotune key only
    SPLIT: tl.constexpr, TILE_N: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # A program: one tile of dx over its split's tiles_per_split tiles of the vocabulary (program_id(1))
    rows, cols, _, _ = grouped_tile(M, H, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    k_lo = split * tiles_per_split * TILE_N
    k_hi = tl.minimum(V, k_lo + tiles_per_split * TILE_N)
    ks = tl.arange(0, BLOCK_K)
    r = (rows % M).to(tl.int64)
    a_ptrs = U + r[:, None] * stride_um + (k_lo + ks)[None, :]
    b_ptrs = W + (k_lo + ks)[:, None].to(tl.int64) * stride_wv + (cols % H)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_even = k_lo + (k_hi - k_lo) // BLOCK_K * BLOCK_K
    for k0 in range(k_lo, k_even, BLOCK_K):  # unmasked: u's rows are whole tiles long, 0 past V
        c = tl.load(C + (k0 // TILE_N) * M + r)
        acc = _scaled_dot(tl.load(a_ptrs), tl.load(b_ptrs), c, acc, UPCAST, DOT_PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wv
    if k_even < k_hi:  # the last split's ragged block: W's rows past V masked (u is 0 there); its pointers
        c = tl.load(C + (k_even // TILE_N) * M + r)  # anew, not the loop's (which the pipeline runs ahead)
        a = tl.load(U + r[:, None] * stride_um + (k_even + ks)[None, :])
        b = tl.load(W + (k_even + ks)[:, None].to(tl.int64) * stride_wv + (cols % H)[None, :],
                    mask=ks[:, None] < k_hi - k_even, other=0.0)
        acc = _scaled_dot(a, b, c, acc, UPCAST, DOT_PREC)
    label = tl.load(LABELS + r)
    labelled = (rows < M) & (label >= 0) & (label < V)
    if split == 0:  # the one-hot's part: minus the label's row of W
        acc -= tl.load(W + tl.where(labelled, label, 0)[:, None] * stride_wv + (cols % H)[None, :],
                       mask=labelled[:, None], other=0.0).to(tl.float32)
    acc *= tl.load(GRAD)
    out_ok = (rows < M)[:, None] & (cols < H)[None, :]
    offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
    if SPLIT > 1:
        # Each split writes its partial; the last of the tile's splits to finish (its count: the only atomic)
        # adds them in split order and rounds once: the same sum whatever order they finish in. The barrier
        # puts every thread's stores before the count's release; the partials are read past L1 (written by
        # other SMs), one at a time (its own too: held in registers beside the others, it spilled). The count
        # is left 0 for the next launch (the autotuner's runs reuse it).
        tl.store(PART + split.to(tl.int64) * M * H + offs, acc, mask=out_ok)
        tl.debug_barrier()
        if tl.atomic_add(COUNTS + tl.program_id(0), 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            tl.store(COUNTS + tl.program_id(0), 0)
            total = tl.load(PART + offs, mask=out_ok, other=0.0, cache_modifier=".cg")
            for s in range(1, SPLIT):
                total += tl.load(PART + (M * s).to(tl.int64) * H + offs, mask=out_ok, other=0.0,
                                 cache_modifier=".cg")
            tl.store(DX + offs, total.to(DX.dtype.element_ty), mask=out_ok)
    else:
        tl.store(DX + offs, acc.to(DX.dtype.element_ty), mask=out_ok)


@triton.jit
def _softmax_dw_gemm_kernel(
    U,       # [M, stride_um] the forward's u, 0 past V (stride_um a multiple of TILE_N)
    C,       # [cdiv(V, TILE_N), M] fp32: the forward's c, 0 on ignored rows
    X,       # [M, stride_xm] x in U's dtype, its columns past H 0, or with HAS_DB 1 (row H of the product is
             # the bias gradient, the rows past it are not stored); stride_xm a multiple of 128 (dW^T's row
             # tiles need no wrap)
    SORTED,         # [M] int64: the rows' indices in label order (stable; ignored rows, -100, first)
    SORTED_LABELS,  # [M] int64: their labels
    OFFSETS,        # [cdiv(V, TILE_N) + 1] int32: where each tile's labels begin in that order
    GRAD,    # [] fp32: the loss's incoming gradient
    DW,      # [V, H] out, contiguous, in DW's dtype
    DB,      # [V] fp32 out (HAS_DB)
    M, V, H, stride_um, stride_xm,
    m_bucket,  # autotune key only
    HAS_DB: tl.constexpr, TILE_N: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_L: tl.constexpr,
):
    # The transposed product, dW^T [H, V] = (x^T scaled by c) @ u: a program's BLOCK_N vocabulary columns lie in
    # one tile t of TILE_N (BLOCK_N divides TILE_N), so its c is one value per row m of u, a column scale of the
    # A operand x^T; u goes to the tensor cores as it was stored.
    hrows, vcols, _, pid_n = grouped_tile(H + HAS_DB, V, BLOCK_M, BLOCK_N, GROUP_M)
    t = pid_n * BLOCK_N // TILE_N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = X + ks[None, :].to(tl.int64) * stride_xm + hrows[:, None]
    b_ptrs = U + ks[:, None].to(tl.int64) * stride_um + vcols[None, :]
    c_ptrs = C + t * M + ks
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, M, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
            c = tl.load(c_ptrs)
        else:
            k_ok = ks < M - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            c = tl.load(c_ptrs, mask=k_ok, other=0.0)
        a = (a.to(tl.float32) * c[None, :]).to(b.dtype)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K * stride_xm
        b_ptrs += BLOCK_K * stride_um
        c_ptrs += BLOCK_K
    # The one-hot's part, minus x's rows at their labels: the rows whose labels fall in this program's tile t,
    # BLOCK_L at a time in label order (a fixed order: deterministic), as a dot with a one-hot of -1s
    ls = tl.arange(0, BLOCK_L)
    hi = tl.load(OFFSETS + t + 1)
    for l0 in range(tl.load(OFFSETS + t), hi, BLOCK_L):
        l_ok = ls < hi - l0
        r = tl.load(SORTED + l0 + ls, mask=l_ok, other=0)
        lab = tl.load(SORTED_LABELS + l0 + ls, mask=l_ok, other=-1)
        xs = tl.load(X + r.to(tl.int64)[None, :] * stride_xm + hrows[:, None])
        onehot = tl.where(lab[:, None] == vcols[None, :], -1.0, 0.0).to(xs.dtype)
        if UPCAST:
            xs = xs.to(tl.float32)
            onehot = onehot.to(tl.float32)
        acc = tl.dot(xs, onehot, acc, input_precision=DOT_PREC)
    acc *= tl.load(GRAD)
    v_ok = vcols < V
    out = DW + vcols.to(tl.int64)[None, :] * H + hrows[:, None]
    tl.store(out, acc.to(DW.dtype.element_ty), mask=v_ok[None, :] & (hrows < H)[:, None])
    if HAS_DB:  # x's column of ones: its row of dW^T is the bias gradient
        tl.store(DB + vcols[None, :] + 0 * hrows[:, None], acc, mask=v_ok[None, :] & (hrows == H)[:, None])


# GPU candidates (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps), the first the default; BLOCK_K divides
# TILE_N (the input gradient's c changes at tile boundaries), the weight gradient's BLOCK_N too (one tile a program)
_DX_CANDIDATES = ((64, 128, 64, 4, 4), (64, 128, 64, 3, 4), (128, 128, 64, 3, 8))
_DW_CANDIDATES = ((64, 128, 64, 3, 4), (64, 128, 64, 4, 4), (128, 128, 64, 3, 8))
# The input gradient's output is small ([M, H]: at BERT-large's 2,432 rows 304 tiles of 64 x 128, not 2 full
# waves of 132 SMs holding 2 each): its vocabulary is split over up to DX_SPLIT_MAX programs a tile, each writing
# fp32 partials, so that there are DX_WAVES waves of them at least.
DX_SPLIT_MAX = 4
DX_WAVES = 6


def _gemm_configs(candidates):
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_stages=s, num_warps=w)
            for m, n, k, s, w in candidates]


_dx_tuned = autotune(_gemm_configs(_DX_CANDIDATES), ["V", "H", "m_bucket", "tiles_per_split"])(
    _softmax_dx_gemm_kernel)
_dw_tuned = autotune(_gemm_configs(_DW_CANDIDATES), ["V", "H", "m_bucket", "HAS_DB"])(_softmax_dw_gemm_kernel)


def dx_split(m: int, h: int, sms: int) -> int:
    """The input gradient's vocabulary split for m rows and hidden size h on ``sms`` SMs: the least split
    giving DX_WAVES SMs' worth of programs at the default tile, at most DX_SPLIT_MAX (1: no partials)."""
    block_m, block_n = _DX_CANDIDATES[0][:2]
    programs = cdiv(m, block_m) * cdiv(h, block_n)
    return next((s for s in range(1, DX_SPLIT_MAX) if s * programs >= DX_WAVES * sms), DX_SPLIT_MAX)


def _dx_counts(m: int, h: int, device: torch.device) -> torch.Tensor:
    """The input gradient's counts of splits done, zeros: one per program along its grid's first axis, whichever
    candidate runs (at the smallest tile; the interpreter's tile under it)."""
    tile_m, tile_n = ((INTERP_TILE["BLOCK_M"], INTERP_TILE["BLOCK_N"]) if _common.interpreting() else
                      (min(t[0] for t in _DX_CANDIDATES), min(t[1] for t in _DX_CANDIDATES)))
    return torch.zeros((cdiv(m, tile_m) * cdiv(h, tile_n),), dtype=torch.int32, device=device)


def _sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2 if interpreting() else 132  # the interpreter: splits at a test's few tiles; else an H100's


def mlm_softmax_gemms_bwd(softmax: DecoderSoftmax, labels: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                          grad: torch.Tensor, dw_dtype: torch.dtype, bias_grad: bool, split: Optional[int] = None
                          ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The decoder's gradients from mlm_logits_gemm_fwd's softmax, the logits' gradient g = grad * (u * c -
    onehot(label)) formed inside the GEMMs as they load u and never written: x [M, H] and weight [V, H] as
    the forward had them, labels [M] int64 (-100 ignored), grad the loss's incoming gradient (a 0-dim fp32
    tensor: no sync). Returns (grad x [M, H] in x's dtype, grad weight [V, H] in ``dw_dtype``, grad bias [V]
    fp32 or None). split: the input gradient's vocabulary split (None: dx_split's for this GPU)."""
    u, c, v = softmax
    m, h = x.shape
    check_tensor("u", u, dtypes=(x.dtype,), shape=softmax_shapes(m, v)[0], device=x.device)
    check_tensor("c", c, dtypes=(torch.float32,), shape=softmax_shapes(m, v)[1], device=x.device)
    check_tensor("weight", weight, dtypes=(x.dtype,), shape=(v, h), device=x.device)
    check_rows("weight", weight)
    check_tensor("labels", labels, dtypes=(torch.int64,), shape=(m,), device=x.device)
    check_tensor("grad", grad, dtypes=(torch.float32,), shape=(), device=x.device)
    dev = x.device
    dw = torch.empty((v, h), dtype=dw_dtype, device=dev)
    db = torch.empty((v,), dtype=torch.float32, device=dev) if bias_grad else None
    if m == 0 or h == 0:
        return x.new_zeros((m, h)), dw.zero_(), None if db is None else db.zero_()
    tile_n = _tile_n()
    tiles = cdiv(v, tile_n)
    split = dx_split(m, h, _sms(dev)) if split is None else split
    per_split = cdiv(tiles, split)
    split = cdiv(tiles, per_split)  # no split without tiles
    flags = gemm_flags(x.dtype, m)
    dx = torch.empty((m, h), dtype=x.dtype, device=dev)
    part, counts = dx, labels  # stand-ins, unread with one split
    if split > 1:
        part, counts = torch.empty((split, m, h), dtype=torch.float32, device=dev), _dx_counts(m, h, dev)
    launch(_dx_tuned, lambda meta: (cdiv(m, meta["BLOCK_M"]) * cdiv(h, meta["BLOCK_N"]), split),
           (u, c, labels, weight, grad, part, counts, dx, m, v, h, u.stride(0), weight.stride(0), per_split,
            n_bucket(m)),
           dict(SPLIT=split, TILE_N=tile_n, UPCAST=flags["UPCAST"], DOT_PREC=flags["DOT_PREC"]),
           interp=INTERP_TILE)
    # The one-hot's rows for the weight gradient: the rows in label order and where each tile's labels begin
    # in it (ignored rows, -100, sort before the first tile)
    sorted_labels, order = torch.sort(labels, stable=True)
    bounds = torch.arange(0, (tiles + 1) * tile_n, tile_n, device=dev, dtype=torch.int64)
    offsets = torch.searchsorted(sorted_labels, bounds, out_int32=True)
    # x^T as the A operand: rows of whole 128s (no wrap), padded in one pass with ones for the bias gradient
    # (column H's; the product's rows past H are not stored) or zeros
    xa = torch.nn.functional.pad(x, (0, cdiv(h + 1, 128) * 128 - h), value=1.0 if bias_grad else 0.0)
    launch(_dw_tuned, lambda meta: (cdiv(h + bias_grad, meta["BLOCK_M"]) * cdiv(v, meta["BLOCK_N"]),),
           (u, c, xa, order, sorted_labels, offsets, grad, dw, dw if db is None else db, m, v, h,
            u.stride(0), xa.stride(0), n_bucket(m)),
           dict(HAS_DB=bias_grad, TILE_N=tile_n, BLOCK_L=16, **flags), interp=INTERP_TILE)
    return dx, dw, db
