"""BertConfig: the Hugging Face BERT configuration as a validated dataclass.

Field names match transformers' ``BertConfig`` so a ``config.json`` written by either side
is read by the other. Unknown keys found in a config.json are kept in ``extra`` and
written back unchanged.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

SUPPORTED_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh")
SUPPORTED_POSITION_EMBEDDINGS = ("absolute",)
SUPPORTED_PROBLEM_TYPES = (None, "regression", "single_label_classification", "multi_label_classification")


@dataclass
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    position_embedding_type: str = "absolute"
    classifier_dropout: Optional[float] = None
    problem_type: Optional[str] = None
    id2label: Dict[int, str] = field(default_factory=lambda: {0: "LABEL_0", 1: "LABEL_1"})
    label2id: Dict[str, int] = field(default_factory=lambda: {"LABEL_0": 0, "LABEL_1": 1})
    tie_word_embeddings: bool = True
    extra: Dict[str, Any] = field(default_factory=dict, repr=False)

    def __init__(self, num_labels: Optional[int] = None, **kwargs: Any):
        known = {f.name for f in dataclasses.fields(self)}
        extra = dict(kwargs.pop("extra", {}) or {})
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            if f.name in kwargs:
                value = kwargs.pop(f.name)
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                value = f.default_factory()  # type: ignore[misc]
            else:
                value = f.default
            setattr(self, f.name, value)
        for key, value in kwargs.items():
            if key not in known:
                extra[key] = value
        self.extra = extra
        # id2label keys arrive as strings from JSON.
        self.id2label = {int(k): v for k, v in self.id2label.items()}
        self.label2id = {k: int(v) for k, v in self.label2id.items()}
        if num_labels is not None:
            self.num_labels = num_labels
        self.validate()

    # -- derived -----------------------------------------------------------------
    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    @num_labels.setter
    def num_labels(self, n: int) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"num_labels must be a positive int, got {n!r}")
        if n != len(self.id2label):
            self.id2label = {i: f"LABEL_{i}" for i in range(n)}
            self.label2id = {v: k for k, v in self.id2label.items()}

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def gelu_approximate(self) -> str:
        """'none' for BERT's exact erf GELU, 'tanh' for the tanh approximation."""
        return "none" if self.hidden_act == "gelu" else "tanh"

    # -- validation --------------------------------------------------------------
    def validate(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"BertConfig.{name} must be a positive int, got {value!r}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            positive(name)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"BertConfig.hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"BertConfig.hidden_act must be one of {SUPPORTED_ACTIVATIONS}, "
                             f"got {self.hidden_act!r}")
        if self.position_embedding_type not in SUPPORTED_POSITION_EMBEDDINGS:
            raise ValueError(
                f"BertConfig.position_embedding_type must be one of {SUPPORTED_POSITION_EMBEDDINGS}, "
                f"got {self.position_embedding_type!r}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            p = getattr(self, name)
            if not 0.0 <= float(p) < 1.0:
                raise ValueError(f"BertConfig.{name} must be in [0, 1), got {p!r}")
        if self.classifier_dropout is not None and not 0.0 <= float(self.classifier_dropout) < 1.0:
            raise ValueError(f"BertConfig.classifier_dropout must be None or in [0, 1), "
                             f"got {self.classifier_dropout!r}")
        if self.problem_type not in SUPPORTED_PROBLEM_TYPES:
            raise ValueError(f"BertConfig.problem_type must be one of {SUPPORTED_PROBLEM_TYPES}, "
                             f"got {self.problem_type!r}")
        if not float(self.layer_norm_eps) > 0:
            raise ValueError(f"BertConfig.layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"BertConfig.pad_token_id must be in [0, vocab_size={self.vocab_size}), "
                             f"got {self.pad_token_id!r}")

    # -- presets -----------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "BertConfig":
        """Named sizes: 'bert-base' and 'bert-large' (the paper's), 'tiny' and 'small' for tests."""
        if name not in PRESETS:
            raise ValueError(f"unknown BertConfig preset {name!r}; expected one of {sorted(PRESETS)}")
        values = dict(PRESETS[name])
        values.update(overrides)
        return cls(**values)

    # -- serialisation -----------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"model_type": "bert", "architectures": None}
        out.update(self.extra)
        for f in dataclasses.fields(self):
            if f.name != "extra":
                out[f.name] = getattr(self, f.name)
        out["id2label"] = {str(k): v for k, v in self.id2label.items()}
        if out.get("architectures") is None:
            out.pop("architectures")
        return out

    def to_json_file(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def from_dict(cls, values: Dict[str, Any]) -> "BertConfig":
        values = dict(values)
        values.pop("model_type", None)
        num_labels = values.pop("num_labels", None)
        if num_labels is not None and "id2label" in values and len(values["id2label"]) == num_labels:
            num_labels = None
        return cls(num_labels=num_labels, **values)

    @classmethod
    def from_json_file(cls, path: str) -> "BertConfig":
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_pretrained(cls, path: str, **overrides: Any) -> "BertConfig":
        """Read ``config.json`` from a local directory (or a path to the file itself)."""
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"expected a config.json in {path!r}; none found (bertfast never "
                                    f"downloads from a hub: pass a local directory)")
        values = json.load(open(file, encoding="utf-8"))
        values.update(overrides)
        return cls.from_dict(values)

    def save_pretrained(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.to_json_file(os.path.join(directory, "config.json"))

    def replace(self, **changes: Any) -> "BertConfig":
        values = self.to_dict()
        values.update(changes)
        return BertConfig.from_dict(values)


PRESETS: Dict[str, Dict[str, Any]] = {
    "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "bert-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    "small": dict(vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                  intermediate_size=1024, max_position_embeddings=512),
    "tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=256, max_position_embeddings=128),
}
