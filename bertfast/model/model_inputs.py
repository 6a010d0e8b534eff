"""Checks of the models' call arguments: a clear error naming what was expected and what was
given, before any kernel sees a bad value."""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from bertfast.model.config import BertConfig
from bertfast.contract import IGNORE_INDEX, exporting, value_checks

Tensor = torch.Tensor


_IGNORED_KWARGS = ("num_items_in_batch",)  # a Trainer argument; losses here are means (see accepts_loss_kwargs)
_DECODER_KWARGS = ("encoder_hidden_states", "encoder_attention_mask", "past_key_values", "use_cache")


def check_kwargs(kwargs: Dict[str, Any]) -> None:
    """Keyword arguments transformers' BERT takes that an encoder-only, fused BERT cannot honour."""
    given = {k for k, v in kwargs.items() if k not in _IGNORED_KWARGS and v is not None and v is not False}
    if "head_mask" in given:
        raise ValueError("head_mask is not supported by bertfast (the fused attention has no per-head mask)")
    if given:
        kind = "decoder/cross-attention arguments" if given <= set(_DECODER_KWARGS) else "arguments"
        raise ValueError(f"bertfast's BERT is an encoder only; unsupported {kind}: {sorted(given)}")


class Packed(NamedTuple):
    """Sequences packed into one row of tokens [1, T]: sequence k is tokens cu_seqlens[k]:cu_seqlens[k+1]."""
    cu_seqlens: Tensor  # int32 [K + 1]: 0 first, T last, non-decreasing (empty sequences allowed)
    max_seqlen: int     # a bound on every sequence's length (static: it sizes the attention's grid)
    cu_seqlens_k: Optional[Tensor] = None  # the caller's cu_seq_lens_k, if another tensor: must hold the same values


# transformers' names for packed sequences (its FlashAttentionKwargs, which DataCollatorWithFlattening fills).
PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def pop_packed(kwargs: Dict[str, Any]) -> Optional[Packed]:
    """Take transformers' packed-sequence keywords out of ``kwargs``: a Packed, or None when
    ``cu_seq_lens_q`` is not given. Self-attention only: the k-side values, when given, must be
    the q-side ones (their values are compared with the other value checks)."""
    given = {k: kwargs.pop(k) for k in PACKED_KWARGS if k in kwargs}
    cu, max_len = given.get("cu_seq_lens_q"), given.get("max_length_q")
    if cu is None:
        stray = sorted(k for k, v in given.items() if v is not None)
        if stray:
            raise ValueError(f"{stray}: packed sequences need cu_seq_lens_q (and max_length_q)")
        return None
    if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.numel() < 2 or cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seq_lens_q: expected an integer tensor [sequences + 1], got "
                         f"{tuple(cu.shape) if isinstance(cu, Tensor) else type(cu).__name__}")
    if isinstance(max_len, Tensor) and max_len.numel() == 1 and not torch.compiler.is_compiling():
        max_len = int(max_len)  # a host value already, or one read here; pass an int to avoid it
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_length_q: expected a positive int (the longest packed sequence), got {max_len!r}")
    cu_k, max_k = given.get("cu_seq_lens_k"), given.get("max_length_k")
    if cu_k is not None and (not isinstance(cu_k, Tensor) or cu_k.shape != cu.shape):
        raise ValueError(f"cu_seq_lens_k: bertfast's attention is self-attention: expected cu_seq_lens_q's "
                         f"values (shape {tuple(cu.shape)}), got {cu_k!r}")
    if max_k is not None and int(max_k) != max_len:
        raise ValueError(f"max_length_k: bertfast's attention is self-attention: expected max_length_q "
                         f"({max_len}), got {max_k!r}")
    return Packed(cu.to(torch.int32).contiguous(), max_len, None if cu_k is cu else cu_k)


def table_rows(cfg: BertConfig, word_embeddings: torch.nn.Module) -> int:
    """The word table's rows: an nn.Embedding's, a wrapper's base layer's (PEFT's LoRA Embedding has
    no num_embeddings), its weight's, else the config's vocabulary."""
    for module in (word_embeddings, getattr(word_embeddings, "base_layer", None)):
        rows = getattr(module, "num_embeddings", None)
        if isinstance(rows, int):
            return rows
    weight = getattr(word_embeddings, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, Tensor) and weight.dim() == 2 else cfg.vocab_size


def prepare_inputs(cfg: BertConfig, word_embeddings: torch.nn.Module, input_ids: Optional[Tensor],
                   attention_mask: Optional[Tensor], token_type_ids: Optional[Tensor], position_ids: Optional[Tensor],
                   inputs_embeds: Optional[Tensor], packed: Optional[Packed] = None,
                   position_padding_idx: Optional[int] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """The encoder's inputs checked (``check_inputs``), then (attention_mask, token_type_ids, position_ids)
    of shape [batch, seq_len]: the defaults where not given, and [1, seq_len] ids broadcast over the
    batch as transformers' embeddings do. Default positions count from 0 (BERT), or with
    ``position_padding_idx`` from it + 1 (RoBERTa, ``counted_positions``). Packed sequences ([1, T]
    with ``packed``) count positions in each sequence."""
    weight = getattr(word_embeddings, "weight", None)
    first = 0 if position_padding_idx is None else position_padding_idx + 1
    batch, seqlen = check_inputs(cfg, table_rows(cfg, word_embeddings), input_ids, attention_mask, token_type_ids,
                                 position_ids, inputs_embeds, weight.dtype if isinstance(weight, Tensor) else None,
                                 packed, first)
    device = (input_ids if input_ids is not None else inputs_embeds).device
    given_mask = attention_mask
    if attention_mask is None:
        attention_mask = torch.ones((batch, seqlen), dtype=torch.long, device=device)
    if token_type_ids is None:
        token_type_ids = torch.zeros((batch, seqlen), dtype=torch.long, device=device)
    if position_ids is None and position_padding_idx is not None:
        position_ids = counted_positions(input_ids, given_mask, position_padding_idx, packed, batch, seqlen, device)
    elif position_ids is None:
        position_ids = torch.arange(seqlen, device=device) if packed is None else packed_positions(packed, seqlen)
    return attention_mask, token_type_ids.expand(batch, seqlen), position_ids.expand(batch, seqlen)


def packed_positions(packed: Packed, tokens: int) -> Tensor:
    """[1, T] int64: each token's position in its own sequence (no host read)."""
    return (torch.arange(tokens, device=packed.cu_seqlens.device) - _sequence_starts(packed, tokens))[None]


def position_restarts(position_ids: Tensor) -> Tensor:
    """Packed sequences read from position ids, as transformers (5.25 and later) reads them when no
    attention_mask is given: a token whose position is not the one before it plus one starts a
    sequence, and attention stays within each (``DataCollatorWithFlattening``'s default batch).
    position_ids [B, S] -> [B, S] bool, True at each sequence's first token (every row's first among
    them). No host read."""
    first = torch.ones_like(position_ids[:, :1], dtype=torch.bool)
    return torch.cat([first, position_ids.diff(dim=1) != 1], dim=1)


def same_sequence(starts: Tensor) -> Tensor:
    """[B, S, S] bool: True where the query's and the key's tokens lie in one sequence of ``starts``
    (``position_restarts``'s): the reference encoder's mask for them."""
    sequence = starts.long().cumsum(1)
    return sequence[:, :, None] == sequence[:, None, :]


def _sequence_starts(packed: Packed, tokens: int) -> Tensor:
    """[T] int64: the index of the first token of each token's sequence."""
    cu = packed.cu_seqlens
    index = torch.arange(tokens, device=cu.device)
    sequence = torch.searchsorted(cu[1:], index.to(cu.dtype), right=True).clamp_(max=cu.numel() - 2)  # [T]
    return cu.long().index_select(0, sequence)


def counted_positions(input_ids: Optional[Tensor], attention_mask: Optional[Tensor], padding_idx: int,
                      packed: Optional[Packed], batch: int, seqlen: int, device: torch.device) -> Tensor:
    """RoBERTa's positions [B, S] (fairseq's): the counted tokens numbered from padding_idx + 1 within
    each sequence, the others at padding_idx. Counted are the ids other than padding_idx, as in
    transformers (left padding then numbers each text as right padding does); with inputs_embeds,
    the attention mask's tokens, where transformers numbers every position (wrong under left
    padding). Packed, each sequence counts from its own first token: transformers' RoBERTa counts
    across the whole row, and DataCollatorWithFlattening's position_ids count from 0."""
    if input_ids is not None:
        counted = input_ids.ne(padding_idx)
    elif attention_mask is not None:
        counted = attention_mask.ne(0)
    else:
        counted = torch.ones((batch, seqlen), dtype=torch.bool, device=device)
    counts = counted.long().cumsum(1)
    if packed is not None:  # restart the count at each sequence's first token
        before = torch.cat([counts.new_zeros((1, 1)), counts[:, :-1]], dim=1)  # counted tokens before each
        counts = counts - before[0].index_select(0, _sequence_starts(packed, seqlen))[None]
    return counts * counted + padding_idx


def check_inputs(cfg: BertConfig, vocab_size: int, input_ids: Optional[Tensor], attention_mask: Optional[Tensor],
                 token_type_ids: Optional[Tensor], position_ids: Optional[Tensor],
                 inputs_embeds: Optional[Tensor], model_dtype: Optional[torch.dtype] = None,
                 packed: Optional[Packed] = None, first_position: int = 0) -> Tuple[int, int]:
    """Shapes, dtypes and devices of BertModel's inputs, then their values (one host sync, or
    none: see ``contract.value_checks``). ``vocab_size`` is the word table's (after a resize, before the
    config is); ``model_dtype`` its weight's; ``first_position`` the family's first token's position
    (RoBERTa's padding_idx + 1: given position_ids must not number a real token below it). Returns
    (batch, seq_len)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("BertModel: give exactly one of input_ids or inputs_embeds")
    named = (("input_ids", input_ids), ("inputs_embeds", inputs_embeds), ("attention_mask", attention_mask),
             ("token_type_ids", token_type_ids), ("position_ids", position_ids))
    for name, t in named:
        if t is not None and t.is_meta and not exporting():
            raise ValueError(f"{name}: expected a tensor with values (cpu or an accelerator), got one on the meta "
                             f"device; bertfast's forward reads the inputs (padding removal, range checks)")
    if input_ids is not None:
        if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise ValueError(f"input_ids: expected an integer tensor, got dtype {input_ids.dtype}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected shape [batch, seq_len], got {tuple(input_ids.shape)}")
        batch, seqlen = input_ids.shape
    else:
        width = getattr(cfg, "embedding_size", cfg.hidden_size)  # ELECTRA's embeddings are narrower
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != width:
            raise ValueError(f"inputs_embeds: expected [batch, seq_len, {width}], "
                             f"got {tuple(inputs_embeds.shape)}")
        _check_embeds_dtype(inputs_embeds.dtype, model_dtype, inputs_embeds.device)
        batch, seqlen = inputs_embeds.shape[:2]
    if not exporting():
        if seqlen == 0:
            raise ValueError(f"{'input_ids' if input_ids is not None else 'inputs_embeds'}: expected at least one "
                             f"position per sequence, got sequence length 0 (shape "
                             f"{tuple((input_ids if input_ids is not None else inputs_embeds).shape)})")
        longest = seqlen if packed is None else packed.max_seqlen
        if longest + first_position > cfg.max_position_embeddings:
            counted = (f" less the first token's position, padding_idx + 1 = {first_position}: "
                       f"{cfg.max_position_embeddings - first_position} tokens" if first_position else "")
            raise ValueError(f"sequence length {longest} exceeds max_position_embeddings "
                             f"{cfg.max_position_embeddings}{counted}")
    if attention_mask is not None and tuple(attention_mask.shape) != (batch, seqlen):
        raise ValueError(f"attention_mask: expected shape [{batch}, {seqlen}], got {tuple(attention_mask.shape)}")
    # transformers' embeddings broadcast ids of one row over the batch (its own default position_ids are [1, S]).
    for name, t in (("token_type_ids", token_type_ids), ("position_ids", position_ids)):
        # Compared as tuples, not with ``in``: under a dynamic-shape compile Dynamo's ``in`` reads a
        # static size against a symbolic one as unequal.
        if t is not None and not (tuple(t.shape) == (batch, seqlen) or tuple(t.shape) == (1, seqlen)):
            raise ValueError(f"{name}: expected shape [{batch}, {seqlen}] (or [1, {seqlen}], broadcast over the "
                             f"batch), got {tuple(t.shape)}")
    if packed is not None:
        _check_packed_shapes(packed, batch, seqlen, attention_mask, input_ids if input_ids is not None else inputs_embeds)
    mode = value_checks(input_ids if input_ids is not None else inputs_embeds)
    if mode == "off":
        return batch, seqlen
    extra_rules = [] if packed is None else _packed_rules(packed, seqlen)
    if first_position and position_ids is not None:
        extra_rules.append(_first_position_rule(position_ids, attention_mask, first_position))
    if mode == "host":
        _check_values(cfg, vocab_size, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                      extra_rules)
    else:
        _assert_values(cfg, vocab_size, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                       extra_rules)
    return batch, seqlen


def _check_packed_shapes(packed: Packed, batch: int, seqlen: int, attention_mask: Optional[Tensor],
                         source: Tensor) -> None:
    if batch != 1:
        raise ValueError(f"packed sequences (cu_seq_lens_q): expected inputs of shape [1, tokens], got batch {batch}")
    if attention_mask is not None:
        raise ValueError("packed sequences (cu_seq_lens_q): expected no attention_mask (every position of the "
                         "[1, tokens] row belongs to a sequence; pack the unused tail as a sequence of its own)")
    if packed.cu_seqlens.device != source.device:
        raise ValueError(f"cu_seq_lens_q: expected device {source.device} (the inputs'), got "
                         f"{packed.cu_seqlens.device}")
    if packed.max_seqlen > seqlen and not exporting():
        raise ValueError(f"max_length_q: expected at most the {seqlen} packed tokens, got {packed.max_seqlen}")


def _packed_rules(packed: Packed, tokens: int) -> List[Tuple[str, Tensor]]:
    """Bool device scalars, each true when cu_seq_lens_q (and a distinct cu_seq_lens_k) is valid."""
    cu = packed.cu_seqlens
    steps = cu.diff()
    message = (f"cu_seq_lens_q: expected 0 first, {tokens} (the packed tokens) last and steps in "
               f"[0, max_length_q={packed.max_seqlen}]")
    ok = (cu[0] == 0) & (cu[-1] == tokens) & (steps >= 0).all() & (steps <= packed.max_seqlen).all()
    rules = [(message, ok)]
    cu_k = packed.cu_seqlens_k
    if cu_k is not None:
        rules.append(("cu_seq_lens_k: bertfast's attention is self-attention: expected cu_seq_lens_q's values",
                      (cu_k.to(cu.device, cu.dtype) == cu).all()))
    return rules


def _first_position_rule(position_ids: Tensor, attention_mask: Optional[Tensor], first: int) -> Tuple[str, Tensor]:
    """A bool device scalar, true when no real token's position is below ``first`` (RoBERTa's
    padding_idx + 1: position ids counted from 0, as BERT's or DataCollatorWithFlattening's, would
    read the padding row and rows no token was trained on)."""
    real = position_ids if attention_mask is None else torch.where(attention_mask == 0, first, position_ids)
    message = (f"position_ids: this model numbers tokens from padding_idx + 1 = {first} (RoBERTa's positions), "
               f"got a real token's position below it (counted from 0, as DataCollatorWithFlattening's are?); "
               f"leave position_ids out (bertfast numbers each sequence, packed ones too: "
               f"pack_batch(..., position_ids=False)) or add {first}")
    return message, (real >= first).all()


def _check_embeds_dtype(dtype: torch.dtype, model_dtype: Optional[torch.dtype], device: torch.device) -> None:
    """inputs_embeds must not be wider than the model's weights (transformers then fails inside LayerNorm
    with a mixed-dtype error); a narrower float type is promoted, as in transformers. Under autocast
    the fp32/fp16/bf16 mix is autocast's to resolve."""
    if not dtype.is_floating_point:
        raise ValueError(f"inputs_embeds: expected a floating-point tensor, got dtype {dtype}")
    if model_dtype is None or torch.promote_types(dtype, model_dtype) == model_dtype:
        return
    if torch.is_autocast_enabled(device.type) and dtype in (torch.float32, torch.float16, torch.bfloat16):
        return
    raise ValueError(f"inputs_embeds: expected dtype {model_dtype} (the model's) or a narrower float type, got "
                     f"{dtype}; cast it with inputs_embeds.to({model_dtype})")


def _check_values(cfg: BertConfig, vocab_size: int, input_ids, attention_mask, token_type_ids, position_ids,
                  inputs_embeds=None, extra_rules: Sequence[Tuple[str, Tensor]] = ()) -> None:
    """Range checks and the extra rules (``_packed_rules``, ``_first_position_rule``), gathered into one
    host sync."""
    checks: List[Tuple[str, Tensor]] = [(message, ok.logical_not()) for message, ok in extra_rules]
    if input_ids is not None and input_ids.numel():
        checks += [("input_ids_min", input_ids.min()), ("input_ids_max", input_ids.max())]
    if token_type_ids is not None and token_type_ids.numel():
        checks += [("tt_min", token_type_ids.min()), ("tt_max", token_type_ids.max())]
    if position_ids is not None and position_ids.numel():
        checks += [("pos_min", position_ids.min()), ("pos_max", position_ids.max())]
    if attention_mask is not None and attention_mask.numel():
        checks.append(("mask_bad", ((attention_mask != 0) & (attention_mask != 1)).sum()))
    if inputs_embeds is not None and inputs_embeds.numel():
        checks.append(("embeds_bad", inputs_embeds.detach().isfinite().logical_not().sum()))
    if not checks:
        return
    values = dict(zip([n for n, _ in checks], torch.stack([v.to(torch.float64) for _, v in checks]).tolist()))
    for message, _ in extra_rules:
        if values[message]:
            raise ValueError(message)
    if values.get("input_ids_min", 0) < 0 or values.get("input_ids_max", 0) >= vocab_size:
        raise ValueError(f"input_ids: expected values in [0, vocab_size={vocab_size}), got values in "
                         f"[{int(values['input_ids_min'])}, {int(values['input_ids_max'])}]")
    if "tt_min" in values and (values["tt_min"] < 0 or values["tt_max"] >= cfg.type_vocab_size):
        raise ValueError(f"token_type_ids: expected values in [0, type_vocab_size={cfg.type_vocab_size}), "
                         f"got values in [{int(values['tt_min'])}, {int(values['tt_max'])}]")
    if values.get("pos_min", 0) < 0 or values.get("pos_max", 0) >= cfg.max_position_embeddings:
        raise ValueError(f"position_ids: expected values in [0, max_position_embeddings="
                         f"{cfg.max_position_embeddings}), got values in [{int(values['pos_min'])}, "
                         f"{int(values['pos_max'])}]")
    if values.get("mask_bad", 0):
        raise ValueError(f"attention_mask: expected only 0 (padding) and 1 (token), got "
                         f"{int(values['mask_bad'])} other values")
    if values.get("embeds_bad", 0):
        raise ValueError(f"inputs_embeds: expected finite values, got {int(values['embeds_bad'])} NaN or inf "
                         f"values")


def _assert_values(cfg: BertConfig, vocab_size: int, input_ids, attention_mask, token_type_ids, position_ids,
                   inputs_embeds=None, extra_rules: Sequence[Tuple[str, Tensor]] = ()) -> None:
    """``_check_values``'s rules asserted on the device (no host read)."""
    def within(t: Optional[Tensor], hi: int) -> Optional[Tensor]:
        return None if t is None else ((t >= 0) & (t < hi)).all()
    rules = [(within(input_ids, vocab_size), f"input_ids: expected values in [0, vocab_size={vocab_size})"),
             (None if token_type_ids is None else within(token_type_ids, cfg.type_vocab_size),
              f"token_type_ids: expected values in [0, type_vocab_size={getattr(cfg, 'type_vocab_size', 0)})"),
             (within(position_ids, cfg.max_position_embeddings),
              f"position_ids: expected values in [0, max_position_embeddings={cfg.max_position_embeddings})"),
             (within(attention_mask, 2), "attention_mask: expected only 0 (padding) and 1 (token)"),
             (None if inputs_embeds is None else inputs_embeds.detach().isfinite().all(),
              "inputs_embeds: expected finite values")]
    rules += [(ok, message) for message, ok in extra_rules]
    for ok, message in rules:
        if ok is not None:
            torch._assert_async(ok, message)


def check_labels(name: str, labels: Tensor, num_classes: int) -> None:
    """Integer class labels in [0, num_classes) or -100 (one host sync, or none: see
    ``contract.value_checks``)."""
    if labels.is_floating_point():
        raise ValueError(f"{name}: expected integer class labels, got dtype {labels.dtype}")
    mode = value_checks(labels)
    if mode == "off" or labels.numel() == 0:
        return
    if mode == "device":
        ok = ((labels == IGNORE_INDEX) | ((labels >= 0) & (labels < num_classes))).all()
        torch._assert_async(ok, f"{name}: expected values in [0, {num_classes}) or -100 (ignored)")
        return
    valid = labels[labels != IGNORE_INDEX]
    if valid.numel():
        lo, hi = torch.stack([valid.min(), valid.max()]).tolist()
        if lo < 0 or hi >= num_classes:
            raise ValueError(f"{name}: expected values in [0, {num_classes}) or -100 (ignored), got values in "
                             f"[{lo}, {hi}]")
