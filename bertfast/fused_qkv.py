"""The query, key and value projections as one GEMM, without copying their weights on every call.

The three nn.Linear modules and their parameters stay what transformers has (state-dict keys,
PEFT targets, optimizers see three weights and three biases), but their tensors live in one
[3H, H] weight buffer and one [3H] bias buffer, back to back (``share_storage``). The GEMM then
runs over a view of each buffer (``joined``); autograd gets the three parameters' gradients from
``_JoinedLinear``, as views of one [3H, H] gradient.

What re-homes the tensors: the module's construction, ``.to()``/``.half()`` and the like (the
module's ``_apply``), ``load_state_dict`` (a post-hook, for ``assign=True``) and
``from_pretrained``. Whenever the three are not back to back (FSDP's flat parameters, a weight
replaced by hand, under torch.compile) the weights are concatenated per call, as before: the same
numbers, one copy more.

A cache of the concatenation keyed on the weights' version counters would go stale: torch's fused
AdamW and ``.data`` writes update weights without bumping them.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from bertfast.ops._common import PLAIN_TYPES

Tensor = torch.Tensor


def joined(parts: Sequence[Tensor]) -> Optional[Tensor]:
    """The tensors ``parts`` (each [n_i, ...]) as one [sum n_i, ...] view, when they lie back to back in
    one storage, contiguous, of one dtype; otherwise None. Called per forward, so it reads addresses
    only (no storage objects): parts at consecutive addresses inside the first part's storage are that
    storage (as_strided refuses a view past its end)."""
    first = parts[0]
    if type(first) not in PLAIN_TYPES or first.device.type == "meta":
        return None
    address, size, rows = first.data_ptr(), first.element_size(), 0
    for part in parts:
        if (type(part) not in PLAIN_TYPES or part.dtype != first.dtype or part.shape[1:] != first.shape[1:]
                or not part.is_contiguous() or part.data_ptr() != address):
            return None
        address += part.numel() * size
        rows += part.shape[0]
    try:
        return first.detach().as_strided((rows,) + tuple(first.shape[1:]), first.stride(), first.storage_offset())
    except RuntimeError:  # the next part starts where the first's storage ends: another allocation
        return None


def share_storage(parts: Sequence[Tensor]) -> None:
    """Move the parameters ``parts`` into one buffer, back to back, keeping each Parameter object (and
    so optimizers' references). Nothing to do when they already are, or are on the meta device, or
    differ in dtype, device or trailing shape."""
    first = parts[0]
    if (joined(parts) is not None or any(type(p) is not torch.nn.Parameter for p in parts)
            or first.device.type == "meta"
            or any(p.dtype != first.dtype or p.device != first.device or p.shape[1:] != first.shape[1:]
                   for p in parts)):
        return
    with torch.no_grad():
        buffer = torch.cat([p.detach() for p in parts])
    for p, view in zip(parts, buffer.split([p.shape[0] for p in parts])):
        p.data = view


class _JoinedLinear(torch.autograd.Function):
    """y = x @ W^T + b with W, b the joined views of the parameters given after them; the gradients of
    W and b come back split into the parameters'. Under autocast the GEMMs run in its dtype, as
    F.linear's would."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, *params: Tensor) -> Tensor:
        device_type, x_dtype = x.device.type, x.dtype
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            x, weight, bias = x.to(dtype), weight.to(dtype), bias.to(dtype)
        with torch.autocast(device_type, enabled=False):
            y = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.rows = [p.shape[0] for p in params[: len(params) // 2]]
        ctx.dtypes = (x_dtype, params[0].dtype)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight = ctx.saved_tensors
        x_dtype, param_dtype = ctx.dtypes
        dy = dy.to(weight.dtype)
        dx = (dy @ weight).to(x_dtype) if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[3:]):
            return (dx, None, None) + (None,) * (2 * len(ctx.rows))
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dweight = (dy2.t() @ x2).to(param_dtype).split(ctx.rows)
        dbias = dy2.sum(0).to(param_dtype).split(ctx.rows)
        return (dx, None, None, *dweight, *dbias)


def linear(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor]) -> Tensor:
    """x @ cat(weights)^T + cat(biases): one GEMM, over views of the parameters when they share one buffer."""
    weight, bias = None, None
    if not torch.compiler.is_compiling():
        weight, bias = joined(weights), joined(biases)
    if weight is None or bias is None:
        return F.linear(x, torch.cat(list(weights)), torch.cat(list(biases)))
    if not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in (*weights, *biases))):
        return F.linear(x, weight, bias)
    return _JoinedLinear.apply(x, weight, bias, *weights, *biases)
