"""Work counts: the FLOPs and bytes each benchmark figure divides by time.

Conventions (stated in every report):

* Attention, FlashAttention's convention, real tokens only:
  forward = 4 * sum_b(len_b^2) * A * D  (QK^T and PV, 2 flops per multiply-add);
  backward = 2.5 x forward (five [len, len] matmuls against two, recomputing P);
  forward + backward = (1 + 2.5) x forward. Padding never counts, whatever an
  implementation computes on it. bertfast's own backward executes about 3.5 x forward
  (seven matmuls over its dK/dV and dQ kernels): its TFLOP/s under-counts its work by
  design and compares directly with FlashAttention's published figures.
* Row ops (bias_gelu, bias_dropout_residual_layernorm, embeddings): GB/s = the bytes the op
  must move by the launcher contract (every input read once, every output written once, a
  gathered table's distinct rows once each, 1e9 bytes per GB) / time. The same count divides
  every implementation's time, so GB/s is comparable across them; % of the copy bandwidth
  measured in the same run.
* GEMM-bound ops (mlm_head_loss_decoder / MLM head, the FFN): 2 flops per multiply-add; backward
  = 2 x forward (grad input and grad weight).
* Optimizer steps (adamw, lamb): GB/s = the bytes a one-pass update must move (read the
  parameters, gradients and both fp32 moments, write the parameters and moments: 28 bytes per
  fp32 element) / time, for every implementation. LAMB needs the norms of the whole update
  before it can apply it, so its fused kernels move 40 bytes per element in two passes: its
  % of copy bandwidth tops out near 70%.
* Model: ``bertfast.model.mfu``, the model FLOPs ``bertfast pretrain`` reports MFU with too
  (real tokens only, training step = 3 x forward); MFU = model FLOPs / time / the measured
  peak matmul rate, and against the datasheet dense bf16 peak.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence, Tuple

from bertfast.model.mfu import mlm_head_flops

ATTENTION_BWD_FACTOR = 2.5
DIRECTIONS = ("fwd", "bwd", "fwd+bwd")
FP32_STAT_BYTES = 4  # mean / rstd / lse are fp32


def _check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")


def _sum_squares(lengths: Iterable[int]) -> int:
    return sum(int(n) * int(n) for n in lengths)


# --------------------------------------------------------------------------- attention
def attention_flops(lengths: Sequence[int], num_heads: int, head_dim: int, direction: str = "fwd") -> float:
    """FLOPs of bidirectional attention over sequences of the given real lengths."""
    _check_direction(direction)
    fwd = 4.0 * _sum_squares(lengths) * num_heads * head_dim
    factor = {"fwd": 1.0, "bwd": ATTENTION_BWD_FACTOR, "fwd+bwd": 1.0 + ATTENTION_BWD_FACTOR}[direction]
    return fwd * factor


# --------------------------------------------------------------------------- row ops
def bias_gelu_bytes(n: int, f: int, act_bytes: int, param_bytes: int, direction: str) -> int:
    """fwd: read x [N,F], bias [F]; write y. bwd: read dy, x, bias; write dx, dbias."""
    _check_direction(direction)
    fwd = 2 * n * f * act_bytes + f * param_bytes
    bwd = 3 * n * f * act_bytes + 2 * f * param_bytes
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[direction]


def bias_dropout_residual_layernorm_bytes(n: int, h: int, act_bytes: int, param_bytes: int, direction: str,
                                          has_bias: bool = True, has_residual: bool = True) -> int:
    """fwd: read x, residual, bias, weight, ln_bias; write y, pre_norm, mean, rstd.
    bwd: read dy, pre_norm, mean, rstd, weight; write dx, dresidual, dbias, dweight, dln_bias.
    (The dropout mask is regenerated from the seed, never stored.)"""
    _check_direction(direction)
    rows = n * h * act_bytes
    stats = 2 * n * FP32_STAT_BYTES
    fwd = (rows + (rows if has_residual else 0) + (h * param_bytes if has_bias else 0) + 2 * h * param_bytes
           + 2 * rows + stats)
    bwd = (2 * rows + stats + h * param_bytes
           + rows + (rows if has_residual else 0) + (h * param_bytes if has_bias else 0) + 2 * h * param_bytes)
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[direction]


def gathered_rows(tokens: int, table_rows: int) -> int:
    """The rows of a table that a gather over ``tokens`` ids reads from DRAM at most: each distinct row
    once, the repeats served by L2, so never more than the table holds. BERT's position and token-type
    tables (2 MB and 8 KB at BERT-large in fp32) are read once however many tokens gather them."""
    return min(tokens, table_rows)


def embeddings_bytes(t: int, h: int, vocab: int, positions: int, types: int, id_bytes: int,
                     table_bytes: int, out_bytes: int, direction: str,
                     distinct: Optional[Tuple[int, int, int]] = None) -> int:
    """fwd: read 3 ids per token, the gathered table rows, LN weight/bias; write y, mean, rstd.
    bwd: read dy, ids, the gathered rows (recompute), LN weight/bias, mean, rstd; write the dense
    table gradients dword [V,H], dpos [P,H], dtype [TT,H] (zero-filled + scatter-added) and dLN.
    The gathered rows are each table's distinct rows (``distinct``: word, position, token-type, as the
    ids hold them; default gathered_rows of each, its most), read once: a token's row read again is
    an L2 hit. (Until 2026-12-06 every token's three rows counted: 201 MB at BERT-large's 16,384
    tokens with fp32 tables, where the position and token-type tables hold 2 MB; the H200 run of
    2026-11-27-3 put a forward at 131% of the copy bandwidth that way.)"""
    _check_direction(direction)
    if distinct is None:
        distinct = (gathered_rows(t, vocab), gathered_rows(t, positions), gathered_rows(t, types))
    stats = 2 * t * FP32_STAT_BYTES
    ids = 3 * t * id_bytes
    gathered = sum(distinct) * h * table_bytes
    ln = 2 * h * table_bytes
    fwd = ids + gathered + ln + t * h * out_bytes + stats
    bwd = t * h * out_bytes + ids + gathered + ln + stats + (vocab + positions + types) * h * table_bytes + ln
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[direction]


# --------------------------------------------------------------------------- GEMM-bound
def mlm_head_loss_decoder_flops(m: int, h: int, vocab: int, direction: str) -> float:
    """logits = x [M,H] @ W[V,H]^T: 2*M*V*H forward; grad x and grad W: 4*M*V*H backward."""
    _check_direction(direction)
    fwd = 2.0 * m * vocab * h
    return {"fwd": fwd, "bwd": 2 * fwd, "fwd+bwd": 3 * fwd}[direction]


def mlm_head_loss_flops(m: int, h: int, vocab: int, direction: str) -> float:
    """MLM head at M rows: transform dense [H,H] + decoder [V,H] (GELU/LN not counted)."""
    _check_direction(direction)
    fwd = mlm_head_flops(m, h, vocab)
    return {"fwd": fwd, "bwd": 2 * fwd, "fwd+bwd": 3 * fwd}[direction]


def ffn_flops(n: int, h: int, f: int, direction: str) -> float:
    """The FFN's two GEMMs at N rows, [H] -> [F] -> [H]: 4*N*H*F forward (GELU not counted)."""
    _check_direction(direction)
    fwd = 4.0 * n * h * f
    return {"fwd": fwd, "bwd": 2 * fwd, "fwd+bwd": 3 * fwd}[direction]


def optimizer_step_bytes(elements: int, param_bytes: int, grad_bytes: int, state_bytes: int = 4) -> int:
    """Read w, g, m, v and write w, m, v, once each (Adam-style moments, ``state_bytes`` each)."""
    return elements * (2 * param_bytes + grad_bytes + 4 * state_bytes)


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12
