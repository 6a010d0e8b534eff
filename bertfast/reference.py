"""The oracle: plain, readable PyTorch for every fused op and for the BERT encoder and heads.

Nothing here is fast. Every backend of every op (``bertfast.ops``) and the fast model are
checked against these functions, which compute in the dtype they are given (tests run them
in fp32, or fp64). Dropout takes an explicit boolean keep-mask so a kernel's own mask can
be fed in and compared exactly; without one, a mask is drawn from ``generator``.
The encoder and MLM head below run a model's own modules; ``bertfast.reference_execution(model)``
makes a model's forward run them.

Conventions shared with the kernels:
  * attention_mask / key_padding_mask: 1 = token, 0 = padding.
  * A query row whose keys are all padding (a fully padded sequence, or a sequence of
    length 0) attends to nothing: its output is 0 and its gradients are 0, never NaN.
  * dropout keeps an element with probability 1 - p and scales it by 1 / (1 - p).
  * labels equal to -100 are ignored by every loss.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from bertfast.contract import IGNORE_INDEX
from bertfast.padding import packed_layout


# --------------------------------------------------------------------------- dropout
def dropout(x: torch.Tensor, p: float, keep_mask: Optional[torch.Tensor] = None,
            generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Inverted dropout with an optional explicit keep-mask (bool, same shape as x)."""
    if p == 0.0:
        return x
    if keep_mask is None:
        keep_mask = torch.rand(x.shape, device=x.device, generator=generator) >= p
    return x * keep_mask.to(x.dtype) / (1.0 - p)


# --------------------------------------------------------------------------- attention
def attention_probs(q: torch.Tensor, k: torch.Tensor, key_padding_mask: Optional[torch.Tensor] = None,
                    softmax_scale: Optional[float] = None) -> torch.Tensor:
    """softmax(q k^T * scale) over the valid keys: q, k [B, S, A, D] -> [B, A, S, S] (rows with no key: 0).
    key_padding_mask [B, S] (1 = token), or [B, S, S] per query (True where the query attends the key:
    packed sequences read from position ids, ``model_inputs.same_sequence``)."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bqad,bkad->baqk", q, k) * scale  # [B, A, S, S]
    if key_padding_mask is None:
        return torch.softmax(scores, dim=-1)
    keep = key_padding_mask.bool()[:, None] if key_padding_mask.dim() == 3 else key_padding_mask.bool()[:, None, None]
    scores = scores.masked_fill(~keep, float("-inf"))
    # A row with no valid key would be softmax(-inf, ..., -inf) = NaN: make it all zero.
    any_key = keep.any(dim=-1, keepdim=True)
    scores = torch.where(any_key, scores, torch.zeros_like(scores))
    return torch.softmax(scores, dim=-1) * any_key.to(scores.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              key_padding_mask: Optional[torch.Tensor] = None,
              softmax_scale: Optional[float] = None, dropout_p: float = 0.0,
              dropout_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bidirectional self-attention on padded tensors.

    q, k, v: [B, S, A, D]; key_padding_mask: [B, S] (1 = token) or [B, S, S] (``attention_probs``);
    dropout_mask: [B, A, S, S] keep.
    Returns [B, S, A, D].
    """
    probs = dropout(attention_probs(q, k, key_padding_mask, softmax_scale), dropout_p, dropout_mask)
    return torch.einsum("baqk,bkad->bqad", probs, v)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, softmax_scale: Optional[float] = None, dropout_p: float = 0.0,
                     dropout_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention on unpadded tokens: q, k, v [T, A, D], sequence b is rows cu_seqlens[b]:cu_seqlens[b+1].

    dropout_mask: [B, A, max_seqlen, max_seqlen] keep-mask (only the top-left
    [len_b, len_b] block of each sequence is used). Returns [T, A, D].
    """
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for b in range(len(bounds) - 1):
        start, end = bounds[b], bounds[b + 1]
        if end == start:
            continue
        n = end - start
        mask_b = None if dropout_mask is None else dropout_mask[b:b + 1, :, :n, :n]
        out[start:end] = attention(q[None, start:end], k[None, start:end], v[None, start:end],
                                   softmax_scale=softmax_scale, dropout_p=dropout_p,
                                   dropout_mask=mask_b)[0]
    return out


# --------------------------------------------------------------------------- row ops
def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU(x + bias); approximate 'none' is BERT's exact erf form, 'tanh' the approximation."""
    return F.gelu(x + bias, approximate=approximate)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def bias_dropout_residual_layernorm(x: torch.Tensor, bias: Optional[torch.Tensor],
                                    residual: Optional[torch.Tensor], weight: torch.Tensor,
                                    ln_bias: torch.Tensor, eps: float, dropout_p: float = 0.0,
                                    dropout_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """LN(residual + Dropout(x + bias)) * weight + ln_bias. x, residual: [N, H]."""
    h = x if bias is None else x + bias
    h = dropout(h, dropout_p, dropout_mask)
    if residual is not None:
        h = h + residual
    return layer_norm(h, weight, ln_bias, eps)


def embeddings(input_ids: torch.Tensor, position_ids: torch.Tensor, token_type_ids: torch.Tensor,
               word_embeddings: torch.Tensor, position_embeddings: torch.Tensor,
               token_type_embeddings: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
               eps: float, dropout_p: float = 0.0,
               dropout_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dropout(LN(word[ids] + position[pos] + type[tt])); ids of any shape, output [..., H]."""
    h = (F.embedding(input_ids, word_embeddings) + F.embedding(position_ids, position_embeddings)
         + F.embedding(token_type_ids, token_type_embeddings))
    return dropout(layer_norm(h, ln_weight, ln_bias, eps), dropout_p, dropout_mask)


def mlm_head_loss_decoder(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sum of softmax cross-entropy of logits = x @ weight.T + bias over rows whose label != -100.

    x: [M, H], weight: [V, H], labels: [M]. Returns (loss_sum fp32 scalar, n_correct int64 scalar)
    where n_correct counts labelled rows whose argmax logit equals the label.
    """
    logits = F.linear(x, weight, bias).float()  # [M, V]
    loss_sum = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    valid = labels != IGNORE_INDEX
    n_correct = ((logits.argmax(dim=-1) == labels) & valid).sum()
    return loss_sum, n_correct


def classification_loss(logits: torch.Tensor, labels: torch.Tensor
                        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [..., C], labels [...] -> (mean fp32 CE over labels != -100, 0 when there are none;
    number of those whose argmax logit is the label; number of those)."""
    logits = logits.float().reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1)
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
    valid = labels != IGNORE_INDEX
    n_correct = ((logits.argmax(dim=-1) == labels) & valid).sum()
    return torch.nan_to_num(loss, nan=0.0), n_correct, valid.sum()


# --------------------------------------------------------------------------- the encoder
# These run a bertfast model's own modules (transformers' BERT module tree and names): each
# Linear, LayerNorm, Embedding and Dropout is called as a module, so LoRA layers, quantized
# Linears and hooks on those modules act here too. The containers above them (BertLayer and so
# on) are not called: their forwards are the fast path.
def encoder(bert: nn.Module, input_ids: Optional[torch.Tensor], attention_mask: torch.Tensor,
            token_type_ids: torch.Tensor, position_ids: torch.Tensor, inputs_embeds: Optional[torch.Tensor],
            want_states: bool = False, want_probs: bool = False
            ) -> Tuple[torch.Tensor, Optional[Tuple[torch.Tensor, ...]], Optional[Tuple[torch.Tensor, ...]]]:
    """The padded BERT encoder of ``bert`` (a BertModel). Inputs [B, S] (inputs_embeds [B, S, H]),
    attention_mask 1 = token, or [B, S, S] per query (``attention_probs``). Padded positions are
    computed like tokens (they attend to the tokens), as in transformers. Returns (last hidden state
    [B, S, H], hidden states with the embeddings first or None, attention probabilities [B, A, S, S]
    per layer or None)."""
    emb = bert.embeddings
    words = emb.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
    types = emb._modules.get("token_type_embeddings")  # DistilBERT has none
    h = words + emb.position_embeddings(position_ids) if types is None else \
        words + types(token_type_ids) + emb.position_embeddings(position_ids)
    x = emb.dropout(emb.LayerNorm(h))
    project = bert._modules.get("embeddings_project")  # ELECTRA's, when its embedding size is not the hidden size
    if project is not None:
        x = project(x)
    states = [x] if want_states else None
    probs = [] if want_probs else None
    for layer in bert.layer_stack.layer:
        x, layer_probs = encoder_layer(layer, x, attention_mask, want_probs)
        if states is not None:
            states.append(x)
        if probs is not None:
            probs.append(layer_probs)
    return x, None if states is None else tuple(states), None if probs is None else tuple(probs)


def encoder_packed(bert: nn.Module, cu_seqlens: torch.Tensor, max_seqlen: int, input_ids: Optional[torch.Tensor],
                   token_type_ids: torch.Tensor, position_ids: torch.Tensor, inputs_embeds: Optional[torch.Tensor],
                   want_states: bool = False, want_probs: bool = False):
    """``encoder`` on packed sequences (inputs [1, T], cu_seqlens [K + 1]), run as a padded batch
    [K, max_seqlen]: (sequence [1, T, H], hidden states like it, attention probabilities [K, A, S, S]
    per layer, the padded sequences [K, S, H] whose first tokens the pooler reads).

    Only the sequences that hold tokens run: a packed row's spare slots are empty (half the slots
    of ``padding.pack_batch``'s default), and run padded they would double the reference's memory.
    An empty slot's sequence is zeros (it pools to 0 either way) and its probabilities zeros, as its
    padded run gave (no key)."""
    tokens = position_ids.shape[1]
    index, mask = packed_layout(cu_seqlens, max_seqlen, tokens)  # [K, S] each
    slots = index.shape[0]
    held = (cu_seqlens.diff() > 0).nonzero().flatten()  # a host read: the reference is no step
    if 0 < held.numel() < slots:
        index, mask = index[held], mask[held]

    def spread(t):  # [1, T, ...] -> [K, S, ...]
        return None if t is None else t[0].index_select(0, index.flatten()).view(index.shape + tuple(t.shape[2:]))

    def pack(x):  # [K, S, H] -> [1, T, H]: sequences in order, one after another
        return x[mask][None]

    def every(x):  # back to all K slots, zeros at the empty ones
        return x.new_zeros((slots,) + tuple(x.shape[1:])).index_copy(0, held, x)

    sequence, states, probs = encoder(bert, spread(input_ids), mask.long(), spread(token_type_ids),
                                      spread(position_ids), spread(inputs_embeds), want_states, want_probs)
    states = None if states is None else tuple(pack(s) for s in states)
    packed_sequence = pack(sequence)
    if index.shape[0] < slots:
        sequence = every(sequence)
        probs = None if probs is None else tuple(every(p) for p in probs)
    return packed_sequence, states, probs, sequence


def encoder_layer(layer: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor, want_probs: bool = False
                  ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One BertLayer on x [B, S, H] -> (output [B, S, H], attention probabilities when asked)."""
    self_attention = layer.roles().self_attention
    p = self_attention.dropout.p if self_attention.training else 0.0
    probs = []

    def attend(q, k, v):  # [B, S, A, D] each
        batch, seqlen, heads, _ = q.shape
        keep = torch.rand((batch, heads, seqlen, seqlen), device=q.device) >= p if p > 0 else None
        if want_probs:
            probs.append(attention_probs(q, k, attention_mask))
        return attention(q, k, v, attention_mask, None, p, keep)
    return layer_math(layer, x, attend), probs[0] if want_probs else None


def layer_math(layer: nn.Module, x: torch.Tensor, attend: Callable[..., torch.Tensor]) -> torch.Tensor:
    """A BertLayer's math on x [..., H] through its own modules, as transformers' layer runs it:
    q, k, v [..., A, D] from the three projections, ``attend(q, k, v)`` -> [..., A, D], then
    LayerNorm(Dropout(dense(context)) + x), GELU(dense), LayerNorm(Dropout(dense) + h). The reference
    encoder's (padded, attend masks the padding) and the fast model's in inference on a CPU (token
    rows, attend the torch backend's varlen attention: bertfast.model.layout's plain)."""
    r = layer.roles()
    self_attention = r.self_attention
    split = (*x.shape[:-1], self_attention.num_attention_heads, self_attention.attention_head_size)
    q, k, v = (m(x).view(split) for m in (self_attention.query, self_attention.key, self_attention.value))
    h = _add_and_norm(r.attention_dense, r.attention_dropout, r.attention_norm, attend(q, k, v).reshape(x.shape), x)
    return _add_and_norm(r.down, r.ffn_dropout, r.ffn_norm, F.gelu(r.up(h), approximate=r.approximate), h)


def _add_and_norm(dense: nn.Module, dropout: Optional[nn.Module], norm: nn.Module, h: torch.Tensor,
                  residual: torch.Tensor) -> torch.Tensor:
    """BertSelfOutput / BertOutput: LayerNorm(Dropout(dense(h)) + residual) (no dropout: DistilBERT's
    attention output)."""
    y = dense(h)
    return norm((y if dropout is None else dropout(y)) + residual)


def mlm_head(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """An MLM head (bertfast.model.mlm_heads: BERT's, RoBERTa's, ...): hidden [..., H] -> logits [..., V]."""
    dense, layer_norm, decoder, approximate = head.parts()
    return decoder(layer_norm(F.gelu(dense(hidden), approximate=approximate)))
