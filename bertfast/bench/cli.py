"""`bertfast bench` / `python -m bertfast.bench`: measure this machine, run the suites, write the results."""
from __future__ import annotations

import datetime as _dt
import os
import signal
import sys
import threading
import time
from typing import List, Optional

import torch

from bertfast.bench import device as devmod
from bertfast.bench import report
from bertfast.bench.common import DTYPES, Stopped, SuiteContext
from bertfast.bench.options import IMPL_FAMILIES, MODEL_BENCHMARKS, parser
from bertfast.bench.results import Row, Run
from bertfast.bench.targets import evaluate_targets
from bertfast.bench.timing import TimingPolicy

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


def _autotune_mode(info: devmod.DeviceInfo) -> str:
    """How the Triton kernels chose their configs in this run (kernels/_common.py: launch)."""
    if not info.is_cuda:
        return "interpreter (fixed small configs)" if info.triton_interpret else "no Triton kernels run on CPU"
    from bertfast.kernels._common import excluded_summary
    summary = excluded_summary()
    excluded = f"; {summary}" if summary else ""
    if os.environ.get("BERTFAST_AUTOTUNE", "1").strip() == "0":
        return "fixed: each kernel's first candidate config, untuned (BERTFAST_AUTOTUNE=0)" + excluded
    return "tuned: Triton's autotuner over each kernel's candidates" + excluded


def run_suites(suite: str, ctx: SuiteContext) -> Optional[Stopped]:
    """Run the suites; each records its cases' rows in ctx.rows as they end. SIGTERM or Ctrl-C stops them
    at once (the handler raises Stopped, which is returned)."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)

    def stop(signum, frame) -> None:
        restore()  # one stop: a second signal acts as it would have without this handler
        raise Stopped(signum)

    handle = threading.current_thread() is threading.main_thread()  # only it may set handlers
    for s in previous if handle else ():
        signal.signal(s, stop)
    try:
        if suite in ("kernels", "all"):
            from bertfast.bench import kernels_suite
            kernels_suite.run(ctx)
        if suite in ("model", "all"):
            from bertfast.bench import model_suite
            model_suite.run(ctx)
        if suite == "overhead":
            from bertfast.bench import overhead_suite
            overhead_suite.run(ctx)
    except Stopped as exc:
        return exc
    finally:
        if handle:
            restore()
    return None


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
    unknown = [m for m in _csv(args.models) or () if m not in MODEL_BENCHMARKS]
    if unknown:
        print(f"bertfast bench: unknown model benchmarks {unknown}; expected {', '.join(MODEL_BENCHMARKS)}",
              file=sys.stderr)
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
              "time_budget_s": args.time_budget, "autotune": _autotune_mode(info)}
    run = Run(device=info, config=config)
    from bertfast.kernels._common import excluded_summary, tuned_configs
    if info.is_cuda and config["autotune"].startswith("fixed"):
        ctx.note(f"Triton autotuning off: {config['autotune']}")
    elif excluded_summary():
        ctx.note(f"{excluded_summary()}: no kernel ran them in this run")
    out_dir = args.out or default_out_dir(info, quick)
    if not info.is_cuda:
        ctx.note("CPU run: timings are time.perf_counter on CPU of the torch backend"
                 + ("/Triton-interpreter" if info.triton_interpret else "") + " paths; not GPU performance"
                 + ("" if ctx.cpu_model_cases else " (tiny shapes: they test the harness)")
                 + ("; the model suite's speedup column is the CPU ratio against transformers sdpa eager"
                    if ctx.cpu_model_cases else ""))

    def save_partial(rows: List[Row]) -> None:  # after each case, JSON only: what a run killed later keeps
        elapsed = round(time.monotonic() - started, 1)
        report.write_json(Run(device=info, config=dict(config, partial=True, elapsed_s=elapsed,
                                                       tuned_configs=tuned_configs()), rows=rows,
                              notes=list(ctx.notes), date=run.date), out_dir)

    ctx.on_record = save_partial
    stopped = run_suites(args.suite, ctx)
    run.rows = list(ctx.rows)
    run.config["elapsed_s"] = round(time.monotonic() - started, 1)
    # what the timings ran: the perf model predicts these configs (its default is each first candidate)
    run.config["tuned_configs"] = tuned_configs()
    if stopped is not None:
        log(f"stopped by {stopped.why}: writing the results of the cases that ended")
        run.config["stopped"] = stopped.why
        ctx.note(f"the bench was stopped ({stopped.why}) after {run.config['elapsed_s']:g} s: the case it was running "
                 "is a skipped row (in the kernel suite, that op's later cases too); the cases after those are not "
                 "listed")
    run.notes = list(ctx.notes)
    run.targets = evaluate_targets(run)

    paths = report.write(run, out_dir)
    log("")
    log(report.summary(run))
    log("")
    for kind, path in paths.items():
        log(f"wrote {kind}: {path}")
    if stopped is not None:
        return 128 + stopped.signum  # as a shell reports a process killed by the signal
    from bertfast.bench.preference import record
    table = record(run)
    if table:
        log(f"recorded the faster backend per op on {info.name} (dispatch prefers it from now on): {table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
