"""The parity gate: before a path is timed, its outputs and gradients must match the reference.

Every tensor a path produces (outputs and input gradients, valid tokens only, in a common
layout) is compared with the reference run in fp32 on the same inputs. The bound follows
docs/testing.md: for low-precision paths, ``2 x`` the error of the same reference run in
that low dtype, plus a floor; for fp32 paths, the floor alone. The floor,
``1e-5 + 1e-4 * max|reference|``, is looser than the unit tests' (they are the precise
check; the gate's job is to refuse to time a wrong path, on any shape, without flaking).
A non-finite value anywhere fails.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch

LOWP_FACTOR = 2.0
ABS_FLOOR = 1e-5
REL_FLOOR = 1e-4


@dataclass
class GateResult:
    ok: bool
    message: str = ""
    tensors: Dict[str, Dict[str, float]] = field(default_factory=dict)  # name -> err, bound, ...

    def to_dict(self) -> Dict[str, Any]:
        return {"ok": self.ok, "message": self.message, "tensors": self.tensors}


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def compare(fast: Dict[str, torch.Tensor], ref32: Dict[str, torch.Tensor],
            ref_lowp: Optional[Dict[str, torch.Tensor]] = None, factor: float = LOWP_FACTOR) -> GateResult:
    """Check every tensor of ``ref32`` against ``fast`` (same names, same shapes).

    ref_lowp: the reference run in the fast path's low dtype (None for fp32 paths).
    """
    tensors: Dict[str, Dict[str, float]] = {}
    failures = []
    for name, ref in ref32.items():
        if name not in fast:
            failures.append(f"{name}: missing from the path's outputs")
            continue
        got = fast[name]
        if tuple(got.shape) != tuple(ref.shape):
            failures.append(f"{name}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
            continue
        if got.is_floating_point() and not torch.isfinite(got).all():
            failures.append(f"{name}: NaN/inf")
            tensors[name] = {"err": float("nan"), "bound": 0.0}
            continue
        scale = ref.abs().max().item() if ref.numel() else 0.0
        floor = ABS_FLOOR + REL_FLOOR * scale
        err = _max_err(got, ref)
        entry = {"err": err, "floor": floor, "max_abs_ref": scale}
        bound = floor
        if ref_lowp is not None and name in ref_lowp:
            err_lowp = _max_err(ref_lowp[name], ref)
            bound = factor * err_lowp + floor
            entry["err_ref_lowp"] = err_lowp
        entry["bound"] = bound
        tensors[name] = entry
        if not err <= bound:
            failures.append(f"{name}: max error {err:.3e} > bound {bound:.3e}")
    if failures:
        return GateResult(False, "; ".join(failures), tensors)
    return GateResult(True, "", tensors)
