"""A pytest plugin that records each test's result as it finishes, and its reader.

For the GPU check's stage 2: a pytest stopped at its step's limit (SIGTERM, then SIGKILL) writes no
junit.xml, so this plugin appends one JSON line per event to ``--progress-file PATH``, flushed at once.
What a killed run leaves is then each finished test's result, the tests running when it stopped and
those never reached. Load it with ``-p bertfast.gpucheck.pytest_progress --progress-file PATH``;
without the option it does nothing. Works with and without pytest-xdist (only the controller writes).

Lines: ``{"event": "collected", "ids": [...]}``, ``{"event": "start", "id": ...}``,
``{"event": "result", "id": ..., "outcome": ..., "seconds": ..., "message": ...}``,
``{"event": "finished", "exitstatus": N}``. ``read_progress(path)`` reads them back.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import pytest

OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
MESSAGE_CHARS = 300


# --------------------------------------------------------------------------- the plugin
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--progress-file", default=None, metavar="PATH",
                     help="append each test's start and result to PATH as JSON lines, flushed as they happen")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("progress_file")
    # xdist workers load this plugin too; their reports reach the controller, which writes them.
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Recorder(path), "bertfast-progress-recorder")


def _message(report) -> str:
    """The first line of what a report says went wrong (or why it skipped), shortened."""
    longrepr = report.longrepr
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and crash.message:
        text = crash.message
    elif isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, reason)
        text = str(longrepr[2])
    else:
        text = str(longrepr or "")
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line[:MESSAGE_CHARS]


class _Recorder:
    def __init__(self, path: str) -> None:
        self.file = open(path, "w", encoding="utf-8")  # truncated: a rerun does not append to an old run
        self.collected = False
        self.pending: Dict[str, dict] = {}  # id -> outcome so far, seconds, message
        self.done: set = set()

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()  # a SIGKILL must not lose a completed line

    def write_collected(self, ids: List[str]) -> None:
        if not self.collected:
            self.collected = True
            self.write({"event": "collected", "ids": list(ids)})

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.write_collected([item.nodeid for item in session.items])

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids: List[str]) -> None:
        self.write_collected(ids)  # every worker collects the same ids; the first one's are written

    def pytest_runtest_logstart(self, nodeid: str, location) -> None:
        self.write({"event": "start", "id": nodeid})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        nodeid = report.nodeid
        if report.when not in ("setup", "call", "teardown"):
            # xdist's report for a test whose worker crashed (when "???"): no teardown report follows.
            if nodeid not in self.done:
                state = self.pending.pop(nodeid, {"seconds": 0.0})
                self.finish(nodeid, "failed", state["seconds"] + report.duration, _message(report))
            return
        state = self.pending.setdefault(nodeid, {"outcome": "passed", "seconds": 0.0, "message": ""})
        state["seconds"] += report.duration
        outcome = self.outcome(report)
        if outcome != "passed" and state["outcome"] in ("passed", "xpassed"):
            state["outcome"] = outcome
            state["message"] = _message(report) if outcome in ("failed", "error", "skipped") else ""
        elif outcome == "xpassed":
            state["outcome"] = outcome
        if report.when == "teardown":
            del self.pending[nodeid]
            self.finish(nodeid, state["outcome"], state["seconds"], state["message"])

    @staticmethod
    def outcome(report: pytest.TestReport) -> str:
        xfail = hasattr(report, "wasxfail")
        if report.failed:
            return "failed" if report.when == "call" else "error"
        if report.skipped:
            return "xfailed" if xfail else "skipped"
        return "xpassed" if xfail and report.when == "call" else "passed"

    def finish(self, nodeid: str, outcome: str, seconds: float, message: str) -> None:
        self.done.add(nodeid)
        record = {"event": "result", "id": nodeid, "outcome": outcome, "seconds": round(seconds, 3)}
        if message:
            record["message"] = message
        self.write(record)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus) -> None:
        self.write({"event": "finished", "exitstatus": int(exitstatus)})

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.file.close()


# --------------------------------------------------------------------------- the reader
@dataclass
class Progress:
    collected: Optional[List[str]] = None  # None: collection never finished
    results: Dict[str, str] = field(default_factory=dict)  # id -> outcome
    messages: Dict[str, str] = field(default_factory=dict)
    seconds: Dict[str, float] = field(default_factory=dict)
    running: List[str] = field(default_factory=list)  # started, no result: running when the process stopped
    not_reached: List[str] = field(default_factory=list)  # collected, never started (collection order)
    finished: bool = False
    exitstatus: Optional[int] = None

    @property
    def counts(self) -> Dict[str, int]:
        counts = {o: 0 for o in OUTCOMES}
        for outcome in self.results.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        return {o: n for o, n in counts.items() if n}

    def summary_line(self) -> str:
        """One line for a report table: the counts, and for a stopped run what was running and not reached."""
        counts = ", ".join(f"{n} {o}" for o, n in self.counts.items())
        if self.finished:
            line = counts or "no test ran"
            return line if self.exitstatus in (0, 1, 5, None) else f"{line} (exit status {self.exitstatus})"
        if self.collected is None and not self.results:
            head = "stopped before collection finished: no test ran"
        elif self.collected is None:
            head = f"stopped before collection finished: {counts}"
        else:
            head = f"stopped before the end: {counts or 'no test finished'}"
        parts = [head]
        if self.running:
            parts.append("running: " + ", ".join(self.running))
        if self.not_reached:
            parts.append(f"{len(self.not_reached)} of {len(self.collected or [])} not reached")
        return "; ".join(parts)


def read_progress(path: str) -> Progress:
    """What a progress file says; a missing file is an empty Progress, a line cut short by a kill is skipped."""
    progress = Progress()
    started: List[str] = []
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except FileNotFoundError:
        return progress
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        event = record.get("event")
        if event == "collected" and progress.collected is None:
            progress.collected = list(record.get("ids", []))
        elif event == "start":
            started.append(record["id"])
        elif event == "result":
            progress.results[record["id"]] = record["outcome"]
            progress.seconds[record["id"]] = record.get("seconds", 0.0)
            if record.get("message"):
                progress.messages[record["id"]] = record["message"]
        elif event == "finished":
            progress.finished = True
            progress.exitstatus = record.get("exitstatus")
    seen = set(started)
    progress.running = list(dict.fromkeys(i for i in started if i not in progress.results))
    progress.not_reached = [i for i in progress.collected or [] if i not in seen and i not in progress.results]
    return progress
