"""Fused self-attention: softmax(Q K^T * scale, key-padding mask) with dropout, times V.

Two forms:
  attention_varlen: unpadded tokens, qkv [T, 3, A, D] + cu_seqlens [B + 1] + max_seqlen
                    (what the unpadded encoder calls);
  attention:        padded q, k, v [B, S, A, D] + key_padding_mask [B, S] (1 = token).
A sequence with no valid key yields zeros and zero gradients.

Contract (every backend; the torch backend is at the end of this file, the Triton and CUDA ones
are bertfast.kernels.attention and bertfast.cuda.attention):
  * softmax_scale None means 1 / sqrt(head dim); otherwise a finite float > 0.
  * varlen: rows of qkv outside every sequence (beyond cu_seqlens[-1], as static-shape packing
    leaves them) get out 0, lse +inf and dqkv 0, so nothing undefined reaches the next GEMM.
  * A query row with no valid key: out 0, lse +inf, zero gradients, never NaN.
  * Outputs contiguous in q's dtype; lse fp32, [A, T] (varlen) or [B, A, S] (padded).
  * Dropout on the probabilities: keep with probability 1 - p, scale 1 / (1 - p); the mask is a
    function of (seed, sequence, head, query row, key column), so the backward regenerates it.
    Each backend draws its own stream; attention_{varlen,padded}_dropout_mask return the mask a
    backend draws, and the varlen and padded forms of one batch draw the same one.
  * Head dims are each backend's limit (``unsupported``): Triton and CUDA serve every head dim from
    contract.MIN_HEAD_DIM (8) to MAX_HEAD_DIM (256), power of two or not; torch serves any.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from bertfast import contract, dispatch, reference
from bertfast.ops._common import distinct, keep_mask, register_backends, seed_for

Tensor = torch.Tensor
register_backends("attention_varlen", "attention", ["q"])
register_backends("attention_padded", "attention", ["q"])


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
    dropout_p = contract.check_dropout(dropout_p)
    scale = contract.softmax_scale(softmax_scale, qkv.shape[-1])
    backend = dispatch.select("attention_varlen", q=qkv, cu_seqlens=cu_seqlens)
    out, _ = _attention_varlen(qkv, cu_seqlens, int(max_seqlen), scale, dropout_p,
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
    dropout_p = contract.check_dropout(dropout_p)
    scale = contract.softmax_scale(softmax_scale, q.shape[-1])
    backend = dispatch.select("attention_padded", q=q, k=k, v=v, key_padding_mask=key_padding_mask)
    out, _ = _attention_padded(q, k, v, key_padding_mask, scale, dropout_p, seed_for(dropout_p, q.device),
                               backend)
    return out


# ------------------------------------------------------------------ the torch backend
def _varlen_layout(cu_seqlens: Tensor, max_seqlen: int) -> Tuple[Tensor, Tensor, Tensor]:
    """(token rows [n], their positions in a [B * max_seqlen] padded layout [n], key mask
    [B, max_seqlen]) for the n tokens inside sequences, in sequence order."""
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    offsets = torch.arange(max_seqlen, device=cu_seqlens.device)
    mask = offsets[None, :] < lengths[:, None]                                   # [B, S]
    padded = mask.flatten().nonzero().flatten()                                  # [n]
    rows = (starts[:, None] + offsets[None, :]).flatten()[padded]                # [n]
    return rows, padded, mask


def _pad(x: Tensor, rows: Tensor, padded: Tensor, batch: int, seqlen: int) -> Tensor:
    out = x.new_zeros((batch * seqlen,) + tuple(x.shape[1:]))
    return out.index_copy(0, padded, x.index_select(0, rows)).view((batch, seqlen) + tuple(x.shape[1:]))


def _probs(q: Tensor, k: Tensor, mask: Tensor, scale: float) -> Tuple[Tensor, Tensor]:
    """Masked softmax probabilities [B, A, S, S] and log-sum-exp [B, A, S] in fp32.

    Rows with no valid key get probabilities 0 and lse +inf."""
    scores = torch.einsum("bqad,bkad->baqk", q.float(), k.float()) * scale
    scores = scores.masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
    return probs, lse.masked_fill(lse == float("-inf"), float("inf"))


def _padded_fwd(q, k, v, mask, scale, dropout_p, keep):
    probs, lse = _probs(q, k, mask, scale)
    out = torch.einsum("baqk,bkad->bqad", reference.dropout(probs, dropout_p, keep), v.float())
    return out.to(q.dtype).contiguous(), lse


def _padded_bwd(dout, q, k, v, mask, scale, dropout_p, keep):
    """dS = P * (dP - rowsum(dP * P)) with dP the gradient through dropout; rows with no key get 0."""
    probs, _ = _probs(q, k, mask, scale)
    dropped = reference.dropout(probs, dropout_p, keep)
    g = dout.float()
    dv = torch.einsum("baqk,bqad->bkad", dropped, g)
    dprobs = reference.dropout(torch.einsum("bqad,bkad->baqk", g, v.float()), dropout_p, keep)
    dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdim=True))
    dq = torch.einsum("baqk,bkad->bqad", dscores, k.float()) * scale
    dk = torch.einsum("baqk,bqad->bkad", dscores, q.float()) * scale
    return dq, dk, dv


def attention_varlen_fwd(q, k, v, cu_seqlens, max_seqlen, softmax_scale, dropout_p, seed):
    tokens, heads, head_dim = q.shape
    scale = contract.softmax_scale(softmax_scale, head_dim)
    rows, padded, mask = _varlen_layout(cu_seqlens, max_seqlen)
    batch = mask.shape[0]
    qp, kp, vp = (_pad(t, rows, padded, batch, max_seqlen) for t in (q, k, v))   # [B, S, A, D]
    keep = keep_mask((batch, heads, max_seqlen, max_seqlen), dropout_p, seed, q.device)
    out_p, lse_p = _padded_fwd(qp, kp, vp, mask, scale, dropout_p, keep)
    out = q.new_zeros((tokens, heads, head_dim))
    out[rows] = out_p.flatten(0, 1)[padded]
    lse = torch.full((heads, tokens), float("inf"), dtype=torch.float32, device=q.device)
    lse[:, rows] = lse_p.permute(1, 0, 2).reshape(heads, batch * max_seqlen)[:, padded]
    return out, lse


def attention_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, softmax_scale, dropout_p, seed):
    tokens, heads, head_dim = q.shape
    scale = contract.softmax_scale(softmax_scale, head_dim)
    rows, padded, mask = _varlen_layout(cu_seqlens, max_seqlen)
    batch = mask.shape[0]
    keep = keep_mask((batch, heads, max_seqlen, max_seqlen), dropout_p, seed, q.device)
    grads = _padded_bwd(*(_pad(t, rows, padded, batch, max_seqlen) for t in (dout, q, k, v)), mask, scale,
                        dropout_p, keep)
    dqkv = q.new_zeros((tokens, 3, heads, head_dim))
    dqkv[rows] = torch.stack([g.flatten(0, 1)[padded] for g in grads], dim=1).to(q.dtype)
    return dqkv


def attention_varlen_dropout_mask(cu_seqlens, max_seqlen, num_heads, dropout_p, seed):
    batch = cu_seqlens.numel() - 1
    return _dropout_mask(batch, max_seqlen, num_heads, dropout_p, seed, cu_seqlens.device)


def _dropout_mask(batch, seqlen, num_heads, dropout_p, seed, device):
    keep = keep_mask((batch, num_heads, seqlen, seqlen), dropout_p, seed, device)
    return keep if keep is not None else torch.ones((batch, num_heads, seqlen, seqlen), dtype=torch.bool,
                                                    device=device)


def attention_padded_fwd(q, k, v, key_padding_mask, softmax_scale, dropout_p, seed):
    batch, seqlen, heads, head_dim = q.shape
    if key_padding_mask is None:
        key_padding_mask = torch.ones((batch, seqlen), dtype=torch.bool, device=q.device)
    keep = keep_mask((batch, heads, seqlen, seqlen), dropout_p, seed, q.device)
    return _padded_fwd(q, k, v, key_padding_mask, contract.softmax_scale(softmax_scale, head_dim), dropout_p, keep)


def attention_padded_bwd(dout, q, k, v, out, lse, key_padding_mask, softmax_scale, dropout_p, seed):
    batch, seqlen, heads, head_dim = q.shape
    if key_padding_mask is None:
        key_padding_mask = torch.ones((batch, seqlen), dtype=torch.bool, device=q.device)
    keep = keep_mask((batch, heads, seqlen, seqlen), dropout_p, seed, q.device)
    grads = _padded_bwd(dout, q, k, v, key_padding_mask, contract.softmax_scale(softmax_scale, head_dim),
                        dropout_p, keep)
    return tuple(g.to(q.dtype).contiguous() for g in grads)


def attention_padded_dropout_mask(batch, seqlen, num_heads, dropout_p, seed):
    device = seed.device if seed is not None else torch.device("cpu")
    return _dropout_mask(batch, seqlen, num_heads, dropout_p, seed, device)
