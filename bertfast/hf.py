"""bertfast inside transformers: the Auto classes, and transformers' own BERT on the fused attention.

    bertfast.register_auto()                        # AutoModel* build bertfast models (BERT, RoBERTa, ELECTRA, ...)
    bertfast.unregister_auto()                      # and back

    import bertfast.hf
    bertfast.hf.register()                          # once: adds the "bertfast" implementation
    model = transformers.BertModel.from_pretrained(path, attn_implementation="bertfast")
    # or, for a model already loaded: model.set_attn_implementation("bertfast")

The padded attention op runs with the key-padding mask recovered from transformers' mask
(a sequence with no valid key gives zeros). The kernel serves bidirectional self-attention
under a key-padding mask and nothing else, so everything else raises a ValueError rather than
being dropped: causal or cross-attention (BERT as a decoder), a sliding window (ModernBERT's
local layers), soft-capping, attention sinks, a position bias (passed beside the mask or added
into it), and any mask that differs between query rows. Families that compute attention in their
own code (DeBERTa, MPNet: no ``_supports_attention_backend``) would never call the kernel, so
asking them for it raises when the model is built or loaded. For the whole fused, unpadded model
use ``bertfast.BertModel`` (``bertfast.RobertaModel``, ...) instead.
"""
from __future__ import annotations

import functools
import weakref
from typing import Optional, Tuple

import torch

from bertfast import ops

NAME = "bertfast"

# Keyword arguments through which transformers asks an attention function for semantics the
# kernel lacks; a value other than None means the caller relies on them.
UNSERVED_KWARGS = {
    "sliding_window": "a sliding window",
    "softcap": "logit soft-capping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "a position bias",
    "head_mask": "a head mask",
}

# The 4D mask transformers passes to every layer is one tensor per forward: check it once.
_checked_mask: Tuple[Optional[weakref.ref], Optional[int]] = (None, None)


def _version(mask: torch.Tensor) -> Optional[int]:
    # Inference tensors keep no version counter; their identity alone keys the check.
    return None if mask.is_inference() else mask._version


def _check_key_padding(mask: torch.Tensor, keep: torch.Tensor, key_keep: torch.Tensor) -> None:
    """Refuse a mask that is not a key-padding mask: float values other than 0 and a large negative
    (a bias added into the mask), or query rows that differ (causal, sliding window, chunked)."""
    global _checked_mask
    ref, version = _checked_mask
    if ref is not None and ref() is mask and version == _version(mask):
        return
    served = (keep == key_keep[:, None, None, :]).all()
    if mask.dtype != torch.bool:
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        served = served & (keep | blocked).all()
    message = ("bertfast attention serves key-padding masks only (every query row masks the same keys, "
               "a float mask holds only 0 and a large negative); this mask holds a position bias or "
               "masks per query (causal, sliding window, chunked, or sequences packed by position ids that "
               "restart). Use attn_implementation='sdpa', or bertfast's own models for packed sequences")
    if torch.compiler.is_compiling():  # no host sync in a graph: checked on the device
        torch._assert_async(served, message)
        return
    if not bool(served):  # one host sync per mask tensor, not per layer
        raise ValueError(message)
    _checked_mask = (weakref.ref(mask), _version(mask))


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
    # A key-padding mask repeats one key pattern for every query row; a key is a token if a row attends to it.
    key_keep = keep[:, 0].any(dim=1)
    _check_key_padding(attention_mask, keep, key_keep)
    return key_keep


def _refuse_unserved(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     is_causal: Optional[bool], kwargs: dict) -> None:
    name = type(module).__name__
    if query.shape != key.shape or "CrossAttention" in name or kwargs.get("encoder_hidden_states") is not None:
        raise ValueError(f"bertfast attention serves self-attention only: {name} passed queries "
                         f"{tuple(query.shape)} and keys {tuple(key.shape)} (cross-attention)")
    # As transformers' sdpa: the call's is_causal wins, then the module's, and a module that
    # declares neither is taken as causal.
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if causal:
        raise ValueError(f"bertfast attention serves bidirectional self-attention only (an encoder): "
                         f"{name} is causal (is_causal={causal}); use attn_implementation=\"sdpa\"")
    for kwarg, what in UNSERVED_KWARGS.items():
        if kwargs.get(kwarg) is not None:
            raise ValueError(f"bertfast attention does not serve {what}: {name} passed {kwarg}="
                             f"{kwargs[kwarg]!r}; use attn_implementation=\"sdpa\" for this model")


def bertfast_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                       scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                       **kwargs) -> Tuple[torch.Tensor, None]:
    """transformers AttentionInterface: q, k, v [B, A, S, D] -> ([B, S, A, D], no weights)."""
    _refuse_unserved(module, query, key, is_causal, kwargs)
    batch, _, seqlen, _ = query.shape
    mask = key_padding_mask_from(attention_mask, batch, seqlen, query.device)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, A, D]
    return ops.attention(q, k, v, mask, dropout, scaling), None


def _require_attention_interface(get_correct):
    """Wrap PreTrainedModel.get_correct_attn_implementation: transformers accepts any registered
    name for any model, so a family that never calls the interface would silently not use bertfast."""
    @functools.wraps(get_correct)
    def checked(self, requested_attention, *args, **kwargs):
        if requested_attention == NAME and type(self).__module__.startswith("bertfast."):
            raise ValueError(
                f"attn_implementation=\"{NAME}\": {type(self).__name__} is bertfast's own class, whose fused "
                f"attention always runs; leave attn_implementation out (or pass \"eager\"). The \"{NAME}\" "
                f"attention is for transformers' own classes (e.g. transformers.{type(self).__name__}).")
        if requested_attention == NAME and not getattr(self, "_supports_attention_backend", False):
            raise ValueError(
                f"attn_implementation=\"{NAME}\": {type(self).__name__} computes attention in its own code, "
                f"not through transformers' AttentionInterface, so bertfast's kernel would never run. "
                f"Use attn_implementation=\"eager\" or \"sdpa\" for this model.")
        return get_correct(self, requested_attention, *args, **kwargs)

    checked.bertfast_checked = True
    return checked


def register() -> None:
    """Register the "bertfast" attention (and its mask builder) with transformers, and make asking
    for it on a model that does not use transformers' AttentionInterface an error."""
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, bertfast_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # a boolean [B, 1, S, S] mask, as for sdpa
    get_correct = PreTrainedModel.get_correct_attn_implementation
    if not getattr(get_correct, "bertfast_checked", False):
        PreTrainedModel.get_correct_attn_implementation = _require_attention_interface(get_correct)


# ----------------------------------------------------------------------- Auto classes
_AUTO_CLASSES = (("AutoModel", "BertModel"), ("AutoModelForPreTraining", "BertForPreTraining"),
                 ("AutoModelForMaskedLM", "BertForMaskedLM"),
                 ("AutoModelForSequenceClassification", "BertForSequenceClassification"),
                 ("AutoModelForTokenClassification", "BertForTokenClassification"),
                 ("AutoModelForQuestionAnswering", "BertForQuestionAnswering"),
                 ("AutoModelForMultipleChoice", "BertForMultipleChoice"))
_displaced: dict = {}


def _auto_keys():
    """(an Auto class's mapping, a config class, the bertfast class it is to build) for every family."""
    import transformers

    import bertfast
    from bertfast.model import distilbert, electra, roberta

    for auto_name, model_name in _AUTO_CLASSES:
        mapping = getattr(transformers, auto_name)._model_mapping
        for config_class in (transformers.BertConfig, bertfast.BertConfig):
            yield mapping, config_class, getattr(bertfast, model_name)
    for family in (roberta, electra, distilbert):
        for config_name, table in family.AUTO_CLASSES.items():
            for auto_name, model_name in table.items():
                yield (getattr(transformers, auto_name)._model_mapping, getattr(transformers, config_name),
                       family.MODEL_CLASSES[model_name])


def register_auto() -> None:
    """Make transformers' Auto classes (and so pipelines, sentence-transformers, Trainer scripts)
    build bertfast's models for BERT, RoBERTa, XLM-R, CamemBERT, ELECTRA and DistilBERT configs, in this process:
    ``AutoModel.from_pretrained(bert_dir)`` then returns a ``bertfast.BertModel`` (a RoBERTa
    directory: a ``bertfast.RobertaModel``). ``unregister_auto()`` restores transformers' own."""
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
