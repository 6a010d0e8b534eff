"""CPU tests of the CUDA backend (bertfast._C + bertfast.cuda_ops), no GPU needed.

* the extension is built (by `pip install -e .`), imports without a GPU or driver, and lands at
  bertfast/_C*.so; where nvcc is missing these skip with extension_status()'s reason;
* cuda_build.py: BERTFAST_BUILD_CUDA / BERTFAST_CUDA_ARCHS handling and the toolkit lookup;
* the kernels' Philox4x32-10 against the Random123 known-answer vectors;
* launcher argument errors surface as RuntimeError with the launcher's message;
* every wrapper rejects bad inputs (CPU tensors, wrong dtype / shape / strides, misaligned
  pointers, unsupported sizes) with a ValueError before anything reaches the GPU: the
  validation is exercised on CPU tensors by letting cuda_ops accept the "cpu" device type and
  replacing its single launch point, which must then never be reached for a bad input.
"""
import importlib.util
import os
import shutil

import pytest
import torch

from bertfast import cuda_ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_cuda_build():
    spec = importlib.util.spec_from_file_location("cuda_build", os.path.join(ROOT, "cuda_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cuda_build = _load_cuda_build()


@pytest.fixture(scope="module")
def ext():
    """bertfast._C; a skip where nvcc is missing, a failure where nvcc exists but it is not built."""
    available, reason = cuda_ops.extension_status()
    if not available:
        if cuda_build.find_nvcc() is None:
            pytest.skip(reason)
        pytest.fail(f"nvcc is installed but the extension is not available: {reason}")
    return cuda_ops._C


# =========================================================================== build and import
def test_extension_imports_from_the_package(ext):
    available, reason = cuda_ops.extension_status()
    assert available and "loaded from" in reason
    path = os.path.realpath(ext.__file__)
    assert os.path.dirname(path) == os.path.realpath(os.path.join(ROOT, "bertfast"))
    assert os.path.basename(path).startswith("_C") and path.endswith(".so")
    expected = cuda_build.parse_archs(os.environ.get("BERTFAST_CUDA_ARCHS", cuda_build.DEFAULT_ARCHS))
    assert ext.cuda_archs.split(";") == expected
    assert ext.cuda_runtime in ("static", "shared")
    for name in ("bias_gelu_fwd", "bias_gelu_bwd", "layernorm_fwd", "layernorm_bwd", "embeddings_fwd",
                 "embeddings_bwd", "softmax_cross_entropy", "attention_fwd", "attention_bwd",
                 "attention_dropout_mask"):
        assert callable(getattr(ext, name)), name


def test_extension_status_explains_a_missing_module(monkeypatch):
    monkeypatch.setattr(cuda_ops, "_C", None)
    monkeypatch.setattr(cuda_ops, "_IMPORT_ERROR", ImportError("No module named 'bertfast._C'"))
    monkeypatch.delenv("BERTFAST_BUILD_CUDA", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    available, reason = cuda_ops.extension_status()
    assert not available and "nvcc was not found" in reason and "bertfast._C" in reason
    monkeypatch.setattr(shutil, "which", lambda name: "/opt/cuda/bin/nvcc")
    available, reason = cuda_ops.extension_status()
    assert not available and "/opt/cuda/bin/nvcc" in reason and "build_ext --inplace" in reason
    monkeypatch.setenv("BERTFAST_BUILD_CUDA", "0")
    assert "BERTFAST_BUILD_CUDA=0" in cuda_ops.extension_status()[1]
    with pytest.raises(RuntimeError, match="CUDA backend is unavailable"):
        cuda_ops._ext()


# =========================================================================== cuda_build.py
def test_parse_archs():
    assert cuda_build.parse_archs("80;90") == ["80", "90"]
    assert cuda_build.parse_archs("8.0, 9.0") == ["80", "90"]
    assert cuda_build.parse_archs("90a") == ["90a"]
    for bad in ("75", "sm80x", ""):
        with pytest.raises(RuntimeError, match="BERTFAST_CUDA_ARCHS"):
            cuda_build.parse_archs(bad)
    flags = cuda_build.gencode_flags(["80", "90"])
    assert flags == ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
                     "-gencode", "arch=compute_90,code=compute_90"]


def test_build_modes(monkeypatch):
    monkeypatch.setenv("BERTFAST_BUILD_CUDA", "0")
    assert cuda_build.cuda_extension_kwargs() == {}
    monkeypatch.setenv("BERTFAST_BUILD_CUDA", "maybe")
    with pytest.raises(RuntimeError, match="auto, 0 or 1"):
        cuda_build.cuda_extension_kwargs()
    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: None)
    monkeypatch.setenv("BERTFAST_BUILD_CUDA", "auto")
    assert cuda_build.cuda_extension_kwargs() == {}
    monkeypatch.setenv("BERTFAST_BUILD_CUDA", "1")
    with pytest.raises(RuntimeError, match="nvcc was not found"):
        cuda_build.cuda_extension_kwargs()
    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setenv("BERTFAST_CUDA_ARCHS", "80;90")
    kwargs = cuda_build.cuda_extension_kwargs()
    (extension,) = kwargs["ext_modules"]
    assert extension.name == "bertfast._C"
    sources = {os.path.basename(s) for s in extension.sources}
    assert {"attention_fwd.cu", "attention_bwd.cu", "bias_gelu.cu", "layer_norm.cu", "embeddings.cu",
            "cross_entropy.cu", "bindings.cpp"} <= sources
    assert "build_ext" in kwargs["cmdclass"]


def test_toolkit_lookup():
    nvcc = cuda_build.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    cuda = cuda_build.find_cuda(nvcc)
    assert os.path.isfile(os.path.join(cuda["include"], "cuda_runtime.h"))
    assert os.path.isdir(cuda["lib_dir"])
    assert cuda["runtime"] in ("static", "shared")


# =========================================================================== host-side checks of the module
def test_philox_matches_random123_known_answers(ext):
    # Known-answer vectors of Philox4x32-10 (Salmon et al.; Random123's kat_vectors).
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]
    for counter, key, expected in cases:
        assert tuple(ext.philox4x32_10(list(counter), list(key))) == expected


def test_reduction_blocks(ext):
    assert ext.reduction_blocks(0) == 1
    assert ext.reduction_blocks(7) == 7
    assert ext.reduction_blocks(10 ** 6) == 1024


def test_launcher_argument_errors_raise_runtime_error(ext):
    # Each of these is rejected by the launcher before any CUDA call.
    with pytest.raises(RuntimeError, match="head_dim must be 16, 32, 64 or 128, got 48"):
        ext.attention_fwd(0, (0, 96, 48), 0, (0, 96, 48), 0, (0, 96, 48), 0, (0, 96, 48), 0, 0, 8, 0, 0, 0, 1, 2,
                          48, 8, 0.1, 0.0, 0, 1, 0)
    with pytest.raises(RuntimeError, match="expected n >= 0 and f > 0"):
        ext.bias_gelu_fwd(0, 0, 0, 0, 4, 0, 1, 1, 0, 0)
    with pytest.raises(RuntimeError, match="unknown dtype code 7"):
        ext.bias_gelu_fwd(0, 8, 0, 0, 4, 8, 7, 7, 0, 0)
    with pytest.raises(RuntimeError, match="parameter dtype code 2 must equal"):
        ext.bias_gelu_fwd(0, 8, 0, 0, 4, 8, 1, 2, 0, 0)
    with pytest.raises(RuntimeError, match="0 < h <= 8192"):
        ext.layernorm_fwd(0, 9000, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 9000, 1e-12, 0.0, 0, 1, 1, 0)
    with pytest.raises(RuntimeError, match="dropout needs a seed"):
        ext.attention_dropout_mask(0, 1, 1, 4, 0.5, 0, 0)
    with pytest.raises(RuntimeError, match="row_stride >= v"):
        ext.softmax_cross_entropy(0, 4, 0, 0, 0, 0, 2, 8, 1.0, 1, 1, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="launches with null pointers: only safe without a GPU")
def test_launch_without_a_gpu_is_a_clean_runtime_error(ext):
    with pytest.raises(RuntimeError, match="softmax_cross_entropy: CUDA error"):
        ext.softmax_cross_entropy(0, 8, 0, 0, 0, 0, 2, 8, 1.0, 1, 1, 0)


# =========================================================================== wrapper validation
class Reached(Exception):
    """Raised by the stand-in launch point: validation let the inputs through."""


@pytest.fixture
def cpu_as_device(monkeypatch):
    """Let the wrappers take CPU tensors as if on the GPU, up to (not including) the launch."""
    monkeypatch.setattr(cuda_ops, "_DEVICE_TYPE", "cpu")
    calls = []

    def launch(device, name, *args):
        calls.append(name)
        raise Reached(name)

    monkeypatch.setattr(cuda_ops, "_launch", launch)
    monkeypatch.setattr(cuda_ops, "_reduction_blocks", lambda n: max(1, min(n, 1024)))
    return calls


def _reaches(fn, *args, **kwargs):
    with pytest.raises(Reached):
        fn(*args, **kwargs)


def _rejects(match, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


def _misaligned(shape, dtype):
    """A tensor whose data pointer is one element past a 16-byte boundary."""
    n = 1
    for s in shape:
        n *= s
    return torch.zeros(n + 1, dtype=dtype)[1:].view(shape)


def test_cpu_tensors_are_rejected():
    x = torch.randn(4, 8)
    b = torch.randn(8)
    _rejects("expected a CUDA tensor, got device cpu", cuda_ops.bias_gelu_fwd, x, b)
    _rejects("expected a CUDA tensor", cuda_ops.bias_gelu_bwd, x, x, b)
    _rejects("expected a CUDA tensor", cuda_ops.bias_dropout_residual_layernorm_fwd, x, b, x, b, b, 1e-12, 0.0, None)
    _rejects("expected a CUDA tensor", cuda_ops.bias_dropout_residual_layernorm_bwd, x, x, torch.zeros(4),
             torch.ones(4), b, 0.0, None, True, True)
    ids = torch.zeros(4, dtype=torch.long)
    _rejects("expected a CUDA tensor", cuda_ops.embeddings_fwd, ids, ids, ids, x, x, x, b, b, 1e-12, 0.0, None,
             torch.float32)
    _rejects("expected a CUDA tensor", cuda_ops.softmax_cross_entropy_, x, ids, 1.0, True)
    _rejects("expected a CUDA tensor", cuda_ops.linear_cross_entropy_fwd, x, x, None, ids, 2, True, 1.0)
    q = torch.randn(6, 2, 16)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    _rejects("expected a CUDA tensor", cuda_ops.attention_varlen_fwd, q, q, q, cu, 6, 0.25, 0.0, None)
    qp = torch.randn(1, 6, 2, 16)
    _rejects("expected a CUDA tensor", cuda_ops.attention_padded_fwd, qp, qp, qp, None, 0.25, 0.0, None)
    _rejects("expected a CUDA tensor", cuda_ops.attention_padded_dropout_mask, 1, 4, 2, 0.1,
             torch.zeros(1, dtype=torch.long))


def test_bias_gelu_validation(cpu_as_device):
    x = torch.randn(5, 24, dtype=torch.float16)
    b = torch.randn(24, dtype=torch.float16)
    _reaches(cuda_ops.bias_gelu_fwd, x, b)
    _reaches(cuda_ops.bias_gelu_fwd, torch.randn(5, 32, dtype=torch.float16)[:, :24], b.float())  # row-strided
    _reaches(cuda_ops.bias_gelu_bwd, x, x, b, "tanh")
    _rejects("dtype in", cuda_ops.bias_gelu_fwd, x.to(torch.int32), b)
    _rejects(r"bias: expected shape \(24,\), got \(23,\)", cuda_ops.bias_gelu_fwd, x, b[:23])
    _rejects("expected 2 dimensions", cuda_ops.bias_gelu_fwd, x[0], b)
    _rejects("stride", cuda_ops.bias_gelu_fwd, x.t().contiguous().t(), b)
    _rejects("approximate: expected 'none' or 'tanh'", cuda_ops.bias_gelu_fwd, x, b, "erf")
    _rejects(r"dy: expected dtype in \['torch.float16'\]", cuda_ops.bias_gelu_bwd, x.float(), x, b)
    _rejects("dy: expected shape", cuda_ops.bias_gelu_bwd, x[:4], x, b)
    assert cpu_as_device == ["bias_gelu_fwd", "bias_gelu_fwd", "bias_gelu_bwd"]


def test_layernorm_validation(cpu_as_device):
    x = torch.randn(6, 40, dtype=torch.bfloat16)
    w = torch.randn(40)
    seed = torch.tensor([3])
    fwd, bwd = cuda_ops.bias_dropout_residual_layernorm_fwd, cuda_ops.bias_dropout_residual_layernorm_bwd
    _reaches(fwd, x, w, x, w, w, 1e-12, 0.1, seed)
    _reaches(fwd, x, None, None, w, w, 1e-12, 0.0, None, return_dropout_mask=True)
    _reaches(fwd, torch.randn(6, 64, dtype=torch.bfloat16)[:, :40], None, x, w, w, 1e-5, 0.0, None)
    mean, rstd = torch.zeros(6), torch.ones(6)
    _reaches(bwd, x, x, mean, rstd, w, 0.1, seed, True, True)
    _rejects("seed: expected an int64 tensor", fwd, x, w, x, w, w, 1e-12, 0.1, None)
    _rejects(r"seed: expected shape \[1\]", fwd, x, w, x, w, w, 1e-12, 0.1, torch.tensor([1, 2]))
    _rejects("seed: expected dtype", fwd, x, w, x, w, w, 1e-12, 0.1, torch.tensor([1], dtype=torch.int32))
    _rejects(r"dropout_p: expected a value in \[0, 1\)", fwd, x, w, x, w, w, 1e-12, 1.0, seed)
    _rejects("residual: expected dtype", fwd, x, w, x.float(), w, w, 1e-12, 0.0, None)
    _rejects("residual: expected shape", fwd, x, w, x[:5], w, w, 1e-12, 0.0, None)
    _rejects(r"weight: expected shape \(40,\)", fwd, x, w, x, w[:39], w, 1e-12, 0.0, None)
    _rejects("hidden size in", fwd, torch.randn(2, 8200), None, None, torch.ones(8200), torch.ones(8200), 1e-12,
             0.0, None)
    _rejects("eps", fwd, x, w, x, w, w, float("nan"), 0.0, None)
    _rejects("stride", fwd, torch.randn(40, 6, dtype=torch.bfloat16).t(), w, None, w, w, 1e-12, 0.0, None)
    _rejects(r"mean: expected dtype in \['torch.float32'\]", bwd, x, x, mean.half(), rstd, w, 0.0, None, True, True)
    _rejects(r"rstd: expected shape \(6,\)", bwd, x, x, mean, rstd[:5], w, 0.0, None, True, True)
    _rejects("dy: expected dtype", bwd, x.float(), x, mean, rstd, w, 0.0, None, False, False)
    assert cpu_as_device == ["layernorm_fwd"] * 3 + ["layernorm_bwd"]


def test_embeddings_validation(cpu_as_device):
    t, h = 7, 24
    ids = torch.randint(0, 10, (t,))
    word, pos, tt = torch.randn(10, h), torch.randn(16, h), torch.randn(2, h)
    lw, lb = torch.ones(h), torch.zeros(h)
    args = (word, pos, tt, lw, lb)
    _reaches(cuda_ops.embeddings_fwd, ids, ids.int(), ids % 2, *args, 1e-12, 0.1, torch.tensor([1]),
             torch.bfloat16)
    y = torch.randn(t, h, dtype=torch.bfloat16)
    _reaches(cuda_ops.embeddings_bwd, y, ids, ids, ids % 2, *args, torch.zeros(t), torch.ones(t), 0.0, None)
    _rejects("input_ids: expected dtype", cuda_ops.embeddings_fwd, ids.float(), ids, ids, *args, 1e-12, 0.0, None,
             torch.float32)
    _rejects(r"position_ids: expected shape \(7,\)", cuda_ops.embeddings_fwd, ids, ids[:6], ids, *args, 1e-12, 0.0,
             None, torch.float32)
    _rejects(r"pos: expected shape \(rows > 0, 24\)", cuda_ops.embeddings_fwd, ids, ids, ids, word,
             torch.randn(16, 23), tt, lw, lb, 1e-12, 0.0, None, torch.float32)
    _rejects("token_type: expected dtype", cuda_ops.embeddings_fwd, ids, ids, ids, word, pos, tt.half(), lw, lb,
             1e-12, 0.0, None, torch.float32)
    _rejects("out_dtype", cuda_ops.embeddings_fwd, ids, ids, ids, *args, 1e-12, 0.0, None, torch.int8)
    _rejects(r"dy: expected shape \(7, 24\)", cuda_ops.embeddings_bwd, y[:6], ids, ids, ids, *args, torch.zeros(t),
             torch.ones(t), 0.0, None)
    assert cpu_as_device == ["embeddings_fwd", "embeddings_bwd"]


def test_cross_entropy_validation(cpu_as_device):
    logits = torch.randn(5, 33, dtype=torch.float16)
    labels = torch.tensor([1, -100, 32, 0, 5])
    _reaches(cuda_ops.softmax_cross_entropy_, logits, labels, 0.5, True)
    _reaches(cuda_ops.softmax_cross_entropy_, torch.randn(5, 40, dtype=torch.float16)[:, :33], labels.int(), 1.0,
             False)
    _rejects("labels: expected dtype", cuda_ops.softmax_cross_entropy_, logits, labels.float(), 1.0, True)
    _rejects(r"labels: expected shape \(5,\)", cuda_ops.softmax_cross_entropy_, logits, labels[:4], 1.0, True)
    _rejects("stride 1 along the vocabulary", cuda_ops.softmax_cross_entropy_, torch.randn(33, 5).t(), labels, 1.0,
             True)
    _rejects("non-empty vocabulary", cuda_ops.softmax_cross_entropy_, torch.randn(5, 0), labels, 1.0, True)
    x, w = torch.randn(5, 8), torch.randn(33, 8)
    _reaches(cuda_ops.linear_cross_entropy_fwd, x, w, torch.randn(33), labels, 2, True, 0.2)
    _rejects("weight: expected shape", cuda_ops.linear_cross_entropy_fwd, x, w[:, :7], None, labels, 2, True, 1.0)
    _rejects("chunk_rows", cuda_ops.linear_cross_entropy_fwd, x, w, None, labels, 0, True, 1.0)
    _rejects(r"labels: expected values in \[0, 33\) or -100, got 33", cuda_ops.linear_cross_entropy_fwd, x, w, None,
             torch.tensor([1, 2, 3, 4, 33]), 2, True, 1.0)
    assert cpu_as_device == ["softmax_cross_entropy"] * 3


def test_attention_validation(cpu_as_device):
    t, a, d = 9, 2, 32
    qkv = torch.randn(t, 3, a, d, dtype=torch.float16)
    q, k, v = qkv.unbind(1)  # packed views: row stride 3 A D, head stride D
    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    seed = torch.tensor([11])
    _reaches(cuda_ops.attention_varlen_fwd, q, k, v, cu, 5, 0.2, 0.1, seed)
    lse = torch.zeros(a, t)
    _reaches(cuda_ops.attention_varlen_bwd, torch.randn(t, a, d, dtype=torch.float16), q, k, v,
             torch.randn(t, a, d, dtype=torch.float16), lse, cu, 5, 0.2, 0.0, None)
    _rejects("head dim in", cuda_ops.attention_varlen_fwd, q[..., :24], k[..., :24], v[..., :24], cu, 5, 0.2, 0.0,
             None)
    _rejects("16-byte aligned data pointer", cuda_ops.attention_varlen_fwd, _misaligned((t, a, d), torch.float16),
             k, v, cu, 5, 0.2, 0.0, None)
    odd = torch.randn(t, a * d + 1, dtype=torch.float16)[:, : a * d].view(t, a, d)  # row stride 65 elements
    _rejects("multiples of 8 elements", cuda_ops.attention_varlen_fwd, odd, k, v, cu, 5, 0.2, 0.0, None)
    head_strided = torch.randn(t, d, a, dtype=torch.float16).transpose(1, 2)  # stride(-1) == A
    _rejects("contiguous last", cuda_ops.attention_varlen_fwd, head_strided, k, v, cu, 5, 0.2, 0.0, None)
    _rejects("k: expected dtype", cuda_ops.attention_varlen_fwd, q, k.float(), v, cu, 5, 0.2, 0.0, None)
    _rejects(r"v: expected shape \(9, 2, 32\)", cuda_ops.attention_varlen_fwd, q, k, v[:8], cu, 5, 0.2, 0.0, None)
    _rejects("cu_seqlens: expected dtype", cuda_ops.attention_varlen_fwd, q, k, v, cu.long(), 5, 0.2, 0.0, None)
    _rejects("max_seqlen: expected a python int", cuda_ops.attention_varlen_fwd, q, k, v, cu, 5.0, 0.2, 0.0, None)
    _rejects("seed: expected an int64 tensor", cuda_ops.attention_varlen_fwd, q, k, v, cu, 5, 0.2, 0.1, None)
    _rejects(r"lse: expected shape \(2, 9\)", cuda_ops.attention_varlen_bwd, q, q, k, v, q, lse.t(), cu, 5, 0.2,
             0.0, None)
    _rejects("softmax_scale", cuda_ops.attention_varlen_fwd, q, k, v, cu, 5, float("inf"), 0.0, None)

    b, s = 2, 5
    qp = torch.randn(b, s, a, d, dtype=torch.bfloat16)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    _reaches(cuda_ops.attention_padded_fwd, qp, qp, qp, mask, 0.2, 0.0, None)
    _reaches(cuda_ops.attention_padded_fwd, qp, qp, qp, mask.long(), 0.2, 0.0, None)
    _reaches(cuda_ops.attention_padded_bwd, qp, qp, qp, qp, qp, torch.zeros(b, a, s), None, 0.2, 0.0, None)
    _rejects(r"key_padding_mask: expected shape \(2, 5\)", cuda_ops.attention_padded_fwd, qp, qp, qp, mask[:, :4],
             0.2, 0.0, None)
    _rejects("bool or integer", cuda_ops.attention_padded_fwd, qp, qp, qp, mask.float(), 0.2, 0.0, None)
    _rejects("expected 4 dimensions", cuda_ops.attention_padded_fwd, qp[0], qp[0], qp[0], None, 0.2, 0.0, None)
    _rejects(r"lse: expected shape \(2, 2, 5\)", cuda_ops.attention_padded_bwd, qp, qp, qp, qp, qp,
             torch.zeros(b, s, a), None, 0.2, 0.0, None)

    _reaches(cuda_ops.attention_padded_dropout_mask, 2, 5, 2, 0.1, seed)
    _reaches(cuda_ops.attention_varlen_dropout_mask, cu, 5, 2, 0.1, seed)
    _rejects("num_heads: expected a python int", cuda_ops.attention_padded_dropout_mask, 2, 5, -1, 0.1, seed)
    assert cpu_as_device == ["attention_fwd", "attention_bwd", "attention_fwd", "attention_fwd", "attention_bwd",
                             "attention_dropout_mask", "attention_dropout_mask"]


def test_dropout_mask_without_dropout_needs_no_gpu():
    keep = cuda_ops.attention_padded_dropout_mask(2, 3, 4, 0.0, None)
    assert keep.shape == (2, 4, 3, 3) and keep.dtype == torch.bool and bool(keep.all())


# =========================================================================== the kernels, run on a CPU emulator
# csrc/emu builds the real kernels and launchers (three mechanical source rewrites) for the CPU:
# a std::thread per CUDA thread, barriers for __syncthreads/__syncwarp, a warp-collective WMMA.
# The GPU test functions then run unchanged against it. This checks the algorithms, indexing,
# masking, RNG use and synchronisation of every kernel; not the hardware-specific parts (the real
# WMMA element layout, the memory model, launch limits, speed), which need a GPU.
def _load_path(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """tests/gpu/test_cuda_ops.py loaded against bertfast.cuda_ops wired to the emulated kernels."""
    if cuda_build.find_nvcc() is None:
        pytest.skip("the emulation compiles against the CUDA headers; nvcc not found")
    pytest.importorskip("pybind11", reason="the emulated module is built with pybind11 (pip install pybind11)")
    build_emu = _load_path("bertfast_build_emu", os.path.join(ROOT, "csrc", "emu", "build_emu.py"))
    out = str(tmp_path_factory.mktemp("cuda_emu"))
    build_emu.build(out)
    module = build_emu.load(out)
    saved = (cuda_ops._C, cuda_ops._DEVICE_TYPE, cuda_ops._launch)
    cuda_ops._C = module
    cuda_ops._DEVICE_TYPE = "cpu"
    cuda_ops._launch = lambda device, name, *args: getattr(module, name)(*args, 0)
    gpu_tests = _load_path("bertfast_cuda_ops_emulated", os.path.join(ROOT, "tests", "gpu", "test_cuda_ops.py"))
    gpu_tests.DEVICE = "cpu"
    gpu_tests._triton = lambda name: None
    try:
        yield gpu_tests
    finally:
        cuda_ops._C, cuda_ops._DEVICE_TYPE, cuda_ops._launch = saved


@pytest.mark.slow
def test_emulated_row_kernels(emulated):
    torch.manual_seed(0)
    emulated.test_bias_gelu(torch.bfloat16, "none", (37, 1023))
    emulated.test_bias_gelu(torch.float16, "tanh", (64, 3072))
    emulated.test_layernorm(torch.bfloat16, 1023, True, True, 0.1)
    emulated.test_layernorm(torch.float32, 768, False, True, 0.0)
    emulated.test_embeddings(torch.bfloat16, torch.float32, 1023, 0.1)
    emulated.test_softmax_cross_entropy(torch.float16, 30522, True)


@pytest.mark.slow
def test_emulated_attention_kernels(emulated):
    torch.manual_seed(0)
    emulated.test_attention_varlen(torch.float16, 64, "random")     # 77 > one 64-key block
    emulated.test_attention_varlen(torch.bfloat16, 128, "empty")    # a zero-length sequence
    emulated.test_attention_varlen(torch.float32, 32, "all_but_one")
    emulated.test_attention_padded(torch.bfloat16, 64, "pattern")   # any mask, one all-pad sequence
    emulated.test_attention_dropout_exact(torch.float16, "varlen", 64)
    emulated.test_attention_dropout_exact(torch.float32, "padded", 128)
