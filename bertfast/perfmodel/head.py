"""The MLM head's target predicted: within 1.25x of its GEMM floor (benchmarks/README.md).

The kernel suite times `ops.mlm_head_loss` (forward and backward, bf16 inputs and parameters, 19 of each
sequence's 128 tokens labelled, as BERT's masking labels 15% of a full one: 2,432 of 16,384; its static
gather, max_predictions_per_seq, with its checks on the device, as a pre-training step runs it) beside
its GEMM floor: the head's GEMMs alone, cuBLAS at the labelled rows over the padded vocabulary
(transform dense and decoder, forward, input and weight gradients). Both run the same GEMMs, so the
model prices them alike (the GEMM rate, hardware.Gpu.gemm_flops) and the head's ratio to its floor is
what it moves besides them, at the achievable bandwidth, and its launches, line by line as the op's
code runs them (ops/mlm_head_loss.py; the chunked decoder driver ``_decoder_loss``):

- the labelled rows gathered (index_select), and their gradient scattered back into a zero-filled
  gradient of every token (its backward);
- the transform's bias+GELU and LayerNorm, forward and backward, over the labelled rows;
- the decoder weight (and bias) copied, in the activations' dtype, into the padded vocabulary's rows;
- the loss kernel: each row of logits read, its gradient written in place (the row's second read,
  for the gradient, is an L2 hit: one row is 61 KB);
- the pad's gradient zeroed; the bias gradient, a column sum of the logits' gradient;
- the weight gradient, where it is not one chunk's GEMM in the weight's dtype (as the floor writes
  it): accumulated in fp32 (its GEMMs write fp32, twice the floor's bf16; a chunk after the first
  reads it back), then cast to the weight's dtype;
- the loss's incoming gradient: one chunk's backward folds it into x before the weight gradient's GEMM
  and onto the input and bias gradients; over several chunks, whose gradients the forward computes for
  a loss scale of 1, the backward scales all three.

Its ceiling: the ratio with only the lines no design around library GEMMs avoids: the loss kernel
(the logits read and their gradient written), the bias gradient's column sum (a reduction over the
rows, where the loss kernel's is over the vocabulary), the gather and scatter, the transform and the
launches. Below it, the loss would have to run inside the GEMMs.

``fused_lines`` prices BERTFAST_MLM_HEAD=fused (kernels/mlm_head_loss.py): the loss's statistics in the
forward GEMM's epilogue, the logits' gradient formed inside the backward's two GEMMs and never written,
the bias gradient a row of the weight gradient's (its kernels predicted from their SASS by
perfmodel/report.py, fused_head_kernels); no weight copy, no loss pass, no column sum. Its ceiling has
its GEMMs at the floor's rate. ``target`` takes the faster design, as the kernel suite's target takes
the fastest of bertfast's rows.

Predictions, not measurements: the GPU run's kernel suite measures both (bench.targets).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

from bertfast.bench.thresholds import MLM_HEAD_FLOOR as TARGET  # at most this many times its GEMM floor
from bertfast.perfmodel.hardware import H100, Gpu

SEQ = 128          # the kernel suite's BERT-large and BERT-base case: batch 128 x seq 128
TOKENS = 16384
PER_SEQUENCE = 19  # its labelled positions in each sequence (bench.kernel_cases.mlm_predictions_per_seq)
VOCAB = 30522
# The head's kernels besides its GEMMs, forward and backward, at the kernel suite's case (bf16, the static gather,
# the checks on the device as a GPU step runs them, the vocabulary padded), as tests/test_perfmodel_head.py counts
# them by tracing ops.mlm_head_loss on CPU: torch's operations that run a kernel and Triton's launches, each
# torch.sort SORT_KERNELS on CUDA (its values copied, its indices filled, the sort). Of the library's 44, 8 find
# the static gather's positions and check their count, 8 check the labels' range, 4 pad the weight and bias.
SORT_KERNELS = 3
LAUNCH_COUNT = 44
# The lines no design around library GEMMs avoids (the module's docstring): the ceiling's.
STRUCTURAL = ("gather, scatter", "transform", "loss", "bias gradient", "launch gaps")
# BERTFAST_MLM_HEAD=fused: its 36. Gone: the weight's and bias's padding, the pad's zeroing, the loss kernel, the
# bias gradient's column sum, the loss's incoming gradient applied three times, and 6 of the labels' range check
# (the statistics kernel's flags, then one assert); added: the rows' sort by label, its tiles' bounds and their
# search, x padded beside its column of ones, the input gradient's counts zeroed. The lines it cannot avoid, with
# its GEMMs at the floor's rate.
FUSED_LAUNCH_COUNT = 36
FUSED_STRUCTURAL = ("gather, scatter", "transform", "statistics", "between", "launch gaps")


def lines(hidden: int, tokens: int = TOKENS, vocab: int = VOCAB, act_bytes: int = 2, weight_bytes: int = 2,
          gpu: Gpu = H100, rows: Optional[int] = None) -> Dict[str, object]:
    """The head's time besides its GEMMs, line by line (name, seconds, how), and the GEMMs' floor;
    ``rows`` labelled of ``tokens`` (default the kernel suite's PER_SEQUENCE in each sequence of SEQ)."""
    from bertfast.ops.mlm_head_loss import default_chunk_rows, padded_vocab
    m = tokens // SEQ * PER_SEQUENCE if rows is None else rows
    vp = padded_vocab(vocab, act_bytes)
    chunks = math.ceil(m / default_chunk_rows(m, vocab, act_bytes))
    one_gemm = chunks == 1 and weight_bytes == act_bytes  # _decoder_loss: no fp32 buffer
    bw = gpu.achievable_hbm_bytes_per_s
    mh = m * hidden
    gemm_flops = 3 * (2.0 * m * hidden * hidden + 2.0 * m * vp * hidden)
    items: List[Tuple[str, float, str]] = [
        ("gather, scatter", (2 * mh + tokens * hidden + 3 * mh) * act_bytes,
         f"{m} labelled rows of {tokens} gathered; the hidden gradient zero-filled and the rows' added back"),
        ("transform", 10 * mh * act_bytes, "bias+GELU and LayerNorm over the labelled rows, forward and backward"),
        ("weight copy", vocab * hidden * weight_bytes + vp * hidden * act_bytes,
         f"the decoder weight into {vp} padded rows in the activations' dtype"),
        ("loss", 2 * m * vocab * act_bytes, f"{m} x {vocab} logits read, their gradient written in place"),
        ("bias gradient", m * vocab * act_bytes + vocab * 4, "a column sum of the logits' gradient"),
        ("weight gradient", 0 if one_gemm else vp * hidden * (4 - act_bytes) + (chunks - 1) * vp * hidden * 4
         + (vocab * hidden * (4 + weight_bytes) if weight_bytes != 4 else 0),
         "one chunk's GEMM writes it in the weight's dtype, as the floor's does" if one_gemm else
         f"fp32 from its GEMM over {chunks} chunk{'s' if chunks > 1 else ''}, then in the weight's dtype"),
        ("scaling", 4 * mh * act_bytes + 2 * vocab * 4 if chunks == 1 else
         2 * (mh * act_bytes + vocab * hidden * weight_bytes + vocab * weight_bytes),
         "the loss's incoming gradient into x before the weight gradient's GEMM, onto the input and bias "
         "gradients" if chunks == 1 else "the three gradients times the loss's incoming gradient, in the backward"),
    ]
    out = [{"name": name, "seconds": moved / bw, "bytes": moved, "how": how} for name, moved, how in items]
    out.append({"name": "launch gaps", "seconds": LAUNCH_COUNT * gpu.launch_gap_s, "bytes": 0,
                "how": f"{LAUNCH_COUNT} kernels besides the GEMMs x {gpu.launch_gap_s * 1e6:.1f} us"})
    floor = gemm_flops / gpu.gemm_flops
    besides = sum(i["seconds"] for i in out)
    structural = sum(i["seconds"] for i in out if i["name"] in STRUCTURAL)
    return {"rows": m, "vocab": vocab, "padded_vocab": vp, "chunks": chunks, "gemm_flops": gemm_flops,
            "floor_s": floor, "items": out, "seconds": floor + besides, "ratio": (floor + besides) / floor,
            "ceiling": (floor + structural) / floor}


def fused_lines(hidden: int, kernels: Dict[str, object], tokens: int = TOKENS, vocab: int = VOCAB,
                act_bytes: int = 2, gpu: Gpu = H100, rows: Optional[int] = None) -> Dict[str, object]:
    """BERTFAST_MLM_HEAD=fused (kernels/mlm_head_loss.py): the head's time besides the same GEMM floor, one
    chunk, bf16 parameters. Its kernels as ``kernels`` predicts them from their SASS (perfmodel/report.py,
    fused_head_kernels: forward_s, stats_s, dx_s, dw_s), each GEMM beyond the floor's; the steps
    between the backward's GEMMs by their bytes; no weight copy, no pass over the logits' gradient (never
    written) and no scaling (the loss's incoming gradient in the GEMMs' epilogues); the rest as ``lines``."""
    library = lines(hidden, tokens, vocab, act_bytes, act_bytes, gpu, rows)
    m, vp = library["rows"], library["padded_vocab"]
    bw = gpu.achievable_hbm_bytes_per_s
    kept = {i["name"]: i for i in library["items"] if i["name"] in ("gather, scatter", "transform")}
    one_floor = 2.0 * m * vp * hidden / gpu.gemm_flops  # each of the decoder's three GEMMs at the floor
    split = int(kernels["dx_split"])
    width = -(-(hidden + 1) // 128) * 128
    between = m * (hidden + width) * act_bytes + m * 8 * 4 + vocab * (4 + act_bytes)

    def gemm(name: str, key: str, what: str) -> Dict[str, object]:
        return {"name": name, "seconds": kernels[f"{key}_s"] - one_floor, "bytes": 0,
                "how": f"{what}, {kernels[f'{key}_s'] * 1e6:.0f} us predicted ({kernels[f'{key}_config']}) where the "
                       f"floor's takes {one_floor * 1e6:.0f}"}
    items = [kept["gather, scatter"], kept["transform"],
             gemm("forward GEMM", "forward", "the logits' GEMM with the loss's statistics in its epilogue"),
             {"name": "statistics", "seconds": kernels["stats_s"], "bytes": 0,
              "how": f"{m} rows' tile statistics combined into the loss, lse and the tiles' factors, z at the "
                     "label from x's row and W's (predicted)"},
             gemm("input GEMM", "dx", "the input gradient's GEMM forming g from u as it loads it" + (
                 f", its vocabulary split {split} ways (fp32 partials, added by each tile's last split)" if split > 1
                 else "")),
             gemm("weight GEMM", "dw", "the weight and bias gradients' GEMM (x^T scaled by c, a column of ones) "
                                       "with the one-hot's rows added in label order"),
             {"name": "between", "seconds": between / bw, "bytes": between,
              "how": "x padded beside its column of ones, the rows sorted by label, the bias gradient cast"},
             {"name": "launch gaps", "seconds": FUSED_LAUNCH_COUNT * gpu.launch_gap_s, "bytes": 0,
              "how": f"{FUSED_LAUNCH_COUNT} kernels besides the GEMMs x {gpu.launch_gap_s * 1e6:.1f} us"}]
    floor = library["floor_s"]
    besides = sum(i["seconds"] for i in items)
    structural = sum(i["seconds"] for i in items if i["name"] in FUSED_STRUCTURAL)
    return {**{k: library[k] for k in ("rows", "vocab", "padded_vocab", "chunks", "gemm_flops", "floor_s")},
            "items": items, "seconds": floor + besides, "ratio": (floor + besides) / floor,
            "ceiling": (floor + structural) / floor}


def target(hidden: int = 1024, gpu: Gpu = H100, fused: Optional[Dict[str, object]] = None) -> Dict[str, object]:
    """The target line (report.targets' form) at BERT-large's hidden size by default; with ``fused`` (the fused
    decoder's kernels predicted: fused_lines) the faster of the two designs, as the kernel suite's target
    takes the faster of bertfast's rows, and the ceiling of that design."""
    plan = lines(hidden, gpu=gpu)
    fused_plan = fused_lines(hidden, fused, gpu=gpu) if fused is not None else None
    best = fused_plan if fused_plan is not None and fused_plan["ratio"] < plan["ratio"] else plan
    model = {1024: "BERT-large", 768: "BERT-base"}.get(hidden, f"hidden {hidden}")
    items = {i["name"]: i["seconds"] for i in best["items"]}
    if best is plan:
        why = (f"with library GEMMs the loss reads the logits and writes their gradient ({items['loss'] * 1e6:.0f} "
               f"us) and the bias gradient reads it again ({items['bias gradient'] * 1e6:.0f} us): below "
               f"{plan['ceiling']:.2f}x the loss must run inside the GEMMs")
    else:
        why = (f"with the gradient inside bertfast's own GEMMs, what remains besides them is the gather and "
               f"scatter, the transform, the statistics, x's copy and the rows' sort "
               f"({(best['ceiling'] - 1) * best['floor_s'] * 1e6:.0f} us in all): below {best['ceiling']:.2f}x the "
               "transform and the gather would have to run inside the GEMMs too")
    line = {"name": f"MLM head fwd+bwd ({model}, {TOKENS:,} tokens, {plan['rows']:,} labelled, bf16) against its "
                    f"GEMM floor", "predicted": best["ratio"], "target": TARGET, "unit": "x (at most)",
            "met": best["ratio"] <= TARGET, "ceiling": best["ceiling"], "ceiling_why": why, "plan": plan,
            "design": "fused" if best is fused_plan else "library"}
    if fused_plan is not None:
        line["fused_plan"] = fused_plan
    return line


def describe(target_line: Dict[str, object]) -> List[str]:
    """The report's lines for a target line of ``target``: the floor, then what the head adds, in each design."""
    out = []
    for plan, design, structural in ((target_line["plan"], "", STRUCTURAL),
                                     (target_line.get("fused_plan"), ", BERTFAST_MLM_HEAD=fused", FUSED_STRUCTURAL)):
        if plan is None:
            continue
        out += [f"{target_line['name'].split(' against')[0]}{design}: {plan['seconds'] * 1e6:.0f} us, "
                f"{plan['ratio']:.2f}x its GEMM floor of {plan['floor_s'] * 1e6:.0f} us "
                f"({plan['gemm_flops'] / 1e9:.0f} GFLOP at the GEMM rate, the vocabulary padded to "
                f"{plan['padded_vocab']}); besides the GEMMs:"]
        out += [f"  {i['name']:16s} {i['seconds'] * 1e6:6.1f} us  {i['how']}" for i in plan["items"]]
        out.append(f"  ceiling {plan['ceiling']:.2f}x: the floor with only {', '.join(structural)}")
    return out
