"""Helpers shared by the Triton launchers."""
import os

import torch


def interpreting() -> bool:
    """True when kernels run under the Triton interpreter (TRITON_INTERPRET=1, CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_tensor(name: str, t: torch.Tensor, *, dtypes=None, ndim=None, shape=None, device=None) -> None:
    """Raise ValueError naming what was expected and what was given."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
