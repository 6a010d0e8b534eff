"""What the GPU machine holds for the check's steps: bertfast installed, the CUDA extension loadable.

A stage may start on a fresh machine (a loan ends between stages and only GPU_OUT is kept), so
before the first step that needs the package the runner looks, and restores what is missing:
bertfast re-installed without building, the extension copied back from GPU_OUT/cache/ext. The
build's outcome is kept there too (build.json): after a failed build every later step, on this
machine or the next, runs without the extension (BERTFAST_SKIP_EXTENSION names the build error,
so the CUDA backend's tests skip quoting it) while the Triton steps run as usual.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

from bertfast.gpucheck.stages import EXTENSION, PACKAGE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SKIP_ENV = "BERTFAST_SKIP_EXTENSION"  # bertfast.cuda._common reads it (not imported here: it needs torch)
RESTORE_LIMIT_S = 120
PROBES = {PACKAGE: "import bertfast.kernels", EXTENSION: "import bertfast._C"}


def ext_dir(out: str) -> str:
    return os.path.join(out, "cache", "ext")


def build_record(out: str) -> Optional[Dict]:
    """What the last build into this GPU_OUT left: {"ok": bool, "error": excerpt}; None if none ran."""
    path = os.path.join(ext_dir(out), "build.json")
    return json.load(open(path)) if os.path.exists(path) else None


def error_excerpt(log_path: str, lines: int = 3, limit: int = 400) -> str:
    """The first error lines of a build log (compiler errors first), else its last lines."""
    try:
        text = open(log_path, errors="replace").read().splitlines()
    except OSError:
        return "no build log"
    errors = [ln.strip() for ln in text if re.search(r"\berror\b", ln, re.I) and not ln.startswith("$ ")]
    picked = errors[:lines] or [ln.strip() for ln in text if ln.strip()][-lines:]
    excerpt = " | ".join(picked)
    return excerpt if len(excerpt) <= limit else excerpt[:limit - 3] + "..."


def _probe(code: str) -> str:
    """'' when ``code`` runs in a fresh interpreter here (this one may predate an install), else why not."""
    env = dict(os.environ)
    env.pop(SKIP_ENV, None)
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    if res.returncode == 0:
        return ""
    last = [ln for ln in res.stderr.splitlines() if ln.strip()]
    return last[-1].strip() if last else f"exit {res.returncode}"


def _replace(src: str, dest: str) -> None:
    """Copy src over dest atomically: a process that has the old module mapped keeps a whole file."""
    tmp = f"{dest}.tmp-{os.getpid()}"
    shutil.copy2(src, tmp)
    os.replace(tmp, dest)


class Machine:
    """The state of this machine for one `gpu-check run`: checked lazily, restored from GPU_OUT.

    fresh: a simulated lost machine (the dry run's --simulate lost-machine): each stage starts as
    if nothing were installed, and the restore runs (the dry run stands the installed package and
    extension in for the re-install and the copy, and says so).
    """

    def __init__(self, out: str, dry_run: bool, log: Callable[[str], None], fresh: bool = False):
        self.out, self.dry_run, self.log, self.fresh = out, dry_run, log, fresh
        self.why_not: Dict[str, str] = {}  # need -> "" (ready) or why not; absent: not looked at yet
        self.restores: List[Dict] = []     # what was done to make the machine ready, for the summary

    def new_stage(self) -> None:
        if self.fresh:
            self.why_not.clear()

    # ------------------------------------------------------------------ what the steps get
    def unmet(self, needs) -> str:
        """Why a step with these needs cannot run here ('' when it can). Looking at the package also
        looks at the extension: the tests and benchmarks use it wherever it loads."""
        if PACKAGE in needs or EXTENSION in needs:
            self._ensure_package()
            if self.why_not[PACKAGE]:
                return f"bertfast is not installed: {self.why_not[PACKAGE]}"
            self._ensure_extension()
        if EXTENSION in needs and self.why_not[EXTENSION]:
            return f"needs the CUDA extension: {self.why_not[EXTENSION]}"
        return ""

    def env(self) -> Dict[str, str]:
        """Environment for every step: without the extension when its build failed."""
        record = build_record(self.out)
        if record is not None and not record["ok"]:
            return {SKIP_ENV: self._build_failure(record)}
        return {}

    # ------------------------------------------------------------------ stage 1's results
    def installed(self, status: str, detail: str) -> None:
        self.why_not[PACKAGE] = "" if status == "ok" else f"the install step {status} ({detail})"

    def built(self, status: str, detail: str, error: str) -> None:
        """Keep the extension for later stages, or record why it is missing (error: the build log's
        excerpt, error_excerpt)."""
        os.makedirs(ext_dir(self.out), exist_ok=True)
        if status == "ok":
            for path in glob.glob(os.path.join(REPO, "bertfast", "_C*.so")):
                shutil.copy2(path, ext_dir(self.out))
                self.log(f"kept {os.path.basename(path)} in {ext_dir(self.out)} for later stages")
            record = {"ok": True, "error": ""}
        else:
            record = {"ok": False, "error": f"{status}, {detail}: {error}"}
        with open(os.path.join(ext_dir(self.out), "build.json"), "w") as fh:
            json.dump(record, fh)
        self.why_not.pop(EXTENSION, None)  # looked at again by the next step that needs it

    # ------------------------------------------------------------------ looking and restoring
    def _looks_fresh(self, need: str) -> str:
        return "not present (simulated lost machine: --simulate lost-machine)" if self.fresh else _probe(PROBES[need])

    def _ensure_package(self) -> None:
        if PACKAGE in self.why_not:
            return
        missing = self._looks_fresh(PACKAGE)
        if missing:
            self.log(f"bertfast is not installed here ({missing}): re-installing it without the build")
            missing = self._reinstall()
        self.why_not[PACKAGE] = missing

    def _reinstall(self) -> str:
        start = time.time()
        if self.dry_run:
            detail, why = "dry run: the installed package stands in for the re-install", _probe(PROBES[PACKAGE])
        else:
            env = dict(os.environ, BERTFAST_BUILD_CUDA="0")
            argv = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", REPO]
            try:
                res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=RESTORE_LIMIT_S)
                why = "" if res.returncode == 0 else f"re-install failed: {res.stderr.strip()[-300:]}"
            except subprocess.TimeoutExpired:
                why = f"re-install did not finish in {RESTORE_LIMIT_S} s"
            why = why or _probe(PROBES[PACKAGE])
            detail = "re-installed bertfast (pip install --no-deps -e ., no build)"
        self._restored("re-install", why, detail, start)
        return why

    def _ensure_extension(self) -> None:
        if EXTENSION in self.why_not:
            return
        record = build_record(self.out)
        if record is not None and not record["ok"]:
            self.why_not[EXTENSION] = self._build_failure(record)
            return
        missing = self._looks_fresh(EXTENSION)
        if missing:
            missing = self._restore_extension(missing)
        self.why_not[EXTENSION] = missing

    def _restore_extension(self, missing: str) -> str:
        start = time.time()
        kept = sorted(glob.glob(os.path.join(ext_dir(self.out), "_C*.so")))
        if not kept:
            return (f"bertfast._C is not built here ({missing}) and {ext_dir(self.out)} holds none: stage 1's "
                    f"build step has not run into this GPU_OUT")
        if self.dry_run:
            why = _probe(PROBES[EXTENSION])
            detail = f"dry run: the extension in the tree stands in for {kept[-1]}"
        else:
            for path in kept:
                _replace(path, os.path.join(REPO, "bertfast", os.path.basename(path)))
            why = _probe(PROBES[EXTENSION])
            detail = f"copied {', '.join(os.path.basename(p) for p in kept)} back from {ext_dir(self.out)}"
        self._restored("extension", why, detail, start)
        return why

    def _restored(self, what: str, why: str, detail: str, start: float) -> None:
        record = {"step": f"restore {what}", "limit_s": RESTORE_LIMIT_S, "status": "failed" if why else "ok",
                  "seconds": round(time.time() - start, 1), "detail": detail + (f"; still missing: {why}" if why else "")}
        self.restores.append(record)
        self.log(f"--- restore {what}: {record['status']}: {record['detail']}")

    @staticmethod
    def _build_failure(record: Dict) -> str:
        return f"the CUDA extension did not build in stage 1 ({record['error']})"
