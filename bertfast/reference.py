"""The oracle: plain, readable PyTorch for every fused op and for the BERT encoder.

Nothing here is fast. Every backend of every op (``bertfast.ops``) and the fast model are
checked against these functions, which compute in the dtype they are given (tests run them
in fp32, or fp64). Dropout takes an explicit boolean keep-mask so a kernel's own mask can
be fed in and compared exactly; without one, a mask is drawn from ``generator``.

Conventions shared with the kernels:
  * attention_mask / key_padding_mask: 1 = token, 0 = padding.
  * A query row whose keys are all padding (a fully padded sequence, or a sequence of
    length 0) attends to nothing: its output is 0 and its gradients are 0, never NaN.
  * dropout keeps an element with probability 1 - p and scales it by 1 / (1 - p).
  * labels equal to -100 are ignored by every loss.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from bertfast.contract import IGNORE_INDEX


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
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              key_padding_mask: Optional[torch.Tensor] = None,
              softmax_scale: Optional[float] = None, dropout_p: float = 0.0,
              dropout_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bidirectional self-attention on padded tensors.

    q, k, v: [B, S, A, D]; key_padding_mask: [B, S] (1 = token); dropout_mask: [B, A, S, S] keep.
    Returns [B, S, A, D].
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bqad,bkad->baqk", q, k) * scale  # [B, A, S, S]
    if key_padding_mask is not None:
        keep = key_padding_mask.bool()[:, None, None, :]
        scores = scores.masked_fill(~keep, float("-inf"))
        # A row with no valid key would be softmax(-inf, ..., -inf) = NaN: make it all zero.
        any_key = keep.any(dim=-1, keepdim=True)
        scores = torch.where(any_key, scores, torch.zeros_like(scores))
        probs = torch.softmax(scores, dim=-1) * any_key.to(scores.dtype)
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = dropout(probs, dropout_p, dropout_mask)
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
