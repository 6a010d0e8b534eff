"""CUDA C++ backend: validating wrappers over the torch-free launchers in ``bertfast._C``.

The functions here have the names and signatures of the Triton launchers (bertfast.kernels.*,
the launcher contract); bertfast.ops dispatches to them. Each one
  1. validates every tensor (CUDA device, dtype, shape, strides, alignment where a kernel
     needs it) and raises ValueError naming what was expected and what was given, before any
     GPU work;
  2. allocates outputs and workspaces with torch (the caching allocator);
  3. calls bertfast._C with data_ptr()s and torch.cuda.current_stream().cuda_stream under the
     tensors' device; a failing launcher raises RuntimeError with its message.
No autograd here (bertfast.ops wires it).

Dtypes: activations fp32/fp16/bf16; parameters either the activation dtype or fp32 (other
mixes are cast to fp32 here, and their gradients cast back). Statistics (mean, rstd, lse) fp32.
Dropout: keep = uniform(philox(seed, row, col // 4)[col % 4]) >= p, kept values scaled by
1 / (1 - p); the row is the token row (row ops) or (b * A + a) * S + i (attention), so the masks
match the debug entry points exactly (not bit-identical to the Triton backend's masks).
"""
from __future__ import annotations

import math
import os
import shutil
from typing import Optional, Tuple

import torch

from bertfast.kernels._common import check_tensor

try:
    from bertfast import _C
    _IMPORT_ERROR: Optional[BaseException] = None
except ImportError as exc:  # built without nvcc, or not built yet
    _C = None
    _IMPORT_ERROR = exc

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ID_DTYPES = (torch.int32, torch.int64)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
MAX_HIDDEN = 8192  # row ops (LayerNorm, embeddings)
IGNORE_INDEX = -100
CHUNK_BYTES = 256 * 1024 * 1024  # logits budget per chunk in linear_cross_entropy_fwd


# =========================================================================== extension
def extension_status() -> Tuple[bool, str]:
    """(available, reason): whether bertfast._C imported, and why not / what it is."""
    if _C is not None:
        where = getattr(_C, "__file__", "?")
        archs = getattr(_C, "cuda_archs", "") or "?"
        runtime = getattr(_C, "cuda_runtime", "") or "?"
        gpu = "a CUDA device is visible" if torch.cuda.is_available() else "no CUDA device is visible"
        return True, f"bertfast._C loaded from {where} (sm {archs}, {runtime} CUDA runtime); {gpu}"
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


def _ext():
    if _C is None:
        raise RuntimeError(f"the CUDA backend is unavailable: {extension_status()[1]}")
    return _C


# =========================================================================== validation
# The device type every input must have. Tests of the validation on a machine without a GPU set
# it to "cpu" (and replace _launch) to reach the dtype / shape / alignment checks.
_DEVICE_TYPE = "cuda"


def _check(name: str, t, *, dtypes=None, ndim=None, shape=None, device=None) -> None:
    if isinstance(t, torch.Tensor) and t.device.type != _DEVICE_TYPE:
        raise ValueError(f"{name}: expected a CUDA tensor, got device {t.device}")
    check_tensor(name, t, dtypes=dtypes, ndim=ndim, shape=shape, device=device)


def _check_rows(name: str, t: torch.Tensor) -> None:
    """[N, H] with unit column stride and row stride >= H (row-strided views allowed)."""
    n, h = t.shape
    if n > 1 and h > 0 and (t.stride(1) != 1 or t.stride(0) < h):
        raise ValueError(f"{name}: expected rows with stride(1) == 1 and stride(0) >= {h}, "
                         f"got strides {t.stride()}")
    if n <= 1 and h > 1 and t.stride(1) != 1:
        raise ValueError(f"{name}: expected stride(1) == 1, got strides {t.stride()}")


def _row_stride(t: torch.Tensor) -> int:
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def _check_vector(name: str, t, h: int, device) -> None:
    _check(name, t, dtypes=FLOAT_DTYPES, shape=(h,), device=device)


def _param_dtype(act: torch.dtype, param: torch.dtype) -> torch.dtype:
    """The dtype the kernels read parameters in: the parameter's own when it is the activation
    dtype or fp32, else fp32 (cast here)."""
    return param if param in (act, torch.float32) else torch.float32


def _as(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    if t is None:
        return None
    return (t if t.dtype == dtype else t.to(dtype)).contiguous()


def _check_dropout(dropout_p, seed, device) -> float:
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a value in [0, 1), got {dropout_p}")
    if dropout_p > 0.0:
        if seed is None:
            raise ValueError("seed: expected an int64 tensor of shape [1] when dropout_p > 0, got None")
        _check("seed", seed, dtypes=(torch.int64,), device=device)
        if seed.numel() != 1:
            raise ValueError(f"seed: expected shape [1], got {tuple(seed.shape)}")
    return dropout_p


def _seed_ptr(seed: Optional[torch.Tensor], dropout_p: float) -> int:
    return seed.data_ptr() if dropout_p > 0.0 else 0


def _launch(device: torch.device, name: str, *args) -> None:
    """bertfast._C.<name>(*args, stream) on device's current stream, with device current."""
    fn = getattr(_ext(), name)
    with torch.cuda.device(device):
        fn(*args, torch.cuda.current_stream(device).cuda_stream)


def _reduction_blocks(n_rows: int) -> int:
    return _ext().reduction_blocks(n_rows)


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _check_eps(eps) -> float:
    eps = float(eps)
    if not (eps >= 0.0 and math.isfinite(eps)):
        raise ValueError(f"eps: expected a finite float >= 0, got {eps}")
    return eps


# =========================================================================== bias + GELU
_APPROX = {"none": 0, "tanh": 1}


def _check_bias_gelu(x, bias, approximate):
    _check("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    _check_rows("x", x)
    _check_vector("bias", bias, x.shape[1], x.device)
    if approximate not in _APPROX:
        raise ValueError(f"approximate: expected 'none' or 'tanh', got {approximate!r}")


def bias_gelu_fwd(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """y = gelu(x + bias). x [N, F] (row-strided ok), bias [F] -> y [N, F] in x's dtype."""
    _check_bias_gelu(x, bias, approximate)
    n, f = x.shape
    y = torch.empty((n, f), dtype=x.dtype, device=x.device)
    if n == 0 or f == 0:
        return y
    b = _as(bias, _param_dtype(x.dtype, bias.dtype))
    _launch(x.device, "bias_gelu_fwd", x.data_ptr(), _row_stride(x), b.data_ptr(), y.data_ptr(), n, f,
            _CODE[x.dtype], _CODE[b.dtype], _APPROX[approximate])
    return y


def bias_gelu_bwd(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor,
                  approximate: str = "none") -> Tuple[torch.Tensor, torch.Tensor]:
    """dx = dy * gelu'(x + bias) [N, F], dbias = sum_rows dx [F] (bias's dtype; fp32 partials, no atomics)."""
    _check_bias_gelu(x, bias, approximate)
    _check("dy", dy, dtypes=(x.dtype,), shape=x.shape, device=x.device)
    _check_rows("dy", dy)
    n, f = x.shape
    dx = torch.empty((n, f), dtype=x.dtype, device=x.device)
    pdt = _param_dtype(x.dtype, bias.dtype)
    if f == 0:
        return dx, torch.zeros_like(bias)
    b = _as(bias, pdt)
    dbias = torch.empty(f, dtype=pdt, device=x.device)
    ws = torch.empty((_reduction_blocks(n), f), dtype=torch.float32, device=x.device)
    _launch(x.device, "bias_gelu_bwd", dy.data_ptr(), _row_stride(dy), x.data_ptr(), _row_stride(x), b.data_ptr(),
            dx.data_ptr(), dbias.data_ptr(), ws.data_ptr(), n, f, _CODE[x.dtype], _CODE[pdt], _APPROX[approximate])
    return dx, dbias.to(bias.dtype)


# =========================================================================== bias + dropout + residual + LayerNorm
def _ln_param_dtype(act: torch.dtype, weight: torch.Tensor) -> torch.dtype:
    return _param_dtype(act, weight.dtype)


def bias_dropout_residual_layernorm_fwd(x: torch.Tensor, bias: Optional[torch.Tensor],
                                        residual: Optional[torch.Tensor], weight: torch.Tensor,
                                        ln_bias: torch.Tensor, eps: float, dropout_p: float,
                                        seed: Optional[torch.Tensor], return_dropout_mask: bool = False):
    """y = LN(residual + Dropout(x + bias)) * weight + ln_bias.

    x, residual: [N, H] (row-strided ok; H <= 8192); bias, weight, ln_bias: [H].
    Returns (y [N, H], pre_norm [N, H] (activation dtype), mean [N] fp32, rstd [N] fp32)
    (+ keep bool [N, H] when return_dropout_mask).
    """
    _check("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    _check_rows("x", x)
    n, h = x.shape
    if not 0 < h <= MAX_HIDDEN:
        raise ValueError(f"x: expected a hidden size in [1, {MAX_HIDDEN}], got shape {tuple(x.shape)}")
    if residual is not None:
        _check("residual", residual, dtypes=(x.dtype,), shape=x.shape, device=x.device)
        _check_rows("residual", residual)
    if bias is not None:
        _check_vector("bias", bias, h, x.device)
    _check_vector("weight", weight, h, x.device)
    _check_vector("ln_bias", ln_bias, h, x.device)
    eps = _check_eps(eps)
    dropout_p = _check_dropout(dropout_p, seed, x.device)

    dev = x.device
    y = torch.empty((n, h), dtype=x.dtype, device=dev)
    pre = torch.empty((n, h), dtype=x.dtype, device=dev)
    mean = torch.empty(n, dtype=torch.float32, device=dev)
    rstd = torch.empty(n, dtype=torch.float32, device=dev)
    keep = torch.empty((n, h), dtype=torch.bool, device=dev) if return_dropout_mask else None
    if n > 0:
        pdt = _ln_param_dtype(x.dtype, weight)
        w, lb, b = _as(weight, pdt), _as(ln_bias, pdt), _as(bias, pdt)
        _launch(dev, "layernorm_fwd", x.data_ptr(), _row_stride(x), _ptr(b), _ptr(residual),
                _row_stride(residual) if residual is not None else 0, w.data_ptr(), lb.data_ptr(),
                y.data_ptr(), pre.data_ptr(), mean.data_ptr(), rstd.data_ptr(), _ptr(keep), n, h,
                eps, dropout_p, _seed_ptr(seed, dropout_p), _CODE[x.dtype], _CODE[pdt])
    if return_dropout_mask:
        return y, pre, mean, rstd, keep
    return y, pre, mean, rstd


def bias_dropout_residual_layernorm_bwd(dy: torch.Tensor, pre_norm: torch.Tensor, mean: torch.Tensor,
                                        rstd: torch.Tensor, weight: torch.Tensor, dropout_p: float,
                                        seed: Optional[torch.Tensor], has_bias: bool, has_residual: bool):
    """Gradients of bias_dropout_residual_layernorm_fwd.

    Returns (dx [N, H], dbias [H] | None, dresidual [N, H] | None, dweight [H], dln_bias [H]);
    parameter gradients in weight's dtype (dbias too: the forward's bias is assumed to share it),
    reduced over rows from fp32 per-block partials (no atomics).
    """
    _check("pre_norm", pre_norm, dtypes=FLOAT_DTYPES, ndim=2)
    _check_rows("pre_norm", pre_norm)
    n, h = pre_norm.shape
    if not 0 < h <= MAX_HIDDEN:
        raise ValueError(f"pre_norm: expected a hidden size in [1, {MAX_HIDDEN}], got shape {tuple(pre_norm.shape)}")
    dev = pre_norm.device
    _check("dy", dy, dtypes=(pre_norm.dtype,), shape=(n, h), device=dev)
    _check_rows("dy", dy)
    _check("mean", mean, dtypes=(torch.float32,), shape=(n,), device=dev)
    _check("rstd", rstd, dtypes=(torch.float32,), shape=(n,), device=dev)
    _check_vector("weight", weight, h, dev)
    dropout_p = _check_dropout(dropout_p, seed, dev)

    act = pre_norm.dtype
    pdt = _ln_param_dtype(act, weight)
    w = _as(weight, pdt)
    mean, rstd = mean.contiguous(), rstd.contiguous()
    dx = torch.empty((n, h), dtype=act, device=dev)
    dres = torch.empty((n, h), dtype=act, device=dev) if has_residual else None
    dbias = torch.empty(h, dtype=pdt, device=dev) if has_bias else None
    dweight = torch.empty(h, dtype=pdt, device=dev)
    dln_bias = torch.empty(h, dtype=pdt, device=dev)
    ws = torch.empty((_reduction_blocks(n), 3, h), dtype=torch.float32, device=dev)
    _launch(dev, "layernorm_bwd", dy.data_ptr(), _row_stride(dy), pre_norm.data_ptr(), _row_stride(pre_norm),
            mean.data_ptr(), rstd.data_ptr(), w.data_ptr(), dx.data_ptr(), _ptr(dres), _ptr(dbias),
            dweight.data_ptr(), dln_bias.data_ptr(), ws.data_ptr(), n, h, dropout_p,
            _seed_ptr(seed, dropout_p), _CODE[act], _CODE[pdt])
    back = weight.dtype
    return (dx, None if dbias is None else dbias.to(back), dres, dweight.to(back), dln_bias.to(back))


# =========================================================================== embeddings
def _check_ids(input_ids, position_ids, token_type_ids):
    _check("input_ids", input_ids, dtypes=ID_DTYPES, ndim=1)
    t = input_ids.shape[0]
    _check("position_ids", position_ids, dtypes=ID_DTYPES, shape=(t,), device=input_ids.device)
    _check("token_type_ids", token_type_ids, dtypes=ID_DTYPES, shape=(t,), device=input_ids.device)
    return t


def _check_tables(word, pos, token_type, ln_weight, ln_bias, device):
    _check("word", word, dtypes=FLOAT_DTYPES, ndim=2, device=device)
    h = word.shape[1]
    if not 0 < h <= MAX_HIDDEN:
        raise ValueError(f"word: expected a hidden size in [1, {MAX_HIDDEN}], got shape {tuple(word.shape)}")
    for name, table in (("pos", pos), ("token_type", token_type)):
        _check(name, table, dtypes=(word.dtype,), ndim=2, device=device)
        if table.shape[1] != h or table.shape[0] == 0:
            raise ValueError(f"{name}: expected shape (rows > 0, {h}) like word {tuple(word.shape)}, "
                             f"got {tuple(table.shape)}")
    _check_vector("ln_weight", ln_weight, h, device)
    _check_vector("ln_bias", ln_bias, h, device)
    return h


def _table_dtype(tables: torch.dtype, out: torch.dtype) -> torch.dtype:
    return tables if tables in (out, torch.float32) else torch.float32


def embeddings_fwd(input_ids: torch.Tensor, position_ids: torch.Tensor, token_type_ids: torch.Tensor,
                   word: torch.Tensor, pos: torch.Tensor, token_type: torch.Tensor, ln_weight: torch.Tensor,
                   ln_bias: torch.Tensor, eps: float, dropout_p: float, seed: Optional[torch.Tensor],
                   out_dtype: torch.dtype, return_dropout_mask: bool = False):
    """y = Dropout(LN(word[ids] + pos[position_ids] + token_type[token_type_ids]) * ln_weight + ln_bias).

    ids: [T] int32/int64 (ranges already validated by the caller); tables [rows, H] of one dtype.
    Returns (y [T, H] out_dtype, mean [T] fp32, rstd [T] fp32) (+ keep bool [T, H]).
    """
    t = _check_ids(input_ids, position_ids, token_type_ids)
    dev = input_ids.device
    h = _check_tables(word, pos, token_type, ln_weight, ln_bias, dev)
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {[str(d) for d in FLOAT_DTYPES]}, got {out_dtype}")
    eps = _check_eps(eps)
    dropout_p = _check_dropout(dropout_p, seed, dev)
    y = torch.empty((t, h), dtype=out_dtype, device=dev)
    mean = torch.empty(t, dtype=torch.float32, device=dev)
    rstd = torch.empty(t, dtype=torch.float32, device=dev)
    keep = torch.empty((t, h), dtype=torch.bool, device=dev) if return_dropout_mask else None
    if t > 0:
        pdt = _table_dtype(word.dtype, out_dtype)
        tabs = [_as(x, pdt) for x in (word, pos, token_type, ln_weight, ln_bias)]
        ids = [i.contiguous() for i in (input_ids, position_ids, token_type_ids)]
        _launch(dev, "embeddings_fwd", ids[0].data_ptr(), int(ids[0].dtype == torch.int64), ids[1].data_ptr(),
                int(ids[1].dtype == torch.int64), ids[2].data_ptr(),
                int(ids[2].dtype == torch.int64), *(x.data_ptr() for x in tabs), y.data_ptr(),
                mean.data_ptr(), rstd.data_ptr(), _ptr(keep), t, h, eps, dropout_p,
                _seed_ptr(seed, dropout_p), _CODE[pdt], _CODE[out_dtype])
    if return_dropout_mask:
        return y, mean, rstd, keep
    return y, mean, rstd


def embeddings_bwd(dy: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   token_type_ids: torch.Tensor, word: torch.Tensor, pos: torch.Tensor, token_type: torch.Tensor,
                   ln_weight: torch.Tensor, ln_bias: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                   dropout_p: float, seed: Optional[torch.Tensor]):
    """Gradients of embeddings_fwd -> (dword [V, H], dpos [P, H], dtoken_type [TT, H], dln_weight [H],
    dln_bias [H]), each in its parameter's dtype; the tables' gradients are scatter-added in fp32
    (repeated ids add up) and cast at the end."""
    t = _check_ids(input_ids, position_ids, token_type_ids)
    dev = input_ids.device
    h = _check_tables(word, pos, token_type, ln_weight, ln_bias, dev)
    _check("dy", dy, dtypes=FLOAT_DTYPES, shape=(t, h), device=dev)
    _check("mean", mean, dtypes=(torch.float32,), shape=(t,), device=dev)
    _check("rstd", rstd, dtypes=(torch.float32,), shape=(t,), device=dev)
    dropout_p = _check_dropout(dropout_p, seed, dev)

    pdt = _table_dtype(word.dtype, dy.dtype)
    tabs = [_as(x, pdt) for x in (word, pos, token_type, ln_weight)]
    ids = [i.contiguous() for i in (input_ids, position_ids, token_type_ids)]
    dy, mean, rstd = dy.contiguous(), mean.contiguous(), rstd.contiguous()
    grads = [torch.zeros(x.shape, dtype=torch.float32, device=dev) for x in (word, pos, token_type)]
    dlnw = torch.empty(h, dtype=pdt, device=dev)
    dlnb = torch.empty(h, dtype=pdt, device=dev)
    ws = torch.empty((_reduction_blocks(t), 2, h), dtype=torch.float32, device=dev)
    _launch(dev, "embeddings_bwd", dy.data_ptr(), ids[0].data_ptr(), int(ids[0].dtype == torch.int64),
            ids[1].data_ptr(),
            int(ids[1].dtype == torch.int64), ids[2].data_ptr(), int(ids[2].dtype == torch.int64),
            *(x.data_ptr() for x in tabs), mean.data_ptr(), rstd.data_ptr(), *(g.data_ptr() for g in grads),
            dlnw.data_ptr(),
            dlnb.data_ptr(), ws.data_ptr(), t, h, token_type.shape[0], dropout_p,
            _seed_ptr(seed, dropout_p), _CODE[pdt], _CODE[dy.dtype])
    dword, dpos, dtype_ = (g.to(x.dtype) for g, x in zip(grads, (word, pos, token_type)))
    return dword, dpos, dtype_, dlnw.to(ln_weight.dtype), dlnb.to(ln_bias.dtype)


# =========================================================================== MLM cross-entropy
def _checked_labels(labels, rows: int, device) -> torch.Tensor:
    _check("labels", labels, dtypes=ID_DTYPES, shape=(rows,), device=device)
    return labels.to(torch.int64).contiguous()


def softmax_cross_entropy_(logits: torch.Tensor, labels: torch.Tensor, grad_scale: float,
                           compute_grad: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row softmax cross-entropy over logits [M, V] (stride 1 along V), MODIFIED IN PLACE when
    compute_grad: grad_scale * (softmax - onehot(label)) on labelled rows, 0 on ignored ones.
    labels [M] int64 (int32 accepted); -100 and (unchecked) out-of-range labels are ignored.
    Returns (loss [M] fp32, 0 at ignored rows; lse [M] fp32; correct [M] bool)."""
    _check("logits", logits, dtypes=FLOAT_DTYPES, ndim=2)
    m, v = logits.shape
    if v == 0:
        raise ValueError(f"logits: expected a non-empty vocabulary dimension, got shape {tuple(logits.shape)}")
    if m > 1 and (logits.stride(1) != 1 or logits.stride(0) < v) or (m <= 1 and v > 1 and logits.stride(1) != 1):
        raise ValueError(f"logits: expected stride 1 along the vocabulary and row stride >= {v}, "
                         f"got strides {logits.stride()}")
    labels = _checked_labels(labels, m, logits.device)
    return _softmax_cross_entropy(logits, labels, float(grad_scale), bool(compute_grad))


def _softmax_cross_entropy(logits, labels, grad_scale, compute_grad):
    m, v = logits.shape
    dev = logits.device
    loss = torch.empty(m, dtype=torch.float32, device=dev)
    lse = torch.empty(m, dtype=torch.float32, device=dev)
    correct = torch.empty(m, dtype=torch.bool, device=dev)
    if m > 0:
        _launch(dev, "softmax_cross_entropy", logits.data_ptr(), _row_stride(logits), labels.data_ptr(),
                loss.data_ptr(),
                lse.data_ptr(), correct.data_ptr(), m, v, grad_scale, int(compute_grad),
                _CODE[logits.dtype])
    return loss, lse, correct


def default_chunk_rows(num_rows: int, vocab_size: int, element_size: int, budget_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk for chunk_rows=None: logits of a chunk within budget_bytes, a multiple of 64
    rows (at least 64), spread evenly over the chunks needed."""
    cap = max(64, budget_bytes // max(1, vocab_size * element_size) // 64 * 64)
    if num_rows <= cap:
        return max(1, num_rows)
    n_chunks = -(-num_rows // cap)
    per_chunk = -(-num_rows // n_chunks)
    return min(cap, -(-per_chunk // 64) * 64)


_MM_FP32_OUT = {}


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as fp32: low-precision GEMMs write their fp32 accumulator directly where torch
    supports out_dtype (probed once per device and dtype), else the product is rounded once."""
    if a.dtype == torch.float32:
        return a @ b
    key = (a.device, a.dtype)
    if key not in _MM_FP32_OUT:
        try:
            probe = torch.mm(torch.ones(16, 16, dtype=a.dtype, device=a.device),
                             torch.ones(16, 16, dtype=a.dtype, device=a.device), out_dtype=torch.float32)
            _MM_FP32_OUT[key] = probe.dtype == torch.float32 and bool((probe == 16).all())
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_FP32_OUT[key] = False
    if _MM_FP32_OUT[key]:
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def linear_cross_entropy_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                             labels: torch.Tensor, chunk_rows: Optional[int], compute_grad: bool,
                             grad_scale: float):
    """Sum over labelled rows of the softmax cross-entropy of x @ weight.T + bias, chunk by chunk.

    x [M, H], weight [V, H], bias [V] | None, labels [M] (-100 ignored; any other label outside
    [0, V) raises ValueError, which costs one sync). chunk_rows: rows per chunk (None: logits of a
    chunk <= 256 MiB). Per chunk: logits = x_c @ W^T + b (cuBLAS, activation dtype), the in-place
    kernel, then grad_x_c = dlogits @ W, grad_W += dlogits^T x_c and grad_b += colsum(dlogits)
    accumulated in fp32. Gradients are of grad_scale * loss_sum.
    Returns (loss_sum fp32 scalar, n_correct int64 scalar, grad_x [M, H] | None,
    grad_weight [V, H] | None, grad_bias [V] | None).
    """
    _check("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    m, h = x.shape
    dev = x.device
    _check("weight", weight, dtypes=FLOAT_DTYPES, ndim=2, device=dev)
    v = weight.shape[0]
    if weight.shape[1] != h or v == 0:
        raise ValueError(f"weight: expected shape (V > 0, {h}) matching x {tuple(x.shape)}, got {tuple(weight.shape)}")
    if bias is not None:
        _check("bias", bias, dtypes=FLOAT_DTYPES, shape=(v,), device=dev)
    labels = _checked_labels(labels, m, dev)
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(m, v, x.element_size())
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows: expected a positive int or None, got {chunk_rows!r}")
    grad_scale = float(grad_scale)
    bad = (labels >= v) | ((labels < 0) & (labels != IGNORE_INDEX))
    if bool(bad.any()):
        raise ValueError(f"labels: expected values in [0, {v}) or {IGNORE_INDEX}, got {int(labels[bad][0])}")

    loss_sum = torch.zeros((), dtype=torch.float32, device=dev)
    n_correct = torch.zeros((), dtype=torch.int64, device=dev)
    grad_x = grad_w = grad_b = None
    if compute_grad:
        grad_x = torch.empty((m, h), dtype=x.dtype, device=dev)
        grad_w = torch.zeros((v, h), dtype=torch.float32, device=dev)
        grad_b = torch.zeros(v, dtype=torch.float32, device=dev) if bias is not None else None
    w = weight.to(x.dtype)                                  # [V, H] GEMMs in the activation dtype
    b = bias.to(x.dtype) if bias is not None else None      # [V]
    buf = torch.empty((min(chunk_rows, m), v), dtype=x.dtype, device=dev)
    for r0 in range(0, m, chunk_rows):
        r1 = min(r0 + chunk_rows, m)
        x_c = x[r0:r1]                                      # [rows, H]
        logits = buf[: r1 - r0]                             # [rows, V]
        if b is not None:
            torch.addmm(b, x_c, w.t(), out=logits)
        else:
            torch.mm(x_c, w.t(), out=logits)
        loss, _, correct = _softmax_cross_entropy(logits, labels[r0:r1], grad_scale, compute_grad)
        loss_sum += loss.sum()
        n_correct += correct.sum()
        if compute_grad:                                    # logits now hold dlogits [rows, V]
            torch.mm(logits, w, out=grad_x[r0:r1])          # [rows, H]
            grad_w += _mm_fp32(logits.t(), x_c)             # [V, H]
            if grad_b is not None:
                grad_b += logits.sum(0, dtype=torch.float32)
    if not compute_grad:
        return loss_sum, n_correct, None, None, None
    return (loss_sum, n_correct, grad_x, grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype))


# =========================================================================== attention
def _check_qkv(names, tensors, ndim: int, layout: str) -> None:
    ref_name, ref = names[0], tensors[0]
    _check(ref_name, ref, dtypes=FLOAT_DTYPES, ndim=ndim)
    for name, t in zip(names[1:], tensors[1:]):
        _check(name, t, dtypes=(ref.dtype,), shape=ref.shape, device=ref.device)
    head_dim = ref.shape[-1]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{ref_name}: expected head dim in {SUPPORTED_HEAD_DIMS} ({layout}), got {head_dim}")
    for name, t in zip(names, tensors):
        _check_aligned(name, t)


def _check_aligned(name: str, t: torch.Tensor) -> None:
    """The attention kernels move 16-byte vectors: unit last stride, 16-byte aligned rows."""
    per16 = 16 // t.element_size()
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: expected a contiguous last (head) dim, got strides {t.stride()}")
    if t.data_ptr() % 16 != 0:
        raise ValueError(f"{name}: expected a 16-byte aligned data pointer, got address {t.data_ptr():#x} "
                         f"(call .contiguous() on a fresh tensor)")
    bad = [s for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1 and s % per16 != 0]
    if bad:
        raise ValueError(f"{name}: expected strides that are multiples of {per16} elements (16 bytes), "
                         f"got strides {t.stride()}")


def _aligned_or_copy(t: torch.Tensor) -> torch.Tensor:
    """Gradients from autograd may come expanded or oddly strided: copy those."""
    per16 = 16 // t.element_size()
    ok = (t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and
          all(s % per16 == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1))
    return t if ok else t.contiguous()


def _scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    softmax_scale = float(softmax_scale)
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale: expected a finite float, got {softmax_scale}")
    return softmax_scale


def _check_cu_seqlens(cu_seqlens, max_seqlen, device) -> Tuple[int, int]:
    _check("cu_seqlens", cu_seqlens, dtypes=(torch.int32,), ndim=1, device=device)
    if cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens: expected shape [B + 1] with B >= 0, got an empty tensor")
    if cu_seqlens.stride(0) != 1:
        raise ValueError(f"cu_seqlens: expected a contiguous tensor, got stride {cu_seqlens.stride()}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or not 0 <= max_seqlen < 2 ** 31:
        raise ValueError(f"max_seqlen: expected a python int in [0, 2**31), got {max_seqlen!r}")
    batch = cu_seqlens.numel() - 1
    if batch > 65535:
        raise ValueError(f"cu_seqlens: expected at most 65535 sequences, got {batch}")
    return batch, max_seqlen


def _key_mask(key_padding_mask, batch: int, seqlen: int, device) -> Optional[torch.Tensor]:
    """[B, S] bool/int (1 = token) -> contiguous uint8, or None."""
    if key_padding_mask is None:
        return None
    _check("key_padding_mask", key_padding_mask, shape=(batch, seqlen), device=device)
    if key_padding_mask.is_floating_point() or key_padding_mask.is_complex():
        raise ValueError(f"key_padding_mask: expected a bool or integer tensor, got {key_padding_mask.dtype}")
    if key_padding_mask.dtype == torch.bool:
        return key_padding_mask.contiguous().view(torch.uint8)
    return (key_padding_mask != 0).to(torch.uint8).contiguous()


def _bsh(t: torch.Tensor, varlen: bool) -> Tuple[int, int, int]:
    """(batch, row, head) element strides; varlen tensors have no batch dim."""
    return (0, t.stride(0), t.stride(1)) if varlen else (t.stride(0), t.stride(1), t.stride(2))


def _fwd(q, k, v, cu_seqlens, key_mask, batch, seqlen, varlen, softmax_scale, dropout_p, seed):
    dev = q.device
    heads, head_dim = q.shape[-2], q.shape[-1]
    out = torch.empty(q.shape, dtype=q.dtype, device=dev)
    if varlen:
        lse = torch.empty((heads, q.shape[0]), dtype=torch.float32, device=dev)
        lse_strides = (0, lse.stride(0))
    else:
        lse = torch.empty((batch, heads, seqlen), dtype=torch.float32, device=dev)
        lse_strides = (lse.stride(0), lse.stride(1))
    if out.numel() == 0 or batch == 0 or seqlen == 0:
        return out.zero_(), lse.fill_(float("inf"))
    _launch(dev, "attention_fwd", q.data_ptr(), _bsh(q, varlen), k.data_ptr(), _bsh(k, varlen), v.data_ptr(),
            _bsh(v, varlen), out.data_ptr(), _bsh(out, varlen), lse.data_ptr(), *lse_strides,
            _ptr(cu_seqlens), _ptr(key_mask), key_mask.stride(0) if key_mask is not None else 0,
            batch, heads, head_dim, seqlen, softmax_scale, dropout_p, _seed_ptr(seed, dropout_p),
            _CODE[q.dtype])
    return out, lse


def _bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens, key_mask, batch, seqlen, varlen, softmax_scale,
         dropout_p, seed):
    dev = q.device
    heads, head_dim = q.shape[-2], q.shape[-1]
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    lse_strides = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    _launch(dev, "attention_bwd", dout.data_ptr(), _bsh(dout, varlen), q.data_ptr(), _bsh(q, varlen), k.data_ptr(),
            _bsh(k, varlen), v.data_ptr(), _bsh(v, varlen), out.data_ptr(), _bsh(out, varlen),
            lse.data_ptr(), delta.data_ptr(), *lse_strides, dq.data_ptr(), _bsh(dq, varlen),
            dk.data_ptr(), _bsh(dk, varlen), dv.data_ptr(), _bsh(dv, varlen), _ptr(cu_seqlens),
            _ptr(key_mask), key_mask.stride(0) if key_mask is not None else 0, batch, heads,
            head_dim, seqlen, softmax_scale, dropout_p, _seed_ptr(seed, dropout_p),
            _CODE[q.dtype])


def attention_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         max_seqlen: int, softmax_scale: float, dropout_p: float,
                         seed: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention on unpadded tokens: q, k, v [T, A, D] (views of a packed [T, 3, A, D] are fine)
    -> (out [T, A, D], lse [A, T] fp32; +inf where a row has no key). Sequence b is rows
    cu_seqlens[b]:cu_seqlens[b+1]; max_seqlen >= every length. Rows outside every sequence are
    left unwritten."""
    _check_qkv(("q", "k", "v"), (q, k, v), 3, "[T, A, D]")
    batch, max_seqlen = _check_cu_seqlens(cu_seqlens, max_seqlen, q.device)
    softmax_scale = _scale(softmax_scale, q.shape[-1])
    dropout_p = _check_dropout(dropout_p, seed, q.device)
    return _fwd(q, k, v, cu_seqlens, None, batch, max_seqlen, True, softmax_scale, dropout_p, seed)


def attention_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                         softmax_scale: float, dropout_p: float, seed: Optional[torch.Tensor]) -> torch.Tensor:
    """Gradients of attention_varlen_fwd -> dqkv [T, 3, A, D] (dq = dqkv[:, 0], dk, dv likewise;
    zero at rows outside every sequence)."""
    _check_qkv(("q", "k", "v", "out"), (q, k, v, out), 3, "[T, A, D]")
    _check("dout", dout, dtypes=(q.dtype,), shape=q.shape, device=q.device)
    tokens, heads, head_dim = q.shape
    _check("lse", lse, dtypes=(torch.float32,), shape=(heads, tokens), device=q.device)
    batch, max_seqlen = _check_cu_seqlens(cu_seqlens, max_seqlen, q.device)
    softmax_scale = _scale(softmax_scale, head_dim)
    dropout_p = _check_dropout(dropout_p, seed, q.device)
    dqkv = torch.zeros((tokens, 3, heads, head_dim), dtype=q.dtype, device=q.device)
    if dqkv.numel() == 0 or batch == 0 or max_seqlen == 0:
        return dqkv
    _bwd(_aligned_or_copy(dout), q, k, v, out, lse, dqkv[:, 0], dqkv[:, 1], dqkv[:, 2], cu_seqlens, None, batch,
         max_seqlen, True, softmax_scale, dropout_p, seed)
    return dqkv


def attention_padded_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_padding_mask: Optional[torch.Tensor], softmax_scale: float, dropout_p: float,
                         seed: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention on padded tensors: q, k, v [B, S, A, D], key_padding_mask [B, S] (1 = token, any
    pattern; None = none) -> (out [B, S, A, D], lse [B, A, S] fp32). Query rows at pad positions
    attend to the valid keys; a sequence with no valid key gives out 0 (lse +inf)."""
    _check_qkv(("q", "k", "v"), (q, k, v), 4, "[B, S, A, D]")
    batch, seqlen = q.shape[0], q.shape[1]
    if batch > 65535:
        raise ValueError(f"q: expected a batch of at most 65535, got {batch}")
    key_mask = _key_mask(key_padding_mask, batch, seqlen, q.device)
    softmax_scale = _scale(softmax_scale, q.shape[-1])
    dropout_p = _check_dropout(dropout_p, seed, q.device)
    return _fwd(q, k, v, None, key_mask, batch, seqlen, False, softmax_scale, dropout_p, seed)


def attention_padded_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
                         softmax_scale: float, dropout_p: float, seed: Optional[torch.Tensor]
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attention_padded_fwd -> (dq, dk, dv), each [B, S, A, D]; 0 at padding keys."""
    _check_qkv(("q", "k", "v", "out"), (q, k, v, out), 4, "[B, S, A, D]")
    _check("dout", dout, dtypes=(q.dtype,), shape=q.shape, device=q.device)
    batch, seqlen, heads, head_dim = q.shape
    if batch > 65535:
        raise ValueError(f"q: expected a batch of at most 65535, got {batch}")
    _check("lse", lse, dtypes=(torch.float32,), shape=(batch, heads, seqlen), device=q.device)
    key_mask = _key_mask(key_padding_mask, batch, seqlen, q.device)
    softmax_scale = _scale(softmax_scale, head_dim)
    dropout_p = _check_dropout(dropout_p, seed, q.device)
    dq, dk, dv = (torch.empty(q.shape, dtype=q.dtype, device=q.device) for _ in range(3))
    if dq.numel() == 0:
        return dq, dk, dv
    _bwd(_aligned_or_copy(dout), q, k, v, out, lse, dq, dk, dv, None, key_mask, batch, seqlen, False,
         softmax_scale, dropout_p, seed)
    return dq, dk, dv


def _dropout_mask(batch: int, seqlen: int, num_heads: int, dropout_p: float, seed, device) -> torch.Tensor:
    for name, value in (("batch", batch), ("seqlen", seqlen), ("num_heads", num_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2 ** 31:
            raise ValueError(f"{name}: expected a python int >= 0, got {value!r}")
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a value in [0, 1), got {dropout_p}")
    if dropout_p == 0.0 or batch * num_heads * seqlen == 0:
        return torch.ones((batch, num_heads, seqlen, seqlen), dtype=torch.bool, device=device)
    _check_dropout(dropout_p, seed, device)
    keep = torch.empty((batch, num_heads, seqlen, seqlen), dtype=torch.bool, device=device)
    _launch(device, "attention_dropout_mask", keep.data_ptr(), batch, num_heads, seqlen, dropout_p, seed.data_ptr())
    return keep


def attention_varlen_dropout_mask(cu_seqlens: torch.Tensor, max_seqlen: int, num_heads: int, dropout_p: float,
                                  seed: Optional[torch.Tensor]) -> torch.Tensor:
    """The keep-mask the varlen kernels draw: bool [B, A, max_seqlen, max_seqlen] (sequence b uses
    its top-left [len_b, len_b] block), for reference.attention_varlen(dropout_mask=...)."""
    batch, max_seqlen = _check_cu_seqlens(cu_seqlens, max_seqlen, cu_seqlens.device)
    return _dropout_mask(batch, max_seqlen, num_heads, dropout_p, seed, cu_seqlens.device)


def attention_padded_dropout_mask(batch: int, seqlen: int, num_heads: int, dropout_p: float,
                                  seed: Optional[torch.Tensor]) -> torch.Tensor:
    """The keep-mask the padded kernels draw: bool [B, A, S, S], on the seed's device (CPU ones
    when there is no dropout and no seed)."""
    device = seed.device if seed is not None else torch.device("cpu")
    return _dropout_mask(batch, seqlen, num_heads, dropout_p, seed, device)


__all__ = [
    "extension_status",
    "bias_gelu_fwd", "bias_gelu_bwd",
    "bias_dropout_residual_layernorm_fwd", "bias_dropout_residual_layernorm_bwd",
    "embeddings_fwd", "embeddings_bwd",
    "softmax_cross_entropy_", "linear_cross_entropy_fwd", "default_chunk_rows",
    "attention_varlen_fwd", "attention_varlen_bwd", "attention_padded_fwd", "attention_padded_bwd",
    "attention_varlen_dropout_mask", "attention_padded_dropout_mask",
    "SUPPORTED_HEAD_DIMS",
]
