"""The bench's work counts, hand computed: FLOPs and bytes per op, model FLOPs and MFU (against the
measured and the datasheet peak), the figures derived from times, and the sequence lengths of a case.
Every bandwidth, TFLOP/s and MFU figure is derived from these counts."""
from __future__ import annotations

import types

import pytest
import torch

from bertfast.model import mfu as bert_flops
from bertfast.bench import device as devmod, flops as W
from bertfast.bench.common import SuiteContext, sequence_lengths
from bertfast.bench.targets import NOT_MET, evaluate_targets
from bertfast.bench.timing import Stat
from bench_helpers import _cpu_ctx, _fake_device, _synthetic_run


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


def test_embeddings_bytes_count_each_gathered_table_row_once():
    """A gather reads each distinct table row from DRAM once (its repeats are L2 hits): 8 tokens over
    tables of 5, 4 and 2 rows read at most those 11 rows, not 24; given the ids' distinct rows, those."""
    # T=8 H=3, int64 ids, fp32 tables, bf16 out: fwd ids 192 + rows (5+4+2)*3*4 = 132 + LN 24 + y 48 + stats 64
    assert W.gathered_rows(8, 5) == 5 and W.gathered_rows(2, 5) == 2
    assert W.embeddings_bytes(8, 3, 5, 4, 2, 8, 4, 2, "fwd") == 460
    # bwd dy 48 + ids 192 + rows 132 + LN 24 + stats 64 + dense table grads 132 + dLN 24
    assert W.embeddings_bytes(8, 3, 5, 4, 2, 8, 4, 2, "bwd") == 616
    # the ids hold 3 distinct words, 2 positions, 1 type: 6 rows, 72 bytes
    assert W.embeddings_bytes(8, 3, 5, 4, 2, 8, 4, 2, "fwd", distinct=(3, 2, 1)) == 460 - 132 + 72
    assert W.embeddings_bytes(8, 3, 5, 4, 2, 8, 4, 2, "fwd+bwd", distinct=(3, 2, 1)) == 460 + 616 - 2 * 60


def test_the_embeddings_case_counts_its_ids_distinct_rows():
    """The kernel suite's embeddings case divides by the rows its ids gather, each distinct word, position
    and token-type row once: at CPU's 64 tokens over 100 words, fewer words than tokens."""
    from bertfast.bench.common import generator_for
    from bertfast.bench.kernel_cases import embeddings_cases
    case = embeddings_cases(_cpu_ctx())[0]
    t, h, vocab = case.case["tokens"], case.case["hidden"], case.case["vocab"]
    words = int(torch.randint(0, vocab, (t,), generator=generator_for("embeddings", t, h, vocab)).unique().numel())
    assert words < t
    for d in ("fwd", "bwd"):  # fp32 here: 4-byte tables and outputs; 32 positions (64 % 32), 2 types
        assert case.work(d)["bytes"] == W.embeddings_bytes(t, h, vocab, 32, 2, 8, 4, 4, d, (words, 32, 2))


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


def test_a_small_kernels_bandwidth_comes_from_its_cold_l2_time(monkeypatch):
    """A kernel under SMALL_KERNEL_MS is re-timed warm (graph replay): the row's time is that, but its
    GB/s and % of the copy bandwidth (DRAM's) come from the cold-L2 time, kept as cold_l2_ms; its
    TFLOP/s from the row's time."""
    from bertfast.bench import kernels_suite
    from bertfast.bench.timing import GRAPH_REPLAY
    ctx = SuiteContext(device=_fake_device("cuda"), quick=True, dtype=torch.bfloat16)
    cold, warm = Stat(0.04, 0.04, 0.04, 5), Stat(0.01, 0.01, 0.01, 10)
    monkeypatch.setattr(kernels_suite, "time_fn", lambda fn, dev, policy: cold)
    monkeypatch.setattr(kernels_suite, "time_small", lambda fn, dev, **kw: (warm, GRAPH_REPLAY))
    monkeypatch.setattr(kernels_suite, "host_overhead_us", lambda fn, dev: Stat(30.0, 30.0, 30.0, 3))
    monkeypatch.setattr(kernels_suite, "direction_callable", lambda p, direction: lambda: None)
    t, method, host, got_cold, mem = kernels_suite._time_direction(ctx, None, "fwd")
    assert (t, method, got_cold, mem) == (warm, GRAPH_REPLAY, cold, None)
    m = kernels_suite.metrics_for(ctx, t, {"bytes": 1.2e8, "flops": 1e10}, got_cold)
    assert m["gbps"].median == pytest.approx(3000.0)  # 120 MB in 0.04 ms, not in 0.01 ms
    assert m["pct_copy_bw"].median == pytest.approx(100.0)
    assert m["tflops"].median == pytest.approx(1000.0)
    monkeypatch.setattr(kernels_suite, "time_fn", lambda fn, dev, policy: Stat(0.2, 0.2, 0.2, 5))
    assert kernels_suite._time_direction(ctx, None, "fwd")[3] is None  # not re-timed: no second figure


def test_a_host_bound_back_to_back_retiming_is_not_kept(monkeypatch):
    """A small kernel whose calls cannot be captured is timed back to back; where those calls took no
    longer than their host time, that figure is the host's and the cold-L2 one stands (the H200 run of
    2026-11-27-3: a LayerNorm backward at 0.50 ms back to back, 0.51 ms of host time a call)."""
    from bertfast.bench import kernels_suite
    from bertfast.bench.timing import BACK_TO_BACK, COLD_L2
    logged = []
    ctx = SuiteContext(device=_fake_device("cuda"), quick=True, dtype=torch.bfloat16, log=logged.append)
    cold = Stat(0.03, 0.03, 0.03, 5)
    monkeypatch.setattr(kernels_suite, "time_fn", lambda fn, dev, policy: cold)
    monkeypatch.setattr(kernels_suite, "direction_callable", lambda p, direction: lambda: None)

    def not_capturable(fn, dev, not_captured):
        not_captured(RuntimeError("operation not permitted when stream is capturing"))
        return Stat(0.50, 0.50, 0.50, 10), BACK_TO_BACK
    monkeypatch.setattr(kernels_suite, "time_small", not_capturable)
    monkeypatch.setattr(kernels_suite, "host_overhead_us", lambda fn, dev: Stat(508.0, 508.0, 508.0, 5))
    t, method, host, got_cold, _ = kernels_suite._time_direction(ctx, None, "fwd")
    assert (t, method, got_cold) == (cold, COLD_L2, None) and host.median == 508.0
    assert logged == ["  fwd: not captured in a CUDA graph (RuntimeError: operation not permitted when stream "
                      "is capturing): timed back to back"]
    device_bound = Stat(0.02, 0.02, 0.02, 10)  # back to back, the host well ahead: kept
    monkeypatch.setattr(kernels_suite, "time_small", lambda fn, dev, **kw: (device_bound, BACK_TO_BACK))
    monkeypatch.setattr(kernels_suite, "host_overhead_us", lambda fn, dev: Stat(5.0, 5.0, 5.0, 5))
    assert kernels_suite._time_direction(ctx, None, "fwd")[:2] == (device_bound, BACK_TO_BACK)


def test_sequence_lengths_modes():
    g = torch.Generator().manual_seed(1)
    assert sequence_lengths("none", 3, 8, g) == [8, 8, 8]
    fine = sequence_lengths("finetune", 64, 128, g)
    assert sum(fine) == 32 * 128  # pairs sum to max_len: mean exactly 50%
    assert all(1 <= n <= 128 for n in fine) and len(set(fine)) > 4
    pre = sequence_lengths("pretrain", 200, 128, g)
    assert sum(n == 128 for n in pre) > 150 and min(pre) >= 32


def test_parameter_modes_and_their_bytes():
    from bertfast.bench import kernel_cases
    gpu = SuiteContext(device=_fake_device("cuda"), quick=True, dtype=torch.bfloat16)
    assert kernel_cases._param_modes(gpu) == ("act", "fp32")
    assert kernel_cases._sizes(gpu, "fp32") == (2, 4) and kernel_cases._sizes(gpu, "act") == (2, 2)
    assert kernel_cases._param_modes(_cpu_ctx()) == ("act",)


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
