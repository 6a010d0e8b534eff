"""The optimizer step both ``bertfast pretrain`` and ``bertfast finetune`` run.

One step = the micro-batches of one global batch: each forward runs under the run's
precision (``training.precision``), each loss is divided by the number of micro-batches and
back-propagated (scaled under fp16), gradients are synchronised across ranks on the last
micro-batch only (``no_sync``), then clipped, and the optimizer and the schedule advance.
Nothing here reads a value back to the host: the step's loss, gradient norm and whether both
are finite stay device tensors (``training.nonfinite`` reads them at the log interval).

``skip_nonfinite`` leaves the parameters untouched when the loss or the gradient norm is not
finite. With a fused AdamW (torch's or bertfast's triton one) or a capturable LAMB (and no fp16
loss scaler) the skip happens on the device: the flag goes to the optimizer as its ``found_inf``
(what GradScaler hands fused AdamW), which then leaves the parameters, the moments and the step
count as they were; no host read, so it can be captured in a CUDA graph. Any other optimizer
reads the flag on the host, once per step.

In one process (no DDP or FSDP, whose reducers hook the gradients' accumulation) the micro-batches
after the first add their GEMM weights' gradients in the GEMMs themselves, in place in the gradients
the first left (``model.residual_linear.weight_grads_added_in_place``): no pass of autograd's adds
them (12 bytes a parameter).

Clipping with a fused AdamW (no fp16 scaler, plain tensors) happens inside the optimizer: the
clipping factor goes to it as ``grad_scale`` (what GradScaler hands fused optimizers; the kernel
divides each gradient by it as it reads it), so no separate pass multiplies every gradient (1.0 ms
of the H100's BERT-large step, 2026-11-26). torch's kernel writes the divided gradient back;
bertfast's triton AdamW does not. With clipping off, only the norm is taken. Other optimizers get
torch's ``clip_grad_norm_``.
"""
from __future__ import annotations

import contextlib
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, Optional, Sequence, Union

import torch

from bertfast.contract import checks_on_device
from bertfast.model.residual_linear import weight_grads_added_in_place
from bertfast.training.optim import AdamW, Lamb
from bertfast.training.precision import autocast_context

Batch = Dict[str, torch.Tensor]


@dataclass
class StepResult:
    outputs: list            # the model output of each micro-batch (losses not detached)
    loss: torch.Tensor       # the step's loss (mean over micro-batches), a float64 device scalar
    grad_norm: torch.Tensor  # before clipping, a device scalar
    lr: float                # the learning rate the step used
    finite: torch.Tensor     # device bool: loss and gradient norm finite (under fp16: the loss; the scaler
    #                          skips steps with inf gradients itself)
    skipped: Union[bool, torch.Tensor] = False  # skip_nonfinite only: the update was not applied (a device
    #                                             bool where the optimizer skips on the device)


class TrainStep:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, device: torch.device, precision: str,
                 max_grad_norm: Optional[float] = None,
                 no_sync: Optional[Callable[[], ContextManager[Any]]] = None, skip_nonfinite: bool = False,
                 device_checks: bool = False):
        """``model`` holds the parameters that are clipped; ``no_sync()`` (DDP/FSDP) suspends the
        gradient all-reduce on all but the last micro-batch; ``skip_nonfinite``: a step whose loss or
        gradient norm is not finite changes nothing but the schedule (on the device, or with one host
        read per step: see the module's note);
        ``device_checks``: the model checks input values on the device, never reading them back
        (``contract.checks_on_device``: for data its loader has checked, e.g. packed batches)."""
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.device, self.precision = device, precision
        self.max_grad_norm = max_grad_norm if max_grad_norm and max_grad_norm > 0 else float("inf")
        self.no_sync = no_sync
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
        self.skip_nonfinite = skip_nonfinite
        self.device_checks = device_checks
        # Can a non-finite step be skipped with no host read? torch's fused AdamW and a capturable
        # LAMB can (found_inf), on plain tensors (not FSDP's DTensors), without fp16's loss scaler
        # (which sets found_inf itself). Fixed by the optimizer and precision: worked out once.
        groups = optimizer.param_groups
        plain = not any(hasattr(p, "full_tensor") for g in groups for p in g["params"])
        self.skips_on_device = self.scaler is None and takes_found_inf(optimizer) and plain
        # The clipping factor handed to fused AdamW as grad_scale (module docstring); needs
        # torch.nn.utils.get_total_norm (torch 2.6).
        self.clips_in_optimizer = (self.scaler is None and plain and hasattr(torch.nn.utils, "get_total_norm")
                                   and _fused_adamw(optimizer))
        # GEMMs add into the gradients in place (module note): one process, plain tensors
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.adds_in_gemms = plain and no_sync is None and not distributed
        self.grad_scale: Optional[torch.Tensor] = None  # this step's, set by gradients()

    autocast_cache = True  # off where the step is captured in a CUDA graph

    def autocast(self) -> ContextManager[Any]:
        return autocast_context(self.device, self.precision, self.autocast_cache)

    def forward(self, model: Callable[..., Any], batch: Batch, **kwargs: Any) -> Any:
        checks = checks_on_device() if self.device_checks else contextlib.nullcontext()
        with checks, self.autocast():
            return model(**batch, **kwargs)

    def __call__(self, micro_batches: Sequence[Batch], forward: Callable[[Batch], Any]) -> StepResult:
        """Run one step; ``forward(batch)`` returns a model output with ``.loss`` (call ``self.forward``)."""
        outputs, step_loss, grad_norm, finite = self.gradients(micro_batches, forward)
        lr = self.scheduler.get_last_lr()[0]
        if self.skip_nonfinite and self.skips_on_device:
            skipped = self.step_unless_nonfinite(finite)
        else:
            skipped = self.skip_nonfinite and not _on_every_rank(finite)
            if self.scaler is not None:
                if not skipped:
                    self.scaler.step(self.optimizer)
                self.scaler.update()
            elif not skipped:
                self.optimizer_step()
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            # A skipped first step makes the scheduler warn that it ran before the optimizer: it meant to.
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()`"), UserWarning)
            self.scheduler.step()
        return StepResult(outputs, step_loss, grad_norm, lr, finite, skipped)

    def step_unless_nonfinite(self, finite: torch.Tensor) -> torch.Tensor:
        """The optimizer's step (fused AdamW, capturable LAMB), which changes nothing where ``finite``
        is false on any rank; returns that device flag ("skipped"). No host read: a CUDA graph can
        capture it."""
        skipped = self.skipped_on_device(finite)
        self.optimizer_step(found_inf=skipped.to(torch.float32))
        return skipped

    @staticmethod
    def skipped_on_device(finite: torch.Tensor) -> torch.Tensor:
        """Whether ``finite`` is false on any rank, as a device bool (no host read)."""
        return ~_every_rank_on_device(finite)

    def optimizer_step(self, found_inf: Optional[torch.Tensor] = None) -> None:
        """The optimizer's step, handed for this step only the ``found_inf`` flag and the clipping's
        ``grad_scale`` where there are any."""
        flags = {name: value for name, value in (("found_inf", found_inf), ("grad_scale", self.grad_scale))
                 if value is not None}
        for name, value in flags.items():
            setattr(self.optimizer, name, value)
        try:
            self.optimizer.step()
        finally:
            for name in flags:
                delattr(self.optimizer, name)

    def gradients(self, micro_batches: Sequence[Batch], forward: Callable[[Batch], Any]):
        """Forward and backward over the micro-batches, then clipping: (outputs, the step's loss,
        the gradient norm before clipping, whether both are finite). No host read."""
        count = len(micro_batches)
        outputs = []
        step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        for j, batch in enumerate(micro_batches):
            last = j == count - 1
            sync = self.no_sync() if (self.no_sync is not None and not last) else contextlib.nullcontext()
            with sync:
                out = forward(batch)
                loss = out.loss / count
                with weight_grads_added_in_place(self.adds_in_gemms):
                    (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            step_loss += out.loss.detach().double() / count
            outputs.append(out)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = self.clip()
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
            grad_norm = grad_norm.full_tensor()
        finite = torch.isfinite(step_loss)
        if self.scaler is None:
            finite = finite & torch.isfinite(grad_norm)
        return outputs, step_loss, grad_norm, finite

    def clip(self) -> torch.Tensor:
        """The gradients' norm before clipping. Clipped here (torch's clip_grad_norm_), or, with fused
        AdamW, by the optimizer (``self.grad_scale``, the factor's inverse: the kernel divides by it)."""
        self.grad_scale = None
        if not self.clips_in_optimizer:
            return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        if self.max_grad_norm != float("inf"):
            # clip_grad_norm_'s factor, max_norm / (norm + 1e-6) capped at 1, as a divisor (fp32: the
            # kernel reads a float, whatever the gradients' dtype)
            self.grad_scale = (1.0 / torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)).float()
        return norm

    # The optimizer's state is saved by the caller (FSDP gathers it); these are the rest.
    def state_dict(self) -> Dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Does ``optimizer.step()`` honour a device ``found_inf`` flag, skipping with no host read (and
    so also run from a CUDA graph)? torch's fused AdamW and a capturable LAMB do."""
    if isinstance(optimizer, torch.optim.AdamW):
        return _fused_adamw(optimizer)
    return isinstance(optimizer, Lamb) and optimizer.capturable


def _fused_adamw(optimizer: torch.optim.Optimizer) -> bool:
    """torch's AdamW on its fused kernel, or bertfast's (triton): they take found_inf and
    grad_scale as device tensors."""
    return isinstance(optimizer, AdamW) or (isinstance(optimizer, torch.optim.AdamW)
                                            and all(g.get("fused") for g in optimizer.param_groups))


def _every_rank_on_device(flag: torch.Tensor) -> torch.Tensor:
    """``flag`` true on every rank, as a device bool (the all-reduce is queued, not waited for)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        value = flag.to(torch.float32).reshape(1)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN)
        return value.reshape(()) > 0
    return flag


def _on_every_rank(flag: torch.Tensor) -> bool:
    """``flag`` true on every rank (one host read): ranks see different losses, and must all skip
    the same steps or their parameters part ways."""
    return bool(_every_rank_on_device(flag))
