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

In the FFN's GEMMs (training on a GPU: bertfast.model.residual_linear.ffn takes a backend that has
gemm_bias_gelu_fwd and gemm_gelu_bwd, this one):
  gemm_bias_gelu_fwd   the up-projection: z = x W1^T + b1 and y = GELU(z), both written from the
                       GEMM's fp32 tile (z for the backward).
  gemm_gelu_bwd        dy @ W2 (the output projection's input gradient) times GELU'(z), with the bias
                       gradient's fp32 partials: a row per PART_M rows of dz, summed by column_sums.
Each removes a pass of the row kernels over the [tokens, FFN] activations: forward they read the
GEMM's output and wrote y (4 bytes an element in bf16), here the GEMM writes y beside z (2);
backward they read the GEMM's dy @ W2 and z and wrote dz (6), here the GEMM reads z (2). The FFN's
other two GEMMs of each pass stay cuBLAS's. The GEMM's tile and main loop are kernels/_gemm.py's
(grouped row blocks, wrapped loads, masked stores, wgmma through Triton's pipeline). x and dy with
unit column stride (rows may be strided), the weights a Linear's [N, K] (any row stride), one dtype
for x, the weights and the bias (autocast's casts and the optimizer's working copies are made
before); any M, N, K.

Limits (the row kernels): any F, any number of rows; x and dy 2-D with unit column stride (rows may be strided,
stride(0) >= F), anything else is a ValueError. Outputs are contiguous, in x's dtype; dbias
takes bias's dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from bertfast.contract import check_approximate, check_bias_gelu, check_gemm_bias_gelu, check_rows, row_stride

from ._common import autotune, cdiv, interpreting, launch, next_power_of_2
from ._gemm import INTERP_TILE, gemm_flags, grouped_tile, tile_product
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


@triton.jit
def _gemm_bias_gelu_kernel(
    A,      # [M, K] rows, row stride stride_am, column stride 1
    B,      # B[k, n] at B + k * stride_bk + n * stride_bn (a Linear's weight, either way round)
    BIAS,   # [N] (forward)
    Z,      # [M, N] contiguous pre-activation: written (forward, HAS_Z) or read (backward, HAS_Z set)
    OUT,    # [M, N] contiguous: y = GELU(z) (forward), dz = (A @ B) * GELU'(z) (backward)
    DBIAS_PART,  # [cdiv(M, PART_M), N] fp32 column sums of dz (backward): a row block's sums in
                 # its first row of BLOCK_M / PART_M, zeros in the others
    M, N, K, stride_am, stride_bk, stride_bn,
    m_bucket,  # autotune key only
    BACKWARD: tl.constexpr, HAS_Z: tl.constexpr, APPROX_TANH: tl.constexpr, EVEN_K: tl.constexpr,
    PART_M: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    rows, cols, pid_m, _ = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tile_product(A, B, rows, cols, M, N, K, stride_am, stride_bk, stride_bn, EVEN_K, UPCAST, DOT_PREC,
                       BLOCK_M, BLOCK_N, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if BACKWARD:
        z = tl.load(Z + offs, mask=mask, other=0.0).to(tl.float32)
        _, grad = _gelu_and_grad(z, APPROX_TANH, True)
        dz = tl.where(mask, acc * grad, 0.0)
        tl.store(OUT + offs, dz.to(OUT.dtype.element_ty), mask=mask)
        part = DBIAS_PART + pid_m * (BLOCK_M // PART_M) * N + cols
        tl.store(part, tl.sum(dz, axis=0), mask=col_ok)
        for r in tl.static_range(1, BLOCK_M // PART_M):  # no zero-fill pass over the partials
            row_exists = cols * 0 + pid_m * BLOCK_M + r * PART_M < M  # a block (the interpreter wants one)
            tl.store(part + r * N, tl.zeros([BLOCK_N], dtype=tl.float32), mask=col_ok & row_exists)
    else:
        z = acc + tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_Z:
            tl.store(Z + offs, z.to(Z.dtype.element_ty), mask=mask)
        y, _ = _gelu_and_grad(z, APPROX_TANH, False)
        tl.store(OUT + offs, y.to(OUT.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- launch configs
def _tile_configs():
    """(BLOCK_N, BLOCK_F, num_warps): tiles of 2K..8K elements, 8..32 per thread, all spill-free on
    sm_90 (compile report); the first is the default. Pruned per F by _prune_tiles: at most 6."""
    return [triton.Config({"BLOCK_N": n, "BLOCK_F": f}, num_warps=w)
            for n, f, w in ((4, 1024, 8), (2, 1024, 4), (1, 2048, 8), (8, 1024, 8), (4, 512, 4), (8, 256, 4))]


def _prune_tiles(configs, named_args, **kwargs):
    """No tile wider than F needs (F rounded up to a power of two, at least 256)."""
    f_cap = max(256, next_power_of_2(named_args["F"]))
    return [c for c in configs if c.kwargs["BLOCK_F"] <= f_cap]


def _gemm_configs():
    """(BLOCK_M, BLOCK_N, BLOCK_K, stages, warps) for the GEMM with the GELU epilogue: Hopper tiles
    (wgmma, 3-5 stages of cp.async), each spill-free on sm_90 by the compile report (tiles of 128
    fp32 accumulators a thread spilled, and 16 warps over 256 x 128 backward). The first is the
    forward's default: 96 KB of stages and 110 registers let two programs share an SM, so one's
    epilogue (GELU over its tile, the stores) runs beside the other's main loop. Backward it takes 161
    registers, one program an SM, so _prune_gemm puts _GEMM_BWD_DEFAULT first there."""
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_stages=s, num_warps=w)
            for m, n, k, s, w in ((128, 128, 64, 3, 8), (128, 128, 64, 4, 8), (64, 256, 64, 3, 8),
                                  (128, 128, 32, 5, 8), _GEMM_BWD_DEFAULT, (128, 64, 64, 4, 4))]


# The backward's default (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps): one warpgroup, 139-154 registers and
# 96 KB of stages, two programs an SM, as the forward's default holds; predicted 222 us against the
# list's first 250 at BERT-large's 16,384 tokens (H100; docs/perf-model.md, "The step budget").
_GEMM_BWD_DEFAULT = (64, 128, 64, 4, 4)


def _gemm_shape(config) -> tuple:
    """A GEMM config as _gemm_configs lists it: (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)."""
    k = config.kwargs
    return k["BLOCK_M"], k["BLOCK_N"], k["BLOCK_K"], config.num_stages, config.num_warps


def _prune_gemm(configs, named_args, **kwargs):
    """No tile wider than N or deeper than K needs (rounded up to powers of two); backward,
    _GEMM_BWD_DEFAULT first (the fixed mode's config), the others in their order."""
    n_cap = max(64, next_power_of_2(named_args["N"]))
    k_cap = max(16, next_power_of_2(named_args["K"]))
    kept = [c for c in configs if c.kwargs["BLOCK_N"] <= n_cap and c.kwargs["BLOCK_K"] <= k_cap] or configs[:1]
    if kwargs.get("BACKWARD"):
        kept.sort(key=lambda c: _gemm_shape(c) != _GEMM_BWD_DEFAULT)
    return kept


_fwd_tuned = autotune(_tile_configs(), ["F", "n_bucket", "APPROX_TANH"], _prune_tiles)(_bias_gelu_fwd_kernel)
_bwd_tuned = autotune(_tile_configs(), ["F", "n_bucket", "APPROX_TANH"], _prune_tiles)(_bias_gelu_bwd_kernel)
_gemm_tuned = autotune(_gemm_configs(), ["N", "K", "m_bucket", "BACKWARD", "HAS_Z", "APPROX_TANH"],
                       _prune_gemm)(_gemm_bias_gelu_kernel)


def _interp_block_f(f: int) -> int:
    return min(1024, max(16, next_power_of_2(f)))


def _row_groups(n: int, device: torch.device):
    """(G, rows_per_program) for the backward's dbias partials.

    On GPU 32 rows per program: many small programs (several waves, so a partial last wave costs
    little) while the [G, F] fp32 partials add only 4 / (32 * 6) ~ 2% to the bf16 traffic.
    Under the interpreter three groups, so tests cross group borders.
    """
    if device.type != "cuda":
        return row_group_shape(n, 3)
    rpp = 2 * MAX_ROWS_PER_TILE
    return cdiv(n, rpp), rpp


# --------------------------------------------------------------------------- launchers
def bias_gelu_fwd(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """y = GELU(x + bias): x [N, F], bias [F] -> y [N, F] in x's dtype."""
    n, f = check_bias_gelu(x, bias, approximate)
    y = torch.empty((n, f), dtype=x.dtype, device=x.device)
    if n == 0 or f == 0:
        return y
    args = (x, bias, y, n, f, row_stride(x), n_bucket(n))
    block_f = _interp_block_f(f)
    launch(_fwd_tuned, lambda m: (cdiv(n, m["BLOCK_N"]), cdiv(f, m["BLOCK_F"])), args,
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
    launch(_bwd_tuned, lambda m: (groups, cdiv(f, m["BLOCK_F"])), args,
           dict(APPROX_TANH=approximate == "tanh"), interp={"BLOCK_N": 4, "BLOCK_F": _interp_block_f(f)})
    return dx, column_sums(part.view(1, groups, f), [bias.dtype])[0]


# --------------------------------------------------------------------------- the FFN's GEMMs
def _part_m() -> int:
    """PART_M: rows of dz per row of the backward's bias-gradient partials; every BLOCK_M is a
    multiple (the interpreter's twice it, so tests see a program fill two rows)."""
    return 16 if interpreting() else 64


def _gemm(a, b, stride_bk, stride_bn, bias, z, out, part, m, n, k, backward, has_z, approximate):
    args = (a, b, bias, z, out, part, m, n, k, row_stride(a), stride_bk, stride_bn, n_bucket(m))
    launch(_gemm_tuned, lambda c: (cdiv(m, c["BLOCK_M"]) * cdiv(n, c["BLOCK_N"]),), args,
           dict(BACKWARD=backward, HAS_Z=has_z, APPROX_TANH=approximate == "tanh", PART_M=_part_m(),
                **gemm_flags(a.dtype, k)), interp=INTERP_TILE)


def gemm_bias_gelu_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, approximate: str = "none",
                       store_z: bool = True):
    """(y, z): z = x @ weight^T + bias, y = GELU(z), from one GEMM whose epilogue adds the bias and
    applies GELU. x [M, K], weight [N, K] (a Linear's), bias [N], one dtype; y and z [M, N] in it
    (z None unless store_z: the backward's)."""
    m, n, k = check_gemm_bias_gelu(x, weight, bias, approximate)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    z = torch.empty((m, n), dtype=x.dtype, device=x.device) if store_z else None
    if m and n:
        if k == 0:
            return _empty_gemm_fwd(y, z, bias, approximate)
        _gemm(x, weight, 1, row_stride(weight), bias, z if store_z else y, y, y, m, n, k, False, store_z, approximate)
    return y, z


def gemm_gelu_bwd(dy: torch.Tensor, weight: torch.Tensor, z: torch.Tensor, approximate: str = "none",
                  bias_dtype: Optional[torch.dtype] = None):
    """(dz, dbias) for y = GELU(z) followed by a Linear of ``weight`` [N2, N] whose output's gradient
    is dy [M, N2]: dz = (dy @ weight) * GELU'(z) [M, N] in z's dtype from one GEMM whose epilogue
    applies GELU', dbias = its column sums (fp32, then bias_dtype, default z's)."""
    m, n2 = check_rows("dy", dy)
    _, n = check_rows("weight", weight, n2, None, dtypes=(dy.dtype,), device=dy.device)
    check_rows("z", z, m, n, dtypes=(dy.dtype,), device=dy.device)
    check_approximate(approximate)
    dz = torch.empty((m, n), dtype=z.dtype, device=z.device)
    bias_dtype = bias_dtype or z.dtype
    if m == 0 or n == 0 or n2 == 0:
        return dz.zero_(), torch.zeros((n,), dtype=bias_dtype, device=z.device)
    z = z if z.is_contiguous() else z.contiguous()
    blocks = cdiv(m, _part_m())
    part = torch.empty((blocks, n), dtype=torch.float32, device=z.device)
    _gemm(dy, weight, row_stride(weight), 1, dz, z, dz, part, m, n, n2, True, True, approximate)
    return dz, column_sums(part.view(1, blocks, n), [bias_dtype])[0]


def _empty_gemm_fwd(y, z, bias, approximate):
    """K = 0: z is the bias on every row."""
    z_full = bias.float().expand(y.shape)
    y.copy_(torch.nn.functional.gelu(z_full, approximate=approximate))
    if z is not None:
        z.copy_(z_full)
    return y, z
