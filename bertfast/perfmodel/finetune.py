"""The fine-tuning target predicted: a padded batch (mean length 50% of max) within 15% of the same
real tokens without padding, in real tokens per second (bench.thresholds.FINETUNE_RATIO), at the
model suite's fine-tuning cases and on their batches (bench.model_suite.GPU_CASES, bench.common's
lengths: pairs l, S - l).

bertfast's encoder takes a padded batch unpadded (bertfast/model/layout.py): the embeddings, the
GEMMs and the row ops run over the real tokens, alike for the padded batch of B sequences and for
the B / 2 full ones that hold its tokens. The full batch's step is step.budget's
(BertForSequenceClassification: one batch, AdamW, clipping); the padded batch's is that step with
what differs priced again:

- the attention, its kernels predicted at the padded batch's lengths (kernels.at_lengths): a tile
  a short sequence fills in part costs a whole one, and twice the sequences are twice the programs;
- the QKV bias gradient's fp32 partials: rows per sequence (kernels/attention.py), twice the rows;
- the output padded back (padding.pad_rows, a view for the full batch): [B, S, H] zero-filled and
  the T tokens' rows copied in; backward, the gradient of the [CLS] rows zero-filled over B x S rows
  where the full batch's is T, and the T rows gathered from it; three launches more.

Host time is left out, as in the step budget: both batches launch the same kernels but those three,
and both read the row count back once (model/layout.py, ``Layout.unpadded``).
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from bertfast.perfmodel import kernels as K
from bertfast.perfmodel import step as S
from bertfast.perfmodel.hardware import Gpu

DROPOUT = 0.1  # BertForSequenceClassification trains with the config's dropout
PAD_LAUNCHES = 3  # the padded output's zero fill and copy, its gradient's gather


def cases() -> List[Tuple[str, int, int]]:
    """(model, seq, padded batch) of the model suite's fine-tuning cases on a GPU."""
    from bertfast.bench.model_suite import GPU_CASES
    return list(GPU_CASES["finetune"])


def lengths(model: str, seq: int, batch: int) -> List[int]:
    """The padded batch's real lengths, as the model suite draws them for the case."""
    from bertfast.bench.common import generator_for, sequence_lengths
    return sequence_lengths("finetune", batch, seq, generator_for("finetune", model, seq, batch))


def full_setting(model: str, seq: int, batch: int) -> K.Setting:
    """The batch of full sequences that holds the padded batch's real tokens (half as many)."""
    return K.Setting(model, seq, batch // 2, DROPOUT)


def plan(results, padded_attention, case: Tuple[str, int, int], gpu: Gpu) -> Dict[str, object]:
    """Both steps' predicted device time and the padded one's real tokens/s over the full one's
    (the same tokens: the full step's time over the padded's). ``results``: the kernels at the full
    setting; ``padded_attention``: the attention's at the padded lengths (report.analyse, lengths=)."""
    from bertfast.gpucheck.compile_report import MODELS
    model, seq, batch = case
    setting = full_setting(*case)
    padded = lengths(*case)
    hidden = MODELS[model][0]
    layers = S.LAYERS[model]
    tokens = sum(padded)
    if tokens != setting.tokens:
        raise ValueError(f"perf-model: the padded batch holds {tokens} tokens, its full batch {setting.tokens}")
    step = S.budget(results, S.StepCase(setting, None, f"fine-tuning {model} seq {seq}", head="classification"),
                    gpu, accumulation=1)
    full = S.attention_launches(results, setting)
    at_lengths = S.attention_launches(padded_attention, setting)
    attention = (layers * sum(r.prediction.predicted_s for r in full.values()),
                 layers * sum(r.prediction.predicted_s for r in at_lengths.values()))
    one_pass = "_attention_bwd_fused_kernel" in full
    bw = gpu.achievable_hbm_bytes_per_s
    partials = layers * 2 * S.bias_grad_bytes(batch - setting.batch, seq, hidden, one_pass) / bw
    row = 2.0 * hidden  # bytes of a bf16 row
    # forward: 2T rows zero-filled, T read and written; backward: T more rows zero-filled, T gathered
    pad_bytes = (2 * tokens + 2 * tokens) * row + (tokens + 2 * tokens) * row
    pad = pad_bytes / bw + PAD_LAUNCHES * gpu.launch_gap_s
    padded_s = step["seconds"] - attention[0] + attention[1] + partials + pad
    return {"case": case, "lengths": padded, "tokens": tokens, "full_sequences": setting.batch,
            "full_s": step["seconds"], "padded_s": padded_s, "ratio": step["seconds"] / padded_s,
            "attention_s": attention, "kernels": {k: (full[k].prediction.predicted_s,
                                                      at_lengths[k].prediction.predicted_s) for k in full},
            "partials_s": partials, "pad_s": pad, "step": step}


def target(p: Dict[str, object]) -> Dict[str, object]:
    """The plan's target line (report.targets' form)."""
    from bertfast.bench.thresholds import FINETUNE_RATIO, MODEL_NAMES
    model, seq, batch = p["case"]
    name = MODEL_NAMES.get(model, model)
    return {"name": f"fine-tuning {name} seq {seq}: a batch of {batch} at mean length 50% against the same "
                    f"{p['tokens']:,} real tokens as {p['full_sequences']} full sequences, real tokens/s",
            "predicted": p["ratio"], "target": FINETUNE_RATIO, "unit": "x (padded over unpadded)",
            "met": p["ratio"] >= FINETUNE_RATIO, "finetune": {k: v for k, v in p.items() if k != "step"}}


def describe(p: Dict[str, object]) -> List[str]:
    """The report's lines for a plan: both steps, and what the padded batch adds."""
    model, seq, batch = p["case"]
    full_attention, padded_attention = p["attention_s"]
    kernels = ", ".join(f"{S.ATTENTION_KERNELS.get(k, k)} {a * 1e6:.1f} -> {b * 1e6:.1f}"
                        for k, (a, b) in p["kernels"].items())
    return [f"fine-tuning {model} seq {seq} ({p['tokens']:,} real tokens): {p['full_sequences']} full sequences "
            f"{p['full_s'] * 1e3:.2f} ms of device time, the padded batch of {batch} {p['padded_s'] * 1e3:.2f} ms: "
            f"{p['ratio']:.3f}x the real tokens/s",
            f"  attention          {full_attention * 1e3:6.3f} -> {padded_attention * 1e3:.3f} ms (a layer's, us: "
            f"{kernels}; the lengths' tiles, each a whole one)",
            f"  QKV bias partials  +{p['partials_s'] * 1e3:.3f} ms  (a row block per sequence: {batch} where "
            f"{p['full_sequences']})",
            f"  padded output      +{p['pad_s'] * 1e3:.3f} ms  ([B, S, H] zero-filled, the rows copied in; the "
            f"gradient's zero fill and gather; {PAD_LAUNCHES} launches)"]
