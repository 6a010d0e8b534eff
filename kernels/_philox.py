"""Philox4x32 (Salmon et al., SC'11) for the attention's dropout mask, as one wide multiply per product.

philox4x32(seed, offset, N_ROUNDS) returns tl.randint4x(seed, offset, N_ROUNDS)'s four words, bit for
bit: key (low, high 32 bits of the 64-bit seed), counter (offset, 0, 0, 0). Each round multiplies two
words into 64-bit products whose halves both feed the next round. tl.randint4x asks for each half
separately (umulhi, then a 32-bit multiply), which ptxas compiles to two instructions, IMAD.HI and
IMAD; on a GPU this module asks for the whole product (PTX mul.wide.u32: one IMAD.WIDE.U32, as nvcc
compiles csrc's Philox). In the attention forward's main loop at BERT's shapes (sm_90, 128 x 64
tiles, dropout on) that took the instructions from 608 to 554 an iteration. Under the interpreter,
which runs no PTX, the product is a uint64 multiply: the same words, which tests/ops/test_philox.py
checks against a numpy Philox and tl.randint4x (on a GPU, the PTX).

The row ops keep tl.randint4x (kernels/_rows.py): they are bound by memory, where it saved 2-5% of
their instructions, and their source is what calibrates the perf model against the last GPU run
until the next one (docs/perf-model.md, "Calibration").
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import interpreting

# Read when this module is imported, as triton.jit decides whether it interprets (TRITON_INTERPRET).
_PTX = tl.constexpr(not interpreting())
_ROUND_A = tl.constexpr(0xD2511F53)  # multiplies counter word 0
_ROUND_B = tl.constexpr(0xCD9E8D57)  # multiplies counter word 2
_KEY_A = tl.constexpr(0x9E3779B9)    # the key's increments (the golden ratio, sqrt(3) - 1)
_KEY_B = tl.constexpr(0xBB67AE85)


@triton.jit
def _mul_wide(x, M: tl.constexpr):
    """(high, low) 32-bit halves of x * M (x uint32, M a uint32 constant)."""
    if _PTX:
        m = tl.full(x.shape, M, tl.uint32)
        hi, lo = tl.inline_asm_elementwise("{ .reg .b64 t; mul.wide.u32 t, $2, $3; mov.b64 {$1, $0}, t; }",
                                           "=r,=r,r,r", [x, m], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        prod = x.to(tl.uint64) * M
        hi, lo = (prod >> 32).to(tl.uint32), prod.to(tl.uint32)
    return hi, lo


@triton.jit
def philox4x32(seed, offset, N_ROUNDS: tl.constexpr):
    """The 4 uint32 words of Philox4x32-N_ROUNDS at counter (offset, 0, 0, 0) under the key seed (an
    int64 scalar: low word k0, high word k1); offset: an integer tensor, taken modulo 2**32."""
    c0 = offset.to(tl.uint32)
    c1 = c0 * 0
    c2 = c1
    c3 = c1
    key = seed.to(tl.uint64)
    k0 = (key & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    for _ in tl.static_range(N_ROUNDS):
        hi_a, lo_a = _mul_wide(c0, _ROUND_A)
        hi_b, lo_b = _mul_wide(c2, _ROUND_B)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = tl.add(k0, _KEY_A, sanitize_overflow=False)
        k1 = tl.add(k1, _KEY_B, sanitize_overflow=False)
    return c0, c1, c2, c3
