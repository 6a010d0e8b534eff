"""The optimizer tests' shared cases (tests/test_optim_*.py): the parameters, their gradients, the
comparisons and the skips, in one place so that LAMB and AdamW are checked on the same tensors.

Oracle: ``Lamb(implementation="reference")``, the per-parameter loop (AdamW: torch's for-loop).
Tolerances: fp32 parameters and moments within 1e-6 of each tensor's largest value (the norms are
summed in another order and products may be fused, ~1e-7 apart); fp16/bf16 parameters within one
unit in the last place of their dtype (the update is rounded to it, and a 1e-7 difference can move
that rounding).

Without a GPU, triton runs under the interpreter (tiny tensors: its chunks are 128 elements, its
tiles 64, so they still cross chunks and tails) and bf16 is left to the GPU (the interpreter
truncates fp32 -> bf16 where the GPU rounds to nearest).

"capturable" is the triton implementation with its step counts, bias corrections and learning rate
on the device (``Lamb(capturable=True)``, what a CUDA graph captures).
"""
import pytest
import torch

from bertfast.training import optim

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
CAPTURABLE = "capturable"  # the triton implementation, capturable=True
# name: (shape, scale of the initial weights); decayed then not decayed.
DECAYED = {"w": ((7, 13), 0.1), "big": ((5, 64), 30.0), "zero_w": ((300,), 0.0), "no_grad": ((3, 3), 1.0)}
NOT_DECAYED = {"bias": ((33,), 0.1), "zero_g": ((64,), 0.1), "one": ((1,), 1.0), "empty": ((0,), 1.0),
               "exact": ((128,), 0.5)}


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return {name: torch.nn.Parameter((scale * torch.randn(shape, generator=g)).to(DEVICE, dtype))
            for name, (shape, scale) in {**DECAYED, **NOT_DECAYED}.items()}


def _set_grads(params, step):
    """'zero_g' gets a zero gradient, 'no_grad' none at all; the others fresh random ones."""
    g = torch.Generator().manual_seed(1000 + step)
    for name, p in params.items():
        p.grad = None if name == "no_grad" else torch.randn(p.shape, generator=g).to(DEVICE, p.dtype)
    params["zero_g"].grad.zero_()


def _close(name, got, ref, dtype=torch.float32):
    """fp32: within 1e-6 of the tensor's largest value (an element that cancels, m = b1 m + (1 - b1) g
    say, carries the rounding of its terms). fp16/bf16: within one unit in the last place."""
    scale = ref.float().abs().max().item() if ref.numel() else 0.0
    if dtype == torch.float32:
        tol = dict(rtol=1e-6, atol=1e-6 * scale)
    else:
        tol = dict(rtol=torch.finfo(dtype).eps, atol=torch.finfo(dtype).eps * scale)
    torch.testing.assert_close(got, ref, **tol, msg=lambda m: f"{name}: {m}")


def _assert_identical(a_params, a_opt, b_params, b_opt):
    for name in a_params:
        assert torch.equal(a_params[name], b_params[name]), name
        sa, sb = a_opt.state[a_params[name]], b_opt.state[b_params[name]]
        # A step is a host int, or a capturable LAMB's device scalar: compared by value.
        assert sa.keys() == sb.keys() and all(
            torch.equal(sa[k], sb[k]) if torch.is_tensor(sa[k]) and torch.is_tensor(sb[k]) else
            float(sa[k]) == float(sb[k]) for k in sa), name


def _require(implementation):
    if implementation in ("triton", CAPTURABLE):
        ok, why = optim.triton_lamb_availability()
        if not ok:
            pytest.skip(f"the triton LAMB is unavailable: {why}")


def _require_triton_adamw():
    ok, why = optim.triton_adamw_availability()
    if not ok:
        pytest.skip(f"the triton AdamW is unavailable: {why}")
