"""bertfast.parity: a healthy model passes; a subtly wrong backend is caught and named."""
import importlib
import sys
import types

import pytest
import torch

import bertfast
from bertfast import dispatch
from bertfast.parity import random_batch
from bertfast.parity import check_batch


@pytest.fixture
def model_and_batch():
    torch.manual_seed(0)
    model = bertfast.BertForPreTraining(bertfast.BertConfig.preset("tiny", num_hidden_layers=2))
    batch = random_batch(model.config, 4, 16, torch.device("cpu"), torch.Generator().manual_seed(3))
    return model, batch


def test_healthy_model_passes_and_state_is_untouched(model_and_batch):
    model, batch = model_and_batch
    model.train()
    report = check_batch(model, batch)
    assert report.ok and report.first_divergent_op is None
    assert report.loss_abs_diff < 1e-5 and report.grad_norm_rel_diff < 1e-5
    assert model.training and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("op, fwd, wrong", [
    ("bias_gelu", "bias_gelu_fwd", lambda f: lambda x, b, a: f(x, b, a) * 1.1),
    ("embeddings", "embeddings_fwd", lambda f: lambda *a, **k: (f(*a, **k)[0] * 1.02,) + tuple(f(*a, **k)[1:])),
])
def test_subtly_wrong_backend_is_caught_and_named(model_and_batch, monkeypatch, op, fwd, wrong):
    model, batch = model_and_batch
    name = f"bertfast_test_wrong_{op}"
    bad = types.ModuleType(name)
    torch_backend = importlib.import_module(f"bertfast.ops.{op}")  # the op's torch backend
    for attr in dir(torch_backend):
        if not attr.startswith("__"):
            setattr(bad, attr, getattr(torch_backend, attr))
    setattr(bad, fwd, wrong(getattr(torch_backend, fwd)))
    monkeypatch.setitem(sys.modules, name, bad)
    original = dispatch.get(op, "triton")
    dispatch.register_backend(dispatch.Backend(op, "triton", name, lambda forced, **inputs: []))
    try:
        report = check_batch(model, batch)
    finally:
        dispatch.register_backend(original)
    assert not report.ok
    assert report.first_divergent_op == op
