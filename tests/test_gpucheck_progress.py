"""The pytest progress plugin of the GPU check's stage 2: each test's result is on disk as it finishes,
so a pytest stopped at its limit (or with a crashed xdist worker) still says what ran and what did not.

Each test runs pytest in a subprocess on a small module written to tmp_path, with an empty ini file
there, so neither the project's pytest configuration nor its conftest (torch) is used.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from bertfast.gpucheck.pytest_progress import Progress, read_progress
from bertfast.gpucheck.runner import run_step
from bertfast.gpucheck.stages import Step

MIXED = '''
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_pass_1():
    pass

def test_pass_2():
    pass

def test_fail():
    assert 1 == 2, "one is not two"

def test_error(broken):
    pass

def test_skip():
    pytest.skip("not on this machine")

@pytest.mark.xfail(reason="known bug")
def test_xfail():
    assert False

@pytest.mark.xfail(reason="known bug")
def test_xpass():
    pass
'''

HANG = '''
import time

def test_a():
    pass

def test_b():
    pass

def test_hang():
    time.sleep(600)

def test_c():
    pass

def test_d():
    pass
'''

CRASH = '''
import os
import signal

def test_before():
    pass

def test_segfault():
    os.kill(os.getpid(), signal.SIGSEGV)

def test_after_1():
    pass

def test_after_2():
    pass
'''


def _argv(tmp_path, source: str, *extra: str):
    """The pytest command line for source as tmp_path/test_mod.py; returns it and the progress file."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_mod.py").write_text(textwrap.dedent(source))
    progress = str(tmp_path / "progress.jsonl")
    argv = [sys.executable, "-m", "pytest", str(tmp_path / "test_mod.py"), "-q", "-p", "no:cacheprovider",
            "-p", "bertfast.gpucheck.pytest_progress", "--progress-file", progress,
            "--rootdir", str(tmp_path), "-c", str(tmp_path / "pytest.ini"), *extra]
    return argv, progress


def _ids(*names: str):
    return [f"test_mod.py::{n}" for n in names]


def _events(path: str):
    return [json.loads(line)["event"] for line in open(path)]


def test_finished_run_records_every_outcome_and_message(tmp_path):
    argv, path = _argv(tmp_path, MIXED)
    open(path, "w").write('{"event": "result", "id": "old::test", "outcome": "passed"}\n')  # a previous run
    res = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr
    p = read_progress(path)
    names = ["test_pass_1", "test_pass_2", "test_fail", "test_error", "test_skip", "test_xfail", "test_xpass"]
    assert p.collected == _ids(*names)
    assert p.results == dict(zip(_ids(*names), ["passed", "passed", "failed", "error", "skipped", "xfailed",
                                                  "xpassed"]))
    assert p.counts == {"passed": 2, "failed": 1, "error": 1, "skipped": 1, "xfailed": 1, "xpassed": 1}
    fail, error, skip = _ids("test_fail", "test_error", "test_skip")
    assert p.messages == {fail: "AssertionError: one is not two", error: "RuntimeError: fixture broke",
                          skip: "Skipped: not on this machine"}
    assert p.finished and p.exitstatus == 1 and p.running == [] and p.not_reached == []
    assert p.summary_line() == "2 passed, 1 failed, 1 error, 1 skipped, 1 xfailed, 1 xpassed"
    assert _events(path).count("result") == len(names)  # truncated at the start, one result per test


def test_run_stopped_at_its_limit_names_the_hanging_test_and_those_not_reached(tmp_path):
    argv, path = _argv(tmp_path, HANG)
    record = run_step(Step("pytest", argv, 6), argv, dict(os.environ), str(tmp_path / "pytest.log"), 6)
    assert record["status"] == "timed out"
    p = read_progress(path)
    assert p.collected == _ids("test_a", "test_b", "test_hang", "test_c", "test_d")
    assert p.results == dict.fromkeys(_ids("test_a", "test_b"), "passed")
    assert p.running == _ids("test_hang")
    assert p.not_reached == _ids("test_c", "test_d")
    assert not p.finished and p.exitstatus is None
    assert p.summary_line() == ("stopped before the end: 2 passed; running: test_mod.py::test_hang; "
                                "2 of 5 not reached")


def test_run_stopped_at_its_limit_under_xdist(tmp_path):
    pytest.importorskip("xdist")
    argv, path = _argv(tmp_path, HANG, "-n", "2")
    record = run_step(Step("pytest", argv, 10), argv, dict(os.environ), str(tmp_path / "pytest.log"), 10)
    assert record["status"] == "timed out"
    assert _events(path).count("collected") == 1  # both workers collect; the list is written once
    p = read_progress(path)
    assert p.collected == _ids("test_a", "test_b", "test_hang", "test_c", "test_d")
    assert p.running == _ids("test_hang")
    assert p.results and set(p.results.values()) == {"passed"}  # the other worker's tests finished
    assert sorted(list(p.results) + p.running + p.not_reached) == sorted(p.collected)
    assert not p.finished
    assert p.summary_line().startswith(f"stopped before the end: {len(p.results)} passed; "
                                       "running: test_mod.py::test_hang")


def test_crashed_xdist_worker_fails_its_test_and_the_others_still_report(tmp_path):
    pytest.importorskip("xdist")
    argv, path = _argv(tmp_path, CRASH, "-n", "2")
    res = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr
    p = read_progress(path)
    segfault = "test_mod.py::test_segfault"
    assert p.results == {**dict.fromkeys(_ids("test_before", "test_after_1", "test_after_2"), "passed"),
                         segfault: "failed"}
    assert "crashed while running" in p.messages[segfault]
    assert _events(path).count("result") == 4  # the crashed test's result is written once
    assert p.finished and p.running == [] and p.not_reached == []
    assert p.summary_line() == "3 passed, 1 failed"


def test_reader_tolerates_a_cut_last_line_and_a_missing_file(tmp_path):
    path = tmp_path / "progress.jsonl"
    lines = [{"event": "collected", "ids": ["t::a", "t::b", "t::c"]}, {"event": "start", "id": "t::a"},
             {"event": "result", "id": "t::a", "outcome": "failed", "seconds": 0.1, "message": "boom"},
             {"event": "start", "id": "t::b"}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"event": "result", "id": "t::b", "outc')
    p = read_progress(str(path))
    assert p.results == {"t::a": "failed"} and p.messages == {"t::a": "boom"}
    assert p.running == ["t::b"] and p.not_reached == ["t::c"] and not p.finished
    assert p.summary_line() == "stopped before the end: 1 failed; running: t::b; 1 of 3 not reached"

    empty = read_progress(str(tmp_path / "absent.jsonl"))
    assert empty == Progress() and empty.collected is None and not empty.finished and empty.counts == {}
    assert empty.summary_line() == "stopped before collection finished: no test ran"
