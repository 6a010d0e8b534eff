"""Exact resumption: RNG states (python, numpy, torch CPU and CUDA), atomic checkpoint
directories (written to a temp dir, fsynced, renamed into place) with keep-last-K pruning, and
the training checkpoint both commands write: the model in Hugging Face layout (with its
tokenizer files, so a checkpoint is a starting point for ``--model``), ``training_state.pt``
(step, optimizer, schedule, loss scaler, RNG states, ...), a readable ``trainer_state.json``
and ``manifest.json`` (every file's size and SHA-256), which ``--resume`` verifies: a damaged
checkpoint is named and set aside, and the one before it is used."""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from bertfast.data.shards import fsync_dir
from bertfast.model.saving import disk_full


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng_state(device: Optional[torch.device] = None) -> Dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch_cpu": torch.get_rng_state()}
    if device is not None and device.type == "cuda":
        state["torch_cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: Dict[str, Any], device: Optional[torch.device] = None) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if device is not None and device.type == "cuda" and "torch_cuda" in state:
        torch.cuda.set_rng_state(state["torch_cuda"], device)


CKPT_RE = re.compile(r"^step_(\d+)$")
STATE_FILE = "training_state.pt"
SUMMARY_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: a file missing, cut short, changed or unreadable (named)."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (disk full, permissions, ...); the message names the path, the
    cause and the free space. The checkpoints written before it are intact."""


def fsync_tree(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(root)


def list_checkpoints(directory: str) -> List[Tuple[int, str]]:
    """Complete checkpoints in ``directory`` as (step, path), oldest first."""
    if not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        m = CKPT_RE.match(name)
        if m and os.path.isfile(os.path.join(directory, name, STATE_FILE)):
            out.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(out)


def latest_checkpoint(directory: str) -> Optional[str]:
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def checkpoint_step(path: str) -> Optional[int]:
    """N for a directory named step_N, else None."""
    m = CKPT_RE.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


# ----------------------------------------------------------------------------- writing
def atomic_checkpoint(directory: str, step: int, write: Callable[[str], None], keep_last: Optional[int] = None) -> str:
    """Call ``write(tmp_dir)``, fsync everything, rename to ``directory/step_<step>``, prune to ``keep_last``.

    A crash at any point leaves either the previous checkpoints untouched or the new one
    complete: the final name appears only through one atomic rename of a synced directory (a
    re-saved step moves its old copy aside first, and ``remove_stale_temp`` puts it back if the
    run dies between the two renames). A failed write removes the temp dir and raises
    ``CheckpointWriteError`` naming the path and the cause.
    """
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, f"step_{step:08d}")
    tmp = os.path.join(directory, f".tmp_step_{step:08d}_{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        write(tmp)
        fsync_tree(tmp)
        if os.path.exists(final):
            old = final + f".old_{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(directory)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_write_failure(e):
            raise CheckpointWriteError(describe_write_failure(f"the checkpoint {final}", directory, e)) from e
        raise
    if keep_last is not None and keep_last > 0:
        for _step, path in list_checkpoints(directory)[:-keep_last]:
            shutil.rmtree(path, ignore_errors=True)
    return final


def is_write_failure(e: BaseException) -> bool:
    """An error of the writing itself: OSError, and what torch.save (a RuntimeError from its zip
    writer) and safetensors raise when the file system fails under them."""
    return isinstance(e, (OSError, RuntimeError)) or type(e).__name__ == "SafetensorError"


def describe_write_failure(what: str, directory: str, e: BaseException) -> str:
    """'could not write WHAT: the disk is full (N MB free on the file system of DIRECTORY)'."""
    try:
        free = f"{shutil.disk_usage(directory).free / 2**20:.0f} MB free"
    except OSError:
        free = "free space unknown"
    cause = "the disk is full" if disk_full(e) else f"{type(e).__name__}: {e}"
    return f"could not write {what}: {cause} ({free} on the file system of {directory})"


def save_training_checkpoint(directory: str, step: int, model, state: Dict[str, Any], summary: Dict[str, Any],
                             keep_last: Optional[int], extra: Optional[Callable[[str], None]] = None,
                             run_id: Optional[str] = None) -> str:
    """``directory/step_<step>``: ``model.save_pretrained``, ``extra(dir)`` (tokenizer files), the
    training ``state``, a JSON ``summary`` and the manifest (naming the run, ``run_id``); written
    atomically, then pruned to ``keep_last``."""
    def write(tmp: str) -> None:
        model.save_pretrained(tmp)
        if extra is not None:
            extra(tmp)
        torch.save(state, os.path.join(tmp, STATE_FILE))
        with open(os.path.join(tmp, SUMMARY_FILE), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
        write_manifest(tmp, step, run_id)

    return atomic_checkpoint(directory, step, write, keep_last=keep_last)


def remove_stale_temp(directory: str) -> None:
    """Clear what a run killed while saving left: half-written temp dirs are deleted; the old copy
    of a re-saved step is deleted once the new copy is in place, and put back if it is not."""
    if not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.startswith(".tmp_step_"):
            shutil.rmtree(path, ignore_errors=True)
        elif ".old_" in name:
            final = os.path.join(directory, name.split(".old_")[0])
            if os.path.isdir(final):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.rename(path, final)


# ----------------------------------------------------------------------------- verifying
def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(path: str, step: int, run_id: Optional[str] = None) -> None:
    """``path/manifest.json``: the size and SHA-256 of every file in the checkpoint directory."""
    files = {}
    for root, _dirs, names in os.walk(path):
        for name in sorted(names):
            full = os.path.join(root, name)
            files[os.path.relpath(full, path)] = {"bytes": os.path.getsize(full), "sha256": _sha256(full)}
    with open(os.path.join(path, MANIFEST_FILE), "w", encoding="utf-8") as f:
        json.dump({"format": 1, "step": step, "run_id": run_id, "files": files}, f, indent=1)


def verify_checkpoint(path: str) -> Dict[str, Any]:
    """Check every file of the checkpoint ``path`` against its manifest and return the manifest
    (``{}`` for a checkpoint written before manifests existed); ``CheckpointError`` names the
    first bad file."""
    manifest_path = os.path.join(path, MANIFEST_FILE)
    if not os.path.isfile(manifest_path):
        if not os.path.isfile(os.path.join(path, STATE_FILE)):
            raise CheckpointError(f"{path}: not a complete bertfast checkpoint (no {STATE_FILE} in it)")
        return {}
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
        files = {name: (int(meta["bytes"]), str(meta["sha256"])) for name, meta in manifest["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{manifest_path}: damaged manifest ({type(e).__name__}: {e})") from None
    for name, (size, digest) in files.items():
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            raise CheckpointError(f"{full}: missing (the manifest lists it)")
        if os.path.getsize(full) != size:
            raise CheckpointError(f"{full}: {os.path.getsize(full)} bytes, {size} when it was written "
                                  f"(cut short or overwritten)")
        if _sha256(full) != digest:
            raise CheckpointError(f"{full}: its SHA-256 differs from the one recorded when it was written "
                                  f"(the file changed on disk)")
    return manifest


def set_aside(path: str, why: str) -> str:
    """Rename a checkpoint out of ``list_checkpoints``' sight, to ``step_N.<why>-<time>``, keeping
    it for the user to inspect or delete."""
    aside = f"{os.path.normpath(path)}.{why}-{time.strftime('%Y%m%d-%H%M%S')}"
    os.rename(path, aside)
    return aside


def find_resume_checkpoint(resume: Optional[str], directory: str,
                           say: Callable[[str], None] = print) -> Optional[str]:
    """The checkpoint ``--resume`` names, verified against its manifest: a directory (an error if
    it is damaged), or 'auto' for the newest good one in ``directory``, a damaged newer one being
    reported and set aside (None when there is none: the run starts fresh)."""
    if not resume:
        return None
    if resume != "auto":
        if not os.path.isdir(resume):
            raise FileNotFoundError(f"--resume {resume}: no such checkpoint directory")
        verify_checkpoint(resume)
        return resume
    for _step, path in reversed(list_checkpoints(directory)):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:
            say(f"[resume] {e}; set aside as {set_aside(path, 'damaged')}; trying the checkpoint before it")
    return None


def load_training_state(path: str) -> Dict[str, Any]:
    file = os.path.join(path, STATE_FILE)
    try:
        return torch.load(file, map_location="cpu", weights_only=False)
    except Exception as e:  # cut short, or not a torch.save archive: name the file
        raise CheckpointError(f"{file}: cannot be read ({type(e).__name__}: {e})") from None
