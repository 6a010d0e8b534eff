"""The fast BERT models, drop-in for transformers' BERT classes.

Same class names, parameter names (state-dict keys), forward keywords, outputs and losses
as transformers. Two ways to run the same modules and weights:

* fast (default): padding is removed once (``bertfast.padding``), every layer runs on the
  real tokens only through the fused ops in ``bertfast.ops``, and the output is padded
  back. Under ``torch.compile`` the padded token layout is kept instead (static shapes, the
  padded attention op with its key mask), since unpadding has a data-dependent size.
  With MLM labels the prediction head runs only at labelled positions.
* reference: the plain padded PyTorch encoder of ``bertfast.reference``, the oracle.
  Chosen with ``bertfast.reference_execution(model)``.
"""
from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from bertfast import ops, reference
from bertfast.config import BertConfig
from bertfast.padding import pad_rows, unpad_mask
from bertfast.reference import IGNORE_INDEX

Tensor = torch.Tensor


# ================================================================= outputs
class ModelOutput(OrderedDict):
    """Outputs readable as attributes, by key, or by position like transformers' ModelOutput.

    Positional access and ``to_tuple`` skip None fields; ``EXTRA`` fields (bertfast's own
    additions) are left out of tuples so ``return_dict=False`` gives transformers' tuples.
    """

    EXTRA: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                super().__setitem__(f.name, value)

    def __getitem__(self, key):
        if isinstance(key, str):
            return dict(self.items())[key]
        return self.to_tuple()[key]

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if value is not None and name in {f.name for f in fields(self)}:
            super().__setitem__(name, value)

    def to_tuple(self) -> Tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in fields(self)
                     if getattr(self, f.name) is not None and f.name not in self.EXTRA)


@dataclass(eq=False)
class BaseModelOutputWithPoolingAndCrossAttentions(ModelOutput):
    # bertfast extras, on the fast unpadded path: the last layer's rows [N, H] for the N real
    # tokens and their indices into the flattened [B * S] batch (heads reuse them).
    EXTRA = ("token_rows", "token_row_index")
    last_hidden_state: Optional[Tensor] = None
    pooler_output: Optional[Tensor] = None
    hidden_states: Optional[Tuple[Tensor, ...]] = None
    past_key_values: Optional[Any] = None
    attentions: Optional[Tuple[Tensor, ...]] = None
    cross_attentions: Optional[Tuple[Tensor, ...]] = None
    token_rows: Optional[Tensor] = None
    token_row_index: Optional[Tensor] = None


@dataclass(eq=False)
class BertForPreTrainingOutput(ModelOutput):
    EXTRA = ("mlm_loss", "nsp_loss", "mlm_num_correct", "mlm_num_predictions")
    loss: Optional[Tensor] = None
    prediction_logits: Optional[Tensor] = None
    seq_relationship_logits: Optional[Tensor] = None
    hidden_states: Optional[Tuple[Tensor, ...]] = None
    attentions: Optional[Tuple[Tensor, ...]] = None
    mlm_loss: Optional[Tensor] = None
    nsp_loss: Optional[Tensor] = None
    mlm_num_correct: Optional[Tensor] = None
    mlm_num_predictions: Optional[Tensor] = None


@dataclass(eq=False)
class MaskedLMOutput(ModelOutput):
    EXTRA = ("mlm_num_correct", "mlm_num_predictions")
    loss: Optional[Tensor] = None
    logits: Optional[Tensor] = None
    hidden_states: Optional[Tuple[Tensor, ...]] = None
    attentions: Optional[Tuple[Tensor, ...]] = None
    mlm_num_correct: Optional[Tensor] = None
    mlm_num_predictions: Optional[Tensor] = None


@dataclass(eq=False)
class SequenceClassifierOutput(ModelOutput):
    loss: Optional[Tensor] = None
    logits: Optional[Tensor] = None
    hidden_states: Optional[Tuple[Tensor, ...]] = None
    attentions: Optional[Tuple[Tensor, ...]] = None


TokenClassifierOutput = SequenceClassifierOutput
MultipleChoiceModelOutput = SequenceClassifierOutput


@dataclass(eq=False)
class QuestionAnsweringModelOutput(ModelOutput):
    loss: Optional[Tensor] = None
    start_logits: Optional[Tensor] = None
    end_logits: Optional[Tensor] = None
    hidden_states: Optional[Tuple[Tensor, ...]] = None
    attentions: Optional[Tuple[Tensor, ...]] = None


# ================================================================= execution mode
FAST, REFERENCE = "fast", "reference"


@contextlib.contextmanager
def reference_execution(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` (same modules, same weights) through the plain padded reference encoder."""
    encoders = [m for m in model.modules() if isinstance(m, BertModel)]
    previous = [m.execution for m in encoders]
    for m in encoders:
        m.execution = REFERENCE
    try:
        yield model
    finally:
        for m, mode in zip(encoders, previous):
            m.execution = mode


def _activation_dtype(reference_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return reference_dtype


# ================================================================= embeddings
class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def _p(self) -> float:
        return self.dropout.p if self.training else 0.0

    def forward(self, input_ids: Optional[Tensor], position_ids: Tensor, token_type_ids: Tensor,
                inputs_embeds: Optional[Tensor], fast: bool = True) -> Tensor:
        """fast: token rows, ids [N] (or inputs_embeds [N, H]) -> [N, H]; else padded [B, S] -> [B, S, H]."""
        if not fast:
            return self._forward_reference(input_ids, position_ids, token_type_ids, inputs_embeds)
        ln = self.LayerNorm
        if inputs_embeds is None:
            dtype = _activation_dtype(self.word_embeddings.weight.dtype, position_ids.device)
            return ops.embeddings(input_ids, position_ids, token_type_ids, self.word_embeddings.weight,
                                  self.position_embeddings.weight, self.token_type_embeddings.weight,
                                  ln.weight, ln.bias, ln.eps, self._p(), dtype)
        h = inputs_embeds + self.position_embeddings(position_ids) + self.token_type_embeddings(token_type_ids)
        return F.dropout(ops.layer_norm(h, ln.weight, ln.bias, ln.eps), self._p(), self.training)

    def _forward_reference(self, input_ids: Optional[Tensor], position_ids: Tensor, token_type_ids: Tensor,
                           inputs_embeds: Optional[Tensor]) -> Tensor:
        words = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        h = words + self.position_embeddings(position_ids) + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(h))


# ================================================================= encoder layer
class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.head_dim
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def qkv(self, x: Tensor) -> Tensor:
        """One GEMM for Q, K and V: rows [N, H] -> [N, 3, A, D] (weights stay separate in the state dict)."""
        weight = torch.cat([self.query.weight, self.key.weight, self.value.weight])
        bias = torch.cat([self.query.bias, self.key.bias, self.value.bias])
        return F.linear(x, weight, bias).view(x.shape[0], 3, self.num_attention_heads, self.attention_head_size)


class BertSelfOutput(nn.Module):
    """dense, dropout and the residual LayerNorm after attention (and, as BertOutput, after the FFN)."""

    def __init__(self, config: BertConfig, in_features: Optional[int] = None):
        super().__init__()
        self.dense = nn.Linear(in_features or config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, h: Tensor, residual: Tensor, fast: bool = True) -> Tensor:
        """LN(residual + Dropout(h @ W^T + b)); on the fast path the bias add is fused into the LayerNorm op."""
        if not fast:
            return self.LayerNorm(residual + self.dropout(self.dense(h)))
        p = self.dropout.p if self.training else 0.0
        return ops.bias_dropout_residual_layernorm(F.linear(h, self.dense.weight), self.dense.bias, residual,
                                                   self.LayerNorm.weight, self.LayerNorm.bias, self.LayerNorm.eps, p)


class BertOutput(BertSelfOutput):
    def __init__(self, config: BertConfig):
        super().__init__(config, in_features=config.intermediate_size)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.approximate = config.gelu_approximate


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, x: Tensor, attend: Optional[Callable[[Tensor, float], Tensor]] = None,
                mask: Optional[Tensor] = None, want_probs: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """Fast: x token rows [N, H] and attend(qkv [N, 3, A, D], dropout_p) -> [N, A, D].
        Reference: x [B, S, H] and mask [B, S] (1 = token). Returns (output, attention probabilities or None)."""
        if attend is None:
            return self._forward_reference(x, mask, want_probs)
        attn = self.attention
        p_attn = attn.self.dropout.p if self.training else 0.0
        context = attend(attn.self.qkv(x), p_attn).reshape(x.shape)  # [N, H]
        x = attn.output(context, x)
        h = ops.bias_gelu(F.linear(x, self.intermediate.dense.weight), self.intermediate.dense.bias,
                          self.intermediate.approximate)
        return self.output(h, x), None

    def _forward_reference(self, x: Tensor, mask: Tensor, want_probs: bool) -> Tuple[Tensor, Optional[Tensor]]:
        sa = self.attention.self
        batch, seqlen, _ = x.shape
        heads = lambda t: t.view(batch, seqlen, sa.num_attention_heads, sa.attention_head_size)  # noqa: E731
        q, k, v = heads(sa.query(x)), heads(sa.key(x)), heads(sa.value(x))
        p = sa.dropout.p if self.training else 0.0
        keep = None
        if p > 0:
            keep = torch.rand((batch, sa.num_attention_heads, seqlen, seqlen), device=x.device) >= p
        context = reference.attention(q, k, v, mask, None, p, keep).reshape(x.shape)
        probs = self._probs(q, k, mask) if want_probs else None
        x = self.attention.output(context, x, fast=False)
        h = F.gelu(self.intermediate.dense(x), approximate=self.intermediate.approximate)
        return self.output(h, x, fast=False), probs

    @staticmethod
    def _probs(q: Tensor, k: Tensor, mask: Tensor) -> Tensor:
        scores = torch.einsum("bqad,bkad->baqk", q, k) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
        return torch.softmax(scores, -1).nan_to_num(0.0)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])


class BertPooler(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.activation(self.dense(hidden_states[:, 0]))


# ================================================================= base class
class BertPreTrainedModel(nn.Module):
    """Weight initialisation and checkpoint I/O shared by every model class."""

    base_model_prefix = "bert"
    config_class = BertConfig

    def __init__(self, config: BertConfig):
        super().__init__()
        if not isinstance(config, BertConfig):
            raise ValueError(f"expected a bertfast.BertConfig, got {type(config).__name__}")
        config.validate()
        self.config = config

    def post_init(self) -> None:
        self.apply(self._init_weights)
        self.tie_weights()

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, BertLMPredictionHead):
            nn.init.zeros_(module.bias)

    def tie_weights(self) -> None:
        """Tie the MLM decoder to the word embeddings (when the model has both)."""
        head = getattr(self, "cls", None)
        if head is None or not self.config.tie_word_embeddings:
            return
        predictions = head.predictions if hasattr(head, "predictions") else None
        if predictions is not None:
            predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def get_input_embeddings(self) -> nn.Embedding:
        base = self if isinstance(self, BertModel) else self.bert
        return base.embeddings.word_embeddings

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        seen, total = set(), 0
        for name, p in self.named_parameters():
            if id(p) in seen or (exclude_embeddings and "embeddings" in name):
                continue
            seen.add(id(p))
            total += p.numel()
        return total

    @classmethod
    def from_pretrained(cls, path: str, config: Optional[BertConfig] = None, strict: bool = False,
                        torch_dtype: Optional[torch.dtype] = None, **config_overrides: Any):
        """Load a local Hugging Face BERT directory (config.json + model.safetensors or pytorch_model.bin)."""
        from bertfast.checkpoint import load_into

        config = config or BertConfig.from_pretrained(path, **config_overrides)
        model = cls(config)
        load_into(model, path, strict=strict)
        if torch_dtype is not None:
            model.to(torch_dtype)
        return model

    def save_pretrained(self, directory: str) -> None:
        """Write config.json + model.safetensors that transformers' from_pretrained loads."""
        from bertfast.checkpoint import save_model

        save_model(self, directory)


# ================================================================= BertModel
class BertModel(BertPreTrainedModel):
    def __init__(self, config: BertConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.execution = FAST
        self.post_init()

    # ---------------------------------------------------------------- input checks
    def _check_inputs(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds) -> Tuple[int, int]:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("BertModel: give exactly one of input_ids or inputs_embeds")
        cfg = self.config
        if input_ids is not None:
            if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
                raise ValueError(f"input_ids: expected an integer tensor, got dtype {input_ids.dtype}")
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids: expected shape [batch, seq_len], got {tuple(input_ids.shape)}")
            batch, seqlen = input_ids.shape
        else:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != cfg.hidden_size:
                raise ValueError(f"inputs_embeds: expected [batch, seq_len, {cfg.hidden_size}], "
                                 f"got {tuple(inputs_embeds.shape)}")
            batch, seqlen = inputs_embeds.shape[:2]
        if seqlen > cfg.max_position_embeddings:
            raise ValueError(f"sequence length {seqlen} exceeds max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        for name, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids),
                        ("position_ids", position_ids)):
            if t is not None and tuple(t.shape) != (batch, seqlen):
                raise ValueError(f"{name}: expected shape [{batch}, {seqlen}], got {tuple(t.shape)}")
        if not torch.compiler.is_compiling():
            self._check_values(input_ids, attention_mask, token_type_ids, position_ids)
        return batch, seqlen

    def _check_values(self, input_ids, attention_mask, token_type_ids, position_ids) -> None:
        """Range checks, gathered into one host sync."""
        cfg = self.config
        checks: List[Tuple[str, Tensor]] = []
        if input_ids is not None and input_ids.numel():
            checks += [("input_ids_min", input_ids.min()), ("input_ids_max", input_ids.max())]
        if token_type_ids is not None and token_type_ids.numel():
            checks += [("tt_min", token_type_ids.min()), ("tt_max", token_type_ids.max())]
        if position_ids is not None and position_ids.numel():
            checks += [("pos_min", position_ids.min()), ("pos_max", position_ids.max())]
        if attention_mask is not None and attention_mask.numel():
            checks.append(("mask_bad", ((attention_mask != 0) & (attention_mask != 1)).sum()))
        if not checks:
            return
        values = dict(zip([n for n, _ in checks], torch.stack([v.to(torch.float64) for _, v in checks]).tolist()))
        if values.get("input_ids_min", 0) < 0 or values.get("input_ids_max", 0) >= cfg.vocab_size:
            raise ValueError(f"input_ids: expected values in [0, vocab_size={cfg.vocab_size}), got values in "
                             f"[{int(values['input_ids_min'])}, {int(values['input_ids_max'])}]")
        if values.get("tt_min", 0) < 0 or values.get("tt_max", 0) >= cfg.type_vocab_size:
            raise ValueError(f"token_type_ids: expected values in [0, type_vocab_size={cfg.type_vocab_size}), "
                             f"got values in [{int(values['tt_min'])}, {int(values['tt_max'])}]")
        if values.get("pos_min", 0) < 0 or values.get("pos_max", 0) >= cfg.max_position_embeddings:
            raise ValueError(f"position_ids: expected values in [0, max_position_embeddings="
                             f"{cfg.max_position_embeddings}), got values in [{int(values['pos_min'])}, "
                             f"{int(values['pos_max'])}]")
        if values.get("mask_bad", 0):
            raise ValueError(f"attention_mask: expected only 0 (padding) and 1 (token), got "
                             f"{int(values['mask_bad'])} other values")

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
                head_mask: Optional[Tensor] = None, inputs_embeds: Optional[Tensor] = None,
                output_attentions: Optional[bool] = None, output_hidden_states: Optional[bool] = None,
                return_dict: Optional[bool] = None, **unsupported: Any):
        _reject_unsupported(unsupported, head_mask)
        batch, seqlen = self._check_inputs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        device = (input_ids if input_ids is not None else inputs_embeds).device
        if attention_mask is None:
            attention_mask = torch.ones((batch, seqlen), dtype=torch.long, device=device)
        if token_type_ids is None:
            token_type_ids = torch.zeros((batch, seqlen), dtype=torch.long, device=device)
        if position_ids is None:
            position_ids = torch.arange(seqlen, device=device).expand(batch, seqlen)
        rows = token_rows = None
        if self.execution == REFERENCE:
            sequence, states, probs = self._encode_reference(input_ids, attention_mask, token_type_ids,
                                                             position_ids, inputs_embeds, bool(output_hidden_states),
                                                             bool(output_attentions))
        else:
            if output_attentions:
                raise ValueError("output_attentions=True: the fused attention never materialises attention "
                                 "probabilities; run the model under bertfast.reference_execution(model) for them")
            sequence, states, rows, token_rows = self._encode_fast(input_ids, attention_mask, token_type_ids,
                                                                   position_ids, inputs_embeds,
                                                                   bool(output_hidden_states))
            probs = None
        pooled = self.pooler(sequence) if self.pooler is not None else None
        out = BaseModelOutputWithPoolingAndCrossAttentions(last_hidden_state=sequence, pooler_output=pooled,
                                                           hidden_states=states, attentions=probs,
                                                           token_rows=token_rows, token_row_index=rows)
        return out if return_dict is not False else out.to_tuple()

    def _encode_fast(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                     want_states: bool):
        batch, seqlen = attention_mask.shape
        width = self.config.hidden_size
        flat = lambda t: None if t is None else t.reshape((batch * seqlen,) + tuple(t.shape[2:]))  # noqa: E731
        if torch.compiler.is_compiling():
            # Static shapes: every position is a row; attention masks the padded keys.
            rows = None
            key_mask = attention_mask.bool()

            def attend(qkv: Tensor, p: float) -> Tensor:
                q, k, v = qkv.view(batch, seqlen, 3, *qkv.shape[2:]).unbind(2)  # [B, S, A, D] each
                return ops.attention(q, k, v, key_mask, p).reshape(qkv.shape[0], *qkv.shape[2:])

            gather = flat
            restore = lambda x: x.view(batch, seqlen, width)  # noqa: E731
        else:
            rows, cu_seqlens, max_seqlen = unpad_mask(attention_mask)

            def attend(qkv: Tensor, p: float) -> Tensor:
                return ops.attention_varlen(qkv, cu_seqlens, max_seqlen, p)

            gather = lambda t: None if t is None else flat(t).index_select(0, rows)  # noqa: E731
            restore = lambda x: pad_rows(x, rows, batch, seqlen)  # noqa: E731
        x = self.embeddings(gather(input_ids), gather(position_ids), gather(token_type_ids), gather(inputs_embeds))
        states = [restore(x)] if want_states else None
        for layer in self.encoder.layer:
            x, _ = layer(x, attend=attend)
            if states is not None:
                states.append(restore(x))
        return restore(x), tuple(states) if states is not None else None, rows, x

    def _encode_reference(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                          want_states: bool, want_probs: bool):
        x = self.embeddings(input_ids, position_ids, token_type_ids, inputs_embeds, fast=False)
        states = [x] if want_states else None
        all_probs = [] if want_probs else None
        for layer in self.encoder.layer:
            x, probs = layer(x, mask=attention_mask, want_probs=want_probs)
            if states is not None:
                states.append(x)
            if all_probs is not None:
                all_probs.append(probs)
        return x, tuple(states) if states is not None else None, tuple(all_probs) if want_probs else None



def _reject_unsupported(unsupported: dict, head_mask: Optional[Tensor]) -> None:
    if head_mask is not None:
        raise ValueError("head_mask is not supported by bertfast (the fused attention has no per-head mask)")
    decoder_only = {"encoder_hidden_states", "encoder_attention_mask", "past_key_values", "use_cache"}
    given = {k for k, v in unsupported.items() if v is not None and v is not False}
    if given:
        kind = "decoder/cross-attention arguments" if given <= decoder_only else "arguments"
        raise ValueError(f"bertfast's BERT is an encoder only; unsupported {kind}: {sorted(given)}")


# ================================================================= heads
class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.approximate = config.gelu_approximate

    def forward(self, h: Tensor, fast: bool = True) -> Tensor:
        if not fast:
            return self.LayerNorm(F.gelu(self.dense(h), approximate=self.approximate))
        h = ops.bias_gelu(F.linear(h, self.dense.weight), self.dense.bias, self.approximate)
        return ops.layer_norm(h, self.LayerNorm.weight, self.LayerNorm.bias, self.LayerNorm.eps)


class BertLMPredictionHead(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.decoder.bias = self.bias

    def forward(self, h: Tensor, fast: bool = True) -> Tensor:
        """Full logits [..., V] (the no-labels path, as transformers)."""
        return F.linear(self.transform(h, fast), self.decoder.weight, self.bias)

    def loss(self, bert: BertModel, encoded: BaseModelOutputWithPoolingAndCrossAttentions, labels: Tensor,
             max_predictions_per_seq: Optional[int]) -> ops.MLMHeadLoss:
        """Mean CE over labelled positions; the fast path runs the head on those rows only."""
        sequence = encoded.last_hidden_state
        if labels.shape != sequence.shape[:2]:
            raise ValueError(f"labels: expected shape {tuple(sequence.shape[:2])}, got {tuple(labels.shape)}")
        _check_labels("labels", labels, self.decoder.weight.shape[0])
        t = self.transform
        if bert.execution == REFERENCE:
            logits = self.forward(sequence, fast=False).float()
            flat = labels.reshape(-1)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), flat, ignore_index=IGNORE_INDEX)
            valid = flat != IGNORE_INDEX
            correct = ((logits.view(-1, logits.shape[-1]).argmax(-1) == flat) & valid).sum()
            return ops.MLMHeadLoss(torch.nan_to_num(loss, nan=0.0), correct, valid.sum())
        if encoded.token_row_index is not None and max_predictions_per_seq is None:
            hidden, row_labels = encoded.token_rows, labels.reshape(-1).index_select(0, encoded.token_row_index)
        else:
            hidden, row_labels = sequence, labels
        return ops.mlm_head_loss(hidden, row_labels, t.dense.weight, t.dense.bias, t.LayerNorm.weight,
                                 t.LayerNorm.bias, t.LayerNorm.eps, self.decoder.weight, self.bias, t.approximate,
                                 max_predictions_per_seq)


def _check_labels(name: str, labels: Tensor, num_classes: int) -> None:
    if labels.is_floating_point():
        raise ValueError(f"{name}: expected integer class labels, got dtype {labels.dtype}")
    if torch.compiler.is_compiling() or labels.numel() == 0:
        return
    valid = labels[labels != IGNORE_INDEX]
    if valid.numel():
        lo, hi = torch.stack([valid.min(), valid.max()]).tolist()
        if lo < 0 or hi >= num_classes:
            raise ValueError(f"{name}: expected values in [0, {num_classes}) or -100 (ignored), got values in "
                             f"[{lo}, {hi}]")


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)


class BertOnlyMLMHead(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)


def _is_fast(bert: BertModel) -> bool:
    return bert.execution == FAST


class BertForPreTraining(BertPreTrainedModel):
    """BERT with the MLM and NSP heads. With ``labels`` the MLM head runs only at labelled
    positions and ``prediction_logits`` is None; without labels it returns full logits."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, head_mask=None,
                inputs_embeds=None, labels=None, next_sentence_label=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, max_predictions_per_seq: Optional[int] = None,
                **unsupported):
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, head_mask, inputs_embeds,
                        output_attentions, output_hidden_states, return_dict=True, **unsupported)
        sequence, pooled = out.last_hidden_state, out.pooler_output
        nsp_logits = self.cls.seq_relationship(pooled)
        prediction_logits = mlm = nsp_loss = None
        if labels is not None:
            mlm = self.cls.predictions.loss(self.bert, out, labels, max_predictions_per_seq)
        else:
            prediction_logits = self.cls.predictions(sequence, _is_fast(self.bert))
        if next_sentence_label is not None:
            _check_labels("next_sentence_label", next_sentence_label, 2)
            nsp_loss = F.cross_entropy(nsp_logits.view(-1, 2).float(), next_sentence_label.view(-1))
        loss = mlm.loss + nsp_loss if mlm is not None and nsp_loss is not None else None
        result = BertForPreTrainingOutput(
            loss=loss, prediction_logits=prediction_logits, seq_relationship_logits=nsp_logits,
            hidden_states=out.hidden_states, attentions=out.attentions,
            mlm_loss=None if mlm is None else mlm.loss, nsp_loss=nsp_loss,
            mlm_num_correct=None if mlm is None else mlm.num_correct,
            mlm_num_predictions=None if mlm is None else mlm.num_predictions)
        return result if return_dict is not False else result.to_tuple()


class BertForMaskedLM(BertPreTrainedModel):
    """BERT with the MLM head. With ``labels`` the head runs only at labelled positions and
    ``logits`` is None; without labels it returns full logits."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, head_mask=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, max_predictions_per_seq: Optional[int] = None, **unsupported):
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, head_mask, inputs_embeds,
                        output_attentions, output_hidden_states, return_dict=True, **unsupported)
        if labels is not None:
            mlm = self.cls.predictions.loss(self.bert, out, labels, max_predictions_per_seq)
            result = MaskedLMOutput(loss=mlm.loss, hidden_states=out.hidden_states, attentions=out.attentions,
                                    mlm_num_correct=mlm.num_correct, mlm_num_predictions=mlm.num_predictions)
        else:
            logits = self.cls.predictions(out.last_hidden_state, _is_fast(self.bert))
            result = MaskedLMOutput(logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)
        return result if return_dict is not False else result.to_tuple()


def _classifier_dropout(config: BertConfig) -> nn.Dropout:
    p = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
    return nn.Dropout(p)


class BertForSequenceClassification(BertPreTrainedModel):
    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, head_mask=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, **unsupported):
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, head_mask, inputs_embeds,
                        output_attentions, output_hidden_states, return_dict=True, **unsupported)
        logits = self.classifier(self.dropout(out.pooler_output))
        loss = None
        if labels is not None:
            loss = self._loss(logits, labels)
        result = SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                          attentions=out.attentions)
        return result if return_dict is not False else result.to_tuple()

    def _loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """transformers' problem_type rules (the type is inferred once and stored in the config)."""
        cfg = self.config
        if cfg.problem_type is None:
            if self.num_labels == 1:
                cfg.problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                cfg.problem_type = "single_label_classification"
            else:
                cfg.problem_type = "multi_label_classification"
        if cfg.problem_type == "regression":
            if self.num_labels == 1:
                return F.mse_loss(logits.squeeze().float(), labels.squeeze().float())
            return F.mse_loss(logits.float(), labels.float())
        if cfg.problem_type == "single_label_classification":
            _check_labels("labels", labels, self.num_labels)
            return F.cross_entropy(logits.view(-1, self.num_labels).float(), labels.view(-1))
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float())


class BertForTokenClassification(BertPreTrainedModel):
    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config, add_pooling_layer=False)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, head_mask=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, **unsupported):
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, head_mask, inputs_embeds,
                        output_attentions, output_hidden_states, return_dict=True, **unsupported)
        logits = self.classifier(self.dropout(out.last_hidden_state))
        loss = None
        if labels is not None:
            _check_labels("labels", labels, self.num_labels)
            loss = F.cross_entropy(logits.view(-1, self.num_labels).float(), labels.view(-1),
                                   ignore_index=IGNORE_INDEX)
        result = TokenClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                       attentions=out.attentions)
        return result if return_dict is not False else result.to_tuple()


class BertForQuestionAnswering(BertPreTrainedModel):
    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, head_mask=None,
                inputs_embeds=None, start_positions=None, end_positions=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, **unsupported):
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, head_mask, inputs_embeds,
                        output_attentions, output_hidden_states, return_dict=True, **unsupported)
        logits = self.qa_outputs(out.last_hidden_state)
        start_logits, end_logits = (t.squeeze(-1).contiguous() for t in logits.split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            # transformers: positions outside the sequence are clamped to seq_len and ignored.
            if start_positions.dim() > 1:
                start_positions = start_positions.squeeze(-1)
            if end_positions.dim() > 1:
                end_positions = end_positions.squeeze(-1)
            ignored = start_logits.size(1)
            start_positions = start_positions.clamp(0, ignored)
            end_positions = end_positions.clamp(0, ignored)
            loss = (F.cross_entropy(start_logits.float(), start_positions, ignore_index=ignored)
                    + F.cross_entropy(end_logits.float(), end_positions, ignore_index=ignored)) / 2
        result = QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits,
                                              hidden_states=out.hidden_states, attentions=out.attentions)
        return result if return_dict is not False else result.to_tuple()


class BertForMultipleChoice(BertPreTrainedModel):
    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, head_mask=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, **unsupported):
        """Inputs [B, C, S] (C choices); logits [B, C]."""
        source = input_ids if input_ids is not None else inputs_embeds
        if source is None or source.dim() < 3:
            raise ValueError(f"BertForMultipleChoice: expected inputs of shape [batch, num_choices, seq_len], got "
                             f"{None if source is None else tuple(source.shape)}")
        num_choices = source.shape[1]
        flat = lambda t: None if t is None else t.reshape(-1, *t.shape[2:])  # noqa: E731
        out = self.bert(flat(input_ids), flat(attention_mask), flat(token_type_ids), flat(position_ids), head_mask,
                        flat(inputs_embeds), output_attentions, output_hidden_states, return_dict=True,
                        **unsupported)
        logits = self.classifier(self.dropout(out.pooler_output)).view(-1, num_choices)
        loss = None
        if labels is not None:
            _check_labels("labels", labels, num_choices)
            loss = F.cross_entropy(logits.float(), labels)
        result = MultipleChoiceModelOutput(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                           attentions=out.attentions)
        return result if return_dict is not False else result.to_tuple()


MODEL_CLASSES = {cls.__name__: cls for cls in (BertModel, BertForPreTraining, BertForMaskedLM,
                                               BertForSequenceClassification, BertForTokenClassification,
                                               BertForQuestionAnswering, BertForMultipleChoice)}
