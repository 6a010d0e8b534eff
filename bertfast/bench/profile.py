"""Where a pre-training step's time goes: torch.profiler over the benchmark's own step.

    python -m bertfast.bench.profile --out DIR                     # BERT-large seq 128 batch 128, bf16
    python -m bertfast.bench.profile --model bert-base --seqlen 512 --batch 32 --impls bertfast
    python -m bertfast.bench.profile --device cpu --model tiny --seqlen 32 --batch 4   # the plumbing, on CPU

The model suite's case (the same weights, lengths and batch as ``bertfast bench --suite model
--models pretrain``), each implementation's step warmed up, then profiled for a few steps, each
step inside a ``bertfast.profile.step`` annotation: graphs (``bertfast pretrain --cuda-graphs``'s
step on the batch packed, with pretrain's optimizer: the step the perf model's budget predicts,
first so that a loan that runs out still has it), bertfast (the drop-in eager step with torch's
fused AdamW) and transformers eager sdpa. For each it writes DIR/<impl>.txt: the wall time per step, the
device's busy time per step (the time at least one kernel, copy or fill runs; far below the wall
time means the host is the bottleneck: launches, syncs, Python), the kernels grouped by name with
their share of the device time, and the host-side ops by their own time. DIR/summary.txt puts the
implementations side by side; --trace adds DIR/<impl>.trace.json.gz (chrome://tracing,
ui.perfetto.dev) to find the gaps between kernels. For the steps that run Python per kernel
(bertfast, transformers; not the graph replay) DIR/<impl>.python.txt holds cProfile's view of the
host: the functions by their own time and by their time with callees, per step. The H100 run of
2026-11-26 found the eager BERT-large step idle half the time with ~300 us of host time per fused
op call, and could not say how much of it was Triton's launch, the autotuner, the op wrappers or
autograd: that file says. The GPU check runs it after the headline (scripts/gpu-loan.sh).

    python -m bertfast.bench.profile --from-trace DIR/bertfast.trace.json --out DIR

rebuilds DIR/bertfast.txt's device part from a trace whose profile was stopped before it wrote its
table (the H200 run of 2026-11-27 ran out of its loan while gzipping the trace): the kernels per
step (the steps counted as trace_steps counts them), and the device's busy time; the wall time and the host
ops are not in a trace's device events, and the file says so.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from bertfast.bench.results import BERTFAST, BERTFAST_GRAPHS, HF_EAGER

# --impls names -> the bench's implementation names (files are DIR/<name>.txt)
IMPLS = {"bertfast": BERTFAST, "graphs": BERTFAST_GRAPHS, "transformers": HF_EAGER}


def _steps(model_name: str, seqlen: int, batch: int, device: torch.device, dtype: torch.dtype,
           impls: List[str]) -> List[Tuple[str, Callable[[], None]]]:
    """Each implementation's training step on the model suite's pre-training batch (graphs: the
    static-shape step of ``bertfast pretrain --cuda-graphs`` on that batch packed)."""
    import bertfast
    from bertfast.bench import device as devmod
    from bertfast.bench.common import SuiteContext, sequence_lengths
    from bertfast.bench.model_suite import (_config, make_packed_train_step, make_train_step, packed_pretrain_batch,
                                            packed_step_skip_reason, pretrain_batch, transformers_twin)

    ctx = SuiteContext(device=devmod.detect(device.type), quick=False, dtype=dtype, log=lambda s: None)
    config = _config(model_name)
    gen = torch.Generator().manual_seed(0)
    lengths = sequence_lengths("pretrain", batch, seqlen, gen)
    data, _ = pretrain_batch(config, lengths, seqlen, gen, device)
    torch.manual_seed(0)
    model = bertfast.BertForPreTraining(config).to(device).train()
    steps = []
    for impl in impls:
        if impl == "bertfast":
            steps.append((impl, make_train_step(ctx, model, [data])))
        elif impl == "graphs":
            why = packed_step_skip_reason(ctx, graphs=True)
            if why:
                print(f"profile: graphs not profiled: {why}", file=sys.stderr)
                continue
            steps.append((impl, make_packed_train_step(ctx, model, [packed_pretrain_batch(data)], True)))
        else:
            hf = transformers_twin(model, "pretrain").train()
            steps.append((impl, make_train_step(ctx, hf, [data])))
    return steps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_step(step: Callable[[], None], device: torch.device, warmup: int, steps: int) -> Tuple[Dict, object]:
    """Warm up (autotuning, compiles, lazy state), then profile ``steps`` calls: the figures, and the
    profiler (for ``export_trace``)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(warmup):
        step()
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            with record_function(STEP_ANNOTATION):
                step()
        _sync(device)
        wall = (time.perf_counter() - start) / steps
    events = prof.key_averages()
    device_attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    # The device's own events (kernels, copies, fills) only: a host op's entry also carries the time
    # of the kernels it launched, so summing every entry would count those twice.
    on_device = [e for e in events if _on_device(e) and getattr(e, device_attr, 0) > 0]
    kernels = sorted(((e.key, getattr(e, device_attr) / steps / 1e3, e.count // steps) for e in on_device),
                     key=lambda k: -k[1])
    host = sorted(((e.key, e.self_cpu_time_total / steps / 1e3, e.count // steps) for e in events
                   if not _on_device(e)), key=lambda k: -k[1])
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events() if _on_device(e)]
    return {"wall_ms": wall * 1e3, "device_ms": sum(k[1] for k in kernels), "kernels": kernels, "host": host,
            "launches": sum(k[2] for k in kernels), "busy_ms": covered_time(spans) / steps / 1e3}, prof


def export_trace(prof, trace: str) -> None:
    """The profiler's chrome trace gzipped into ``trace`` (written under a temporary name and renamed,
    so a process stopped on the way leaves the raw trace, never an empty or partial .gz)."""
    raw = trace[:-len(".gz")]
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(trace + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.replace(trace + ".part", trace)
    os.remove(raw)


# The trace's device events: kernels, copies and fills (its annotations of host ranges on the device's
# timeline, "gpu_user_annotation", would count their kernels twice).
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def read_trace(path: str) -> Tuple[List[Dict], Optional[str]]:
    """A chrome trace's events (.json or .json.gz) and the name of its first GPU, when it names one."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    props = trace.get("deviceProperties") if isinstance(trace, dict) else None
    return events, (props[0].get("name") if props else None)


# Each profiled step runs inside this host annotation: a graph replay has no optimizer call to count.
STEP_ANNOTATION = "bertfast.profile.step"


def trace_steps(events: List[Dict]) -> int:
    """How many steps a trace of training steps holds: its step annotations (STEP_ANNOTATION), else
    (traces written before 2026-11-27's last change) its optimizer calls."""
    annotations = [str(e.get("name", "")) for e in events if e.get("cat") == "user_annotation"]
    marked = sum(1 for name in annotations if name == STEP_ANNOTATION)
    return marked or sum(1 for name in annotations if name.startswith("Optimizer.step"))


def profile_from_trace(events: List[Dict], steps: int) -> Dict:
    """``profile_step``'s figures from a trace's device events, per step; no wall time and no host ops
    (None and [])."""
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e]
    by_name: Dict[str, List[float]] = {}
    for e in device:
        entry = by_name.setdefault(e["name"], [0.0, 0])
        entry[0] += e["dur"]
        entry[1] += 1
    kernels = sorted(((name, us / steps / 1e3, count // steps) for name, (us, count) in by_name.items()),
                     key=lambda k: -k[1])
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in device]
    return {"wall_ms": None, "device_ms": sum(k[1] for k in kernels), "kernels": kernels, "host": [],
            "launches": sum(k[2] for k in kernels), "busy_ms": covered_time(spans) / steps / 1e3}


def python_profile(step: Callable[[], None], device: torch.device, steps: int, top: int = 40) -> str:
    """cProfile over ``steps`` calls of an already warmed-up step: the host's Python by function,
    sorted by own time, then by time with callees (cProfile slows Python down, so shares, not
    microseconds, are the figure)."""
    import cProfile
    import io
    import pstats

    _sync(device)
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step()
    _sync(device)
    prof.disable()
    wall = (time.perf_counter() - start) / steps
    out = io.StringIO()
    out.write(f"{steps} step{'s' if steps != 1 else ''} under cProfile, {wall * 1e3:.1f} ms per step (slower "
              f"than unprofiled)\n\n")
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def _on_device(event) -> bool:
    return event.device_type != torch.autograd.DeviceType.CPU


def covered_time(spans: List[Tuple[float, float]]) -> float:
    """The time covered by at least one of the (start, end) spans, in their unit (kernels on several
    streams overlap); the perf model reads committed traces with it too."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def report(impl: str, p: Dict, top: int = 30) -> str:
    if p["wall_ms"] is None:  # rebuilt from a trace
        wall, idle = "wall per step not in the trace", ""
    else:
        wall = f"wall per step {p['wall_ms']:.2f} ms"
        idle = f", idle {100 * (1 - p['busy_ms'] / p['wall_ms']):.0f}% of the wall time" if p["wall_ms"] else ""
    device = (f"device busy {p['busy_ms']:.2f} ms{idle}; kernels {p['device_ms']:.2f} ms; {p['launches']} device "
              f"ops per step" if p["launches"] else "no device ops (a CPU run)")
    lines = [f"# {impl}", f"{wall}; {device}", "",
             f"{'ms/step':>9} {'share':>6} {'calls':>6}  kernel"]
    for name, ms, count in p["kernels"][:top]:
        share = ms / p["device_ms"] if p["device_ms"] else 0.0
        lines.append(f"{ms:9.3f} {100 * share:5.1f}% {count:6d}  {name[:140]}")
    if p["wall_ms"] is None:
        lines += ["", "host ops: not rebuilt from a trace (its host events hold times with their callees)"]
    else:
        lines += ["", f"{'ms/step':>9} {'calls':>6}  host op (self time)"]
        lines += [f"{ms:9.3f} {count:6d}  {name[:140]}" for name, ms, count in p["host"][:top]]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bertfast.bench.profile", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="bert-large", help="a BertConfig preset (default bert-large)")
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--impls", default="graphs,bertfast,transformers",
                    help="comma-separated, profiled in this order: graphs (`bertfast pretrain --cuda-graphs`'s "
                         "step, the one the perf model's budget predicts), bertfast (the drop-in eager step: "
                         "torch's fused AdamW), transformers")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
                    help="autocast dtype on the GPU (fp32 on CPU)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True, help="directory for <impl>.txt and summary.txt")
    ap.add_argument("--trace", action="store_true", help="also write DIR/<impl>.trace.json.gz")
    ap.add_argument("--from-trace", metavar="TRACE",
                    help="profile nothing: rebuild DIR/<impl>.txt from TRACE (<impl>.trace.json or .json.gz, a "
                         "stopped profile's), for the case the other options name (the steps: the trace's "
                         "step annotations, else its optimizer calls, else --steps)")
    args = ap.parse_args(argv)
    if args.from_trace:
        return _from_trace(args)
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    unknown = [i for i in impls if i not in IMPLS]
    if unknown or not impls:
        print(f"profile: --impls expects some of {', '.join(IMPLS)}, got {args.impls!r}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("profile: --device cuda but torch sees no CUDA device (use --device cpu for the plumbing)",
              file=sys.stderr)
        return 2
    device = torch.device(args.device)
    case = _case(args, device.type)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if device.type == "cpu":
        dtype = torch.float32
    os.makedirs(args.out, exist_ok=True)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    summary = [f"pre-training step profile: {case} on {device_name}", ""]
    for name, step in _steps(args.model, args.seqlen, args.batch, device, dtype, impls):
        impl = IMPLS[name]
        p, prof = profile_step(step, device, args.warmup, args.steps)
        with open(os.path.join(args.out, f"{name}.txt"), "w") as fh:
            fh.write(f"{case} on {device_name}\n\n{report(impl, p)}\n{tuned_report()}")
        if args.trace:
            export_trace(prof, os.path.join(args.out, f"{name}.trace.json.gz"))
        del prof
        if name != "graphs":  # a replay runs no Python per kernel
            with open(os.path.join(args.out, f"{name}.python.txt"), "w") as fh:
                fh.write(f"{case} on {device_name}, {impl}: where the host's time goes\n\n"
                         + python_profile(step, device, args.steps))
        top = ", ".join(f"{name[:60]} {ms:.1f} ms" for name, ms, _ in p["kernels"][:5])
        summary.append(f"{impl:28s} wall {p['wall_ms']:8.2f} ms/step, device busy {p['busy_ms']:8.2f} ms, "
                       f"{p['launches']} device ops; top: {top}")
        print(summary[-1], flush=True)
        del step
    with open(os.path.join(args.out, "summary.txt"), "w") as fh:
        fh.write("\n".join(summary) + "\n")
    return 0


def tuned_report() -> str:
    """The autotuner's choices in this process (kernels/_common.py tuned_configs), a line per kernel and
    key: the configs the profiled kernels ran, which the perf model reads back (runs.read_profile)."""
    from bertfast.kernels._common import tuned_configs
    chosen = tuned_configs()
    if not chosen:
        return "autotuned configs: none (each kernel ran its first candidate: fixed mode, or nothing tuned)\n"
    lines = ["autotuned configs (kernel | tuning key | config):"]
    lines += [f"  {name} | {json.dumps(c['key'])} | {c['config']}"
              for name in sorted(chosen) for c in chosen[name]]
    return "\n".join(lines) + "\n"


def _case(args, device_type: str) -> str:
    """The first line's case (the perf model reads it back: bertfast/perfmodel/runs.py read_profile)."""
    return f"{args.model} seq {args.seqlen} batch {args.batch}, {args.dtype if device_type == 'cuda' else 'fp32'}"


def _from_trace(args) -> int:
    name = os.path.basename(args.from_trace).split(".trace.json")[0]
    if name not in IMPLS:
        print(f"profile: --from-trace expects <impl>.trace.json[.gz] with <impl> one of {', '.join(IMPLS)}, got "
              f"{args.from_trace!r}", file=sys.stderr)
        return 2
    try:
        events, gpu = read_trace(args.from_trace)
    except (OSError, ValueError, EOFError) as err:
        print(f"profile: cannot read the trace {args.from_trace}: {err}", file=sys.stderr)
        return 2
    steps = trace_steps(events) or args.steps
    p = profile_from_trace(events, steps)
    if not p["launches"]:
        print(f"profile: {args.from_trace} has no device events (kernels, copies, fills) to rebuild a table from",
              file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    device_type = "cuda" if gpu else "cpu"
    with open(os.path.join(args.out, f"{name}.txt"), "w") as fh:
        fh.write(f"{_case(args, device_type)} on {gpu or 'CPU'}\n\n{report(IMPLS[name], p)}"
                 f"\n(rebuilt from {os.path.basename(args.from_trace)}: {steps} steps)\n")
    print(f"profile: wrote {os.path.join(args.out, name + '.txt')} from {args.from_trace} ({steps} steps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
