"""The bench's targets evaluated on synthetic runs: met, not met and not measured, failed parity,
the fastest bertfast step, and one line for the cases a stopped run left unmeasured. The README's
target table shows these verdicts."""
from __future__ import annotations

import pytest

from bertfast.bench.results import FAILED_PARITY, HF_EAGER, Row
from bertfast.bench.targets import MET, NOT_MEASURED, NOT_MET, evaluate_targets
from bench_helpers import _row, _synthetic_run


def test_targets_met_not_met_not_measured():
    run = _synthetic_run()
    got = {t["id"]: (t["status"], t["value"]) for t in run.targets}
    assert got["mfu_base_128"] == (MET, pytest.approx(0.55))
    assert got["mfu_large_128"] == (NOT_MET, pytest.approx(0.40))
    assert got["hf_eager_base_128"] == (MET, pytest.approx(3.0))
    assert got["hf_eager_large_128"][0] == NOT_MET  # 1.0x
    assert got["hf_compiled_base_128"] == (MET, pytest.approx(1.6))
    assert got["finetune_padding"] == (MET, pytest.approx(0.85))
    assert got["row_ops_bandwidth"] == (MET, pytest.approx(93.0))  # best fast backend per op
    assert got["attention_vs_flash"] == (MET, pytest.approx(1.1))
    assert got["attention_vs_mem_efficient"] == (NOT_MET, pytest.approx(1.5))
    # time 12 / 2 ms = 6x, peak memory above the inputs 6 GiB / 1 GiB = 6x: met on both
    assert got["mlm_head_loss_vs_full"] == (MET, pytest.approx(6.0))
    assert got["mlm_head_loss_floor"] == (MET, pytest.approx(2.0 / 1.7))
    assert all(t["device"] == "Fake GPU 80GB" for t in run.targets)


def test_targets_failed_parity_and_missing_rows():
    run = _synthetic_run()
    run.rows = [r for r in run.rows if r.group != "mlm_head_loss"]
    for i, r in enumerate(run.rows):
        if r.group == "attention" and r.impl.startswith("bertfast"):
            run.rows[i] = Row(r.suite, r.group, r.case, r.direction, r.impl, status=FAILED_PARITY,
                              reason="out: max error 1 > bound 0.01")
    got = {t["id"]: t for t in evaluate_targets(run)}
    assert got["attention_vs_flash"]["status"] == NOT_MET
    assert "FAILED PARITY" in got["attention_vs_flash"]["detail"]
    assert got["mlm_head_loss_vs_full"]["status"] == NOT_MEASURED
    cpu = _synthetic_run("cpu")
    assert {t["status"] for t in cpu.targets} == {NOT_MEASURED}


def test_step_targets_take_the_fastest_bertfast_pretrain_step():
    """`bertfast pretrain --cuda-graphs` is bertfast's step as much as the default one: the step
    targets take the fastest that passed its gate, and say which; a failed option is passed over."""
    from bertfast.bench.results import BERTFAST_GRAPHS, BERTFAST_STATIC
    run = _synthetic_run()
    case = dict(model="bert-large", seqlen=128, batch=128, micro_batches=2, global_batch=256)
    run.rows += [_row("pretrain_step", BERTFAST_STATIC, 250.0, "step", "model", {"mfu": 0.48}, **case),
                 _row("pretrain_step", BERTFAST_GRAPHS, 200.0, "step", "model", {"mfu": 0.6}, **case)]
    got = {t["id"]: t for t in evaluate_targets(run)}
    assert (got["mfu_large_128"]["status"], got["mfu_large_128"]["value"]) == (MET, pytest.approx(0.6))
    assert got["mfu_large_128"]["detail"].endswith(f"(global batch 256 = 2 x 128, {BERTFAST_GRAPHS})")
    assert got["hf_eager_large_128"]["value"] == pytest.approx(1.5)  # 300 ms vs the graphed 200 ms
    assert "ms, bertfast cuda graphs vs" in got["hf_eager_large_128"]["detail"]
    assert "," not in got["mfu_base_128"]["detail"]  # bert-base: the default step is the fastest
    run.rows[-1] = Row("model", "pretrain_step", case, "step", BERTFAST_GRAPHS, status=FAILED_PARITY,
                       reason="loss differs")
    got = {t["id"]: t for t in evaluate_targets(run)}
    assert got["mfu_large_128"]["value"] == pytest.approx(0.48)  # the static-shape step, 250 ms


def test_step_targets_take_the_targets_global_batch():
    """The step targets ask for a global batch of 256: a run's rows at it are taken over a faster
    step of fewer sequences per optimizer step, and a run without them (before 2026-12-06, one
    optimizer step per batch of 128) is read with its global batch named as under the targets'."""
    from bertfast.bench.results import BERTFAST_GRAPHS
    run = _synthetic_run()
    small = dict(model="bert-large", seqlen=128, batch=128)
    run.rows.append(_row("pretrain_step", BERTFAST_GRAPHS, 100.0, "step", "model", {"mfu": 0.7}, **small))
    got = {t["id"]: t for t in evaluate_targets(run)}
    assert got["mfu_large_128"]["value"] == pytest.approx(0.40)  # the synthetic run's 2 x 128 step
    assert got["mfu_large_128"]["detail"].endswith("(global batch 256 = 2 x 128)")
    assert got["hf_eager_large_128"]["value"] == pytest.approx(1.0)  # 300 vs 300 ms, not vs the 100 ms step
    assert got["hf_eager_large_128"]["detail"].endswith("(global batch 256 = 2 x 128)")
    run.rows = [r for r in run.rows if r.group != "pretrain_step" or r.case == small]
    run.rows.append(_row("pretrain_step", HF_EAGER, 150.0, "step", "model", **small))
    got = {t["id"]: t for t in evaluate_targets(run)}
    assert (got["mfu_large_128"]["status"], got["mfu_large_128"]["value"]) == (MET, pytest.approx(0.7))
    assert got["mfu_large_128"]["detail"].endswith(
        f"(global batch 128, under the targets' 256: the optimizer's step counted once per 128 sequences, "
        f"{BERTFAST_GRAPHS})")
    assert got["hf_eager_large_128"]["value"] == pytest.approx(1.5)


def test_target_detail_groups_the_cases_not_measured():
    """A stopped bench leaves many cases unmeasured for one reason: one line with their count, after
    the measured cases (the README table stays readable)."""
    from bertfast.bench.targets import Outcome, _not_measured, _worst
    stopped = "triton skipped (not run: the bench was stopped (SIGTERM) before this case)"
    pieces = [(Outcome(NOT_MET, 0.3, "0.30x"), "B128"), (_not_measured(stopped), "B32"),
              (_not_measured(stopped), "B64"), (_not_measured("cuda: not in this run"), "B8")]
    got = _worst(pieces, True, 1.0)
    assert got.status == NOT_MET and got.value == pytest.approx(0.3)
    assert got.detail == f"B128: 0.30x; 2 cases not measured: {stopped}; 1 case not measured: cuda: not in this run"


def test_new_attention_and_seq512_targets():
    run = _synthetic_run()
    run.rows = [r for r in run.rows if r.group != "attention"]
    att = dict(batch=32, seqlen=512, heads=16, head_dim=64, padding="none")
    run.rows += [
        _row("attention", "bertfast:triton varlen", 2.0, metrics={"tflops": 230.0}, dropout=0.1, **att),
        _row("attention", "bertfast:cuda varlen", 3.0, metrics={"tflops": 150.0}, dropout=0.1, **att),
        _row("attention", "sdpa:cudnn", 2.5, dropout=0.1, **att),
        _row("pretrain_step", "bertfast", 900.0, "step", "model", {"mfu": 0.46}, model="bert-large", seqlen=512,
             batch=32)]
    got = {t["id"]: t for t in evaluate_targets(run)}
    assert got["attention_tflops"]["status"] == MET and got["attention_tflops"]["value"] == pytest.approx(230.0)
    assert got["attention_vs_cudnn"]["status"] == MET and got["attention_vs_cudnn"]["value"] == pytest.approx(1.25)
    assert got["mfu_large_512"]["status"] == MET


def test_speedup_target_not_met_says_what_it_asks():
    """A speedup target not met names the step time it asks for and that time's MFU (the baseline's
    MFU times the speedup), so the table shows whether any step could reach it; met, it says neither."""
    run = _synthetic_run()
    got = {t["id"]: t for t in evaluate_targets(run)}
    assert "; 2.5x is 120.0 ms (" in got["hf_eager_large_128"]["detail"]  # the baseline has no MFU here
    assert " is " not in got["hf_eager_base_128"]["detail"]  # met: 3.0x
    case = dict(model="bert-large", seqlen=128, batch=128, micro_batches=2, global_batch=256)
    run.rows = [r for r in run.rows if not (r.impl == HF_EAGER and r.case == case)]
    run.rows.append(_row("pretrain_step", HF_EAGER, 300.0, "step", "model", {"mfu": 0.3, "mfu_datasheet": 0.24},
                         **case))
    detail = {t["id"]: t for t in evaluate_targets(run)}["hf_eager_large_128"]["detail"]
    assert detail == ("300.0 ms vs 300.0 ms = 1.00x; 2.5x is 120.0 ms, 60.0% MFU of the datasheet peak "
                      "(global batch 256 = 2 x 128)")


def test_each_threshold_is_stated_once_and_read_by_the_perf_model():
    """The targets' texts, written from bench/thresholds.py, state the issue's numbers, and the
    performance model holds its predictions to the same thresholds (none of its own)."""
    from bertfast.bench import targets as T
    from bertfast.bench import thresholds
    from bertfast.perfmodel import head as HEAD
    from bertfast.perfmodel import report as PR
    from bertfast.perfmodel import step as S
    text = {tid: stated for tid, stated, _ in T.TARGETS}
    assert ">= 50% MFU" in text["mfu_large_128"] and ">= 50% MFU" in text["mfu_base_128"]
    assert "seq-512 training step >= 45% MFU" in text["mfu_large_512"]
    assert "within 15% of" in text["finetune_padding"] and ">= 90% of" in text["row_ops_bandwidth"]
    assert ">= 215 TFLOP/s" in text["attention_tflops"] and "within 1.25x" in text["mlm_head_loss_floor"]
    assert ">= 5x the full-sequence head" in text["mlm_head_loss_vs_full"]
    assert T.MFU is thresholds.MFU and T.FINETUNE_RATIO == thresholds.FINETUNE_RATIO
    assert {(c.setting.model, c.setting.seq): c.target_mfu for c in S.STEP_CASES} == T.MFU
    assert (HEAD.TARGET, PR.ATTENTION_TFLOPS, PR.ROW_OP_BANDWIDTH) == (T.MLM_HEAD_FLOOR, T.ATTENTION_TFLOPS,
                                                                       T.ROW_OP_BANDWIDTH)
