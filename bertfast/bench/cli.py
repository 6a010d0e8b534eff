"""`bertfast bench` / `python -m bertfast.bench`: measure this machine, run the suites, write the results."""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
import time
from typing import List, Optional

import torch

from bertfast.bench import device as devmod
from bertfast.bench import report
from bertfast.bench.common import DTYPES, SuiteContext
from bertfast.bench.results import IMPL_FAMILIES, Run
from bertfast.bench.targets import evaluate_targets
from bertfast.bench.timing import TimingPolicy

SUITES = ("kernels", "model", "overhead", "all")  # all = kernels + model


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bertfast bench",
        description="Benchmark bertfast's fused ops and training steps against PyTorch and transformers on "
                    "this machine. Every path is checked against the reference before it is timed.")
    p.add_argument("--suite", choices=SUITES, default="all")
    p.add_argument("--quick", action="store_true", help="small case lists and short timing (tiny shapes on CPU)")
    p.add_argument("--out", default=None,
                   help="output directory (default: benchmarks/results/<gpu>/<date> for a full GPU run, "
                        "bench-out/<device>/<date> otherwise)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="activation dtype (default bf16 on GPU, fp32 on CPU)")
    p.add_argument("--backends", default="triton,cuda,torch",
                   help="comma-separated bertfast backends to benchmark (default: all)")
    p.add_argument("--ops", default=None, help="comma-separated kernel- or overhead-suite ops (default: all)")
    p.add_argument("--models", default=None, help="comma-separated model-suite benchmarks (default: all)")
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


def _case_filter(text: Optional[str]) -> dict:
    out = {}
    for item in _csv(text) or ():
        field, sep, value = item.partition("=")
        if not sep or not field.strip():
            raise ValueError(f"--case: expected FIELD=VALUE items, got {item!r}")
        out[field.strip()] = value.strip()
    return out


def _csv(value: Optional[str]) -> Optional[tuple]:
    return None if value is None else tuple(v.strip() for v in value.split(",") if v.strip())


def default_out_dir(info: devmod.DeviceInfo, quick: bool, when: Optional[_dt.datetime] = None) -> str:
    """Committed layout for full GPU runs: benchmarks/results/<gpu-name-slug>/<date>/."""
    stamp = (when or _dt.datetime.now()).strftime("%Y-%m-%d")
    root = "benchmarks/results" if info.is_cuda and not quick else "bench-out"
    return os.path.join(root, info.slug, stamp)


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    started = time.monotonic()
    log = lambda text: print(text, flush=True)  # noqa: E731
    device = None if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("bertfast bench: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    info = devmod.detect(device)
    backends = _csv(args.backends) or ()
    unknown = [b for b in backends if b not in ("triton", "cuda", "torch")]
    if unknown:
        print(f"bertfast bench: unknown backends {unknown}; expected triton, cuda, torch", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if info.is_cuda else torch.float32)
    impls = _csv(args.impls)
    unknown = [f for f in impls or () if f not in IMPL_FAMILIES]
    if unknown:
        print(f"bertfast bench: unknown implementation families {unknown}; expected {', '.join(IMPL_FAMILIES)}",
              file=sys.stderr)
        return 2
    try:
        cases = _case_filter(args.case)
    except ValueError as exc:
        print(f"bertfast bench: {exc}", file=sys.stderr)
        return 2
    if args.time_budget is not None and args.time_budget <= 0:
        print(f"bertfast bench: --time-budget must be > 0 seconds, got {args.time_budget}", file=sys.stderr)
        return 2

    log(f"bertfast bench on {info.describe()}")
    if not info.is_cuda:
        log("No GPU: running on CPU. These are CPU timings (time.perf_counter) of the torch-backend"
            + (" and Triton-interpreter" if info.triton_interpret else "")
            + " paths, not GPU performance."
            + ("" if info.triton_interpret else " Set TRITON_INTERPRET=1 to include the Triton interpreter."))
        if not args.quick:
            log("(CPU run: the kernel suite uses its --quick case lists; the model suite times MiniLM-sized "
                "steps against transformers)")
    quick = args.quick or not info.is_cuda
    log("measuring copy bandwidth and peak matmul rate ...")
    devmod.calibrate(info, quick=quick)
    log(f"  copy bandwidth {info.copy_bandwidth_gbps.median:.4g} GB/s; peak matmul "
        f"{info.peak_matmul_tflops.median:.4g} TFLOP/s ({info.calibration['matmul_dtype']})")

    policy = TimingPolicy.quick() if quick else TimingPolicy()
    step_policy = TimingPolicy.steps(quick)
    if args.reps is not None:
        if args.reps < 1:
            print(f"bertfast bench: --reps must be >= 1, got {args.reps}", file=sys.stderr)
            return 2
        policy.cpu_reps = step_policy.cpu_reps = args.reps
        policy.cpu_warmup = step_policy.cpu_warmup = 1
    ctx = SuiteContext(device=info, quick=quick, dtype=dtype, cpu_model_cases=not info.is_cuda and not args.quick,
                       backends=backends, compile=not args.no_compile,
                       with_transformers=not args.no_transformers, policy=policy, step_policy=step_policy,
                       ops=_csv(args.ops), models=_csv(args.models), impls=impls, cases=cases,
                       deadline=None if args.time_budget is None else started + args.time_budget,
                       budget_s=args.time_budget, log=log)
    config = {"suite": args.suite, "quick": quick, "dtype": str(dtype).replace("torch.", ""),
              "backends": list(backends), "compile": ctx.compile, "transformers": ctx.with_transformers,
              "ops": list(ctx.ops) if ctx.ops else None, "models": list(ctx.models) if ctx.models else None,
              "argv": list(argv) if argv is not None else sys.argv[1:],
              "timing": "cuda_events" if info.is_cuda else "perf_counter (CPU)",
              "cpu_reps": None if info.is_cuda else policy.cpu_reps,
              "cpu_model_cases": ctx.cpu_model_cases,
              "impls": list(impls) if impls else None, "cases": cases or None,
              "time_budget_s": args.time_budget}
    run = Run(device=info, config=config)
    if not info.is_cuda:
        ctx.note("CPU run: timings are time.perf_counter on CPU of the torch backend"
                 + ("/Triton-interpreter" if info.triton_interpret else "") + " paths; not GPU performance"
                 + ("" if ctx.cpu_model_cases else " (tiny shapes: they test the harness)")
                 + ("; the model suite's speedup column is the CPU ratio against transformers sdpa eager"
                    if ctx.cpu_model_cases else ""))

    if args.suite in ("kernels", "all"):
        from bertfast.bench import kernels_suite
        run.rows += kernels_suite.run(ctx)
    if args.suite in ("model", "all"):
        from bertfast.bench import model_suite
        run.rows += model_suite.run(ctx)
    if args.suite == "overhead":
        from bertfast.bench import overhead_suite
        run.rows += overhead_suite.run(ctx)
    run.notes = list(ctx.notes)
    run.config["elapsed_s"] = round(time.monotonic() - started, 1)
    run.targets = evaluate_targets(run)

    out_dir = args.out or default_out_dir(info, quick)
    paths = report.write(run, out_dir)
    log("")
    log(report.summary(run))
    log("")
    for kind, path in paths.items():
        log(f"wrote {kind}: {path}")
    from bertfast.bench.preference import record
    table = record(run)
    if table:
        log(f"recorded the faster backend per op on {info.name} (dispatch prefers it from now on): {table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
