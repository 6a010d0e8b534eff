"""`bertfast bench`'s options, kept free of torch and the kernels so that `bertfast bench --help`
answers at once (bertfast/cli.py: LIGHT_HELP); the run itself is bertfast/bench/cli.py."""
from __future__ import annotations

import argparse

SUITES = ("kernels", "model", "overhead", "all")  # all = kernels + model
DTYPE_NAMES = ("bf16", "fp16", "fp32")  # bertfast.bench.common.DTYPES maps them to torch dtypes
MODEL_BENCHMARKS = ("pretrain", "finetune", "inference", "embeddings")  # the model suite's (--models)
# The pre-training targets' global batch (">= 256, with accumulation as needed"): the model suite's GPU
# cases and the perf model's steps accumulate micro-batches up to it.
GLOBAL_BATCH = 256

# Implementation families: what `bertfast bench --impls` selects (bertfast.bench.results.impl_family).
IMPL_FAMILIES = ("bertfast", "static-shapes", "reference", "eager", "compiled", "sdpa", "transformers",
                 "transformers-compiled", "onnxruntime")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bertfast bench",
        description="Benchmark bertfast's fused ops and training steps against PyTorch and transformers on "
                    "this machine. Every path is checked against the reference before it is timed. results.json "
                    "is saved after every case (marked partial); SIGTERM or Ctrl-C stops the run, which then "
                    "writes what it measured.")
    p.add_argument("--suite", choices=SUITES, default="all")
    p.add_argument("--quick", action="store_true", help="small case lists and short timing (tiny shapes on CPU)")
    p.add_argument("--out", default=None,
                   help="output directory (default: benchmarks/results/<gpu>/<date> for a full GPU run, "
                        "bench-out/<device>/<date> otherwise)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None,
                   help="activation dtype (default bf16 on GPU, fp32 on CPU)")
    p.add_argument("--backends", default="triton,cuda,torch",
                   help="comma-separated bertfast backends to benchmark (default: all)")
    p.add_argument("--ops", default=None, help="comma-separated kernel- or overhead-suite ops (default: all)")
    p.add_argument("--models", default=None,
                   help=f"comma-separated model-suite benchmarks: {', '.join(MODEL_BENCHMARKS)} (default: all)")
    p.add_argument("--reps", type=int, default=None,
                   help="CPU only: timed calls per figure after one warm-up call (default 3 with --quick, 5 "
                        "otherwise); on a GPU the number of calls follows the time budget")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers rows")
    p.add_argument("--impls", default=None,
                   help=f"comma-separated implementation families to run (default: all): {', '.join(IMPL_FAMILIES)}")
    p.add_argument("--case", default=None, metavar="FIELD=VALUE[,FIELD=VALUE]",
                   help="run only the cases whose fields have these values (e.g. model=bert-large,seqlen=128)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="stop starting new cases after this many seconds (calibration included); the cases "
                        "not reached are recorded as skipped")
    return p
