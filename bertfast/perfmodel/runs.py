"""The committed GPU runs the performance model is set beside (benchmarks/results/<gpu>/<date>/): a run's
profile of the pre-training step, which run is the newest, the GPU it ran on, its results.json, and
whether a kernel's source changed since the commit that added the run (then it measured other code).
`bertfast perf-model` (report.py) reads them.
"""
from __future__ import annotations

import ast
import functools
import glob
import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

from bertfast.perfmodel import kernels as K
from bertfast.perfmodel.hardware import Gpu, device_gpu


@dataclass
class Profile:
    """A committed GPU run's profile of the pre-training step (bertfast/bench/profile.py's
    graphs.txt or bertfast.txt): its case, its device, and each kernel's device time per step and calls."""

    path: str
    setting: K.Setting
    device: str
    kernels: Dict[str, Tuple[float, int]]  # name -> (ms per step, calls per step)
    # kernel -> tuning key -> the config its autotuner chose (profiles since 2026-11-27; older ones: {})
    tuned: Dict[str, Dict[Tuple, str]] = field(default_factory=dict)

    @property
    def graphed(self) -> bool:
        """A profile of ``bertfast pretrain --cuda-graphs``'s step (the profile's graphs.txt): the step
        the budget predicts. Else the drop-in eager step (bertfast.txt), whose optimizer is torch's
        fused AdamW, without working copies, and which does not clip."""
        return os.path.basename(self.path).endswith("graphs.txt")

    @property
    def trace(self) -> str:
        """Where the same profile's chrome trace is (it may be absent)."""
        return self.path[:-len(".txt")] + ".trace.json.gz"


def read_profile(path: str) -> Optional[Profile]:
    """The profile at ``path``, or None when it is not one (its first line reads "<model> seq S
    batch B, <dtype> on <device>"; the kernel table, "ms/step share calls kernel")."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    head = re.match(r"(\S+) seq (\d+) batch (\d+), (\w+) on (.+)$", lines[0]) if lines else None
    if head is None or head.group(4) != "bf16":
        return None
    kernels: Dict[str, Tuple[float, int]] = {}
    tuned: Dict[str, Dict[Tuple, str]] = {}
    for line in lines:
        m = re.match(r"\s*([\d.]+)\s+[\d.]+%\s+(\d+)\s+(\S+)", line)
        if m:
            kernels[m.group(3)] = (float(m.group(1)), int(m.group(2)))
        t = re.match(r"\s+(\w+) \| (\[.*\]) \| (.+)$", line)  # bertfast/bench/profile.py tuned_report
        if t:
            tuned.setdefault(t.group(1), {})[tuple(json.loads(t.group(2)))] = t.group(3).strip()
    # the model suite's step: BERT's dropout 0.1
    setting = K.Setting(head.group(1), int(head.group(2)), int(head.group(3)), 0.1)
    return Profile(path, setting, head.group(5).strip(), kernels, tuned)


RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks",
                       "results")


def run_date(run_dir: str) -> str:
    """When a committed run (benchmarks/results/<gpu>/<date>/) was measured: its results.json's
    timestamp, else its folder's name. Folder names alone do not order two GPUs' runs of one day."""
    try:
        with open(os.path.join(run_dir, "results.json"), encoding="utf-8") as f:
            return str(json.load(f).get("date") or os.path.basename(run_dir))
    except (OSError, ValueError):
        return os.path.basename(run_dir)


# A run's profiles of bertfast's step, the preferred first: pretrain's graphed step is the budget's.
PROFILE_FILES = ("profile-graphs.txt", "profile-bertfast.txt")


def latest_profile(root: str = RESULTS) -> Optional[Profile]:
    """The newest committed GPU run (benchmarks/results/<gpu>/<date>/) with a profile of bertfast's
    step: of its graphed step where the run has one (PROFILE_FILES), else of its eager step."""
    runs: Dict[str, Profile] = {}
    for name in reversed(PROFILE_FILES):  # the preferred file read last replaces the other
        for path in glob.glob(os.path.join(root, "*", "*", name)):
            profile = read_profile(path)
            if profile is not None and profile.setting.model in ("bert-base", "bert-large"):
                runs[os.path.dirname(path)] = profile
    return max(runs.values(), key=lambda p: run_date(os.path.dirname(p.path))) if runs else None


def run_gpu(profile: Profile) -> Gpu:
    """The profiled GPU's constants, with the copy bandwidth its run measured when results.json has it."""
    device = run_results(os.path.dirname(profile.path)).get("device") or {}
    return device_gpu(dict(device, name=profile.device))


REPO = os.path.dirname(os.path.dirname(RESULTS))


def _git(repo: str, *args: str) -> Optional[str]:
    try:
        res = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout if res.returncode == 0 else None


@functools.lru_cache(maxsize=None)
def _adding_commit(profile_path: str, repo: str) -> Optional[str]:
    """The commit that added the profile (asked once per profile, not per kernel row)."""
    added = _git(repo, "log", "--diff-filter=A", "--format=%H", "--", os.path.relpath(profile_path, repo))
    return added.split()[-1] if added and added.split() else None


def _function_sources(text: str, name: str) -> Optional[Dict[str, str]]:
    """The source (decorators included) of the module-level function ``name`` in ``text`` and of every
    module-level function it names, transitively (the @triton.jit helpers a kernel calls); None when
    the text does not parse or has no such function."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    defs = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    if name not in defs:
        return None
    lines, out, todo = text.splitlines(), {}, [name]
    while todo:
        fn = todo.pop()
        if fn in out:
            continue
        node = defs[fn]
        start = min([d.lineno for d in node.decorator_list] + [node.lineno])
        out[fn] = "\n".join(lines[start - 1:node.end_lineno])
        todo += [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in defs]
    return out


def changed_since(profile_path: str, sources: Sequence[str], repo: str = REPO,
                  kernel: Optional[str] = None) -> Optional[bool]:
    """Whether any of ``sources`` (paths in the repository) changed after the commit that added the
    profile, committed or not: then the profile measured other code. With ``kernel``, the first source
    is its own file, and only the kernel's function and the functions of that file it calls count
    (code added beside it, another kernel's edits, do not). None outside a git checkout."""
    added = _adding_commit(profile_path, repo)
    if added is None:
        return None
    if kernel is not None and sources:
        own, sources = sources[0], list(sources[1:])
        then = _git(repo, "show", f"{added}:{own}")
        try:
            with open(os.path.join(repo, own), encoding="utf-8") as f:
                now = f.read()
        except OSError:
            now = None
        before = _function_sources(then, kernel) if then is not None else None
        after = _function_sources(now, kernel) if now is not None else None
        if before is None or after is None:
            sources = [own, *sources]  # not readable as Python: the whole file counts
        elif before != after:
            return True
        if not sources:
            return False
    since = _git(repo, "log", "--format=%H", f"{added}..HEAD", "--", *sources)
    local = _git(repo, "status", "--porcelain", "--", *sources)
    if since is None or local is None:
        return None
    return bool(since.strip() or local.strip())


@functools.lru_cache(maxsize=None)
def run_results(run_dir: str) -> Dict[str, object]:
    """A committed run's results.json ({} when it has none or cannot be read), read once (its GPU's
    copy bandwidth and the profiled step's tokens come from it)."""
    try:
        with open(os.path.join(run_dir, "results.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def profiled_tokens(profile: Profile) -> Optional[int]:
    """The real tokens of the profiled step (the model suite's pretrain_step case of the same run: a
    micro-batch's, on average, where its step accumulates several; the profile steps on one), or None
    when the run does not say."""
    for row in run_results(os.path.dirname(profile.path)).get("rows") or []:
        case = row.get("case") or {}
        if (row.get("group") == "pretrain_step" and case.get("model") == profile.setting.model
                and case.get("seqlen") == profile.setting.seq and case.get("batch") == profile.setting.batch
                and case.get("real_tokens")):
            return int(round(case["real_tokens"] / case.get("micro_batches", 1)))
    return None
