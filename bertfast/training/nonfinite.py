"""Never train on NaN: each step's loss and gradient norm are watched on the device, with no host
read per step (as GradScaler keeps its inf flag on the device); the trainer reads the watch when
it reads anything else (the log interval, a parity check, an evaluation) and before every
checkpoint, which it also refuses to write while a parameter is not finite. So a checkpoint is
always finite, and keep-last pruning never drops a finite checkpoint for a non-finite one.

``--on-nonfinite stop`` (the default): the run stops with ``NonFiniteError`` naming the first
bad step and the last checkpoint (written before it). ``--on-nonfinite skip``: a step whose loss
or gradient norm is not finite is not applied (``TrainStep(skip_nonfinite=True)``), the skips are
counted in the log, and ``--max-skipped-steps`` skips in a row stop the run as above. Where the
optimizer skips on the device (fused AdamW, a capturable LAMB), the counts are device tensors too
and the stop comes at the next read (the skipped steps changed nothing, so only their time is
lost); otherwise the step has read its flag and the stop comes at once.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch

from bertfast.model.saving import nonfinite_weights
from bertfast.training.step import StepResult

Tensor = torch.Tensor


class NonFiniteError(RuntimeError):
    """The loss, the gradient norm or a parameter stopped being finite."""


class NonFiniteWatch:
    def __init__(self, device: torch.device, skip: bool = False, max_skipped_steps: int = 10):
        self.skip, self.max_skipped_steps = skip, max_skipped_steps
        self.first_step = torch.full((), -1, dtype=torch.int64, device=device)  # -1: none yet
        self.first_values = torch.zeros(2, dtype=torch.float64, device=device)  # its loss, gradient norm
        # Skip mode: steps skipped in the whole run and in a row so far (host ints, or device ones
        # where the step skips on the device).
        self.skipped_steps: Union[int, Tensor] = 0
        self.skipped_in_a_row: Union[int, Tensor] = 0
        self.checkpoint: Optional[str] = None  # the last checkpoint written, named in the error

    @property
    def skipped(self) -> int:
        """Steps skipped so far (a host read where they are counted on the device)."""
        return int(self.skipped_steps)

    def observe(self, step: int, done: StepResult) -> None:
        """Record step ``step`` (1-based). No host read. In skip mode, where the step has read its
        flag already, too many skips in a row raise ``NonFiniteError`` here; where it skipped on the
        device, at the next ``check``. Outside skip mode, ``first_step`` is the first non-finite step;
        in skip mode, the step that made ``max_skipped_steps`` skips in a row."""
        if not self.skip:
            self._mark(~done.finite, step, done)
        elif isinstance(done.skipped, Tensor):
            self.skipped_steps = self.skipped_steps + done.skipped.long()
            self.skipped_in_a_row = torch.where(done.skipped, self.skipped_in_a_row + 1, 0)
            self._mark(self.skipped_in_a_row >= self.max_skipped_steps, step, done)
        elif not done.skipped:
            self.skipped_in_a_row = 0
        else:
            self.skipped_steps += 1
            self.skipped_in_a_row += 1
            if self.skipped_in_a_row >= self.max_skipped_steps:
                raise NonFiniteError(describe(step - self.skipped_in_a_row + 1, float(done.loss),
                                              float(done.grad_norm), self.checkpoint, self.skipped_in_a_row))

    def _mark(self, bad: Tensor, step: int, done: StepResult) -> None:
        """Record ``step`` and its values where ``bad`` holds and no step was recorded yet (on the device)."""
        first = bad & (self.first_step < 0)
        self.first_step = torch.where(first, step, self.first_step)
        self.first_values = torch.where(first, torch.stack([done.loss.double(), done.grad_norm.double()]),
                                        self.first_values)

    def check(self, model: Optional[torch.nn.Module] = None, step: int = 0,
              reduce_max: Optional[Callable[[float], float]] = None) -> None:
        """Raise ``NonFiniteError`` if a step so far was not finite (one host read; ``reduce_max``
        makes every rank agree), or, given ``model``, if one of its parameters is not."""
        first = int(self.first_step)
        if reduce_max is not None:
            first = int(reduce_max(float(first)))
        if first >= 0:
            loss, grad_norm = self.first_values.tolist()
            if self.skip:  # the last of max_skipped_steps skips in a row
                raise NonFiniteError(describe(first - self.max_skipped_steps + 1, loss, grad_norm, self.checkpoint,
                                              self.max_skipped_steps))
            raise NonFiniteError(describe(first, loss, grad_norm, self.checkpoint))
        if model is None:
            return
        bad = nonfinite_weights(model)
        # Under FSDP each rank holds a shard: all stop together, or the others would wait forever.
        if bad if reduce_max is None else reduce_max(1.0 if bad else 0.0) > 0:
            raise NonFiniteError(f"training stopped: after step {step} the model holds NaN or inf "
                                 f"({', '.join(bad[:3]) or 'in a shard of another rank'}) although the loss and "
                                 f"gradient norm were finite; " + _where(self.checkpoint) + _ADVICE)


def describe(step: int, loss: float, grad_norm: float, checkpoint: Optional[str], skipped_in_a_row: int = 0) -> str:
    """The error a run stops with: what went non-finite, where to resume, what to change."""
    values = f"loss {_show(loss)}, gradient norm {_show(grad_norm)}"
    what = (f"{skipped_in_a_row} steps in a row from step {step} had a non-finite loss or gradient norm and were "
            f"skipped (the last: {values})" if skipped_in_a_row else f"step {step} has a non-finite {values}")
    return f"training stopped: {what}; " + _where(checkpoint) + _ADVICE


def _where(checkpoint: Optional[str]) -> str:
    return (f"the last checkpoint, {checkpoint}, was written before it and is intact: resume from it (--resume) "
            if checkpoint else "no checkpoint was written before it; start again ")


_ADVICE = ("after removing the cause (a lower --lr or more warm-up, gradient clipping (--max-grad-norm), --adam-eps > "
           "0, fp32 precision, or labels that are finite numbers), or pass --on-nonfinite skip to skip such steps")


def _show(x: float) -> str:
    return str(x) if not math.isfinite(x) else f"{x:.4g}"
