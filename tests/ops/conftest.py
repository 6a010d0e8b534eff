"""The backends every contract test runs (tests/ops/test_<op>.py).

``backend`` is parametrised over torch, triton and cuda. On a machine with a GPU each runs on
CUDA tensors. Without one: torch on the CPU, Triton under the interpreter (TRITON_INTERPRET=1,
set in tests/conftest.py), and CUDA on the CPU emulator (csrc/emu: the real kernels and
launchers compiled with g++ against an emulation of threads, barriers and the PTX they issue), built once per
session. A backend that cannot run here skips with the reason.

Inside ``with backend.forced():`` every op call goes to that backend (a forced backend never
falls back), so a test exercises the whole op (contract, custom op, autograd) on it.
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

from bertfast import dispatch
from bertfast.testing import BackendUnderTest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU = torch.cuda.is_available()
BACKENDS = ("torch", "triton", "cuda")
FUSED = ("triton", "cuda")


def _load_path(name, path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def cuda_emulator(tmp_path_factory):
    """The CPU-emulated build of csrc/ (a module with bertfast._C's functions), or a skip. Built once
    a session: under pytest-xdist the first worker to need it builds it (g++ on every core, ~100 s of
    CPU) into the session's shared directory while the others wait on a lock, then all load it."""
    import fcntl

    cuda_build = _load_path("bertfast_cuda_build", os.path.join(ROOT, "cuda_build.py"))
    if cuda_build.find_nvcc() is None:
        pytest.skip("the CUDA emulation compiles against the CUDA headers; nvcc not found")
    pytest.importorskip("pybind11", reason="the emulated module is built with pybind11 (pip install pybind11)")
    build_emu = _load_path("bertfast_build_emu", os.path.join(ROOT, "csrc", "emu", "build_emu.py"))
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' base directories sit in one per session
    out = root / "cuda_emu"
    with open(root / "cuda_emu.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = out / "built"
        if not built.exists():  # a failed build leaves no mark: the next worker tries (and fails) again
            out.mkdir(exist_ok=True)
            built.write_text(build_emu.build(str(out)))
    return build_emu.load(str(out))


@contextlib.contextmanager
def emulating(module, monkeypatch):
    """Route the CUDA backend to the emulated module: CPU tensors count as the CUDA device."""
    from bertfast.cuda import _common

    with monkeypatch.context() as m:
        m.setattr(_common, "_C", module)
        m.setattr(_common, "DEVICE_TYPE", "cpu")
        m.setattr(_common, "launch", lambda device, name, *args: getattr(module, name)(*args, 0))
        for op in dispatch.ops():  # availability was cached from the real extension (or its absence)
            m.setattr(dispatch.get(op, "cuda"), "_available", None)
        yield
    for op in dispatch.ops():
        dispatch.get(op, "cuda")._available = None


def _backend(request, monkeypatch):
    name = request.param
    if GPU:
        ok, why = dispatch.get("bias_gelu", name).availability()
        if not ok:
            pytest.skip(f"{name} backend unavailable: {why}")
        yield BackendUnderTest(name, torch.device("cuda"))
        return
    if name == "cuda":
        module = request.getfixturevalue("cuda_emulator")
        with emulating(module, monkeypatch):
            yield BackendUnderTest(name, torch.device("cpu"), emulated=True)
        return
    if name == "triton":
        ok, why = dispatch.get("bias_gelu", "triton").availability()
        if not ok:
            pytest.skip(f"triton backend unavailable: {why}")
    yield BackendUnderTest(name, torch.device("cpu"))


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Every backend in turn."""
    yield from _backend(request, monkeypatch)


@pytest.fixture(params=BACKENDS)
def cpu_backend(request, monkeypatch):
    """Every backend in turn on the CPU only (the interpreter, the emulator), for what the GPU tests
    cover otherwise: skipped where there is a GPU, and not in the GPU check's selection (each test
    there costs the lent machine seconds)."""
    if GPU:
        pytest.skip("the CPU backends only: on a GPU the contract tests cover this")
    yield from _backend(request, monkeypatch)


@pytest.fixture(params=FUSED)
def fused_backend(request, monkeypatch):
    """Triton and CUDA: the backends whose launchers validate their own arguments (the torch
    backend's are reached only through the op, which validates)."""
    yield from _backend(request, monkeypatch)


HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    # Contract tests run on CUDA when there is a GPU: the GPU check selects them with gpu_capable.
    for item in items:
        names = getattr(item, "fixturenames", ())
        if str(item.path).startswith(HERE) and ("backend" in names or "fused_backend" in names):
            item.add_marker(pytest.mark.gpu_capable)


class Reached(Exception):
    """Raised by the stand-in CUDA launch point: validation let the inputs through."""


class CudaOnCpu:
    """The CUDA wrappers' validation, run on CPU tensors: CPU counts as the CUDA device and the
    launch point raises Reached, so a test sees exactly which inputs reach a kernel."""

    def __init__(self):
        self.calls = []

    def launch(self, device, name, *args):
        self.calls.append(name)
        raise Reached(name)

    def reaches(self, fn, *args, **kwargs):
        with pytest.raises(Reached):
            fn(*args, **kwargs)

    @staticmethod
    def rejects(match, fn, *args, **kwargs):
        with pytest.raises(ValueError, match=match):
            fn(*args, **kwargs)

    @staticmethod
    def misaligned(shape, dtype):
        """A tensor whose data pointer is one element past a 16-byte boundary."""
        n = 1
        for s in shape:
            n *= s
        return torch.zeros(n + 1, dtype=dtype)[1:].view(shape)


@pytest.fixture
def cuda_on_cpu(monkeypatch):
    from bertfast.cuda import _common

    stand_in = CudaOnCpu()
    monkeypatch.setattr(_common, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(_common, "launch", stand_in.launch)
    monkeypatch.setattr(_common, "reduction_blocks", lambda n: max(1, min(n, 1024)))
    return stand_in
