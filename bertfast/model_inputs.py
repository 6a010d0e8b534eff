"""Checks of the models' call arguments: a clear error naming what was expected and what was
given, before any kernel sees a bad value."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from bertfast.config import BertConfig
from bertfast.contract import IGNORE_INDEX

Tensor = torch.Tensor


def exporting() -> bool:
    return torch.compiler.is_exporting() or torch.onnx.is_in_onnx_export()


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


def check_inputs(cfg: BertConfig, vocab_size: int, input_ids: Optional[Tensor], attention_mask: Optional[Tensor],
                 token_type_ids: Optional[Tensor], position_ids: Optional[Tensor],
                 inputs_embeds: Optional[Tensor]) -> Tuple[int, int]:
    """Shapes and dtypes of BertModel's inputs, then their values (one host sync, skipped while
    compiling or exporting). ``vocab_size`` is the word table's (after a resize, before the config is).
    Returns (batch, seq_len)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("BertModel: give exactly one of input_ids or inputs_embeds")
    if input_ids is not None:
        if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise ValueError(f"input_ids: expected an integer tensor, got dtype {input_ids.dtype}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected shape [batch, seq_len], got {tuple(input_ids.shape)}")
        batch, seqlen = input_ids.shape
    else:
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != cfg.hidden_size:
            raise ValueError(f"inputs_embeds: expected [batch, seq_len, {cfg.hidden_size}], "
                             f"got {tuple(inputs_embeds.shape)}")
        batch, seqlen = inputs_embeds.shape[:2]
    if not exporting() and seqlen > cfg.max_position_embeddings:
        raise ValueError(f"sequence length {seqlen} exceeds max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    for name, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids),
                    ("position_ids", position_ids)):
        if t is not None and tuple(t.shape) != (batch, seqlen):
            raise ValueError(f"{name}: expected shape [{batch}, {seqlen}], got {tuple(t.shape)}")
    if not torch.compiler.is_compiling() and not exporting():
        _check_values(cfg, vocab_size, input_ids, attention_mask, token_type_ids, position_ids)
    return batch, seqlen


def _check_values(cfg: BertConfig, vocab_size: int, input_ids, attention_mask, token_type_ids, position_ids) -> None:
    """Range checks, gathered into one host sync."""
    checks: List[Tuple[str, Tensor]] = []
    if input_ids is not None and input_ids.numel():
        checks += [("input_ids_min", input_ids.min()), ("input_ids_max", input_ids.max())]
    if token_type_ids is not None and token_type_ids.numel():
        checks += [("tt_min", token_type_ids.min()), ("tt_max", token_type_ids.max())]
    if position_ids is not None and position_ids.numel():
        checks += [("pos_min", position_ids.min()), ("pos_max", position_ids.max())]
    if attention_mask is not None and attention_mask.numel():
        checks.append(("mask_bad", ((attention_mask != 0) & (attention_mask != 1)).sum()))
    if not checks:
        return
    values = dict(zip([n for n, _ in checks], torch.stack([v.to(torch.float64) for _, v in checks]).tolist()))
    if values.get("input_ids_min", 0) < 0 or values.get("input_ids_max", 0) >= vocab_size:
        raise ValueError(f"input_ids: expected values in [0, vocab_size={vocab_size}), got values in "
                         f"[{int(values['input_ids_min'])}, {int(values['input_ids_max'])}]")
    if values.get("tt_min", 0) < 0 or values.get("tt_max", 0) >= cfg.type_vocab_size:
        raise ValueError(f"token_type_ids: expected values in [0, type_vocab_size={cfg.type_vocab_size}), "
                         f"got values in [{int(values['tt_min'])}, {int(values['tt_max'])}]")
    if values.get("pos_min", 0) < 0 or values.get("pos_max", 0) >= cfg.max_position_embeddings:
        raise ValueError(f"position_ids: expected values in [0, max_position_embeddings="
                         f"{cfg.max_position_embeddings}), got values in [{int(values['pos_min'])}, "
                         f"{int(values['pos_max'])}]")
    if values.get("mask_bad", 0):
        raise ValueError(f"attention_mask: expected only 0 (padding) and 1 (token), got "
                         f"{int(values['mask_bad'])} other values")


def check_labels(name: str, labels: Tensor, num_classes: int) -> None:
    """Integer class labels in [0, num_classes) or -100 (one host sync, skipped while compiling)."""
    if labels.is_floating_point():
        raise ValueError(f"{name}: expected integer class labels, got dtype {labels.dtype}")
    if torch.compiler.is_compiling() or exporting() or labels.numel() == 0:
        return
    valid = labels[labels != IGNORE_INDEX]
    if valid.numel():
        lo, hi = torch.stack([valid.min(), valid.max()]).tolist()
        if lo < 0 or hi >= num_classes:
            raise ValueError(f"{name}: expected values in [0, {num_classes}) or -100 (ignored), got values in "
                             f"[{lo}, {hi}]")
