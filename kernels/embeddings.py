"""Fused BERT embeddings on unpadded tokens: gather + sum + LayerNorm + dropout, forward and backward.

Math, per token t (one row of H elements), fp32 after upcasting every load:

  forward
    h    = word[input_ids[t]] + pos[position_ids[t]] + token_type[token_type_ids[t]]
    mean = sum(h) / H,   rstd = 1 / sqrt(sum((h - mean)^2) / H + eps)
    zhat = (h - mean) * rstd
    y    = (zhat * ln_weight + ln_bias) * keep / (1 - p)     keep: kernels/_rows.py's row_dropout_keep
  backward (h recomputed from the tables, bit-identical to the forward; keep regenerated)
    dz         = dy * keep / (1 - p)
    dln_weight = sum_t dz * zhat,   dln_bias = sum_t dz        (per-program fp32 partials, then a sum)
    g          = dz * ln_weight
    dh         = rstd * (g - zhat * sum(g * zhat) / H - sum(g) / H)
    dword[v]   = sum of dh[t] over the tokens t with input_ids[t] == v   (likewise dpos over
    dpos[q]      position_ids, and dtoken_type over token_type_ids)
  The table gradients are deterministic: no atomics, every sum taken in one fixed order, so a
  step gives the same bits every time (a stopped run resumes exactly, docs/training.md). The
  wrapper builds the stacked row keys (ids, V + position ids) and sorts them (torch.sort, stable:
  a row's tokens stay in token order; on the device, no host read, graph-safe): the T word
  entries first, then the T position entries. The sorted entries are cut into chunks of
  _TABLE_CHUNK, a program each, so every program's work is bounded whatever the ids (at BERT's
  phase 1 [MASK] alone holds ~2,000 of the 32,768 sorted entries). A program walks its chunk's
  entries, computing each entry's dh row from its token (nothing [T, H] is stored) and adding it
  to its run of equal keys, one entry after another: a run inside the chunk is a whole table
  row, stored; the runs cut by the chunk's edges leave partial sums. So a table row is its
  tokens' dh rows added in token order within a chunk, then the chunks in order, as
  csrc/embeddings.cu adds them (it stores dh and sums it in chunks of its own size). Three
  launches:
    _embeddings_bwd_kernel      the walk by word: each token's LayerNorm backward, its row sums
                                (the scalars a = sum(g * zhat) * rstd / H, c = sum(g) * rstd / H)
                                stored, [2, T] fp32; the word table's runs.
    _embeddings_bwd_pos_kernel  the walk by position: each token's dh again from a and c (no row
                                sums: dh = rstd * g - (zhat * a + c), the same expression, so the
                                same bits), the position table's runs, and each token once the
                                ln and token-type partials.
    _table_rows_kernel          stores every other row once: zeros for rows no token uses (no
                                zero-fill pass), the sum of its chunks' partials in chunk order for
                                the rows that cross chunks.
  Walking twice reads dy and the gathered rows twice (the word table, larger than L2, from DRAM
  again) where storing dh [T, H] fp32 wrote it once and read it once a table: at BERT-large's
  16,384 tokens 351 MB moved against 449 (docs/perf-model.md). Rows are stored in the table's
  dtype (no cast pass).
  Token-type rows are few (2 in BERT), so every token would hit the same rows: per-program fp32
  partials in registers, then a sum over programs, when the table has <= 4 rows; else its rows
  join the sorted reduction (keys V + P + token-type ids, walked with the positions).
  The LayerNorm sums (statistics, the backward's row sums, the ln partials) are order-free
  (kernels/_rows.py, exact_sum): the forward gives the same bits whether or not it stores
  the keep-mask, whatever the tables' row strides or the tuned config.

Launch: the forward as kernels/bias_dropout_residual_layernorm.py (row tiles autotuned on GPU,
fixed under the interpreter). The backward's three kernels have one fixed configuration each
(never autotuned: the chunk and the walks' tiles set the order of the sums).

Limits: H <= 8192; ids 1-D int32/int64 of one length T, in range (the caller validates);
tables 2-D with unit column stride. The dropout counter is (token row, column), as in every
row op, so the keep-mask of token t does not depend on the launch.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from bertfast.contract import (FLOAT_DTYPES, ID_DTYPES, check_dropout, check_eps, check_rows, check_tensor,
                               check_vector, row_stride)

from ._common import autotune, cdiv, interpreting, launch, next_power_of_2
from ._rows import (FWD_MAX_WARPS, FWD_PER_THREAD, block_h_for, check_hidden, column_sums,
                    hidden_reasons, interpreter_rows, layernorm_bwd_coefs, layernorm_dx, layernorm_rows,
                    layernorm_zhat, load_cols, n_bucket, row_config_pruner, row_dropout, row_tile_configs,
                    store_col_sums)

_MAX_TYPES_IN_REGISTERS = 4


def unsupported(inputs) -> list:
    """Dispatch: reasons these inputs exceed this backend's limits ([] when it runs them)."""
    return hidden_reasons(inputs["word"].shape[-1])


# --------------------------------------------------------------------------- kernels
@triton.jit
def _gather_rows(IDS, PIDS, TIDS, WORD, POS, TT, rows, row_ok, cols, mask, stride_word, stride_pos, stride_tt):
    """(h, ids, pids, tids): h = word[ids] + pos[pids] + tt[tids] as fp32 [BLOCK_M, BLOCK_H] for the
    given rows, and the ids as int64 [BLOCK_M] (0 past the end)."""
    ids = tl.load(IDS + rows, mask=row_ok, other=0).to(tl.int64)
    pids = tl.load(PIDS + rows, mask=row_ok, other=0).to(tl.int64)
    tids = tl.load(TIDS + rows, mask=row_ok, other=0).to(tl.int64)
    h = tl.load(WORD + ids[:, None] * stride_word + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h += tl.load(POS + pids[:, None] * stride_pos + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h += tl.load(TT + tids[:, None] * stride_tt + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return h, ids, pids, tids


@triton.jit
def _embeddings_fwd_kernel(
    IDS,    # [T] int32/int64 word ids
    PIDS,   # [T] int32/int64 position ids
    TIDS,   # [T] int32/int64 token-type ids
    WORD,   # [V, H] word table, row stride stride_word
    POS,    # [P, H] position table, row stride stride_pos
    TT,     # [TT, H] token-type table, row stride stride_tt
    W,      # [H] LayerNorm weight
    B,      # [H] LayerNorm bias
    Y,      # [T, H] output, contiguous, out_dtype
    MEAN,   # [T] fp32
    RSTD,   # [T] fp32
    KEEP,   # [T, H] bool keep-mask (written only when STORE_KEEP)
    SEED,   # [1] int64 dropout seed (read only when HAS_DROPOUT)
    N, H, stride_word, stride_pos, stride_tt, eps, p,
    n_bucket,  # autotune key only
    HAS_DROPOUT: tl.constexpr, STORE_KEEP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_H)
    row_ok = rows < N
    col_ok = cols < H
    mask = row_ok[:, None] & col_ok[None, :]
    h, _, _, _ = _gather_rows(IDS, PIDS, TIDS, WORD, POS, TT, rows, row_ok, cols, mask,
                              stride_word, stride_pos, stride_tt)
    y, mean, rstd = layernorm_rows(h, mask, W, B, cols, col_ok, H, eps)
    out_offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
    if HAS_DROPOUT:
        y, keep = row_dropout(y, tl.load(SEED), rows, H, p, BLOCK_M, BLOCK_H)
        if STORE_KEEP:
            tl.store(KEEP + out_offs, keep, mask=mask)
    tl.store(Y + out_offs, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _walk_rows(DY, IDS, PIDS, TIDS, WORD, POS, TT, MEAN, RSTD, KEYS, ORDER, seed, e0, last, T, H, cols, col_ok,
               stride_dy, stride_word, stride_pos, stride_tt, p,
               HAS_DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """Sorted entries e0 .. e0 + BLOCK_M (those before ``last``) of a walk: (ok, keys, the next entries'
    keys (-1 past ``last``: a run ends there), their tokens, the tokens' type ids, and dz, zhat as fp32
    [BLOCK_M, BLOCK_H] tiles with rstd; 0 in the rows past ``last``)."""
    e = e0 + tl.arange(0, BLOCK_M)
    ok = e < last
    keys = tl.load(KEYS + e, mask=ok, other=-1)
    nexts = tl.load(KEYS + e + 1, mask=e + 1 < last, other=-1)
    tok = tl.load(ORDER + e, mask=ok, other=0) % T
    mask = ok[:, None] & col_ok[None, :]
    h, _, _, tids = _gather_rows(IDS, PIDS, TIDS, WORD, POS, TT, tok, ok, cols, mask,
                                 stride_word, stride_pos, stride_tt)
    mean = tl.load(MEAN + tok, mask=ok, other=0.0)
    rstd = tl.load(RSTD + tok, mask=ok, other=0.0)
    dz = tl.load(DY + tok[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        dz, _ = row_dropout(dz, seed, tok, H, p, BLOCK_M, BLOCK_H)
    return ok, keys, nexts, tok, tids, dz, layernorm_zhat(h, mean, rstd), rstd


@triton.jit
def _add_to_runs(run, prev, keys, nexts, dh, e0, last, before, after, c, PART, TABLE, base, TABLE2, base2, H,
                 cols, col_ok, TWO_TABLES: tl.constexpr, BLOCK_M: tl.constexpr):
    """Adds the tile's dh rows to their runs of equal keys, one entry after another (the same order
    whatever BLOCK_M), and stores each run that ends in the tile: into PART when it crosses the chunk's
    edge (its key is ``before``: PART[c, 0]; else ``after``: PART[c, 1]), else into its table row (key -
    base of TABLE; with TWO_TABLES, key - base2 of TABLE2 from base2 on). (run, prev key) carry on."""
    slots = tl.arange(0, BLOCK_M)
    for j in tl.static_range(BLOCK_M):
        at = slots == j
        key = tl.sum(tl.where(at, keys, 0), axis=0)
        run = tl.where(key == prev, run, 0.0) + tl.sum(tl.where(at[:, None], dh, 0.0), axis=0)
        prev = key
        if (e0 + j < last) & (tl.sum(tl.where(at, nexts, 0), axis=0) != key):  # the run's last entry here
            if (key == before) | (key == after):
                slot = (2 * c + tl.where(key == before, 0, 1)).to(tl.int64)
                tl.store(PART + slot * H + cols, run, mask=col_ok)
            else:
                k = key.to(tl.int64)
                if k >= base2 if TWO_TABLES else False:  # a constexpr False without TABLE2: no branch
                    tl.store(TABLE2 + (k - base2) * H + cols, run.to(TABLE2.dtype.element_ty), mask=col_ok)
                else:
                    tl.store(TABLE + (k - base) * H + cols, run.to(TABLE.dtype.element_ty), mask=col_ok)
    return run, prev


@triton.jit
def _embeddings_bwd_kernel(
    DY,       # [T, H] upstream gradient, row stride stride_dy
    IDS,      # [T] word ids
    PIDS,     # [T] position ids
    TIDS,     # [T] token-type ids
    WORD,     # [V, H] word table (to recompute h)
    POS,      # [P, H] position table
    TT,       # [TT, H] token-type table
    W,        # [H] LayerNorm weight
    MEAN,     # [T] fp32 from the forward
    RSTD,     # [T] fp32 from the forward
    KEYS,     # [N] int32 sorted keys: the stacked table row of each entry (T word ids first, then V + position
    #           ids, and with sorted token types V + P + type ids)
    ORDER,    # [N] int64: each sorted entry's index into the unsorted keys (its token, + T per table)
    PART,     # [chunks, 2, H] fp32: the sums of the runs cut by a chunk's edges
    COEF,     # [2, T] fp32 out: each token's LayerNorm backward scalars (a, c), for the walk by position
    DWORD,    # [V, H] word table gradient, contiguous, in the table's dtype
    SEED,     # [1] int64 dropout seed (read only when HAS_DROPOUT)
    N, T, H, stride_dy, stride_word, stride_pos, stride_tt, p,
    HAS_DROPOUT: tl.constexpr, CHUNK: tl.constexpr, STAGES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """The walk by word: each program the word entries of one chunk, BLOCK_M at a time. Each entry's
    token: its LayerNorm backward's row sums (the scalars a and c, stored for the walk by position) and
    dh, added to its word's run (_add_to_runs)."""
    c = tl.program_id(0)
    first = c * CHUNK
    last = tl.minimum(first + CHUNK, T)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    w = load_cols(W, cols, col_ok)
    seed = tl.load(SEED) if HAS_DROPOUT else 0
    # The keys just outside the chunk: a run of either crosses the chunk's edge (the next table's keys
    # never equal a word's).
    before = tl.load(KEYS + first - 1, mask=c > 0, other=-1)
    after = tl.load(KEYS + last, mask=last < N, other=-1)
    run = tl.sum(tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32), axis=0)  # the current run's sum
    prev = tl.load(KEYS + first) - 1  # no key: the first entry starts a run
    for e0 in tl.range(first, last, BLOCK_M, num_stages=STAGES):
        ok, keys, nexts, tok, _, dz, zhat, rstd = _walk_rows(
            DY, IDS, PIDS, TIDS, WORD, POS, TT, MEAN, RSTD, KEYS, ORDER, seed, e0, last, T, H, cols, col_ok,
            stride_dy, stride_word, stride_pos, stride_tt, p, HAS_DROPOUT, BLOCK_M, BLOCK_H)
        g = dz * w[None, :]
        a, b = layernorm_bwd_coefs(g, zhat, rstd, H)
        tl.store(COEF + tok, a, mask=ok)
        tl.store(COEF + T + tok, b, mask=ok)
        run, prev = _add_to_runs(run, prev, keys, nexts, layernorm_dx(g, zhat, rstd, a, b), e0, last, before, after,
                                 c, PART, DWORD, 0, DWORD, 0, H, cols, col_ok, False, BLOCK_M)


@triton.jit
def _embeddings_bwd_pos_kernel(
    DY, IDS, PIDS, TIDS, WORD, POS, TT, W, MEAN, RSTD, KEYS, ORDER, PART,  # as _embeddings_bwd_kernel's
    COEF,     # [2, T] fp32: the scalars (a, c) the walk by word stored
    DPOS,     # [P, H] position table gradient, contiguous, in the table's dtype
    DTT,      # TT_SORTED: [TT, H] token-type table gradient (unused otherwise)
    DTT_PART,  # not TT_SORTED: [G, NUM_TYPES, H] fp32 partials, G the grid's programs (unused otherwise)
    DW_PART,  # [G, H] fp32 partial sums of dz * zhat
    DB_PART,  # [G, H] fp32 partial sums of dz
    SEED,
    N, T, H, V, P, NUM_TYPES, stride_dy, stride_word, stride_pos, stride_tt, p,
    HAS_DROPOUT: tl.constexpr, TT_SORTED: tl.constexpr, TT_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr, STAGES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """The walk by position (and token type, when TT_SORTED): the entries from T on, each program those
    of one chunk (the first program's from T). Each entry's dh from its token's a and c (no row sums),
    added to its row's run (_add_to_runs); each position entry's token (each token once) adds to the
    partials of the LayerNorm parameters' gradients and, unless TT_SORTED, of the token types'."""
    pid = tl.program_id(0)
    c = T // CHUNK + pid
    first = tl.maximum(c * CHUNK, T)
    last = tl.minimum(c * CHUNK + CHUNK, N)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    w = load_cols(W, cols, col_ok)
    seed = tl.load(SEED) if HAS_DROPOUT else 0
    before = tl.load(KEYS + first - 1)  # first >= T >= 1
    after = tl.load(KEYS + last, mask=last < N, other=-1)
    acc_dw = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    acc_db = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    types = tl.arange(0, TT_BLOCK)
    acc_tt = tl.zeros([TT_BLOCK, BLOCK_H], dtype=tl.float32)
    run = tl.sum(acc_dw, axis=0)
    prev = tl.load(KEYS + first) - 1
    for e0 in tl.range(first, last, BLOCK_M, num_stages=STAGES):
        ok, keys, nexts, tok, tids, dz, zhat, rstd = _walk_rows(
            DY, IDS, PIDS, TIDS, WORD, POS, TT, MEAN, RSTD, KEYS, ORDER, seed, e0, last, T, H, cols, col_ok,
            stride_dy, stride_word, stride_pos, stride_tt, p, HAS_DROPOUT, BLOCK_M, BLOCK_H)
        a = tl.load(COEF + tok, mask=ok, other=0.0)
        b = tl.load(COEF + T + tok, mask=ok, other=0.0)
        dh = layernorm_dx(dz * w[None, :], zhat, rstd, a, b)
        if TT_SORTED:  # the token-type entries come after the positions': each token once
            dz = tl.where((keys < V + P)[:, None], dz, 0.0)
        acc_dw += dz * zhat  # the rows past ``last`` add 0
        acc_db += dz
        if not TT_SORTED:
            for t in tl.static_range(TT_BLOCK):
                s = tl.sum(tl.where((tids == t)[:, None], dh, 0.0), axis=0)   # [BLOCK_H]
                acc_tt += tl.where((types == t)[:, None], s[None, :], 0.0)
        run, prev = _add_to_runs(run, prev, keys, nexts, dh, e0, last, before, after, c, PART, DPOS, V, DTT, V + P,
                                 H, cols, col_ok, TT_SORTED, BLOCK_M)
    store_col_sums(DW_PART, acc_dw, pid, H, cols, col_ok)
    store_col_sums(DB_PART, acc_db, pid, H, cols, col_ok)
    if not TT_SORTED:
        tt_offs = (pid * NUM_TYPES + types)[:, None] * H + cols[None, :]
        tl.store(DTT_PART + tt_offs, acc_tt, mask=(types < NUM_TYPES)[:, None] & col_ok[None, :])


@triton.jit
def _store_table_rows(DWORD, DPOS, DTT, keys, g, ok, cols, col_ok, H, V, P, TT_SORTED: tl.constexpr):
    """Rows ``keys`` of the stacked tables [word; position; token type] (the last only when the token
    types are sorted with them): g [len(keys), BLOCK_H] fp32 into its table, in its dtype, where ``ok``."""
    k = keys.to(tl.int64)[:, None]
    m = ok[:, None] & col_ok[None, :]
    tl.store(DWORD + k * H + cols[None, :], g.to(DWORD.dtype.element_ty), mask=m & (k < V))
    tl.store(DPOS + (k - V) * H + cols[None, :], g.to(DPOS.dtype.element_ty), mask=m & (k >= V) & (k < V + P))
    if TT_SORTED:
        tl.store(DTT + (k - V - P) * H + cols[None, :], g.to(DTT.dtype.element_ty), mask=m & (k >= V + P))


@triton.jit
def _table_rows_kernel(
    PART,     # [chunks, 2, H] fp32 from the walks
    BOUNDS,   # [R + 1] int64: stacked table row r's entries sit at sorted positions BOUNDS[r] .. BOUNDS[r + 1]
    DWORD, DPOS, DTT,
    H, V, P, R,
    TT_SORTED: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Each program: ROWS consecutive stacked table rows at BLOCK_H columns. A row no entry has is
    stored as zeros (so no zero-fill pass); a row whose entries cross chunks is the sum of its first
    chunk's PART[c0, 1] and its later chunks' PART[c, 0], in chunk order, all the program's such rows
    at once, four chunks' loads in flight ([MASK] holds ~12% of the tokens: 2,000 entries in 31
    chunks at BERT's phase 1); the rows inside one chunk were stored by the walks."""
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < R
    lo = tl.load(BOUNDS + rows, mask=ok, other=0)
    hi = tl.load(BOUNDS + rows + 1, mask=ok, other=0)
    _store_table_rows(DWORD, DPOS, DTT, rows, tl.zeros([ROWS, BLOCK_H], tl.float32), ok & (lo == hi), cols, col_ok,
                      H, V, P, TT_SORTED)
    c0 = lo // CHUNK
    c1 = (hi - 1) // CHUNK
    spans = ok & (lo < hi) & (c0 < c1)
    n = tl.max(tl.where(spans, c1 - c0, 0), 0)
    if n > 0:
        m = spans[:, None] & col_ok[None, :]
        part = PART + cols[None, :]
        acc = tl.load(part + (2 * c0 + 1)[:, None] * H, mask=m, other=0.0)
        for j in range(1, n + 1, 4):
            c = c0 + j
            p0 = tl.load(part + (2 * c)[:, None] * H, mask=m & (c <= c1)[:, None], other=0.0)
            p1 = tl.load(part + (2 * c + 2)[:, None] * H, mask=m & (c + 1 <= c1)[:, None], other=0.0)
            p2 = tl.load(part + (2 * c + 4)[:, None] * H, mask=m & (c + 2 <= c1)[:, None], other=0.0)
            p3 = tl.load(part + (2 * c + 6)[:, None] * H, mask=m & (c + 3 <= c1)[:, None], other=0.0)
            acc = (((acc + p0) + p1) + p2) + p3
        _store_table_rows(DWORD, DPOS, DTT, rows, acc, spans, cols, col_ok, H, V, P, TT_SORTED)


_fwd_tuned = autotune(row_tile_configs(), ["H", "n_bucket", "HAS_DROPOUT", "STORE_KEEP"],
                      row_config_pruner(FWD_PER_THREAD, FWD_MAX_WARPS))(_embeddings_fwd_kernel)
# The backward's walks and rows pass: one fixed configuration each (never autotuned: the chunk sets the
# order of the table rows' sums, and the position walk's tile that of the LayerNorm partials').
_TABLE_CHUNK = 64          # sorted entries per program of a walk (a power of two)
# Entries a tile of a walk (their loads in flight together); each walk's elements a thread and
# pipeline stages (its loop's loads issued that many tiles minus one ahead, through shared memory).
# The walk by word's row sums cost fewer instructions an element over more of them (sm_90, one stage:
# 55 an element at 32 a thread, 71 at 8); the walk by position keeps three fp32 accumulators, so 16,
# and two stages (229 registers; 248 at three). The stages keep loads in flight while a tile computes,
# which the one-row-a-program kernels did not (docs/perf-model.md, "Calibration against a GPU run").
_WALK_ROWS = 2
_WORD_WALK = dict(per_thread=32, stages=3)
_POS_WALK = dict(per_thread=16, stages=2)
_TABLE_ROWS = 16           # table rows per rows program (64 under the interpreter: fewer programs to run)
_TABLE_ROWS_BLOCK_H = 256
_TABLE_ROWS_WARPS = 8


def _walk_tile(block_h: int, per_thread: int, stages: int) -> dict:
    """A walk's BLOCK_M, num_warps and STAGES: _WALK_ROWS entries a tile (one where that would take more
    than 16 warps), ``per_thread`` elements a thread. Under the interpreter, where a tile costs its
    Python, ~4K elements a tile (the table rows' sums do not depend on the tile)."""
    rows = _WALK_ROWS if _WALK_ROWS * block_h <= 16 * 32 * per_thread else 1
    if interpreting():
        rows = interpreter_rows(block_h, 16)
    return dict(BLOCK_M=rows, num_warps=next_power_of_2(max(1, min(16, rows * block_h // (32 * per_thread)))),
                STAGES=stages)


# --------------------------------------------------------------------------- validation
def _check_inputs(input_ids, position_ids, token_type_ids, word, pos, token_type, ln_weight, ln_bias):
    check_tensor("input_ids", input_ids, dtypes=ID_DTYPES, ndim=1)
    t = input_ids.shape[0]
    dev = input_ids.device
    check_tensor("position_ids", position_ids, dtypes=ID_DTYPES, shape=(t,), device=dev)
    check_tensor("token_type_ids", token_type_ids, dtypes=ID_DTYPES, shape=(t,), device=dev)
    for name, ids in (("input_ids", input_ids), ("position_ids", position_ids),
                      ("token_type_ids", token_type_ids)):
        if t > 1 and ids.stride(0) != 1:
            raise ValueError(f"{name}: expected a contiguous vector, got stride {ids.stride()}")
    check_tensor("word", word, dtypes=FLOAT_DTYPES, ndim=2, device=dev)
    h = word.shape[1]
    check_hidden(h)
    for name, table in (("word", word), ("pos", pos), ("token_type", token_type)):
        check_tensor(name, table, dtypes=FLOAT_DTYPES, ndim=2, device=dev)
        check_rows(name, table, table.shape[0], h, device=dev)
    check_vector("ln_weight", ln_weight, h, dev)
    check_vector("ln_bias", ln_bias, h, dev)
    return t, h, dev


# --------------------------------------------------------------------------- launchers
def embeddings_fwd(input_ids: torch.Tensor, position_ids: torch.Tensor, token_type_ids: torch.Tensor,
                   word: torch.Tensor, pos: torch.Tensor, token_type: torch.Tensor,
                   ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float, dropout_p: float,
                   seed: Optional[torch.Tensor], out_dtype: torch.dtype, return_dropout_mask: bool = False):
    """y = Dropout(LN(word[ids] + pos[position_ids] + token_type[token_type_ids])).

    Returns (y [T, H] out_dtype, mean [T] fp32, rstd [T] fp32), plus keep [T, H] bool when
    return_dropout_mask.
    """
    t, h, dev = _check_inputs(input_ids, position_ids, token_type_ids, word, pos, token_type,
                              ln_weight, ln_bias)
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {[str(d) for d in FLOAT_DTYPES]}, got {out_dtype}")
    eps = check_eps(eps)
    dropout_p = check_dropout(dropout_p, seed, dev)
    has_dropout = dropout_p > 0.0
    store_keep = return_dropout_mask and has_dropout
    y = torch.empty((t, h), dtype=out_dtype, device=dev)
    mean = torch.empty((t,), dtype=torch.float32, device=dev)
    rstd = torch.empty((t,), dtype=torch.float32, device=dev)
    keep = None
    if return_dropout_mask:
        keep = (torch.empty((t, h), dtype=torch.bool, device=dev) if store_keep
                else torch.ones((t, h), dtype=torch.bool, device=dev))
    if t > 0:
        block_h = block_h_for(h)
        args = (input_ids, position_ids, token_type_ids, word, pos, token_type, ln_weight, ln_bias,
                y, mean, rstd, keep if store_keep else y, seed if has_dropout else mean,
                t, h, row_stride(word), row_stride(pos), row_stride(token_type),
                eps, dropout_p, n_bucket(t))
        flags = dict(HAS_DROPOUT=has_dropout, STORE_KEEP=store_keep, BLOCK_H=block_h)
        launch(_fwd_tuned, lambda meta: (cdiv(t, meta["BLOCK_M"]),), args, flags,
               interp={"BLOCK_M": interpreter_rows(block_h, 16)})
    out = (y, mean, rstd)
    return out + (keep,) if return_dropout_mask else out


def embeddings_bwd(dy: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   token_type_ids: torch.Tensor, word: torch.Tensor, pos: torch.Tensor,
                   token_type: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
                   mean: torch.Tensor, rstd: torch.Tensor, dropout_p: float, seed: Optional[torch.Tensor]):
    """Gradients of embeddings_fwd.

    Returns (dword [V, H], dpos [P, H], dtoken_type [TT, H], dln_weight [H], dln_bias [H]), each
    in its parameter's dtype, accumulated in fp32 (repeated ids add up).
    """
    t, h, dev = _check_inputs(input_ids, position_ids, token_type_ids, word, pos, token_type,
                              ln_weight, ln_bias)
    check_rows("dy", dy, t, h, device=dev)
    check_tensor("mean", mean, dtypes=(torch.float32,), shape=(t,), device=dev)
    check_tensor("rstd", rstd, dtypes=(torch.float32,), shape=(t,), device=dev)
    if t > 1 and (mean.stride(0) != 1 or rstd.stride(0) != 1):
        raise ValueError(f"mean, rstd: expected contiguous vectors, got strides {mean.stride()}, {rstd.stride()}")
    dropout_p = check_dropout(dropout_p, seed, dev)

    num_types = token_type.shape[0]
    tt_in_regs = num_types <= _MAX_TYPES_IN_REGISTERS
    if t == 0:
        zero = torch.zeros((h,), dtype=torch.float32, device=dev)
        return (torch.zeros(word.shape, dtype=word.dtype, device=dev), torch.zeros(pos.shape, dtype=pos.dtype, device=dev),
                torch.zeros(token_type.shape, dtype=token_type.dtype, device=dev), zero.to(ln_weight.dtype),
                zero.to(ln_bias.dtype))
    v, p_rows = word.shape[0], pos.shape[0]
    # Each table row's tokens, in token order: the stacked row keys sorted stably, and where each row's
    # entries start. The T word entries sort first (their keys are below V).
    keys = torch.empty((2 if tt_in_regs else 3, t), dtype=torch.int32, device=dev)
    keys[0].copy_(input_ids)
    torch.add(position_ids, v, out=keys[1])
    if not tt_in_regs:
        torch.add(token_type_ids, v + p_rows, out=keys[2])
    sorted_keys, order = torch.sort(keys.view(-1), stable=True)
    n_rows = v + p_rows + (0 if tt_in_regs else num_types)
    bounds = torch.searchsorted(sorted_keys, torch.arange(n_rows + 1, dtype=torch.int32, device=dev))

    n = keys.numel()
    chunk = _TABLE_CHUNK
    chunks = cdiv(n, chunk)
    groups = chunks - t // chunk  # the walk by position's programs
    part = torch.empty((2, groups, h), dtype=torch.float32, device=dev)
    dtt = torch.empty((groups, num_types, h), dtype=torch.float32, device=dev) if tt_in_regs else part
    cut_runs = torch.empty((chunks, 2, h), dtype=torch.float32, device=dev)
    coef = torch.empty((2, t), dtype=torch.float32, device=dev)
    dword = torch.empty(word.shape, dtype=word.dtype, device=dev)
    dpos = torch.empty(pos.shape, dtype=pos.dtype, device=dev)
    dtt_rows = dpos if tt_in_regs else torch.empty(token_type.shape, dtype=token_type.dtype, device=dev)
    has_dropout = dropout_p > 0.0
    block_h = block_h_for(h)
    gathered = (dy, input_ids, position_ids, token_type_ids, word, pos, token_type, ln_weight, mean, rstd,
                sorted_keys, order, cut_runs, coef)
    strides = (row_stride(dy), row_stride(word), row_stride(pos), row_stride(token_type), dropout_p)
    seed_arg = seed if has_dropout else mean
    flags = dict(HAS_DROPOUT=has_dropout, CHUNK=chunk, BLOCK_H=block_h)
    launch(_embeddings_bwd_kernel, (cdiv(t, chunk),), (*gathered, dword, seed_arg, n, t, h, *strides),
           dict(flags, **_walk_tile(block_h, **_WORD_WALK)))
    launch(_embeddings_bwd_pos_kernel, (groups,),
           (*gathered, dpos, dtt_rows, dtt, part[0], part[1], seed_arg, n, t, h, v, p_rows, num_types, *strides),
           dict(flags, TT_SORTED=not tt_in_regs, TT_BLOCK=next_power_of_2(num_types) if tt_in_regs else 1,
                **_walk_tile(block_h, **_POS_WALK)))
    table_rows = 64 if interpreting() else _TABLE_ROWS
    rows_block_h = block_h if interpreting() else min(block_h, _TABLE_ROWS_BLOCK_H)
    launch(_table_rows_kernel, (cdiv(n_rows, table_rows), cdiv(h, rows_block_h)),
           (cut_runs, bounds, dword, dpos, dtt_rows, h, v, p_rows, n_rows),
           dict(TT_SORTED=not tt_in_regs, CHUNK=chunk, ROWS=table_rows, BLOCK_H=rows_block_h,
                num_warps=_TABLE_ROWS_WARPS))
    if tt_in_regs:
        dtt_rows = column_sums(dtt.view(1, groups, num_types * h), [token_type.dtype])[0].view(num_types, h)
    dln_weight, dln_bias = column_sums(part, [ln_weight.dtype, ln_bias.dtype])
    return dword, dpos, dtt_rows, dln_weight, dln_bias
