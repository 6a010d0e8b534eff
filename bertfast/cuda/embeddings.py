"""embeddings on the CUDA backend (csrc/embeddings.cu): y = Dropout(LN(word[ids] + pos[position_ids] +
token_type[token_type_ids])), forward and backward."""
from __future__ import annotations

import math
from typing import Optional

import torch

from bertfast.contract import (FLOAT_DTYPES, ID_DTYPES, check_dropout, check_eps, check_tensor, check_vector)
from bertfast.cuda import _common as C

TYPE_SMEM_BYTES = 32 * 1024  # csrc/embeddings.cu kMaxTypeSmem: token-type partials in shared memory up to this


def sort_chunk(n: int) -> int:
    """Sorted entries per block of the backward's first table pass (csrc/embeddings.cu): a power of two
    about sqrt(n), so that neither pass has a long serial chain when a hot row ([MASK], position 0)
    holds many of the n entries; at least 32."""
    return max(32, 1 << (math.isqrt(n).bit_length() - 1)) if n > 0 else 32


def unsupported(inputs) -> list:
    """Dispatch: reasons these inputs exceed this backend's limits ([] when it runs them)."""
    word = inputs["word"]
    mixed = [name for name in ("pos", "token_type") if inputs[name].dtype != word.dtype]
    reasons = [f"{', '.join(mixed)} not in word's dtype {word.dtype} (the kernels read the tables in one dtype)"] \
        if mixed else []
    return reasons + C.hidden_reasons(word.shape[-1])


def _check_ids(input_ids, position_ids, token_type_ids) -> int:
    C.on_device(input_ids=input_ids, position_ids=position_ids, token_type_ids=token_type_ids)
    check_tensor("input_ids", input_ids, dtypes=ID_DTYPES, ndim=1)
    t = input_ids.shape[0]
    check_tensor("position_ids", position_ids, dtypes=ID_DTYPES, shape=(t,), device=input_ids.device)
    check_tensor("token_type_ids", token_type_ids, dtypes=ID_DTYPES, shape=(t,), device=input_ids.device)
    return t


def _check_tables(word, pos, token_type, ln_weight, ln_bias, device) -> int:
    C.on_device(word=word, pos=pos, token_type=token_type, ln_weight=ln_weight, ln_bias=ln_bias)
    check_tensor("word", word, dtypes=FLOAT_DTYPES, ndim=2, device=device)
    h = word.shape[1]
    C.check_hidden("word", word, h)
    for name, table in (("pos", pos), ("token_type", token_type)):
        check_tensor(name, table, dtypes=(word.dtype,), ndim=2, device=device)
        if table.shape[1] != h or table.shape[0] == 0:
            raise ValueError(f"{name}: expected shape (rows > 0, {h}) like word {tuple(word.shape)}, "
                             f"got {tuple(table.shape)}")
    check_vector("ln_weight", ln_weight, h, device)
    check_vector("ln_bias", ln_bias, h, device)
    return h


def _table_dtype(tables: torch.dtype, out: torch.dtype) -> torch.dtype:
    return tables if tables in (out, torch.float32) else torch.float32


def _id_args(ids):
    """(pointer, is_int64) per id vector; the caller keeps the (contiguous) vectors alive."""
    return [a for i in ids for a in (i.data_ptr(), int(i.dtype == torch.int64))]


def embeddings_fwd(input_ids: torch.Tensor, position_ids: torch.Tensor, token_type_ids: torch.Tensor,
                   word: torch.Tensor, pos: torch.Tensor, token_type: torch.Tensor, ln_weight: torch.Tensor,
                   ln_bias: torch.Tensor, eps: float, dropout_p: float, seed: Optional[torch.Tensor],
                   out_dtype: torch.dtype, return_dropout_mask: bool = False):
    """y = Dropout(LN(word[ids] + pos[position_ids] + token_type[token_type_ids]) * ln_weight + ln_bias).

    ids: [T] int32/int64 (ranges already validated by the caller); tables [rows, H] of one dtype.
    Returns (y [T, H] out_dtype, mean [T] fp32, rstd [T] fp32) (+ keep bool [T, H]).
    """
    t = _check_ids(input_ids, position_ids, token_type_ids)
    dev = input_ids.device
    h = _check_tables(word, pos, token_type, ln_weight, ln_bias, dev)
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {[str(d) for d in FLOAT_DTYPES]}, got {out_dtype}")
    eps = check_eps(eps)
    C.on_device(seed=seed)
    dropout_p = check_dropout(dropout_p, seed, dev)
    y = torch.empty((t, h), dtype=out_dtype, device=dev)
    mean = torch.empty(t, dtype=torch.float32, device=dev)
    rstd = torch.empty(t, dtype=torch.float32, device=dev)
    keep = torch.empty((t, h), dtype=torch.bool, device=dev) if return_dropout_mask else None
    if t > 0:
        pdt = _table_dtype(word.dtype, out_dtype)
        tabs = [C.cast(x, pdt) for x in (word, pos, token_type, ln_weight, ln_bias)]
        ids = [i.contiguous() for i in (input_ids, position_ids, token_type_ids)]
        C.launch(dev, "embeddings_fwd", *_id_args(ids),
                 *(x.data_ptr() for x in tabs), y.data_ptr(), mean.data_ptr(), rstd.data_ptr(), C.ptr(keep), t, h,
                 eps, dropout_p, C.seed_ptr(seed, dropout_p), C.DTYPE_CODE[pdt], C.DTYPE_CODE[out_dtype])
    if return_dropout_mask:
        return y, mean, rstd, keep
    return y, mean, rstd


def embeddings_bwd(dy: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   token_type_ids: torch.Tensor, word: torch.Tensor, pos: torch.Tensor, token_type: torch.Tensor,
                   ln_weight: torch.Tensor, ln_bias: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                   dropout_p: float, seed: Optional[torch.Tensor]):
    """Gradients of embeddings_fwd -> (dword [V, H], dpos [P, H], dtoken_type [TT, H], dln_weight [H],
    dln_bias [H]), each in its parameter's dtype; each table row's gradient is the fp32 sum of its tokens' dh
    in a fixed order (no atomics: the same bits whatever the block schedule), cast once."""
    t = _check_ids(input_ids, position_ids, token_type_ids)
    dev = input_ids.device
    h = _check_tables(word, pos, token_type, ln_weight, ln_bias, dev)
    C.on_device(dy=dy, mean=mean, rstd=rstd, seed=seed)
    check_tensor("dy", dy, dtypes=FLOAT_DTYPES, shape=(t, h), device=dev)
    check_tensor("mean", mean, dtypes=(torch.float32,), shape=(t,), device=dev)
    check_tensor("rstd", rstd, dtypes=(torch.float32,), shape=(t,), device=dev)
    dropout_p = check_dropout(dropout_p, seed, dev)
    vocab, n_pos, n_types = word.shape[0], pos.shape[0], token_type.shape[0]
    types_sorted = n_types * h * 4 > TYPE_SMEM_BYTES
    rows = vocab + n_pos + (n_types if types_sorted else 0)
    if rows >= 2 ** 31:
        raise ValueError(f"embeddings: {rows} table rows do not fit the backward's int32 row keys")

    pdt = _table_dtype(word.dtype, dy.dtype)
    tabs = [C.cast(x, pdt) for x in (word, pos, token_type, ln_weight)]
    ids = [i.contiguous() for i in (input_ids, position_ids, token_type_ids)]
    dy, mean, rstd = dy.contiguous(), mean.contiguous(), rstd.contiguous()
    # Each token's table rows as keys (word, then position, then type rows), stably sorted: a row's
    # entries sit together in token order, between its bounds. On the device, no host read.
    keys = torch.cat([ids[0].int(), ids[1].int() + vocab] + ([ids[2].int() + (vocab + n_pos)] if types_sorted else []))
    keys, order = torch.sort(keys, stable=True)
    bounds = torch.searchsorted(keys, torch.arange(rows + 1, dtype=torch.int32, device=dev))
    n = keys.shape[0]
    chunk = sort_chunk(n)
    # Every row of each gradient is written by the kernels: no zero fill.
    grads = [torch.empty(x.shape, dtype=pdt, device=dev) for x in (word, pos, token_type)]
    dlnw = torch.empty(h, dtype=pdt, device=dev)
    dlnb = torch.empty(h, dtype=pdt, device=dev)
    blocks = C.reduction_blocks(t)
    ws = torch.empty(blocks * (2 + (0 if types_sorted else n_types)) * h, dtype=torch.float32, device=dev)
    dh = torch.empty((t, h), dtype=torch.float32, device=dev)
    chunk_ws = torch.empty(((n + chunk - 1) // chunk, 2, h), dtype=torch.float32, device=dev)
    C.launch(dev, "embeddings_bwd", dy.data_ptr(), *_id_args(ids),
             *(x.data_ptr() for x in tabs), mean.data_ptr(), rstd.data_ptr(), keys.data_ptr(), order.data_ptr(),
             bounds.data_ptr(), *(g.data_ptr() for g in grads), dlnw.data_ptr(), dlnb.data_ptr(), ws.data_ptr(),
             dh.data_ptr(), chunk_ws.data_ptr(), t, h, vocab, n_pos, n_types, int(types_sorted), chunk, dropout_p,
             C.seed_ptr(seed, dropout_p), C.DTYPE_CODE[pdt], C.DTYPE_CODE[dy.dtype])
    dword, dpos, dtype_ = (g.to(x.dtype) for g, x in zip(grads, (word, pos, token_type)))
    return dword, dpos, dtype_, dlnw.to(ln_weight.dtype), dlnb.to(ln_bias.dtype)
