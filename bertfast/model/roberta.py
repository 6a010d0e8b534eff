"""RoBERTa, XLM-R and CamemBERT on the fused encoder: transformers' RoBERTa code serves the three,
and so does this module.

The encoder is BERT's (the same modules and state-dict keys under ``roberta.``), with RoBERTa's
positions: counted from padding_idx + 1 within each sequence, the padding tokens at padding_idx
(``model_inputs.counted_positions``), packed sequences included; given position_ids that number a
real token below padding_idx + 1 are an error. The heads are RoBERTa's modules (``lm_head``, the
classification head on each sequence's first real token) over the task mixins of
``bertfast.model.task_models``. Each family member's classes subclass its own transformers
PreTrainedModel (``XLMRobertaPreTrainedModel`` for XLM-R: loading, saving and ``base_model_prefix``
are transformers') and take its config class; the three families' configs are interchangeable.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import transformers
from transformers.models.camembert import modeling_camembert as hf_camembert
from transformers.models.roberta import modeling_roberta as hf_roberta
from transformers.models.xlm_roberta import modeling_xlm_roberta as hf_xlm_roberta

from bertfast.model.config import roberta_config_classes
from bertfast.model.mlm_heads import MLMHead
from bertfast.model.modeling import (BertEmbeddings, BertModelOutput, EncoderModel, FastPreTrainedModel, Tensor,
                                     _dense_gelu, _layer_norm)
from bertfast.model.task_models import (MaskedLMModel, MultipleChoiceModel, QuestionAnsweringModel,
                                        SequenceClassificationModel, TokenClassificationModel, _encoder,
                                        classifier_dropout)


# ================================================================= modules
class RobertaEmbeddings(BertEmbeddings):
    """BERT's embeddings with RoBERTa's positions (from padding_idx + 1); the position table's
    padding_idx row is padding's, as in transformers."""

    def __init__(self, config):
        super().__init__(config)
        self.position_padding_idx = config.pad_token_id
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                padding_idx=config.pad_token_id)


class RobertaLMHead(MLMHead):
    """LayerNorm(GELU(dense(h))) (GELU exact whatever hidden_act, as transformers'), then the decoder."""

    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, h: Tensor) -> Tensor:
        """Full logits [..., V]."""
        return self.decoder(_layer_norm(self.layer_norm, _dense_gelu(self.dense, h, "none")[0]))

    def parts(self):
        return self.dense, self.layer_norm, self.decoder, "none"


class RobertaClassificationHead(nn.Module):
    """dropout, dense, tanh, dropout, out_proj on each sequence's first real token [B, H] (transformers'
    reads position 0 of [B, S, H]: the same token unless the row is left-padded)."""

    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = classifier_dropout(config)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, first_tokens: Tensor) -> Tensor:
        x = torch.tanh(self.dense(self.dropout(first_tokens)))
        return self.out_proj(self.dropout(x))


# ================================================================= what the three families share
class RobertaEncoderModel(EncoderModel):
    embeddings_class = RobertaEmbeddings
    _no_split_modules = ["RobertaEmbeddings", "BertLayer"]


class RobertaMaskedLM(MaskedLMModel):
    """ForMaskedLM: the encoder and ``lm_head`` (``MaskedLMModel``'s forward)."""

    _tied_weights_keys = {"lm_head.decoder.weight": "roberta.embeddings.word_embeddings.weight",
                          "lm_head.decoder.bias": "lm_head.bias"}

    def __init__(self, config):
        super().__init__(config)
        _encoder(self, config, add_pooling_layer=False)
        self.lm_head = RobertaLMHead(config)
        self.post_init()

    @property
    def mlm_head(self) -> MLMHead:
        return self.lm_head


class RobertaSequenceClassification(SequenceClassificationModel):
    """ForSequenceClassification: no pooler; the classification head reads each first real token."""

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        _encoder(self, config, add_pooling_layer=False)
        self.classifier = RobertaClassificationHead(config)
        self.post_init()

    def sequence_logits(self, encoded: BertModelOutput) -> Tensor:
        return self.classifier(encoded.first_tokens)


class RobertaMultipleChoice(MultipleChoiceModel):
    def add_choice_head(self, config) -> None:
        self.dropout = nn.Dropout(config.hidden_dropout_prob)  # transformers' RoBERTa ignores classifier_dropout here
        self.classifier = nn.Linear(config.hidden_size, 1)


class _RobertaFamily(FastPreTrainedModel):
    supported_configs = roberta_config_classes()
    counts_from_padding = True


# ================================================================= RoBERTa
class RobertaPreTrainedModel(_RobertaFamily, hf_roberta.RobertaPreTrainedModel):
    config_class = transformers.RobertaConfig


class RobertaModel(RobertaEncoderModel, RobertaPreTrainedModel):
    """transformers' RobertaModel, fused."""


class RobertaForMaskedLM(RobertaMaskedLM, RobertaPreTrainedModel):
    pass


class RobertaForSequenceClassification(RobertaSequenceClassification, RobertaPreTrainedModel):
    pass


class RobertaForTokenClassification(TokenClassificationModel, RobertaPreTrainedModel):
    pass


class RobertaForQuestionAnswering(QuestionAnsweringModel, RobertaPreTrainedModel):
    pass


class RobertaForMultipleChoice(RobertaMultipleChoice, RobertaPreTrainedModel):
    pass


# ================================================================= XLM-R
class XLMRobertaPreTrainedModel(_RobertaFamily, hf_xlm_roberta.XLMRobertaPreTrainedModel):
    config_class = transformers.XLMRobertaConfig


class XLMRobertaModel(RobertaEncoderModel, XLMRobertaPreTrainedModel):
    """transformers' XLMRobertaModel, fused."""


class XLMRobertaForMaskedLM(RobertaMaskedLM, XLMRobertaPreTrainedModel):
    pass


class XLMRobertaForSequenceClassification(RobertaSequenceClassification, XLMRobertaPreTrainedModel):
    pass


class XLMRobertaForTokenClassification(TokenClassificationModel, XLMRobertaPreTrainedModel):
    pass


class XLMRobertaForQuestionAnswering(QuestionAnsweringModel, XLMRobertaPreTrainedModel):
    pass


class XLMRobertaForMultipleChoice(RobertaMultipleChoice, XLMRobertaPreTrainedModel):
    pass


# ================================================================= CamemBERT
class CamembertPreTrainedModel(_RobertaFamily, hf_camembert.CamembertPreTrainedModel):
    config_class = transformers.CamembertConfig


class CamembertModel(RobertaEncoderModel, CamembertPreTrainedModel):
    """transformers' CamembertModel, fused."""


class CamembertForMaskedLM(RobertaMaskedLM, CamembertPreTrainedModel):
    pass


class CamembertForSequenceClassification(RobertaSequenceClassification, CamembertPreTrainedModel):
    pass


class CamembertForTokenClassification(TokenClassificationModel, CamembertPreTrainedModel):
    pass


class CamembertForQuestionAnswering(QuestionAnsweringModel, CamembertPreTrainedModel):
    pass


class CamembertForMultipleChoice(RobertaMultipleChoice, CamembertPreTrainedModel):
    pass


RobertaPreTrainedModel.encoder_class = RobertaModel
XLMRobertaPreTrainedModel.encoder_class = XLMRobertaModel
CamembertPreTrainedModel.encoder_class = CamembertModel

# The classes by config class and transformers' Auto class (bertfast.hf.register_auto).
AUTO_CLASSES = {
    f"{prefix}Config": {"AutoModel": f"{prefix}Model", "AutoModelForMaskedLM": f"{prefix}ForMaskedLM",
                        "AutoModelForSequenceClassification": f"{prefix}ForSequenceClassification",
                        "AutoModelForTokenClassification": f"{prefix}ForTokenClassification",
                        "AutoModelForQuestionAnswering": f"{prefix}ForQuestionAnswering",
                        "AutoModelForMultipleChoice": f"{prefix}ForMultipleChoice"}
    for prefix in ("Roberta", "XLMRoberta", "Camembert")}
MODEL_CLASSES = {name: globals()[name] for table in AUTO_CLASSES.values() for name in table.values()}
