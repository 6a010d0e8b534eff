"""BertConfig: transformers' ``BertConfig``, with named presets and a check of what the kernels serve.

A bertfast model takes any transformers ``BertConfig`` (this subclass or transformers' own);
``config.json`` files are transformers' and round-trip both ways. ``check_supported`` runs
when a model is built and names any setting the fused encoder does not serve.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Tuple

import transformers

SUPPORTED_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh")
SUPPORTED_PROBLEM_TYPES = (None, "regression", "single_label_classification", "multi_label_classification")


class BertConfig(transformers.BertConfig):
    """transformers' BertConfig plus ``preset(name)``; every field and method is transformers'."""

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "BertConfig":
        """Named sizes: 'bert-base' and 'bert-large' (the paper's), 'minilm' (MiniLM-L12-H384's shape, which
        sentence-embedding models use: the CPU benchmarks), 'tiny' and 'small' for tests."""
        if name not in PRESETS:
            raise ValueError(f"unknown BertConfig preset {name!r}; expected one of {sorted(PRESETS)}")
        config = cls(**{**PRESETS[name], **overrides})
        check_supported(config)
        return config

    @classmethod
    def _dict_from_json_file(cls, json_file: "str | os.PathLike") -> Dict[str, Any]:
        """transformers' reader of config.json (used by from_pretrained and from_json_file), with errors
        that name the file: not JSON, not a JSON object, or a field transformers' validators refuse
        (``"hidden_size": null`` or ``"3"``), which would otherwise fail later without the file's name."""
        try:
            values = super()._dict_from_json_file(json_file)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise OSError(f"{json_file}: not a valid JSON config file ({e})") from e
        if not isinstance(values, dict):
            raise OSError(f"{json_file}: expected a JSON object of config fields, got a JSON "
                          f"{_JSON_TYPES.get(type(values), type(values).__name__)}")
        validators = getattr(cls, "__validators__", {})  # transformers' strict-dataclass field checks
        for name, value in values.items():
            for validate in validators.get(name, ()):
                try:
                    validate(value)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"{json_file}: invalid value for {name!r}: {e}") from e
            if name in POSITIVE_INT_FIELDS and not _positive_int(value):
                raise ValueError(f"{json_file}: {name} must be a positive int, got {value!r}")
        return values


_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}
POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                       "intermediate_size", "max_position_embeddings", "type_vocab_size")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def head_dim(config: transformers.PretrainedConfig) -> int:
    return config.hidden_size // config.num_attention_heads


def gelu_approximate(config: transformers.PretrainedConfig) -> str:
    """'none' for BERT's exact erf GELU, 'tanh' for the tanh approximation (DistilBERT names the
    activation ``activation``)."""
    act = getattr(config, "hidden_act", None)
    return "none" if (config.activation if act is None else act) == "gelu" else "tanh"


def ffn_size(config: transformers.PretrainedConfig) -> int:
    """The feed-forward layer's width: intermediate_size (DistilBERT's hidden_dim)."""
    size = getattr(config, "intermediate_size", None)
    return config.hidden_dim if size is None else size


def roberta_config_classes() -> Tuple[type, ...]:
    """The config classes of the RoBERTa family: transformers' RoBERTa code serves all three."""
    return (transformers.RobertaConfig, transformers.XLMRobertaConfig, transformers.CamembertConfig)


def check_supported(config: transformers.PretrainedConfig, expected: Tuple[type, ...] = (transformers.BertConfig,),
                    counts_from_padding: bool = False) -> None:
    """Raise a ValueError naming the first setting the fused encoder cannot run. ``expected``: the
    config classes of the model's family; ``counts_from_padding``: a family whose positions count
    from padding_idx + 1 (RoBERTa), which needs a pad_token_id."""
    if not isinstance(config, expected):
        names = " or ".join(c.__name__ for c in expected)
        raise ValueError(f"expected a transformers {names}, got {type(config).__module__}.{type(config).__name__}")
    kind = type(config).__name__
    for name in POSITIVE_INT_FIELDS:
        value = getattr(config, name)
        if not _positive_int(value):
            raise ValueError(f"{kind}.{name} must be a positive int, got {value!r}")
    size = getattr(config, "embedding_size", None)  # ELECTRA's embeddings width
    if size is not None and not _positive_int(size):
        raise ValueError(f"{kind}.embedding_size must be a positive int, got {size!r}")
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(f"{kind}.hidden_size ({config.hidden_size}) must be divisible by "
                         f"num_attention_heads ({config.num_attention_heads})")
    if config.hidden_act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"{kind}.hidden_act must be one of {SUPPORTED_ACTIVATIONS}, got {config.hidden_act!r}")
    # transformers 4 wrote this field; relative position embeddings are not served by the fused attention.
    position = getattr(config, "position_embedding_type", "absolute")
    if position != "absolute":
        raise ValueError(f"{kind}.position_embedding_type must be 'absolute' (bertfast's attention has no "
                         f"relative position bias), got {position!r}")
    if config.is_decoder or config.add_cross_attention:
        raise ValueError(f"bertfast's models are encoder only: {kind}.is_decoder and add_cross_attention must "
                         f"be False, got is_decoder={config.is_decoder}, "
                         f"add_cross_attention={config.add_cross_attention}")
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
        p = getattr(config, name)
        if not 0.0 <= float(p) < 1.0:
            raise ValueError(f"{kind}.{name} must be in [0, 1), got {p!r}")
    if config.classifier_dropout is not None and not 0.0 <= float(config.classifier_dropout) < 1.0:
        raise ValueError(f"{kind}.classifier_dropout must be None or in [0, 1), got {config.classifier_dropout!r}")
    if config.problem_type not in SUPPORTED_PROBLEM_TYPES:
        raise ValueError(f"{kind}.problem_type must be one of {SUPPORTED_PROBLEM_TYPES}, "
                         f"got {config.problem_type!r}")
    if not float(config.layer_norm_eps) > 0:
        raise ValueError(f"{kind}.layer_norm_eps must be > 0, got {config.layer_norm_eps!r}")
    pad = config.pad_token_id
    if counts_from_padding and not (_positive_int(pad) or pad == 0):
        raise ValueError(f"{kind}.pad_token_id must be an int (positions count from it: padding_idx + 1 is the "
                         f"first token's), got {pad!r}")
    if pad is not None and not 0 <= pad < config.vocab_size:
        raise ValueError(f"{kind}.pad_token_id must be None or in [0, vocab_size={config.vocab_size}), "
                         f"got {pad!r}")
    if counts_from_padding and pad + 1 >= config.max_position_embeddings:
        raise ValueError(f"{kind}.max_position_embeddings ({config.max_position_embeddings}) must exceed "
                         f"pad_token_id + 1 = {pad + 1}, the first token's position")


PRESETS: Dict[str, Dict[str, Any]] = {
    "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "bert-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    "minilm": dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=12, intermediate_size=1536),
    "small": dict(vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                  intermediate_size=1024, max_position_embeddings=512),
    "tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=256, max_position_embeddings=128),
}
