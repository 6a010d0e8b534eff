"""The training step replayed from a CUDA graph (``bertfast pretrain --cuda-graphs``).

A BERT step launches thousands of small kernels; at small batches the CPU's launch time, not
the GPU, sets the pace. Captured once in a CUDA graph, the whole step (forward and backward of
every micro-batch, clipping, the optimizer) is one launch. What that needs, and where it comes from:

* fixed shapes: packed batches (``--static-shapes``: one row of a fixed token budget, a fixed
  number of masked positions);
* no host read inside the step: value checks on the device (``contract.checks_on_device``),
  the data checked by the loader on the host;
* fixed buffers: each batch is copied into the tensors the graph reads. The gradients are the
  backward's own tensors, allocated from the graph's memory pool at the capture and so fixed from
  then on (no zero-fill, no add: 2.1 ms of a BERT-large step on an H100 went to those), except
  under LAMB, whose triton step reads them through an address table uploaded before the capture:
  there they get buffers of their own first, which the graph zeroes and the backward adds into;
* an optimizer whose every input is on the device: a fused AdamW, torch's (its step counts are
  device tensors) or bertfast's triton one (its update a second graph: see ``_capture``), or a
  capturable LAMB (``Lamb(capturable=True)``, the triton implementation: its step counts and bias
  corrections too), with the learning rate in a device tensor the scheduler fills between replays;
* dropout seeds drawn from torch's CUDA generator, which is graph-safe (each replay draws anew);
* ``--on-nonfinite skip`` on the device: the step's "not finite" flag is the optimizer's found_inf
  (``TrainStep.step_unless_nonfinite``), so a skipped replay changes nothing but the schedule;
* eager steps first (``warmup_steps``, on a side stream, for each new batch shape): Triton
  autotuning, cuBLAS workspaces and the optimizer's lazy state happen there, never inside a
  capture. They are steps of the run, not extra ones.

Not served, refused up front by ``check_supported``: several processes (DDP, FSDP), LAMB other
than the triton one (the others count their steps on the host), fp16 (GradScaler reads its inf
flag on the host), ``--compile`` (torch.compile's "reduce-overhead" mode is its own graph capture)
and the reference execution (it unpacks batches with host reads).
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from bertfast.training import optim
from bertfast.training.step import Batch, StepResult, TrainStep, takes_found_inf

Tensor = torch.Tensor


def check_supported(device: torch.device, world_size: int, optimizer: str, precision: str, compile: bool,
                    execution: str) -> None:
    """ValueError naming every setting a CUDA-graph run cannot have."""
    problems = []
    if device.type != "cuda":
        problems.append(f"a CUDA device (got {device})")
    if world_size != 1:
        problems.append(f"one process (got {world_size}; DDP and FSDP are not captured yet)")
    if optimizer == "lamb":
        forced = os.environ.get(optim.LAMB_ENV)
        available, why = optim.triton_lamb_availability()
        if forced and forced != "triton":
            problems.append(f"the triton LAMB (got {optim.LAMB_ENV}={forced}: only the triton one keeps its step "
                            f"counts on the device)")
        elif not available:
            problems.append(f"the triton LAMB (unavailable: {why})")
    if precision == "fp16":
        problems.append("--precision bf16 or fp32 (fp16's loss scaler reads its inf flag on the host)")
    if compile:
        problems.append("no --compile (use one: torch.compile's reduce-overhead mode captures graphs itself)")
    if execution != "fast":
        problems.append(f"--execution fast (got {execution})")
    if problems:
        raise ValueError("--cuda-graphs needs " + "; ".join(problems))


def host_lrs(optimizer_state: Dict[str, Any]) -> Dict[str, Any]:
    """An optimizer state dict with its learning rates as floats (a graph run keeps them in
    device tensors; a checkpoint should not depend on that)."""
    groups = [{**g, "lr": float(g["lr"])} if isinstance(g.get("lr"), Tensor) else g
              for g in optimizer_state["param_groups"]]
    return {**optimizer_state, "param_groups": groups}


def _signature(micro_batches: Sequence[Batch]) -> Tuple:
    """What a captured graph is specific to: the number of micro-batches, and each value's shape
    and dtype (tensors) or value (anything else, e.g. max_length_q)."""
    return tuple(tuple(sorted((k, (tuple(v.shape), v.dtype, v.device) if isinstance(v, Tensor) else v)
                              for k, v in mb.items())) for mb in micro_batches)


class GraphedTrainStep(TrainStep):
    """TrainStep (one CUDA process, fused AdamW or capturable LAMB, bf16 or fp32) whose steps
    replay a CUDA graph: ``warmup_steps`` (at least 1) eager steps for each new batch signature,
    then one captured step replayed for every later step with that signature."""

    WARMUP_STEPS = 3

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, device: torch.device, precision: str,
                 max_grad_norm: Optional[float] = None, warmup_steps: int = WARMUP_STEPS,
                 skip_nonfinite: bool = False):
        super().__init__(model, optimizer, scheduler, device, precision, max_grad_norm,
                         skip_nonfinite=skip_nonfinite, device_checks=True)
        if device.type != "cuda":
            raise ValueError(f"GraphedTrainStep: expected a CUDA device, got {device}")
        if not takes_found_inf(optimizer):
            raise ValueError(f"GraphedTrainStep: expected torch's fused AdamW or Lamb(capturable=True) (every input "
                             f"on the device), got {type(optimizer).__name__}")
        if self.scaler is not None:
            raise ValueError("GraphedTrainStep: fp16 loss scaling reads its inf flag on the host; use bf16 or fp32")
        if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            raise ValueError(f"GraphedTrainStep: expected a LambdaLR schedule, got {type(scheduler).__name__}")
        if int(warmup_steps) < 1:
            raise ValueError(f"GraphedTrainStep: expected warmup_steps >= 1 (autotuning, lazy state and the "
                             f"parameters that get a gradient are found in eager steps), got {warmup_steps}")
        self.autocast_cache = False
        self.warmup_steps = int(warmup_steps)
        self.grad_params: List[Tensor] = []  # those the last eager step gave a gradient (LAMB: the graph's buffers)
        self.signature: Optional[Tuple] = None   # of the batches the graph below was captured for
        self.eager_steps = 0                      # with that signature, before the capture
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.optimizer_graph: Optional[torch.cuda.CUDAGraph] = None  # bertfast's AdamW: its step (see _capture)
        self._held: Tuple = ()
        self.static_batches: List[Batch] = []    # what the graph reads
        self.captured: Optional[Tuple[list, Tensor, Tensor, Tensor, Optional[Tensor]]] = None  # what it writes
        self.replays = 0
        self._side: Optional[torch.cuda.Stream] = None  # where eager warm-up steps run (torch's advice)

    def __call__(self, micro_batches: Sequence[Batch], forward: Callable[[Batch], Any]) -> StepResult:
        signature = _signature(micro_batches)
        if signature != self.signature:  # a new phase: new shapes, new warm-up, new graph
            self._release()
            self.signature = signature
        if self.graph is None and self.eager_steps < self.warmup_steps:
            self.eager_steps += 1
            return self._eager(micro_batches, forward)
        lr = self.scheduled_lr()
        if self.graph is None:
            self._capture(micro_batches, forward)
        else:
            for static, mb in zip(self.static_batches, micro_batches):
                for k, v in mb.items():
                    if isinstance(v, Tensor):
                        static[k].copy_(v, non_blocking=True)
        self.graph.replay()
        if self.optimizer_graph is not None:
            self.optimizer_graph.replay()
        self.replays += 1
        outputs, step_loss, grad_norm, finite, skipped = self.captured
        self._advance_schedule()
        # The graph overwrites its outputs at the next replay: the step's own values are copies.
        return StepResult(outputs, step_loss.clone(), grad_norm.clone(), lr, finite.clone(),
                          False if skipped is None else skipped.clone())

    def scheduled_lr(self) -> float:
        """The learning rate of the coming step, on the host (the optimizer's is a device tensor)."""
        s = self.scheduler
        return s.base_lrs[0] * s.lr_lambdas[0](s.last_epoch)

    def _eager(self, micro_batches: Sequence[Batch], forward: Callable[[Batch], Any]) -> StepResult:
        lr = self.scheduled_lr()
        current = torch.cuda.current_stream(self.device)
        if self._side is None:  # one side stream for every warm-up step: its memory pool is reused
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        side.wait_stream(current)
        with torch.cuda.stream(side):
            result = super().__call__(micro_batches, forward)
        current.wait_stream(side)
        result.lr = lr  # a float, whether the optimizer's rate is one yet or a device tensor
        return result

    def gradients(self, micro_batches: Sequence[Batch], forward: Callable[[Batch], Any]):
        result = super().gradients(micro_batches, forward)
        if self.graph is None:  # an eager step (or the capture, which finds the same ones)
            self.grad_params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        return result

    def _capture(self, micro_batches: Sequence[Batch], forward: Callable[[Batch], Any]) -> None:
        self.static_batches = [{k: v.clone() if isinstance(v, Tensor) else v for k, v in mb.items()}
                               for mb in micro_batches]
        for group in self.optimizer.param_groups:
            if not isinstance(group["lr"], Tensor):  # filled by the scheduler from now on
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=self.device)
        # No gradient before the capture, so the captured backward hands each parameter its own
        # gradient tensor (from the graph's pool), as an eager step's does; an unused parameter keeps
        # none. bertfast's AdamW reads the gradients through an address table, uploaded on the host:
        # its step is a second graph in the same pool, captured once the first has allocated the
        # gradients and the table holds their addresses. LAMB: fixed buffers for the parameters the
        # eager steps gave a gradient (no others: an unused parameter must not take a zero-gradient
        # step), zeroed by the graph and accumulated into by its backward, with its address tables
        # built from them here.
        self.optimizer.zero_grad(set_to_none=True)
        grads = []
        if isinstance(self.optimizer, optim.Lamb):
            grads = [torch.zeros_like(p) for p in self.grad_params]
            for p, g in zip(self.grad_params, grads):
                p.grad = g
            self.optimizer.prepare_tables()
        split = isinstance(self.optimizer, optim.AdamW)
        graph = torch.cuda.CUDAGraph()
        adamw = isinstance(self.optimizer, torch.optim.AdamW)
        capturable = [g["capturable"] for g in self.optimizer.param_groups] if adamw else []
        try:
            for g in self.optimizer.param_groups if adamw else ():
                g["capturable"] = True  # fused AdamW's step is capturable; torch asks for the flag
            # thread_local: the prefetch thread may pin host memory meanwhile (a CUDA call that
            # would end a capture in the default, global mode).
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                if grads:
                    torch._foreach_zero_(grads)
                outputs, step_loss, grad_norm, finite = self.gradients(self.static_batches, forward)
                skipped = self.skipped_on_device(finite) if self.skip_nonfinite else None
                found_inf = skipped.to(torch.float32) if skipped is not None else None
                if not split:
                    self.optimizer_step(found_inf=found_inf)
            if split:
                self.optimizer.prepare_tables()
                self.optimizer_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.optimizer_graph, pool=graph.pool(), capture_error_mode="thread_local"):
                    self.optimizer_step(found_inf=found_inf)
            # what the graphs read and write, kept alive (and at their addresses) while they are replayed
            self.captured = (outputs, step_loss, grad_norm, finite, skipped)
            self._held = (found_inf, self.grad_scale)
        finally:
            for g, flag in zip(self.optimizer.param_groups, capturable):
                g["capturable"] = flag
        self.graph = graph

    def _release(self) -> None:
        """Drop the graph and what it holds; the gradients it wrote are not an eager step's to add to."""
        self.graph, self.optimizer_graph, self.captured, self.static_batches = None, None, None, []
        self._held = ()
        self.eager_steps = 0
        self.optimizer.zero_grad(set_to_none=True)

    def _advance_schedule(self) -> None:
        with warnings.catch_warnings():
            # The optimizer's step ran inside the graph, out of the scheduler's sight.
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)`", UserWarning)
            self.scheduler.step()
