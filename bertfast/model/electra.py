"""ELECTRA on the fused encoder: the discriminator (ElectraForPreTraining), the generator
(ElectraForMaskedLM) and the fine-tuning heads, with transformers' module names and state-dict keys.

The encoder is BERT's with embeddings of ``embedding_size`` and, when that is not the hidden size,
``electra.embeddings_project`` between them and the first layer (``EncoderModel``); no pooler. The
heads are transformers' own ELECTRA modules (discriminator and generator predictions, the
classification head, the sequence summary), reading each sequence's first real token where
transformers reads position 0; the generator's MLM loss runs the fused head at labelled positions
only, as BERT's does.
"""
from __future__ import annotations

import torch.nn as nn
import transformers
from transformers.models.electra import modeling_electra as hf_electra

from bertfast.model import losses
from bertfast.model.mlm_heads import MLMHeadView
from bertfast.model.modeling import BertEmbeddings, BertModelOutput, EncoderModel, FastPreTrainedModel, Tensor
from bertfast.model.task_models import (MaskedLMModel, MultipleChoiceModel, QuestionAnsweringModel,
                                        SequenceClassificationModel, TokenClassificationModel, _encoder, _return)


class ElectraEmbeddings(BertEmbeddings):
    """BERT's embeddings at ELECTRA's embedding_size."""

    def __init__(self, config):
        super().__init__(config, config.embedding_size)


class ElectraPreTrainedModel(FastPreTrainedModel, hf_electra.ElectraPreTrainedModel):
    config_class = transformers.ElectraConfig
    supported_configs = (transformers.ElectraConfig,)


class ElectraModel(EncoderModel, ElectraPreTrainedModel):
    """transformers' ElectraModel, fused (no pooler: ``pooler_output`` is None)."""

    embeddings_class = ElectraEmbeddings
    _no_split_modules = ["ElectraEmbeddings", "BertLayer"]

    def __init__(self, config, add_pooling_layer: bool = False):
        if add_pooling_layer:
            raise ValueError("ElectraModel has no pooler (transformers' has none): add_pooling_layer must be False")
        super().__init__(config, add_pooling_layer=False)


ElectraPreTrainedModel.encoder_class = ElectraModel


def _first_tokens(encoded: BertModelOutput) -> Tensor:
    """[B, 1, H]: each sequence's first real token, where transformers' heads read position 0."""
    return encoded.first_tokens[:, None]


class ElectraForPreTraining(ElectraPreTrainedModel):
    """The discriminator: a replaced-token logit per position. The loss is transformers' (binary
    cross-entropy over the attention mask's tokens), 0 when there are none."""

    def __init__(self, config):
        super().__init__(config)
        self.electra = ElectraModel(config)
        self.discriminator_predictions = hf_electra.ElectraDiscriminatorPredictions(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, **kwargs):
        out = self.electra(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                           output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                           return_dict=True, **kwargs)
        logits = self.discriminator_predictions(out.last_hidden_state)  # [B, S]
        loss = None
        if labels is not None:
            if labels.shape != logits.shape:
                raise ValueError(f"labels: expected shape {tuple(logits.shape)} (1 = replaced), "
                                 f"got {tuple(labels.shape)}")
            loss = losses.replaced_tokens(logits, labels, attention_mask)
        result = hf_electra.ElectraForPreTrainingOutput(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                                        attentions=out.attentions)
        return _return(self, result, return_dict)


class _GeneratorHead(MLMHeadView):
    """ElectraForMaskedLM's generator_predictions then generator_lm_head (the model's modules, under
    transformers' keys) as one MLM head."""

    def parts(self):
        predictions = self.model.generator_predictions
        return predictions.dense, predictions.LayerNorm, self.model.generator_lm_head, "none"  # exact GELU

    def modules(self):
        return self.model.generator_predictions, self.model.generator_lm_head

    def __call__(self, h: Tensor) -> Tensor:
        return self.model.generator_lm_head(self.model.generator_predictions(h))


class ElectraForMaskedLM(MaskedLMModel, ElectraPreTrainedModel):
    """The generator (``MaskedLMModel``'s forward): generator_lm_head tied to the word embeddings."""

    _tied_weights_keys = {"generator_lm_head.weight": "electra.embeddings.word_embeddings.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.electra = ElectraModel(config)
        self.generator_predictions = hf_electra.ElectraGeneratorPredictions(config)
        self.generator_lm_head = nn.Linear(config.embedding_size, config.vocab_size)
        self.post_init()

    @property
    def mlm_head(self) -> _GeneratorHead:
        return _GeneratorHead(self)

    def get_output_embeddings(self) -> nn.Module:
        return self.generator_lm_head

    def set_output_embeddings(self, new_embeddings: nn.Module) -> None:
        self.generator_lm_head = new_embeddings


class ElectraForSequenceClassification(SequenceClassificationModel, ElectraPreTrainedModel):
    """transformers' classification head (GELU between its dense layers) on each first real token."""

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        _encoder(self, config, add_pooling_layer=False)
        self.classifier = hf_electra.ElectraClassificationHead(config)
        self.post_init()

    def sequence_logits(self, encoded: BertModelOutput) -> Tensor:
        return self.classifier(_first_tokens(encoded))


class ElectraForTokenClassification(TokenClassificationModel, ElectraPreTrainedModel):
    pass


class ElectraForQuestionAnswering(QuestionAnsweringModel, ElectraPreTrainedModel):
    pass


class ElectraForMultipleChoice(MultipleChoiceModel, ElectraPreTrainedModel):
    """Each choice scored from its sequence summary (transformers' module) of the first real token;
    summary_type "first" only (the config's default: "last" and "mean" read padding in transformers)."""

    pooled = False

    def add_choice_head(self, config) -> None:
        if getattr(config, "summary_type", "first") != "first":
            raise ValueError(f"ElectraForMultipleChoice: ElectraConfig.summary_type must be 'first' (the "
                             f"default; bertfast summarises each choice's first real token), "
                             f"got {config.summary_type!r}")
        self.sequence_summary = hf_electra.ElectraSequenceSummary(config)
        self.classifier = nn.Linear(config.hidden_size, 1)

    def choice_scores(self, encoded: BertModelOutput) -> Tensor:
        return self.classifier(self.sequence_summary(_first_tokens(encoded)))


MODEL_CLASSES = {cls.__name__: cls for cls in (
    ElectraModel, ElectraForPreTraining, ElectraForMaskedLM, ElectraForSequenceClassification,
    ElectraForTokenClassification, ElectraForQuestionAnswering, ElectraForMultipleChoice)}
# The classes by config class and transformers' Auto class (bertfast.hf.register_auto).
AUTO_CLASSES = {"ElectraConfig": {
    "AutoModel": "ElectraModel", "AutoModelForPreTraining": "ElectraForPreTraining",
    "AutoModelForMaskedLM": "ElectraForMaskedLM",
    "AutoModelForSequenceClassification": "ElectraForSequenceClassification",
    "AutoModelForTokenClassification": "ElectraForTokenClassification",
    "AutoModelForQuestionAnswering": "ElectraForQuestionAnswering",
    "AutoModelForMultipleChoice": "ElectraForMultipleChoice"}}
