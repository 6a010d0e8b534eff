"""The FFN's GEMMs with the bias_gelu op's math in their epilogues (Triton), for
bertfast.residual_linear.ffn: the bias_gelu op's Triton backend's way of running inside an FFN.

  gemm_bias_gelu_fwd   the up-projection: z = x W1^T + b1 and y = GELU(z), both written from the
                       GEMM's fp32 tile (z for the backward); GELU as kernels/bias_gelu.py's
                       _gelu_and_grad (erf or tanh form).
  gemm_gelu_bwd        dy @ W2 (the output projection's input gradient) times GELU'(z), with the bias
                       gradient's fp32 partials: a row per PART_M rows of dz, summed by column_sums.

Each removes a pass of the row kernel over the [tokens, FFN] activations: forward it read the GEMM's
output and wrote y (4 bytes an element in bf16), here the GEMM writes y beside z (2); backward it
read the GEMM's dy @ W2 and z and wrote dz (6), here the GEMM reads z (2). The FFN's other two
GEMMs of each pass stay cuBLAS's.

The GEMM: tiles of BLOCK_M x BLOCK_N over K in BLOCK_K steps, Triton's software pipeline (num_stages)
and wgmma on Hopper; row blocks grouped by GROUP_M so a group's operands stay in L2. Loads past the
edge read wrapped rows and columns (no masks in the main loop), only the stores are masked; K need
not be a multiple of BLOCK_K (EVEN_K: no K mask when it is).

Limits: x [M, K] and dy with unit column stride (rows may be strided); the weights a Linear's
[N, K] (any row stride, unit column stride); one dtype for x, the weights and the bias (autocast's
casts and the optimizer's working copies are made before); any M, N, K. bf16 dots under the
interpreter run on fp32 upcasts (its bf16 dot is wrong), as the attention's do.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from bertfast.contract import check_approximate, check_gemm_bias_gelu, check_rows, row_stride

from ._common import autotune, interpreting, launch
from ._rows import column_sums, n_bucket
from .bias_gelu import _gelu_and_grad


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
    # Row blocks in groups of GROUP_M walk the column blocks together, so a group's A rows and B
    # columns stay in L2 while they are reused.
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Loads of rows and columns past the edge read row / column 0 instead (wrapped), so the main
    # loop needs no row or column masks; only the stores are masked.
    a_ptrs = A + (rows % M).to(tl.int64)[:, None] * stride_am + ks[None, :]
    b_ptrs = B + ks[:, None].to(tl.int64) * stride_bk + (cols % N).to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=ks[None, :] < K - k0, other=0.0)
            b = tl.load(b_ptrs, mask=ks[:, None] < K - k0, other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong: fp32 operands (exact products of bf16)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
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
def _gemm_configs():
    """(BLOCK_M, BLOCK_N, BLOCK_K, stages, warps) for the GEMM with the GELU epilogue: Hopper tiles
    (wgmma, 3-5 stages of cp.async), each spill-free on sm_90 by the compile report (tiles of 128
    fp32 accumulators a thread spilled, and 16 warps over 256 x 128 backward). The first is the
    default: 96 KB of stages and 110 registers let two programs share an SM forward, so one's
    epilogue (GELU over its tile, the stores) runs beside the other's main loop; backward, at 161
    registers, one."""
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_stages=s, num_warps=w)
            for m, n, k, s, w in ((128, 128, 64, 3, 8), (128, 128, 64, 4, 8), (64, 256, 64, 3, 8),
                                  (128, 128, 32, 5, 8), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4))]


def _prune_gemm(configs, named_args, **kwargs):
    """No tile wider than N or deeper than K needs (rounded up to powers of two)."""
    n_cap = max(64, triton.next_power_of_2(named_args["N"]))
    k_cap = max(16, triton.next_power_of_2(named_args["K"]))
    kept = [c for c in configs if c.kwargs["BLOCK_N"] <= n_cap and c.kwargs["BLOCK_K"] <= k_cap]
    return kept or configs[:1]


_gemm_tuned = autotune(_gemm_configs(), ["N", "K", "m_bucket", "BACKWARD", "HAS_Z", "APPROX_TANH"],
                       _prune_gemm)(_gemm_bias_gelu_kernel)


# --------------------------------------------------------------------------- launchers
# Under the interpreter: small tiles (tl.dot needs 16 or more each way), several programs per test.
_GEMM_INTERP = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2}


def _part_m() -> int:
    """PART_M: rows of dz per row of the backward's bias-gradient partials; every BLOCK_M is a
    multiple (the interpreter's twice it, so tests see a program fill two rows)."""
    return 16 if interpreting() else 64


def _gemm(a, b, stride_bk, stride_bn, bias, z, out, part, m, n, k, backward, has_z, approximate):
    args = (a, b, bias, z, out, part, m, n, k, row_stride(a), stride_bk, stride_bn, n_bucket(m))
    upcast = interpreting() and a.dtype == torch.bfloat16
    even_k = k % (_GEMM_INTERP["BLOCK_K"] if interpreting() else 64) == 0  # every candidate's BLOCK_K divides 64
    launch(_gemm_tuned, lambda c: (triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]),), args,
           dict(BACKWARD=backward, HAS_Z=has_z, APPROX_TANH=approximate == "tanh", EVEN_K=even_k, PART_M=_part_m(),
                UPCAST=upcast, DOT_PREC="ieee" if a.dtype == torch.float32 or upcast else "tf32"),
           interp=_GEMM_INTERP)


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
    blocks = triton.cdiv(m, _part_m())
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
