"""What the Triton GEMMs with fused epilogues share (kernels/bias_gelu.py's FFN GEMM,
kernels/mlm_head_loss.py's decoder GEMM): the program's tile and its main loop (jit helpers,
inlined, so each kernel compiles to one loop as if written in place).

A program computes a BLOCK_M x BLOCK_N tile of A @ B over K in BLOCK_K steps: Triton's software
pipeline (num_stages) and wgmma on Hopper. Row blocks in groups of GROUP_M walk the column blocks
together, so a group's A rows and B columns stay in L2 while they are reused. Loads of rows and
columns past the edge read row or column 0 instead (wrapped), so the main loop needs no row or
column masks; only the epilogue's stores are masked. K need not be a multiple of BLOCK_K (EVEN_K:
no K mask when it is). bf16 dots under the interpreter run on fp32 upcasts (UPCAST: its bf16 dot is
wrong), as the attention's do.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import interpreting

# Under the interpreter: small tiles (tl.dot needs 16 or more each way), several programs per test.
INTERP_TILE = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2}


def gemm_flags(dtype: torch.dtype, k: int) -> dict:
    """tile_product's EVEN_K (every GPU candidate's BLOCK_K divides 64), UPCAST and DOT_PREC for operands
    of ``dtype`` over a reduction of ``k``."""
    upcast = interpreting() and dtype == torch.bfloat16
    return dict(EVEN_K=k % (INTERP_TILE["BLOCK_K"] if interpreting() else 64) == 0, UPCAST=upcast,
                DOT_PREC="ieee" if dtype == torch.float32 or upcast else "tf32")


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(rows, cols, pid_m, pid_n) of this program's tile of an [M, N] output."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N), pid_m, pid_n


@triton.jit
def tile_product(A, B, rows, cols, M, N, K, stride_am, stride_bk, stride_bn,
                 EVEN_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 tile A[rows, :] @ B[:, cols]: A [M, K] with unit column stride, B[k, n] at
    B + k * stride_bk + n * stride_bn (a Linear's weight, either way round)."""
    ks = tl.arange(0, BLOCK_K)
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
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    return acc
