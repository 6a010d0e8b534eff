"""The bench's parity gate: its fp32 and low-precision rule, and the suites refusing to time a backend,
a model or a packed step that disagrees with the reference, so a wrong result never shows as a speed."""
from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

from bertfast.bench import report
from bertfast.bench.gate import compare
from bertfast.bench.results import FAILED_PARITY, OK, TORCH_EAGER, Run
from bench_helpers import _cpu_ctx


def test_a_packed_pretrain_step_that_disagrees_is_not_timed(monkeypatch):
    from bertfast.bench import model_suite
    from bertfast.bench.results import BERTFAST_STATIC

    real = model_suite.packed_pretrain_batch

    def shifted(batch):  # the packed row loses its NSP labels: its loss is no longer the padded batch's
        packed = real(batch)
        packed["next_sentence_label"] = torch.full_like(packed["next_sentence_label"], -100)
        return packed

    monkeypatch.setattr(model_suite, "packed_pretrain_batch", shifted)
    rows = model_suite.run(_cpu_ctx(models=("pretrain",), impls=("bertfast", "static-shapes")))
    static = next(r for r in rows if r.impl == BERTFAST_STATIC)
    assert static.status == FAILED_PARITY and "packed_vs_padded_loss_rel_diff" in static.reason


def test_a_parity_gate_that_cannot_run_is_an_error_not_a_parity_failure(monkeypatch):
    """The H100 run of 2026-11-26 reported BERT-large seq-512's packed steps as FAILED PARITY when
    their fp32 gate ran out of memory: the gate gave no verdict, and the row says so."""
    from bertfast.bench import model_suite
    from bertfast.bench.results import BERTFAST_STATIC, ERROR

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1024.00 MiB")

    monkeypatch.setattr(model_suite, "parity_packed", out_of_memory)
    rows = model_suite.run(_cpu_ctx(models=("pretrain",), impls=("bertfast", "static-shapes")))
    by_impl = {r.impl: r for r in rows}
    static = by_impl[BERTFAST_STATIC]
    assert static.status == ERROR and static.time_ms is None
    assert static.reason.startswith("while checking parity: OutOfMemoryError: CUDA out of memory"), static.reason
    assert by_impl["bertfast"].ok  # the padded gate ran and passed: that row is timed


def test_gate_fp32_and_low_precision_rule():
    ref = {"y": torch.linspace(-1, 1, 50)}
    assert compare({"y": ref["y"].clone()}, ref).ok
    bad = compare({"y": ref["y"] + 1e-2}, ref)
    assert not bad.ok and "y: max error" in bad.message
    nan = ref["y"].clone()
    nan[3] = float("nan")
    assert "NaN" in compare({"y": nan}, ref).message
    assert "missing" in compare({}, ref).message
    # low precision: fast error up to 2x the reference's own low-precision error passes.
    lowp = {"y": ref["y"] + 1e-3}
    assert compare({"y": ref["y"] - 1.9e-3}, ref, lowp).ok
    assert not compare({"y": ref["y"] - 2.5e-3}, ref, lowp).ok


@pytest.fixture
def wrong_cuda_backend(monkeypatch):
    """A 'cuda' backend of bias_gelu that runs anywhere and computes 1.5 x GELU(x + b)."""
    from bertfast import dispatch
    torch_backend = importlib.import_module("bertfast.ops.bias_gelu")  # the module, not the function

    module = types.ModuleType("bertfast_bench_wrong_backend")
    module.bias_gelu_fwd = lambda x, bias, approximate: 1.5 * torch_backend.bias_gelu_fwd(x, bias, approximate)
    module.bias_gelu_bwd = torch_backend.bias_gelu_bwd
    monkeypatch.setitem(sys.modules, module.__name__, module)
    original = dispatch.backends("bias_gelu")["cuda"]
    dispatch.register_backend(dispatch.Backend("bias_gelu", "cuda", module.__name__,
                                               lambda forced, **inputs: []))
    yield
    dispatch.register_backend(original)


def test_kernel_suite_refuses_to_time_a_wrong_backend(wrong_cuda_backend):
    from bertfast.bench import kernels_suite
    ctx = _cpu_ctx(backends=("cuda", "torch"), ops=("bias_gelu",))
    rows = kernels_suite.run(ctx)
    wrong = [r for r in rows if r.impl == "bertfast:cuda"]
    assert [r.direction for r in wrong] == ["fwd", "bwd", "fwd+bwd"]
    for r in wrong:
        assert r.status == FAILED_PARITY and r.time_ms is None and not r.metrics
        assert "y: max error" in r.reason
    good = [r for r in rows if r.impl in ("bertfast:torch", TORCH_EAGER)]
    assert len(good) == 6 and all(r.status == OK and r.time_ms.median > 0 for r in good)
    assert all(r.metrics["gbps"].median > 0 for r in good)
    run = Run(device=ctx.device, config={}, rows=rows)
    md = report.markdown(run)
    assert md.count("**FAILED PARITY**") == 3


def test_model_suite_refuses_to_time_a_fast_model_on_a_wrong_backend(wrong_cuda_backend):
    from bertfast.bench import model_suite
    ctx = _cpu_ctx(models=("inference",))
    rows = model_suite.run(ctx)
    fast = [r for r in rows if r.impl == "bertfast"]
    assert fast and all(r.status == FAILED_PARITY and r.time_ms is None for r in fast)
    assert "disagrees with the reference" in fast[0].reason
    ref = [r for r in rows if r.impl == "bertfast reference"]
    assert ref and all(r.ok for r in ref)


def test_dropout_case_is_timed_only_after_the_p0_gate(wrong_layernorm_backend):
    from bertfast.bench import kernels_suite
    ctx = _cpu_ctx(backends=("cuda", "torch"), ops=("bias_dropout_residual_layernorm",))
    rows = kernels_suite.run(ctx)
    dropout = [r for r in rows if r.case["dropout"] == 0.1]
    wrong = [r for r in dropout if r.impl == "bertfast:cuda"]
    assert len(wrong) == 3 and all(r.status == FAILED_PARITY and r.reason.startswith("at p = 0: y: max error")
                                   for r in wrong)
    good = [r for r in dropout if r.impl == "bertfast:torch"]
    assert len(good) == 3 and all(r.ok for r in good)
    assert all(r.parity["gate"].startswith("p=0 on the same inputs") and r.parity["ok"] for r in good)


@pytest.fixture
def wrong_layernorm_backend(monkeypatch):
    """A 'cuda' backend of the residual LayerNorm that runs anywhere and adds 0.1 to the output."""
    from bertfast import dispatch
    torch_backend = importlib.import_module("bertfast.ops.bias_dropout_residual_layernorm")

    module = types.ModuleType("bertfast_bench_wrong_layernorm")

    def fwd(*args, **kwargs):
        y, *rest = torch_backend.bias_dropout_residual_layernorm_fwd(*args, **kwargs)
        return (y + 0.1, *rest)
    module.bias_dropout_residual_layernorm_fwd = fwd
    module.bias_dropout_residual_layernorm_bwd = torch_backend.bias_dropout_residual_layernorm_bwd
    monkeypatch.setitem(sys.modules, module.__name__, module)
    op = "bias_dropout_residual_layernorm"
    original = dispatch.backends(op)["cuda"]
    dispatch.register_backend(dispatch.Backend(op, "cuda", module.__name__, lambda forced, **inputs: []))
    yield
    dispatch.register_backend(original)
