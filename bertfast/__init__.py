"""bertfast: fused Triton and CUDA C++ kernels under a drop-in Hugging Face BERT API.

    from bertfast import BertModel            # instead of: from transformers import BertModel
    model = BertModel.from_pretrained("path/or/hub-id")

    bertfast.register_auto()                  # or: transformers' Auto classes build bertfast models
"""
from bertfast.config import BertConfig
from bertfast.modeling import (BertForMaskedLM, BertForMultipleChoice, BertForPreTraining,
                               BertForQuestionAnswering, BertForSequenceClassification,
                               BertForTokenClassification, BertModel, BertPreTrainedModel, reference_execution)
from bertfast.dispatch import use_backend
from bertfast.hf import register_auto, unregister_auto

__version__ = "0.1.0"
__all__ = ["BertConfig", "BertModel", "BertForPreTraining", "BertForMaskedLM", "BertForSequenceClassification",
           "BertForTokenClassification", "BertForQuestionAnswering", "BertForMultipleChoice",
           "BertPreTrainedModel", "reference_execution", "use_backend", "register_auto", "unregister_auto"]
