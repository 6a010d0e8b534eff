"""`bertfast info` / `python -m bertfast.info`: what runs on this machine, and why not.

Lists versions, devices, the Triton and CUDA-extension status, which LAMB implementation runs,
and for every op each backend with the reasons it can or cannot run a typical input on each
device here, which backend dispatch would pick, what a backend's kernels are (its module's KERNELS,
where it has one), and any fallbacks that happened in this process.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import List, Optional

# torch, dispatch and the ops are imported where used: `bertfast info --help` imports none of them.


def _autotune_line() -> str:
    from bertfast.kernels._common import AUTOTUNE_ENV, autotune_enabled, excluded_summary
    try:
        enabled = autotune_enabled()
        excluded = excluded_summary()
    except ValueError as exc:
        return f"Triton autotuning: {exc}"
    if not enabled:
        line = f"Triton autotuning: off ({AUTOTUNE_ENV}=0): every kernel runs its first candidate config"
    else:
        cache = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
        line = f"Triton autotuning: on; results cached in {cache} (TRITON_CACHE_DIR)"
    return line + (f"\n{excluded}" if excluded else "")


def report() -> str:
    import torch

    from bertfast import dispatch, registry

    lines: List[str] = ["bertfast environment", "===================="]
    lines.append(f"python {platform.python_version()}  torch {torch.__version__}  platform {platform.platform()}")
    ok, why = dispatch.triton_availability()
    if ok:
        import triton
        interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
        lines.append(f"triton {triton.__version__}" + ("  (TRITON_INTERPRET=1: kernels run on the CPU interpreter)"
                                                      if interp else ""))
        lines.append(_autotune_line())
        from bertfast.kernels.attention import dq_summary
        lines.append(dq_summary())
    else:
        lines.append(f"triton: unavailable: {why}")
    ok, why = dispatch.cuda_ext_availability()
    lines.append(f"CUDA extension bertfast._C: {'built and importable' if ok else 'unavailable: ' + why}")
    from bertfast.training.optim import adamw_summary, lamb_summary
    lines.append(adamw_summary())
    lines.append(lamb_summary())
    from bertfast.model.residual_linear import ffn_summary, weight_grad_summary
    lines.append(ffn_summary())
    lines.append(weight_grad_summary())
    from bertfast.ops.mlm_head_loss import head_summary
    lines.append(head_summary())
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.insert(0, torch.device("cuda"))
        props = torch.cuda.get_device_properties(0)
        lines.append(f"GPU: {props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB), "
                     f"CUDA {torch.version.cuda}")
    else:
        lines.append("GPU: none (CUDA not available to torch)")
    forced = os.environ.get("BERTFAST_BACKEND")
    if forced:
        lines.append(f"BERTFAST_BACKEND={forced} (forced for every op)")
    lines.append("")
    lines.append("Backends per op (device, dtype -> selected backend; then every backend and why not):")
    for op in dispatch.ops():
        lines.append(f"  {op}")
        for device in devices:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            inputs = registry.form(op)[1].sample_inputs(device, dtype)
            try:
                chosen: Optional[str] = dispatch.select(op, **inputs)
                lines.append(f"    {device.type}/{str(dtype).replace('torch.', '')}: -> {chosen}")
            except dispatch.NoBackendError as exc:
                lines.append(f"    {device.type}: no backend: {exc}")
            for name, backend in dispatch.backends(op).items():
                reasons = backend.reasons(False, **inputs)
                state = "ok" if not reasons else "; ".join(reasons)
                if not backend.auto_select:
                    state += " (runs only when forced)"
                lines.append(f"      {name:6s} {state}")
        for name, backend in dispatch.backends(op).items():  # what each backend's kernels are, where it says
            kernels = getattr(backend.impl, "KERNELS", None) if backend.availability()[0] else None
            if kernels:
                lines.append(f"    {name} kernels: {kernels}")
    if dispatch.FALLBACKS:
        lines.append("")
        lines.append("Fallbacks in this process (a backend that should have run was unavailable):")
        for (op, name), reason in sorted(dispatch.FALLBACKS.items()):
            lines.append(f"  {op}: {name} skipped: {reason}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog="bertfast info", description=__doc__.split("\n\n")[0].split(": ", 1)[1])


def main(argv: Optional[List[str]] = None) -> int:
    parser().parse_args(argv)
    sys.stdout.write(report() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
