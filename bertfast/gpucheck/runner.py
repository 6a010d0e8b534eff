"""`bertfast gpu-check` / `python -m bertfast.gpucheck`: plan, run and land the staged GPU check.

    plan                         the stages, their commands and estimated H100 minutes
    run --out DIR [--stage K]    run all stages (or stage K); logs and results in DIR
        [--step S | --skip S]    only these steps of them, or all but these (e.g. the sanitizers
                                 in a second process beside stage 2: see docs/gpu-check.md)
    run --out DIR --dry-run      the same on CPU: tiny shapes, every output labelled CPU
        [--simulate MODE:STEP]   ... with a step failing, hanging or crashing, or (lost-machine)
                                 every stage on a fresh machine (see simulate.py)
    land DIR                     file a GPU run under benchmarks/results/<gpu>/<date>/ and
                                 regenerate the README's result table

DIR keeps everything a later stage or a later machine needs: the Triton cache with the
autotuning results (DIR/cache/triton), the built CUDA extension or its build error
(DIR/cache/ext; machine.py restores from there), each stage's
logs (DIR/stage<K>-<name>/), the benchmark results merged so far (DIR/results/) and a
summary (DIR/summary.md, DIR/summary.json). Copy DIR off a GPU machine before it goes back.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import fcntl
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
from typing import Dict, List, Optional, Sequence

from bertfast.gpucheck import simulate
from bertfast.gpucheck.machine import REPO, SKIP_ENV, Machine, error_excerpt
from bertfast.gpucheck.stages import (EXCLUDE_CANDIDATES_ENV, EXTENSION, FAILED_CANDIDATES, JOBS, OUT, PY,
                                      STAGE_LIMIT_MIN, STAGES, TOTAL_LIMIT_MIN, Stage, Step, stage as get_stage)


# --------------------------------------------------------------------------- plan
def plan_text(out: str = "gpu-out") -> str:
    total = sum(s.minutes for s in STAGES)
    lines = [f"GPU check: {len(STAGES)} stages, {total} min on one H100 (priority order; each step runs under "
             f"its own time limit,", "a stage's estimate is the sum of its steps' limits). "
             f"`make gpu-check GPU_OUT={out}` runs them all in order.", ""]
    for s in STAGES:
        lines.append(f"stage {s.number}  {s.minutes} min  {s.name}: {s.what}")
        lines.append(f"         make gpu-check STAGE={s.number} GPU_OUT={out}")
        if s.restore_s:
            lines.append(f"           {s.restore_s:4d} s  {'(fresh machine)':20s} re-install bertfast, copy the "
                         f"extension back from {out}/cache/ext")
        for step in s.steps:
            needs = f"  [needs {', '.join(step.needs)}]" if step.needs else ""
            lines.append(f"           {step.limit_s:4d} s  {step.name:20s} {_show(step.argv, out)}{needs}")
            lines.append(f"           {'':4s}    {'':20s} sized: {step.sizing}")
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
KILL_GRACE_S = 10  # after SIGTERM, the time a step has to write its results before SIGKILL


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(KILL_GRACE_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _rejected_option(log_path: str) -> bool:
    """Did the command refuse to start over an option it does not know?"""
    head = open(log_path, errors="replace").read(4000).lower()
    return "option" in head and any(w in head for w in ("unknown", "unrecognized", "unrecognised", "invalid"))


def _ended(returncode: int) -> Dict:
    if returncode == 0:
        return {"status": "ok", "detail": ""}
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return {"status": "crashed", "detail": f"killed by {name}"}
    return {"status": "failed", "detail": f"exit {returncode}"}


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
    return {"seconds": seconds, **_ended(proc.returncode)}


# --------------------------------------------------------------------------- findings per step
def findings(step: Step, log_path: str, out: str, stage_dir: str) -> str:
    """A one-line result read off a step's log or results (test counts, sanitizer errors, rows)."""
    try:
        text = open(log_path, errors="replace").read()
    except OSError:
        return ""
    if step.name == "pytest":
        return _pytest_findings(text, os.path.join(out, stage_dir))
    if step.name in ("memcheck", "racecheck"):
        return _sanitizer_findings(text)
    if step.name == "requirements":
        lines = [ln for ln in text.splitlines() if ln.startswith(("all ", "MISSING:"))]
        return lines[-1] if lines else ""
    if step.name == "info":
        lines = [ln for ln in text.splitlines() if ln.startswith("CUDA extension")]
        return lines[-1] if lines else ""
    if step.bench_part:
        path = os.path.join(out, stage_dir, step.name, "results.json")
        if not os.path.exists(path):
            return "no results.json"
        data = json.load(open(path))
        counts: Dict[str, int] = {}
        for r in data.get("rows", []):
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        text = ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "no rows"
        return text + _bench_state(data.get("config", {}))
    return ""


def _bench_state(config: Dict) -> str:
    """What a stopped bench's results.json says of itself (see bertfast.bench.cli)."""
    if config.get("stopped"):
        return f" (stopped: {config['stopped']})"
    if config.get("partial"):
        return " (partial: the bench did not finish; rows of the cases it completed)"
    return ""


def _sanitizer_findings(text: str) -> str:
    """memcheck ends with 'ERROR SUMMARY: N errors', racecheck with 'RACECHECK SUMMARY: N hazards
    displayed (E errors, W warnings)'; an internal sanitizer error is named (it is not the kernel's)."""
    m = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    race = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text)
    calls = re.findall(r"^(?:ok|FAILED) ", text, re.M)
    failed = re.findall(r"^FAILED (\S+ \S+):", text, re.M)
    if race:
        head = f"{race[-1][1]} race error(s), {race[-1][2]} warning(s)"
    else:
        head = f"{m[-1]} sanitizer error(s)" if m else "no sanitizer summary"
    if "Internal Sanitizer Error" in text:
        head += " (one is compute-sanitizer's own internal error: '" + \
            re.findall(r"Internal Sanitizer Error: ([^\n]*)", text)[0].strip() + "')"
    return f"{head}; {len(calls)} call(s) run" + (f"; failing: {', '.join(failed)}" if failed else "")


def _pytest_findings(log_text: str, stage_dir: str) -> str:
    """pytest's own summary line when it finished; else what the progress file recorded, with the tests
    not reached (and those running when it stopped) listed in not-reached.txt."""
    from bertfast.gpucheck.pytest_progress import read_progress

    m = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|deselected|errors?)\b.*?) in [\d.]+s", log_text, re.M)
    if m:
        return m[-1]
    progress = read_progress(os.path.join(stage_dir, "progress.jsonl"))
    if progress.running or progress.not_reached:
        with open(os.path.join(stage_dir, "not-reached.txt"), "w") as fh:
            fh.writelines(f"running when stopped: {t}\n" for t in progress.running)
            fh.writelines(f"{t}\n" for t in progress.not_reached)
    return progress.summary_line()


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
def _environment(out: str, dry_run: bool, machine: Machine) -> Dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TRITON_CACHE_DIR=os.path.join(out, "cache", "triton"))
    env.pop(SKIP_ENV, None)
    env.update(machine.env())
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


def wrong_candidates(out: str) -> str:
    """The autotune candidates stage 2's tests found wrong, as BERTFAST_EXCLUDE_CANDIDATES takes them
    ('' when none)."""
    try:
        with open(os.path.join(out, FAILED_CANDIDATES), encoding="utf-8") as fh:
            return "; ".join(sorted({line.strip() for line in fh if line.strip()}))
    except OSError:
        return ""


def _exclude_wrong_candidates(step: Step, out: str, env: Dict[str, str], log) -> None:
    """Stage 2's tests record the candidates they find wrong afresh; every other step leaves those out
    (unless BERTFAST_EXCLUDE_CANDIDATES is set already), so no stage times or runs one, and says so."""
    if step.name == "pytest":
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out, FAILED_CANDIDATES))
        return
    wrong = wrong_candidates(out)
    if wrong and EXCLUDE_CANDIDATES_ENV not in env:
        env[EXCLUDE_CANDIDATES_ENV] = wrong
        log(f"--- {step.name}: leaving out the autotune candidates stage 2's tests found wrong: {wrong}")


def _run_one(step: Step, out: str, stage_dir: str, dry_run: bool, machine: Machine, log,
             simulated: Optional[str] = None, limit: Optional[int] = None) -> Dict:
    """One step's command with its environment and log; a rejected optional option is dropped once.
    simulated: the dry run's --simulate mode for this step (a stand-in command runs instead);
    limit: the step's limit cut short by a deadline (default: its own)."""
    argv, limit = _command(step, out, dry_run, log), limit or step.limit_s
    if simulated:
        argv, limit = simulate.stand_in(step.name, simulated, out, argv, limit)
    env = _environment(out, dry_run, machine)
    env.update({k: _fill(v, out) for k, v in step.env.items()})
    _exclude_wrong_candidates(step, out, env, log)
    log(f"--- {step.name} (limit {limit} s){' SIMULATED ' + simulated if simulated else ''}: {' '.join(argv)}")
    log_path = os.path.join(stage_dir, f"{step.name}.log")
    result = run_step(step, argv, env, log_path, limit)
    if result["status"] == "failed" and step.optional_args and _rejected_option(log_path):
        argv = [a for a in argv if a not in step.optional_args]
        log(f"--- {step.name}: the tool rejected {' '.join(step.optional_args)}; again without it")
        result = run_step(step, argv, env, log_path, limit)
    result["findings"] = findings(step, log_path, out, os.path.basename(stage_dir))
    if step.name == "build" and result["status"] != "ok":
        result["findings"] = error_excerpt(log_path)
    if simulated:
        result["simulated"] = simulated
    log(f"--- {step.name}: {result['status']} in {result['seconds']:.0f} s. {result['findings']}")
    return result


MIN_STEP_S = 15  # under a deadline, a step with less time left than this is not started


def run_stage(s: Stage, out: str, dry_run: bool, log, machine: Optional[Machine] = None,
              simulated: Optional[Dict[str, str]] = None, only: Optional[Sequence[str]] = None,
              until: Optional[float] = None) -> Dict:
    """Every step of a stage (or those named in ``only``), in order. A failing step does not stop the
    next (each is evidence); a step whose needs are unmet (no package, no extension) is skipped with
    the reason. Steps left out by ``only`` leave no record: the summary keeps their earlier one.
    until: a deadline (epoch seconds, the loan's end): each step's limit is cut to the time left, and
    a step with less than MIN_STEP_S left is skipped, so the command ends in time with its logs."""
    machine = machine or Machine(out, dry_run, log)
    simulated = simulated or {}
    steps = [step for step in s.steps if only is None or step.name in only]
    stage_dir = os.path.join(out, s.dir_name)
    os.makedirs(stage_dir, exist_ok=True)
    log(f"=== stage {s.number} ({s.name}, {s.minutes} min): {s.what}")
    machine.new_stage()
    records: List[Dict] = []
    builds = any(step.name == "build" for step in steps)
    for step in steps:
        record = {"step": step.name, "limit_s": step.limit_s}
        mode = simulated.get(step.name)
        if dry_run and step.dry_argv == [] and not mode:
            records.append(dict(record, status="skipped", seconds=0.0, detail=step.dry_note))
            log(f"--- {step.name}: skipped in the dry run ({step.dry_note})")
            if step.name == "install":
                machine.installed("ok", "")  # the installed package stands in for it
            continue
        done, looked = len(machine.restores), EXTENSION in machine.why_not
        unmet = machine.unmet(step.needs)
        records += machine.restores[done:]  # what was restored before this step, in the order it happened
        if not looked and machine.why_not.get(EXTENSION) and not builds:
            records.append({"step": "extension", "limit_s": 0, "status": "skipped", "seconds": 0.0,
                            "detail": f"this stage runs without it: {machine.why_not[EXTENSION]}"})
        if unmet:
            # on the GPU a step that could not run is a finding, not a pass: its stage fails
            records.append(dict(record, status="skipped", seconds=0.0, detail=unmet, unmet=not dry_run))
            log(f"--- {step.name}: skipped: {unmet}")
            continue
        limit = step.limit_s
        if until is not None:
            left = int(until - time.time())
            # a step stopped at its limit may take the kill's grace to end: both fit before the deadline
            room = left - KILL_GRACE_S
            if room < MIN_STEP_S:
                records.append(dict(record, status="skipped", seconds=0.0,
                                    detail=f"not started: {max(left, 0)} s left before the deadline"))
                log(f"--- {step.name}: not started, {max(left, 0)} s left before the deadline")
                continue
            if room < limit:
                limit = record["limit_s"] = room
                record["cut_from_s"] = step.limit_s
        record.update(_run_one(step, out, stage_dir, dry_run, machine, log, mode, limit))
        records.append(record)
        if step.name == "install":
            machine.installed(record["status"], record.get("detail", ""))
        elif step.name == "build":
            machine.built(record["status"], record.get("detail", ""), record.get("findings", ""))
    if any(step.bench_part for step in steps):
        merge_results(out, log)
    return _stage_record(s, records)


def _stage_record(s: Stage, records: List[Dict]) -> Dict:
    bad = [r for r in records if r["status"] not in ("ok", "skipped") or r.get("unmet")]
    return {"stage": s.number, "name": s.name, "estimate_min": s.minutes, "status": "failed" if bad else "ok",
            "seconds": round(sum(r.get("seconds", 0.0) for r in records), 1), "steps": records}


def _merge_stage(previous: Dict, new: Dict) -> Dict:
    """A stage's record after a run of some of its steps: each step's newest record, in the stage's order
    (rows that are not steps, the restores, keep their place before the steps)."""
    names = {r["step"] for r in new["steps"]}
    kept = [r for r in previous["steps"] if r["step"] not in names] + new["steps"]
    s = get_stage(new["stage"])
    order = {step.name: i for i, step in enumerate(s.steps)}
    kept.sort(key=lambda r: order.get(r["step"], -1))
    return _stage_record(s, kept)


@contextlib.contextmanager
def _locked(out: str):
    """Two `run`s may share a GPU_OUT at once (the sanitizers beside stage 2): one writes the summary
    at a time."""
    with open(os.path.join(out, "summary.lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _device_label(dry_run: bool) -> str:
    if dry_run:
        return "CPU dry run (no GPU): tiny shapes, CPU timings; proves the plumbing, measures nothing"
    import torch
    return torch.cuda.get_device_name(0)


def write_summary(out: str, stages: List[Dict], dry_run: bool) -> str:
    """summary.json (every stage run so far, each step's newest result) and summary.md; returns the table."""
    path = os.path.join(out, "summary.json")
    device = _device_label(dry_run)
    with _locked(out):
        previous = json.load(open(path)) if os.path.exists(path) else {}
        if previous.get("dry_run", dry_run) != dry_run:
            previous = {}
        by_stage = {s["stage"]: s for s in previous.get("stages", [])}
        for s in stages:
            by_stage[s["stage"]] = _merge_stage(by_stage[s["stage"]], s) if s["stage"] in by_stage else s
        data = {"device": device, "dry_run": dry_run,
                "updated": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                "stages": [by_stage[k] for k in sorted(by_stage)]}
        with open(path + ".tmp", "w") as fh:
            json.dump(data, fh, indent=1)
        os.replace(path + ".tmp", path)
        table = summary_table(data)
        with open(os.path.join(out, "summary.md"), "w") as fh:
            fh.write(f"# GPU check: {data['device']}\n\n{table}\n")
    return table


def summary_table(data: Dict) -> str:
    lines = ["| stage | step | status | time / limit | result |", "| --- | --- | --- | --- | --- |"]
    for s in data["stages"]:
        for r in s["steps"]:
            result = r.get("findings") or r.get("detail", "")
            if r.get("status") not in ("ok", "skipped") and r.get("detail") and r["detail"] not in result:
                result = f"{r['detail']}: {result}" if result else r["detail"]
            if r.get("simulated"):
                result = f"(simulated {r['simulated']}) {result}"
            if r.get("cut_from_s"):
                result = f"{result} (limit cut from {r['cut_from_s']} s by the deadline)".strip()
            lines.append(f"| {s['stage']} {s['name']} | {r['step']} | {r['status']} | "
                         f"{r.get('seconds', 0):.0f} s / {r['limit_s']} s | {result.replace('|', '/')} |")
    return "\n".join(lines)


def step_filter(stage_numbers: List[int], steps: Sequence[str] = (), skip: Sequence[str] = ()
                ) -> Dict[int, Optional[List[str]]]:
    """Each stage's steps to run (None: all) for --step / --skip; a name no chosen stage has is an error."""
    known = {step.name for k in stage_numbers for step in get_stage(k).steps}
    for name in [*steps, *skip]:
        if name not in known:
            raise ValueError(f"expected a step of stage(s) {', '.join(map(str, stage_numbers))} "
                             f"({', '.join(sorted(known))}), got {name!r}")
    if not steps and not skip:
        return {k: None for k in stage_numbers}
    chosen = {k: [st.name for st in get_stage(k).steps if (not steps or st.name in steps) and st.name not in skip]
              for k in stage_numbers}
    return {k: names for k, names in chosen.items() if names}


def run(out: str, stage_numbers: List[int], dry_run: bool, simulations: Sequence[str] = (),
        steps: Sequence[str] = (), skip: Sequence[str] = (), until: Optional[float] = None) -> int:
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    log = lambda text: print(f"[gpu-check] {text}", flush=True)  # noqa: E731
    if simulations and not dry_run:
        print("gpu-check: --simulate is for the CPU dry run (--dry-run) only", file=sys.stderr)
        return 2
    try:
        modes, lost = simulate.parse(simulations, [step.name for s in STAGES for step in s.steps])
        chosen = step_filter(stage_numbers, steps, skip)
    except ValueError as exc:
        print(f"gpu-check: {exc}", file=sys.stderr)
        return 2
    if not dry_run:
        import torch
        if not torch.cuda.is_available():
            print("gpu-check: torch sees no CUDA device. On a CPU machine use --dry-run (make gpu-check-dry).",
                  file=sys.stderr)
            return 2
    machine = Machine(out, dry_run, log, fresh=lost)
    results = [run_stage(get_stage(k), out, dry_run, log, machine, modes, only, until)
               for k, only in chosen.items()]
    table = write_summary(out, results, dry_run)
    print()
    print(table)
    print(f"\nlogs and results: {out}" + ("  (CPU dry run: nothing here is a GPU figure)" if dry_run else ""))
    return 0 if all(r["status"] == "ok" for r in results) else 1


# --------------------------------------------------------------------------- landing a run
def land(out: str, repo: str = REPO, date: Optional[str] = None) -> str:
    """Copy a GPU run's results and logs to benchmarks/results/<gpu>/<date>/ and regenerate the README
    table from every filed run (each target from the newest that measured it). Returns the directory
    written."""
    from bertfast.bench.readme import filed_runs, update_readme
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
    dest = _land_dir(os.path.join(repo, "benchmarks", "results", run_.device.slug), date or run_.date[:10], run_.date)
    os.makedirs(dest, exist_ok=True)
    for path in glob.glob(os.path.join(out, "results", "*")):
        shutil.copy2(path, dest)
    evidence = [p for pattern in ("*.log", "progress.jsonl", "not-reached.txt", "failed-candidates.txt")
                for p in glob.glob(os.path.join(out, "stage*", pattern))]
    # The profile of the step and ncu's of the ops' kernels (scripts/gpu-loan.sh), and the sanitizers'
    # own output, where run (not ncu's binary report: its CSV pages hold what it measured).
    evidence += [p for pattern in ("*.txt", "*.log", "*.trace.json.gz")
                 for p in glob.glob(os.path.join(out, "profile", pattern))]
    evidence += [p for pattern in ("*.md", "*.csv", "*.json", "*.log") for where in ("ncu", os.path.join("ncu", "*"))
                 for p in glob.glob(os.path.join(out, where, pattern))]  # a set's own (attention-512-ncu.md)
    evidence += glob.glob(os.path.join(out, "sanitizers.out"))
    for path in evidence + [os.path.join(out, "summary.md"), summary_path]:
        name = os.path.basename(path)
        stage_dir = os.path.basename(os.path.dirname(path))
        named = name if stage_dir == os.path.basename(out) or name.startswith(stage_dir) else f"{stage_dir}-{name}"
        shutil.copy2(path, os.path.join(dest, named))
    update_readme(os.path.join(repo, "README.md"), filed_runs(repo))
    return dest


def _land_dir(device_dir: str, stamp: str, run_date: str) -> str:
    """device_dir/stamp, or stamp-2, stamp-3 ... when an earlier run of another time holds it (two
    loans on one day): a run is never filed over another."""
    for n in range(1, 100):
        dest = os.path.join(device_dir, stamp if n == 1 else f"{stamp}-{n}")
        try:
            filed = json.load(open(os.path.join(dest, "results.json"))).get("date")
        except (OSError, ValueError):
            return dest
        if filed == run_date:
            return dest
    raise ValueError(f"land: {device_dir} holds 99 runs dated {stamp}")


# --------------------------------------------------------------------------- command line
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bertfast gpu-check", description="The staged GPU check (plan, run, land).")
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("plan", help="print the stages with their commands and estimated minutes")
    pl.add_argument("--out", default="gpu-out", help="the output directory shown in the commands")
    r = sub.add_parser("run", help="run the stages (all, or --stage K)")
    r.add_argument("--out", required=True, help="directory for logs, results and caches")
    r.add_argument("--stage", type=int, action="append", help="stage number; repeat for several (default: all)")
    r.add_argument("--step", action="append", default=[], metavar="STEP",
                   help="run only this step of the chosen stages; repeat for several (the summary keeps the "
                        "other steps' earlier results)")
    r.add_argument("--skip", action="append", default=[], metavar="STEP",
                   help="run every step of the chosen stages but this one; repeat for several")
    r.add_argument("--until", type=float, default=None, metavar="EPOCH",
                   help="a deadline (Unix time): each step's limit is cut to the time left, and a step is not "
                        "started with under %d s left (scripts/gpu-loan.sh passes the loan's end)" % MIN_STEP_S)
    r.add_argument("--dry-run", action="store_true", help="on CPU: tiny shapes, labelled CPU")
    r.add_argument("--simulate", action="append", default=[], metavar="MODE:STEP|lost-machine",
                   help="dry run only: simulate a failure (fail:STEP, hang:STEP, crash:STEP; e.g. fail:build) or "
                        "a machine lost between stages (lost-machine); repeat for several")
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
        return run(args.out, numbers, args.dry_run, args.simulate, args.step, args.skip, args.until)
    try:
        dest = land(args.out, date=args.date)
    except (FileNotFoundError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"filed {args.out} under {dest} and regenerated the README's result table")
    return 0
