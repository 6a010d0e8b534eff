"""The staged GPU check on CPU: the plan's budget, the step runner, the dry run of the stages,
the compile report, and filing a run under benchmarks/results/."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bertfast.gpucheck import compile_report, runner, stages
from bertfast.gpucheck.stages import STAGES, Stage, Step

REPO = runner.REPO


def _env_without_interpreter():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return env


# --------------------------------------------------------------------------- the plan
def test_plan_fits_a_lent_gpu_machine():
    assert [s.number for s in STAGES] == [1, 2, 3, 4, 5]
    assert sum(s.minutes for s in STAGES) <= stages.TOTAL_LIMIT_MIN == 25
    assert all(s.minutes <= stages.STAGE_LIMIT_MIN == 8 for s in STAGES)
    assert runner.check_plan() == []
    # Priority order: build + sanitizers, correctness, the headline, the kernel suite, the rest.
    assert [s.name for s in STAGES] == ["build", "tests", "headline", "kernels", "rest"]
    assert "compute-sanitizer" in " ".join(STAGES[0].steps[2].argv + STAGES[0].steps[3].argv)
    tests = STAGES[1].steps[0]
    assert tests.env == {"BERTFAST_AUTOTUNE": "0"} and "gpu or gpu_capable" in tests.argv


def test_plan_command_prints_minutes_and_commands():
    res = subprocess.run([sys.executable, "-m", "bertfast.gpucheck", "plan", "--out", "somewhere"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr
    for s in STAGES:
        assert f"stage {s.number}  {s.minutes} min  {s.name}" in res.stdout
        assert f"make gpu-check STAGE={s.number} GPU_OUT=somewhere" in res.stdout
    assert f"total    {sum(s.minutes for s in STAGES)} min" in res.stdout


def test_plan_that_does_not_fit_is_reported(monkeypatch):
    slow = Stage(9, "slow", "too slow", [Step("a", ["true"], 9 * 60)])
    monkeypatch.setattr(runner, "STAGES", STAGES + [slow])
    problems = runner.check_plan()
    assert any("more than 25" in p for p in problems) and any("stage 9 takes 9 min" in p for p in problems)


# --------------------------------------------------------------------------- one step
def test_step_output_is_logged_and_a_step_past_its_limit_is_stopped(tmp_path):
    log = tmp_path / "a.log"
    ok = runner.run_step(Step("echo", [], 10), [sys.executable, "-c", "print('hello from the step')"],
                         dict(os.environ), str(log), 10)
    assert ok["status"] == "ok" and "hello from the step" in log.read_text()
    failed = runner.run_step(Step("fail", [], 10), [sys.executable, "-c", "raise SystemExit(3)"],
                             dict(os.environ), str(log), 10)
    assert failed == {"status": "failed", "seconds": failed["seconds"], "detail": "exit 3"}
    slow = runner.run_step(Step("slow", [], 1), [sys.executable, "-c", "import time; print('started', flush=True); "
                                                 "time.sleep(60)"], dict(os.environ), str(log), 1)
    assert slow["status"] == "timed out" and slow["seconds"] < 30
    assert "started" in log.read_text() and "stopped at the step's limit of 1 s" in log.read_text()


def test_findings_read_pytest_and_sanitizer_summaries(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("....\n===== 312 passed, 4 skipped in 201.33s (0:03:21) =====\n")
    assert runner.findings(Step("pytest", [], 1), str(log), str(tmp_path), "s") == "312 passed, 4 skipped"
    log.write_text("ok     bias_gelu float32\nFAILED embeddings bfloat16: x\n========= ERROR SUMMARY: 2 errors\n")
    assert runner.findings(Step("memcheck", [], 1), str(log), str(tmp_path), "s") == "2 sanitizer error(s); 2 call(s) run"


# --------------------------------------------------------------------------- the dry run
def test_dry_run_of_the_stages_on_cpu(tmp_path):
    """Stages 1, 3, 4 and 5 as the GPU runs them, on CPU with tiny shapes; stage 2's selection is
    collected (running it repeats the kernel tests of this suite)."""
    out = tmp_path / "gpu-out"
    res = subprocess.run([sys.executable, "-m", "bertfast.gpucheck", "run", "--dry-run", "--out", str(out),
                          "--stage", "1", "--stage", "3", "--stage", "4", "--stage", "5"],
                         capture_output=True, text=True, cwd=REPO, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] and "CPU dry run" in summary["device"]
    assert [s["stage"] for s in summary["stages"]] == [1, 3, 4, 5]
    steps = {r["step"]: r for s in summary["stages"] for r in s["steps"]}
    assert steps["install"]["status"] == "skipped" and steps["memcheck"]["status"] == "ok"
    for name in ("pretrain", "row-ops", "attention", "mlm-head", "finetune-inference", "compiled"):
        assert steps[name]["status"] == "ok", (name, steps[name])
        assert (out / ("stage3-headline" if name == "pretrain" else
                       "stage4-kernels" if name in ("row-ops", "attention") else "stage5-rest")
                / name / "results.json").exists()
    merged = json.loads((out / "results" / "results.json").read_text())
    assert merged["device"]["kind"] == "cpu" and merged["rows"]
    assert "| 3 headline | pretrain | ok |" in (out / "summary.md").read_text()
    assert "CPU dry run" in res.stdout


def test_stage2_selects_the_gpu_tests_and_the_kernel_tests():
    res = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-m", "gpu or gpu_capable", "tests",
                          "-p", "no:cacheprovider"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:]
    ids = [line for line in res.stdout.splitlines() if "::" in line]
    assert len(ids) > 300
    for prefix in ("tests/ops/test_attention.py", "tests/ops/test_bias_dropout_residual_layernorm.py",
                   "tests/ops/test_bias_gelu.py", "tests/ops/test_embeddings.py", "tests/ops/test_mlm_head_loss.py",
                   "tests/test_model_triton.py"):
        assert any(i.startswith(prefix) for i in ids), prefix
    assert not any(i.startswith("tests/test_data.py") for i in ids)


# --------------------------------------------------------------------------- compile report
PTXAS_TRITON = """ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function '_attn_fwd_kernel' for 'sm_90a'
ptxas info    : Function properties for _attn_fwd_kernel
    8 bytes stack frame, 52 bytes spill stores, 60 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
"""
PTXAS_NVCC = """ptxas info    : Compiling entry function '_ZN8bertfast3fooEv' for 'sm_90'
ptxas info    : Function properties for _ZN8bertfast3fooEv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 2048 bytes smem, 400 bytes cmem[0]
"""


def test_ptxas_reports_are_parsed():
    assert compile_report.parse_ptxas(PTXAS_TRITON) == {
        "_attn_fwd_kernel": {"spill_stores": 52, "spill_loads": 60, "registers": 255, "smem": 0}}
    assert compile_report.parse_ptxas(PTXAS_NVCC) == {
        "_ZN8bertfast3fooEv": {"spill_stores": 0, "spill_loads": 0, "registers": 40, "smem": 2048}}
    row = compile_report.Row("triton", "k", "v", "c", registers=255, spill_stores=52, spill_loads=60, shared=10)
    assert row.problems == ["spills 52 B"]
    assert compile_report.Row("cuda", "k", "v", "-", registers=1, spill_stores=0, shared=300 * 1024).problems \
        == [f"shared memory {300 * 1024} B > {227 * 1024} B"]


def test_compile_report_fast_part_is_spill_free_on_sm90():
    """What CI runs of `make compile-report`: every autotune candidate of the training configuration
    (BERT-large, bf16 activations, fp32 parameters, dropout) compiled for sm_90 by Triton, and the
    CUDA extension by nvcc when it is here; the report fails on any spill."""
    res = subprocess.run([sys.executable, "-m", "bertfast.gpucheck.compile_report", "--fast"],
                         capture_output=True, text=True, cwd=REPO, env=_env_without_interpreter(), timeout=1500)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    for kernel in ("_attention_fwd_kernel", "_attention_bwd_dkdv_kernel", "_attention_bwd_dq_kernel",
                   "_bias_dropout_residual_layernorm_bwd_kernel", "_embeddings_bwd_kernel", "_mlm_head_loss_fwd_kernel",
                   "_bias_gelu_fwd_kernel"):
        assert f"triton {kernel}" in res.stdout
    assert "none spills" in res.stdout


# --------------------------------------------------------------------------- landing a run
def _gpu_run_dir(tmp_path, dry_run=False):
    import torch
    from bertfast.bench import device as devmod, report
    from bertfast.bench.results import Row, Run
    from bertfast.bench.targets import evaluate_targets
    from bertfast.bench.timing import Stat

    info = devmod.DeviceInfo(kind="cuda", name="NVIDIA H100 80GB HBM3", slug="nvidia-h100-80gb-hbm3",
                             torch_version=torch.__version__, python_version="3", platform="test")
    row = Row("model", "pretrain_step", {"model": "bert-large", "seqlen": 128, "batch": 128}, "step", "bertfast",
              time_ms=Stat(60.0, 59.0, 61.0, 10), metrics={"mfu_datasheet": Stat(0.51, 0.5, 0.52, 10)})
    run = Run(device=info, config={}, rows=[row], date="2026-12-01T10:00:00+00:00")
    run.targets = evaluate_targets(run)
    out = tmp_path / "gpu-out"
    report.write(run, str(out / "results"))
    (out / "stage2-tests").mkdir()
    (out / "stage2-tests" / "pytest.log").write_text("===== 400 passed in 200.00s =====\n")
    (out / "summary.md").write_text("# GPU check\n")
    (out / "summary.json").write_text(json.dumps({"dry_run": dry_run, "device": info.name, "stages": []}))
    return out


def test_land_files_a_gpu_run_and_regenerates_the_readme_table(tmp_path):
    out = _gpu_run_dir(tmp_path)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README.md").write_text("# x\n<!-- results:begin -->\nnothing yet\n<!-- results:end -->\nend\n")
    dest = runner.land(str(out), repo=str(repo))
    assert dest == str(repo / "benchmarks" / "results" / "nvidia-h100-80gb-hbm3" / "2026-12-01")
    files = set(os.listdir(dest))
    assert {"results.json", "results.md", "kernels_speedup.png", "model_speedup.png", "summary.md",
            "summary.json", "stage2-tests-pytest.log"} <= files
    readme = (repo / "README.md").read_text()
    assert "nothing yet" not in readme and "NVIDIA H100 80GB HBM3" in readme
    assert "| BERT-large seq-128 training step >= 50% MFU | met |" in readme
    assert "benchmarks/results/nvidia-h100-80gb-hbm3/2026-12-01" in readme


def test_land_refuses_a_dry_run(tmp_path):
    out = _gpu_run_dir(tmp_path, dry_run=True)
    with pytest.raises(ValueError, match="CPU dry run"):
        runner.land(str(out), repo=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="summary.json"):
        runner.land(str(tmp_path / "nothing"), repo=str(tmp_path))


def test_a_rejected_optional_option_is_dropped_and_the_step_retried(tmp_path, monkeypatch):
    """compute-sanitizer's kernel filter differs between versions: a tool that rejects it runs again
    without it, and the log says so."""
    tool = tmp_path / "tool.py"
    tool.write_text("import sys\nif '--only' in sys.argv:\n    print('Error: unknown option --only')\n"
                    "    raise SystemExit(2)\nprint('checked everything')\n")
    step = Step("memcheck", [sys.executable, str(tool), "--only", "x"], 30, optional_args=["--only", "x"])
    monkeypatch.setattr(runner, "STAGES", [Stage(1, "build", "test", [step])])
    monkeypatch.setattr(runner, "get_stage", lambda k: runner.STAGES[0])
    monkeypatch.setattr(runner, "_installed", lambda: True)
    record = runner.run_stage(runner.STAGES[0], str(tmp_path), dry_run=False, log=lambda text: None)
    assert record["status"] == "ok" and record["steps"][0]["status"] == "ok"
    assert "checked everything" in (tmp_path / "stage1-build" / "memcheck.log").read_text()
