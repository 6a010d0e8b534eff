"""The benchmark harness on CPU: arithmetic, the parity gate, targets, reports, and end-to-end runs."""
from __future__ import annotations

import importlib
import json
import os
import sys
import types

import pytest
import torch

from bertfast import flops as bert_flops
from bertfast.bench import cli, device as devmod, flops as W, report
from bertfast.bench.common import SuiteContext, sequence_lengths
from bertfast.bench.gate import compare
from bertfast.bench.results import (FAILED_PARITY, FULL_HEAD, GEMM_FLOOR, HF_COMPILED, HF_EAGER, OK, SDPA_FLASH,
                                    SDPA_MEM_EFFICIENT, TORCH_EAGER, Row, Run)
from bertfast.bench.targets import MET, NOT_MEASURED, NOT_MET, evaluate_targets
from bertfast.bench.timing import (Memory, Stat, TimingPolicy, quantile, summarize, time_cpu_interleaved,
                                  time_fn)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- timing and statistics
def test_quantiles_interpolate_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert quantile(values, 0.5) == 3.0
    assert quantile(values, 0.2) == pytest.approx(1.8)  # position 0.8 between 1 and 2
    assert quantile(values, 0.8) == pytest.approx(4.2)
    s = summarize([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (s.median, s.p20, s.p80, s.n) == (3.0, pytest.approx(1.8), pytest.approx(4.2), 5)


def test_rate_swaps_quantiles():
    times = Stat(median=2.0, p20=1.0, p80=4.0, n=9)  # ms
    r = times.rate(8.0)
    # The slowest calls (p80 time) give the lowest throughput (p20 rate).
    assert (r.median, r.p20, r.p80, r.n) == (4.0, 2.0, 8.0, 9)
    assert times.scaled(3.0) == Stat(6.0, 3.0, 12.0, 9)


def test_cpu_timing_runs_warmup_then_reps_and_setup_each_time():
    calls = {"fn": 0, "setup": 0}

    def fn():
        calls["fn"] += 1

    def setup():
        calls["setup"] += 1
    s = time_fn(fn, torch.device("cpu"), TimingPolicy(cpu_warmup=2, cpu_reps=4), setup=setup)
    assert calls == {"fn": 6, "setup": 6}
    assert s.n == 4 and 0 <= s.p20 <= s.median <= s.p80


def test_cpu_interleaved_timing_takes_turns_and_drops_a_callable_that_raises():
    order = []

    def one(name, fail_on=None):
        def fn():
            order.append(name)
            if len(order) == fail_on:
                raise RuntimeError("out of memory")
        return fn
    a, b, c = one("a"), one("b", fail_on=5), one("c")
    stats = time_cpu_interleaved([a, b, c], TimingPolicy(cpu_warmup=1, cpu_reps=3))
    # rounds of a, b, c; b raises in the second round (the fifth call) and is left out after it
    assert order == ["a", "b", "c", "a", "b", "c", "a", "c", "a", "c"]
    assert isinstance(stats[1], RuntimeError)
    assert stats[0].n == stats[2].n == 3  # the warm-up round is not a sample


def test_model_suite_on_cpu_times_the_implementations_in_turns(monkeypatch):
    """The CPU model suite's ratio against transformers: both timed in the same rounds."""
    from bertfast.bench import model_suite

    seen = []
    real = model_suite.time_cpu_interleaved

    def spy(fns, policy=None):
        seen.append(len(fns))
        return real(fns, policy)
    monkeypatch.setattr(model_suite, "time_cpu_interleaved", spy)
    monkeypatch.setattr(model_suite, "time_fn", lambda *a, **k: pytest.fail("a CPU case timed on its own"))
    ctx = _cpu_ctx(models=("inference",), impls=("bertfast", "transformers"), with_transformers=True)
    rows = model_suite.run(ctx)
    assert seen and all(n == 2 for n in seen)
    assert {r.impl for r in rows} == {"bertfast", HF_EAGER} and all(r.ok for r in rows)


def test_model_suite_times_the_static_shape_pretrain_step_and_skips_graphs_without_a_gpu(monkeypatch):
    """bertfast pretrain's own step on the packed batch: gated (fast vs reference on the packed
    batch, and the packed loss = the padded loss), timed; the CUDA-graph row says why it is absent."""
    from bertfast.bench import model_suite
    from bertfast.bench.results import BERTFAST_GRAPHS, BERTFAST_STATIC
    from bertfast.training import step as step_module

    calls = []
    real = step_module.TrainStep.__call__

    def spy(self, micro_batches, forward):
        calls.append(sorted(micro_batches[0]))
        return real(self, micro_batches, forward)

    monkeypatch.setattr(step_module.TrainStep, "__call__", spy)
    rows = model_suite.run(_cpu_ctx(models=("pretrain",), impls=("bertfast", "static-shapes")))
    by_impl = {r.impl: r for r in rows}
    assert set(by_impl) == {"bertfast", BERTFAST_STATIC, BERTFAST_GRAPHS}
    static = by_impl[BERTFAST_STATIC]
    assert static.ok and static.time_ms.median > 0, static.reason
    assert static.parity["ok"] and static.parity["packed_vs_padded_loss_rel_diff"] < 1e-5
    assert calls and all("cu_seq_lens_q" in keys and "max_predictions_per_seq" in keys for keys in calls)
    graphs = by_impl[BERTFAST_GRAPHS]
    assert graphs.status == "skipped" and graphs.reason == "--cuda-graphs needs a CUDA device (got cpu)"


def test_packed_pretrain_rows_step_with_pretrains_optimizer_and_clipping(monkeypatch):
    """The static-shape and CUDA-graph rows time `bertfast pretrain`'s step: its optimizer built by
    pretrain's own function from its default settings (on a GPU in bf16, the triton AdamW writing
    working copies), its clipping at norm 1.0. The H200 runs of 2026-11-27 timed torch's fused AdamW
    without working copies there."""
    import bertfast
    from bertfast.bench import model_suite
    from bertfast.training import optim
    from bertfast.training.config import PretrainConfig

    built = []
    real = optim.pretrain_optimizer

    def spy(model, args, precision):
        built.append((args, precision))
        return real(model, args, precision)

    monkeypatch.setattr(optim, "pretrain_optimizer", spy)
    ctx = _cpu_ctx()
    config = model_suite._config("tiny")
    gen = torch.Generator().manual_seed(0)
    batch, _ = model_suite.pretrain_batch(config, sequence_lengths("pretrain", 2, 16, gen), 16, gen, ctx.torch_device)
    torch.manual_seed(0)
    model = bertfast.BertForPreTraining(config).train()
    step = model_suite.make_packed_train_step(ctx, model, model_suite.packed_pretrain_batch(batch), graphs=False)
    assert built == [(PretrainConfig(), "fp32")]
    assert step.train_step.max_grad_norm == PretrainConfig().max_grad_norm == 1.0
    before = model.cls.predictions.transform.dense.weight.detach().clone()
    step()
    assert not torch.equal(before, model.cls.predictions.transform.dense.weight)


def test_a_packed_pretrain_step_that_disagrees_is_not_timed(monkeypatch):
    from bertfast.bench import model_suite
    from bertfast.bench.results import BERTFAST_STATIC

    real = model_suite.packed_pretrain_batch

    def shifted(batch):  # the packed row loses its NSP labels: its loss is no longer the padded batch's
        packed = real(batch)
        packed["next_sentence_label"] = torch.full_like(packed["next_sentence_label"], -100)
        return packed

    monkeypatch.setattr(model_suite, "packed_pretrain_batch", shifted)
    rows = model_suite.run(_cpu_ctx(models=("pretrain",), impls=("bertfast", "static-shapes")))
    static = next(r for r in rows if r.impl == BERTFAST_STATIC)
    assert static.status == FAILED_PARITY and "packed_vs_padded_loss_rel_diff" in static.reason


def test_a_parity_gate_that_cannot_run_is_an_error_not_a_parity_failure(monkeypatch):
    """The H100 run of 2026-11-26 reported BERT-large seq-512's packed steps as FAILED PARITY when
    their fp32 gate ran out of memory: the gate gave no verdict, and the row says so."""
    from bertfast.bench import model_suite
    from bertfast.bench.results import BERTFAST_STATIC, ERROR

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1024.00 MiB")

    monkeypatch.setattr(model_suite, "parity_packed", out_of_memory)
    rows = model_suite.run(_cpu_ctx(models=("pretrain",), impls=("bertfast", "static-shapes")))
    by_impl = {r.impl: r for r in rows}
    static = by_impl[BERTFAST_STATIC]
    assert static.status == ERROR and static.time_ms is None
    assert static.reason.startswith("while checking parity: OutOfMemoryError: CUDA out of memory"), static.reason
    assert by_impl["bertfast"].ok  # the padded gate ran and passed: that row is timed


# --------------------------------------------------------------------------- work counts
def test_attention_flops_hand_computed():
    # fwd = 4 * (3^2 + 5^2) * A * D = 4 * 34 * 2 * 4
    assert W.attention_flops([3, 5], 2, 4, "fwd") == 1088
    assert W.attention_flops([3, 5], 2, 4, "bwd") == 2.5 * 1088
    assert W.attention_flops([3, 5], 2, 4, "fwd+bwd") == 3.5 * 1088
    # Padding never counts: only the real lengths enter.
    assert W.attention_flops([128] * 2, 12, 64, "fwd") == 4 * 2 * 128 ** 2 * 12 * 64
    with pytest.raises(ValueError, match="direction"):
        W.attention_flops([1], 1, 1, "sideways")


def test_row_op_bytes_hand_computed():
    # bias_gelu N=10 F=4, bf16 activations, fp32 bias: fwd reads x + bias, writes y.
    assert W.bias_gelu_bytes(10, 4, 2, 4, "fwd") == 10 * 4 * 2 * 2 + 4 * 4
    assert W.bias_gelu_bytes(10, 4, 2, 4, "bwd") == 10 * 4 * 2 * 3 + 2 * 4 * 4
    # bias_dropout_residual_layernorm N=2 H=3, act 2 bytes, params 4: fwd x 12 + residual 12 + bias 12 + weight/ln_bias 24
    # + y 12 + pre_norm 12 + mean/rstd 16 = 100; bwd dy 12 + pre_norm 12 + stats 16 + weight 12
    # + dx 12 + dresidual 12 + dbias 12 + dweight 12 + dln_bias 12 = 112.
    assert W.bias_dropout_residual_layernorm_bytes(2, 3, 2, 4, "fwd") == 100
    assert W.bias_dropout_residual_layernorm_bytes(2, 3, 2, 4, "bwd") == 112
    assert W.bias_dropout_residual_layernorm_bytes(2, 3, 2, 4, "fwd+bwd") == 212
    assert W.bias_dropout_residual_layernorm_bytes(2, 3, 2, 4, "fwd", has_bias=False, has_residual=False) == 76
    # embeddings T=2 H=3 V=5 P=4 TT=2, int64 ids, fp32 tables, bf16 out:
    # fwd ids 48 + gathered rows 72 + LN 24 + y 12 + stats 16 = 172;
    # bwd dy 12 + ids 48 + rows 72 + LN 24 + stats 16 + dense table grads (5+4+2)*3*4 = 132 + dLN 24 = 328.
    assert W.embeddings_bytes(2, 3, 5, 4, 2, 8, 4, 2, "fwd") == 172
    assert W.embeddings_bytes(2, 3, 5, 4, 2, 8, 4, 2, "bwd") == 328


def test_model_flops_and_mfu_hand_computed():
    cfg = types.SimpleNamespace(hidden_size=4, num_hidden_layers=2, intermediate_size=8, vocab_size=10)
    # per layer: linear 2 * 5 tokens * (4*16 + 2*4*8) = 1280, attention 4 * (2^2 + 3^2) * 4 = 208
    # -> 2 layers 2976; pooler 2 * 2 * 16 = 64; MLM head at 1 row 2 * 4 * (4 + 10) = 112; NSP 2 * 2 * 4 * 2 = 32
    fwd = bert_flops.bert_forward_flops(cfg, [2, 3], "pretraining", n_predictions=1)
    assert fwd == 2976 + 64 + 112 + 32
    assert bert_flops.bert_forward_flops(cfg, [2, 3], "none") == 2976 + 64
    assert bert_flops.bert_forward_flops(cfg, [2, 3], "classification", num_labels=3) == 2976 + 64 + 2 * 2 * 4 * 3
    step = bert_flops.training_step_flops(fwd)
    assert step == 3 * 3184
    # 9552 flops in 1 ms on a 1e7 flop/s peak = 95.52% MFU
    assert bert_flops.mfu(step, 1e-3, 1e7) == pytest.approx(0.9552)
    # pretrain counts the same model from sums it keeps on the device: tokens, sum of squares, sequences
    assert bert_flops.bert_forward_flops_from_counts(cfg, 5, 13, 2, "pretraining", 1) == fwd
    assert W.gbps(2e9, 1000.0) == pytest.approx(2.0)
    assert W.tflops(3e12, 500.0) == pytest.approx(6.0)


def test_bert_base_linear_flops_are_two_per_weight():
    from bertfast import BertConfig
    cfg = BertConfig.preset("bert-base")
    per_layer_weights = 4 * 768 * 768 + 2 * 768 * 3072
    # one token: attention 4 * 1 * 768 per layer; the pooler 2 * 768^2
    assert bert_flops.bert_forward_flops(cfg, [1], "none") == 12 * (2 * per_layer_weights + 4 * 768) + 2 * 768 * 768
    assert cfg.num_hidden_layers == 12


def test_kernel_and_model_figures_from_times():
    from bertfast.bench import kernels_suite, model_suite
    info = _fake_device("cuda")
    ctx = SuiteContext(device=info, quick=True, dtype=torch.bfloat16)
    t = Stat(median=1.0, p20=0.5, p80=2.0, n=5)  # ms
    m = kernels_suite.metrics_for(ctx, t, {"bytes": 2e9})
    assert m["gbps"].median == pytest.approx(2000.0)  # 2 GB in 1 ms
    assert m["gbps"].p20 == pytest.approx(1000.0) and m["gbps"].p80 == pytest.approx(4000.0)
    assert m["pct_copy_bw"].median == pytest.approx(2000.0 / 3000.0 * 100)
    m = kernels_suite.metrics_for(ctx, Stat(2.0, 2.0, 2.0, 1), {"flops": 1e12})
    assert m["tflops"].median == pytest.approx(500.0)
    f = model_suite._figures(ctx, Stat(100.0, 100.0, 100.0, 1), batch_size=32, tokens=4096, model_flops=40e12)
    assert f["seq_per_s"].median == pytest.approx(320.0)
    assert f["tokens_per_s"].median == pytest.approx(40960.0)
    assert f["tflops"].median == pytest.approx(400.0)
    assert f["mfu"].median == pytest.approx(400.0 / 800.0)  # fake peak 800 TFLOP/s


def test_sequence_lengths_modes():
    g = torch.Generator().manual_seed(1)
    assert sequence_lengths("none", 3, 8, g) == [8, 8, 8]
    fine = sequence_lengths("finetune", 64, 128, g)
    assert sum(fine) == 32 * 128  # pairs sum to max_len: mean exactly 50%
    assert all(1 <= n <= 128 for n in fine) and len(set(fine)) > 4
    pre = sequence_lengths("pretrain", 200, 128, g)
    assert sum(n == 128 for n in pre) > 150 and min(pre) >= 32


# --------------------------------------------------------------------------- the gate
def test_gate_fp32_and_low_precision_rule():
    ref = {"y": torch.linspace(-1, 1, 50)}
    assert compare({"y": ref["y"].clone()}, ref).ok
    bad = compare({"y": ref["y"] + 1e-2}, ref)
    assert not bad.ok and "y: max error" in bad.message
    nan = ref["y"].clone()
    nan[3] = float("nan")
    assert "NaN" in compare({"y": nan}, ref).message
    assert "missing" in compare({}, ref).message
    # low precision: fast error up to 2x the reference's own low-precision error passes.
    lowp = {"y": ref["y"] + 1e-3}
    assert compare({"y": ref["y"] - 1.9e-3}, ref, lowp).ok
    assert not compare({"y": ref["y"] - 2.5e-3}, ref, lowp).ok


# --------------------------------------------------------------------------- targets and reports
def _fake_device(kind: str) -> devmod.DeviceInfo:
    info = devmod.DeviceInfo(kind=kind, name="Fake GPU 80GB" if kind == "cuda" else "Fake CPU",
                             slug=devmod.slugify("Fake GPU 80GB" if kind == "cuda" else "Fake CPU"),
                             torch_version=torch.__version__, python_version="3", platform="test")
    info.copy_bandwidth_gbps = Stat(3000.0, 2900.0, 3100.0, 10)
    info.peak_matmul_tflops = Stat(800.0, 790.0, 810.0, 10)
    return info


def test_a_gpu_run_names_its_host_cpu():
    """Host-bound eager steps run at the host's pace: a GPU run's header names its CPU, and results
    written before the field existed still load (without one)."""
    info = _fake_device("cuda")
    info.host_cpu, info.cpu_threads = "Fake Xeon 8480", 16
    assert "host Fake Xeon 8480 (16 threads)" in info.describe()
    assert devmod.DeviceInfo.from_dict(info.to_dict()).host_cpu == "Fake Xeon 8480"
    old = {k: v for k, v in info.to_dict().items() if k != "host_cpu"}
    assert "CPU not recorded" in devmod.DeviceInfo.from_dict(old).describe()


def _row(group, impl, ms, direction="fwd+bwd", suite="kernels", metrics=None, memory=None, **case):
    return Row(suite, group, case, direction, impl, time_ms=Stat(ms, ms, ms, 3),
               metrics={k: Stat(v, v, v, 3) for k, v in (metrics or {}).items()}, memory=memory,
               work={"bytes": 1e9})


def _synthetic_run(kind="cuda") -> Run:
    rows = []
    # pretraining steps: base meets everything, large is too slow.
    for model, fast_ms, mfu in (("bert-base", 100.0, 0.55), ("bert-large", 300.0, 0.40)):
        case = dict(model=model, seqlen=128, batch=128)
        rows += [_row("pretrain_step", "bertfast", fast_ms, "step", "model", {"mfu": mfu}, **case),
                 _row("pretrain_step", HF_EAGER, 300.0, "step", "model", **case),
                 _row("pretrain_step", HF_COMPILED, 160.0, "step", "model", **case)]
    for lengths, batch, fill, tps in (("padded", 32, 0.5, 85.0), ("no-padding", 16, 1.0, 100.0)):
        rows.append(_row("finetune_step", "bertfast", 10.0, "step", "model", {"tokens_per_s": tps},
                         model="bert-base", seqlen=128, batch=batch, lengths=lengths, real_tokens=2048, fill=fill))
    for op in ("bias_gelu", "bias_dropout_residual_layernorm", "embeddings"):
        for direction in ("fwd", "bwd"):
            rows.append(_row(op, "bertfast:triton", 1.0, direction, metrics={"pct_copy_bw": 93.0}, tokens=16384))
            rows.append(_row(op, "bertfast:cuda", 1.2, direction, metrics={"pct_copy_bw": 80.0}, tokens=16384))
            rows.append(_row(op, TORCH_EAGER, 3.0, direction, metrics={"pct_copy_bw": 30.0}, tokens=16384))
    att = dict(batch=128, seqlen=128, heads=12, head_dim=64)
    rows += [_row("attention", "bertfast:triton varlen", 1.0, padding="none", **att),
             _row("attention", SDPA_FLASH, 1.1, padding="none", **att),
             _row("attention", "bertfast:triton varlen", 1.0, padding="finetune", **att),
             _row("attention", SDPA_MEM_EFFICIENT, 1.5, padding="finetune", **att)]  # only 1.5x: not met
    head = dict(model="bert-base", tokens=16384)
    rows += [_row("mlm_head_loss", "bertfast:triton", 2.0, memory=Memory(10 * 2**30, 2**30), **head),
             _row("mlm_head_loss", FULL_HEAD, 12.0, memory=Memory(20 * 2**30, 6 * 2**30), **head),
             _row("mlm_head_loss", GEMM_FLOOR, 1.7, **head)]
    run = Run(device=_fake_device(kind), config={"quick": False}, rows=rows)
    run.targets = evaluate_targets(run)
    return run


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
    case = dict(model="bert-large", seqlen=128, batch=128)
    run.rows += [_row("pretrain_step", BERTFAST_STATIC, 250.0, "step", "model", {"mfu": 0.48}, **case),
                 _row("pretrain_step", BERTFAST_GRAPHS, 200.0, "step", "model", {"mfu": 0.6}, **case)]
    got = {t["id"]: t for t in evaluate_targets(run)}
    assert (got["mfu_large_128"]["status"], got["mfu_large_128"]["value"]) == (MET, pytest.approx(0.6))
    assert got["mfu_large_128"]["detail"].endswith(f"(batch 128, {BERTFAST_GRAPHS})")
    assert got["hf_eager_large_128"]["value"] == pytest.approx(1.5)  # 300 ms vs the graphed 200 ms
    assert "ms, bertfast cuda graphs vs" in got["hf_eager_large_128"]["detail"]
    assert "," not in got["mfu_base_128"]["detail"]  # bert-base: the default step is the fastest
    run.rows[-1] = Row("model", "pretrain_step", case, "step", BERTFAST_GRAPHS, status=FAILED_PARITY,
                       reason="loss differs")
    got = {t["id"]: t for t in evaluate_targets(run)}
    assert got["mfu_large_128"]["value"] == pytest.approx(0.48)  # the static-shape step, 250 ms


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


def _check_png(path):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.image as mpimg
    image = mpimg.imread(path)
    assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 50


def test_results_directory_layout():
    assert devmod.slugify("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    import datetime
    when = datetime.datetime(2025, 3, 4)
    assert cli.default_out_dir(_fake_device("cuda"), quick=False, when=when) == os.path.join(
        "benchmarks/results", "fake-gpu-80gb", "2025-03-04")
    assert cli.default_out_dir(_fake_device("cuda"), quick=True, when=when).startswith("bench-out")
    assert cli.default_out_dir(_fake_device("cpu"), quick=False, when=when).startswith("bench-out")


# --------------------------------------------------------------------------- suites on CPU
def _cpu_ctx(**kw) -> SuiteContext:
    info = devmod.detect("cpu")
    devmod.calibrate(info, quick=True)
    base = dict(device=info, quick=True, dtype=torch.float32, backends=("torch",), compile=False,
                with_transformers=False, policy=TimingPolicy(cpu_warmup=0, cpu_reps=2),
                step_policy=TimingPolicy(cpu_warmup=0, cpu_reps=1), log=lambda s: None)
    base.update(kw)
    return SuiteContext(**base)


@pytest.fixture
def wrong_cuda_backend(monkeypatch):
    """A 'cuda' backend of bias_gelu that runs anywhere and computes 1.5 x GELU(x + b)."""
    from bertfast import dispatch
    torch_backend = importlib.import_module("bertfast.ops.bias_gelu")  # the module, not the function

    module = types.ModuleType("bertfast_bench_wrong_backend")
    module.bias_gelu_fwd = lambda x, bias, approximate: 1.5 * torch_backend.bias_gelu_fwd(x, bias, approximate)
    module.bias_gelu_bwd = torch_backend.bias_gelu_bwd
    monkeypatch.setitem(sys.modules, module.__name__, module)
    original = dispatch.backends("bias_gelu")["cuda"]
    dispatch.register_backend(dispatch.Backend("bias_gelu", "cuda", module.__name__,
                                               lambda forced, **inputs: []))
    yield
    dispatch.register_backend(original)


def test_kernel_suite_refuses_to_time_a_wrong_backend(wrong_cuda_backend):
    from bertfast.bench import kernels_suite
    ctx = _cpu_ctx(backends=("cuda", "torch"), ops=("bias_gelu",))
    rows = kernels_suite.run(ctx)
    wrong = [r for r in rows if r.impl == "bertfast:cuda"]
    assert [r.direction for r in wrong] == ["fwd", "bwd", "fwd+bwd"]
    for r in wrong:
        assert r.status == FAILED_PARITY and r.time_ms is None and not r.metrics
        assert "y: max error" in r.reason
    good = [r for r in rows if r.impl in ("bertfast:torch", TORCH_EAGER)]
    assert len(good) == 6 and all(r.status == OK and r.time_ms.median > 0 for r in good)
    assert all(r.metrics["gbps"].median > 0 for r in good)
    run = Run(device=ctx.device, config={}, rows=rows)
    md = report.markdown(run)
    assert md.count("**FAILED PARITY**") == 3


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


def test_model_suite_refuses_to_time_a_fast_model_on_a_wrong_backend(wrong_cuda_backend):
    from bertfast.bench import model_suite
    ctx = _cpu_ctx(models=("inference",))
    rows = model_suite.run(ctx)
    fast = [r for r in rows if r.impl == "bertfast"]
    assert fast and all(r.status == FAILED_PARITY and r.time_ms is None for r in fast)
    assert "disagrees with the reference" in fast[0].reason
    ref = [r for r in rows if r.impl == "bertfast reference"]
    assert ref and all(r.ok for r in ref)


def test_torch_compile_skipped_without_a_compiler(monkeypatch):
    from bertfast.bench import common, kernels_suite
    monkeypatch.setattr(common, "compiler_status", lambda: {"cxx": None, "triton": None})
    ctx = _cpu_ctx(compile=True, ops=("bias_gelu",))
    rows = [r for r in kernels_suite.run(ctx) if r.impl == "torch.compile"]
    assert rows and all(r.status == "skipped" and "C++ compiler" in r.reason for r in rows)


def test_triton_interpreter_path_is_benchmarked_on_cpu():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET=1 is set by conftest on machines without CUDA")
    from bertfast.bench import kernels_suite
    ctx = _cpu_ctx(backends=("triton",), ops=("bias_gelu",), policy=TimingPolicy(cpu_warmup=0, cpu_reps=1))
    rows = [r for r in kernels_suite.run(ctx) if r.impl == "bertfast:triton"]
    assert len(rows) == 3 and all(r.ok for r in rows), [r.reason for r in rows]
    assert any("TRITON_INTERPRET" in n for n in ctx.notes)


def test_quick_cpu_run_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(["--quick", "--out", str(out), "--no-compile", "--backends", "torch", "--reps", "1"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "CPU timings" in printed and "No GPU" in printed
    # each kernel case's rows follow a line naming it (dropout 0 and 0.1 are told apart)
    assert "  case batch=2,seqlen=16,heads=2,head_dim=16,padding=none,real_tokens=32,fill=1.0,dropout=0.1" in printed
    data = json.load(open(out / "results.json"))
    assert data["device"]["kind"] == "cpu" and data["config"]["quick"] is True and data["config"]["cpu_reps"] == 1
    assert data["device"]["copy_bandwidth_gbps"]["median"] > 0 and data["device"]["peak_matmul_tflops"]["median"] > 0
    rows = data["rows"]
    groups = {r["group"] for r in rows}
    assert {"attention", "bias_gelu", "bias_dropout_residual_layernorm", "embeddings", "mlm_head_loss_decoder",
            "mlm_head_loss", "pretrain_step", "finetune_step", "inference"} <= groups
    bad = [(r["group"], r["impl"], r["status"], r["reason"]) for r in rows if r["status"] not in ("ok", "skipped")]
    assert not bad
    for r in rows:
        if r["status"] == "ok":
            t = r["time_ms"]
            assert 0 < t["p20"] <= t["median"] <= t["p80"]
    impls = {r["impl"] for r in rows if r["status"] == "ok"}
    assert {"bertfast:torch", "bertfast:torch varlen", TORCH_EAGER, "bertfast", "bertfast reference"} <= impls
    if devmod._version("transformers"):
        assert HF_EAGER in impls
    compiled = [r for r in rows if r["impl"] in ("torch.compile", HF_COMPILED)]
    assert compiled and all("--no-compile" in r["reason"] for r in compiled)
    model_ok = [r for r in rows if r["suite"] == "model" and r["status"] == "ok"]
    assert all(r["metrics"]["mfu"]["median"] > 0 and r["metrics"]["tokens_per_s"]["median"] > 0 for r in model_ok)
    assert {t["status"] for t in data["targets"]} == {NOT_MEASURED}
    md = open(out / "results.md").read()
    assert "CPU run" in md and "## Targets" in md and "## Model suite" in md
    assert data["config"]["cpu_model_cases"] is False and "on tiny shapes (they check that the harness" in md
    loaded = report.load(str(out / "results.json"))
    loaded.config["cpu_model_cases"] = True                             # a run without --quick: MiniLM-sized
    assert "tiny kernel shapes and MiniLM-sized model cases" in report.markdown(loaded)
    _check_png(out / "kernels_speedup.png")
    _check_png(out / "model_speedup.png")

    # The targets find the rows the suites really write: pretend this run was on a GPU, with the
    # torch backend standing in for triton and the tiny model for BERT-base at seq 128.
    run = report.load(str(out / "results.json"))
    run.device.kind = "cuda"
    for r in run.rows:
        r.impl = r.impl.replace("bertfast:torch", "bertfast:triton")
        if r.case.get("model") == "tiny" and r.group == "pretrain_step":
            r.case.update(model="bert-base", seqlen=128)
    got = {t["id"]: t for t in evaluate_targets(run)}
    evaluable = ["mfu_base_128", "finetune_padding", "row_ops_bandwidth", "attention_vs_flash", "mlm_head_loss_floor"]
    if HF_EAGER in impls:
        evaluable.append("hf_eager_base_128")
    for tid in evaluable:
        status, detail = got[tid]["status"], got[tid]["detail"]
        if status == NOT_MEASURED and tid == "attention_vs_flash":
            # SDPA flash has no CPU kernel with dropout: that case stays unmeasured here, and the
            # status is then "not measured" whenever the timed cases meet the target (timing-dependent).
            assert "cannot run here with these settings" in detail, detail
        else:
            assert status in (MET, NOT_MET), (tid, status, detail)
        assert got[tid]["value"] > 0
    assert got["mfu_large_128"]["status"] == NOT_MEASURED  # no BERT-large rows in a quick CPU run


def test_overhead_suite_times_every_op_on_cpu(monkeypatch):
    from bertfast.bench import overhead_suite as OH
    monkeypatch.setattr(OH, "_timing_counts", lambda ctx: (1, 5, 3))  # warm-up, calls, samples: quick
    ctx = _cpu_ctx()
    rows = OH.run(ctx)
    assert list(dict.fromkeys(r.group for r in rows)) == list(OH.case_builders()) == [
        "embeddings", "attention_varlen", "attention", "bias_dropout_residual_layernorm", "bias_gelu", "mlm_head_loss"]
    bad = [(r.group, r.direction, r.impl, r.status, r.reason) for r in rows if not r.ok]
    assert not bad
    for op in OH.case_builders():
        got = {(r.direction, r.impl) for r in rows if r.group == op}
        assert got == {("select", "bertfast:torch"), ("decide", "bertfast:torch"), ("fwd", "bertfast:torch"),
                       ("fwd", TORCH_EAGER),
                       ("fwd+bwd", "bertfast:torch"), ("fwd+bwd", TORCH_EAGER)}, op
    for r in rows:
        host = r.metrics["host_us"]
        assert r.suite == "overhead" and host.n == 3 and 0 < host.p20 <= host.median <= host.p80
        assert r.time_ms.median == pytest.approx(host.median / 1e3)
    assert any("host microseconds per call" in n for n in ctx.notes)


def test_overhead_suite_from_the_cli_and_its_report(tmp_path, monkeypatch):
    from bertfast.bench import overhead_suite as OH
    monkeypatch.setattr(OH, "_timing_counts", lambda ctx: (1, 5, 3))
    out = tmp_path / "run"
    assert cli.main(["--suite", "overhead", "--device", "cpu", "--ops", "bias_gelu", "--out", str(out)]) == 0
    data = json.load(open(out / "results.json"))
    rows = data["rows"]
    assert {r["suite"] for r in rows} == {"overhead"} and {r["group"] for r in rows} == {"bias_gelu"}
    assert len(rows) == 6 and all(r["status"] == "ok" and r["metrics"]["host_us"]["median"] > 0 for r in rows)
    md = open(out / "results.md").read()
    assert "## Overhead suite" in md and "+us vs torch eager" in md and "## Kernel suite" not in md

    # Its rows reuse op names: the kernel targets must not read them, even on a GPU.
    run = report.load(str(out / "results.json"))
    run.device.kind = "cuda"
    for r in run.rows:
        r.impl = r.impl.replace("bertfast:torch", "bertfast:triton")
    got = {t["id"]: t for t in evaluate_targets(run)}
    assert got["row_ops_bandwidth"]["status"] == NOT_MEASURED
    assert "evaluation failed" not in got["row_ops_bandwidth"]["detail"]


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_calibration_and_timing():
    info = devmod.calibrate(devmod.detect("cuda"), quick=True)
    assert info.is_cuda and info.copy_bandwidth_gbps.median > 100 and info.peak_matmul_tflops.median > 10
    x = torch.randn(4096, 4096, device="cuda")
    t = time_fn(lambda: x.mul_(1.0), torch.device("cuda"), TimingPolicy.quick())
    assert t.n >= 3 and 0 < t.p20 <= t.median <= t.p80


@pytest.mark.gpu
def test_gpu_kernel_timing_leaves_out_the_host_time_of_a_call():
    """A call that spends 3 ms on the host before launching a ~20 us kernel: kernel timing (queued
    behind a device sleep) reports the kernel; step timing, as users wait for it, the 3 ms."""
    import time as _time
    x = torch.randn(2048, 2048, device="cuda")

    def call():
        _time.sleep(0.003)
        x.mul_(1.0)

    kernel = time_fn(call, torch.device("cuda"), TimingPolicy.quick())
    step = time_fn(call, torch.device("cuda"), TimingPolicy.steps(quick=True))
    assert kernel.median < 0.5, kernel
    assert step.median > 2.5, step


@pytest.mark.gpu
def test_gpu_graphed_pretrain_row_steps_on_working_copies():
    """On a GPU in bf16 the CUDA-graph row runs pretrain's step: the triton AdamW writing the working
    copies of the encoder's GEMM weights, which the replays' forwards read fresh (no cast of them)."""
    import bertfast
    from bertfast import working_weights
    from bertfast.bench import model_suite
    from bertfast.training import optim

    ctx = SuiteContext(device=devmod.detect("cuda"), quick=True, dtype=torch.bfloat16, log=lambda s: None)
    config = model_suite._config("tiny")
    gen = torch.Generator().manual_seed(0)
    batch, _ = model_suite.pretrain_batch(config, sequence_lengths("pretrain", 4, 32, gen), 32, gen, ctx.torch_device)
    model = bertfast.BertForPreTraining(config).to(ctx.torch_device).train()
    step = model_suite.make_packed_train_step(ctx, model, model_suite.packed_pretrain_batch(batch), graphs=True)
    opt = step.train_step.optimizer
    assert isinstance(opt, optim.AdamW) and opt.working is not None and opt.working.dtype == torch.bfloat16
    step()
    torch.cuda.synchronize()
    query = model.bert.encoder.layer[0].attention.self
    parts = [query.query.weight, query.key.weight, query.value.weight]
    fresh = working_weights.lookup(parts, torch.bfloat16)
    assert fresh is not None and torch.equal(fresh, torch.cat(parts).to(torch.bfloat16))


@pytest.mark.gpu
def test_gpu_ncu_target_finds_each_ops_case_at_bert_large_shapes(capsys):
    """The ncu step's target (bertfast/bench/ncu.py target_cases) is among the GPU's kernel-suite cases
    for every op, and runs each one's forward and backward (no ncu attached: the profiler calls are
    no-ops), so a speed loan's ncu step does not fail on a case the suite no longer lists."""
    from bertfast.bench import ncu
    profiled = list(ncu.target_cases())
    assert ncu.run_target(profiled, "triton", dry_run=False, warmup=1) == 0
    ran = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ncu target: ran")]
    assert [line.split()[3] for line in ran] == profiled
    layernorm = ran[profiled.index("bias_dropout_residual_layernorm")]
    assert '"tokens": 16384' in layernorm and '"dropout": 0.1' in layernorm


# --------------------------------------------------------------------------- selection, budget, merge, README
def test_implementation_families():
    from bertfast.bench.common import DTYPES
    from bertfast.bench.options import DTYPE_NAMES, IMPL_FAMILIES
    from bertfast.bench.results import (BERTFAST, BERTFAST_GRAPHS, BERTFAST_REFERENCE, BERTFAST_STATIC, SDPA_CUDNN,
                                        TORCH_COMPILE, impl_family)
    assert [impl_family(i) for i in ("bertfast:triton varlen", BERTFAST, BERTFAST_STATIC, BERTFAST_GRAPHS,
                                     BERTFAST_REFERENCE, TORCH_EAGER, FULL_HEAD, GEMM_FLOOR, TORCH_COMPILE, SDPA_FLASH,
                                     SDPA_CUDNN, HF_EAGER, HF_COMPILED)] == [
        "bertfast", "bertfast", "static-shapes", "static-shapes", "reference", "eager", "eager", "eager", "compiled",
        "sdpa", "sdpa", "transformers", "transformers-compiled"]
    assert set(IMPL_FAMILIES) == {"bertfast", "static-shapes", "reference", "eager", "compiled", "sdpa",
                                  "transformers", "transformers-compiled"}
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


def test_dropout_case_is_timed_only_after_the_p0_gate(wrong_layernorm_backend):
    from bertfast.bench import kernels_suite
    ctx = _cpu_ctx(backends=("cuda", "torch"), ops=("bias_dropout_residual_layernorm",))
    rows = kernels_suite.run(ctx)
    dropout = [r for r in rows if r.case["dropout"] == 0.1]
    wrong = [r for r in dropout if r.impl == "bertfast:cuda"]
    assert len(wrong) == 3 and all(r.status == FAILED_PARITY and r.reason.startswith("at p = 0: y: max error")
                                   for r in wrong)
    good = [r for r in dropout if r.impl == "bertfast:torch"]
    assert len(good) == 3 and all(r.ok for r in good)
    assert all(r.parity["gate"].startswith("p=0 on the same inputs") and r.parity["ok"] for r in good)


@pytest.fixture
def wrong_layernorm_backend(monkeypatch):
    """A 'cuda' backend of the residual LayerNorm that runs anywhere and adds 0.1 to the output."""
    from bertfast import dispatch
    torch_backend = importlib.import_module("bertfast.ops.bias_dropout_residual_layernorm")

    module = types.ModuleType("bertfast_bench_wrong_layernorm")

    def fwd(*args, **kwargs):
        y, *rest = torch_backend.bias_dropout_residual_layernorm_fwd(*args, **kwargs)
        return (y + 0.1, *rest)
    module.bias_dropout_residual_layernorm_fwd = fwd
    module.bias_dropout_residual_layernorm_bwd = torch_backend.bias_dropout_residual_layernorm_bwd
    monkeypatch.setitem(sys.modules, module.__name__, module)
    op = "bias_dropout_residual_layernorm"
    original = dispatch.backends(op)["cuda"]
    dispatch.register_backend(dispatch.Backend(op, "cuda", module.__name__, lambda forced, **inputs: []))
    yield
    dispatch.register_backend(original)


def test_parameter_modes_and_their_bytes():
    from bertfast.bench import kernel_cases
    gpu = SuiteContext(device=_fake_device("cuda"), quick=True, dtype=torch.bfloat16)
    assert kernel_cases._param_modes(gpu) == ("act", "fp32")
    assert kernel_cases._sizes(gpu, "fp32") == (2, 4) and kernel_cases._sizes(gpu, "act") == (2, 2)
    assert kernel_cases._param_modes(_cpu_ctx()) == ("act",)


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
    update_readme(str(readme), merged, "benchmarks/results/fake-gpu-80gb/2026-01-01")
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n" + BEGIN) and text.endswith(END + "\nafter\n")
    assert "old table" not in text and "Fake GPU 80GB" in text and "benchmarks/results/fake-gpu-80gb" in text
    assert "| BERT-base seq-128 training step >= 50% MFU | met |" in text
    with pytest.raises(ValueError, match="CPU run"):
        update_readme(str(readme), _synthetic_run("cpu"), "x")
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="expected the lines"):
        update_readme(str(readme), merged, "x")


def test_datasheet_peaks_and_mfu_against_them():
    assert bert_flops.datasheet_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert bert_flops.datasheet_bf16_tflops("NVIDIA H100 PCIe") == 756.0
    assert bert_flops.datasheet_bf16_tflops("NVIDIA H200") == 989.4
    assert bert_flops.datasheet_bf16_tflops("NVIDIA H100 NVL") == 835.0
    assert bert_flops.datasheet_bf16_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert bert_flops.datasheet_bf16_tflops("NVIDIA A10G") == 125.0
    assert bert_flops.datasheet_bf16_tflops("NVIDIA L40S") == 362.0
    assert bert_flops.datasheet_bf16_tflops("AMD EPYC") is None
    from bertfast.bench import model_suite
    info = _fake_device("cuda")
    info.datasheet_bf16_tflops = 1000.0
    ctx = SuiteContext(device=info, quick=True, dtype=torch.bfloat16)
    f = model_suite._figures(ctx, Stat(100.0, 100.0, 100.0, 1), batch_size=32, tokens=4096, model_flops=40e12)
    assert f["mfu"].median == pytest.approx(0.5) and f["mfu_datasheet"].median == pytest.approx(0.4)
    run = _synthetic_run()
    for r in run.rows:
        if r.group == "pretrain_step" and r.impl == "bertfast":
            r.metrics["mfu_datasheet"] = Stat(0.3, 0.3, 0.3, 3)
    got = {t["id"]: t for t in evaluate_targets(run)}
    assert got["mfu_base_128"]["status"] == NOT_MET and "datasheet peak" in got["mfu_base_128"]["detail"]
    old = devmod.DeviceInfo.from_dict({k: v for k, v in info.to_dict().items() if k != "datasheet_bf16_tflops"})
    assert old.datasheet_bf16_tflops is None


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


def test_row_timing_method_round_trips_and_old_files_load():
    row = _row("bias_gelu", "bertfast:triton", 0.01, "fwd")
    row.timing = "cuda graph replay"
    assert Row.from_dict(row.to_dict()).timing == "cuda graph replay"
    old = row.to_dict()
    del old["timing"]
    assert Row.from_dict(old).timing == ""


@pytest.mark.gpu
def test_gpu_small_kernels_are_timed_by_graph_replay():
    from bertfast.bench.timing import GRAPH_REPLAY, host_overhead_us, time_small
    x = torch.randn(1024, device="cuda")
    t, method = time_small(lambda: x.mul_(1.0), torch.device("cuda"))
    assert method == GRAPH_REPLAY and 0 < t.median < 0.05
    assert host_overhead_us(lambda: x.mul_(1.0), torch.device("cuda")).median > 0


def test_mlm_head_gemm_floor_of_each_case_uses_that_cases_sizes(monkeypatch):
    """The GPU run's cases are BERT-base then BERT-large: the floor of the first once multiplied by
    the second's hidden size (a closure reading the loop's last value). Two CPU shapes of different
    widths stand in for them. The floor's vocabulary is padded as the op pads its GEMMs' (50 -> 52
    fp32 rows of 16 bytes; 60 is whole)."""
    from bertfast.bench import kernel_cases
    shapes = [("a", 2, 8, 16, 50), ("b", 2, 8, 24, 60)]
    monkeypatch.setattr(kernel_cases, "_row_shapes", lambda ctx, full, quick, cpu: shapes)
    cases = kernel_cases.mlm_head_loss_cases(_cpu_ctx())
    assert [c.case["hidden"] for c in cases] == [16, 24]
    for case, padded in zip(cases, (52, 60)):
        floor = next(i for i in case.impls if i.name == GEMM_FLOOR).build(torch.float32)
        rows, dense, decoder = floor.leaves
        assert rows.shape == (case.case["predictions"], case.case["hidden"])
        assert decoder.shape == (padded, case.case["hidden"])
        assert floor.forward().shape == (case.case["predictions"], padded)


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
    from bertfast.perfmodel.report import read_profile
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
    reasons, units converted; the target runs one training forward and backward of each op (on CPU,
    --dry-run); without ncu the driver says so; the command profiles only the target's region."""
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
    (tmp_path / "ncu-raw.csv").write_text('"ID","Kernel Name"\n"",""\n')
    assert ncu.main(["--summarize", str(tmp_path)]) == 1  # no kernel: said, not an empty table

    assert ncu.main(["--target", "--dry-run", "--backend", "torch"]) == 0
    ran = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ncu target: ran")]
    assert [line.split()[3] for line in ran] == list(ncu.target_cases())
    monkeypatch.setattr(ncu, "find_ncu", lambda: None)
    assert ncu.main(["--out", str(tmp_path / "n")]) == 2
    assert "no ncu" in capsys.readouterr().err
    cmd = ncu.ncu_command("ncu", "R", ["bias_gelu"], "triton")
    assert cmd[cmd.index("--profile-from-start") + 1] == "off" and cmd[cmd.index("--clock-control") + 1] == "none"
    assert cmd[-6:] == ["bertfast.bench.ncu", "--target", "--ops", "bias_gelu", "--backend", "triton"]
    assert ncu.main(["--target", "--ops", "attention,softmax"]) == 2


def test_profile_counts_overlapping_kernels_once():
    """The device's busy time is the union of its kernels' spans (streams overlap), not their sum."""
    from bertfast.bench.profile import covered_time
    assert covered_time([(20, 25), (0, 10), (5, 15), (6, 7)]) == 20
    assert covered_time([]) == 0
