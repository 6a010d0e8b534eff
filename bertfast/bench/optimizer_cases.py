"""The kernel suite's optimizer cases (adamw, lamb; direction ``step``): one step over BertForPreTraining's
two parameter groups, bertfast's triton AdamW against torch's fused, foreach and for-loop AdamW, and
bertfast's LAMB (triton kernels, host-step and capturable, and foreach) against its reference loop
(``torch eager``). The cases' structure is kernel_cases' (OpCase, Impl, OptimizerStep).
"""
from __future__ import annotations

from typing import Any, Callable, List, Tuple

import torch

from bertfast.bench import flops as W
from bertfast.bench.common import SuiteContext, generator_for
from bertfast.bench.kernel_cases import STEP, Builder, Impl, OpCase, OptimizerStep
from bertfast.bench.results import TORCH_EAGER, TORCH_FOREACH, TORCH_FUSED, bertfast_impl

# Large enough that a step moves the weights well above their fp32 rounding (the gate compares the
# step / lr); the timed steps keep stepping, which changes nothing in the time they take.
OPTIMIZER_LR = 1e-2


def _optimizer_models(ctx: SuiteContext) -> List[Tuple[str, Any]]:
    """(name, BertConfig) whose BertForPreTraining parameters the optimizer cases update."""
    from bertfast import BertConfig
    if not ctx.device.is_cuda:  # one layer of width 16: a few dozen tensors, fast under the interpreter
        return [("micro", BertConfig.preset("tiny", vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                            num_attention_heads=2, intermediate_size=32, max_position_embeddings=16))]
    names = ("bert-base",) if ctx.quick else ("bert-base", "bert-large")
    return [(name, BertConfig.preset(name)) for name in names]


def _optimizer_case(ctx: SuiteContext, group: str, model: str, config,
                    impls: List[Tuple[str, Callable, str]]) -> OpCase:
    """One step over BERT's two parameter groups (fp32 parameters and gradients, as under autocast).

    impls: [(name, factory, skip reason or "")]; factory(param groups) builds the optimizer, and
    the one named torch eager is the reference. Every path starts from the same weights and zero
    moments; timed calls keep stepping.
    """
    from bertfast.model.task_models import BertForPreTraining
    from bertfast.training.optim import parameter_groups

    with torch.device("meta"):  # shapes and grouping only: nothing allocated
        skeleton = BertForPreTraining(config)
    names = {id(p): n for n, p in skeleton.named_parameters()}
    gen = generator_for(group, model)
    layout = [[(names[id(p)], tuple(p.shape)) for p in g["params"]] for g in parameter_groups(skeleton, 0.01)]
    weights = {n: (0.02 * torch.randn(shape, generator=gen)).to(ctx.torch_device) for g in layout for n, shape in g}
    grads = {n: (1e-3 * torch.randn(shape, generator=gen)).to(ctx.torch_device) for g in layout for n, shape in g}
    elements = sum(t.numel() for t in weights.values())

    def path(factory: Callable) -> Builder:
        def build(dtype):  # the run's dtype is the activations': parameters stay fp32 here
            params = {}
            for n, w in weights.items():
                params[n] = torch.nn.Parameter(w.clone())
                params[n].grad = grads[n]  # shared, read-only
            opt = factory([{"params": [params[n] for n, _ in g], "weight_decay": wd}
                           for g, wd in zip(layout, (0.01, 0.0))])
            return OptimizerStep([], opt.step, None, lambda out, gs: params, lr=OPTIMIZER_LR)
        return build

    reference = {name: factory for name, factory, _ in impls}[TORCH_EAGER]
    return OpCase(group, {"model": model, "tensors": len(weights), "elements": elements, "params": "fp32"},
                  path(reference),
                  [Impl(name, skip=skip) if skip else Impl(name, path(factory)) for name, factory, skip in impls],
                  lambda d: {"bytes": W.optimizer_step_bytes(elements, 4, 4)}, directions=(STEP,))


def adamw_cases(ctx: SuiteContext) -> List[OpCase]:
    from bertfast.training.optim import AdamW, adamw_implementation, fused_adamw_devices

    fused_devices = fused_adamw_devices()

    def adamw(**kind):
        return lambda groups: torch.optim.AdamW(groups, lr=OPTIMIZER_LR, eps=1e-6, weight_decay=0.01, **kind)
    fused_skip = ("" if ctx.torch_device.type in fused_devices
                  else f"torch {torch.__version__} has no fused AdamW for {ctx.torch_device.type}")
    impls = []
    if "triton" in ctx.backends:
        skip = _triton_skip(ctx, adamw_implementation)
        # bertfast's kernel, without working copies (pretrain's writes 2 bytes more per GEMM weight)
        impls.append((bertfast_impl("triton"), lambda groups: AdamW(groups, lr=OPTIMIZER_LR, eps=1e-6,
                                                                    weight_decay=0.01), skip))
    impls += [(TORCH_FUSED, adamw(fused=True), fused_skip), (TORCH_FOREACH, adamw(foreach=True), ""),
              (TORCH_EAGER, adamw(foreach=False, fused=False), "")]

    _note_optimizers(ctx)
    return [_optimizer_case(ctx, "adamw", model, config, impls) for model, config in _optimizer_models(ctx)]


def lamb_cases(ctx: SuiteContext) -> List[OpCase]:
    from bertfast.training.optim import Lamb, lamb_implementation

    def lamb(implementation, capturable=False):
        return lambda groups: Lamb(groups, lr=OPTIMIZER_LR, eps=1e-6, implementation=implementation,
                                   capturable=capturable)

    impls = []
    if "triton" in ctx.backends:
        skip = _triton_skip(ctx, lamb_implementation)
        impls.append((bertfast_impl("triton"), lamb("triton"), skip))
        # What --cuda-graphs runs: the same kernels, with the steps and scalars on the device.
        impls.append((bertfast_impl("triton", "capturable"), lamb("triton", capturable=True), skip))
    if "torch" in ctx.backends:
        impls.append((bertfast_impl("torch", "foreach"), lamb("foreach"), ""))
    impls.append((TORCH_EAGER, lamb("reference"), ""))

    _note_optimizers(ctx)
    return [_optimizer_case(ctx, "lamb", model, config, impls) for model, config in _optimizer_models(ctx)]


def _triton_skip(ctx: SuiteContext, implementation: Callable) -> str:
    """Why an optimizer's triton implementation cannot run on this device (no TRITON_INTERPRET on
    a CPU, triton missing), or "" where it can: what its ``implementation("triton", ...)`` refuses."""
    try:
        implementation("triton", [torch.empty(0, device=ctx.torch_device)])
        return ""
    except ValueError as exc:
        return str(exc)


def _note_optimizers(ctx: SuiteContext) -> None:
    ctx.note("adamw / lamb: one optimizer step over BertForPreTraining's two parameter groups, fp32 parameters "
             "and gradients whatever the activation dtype (as under autocast); GB/s counts the 28 bytes per "
             "element a one-pass update moves; lamb's torch eager is bertfast's reference loop"
             + ("" if ctx.device.is_cuda else "; on CPU a one-layer width-16 model ('micro')"))
