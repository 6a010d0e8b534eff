"""Removing padding once and putting it back (the unpadded encoder's bookkeeping).

The encoder gathers the real tokens of a padded batch into rows [N, ...] (N = number of
real tokens), runs every layer on them, and scatters the result back to [B, S, ...] with
zeros at padded positions. Any mask pattern works (not only right padding): a sequence's
tokens stay contiguous and in order among the rows.

``pack_batch`` turns a padded batch into packed sequences of fixed shapes (the static-shape form
the models take through transformers' cu_seq_lens_q / max_length_q).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from bertfast.contract import IGNORE_INDEX

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


def packed_layout(cu_seqlens: Tensor, max_seqlen: int, tokens: int) -> Tuple[Tensor, Tensor]:
    """Packed sequences (rows cu_seqlens[k]:cu_seqlens[k+1] of [T, ...]) seen as a padded batch
    [K, max_seqlen]: (index [K, max_seqlen] int64 into the T rows, clamped where padded; mask
    [K, max_seqlen] bool, True at tokens). No host read."""
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    offsets = torch.arange(max_seqlen, device=cu_seqlens.device)
    index = (starts[:, None] + offsets[None, :]).clamp_(max=max(tokens - 1, 0))  # [K, S]
    return index, offsets[None, :] < lengths[:, None]


def pack_batch(batch: Dict[str, Any], tokens: int, max_seqlen: int, slots: Optional[int] = None,
               position_ids: bool = True) -> Dict[str, Any]:
    """A padded batch (model keyword arguments with attention_mask [B, S]) as packed sequences of
    fixed shapes: the B sequences one after another in one row of ``tokens`` tokens, the unused
    tail cut into dummy sequences of at most ``max_seqlen`` tokens, then empty sequences up to
    ``slots`` (default B + ceil(tokens / max_seqlen), room for any tail).

    Per-token values ([B, S, ...]) become [1, tokens, ...], filled with -100 (names holding
    "label") or 0; per-sequence values ([B, ...]) become [slots, ...], with -100 (integer labels,
    QA positions) or NaN (float targets: regression, multi-label) for the dummy and empty slots,
    so they count in no loss. Float targets must therefore be finite. position_ids restart from 0 in
    every sequence (BERT's), unless the batch has its own or ``position_ids=False`` leaves them to
    the model (RoBERTa's family numbers each packed sequence from padding_idx + 1 itself).

    A multiple-choice batch (attention_mask [E, C, S]) packs its E x C sequences example after
    example, in groups of C slots (``slots`` a multiple of C; the default rounded up to one);
    per-example values ([E, ...]) become [slots / C, ...], and ``num_choices`` = C is added for
    BertForMultipleChoice.

    Adds cu_seq_lens_q [slots + 1] int32 and max_length_q; drops attention_mask. Reads the mask
    on the host: for a data loader, not a training step.
    """
    mask = batch["attention_mask"].bool()
    if mask.dim() not in (2, 3):
        raise ValueError(f"pack_batch: expected attention_mask [batch, seq_len] (or [batch, num_choices, seq_len]), "
                         f"got {tuple(mask.shape)}")
    token_shape = tuple(mask.shape)  # of per-token values
    choices = mask.dim() == 3
    group = mask.shape[1] if choices else 1  # sequences per example
    examples, s = mask.shape[0], mask.shape[-1]
    mask = mask.reshape(-1, s)
    b = mask.shape[0]
    lengths = mask.sum(1).tolist()
    used = sum(lengths)
    if used > tokens:
        raise ValueError(f"pack_batch: the batch holds {used} tokens, more than the {tokens} of the packed row")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"pack_batch: a sequence of {max(lengths)} tokens, longer than max_seqlen={max_seqlen}")
    tail = [min(max_seqlen, tokens - start) for start in range(used, tokens, max_seqlen)]
    if slots is None:
        slots = -(-(b + -(-tokens // max_seqlen)) // group) * group
    if b + len(tail) > slots:
        raise ValueError(f"pack_batch: {b} sequences and {len(tail)} dummy ones need {b + len(tail)} slots, "
                         f"got slots={slots}")
    if slots % group:
        raise ValueError(f"pack_batch: {group} choices per example need slots in groups of {group}, got slots={slots}")
    pieces = lengths + tail + [0] * (slots - b - len(tail))
    cu = torch.zeros(slots + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(pieces, dtype=torch.int64), 0).to(torch.int32)
    rows = mask.flatten().nonzero().flatten()  # [used]: the tokens, sequence after sequence
    out: Dict[str, Any] = {}
    for name, value in batch.items():
        if name == "attention_mask" or not isinstance(value, Tensor):
            continue
        fill = IGNORE_INDEX if "label" in name else 0
        if tuple(value.shape[:len(token_shape)]) == token_shape:  # per token
            inner = tuple(value.shape[len(token_shape):])
            row = value.new_full((tokens,) + inner, fill)
            row[:used] = value.reshape((b * s,) + inner).index_select(0, rows.to(value.device))
            out[name] = row[None]
        elif value.dim() >= 1 and value.shape[0] == examples:  # per sequence (per example: per group of slots)
            if value.is_floating_point() and not value.isfinite().all():
                raise ValueError(f"pack_batch: {name} holds NaN or infinite per-sequence values; a packed batch "
                                 f"marks the slots without a target with NaN, so every real target must be finite")
            fill = float("nan") if value.is_floating_point() else IGNORE_INDEX
            slot_values = value.new_full((slots // group,) + tuple(value.shape[1:]), fill)
            slot_values[:examples] = value
            out[name] = slot_values
        else:
            raise ValueError(f"pack_batch: {name} of shape {tuple(value.shape)} is neither per token "
                             f"[{', '.join(map(str, token_shape))}, ...] nor per "
                             f"{'example' if choices else 'sequence'} [{examples}, ...]")
    if "position_ids" not in out and position_ids:
        out["position_ids"] = torch.cat([torch.arange(n) for n in pieces])[None].to(mask.device)
    out["cu_seq_lens_q"] = cu.to(mask.device)
    out["max_length_q"] = int(max_seqlen)
    if choices:
        out["num_choices"] = group
    return out
