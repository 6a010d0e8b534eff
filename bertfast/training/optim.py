"""Optimizers and the learning-rate schedule.

Parameter groups leave biases and LayerNorm parameters without weight decay (the paper's
recipe); AdamW runs torch's fused kernel on CUDA; LAMB is for large batches. The schedule is
a linear warm-up, then linear decay to zero.

LAMB (You et al., 2019, "Large batch optimization for deep learning"), per parameter w with
gradient g at step t:
    m = b1*m + (1-b1)*g ;  v = b2*v + (1-b2)*g^2
    u = (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps) + wd * w
    r = ||w|| / ||u||   (1 when either norm is 0; the layer-wise trust ratio)
    w = w - lr * r * u
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch


NO_DECAY_PATTERNS = ("bias", "LayerNorm.weight", "LayerNorm.bias", "layer_norm", "layernorm")


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


class Lamb(torch.optim.Optimizer):
    """LAMB: Adam moments with a per-parameter trust ratio ||w|| / ||update|| (see module docstring)."""

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, bias_correction: bool = True,
                 max_trust_ratio: Optional[float] = 10.0):
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid LAMB hyper-parameters lr={lr} betas={betas} eps={eps} wd={weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_trust_ratio=max_trust_ratio)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LAMB does not support sparse gradients")
                g = p.grad.float()
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
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
        return loss


def build_optimizer(model: torch.nn.Module, name: str, lr: float, weight_decay: float = 0.01,
                    betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                    fused: Optional[bool] = None) -> torch.optim.Optimizer:
    """'adamw' (the paper's Adam with decoupled weight decay) or 'lamb'."""
    groups = parameter_groups(model, weight_decay)
    if name == "adamw":
        device_types = {p.device.type for g in groups for p in g["params"]}
        if fused is None:
            fused = device_types == {"cuda"}
        kwargs = {"fused": True} if fused else {}
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)
    if name == "lamb":
        return Lamb(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; expected 'adamw' or 'lamb'")


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
