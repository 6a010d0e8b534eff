"""Kernel micro-benchmarks under pytest-benchmark: one test per (op, implementation, direction).

    pytest benchmarks/ --benchmark-only                  # every op, quick shapes
    pytest benchmarks/ --benchmark-only -k "attention and triton"
    pytest benchmarks/ --benchmark-only --benchmark-autosave   # then --benchmark-compare

The cases, implementations and parity gate are those of ``python -m bertfast.bench``
(bertfast/bench/kernel_cases.py, first quick case of each op): an implementation that does not
match the reference FAILS its test and is never timed; one that cannot run here is skipped
with the reason. GPU calls end with torch.cuda.synchronize() so pytest-benchmark's wall-clock
timer measures the kernels; extra_info carries the case, GB/s, % of the measured copy bandwidth
and TFLOP/s computed from the median. For CUDA-event timings with an L2 flush and the
markdown/JSON/PNG report, use ``python -m bertfast.bench``.

On a CPU the shapes are tiny and the timings are CPU timings of the reference paths (and of
the Triton interpreter when TRITON_INTERPRET=1 is set before starting pytest).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Dict, List, Tuple

import pytest
import torch

pytest.importorskip("pytest_benchmark")

from bertfast.bench import device as devmod  # noqa: E402
from bertfast.bench import kernel_cases as kc  # noqa: E402
from bertfast.bench import kernels_suite as ks  # noqa: E402
from bertfast.bench.common import SuiteContext  # noqa: E402
from bertfast.bench.gate import compare  # noqa: E402
from bertfast.bench.results import (FULL_HEAD, GEMM_FLOOR, SDPA_FLASH, SDPA_MEM_EFFICIENT, TORCH_COMPILE,  # noqa: E402
                                    TORCH_EAGER, TORCH_FOREACH, TORCH_FUSED, bertfast_impl)
from bertfast.bench.timing import TimingPolicy  # noqa: E402

BACKENDS = ("triton", "cuda", "torch")


def _impl_names(op: str) -> List[str]:
    if op == "adamw":
        return [TORCH_FUSED, TORCH_FOREACH, TORCH_EAGER]
    if op == "lamb":
        return [bertfast_impl("triton"), bertfast_impl("torch", "foreach"), TORCH_EAGER]
    if op == "attention":
        names = [bertfast_impl(b, v) for b in BACKENDS for v in ("varlen", "padded")]
        return names + [TORCH_EAGER, TORCH_COMPILE, SDPA_FLASH, SDPA_MEM_EFFICIENT]
    names = [bertfast_impl(b) for b in BACKENDS] + [TORCH_EAGER, TORCH_COMPILE]
    return names + ([FULL_HEAD, GEMM_FLOOR] if op == "mlm_head_loss" else [])


PARAMS = [(op, impl) for op in kc.case_builders() for impl in _impl_names(op)]


@functools.lru_cache(maxsize=1)
def _ctx() -> SuiteContext:
    info = devmod.calibrate(devmod.detect(), quick=True)
    dtype = torch.bfloat16 if info.is_cuda else torch.float32
    return SuiteContext(device=info, quick=True, dtype=dtype, backends=BACKENDS,
                        policy=TimingPolicy.quick(), log=lambda text: None)


@functools.lru_cache(maxsize=None)
def _case(op: str) -> Tuple[kc.OpCase, Dict[str, torch.Tensor], object]:
    ctx = _ctx()
    oc = kc.case_builders()[op](ctx)[0]
    ref32 = oc.reference(torch.float32).run_once()
    ref_lowp = oc.reference(ctx.dtype).run_once() if ctx.dtype != torch.float32 else None
    return oc, ref32, ref_lowp


@pytest.mark.parametrize("direction", kc.ALL_DIRECTIONS + (kc.STEP,))
@pytest.mark.parametrize("op,impl", PARAMS, ids=[f"{op}-{impl}" for op, impl in PARAMS])
def test_kernel(benchmark, op: str, impl: str, direction: str) -> None:
    from bertfast.dispatch import NoBackendError

    ctx = _ctx()
    oc, ref32, ref_lowp = _case(op)
    if direction not in oc.directions:
        pytest.skip(f"{op} has no {direction} timing, only {', '.join(oc.directions)}")
    chosen = [i for i in oc.impls if i.name == impl]
    if not chosen:
        pytest.skip(f"{impl} is not part of this {op} case")
    spec = chosen[0]
    if spec.skip:
        pytest.skip(spec.skip)
    with ks.compile_settings() if impl == TORCH_COMPILE else contextlib.nullcontext():
        try:
            p = spec.build(ctx.dtype)
            got = p.run_once()
        except NoBackendError as exc:
            pytest.skip(str(exc).splitlines()[0])
        except Exception as exc:  # noqa: BLE001
            if spec.env_dependent:
                pytest.skip(f"cannot run here: {type(exc).__name__}: {exc}")
            raise
        if p.gated:
            gate = compare(got, ref32, ref_lowp)
            assert gate.ok, f"FAILED PARITY (not timed): {gate.message}"
        fn = ks.direction_callable(p, direction)
        if ctx.device.is_cuda:
            inner = fn

            def fn() -> None:
                inner()
                torch.cuda.synchronize()
        rounds = 20 if ctx.device.is_cuda else 3
        benchmark.pedantic(fn, rounds=rounds, warmup_rounds=3 if ctx.device.is_cuda else 1, iterations=1)
    median_ms = benchmark.stats.stats.median * 1e3
    work = oc.work(direction)
    info = {"case": oc.case, "device": ctx.device.name, "cpu_timings": not ctx.device.is_cuda,
            "median_ms": median_ms, **work}
    if "bytes" in work:
        info["gbps"] = work["bytes"] / 1e6 / median_ms
        info["pct_copy_bw"] = 100.0 * info["gbps"] / ctx.device.copy_bandwidth_gbps.median
    if "flops" in work:
        info["tflops"] = work["flops"] / 1e9 / median_ms
    benchmark.extra_info.update(info)
