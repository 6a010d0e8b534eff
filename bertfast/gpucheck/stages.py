"""The stages of the GPU check, in priority order, each a list of time-limited steps.

A step is one command with a log file and a wall-clock limit; the runner stops a step that
reaches its limit, so a stage never takes longer than the sum of its steps' limits, and that
sum, rounded up to whole minutes, is the stage's estimate. The benchmark steps also get a
budget of their own (``--time-budget``), ending one costliest case before the limit, so they
stop starting new cases in time and still write what they measured.

Each limit comes from bertfast/gpucheck/sizing.py: what can be measured without a GPU (import
times, nvcc's and Triton's compile times for sm_90, the candidates each case tunes) times stated
per-item costs; `python -m bertfast.gpucheck.sizing` prints every formula with its numbers.

Each step says what it needs on the machine (``needs``): the installed package, the CUDA
extension. A step whose need is unmet is skipped with the reason (a failed extension build is
quoted), and the other steps still run: the Triton tests and the benchmarks never wait on the
extension.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from bertfast import registry
from bertfast.gpucheck import sizing

PY = "{python}"      # replaced by the running interpreter
OUT = "{out}"        # replaced by the output directory
JOBS = "{jobs}"      # replaced by the CPU count

PACKAGE = "package"      # bertfast installed: `import bertfast.kernels` works in a fresh interpreter
EXTENSION = "extension"  # the CUDA extension bertfast._C built for this GPU and loadable


@dataclass(frozen=True)
class Step:
    name: str
    argv: List[str]
    limit_s: int
    env: Dict[str, str] = field(default_factory=dict)
    # The CPU dry run: None runs argv as it is; [] skips the step (dry_note says why); else these argv.
    dry_argv: Optional[List[str]] = None
    dry_note: str = ""
    bench_part: bool = False   # a benchmark step: its results directory is merged into results/
    needs: Tuple[str, ...] = (PACKAGE,)  # what must be on the machine (PACKAGE, EXTENSION) for it to run
    # Arguments to drop and retry without when the tool rejects them as an unknown option.
    optional_args: List[str] = field(default_factory=list)
    sizing: str = ""           # how its limit was derived


@dataclass(frozen=True)
class Stage:
    number: int
    name: str
    what: str
    steps: List[Step]

    @property
    def restore_s(self) -> int:
        """A later stage may start on a fresh machine: bertfast is re-installed there first."""
        return 0 if self.number == 1 else sizing.install().limit_s

    @property
    def limit_s(self) -> int:
        return self.restore_s + sum(s.limit_s for s in self.steps)

    @property
    def minutes(self) -> int:
        return -(-self.limit_s // 60)

    @property
    def dir_name(self) -> str:
        return f"stage{self.number}-{self.name}"


def _step(name: str, argv: List[str], estimate: sizing.Estimate, **kw) -> Step:
    return Step(name, argv, estimate.limit_s, sizing=estimate.how, **kw)


def _bench(name: str, stage_dir: str, limit_s: int, margin_s: int, args: List[str],
           gpu_args: List[str] = (), sized: str = "", env: Optional[Dict[str, str]] = None) -> Step:
    """A benchmark step: its own time budget ends margin_s before the step's limit. gpu_args only
    on the GPU (case filters naming GPU shapes; the dry run's tiny cases would not match)."""
    out = f"{OUT}/{stage_dir}/{name}"
    budget = ["--time-budget", str(limit_s - margin_s), "--out", out]
    argv = [PY, "-m", "bertfast.bench", *args, *gpu_args, *budget]
    dry = [PY, "-m", "bertfast.bench", *args, "--device", "cpu", "--quick", *budget]  # tiny CPU shapes
    return Step(name, argv, limit_s, env=dict(env or {}), dry_argv=dry, bench_part=True,
                sizing=sized or f"a budget, not an estimate: cases start until --time-budget {limit_s - margin_s} s;"
                                f" {margin_s} s (stated) lets the costliest case finish")


HEADLINE_CAP_S = 360  # stage 3 may take 6 minutes, its restore included; beyond that its tuning does not fit


def headline_step(cap_s: int = HEADLINE_CAP_S) -> Step:
    """The pre-training cases, autotuned where the tuning fits within cap_s (less the stage's restore):
    all of them, or, where only the first (the headline target's case, which tunes most) fits, the
    cases its time budget reaches; otherwise every kernel runs its first candidate
    (BERTFAST_AUTOTUNE=0), which stage 2 has compiled into the shared Triton cache, and the results
    say so."""
    # static-shapes: the --static-shapes and --cuda-graphs steps (the step targets take the fastest)
    args = ["--suite", "model", "--models", "pretrain", "--impls", "bertfast,static-shapes,transformers",
            "--no-compile"]
    cap_s -= sizing.install().limit_s  # Stage.restore_s: stage 3 reinstalls first
    cases = sizing.headline_cases(tuned=True)
    tuned, margin = sizing.bench(cases, "tuned")
    if tuned.limit_s <= cap_s:
        return _bench("pretrain", "stage3-headline", tuned.limit_s, margin, args, sized=tuned.how)
    if sizing.bench(cases[:1], "tuned")[0].limit_s <= cap_s and cap_s - margin > cases[0].seconds:
        return _bench("pretrain", "stage3-headline", cap_s, margin, args,
                      sized=f"{tuned.how} (limit {tuned.limit_s} s: capped at {cap_s} s, the cases its --time-budget "
                            f"{cap_s - margin} s reaches, the headline first)")
    fixed, margin = sizing.bench(sizing.headline_cases(tuned=False), "fixed configs (tuning would not fit)")
    return _bench("pretrain", "stage3-headline", min(fixed.limit_s, cap_s), margin, args, sized=fixed.how,
                  env={"BERTFAST_AUTOTUNE": "0"})


SANITIZE = [PY, "-m", "bertfast.gpucheck.sanitize", "--backend", "cuda"]
# Only bertfast's kernels are instrumented (all sit in namespace bertfast); torch's run unchecked.
KERNEL_FILTER = ["--kernel-name", "kns=bertfast"]
SANITIZER = ["compute-sanitizer", *KERNEL_FILTER, "--error-exitcode", "1"]
# The kernel-suite cases of stage 4's row-op step (each row op's own) and stage 5's MLM-head step
ROW_OPS = ",".join(registry.names(registry.ROW))
HEAD_CASES = ",".join(case for op in registry.ops(registry.HEAD) for case in op.bench)
PROGRESS = ["-p", "bertfast.gpucheck.pytest_progress", "--progress-file", f"{OUT}/stage2-tests/progress.jsonl"]
# The autotune candidates stage 2's tests found wrong: tests/ops/test_candidates.py writes "kernel:config"
# lines to the file CANDIDATE_FAILURES_ENV names; the later stages leave them out through
# EXCLUDE_CANDIDATES_ENV (runner.py; kernels._common.EXCLUDE_ENV, which every launch mode honours)
FAILED_CANDIDATES = "stage2-tests/failed-candidates.txt"
CANDIDATE_FAILURES_ENV = "BERTFAST_CANDIDATE_FAILURES"
EXCLUDE_CANDIDATES_ENV = "BERTFAST_EXCLUDE_CANDIDATES"
PYTEST = [PY, "-m", "pytest", "-m", "gpu or gpu_capable", "tests", "-p", "no:cacheprovider", *PROGRESS,
          "--junitxml", f"{OUT}/stage2-tests/junit.xml"]

STAGES: List[Stage] = [
    Stage(1, "build", "install, the requirements' versions, the CUDA extension for sm_90a (all cores), bertfast "
          "info, compute-sanitizer memcheck and racecheck on every CUDA op, forward and backward, dropout on", [
              _step("install", [PY, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", "."],
                    sizing.install(), env={"BERTFAST_BUILD_CUDA": "0"}, dry_argv=[],
                    dry_note="the CPU dry run uses the installed package", needs=()),
              _step("requirements", [PY, "-m", "bertfast.gpucheck.requirements"], sizing.requirements(),
                    needs=()),
              _step("build", [PY, "setup.py", "build_ext", "--inplace"], sizing.build(),
                    env={"BERTFAST_BUILD_CUDA": "1", "BERTFAST_CUDA_ARCHS": ";".join(sizing.BUILD_ARCHS),
                         "MAX_JOBS": JOBS},
                    dry_argv=[], dry_note="the CPU dry run uses the extension built at install, if any", needs=()),
              _step("info", [PY, "-m", "bertfast.cli", "info"], sizing.info()),
              # mma.sync's rate: the CUDA attention's instruction without wgmma (docs/perf-model.md)
              _step("mma-rate", [PY, "-m", "bertfast.perfmodel.mma_rate"], sizing.mma_rate(), dry_argv=[],
                    dry_note="no GPU: it times the hardware's mma.sync", needs=(PACKAGE, EXTENSION)),
              _step("memcheck", SANITIZER + ["--tool", "memcheck"] + SANITIZE, sizing.memcheck(),
                    dry_argv=[PY, "-m", "bertfast.gpucheck.sanitize", "--backend", "torch", "--device", "cpu"],
                    dry_note="no GPU: the same calls on the torch backend, without compute-sanitizer",
                    optional_args=KERNEL_FILTER, needs=(PACKAGE, EXTENSION)),
              # --no-fp32-out-gemms: racecheck fails inside cuBLAS's bf16-in, fp32-out GEMM; each launch
              # blocking, so a fault is reported at the launch that made it (sanitize's docstring)
              _step("racecheck", SANITIZER + ["--tool", "racecheck"] + SANITIZE + ["--no-fp32-out-gemms"],
                    sizing.racecheck(), env={"CUDA_LAUNCH_BLOCKING": "1"},
                    dry_argv=[], dry_note="no GPU: covered by the memcheck step's dry run",
                    optional_args=KERNEL_FILTER, needs=(PACKAGE, EXTENSION)),
          ]),
    Stage(2, "tests", "correctness: every GPU test and every test that runs on CUDA when it can (the kernel "
          "tests too), in parallel, each autotuned kernel at its fixed first config (BERTFAST_AUTOTUNE=0)", [
              # compile_groups: the tests that compile the same Triton kernels on one worker; one torch CPU
              # thread a worker, where 16 workers on 16 cores would each start 16
              _step("pytest", PYTEST[:3] + ["-n", JOBS, "-p", "bertfast.gpucheck.compile_groups", "-rfE",
                                            "--durations=15"] + PYTEST[3:],
                    sizing.tests(), env={"BERTFAST_AUTOTUNE": "0", "OMP_NUM_THREADS": "1",
                                         CANDIDATE_FAILURES_ENV: f"{OUT}/{FAILED_CANDIDATES}"},
                    dry_argv=PYTEST + ["-q", "-rfE"],
                    dry_note="no GPU: the same selection on CPU (Triton interpreter; GPU-marked tests skip)"),
          ]),
    Stage(3, "headline", "BERT-base and BERT-large pre-training steps (seq 128 and 512; BERT-large seq 128, the "
          "headline, first), bertfast's default, static-shape and CUDA-graph steps against transformers eager "
          "sdpa on the same weights", [headline_step()]),
    Stage(4, "kernels", "the kernel suite for the row ops and attention (bertfast backends, torch eager, SDPA "
          "flash / memory-efficient / cuDNN; dropout cases; fp32-parameter cases)", [
              _bench("row-ops", "stage4-kernels", 120, 30,
                     ["--suite", "kernels", "--ops", ROW_OPS, "--impls", "bertfast,eager", "--no-compile"]),
              _bench("attention", "stage4-kernels", 180, 45,
                     ["--suite", "kernels", "--ops", "attention", "--impls", "bertfast,eager,sdpa", "--no-compile"]),
          ]),
    Stage(5, "rest", "the MLM head (mlm_head_loss, and its decoder stage alone), the fine-tuning padding case, "
          "inference, and the compiled baseline (transformers under torch.compile, BERT-large seq 128)", [
              _bench("mlm-head", "stage5-rest", 40, 15,
                     ["--suite", "kernels", "--ops", HEAD_CASES,
                      "--impls", "bertfast,eager", "--no-compile"]),
              _bench("finetune-inference", "stage5-rest", 60, 20,
                     ["--suite", "model", "--models", "finetune,inference", "--impls", "bertfast,transformers",
                      "--no-compile"]),
              _bench("compiled", "stage5-rest", 180, 20,
                     ["--suite", "model", "--models", "pretrain", "--impls", "transformers-compiled"],
                     gpu_args=["--case", "model=bert-large,seqlen=128"]),
          ]),
]

TOTAL_LIMIT_MIN = 30   # two 15-minute loans (scripts/gpu-loan.sh runs stages 1-3 in the first)
STAGE_LIMIT_MIN = 9    # one stage per 10-minute command (the machine's start is not counted in it)


def stage(number: int) -> Stage:
    for s in STAGES:
        if s.number == number:
            return s
    raise ValueError(f"stage: expected one of {[s.number for s in STAGES]}, got {number}")
