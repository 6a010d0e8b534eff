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
(BERTFAST_MLM_HEAD=fused: the forward GEMM with the loss in its epilogue, then the gradient pass) is
the second part of this file, "the loss in the GEMM's epilogue".

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

from bertfast.contract import FLOAT_DTYPES, ID_DTYPES, check_logits, check_rows, check_tensor, padded_vocab

from ._common import autotune, cdiv, interpreting, launch
from ._gemm import INTERP_TILE, gemm_flags, grouped_tile, tile_product
from ._rows import column_sums, n_bucket

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


# --------------------------------------------------------------------------- the loss in the GEMM's epilogue
# BERTFAST_MLM_HEAD=fused (bertfast/ops/mlm_head_loss.py): one chunk's decoder forward as one GEMM of
# bertfast's own, without the loss kernel's pass over the logits or the bias gradient's column sum.
# The softmax is split by tiles of TILE_N columns: p = u * c, where u = exp(z - m_t) in [0, 1] for the
# row's max m_t over its tile t, and c = exp(m_t - lse) one factor per row and tile.
#
#   mlm_logits_gemm_fwd  z = x @ W^T + b; the epilogue writes u in the activations' dtype (the logits
#                        themselves never), and per row and tile m_t, the sum of the u it stored, the
#                        first argmax and z at the label where the tile holds it; _logits_stats_kernel
#                        combines them into each row's loss, lse and correct, and the factors c.
#   mlm_softmax_grad     g = grad_scale * (u * c - onehot(label)) written over u (the GEMMs of the input
#                        and weight gradients are cuBLAS's), with g's column sums over each block of rows
#                        (the bias gradient's partials): the loss kernel's write and the column sum's read
#                        in one pass.
# Where the loss kernel's gradient is exp(z - lse) of logits rounded to the activations' dtype (a
# relative error of |z| * 2^-8 in bf16), p here is u rounded (2^-8) times an fp32 factor, and the loss
# and argmax come from the fp32 logits. c is computed from the sums of the u stored, so the p the
# gradient forms sum to 1 over the row. The GEMM's tile and main loop are kernels/_gemm.py's, as the FFN
# GEMM's (kernels/bias_gelu.py).
@triton.jit
def _mlm_logits_gemm_kernel(
    X,          # [M, H] activations, row stride stride_xm, column stride 1
    W,          # [V, H] decoder weight in X's dtype, row stride stride_wv, column stride 1
    BIAS,       # [V] in X's dtype (HAS_BIAS)
    LABELS,     # [M] int64, -100 ignored
    U,          # [M, stride_um] out: exp(z - the row's max over its tile) in X's dtype, 0 past V
    TILE_MAX,   # [cdiv(V, BLOCK_N), M] fp32 out: each tile's row max of z
    TILE_SUM,   # [cdiv(V, BLOCK_N), M] fp32 out: the sum of the tile's stored u
    TILE_ARG,   # [cdiv(V, BLOCK_N), M] int32 out: the column of the max (first of ties)
    Z_LABEL,    # [M] fp32 out: z at the label, from the tile that holds it
    M, V, H, stride_xm, stride_wv, stride_um,
    m_bucket,  # autotune key only
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    rows, cols, _, pid_n = grouped_tile(M, V, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tile_product(X, W, rows, cols, M, V, H, stride_xm, 1, stride_wv, EVEN_K, UPCAST, DOT_PREC, BLOCK_M,
                       BLOCK_N, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < V
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    z = tl.where(col_ok[None, :], acc, float("-inf"))
    t_max, t_arg = tl.max(z, 1, return_indices=True, return_indices_tie_break_left=True)
    m_safe = tl.where(t_max == float("-inf"), 0.0, t_max)  # a tile of -inf logits: no inf - inf
    u = tl.exp(z - m_safe[:, None]).to(U.dtype.element_ty)
    # u's rows have their padded width, 0 past V: a bound of whole 16-byte groups keeps the stores wide
    u_ok = row_ok[:, None] & (cols < stride_um)[None, :]
    tl.store(U + rows.to(tl.int64)[:, None] * stride_um + cols[None, :], u, mask=u_ok)
    stat = pid_n * M + rows
    tl.store(TILE_MAX + stat, t_max, mask=row_ok)
    tl.store(TILE_SUM + stat, tl.sum(u.to(tl.float32), 1), mask=row_ok)
    tl.store(TILE_ARG + stat, pid_n * BLOCK_N + t_arg, mask=row_ok)
    label = tl.load(LABELS + rows % M)
    here = row_ok & (label >= pid_n * BLOCK_N) & (label < pid_n * BLOCK_N + BLOCK_N) & (label < V)
    z_label = tl.sum(tl.where(cols[None, :] == label[:, None], z, 0.0), 1)
    tl.store(Z_LABEL + rows, z_label, mask=here)


@triton.jit
def _logits_stats_kernel(
    TILE_MAX, TILE_SUM, TILE_ARG, Z_LABEL, LABELS,  # as _mlm_logits_gemm_kernel wrote them
    LOSS,        # [M] fp32 out: lse - z[label], 0 on ignored rows
    LSE,         # [M] fp32 out
    CORRECT,     # [M] uint8 out: labelled and the first argmax is the label
    TILE_SCALE,  # [TILES, M] fp32 out: c = exp(m_t - lse), so that p = u * c
    M, V, TILES,
    BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < M
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
        tl.store(TILE_SCALE + offs, tl.exp(t_max - lse[None, :]), mask=ok)
    label = tl.load(LABELS + rows, mask=row_ok, other=-100)
    labelled = (label >= 0) & (label < V)
    z_label = tl.load(Z_LABEL + rows, mask=row_ok & labelled, other=0.0)
    tl.store(LOSS + rows, tl.where(labelled, lse - z_label, 0.0), mask=row_ok)
    tl.store(LSE + rows, lse, mask=row_ok)
    tl.store(CORRECT + rows, (labelled & (arg == label)).to(tl.uint8), mask=row_ok)


@triton.jit
def _softmax_grad_kernel(
    U,           # [M, stride_um] the forward's u, 0 past V; overwritten by g
    TILE_SCALE,  # [cdiv(V, TILE_N), M] fp32: the forward's c
    LABELS,      # [M] int64, -100 ignored
    DB_PART,     # [cdiv(M, BLOCK_M), V] fp32 out (HAS_DB): g's column sums over each program's rows
    M, V, stride_um, grad_scale,
    HAS_DB: tl.constexpr, TILE_N: tl.constexpr, BLOCK_M: tl.constexpr,
):
    # One program: BLOCK_M rows of one tile t of TILE_N columns, whose c is one value per row.
    pid_m = tl.program_id(0)
    pid_t = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_t * TILE_N + tl.arange(0, TILE_N)
    row_ok = rows < M
    label = tl.load(LABELS + rows, mask=row_ok, other=-100)
    labelled = row_ok & (label >= 0) & (label < V)
    c = tl.load(TILE_SCALE + pid_t * M + rows, mask=labelled, other=0.0)
    ptrs = U + rows.to(tl.int64)[:, None] * stride_um + cols[None, :]
    u_ok = row_ok[:, None] & (cols < stride_um)[None, :]  # the padded width: wide loads and stores
    u = tl.load(ptrs, mask=u_ok, other=0.0).to(tl.float32)
    g = (u * c[:, None] - tl.where(cols[None, :] == label[:, None], 1.0, 0.0)) * grad_scale
    # where, not a product with a mask: exact 0 on ignored rows whatever grad_scale (inf with no labelled row)
    g = tl.where(labelled[:, None], g, 0.0).to(U.dtype.element_ty)
    tl.store(ptrs, g, mask=u_ok)
    if HAS_DB:
        tl.store(DB_PART + pid_m * V + cols, tl.sum(g.to(tl.float32), 0), mask=cols < V)


# GPU candidates, the first the default, all at BLOCK_N = TILE_N (the statistics are per TILE_N columns
# whatever the candidate); under the interpreter small tiles, several programs per test.
TILE_N = 128
GRAD_BLOCK_M = 64  # mlm_softmax_grad's rows per program: a row of the bias gradient's partials each


def _tile_n() -> int:
    return INTERP_TILE["BLOCK_N"] if interpreting() else TILE_N


def _logits_configs():
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": TILE_N, "BLOCK_K": k, "GROUP_M": 8}, num_stages=s,
                          num_warps=w)
            for m, k, s, w in ((64, 64, 4, 4), (64, 64, 3, 4), (128, 64, 3, 8), (128, 64, 4, 8))]


_logits_tuned = autotune(_logits_configs(), ["V", "H", "m_bucket", "HAS_BIAS"])(_mlm_logits_gemm_kernel)


class DecoderSoftmax(NamedTuple):
    """The softmax mlm_logits_gemm_fwd keeps for the gradient: p = u * c, by tiles of TILE_N columns."""
    u: torch.Tensor  # [M, padded_vocab(V)] in the activations' dtype, 0 past V
    c: torch.Tensor  # [cdiv(V, TILE_N), M] fp32
    vocab: int       # V


def mlm_logits_gemm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor
                        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecoderSoftmax]:
    """The decoder's forward with the loss in its GEMM's epilogue: x [M, H] (H >= 1), weight [V, H] and
    bias [V] (or None) in x's dtype, labels [M] int64 (-100 ignored; anything else outside [0, V) counts
    as ignored, as in mlm_head_loss_fwd). Returns (loss [M] fp32, lse [M] fp32, correct [M] bool, the
    softmax as the backward takes it)."""
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
    dev = x.device
    tiles = cdiv(v, _tile_n())
    u = torch.empty((m, padded_vocab(v, x.element_size())), dtype=x.dtype, device=dev)
    c = torch.empty((tiles, m), dtype=torch.float32, device=dev)
    loss = torch.empty((m,), dtype=torch.float32, device=dev)
    lse = torch.empty((m,), dtype=torch.float32, device=dev)
    correct = torch.empty((m,), dtype=torch.uint8, device=dev)
    if m == 0:
        return loss, lse, correct.view(torch.bool), DecoderSoftmax(u, c, v)
    t_max = torch.empty((tiles, m), dtype=torch.float32, device=dev)
    t_sum = torch.empty_like(t_max)
    t_arg = torch.empty((tiles, m), dtype=torch.int32, device=dev)
    z_label = torch.empty((m,), dtype=torch.float32, device=dev)  # read at labelled rows only
    args = (x, weight, x if bias is None else bias, labels, u, t_max, t_sum, t_arg, z_label, m, v, h, x.stride(0),
            weight.stride(0), u.stride(0), n_bucket(m))
    launch(_logits_tuned, lambda meta: (cdiv(m, meta["BLOCK_M"]) * tiles,), args,
           dict(HAS_BIAS=bias is not None, **gemm_flags(x.dtype, h)), interp=INTERP_TILE)
    block_r, block_t = (4, 4) if interpreting() else (32, 64)
    launch(_logits_stats_kernel, (cdiv(m, block_r),),
           (t_max, t_sum, t_arg, z_label, labels, loss, lse, correct, c, m, v, tiles),
           dict(BLOCK_R=block_r, BLOCK_T=block_t, num_warps=4))
    return loss, lse, correct.view(torch.bool), DecoderSoftmax(u, c, v)


def mlm_softmax_grad(softmax: DecoderSoftmax, labels: torch.Tensor, grad_scale: float, bias_grad: bool = True
                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The logits' gradient from mlm_logits_gemm_fwd's softmax, written over its u: g = grad_scale * (u * c -
    onehot(label)), 0 on ignored rows (labels [M] int64 as the forward had them). Returns (g, u itself:
    [M, padded_vocab(V)] in u's dtype, 0 past V; with bias_grad, g's column sums [V] in fp32, else
    None)."""
    u, c, v = softmax
    m = u.shape[0]
    check_tensor("u", u, dtypes=FLOAT_DTYPES, shape=(m, padded_vocab(v, u.element_size())))
    if not u.is_contiguous():
        raise ValueError(f"u: expected mlm_logits_gemm_fwd's contiguous rows, got strides {u.stride()}")
    tile_n = _tile_n()
    check_tensor("c", c, dtypes=(torch.float32,), shape=(cdiv(v, tile_n), m), device=u.device)
    check_tensor("labels", labels, dtypes=(torch.int64,), shape=(m,), device=u.device)
    block_m = 16 if interpreting() else GRAD_BLOCK_M  # the interpreter: several row blocks per test
    blocks = cdiv(m, block_m)
    db_part = torch.empty((blocks, v), dtype=torch.float32, device=u.device) if bias_grad else c
    if m:
        launch(_softmax_grad_kernel, (blocks, cdiv(v, tile_n)),
               (u, c, labels, db_part, m, v, u.stride(0), float(grad_scale)),
               dict(HAS_DB=bias_grad, TILE_N=tile_n, BLOCK_M=block_m, num_warps=8))
    if not bias_grad:
        return u, None
    return u, column_sums(db_part.view(1, blocks, v), [torch.float32])[0]
