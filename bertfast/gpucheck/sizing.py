"""How long each step of the GPU check may take, sized from what can be measured without a GPU.

A GPU machine is lent for minutes, so every step runs under a limit; a limit that is too short
loses a stage's evidence and one that is too long wastes the loan. The limits in stages.py come
from here: measured quantities (measured.json, written by ``python -m bertfast.gpucheck.sizing
--measure`` on a CPU machine with nvcc) times stated per-item costs and factors for what cannot
be measured without a GPU. The first GPU run records each step's real duration in summary.json;
revise the factors from it (``python -m bertfast.gpucheck.sizing --against GPU_OUT/summary.json``
prints estimate beside measured).

Measured here (measured.json):
  import_s          a fresh interpreter's ``import torch`` and ``import bertfast.ops`` (torch,
                    transformers, triton and the kernels), median of 3
  install_s         ``pip install --no-deps --no-build-isolation -e .`` without the extension build
  nvcc_s            each csrc/*.cu compiled by stage 1's build command (sm_90a and its PTX, nvcc's two
                    threads), one at a time
  csrc_digest       per csrc/*.cu, a digest of its code and the csrc headers' it includes (comments
                    left out): a test fails when a source's time is stale
  triton            per Triton kernel, the mean seconds to compile one autotune candidate for
                    sm_90 (Triton's own compiler with an offline driver, one core), measured over
                    the headline stage's candidates
  headline          per pre-training case of stage 3, in the order the bench runs them: the
                    candidates compiled for the first time in that case and the tunings (one per
                    candidate per autotune key) it times; counts from the code, held current by
                    tests/test_gpucheck.py
  tests             the number of tests stage 2 selects (``-m "gpu or gpu_capable"``)
  gpu_tests         the newest GPU run's stage-2 tests in benchmarks/results (its progress file): how
                    many finished, their test-seconds, and those priced as grouped (compile_groups)
"""
from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

MEASURED_PATH = Path(__file__).with_name("measured.json")
REPO = Path(__file__).resolve().parents[2]

# The pre-training cases of the model suite on a GPU (bertfast.bench.model_suite.GPU_CASES), in order:
# (model, seq, micro-batch size, micro-batches a step: the targets' global batch of 256).
HEADLINE_CASES: Tuple[Tuple[str, int, int, int], ...] = (("bert-large", 128, 128, 2), ("bert-base", 128, 128, 2),
                                                         ("bert-large", 512, 32, 8), ("bert-base", 512, 32, 8))


def headline_ops() -> Tuple[str, ...]:
    """What one case launches: the ops with dispatch forms (bertfast.registry), in the fp32 parity gate
    (dropout off), then the timed bf16-autocast step with fp32 parameters and dropout 0.1; the
    encoder is unpadded, so attention is the varlen form only."""
    from bertfast import registry
    return tuple(op.name for op in registry.ops() if op.forms)


# ---- stated costs and factors (no GPU here to measure them), revised from the first GPU run ----
# (H200, 2026-11-26; `sizing --against` its summary.json: build 20 s, info 9 s, memcheck 14 s,
# racecheck 43 s, stage 2's 1562 tests 5862 test-seconds on 16 workers, ~430 s wall, headline 150 s)
CPU_SPEED = 1.0             # a GPU machine core against this machine's: compiles take measured / CPU_SPEED
GPU_IMPORT_FACTOR = 2.0     # torch cu130 also loads the CUDA libraries (cuBLAS, cuDNN) the CPU build lacks
SANITIZER_FACTOR = 3.0      # compute-sanitizer's start-up (was 10 before the H200 run: memcheck took 14 s)
MEMCHECK_CALL_S = 1.0       # one small call, instrumented
RACECHECK_CALL_S = 3.0      # racecheck also tracks every shared-memory access
TUNE_TIMING_S = 0.03        # one candidate timed: 5 ms warm-up + 20 ms (kernels/_common.py) + launch gaps
# One pre-training case besides tuning: both models built, the fp32 parity gates (the packed one
# too), and 4 x ~2.5 s of timed steps (TimingPolicy.steps) with the peak-memory pass: bertfast's
# default, static-shape and CUDA-graph steps (three eager steps and the capture first) and
# transformers'. Stated: the H100 run of 2026-11-26 ran the BERT-large seq-128 case with all four,
# start-up and tuning included, in 110 s, one micro-batch a step.
CASE_S = {"bert-base": 30.0, "bert-large": 50.0}
# Each further micro-batch of a step lengthens every call of the four steps (warm-up, 5 or more timed
# calls, the peak-memory pass, the graph's eager steps and capture: ~10 calls each). Stated from the
# H200's one-micro-batch steps of 2026-11-27 (BERT-large at seq 128: 163, 210, 70 and 124 ms; at seq
# 512 about the same; BERT-base 40-60% of them): ~0.6 s a call of all four, ~6 s a micro-batch.
MICRO_BATCH_S = {"bert-base": 3.0, "bert-large": 6.0}
BENCH_START_S = 20.0        # the bench process: imports, device calibration, writing the report
TEST_WORKERS = 16           # pytest-xdist workers (one per core)
BUILD_OVERHEAD_S = 10.0     # setup.py start-up, the host compile of the binding, the link (was 20): the GPU runs'
                            # builds took 20-31 s where the slowest source's sm_90a compile took 17 s here, ~24 s
                            # with its PTX (the ratio measured on 2026-11-28: 86 s to 62 s)
BUILD_ARCHS = ["90a"]       # stage 1's build: BERTFAST_CUDA_ARCHS (stages.py)
MARGIN = 1.25               # every limit: the estimate plus a quarter
MIN_LIMIT_S = 20            # and never under this: any Python process's cold start on a fresh machine


@dataclass(frozen=True)
class Estimate:
    seconds: float   # expected duration on the GPU machine
    how: str         # the formula with its numbers (printed by `make gpu-plan`)

    @property
    def limit_s(self) -> int:
        """The step's limit: the estimate with MARGIN, rounded up to 10 s, at least MIN_LIMIT_S."""
        return max(MIN_LIMIT_S, int(math.ceil(self.seconds * MARGIN / 10.0) * 10))


@functools.lru_cache(maxsize=1)
def measured() -> Dict:
    if not MEASURED_PATH.exists():
        raise FileNotFoundError(f"{MEASURED_PATH} is missing: run `python -m bertfast.gpucheck.sizing --measure`")
    return json.loads(MEASURED_PATH.read_text())


def _gpu_import_s() -> float:
    return measured()["import_s"]["bertfast.ops"] * GPU_IMPORT_FACTOR


# --------------------------------------------------------------------------- the estimates
def build() -> Estimate:
    """nvcc runs the sources side by side on all cores (MAX_JOBS // nvcc's threads at once; the attention's
    per dtype), so the slowest source sets the pace."""
    nvcc = measured()["nvcc_s"]
    slowest = max(nvcc, key=nvcc.get)
    s = nvcc[slowest] / CPU_SPEED + BUILD_OVERHEAD_S
    return Estimate(s, f"slowest source {slowest} {nvcc[slowest]:.0f} s / cpu speed {CPU_SPEED:g} + "
                       f"{BUILD_OVERHEAD_S:.0f} s set-up and link ({len(nvcc)} sources in parallel)")


def sanitize_calls() -> int:
    """bertfast.gpucheck.sanitize's calls: every case (bertfast.registry) x (fp32, bf16), forward and backward."""
    from bertfast import registry
    return 2 * len(registry.hooks("sanitize"))


def sanitizer(call_s: float) -> Estimate:
    start = _gpu_import_s() * SANITIZER_FACTOR
    calls = sanitize_calls()
    s = start + calls * call_s
    return Estimate(s, f"start-up: import {measured()['import_s']['bertfast.ops']:.1f} s x {GPU_IMPORT_FACTOR:g} "
                       f"(CUDA libraries) x {SANITIZER_FACTOR:g} (sanitizer) + {calls} calls x {call_s:g} s")


def memcheck() -> Estimate:
    return sanitizer(MEMCHECK_CALL_S)


def racecheck() -> Estimate:
    return sanitizer(RACECHECK_CALL_S)


def install() -> Estimate:
    s = measured()["install_s"] / CPU_SPEED
    return Estimate(s, f"pip install --no-deps -e . without the extension build: {s:.0f} s measured")


def info() -> Estimate:
    return Estimate(_gpu_import_s() + 2.0, f"import {measured()['import_s']['bertfast.ops']:.1f} s x "
                                           f"{GPU_IMPORT_FACTOR:g} (CUDA libraries) + 2 s")


def mma_rate() -> Estimate:
    return Estimate(_gpu_import_s() + 3.0, "the import, and 11 launches of ~10 ms: 3 s stated")


def requirements() -> Estimate:
    return Estimate(5.0, "stated: the installed metadata of ~20 packages and two tools' --version, 5 s")


def tests() -> Estimate:
    """Stage 2: every selected test on TEST_WORKERS workers at the newest GPU run's mean seconds a test
    (its Triton compiles included: the first candidate per kernel variant, workers sharing Triton's disk
    cache), priced with the tests that compile the same kernels grouped on one worker (compile_groups)."""
    m = measured()
    run = m["gpu_tests"]
    per_test = run["grouped_test_s"] / run["tests"]
    s = _gpu_import_s() + m["tests"] * per_test / TEST_WORKERS + m["collect_s"]
    return Estimate(s, f"{m['tests']} tests x {per_test:.2f} s / {TEST_WORKERS} workers (the {run['run']} run's "
                       f"{run['tests']} tests: {run['test_s']:.0f} test-seconds, {run['grouped_test_s']:.0f} "
                       f"grouped) + collection {m['collect_s']:.0f} s + import")


@dataclass(frozen=True)
class CaseCost:
    case: Tuple[str, int, int]
    compiles: int      # candidates compiled for the first time in this case
    timings: int       # candidate timings (one per candidate per autotune key)
    tune_s: float
    rest_s: float

    @property
    def seconds(self) -> float:
        return self.tune_s + self.rest_s

    def describe(self) -> str:
        model, seq, batch = self.case
        return (f"{model} seq {seq}: tuning {self.tune_s:.0f} s ({self.compiles} compiles, {self.timings} timings)"
                f" + {self.rest_s:.0f} s")


def _headline_case(case: Sequence) -> Tuple[str, int, int, int]:
    """measured.json's case (model, seq, batch) as HEADLINE_CASES lists it, with its micro-batches."""
    for listed in HEADLINE_CASES:
        if tuple(listed[:3]) == tuple(case):
            return listed
    raise ValueError(f"measured.json's headline case {case} is not one of {HEADLINE_CASES}: run `make gpu-sizing`")


def headline_cases(tuned: bool = True) -> List[CaseCost]:
    """Each pre-training case's cost, in the bench's order. Untuned (BERTFAST_AUTOTUNE=0), a case
    compiles only each kernel's first candidate and times nothing."""
    m = measured()
    out = []
    for entry in m["headline"]:
        compiles = entry["compiles"] if tuned else entry["first_compiles"]  # per kernel
        compile_s = sum(n * m["triton"][k]["mean_s"] for k, n in compiles.items()) / CPU_SPEED
        timings = entry["timings"] if tuned else 0
        model, seq, batch, micro = _headline_case(entry["case"])
        out.append(CaseCost((model, seq, batch), sum(compiles.values()), timings, compile_s + timings * TUNE_TIMING_S,
                            CASE_S[model] + (micro - 1) * MICRO_BATCH_S[model]))
    return out


def bench(cases: Sequence[CaseCost], what: str) -> Tuple[Estimate, int]:
    """A bench step over these cases: (estimate, the --time-budget margin). The budget stops new
    cases that could not finish: its margin is the costliest case."""
    s = BENCH_START_S + sum(c.seconds for c in cases)
    how = f"{what}: start {BENCH_START_S:.0f} s + " + " + ".join(c.describe() for c in cases)
    return Estimate(s, how), int(math.ceil(max(c.seconds for c in cases)))


# --------------------------------------------------------------------------- measuring
def _median_import_s(module: str, runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
        env = dict(os.environ)
        env.pop("TRITON_INTERPRET", None)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(REPO),
                             check=True)
        times.append(float(res.stdout.strip().splitlines()[-1]))
    return round(statistics.median(times), 2)


def headline_launches():
    """Per case, in order: the launches of its gate and its timed step (compile_report.Launch list)."""
    from bertfast.gpucheck.compile_report import record_settings

    for model, seq, batch, _micro in HEADLINE_CASES:
        settings = [(model, seq, batch, "fp32", "act", 0.0), (model, seq, batch, "bf16", "fp32", 0.1)]
        yield (model, seq, batch), record_settings(settings, (64,), headline_ops(), padded_attention=False)


def headline_counts() -> List[Dict]:
    """Per case: candidates first compiled there (per kernel), first candidates (the untuned run's
    compiles) and timings. A variant compiled by an earlier case is not compiled again; a key tuned
    by an earlier case is not tuned again."""
    from bertfast.gpucheck.compile_report import _config_text, _describe

    compiled, first, tuned, out = set(), set(), set(), []
    for case, launches in headline_launches():
        compiles: Dict[str, int] = {}
        firsts: Dict[str, int] = {}
        timings = 0
        for launch in launches:
            name = launch.fn.__name__
            variant = (name, _describe(launch))
            for i, config in enumerate(launch.configs):
                key = variant + (_config_text(launch, config),)
                if key not in compiled:
                    compiled.add(key)
                    compiles[name] = compiles.get(name, 0) + 1
                if i == 0 and key not in first:
                    first.add(key)
                    firsts[name] = firsts.get(name, 0) + 1
            for tuning_key in launch.keys:
                if (name, tuning_key) not in tuned:
                    tuned.add((name, tuning_key))
                    timings += len(launch.configs)
        out.append({"case": list(case), "compiles": compiles, "first_compiles": firsts, "timings": timings})
    return out


def _measure_triton() -> Dict[str, Dict]:
    """Compile every headline candidate for sm_90, one at a time; per kernel the mean seconds and
    the number of variants in the full compile-report matrix (stage 2 compiles one config each)."""
    from bertfast.gpucheck import compile_report as cr

    launches = list({(launch.fn.__name__, cr._describe(launch)): launch
                     for _, group in headline_launches() for launch in group}.values())
    with tempfile.TemporaryDirectory() as cache:
        cr._prepare_offline_triton(cache)
        rows = cr.compile_triton(launches)
    bad = [r for r in rows if r.error]
    if bad:
        raise SystemExit(f"sizing: {len(bad)} candidates did not compile, e.g. {bad[0].kernel}: {bad[0].error}")
    per: Dict[str, List[float]] = {}
    for r in rows:
        per.setdefault(r.kernel, []).append(r.compile_s)
    variants: Dict[str, int] = {}
    for launch in cr.record_launches(fast=False):
        variants[launch.fn.__name__] = variants.get(launch.fn.__name__, 0) + 1
    return {k: {"mean_s": round(statistics.mean(v), 3), "measured": len(v), "variants": variants.get(k, 0)}
            for k, v in sorted(per.items())}


def _measure_nvcc() -> Dict[str, float]:
    """Each csrc/*.cu compiled by the command stage 1's build gives it (cuda_build.py, BERTFAST_CUDA_ARCHS
    90a: sm_90a's SASS and compute_90's PTX, in nvcc's two threads), one source at a time."""
    from bertfast.gpucheck import compile_report as cr

    build = cr.cuda_build()
    nvcc = build.find_nvcc() if build is not None else None
    if nvcc is None:
        raise SystemExit("sizing: nvcc and csrc/ are needed to measure the build")
    out: Dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for obj, cmd, kind in build._compile_commands(nvcc, build.find_cuda(nvcc), BUILD_ARCHS, tmp):
            if kind != "nvcc":
                continue
            start = time.perf_counter()
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise SystemExit(f"sizing: nvcc failed on {obj}: {res.stderr.strip()[-500:]}")
            out[os.path.basename(obj)[:-len(".o")]] = round(time.perf_counter() - start, 2)
    return dict(sorted(out.items()))


def _code(text: str) -> bytes:
    """A source's code: its comments and blank lines dropped, so that a comment changes no digest."""
    import re

    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    lines = (re.sub(r"//.*", "", line).rstrip() for line in text.splitlines())
    return "\n".join(line for line in lines if line).encode()


def csrc_digests() -> Dict[str, str]:
    """Per csrc/*.cu, a digest of its code and of the csrc headers' it includes, directly or not."""
    import hashlib
    import re

    src = REPO / "csrc"

    def included(path: Path, seen: set) -> None:
        for name in re.findall(r'^#include "([^"]+)"', path.read_text(), flags=re.M):
            header = src / name
            if header.exists() and header not in seen:
                seen.add(header)
                included(header, seen)

    out = {}
    for cu in sorted(src.glob("*.cu")):
        files = {cu}
        included(cu, files)
        digest = hashlib.sha256()
        for f in sorted(files):
            digest.update(f.name.encode() + b"\0" + _code(f.read_text()))
        out[cu.name] = digest.hexdigest()[:12]
    return out


def _measure_install() -> float:
    """The install stage 1 runs (the same package is re-installed here, without the extension build)."""
    env = dict(os.environ, BERTFAST_BUILD_CUDA="0")
    start = _dt.datetime.now()
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "-e",
                    str(REPO)], env=env, check=True, capture_output=True)
    return round((_dt.datetime.now() - start).total_seconds(), 1)


def _count_tests() -> Tuple[int, float]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    start = _dt.datetime.now()
    res = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-m", "gpu or gpu_capable", "tests",
                          "-p", "no:cacheprovider"], capture_output=True, text=True, cwd=str(REPO), env=env)
    seconds = (_dt.datetime.now() - start).total_seconds()
    return sum(1 for line in res.stdout.splitlines() if "::" in line), round(seconds, 1)


def _gpu_run_tests() -> Dict:
    """The stage-2 test durations of the newest GPU run filed under benchmarks/results (ordered as the
    perf model orders them: by when each was measured)."""
    from bertfast.gpucheck import compile_groups
    from bertfast.gpucheck.pytest_progress import read_progress
    from bertfast.perfmodel.runs import RESULTS, run_date

    runs = sorted(Path(RESULTS).glob("*/*/stage2-tests-progress.jsonl"), key=lambda p: run_date(str(p.parent)))
    if not runs:
        raise SystemExit(f"sizing: no GPU run's stage2-tests-progress.jsonl under {RESULTS}")
    durations = read_progress(str(runs[-1])).seconds
    return {"run": f"{runs[-1].parent.parent.name}/{runs[-1].parent.name}", "tests": len(durations),
            "test_s": round(sum(durations.values()), 1),
            "grouped_test_s": round(compile_groups.grouped_seconds(durations), 1)}


def measure() -> Dict:
    import torch
    import triton

    tests, collect_s = _count_tests()
    data = {
        "measured": {"date": _dt.date.today().isoformat(), "machine": f"{platform.processor() or platform.machine()}"
                     f", {os.cpu_count()} cores", "python": platform.python_version(), "torch": torch.__version__,
                     "triton": triton.__version__},
        "import_s": {"torch": _median_import_s("torch"), "bertfast.ops": _median_import_s("bertfast.ops")},
        "install_s": _measure_install(),
        "nvcc_s": _measure_nvcc(),
        "csrc_digest": csrc_digests(),
        "triton": _measure_triton(),
        "headline": headline_counts(),
        "tests": tests,
        "collect_s": collect_s,
        "gpu_tests": _gpu_run_tests(),
    }
    return data


# --------------------------------------------------------------------------- command line
def report() -> str:
    from bertfast.gpucheck.stages import STAGES

    m = measured()
    lines = [f"measured {m['measured']['date']} on {m['measured']['machine']} (triton {m['measured']['triton']}); "
             f"stated factors in bertfast/gpucheck/sizing.py", ""]
    for s in STAGES:
        for step in s.steps:
            lines.append(f"stage {s.number} {step.name:20s} limit {step.limit_s:4d} s  {step.sizing}")
    return "\n".join(lines)


def against(summary_path: str) -> str:
    """Each step's limit beside its measured duration in a GPU run's summary.json."""
    from bertfast.gpucheck.stages import STAGES

    summary = json.loads(Path(summary_path).read_text())
    seen = {(s["stage"], r["step"]): r for s in summary.get("stages", []) for r in s["steps"]}
    lines = [f"{'stage':6s} {'step':20s} {'limit':>6s} {'took':>6s}  status"]
    for s in STAGES:
        for step in s.steps:
            r = seen.get((s.number, step.name))
            took = f"{r['seconds']:.0f}" if r else "-"
            lines.append(f"{s.number:<6d} {step.name:20s} {step.limit_s:6d} {took:>6s}  {r['status'] if r else 'not run'}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bertfast.gpucheck.sizing", description=__doc__.split("\n")[0])
    p.add_argument("--measure", action="store_true", help=f"measure on this machine and rewrite {MEASURED_PATH.name}")
    p.add_argument("--against", metavar="SUMMARY_JSON", help="limits beside a GPU run's measured durations")
    args = p.parse_args(argv)
    if args.measure:
        data = measure()
        MEASURED_PATH.write_text(json.dumps(data, indent=1) + "\n")
        measured.cache_clear()
        print(f"wrote {MEASURED_PATH}")
    if args.against:
        print(against(args.against))
        return 0
    print(report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
