"""Kernel suite: every fused op, forward and backward, each bertfast backend against baselines.

For each op and case the suite builds one set of random inputs (fp32 masters, cast to the
run's dtype), runs the reference (``bertfast.reference``) in fp32 and in the run's dtype,
then for every implementation:

  1. the parity gate (``bertfast.bench.gate``): outputs and input gradients vs the fp32
     reference; a path that fails gets a FAILED PARITY row per direction and is never timed;
  2. timing of ``fwd`` (forward under no_grad), ``bwd`` (``autograd.grad`` on a retained
     graph) and ``fwd+bwd`` (forward with grad + ``autograd.grad``).

The optimizer cases (adamw, lamb) have one direction, ``step``: one optimizer step, gated on each
parameter's change (``kernel_cases.OptimizerStep``).

What is measured (the cases and the implementations compared) is in ``kernel_cases``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from bertfast.bench.clocks import ClockSampler
from bertfast.bench.common import Stopped, SuiteContext, free_memory, short_error, strict_fp32
from bertfast.bench.gate import compare
from bertfast.bench.kernel_cases import ALL_DIRECTIONS, STEP, SUITE, Impl, OpCase, Prepared, case_builders
from bertfast.bench.results import ERROR, FAILED_PARITY, TORCH_COMPILE, Row, case_text, skipped
from bertfast.bench.timing import (BACK_TO_BACK, COLD_L2, PERF_COUNTER, SMALL_KERNEL_MS, host_overhead_us, peak_memory,
                                   time_fn, time_small)

# A back-to-back re-timing whose calls took no longer than this share of their host time measured the host:
# the cold-L2 figure, queued ahead of the host, stands.
HOST_BOUND_SHARE = 0.8


# --------------------------------------------------------------------------- running
def metrics_for(ctx: SuiteContext, t, work: Dict[str, float], cold=None):
    """GB/s and % of the copy bandwidth from ``cold`` (the cold-L2 timing) where the row's time is a
    warm re-timing of a small kernel: the copy bandwidth is DRAM's, and 20 calls replayed on the same
    buffers find them in L2 (the H200 run of 2026-11-27: an embeddings forward at 131% of it)."""
    metrics = {}
    if "bytes" in work:
        metrics["gbps"] = (cold or t).rate(work["bytes"] / 1e6)  # bytes / ms -> GB/s
        bw = ctx.device.copy_bandwidth_gbps
        if bw is not None:
            metrics["pct_copy_bw"] = metrics["gbps"].scaled(100.0 / bw.median)
    if "flops" in work:
        metrics["tflops"] = t.rate(work["flops"] / 1e9)  # flops / ms -> TFLOP/s
    return metrics


def direction_callable(p: Prepared, direction: str) -> Callable[[], None]:
    """What one timed call of a direction runs (bwd: autograd.grad on a graph built once, retained)."""
    if direction == "fwd":
        def fwd() -> None:
            with torch.no_grad(), p.context():
                p.forward()
        return fwd
    if direction == "bwd":
        with p.context():
            out = p.forward()

        def bwd() -> None:
            with p.context():
                torch.autograd.grad(out, p.leaves, p.grad_out, retain_graph=True)
        return bwd
    if direction == "fwd+bwd":
        def step() -> None:
            with p.context():
                torch.autograd.grad(p.forward(), p.leaves, p.grad_out)
        return step
    if direction == STEP:  # an optimizer step: the path's forward is the whole step
        return p.forward
    raise ValueError(f"direction must be one of {ALL_DIRECTIONS + (STEP,)}, got {direction!r}")


def _time_direction(ctx: SuiteContext, p: Prepared, direction: str):
    """(time Stat, timing method, host overhead Stat or None, cold-L2 time Stat where the time is a
    re-timing else None, peak memory or None).

    Cold-L2 CUDA events per call; a figure under SMALL_KERNEL_MS is re-timed by graph replay (or
    back to back), its host overhead measured apart. A back-to-back re-timing bound by the host
    (HOST_BOUND_SHARE) is not kept: the H200 run of 2026-11-27-3 reported a LayerNorm backward whose
    calls could not be captured at 0.50 ms, its host's 0.51, where its cold-L2 time was under 0.05.
    CPU: perf_counter."""
    fn = direction_callable(p, direction)
    dev = ctx.torch_device
    t = time_fn(fn, dev, ctx.policy)
    method, host, cold = (COLD_L2 if ctx.device.is_cuda else PERF_COUNTER), None, None
    if ctx.device.is_cuda and t.median < SMALL_KERNEL_MS:
        warm, warm_method = time_small(
            fn, dev, not_captured=lambda exc: ctx.log(f"  {direction}: not captured in a CUDA graph "
                                                      f"({short_error(exc)}): timed back to back"))
        host = host_overhead_us(fn, dev)
        if warm_method != BACK_TO_BACK or host.median / 1e3 < HOST_BOUND_SHARE * warm.median:
            t, method, cold = warm, warm_method, t
    return t, method, host, cold, (peak_memory(fn, dev) if direction == "fwd+bwd" else None)


def compile_settings():
    """Compiled backward graphs must allow autograd.grad(retain_graph=True) (the bwd timing): no donated
    buffers (an AOTAutograd memory optimisation that forbids retaining the graph)."""
    try:
        import torch._functorch.config as functorch_config
    except Exception:  # noqa: BLE001
        return contextlib.nullcontext()
    if not hasattr(functorch_config, "donated_buffer"):
        return contextlib.nullcontext()
    return functorch_config.patch(donated_buffer=False)


class _References:
    """The fp32 and run-dtype references of a case, computed on first use."""

    def __init__(self, ctx: SuiteContext, oc: OpCase):
        self.ctx, self.oc, self._values = ctx, oc, None

    def get(self):
        if self._values is None:
            with strict_fp32():
                ref32 = self.oc.reference(torch.float32).run_once()
            lowp = self.ctx.dtype
            ref_lowp = self.oc.reference(lowp).run_once() if lowp != torch.float32 else None
            self._values = (ref32, ref_lowp)
        return self._values


def run_case(ctx: SuiteContext, oc: OpCase) -> List[Row]:
    """Every selected implementation: gate (on this case, or at p = 0 for a dropout case), then time."""
    refs = _References(ctx, oc.gate_case or oc)
    rows: List[Row] = []
    for impl in oc.impls:
        if not ctx.wants(impl.name):
            continue
        with compile_settings() if impl.name == TORCH_COMPILE else contextlib.nullcontext():
            rows += _run_impl(ctx, oc, impl, refs)
        free_memory()
    return rows


def _gate_key(oc: OpCase, impl: Impl) -> Tuple:
    return (oc.group, repr(sorted(oc.case.items())), impl.name)


def _gate(ctx: SuiteContext, oc: OpCase, impl: Impl,
          refs: _References) -> Tuple[str, str, Dict[str, Any], Optional[Prepared]]:
    """(status, reason, parity, the path it built) of an implementation on its case's inputs:
    "ok", "skipped" (cannot run here), "error" or FAILED PARITY. The verdict is remembered per
    case, so a dropout case reuses its p = 0 gate (the path is then None: not built again)."""
    from bertfast.dispatch import NoBackendError

    key = _gate_key(oc, impl)
    if key in ctx.gates:
        return (*ctx.gates[key], None)
    p = None
    try:
        p = impl.build(ctx.dtype)
        got = p.run_once()
    except NoBackendError as exc:
        result = ("skipped", short_error(exc), {})
    except Exception as exc:  # noqa: BLE001 - every failure becomes a visible row
        if impl.name == TORCH_COMPILE:
            ctx.note(f"torch.compile failed on this machine ({short_error(exc, 200)}); its rows are skipped")
            result = ("skipped", f"torch.compile cannot run here: {short_error(exc)}", {})
        elif impl.env_dependent:
            result = ("skipped", f"cannot run here: {short_error(exc)}", {})
        else:
            result = (ERROR, f"while checking parity: {short_error(exc)}", {})
    else:
        result = ("ok", "", {"gate": "not applicable (GEMMs only, not the op)"})
        if p.gated:
            gate = compare(got, *refs.get())
            result = ("ok" if gate.ok else FAILED_PARITY, gate.message, gate.to_dict())
            if not gate.ok:
                ctx.log(f"  {oc.group} {impl.name}: FAILED PARITY: {gate.message}")
        del got
    ctx.gates[key] = result
    return (*result, p)


def _run_impl(ctx: SuiteContext, oc: OpCase, impl: Impl, refs: _References) -> List[Row]:
    def all_rows(status: str, reason: str, parity=None) -> List[Row]:
        return [Row(SUITE, oc.group, dict(oc.case), d, impl.name, status=status, reason=reason,
                    parity=parity or {}, work=oc.work(d)) for d in oc.directions]

    if impl.skip:
        return [skipped(SUITE, oc.group, dict(oc.case), d, impl.name, impl.skip) for d in oc.directions]
    gate_case = oc.gate_case or oc
    sibling = next((i for i in gate_case.impls if i.name == impl.name), None)
    if sibling is None or sibling.skip:
        return all_rows("skipped", f"no gate: {impl.name} does not run at p = 0 on these inputs")
    status, reason, parity, gated = _gate(ctx, gate_case, sibling, refs)
    if oc.gate_case is not None:
        parity = {"gate": "p=0 on the same inputs (dropout masks are implementation-specific)", **parity}
        reason = reason and f"at p = 0: {reason}"
    if status != "ok":
        return all_rows(status, reason, parity)
    try:
        if oc.gate_case is None and gated is not None:
            p = gated  # the path the gate just checked
        else:
            p = impl.build(ctx.dtype)
        if oc.gate_case is not None:  # this path has not run with dropout yet
            p.run_once()
    except Exception as exc:  # noqa: BLE001
        if impl.env_dependent or impl.name == TORCH_COMPILE:
            return all_rows("skipped", f"cannot run here with these settings: {short_error(exc)}", parity)
        return all_rows(ERROR, f"while building: {short_error(exc)}", parity)
    rows: List[Row] = []
    for direction in oc.directions:
        work = oc.work(direction)
        try:
            with ClockSampler(ctx.torch_device) as sampler:
                t, method, host, cold, mem = _time_direction(ctx, p, direction)
        except Exception as exc:  # noqa: BLE001
            rows.append(Row(SUITE, oc.group, dict(oc.case), direction, impl.name, status=ERROR,
                            reason=f"while timing: {short_error(exc)}", parity=parity, work=work))
            continue
        metrics = metrics_for(ctx, t, work, cold)
        if host is not None:
            metrics["host_us"] = host
        if cold is not None:
            metrics["cold_l2_ms"] = cold
        rows.append(Row(SUITE, oc.group, dict(oc.case), direction, impl.name, time_ms=t, metrics=metrics,
                        memory=mem, parity=parity, work=work, timing=method, clocks=sampler.summary()))
        ctx.log(f"  {oc.group} {direction:8s} {impl.name:28s} {t.median:9.4f} ms")
    return rows


def _skipped_case(ctx: SuiteContext, oc: OpCase, reason: str) -> List[Row]:
    return [skipped(SUITE, oc.group, dict(oc.case), d, impl.name, reason)
            for impl in oc.impls if ctx.wants(impl.name) for d in oc.directions]


def run(ctx: SuiteContext) -> List[Row]:
    if not ctx.device.is_cuda:
        ctx.note("kernel suite on CPU: tiny shapes, fp32; bertfast:triton runs only under TRITON_INTERPRET=1 "
                 "(the Triton interpreter), bertfast:cuda needs a GPU")
    ctx.note("kernel suite: params=act puts the parameters in the activation dtype, params=fp32 keeps them in "
             "fp32 (autocast); a dropout case is timed only for implementations that passed the gate on the same "
             "inputs at p = 0; fwd = forward under no_grad, bwd = autograd.grad on a retained graph, fwd+bwd = both")
    ctx.note("mlm_head_loss_decoder / mlm_head_loss: bertfast computes the gradients inside the forward pass, so they "
             "have fwd (no grad) and fwd+bwd rows only; TFLOP/s counts the labelled rows' GEMMs for every "
             "implementation (the full-sequence head does more work for the same result)")
    rows: List[Row] = []
    for op, builder in case_builders().items():
        if ctx.ops is not None and op not in ctx.ops:
            continue
        ctx.log(f"[kernels] {op}")
        cases = [oc for oc in builder(ctx) if ctx.wants_case(oc.case)]
        for i, oc in enumerate(cases):
            if ctx.budget_spent():
                ctx.log(f"  time budget spent: {len(cases) - i} {op} case(s) not run")
                rows += ctx.record([r for rest in cases[i:] for r in _skipped_case(ctx, rest, ctx.budget_reason())])
                break
            ctx.log(f"  case {case_text(oc.case)}")
            try:
                case_rows = run_case(ctx, oc)
            except Stopped as stop:  # this case and the op's others not run: skipped rows, then stop
                ctx.record(_skipped_case(ctx, oc, stop.reason(running=True))
                           + [r for rest in cases[i + 1:] for r in _skipped_case(ctx, rest, stop.reason())])
                raise
            rows += ctx.record(case_rows)
            free_memory()
    return rows
