"""The masked-position-only MLM head.

mlm_head_loss gathers the rows that carry a label, runs the head transform
(dense -> bias+GELU -> LayerNorm, through the fused ops) and then linear_cross_entropy: the
decoder projection (weight tied to the word embeddings) and softmax cross-entropy over the
vocabulary, in row chunks, so logits for all masked rows never exist at once. Gradients of
the projection are computed chunk by chunk during the forward pass and scaled by the
incoming gradient in backward; no second logits pass.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from bertfast import dispatch
from bertfast.ops._common import distinct, empty, register_backends
from bertfast.ops.bias_gelu import bias_gelu
from bertfast.ops.layer_norm import layer_norm
from bertfast.reference import IGNORE_INDEX

OP = "linear_cross_entropy"
Tensor = torch.Tensor
register_backends(OP, "cross_entropy", ["x", "weight", "bias"])


@torch.library.custom_op("bertfast::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy(x: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, chunk_rows: int,
                          compute_grad: bool, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    impl = dispatch.get(OP, backend).impl
    # chunk_rows 0: the launcher picks its default (logits of one chunk within a memory budget).
    loss_sum, n_correct, gx, gw, gb = impl.linear_cross_entropy_fwd(x, weight, bias, labels, chunk_rows or None,
                                                                   compute_grad, 1.0)
    return distinct([loss_sum, n_correct, empty(x) if gx is None else gx, empty(weight) if gw is None else gw,
                     empty(weight) if gb is None else gb], [x, weight, bias, labels])


@_linear_cross_entropy.register_fake
def _(x, weight, bias, labels, chunk_rows, compute_grad, backend):
    scalar = x.new_empty((), dtype=torch.float32)
    count = x.new_empty((), dtype=torch.int64)
    if not compute_grad:
        return scalar, count, empty(x), empty(weight), empty(weight)
    gb = torch.empty_like(bias) if bias is not None else empty(weight)
    return scalar, count, torch.empty_like(x), torch.empty_like(weight), gb


def _setup(ctx, inputs, output):
    ctx.has_bias, ctx.computed_grad = inputs[2] is not None, inputs[5]
    ctx.save_for_backward(*output[2:])


def _backward(ctx, d_loss_sum, _d_correct, _dgx, _dgw, _dgb):
    if not ctx.computed_grad:
        raise RuntimeError("linear_cross_entropy: backward called on a forward run without gradients")
    gx, gw, gb = ctx.saved_tensors
    return (gx * d_loss_sum.to(gx.dtype), gw * d_loss_sum.to(gw.dtype),
            gb * d_loss_sum.to(gb.dtype) if ctx.has_bias else None, None, None, None, None)


_linear_cross_entropy.register_autograd(_backward, setup_context=_setup)


def linear_cross_entropy(x: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                         chunk_rows: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """(sum of CE over labelled rows (fp32 scalar), number of rows whose argmax equals the label).

    x [M, H], weight [V, H], bias [V] or None, labels [M] (-100 = ignored).
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{OP}: expected x [rows, H] and weight [vocab, H], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if labels.shape != x.shape[:1]:
        raise ValueError(f"{OP}: expected labels of shape [{x.shape[0]}], got {tuple(labels.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{OP}: expected bias of shape [{weight.shape[0]}], got {tuple(bias.shape)}")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"{OP}: chunk_rows must be >= 1, got {chunk_rows}")
    compute_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    backend = dispatch.select(OP, x=x, weight=weight, bias=bias, labels=labels)
    loss_sum, n_correct, _, _, _ = _linear_cross_entropy(x, weight, bias, labels.long(), chunk_rows or 0, compute_grad,
                                                         backend)
    return loss_sum, n_correct


class MLMHeadLoss(NamedTuple):
    loss: Tensor  # mean CE over labelled positions (0 when there are none)
    num_correct: Tensor  # int64: labelled positions whose argmax equals the label
    num_predictions: Tensor  # int64: labelled positions


def masked_positions(labels: Tensor, max_predictions_per_seq: Optional[int] = None) -> Tensor:
    """Flat indices of the labelled positions of labels [B, S].

    Without max_predictions_per_seq the count is data-dependent. With it, exactly
    B * max_predictions_per_seq indices come back (static shape): each sequence's labelled
    positions first, then unlabelled ones as filler (their label is -100, so they add nothing).
    Labelled positions beyond the limit raise an error rather than being dropped silently.
    """
    if max_predictions_per_seq is None:
        if torch.compiler.is_compiling() and not torch._dynamo.config.capture_dynamic_output_shape_ops:
            # nonzero has a data-dependent size, which Dynamo captures only with
            # capture_dynamic_output_shape_ops=True; otherwise every position is a row (unlabelled
            # ones add nothing). max_predictions_per_seq gives the sparse static form.
            return torch.arange(labels.numel(), device=labels.device)
        return (labels.reshape(-1) != IGNORE_INDEX).nonzero().flatten()
    batch, seqlen = labels.shape
    limit = min(max_predictions_per_seq, seqlen)
    unlabelled = (labels == IGNORE_INDEX).to(torch.int8)
    order = torch.sort(unlabelled, dim=1, stable=True).indices[:, :limit]  # labelled first, in order
    return (order + torch.arange(batch, device=labels.device)[:, None] * seqlen).flatten()


def mlm_head_loss(hidden: Tensor, labels: Tensor, dense_weight: Tensor, dense_bias: Tensor, ln_weight: Tensor,
                  ln_bias: Tensor, eps: float, decoder_weight: Tensor, decoder_bias: Optional[Tensor],
                  approximate: str = "none", max_predictions_per_seq: Optional[int] = None,
                  chunk_rows: Optional[int] = None) -> MLMHeadLoss:
    """MLM loss computed only where labels != -100.

    hidden [B, S, H] (or [N, H] with labels [N]); the transform (dense, GELU, LayerNorm) and the
    decoder run on the gathered rows only. Mean over labelled positions as transformers computes it.
    """
    width = hidden.shape[-1]
    flat_labels = labels.reshape(-1)
    if flat_labels.numel() * width != hidden.numel():
        raise ValueError(f"mlm_head_loss: labels {tuple(labels.shape)} do not match hidden {tuple(hidden.shape)}")
    if max_predictions_per_seq is not None:
        if labels.dim() != 2:
            raise ValueError("mlm_head_loss: max_predictions_per_seq needs labels of shape [batch, seq]")
        positions = masked_positions(labels, max_predictions_per_seq)
    else:
        positions = masked_positions(flat_labels[None])
    rows = hidden.reshape(-1, width).index_select(0, positions)  # [M, H]
    picked_labels = flat_labels.index_select(0, positions)
    h = bias_gelu(F.linear(rows, dense_weight), dense_bias, approximate)
    h = layer_norm(h, ln_weight, ln_bias, eps)
    loss_sum, num_correct = linear_cross_entropy(h, decoder_weight, decoder_bias, picked_labels, chunk_rows)
    num_predictions = (picked_labels != IGNORE_INDEX).sum()
    return MLMHeadLoss(loss_sum / num_predictions.clamp_min(1), num_correct, num_predictions)
