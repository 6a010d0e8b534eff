"""`bertfast perf-model`: the predicted H100 speed of bertfast's Triton kernels, read from their sm_90
SASS, against the benchmark targets, and the CUDA attention's kernels beside Triton's; beside the
measured figures of a committed GPU run, with the overlap and memory constants refitted to them.
Predictions are a plan, never a measurement (docs/perf-model.md).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from bertfast import registry
from bertfast.bench.thresholds import ATTENTION_TFLOPS, ROW_OP_BANDWIDTH
from bertfast.perfmodel import cuda as CU
from bertfast.perfmodel import finetune as FT
from bertfast.perfmodel import head as HEAD
from bertfast.perfmodel import kernels as K
from bertfast.perfmodel import reach as R
from bertfast.perfmodel import step as S
from bertfast.perfmodel import suite as SU
from bertfast.perfmodel.hardware import H100, Gpu
from bertfast.perfmodel.model import Prediction, fit_constant, predict, retime, streaming, time_with_overlap
from bertfast.perfmodel.runs import (REPO, RESULTS, Profile, changed_since, latest_profile, profiled_tokens,
                                     read_profile, run_gpu)

# The training shapes the targets are stated at (benchmarks/README.md): BERT-large, 16,384 tokens,
# bf16 activations, fp32 parameters, dropout 0.1, and without dropout for the dropout's cost.
TARGET_SETTINGS = (K.Setting("bert-large", 512, 32, 0.1), K.Setting("bert-large", 512, 32, 0.0))
DROPOUT_COST_TARGET = 0.60        # dropout's extra main-loop instructions per element, fwd+bwd
# Attention FLOPs credited per score element (4·D forward, 10·D backward; what the benchmark divides by).
CREDITED = {"fwd": 4 * K.HEAD_DIM, "bwd": 10 * K.HEAD_DIM}
# The ops and kernels whose every autotune candidate is predicted, the fastest kept, as a GPU run's
# autotuner keeps the fastest it times: the tensor-core kernels (the attention's, the FFN's GEMMs with GELU
# epilogues), whose configs' occupancy decides what their schedules leave exposed (schedule.py). The row
# kernels, bound by memory, keep their first candidate.
TUNED_OPS = ("attention", "_gemm_bias_gelu_kernel")
DIRECTION = {"_attention_fwd_kernel": "fwd", "_attention_bwd_delta_kernel": "bwd", "_attention_bwd_dq_kernel": "bwd",
             "_attention_bwd_dkdv_kernel": "bwd", "_attention_bwd_fused_kernel": "bwd"}


@dataclass
class KernelResult:
    setting: K.Setting
    op: str
    kernel: str
    variant: str
    config: str
    registers: Optional[int]
    hbm_bytes: float  # what the op must move (the prediction also prices its overhead: partial sums)
    prediction: Optional[Prediction]
    tuned: bool = False  # config is the one a GPU run's autotuner chose (else the first candidate)
    candidates: int = 1  # the candidates predicted, the fastest kept (analyse's fastest); 1: the config as said

    def direction(self) -> str:
        if self.kernel in DIRECTION:
            return DIRECTION[self.kernel]
        return "bwd" if "_bwd_" in self.kernel or self.kernel.startswith("_table_") else "fwd"

    def to_dict(self) -> Dict[str, object]:
        return {"setting": self.setting.label(), "op": self.op, "kernel": self.kernel, "variant": self.variant,
                "config": self.config, "tuned": self.tuned, "candidates": self.candidates,
                "registers": self.registers, "hbm_bytes": self.hbm_bytes,
                "prediction": None if self.prediction is None else self.prediction.to_dict()}


def _variant(meta: Dict[str, object]) -> str:
    flags = {k: v for k, v in meta.items() if k.isupper() and not k.startswith("BLOCK")}
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(flags.items()))


def _config(meta: Dict[str, object]) -> str:
    blocks = " ".join(f"{k}={v}" for k, v in sorted(meta.items()) if k.startswith("BLOCK"))
    return f"{blocks} w={meta.get('num_warps', '-')}"


_COMPILED: Dict[Tuple, K.Compiled] = {}  # one compile per kernel variant and config, shared by the settings


def analyse(settings: Sequence[K.Setting], gpu: Gpu = H100, log=print,
            tuned: Optional[Dict[str, Dict[Tuple, str]]] = None,
            ops: Optional[Sequence[str]] = None, dq_mode: str = "deterministic",
            lengths: Optional[Sequence[int]] = None, fastest: Sequence[str] = ()) -> List[KernelResult]:
    """Compile, read and predict every modelled kernel launch (of ``ops``, default every priced op) at
    each setting, for ``gpu``: each kernel's first candidate, or the config ``tuned`` names (a GPU
    run's choices: Profile.tuned), or for the ops in ``fastest`` every candidate, the one predicted
    fastest kept (what a GPU run's autotuner does, were the predictions its timings); the attention's
    backward in ``dq_mode`` (kernels.record). With ``lengths``, the attention's kernels work on
    sequences of those lengths padded to the setting's (kernels.at_lengths), their results still
    labelled with the setting."""
    results: List[KernelResult] = []
    with K.offline_triton():
        for setting in settings:
            start = time.perf_counter()
            launches = K.record(setting, ops=ops, tuned=tuned, dq_mode=dq_mode, candidates=fastest)
            results.extend(_fastest(launches, setting, gpu, lengths))
            log(f"[perf-model] {setting.label()}: {len(launches)} launches read in "
                f"{time.perf_counter() - start:.1f} s")
    return results


def _fastest(launches: Sequence[K.Launch], setting: K.Setting, gpu: Gpu,
             lengths: Optional[Sequence[int]] = None) -> List[KernelResult]:
    """Each recorded call's prediction (the modelled kernels'), its candidate predicted fastest; compiled
    once per process (offline Triton set: analyse)."""
    kept: Dict[int, Tuple[Tuple[bool, float], KernelResult]] = {}
    for launch in launches:
        if launch.kernel not in K.WORK:
            continue
        key = (launch.kernel, tuple(sorted((k, str(v)) for k, v in launch.meta.items())),
               tuple(str(getattr(a, "dtype", "")) for a in launch.args))
        if key not in _COMPILED:
            _COMPILED[key] = K.compile_launch(launch)
        done = _COMPILED[key]
        work = K.WORK[launch.kernel](setting, launch, gpu)
        if lengths is not None and launch.op == "attention":
            work = K.at_lengths(work, launch, setting, lengths, gpu)
        work.registers, work.shared_bytes = done.registers, done.shared_bytes
        prediction = predict(done.function, work, gpu)
        if done.spills:  # local-memory traffic the model does not price
            prediction.notes.append(f"spills {done.spills} bytes of registers")
        result = KernelResult(setting, launch.op, launch.kernel, _variant(launch.meta), _config(launch.meta),
                              done.registers, work.hbm_bytes, prediction, launch.tuned, launch.candidates)
        # a candidate that spills or does not fit is slower than predicted (neither is priced)
        rank = (bool(done.spills) or "does not fit" in " ".join(prediction.notes), prediction.predicted_s)
        if launch.call not in kept or rank < kept[launch.call][0]:
            kept[launch.call] = (rank, result)
    return [kept[call][1] for call in sorted(kept)]


def fused_head_kernels(gpu: Gpu = H100, hiddens: Sequence[int] = (1024, 768)) -> Dict[int, Dict[str, object]]:
    """The fused MLM decoder's own kernels (BERTFAST_MLM_HEAD=fused, kernels/mlm_head_loss.py) at the kernel
    suite's case, per hidden size, each at its candidate predicted fastest: the forward GEMM, the statistics'
    kernel and the backward's two GEMMs (the input gradient's at the vocabulary split the launcher picks for the
    GPU's SMs, its partials' sum in its epilogue; the small steps between them are priced by their bytes:
    perfmodel/head.py, fused_lines)."""
    import torch

    from bertfast.kernels import mlm_head_loss as M
    out: Dict[int, Dict[str, object]] = {}
    with K.offline_triton():
        for hidden in hiddens:
            model = {1024: "bert-large", 768: "bert-base"}.get(hidden, "bert-large")
            setting = K.Setting(model, HEAD.SEQ, HEAD.TOKENS // HEAD.SEQ, 0.1)
            rows = HEAD.lines(hidden)["rows"]
            x = torch.empty(rows, hidden, dtype=torch.bfloat16)
            w = torch.empty(HEAD.VOCAB, hidden, dtype=torch.bfloat16)
            bias = torch.empty(HEAD.VOCAB, dtype=torch.bfloat16)
            labels = torch.zeros(rows, dtype=torch.int64)
            split = M.dx_split(rows, hidden, gpu.sms)

            def head():
                # the labels' range checked in the statistics kernel, as the kernel suite's case (on the device)
                softmax = M.mlm_logits_gemm_fwd(x, w, bias, labels, torch.empty(rows, dtype=torch.bool))[3]
                M.mlm_softmax_gemms_bwd(softmax, labels, x, w, torch.empty(()), w.dtype, True, split)
            found = {r.kernel: r for r in _fastest(K.record_call("mlm_head_loss", head), setting, gpu)}
            kernels = {"forward": "_mlm_logits_gemm_kernel", "stats": "_logits_stats_kernel",
                       "dx": "_softmax_dx_gemm_kernel", "dw": "_softmax_dw_gemm_kernel"}
            out[hidden] = {f"{key}_s": found[name].prediction.predicted_s for key, name in kernels.items()}
            out[hidden].update({f"{key}_config": found[name].config for key, name in kernels.items()},
                               dx_split=split, binding=found["_mlm_logits_gemm_kernel"].prediction.binding)
    return out


# --------------------------------------------------------------------------- aggregates
def _of(results: Sequence[KernelResult], setting: K.Setting, op: str) -> List[KernelResult]:
    return [r for r in results if r.setting == setting and r.op == op and r.prediction is not None]


def heads(setting: K.Setting) -> int:
    """The attention heads of ``setting``'s model (head dim 64)."""
    from bertfast.gpucheck.compile_report import MODELS
    return MODELS[setting.model][0] // K.HEAD_DIM


def score_elements(setting: K.Setting) -> int:
    """The attention's score elements at ``setting`` (full lengths): batch x heads x seq^2."""
    return setting.batch * heads(setting) * setting.seq ** 2


def attention_tflops(setting: K.Setting, direction: str, seconds: float) -> float:
    """TFLOP/s as the benchmark credits the attention (CREDITED per score element; fwd+bwd: both)."""
    credited = CREDITED["fwd"] + CREDITED["bwd"] if direction == "fwd+bwd" else CREDITED[direction]
    return credited * score_elements(setting) / seconds / 1e12


def attention_figures(results: Sequence[KernelResult], setting: K.Setting) -> Dict[str, Dict[str, float]]:
    """{fwd, bwd, fwd+bwd: {seconds, tflops, instructions_per_element}} of the attention at ``setting``."""
    out: Dict[str, Dict[str, float]] = {}
    for direction in ("fwd", "bwd"):
        rows = [r for r in _of(results, setting, "attention") if r.direction() == direction]
        seconds = sum(r.prediction.predicted_s for r in rows)
        per_element = sum(r.prediction.per_element["total"] for r in rows if r.prediction.loop)
        out[direction] = {"seconds": seconds, "tflops": attention_tflops(setting, direction, seconds),
                          "instructions_per_element": per_element}
    total = out["fwd"]["seconds"] + out["bwd"]["seconds"]
    out["fwd+bwd"] = {"seconds": total, "tflops": attention_tflops(setting, "fwd+bwd", total),
                      "instructions_per_element": out["fwd"]["instructions_per_element"]
                      + out["bwd"]["instructions_per_element"]}
    return out


def atomic_dq_figures(deterministic: Sequence[KernelResult], gpu: Gpu = H100, log=print) -> List[Dict[str, object]]:
    """The attention at the targets' settings with the backward's atomic dQ (kernels/attention.py, "Atomic
    dQ"; BERTFAST_ATTENTION_DQ=atomic) beside the default, deterministic one (``deterministic``: analyse's
    results): its kernels' predictions and the fp32 accumulator's zero fill at the achievable bandwidth."""
    results = analyse(TARGET_SETTINGS, gpu, log=lambda m: None, ops=["attention"], dq_mode="atomic",
                      fastest=TUNED_OPS)
    rows = []
    for setting in TARGET_SETTINGS:
        plain = attention_figures(deterministic, setting)
        atomic = attention_figures(results, setting)
        fill = setting.tokens * heads(setting) * K.HEAD_DIM * 4 / gpu.achievable_hbm_bytes_per_s
        bwd = atomic["bwd"]["seconds"] + fill
        total = atomic["fwd"]["seconds"] + bwd
        kernels = {r.kernel: r.prediction.predicted_s for r in _of(results, setting, "attention")
                   if r.direction() == "bwd"}
        row = {"setting": setting.label(), "bwd_s": bwd, "fill_s": fill, "kernels_s": kernels,
               "deterministic_bwd_s": plain["bwd"]["seconds"], "tflops": attention_tflops(setting, "fwd+bwd", total),
               "deterministic_tflops": plain["fwd+bwd"]["tflops"]}
        rows.append(row)
        log(f"attention with the atomic dQ (BERTFAST_ATTENTION_DQ=atomic), {setting.label()}: bwd "
            f"{bwd * 1e6:.0f} us (" + ", ".join(f"{k.strip('_').replace('_kernel', '')} {t * 1e6:.0f}"
                                                for k, t in kernels.items())
            + f", the accumulator's zero fill {fill * 1e6:.0f}) where the deterministic takes "
            f"{plain['bwd']['seconds'] * 1e6:.0f}; fwd+bwd {row['tflops']:.0f} TFLOP/s "
            f"({row['deterministic_tflops']:.0f})")
    return rows


# Kernels that finish a row op's direction after its own kernel: the embeddings' walk by position and
# rows pass.
LATER_PASSES = ("_embeddings_bwd_pos_kernel", "_table_rows_kernel")


def row_op_figures(results: Sequence[KernelResult], setting: K.Setting, gpu: Gpu = H100) -> List[Dict[str, object]]:
    """Each row op's first training launch per direction and the LATER_PASSES that finish it: the op's
    bytes over their time against the achievable copy bandwidth. The embeddings' bytes are the bench's
    contract (fp32 tables, int64 ids, bf16 output, as recorded), another op's its one kernel's."""
    from bertfast.bench.flops import embeddings_bytes
    from bertfast.gpucheck.compile_report import MODELS
    out = []
    for op in registry.names(registry.ROW):
        firsts: Dict[str, KernelResult] = {}
        passes: Dict[str, Dict[str, KernelResult]] = {}
        for r in _of(results, setting, op):
            if r.kernel in LATER_PASSES:
                passes.setdefault(r.direction(), {}).setdefault(r.kernel, r)
            else:
                firsts.setdefault(r.direction(), r)
        for direction, first in firsts.items():
            kernels = [first, *passes.get(direction, {}).values()]
            seconds = sum(r.prediction.predicted_s for r in kernels)
            moved = first.hbm_bytes if op != "embeddings" else embeddings_bytes(
                setting.tokens, MODELS[setting.model][0], S.VOCAB, S.POSITIONS, S.TYPES, 8, 4, 2, direction)
            # What the kernels move (their partial sums, the embeddings' second walk and sort keys
            # included): at the achievable bandwidth, the op's fraction can be no higher than ``ceiling``.
            kernel_bytes = sum(r.prediction.bounds_s["memory"] for r in kernels) * gpu.achievable_hbm_bytes_per_s
            out.append({"op": op, "direction": direction, "kernel": " + ".join(r.kernel for r in kernels),
                        "bytes": moved, "seconds": seconds, "bytes_per_s": moved / seconds,
                        "fraction": moved / seconds / gpu.achievable_hbm_bytes_per_s,
                        "kernel_bytes": kernel_bytes, "ceiling": moved / kernel_bytes,
                        "binding": ", ".join(r.prediction.binding for r in kernels)})
    return out


def targets(results: Sequence[KernelResult], gpu: Gpu = H100) -> List[Dict[str, object]]:
    """The benchmark targets the prediction is held to: name, predicted, target, unit, met."""
    with_dropout, without = TARGET_SETTINGS
    att = attention_figures(results, with_dropout)
    plain = attention_figures(results, without)
    cost = att["fwd+bwd"]["instructions_per_element"] / plain["fwd+bwd"]["instructions_per_element"] - 1
    out = [{"name": "attention fwd+bwd, head dim 64, seq 512, dropout 0.1 (BERT-large)",
            "predicted": att["fwd+bwd"]["tflops"], "target": ATTENTION_TFLOPS, "unit": "TFLOP/s",
            "met": att["fwd+bwd"]["tflops"] >= ATTENTION_TFLOPS},
           {"name": "attention dropout cost: extra main-loop instructions per element, fwd+bwd",
            "predicted": 100 * cost, "target": 100 * DROPOUT_COST_TARGET, "unit": "% (at most)",
            "met": cost <= DROPOUT_COST_TARGET}]
    for row in row_op_figures(results, with_dropout, gpu):
        out.append({"name": f"{row['op']} {row['direction']} (BERT-large, 16,384 tokens, dropout 0.1)",
                    "predicted": 100 * row["fraction"], "target": 100 * ROW_OP_BANDWIDTH,
                    "unit": "% of achievable copy bandwidth", "met": row["fraction"] >= ROW_OP_BANDWIDTH,
                    "ceiling": 100 * row["ceiling"],
                    "ceiling_why": f"its kernels move {row['kernel_bytes'] / 1e6:.0f} MB where the op's contract "
                                   f"is {row['bytes'] / 1e6:.0f} MB"})
    fused = fused_head_kernels(gpu)
    out += [HEAD.target(hidden, gpu, fused[hidden]) for hidden in (1024, 768)]  # BERT-large's and BERT-base's heads
    for case in S.STEP_CASES:
        plan = S.budget(results, case, gpu)
        out.append({"name": f"{case.name} MFU", "predicted": 100 * plan["mfu"], "target": 100 * case.target_mfu,
                    "unit": "% MFU (device time; a CUDA-graph step)", "met": plan["mfu"] >= case.target_mfu,
                    "ceiling": 100 * plan["ceiling"]["mfu"]})
    for case in FT.cases():  # the padded batch's attention at its lengths: the full batch's launches, tuned
        # on the padded batch, as a fine-tuning run's autotuner tunes on its own first batch
        padded = analyse([FT.full_setting(*case)], gpu, log=lambda m: None, ops=["attention"],
                         lengths=FT.lengths(*case), fastest=TUNED_OPS)
        out.append(FT.target(FT.plan(results, padded, case, gpu)))
    return out


def refitted_steps(results: List[KernelResult], refit: Tuple[float, float, float], gpu: Gpu = H100):
    """The step budgets with the kernels retimed under refitted constants (overlap, memory_overlap, a
    factor on the memory latency): the targets' steps as a GPU run's measurements would price them."""
    overlap, memory_overlap, latency_factor = refit
    retimed = [replace(r, prediction=replace(r.prediction, predicted_s=retime(r.prediction, *refit)))
               if r.prediction is not None else r for r in results]
    refit_gpu = replace(gpu, overlap=overlap, memory_overlap=memory_overlap,
                        memory_latency_s=gpu.memory_latency_s * latency_factor)
    return [S.budget(retimed, case, refit_gpu) for case in S.STEP_CASES]


# --------------------------------------------------------------------------- measured beside predicted
def compare(results: Sequence[KernelResult], profile: Profile) -> List[Dict[str, object]]:
    """Each modelled kernel the profile timed: measured and predicted seconds per call (the first
    launch recorded of that kernel at the profile's case: the training variant), and whether its
    source (kernels/<op>.py, kernels/_rows.py for a row op, the files kernels.SHARED_SOURCES names for
    it) changed since the run: then the run measured other code.

    A call is a layer's: a kernel with a few calls more than a whole number per layer (the MLM head's
    bias+GELU and LayerNorm over its masked rows, a sixth of a layer's LayerNorm rows at most) has its
    time divided by the layers' calls alone, which overstates a layer call by that share (under 0.4%).
    A row kernel's time is linear in its rows, so it is scaled from the profiled step's real tokens to
    the prediction's full lengths (``token_scale``); the attention's, quadratic in each length, is not.
    """
    from bertfast.perfmodel.step import LAYERS
    layers = LAYERS.get(profile.setting.model, 1)
    tokens = profiled_tokens(profile)
    rows, seen = [], set()
    for r in results:
        if r.setting != profile.setting or r.prediction is None or r.kernel in seen or r.kernel not in profile.kernels:
            continue
        seen.add(r.kernel)
        ms, calls = profile.kernels[r.kernel]
        layer_calls = calls // layers * layers or calls
        row_op = registry.get(r.op).kind == registry.ROW
        scale = profile.setting.tokens / tokens if tokens and row_op else 1.0
        # A kernel a layer runs in several variants (the FFN's GEMM forward and backward, step.FFN_GEMMS)
        # is timed as one name: its calls set beside the mean of their predictions (and not fitted: the
        # constants are fitted to kernels with one prediction per measured time). Any other kernel is
        # its first launch's, the training variant.
        tags = [tag for kernel, tag in S.FFN_GEMMS if kernel == r.kernel]
        predictions = [next(v.prediction for v in results if v.setting == r.setting and v.kernel == r.kernel
                            and tag in v.variant and v.prediction is not None) for tag in tags] or [r.prediction]
        rows.append({"kernel": r.kernel, "measured_s": ms / 1e3 / layer_calls * scale, "calls": calls,
                     "layer_calls": layer_calls, "token_scale": scale, "tuned_config": r.tuned,
                     "predicted_s": sum(p.predicted_s for p in predictions) / len(predictions),
                     "prediction": r.prediction, "predictions": predictions, "variants": len(predictions),
                     "changed_since_run": changed_since(
                         profile.path, [f"kernels/{r.op}.py"] + (["kernels/_rows.py"] if row_op else [])
                         + list(K.SHARED_SOURCES.get(r.kernel, ())), kernel=r.kernel)})
    return rows


def fit_overlap(rows: Sequence[Dict[str, object]]) -> Optional[float]:
    """The overlap constant of the kernels ``memory_overlap`` does not price, best fitting their measured
    times, relative errors weighted alike (least squares on time / measured: model.fit_constant), and
    never below 0 (perfect overlap): a kernel that runs faster than its binding bound says that bound's
    constant is low for it, not that units overlap better than perfectly. Kernels changed since the run
    are left out: their measured time is of other code; so are kernels timed under one name in several
    variants (compare). None when no row is left whose time the constant moves."""
    kept = [row for row in rows if not row.get("changed_since_run") and row.get("variants", 1) == 1
            and not streaming(row["prediction"])]
    if not any(time_with_overlap(r["prediction"], 1.0) != time_with_overlap(r["prediction"], 0.0) for r in kept):
        return None
    return fit_constant(lambda o: sum((time_with_overlap(r["prediction"], o) / r["measured_s"] - 1.0) ** 2
                                      for r in kept))


# The memory-bound fit's grid: overlaps 0 to 1, latency factors 1/4 to 4 (about 1% apart)
_OVERLAPS = [i / 100 for i in range(101)]
_FACTORS = [4.0 ** ((i - 140) / 140) for i in range(281)]


def fit_memory_constants(rows: Sequence[Dict[str, object]], gpu: Gpu = H100) -> Dict[str, Optional[float]]:
    """``memory_overlap`` and ``memory_latency_s`` best fitting the memory-bound kernels unchanged
    since the run (least squares on time / measured over a grid; the overlap never below 0). The
    latency is only fitted when some kernel's time depends on it (a latency-bound one): otherwise,
    and for a constant no row decides, None. Of equally good latencies the one nearest ``gpu``'s wins."""
    kept = [r for r in rows if not r.get("changed_since_run") and r.get("variants", 1) == 1
            and streaming(r["prediction"])]
    if not kept:
        return {"memory_overlap": None, "memory_latency_s": None}

    def loss(o: float, f: float) -> float:
        return sum((retime(r["prediction"], 0.0, o, f) / r["measured_s"] - 1.0) ** 2 for r in kept)
    best = min(((round(loss(o, f), 12), abs(math.log(f)), o, f) for o in _OVERLAPS for f in _FACTORS))
    _, _, overlap, factor = best
    decides = any(retime(r["prediction"], 0.0, overlap, f) != retime(r["prediction"], 0.0, overlap, factor)
                  for r in kept for f in (factor * 0.9, factor * 1.1))
    return {"memory_overlap": overlap, "memory_latency_s": gpu.memory_latency_s * factor if decides else None}


def suite_comparison(suite: SU.SuiteRun, log=print) -> Dict[str, object]:
    """The attention as a run's kernel suite timed it, beside its prediction at the configs that run's
    autotuner chose, and the one overlap that fits those times (perfmodel/suite.py)."""
    results = analyse(suite.settings(), suite.gpu, log=lambda m: None, tuned=suite.tuned, ops=["attention"])
    rows = SU.compare(results, suite)
    # A row whose kernels changed since the run measured other code: shown, not fitted (as in compare).
    timed = os.path.join(suite.path, "results.json")
    changed = {kernel: changed_since(timed, ["kernels/attention.py"], kernel=kernel)
               for kernel in {kernel for row in rows for kernel in row["kernels"]}}
    for row in rows:
        row["changed_since_run"] = any(changed[kernel] for kernel in row["kernels"])
    memory_overlap = suite.gpu.memory_overlap
    fitted = SU.fit_overlap([row for row in rows if not row["changed_since_run"]], memory_overlap)
    shown = os.path.relpath(suite.path, REPO)
    log(f"\nthe attention as {shown}'s kernel suite timed it ({suite.device}; the op alone, cold L2, full "
        f"lengths; predicted at {suite.gpu.achievable_hbm_bytes_per_s / 1e12:.2f} TB/s), us per call:")
    for row in rows:
        setting, direction = row["setting"], row["direction"]
        measured, predicted = row["measured_s"], row["predicted_s"]
        row["refit_s"] = SU.at_overlap(row, fitted, memory_overlap) if fitted is not None else None
        log(f"  {setting.label():38s} {direction}  measured {measured * 1e6:6.1f} "
            f"({attention_tflops(setting, direction, measured):3.0f} TFLOP/s)  predicted {predicted * 1e6:6.1f} "
            f"({attention_tflops(setting, direction, predicted):3.0f})  measured/predicted {measured / predicted:.2f}"
            + (f"  at the fitted overlap {row['refit_s'] * 1e6:6.1f}" if fitted is not None else "")
            + ("" if row["tuned"] else "  [first candidate: the run's config unknown]")
            + ("  [source changed since this run: not fitted]" if row["changed_since_run"] else ""))
    log("  one overlap fitted to these: " + (f"{fitted:.2f}" if fitted is not None else "-")
        + f" (assumed {suite.gpu.overlap:g})")
    # the run's choices beside the model's picks: the attention's, and the FFN GEMMs' where the run tuned them
    picked = analyse(suite.settings(), suite.gpu, log=lambda m: None, ops=["attention", "bias_gelu"],
                     fastest=TUNED_OPS)
    gemms = [r for r in analyse(suite.settings(), suite.gpu, log=lambda m: None, tuned=suite.tuned, ops=["bias_gelu"])
             if r.kernel in TUNED_OPS]
    choices = SU.autotuner_agreement(results + gemms, picked)
    if choices:
        log(f"  the candidate the model predicts fastest is the one the run's autotuner chose for "
            f"{sum(c['agree'] for c in choices)} of {len(choices)} kernels" + "".join(
                f"; not at {c['setting']}, {c['kernel'].strip('_')}: the run's {c['run']}, the model's {c['model']}"
                for c in choices if not c["agree"]))
    return {"run": shown, "device": suite.device, "overlap_fitted": fitted, "autotuner": choices,
            "rows": [{"setting": row["setting"].label(), "direction": row["direction"],
                      "measured_s": row["measured_s"], "predicted_s": row["predicted_s"], "refit_s": row["refit_s"],
                      "kernels": row["kernels"], "tuned": row["tuned"], "changed_since_run": row["changed_since_run"]}
                     for row in rows]}


def measured_attention_target(suite: SU.SuiteRun) -> Optional[Dict[str, object]]:
    """The attention target's case as the run's suite timed it: seq 512, dropout 0.1, forward and
    backward in one call (any heads: TFLOP/s are credited per score element); None when it did not."""
    with_dropout = TARGET_SETTINGS[0]
    for setting in suite.settings():
        seconds = suite.seconds(setting, "fwd+bwd")
        if (setting.seq, setting.dropout) == (with_dropout.seq, with_dropout.dropout) and seconds is not None:
            return {"tflops": attention_tflops(setting, "fwd+bwd", seconds), "heads": heads(setting),
                    "device": suite.device, "run": os.path.relpath(suite.path, REPO)}
    return None


# --------------------------------------------------------------------------- output
def kernel_table(results: Sequence[KernelResult]) -> str:
    header = ("setting", "kernel", "variant", "config", "regs", "instr/elem", "binding", "tensor us", "issue us",
              "pipe us", "memory us", "latency us", "schedule us", "predicted us")
    lines = [header]
    for r in results:
        p = r.prediction
        if p is None:
            continue
        b = p.bounds_s
        config = r.config + (f" ({r.candidates} tried)" if r.candidates > 1 else "")
        lines.append((r.setting.label(), r.kernel.strip("_").replace("_kernel", ""), r.variant, config,
                      str(r.registers or "-"), f"{p.per_element['total']:.1f}", p.binding,
                      *(f"{b[k] * 1e6:.1f}" for k in ("tensor", "issue", "pipe", "memory", "latency")),
                      f"{b['schedule'] * 1e6:.1f}" if b.get("schedule") else "-", f"{p.predicted_s * 1e6:.1f}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bertfast perf-model",
        description="Predicted H100 speed of bertfast's Triton kernels, read from their sm_90 SASS (no GPU "
                    "needed), against the benchmark targets, and the CUDA attention's kernels beside Triton's; "
                    "beside a committed GPU run's measurements. Predictions, not measurements.")
    p.add_argument("--json", default=None, metavar="FILE", help="write the targets and every kernel's figures")
    p.add_argument("--profile", default=None, metavar="PROFILE_TXT",
                   help="a GPU run's profile of the step (profile-graphs.txt or profile-bertfast.txt) to compare "
                        "with (default: the latest committed under benchmarks/results/, its graphed step's "
                        "profile where it has one)")
    p.add_argument("--no-measured", action="store_true", help="no comparison with a GPU run (faster)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    from bertfast.perfmodel.sass import find_cuobjdump
    if find_cuobjdump() is None:
        print("bertfast perf-model: no cuobjdump (Triton's NVIDIA backend carries one; or put the CUDA toolkit's "
              "bin on PATH)", file=sys.stderr)
        return 2
    profile = None
    if not args.no_measured:
        profile = read_profile(args.profile) if args.profile else latest_profile()
        if args.profile and profile is None:
            print(f"bertfast perf-model: {args.profile} is not a bf16 profile of the pre-training step "
                  "(bertfast/bench/profile.py's <impl>.txt)", file=sys.stderr)
            return 2
    settings = list(TARGET_SETTINGS) + [c.setting for c in S.STEP_CASES if c.setting not in TARGET_SETTINGS]
    results = analyse(settings + [FT.full_setting(*case) for case in FT.cases()],  # and the fine-tuning's
                      fastest=TUNED_OPS)
    gpu = H100
    print(f"\nPredicted for an {gpu.name} ({gpu.sms} SMs at {gpu.clock_hz / 1e9:.2f} GHz, "
          f"{gpu.achievable_hbm_bytes_per_s / 1e12:.1f} TB/s achievable, memory latency "
          f"{gpu.memory_latency_s * 1e6:.2f} us, overlap {gpu.overlap:g}, {gpu.memory_overlap:g} where memory binds); "
          "the attention's kernels and the FFN's GEMMs at the autotune candidate predicted fastest, the others at "
          "their first. "
          "Predictions, not measurements.\n")
    print(kernel_table([r for r in results if r.setting in TARGET_SETTINGS]))
    print()
    for setting in settings:  # the targets' seq 512, then the steps' (phase 1: the one-pass backward)
        if setting.model != "bert-large":
            continue
        att = attention_figures(results, setting)
        print(f"attention, {setting.label()}: " + "; ".join(
            f"{d} {att[d]['seconds'] * 1e6:.0f} us, {att[d]['tflops']:.0f} TFLOP/s, "
            f"{att[d]['instructions_per_element']:.1f} instr/elem" for d in ("fwd", "bwd", "fwd+bwd")))
    atomic_rows = atomic_dq_figures(results, gpu)
    print()
    cuda_rows = CU.beside_triton(results, [s for s in settings if s.model == "bert-large"], gpu)
    plans = [S.budget(results, case, gpu) for case in S.STEP_CASES]
    for plan in plans:
        print(f"\n{plan['case']}: {plan['seconds'] * 1e3:.1f} ms of device time, {plan['sequences_per_s']:,.0f} "
              f"sequences/s, {100 * plan['mfu']:.1f}% MFU (target {100 * plan['target_mfu']:.0f}%)")
        for item in plan["items"]:
            print(f"  {item['name']:18s} {item['seconds'] * 1e3:7.2f} ms  {item['how']}")
        ceiling = plan["ceiling"]
        print(f"  ceiling: {ceiling['seconds'] * 1e3:.1f} ms, {100 * ceiling['mfu']:.1f}% MFU, with {ceiling['how']}")
    comparison, fitted = None, None
    if profile is not None:
        measured_gpu = run_gpu(profile)
        measured_results = analyse([profile.setting], measured_gpu, log=lambda m: None, tuned=profile.tuned)
        rows = compare(measured_results, profile)
        fitted = fit_overlap(rows)
        fitted_memory = fit_memory_constants(rows, measured_gpu)
        refit = (fitted if fitted is not None else measured_gpu.overlap,
                 fitted_memory["memory_overlap"] if fitted_memory["memory_overlap"] is not None
                 else measured_gpu.memory_overlap,
                 (fitted_memory["memory_latency_s"] or measured_gpu.memory_latency_s) / measured_gpu.memory_latency_s)
        shown = os.path.relpath(profile.path, os.path.dirname(os.path.dirname(RESULTS)))
        print(f"\nmeasured beside predicted: {shown} ({profile.setting.model} seq {profile.setting.seq} batch "
              f"{profile.setting.batch} on {profile.device}; predicted for it at "
              f"{measured_gpu.achievable_hbm_bytes_per_s / 1e12:.2f} TB/s), us per layer call:")
        for row in rows:
            row["refit_s"] = sum(retime(p, *refit) for p in row["predictions"]) / len(row["predictions"])
            print(f"  {row['kernel'].strip('_').replace('_kernel', ''):38s} measured {row['measured_s'] * 1e6:7.1f}"
                  f"  predicted {row['predicted_s'] * 1e6:7.1f}  refitted {row['refit_s'] * 1e6:7.1f}"
                  + ("" if row["tuned_config"] else "  [first candidate: the run's config unknown]")
                  + ("  [source changed since this run: not fitted]" if row["changed_since_run"] else ""))
        latency = fitted_memory["memory_latency_s"]
        print("  fitted to the kernels unchanged since the run: overlap "
              + (f"{fitted:.2f}" if fitted is not None else "- (none of them has tensor-core work or is issue-bound)")
              + f" (assumed {measured_gpu.overlap:g}); memory_overlap "
              + (f"{fitted_memory['memory_overlap']:.2f}" if fitted_memory["memory_overlap"] is not None else "-")
              + f" ({measured_gpu.memory_overlap:g}); memory_latency_s "
              + (f"{latency * 1e6:.2f} us" if latency is not None else "- (no latency-bound kernel)")
              + f" ({measured_gpu.memory_latency_s * 1e6:.2f} us)")
        refit_plans = refitted_steps(results, refit)
        steps = "; ".join(f"{plan['case'].split(' step')[0]} {100 * plan['mfu']:.1f}% MFU (target "
                          f"{100 * plan['target_mfu']:.0f})" for plan in refit_plans)
        print(f"  the targets' steps priced with these refitted constants (the targets below take the assumed): {steps}")
        tokens = profiled_tokens(profile)
        print("  (the profile's kernels ran autotuned configs on the model suite's lengths"
              + (f" ({tokens:,} real tokens of {profile.setting.tokens:,}: row kernels scaled to full lengths)"
                 if tokens else "") + "; the predictions read at full lengths the config the run's autotuner chose where "
              "its profile lists it, else the first candidate)")
        comparison = {"profile": shown, "device": profile.device, "overlap_fitted": fitted,
                      "steps_refitted": [{k: plan[k] for k in ("case", "seconds", "mfu", "target_mfu")}
                                         for plan in refit_plans],
                      "memory_overlap_fitted": fitted_memory["memory_overlap"],
                      "memory_latency_s_fitted": latency,
                      "rows": [{k: v for k, v in row.items() if k not in ("prediction", "predictions")}
                               for row in rows]}
        traced = S.trace_device_time(profile.trace) if os.path.exists(profile.trace) else None
        case = next((c for c in S.STEP_CASES if c.setting == profile.setting), None)
        if traced is not None and case is not None:
            plan = S.budget(measured_results, case, measured_gpu, accumulation=1)  # the profile's one micro-batch
            item = {i["name"]: i["seconds"] for i in plan["items"]}
            gemms = item["GEMMs"] + item["FFN GEMMs + GELU"]  # a trace counts the fused ones among its GEMMs
            if profile.graphed:
                predicted, which = plan["seconds"], "the budget: the profiled step is pretrain's graphed step"
            else:  # the bench's eager step neither clips nor takes a norm
                predicted = plan["seconds"] - item["clipping"]
                which = ("the budget less its clipping; the profiled step is the drop-in eager one, whose torch "
                         "AdamW writes no working copies, so its forwards cast every GEMM weight")
            print(f"  the step's device time (its trace, union of device spans): measured {traced['busy_ms']:.1f} ms, "
                  f"predicted {predicted * 1e3:.1f} ms ({which}); GEMMs measured {traced['gemm_ms']:.1f} ms, "
                  f"predicted {gemms * 1e3:.1f} ms (the FFN's with GELU epilogues among them; the trace's lengths are "
                  "~96% real tokens, the budget's full"
                  + ("; the kernels changed since the run are predicted as they are now" if any(
                      row["changed_since_run"] for row in rows) else "") + ")")
            comparison["step"] = {"measured_busy_ms": traced["busy_ms"], "measured_gemm_ms": traced["gemm_ms"],
                                  "predicted_ms": predicted * 1e3, "predicted_gemm_ms": gemms * 1e3,
                                  "graphed": profile.graphed}
    suite = None if args.no_measured else SU.latest_suite(RESULTS)
    if suite is not None:
        section = suite_comparison(suite)
        if section["overlap_fitted"] is not None:
            refit_plans = refitted_steps(results, (section["overlap_fitted"], gpu.memory_overlap, 1.0))
            print("  the targets' steps priced with this overlap (the memory constants as assumed): " + "; ".join(
                f"{plan['case'].split(' step')[0]} {100 * plan['mfu']:.1f}% MFU" for plan in refit_plans))
            section["steps_refitted"] = [{k: plan[k] for k in ("case", "seconds", "mfu", "target_mfu")}
                                         for plan in refit_plans]
        comparison = dict(comparison or {}, suite=section)
    goals = targets(results)
    for line in (t for t in goals if "plan" in t):  # the MLM heads'
        print("\n" + "\n".join(HEAD.describe(line)))
    for line in (t for t in goals if "finetune" in t):
        print("\n" + "\n".join(FT.describe(line["finetune"])))
    if not args.no_measured:  # the speedup targets and the MLM head's, as the filed runs' baselines set them
        from bertfast.bench.readme import filed_runs
        predictions = {}

        def predict(setting: K.Setting, on: Gpu) -> List[KernelResult]:
            key = (setting.label(), on.name, on.achievable_hbm_bytes_per_s)
            if key not in predictions:
                predictions[key] = analyse([setting], on, log=lambda m: None, fastest=TUNED_OPS)
            return predictions[key]
        filed = filed_runs(REPO)
        goals += R.priced(R.speedup_asks(filed), predict)
        goals += R.head_priced(R.head_asks(filed))
    measured = measured_attention_target(suite) if suite is not None else None
    if measured is not None:  # the attention target's line: beside the run that measured its case
        next(t for t in goals if t["unit"] == "TFLOP/s")["measured"] = measured
    print("\ntargets (predicted):")
    for t in goals:
        reach = ""
        digits = 2 if t["unit"].startswith("x") else 1  # a ratio (the MLM head's), else a percentage or a rate
        if "ceiling" in t and not t["met"]:
            why = R.out_of_reach(t)
            reach = f"; ceiling {t['ceiling']:.{digits}f}" + (f", the target out of reach: {why}" if why else "")
        if "measured" in t:
            m = t["measured"]
            reach += f"; measured {m['tflops']:.1f} at {m['heads']} heads on {m['device']}, {m['run']}"
        print(f"  [{'met' if t['met'] else 'NOT MET'}] {t['name']}: {t['predicted']:.{digits}f} {t['unit']} "
              f"(target {t['target']:.3g}{reach})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"gpu": gpu.name, "overlap": gpu.overlap, "memory_overlap": gpu.memory_overlap,
                       "memory_latency_s": gpu.memory_latency_s, "targets": goals, "steps": plans,
                       "kernels": [r.to_dict() for r in results], "cuda_attention": cuda_rows,
                       "atomic_dq": atomic_rows,
                       "measured": comparison}, f, indent=1)
    print(f"\npredicted: {sum(1 for t in goals if t['met'])} of {len(goals)} targets met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
