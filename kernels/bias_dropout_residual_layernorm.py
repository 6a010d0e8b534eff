"""Fused bias + dropout + residual + LayerNorm (BERT's post-LN block), forward and backward.

Math, per row of H elements; every input is upcast to fp32 right after its load and all
arithmetic is fp32 (statistics included):

  forward
    h    = x + bias                                   (bias optional)
    d    = h * keep / (1 - p)                         keep = (u >= p), u from Philox (below)
    z    = residual + d                               (residual optional), rounded to the activation
                                                      dtype: pre_norm, stored once
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

  Statistics come from z as stored (rounded to the activation dtype), so y is exactly the
  LayerNorm of the pre_norm that the backward reads back (and that the next residual
  branch starts from), as in an unfused low-precision model; every backend does the same.
  The three row sums are per-program partial sums in fp32 (each program owns a contiguous
  block of rows and one row of a [G, H] buffer), then one reduction over G: no atomics.
  Every sum over a tile's columns or rows is order-free (kernels/_rows.py, exact_sum): its
  bits do not depend on the register layout Triton picks, which follows the row strides'
  alignment and the stores a variant makes, so a row-strided input gives the same bits as its
  contiguous copy, the forward's bits do not depend on return_dropout_mask or on the tuned
  config, and the backward's only through the row grouping of the parameter sums (BLOCK_M, G).

Dropout RNG: the row-op scheme of kernels/_rows.py (row_dropout_keep), a pure function of
(seed, row, col, H), so the backward regenerates the forward's mask exactly.

Launch: on GPU the row-tile shape (rows per program, num_warps) is autotuned per H, size class
of N, dtypes and flags; under the interpreter a fixed tile of ~4K elements is used. The backward
runs about four programs per SM, each walking a contiguous block of rows (a row group) one tile at
a time with the next four tiles' loads in flight (Triton's pipeline of BWD_STAGES stages, through
shared memory). The forward's candidates run either way: first as row groups (ROW_GROUPS programs
an SM, eight of two warps at BERT's rows, FWD_STAGES - 1 tiles ahead, the parameters loaded once a
program), then one program per BLOCK_M rows, whose loads are in flight only until it computes (the
H200 measured it at 62-89% of the copy bandwidth: docs/perf-model.md, "A program's life"). The
autotuner keeps the faster; both give the same bits.

Limits: H <= 8192 (one row per register tile); any number of rows; x / residual / dy /
pre_norm may be row-strided (stride(1) == 1, stride(0) >= H), anything else is a ValueError.
Plain LayerNorm is bias=None, residual=None, p=0: then pre_norm would be x itself, so nothing
is stored and the launcher returns None for it (the backward is given x).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from bertfast.contract import check_dropout, check_eps, check_rows, check_tensor, check_vector, row_stride

from ._common import autotune, cdiv, launch, resident_programs
from ._rows import (BWD_PER_THREAD, FWD_MAX_WARPS, FWD_PER_THREAD, MAX_ROWS_PER_TILE, block_h_for, check_hidden,
                    column_sums, hidden_reasons, interpreter_rows, layernorm_bwd_rows, layernorm_normalize,
                    layernorm_rows, load_cols, load_row_vector, n_bucket, program_rows, row_config_pruner,
                    row_dropout, row_groups, row_tile_configs, store_col_sums)


def unsupported(inputs) -> list:
    """Dispatch: reasons these inputs exceed this backend's limits ([] when it runs them)."""
    return hidden_reasons(inputs["x"].shape[-1])


# --------------------------------------------------------------------------- kernels
@triton.jit
def _fwd_rows(X, BIAS, RES, W, B, Y, PRE, MEAN, RSTD, KEEP, rows, row_ok, cols, col_ok, bias, w, b, seed,
              H, stride_x, stride_res, eps, p,
              HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              STORE_PRE: tl.constexpr, STORE_KEEP: tl.constexpr, LOADED: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """The forward of one row tile. LOADED: the parameters (bias, w, b: [1, BLOCK_H] fp32) and the
    seed are given, loaded once by a row group's program; else they are loaded here from BIAS, W, B
    and SEED (seed: its pointer), the weight and bias after the statistics (fewer live registers)."""
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    out_offs = rows64 * H + cols[None, :]
    # Both rows loaded before anything waits: a load issued after a barrier (a layout conversion's)
    # would start its memory round trip only once the loads before it had arrived.
    z = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        res = tl.load(RES + rows64 * stride_res + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += bias if LOADED else load_cols(BIAS, cols, col_ok)[None, :]
    if HAS_DROPOUT:
        z, keep = row_dropout(z, seed if LOADED else tl.load(seed), rows, H, p, BLOCK_M, BLOCK_H)
        if STORE_KEEP:
            tl.store(KEEP + out_offs, keep, mask=mask)
    if HAS_RES:
        z += res
    z = z.to(PRE.dtype.element_ty).to(tl.float32)  # the statistics describe pre_norm as stored
    if STORE_PRE:
        tl.store(PRE + out_offs, z.to(PRE.dtype.element_ty), mask=mask)
    if LOADED:
        zhat, mean, rstd = layernorm_normalize(z, mask, H, eps)
        y = zhat * w + b
    else:
        y, mean, rstd = layernorm_rows(z, mask, W, B, cols, col_ok, H, eps)
    tl.store(Y + out_offs, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _bias_dropout_residual_layernorm_fwd_kernel(
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
    ROW_GROUPS: tl.constexpr,  # programs an SM, each walking a contiguous block of rows (0: one tile each)
    STAGES: tl.constexpr,      # a row group's pipeline stages
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    if ROW_GROUPS:
        # The next STAGES - 1 tiles' loads are in flight (Triton's pipeline, through shared memory)
        # while a tile computes, and the parameters are loaded once a program, in the tile's layout.
        # The grid is what the GPU holds at once; its programs split the rows in blocks of whole tiles
        # (_rows.row_group_shape at BLOCK_M).
        _, row_start, row_end = program_rows(N, tl.cdiv(tl.cdiv(N, tl.num_programs(0)), BLOCK_M) * BLOCK_M)
        w = load_row_vector(W, cols, col_ok)
        b = load_row_vector(B, cols, col_ok)
        bias = load_row_vector(BIAS, cols, col_ok) if HAS_BIAS else w
        seed = tl.load(SEED) if HAS_DROPOUT else 0
        for m0 in tl.range(row_start, row_end, BLOCK_M, num_stages=STAGES):
            rows = m0 + tl.arange(0, BLOCK_M)
            _fwd_rows(X, BIAS, RES, W, B, Y, PRE, MEAN, RSTD, KEEP, rows, rows < row_end, cols, col_ok,
                      bias, w, b, seed, H, stride_x, stride_res, eps, p, HAS_BIAS, HAS_RES, HAS_DROPOUT,
                      STORE_PRE, STORE_KEEP, True, BLOCK_M, BLOCK_H)
    else:
        # One tile a program: its loads are in flight only until it computes (docs/perf-model.md,
        # "A program's life").
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        _fwd_rows(X, BIAS, RES, W, B, Y, PRE, MEAN, RSTD, KEEP, rows, rows < N, cols, col_ok,
                  0.0, 0.0, 0.0, SEED, H, stride_x, stride_res, eps, p, HAS_BIAS, HAS_RES, HAS_DROPOUT,
                  STORE_PRE, STORE_KEEP, False, BLOCK_M, BLOCK_H)


@triton.jit
def _bias_dropout_residual_layernorm_bwd_kernel(
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
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_DROPOUT: tl.constexpr, STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid, row_start, row_end = program_rows(N, rows_per_program)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    w = load_cols(W, cols, col_ok)
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    # Per-element accumulators, reduced over rows once at the end.
    acc_dw = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    acc_db = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    acc_dbias = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    # The loads are pipelined by Triton through shared memory (cp.async), STAGES - 1 tiles ahead of
    # the tile being computed. Prefetching into registers by hand cannot run ahead further than one
    # tile: a loaded register must be read before the loop's next pass loads into it again
    # (docs/perf-model.md, "The LayerNorm backward's prefetch").
    for m0 in tl.range(row_start, row_end, BLOCK_M, num_stages=STAGES):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        z = tl.load(PRE + rows64 * stride_pre + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        dz, acc_dw, acc_db = layernorm_bwd_rows(dy, z, mean, rstd, w, acc_dw, acc_db, H)
        out_offs = rows64 * H + cols[None, :]
        if HAS_RES:
            tl.store(DRES + out_offs, dz.to(DRES.dtype.element_ty), mask=mask)
        if HAS_DROPOUT:
            dz, _ = row_dropout(dz, seed, rows, H, p, BLOCK_M, BLOCK_H)
        tl.store(DX + out_offs, dz.to(DX.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            acc_dbias += dz
    store_col_sums(DW_PART, acc_dw, pid, H, cols, col_ok)
    store_col_sums(DB_PART, acc_db, pid, H, cols, col_ok)
    if HAS_BIAS:
        store_col_sums(DBIAS_PART, acc_dbias, pid, H, cols, col_ok)


# --------------------------------------------------------------------------- launch configs
# The backward's row groups (_rows.row_groups): programs per SM, each with BWD_STAGES - 1 tiles of loads
# in flight (Triton's pipeline, through shared memory: a 4 KB row of dy and pre_norm a stage in bf16 at
# BERT-large). Four programs four tiles ahead keep 64 KB in flight an SM, so the perf model's latency
# bound stays under the H200's bandwidth up to a loaded latency of 3.5 us (docs/perf-model.md), for
# 3 x [G, H] fp32 partials of 6.3 MB. Four one tile ahead read at 76% of the copy bandwidth on the H100,
# and took the same time on the H200 (58 us) when two tiles held in registers were in fact one.
BWD_PROGRAMS_PER_SM = 4
BWD_STAGES = 5  # the backward loop's pipeline stages (what the perf model reads), fewer for wide rows:
BWD_STAGE_BYTES = 48 * 1024  # at most this much shared memory a program for them (four an SM fit 228 KB)
BWD_MAX_WARPS = 8  # the backward's tiles (at most 8 warps, BWD_PER_THREAD elements a thread, a row above)
# The forward's row groups: FWD_GROUP_WARPS warps an SM (eight programs of two warps: a BERT row), each
# FWD_STAGES - 1 tiles ahead: at BERT-large in bf16, 96 KB of loads in flight an SM, which keeps the perf
# model's latency bound under the H200's bandwidth up to a loaded latency of about 5 us. Their parameters
# stay in registers (three fp32 vectors: 48 a thread at 16 elements), under the 128 that eight programs allow.
FWD_GROUP_WARPS = 16
FWD_STAGES = 4
FWD_STAGE_BYTES = 24 * 1024  # at most this much shared memory a program for them
# Candidates a tuning key: the first row-group tiles and the first one-tile tiles of the pruned list.
FWD_GROUP_CANDIDATES = 2
FWD_TILE_CANDIDATES = 4


def _fwd_configs():
    """The forward's candidates: the row tiles of up to MAX_ROWS_PER_TILE rows as row groups, then every
    row tile as one tile a program."""
    tiles = row_tile_configs()
    return ([triton.Config({**c.kwargs, "ROW_GROUPS": max(1, FWD_GROUP_WARPS // c.num_warps)},
                           num_warps=c.num_warps) for c in tiles if c.kwargs["BLOCK_M"] <= MAX_ROWS_PER_TILE]
            + [triton.Config({**c.kwargs, "ROW_GROUPS": 0}, num_warps=c.num_warps) for c in tiles])


# Under the interpreter: row groups (three programs, so tests cross their borders) through a pipeline of
# two stages; a test sets ROW_GROUPS to 0 to run one tile a program.
FWD_INTERP = {"ROW_GROUPS": 1, "STAGES": 2}


def _stages_within(tile_bytes: int, stages: int, budget: int) -> int:
    """A row loop's pipeline stages for tiles whose pipelined loads take ``tile_bytes``: ``stages``, fewer
    (at least 2) where the STAGES - 1 buffers would hold more than ``budget`` bytes."""
    return max(2, min(stages, 1 + budget // tile_bytes))


def fwd_stages(tile_bytes: int) -> int:
    """A forward row group's stages for tiles whose x and residual take ``tile_bytes`` (FWD_STAGES,
    within FWD_STAGE_BYTES)."""
    return _stages_within(tile_bytes, FWD_STAGES, FWD_STAGE_BYTES)


def _fwd_pruner():
    """The row tiles' pruner (row_config_pruner) over each way of running, the first FWD_GROUP_CANDIDATES
    row-group tiles, then the first FWD_TILE_CANDIDATES one-tile tiles, each given its STAGES: fwd_stages
    of its tile for row groups, 1 (no loop) for one tile a program."""
    tiles = row_config_pruner(FWD_PER_THREAD, FWD_MAX_WARPS)

    def prune(configs, named_args, **kwargs):
        loaded = named_args["X"].element_size() * (2 if kwargs["HAS_RES"] else 1)  # a tile element's loads

        def staged(c):
            tile = c.kwargs["BLOCK_M"] * kwargs["BLOCK_H"] * loaded
            stages = fwd_stages(tile) if c.kwargs["ROW_GROUPS"] else 1
            return triton.Config({**c.kwargs, "STAGES": stages}, num_warps=c.num_warps, num_stages=c.num_stages)
        groups = tiles([c for c in configs if c.kwargs["ROW_GROUPS"]], named_args, **kwargs)
        single = tiles([c for c in configs if not c.kwargs["ROW_GROUPS"]], named_args, **kwargs)
        return [staged(c) for c in groups[:FWD_GROUP_CANDIDATES] + single[:FWD_TILE_CANDIDATES]]
    return prune


def fwd_grid(n: int, device: torch.device):
    """The forward's grid for a config's meta: ROW_GROUPS programs an SM (no more than its tiles), or
    one program a tile."""
    def grid(meta):
        tiles = cdiv(n, meta["BLOCK_M"])
        return (min(tiles, resident_programs(device, meta["ROW_GROUPS"])) if meta["ROW_GROUPS"] else tiles,)
    return grid


# Keys: H, the size class of N and every constexpr flag (dtypes are added by the autotuner).
_fwd_tuned = autotune(_fwd_configs(), ["H", "n_bucket", "HAS_BIAS", "HAS_RES", "HAS_DROPOUT",
                                       "STORE_PRE", "STORE_KEEP"], _fwd_pruner()
                      )(_bias_dropout_residual_layernorm_fwd_kernel)
# At most 8 warps: the fp32 accumulators and a tile spill at 16 (128 registers a thread; sm_90).
_bwd_tuned = autotune(row_tile_configs(MAX_ROWS_PER_TILE), ["H", "n_bucket", "HAS_BIAS", "HAS_RES", "HAS_DROPOUT"],
                            row_config_pruner(BWD_PER_THREAD, max_warps=BWD_MAX_WARPS)
                            )(_bias_dropout_residual_layernorm_bwd_kernel)


def bwd_stages(block_h: int, element_bytes: int) -> int:
    """The backward loop's pipeline stages for rows of ``block_h`` columns whose dy and pre_norm take
    ``element_bytes`` an element together: BWD_STAGES, fewer (at least 2) where the STAGES - 1 buffers
    of the largest tile a candidate may take would hold more than BWD_STAGE_BYTES."""
    tile = max(max(BWD_PER_THREAD) * 32 * BWD_MAX_WARPS, block_h) * element_bytes
    return _stages_within(tile, BWD_STAGES, BWD_STAGE_BYTES)


# --------------------------------------------------------------------------- launchers
def bias_dropout_residual_layernorm_fwd(x: torch.Tensor, bias: Optional[torch.Tensor],
                                        residual: Optional[torch.Tensor], weight: torch.Tensor,
                                        ln_bias: torch.Tensor, eps: float, dropout_p: float,
                                        seed: Optional[torch.Tensor], return_dropout_mask: bool = False):
    """y = LN(residual + Dropout(x + bias)) * weight + ln_bias.

    Returns (y [N, H], pre_norm [N, H] | None, mean [N] fp32, rstd [N] fp32), plus keep [N, H]
    bool when return_dropout_mask. y and pre_norm take x's dtype; pre_norm is None when there is
    no bias, no residual and no dropout (it would be x).
    """
    n, h = check_rows("x", x)
    check_hidden(h)
    dev = x.device
    if bias is not None:
        check_vector("bias", bias, h, dev)
    if residual is not None:
        check_rows("residual", residual, n, h, dtypes=(x.dtype,), device=dev)
    check_vector("weight", weight, h, dev)
    check_vector("ln_bias", ln_bias, h, dev)
    eps = check_eps(eps)
    dropout_p = check_dropout(dropout_p, seed, dev)

    has_dropout = dropout_p > 0.0
    store_pre = bias is not None or residual is not None or has_dropout
    store_keep = return_dropout_mask and has_dropout
    y = torch.empty((n, h), dtype=x.dtype, device=dev)
    pre = torch.empty((n, h), dtype=x.dtype, device=dev) if store_pre else None
    mean = torch.empty((n,), dtype=torch.float32, device=dev)
    rstd = torch.empty((n,), dtype=torch.float32, device=dev)
    keep = None
    if return_dropout_mask:
        keep = (torch.empty((n, h), dtype=torch.bool, device=dev) if store_keep
                else torch.ones((n, h), dtype=torch.bool, device=dev))
    if n > 0:
        block_h = block_h_for(h)
        args = (x, bias if bias is not None else weight, residual if residual is not None else x,
                weight, ln_bias, y, pre if store_pre else x, mean, rstd, keep if store_keep else y,
                seed if has_dropout else mean,
                n, h, row_stride(x), row_stride(residual) if residual is not None else h,
                eps, dropout_p, n_bucket(n))
        flags = dict(HAS_BIAS=bias is not None, HAS_RES=residual is not None, HAS_DROPOUT=has_dropout,
                     STORE_PRE=store_pre, STORE_KEEP=store_keep, BLOCK_H=block_h)
        launch(_fwd_tuned, fwd_grid(n, dev), args, flags,
               interp={"BLOCK_M": interpreter_rows(block_h, MAX_ROWS_PER_TILE), **FWD_INTERP})
    out = (y, pre, mean, rstd)
    return out + (keep,) if return_dropout_mask else out


def bias_dropout_residual_layernorm_bwd(dy: torch.Tensor, pre_norm: torch.Tensor, mean: torch.Tensor,
                                        rstd: torch.Tensor, weight: torch.Tensor, dropout_p: float,
                                        seed: Optional[torch.Tensor], has_bias: bool, has_residual: bool):
    """Gradients of bias_dropout_residual_layernorm_fwd (pre_norm: the forward's, or x where it
    returned None).

    Returns (dx [N, H], dbias [H] | None, dresidual [N, H] | None, dweight [H], dln_bias [H]).
    dx and dresidual take dy's dtype; dbias, dweight and dln_bias are summed in fp32 and take
    weight's dtype (the backward is not given bias or ln_bias; they share weight's dtype in BERT).
    """
    n, h = check_rows("dy", dy)
    check_hidden(h)
    dev = dy.device
    check_rows("pre_norm", pre_norm, n, h, dtypes=(dy.dtype,), device=dev)
    for name, t in (("mean", mean), ("rstd", rstd)):
        check_tensor(name, t, dtypes=(torch.float32,), shape=(n,), device=dev)
        if n > 1 and t.stride(0) != 1:
            raise ValueError(f"{name}: expected a contiguous vector, got strides {t.stride()}")
    check_vector("weight", weight, h, dev)
    dropout_p = check_dropout(dropout_p, seed, dev)

    has_dropout = dropout_p > 0.0
    dx = torch.empty((n, h), dtype=dy.dtype, device=dev)
    dres = torch.empty((n, h), dtype=dy.dtype, device=dev) if has_residual else None
    if n == 0:
        zero = torch.zeros((h,), dtype=weight.dtype, device=dev)
        return dx, (zero.clone() if has_bias else None), dres, zero.clone(), zero.clone()
    groups, rpp = row_groups(n, dev, BWD_PROGRAMS_PER_SM)
    part = torch.empty((3 if has_bias else 2, groups, h), dtype=torch.float32, device=dev)
    block_h = block_h_for(h)
    args = (dy, pre_norm, mean, rstd, weight, dx, dres if has_residual else dx,
            part[0], part[1], part[2] if has_bias else part[1], seed if has_dropout else mean,
            n, h, row_stride(dy), row_stride(pre_norm), rpp, dropout_p, n_bucket(n))
    flags = dict(HAS_BIAS=has_bias, HAS_RES=has_residual, HAS_DROPOUT=has_dropout, BLOCK_H=block_h,
                 STAGES=bwd_stages(block_h, dy.element_size() + pre_norm.element_size()))
    launch(_bwd_tuned, (groups,), args, flags, interp={"BLOCK_M": interpreter_rows(block_h, 4)})
    dweight, dln_bias, *dbias = column_sums(part, [weight.dtype] * part.shape[0])
    return dx, dbias[0] if has_bias else None, dres, dweight, dln_bias
