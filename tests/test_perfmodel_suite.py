"""perfmodel/suite.py: a GPU run's kernel-suite attention timings read as model settings, compared
with predictions summed over each direction's kernels, and one overlap fitted to them."""
import json

import pytest

from bertfast.perfmodel import kernels as K
from bertfast.perfmodel import report
from bertfast.perfmodel import suite as SU
from bertfast.perfmodel.hardware import H100
from bertfast.perfmodel.model import Prediction, retime

DEVICE = {"kind": "cuda", "name": "NVIDIA H200", "copy_bandwidth_gbps": {"median": 4248.0}}


def _row(direction, ms, impl=SU.IMPL, padding="none", heads=12, seqlen=512, batch=32, dropout=0.1, status="ok"):
    case = {"batch": batch, "seqlen": seqlen, "heads": heads, "head_dim": 64, "padding": padding,
            "dropout": dropout, "dtype": "bf16"}
    return {"suite": "kernels", "group": "attention", "case": case, "direction": direction, "impl": impl,
            "status": status, "time_ms": {"median": ms}}


def _write(tmp_path, name, date, rows, device=DEVICE, config=None):
    run = tmp_path / "gpu" / name
    run.mkdir(parents=True)
    (run / "results.json").write_text(json.dumps({"date": date, "device": device, "rows": rows,
                                                  "config": config or {}}))
    return run


def test_a_runs_attention_timings_become_model_settings(tmp_path):
    chosen = {"_attention_fwd_kernel": [{"key": [512, 64, True], "config": "BLOCK_M=64 BLOCK_N=64 num_warps=4"}]}
    rows = [_row("fwd", 0.144), _row("bwd", 0.35), _row("fwd+bwd", 0.482),
            _row("fwd", 0.04, heads=16, seqlen=128, batch=128, dropout=0.0),
            _row("fwd", 9.0, padding="pretrain"), _row("fwd", 9.0, impl="sdpa:flash"),
            _row("fwd", 9.0, heads=8), _row("bwd", 9.0, status="skipped")]
    run = SU.read_suite(str(_write(tmp_path, "a", "2026-01-02", rows, config={"parts": [{"tuned_configs": chosen}]})))
    base, large = K.Setting("bert-base", 512, 32, 0.1), K.Setting("bert-large", 128, 128, 0.0)
    assert [s.label() for s in run.settings()] == [base.label(), large.label()]
    assert run.seconds(base, "fwd") == pytest.approx(144e-6) and run.seconds(base, "fwd+bwd") == pytest.approx(482e-6)
    assert run.seconds(large, "fwd") == pytest.approx(40e-6) and run.seconds(large, "bwd") is None
    assert run.tuned == {"_attention_fwd_kernel": {(512, 64, True): "BLOCK_M=64 BLOCK_N=64 num_warps=4"}}
    assert run.gpu.name.startswith("H200") and run.gpu.achievable_hbm_bytes_per_s == pytest.approx(4.248e12)
    # the newest run that timed the attention; one without (a CPU run, no attention rows) is passed over
    _write(tmp_path, "b", "2026-01-01", [_row("fwd", 0.2)])
    _write(tmp_path, "c", "2026-01-03", [_row("fwd", 0.2, impl="sdpa:cudnn")])
    _write(tmp_path, "d", "2026-01-04", [_row("fwd", 0.2)], device={"kind": "cpu", "name": "cpu"})
    assert SU.latest_suite(str(tmp_path)).path.endswith("a")
    assert SU.latest_suite(str(tmp_path / "nowhere")) is None


def _result(setting, kernel, us, tuned=True):
    bounds = {"tensor": 0.5 * us * 1e-6, "issue": us * 1e-6, "pipe": 0.0, "memory": 0.4 * us * 1e-6, "latency": 0.0}
    prediction = Prediction(kernel, True, {}, bounds, {}, "issue", 1, 1.0, True, 0.0, 0.0)
    prediction.predicted_s = retime(prediction, H100.overlap, H100.memory_overlap)
    return report.KernelResult(setting, "attention", kernel, "", "", 128, 1e8, prediction, tuned)


def test_each_direction_is_measured_against_the_sum_of_its_kernels_and_one_overlap_fits_them():
    setting = K.Setting("bert-base", 512, 32, 0.1)
    fwd = _result(setting, "_attention_fwd_kernel", 100)
    bwd = [_result(setting, "_attention_bwd_delta_kernel", 20, tuned=False),
           _result(setting, "_attention_bwd_dq_kernel", 100), _result(setting, "_attention_bwd_dkdv_kernel", 120)]
    # measured as if the overlap were 0.8
    measured = {"fwd": retime(fwd.prediction, 0.8, 0.0),
                "bwd": sum(retime(r.prediction, 0.8, 0.0) for r in bwd)}
    run = SU.SuiteRun("runs/x", "NVIDIA H200", H100, "2026-01-01",
                      [(setting, d, measured[d]) for d in ("fwd", "bwd")] + [(setting, "fwd+bwd", 1.0)],
                      {"_attention_fwd_kernel": {}, "_attention_bwd_dq_kernel": {}, "_attention_bwd_dkdv_kernel": {}})
    other = _result(K.Setting("bert-base", 128, 128, 0.1), "_attention_fwd_kernel", 10)
    rows = SU.compare([fwd, *bwd, other], run)
    assert [(r["direction"], r["kernels"]) for r in rows] == [
        ("fwd", ["_attention_fwd_kernel"]),
        ("bwd", ["_attention_bwd_delta_kernel", "_attention_bwd_dq_kernel", "_attention_bwd_dkdv_kernel"])]
    assert rows[1]["predicted_s"] == pytest.approx(sum(r.prediction.predicted_s for r in bwd))
    assert all(r["tuned"] for r in rows)  # the delta kernel has no candidates: not a missed config
    assert SU.fit_overlap(rows, 0.0) == pytest.approx(0.8)
    assert SU.at_overlap(rows[1], 0.8, 0.0) == pytest.approx(measured["bwd"])
    assert SU.fit_overlap([], 0.0) is None
    # a config the run chose but the model could not match is said
    bwd[1].tuned = False
    assert [r["tuned"] for r in SU.compare([fwd, *bwd], run)] == [True, False]
    # faster than the binding bound alone: the fit stops at perfect overlap
    fast = [dict(rows[0], measured_s=0.5 * rows[0]["predicted_s"])]
    assert SU.fit_overlap(fast, 0.0) == 0.0


def test_the_attention_target_is_shown_beside_the_runs_measurement():
    """The target's case (seq 512, dropout 0.1) as the run timed it in one call, at its heads."""
    setting = K.Setting("bert-base", 512, 32, 0.1)
    run = SU.SuiteRun(report.RESULTS + "/gpu/x", "NVIDIA H200", H100, "2026-01-01",
                      [(setting, "fwd", 1e-4), (setting, "fwd+bwd", 482e-6)], {})
    got = report.measured_attention_target(run)
    scores = 32 * 12 * 512 ** 2
    assert got["tflops"] == pytest.approx(14 * 64 * scores / 482e-6 / 1e12) and got["heads"] == 12
    assert got["tflops"] == pytest.approx(187.1, abs=0.1)  # the H200 run of 2026-11-27-3: 482 us
    assert report.measured_attention_target(SU.SuiteRun("x", "d", H100, "", [(setting, "fwd", 1e-4)], {})) is None
    at_128 = K.Setting("bert-base", 128, 128, 0.1)
    assert report.measured_attention_target(SU.SuiteRun("x", "d", H100, "", [(at_128, "fwd+bwd", 1e-4)], {})) is None


def test_a_direction_whose_kernels_changed_since_the_run_is_shown_and_not_fitted(monkeypatch):
    """As the step's profile: a kernel edited after the run measured other code (the forward's keep-bit
    packing and Philox of 2026-11-28), so its rows are marked and the overlap fits the others alone."""
    setting = K.Setting("bert-base", 512, 32, 0.1)
    fwd = _result(setting, "_attention_fwd_kernel", 100)
    bwd = [_result(setting, "_attention_bwd_dq_kernel", 100), _result(setting, "_attention_bwd_dkdv_kernel", 120)]
    # the backward measured as if the overlap were 0.8, the (changed) forward at 3 times its prediction
    measured = {"fwd": 3 * fwd.prediction.predicted_s, "bwd": sum(retime(r.prediction, 0.8, 0.0) for r in bwd)}
    run = SU.SuiteRun(report.RESULTS + "/gpu/x", "NVIDIA H200", H100, "2026-01-01",
                      [(setting, d, measured[d]) for d in ("fwd", "bwd")], {})
    monkeypatch.setattr(report, "analyse", lambda *a, **k: [fwd, *bwd])
    asked = []

    def changed_since(path, sources, repo=report.REPO, kernel=None):
        asked.append((path, tuple(sources), kernel))
        return kernel == "_attention_fwd_kernel"
    monkeypatch.setattr(report, "changed_since", changed_since)
    lines = []
    got = report.suite_comparison(run, log=lines.append)
    assert [(r["direction"], r["changed_since_run"]) for r in got["rows"]] == [("fwd", True), ("bwd", False)]
    assert got["overlap_fitted"] == pytest.approx(0.8)
    assert ("x/results.json", ("kernels/attention.py",), "_attention_fwd_kernel") in [
        (p.split("/gpu/")[-1], s, k) for p, s, k in asked]
    assert "[source changed since this run: not fitted]" in next(line for line in lines if " fwd " in line)
    assert not any("not fitted" in line for line in lines if " bwd " in line)
    # unchanged, the forward joins the fit and pulls the overlap up
    monkeypatch.setattr(report, "changed_since", lambda *a, **k: False)
    assert report.suite_comparison(run, log=lambda m: None)["overlap_fitted"] > 0.8


def test_the_models_fastest_candidate_is_set_beside_the_runs_autotuner_choice():
    """Each kernel the run tuned, its config beside the one the model predicts fastest among the same
    candidates: a kernel the run did not tune (the delta kernel), or the model had no choice for, is not
    compared."""
    setting = K.Setting("bert-base", 512, 32, 0.1)
    ran = [_result(setting, "_attention_fwd_kernel", 100), _result(setting, "_attention_bwd_dq_kernel", 100),
           _result(setting, "_attention_bwd_delta_kernel", 20, tuned=False)]
    ran[0].config, ran[1].config = "BLOCK_M=64 BLOCK_N=64 w=4", "BLOCK_M=64 BLOCK_N=64 w=4"
    picked = [_result(setting, "_attention_fwd_kernel", 90), _result(setting, "_attention_bwd_dq_kernel", 80),
              _result(setting, "_attention_bwd_delta_kernel", 20)]
    picked[0].config, picked[0].candidates = "BLOCK_M=64 BLOCK_N=64 w=4", 5
    picked[1].config, picked[1].candidates = "BLOCK_M=128 BLOCK_N=64 w=8", 4
    rows = SU.autotuner_agreement(ran, picked)
    assert [(r["kernel"], r["agree"]) for r in rows] == [("_attention_fwd_kernel", True),
                                                         ("_attention_bwd_dq_kernel", False)]
    assert rows[1]["run"] == "BLOCK_M=64 BLOCK_N=64 w=4" and rows[1]["model"] == "BLOCK_M=128 BLOCK_N=64 w=8"
    assert rows[1]["candidates"] == 4
    picked[1].candidates = 1  # the model tried one config: nothing to compare
    assert len(SU.autotuner_agreement(ran, picked)) == 1


def test_a_gemm_the_settings_repeat_is_compared_once():
    """The FFN's GEMM launches alike at a shape with and without dropout: one row, not one a setting;
    the attention's kernels differ by variant there and keep a row each."""
    settings = [K.Setting("bert-large", 512, 32, p) for p in (0.1, 0.0)]
    ran, picked = [], []
    for setting, dropout in zip(settings, ("HAS_DROPOUT=1", "HAS_DROPOUT=0")):
        for kernel, variant in (("_gemm_bias_gelu_kernel", "BACKWARD=1"), ("_attention_fwd_kernel", dropout)):
            mine, run = _result(setting, kernel, 100), _result(setting, kernel, 100)
            mine.variant = run.variant = variant
            mine.config, mine.candidates = "BLOCK_M=64 BLOCK_N=128 w=4", 6
            run.config = "BLOCK_M=128 BLOCK_N=128 w=8"
            ran.append(run)
            picked.append(mine)
    rows = SU.autotuner_agreement(ran, picked)
    assert sorted(r["kernel"] for r in rows) == ["_attention_fwd_kernel", "_attention_fwd_kernel",
                                                 "_gemm_bias_gelu_kernel"]
    assert not any(r["agree"] for r in rows)
