"""The model's FLOPs and the GPU peaks MFU divides by: one model for ``bertfast pretrain`` and
``bertfast bench``.

Counted on real tokens only (padding never counts, whatever an implementation computes on
it), 2 flops per multiply-add:

* encoder, per layer: 2 * T * (4 H^2 + 2 H I) for the linear layers (QKV, attention output,
  FFN up and down) plus 4 * sum_b(len_b^2) * H for attention (QK^T and PV);
* the pooler on each sequence's first token, 2 * B * H^2;
* pre-training heads: the MLM head (transform + decoder, 2 * M * H * (H + V)) at the M
  labelled positions only (the work the loss needs) and the NSP classifier, 2 * B * H * 2;
  a classification head: 2 * B * H * num_labels;
* a training step is 3 x forward (backward = 2 x forward; no recomputation counted).

Embedding gathers, LayerNorm, softmax and the optimizer are not counted. MFU = model FLOPs /
time / peak, where the peak is the datasheet dense bf16 rate of the GPU (``bertfast bench``
also reports MFU against the matmul peak it measures).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

HEADS = ("none", "pretraining", "classification")


def mlm_head_flops(m: float, h: int, vocab: int) -> float:
    """Forward FLOPs of the MLM head at m rows: transform dense [H, H] + decoder [V, H]."""
    return 2.0 * m * h * (h + vocab)


def bert_forward_flops_from_counts(config, tokens: float, sum_len_sq: float, sequences: float,
                                   head: str = "pretraining", n_predictions: Optional[float] = None,
                                   num_labels: int = 2) -> float:
    """Forward FLOPs of a BERT model on a batch described by its sums: real tokens, sum of squared
    sequence lengths, sequences (counts a training loop can add up on the device, without a sync).

    head: 'none' (BertModel: encoder + pooler), 'pretraining' (+ MLM head at ``n_predictions``
    labelled positions + NSP), 'classification' (+ [CLS] classifier with ``num_labels``).
    """
    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    from bertfast.model.config import ffn_size  # (transformers: imported when first counted)
    h, i, layers = config.hidden_size, ffn_size(config), config.num_hidden_layers
    flops = layers * (2.0 * tokens * (4 * h * h + 2 * h * i) + 4.0 * sum_len_sq * h)
    flops += 2.0 * sequences * h * h  # pooler
    if head == "pretraining":
        if n_predictions is None:
            raise ValueError("head='pretraining' needs n_predictions (the number of labelled MLM positions)")
        flops += mlm_head_flops(n_predictions, h, config.vocab_size) + 2.0 * sequences * h * 2
    elif head == "classification":
        flops += 2.0 * sequences * h * num_labels
    return flops


def bert_forward_flops(config, lengths: Sequence[int], head: str = "pretraining",
                       n_predictions: Optional[int] = None, num_labels: int = 2) -> float:
    """``bert_forward_flops_from_counts`` for sequences of the given real lengths."""
    lengths = [int(n) for n in lengths]
    return bert_forward_flops_from_counts(config, sum(lengths), sum(n * n for n in lengths), len(lengths), head,
                                          n_predictions, num_labels)


def training_step_flops(forward_flops: float) -> float:
    """Forward + backward (= 2 x forward) model FLOPs."""
    return 3.0 * forward_flops


def mfu(model_flops: float, seconds: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation as a fraction (0.5 = 50%)."""
    if seconds <= 0 or peak_flops_per_s <= 0:
        raise ValueError(f"seconds and peak must be > 0, got {seconds}, {peak_flops_per_s}")
    return model_flops / seconds / peak_flops_per_s


# Dense bf16 tensor-core peaks from the vendors' datasheets, TFLOP/s (no sparsity), matched on the
# device name in order: the first pattern that is a substring of the lower-cased name wins, so a
# longer name comes before its prefix (h100 nvl before h100, a100 before a10, l40s before l40 and l4).
DATASHEET_BF16_TFLOPS = (
    ("gh200", 989.4), ("h200", 989.4), ("h100 nvl", 835.0), ("h100 pcie", 756.0),
    ("h100", 989.4),  # SXM ("NVIDIA H100 80GB HBM3")
    ("b200", 2250.0), ("a100", 312.0), ("a800", 312.0), ("l40s", 362.0), ("l40", 181.0), ("l4", 121.0),
    ("a10g", 125.0), ("a10", 125.0), ("rtx 4090", 165.0), ("rtx 3090", 71.0), ("v100", 125.0), ("t4", 65.0),
)


def datasheet_bf16_tflops(name: str) -> Optional[float]:
    """The datasheet dense bf16 peak of a GPU by name; None for an unknown GPU or a CPU."""
    lowered = name.lower()
    return next((peak for pattern, peak in DATASHEET_BF16_TFLOPS if pattern in lowered), None)


def peak_bf16_flops(device: torch.device) -> Optional[float]:
    """Datasheet dense bf16 FLOP/s of ``device``'s GPU, or None (CPU, or a GPU not in the table)."""
    if device.type != "cuda":
        return None
    tflops = datasheet_bf16_tflops(torch.cuda.get_device_name(device))
    return None if tflops is None else tflops * 1e12
