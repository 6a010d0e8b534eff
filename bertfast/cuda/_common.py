"""What the CUDA wrappers share: the extension, its launch point, and argument helpers.

Tests of the validation on a machine without a GPU set DEVICE_TYPE to "cpu" and replace
``launch``; the emulator tests also replace ``_C`` with the CPU-emulated build of csrc/.
Dtypes: activations fp32/fp16/bf16; parameters either the activation dtype or fp32 (other mixes
are cast to fp32 here, and their gradients cast back). Statistics (mean, rstd, lse) fp32.
"""
from __future__ import annotations

import os
import shutil
from typing import Iterable, List, Optional, Tuple

import torch

# Set (to the reason) to run without bertfast._C even where it imports: the GPU check sets it after
# the extension failed to build, so a stale module is not loaded and every skip quotes the build error.
SKIP_ENV = "BERTFAST_SKIP_EXTENSION"
_SKIP_REASON = os.environ.get(SKIP_ENV, "").strip()
_C = None
_IMPORT_ERROR: Optional[BaseException] = None
if not _SKIP_REASON:
    try:
        from bertfast import _C
    except ImportError as exc:  # built without nvcc, or not built yet
        _IMPORT_ERROR = exc

DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
MAX_HIDDEN = 8192  # LayerNorm rows (LayerNorm, embeddings): one row per block, fp32 row in shared memory
DEVICE_TYPE = "cuda"  # the device type every input must have


def extension_status() -> Tuple[bool, str]:
    """(available, reason): whether bertfast._C imported, and why not / what it is."""
    if _C is not None:
        where = getattr(_C, "__file__", "?")
        archs = getattr(_C, "cuda_archs", "") or "?"
        runtime = getattr(_C, "cuda_runtime", "") or "?"
        gpu = "a CUDA device is visible" if torch.cuda.is_available() else "no CUDA device is visible"
        return True, f"bertfast._C loaded from {where} (sm {archs}, {runtime} CUDA runtime); {gpu}"
    if _SKIP_REASON:
        return False, f"bertfast._C is not loaded ({SKIP_ENV} is set): {_SKIP_REASON}"
    mode = os.environ.get("BERTFAST_BUILD_CUDA", "auto")
    nvcc = shutil.which("nvcc")
    if mode == "0":
        why = "BERTFAST_BUILD_CUDA=0 skips the build"
    elif nvcc is None:
        why = ("nvcc was not found, so setup.py installed bertfast without it "
               "(BERTFAST_BUILD_CUDA=auto); install the CUDA toolkit and reinstall")
    else:
        why = (f"nvcc is at {nvcc}: build it with `pip install -e .` or "
               "`python setup.py build_ext --inplace`")
    return False, f"bertfast._C is not built ({_IMPORT_ERROR}); {why}"


def ext():
    if _C is None:
        raise RuntimeError(f"the CUDA backend is unavailable: {extension_status()[1]}")
    return _C


def launch(device: torch.device, name: str, *args) -> None:
    """bertfast._C.<name>(*args, stream) on device's current stream, with device current."""
    fn = getattr(ext(), name)
    with torch.cuda.device(device):
        fn(*args, torch.cuda.current_stream(device).cuda_stream)


def reduction_blocks(n_rows: int) -> int:
    return ext().reduction_blocks(n_rows)


def device_reasons(devices: Iterable[str]) -> List[str]:
    """Why the CUDA backend cannot run tensors on these device types (dispatch asks)."""
    return [] if set(devices) == {DEVICE_TYPE} else [f"needs {DEVICE_TYPE.upper()} tensors, got {sorted(devices)}"]


def dispatch_state() -> str:
    """What device_reasons reads besides its inputs (dispatch keys its cached choices on it)."""
    return DEVICE_TYPE


def on_device(**tensors) -> None:
    """Every given tensor (None skipped) lives on a DEVICE_TYPE device."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device.type != DEVICE_TYPE:
            raise ValueError(f"{name}: expected a CUDA tensor, got device {t.device}")


def hidden_reasons(h: int):
    """The LayerNorm kernels' declared limit, as dispatch reasons."""
    return [] if 1 <= h <= MAX_HIDDEN else [f"hidden size {h} is outside [1, {MAX_HIDDEN}] (one row per block)"]


def check_hidden(name: str, t: torch.Tensor, h: int) -> None:
    if hidden_reasons(h):
        raise ValueError(f"{name}: expected a hidden size in [1, {MAX_HIDDEN}], got shape {tuple(t.shape)}")


def param_dtype(act: torch.dtype, param: torch.dtype) -> torch.dtype:
    """The dtype the kernels read parameters in: the parameter's own when it is the activation
    dtype or fp32, else fp32 (cast here)."""
    return param if param in (act, torch.float32) else torch.float32


def cast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    if t is None:
        return None
    return (t if t.dtype == dtype else t.to(dtype)).contiguous()


def seed_ptr(seed: Optional[torch.Tensor], dropout_p: float) -> int:
    return seed.data_ptr() if dropout_p > 0.0 else 0


def ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()
