"""The bench's timing on CPU and GPU: quantiles and rates, warm-up and repetitions, interleaved CPU
rounds, and on a GPU kernel timing without host time and graph replay for small kernels. Every figure
the suites report rests on these times."""
from __future__ import annotations

import pytest
import torch

from bertfast.bench import device as devmod
from bertfast.bench.results import HF_EAGER
from bertfast.bench.timing import Stat, TimingPolicy, quantile, summarize, time_cpu_interleaved, time_fn
from bench_helpers import _cpu_ctx


def test_quantiles_interpolate_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert quantile(values, 0.5) == 3.0
    assert quantile(values, 0.2) == pytest.approx(1.8)  # position 0.8 between 1 and 2
    assert quantile(values, 0.8) == pytest.approx(4.2)
    s = summarize([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (s.median, s.p20, s.p80, s.n) == (3.0, pytest.approx(1.8), pytest.approx(4.2), 5)


def test_rate_swaps_quantiles():
    times = Stat(median=2.0, p20=1.0, p80=4.0, n=9)  # ms
    r = times.rate(8.0)
    # The slowest calls (p80 time) give the lowest throughput (p20 rate).
    assert (r.median, r.p20, r.p80, r.n) == (4.0, 2.0, 8.0, 9)
    assert times.scaled(3.0) == Stat(6.0, 3.0, 12.0, 9)


def test_cpu_timing_runs_warmup_then_reps_and_setup_each_time():
    calls = {"fn": 0, "setup": 0}

    def fn():
        calls["fn"] += 1

    def setup():
        calls["setup"] += 1
    s = time_fn(fn, torch.device("cpu"), TimingPolicy(cpu_warmup=2, cpu_reps=4), setup=setup)
    assert calls == {"fn": 6, "setup": 6}
    assert s.n == 4 and 0 <= s.p20 <= s.median <= s.p80


def test_cpu_interleaved_timing_takes_turns_and_drops_a_callable_that_raises():
    order = []

    def one(name, fail_on=None):
        def fn():
            order.append(name)
            if len(order) == fail_on:
                raise RuntimeError("out of memory")
        return fn
    a, b, c = one("a"), one("b", fail_on=5), one("c")
    stats = time_cpu_interleaved([a, b, c], TimingPolicy(cpu_warmup=1, cpu_reps=3))
    # rounds of a, b, c; b raises in the second round (the fifth call) and is left out after it
    assert order == ["a", "b", "c", "a", "b", "c", "a", "c", "a", "c"]
    assert isinstance(stats[1], RuntimeError)
    assert stats[0].n == stats[2].n == 3  # the warm-up round is not a sample


def test_model_suite_on_cpu_times_the_implementations_in_turns(monkeypatch):
    """The CPU model suite's ratio against transformers: both timed in the same rounds."""
    from bertfast.bench import common, model_suite

    seen = []
    real = common.time_cpu_interleaved

    def spy(fns, policy=None):
        seen.append(len(fns))
        return real(fns, policy)
    monkeypatch.setattr(common, "time_cpu_interleaved", spy)  # where the suites' time_plans times them
    monkeypatch.setattr(common, "time_fn", lambda *a, **k: pytest.fail("a CPU case timed on its own"))
    ctx = _cpu_ctx(models=("inference",), impls=("bertfast", "transformers"), with_transformers=True)
    rows = model_suite.run(ctx)
    assert seen and all(n == 2 for n in seen)
    assert {r.impl for r in rows} == {"bertfast", HF_EAGER} and all(r.ok for r in rows)


@pytest.mark.gpu
def test_gpu_calibration_and_timing():
    info = devmod.calibrate(devmod.detect("cuda"), quick=True)
    assert info.is_cuda and info.copy_bandwidth_gbps.median > 100 and info.peak_matmul_tflops.median > 10
    x = torch.randn(4096, 4096, device="cuda")
    t = time_fn(lambda: x.mul_(1.0), torch.device("cuda"), TimingPolicy.quick())
    assert t.n >= 3 and 0 < t.p20 <= t.median <= t.p80


@pytest.mark.gpu
def test_gpu_kernel_timing_leaves_out_the_host_time_of_a_call():
    """A call that spends 3 ms on the host before launching a ~20 us kernel: kernel timing (queued
    behind a device sleep) reports the kernel; step timing, as users wait for it, the 3 ms."""
    import time as _time
    x = torch.randn(2048, 2048, device="cuda")

    def call():
        _time.sleep(0.003)
        x.mul_(1.0)

    kernel = time_fn(call, torch.device("cuda"), TimingPolicy.quick())
    step = time_fn(call, torch.device("cuda"), TimingPolicy.steps(quick=True))
    assert kernel.median < 0.5, kernel
    assert step.median > 2.5, step


@pytest.mark.gpu
def test_gpu_small_kernels_are_timed_by_graph_replay():
    from bertfast.bench.timing import GRAPH_REPLAY, host_overhead_us, time_small
    x = torch.randn(1024, device="cuda")
    t, method = time_small(lambda: x.mul_(1.0), torch.device("cuda"))
    assert method == GRAPH_REPLAY and 0 < t.median < 0.05
    assert host_overhead_us(lambda: x.mul_(1.0), torch.device("cuda")).median > 0
