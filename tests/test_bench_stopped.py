"""A bench run that is stopped keeps what it measured: results.json after every case (partial), and on
SIGTERM or Ctrl-C the full report with the cases not run as skipped rows (the GPU check stops a bench
that overruns its limit with SIGTERM, then SIGKILL)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bertfast.bench import cli, report
from bertfast.bench.common import Stopped
from bertfast.bench.results import OK, SKIPPED, TORCH_EAGER, Run

# The bench with its second kernel case overrunning (as a long autotune would): it times nothing until
# a signal ends it, inside the suite's `except Exception` blocks.
OVERRUNNING = """
import sys, time
from bertfast.bench import cli, kernels_suite as K
cases, run_case, time_fn = [], K.run_case, K.time_fn
def counting_run_case(ctx, oc):
    cases.append(oc)
    return run_case(ctx, oc)
def overrunning_time_fn(*args, **kwargs):
    if len(cases) == 2:
        print("second case started", flush=True)
        while True:
            time.sleep(0.05)
    return time_fn(*args, **kwargs)
K.run_case, K.time_fn = counting_run_case, overrunning_time_fn
sys.exit(cli.main(sys.argv[1:]))
"""
# attention has three CPU cases: the first is timed, the second overruns, the third is not reached.
ARGS = ["--suite", "kernels", "--device", "cpu", "--quick", "--ops", "attention", "--backends", "torch",
        "--impls", "bertfast,eager", "--reps", "1"]
DEADLINE_S = 120  # start-up and the first case on a loaded CPU; a passing run takes a few seconds


def _start(out) -> subprocess.Popen:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    log = open(out.parent / "log.txt", "w")
    return subprocess.Popen([sys.executable, "-c", OVERRUNNING, *ARGS, "--out", str(out)], stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_for_second_case(proc: subprocess.Popen, out) -> str:
    deadline = time.monotonic() + DEADLINE_S
    log = out.parent / "log.txt"
    while "second case started" not in log.read_text():
        assert proc.poll() is None, f"the bench ended before its second case:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no second case after {DEADLINE_S} s:\n{log.read_text()}"
        time.sleep(0.1)
    return log.read_text()


def _by_case(rows):
    """[(attention case's padding, dropout), rows] in the suite's order."""
    out = []
    for r in rows:
        key = (r.case["padding"], r.case["dropout"])
        if not out or out[-1][0] != key:
            out.append((key, []))
        out[-1][1].append(r)
    return out


def test_sigterm_mid_suite_writes_the_report_with_the_finished_case_and_the_rest_skipped(tmp_path):
    out = tmp_path / "run"
    proc = _start(out)
    try:
        _wait_for_second_case(proc, out)
        partial = report.load(str(out / "results.json"))  # saved when the first case ended
        assert partial.config["partial"] is True and "stopped" not in partial.config
        first = partial.rows
        assert first and all(r.ok and r.case["dropout"] == 0.0 and r.case["padding"] == "none" for r in first)

        signalled = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        rc = proc.wait(60)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    printed = (tmp_path / "log.txt").read_text()
    assert rc == 128 + signal.SIGTERM, printed
    assert took < 30, f"the bench took {took:.1f} s to stop"
    assert "stopped by SIGTERM" in printed and "targets (" in printed and "wrote markdown" in printed

    data = json.load(open(out / "results.json"))
    run = Run.from_dict(data)
    assert run.config["stopped"] == "SIGTERM" and "partial" not in run.config
    assert any("the bench was stopped (SIGTERM)" in n for n in run.notes)
    cases = _by_case(run.rows)
    assert [key for key, _ in cases] == [("none", 0.0), ("none", 0.1), ("finetune", 0.0)]
    (_, done), (_, running), (_, rest) = cases
    assert [r.to_dict() for r in done] == [r.to_dict() for r in first]  # the finished case, as measured
    expected = {(r.impl, r.direction) for r in done}
    assert {(r.impl, r.direction) for r in running} == expected == {(r.impl, r.direction) for r in rest}
    assert all(r.status == SKIPPED and r.reason == "not finished: the bench was stopped (SIGTERM) while this case ran"
               for r in running)
    assert all(r.status == SKIPPED and r.reason == "not run: the bench was stopped (SIGTERM) before this case"
               for r in rest)
    md = (out / "results.md").read_text()
    assert '"stopped": "SIGTERM"' in md and "while this case ran" in md
    assert (out / "kernels_speedup.png").stat().st_size > 0


def test_sigkill_leaves_a_partial_results_json_that_merges(tmp_path):
    from bertfast.bench.merge import main as merge_main
    out = tmp_path / "run"
    proc = _start(out)
    try:
        _wait_for_second_case(proc, out)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)
    assert proc.returncode == -signal.SIGKILL
    run = report.load(str(out / "results.json"))
    assert run.config["partial"] is True and run.config["elapsed_s"] > 0 and "stopped" not in run.config
    assert len(run.rows) == 9 and all(r.ok and (r.case["padding"], r.case["dropout"]) == ("none", 0.0)
                                      for r in run.rows)
    assert {r.impl for r in run.rows} == {"bertfast:torch varlen", "bertfast:torch padded", TORCH_EAGER}
    assert not (out / "results.md").exists()  # no markdown or plots per case
    assert merge_main(["--out", str(tmp_path / "merged"), str(out)]) == 0
    merged = report.load(str(tmp_path / "merged" / "results.json"))
    assert [r.to_dict() for r in merged.rows] == [r.to_dict() for r in run.rows]
    assert merged.config["parts"][0]["partial"] is True


@pytest.fixture
def quick_overhead(monkeypatch):
    from bertfast.bench import overhead_suite as OH
    monkeypatch.setattr(OH, "_timing_counts", lambda ctx: (1, 5, 3))  # warm-up, calls, samples
    return OH


def test_an_uninterrupted_run_saves_after_each_case_and_is_complete_at_the_end(tmp_path, monkeypatch,
                                                                                quick_overhead):
    saved = []
    real = report.write_json

    def spy(run, out_dir):
        saved.append((dict(run.config), [(r.group, r.status) for r in run.rows]))
        return real(run, out_dir)
    monkeypatch.setattr(report, "write_json", spy)
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    out = tmp_path / "run"
    assert cli.main(["--suite", "overhead", "--device", "cpu", "--ops", "bias_gelu,embeddings", "--out", str(out)]) == 0
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers  # restored

    # One save per case (7 rows each), marked partial, then the final one, not.
    assert [len(rows) for _, rows in saved] == [7, 14, 14]
    assert [config.get("partial") for config, _ in saved] == [True, True, None]
    assert {g for g, _ in saved[0][1]} == {"embeddings"} and saved[1][1][:7] == saved[0][1]  # the registry's order
    data = json.load(open(out / "results.json"))
    assert "partial" not in data["config"] and "stopped" not in data["config"]
    assert len(data["rows"]) == 14 and all(r["status"] == OK for r in data["rows"])
    assert not (out / "results.json.tmp").exists()


def test_ctrl_c_stops_the_run_with_exit_130_and_the_case_cut_short_skipped(tmp_path, monkeypatch, quick_overhead):
    OH = quick_overhead
    real = OH._check

    def interrupted(oc, dtype):  # inside run_case's `except Exception` block
        if oc.op == "attention":
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(200):
                time.sleep(0.05)
            pytest.fail("SIGINT did not stop the bench")
        return real(oc, dtype)
    monkeypatch.setattr(OH, "_check", interrupted)
    out = tmp_path / "run"
    before = signal.getsignal(signal.SIGINT)  # Python's default_int_handler, or SIG_IGN under nohup / `&`
    assert cli.main(["--suite", "overhead", "--device", "cpu", "--ops", "bias_gelu,embeddings,attention",
                     "--out", str(out)]) == 128 + signal.SIGINT
    assert signal.getsignal(signal.SIGINT) == before  # restored
    run = report.load(str(out / "results.json"))
    assert run.config["stopped"] == "SIGINT"
    done = [r for r in run.rows if r.group == "embeddings"]  # the registry's order: embeddings, attention, ...
    cut = [r for r in run.rows if r.group == "attention"]
    assert len(done) == 7 and all(r.ok for r in done)
    assert len(cut) == 7 and all(r.status == SKIPPED and "stopped (SIGINT) while this case ran" in r.reason
                                 for r in cut)
    assert {r.impl for r in cut} == {"bertfast:?", TORCH_EAGER, "bertfast:? custom op"}
    assert len(run.rows) == 14  # bias_gelu: not started, and the overhead suite lists no case it did not reach


def test_the_model_suite_keeps_its_finished_cases_when_stopped(monkeypatch):
    from bertfast.bench import device as devmod, model_suite
    from bertfast.bench.common import SuiteContext
    from bertfast.bench.timing import TimingPolicy
    import torch

    calls = []
    real = model_suite.parity_fast

    def stopped_on_second(model, batch):
        calls.append(1)
        if len(calls) == 2:
            raise Stopped(signal.SIGTERM)  # what the handler raises, here inside _bench's `except Exception`
        return real(model, batch)
    monkeypatch.setattr(model_suite, "parity_fast", stopped_on_second)
    saves = []
    ctx = SuiteContext(device=devmod.detect("cpu"), quick=True, dtype=torch.float32, backends=("torch",),
                       compile=False, with_transformers=False, models=("inference",), impls=("bertfast",),
                       step_policy=TimingPolicy(cpu_warmup=0, cpu_reps=1), log=lambda s: None,
                       on_record=lambda rows: saves.append(len(rows)))
    with pytest.raises(Stopped):
        model_suite.run(ctx)
    assert [(r.case["batch"], r.status) for r in ctx.rows] == [(1, OK), (8, SKIPPED)]
    assert ctx.rows[1].reason == "not finished: the bench was stopped (SIGTERM) while this case ran"
    assert saves == [1, 2]
