"""bias_dropout_residual_layernorm: y = LN(residual + Dropout(x + bias)) * weight + ln_bias.

Used twice per encoder layer (after attention and after the FFN) and, with no bias, no
residual and p = 0, as the plain LayerNorm of the MLM head transform. x, residual: [N, H].
"""
from __future__ import annotations

from typing import Optional

import torch

from bertfast import dispatch
from bertfast.ops._common import check_dropout, distinct, empty, or_none, register_backends, seed_for

OP = "bias_dropout_residual_layernorm"
MAX_HIDDEN = 8192


def _limits(backend, inputs):
    width = inputs["x"].shape[-1]
    return [f"hidden size {width} exceeds {MAX_HIDDEN}"] if width > MAX_HIDDEN else []


register_backends(OP, "layer_norm", ["x", "bias", "residual", "weight", "ln_bias"], _limits)

Tensor = torch.Tensor


@torch.library.custom_op("bertfast::bias_dropout_residual_layernorm", mutates_args=())
def _bdrln(x: Tensor, bias: Optional[Tensor], residual: Optional[Tensor], weight: Tensor, ln_bias: Tensor,
           eps: float, dropout_p: float, seed: Optional[Tensor], backend: str
           ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    impl = dispatch.get(OP, backend).impl
    outputs = impl.bias_dropout_residual_layernorm_fwd(x, bias, residual, weight, ln_bias, eps, dropout_p, seed)
    return distinct(outputs, [x, bias, residual, weight, ln_bias])


@_bdrln.register_fake
def _(x, bias, residual, weight, ln_bias, eps, dropout_p, seed, backend):
    rows = x.shape[0]
    stats = x.new_empty((rows,), dtype=torch.float32)
    return torch.empty_like(x), torch.empty_like(x), stats, torch.empty_like(stats)


@torch.library.custom_op("bertfast::bias_dropout_residual_layernorm_backward", mutates_args=())
def _bdrln_backward(dy: Tensor, pre_norm: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, dropout_p: float,
                    seed: Optional[Tensor], has_bias: bool, has_residual: bool, backend: str
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    impl = dispatch.get(OP, backend).impl
    dx, dbias, dres, dweight, dln_bias = impl.bias_dropout_residual_layernorm_bwd(
        dy.contiguous(), pre_norm, mean, rstd, weight, dropout_p, seed, has_bias, has_residual)
    # Without dropout d(residual) equals dx (a backend may even return one tensor for both);
    # outputs must not alias, so a placeholder tells autograd to reuse dx.
    if not has_residual or dropout_p == 0.0:
        dres = empty(dx)
    return distinct([dx, empty(weight) if dbias is None else dbias, dres, dweight, dln_bias], [dy, pre_norm, weight])


@_bdrln_backward.register_fake
def _(dy, pre_norm, mean, rstd, weight, dropout_p, seed, has_bias, has_residual, backend):
    return (torch.empty_like(dy), torch.empty_like(weight) if has_bias else empty(weight),
            torch.empty_like(dy) if has_residual and dropout_p > 0.0 else empty(dy), torch.empty_like(weight),
            torch.empty_like(weight))


def _setup(ctx, inputs, output):
    x, bias, residual, weight, ln_bias, eps, dropout_p, seed, backend = inputs
    _, pre_norm, mean, rstd = output
    ctx.save_for_backward(pre_norm, mean, rstd, weight, seed)
    ctx.dropout_p, ctx.backend = dropout_p, backend
    ctx.has_bias, ctx.has_residual = bias is not None, residual is not None


def _backward(ctx, dy, _d_pre_norm, _d_mean, _d_rstd):
    pre_norm, mean, rstd, weight, seed = ctx.saved_tensors
    dx, dbias, dres, dweight, dln_bias = _bdrln_backward(dy, pre_norm, mean, rstd, weight, ctx.dropout_p, seed,
                                                         ctx.has_bias, ctx.has_residual, ctx.backend)
    dres = (dx if dres.numel() == 0 else dres) if ctx.has_residual else None
    return dx, or_none(dbias) if ctx.has_bias else None, dres, dweight, dln_bias, None, None, None, None


_bdrln.register_autograd(_backward, setup_context=_setup)


def bias_dropout_residual_layernorm(x: Tensor, bias: Optional[Tensor], residual: Optional[Tensor],
                                    weight: Tensor, ln_bias: Tensor, eps: float,
                                    dropout_p: float = 0.0) -> Tensor:
    """LN(residual + Dropout(x + bias)) * weight + ln_bias over the last dimension; any leading shape."""
    width = x.shape[-1]
    for name, t in (("bias", bias), ("weight", weight), ("ln_bias", ln_bias)):
        if t is not None and tuple(t.shape) != (width,):
            raise ValueError(f"{OP}: expected {name} of shape [{width}], got {tuple(t.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"{OP}: expected residual of shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    dropout_p = check_dropout(dropout_p)
    rows = x.reshape(-1, width)
    res_rows = None if residual is None else residual.reshape(-1, width)
    backend = dispatch.select(OP, x=rows, bias=bias, residual=res_rows, weight=weight, ln_bias=ln_bias)
    y, _, _, _ = _bdrln(rows, bias, res_rows, weight, ln_bias, float(eps), dropout_p,
                        seed_for(dropout_p, x.device), backend)
    return y.view(x.shape)


def layer_norm(x: Tensor, weight: Tensor, ln_bias: Tensor, eps: float) -> Tensor:
    """Plain LayerNorm through the fused op (no bias, no residual, no dropout)."""
    return bias_dropout_residual_layernorm(x, None, None, weight, ln_bias, eps, 0.0)
