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
        dispatch.clear_cache()


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
        dispatch.clear_cache()
        dispatch.FALLBACKS.pop(("bias_gelu", "triton"), None)


def test_info_lists_every_op_and_backend():
    from bertfast.info import report

    text = report()
    for op in dispatch.ops():
        assert op in text
    assert "torch  ok" in text and "triton" in text and "cuda" in text


def test_info_says_what_each_attention_backend_runs():
    """Issue 39: `bertfast info` names each attention backend's kernels (its module's KERNELS)."""
    from bertfast.info import report

    text = report()
    shown = 0
    for name, backend in dispatch.backends("attention_varlen").items():
        if backend.availability()[0]:
            assert f"    {name} kernels: {backend.impl.KERNELS}" in text
            shown += 1
    assert shown >= 1  # torch, at least
    if dispatch.backends("attention_varlen")["cuda"].availability()[0]:
        assert "cuda kernels: forward: mma.sync m16n8k16" in text


def test_info_says_how_gemm_weight_gradients_are_accumulated(monkeypatch):
    """`bertfast info` says whether TrainStep's accumulation adds the GEMM weights' gradients in their
    GEMMs on this GPU (the fp32-input addmm torch has there, or not) or that there is no GPU."""
    from bertfast.info import report
    from bertfast.model import residual_linear

    line = next(line for line in report().splitlines() if line.startswith("GEMM weight gradients"))
    if not torch.cuda.is_available():
        assert "no GPU here" in line
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for caps, said in (((True, True), "added in place by the weight-gradient GEMMs"),
                       ((False, True), "added by autograd (this torch's CUDA addmm takes no fp32 input")):
        monkeypatch.setattr(residual_linear, "fp32_gemm_caps", lambda device, dtype, caps=caps: caps)
        assert said in residual_linear.weight_grad_summary()


def test_measured_preference_reorders_fast_backends_per_gpu(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from bertfast.bench.preference import measured_order, record
    from bertfast.bench.results import Row, Run
    from bertfast.bench.timing import Stat

    def row(impl, ms, case, group="embeddings"):
        return Row("kernels", group, case, "fwd+bwd", impl, time_ms=Stat(median=ms, p20=ms, p80=ms, n=3))

    rows = [row("bertfast:triton", 2.0, {"h": 768}), row("bertfast:cuda", 1.0, {"h": 768}),
            row("bertfast:triton", 3.0, {"h": 1024}), row("bertfast:cuda", 2.0, {"h": 1024}),
            row("bertfast:triton", 1.0, {"h": 64})]  # only on one backend: not compared
    run = Run(device=SimpleNamespace(kind="cuda", name="Test GPU"), config={}, rows=rows)
    assert measured_order(run) == {"embeddings": ["cuda", "triton"]}
    # bias_gelu is decided by the FFN's case, where training runs it (on Triton inside the GEMMs): its
    # row kernel's times alone decide nothing, the FFN's do.
    gelu = [row(impl, ms, {"h": 768}, "bias_gelu") for impl, ms in (("bertfast:triton", 2.0), ("bertfast:cuda", 1.0))]
    assert measured_order(Run(device=run.device, config={}, rows=gelu)) == {}
    ffn = [row(impl, ms, {"h": 768}, "ffn") for impl, ms in (("bertfast:triton", 5.0), ("bertfast:cuda", 4.0))]
    assert measured_order(Run(device=run.device, config={}, rows=gelu + ffn)) == {"bias_gelu": ["cuda", "triton"]}
    ffn = [row(impl, ms, {"h": 768}, "ffn") for impl, ms in (("bertfast:triton", 4.0), ("bertfast:cuda", 5.0))]
    assert measured_order(Run(device=run.device, config={}, rows=gelu + ffn)) == {"bias_gelu": ["triton", "cuda"]}
    path = tmp_path / "pref.json"
    monkeypatch.setenv("BERTFAST_PREFERENCE_FILE", str(path))
    assert record(run) == str(path)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: asked.append(device) or "Test GPU")
    try:
        cuda = torch.device("cuda", 0)
        assert dispatch.preference("embeddings", cuda) == ("cuda", "triton", "torch")
        assert dispatch.preference("bias_gelu", cuda) == dispatch.PREFERENCE
        assert dispatch.preference("embeddings", torch.device("cpu")) == dispatch.PREFERENCE
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


# --------------------------------------------------------------------------- the decision cache
class Counting:
    """A backend's reasons function that counts its calls (a fresh decision asks it again)."""

    def __init__(self, reasons):
        self.reasons, self.calls = reasons, 0

    def __call__(self, forced, **inputs):
        self.calls += 1
        return list(self.reasons)


@pytest.fixture
def counted(monkeypatch):
    """bias_gelu with counting torch (runs anything) and triton (runs nothing) backends; the real
    table is put back afterwards. The cuda backend is left out: nothing else is asked."""
    table = dict(dispatch.backends("bias_gelu"))
    torch_reasons, triton_reasons = Counting([]), Counting(["pretend triton cannot"])
    try:
        dispatch._REGISTRY["bias_gelu"] = {}
        dispatch.register_backend(Backend("bias_gelu", "torch", "bertfast.ops.bias_gelu", torch_reasons))
        dispatch.register_backend(Backend("bias_gelu", "triton", "bertfast.ops.bias_gelu", triton_reasons))
        yield torch_reasons, triton_reasons
    finally:
        dispatch._REGISTRY["bias_gelu"] = table
        dispatch.clear_cache()


def _select(x, b):
    return dispatch.select("bias_gelu", x=x, bias=b)


def test_a_repeated_choice_asks_no_backend_again(counted):
    torch_reasons, triton_reasons = counted
    x, b = torch.randn(4, 8), torch.randn(8)
    assert _select(x, b) == "torch"
    assert (torch_reasons.calls, triton_reasons.calls) == (1, 1)
    for _ in range(3):  # other tensors with the same metadata: hits
        assert _select(torch.randn(4, 8), torch.randn(8)) == "torch"
    assert (torch_reasons.calls, triton_reasons.calls) == (1, 1)


@pytest.mark.parametrize("change", ["rows", "width", "dtype", "device", "bias absent"])
def test_other_metadata_is_a_fresh_choice(counted, change):
    _, triton_reasons = counted
    x, b = torch.randn(4, 8), torch.randn(8)
    _select(x, b)
    other = {"rows": (torch.randn(5, 8), b),  # the leading size is part of the key (CUDA attention reads it)
             "width": (torch.randn(4, 16), torch.randn(16)),
             "dtype": (x.double(), b),
             "device": (torch.empty(4, 8, device="meta"), b),
             "bias absent": (x, None)}[change]
    _select(*other)
    assert triton_reasons.calls == 2
    _select(*other)
    assert triton_reasons.calls == 2


def test_forced_backend_is_part_of_the_key(counted, monkeypatch):
    torch_reasons, triton_reasons = counted
    x, b = torch.randn(4, 8), torch.randn(8)
    assert _select(x, b) == "torch"
    with dispatch.use_backend("torch"):
        assert _select(x, b) == "torch"
        assert _select(x, b) == "torch"
    assert (torch_reasons.calls, triton_reasons.calls) == (2, 1)  # one forced decision, then a hit
    monkeypatch.setenv("BERTFAST_BACKEND_BIAS_GELU", "triton")
    with pytest.raises(NoBackendError, match="pretend triton cannot"):
        _select(x, b)
    monkeypatch.setenv("BERTFAST_BACKEND_BIAS_GELU", "torch")  # torch forced again, another way: a hit
    assert _select(x, b) == "torch"
    assert (torch_reasons.calls, triton_reasons.calls) == (2, 2)


def test_errors_are_not_cached(counted):
    _, triton_reasons = counted
    x, b = torch.randn(4, 8), torch.randn(8)
    with dispatch.use_backend("triton"):
        for expected_calls in (1, 2, 3):
            with pytest.raises(NoBackendError, match="forced for op 'bias_gelu'"):
                _select(x, b)
            assert triton_reasons.calls == expected_calls
    assert not any(key[0] == "bias_gelu" and key[1] == "triton" for key in dispatch._CACHE)


def test_register_backend_clears_the_cache(counted):
    x, b = torch.randn(4, 8), torch.randn(8)
    assert _select(x, b) == "torch"
    dispatch.register_backend(Backend("bias_gelu", "triton", "bertfast.ops.bias_gelu", lambda forced, **t: []))
    assert _select(x, b) == "triton"  # not the cached "torch"


@pytest.mark.parametrize("change", ["TRITON_INTERPRET", "backend state", "availability reset", "reload"])
def test_what_else_a_choice_reads_gives_a_fresh_choice(counted, monkeypatch, change):
    _, triton_reasons = counted
    state = {"device type": "cuda"}
    monkeypatch.setattr(dispatch.get("bias_gelu", "triton"), "state_fn", lambda: state["device type"])
    x, b = torch.randn(4, 8), torch.randn(8)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _select(x, b)
    assert triton_reasons.calls == 1
    if change == "TRITON_INTERPRET":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    elif change == "backend state":
        state["device type"] = "cpu"  # as the CUDA emulator tests set the cuda backend's
    elif change == "availability reset":
        monkeypatch.setattr(dispatch.get("bias_gelu", "triton"), "_available", None)
    else:
        dispatch.reload_preferences()
    _select(x, b)
    assert triton_reasons.calls == 2


def test_the_cuda_backends_state_is_the_device_type_it_takes(monkeypatch):
    from bertfast.cuda import _common

    backend = dispatch.get("bias_gelu", "cuda")
    assert backend.state_fn() == "cuda"
    monkeypatch.setattr(_common, "DEVICE_TYPE", "cpu")  # what the CUDA emulator tests do
    assert backend.state_fn() == "cpu"
    assert dispatch.device_reasons("cuda", False, {"x": torch.empty(2, 8)}) == []


def test_the_cache_is_bounded_least_recently_used_first(counted, monkeypatch):
    _, triton_reasons = counted
    monkeypatch.setattr(dispatch, "CACHE_SIZE", 3)
    dispatch.clear_cache()
    b = torch.randn(8)
    for rows in (1, 2, 3):
        _select(torch.randn(rows, 8), b)
    _select(torch.randn(1, 8), b)  # rows=1 is now the most recently used
    _select(torch.randn(4, 8), b)  # drops rows=2
    assert len(dispatch._CACHE) == 3 and triton_reasons.calls == 4
    _select(torch.randn(1, 8), b)
    assert triton_reasons.calls == 4
    _select(torch.randn(2, 8), b)
    assert triton_reasons.calls == 5


def test_a_cached_choice_still_records_its_fallback(monkeypatch, caplog):
    """A CUDA input skipping a broken backend: warned and recorded on the first (uncached) decision."""
    class OnCuda(torch.Tensor):  # CUDA metadata without a GPU: dispatch reads only the metadata
        device = property(lambda self: torch.device("cuda", 0))

    def on_cuda(*shape):
        return torch.Tensor._make_subclass(OnCuda, torch.empty(*shape))

    table = dict(dispatch.backends("bias_gelu"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    monkeypatch.setenv("BERTFAST_PREFERENCE_FILE", "/nonexistent/bertfast-preference.json")
    dispatch.reload_preferences()
    try:
        dispatch.register_backend(Backend("bias_gelu", "triton", "bertfast.kernels.does_not_exist",
                                          lambda forced, **t: []))
        dispatch.register_backend(Backend("bias_gelu", "cuda", "bertfast.ops.bias_gelu",
                                          lambda forced, **t: ["pretend cuda cannot"]))
        dispatch.FALLBACKS.pop(("bias_gelu", "triton"), None)
        x, b = on_cuda(4, 8), on_cuda(8)
        with caplog.at_level(logging.WARNING, logger="bertfast.dispatch"):
            assert _select(x, b) == "torch"
            assert _select(x, b) == "torch"
        assert "does_not_exist" in dispatch.FALLBACKS[("bias_gelu", "triton")]
        assert caplog.text.count("falls back from triton to torch") == 1
    finally:
        dispatch._REGISTRY["bias_gelu"] = table
        dispatch.reload_preferences()
        dispatch.FALLBACKS.pop(("bias_gelu", "triton"), None)
