"""Failures the CPU dry run can simulate, to show what the GPU check does when a step goes wrong.

    --simulate fail:STEP     STEP exits 1 with an error line (fail:build: the extension does not build)
    --simulate hang:STEP     STEP prints a line and hangs: it is stopped at a short limit
    --simulate crash:STEP    STEP dies of SIGSEGV
    --simulate lost-machine  every stage starts on a fresh machine: only GPU_OUT is kept

A simulated step runs a stand-in command in place of its own. For stage 2's pytest the stand-in
is pytest itself over a generated module (two tests pass, then the one that fails, hangs or
crashes, then two that are never reached), with the same progress file and junit.xml as the real
step, so the summary reads the same evidence a GPU run would leave.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List, Sequence, Tuple

MODES = ("fail", "hang", "crash")
LOST_MACHINE = "lost-machine"
HANG_LIMIT_S = 5           # a simulated hang is stopped here instead of at the step's limit
PYTEST_HANG_LIMIT_S = 20   # pytest needs a few seconds to start before its tests hang

_BODY = {
    "fail": "print('{step}: error: simulated failure (--simulate fail:{step})', flush=True)\nraise SystemExit(1)",
    "hang": "import time\nprint('{step}: simulated hang (--simulate hang:{step})', flush=True)\ntime.sleep(3600)",
    "crash": "import os, signal\nprint('{step}: simulated crash (--simulate crash:{step})', flush=True)\n"
             "os.kill(os.getpid(), signal.SIGSEGV)",
}
_TEST = {
    "fail": "def test_fails():\n    assert 1 + 1 == 3, 'simulated failure'\n",
    "hang": "def test_hangs():\n    import time\n    time.sleep(3600)\n",
    "crash": "def test_crashes():\n    import os, signal\n    os.kill(os.getpid(), signal.SIGSEGV)\n",
}


def parse(values: Sequence[str], step_names: Sequence[str]) -> Tuple[Dict[str, str], bool]:
    """(step -> mode, lost machine?) from --simulate values; a clear ValueError for anything else."""
    modes: Dict[str, str] = {}
    lost = False
    for value in values:
        if value == LOST_MACHINE:
            lost = True
            continue
        mode, sep, step = value.partition(":")
        if not sep or mode not in MODES or step not in step_names:
            raise ValueError(f"--simulate: expected {LOST_MACHINE} or MODE:STEP with MODE one of {', '.join(MODES)} "
                             f"and STEP one of {', '.join(step_names)}; got {value!r}")
        modes[step] = mode
    return modes, lost


def stand_in(step: str, mode: str, out: str, pytest_argv: List[str], limit_s: int) -> Tuple[List[str], int]:
    """(argv, limit) of the command that simulates ``mode`` for ``step``, whose limit is limit_s (a hang is
    stopped sooner). pytest_argv: the real step's argv for pytest (its progress and junit options are kept)."""
    limit = HANG_LIMIT_S if mode == "hang" else limit_s
    if step != "pytest":
        return [sys.executable, "-c", _BODY[mode].format(step=step)], limit
    folder = os.path.join(out, "simulate")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "pytest.ini"), "w") as fh:
        fh.write("[pytest]\n")
    tests = [f"def test_{name}():\n    assert True\n" for name in ("passes_1", "passes_2")] + [_TEST[mode]] \
        + [f"def test_{name}():\n    assert True\n" for name in ("after_1", "after_2")]
    with open(os.path.join(folder, "test_simulated.py"), "w") as fh:
        fh.write(f'"""Stand-in for stage 2 (--simulate {mode}:pytest)."""\n\n\n' + "\n\n".join(tests))
    keep = []
    for flag in ("--progress-file", "--junitxml"):
        if flag in pytest_argv:
            i = pytest_argv.index(flag)
            keep += pytest_argv[i:i + 2]
    argv = [sys.executable, "-m", "pytest", os.path.join(folder, "test_simulated.py"), "-p", "no:cacheprovider",
            "-p", "bertfast.gpucheck.pytest_progress", "--rootdir", folder, "-c", os.path.join(folder, "pytest.ini"),
            "-q", *keep]
    return argv, PYTEST_HANG_LIMIT_S if mode == "hang" else limit
