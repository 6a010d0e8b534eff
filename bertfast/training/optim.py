"""Optimizers and the learning-rate schedule.

Parameter groups leave biases and LayerNorm parameters without weight decay (the paper's
recipe). The schedule is a linear warm-up, then linear decay to zero.

AdamW has three implementations of torch's AdamW step, with torch's state layout (per
parameter: "step", an fp32 device scalar as fused AdamW keeps it; "exp_avg" and "exp_avg_sq"):
  triton   ``AdamW``, bertfast.kernels.adamw: one launch per parameter group, every scalar on the
           device (capturable, found_inf and grad_scale as torch's fused AdamW takes them), the
           gradient read divided by grad_scale but not written back, and the bf16 working copy of
           each GEMM weight written with the weight (``working=``, bertfast.model.working_weights), so the
           forward casts nothing. fp32 CUDA parameters (or CPU ones under the interpreter, forced).
  fused    torch's fused kernel, where the installed torch has one (CUDA, CPU since torch 2.4).
  foreach  torch's multi-tensor form.
Default: triton where it can run, else fused where torch has it, else foreach; ``implementation=``
(or BERTFAST_ADAMW=triton|fused|foreach) forces one, and ``fused=True``/``False`` means fused/foreach.
When triton cannot be imported for CUDA parameters, AdamW runs torch's fused kernel, logs a warning
and records the reason for `bertfast info`.

LAMB (You et al., 2019, "Large batch optimization for deep learning"), for large batches, per
parameter w with gradient g at step t:
    m = b1*m + (1-b1)*g ;  v = b2*v + (1-b2)*g^2
    u = (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps) + wd * w
    r = ||w|| / ||u||   (1 when either norm is 0; the layer-wise trust ratio, clamped to max_trust_ratio)
    w = w - lr * r * u
``Lamb`` has three implementations of that step, with one state layout (per parameter: "step",
a Python int; "exp_avg" and "exp_avg_sq", fp32 whatever the parameter's dtype), so a checkpoint
written by one resumes under another (a capturable LAMB's state dict has its steps as ints too):
  reference  a loop over the parameters, about 8 kernels each: the oracle the others are tested
             against.
  foreach    torch's multi-tensor ``_foreach_*`` ops over all the parameters of a device and
             dtype, with ``_foreach_norm`` for the per-tensor norms; any device, FSDP's DTensors
             included.
  triton     bertfast.kernels.lamb: three launches per parameter group, whatever its number of
             tensors; CUDA (or the Triton interpreter on CPU, when forced).
Default: triton for CUDA parameters, foreach otherwise. ``implementation=`` (or the environment
variable BERTFAST_LAMB=reference|foreach|triton) forces one; a forced implementation runs or
raises. When triton cannot be imported for CUDA parameters, LAMB runs foreach, logs a warning
and records the reason for `bertfast info` (``dispatch.FALLBACKS``): never a silent fallback.
No implementation reads a value back from the device during a step.

``capturable=True`` (triton only; what ``bertfast pretrain`` builds for it): every input of a
step is on the device, so the step can be captured in a CUDA graph and replayed, as torch's fused
AdamW. The steps are fp64 device scalars, the bias corrections are computed from them on the
device, the learning rate may be a device tensor, and a ``found_inf`` attribute set for one step
(an fp32 device scalar, what ``TrainStep`` hands fused AdamW under ``--on-nonfinite skip``) makes
a non-zero value skip that step: parameters, moments and steps stay as they were.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from bertfast import dispatch
from bertfast.model import working_weights

log = logging.getLogger("bertfast.optim")

NO_DECAY_PATTERNS = ("bias", "LayerNorm.weight", "LayerNorm.bias", "layer_norm", "layernorm")
LAMB_IMPLEMENTATIONS = ("reference", "foreach", "triton")
LAMB_ENV = "BERTFAST_LAMB"
ADAMW_IMPLEMENTATIONS = ("triton", "fused", "foreach")
ADAMW_ENV = "BERTFAST_ADAMW"
# The foreach LAMB holds two fp32 temporaries per element it updates at once; it updates at most
# this many elements at a time (256 MiB of temporaries), so BERT-large does not need 2.7 GB more.
FOREACH_BATCH_ELEMENTS = 1 << 25


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
    """Two groups: decayed weights, and biases + LayerNorm parameters with weight_decay 0."""
    decay, no_decay = [], []
    seen = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.ndim < 2 or any(pat in name for pat in NO_DECAY_PATTERNS):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


# --------------------------------------------------------------------------- choosing LAMB's implementation
# A dispatch Backend for its cached, visible import check; not registered (LAMB is no op: it has
# no torch or cuda backend for dispatch to choose between).
_TRITON_LAMB = dispatch.Backend("lamb", "triton", "bertfast.kernels.lamb", lambda forced, **inputs: [],
                                availability_fn=dispatch.triton_availability)


def triton_lamb_availability() -> Tuple[bool, str]:
    """(True, "") when triton and bertfast.kernels.lamb import, else (False, why); cached."""
    return _TRITON_LAMB.availability()


_TRITON_ADAMW = dispatch.Backend("adamw", "triton", "bertfast.kernels.adamw", lambda forced, **inputs: [],
                                 availability_fn=dispatch.triton_availability)


def triton_adamw_availability() -> Tuple[bool, str]:
    """(True, "") when triton and bertfast.kernels.adamw import, else (False, why); cached."""
    return _TRITON_ADAMW.availability()


def _triton_reasons(params: Sequence[torch.Tensor], forced: bool, optimizer: str = "lamb") -> List[str]:
    """Why the triton LAMB (or AdamW) cannot run these parameters (none: it can)."""
    ok, why = triton_lamb_availability() if optimizer == "lamb" else triton_adamw_availability()
    if not ok:
        return [why]
    reasons = []
    devices = sorted({p.device.type for p in params})
    if devices == ["cpu"] and forced:
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            reasons.append("CPU parameters need TRITON_INTERPRET=1 (the Triton interpreter)")
    elif devices != ["cuda"]:
        reasons.append(f"needs CUDA parameters (CPU ones only when forced, under TRITON_INTERPRET=1), got {devices}")
    if any(hasattr(p, "full_tensor") for p in params):
        reasons.append("the parameters are DTensors (FSDP): the trust ratio needs each tensor's full norm, "
                       "which the foreach implementation reduces across ranks" if optimizer == "lamb" else
                       "the parameters are DTensors (FSDP)")
    allowed = {"torch.float32", "torch.float16", "torch.bfloat16"} if optimizer == "lamb" else {"torch.float32"}
    dtypes = sorted({str(p.dtype) for p in params} - allowed)
    if dtypes:
        reasons.append(f"needs {'fp32, fp16 or bf16' if optimizer == 'lamb' else 'fp32'} parameters, got {dtypes}")
    return reasons


def lamb_implementation(requested: Optional[str], params: Sequence[torch.Tensor]) -> str:
    """The LAMB implementation for these parameters: ``requested``, else $BERTFAST_LAMB, else
    triton where it can run them and foreach otherwise (see the module docstring)."""
    forced = requested if requested is not None else (os.environ.get(LAMB_ENV) or None)
    if forced is not None:
        if forced not in LAMB_IMPLEMENTATIONS:
            source = "implementation" if requested is not None else LAMB_ENV
            raise ValueError(f"{source} must be one of {list(LAMB_IMPLEMENTATIONS)}, got {forced!r}")
        reasons = _triton_reasons(params, forced=True) if forced == "triton" else []
        if reasons:
            raise ValueError(f"bertfast: the triton LAMB was forced but cannot run these parameters: "
                             f"{'; '.join(reasons)}")
        return forced
    if not _triton_reasons(params, forced=False):
        return "triton"
    ok, why = triton_lamb_availability()
    if not ok and any(p.device.type == "cuda" for p in params) and ("lamb", "triton") not in dispatch.FALLBACKS:
        dispatch.FALLBACKS[("lamb", "triton")] = why
        log.warning("bertfast: LAMB falls back from triton to foreach: %s", why)
    return "foreach"


def lamb_summary() -> str:
    """One line for `bertfast info`: which LAMB implementation runs where."""
    ok, why = triton_lamb_availability()
    text = ("LAMB optimizer: triton kernels for CUDA parameters, foreach otherwise" if ok
            else f"LAMB optimizer: foreach everywhere (triton LAMB unavailable: {why})")
    forced = os.environ.get(LAMB_ENV)
    return text + (f"; {LAMB_ENV}={forced} forces that one" if forced else "")


def adamw_implementation(requested: Optional[str], params: Sequence[torch.Tensor]) -> str:
    """The AdamW implementation for these parameters: ``requested``, else $BERTFAST_ADAMW, else
    triton where it can run them, fused where torch has a fused kernel for them, foreach otherwise."""
    forced = requested if requested is not None else (os.environ.get(ADAMW_ENV) or None)
    if forced is not None:
        if forced not in ADAMW_IMPLEMENTATIONS:
            source = "implementation" if requested is not None else ADAMW_ENV
            raise ValueError(f"{source} must be one of {list(ADAMW_IMPLEMENTATIONS)}, got {forced!r}")
        reasons = (_triton_reasons(params, forced=True, optimizer="adamw") if forced == "triton" else
                   [] if forced == "foreach" or _fused_adamw_supported(params) else
                   [f"torch {torch.__version__} has no fused AdamW for {sorted({p.device.type for p in params})}"])
        if reasons:
            raise ValueError(f"bertfast: the {forced} AdamW was forced but cannot run these parameters: "
                             f"{'; '.join(reasons)}")
        return forced
    if params and not _triton_reasons(params, forced=False, optimizer="adamw"):
        return "triton"
    ok, why = triton_adamw_availability()
    if not ok and any(p.device.type == "cuda" for p in params) and ("adamw", "triton") not in dispatch.FALLBACKS:
        dispatch.FALLBACKS[("adamw", "triton")] = why
        log.warning("bertfast: AdamW falls back from triton to torch's: %s", why)
    return "fused" if _fused_adamw_supported(params) else "foreach"


def adamw_summary() -> str:
    """One line for `bertfast info`: which AdamW implementation runs where."""
    ok, why = triton_adamw_availability()
    text = ("AdamW optimizer: triton kernel for fp32 CUDA parameters (writing bf16 working copies of the "
            "encoder's weights in pretrain), torch's fused or foreach otherwise" if ok else
            f"AdamW optimizer: torch's fused or foreach everywhere (triton AdamW unavailable: {why})")
    forced = os.environ.get(ADAMW_ENV)
    return text + (f"; {ADAMW_ENV}={forced} forces that one" if forced else "")


# --------------------------------------------------------------------------- AdamW
class AdamW(torch.optim.AdamW):
    """torch's AdamW (hyper-parameters, parameter groups, fused state layout) stepped by bertfast's
    triton kernel (see the module docstring); capturable, and it takes ``found_inf`` and
    ``grad_scale`` attributes set for one step, as torch's fused AdamW does.

    working: bertfast.model.working_weights.WorkingWeights whose copies the kernel writes with the weights.
    """

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, working=None):
        # capturable: torch's load_state_dict then puts each step on its parameter's device as fp32.
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False,
                         fused=False, capturable=True)
        params = [p for g in self.param_groups for p in g["params"]]
        reasons = _triton_reasons(params, forced=True, optimizer="adamw")
        if reasons:
            raise ValueError(f"bertfast AdamW (triton) cannot run these parameters: {'; '.join(reasons)}")
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"]:
                raise ValueError("bertfast AdamW (triton): amsgrad and maximize are torch's AdamW's only")
        self.implementation = "triton"
        self.working = working
        self._tables: Dict[Tuple, Any] = {}

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)   # set for one step by TrainStep
        grad_scale = getattr(self, "grad_scale", None)
        used = set()
        for index, group in enumerate(self.param_groups):
            for key, lists in self._gather(group).items():
                used.add((index, key))
                self._triton_step((index, key), *lists, group, found_inf, grad_scale)
        for stale in set(self._tables) - used:
            del self._tables[stale]
        return loss

    @torch.no_grad()
    def prepare_tables(self) -> None:
        """Build the device tables for the parameters' current gradients, advancing nothing: a CUDA
        graph capturing the next step then finds them built. The gradients must keep their buffers."""
        for index, group in enumerate(self.param_groups):
            for key, (params, grads, exp_avgs, exp_avg_sqs, copies, _) in self._gather(group).items():
                self._tables_for((index, key)).update(params, grads, exp_avgs, exp_avg_sqs, copies)

    def _tables_for(self, key: Tuple):
        from bertfast.kernels import adamw as kernels

        tables = self._tables.get(key)
        if tables is None:
            tables = self._tables[key] = kernels.AdamWTables()
        return tables

    def _gather(self, group: Dict[str, Any]) -> Dict[Tuple, Tuple[List, ...]]:
        """The parameters with a gradient and their state (created), in sets of one device and
        gradient dtype, each keyed by those and by its members."""
        sets: Dict[Tuple, Tuple[List, ...]] = {}
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError("AdamW does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            lists = sets.setdefault((p.device, g.dtype), ([], [], [], [], [], []))
            for target, value in zip(lists, (p, g, state["exp_avg"], state["exp_avg_sq"],
                                             self.working.copy_of(p) if self.working is not None else None,
                                             state["step"])):
                target.append(value)
        return {kind + (tuple(map(id, lists[0])),): lists for kind, lists in sets.items()}

    def _triton_step(self, key: Tuple, params: List[torch.Tensor], grads: List[torch.Tensor],
                     exp_avgs: List[torch.Tensor], exp_avg_sqs: List[torch.Tensor],
                     copies: List[Optional[torch.Tensor]], steps: List[torch.Tensor], group: Dict[str, Any],
                     found_inf: Optional[torch.Tensor], grad_scale: Optional[torch.Tensor]) -> None:
        from bertfast.kernels import adamw as kernels

        tables = self._tables_for(key)
        tables.update(params, grads, exp_avgs, exp_avg_sqs, copies)
        b1, b2 = group["betas"]
        # A skipped step (found_inf 1) advances by 0, as torch's fused AdamW counts.
        torch._foreach_add_(steps, 1.0)
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf] * len(steps))
        if not tables.count:
            return
        # In fp64 as torch's kernel takes 1 - b^t, then rounded to fp32 as the kernel reads it.
        t = torch.stack([steps[i] for i in tables.kept]).double()
        bias = torch.stack((1 - torch.pow(b1, t), torch.sqrt(1 - torch.pow(b2, t))), dim=1).float()
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            lr = lr.to(torch.float32)
        kernels.adamw_step(tables, lr=lr, beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"],
                           bias=bias, found_inf=found_inf, grad_scale=grad_scale)
        working_weights.written(params, copies)  # raw-pointer writes: what they leave fresh or stale

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("implementation", "triton")
        self.__dict__.setdefault("working", None)
        self._tables = {}

    def state_dict(self) -> Dict[str, Any]:
        """torch's, its groups marked not capturable: torch's AdamW loads the saved flags with the
        hyper-parameters, and a capturable one refuses CPU parameters."""
        state_dict = super().state_dict()
        state_dict["param_groups"] = [{**g, "capturable": False} for g in state_dict["param_groups"]]
        return state_dict

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torch's (any AdamW's state dict), then this one's flags, and each step an fp32 scalar on
        its parameter's device, as the kernel's bias corrections read it."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group.update(capturable=True, fused=False, foreach=False)
            for p in group["params"]:
                state = self.state.get(p)
                if state and "step" in state:
                    state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).to(p.device)
        self._tables.clear()


# --------------------------------------------------------------------------- LAMB
class Lamb(torch.optim.Optimizer):
    """LAMB: Adam moments with a per-parameter trust ratio ||w|| / ||update|| (see module docstring).

    implementation: "reference", "foreach" or "triton"; None: $BERTFAST_LAMB, else the default.
    The choice is made here, for the parameters' devices; ``self.implementation`` names it.
    capturable: the step's counts and scalars live on the device (triton only; see the module's note).
    """

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, bias_correction: bool = True,
                 max_trust_ratio: Optional[float] = 10.0, implementation: Optional[str] = None,
                 capturable: bool = False):
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid LAMB hyper-parameters lr={lr} betas={betas} eps={eps} wd={weight_decay}")
        if max_trust_ratio is not None and not max_trust_ratio > 0:
            raise ValueError(f"max_trust_ratio must be > 0 or None, got {max_trust_ratio}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_trust_ratio=max_trust_ratio)
        super().__init__(params, defaults)
        # Not a hyper-parameter: kept out of param_groups, so the state_dict layout is every implementation's.
        self.implementation = lamb_implementation(implementation, [p for g in self.param_groups for p in g["params"]])
        if capturable and self.implementation != "triton":
            raise ValueError(f"a capturable LAMB (step counts on the device, for CUDA graphs) needs the triton "
                             f"implementation, got {self.implementation!r}")
        self.capturable = bool(capturable)  # an attribute, like the implementation, not a param_groups entry
        self._tables: Dict[Tuple, Any] = {}  # triton: the device tables of each set of tensors, kept between steps

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)  # set for one step by TrainStep.step_unless_nonfinite
        if found_inf is not None and not self.capturable:
            raise ValueError("LAMB: found_inf (a step skipped on the device) needs capturable=True: the other "
                             "forms count their steps on the host")
        used = set()
        for index, group in enumerate(self.param_groups):
            if self.implementation == "reference":
                self._reference_step(group)
                continue
            for key, (params, grads, exp_avgs, exp_avg_sqs, steps) in self._gather(group).items():
                if self.implementation == "foreach":
                    _foreach_lamb(params, grads, exp_avgs, exp_avg_sqs, steps, group)
                else:
                    used.add((index, key))
                    self._triton_step((index, key), params, grads, exp_avgs, exp_avg_sqs, steps, group, found_inf)
        for stale in set(self._tables) - used:  # tensors that left a set (no gradient this step) or moved
            del self._tables[stale]
        return loss

    @torch.no_grad()
    def prepare_tables(self) -> None:
        """Build the triton step's device tables for the parameters' current gradients, advancing
        nothing: a CUDA graph capturing the next step then finds them built (an upload cannot be
        captured). The gradients must keep their buffers until that step."""
        if self.implementation != "triton":
            return
        from bertfast.kernels import lamb as kernels

        for index, group in enumerate(self.param_groups):
            for key, (params, grads, exp_avgs, exp_avg_sqs, _) in self._gather(group, advance=False).items():
                self._tables.setdefault((index, key), kernels.LambTables()).update(params, grads, exp_avgs,
                                                                                   exp_avg_sqs)

    def _state(self, p: torch.Tensor) -> Dict[str, Any]:
        """p's state, created at its first step: fp32 moments whatever p's dtype; the step a host
        int, or an fp64 device scalar when capturable."""
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float64, device=p.device) if self.capturable else 0
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        return state

    def _reference_step(self, group: Dict[str, Any]) -> None:
        """The oracle: one parameter at a time, in plain tensor ops."""
        b1, b2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("LAMB does not support sparse gradients")
            g = p.grad.float()
            state = self._state(p)
            state["step"] += 1
            m, v = state["exp_avg"], state["exp_avg_sq"]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            if group["bias_correction"]:
                m_hat = m / (1 - b1 ** state["step"])
                v_hat = v / (1 - b2 ** state["step"])
            else:
                m_hat, v_hat = m, v
            w = p.float()
            update = m_hat / (v_hat.sqrt() + group["eps"])
            if group["weight_decay"]:
                update.add_(w, alpha=group["weight_decay"])
            w_norm = torch.linalg.vector_norm(w)
            u_norm = torch.linalg.vector_norm(update)
            trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
            if group["max_trust_ratio"] is not None:
                trust = trust.clamp(max=group["max_trust_ratio"])
            p.add_((update * (-group["lr"] * trust)).to(p.dtype))

    def _gather(self, group: Dict[str, Any], advance: bool = True) -> Dict[Tuple, Tuple[List, List, List, List, List]]:
        """The parameters with a gradient, their state (created; a host step advanced when
        ``advance``), in sets of one device, parameter dtype and gradient dtype; for the host-step
        triton, also of one step (one bias correction per launch). Each set is keyed by those and
        by its members."""
        sets: Dict[Tuple, Tuple[List, List, List, List, List]] = {}
        by_step = self.implementation == "triton" and not self.capturable
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError("LAMB does not support sparse gradients")
            state = self._state(p)
            if advance and not self.capturable:  # a capturable step advances its device counts itself
                state["step"] += 1
            step = state["step"]
            kind = (p.device, p.dtype, g.dtype, step if by_step else None)
            lists = sets.get(kind)
            if lists is None:
                lists = sets[kind] = ([], [], [], [], [])
            params, grads, exp_avgs, exp_avg_sqs, steps = lists
            params.append(p)
            grads.append(g)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(step)
        return {kind[:3] + (tuple(map(id, lists[0])),): lists for kind, lists in sets.items()}

    def _triton_step(self, key: Tuple, params: List[torch.Tensor], grads: List[torch.Tensor],
                     exp_avgs: List[torch.Tensor], exp_avg_sqs: List[torch.Tensor], steps: List,
                     group: Dict[str, Any], found_inf: Optional[torch.Tensor] = None) -> None:
        """One set's step: its steps are all one host int, or (capturable) device scalars advanced
        here, whose bias corrections go to the kernels in a device table."""
        from bertfast.kernels import lamb as kernels

        tables = self._tables.get(key)
        if tables is None:
            tables = self._tables[key] = kernels.LambTables()
        tables.update(params, grads, exp_avgs, exp_avg_sqs)
        b1, b2 = group["betas"]
        correct = group["bias_correction"]
        lr, bias, c1, c2 = group["lr"], None, 1.0, 1.0
        if self.capturable:
            # A skipped step (found_inf 1) advances by 0: multi-tensor ops, a few launches per set. As
            # torch's capturable fused Adam does (add 1, subtract found_inf as a tensor list): the
            # tensor-scalar form failed a CUDA graph capture on an H200 (stream capture unsupported).
            torch._foreach_add_(steps, 1.0)
            if found_inf is not None:
                torch._foreach_sub_(steps, [found_inf.double()] * len(steps))
            if correct and tables.count:
                # In fp64 as the host's ``1 - b ** step``, then rounded to fp32 as a kernel argument is.
                t = torch.stack([steps[i] for i in tables.kept])
                bias = torch.stack((1 - torch.pow(b1, t), 1 - torch.pow(b2, t)), dim=1).float()
            if not isinstance(lr, torch.Tensor):  # a fill, not a copy: the kernels read the rate on the device
                lr = torch.full((), lr, dtype=torch.float32, device=params[0].device)
        elif correct:
            c1, c2 = 1 - b1 ** steps[0], 1 - b2 ** steps[0]
        kernels.lamb_step(tables, lr=lr, beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"],
                          bias_correction1=c1, bias_correction2=c2, bias=bias, found_inf=found_inf,
                          max_trust_ratio=group["max_trust_ratio"])
        working_weights.written(params, [None] * len(params))  # raw-pointer writes: any working copy is stale

    def __getstate__(self) -> Dict[str, Any]:  # pickle and deepcopy keep the choices, not the device tables
        return {**super().__getstate__(), "implementation": self.implementation, "capturable": self.capturable}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("capturable", False)
        self._tables = {}

    def state_dict(self) -> Dict[str, Any]:
        """torch's, with every step a Python int (a capturable LAMB's are device scalars: one host
        read here), so any implementation resumes from it."""
        state_dict = super().state_dict()
        state_dict["state"] = {i: {**s, "step": int(s["step"])} if isinstance(s.get("step"), torch.Tensor) else s
                               for i, s in state_dict["state"].items()}
        return state_dict

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torch's, except that the moments stay fp32 (torch casts saved state to each parameter's
        dtype, which would round a bf16 parameter's moments to bf16) and the steps take this
        optimizer's form (host ints, or device scalars when capturable)."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        moments = {i: {k: v for k, v in state_dict["state"][i].items() if k in ("exp_avg", "exp_avg_sq")}
                   for i in saved_ids if i in state_dict["state"]}
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params):
            state = self.state[p]
            for k, v in moments.get(i, {}).items():
                state[k] = v.to(device=p.device, dtype=torch.float32, copy=True)
            if "step" in state:
                step = int(state["step"])
                state["step"] = (torch.full((), step, dtype=torch.float64, device=p.device) if self.capturable
                                 else step)
        self._tables.clear()


def _batches(params: Sequence[torch.Tensor], budget: int) -> List[slice]:
    """Consecutive slices of ``params`` of at most ``budget`` elements each (a larger tensor alone)."""
    out, start, size = [], 0, 0
    for i, p in enumerate(params):
        if i > start and size + p.numel() > budget:
            out.append(slice(start, i))
            start, size = i, 0
        size += p.numel()
    if start < len(params):
        out.append(slice(start, len(params)))
    return out


def _foreach_lamb(params: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor],
                  exp_avg_sqs: List[torch.Tensor], steps: List[int], group: Dict[str, Any]) -> None:
    """The reference's arithmetic, one multi-tensor op at a time, over tensors of one device and dtype."""
    b1, b2 = group["betas"]
    lowp = params[0].dtype != torch.float32
    for part in _batches(params, FOREACH_BATCH_ELEMENTS):
        ps, ms, vs = params[part], exp_avgs[part], exp_avg_sqs[part]
        gs = grads[part] if grads[0].dtype == torch.float32 else [g.float() for g in grads[part]]
        torch._foreach_mul_(ms, b1)
        torch._foreach_add_(ms, gs, alpha=1 - b1)
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, gs, gs, value=1 - b2)
        ws = [p.float() for p in ps] if lowp else ps
        if group["bias_correction"]:
            updates = torch._foreach_div(ms, [1 - b1 ** s for s in steps[part]])
            denom = torch._foreach_div(vs, [1 - b2 ** s for s in steps[part]])
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, group["eps"])
            torch._foreach_div_(updates, denom)
        else:
            denom = torch._foreach_sqrt(vs)
            torch._foreach_add_(denom, group["eps"])
            updates = torch._foreach_div(ms, denom)
        del denom
        if group["weight_decay"]:
            torch._foreach_add_(updates, ws, alpha=group["weight_decay"])
        w_norm = torch.stack(torch._foreach_norm(ws))
        u_norm = torch.stack(torch._foreach_norm(updates))
        trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
        if group["max_trust_ratio"] is not None:
            trust = trust.clamp(max=group["max_trust_ratio"])
        scales = (trust * -group["lr"]).unbind()  # device scalars: no host read
        if lowp:  # the update rounded to the parameter's dtype first, as the reference
            torch._foreach_mul_(updates, scales)
            torch._foreach_add_(ps, [u.to(p.dtype) for u, p in zip(updates, ps)])
        else:
            torch._foreach_addcmul_(ps, scales, updates)


# --------------------------------------------------------------------------- building
def fused_adamw_devices() -> List[str]:
    """The device types the installed torch has a fused AdamW kernel for."""
    from torch.utils import _foreach_utils

    return list(getattr(_foreach_utils, "_get_fused_kernels_supported_devices", lambda: ["cuda"])())


def _fused_adamw_supported(params: Sequence[torch.Tensor]) -> bool:
    """Does the installed torch have a fused AdamW kernel for every parameter's device?"""
    supported = fused_adamw_devices()
    return bool(params) and all(p.device.type in supported and p.is_floating_point() for p in params)


def build_optimizer(model: torch.nn.Module, name: str, lr: float, weight_decay: float = 0.01,
                    betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                    fused: Optional[bool] = None, implementation: Optional[str] = None,
                    capturable: bool = False, working_dtype: Optional[torch.dtype] = None) -> torch.optim.Optimizer:
    """'adamw' (the paper's Adam with decoupled weight decay) or 'lamb', over ``parameter_groups``.

    implementation: AdamW's ("triton", "fused", "foreach": ``adamw_implementation``) or LAMB's
    (see ``Lamb``); fused (AdamW only): True forces torch's fused kernel, False its foreach form.
    capturable (LAMB only): see ``Lamb`` (AdamW's every form is capturable).
    working_dtype (AdamW only): bf16 or fp16, the autocast dtype of the forward; where the triton
    AdamW runs, it writes working copies of the GEMM weights in it (bertfast.model.working_weights).
    """
    groups = parameter_groups(model, weight_decay)
    if name == "adamw":
        if capturable:
            raise ValueError("capturable= is LAMB's; every form of AdamW is capturable")
        if fused is not None:
            if implementation is not None:
                raise ValueError(f"AdamW takes fused= or implementation=, not both (got fused={fused!r}, "
                                 f"implementation={implementation!r})")
            implementation = "fused" if fused else "foreach"
        implementation = adamw_implementation(implementation, [p for g in groups for p in g["params"]])
        if implementation == "triton":
            working = None
            if working_dtype is not None:
                from bertfast.model.working_weights import WorkingWeights
                working = WorkingWeights(model, working_dtype)
            return AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, working=working)
        kwargs = {"fused": True} if implementation == "fused" else {"foreach": True}
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)
    if working_dtype is not None:
        raise ValueError(f"working_dtype= is the triton AdamW's, got it for {name!r}")
    if name == "lamb":
        if fused is not None:
            raise ValueError(f"fused= chooses AdamW's kernel; LAMB takes implementation=, got fused={fused!r}")
        return Lamb(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, implementation=implementation,
                    capturable=capturable)
    raise ValueError(f"unknown optimizer {name!r}; expected 'adamw' or 'lamb'")


def pretrain_optimizer(model: torch.nn.Module, args: Any, precision: str) -> torch.optim.Optimizer:
    """The optimizer ``bertfast pretrain`` steps ``model`` with, for ``args`` (a
    training.config.PretrainConfig) and its resolved ``precision`` (fp32, bf16, fp16). The
    benchmark's packed pre-training rows build theirs here too, so that they time pretrain's step.

    LAMB's implementation is chosen once, here ($BERTFAST_LAMB, else triton where it can run); the
    triton one (CUDA) keeps its step counts on the device, as fused AdamW does, so --cuda-graphs
    captures it and --on-nonfinite skip skips with no host read. AdamW is the triton one where it
    can run (fp32 CUDA parameters): it writes the bf16 (fp16) working copies of the GEMM weights
    that the forward then reads instead of casting them (bertfast.model.working_weights)."""
    lamb = lamb_implementation(None, list(model.parameters())) if args.optimizer == "lamb" else None
    working = ({"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision) if args.optimizer == "adamw"
               else None)
    return build_optimizer(model, args.optimizer, args.lr, args.weight_decay, (args.beta1, args.beta2),
                           args.adam_eps, implementation=lamb, capturable=lamb == "triton", working_dtype=working)


def warmup_linear_decay(optimizer: torch.optim.Optimizer, warmup_steps: int,
                        total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """lr * step/warmup during warm-up, then linear decay to 0 at total_steps."""
    warmup_steps = max(0, int(warmup_steps))
    total_steps = max(1, int(total_steps))

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
