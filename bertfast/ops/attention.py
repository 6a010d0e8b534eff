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
    function of (seed, sequence, head, query row, key column). The forward returns, third, what it
    records of the mask for the backward (``keep``, uint8 of dropout_keep_shape(batch, heads,
    seqlen, p): the keep bits of Triton and CUDA), and the backward takes it last; a backend whose shape is (0,)
    records nothing and its backward regenerates the mask from the seed. (One exception, not a
    backend: eager training on a CPU with the torch backend keeps the probabilities and mask for
    the backward instead, in _KeptProbs; same numbers, faster there.) The fused backends draw one
    stream (CUDA draws Triton's mask bit for bit), torch its own; attention_{varlen,padded}_dropout_mask
    return the mask a backend draws, and the varlen and padded forms of one batch draw the same one.
  * varlen, given the QKV GEMM's biases (``qkv_bias``: the bias already in qkv): the backward also
    returns their gradient, the column sums of dqkv; the backend's attention_varlen_bwd takes
    bias_dtype and returns (dqkv, dbias [3, A, D]) (contract.qkv_bias_grad). The Triton kernels sum
    it from registers as they write dqkv, so no pass over dqkv is made for it.
  * Head dims are each backend's limit (``unsupported``): Triton and CUDA serve every head dim from
    contract.MIN_HEAD_DIM (8) to MAX_HEAD_DIM (256), power of two or not; torch serves any.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from bertfast import contract, dispatch
from bertfast.ops._common import (PLAIN_TYPES, distinct, fused_op, keep_mask, launch_directly, no_zero_grads,
                                  seed_for)
from bertfast.padding import packed_layout

Tensor = torch.Tensor


def _impl(op, backend):
    return dispatch.get(op, backend).impl


def _fake_keep(like: Tensor, op: str, backend: str, batch: int, heads: int, seqlen: int, dropout_p: float) -> Tensor:
    return like.new_empty(_impl(op, backend).dropout_keep_shape(batch, heads, seqlen, dropout_p), dtype=torch.uint8)


# ------------------------------------------------------------------ variable length
@fused_op("bertfast::attention_varlen")
def _attention_varlen(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, softmax_scale: float, dropout_p: float,
                      seed: Optional[Tensor], backend: str, qkv_bias: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """qkv_bias: not read; inputs so that the backward returns their gradient."""
    q, k, v = qkv.unbind(1)
    outputs = _impl("attention_varlen", backend).attention_varlen_fwd(q, k, v, cu_seqlens, max_seqlen,
                                                                      softmax_scale, dropout_p, seed)
    return distinct(outputs, [qkv])


@_attention_varlen.register_fake
def _(qkv, cu_seqlens, max_seqlen, softmax_scale, dropout_p, seed, backend, qkv_bias):
    tokens, _, heads, head_dim = qkv.shape
    keep = _fake_keep(qkv, "attention_varlen", backend, cu_seqlens.shape[0] - 1, heads, max_seqlen, dropout_p)
    return qkv.new_empty((tokens, heads, head_dim)), qkv.new_empty((heads, tokens), dtype=torch.float32), keep


@fused_op("bertfast::attention_varlen_backward")
def _attention_varlen_backward(dout: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
                               max_seqlen: int, softmax_scale: float, dropout_p: float, seed: Optional[Tensor],
                               keep: Tensor, backend: str,
                               bias_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor]:
    """(dqkv, the QKV bias gradient [3, A, D] in bias_dtype, or an empty tensor without bias_dtype)."""
    q, k, v = qkv.unbind(1)
    grads = _impl("attention_varlen", backend).attention_varlen_bwd(
        dout.contiguous(), q, k, v, out, lse, cu_seqlens, max_seqlen, softmax_scale, dropout_p, seed, keep,
        bias_dtype)
    if bias_dtype is None:
        grads = (grads, qkv.new_empty((0,)))
    return distinct(grads, [dout, qkv, out, lse, keep])


@_attention_varlen_backward.register_fake
def _(dout, qkv, out, lse, cu_seqlens, max_seqlen, softmax_scale, dropout_p, seed, keep, backend, bias_dtype):
    dbias = qkv.new_empty((0,)) if bias_dtype is None else qkv.new_empty(qkv.shape[1:], dtype=bias_dtype)
    return qkv.new_empty(qkv.shape), dbias


def _varlen_setup(ctx, inputs, output):
    qkv, cu_seqlens, max_seqlen, softmax_scale, dropout_p, seed, backend, qkv_bias = inputs
    out, lse, keep = output
    ctx.save_for_backward(qkv, out, lse, cu_seqlens, seed, keep)
    ctx.args = (max_seqlen, softmax_scale, dropout_p, backend)
    ctx.biases = [(b.shape, b.dtype) for b in qkv_bias]
    no_zero_grads(ctx)


def _varlen_backward(ctx, dout, _dlse, _dkeep):
    if dout is None:
        return (None,) * 7 + ([None] * len(ctx.biases),)
    qkv, out, lse, cu_seqlens, seed, keep = ctx.saved_tensors
    max_seqlen, softmax_scale, dropout_p, backend = ctx.args
    dqkv, dbias = _attention_varlen_backward(dout, qkv, out, lse, cu_seqlens, max_seqlen, softmax_scale, dropout_p,
                                             seed, keep, backend, _bias_dtype(ctx.biases))
    return dqkv, None, None, None, None, None, None, _split_bias_grad(dbias, ctx.biases)


_attention_varlen.register_autograd(_varlen_backward, setup_context=_varlen_setup)


def _bias_dtype(biases) -> Optional[torch.dtype]:
    """The dtype the backend returns the QKV bias gradient in: the biases' own, or fp32 where they
    differ or are another dtype (fp64: summed in fp32, as the GEMM's node sums a bias gradient)."""
    if not biases:
        return None
    dtypes = {dtype for _, dtype in biases}
    return dtypes.pop() if len(dtypes) == 1 and dtypes <= set(contract.FLOAT_DTYPES) else torch.float32


def _split_bias_grad(dbias: Tensor, biases) -> list:
    """The gradient [3, A, D] cut into the biases' shapes and dtypes (views where the dtypes agree)."""
    if not biases:
        return []
    parts = dbias.flatten().split([math.prod(shape) for shape, _ in biases])
    return [part.view(shape).to(dtype) for part, (shape, dtype) in zip(parts, biases)]


def _check_qkv_bias(qkv_bias: Sequence[Tensor], qkv: Tensor) -> list:
    biases = list(qkv_bias)
    total, want = sum(b.numel() for b in biases), math.prod(qkv.shape[1:])
    if biases and total != want:
        raise ValueError(f"attention_varlen: expected qkv_bias of {want} elements in all (3 x heads x head_dim, "
                         f"the QKV GEMM's bias), got {total} in {[tuple(b.shape) for b in biases]}")
    for b in biases:
        if not b.is_floating_point() or b.device != qkv.device:
            raise ValueError(f"attention_varlen: expected qkv_bias of floating dtype on {qkv.device}, "
                             f"got {b.dtype} on {b.device}")
    return biases


class _QkvBiasGrad(torch.autograd.Function):
    """qkv as it is, and in the backward the QKV bias gradient summed from dqkv: for the entry
    points that do not run the custom op (_KeptProbs)."""

    @staticmethod
    def forward(ctx, qkv, *biases):
        ctx.biases = [(b.shape, b.dtype) for b in biases]
        return qkv.view_as(qkv)

    @staticmethod
    def backward(ctx, dqkv):
        _, dbias = contract.qkv_bias_grad(dqkv, _bias_dtype(ctx.biases))
        return dqkv, *_split_bias_grad(dbias, ctx.biases)


def attention_varlen(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = 0.0,
                     softmax_scale: Optional[float] = None, qkv_bias: Sequence[Tensor] = ()) -> Tensor:
    """Self-attention over unpadded tokens. qkv [T, 3, A, D] -> [T, A, D].

    qkv_bias: the bias the QKV GEMM has already added to qkv (one [3 * A * D] tensor, or the query's,
    key's and value's in that order), not added again: the attention's backward returns its
    gradient, summed by the Triton kernels as they write dqkv, so the GEMM's backward should not
    (bertfast.model.residual_linear.linear's bias_grad=False)."""
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"attention_varlen: expected qkv of shape [tokens, 3, heads, head_dim], "
                         f"got {tuple(qkv.shape)}")
    biases = _check_qkv_bias(qkv_bias, qkv)
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"attention_varlen: expected cu_seqlens int32 [batch + 1], "
                         f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    dropout_p = contract.check_dropout(dropout_p)
    scale = contract.softmax_scale(softmax_scale, qkv.shape[-1])
    backend = dispatch.select("attention_varlen", q=qkv, cu_seqlens=cu_seqlens)
    seed = seed_for(dropout_p, qkv.device)
    if launch_directly(qkv, *biases):
        return _impl("attention_varlen", backend).attention_varlen_fwd(*qkv.unbind(1), cu_seqlens, int(max_seqlen),
                                                                       scale, dropout_p, seed)[0]
    if keeps_probs(backend, dropout_p, qkv):
        if biases:
            qkv = _QkvBiasGrad.apply(qkv, *biases)
        return kept_probs_varlen(qkv, cu_seqlens, int(max_seqlen), scale, dropout_p, seed)
    return _attention_varlen(qkv, cu_seqlens, int(max_seqlen), scale, dropout_p, seed, backend, biases)[0]


# ------------------------------------------------------------------ padded + mask
@fused_op("bertfast::attention_padded")
def _attention_padded(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor, softmax_scale: float,
                      dropout_p: float, seed: Optional[Tensor], backend: str) -> tuple[Tensor, Tensor, Tensor]:
    outputs = _impl("attention_padded", backend).attention_padded_fwd(q, k, v, key_padding_mask, softmax_scale,
                                                                      dropout_p, seed)
    return distinct(outputs, [q, k, v])


@_attention_padded.register_fake
def _(q, k, v, key_padding_mask, softmax_scale, dropout_p, seed, backend):
    batch, seqlen, heads, _ = q.shape
    # Every backend returns contiguous tensors, whatever the strides of q, k, v.
    keep = _fake_keep(q, "attention_padded", backend, batch, heads, seqlen, dropout_p)
    return q.new_empty(q.shape), q.new_empty((batch, heads, seqlen), dtype=torch.float32), keep


@fused_op("bertfast::attention_padded_backward")
def _attention_padded_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                               key_padding_mask: Tensor, softmax_scale: float, dropout_p: float,
                               seed: Optional[Tensor], keep: Tensor, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    grads = _impl("attention_padded", backend).attention_padded_bwd(
        dout.contiguous(), q, k, v, out, lse, key_padding_mask, softmax_scale, dropout_p, seed, keep)
    return distinct(grads, [dout, q, k, v, out, lse, keep])


@_attention_padded_backward.register_fake
def _(dout, q, k, v, out, lse, key_padding_mask, softmax_scale, dropout_p, seed, keep, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _padded_setup(ctx, inputs, output):
    q, k, v, key_padding_mask, softmax_scale, dropout_p, seed, backend = inputs
    out, lse, keep = output
    ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, seed, keep)
    ctx.args = (softmax_scale, dropout_p, backend)
    no_zero_grads(ctx)


def _padded_backward(ctx, dout, _dlse, _dkeep):
    if dout is None:
        return (None,) * 8
    q, k, v, out, lse, key_padding_mask, seed, keep = ctx.saved_tensors
    softmax_scale, dropout_p, backend = ctx.args
    dq, dk, dv = _attention_padded_backward(dout, q, k, v, out, lse, key_padding_mask, softmax_scale, dropout_p,
                                            seed, keep, backend)
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
    seed = seed_for(dropout_p, q.device)
    if launch_directly(q, k, v):
        return _impl("attention_padded", backend).attention_padded_fwd(q, k, v, key_padding_mask, scale, dropout_p,
                                                                       seed)[0]
    if keeps_probs(backend, dropout_p, q, k, v):
        every_key = bool(key_padding_mask.all())  # a CPU tensor: no device sync
        return _KeptProbs.apply(q, k, v, None if every_key else key_padding_mask, scale, dropout_p, seed)
    return _attention_padded(q, k, v, key_padding_mask, scale, dropout_p, seed, backend)[0]


# ------------------------------------------------------------------ the torch backend
# Without dropout, on CPU, it runs aten's flash attention for CPU (the kernel under
# F.scaled_dot_product_attention there, which also returns the log-sum-exp). With dropout, or on
# another device: fp32 [B, A, S, S] scores, the softmax from the log-sum-exp, the mask drawn from
# the seed; the backward rebuilds the probabilities from the forward's log-sum-exp (except under
# _KeptProbs, which saves them).
# The varlen form pads its sequences into the padded form (or views them, when none is padded).
_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# What the torch backend runs, for `bertfast info`.
KERNELS = ("aten's flash attention for CPU without dropout; otherwise fp32 scores [B, A, S, S], softmax and "
           "matmuls, the mask from torch.Generator")


def _cpu_flash(q: Tensor, dropout_p: float) -> bool:
    return q.device.type == "cpu" and dropout_p == 0.0 and q.dtype in _FLASH_DTYPES and q.numel() > 0


def _key_bias(mask: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """Key mask [B, S] -> the additive [B, 1, 1, S] (0 or -inf) the CPU kernel takes; None when every key counts."""
    if mask is None or bool(mask.all()):
        return None
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias[:, None, None, :]


def _flash_fwd(q, k, v, mask, scale) -> Tuple[Tensor, Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *(t.transpose(1, 2) for t in (q, k, v)), 0.0, False, attn_mask=_key_bias(mask, q.dtype), scale=scale)
    out, lse = out.transpose(1, 2).contiguous(), lse.float().contiguous()
    if mask is None:
        return out, lse
    empty = ~mask.any(1)  # a sequence with no valid key: out 0 and lse +inf (the kernel leaves lse 0)
    if bool(empty.any()):
        out[empty] = 0
        lse[empty] = float("inf")
    return out, lse


def _flash_bwd(dout, q, k, v, out, lse, mask, scale) -> Tuple[Tensor, Tensor, Tensor]:
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *(t.transpose(1, 2) for t in (dout, q, k, v, out)), lse, 0.0, False, attn_mask=_key_bias(mask, q.dtype),
        scale=scale)
    return tuple(g.transpose(1, 2) for g in grads)


def _scores(q: Tensor, k: Tensor, mask: Optional[Tensor], scale: float) -> Tensor:
    """fp32 scores [B, A, S, S] from q, k [B, S, A, D]; -inf at keys outside the mask (None: every key).
    The scale goes on q, a quarter of the scores' size at BERT's head dims."""
    scores = torch.matmul(q.float().transpose(1, 2).mul(scale), k.float().permute(0, 2, 3, 1))
    return scores if mask is None else scores.masked_fill_(~mask[:, None, None, :], float("-inf"))


def _probs(q: Tensor, k: Tensor, mask: Optional[Tensor], scale: float,
           lse: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """Softmax probabilities [B, A, S, S] over the valid keys and the log-sum-exp [B, A, S], fp32, from
    q, k [B, S, A, D]; lse is computed unless given. A row with no valid key: probabilities 0, lse +inf."""
    scores = _scores(q, k, mask, scale)
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
        lse.masked_fill_(lse == float("-inf"), float("inf"))
    return scores.sub_(lse[..., None]).exp_(), lse  # -inf - (+inf) = -inf: rows with no key stay 0


# Dropout here is reference.dropout's x * keep / (1 - p) with the factor moved onto a smaller tensor:
# the [B, A, S, D] output and dv, and dq, dk (the softmax backward is linear in its gradient).
def _kept(x: Tensor, keep: Optional[Tensor]) -> Tensor:
    """x where keep, 0 elsewhere, as a new tensor (torch.where reads the bool mask as it is)."""
    return x if keep is None else torch.where(keep, x, 0.0)


def _dropout_scale(dropout_p: float) -> float:
    return 1.0 / (1.0 - dropout_p)


def _math_fwd(q, k, v, probs, dropout_p, keep) -> Tensor:
    """out [B, S, A, D] in q's dtype from the probabilities [B, A, S, S] (fp32)."""
    out = torch.matmul(_kept(probs, keep), v.float().transpose(1, 2))      # [B, A, S, D]
    if dropout_p:
        out.mul_(_dropout_scale(dropout_p))
    return out.transpose(1, 2).to(q.dtype).contiguous()


def _math_bwd(dout, q, k, v, probs, scale, dropout_p, keep) -> Tuple[Tensor, Tensor, Tensor]:
    """dS = P * (dP - rowsum(dP * P)) with dP the gradient through dropout; rows with no key (P 0) get 0."""
    kept_scale = _dropout_scale(dropout_p) if dropout_p else 1.0
    g = dout.float().transpose(1, 2)                                       # [B, A, S, D]
    dv = torch.matmul(_kept(probs, keep).transpose(-1, -2), g)
    dprobs = _kept(torch.matmul(g, v.float().permute(0, 2, 3, 1)), keep)
    dscores = torch._softmax_backward_data(dprobs, probs, -1, torch.float32)
    dq = torch.matmul(dscores, k.float().transpose(1, 2)).mul_(scale * kept_scale)
    dk = torch.matmul(dscores.transpose(-1, -2), q.float().transpose(1, 2)).mul_(scale * kept_scale)
    if dropout_p:
        dv.mul_(kept_scale)
    return tuple(t.transpose(1, 2).to(q.dtype).contiguous() for t in (dq, dk, dv))


class _KeptProbs(torch.autograd.Function):
    """The torch backend with dropout, for eager training on a CPU: the backward uses the forward's
    probabilities and mask, as transformers' math path does, instead of rebuilding them (the custom op's
    contract). That is a third of the attention's time, for fp32 [B, A, S, S] and a bool mask of the
    same size held per layer until the backward. q, k, v [B, S, A, D], key mask [B, S] or None (every
    key) -> out [B, S, A, D]."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, dropout_p, seed):
        batch, seqlen, heads, _ = q.shape
        keep = keep_mask((batch, heads, seqlen, seqlen), dropout_p, seed, q.device)
        # fp32 math, forward and backward, whatever autocast says (a backward may run inside or outside
        # it): autocast's matmuls would round one pass's probabilities to bf16, and the other's fp32
        # matmuls would refuse them.
        with torch.autocast(q.device.type, enabled=False):
            if mask is None:  # no row without a key: aten's one-pass softmax, no log-sum-exp needed
                probs = torch.softmax(_scores(q, k, None, scale), dim=-1)
            else:
                probs, _ = _probs(q, k, mask, scale, None)
            out = _math_fwd(q, k, v, probs, dropout_p, keep)
        ctx.save_for_backward(q, k, v, probs, keep)
        ctx.args = (scale, dropout_p)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, probs, keep = ctx.saved_tensors
        scale, dropout_p = ctx.args
        with torch.autocast(q.device.type, enabled=False):
            return *_math_bwd(dout, q, k, v, probs, scale, dropout_p, keep), None, None, None, None


def keeps_probs(backend: str, dropout_p: float, *tensors: Tensor) -> bool:
    """Whether an entry runs _KeptProbs: the torch backend with dropout, on plain CPU tensors, eager, with
    gradients on (an entry asks once launch_directly has said no: something needs a gradient)."""
    return (backend == "torch" and dropout_p > 0.0 and torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and all(type(t) in PLAIN_TYPES and t.device.type == "cpu" for t in tensors))


def kept_probs_varlen(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, softmax_scale: float, dropout_p: float,
                      seed: Tensor) -> Tensor:
    """_KeptProbs on unpadded rows qkv [T, 3, A, D] -> [T, A, D]: views when nothing is padded, else
    padding and unpadding that autograd differentiates."""
    form = _PaddedForm(cu_seqlens, max_seqlen, qkv.shape[0])
    out = _KeptProbs.apply(*(form.pad(t) for t in qkv.unbind(1)), form.mask, softmax_scale, dropout_p, seed)
    return form.unpad(out)


def dropout_keep_shape(batch, heads, seqlen, dropout_p):
    """Nothing recorded: the backward redraws the mask from the seed."""
    return (0,)


def _no_keep(like: Tensor) -> Tensor:
    return like.new_empty((0,), dtype=torch.uint8)


def attention_padded_fwd(q, k, v, key_padding_mask, softmax_scale, dropout_p, seed):
    batch, seqlen, heads, head_dim = q.shape
    mask = None if key_padding_mask is None else key_padding_mask.bool()
    scale = contract.softmax_scale(softmax_scale, head_dim)
    if _cpu_flash(q, dropout_p):
        return (*_flash_fwd(q, k, v, mask, scale), _no_keep(q))
    keep = keep_mask((batch, heads, seqlen, seqlen), dropout_p, seed, q.device)
    probs, lse = _probs(q, k, mask, scale, None)
    return _math_fwd(q, k, v, probs, dropout_p, keep), lse, _no_keep(q)


def attention_padded_bwd(dout, q, k, v, out, lse, key_padding_mask, softmax_scale, dropout_p, seed, keep):
    batch, seqlen, heads, head_dim = q.shape
    mask = None if key_padding_mask is None else key_padding_mask.bool()
    scale = contract.softmax_scale(softmax_scale, head_dim)
    if _cpu_flash(q, dropout_p):
        return tuple(g.to(q.dtype).contiguous() for g in _flash_bwd(dout, q, k, v, out, lse, mask, scale))
    keep = keep_mask((batch, heads, seqlen, seqlen), dropout_p, seed, q.device)
    probs, _ = _probs(q, k, mask, scale, lse)
    return _math_bwd(dout, q, k, v, probs, scale, dropout_p, keep)


class _PaddedForm:
    """Varlen rows [T, ...] (sequence b is rows cu_seqlens[b]:cu_seqlens[b+1]) as the padded form
    [B, max_seqlen, ...] and back, the layout worked out once. When the first sequences are max_seqlen
    long and fill the T rows, and any after them are empty (a packed batch's unused slots), both ways
    are views of those first sequences and ``mask`` is None (every key counts); otherwise ``mask``
    [B, max_seqlen] marks the tokens and both ways copy, with ``fill`` where there is no row. The
    torch backend's dropout draws [B, ...] masks in order, so leaving out trailing empty slots keeps
    every sequence's mask."""

    def __init__(self, cu_seqlens: Tensor, max_seqlen: int, tokens: int):
        batch = cu_seqlens.numel() - 1
        full = tokens // max_seqlen if max_seqlen > 0 else 0
        lengths = cu_seqlens.diff()
        self.dense = (0 < full <= batch and full * max_seqlen == tokens
                      and bool((lengths[:full] == max_seqlen).all() & (lengths[full:] == 0).all()))
        self.tokens, self.batch, self.seqlen = tokens, full if self.dense else batch, max_seqlen
        self.mask: Optional[Tensor] = None
        if not self.dense:
            index, self.mask = packed_layout(cu_seqlens, max_seqlen, tokens)        # [B, S] each
            self.padded = self.mask.flatten().nonzero().flatten()                    # [n] positions in B * S
            self.rows = index.flatten()[self.padded]                                  # [n] their rows in T

    def pad(self, x: Tensor, fill: float = 0.0) -> Tensor:
        """[T, ...] -> [B, S, ...], fill at padded positions."""
        shape = (self.batch, self.seqlen) + tuple(x.shape[1:])
        if self.dense:
            return x.view(shape)
        out = x.new_full((self.batch * self.seqlen,) + tuple(x.shape[1:]), fill)
        return out.index_copy(0, self.padded, x.index_select(0, self.rows)).view(shape)

    def unpad(self, x: Tensor, fill: float = 0.0) -> Tensor:
        """[B, S, ...] -> [T, ...], fill at rows outside every sequence."""
        if self.dense:
            return x.reshape((self.tokens,) + tuple(x.shape[2:]))
        out = x.new_full((self.tokens,) + tuple(x.shape[2:]), fill)
        out[self.rows] = x.flatten(0, 1)[self.padded]
        return out


def attention_varlen_fwd(q, k, v, cu_seqlens, max_seqlen, softmax_scale, dropout_p, seed):
    form = _PaddedForm(cu_seqlens, max_seqlen, q.shape[0])
    out, lse, keep = attention_padded_fwd(*(form.pad(t) for t in (q, k, v)), form.mask, softmax_scale, dropout_p,
                                          seed)
    return form.unpad(out), form.unpad(lse.transpose(1, 2), float("inf")).t().contiguous(), keep


class _LengthGroups:
    """Varlen rows [T, ...] as groups of sequences of similar lengths, each group padded to its
    longest: a batch mixing short and long sequences (queries and passages) then costs the attention
    about what its sequences' own lengths cost, where the one padded form [B, max_seqlen] costs each
    sequence the longest's. A group's sequences are at least 1 / RATIO of its longest; a group of
    equal lengths has no mask. Reads the lengths on the host, once per forward."""
    RATIO = 1.25

    def __init__(self, cu_seqlens: Tensor, tokens: int):
        starts, lengths = cu_seqlens[:-1].tolist(), cu_seqlens.diff().tolist()
        order = sorted((b for b, n in enumerate(lengths) if n > 0), key=lambda b: -lengths[b])
        self.groups: List[Tuple[Tensor, Optional[Tensor], Tensor, Optional[Tensor]]] = []
        first = 0
        while first < len(order):
            longest, end = lengths[order[first]], first
            while end < len(order) and lengths[order[end]] * self.RATIO >= longest:
                end += 1
            members = order[first:end]
            offsets = torch.arange(longest)
            start = torch.tensor([starts[b] for b in members])[:, None]
            mask = offsets[None, :] < torch.tensor([lengths[b] for b in members])[:, None]  # [G, L]
            index = (start + offsets[None, :]).clamp_(max=tokens - 1).to(cu_seqlens.device)  # rows, [G, L]
            if bool(mask.all()):
                self.groups.append((index, None, index.flatten(), None))
            else:
                positions = mask.flatten().nonzero().flatten().to(cu_seqlens.device)  # [n] in G * L
                self.groups.append((index, mask.to(cu_seqlens.device), index.flatten()[positions], positions))
            first = end

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """attention_padded_fwd without dropout on each group: q, k, v [T, A, D] -> [T, A, D]."""
        out = q.new_zeros(q.shape)
        for index, mask, rows, positions in self.groups:
            o = attention_padded_fwd(q[index], k[index], v[index], mask, None, 0.0, None)[0].flatten(0, 1)
            out[rows] = o if positions is None else o[positions]
        return out


def varlen_inference(cu_seqlens: Tensor, max_seqlen: int, tokens: int) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """attention_varlen_fwd without dropout, for every layer of one forward: q, k, v [T, A, D] -> [T, A, D].
    The sequences are grouped by length once (``_LengthGroups``) instead of padded at every call,
    and no log-sum-exp is kept. A batch of full sequences is a view."""
    form = _PaddedForm(cu_seqlens, max_seqlen, tokens)
    if form.dense:
        return lambda q, k, v: form.unpad(attention_padded_fwd(*(form.pad(t) for t in (q, k, v)), None, None, 0.0,
                                                               None)[0])
    return _LengthGroups(cu_seqlens, tokens).attend


def attention_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, softmax_scale, dropout_p, seed, keep,
                         bias_dtype=None):
    form = _PaddedForm(cu_seqlens, max_seqlen, q.shape[0])
    # Padded query rows get lse +inf: probabilities 0, so they add nothing to dk and dv.
    lse_p = form.pad(lse.t(), float("inf")).transpose(1, 2)                      # [B, A, S]
    grads = attention_padded_bwd(*(form.pad(t) for t in (dout, q, k, v, out)), lse_p, form.mask, softmax_scale,
                                 dropout_p, seed, keep)
    return contract.qkv_bias_grad(form.unpad(torch.stack(grads, dim=2)), bias_dtype)  # [T, 3, A, D]


def attention_varlen_dropout_mask(cu_seqlens, max_seqlen, num_heads, dropout_p, seed):
    batch = cu_seqlens.numel() - 1
    return _dropout_mask(batch, max_seqlen, num_heads, dropout_p, seed, cu_seqlens.device)


def _dropout_mask(batch, seqlen, num_heads, dropout_p, seed, device):
    keep = keep_mask((batch, num_heads, seqlen, seqlen), dropout_p, seed, device)
    return keep if keep is not None else torch.ones((batch, num_heads, seqlen, seqlen), dtype=torch.bool,
                                                    device=device)


def attention_padded_dropout_mask(batch, seqlen, num_heads, dropout_p, seed):
    device = seed.device if seed is not None else torch.device("cpu")
    return _dropout_mask(batch, seqlen, num_heads, dropout_p, seed, device)
