"""The argument rules every backend of the fused ops shares.

One definition of each rule, used by the op contracts (``bertfast.ops``), the Triton launchers
(``bertfast.kernels``) and the CUDA wrappers (``bertfast.cuda``), so the backends cannot drift
apart on what they accept. Every check raises ValueError naming what was expected and what was
given. Torch only: importing this pulls in neither triton nor the CUDA extension.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import os
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ID_DTYPES = (torch.int32, torch.int64)
IGNORE_INDEX = -100  # labels equal to it add nothing to any loss (transformers' convention)
GELU_APPROXIMATIONS = ("none", "tanh")  # the exact erf form (BERT's), or the tanh approximation
# Head dims the fused attention backends serve, power of two or not (the torch backend serves any):
# the kernels pad the head dim to their tile and mask the extra columns.
MIN_HEAD_DIM, MAX_HEAD_DIM = 8, 256


def check_tensor(name: str, t: torch.Tensor, *, dtypes=None, ndim=None, shape=None, device=None) -> None:
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


def check_rows(name: str, t: torch.Tensor, n: Optional[int] = None, h: Optional[int] = None,
               dtypes=FLOAT_DTYPES, device=None) -> Tuple[int, int]:
    """A 2-D [n, h] tensor whose rows are contiguous (stride(1) == 1) and do not overlap
    (stride(0) >= h): row-strided views are fine. Returns (n, h)."""
    check_tensor(name, t, dtypes=dtypes, ndim=2, device=device)
    rows, width = t.shape
    if (n is not None and rows != n) or (h is not None and width != h):
        raise ValueError(f"{name}: expected shape ({n if n is not None else 'N'}, {h if h is not None else 'H'}), "
                         f"got {tuple(t.shape)}")
    if t.numel() == 0:  # nothing is read: any strides (autograd hands empty gradients with strides 0)
        return rows, width
    if width > 1 and t.stride(1) != 1:
        raise ValueError(f"{name}: expected unit column stride (rows may be strided), got strides {t.stride()}")
    if rows > 1 and t.stride(0) < width:
        raise ValueError(f"{name}: expected row stride >= {width} (non-overlapping rows), got strides {t.stride()}")
    return rows, width


def check_logits(logits: torch.Tensor) -> Tuple[int, int]:
    """A chunk of logits [M, V], V >= 1, with stride 1 along the vocabulary (rows may be strided).
    Returns (M, V)."""
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, ndim=2)
    m, v = logits.shape
    if v == 0:
        raise ValueError(f"logits: expected a non-empty vocabulary dimension, got shape {tuple(logits.shape)}")
    if v > 1 and logits.stride(1) != 1 or m > 1 and logits.stride(0) < v:
        raise ValueError(f"logits: expected stride 1 along the vocabulary and row stride >= {v}, "
                         f"got strides {logits.stride()}")
    return m, v


def padded_vocab(vocab_size: int, element_size: int) -> int:
    """The MLM decoder's rows of logits on a GPU: ``vocab_size`` rounded up to whole 16-byte rows
    (BERT's 30522 -> 30528 in bf16), for bertfast.ops.mlm_head_loss and its fused kernels. cuBLAS's
    Hopper kernels load through TMA, which needs 16-byte aligned leading dimensions; at 30522 it ran
    sm80-era kernels with 4-byte loads instead, at about a third of the rate (the H200 trace of
    2026-11-27: the head's three GEMMs 1.8 ms of a BERT-large step, about 150 GFLOP each at ~250
    TFLOP/s)."""
    per_row = max(1, 16 // element_size)
    return -(-vocab_size // per_row) * per_row


def check_vector(name: str, t: torch.Tensor, h: int, device=None) -> None:
    """A contiguous float [h] parameter vector (bias, LayerNorm weight and bias)."""
    check_tensor(name, t, dtypes=FLOAT_DTYPES, shape=(h,), device=device)
    if h > 1 and t.stride(0) != 1:
        raise ValueError(f"{name}: expected a contiguous vector, got strides {t.stride()}")


def row_stride(t: torch.Tensor) -> int:
    """Elements between rows of a [n, h] tensor checked by check_rows (h when there is one row)."""
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def check_dropout(p, seed: Optional[torch.Tensor] = None, device=None) -> float:
    """p in [0, 1); when p > 0 and a device is given, seed must be an int64 [1] tensor there
    (the kernels read it from device memory, so CUDA graphs can replay a step)."""
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise ValueError(f"dropout_p: expected a float in [0, 1), got {p!r}")
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1), got {p}")
    if p > 0.0 and device is not None:
        if seed is None:
            raise ValueError("seed: expected an int64 tensor of shape [1] when dropout_p > 0, got None")
        check_tensor("seed", seed, dtypes=(torch.int64,), shape=(1,), device=device)
    return p


# The attention forward's record of its dropout decisions for the backward (Triton and CUDA: the same
# layout, kernels/attention.py's header, "Keep bits"): uint8 [B, A, L / 2, L / 4], one bit per score
# element, L the sequence length rounded up to KEEP_ALIGN, a multiple of every kernel's tile.
KEEP_ALIGN = 128


def keep_bits_shape(batch: int, heads: int, seqlen: int, dropout_p: float) -> Tuple[int, ...]:
    """The keep bits' shape; (0,) without dropout (or without a score)."""
    if dropout_p == 0.0 or batch * heads * seqlen == 0:
        return (0,)
    length = -(-seqlen // KEEP_ALIGN) * KEEP_ALIGN
    return (batch, heads, length // 2, length // 4)


def check_keep_bits(keep: torch.Tensor, batch: int, heads: int, seqlen: int, dropout_p: float, device) -> None:
    """``keep`` is what a forward with these sizes records (keep_bits_shape, uint8; empty without dropout)."""
    want = keep_bits_shape(batch, heads, seqlen, dropout_p)
    if dropout_p > 0.0 or keep.numel():
        check_tensor("keep", keep, dtypes=(torch.uint8,), shape=want, device=device)


def check_approximate(approximate) -> str:
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate: expected one of {GELU_APPROXIMATIONS}, got {approximate!r}")
    return approximate


def check_bias_gelu(x, bias, approximate):
    """The bias_gelu launchers' arguments: rows x [N, F], bias [F] on x's device, a known GELU.
    Returns (N, F)."""
    n, f = check_rows("x", x)
    check_vector("bias", bias, f, x.device)
    check_approximate(approximate)
    return n, f


def check_gemm_bias_gelu(x, weight, bias, approximate):
    """The bias_gelu GEMM launchers' forward arguments: rows x [M, K], weight [N, K] (a Linear's, unit
    column stride) and bias [N], all of x's dtype and device, a known GELU. Returns (M, N, K)."""
    m, k = check_rows("x", x)
    n, kw = check_rows("weight", weight, dtypes=(x.dtype,), device=x.device)
    if kw != k:
        raise ValueError(f"weight: expected shape (N, {k}) for x of shape {tuple(x.shape)}, got {tuple(weight.shape)}")
    check_vector("bias", bias, n, x.device)
    if bias.dtype != x.dtype:
        raise ValueError(f"bias: expected dtype {x.dtype} (x's), got {bias.dtype}")
    check_approximate(approximate)
    return m, n, k


def check_eps(eps) -> float:
    eps = float(eps)
    if not (eps >= 0.0 and math.isfinite(eps)):
        raise ValueError(f"eps: expected a finite float >= 0, got {eps}")
    return eps


def softmax_scale(scale: Optional[float], head_dim: int) -> float:
    """The attention scale: None means 1 / sqrt(head_dim), on every backend."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"softmax_scale: expected a finite float > 0 or None, got {scale!r}")
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"softmax_scale: expected a finite float > 0 or None, got {scale}")
    return scale


def head_dim_reasons(head_dim: int) -> List[str]:
    """The fused attention backends' head-dim limit, as dispatch reasons ([] when served)."""
    if MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        return []
    return [f"head dim {head_dim} is outside [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"]


def check_head_dim(name: str, head_dim: int) -> None:
    if head_dim_reasons(head_dim):
        raise ValueError(f"{name}: expected a head dim in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {head_dim}")


def check_cu_seqlens(cu_seqlens: torch.Tensor, max_seqlen, device=None) -> Tuple[int, int]:
    """cu_seqlens: contiguous int32 [B + 1] (sequence b is rows cu_seqlens[b]:cu_seqlens[b+1]);
    max_seqlen: a python int in [0, 2**31). Returns (B, max_seqlen). Values are not read (no sync)."""
    check_tensor("cu_seqlens", cu_seqlens, dtypes=(torch.int32,), ndim=1, device=device)
    if cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens: expected shape [B + 1] with B >= 0, got an empty tensor")
    if cu_seqlens.numel() > 1 and cu_seqlens.stride(0) != 1:
        raise ValueError(f"cu_seqlens: expected a contiguous tensor, got stride {cu_seqlens.stride()}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or not 0 <= max_seqlen < 2 ** 31:
        raise ValueError(f"max_seqlen: expected a python int in [0, 2**31), got {max_seqlen!r}")
    return cu_seqlens.numel() - 1, max_seqlen


def qkv_bias_grad(dqkv: torch.Tensor, bias_dtype: Optional[torch.dtype]):
    """What attention_varlen_bwd returns: dqkv [T, 3, A, D] alone, or given bias_dtype (dqkv, the
    QKV bias gradient [3, A, D] = the column sums of dqkv, summed in fp32, in bias_dtype). The
    backends that do not sum it in their kernels sum it here."""
    if check_bias_dtype(bias_dtype) is None:
        return dqkv
    return dqkv, dqkv.sum(0, dtype=torch.float32).to(bias_dtype)


def check_bias_dtype(bias_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    if bias_dtype is not None and bias_dtype not in FLOAT_DTYPES:
        raise ValueError(f"bias_dtype: expected one of {FLOAT_DTYPES} or None, got {bias_dtype!r}")
    return bias_dtype


def check_qkv(names, tensors, ndim: int, layout: str) -> None:
    """Attention operands: one float dtype, shape and device; a contiguous last (head) dim."""
    ref_name, ref = names[0], tensors[0]
    check_tensor(ref_name, ref, dtypes=FLOAT_DTYPES, ndim=ndim)
    for name, t in zip(names[1:], tensors[1:]):
        check_tensor(name, t, ndim=ndim)
        if t.shape != ref.shape:
            raise ValueError(f"{name}: expected shape {tuple(ref.shape)} ({layout}, like {ref_name}), "
                             f"got {tuple(t.shape)}")
        if t.dtype != ref.dtype:
            raise ValueError(f"{name}: expected dtype {ref.dtype} (like {ref_name}), got {t.dtype}")
        if t.device != ref.device:
            raise ValueError(f"{name}: expected device {ref.device} (like {ref_name}), got {t.device}")
    for name, t in zip(names, tensors):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last (head) dim, got strides {t.stride()}")


def check_key_padding_mask(mask: Optional[torch.Tensor], batch: int, seqlen: int, device=None) -> None:
    """[B, S] bool or integer (1 = token); None means no padding."""
    if mask is None:
        return
    check_tensor("key_padding_mask", mask, shape=(batch, seqlen), device=device)
    if mask.is_floating_point() or mask.is_complex():
        raise ValueError(f"key_padding_mask: expected a bool or integer tensor, got {mask.dtype}")


# ------------------------------------------------------------------ value checks without a host read
# Checks of tensor values (ids in range, labels valid) read a result back to the host, which waits
# for the device: a step that must never wait (a CUDA graph, a sync-free training loop) asks for
# them on the device instead, where a failed check is a device-side assert.
_CHECKS_ON_DEVICE = contextvars.ContextVar("bertfast_checks_on_device", default=False)


def env_choice(name: str, choices: Sequence[str]) -> str:
    """The environment setting ``name``, one of ``choices`` (unset or empty: the first, the default)."""
    value = (os.environ.get(name) or choices[0]).strip()
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")
    return value


@contextlib.contextmanager
def env_setting(name: str, value: str, choices: Sequence[str]) -> Iterator[None]:
    """The environment setting ``name`` set to ``value`` (one of ``choices``) inside the block, as it was
    after (the compile report's and the bench's launches of a kernel variant a setting picks)."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


@contextlib.contextmanager
def checks_on_device() -> Iterator[None]:
    """Within: value checks of tensors on an accelerator run on the device (torch._assert_async)
    and never read back to the host. A failed check there stops the process with a device-side
    assert instead of a ValueError naming the values, so validate data before it reaches the
    model (the training loaders do, on the host, once per example)."""
    token = _CHECKS_ON_DEVICE.set(True)
    try:
        yield
    finally:
        _CHECKS_ON_DEVICE.reset(token)


def exporting() -> bool:
    """Tracing for torch.export or ONNX: no tensor has values to check."""
    return torch.compiler.is_exporting() or torch.onnx.is_in_onnx_export()


def value_checks(t: torch.Tensor) -> str:
    """How a check of ``t``'s values runs: "host" (read back; ValueError naming the values),
    "device" (torch._assert_async: under torch.compile, while a CUDA graph is captured, or within
    ``checks_on_device()`` for accelerator tensors) or "off" (exporting a graph)."""
    if exporting():
        return "off"
    if torch.compiler.is_compiling():
        return "device"
    if t.device.type != "cpu" and (_CHECKS_ON_DEVICE.get() or (t.is_cuda and torch.cuda.is_current_stream_capturing())):
        return "device"
    return "host"
