"""CPU tests of the CUDA extension itself (bertfast._C), no GPU needed.

* the extension is built (by `pip install -e .`), imports without a GPU or driver, and lands at
  bertfast/_C*.so; where nvcc is missing these skip with extension_status()'s reason;
* cuda_build.py: BERTFAST_BUILD_CUDA / BERTFAST_CUDA_ARCHS handling and the toolkit lookup;
* the kernels' Philox4x32-10 against the Random123 known-answer vectors;
* launcher argument errors surface as RuntimeError with the launcher's message.

Each op's CUDA kernels run in tests/ops/test_<op>.py: on the GPU, or on the CPU emulator
(csrc/emu), where the same tests also check each wrapper's validation.
"""
import importlib.util
import os
import shutil

import pytest
import torch

from bertfast.cuda import _common as cuda_common

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
    available, reason = cuda_common.extension_status()
    if not available:
        if cuda_build.find_nvcc() is None or os.environ.get(cuda_common.SKIP_ENV):
            pytest.skip(reason)
        pytest.fail(f"nvcc is installed but the extension is not available: {reason}")
    return cuda_common._C


# =========================================================================== build and import
def test_extension_imports_from_the_package(ext):
    available, reason = cuda_common.extension_status()
    assert available and "loaded from" in reason
    path = os.path.realpath(ext.__file__)
    assert os.path.dirname(path) == os.path.realpath(os.path.join(ROOT, "bertfast"))
    assert os.path.basename(path).startswith("_C") and path.endswith(".so")
    expected = cuda_build.parse_archs(os.environ.get("BERTFAST_CUDA_ARCHS", cuda_build.DEFAULT_ARCHS))
    assert ext.cuda_archs.split(";") == expected
    assert ext.cuda_runtime in ("static", "shared")
    for name in ("bias_gelu_fwd", "bias_gelu_bwd", "bias_dropout_residual_layernorm_fwd",
                 "bias_dropout_residual_layernorm_bwd", "embeddings_fwd", "embeddings_bwd", "mlm_head_loss_fwd",
                 "attention_fwd", "attention_bwd", "attention_dropout_mask"):
        assert callable(getattr(ext, name)), name


def test_extension_status_explains_a_missing_module(monkeypatch):
    monkeypatch.setattr(cuda_common, "_C", None)
    monkeypatch.setattr(cuda_common, "_IMPORT_ERROR", ImportError("No module named 'bertfast._C'"))
    monkeypatch.delenv("BERTFAST_BUILD_CUDA", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    available, reason = cuda_common.extension_status()
    assert not available and "nvcc was not found" in reason and "bertfast._C" in reason
    monkeypatch.setattr(shutil, "which", lambda name: "/opt/cuda/bin/nvcc")
    available, reason = cuda_common.extension_status()
    assert not available and "/opt/cuda/bin/nvcc" in reason and "build_ext --inplace" in reason
    monkeypatch.setenv("BERTFAST_BUILD_CUDA", "0")
    assert "BERTFAST_BUILD_CUDA=0" in cuda_common.extension_status()[1]
    with pytest.raises(RuntimeError, match="CUDA backend is unavailable"):
        cuda_common.ext()


def test_skip_env_keeps_an_importable_extension_unloaded_and_says_why(tmp_path):
    """BERTFAST_SKIP_EXTENSION (the GPU check sets it after a failed build) wins over a module that
    imports: the CUDA backend is unavailable with that reason, in dispatch and in `bertfast info`."""
    import subprocess
    import sys

    env = dict(os.environ, BERTFAST_SKIP_EXTENSION="the build failed: attention_fwd.cu(12): error: boom")
    probe = ("from bertfast.cuda import _common as c; from bertfast import dispatch; "
             "print(c._C is None, c.extension_status()[1]); print(dispatch.get('bias_gelu', 'cuda').availability())")
    res = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    first, second = res.stdout.splitlines()
    assert first.startswith("True ") and "BERTFAST_SKIP_EXTENSION" in first and "attention_fwd.cu(12): error" in first
    assert second.startswith("(False,") and "attention_fwd.cu(12): error: boom" in second
    info = subprocess.run([sys.executable, "-m", "bertfast.cli", "info"], env=env, capture_output=True, text=True,
                          cwd=str(tmp_path))
    assert "CUDA extension bertfast._C: unavailable: " in info.stdout and "error: boom" in info.stdout


# =========================================================================== cuda_build.py
def test_parse_archs():
    assert cuda_build.parse_archs("80;90") == ["80", "90"]
    assert cuda_build.parse_archs("8.0, 9.0") == ["80", "90"]
    assert cuda_build.parse_archs("90a") == ["90a"]
    for bad in ("75", "sm80x", ""):
        with pytest.raises(RuntimeError, match="BERTFAST_CUDA_ARCHS"):
            cuda_build.parse_archs(bad)
    with pytest.raises(RuntimeError, match="give 90 or 90a, not both"):
        cuda_build.parse_archs("90;90a")
    flags = cuda_build.gencode_flags(["80", "90"])
    assert flags == ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
                     "-gencode", "arch=compute_90,code=compute_90"]
    # the default: sm_90a SASS (wgmma) and portable compute_90 PTX for later GPUs
    flags = cuda_build.gencode_flags(cuda_build.parse_archs(cuda_build.DEFAULT_ARCHS))
    assert flags == ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90a,code=sm_90a",
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
    assert {"attention_fwd.cu", "attention_bwd.cu", "bias_gelu.cu", "bias_dropout_residual_layernorm.cu",
            "embeddings.cu", "mlm_head_loss.cu", "bindings.cpp"} <= sources
    # each attention direction's kernels compile per dtype, side by side
    assert {f"attention_{d}_{t}.cu" for d in ("fwd", "bwd") for t in ("fp32", "fp16", "bf16")} <= sources
    assert "build_ext" in kwargs["cmdclass"]


def test_nvcc_compiles_each_target_in_a_thread_and_max_jobs_counts_them(monkeypatch, tmp_path):
    assert cuda_build.nvcc_threads(["90a"]) == 2 and cuda_build.nvcc_threads(["80", "90a"]) == 3  # + the PTX
    monkeypatch.setenv("MAX_JOBS", "16")
    assert cuda_build._parallel_sources(["90a"]) == 8
    monkeypatch.setenv("MAX_JOBS", "2")
    assert cuda_build._parallel_sources(["80", "90a"]) == 1
    jobs = cuda_build._compile_commands("nvcc", {"runtime": "static"}, ["80", "90a"], str(tmp_path))
    nvcc_jobs = [cmd for _, cmd, kind in jobs if kind == "nvcc"]
    assert nvcc_jobs and all(cmd[cmd.index("--threads") + 1] == "3" for cmd in nvcc_jobs)


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
    for head_dim in (7, 264):
        with pytest.raises(RuntimeError, match=rf"head_dim must be in \[8, 256\], got {head_dim}"):
            ext.attention_fwd(0, (0, 96, 48), 0, (0, 96, 48), 0, (0, 96, 48), 0, (0, 96, 48), 0, 0, 8, 0, 0, 0, 1,
                              2, head_dim, 8, 0.1, 0.0, 0, 0, 0, 1, 0)
    for scale in (0.0, -0.125, float("inf")):
        with pytest.raises(RuntimeError, match=r"softmax_scale must be a finite float > 0, got"):
            ext.attention_fwd(0, (0, 96, 48), 0, (0, 96, 48), 0, (0, 96, 48), 0, (0, 96, 48), 0, 0, 8, 0, 0, 0, 1,
                              2, 64, 8, scale, 0.0, 0, 0, 0, 1, 0)
    for keep, keep_len in ((0, 128), (8, 100), (8, 0)):  # dropout without its keep bits, or too short ones
        with pytest.raises(RuntimeError, match="dropout needs its keep bits, keep_len a multiple of 128"):
            ext.attention_fwd(0, (0, 96, 48), 0, (0, 96, 48), 0, (0, 96, 48), 0, (0, 96, 48), 0, 0, 8, 0, 0, 0, 1,
                              2, 64, 8, 0.125, 0.1, 8, keep, keep_len, 1, 0)
    with pytest.raises(RuntimeError, match="the keep bits must be 16-byte aligned, got address 0x8"):
        ext.attention_fwd(0, (0, 96, 48), 0, (0, 96, 48), 0, (0, 96, 48), 0, (0, 96, 48), 0, 0, 8, 0, 0, 0, 1,
                          2, 64, 8, 0.125, 0.1, 8, 8, 128, 1, 0)
    with pytest.raises(RuntimeError, match="expected n >= 0 and f > 0"):
        ext.bias_gelu_fwd(0, 0, 0, 0, 4, 0, 1, 1, 0, 0)
    with pytest.raises(RuntimeError, match="unknown dtype code 7"):
        ext.bias_gelu_fwd(0, 8, 0, 0, 4, 8, 7, 7, 0, 0)
    with pytest.raises(RuntimeError, match="parameter dtype code 2 must equal"):
        ext.bias_gelu_fwd(0, 8, 0, 0, 4, 8, 1, 2, 0, 0)
    with pytest.raises(RuntimeError, match="0 < h <= 8192"):
        ext.bias_dropout_residual_layernorm_fwd(0, 9000, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 9000, 1e-12, 0.0, 0, 1, 1, 0)
    with pytest.raises(RuntimeError, match="dropout needs a seed"):
        ext.attention_dropout_mask(0, 1, 1, 4, 0.5, 0, 0)
    with pytest.raises(RuntimeError, match="row_stride >= v"):
        ext.mlm_head_loss_fwd(0, 4, 0, 0, 0, 0, 2, 8, 1.0, 1, 1, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="launches with null pointers: only safe without a GPU")
def test_launch_without_a_gpu_is_a_clean_runtime_error(ext):
    with pytest.raises(RuntimeError, match="mlm_head_loss_fwd: CUDA error"):
        ext.mlm_head_loss_fwd(0, 8, 0, 0, 0, 0, 2, 8, 1.0, 1, 1, 0)
