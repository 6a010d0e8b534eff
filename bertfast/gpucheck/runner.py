"""`bertfast gpu-check` / `python -m bertfast.gpucheck`: plan, run and land the staged GPU check.

    plan                         the stages, their commands and estimated H100 minutes
    run --out DIR [--stage K]    run all stages (or stage K); logs and results in DIR
    run --out DIR --dry-run      the same on CPU: tiny shapes, every output labelled CPU
    land DIR                     file a GPU run under benchmarks/results/<gpu>/<date>/ and
                                 regenerate the README's result table

DIR keeps everything a later stage or a later machine needs: the Triton cache with the
autotuning results (DIR/cache/triton), the built CUDA extension (DIR/cache/ext), each stage's
logs (DIR/stage<K>-<name>/), the benchmark results merged so far (DIR/results/) and a
summary (DIR/summary.md, DIR/summary.json). Copy DIR off a GPU machine before it goes back.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import glob
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

from bertfast.gpucheck.stages import (JOBS, OUT, PY, STAGE_LIMIT_MIN, STAGES, TOTAL_LIMIT_MIN, Stage, Step,
                                      stage as get_stage)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --------------------------------------------------------------------------- plan
def plan_text(out: str = "gpu-out") -> str:
    total = sum(s.minutes for s in STAGES)
    lines = [f"GPU check: {len(STAGES)} stages, {total} min on one H100 (priority order; each step runs under "
             f"its own time limit,", "a stage's estimate is the sum of its steps' limits). "
             f"`make gpu-check GPU_OUT={out}` runs them all in order.", ""]
    for s in STAGES:
        lines.append(f"stage {s.number}  {s.minutes} min  {s.name}: {s.what}")
        lines.append(f"         make gpu-check STAGE={s.number} GPU_OUT={out}")
        for step in s.steps:
            lines.append(f"           {step.limit_s:4d} s  {step.name:20s} {_show(step.argv, out)}")
        lines.append("")
    lines.append(f"total    {total} min (limit {TOTAL_LIMIT_MIN}; no stage over {STAGE_LIMIT_MIN})")
    return "\n".join(lines)


def check_plan() -> List[str]:
    """What is wrong with the plan's budget, if anything."""
    problems = []
    total = sum(s.minutes for s in STAGES)
    if total > TOTAL_LIMIT_MIN:
        problems.append(f"the stages sum to {total} min, more than {TOTAL_LIMIT_MIN}")
    problems += [f"stage {s.number} takes {s.minutes} min, more than {STAGE_LIMIT_MIN}"
                 for s in STAGES if s.minutes > STAGE_LIMIT_MIN]
    return problems


def _show(argv: List[str], out: str) -> str:
    return " ".join(shlex.quote(_fill(a, out, "python")).replace(str(os.cpu_count() or 1), "<cores>")
                    if a == JOBS else shlex.quote(_fill(a, out, "python")) for a in argv)


def _fill(arg: str, out: str, python: str = sys.executable) -> str:
    return arg.replace(PY, python).replace(OUT, out).replace(JOBS, str(os.cpu_count() or 1))


# --------------------------------------------------------------------------- running one step
def _installed() -> bool:
    """bertfast installed with its CUDA extension, as a fresh interpreter sees it (this one may have
    started before the install)."""
    probe = [sys.executable, "-c", "import bertfast.kernels, bertfast._C"]
    return subprocess.run(probe, cwd=REPO, capture_output=True).returncode == 0


def _extension_files() -> List[str]:
    return glob.glob(os.path.join(REPO, "bertfast", "_C*.so"))


def _restore_install(out: str, log) -> Optional[str]:
    """On a fresh machine: install without building, reusing the extension kept in DIR/cache/ext."""
    kept = glob.glob(os.path.join(out, "cache", "ext", "_C*.so"))
    if not kept:
        return "bertfast is not installed here and DIR/cache/ext holds no built extension: run stage 1 first"
    env = dict(os.environ, BERTFAST_BUILD_CUDA="0")
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", REPO],
                         env=env, capture_output=True, text=True)
    if res.returncode != 0:
        return f"re-install failed: {res.stderr[-500:]}"
    for path in kept:
        shutil.copy2(path, os.path.join(REPO, "bertfast", os.path.basename(path)))
    log(f"re-installed bertfast and the CUDA extension kept in {os.path.dirname(kept[0])}")
    return None


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _rejected_option(log_path: str) -> bool:
    """Did the command refuse to start over an option it does not know?"""
    head = open(log_path, errors="replace").read(4000).lower()
    return "option" in head and any(w in head for w in ("unknown", "unrecognized", "unrecognised", "invalid"))


def run_step(step: Step, argv: List[str], env: Dict[str, str], log_path: str, limit_s: int) -> Dict:
    """Run one command, its output teed to log_path; stopped at limit_s. Returns its record."""
    start = time.time()
    with open(log_path, "w") as log:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        try:
            proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, bufsize=1, start_new_session=True)
        except FileNotFoundError as exc:
            log.write(f"cannot start: {exc}\n")
            return {"status": "failed", "seconds": 0.0, "detail": f"cannot start: {exc}"}
        timed_out = False
        deadline = start + limit_s
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        while True:
            line = proc.stdout.readline()
            if line:
                log.write(line)
                sys.stdout.write("  | " + line)
                continue
            if proc.poll() is not None:
                rest = proc.stdout.read() or ""
                log.write(rest)
                sys.stdout.write("".join("  | " + l for l in rest.splitlines(True)))
                break
            if time.time() > deadline:
                timed_out = True
                _kill(proc)
                log.write(f"\n[gpu-check] stopped at the step's limit of {limit_s} s\n")
                break
            time.sleep(0.05)
    seconds = round(time.time() - start, 1)
    if timed_out:
        return {"status": "timed out", "seconds": seconds, "detail": f"stopped at its {limit_s} s limit"}
    status = "ok" if proc.returncode == 0 else "failed"
    return {"status": status, "seconds": seconds, "detail": "" if status == "ok" else f"exit {proc.returncode}"}


# --------------------------------------------------------------------------- findings per step
def findings(step: Step, log_path: str, out: str, stage_dir: str) -> str:
    """A one-line result read off a step's log or results (test counts, sanitizer errors, rows)."""
    try:
        text = open(log_path, errors="replace").read()
    except OSError:
        return ""
    if step.name == "pytest":
        m = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|deselected|errors?)\b.*?) in [\d.]+s", text, re.M)
        return m[-1] if m else "no pytest summary (stopped?)"
    if step.name in ("memcheck", "racecheck"):
        m = re.findall(r"ERROR SUMMARY: (\d+) error", text)
        calls = re.findall(r"^(?:ok|FAILED) ", text, re.M)
        head = f"{m[-1]} sanitizer error(s)" if m else "no sanitizer summary"
        return f"{head}; {len(calls)} call(s) run"
    if step.bench_part:
        path = os.path.join(out, stage_dir, step.name, "results.json")
        if not os.path.exists(path):
            return "no results.json"
        rows = json.load(open(path)).get("rows", [])
        counts: Dict[str, int] = {}
        for r in rows:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        return ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "no rows"
    return ""


def merge_results(out: str, log) -> Optional[str]:
    """Merge every benchmark part written so far into DIR/results/ (results.json/md/png)."""
    parts = [os.path.dirname(p) for s in STAGES for step in s.steps if step.bench_part
             for p in glob.glob(os.path.join(out, s.dir_name, step.name, "results.json"))]
    if not parts:
        return None
    from bertfast.bench.merge import main as merge_main
    target = os.path.join(out, "results")
    code = merge_main(["--out", target, *parts])
    log(f"merged {len(parts)} benchmark part(s) into {target}" + ("" if code == 0 else f" (exit {code})"))
    return target


# --------------------------------------------------------------------------- running stages
def _environment(out: str, dry_run: bool) -> Dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TRITON_CACHE_DIR=os.path.join(out, "cache", "triton"))
    if dry_run:
        env.setdefault("TRITON_INTERPRET", "1")
    return env


def _command(step: Step, out: str, dry_run: bool, log) -> List[str]:
    argv = [_fill(a, out) for a in (step.dry_argv if dry_run and step.dry_argv else step.argv)]
    if step.name == "pytest" and not dry_run and importlib.util.find_spec("xdist") is None:
        i = argv.index("-n")
        del argv[i:i + 2]
        log("pytest-xdist is not installed: the tests run in one process")
    return argv


def _run_one(step: Step, out: str, stage_dir: str, dry_run: bool, log) -> Dict:
    """One step's command with its environment and log; a rejected optional option is dropped once."""
    argv = _command(step, out, dry_run, log)
    env = _environment(out, dry_run)
    env.update({k: _fill(v, out) for k, v in step.env.items()})
    log(f"--- {step.name} (limit {step.limit_s} s): {' '.join(argv)}")
    log_path = os.path.join(stage_dir, f"{step.name}.log")
    result = run_step(step, argv, env, log_path, step.limit_s)
    if result["status"] == "failed" and step.optional_args and _rejected_option(log_path):
        argv = [a for a in argv if a not in step.optional_args]
        log(f"--- {step.name}: the tool rejected {' '.join(step.optional_args)}; again without it")
        result = run_step(step, argv, env, log_path, step.limit_s)
    result["findings"] = findings(step, log_path, out, os.path.basename(stage_dir))
    log(f"--- {step.name}: {result['status']} in {result['seconds']:.0f} s. {result['findings']}")
    return result


def run_stage(s: Stage, out: str, dry_run: bool, log) -> Dict:
    """Every step of a stage, in order (a failing step does not stop the next: each is evidence)."""
    stage_dir = os.path.join(out, s.dir_name)
    os.makedirs(stage_dir, exist_ok=True)
    log(f"=== stage {s.number} ({s.name}, {s.minutes} min): {s.what}")
    records = []
    install_checked = dry_run
    for step in s.steps:
        record = {"step": step.name, "limit_s": step.limit_s}
        records.append(record)
        if dry_run and step.dry_argv == []:
            record.update(status="skipped", seconds=0.0, detail=step.dry_note)
            log(f"--- {step.name}: skipped in the dry run ({step.dry_note})")
            continue
        if step.needs_install and not install_checked:
            problem = None if _installed() else _restore_install(out, log)
            if problem:
                record.update(status="failed", seconds=0.0, detail=problem)
                log(f"--- {step.name}: {problem}")
                continue
            install_checked = True
        record.update(_run_one(step, out, stage_dir, dry_run, log))
        if step.name == "install" and record["status"] == "ok":
            _keep_extension(out, log)
            install_checked = True
    if any(step.bench_part for step in s.steps):
        merge_results(out, log)
    status = "ok" if all(r["status"] in ("ok", "skipped") for r in records) else "failed"
    return {"stage": s.number, "name": s.name, "estimate_min": s.minutes, "status": status,
            "seconds": round(sum(r.get("seconds", 0.0) for r in records), 1), "steps": records}


def _keep_extension(out: str, log) -> None:
    ext_dir = os.path.join(out, "cache", "ext")
    os.makedirs(ext_dir, exist_ok=True)
    for path in _extension_files():
        shutil.copy2(path, ext_dir)
        log(f"kept {os.path.basename(path)} in {ext_dir} for later stages")


def _device_label(dry_run: bool) -> str:
    if dry_run:
        return "CPU dry run (no GPU): tiny shapes, CPU timings; proves the plumbing, measures nothing"
    import torch
    return torch.cuda.get_device_name(0)


def write_summary(out: str, stages: List[Dict], dry_run: bool) -> str:
    """summary.json (every run stage so far, newest result per stage) and summary.md; returns the table."""
    path = os.path.join(out, "summary.json")
    previous = json.load(open(path)) if os.path.exists(path) else {}
    if previous.get("dry_run", dry_run) != dry_run:
        previous = {}
    by_stage = {s["stage"]: s for s in previous.get("stages", [])}
    by_stage.update({s["stage"]: s for s in stages})
    data = {"device": _device_label(dry_run), "dry_run": dry_run,
            "updated": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "stages": [by_stage[k] for k in sorted(by_stage)]}
    with open(path, "w") as fh:
        json.dump(data, fh, indent=1)
    table = summary_table(data)
    with open(os.path.join(out, "summary.md"), "w") as fh:
        fh.write(f"# GPU check: {data['device']}\n\n{table}\n")
    return table


def summary_table(data: Dict) -> str:
    lines = ["| stage | step | status | time / limit | result |", "| --- | --- | --- | --- | --- |"]
    for s in data["stages"]:
        for r in s["steps"]:
            result = r.get("findings") or r.get("detail", "")
            lines.append(f"| {s['stage']} {s['name']} | {r['step']} | {r['status']} | "
                         f"{r.get('seconds', 0):.0f} s / {r['limit_s']} s | {result} |")
    return "\n".join(lines)


def run(out: str, stage_numbers: List[int], dry_run: bool) -> int:
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    log = lambda text: print(f"[gpu-check] {text}", flush=True)  # noqa: E731
    if not dry_run:
        import torch
        if not torch.cuda.is_available():
            print("gpu-check: torch sees no CUDA device. On a CPU machine use --dry-run (make gpu-check-dry).",
                  file=sys.stderr)
            return 2
    results = [run_stage(get_stage(k), out, dry_run, log) for k in stage_numbers]
    table = write_summary(out, results, dry_run)
    print()
    print(table)
    print(f"\nlogs and results: {out}" + ("  (CPU dry run: nothing here is a GPU figure)" if dry_run else ""))
    return 0 if all(r["status"] == "ok" for r in results) else 1


# --------------------------------------------------------------------------- landing a run
def land(out: str, repo: str = REPO, date: Optional[str] = None) -> str:
    """Copy a GPU run's results and logs to benchmarks/results/<gpu>/<date>/ and regenerate the README
    table from it. Returns the directory written."""
    from bertfast.bench.readme import update_readme
    from bertfast.bench.results import Run

    summary_path = os.path.join(out, "summary.json")
    results_path = os.path.join(out, "results", "results.json")
    for path in (summary_path, results_path):
        if not os.path.exists(path):
            raise FileNotFoundError(f"land: expected {path} (run the GPU check's stages into {out} first)")
    summary = json.load(open(summary_path))
    run_ = Run.from_dict(json.load(open(results_path)))
    if summary.get("dry_run") or not run_.device.is_cuda:
        raise ValueError(f"land: {out} holds a CPU dry run; only GPU runs are filed under benchmarks/results/")
    stamp = date or run_.date[:10]
    dest = os.path.join(repo, "benchmarks", "results", run_.device.slug, stamp)
    os.makedirs(dest, exist_ok=True)
    for path in glob.glob(os.path.join(out, "results", "*")):
        shutil.copy2(path, dest)
    for path in glob.glob(os.path.join(out, "stage*", "*.log")) + [os.path.join(out, "summary.md"), summary_path]:
        name = os.path.basename(path)
        stage_dir = os.path.basename(os.path.dirname(path))
        shutil.copy2(path, os.path.join(dest, name if stage_dir == os.path.basename(out) else f"{stage_dir}-{name}"))
    update_readme(os.path.join(repo, "README.md"), run_, os.path.relpath(dest, repo))
    return dest


# --------------------------------------------------------------------------- command line
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bertfast gpu-check", description="The staged GPU check (plan, run, land).")
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("plan", help="print the stages with their commands and estimated minutes")
    pl.add_argument("--out", default="gpu-out", help="the output directory shown in the commands")
    r = sub.add_parser("run", help="run the stages (all, or --stage K)")
    r.add_argument("--out", required=True, help="directory for logs, results and caches")
    r.add_argument("--stage", type=int, action="append", help="stage number; repeat for several (default: all)")
    r.add_argument("--dry-run", action="store_true", help="on CPU: tiny shapes, labelled CPU")
    la = sub.add_parser("land", help="file a GPU run under benchmarks/results/ and regenerate the README table")
    la.add_argument("out", help="the directory a GPU run wrote")
    la.add_argument("--date", default=None, help="YYYY-MM-DD for the directory name (default: the run's date)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "plan":
        print(plan_text(args.out))
        problems = check_plan()
        for problem in problems:
            print(f"PLAN DOES NOT FIT: {problem}", file=sys.stderr)
        return 1 if problems else 0
    if args.command == "run":
        numbers = args.stage or [s.number for s in STAGES]
        for k in numbers:
            get_stage(k)  # a clear error for an unknown stage before anything runs
        return run(args.out, numbers, args.dry_run)
    try:
        dest = land(args.out, date=args.date)
    except (FileNotFoundError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"filed {args.out} under {dest} and regenerated the README's result table")
    return 0
