"""Removing padding once and putting it back (the unpadded encoder's bookkeeping).

The encoder gathers the real tokens of a padded batch into rows [N, ...] (N = number of
real tokens), runs every layer on them, and scatters the result back to [B, S, ...] with
zeros at padded positions. Any mask pattern works (not only right padding): a sequence's
tokens stay contiguous and in order among the rows.
"""
from __future__ import annotations

from typing import Tuple

import torch

Tensor = torch.Tensor


def unpad_mask(attention_mask: Tensor) -> Tuple[Tensor, Tensor, int]:
    """attention_mask [B, S] (1 = token) -> (rows [N] int64 indices into the flattened batch,
    cu_seqlens [B + 1] int32, max_seqlen). One host sync (the sizes are data-dependent)."""
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1, dtype=torch.int32)
    rows = mask.flatten().nonzero().flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    max_seqlen = int(lengths.max().item()) if lengths.numel() else 0
    return rows, cu_seqlens, max_seqlen


def unpad(x: Tensor, rows: Tensor) -> Tensor:
    """[B, S, ...] -> [N, ...]; without padding a view where the layout allows."""
    flat = x.reshape((-1,) + tuple(x.shape[2:]))
    return flat if rows.numel() == flat.shape[0] else flat.index_select(0, rows)


def pad_rows(x: Tensor, rows: Tensor, batch: int, seqlen: int) -> Tensor:
    """[N, ...] -> [B, S, ...], zeros at padded positions (differentiable). Without padding
    (N = B * S, so rows are 0..N-1 in order) a view."""
    if rows.numel() == batch * seqlen:
        return x.view((batch, seqlen) + tuple(x.shape[1:]))
    out = x.new_zeros((batch * seqlen,) + tuple(x.shape[1:]))
    return out.index_copy(0, rows, x).view((batch, seqlen) + tuple(x.shape[1:]))
