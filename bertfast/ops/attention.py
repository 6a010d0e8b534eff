"""Fused self-attention: softmax(Q K^T * scale, key-padding mask) with dropout, times V.

Two forms:
  attention_varlen: unpadded tokens, qkv [T, 3, A, D] + cu_seqlens [B + 1] + max_seqlen
                    (what the unpadded encoder calls);
  attention:        padded q, k, v [B, S, A, D] + key_padding_mask [B, S] (1 = token).
A sequence with no valid key yields zeros and zero gradients.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from bertfast import dispatch
from bertfast.ops._common import check_dropout, distinct, register_backends, seed_for

Tensor = torch.Tensor
HEAD_DIMS = (16, 32, 64, 128)


def _limits(backend, inputs):
    head_dim = inputs["q"].shape[-1]
    return [] if head_dim in HEAD_DIMS else [f"head dim {head_dim} not in {HEAD_DIMS}"]


register_backends("attention_varlen", "attention", ["q"], _limits)
register_backends("attention_padded", "attention", ["q"], _limits)


def _impl(op, backend):
    return dispatch.get(op, backend).impl


# ------------------------------------------------------------------ variable length
@torch.library.custom_op("bertfast::attention_varlen", mutates_args=())
def _attention_varlen(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, softmax_scale: float, dropout_p: float,
                      seed: Optional[Tensor], backend: str) -> tuple[Tensor, Tensor]:
    q, k, v = qkv.unbind(1)
    outputs = _impl("attention_varlen", backend).attention_varlen_fwd(q, k, v, cu_seqlens, max_seqlen,
                                                                      softmax_scale, dropout_p, seed)
    return distinct(outputs, [qkv])


@_attention_varlen.register_fake
def _(qkv, cu_seqlens, max_seqlen, softmax_scale, dropout_p, seed, backend):
    tokens, _, heads, head_dim = qkv.shape
    return qkv.new_empty((tokens, heads, head_dim)), qkv.new_empty((heads, tokens), dtype=torch.float32)


@torch.library.custom_op("bertfast::attention_varlen_backward", mutates_args=())
def _attention_varlen_backward(dout: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
                               max_seqlen: int, softmax_scale: float, dropout_p: float, seed: Optional[Tensor],
                               backend: str) -> Tensor:
    q, k, v = qkv.unbind(1)
    dqkv = _impl("attention_varlen", backend).attention_varlen_bwd(
        dout.contiguous(), q, k, v, out, lse, cu_seqlens, max_seqlen, softmax_scale, dropout_p, seed)
    return distinct([dqkv], [dout, qkv, out, lse])[0]


@_attention_varlen_backward.register_fake
def _(dout, qkv, out, lse, cu_seqlens, max_seqlen, softmax_scale, dropout_p, seed, backend):
    return qkv.new_empty(qkv.shape)


def _varlen_setup(ctx, inputs, output):
    qkv, cu_seqlens, max_seqlen, softmax_scale, dropout_p, seed, backend = inputs
    out, lse = output
    ctx.save_for_backward(qkv, out, lse, cu_seqlens, seed)
    ctx.args = (max_seqlen, softmax_scale, dropout_p, backend)


def _varlen_backward(ctx, dout, _dlse):
    qkv, out, lse, cu_seqlens, seed = ctx.saved_tensors
    max_seqlen, softmax_scale, dropout_p, backend = ctx.args
    dqkv = _attention_varlen_backward(dout, qkv, out, lse, cu_seqlens, max_seqlen, softmax_scale, dropout_p,
                                      seed, backend)
    return dqkv, None, None, None, None, None, None


_attention_varlen.register_autograd(_varlen_backward, setup_context=_varlen_setup)


def attention_varlen(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = 0.0,
                     softmax_scale: Optional[float] = None) -> Tensor:
    """Self-attention over unpadded tokens. qkv [T, 3, A, D] -> [T, A, D]."""
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"attention_varlen: expected qkv of shape [tokens, 3, heads, head_dim], "
                         f"got {tuple(qkv.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"attention_varlen: expected cu_seqlens int32 [batch + 1], "
                         f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    dropout_p = check_dropout(dropout_p)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(qkv.shape[-1])
    backend = dispatch.select("attention_varlen", q=qkv, cu_seqlens=cu_seqlens)
    out, _ = _attention_varlen(qkv, cu_seqlens, int(max_seqlen), float(scale), dropout_p,
                               seed_for(dropout_p, qkv.device), backend)
    return out


# ------------------------------------------------------------------ padded + mask
@torch.library.custom_op("bertfast::attention_padded", mutates_args=())
def _attention_padded(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor, softmax_scale: float,
                      dropout_p: float, seed: Optional[Tensor], backend: str) -> tuple[Tensor, Tensor]:
    outputs = _impl("attention_padded", backend).attention_padded_fwd(q, k, v, key_padding_mask, softmax_scale,
                                                                      dropout_p, seed)
    return distinct(outputs, [q, k, v])


@_attention_padded.register_fake
def _(q, k, v, key_padding_mask, softmax_scale, dropout_p, seed, backend):
    batch, seqlen, heads, _ = q.shape
    # Every backend returns contiguous tensors, whatever the strides of q, k, v.
    return q.new_empty(q.shape), q.new_empty((batch, heads, seqlen), dtype=torch.float32)


@torch.library.custom_op("bertfast::attention_padded_backward", mutates_args=())
def _attention_padded_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                               key_padding_mask: Tensor, softmax_scale: float, dropout_p: float,
                               seed: Optional[Tensor], backend: str) -> tuple[Tensor, Tensor, Tensor]:
    grads = _impl("attention_padded", backend).attention_padded_bwd(
        dout.contiguous(), q, k, v, out, lse, key_padding_mask, softmax_scale, dropout_p, seed)
    return distinct(grads, [dout, q, k, v, out, lse])


@_attention_padded_backward.register_fake
def _(dout, q, k, v, out, lse, key_padding_mask, softmax_scale, dropout_p, seed, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _padded_setup(ctx, inputs, output):
    q, k, v, key_padding_mask, softmax_scale, dropout_p, seed, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, seed)
    ctx.args = (softmax_scale, dropout_p, backend)


def _padded_backward(ctx, dout, _dlse):
    q, k, v, out, lse, key_padding_mask, seed = ctx.saved_tensors
    softmax_scale, dropout_p, backend = ctx.args
    dq, dk, dv = _attention_padded_backward(dout, q, k, v, out, lse, key_padding_mask, softmax_scale, dropout_p,
                                            seed, backend)
    return dq, dk, dv, None, None, None, None, None


_attention_padded.register_autograd(_padded_backward, setup_context=_padded_setup)


def attention(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None,
              dropout_p: float = 0.0, softmax_scale: Optional[float] = None) -> Tensor:
    """Self-attention on padded tensors. q, k, v [B, S, A, D]; key_padding_mask [B, S] (1 = token)."""
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"attention: expected q, k, v of one shape [batch, seq, heads, head_dim], "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    batch, seqlen = q.shape[:2]
    if key_padding_mask is None:
        key_padding_mask = torch.ones((batch, seqlen), dtype=torch.bool, device=q.device)
    if tuple(key_padding_mask.shape) != (batch, seqlen):
        raise ValueError(f"attention: expected key_padding_mask of shape [{batch}, {seqlen}], "
                         f"got {tuple(key_padding_mask.shape)}")
    key_padding_mask = key_padding_mask.bool()
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    dropout_p = check_dropout(dropout_p)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    backend = dispatch.select("attention_padded", q=q, k=k, v=v, key_padding_mask=key_padding_mask)
    out, _ = _attention_padded(q, k, v, key_padding_mask, float(scale), dropout_p, seed_for(dropout_p, q.device),
                               backend)
    return out
