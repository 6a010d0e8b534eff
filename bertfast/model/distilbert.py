"""DistilBERT on the fused encoder, with transformers' module names and state-dict keys.

DistilBERT is BERT's layer under other names and without token types: ``attention.q_lin``,
``k_lin``, ``v_lin``, ``out_lin`` (no dropout after it), ``sa_layer_norm``, ``ffn.lin1`` / ``lin2``
/ ``dropout``, ``output_layer_norm``, the layers under ``transformer``, every LayerNorm at eps
1e-12. Its blocks run the same fused ops as BERT's (``dense_norm``, ``_ffn``, the attention through
``BertSelfAttention``'s methods, which read q_lin, k_lin and v_lin as query, key and value); the
embeddings run the fused embeddings op with a zero token-type row. The heads are transformers':
``vocab_transform`` / ``vocab_layer_norm`` / ``vocab_projector`` (the fused MLM head at labelled
positions), ``pre_classifier`` then ReLU on each sequence's first real token, ``qa_outputs`` after
the QA dropout.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.distilbert import modeling_distilbert as hf_distilbert

from bertfast import ops
from bertfast.model.config import SUPPORTED_ACTIVATIONS, SUPPORTED_PROBLEM_TYPES, gelu_approximate
from bertfast.model.layout import Layout
from bertfast.model.mlm_heads import MLMHeadView
from bertfast.model.modeling import (BertModelOutput, BertSelfAttention, EncoderModel, FastPreTrainedModel,
                                     LayerRoles, Tensor, _activation_dtype, _dense_gelu, _ffn, _layer_norm, _residual,
                                     dense_norm, fused_norm, fusable, hooked)
from bertfast.model.task_models import (MaskedLMModel, MultipleChoiceModel, QuestionAnsweringModel,
                                        SequenceClassificationModel, TokenClassificationModel, _encoder)
from bertfast import reference

EPS = 1e-12  # DistilBERT's LayerNorms, whatever the config says


def check_config(config: Any) -> None:
    """A ValueError naming the first DistilBertConfig setting the fused encoder does not serve."""
    if not isinstance(config, transformers.DistilBertConfig):
        raise ValueError(f"expected a transformers DistilBertConfig, got {type(config).__module__}."
                         f"{type(config).__name__}")
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "max_position_embeddings"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"DistilBertConfig.{name} must be a positive int, got {value!r}")
    if config.dim % config.n_heads:
        raise ValueError(f"DistilBertConfig.dim ({config.dim}) must be divisible by n_heads ({config.n_heads})")
    if config.activation not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"DistilBertConfig.activation must be one of {SUPPORTED_ACTIVATIONS}, "
                         f"got {config.activation!r}")
    for name in ("dropout", "attention_dropout", "qa_dropout", "seq_classif_dropout"):
        p = getattr(config, name)
        if not 0.0 <= float(p) < 1.0:
            raise ValueError(f"DistilBertConfig.{name} must be in [0, 1), got {p!r}")
    if config.problem_type not in SUPPORTED_PROBLEM_TYPES:
        raise ValueError(f"DistilBertConfig.problem_type must be one of {SUPPORTED_PROBLEM_TYPES}, "
                         f"got {config.problem_type!r}")
    pad = config.pad_token_id
    if pad is not None and not 0 <= pad < config.vocab_size:
        raise ValueError(f"DistilBertConfig.pad_token_id must be None or in [0, vocab_size={config.vocab_size}), "
                         f"got {pad!r}")


# ================================================================= modules
class DistilBertEmbeddings(nn.Module):
    """word and position embeddings, LayerNorm, dropout (no token types: the fused op reads a zero row)."""

    position_padding_idx: Optional[int] = None  # positions count from 0

    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.dim, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.dim)
        # Marked for _init_weights, which transformers calls on modules with parameters of their own only.
        self.position_embeddings.sinusoidal = bool(config.sinusoidal_pos_embds)
        self.LayerNorm = nn.LayerNorm(config.dim, eps=EPS)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids: Optional[Tensor], position_ids: Tensor, token_type_ids: Tensor,
                inputs_embeds: Optional[Tensor]) -> Tensor:
        ln = self.LayerNorm
        if inputs_embeds is None and fusable(self.word_embeddings, self.position_embeddings, ln, self.dropout):
            word = self.word_embeddings.weight
            dtype = _activation_dtype(word.dtype, position_ids.device)
            p = self.dropout.p if self.training else 0.0
            no_types = word.new_zeros((1, word.shape[1]))  # the fused op's token-type table: one zero row
            return ops.embeddings(input_ids, position_ids, torch.zeros_like(position_ids), word,
                                  self.position_embeddings.weight, no_types, ln.weight, ln.bias, ln.eps, p, dtype)
        words = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        return self.dropout(_layer_norm(ln, words + self.position_embeddings(position_ids)))


class DistilBertSelfAttention(BertSelfAttention):
    """q_lin, k_lin, v_lin (read as query, key, value by BertSelfAttention's methods), the fused
    attention, then out_lin; the attention dropout on the probabilities only."""

    def __init__(self, config):
        nn.Module.__init__(self)
        self.num_attention_heads = config.n_heads
        self.attention_head_size = config.dim // config.n_heads
        self.q_lin = nn.Linear(config.dim, config.dim)
        self.k_lin = nn.Linear(config.dim, config.dim)
        self.v_lin = nn.Linear(config.dim, config.dim)
        self.out_lin = nn.Linear(config.dim, config.dim)
        self.dropout = nn.Dropout(config.attention_dropout)

    query = property(lambda self: self.q_lin)
    key = property(lambda self: self.k_lin)
    value = property(lambda self: self.v_lin)

    def forward(self, x: Tensor, layout: Layout) -> Tensor:
        """rows [N, H] -> out_lin(context) [N, H] (called as a module when it runs hooks)."""
        return self.out_lin(self.context_keeping_input(x, layout)[0])


class DistilBertFFN(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dropout = nn.Dropout(config.dropout)
        self.lin1 = nn.Linear(config.dim, config.hidden_dim)
        self.lin2 = nn.Linear(config.hidden_dim, config.dim)
        self.approximate = gelu_approximate(config)

    def forward(self, h: Tensor) -> Tensor:
        return self.dropout(self.lin2(_dense_gelu(self.lin1, h, self.approximate)[0]))


class DistilBertBlock(GradientCheckpointingLayer):
    """transformers' TransformerBlock: LN(out_lin(attention(x)) + x), then LN(Dropout(FFN) + h)."""

    def __init__(self, config):
        super().__init__()
        self.attention = DistilBertSelfAttention(config)
        self.sa_layer_norm = nn.LayerNorm(config.dim, eps=EPS)
        self.ffn = DistilBertFFN(config)
        self.output_layer_norm = nn.LayerNorm(config.dim, eps=EPS)

    def roles(self) -> LayerRoles:
        a, f = self.attention, self.ffn
        return LayerRoles(a, a.out_lin, None, self.sa_layer_norm, f.lin1, f.approximate, f.lin2, f.dropout,
                          self.output_layer_norm, (a, f))

    def forward(self, x: Tensor, layout: Layout) -> Tensor:
        """x positional (gradient checkpointing re-runs the layer on it)."""
        if layout.plain is not None:  # inference on a CPU: the modules' own math (bertfast.model.layout)
            return reference.layer_math(self, x, layout.plain)
        attention, ffn, norm = self.attention, self.ffn, self.output_layer_norm
        if hooked(attention):  # called as a module, so its hooks run
            h = _layer_norm(self.sa_layer_norm, attention(x, layout) + x)
        else:
            context, residual = attention.context_keeping_input(x, layout)
            h = dense_norm(attention.out_lin, None, self.sa_layer_norm, context,
                           _residual(residual, x, self.sa_layer_norm))
        if hooked(ffn):
            return _layer_norm(norm, ffn(h) + h)
        fused = _ffn(ffn.lin1, ffn.approximate, ffn.lin2, (ffn.dropout, norm), h)
        if fused is not None:
            return fused_norm(ffn.dropout, norm, fused[0], ffn.lin2.bias, fused[1])
        y, residual = _dense_gelu(ffn.lin1, h, ffn.approximate)
        return dense_norm(ffn.lin2, ffn.dropout, norm, y, _residual(residual, h, norm))


# ================================================================= models
class DistilBertPreTrainedModel(FastPreTrainedModel, hf_distilbert.DistilBertPreTrainedModel):
    config_class = transformers.DistilBertConfig
    supported_configs = (transformers.DistilBertConfig,)

    @classmethod
    def check_config(cls, config: Any) -> None:
        check_config(config)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, nn.Embedding) and getattr(module, "sinusoidal", False):
            table = module.weight
            init.copy_(table, hf_distilbert.create_sinusoidal_embeddings(*table.shape, torch.empty_like(table)))


class DistilBertModel(EncoderModel, DistilBertPreTrainedModel):
    """transformers' DistilBertModel, fused (no pooler, no token types)."""

    embeddings_class = DistilBertEmbeddings
    layer_class = DistilBertBlock
    stack_name = "transformer"
    packs_by_position_ids = False  # transformers' DistilBERT masks read no position ids
    _no_split_modules = ["DistilBertBlock"]

    def __init__(self, config, add_pooling_layer: bool = False):
        if add_pooling_layer:
            raise ValueError("DistilBertModel has no pooler (transformers' has none): add_pooling_layer must be False")
        super().__init__(config, add_pooling_layer=False)

    def forward(self, input_ids: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
                inputs_embeds: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, **kwargs: Any):
        """transformers' DistilBertModel arguments (``inputs_embeds`` third); no token types."""
        if token_type_ids is not None:
            raise ValueError("token_type_ids: DistilBERT has no token types (its tokenizer gives none); leave them out")
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               inputs_embeds=inputs_embeds, **kwargs)


DistilBertPreTrainedModel.encoder_class = DistilBertModel


class _VocabHead(MLMHeadView):
    """DistilBertForMaskedLM's vocab_transform, activation, vocab_layer_norm and vocab_projector as one MLM head."""

    def parts(self):
        m = self.model
        return m.vocab_transform, m.vocab_layer_norm, m.vocab_projector, gelu_approximate(m.config)

    def modules(self):
        return self.model.vocab_transform, self.model.vocab_layer_norm, self.model.vocab_projector

    def __call__(self, h: Tensor) -> Tensor:
        dense, ln, decoder, approximate = self.parts()
        return decoder(ln(F.gelu(dense(h), approximate=approximate)))


class DistilBertForMaskedLM(MaskedLMModel, DistilBertPreTrainedModel):
    """The MLM head (``MaskedLMModel``'s forward): vocab_projector tied to the word embeddings."""

    _tied_weights_keys = {"vocab_projector.weight": "distilbert.embeddings.word_embeddings.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.distilbert = DistilBertModel(config)
        self.vocab_transform = nn.Linear(config.dim, config.dim)
        self.vocab_layer_norm = nn.LayerNorm(config.dim, eps=EPS)
        self.vocab_projector = nn.Linear(config.dim, config.vocab_size)
        self.post_init()

    @property
    def mlm_head(self) -> _VocabHead:
        return _VocabHead(self)

    def get_output_embeddings(self) -> nn.Module:
        return self.vocab_projector

    def set_output_embeddings(self, new_embeddings: nn.Module) -> None:
        self.vocab_projector = new_embeddings


def _pre_classified(model: nn.Module, first_tokens: Tensor) -> Tensor:
    """dropout(ReLU(pre_classifier(first token))): what DistilBERT's classifiers read."""
    return model.dropout(F.relu(model.pre_classifier(first_tokens)))


class DistilBertForSequenceClassification(SequenceClassificationModel, DistilBertPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        _encoder(self, config, add_pooling_layer=False)
        self.pre_classifier = nn.Linear(config.dim, config.dim)
        self.classifier = nn.Linear(config.dim, config.num_labels)
        self.dropout = nn.Dropout(config.seq_classif_dropout)
        self.post_init()

    def sequence_logits(self, encoded: BertModelOutput) -> Tensor:
        return self.classifier(_pre_classified(self, encoded.first_tokens))


class DistilBertForTokenClassification(TokenClassificationModel, DistilBertPreTrainedModel):
    pass


class DistilBertForQuestionAnswering(QuestionAnsweringModel, DistilBertPreTrainedModel):
    def add_span_head(self, config) -> None:
        self.qa_outputs = nn.Linear(config.dim, config.num_labels)
        if config.num_labels != 2:
            raise ValueError(f"DistilBertConfig.num_labels must be 2 for question answering, got {config.num_labels}")
        self.dropout = nn.Dropout(config.qa_dropout)

    def span_logits(self, hidden: Tensor) -> Tensor:
        return self.qa_outputs(self.dropout(hidden))


class DistilBertForMultipleChoice(MultipleChoiceModel, DistilBertPreTrainedModel):
    pooled = False

    def add_choice_head(self, config) -> None:
        self.pre_classifier = nn.Linear(config.dim, config.dim)
        self.classifier = nn.Linear(config.dim, 1)
        self.dropout = nn.Dropout(config.seq_classif_dropout)

    def choice_scores(self, encoded: BertModelOutput) -> Tensor:
        return self.classifier(_pre_classified(self, encoded.first_tokens))


MODEL_CLASSES = {cls.__name__: cls for cls in (
    DistilBertModel, DistilBertForMaskedLM, DistilBertForSequenceClassification, DistilBertForTokenClassification,
    DistilBertForQuestionAnswering, DistilBertForMultipleChoice)}
# The classes by config class and transformers' Auto class (bertfast.hf.register_auto).
AUTO_CLASSES = {"DistilBertConfig": {
    "AutoModel": "DistilBertModel", "AutoModelForMaskedLM": "DistilBertForMaskedLM",
    "AutoModelForSequenceClassification": "DistilBertForSequenceClassification",
    "AutoModelForTokenClassification": "DistilBertForTokenClassification",
    "AutoModelForQuestionAnswering": "DistilBertForQuestionAnswering",
    "AutoModelForMultipleChoice": "DistilBertForMultipleChoice"}}
