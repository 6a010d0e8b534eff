"""The bench's results files: results.json round trips (old files included), results.md and its
plots, the results directory, merged runs and the README table, so a run reads back as it was measured."""
from __future__ import annotations

import json
import os

import pytest

from bertfast.bench import cli, device as devmod, report
from bertfast.bench.results import FAILED_PARITY, TORCH_EAGER, Row, Run
from bertfast.bench.targets import evaluate_targets
from bertfast.bench.timing import Stat
from bench_helpers import _check_png, _fake_device, _row, _synthetic_run


def test_a_gpu_run_names_its_host_cpu():
    """Host-bound eager steps run at the host's pace: a GPU run's header names its CPU, and results
    written before the field existed still load (without one)."""
    info = _fake_device("cuda")
    info.host_cpu, info.cpu_threads = "Fake Xeon 8480", 16
    assert "host Fake Xeon 8480 (16 threads)" in info.describe()
    assert devmod.DeviceInfo.from_dict(info.to_dict()).host_cpu == "Fake Xeon 8480"
    old = {k: v for k, v in info.to_dict().items() if k != "host_cpu"}
    assert "CPU not recorded" in devmod.DeviceInfo.from_dict(old).describe()


def test_a_failed_row_carries_no_speed():
    with pytest.raises(ValueError, match="carries no timing"):
        Row("kernels", "bias_gelu", {}, "fwd", "bertfast:triton", status=FAILED_PARITY, time_ms=Stat(1, 1, 1, 1))


def test_report_files_parse(tmp_path):
    run = _synthetic_run()
    paths = report.write(run, str(tmp_path))
    data = json.load(open(paths["json"]))
    assert data["device"]["name"] == "Fake GPU 80GB"
    assert data["device"]["copy_bandwidth_gbps"]["median"] == 3000.0
    assert len(data["rows"]) == len(run.rows) and len(data["targets"]) == len(run.targets)
    first = data["rows"][0]
    assert set(first["time_ms"]) == {"median", "p20", "p80", "n"}
    again = report.load(paths["json"])
    assert again.rows[0].time_ms == run.rows[0].time_ms and again.targets == run.targets
    md = open(paths["markdown"]).read()
    assert "## Targets" in md and "| BERT-base seq-128 training step >= 50% MFU | **met** |" in md
    assert "**not met**" in md and "Fake GPU 80GB" in md and "## Kernel suite" in md and "## Model suite" in md
    _check_png(paths["kernels_png"])
    _check_png(paths["model_png"])
    # speedup vs the baseline of the same case: eager 3 ms / triton 1 ms.
    triton_row = next(r for r in run.rows if r.group == "bias_gelu" and r.impl == "bertfast:triton")
    assert report.speedup(run, triton_row) == pytest.approx(3.0)


def test_plot_labels_tell_every_case_apart_and_a_cpu_plot_says_what_it_measures(tmp_path, monkeypatch):
    """Issue: attention with and without dropout were one label on the plot (dropout was hidden), and a
    quick CPU run's 0.003x-400x bars looked like speed. Each bar names the fields that vary within its
    group (the shared ones go in the group's title), and a CPU plot carries its note."""
    att = dict(batch=2, seqlen=16, heads=2, head_dim=16)
    rows = []
    for padding, real_tokens in (("none", 32), ("finetune", 16)):
        for dropout in (0.0, 0.1):
            case = dict(att, padding=padding, real_tokens=real_tokens, dropout=dropout, dtype="fp32")
            rows += [_row("attention", "bertfast:torch varlen", 2.0, **case),
                     _row("attention", TORCH_EAGER, 1.0, **case)]
    rows += [_row("bias_gelu", "bertfast:torch", 2.0, tokens=64, dtype="fp32"),
             _row("bias_gelu", TORCH_EAGER, 1.0, tokens=64, dtype="fp32")]
    run = Run(device=_fake_device("cpu"), config={"quick": True}, rows=rows)
    series = report._speedup_series(run, "kernels")
    title, bars = series["attention"]
    assert title == "attention (batch=2,seqlen=16,heads=2,head_dim=16,dtype=fp32)"
    labels = [label for label, _, _ in bars]
    assert len(set(labels)) == len(labels) == 4
    assert "padding=none,dropout=0.1 fwd+bwd" in labels and "padding=none,dropout=0.0 fwd+bwd" in labels
    assert series["bias_gelu"] == ("bias_gelu (tokens=64,dtype=fp32)", [("fwd+bwd", "bertfast:torch", 0.5)])
    # a derived field is shown when only it tells rows apart
    only_fill = [_row("x", "a", 1.0, fill=0.5), _row("x", "a", 1.0, fill=1.0)]
    assert report.case_fields(only_fill) == (["fill"], {})

    note = report.plot_note(run)
    assert "tiny shapes" in note and "harness" in note and "not kernel speed" in note
    assert note in report.summary(run)
    texts = []
    import matplotlib.figure
    real_text = matplotlib.figure.Figure.text
    monkeypatch.setattr(matplotlib.figure.Figure, "text",
                        lambda self, x, y, s, *a, **k: texts.append(s) or real_text(self, x, y, s, *a, **k))
    _check_png(report.plot_speedups(run, "kernels", str(tmp_path / "cpu.png")))
    assert any("measure the harness" in t.replace("\n", " ") for t in texts)
    run.device = _fake_device("cuda")
    texts.clear()
    report.plot_speedups(run, "kernels", str(tmp_path / "gpu.png"))
    assert report.plot_note(run) is None and not any("harness" in t for t in texts)


def test_results_directory_layout():
    assert devmod.slugify("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    import datetime
    when = datetime.datetime(2025, 3, 4)
    assert cli.default_out_dir(_fake_device("cuda"), quick=False, when=when) == os.path.join(
        "benchmarks/results", "fake-gpu-80gb", "2025-03-04")
    assert cli.default_out_dir(_fake_device("cuda"), quick=True, when=when).startswith("bench-out")
    assert cli.default_out_dir(_fake_device("cpu"), quick=False, when=when).startswith("bench-out")


def test_results_list_the_autotuned_configs_in_a_table_not_in_the_config_line():
    """A GPU run's autotuner choices (config["tuned_configs"], a merged run's per part) get their own
    table in results.md, once per kernel and key; the config line leaves them out."""
    from bertfast.bench import device as devmod
    chosen = {"_bias_gelu_fwd_kernel": [{"key": [3072, 16384, False, "torch.bfloat16"],
                                         "config": "BLOCK_F=1024 BLOCK_N=4 num_warps=8 num_stages=3"}]}
    run = Run(device=devmod.detect("cpu"), config={"parts": [{"suite": "model", "tuned_configs": chosen},
                                                             {"suite": "kernels", "tuned_configs": chosen}]})
    md = report.markdown(run)
    config_line = next(line for line in md.splitlines() if line.startswith("- config:"))
    assert "tuned_configs" not in config_line and '"suite": "kernels"' in config_line
    table = md.split("## Autotuned configs", 1)[1].split("## Conventions")[0]
    assert table.count("_bias_gelu_fwd_kernel") == 1
    assert '`[3072, 16384, false, "torch.bfloat16"]` | BLOCK_F=1024 BLOCK_N=4 num_warps=8 num_stages=3' in table
    assert "## Autotuned configs" not in report.markdown(Run(device=run.device, config={}))


def test_merge_runs_and_readme_table(tmp_path):
    from bertfast.bench.merge import main as merge_main, merge_runs
    from bertfast.bench.readme import BEGIN, END, update_readme
    full = _synthetic_run()
    a, b = tmp_path / "a", tmp_path / "b"
    report.write(Run(device=full.device, config={"part": "a"}, rows=full.rows[:6], notes=["n1"]), str(a))
    report.write(Run(device=full.device, config={"part": "b"}, rows=full.rows[6:], notes=["n1", "n2"]), str(b))
    merged = merge_runs([str(a), str(b)])
    assert len(merged.rows) == len(full.rows) and merged.notes == ["n1", "n2"]
    assert [t["status"] for t in merged.targets] == [t["status"] for t in evaluate_targets(full)]
    assert merged.config["parts"] == [{"part": "a"}, {"part": "b"}]
    assert merge_main(["--out", str(tmp_path / "m"), str(a), str(b)]) == 0
    assert (tmp_path / "m" / "results.json").exists()
    with pytest.raises(FileNotFoundError, match="results.json"):
        merge_runs([str(a), str(tmp_path / "nowhere")])
    other = _fake_device("cuda")
    other.name = "Other GPU"
    report.write(Run(device=other, config={}, rows=[]), str(tmp_path / "c"))
    with pytest.raises(ValueError, match="Other GPU"):
        merge_runs([str(a), str(tmp_path / "c")])

    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n")
    update_readme(str(readme), [(merged, "benchmarks/results/fake-gpu-80gb/2026-01-01")])
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n" + BEGIN) and text.endswith(END + "\nafter\n")
    assert "old table" not in text and "Fake GPU 80GB" in text and "benchmarks/results/fake-gpu-80gb" in text
    assert "| BERT-base seq-128 training step >= 50% MFU | met |" in text
    with pytest.raises(ValueError, match="CPU run"):
        update_readme(str(readme), [(_synthetic_run("cpu"), "x")])
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="expected the lines"):
        update_readme(str(readme), [(merged, "x")])


def test_readme_table_takes_each_target_from_the_newest_run_that_measured_it(tmp_path):
    """A loan measures some targets: each line is the newest run that measured its target (met, not
    met, or a value from part of its cases), named on the line; a target none measured shows the
    newest run's line; the runs may come in any order."""
    from bertfast.bench.readme import BEGIN, END, filed_runs, main as readme_main, render_table
    old = _synthetic_run()
    old.date = "2026-01-01T00:00:00+00:00"
    new = Run(device=old.device, config={}, rows=[r for r in old.rows if r.suite == "kernels"])
    new.date = "2026-01-02T00:00:00+00:00"
    new.targets = evaluate_targets(new)
    by_id = {t["id"]: t for t in new.targets}
    assert by_id["mfu_base_128"]["status"] == "not measured" and by_id["row_ops_bandwidth"]["status"] == "met"
    for t in new.targets:  # one line the newer run changed, to tell the runs apart
        if t["id"] == "row_ops_bandwidth":
            t["detail"] += " (the newer run)"
    new.targets.append({"id": "nobody", "target": "a target no run measured", "status": "not measured",
                        "value": None, "detail": "no matching cases in this run", "device": "x"})
    lines = {line.split(" | ")[0][2:]: line
             for line in render_table([(old, "runs/old"), (new, "runs/new")]).splitlines() if line.startswith("| ")}
    assert lines["BERT-base seq-128 training step >= 50% MFU"].endswith(
        "| met | 0.55 | MFU 55.0% of the measured peak (GPU not in the datasheet table) (global batch 256 = 2 x 128) | "
        "Fake GPU 80GB, `runs/old` |")
    row_ops = next(line for name, line in lines.items() if name.startswith("row ops"))
    assert "(the newer run)" in row_ops and row_ops.endswith("`runs/new` |")
    assert lines["a target no run measured"].endswith("| not measured |  | no matching cases in this run | "
                                                      "Fake GPU 80GB, `runs/new` |")
    assert render_table([(new, "runs/new"), (old, "runs/old")]) == render_table([(old, "runs/old"), (new, "runs/new")])
    # from the files: every run filed under benchmarks/results/, or the directories named
    for run, where in ((old, "old"), (new, "new")):
        report.write(run, str(tmp_path / "benchmarks" / "results" / "fake-gpu-80gb" / where))
    readme = tmp_path / "README.md"
    readme.write_text(f"{BEGIN}\n{END}\n")
    assert [where for _, where in filed_runs(str(tmp_path))] == ["benchmarks/results/fake-gpu-80gb/new",
                                                                 "benchmarks/results/fake-gpu-80gb/old"]
    assert readme_main(["--readme", str(readme)]) == 0
    assert "`benchmarks/results/fake-gpu-80gb/old` |" in readme.read_text()
    newest = tmp_path / "benchmarks" / "results" / "fake-gpu-80gb" / "new"
    assert readme_main(["--readme", str(readme), str(newest)]) == 0
    assert "fake-gpu-80gb/old" not in readme.read_text()
    assert readme_main(["--readme", str(readme), str(tmp_path / "nowhere")]) == 2


def test_row_timing_method_round_trips_and_old_files_load():
    row = _row("bias_gelu", "bertfast:triton", 0.01, "fwd")
    row.timing = "cuda graph replay"
    assert Row.from_dict(row.to_dict()).timing == "cuda graph replay"
    old = row.to_dict()
    del old["timing"]
    assert Row.from_dict(old).timing == ""
