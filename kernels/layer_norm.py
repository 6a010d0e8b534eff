"""Fused bias + dropout + residual + LayerNorm (BERT's post-LN block), forward and backward.

Math, per row of H elements; every input is upcast to fp32 right after its load and all
arithmetic is fp32 (statistics included):

  forward
    h    = x + bias                                   (bias optional)
    d    = h * keep / (1 - p)                         keep = (u >= p), u from Philox (below)
    z    = residual + d                               (residual optional); stored once: pre_norm
    mean = sum(z) / H
    rstd = 1 / sqrt(sum((z - mean)^2) / H + eps)
    zhat = (z - mean) * rstd
    y    = zhat * weight + ln_bias

  backward (zhat recomputed from pre_norm, mean, rstd; keep regenerated from the seed)
    g         = dy * weight
    dz        = rstd * (g - zhat * sum(g * zhat) / H - sum(g) / H)
    dresidual = dz
    dx        = dz * keep / (1 - p)
    dbias     = sum_rows dx,   dweight = sum_rows dy * zhat,   dln_bias = sum_rows dy

  Statistics come from the fp32 z; the backward reads pre_norm as stored (rounded to the
  activation dtype), the usual trade for saving one [N, H] tensor instead of two.
  The three row sums are per-program partial sums in fp32 (each program owns a contiguous
  block of rows and one row of a [G, H] buffer), then one reduction over G: no atomics.

Dropout RNG (shared with kernels/embeddings.py through ``_dropout_keep``): element (row, col)
takes 16 bits of Philox4x32-10 keyed by the int64 seed tensor, at counter
row * ceil(H / 8) + col // 8 (one Philox call feeds 8 elements; which 16 bits is fixed by
col % 8); u = bits / 65536 and keep = (u >= p), evaluated as bits >= ceil(p * 65536), so the
keep probability is 1 - p to within 2**-16. The mask depends only on (seed, row, col, H), never
on the launch configuration, so the backward regenerates it exactly. The counter is 32-bit: the
pattern repeats after 2**32 elements (N * H) under one seed.

Launch: on GPU the row-tile shape (rows per program, num_warps) is autotuned per H, size class
of N, dtypes and flags; under the interpreter a fixed tile of ~4K elements is used. The forward
runs one program per BLOCK_M rows; the backward runs about two programs per SM, each walking a
contiguous block of rows one tile at a time and prefetching the next tile.

Limits: H <= 8192 (one row per register tile); any number of rows; x / residual / dy /
pre_norm may be row-strided (stride(1) == 1, stride(0) >= H), anything else is a ValueError.
Plain LayerNorm is bias=None, residual=None, p=0: then pre_norm is x itself (no copy).
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, autotune, check_tensor, launch

MAX_HIDDEN = 8192
_MAX_ROWS_PER_TILE = 16  # the largest BLOCK_M in the backward configs; row groups are multiples of it


# --------------------------------------------------------------------------- kernels
@triton.jit
def _dropout_keep(seed, rows, H, p, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
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
def _bdrln_fwd_kernel(
    X,       # [N, H] activations, row stride stride_x, column stride 1
    BIAS,    # [H] bias added before dropout (any pointer when HAS_BIAS is False)
    RES,     # [N, H] residual, row stride stride_res (any pointer when HAS_RES is False)
    W,       # [H] LayerNorm weight
    B,       # [H] LayerNorm bias
    Y,       # [N, H] output, contiguous
    PRE,     # [N, H] pre_norm, contiguous (written only when STORE_PRE)
    MEAN,    # [N] fp32 row means
    RSTD,    # [N] fp32 row reciprocal standard deviations
    KEEP,    # [N, H] bool keep-mask, contiguous (written only when STORE_KEEP)
    SEED,    # [1] int64 dropout seed (read only when HAS_DROPOUT)
    N, H, stride_x, stride_res, eps, p,
    n_bucket,  # autotune key only: next power of two of N, capped
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    STORE_PRE: tl.constexpr, STORE_KEEP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_H)
    row_ok = rows < N
    col_ok = cols < H
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    out_offs = rows64 * H + cols[None, :]

    z = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_DROPOUT:
        keep = _dropout_keep(tl.load(SEED), rows, H, p, BLOCK_M, BLOCK_H)
        z = tl.where(keep, z * (1.0 / (1.0 - p)), 0.0)
        if STORE_KEEP:
            tl.store(KEEP + out_offs, keep, mask=mask)
    if HAS_RES:
        z += tl.load(RES + rows64 * stride_res + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if STORE_PRE:
        tl.store(PRE + out_offs, z.to(PRE.dtype.element_ty), mask=mask)

    # Statistics in fp32 from the unrounded z; padded columns hold 0 and are masked out of var.
    mean = tl.sum(z, axis=1) / H                                   # [BLOCK_M]
    zc = tl.where(mask, z - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(zc * zc, axis=1) / H + eps)             # [BLOCK_M]
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = zc * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + out_offs, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _load_bwd_tile(DY, PRE, MEAN, RSTD, rows, row_end, cols, col_ok, stride_dy, stride_pre):
    """(dy, pre_norm) tiles in their stored dtype and (mean, rstd) for `rows`; zeros past row_end."""
    row_ok = rows < row_end
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0)
    z = tl.load(PRE + rows64 * stride_pre + cols[None, :], mask=mask, other=0.0)
    mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
    return dy, z, mean, rstd


@triton.jit
def _bdrln_bwd_kernel(
    DY,          # [N, H] upstream gradient, row stride stride_dy
    PRE,         # [N, H] pre_norm saved by the forward, row stride stride_pre
    MEAN,        # [N] fp32
    RSTD,        # [N] fp32
    W,           # [H] LayerNorm weight
    DX,          # [N, H] gradient of x, contiguous
    DRES,        # [N, H] gradient of residual, contiguous (written only when HAS_RES)
    DW_PART,     # [G, H] fp32 partial sums of dy * zhat, one row per program
    DB_PART,     # [G, H] fp32 partial sums of dy
    DBIAS_PART,  # [G, H] fp32 partial sums of dx (written only when HAS_BIAS)
    SEED,        # [1] int64 dropout seed (read only when HAS_DROPOUT)
    N, H, stride_dy, stride_pre, rows_per_program, p,
    n_bucket,    # autotune key only
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, N)
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    # Per-element accumulators, reduced over rows once at the end.
    acc_dw = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    acc_db = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    acc_dbias = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    # Software pipelining by hand: the loads of tile i + 1 are issued before tile i is computed,
    # so each program keeps two tiles of loads in flight (Triton does not pipeline plain loads).
    dy_next, z_next, mean_next, rstd_next = _load_bwd_tile(
        DY, PRE, MEAN, RSTD, row_start + tl.arange(0, BLOCK_M), row_end, cols, col_ok, stride_dy, stride_pre)
    for m0 in range(row_start, row_end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        dy = dy_next.to(tl.float32)
        z = z_next.to(tl.float32)
        mean = mean_next
        rstd = rstd_next
        dy_next, z_next, mean_next, rstd_next = _load_bwd_tile(
            DY, PRE, MEAN, RSTD, rows + BLOCK_M, row_end, cols, col_ok, stride_dy, stride_pre)
        # Padded columns and rows have dy = 0, hence g = 0: they add nothing to the sums below
        # and are never stored, so zhat needs no masking there.
        zhat = z * rstd[:, None] - (mean * rstd)[:, None]
        g = dy * w[None, :]
        a = tl.sum(g * zhat, axis=1) * rstd / H
        c = tl.sum(g, axis=1) * rstd / H
        dz = g * rstd[:, None] - (zhat * a[:, None] + c[:, None])
        acc_dw += dy * zhat
        acc_db += dy
        out_offs = rows64 * H + cols[None, :]
        if HAS_RES:
            tl.store(DRES + out_offs, dz.to(DRES.dtype.element_ty), mask=mask)
        if HAS_DROPOUT:
            keep = _dropout_keep(seed, rows, H, p, BLOCK_M, BLOCK_H)
            dz = tl.where(keep, dz * (1.0 / (1.0 - p)), 0.0)
        tl.store(DX + out_offs, dz.to(DX.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            acc_dbias += dz
    tl.store(DW_PART + pid * H + cols, tl.sum(acc_dw, axis=0), mask=col_ok)
    tl.store(DB_PART + pid * H + cols, tl.sum(acc_db, axis=0), mask=col_ok)
    if HAS_BIAS:
        tl.store(DBIAS_PART + pid * H + cols, tl.sum(acc_dbias, axis=0), mask=col_ok)


# --------------------------------------------------------------------------- launch configs
def row_tile_configs(max_rows: int = 64):
    """Candidate (rows per tile, num_warps) configs for row kernels; pruned per H by row_config_pruner."""
    return [triton.Config({"BLOCK_M": m}, num_warps=w)
            for m in (1, 2, 4, 8, 16, 32, 64) if m <= max_rows
            for w in (2, 4, 8, 16)]


def row_config_pruner(per_thread: Tuple[int, ...]):
    """early_config_prune for row kernels: tiles of >= 1K elements (several rows per program for
    small H) and no more rows than the problem has, giving each thread ``per_thread`` elements, in
    that order of preference (fewer rows first). Elements per thread set the register footprint:
    the compile report (sm_90, triton 3.6 and 3.9) finds spills at 16 per thread in the backward
    kernels (three fp32 accumulators and a prefetched tile) and in some forward variants, none
    at 4 or 8. When no tile gives an allowed count (H = 8192 needs 16 at 16 warps), the tiles
    with the fewest elements per thread remain."""
    def prune(configs, named_args, **kwargs):
        block_h = kwargs["BLOCK_H"]
        rows_cap = max(1, named_args.get("n_bucket", 1 << 16))

        def per(c):
            return c.kwargs["BLOCK_M"] * block_h // (32 * c.num_warps)
        fits = [c for c in configs
                if per(c) >= 4 and c.kwargs["BLOCK_M"] <= rows_cap
                and (c.kwargs["BLOCK_M"] * block_h >= 1024 or c.kwargs["BLOCK_M"] >= rows_cap)]
        kept = [c for c in fits if per(c) in per_thread]
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
    return max(16, triton.next_power_of_2(h))


def n_bucket(n: int) -> int:
    return min(triton.next_power_of_2(max(n, 1)), 1 << 16)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def row_groups(n_rows: int, device: torch.device, per_sm: int = 2):
    """(G, rows_per_program) for backward kernels that reduce over rows with per-program partials.

    per_sm programs per SM on GPU. The LayerNorm backward uses 2: all resident at once (no partial
    last wave), each keeping two tiles of loads in flight (it prefetches the next tile), while the
    [G, H] fp32 partial buffers stay small next to the [N, H] traffic (1% at N = 32K). Three
    under the interpreter, so tests cross program borders. rows_per_program is a multiple of the
    largest BLOCK_M, so only a program's last tile is partial.
    """
    target = 3 if device.type != "cuda" else per_sm * _sm_count(device.index if device.index is not None
                                                              else torch.cuda.current_device())
    rpp = triton.cdiv(triton.cdiv(n_rows, target), _MAX_ROWS_PER_TILE) * _MAX_ROWS_PER_TILE
    return triton.cdiv(n_rows, rpp), rpp


# Keys: H, the size class of N and every constexpr flag (dtypes are added by the autotuner).
# Elements per thread: 8 first (a 16-byte vector of bf16), then 4; the backward only 8.
FWD_PER_THREAD = (8, 4)
BWD_PER_THREAD = (8,)
_bdrln_fwd_tuned = autotune(row_tile_configs(), ["H", "n_bucket", "HAS_BIAS", "HAS_RES", "HAS_DROPOUT",
                                                  "STORE_PRE", "STORE_KEEP"],
                            row_config_pruner(FWD_PER_THREAD))(_bdrln_fwd_kernel)
_bdrln_bwd_tuned = autotune(row_tile_configs(_MAX_ROWS_PER_TILE), ["H", "n_bucket", "HAS_BIAS", "HAS_RES", "HAS_DROPOUT"],
                            row_config_pruner(BWD_PER_THREAD))(_bdrln_bwd_kernel)


# --------------------------------------------------------------------------- validation helpers
def check_rows(name: str, t: torch.Tensor, n: int, h: int, dtypes=FLOAT_DTYPES, device=None) -> None:
    """A [n, h] tensor whose rows are contiguous (stride(1) == 1) and do not overlap (stride(0) >= h)."""
    check_tensor(name, t, dtypes=dtypes, ndim=2, shape=(n, h), device=device)
    if h > 1 and t.stride(1) != 1:
        raise ValueError(f"{name}: expected unit column stride (rows may be strided), got strides {t.stride()}")
    if n > 1 and t.stride(0) < h:
        raise ValueError(f"{name}: expected row stride >= {h} (non-overlapping rows), got strides {t.stride()}")


def check_hidden(h: int) -> None:
    if not 1 <= h <= MAX_HIDDEN:
        raise ValueError(f"hidden size: expected 1 <= H <= {MAX_HIDDEN}, got {h}")


def check_dropout(p: float, seed: Optional[torch.Tensor], device: torch.device) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p: expected 0 <= p < 1, got {p}")
    if p > 0.0:
        if seed is None:
            raise ValueError("seed: expected an int64 tensor of shape [1] when dropout_p > 0, got None")
        check_tensor("seed", seed, dtypes=(torch.int64,), shape=(1,), device=device)


def row_stride(t: torch.Tensor, h: int) -> int:
    return t.stride(0) if t.shape[0] > 1 else h


# --------------------------------------------------------------------------- launchers
def bias_dropout_residual_layernorm_fwd(x: torch.Tensor, bias: Optional[torch.Tensor],
                                        residual: Optional[torch.Tensor], weight: torch.Tensor,
                                        ln_bias: torch.Tensor, eps: float, dropout_p: float,
                                        seed: Optional[torch.Tensor], return_dropout_mask: bool = False):
    """y = LN(residual + Dropout(x + bias)) * weight + ln_bias.

    Returns (y [N, H], pre_norm [N, H], mean [N] fp32, rstd [N] fp32), plus keep [N, H] bool
    when return_dropout_mask. y and pre_norm take x's dtype; pre_norm is x itself when there
    is no bias, no residual and no dropout.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    n, h = x.shape
    check_hidden(h)
    check_rows("x", x, n, h)
    dev = x.device
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES, shape=(h,), device=dev)
    if residual is not None:
        check_rows("residual", residual, n, h, dtypes=(x.dtype,), device=dev)
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, shape=(h,), device=dev)
    check_tensor("ln_bias", ln_bias, dtypes=FLOAT_DTYPES, shape=(h,), device=dev)
    check_dropout(dropout_p, seed, dev)
    for name, t in (("bias", bias), ("weight", weight), ("ln_bias", ln_bias)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous vector, got strides {t.stride()}")

    has_dropout = dropout_p > 0.0
    store_pre = bias is not None or residual is not None or has_dropout
    store_keep = return_dropout_mask and has_dropout
    y = torch.empty((n, h), dtype=x.dtype, device=dev)
    pre = torch.empty((n, h), dtype=x.dtype, device=dev) if store_pre else x
    mean = torch.empty((n,), dtype=torch.float32, device=dev)
    rstd = torch.empty((n,), dtype=torch.float32, device=dev)
    keep = None
    if return_dropout_mask:
        keep = (torch.empty((n, h), dtype=torch.bool, device=dev) if store_keep
                else torch.ones((n, h), dtype=torch.bool, device=dev))
    if n > 0:
        block_h = block_h_for(h)
        args = (x, bias if bias is not None else weight, residual if residual is not None else x,
                weight, ln_bias, y, pre, mean, rstd, keep if store_keep else y,
                seed if has_dropout else mean,
                n, h, row_stride(x, h), row_stride(residual, h) if residual is not None else h,
                float(eps), float(dropout_p), n_bucket(n))
        flags = dict(HAS_BIAS=bias is not None, HAS_RES=residual is not None, HAS_DROPOUT=has_dropout,
                     STORE_PRE=store_pre, STORE_KEEP=store_keep, BLOCK_H=block_h)
        launch(_bdrln_fwd_tuned, lambda meta: (triton.cdiv(n, meta["BLOCK_M"]),), args, flags,
               interp={"BLOCK_M": interpreter_rows(block_h, 16)})
    out = (y, pre, mean, rstd)
    return out + (keep,) if return_dropout_mask else out


def bias_dropout_residual_layernorm_bwd(dy: torch.Tensor, pre_norm: torch.Tensor, mean: torch.Tensor,
                                        rstd: torch.Tensor, weight: torch.Tensor, dropout_p: float,
                                        seed: Optional[torch.Tensor], has_bias: bool, has_residual: bool):
    """Gradients of bias_dropout_residual_layernorm_fwd.

    Returns (dx [N, H], dbias [H] | None, dresidual [N, H] | None, dweight [H], dln_bias [H]).
    dx and dresidual take dy's dtype; dbias, dweight and dln_bias are summed in fp32 and take
    weight's dtype (the backward is not given bias or ln_bias; they share weight's dtype in BERT).
    """
    check_tensor("dy", dy, dtypes=FLOAT_DTYPES, ndim=2)
    n, h = dy.shape
    check_hidden(h)
    dev = dy.device
    check_rows("dy", dy, n, h)
    check_rows("pre_norm", pre_norm, n, h, dtypes=(dy.dtype,), device=dev)
    check_tensor("mean", mean, dtypes=(torch.float32,), shape=(n,), device=dev)
    check_tensor("rstd", rstd, dtypes=(torch.float32,), shape=(n,), device=dev)
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, shape=(h,), device=dev)
    if not (mean.is_contiguous() and rstd.is_contiguous() and weight.is_contiguous()):
        raise ValueError("mean, rstd, weight: expected contiguous vectors, got strides "
                         f"{mean.stride()}, {rstd.stride()}, {weight.stride()}")
    check_dropout(dropout_p, seed, dev)

    has_dropout = dropout_p > 0.0
    dx = torch.empty((n, h), dtype=dy.dtype, device=dev)
    dres = torch.empty((n, h), dtype=dy.dtype, device=dev) if has_residual else None
    if n == 0:
        zero = torch.zeros((h,), dtype=weight.dtype, device=dev)
        return dx, (zero.clone() if has_bias else None), dres, zero.clone(), zero.clone()
    groups, rpp = row_groups(n, dev)
    part = torch.empty((3 if has_bias else 2, groups, h), dtype=torch.float32, device=dev)
    block_h = block_h_for(h)
    args = (dy, pre_norm, mean, rstd, weight, dx, dres if has_residual else dx,
            part[0], part[1], part[2] if has_bias else part[1], seed if has_dropout else mean,
            n, h, row_stride(dy, h), row_stride(pre_norm, h), rpp, float(dropout_p), n_bucket(n))
    flags = dict(HAS_BIAS=has_bias, HAS_RES=has_residual, HAS_DROPOUT=has_dropout, BLOCK_H=block_h)
    launch(_bdrln_bwd_tuned, (groups,), args, flags, interp={"BLOCK_M": interpreter_rows(block_h, 4)})
    sums = part.sum(dim=1)  # [2 or 3, H] fp32
    dweight = sums[0].to(weight.dtype)
    dln_bias = sums[1].to(weight.dtype)
    dbias = sums[2].to(weight.dtype) if has_bias else None
    return dx, dbias, dres, dweight, dln_bias
