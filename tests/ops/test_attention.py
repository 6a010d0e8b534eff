"""attention: the contract on every backend (CPU sizes), and the shared inputs and checks.

Dropout's part of the contract is tests/ops/test_attention_dropout.py, the contract at GPU sizes
tests/ops/test_attention_gpu_sizes.py; what is particular to the fused backends (Triton, CUDA: their
launchers' own validation, the Triton launch path and the CUDA wrappers) is
tests/ops/test_attention_fused.py. Each imports the inputs and the checks below from here.

Contract (bertfast/ops/attention.py), for both forms, attention_varlen (q, k, v [T, A, D] +
cu_seqlens) and attention_padded (q, k, v [B, S, A, D] + key_padding_mask): softmax_scale None
means 1/sqrt(D); varlen rows beyond cu_seqlens[-1] get out 0, lse +inf, dqkv 0; a query row with
no valid key gets out 0, lse +inf and zero gradients, never NaN; outputs contiguous in q's dtype,
lse fp32 [A, T] / [B, A, S]; dropout keeps ~1 - p, scales kept values by 1/(1 - p), regenerates
the same mask from the same seed, and a backend's *_dropout_mask returns exactly the mask its
kernels draw (the varlen and padded forms of one batch draw the same one; Triton and CUDA draw the
same one, torch its own);
Triton and CUDA serve every head dim from 8 to 256, power of two or not (TinyBERT's 26,
80, 256: the kernels pad to their tile and mask), the torch backend any; empty inputs give empty
outputs. Oracle: bertfast.reference in fp32 with autograd, fed the backend's own dropout mask
(fp32: atol 1e-5, gradients 2e-5 + rtol 1e-4 as they sum over keys in another order; fp16: the
low-precision rule, bertfast.testing.assert_close_lowp). Without a GPU, Triton runs under the
interpreter (blocks 16x16 forward, 16x32 dK/dV, 32x16 dQ, 16x32 mask, 16 queries in the one-pass
backward that short sequences take, so tails and several blocks are exercised; the three-kernel
backward of longer ones runs forced in test_attention_fused.py) and CUDA on the CPU emulator (tests/ops/conftest.py), so shapes stay
small; bf16 on a GPU, and on the emulator (test_attention_fused.py: the interpreter's bf16 is wrong).
"""
import math

import pytest
import torch

from bertfast import dispatch, ops
from bertfast import reference as R
from bertfast.ops._common import new_seed
from bertfast.testing import (PADDING_MODES, check_close, cu_seqlens_from_lengths, make_lengths, mask_from_lengths,
                              references)

VARLEN, PADDED = "attention_varlen", "attention_padded"
B, S, A, D = 2, 20, 2, 32  # CPU sizes: S = 20 gives the interpreter's blocks a tail and a second block
FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPE_ID = {FP32: "fp32", FP16: "fp16", BF16: "bf16"}
LOWP_CPU = [FP16, BF16]  # bf16 on CPU: torch and the CUDA emulator (the interpreter's bf16 is wrong)


# =========================================================================== inputs
def seed_of(backend, value):
    return torch.tensor([value], dtype=torch.int64, device=backend.device)


def lengths_of(mode, batch=B, seqlen=S, seed=0):
    return make_lengths(mode, batch, seqlen, torch.Generator().manual_seed(seed))


def _bert_lengths(seqlen):
    return torch.tensor([seqlen, seqlen * 3 // 5, 1, seqlen - 1])  # ragged, a single token, one short of full


def key_mask(kind, batch=B, seqlen=S, seed=0):
    """[B, S] key padding mask, 1 = token: None ("nomask"), int64 prefixes from a padding mode, or
    "scattered": bool, keys anywhere, sequence 1 fully padded."""
    if kind == "nomask":
        return None
    g = torch.Generator().manual_seed(seed)
    if kind == "scattered":
        mask = torch.rand(batch, seqlen, generator=g) < 0.6
        mask[1] = False
        return mask
    return mask_from_lengths(make_lengths(kind, batch, seqlen, g), seqlen)


def varlen_inputs(backend, lengths, dtype=FP32, head_dim=D, heads=A, packed=True, extra=0, seed=0):
    """q, k, v [T, A, D] (views of one packed [T, 3, A, D] tensor, as the encoder passes them, or
    separate tensors), dout [T, A, D] and cu_seqlens; T = sum(lengths) + extra rows after the last
    sequence."""
    g = torch.Generator().manual_seed(seed)
    tokens = int(lengths.sum()) + extra
    qkv = backend.tensor(tokens, 3, heads, head_dim, dtype=dtype, generator=g)
    q, k, v = qkv.unbind(1) if packed else tuple(qkv[:, i].contiguous() for i in range(3))
    dout = backend.tensor(tokens, heads, head_dim, dtype=dtype, generator=g)
    return q, k, v, dout, cu_seqlens_from_lengths(lengths).to(backend.device)


def padded_inputs(backend, batch=B, seqlen=S, dtype=FP32, head_dim=D, heads=A, seed=0):
    """q, k, v [B, S, A, D] as views of one packed [B, S, 3, A, D] tensor, and dout."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = backend.tensor(batch, seqlen, 3, heads, head_dim, dtype=dtype, generator=g).unbind(2)
    return q, k, v, backend.tensor(batch, seqlen, heads, head_dim, dtype=dtype, generator=g)


# =========================================================================== checks
def _scale(scale, head_dim):
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def _lse_atol(dtype):
    return 1e-5 if dtype == FP32 else 2e-3


def check_varlen(backend, q, k, v, dout, cu, max_seqlen, scale=None, p=0.0, seed=None, atol=1e-5, grad_atol=None):
    """The backend's varlen launchers against the reference, fed the backend's own dropout mask, the
    backward asked for the QKV bias gradient as training asks (fp32 biases); returns (out, lse, dqkv)."""
    impl = backend.module(VARLEN)
    tokens, heads, head_dim = q.shape
    out, lse, bits = impl.attention_varlen_fwd(q, k, v, cu, max_seqlen, scale, p, seed)
    dqkv, dbias = impl.attention_varlen_bwd(dout, q, k, v, out, lse, cu, max_seqlen, scale, p, seed, bits, FP32)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (heads, tokens) and lse.dtype == FP32
    assert dqkv.shape == (tokens, 3, heads, head_dim) and dqkv.dtype == q.dtype and dqkv.is_contiguous()
    check_bias_grad(dbias, dqkv, FP32)

    keep = impl.attention_varlen_dropout_mask(cu, max_seqlen, heads, p, seed) if p else None
    fn = lambda q_, k_, v_: R.attention_varlen(q_, k_, v_, cu, max_seqlen, scale, p, keep)  # noqa: E731
    (o32, g32), (olo, glo) = references(fn, [q, k, v], q.dtype, dout)
    n = int(cu[-1])  # the reference leaves rows after the last sequence undefined; its gradients are 0 there
    check_close("out", out[:n], o32[:n], None if olo is None else olo[:n], q.dtype, atol=atol)
    assert not out[n:].any(), "rows after the last sequence: out must be 0"
    for i, name in enumerate(("dq", "dk", "dv")):
        check_close(name, dqkv[:, i], g32[i], glo[i], q.dtype, atol=grad_atol or 2 * atol, rtol=1e-4)

    # lse = log sum_j exp(scale q_i . k_j) over the row's sequence; +inf outside every sequence
    want = torch.full((heads, tokens), float("inf"))
    bounds = cu.tolist()
    for s0, s1 in zip(bounds[:-1], bounds[1:]):
        if s1 > s0:
            scores = torch.einsum("qad,kad->aqk", q[s0:s1].float().cpu(), k[s0:s1].float().cpu())
            want[:, s0:s1] = torch.logsumexp(scores * _scale(scale, head_dim), -1)
    torch.testing.assert_close(lse.cpu(), want, atol=_lse_atol(q.dtype), rtol=1e-5)
    return out, lse, dqkv


def check_bias_grad(dbias, dqkv, dtype):
    """dbias [3, A, D] in dtype is the column sums of dqkv [T, 3, A, D]. A backend may sum its fp32
    values before rounding them into dqkv: each element of dqkv is then off by up to half an ulp."""
    assert dbias.shape == dqkv.shape[1:] and dbias.dtype == dtype and dbias.device == dqkv.device
    want = dqkv.double().sum(0)
    ulp = {FP32: 2 ** -23, FP16: 2 ** -10, BF16: 2 ** -7}
    tol = (dqkv.double().abs().sum(0) * (ulp[dqkv.dtype] + ulp[dtype]) + 1e-6).cpu()
    err = (dbias.double() - want).abs().cpu()
    assert (err <= tol).all(), f"QKV bias gradient: max error {err.max().item():.3g} (max allowed {tol.min():.3g})"


def check_padded(backend, q, k, v, dout, mask, scale=None, p=0.0, seed=None, atol=1e-5, grad_atol=None):
    """The backend's padded launchers against the reference, fed the backend's own dropout mask;
    returns (out, lse, (dq, dk, dv))."""
    impl = backend.module(PADDED)
    batch, seqlen, heads, head_dim = q.shape
    kpm = None if mask is None else mask.to(backend.device)
    out, lse, bits = impl.attention_padded_fwd(q, k, v, kpm, scale, p, seed)
    grads = impl.attention_padded_bwd(dout, q, k, v, out, lse, kpm, scale, p, seed, bits)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (batch, heads, seqlen) and lse.dtype == FP32
    for g in grads:
        assert g.shape == q.shape and g.dtype == q.dtype and g.is_contiguous()

    keep = impl.attention_padded_dropout_mask(batch, seqlen, heads, p, seed) if p else None
    fn = lambda q_, k_, v_: R.attention(q_, k_, v_, kpm, scale, p, keep)  # noqa: E731
    (o32, g32), (olo, glo) = references(fn, [q, k, v], q.dtype, dout)
    # Every position: query rows at pads attend to the valid keys, as in the reference.
    check_close("out", out, o32, olo, q.dtype, atol=atol)
    for name, got, want, yard in zip(("dq", "dk", "dv"), grads, g32, glo):
        check_close(name, got, want, yard, q.dtype, atol=grad_atol or 2 * atol, rtol=1e-4)

    scores = torch.einsum("bqad,bkad->baqk", q.float().cpu(), k.float().cpu()) * _scale(scale, head_dim)
    if kpm is not None:
        scores = scores.masked_fill(~kpm.bool().cpu()[:, None, None, :], float("-inf"))
    want = torch.logsumexp(scores, -1)
    torch.testing.assert_close(lse.cpu(), want.masked_fill(want == float("-inf"), float("inf")),
                               atol=_lse_atol(q.dtype), rtol=1e-5)
    if kpm is not None:
        dq, dk, dv = grads
        pad = ~kpm.bool()
        assert not dk[pad].any() and not dv[pad].any(), "padding keys got a gradient"
        no_key = pad.all(1)  # sequences with no valid key: out 0, lse +inf, zero gradients
        assert not out[no_key].any() and not dq[no_key].any()
        assert torch.isposinf(lse[no_key]).all()
    return out, lse, grads


# =========================================================================== the contract, every backend
VARLEN_CASES = [(m, FP32) for m in PADDING_MODES] + [(m, FP16) for m in ("random", "empty")]


@pytest.mark.parametrize("mode,dtype", VARLEN_CASES, ids=[f"{m}-{DTYPE_ID[d]}" for m, d in VARLEN_CASES])
def test_varlen_matches_reference(backend, mode, dtype):
    lengths = lengths_of(mode, seed=1)
    q, k, v, dout, cu = varlen_inputs(backend, lengths, dtype, seed=1)
    check_varlen(backend, q, k, v, dout, cu, int(lengths.max()))


PADDED_CASES = ([(m, FP32) for m in ("nomask", *PADDING_MODES, "scattered")]
                + [(m, FP16) for m in ("random", "scattered")])


@pytest.mark.parametrize("kind,dtype", PADDED_CASES, ids=[f"{m}-{DTYPE_ID[d]}" for m, d in PADDED_CASES])
def test_padded_matches_reference(backend, kind, dtype):
    q, k, v, dout = padded_inputs(backend, dtype=dtype, seed=2)
    check_padded(backend, q, k, v, dout, key_mask(kind, seed=2))


HEAD_DIM_CASES = [(8, FP32, 0.0), (12, FP16, 0.0), (16, FP16, 0.0), (26, FP32, 0.1), (26, FP16, 0.0),
                  (64, FP32, 0.0), (64, FP16, 0.0), (80, FP16, 0.1), (128, FP32, 0.0), (256, FP32, 0.0)]


@pytest.mark.parametrize("head_dim,dtype,p", HEAD_DIM_CASES,
                         ids=[f"d{d}-{DTYPE_ID[t]}" + ("-dropout" if p else "") for d, t, p in HEAD_DIM_CASES])
def test_head_dims(backend, head_dim, dtype, p):
    # Powers of two and not (8, 12, 26, 80: the fused kernels mask the columns past the head dim
    # in their tile). Packed qkv with a head dim like 26 has row strides no vector load can assume.
    # 33: a full 32-row interpreter block plus a tail in every kernel; 16: an exact block; 7: short
    lengths = torch.tensor([33, 16, 7])
    seed = seed_of(backend, 5) if p else None
    q, k, v, dout, cu = varlen_inputs(backend, lengths, dtype, head_dim, heads=1, packed=head_dim != 64, seed=3)
    check_varlen(backend, q, k, v, dout, cu, 33, p=p, seed=seed)
    q, k, v, dout = padded_inputs(backend, 1, 33, dtype, head_dim, heads=1, seed=3)
    check_padded(backend, q, k, v, dout, key_mask("random", 1, 33, seed=3), p=p, seed=seed)


def test_awkward_length(backend):
    # 77 > one 64-query block of the CUDA kernels (fp16 takes their tensor-core path) and four
    # 16-row interpreter blocks (fp32 there: the interpreter's fp16 dots are slow)
    lengths = torch.tensor([77, 5])
    dtype = FP16 if backend.name == "cuda" else FP32
    q, k, v, dout, cu = varlen_inputs(backend, lengths, dtype, 16, heads=1, seed=4)
    check_varlen(backend, q, k, v, dout, cu, 77, p=0.1, seed=seed_of(backend, 8))


@pytest.mark.parametrize("form", ["varlen", "padded"])
def test_softmax_scale_none_is_inverse_sqrt_head_dim(backend, form):
    # Against the reference's own default, and bitwise against passing 1/sqrt(D) explicitly.
    head_dim, explicit = 16, 0.25
    if form == "varlen":
        impl = backend.module(VARLEN)
        lengths = torch.tensor([6, 11])
        q, k, v, dout, cu = varlen_inputs(backend, lengths, head_dim=head_dim, seed=5)
        out, lse, dqkv = check_varlen(backend, q, k, v, dout, cu, 11, scale=None)
        out2, lse2, bits = impl.attention_varlen_fwd(q, k, v, cu, 11, explicit, 0.0, None)
        grads, grads2 = [dqkv], [impl.attention_varlen_bwd(dout, q, k, v, out2, lse2, cu, 11, explicit, 0.0, None,
                                                           bits)]
    else:
        impl = backend.module(PADDED)
        q, k, v, dout = padded_inputs(backend, 2, 11, head_dim=head_dim, seed=5)
        mask = key_mask("random", 2, 11, seed=5)
        out, lse, grads = check_padded(backend, q, k, v, dout, mask, scale=None)
        mask = mask.to(backend.device)
        out2, lse2, bits = impl.attention_padded_fwd(q, k, v, mask, explicit, 0.0, None)
        grads2 = impl.attention_padded_bwd(dout, q, k, v, out2, lse2, mask, explicit, 0.0, None, bits)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2))


def test_explicit_scale_separate_tensors_and_strided_dout(backend):
    lengths = torch.tensor([7, 15])
    q, k, v, _, cu = varlen_inputs(backend, lengths, packed=False, seed=6)
    # autograd may hand over a gradient with stride(-1) != 1
    dout = backend.tensor(22, D, A, generator=torch.Generator().manual_seed(6)).transpose(1, 2)
    check_varlen(backend, q, k, v, dout, cu, 15, scale=0.3)


def test_max_seqlen_is_an_upper_bound(backend):
    impl = backend.module(VARLEN)
    lengths = torch.tensor([9, 14])
    q, k, v, dout, cu = varlen_inputs(backend, lengths, seed=7)
    out, lse, dqkv = check_varlen(backend, q, k, v, dout, cu, 14)
    out2, lse2, bits = impl.attention_varlen_fwd(q, k, v, cu, 37, None, 0.0, None)
    dqkv2 = impl.attention_varlen_bwd(dout, q, k, v, out2, lse2, cu, 37, None, 0.0, None, bits)
    for a, b in ((out, out2), (lse, lse2), (dqkv, dqkv2)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_varlen_rows_after_the_last_sequence(backend, dropout_p):
    lengths = torch.tensor([5, 9])
    q, k, v, dout, cu = varlen_inputs(backend, lengths, extra=6, seed=8)
    # static-shape packing leaves anything there: NaN must reach no result
    for t in (q, k, v, dout):
        t[14:] = float("nan")
    out, lse, dqkv = check_varlen(backend, q, k, v, dout, cu, 9, p=dropout_p, seed=seed_of(backend, 3))
    assert not out[14:].any() and torch.isposinf(lse[:, 14:]).all() and not dqkv[14:].any()
    assert torch.isfinite(out).all() and torch.isfinite(dqkv).all()


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_full_sequences_then_empty_slots(backend, dropout_p):
    """A packed batch of full sequences (pack_batch's layout: the empty slots last). The torch
    backend runs the full sequences as views of the rows (no padded copy), and its dropout mask
    for them is still the [B, ...] mask its *_dropout_mask draws."""
    from bertfast.ops.attention import _PaddedForm

    lengths = torch.tensor([7, 7, 7, 0, 0])
    q, k, v, dout, cu = varlen_inputs(backend, lengths, seed=15)
    out, _, dqkv = check_varlen(backend, q, k, v, dout, cu, 7, p=dropout_p, seed=seed_of(backend, 6))
    assert torch.isfinite(out).all() and torch.isfinite(dqkv).all()
    form = _PaddedForm(cu, 7, 21)
    assert form.dense and form.batch == 3 and form.mask is None
    assert form.pad(q).data_ptr() == q.data_ptr()                     # a view
    assert not _PaddedForm(torch.tensor([0, 7, 7, 14, 21], dtype=torch.int32), 7, 21).dense  # an empty slot between
    assert not _PaddedForm(torch.tensor([0, 7, 14], dtype=torch.int32), 7, 21).dense        # rows after the last


@pytest.mark.parametrize("form", ["varlen", "padded"])
def test_rows_without_a_key_give_zeros_with_dropout(backend, form):
    seed = seed_of(backend, 4)
    if form == "varlen":  # zero-length sequences between others: no row, no NaN, the others intact
        lengths = torch.tensor([0, 7, 0, 12, 0])
        q, k, v, dout, cu = varlen_inputs(backend, lengths, seed=9)
        out, _, dqkv = check_varlen(backend, q, k, v, dout, cu, 12, p=0.1, seed=seed)
        assert out.shape[0] == 19 and torch.isfinite(out).all() and torch.isfinite(dqkv).all()
    else:  # sequence 0 fully padded: its query rows have no key
        mask = key_mask("empty", seed=9)
        assert not mask[0].any() and mask[1].any()
        q, k, v, dout = padded_inputs(backend, seed=9)
        out, lse, grads = check_padded(backend, q, k, v, dout, mask, p=0.1, seed=seed)
        assert not out[0].any() and torch.isposinf(lse[0]).all()
        assert not any(g[0].any() for g in grads)


def test_outputs_contiguous_from_transposed_inputs(backend):
    # q, k, v as transformers passes them: [B, A, S, D] transposed to [B, S, A, D]
    g = torch.Generator().manual_seed(10)
    q, k, v = (backend.tensor(2, A, 9, D, dtype=FP16, generator=g).transpose(1, 2) for _ in range(3))
    dout = backend.tensor(2, A, 9, D, dtype=FP16, generator=g).transpose(1, 2)
    assert not q.is_contiguous()
    check_padded(backend, q, k, v, dout, key_mask("random", 2, 9, seed=10))


def test_empty_inputs(backend):
    seed = seed_of(backend, 1)
    v_impl, p_impl = backend.module(VARLEN), backend.module(PADDED)
    empty = torch.empty(0, 3, A, D, device=backend.device).unbind(1)
    for cu, max_seqlen in ((torch.zeros(4, dtype=torch.int32), 0), (torch.zeros(1, dtype=torch.int32), 0)):
        cu = cu.to(backend.device)  # three zero-length sequences; no sequence at all
        out, lse, bits = v_impl.attention_varlen_fwd(*empty, cu, max_seqlen, None, 0.1, seed)
        dqkv = v_impl.attention_varlen_bwd(out, *empty, out, lse, cu, max_seqlen, None, 0.1, seed, bits)
        assert out.shape == (0, A, D) and lse.shape == (A, 0) and dqkv.shape == (0, 3, A, D)
        keep = v_impl.attention_varlen_dropout_mask(cu, max_seqlen, A, 0.1, seed)
        assert keep.shape == (cu.numel() - 1, A, 0, 0)
    for batch, seqlen in ((0, 5), (2, 0)):
        q = torch.empty(batch, seqlen, A, D, device=backend.device)
        out, lse, bits = p_impl.attention_padded_fwd(q, q, q, None, None, 0.1, seed)
        grads = p_impl.attention_padded_bwd(out, q, q, q, out, lse, None, None, 0.1, seed, bits)
        assert out.shape == q.shape and lse.shape == (batch, A, seqlen) and all(g.shape == q.shape for g in grads)
        assert p_impl.attention_padded_dropout_mask(batch, seqlen, A, 0.1, seed).shape == (batch, A, seqlen, seqlen)
    # Rows but no sequence: every row is outside, so out 0, lse +inf, dqkv 0.
    q, k, v, dout, _ = varlen_inputs(backend, torch.tensor([4]), seed=11)
    cu = torch.zeros(1, dtype=torch.int32, device=backend.device)
    out, lse, bits = v_impl.attention_varlen_fwd(q, k, v, cu, 0, None, 0.0, None)
    dqkv = v_impl.attention_varlen_bwd(dout, q, k, v, out, lse, cu, 0, None, 0.0, None, bits)
    assert not out.any() and torch.isposinf(lse).all() and not dqkv.any() and dqkv.shape == (4, 3, A, D)
    # The QKV bias gradient where no token is: 0, in the dtype asked for.
    for rows, cu_ in ((q, cu), (empty[0], torch.zeros(4, dtype=torch.int32, device=backend.device))):
        qkv = rows, rows, rows
        out, lse, bits = v_impl.attention_varlen_fwd(*qkv, cu_, 0, None, 0.0, None)
        dqkv, dbias = v_impl.attention_varlen_bwd(out, *qkv, out, lse, cu_, 0, None, 0.0, None, bits, FP16)
        assert dbias.shape == (3, A, D) and dbias.dtype == FP16 and not dbias.any() and not dqkv.any()


@pytest.mark.parametrize("form", ["varlen", "padded"])
def test_head_dim_the_fused_backends_do_not_serve(backend, form):
    head_dim = 4  # below contract.MIN_HEAD_DIM
    g = torch.Generator().manual_seed(12)
    if form == "varlen":
        lengths = torch.tensor([5, 3])
        qkv = backend.tensor(8, 3, A, head_dim, generator=g).requires_grad_()
        cu = cu_seqlens_from_lengths(lengths).to(backend.device)
        inputs = dict(q=qkv, cu_seqlens=cu)
        run = lambda x: ops.attention_varlen(x, cu, 5)  # noqa: E731
        ref = lambda x: R.attention_varlen(x[:, 0], x[:, 1], x[:, 2], cu, 5)  # noqa: E731
    else:
        qkv = backend.tensor(2, 5, 3, A, head_dim, generator=g).requires_grad_()
        mask = key_mask("random", 2, 5, seed=12).bool().to(backend.device)
        inputs = dict(q=qkv[:, :, 0], k=qkv[:, :, 1], v=qkv[:, :, 2], key_padding_mask=mask)
        run = lambda x: ops.attention(x[:, :, 0], x[:, :, 1], x[:, :, 2], mask)  # noqa: E731
        ref = lambda x: R.attention(x[:, :, 0], x[:, :, 1], x[:, :, 2], mask)  # noqa: E731
    assert dispatch.select(VARLEN if form == "varlen" else PADDED, **inputs) == "torch"
    with backend.forced():
        if backend.name != "torch":
            with pytest.raises(dispatch.NoBackendError, match=f"{backend.name}.*head dim {head_dim} is outside"):
                run(qkv)
            return
        out = run(qkv)
    dout = torch.randn_like(out)
    out.backward(dout)
    (o32, (g32,)), _ = references(ref, [qkv], FP32, dout)
    check_close("out", out, o32, None, FP32)
    check_close("dqkv", qkv.grad, g32, None, FP32, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
@pytest.mark.parametrize("form", ["varlen", "padded"])
def test_op_autograd_matches_reference(backend, form, dropout_p):
    """The custom op with autograd, forced onto the backend; with dropout the backward regenerates
    the forward's mask, which the backend's *_dropout_mask reproduces from the op's seed."""
    g = torch.Generator().manual_seed(13)
    if form == "varlen":
        lengths = torch.tensor([4, 1, 0, 6])
        cu = cu_seqlens_from_lengths(lengths).to(backend.device)
        qkv = backend.tensor(11, 3, A, D, generator=g).requires_grad_()
        run = lambda x: ops.attention_varlen(x, cu, 6, dropout_p)  # noqa: E731
        draw = lambda s: backend.module(VARLEN).attention_varlen_dropout_mask(cu, 6, A, dropout_p, s)  # noqa: E731
        ref = lambda x, keep: R.attention_varlen(x[:, 0], x[:, 1], x[:, 2], cu, 6, None, dropout_p, keep)  # noqa: E731
    else:
        mask = key_mask("empty", 2, 7, seed=13).to(backend.device)
        qkv = backend.tensor(2, 7, 3, A, D, generator=g).requires_grad_()
        run = lambda x: ops.attention(x[:, :, 0], x[:, :, 1], x[:, :, 2], mask, dropout_p)  # noqa: E731
        draw = lambda s: backend.module(PADDED).attention_padded_dropout_mask(2, 7, A, dropout_p, s)  # noqa: E731
        ref = lambda x, keep: R.attention(x[:, :, 0], x[:, :, 1], x[:, :, 2], mask, None, dropout_p, keep)  # noqa: E731
    torch.manual_seed(5)
    with backend.forced():
        out = run(qkv)
    dout = backend.tensor(*out.shape, generator=g)
    out.backward(dout)
    torch.manual_seed(5)  # the op drew its seed from torch's generator (new_seed): draw it again
    keep = draw(new_seed(backend.device)) if dropout_p else None
    (o32, (g32,)), _ = references(lambda x: ref(x, keep), [qkv], FP32, dout)
    check_close("out", out, o32, None, FP32)
    check_close("dqkv", qkv.grad, g32, None, FP32, atol=2e-5, rtol=1e-4)


def test_op_forms_the_qkv_bias_gradient(cpu_backend):
    """Given the QKV GEMM's biases (qkv_bias), the op's backward returns their gradient, the column sums
    of dqkv, in each bias's shape and dtype, and dqkv as without them: one [3AD] bias or three of mixed
    dtypes (summed in fp32, each cast to its own), with and without dropout. With the torch backend and
    dropout this is the _KeptProbs path, without dropout the custom op; elsewhere the custom op. On a
    GPU, check_varlen covers each backend's bias gradient (every varlen contract and GPU-size test)."""
    backend = cpu_backend
    g = torch.Generator().manual_seed(17)
    lengths = torch.tensor([4, 1, 0, 6])
    cu = cu_seqlens_from_lengths(lengths).to(backend.device)
    qkv = backend.tensor(13, 3, A, D, generator=g)  # two rows after the last sequence
    width = 3 * A * D
    rows = torch.arange(13, device=backend.device)[:, None, None]
    dout = torch.ones(13, A, D, device=backend.device).mul_(rows % 3 - 1.0)
    for shapes, dtypes in (([(width,)], [FP32]), ([(A * D,)] * 3, [FP32, FP16, FP32])):
        params = [torch.randn(shape, generator=g).to(device=backend.device, dtype=dtype).requires_grad_()
                  for shape, dtype in zip(shapes, dtypes)]
        for dropout_p in (0.0, 0.25):
            grads = []
            for with_bias in (False, True):
                x = qkv.clone().requires_grad_()
                torch.manual_seed(5)
                with backend.forced():
                    out = ops.attention_varlen(x, cu, 6, dropout_p, qkv_bias=params if with_bias else ())
                out.backward(dout)
                grads.append(x.grad)
            case = f"{len(params)} biases, dropout {dropout_p}"
            assert torch.equal(grads[0], grads[1]), f"{case}: the bias gradient changed dqkv"
            sums = grads[1].double().sum(0).flatten()
            for param, part in zip(params, sums.split([t.numel() for t in params])):
                assert param.grad.dtype == param.dtype and param.grad.shape == param.shape, case
                tol = 1e-3 if param.dtype == FP16 else 1e-5
                torch.testing.assert_close(param.grad.double(), part.view(param.shape), atol=tol, rtol=tol, msg=case)
                param.grad = None
    with pytest.raises(ValueError, match=rf"qkv_bias of {width} elements in all .* got {width - 1}"):
        ops.attention_varlen(qkv.clone().requires_grad_(), cu, 6, qkv_bias=[params[0][:-1], *params[1:]])


# --------------------------------------------------------------------------- errors, opcheck
def test_op_errors_are_clear():
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"expected qkv of shape \[tokens, 3, heads, head_dim\]"):
        ops.attention_varlen(torch.randn(4, 2, 2, 16), cu, 4)
    with pytest.raises(ValueError, match="expected cu_seqlens int32"):
        ops.attention_varlen(torch.randn(4, 3, 2, 16), cu.long(), 4)
    with pytest.raises(ValueError, match="dropout_p"):
        ops.attention_varlen(torch.randn(4, 3, 2, 16), cu, 4, dropout_p=1.0)
    with pytest.raises(ValueError, match="softmax_scale"):
        ops.attention_varlen(torch.randn(4, 3, 2, 16), cu, 4, softmax_scale=-1.0)
    q = torch.randn(2, 5, 2, 16)
    with pytest.raises(ValueError, match="one shape"):
        ops.attention(q, q[:, :4], q)
    with pytest.raises(ValueError, match=r"expected key_padding_mask of shape \[2, 5\]"):
        ops.attention(q, q, q, torch.ones(2, 4))


def opcheck_samples():
    """(custom op, args) by name: the schema, fakes and autograd registration of both forms."""
    def leaf(*shape):
        return torch.randn(*shape, requires_grad=True)

    cu = cu_seqlens_from_lengths(torch.tensor([3, 0, 5]))
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)  # sequence 1 fully padded
    varlen, padded = torch.ops.bertfast.attention_varlen, torch.ops.bertfast.attention_padded
    return {
        "varlen-dropout": (varlen, (leaf(8, 3, 2, 16), cu, 5, 0.25, 0.1, torch.tensor([7]), "torch", [])),
        # with the QKV biases, whose gradient the backward returns: one [3 * A * D], or three in fp64
        "varlen-bias": (varlen, (leaf(8, 3, 2, 16), cu, 5, 0.25, 0.0, None, "torch", [leaf(96)])),
        "varlen-biases": (varlen, (leaf(8, 3, 2, 16), cu, 5, 0.25, 0.1, torch.tensor([7]), "torch",
                                   [leaf(32).double() for _ in range(3)])),
        "padded": (padded, (leaf(2, 5, 2, 16), leaf(2, 5, 2, 16), leaf(2, 5, 2, 16), mask, 0.25, 0.0, None, "torch")),
        # q, k, v as transformers passes them: [B, A, S, D] transposed to [B, S, A, D]
        "padded-transposed": (padded, (*(leaf(2, 2, 5, 16).transpose(1, 2) for _ in range(3)), mask, 0.25, 0.0,
                                       None, "torch")),
    }


@pytest.mark.parametrize("sample", ["varlen-dropout", "varlen-bias", "varlen-biases", "padded", "padded-transposed"])
def test_opcheck(sample):
    op, args = opcheck_samples()[sample]
    torch.library.opcheck(op, args)
