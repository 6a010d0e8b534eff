"""Triton attention (bertfast.kernels.attention) against the oracle, bertfast.reference.

On CPU the kernels run under the Triton interpreter (tests/conftest.py), so shapes stay small:
B <= 3 sequences, S <= 40, A = 2 heads, head dims 32/64 (128 once). The interpreter's block
sizes differ per kernel (forward 16x16, dK/dV 16x32, dQ 32x16, mask 16x32), so the tail-block
and multi-block paths and the block-independence of the dropout mask are all exercised.

Tolerances (DESIGN.md section 6): fp32 against the fp32 reference with atol 1e-5 (outputs)
and atol 2e-5 + rtol 1e-4 for gradients, which sum over up to S keys/queries in a different
order than the reference einsum; fp16 by the 2x rule (assert_close_lowp) with the reference
run in fp16 as the yardstick.
"""
import math

import pytest
import torch

from bertfast import reference
from bertfast.kernels import attention as attn
from bertfast.testing import (PADDING_MODES, assert_close_lowp, cu_seqlens_from_lengths,
                              make_lengths, mask_from_lengths)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.gpu_capable  # on CUDA when there is a GPU, else the interpreter
B, S, A = 3, 40, 2


def _seed(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64, device=DEVICE)


def _ref_grads(fn, inputs, dout):
    """Run the reference fn on leaf copies of inputs; returns (out, [grad per input])."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves]


def _compare(name, fast, ref32, ref_lowp, dtype, grad=False):
    if dtype == torch.float32:
        rtol = 1e-4 if grad else 0.0
        atol = 2e-5 if grad else 1e-5
        torch.testing.assert_close(fast, ref32, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
    else:
        assert_close_lowp(fast.float(), ref32, ref_lowp.float(), atol=1e-5, name=name)


def _varlen_inputs(lengths, dtype, head_dim, packed, gen, heads=A):
    tokens = int(lengths.sum())
    base = torch.randn(tokens, 3, heads, head_dim, generator=gen)  # [T, 3, A, D]
    if packed:
        qkv = base.to(DEVICE, dtype)
        q, k, v = qkv.unbind(1)  # strided views of one buffer, as the encoder passes them
        assert not q.is_contiguous()
    else:
        q, k, v = (base[:, i].contiguous().to(DEVICE, dtype) for i in range(3))
    dout = torch.randn(tokens, heads, head_dim, generator=gen).to(DEVICE, dtype)
    return q, k, v, dout, cu_seqlens_from_lengths(lengths).to(DEVICE)


def _check_varlen(lengths, dtype, head_dim, packed, dropout_p=0.0, seed=None, gen=None):
    max_len = int(lengths.max()) if lengths.numel() else 0
    q, k, v, dout, cu = _varlen_inputs(lengths, dtype, head_dim, packed, gen)
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = attn.attention_varlen_fwd(q, k, v, cu, max_len, scale, dropout_p, seed)
    dqkv = attn.attention_varlen_bwd(dout, q, k, v, out, lse, cu, max_len, scale, dropout_p, seed)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (A, q.shape[0]) and lse.dtype == torch.float32
    assert dqkv.shape == (q.shape[0], 3, A, head_dim) and dqkv.dtype == dtype
    assert torch.isfinite(out).all() and torch.isfinite(dqkv).all()

    mask = None
    if dropout_p > 0:
        mask = attn.attention_varlen_dropout_mask(cu, max_len, A, dropout_p, seed)

    def ref(q_, k_, v_):
        return reference.attention_varlen(q_, k_, v_, cu, max_len, scale, dropout_p, mask)

    ins32 = [t.float() for t in (q, k, v)]
    out32, grads32 = _ref_grads(ref, ins32, dout.float())
    out_lp, grads_lp = (out32, grads32) if dtype == torch.float32 else _ref_grads(ref, (q, k, v), dout)
    _compare("out", out.float(), out32, out_lp, dtype)
    for i, name in enumerate(("dq", "dk", "dv")):
        _compare(name, dqkv[:, i].float(), grads32[i], grads_lp[i], dtype, grad=True)

    # lse = log sum_j exp(scale * q.k) per sequence, head and query.
    for bi in range(lengths.numel()):
        s0, s1 = int(cu[bi]), int(cu[bi + 1])
        if s1 > s0:
            scores = torch.einsum("qad,kad->aqk", ins32[0][s0:s1], ins32[1][s0:s1]) * scale
            torch.testing.assert_close(lse[:, s0:s1], torch.logsumexp(scores, -1), atol=1e-5, rtol=1e-6)
    return out, dqkv


# --------------------------------------------------------------------------- varlen
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("mode", PADDING_MODES)
def test_varlen_matches_reference(mode, dtype):
    gen = torch.Generator().manual_seed(1)
    lengths = make_lengths(mode, B, S, gen)
    _check_varlen(lengths, dtype, 32, packed=True, gen=gen)


@pytest.mark.parametrize("head_dim,dtype", [(64, torch.float32), (64, torch.float16),
                                            (128, torch.float32)], ids=["d64-fp32", "d64-fp16", "d128-fp32"])
def test_varlen_head_dims(head_dim, dtype):
    gen = torch.Generator().manual_seed(2)
    lengths = torch.tensor([33, 16, 7])  # an exact block multiple, a tail and a short sequence
    _check_varlen(lengths, dtype, head_dim, packed=head_dim == 64, gen=gen)


def test_varlen_separate_tensors_and_strided_dout():
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([21, 40])
    q, k, v, _, cu = _varlen_inputs(lengths, torch.float32, 32, packed=False, gen=gen)
    scale = 0.3  # not 1/sqrt(D): the scale argument is honoured
    out, lse = attn.attention_varlen_fwd(q, k, v, cu, 40, scale, 0.0, None)
    dout = torch.randn(q.shape[0], 32, A, generator=gen).to(DEVICE).transpose(1, 2)  # stride(-1) != 1
    dqkv = attn.attention_varlen_bwd(dout, q, k, v, out, lse, cu, 40, scale, 0.0, None)

    def ref(q_, k_, v_):
        return reference.attention_varlen(q_, k_, v_, cu, 40, scale)

    out32, grads = _ref_grads(ref, (q, k, v), dout)
    torch.testing.assert_close(out, out32, atol=1e-5, rtol=0)
    for i in range(3):
        torch.testing.assert_close(dqkv[:, i], grads[i], atol=2e-5, rtol=1e-4)


def test_varlen_max_seqlen_larger_than_longest():
    """max_seqlen is an upper bound: a larger value launches idle programs, same result."""
    gen = torch.Generator().manual_seed(4)
    lengths = torch.tensor([9, 20])
    q, k, v, dout, cu = _varlen_inputs(lengths, torch.float32, 32, packed=True, gen=gen)
    o1, l1 = attn.attention_varlen_fwd(q, k, v, cu, 20, 0.2, 0.0, None)
    o2, l2 = attn.attention_varlen_fwd(q, k, v, cu, 37, 0.2, 0.0, None)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


# --------------------------------------------------------------------------- padded
def _key_mask(kind, gen):
    """[B, S] int mask (1 = token); prefix masks from the padding modes, or a scattered one."""
    if kind == "scattered":
        mask = (torch.rand(B, S, generator=gen) < 0.6).long()
        mask[1] = 0  # a fully padded sequence
        mask[2] = torch.arange(S) % 3 == 1  # keys not at the front, bool-valued row
        return mask
    return mask_from_lengths(make_lengths(kind, B, S, gen), S)


def _check_padded(key_mask, dtype, head_dim, dropout_p=0.0, seed=None, gen=None, mask_dtype=None):
    qkv = torch.randn(B, S, 3, A, head_dim, generator=gen).to(DEVICE, dtype)  # packed [B, S, 3, A, D]
    q, k, v = qkv.unbind(2)
    dout = torch.randn(B, S, A, head_dim, generator=gen).to(DEVICE, dtype)
    kpm = None if key_mask is None else key_mask.to(DEVICE, mask_dtype or key_mask.dtype)
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = attn.attention_padded_fwd(q, k, v, kpm, scale, dropout_p, seed)
    dq, dk, dv = attn.attention_padded_bwd(dout, q, k, v, out, lse, kpm, scale, dropout_p, seed)
    assert out.shape == q.shape and lse.shape == (B, A, S) and lse.dtype == torch.float32
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all() and t.dtype == dtype

    drop_mask = attn.attention_padded_dropout_mask(B, S, A, dropout_p, seed) if dropout_p > 0 else None
    ref_kpm = None if key_mask is None else key_mask.to(DEVICE)

    def ref(q_, k_, v_):
        return reference.attention(q_, k_, v_, ref_kpm, scale, dropout_p, drop_mask)

    out32, grads32 = _ref_grads(ref, [t.float() for t in (q, k, v)], dout.float())
    out_lp, grads_lp = (out32, grads32) if dtype == torch.float32 else _ref_grads(ref, (q, k, v), dout)
    # Every position is compared: query rows at pads attend to the valid keys, as in the reference.
    _compare("out", out.float(), out32, out_lp, dtype)
    for name, fast, r32, rlp in zip(("dq", "dk", "dv"), (dq, dk, dv), grads32, grads_lp):
        _compare(name, fast.float(), r32, rlp, dtype, grad=True)
    if key_mask is not None:
        pad_keys = ~key_mask.bool().to(DEVICE)
        assert (dk[pad_keys] == 0).all() and (dv[pad_keys] == 0).all()
        no_key = ~key_mask.bool().any(1).to(DEVICE)
        assert (out[no_key] == 0).all() and (dq[no_key] == 0).all()
        assert torch.isinf(lse[no_key]).all()
    return out, (dq, dk, dv)


# fp32 on every mask kind; fp16 on a representative subset to keep CPU time down.
_PADDED_CASES = ([(kind, torch.float32) for kind in ("nomask", *PADDING_MODES, "scattered")]
                 + [(kind, torch.float16) for kind in ("random", "empty", "scattered")])


@pytest.mark.parametrize("kind,dtype", _PADDED_CASES,
                         ids=[f"{k}-{str(d)[6:]}" for k, d in _PADDED_CASES])
def test_padded_matches_reference(kind, dtype):
    gen = torch.Generator().manual_seed(5)
    key_mask = None if kind == "nomask" else _key_mask(kind, gen)
    _check_padded(key_mask, dtype, 32, gen=gen)


def test_padded_bool_mask_head_dim_64():
    gen = torch.Generator().manual_seed(6)
    _check_padded(_key_mask("scattered", gen), torch.float32, 64, gen=gen, mask_dtype=torch.bool)


# --------------------------------------------------------------------------- dropout
@pytest.mark.parametrize("dtype,mode", [(torch.float32, "random"), (torch.float32, "empty"),
                                        (torch.float16, "none")], ids=["fp32-random", "fp32-empty", "fp16-none"])
def test_varlen_dropout_matches_reference_with_kernel_mask(dtype, mode):
    gen = torch.Generator().manual_seed(7)
    lengths = make_lengths(mode, B, S, gen)
    out, _ = _check_varlen(lengths, dtype, 32, packed=True, dropout_p=0.3, seed=_seed(1234), gen=gen)


def test_padded_dropout_matches_reference_with_kernel_mask():
    gen = torch.Generator().manual_seed(8)
    _check_padded(_key_mask("scattered", gen), torch.float32, 32, dropout_p=0.3, seed=_seed(99), gen=gen)


def test_dropout_masks_varlen_and_padded_agree():
    """Sequence b of a varlen batch and row b of the padded batch draw the same mask."""
    cu = torch.tensor([0, 5, 30, 30], dtype=torch.int32, device=DEVICE)
    seed = _seed(2024)
    m_varlen = attn.attention_varlen_dropout_mask(cu, 25, A, 0.2, seed)
    m_padded = attn.attention_padded_dropout_mask(3, 25, A, 0.2, seed)
    assert m_varlen.dtype == torch.bool and m_varlen.shape == (3, A, 25, 25)
    assert torch.equal(m_varlen, m_padded)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_fraction(p):
    batch, heads, seqlen = 2, 2, 160  # 102400 draws
    keep = attn.attention_padded_dropout_mask(batch, seqlen, heads, p, _seed(31337))
    dropped = 1.0 - keep.float()
    assert abs(dropped.mean().item() - p) < 0.01
    # Each of the four Philox outputs (column phase j % 4) and each (batch, head) stream is fair.
    for phase in range(4):
        assert abs(dropped[..., phase::4].mean().item() - p) < 0.02, phase
    per_stream = dropped.mean(dim=(2, 3)).flatten()
    assert (per_stream - p).abs().max().item() < 0.02
    # Independence: within a group of four columns (one Philox call) and across neighbouring
    # rows, two keep decisions coincide as often as for independent draws, (1 - p)^2.
    kf = keep.float()
    for a in range(4):
        for b in range(a + 1, 4):
            joint = (kf[..., a::4] * kf[..., b::4]).mean().item()
            assert abs(joint - (1 - p) ** 2) < 0.02, (a, b)
    assert abs((kf[:, :, 1:] * kf[:, :, :-1]).mean().item() - (1 - p) ** 2) < 0.01
    # Streams are distinct: no two (batch, head) masks, and no two rows, are identical.
    flat = keep.reshape(batch * heads, -1)
    for i in range(flat.shape[0]):
        for j in range(i + 1, flat.shape[0]):
            assert not torch.equal(flat[i], flat[j])
    assert not torch.equal(keep[0, 0, 0], keep[0, 0, 1])


def test_dropout_determinism_and_seed_dependence():
    gen = torch.Generator().manual_seed(9)
    lengths = torch.tensor([17, 33])
    q, k, v, dout, cu = _varlen_inputs(lengths, torch.float32, 32, packed=True, gen=gen)

    def run(seed_value):
        seed = _seed(seed_value)
        out, lse = attn.attention_varlen_fwd(q, k, v, cu, 33, 0.2, 0.1, seed)
        dqkv = attn.attention_varlen_bwd(dout, q, k, v, out, lse, cu, 33, 0.2, 0.1, seed)
        return out, lse, dqkv

    a, b, c = run(5), run(5), run(6)
    for x, y in zip(a, b):
        assert torch.equal(x, y)  # same seed: bitwise identical outputs and gradients
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[2], c[2])
    assert torch.equal(a[1], c[1])  # lse does not depend on dropout


def test_dropout_zero_ignores_seed():
    gen = torch.Generator().manual_seed(10)
    lengths = torch.tensor([12, 30])
    q, k, v, _, cu = _varlen_inputs(lengths, torch.float32, 32, packed=True, gen=gen)
    o1, _ = attn.attention_varlen_fwd(q, k, v, cu, 30, 0.2, 0.0, None)
    o2, _ = attn.attention_varlen_fwd(q, k, v, cu, 30, 0.2, 0.0, _seed(7))
    assert torch.equal(o1, o2)
    assert attn.attention_padded_dropout_mask(2, 8, A, 0.0, None).all()


# --------------------------------------------------------------------------- empty sequences
def test_varlen_zero_length_sequences_no_nan():
    gen = torch.Generator().manual_seed(11)
    lengths = torch.tensor([0, 7, 0, 0, 12, 0])
    out, dqkv = _check_varlen(lengths, torch.float32, 32, packed=True, dropout_p=0.1,
                              seed=_seed(3), gen=gen)
    assert out.shape[0] == 19


def test_all_sequences_empty():
    cu = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    q = torch.empty(0, 3, A, 32, device=DEVICE).unbind(1)
    out, lse = attn.attention_varlen_fwd(*q, cu, 0, 0.1, 0.0, None)
    dqkv = attn.attention_varlen_bwd(out, *q, out, lse, cu, 0, 0.1, 0.0, None)
    assert out.shape == (0, A, 32) and lse.shape == (A, 0) and dqkv.shape == (0, 3, A, 32)


def test_padded_fully_padded_batch_gives_zeros_with_dropout():
    gen = torch.Generator().manual_seed(12)
    key_mask = _key_mask("empty", gen)
    assert key_mask[0].sum() == 0
    out, (dq, dk, dv) = _check_padded(key_mask, torch.float32, 32, dropout_p=0.1, seed=_seed(4), gen=gen)
    for t in (out, dq, dk, dv):
        assert (t[0] == 0).all()


# --------------------------------------------------------------------------- validation
def test_launchers_reject_bad_inputs():
    q = torch.randn(10, A, 32, device=DEVICE)
    cu = torch.tensor([0, 10], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="head dim"):
        attn.attention_varlen_fwd(q[..., :24], q[..., :24], q[..., :24], cu, 10, 0.1, 0.0, None)
    with pytest.raises(ValueError, match="dtype"):
        attn.attention_varlen_fwd(q, q.half(), q, cu, 10, 0.1, 0.0, None)
    with pytest.raises(ValueError, match="cu_seqlens"):
        attn.attention_varlen_fwd(q, q, q, cu.long(), 10, 0.1, 0.0, None)
    with pytest.raises(ValueError, match="softmax_scale"):
        attn.attention_varlen_fwd(q, q, q, cu, 10, 0.0, 0.0, None)
    with pytest.raises(ValueError, match="dropout_p"):
        attn.attention_varlen_fwd(q, q, q, cu, 10, 0.1, 1.0, _seed(1))
    with pytest.raises(ValueError, match="seed"):
        attn.attention_varlen_fwd(q, q, q, cu, 10, 0.1, 0.1, None)
    with pytest.raises(ValueError, match="contiguous last"):
        qt = torch.randn(10, 32, A, device=DEVICE).transpose(1, 2)
        attn.attention_varlen_fwd(qt, qt, qt, cu, 10, 0.1, 0.0, None)
    with pytest.raises(ValueError, match="key_padding_mask"):
        qp = torch.randn(2, 5, A, 32, device=DEVICE)
        attn.attention_padded_fwd(qp, qp, qp, torch.ones(2, 4, device=DEVICE), 0.1, 0.0, None)


# --------------------------------------------------------------------------- GPU: bf16 / fp16
def _gpu_case(dtype, seqlen, heads, varlen, dropout_p=0.0):
    gen = torch.Generator().manual_seed(seqlen + heads)
    batch, head_dim = 4, 64
    scale = 1.0 / math.sqrt(head_dim)
    seed = _seed(77) if dropout_p > 0 else None
    lengths = make_lengths("random", batch, seqlen, gen)
    lengths[0] = seqlen
    if varlen:
        q, k, v, dout, cu = _varlen_inputs(lengths, dtype, head_dim, packed=True, gen=gen, heads=heads)
        out, lse = attn.attention_varlen_fwd(q, k, v, cu, seqlen, scale, dropout_p, seed)
        dqkv = attn.attention_varlen_bwd(dout, q, k, v, out, lse, cu, seqlen, scale, dropout_p, seed)
        grads = dqkv.unbind(1)
        mask = attn.attention_varlen_dropout_mask(cu, seqlen, heads, dropout_p, seed) if dropout_p else None

        def ref(q_, k_, v_):
            return reference.attention_varlen(q_, k_, v_, cu, seqlen, scale, dropout_p, mask)
    else:
        qkv = torch.randn(batch, seqlen, 3, heads, head_dim, generator=gen).to(DEVICE, dtype)
        q, k, v = qkv.unbind(2)
        dout = torch.randn(batch, seqlen, heads, head_dim, generator=gen).to(DEVICE, dtype)
        kpm = mask_from_lengths(lengths, seqlen).to(DEVICE)
        out, lse = attn.attention_padded_fwd(q, k, v, kpm, scale, dropout_p, seed)
        grads = attn.attention_padded_bwd(dout, q, k, v, out, lse, kpm, scale, dropout_p, seed)
        mask = attn.attention_padded_dropout_mask(batch, seqlen, heads, dropout_p, seed) if dropout_p else None

        def ref(q_, k_, v_):
            return reference.attention(q_, k_, v_, kpm, scale, dropout_p, mask)
    return q, k, v, dout, out, grads, ref


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [True, False], ids=["varlen", "padded"])
@pytest.mark.parametrize("heads", [12, 16])
@pytest.mark.parametrize("seqlen", [128, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_lowp_matches_fp32_reference(dtype, seqlen, heads, varlen):
    q, k, v, dout, out, grads, ref = _gpu_case(dtype, seqlen, heads, varlen)
    assert q.shape[-2] == heads
    out32, grads32 = _ref_grads(ref, [t.float() for t in (q, k, v)], dout.float())
    out_lp, grads_lp = _ref_grads(ref, (q, k, v), dout)
    assert_close_lowp(out.float(), out32, out_lp.float(), name="out")
    for name, fast, r32, rlp in zip(("dq", "dk", "dv"), grads, grads32, grads_lp):
        assert_close_lowp(fast.float(), r32, rlp.float(), name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [True, False], ids=["varlen", "padded"])
def test_gpu_dropout_bf16_matches_reference_with_kernel_mask(varlen):
    q, k, v, dout, out, grads, ref = _gpu_case(torch.bfloat16, 512, 12, varlen, dropout_p=0.1)
    out32, grads32 = _ref_grads(ref, [t.float() for t in (q, k, v)], dout.float())
    out_lp, grads_lp = _ref_grads(ref, (q, k, v), dout)
    assert_close_lowp(out.float(), out32, out_lp.float(), name="out")
    for name, fast, r32, rlp in zip(("dq", "dk", "dv"), grads, grads32, grads_lp):
        assert_close_lowp(fast.float(), r32, rlp.float(), name=name)


@pytest.mark.gpu
def test_gpu_fp32_is_ieee_accurate():
    q, k, v, dout, out, grads, ref = _gpu_case(torch.float32, 128, 12, True)
    out32, grads32 = _ref_grads(ref, (q, k, v), dout)
    torch.testing.assert_close(out, out32, atol=1e-5, rtol=1e-5)
    for fast, r32 in zip(grads, grads32):
        torch.testing.assert_close(fast, r32, atol=5e-5, rtol=1e-4)
