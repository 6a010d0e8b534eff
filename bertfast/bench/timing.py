"""Timing: one function that times a callable on the device its tensors live on.

GPU (after ``triton.testing.do_bench``): run once, estimate the time per call with a few
CUDA-event-timed calls, warm up for ``warmup_ms``, then time each of ``rep_ms`` worth of calls
with its own pair of CUDA events, zeroing a 256 MiB buffer between calls so that every call
starts with a cold L2 cache. Kernel timings (``TimingPolicy.ahead_of_host``) queue each call
behind a device sleep longer than the call's own host time (nvbench's "blocking kernel"): the
start event then fires only once the call's kernels are all queued, so the figure is the
device's work and not the host's launch time, which an op's Python wrapper can exceed (the
H100 run of 2026-11-26 timed a 0.1 ms LayerNorm backward at 0.4 ms that way). Whole steps
are timed as users run them, host included. CPU: ``time.perf_counter`` around each call after
warm-up calls; these are CPU timings of interpreter/reference paths on tiny shapes, not GPU
figures.
``time_cpu_interleaved`` times several callables on a CPU in turns, for ratios between them.

Kernels that take less than SMALL_KERNEL_MS per call are timed again without the L2 flush and
the per-call events, whose own cost would be a large part of the figure: by CUDA-graph
replay of ``calls`` back-to-back calls (the launch overhead gone too), or, where the call
cannot be captured (a host synchronisation inside, say), back to back between two events.
Their host overhead, the CPU time of one eager call, is reported on its own (``host_us``).

Every figure is a ``Stat``: median, p20 and p80 of the per-call samples (linear
interpolation between order statistics, as numpy's default), plus the sample count.
Throughputs derived from times (GB/s, TFLOP/s, sequences/s) are ``amount / time``, a
decreasing map, so their p20 comes from the time's p80 and their p80 from the time's p20.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch


@dataclass(frozen=True)
class Stat:
    """A measured figure with its spread."""

    median: float
    p20: float
    p80: float
    n: int

    def scaled(self, k: float) -> "Stat":
        """The figure times a positive constant (unit changes)."""
        if k <= 0:
            raise ValueError(f"scale must be > 0, got {k}")
        return Stat(self.median * k, self.p20 * k, self.p80 * k, self.n)

    def rate(self, amount: float) -> "Stat":
        """``amount / self`` for a Stat of times: quantiles swap (p20 of a rate = amount / p80 time)."""
        def div(t: float) -> float:
            return amount / t if t > 0 else math.inf
        return Stat(div(self.median), div(self.p80), div(self.p20), self.n)

    def to_dict(self) -> Dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, float]) -> "Stat":
        return cls(float(d["median"]), float(d["p20"]), float(d["p80"]), int(d["n"]))


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """q-quantile of already sorted values, linear interpolation (numpy's default)."""
    if not sorted_values:
        raise ValueError("quantile of an empty sample")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return sorted_values[lo] * (1.0 - frac) + sorted_values[hi] * frac


def summarize(samples: Sequence[float]) -> Stat:
    values = sorted(float(s) for s in samples)
    return Stat(quantile(values, 0.5), quantile(values, 0.2), quantile(values, 0.8), len(values))


@dataclass
class TimingPolicy:
    """How long to warm up and how many samples to take.

    GPU: by time budget (``warmup_ms``, ``rep_ms``), bounded by ``min_reps``/``max_reps``.
    CPU: ``cpu_warmup`` calls then ``cpu_reps`` timed calls (each call may take seconds
    under the Triton interpreter, so counts, not budgets).
    """

    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    min_reps: int = 5
    max_reps: int = 1000
    cpu_warmup: int = 1
    cpu_reps: int = 5
    flush_l2: bool = True
    ahead_of_host: bool = True  # GPU: queue each call behind a device sleep (device time, not launch time)

    @classmethod
    def quick(cls) -> "TimingPolicy":
        return cls(warmup_ms=10.0, rep_ms=40.0, min_reps=3, max_reps=200, cpu_warmup=1, cpu_reps=3)

    @classmethod
    def steps(cls, quick: bool) -> "TimingPolicy":
        """For whole training steps (tens of ms to seconds each): fixed small counts. A step of several
        micro-batches (the pre-training cases' global batch) can take over a second: 5 samples, where
        2 s of them are fewer."""
        if quick:
            return cls(warmup_ms=0.0, rep_ms=0.0, min_reps=3, max_reps=3, cpu_warmup=1, cpu_reps=3,
                       flush_l2=False, ahead_of_host=False)
        return cls(warmup_ms=300.0, rep_ms=2000.0, min_reps=5, max_reps=50, cpu_warmup=2, cpu_reps=5,
                   flush_l2=False, ahead_of_host=False)


_FLUSH_BUFFERS: Dict[int, torch.Tensor] = {}


def _l2_flush_buffer(device: torch.device) -> torch.Tensor:
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _FLUSH_BUFFERS:
        # 256 MiB: larger than the L2 of any current GPU (H100 50 MB, H200 60 MB).
        _FLUSH_BUFFERS[index] = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=f"cuda:{index}")
    return _FLUSH_BUFFERS[index]


def time_fn(fn: Callable[[], object], device: torch.device, policy: Optional[TimingPolicy] = None,
            setup: Optional[Callable[[], object]] = None) -> Stat:
    """Per-call time of ``fn()`` in milliseconds (median, p20, p80).

    ``setup``, when given, runs before every call outside the timed region (e.g. zeroing
    gradients). On CUDA it is enqueued before the call's start event.
    """
    policy = policy or TimingPolicy()
    device = torch.device(device)
    if device.type == "cuda":
        return _time_cuda(fn, device, policy, setup)
    return _time_cpu(fn, policy, setup)


def _time_cpu(fn, policy: TimingPolicy, setup) -> Stat:
    for _ in range(max(policy.cpu_warmup, 0)):
        if setup is not None:
            setup()
        fn()
    samples: List[float] = []
    for _ in range(max(policy.cpu_reps, 1)):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return summarize(samples)


def time_cpu_interleaved(fns: Sequence[Callable[[], object]], policy: Optional[TimingPolicy] = None
                         ) -> List[object]:
    """CPU times of several callables, taken in turns: each warm-up round and each timed round
    calls every one once, so a change in the machine's load (a shared CPU) falls on all of them
    alike and their ratios hold; timed one after the other, a ratio moves with the load. Returns,
    per callable, its Stat, or the exception it raised (it is then left out of later rounds)."""
    policy = policy or TimingPolicy()
    results: List[object] = [None] * len(fns)
    samples: List[List[float]] = [[] for _ in fns]
    rounds = max(policy.cpu_warmup, 0) + max(policy.cpu_reps, 1)
    for r in range(rounds):
        for i, fn in enumerate(fns):
            if isinstance(results[i], BaseException):
                continue
            try:
                t0 = time.perf_counter()
                fn()
                elapsed = (time.perf_counter() - t0) * 1e3
            except Exception as exc:  # noqa: BLE001 - reported per callable by the caller
                results[i] = exc
                continue
            if r >= max(policy.cpu_warmup, 0):
                samples[i].append(elapsed)
    return [result if isinstance(result, BaseException) else summarize(samples[i])
            for i, result in enumerate(results)]


_SLEEP_CYCLES_PER_MS: Dict[int, float] = {}


def _sleep_cycles_per_ms(device: torch.device) -> Optional[float]:
    """Clock cycles of ``torch.cuda._sleep`` per millisecond on ``device``, measured once; None where
    this torch has no ``_sleep`` (the calls are then timed as queued, host time included)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return None
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _SLEEP_CYCLES_PER_MS:
        cycles = 20_000_000  # ~10 ms at a GPU's clock: long against the events' resolution
        sleep(1000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        sleep(cycles)
        end.record()
        torch.cuda.synchronize(device)
        _SLEEP_CYCLES_PER_MS[index] = cycles / max(start.elapsed_time(end), 1e-3)
    return _SLEEP_CYCLES_PER_MS[index]


def _host_ms(fn, device: torch.device, setup, calls: int = 3) -> float:
    """The longest host time of one call of ``fn`` (its launches, not its kernels), the device idle."""
    worst = 0.0
    for _ in range(calls):
        if setup is not None:
            setup()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        worst = max(worst, (time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize(device)
    return worst


def _time_cuda(fn, device: torch.device, policy: TimingPolicy, setup) -> Stat:
    with torch.cuda.device(device):
        flush = _l2_flush_buffer(device) if policy.flush_l2 else None

        # First call (compilation, autotuning, allocator growth).
        if setup is not None:
            setup()
        fn()
        torch.cuda.synchronize(device)
        hold, hold_ms = 0, 0.0
        rate = _sleep_cycles_per_ms(device) if policy.ahead_of_host else None
        if rate is not None:  # the sleep outlasts the call's host time by half, plus 0.1 ms
            hold_ms = 1.5 * _host_ms(fn, device, setup) + 0.1
            hold = int(rate * hold_ms)

        def one(start: torch.cuda.Event, end: torch.cuda.Event) -> None:
            if setup is not None:
                setup()
            if flush is not None:
                flush.zero_()
            if hold:
                torch.cuda._sleep(hold)
            start.record()
            fn()
            end.record()

        n_est = 3  # a small estimate of the time per call
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(n_est)]
        for s, e in events:
            one(s, e)
        torch.cuda.synchronize(device)
        estimate = max(sum(s.elapsed_time(e) for s, e in events) / n_est, 1e-4)

        n_warmup = int(policy.warmup_ms / estimate)
        # each timed call also waits out its sleep: the budget counts it
        n_reps = min(max(int(policy.rep_ms / (estimate + hold_ms)), policy.min_reps), policy.max_reps)
        for _ in range(n_warmup):
            if setup is not None:
                setup()
            fn()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(n_reps)]
        for s, e in events:
            one(s, e)
        torch.cuda.synchronize(device)
        return summarize([s.elapsed_time(e) for s, e in events])


# How a figure was timed (Row.timing).
COLD_L2 = "cuda events, cold L2, queued ahead of the host"
GRAPH_REPLAY = "cuda graph replay"
BACK_TO_BACK = "back to back"
PERF_COUNTER = "perf_counter (CPU)"
METHODS = (COLD_L2, GRAPH_REPLAY, BACK_TO_BACK, PERF_COUNTER)
SMALL_KERNEL_MS = 0.05


def _capture(fn: Callable[[], object], device: torch.device, calls: int) -> "torch.cuda.CUDAGraph":
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the capturing stream, as CUDA graphs require
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def time_small(fn: Callable[[], object], device: torch.device, calls: int = 20, samples: int = 10,
               not_captured: Optional[Callable[[Exception], None]] = None):
    """(Stat of ms per call, method): graph replay of ``calls`` calls, else back to back
    (``not_captured`` gets the capture's exception)."""
    device = torch.device(device)
    try:
        graph = _capture(fn, device, calls)
        run, method = graph.replay, GRAPH_REPLAY
    except Exception as exc:  # noqa: BLE001 - not capturable here: time the eager calls back to back
        if not_captured is not None:
            not_captured(exc)
        torch.cuda.synchronize(device)

        def run():
            for _ in range(calls):
                fn()
        method = BACK_TO_BACK
    run()
    torch.cuda.synchronize(device)
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(samples)]
    for start, end in pairs:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize(device)
    return summarize([s.elapsed_time(e) / calls for s, e in pairs]), method


def host_overhead_us(fn: Callable[[], object], device: torch.device, calls: int = 20) -> Stat:
    """CPU time of one eager call in microseconds (no synchronisation inside the timed loop)."""
    samples = []
    for _ in range(5):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize(device)
    return summarize(samples)


@dataclass
class Memory:
    """Peak memory of one call: absolute peak and peak above what was allocated before it."""

    peak_bytes: int
    peak_delta_bytes: int

    def to_dict(self) -> Dict[str, int]:
        return asdict(self)


def peak_memory(fn: Callable[[], object], device: torch.device) -> Optional[Memory]:
    """Peak CUDA memory of one call of ``fn``; None on CPU (torch keeps no CPU allocator statistics)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return Memory(int(peak), int(peak - before))
