"""LAMB's foreach and triton (host-step and capturable) implementations against the reference loop,
checkpoints that resume across implementations, and determinism: every implementation must train
as the reference does (cases and tolerances: optim_helpers.py)."""
import copy
import io

import pytest
import torch

from bertfast.training import optim
from optim_helpers import (CAPTURABLE, DECAYED, DEVICE, GPU, NOT_DECAYED, _assert_identical, _close, _params,
                           _require, _set_grads)

LOWP = [torch.float16] + ([torch.bfloat16] if GPU else [])
FAST = ("foreach", "triton")


# The triton runs are the ones a GPU check should repeat on CUDA.
pytestmark = pytest.mark.gpu_capable


def _lamb(params, implementation, **hyper):
    groups = [{"params": [params[n] for n in DECAYED], "weight_decay": 0.01},
              {"params": [params[n] for n in NOT_DECAYED], "weight_decay": 0.0}]
    if implementation == CAPTURABLE:
        implementation, hyper = "triton", {**hyper, "capturable": True}
    return optim.Lamb(groups, lr=0.02, implementation=implementation, **hyper)


def _run(implementation, steps, dtype=torch.float32, first=0, params=None, state=None, **hyper):
    """``steps`` LAMB steps (gradients of steps first, first + 1, ...); returns (params, optimizer)."""
    params = params if params is not None else _params(dtype)
    opt = _lamb(params, implementation, **hyper)
    if state is not None:
        opt.load_state_dict(state)
    for step in range(first, first + steps):
        _set_grads(params, step)
        opt.step()
    return params, opt


def _snapshot(params, opt):
    """Copies of the parameters and of the optimizer's state dict (safe from later steps)."""
    return {n: p.detach().clone() for n, p in params.items()}, copy.deepcopy(opt.state_dict())


def _restore(saved):
    return {n: torch.nn.Parameter(t.clone()) for n, t in saved.items()}


def _assert_same_run(got_params, got_opt, ref_params, ref_opt, dtype=torch.float32):
    for name, ref in ref_params.items():
        _close(name, got_params[name], ref, dtype)
        got_state, ref_state = got_opt.state[got_params[name]], ref_opt.state[ref]
        assert set(got_state) == set(ref_state), name
        if ref_state:
            assert got_state["step"] == ref_state["step"], name
            for key in ("exp_avg", "exp_avg_sq"):
                assert got_state[key].dtype == torch.float32, (name, key)
                _close(f"{name} {key}", got_state[key], ref_state[key])


@pytest.mark.parametrize("implementation", FAST + (CAPTURABLE,))
@pytest.mark.parametrize("dtype,hyper", [
    (torch.float32, dict(bias_correction=True, max_trust_ratio=10.0)),
    (torch.float32, dict(bias_correction=False, max_trust_ratio=None)),
    *[(dt, dict(bias_correction=True, max_trust_ratio=10.0)) for dt in LOWP],
], ids=lambda v: str(v).replace("torch.", "") if isinstance(v, torch.dtype) else
    f"bc={int(v['bias_correction'])},max_trust={v['max_trust_ratio']}")
def test_lamb_matches_the_reference(implementation, dtype, hyper):
    _require(implementation)
    ref_params, ref_opt = _run("reference", 3, dtype, **hyper)
    got_params, got_opt = _run(implementation, 3, dtype, **hyper)
    _assert_same_run(got_params, got_opt, ref_params, ref_opt, dtype)
    # The special tensors did what they are there for.
    assert not got_opt.state[got_params["no_grad"]] and torch.equal(got_params["no_grad"], _params(dtype)["no_grad"])
    assert torch.equal(got_params["zero_g"], _params(dtype)["zero_g"])        # u = 0 without decay: trust 1, no move
    assert got_params["zero_w"].abs().max() > 0                               # ||w|| = 0: trust 1, it moves


def test_the_cases_exercise_the_trust_ratio_clamp():
    """'big' (trust ratio ~100 before the clamp) moves differently at max_trust_ratio 10 and None,
    so the comparisons above do test the clamp."""
    clamped, _ = _run("reference", 1, max_trust_ratio=10.0)
    free, _ = _run("reference", 1, max_trust_ratio=None)
    assert not torch.allclose(clamped["big"], free["big"], rtol=1e-4, atol=0)
    torch.testing.assert_close(clamped["w"], free["w"], rtol=0, atol=0)


def test_foreach_batches_cover_every_tensor(monkeypatch):
    """The foreach implementation in batches of at most 64 elements (a larger tensor alone) equals it in one batch."""
    one_batch = _run("foreach", 2)
    monkeypatch.setattr(optim, "FOREACH_BATCH_ELEMENTS", 64)
    assert [(s.start, s.stop) for s in optim._batches([torch.empty(n) for n in (10, 60, 300, 1, 2)], 64)] == [
        (0, 1), (1, 2), (2, 3), (3, 5)]
    _assert_identical(*_run("foreach", 2), *one_batch)


@pytest.mark.parametrize("implementation", ("reference",) + FAST + (CAPTURABLE,))
def test_lamb_resumes_from_a_checkpoint(implementation):
    """A reference-written checkpoint continues under each implementation as the reference does;
    then each implementation's own checkpoint, saved through torch.save, resumes bit for bit."""
    _require(implementation)
    ref_params, ref_opt = _run("reference", 2)
    saved = _snapshot(ref_params, ref_opt)
    _set_grads(ref_params, 2)
    ref_opt.step()

    params, opt = _run(implementation, 1, first=2, params=_restore(saved[0]), state=saved[1])
    _assert_same_run(params, opt, ref_params, ref_opt)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    weights = {n: p.detach().clone() for n, p in params.items()}
    _set_grads(params, 3)
    opt.step()

    buffer.seek(0)
    resumed = _run(implementation, 1, first=3, params=_restore(weights),
                   state=torch.load(buffer, weights_only=True))
    _assert_identical(params, opt, *resumed)


@pytest.mark.parametrize("implementation", ("reference", "foreach"))
def test_a_checkpoint_keeps_low_precision_parameters_moments_in_fp32(implementation):
    """torch's load_state_dict casts saved state to the parameter's dtype; LAMB's moments stay fp32."""
    dtype = LOWP[-1]
    params, opt = _run(implementation, 2, dtype)
    saved = _snapshot(params, opt)
    _set_grads(params, 2)
    opt.step()
    resumed = _run(implementation, 1, dtype, first=2, params=_restore(saved[0]), state=saved[1])
    assert resumed[1].state[resumed[0]["w"]]["exp_avg"].dtype == torch.float32
    _assert_identical(params, opt, *resumed)


@pytest.mark.parametrize("implementation", FAST)
def test_lamb_is_deterministic(implementation):
    _require(implementation)
    _assert_identical(*_run(implementation, 2), *_run(implementation, 2))


def test_triton_tables_follow_gradients_that_move():
    """Gradients are new tensors each step (zero_grad(set_to_none=True)): the address table follows
    them, and a parameter that loses its gradient leaves the tensor set."""
    _require("triton")
    ref_params, ref_opt = _run("reference", 1)
    params, opt = _run("triton", 1)
    for p, q in ((params, opt), (ref_params, ref_opt)):
        _set_grads(p, 1)
        p["w"].grad = p["w"].grad.clone()  # a gradient at a new address
        p["bias"].grad = None              # and one that is gone
        q.step()
    _assert_same_run(params, opt, ref_params, ref_opt)
    assert len(opt._tables) == 2


@pytest.mark.parametrize("dtype", [torch.float32] + LOWP, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("bias_correction", [True, False], ids=["bc", "no-bc"])
@pytest.mark.parametrize("device_lr", [False, True], ids=["host-lr", "device-lr"])
def test_capturable_lamb_computes_what_the_host_step_triton_lamb_does(dtype, bias_correction, device_lr):
    """Steps on the device, bias corrections computed there in fp64 (as the host computes them in
    Python floats) and the learning rate read there: on CPU the same bits as the host-step
    triton LAMB; on a GPU the device's fp64 pow may differ in the last place, so within the
    tolerances above."""
    _require("triton")
    host_params, host_opt = _run("triton", 3, dtype, bias_correction=bias_correction)
    params = _params(dtype)
    opt = _lamb(params, CAPTURABLE, bias_correction=bias_correction)
    if device_lr:  # as GraphedTrainStep hands it the rate, for the scheduler to fill
        for group in opt.param_groups:
            group["lr"] = torch.tensor(group["lr"], dtype=torch.float32, device=DEVICE)
    for step in range(3):
        _set_grads(params, step)
        opt.step()
    for name, p in params.items():
        state = opt.state[p]
        if state:
            assert state["step"].dtype == torch.float64 and state["step"].device == p.device, name
    _assert_same_as_host_triton(params, opt, host_params, host_opt, dtype)


def _assert_same_as_host_triton(params, opt, host_params, host_opt, dtype=torch.float32):
    """A capturable LAMB's run against the host-step triton LAMB's: bit for bit on CPU, within the
    tolerances on a GPU (its fp64 pow may differ from the host's in the last place)."""
    if GPU:
        _assert_same_run(params, opt, host_params, host_opt, dtype)
    else:
        _assert_identical(params, opt, host_params, host_opt)


def test_capturable_lamb_skips_a_step_on_found_inf():
    """found_inf 1: parameters, moments and steps stay as they were; found_inf 0 then: the step an
    optimizer that never saw the skipped one takes, bit for bit."""
    _require("triton")
    params, opt = _run(CAPTURABLE, 2)
    twin_params, twin_opt = _run(CAPTURABLE, 0, params=_restore(_snapshot(params, opt)[0]), state=opt.state_dict())
    _set_grads(params, 7)
    opt.found_inf = torch.ones((), device=DEVICE)
    opt.step()
    _assert_identical(params, opt, twin_params, twin_opt)               # nothing moved, the steps included
    assert int(opt.state[params["w"]]["step"]) == 2
    for p, q in ((params, opt), (twin_params, twin_opt)):
        _set_grads(p, 2)
        q.found_inf = torch.zeros((), device=DEVICE)
        q.step()
        del q.found_inf
    _assert_identical(params, opt, twin_params, twin_opt)
    assert int(opt.state[params["w"]]["step"]) == 3


def test_a_capturable_lambs_checkpoint_holds_int_steps_and_resumes_under_any_implementation():
    """The state dict gives the steps as ints (one host read); a host-step LAMB resumes from it and
    a capturable one resumes from a host-step LAMB's, as the reference does."""
    _require("triton")
    params, opt = _run(CAPTURABLE, 2)
    saved = _snapshot(params, opt)
    assert {type(s["step"]) for s in saved[1]["state"].values()} == {int}
    assert isinstance(opt.state[params["w"]]["step"], torch.Tensor)    # the live state is left on the device
    ref_params, ref_opt = _run("reference", 1, first=2, params=_restore(saved[0]), state=saved[1])
    for implementation in ("foreach", "triton", CAPTURABLE):
        got = _run(implementation, 1, first=2, params=_restore(saved[0]), state=saved[1])
        _assert_same_run(*got, ref_params, ref_opt)
    host = _snapshot(*_run("triton", 2))
    resumed = _run(CAPTURABLE, 1, first=2, params=_restore(host[0]), state=host[1])
    assert isinstance(resumed[1].state[resumed[0]["w"]]["step"], torch.Tensor)
    _assert_same_as_host_triton(*resumed, *_run("triton", 1, first=2, params=_restore(host[0]), state=host[1]))


def test_capturable_and_found_inf_are_refused_where_they_cannot_work():
    _require("triton")
    p = torch.nn.Parameter(torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError, match="a capturable LAMB .* needs the triton implementation, got 'foreach'"):
        optim.Lamb([p], implementation="foreach", capturable=True)
    opt = optim.Lamb([p], implementation="triton")
    p.grad = torch.ones(4, device=DEVICE)
    opt.found_inf = torch.zeros((), device=DEVICE)
    with pytest.raises(ValueError, match="found_inf .* needs capturable=True"):
        opt.step()
    from bertfast.kernels import lamb as kernels
    tables = kernels.LambTables()
    tables.update([p], [p.grad], [torch.zeros(4, device=DEVICE)], [torch.zeros(4, device=DEVICE)])
    with pytest.raises(ValueError, match=r"LAMB bias corrections: .*shape"):
        kernels.lamb_step(tables, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0, max_trust_ratio=None,
                          bias=torch.ones(2, 2, device=DEVICE))
    with pytest.raises(ValueError, match=r"LAMB learning rate: .*float32.*float64"):
        kernels.lamb_step(tables, lr=torch.tensor(0.1, dtype=torch.float64, device=DEVICE), beta1=0.9, beta2=0.999,
                          eps=1e-6, weight_decay=0.0, max_trust_ratio=None)
