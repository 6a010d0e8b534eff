"""Which implementation LAMB and AdamW run (defaults, BERTFAST_LAMB / BERTFAST_ADAMW, the argument),
what they refuse, their visible fallback when triton is broken, and how build_optimizer and
pretrain_optimizer wire them: a wrong choice would train correctly but slowly, or not at all."""
import copy
import logging
import types

import pytest
import torch

import bertfast
from bertfast import dispatch
from bertfast.training import optim
from optim_helpers import DEVICE, GPU, _require_triton_adamw


# The triton runs are the ones a GPU check should repeat on CUDA.
pytestmark = pytest.mark.gpu_capable


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
