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
  backward kernel writes dh [T, H] fp32 and the sort keys (ids, V + position ids); the keys are
  sorted (torch.sort, stable: a row's tokens stay in token order; on the device, no host read,
  graph-safe). Two passes then add each table row's dh rows, as csrc/embeddings.cu does, with
  every program's work bounded whatever the ids (at BERT's phase 1 [MASK] alone holds ~2,000 of
  the 32,768 sorted entries; the former single pass, four table rows a program, each row's entries
  16 at a time, took 338 us of the H200's BERT-large step where the backward kernel took 88):
    _table_chunks_kernel  cuts the sorted entries into chunks of _TABLE_CHUNK, gathers a chunk's
                          dh rows at once and sums its runs of equal keys (a segmented scan: a
                          fixed tree); a run inside the chunk is a whole table row, stored; the
                          runs cut by the chunk's edges leave partial sums.
    _table_rows_kernel    stores every other row once: zeros for rows no token uses (no
                          zero-fill pass), the sum of its chunks' partials in chunk order for
                          the rows that cross chunks.
  Rows are stored in the table's dtype (no cast pass).
  Token-type rows are few (2 in BERT), so every token would hit the same rows: per-program fp32
  partials in registers, then a sum over programs, when the table has <= 4 rows; else its rows
  join the sorted reduction (keys V + P + token-type ids).
  The LayerNorm sums (statistics, the backward's row sums, the ln partials) are order-free
  (kernels/_rows.py, exact_sum): the forward gives the same bits whether or not it stores
  the keep-mask, whatever the tables' row strides or the tuned config.

Launch: as kernels/bias_dropout_residual_layernorm.py (row tiles autotuned on GPU, fixed under
the interpreter); the backward runs about four programs per SM, each walking a contiguous block
of tokens. The table passes have one fixed configuration each (never autotuned: the chunk sets the
order of the sums).

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
from ._rows import (BWD_PER_THREAD, FWD_MAX_WARPS, FWD_PER_THREAD, MAX_ROWS_PER_TILE, block_h_for, check_hidden,
                    column_sums, hidden_reasons, interpreter_rows, layernorm_bwd_rows, layernorm_rows, load_cols,
                    n_bucket, program_rows, row_config_pruner, row_dropout, row_groups, row_tile_configs,
                    store_col_sums)

_MAX_TYPES_IN_REGISTERS = 4
# The backward's row groups (_rows.row_groups): programs per SM. Its loop does not prefetch (the
# gathered rows would not fit in registers twice), so only resident programs keep loads in flight.
BWD_PROGRAMS_PER_SM = 4


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
    DH,       # [T, H] fp32, contiguous: dh per token (the tables' gradients sum its rows)
    KEYS,     # [K * T] int32: ids, then V + position ids, then (K = 3, not TT_IN_REGS) V + P + token-type ids
    DTT,      # TT_IN_REGS: [G, NUM_TYPES, H] fp32 per-program partials (unused otherwise)
    DW_PART,  # [G, H] fp32 partial sums of dz * zhat
    DB_PART,  # [G, H] fp32 partial sums of dz
    SEED,     # [1] int64 dropout seed (read only when HAS_DROPOUT)
    N, H, V, P, NUM_TYPES, stride_dy, stride_word, stride_pos, stride_tt, rows_per_program, p,
    n_bucket,  # autotune key only
    HAS_DROPOUT: tl.constexpr, TT_IN_REGS: tl.constexpr, TT_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid, row_start, row_end = program_rows(N, rows_per_program)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    w = load_cols(W, cols, col_ok)
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    acc_dw = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    acc_db = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    types = tl.arange(0, TT_BLOCK)
    acc_tt = tl.zeros([TT_BLOCK, BLOCK_H], dtype=tl.float32)
    for m0 in range(row_start, row_end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        mask = row_ok[:, None] & col_ok[None, :]
        h, ids, pids, tids = _gather_rows(IDS, PIDS, TIDS, WORD, POS, TT, rows, row_ok, cols, mask,
                                          stride_word, stride_pos, stride_tt)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        dz = tl.load(DY + rows.to(tl.int64)[:, None] * stride_dy + cols[None, :],
                     mask=mask, other=0.0).to(tl.float32)
        if HAS_DROPOUT:
            dz, _ = row_dropout(dz, seed, rows, H, p, BLOCK_M, BLOCK_H)
        dh, acc_dw, acc_db = layernorm_bwd_rows(dz, h, mean, rstd, w, acc_dw, acc_db, H)  # masked below
        tl.store(DH + rows.to(tl.int64)[:, None] * H + cols[None, :], dh, mask=mask)
        tl.store(KEYS + rows, ids.to(tl.int32), mask=row_ok)
        tl.store(KEYS + N + rows, (pids + V).to(tl.int32), mask=row_ok)
        if TT_IN_REGS:
            for t in tl.static_range(TT_BLOCK):
                s = tl.sum(tl.where((tids == t)[:, None], dh, 0.0), axis=0)   # [BLOCK_H]
                acc_tt += tl.where((types == t)[:, None], s[None, :], 0.0)
        else:
            tl.store(KEYS + 2 * N + rows, (tids + V + P).to(tl.int32), mask=row_ok)
    store_col_sums(DW_PART, acc_dw, pid, H, cols, col_ok)
    store_col_sums(DB_PART, acc_db, pid, H, cols, col_ok)
    if TT_IN_REGS:
        tt_offs = (pid * NUM_TYPES + types)[:, None] * H + cols[None, :]
        tl.store(DTT + tt_offs, acc_tt, mask=(types < NUM_TYPES)[:, None] & col_ok[None, :])


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
def _run_sum(key_a, sum_a, key_b, sum_b):
    """Segmented sum over sorted keys: b continues a's run of one table row when their keys match."""
    return key_b, tl.where(key_a == key_b, sum_a + sum_b, sum_b)


@triton.jit
def _table_chunks_kernel(
    DH,       # [T, H] fp32 from _embeddings_bwd_kernel
    KEYS,     # [N] int32 sorted keys (the stacked table row of each entry)
    ORDER,    # [N] int64: each sorted entry's index into the unsorted keys (its token, + T per table)
    PART,     # [chunks, 2, H] fp32: the sums of the runs that cross a chunk's edges
    DWORD, DPOS, DTT,  # the table gradients, contiguous, in their tables' dtypes (DTT: TT_SORTED only)
    N, T, H, V, P,
    TT_SORTED: tl.constexpr, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Each program: CHUNK consecutive sorted entries at BLOCK_H columns, their dh rows gathered at
    once, then summed by run of equal keys (a segmented scan). A run that lies inside the chunk is a
    whole table row: stored. A run cut by the chunk's first edge (the row began before) goes to
    PART[chunk, 0]; one cut only by its last edge (the row goes on after) to PART[chunk, 1];
    _table_rows_kernel adds those. The order of every addition follows from the sorted keys and
    CHUNK alone."""
    c = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    first = c * CHUNK
    e = first + tl.arange(0, CHUNK)
    ok = e < N
    keys = tl.load(KEYS + e, mask=ok, other=-1)
    tok = tl.load(ORDER + e, mask=ok, other=0) % T
    dh = tl.load(DH + tok[:, None] * H + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0)
    _, runs = tl.associative_scan((tl.broadcast_to(keys[:, None], [CHUNK, BLOCK_H]), dh), 0, _run_sum)
    next_keys = tl.load(KEYS + e + 1, mask=e + 1 < N, other=-1)
    ends = ok & ((next_keys != keys) | (e == first + CHUNK - 1))  # each run's last entry in the chunk
    began_before = keys == tl.load(KEYS + first - 1, mask=c > 0, other=-1)
    goes_on = keys == tl.load(KEYS + first + CHUNK, mask=first + CHUNK < N, other=-1)
    _store_table_rows(DWORD, DPOS, DTT, keys, runs, ends & ~began_before & ~goes_on, cols, col_ok, H, V, P,
                      TT_SORTED)
    slot = (2 * c + tl.where(began_before, 0, 1)).to(tl.int64)
    tl.store(PART + slot[:, None] * H + cols[None, :], runs,
             mask=(ends & (began_before | goes_on))[:, None] & col_ok[None, :])


@triton.jit
def _table_rows_kernel(
    PART,     # [chunks, 2, H] fp32 from _table_chunks_kernel
    BOUNDS,   # [R + 1] int64: stacked table row r's entries sit at sorted positions BOUNDS[r] .. BOUNDS[r + 1]
    DWORD, DPOS, DTT,
    H, V, P, R,
    TT_SORTED: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Each program: ROWS consecutive stacked table rows at BLOCK_H columns. A row no entry has is
    stored as zeros (so no zero-fill pass); a row whose entries cross chunks is the sum of its first
    chunk's PART[c0, 1] and its later chunks' PART[c, 0], in chunk order, all the program's such rows
    at once, four chunks' loads in flight ([MASK] holds ~12% of the tokens: 2,000 entries in 31
    chunks at BERT's phase 1); the rows inside one chunk were stored by _table_chunks_kernel."""
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
# The backward writes every buffer it is given (no accumulation): the autotuner runs it as it is.
_bwd_tuned = autotune(row_tile_configs(MAX_ROWS_PER_TILE), ["H", "n_bucket", "HAS_DROPOUT", "TT_IN_REGS", "TT_BLOCK"],
                      row_config_pruner(BWD_PER_THREAD))(_embeddings_bwd_kernel)
# The table passes: one fixed configuration each, as the chunk sets the order of the sums. The chunk
# pass's scan costs fewer instructions an element as its tile narrows (41 at [64, 32] in 2 warps, 83 at
# [64, 128] in 8), so it takes 32 columns, a 128-byte line of each fp32 dh row.
_TABLE_CHUNK = 64          # sorted entries per chunk (a power of two)
_TABLE_CHUNK_BLOCK_H = 32
_TABLE_CHUNK_WARPS = 2
_TABLE_ROWS = 16           # table rows per rows program (64 under the interpreter: fewer programs to run)
_TABLE_ROWS_BLOCK_H = 256
_TABLE_ROWS_WARPS = 8


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
    groups, rpp = row_groups(t, dev, BWD_PROGRAMS_PER_SM)
    part = torch.empty((2, groups, h), dtype=torch.float32, device=dev)
    dh = torch.empty((t, h), dtype=torch.float32, device=dev)
    keys = torch.empty(((2 if tt_in_regs else 3) * t,), dtype=torch.int32, device=dev)
    dtt = torch.empty((groups, num_types, h), dtype=torch.float32, device=dev) if tt_in_regs else part
    has_dropout = dropout_p > 0.0
    block_h = block_h_for(h)
    v, p_rows = word.shape[0], pos.shape[0]
    args = (dy, input_ids, position_ids, token_type_ids, word, pos, token_type, ln_weight, mean, rstd,
            dh, keys, dtt, part[0], part[1], seed if has_dropout else mean,
            t, h, v, p_rows, num_types, row_stride(dy), row_stride(word), row_stride(pos),
            row_stride(token_type), rpp, dropout_p, n_bucket(t))
    flags = dict(HAS_DROPOUT=has_dropout, TT_IN_REGS=tt_in_regs,
                 TT_BLOCK=next_power_of_2(num_types) if tt_in_regs else 1, BLOCK_H=block_h)
    launch(_bwd_tuned, (groups,), args, flags, interp={"BLOCK_M": interpreter_rows(block_h, 4)})

    # Each table row's tokens, in token order: a stable sort of the keys, and where each row's run starts.
    sorted_keys, order = torch.sort(keys, stable=True)
    n_rows = v + p_rows + (0 if tt_in_regs else num_types)
    bounds = torch.searchsorted(sorted_keys, torch.arange(n_rows + 1, dtype=torch.int32, device=dev))
    dword = torch.empty(word.shape, dtype=word.dtype, device=dev)
    dpos = torch.empty(pos.shape, dtype=pos.dtype, device=dev)
    dtt_rows = dword if tt_in_regs else torch.empty(token_type.shape, dtype=token_type.dtype, device=dev)
    n = keys.numel()
    chunks = cdiv(n, _TABLE_CHUNK)
    cut_runs = torch.empty((chunks, 2, h), dtype=torch.float32, device=dev)
    # Under the interpreter a program costs its Python, not registers: every column at once.
    chunk_block_h = block_h if interpreting() else min(block_h, _TABLE_CHUNK_BLOCK_H)
    launch(_table_chunks_kernel, (chunks, cdiv(h, chunk_block_h)),
           (dh, sorted_keys, order, cut_runs, dword, dpos, dtt_rows, n, t, h, v, p_rows),
           dict(TT_SORTED=not tt_in_regs, CHUNK=_TABLE_CHUNK, BLOCK_H=chunk_block_h, num_warps=_TABLE_CHUNK_WARPS))
    rows = 64 if interpreting() else _TABLE_ROWS
    rows_block_h = block_h if interpreting() else min(block_h, _TABLE_ROWS_BLOCK_H)
    launch(_table_rows_kernel, (cdiv(n_rows, rows), cdiv(h, rows_block_h)),
           (cut_runs, bounds, dword, dpos, dtt_rows, h, v, p_rows, n_rows),
           dict(TT_SORTED=not tt_in_regs, CHUNK=_TABLE_CHUNK, ROWS=rows, BLOCK_H=rows_block_h,
                num_warps=_TABLE_ROWS_WARPS))
    if tt_in_regs:
        dtt_rows = column_sums(dtt.view(1, groups, num_types * h), [token_type.dtype])[0].view(num_types, h)
    dln_weight, dln_bias = column_sums(part, [ln_weight.dtype, ln_bias.dtype])
    return dword, dpos, dtt_rows, dln_weight, dln_bias
