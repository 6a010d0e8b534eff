"""What the targets a GPU run's baseline sets ask of bertfast, set beside the prediction: the
speedup targets of the step, and the MLM head's >= 5x the full-sequence head.

A speedup target (bench.targets.SPEEDUP_TARGETS: at least 2.5x transformers eager, 1.5x transformers
under torch.compile) is a step time only a GPU run can set: the baseline's time over the speedup. At
that time the step runs the same model FLOPs as the baseline, so its MFU is the baseline's MFU times
the speedup. The step's prediction on the run's GPU (step.budget, at the run's micro-batches a
step), and the prediction's ceiling, then say whether bertfast's step could reach it: a target whose
MFU lies above the ceiling is out of reach of every kernel the model prices (the GEMMs at the rate
cuBLAS ran them). The baselines are measured, the step is predicted: the comparison is a plan, and
a GPU run of both settles it (docs/perf-model.md).

The MLM head's target over the full-sequence head (bench.targets.MLM_HEAD_VS_FULL: 5x in time and in
peak memory) is set alike by the full head a run timed (the transformers-style head over every
token, which no change of bertfast's moves): it asks for the head in its time over 5, which
perfmodel/head.py prices on the run's GPU. Only the time is predicted; the peak memory is the
run's.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from bertfast.perfmodel import head as HEAD
from bertfast.perfmodel import kernels as K
from bertfast.perfmodel import step as S
from bertfast.perfmodel.hardware import Gpu, device_gpu

SEQLEN = 128  # the speedup targets' sequence length


@dataclass
class Ask:
    """What a speedup target asks of the step, as one filed run's baseline sets it."""

    target_id: str
    text: str
    model: str
    speedup: float
    device: Dict[str, object]   # the run's device: its name and the copy bandwidth it measured
    run: str                    # the run's directory, as the README names it
    baseline_ms: float
    baseline_mfu: float         # of the datasheet peak
    micro_batches: int          # a step of the run's case: micro-batches before one optimizer step
    global_batch: int

    @property
    def needed_ms(self) -> float:
        return self.baseline_ms / self.speedup

    @property
    def needed_mfu(self) -> float:
        return self.baseline_mfu * self.speedup


def speedup_asks(runs: Sequence[Tuple[object, str]]) -> List[Ask]:
    """Per speedup target and GPU, the newest of ``runs`` (bench.readme.filed_runs: (Run, directory))
    whose baseline step ran at seq 128 with a datasheet MFU."""
    from bertfast.bench.targets import SPEEDUP_TARGETS, global_batch, pretrain_rows, speedup_text
    asks: Dict[Tuple[str, str], Ask] = {}
    for run, where in sorted(runs, key=lambda filed: filed[0].date, reverse=True):
        if not run.device.is_cuda:
            continue
        for tid, model, baseline, speedup in SPEEDUP_TARGETS:
            if (tid, run.device.name) in asks:
                continue
            base = next((r for r in pretrain_rows(run, model, SEQLEN)
                         if r.impl == baseline and r.ok and r.metric("mfu_datasheet")), None)
            if base is None:
                continue
            asks[tid, run.device.name] = Ask(
                tid, speedup_text(model, baseline, speedup), model, speedup, _device(run), where, base.time_ms.median,
                base.metric("mfu_datasheet"), int(base.case.get("micro_batches") or 1), global_batch(base))
    return list(asks.values())


def _device(run) -> Dict[str, object]:
    """A run's device as hardware.device_gpu reads it: its name and the copy bandwidth it measured."""
    copy = run.device.copy_bandwidth_gbps
    return {"name": run.device.name, "copy_bandwidth_gbps": {"median": copy.median} if copy else None}


def step_case(model: str) -> S.StepCase:
    return next(c for c in S.STEP_CASES if c.setting.model == model and c.setting.seq == SEQLEN)


def priced(asks: Sequence[Ask], predict: Callable[[K.Setting, Gpu], list]) -> List[Dict[str, object]]:
    """Each ask as a target line of the report (name, predicted, target, unit, met, ceiling): the step's
    predicted MFU on the run's GPU (``predict(setting, gpu)`` gives the kernel results) against the MFU
    the target asks for."""
    out = []
    for ask in asks:
        gpu = device_gpu(ask.device)
        case = step_case(ask.model)
        plan = S.budget(predict(case.setting, gpu), case, gpu, accumulation=ask.micro_batches)
        out.append({"name": f"{ask.text} on the {ask.device['name']}: {ask.needed_ms:.1f} ms a step, as its "
                            f"baseline's {ask.baseline_ms:.1f} ms at {100 * ask.baseline_mfu:.1f}% MFU sets it "
                            f"({os.path.basename(ask.run)}, global batch {ask.global_batch}; the step predicted at "
                            f"{ask.micro_batches} x {case.setting.batch} on that GPU)",
                    "predicted": 100 * plan["mfu"], "target": 100 * ask.needed_mfu,
                    "unit": "% MFU (device time; a CUDA-graph step)", "met": plan["mfu"] >= ask.needed_mfu,
                    "ceiling": 100 * plan["ceiling"]["mfu"],
                    "ceiling_why": "the step's ceiling has its row ops at the copy bandwidth and no casts, its "
                                   "GEMMs at cuBLAS's rate, the attention and the rest as predicted",
                    "speedup": ask.target_id, "run": ask.run,
                    "needed_ms": ask.needed_ms, "predicted_ms": plan["seconds"] * 1e3})
    return out


@dataclass
class HeadAsk:
    """What the MLM head's target over the full-sequence head asks, as one filed run's full head sets it."""

    case: Dict[str, object]     # the kernel suite's mlm_head_loss case: model, tokens, predictions, hidden
    device: Dict[str, object]
    run: str
    full_ms: float              # the full-sequence head, fwd+bwd
    floor_ms: Optional[float]   # the run's GEMM floor of the case, where it timed one
    memory_ratio: Optional[float]  # the full head's peak memory over bertfast's, as the run measured them

    @property
    def needed_ms(self) -> float:
        from bertfast.bench.thresholds import MLM_HEAD_VS_FULL
        return self.full_ms / MLM_HEAD_VS_FULL


def head_asks(runs: Sequence[Tuple[object, str]]) -> List[HeadAsk]:
    """Per kernel-suite case of the MLM head and GPU, the newest of ``runs`` that timed its full-sequence
    head (fwd+bwd); the memory ratio against the faster fast backend's row, as bench.targets reads it."""
    from bertfast.bench.results import FULL_HEAD, GEMM_FLOOR, is_fast_impl
    asks: Dict[Tuple[object, str], HeadAsk] = {}
    for run, where in sorted(runs, key=lambda filed: filed[0].date, reverse=True):
        if not run.device.is_cuda:
            continue
        for full in run.find("mlm_head_loss", FULL_HEAD, "fwd+bwd"):
            key = (full.case.get("model"), run.device.name)
            if key in asks or not full.ok:
                continue
            rows = [r for r in run.find("mlm_head_loss", direction="fwd+bwd") if r.case == full.case and r.ok]
            floor = next((r.time_ms.median for r in rows if r.impl == GEMM_FLOOR), None)
            fast = min((r for r in rows if is_fast_impl(r.impl)), key=lambda r: r.time_ms.median, default=None)
            memory = (full.memory.peak_delta_bytes / fast.memory.peak_delta_bytes
                      if fast is not None and fast.memory is not None and full.memory is not None
                      and fast.memory.peak_delta_bytes > 0 else None)
            asks[key] = HeadAsk(dict(full.case), _device(run), where, full.time_ms.median, floor, memory)
    return sorted(asks.values(), key=lambda a: (str(a.device["name"]), -int(a.case.get("hidden") or 0)))


def head_priced(asks: Sequence[HeadAsk]) -> List[Dict[str, object]]:
    """Each ask as a target line of the report: the full head's time over the head's predicted on the
    run's GPU (head.lines at the case's tokens and labelled rows, bf16 parameters as the kernel suite
    times it), against MLM_HEAD_VS_FULL; its ceiling over the head at its ceiling's lines."""
    from bertfast.bench.results import FULL_HEAD
    from bertfast.bench.thresholds import MLM_HEAD_VS_FULL, MODEL_NAMES
    out = []
    for ask in asks:
        gpu = device_gpu(ask.device)
        case = ask.case
        plan = HEAD.lines(int(case["hidden"]), int(case["tokens"]), int(case.get("vocab", HEAD.VOCAB)),
                          act_bytes=2, weight_bytes=2, gpu=gpu, rows=int(case["predictions"]))
        predicted_ms = plan["seconds"] * 1e3
        speedup = ask.full_ms / predicted_ms
        model = MODEL_NAMES.get(str(case.get("model")), case.get("model"))
        at_floor = ("" if ask.floor_ms is None else
                    f"; at the run's measured GEMM floor ({ask.floor_ms:.2f} ms, "
                    f"{ask.floor_ms / (plan['floor_s'] * 1e3):.1f}x the model's) times the predicted ratio "
                    f"{plan['ratio']:.2f}, {ask.full_ms / (ask.floor_ms * plan['ratio']):.1f}x")
        memory = "" if ask.memory_ratio is None else f"; its peak memory {ask.memory_ratio:.1f}x the head's"
        out.append({"name": f"MLM head fwd+bwd ({model}, {int(case['tokens']):,} tokens, {int(case['predictions']):,} "
                            f"labelled, bf16) >= {MLM_HEAD_VS_FULL:g}x the full-sequence head in time on the "
                            f"{ask.device['name']}: {ask.needed_ms:.2f} ms, as the full head's {ask.full_ms:.2f} ms "
                            f"sets it ({os.path.basename(ask.run)}{memory}); the head predicted {predicted_ms:.2f} ms "
                            "on that GPU" + at_floor,
                    "predicted": speedup, "target": MLM_HEAD_VS_FULL, "unit": "x", "met": speedup >= MLM_HEAD_VS_FULL,
                    "ceiling": ask.full_ms / (plan["floor_s"] * plan["ceiling"] * 1e3),
                    "ceiling_why": "the head at its ceiling: its GEMMs at the GEMM rate and only the lines no "
                                   "design around library GEMMs avoids (perfmodel/head.py)",
                    "baseline": FULL_HEAD, "run": ask.run, "needed_ms": ask.needed_ms, "predicted_ms": predicted_ms})
    return out


def out_of_reach(target: Dict[str, object]) -> Optional[str]:
    """Why a target line's target lies beyond its ceiling, or None (a ceiling is the least a target's
    measure could be where the target is an upper bound: a ratio "at most", the MLM head's)."""
    at_most = str(target.get("unit", "")).endswith("(at most)")
    if "ceiling" in target and (target["ceiling"] > target["target"] if at_most else
                                target["ceiling"] < target["target"]):
        return target.get("ceiling_why", "out of reach by memory-bound work alone")
    return None
