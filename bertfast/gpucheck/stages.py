"""The stages of the GPU check, in priority order, each a list of time-limited steps.

A step is one command with a log file and a wall-clock limit; the runner stops a step that
reaches its limit, so a stage never takes longer than the sum of its steps' limits, and that
sum, rounded up to whole minutes, is the stage's estimate. The benchmark steps also get a
budget of their own (``--time-budget``), well inside the limit, so they stop starting new
cases and still write what they measured.

The limits are one H100's (16 cores) worth, derived from counts and per-item costs measured
or stated here; the first GPU run records each step's real duration in summary.json, and
the limits are to be revised from it:

  build     nvcc for sm_90 with one job per source: the slowest source (attention_bwd.cu)
            takes ~40 s on one core, plus pip and the link
  memcheck  the sanitizer's start-up under PyTorch dominates (~1 min), the calls are tiny
  tests     ~400 tests on 16 workers, every Triton kernel compiled once per variant at its
            fixed config (0.3-1.2 s each), no autotune benchmarking
  headline  4 cases x (model build, two fp32 parity passes, ~20 timed steps each for 2
            implementations) plus the autotuning of ~15 kernel variants, cached on disk
  kernels   row ops, BERT-large shapes first (~24 cases of ~12 timings); attention, head dim 64
            first (~36 cases of ~27 timings, the budget stops it); no torch.compile here
  rest      the compiled baseline: torch.compile of BERT-large forward and backward twice (fp32
            for the parity gate, bf16 autocast for the timing), assumed ~1-1.5 min each; the
            fine-tuning padding case, inference, the MLM head. The kernel suite's torch.compile
            rows (~30 compiles) only run in a full `bertfast bench`
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

PY = "{python}"      # replaced by the running interpreter
OUT = "{out}"        # replaced by the output directory
JOBS = "{jobs}"      # replaced by the CPU count


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
    needs_install: bool = True  # run only once bertfast (kernels, CUDA extension) is installed
    # Arguments to drop and retry without when the tool rejects them as an unknown option.
    optional_args: List[str] = field(default_factory=list)


@dataclass(frozen=True)
class Stage:
    number: int
    name: str
    what: str
    steps: List[Step]

    @property
    def limit_s(self) -> int:
        return sum(s.limit_s for s in self.steps)

    @property
    def minutes(self) -> int:
        return -(-self.limit_s // 60)

    @property
    def dir_name(self) -> str:
        return f"stage{self.number}-{self.name}"


def _bench(name: str, stage_dir: str, limit_s: int, margin_s: int, args: List[str],
           gpu_args: List[str] = ()) -> Step:
    """A benchmark step: its own time budget ends margin_s before the step's limit. gpu_args only
    on the GPU (case filters naming GPU shapes; the dry run's tiny cases would not match)."""
    out = f"{OUT}/{stage_dir}/{name}"
    budget = ["--time-budget", str(limit_s - margin_s), "--out", out]
    argv = [PY, "-m", "bertfast.bench", *args, *gpu_args, *budget]
    dry = [PY, "-m", "bertfast.bench", *args, "--device", "cpu", "--quick", *budget]  # tiny CPU shapes
    return Step(name, argv, limit_s, dry_argv=dry, bench_part=True)


SANITIZE = [PY, "-m", "bertfast.gpucheck.sanitize", "--backend", "cuda"]
# Only bertfast's kernels are instrumented (all sit in namespace bertfast); torch's run unchecked.
KERNEL_FILTER = ["--kernel-name", "kns=bertfast"]
SANITIZER = ["compute-sanitizer", *KERNEL_FILTER, "--error-exitcode", "1"]
ROW_OPS = "bias_gelu,bias_dropout_residual_layernorm,embeddings"

STAGES: List[Stage] = [
    Stage(1, "build", "install (CUDA extension for sm_90, all cores), bertfast info, compute-sanitizer memcheck "
          "and racecheck on every CUDA op, forward and backward, dropout on", [
              Step("install", [PY, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", "."], 90,
                   env={"BERTFAST_BUILD_CUDA": "1", "BERTFAST_CUDA_ARCHS": "90", "MAX_JOBS": JOBS},
                   dry_argv=[], dry_note="the CPU dry run uses the installed package", needs_install=False),
              Step("info", [PY, "-m", "bertfast.cli", "info"], 20),
              Step("memcheck", SANITIZER + ["--tool", "memcheck"] + SANITIZE, 90,
                   dry_argv=[PY, "-m", "bertfast.gpucheck.sanitize", "--backend", "torch", "--device", "cpu"],
                   dry_note="no GPU: the same calls on the torch backend, without compute-sanitizer",
                   optional_args=KERNEL_FILTER),
              Step("racecheck", SANITIZER + ["--tool", "racecheck"] + SANITIZE, 90,
                   dry_argv=[], dry_note="no GPU: covered by the memcheck step's dry run",
                   optional_args=KERNEL_FILTER),
          ]),
    Stage(2, "tests", "correctness: every GPU test and every test that runs on CUDA when it can (the kernel "
          "tests too), in parallel, each autotuned kernel at its fixed first config (BERTFAST_AUTOTUNE=0)", [
              Step("pytest", [PY, "-m", "pytest", "-m", "gpu or gpu_capable", "tests", "-p", "no:cacheprovider",
                              "-n", JOBS, "-rfE", "--durations=15", "--junitxml", f"{OUT}/stage2-tests/junit.xml"],
                   300, env={"BERTFAST_AUTOTUNE": "0"},
                   dry_argv=[PY, "-m", "pytest", "-m", "gpu or gpu_capable", "tests", "-p", "no:cacheprovider",
                             "-q", "-rfE", "--junitxml", f"{OUT}/stage2-tests/junit.xml"],
                   dry_note="no GPU: the same selection on CPU (Triton interpreter; GPU-marked tests skip)"),
          ]),
    Stage(3, "headline", "BERT-base and BERT-large pre-training steps (seq 128 and 512) against transformers "
          "eager sdpa on the same weights", [
              _bench("pretrain", "stage3-headline", 300, 60,
                     ["--suite", "model", "--models", "pretrain", "--impls", "bertfast,transformers",
                      "--no-compile"]),
          ]),
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
                     ["--suite", "kernels", "--ops", "mlm_head_loss_decoder,mlm_head_loss",
                      "--impls", "bertfast,eager", "--no-compile"]),
              _bench("finetune-inference", "stage5-rest", 60, 20,
                     ["--suite", "model", "--models", "finetune,inference", "--impls", "bertfast,transformers",
                      "--no-compile"]),
              _bench("compiled", "stage5-rest", 180, 20,
                     ["--suite", "model", "--models", "pretrain", "--impls", "transformers-compiled"],
                     gpu_args=["--case", "model=bert-large,seqlen=128"]),
          ]),
]

TOTAL_LIMIT_MIN = 25   # what a lent GPU machine gives; the plan's sum must stay within it
STAGE_LIMIT_MIN = 8    # one stage per 10-minute command, with room for the machine's start


def stage(number: int) -> Stage:
    for s in STAGES:
        if s.number == number:
            return s
    raise ValueError(f"stage: expected one of {[s.number for s in STAGES]}, got {number}")
