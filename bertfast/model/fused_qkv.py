"""The query, key and value projections into one [N, 3H] buffer, the attention's packed qkv.

Their weights stay three parameters, each with storage of its own (transformers' state-dict keys,
PEFT targets, optimizers). One GEMM would need one [3H, H] weight:

* concatenated per call, that is a copy of the three weights in every layer of every forward: on a
  CPU at 128 tokens about a third of the projection's time, the whole gap to transformers at batch 1;
* cached, it goes stale: torch's fused AdamW and ``.data`` writes change weights without bumping
  their version counters;
* as views of one buffer held by the three parameters, checkpoints break: safetensors' save_model
  refuses tensors that do not cover their storage, and accelerate's safetensors saving keeps one
  name per storage, dropping key and value from the file.

So with nothing to differentiate (inference), three GEMMs write their columns of the one output
(addmm with out=, which takes a strided output as it is): no weight is copied and the result is
the packed qkv. Under autocast or torch.compile, where out= does not apply, the weights are
concatenated and one GEMM runs. What is differentiated takes bertfast.model.residual_linear instead
(one GEMM too, each weight cast into its rows of one buffer; its backward also sums the residual's
gradient).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from bertfast.ops._common import launch_directly

Tensor = torch.Tensor


def _into_columns(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor]) -> bool:
    """Whether the three GEMMs can write their columns of one output: what an op entry would launch
    directly (eager, plain tensors, nothing that needs a gradient), of one dtype and device, no autocast."""
    tensors = (x, *weights, *biases)
    return (x.dim() == 2 and not torch.is_autocast_enabled(x.device.type) and launch_directly(*tensors)
            and all(t.dtype == x.dtype and t.device == x.device for t in tensors))


def linear(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor]) -> Tensor:
    """rows x [N, H] -> [N, sum of the weights' rows]: x @ cat(weights)^T + cat(biases)."""
    if not _into_columns(x, weights, biases):
        return F.linear(x, torch.cat(list(weights)), torch.cat(list(biases)))
    out = x.new_empty((x.shape[0], sum(w.shape[0] for w in weights)))
    start = 0
    for weight, bias in zip(weights, biases):
        stop = start + weight.shape[0]
        torch.addmm(bias, x, weight.t(), out=out[:, start:stop])
        start = stop
    return out
