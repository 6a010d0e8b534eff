"""The run's numeric precision: fp32, bf16 autocast, or fp16 autocast with loss scaling (CUDA)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch


def autocast_context(device: torch.device, precision: str, cache: bool = True):
    """bf16/fp16 autocast on CUDA (bf16 also on CPU if asked); fp32: no autocast. ``cache=False``
    for a region captured in a CUDA graph (autocast's cache of cast weights must not outlive it)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=cache)


def resolve_precision(precision: Optional[str], device: torch.device) -> str:
    if precision in (None, "auto"):
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision must be fp32, bf16, fp16 or auto, got {precision!r}")
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("fp16 with loss scaling needs CUDA; use fp32 (or bf16) on CPU")
    return precision
