"""AdamW's fused, foreach and triton forms against torch's for-loop AdamW: the same parameters and
moments, clipping inside the optimizer, the triton form's working copies, skipped steps and
checkpoints (cases and tolerances: optim_helpers.py)."""
import copy
import io

import pytest
import torch

import bertfast
from bertfast.training import optim
from optim_helpers import (DECAYED, DEVICE, NOT_DECAYED, _assert_identical, _close, _params, _require_triton_adamw,
                           _set_grads)


# The triton runs are the ones a GPU check should repeat on CUDA.
pytestmark = pytest.mark.gpu_capable


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_adamw_matches_torchs_for_loop(fused):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 3)).to(DEVICE)
    twin = copy.deepcopy(model)
    fast = optim.build_optimizer(model, "adamw", 1e-2, weight_decay=0.1, fused=fused)
    loop = torch.optim.AdamW(optim.parameter_groups(twin, 0.1), lr=1e-2, eps=1e-6, weight_decay=0.1,
                             foreach=False, fused=False)
    for step in range(5):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).to(DEVICE)
        for m, opt in ((model, fast), (twin, loop)):
            opt.zero_grad(set_to_none=True)
            m(x).square().mean().backward()
            opt.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("implementation", ["fused", "triton"])
@pytest.mark.parametrize("max_norm", [0.05, 0.0], ids=["clipping", "no-clipping"])
def test_fused_adamw_clips_in_its_own_kernel_as_clip_grad_norm_would(max_norm, implementation):
    """TrainStep hands fused AdamW the clipping factor as its grad_scale: no separate pass over the
    gradients (they leave the backward unclipped), and the parameters after a few steps those of
    clip_grad_norm_ then AdamW. Clipping off (0): only the norm is taken. Other optimizers clip
    with clip_grad_norm_ as before."""
    from bertfast.training.step import TrainStep
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    if implementation == "fused" and DEVICE.type not in _get_fused_kernels_supported_devices():
        pytest.skip("no fused AdamW in this torch")
    if not hasattr(torch.nn.utils, "get_total_norm"):
        pytest.skip("no torch.nn.utils.get_total_norm in this torch")
    if implementation == "triton":
        _require_triton_adamw()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 3)).to(DEVICE)
    twin = copy.deepcopy(model)
    opt = optim.build_optimizer(model, "adamw", 1e-2, weight_decay=0.1, implementation=implementation)
    step = TrainStep(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), DEVICE, "fp32",
                     max_grad_norm=max_norm)
    assert step.clips_in_optimizer
    loop = torch.optim.AdamW(optim.parameter_groups(twin, 0.1), lr=1e-2, eps=1e-6, weight_decay=0.1,
                             foreach=False, fused=False)

    class Out:
        def __init__(self, loss):
            self.loss = loss

    for i in range(4):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i)).to(DEVICE)
        done = step([{"x": x}], lambda batch: Out(model(batch["x"]).square().mean() * 10))
        loop.zero_grad(set_to_none=True)
        (twin(x).square().mean() * 10).backward()
        norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm or float("inf"))
        loop.step()
        torch.testing.assert_close(done.grad_norm, norm, rtol=1e-6, atol=0)
        assert (step.grad_scale is not None) == (max_norm > 0 and bool(norm > max_norm))
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # the gradients of the last step, unclipped by the step itself (the optimizer read them scaled)
    model.zero_grad(set_to_none=True)
    model(x).square().mean().mul(10).backward()
    raw = [p.grad.clone() for p in model.parameters()]
    step.clip()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), raw))
    lamb = optim.build_optimizer(model, "lamb", 1e-2)
    assert not TrainStep(model, lamb, torch.optim.lr_scheduler.LambdaLR(lamb, lambda s: 1.0), DEVICE, "fp32",
                         max_grad_norm=1.0).clips_in_optimizer


def _adamw_pair(params, lr=1e-2, **hyper):
    """The triton AdamW over ``params`` and torch's for-loop AdamW over a copy, both in the
    decayed / not-decayed groups of the LAMB tests (eps 1e-6 unless given: the defaults differ)."""
    hyper.setdefault("eps", 1e-6)
    twin = {n: torch.nn.Parameter(p.detach().clone()) for n, p in params.items()}

    def groups(ps):
        return [{"params": [ps[n] for n in DECAYED], "weight_decay": 0.1},
                {"params": [ps[n] for n in NOT_DECAYED], "weight_decay": 0.0}]
    fast = optim.AdamW(groups(params), lr=lr, **hyper)
    loop = torch.optim.AdamW(groups(twin), lr=lr, foreach=False, fused=False, **hyper)
    return fast, twin, loop


@pytest.mark.parametrize("hyper", [dict(), dict(betas=(0.8, 0.95), eps=1e-8)], ids=["default", "betas"])
def test_triton_adamw_matches_torchs_for_loop(hyper):
    """Every tensor of the LAMB cases (empty, one element, zero gradient, none at all, across chunks
    and tails), decayed and not, over four steps: parameters and moments as torch's loop computes
    them (fp32: the same formula, in another order: within 1e-6 of each tensor's largest value)."""
    _require_triton_adamw()
    params = _params()
    fast, twin, loop = _adamw_pair(params, **hyper)
    for step in range(4):
        _set_grads(params, step)
        _set_grads(twin, step)
        fast.step()
        loop.step()
    for name in params:
        _close(name, params[name], twin[name])
        got, want = fast.state[params[name]], loop.state[twin[name]]
        assert set(got) == set(want), name
        if want:
            assert float(got["step"]) == float(want["step"]) == (0 if name == "no_grad" else 4), name
            assert got["step"].device == params[name].device and got["step"].dtype == torch.float32
            for key in ("exp_avg", "exp_avg_sq"):
                _close(f"{name} {key}", got[key], want[key])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_adamw_writes_each_working_copy_as_torch_casts_the_weight(dtype):
    """The GEMM weights' copies (the QKV weights in one buffer) hold exactly the cast of each
    updated weight, rounded to nearest even as torch rounds, after every step; a weight with no
    copy (LayerNorm) is updated all the same; the forward then finds them fresh."""
    _require_triton_adamw()
    from bertfast.model import working_weights

    model = bertfast.BertForMaskedLM(bertfast.BertConfig.preset("tiny")).to(DEVICE)
    opt = optim.build_optimizer(model, "adamw", 1e-2, implementation="triton", working_dtype=dtype)
    working = opt.working
    attention = model.bert.encoder.layer[0].attention.self
    qkv = [attention.query.weight, attention.key.weight, attention.value.weight]
    ln = model.bert.embeddings.LayerNorm.weight
    assert working.copy_of(ln) is None and working.copy_of(qkv[0]) is not None
    for step in range(3):
        before = ln.detach().clone()
        g = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(DEVICE)
        opt.step()
        assert not torch.equal(ln, before)
        for name, p in model.named_parameters():
            copy_ = working.copy_of(p)
            if copy_ is not None:
                assert torch.equal(copy_, p.detach().to(dtype).view(-1)), (step, name)
        buffer = working_weights.lookup(qkv, dtype)
        assert buffer is not None and torch.equal(buffer, torch.cat(qkv).to(dtype))


def test_triton_adamw_skips_a_step_on_found_inf_and_leaves_gradients_it_divides_unwritten():
    """found_inf set: parameters, moments and steps stay as they were. grad_scale set: the step is
    torch's on the gradients divided by it, and the gradients are not written back."""
    _require_triton_adamw()
    params = _params()
    fast, twin, loop = _adamw_pair(params)
    _set_grads(params, 0)
    _set_grads(twin, 0)
    fast.step()
    loop.step()
    kept = {n: p.detach().clone() for n, p in params.items()}
    state = {n: {k: v.clone() for k, v in fast.state[p].items()} for n, p in params.items()}
    _set_grads(params, 1)
    fast.found_inf = torch.ones((), device=DEVICE)
    fast.step()
    del fast.found_inf
    for name, p in params.items():
        assert torch.equal(p, kept[name]), name
        assert all(torch.equal(fast.state[p][k], v) for k, v in state[name].items()), name
    grads = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
    fast.grad_scale = torch.full((), 4.0, device=DEVICE)
    fast.step()
    del fast.grad_scale
    assert all(torch.equal(params[n].grad, g) for n, g in grads.items())
    for name, p in twin.items():
        p.grad = None if name not in grads else grads[name] / 4.0
    loop.step()
    for name in params:
        _close(name, params[name], twin[name])


def test_a_triton_adamw_checkpoint_resumes_identically_and_loads_into_torchs_adamw():
    _require_triton_adamw()
    params = _params()
    fast, _, _ = _adamw_pair(params)
    for step in range(2):
        _set_grads(params, step)
        fast.step()
    buffer = io.BytesIO()
    torch.save({"params": {n: p.detach() for n, p in params.items()}, "opt": fast.state_dict()}, buffer)
    for step in range(2, 4):
        _set_grads(params, step)
        fast.step()
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = {n: torch.nn.Parameter(p.clone()) for n, p in saved["params"].items()}
    again, twin, loop = _adamw_pair(resumed)
    again.load_state_dict(saved["opt"])
    loop.load_state_dict(copy.deepcopy(saved["opt"]))  # torch keeps the loaded moments: not shared
    for step in range(2, 4):
        _set_grads(resumed, step)
        _set_grads(twin, step)
        again.step()
        loop.step()
    _assert_identical(params, fast, resumed, again)
    for name in params:
        _close(name, twin[name], params[name])
