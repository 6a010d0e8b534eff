"""The MLM heads: what the fused MLM loss and the reference read of any family's head (``MLMHead``,
a head module of its own; ``MLMHeadView``, a head made of a model's modules), the loss itself
(``mlm_loss``: the fused head at labelled rows only), and BERT's head modules (``cls.predictions``,
transformers' names and keys).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn as nn

from bertfast import ops, reference
from bertfast.model.config import BertConfig, gelu_approximate
from bertfast.model.modeling import BertModelOutput, Tensor, _biased_linear, _dense_gelu, _layer_norm, fusable, hooked


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.approximate = gelu_approximate(config)

    def forward(self, h: Tensor) -> Tensor:
        return _layer_norm(self.LayerNorm, _dense_gelu(self.dense, h, self.approximate)[0])


class MLMHead(nn.Module):
    """An MLM head: LayerNorm(GELU(dense(h))), then the decoder (tied to the word embeddings) and the
    family's ``bias`` (tied to the decoder's). ``parts`` names its modules for the fused loss and the
    reference."""

    bias: nn.Parameter

    def parts(self) -> Tuple[nn.Linear, nn.LayerNorm, nn.Linear, str]:
        """(dense, layer_norm, decoder, GELU approximation)."""
        raise NotImplementedError

    def loss(self, encoded: BertModelOutput, labels: Tensor, max_predictions_per_seq: Optional[int]) -> ops.MLMHeadLoss:
        return mlm_loss(self, hooked(self), encoded, labels, max_predictions_per_seq)


class MLMHeadView:
    """An MLM head made of a model's own modules, not one module of its own (ELECTRA's generator,
    DistilBERT's vocab_*), seen as MLMHead is by the fused loss and the reference: ``parts()``,
    called for full logits, ``decoder``, and the modules whose hooks send the loss through them."""

    def __init__(self, model: nn.Module):
        self.model = model

    def parts(self) -> Tuple[nn.Module, nn.Module, nn.Module, str]:
        raise NotImplementedError

    def modules(self) -> Tuple[nn.Module, ...]:
        raise NotImplementedError

    def __call__(self, h: Tensor) -> Tensor:
        raise NotImplementedError

    @property
    def decoder(self) -> nn.Module:
        return self.parts()[2]

    def loss(self, encoded: BertModelOutput, labels: Tensor, max_predictions_per_seq: Optional[int]) -> ops.MLMHeadLoss:
        return mlm_loss(self, any(hooked(m) for m in self.modules()), encoded, labels, max_predictions_per_seq)


def mlm_loss(head: Any, head_hooked: bool, encoded: BertModelOutput, labels: Tensor,
             max_predictions_per_seq: Optional[int]) -> ops.MLMHeadLoss:
    """Mean CE over labels [B, S] (checked, -100 at padding) of an MLM head (``parts()``, called for full
    logits); the fused head runs on the labelled rows only, unless the head runs hooks or its parts
    are not plain modules (then it is called on the real tokens' rows)."""
    unpadded = encoded.token_row_index is not None
    dense, ln, decoder, approximate = head.parts()
    if head_hooked or not (_biased_linear(dense, decoder) and fusable(ln)):
        hidden, flat = encoded.last_hidden_state, labels
        if unpadded:
            hidden, flat = encoded.token_rows, labels.reshape(-1).index_select(0, encoded.token_row_index)
        return ops.MLMHeadLoss(*reference.classification_loss(head(hidden), flat))
    if unpadded and max_predictions_per_seq is None:
        hidden, row_labels = encoded.token_rows, labels.reshape(-1).index_select(0, encoded.token_row_index)
    else:
        hidden, row_labels = encoded.last_hidden_state, labels
    return ops.mlm_head_loss(hidden, row_labels, dense.weight, dense.bias, ln.weight, ln.bias, ln.eps,
                             decoder.weight, decoder.bias, approximate, max_predictions_per_seq)


class BertLMPredictionHead(MLMHead):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        # The decoder's weight is tied to the word embeddings and its bias to self.bias (transformers ties them).
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=True)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, h: Tensor) -> Tensor:
        """Full logits [..., V] (the no-labels path, as transformers)."""
        return self.decoder(self.transform(h))

    def parts(self) -> Tuple[nn.Linear, nn.LayerNorm, nn.Linear, str]:
        t = self.transform
        return t.dense, t.LayerNorm, self.decoder, t.approximate


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)


class BertOnlyMLMHead(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
