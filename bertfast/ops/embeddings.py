"""embeddings: y = Dropout(LN(word[ids] + position[pos_ids] + token_type[tt_ids])), on unpadded tokens.

ids: [T] (int32 or int64, already range-checked by the model); tables [V, H], [P, H], [TT, H].

Contract (every backend; the torch backend is at the end of this file, the Triton and CUDA ones
are bertfast.kernels.embeddings and bertfast.cuda.embeddings): y [T, H] in out_dtype, mean and
rstd fp32 [T] of the fp32 embedding sum; table gradients scatter-added in fp32 (repeated ids add
up) and returned in each table's dtype; 0 tokens give zero gradients. Dropout as in
bias_dropout_residual_layernorm (per backend stream, mask returned by return_dropout_mask).
H limits are each backend's (``unsupported``): 8192 for Triton and CUDA, none for torch.
"""
from __future__ import annotations

from typing import Optional

import torch

import torch.nn.functional as F

from bertfast import dispatch, reference
from bertfast.contract import check_dropout
from bertfast.ops._common import (distinct, fused_op, keep_mask, launch_directly, layer_norm_bwd, layer_norm_fwd,
                                  no_zero_grads, seed_for)

OP = "embeddings"
Tensor = torch.Tensor


@fused_op("bertfast::embeddings")
def _embeddings(input_ids: Tensor, position_ids: Tensor, token_type_ids: Tensor, word: Tensor, pos: Tensor,
                token_type: Tensor, ln_weight: Tensor, ln_bias: Tensor, eps: float, dropout_p: float,
                seed: Optional[Tensor], out_dtype: torch.dtype, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    outputs = dispatch.get(OP, backend).impl.embeddings_fwd(input_ids, position_ids, token_type_ids, word, pos,
                                                            token_type, ln_weight, ln_bias, eps, dropout_p, seed,
                                                            out_dtype)
    return distinct(outputs, [word, pos, token_type, ln_weight, ln_bias])


@_embeddings.register_fake
def _(input_ids, position_ids, token_type_ids, word, pos, token_type, ln_weight, ln_bias, eps, dropout_p, seed,
      out_dtype, backend):
    tokens = input_ids.shape[0]
    stats = word.new_empty((tokens,), dtype=torch.float32)
    return word.new_empty((tokens, word.shape[1]), dtype=out_dtype), stats, torch.empty_like(stats)


@fused_op("bertfast::embeddings_backward")
def _embeddings_backward(dy: Tensor, input_ids: Tensor, position_ids: Tensor, token_type_ids: Tensor,
                         word: Tensor, pos: Tensor, token_type: Tensor, ln_weight: Tensor, ln_bias: Tensor,
                         mean: Tensor, rstd: Tensor, dropout_p: float, seed: Optional[Tensor], backend: str
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = dispatch.get(OP, backend).impl.embeddings_bwd(dy.contiguous(), input_ids, position_ids, token_type_ids,
                                                          word, pos, token_type, ln_weight, ln_bias, mean, rstd,
                                                          dropout_p, seed)
    return distinct(grads, [dy, word, pos, token_type, ln_weight, ln_bias])


@_embeddings_backward.register_fake
def _(dy, input_ids, position_ids, token_type_ids, word, pos, token_type, ln_weight, ln_bias, mean, rstd,
      dropout_p, seed, backend):
    return tuple(torch.empty_like(t) for t in (word, pos, token_type, ln_weight, ln_bias))


def _setup(ctx, inputs, output):
    (input_ids, position_ids, token_type_ids, word, pos, token_type, ln_weight, ln_bias, eps, dropout_p, seed,
     out_dtype, backend) = inputs
    _, mean, rstd = output
    ctx.save_for_backward(input_ids, position_ids, token_type_ids, word, pos, token_type, ln_weight, ln_bias,
                          mean, rstd, seed)
    ctx.dropout_p, ctx.backend = dropout_p, backend
    no_zero_grads(ctx)


def _backward(ctx, dy, _dmean, _drstd):
    if dy is None:
        return (None,) * 13
    *tensors, mean, rstd, seed = ctx.saved_tensors
    grads = _embeddings_backward(dy, *tensors, mean, rstd, ctx.dropout_p, seed, ctx.backend)
    return (None, None, None, *grads, None, None, None, None, None)


_embeddings.register_autograd(_backward, setup_context=_setup)


def embeddings(input_ids: Tensor, position_ids: Tensor, token_type_ids: Tensor, word: Tensor, pos: Tensor,
               token_type: Tensor, ln_weight: Tensor, ln_bias: Tensor, eps: float, dropout_p: float = 0.0,
               out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """Embedding sum + LayerNorm + dropout for token rows. ids [T] -> [T, H] in out_dtype (default word.dtype)."""
    for name, ids in (("input_ids", input_ids), ("position_ids", position_ids), ("token_type_ids", token_type_ids)):
        if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"embeddings: expected {name} as int32/int64 [tokens], got {ids.dtype} "
                             f"{tuple(ids.shape)}")
    dropout_p = check_dropout(dropout_p)
    backend = dispatch.select(OP, input_ids=input_ids, word=word, pos=pos, token_type=token_type,
                              ln_weight=ln_weight, ln_bias=ln_bias)
    args = (input_ids, position_ids, token_type_ids, word, pos, token_type, ln_weight, ln_bias, float(eps), dropout_p,
            seed_for(dropout_p, word.device), out_dtype or word.dtype)
    if launch_directly(word, pos, token_type, ln_weight, ln_bias):
        return dispatch.get(OP, backend).impl.embeddings_fwd(*args)[0]
    return _embeddings(*args, backend)[0]


# ------------------------------------------------------------------ the torch backend
def _embedding_sum(input_ids, position_ids, token_type_ids, word, pos, token_type):
    # Gather, then widen: only the looked-up rows are converted, never a whole table.
    return (F.embedding(input_ids, word).float() + F.embedding(position_ids, pos).float()
            + F.embedding(token_type_ids, token_type).float())


def embeddings_fwd(input_ids, position_ids, token_type_ids, word, pos, token_type, ln_weight, ln_bias, eps,
                   dropout_p, seed, out_dtype, return_dropout_mask=False):
    h = _embedding_sum(input_ids, position_ids, token_type_ids, word, pos, token_type)
    y, mean, rstd = layer_norm_fwd(h, ln_weight, ln_bias, eps)
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
    g = reference.dropout(dy.float(), dropout_p, keep)
    dh, dweight, dln_bias = layer_norm_bwd(g, h, mean, rstd, ln_weight)
    tables = []
    for ids, table in ((input_ids, word), (position_ids, pos), (token_type_ids, token_type)):
        grad = torch.zeros(table.shape, dtype=torch.float32, device=table.device)
        if grad.is_cuda:
            # index_add_ adds with atomics on CUDA: the sums' bits would change from run to run (a
            # resumed run would drift from the uninterrupted one). index_put_(accumulate=True) sorts
            # the ids and adds each row's tokens in order: deterministic, no host read.
            grad.index_put_((ids.long(),), dh, accumulate=True)
        else:
            grad.index_add_(0, ids.long(), dh)  # on the CPU: one pass in token order
        tables.append(grad.to(table.dtype))
    return (*tables, dweight.to(ln_weight.dtype), dln_bias.to(ln_bias.dtype))
