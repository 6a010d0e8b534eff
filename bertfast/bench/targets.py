"""The performance targets, evaluated on a run: met / not met / not measured, per device.

A target is "not measured" when the rows it needs are missing, skipped or errored, or when
the run is on a CPU (the targets are GPU targets; CPU timings of reference/interpreter paths
say nothing about them). A fast path that FAILED PARITY has no speed: its target is "not met".
Kernel targets take the faster of the two fast backends (triton, cuda) per case; step targets
the fastest of bertfast's own pre-training steps (``bertfast pretrain``, ``--static-shapes``,
``--cuda-graphs``), and the detail names it. MFU targets are against the datasheet dense bf16
peak (989.4 TFLOP/s on H100 SXM and H200); where the GPU is not in the datasheet table, against
the measured matmul peak, and the detail says which.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from bertfast import registry
from bertfast.bench.clocks import describe as describe_clocks
from bertfast.bench.options import GLOBAL_BATCH
from bertfast.bench.results import (BERTFAST, BERTFAST_GRAPHS, BERTFAST_STATIC, FAILED_PARITY, FULL_HEAD,
                                    GEMM_FLOOR, HF_COMPILED, HF_EAGER, SDPA_CUDNN, SDPA_FLASH, SDPA_MEM_EFFICIENT,
                                    Row, Run, is_fast_impl)
from bertfast.bench.thresholds import (ATTENTION_TFLOPS, FINETUNE_RATIO, MFU, MLM_HEAD_FLOOR, MLM_HEAD_VS_FULL,
                                       MODEL_NAMES, ROW_OP_BANDWIDTH)  # the thresholds: bench/thresholds.py

MET, NOT_MET, NOT_MEASURED = "met", "not met", "not measured"
ATTENTION_CASE = {"head_dim": 64, "seqlen": 512, "padding": "none", "dropout": 0.1}  # the kernel suite's, any batch


@dataclass
class Outcome:
    status: str
    value: Optional[float] = None
    detail: str = ""


def _not_measured(detail: str) -> Outcome:
    return Outcome(NOT_MEASURED, None, detail)


def _time(row: Row) -> float:
    assert row.time_ms is not None
    return row.time_ms.median


def _usable(rows: List[Row], what: str) -> Tuple[Optional[Row], Optional[Outcome]]:
    """The first ok row, or the outcome explaining why there is none."""
    for r in rows:
        if r.ok:
            return r, None
    failed = [r for r in rows if r.status == FAILED_PARITY]
    if failed:
        return None, Outcome(NOT_MET, None, f"{what}: {failed[0].impl} FAILED PARITY ({failed[0].reason})")
    if rows:
        return None, _not_measured(f"{what}: {rows[0].impl} {rows[0].status} ({rows[0].reason})")
    return None, _not_measured(f"{what}: not in this run")


def _best_fast(rows: List[Row]) -> Tuple[Optional[Row], Optional[Outcome]]:
    """Fastest ok row among the bertfast fast backends (triton/cuda)."""
    fast = [r for r in rows if is_fast_impl(r.impl)]
    ok = [r for r in fast if r.ok]
    if ok:
        return min(ok, key=_time), None
    return _usable(fast, "bertfast fast backends")


def _cases(run: Run, group: str, direction: Optional[str] = None, **case: Any) -> List[Dict[str, Any]]:
    seen: List[Dict[str, Any]] = []
    for r in run.find(group, direction=direction, **case):
        if r.case not in seen:
            seen.append(r.case)
    return seen


def _worst(pieces: List[Tuple[Outcome, str]], higher_is_better: bool, threshold: float) -> Outcome:
    """Combine per-case outcomes: any not met -> not met; any not measured -> not measured."""
    if not pieces:
        return _not_measured("no matching cases in this run")
    values = [o.value for o, _ in pieces if o.value is not None]
    worst = (min(values) if higher_is_better else max(values)) if values else None
    # Measured cases one by one; those not measured, one line per reason (a stopped bench leaves many).
    details = [f"{label}: {o.detail}" for o, label in pieces if o.value is not None or o.status == NOT_MET]
    reasons: Dict[str, int] = {}
    for o, _ in pieces:
        if o.value is None and o.status != NOT_MET:
            reasons[o.detail] = reasons.get(o.detail, 0) + 1
    details += [f"{n} case{'s' if n > 1 else ''} not measured: {why}" for why, n in reasons.items()]
    details = "; ".join(details)
    for status in (NOT_MET, NOT_MEASURED):
        if any(o.status == status for o, _ in pieces):
            return Outcome(status, worst, details)
    return Outcome(MET, worst, details)


def _compare(value: float, threshold: float, higher_is_better: bool, text: str) -> Outcome:
    good = value >= threshold if higher_is_better else value <= threshold
    return Outcome(MET if good else NOT_MET, value, text)


# --------------------------------------------------------------------------- model targets
# bertfast pretrain's steps, as a user picks one: the default, --static-shapes, --cuda-graphs.
PRETRAIN_STEPS = (BERTFAST, BERTFAST_STATIC, BERTFAST_GRAPHS)


def _fastest_step(rows: List[Row]) -> Tuple[Optional[Row], Optional[Outcome]]:
    """The fastest ok row among bertfast's own pre-training steps, or why there is none (as the
    default step's row says: the other two are options)."""
    ok = [r for r in rows if r.impl in PRETRAIN_STEPS and r.ok]
    if ok:
        return min(ok, key=_time), None
    return _usable([r for r in rows if r.impl == BERTFAST], "bertfast step")


def _step_name(row: Row) -> str:
    return "" if row.impl == BERTFAST else f", {row.impl}"


def global_batch(row: Row) -> int:
    """The sequences of one optimizer step: the case's global batch (micro-batches accumulated; a run
    before 2026-12-06 stepped once per batch)."""
    return int(row.case.get("global_batch") or row.case.get("batch") or 0)


def _batch_text(row: Row) -> str:
    micro, size, total = row.case.get("micro_batches", 1), row.case.get("batch"), global_batch(row)
    text = f"global batch {total}" + (f" = {micro} x {size}" if micro > 1 else "")
    if total < GLOBAL_BATCH:
        text += f", under the targets' {GLOBAL_BATCH}: the optimizer's step counted once per {total} sequences"
    return text


def pretrain_rows(run: Run, model: str, seqlen: int) -> List[Row]:
    """The case's rows, those at the targets' global batch where the run has them."""
    rows = run.find("pretrain_step", direction="step", model=model, seqlen=seqlen)
    return [r for r in rows if global_batch(r) >= GLOBAL_BATCH] or rows


def _model_mfu(model: str, seqlen: int, threshold: float) -> Callable[[Run], Outcome]:
    def evaluate(run: Run) -> Outcome:
        row, why = _fastest_step(pretrain_rows(run, model, seqlen))
        if why:
            return why
        mfu, peak = row.metric("mfu_datasheet"), "datasheet peak"
        if mfu is None:
            mfu, peak = row.metric("mfu"), "measured peak (GPU not in the datasheet table)"
        clocks = describe_clocks(row.clocks)
        return _compare(mfu, threshold, True, f"MFU {mfu:.1%} of the {peak} ({_batch_text(row)}{_step_name(row)})"
                        + (f"; {clocks}" if clocks else ""))
    return evaluate


def _model_speedup(model: str, baseline: str, threshold: float) -> Callable[[Run], Outcome]:
    def evaluate(run: Run) -> Outcome:
        rows = pretrain_rows(run, model, 128)
        fast, why = _fastest_step(rows)
        if why:
            return why
        base, why = _usable([r for r in rows if r.impl == baseline and r.case == fast.case], baseline)
        if why:
            return why
        s = _time(base) / _time(fast)
        return _compare(s, threshold, True, f"{_time(fast):.1f} ms{_step_name(fast)} vs {_time(base):.1f} ms = "
                                            f"{s:.2f}x{_needed(base, threshold) if s < threshold else ''} "
                                            f"({_batch_text(fast)})")
    return evaluate


def _needed(base: Row, threshold: float) -> str:
    """What a speedup target asks of bertfast's step: the time, and the MFU at that time (the baseline's
    MFU times the speedup: the same model FLOPs), which says whether it is within reach of any step
    (NVIDIA's MLPerf BERT is near 48%; docs/perf-model.md prices bertfast's)."""
    text = f"; {threshold:g}x is {_time(base) / threshold:.1f} ms"
    mfu, peak = base.metric("mfu_datasheet"), "datasheet"
    if mfu is None:
        mfu, peak = base.metric("mfu"), "measured"
    return text + (f", {threshold * mfu:.1%} MFU of the {peak} peak" if mfu is not None else "")


def _finetune_padding(run: Run) -> Outcome:
    pieces = []
    for case in _cases(run, "finetune_step", lengths="padded"):
        other = {"model": case.get("model"), "seqlen": case.get("seqlen")}  # batch, fill differ by design
        padded, why = _usable(run.find("finetune_step", BERTFAST, lengths="padded", **other), "padded batch")
        if not why:
            unpadded, why = _usable(run.find("finetune_step", BERTFAST, lengths="no-padding", **other),
                                    "unpadded batch")
        label = f"{case.get('model')} seq {case.get('seqlen')}"
        if why:
            pieces.append((why, label))
            continue
        ratio = padded.metric("tokens_per_s") / unpadded.metric("tokens_per_s")
        pieces.append((_compare(ratio, FINETUNE_RATIO, True, f"padded/unpadded real tokens/s = {ratio:.2f}"), label))
    return _worst(pieces, True, FINETUNE_RATIO)


# --------------------------------------------------------------------------- kernel targets
def _row_ops_bandwidth(run: Run) -> Outcome:
    pieces = []
    for op in registry.names(registry.ROW):
        for direction in ("fwd", "bwd"):
            cases = _cases(run, op, direction)
            if not cases:
                continue
            # The largest case (most bytes): launch overhead is not what this target is about.
            largest = max(cases, key=lambda c: max((r.work.get("bytes", 0) for r in run.find(op, direction=direction)
                                                    if r.case == c), default=0))
            fast, why = _best_fast([r for r in run.find(op, direction=direction) if r.case == largest])
            label = f"{op} {direction}"
            if why:
                pieces.append((why, label))
                continue
            pct = fast.metric("pct_copy_bw")
            pieces.append((_compare(pct, 100 * ROW_OP_BANDWIDTH, True, f"{pct:.0f}% ({fast.impl})"), label))
    return _worst(pieces, True, 100 * ROW_OP_BANDWIDTH)


def _attention_vs(baseline: str, threshold: float, padded: bool) -> Callable[[Run], Outcome]:
    def evaluate(run: Run) -> Outcome:
        pieces = []
        for case in _cases(run, "attention", "fwd+bwd"):
            if (case.get("padding") != "none") != padded:
                continue
            rows = [r for r in run.find("attention", direction="fwd+bwd") if r.case == case]
            label = f"B{case.get('batch')} S{case.get('seqlen')} D{case.get('head_dim')} {case.get('padding')}"
            fast, why = _best_fast(rows)
            if not why:
                base, why = _usable([r for r in rows if r.impl == baseline], baseline)
            if why:
                pieces.append((why, label))
                continue
            s = _time(base) / _time(fast)
            pieces.append((_compare(s, threshold, True, f"{s:.2f}x ({fast.impl})"), label))
        return _worst(pieces, True, threshold)
    return evaluate


def _attention_tflops(run: Run) -> Outcome:
    """Best fast backend, fwd+bwd, head dim 64, seq 512, dropout 0.1, equal lengths (FA's convention)."""
    pieces = []
    for case in _cases(run, "attention", "fwd+bwd", **ATTENTION_CASE):
        fast, why = _best_fast([r for r in run.find("attention", direction="fwd+bwd") if r.case == case])
        label = f"B{case.get('batch')} A{case.get('heads')} p={case.get('dropout')}"
        if why:
            pieces.append((why, label))
            continue
        value = fast.metric("tflops")
        pieces.append((_compare(value, ATTENTION_TFLOPS, True, f"{value:.0f} TFLOP/s ({fast.impl})"), label))
    return _worst(pieces, True, ATTENTION_TFLOPS)


def _mlm_head_loss(kind: str) -> Callable[[Run], Outcome]:
    def evaluate(run: Run) -> Outcome:
        pieces = []
        for case in _cases(run, "mlm_head_loss", "fwd+bwd"):
            rows = [r for r in run.find("mlm_head_loss", direction="fwd+bwd") if r.case == case]
            label = f"{case.get('model')} M{case.get('tokens')}"
            fast, why = _best_fast(rows)
            if why:
                pieces.append((why, label))
                continue
            if kind == "floor":
                floor, why = _usable([r for r in rows if r.impl == GEMM_FLOOR], GEMM_FLOOR)
                if why:
                    pieces.append((why, label))
                    continue
                ratio = _time(fast) / _time(floor)
                pieces.append((_compare(ratio, MLM_HEAD_FLOOR, False, f"{ratio:.2f}x its GEMM floor"), label))
                continue
            full, why = _usable([r for r in rows if r.impl == FULL_HEAD], FULL_HEAD)
            if why:
                pieces.append((why, label))
                continue
            t_ratio = _time(full) / _time(fast)
            if fast.memory is None or full.memory is None or fast.memory.peak_delta_bytes <= 0:
                pieces.append((_not_measured("peak memory not measured"), label))
                continue
            m_ratio = full.memory.peak_delta_bytes / fast.memory.peak_delta_bytes
            worst = min(t_ratio, m_ratio)
            pieces.append((_compare(worst, MLM_HEAD_VS_FULL, True, f"time {t_ratio:.1f}x, peak memory {m_ratio:.1f}x"),
                           label))
        return _worst(pieces, kind != "floor", MLM_HEAD_FLOOR if kind == "floor" else MLM_HEAD_VS_FULL)
    return evaluate


# The step targets against what users would pick instead (id, model, baseline impl, speedup), at seq 128.
# bertfast.perfmodel.reach sets what each asks of the step beside the step's prediction.
SPEEDUP_TARGETS: Tuple[Tuple[str, str, str, float], ...] = (
    ("hf_eager_large_128", "bert-large", HF_EAGER, 2.5), ("hf_eager_base_128", "bert-base", HF_EAGER, 2.5),
    ("hf_compiled_large_128", "bert-large", HF_COMPILED, 1.5), ("hf_compiled_base_128", "bert-base", HF_COMPILED, 1.5))
_BASELINE_TEXT = {HF_EAGER: "transformers eager (sdpa)", HF_COMPILED: "transformers under torch.compile"}


def speedup_text(model: str, baseline: str, speedup: float) -> str:
    return f"{MODEL_NAMES[model]} seq-128 step >= {speedup:g}x {_BASELINE_TEXT[baseline]}"


# (id, the target as stated, how to evaluate it on a run)
TARGETS: List[Tuple[str, str, Callable[[Run], Outcome]]] = [
    *((f"mfu_{model[5:]}_{seq}", f"{MODEL_NAMES[model]} seq-{seq} training step >= {mfu:.0%} MFU",
       _model_mfu(model, seq, mfu)) for (model, seq), mfu in MFU.items()),
    *((tid, speedup_text(model, baseline, k), _model_speedup(model, baseline, k))
      for tid, model, baseline, k in SPEEDUP_TARGETS),
    ("finetune_padding", f"fine-tuning: padded batch (mean length 50%) within {1 - FINETUNE_RATIO:.0%} of the same "
     "real tokens unpadded (real tokens/s)", _finetune_padding),
    ("row_ops_bandwidth", f"row ops ({', '.join(registry.names(registry.ROW))}; fwd and bwd; "
     f"largest case; faster fast backend) >= {ROW_OP_BANDWIDTH:.0%} of measured copy bandwidth", _row_ops_bandwidth),
    ("attention_tflops", f"attention fwd+bwd, head dim 64, seq 512, dropout 0.1 >= {ATTENTION_TFLOPS:g} TFLOP/s "
     "(faster fast backend; FlashAttention's FLOP convention)", _attention_tflops),
    ("attention_vs_flash", "attention fwd+bwd >= torch SDPA flash on equal-length real tokens",
     _attention_vs(SDPA_FLASH, 1.0, padded=False)),
    ("attention_vs_cudnn", "attention fwd+bwd >= torch SDPA cuDNN on equal-length real tokens",
     _attention_vs(SDPA_CUDNN, 1.0, padded=False)),
    ("attention_vs_mem_efficient", "attention fwd+bwd >= 2x torch SDPA memory-efficient with a padding mask",
     _attention_vs(SDPA_MEM_EFFICIENT, 2.0, padded=True)),
    ("mlm_head_loss_vs_full", f"MLM head >= {MLM_HEAD_VS_FULL:g}x the full-sequence head in time and in peak memory",
     _mlm_head_loss("full")),
    ("mlm_head_loss_floor", f"MLM head within {MLM_HEAD_FLOOR:g}x of its GEMM floor", _mlm_head_loss("floor")),
]


def evaluate_targets(run: Run) -> List[Dict[str, Any]]:
    """One dict per target: id, target, status, value, detail, device."""
    device = run.device.name
    # The targets are about the kernel and model suites; the overhead suite's rows reuse op names
    # (its tiny-input timings must not stand in for a kernel row).
    run = Run(device=run.device, config=run.config, rows=[r for r in run.rows if r.suite in ("kernels", "model")],
              notes=run.notes, date=run.date)
    out = []
    for tid, text, evaluate in TARGETS:
        if not run.device.is_cuda:
            outcome = _not_measured("CPU run: the targets are GPU targets; CPU timings do not measure them")
        else:
            try:
                outcome = evaluate(run)
            except Exception as exc:  # a broken evaluation must show, not abort the report
                outcome = _not_measured(f"evaluation failed: {type(exc).__name__}: {exc}")
        out.append({"id": tid, "target": text, "status": outcome.status, "value": outcome.value,
                    "detail": outcome.detail, "device": device})
    return out
