"""BERT with its task heads: pre-training (MLM + NSP), masked LM, sequence and token
classification, question answering, multiple choice. Each is a transformers model (the same class
names, state-dict keys, forward keywords and outputs as transformers' BERT) over
``bertfast.model.modeling.BertModel``; the MLM loss runs the fused head at labelled positions only.

The heads' forwards are mixins (``MaskedLMModel``, ``TokenClassificationModel``, ...) over a family's
encoder, reached as ``self.base_model`` (``self.bert``, ``self.roberta``): the other families' classes
(``bertfast.model.roberta``, ``bertfast.model.electra``) take them with their own encoder and head
modules.
"""
from __future__ import annotations

from typing import Optional

import torch.nn as nn
from transformers.modeling_outputs import (MultipleChoiceModelOutput, QuestionAnsweringModelOutput,
                                           SequenceClassifierOutput, TokenClassifierOutput)

from bertfast import ops, reference
from bertfast.model import losses, model_inputs
from bertfast.model.config import BertConfig
from bertfast.contract import IGNORE_INDEX
from bertfast.model.mlm_heads import BertOnlyMLMHead, BertPreTrainingHeads, MLMHead
from bertfast.model.modeling import (BertForPreTrainingOutput, BertMaskedLMOutput, BertModel, BertModelOutput,
                                     BertPreTrainedModel, Tensor, _reference, _with_extras)
from bertfast.ops.mlm_head_loss import check_max_predictions_per_seq, masked_positions


def _return(model: BertPreTrainedModel, result, return_dict: Optional[bool]):
    return_dict = model.config.return_dict if return_dict is None else return_dict
    return result if return_dict else result.to_tuple()


def _full_logits_with_labels(model: BertPreTrainedModel, return_logits: Optional[bool],
                             return_dict: Optional[bool]) -> bool:
    """With labels, whether the MLM head also returns full logits [B, S, V]: as asked, else when
    transformers' callers expect them (evaluation, e.g. Trainer's metrics on the logits; a tuple
    unpacked as (loss, logits)). Training with return_dict keeps the masked-position-only head."""
    if return_logits is not None:
        return bool(return_logits)
    return_dict = model.config.return_dict if return_dict is None else return_dict
    return not model.training or not return_dict


class MLMHeadModel:
    """What the classes with an MLM head share (a mixin before the family's PreTrainedModel): the
    head (``mlm_head``: BERT's ``cls.predictions``, RoBERTa's ``lm_head``, ELECTRA's generator modules
    seen as one), its accessors, logits and loss."""

    @property
    def mlm_head(self) -> MLMHead:
        raise NotImplementedError

    def get_output_embeddings(self) -> nn.Module:
        return self.mlm_head.decoder

    def set_output_embeddings(self, new_embeddings: nn.Module) -> None:
        self.mlm_head.decoder = new_embeddings
        self.mlm_head.bias = new_embeddings.bias

    def _mlm_logits(self, sequence: Tensor) -> Tensor:
        head = self.mlm_head
        return reference.mlm_head(head, sequence) if _reference(self.base_model) else head(sequence)

    def _mlm_loss(self, encoded: BertModelOutput, labels: Tensor, attention_mask: Optional[Tensor],
                  max_predictions_per_seq: Optional[int], logits: Optional[Tensor] = None) -> ops.MLMHeadLoss:
        """Mean CE over labelled real tokens (labels at padded positions are ignored on every path);
        from ``logits`` when the full logits were made anyway (the head then runs once, as in
        transformers), else from the head at labelled positions only."""
        head, sequence = self.mlm_head, encoded.last_hidden_state
        if labels.shape != sequence.shape[:2]:
            raise ValueError(f"labels: expected shape {tuple(sequence.shape[:2])}, got {tuple(labels.shape)}")
        model_inputs.check_labels("labels", labels, head.decoder.out_features)
        check_max_predictions_per_seq(max_predictions_per_seq)  # on every path, not only the fused head's
        if attention_mask is not None:
            labels = labels.masked_fill(attention_mask == 0, IGNORE_INDEX)
        if logits is not None:
            if max_predictions_per_seq is not None:  # the limit holds whichever head computes the loss
                masked_positions(labels, max_predictions_per_seq)
            return ops.MLMHeadLoss(*reference.classification_loss(logits, labels))
        if _reference(self.base_model):
            return ops.MLMHeadLoss(*reference.classification_loss(reference.mlm_head(head, sequence), labels))
        return head.loss(encoded, labels, max_predictions_per_seq)


_BERT_TIED = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
              "cls.predictions.decoder.bias": "cls.predictions.bias"}


class BertForPreTraining(MLMHeadModel, BertPreTrainedModel):
    """BERT with the MLM and NSP heads. With ``labels`` in training the MLM head runs only at
    labelled positions and ``prediction_logits`` is None; in evaluation, with return_dict=False or
    with ``return_logits=True`` it returns full logits too (``return_logits=False``: never).
    ``max_predictions_per_seq`` (a call argument) gives the MLM head a static shape."""

    _tied_weights_keys = _BERT_TIED

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.post_init()

    @property
    def mlm_head(self) -> MLMHead:
        return self.cls.predictions

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, next_sentence_label=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, max_predictions_per_seq: Optional[int] = None,
                return_logits: Optional[bool] = None, **kwargs):
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                        output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                        return_dict=True, **kwargs)
        sequence, pooled = out.last_hidden_state, out.pooler_output
        nsp_logits = self.cls.seq_relationship(pooled)
        prediction_logits = mlm = nsp_loss = None
        if labels is None or _full_logits_with_labels(self, return_logits, return_dict):
            prediction_logits = self._mlm_logits(sequence)
        if labels is not None:
            mlm = self._mlm_loss(out, labels, attention_mask, max_predictions_per_seq, prediction_logits)
        if next_sentence_label is not None:
            model_inputs.check_labels("next_sentence_label", next_sentence_label, 2)
            nsp_loss = losses.cross_entropy(nsp_logits.view(-1, 2), next_sentence_label.view(-1))
        loss = mlm.loss + nsp_loss if mlm is not None and nsp_loss is not None else None
        result = BertForPreTrainingOutput(loss=loss, prediction_logits=prediction_logits,
                                          seq_relationship_logits=nsp_logits, hidden_states=out.hidden_states,
                                          attentions=out.attentions)
        if mlm is not None:
            _with_extras(result, mlm_loss=mlm.loss, mlm_num_correct=mlm.num_correct,
                         mlm_num_predictions=mlm.num_predictions)
        _with_extras(result, nsp_loss=nsp_loss)
        return _return(self, result, return_dict)


class MaskedLMModel(MLMHeadModel):
    """A family's ForMaskedLM forward. With ``labels`` in training the head runs only at labelled
    positions and ``logits`` is None; in evaluation, with return_dict=False or with
    ``return_logits=True`` it returns full logits too (``return_logits=False``: never); without
    labels, full logits."""

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, max_predictions_per_seq: Optional[int] = None,
                return_logits: Optional[bool] = None, **kwargs):
        out = self.base_model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                              position_ids=position_ids, inputs_embeds=inputs_embeds,
                              output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                              return_dict=True, **kwargs)
        if labels is not None:
            logits = (self._mlm_logits(out.last_hidden_state)
                      if _full_logits_with_labels(self, return_logits, return_dict) else None)
            mlm = self._mlm_loss(out, labels, attention_mask, max_predictions_per_seq, logits)
            result = BertMaskedLMOutput(loss=mlm.loss, logits=logits, hidden_states=out.hidden_states,
                                        attentions=out.attentions)
            _with_extras(result, mlm_num_correct=mlm.num_correct, mlm_num_predictions=mlm.num_predictions)
        else:
            logits = self._mlm_logits(out.last_hidden_state)
            result = BertMaskedLMOutput(logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)
        return _return(self, result, return_dict)


class BertForMaskedLM(MaskedLMModel, BertPreTrainedModel):
    """BERT with the MLM head (``MaskedLMModel``)."""

    _tied_weights_keys = _BERT_TIED

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self.post_init()

    @property
    def mlm_head(self) -> MLMHead:
        return self.cls.predictions


def classifier_dropout(config) -> nn.Dropout:
    """classifier_dropout, else hidden_dropout_prob (DistilBERT, which has neither: its dropout)."""
    p = getattr(config, "classifier_dropout", None)
    p = getattr(config, "hidden_dropout_prob", None) if p is None else p
    return nn.Dropout(config.dropout if p is None else p)


def _encoder(model, config, add_pooling_layer: bool) -> None:
    """The family's encoder (its PreTrainedModel's ``encoder_class``) as ``model.<base_model_prefix>``."""
    setattr(model, model.base_model_prefix, model.encoder_class(config, add_pooling_layer=add_pooling_layer))


class SequenceClassificationModel:
    """A family's ForSequenceClassification forward; ``sequence_logits`` is the family's head."""

    def sequence_logits(self, encoded: BertModelOutput) -> Tensor:
        raise NotImplementedError

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, **kwargs):
        out = self.base_model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                              position_ids=position_ids, inputs_embeds=inputs_embeds,
                              output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                              return_dict=True, **kwargs)
        logits = self.sequence_logits(out)
        loss = None
        if labels is not None:
            loss = losses.sequence_classification(self, logits, labels, packed=out.packed is not None)
        result = SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                          attentions=out.attentions)
        return _return(self, result, return_dict)


class BertForSequenceClassification(SequenceClassificationModel, BertPreTrainedModel):
    """The classifier reads the pooler's output: each sequence's first real token, pooled."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config)
        self.dropout = classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def sequence_logits(self, encoded: BertModelOutput) -> Tensor:
        return self.classifier(self.dropout(encoded.pooler_output))


class TokenClassificationModel:
    """A family's ForTokenClassification. Labels at padded positions are ignored (bertfast's padded
    rows are zeros, never encoded)."""

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        _encoder(self, config, add_pooling_layer=False)
        self.dropout = classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, **kwargs):
        out = self.base_model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                              position_ids=position_ids, inputs_embeds=inputs_embeds,
                              output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                              return_dict=True, **kwargs)
        logits = self.classifier(self.dropout(out.last_hidden_state))
        loss = None
        if labels is not None:
            model_inputs.check_labels("labels", labels, self.num_labels)
            if attention_mask is not None:
                labels = labels.masked_fill(attention_mask == 0, IGNORE_INDEX)
            loss = losses.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        result = TokenClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                       attentions=out.attentions)
        return _return(self, result, return_dict)


class BertForTokenClassification(TokenClassificationModel, BertPreTrainedModel):
    """BERT with a token classifier (``TokenClassificationModel``)."""


class QuestionAnsweringModel:
    """A family's ForQuestionAnswering. The span softmax runs over every position, padded ones
    included, as in transformers; bertfast's padded positions score the classifier bias alone (their
    hidden states are zeros). Packed inputs give logits [1, T] and take one start and end position
    per sequence, counted from its first token; there each softmax runs over its own sequence
    (``losses.packed_span``)."""

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        _encoder(self, config, add_pooling_layer=False)
        self.add_span_head(config)
        self.post_init()

    def add_span_head(self, config) -> None:
        """The modules that score span starts and ends (DistilBERT's adds a dropout before them)."""
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)

    def span_logits(self, hidden: Tensor) -> Tensor:
        """[B, S, H] -> [B, S, 2]."""
        return self.qa_outputs(hidden)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, start_positions=None, end_positions=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, **kwargs):
        out = self.base_model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                              position_ids=position_ids, inputs_embeds=inputs_embeds,
                              output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                              return_dict=True, **kwargs)
        logits = self.span_logits(out.last_hidden_state)
        start_logits, end_logits = (t.squeeze(-1).contiguous() for t in logits.split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None and out.packed is not None:
            loss = losses.packed_span(start_logits, end_logits, start_positions, end_positions,
                                      out.packed.cu_seqlens, out.packed.max_seqlen)
        elif start_positions is not None and end_positions is not None:
            loss = losses.span(start_logits, end_logits, start_positions, end_positions)
        result = QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits,
                                              hidden_states=out.hidden_states, attentions=out.attentions)
        return _return(self, result, return_dict)


class BertForQuestionAnswering(QuestionAnsweringModel, BertPreTrainedModel):
    """BERT with a span head (``QuestionAnsweringModel``)."""


class MultipleChoiceModel:
    """A family's ForMultipleChoice: inputs [B, C, S], each choice scored (``choice_scores``: BERT's and
    RoBERTa's from the pooler's output).
    Packed inputs ([1, T] with cu_seq_lens_q, as ``padding.pack_batch`` makes them) hold each
    example's C choices in C consecutive slots and need ``num_choices=C``: the logits are then
    [slots / C, C], labels one per group of slots (-100 for the groups without one)."""

    pooled = True  # the encoder has a pooler (ELECTRA's has none)

    def __init__(self, config):
        super().__init__(config)
        _encoder(self, config, add_pooling_layer=self.pooled)
        self.add_choice_head(config)
        self.post_init()

    def add_choice_head(self, config) -> None:
        """The modules that score a choice: BERT's dropout and classifier on the pooler's output."""
        self.dropout = classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, 1)

    def choice_scores(self, encoded: BertModelOutput) -> Tensor:
        """A score [slots, 1] per encoded choice."""
        return self.classifier(self.dropout(encoded.pooler_output))

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, num_choices: Optional[int] = None, **kwargs):
        """Inputs [B, C, S] (C choices); logits [B, C]."""
        cu = kwargs.get("cu_seq_lens_q")
        if cu is not None:
            slots = cu.numel() - 1 if isinstance(cu, Tensor) else None  # not a tensor: BertModel says so
            if (isinstance(num_choices, bool) or not isinstance(num_choices, int) or num_choices < 1
                    or (slots is not None and slots % num_choices)):
                raise ValueError(f"{type(self).__name__}: packed sequences need num_choices, the choices per example "
                                 f"(a positive int dividing the {slots} slots), got {num_choices!r}")
            out = self.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                  token_type_ids=token_type_ids, position_ids=position_ids, inputs_embeds=inputs_embeds,
                                  output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                                  return_dict=True, **kwargs)
        else:
            source = input_ids if input_ids is not None else inputs_embeds
            if source is None or source.dim() < 3 or source.shape[1] == 0:
                raise ValueError(f"{type(self).__name__}: expected inputs of shape [batch, num_choices >= 1, "
                                 f"seq_len], got {None if source is None else tuple(source.shape)}")
            if num_choices is not None and num_choices != source.shape[1]:
                raise ValueError(f"{type(self).__name__}: num_choices={num_choices!r}, but the inputs hold "
                                 f"{source.shape[1]} choices")
            num_choices = source.shape[1]
            flat = lambda t, k=1: None if t is None else t.reshape(-1, *t.shape[-k:])  # noqa: E731  (as transformers)
            out = self.base_model(input_ids=flat(input_ids), attention_mask=flat(attention_mask),
                                  token_type_ids=flat(token_type_ids), position_ids=flat(position_ids),
                                  inputs_embeds=flat(inputs_embeds, 2), output_attentions=output_attentions,
                                  output_hidden_states=output_hidden_states, return_dict=True, **kwargs)
        logits = self.choice_scores(out).view(-1, num_choices)
        loss = None
        if labels is not None:
            model_inputs.check_labels("labels", labels, num_choices)
            loss = losses.cross_entropy(logits, labels)
        result = MultipleChoiceModelOutput(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                           attentions=out.attentions)
        return _return(self, result, return_dict)




class BertForMultipleChoice(MultipleChoiceModel, BertPreTrainedModel):
    """BERT with a multiple-choice head (``MultipleChoiceModel``)."""


MODEL_CLASSES = {cls.__name__: cls for cls in (BertModel, BertForPreTraining, BertForMaskedLM,
                                               BertForSequenceClassification, BertForTokenClassification,
                                               BertForQuestionAnswering, BertForMultipleChoice)}
