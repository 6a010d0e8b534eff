"""What a run writes for people to read: ``metrics.jsonl`` (one JSON object per record, and
TensorBoard when installed and asked for) and the loss-curve plot."""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch

from bertfast.training.checkpoints import describe_write_failure


class MetricsLogger:
    """JSON lines (one object per record) and, when installed and asked for, TensorBoard."""

    def __init__(self, path: Optional[str], tensorboard_dir: Optional[str] = None, enabled: bool = True,
                 resumed_at: Optional[int] = None):
        """``resumed_at``: the step of the checkpoint a run resumes from; the records the stopped
        run wrote after it are dropped (the resumed run writes them again), the ones before it are
        kept (``self.previous``), then new ones append."""
        self.enabled = enabled
        self.path = path
        self.previous: List[Dict[str, Any]] = []
        self._f = None
        self._tb = None
        if not enabled:
            return
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            if resumed_at is not None:
                self.previous = _keep_through_step(path, resumed_at)
            self._f = open(path, "a" if resumed_at is not None else "w", encoding="utf-8")
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(tensorboard_dir)
            except Exception:  # tensorboard not installed: JSONL only
                self._tb = None

    def log(self, record: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._f is not None:
            try:
                self._f.write(json.dumps(record, default=_json_default) + "\n")
                self._f.flush()
            except OSError as e:  # a full disk: name the file and the free space
                raise OSError(e.errno, describe_write_failure(self.path, os.path.dirname(os.path.abspath(self.path)),
                                                              e)) from e
        if self._tb is not None and "step" in record:
            kind = record.get("type", "train")
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self._tb.add_scalar(f"{kind}/{k}", v, record["step"])

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, torch.Tensor):
        return o.item() if o.numel() == 1 else o.tolist()
    return str(o)


def _keep_through_step(path: str, step: int) -> List[Dict[str, Any]]:
    """Rewrite ``path`` without the records after ``step`` (and without a last line cut short by
    a kill) and return the records kept; any other line that is not a JSON object is an error
    naming the file and line."""
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept, records = [], []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(lines) and not line.endswith("\n"):
                break  # a write cut short by a kill
            raise ValueError(f"{path}:{lineno}: not a JSON record; move the file aside to resume") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
        if record.get("step", 0) <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
            records.append(record)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return records


def read_jsonl(path: str) -> List[Dict[str, Any]]:
    out = []
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    out.append(json.loads(line))
    return out


def plot_loss_curve(jsonl_path: str, png_path: str, title: str = "bertfast pre-training") -> Optional[str]:
    """Training (and held-out) loss against step from a metrics file; None if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = read_jsonl(jsonl_path)
    # A resumed run appends: keep the last record of each step.
    train = {r["step"]: r for r in records if r.get("type", "train") == "train" and "loss" in r}
    evals = {r["step"]: r for r in records if r.get("type") == "eval" and "loss" in r}
    if not train:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    steps = sorted(train)
    ax.plot(steps, [train[s]["loss"] for s in steps], lw=1, label="train loss (MLM + NSP)")
    if evals:
        es = sorted(evals)
        ax.plot(es, [evals[s]["loss"] for s in es], "o-", ms=3, label="held-out loss")
    lengths = [train[s].get("seq_len") for s in steps]
    for prev, cur, step in zip(lengths, lengths[1:], steps[1:]):
        if prev != cur and cur is not None:  # a new phase (sequence length)
            ax.axvline(step, color="gray", ls="--", lw=0.8)
            ax.text(step, ax.get_ylim()[1], f" seq {cur}", va="top", fontsize=8, color="gray")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return png_path


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class RunningSums:
    """Named float64 sums kept on the device: adding never waits for the GPU; ``read`` reduces
    them over ranks and brings them to the host at once (the log interval's one sync)."""

    def __init__(self, names, device: torch.device):
        self.names = tuple(names)
        self._index = {name: i for i, name in enumerate(self.names)}
        self.values = torch.zeros(len(self.names), dtype=torch.float64, device=device)

    def add(self, **values) -> None:
        for name, value in values.items():
            self.values[self._index[name]] += value.double() if isinstance(value, torch.Tensor) else value

    def read(self, reduce=None) -> Dict[str, float]:
        """{name: sum}, summed over ranks by ``reduce(tensor) -> tensor`` when given."""
        values = reduce(self.values) if reduce is not None else self.values
        return dict(zip(self.names, values.tolist()))

    def reset(self) -> None:
        self.values.zero_()


@contextlib.contextmanager
def library_progress_bars(enabled: bool) -> Iterator[None]:
    """transformers' progress bars (writing and loading model shards at each checkpoint) on or off
    for a run, as --no-progress asks; their earlier state back afterwards."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()
