"""What the speedup targets ask of bertfast's step (bertfast/perfmodel/reach.py): the time and MFU a
filed run's baseline sets, per target and GPU from the newest run that measured the baseline, set
beside the step's prediction on that run's GPU at its micro-batches; and the MLM head's time a
filed run's full-sequence head sets, beside the head's prediction on that GPU."""
from __future__ import annotations

import pytest

from bertfast.bench.results import HF_EAGER
from bertfast.perfmodel import reach as R
from bertfast.perfmodel import step as S
from bertfast.perfmodel.hardware import H100, H200
from bench_helpers import _fake_device, _row, _synthetic_run


def _run(name: str, date: str, eager_ms: float, mfu: float, **case):
    run = _synthetic_run()
    run.device = _fake_device("cuda")
    run.device.name = name
    run.date = date
    large = dict(model="bert-large", seqlen=128, batch=128, **case)
    run.rows = [r for r in run.rows if r.group != "pretrain_step"]
    run.rows.append(_row("pretrain_step", HF_EAGER, eager_ms, "step", "model", {"mfu_datasheet": mfu}, **large))
    return run


def test_each_target_takes_the_newest_run_per_gpu_that_measured_its_baseline():
    old = _run("NVIDIA H200", "2026-11-26T00:00", 120.0, 0.25)
    new = _run("NVIDIA H200", "2026-11-27T00:00", 125.0, 0.24, micro_batches=2, global_batch=256)
    h100 = _run("NVIDIA H100 80GB HBM3", "2026-11-20T00:00", 130.0, 0.23)
    unmeasured = _run("NVIDIA H200", "2026-11-28T00:00", 1.0, 0.9)
    unmeasured.rows[-1].metrics = {}  # no datasheet MFU: not a baseline the targets can read
    cpu = _run("cpu", "2026-11-29T00:00", 1.0, 0.9)
    cpu.device = _fake_device("cpu")
    asks = R.speedup_asks([(old, "results/h200/a"), (new, "results/h200/b"), (h100, "results/h100/a"),
                           (unmeasured, "results/h200/c"), (cpu, "results/cpu/a")])
    # BERT-large under eager only: no base rows, no compiled baseline
    assert sorted((a.target_id, a.device["name"], a.run) for a in asks) == [
        ("hf_eager_large_128", "NVIDIA H100 80GB HBM3", "results/h100/a"),
        ("hf_eager_large_128", "NVIDIA H200", "results/h200/b")]
    ask = next(a for a in asks if a.run == "results/h200/b")
    assert ask.speedup == 2.5 and ask.text == "BERT-large seq-128 step >= 2.5x transformers eager (sdpa)"
    assert ask.needed_ms == pytest.approx(50.0) and ask.needed_mfu == pytest.approx(0.6)
    assert (ask.micro_batches, ask.global_batch) == (2, 256)
    assert next(a for a in asks if a.run == "results/h100/a").micro_batches == 1  # a run before accumulation


def test_an_ask_is_priced_by_the_step_on_its_gpu_and_out_of_reach_above_the_ceiling(monkeypatch):
    calls = []

    def budget(results, case, gpu, accumulation=None):
        calls.append((results, case.setting.model, gpu.name, accumulation))
        return {"mfu": 0.54, "seconds": 0.06, "ceiling": {"mfu": 0.55}}
    monkeypatch.setattr(S, "budget", budget)
    h200 = R.Ask("hf_eager_large_128", "BERT-large ...", "bert-large", 2.5, {"name": "NVIDIA H200"},
                 "benchmarks/results/nvidia-h200/x", 124.0, 0.244, 1, 128)
    base = R.Ask("hf_compiled_base_128", "BERT-base ...", "bert-base", 1.5, {"name": "NVIDIA H100 80GB HBM3"},
                 "benchmarks/results/h100/y", 60.0, 0.30, 2, 256)
    lines = R.priced([h200, base], lambda setting, gpu: ("predicted", setting.label(), gpu.name))
    assert [c[1:] for c in calls] == [("bert-large", H200.name, 1), ("bert-base", H100.name, 2)]
    assert calls[0][0] == ("predicted", "bert-large seq 128 batch 128 bf16 p=0.1", H200.name)
    large, small = lines
    assert large["target"] == pytest.approx(61.0) and large["predicted"] == pytest.approx(54.0)
    assert not large["met"] and large["needed_ms"] == pytest.approx(49.6)
    assert "49.6 ms a step" in large["name"] and "1 x 128" in large["name"]
    assert R.out_of_reach(large).startswith("the step's ceiling has")
    assert small["met"] and small["target"] == pytest.approx(45.0) and R.out_of_reach(small) is None
    # a line whose target is within its ceiling but not met: not out of reach
    assert R.out_of_reach(dict(large, target=54.5)) is None
    assert R.out_of_reach({"target": 90, "predicted": 51}) is None  # no ceiling known
    # a ratio "at most" (the MLM head's): its ceiling is the least it could be, out of reach above the target
    ratio = {"target": 1.25, "predicted": 1.4, "unit": "x (at most)", "ceiling": 1.32, "ceiling_why": "the loss"}
    assert R.out_of_reach(ratio) == "the loss" and R.out_of_reach(dict(ratio, ceiling=1.2)) is None


def _head_run(name: str, date: str, full_ms: float, floor_ms=None, model="bert-large", hidden=1024, full_ok=True):
    from bertfast.bench.results import FAILED_PARITY, FULL_HEAD, GEMM_FLOOR
    from bertfast.bench.timing import Memory
    run = _run(name, date, 125.0, 0.24)
    case = dict(model=model, tokens=16384, predictions=2458, hidden=hidden, vocab=30522, dtype="bf16")
    run.rows = [r for r in run.rows if r.group != "mlm_head_loss"]
    run.rows += [_row("mlm_head_loss", "bertfast:triton", 3.0, memory=Memory(2 * 2**30, 2**28), **case),
                 _row("mlm_head_loss", "bertfast:cuda", 2.5, memory=Memory(2 * 2**30, 2**27), **case),
                 _row("mlm_head_loss", FULL_HEAD, full_ms, memory=Memory(8 * 2**30, 2**31), **case)]
    if floor_ms is not None:
        run.rows.append(_row("mlm_head_loss", GEMM_FLOOR, floor_ms, **case))
    if not full_ok:
        run.rows[-1 if floor_ms is None else -2].status = FAILED_PARITY
    return run


def test_the_head_target_takes_the_newest_full_head_per_model_and_gpu():
    old = _head_run("NVIDIA H200", "2026-11-26T00:00", 18.0, floor_ms=2.0)
    new = _head_run("NVIDIA H200", "2026-11-27T00:00", 20.0)
    base = _head_run("NVIDIA H200", "2026-11-25T00:00", 16.0, model="bert-base", hidden=768)
    broken = _head_run("NVIDIA H200", "2026-11-28T00:00", 1.0, full_ok=False)  # a full head that failed: no ask
    cpu = _head_run("cpu", "2026-11-29T00:00", 1.0)
    cpu.device = _fake_device("cpu")
    asks = R.head_asks([(old, "r/a"), (new, "r/b"), (base, "r/c"), (broken, "r/d"), (cpu, "r/e")])
    assert [(a.case["model"], a.run) for a in asks] == [("bert-large", "r/b"), ("bert-base", "r/c")]
    large = next(a for a in asks if a.case["model"] == "bert-large")
    assert large.full_ms == 20.0 and large.floor_ms is None and large.needed_ms == pytest.approx(4.0)
    assert large.memory_ratio == pytest.approx(16.0)  # against the faster fast backend's peak (cuda: 2.5 ms)
    assert R.head_asks([(old, "r/a")])[0].floor_ms == 2.0


def test_a_head_ask_is_priced_by_head_lines_on_its_gpu():
    from bertfast.perfmodel import head as HEAD
    from bertfast.perfmodel.hardware import device_gpu
    ask = R.head_asks([(_head_run("NVIDIA H200", "2026-11-26T00:00", 18.0, floor_ms=2.0), "r/a")])[0]
    gpu = device_gpu(ask.device)  # the H200's constants at the copy bandwidth the run measured
    assert gpu.name == H200.name and ask.device["copy_bandwidth_gbps"]
    plan = HEAD.lines(1024, 16384, 30522, act_bytes=2, weight_bytes=2, gpu=gpu, rows=2458)
    line, = R.head_priced([ask])
    assert line["predicted"] == pytest.approx(18.0 / (plan["seconds"] * 1e3)) and line["unit"] == "x"
    assert line["met"] and line["target"] == 5.0 and line["ceiling"] > line["predicted"]
    assert "3.60 ms, as the full head's 18.00 ms sets it (a; its peak memory 16.0x the head's)" in line["name"]
    assert f"{18.0 / (2.0 * plan['ratio']):.1f}x" in line["name"]  # at the run's own floor
    # a full head barely slower than the head: not met, and beyond the head's ceiling out of reach
    slow, = R.head_priced([R.HeadAsk(ask.case, ask.device, "r/x", 2.0, None, None)])
    assert not slow["met"] and slow["ceiling"] < 5.0 and R.out_of_reach(slow).startswith("the head at its ceiling")
