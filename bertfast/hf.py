"""bertfast inside transformers: the Auto classes, and transformers' own BERT on the fused attention.

    bertfast.register_auto()                        # AutoModel* build bertfast models for BERT configs
    bertfast.unregister_auto()                      # and back

    import bertfast.hf
    bertfast.hf.register()                          # once: adds the "bertfast" implementation
    model = transformers.BertModel.from_pretrained(path, attn_implementation="bertfast")
    # or, for a model already loaded: model.set_attn_implementation("bertfast")

The padded attention op runs with the key-padding mask recovered from transformers' mask
(a sequence with no valid key gives zeros). Only bidirectional self-attention is served;
causal or cross-attention (BERT as a decoder) raises a clear error. For the whole fused,
unpadded model use ``bertfast.BertModel`` instead.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from bertfast import ops

NAME = "bertfast"


def key_padding_mask_from(attention_mask: Optional[torch.Tensor], batch: int, seqlen: int,
                          device: torch.device) -> torch.Tensor:
    """[B, S] bool (True = key is a token) from transformers' 4D bool or additive float mask."""
    if attention_mask is None:
        return torch.ones((batch, seqlen), dtype=torch.bool, device=device)
    if attention_mask.dim() == 2:
        return attention_mask.bool()
    if attention_mask.dim() != 4 or attention_mask.shape[-1] != seqlen:
        raise ValueError(f"bertfast attention: expected a [batch, 1, seq, seq] or [batch, seq] mask, got "
                         f"{tuple(attention_mask.shape)}")
    keep = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    # Padding masks repeat one key pattern for every query row; a key is a token if any row attends to it.
    return keep[:, 0].any(dim=1)


def bertfast_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                       scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                       **kwargs) -> Tuple[torch.Tensor, None]:
    """transformers AttentionInterface: q, k, v [B, A, S, D] -> ([B, S, A, D], no weights)."""
    if is_causal or getattr(module, "is_causal", False) or kwargs.get("encoder_hidden_states") is not None:
        raise ValueError("bertfast attention serves bidirectional self-attention only (BERT as an encoder)")
    if query.shape != key.shape:
        raise ValueError(f"bertfast attention: expected self-attention (q and k of one shape), got "
                         f"{tuple(query.shape)} and {tuple(key.shape)}")
    batch, _, seqlen, _ = query.shape
    mask = key_padding_mask_from(attention_mask, batch, seqlen, query.device)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, A, D]
    return ops.attention(q, k, v, mask, dropout, scaling), None


def register() -> None:
    """Register the "bertfast" attention (and its mask builder) with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, bertfast_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # a boolean [B, 1, S, S] mask, as for sdpa


# ----------------------------------------------------------------------- Auto classes
_AUTO_CLASSES = (("AutoModel", "BertModel"), ("AutoModelForPreTraining", "BertForPreTraining"),
                 ("AutoModelForMaskedLM", "BertForMaskedLM"),
                 ("AutoModelForSequenceClassification", "BertForSequenceClassification"),
                 ("AutoModelForTokenClassification", "BertForTokenClassification"),
                 ("AutoModelForQuestionAnswering", "BertForQuestionAnswering"),
                 ("AutoModelForMultipleChoice", "BertForMultipleChoice"))
_displaced: dict = {}


def _auto_keys():
    import transformers

    import bertfast

    for auto_name, model_name in _AUTO_CLASSES:
        mapping = getattr(transformers, auto_name)._model_mapping
        for config_class in (transformers.BertConfig, bertfast.BertConfig):
            yield mapping, config_class, getattr(bertfast, model_name)


def register_auto() -> None:
    """Make transformers' Auto classes (and so pipelines, sentence-transformers, Trainer scripts)
    build bertfast's models for BERT configs, in this process: ``AutoModel.from_pretrained(bert_dir)``
    then returns a ``bertfast.BertModel``. ``unregister_auto()`` restores transformers' own."""
    for mapping, config_class, model_class in _auto_keys():
        if (id(mapping), config_class) not in _displaced:
            _displaced[(id(mapping), config_class)] = mapping._extra_content.get(config_class)
        # Written directly: mapping.register() skips transformers' own config classes in some releases.
        mapping._extra_content[config_class] = model_class


def unregister_auto() -> None:
    """Undo ``register_auto()``: the Auto classes build what they built before it."""
    for mapping, config_class, _ in _auto_keys():
        key = (id(mapping), config_class)
        if key not in _displaced:
            continue
        previous = _displaced.pop(key)
        if previous is None:
            mapping._extra_content.pop(config_class, None)
        else:
            mapping._extra_content[config_class] = previous
