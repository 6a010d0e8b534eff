"""The heads' losses: transformers' means, except for a batch with nothing to learn from.

transformers' BERT takes torch's mean reductions, so a batch whose labels are all ignored (-100,
or QA positions outside the sequence) or an empty batch gives a NaN loss, and a NaN gradient
that spoils the weights at the next optimizer step. bertfast gives 0 with zero gradients there,
as its MLM head does ("0 when there are none"); every other batch gives transformers' value.
No host sync: the divisor is a device tensor or a static size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bertfast import model_inputs
from bertfast.contract import IGNORE_INDEX

Tensor = torch.Tensor


def cross_entropy(logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Mean cross-entropy (fp32) over the labels that are not ``ignore_index``; 0 when there are none."""
    labels = labels.reshape(-1)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels, ignore_index=ignore_index,
                            reduction="sum")
    return total / (labels != ignore_index).sum().clamp_min(1)


def mean(values: Tensor) -> Tensor:
    """Mean of an elementwise loss; 0 for an empty batch (the count is static: no sync)."""
    return values.sum() / max(values.numel(), 1)


def sequence_classification(model: torch.nn.Module, logits: Tensor, labels: Tensor) -> Tensor:
    """transformers' problem_type rules (the type is inferred once and stored in the config)."""
    cfg, num_labels = model.config, model.num_labels
    if cfg.problem_type is None:
        if num_labels == 1:
            cfg.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            cfg.problem_type = "single_label_classification"
        else:
            cfg.problem_type = "multi_label_classification"
    if cfg.problem_type == "regression":
        if num_labels == 1:
            return mean(F.mse_loss(logits.squeeze().float(), labels.squeeze().float(), reduction="none"))
        return mean(F.mse_loss(logits.float(), labels.float(), reduction="none"))
    if cfg.problem_type == "single_label_classification":
        model_inputs.check_labels("labels", labels, num_labels)
        return cross_entropy(logits.view(-1, num_labels), labels.view(-1))
    return mean(F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none"))


def span(start_logits: Tensor, end_logits: Tensor, start_positions: Tensor, end_positions: Tensor) -> Tensor:
    """QA: mean of the start and end losses. As transformers: positions outside the sequence are
    clamped to seq_len and ignored."""
    if start_positions.dim() > 1:
        start_positions = start_positions.squeeze(-1)
    if end_positions.dim() > 1:
        end_positions = end_positions.squeeze(-1)
    ignored = start_logits.size(1)
    start_positions = start_positions.clamp(0, ignored)
    end_positions = end_positions.clamp(0, ignored)
    return (cross_entropy(start_logits, start_positions, ignored)
            + cross_entropy(end_logits, end_positions, ignored)) / 2
