"""Exact resumption: RNG states (python, numpy, torch CPU and CUDA), atomic checkpoint
directories (written to a temp dir, fsynced, renamed into place) with keep-last-K pruning, and
the training checkpoint both commands write: the model in Hugging Face layout (with its
tokenizer files, so a checkpoint is a starting point for ``--model``), ``training_state.pt``
(step, optimizer, schedule, loss scaler, RNG states, ...) and a readable ``trainer_state.json``."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from bertfast.data.shards import fsync_dir


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


def atomic_checkpoint(directory: str, step: int, write: Callable[[str], None], keep_last: Optional[int] = None) -> str:
    """Call ``write(tmp_dir)``, fsync everything, rename to ``directory/step_<step>``, prune to ``keep_last``.

    A crash at any point leaves either the previous checkpoints untouched or the new one
    complete: the final name appears only through one atomic rename of a synced directory.
    """
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, f"step_{step:08d}")
    tmp = os.path.join(directory, f".tmp_step_{step:08d}_{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write(tmp)
    fsync_tree(tmp)
    if os.path.exists(final):  # re-saving the same step: move the old one aside first
        old = final + f".old_{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(directory)
    if keep_last is not None and keep_last > 0:
        for _step, path in list_checkpoints(directory)[:-keep_last]:
            shutil.rmtree(path, ignore_errors=True)
    return final


def save_training_checkpoint(directory: str, step: int, model, state: Dict[str, Any], summary: Dict[str, Any],
                             keep_last: Optional[int], extra: Optional[Callable[[str], None]] = None) -> str:
    """``directory/step_<step>``: ``model.save_pretrained``, ``extra(dir)`` (tokenizer files), the
    training ``state`` and a JSON ``summary``; written atomically, then pruned to ``keep_last``."""
    def write(tmp: str) -> None:
        model.save_pretrained(tmp)
        if extra is not None:
            extra(tmp)
        torch.save(state, os.path.join(tmp, STATE_FILE))
        with open(os.path.join(tmp, SUMMARY_FILE), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)

    return atomic_checkpoint(directory, step, write, keep_last=keep_last)


def find_resume_checkpoint(resume: Optional[str], directory: str) -> Optional[str]:
    """The checkpoint ``--resume`` names: a directory, or 'auto' for the latest in ``directory``
    (None when there is none yet: the run starts fresh)."""
    if not resume:
        return None
    path = latest_checkpoint(directory) if resume == "auto" else resume
    if path is not None and not os.path.isfile(os.path.join(path, STATE_FILE)):
        raise FileNotFoundError(f"{path!r} is not a complete bertfast checkpoint (no {STATE_FILE} in it)")
    return path


def load_training_state(path: str) -> Dict[str, Any]:
    return torch.load(os.path.join(path, STATE_FILE), map_location="cpu", weights_only=False)


def prepare_run_directory(config, checkpoint_dir: str) -> None:
    """Create the run's output directory, clear what a run killed while saving left in
    ``checkpoint_dir``, and save the resolved settings there (``--resume`` reads them back)."""
    os.makedirs(config.output_dir, exist_ok=True)
    remove_stale_temp(checkpoint_dir)
    config.save(config.output_dir)


def remove_stale_temp(directory: str) -> None:
    """Delete temp directories left by a run killed while saving."""
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            if name.startswith(".tmp_step_") or ".old_" in name:
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def torch_save_atomic(obj: Any, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
