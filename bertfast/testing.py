"""Helpers for parity checks, shared by the test suite, the benchmark gate and training parity.

Tolerance rule (DESIGN.md section 6, after FlashAttention): a low-precision fast path is
correct when its error against the fp32 reference is at most ``factor`` times the error of
the same reference computed in the low dtype, plus a small ``atol``.
"""
from __future__ import annotations

from typing import List, Optional

import torch

PADDING_MODES = ("none", "random", "one", "all_but_one", "empty")


def make_lengths(mode: str, batch: int, max_len: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Sequence lengths [batch] (int64) for a padding mode.

    none: all max_len; random: uniform in [1, max_len]; one: a single real token each;
    all_but_one: max_len - 1 each; empty: random lengths with sequence 0 fully padded.
    """
    if mode == "none":
        return torch.full((batch,), max_len, dtype=torch.long)
    if mode == "random":
        return torch.randint(1, max_len + 1, (batch,), generator=generator)
    if mode == "one":
        return torch.ones(batch, dtype=torch.long)
    if mode == "all_but_one":
        return torch.full((batch,), max(max_len - 1, 1), dtype=torch.long)
    if mode == "empty":
        lengths = torch.randint(1, max_len + 1, (batch,), generator=generator)
        lengths[0] = 0
        return lengths
    raise ValueError(f"padding mode must be one of {PADDING_MODES}, got {mode!r}")


def mask_from_lengths(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """attention_mask [B, max_len] int64 (1 = token) with each sequence's tokens first."""
    return (torch.arange(max_len)[None, :] < lengths[:, None]).long()


def cu_seqlens_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Cumulative sequence starts [B + 1] int32, as the varlen kernels take them."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(lengths, 0)
    return out


def max_abs_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_close_lowp(fast: torch.Tensor, ref_fp32: torch.Tensor, ref_lowp: torch.Tensor,
                      factor: float = 2.0, atol: float = 1e-5, name: str = "output") -> None:
    """err(fast, ref_fp32) <= factor * err(ref_lowp, ref_fp32) + atol, else AssertionError."""
    if not torch.isfinite(fast).all():
        raise AssertionError(f"{name}: fast path produced NaN/inf")
    err_fast = max_abs_error(fast, ref_fp32)
    err_ref = max_abs_error(ref_lowp, ref_fp32)
    bound = factor * err_ref + atol
    if err_fast > bound:
        raise AssertionError(f"{name}: fast-path error {err_fast:.3e} exceeds {factor} x reference "
                             f"low-precision error {err_ref:.3e} + atol {atol:.1e} = {bound:.3e}")


def lowp_errors(fast: torch.Tensor, ref_fp32: torch.Tensor, ref_lowp: torch.Tensor) -> List[float]:
    """(fast error, reference low-precision error), for reports."""
    return [max_abs_error(fast, ref_fp32), max_abs_error(ref_lowp, ref_fp32)]
