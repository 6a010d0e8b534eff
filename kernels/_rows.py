"""What the Triton row kernels share (bias_gelu, bias_dropout_residual_layernorm, embeddings):
the row-tile launch configurations, the row groups of backward reductions and the kernel that
sums their partials (column_sums), the row-op dropout RNG, and the LayerNorm row math of both
LayerNorm kernels (jit helpers, inlined).

Dropout RNG of the row ops (``row_dropout_keep``): element (row, col) takes 16 bits of
Philox4x32-10 keyed by the int64 seed tensor, at counter row * ceil(H / 8) + col // 8 (one
Philox call feeds 8 elements; which 16 bits is fixed by col % 8); u = bits / 65536 and
keep = (u >= p), evaluated as bits >= ceil(p * 65536), so the keep probability is 1 - p to
within 2**-16. The mask depends only on (seed, row, col, H), never on the launch
configuration, so a backward regenerates it exactly. The counter is 32-bit: the pattern
repeats after 2**32 elements (N * H) under one seed.

Sums (``exact_sum``): every row and column sum of these kernels (LayerNorm statistics, the
backward's row sums, the per-program parameter-gradient partials) is order-free: its bits do not
depend on the order of the additions, so not on the register layout Triton picks for a tile.
That layout is not the launch config's alone: the alignment of the row strides (Triton
specialises integer arguments divisible by 16) and the other loads and stores of the kernel
(e.g. whether the keep-mask is stored) change it, and a plain tl.sum's reduction tree with it.
With exact_sum a row-strided input and its contiguous copy, or a forward with and without
return_dropout_mask, give the same bits on a GPU, and the forward's bits do not depend on the
config the autotuner picks (BLOCK_M, num_warps).
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch
import triton
import triton.language as tl

from ._common import cdiv, interpreting, launch, next_power_of_2, resident_programs

MAX_HIDDEN = 8192  # LayerNorm rows (LayerNorm, embeddings) are one register tile: H <= 8192
MAX_ROWS_PER_TILE = 16  # the largest BLOCK_M in the backward configs; row groups are multiples of it
# Elements per thread of the row-tile candidates. The forward: 16 first (two 16-byte vectors of
# bf16; a row of BERT's 768 or 1024 takes 2 warps, whose LayerNorm sums cross one warp boundary:
# 54 instructions an element on sm_90 against 70 at 8, which left BERT-base's LayerNorm forward
# issue-bound: docs/perf-model.md), then 8, then 4. The backward only 8 (row_config_pruner says why).
FWD_PER_THREAD = (16, 8, 4)
FWD_MAX_WARPS = 8  # the forwards' pruners: their three per-thread counts give six tiles at H = 1024
BWD_PER_THREAD = (8,)


@triton.jit
def row_dropout_keep(seed, rows, H, p, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """keep-mask [BLOCK_M, BLOCK_H] (bool) for the given rows and columns 0..BLOCK_H-1."""
    GROUPS: tl.constexpr = BLOCK_H // 8
    # One Philox call per 8 columns: counter = row * ceil(H / 8) + col // 8 (32-bit, wraps).
    ctr = rows.to(tl.uint32)[:, None] * ((H + 7) // 8) + tl.arange(0, GROUPS)[None, :].to(tl.uint32)
    r0, r1, r2, r3 = tl.randint4x(seed, ctr)                      # 4 x [BLOCK_M, GROUPS] uint32
    # u = bits / 65536 >= p  <=>  bits >= ceil(p * 65536): compare the 16-bit halves as integers.
    thr = tl.ceil(p * 65536.0).to(tl.uint32)
    k0 = tl.join((r0 & 0xFFFF) >= thr, (r0 >> 16) >= thr)         # [BLOCK_M, GROUPS, 2]
    k1 = tl.join((r1 & 0xFFFF) >= thr, (r1 >> 16) >= thr)
    k2 = tl.join((r2 & 0xFFFF) >= thr, (r2 >> 16) >= thr)
    k3 = tl.join((r3 & 0xFFFF) >= thr, (r3 >> 16) >= thr)
    keep = tl.join(tl.join(k0, k1), tl.join(k2, k3))              # [BLOCK_M, GROUPS, 2, 2, 2]
    return tl.reshape(keep, (BLOCK_M, BLOCK_H))                   # column = 8 * group + lane


@triton.jit
def row_dropout(x, seed, rows, H, p, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """(x * keep / (1 - p), keep) for an fp32 [BLOCK_M, BLOCK_H] tile of the given rows."""
    keep = row_dropout_keep(seed, rows, H, p, BLOCK_M, BLOCK_H)
    return tl.where(keep, x * (1.0 / (1.0 - p)), 0.0), keep


@triton.jit
def _pow2(k):
    """2.0 ** k as fp32 for integer k in [-126, 127] (built from its exponent bits)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def exact_sum(v, axis: tl.constexpr):
    """Sum of the fp32 tensor v along axis (at most 8192 = MAX_HIDDEN terms), the same bits whatever
    the order of the additions (plain tl.sum's order follows the register layout).

    Each term is scaled by a power of two chosen from the largest magnitude m along the axis (an
    order-free max) to below 2**49, truncated to an int64, the int64s are added exactly (8192
    terms stay below 2**62), and the total is converted back with one rounding. The truncation is
    deterministic: below 2**-48 * m per term (far under an fp32 ulp of m), and below 2**-126 per
    term when m < 2**-77 (the scale is at most 2**126). A NaN or inf along the axis gives NaN.
    Per term: a max, a multiply, a conversion and a 64-bit add.
    """
    tl.static_assert(v.shape[axis] <= 8192, "exact_sum: at most 8192 terms")
    if v.shape[axis] == 1:
        return tl.sum(v, axis=axis)                                 # one term: nothing to order
    m = tl.reduce(tl.abs(v), axis, _max_nan)                        # NaN if any term is NaN
    # m < 2**(e - 126) for its biased exponent e; scale by 2**k, k = 175 - e, at most 2**126.
    k = tl.minimum(175 - (m.to(tl.int32, bitcast=True) >> 23), 126)
    q = (v * tl.expand_dims(_pow2(k), axis)).to(tl.int64)           # NaN/inf terms: m says so below
    total = tl.sum(q, axis=axis).to(tl.float32) * _pow2(-k)
    return tl.where(m < float("inf"), total, float("nan"))


@triton.jit
def load_cols(PTR, cols, col_ok):
    """An [H] vector (weight, bias) as fp32 [BLOCK_H], 0 in padded columns."""
    return tl.load(PTR + cols, mask=col_ok, other=0.0).to(tl.float32)


@triton.jit
def load_row_vector(PTR, cols, col_ok):
    """An [H] vector (weight, bias) as fp32 [1, BLOCK_H], 0 in padded columns: loaded in a row tile's
    own layout, where load_cols' [BLOCK_H] takes a layout conversion through shared memory (barriers)
    whenever its element size differs from the tile's (fp32 parameters beside bf16 rows)."""
    return tl.load(PTR + cols[None, :], mask=col_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def layernorm_normalize(z, mask, H, eps):
    """(zhat, mean, rstd): the normalised rows of the fp32 tile z (padded entries 0, and 0 in zhat),
    statistics in fp32 from order-free sums (exact_sum)."""
    mean = exact_sum(z, 1) / H                                     # [BLOCK_M]
    zc = tl.where(mask, z - mean[:, None], 0.0)                    # padded columns out of the variance
    rstd = tl.rsqrt(exact_sum(zc * zc, 1) / H + eps)               # [BLOCK_M]
    return zc * rstd[:, None], mean, rstd


@triton.jit
def layernorm_rows(z, mask, W, B, cols, col_ok, H, eps):
    """(y, mean, rstd): LayerNorm of each row of the fp32 tile z (layernorm_normalize), its weight
    and bias loaded after the statistics (a program of one tile holds fewer registers so)."""
    zhat, mean, rstd = layernorm_normalize(z, mask, H, eps)
    w = load_cols(W, cols, col_ok)
    b = load_cols(B, cols, col_ok)
    return zhat * w[None, :] + b[None, :], mean, rstd


@triton.jit
def program_rows(N, rows_per_program):
    """(pid, row_start, row_end): the contiguous rows this program of a row_groups launch walks."""
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    return pid, row_start, tl.minimum(row_start + rows_per_program, N)


@triton.jit
def layernorm_bwd_rows(dy, x, mean, rstd, w, acc_dw, acc_db, H):
    """LayerNorm backward of an fp32 row tile (dy: gradient of y = zhat * w + b, x: the input):
    (dx, acc_dw + dy * zhat, acc_db + dy)."""
    # Padded rows and columns have dy = 0, hence g = 0: they add nothing to the sums, and callers
    # mask dx there out of their stores, so zhat needs no masking.
    zhat = layernorm_zhat(x, mean, rstd)
    acc_dw += dy * zhat
    acc_db += dy
    g = dy * w[None, :]
    a, c = layernorm_bwd_coefs(g, zhat, rstd, H)
    return layernorm_dx(g, zhat, rstd, a, c), acc_dw, acc_db


@triton.jit
def layernorm_zhat(x, mean, rstd):
    """The normalised rows (x - mean) * rstd of an fp32 row tile."""
    return x * rstd[:, None] - (mean * rstd)[:, None]


@triton.jit
def layernorm_bwd_coefs(g, zhat, rstd, H):
    """The per-row scalars (a, c) of the LayerNorm backward, g = dy * w: dx = layernorm_dx(g, zhat, rstd, a, c)."""
    return exact_sum(g * zhat, 1) * rstd / H, exact_sum(g, 1) * rstd / H


@triton.jit
def layernorm_dx(g, zhat, rstd, a, c):
    """dx = rstd * g - (zhat * a + c): the LayerNorm backward's input gradient from its row scalars."""
    return g * rstd[:, None] - (zhat * a[:, None] + c[:, None])


@triton.jit
def store_col_sums(PART, acc, pid, H, cols, col_ok):
    """Row pid of a [G, H] fp32 partial buffer: the (order-free) column sums of the tile accumulator acc."""
    tl.store(PART + pid * H + cols, exact_sum(acc, 0), mask=col_ok)


def row_tile_configs(max_rows: int = 64):
    """Candidate (rows per tile, num_warps) configs for row kernels; pruned per H by row_config_pruner."""
    return [triton.Config({"BLOCK_M": m}, num_warps=w)
            for m in (1, 2, 4, 8, 16, 32, 64) if m <= max_rows
            for w in (2, 4, 8, 16)]


def row_config_pruner(per_thread: Tuple[int, ...], max_warps: int = 16):
    """early_config_prune for row kernels: tiles of >= 1K elements (several rows per program for
    small H) and no more rows than the problem has, giving each thread ``per_thread`` elements, in
    that order of preference (fewer rows first). Elements per thread set the register footprint:
    the compile report (sm_90, triton 3.6 and 3.9) finds spills at 16 per thread in the backward
    kernels (three fp32 accumulators and a tile), none at 4 or 8, and none in the
    forwards' tiles at 16 of up to FWD_MAX_WARPS warps. When no tile gives an allowed count (the
    backward's 8 at H = 8192 needs 32 warps), the tiles with the fewest elements per thread remain. Of the tiles giving an allowed count, those of more than ``max_warps`` warps
    are left out while others remain (16 warps cap a thread at 128 registers)."""
    def prune(configs, named_args, **kwargs):
        block_h = kwargs["BLOCK_H"]
        rows_cap = max(1, named_args.get("n_bucket", 1 << 16))

        def per(c):
            return c.kwargs["BLOCK_M"] * block_h // (32 * c.num_warps)
        fits = [c for c in configs
                if per(c) >= 4 and c.kwargs["BLOCK_M"] <= rows_cap
                and (c.kwargs["BLOCK_M"] * block_h >= 1024 or c.kwargs["BLOCK_M"] >= rows_cap)]
        kept = [c for c in fits if per(c) in per_thread]
        kept = [c for c in kept if c.num_warps <= max_warps] or kept
        if not kept and fits:
            fewest = min(per(c) for c in fits)
            kept = [c for c in fits if per(c) == fewest]
        kept.sort(key=lambda c: (per_thread.index(per(c)) if per(c) in per_thread else len(per_thread),
                                 c.kwargs["BLOCK_M"]))
        return kept or [min(configs, key=lambda c: (c.kwargs["BLOCK_M"], -c.num_warps))]
    return prune


def interpreter_rows(block_h: int, cap: int) -> int:
    """Fixed rows per tile under the interpreter (autotune cannot run there): ~4K elements a tile."""
    return max(1, min(cap, 4096 // block_h))


def block_h_for(h: int) -> int:
    """Columns of the register tile: next power of two of H, at least 16 (dropout uses 8-column groups)."""
    return max(16, next_power_of_2(h))


def n_bucket(n: int) -> int:
    return min(next_power_of_2(max(n, 1)), 1 << 16)


def row_groups(n_rows: int, device: torch.device, per_sm: int):
    """(G, rows_per_program) for backward kernels that reduce over rows with per-program partials:
    about per_sm programs per SM on a GPU, three under the interpreter (so tests cross program
    borders). More programs keep more loads in flight (the LayerNorm backward ran two per SM on the
    H200 and read at a third of the bandwidth) but write more [G, H] fp32 partials."""
    return row_group_shape(n_rows, resident_programs(device, per_sm))


def row_group_shape(n_rows: int, programs: int, tile_rows: int = MAX_ROWS_PER_TILE) -> Tuple[int, int]:
    """(G, rows_per_program) for about ``programs`` programs: rows_per_program is a multiple of
    ``tile_rows`` (by default the largest BLOCK_M), so only a program's last tile is partial."""
    rpp = cdiv(cdiv(n_rows, programs), tile_rows) * tile_rows
    return cdiv(n_rows, rpp), rpp


def hidden_reasons(h: int):
    """The row kernels' declared limit, as dispatch reasons ([] when H fits one register tile)."""
    return [] if 1 <= h <= MAX_HIDDEN else [f"hidden size {h} is outside [1, {MAX_HIDDEN}] (one register tile per row)"]


def check_hidden(h: int) -> None:
    reasons = hidden_reasons(h)
    if reasons:
        raise ValueError(f"hidden size: expected 1 <= H <= {MAX_HIDDEN}, got {h}")


# --------------------------------------------------------------------------- partial sums
@triton.jit
def _column_sums_kernel(
    PART,              # [K, G, C] fp32 partial sums, contiguous
    OUT0, OUT1, OUT2,  # [C] each, contiguous: the column sums of set 0, 1, 2 (K <= 3), in their dtype
    G, C,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
):
    k = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    base = PART + k.to(tl.int64) * G * C
    acc = tl.zeros([BLOCK_G, BLOCK_C], dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        groups = g0 + tl.arange(0, BLOCK_G)
        acc += tl.load(base + groups.to(tl.int64)[:, None] * C + cols[None, :],
                       mask=(groups < G)[:, None] & col_ok[None, :], other=0.0)
    total = exact_sum(acc, 0)
    if k == 0:
        tl.store(OUT0 + cols, total.to(OUT0.dtype.element_ty), mask=col_ok)
    elif k == 1:
        tl.store(OUT1 + cols, total.to(OUT1.dtype.element_ty), mask=col_ok)
    else:
        tl.store(OUT2 + cols, total.to(OUT2.dtype.element_ty), mask=col_ok)


_SUMS_BLOCK_C = 32   # one 128-byte segment of each partial row
_SUMS_BLOCK_G = 512  # a [512, 32] fp32 tile over 8 warps: 64 registers a thread (fixed, whatever G, so
#                      the compile report compiles what a GPU runs)


def column_sums(part: torch.Tensor, dtypes: Sequence[torch.dtype]) -> Tuple[torch.Tensor, ...]:
    """The sums over G of fp32 partials [K, G, C] (K <= 3): K separate [C] tensors, set k in
    dtypes[k], each summed in fp32 and rounded once.

    One launch for all K, instead of torch's sum over the middle dim (12 us for [3, 264, 1024] on
    the H200, slower than the partials' bytes need) and a cast or copy per gradient (custom ops may
    not return views of one buffer). Programs of 32 columns load up to 512 partial rows at once, so
    a reduction over G <= 512 makes one trip to memory. The result depends on G (the order of the
    fp32 additions across tiles) but not on anything else.
    """
    k, g, c = part.shape
    assert part.dtype == torch.float32 and part.is_contiguous() and 1 <= k == len(dtypes) <= 3
    outs = tuple(torch.empty((c,), dtype=dt, device=part.device) for dt in dtypes)
    if c == 0:
        return outs
    if g == 0:
        return tuple(o.zero_() for o in outs)
    block_g = 2 if interpreting() else _SUMS_BLOCK_G  # the interpreter: several tiles and a partial one
    slots = outs + (outs[0],) * (3 - k)
    launch(_column_sums_kernel, (cdiv(c, _SUMS_BLOCK_C), k), (part, *slots, g, c),
           dict(BLOCK_G=block_g, BLOCK_C=_SUMS_BLOCK_C, num_warps=8))
    return outs
