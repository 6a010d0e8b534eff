"""Fixtures of the kernel tests."""
import pytest


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
    monkeypatch.setattr(_common, "_SCRATCH_CHOICES", {})
    monkeypatch.delenv(_common.AUTOTUNE_ENV, raising=False)

    def use(*tuned):
        for kernel in tuned:
            monkeypatch.setattr(kernel, "_do_bench", one_shot_bench)
            monkeypatch.delitem(kernel.__dict__, "do_bench", raising=False)  # a cached benchmarker, if any
            monkeypatch.setattr(kernel, "cache", {})
    return use
