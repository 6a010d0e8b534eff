"""Optimizers (bertfast/training/optim.py): LAMB's foreach and triton implementations against the
reference loop, checkpoints across implementations, determinism, the choice of implementation and
its fallback; AdamW's fused and foreach forms against torch's for-loop.

Oracle: ``Lamb(implementation="reference")``, the per-parameter loop. Tolerances: fp32 parameters
and moments within 1e-6 of each tensor's largest value (the norms are summed in another order and
products may be fused, ~1e-7 apart); fp16/bf16 parameters within one unit in the last place of
their dtype (the update is rounded to it, and a 1e-7 difference can move that rounding).

Without a GPU, triton runs under the interpreter (tiny tensors: its chunks are 128 elements, its
tiles 64, so they still cross chunks and tails) and bf16 is left to the GPU (the interpreter
truncates fp32 -> bf16 where the GPU rounds to nearest).

"capturable" below is the triton implementation with its step counts, bias corrections and
learning rate on the device (``Lamb(capturable=True)``, what a CUDA graph captures).
"""
import copy
import io
import logging
import types

import pytest
import torch

import bertfast
from bertfast import dispatch
from bertfast.training import optim

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
LOWP = [torch.float16] + ([torch.bfloat16] if GPU else [])
FAST = ("foreach", "triton")
CAPTURABLE = "capturable"  # the triton implementation, capturable=True
# name: (shape, scale of the initial weights); decayed then not decayed.
DECAYED = {"w": ((7, 13), 0.1), "big": ((5, 64), 30.0), "zero_w": ((300,), 0.0), "no_grad": ((3, 3), 1.0)}
NOT_DECAYED = {"bias": ((33,), 0.1), "zero_g": ((64,), 0.1), "one": ((1,), 1.0), "empty": ((0,), 1.0),
               "exact": ((128,), 0.5)}

# The triton runs are the ones a GPU check should repeat on CUDA.
pytestmark = pytest.mark.gpu_capable


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


def _close(name, got, ref, dtype=torch.float32):
    """fp32: within 1e-6 of the tensor's largest value (an element that cancels, m = b1 m + (1 - b1) g
    say, carries the rounding of its terms). fp16/bf16: within one unit in the last place."""
    scale = ref.float().abs().max().item() if ref.numel() else 0.0
    if dtype == torch.float32:
        tol = dict(rtol=1e-6, atol=1e-6 * scale)
    else:
        tol = dict(rtol=torch.finfo(dtype).eps, atol=torch.finfo(dtype).eps * scale)
    torch.testing.assert_close(got, ref, **tol, msg=lambda m: f"{name}: {m}")


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


# --------------------------------------------------------------------------- LAMB against the reference
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


# --------------------------------------------------------------------------- checkpoints and determinism
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


# --------------------------------------------------------------------------- capturable
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


# --------------------------------------------------------------------------- choosing the implementation
def _fake_params(device_type, **extra):
    """Stand-ins with the attributes the choice reads (device, dtype): CUDA without a GPU."""
    return [types.SimpleNamespace(device=torch.device(device_type), dtype=torch.float32,
                                  is_floating_point=lambda: True, **extra)]


def test_default_and_forced_implementations(monkeypatch):
    monkeypatch.delenv(optim.LAMB_ENV, raising=False)
    cpu = [torch.nn.Parameter(torch.zeros(2, device="cpu"))]
    assert optim.Lamb(cpu).implementation == "foreach"                         # CPU: never the interpreter by default
    assert optim.Lamb(cpu, implementation="reference").implementation == "reference"
    monkeypatch.setenv(optim.LAMB_ENV, "reference")
    assert optim.Lamb(cpu).implementation == "reference"
    assert optim.Lamb(cpu, implementation="foreach").implementation == "foreach"  # the argument wins
    monkeypatch.setenv(optim.LAMB_ENV, "fastest")
    with pytest.raises(ValueError, match=r"BERTFAST_LAMB must be one of \['reference', 'foreach', 'triton'\], "
                                         r"got 'fastest'"):
        optim.Lamb(cpu)
    with pytest.raises(ValueError, match="implementation must be one of"):
        optim.Lamb(cpu, implementation="fused")
    monkeypatch.delenv(optim.LAMB_ENV)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="triton LAMB was forced but cannot run these parameters: CPU parameters "
                                         "need TRITON_INTERPRET=1"):
        optim.Lamb(cpu, implementation="triton")
    if optim.triton_lamb_availability()[0]:
        assert optim.lamb_implementation(None, _fake_params("cuda")) == "triton"
    # FSDP's DTensors: foreach (it reduces the norms across ranks), by design: not a fallback.
    assert optim.lamb_implementation(None, _fake_params("cuda", full_tensor=None)) == "foreach"
    with pytest.raises(ValueError, match="DTensors"):
        optim.lamb_implementation("triton", _fake_params("cuda", full_tensor=None))


def test_a_broken_triton_lamb_falls_back_visibly(monkeypatch, caplog):
    monkeypatch.delenv(optim.LAMB_ENV, raising=False)
    why = "import of bertfast.kernels.lamb failed: ImportError: a broken install"
    monkeypatch.setattr(optim, "triton_lamb_availability", lambda: (False, why))
    monkeypatch.delitem(dispatch.FALLBACKS, ("lamb", "triton"), raising=False)
    try:
        assert optim.lamb_implementation(None, _fake_params("cpu")) == "foreach"
        assert ("lamb", "triton") not in dispatch.FALLBACKS                     # CPU never wanted triton
        with caplog.at_level(logging.WARNING, logger="bertfast.optim"):
            assert optim.lamb_implementation(None, _fake_params("cuda")) == "foreach"
        assert "LAMB falls back from triton to foreach: " + why in caplog.text
        assert dispatch.FALLBACKS[("lamb", "triton")] == why
        from bertfast.info import report
        text = report()
        assert "lamb: triton skipped: " + why in text and "LAMB optimizer: foreach everywhere" in text
        with pytest.raises(ValueError, match="a broken install"):
            optim.lamb_implementation("triton", _fake_params("cuda"))
    finally:
        dispatch.FALLBACKS.pop(("lamb", "triton"), None)


def test_lamb_rejects_what_it_cannot_run():
    p = torch.nn.Parameter(torch.zeros(4, 4))
    p.grad = torch.zeros(4, 4).to_sparse()
    for implementation in ("reference", "foreach"):
        with pytest.raises(RuntimeError, match="sparse gradients"):
            optim.Lamb([p], implementation=implementation).step()
    with pytest.raises(ValueError, match="max_trust_ratio must be > 0 or None, got 0"):
        optim.Lamb([p], max_trust_ratio=0)
    from bertfast.kernels import lamb as kernels
    tensors = [torch.zeros(4, 4) for _ in range(4)]
    with pytest.raises(ValueError, match=r"gradient 0: expected a contiguous tensor, got shape \(4, 4\) with "
                                         r"strides \(1, 4\)"):
        kernels.check_lamb_tensors([tensors[0]], [tensors[1].t()], [tensors[2]], [tensors[3]])
    with pytest.raises(ValueError, match=r"exp_avg_sq 0: expected dtype in \['torch.float32'\], got torch.float16"):
        kernels.check_lamb_tensors([tensors[0]], [tensors[1]], [tensors[2]], [tensors[3].half()])


def test_build_optimizer_wires_both_optimizers(monkeypatch):
    monkeypatch.delenv(optim.LAMB_ENV, raising=False)
    model = bertfast.BertForPreTraining(bertfast.BertConfig.preset("tiny"))
    lamb = optim.build_optimizer(model, "lamb", 1e-3, implementation="reference")
    assert isinstance(lamb, optim.Lamb) and lamb.implementation == "reference"
    assert copy.deepcopy(lamb).implementation == "reference"                  # a copy keeps the forced choice
    assert [g["weight_decay"] for g in lamb.param_groups] == [0.01, 0.0]
    assert optim.build_optimizer(model, "lamb", 1e-3).implementation == "foreach"
    with pytest.raises(ValueError, match="fused= chooses AdamW's kernel"):
        optim.build_optimizer(model, "lamb", 1e-3, fused=True)
    with pytest.raises(ValueError, match="capturable= is LAMB's"):
        optim.build_optimizer(model, "adamw", 1e-3, capturable=True)
    with pytest.raises(ValueError, match="AdamW takes fused= or implementation=, not both"):
        optim.build_optimizer(model, "adamw", 1e-3, fused=True, implementation="triton")
    with pytest.raises(ValueError, match="working_dtype= is the triton AdamW's"):
        optim.build_optimizer(model, "lamb", 1e-3, working_dtype=torch.bfloat16)


def test_pretrain_optimizer_writes_working_copies_in_low_precision_only(monkeypatch):
    """`bertfast pretrain`'s optimizer (the bench's packed rows build theirs with it too): its
    settings' hyper-parameters; the triton AdamW (forced here, the interpreter on a CPU) writes bf16
    or fp16 working copies of the encoder's GEMM weights when the step runs in that precision, none
    in fp32; LAMB takes none."""
    _require_triton_adamw()
    from bertfast.training.config import PretrainConfig

    monkeypatch.setenv(optim.ADAMW_ENV, "triton")
    model = bertfast.BertForPreTraining(bertfast.BertConfig.preset("tiny")).to(DEVICE)
    args = PretrainConfig(lr=3e-4, weight_decay=0.02, beta1=0.8, adam_eps=1e-7)
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", None)):
        opt = optim.pretrain_optimizer(model, args, precision)
        assert isinstance(opt, optim.AdamW)
        assert (opt.working.dtype if opt.working is not None else None) == dtype, precision
        hyper = {(g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in opt.param_groups}
        assert hyper == {(3e-4, (0.8, 0.999), 1e-7, 0.02), (3e-4, (0.8, 0.999), 1e-7, 0.0)}
        if opt.working is not None:
            opt.working.release()
    lamb = optim.pretrain_optimizer(model, PretrainConfig(optimizer="lamb"), "bf16")
    assert isinstance(lamb, optim.Lamb) and not getattr(lamb, "working", None)


# --------------------------------------------------------------------------- AdamW
def test_adamw_is_triton_on_cuda_fused_where_torch_has_it_and_foreach_otherwise(monkeypatch):
    monkeypatch.delenv(optim.ADAMW_ENV, raising=False)
    model = torch.nn.Linear(4, 3).to(DEVICE)
    auto = optim.build_optimizer(model, "adamw", 1e-3)
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    if GPU and optim.triton_adamw_availability()[0]:
        assert isinstance(auto, optim.AdamW) and auto.implementation == "triton"
    else:
        assert type(auto) is torch.optim.AdamW
        assert auto.defaults["fused"] == (DEVICE.type in _get_fused_kernels_supported_devices())
    forced = optim.build_optimizer(model, "adamw", 1e-3, fused=False)
    assert not forced.defaults["fused"] and forced.defaults["foreach"]


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


# --------------------------------------------------------------------------- AdamW's triton implementation
def _require_triton_adamw():
    ok, why = optim.triton_adamw_availability()
    if not ok:
        pytest.skip(f"the triton AdamW is unavailable: {why}")


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
    from bertfast import working_weights

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


def test_triton_adamw_choice_and_refusals(monkeypatch):
    monkeypatch.delenv(optim.ADAMW_ENV, raising=False)
    cpu = [torch.nn.Parameter(torch.zeros(2))]
    assert optim.adamw_implementation(None, cpu) in ("fused", "foreach")     # CPU: never the interpreter
    monkeypatch.setenv(optim.ADAMW_ENV, "foreach")
    assert optim.adamw_implementation(None, cpu) == "foreach"
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU parameters run triton only under the interpreter
    assert optim.adamw_implementation("triton", cpu) == "triton"             # the argument wins
    monkeypatch.setenv(optim.ADAMW_ENV, "apex")
    with pytest.raises(ValueError, match=r"BERTFAST_ADAMW must be one of \['triton', 'fused', 'foreach'\], "
                                         r"got 'apex'"):
        optim.adamw_implementation(None, cpu)
    monkeypatch.delenv(optim.ADAMW_ENV)
    with pytest.raises(ValueError, match=r"needs fp32 parameters, got \['torch.float16'\]"):
        optim.adamw_implementation("triton", [torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))])
    with pytest.raises(ValueError, match="amsgrad and maximize are torch's AdamW's only"):
        optim.AdamW([{"params": cpu, "amsgrad": True}])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="triton AdamW was forced but cannot run these parameters: CPU parameters "
                                         "need TRITON_INTERPRET=1"):
        optim.adamw_implementation("triton", cpu)
    if optim.triton_adamw_availability()[0]:
        assert optim.adamw_implementation(None, _fake_params("cuda")) == "triton"
    assert optim.adamw_implementation(None, _fake_params("cuda", full_tensor=None)) != "triton"  # FSDP


def test_a_broken_triton_adamw_falls_back_visibly(monkeypatch, caplog):
    monkeypatch.delenv(optim.ADAMW_ENV, raising=False)
    why = "import of bertfast.kernels.adamw failed: ImportError: a broken install"
    monkeypatch.setattr(optim, "triton_adamw_availability", lambda: (False, why))
    monkeypatch.delitem(dispatch.FALLBACKS, ("adamw", "triton"), raising=False)
    try:
        with caplog.at_level(logging.WARNING, logger="bertfast.optim"):
            assert optim.adamw_implementation(None, _fake_params("cuda")) in ("fused", "foreach")
        assert "AdamW falls back from triton to torch's: " + why in caplog.text
        from bertfast.info import report
        text = report()
        assert "adamw: triton skipped: " + why in text and "AdamW optimizer: torch's fused or foreach" in text
    finally:
        dispatch.FALLBACKS.pop(("adamw", "triton"), None)


# --------------------------------------------------------------------------- the benchmark cases
def _bench_rows(ops, backends=("torch",)):
    from bertfast.bench import device, kernels_suite
    from bertfast.bench.common import SuiteContext
    from bertfast.bench.timing import TimingPolicy

    ctx = SuiteContext(device=device.detect("cpu"), quick=True, dtype=torch.float32, backends=backends,
                       compile=False, policy=TimingPolicy(cpu_warmup=0, cpu_reps=1), ops=ops, log=lambda text: None)
    return {(r.group, r.impl): r for r in kernels_suite.run(ctx)}


@pytest.mark.skipif(GPU, reason="the CPU case list (one tiny model); a GPU runs BERT's parameters")
def test_benchmark_cases_gate_then_time_both_optimizers(monkeypatch):
    """`bertfast bench --ops adamw,lamb` on CPU: each implementation passes the parity gate against
    the for-loop / reference step and is timed; a LAMB whose updates are 1% too large is refused."""
    rows = _bench_rows(("adamw", "lamb"))
    assert set(rows) == {("adamw", "torch fused"), ("adamw", "torch foreach"), ("adamw", "torch eager"),
                         ("lamb", "bertfast:torch foreach"), ("lamb", "torch eager")}
    for key, row in rows.items():
        assert row.direction == "step" and row.case["model"] == "micro", key
        assert row.ok and row.time_ms.median > 0 and row.metrics["gbps"].median > 0, (key, row.reason)

    right = optim._foreach_lamb

    def wrong(params, grads, exp_avgs, exp_avg_sqs, steps, group):
        right(params, grads, exp_avgs, exp_avg_sqs, steps, {**group, "lr": group["lr"] * 1.01})
    monkeypatch.setattr(optim, "_foreach_lamb", wrong)
    row = _bench_rows(("lamb",))[("lamb", "bertfast:torch foreach")]
    assert row.status == "FAILED PARITY" and row.time_ms is None and "step/lr: max error" in row.reason


@pytest.mark.skipif(GPU, reason="the CPU case list (one tiny model); a GPU runs BERT's parameters")
def test_benchmark_cases_gate_then_time_the_triton_optimizers():
    """Under the interpreter: the host-step and the capturable triton LAMB, and the triton AdamW,
    pass the gate and are timed."""
    _require("triton")
    _require_triton_adamw()
    rows = _bench_rows(("lamb", "adamw"), backends=("triton",))
    assert set(rows) == {("lamb", "bertfast:triton"), ("lamb", "bertfast:triton capturable"), ("lamb", "torch eager"),
                         ("adamw", "bertfast:triton"), ("adamw", "torch fused"), ("adamw", "torch foreach"),
                         ("adamw", "torch eager")}
    for key, row in rows.items():
        assert row.ok and row.time_ms.median > 0, (key, row.reason)
