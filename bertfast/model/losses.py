"""The heads' losses: transformers' means, except for a batch with nothing to learn from.

transformers' BERT takes torch's mean reductions, so a batch whose labels are all ignored (-100,
or QA positions outside the sequence) or an empty batch gives a NaN loss, and a NaN gradient
that spoils the weights at the next optimizer step. bertfast gives 0 with zero gradients there,
as its MLM head does ("0 when there are none"); every other batch gives transformers' value.
No host sync: the divisor is a device tensor or a static size.

Packed sequences (``padding.pack_batch``) hold dummy and empty slots next to the real sequences:
their integer labels are -100, their float targets NaN, and both count nowhere. Outside packed
batches a NaN target stays an error the run sees (a NaN loss), never a silently skipped example.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bertfast.model import model_inputs
from bertfast.contract import IGNORE_INDEX
from bertfast.padding import packed_layout

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


def replaced_tokens(logits: Tensor, labels: Tensor, attention_mask: "Tensor | None") -> Tensor:
    """ELECTRA's discriminator loss: mean binary cross-entropy (fp32) of logits [B, S] against labels
    [B, S] (1 = replaced) over the attention mask's tokens (every position without a mask); 0 when
    there are none."""
    values = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none")
    if attention_mask is None:
        return mean(values)
    active = attention_mask == 1
    return values.masked_fill(~active, 0.0).sum() / active.sum().clamp_min(1)


def _float_targets(loss, logits: Tensor, labels: Tensor, packed: bool) -> Tensor:
    """Mean of an elementwise loss against float targets; in a packed batch NaN targets (the slots
    without a sequence to learn from) are left out."""
    logits, labels = logits.float(), labels.float()
    if not packed:
        return mean(loss(logits, labels, reduction="none"))
    known = labels.isnan().logical_not()
    values = loss(logits, labels.masked_fill(~known, 0.0), reduction="none").masked_fill(~known, 0.0)
    return values.sum() / known.sum().clamp_min(1)


def sequence_classification(model: torch.nn.Module, logits: Tensor, labels: Tensor, packed: bool = False) -> Tensor:
    """transformers' problem_type rules (the type is inferred once and stored in the config).
    ``packed``: one row per packed slot, NaN float targets ignored (see the module's note)."""
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
            return _float_targets(F.mse_loss, logits.squeeze(), labels.squeeze(), packed)
        return _float_targets(F.mse_loss, logits, labels, packed)
    if cfg.problem_type == "single_label_classification":
        model_inputs.check_labels("labels", labels, num_labels)
        return cross_entropy(logits.view(-1, num_labels), labels.view(-1))
    return _float_targets(F.binary_cross_entropy_with_logits, logits, labels, packed)


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


def packed_span(start_logits: Tensor, end_logits: Tensor, start_positions: Tensor, end_positions: Tensor,
                cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
    """QA on packed sequences: logits [1, T], one start and one end position per slot [K], counted
    from the slot's first token. Each sequence's softmax runs over its own tokens (a padded
    batch's also spans its padding); a position outside [0, length) is ignored, -100 included."""
    slots = cu_seqlens.numel() - 1
    index, inside = packed_layout(cu_seqlens, max_seqlen, start_logits.shape[-1])  # [K, S] each
    lengths = cu_seqlens.diff()

    def one(name: str, logits: Tensor, positions: Tensor) -> Tensor:
        if positions.dim() > 1:
            positions = positions.squeeze(-1)
        if positions.shape != (slots,) or positions.is_floating_point():
            raise ValueError(f"{name}: expected integer positions, one per packed sequence [{slots}] (-100 for the "
                             f"slots without one), got {positions.dtype} of shape {tuple(positions.shape)}")
        per_sequence = logits.reshape(-1).float()[index].masked_fill(~inside, torch.finfo(torch.float32).min)
        wanted = (positions >= 0) & (positions < lengths)
        return cross_entropy(per_sequence, positions.long().masked_fill(~wanted, IGNORE_INDEX))

    return (one("start_positions", start_logits, start_positions) + one("end_positions", end_logits, end_positions)) / 2
