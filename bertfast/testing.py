"""Helpers for parity checks, shared by the test suite, the benchmark gate and training parity.

Tolerance rule (docs/testing.md, after FlashAttention): a low-precision fast path is correct
when its error against the fp32 reference is at most ``factor`` times the error of the same
reference computed in the low dtype, plus a small ``atol``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


Outcome = Tuple[torch.Tensor, List[Optional[torch.Tensor]]]


def run_reference(fn: Callable, tensors: Sequence[Optional[torch.Tensor]], dtype: torch.dtype,
                  grad_out: Optional[torch.Tensor] = None) -> Outcome:
    """fn on copies of ``tensors`` (floating ones cast to dtype, requiring grad when grad_out is
    given) -> (output, [gradient or None per tensor])."""
    xs = [t if t is None or not t.is_floating_point() else t.detach().to(dtype).requires_grad_(grad_out is not None)
          for t in tensors]
    out = fn(*xs)
    if grad_out is None:
        return out.detach(), [None] * len(xs)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [x.grad if (x is not None and x.is_floating_point()) else None for x in xs]


def references(fn: Callable, tensors: Sequence[Optional[torch.Tensor]], dtype: torch.dtype,
               grad_out: Optional[torch.Tensor] = None) -> Tuple[Outcome, Outcome]:
    """(the fp32 oracle, the same reference in ``dtype`` as the yardstick; None parts for fp32)."""
    oracle = run_reference(fn, tensors, torch.float32, grad_out)
    yard = run_reference(fn, tensors, dtype, grad_out) if dtype != torch.float32 else (None, [None] * len(tensors))
    return oracle, yard


def check_close(name: str, fast: torch.Tensor, oracle: torch.Tensor, yard: Optional[torch.Tensor],
                dtype: torch.dtype, atol: float = 1e-5, rtol: float = 1e-5, lowp_atol: float = 1e-5) -> None:
    """fp32: ``fast`` close to the fp32 oracle; fp16/bf16: the low-precision rule against it."""
    assert fast is not None, f"{name}: missing"
    assert torch.isfinite(fast.float()).all(), f"{name}: NaN/inf"
    assert fast.shape == oracle.shape, f"{name}: shape {tuple(fast.shape)} != {tuple(oracle.shape)}"
    if dtype == torch.float32:
        torch.testing.assert_close(fast.float().cpu(), oracle.float().cpu(), atol=atol, rtol=rtol,
                                   msg=lambda m: f"{name}: {m}")
    else:
        assert_close_lowp(fast.float().cpu(), oracle.float().cpu(), yard.float().cpu(), atol=lowp_atol, name=name)


@dataclass
class BackendUnderTest:
    """One backend of the ops as the contract tests run it (tests/ops/conftest.py)."""

    name: str  # torch | triton | cuda
    device: torch.device
    emulated: bool = False  # CUDA kernels on the CPU emulator: slow, so tests keep shapes tiny

    def forced(self):
        """Within this context every op runs on this backend (forced: it never falls back)."""
        from bertfast.dispatch import use_backend
        return use_backend(self.name)

    def module(self, op: str):
        """The module implementing ``op`` (a dispatch op name) on this backend: its launchers."""
        from bertfast import dispatch, ops  # noqa: F401  (importing ops registers the backends)
        return dispatch.get(op, self.name).impl

    def tensor(self, *shape, dtype=torch.float32, scale: float = 1.0,
               generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Standard normal values (drawn on the CPU, so every backend sees the same) on this device."""
        return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(self.device)


class AtenLog(TorchDispatchMode):
    """Every aten call that reaches this mode while it is on: ``calls`` holds (op, its output's shape,
    None when the output is not one tensor) in order; ``ops`` the ops alone."""

    def __init__(self):
        super().__init__()
        self.calls: List[Tuple[object, Optional[Tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, tuple(out.shape) if isinstance(out, torch.Tensor) else None))
        return out

    @property
    def ops(self) -> list:
        return [func for func, _ in self.calls]
