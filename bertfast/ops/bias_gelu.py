"""bias_gelu: y = GELU(x + bias), after the FFN up-projection. x [N, F], bias [F].

Contract (every backend): approximate 'none' (erf, BERT's) or 'tanh'; outputs contiguous in x's
dtype; dbias in bias's dtype, summed in fp32; any F and any number of rows (0 rows: empty y,
zero dbias). The torch backend is at the end of this file; the Triton and CUDA ones are
bertfast.kernels.bias_gelu and bertfast.cuda.bias_gelu.
"""
from __future__ import annotations

import torch

from bertfast import dispatch
from bertfast.contract import check_approximate
from bertfast.ops._common import distinct, fused_op, launch_directly

OP = "bias_gelu"


@fused_op("bertfast::bias_gelu")
def _bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str, backend: str) -> torch.Tensor:
    return distinct([dispatch.get(OP, backend).impl.bias_gelu_fwd(x, bias, approximate)], [x, bias])[0]


@_bias_gelu.register_fake
def _(x, bias, approximate, backend):
    return x.new_empty(x.shape)


@fused_op("bertfast::bias_gelu_backward")
def _bias_gelu_backward(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, approximate: str,
                        backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return distinct(dispatch.get(OP, backend).impl.bias_gelu_bwd(dy.contiguous(), x, bias, approximate), [dy, x, bias])


@_bias_gelu_backward.register_fake
def _(dy, x, bias, approximate, backend):
    return x.new_empty(x.shape), torch.empty_like(bias)


def _setup(ctx, inputs, output):
    x, bias, approximate, backend = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate, ctx.backend = approximate, backend


def _backward(ctx, dy):
    x, bias = ctx.saved_tensors
    dx, dbias = _bias_gelu_backward(dy, x, bias, ctx.approximate, ctx.backend)
    return dx, dbias, None, None


_bias_gelu.register_autograd(_backward, setup_context=_setup)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU(x + bias) over the last dimension; any leading shape. approximate: 'none' (erf) or 'tanh'."""
    check_approximate(approximate)
    if bias.dim() != 1 or x.shape[-1] != bias.shape[0]:
        raise ValueError(f"bias_gelu: expected bias of shape [{x.shape[-1]}] for x of shape {tuple(x.shape)}, "
                         f"got {tuple(bias.shape)}")
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[-1] > 1 and rows.stride(-1) != 1:
        rows = rows.contiguous()
    backend = dispatch.select(OP, x=rows, bias=bias)
    if launch_directly(rows, bias):
        return dispatch.get(OP, backend).impl.bias_gelu_fwd(rows, bias, approximate).view(x.shape)
    return _bias_gelu(rows, bias, approximate, backend).view(x.shape)


# ------------------------------------------------------------------ the torch backend
def bias_gelu_fwd(x, bias, approximate="none"):
    h = x.float() + bias.float()
    return torch.ops.aten.gelu_(h, approximate=approximate).to(x.dtype)  # in place: one allocation less


def bias_gelu_bwd(dy, x, bias, approximate="none"):
    dx = torch.ops.aten.gelu_backward(dy.float(), x.float() + bias.float(), approximate=approximate)
    return dx.to(x.dtype).contiguous(), dx.sum(0).to(bias.dtype)
