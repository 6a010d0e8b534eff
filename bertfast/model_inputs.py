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


def prepare_inputs(cfg: BertConfig, word_embeddings: torch.nn.Module, input_ids: Optional[Tensor],
                   attention_mask: Optional[Tensor], token_type_ids: Optional[Tensor], position_ids: Optional[Tensor],
                   inputs_embeds: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """BertModel's inputs checked (``check_inputs``), then (attention_mask, token_type_ids, position_ids)
    of shape [batch, seq_len]: the defaults where not given, and [1, seq_len] ids broadcast over the
    batch as transformers' embeddings do."""
    weight = getattr(word_embeddings, "weight", None)
    batch, seqlen = check_inputs(cfg, word_embeddings.num_embeddings, input_ids, attention_mask, token_type_ids,
                                 position_ids, inputs_embeds, weight.dtype if isinstance(weight, Tensor) else None)
    device = (input_ids if input_ids is not None else inputs_embeds).device
    if attention_mask is None:
        attention_mask = torch.ones((batch, seqlen), dtype=torch.long, device=device)
    if token_type_ids is None:
        token_type_ids = torch.zeros((batch, seqlen), dtype=torch.long, device=device)
    if position_ids is None:
        position_ids = torch.arange(seqlen, device=device)
    return attention_mask, token_type_ids.expand(batch, seqlen), position_ids.expand(batch, seqlen)


def check_inputs(cfg: BertConfig, vocab_size: int, input_ids: Optional[Tensor], attention_mask: Optional[Tensor],
                 token_type_ids: Optional[Tensor], position_ids: Optional[Tensor],
                 inputs_embeds: Optional[Tensor], model_dtype: Optional[torch.dtype] = None) -> Tuple[int, int]:
    """Shapes, dtypes and devices of BertModel's inputs, then their values (one host sync, skipped
    while compiling or exporting). ``vocab_size`` is the word table's (after a resize, before the
    config is); ``model_dtype`` its weight's. Returns (batch, seq_len)."""
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
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != cfg.hidden_size:
            raise ValueError(f"inputs_embeds: expected [batch, seq_len, {cfg.hidden_size}], "
                             f"got {tuple(inputs_embeds.shape)}")
        _check_embeds_dtype(inputs_embeds.dtype, model_dtype, inputs_embeds.device)
        batch, seqlen = inputs_embeds.shape[:2]
    if not exporting():
        if seqlen == 0:
            raise ValueError(f"{'input_ids' if input_ids is not None else 'inputs_embeds'}: expected at least one "
                             f"position per sequence, got sequence length 0 (shape "
                             f"{tuple((input_ids if input_ids is not None else inputs_embeds).shape)})")
        if seqlen > cfg.max_position_embeddings:
            raise ValueError(f"sequence length {seqlen} exceeds max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
    if attention_mask is not None and tuple(attention_mask.shape) != (batch, seqlen):
        raise ValueError(f"attention_mask: expected shape [{batch}, {seqlen}], got {tuple(attention_mask.shape)}")
    # transformers' embeddings broadcast ids of one row over the batch (its own default position_ids are [1, S]).
    for name, t in (("token_type_ids", token_type_ids), ("position_ids", position_ids)):
        if t is not None and tuple(t.shape) not in ((batch, seqlen), (1, seqlen)):
            raise ValueError(f"{name}: expected shape [{batch}, {seqlen}] (or [1, {seqlen}], broadcast over the "
                             f"batch), got {tuple(t.shape)}")
    if not torch.compiler.is_compiling() and not exporting():
        _check_values(cfg, vocab_size, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
    return batch, seqlen


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
                  inputs_embeds=None) -> None:
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
    if inputs_embeds is not None and inputs_embeds.numel():
        checks.append(("embeds_bad", inputs_embeds.detach().isfinite().logical_not().sum()))
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
    if values.get("embeds_bad", 0):
        raise ValueError(f"inputs_embeds: expected finite values, got {int(values['embeds_bad'])} NaN or inf "
                         f"values")


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
