"""Fused bias + GELU after the FFN up-projection, forward and backward.

Math, elementwise on z = x + bias (bias broadcast over rows), in fp32 after upcasting loads:

  exact (approximate='none', BERT's):
    y     = z * Phi(z),                 Phi(z) = (1 + erf(z / sqrt(2))) / 2
    dy/dz = Phi(z) + z * phi(z),        phi(z) = exp(-z^2 / 2) / sqrt(2 pi)
    Phi is Abramowitz & Stegun 26.2.17 (a degree-5 polynomial in t = 1 / (1 + 0.2316419 |z|)
    times phi, 7.5e-8 absolute); with fp32 evaluation and an approximate reciprocal the error
    stays below 1e-6 absolute, the size of fp32 rounding of y, at half the instructions of erf
    (erf made the bf16 kernels instruction-bound rather than memory-bound on H100/H200).
  tanh (approximate='tanh'):
    k     = sqrt(2 / pi) * (z + 0.044715 z^3)
    y     = z * (1 + tanh(k)) / 2 = z * s,      s = sigmoid(2k)
    dy/dz = s + z * 2 s (1 - s) * sqrt(2 / pi) * (1 + 3 * 0.044715 z^2)

  backward: dx = dy * dy/dz;  dbias = sum_rows dx.
  dbias: each program owns a block of rows and a block of columns and writes its fp32 column
  sums to one row of a [G, F] buffer; one reduction over G follows. No atomics.

Launch: 2-D tiles [BLOCK_N, BLOCK_F], autotuned on GPU per F, size class of N, dtypes and
variant; a fixed tile under the interpreter. The backward gives each program 32 rows (on GPU).

Limits: any F, any number of rows; x and dy 2-D with unit column stride (rows may be strided,
stride(0) >= F), anything else is a ValueError. Outputs are contiguous, in x's dtype; dbias
takes bias's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from bertfast.contract import check_bias_gelu, check_rows, row_stride

from ._common import autotune, launch
from ._rows import MAX_ROWS_PER_TILE, column_sums, n_bucket, row_group_shape


def unsupported(inputs) -> list:
    """Dispatch: reasons these inputs exceed this backend's limits: none (any width, any rows)."""
    return []


# --------------------------------------------------------------------------- kernels
@triton.jit
def _gelu_and_grad(z, APPROX_TANH: tl.constexpr, NEED_GRAD: tl.constexpr):
    """(GELU(z), dGELU/dz) for fp32 z; the gradient is 0 unless NEED_GRAD.

    Constants are folded so each form costs one exp2 and one rsqrt (the bf16 kernels are
    otherwise limited by instruction issue, not memory, on H100/H200). Reciprocals are taken
    as rsqrt(d)^2: a bare MUFU.RSQ (relative error ~3e-7) where 1/d compiles to a range-checked
    division about four times longer; d >= 1 here, so no range checks are needed.
    """
    if APPROX_TANH:
        # e = exp(-2k) = exp2(z * (C1 + C2 z^2)), C1 = -2 sqrt(2/pi) log2(e), C2 = 0.044715 C1;
        # clamped so e stays finite. s = sigmoid(2k) = 1 / (1 + e), and 1 - s = e * s (no cancellation).
        z2 = z * z
        e = tl.exp2(tl.minimum(z * (-2.302208198144325 + -0.1029432395800235 * z2), 100.0))
        r = tl.rsqrt(1.0 + e)
        s = r * r
        y = z * s
        grad = 0.0
        if NEED_GRAD:
            # s + z * 2 s (1 - s) * sqrt(2/pi) * (1 + 3 * 0.044715 z^2)
            grad = s + (z * (e * s) * s) * (1.5957691216057308 + 0.21406444881780076 * z2)
    else:
        # Phi(z) by Abramowitz & Stegun 26.2.17 (|error| < 7.5e-8, below fp32 rounding of y):
        #   Q = phi(|z|) * t (b1 + t (b2 + t (b3 + t (b4 + t b5)))),  t = 1 / (1 + 0.2316419 |z|)
        #   Phi(z) = 1 - Q for z >= 0, Q for z < 0 (no cancellation in the negative tail).
        # e = exp(-z^2 / 2); the b_i below are pre-multiplied by 1 / sqrt(2 pi).
        e = tl.exp2(z * z * -0.7213475204444817)
        r = tl.rsqrt(1.0 + 0.2316419 * tl.abs(z))
        t = r * r
        q = t * (0.1274147958962986 + t * (-0.14224836829963933 + t * (
            0.7107068706716199 + t * (-0.7265760130580615 + t * 0.5307027142649737)))) * e
        cdf = tl.where(z >= 0.0, 1.0 - q, q)
        y = z * cdf
        grad = 0.0
        if NEED_GRAD:
            grad = cdf + z * e * 0.3989422804014327   # Phi(z) + z phi(z)
    return y, grad


@triton.jit
def _bias_gelu_fwd_kernel(
    X,     # [N, F] input, row stride stride_x, column stride 1
    BIAS,  # [F]
    Y,     # [N, F] output, contiguous
    N, F, stride_x,
    n_bucket,  # autotune key only
    APPROX_TANH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    col_ok = cols < F
    mask = (rows < N)[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    z = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y, _ = _gelu_and_grad(z, APPROX_TANH, False)
    tl.store(Y + rows64 * F + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(
    DY,     # [N, F] upstream gradient, row stride stride_dy
    X,      # [N, F] forward input, row stride stride_x
    BIAS,   # [F]
    DX,     # [N, F] gradient of x, contiguous
    DBIAS_PART,  # [G, F] fp32 column sums of dx, one row per row-group (program_id(0))
    N, F, stride_dy, stride_x, rows_per_program,
    n_bucket,  # autotune key only
    APPROX_TANH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
):
    group = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    col_ok = cols < F
    b = tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)
    row_start = group * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, N)
    acc = tl.zeros([BLOCK_N, BLOCK_F], dtype=tl.float32)
    for n0 in range(row_start, row_end, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        mask = (rows < row_end)[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        z = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32) + b[None, :]
        dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        _, grad = _gelu_and_grad(z, APPROX_TANH, True)
        dx = dy * grad  # 0 where masked, since dy is
        tl.store(DX + rows64 * F + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        acc += dx
    tl.store(DBIAS_PART + group * F + cols, tl.sum(acc, axis=0), mask=col_ok)


# --------------------------------------------------------------------------- launch configs
def _tile_configs():
    """(BLOCK_N, BLOCK_F, num_warps): tiles of 2K..8K elements, 8..32 per thread, all spill-free on
    sm_90 (compile report); the first is the default. Pruned per F by _prune_tiles: at most 6."""
    return [triton.Config({"BLOCK_N": n, "BLOCK_F": f}, num_warps=w)
            for n, f, w in ((4, 1024, 8), (2, 1024, 4), (1, 2048, 8), (8, 1024, 8), (4, 512, 4), (8, 256, 4))]


def _prune_tiles(configs, named_args, **kwargs):
    """No tile wider than F needs (F rounded up to a power of two, at least 256)."""
    f_cap = max(256, triton.next_power_of_2(named_args["F"]))
    return [c for c in configs if c.kwargs["BLOCK_F"] <= f_cap]


_fwd_tuned = autotune(_tile_configs(), ["F", "n_bucket", "APPROX_TANH"], _prune_tiles)(_bias_gelu_fwd_kernel)
_bwd_tuned = autotune(_tile_configs(), ["F", "n_bucket", "APPROX_TANH"], _prune_tiles)(_bias_gelu_bwd_kernel)


def _interp_block_f(f: int) -> int:
    return min(1024, max(16, triton.next_power_of_2(f)))


def _row_groups(n: int, device: torch.device):
    """(G, rows_per_program) for the backward's dbias partials.

    On GPU 32 rows per program: many small programs (several waves, so a partial last wave costs
    little) while the [G, F] fp32 partials add only 4 / (32 * 6) ~ 2% to the bf16 traffic.
    Under the interpreter three groups, so tests cross group borders.
    """
    if device.type != "cuda":
        return row_group_shape(n, 3)
    rpp = 2 * MAX_ROWS_PER_TILE
    return triton.cdiv(n, rpp), rpp


# --------------------------------------------------------------------------- launchers
def bias_gelu_fwd(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """y = GELU(x + bias): x [N, F], bias [F] -> y [N, F] in x's dtype."""
    n, f = check_bias_gelu(x, bias, approximate)
    y = torch.empty((n, f), dtype=x.dtype, device=x.device)
    if n == 0 or f == 0:
        return y
    args = (x, bias, y, n, f, row_stride(x), n_bucket(n))
    block_f = _interp_block_f(f)
    launch(_fwd_tuned, lambda m: (triton.cdiv(n, m["BLOCK_N"]), triton.cdiv(f, m["BLOCK_F"])), args,
           dict(APPROX_TANH=approximate == "tanh"),
           interp={"BLOCK_N": max(1, min(16, 4096 // block_f)), "BLOCK_F": block_f})
    return y


def bias_gelu_bwd(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, approximate: str = "none"):
    """(dx [N, F] in x's dtype, dbias [F] in bias's dtype, summed in fp32) for y = GELU(x + bias)."""
    n, f = check_bias_gelu(x, bias, approximate)
    check_rows("dy", dy, n, f, dtypes=(x.dtype,), device=x.device)
    dx = torch.empty((n, f), dtype=x.dtype, device=x.device)
    if n == 0 or f == 0:
        return dx, torch.zeros((f,), dtype=bias.dtype, device=x.device)
    groups, rpp = _row_groups(n, x.device)
    part = torch.empty((groups, f), dtype=torch.float32, device=x.device)
    args = (dy, x, bias, dx, part, n, f, row_stride(dy), row_stride(x), rpp, n_bucket(n))
    launch(_bwd_tuned, lambda m: (groups, triton.cdiv(f, m["BLOCK_F"])), args,
           dict(APPROX_TANH=approximate == "tanh"), interp={"BLOCK_N": 4, "BLOCK_F": _interp_block_f(f)})
    return dx, column_sums(part.view(1, groups, f), [bias.dtype])[0]
