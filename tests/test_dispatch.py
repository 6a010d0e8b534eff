"""Backend selection: defaults, forcing, clear errors, visible fallbacks, `bertfast info`."""
import logging

import pytest
import torch

import bertfast.ops as ops
from bertfast import dispatch
from bertfast.dispatch import Backend, NoBackendError


def test_cpu_inputs_pick_the_torch_backend_by_default():
    x = torch.randn(4, 8)
    assert dispatch.select("bias_gelu", x=x, bias=torch.randn(8)) == "torch"


def test_forcing_triton_on_cpu_runs_the_interpreter_and_matches():
    x, b = torch.randn(4, 8), torch.randn(8)
    with dispatch.use_backend("triton"):
        assert dispatch.select("bias_gelu", x=x, bias=b) == "triton"
        y = ops.bias_gelu(x, b)
    torch.testing.assert_close(y, ops.bias_gelu(x, b), atol=1e-6, rtol=0)


def test_forced_backend_that_cannot_run_raises_with_reasons():
    with dispatch.use_backend("cuda"), pytest.raises(NoBackendError, match="forced for op 'bias_gelu'"):
        ops.bias_gelu(torch.randn(2, 4), torch.randn(4))


def test_env_override_per_op(monkeypatch):
    monkeypatch.setenv("BERTFAST_BACKEND_BIAS_GELU", "cuda")
    assert dispatch.forced_backend("bias_gelu") == "cuda"
    assert dispatch.forced_backend("embeddings") is None
    monkeypatch.setenv("BERTFAST_BACKEND", "bogus")
    with pytest.raises(ValueError, match="must be one of"):
        dispatch.forced_backend("embeddings")


def test_no_backend_error_lists_every_backend():
    table = dict(dispatch.backends("bias_gelu"))
    try:
        dispatch.register_backend(Backend("bias_gelu", "torch", "bertfast.ops.bias_gelu",
                                          lambda forced, **t: ["pretend torch cannot"]))
        with pytest.raises(NoBackendError) as err:
            dispatch.select("bias_gelu", x=torch.randn(2, 4), bias=torch.randn(4))
        message = str(err.value)
        assert "pretend torch cannot" in message and "triton:" in message and "cuda:" in message
    finally:
        dispatch._REGISTRY["bias_gelu"] = table


def test_broken_backend_module_is_reported_not_hidden(caplog):
    table = dict(dispatch.backends("bias_gelu"))
    try:
        broken = Backend("bias_gelu", "triton", "bertfast.kernels.does_not_exist", lambda forced, **t: [])
        dispatch.register_backend(broken)
        ok, reason = broken.availability()
        assert not ok and "does_not_exist" in reason
        # What select() does when a CUDA input skips a broken backend: a warning, recorded for `bertfast info`.
        with caplog.at_level(logging.WARNING, logger="bertfast.dispatch"):
            dispatch._note_fallbacks("bias_gelu", "torch", {"triton": [reason]})
        assert ("bias_gelu", "triton") in dispatch.FALLBACKS
        assert "falls back from triton to torch" in caplog.text
        from bertfast.info import report
        assert "bias_gelu: triton skipped" in report()
    finally:
        dispatch._REGISTRY["bias_gelu"] = table
        dispatch.FALLBACKS.pop(("bias_gelu", "triton"), None)


def test_info_lists_every_op_and_backend():
    from bertfast.info import report

    text = report()
    for op in dispatch.ops():
        assert op in text
    assert "torch  ok" in text and "triton" in text and "cuda" in text


def test_measured_preference_reorders_fast_backends_per_gpu(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from bertfast.bench.preference import measured_order, record
    from bertfast.bench.results import Row, Run
    from bertfast.bench.timing import Stat

    def row(impl, ms, case):
        return Row("kernels", "bias_gelu", case, "fwd+bwd", impl, time_ms=Stat(median=ms, p20=ms, p80=ms, n=3))

    rows = [row("bertfast:triton", 2.0, {"h": 768}), row("bertfast:cuda", 1.0, {"h": 768}),
            row("bertfast:triton", 3.0, {"h": 1024}), row("bertfast:cuda", 2.0, {"h": 1024}),
            row("bertfast:triton", 1.0, {"h": 64})]  # only on one backend: not compared
    run = Run(device=SimpleNamespace(kind="cuda", name="Test GPU"), config={}, rows=rows)
    assert measured_order(run) == {"bias_gelu": ["cuda", "triton"]}
    path = tmp_path / "pref.json"
    monkeypatch.setenv("BERTFAST_PREFERENCE_FILE", str(path))
    assert record(run) == str(path)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: asked.append(device) or "Test GPU")
    try:
        cuda = torch.device("cuda", 0)
        assert dispatch.preference("bias_gelu", cuda) == ("cuda", "triton", "torch")
        assert dispatch.preference("embeddings", cuda) == dispatch.PREFERENCE
        assert dispatch.preference("bias_gelu", torch.device("cpu")) == dispatch.PREFERENCE
        assert asked == [0]  # the name is asked once per device, not on every op call (host overhead)
    finally:
        dispatch.reload_preferences()


def test_cli_reports_a_missing_optional_dependency_in_one_line(monkeypatch, capsys):
    import importlib

    from bertfast import cli

    def fake_import(name):
        raise ImportError("bertfast data preparation needs the 'tokenizers' package (pip install 'bertfast[train]')")

    monkeypatch.setattr(importlib, "import_module", fake_import)
    assert cli.main(["prepare"]) == 2
    assert "pip install 'bertfast[train]'" in capsys.readouterr().err
    monkeypatch.setattr(importlib, "import_module", lambda name: (_ for _ in ()).throw(ImportError("a real bug")))
    with pytest.raises(ImportError, match="a real bug"):
        cli.main(["prepare"])
