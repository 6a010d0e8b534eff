"""bias_dropout_residual_layernorm on the CUDA backend (csrc/bias_dropout_residual_layernorm.cu):
y = LN(residual + Dropout(x + bias)) * weight + ln_bias, forward and backward.

Dropout: keep = uniform(philox(seed, row, col // 4)[col % 4]) >= p, kept values scaled by
1 / (1 - p) (csrc/README.md); return_dropout_mask gives exactly that mask.
"""
from __future__ import annotations

from typing import Optional

import torch

from bertfast.contract import check_dropout, check_eps, check_rows, check_tensor, check_vector, row_stride
from bertfast.cuda import _common as C


def unsupported(inputs) -> list:
    """Dispatch: reasons these inputs exceed this backend's limits ([] when it runs them)."""
    return C.hidden_reasons(inputs["x"].shape[-1])


def bias_dropout_residual_layernorm_fwd(x: torch.Tensor, bias: Optional[torch.Tensor],
                                        residual: Optional[torch.Tensor], weight: torch.Tensor,
                                        ln_bias: torch.Tensor, eps: float, dropout_p: float,
                                        seed: Optional[torch.Tensor], return_dropout_mask: bool = False):
    """y = LN(residual + Dropout(x + bias)) * weight + ln_bias.

    x, residual: [N, H] (row-strided ok; H <= 8192); bias, weight, ln_bias: [H].
    Returns (y [N, H], pre_norm [N, H] (activation dtype) | None, mean [N] fp32, rstd [N] fp32)
    (+ keep bool [N, H] when return_dropout_mask); pre_norm is None without bias, residual and
    dropout (it would be x).
    """
    C.on_device(x=x, bias=bias, residual=residual, weight=weight, ln_bias=ln_bias, seed=seed)
    n, h = check_rows("x", x)
    C.check_hidden("x", x, h)
    if residual is not None:
        check_rows("residual", residual, n, h, dtypes=(x.dtype,), device=x.device)
    if bias is not None:
        check_vector("bias", bias, h, x.device)
    check_vector("weight", weight, h, x.device)
    check_vector("ln_bias", ln_bias, h, x.device)
    eps = check_eps(eps)
    dropout_p = check_dropout(dropout_p, seed, x.device)

    dev = x.device
    y = torch.empty((n, h), dtype=x.dtype, device=dev)
    pre = torch.empty((n, h), dtype=x.dtype, device=dev)  # the kernel always writes it
    mean = torch.empty(n, dtype=torch.float32, device=dev)
    rstd = torch.empty(n, dtype=torch.float32, device=dev)
    keep = torch.empty((n, h), dtype=torch.bool, device=dev) if return_dropout_mask else None
    if n > 0:
        pdt = C.param_dtype(x.dtype, weight.dtype)
        w, lb, b = C.cast(weight, pdt), C.cast(ln_bias, pdt), C.cast(bias, pdt)
        C.launch(dev, "bias_dropout_residual_layernorm_fwd", x.data_ptr(), row_stride(x), C.ptr(b), C.ptr(residual),
                 row_stride(residual) if residual is not None else 0, w.data_ptr(), lb.data_ptr(),
                 y.data_ptr(), pre.data_ptr(), mean.data_ptr(), rstd.data_ptr(), C.ptr(keep), n, h,
                 eps, dropout_p, C.seed_ptr(seed, dropout_p), C.DTYPE_CODE[x.dtype], C.DTYPE_CODE[pdt])
    if bias is None and residual is None and dropout_p == 0.0:
        pre = None
    if return_dropout_mask:
        return y, pre, mean, rstd, keep
    return y, pre, mean, rstd


def bias_dropout_residual_layernorm_bwd(dy: torch.Tensor, pre_norm: torch.Tensor, mean: torch.Tensor,
                                        rstd: torch.Tensor, weight: torch.Tensor, dropout_p: float,
                                        seed: Optional[torch.Tensor], has_bias: bool, has_residual: bool):
    """Gradients of bias_dropout_residual_layernorm_fwd (pre_norm: the forward's, or x where it
    returned None).

    Returns (dx [N, H], dbias [H] | None, dresidual [N, H] | None, dweight [H], dln_bias [H]);
    parameter gradients in weight's dtype (dbias too: the forward's bias is assumed to share it),
    reduced over rows from fp32 per-block partials (no atomics).
    """
    C.on_device(dy=dy, pre_norm=pre_norm, mean=mean, rstd=rstd, weight=weight, seed=seed)
    n, h = check_rows("pre_norm", pre_norm)
    C.check_hidden("pre_norm", pre_norm, h)
    dev = pre_norm.device
    check_rows("dy", dy, n, h, dtypes=(pre_norm.dtype,), device=dev)
    check_tensor("mean", mean, dtypes=(torch.float32,), shape=(n,), device=dev)
    check_tensor("rstd", rstd, dtypes=(torch.float32,), shape=(n,), device=dev)
    check_vector("weight", weight, h, dev)
    dropout_p = check_dropout(dropout_p, seed, dev)

    act = pre_norm.dtype
    pdt = C.param_dtype(act, weight.dtype)
    w = C.cast(weight, pdt)
    mean, rstd = mean.contiguous(), rstd.contiguous()
    dx = torch.empty((n, h), dtype=act, device=dev)
    dres = torch.empty((n, h), dtype=act, device=dev) if has_residual else None
    dbias = torch.empty(h, dtype=pdt, device=dev) if has_bias else None
    dweight = torch.empty(h, dtype=pdt, device=dev)
    dln_bias = torch.empty(h, dtype=pdt, device=dev)
    ws = torch.empty((C.reduction_blocks(n), 3, h), dtype=torch.float32, device=dev)
    C.launch(dev, "bias_dropout_residual_layernorm_bwd", dy.data_ptr(), row_stride(dy), pre_norm.data_ptr(),
             row_stride(pre_norm), mean.data_ptr(), rstd.data_ptr(), w.data_ptr(), dx.data_ptr(), C.ptr(dres),
             C.ptr(dbias), dweight.data_ptr(), dln_bias.data_ptr(), ws.data_ptr(), n, h, dropout_p,
             C.seed_ptr(seed, dropout_p), C.DTYPE_CODE[act], C.DTYPE_CODE[pdt])
    back = weight.dtype
    return (dx, None if dbias is None else dbias.to(back), dres, dweight.to(back), dln_bias.to(back))
