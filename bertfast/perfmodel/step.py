"""The pre-training step's budget: predicted device time of one BERT training step, line by line.

A step (forward, backward, bertfast's AdamW; bf16 autocast over fp32 weights; full-length
sequences, the BERT recipe's masked positions) is the sum of:

- GEMMs: the model's linear-layer FLOPs (bertfast.model.mfu, 3 x forward) at the GEMM rate measured
  for BERT's GEMMs (hardware.Gpu.gemm_flops), but for two per layer:
- the FFN's GEMMs with GELU in their epilogues (kernels/bias_gelu.py: the up-projection
  forward, dy @ W2 backward), each at the larger of its kernel's prediction and the GEMM rate plus
  the bytes its epilogue adds to a plain GEMM's (z written forward, read backward, and the bias
  gradient's partials) at the achievable bandwidth: no faster than cuBLAS would run the GEMM alone;
- attention: every layer's forward and backward kernels, as the kernel model predicts them;
- row ops: every layer's two bias+dropout+residual+LayerNorm, forward and backward, and the
  embeddings, as predicted (bias+GELU runs in the GEMMs above);
- memory-bound work the kernels do not cover, at the achievable bandwidth: the MLM head besides its
  GEMMs at the masked rows, as perfmodel/head.py prices it for fp32 weights (the loss over the
  vocabulary, the bias gradient's column sum, the gather and scatter, the transform, the fp32 weight
  gradient, the loss's incoming gradient); AdamW (kernels/adamw.py: 28 bytes per parameter, and 2 more for
  the bf16 working copy it writes of each encoder GEMM weight, bertfast.model.working_weights); the
  clipping's gradient norm (4 bytes per parameter: the optimizer divides by the clipping factor as
  it reads each gradient, writing nothing back); autocast's casts of the weights without a working
  copy (the embeddings, the heads, the pooler: 6 bytes per parameter; the weight gradients come
  fp32 from their GEMMs but the pooler's and NSP head's, cast from bf16 at 6 more:
  bertfast.model.residual_linear); the QKV bias gradient (the attention's backward kernels write its fp32
  partials, a row per block, which a column sum reads back: kernels/attention.py)
  and the residual gradients the input-gradient GEMMs read (bertfast.model.residual_linear: each layer's
  two residual-gradient additions happen in the GEMMs, in place in the gradient the LayerNorm op
  hands over, beta = 1);
- launch gaps: the step's kernels back to back on the device (as a CUDA graph replays them).

A step is the target's: a global batch of 256 sequences (benchmarks/README), ACCUMULATION
micro-batches of the benchmark's batch, so the lines above but the optimizer's and the clipping's
come once per micro-batch, and each micro-batch after the first adds its weight gradients to the
ones before (the GEMM weights' in their GEMMs, 4 bytes per parameter; the others' through autograd's
add, 12: ``accumulation_bytes``). ``budget(..., accumulation=1)`` is the
single micro-batch step a GPU run profiles.

A case with ``head="classification"`` is BertForSequenceClassification's step instead (perfmodel/finetune.py):
no MLM head, a two-way classifier in NSP's place.

Predicted device time, sequences per second and MFU (model FLOPs / time / the dense bf16 peak).
Host time is not in it: a step launched from Python eagerly can take far longer (the GPU runs
measured it), which `bertfast pretrain --cuda-graphs` removes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from bertfast.bench.options import GLOBAL_BATCH
from bertfast.bench.thresholds import MFU
from bertfast.perfmodel import head as HEAD
from bertfast.perfmodel import kernels as K
from bertfast.perfmodel.hardware import Gpu

LAYERS = {"bert-base": 12, "bert-large": 24}
VOCAB, POSITIONS, TYPES = 30522, 512, 2
# Besides the attention's kernels (ATTENTION_KERNELS): forward 7 (4 GEMMs on the weights' working
# copies, the up-projection's with bias and GELU, the attention's outside-rows pass, 2 LayerNorms),
# backward 14 (8 GEMMs, one with GELU', the outside-rows pass, 2 LayerNorms, and 3 column sums for
# their and the FFN's bias gradients; the weight gradients come fp32 from the GEMMs and the residual
# gradients are summed in them, bertfast.model.residual_linear)
KERNELS_PER_LAYER_BESIDE_ATTENTION = 21
MASKED_PER_SEQUENCE = {128: 20, 512: 80}  # the BERT recipe's max_predictions_per_seq
# The MLM head's lines (perfmodel/head.py) the step prices as its own: all but the weight's copy (the
# autocast cast the weight casts line counts) and the launch gaps (the step's launches count them).
HEAD_LINES = ("loss", "bias gradient", "gather, scatter", "transform", "weight gradient", "scaling")


@dataclass(frozen=True)
class StepCase:
    setting: K.Setting
    target_mfu: Optional[float]  # None: a step no MFU target is about (perfmodel/finetune.py's)
    name: str
    accumulation: int = 1  # micro-batches of setting.batch per optimizer step
    head: str = "pretraining"  # or "classification": BertForSequenceClassification's step, two labels


# The MFU targets (benchmarks/README): phase 1 and 2 of BERT-large, phase 1 of BERT-base, at a global
# batch of 256 (the targets' least) in micro-batches of the benchmark's batches, as the model suite
# runs them on a GPU; dropout 0.1.
STEP_CASES = tuple(StepCase(K.Setting(model, seq, batch, 0.1), MFU[model, seq],
                            f"{name} step (seq {seq}, global batch {GLOBAL_BATCH} = {GLOBAL_BATCH // batch} x {batch})",
                            GLOBAL_BATCH // batch)
                   for model, seq, batch, name in (("bert-large", 128, 128, "BERT-large phase 1"),
                                                   ("bert-large", 512, 32, "BERT-large phase 2"),
                                                   ("bert-base", 128, 128, "BERT-base phase 1")))


def parameters(hidden: int, ffn: int, layers: int, vocab: int = VOCAB, positions: int = POSITIONS,
               head: str = "pretraining") -> int:
    """BertForPreTraining's parameters (the decoder weight tied to the word embeddings), or with
    head="classification" BertForSequenceClassification's (two labels)."""
    per_layer = 4 * hidden * hidden + 4 * hidden + 2 * hidden * ffn + ffn + hidden + 4 * hidden
    embeddings = (vocab + positions + TYPES) * hidden + 2 * hidden
    pooler, two_way = hidden * hidden + hidden, 2 * hidden + 2  # NSP's, or the classifier's
    heads = pooler + two_way + (hidden * hidden + 3 * hidden + vocab if head == "pretraining" else 0)
    return layers * per_layer + embeddings + heads


def working_copies(hidden: int, ffn: int, layers: int) -> int:
    """The encoder GEMM weights and biases with a bf16 working copy (bertfast.model.working_weights): every
    layer's parameters but its two LayerNorms'."""
    return layers * (4 * hidden * hidden + 4 * hidden + 2 * hidden * ffn + ffn + hidden)


def model_flops(setting: K.Setting, head: str = "pretraining") -> Tuple[float, float]:
    """(step FLOPs, of which attention) as bertfast.model.mfu counts them, full-length sequences."""
    from bertfast.model.config import BertConfig
    from bertfast.model.mfu import bert_forward_flops_from_counts, training_step_flops
    config = BertConfig.preset(setting.model)
    masked = setting.batch * MASKED_PER_SEQUENCE.get(setting.seq, math.ceil(0.15 * setting.seq))
    forward = bert_forward_flops_from_counts(config, setting.tokens, setting.batch * setting.seq ** 2, setting.batch,
                                             head, masked)
    attention = config.num_hidden_layers * 4.0 * setting.batch * setting.seq ** 2 * config.hidden_size
    return training_step_flops(forward), training_step_flops(attention)


def _launch(results, setting: K.Setting, kernel: str, variant_has: str = ""):
    """The first recorded launch of ``kernel`` at ``setting`` (whose variant contains ``variant_has``)."""
    for r in results:
        if r.setting == setting and r.kernel == kernel and r.prediction is not None and variant_has in r.variant:
            return r
    raise KeyError(f"perf-model: no prediction of {kernel} at {setting.label()}")


# The attention kernels a training step runs, by their step-budget names: the backward is the one-pass
# kernel for sequences up to kernels/attention.py's FUSED_BWD_MAX_SEQLEN, else three kernels.
ATTENTION_KERNELS = {"_attention_fwd_kernel": "forward", "_attention_bwd_fused_kernel": "one-pass backward",
                     "_attention_bwd_delta_kernel": "delta", "_attention_bwd_dq_kernel": "dQ",
                     "_attention_bwd_dkdv_kernel": "dK/dV"}


def attention_launches(results, setting: K.Setting) -> Dict[str, object]:
    """The first recorded launch of each attention kernel at ``setting``, in the order of ATTENTION_KERNELS."""
    found = {k: _launch(results, setting, k) for k in ATTENTION_KERNELS
             if any(r.setting == setting and r.kernel == k and r.prediction is not None for r in results)}
    if "_attention_fwd_kernel" not in found or len(found) < 2:
        raise KeyError(f"perf-model: no prediction of the attention's forward and backward at {setting.label()}")
    return found


def bias_grad_bytes(sequences: int, seqlen: int, hidden: int, one_pass: bool) -> float:
    """Bytes of the QKV bias gradient's fp32 partials the attention's backward writes for ``sequences``
    sequences (then read back by a column sum)."""
    return sequences * bias_grad_rows(seqlen, one_pass) * 3 * hidden * 4.0


def bias_grad_rows(seqlen: int, one_pass: bool) -> int:
    """Rows of the QKV bias gradient's partials per sequence on a GPU (kernels/attention.py), bf16,
    head dim 64."""
    import torch

    from bertfast.kernels.attention import bias_grad_rows
    return bias_grad_rows(seqlen, K.HEAD_DIM, torch.bfloat16, one_pass, interpreted=False)


def _predicted(results, setting: K.Setting, kernel: str, variant_has: str = "") -> float:
    return _launch(results, setting, kernel, variant_has).prediction.predicted_s


# The row kernels of a layer (kernel, variant) as the budget counts them: two residual LayerNorms
# (with bias, dropout and residual), forward and backward.
ROW_KERNELS = tuple((k, "HAS_BIAS=1") for k in ("_bias_dropout_residual_layernorm_fwd_kernel",
                                                "_bias_dropout_residual_layernorm_fwd_kernel",
                                                "_bias_dropout_residual_layernorm_bwd_kernel",
                                                "_bias_dropout_residual_layernorm_bwd_kernel"))
# The FFN's GEMMs with the bias and GELU in their epilogues: the up-projection forward, dy @ W2 backward.
FFN_GEMMS = (("_gemm_bias_gelu_kernel", "BACKWARD=0"), ("_gemm_bias_gelu_kernel", "BACKWARD=1"))
EMBEDDING_KERNELS = ("_embeddings_fwd_kernel", "_embeddings_bwd_kernel", "_embeddings_bwd_pos_kernel",
                     "_table_rows_kernel")
# Line items that are not the model's work: fused away, they cost nothing.
REMOVABLE = ("weight casts", "QKV bias grad", "residual grads")
PER_STEP = ("AdamW", "clipping")  # once per optimizer step; the other lines once per micro-batch
CEILING = ("every row op and the embeddings moving their bytes at the achievable bandwidth, and no weight "
           "casts, separate QKV bias gradient or residual-gradient reads, and the MLM head at its ceiling's lines "
           "(perfmodel/head.py); GEMMs, attention, optimizer and launch gaps as predicted")


def ffn_gemm_seconds(results, setting: K.Setting, gpu: Gpu) -> Tuple[float, int]:
    """(seconds of a layer's two FFN GEMMs with GELU epilogues, how many of them the floor prices):
    each the larger of its kernel's prediction and the floor, its FLOPs at the GEMM rate plus the
    bytes its epilogue adds to a plain GEMM's (operands read, one output written) at the achievable
    bandwidth: never faster than cuBLAS would run the GEMM alone."""
    from bertfast.gpucheck.compile_report import MODELS
    hidden, _, ffn = MODELS[setting.model]
    flops = 2.0 * setting.tokens * hidden * ffn
    plain = 2.0 * (setting.tokens * hidden + hidden * ffn + setting.tokens * ffn)  # bf16 operands and output
    total, floors = 0.0, 0
    for kernel, variant in FFN_GEMMS:
        r = _launch(results, setting, kernel, variant)
        floor = flops / gpu.gemm_flops + max(0.0, r.hbm_bytes - plain) / gpu.achievable_hbm_bytes_per_s
        total += max(r.prediction.predicted_s, floor)
        floors += floor >= r.prediction.predicted_s
    return total, floors


def accumulation_bytes(params: int, copies: int) -> float:
    """The bytes a micro-batch after the first moves to add its gradients to the ones before: the
    encoder's GEMM weights (``copies``) in their weight-gradient GEMMs, which read the fp32 gradient
    they add to (training.TrainStep in one process: bertfast.model.residual_linear), the others
    through autograd's add (both read, the sum written)."""
    return 4.0 * copies + 12.0 * (params - copies)


def budget(results, case: StepCase, gpu: Gpu, accumulation: Optional[int] = None) -> Dict[str, object]:
    """The step's line items (seconds), its predicted time, sequences per second and MFU on ``gpu``:
    ``accumulation`` micro-batches (default the case's) and one optimizer step."""
    from bertfast.gpucheck.compile_report import MODELS
    accumulation = case.accumulation if accumulation is None else accumulation
    s = case.setting
    hidden, _, ffn = MODELS[s.model]
    layers = LAYERS[s.model]
    tokens = s.tokens
    pretraining = case.head == "pretraining"
    masked = s.batch * MASKED_PER_SEQUENCE.get(s.seq, math.ceil(0.15 * s.seq)) if pretraining else 0
    params = parameters(hidden, ffn, layers, head=case.head)
    copies = working_copies(hidden, ffn, layers)
    # the pooler's and NSP's (or the classifier's): through F.linear under autocast, bf16, then cast
    cast_grads = hidden * hidden + hidden + 2 * hidden + 2
    flops, attention_flops = model_flops(s, case.head)
    bw = gpu.achievable_hbm_bytes_per_s
    attention_kernels = attention_launches(results, s)
    attention = sum(r.prediction.predicted_s for r in attention_kernels.values())
    # The QKV bias gradient's partials (kernels/attention.py): zero-filled, written by the attention's
    # backward kernels, read back by a column sum.
    one_pass = "_attention_bwd_fused_kernel" in attention_kernels
    partial_bytes = bias_grad_bytes(s.batch, s.seq, hidden, one_pass)
    bias_grad = 2 * partial_bytes / bw + gpu.memory_latency_s
    launches = layers * (KERNELS_PER_LAYER_BESIDE_ATTENTION + len(attention_kernels) + 2) + 20
    rows = sum(_predicted(results, s, k, v) for k, v in ROW_KERNELS)
    embeddings = sum(_predicted(results, s, k) for k in EMBEDDING_KERNELS)
    ffn_gemms, floors = ffn_gemm_seconds(results, s, gpu)
    fused_flops = layers * 2 * 2.0 * tokens * hidden * ffn  # the two GEMMs with GELU epilogues
    head = ({i["name"]: i["seconds"] for i in HEAD.lines(hidden, tokens, VOCAB, act_bytes=2, weight_bytes=4,
                                                          gpu=gpu, rows=masked)["items"]} if pretraining else {})
    head_s = sum(head[name] for name in HEAD_LINES) if pretraining else 0.0
    gemm_flops = flops - attention_flops - fused_flops
    items = [
        ("GEMMs", gemm_flops / gpu.gemm_flops,
         f"{gemm_flops / 1e12:.1f} TFLOP at {gpu.gemm_flops / 1e12:.0f} TFLOP/s"),
        ("FFN GEMMs + GELU", layers * ffn_gemms,
         f"{layers} x {ffn_gemms * 1e6:.0f} us (the up-projection forward, dy @ W2 backward: {fused_flops / 1e12:.1f} "
         f"TFLOP, the bias and GELU in their epilogues; {floors} of 2 priced at the GEMM rate plus their epilogues' "
         "bytes, above their kernel's prediction)"),
        ("attention", layers * attention,
         f"{layers} x {attention * 1e6:.0f} us ({', '.join(ATTENTION_KERNELS.get(k, k) for k in attention_kernels)})"),
        ("row ops", layers * rows + embeddings,
         f"{layers} x {rows * 1e6:.0f} us (2 x residual LayerNorm, fwd+bwd) + embeddings {embeddings * 1e6:.0f} us"),
        *([("MLM head", head_s, f"{masked} rows x {VOCAB} logits: {', '.join(HEAD_LINES)} (perfmodel/head.py, "
            "for fp32 weights: its GEMMs are in the GEMMs line, its weight's cast in the weight casts)")]
          if pretraining else []),
        ("AdamW", (28.0 * params + 2.0 * copies) / bw,
         f"{params / 1e6:.0f}M parameters x 28 bytes, and the bf16 working copies of {copies / 1e6:.0f}M "
         "(the encoder's GEMM weights) x 2"),
        ("clipping", 4.0 * params / bw, "the gradient norm (fp32 gradients read; AdamW divides each gradient "
                                         "by the clipping factor as it reads it, writing nothing back; pretrain "
                                         "clips at 1.0 by default)"),
        ("weight casts", (6.0 * (params - copies) + 6.0 * cast_grads) / bw,
         f"bf16 casts every forward of the {(params - copies) / 1e6:.0f}M fp32 weights without a working copy "
         "(the embeddings, heads, pooler, LayerNorms: 6 B each); the gradients come fp32 from their GEMMs "
         f"(bertfast.model.residual_linear) and kernels, but {cast_grads / 1e6:.1f}M (the pooler's, "
         f"{'NSP' if pretraining else 'the classifier'}'s) cast from bf16"),
        ("QKV bias grad", layers * bias_grad,
         f"{layers} x the {partial_bytes / 1e6:.1f} MB of fp32 partials the attention's backward writes, "
         f"zero-filled and summed by a column sum (one memory latency), where a column sum of the QKV gradient "
         f"read {tokens * 3 * hidden * 2.0 / 1e6:.0f} MB"),
        ("residual grads", layers * tokens * 2 * hidden * 2.0 / bw,
         "each layer's two residual gradients, read by the QKV and FFN-input GEMMs that sum them (addmm_ "
         "into the gradient the LayerNorm op hands over, beta = 1; priced at the bandwidth, as if the GEMMs "
         "did not hide them)"),
        ("launch gaps", launches * gpu.launch_gap_s, f"~{launches} kernels x {gpu.launch_gap_s * 1e6:.1f} us"),
    ]
    # The step: the lines above once per micro-batch (the optimizer's and the clipping's once), and the
    # gradients of each micro-batch after the first added to the ones before.
    items = [(n, t if n in PER_STEP else accumulation * t,
              how if n in PER_STEP or accumulation == 1 else f"{how}; x {accumulation} micro-batches")
             for n, t, how in items]
    items.append(("accumulation", (accumulation - 1) * accumulation_bytes(params, copies) / bw,
                  f"{accumulation - 1} x the gradients added to the ones before: the encoder's GEMM weights' "
                  f"({copies / 1e6:.0f}M) by their weight-gradient GEMMs in place (4 bytes a parameter: the fp32 "
                  f"gradient read by the epilogue), the other {(params - copies) / 1e6:.0f}M's by autograd (12 "
                  "bytes: both read, the sum written)" if accumulation > 1 else "one micro-batch: nothing added"))
    seconds = sum(t for _, t, _ in items)
    # The ceiling: this step with its memory-bound work done as well as it can be, the GEMMs,
    # attention, optimizer and launches as above.
    row_bytes = sum(_launch(results, s, k, v).hbm_bytes for k, v in ROW_KERNELS)
    embedding_bytes = sum(_launch(results, s, k).hbm_bytes for k in EMBEDDING_KERNELS)
    best = {n: t for n, t, _ in items}
    best["row ops"] = accumulation * (layers * row_bytes + embedding_bytes) / bw
    for name in REMOVABLE:
        best[name] = 0.0
    if pretraining:
        best["MLM head"] = accumulation * sum(head[name] for name in HEAD_LINES if name in HEAD.STRUCTURAL)
    ceiling = sum(best.values())
    step_flops = accumulation * flops
    return {"case": case.name, "setting": s.label(), "accumulation": accumulation,
            "items": [{"name": n, "seconds": t, "how": how} for n, t, how in items],
            "seconds": seconds, "sequences_per_s": accumulation * s.batch / seconds, "model_flops": step_flops,
            "mfu": step_flops / seconds / gpu.dense_bf16_flops, "target_mfu": case.target_mfu,
            "ceiling": {"seconds": ceiling, "mfu": step_flops / ceiling / gpu.dense_bf16_flops, "how": CEILING}}


# --------------------------------------------------------------------------- a GPU run's trace
GEMM_NAMES = ("nvjet", "gemm", "cutlass", "xmma", "sm90_", "sm80_")  # cuBLAS's, and _gemm_bias_gelu_kernel


def trace_device_time(path: str) -> Optional[Dict[str, float]]:
    """{busy, gemm} milliseconds per step from a committed chrome trace of bertfast's step (the
    union of the device's kernel, copy and fill spans; GEMMs: cuBLAS's kernels by name), the steps
    counted as bertfast/bench/profile.py trace_steps counts them. None when the trace has no device
    events."""
    from bertfast.bench.profile import DEVICE_CATEGORIES, covered_time, read_trace, trace_steps
    events, _ = read_trace(path)
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e]
    if not device:
        return None
    steps = max(1, trace_steps(events))

    spans = [(e["ts"], e["ts"] + e["dur"]) for e in device]
    gemm = [(e["ts"], e["ts"] + e["dur"]) for e in device
            if e.get("cat") == "kernel" and any(n in e["name"].lower() for n in GEMM_NAMES)]
    return {"busy_ms": covered_time(spans) / steps / 1e3, "gemm_ms": covered_time(gemm) / steps / 1e3,
            "steps": steps}
