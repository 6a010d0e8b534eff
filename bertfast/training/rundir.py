"""A run's output directory: one run at a time, and what is done with what an earlier run left.

``RunDirectory.open`` (the main process of a run, before anything is written):

  * takes a lock on ``OUTPUT_DIR/.lock`` (``flock``; released when the process ends, however it
    ends), so a second run on the same directory stops at once, naming the first one;
  * clears what a run killed while saving left (``checkpoints.remove_stale_temp``);
  * finds the checkpoint to resume from (``--resume``: verified against its manifest; a damaged
    newest checkpoint is set aside and the one before it is used);
  * a fresh run into a directory holding an earlier run (checkpoints or metrics) is refused
    unless ``--overwrite``, which deletes that run's checkpoints and records first;
  * resuming from step k sets aside the directory's checkpoints after k (a continuation that was
    abandoned, as ``step_N.abandoned-<time>``), so a later ``--resume`` follows this run and
    keep-last pruning never favours them;
  * records the run's identity and lineage in ``run.json`` (a run id, and one entry per start:
    when, and from which checkpoint), and saves the resolved settings (``run_config.json``).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from typing import Any, Callable, Dict, List, Optional

from bertfast.training import checkpoints as ckpt

RUN_FILE = "run.json"
LOCK_FILE = ".lock"
# What a run writes into its output directory; --overwrite deletes these of the earlier run.
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "tensorboard", "loss.png", "eval_results.json", "predictions.json",
               RUN_FILE)


class RunDirectoryError(ValueError):
    """The output directory is in use, or holds an earlier run this one would overwrite."""


class RunDirectory:
    def __init__(self, output_dir: str, checkpoint_dir: str, say: Callable[[str], None] = print):
        self.output_dir, self.checkpoint_dir, self.say = output_dir, checkpoint_dir, say
        self.run_id: Optional[str] = None
        self._lock_fd: Optional[int] = None

    # ------------------------------------------------------------------ the lock
    def lock(self) -> None:
        """Hold ``OUTPUT_DIR/.lock`` for the life of this process (or until ``release``)."""
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            return
        os.makedirs(self.output_dir, exist_ok=True)
        path = os.path.join(self.output_dir, LOCK_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 4096).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise RunDirectoryError(f"{self.output_dir} is in use by another run ({holder}); wait for it to end "
                                    f"or give another --output-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
                 .encode())
        self._lock_fd = fd

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor drops the flock
            self._lock_fd = None

    # ------------------------------------------------------------------ opening
    def open(self, config, resume: Optional[str], overwrite: bool) -> Optional[str]:
        """Lock the directory, settle what an earlier run left, record this run; returns the
        checkpoint to resume from (None: a fresh start)."""
        self.lock()
        ckpt.remove_stale_temp(self.checkpoint_dir)
        resume_from = ckpt.find_resume_checkpoint(resume, self.checkpoint_dir, self.say)
        if resume and resume_from is None:
            self.say(f"[run] --resume auto: no checkpoint in {self.checkpoint_dir}; starting fresh")
        ours = resume_from is not None and _same_dir(os.path.dirname(os.path.normpath(resume_from)),
                                                     self.checkpoint_dir)
        earlier = self.earlier_run()
        if earlier and not ours and not (resume and resume_from is None):
            if not overwrite:
                start = (f"--resume {resume_from} starts from another directory's checkpoint" if resume_from
                         else "a fresh run would mix with it")
                raise RunDirectoryError(f"{self.output_dir} holds an earlier run ({earlier}) and {start}; pass "
                                        f"--resume to continue that run, --overwrite to replace it, or give "
                                        f"another --output-dir")
            self._delete_earlier_run(earlier)
        if ours:
            self._set_aside_later_checkpoints(resume_from)
        self._record_start(resume_from, continuing=ours or bool(resume))
        config.save(self.output_dir)
        return resume_from

    def earlier_run(self) -> str:
        """What an earlier run left here ('' when nothing): its checkpoints and records."""
        found = ckpt.list_checkpoints(self.checkpoint_dir)
        parts = []
        if found:
            parts.append(f"checkpoints up to step {found[-1][0]}")
        metrics = os.path.join(self.output_dir, "metrics.jsonl")
        if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
            parts.append("metrics.jsonl")
        return ", ".join(parts)

    def _delete_earlier_run(self, earlier: str) -> None:
        for name in RUN_OUTPUTS:
            path = os.path.join(self.output_dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
        self.say(f"[run] --overwrite: deleted the earlier run in {self.output_dir} ({earlier})")

    def _set_aside_later_checkpoints(self, resume_from: str) -> None:
        step = ckpt.checkpoint_step(resume_from)
        later = [path for s, path in ckpt.list_checkpoints(self.checkpoint_dir) if step is not None and s > step]
        if later:
            moved = [ckpt.set_aside(path, "abandoned") for path in later]
            self.say(f"[run] resuming from step {step}: the later checkpoints of the run that went on from it are "
                     f"set aside ({', '.join(os.path.basename(p) for p in moved)}); delete them when no longer "
                     f"needed")

    def _record_start(self, resume_from: Optional[str], continuing: bool) -> None:
        path = os.path.join(self.output_dir, RUN_FILE)
        record: Dict[str, Any] = {}
        if continuing and os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    record = json.load(f)
            except ValueError as e:
                self.say(f"[run] {path} is damaged ({e}); starting a new lineage record")
        record.setdefault("run_id", uuid.uuid4().hex)
        starts: List[Dict[str, Any]] = record.setdefault("starts", [])
        starts.append({"time": time.strftime("%Y-%m-%d %H:%M:%S"), "pid": os.getpid(),
                       "resumed_from": resume_from,
                       "step": ckpt.checkpoint_step(resume_from) if resume_from else 0})
        self.run_id = record["run_id"]
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
        os.replace(tmp, path)


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)
