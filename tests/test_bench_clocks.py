"""The GPU's clocks while a case is timed (bertfast.bench.clocks): nvidia-smi's lines read, the busy
samples summarised, the sampler run against a stand-in nvidia-smi (the real one needs a GPU), and
the report and the MFU targets saying at what clock a step ran."""
from __future__ import annotations

import stat
import textwrap
import time

import pytest
import torch

from bertfast.bench import clocks
from bertfast.bench.report import markdown
from bertfast.bench.results import BERTFAST_GRAPHS, Row, Run
from bertfast.bench.targets import evaluate_targets
from bench_helpers import _row, _synthetic_run


def test_lines_read_and_busy_samples_summarised():
    lines = ["1980, 2619, 350.5, 45, 0x0000000000000000",
             "1755, 2619, 699.0, 61, 0x0000000000000004",  # power cap
             "1740, 2619, 700.2, 62, 0x0000000000000004",
             "345, 2619, 80.0, 40, 0x0000000000000001",  # idle: left out
             "1800, 2619, [N/A], 60, 0x0000000000000024",  # power cap and sw thermal; power unread
             "garbage", "1, 2, 3"]
    samples = clocks.parse_samples(lines)
    assert len(samples) == 5 and samples[4]["power_w"] is None and samples[4]["reasons"] == 0x24
    got = clocks.summarize_samples(samples, {"max_sm_mhz": 1980.0, "power_limit_w": 700.0})
    assert (got["samples"], got["idle_samples"]) == (4, 1)
    assert got["sm_mhz"]["median"] == pytest.approx(1777.5) and got["sm_mhz"]["n"] == 4
    assert got["power_w"]["n"] == 3  # the unread draw left out
    assert got["limits"] == {"power cap": 0.75, "sw thermal": 0.25}
    assert got["max_sm_mhz"] == 1980.0
    text = clocks.describe(got)
    assert text.startswith("SM 1,778 MHz [") and "of 1,980" in text and "of 700" in text
    assert text.endswith("power cap in 75% of samples; sw thermal in 25% of samples (4 samples)")


def test_no_busy_sample_is_said():
    idle = clocks.parse_samples(["345, 2619, 80.0, 40, 0x1"])
    assert "no sample with the GPU busy" in clocks.summarize_samples(idle)["error"]
    assert clocks.summarize_samples([])["error"] == "no sample read"
    assert clocks.describe({"error": "not sampled: no nvidia-smi on PATH"}) == \
        "clocks not sampled: no nvidia-smi on PATH"
    assert clocks.describe({}) == ""


FAKE_SMI = """\
#!/usr/bin/env bash
# A stand-in for nvidia-smi: the query's fields decide the answer; --loop-ms prints until killed.
query=""; loop=""
for a in "$@"; do
  case "$a" in
    --query-gpu=*) query="${a#--query-gpu=}";;
    --loop-ms=*) loop="${a#--loop-ms=}";;
  esac
done
case "$query" in
  *clocks_event_reasons*) [ -n "$OLD_DRIVER" ] && { echo "Field is not a valid field to query." >&2; exit 2; };;
esac
case "$query" in
  clocks.max.sm*) echo "1980, 3201, 700.00"; exit 0;;
esac
line="1755, 2619, 699.10, 61, 0x0000000000000004"
if [ -z "$loop" ]; then echo "$line"; exit 0; fi
while true; do echo "$line"; sleep 0.05; done
"""


@pytest.fixture
def fake_smi(tmp_path):
    path = tmp_path / "nvidia-smi"
    path.write_text(textwrap.dedent(FAKE_SMI))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.parametrize("old_driver", ["", "1"])
def test_sampler_runs_nvidia_smi_for_the_block(fake_smi, monkeypatch, old_driver):
    """The loop runs as long as the block and is stopped after it; a driver that does not know
    clocks_event_reasons is asked for clocks_throttle_reasons."""
    monkeypatch.setenv("OLD_DRIVER", old_driver)
    with clocks.ClockSampler(torch.device("cuda"), smi=fake_smi, gpu="GPU-test") as sampler:
        time.sleep(0.4)
    assert sampler.proc is None
    got = sampler.summary()
    assert "error" not in got, got
    assert got["samples"] >= 3 and got["sm_mhz"]["median"] == 1755.0
    assert got["limits"] == {"power cap": 1.0}
    assert (got["max_sm_mhz"], got["power_limit_w"]) == (1980.0, 700.0)
    assert sampler.fields[-1] == ("clocks_throttle_reasons.active" if old_driver else "clocks_event_reasons.active")


def test_sampler_errors_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(clocks.shutil, "which", lambda name: None)
    with clocks.ClockSampler(torch.device("cuda"), gpu="GPU-test") as sampler:
        pass
    assert sampler.summary() == {"error": "not sampled: no nvidia-smi on PATH"}
    failing = tmp_path / "nvidia-smi"
    failing.write_text("#!/usr/bin/env bash\necho 'No devices were found' >&2\nexit 6\n")
    failing.chmod(0o755)
    with clocks.ClockSampler(torch.device("cuda"), smi=str(failing), gpu="GPU-test") as sampler:
        pass
    assert sampler.summary()["error"] == "not sampled: nvidia-smi exited 6: No devices were found"
    with clocks.ClockSampler(torch.device("cpu")) as sampler:
        pass
    assert sampler.summary() == {}


def test_a_block_too_short_to_sample_is_empty(fake_smi, monkeypatch):
    monkeypatch.setattr(clocks, "parse_samples", lambda lines: [])
    with clocks.ClockSampler(torch.device("cuda"), smi=fake_smi, gpu="GPU-test") as sampler:
        pass
    assert sampler.summary() == {}


def _clocked() -> dict:
    samples = clocks.parse_samples(["1755, 2619, 699.0, 61, 0x4"] * 4 + ["1980, 2619, 500.0, 55, 0x0"] * 6)
    return clocks.summarize_samples(samples, {"max_sm_mhz": 1980.0, "power_limit_w": 700.0})


def test_report_and_mfu_target_name_the_clocks():
    run = _synthetic_run()
    case = dict(model="bert-large", seqlen=128, batch=128, micro_batches=2, global_batch=256)
    graphs = _row("pretrain_step", BERTFAST_GRAPHS, 200.0, "step", "model", {"mfu": 0.45}, **case)
    graphs.clocks = _clocked()
    run.rows.append(graphs)
    run.device.calibration = {"matmul": "a matmul", "matmul_clocks": _clocked()}
    run.targets = evaluate_targets(run)
    detail = next(t["detail"] for t in run.targets if t["id"] == "mfu_large_128")
    assert detail.startswith(f"MFU 45.0% of the measured peak (GPU not in the datasheet table) (global batch 256 "
                             f"= 2 x 128, {BERTFAST_GRAPHS}); SM 1,980 MHz")
    assert "power cap in 40% of samples (10 samples)" in detail
    md = markdown(run)
    assert "## Clocks" in md
    assert (f"| pretrain_step | model=bert-large,seqlen=128,batch=128,micro_batches=2,global_batch=256 | "
            f"{BERTFAST_GRAPHS} | SM 1,980 MHz") in md
    assert "(a matmul); while timed: SM 1,980 MHz" in md


def test_clocks_survive_the_results_file():
    row = Row("kernels", "attention", {"seqlen": 512}, "fwd+bwd", "bertfast:triton", clocks=_clocked())
    assert Row.from_dict(row.to_dict()).clocks == row.clocks
    run = Run(device=_synthetic_run().device, config={}, rows=[row])
    md = markdown(run)
    assert "Kernel suite, 1 row: SM clock medians from 1,980 to 1,980 MHz; a clock limit active in 1 row" in md
