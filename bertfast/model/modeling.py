"""The fast BERT encoder: transformers BERT models whose forward runs the fused ops (the classes
with task heads, built on it, are in ``bertfast.model.task_models``).

Each class subclasses transformers' ``BertPreTrainedModel`` and takes transformers'
``BertConfig``: loading, saving (wrapped by ``bertfast.model.saving``: checked files and weights,
atomic saves), dtype and device handling, gradient checkpointing,
embedding resize, weight tying and the output classes are transformers'. Same class
names, parameter names (state-dict keys), forward keywords, outputs and losses as
transformers' BERT; the deliberate differences are listed in the README's drop-in table.
What another family's classes share with BERT's is here too: ``FastPreTrainedModel`` (listed before
the family's transformers PreTrainedModel) and ``EncoderModel`` (its encoder model's modules and
forward; ``bertfast.model.roberta`` for RoBERTa, XLM-R and CamemBERT). The MLM heads are in
``bertfast.model.mlm_heads``.

Two ways to run the same modules and weights:

* fast (default): padding is removed once, every layer runs on the real tokens only through
  the fused ops in ``bertfast.ops``, and the output is padded back. Under ``torch.compile`` the
  padded token layout is kept instead (static shapes, the padded attention op with its key
  mask), since unpadding has a data-dependent size; packed inputs are their own layout. One
  layer forward serves the three: ``bertfast.model.layout.Layout`` holds what differs.
  With MLM labels the prediction head runs only at labelled positions.
* reference: the plain padded PyTorch encoder and MLM head of ``bertfast.reference`` (the
  oracle), run on the same modules. Chosen with ``bertfast.reference_execution(model)``;
  export (``torch.export``, ONNX) traces it too. The modules' own forwards are the fast path.

Fusion never bypasses a module: a Linear, LayerNorm, Embedding or Dropout is fused into an
op only while it is exactly that torch class with no hooks (``fusable``). PEFT/LoRA layers,
quantized or parametrized modules and hooked modules are called as modules.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as _torch_module
import transformers
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions, MaskedLMOutput
from transformers.models.bert import modeling_bert as hf_bert

from bertfast import dispatch, ops, reference
from bertfast.model import fused_qkv, model_inputs, residual_linear, saving
from bertfast.model.config import BertConfig, check_supported, ffn_size, gelu_approximate, head_dim
from bertfast.model.layout import PADDED, Layout, first_real_tokens
from bertfast.ops.attention import varlen_inference

Tensor = torch.Tensor


# ================================================================= outputs
# transformers' output classes. bertfast's additions are plain attributes, not dataclass fields:
# they stay out of keys(), to_tuple() and pytree flattening, so tuples and dicts are transformers'.
class BertModelOutput(BaseModelOutputWithPoolingAndCrossAttentions):
    # On the fast unpadded path: the last layer's rows [N, H] for the N real tokens and their
    # indices into the flattened [B * S] batch (the heads reuse them).
    token_rows: Optional[Tensor] = None
    token_row_index: Optional[Tensor] = None
    # Packed inputs' layout (cu_seq_lens_q, max_length_q), for the heads with per-sequence losses.
    packed: Optional[model_inputs.Packed] = None
    # Each sequence's first real token [B, H] (packed: [K, H], zeros for an empty sequence): what the
    # pooler reads, and RoBERTa's classification head.
    first_tokens: Optional[Tensor] = None


class BertForPreTrainingOutput(hf_bert.BertForPreTrainingOutput):
    mlm_loss: Optional[Tensor] = None
    nsp_loss: Optional[Tensor] = None
    mlm_num_correct: Optional[Tensor] = None
    mlm_num_predictions: Optional[Tensor] = None


class BertMaskedLMOutput(MaskedLMOutput):
    mlm_num_correct: Optional[Tensor] = None
    mlm_num_predictions: Optional[Tensor] = None


def _with_extras(output, **extras: Any):
    for name, value in extras.items():
        setattr(output, name, value)  # not a field, so never a key
    return output


# ================================================================= execution mode
FAST, REFERENCE = "fast", "reference"


@contextlib.contextmanager
def reference_execution(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` (same modules, same weights) through the plain padded reference encoder."""
    encoders = [m for m in model.modules() if isinstance(m, EncoderModel)]
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


_FUSABLE_TYPES = (nn.Linear, nn.LayerNorm, nn.Embedding, nn.Dropout)


def hooked(module: nn.Module) -> bool:
    """True when calling ``module`` runs hooks: its own, global ones, or accelerate's (``_hf_hook``,
    which moves or loads the weights on call under a device_map with offloading)."""
    # _hf_hook is read from __dict__: getattr on a module without one raises inside nn.Module.__getattr__,
    # which costs microseconds on every fused op call.
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or module.__dict__.get("_hf_hook") is not None
                or _torch_module._global_forward_hooks
                or _torch_module._global_forward_pre_hooks or _torch_module._global_backward_hooks
                or _torch_module._global_backward_pre_hooks)


def fusable(*modules: nn.Module) -> bool:
    """True when each module is exactly nn.Linear/LayerNorm/Embedding/Dropout with no hooks, so its
    math may run inside a fused op. Anything else (a LoRA layer, a quantized or parametrized
    module, a hooked one) must be called as a module."""
    return all(type(m) in _FUSABLE_TYPES and not hooked(m) for m in modules)


def _biased_linear(*modules: nn.Module) -> bool:
    return fusable(*modules) and all(m.bias is not None for m in modules)


def _bias_in_gemm(x: Tensor, dense: nn.Linear, op: str) -> bool:
    """Whether the GEMM ``dense(x)`` before ``op`` should add its bias itself (addmm) instead of passing
    it to the op: when the op would run its torch backend on a CPU, where a fused bias is one more
    pass over the activations and aten's GEMM adds it for free, as transformers' Linear does.
    Dispatch is asked with a 0-row stand-in of the GEMM's output (a forced or registered fused
    backend, as tests use on a CPU, still gets the bias)."""
    if x.device.type != "cpu":
        return False
    out = x.new_empty((0, dense.out_features), dtype=_activation_dtype(dense.weight.dtype, x.device))
    return dispatch.select(op, x=out, bias=dense.bias) == "torch"


# ================================================================= embeddings
class BertEmbeddings(nn.Module):
    # Default positions count from 0 (RoBERTa's embeddings: from this index + 1, model_inputs.counted_positions).
    position_padding_idx: Optional[int] = None

    def __init__(self, config: BertConfig, size: Optional[int] = None):
        """``size``: the embeddings' width, when not the hidden size (ELECTRA's embedding_size)."""
        super().__init__()
        size = size or config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, size)
        self.LayerNorm = nn.LayerNorm(size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Optional[Tensor], position_ids: Tensor, token_type_ids: Tensor,
                inputs_embeds: Optional[Tensor]) -> Tensor:
        """Token rows: ids [N] (or inputs_embeds [N, H]) -> [N, H] (any leading shape works)."""
        ln = self.LayerNorm
        if inputs_embeds is None and fusable(self.word_embeddings, self.position_embeddings,
                                                      self.token_type_embeddings, ln, self.dropout):
            dtype = _activation_dtype(self.word_embeddings.weight.dtype, position_ids.device)
            p = self.dropout.p if self.training else 0.0
            return ops.embeddings(input_ids, position_ids, token_type_ids, self.word_embeddings.weight,
                                  self.position_embeddings.weight, self.token_type_embeddings.weight,
                                  ln.weight, ln.bias, ln.eps, p, dtype)
        words = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        h = words + self.token_type_embeddings(token_type_ids) + self.position_embeddings(position_ids)
        return self.dropout(_layer_norm(ln, h))


def _layer_norm(ln: nn.Module, h: Tensor) -> Tensor:
    """A plain LayerNorm runs through the fused op; anything else is called."""
    if fusable(ln):
        return ops.bias_dropout_residual_layernorm(h, None, None, ln.weight, ln.bias, ln.eps)
    return ln(h)


# ================================================================= encoder layer
# x holds token rows [N, H] laid out by a bertfast.model.layout.Layout: the real tokens, the packed row's, or
# every position under torch.compile.
class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = head_dim(config)
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def qkv(self, x: Tensor) -> Tensor:
        """rows [N, H] -> [N, 3, A, D] in one buffer for plain Linears (bertfast.model.fused_qkv); anything else
        (a LoRA layer, a hooked module) is called as a module."""
        return self.qkv_keeping_input(x)[0]

    def qkv_keeping_input(self, x: Tensor, attention_takes_bias: bool = False) -> Tuple[Tensor, Tensor, List[Tensor]]:
        """(qkv [N, 3, A, D], x to use as the residual, the biases whose gradient the attention is to
        form). Differentiated through plain Linears, both come from one node (bertfast.model.residual_linear),
        so x's two gradients are summed in the QKV GEMM; with attention_takes_bias that node leaves
        the biases' gradient to the attention (Layout.takes_qkv_bias), else the list is empty."""
        shape = (x.shape[0], 3, self.num_attention_heads, self.attention_head_size)
        linears = (self.query, self.key, self.value)
        if _biased_linear(*linears):
            weights, biases = [m.weight for m in linears], [m.bias for m in linears]
            if residual_linear.records_grad(x, *weights, *biases):
                qkv, residual = residual_linear.linear(x, weights, biases, bias_grad=not attention_takes_bias)
                return qkv.view(shape), residual, biases if attention_takes_bias else []
            return fused_qkv.linear(x, weights, biases).view(shape), x, []
        return torch.stack([self.query(x), self.key(x), self.value(x)], dim=1).view(shape), x, []

    def context_keeping_input(self, x: Tensor, layout: Layout) -> Tuple[Tensor, Tensor]:
        """rows [N, H] -> (context [N, H], x to use as the residual: see qkv_keeping_input)."""
        p = self.dropout.p if self.training else 0.0
        qkv, residual, biases = self.qkv_keeping_input(x, layout.takes_qkv_bias)
        return layout.attend(qkv, p, biases).reshape(x.shape), residual

    def forward(self, x: Tensor, layout: Layout) -> Tensor:
        """rows [N, H] -> context [N, H]."""
        return self.context_keeping_input(x, layout)[0]


def _linear(h: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """F.linear, differentiated through bertfast.model.residual_linear.dense: the weight gradient of fp32
    weights under autocast comes from the GEMM in fp32, with no cast pass after it."""
    if residual_linear.records_grad(h, weight, bias):
        return residual_linear.dense(h, weight, bias)
    return F.linear(h, weight, bias)


class BertSelfOutput(nn.Module):
    """dense, dropout and the residual LayerNorm after attention (and, as BertOutput, after the FFN)."""

    def __init__(self, config: BertConfig, in_features: Optional[int] = None):
        super().__init__()
        self.dense = nn.Linear(in_features or config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, h: Tensor, residual: Tensor) -> Tensor:
        """LN(Dropout(h @ W^T + b) + residual): one op after the GEMM."""
        return dense_norm(self.dense, self.dropout, self.LayerNorm, h, residual)

    def norm(self, y: Tensor, bias: Optional[Tensor], residual: Tensor) -> Tensor:
        """LN(Dropout(y + bias) + residual) in one op, y the dense's output before its bias."""
        return fused_norm(self.dropout, self.LayerNorm, y, bias, residual)


def dense_norm(dense: nn.Module, dropout: Optional[nn.Module], ln: nn.Module, h: Tensor, residual: Tensor) -> Tensor:
    """LN(Dropout(dense(h)) + residual), one op after the GEMM where the modules are plain (the bias
    fused into the LayerNorm op; on a CPU into the GEMM). ``dropout`` None: a layer without one
    there (DistilBERT's attention output)."""
    if not fusable(ln) or (dropout is not None and not fusable(dropout)):
        y = dense(h)
        return ln((y if dropout is None else dropout(y)) + residual)
    if not fusable(dense):
        y, bias = dense(h), None
    elif _bias_in_gemm(h, dense, "bias_dropout_residual_layernorm"):
        y, bias = _linear(h, dense.weight, dense.bias), None
    else:
        y, bias = _linear(h, dense.weight), dense.bias  # bias fused into the LayerNorm op
    return fused_norm(dropout, ln, y, bias, residual)


def fused_norm(dropout: Optional[nn.Module], ln: nn.Module, y: Tensor, bias: Optional[Tensor],
               residual: Tensor) -> Tensor:
    """LN(Dropout(y + bias) + residual) in one op, y a dense's output before its bias."""
    p = dropout.p if dropout is not None and dropout.training else 0.0
    return ops.bias_dropout_residual_layernorm(y, bias, residual, ln.weight, ln.bias, ln.eps, p)


class BertOutput(BertSelfOutput):
    def __init__(self, config: BertConfig):
        super().__init__(config, in_features=config.intermediate_size)


def _residual(kept: Tensor, x: Tensor, output: nn.Module) -> Tensor:
    """The residual to hand ``output``: ``kept`` (the GEMM's node gets its gradient and adds into it
    in place, bertfast.model.residual_linear) unless ``output`` runs hooks, whose backward hooks may keep
    that gradient: then x itself, its two gradients summed by autograd."""
    return x if hooked(output) else kept


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, x: Tensor, layout: Layout) -> Tensor:
        if hooked(self.self):  # called as a module, so its hooks run
            return self.output(self.self(x, layout), x)
        context, residual = self.self.context_keeping_input(x, layout)
        return self.output(context, _residual(residual, x, self.output))


def _dense_gelu(dense: nn.Linear, x: Tensor, approximate: str) -> Tuple[Tensor, Tensor]:
    """(GELU(x @ W^T + b), x to use as the residual), the bias add fused into the GELU op (on a CPU,
    into the GEMM). Differentiated, the GEMM and the residual come from one node
    (bertfast.model.residual_linear), so x's two gradients are summed in the GEMM."""
    if not _biased_linear(dense):
        return F.gelu(dense(x), approximate=approximate), x
    in_gemm = _bias_in_gemm(x, dense, "bias_gelu")
    if residual_linear.records_grad(x, dense.weight, dense.bias):
        y, residual = residual_linear.linear(x, [dense.weight], [dense.bias] if in_gemm else None)
    else:
        y, residual = F.linear(x, dense.weight, dense.bias if in_gemm else None), x
    if in_gemm:
        return F.gelu(y, approximate=approximate), residual
    return ops.bias_gelu(y, dense.bias, approximate), residual


def _ffn(up: nn.Module, approximate: str, down: nn.Module, after: Tuple[nn.Module, ...], h: Tensor
         ) -> Optional[Tuple[Tensor, Tensor]]:
    """(GELU(h @ W1^T + b1) @ W2^T, h to use as the residual) from one node whose GEMMs apply the
    bias and GELU in their epilogues (bertfast.model.residual_linear.ffn), where it applies: differentiated,
    both Linears and the modules ``after`` them (the dropout and LayerNorm) plain, and a backend with
    such GEMMs; else None."""
    if (not _biased_linear(up, down) or not fusable(*after)
            or not residual_linear.records_grad(h, up.weight, up.bias, down.weight, down.bias)):
        return None
    gemms = residual_linear.ffn_gemms(h, up.weight, up.bias, down.weight)
    if gemms is None:
        return None
    return residual_linear.ffn(h, up.weight, up.bias, down.weight, approximate, gemms)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.approximate = gelu_approximate(config)

    def forward(self, x: Tensor) -> Tensor:
        return self.gelu_keeping_input(x)[0]

    def gelu_keeping_input(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """(GELU(dense(x)), x to use as the residual: see _dense_gelu)."""
        return _dense_gelu(self.dense, x, self.approximate)


class LayerRoles(NamedTuple):
    """A layer's modules by what they do, whatever the family names them (``roles()``): what the
    reference math and the CPU inference path read."""
    self_attention: nn.Module  # query, key, value (properties where the family names them otherwise)
    attention_dense: nn.Module
    attention_dropout: Optional[nn.Module]  # None: no dropout after the attention's dense (DistilBERT)
    attention_norm: nn.Module
    up: nn.Module
    approximate: str  # the GELU between up and down
    down: nn.Module
    ffn_dropout: nn.Module
    ffn_norm: nn.Module
    containers: Tuple[nn.Module, ...]  # modules above these whose forwards the math does not call


class BertLayer(GradientCheckpointingLayer):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def roles(self) -> LayerRoles:
        a = self.attention
        return LayerRoles(a.self, a.output.dense, a.output.dropout, a.output.LayerNorm, self.intermediate.dense,
                          self.intermediate.approximate, self.output.dense, self.output.dropout,
                          self.output.LayerNorm, (a, a.self, a.output, self.intermediate, self.output))

    def forward(self, x: Tensor, layout: Layout) -> Tensor:
        """x positional (gradient checkpointing re-runs the layer on it)."""
        if layout.plain is not None:  # inference on a CPU: the modules' own math (bertfast.model.layout)
            return reference.layer_math(self, x, layout.plain)
        h = self.attention(x, layout)
        if hooked(self.intermediate):  # called as a module, so its hooks run
            return self.output(self.intermediate(h), h)
        out = self.output  # its own dense runs inside the fused node: not when it runs hooks
        fused = None if hooked(out) else _ffn(self.intermediate.dense, self.intermediate.approximate, out.dense,
                                               (out.LayerNorm, out.dropout), h)
        if fused is not None:
            return self.output.norm(fused[0], self.output.dense.bias, fused[1])
        y, residual = self.intermediate.gelu_keeping_input(h)
        return self.output(y, _residual(residual, h, self.output))


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig, layer_class: type = BertLayer):
        super().__init__()
        self.layer = nn.ModuleList([layer_class(config) for _ in range(config.num_hidden_layers)])

    def forward(self, x: Tensor, layout: Layout,
                want_states: bool = False) -> Tuple[Tensor, Optional[Tuple[Tensor, ...]]]:
        """-> (last layer's rows, hidden states as [B, S, H] (embeddings first) when asked)."""
        states: Optional[List[Tensor]] = [layout.restore(x)] if want_states else None
        for layer in self.layer:
            x = layer(x, layout=layout)
            if states is not None:
                states.append(layout.restore(x))
        return x, None if states is None else tuple(states)


class BertPooler(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.activation(self.dense(hidden_states[:, 0]))


# ================================================================= base classes
class FastPreTrainedModel:
    """What bertfast adds to a family's transformers PreTrainedModel (the first of its bases):
    PreTrainedModel's machinery, the fused forward. ``supported_configs``: the family's config
    classes; ``counts_from_padding``: positions count from padding_idx + 1 (RoBERTa)."""

    supported_configs: Tuple[type, ...] = (transformers.BertConfig,)
    counts_from_padding = False
    # The fused attention always runs; transformers' attention backends do not apply to these classes.
    _supports_sdpa = False
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False
    _can_record_outputs: Dict[str, Any] = {}
    # Losses are means over the batch's labels (as transformers' BERT computes them), never sums over
    # num_items_in_batch; Trainer then averages over gradient-accumulation steps itself.
    accepts_loss_kwargs = False
    _keys_to_ignore_on_load_unexpected = [r"embeddings\.position_ids", r"embeddings\.token_type_ids"]

    def __init__(self, config: Any, *inputs: Any, **kwargs: Any):
        self.check_config(config)
        super().__init__(config, *inputs, **kwargs)

    @classmethod
    def check_config(cls, config: Any) -> None:
        """A ValueError naming the first setting of ``config`` the fused encoder does not serve."""
        check_supported(config, cls.supported_configs, cls.counts_from_padding)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any):
        """transformers' loading; a truncated weight file or NaN/inf weights get an error naming them."""
        return saving.load_checked(super().from_pretrained, pretrained_model_name_or_path, *args, **kwargs)

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> None:
        """transformers' saving, made atomic: written next to ``save_directory``, then moved in."""
        return saving.save_atomically(self, super().save_pretrained, save_directory, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        from bertfast.model.mlm_heads import MLMHead  # the heads' module imports this one

        PreTrainedModel._init_weights(self, module)  # Linear, Embedding (pad row 0), LayerNorm
        if isinstance(module, MLMHead):
            init.zeros_(module.bias)


class BertPreTrainedModel(FastPreTrainedModel, hf_bert.BertPreTrainedModel):
    """transformers' BertPreTrainedModel with bertfast's modules."""

    config_class = BertConfig


# ================================================================= the encoder model
class EncoderModel:
    """The encoder model of a family (BertModel, RobertaModel, ...; a mixin listed before the family's
    FastPreTrainedModel): embeddings (``embeddings_class``), layers, pooler, the fused forward. An
    embedding_size other than the hidden size (ELECTRA's) adds ``embeddings_project`` between the
    embeddings and the first layer, as transformers does."""

    embeddings_class = BertEmbeddings
    layer_class = BertLayer
    stack_name = "encoder"  # the layers' module (DistilBERT's: transformer)
    # Position ids that restart, given without an attention mask, pack sequences (transformers 5.25's
    # masks read them so; its DistilBERT's do not).
    packs_by_position_ids = True
    _no_split_modules = ["BertEmbeddings", "BertLayer"]

    def __init__(self, config: Any, add_pooling_layer: bool = True):
        super().__init__(config)
        self.embeddings = self.embeddings_class(config)
        if getattr(config, "embedding_size", config.hidden_size) != config.hidden_size:
            self.embeddings_project = nn.Linear(config.embedding_size, config.hidden_size)
        setattr(self, self.stack_name, BertEncoder(config, self.layer_class))
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.execution = FAST
        self.post_init()

    @property
    def layer_stack(self) -> "BertEncoder":
        """The layers' module: ``encoder`` (``transformer`` in DistilBERT)."""
        return self._modules[self.stack_name]

    def get_input_embeddings(self) -> nn.Module:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embeddings.word_embeddings = value

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
                inputs_embeds: Optional[Tensor] = None, output_attentions: Optional[bool] = None,
                output_hidden_states: Optional[bool] = None, return_dict: Optional[bool] = None,
                **kwargs: Any):
        packed = model_inputs.pop_packed(kwargs)
        model_inputs.check_kwargs(kwargs)
        cfg = self.config
        output_attentions = cfg.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = cfg.output_hidden_states if output_hidden_states is None else output_hidden_states
        return_dict = cfg.return_dict if return_dict is None else return_dict
        packs = self.packs_by_position_ids and position_ids is not None and attention_mask is None and packed is None
        attention_mask, token_type_ids, position_ids = model_inputs.prepare_inputs(
            cfg, self.embeddings.word_embeddings, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
            packed, self.embeddings.position_padding_idx)
        starts = model_inputs.position_restarts(position_ids) if packs else None
        index = token_rows = probs = None
        want_states = bool(output_hidden_states)
        if _reference(self) and packed is not None:
            sequence, states, probs, firsts = reference.encoder_packed(
                self, packed.cu_seqlens, packed.max_seqlen, input_ids, token_type_ids, position_ids, inputs_embeds,
                want_states, bool(output_attentions))
        elif _reference(self):
            sequence, states, probs = reference.encoder(
                self, input_ids, attention_mask if starts is None else model_inputs.same_sequence(starts),
                token_type_ids, position_ids, inputs_embeds, want_states, bool(output_attentions))
            firsts = first_real_tokens(sequence, attention_mask)
        elif output_attentions:
            raise ValueError("output_attentions=True: the fused attention never materialises attention "
                             "probabilities; run the model under bertfast.reference_execution(model) for them")
        else:
            if packed is not None:
                layout = Layout.packed(packed.cu_seqlens, packed.max_seqlen, position_ids.shape[1])
            elif starts is not None:
                layout = Layout.segmented(starts)
            elif torch.compiler.is_compiling():  # static shapes: unpadding has a data-dependent size
                layout = Layout.padded(attention_mask)
            else:
                layout = Layout.unpadded(attention_mask)
            index = layout.index
            sequence, states, token_rows = self._encode(layout, input_ids, token_type_ids, position_ids,
                                                        inputs_embeds, want_states)
            firsts = layout.first_tokens(sequence, token_rows, attention_mask)
        pooled = self.pooler(firsts) if self.pooler is not None else None
        if packed is not None:  # an empty sequence pools to 0 (on every path)
            empty = packed.cu_seqlens.diff() == 0
            firsts = firsts.masked_fill(empty[:, None, None], 0.0)
            pooled = None if pooled is None else pooled.masked_fill(empty[:, None], 0.0)
        out = BertModelOutput(last_hidden_state=sequence, pooler_output=pooled, hidden_states=states,
                              attentions=probs)
        out = _with_extras(out, token_rows=token_rows, token_row_index=index, packed=packed,
                           first_tokens=firsts[:, 0])
        return out if return_dict else out.to_tuple()

    def _encode(self, layout: Layout, input_ids, token_type_ids, position_ids, inputs_embeds, want_states: bool):
        """The embeddings and every layer on the layout's rows: (sequence [B, S, H], hidden states or
        None, the last layer's rows [N, H])."""
        rows = layout.rows
        x = self.embeddings(rows(input_ids), rows(position_ids), rows(token_type_ids), rows(inputs_embeds))
        project = self._modules.get("embeddings_project")
        if project is not None:
            x = project(x)
        layout.plain = self._plain_attention(x, layout)
        x, states = self.layer_stack(x, layout, want_states=want_states)
        return layout.restore(x), states, x

    def _plain_attention(self, x: Tensor, layout: Layout):
        """Layout.plain for the embeddings' rows x [N, H], or None. Plain in eager mode on the varlen
        layouts when nothing is to be differentiated, no attention is in training mode (plain attention
        has no dropout; the other dropouts are modules, called as such), autocast is off, every layer
        sits on x's device and runs no hooks of its parts (the plain math calls only their Linears,
        LayerNorms and dropouts), and dispatch picks the torch backend of each layer op for these rows
        (asked with stand-ins: only metadata is read)."""
        device = x.device
        if (layout.kind == PADDED or torch.compiler.is_compiling() or torch.is_grad_enabled()
                or torch.is_autocast_enabled(device.type)):
            return None
        cfg = self.config
        tokens, width = x.shape

        def stand_in(*shape: int) -> Tensor:
            return x.new_empty(()).expand(shape)
        # The attention first: on a GPU the answer is no at once.
        if (dispatch.select("attention_varlen", q=stand_in(tokens, 3, cfg.num_attention_heads, head_dim(cfg)),
                            cu_seqlens=layout.cu_seqlens) != "torch"
                or dispatch.select("bias_gelu", x=stand_in(tokens, ffn_size(cfg)),
                                   bias=stand_in(ffn_size(cfg))) != "torch"
                or dispatch.select("bias_dropout_residual_layernorm", x=x, bias=stand_in(width), residual=x,
                                   weight=stand_in(width), ln_bias=stand_in(width)) != "torch"):
            return None
        for layer in self.layer_stack.layer:
            param, roles = next(layer.parameters(), None), layer.roles()
            if roles.self_attention.training or param is None or param.device != device:
                return None
            if any(hooked(m) for m in roles.containers):
                return None
        return varlen_inference(layout.cu_seqlens, layout.max_seqlen, tokens)


class BertModel(EncoderModel, BertPreTrainedModel):
    """transformers' BertModel, fused."""


BertPreTrainedModel.encoder_class = BertModel  # what the task models build (bertfast.model.task_models)


def _reference(bert: EncoderModel) -> bool:
    return bert.execution == REFERENCE or model_inputs.exporting()
