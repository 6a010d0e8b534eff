"""The kernel suite's attention timings beside the model's predictions of the same cases.

A GPU run's kernel suite (the GPU check's stage 4) times the attention op alone at full lengths
(padding none), forward and backward, from a cold L2, with the configs its autotuner chose (the
run's results.json lists them). Each such case is a setting the model predicts as it stands: 12
heads of 64 are BERT-base's, 16 BERT-large's. The step's profile (report.compare) times the attention
inside the step at one shape; the suite times it at the targets' sequence length, 512, too, where
the model's attention target is stated. A direction is every kernel it launches (the backward at
seq 512: delta, dQ, dK/dV), so a row is measured against the sum of their predictions.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from bertfast.perfmodel import kernels as K
from bertfast.perfmodel.hardware import Gpu, device_gpu
from bertfast.perfmodel.model import fit_constant, retime

IMPL = "bertfast:triton varlen"  # the attention the model predicts (kernels.record: varlen)
MODEL_OF_HEADS = {12: "bert-base", 16: "bert-large"}
DIRECTIONS = ("fwd", "bwd")  # compared with the prediction; "fwd+bwd" is read too (the target's figure)


@dataclass
class SuiteRun:
    """A committed GPU run's kernel-suite timings of the attention, as model settings."""

    path: str  # the run's directory
    device: str
    gpu: Gpu  # its constants, with the copy bandwidth the run measured
    date: str
    times: List[Tuple[K.Setting, str, float]]  # (setting, direction, median seconds per call)
    tuned: Dict[str, Dict[Tuple, str]]  # kernel -> tuning key -> the config its autotuner chose

    def settings(self) -> List[K.Setting]:
        return list({setting.label(): setting for setting, _, _ in self.times}.values())

    def seconds(self, setting: K.Setting, direction: str) -> Optional[float]:
        return next((t for s, d, t in self.times if s == setting and d == direction), None)


def read_suite(run_dir: str) -> Optional[SuiteRun]:
    """The run's attention timings, or None when it has none (no kernel suite, a CPU run)."""
    from bertfast.bench.report import tuned_choices  # here: it imports torch, which `perf-model --help` must not
    try:
        with open(os.path.join(run_dir, "results.json"), encoding="utf-8") as f:
            results = json.load(f)
    except (OSError, ValueError):
        return None
    device = results.get("device") or {}
    if device.get("kind") != "cuda":
        return None
    times: List[Tuple[K.Setting, str, float]] = []
    for row in results.get("rows") or []:
        case = row.get("case") or {}
        if (row.get("suite") != "kernels" or row.get("group") != "attention" or row.get("impl") != IMPL
                or row.get("status") != "ok" or row.get("direction") not in DIRECTIONS + ("fwd+bwd",)
                or case.get("padding") != "none" or case.get("head_dim") != K.HEAD_DIM
                or case.get("dtype") != "bf16" or case.get("heads") not in MODEL_OF_HEADS):
            continue
        setting = K.Setting(MODEL_OF_HEADS[case["heads"]], int(case["seqlen"]), int(case["batch"]),
                            float(case["dropout"]))
        times.append((setting, row["direction"], row["time_ms"]["median"] / 1e3))
    if not times:
        return None
    return SuiteRun(run_dir, device.get("name", ""), device_gpu(device), str(results.get("date") or ""), times,
                    tuned_choices(results.get("config") or {}))


def latest_suite(root: str) -> Optional[SuiteRun]:
    """The newest committed run (``root``/<gpu>/<date>/) whose kernel suite timed the attention."""
    runs = [run for run in (read_suite(os.path.dirname(p)) for p in glob.glob(os.path.join(root, "*", "*",
                                                                                              "results.json")))
            if run is not None]
    return max(runs, key=lambda run: run.date) if runs else None


def compare(results: Sequence, suite: SuiteRun) -> List[Dict[str, object]]:
    """Each timed (setting, direction): measured and predicted seconds, the prediction the sum of the
    direction's attention kernels at that setting (report.KernelResult rows of ``results``)."""
    rows = []
    for setting, direction, measured in suite.times:
        if direction not in DIRECTIONS:
            continue
        kernels = [r for r in results if r.setting == setting and r.op == "attention" and r.prediction is not None
                   and r.direction() == direction]
        if not kernels:
            continue
        rows.append({"setting": setting, "direction": direction, "measured_s": measured,
                     "predicted_s": sum(r.prediction.predicted_s for r in kernels),
                     # each autotuned kernel at the config the run chose (its key matched; the delta kernel
                     # has no candidates)
                     "kernels": [r.kernel for r in kernels],
                     "tuned": all(r.tuned or r.kernel not in suite.tuned for r in kernels),
                     "predictions": [r.prediction for r in kernels]})
    return rows


def fit_overlap(rows: Sequence[Dict[str, object]], memory_overlap: float) -> Optional[float]:
    """The one overlap constant that best fits the rows' measured times (least squares on predicted /
    measured: model.fit_constant; each row's prediction a sum of kernels), never below 0; None without
    rows whose time it moves. The overlap prices the attention's kernels (they have tensor-core work); a
    memory-bound one among them (the backward's delta) keeps ``memory_overlap``."""
    if not any(at_overlap(row, 1.0, memory_overlap) != at_overlap(row, 0.0, memory_overlap) for row in rows):
        return None
    return fit_constant(lambda o: sum((at_overlap(row, o, memory_overlap) / row["measured_s"] - 1.0) ** 2
                                      for row in rows))


def at_overlap(row: Dict[str, object], overlap: float, memory_overlap: float) -> float:
    """A row's predicted seconds with ``overlap`` in place of the assumed constant."""
    return sum(retime(p, overlap, memory_overlap) for p in row["predictions"])


def autotuner_agreement(tuned: Sequence, picked: Sequence) -> List[Dict[str, object]]:
    """Each kernel the run's autotuner chose a config for (``tuned``: analyse's results at the run's
    choices), beside the candidate the model predicts fastest at the same setting (``picked``: analyse
    with its ``fastest``): the two configs and whether they are one. A launch the settings repeat (a GEMM at
    the same shape with and without dropout) counts once."""
    model_pick = {(r.setting.label(), r.kernel, r.variant): r for r in picked if r.candidates > 1}
    rows, seen = [], set()
    for r in tuned:
        mine = model_pick.get((r.setting.label(), r.kernel, r.variant))
        launch = (r.setting.model, r.setting.seq, r.setting.batch, r.kernel, r.variant)
        if r.tuned and mine is not None and launch not in seen:
            seen.add(launch)
            rows.append({"setting": r.setting.label(), "kernel": r.kernel, "run": r.config, "model": mine.config,
                         "candidates": mine.candidates, "agree": r.config == mine.config})
    return rows

