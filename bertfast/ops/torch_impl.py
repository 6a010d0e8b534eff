"""The ``torch`` backend: the launcher contract implemented with the reference math.

Runs on any device and dtype, in fp32 inside. Backward functions are the analytic
gradients of the reference math (autograd is switched off inside a custom op's
implementation, so nothing here relies on it). Dropout masks are drawn
from a ``torch.Generator`` seeded with the op's seed, so backward regenerates them.
Outputs take the activation dtype and parameter gradients the parameter's dtype, as the
Triton and CUDA launchers do.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from bertfast import reference

Tensor = torch.Tensor


def keep_mask(shape: Sequence[int], dropout_p: float, seed: Optional[Tensor], device) -> Optional[Tensor]:
    """The torch backend's dropout keep-mask for a seed (None when p == 0)."""
    if dropout_p == 0.0:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed.item()))
    return torch.rand(tuple(shape), generator=gen, device=device) >= dropout_p


# ------------------------------------------------------------------------ attention
def _varlen_layout(cu_seqlens: Tensor, max_seqlen: int) -> Tuple[Tensor, Tensor, int]:
    """(token indices into a [B * max_seqlen] padded layout, key mask [B, max_seqlen], B)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    batch = lengths.numel()
    mask = torch.arange(max_seqlen, device=cu_seqlens.device)[None, :] < lengths[:, None]
    return mask.flatten().nonzero().flatten(), mask, batch


def _pad(x: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    out = x.new_zeros((batch * seqlen,) + tuple(x.shape[1:]))
    return out.index_copy(0, indices, x).view((batch, seqlen) + tuple(x.shape[1:]))


def _probs(q: Tensor, k: Tensor, mask: Tensor, scale: float) -> Tuple[Tensor, Tensor]:
    """Masked softmax probabilities [B, A, S, S] and log-sum-exp [B, A, S] in fp32.

    Rows with no valid key get probabilities 0 and lse -inf."""
    scores = torch.einsum("bqad,bkad->baqk", q.float(), k.float()) * scale
    scores = scores.masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
    return probs, lse


def _attention_padded_fwd(q, k, v, mask, scale, dropout_p, keep):
    probs, lse = _probs(q, k, mask, scale)
    out = torch.einsum("baqk,bkad->bqad", reference.dropout(probs, dropout_p, keep), v.float())
    return out.to(q.dtype).contiguous(), lse


def _attention_padded_bwd(dout, q, k, v, mask, scale, dropout_p, keep):
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
    indices, mask, batch = _varlen_layout(cu_seqlens, max_seqlen)
    qp, kp, vp = (_pad(t, indices, batch, max_seqlen) for t in (q, k, v))  # [B, S, A, D]
    heads = q.shape[1]
    keep = keep_mask((batch, heads, max_seqlen, max_seqlen), dropout_p, seed, q.device)
    out, lse = _attention_padded_fwd(qp, kp, vp, mask, softmax_scale, dropout_p, keep)
    lse = lse.permute(1, 0, 2).reshape(heads, batch * max_seqlen)[:, indices]  # [A, T]
    return out.flatten(0, 1)[indices], lse.contiguous()


def attention_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, softmax_scale, dropout_p, seed):
    indices, mask, batch = _varlen_layout(cu_seqlens, max_seqlen)
    heads = q.shape[1]
    keep = keep_mask((batch, heads, max_seqlen, max_seqlen), dropout_p, seed, q.device)
    padded = [_pad(t, indices, batch, max_seqlen) for t in (dout, q, k, v)]
    grads = _attention_padded_bwd(*padded, mask, softmax_scale, dropout_p, keep)
    return torch.stack([g.flatten(0, 1)[indices] for g in grads], dim=1).to(q.dtype)  # [T, 3, A, D]


def attention_varlen_dropout_mask(cu_seqlens, max_seqlen, num_heads, dropout_p, seed):
    batch = cu_seqlens.numel() - 1
    return keep_mask((batch, num_heads, max_seqlen, max_seqlen), dropout_p, seed, cu_seqlens.device)


def attention_padded_fwd(q, k, v, key_padding_mask, softmax_scale, dropout_p, seed):
    batch, seqlen, heads, _ = q.shape
    keep = keep_mask((batch, heads, seqlen, seqlen), dropout_p, seed, q.device)
    return _attention_padded_fwd(q, k, v, key_padding_mask, softmax_scale, dropout_p, keep)


def attention_padded_bwd(dout, q, k, v, out, lse, key_padding_mask, softmax_scale, dropout_p, seed):
    batch, seqlen, heads, _ = q.shape
    keep = keep_mask((batch, heads, seqlen, seqlen), dropout_p, seed, q.device)
    grads = _attention_padded_bwd(dout, q, k, v, key_padding_mask, softmax_scale, dropout_p, keep)
    return tuple(g.to(q.dtype).contiguous() for g in grads)


def attention_padded_dropout_mask(batch, seqlen, num_heads, dropout_p, seed):
    return keep_mask((batch, num_heads, seqlen, seqlen), dropout_p, seed, seed.device)


# ------------------------------------------------------------------------ bias_gelu
def bias_gelu_fwd(x, bias, approximate):
    return reference.bias_gelu(x.float(), bias.float(), approximate).to(x.dtype)


def bias_gelu_bwd(dy, x, bias, approximate):
    dx = torch.ops.aten.gelu_backward(dy.float(), x.float() + bias.float(), approximate=approximate)
    return dx.to(x.dtype), dx.sum(0).to(bias.dtype)


# ------------------------------------------------------------ bias+dropout+residual+LN
def _layer_norm_bwd(g: Tensor, xhat: Tensor, rstd: Tensor, weight: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """LayerNorm backward from the normalised input: (d input, d weight, d bias), fp32."""
    gw = g * weight.float()
    dh = rstd[:, None] * (gw - gw.mean(-1, keepdim=True) - xhat * (gw * xhat).mean(-1, keepdim=True))
    return dh, (g * xhat).sum(0), g.sum(0)


def bias_dropout_residual_layernorm_fwd(x, bias, residual, weight, ln_bias, eps, dropout_p, seed,
                                        return_dropout_mask=False):
    keep = keep_mask(x.shape, dropout_p, seed, x.device)
    h = x.to(torch.float32, copy=True)  # a fresh tensor: pre_norm must never alias the input
    if bias is not None:
        h += bias.float()
    h = reference.dropout(h, dropout_p, keep)
    if residual is not None:
        h = h + residual.float()
    mean = h.mean(dim=-1)
    rstd = torch.rsqrt((h - mean[:, None]).square().mean(-1) + eps)
    y = (h - mean[:, None]) * rstd[:, None] * weight.float() + ln_bias.float()
    result = (y.to(x.dtype), h.to(x.dtype), mean, rstd)
    if return_dropout_mask:
        full = keep if keep is not None else torch.ones(x.shape, dtype=torch.bool, device=x.device)
        return result + (full,)
    return result


def bias_dropout_residual_layernorm_bwd(dy, pre_norm, mean, rstd, weight, dropout_p, seed, has_bias, has_residual):
    keep = keep_mask(pre_norm.shape, dropout_p, seed, pre_norm.device)
    xhat = (pre_norm.float() - mean[:, None]) * rstd[:, None]
    dh, dweight, dln_bias = _layer_norm_bwd(dy.float(), xhat, rstd, weight)
    dx = reference.dropout(dh, dropout_p, keep)
    return (dx.to(dy.dtype), dx.sum(0).to(weight.dtype) if has_bias else None,
            dh.to(dy.dtype) if has_residual else None, dweight.to(weight.dtype), dln_bias.to(weight.dtype))


# ------------------------------------------------------------------------ embeddings
def _embedding_sum(input_ids, position_ids, token_type_ids, word, pos, token_type):
    return (F.embedding(input_ids, word.float()) + F.embedding(position_ids, pos.float())
            + F.embedding(token_type_ids, token_type.float()))


def embeddings_fwd(input_ids, position_ids, token_type_ids, word, pos, token_type, ln_weight, ln_bias, eps,
                   dropout_p, seed, out_dtype, return_dropout_mask=False):
    h = _embedding_sum(input_ids, position_ids, token_type_ids, word, pos, token_type)
    mean = h.mean(-1)
    rstd = torch.rsqrt((h - mean[:, None]).square().mean(-1) + eps)
    y = (h - mean[:, None]) * rstd[:, None] * ln_weight.float() + ln_bias.float()
    keep = keep_mask(y.shape, dropout_p, seed, y.device)
    y = reference.dropout(y, dropout_p, keep).to(out_dtype)
    if return_dropout_mask:
        full = keep if keep is not None else torch.ones(y.shape, dtype=torch.bool, device=y.device)
        return y, mean, rstd, full
    return y, mean, rstd


def embeddings_bwd(dy, input_ids, position_ids, token_type_ids, word, pos, token_type, ln_weight, ln_bias,
                   mean, rstd, dropout_p, seed):
    keep = keep_mask(dy.shape, dropout_p, seed, dy.device)
    h = _embedding_sum(input_ids, position_ids, token_type_ids, word, pos, token_type)
    xhat = (h - mean[:, None]) * rstd[:, None]
    g = reference.dropout(dy.float(), dropout_p, keep)
    dh, dweight, dln_bias = _layer_norm_bwd(g, xhat, rstd, ln_weight)
    tables = []
    for ids, table in ((input_ids, word), (position_ids, pos), (token_type_ids, token_type)):
        grad = torch.zeros(table.shape, dtype=torch.float32, device=table.device)
        tables.append(grad.index_add_(0, ids.long(), dh).to(table.dtype))
    return (*tables, dweight.to(ln_weight.dtype), dln_bias.to(ln_weight.dtype))


# ------------------------------------------------------------------- MLM cross-entropy
def softmax_cross_entropy_(logits, labels, grad_scale, compute_grad):
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    valid = labels != reference.IGNORE_INDEX
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    picked = lf.gather(1, safe[:, None])[:, 0]
    loss = torch.where(valid, lse - picked, torch.zeros_like(lse))
    correct = valid & (lf.argmax(-1) == labels)
    if compute_grad:
        grad = torch.softmax(lf, dim=-1)
        grad[torch.arange(len(labels), device=labels.device), safe] -= 1.0
        grad = grad * valid[:, None].float() * grad_scale
        logits.copy_(grad.to(logits.dtype))
    return loss, lse, correct


def linear_cross_entropy_fwd(x, weight, bias, labels, chunk_rows, compute_grad, grad_scale):
    """Reference form: one chunk holding every row (the full logits); chunk_rows is ignored."""
    bad = (labels != reference.IGNORE_INDEX) & ((labels < 0) | (labels >= weight.shape[0]))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"linear_cross_entropy: labels must be in [0, {weight.shape[0]}) or -100, "
                         f"got {int(labels[row])} at row {row}")
    logits = F.linear(x.float(), weight.float(), None if bias is None else bias.float())  # [M, V]
    loss, _, correct = softmax_cross_entropy_(logits, labels, grad_scale, compute_grad)
    loss_sum, n_correct = loss.sum(), correct.sum()
    if not compute_grad:
        return loss_sum, n_correct, None, None, None
    grad_x = logits @ weight.float()  # logits now hold d(loss)/d(logits)
    grad_w = logits.t() @ x.float()
    grad_b = None if bias is None else logits.sum(0).to(bias.dtype)
    return loss_sum, n_correct, grad_x.to(x.dtype), grad_w.to(weight.dtype), grad_b


def default_softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
