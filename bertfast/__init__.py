"""bertfast: fused Triton and CUDA C++ kernels under a drop-in Hugging Face BERT API.

    from bertfast import BertModel            # instead of: from transformers import BertModel
    model = BertModel.from_pretrained("path/or/hub-id")

    bertfast.register_auto()                  # or: transformers' Auto classes build bertfast models

The names below are imported on first use (PEP 562), so tools inside the package (the CLI's
--help, the GPU check) start without torch and transformers, and say what is missing instead of
failing at ``import bertfast``.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_WHERE = {
    "BertConfig": "bertfast.model.config",
    **{name: "bertfast.model.modeling" for name in ("BertModel", "BertPreTrainedModel", "reference_execution")},
    **{name: "bertfast.model.task_models" for name in (
        "BertForPreTraining", "BertForMaskedLM", "BertForSequenceClassification", "BertForTokenClassification",
        "BertForQuestionAnswering", "BertForMultipleChoice")},
    **{f"{prefix}{suffix}": "bertfast.model.roberta" for prefix in ("Roberta", "XLMRoberta", "Camembert")
       for suffix in ("PreTrainedModel", "Model", "ForMaskedLM", "ForSequenceClassification",
                      "ForTokenClassification", "ForQuestionAnswering", "ForMultipleChoice")},
    **{f"Electra{suffix}": "bertfast.model.electra" for suffix in (
        "PreTrainedModel", "Model", "ForPreTraining", "ForMaskedLM", "ForSequenceClassification",
        "ForTokenClassification", "ForQuestionAnswering", "ForMultipleChoice")},
    **{f"DistilBert{suffix}": "bertfast.model.distilbert" for suffix in (
        "PreTrainedModel", "Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification",
        "ForQuestionAnswering", "ForMultipleChoice")},
    "pack_batch": "bertfast.padding",
    "unpadded": "bertfast.sentence",
    "use_backend": "bertfast.dispatch",
    "register_auto": "bertfast.hf",
    "unregister_auto": "bertfast.hf",
}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'bertfast' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
