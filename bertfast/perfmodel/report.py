"""`bertfast perf-model`: the predicted H100 speed of bertfast's Triton kernels, read from their sm_90
SASS, against the benchmark targets; beside the measured figures of a committed GPU run, with the
overlap constant refitted to them. Predictions are a plan, never a measurement (docs/perf-model.md).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from bertfast.perfmodel import kernels as K
from bertfast.perfmodel.hardware import H100, Gpu
from bertfast.perfmodel.model import Prediction, time_with_overlap

# The training shapes the targets are stated at (benchmarks/README.md): BERT-large, 16,384 tokens,
# bf16 activations, fp32 parameters, dropout 0.1, and without dropout for the dropout's cost.
TARGET_SETTINGS = (K.Setting("bert-large", 512, 32, 0.1), K.Setting("bert-large", 512, 32, 0.0))
# The GPU benchmark's attention case (kernel suite: batch 32, seq 512, 12 heads of 64, no padding).
MEASURED_SETTINGS = (K.Setting("bert-base", 512, 32, 0.1), K.Setting("bert-base", 512, 32, 0.0))
ROW_OPS = ("bias_gelu", "bias_dropout_residual_layernorm", "embeddings")
ATTENTION_TFLOPS_TARGET = 215.0   # benchmarks/README: FlashAttention-2's published H100 figure
DROPOUT_COST_TARGET = 0.60        # dropout's extra main-loop instructions per element, fwd+bwd
ROW_OP_BANDWIDTH_TARGET = 0.90    # of the achievable copy bandwidth
# Attention FLOPs credited per score element (4·D forward, 10·D backward; what the benchmark divides by).
CREDITED = {"fwd": 4 * K.HEAD_DIM, "bwd": 10 * K.HEAD_DIM}
DIRECTION = {"_attention_fwd_kernel": "fwd", "_attention_bwd_delta_kernel": "bwd", "_attention_bwd_dq_kernel": "bwd",
             "_attention_bwd_dkdv_kernel": "bwd"}


@dataclass
class KernelResult:
    setting: K.Setting
    op: str
    kernel: str
    variant: str
    config: str
    registers: Optional[int]
    hbm_bytes: float
    prediction: Optional[Prediction]

    def direction(self) -> str:
        if self.kernel in DIRECTION:
            return DIRECTION[self.kernel]
        return "bwd" if "_bwd_" in self.kernel or self.kernel.startswith("_table_grads") else "fwd"

    def to_dict(self) -> Dict[str, object]:
        return {"setting": self.setting.label(), "op": self.op, "kernel": self.kernel, "variant": self.variant,
                "config": self.config, "registers": self.registers, "hbm_bytes": self.hbm_bytes,
                "prediction": None if self.prediction is None else self.prediction.to_dict()}


def _variant(meta: Dict[str, object]) -> str:
    flags = {k: v for k, v in meta.items() if k.isupper() and not k.startswith("BLOCK")}
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(flags.items()))


def _config(meta: Dict[str, object]) -> str:
    blocks = " ".join(f"{k}={v}" for k, v in sorted(meta.items()) if k.startswith("BLOCK"))
    return f"{blocks} w={meta.get('num_warps', '-')}"


def analyse(settings: Sequence[K.Setting], gpu: Gpu = H100, log=print) -> List[KernelResult]:
    """Compile, read and predict every modelled kernel launch at each setting (compiles are shared)."""
    compiled: Dict[Tuple, K.Compiled] = {}
    results: List[KernelResult] = []
    with K.offline_triton():
        for setting in settings:
            start = time.perf_counter()
            launches = K.record(setting)
            for launch in launches:
                if launch.kernel not in K.WORK:
                    continue
                key = (launch.kernel, tuple(sorted((k, str(v)) for k, v in launch.meta.items())),
                       tuple(str(getattr(a, "dtype", "")) for a in launch.args))
                if key not in compiled:
                    compiled[key] = K.compile_launch(launch)
                done = replace(compiled[key], launch=launch)
                prediction = K.predict_launch(setting, done, gpu)
                work = K.WORK[launch.kernel](setting, launch, gpu)
                results.append(KernelResult(setting, launch.op, launch.kernel, _variant(launch.meta),
                                            _config(launch.meta), done.registers, work.hbm_bytes, prediction))
            log(f"[perf-model] {setting.label()}: {len(launches)} launches read in "
                f"{time.perf_counter() - start:.1f} s")
    return results


# --------------------------------------------------------------------------- aggregates
def _of(results: Sequence[KernelResult], setting: K.Setting, op: str) -> List[KernelResult]:
    return [r for r in results if r.setting == setting and r.op == op and r.prediction is not None]


def attention_figures(results: Sequence[KernelResult], setting: K.Setting, overlap: Optional[float] = None,
                      gpu: Gpu = H100) -> Dict[str, Dict[str, float]]:
    """{fwd, bwd, fwd+bwd: {seconds, tflops, instructions_per_element}} of the attention at ``setting``."""
    from bertfast.gpucheck.compile_report import MODELS
    heads = MODELS[setting.model][0] // K.HEAD_DIM
    scores = setting.batch * heads * setting.seq ** 2
    out: Dict[str, Dict[str, float]] = {}
    for direction in ("fwd", "bwd"):
        rows = [r for r in _of(results, setting, "attention") if r.direction() == direction]
        seconds = sum(r.prediction.predicted_s if overlap is None else time_with_overlap(r.prediction, overlap)
                      for r in rows)
        per_element = sum(r.prediction.per_element["total"] for r in rows if r.prediction.loop)
        out[direction] = {"seconds": seconds, "tflops": CREDITED[direction] * scores / seconds / 1e12,
                          "instructions_per_element": per_element}
    total = out["fwd"]["seconds"] + out["bwd"]["seconds"]
    out["fwd+bwd"] = {"seconds": total, "tflops": (CREDITED["fwd"] + CREDITED["bwd"]) * scores / total / 1e12,
                      "instructions_per_element": out["fwd"]["instructions_per_element"]
                      + out["bwd"]["instructions_per_element"]}
    return out


def row_op_figures(results: Sequence[KernelResult], setting: K.Setting, gpu: Gpu = H100) -> List[Dict[str, object]]:
    """Each row op's training launch (the first recorded, with every feature on) per direction: its
    effective bandwidth against the achievable copy bandwidth."""
    out = []
    for op in ROW_OPS:
        seen = set()
        for r in _of(results, setting, op):
            if r.direction() in seen:
                continue
            seen.add(r.direction())
            bandwidth = r.hbm_bytes / r.prediction.predicted_s
            out.append({"op": op, "direction": r.direction(), "kernel": r.kernel, "bytes": r.hbm_bytes,
                        "seconds": r.prediction.predicted_s, "bytes_per_s": bandwidth,
                        "fraction": bandwidth / gpu.achievable_hbm_bytes_per_s, "binding": r.prediction.binding})
    return out


def targets(results: Sequence[KernelResult], gpu: Gpu = H100) -> List[Dict[str, object]]:
    """The benchmark targets the kernels' prediction can be held to: name, predicted, target, unit, met
    (None: not predicted yet, with the reason)."""
    with_dropout, without = TARGET_SETTINGS
    att = attention_figures(results, with_dropout, gpu=gpu)
    plain = attention_figures(results, without, gpu=gpu)
    cost = att["fwd+bwd"]["instructions_per_element"] / plain["fwd+bwd"]["instructions_per_element"] - 1
    out = [{"name": "attention fwd+bwd, head dim 64, seq 512, dropout 0.1 (BERT-large)",
            "predicted": att["fwd+bwd"]["tflops"], "target": ATTENTION_TFLOPS_TARGET, "unit": "TFLOP/s",
            "met": att["fwd+bwd"]["tflops"] >= ATTENTION_TFLOPS_TARGET},
           {"name": "attention dropout cost: extra main-loop instructions per element, fwd+bwd",
            "predicted": 100 * cost, "target": 100 * DROPOUT_COST_TARGET, "unit": "% (at most)",
            "met": cost <= DROPOUT_COST_TARGET}]
    for row in row_op_figures(results, with_dropout, gpu):
        out.append({"name": f"{row['op']} {row['direction']} (BERT-large, 16,384 tokens, dropout 0.1)",
                    "predicted": 100 * row["fraction"], "target": 100 * ROW_OP_BANDWIDTH_TARGET,
                    "unit": "% of achievable copy bandwidth", "met": row["fraction"] >= ROW_OP_BANDWIDTH_TARGET})
    for name in ("BERT-large phase 1 step (seq 128) >= 50% MFU", "BERT-large phase 2 step (seq 512) >= 45% MFU",
                 "BERT-base phase 1 step (seq 128) >= 50% MFU"):
        out.append({"name": name, "predicted": None, "target": None, "unit": "% MFU", "met": None,
                    "why": "not predicted yet: the step budget (GEMMs, optimizer, casts, launch gaps) is to come"})
    return out


# --------------------------------------------------------------------------- measured runs
def measured_attention(path: str) -> Dict[Tuple[float, str], float]:
    """{(dropout, fwd|bwd): median seconds} of a committed GPU run's Triton varlen attention at the
    benchmark's case (batch 32, seq 512, 12 heads of 64, no padding)."""
    with open(path, encoding="utf-8") as f:
        run = json.load(f)
    out = {}
    for row in run.get("rows", []):
        case = row.get("case", {})
        if (row.get("group") == "attention" and row.get("impl") == "bertfast:triton varlen"
                and row.get("status") == "ok" and row.get("direction") in ("fwd", "bwd")
                and (case.get("batch"), case.get("seqlen"), case.get("heads"), case.get("head_dim"),
                     case.get("padding")) == (32, 512, 12, 64, "none")):
            out[(float(case.get("dropout", 0.0)), row["direction"])] = row["time_ms"]["median"] / 1e3
    return out


RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks",
                       "results")


def latest_gpu_run(root: str = RESULTS) -> Optional[str]:
    """The newest committed GPU run (benchmarks/results/<gpu>/<date>/) that has the attention case."""
    runs = [p for p in glob.glob(os.path.join(root, "*", "*", "results.json")) if measured_attention(p)]
    return max(runs, key=lambda p: os.path.basename(os.path.dirname(p))) if runs else None


def fit_overlap(results: Sequence[KernelResult], measured: Dict[Tuple[float, str], float]) -> Optional[float]:
    """The overlap constant that best fits the measured attention times (least squares: each
    predicted time is linear in it)."""
    num = den = 0.0
    for setting in MEASURED_SETTINGS:
        for direction in ("fwd", "bwd"):
            seconds = measured.get((setting.dropout, direction))
            rows = [r for r in _of(results, setting, "attention") if r.direction() == direction]
            if seconds is None or not rows:
                continue
            base = sum(time_with_overlap(r.prediction, 0.0) for r in rows)
            slope = sum(time_with_overlap(r.prediction, 1.0) for r in rows) - base
            num += slope * (seconds - base)
            den += slope * slope
    return num / den if den else None


# --------------------------------------------------------------------------- output
def kernel_table(results: Sequence[KernelResult]) -> str:
    header = ("setting", "kernel", "variant", "config", "regs", "instr/elem", "binding", "tensor us", "issue us",
              "pipe us", "memory us", "predicted us")
    lines = [header]
    for r in results:
        p = r.prediction
        if p is None:
            continue
        b = p.bounds_s
        lines.append((r.setting.label(), r.kernel.strip("_").replace("_kernel", ""), r.variant, r.config,
                      str(r.registers or "-"), f"{p.per_element['total']:.1f}", p.binding,
                      *(f"{b[k] * 1e6:.1f}" for k in ("tensor", "issue", "pipe", "memory")),
                      f"{p.predicted_s * 1e6:.1f}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bertfast perf-model",
        description="Predicted H100 speed of bertfast's Triton kernels, read from their sm_90 SASS (no GPU "
                    "needed), against the benchmark targets; beside a committed GPU run's measurements. "
                    "Predictions, not measurements.")
    p.add_argument("--json", default=None, metavar="FILE", help="write the targets and every kernel's figures")
    p.add_argument("--measured", default=None, metavar="RESULTS_JSON",
                   help="a GPU run's results.json to compare with (default: the latest committed one under "
                        "benchmarks/results/ with the attention case)")
    p.add_argument("--no-measured", action="store_true", help="no comparison with a GPU run (faster)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    from bertfast.perfmodel.sass import find_cuobjdump
    if find_cuobjdump() is None:
        print("bertfast perf-model: no cuobjdump (Triton's NVIDIA backend carries one; or put the CUDA toolkit's "
              "bin on PATH)", file=sys.stderr)
        return 2
    measured_path = None if args.no_measured else (args.measured or latest_gpu_run())
    settings = list(TARGET_SETTINGS) + (list(MEASURED_SETTINGS) if measured_path else [])
    results = analyse(settings)
    gpu = H100
    print(f"\nPredicted for an {gpu.name} ({gpu.sms} SMs at {gpu.clock_hz / 1e9:.2f} GHz, "
          f"{gpu.achievable_hbm_bytes_per_s / 1e12:.1f} TB/s achievable, overlap {gpu.overlap:g}); "
          "first autotune candidate of each kernel. Predictions, not measurements.\n")
    print(kernel_table([r for r in results if r.setting in TARGET_SETTINGS]))
    print()
    for setting in TARGET_SETTINGS:
        att = attention_figures(results, setting)
        print(f"attention, {setting.label()}: " + "; ".join(
            f"{d} {att[d]['seconds'] * 1e6:.0f} us, {att[d]['tflops']:.0f} TFLOP/s, "
            f"{att[d]['instructions_per_element']:.1f} instr/elem" for d in ("fwd", "bwd", "fwd+bwd")))
    comparison = None
    if measured_path:
        measured = measured_attention(measured_path)
        fitted = fit_overlap(results, measured)
        comparison = {"run": measured_path, "overlap_fitted": fitted, "rows": []}
        shown = os.path.relpath(measured_path, os.path.dirname(os.path.dirname(RESULTS)))
        print(f"\nmeasured ({shown}) beside predicted, attention batch 32, seq 512, 12 heads of 64:")
        for setting in MEASURED_SETTINGS:
            now = attention_figures(results, setting)
            refit = attention_figures(results, setting, overlap=fitted) if fitted is not None else None
            for direction in ("fwd", "bwd"):
                seconds = measured.get((setting.dropout, direction))
                if seconds is None:
                    continue
                row = {"dropout": setting.dropout, "direction": direction, "measured_s": seconds,
                       "predicted_s": now[direction]["seconds"],
                       "refitted_s": refit[direction]["seconds"] if refit else None}
                comparison["rows"].append(row)
                print(f"  p={setting.dropout:g} {direction}: measured {seconds * 1e6:.0f} us, predicted "
                      f"{row['predicted_s'] * 1e6:.0f} us (overlap {gpu.overlap:g})"
                      + (f", {row['refitted_s'] * 1e6:.0f} us refitted (overlap {fitted:.2f})" if refit else ""))
        print("  (the run's configs were autotuned; these predictions read the first candidate of each kernel)")
    goals = targets(results)
    print("\ntargets (predicted):")
    for t in goals:
        if t["met"] is None:
            print(f"  [not predicted] {t['name']}: {t['why']}")
        else:
            print(f"  [{'met' if t['met'] else 'NOT MET'}] {t['name']}: {t['predicted']:.1f} {t['unit']} "
                  f"(target {t['target']:g})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"gpu": gpu.name, "overlap": gpu.overlap, "targets": goals,
                       "kernels": [r.to_dict() for r in results], "measured": comparison}, f, indent=1)
    predicted = [t for t in goals if t["met"] is not None]
    print(f"\npredicted: {sum(1 for t in predicted if t['met'])} of {len(predicted)} targets met"
          + (f" ({len(goals) - len(predicted)} not predicted yet)" if len(predicted) < len(goals) else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
