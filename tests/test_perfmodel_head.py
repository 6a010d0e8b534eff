"""The MLM head's target predicted (bertfast/perfmodel/head.py): its GEMMs priced as its floor's, and
what it moves besides them line by line as the op's code runs, so its ratio to the floor."""
from __future__ import annotations

import pytest

from bertfast.perfmodel import head as HEAD
from bertfast.perfmodel import reach as R
from bertfast.perfmodel.hardware import H100, H200


def test_the_floor_is_the_heads_gemms_and_the_rest_is_priced_by_its_bytes():
    plan = HEAD.lines(1024)
    m, h, v, vp = 2432, 1024, 30522, 30528  # 19 labelled of each sequence's 128 tokens, 128 sequences
    assert (plan["rows"], plan["vocab"], plan["padded_vocab"], plan["chunks"]) == (m, v, vp, 1)
    assert plan["gemm_flops"] == pytest.approx(3 * (2 * m * h * h + 2 * m * vp * h))
    assert plan["floor_s"] == pytest.approx(plan["gemm_flops"] / H100.gemm_flops)
    items = {i["name"]: i for i in plan["items"]}
    bw = H100.achievable_hbm_bytes_per_s
    assert items["loss"]["bytes"] == 2 * m * v * 2  # read, and the gradient written in place
    assert items["bias gradient"]["bytes"] == m * v * 2 + v * 4
    assert items["weight copy"]["bytes"] == v * h * 2 + vp * h * 2
    # one chunk, bf16 weights: the weight gradient is its GEMM's output, as the floor's
    assert items["weight gradient"]["bytes"] == 0 and "one chunk" in items["weight gradient"]["how"]
    assert all(i["seconds"] == pytest.approx(i["bytes"] / bw) for i in plan["items"] if i["bytes"])
    assert items["launch gaps"]["seconds"] == pytest.approx(HEAD.LAUNCH_COUNT * H100.launch_gap_s)
    # one chunk: the loss's incoming gradient scales x before the weight gradient's GEMM and the input and
    # bias gradients after theirs (each read and written), not the [V, H] weight gradient
    assert items["scaling"]["bytes"] == 4 * m * h * 2 + 2 * v * 4
    assert plan["seconds"] == pytest.approx(plan["floor_s"] + sum(i["seconds"] for i in plan["items"]))
    assert plan["ratio"] == pytest.approx(plan["seconds"] / plan["floor_s"])


def test_fp32_weights_and_chunks_add_the_fp32_weight_gradient():
    """fp32 master weights (training under autocast): the GEMM writes fp32, no cast after; bf16 weights
    over several chunks: the fp32 sums read back and cast at the end."""
    h, v, vp = 1024, 30522, 30528
    fp32 = {i["name"]: i["bytes"] for i in HEAD.lines(h, weight_bytes=4)["items"]}
    assert fp32["weight gradient"] == vp * h * 2 and fp32["weight copy"] == v * h * 4 + vp * h * 2
    many = HEAD.lines(h, tokens=16384 * 4)  # 9,728 labelled rows: 3 chunks of logits
    assert many["chunks"] == 3
    many_items = {i["name"]: i["bytes"] for i in many["items"]}
    assert many_items["weight gradient"] == vp * h * 2 + 2 * vp * h * 4 + v * h * 6
    # the forward's gradients, for a loss scale of 1, each scaled in the backward
    assert many_items["scaling"] == 2 * (9728 * h * 2 + v * h * 2 + v * 2)


def test_the_ceiling_keeps_only_what_library_gemms_cannot_avoid():
    """The loss kernel, the bias gradient's column sum, the gather and scatter, the transform and the
    launches: BERT-large's ceiling above the 1.25x target (out of reach, with why), on the H100 and, just,
    on the H200."""
    plan = HEAD.lines(1024)
    kept = sum(i["seconds"] for i in plan["items"] if i["name"] in HEAD.STRUCTURAL)
    assert plan["ceiling"] == pytest.approx((plan["floor_s"] + kept) / plan["floor_s"])
    assert 1.0 < plan["ceiling"] < plan["ratio"]
    assert {"weight copy", "weight gradient", "scaling"}.isdisjoint(HEAD.STRUCTURAL)
    line = HEAD.target(1024)
    assert line["ceiling"] == plan["ceiling"] > HEAD.TARGET
    assert R.out_of_reach(line).startswith("with library GEMMs the loss reads the logits")
    # faster memory, a lower ceiling: on the H200 just above the target (the static gather's launches)
    assert plan["ceiling"] > HEAD.lines(1024, gpu=H200)["ceiling"] > HEAD.TARGET


def test_the_target_line():
    line = HEAD.target(1024)
    assert line["name"].startswith("MLM head fwd+bwd (BERT-large, 16,384 tokens, 2,432 labelled")
    assert line["target"] == 1.25 and line["met"] == (line["predicted"] <= 1.25)
    assert line["predicted"] == pytest.approx(line["plan"]["ratio"])
    # faster memory, a smaller share besides the GEMMs
    assert HEAD.target(1024, H200)["predicted"] < line["predicted"]
    text = HEAD.describe(line)
    assert text[0].startswith("MLM head fwd+bwd (BERT-large") and "its GEMM floor of 648 us" in text[0]
    assert len(text) == 2 + len(line["plan"]["items"]) and text[-1].startswith("  ceiling 1.35x: the floor with only")


def test_the_model_prices_the_kernel_suites_case():
    """Its labelled rows are the case's: the suite's positions in each sequence at the case's length."""
    from bertfast.bench.kernel_cases import mlm_predictions_per_seq
    assert HEAD.PER_SEQUENCE == mlm_predictions_per_seq(HEAD.SEQ)
    assert HEAD.lines(1024)["rows"] == HEAD.TOKENS // HEAD.SEQ * HEAD.PER_SEQUENCE == 2432


FUSED = {"forward_s": 240e-6, "stats_s": 8e-6, "dx_s": 215e-6, "dw_s": 230e-6, "dx_split": 3,
         **{f"{k}_config": "BLOCK_M=64 BLOCK_N=128" for k in ("forward", "stats", "dx", "dw")},
         "binding": "schedule"}


def test_the_fused_decoder_is_priced_by_its_kernels():
    """BERTFAST_MLM_HEAD=fused: the same floor; each of its three GEMMs beyond the floor's share (the input
    gradient's partials summed in its own epilogue) and its statistics kernel as predicted; x padded beside its
    ones, the sort and the bias gradient's cast by their bytes; no weight copy, loss kernel, column sum, logits'
    gradient or scaling."""
    plan, library = HEAD.fused_lines(1024, FUSED), HEAD.lines(1024)
    m, h, v, vp = 2432, 1024, 30522, 30528
    assert (plan["floor_s"], plan["gemm_flops"], plan["rows"]) == (library["floor_s"], library["gemm_flops"], m)
    items = {i["name"]: i for i in plan["items"]}
    assert list(items) == ["gather, scatter", "transform", "forward GEMM", "statistics", "input GEMM", "weight GEMM",
                           "between", "launch gaps"]
    one_floor = 2 * m * vp * h / H100.gemm_flops
    assert plan["floor_s"] == pytest.approx(3 * one_floor + 3 * 2 * m * h * h / H100.gemm_flops)
    for name, key in (("forward GEMM", "forward_s"), ("input GEMM", "dx_s"), ("weight GEMM", "dw_s")):
        assert items[name]["seconds"] == pytest.approx(FUSED[key] - one_floor)
    assert items["statistics"]["seconds"] == 8e-6 and "split 3 ways" in items["input GEMM"]["how"]
    assert items["between"]["bytes"] == m * (h + 1152) * 2 + m * 32 + v * 6
    assert items["launch gaps"]["seconds"] == pytest.approx(HEAD.FUSED_LAUNCH_COUNT * H100.launch_gap_s)
    assert plan["ratio"] == pytest.approx(plan["seconds"] / plan["floor_s"])
    kept = sum(i["seconds"] for i in plan["items"] if i["name"] in HEAD.FUSED_STRUCTURAL)
    assert plan["ceiling"] == pytest.approx((plan["floor_s"] + kept) / plan["floor_s"])
    assert not any("GEMM" in name for name in HEAD.FUSED_STRUCTURAL)  # at the floor's rate
    no_split = HEAD.fused_lines(1024, dict(FUSED, dx_split=1))
    assert "split" not in {i["name"]: i["how"] for i in no_split["items"]}["input GEMM"]


def test_the_target_takes_the_faster_design():
    """With the fused decoder's kernels the target line is the faster design's (the kernel suite's target
    takes the fastest of bertfast's rows), its ceiling that design's, and the report describes both."""
    line = HEAD.target(1024, H100, FUSED)
    assert line["design"] == "fused" and line["predicted"] == line["fused_plan"]["ratio"] < line["plan"]["ratio"]
    assert line["ceiling"] == line["fused_plan"]["ceiling"]
    assert R.out_of_reach(line) is None  # its ceiling is under the target
    assert line["ceiling_why"].startswith("with the gradient inside bertfast's own GEMMs")
    text = HEAD.describe(line)
    assert len(text) == 4 + len(line["plan"]["items"]) + len(line["fused_plan"]["items"])
    fused_header = "MLM head fwd+bwd (BERT-large, 16,384 tokens, 2,432 labelled, bf16), BERTFAST_MLM_HEAD=fused"
    assert any(t.startswith(fused_header) for t in text)
    slow = HEAD.target(1024, H100, dict(FUSED, forward_s=500e-6))  # a fused GEMM far slower than the library's
    assert slow["design"] == "library" and slow["predicted"] == slow["plan"]["ratio"]
    assert R.out_of_reach(slow).startswith("with library GEMMs the loss reads the logits")


# torch operations that run no kernel (views, allocations, metadata)
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "view", "_unsafe_view", "reshape", "_reshape_alias", "t",
              "transpose", "expand", "slice", "select", "unsqueeze", "squeeze", "as_strided", "detach", "alias",
              "permute", "lift_fresh", "split", "split_with_sizes", "new_empty", "new_empty_strided", "sym_size",
              "sym_stride", "sym_numel", "is_same_size"}
_GEMMS = {"mm", "addmm", "_mlm_logits_gemm_kernel", "_softmax_dx_gemm_kernel", "_softmax_dw_gemm_kernel"}


def _head_launches(mode: str, monkeypatch) -> int:
    """The kernels besides the GEMMs of ops.mlm_head_loss's forward and backward in ``mode`` (bf16, the static
    gather, Triton's kernels), traced on CPU as a GPU step runs it: its checks on the device, the vocabulary
    padded, each torch.sort counted as HEAD.SORT_KERNELS."""
    import importlib

    import torch

    from bertfast.dispatch import use_backend
    from bertfast.kernels import _common
    from bertfast.testing import AtenLog
    ops = importlib.import_module("bertfast.ops.mlm_head_loss")
    monkeypatch.setattr(ops, "value_checks", lambda t: "device")
    monkeypatch.setattr(ops, "PADDED_DEVICES", {"cuda", "cpu"})
    log, triton, inside = AtenLog(), [], set()
    launch = _common.launch

    def traced(kernel, *args, **kwargs):  # a Triton launch; the torch operations it makes (the interpreter's) not
        start = len(log.calls)
        try:
            return launch(kernel, *args, **kwargs)
        finally:
            inside.update(range(start, len(log.calls)))
            triton.append(_common.jit_function(kernel).__name__)
    for module in ("mlm_head_loss", "bias_gelu", "bias_dropout_residual_layernorm", "_rows"):
        kernels = importlib.import_module(f"bertfast.kernels.{module}")
        if hasattr(kernels, "launch"):
            monkeypatch.setattr(kernels, "launch", traced)
    gen = torch.Generator().manual_seed(0)
    batch, seq, hidden, vocab = 4, 32, 64, 301
    labels = torch.full((batch, seq), -100)
    labels[:, ::7] = torch.randint(0, vocab, (batch, 5), generator=gen)
    x = torch.randn(batch, seq, hidden, generator=gen).bfloat16().requires_grad_()
    shapes = ((hidden, hidden), (hidden,), (hidden,), (hidden,), (vocab, hidden), (vocab,))
    params = [(torch.randn(*s, generator=gen) * 0.1).bfloat16().requires_grad_() for s in shapes]
    seed = torch.ones(())  # the loss's gradient, made outside the count (as the step's scaler makes it)
    with ops.using_head_mode(mode), use_backend("triton"), log:
        out = ops.mlm_head_loss(x, labels, *params[:4], 1e-12, *params[4:], max_predictions_per_seq=5)
        out.loss.backward(seed)
    names = [func.__name__.split(".")[0] for i, func in enumerate(log.ops) if i not in inside] + triton
    return sum(HEAD.SORT_KERNELS if name == "sort" else 1 for name in names
               if name not in _NO_KERNEL and name not in _GEMMS)


@pytest.mark.parametrize("mode", ["library", "fused"])
def test_the_launch_gaps_count_the_ops_own_kernels(mode, monkeypatch):
    """The head's launch gaps: LAUNCH_COUNT and FUSED_LAUNCH_COUNT are the kernels the op runs besides its GEMMs,
    counted by tracing it (torch's operations and Triton's launches), not an estimate."""
    want = HEAD.LAUNCH_COUNT if mode == "library" else HEAD.FUSED_LAUNCH_COUNT
    assert _head_launches(mode, monkeypatch) == want
