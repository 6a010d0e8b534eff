"""The fine-tuning target's prediction (bertfast/perfmodel/finetune.py, kernels.at_lengths): the
attention's kernels at a padded batch's lengths pay for every tile a sequence fills in part, the
batches are the model suite's, and the padded step adds to the full one only what differs."""
from __future__ import annotations

import pytest

from bertfast.perfmodel import finetune as FT
from bertfast.perfmodel import kernels as K
from bertfast.perfmodel.hardware import H100
from bertfast.perfmodel.model import Work

HEADS = 12
SETTING = K.Setting("bert-base", 128, 16, 0.1)
PAIRS = [40, 88] * 16  # 32 sequences holding 16 full ones' tokens


def _launch(kernel: str, **meta) -> K.Launch:
    return K.Launch("attention", kernel, dict(meta, num_warps=8), (1,), (), lambda: None, ())


def test_a_tile_filled_in_part_costs_a_whole_one():
    # the forward, 128 queries x 64 keys a tile: a full sequence is 1 x 2 tiles, 40 tokens 1 x 1, 88 1 x 2
    fwd = _launch("_attention_fwd_kernel", BLOCK_M=128, BLOCK_N=64)
    work = Work(iterations=16 * HEADS * 2, tile_elements=128 * 64, programs=16 * HEADS, warps=8, hbm_bytes=1e6)
    padded = K.at_lengths(work, fwd, SETTING, PAIRS, H100)
    assert padded.iterations == HEADS * 16 * (1 + 2) and padded.programs == HEADS * 32
    assert (padded.hbm_bytes, padded.tile_elements) == (1e6, 128 * 64)  # the same tokens, the same tile
    # dK/dV walks key blocks in its programs, query blocks in its loop
    dkdv = _launch("_attention_bwd_dkdv_kernel", BLOCK_M=64, BLOCK_N=128)
    work = Work(16 * HEADS * 2, 64 * 128, 16 * HEADS, 8, 1e6)
    assert K.at_lengths(work, dkdv, SETTING, PAIRS, H100).programs == HEADS * 32
    # the one-pass backward: a program per (sequence, head), its query blocks to the sequence's end
    fused = _launch("_attention_bwd_fused_kernel", BLOCK_M=64, BLOCK_N=128)
    work = Work(16 * HEADS * 2, 64 * 128, 16 * HEADS, 8, 1e6)
    padded = K.at_lengths(work, fused, SETTING, PAIRS, H100)
    assert padded.iterations == HEADS * 16 * (1 + 2) and padded.programs == HEADS * 32
    # persistent, it walks every query block of its key tile: a sequence costs a full one
    persistent = _launch("_attention_bwd_fused_kernel", BLOCK_M=32, BLOCK_N=128, PERSISTENT=True)
    work = Work(16 * HEADS, 128 * 128, H100.sms, 8, 1e6)
    padded = K.at_lengths(work, persistent, SETTING, PAIRS, H100)
    assert padded.iterations == HEADS * 32 and padded.programs == H100.sms
    # full lengths change nothing
    assert K.at_lengths(work, persistent, SETTING, [128] * 16, H100).iterations == work.iterations
    with pytest.raises(KeyError, match="no tiles per sequence"):
        K.at_lengths(work, _launch("_attention_bwd_dq_store_kernel"), SETTING, PAIRS, H100)


def test_the_batches_are_the_model_suites():
    from bertfast.bench.common import generator_for, sequence_lengths
    from bertfast.bench.model_suite import GPU_CASES
    assert FT.cases() == GPU_CASES["finetune"]
    for model, seq, batch in FT.cases():
        lengths = FT.lengths(model, seq, batch)
        assert lengths == sequence_lengths("finetune", batch, seq, generator_for("finetune", model, seq, batch))
        full = FT.full_setting(model, seq, batch)
        assert (full.batch, full.seq, sum(lengths)) == (batch // 2, seq, full.tokens)
        assert min(lengths) < seq // 2 < max(lengths) < seq  # padded: no sequence full
