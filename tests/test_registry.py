"""bertfast.registry, the list of ops: every name in it resolves, every op has its files and its row
in docs/ops.md, and an op registered with its files reaches every reader (dispatch, the kernel and
overhead suites, the backend preference, ncu, parity, bertfast info, the sanitizer, the compile
report, the GPU check's sizing and the perf model)."""
from __future__ import annotations

import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bertfast import dispatch, registry
from bench_helpers import _cpu_ctx

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("op", registry.names())
def test_every_hook_names_a_function(op):
    spec = registry.get(op)
    refs = [*spec.bench.values(), *spec.overhead.values(), *spec.sanitize.values()]
    refs += [spec.launches] if spec.launches else []
    assert spec.bench, f"{op}: no kernel-suite case"
    for ref in refs:
        assert callable(registry.resolve(ref)), ref
    if spec.preference_case is not None:
        assert spec.preference_case in spec.bench


@pytest.mark.parametrize("op", registry.names())
def test_every_op_has_its_files(op):
    spec = registry.get(op)
    assert (ROOT / "kernels" / f"{op}.py").is_file()
    if not spec.forms:  # the optimizers: Triton kernels alone
        return
    for path in (f"bertfast/ops/{op}.py", f"bertfast/cuda/{op}.py", f"tests/ops/test_{op}.py"):
        assert (ROOT / path).is_file(), path
    assert list((ROOT / "csrc").glob(f"{op}*.cu")), f"csrc/{op}*.cu"
    assert spec.launchers and spec.sanitize and spec.overhead and spec.launches


def test_docs_ops_table_lists_every_op_with_forms():
    text = (ROOT / "docs" / "ops.md").read_text()
    table = text.split("## The contract every backend keeps")[0]
    listed = re.findall(r"^\| `(\w+)`", table, flags=re.M)
    assert listed == [op.name for op in registry.ops() if op.forms]


def test_the_list_rejects_what_it_cannot_serve():
    with pytest.raises(ValueError, match="kind must be one of"):
        registry.Op("x", "rows")
    with pytest.raises(ValueError, match="no dispatch forms"):
        registry.Op("x", registry.OPTIMIZER, forms=(registry.Form("x", {}),))
    with pytest.raises(ValueError, match="already belongs to op 'attention'"):
        registry.register(registry.Op("other", registry.ROW, forms=(registry.Form("attention_varlen", {}),)))
    with pytest.raises(ValueError, match="package.module:function"):
        registry.resolve("bertfast.bench.kernel_cases")
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        registry.get("nope")


# ---------------------------------------------------------------- a new op, registered with its files
TOY = "toy_scale"
TOY_MODULE = "bertfast_test_toy_scale"
TOY_SOURCE = '''
"""A toy op, y = 2 x + bias, with what an op brings: its backends' launchers, a kernel-suite case,
an overhead case, a sanitizer call and a compile-report launch function."""
import torch

from bertfast import dispatch

CALLS = {"launches": 0}


def toy_scale_fwd(x, bias):
    return 2 * x + bias


def unsupported(inputs):  # the toy's "fused" backends run nothing
    return ["the toy op has no fused kernel"]


def toy_scale(x, bias):
    name = dispatch.select("toy_scale", x=x, bias=bias)
    return dispatch.get("toy_scale", name).impl.toy_scale_fwd(x, bias)


def _data():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=gen), torch.randn(8, generator=gen), torch.randn(4, 8, generator=gen)


def toy_scale_cases(ctx):
    from bertfast.bench.kernel_cases import Impl, OpCase, Prepared
    from bertfast.bench.results import TORCH_EAGER, bertfast_impl
    from bertfast.ops import use_backend

    x, b, dy = _data()

    def path(fn, backend=None):
        def build(dtype):
            leaves = [x.to(dtype).requires_grad_(), b.to(dtype).requires_grad_()]

            def forward():
                if backend is None:
                    return fn(*leaves)
                with use_backend({"toy_scale": backend}):
                    return fn(*leaves)
            return Prepared(leaves, forward, dy.to(dtype),
                            lambda out, grads: {"y": out, "dx": grads[0], "dbias": grads[1]})
        return build

    reference = path(lambda x, b: 2 * x + b)
    impls = [Impl(bertfast_impl(name), path(toy_scale, name)) for name in ctx.backends]
    impls.append(Impl(TORCH_EAGER, reference))
    return [OpCase("toy_scale", {"tokens": 4, "hidden": 8}, reference, impls, lambda d: {"bytes": 4 * 3 * 32})]


def toy_scale_overhead_case(gen, dtype, device):
    from bertfast.bench.overhead_suite import OverheadCase
    x = torch.randn(4, 8, generator=gen).to(dtype=dtype, device=device).requires_grad_()
    b = torch.randn(8, generator=gen).to(dtype=dtype, device=device).requires_grad_()
    return OverheadCase("toy_scale", "toy_scale", {"rows": 4, "h": 8}, {"x": x, "bias": b}, [x, b],
                        lambda: toy_scale(x, b), lambda: 2 * x + b)


def toy_scale_sanitize(device, dtype):
    x, b, _ = _data()
    x = x.to(device=device, dtype=dtype).requires_grad_()
    y = toy_scale(x, b.to(device=device, dtype=dtype))
    return [y, torch.autograd.grad(y.sum(), x)[0]]


def toy_scale_launches(setting):
    CALLS["launches"] += 1
'''


@pytest.fixture
def toy_op(tmp_path, monkeypatch):
    (tmp_path / f"{TOY_MODULE}.py").write_text(textwrap.dedent(TOY_SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, TOY_MODULE, raising=False)
    op = registry.Op(
        TOY, registry.ROW,
        forms=(registry.Form(TOY, {"x": registry.act(8, 16), "bias": registry.act(16)}),),
        launchers=("toy_scale_fwd",),
        bench={TOY: f"{TOY_MODULE}:toy_scale_cases"},
        overhead={TOY: f"{TOY_MODULE}:toy_scale_overhead_case"},
        sanitize={TOY: f"{TOY_MODULE}:toy_scale_sanitize"},
        launches=f"{TOY_MODULE}:toy_scale_launches",
        profile_case={"tokens": 4, "hidden": 8},
        modules={backend: TOY_MODULE for backend in registry.BACKENDS})
    with registry.registered(op):
        yield op
    assert TOY not in dispatch.ops()  # gone with the block, from dispatch too
    dispatch.clear_cache()


def test_a_registered_op_reaches_dispatch_info_and_parity(toy_op, monkeypatch):
    from bertfast import info, parity
    assert dispatch.ops()[-1] == TOY
    x, b = torch.randn(3, 5), torch.randn(5)
    assert dispatch.select(TOY, x=x, bias=b) == "torch"
    pytest.importorskip("triton")
    with dispatch.use_backend({TOY: "triton"}), pytest.raises(dispatch.NoBackendError, match="no fused kernel"):
        dispatch.select(TOY, x=x, bias=b)  # the interpreter would run it: the module's limits refuse
    assert registry.step_forms()[-1] == TOY
    alone = []  # the op each of parity's runs leaves on its selected backend, every other forced to torch

    def signature(model, batch):
        forced = dispatch._OVERRIDES[-1]
        alone.append(next((f for f in dispatch.ops() if forced.get(f, forced.get("*")) != "torch"), None))
        return [torch.zeros(1)]
    monkeypatch.setattr(parity, "_signature", signature)
    parity.first_divergent_op(None, {})
    assert alone == [None, *registry.step_forms()] and alone[-1] == TOY
    report = info.report()
    section = report.split(f"  {TOY}\n", 1)[1]
    assert section.splitlines()[0].strip() == "cpu/float32: -> torch"


def test_a_registered_op_reaches_the_benchmarks(toy_op, monkeypatch):
    from bertfast.bench import kernels_suite, ncu, overhead_suite
    ctx = _cpu_ctx(ops=(TOY,))
    rows = kernels_suite.run(ctx)
    assert {r.group for r in rows} == {TOY}
    assert all(r.ok for r in rows), [(r.impl, r.direction, r.status, r.reason) for r in rows if not r.ok]
    assert {r.impl for r in rows} == {"bertfast:torch", "torch eager"}
    monkeypatch.setattr(overhead_suite, "_timing_counts", lambda ctx: (1, 2, 3))
    rows = overhead_suite.run(_cpu_ctx(ops=(TOY,)))
    assert {r.group for r in rows} == {TOY} and all(r.ok for r in rows)
    assert ncu.target_cases()[-1] == ncu.Profiled(TOY, {"tokens": 4, "hidden": 8})


def test_a_registered_op_reaches_the_gpu_check_and_the_perf_model(toy_op):
    from bertfast.gpucheck import compile_report, sanitize, sizing
    from bertfast.perfmodel import kernels as K
    failures = sanitize.run("torch", torch.device("cpu"), dtypes=(torch.float32,), log=lambda s: None, cases=[TOY])
    assert failures == []
    assert TOY in dict(sanitize.registered_cases())
    assert sizing.sanitize_calls() == 2 * len(sanitize.registered_cases())
    assert TOY in sizing.headline_ops()
    labels = [label for label, call in compile_report.bert_launches([("bert-base", 128, 128, "bf16", "fp32", 0.1)],
                                                                   ops=[TOY])]
    assert labels == [f"{TOY} [bert-base seq128 bf16 params=fp32 p=0.1]"]
    module = sys.modules[TOY_MODULE]
    for _, call in compile_report.bert_launches([("bert-base", 128, 128, "bf16", "fp32", 0.1)], ops=[TOY]):
        call()
    assert module.CALLS["launches"] == 1
    assert TOY in K.priced_ops()  # a row op: the perf model predicts its kernels (kernels.WORK has their rules)


def test_the_gpu_check_stages_name_the_registered_row_ops():
    from bertfast.gpucheck import stages
    assert stages.ROW_OPS.split(",") == list(registry.names(registry.ROW))
    assert stages.HEAD_CASES.split(",") == ["mlm_head_loss_decoder", "mlm_head_loss"]


def test_the_registry_imports_neither_triton_nor_the_extension():
    import subprocess
    code = ("import sys; import bertfast.registry as r; r.ops(); "
            "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('bertfast.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['bertfast.registry']"
