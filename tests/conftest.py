"""Test session set-up.

Without a GPU, Triton kernels run under the interpreter: TRITON_INTERPRET must be set
before triton is first imported, so it is set here, at collection time.
"""
import atexit
import os
import shutil
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (`make test` runs a worker a core) the cores are shared out among the workers, for
# torch's threads here and in the processes tests start: each would otherwise start a thread a core.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Tests never reach the Hugging Face Hub: a hub id fails at once instead of waiting on a network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# torch.compile's caches in a directory of the session's own (the xdist workers inherit it): inductor's default,
# /tmp/torchinductor_<user>, is shared by every checkout on the machine, and its AOT autograd cache keys a custom
# op's forward graph, not the autograd formula registered for it, so another checkout's compiled backward of an
# unchanged forward was served (a backward op called with the arguments of its former schema).
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bertfast-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import pytest  # noqa: E402

# Every kernel module decides some things once, at import, from TRITON_INTERPRET (_philox's inline
# PTX, none under the interpreter; the dots' upcast of bf16, which the interpreter gets wrong): all
# are imported here, so that a test faking interpreting() False (stand_in_tuner, to record or tune
# launches) is never a module's first importer.
import importlib  # noqa: E402
import pkgutil  # noqa: E402

import bertfast.kernels  # noqa: E402

for _module in pkgutil.iter_modules(bertfast.kernels.__path__):
    importlib.import_module(f"bertfast.kernels.{_module.name}")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def datasets(tmp_path_factory):
    """Two pre-training datasets from a slice of the embedded corpus: seq 64 and seq 128, one vocabulary."""
    from bertfast.data.prepare import prepare_dataset
    root = tmp_path_factory.mktemp("pretrain-data")
    cache = str(root / "corpus")
    d1, d2 = str(root / "p1"), str(root / "p2")
    quiet = dict(progress=False, log=lambda m: None, corpus_cache=cache, corpus_max_docs=300, workers=1)
    prepare_dataset([], d1, vocab_size=400, max_seq_len=64, **quiet)
    prepare_dataset([], d2, vocab=d1, max_seq_len=128, **quiet)
    return d1, d2


@pytest.fixture
def stand_in_tuner(monkeypatch):
    """The GPU launch path under the interpreter: launch() takes its autotuning branch (candidate
    pruning, tuning keys, grid functions, scratch copies) and each autotuned kernel passed to the
    returned function times every candidate by running it once. Returns that function."""
    from bertfast.kernels import _common

    def one_shot_bench(fn, quantiles=None, **kwargs):
        fn()
        return [1.0, 1.0, 1.0]

    monkeypatch.setattr(_common, "interpreting", lambda: False)
    monkeypatch.setattr(_common, "_LAUNCH_KWARGS", {})
    monkeypatch.delenv(_common.AUTOTUNE_ENV, raising=False)

    def use(*tuned):
        for kernel in tuned:
            monkeypatch.setattr(kernel, "_do_bench", one_shot_bench)
            monkeypatch.delitem(kernel.__dict__, "do_bench", raising=False)  # a cached benchmarker, if any
            monkeypatch.setattr(kernel, "cache", {})
    return use


@pytest.fixture
def triton_lamb(monkeypatch):
    """The triton LAMB, or a skip where it is unavailable; forced for `bertfast pretrain`
    (BERTFAST_LAMB=triton, which it builds capturable). Under the interpreter its chunks are the
    GPU's (16K elements, not 128): one program per chunk runs in Python, and the small chunks that
    make unit tests cross chunk edges would take a tiny model's step ~10 s."""
    from bertfast.training.optim import triton_lamb_availability

    available, why = triton_lamb_availability()
    if not available:
        pytest.skip(f"the triton LAMB is unavailable: {why}")
    monkeypatch.setenv("BERTFAST_LAMB", "triton")
    if not torch.cuda.is_available():
        from bertfast.kernels import lamb as kernels
        monkeypatch.setattr(kernels, "INTERP_BLOCK", kernels.BLOCK)
        monkeypatch.setattr(kernels, "INTERP_CHUNK", kernels.CHUNK)
