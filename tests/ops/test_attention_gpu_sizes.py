"""attention's contract at GPU sizes (marked gpu: skipped without one): every head dim at awkward
lengths, dropout, BERT's shapes in low precision, and fp32 without TF32. The inputs and checks are
test_attention.py's."""
import pytest
import torch

from bertfast.testing import PADDING_MODES, BackendUnderTest, mask_from_lengths
from test_attention import (BF16, FP16, FP32, PADDED, VARLEN, _bert_lengths, check_padded, check_varlen, key_mask,
                            lengths_of, padded_inputs, seed_of, varlen_inputs)

LOWP_GPU = [BF16, FP16]
ALL_GPU = [FP32, FP16, BF16]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", PADDING_MODES)
@pytest.mark.parametrize("head_dim", [16, 26, 32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", ALL_GPU, ids=["fp32", "fp16", "bf16"])
def test_gpu_varlen_awkward_length_every_head_dim(backend, dtype, head_dim, mode):
    lengths = lengths_of(mode, 3, 77, seed=7)  # 77 > one 64-query block
    q, k, v, dout, cu = varlen_inputs(backend, lengths, dtype, head_dim, heads=2)
    # fp32: sums over up to 77 keys / queries in another order than einsum's
    check_varlen(backend, q, k, v, dout, cu, int(lengths.max()), atol=1e-4, grad_atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["nomask", "random", "empty", "scattered"])
@pytest.mark.parametrize("head_dim", [16, 26, 32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", ALL_GPU, ids=["fp32", "fp16", "bf16"])
def test_gpu_padded_awkward_length_every_head_dim(backend, dtype, head_dim, kind):
    q, k, v, dout = padded_inputs(backend, 3, 77, dtype, head_dim, heads=2)
    check_padded(backend, q, k, v, dout, key_mask(kind, 3, 77, seed=11), atol=1e-4, grad_atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [26, 64, 128, 256])
@pytest.mark.parametrize("form", ["varlen", "padded"])
@pytest.mark.parametrize("dtype", ALL_GPU, ids=["fp32", "fp16", "bf16"])
def test_gpu_dropout_exact(backend, dtype, form, head_dim):
    seed = seed_of(backend, 77)
    if form == "varlen":
        lengths = lengths_of("empty", 3, 77, seed=7)
        q, k, v, dout, cu = varlen_inputs(backend, lengths, dtype, head_dim)
        check_varlen(backend, q, k, v, dout, cu, int(lengths.max()), p=0.2, seed=seed, atol=1e-4, grad_atol=1e-4)
    else:
        q, k, v, dout = padded_inputs(backend, 3, 77, dtype, head_dim)
        check_padded(backend, q, k, v, dout, key_mask("scattered", 3, 77, seed=11), p=0.2, seed=seed, atol=1e-4,
                     grad_atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["varlen", "padded"])
@pytest.mark.parametrize("heads", [12, 16])
@pytest.mark.parametrize("seqlen", [128, 512])
@pytest.mark.parametrize("dtype", LOWP_GPU, ids=["bf16", "fp16"])
def test_gpu_lowp_bert_sizes(backend, dtype, seqlen, heads, form):
    lengths = _bert_lengths(seqlen)
    if form == "varlen":
        q, k, v, dout, cu = varlen_inputs(backend, lengths, dtype, 64, heads)
        check_varlen(backend, q, k, v, dout, cu, seqlen)
    else:
        q, k, v, dout = padded_inputs(backend, 4, seqlen, dtype, 64, heads)
        check_padded(backend, q, k, v, dout, mask_from_lengths(lengths, seqlen))


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["varlen", "padded"])
@pytest.mark.parametrize("seqlen", [128, 512])  # Triton: the one-pass backward, then the three kernels
def test_gpu_dropout_bf16_bert_size(backend, seqlen, form):
    lengths, seed = _bert_lengths(seqlen), seed_of(backend, 77)
    if form == "varlen":
        q, k, v, dout, cu = varlen_inputs(backend, lengths, BF16, 64, 12)
        check_varlen(backend, q, k, v, dout, cu, seqlen, p=0.1, seed=seed)
    else:
        q, k, v, dout = padded_inputs(backend, 4, seqlen, BF16, 64, 12)
        check_padded(backend, q, k, v, dout, mask_from_lengths(lengths, seqlen), p=0.1, seed=seed)


@pytest.mark.gpu
def test_gpu_fp32_is_ieee_accurate(backend):
    # No TF32 anywhere: fp32 stays within fp32 rounding of the reference at S = 128.
    lengths = _bert_lengths(128)
    q, k, v, dout, cu = varlen_inputs(backend, lengths, FP32, 64, 12)
    check_varlen(backend, q, k, v, dout, cu, 128, atol=1e-5, grad_atol=5e-5)


@pytest.mark.gpu
def test_gpu_dropout_mask_fraction_at_scale(backend):
    p, impl = 0.1, backend.module(PADDED)
    keep = impl.attention_padded_dropout_mask(4, 128, 4, p, seed_of(backend, 1))
    assert abs((1.0 - keep.float().mean().item()) - p) < 0.004  # 262144 draws: sigma 0.0006
    cu = torch.tensor([0, 100, 228, 300, 428], dtype=torch.int32, device=backend.device)
    assert torch.equal(keep, backend.module(VARLEN).attention_varlen_dropout_mask(cu, 128, 4, p, seed_of(backend, 1)))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [26, 64, 128, 256])
@pytest.mark.parametrize("dtype", ALL_GPU, ids=["fp32", "fp16", "bf16"])
def test_gpu_triton_atomic_dq(monkeypatch, dtype, head_dim):
    """BERTFAST_ATTENTION_DQ=atomic (kernels/attention.py, "Atomic dQ") past the one-pass kernel's lengths:
    the varlen form with empty sequences and dropout, the padded form with keys anywhere, against the
    reference; its adds are the GPU's atomics, which the interpreter's tests do not run."""
    from bertfast.kernels import attention as K

    monkeypatch.setenv(K.DQ_ENV, "atomic")
    triton = BackendUnderTest("triton", torch.device("cuda"))
    seed = seed_of(triton, 78)
    lengths = lengths_of("empty", 3, 200, seed=8)  # past 128 (fp16/bf16) and 32 (fp32): not the one-pass kernel
    q, k, v, dout, cu = varlen_inputs(triton, lengths, dtype, head_dim)
    check_varlen(triton, q, k, v, dout, cu, int(lengths.max()), p=0.2, seed=seed, atol=1e-4, grad_atol=1e-4)
    q, k, v, dout = padded_inputs(triton, 3, 200, dtype, head_dim)
    check_padded(triton, q, k, v, dout, key_mask("scattered", 3, 200, seed=12), atol=1e-4, grad_atol=1e-4)


@pytest.mark.gpu
def test_gpu_triton_atomic_dq_bert_size(monkeypatch):
    """The atomic dQ at BERT-base's training shape (bf16, seq 512, dropout 0.1, the varlen form the encoder
    runs) against the reference: dQ summed from 4 key blocks' adds."""
    from bertfast.kernels import attention as K

    monkeypatch.setenv(K.DQ_ENV, "atomic")
    triton = BackendUnderTest("triton", torch.device("cuda"))
    lengths = _bert_lengths(512)
    q, k, v, dout, cu = varlen_inputs(triton, lengths, BF16, 64, 12)
    check_varlen(triton, q, k, v, dout, cu, 512, p=0.1, seed=seed_of(triton, 79))


@pytest.mark.gpu
def test_gpu_triton_persistent_one_pass_backward(monkeypatch):
    """The one-pass backward's PERSISTENT candidate (kernels/attention.py: a program per SM takes every
    (sequence, head) in turn, the next one's tiles loaded while it computes this one's), forced as
    the autotuner may choose it, at BERT-base's seq-128 training shape with dropout (the varlen form,
    the one it is offered in), against the reference: its clamped loads and the rows past the ends."""
    from bertfast.kernels import _common, attention as K

    prune = K._bwd_fused_tuned.early_config_prune
    monkeypatch.setattr(K._bwd_fused_tuned, "early_config_prune", lambda configs, nargs, **kw: [
        c for c in prune(configs, nargs, **kw) if c.kwargs.get("PERSISTENT")])
    monkeypatch.setattr(_common, "_LAUNCH_KWARGS", {})
    monkeypatch.setenv(_common.AUTOTUNE_ENV, "0")
    triton = BackendUnderTest("triton", torch.device("cuda"))
    q, k, v, dout, cu = varlen_inputs(triton, _bert_lengths(128), BF16, 64, 12)
    check_varlen(triton, q, k, v, dout, cu, 128, p=0.1, seed=seed_of(triton, 80))
