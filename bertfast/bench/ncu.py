"""Nsight Compute (ncu) on the kernels of one training forward and backward of each fused op.

    python -m bertfast.bench.ncu --out DIR                 # on a GPU: ncu runs this module's --target
    python -m bertfast.bench.ncu --out DIR --set attention-512   # the attention target's kernels
    python -m bertfast.bench.ncu --summarize DIR           # DIR/ncu.md again from DIR/ncu-raw.csv
    python -m bertfast.bench.ncu --target --dry-run --backend torch   # the calls alone, on CPU

The perf model (docs/perf-model.md) predicts each kernel from its SASS; a GPU profile says where it
is wrong: the one-pass attention backward took 2.2 times its prediction on the H200, and the
kernels of one row a program (the LayerNorm forward and backward, the embeddings' backward) moved
their bytes at 47-72% of the copy bandwidth where the model has them bandwidth-bound. The timings
cannot say why; the hardware counters can: DRAM throughput, issue-slot use, achieved occupancy and
what the warps stall on.

What it profiles is a set (``--set``, PROFILE_SETS). ``step``: the kernel suite's case of each op at
BERT-large's seq-128 pre-training shapes (16,384 tokens, bf16 activations with fp32 parameters, dropout
0.1; the attention's pre-training lengths; through the op's ``preference_case`` where bertfast.registry
names one, the case whose kernels training runs: bias_gelu's FFN, the GEMMs with GELU in their
epilogues beside cuBLAS's GEMMs of the same FFN). ``attention-512``: the attention target's case
(BERT-large's 16 heads at seq 512, equal lengths, head dim 64, dropout 0.1; bertfast.bench.targets),
whose kernels ran at the sum of their tensor, instruction and memory times on the H200, through the
deterministic backward (delta, dQ, dK/dV) and, with Triton, the atomic dQ. ``target_cases(set)``
lists a set's (op, variant, case). The target warms each up (the autotuner chooses its configs
there, in the stages' Triton cache; under BERTFAST_AUTOTUNE=0 every kernel runs its first
candidate, the config the perf model reads), then runs one training forward and its backward
between cudaProfilerStart and Stop, so ncu (``--profile-from-start off``) profiles those kernels
alone, with the clocks left as they are (``--clock-control none``). The driver then exports the
report's raw metrics (DIR/ncu-raw.csv) and details page (DIR/ncu-details.csv) and writes DIR/ncu.md:
per kernel its time, DRAM bytes and throughput, issue slots busy, occupancy, registers, grid and
block, and its three largest stall reasons, under a header saying how the kernels ran (autotuned or
first candidates; ``--note``: e.g. beside the GPU check's tests, DIR/ncu-conditions.json keeps both).
The target's last line gives the autotuner's choices (kernels/_common.py tuned_configs): the configs
the profiled kernels ran.
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

PROFILE_SETS = ("step", "attention-512")


@dataclass(frozen=True)
class Profiled:
    """One profiled run: an op's kernel-suite case, through bertfast's implementation of that variant (the
    model's attention is packed: ``varlen``)."""
    op: str
    case: Dict[str, object]
    variant: str = ""


def target_cases(profile_set: str = "step", backend: str = "triton") -> List[Profiled]:
    """What a set profiles, in launch order. ``step``: each op's case at BERT-large's seq-128 pre-training
    shapes (bertfast.registry's ``profile_case``), in the registry's order. ``attention-512``: the attention
    target's case, the deterministic backward, then (Triton's alone) the atomic dQ."""
    from bertfast import registry
    if profile_set == "step":
        return [Profiled(op.name, dict(op.profile_case), _variant(op.name))
                for op in registry.ops() if op.profile_case is not None]
    if profile_set == "attention-512":  # the target's case at BERT-large's heads, the kernel suite's first
        from bertfast.bench.targets import ATTENTION_CASE
        case = {"batch": 32, "heads": 16, **ATTENTION_CASE}
        variants = ["varlen"] + (["varlen atomic-dq"] if backend == "triton" else [])
        return [Profiled("attention", dict(case), v) for v in variants]
    raise ValueError(f"profile set must be one of {PROFILE_SETS}, got {profile_set!r}")


def profiled_ops(profile_set: str = "step", backend: str = "triton") -> List[str]:
    """The ops a set profiles, each once, in its order."""
    return list(dict.fromkeys(p.op for p in target_cases(profile_set, backend)))


def _variant(op: str) -> str:
    return "varlen" if op == "attention" else ""  # the model's attention: packed


def case_builder(op: str) -> str:
    """The kernel-suite case an op is profiled through: its ``preference_case`` where it names one
    (where training runs the op's kernels), else the case named after it."""
    from bertfast import registry
    return registry.get(op).preference_case or op


SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "SchedulerStats", "WarpStateStats", "InstructionStats",
            "MemoryWorkloadAnalysis")
MAX_KERNELS = 64  # a bound on what one profiled region may launch (--launch-count)
NCU_GLOBS = ("/opt/nvidia/nsight-compute/*/ncu", "/usr/local/cuda*/bin/ncu")


# --------------------------------------------------------------------------- the target (under ncu)
def _pick(cases, want: Optional[Dict[str, object]]):
    """The case whose fields equal ``want`` (None: the first, for the CPU's tiny cases)."""
    if want is None:
        return cases[0] if cases else None
    return next((oc for oc in cases if all(oc.case.get(k) == v for k, v in want.items())), None)


def run_target(ops: Sequence[str], backend: str, dry_run: bool, warmup: int = 2, profile_set: str = "step") -> int:
    """Each case of ``profile_set`` whose op is among ``ops``, warmed up, then one training forward and
    backward inside the profiled region. A case that cannot run (no path, an exception) is said and left
    out, so the others' kernels are still profiled; the exit status is then 1."""
    import torch

    from bertfast.bench import device as devmod
    from bertfast.bench.common import SuiteContext
    from bertfast.bench.kernel_cases import case_builders
    from bertfast.bench.results import bertfast_impl
    from bertfast.kernels._common import AUTOTUNE_ENV, autotune_enabled, tuned_configs

    on_gpu = torch.cuda.is_available() and not dry_run
    if not on_gpu and not dry_run:
        print("ncu target: no CUDA device (use --dry-run to run the calls on CPU)", file=sys.stderr)
        return 2
    ctx = SuiteContext(device=devmod.detect("cuda" if on_gpu else "cpu"), quick=False,
                       dtype=torch.bfloat16 if on_gpu else torch.float32, backends=(backend,), compile=False,
                       with_transformers=False, log=lambda s: None)
    prepared, failed, builders, built = [], [], case_builders(), {}
    for t in (t for t in target_cases(profile_set, backend) if t.op in ops):
        want = t.case if on_gpu else None
        name = bertfast_impl(backend, t.variant)
        try:
            if t.op not in built:  # each op's cases built once: a set may run one through two variants
                built[t.op] = builders[case_builder(t.op)](ctx)
            oc = _pick(built[t.op], want)
            impl = next((i for i in oc.impls if i.name == name), None) if oc is not None else None
            if impl is None or impl.skip:
                raise LookupError(f"no {name} path for the case {want or 'first listed'}"
                                  + (f" ({impl.skip})" if impl is not None else ""))
            p = impl.build(ctx.dtype)
            for _ in range(warmup):  # the autotuner chooses here, outside the profiled region
                p.run_once()
        except Exception as exc:  # noqa: BLE001 - said, and the other ops are still profiled
            print(f"ncu target: {t.op}: left out: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            failed.append(t.op)
            continue
        prepared.append((t.op, oc.case, name, p))
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    for op, case, name, p in prepared:
        try:
            with p.context():
                out = p.forward()
                torch.autograd.grad(out, p.leaves, p.grad_out, allow_unused=True)
        except Exception as exc:  # noqa: BLE001
            print(f"ncu target: {op}: failed in the profiled region: {type(exc).__name__}: {exc}", file=sys.stderr,
                  flush=True)
            failed.append(op)
            continue
        print(f"ncu target: ran {op} {json.dumps(case)} ({name}): a training forward and its backward", flush=True)
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    print("ncu target: " + ("autotuned configs " + json.dumps(tuned_configs()) if autotune_enabled()
                            else f"first candidate configs ({AUTOTUNE_ENV}=0)"), flush=True)
    return 1 if failed else 0


# --------------------------------------------------------------------------- the driver
def find_ncu() -> Optional[str]:
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in NCU_GLOBS:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def ncu_command(ncu: str, report: str, ops: Sequence[str], backend: str, profile_set: str = "step") -> List[str]:
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--target-processes", "all",
           "--launch-count", str(MAX_KERNELS), "-f", "-o", report]
    for section in SECTIONS:
        cmd += ["--section", section]
    return cmd + [sys.executable, "-m", "bertfast.bench.ncu", "--target", "--set", profile_set, "--ops", ",".join(ops),
                  "--backend", backend]


CONDITIONS = "ncu-conditions.json"


def conditions(ops: Sequence[str], note: str = "", profile_set: str = "step", backend: str = "triton",
               ) -> Dict[str, object]:
    """How the profiled kernels ran (ncu.md's header, kept beside the CSV pages as CONDITIONS): the set's
    runs in their order, their configs (the autotuner's, or each kernel's first candidate under
    BERTFAST_AUTOTUNE=0) and the caller's note."""
    from bertfast.bench.results import bertfast_impl
    from bertfast.kernels._common import AUTOTUNE_ENV, autotune_enabled
    configs = ("autotuned (the target's last line in ncu.log lists the choices)" if autotune_enabled()
               else f"each kernel's first candidate ({AUTOTUNE_ENV}=0), the config the perf model reads")
    runs = [f"{t.op} {json.dumps(t.case)} ({bertfast_impl(backend, t.variant)})"
            for t in target_cases(profile_set, backend) if t.op in ops]
    return {"set": profile_set, "ops": list(ops), "runs": runs, "configs": configs, "note": note}


def drive(out: str, ops: Sequence[str], backend: str, note: str = "", profile_set: str = "step") -> int:
    ncu = find_ncu()
    if ncu is None:
        print("bertfast ncu: no ncu (Nsight Compute) on PATH or under /opt/nvidia/nsight-compute", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, CONDITIONS), "w") as fh:
        json.dump(conditions(ops, note, profile_set, backend), fh, indent=1)
    report = os.path.join(out, "ncu")
    cmd = ncu_command(ncu, report, ops, backend, profile_set)
    print("$ " + " ".join(cmd), flush=True)
    res = subprocess.run(cmd)
    if not os.path.exists(report + ".ncu-rep"):
        print(f"bertfast ncu: ncu exited {res.returncode}; no report at {report}.ncu-rep", file=sys.stderr)
        return 1
    if res.returncode != 0:  # an op the target left out, or ncu's own error: the kernels it did profile count
        print(f"bertfast ncu: ncu exited {res.returncode} (the target's lines above say what failed); "
              f"summarising the kernels it profiled", file=sys.stderr)
    for page in ("raw", "details"):
        with open(os.path.join(out, f"ncu-{page}.csv"), "w") as fh:
            subprocess.run([ncu, "--import", report + ".ncu-rep", "--csv", "--page", page], stdout=fh, check=True)
    return summarize(out) or (1 if res.returncode else 0)


# --------------------------------------------------------------------------- the summary
_SCALE = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6,  # -> microseconds
          "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}  # -> bytes
STALL = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")


def read_raw(path: str) -> List[Dict[str, Tuple[str, str]]]:
    """ncu's raw page (--csv --page raw): a header of metric names, a row of units, a row per kernel.
    Each kernel as {column: (value, unit)}."""
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        rows = [r for r in csv.reader(f) if r]
    header = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if header is None or header + 1 >= len(rows):
        return []
    names, units = rows[header], rows[header + 1]
    return [{n: (v, u) for n, v, u in zip(names, row, units)} for row in rows[header + 2:] if len(row) == len(names)]


def _number(cell: Tuple[str, str], kind: str) -> Optional[float]:
    value, unit = cell
    try:
        x = float(value.replace(",", ""))
    except ValueError:
        return None
    if kind in ("time", "bytes"):
        return x * _SCALE.get(unit.strip(), 1.0)
    return x


def kernel_rows(kernels: List[Dict[str, Tuple[str, str]]]) -> List[Dict[str, object]]:
    """Per kernel: its name, time (us), DRAM bytes, the throughput, issue and occupancy percentages,
    registers, grid and block, and its stall reasons (cycles per issued instruction spent stalled on
    each), largest first. A metric the report lacks is None."""
    out = []
    for k in kernels:
        def get(metric: str, kind: str = "value") -> Optional[float]:
            return _number(k[metric], kind) if metric in k else None
        row: Dict[str, object] = {"kernel": k.get("Kernel Name", ("?", ""))[0]}
        row["time_us"] = get("gpu__time_duration.sum", "time")
        read, written = get("dram__bytes_read.sum", "bytes"), get("dram__bytes_write.sum", "bytes")
        row["dram_bytes"] = (read or 0) + (written or 0) if read is not None or written is not None else None
        for key, metric in (("dram_pct", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
                            ("sm_pct", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
                            ("issue_pct", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
                            ("occupancy_pct", "sm__warps_active.avg.pct_of_peak_sustained_active"),
                            ("theoretical_pct", "sm__maximum_warps_per_active_cycle_pct"),
                            ("registers", "launch__registers_per_thread"),
                            ("grid", "launch__grid_size"), ("block", "launch__block_size")):
            row[key] = get(metric)
        stalls = {name[len(STALL[0]):-len(STALL[1])]: _number(cell, "value")
                  for name, cell in k.items() if name.startswith(STALL[0]) and name.endswith(STALL[1])}
        row["stalls"] = sorted(((r, v) for r, v in stalls.items() if v), key=lambda rv: -rv[1])
        out.append(row)
    return out


def _f(x: Optional[float], digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def markdown(rows: List[Dict[str, object]], source: str, ran: Optional[Dict[str, object]] = None) -> str:
    ran = ran or {}
    runs = f"Runs, in launch order: {'; '.join(ran['runs'])}." if ran.get("runs") else ""
    how = " ".join(part for part in (runs or (f"Ops: {', '.join(ran['ops'])}." if ran.get("ops") else ""),
                                     f"Configs: {ran['configs']}." if ran.get("configs") else "",
                                     ran.get("note") or "") if part)
    title = ("the attention target's case at seq 512" if ran.get("set") == "attention-512"
             else "one training forward and backward of each op")
    lines = [f"# ncu: {title} ({source})", "", *([how, ""] if how else []),
             "Per kernel in launch order. DRAM GB/s: the bytes DRAM read and wrote over the kernel's time. Issue "
             "busy: the share of cycles a scheduler issued. Stalls: cycles per issued instruction a warp spent "
             "stalled, by reason (ncu's smsp__average_warps_issue_stalled_*_per_issue_active), largest three.", "",
             "| kernel | time us | DRAM MB | DRAM GB/s | DRAM % | SM % | issue busy % | occupancy % (achieved / "
             "theoretical) | regs | grid x block | stalls |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        gbps = (r["dram_bytes"] / (r["time_us"] * 1e3)) if r["dram_bytes"] is not None and r["time_us"] else None
        stalls = ", ".join(f"{name} {v:.1f}" for name, v in r["stalls"][:3]) or "-"
        occupancy = f"{_f(r['occupancy_pct'])} / {_f(r['theoretical_pct'])}"
        lines.append(f"| {r['kernel'][:60]} | {_f(r['time_us'])} | "
                     f"{_f(None if r['dram_bytes'] is None else r['dram_bytes'] / 1e6)} | {_f(gbps, 0)} | "
                     f"{_f(r['dram_pct'])} | {_f(r['sm_pct'])} | {_f(r['issue_pct'])} | {occupancy} | "
                     f"{_f(r['registers'], 0)} | {_f(r['grid'], 0)} x {_f(r['block'], 0)} | {stalls} |")
    return "\n".join(lines) + "\n"


def summarize(out: str) -> int:
    raw = os.path.join(out, "ncu-raw.csv")
    if not os.path.exists(raw):
        print(f"bertfast ncu: expected {raw} (ncu --import REPORT --csv --page raw)", file=sys.stderr)
        return 2
    rows = kernel_rows(read_raw(raw))
    if not rows:
        print(f"bertfast ncu: {raw} lists no kernels (was anything launched between cudaProfilerStart and Stop?)",
              file=sys.stderr)
        return 1
    ran = None
    try:
        with open(os.path.join(out, CONDITIONS), encoding="utf-8") as fh:
            ran = json.load(fh)
    except (OSError, ValueError):
        pass  # a report from before the conditions were kept, or summarised apart from them
    text = markdown(rows, os.path.basename(raw), ran)
    with open(os.path.join(out, "ncu.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(out, "ncu.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    print(text, end="")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bertfast.bench.ncu", description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="directory for the report, its CSV pages and ncu.md (the driver)")
    ap.add_argument("--set", default="step", choices=PROFILE_SETS, dest="profile_set",
                    help="step: each op at BERT-large's seq-128 pre-training shapes (default); attention-512: the "
                         "attention target's case at seq 512, deterministic and (Triton) atomic dQ")
    ap.add_argument("--ops", help="comma-separated, of the set's ops (default: all of them)")
    ap.add_argument("--backend", default="triton", choices=("triton", "cuda", "torch"))
    ap.add_argument("--target", action="store_true", help="be what ncu profiles (the driver runs this)")
    ap.add_argument("--dry-run", action="store_true", help="with --target: run the calls without a GPU or profiler")
    ap.add_argument("--summarize", metavar="DIR", help="write DIR/ncu.md from DIR/ncu-raw.csv and stop")
    ap.add_argument("--note", default="", help="how the profile was taken, for ncu.md's header (the driver)")
    args = ap.parse_args(argv)
    if args.summarize:
        return summarize(args.summarize)
    profiled = profiled_ops(args.profile_set, args.backend)
    ops = profiled if args.ops is None else [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in profiled]
    if unknown or not ops:
        print(f"bertfast ncu: --ops expects some of {', '.join(profiled)} (--set {args.profile_set}), "
              f"got {args.ops!r}", file=sys.stderr)
        return 2
    if args.target:
        return run_target(ops, args.backend, args.dry_run, profile_set=args.profile_set)
    if not args.out:
        print("bertfast ncu: --out DIR is required (or --target, --summarize DIR)", file=sys.stderr)
        return 2
    return drive(args.out, ops, args.backend, args.note, args.profile_set)


if __name__ == "__main__":
    raise SystemExit(main())
