"""Fused bidirectional self-attention for BERT (FlashAttention-2 style), forward and backward.

Math, per sequence b and head h (i: query row, j: key column, both < len_b):

    S_ij  = scale * q_i . k_j                      (-inf where key j is padding)
    lse_i = log sum_j exp(S_ij)                    (natural log, fp32, saved for backward)
    P_ij  = exp(S_ij - lse_i)
    Z_ij  = keep_ij / (1 - p)                      (dropout on probabilities; Z = 1 when p = 0)
    o_i   = sum_j P_ij Z_ij v_j

  Forward streams over key blocks with the online softmax: running max m_i and running sum
  l_i of exp(S - m); the accumulator is rescaled by exp(m_old - m_new) whenever the max grows,
  so the [S, S] matrix never exists in memory. Exponentials are exp2 with log2(e) folded into
  the scale (qk_scale = scale * log2 e); lse is stored in natural-log units.

  Backward (dO = upstream gradient), recomputing P from q, k and lse block by block:

    delta_i = sum_j P_ij dP_ij   (= dO_i . o_i)
    dV_j    = sum_i P_ij Z_ij dO_i
    dP_ij   = Z_ij (dO_i . v_j)
    dS_ij   = P_ij (dP_ij - delta_i)
    dQ_i    = scale * sum_j dS_ij k_j
    dK_j    = scale * sum_i dS_ij q_i

  delta in two steps (fp16/bf16). A preprocessing kernel takes d_i = dO_i . O_i from the stored
  output, which is o_i rounded, so d_i is off by dO_i . (o_i - O_i) (~2**-9 |dO_i| |o_i| in bf16).
  That puts -scale sum_i P_ij (delta_i - d_i) q_i into dK_j, summed over every query attending to
  key j (the key of a one-token sequence of the padded form gets it from all S rows with P = 1,
  where the exact dS is 0: ~sqrt(S) times one row's error), and -scale (delta_i - d_i) pk_i into
  dQ_i, pk_i = sum_j P_ij k_j (with P = 1 that is all of dQ_i, whose exact value is 0). So the dQ
  kernel, which sees all keys of its rows, takes dS'_ij = P_ij (dP_ij - d_i) as before and sums
  r_i = sum_j dS'_ij (= delta_i - d_i as sum_j P_ij = 1; fp32, before dS' is rounded for the
  dot) and pk_i beside sum_j dS'_ij k_j; then
      dQ_i = scale * (sum_j dS'_ij k_j - r_i pk_i),   delta_i = d_i + r_i,
  and it writes delta for the dK/dV kernel, which runs after it. Cost: one more dot and
  accumulator in the dQ kernel. fp32: d is exact to fp32 rounding, nothing is refined.

  Three kernels: the preprocessing kernel computes d; one program per query block iterates over
  the key blocks for dQ (and delta); one program per key block iterates over the query blocks for
  dK, dV. Every output element is written by exactly one program (no atomics), so results are
  deterministic for a fixed launch configuration. (Or dQ added atomically: "Atomic dQ" below.)

  Short sequences (up to FUSED_BWD_MAX_SEQLEN tokens, head dims up to FUSED_BWD_MAX_HEAD_DIM: BERT's
  pre-training phase 1 and most fine-tuning): one kernel, one program per (sequence, head), holding
  every key and value of its sequence and the dK, dV accumulators while it walks the query blocks.
  Each query block sees its whole rows of scores, so
      (1 - p) delta_i = sum_j kept_ij dP_ij            (fp32, from the tile: exact, nothing to refine)
  and its dQ_i = scale / (1 - p) sum_j dS'_ij k_j is complete when the block ends: written, no
  atomics. Five products per score element where the three kernels make seven (S and dP twice),
  the preprocessing kernel and the stored output are not read, and the scores, K and V are loaded
  once. The tiles are keys-major ([keys, queries], the orientation of dK's and dV's products, whose
  operands then come from registers; the keep bits are transposed in shared memory, and dS for dQ).
  One program per (sequence, head) fits on an SM (255 registers), so its loads, arithmetic and
  stores run in series: the H200's step profile of 2026-11-27 had the kernel at 193 us a layer where
  its tensor, issue and memory bounds sum to 136. Its PERSISTENT candidate (128-key tiles, the
  varlen form at head dim 64: PERSISTENT_HEAD_DIM) runs a program per SM that takes the (sequence,
  head) pairs in turn, each pair's query blocks unrolled so that the loop over pairs is one level
  deep and Triton pipelines it: the next pair's K, V, Q and dO are copied to shared memory
  (cp.async) while this pair computes. Its loads are clamped to the sequence's last row instead of
  masked (P is 0 there all the same: key_ok, lse +inf), since the pipeline carries each masked
  load's [rows, head dim] mask to the next iteration, which spilled. The autotuner keeps whichever
  candidate is faster.

Dropout: keep_ij = (u >= p), u in [0, 1) in steps of 2**-16, from Philox4x32-7 (_philox.py: tl.randint4x's
words, N_ROUNDS) keyed by (seed, b * A + h) -- the seed in the key's low word, the (batch, head) stream in
its high word. One Philox call makes 8 keep decisions, a 16-bit half of each of its 4 words compared
as an integer (bits >= ceil(p * 2**16), no float per element): group g of row i, at counter
i * 2**13 + g, holds the columns 32m + 8w + 2q + e of g = 4m + q, decision 2w + e from half e of
word w. That grouping is the layout of a score tile in registers (each thread holds column pairs
8 apart), so a group's 8 columns land in one thread and the mask is only reshaped, never moved
between threads. 7 rounds, as FlashAttention-2 draws its dropout: the fewest with which Philox4x32
passes TestU01's BigCrush (Salmon et al., SC'11; 10 is their margin for general use). The mask is
a pure function of (seed, b, h, i, j): the forward and the debug entry points draw the same mask
whatever their block sizes, and the seed is read from a device tensor so the kernels can live in a
CUDA graph. The varlen and padded forms of one batch draw the same mask (sequence b of the varlen
batch is batch row b of the padded one). The keep rate is 1 - p to within 2**-16, the scale
exactly 1 / (1 - p).

QKV bias gradient (varlen, when asked: attention_varlen_bwd's bias_dtype). The QKV GEMM adds
the bias, so its gradient is the column sum of dqkv over the tokens, which the backward kernels
hold in registers: each query block also sums the columns of its dQ rows, each key block those of
its dK and dV rows (fp32, before rounding), into a row of fp32 partials [B * G, 3 * A * D] (block i
of sequence b at row b * G + i), and column_sums adds the rows. G = bias_grad_rows: as many blocks
as the smallest candidate tile leaves, so whichever candidate runs has a row per block, the rows
it leaves zero (zero-filled; autotuning runs on a scratch copy). 3 MB at BERT-large seq 128, batch
128, where a column sum of dqkv reads 100 MB. Deterministic: no atomics, a fixed order of additions.
The one-pass kernel stores each query block's sums as the block ends: one sum carried across its
loop spilled at 255 registers. (ptxas also spilled, at some small fp32 configs, the index
arithmetic of a sum stored in the reduction's own layout, hoisted across the loop: the dQ and
dK/dV kernels store theirs from the tile's own layout, dK/dV's before the tiles themselves.)

Atomic dQ (BERTFAST_ATTENTION_DQ=atomic, dq_mode(); sequences the one-pass kernel does not take). The
dK/dV kernel, which holds dS' for its keys, also forms each query block's sum_j dS'_ij k_j over them
and adds it to an fp32 accumulator [rows, A, D] (zero-filled; relaxed atomic adds, which sm_90 issues
four floats at a time); _attention_bwd_dq_store_kernel scales it by scale / (1 - p) into dQ and sums
its columns for the bias gradient. Five products per score element instead of seven, two kernels
instead of three, at the price of the accumulator's traffic (written zero, added to, read back: 4
bytes an element three times, 2 for dQ) and of the refinement of delta: the dK/dV kernel takes
d_i = dO_i . O_i as it stands (FlashAttention-2 does), which leaves fp16/bf16 gradients the error the
refinement removes (above: a key every padded row attends). dQ then depends on the order in which
the key blocks' adds land: not deterministic, so torch.use_deterministic_algorithms(True) keeps
the dQ kernel. The padding keys' rows of K load as 0, so their dS adds nothing to dQ.

Keep bits: the forward records its decisions for the backward, one bit per score element, and both
backward kernels read them back instead of drawing the mask again (a Philox call costs ~9
instructions per decision, a bit read back ~1; the mask was drawn three times). The uint8
[B, A, L / 2, L / 4] tensor holds element (16R + 8h + r, 16C + 8w + 2q + e) of (b, h)'s [L, L]
scores in bit 4h + 2w + e of byte (8R + r, 4C + q): the 8 elements of a byte are the ones one
thread holds of a 16 x 16 block in the layout of a score tile in registers (rows r and r + 8,
column pairs 8 apart), so packing and unpacking never move data between threads, whatever the
tile. The forward packs each tile from its dropped probabilities, so a bit is the decision where
the forward's P_ij != 0 and reads dropped where P_ij == 0. The backward's P_ij is never larger
than the forward's (the same exponent against the final max and sum instead of a running max; up
to the rounding of lse, at a P below 2**-126 that no fp32 sum keeps), so where a bit differs from
the draw the backward's P_ij is 0 and the bit does not count. (Packing the draws themselves
compiles to a second Philox chain in the store's layout.) fp32 (BYTEWISE_KEEP) does just that: its
dots run on the CUDA cores in blocked layouts, where a byte's 8 elements span threads and warps, and
with this packing (reshape, permute, a sum across warps) and unpacking its gradients with dropout
came out wrong on an H200 (2026-11-27; 16-bit passed; which half failed is not known). So fp32 draws
each byte in the byte's own layout (two Philox calls a byte: the same decisions, recorded also where
P is 0) and reads each element's bit from its own byte: elementwise code, nothing moves between
threads. L is the padded length rounded up to KEEP_ALIGN, a multiple of every tile, so tiles that
overhang a sequence stay inside the tensor and no byte load or store is masked: the bytes past a
sequence's end belong to rows and columns whose P is 0 or whose gradients are dropped. 1/8 byte per
score element: 17 MB per layer at BERT-large, seq 512, batch 32. With P Z = kept / (1 - p),
kept = keep ? P : 0, the backward forms dS (1 - p) = kept dP - P (1 - p) delta from one select of P,
which is also dV's operand, and scales dQ, dK and dV by 1 / (1 - p) once, at the end.

Layouts: varlen q, k, v, out, dout [T, A, D] (sequence b is rows cu_seqlens[b]:cu_seqlens[b+1]);
padded [B, S, A, D]. Row and head strides are honoured (packed qkv views work); the last dim
must be contiguous. lse: [A, T] (varlen) or [B, A, S] (padded), fp32.

Launch: on GPU each kernel is autotuned (key: next power of two of the sequence length, head
dim, varlen/mask/dropout flags, dtype); tuning runs on the first call of each key, so warm up
before capturing a CUDA graph. Under the interpreter a fixed small configuration is used.

Head dims: any from 8 to 256 (contract.MIN_HEAD_DIM..MAX_HEAD_DIM). The kernels work on a tile
BLOCK_D, the next power of two >= max(head dim, 16) (block_d): columns past the head dim load as 0,
so they add nothing to any dot product, and are never stored (as FlashAttention pads).

Limits: any sequence length (the dropout counter keeps rows independent up to 65536 positions);
fp32, fp16, bf16 (bf16 only on GPU: the interpreter's bf16 dot is wrong, so under
TRITON_INTERPRET=1 bf16 operands are upcast).
A query row with no valid key (a fully padded sequence) gives out = 0, lse = +inf and zero
gradients; sequences of length 0 contribute nothing. fp32 dots use IEEE precision (no TF32).
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from bertfast.contract import (KEEP_ALIGN, check_bias_dtype, check_cu_seqlens, check_dropout, check_head_dim,
                               check_keep_bits, check_key_padding_mask, check_qkv, check_tensor, env_choice,
                               env_setting, head_dim_reasons, keep_bits_shape, softmax_scale as _softmax_scale)

from . import _common
from ._common import autotune, cdiv, interpreting, launch, next_power_of_2, resident_programs
from ._philox import philox4x32
from ._rows import column_sums

# log2(e): a constexpr so the kernels can read it. _bwd_fused_block still writes the number out until
# a GPU run re-measures the one-pass backward: the perf model fits a kernel only while its source is
# as the last run measured it, and this kernel's miss is the fit's main evidence (same SASS either way).
_LOG2E = tl.constexpr(1.4426950408889634)
N_ROUNDS = tl.constexpr(7)  # Philox rounds of the dropout mask (header)
# What these kernels are, for `bertfast info`.
KERNELS = ("FlashAttention-2 in Triton (tl.dot on tensor cores), autotuned per shape; backward: one pass per "
           "(sequence, head) for short sequences, else delta, dQ and dK/dV kernels (or delta and dK/dV with an "
           "atomic dQ: BERTFAST_ATTENTION_DQ=atomic); the forward records its dropout decisions as keep bits for "
           "the backward")


# =========================================================================== jit helpers
@triton.jit
def _keep_threshold(dropout_p):
    """keep u >= p for u = bits / 2**16  <=>  bits >= ceil(p * 2**16) (uint32)."""
    return tl.ceil(dropout_p * 65536.0).to(tl.uint32)


@triton.jit
def _groups(start_n, BLOCK_N: tl.constexpr):
    """The Philox groups of a row that columns start_n .. start_n + BLOCK_N - 1 fall in: 4 per 32
    columns; a 16-column tile takes the 4 groups of its 32-column block."""
    tl.static_assert(BLOCK_N % 16 == 0)
    if BLOCK_N >= 32:
        groups = (start_n // 32) * 4 + tl.arange(0, BLOCK_N // 8)
    else:
        groups = (start_n // 32) * 4 + tl.arange(0, 4)
    return groups


@triton.jit
def _philox_words(seed_bh, rows, groups, WIDE: tl.constexpr = True):
    """The 4 Philox words of group ``groups`` of row ``rows`` (broadcasting tensors; header): WIDE, with
    _philox.py's wide products; else tl.randint4x's, the same words (fp32, which draws bytewise: at 8-warp
    16 x 16 tiles with a key mask, head dims 80 to 256, the wide products spilled 4-8 bytes on triton 3.9)."""
    if WIDE:
        words = philox4x32(seed_bh, rows * 8192 + groups, N_ROUNDS)  # 2**13 groups per row
    else:
        words = tl.randint4x(seed_bh, rows * 8192 + groups, N_ROUNDS)
    return words


@triton.jit
def _kept_halves(word, threshold):
    """The keep decisions of a Philox word's two 16-bit halves (header): (low half, high half)."""
    hi = (threshold << 16) - 1  # r >> 16 >= t  <=>  r > (t << 16) - 1 (uint32; t = 2**16 wraps: none kept)
    return (word & 0xFFFF) >= threshold, word > hi


@triton.jit
def _philox_bits(seed_bh, offs_m, start_n, threshold, BLOCK_N: tl.constexpr, WIDE: tl.constexpr):
    """The 8 keep decisions of each group of _groups (header), as 8 bool [BM, G] tensors: bit 2w + e
    is half e of Philox word w."""
    r0, r1, r2, r3 = _philox_words(seed_bh, offs_m[:, None], _groups(start_n, BLOCK_N)[None, :], WIDE)
    b0, b1 = _kept_halves(r0, threshold)
    b2, b3 = _kept_halves(r1, threshold)
    b4, b5 = _kept_halves(r2, threshold)
    b6, b7 = _kept_halves(r3, threshold)
    return b0, b1, b2, b3, b4, b5, b6, b7


@triton.jit
def _keep_tile(b0, b1, b2, b3, b4, b5, b6, b7, start_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] keep flags from the groups' decisions (_philox_bits): column
    32m + 8w + 2q + e of the tile is decision 2w + e of group 4m + q. The tensors are only joined and
    reshaped, never moved between threads: in the layout of the score tile (each thread holds pairs of
    columns 8 apart) a group's 8 columns sit in one thread."""
    if BLOCK_N >= 32:
        NB: tl.constexpr = BLOCK_N // 32
        keep = tl.join(tl.join(tl.join(b0, b1), tl.join(b2, b3)),
                       tl.join(tl.join(b4, b5), tl.join(b6, b7)))                 # [BM, 4NB, e, w0, w1]
        keep = tl.permute(tl.reshape(keep, (BLOCK_M, NB, 4, 2, 2, 2)), (0, 1, 5, 4, 2, 3))  # [BM, m, w1, w0, q, e]
    else:
        # A 16-column tile is half a 32-column block: words 0, 1 (first half) or 2, 3 (second).
        second = (start_n % 32) != 0
        keep = tl.join(tl.join(tl.where(second, b4, b0), tl.where(second, b5, b1)),
                       tl.join(tl.where(second, b6, b2), tl.where(second, b7, b3)))  # [BM, 4, e, w0]
        keep = tl.permute(keep, (0, 3, 1, 2))                                          # [BM, w0, q, e]
    return tl.reshape(keep, (BLOCK_M, BLOCK_N))


@triton.jit
def _dropout_keep(seed_bh, offs_m, start_n, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  WIDE: tl.constexpr = True):
    """[BLOCK_M, BLOCK_N] keep flags (True = kept) of rows offs_m, columns start_n + n (WIDE: _philox_words)."""
    b0, b1, b2, b3, b4, b5, b6, b7 = _philox_bits(seed_bh, offs_m, start_n, threshold, BLOCK_N, WIDE)
    return _keep_tile(b0, b1, b2, b3, b4, b5, b6, b7, start_n, BLOCK_M, BLOCK_N)


@triton.jit
def _drop_and_record(p, seed_bh, offs_m, start_m, start_n, threshold, keep_base, keep_rows, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BYTEWISE_KEEP: tl.constexpr):
    """The forward's probability tile p with its dropped elements 0, and its keep bits stored for the
    backward (header, "Keep bits") at keep_base + keep_rows[:, None] + byte column."""
    # fp32 (BYTEWISE_KEEP) draws with tl.randint4x (_philox_words)
    p = tl.where(_dropout_keep(seed_bh, offs_m, start_n, threshold, BLOCK_M, BLOCK_N, not BYTEWISE_KEEP), p, 0.0)
    if BYTEWISE_KEEP:
        cols = start_n // 4 + tl.arange(0, BLOCK_N // 4)
        byte = _drawn_keep_bytes(seed_bh, start_m, cols, threshold, BLOCK_M, BLOCK_N)
    else:
        # Packed from the dropped tile (bit = P != 0, header) over its (h, w, e) axes, which each thread
        # holds in registers: nothing is rematerialised, so only the bytes change layout for the store.
        # (Packed from the draws, the store compiles to a second Philox chain in its own layout.) The bit
        # is min(P's bits as int32, 1): P is +0 or positive (a GPU's NaN too), one VIMNMX an element; the
        # bits are added in a tree of splits. As P != 0 summed over an axis, ptxas got an FSETP, a SEL
        # and byte shuffles (PRMT) an element: 652 instructions an iteration of the forward at BERT's
        # tiles, 608 so (with tl.randint4x: _philox.py).
        bits = tl.minimum(p.to(tl.int32, bitcast=True), 1)
        bits = tl.reshape(bits, (BLOCK_M // 16, 2, 8, BLOCK_N // 16, 2, 4, 2))  # [R, h, r, C, w, q, e]
        bits = tl.permute(bits, (0, 2, 3, 5, 1, 4, 6))                          # [R, r, C, q, h, w, e]
        bits = tl.reshape(bits, (BLOCK_M // 2, BLOCK_N // 4, 2, 2, 2))           # [byte row, col, h, w, e]
        e0, e1 = tl.split(bits)
        w0, w1 = tl.split(e0 + (e1 << 1))
        h0, h1 = tl.split(w0 + (w1 << 2))
        byte = h0 + (h1 << 4)
        cols = start_n // 4 + tl.arange(0, BLOCK_N // 4)
    tl.store(keep_base + (keep_rows[:, None] + cols[None, :]), byte.to(tl.uint8))
    return p


@triton.jit
def _stored_keep(keep_base, keep_rows, start_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The forward's keep flags of a [BLOCK_M, BLOCK_N] tile read back from its bytes (_drop_and_record),
    each byte tested against the bit of each of its 8 elements, laid out as [R, h, r, C, w, q, e]: the
    h, w, e axes each thread holds in registers, so the bits are constants there, one test per
    element, and no bool tensors are joined and permuted (which compiled to byte shuffles per element)."""
    cols = start_n // 4 + tl.arange(0, BLOCK_N // 4)
    byte = tl.load(keep_base + (keep_rows[:, None] + cols[None, :])).to(tl.int32)    # [BM / 2, BN / 4]
    h = tl.arange(0, 2)[:, None, None]
    w = tl.arange(0, 2)[None, :, None]
    e = tl.arange(0, 2)[None, None, :]
    bit = tl.reshape(1 << (4 * h + 2 * w + e), (1, 2, 1, 1, 2, 1, 2))
    keep = (tl.reshape(byte, (BLOCK_M // 16, 1, 8, BLOCK_N // 16, 1, 4, 1)) & bit) != 0
    return tl.reshape(keep, (BLOCK_M, BLOCK_N))


@triton.jit
def _drawn_keep_bytes(seed_bh, start_m, cols, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """BYTEWISE_KEEP: the bytes of query rows start_m .. start_m + BLOCK_M - 1 at byte columns cols,
    [BLOCK_M / 2, BLOCK_N / 4] int32, drawn in their own layout (header, "Keep bits"): byte (8R + r, 4C + q)
    of rows 16R + 8h + r takes, for each h, words 2 (C % 2) and 2 (C % 2) + 1 of the Philox call of
    group 4 (C // 2) + q (columns 16C + 8w + 2q + e are word 2 (C % 2) + w, half e)."""
    a = tl.arange(0, BLOCK_M // 2)
    rows = start_m + (a // 8) * 16 + a % 8  # h = 0; h = 1 is 8 rows further
    groups = (cols // 8) * 4 + cols % 4
    odd = ((cols // 4) % 2 == 1)[None, :]
    byte = tl.zeros([BLOCK_M // 2, BLOCK_N // 4], tl.int32)
    for h in tl.static_range(2):
        r0, r1, r2, r3 = _philox_words(seed_bh, (rows + 8 * h)[:, None], groups[None, :], False)
        k0, k1 = _kept_halves(tl.where(odd, r2, r0), threshold)  # w = 0: bits 0, 1
        k2, k3 = _kept_halves(tl.where(odd, r3, r1), threshold)  # w = 1: bits 2, 3
        nibble = k0.to(tl.int32) | (k1.to(tl.int32) << 1) | (k2.to(tl.int32) << 2) | (k3.to(tl.int32) << 3)
        byte = byte | (nibble << (4 * h))
    return byte


@triton.jit
def _gathered_keep(keep_base, rows, cols, keep_len):
    """BYTEWISE_KEEP: the keep flags of elements (rows, cols) of the (b, h) block (broadcasting index
    tensors, either orientation), each read from its own byte (header, "Keep bits")."""
    byte_rows = (rows // 16) * 8 + rows % 8
    byte = tl.load(keep_base + (byte_rows * (keep_len // 4) + (cols // 16) * 4 + (cols % 8) // 2))
    return ((byte.to(tl.int32) >> (4 * ((rows // 8) % 2) + 2 * ((cols // 8) % 2) + cols % 2)) & 1) != 0


@triton.jit
def _keep_flags(keep_base, block_rows, offs_m, start_n, keep_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BYTEWISE_KEEP: tl.constexpr, KEYS_MAJOR: tl.constexpr):
    """The forward's keep flags of query rows offs_m (byte rows block_rows) and keys start_n ..
    start_n + BLOCK_N - 1: [BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M] KEYS_MAJOR."""
    if BYTEWISE_KEEP:
        keys = start_n + tl.arange(0, BLOCK_N)
        if KEYS_MAJOR:
            keep = _gathered_keep(keep_base, offs_m[None, :], keys[:, None], keep_len)
        else:
            keep = _gathered_keep(keep_base, offs_m[:, None], keys[None, :], keep_len)
    else:
        keep = _stored_keep(keep_base, block_rows, start_n, BLOCK_M, BLOCK_N)
        if KEYS_MAJOR:
            keep = tl.trans(keep)
    return keep


@triton.jit
def _keep_block(KEEP, b64, h64, num_heads, keep_len):
    """(sequence b, head h)'s block of the keep bits [B, A, L / 2, L / 4] (header)."""
    return KEEP + (b64 * num_heads + h64) * (keep_len // 2) * (keep_len // 4)


@triton.jit
def _keep_rows(start_m, keep_len, BLOCK_M: tl.constexpr):
    """Offsets in a (b, h) block of the byte rows of query rows start_m .. start_m + BLOCK_M - 1 (int32
    offsets from _keep_block, not pointers: half the registers held across the loops)."""
    return (start_m // 2 + tl.arange(0, BLOCK_M // 2)) * (keep_len // 4)


@triton.jit
def _load_tile(ptrs, row_ok, MASK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """A [rows, BLOCK_D] tile: rows outside row_ok (when MASK_ROWS) and columns >= HEAD_DIM read 0,
    so the padded columns add nothing to any dot product."""
    if HEAD_DIM == BLOCK_D:
        if MASK_ROWS:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs)
    else:
        col_ok = tl.arange(0, BLOCK_D) < HEAD_DIM
        if MASK_ROWS:
            x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
    return x


@triton.jit
def _store_tile(ptrs, x, row_ok, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store the rows in row_ok and the HEAD_DIM real columns of a [rows, BLOCK_D] tile."""
    if HEAD_DIM == BLOCK_D:
        tl.store(ptrs, x, mask=row_ok[:, None])
    else:
        tl.store(ptrs, x, mask=row_ok[:, None] & (tl.arange(0, BLOCK_D) < HEAD_DIM)[None, :])


@triton.jit
def _seq_range(CU_SEQLENS, b, seqlen, IS_VARLEN: tl.constexpr):
    """(first token row of sequence b, its length). Padded form: (0, S)."""
    if IS_VARLEN:
        start = tl.load(CU_SEQLENS + b)
        length = tl.load(CU_SEQLENS + b + 1) - start
        start = start.to(tl.int64)
    else:
        start = 0
        length = seqlen
    return start, length


@triton.jit
def _rng_key(SEED, b, h, num_heads, HAS_DROPOUT: tl.constexpr):
    """Philox key: seed in the low 32 bits, the (batch, head) stream in the high 32 bits."""
    if HAS_DROPOUT:
        seed = tl.load(SEED).to(tl.int64)
        key = seed + (b * num_heads + h).to(tl.int64) * 4294967296
    else:
        key = 0
    return key


@triton.jit
def _key_block(K, V, b64, h64, seq_start, offs_n, key_in, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
               stride_vh, UPCAST: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               MASK_ROWS: tl.constexpr = True):
    """The K and V rows offs_n of sequence b, head h (rows outside key_in read 0, or unmasked without
    MASK_ROWS) that a backward program holds for its whole loop; fp32 when UPCAST."""
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_tile(K + b64 * stride_kb + seq_start * stride_ks + h64 * stride_kh
                   + offs_n[:, None] * stride_ks + offs_d[None, :], key_in, MASK_ROWS, HEAD_DIM, BLOCK_D)
    v = _load_tile(V + b64 * stride_vb + seq_start * stride_vs + h64 * stride_vh
                   + offs_n[:, None] * stride_vs + offs_d[None, :], key_in, MASK_ROWS, HEAD_DIM, BLOCK_D)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _store_key_grads(DK, DV, dk, dv, b64, h64, seq_start, offs_n, key_in, stride_dkb, stride_dks, stride_dkh,
                     stride_dvb, stride_dvs, stride_dvh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """dK and dV of _key_block's keys, the rows in key_in, in DK's and DV's dtypes."""
    offs_d = tl.arange(0, BLOCK_D)
    _store_tile(DK + b64 * stride_dkb + seq_start * stride_dks + h64 * stride_dkh
                + offs_n[:, None] * stride_dks + offs_d[None, :],
                dk.to(DK.dtype.element_ty), key_in, HEAD_DIM, BLOCK_D)
    _store_tile(DV + b64 * stride_dvb + seq_start * stride_dvs + h64 * stride_dvh
                + offs_n[:, None] * stride_dvs + offs_d[None, :],
                dv.to(DV.dtype.element_ty), key_in, HEAD_DIM, BLOCK_D)


@triton.jit
def _store_bias_grad_tile(DB, row, stride_db, which, h, num_heads, tile, HEAD_DIM: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """_store_bias_grad of tile's column sums, stored from the tile's own layout (its first row
    holds them): no layout conversion, whose index arithmetic ptxas would spill across the loop."""
    offs_r = tl.arange(0, BLOCK_R)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    sums = tl.broadcast_to(tl.sum(tile, 0, keep_dims=True), [BLOCK_R, BLOCK_D])
    col = (which * num_heads + h) * HEAD_DIM
    tl.store(DB + row.to(tl.int64) * stride_db + col + (offs_r * 0 + offs_d), sums,
             mask=(offs_r == 0) & (offs_d < HEAD_DIM))


@triton.jit
def _store_bias_grad(DB, row, stride_db, which, h, num_heads, grad, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     ok=None):
    """grad [BLOCK_D], the column sums of one program's dQ (which 0), dK (1) or dV (2) rows of head h,
    into row ``row`` of the QKV bias gradient's fp32 partials (header, "QKV bias gradient"); nothing
    where ``ok`` ([BLOCK_D], if given) is false."""
    offs_d = tl.arange(0, BLOCK_D)
    col = (which * num_heads + h) * HEAD_DIM
    mask = offs_d < HEAD_DIM
    if ok is not None:
        mask = mask & ok
    tl.store(DB + row.to(tl.int64) * stride_db + col + offs_d, grad, mask=mask)


# =========================================================================== forward
@triton.jit
def _fwd_block(acc, l_i, m_i, q, k_ptrs, v_ptrs, kmask_ptrs, keep_base, keep_rows, start_m, start_n, seq_len, offs_m,
               offs_n, stride_ks, stride_vs, stride_ms, qk_scale, seed_bh, threshold,
               MASKED: tl.constexpr, HAS_KEY_MASK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
               UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, BYTEWISE_KEEP: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One key block of the online softmax; MASKED handles the tail block and key padding."""
    key_ok = (start_n + offs_n) < seq_len  # [BN]; read only when MASKED
    k = _load_tile(k_ptrs + start_n * stride_ks, key_ok, MASKED, HEAD_DIM, BLOCK_D)
    if UPCAST:
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BM, BN] unscaled scores
    if MASKED:
        if HAS_KEY_MASK:
            key_ok = key_ok & (tl.load(kmask_ptrs + (start_n + offs_n) * stride_ms,
                                       mask=key_ok, other=0) != 0)
        qk = tl.where(key_ok[None, :], qk, float("-inf"))
    # qk_scale > 0 commutes with max, so the scale folds into one FMA inside exp2 below.
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # running max, log2 units
    if MASKED:
        # A row whose keys so far are all masked has m = -inf; exp2(-inf - -inf) would be NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.exp2(qk * qk_scale - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if HAS_DROPOUT:
        # l_i sums the undropped probabilities; only the product with V sees the 0/1 mask
        # (the 1 / (1 - p) is applied once, at the end).
        p = _drop_and_record(p, seed_bh, offs_m, start_m, start_n, threshold, keep_base, keep_rows, BLOCK_M, BLOCK_N,
                             BYTEWISE_KEEP)
    v = _load_tile(v_ptrs + start_n * stride_vs, key_ok, MASKED, HEAD_DIM, BLOCK_D)
    if UPCAST:
        v = v.to(tl.float32)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _attention_fwd_kernel(
    Q,           # [B, S, A, D] or [T, A, D] queries (row/head strides given)
    K,           # keys, same layout
    V,           # values, same layout
    Out,         # output, same layout; written
    LSE,         # fp32 [B, A, S] or [A, T]; written (natural log, +inf for rows with no key)
    CU_SEQLENS,  # int32 [B + 1] sequence starts (varlen only)
    KEY_MASK,    # [B, S] 1 = token, 0 = pad (padded form with a mask only)
    SEED,        # int64 [1] dropout seed (dropout only)
    KEEP,        # uint8 [B, A, L / 2, L / 4] keep bits (dropout only); written (header)
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh,
    stride_mb, stride_ms,
    seqlen, num_heads, qk_scale, dropout_p, seqlen_bucket, keep_len,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, BYTEWISE_KEEP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    seq_start, seq_len = _seq_range(CU_SEQLENS, b, seqlen, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= seq_len:
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seq_len

    q_ptrs = (Q + b64 * stride_qb + seq_start * stride_qs + h64 * stride_qh
              + offs_m[:, None] * stride_qs + offs_d[None, :])
    q = _load_tile(q_ptrs, row_ok, True, HEAD_DIM, BLOCK_D)  # [BM, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    k_ptrs = (K + b64 * stride_kb + seq_start * stride_ks + h64 * stride_kh
              + offs_n[:, None] * stride_ks + offs_d[None, :])
    v_ptrs = (V + b64 * stride_vb + seq_start * stride_vs + h64 * stride_vh
              + offs_n[:, None] * stride_vs + offs_d[None, :])
    kmask_ptrs = KEY_MASK + b64 * stride_mb

    seed_bh = _rng_key(SEED, b, h, num_heads, HAS_DROPOUT)
    threshold = _keep_threshold(dropout_p)
    inv_keep = 1.0 / (1.0 - dropout_p)
    keep_base = _keep_block(KEEP, b64, h64, num_heads, keep_len)
    keep_rows = _keep_rows(start_m, keep_len, BLOCK_M)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Full key blocks without masks, then the tail; with key padding every block is masked.
    if HAS_KEY_MASK:
        n_full = 0
    else:
        n_full = (seq_len // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):
        acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, k_ptrs, v_ptrs, kmask_ptrs, keep_base, keep_rows, start_m,
                                   start_n, seq_len, offs_m, offs_n, stride_ks, stride_vs, stride_ms, qk_scale,
                                   seed_bh, threshold, False, HAS_KEY_MASK, HAS_DROPOUT,
                                   UPCAST, DOT_PREC, BYTEWISE_KEEP, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N)
    for start_n in range(n_full, seq_len, BLOCK_N):
        acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, k_ptrs, v_ptrs, kmask_ptrs, keep_base, keep_rows, start_m,
                                   start_n, seq_len, offs_m, offs_n, stride_ks, stride_vs, stride_ms, qk_scale,
                                   seed_bh, threshold, True, HAS_KEY_MASK, HAS_DROPOUT,
                                   UPCAST, DOT_PREC, BYTEWISE_KEEP, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N)

    empty = l_i == 0.0  # no valid key: out 0, lse +inf (backward then sees P = 0)
    l_safe = tl.where(empty, 1.0, l_i)
    if HAS_DROPOUT:
        acc = acc * (inv_keep / l_safe)[:, None]
    else:
        acc = acc * (1.0 / l_safe)[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)

    o_ptrs = (Out + b64 * stride_ob + seq_start * stride_os + h64 * stride_oh
              + offs_m[:, None] * stride_os + offs_d[None, :])
    _store_tile(o_ptrs, acc.to(Out.dtype.element_ty), row_ok, HEAD_DIM, BLOCK_D)
    tl.store(LSE + b64 * stride_lb + h64 * stride_lh + seq_start + offs_m, lse, mask=row_ok)


# =========================================================================== backward
@triton.jit
def _attention_bwd_delta_kernel(
    Out,         # forward output, [B, S, A, D] or [T, A, D]
    DO,          # upstream gradient, same layout
    DELTA,       # fp32, lse layout; written: rowsum(dO * O)
    CU_SEQLENS,  # int32 [B + 1] (varlen only)
    stride_ob, stride_os, stride_oh,
    stride_db, stride_ds, stride_dh,
    stride_lb, stride_lh,
    seqlen,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    seq_start, seq_len = _seq_range(CU_SEQLENS, b, seqlen, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= seq_len:
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seq_len
    o = _load_tile(Out + b64 * stride_ob + seq_start * stride_os + h64 * stride_oh
                   + offs_m[:, None] * stride_os + offs_d[None, :], row_ok, True, HEAD_DIM, BLOCK_D)
    do = _load_tile(DO + b64 * stride_db + seq_start * stride_ds + h64 * stride_dh
                    + offs_m[:, None] * stride_ds + offs_d[None, :], row_ok, True, HEAD_DIM, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # [BM]
    tl.store(DELTA + b64 * stride_lb + h64 * stride_lh + seq_start + offs_m, delta, mask=row_ok)


@triton.jit
def _bwd_kv_block(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, keep_base, keep_rows, start_m, start_n,
                  seq_len, stride_qs, stride_dos, qk_scale, keep_len, keep_frac,
                  MASKED: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
                  BYTEWISE_KEEP: tl.constexpr, QUERY_MAJOR: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dK, dV contributions of one query block. QUERY_MAJOR: scores in the forward's [queries, keys]
    orientation, so the dropout mask is unpacked in the register layout it has there (_stored_keep),
    and dV, dK take the transposed P and dS from shared memory; else in [keys, queries], the
    products' own orientation, with the mask transposed through shared memory. A launch config
    picks (the first suits wgmma tiles, the second fp32 and the largest head dims, where the first
    spills).

    Keys are not masked here: a padded or out-of-range key only pollutes its own dK/dV row,
    which the caller zeroes or skips. Out-of-range queries load q = dO = 0, lse = delta = 0,
    so they contribute exactly 0.
    """
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < seq_len
    q = _load_tile(q_ptrs + start_m * stride_qs, row_ok, MASKED, HEAD_DIM, BLOCK_D)
    do = _load_tile(do_ptrs + start_m * stride_dos, row_ok, MASKED, HEAD_DIM, BLOCK_D)
    if MASKED:
        lse = tl.load(lse_ptr + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + offs_m, mask=row_ok, other=0.0)
    else:
        lse = tl.load(lse_ptr + offs_m)
        delta = tl.load(delta_ptr + offs_m)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2 = lse * _LOG2E  # log2 units, for exp2
    # With dropout, P Z = kept / (1 - p), kept = keep ? P : 0, and dS = P (Z dP - delta) =
    # (kept dP - P (1 - p) delta) / (1 - p): the block sums the numerators, from one select of P that
    # is also dV's operand, and the caller scales dK and dV by 1 / (1 - p) once, at the end.
    if HAS_DROPOUT:
        delta = delta * keep_frac
        block_rows = keep_rows + (start_m // 2) * (keep_len // 4)  # this query block's byte rows
    if QUERY_MAJOR:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BM, BN]
        p = tl.exp2(s * qk_scale - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)  # [BM, BN]
        if HAS_DROPOUT:
            keep = _keep_flags(keep_base, block_rows, offs_m, start_n, keep_len, BLOCK_M, BLOCK_N, BYTEWISE_KEEP,
                               False)
            kept = tl.where(keep, p, 0.0)
            dv = tl.dot(tl.trans(kept.to(do.dtype)), do, dv, input_precision=DOT_PREC)
            ds = kept * dp - p * delta[:, None]
        else:
            dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=DOT_PREC)
            ds = p * (dp - delta[:, None])
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=DOT_PREC)
    else:
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)  # [BN, BM]
        p_t = tl.exp2(s_t * qk_scale - lse2[None, :])
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # [BN, BM]
        if HAS_DROPOUT:
            keep_t = _keep_flags(keep_base, block_rows, offs_m, start_n, keep_len, BLOCK_M, BLOCK_N, BYTEWISE_KEEP,
                                 True)
            kept_t = tl.where(keep_t, p_t, 0.0)
            dv = tl.dot(kept_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
            ds_t = kept_t * dp_t - p_t * delta[None, :]
        else:
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
            ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def _attention_bwd_dkdv_kernel(
    Q,           # [B, S, A, D] or [T, A, D] queries
    K,           # keys, same layout
    V,           # values, same layout
    DO,          # upstream gradient of the output, same layout
    LSE,         # fp32 [B, A, S] or [A, T] from the forward
    DELTA,       # fp32, lse layout, delta (refined by _attention_bwd_dq_kernel in fp16/bf16)
    DK,          # written: dK, q layout (its own strides)
    DV,          # written: dV, q layout (its own strides)
    CU_SEQLENS,  # int32 [B + 1] (varlen only)
    KEY_MASK,    # [B, S] 1 = token (padded form with a mask only)
    KEEP,        # uint8 keep bits from the forward (dropout only)
    DB,          # fp32 [B * db_rows, 3 * A * D], zeros: QKV bias gradient partials (HAS_DB only)
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_lb, stride_lh,
    stride_mb, stride_ms,
    stride_db, db_rows,
    seqlen, num_heads, softmax_scale, qk_scale, dropout_p, inv_keep, seqlen_bucket, keep_len,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, BYTEWISE_KEEP: tl.constexpr,
    HAS_DB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QUERY_MAJOR: tl.constexpr,
):
    """One program per (key block, head, sequence): dK, dV of BLOCK_N keys over all queries."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    seq_start, seq_len = _seq_range(CU_SEQLENS, b, seqlen, IS_VARLEN)
    start_n = pid_n * BLOCK_N
    if start_n >= seq_len:
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    key_in = offs_n < seq_len

    k, v = _key_block(K, V, b64, h64, seq_start, offs_n, key_in, stride_kb, stride_ks, stride_kh, stride_vb,
                      stride_vs, stride_vh, UPCAST, HEAD_DIM, BLOCK_D)
    q_ptrs = (Q + b64 * stride_qb + seq_start * stride_qs + h64 * stride_qh
              + offs_m0[:, None] * stride_qs + offs_d[None, :])
    do_ptrs = (DO + b64 * stride_dob + seq_start * stride_dos + h64 * stride_doh
               + offs_m0[:, None] * stride_dos + offs_d[None, :])
    lse_ptr = LSE + b64 * stride_lb + h64 * stride_lh + seq_start
    delta_ptr = DELTA + b64 * stride_lb + h64 * stride_lh + seq_start

    keep_base = _keep_block(KEEP, b64, h64, num_heads, keep_len)
    keep_rows = _keep_rows(0, keep_len, BLOCK_M)
    keep_frac = 1.0 - dropout_p
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    m_full = (seq_len // BLOCK_M) * BLOCK_M
    for start_m in range(0, m_full, BLOCK_M):
        dk, dv = _bwd_kv_block(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, keep_base, keep_rows, start_m,
                               start_n, seq_len, stride_qs, stride_dos, qk_scale, keep_len, keep_frac, False,
                               HAS_DROPOUT, UPCAST, DOT_PREC, BYTEWISE_KEEP, QUERY_MAJOR, HEAD_DIM, BLOCK_D, BLOCK_M,
                               BLOCK_N)
    for start_m in range(m_full, seq_len, BLOCK_M):
        dk, dv = _bwd_kv_block(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, keep_base, keep_rows, start_m,
                               start_n, seq_len, stride_qs, stride_dos, qk_scale, keep_len, keep_frac, True,
                               HAS_DROPOUT, UPCAST, DOT_PREC, BYTEWISE_KEEP, QUERY_MAJOR, HEAD_DIM, BLOCK_D, BLOCK_M,
                               BLOCK_N)

    key_ok = key_in
    if HAS_KEY_MASK:
        key_ok = key_ok & (tl.load(KEY_MASK + b64 * stride_mb + offs_n * stride_ms,
                                   mask=key_in, other=0) != 0)
    # Padding keys got garbage from the unmasked recomputation above: their gradient is 0.
    if HAS_DROPOUT:
        dk = dk * (softmax_scale * inv_keep)
        dv = dv * inv_keep
    else:
        dk = dk * softmax_scale
    dk = tl.where(key_ok[:, None], dk, 0.0)
    dv = tl.where(key_ok[:, None], dv, 0.0)
    if HAS_DB:
        row = b64 * db_rows + start_n // BLOCK_N
        _store_bias_grad_tile(DB, row, stride_db, 1, h64, num_heads, dk, HEAD_DIM, BLOCK_N, BLOCK_D)
        _store_bias_grad_tile(DB, row, stride_db, 2, h64, num_heads, dv, HEAD_DIM, BLOCK_N, BLOCK_D)
    _store_key_grads(DK, DV, dk, dv, b64, h64, seq_start, offs_n, key_in, stride_dkb, stride_dks, stride_dkh,
                     stride_dvb, stride_dvs, stride_dvh, HEAD_DIM, BLOCK_D)


@triton.jit
def _bwd_q_block(dq, pk, resid, q, do, lse2, delta, k_ptrs, v_ptrs, kmask_ptrs, keep_base, keep_rows, start_n,
                 seq_len, offs_m, offs_n, stride_ks, stride_vs, stride_ms, qk_scale, keep_len,
                 MASKED: tl.constexpr, HAS_KEY_MASK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                 UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, BYTEWISE_KEEP: tl.constexpr,
                 REFINE_DELTA: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ contribution of one key block; with REFINE_DELTA also sum_j P_ij k_j (pk) and the row
    sums of dS (resid), for the refinement of delta (header). With dropout, dS times (1 - p) as in
    _bwd_kv_block (delta arrives times (1 - p)); the caller scales by 1 / (1 - p)."""
    key_ok = (start_n + offs_n) < seq_len  # read only when MASKED
    k = _load_tile(k_ptrs + start_n * stride_ks, key_ok, MASKED, HEAD_DIM, BLOCK_D)
    v = _load_tile(v_ptrs + start_n * stride_vs, key_ok, MASKED, HEAD_DIM, BLOCK_D)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BM, BN]
    p = tl.exp2(s * qk_scale - lse2[:, None])
    if MASKED:
        if HAS_KEY_MASK:
            key_ok = key_ok & (tl.load(kmask_ptrs + (start_n + offs_n) * stride_ms,
                                       mask=key_ok, other=0) != 0)
        p = tl.where(key_ok[None, :], p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)  # [BM, BN]
    if HAS_DROPOUT:
        keep = _keep_flags(keep_base, keep_rows, offs_m, start_n, keep_len, BLOCK_M, BLOCK_N, BYTEWISE_KEEP, False)
        kept = tl.where(keep, p, 0.0)
        ds = kept * dp - p * delta[:, None]
    else:
        ds = p * (dp - delta[:, None])
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    if REFINE_DELTA:
        pk = tl.dot(p.to(k.dtype), k, pk, input_precision=DOT_PREC)
        resid += tl.sum(ds, 1)
    return dq, pk, resid


@triton.jit
def _attention_bwd_dq_kernel(
    Q,           # [B, S, A, D] or [T, A, D] queries
    K,           # keys, same layout
    V,           # values, same layout
    DO,          # upstream gradient of the output, same layout
    LSE,         # fp32 [B, A, S] or [A, T] from the forward
    DELTA,       # fp32, lse layout, rowsum(dO * O) from _attention_bwd_delta_kernel
    DELTA_OUT,   # fp32, lse layout; written (REFINE_DELTA only): delta refined, for the dK/dV kernel
    DQ,          # written: dQ, q layout (its own strides)
    CU_SEQLENS,  # int32 [B + 1] (varlen only)
    KEY_MASK,    # [B, S] 1 = token (padded form with a mask only)
    KEEP,        # uint8 keep bits from the forward (dropout only)
    DB,          # fp32 [B * db_rows, 3 * A * D], zeros: QKV bias gradient partials (HAS_DB only)
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh,
    stride_mb, stride_ms,
    stride_db, db_rows,
    seqlen, num_heads, softmax_scale, qk_scale, dropout_p, inv_keep, seqlen_bucket, keep_len,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, BYTEWISE_KEEP: tl.constexpr,
    HAS_DB: tl.constexpr,
    REFINE_DELTA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (query block, head, sequence): dQ of BLOCK_M queries over all keys, and
    with REFINE_DELTA their delta refined (header)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    seq_start, seq_len = _seq_range(CU_SEQLENS, b, seqlen, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= seq_len:
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seq_len

    q = _load_tile(Q + b64 * stride_qb + seq_start * stride_qs + h64 * stride_qh
                   + offs_m[:, None] * stride_qs + offs_d[None, :], row_ok, True, HEAD_DIM, BLOCK_D)
    do = _load_tile(DO + b64 * stride_dob + seq_start * stride_dos + h64 * stride_doh
                    + offs_m[:, None] * stride_dos + offs_d[None, :], row_ok, True, HEAD_DIM, BLOCK_D)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse_off = b64 * stride_lb + h64 * stride_lh + seq_start + offs_m
    lse2 = tl.load(LSE + lse_off, mask=row_ok, other=0.0) * _LOG2E
    delta = tl.load(DELTA + lse_off, mask=row_ok, other=0.0)
    k_ptrs = (K + b64 * stride_kb + seq_start * stride_ks + h64 * stride_kh
              + offs_n[:, None] * stride_ks + offs_d[None, :])
    v_ptrs = (V + b64 * stride_vb + seq_start * stride_vs + h64 * stride_vh
              + offs_n[:, None] * stride_vs + offs_d[None, :])
    kmask_ptrs = KEY_MASK + b64 * stride_mb

    keep_base = _keep_block(KEEP, b64, h64, num_heads, keep_len)
    keep_rows = _keep_rows(start_m, keep_len, BLOCK_M)
    keep_frac = 1.0 - dropout_p
    delta_in = delta
    if HAS_DROPOUT:
        delta_in = delta * keep_frac  # the blocks' dS are times (1 - p)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    pk = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # sum_j P_ij k_j (REFINE_DELTA only)
    resid = tl.zeros([BLOCK_M], tl.float32)        # r_i = sum_j dS'_ij (REFINE_DELTA only)
    if HAS_KEY_MASK:
        n_full = 0
    else:
        n_full = (seq_len // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):
        dq, pk, resid = _bwd_q_block(dq, pk, resid, q, do, lse2, delta_in, k_ptrs, v_ptrs, kmask_ptrs, keep_base,
                                     keep_rows, start_n, seq_len, offs_m, offs_n, stride_ks, stride_vs, stride_ms,
                                     qk_scale, keep_len, False, HAS_KEY_MASK, HAS_DROPOUT, UPCAST,
                                     DOT_PREC, BYTEWISE_KEEP, REFINE_DELTA, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N)
    for start_n in range(n_full, seq_len, BLOCK_N):
        dq, pk, resid = _bwd_q_block(dq, pk, resid, q, do, lse2, delta_in, k_ptrs, v_ptrs, kmask_ptrs, keep_base,
                                     keep_rows, start_n, seq_len, offs_m, offs_n, stride_ks, stride_vs, stride_ms,
                                     qk_scale, keep_len, True, HAS_KEY_MASK, HAS_DROPOUT, UPCAST,
                                     DOT_PREC, BYTEWISE_KEEP, REFINE_DELTA, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N)
    if REFINE_DELTA:
        dq -= resid[:, None] * pk
        tl.store(DELTA_OUT + lse_off, delta + resid * inv_keep, mask=row_ok)
    dq = dq * (softmax_scale * inv_keep)
    if HAS_DB:  # rows past the end: q, dO 0, so dS 0 and dQ 0
        _store_bias_grad_tile(DB, b64 * db_rows + pid_m, stride_db, 0, h64, num_heads, dq, HEAD_DIM, BLOCK_M,
                              BLOCK_D)
    _store_tile(DQ + b64 * stride_dqb + seq_start * stride_dqs + h64 * stride_dqh
                + offs_m[:, None] * stride_dqs + offs_d[None, :],
                dq.to(DQ.dtype.element_ty), row_ok, HEAD_DIM, BLOCK_D)


# =========================================================================== backward, atomic dQ
@triton.jit
def _bwd_kv_atomic_dq_block(dk, dv, k, v, q_ptrs, do_ptrs, dq_base, lse_ptr, delta_ptr, keep_base, keep_rows, start_m,
                            start_n, seq_len, stride_qs, stride_dos, stride_dqs, qk_scale, keep_len, keep_frac,
                            MASKED: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
                            DOT_PREC: tl.constexpr, BYTEWISE_KEEP: tl.constexpr, QUERY_MAJOR: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    """_bwd_kv_block's dK, dV contributions of one query block, and its dQ contribution sum_j dS'_ij k_j
    added to its rows of the fp32 accumulator at dq_base (header, "Atomic dQ"). The caller zeroes the K
    rows of padding keys, so their dS adds nothing."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < seq_len
    q = _load_tile(q_ptrs + start_m * stride_qs, row_ok, MASKED, HEAD_DIM, BLOCK_D)
    do = _load_tile(do_ptrs + start_m * stride_dos, row_ok, MASKED, HEAD_DIM, BLOCK_D)
    if MASKED:
        lse = tl.load(lse_ptr + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + offs_m, mask=row_ok, other=0.0)
    else:
        lse = tl.load(lse_ptr + offs_m)
        delta = tl.load(delta_ptr + offs_m)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2 = lse * _LOG2E
    if HAS_DROPOUT:
        delta = delta * keep_frac
        block_rows = keep_rows + (start_m // 2) * (keep_len // 4)
    if QUERY_MAJOR:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BM, BN]
        p = tl.exp2(s * qk_scale - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        if HAS_DROPOUT:
            keep = _keep_flags(keep_base, block_rows, offs_m, start_n, keep_len, BLOCK_M, BLOCK_N, BYTEWISE_KEEP,
                               False)
            kept = tl.where(keep, p, 0.0)
            dv = tl.dot(tl.trans(kept.to(do.dtype)), do, dv, input_precision=DOT_PREC)
            ds = (kept * dp - p * delta[:, None]).to(q.dtype)
        else:
            dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=DOT_PREC)
            ds = (p * (dp - delta[:, None])).to(q.dtype)
        dk = tl.dot(tl.trans(ds), q, dk, input_precision=DOT_PREC)
        dq = tl.dot(ds, k, input_precision=DOT_PREC)  # [BM, BLOCK_D]
    else:
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)  # [BN, BM]
        p_t = tl.exp2(s_t * qk_scale - lse2[None, :])
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        if HAS_DROPOUT:
            keep_t = _keep_flags(keep_base, block_rows, offs_m, start_n, keep_len, BLOCK_M, BLOCK_N, BYTEWISE_KEEP,
                                 True)
            kept_t = tl.where(keep_t, p_t, 0.0)
            dv = tl.dot(kept_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
            ds_t = (kept_t * dp_t - p_t * delta[None, :]).to(q.dtype)
        else:
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
            ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk, input_precision=DOT_PREC)
        dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PREC)  # [BM, BLOCK_D]
    offs_d = tl.arange(0, BLOCK_D)
    tl.atomic_add(dq_base + (offs_m[:, None] * stride_dqs + offs_d[None, :]), dq,
                  mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :], sem="relaxed")
    return dk, dv


@triton.jit
def _attention_bwd_dkdv_atomic_dq_kernel(
    Q, K, V, DO, LSE,  # as _attention_bwd_dkdv_kernel's
    DELTA,       # fp32, lse layout: rowsum(dO * O) from _attention_bwd_delta_kernel (not refined)
    DK, DV,      # written: dK, dV, q layout (their own strides)
    DQ_ACC,      # fp32 [rows, A, D] contiguous, zeros: sum_j dS'_ij k_j added (atomics)
    CU_SEQLENS, KEY_MASK, KEEP,
    DB,          # fp32 [rows, 3 * A * D], zeros: the dK, dV sections of the QKV bias gradient partials (HAS_DB)
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_lb, stride_lh,
    stride_mb, stride_ms,
    stride_db, db_rows,
    seqlen, num_heads, softmax_scale, qk_scale, dropout_p, inv_keep, seqlen_bucket, keep_len,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, BYTEWISE_KEEP: tl.constexpr,
    HAS_DB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QUERY_MAJOR: tl.constexpr,
):
    """One program per (key block, head, sequence): dK, dV of BLOCK_N keys over all queries, and
    their share of every query's dQ, added to DQ_ACC (header, "Atomic dQ")."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    seq_start, seq_len = _seq_range(CU_SEQLENS, b, seqlen, IS_VARLEN)
    start_n = pid_n * BLOCK_N
    if start_n >= seq_len:
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    key_in = offs_n < seq_len
    key_ok = key_in
    if HAS_KEY_MASK:
        key_ok = key_ok & (tl.load(KEY_MASK + b64 * stride_mb + offs_n * stride_ms, mask=key_in, other=0) != 0)

    # Padding keys load as zero rows: their scores then pollute only their own dK, dV rows (zeroed
    # below), and dS k adds nothing to any dQ (rows past the end read 0 already). The mask is read again
    # after the loop: held across it, it spilled.
    k, v = _key_block(K, V, b64, h64, seq_start, offs_n, key_ok, stride_kb, stride_ks, stride_kh, stride_vb,
                      stride_vs, stride_vh, UPCAST, HEAD_DIM, BLOCK_D)
    q_ptrs = (Q + b64 * stride_qb + seq_start * stride_qs + h64 * stride_qh
              + offs_m0[:, None] * stride_qs + offs_d[None, :])
    do_ptrs = (DO + b64 * stride_dob + seq_start * stride_dos + h64 * stride_doh
               + offs_m0[:, None] * stride_dos + offs_d[None, :])
    # DQ_ACC is [rows, A, D] contiguous: sequence b starts at row seq_start (varlen) or b * S (padded)
    if IS_VARLEN:
        acc_row = seq_start
    else:
        acc_row = b64 * seqlen
    stride_dqs = num_heads * HEAD_DIM
    dq_base = DQ_ACC + (acc_row * num_heads + h64) * HEAD_DIM
    lse_ptr = LSE + b64 * stride_lb + h64 * stride_lh + seq_start
    delta_ptr = DELTA + b64 * stride_lb + h64 * stride_lh + seq_start

    keep_base = _keep_block(KEEP, b64, h64, num_heads, keep_len)
    keep_rows = _keep_rows(0, keep_len, BLOCK_M)
    keep_frac = 1.0 - dropout_p
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    m_full = (seq_len // BLOCK_M) * BLOCK_M
    for start_m in range(0, m_full, BLOCK_M):
        dk, dv = _bwd_kv_atomic_dq_block(dk, dv, k, v, q_ptrs, do_ptrs, dq_base, lse_ptr, delta_ptr, keep_base,
                                         keep_rows, start_m, start_n, seq_len, stride_qs, stride_dos, stride_dqs,
                                         qk_scale, keep_len, keep_frac, False, HAS_DROPOUT, UPCAST, DOT_PREC,
                                         BYTEWISE_KEEP, QUERY_MAJOR, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N)
    for start_m in range(m_full, seq_len, BLOCK_M):
        dk, dv = _bwd_kv_atomic_dq_block(dk, dv, k, v, q_ptrs, do_ptrs, dq_base, lse_ptr, delta_ptr, keep_base,
                                         keep_rows, start_m, start_n, seq_len, stride_qs, stride_dos, stride_dqs,
                                         qk_scale, keep_len, keep_frac, True, HAS_DROPOUT, UPCAST, DOT_PREC,
                                         BYTEWISE_KEEP, QUERY_MAJOR, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N)
    if HAS_DROPOUT:
        dk = dk * (softmax_scale * inv_keep)
        dv = dv * inv_keep
    else:
        dk = dk * softmax_scale
    key_ok = key_in  # keys past the end and padding keys: 0 (the bias gradient sums these rows)
    if HAS_KEY_MASK:
        key_ok = key_in & (tl.load(KEY_MASK + b64 * stride_mb + offs_n * stride_ms, mask=key_in, other=0) != 0)
    dk = tl.where(key_ok[:, None], dk, 0.0)
    dv = tl.where(key_ok[:, None], dv, 0.0)
    if HAS_DB:
        row = b64 * db_rows + start_n // BLOCK_N
        _store_bias_grad_tile(DB, row, stride_db, 1, h64, num_heads, dk, HEAD_DIM, BLOCK_N, BLOCK_D)
        _store_bias_grad_tile(DB, row, stride_db, 2, h64, num_heads, dv, HEAD_DIM, BLOCK_N, BLOCK_D)
    _store_key_grads(DK, DV, dk, dv, b64, h64, seq_start, offs_n, key_in, stride_dkb, stride_dks, stride_dkh,
                     stride_dvb, stride_dvs, stride_dvh, HEAD_DIM, BLOCK_D)


@triton.jit
def _attention_bwd_dq_store_kernel(
    DQ_ACC,      # fp32 [rows, A, D] contiguous, from _attention_bwd_dkdv_atomic_dq_kernel
    DQ,          # written: dQ, rows of [rows, A, D] at its own row and head strides
    DB,          # fp32 [>= cdiv(rows, BLOCK_T), 3 * A * D]: the dQ section of row i written (HAS_DB)
    stride_dqr, stride_dqh, stride_db,
    rows, num_heads, dq_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DB: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """dQ = dq_scale * DQ_ACC in DQ's dtype, BLOCK_T rows of one head a program, and with HAS_DB the
    column sums of those rows (fp32, before rounding) into the dQ section of DB's row pid_t."""
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    t64 = offs_t.to(tl.int64)
    ok = (offs_t < rows)[:, None] & (offs_d < HEAD_DIM)[None, :]
    acc = tl.load(DQ_ACC + (t64[:, None] * num_heads + h) * HEAD_DIM + offs_d[None, :], mask=ok, other=0.0)
    dq = acc * dq_scale
    tl.store(DQ + t64[:, None] * stride_dqr + h * stride_dqh + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=ok)
    if HAS_DB:
        _store_bias_grad(DB, pid_t, stride_db, 0, h, num_heads, tl.sum(dq, 0), HEAD_DIM, BLOCK_D)


# =========================================================================== backward, short sequences
@triton.jit
def _bwd_fused_block(dk, dv, k, v, key_ok, q_base, do_base, dq_base, lse_ptr, keep_base, keep_rows,
                     start_m, seq_len, stride_qs, stride_dos, stride_dqs, qk_scale, dq_scale, keep_len,
                     DB, db_row, stride_db, h, num_heads,
                     HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
                     BYTEWISE_KEEP: tl.constexpr, HAS_DB: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CLAMPED: tl.constexpr,
                     DB_OUT: tl.constexpr):
    """One query block against every key of its sequence: (dk, dv, sums) with its dK, dV contributions
    added; its dQ written, and with HAS_DB its column sums into row db_row of the bias gradient's
    partials, or with DB_OUT returned as sums (else 0). The block sees whole rows of scores, so delta
    is their row sum in fp32, delta_i (1 - p) = sum_j kept_ij dP_ij (header: no delta kernel, nothing
    to refine). CLAMPED: the rows past the end read the sequence's last row, unmasked (_fused_keys)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seq_len
    # Tile pointers from the (b, h) base and int32 offsets, made here: [BLOCK_M, BLOCK_D] 64-bit
    # pointers held across the loop cost 2 registers an element, three of them more than the
    # score tiles.
    if CLAMPED:
        rows = tl.minimum(offs_m, tl.maximum(seq_len - 1, 0))
        q = _load_tile(q_base + (rows[:, None] * stride_qs + offs_d[None, :]), row_ok, False, HEAD_DIM, BLOCK_D)
        do = _load_tile(do_base + (rows[:, None] * stride_dos + offs_d[None, :]), row_ok, False, HEAD_DIM, BLOCK_D)
        lse = tl.where(row_ok, tl.load(lse_ptr + rows), float("inf"))  # rows past the end: P = 0
    else:
        q = _load_tile(q_base + (offs_m[:, None] * stride_qs + offs_d[None, :]), row_ok, True, HEAD_DIM, BLOCK_D)
        do = _load_tile(do_base + (offs_m[:, None] * stride_dos + offs_d[None, :]), row_ok, True, HEAD_DIM,
                        BLOCK_D)
        lse = tl.load(lse_ptr + offs_m, mask=row_ok, other=float("inf"))  # rows past the end: P = 0
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    # Keys-major: scores as [keys, queries], the products' own orientation, so dV and dK take P and
    # dS from registers and only dQ's operand is transposed (in shared memory); the [BLOCK_N, BLOCK_M]
    # tiles share the [BLOCK_N, BLOCK_D] accumulators' layout.
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)  # [BN, BM]
    p_t = tl.exp2(s_t * qk_scale - (lse * 1.4426950408889634)[None, :])
    p_t = tl.where(key_ok[:, None], p_t, 0.0)  # keys past the end or padding: their recomputed P is not 0
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # [BN, BM]
    if HAS_DROPOUT:
        block_rows = keep_rows + (start_m // 2) * (keep_len // 4)
        keep_t = _keep_flags(keep_base, block_rows, offs_m, 0, keep_len, BLOCK_M, BLOCK_N, BYTEWISE_KEEP, True)
        kept_t = tl.where(keep_t, p_t, 0.0)
    else:
        kept_t = p_t
    dv = tl.dot(kept_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
    # dS (1 - p) = kept dP - P (1 - p) delta (as _bwd_kv_block), (1 - p) delta = sum_j kept dP.
    kdp_t = kept_t * dp_t
    ds_t = kdp_t - p_t * tl.sum(kdp_t, 0)[None, :]
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PREC)
    dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=DOT_PREC) * dq_scale
    _store_tile(dq_base + (offs_m[:, None] * stride_dqs + offs_d[None, :]), dq.to(dq_base.dtype.element_ty), row_ok,
                HEAD_DIM, BLOCK_D)
    sums = 0.0
    if HAS_DB:  # rows past the end have P = 0, so dQ 0
        if DB_OUT:
            sums = tl.sum(dq, 0)
        else:
            _store_bias_grad(DB, db_row, stride_db, 0, h, num_heads, tl.sum(dq, 0), HEAD_DIM, BLOCK_D)
    return dk, dv, sums


@triton.jit
def _attention_bwd_fused_kernel(
    Q,           # [B, S, A, D] or [T, A, D] queries
    K,           # keys, same layout
    V,           # values, same layout
    DO,          # upstream gradient of the output, same layout
    LSE,         # fp32 [B, A, S] or [A, T] from the forward
    DQ,          # written: dQ, q layout (its own strides)
    DK,          # written: dK
    DV,          # written: dV
    CU_SEQLENS,  # int32 [B + 1] (varlen only)
    KEY_MASK,    # [B, S] 1 = token (padded form with a mask only)
    KEEP,        # uint8 keep bits from the forward (dropout only)
    DB,          # fp32 [B * db_rows, 3 * A * D], zeros: QKV bias gradient partials (HAS_DB only)
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_lb, stride_lh,
    stride_mb, stride_ms,
    stride_db, db_rows,
    seqlen, num_heads, softmax_scale, qk_scale, dropout_p, inv_keep, seqlen_bucket, keep_len,
    items,       # batch x heads: the (sequence, head) pairs (PERSISTENT)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, BYTEWISE_KEEP: tl.constexpr,
    HAS_DB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PERSISTENT: tl.constexpr = False, ITEM_STAGES: tl.constexpr = 2,
):
    """One program per (head, sequence) of at most BLOCK_N tokens: every key at once, the query
    blocks in turn; dQ, dK and dV in one pass (header, "Short sequences"). PERSISTENT: a program per
    SM takes the items = batch x heads (sequence, head) pairs in turn, every query block of each
    (static, so the loop over items is one level deep), and Triton's pipeline loads the next item's
    tiles while it computes this one's."""
    inv_keep_k = 1.0
    if HAS_DROPOUT:
        # 1 / (1 - p) divided here, not taken from inv_keep as the other backward kernels take it:
        # with the argument ptxas spilled this kernel at (32, 4, 2), head dim 26
        inv_keep_k = 1.0 / (1.0 - dropout_p)
    dq_scale = softmax_scale * inv_keep_k
    if PERSISTENT:
        for item in tl.range(tl.program_id(0), items, tl.num_programs(0), num_stages=ITEM_STAGES):
            b = item // num_heads
            h = item % num_heads
            seq_start, seq_len = _seq_range(CU_SEQLENS, b, seqlen, IS_VARLEN)
            seq_start = tl.where(seq_len > 0, seq_start, 0)  # an empty sequence's clamped rows: row 0
            k, v, key_in, key_ok = _fused_keys(K, V, KEY_MASK, b, h, seq_start, seq_len, stride_kb, stride_ks,
                                               stride_kh, stride_vb, stride_vs, stride_vh, stride_mb, stride_ms,
                                               HAS_KEY_MASK, UPCAST, HEAD_DIM, BLOCK_D, BLOCK_N, True)
            dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
            dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
            # the bias gradient's dQ sums: a row per two query blocks (bias_grad_rows), the first's held in
            # registers; none for blocks past the sequence's end (its rows stop there)
            pending = 0.0
            for j in tl.static_range(BLOCK_N // BLOCK_M):
                dk, dv, sums = _bwd_fused_query_block(
                    dk, dv, k, v, key_ok, Q, DO, DQ, LSE, KEEP, DB, b, h, seq_start, seq_len, j * BLOCK_M,
                    stride_qb, stride_qs, stride_qh, stride_dob, stride_dos, stride_doh, stride_dqb, stride_dqs,
                    stride_dqh, stride_lb, stride_lh, stride_db, db_rows, num_heads, qk_scale, dq_scale, keep_len,
                    HAS_DROPOUT, UPCAST, DOT_PREC, BYTEWISE_KEEP, HAS_DB, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, True,
                    True)
                if HAS_DB:
                    if j % 2 == 1 or j == BLOCK_N // BLOCK_M - 1:
                        in_sequence = tl.arange(0, BLOCK_D) * 0 + (j // 2) * 2 * BLOCK_M < seq_len
                        _store_bias_grad(DB, b * db_rows + j // 2, stride_db, 0, h, num_heads, pending + sums,
                                         HEAD_DIM, BLOCK_D, in_sequence)
                        pending = 0.0
                    else:
                        pending = sums
            _fused_key_grads(DK, DV, DB, dk, dv, b, h, seq_start, key_in, stride_dkb, stride_dks, stride_dkh,
                             stride_dvb, stride_dvs, stride_dvh, stride_db, db_rows, num_heads, softmax_scale,
                             inv_keep_k, HAS_DB, HEAD_DIM, BLOCK_D, BLOCK_N)
    else:
        h = tl.program_id(1)
        b = tl.program_id(2)
        seq_start, seq_len = _seq_range(CU_SEQLENS, b, seqlen, IS_VARLEN)
        if seq_len <= 0:
            return
        k, v, key_in, key_ok = _fused_keys(K, V, KEY_MASK, b, h, seq_start, seq_len, stride_kb, stride_ks,
                                           stride_kh, stride_vb, stride_vs, stride_vh, stride_mb, stride_ms,
                                           HAS_KEY_MASK, UPCAST, HEAD_DIM, BLOCK_D, BLOCK_N, False)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        # One loop, its rows and keys always masked: unmasked copies for full blocks and full-length
        # sequences save about one instruction per score element (~4%) and triple the compile time.
        for start_m in range(0, seq_len, BLOCK_M):
            dk, dv, _ = _bwd_fused_query_block(
                dk, dv, k, v, key_ok, Q, DO, DQ, LSE, KEEP, DB, b, h, seq_start, seq_len, start_m,
                stride_qb, stride_qs, stride_qh, stride_dob, stride_dos, stride_doh, stride_dqb, stride_dqs,
                stride_dqh, stride_lb, stride_lh, stride_db, db_rows, num_heads, qk_scale, dq_scale, keep_len,
                HAS_DROPOUT, UPCAST, DOT_PREC, BYTEWISE_KEEP, HAS_DB, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, False,
                False)
        _fused_key_grads(DK, DV, DB, dk, dv, b, h, seq_start, key_in, stride_dkb, stride_dks, stride_dkh,
                         stride_dvb, stride_dvs, stride_dvh, stride_db, db_rows, num_heads, softmax_scale,
                         inv_keep_k, HAS_DB, HEAD_DIM, BLOCK_D, BLOCK_N)


@triton.jit
def _fused_keys(K, V, KEY_MASK, b, h, seq_start, seq_len, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                stride_vh, stride_mb, stride_ms, HAS_KEY_MASK: tl.constexpr, UPCAST: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CLAMPED: tl.constexpr):
    """(k, v, key_in, key_ok): the one-pass kernel's keys of sequence b, head h. CLAMPED: rows past the
    end read the sequence's last row instead of 0, so no load is masked (a pipelined loop carries each
    masked load's mask to the next item, [BLOCK_N, BLOCK_D] predicates: spills); their P is set to 0
    by key_ok and the rows never stored."""
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    key_in = offs_n < seq_len
    keys = tl.minimum(offs_n, tl.maximum(seq_len - 1, 0)) if CLAMPED else offs_n
    k, v = _key_block(K, V, b64, h64, seq_start, keys, key_in, stride_kb, stride_ks, stride_kh, stride_vb,
                      stride_vs, stride_vh, UPCAST, HEAD_DIM, BLOCK_D, not CLAMPED)
    key_ok = key_in
    if HAS_KEY_MASK:
        if CLAMPED:
            key_ok = key_ok & (tl.load(KEY_MASK + b64 * stride_mb + keys * stride_ms) != 0)
        else:
            key_ok = key_ok & (tl.load(KEY_MASK + b64 * stride_mb + keys * stride_ms, mask=key_in, other=0) != 0)
    return k, v, key_in, key_ok


@triton.jit
def _bwd_fused_query_block(dk, dv, k, v, key_ok, Q, DO, DQ, LSE, KEEP, DB, b, h, seq_start, seq_len, start_m,
                           stride_qb, stride_qs, stride_qh, stride_dob, stride_dos, stride_doh, stride_dqb,
                           stride_dqs, stride_dqh, stride_lb, stride_lh, stride_db, db_rows, num_heads, qk_scale,
                           dq_scale, keep_len, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
                           DOT_PREC: tl.constexpr, BYTEWISE_KEEP: tl.constexpr, HAS_DB: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, CLAMPED: tl.constexpr, DB_OUT: tl.constexpr):
    """_bwd_fused_block of query block start_m of sequence b, head h: its bases, made here."""
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    # Tile pointers from the (b, h) base and int32 offsets, made in the block: [BLOCK_M, BLOCK_D] 64-bit
    # pointers held across the loop cost 2 registers an element, three of them more than the score tiles.
    q_base = Q + b64 * stride_qb + seq_start * stride_qs + h64 * stride_qh
    do_base = DO + b64 * stride_dob + seq_start * stride_dos + h64 * stride_doh
    dq_base = DQ + b64 * stride_dqb + seq_start * stride_dqs + h64 * stride_dqh
    lse_ptr = LSE + b64 * stride_lb + h64 * stride_lh + seq_start
    keep_base = _keep_block(KEEP, b64, h64, num_heads, keep_len)
    keep_rows = _keep_rows(0, keep_len, BLOCK_M)
    # each query block's dQ column sums in a partials row of its own (a sum held across the loop
    # spilled at 255 registers)
    return _bwd_fused_block(dk, dv, k, v, key_ok, q_base, do_base, dq_base, lse_ptr, keep_base, keep_rows,
                            start_m, seq_len, stride_qs, stride_dos, stride_dqs, qk_scale, dq_scale, keep_len,
                            DB, b * db_rows + start_m // BLOCK_M, stride_db, h, num_heads, HAS_DROPOUT, UPCAST,
                            DOT_PREC, BYTEWISE_KEEP, HAS_DB, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CLAMPED, DB_OUT)


@triton.jit
def _fused_key_grads(DK, DV, DB, dk, dv, b, h, seq_start, key_in, stride_dkb, stride_dks, stride_dkh, stride_dvb,
                     stride_dvs, stride_dvh, stride_db, db_rows, num_heads, softmax_scale, inv_keep_k,
                     HAS_DB: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """The one-pass kernel's dK, dV of sequence b, head h, scaled and stored, and their bias-gradient sums.
    A padding key's P is 0 in every row, so its dK and dV rows are 0 already."""
    dk = dk * (softmax_scale * inv_keep_k)
    dv = dv * inv_keep_k
    _store_key_grads(DK, DV, dk, dv, b.to(tl.int64), h.to(tl.int64), seq_start, tl.arange(0, BLOCK_N), key_in,
                     stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh, HEAD_DIM, BLOCK_D)
    if HAS_DB:
        _store_bias_grad(DB, b * db_rows, stride_db, 1, h, num_heads, tl.sum(dk, 0), HEAD_DIM, BLOCK_D)
        _store_bias_grad(DB, b * db_rows, stride_db, 2, h, num_heads, tl.sum(dv, 0), HEAD_DIM, BLOCK_D)


# =========================================================================== dropout mask (debug)
@triton.jit
def _attention_dropout_mask_kernel(
    KEEP,  # uint8 [B, A, S, S]; written: 1 = kept
    SEED,  # int64 [1]
    num_heads, seqlen, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    seed_bh = _rng_key(SEED, b, h, num_heads, True)
    threshold = _keep_threshold(dropout_p)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    base = KEEP + (b.to(tl.int64) * num_heads + h) * seqlen * seqlen
    row_ptrs = base + offs_m[:, None].to(tl.int64) * seqlen
    for start_n in range(0, seqlen, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keep = _dropout_keep(seed_bh, offs_m, start_n, threshold, BLOCK_M, BLOCK_N)
        tl.store(row_ptrs + offs_n[None, :], keep.to(tl.uint8),
                 mask=(offs_m[:, None] < seqlen) & (offs_n[None, :] < seqlen))


# =========================================================================== rows outside every sequence
@triton.jit
def _attention_outside_rows_kernel(
    OUT,         # [T, row_elems] contiguous: rows outside every sequence are set to 0
    LSE,         # [heads, T] fp32 (written only when HAS_LSE): +inf at those rows
    CU_SEQLENS,  # int32 [batch + 1]
    batch, tokens, row_elems, heads, stride_lse_h,
    HAS_LSE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # The varlen outputs are allocated empty; the attention kernels write every row of every
    # sequence, so only rows before cu_seqlens[0] or from cu_seqlens[batch] on are left. This costs
    # a program per BLOCK_T rows that reads two ints and, on a batch that covers its tokens, exits:
    # the zero-fill it replaces wrote the whole output (and dqkv, three times its size).
    pid = tl.program_id(0)
    lo = pid * BLOCK_T
    first = tl.load(CU_SEQLENS)
    last = tl.load(CU_SEQLENS + batch)
    if (lo < first) | (lo + BLOCK_T > last):
        rows = lo + tl.arange(0, BLOCK_T)
        outside = (rows < tokens) & ((rows < first) | (rows >= last))
        rows64 = rows.to(tl.int64)[:, None]
        zero = tl.zeros([BLOCK_T, BLOCK_C], dtype=OUT.dtype.element_ty)
        for c0 in range(0, row_elems, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            tl.store(OUT + rows64 * row_elems + cols[None, :], zero,
                     mask=outside[:, None] & (cols < row_elems)[None, :])
        if HAS_LSE:
            for h in range(0, heads):
                tl.store(LSE + h * stride_lse_h + rows, tl.full([BLOCK_T], float("inf"), tl.float32), mask=outside)


# =========================================================================== launch configurations
# Autotune candidates, (BLOCK_M = queries, BLOCK_N = keys, num_warps, num_stages), per kernel, per
# operand class (fp32 runs IEEE dots on the CUDA cores: small tiles) and head-dim tile BLOCK_D (32
# stands for <= 32); dK/dV's add its orientation (_Q: QUERY_MAJOR, _K: keys-major, _bwd_kv_block).
# Every entry compiles without register spills for sm_90 with triton 3.9 and 3.6 (the GPU machine's),
# dropout on and off, varlen and padded, at the tile's own head dim and at one it pads (26, 80: the
# column masks cost registers) (make compile-report, benchmarks/compile-report/); the first
# entry is the default (BERTFAST_AUTOTUNE=0). Tiles longer than the sequences need are pruned per
# call. The 16-bit dQ lists fit its second accumulator (sum_j P_ij k_j, header): (64, 128, 8, 3)
# at 64, (128, 32, 8, 3) and (64, 32, 4, 4) at 128 and (64, 16, 8, 2) at 256 spill with it.
# Query-major dK/dV spills at a padded head dim 26 and at fp32: it leads the 16-bit 64 list only.
# Since that mask, (32, 16, 8, 2) and (16, 32, 4, 2) spill in dK/dV at 256, (32, 32, 8, 2) in fp32
# forward and dQ at <= 32, (16, 32, 4, 2) in 16-bit dQ at 256, and in fp32 dK/dV (32, 16, 4, 2) at
# 64 and (16, 16, 4, 2) at 256 (padded, by 8-20 bytes): they left the lists. The keep bits (header)
# cost registers where dropout is on: query-major dK/dV (64, 64, 4, 2), the 16-bit 64 default, spills
# by 12-16 bytes and (128, 64, 8, 2) leads that list instead; the forward at a padded head dim 26
# spills in (64, 64, 4, 3) and (128, 32, 4, 4), the fp32 forward at 256 in (32, 16, 8, 1) and the
# fp32 dQ at 64 in (32, 16, 4, 2): they left the lists. Triton 3.6 spills by 8-20 bytes where 3.9
# does not in the 16-bit forward at 128 (64, 64, 4, 3), gone, and at 4 warps in three fp32 entries:
# the forward's (16, 32, 4, 2) at <= 32 and (16, 16, 4, 2) at 128, and dQ's (32, 16, 4, 2) at <= 32,
# which run at 8 warps instead. With the QKV bias gradient's sums (and 1 / (1 - p) an argument of the
# dQ and dK/dV kernels) the fp32 dQ spills by 4-8 bytes in (16, 16, 4, 2) at <= 32 (3.9 and 3.6,
# dropout) and (16, 16, 4, 1) at 256 (3.6, padded, dropout): they left the lists. With fp32's keep
# bits drawn and read bytewise (header), the fp32 forward at 256 spilled 4-8 bytes in (16, 16, 4, 1)
# (3.9, dropout), which (16, 16, 8, 1) replaces, and dK/dV at 128 12 bytes in (16, 16, 4, 2) (3.6,
# varlen), which left the list.
_Q, _K = True, False
_CANDIDATES = {
    "fwd": {
        (False, 32): [(128, 64, 8, 3), (64, 32, 4, 4)],
        (False, 64): [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (128, 32, 4, 4), (64, 32, 4, 4)],
        (False, 128): [(128, 64, 8, 3), (64, 32, 4, 4)],
        (True, 32): [(16, 32, 8, 2), (16, 16, 4, 2)],
        (True, 64): [(32, 32, 8, 2), (32, 16, 8, 2), (16, 16, 4, 2)],
        (True, 128): [(16, 16, 8, 2)],
        (False, 256): [(64, 32, 8, 2), (32, 32, 4, 2), (64, 32, 8, 1)],
        (True, 256): [(16, 16, 8, 1)],
    },
    "dkdv": {
        (False, 32): [(32, 64, 4, 3, _K), (64, 128, 8, 3, _K), (64, 64, 8, 2, _K), (32, 128, 8, 3, _K),
                      (16, 64, 4, 3, _K), (32, 32, 4, 4, _K)],
        (False, 64): [(128, 64, 8, 2, _Q), (32, 64, 4, 3, _K), (64, 128, 8, 3, _K), (64, 64, 8, 2, _K),
                      (32, 128, 8, 3, _K), (16, 64, 4, 3, _K)],
        (False, 128): [(32, 32, 8, 3, _K), (16, 64, 8, 3, _K), (16, 32, 4, 3, _K), (32, 64, 8, 3, _K),
                       (16, 128, 8, 3, _K)],
        (True, 32): [(32, 32, 8, 2, _K), (32, 16, 4, 2, _K)],
        (True, 64): [(32, 32, 8, 2, _K), (16, 32, 8, 2, _K), (16, 16, 4, 2, _K)],
        (True, 128): [(16, 32, 8, 2, _K)],
        (False, 256): [(32, 32, 8, 2, _K), (32, 32, 8, 1, _K), (64, 32, 8, 1, _K)],
        (True, 256): [(16, 16, 8, 2, _K)],
    },
    # dK/dV with the atomic dQ (header, "Atomic dQ"): the dK/dV lists less what spills with the dQ product.
    # At 64, wgmma takes 64 rows a warpgroup, so the tile is at least 64 keys (dK, dV) and 64 queries (dQ)
    # a warpgroup: (64, 128, 8, 3) keys-major first (predicted 171 us at BERT-large seq 512, dropout 0.1,
    # against 188 for (128, 64, 8, 2), the dK/dV kernel's first); 16-bit (64, 64, 4, 3) keys-major
    # spills on triton 3.6, query-major at 4 warps on 3.9 with a key mask and dropout, (64, 128, 8, 3)
    # query-major and (128, 128, 8, 2) on both, and at 128 (32, 64, 8, 3) (3.9) and (16, 32, 4, 3)
    # (3.6, head dim 80). fp32 spilled 4-36 bytes in (32, 32, 8, 2) and (16, 32, 8, 2) at <= 64 and in
    # (16, 16, 8, 2) at 256 (3.9), and, per head dim and flags, in most other tiles at 4, 8 or 16 warps:
    # the entries left are those neither triton spills in at 16, 26, 32, 64 and 256.
    "dkdv_atomic_dq": {
        (False, 32): [(32, 64, 4, 3, _K), (64, 128, 8, 3, _K), (64, 64, 8, 2, _K), (32, 128, 8, 3, _K),
                      (16, 64, 4, 3, _K), (32, 32, 4, 4, _K)],
        (False, 64): [(64, 128, 8, 3, _K), (128, 64, 8, 2, _Q)],
        (False, 128): [(32, 32, 8, 3, _K), (16, 64, 8, 3, _K), (16, 128, 8, 3, _K)],
        (True, 32): [(32, 16, 4, 2, _K), (16, 32, 16, 2, _K)],
        (True, 64): [(32, 16, 8, 2, _K), (16, 16, 4, 2, _K), (32, 32, 16, 2, _K)],
        (True, 128): [(16, 32, 8, 2, _K)],
        (False, 256): [(32, 32, 8, 2, _K), (32, 32, 8, 1, _K)],
        (True, 256): [(16, 16, 16, 1, _K), (16, 16, 16, 2, _K)],
    },
    "dq": {
        (False, 32): [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4), (128, 32, 8, 3)],
        (False, 64): [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4), (128, 32, 8, 3)],
        (False, 128): [(128, 16, 8, 3), (64, 32, 8, 3), (64, 16, 4, 4)],
        (True, 32): [(32, 16, 8, 2)],
        (True, 64): [(32, 16, 8, 2), (16, 16, 4, 2)],
        (True, 128): [(16, 16, 8, 2)],
        (False, 256): [(16, 32, 8, 2), (32, 32, 8, 1), (32, 16, 8, 2)],
        (True, 256): [(16, 16, 4, 2)],
    },
}
# Under the interpreter: one fixed, small configuration per kernel. The sizes differ between
# kernels on purpose so the CPU tests show results do not depend on the block shape; dK/dV runs
# query-major, the training path's orientation (a test runs the other).
_INTERP = {"fwd": {"BLOCK_M": 16, "BLOCK_N": 16}, "dkdv": {"BLOCK_M": 16, "BLOCK_N": 32, "QUERY_MAJOR": True},
           "dq": {"BLOCK_M": 32, "BLOCK_N": 16}, "mask": {"BLOCK_M": 16, "BLOCK_N": 32},
           "fused": {"BLOCK_M": 16}}  # its BLOCK_N: fused_block_n
_DELTA_BLOCK_M = 64
_DQ_STORE_ELEMENTS = 4096  # _attention_bwd_dq_store_kernel's tile: rows x head-dim tile (the interpreter: 16 rows)
# The keep bits' rows and columns are padded to a multiple of every tile, so no kernel masks its
# byte loads and stores (header, "Keep bits"); _tuned checks each candidate against it.
_OUTSIDE_BLOCKS = {"BLOCK_T": 64, "BLOCK_C": 128}


# The short-sequence backward (_attention_bwd_fused_kernel): one program holds every key of its
# sequence, BLOCK_N = fused_block_n(seqlen), so its candidates are listed per key tile, (BLOCK_M =
# queries a step, num_warps, num_stages[, the PERSISTENT loop's stages: header]), and its pruner
# keeps that tile's. It serves sequences up to FUSED_BWD_MAX_SEQLEN tokens (fp32: its IEEE dots on
# the CUDA cores spill at every 128-key tile tried, up to 16 warps, and at 64 keys with triton 3.6)
# at head dims up to FUSED_BWD_MAX_HEAD_DIM (the [keys, head dim] dK and dV accumulators stay in
# registers); longer sequences take the three kernels above. At 128 keys the tiles are keys-major so
# that 8 warps hold the [128, 64] accumulators and the [128, 64] score tiles in one layout
# (query-major, a [64, 128] score tile took the accumulators' 8 x 1 warp layout, each warpgroup
# holding all of it: spills); 226-255 registers, one program per SM; 3 stages put both query blocks'
# loads in flight at once (the program runs two). Spilling, so left out: (32, 4, 3) at 128 keys,
# (64, 4, 3) at 64; in fp32, (16, 4, 2) at 16 and 32 keys; PERSISTENT with 64-query blocks (92
# bytes) or 3 stages (4 bytes, and 198 KB of shared memory), so its one is (32, 8, 2, 2): 131 KB.
FUSED_BWD_MAX_SEQLEN = {False: 128, True: 32}  # by fp32 operands
FUSED_BWD_MAX_HEAD_DIM = 64
# The PERSISTENT candidate runs the varlen form (the encoder's) at head dim 64 (BERT's): elsewhere it
# spilled, at head dim 26 (a column mask the pipeline carries: 272-612 bytes), at 32 with dropout (24)
# and, with triton 3.6, in the padded form with a key mask and dropout (20).
PERSISTENT_HEAD_DIM = 64
# BERTFAST_ATTENTION_PERSISTENT=0 leaves the candidate out of the tuning (read when a key is tuned): a
# GPU run whose test of it failed times the others.
PERSISTENT_ENV = "BERTFAST_ATTENTION_PERSISTENT"
_FUSED_CANDIDATES = {
    False: {128: [(64, 8, 3), (64, 8, 2), (32, 8, 2, 2)], 64: [(32, 4, 3), (32, 4, 2)], 32: [(32, 4, 2), (16, 4, 2)],
            16: [(16, 4, 2)]},
    True: {32: [(16, 8, 2)], 16: [(16, 4, 1)]},
}


def fused_block_n(seqlen: int) -> int:
    """The short-sequence backward's key tile: every key of the longest sequence."""
    return max(16, next_power_of_2(seqlen))


def fused_backward(seqlen: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the backward takes the one-pass kernel (_attention_bwd_fused_kernel)."""
    return seqlen <= FUSED_BWD_MAX_SEQLEN[dtype == torch.float32] and head_dim <= FUSED_BWD_MAX_HEAD_DIM


def _fused_tuned(kernel):
    """The autotuned one-pass backward: its pruner keeps the candidates of the call's key tile."""
    table, configs = {}, {}
    for fp32, tiles in _FUSED_CANDIDATES.items():
        assert max(tiles) == FUSED_BWD_MAX_SEQLEN[fp32]
        for block_n, entries in tiles.items():
            assert KEEP_ALIGN % block_n == 0 and all(KEEP_ALIGN % e[0] == 0 for e in entries), (fp32, block_n)
            table[(fp32, block_n)] = [
                configs.setdefault((e[0], block_n) + e[1:], triton.Config(
                    {"BLOCK_M": e[0], "BLOCK_N": block_n, **({"PERSISTENT": True, "ITEM_STAGES": e[3]} if len(e) > 3
                                                              else {})},
                    num_warps=e[1], num_stages=e[2]))
                for e in entries]

    def prune(_configs, named_args, **kwargs):
        listed = table[(named_args["Q"].dtype == torch.float32, max(16, named_args["seqlen_bucket"]))]
        persistent = (kwargs["IS_VARLEN"] and kwargs["HEAD_DIM"] == PERSISTENT_HEAD_DIM
                      and os.environ.get(PERSISTENT_ENV, "1") != "0")
        return [c for c in listed if persistent or not c.kwargs.get("PERSISTENT")]
    return autotune(list(configs.values()), _AUTOTUNE_KEY, prune)(kernel)


def _tuned(kernel, which: str):
    """The autotuned kernel over every candidate of ``which``; its pruner picks the table entry."""
    table, configs = {}, {}
    for key, entries in _CANDIDATES[which].items():
        assert all(KEEP_ALIGN % e[0] == 0 and KEEP_ALIGN % e[1] == 0 for e in entries), (which, key)
        table[key] = [configs.setdefault(e, triton.Config({"BLOCK_M": e[0], "BLOCK_N": e[1],
                                                           **({"QUERY_MAJOR": e[4]} if len(e) > 4 else {})},
                                                          num_warps=e[2], num_stages=e[3]))
                      for e in entries]

    def prune(_configs, named_args, **kwargs):
        tile = kwargs["BLOCK_D"]
        listed = table[(named_args["Q"].dtype == torch.float32, max(tile, 32))]
        longest = max(named_args["seqlen_bucket"], 64)
        return [c for c in listed if max(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) <= longest] or listed[:1]
    return autotune(list(configs.values()), _AUTOTUNE_KEY, prune)(kernel)


_AUTOTUNE_KEY = ["seqlen_bucket", "HEAD_DIM", "IS_VARLEN", "HAS_KEY_MASK", "HAS_DROPOUT"]
_fwd_tuned = _tuned(_attention_fwd_kernel, "fwd")
_bwd_dkdv_tuned = _tuned(_attention_bwd_dkdv_kernel, "dkdv")
_bwd_dq_tuned = _tuned(_attention_bwd_dq_kernel, "dq")
_bwd_dkdv_atomic_dq_tuned = _tuned(_attention_bwd_dkdv_atomic_dq_kernel, "dkdv_atomic_dq")
_bwd_fused_tuned = _fused_tuned(_attention_bwd_fused_kernel)


# =========================================================================== atomic dQ
DQ_ENV = "BERTFAST_ATTENTION_DQ"
DQ_MODES = ("deterministic", "atomic")


def dq_mode() -> str:
    """How the backward of sequences longer than the one-pass kernel takes forms dQ (header, "Atomic
    dQ"): BERTFAST_ATTENTION_DQ, "deterministic" (default: the dQ kernel) or "atomic" (added in the
    dK/dV kernel), which torch.use_deterministic_algorithms(True) overrides."""
    value = env_choice(DQ_ENV, DQ_MODES)
    return "deterministic" if torch.are_deterministic_algorithms_enabled() else value


def using_dq(mode: str):
    """BERTFAST_ATTENTION_DQ set to ``mode`` inside the block (the compile report's and the bench's
    launches of both backwards), as it was after."""
    return env_setting(DQ_ENV, mode, DQ_MODES)


def dq_summary() -> str:
    """`bertfast info`'s line: the backward's dQ and why."""
    try:
        mode = dq_mode()
    except ValueError as exc:
        return f"Triton attention dQ: {exc}"
    why = "torch.use_deterministic_algorithms" if torch.are_deterministic_algorithms_enabled() else DQ_ENV
    return (f"Triton attention dQ (sequences over {FUSED_BWD_MAX_SEQLEN[False]} tokens): {mode} ({why}; "
            f"{' or '.join(DQ_MODES)})")


# =========================================================================== validation
def unsupported(inputs) -> list:
    """Dispatch: reasons these inputs exceed this backend's limits ([] when it runs them)."""
    return head_dim_reasons(inputs["q"].shape[-1])


def block_d(head_dim: int) -> int:
    """The kernels' head-dim tile: tl.arange and tl.dot need a power of two >= 16; the columns
    past the head dim are masked (loaded as 0, never stored)."""
    return max(16, next_power_of_2(head_dim))


def _check_qkv(names, tensors, ndim: int, layout: str) -> None:
    check_qkv(names, tensors, ndim, layout)
    check_head_dim(names[0], tensors[0].shape[-1])


def _key_mask(key_padding_mask: Optional[torch.Tensor], batch: int, seqlen: int,
              device: torch.device) -> Optional[torch.Tensor]:
    check_key_padding_mask(key_padding_mask, batch, seqlen, device)
    if key_padding_mask is not None and key_padding_mask.dtype == torch.bool:
        return key_padding_mask.view(torch.uint8)  # same bytes; the kernels test != 0
    return key_padding_mask


def _dot_flags(dtype: torch.dtype):
    """(UPCAST, DOT_PREC): bf16 operands are upcast under the interpreter; fp32 dots stay IEEE."""
    upcast = interpreting() and dtype == torch.bfloat16
    prec = "ieee" if (dtype == torch.float32 or upcast) else "tf32"
    return upcast, prec


def _bytewise_keep(dtype: torch.dtype) -> bool:
    """BYTEWISE_KEEP (header, "Keep bits"): fp32, whose dots run in the CUDA cores' blocked layouts."""
    return dtype == torch.float32


def _bsh(t: torch.Tensor, varlen: bool):
    """(batch, row, head) element strides; varlen tensors have no batch dim."""
    return (0, t.stride(0), t.stride(1)) if varlen else (t.stride(0), t.stride(1), t.stride(2))


def _lse_strides(lse: torch.Tensor, varlen: bool):
    return (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))


# =========================================================================== launchers
def _forward(q, k, v, out, lse, cu_seqlens, key_mask, seed, keep, batch, seqlen, varlen,
             softmax_scale, dropout_p):
    heads, head_dim = q.shape[-2], q.shape[-1]
    upcast, prec = _dot_flags(q.dtype)
    dummy = lse  # stands in for pointers a variant never reads
    mask_strides = (key_mask.stride(0), key_mask.stride(1)) if key_mask is not None else (0, 0)
    args = (q, k, v, out, lse,
            cu_seqlens if varlen else dummy, key_mask if key_mask is not None else dummy,
            seed if dropout_p > 0 else dummy, keep if dropout_p > 0 else dummy,
            *_bsh(q, varlen), *_bsh(k, varlen), *_bsh(v, varlen), *_bsh(out, varlen),
            *_lse_strides(lse, varlen), *mask_strides,
            seqlen, heads, softmax_scale * _LOG2E.value, dropout_p, next_power_of_2(seqlen), _keep_len(keep))
    consts = dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), IS_VARLEN=varlen, HAS_KEY_MASK=key_mask is not None,
                  HAS_DROPOUT=dropout_p > 0, UPCAST=upcast, DOT_PREC=prec, BYTEWISE_KEEP=_bytewise_keep(q.dtype))
    grid = lambda meta: (cdiv(seqlen, meta["BLOCK_M"]), heads, batch)  # noqa: E731
    launch(_fwd_tuned, grid, args, consts, interp=_INTERP["fwd"])


def _backward(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens, key_mask, keep, batch, seqlen,
              varlen, softmax_scale, dropout_p, bias_dtype=None):
    """Launches the backward into dq, dk, dv; given bias_dtype, returns the QKV bias gradient
    [3 * A * D] in it (header, "QKV bias gradient"). Past the one-pass kernel's lengths, dQ as
    dq_mode() says."""
    heads, head_dim = q.shape[-2], q.shape[-1]
    upcast, prec = _dot_flags(q.dtype)
    lse = lse.contiguous()
    cu = cu_seqlens if varlen else lse
    mask_strides = (key_mask.stride(0), key_mask.stride(1)) if key_mask is not None else (0, 0)
    kmask = key_mask if key_mask is not None else lse
    keep_arg = keep if dropout_p > 0 else lse
    bucket = next_power_of_2(seqlen)
    consts = dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), IS_VARLEN=varlen, HAS_KEY_MASK=key_mask is not None,
                  HAS_DROPOUT=dropout_p > 0, UPCAST=upcast, DOT_PREC=prec, BYTEWISE_KEEP=_bytewise_keep(q.dtype),
                  HAS_DB=bias_dtype is not None)
    qkv_strides = (*_bsh(q, varlen), *_bsh(k, varlen), *_bsh(v, varlen), *_bsh(dout, varlen))
    fused = fused_backward(seqlen, head_dim, q.dtype)
    atomic_dq = not fused and dq_mode() == "atomic"
    db_rows = bias_grad_rows(seqlen, head_dim, q.dtype, fused, atomic_dq=atomic_dq)
    db = None
    if bias_dtype is not None:
        db = torch.zeros((batch * db_rows, 3 * heads * head_dim), dtype=torch.float32, device=q.device)
    # Tuned on a scratch DB: a candidate with smaller blocks writes rows the chosen one leaves at 0.
    scratch = ("DB",) if db is not None else ()
    # 1 / (1 - p) from here for the dQ and dK/dV kernels: divided there, 1 - p stayed live across their
    # loops and ptxas spilled it at small fp32 tiles
    tail = (*_lse_strides(lse, varlen), *mask_strides, db.stride(0) if db is not None else 0, db_rows,
            seqlen, heads, softmax_scale, softmax_scale * _LOG2E.value, dropout_p, 1.0 / (1.0 - dropout_p), bucket,
            _keep_len(keep))
    db_arg = db if db is not None else lse

    if fused:
        items = batch * heads
        args = (q, k, v, dout, lse, dq, dk, dv, cu, kmask, keep_arg, db_arg,
                *qkv_strides, *_bsh(dq, varlen), *_bsh(dk, varlen), *_bsh(dv, varlen), *tail, items)
        interp = dict(_INTERP["fused"], BLOCK_N=fused_block_n(seqlen))
        # PERSISTENT: one program an SM (its 255 registers and the pipelined tiles hold one)
        programs = min(items, resident_programs(q.device, 1))
        grid = lambda meta: (programs,) if meta.get("PERSISTENT") else (1, heads, batch)  # noqa: E731
        launch(_bwd_fused_tuned, grid, args, consts, interp=interp, scratch=scratch)
        return None if db is None else column_sums(db.unsqueeze(0), [bias_dtype])[0]
    delta = torch.empty_like(lse)  # same layout as lse: d = rowsum(dO * O)
    delta_block = _INTERP["fwd"]["BLOCK_M"] if interpreting() else _DELTA_BLOCK_M
    launch(_attention_bwd_delta_kernel, (cdiv(seqlen, delta_block), heads, batch),
           (out, dout, delta, cu, *_bsh(out, varlen), *_bsh(dout, varlen), *_lse_strides(lse, varlen), seqlen),
           dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), IS_VARLEN=varlen, BLOCK_M=delta_block))
    key_grid = lambda meta: (cdiv(seqlen, meta["BLOCK_N"]), heads, batch)  # noqa: E731

    if atomic_dq:
        rows = q.shape[0] if varlen else batch * seqlen
        assert varlen or dq.stride(0) == seqlen * dq.stride(1), "padded dq: rows b * S + s"
        block_t = 16 if interpreting() else _DQ_STORE_ELEMENTS // block_d(head_dim)
        if db is not None and db.shape[0] < cdiv(rows, block_t):  # varlen rows past the sequences
            db = torch.cat([db, db.new_zeros((cdiv(rows, block_t) - db.shape[0], db.shape[1]))])
        db_arg = db if db is not None else lse
        dq_acc = torch.zeros((rows, heads, head_dim), dtype=torch.float32, device=q.device)
        args = (q, k, v, dout, lse, delta, dk, dv, dq_acc, cu, kmask, keep_arg, db_arg,
                *qkv_strides, *_bsh(dk, varlen), *_bsh(dv, varlen), *tail)
        launch(_bwd_dkdv_atomic_dq_tuned, key_grid, args, consts, interp=_INTERP["dkdv"],
               scratch=scratch + ("DQ_ACC",))
        launch(_attention_bwd_dq_store_kernel, (cdiv(rows, block_t), heads),
               (dq_acc, dq, db_arg, dq.stride(-3), dq.stride(-2), db.stride(0) if db is not None else 0, rows, heads,
                softmax_scale / (1.0 - dropout_p)),
               dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), HAS_DB=db is not None, BLOCK_T=block_t))
        return None if db is None else column_sums(db.unsqueeze(0), [bias_dtype])[0]

    # fp16/bf16: the dQ kernel refines d into delta (header) for the dK/dV kernel; fp32: d is delta
    refine = q.dtype != torch.float32
    delta_out = torch.empty_like(lse) if refine else delta

    args = (q, k, v, dout, lse, delta, delta_out, dq, cu, kmask, keep_arg, db_arg,
            *qkv_strides, *_bsh(dq, varlen), *tail)
    query_grid = lambda meta: (cdiv(seqlen, meta["BLOCK_M"]), heads, batch)  # noqa: E731
    launch(_bwd_dq_tuned, query_grid, args, dict(consts, REFINE_DELTA=refine), interp=_INTERP["dq"], scratch=scratch)

    args = (q, k, v, dout, lse, delta_out, dk, dv, cu, kmask, keep_arg, db_arg,
            *qkv_strides, *_bsh(dk, varlen), *_bsh(dv, varlen), *tail)
    launch(_bwd_dkdv_tuned, key_grid, args, consts, interp=_INTERP["dkdv"], scratch=scratch)
    return None if db is None else column_sums(db.unsqueeze(0), [bias_dtype])[0]


def bias_grad_rows(seqlen: int, head_dim: int, dtype: torch.dtype, one_pass: Optional[bool] = None,
                   interpreted: Optional[bool] = None, atomic_dq: bool = False) -> int:
    """Rows of the QKV bias gradient's partials per sequence (header): a row per block of the smallest
    any candidate may take (zeros where the chosen blocks leave none), query blocks for the one-pass
    kernel (pairs of them for its PERSISTENT candidate), query and key blocks for the three, key blocks
    for the atomic dQ's dK/dV kernel (atomic_dq). one_pass: which backward runs (None: fused_backward's
    choice); interpreted: whether the interpreter's blocks run (None: whether launch() would run them
    now)."""
    if one_pass is None:
        one_pass = fused_backward(seqlen, head_dim, dtype)
    if interpreted is None:
        interpreted = _common.interpreting()  # launch()'s own test, which decides which blocks run
    fp32 = dtype == torch.float32
    if one_pass:  # PERSISTENT: a row per two query blocks
        if interpreted:
            smallest = _INTERP["fused"]["BLOCK_M"] * (2 if _INTERP["fused"].get("PERSISTENT") else 1)
        else:
            smallest = min(e[0] * (2 if len(e) > 3 else 1) for e in _FUSED_CANDIDATES[fp32][fused_block_n(seqlen)])
    elif interpreted:
        smallest = min(_INTERP["dq"]["BLOCK_M"], _INTERP["dkdv"]["BLOCK_N"])
    elif atomic_dq:  # key blocks only: the dQ sections come from _attention_bwd_dq_store_kernel's rows
        smallest = min(e[1] for e in _CANDIDATES["dkdv_atomic_dq"][(fp32, max(block_d(head_dim), 32))])
    else:
        key = (fp32, max(block_d(head_dim), 32))
        smallest = min(min(e[0] for e in _CANDIDATES["dq"][key]), min(e[1] for e in _CANDIDATES["dkdv"][key]))
    return cdiv(seqlen, smallest)


def _clear_outside_rows(out: torch.Tensor, lse: Optional[torch.Tensor], cu_seqlens: torch.Tensor) -> None:
    """Rows of a varlen output that no sequence covers: 0 (and lse +inf), as the contract says."""
    tokens = out.shape[0]
    launch(_attention_outside_rows_kernel, (cdiv(tokens, _OUTSIDE_BLOCKS["BLOCK_T"]),),
           (out, lse if lse is not None else cu_seqlens, cu_seqlens, cu_seqlens.numel() - 1, tokens,
            out[0].numel(), lse.shape[0] if lse is not None else 0, lse.stride(0) if lse is not None else 0),
           dict(HAS_LSE=lse is not None, **_OUTSIDE_BLOCKS))


dropout_keep_shape = keep_bits_shape  # the keep bits a forward with dropout writes for its backward (header)


def _new_keep(batch: int, heads: int, seqlen: int, dropout_p: float, device: torch.device) -> torch.Tensor:
    return torch.empty(dropout_keep_shape(batch, heads, seqlen, dropout_p), dtype=torch.uint8, device=device)


def _keep_len(keep: torch.Tensor) -> int:
    return keep.shape[3] * 4 if keep.dim() == 4 else 0


def _grad_out(dout: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    check_tensor("dout", dout, dtypes=(like.dtype,), shape=like.shape, device=like.device)
    # Autograd may hand over expanded or transposed gradients: the kernels need stride(-1) == 1.
    return dout if dout.stride(-1) == 1 else dout.contiguous()


def attention_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         max_seqlen: int, softmax_scale: Optional[float], dropout_p: float,
                         seed: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention on unpadded tokens. q, k, v [T, A, D] -> (out [T, A, D], lse [A, T] fp32, keep bits
    for the backward: dropout_keep_shape, uint8).

    Sequence b is rows cu_seqlens[b]:cu_seqlens[b+1]; max_seqlen must be >= every length.
    Rows outside every sequence get out 0 and lse +inf (_clear_outside_rows: the outputs are not
    zero-filled first, so a max_seqlen below a sequence's length leaves that sequence's later rows
    unwritten).
    """
    _check_qkv(("q", "k", "v"), (q, k, v), 3, "[T, A, D]")
    tokens, heads, head_dim = q.shape
    batch, max_seqlen = check_cu_seqlens(cu_seqlens, max_seqlen, q.device)
    softmax_scale = _softmax_scale(softmax_scale, head_dim)
    dropout_p = check_dropout(dropout_p, seed, q.device)
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((heads, tokens), dtype=torch.float32, device=q.device)
    keep = _new_keep(batch, heads, max_seqlen, dropout_p, q.device)
    if out.numel() == 0:
        return out, lse.fill_(float("inf")), keep
    if batch > 0 and max_seqlen > 0:
        _forward(q, k, v, out, lse, cu_seqlens, None, seed, keep, batch, max_seqlen, True,
                 softmax_scale, dropout_p)
    _clear_outside_rows(out, lse, cu_seqlens)
    return out, lse, keep


def attention_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor,
                         max_seqlen: int, softmax_scale: Optional[float], dropout_p: float,
                         seed: Optional[torch.Tensor], keep: torch.Tensor,
                         bias_dtype: Optional[torch.dtype] = None):
    """Gradients of attention_varlen_fwd -> dqkv [T, 3, A, D] (dq = dqkv[:, 0], dk, dv likewise;
    0 at rows outside every sequence). keep: the forward's keep bits (the seed is not read).
    Given bias_dtype: (dqkv, dbias [3, A, D] in bias_dtype), dbias the column sums of dqkv, summed
    in fp32 by the kernels (header, "QKV bias gradient")."""
    _check_qkv(("q", "k", "v", "out"), (q, k, v, out), 3, "[T, A, D]")
    dout = _grad_out(dout, q)
    tokens, heads, head_dim = q.shape
    check_tensor("lse", lse, dtypes=(torch.float32,), shape=(heads, tokens), device=q.device)
    batch, max_seqlen = check_cu_seqlens(cu_seqlens, max_seqlen, q.device)
    softmax_scale = _softmax_scale(softmax_scale, head_dim)
    dropout_p = check_dropout(dropout_p, seed, q.device)
    check_bias_dtype(bias_dtype)
    dqkv = torch.empty((tokens, 3, heads, head_dim), dtype=q.dtype, device=q.device)
    dbias = None
    if dqkv.numel() > 0:
        check_keep_bits(keep, batch, heads, max_seqlen, dropout_p, q.device)
        if batch > 0 and max_seqlen > 0:
            dbias = _backward(dout, q, k, v, out, lse, dqkv[:, 0], dqkv[:, 1], dqkv[:, 2], cu_seqlens, None, keep,
                              batch, max_seqlen, True, softmax_scale, dropout_p, bias_dtype)
        _clear_outside_rows(dqkv, None, cu_seqlens)
    if bias_dtype is None:
        return dqkv
    if dbias is None:  # no token in any sequence
        dbias = torch.zeros(3 * heads * head_dim, dtype=bias_dtype, device=q.device)
    return dqkv, dbias.view(3, heads, head_dim)


def attention_padded_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_padding_mask: Optional[torch.Tensor], softmax_scale: Optional[float],
                         dropout_p: float, seed: Optional[torch.Tensor]
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention on padded tensors. q, k, v [B, S, A, D], key_padding_mask [B, S] (1 = token, any
    pattern; None = no padding) -> (out [B, S, A, D], lse [B, A, S] fp32, keep bits for the
    backward: dropout_keep_shape, uint8).

    Query rows at pad positions still attend to the valid keys; a row with no valid key gives 0.
    """
    _check_qkv(("q", "k", "v"), (q, k, v), 4, "[B, S, A, D]")
    batch, seqlen, heads, head_dim = q.shape
    key_mask = _key_mask(key_padding_mask, batch, seqlen, q.device)
    softmax_scale = _softmax_scale(softmax_scale, head_dim)
    dropout_p = check_dropout(dropout_p, seed, q.device)
    out = torch.empty((batch, seqlen, heads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seqlen), dtype=torch.float32, device=q.device)
    keep = _new_keep(batch, heads, seqlen, dropout_p, q.device)
    if out.numel() == 0:
        return out, lse.fill_(float("inf")), keep
    _forward(q, k, v, out, lse, None, key_mask, seed, keep, batch, seqlen, False, softmax_scale, dropout_p)
    return out, lse, keep


def attention_padded_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor,
                         key_padding_mask: Optional[torch.Tensor], softmax_scale: Optional[float],
                         dropout_p: float, seed: Optional[torch.Tensor], keep: torch.Tensor
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attention_padded_fwd -> (dq, dk, dv), each [B, S, A, D]; 0 at padding keys.
    keep: the forward's keep bits (the seed is not read)."""
    _check_qkv(("q", "k", "v", "out"), (q, k, v, out), 4, "[B, S, A, D]")
    dout = _grad_out(dout, q)
    batch, seqlen, heads, head_dim = q.shape
    check_tensor("lse", lse, dtypes=(torch.float32,), shape=(batch, heads, seqlen), device=q.device)
    key_mask = _key_mask(key_padding_mask, batch, seqlen, q.device)
    softmax_scale = _softmax_scale(softmax_scale, head_dim)
    dropout_p = check_dropout(dropout_p, seed, q.device)
    dq, dk, dv = (torch.empty((batch, seqlen, heads, head_dim), dtype=q.dtype, device=q.device)
                  for _ in range(3))
    if dq.numel() == 0:
        return dq, dk, dv
    check_keep_bits(keep, batch, heads, seqlen, dropout_p, q.device)
    _backward(dout, q, k, v, out, lse, dq, dk, dv, None, key_mask, keep, batch, seqlen, False,
              softmax_scale, dropout_p)
    return dq, dk, dv


def _dropout_mask(batch: int, seqlen: int, num_heads: int, dropout_p: float,
                  seed: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    for name, value in (("batch", batch), ("seqlen", seqlen), ("num_heads", num_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected a python int >= 0, got {value!r}")
    dropout_p = check_dropout(dropout_p, seed, device)
    if dropout_p == 0.0 or batch * num_heads * seqlen == 0:
        return torch.ones((batch, num_heads, seqlen, seqlen), dtype=torch.bool, device=device)
    keep = torch.empty((batch, num_heads, seqlen, seqlen), dtype=torch.uint8, device=device)
    blocks = _INTERP["mask"] if interpreting() else {"BLOCK_M": 64, "BLOCK_N": 64}
    launch(_attention_dropout_mask_kernel, (cdiv(seqlen, blocks["BLOCK_M"]), num_heads, batch),
           (keep, seed, num_heads, seqlen, dropout_p), blocks)
    return keep.view(torch.bool)


def attention_varlen_dropout_mask(cu_seqlens: torch.Tensor, max_seqlen: int, num_heads: int,
                                  dropout_p: float, seed: Optional[torch.Tensor]) -> torch.Tensor:
    """The keep-mask the varlen kernels use: bool [B, A, max_seqlen, max_seqlen] (sequence b uses
    its top-left [len_b, len_b] block), for reference.attention_varlen(dropout_mask=...)."""
    batch, max_seqlen = check_cu_seqlens(cu_seqlens, max_seqlen, cu_seqlens.device)
    return _dropout_mask(batch, max_seqlen, num_heads, dropout_p, seed, cu_seqlens.device)


def attention_padded_dropout_mask(batch: int, seqlen: int, num_heads: int, dropout_p: float,
                                  seed: Optional[torch.Tensor]) -> torch.Tensor:
    """The keep-mask the padded kernels use: bool [B, A, S, S], on the seed's device."""
    device = seed.device if seed is not None else torch.device("cpu")
    return _dropout_mask(batch, seqlen, num_heads, dropout_p, seed, device)


__all__ = [
    "attention_varlen_fwd", "attention_varlen_bwd", "attention_padded_fwd", "attention_padded_bwd",
    "dropout_keep_shape",
    "attention_varlen_dropout_mask", "attention_padded_dropout_mask", "block_d",
]
