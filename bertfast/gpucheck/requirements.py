"""Every requirement of bertfast and of the GPU check, with the version found here.

``pip install --no-deps`` (how the GPU machine installs bertfast: it has no network) checks
nothing, so stage 1 runs this right after the install: each runtime requirement (bertfast's
install_requires, read from its installed metadata), each package of the ``test`` extra
(stage 2's tests, pytest-xdist among them; a test whose package is missing skips) and the CUDA
tools the check runs. Exit status 1 when a runtime requirement is missing or too old: the summary then
says which before any GPU minute goes to tests.

    python -m bertfast.gpucheck.requirements
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import List, Optional

from packaging.requirements import Requirement

EXTRA = "test"
# Run by the check itself, beyond bertfast's metadata: the tools and the parallel test runner.
TOOLS = (("nvcc", "builds the CUDA extension (stage 1)"),
         ("compute-sanitizer", "memcheck and racecheck (stage 1)"))


@dataclass
class Found:
    kind: str                 # "runtime" | "test" | "tool"
    name: str                 # the requirement as written, e.g. "transformers>=5.17"
    version: Optional[str]    # what is installed (a tool: its path and release); None when missing
    ok: bool
    note: str = ""

    @property
    def line(self) -> str:
        state = "ok" if self.ok else ("MISSING" if self.version is None else "TOO OLD")
        found = self.version or "not installed"
        return f"  {state:8s} {self.name:32s} {found}" + (f"  ({self.note})" if self.note else "")


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bertfast_requires() -> List[str]:
    """bertfast's requirements as pip installed them last. A bertfast.egg-info in the source tree (on
    sys.path when run from there) may predate a later install, so the installed metadata comes first."""
    elsewhere = [p for p in sys.path if os.path.realpath(p or os.curdir) != os.path.realpath(REPO)]
    dist = next(iter(md.distributions(name="bertfast", path=elsewhere)), None) or md.distribution("bertfast")
    return dist.requires or []


def _installed(name: str) -> Optional[str]:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def check_requirement(text: str, kind: str) -> Found:
    req = Requirement(text)
    version = _installed(req.name)
    ok = version is not None and (not req.specifier or req.specifier.contains(version, prereleases=True))
    return Found(kind, f"{req.name}{req.specifier}", version, ok)


def _tool(name: str, why: str) -> Found:
    path = shutil.which(name)
    if path is None:
        return Found("tool", name, None, False, why)
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    release = re.search(r"release (\S+?),|Version (\S+)", out)
    version = next((g for g in release.groups() if g), "") if release else ""
    return Found("tool", name, f"{path}" + (f" ({version})" if version else ""), True, why)


def check() -> List[Found]:
    """Every requirement with what is installed; raises PackageNotFoundError without bertfast's metadata."""
    found = []
    for text in _bertfast_requires():
        req = Requirement(text)
        if req.marker is None:
            found.append(check_requirement(text, "runtime"))
        elif req.marker.evaluate({"extra": EXTRA}):
            found.append(check_requirement(text.split(";")[0], "test"))
    found += [_tool(name, why) for name, why in TOOLS]
    return found


def report(found: List[Found]) -> str:
    titles = {"runtime": "runtime requirements (bertfast's install_requires)",
              "test": f"the {EXTRA!r} extra (stage 2: a test that needs a missing package skips)",
              "tool": "CUDA tools"}
    lines = []
    for kind, title in titles.items():
        group = [f for f in found if f.kind == kind]
        if group:
            lines.append(title + ":")
            lines += [f.line for f in group]
    return "\n".join(lines)


def verdict(found: List[Found]) -> str:
    """One line for the summary: what is missing, runtime first."""
    bad = [f for f in found if f.kind == "runtime" and not f.ok]
    optional = [f.name for f in found if f.kind != "runtime" and not f.ok]
    runtime = len([f for f in found if f.kind == "runtime"])
    if bad:
        text = "MISSING: " + ", ".join(f"{f.name} (found {f.version or 'nothing'})" for f in bad)
    else:
        text = f"all {runtime} runtime requirements met"
    if optional:
        text += f"; not here: {', '.join(optional)}"
    return text


def main(argv: Optional[List[str]] = None) -> int:
    argparse.ArgumentParser(prog="python -m bertfast.gpucheck.requirements",
                            description=__doc__.split("\n")[0]).parse_args(argv)
    try:
        found = check()
    except md.PackageNotFoundError:
        print("requirements: bertfast is not installed, so its requirements cannot be read "
              "(run `pip install --no-deps --no-build-isolation -e .` first)", file=sys.stderr)
        return 2
    print(report(found))
    print()
    print(verdict(found))
    return 1 if any(f.kind == "runtime" and not f.ok for f in found) else 0


if __name__ == "__main__":
    raise SystemExit(main())
