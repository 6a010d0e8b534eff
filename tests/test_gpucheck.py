"""The staged GPU check on CPU: the plan's budget, the step runner, the dry run of the stages,
the compile report, and filing a run under benchmarks/results/."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bertfast import registry
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
    assert sum(s.minutes for s in STAGES) <= stages.TOTAL_LIMIT_MIN == 30
    assert all(s.minutes <= stages.STAGE_LIMIT_MIN == 9 for s in STAGES)
    assert runner.check_plan() == []
    # Priority order: build + sanitizers, correctness, the headline, the kernel suite, the rest.
    assert [s.name for s in STAGES] == ["build", "tests", "headline", "kernels", "rest"]
    build = {step.name: step for step in STAGES[0].steps}
    assert list(build) == ["install", "requirements", "build", "info", "mma-rate", "memcheck", "racecheck"]
    assert build["install"].env == {"BERTFAST_BUILD_CUDA": "0"} and build["build"].env["BERTFAST_BUILD_CUDA"] == "1"
    assert "compute-sanitizer" in build["memcheck"].argv and "compute-sanitizer" in build["racecheck"].argv
    # racecheck fails inside cuBLAS's fp32-out GEMM (three GPU runs): it alone takes the bf16-out path.
    assert "--no-fp32-out-gemms" in build["racecheck"].argv and "--no-fp32-out-gemms" not in build["memcheck"].argv
    # Only the sanitizers and mma.sync's timing need the extension: the Triton tests and the benchmarks
    # never wait on its build.
    assert [step.name for s in STAGES for step in s.steps if stages.EXTENSION in step.needs] == [
        "mma-rate", "memcheck", "racecheck"]
    assert all(not step.needs for step in STAGES[0].steps[:3])
    tests = STAGES[1].steps[0]
    assert tests.env == {"BERTFAST_AUTOTUNE": "0", "OMP_NUM_THREADS": "1",
                         stages.CANDIDATE_FAILURES_ENV: f"{stages.OUT}/{stages.FAILED_CANDIDATES}"}
    assert "gpu or gpu_capable" in tests.argv
    n = tests.argv.index("-n")
    assert tests.argv[n + 2:n + 4] == ["-p", "bertfast.gpucheck.compile_groups"]  # tests sharing compiles together
    assert "bertfast.gpucheck.pytest_progress" in tests.argv and "bertfast.gpucheck.pytest_progress" in tests.dry_argv
    assert all(step.sizing for s in STAGES for step in s.steps)


def test_plan_command_prints_minutes_and_commands():
    res = subprocess.run([sys.executable, "-m", "bertfast.gpucheck", "plan", "--out", "somewhere"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr
    for s in STAGES:
        assert f"stage {s.number}  {s.minutes} min  {s.name}" in res.stdout
        assert f"make gpu-check STAGE={s.number} GPU_OUT=somewhere" in res.stdout
        for step in s.steps:
            assert f"sized: {step.sizing}" in res.stdout
    assert f"total    {sum(s.minutes for s in STAGES)} min" in res.stdout
    assert res.stdout.count("(fresh machine)") == len(STAGES) - 1


def test_plan_that_does_not_fit_is_reported(monkeypatch):
    slow = Stage(9, "slow", "too slow", [Step("a", ["true"], 10 * 60)])
    monkeypatch.setattr(runner, "STAGES", STAGES + [slow])
    problems = runner.check_plan()
    assert any("more than 30" in p for p in problems) and any(f"stage 9 takes {slow.minutes} min" in p
                                                              for p in problems)


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


def test_sanitize_can_keep_the_mlm_weight_gradient_off_fp32_out_gemms(monkeypatch, capsys):
    """--no-fp32-out-gemms: the op's weight gradient through input-dtype GEMMs (a probe that once
    found fp32-out GEMMs is overridden); the calls still run and finish finite."""
    from bertfast.gpucheck import sanitize
    from bertfast.ops import _common
    monkeypatch.setattr(_common, "FP32_OUT_GEMMS", True)
    monkeypatch.setitem(_common._FP32_GEMM_CAPS, ("cuda", 0, torch.bfloat16), (True, True))
    assert _common.fp32_gemm_caps(torch.device("cuda", 0), torch.bfloat16) == (True, True)
    assert sanitize.main(["--backend", "torch", "--device", "cpu", "--case", "mlm_head_loss",
                          "--no-fp32-out-gemms"]) == 0
    assert _common.FP32_OUT_GEMMS is False
    assert _common.fp32_gemm_caps(torch.device("cuda", 0), torch.bfloat16) == (False, False)
    assert "GEMMs write the input dtype" in capsys.readouterr().out


def test_findings_read_pytest_and_sanitizer_summaries(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("....\n===== 312 passed, 4 skipped in 201.33s (0:03:21) =====\n")
    assert runner.findings(Step("pytest", [], 1), str(log), str(tmp_path), "s") == "312 passed, 4 skipped"
    log.write_text("ok     bias_gelu float32\nFAILED embeddings bfloat16: x\n========= ERROR SUMMARY: 2 errors\n")
    assert runner.findings(Step("memcheck", [], 1), str(log), str(tmp_path), "s") == \
        "2 sanitizer error(s); 2 call(s) run; failing: embeddings bfloat16"
    # The H200 run's racecheck log (2026-11-26), shortened: racecheck's own summary line, and an error
    # that is compute-sanitizer's, not a race.
    log.write_text("========= COMPUTE-SANITIZER\nok     embeddings bfloat16 (cuda on cuda)\n"
                   "========= Internal Sanitizer Error: The Sanitizer failed to handle a hardware exception.\n"
                   "FAILED mlm_head_loss bfloat16: RuntimeError: CUDA error: CUBLAS_STATUS_INTERNAL_ERROR\n"
                   "1 failing call(s)\n========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n")
    assert runner.findings(Step("racecheck", [], 1), str(log), str(tmp_path), "s") == (
        "1 race error(s), 0 warning(s) (one is compute-sanitizer's own internal error: 'The Sanitizer failed to "
        "handle a hardware exception.'); 2 call(s) run; failing: mlm_head_loss bfloat16")


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
    op_tests = [f"tests/ops/test_{op.name}.py" for op in registry.ops() if op.forms]
    for prefix in op_tests + ["tests/test_model_triton.py"]:
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
    (BERT-large at seq 512 and 128, bf16 activations, fp32 parameters, dropout) compiled for sm_90 by
    Triton, and the CUDA extension by nvcc when it is here; the report fails on any spill."""
    res = subprocess.run([sys.executable, "-m", "bertfast.gpucheck.compile_report", "--fast"],
                         capture_output=True, text=True, cwd=REPO, env=_env_without_interpreter(), timeout=1500)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    for kernel in ("_attention_fwd_kernel", "_attention_bwd_dkdv_kernel", "_attention_bwd_dq_kernel",
                   "_attention_bwd_dkdv_atomic_dq_kernel", "_attention_bwd_dq_store_kernel",
                   "_attention_bwd_fused_kernel", "_bias_dropout_residual_layernorm_bwd_kernel", "_embeddings_bwd_kernel", "_mlm_head_loss_fwd_kernel",
                   "_bias_gelu_fwd_kernel"):
        assert f"triton {kernel}" in res.stdout
    assert "none spills" in res.stdout


def test_recorded_launches_hold_small_stand_ins_and_compiled_kernels_are_not_kept(monkeypatch):
    """The full matrix must fit a small machine: a recorded launch keeps one-element tensors that
    Triton specialises like the real ones (dtype, address modulo 16), not the setting's activations,
    and the report drops each compiled kernel once it has read it."""
    import torch
    from bertfast.kernels import _common

    base = torch.empty(64, dtype=torch.bfloat16)
    for view in (base, base[3:], base[8:]):  # 64-byte aligned, 6 bytes past, 16 bytes past
        s = compile_report._stand_in(view)
        assert s.dtype == view.dtype and s.numel() == 1 and s.data_ptr() % 16 == view.data_ptr() % 16
    assert compile_report._stand_in(7) == 7 and compile_report._stand_in(None) is None
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    launches = compile_report.record_settings([("bert-large", 512, 32, "bf16", "fp32", 0.1)])
    tensors = [a for launch in launches for a in launch.args if isinstance(a, torch.Tensor)]
    assert tensors and max(t.numel() for t in tensors) == 1

    class Fn:  # Triton's JITFunction keeps (kernel cache, key cache, target, backend, binder) per device
        device_caches = {0: ({"key": "a compiled kernel"}, {"args": "key"}, "sm_90", None, None)}
    compile_report._forget_compiled(Fn)
    assert Fn.device_caches[0][0] == {}


def test_full_matrix_compiles_fp16_attention_at_head_dim_64_and_attention_only_at_every_one(monkeypatch):
    """fp16 attention compiles like its bf16 twin (compile_report.FULL_MATRIX_FP16_ATTENTION_HEAD_DIMS):
    the full matrix keeps it at head dim 64 and every head dim in bf16 and fp32; --attention-only keeps
    fp16 at every other head dim."""
    from bertfast.kernels import _common
    monkeypatch.setattr(_common, "interpreting", lambda: False)

    def head_dims(launches):
        out = {}
        for launch in launches:
            if launch.fn.__name__ == "_attention_fwd_kernel":
                dtype = str(launch.args[0].dtype).replace("torch.", "")
                out.setdefault(dtype, set()).add(launch.consts["HEAD_DIM"])
        return out
    every = set(compile_report.ATTENTION_HEAD_DIMS)
    full = head_dims(compile_report.record_launches(fast=False))
    assert full["bfloat16"] == every and full["float32"] == every
    assert full["float16"] == set(compile_report.FULL_MATRIX_FP16_ATTENTION_HEAD_DIMS) == {64}
    assert head_dims(compile_report.record_launches(fast=False, attention_only=True))["float16"] == every - {64}


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
    (out / "stage2-tests" / "progress.jsonl").write_text('{"event": "finished", "exitstatus": 0}\n')
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
            "summary.json", "stage2-tests-pytest.log", "stage2-tests-progress.jsonl"} <= files
    readme = (repo / "README.md").read_text()
    assert "nothing yet" not in readme and "NVIDIA H100 80GB HBM3" in readme
    assert "| BERT-large seq-128 training step >= 50% MFU | met |" in readme
    assert "benchmarks/results/nvidia-h100-80gb-hbm3/2026-12-01" in readme


def test_land_files_a_second_run_of_the_day_beside_the_first(tmp_path):
    """Two loans on one day: the second run gets DATE-2, never the first's directory; landing a run
    again rewrites its own; the step's profile and the sanitizers' output are filed with the logs."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README.md").write_text("# x\n<!-- results:begin -->\nnothing yet\n<!-- results:end -->\n")
    first = runner.land(str(_gpu_run_dir(tmp_path / "a")), repo=str(repo))
    out = _gpu_run_dir(tmp_path / "b")
    results = json.loads((out / "results" / "results.json").read_text())
    results["date"] = "2026-12-01T15:30:00+00:00"
    (out / "results" / "results.json").write_text(json.dumps(results))
    (out / "profile").mkdir()
    (out / "profile" / "bertfast.txt").write_text("wall per step 1 ms\n")
    (out / "profile" / "bertfast.trace.json.gz").write_bytes(b"gz")
    (out / "sanitizers.out").write_text("ERROR SUMMARY: 0 errors\n")
    (out / "stage2-tests").mkdir(exist_ok=True)
    (out / stages.FAILED_CANDIDATES).write_text("_k:A=1 num_warps=4 num_stages=2\n")
    (out / "ncu" / "attention-512").mkdir(parents=True)
    for name in ("ncu.md", "ncu-raw.csv", "ncu.log", "ncu.ncu-rep"):
        (out / "ncu" / name).write_text("x\n")
        (out / "ncu" / "attention-512" / name).write_text("x\n")
    second = runner.land(str(out), repo=str(repo))
    assert second == first + "-2"
    assert {"profile-bertfast.txt", "profile-bertfast.trace.json.gz", "sanitizers.out", "ncu.md", "ncu-raw.csv",
            "ncu.log", "attention-512-ncu.md", "attention-512-ncu-raw.csv", "stage2-tests-failed-candidates.txt"
            } <= set(os.listdir(second))
    assert not {"ncu.ncu-rep", "attention-512-ncu.ncu-rep"} & set(os.listdir(second))  # its CSV pages hold it
    assert json.loads(open(os.path.join(first, "results.json")).read())["date"].startswith("2026-12-01T10")
    assert runner.land(str(out), repo=str(repo)) == second
    assert "2026-12-01-2" in (repo / "README.md").read_text()


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
    machine = _ready_machine(tmp_path)
    record = runner.run_stage(runner.STAGES[0], str(tmp_path), dry_run=False, log=lambda text: None,
                              machine=machine)
    assert record["status"] == "ok" and record["steps"][0]["status"] == "ok"
    assert "checked everything" in (tmp_path / "stage1-build" / "memcheck.log").read_text()


def test_the_candidates_stage_2_finds_wrong_are_left_out_of_the_later_stages(tmp_path, monkeypatch):
    """Stage 2's test of every autotune candidate (tests/ops/test_candidates.py) writes the wrong ones to
    FAILED_CANDIDATES, afresh each run; every later step runs with them in BERTFAST_EXCLUDE_CANDIDATES
    (so the autotuner times none of them), says so in its log, and a value the caller set wins."""
    from bertfast.kernels._common import EXCLUDE_ENV
    assert EXCLUDE_ENV == stages.EXCLUDE_CANDIDATES_ENV  # the runner's name for it: it imports no kernels
    assert stages.FAILED_CANDIDATES in dict(stages.stage(2).steps[0].env)[stages.CANDIDATE_FAILURES_ENV]
    show = [sys.executable, "-c", f"import os; print('excluded:', os.environ.get('{EXCLUDE_ENV}', '-'))"]
    wrong = tmp_path / stages.FAILED_CANDIDATES
    wrong.parent.mkdir(parents=True)
    wrong.write_text("_k:A=1 num_warps=4 num_stages=2\n_j:B=2 num_warps=8 num_stages=3\n"
                     "_k:A=1 num_warps=4 num_stages=2\n")
    monkeypatch.delenv(EXCLUDE_ENV, raising=False)
    assert runner.wrong_candidates(str(tmp_path)) == "_j:B=2 num_warps=8 num_stages=3; _k:A=1 num_warps=4 num_stages=2"
    later = Stage(3, "headline", "test", [Step("pretrain", show, 30, needs=())])
    logged = []
    runner.run_stage(later, str(tmp_path), False, logged.append, _ready_machine(tmp_path))
    ran = (tmp_path / "stage3-headline" / "pretrain.log").read_text()
    assert "excluded: _j:B=2 num_warps=8 num_stages=3; _k:A=1 num_warps=4 num_stages=2" in ran
    assert any("leaving out the autotune candidates stage 2's tests found wrong" in line for line in logged)
    monkeypatch.setenv(EXCLUDE_ENV, "_mine:C=3")
    runner.run_stage(later, str(tmp_path), False, logged.append, _ready_machine(tmp_path))
    assert "excluded: _mine:C=3" in (tmp_path / "stage3-headline" / "pretrain.log").read_text()
    tests = Stage(2, "tests", "test", [Step("pytest", show, 30, needs=())])
    runner.run_stage(tests, str(tmp_path), False, logged.append, _ready_machine(tmp_path))
    assert not wrong.exists() and runner.wrong_candidates(str(tmp_path)) == ""  # recorded afresh


def _ready_machine(tmp_path):
    """A Machine that has looked already: the package and the extension are there."""
    from bertfast.gpucheck.machine import Machine
    machine = Machine(str(tmp_path), dry_run=False, log=lambda text: None)
    machine.why_not.update({stages.PACKAGE: "", stages.EXTENSION: ""})
    return machine


# --------------------------------------------------------------------------- each step with what it needs
def test_a_failed_build_skips_only_the_steps_that_need_the_extension_and_names_its_error(tmp_path):
    """The build step fails: the later steps get BERTFAST_SKIP_EXTENSION with the compiler's error,
    the sanitizer steps skip quoting it, every other step still runs; a later stage on another
    machine reads the failure from GPU_OUT (build.json) and runs without the extension too."""
    from bertfast.gpucheck.machine import Machine, build_record
    out = str(tmp_path)
    show_env = [sys.executable, "-c", "import os; print('SKIP=' + os.environ.get('BERTFAST_SKIP_EXTENSION', ''))"]
    build = Step("build", [sys.executable, "-c", "print('csrc/attention_fwd.cu(12): error: identifier \"x\" is "
                           "undefined'); raise SystemExit(2)"], 30, needs=())
    stage1 = Stage(1, "build", "test", [build, Step("info", show_env, 30),
                                        Step("memcheck", show_env, 30, needs=(stages.PACKAGE, stages.EXTENSION))])
    machine = _ready_machine(tmp_path)
    record = runner.run_stage(stage1, out, dry_run=False, log=lambda text: None, machine=machine)
    steps = {r["step"]: r for r in record["steps"]}
    assert steps["build"]["status"] == "failed" and record["status"] == "failed"
    assert build_record(out)["ok"] is False and 'attention_fwd.cu(12): error: identifier "x"' in build_record(out)["error"]
    assert steps["info"]["status"] == "ok"
    info_log = (tmp_path / "stage1-build" / "info.log").read_text()
    assert "SKIP=the CUDA extension did not build in stage 1 (failed, exit 2: csrc/attention_fwd.cu(12): error" in info_log
    assert steps["memcheck"]["status"] == "skipped"
    assert steps["memcheck"]["detail"].startswith("needs the CUDA extension: the CUDA extension did not build")
    assert "attention_fwd.cu(12): error" in steps["memcheck"]["detail"]
    table = runner.summary_table({"stages": [record]})
    assert "| 1 build | memcheck | skipped |" in table and "attention_fwd.cu(12): error" in table

    later = Machine(out, dry_run=False, log=lambda text: None)  # another machine: only GPU_OUT is kept
    later.why_not[stages.PACKAGE] = ""
    assert later.unmet((stages.PACKAGE,)) == "" and "attention_fwd.cu(12)" in later.why_not[stages.EXTENSION]
    assert "attention_fwd.cu(12)" in later.env()["BERTFAST_SKIP_EXTENSION"]
    assert later.unmet((stages.PACKAGE, stages.EXTENSION)).startswith("needs the CUDA extension")


def test_an_unbuilt_extension_is_restored_from_gpu_out_or_named_missing(tmp_path, monkeypatch):
    from bertfast.gpucheck import machine as mod
    probes = {"import bertfast._C": "ModuleNotFoundError: No module named 'bertfast._C'"}
    monkeypatch.setattr(mod, "_probe", lambda code: probes.get(code, ""))
    m = mod.Machine(str(tmp_path), dry_run=False, log=lambda text: None)
    assert m.unmet((stages.PACKAGE, stages.EXTENSION)).startswith("needs the CUDA extension: bertfast._C is not built")
    assert "has not run into this GPU_OUT" in m.why_not[stages.EXTENSION] and m.env() == {}

    kept = tmp_path / "cache" / "ext"
    kept.mkdir(parents=True)
    (kept / "_C.cpython-test.so").write_bytes(b"module")
    copied = []
    monkeypatch.setattr(mod, "_replace", lambda src, dest: (copied.append((src, dest)), probes.clear()))
    m = mod.Machine(str(tmp_path), dry_run=False, log=lambda text: None)
    assert m.unmet((stages.PACKAGE, stages.EXTENSION)) == ""
    assert copied == [(str(kept / "_C.cpython-test.so"), os.path.join(REPO, "bertfast", "_C.cpython-test.so"))]
    assert [(r["step"], r["status"]) for r in m.restores] == [("restore extension", "ok")]


def test_replace_is_atomic_and_error_excerpt_picks_the_compiler_errors(tmp_path):
    from bertfast.gpucheck.machine import _replace, error_excerpt
    src, dest = tmp_path / "new.so", tmp_path / "old.so"
    src.write_bytes(b"new")
    dest.write_bytes(b"old")
    _replace(str(src), str(dest))
    assert dest.read_bytes() == b"new" and sorted(os.listdir(tmp_path)) == ["new.so", "old.so"]
    log = tmp_path / "build.log"
    log.write_text("$ python setup.py build_ext\nninja: build stopped\na.cu(3): error: bad\nb.cu(9): error: worse\n"
                   "RuntimeError: compile failed\n")
    assert error_excerpt(str(log)) == "a.cu(3): error: bad | b.cu(9): error: worse"
    log.write_text("line one\nKilled\n")
    assert error_excerpt(str(log)) == "line one | Killed"


# --------------------------------------------------------------------------- pytest's progress
def test_pytest_stopped_at_its_limit_still_gives_counts_and_the_tests_not_reached(tmp_path):
    stage_dir = tmp_path / "stage2-tests"
    stage_dir.mkdir()
    lines = [{"event": "collected", "ids": ["t.py::a", "t.py::b", "t.py::hang", "t.py::c"]},
             {"event": "start", "id": "t.py::a"}, {"event": "result", "id": "t.py::a", "outcome": "passed"},
             {"event": "start", "id": "t.py::b"}, {"event": "result", "id": "t.py::b", "outcome": "failed"},
             {"event": "start", "id": "t.py::hang"}]
    (stage_dir / "progress.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    log = tmp_path / "pytest.log"
    log.write_text("..F\n[gpu-check] stopped at the step's limit of 300 s\n")
    found = runner.findings(Step("pytest", [], 1), str(log), str(tmp_path), "stage2-tests")
    assert found == "stopped before the end: 1 passed, 1 failed; running: t.py::hang; 1 of 4 not reached"
    assert (stage_dir / "not-reached.txt").read_text() == "running when stopped: t.py::hang\nt.py::c\n"


# --------------------------------------------------------------------------- requirements
def test_requirements_report_versions_and_what_is_missing():
    from bertfast.gpucheck import requirements as req
    found = req.check()
    names = {f.name.split(">")[0]: f for f in found}
    assert {"torch", "transformers", "safetensors", "numpy", "tqdm"} <= {f.name.split(">")[0] for f in found
                                                                          if f.kind == "runtime"}
    assert names["transformers"].ok and names["transformers"].version
    old = req.check_requirement("transformers>=99.0", "runtime")
    missing = req.check_requirement("no-such-package-bertfast>=1", "runtime")
    assert not old.ok and "TOO OLD" in old.line and not missing.ok and "MISSING" in missing.line
    assert req.verdict([old, missing]) == ("MISSING: transformers>=99.0 (found " + old.version + "), "
                                           "no-such-package-bertfast>=1 (found nothing)")
    assert req.verdict(found).startswith("all 5 runtime requirements met")
    res = subprocess.run([sys.executable, "-m", "bertfast.gpucheck.requirements"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert res.returncode == 0 and "transformers>=5.17" in res.stdout and "pytest-xdist" in res.stdout


# --------------------------------------------------------------------------- sizing
def test_sizing_is_current_with_the_kernels_and_the_bench(monkeypatch):
    """measured.json's candidate counts are what the code makes today (re-measure with `make gpu-sizing`
    when a kernel's candidate list changes), and stage 3 sizes the model suite's own cases."""
    from bertfast.bench.model_suite import GPU_CASES
    from bertfast.gpucheck import sizing
    from bertfast.kernels import _common

    monkeypatch.setattr(_common, "interpreting", lambda: False)
    assert list(sizing.HEADLINE_CASES) == GPU_CASES["pretrain"]
    counts = sizing.headline_counts()
    assert counts == sizing.measured()["headline"], "kernel candidates changed: run `make gpu-sizing`"
    kernels = {k for entry in counts for k in entry["compiles"]}
    assert kernels <= set(sizing.measured()["triton"]) and counts[0]["compiles"] and counts[0]["timings"]
    assert sizing.measured()["tests"] > 300
    # Every source the build compiles was timed as it is: the backward's nvcc time tripled (17 to 62 s)
    # while measured.json kept the old one, and stage 1's build limit (50 s) would have stopped the build.
    sources = {p.name for p in (Path(REPO) / "csrc").glob("*.cu")}
    assert set(sizing.measured()["nvcc_s"]) == sources, "csrc/*.cu changed: run `make gpu-sizing`"
    stale = sorted(k for k, v in sizing.csrc_digests().items() if sizing.measured()["csrc_digest"].get(k) != v)
    assert not stale, f"{stale} or a header they include changed since nvcc was timed: run `make gpu-sizing`"
    # the newest GPU run's tests price stage 2, at today's count give or take 3%
    assert sizing.measured()["gpu_tests"] == sizing._gpu_run_tests(), "a GPU run was filed: run `make gpu-sizing`"
    today = sizing._count_tests()[0]
    assert abs(today - sizing.measured()["tests"]) <= 0.03 * today, \
        f"stage 2 selects {today} tests, measured.json says {sizing.measured()['tests']}: run `make gpu-sizing`"


def test_compile_groups_put_one_kernel_variants_data_cases_together():
    from bertfast.gpucheck import compile_groups as cg
    padded = "tests/ops/test_attention_gpu_sizes.py::test_gpu_padded_awkward_length_every_head_dim"
    name = "test_gpu_padded_awkward_length_every_head_dim:triton-fp32-256"
    assert cg.group(f"{padded}[triton-fp32-256-nomask]") == name
    assert cg.group(f"{padded}[triton-fp32-256-scattered]") == name
    assert cg.group(f"{padded}[cuda-fp32-256-nomask]") is None  # built once, nothing to share
    assert cg.group("tests/ops/test_attention.py::test_head_dims[triton-d256-fp32]") is None
    durations = {f"{padded}[triton-fp32-256-{k}]": s for k, s in [("nomask", 40.0), ("random", 30.0), ("empty", 1.0)]}
    durations[f"{padded}[torch-fp32-256-empty]"] = 2.0
    assert cg.grouped_seconds(durations) == 40.0 + 2 * 1.0 + 2.0


def test_stage_two_runs_the_groups_on_one_worker():
    """With the compile_groups plugin, xdist sends a group's tests to one worker together (on the
    pytest of CI and of this machine alike: xdist's own --dist loadgroup groups nothing on pytest 9.2)."""
    res = subprocess.run([sys.executable, "-m", "pytest", "-v", "-n", "2", "-p", "bertfast.gpucheck.compile_groups",
                          "-p", "no:cacheprovider", "tests/ops/test_attention_gpu_sizes.py", "-k",
                          "padded_awkward and fp32-16"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    workers = {}
    for line in res.stdout.splitlines():
        if line.startswith("[gw") and "[triton-fp32-16-" in line:
            workers.setdefault(line.split()[0], []).append(line)
    assert len(workers) == 1 and len(next(iter(workers.values()))) == 4, workers


def test_headline_falls_back_to_fixed_configs_where_tuning_does_not_fit(monkeypatch):
    from bertfast.gpucheck import sizing
    tuned = stages.headline_step()
    assert tuned.env == {} and tuned.limit_s <= stages.HEADLINE_CAP_S and tuned.sizing.startswith("tuned")
    budget = int(tuned.argv[tuned.argv.index("--time-budget") + 1])
    assert tuned.limit_s - budget == math.ceil(max(c.seconds for c in sizing.headline_cases()))
    # only the headline case fits tuned: tuned at the cap, the budget leaving out the cases it does not reach
    monkeypatch.setattr(sizing, "MICRO_BATCH_S", {"bert-base": 10.0, "bert-large": 10.0})
    capped = stages.headline_step()
    assert capped.env == {} and "capped at" in capped.sizing
    assert capped.limit_s + sizing.install().limit_s == stages.HEADLINE_CAP_S
    monkeypatch.setattr(sizing, "MICRO_BATCH_S", {"bert-base": 0.0, "bert-large": 0.0})
    monkeypatch.setattr(sizing, "CASE_S", {"bert-base": 1.0, "bert-large": 1.0})
    every = stages.headline_step()
    assert every.env == {} and "capped" not in every.sizing and every.limit_s < capped.limit_s
    monkeypatch.undo()
    monkeypatch.setattr(sizing, "CPU_SPEED", 0.1)  # a machine whose compiles take 10x longer
    fixed = stages.headline_step()
    assert fixed.env == {"BERTFAST_AUTOTUNE": "0"} and fixed.sizing.startswith("fixed configs")
    assert fixed.limit_s <= stages.HEADLINE_CAP_S


# --------------------------------------------------------------------------- failures, simulated on CPU
def _dry_run(out, *args, timeout=900):
    res = subprocess.run([sys.executable, "-m", "bertfast.gpucheck", "run", "--dry-run", "--out", str(out), *args],
                         capture_output=True, text=True, cwd=REPO, timeout=timeout)
    summary = json.loads((out / "summary.json").read_text())
    steps = {(s["stage"], r["step"]): r for s in summary["stages"] for r in s["steps"]}
    return res, summary, steps


def test_dry_run_simulates_crashes_and_a_hang_and_the_other_steps_still_run(tmp_path):
    out = tmp_path / "gpu-out"
    res, summary, steps = _dry_run(out, "--stage", "1", "--stage", "2", "--simulate", "crash:info",
                                   "--simulate", "hang:memcheck", "--simulate", "crash:pytest")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-2000:]
    assert steps[(1, "requirements")]["status"] == "ok"
    assert steps[(1, "info")]["status"] == "crashed" and steps[(1, "info")]["detail"] == "killed by SIGSEGV"
    memcheck = steps[(1, "memcheck")]
    assert memcheck["status"] == "timed out" and memcheck["seconds"] < 30 and memcheck["simulated"] == "hang"
    pytest_run = steps[(2, "pytest")]
    assert pytest_run["status"] == "crashed" and pytest_run["findings"] == (
        "stopped before the end: 2 passed; running: test_simulated.py::test_crashes; 2 of 5 not reached")
    assert (out / "stage2-tests" / "not-reached.txt").read_text().splitlines() == [
        "running when stopped: test_simulated.py::test_crashes", "test_simulated.py::test_after_1",
        "test_simulated.py::test_after_2"]
    table = (out / "summary.md").read_text()
    assert "| 1 build | info | crashed |" in table and "(simulated crash) killed by SIGSEGV" in table
    assert "| 1 build | memcheck | timed out |" in table and "stopped at its 5 s limit" in table
    assert "| 2 tests | pytest | crashed |" in table and "2 of 5 not reached" in table
    assert [s["status"] for s in summary["stages"]] == ["failed", "failed"]


def test_dry_run_simulates_a_failed_build_and_a_lost_machine(tmp_path):
    """The extension does not build, stage 2's pytest hangs, and every stage starts on a fresh machine:
    the Triton steps and the benchmark still run, and the summary says what happened at each step."""
    out = tmp_path / "gpu-out"
    res, summary, steps = _dry_run(out, "--stage", "1", "--stage", "2", "--stage", "3", "--simulate", "fail:build",
                                   "--simulate", "hang:pytest", "--simulate", "lost-machine")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-2000:]
    quote = "build: error: simulated failure (--simulate fail:build)"
    assert steps[(1, "build")]["status"] == "failed" and quote in (out / "cache" / "ext" / "build.json").read_text()
    assert steps[(1, "build")]["findings"] == quote
    assert steps[(1, "info")]["status"] == "ok"
    assert "not loaded (BERTFAST_SKIP_EXTENSION is set): the CUDA extension did not build" in \
        steps[(1, "info")]["findings"] and quote in steps[(1, "info")]["findings"]
    assert steps[(1, "memcheck")]["status"] == "skipped" and quote in steps[(1, "memcheck")]["detail"]
    for stage in (2, 3):
        assert steps[(stage, "restore re-install")]["status"] == "ok"
        assert "dry run: the installed package stands in" in steps[(stage, "restore re-install")]["detail"]
        assert quote in steps[(stage, "extension")]["detail"]
    pytest_run = steps[(2, "pytest")]
    assert pytest_run["status"] == "timed out" and pytest_run["findings"] == (
        "stopped before the end: 2 passed; running: test_simulated.py::test_hangs; 2 of 5 not reached")
    assert steps[(3, "pretrain")]["status"] == "ok"
    rows = json.loads((out / "stage3-headline" / "pretrain" / "results.json").read_text())["rows"]
    assert any(r["impl"] == "bertfast" and r["status"] == "ok" for r in rows)
    table = (out / "summary.md").read_text()
    assert "| 3 headline | restore re-install | ok |" in table and "| 3 headline | pretrain | ok |" in table
    assert "this stage runs without it: the CUDA extension did not build in stage 1" in table


def test_sizing_against_a_gpu_run_puts_each_limit_beside_its_duration(tmp_path):
    from bertfast.gpucheck import sizing
    summary = {"stages": [{"stage": 1, "steps": [{"step": "memcheck", "status": "timed out", "seconds": 80.2}]}]}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    lines = sizing.against(str(tmp_path / "summary.json")).splitlines()
    memcheck = next(ln for ln in lines if " memcheck " in ln).split()
    limit = next(step.limit_s for step in stages.stage(1).steps if step.name == "memcheck")
    assert memcheck == ["1", "memcheck", str(limit), "80", "timed", "out"]
    assert next(ln for ln in lines if " pytest " in ln).endswith("not run")


def test_steps_chosen_by_step_or_skip_and_the_summary_keeps_each_steps_newest_result(tmp_path, monkeypatch):
    """The sanitizers run in a second `run` beside stage 2 (scripts/gpu-loan.sh): stage 1 is then
    recorded by two runs, and the summary holds both runs' steps, in the stage's order, whichever
    writes last; two writers at once lose nothing (the summary is written under a lock)."""
    assert runner.step_filter([1, 2], skip=["memcheck", "racecheck"]) == {
        1: ["install", "requirements", "build", "info", "mma-rate"], 2: ["pytest"]}
    assert runner.step_filter([1, 2], steps=["memcheck", "racecheck"]) == {1: ["memcheck", "racecheck"]}
    assert runner.step_filter([3]) == {3: None}
    with pytest.raises(ValueError, match=r"expected a step of stage\(s\) 3 \(pretrain\), got 'memcheck'"):
        runner.step_filter([3], steps=["memcheck"])
    assert runner.main(["run", "--out", str(tmp_path), "--dry-run", "--stage", "2", "--step", "build"]) == 2

    quick = [sys.executable, "-c", "print('ok')"]
    fake = Stage(1, "build", "test", [Step(name, quick, 30, needs=()) for name in
                                      ("install", "requirements", "build", "info", "memcheck", "racecheck")])
    monkeypatch.setattr(runner, "get_stage", lambda k: fake)
    monkeypatch.setattr(runner, "_device_label", lambda dry_run: "test device")
    out, log = str(tmp_path), (lambda text: None)
    main = runner.run_stage(fake, out, False, log, _ready_machine(tmp_path), only=["install", "build", "info"])
    sanitizers = runner.run_stage(fake, out, False, log, _ready_machine(tmp_path), only=["memcheck", "racecheck"])
    assert [r["step"] for r in sanitizers["steps"]] == ["memcheck", "racecheck"]
    runner.write_summary(out, [sanitizers], dry_run=False)
    runner.write_summary(out, [main], dry_run=False)
    failed = dict(sanitizers, status="failed", steps=[dict(sanitizers["steps"][1], status="failed")])
    runner.write_summary(out, [failed], dry_run=False)   # racecheck again, failing this time
    stage1 = json.load(open(os.path.join(out, "summary.json")))["stages"][0]
    assert [r["step"] for r in stage1["steps"]] == ["install", "build", "info", "memcheck", "racecheck"]
    assert [r["status"] for r in stage1["steps"]] == ["ok", "ok", "ok", "ok", "failed"]
    assert stage1["status"] == "failed"

    import threading
    os.remove(os.path.join(out, "summary.json"))
    writers = [threading.Thread(target=runner.write_summary, args=(out, [rec], False)) for rec in (main, sanitizers)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stage1 = json.load(open(os.path.join(out, "summary.json")))["stages"][0]
    assert [r["step"] for r in stage1["steps"]] == ["install", "build", "info", "memcheck", "racecheck"]


def test_a_deadline_cuts_a_steps_limit_and_a_step_with_no_time_left_is_not_started(tmp_path):
    """A loan's command ends at its deadline with its logs (scripts/gpu-loan.sh passes --until): the
    step running then is stopped in time to end by the deadline, not at its own limit, even where it
    ignores SIGTERM for the whole grace (the H100 run of 2026-11-26 overran by the 10 s its bench took
    to write its results), and the next is not started."""
    import time
    slow = Step("info", [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                         "print('started', flush=True); time.sleep(60)"], 120, needs=())
    after = Step("memcheck", [sys.executable, "-c", "print('never')"], 30, needs=())
    stage = Stage(1, "build", "test", [slow, after])
    start = time.time()
    record = runner.run_stage(stage, str(tmp_path), False, lambda text: None, _ready_machine(tmp_path),
                              until=start + 28)
    took = time.time() - start
    steps = {r["step"]: r for r in record["steps"]}
    assert steps["info"]["status"] == "timed out" and 15 <= steps["info"]["limit_s"] <= 18
    assert steps["info"]["cut_from_s"] == 120 and took < 28 + 2  # the deadline, and the runner's bookkeeping
    assert steps["memcheck"]["status"] == "skipped" and "left before the deadline" in steps["memcheck"]["detail"]
    assert not (tmp_path / "stage1-build" / "memcheck.log").exists()
    table = runner.summary_table({"stages": [record]})
    assert "(limit cut from 120 s by the deadline)" in table and "not started" in table
