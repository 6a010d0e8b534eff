"""Stage 2's tests that compile the same Triton kernels, sent to one pytest-xdist worker.

Stage 2 runs every test on 16 workers that share Triton's disk cache, each autotuned kernel at its
first config. A worker that meets a kernel variant before the cache has it compiles it, so tests of one
variant spread over several workers compile it several times at once. The attention's awkward-length
tests at every head dim are the costly case: four or five data cases (masks, lengths: the last
parameter) of each compiled variant. The H200 run of 2026-11-27-3 spent 1,719 of its 6,148
test-seconds on their Triton cases; priced as if grouped (below), the same durations give 1,037.

``group(nodeid)`` names a test's group, or None: those tests' Triton cases, their last parameter
dropped (``test_gpu_padded_awkward_length_every_head_dim:triton-fp32-256``). Loaded as a pytest plugin
(``-p bertfast.gpucheck.compile_groups``, stage 2's pytest), this module gives xdist a scheduler that
sends each group to one worker as a unit and every other test alone (xdist's own ``--dist loadgroup``
reads marks it renames the test ids by, which pytest 9.2 no longer lets it do). Sizing prices a GPU
run's recorded durations by the same rule (``grouped_seconds``).
"""
from __future__ import annotations

from typing import Dict, Optional

import pytest

# Test functions whose last parameter is data only (a mask, a set of lengths) for the kernels compiled
FAMILIES = ("test_gpu_varlen_awkward_length_every_head_dim", "test_gpu_padded_awkward_length_every_head_dim")
COMPILING_BACKENDS = ("triton",)  # the CUDA kernels are compiled once by the build, torch's need nothing


def group(nodeid: str) -> Optional[str]:
    """The group of a test id, or None when it has none."""
    name, _, params = nodeid.partition("::")[2].partition("[")
    parts = params.rstrip("]").split("-")
    if name not in FAMILIES or len(parts) < 2 or parts[0] not in COMPILING_BACKENDS:
        return None
    return f"{name}:{'-'.join(parts[:-1])}"


def grouped_seconds(durations: Dict[str, float]) -> float:
    """The test-seconds these tests (id -> seconds, as a GPU run recorded them) would take grouped: a
    group costs its slowest test (its compiles and its own work) and its fastest once for each other
    test (the work alone, the kernels cached); a test in no group costs what it took."""
    groups: Dict[str, list] = {}
    total = 0.0
    for nodeid, seconds in durations.items():
        name = group(nodeid)
        if name is None:
            total += seconds
        else:
            groups.setdefault(name, []).append(seconds)
    for times in groups.values():
        total += max(times) + (len(times) - 1) * min(times)
    return total


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n``: xdist's scope scheduling (a scope's tests go to one worker together, the largest
    scopes first) with each group a scope and every other test a scope of its own."""
    from xdist.scheduler import LoadScopeScheduling

    class CompileGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group(nodeid) or nodeid

    return CompileGroupScheduling(config, log)
