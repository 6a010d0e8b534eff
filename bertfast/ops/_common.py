"""What every op module shares: backend registration, the dropout seed policy, empty outputs."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from bertfast.dispatch import (Backend, cuda_ext_availability, device_reasons, dtype_reasons,
                               register_backend, triton_availability)

InputReasons = Callable[[str, Dict[str, Optional[torch.Tensor]]], List[str]]


def no_reasons(backend: str, tensors) -> List[str]:
    return []


def register_backends(op: str, kernel_module: str, float_inputs: List[str],
                      extra_reasons: InputReasons = no_reasons) -> None:
    """Register the torch, triton and cuda backends of an op.

    float_inputs: names of the inputs whose dtype must be fp32/fp16/bf16 for the fused backends.
    extra_reasons(backend, inputs): op-specific limits (head dim, hidden size, ...).
    """

    def fused_reasons(name: str):
        def reasons(forced: bool, **inputs) -> List[str]:
            out = device_reasons(name, forced, inputs)
            out += dtype_reasons({k: inputs[k] for k in float_inputs if k in inputs})
            return out + extra_reasons(name, inputs)
        return reasons

    register_backend(Backend(op, "torch", "bertfast.ops.torch_impl", lambda forced, **inputs: []))
    register_backend(Backend(op, "triton", f"bertfast.kernels.{kernel_module}", fused_reasons("triton"),
                             availability_fn=triton_availability))
    register_backend(Backend(op, "cuda", "bertfast.cuda_ops", fused_reasons("cuda"),
                             availability_fn=cuda_ext_availability))


def new_seed(device: torch.device) -> torch.Tensor:
    """A fresh dropout seed, int64 [1] on ``device``.

    Drawn from torch's generator for that device, so ``torch.manual_seed`` makes runs
    reproducible, every call advances the stream, and on CUDA the draw is graph-safe (the
    kernels read the seed from device memory, never from the host).
    """
    return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device)


def seed_for(dropout_p: float, device: torch.device) -> Optional[torch.Tensor]:
    return new_seed(device) if dropout_p > 0.0 else None


def empty(like: torch.Tensor) -> torch.Tensor:
    """Placeholder for an absent optional output (custom ops return tensors, not None)."""
    return like.new_empty((0,))


def or_none(t: torch.Tensor) -> Optional[torch.Tensor]:
    return None if t.numel() == 0 and t.dim() == 1 else t


def check_dropout(p: float) -> float:
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {p}")
    return p


def distinct(outputs, inputs=()):
    """Custom ops may not return tensors that share storage with an input or with each other.

    Launchers may legitimately return views of one buffer (e.g. two reductions computed
    together); clone only the outputs that would alias."""
    seen = {id(t) for t in inputs if isinstance(t, torch.Tensor)}
    seen |= {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor) and t.numel()}
    result = []
    for t in outputs:
        if isinstance(t, torch.Tensor):
            key = t.untyped_storage().data_ptr() if t.numel() else id(t)
            if key in seen or id(t) in seen:
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr() if t.numel() else id(t))
        result.append(t)
    return tuple(result)
