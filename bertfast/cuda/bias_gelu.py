"""bias_gelu on the CUDA backend (csrc/bias_gelu.cu): y = GELU(x + bias), forward and backward."""
from __future__ import annotations

from typing import Tuple

import torch

from bertfast.contract import GELU_APPROXIMATIONS, check_bias_gelu, check_rows, row_stride
from bertfast.cuda import _common as C

_APPROX = {name: code for code, name in enumerate(GELU_APPROXIMATIONS)}  # the launcher's codes: 0 erf, 1 tanh


def unsupported(inputs) -> list:
    """Dispatch: reasons these inputs exceed this backend's limits: none (any width, any rows)."""
    return []


def _check(x, bias, approximate) -> Tuple[int, int]:
    C.on_device(x=x, bias=bias)
    return check_bias_gelu(x, bias, approximate)


def bias_gelu_fwd(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """y = gelu(x + bias). x [N, F] (row-strided ok), bias [F] -> y [N, F] in x's dtype."""
    n, f = _check(x, bias, approximate)
    y = torch.empty((n, f), dtype=x.dtype, device=x.device)
    if n == 0 or f == 0:
        return y
    b = C.cast(bias, C.param_dtype(x.dtype, bias.dtype))
    C.launch(x.device, "bias_gelu_fwd", x.data_ptr(), row_stride(x), b.data_ptr(), y.data_ptr(), n, f,
             C.DTYPE_CODE[x.dtype], C.DTYPE_CODE[b.dtype], _APPROX[approximate])
    return y


def bias_gelu_bwd(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor,
                  approximate: str = "none") -> Tuple[torch.Tensor, torch.Tensor]:
    """dx = dy * gelu'(x + bias) [N, F], dbias = sum_rows dx [F] (bias's dtype; fp32 partials, no atomics)."""
    n, f = _check(x, bias, approximate)
    C.on_device(dy=dy)
    check_rows("dy", dy, n, f, dtypes=(x.dtype,), device=x.device)
    dx = torch.empty((n, f), dtype=x.dtype, device=x.device)
    pdt = C.param_dtype(x.dtype, bias.dtype)
    if n == 0 or f == 0:
        return dx, torch.zeros_like(bias)
    b = C.cast(bias, pdt)
    dbias = torch.empty(f, dtype=pdt, device=x.device)
    ws = torch.empty((C.reduction_blocks(n), f), dtype=torch.float32, device=x.device)
    C.launch(x.device, "bias_gelu_bwd", dy.data_ptr(), row_stride(dy), x.data_ptr(), row_stride(x), b.data_ptr(),
             dx.data_ptr(), dbias.data_ptr(), ws.data_ptr(), n, f, C.DTYPE_CODE[x.dtype], C.DTYPE_CODE[pdt],
             _APPROX[approximate])
    return dx, dbias.to(bias.dtype)
