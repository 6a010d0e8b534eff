"""What a bench run selects: implementation families (--impls), case filters (--case) and the time
budget, and the CLI's refusal of unknown ones, so that a partial run times only what was asked."""
from __future__ import annotations

import pytest

from bertfast.bench import cli
from bertfast.bench.results import FULL_HEAD, GEMM_FLOOR, HF_COMPILED, HF_EAGER, SDPA_FLASH, TORCH_EAGER
from bench_helpers import _cpu_ctx


def test_implementation_families():
    from bertfast.bench.common import DTYPES
    from bertfast.bench.options import DTYPE_NAMES, IMPL_FAMILIES
    from bertfast.bench.results import (BERTFAST, BERTFAST_GRAPHS, BERTFAST_REFERENCE, BERTFAST_STATIC, ONNXRUNTIME,
                                        SDPA_CUDNN, TORCH_COMPILE, impl_family)
    assert [impl_family(i) for i in ("bertfast:triton varlen", BERTFAST, BERTFAST_STATIC, BERTFAST_GRAPHS,
                                     BERTFAST_REFERENCE, TORCH_EAGER, FULL_HEAD, GEMM_FLOOR, TORCH_COMPILE, SDPA_FLASH,
                                     SDPA_CUDNN, HF_EAGER, HF_COMPILED, ONNXRUNTIME)] == [
        "bertfast", "bertfast", "static-shapes", "static-shapes", "reference", "eager", "eager", "eager", "compiled",
        "sdpa", "sdpa", "transformers", "transformers-compiled", "onnxruntime"]
    assert set(IMPL_FAMILIES) == {"bertfast", "static-shapes", "reference", "eager", "compiled", "sdpa",
                                  "transformers", "transformers-compiled", "onnxruntime"}
    assert sorted(DTYPES) == sorted(DTYPE_NAMES)  # --dtype's choices (torch-free) are the dtypes the bench maps
    with pytest.raises(ValueError, match="no family"):
        impl_family("numpy")


def test_impls_filter_runs_only_the_selected_families():
    from bertfast.bench import kernels_suite, model_suite
    ctx = _cpu_ctx(backends=("torch",), ops=("bias_gelu",), impls=("eager",))
    rows = kernels_suite.run(ctx)
    assert rows and {r.impl for r in rows} == {TORCH_EAGER}
    ctx = _cpu_ctx(models=("inference",), impls=("reference",))
    rows = model_suite.run(ctx)
    assert rows and {r.impl for r in rows} == {"bertfast reference"} and all(r.ok for r in rows)


def test_cli_rejects_unknown_families_and_bad_case_filters(capsys):
    assert cli.main(["--impls", "bertfast,numpy", "--device", "cpu"]) == 2
    assert "unknown implementation families ['numpy']" in capsys.readouterr().err
    assert cli.main(["--case", "model", "--device", "cpu"]) == 2
    assert "expected FIELD=VALUE" in capsys.readouterr().err
    assert cli.main(["--time-budget", "0", "--device", "cpu"]) == 2
    assert cli.main(["--models", "inference,embedding", "--device", "cpu"]) == 2
    assert "unknown model benchmarks ['embedding']; expected pretrain, finetune, inference, embeddings" in \
        capsys.readouterr().err


def test_case_filter_and_time_budget(monkeypatch):
    from bertfast.bench import common, kernels_suite
    ctx = _cpu_ctx(backends=("torch",), ops=("bias_dropout_residual_layernorm",), cases={"dropout": "0.1"})
    rows = kernels_suite.run(ctx)
    assert rows and {r.case["dropout"] for r in rows} == {0.1}
    # A spent budget: every case left is recorded as skipped, none is run.
    ctx = _cpu_ctx(backends=("torch",), ops=("bias_gelu", "attention"), budget_s=5.0)
    ctx.deadline = common.time.monotonic() - 1.0
    rows = kernels_suite.run(ctx)
    assert rows and all(r.status == "skipped" and r.reason == "not run: the --time-budget of 5 s was spent"
                        for r in rows)
    assert {r.group for r in rows} == {"bias_gelu", "attention"}
