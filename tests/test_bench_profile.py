"""Where a step's time goes: bertfast.bench.profile's reports (also rebuilt from a stopped profile's
trace) and bertfast.bench.ncu's summary and target, which the GPU check runs after the headline."""
from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest


@pytest.mark.gpu
def test_gpu_ncu_target_finds_each_ops_case_at_bert_large_shapes(capsys):
    """The ncu step's target (bertfast/bench/ncu.py target_cases) is among the GPU's kernel-suite cases
    for every op, and runs each one's forward and backward (no ncu attached: the profiler calls are
    no-ops), so a speed loan's ncu step does not fail on a case the suite no longer lists; so is the
    attention target's case at seq 512, through both backwards."""
    from bertfast.bench import ncu
    profiled = ncu.profiled_ops()
    assert ncu.run_target(profiled, "triton", dry_run=False, warmup=1) == 0
    ran = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ncu target: ran")]
    assert [line.split()[3] for line in ran] == profiled
    layernorm = ran[profiled.index("bias_dropout_residual_layernorm")]
    assert '"tokens": 16384' in layernorm and '"dropout": 0.1' in layernorm
    ffn = ran[profiled.index("bias_gelu")]  # the FFN, whose GEMMs run GELU in training
    assert '"hidden": 1024' in ffn and '"features": 4096' in ffn
    assert ncu.run_target(["attention"], "triton", dry_run=False, warmup=1, profile_set="attention-512") == 0
    ran = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ncu target: ran")]
    assert len(ran) == 2 and all('"seqlen": 512' in line and '"heads": 16' in line for line in ran)
    assert ran[0].endswith("(bertfast:triton varlen): a training forward and its backward")
    assert "(bertfast:triton varlen atomic-dq)" in ran[1]


def test_profile_writes_where_a_steps_time_goes(tmp_path):
    """bertfast.bench.profile (the GPU check runs it after the headline) on CPU: the report per
    implementation and the side-by-side summary; an unknown implementation is a clear error."""
    from bertfast.bench import profile
    out = tmp_path / "prof"
    assert profile.main(["--device", "cpu", "--model", "tiny", "--seqlen", "16", "--batch", "2", "--warmup", "1",
                         "--steps", "1", "--impls", "bertfast", "--out", str(out), "--trace"]) == 0
    text = (out / "bertfast.txt").read_text()
    import gzip, json
    trace = json.loads(gzip.open(out / "bertfast.trace.json.gz").read())
    assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
    assert profile.trace_steps(trace["traceEvents"]) == 1  # the step's own annotation
    assert not (out / "bertfast.trace.json").exists()
    assert text.startswith("tiny seq 16 batch 2, fp32 on CPU") and "wall per step" in text
    assert "aten::" in text  # the host ops by self time
    assert "autotuned configs: none" in text  # nothing is tuned on CPU (a GPU run lists its choices)
    assert "bertfast" in (out / "summary.txt").read_text()
    # the host's Python by function: bertfast's own op wrappers among them
    python = (out / "bertfast.python.txt").read_text()
    assert "1 step under cProfile" in python and "Ordered by: internal time" in python
    assert "Ordered by: cumulative time" in python and "bertfast/ops/" in python
    assert profile.main(["--device", "cpu", "--impls", "bertfast,deepspeed", "--out", str(out)]) == 2


def test_profile_rebuilt_from_a_stopped_profiles_trace(tmp_path):
    """--from-trace: a profile stopped after its trace was written (the H200 run of 2026-11-27) still
    gives the kernel table the perf model reads, per step (the trace's optimizer calls), the device's
    busy time a union of spans; the wall time and host ops said to be missing, not made up."""
    import gzip, json
    from bertfast.bench import profile
    from bertfast.perfmodel.runs import read_profile
    events = [{"cat": "user_annotation", "name": "Optimizer.step#AdamW.step", "ts": 0, "dur": 1}] * 2 + [
        {"cat": "kernel", "name": "_bias_gelu_fwd_kernel", "ts": 0, "dur": 30},
        {"cat": "kernel", "name": "nvjet_sm90_gemm", "ts": 10, "dur": 40},  # overlaps the first: busy once
        {"cat": "gpu_memset", "name": "Memset (Device)", "ts": 60, "dur": 20},
        {"cat": "kernel", "name": "_bias_gelu_fwd_kernel", "ts": 100, "dur": 50},
        {"cat": "kernel", "name": "nvjet_sm90_gemm", "ts": 150, "dur": 20},
        {"cat": "gpu_memset", "name": "Memset (Device)", "ts": 200, "dur": 20},
        {"cat": "gpu_user_annotation", "name": "Optimizer.step#AdamW.step", "ts": 0, "dur": 500},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 900}]
    trace = tmp_path / "bertfast.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events, "deviceProperties": [{"name": "NVIDIA H200"}]}, f)
    out = tmp_path / "prof"
    assert profile.main(["--from-trace", str(trace), "--out", str(out)]) == 0
    text = (out / "bertfast.txt").read_text()
    assert "wall per step not in the trace; device busy 0.08 ms; kernels 0.09 ms; 3 device ops" in text
    assert "host ops: not rebuilt" in text and "2 steps" in text
    read = read_profile(str(out / "bertfast.txt"))
    assert read.device == "NVIDIA H200" and read.setting.label() == "bert-large seq 128 batch 128 bf16 p=0.1"
    assert read.kernels == {"_bias_gelu_fwd_kernel": (0.04, 1), "nvjet_sm90_gemm": (0.03, 1), "Memset": (0.02, 1)}
    # a trace of another implementation's name, or one without device events, is a clear error
    assert profile.main(["--from-trace", str(tmp_path / "deepspeed.trace.json"), "--out", str(out)]) == 2
    # a graph replay calls no optimizer on the host: its steps are counted by their annotations
    replays = [{"cat": "user_annotation", "name": profile.STEP_ANNOTATION, "ts": 0, "dur": 1}] * 3
    assert profile.trace_steps(replays + events[2:]) == 3 and profile.trace_steps(events) == 2
    empty = tmp_path / "graphs.trace.json"
    empty.write_text(json.dumps({"traceEvents": events[-1:]}))
    assert profile.main(["--from-trace", str(empty), "--out", str(out)]) == 2


def test_ncu_summary_reads_the_raw_page_and_the_target_runs_each_op(tmp_path, monkeypatch, capsys):
    """bertfast.bench.ncu: the raw page (a header of metrics, a row of units, a row per kernel) becomes
    a table per kernel with its time, DRAM bytes and rate, issue and occupancy, and its largest stall
    reasons, units converted, under a header saying how the kernels ran where the driver kept it; the
    target runs one training forward and backward of each op (on CPU, --dry-run), bias_gelu's through
    the FFN; without ncu the driver says so; the command profiles only the target's region."""
    import csv
    from bertfast.bench import ncu
    names = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Block Size", "Grid Size",
             "gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
             "dram__throughput.avg.pct_of_peak_sustained_elapsed", "smsp__issue_active.avg.pct_of_peak_sustained_active",
             "sm__warps_active.avg.pct_of_peak_sustained_active", "sm__maximum_warps_per_active_cycle_pct",
             "launch__registers_per_thread", "launch__grid_size", "launch__block_size",
             "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
             "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
             "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"]
    units = ["", "", "", "", "", "", "", "usecond", "Mbyte", "Mbyte", "%", "%", "%", "%", "register/thread", "", "",
             "", "", ""]
    rows = [["0", "1", "python", "h", "_bias_dropout_residual_layernorm_fwd_kernel", "(64, 1, 1)", "(16384, 1, 1)",
             "44.40", "100.00", "34.20", "70.1", "55.0", "60.2", "100", "62", "16384", "64", "6.5", "2.25", "0.5"],
            ["1", "1", "python", "h", "_bias_gelu_fwd_kernel", "(256, 1, 1)", "(4096, 1, 1)",
             "1,200.5", "150.0", "150.0", "93.0", "30.0", "80.0", "100", "40", "4096", "256", "9.0", "0", "1.0"]]
    (tmp_path / "ncu-raw.csv").write_text("")
    with open(tmp_path / "ncu-raw.csv", "w", newline="") as f:
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows([names, units] + rows)
    assert ncu.main(["--summarize", str(tmp_path)]) == 0
    md = (tmp_path / "ncu.md").read_text()
    ln = next(line for line in md.splitlines() if line.startswith("| _bias_dropout_residual_layernorm_fwd"))
    # 134.2 MB in 44.4 us: 3,023 GB/s; 62 registers; the stalls largest first, none of 0 listed
    assert "| 44.4 | 134.2 | 3,023 | 70.1 |" in ln and "| 60.2 / 100.0 | 62 | 16,384 x 64 |" in ln
    assert ln.endswith("| long_scoreboard 6.5, barrier 2.2, wait 0.5 |")
    gelu = next(r for r in json.loads((tmp_path / "ncu.json").read_text()) if r["kernel"] == "_bias_gelu_fwd_kernel")
    assert gelu["time_us"] == pytest.approx(1200.5) and gelu["dram_bytes"] == pytest.approx(300e6)
    assert [s[0] for s in gelu["stalls"]] == ["long_scoreboard", "wait"]
    assert "Configs:" not in md  # no conditions kept: no header claims how the kernels ran
    monkeypatch.setenv("BERTFAST_AUTOTUNE", "0")
    (tmp_path / ncu.CONDITIONS).write_text(json.dumps(ncu.conditions(["attention"], "Beside the tests.")))
    assert ncu.main(["--summarize", str(tmp_path)]) == 0
    header = (tmp_path / "ncu.md").read_text().splitlines()[2]
    case = json.dumps(dict(ncu.target_cases()[ncu.profiled_ops().index("attention")].case))
    assert header == (f"Runs, in launch order: attention {case} (bertfast:triton varlen). Configs: each kernel's "
                      "first candidate (BERTFAST_AUTOTUNE=0), the config the perf model reads. Beside the tests.")
    # the attention target's set: its title, and its runs in launch order
    kept = ncu.conditions(["attention"], profile_set="attention-512")
    (tmp_path / ncu.CONDITIONS).write_text(json.dumps(kept))
    assert ncu.main(["--summarize", str(tmp_path)]) == 0
    md = (tmp_path / "ncu.md").read_text().splitlines()
    assert md[0] == "# ncu: the attention target's case at seq 512 (ncu-raw.csv)"
    assert md[2].startswith("Runs, in launch order: attention {\"batch\": 32, \"heads\": 16, \"head_dim\": 64")
    assert md[2].count('"seqlen": 512') == 2 and "(bertfast:triton varlen); attention" in md[2]
    assert "(bertfast:triton varlen atomic-dq). Configs:" in md[2]
    # a conditions file from before the runs were kept (the committed runs): its ops
    (tmp_path / ncu.CONDITIONS).write_text(json.dumps({"ops": ["attention"], "configs": "autotuned"}))
    assert ncu.main(["--summarize", str(tmp_path)]) == 0
    assert (tmp_path / "ncu.md").read_text().splitlines()[2] == "Ops: attention. Configs: autotuned."
    monkeypatch.setenv("BERTFAST_AUTOTUNE", "1")
    assert ncu.conditions(["attention"])["configs"].startswith("autotuned")
    (tmp_path / "ncu-raw.csv").write_text('"ID","Kernel Name"\n"",""\n')
    assert ncu.main(["--summarize", str(tmp_path)]) == 1  # no kernel: said, not an empty table

    assert ncu.main(["--target", "--dry-run", "--backend", "torch"]) == 0
    ran = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ncu target: ran")]
    assert [line.split()[3] for line in ran] == ncu.profiled_ops()
    # bias_gelu through its preference case, the FFN (where training runs it), whose fields its case names
    assert ncu.case_builder("bias_gelu") == "ffn" and ncu.case_builder("attention") == "attention"
    assert '"features": 128' in ran[ncu.profiled_ops().index("bias_gelu")]
    gelu = next(t for t in ncu.target_cases() if t.op == "bias_gelu")
    assert set(gelu.case) == {"tokens", "hidden", "features"} and gelu.variant == ""
    # the attention target's set: its case twice with Triton (deterministic, atomic dQ), once elsewhere
    triton = ncu.target_cases("attention-512")
    assert [t.variant for t in triton] == ["varlen", "varlen atomic-dq"]
    assert triton[0].case == {"batch": 32, "seqlen": 512, "heads": 16, "head_dim": 64, "padding": "none",
                              "dropout": 0.1}
    assert [t.variant for t in ncu.target_cases("attention-512", "cuda")] == ["varlen"]
    assert ncu.profiled_ops("attention-512") == ["attention"]
    assert ncu.main(["--target", "--dry-run", "--backend", "torch", "--set", "attention-512"]) == 0
    ran = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ncu target: ran")]
    assert len(ran) == 1 and ran[0].endswith("(bertfast:torch varlen): a training forward and its backward")
    assert ncu.main(["--target", "--set", "attention-512", "--ops", "bias_gelu"]) == 2
    assert "--ops expects some of attention (--set attention-512)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="profile set must be one of"):
        ncu.target_cases("attention-128")
    monkeypatch.setattr(ncu, "find_ncu", lambda: None)
    assert ncu.main(["--out", str(tmp_path / "n")]) == 2
    assert "no ncu" in capsys.readouterr().err
    cmd = ncu.ncu_command("ncu", "R", ["bias_gelu"], "triton")
    assert cmd[cmd.index("--profile-from-start") + 1] == "off" and cmd[cmd.index("--clock-control") + 1] == "none"
    assert cmd[-8:] == ["bertfast.bench.ncu", "--target", "--set", "step", "--ops", "bias_gelu", "--backend",
                        "triton"]
    assert ncu.ncu_command("ncu", "R", ["attention"], "triton", "attention-512")[-6:-4] == ["--set", "attention-512"]
    assert ncu.main(["--target", "--ops", "attention,softmax"]) == 2


def test_ncu_driver_keeps_how_the_kernels_ran_beside_the_report(tmp_path, monkeypatch):
    """The driver (what the GPU loan runs) on a stand-in ncu that writes a report and its CSV pages: it
    records the ops, the configs (first candidates under BERTFAST_AUTOTUNE=0) and the note, and ncu.md
    says them above the table."""
    from bertfast.bench import ncu
    fake = tmp_path / "ncu"
    fake.write_text(f"#!{sys.executable}\n" + textwrap.dedent('''\
        import os, sys
        args = sys.argv[1:]
        if "--import" in args:  # a CSV page: metric names, units, a kernel
            print('"ID","Kernel Name","gpu__time_duration.sum"')
            print('"","","usecond"')
            print('"0","_gemm_bias_gelu_kernel","250.0"')
        else:  # the profiling run: the report, and the target's exit status
            open(args[args.index("-o") + 1] + ".ncu-rep", "w").write("report")
            raise SystemExit(int(os.environ.get("FAKE_TARGET_EXIT", "0")))
        '''))
    fake.chmod(0o755)
    monkeypatch.setattr(ncu, "find_ncu", lambda: str(fake))
    monkeypatch.setenv("BERTFAST_AUTOTUNE", "0")
    out = tmp_path / "out"
    assert ncu.main(["--out", str(out), "--ops", "bias_gelu", "--note", "Beside the tests."]) == 0
    kept = json.loads((out / ncu.CONDITIONS).read_text())
    assert kept["ops"] == ["bias_gelu"] and "BERTFAST_AUTOTUNE=0" in kept["configs"] and kept["set"] == "step"
    assert kept["runs"] == ['bias_gelu {"tokens": 16384, "hidden": 1024, "features": 4096} (bertfast:triton)']
    md = (out / "ncu.md").read_text()
    assert "(bertfast:triton). Configs: each kernel's first candidate" in md and md.count("Beside the tests.") == 1
    assert "| _gemm_bias_gelu_kernel | 250.0 |" in md
    # an op the target left out: the kernels it did profile are still summarised, and the status says so
    monkeypatch.setenv("FAKE_TARGET_EXIT", "1")
    os.remove(out / "ncu.md")
    assert ncu.main(["--out", str(out), "--ops", "bias_gelu"]) == 1
    assert "| _gemm_bias_gelu_kernel | 250.0 |" in (out / "ncu.md").read_text()


def test_ncu_target_leaves_out_an_op_that_fails_and_profiles_the_others(monkeypatch, capsys):
    """One op's failure (here its case builder's) is said and leaves the other ops' kernels profiled,
    so a loan's ncu is not lost to one kernel that does not run; the exit status is then 1."""
    from bertfast.bench import kernel_cases, ncu
    builders = kernel_cases.case_builders()

    def broken(ctx):
        raise RuntimeError("the FFN's GEMM did not compile")
    monkeypatch.setattr(kernel_cases, "case_builders", lambda: dict(builders, ffn=broken))
    assert ncu.main(["--target", "--dry-run", "--backend", "torch", "--ops", "attention,bias_gelu"]) == 1
    out, err = capsys.readouterr()
    assert [line.split()[3] for line in out.splitlines() if line.startswith("ncu target: ran")] == ["attention"]
    assert "ncu target: bias_gelu: left out: RuntimeError: the FFN's GEMM did not compile" in err


def test_profile_counts_overlapping_kernels_once():
    """The device's busy time is the union of its kernels' spans (streams overlap), not their sum."""
    from bertfast.bench.profile import covered_time
    assert covered_time([(20, 25), (0, 10), (5, 15), (6, 7)]) == 20
    assert covered_time([]) == 0
