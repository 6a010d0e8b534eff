"""GPU tests of the CUDA C++ backend (bertfast.cuda_ops -> bertfast._C), forward and backward.

Oracle: bertfast.reference in fp32 (gradients by autograd). fp32 kernels must match it closely;
fp16/bf16 kernels must satisfy DESIGN.md's rule (bertfast.testing.assert_close_lowp): error
against the fp32 oracle <= 2 x the error of the same reference run in the low dtype, + atol.
Where the Triton backend (bertfast.kernels) imports, the two backends must agree within the
same budget. Dropout: the kernels' own keep-masks (return_dropout_mask / the attention mask
entry points) are fed to the reference, so outputs and gradients are compared exactly; the drop
fraction and the seed dependence are checked separately.

Shapes are module constants so a dry run can shrink them; sizes are deliberately awkward
(H = 1023, S = 77, odd token counts, a vocabulary whose rows are not 16-byte aligned).
"""
import importlib
import math

import pytest
import torch

from bertfast import cuda_ops
from bertfast import reference as ref
from bertfast.testing import (PADDING_MODES, assert_close_lowp, cu_seqlens_from_lengths, make_lengths,
                              mask_from_lengths, max_abs_error)

pytestmark = pytest.mark.gpu

OPS = cuda_ops            # the backend under test
DEVICE = "cuda"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128)
ROWS = 67                 # rows of the row ops
ATTN_B, ATTN_S, ATTN_A = 3, 77, 2
CE_ROWS = 37
EMB_TOKENS = 70


@pytest.fixture(autouse=True)
def _need_extension():
    if OPS is cuda_ops:
        available, reason = cuda_ops.extension_status()
        if not available:
            pytest.skip(reason)


def _triton(name):
    """bertfast.kernels.<name>, or None when Triton (or that module) is not importable."""
    try:
        return importlib.import_module(f"bertfast.kernels.{name}")
    except Exception:  # noqa: BLE001 - any import failure just means "no Triton to compare with"
        return None


def _seed(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64, device=DEVICE)


def _randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def run_ref(fn, tensors, dtype, grad_out=None):
    """fn on copies of tensors, floating ones cast to dtype (and requiring grad when grad_out is
    given). Returns (output, [gradient or None per tensor])."""
    xs = []
    for t in tensors:
        if t is None or not t.is_floating_point():
            xs.append(t)
        else:
            xs.append(t.detach().to(dtype).requires_grad_(grad_out is not None))
    out = fn(*xs)
    if grad_out is None:
        return out.detach(), [None] * len(xs)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [x.grad if (x is not None and x.is_floating_point()) else None for x in xs]


def references(fn, tensors, dtype, grad_out=None):
    """(fp32 oracle, low-precision yardstick or None for fp32), each as (out, grads)."""
    oracle = run_ref(fn, tensors, torch.float32, grad_out)
    yard = run_ref(fn, tensors, dtype, grad_out) if dtype != torch.float32 else (None, [None] * len(tensors))
    return oracle, yard


def check(name, fast, oracle, yard, dtype, atol=1e-5, rtol=1e-5, lowp_atol=1e-5):
    """fp32 activations: close to the oracle; fp16/bf16: the low-precision rule."""
    assert fast is not None, f"{name}: missing"
    assert torch.isfinite(fast.float()).all(), f"{name}: NaN/inf"
    assert fast.shape == oracle.shape, f"{name}: shape {tuple(fast.shape)} != {tuple(oracle.shape)}"
    if dtype == torch.float32:
        torch.testing.assert_close(fast.float(), oracle.float(), atol=atol, rtol=rtol,
                                   msg=lambda m: f"{name}: {m}")
    else:
        assert_close_lowp(fast.float(), oracle.float(), yard.float(), atol=lowp_atol, name=name)


def agree(name, fast, other, oracle, yard, dtype, atol=1e-4):
    """Two backends agree: within 2 x (the larger of their allowed errors)."""
    if other is None:
        return
    if dtype == torch.float32:
        torch.testing.assert_close(fast.float(), other.float(), atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        return
    budget = 2.0 * max_abs_error(yard.float(), oracle.float()) + atol
    diff = max_abs_error(fast.float(), other.float())
    assert diff <= 2.0 * budget, f"{name}: CUDA and Triton differ by {diff:.3e} > {2 * budget:.3e}"


# =========================================================================== bias + GELU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", [(37, 1023), (64, 3072), (1, 8)])
def test_bias_gelu(dtype, approximate, shape):
    n, f = shape
    x = _randn(n, f, dtype=dtype, scale=2.0)
    b = _randn(f, dtype=dtype)
    dy = _randn(n, f, dtype=dtype)
    y = OPS.bias_gelu_fwd(x, b, approximate)
    dx, db = OPS.bias_gelu_bwd(dy, x, b, approximate)
    fn = lambda x_, b_: ref.bias_gelu(x_, b_, approximate)  # noqa: E731
    (y32, g32), (ylo, glo) = references(fn, [x, b], dtype, dy)
    assert y.dtype == dtype and dx.dtype == dtype and db.dtype == b.dtype
    check("y", y, y32, ylo, dtype)
    check("dx", dx, g32[0], glo[0], dtype)
    check("dbias", db, g32[1], glo[1], dtype, atol=1e-4)
    tri = _triton("bias_gelu")
    if tri is not None:
        agree("y vs triton", y, tri.bias_gelu_fwd(x, b, approximate), y32, ylo, dtype)
        agree("dx vs triton", dx, tri.bias_gelu_bwd(dy, x, b, approximate)[0], g32[0], glo[0], dtype)


def test_bias_gelu_fp32_bias_and_strided_rows():
    dtype = torch.bfloat16
    big = _randn(33, 3080, dtype=dtype)
    x = big[:, :3072]  # row stride 3080: the 128-bit path with a row stride != F
    b = _randn(3072)   # fp32 master bias with bf16 activations
    dy = _randn(33, 3072, dtype=dtype)
    y = OPS.bias_gelu_fwd(x, b)
    dx, db = OPS.bias_gelu_bwd(dy, x, b)
    (y32, g32), (ylo, glo) = references(lambda x_, b_: ref.bias_gelu(x_, b_), [x, b], dtype, dy)
    assert db.dtype == torch.float32
    check("y", y, y32, ylo, dtype)
    check("dx", dx, g32[0], glo[0], dtype)
    check("dbias", db, g32[1], glo[1], dtype)


# =========================================================================== bias + dropout + residual + LayerNorm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1023, 768])
@pytest.mark.parametrize("has_bias,has_residual", [(True, True), (False, True), (True, False), (False, False)])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_layernorm(dtype, hidden, has_bias, has_residual, dropout_p):
    eps = 1e-12
    x = _randn(ROWS, hidden, dtype=dtype)
    b = _randn(hidden, dtype=dtype, scale=0.1) if has_bias else None
    r = _randn(ROWS, hidden, dtype=dtype) if has_residual else None
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    lb = _randn(hidden, dtype=dtype, scale=0.1)
    seed = _seed(1234)
    y, pre, mean, rstd, keep = OPS.bias_dropout_residual_layernorm_fwd(x, b, r, w, lb, eps, dropout_p, seed,
                                                                       return_dropout_mask=True)
    if dropout_p == 0.0:
        assert bool(keep.all())
    dy = _randn(ROWS, hidden, dtype=dtype)

    def fn(x_, b_, r_, w_, lb_):
        return ref.bias_dropout_residual_layernorm(x_, b_, r_, w_, lb_, eps, dropout_p, keep)

    def pre_fn(x_, b_, r_):
        h = ref.dropout(x_ if b_ is None else x_ + b_, dropout_p, keep)
        return h if r_ is None else h + r_

    (y32, g32), (ylo, glo) = references(fn, [x, b, r, w, lb], dtype, dy)
    (p32, _), (plo, _) = references(pre_fn, [x, b, r], dtype)
    check("y", y, y32, ylo, dtype, atol=1e-4, rtol=1e-4)
    check("pre_norm", pre, p32, plo, dtype)
    # Statistics are those of the stored (rounded) pre_norm.
    pf = pre.float()
    torch.testing.assert_close(mean, pf.mean(1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rstd, torch.rsqrt(pf.var(1, unbiased=False) + eps), atol=0, rtol=1e-4)

    dx, db, dres, dw, dlb = OPS.bias_dropout_residual_layernorm_bwd(dy, pre, mean, rstd, w, dropout_p, seed,
                                                                    has_bias, has_residual)
    # fp32: sums over 1023 columns and 67 rows in another order than torch's: 1e-4.
    check("dx", dx, g32[0], glo[0], dtype, atol=1e-4, rtol=1e-4)
    if has_bias:
        check("dbias", db, g32[1], glo[1], dtype, atol=1e-4, rtol=1e-4)
    else:
        assert db is None
    if has_residual:
        check("dresidual", dres, g32[2], glo[2], dtype, atol=1e-4, rtol=1e-4)
    else:
        assert dres is None
    check("dweight", dw, g32[3], glo[3], dtype, atol=1e-4, rtol=1e-4)
    check("dln_bias", dlb, g32[4], glo[4], dtype, atol=1e-4, rtol=1e-4)
    tri = _triton("layer_norm")
    if tri is not None and dropout_p == 0.0:
        t_out = tri.bias_dropout_residual_layernorm_fwd(x, b, r, w, lb, eps, 0.0, None)
        agree("y vs triton", y, t_out[0], y32, ylo, dtype)
        t_grads = tri.bias_dropout_residual_layernorm_bwd(dy, t_out[1], t_out[2], t_out[3], w, 0.0, None,
                                                          has_bias, has_residual)
        agree("dx vs triton", dx, t_grads[0], g32[0], glo[0], dtype)
        agree("dweight vs triton", dw, t_grads[3], g32[3], glo[3], dtype)


def test_layernorm_mixed_params_and_strided_rows():
    dtype, h = torch.bfloat16, 1024
    big = _randn(ROWS, h + 64, dtype=dtype)
    x = big[:, :h]
    r = _randn(ROWS, h, dtype=dtype)
    b, w, lb = _randn(h, scale=0.1), 1 + 0.1 * _randn(h), _randn(h, scale=0.1)  # fp32 parameters
    y, pre, mean, rstd = OPS.bias_dropout_residual_layernorm_fwd(x, b, r, w, lb, 1e-5, 0.0, None)
    dy = _randn(ROWS, h, dtype=dtype)
    dx, db, dres, dw, dlb = OPS.bias_dropout_residual_layernorm_bwd(dy, pre, mean, rstd, w, 0.0, None, True, True)
    fn = lambda x_, b_, r_, w_, lb_: ref.bias_dropout_residual_layernorm(x_, b_, r_, w_, lb_, 1e-5)  # noqa: E731
    (y32, g32), (ylo, glo) = references(fn, [x, b, r, w, lb], dtype, dy)
    assert db.dtype == dw.dtype == dlb.dtype == torch.float32
    check("y", y, y32, ylo, dtype)
    for name, got, i in (("dx", dx, 0), ("dbias", db, 1), ("dresidual", dres, 2), ("dweight", dw, 3),
                         ("dln_bias", dlb, 4)):
        check(name, got, g32[i], glo[i], dtype)


def test_layernorm_dropout_fraction_and_seed():
    n, h, p = 512, 1024, 0.1
    x = _randn(n, h, dtype=torch.float16)
    w, lb = torch.ones(h, device=DEVICE), torch.zeros(h, device=DEVICE)
    keep1 = OPS.bias_dropout_residual_layernorm_fwd(x, None, None, w, lb, 1e-12, p, _seed(5), True)[4]
    keep2 = OPS.bias_dropout_residual_layernorm_fwd(x, None, None, w, lb, 1e-12, p, _seed(5), True)[4]
    keep3 = OPS.bias_dropout_residual_layernorm_fwd(x, None, None, w, lb, 1e-12, p, _seed(6), True)[4]
    dropped = 1.0 - keep1.float().mean().item()
    assert abs(dropped - p) < 0.005, dropped  # 262144 draws: sigma = 0.0006
    assert torch.equal(keep1, keep2)
    differ = (keep1 != keep3).float().mean().item()
    assert abs(differ - 2 * p * (1 - p)) < 0.01, differ  # independent masks for another seed


# =========================================================================== embeddings
@pytest.mark.parametrize("out_dtype,table_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                   (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                   (torch.float16, torch.float32)])
@pytest.mark.parametrize("hidden", [768, 1023])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_embeddings(out_dtype, table_dtype, hidden, dropout_p):
    t, vocab, n_pos, n_types, eps = EMB_TOKENS, 50, 40, 2, 1e-12
    ids = torch.randint(0, vocab, (t,), device=DEVICE, dtype=torch.int32)
    ids[:10] = 3                                                          # repeated ids add up
    pos_ids = torch.arange(t, device=DEVICE) % n_pos                     # int64
    type_ids = (torch.arange(t, device=DEVICE) >= t // 2).to(torch.int64)
    word = _randn(vocab, hidden, dtype=table_dtype)
    pos = _randn(n_pos, hidden, dtype=table_dtype)
    tt = _randn(n_types, hidden, dtype=table_dtype)
    lnw = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(table_dtype)
    lnb = _randn(hidden, dtype=table_dtype, scale=0.1)
    seed = _seed(99)
    y, mean, rstd, keep = OPS.embeddings_fwd(ids, pos_ids, type_ids, word, pos, tt, lnw, lnb, eps, dropout_p, seed,
                                             out_dtype, return_dropout_mask=True)
    assert y.dtype == out_dtype
    dy = _randn(t, hidden, dtype=out_dtype)
    grads = OPS.embeddings_bwd(dy, ids, pos_ids, type_ids, word, pos, tt, lnw, lnb, mean, rstd, dropout_p, seed)

    def fn(word_, pos_, tt_, lnw_, lnb_):
        return ref.embeddings(ids.long(), pos_ids, type_ids, word_, pos_, tt_, lnw_, lnb_, eps, dropout_p, keep)

    (y32, g32), (ylo, glo) = references(fn, [word, pos, tt, lnw, lnb], out_dtype, dy)
    check("y", y, y32, ylo, out_dtype, atol=1e-4, rtol=1e-4)
    h = (word.float()[ids.long()] + pos.float()[pos_ids] + tt.float()[type_ids])
    torch.testing.assert_close(mean, h.mean(1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rstd, torch.rsqrt(h.var(1, unbiased=False) + eps), atol=0, rtol=1e-4)
    for name, got, i, like in (("dword", grads[0], 0, word), ("dpos", grads[1], 1, pos),
                               ("dtoken_type", grads[2], 2, tt), ("dln_weight", grads[3], 3, lnw),
                               ("dln_bias", grads[4], 4, lnb)):
        assert got.dtype == like.dtype and got.shape == like.shape, name
        check(name, got, g32[i], glo[i], out_dtype, atol=1e-4, rtol=1e-4)
    tri = _triton("embeddings")
    if tri is not None and dropout_p == 0.0:
        t_y = tri.embeddings_fwd(ids, pos_ids, type_ids, word, pos, tt, lnw, lnb, eps, 0.0, None, out_dtype)[0]
        agree("y vs triton", y, t_y, y32, ylo, out_dtype)


def test_embeddings_dropout_fraction():
    t, h, p = 512, 1024, 0.1
    ids = torch.zeros(t, dtype=torch.int64, device=DEVICE)
    tabs = [_randn(4, h) for _ in range(3)]
    keep = OPS.embeddings_fwd(ids, ids, ids, *tabs, torch.ones(h, device=DEVICE), torch.zeros(h, device=DEVICE),
                              1e-12, p, _seed(3), torch.float32, return_dropout_mask=True)[3]
    assert abs((1.0 - keep.float().mean().item()) - p) < 0.005


# =========================================================================== MLM cross-entropy
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1000, 30522])
@pytest.mark.parametrize("strided", [False, True])
def test_softmax_cross_entropy(dtype, vocab, strided):
    m, scale = CE_ROWS, 0.37
    buf = _randn(m, vocab + (3 if strided else 0), dtype=dtype, scale=3.0)
    logits = buf[:, :vocab]  # strided: row starts at every 2- or 4-byte offset
    logits[1, 5] = logits[1, 9] = 100.0  # a tie: argmax is the lower index
    labels = torch.randint(0, vocab, (m,), device=DEVICE)
    labels[::4] = -100
    labels[1] = 5
    labels[2] = 9
    logits[2, 9] = logits[2, 4] = 100.0  # tie lost by the label
    x32 = logits.float().clone()
    before = buf.clone()
    valid = labels != -100
    lse_ref = torch.logsumexp(x32, 1)
    picked = x32.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    loss_ref = torch.where(valid, lse_ref - picked, torch.zeros_like(lse_ref))
    correct_ref = valid & (x32.argmax(1) == labels)
    assert bool(correct_ref[1]) and not bool(correct_ref[2])
    onehot = torch.nn.functional.one_hot(labels.clamp(min=0), vocab).float()
    grad_ref = scale * (torch.softmax(x32, 1) - onehot) * valid[:, None]

    loss, lse, correct = OPS.softmax_cross_entropy_(logits, labels, scale, False)
    assert torch.equal(buf, before), "compute_grad=False must leave the logits alone"
    loss, lse, correct = OPS.softmax_cross_entropy_(logits, labels, scale, True)
    torch.testing.assert_close(lse, lse_ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(loss, loss_ref, atol=1e-4, rtol=1e-5)
    assert torch.equal(correct, correct_ref)
    assert bool((logits[~valid] == 0).all())
    # The in-place gradient: its only error beyond the fp32 math is the rounding to the dtype.
    assert_close_lowp(logits.float(), grad_ref, grad_ref.to(dtype).float(), factor=2.0, atol=1e-6, name="dlogits")
    if strided:
        assert torch.equal(buf[:, vocab:], before[:, vocab:]), "columns past the vocabulary were written"
    tri = _triton("cross_entropy")
    if tri is not None:
        t_logits = before[:, :vocab].clone()
        t_loss, t_lse, t_correct = tri.softmax_cross_entropy_(t_logits, labels, scale, True)
        torch.testing.assert_close(loss, t_loss, atol=1e-4, rtol=1e-5)
        assert torch.equal(correct, t_correct)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_cross_entropy(dtype, with_bias):
    m, h, vocab, scale = 45, 64, 1000, 0.5
    x = _randn(m, h, dtype=dtype)
    w = _randn(vocab, h, dtype=dtype, scale=0.2)
    b = _randn(vocab, dtype=dtype, scale=0.1) if with_bias else None
    labels = torch.randint(0, vocab, (m,), device=DEVICE)
    labels[::5] = -100
    loss_sum, n_correct, gx, gw, gb = OPS.linear_cross_entropy_fwd(x, w, b, labels, 16, True, scale)
    fn = lambda x_, w_, b_: ref.mlm_head_loss_decoder(x_, w_, b_, labels)[0] * scale  # noqa: E731
    (l32, g32), (llo, glo) = references(fn, [x, w, b], dtype, torch.ones((), device=DEVICE))
    check("loss_sum", loss_sum * scale, l32, llo, dtype, atol=1e-4, rtol=1e-5, lowp_atol=1e-4)
    check("grad_x", gx, g32[0], glo[0], dtype, atol=1e-5, rtol=1e-4)
    check("grad_weight", gw, g32[1], glo[1], dtype, atol=1e-5, rtol=1e-4)
    if with_bias:
        check("grad_bias", gb, g32[2], glo[2], dtype, atol=1e-5, rtol=1e-4)
    else:
        assert gb is None
    # n_correct from logits computed like the kernel sees them (GEMM in the activation dtype).
    logits = torch.nn.functional.linear(x, w, b).float()
    expected = int(((logits.argmax(1) == labels) & (labels != -100)).sum())
    assert abs(int(n_correct) - expected) <= (0 if dtype == torch.float32 else 1)
    loss_only = OPS.linear_cross_entropy_fwd(x, w, b, labels, None, False, scale)
    assert loss_only[2] is None and loss_only[3] is None and loss_only[4] is None
    torch.testing.assert_close(loss_only[0], loss_sum, atol=1e-3, rtol=1e-5)


# =========================================================================== attention
def _packed(shape_prefix, heads, head_dim, dtype):
    """q, k, v as views of one packed [..., 3, A, D] tensor (non-contiguous, strides honoured)."""
    qkv = _randn(*shape_prefix, 3, heads, head_dim, dtype=dtype)
    return qkv.unbind(-3)


def _lengths(mode: str) -> torch.Tensor:
    return make_lengths(mode, ATTN_B, ATTN_S, generator=torch.Generator().manual_seed(7))


def _varlen_lse_ref(q, k, cu, scale):
    """[A, T] log-sum-exp of the fp32 scores of each sequence."""
    out = torch.full((q.shape[1], q.shape[0]), float("inf"), device=q.device)
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e > s:
            scores = torch.einsum("qad,kad->aqk", q[s:e].float(), k[s:e].float()) * scale
            out[:, s:e] = torch.logsumexp(scores, -1)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("mode", PADDING_MODES)
def test_attention_varlen(dtype, head_dim, mode):
    lengths = _lengths(mode)
    cu = cu_seqlens_from_lengths(lengths).to(DEVICE)
    tokens, max_seqlen = int(lengths.sum()), int(lengths.max())
    q, k, v = _packed((tokens,), ATTN_A, head_dim, dtype)
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = OPS.attention_varlen_fwd(q, k, v, cu, max_seqlen, scale, 0.0, None)
    dout = _randn(tokens, ATTN_A, head_dim, dtype=dtype)
    dqkv = OPS.attention_varlen_bwd(dout, q, k, v, out, lse, cu, max_seqlen, scale, 0.0, None)
    assert dqkv.shape == (tokens, 3, ATTN_A, head_dim)
    fn = lambda q_, k_, v_: ref.attention_varlen(q_, k_, v_, cu, max_seqlen, scale)  # noqa: E731
    (o32, g32), (olo, glo) = references(fn, [q, k, v], dtype, dout)
    # fp32: sums over up to 77 keys / queries in another order than einsum's: 1e-4.
    check("out", out, o32, olo, dtype, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, _varlen_lse_ref(q, k, cu, scale),
                               atol=1e-5 if dtype == torch.float32 else 2e-3, rtol=1e-5)
    for i, name in enumerate(("dq", "dk", "dv")):
        check(name, dqkv[:, i], g32[i], glo[i], dtype, atol=1e-4, rtol=1e-4)
    tri = _triton("attention")
    if tri is not None:
        t_out, _ = tri.attention_varlen_fwd(q, k, v, cu, max_seqlen, scale, 0.0, None)
        agree("out vs triton", out, t_out, o32, olo, dtype)


def _padded_mask(kind: str):
    if kind == "none_mask":
        return None
    if kind == "pattern":  # any pattern, not only right padding; sequence 1 fully padded
        g = torch.Generator().manual_seed(11)
        mask = torch.rand(ATTN_B, ATTN_S, generator=g) < 0.6
        mask[1] = False
        return mask.to(DEVICE)
    return mask_from_lengths(_lengths(kind), ATTN_S).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kind", PADDING_MODES + ("pattern", "none_mask"))
def test_attention_padded(dtype, head_dim, kind):
    mask = _padded_mask(kind)
    q, k, v = _packed((ATTN_B, ATTN_S), ATTN_A, head_dim, dtype)
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = OPS.attention_padded_fwd(q, k, v, mask, scale, 0.0, None)
    dout = _randn(ATTN_B, ATTN_S, ATTN_A, head_dim, dtype=dtype)
    dq, dk, dv = OPS.attention_padded_bwd(dout, q, k, v, out, lse, mask, scale, 0.0, None)
    fn = lambda q_, k_, v_: ref.attention(q_, k_, v_, mask, scale)  # noqa: E731
    (o32, g32), (olo, glo) = references(fn, [q, k, v], dtype, dout)
    check("out", out, o32, olo, dtype, atol=1e-4, rtol=1e-4)
    for name, got, i in (("dq", dq, 0), ("dk", dk, 1), ("dv", dv, 2)):
        check(name, got, g32[i], glo[i], dtype, atol=1e-4, rtol=1e-4)
    if mask is not None:
        empty = ~mask.bool().any(1)
        assert bool((out[empty] == 0).all()) and bool((dq[empty] == 0).all())
        assert bool(torch.isinf(lse[empty]).all())
        pad_keys = ~mask.bool()
        assert bool((dk[pad_keys] == 0).all()) and bool((dv[pad_keys] == 0).all())
    tri = _triton("attention")
    if tri is not None:
        t_out, _ = tri.attention_padded_fwd(q, k, v, mask, scale, 0.0, None)
        agree("out vs triton", out, t_out, o32, olo, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["varlen", "padded"])
@pytest.mark.parametrize("head_dim", (64, 128))
def test_attention_dropout_exact(dtype, layout, head_dim):
    p, seed, scale = 0.2, _seed(77), 1.0 / math.sqrt(head_dim)
    if layout == "varlen":
        lengths = _lengths("empty")
        cu = cu_seqlens_from_lengths(lengths).to(DEVICE)
        tokens, max_seqlen = int(lengths.sum()), int(lengths.max())
        q, k, v = _packed((tokens,), ATTN_A, head_dim, dtype)
        keep = OPS.attention_varlen_dropout_mask(cu, max_seqlen, ATTN_A, p, seed)
        assert keep.shape == (ATTN_B, ATTN_A, max_seqlen, max_seqlen) and keep.dtype == torch.bool
        out, lse = OPS.attention_varlen_fwd(q, k, v, cu, max_seqlen, scale, p, seed)
        dout = _randn(*q.shape, dtype=dtype)
        dqkv = OPS.attention_varlen_bwd(dout, q, k, v, out, lse, cu, max_seqlen, scale, p, seed)
        grads = dqkv.unbind(1)
        fn = lambda q_, k_, v_: ref.attention_varlen(q_, k_, v_, cu, max_seqlen, scale, p, keep)  # noqa: E731
    else:
        mask = _padded_mask("pattern")
        q, k, v = _packed((ATTN_B, ATTN_S), ATTN_A, head_dim, dtype)
        keep = OPS.attention_padded_dropout_mask(ATTN_B, ATTN_S, ATTN_A, p, seed)
        assert keep.shape == (ATTN_B, ATTN_A, ATTN_S, ATTN_S)
        out, lse = OPS.attention_padded_fwd(q, k, v, mask, scale, p, seed)
        dout = _randn(*q.shape, dtype=dtype)
        grads = OPS.attention_padded_bwd(dout, q, k, v, out, lse, mask, scale, p, seed)
        fn = lambda q_, k_, v_: ref.attention(q_, k_, v_, mask, scale, p, keep)  # noqa: E731
    (o32, g32), (olo, glo) = references(fn, [q, k, v], dtype, dout)
    check("out", out, o32, olo, dtype, atol=1e-4, rtol=1e-4)
    for i, name in enumerate(("dq", "dk", "dv")):
        check(name, grads[i], g32[i], glo[i], dtype, atol=1e-4, rtol=1e-4)


def test_attention_dropout_mask_fraction_and_consistency():
    b, s, a, p = 4, 128, 4, 0.1
    keep = OPS.attention_padded_dropout_mask(b, s, a, p, _seed(1))
    assert abs((1.0 - keep.float().mean().item()) - p) < 0.004  # 262144 draws: sigma = 0.0006
    assert torch.equal(keep, OPS.attention_padded_dropout_mask(b, s, a, p, _seed(1)))
    other = OPS.attention_padded_dropout_mask(b, s, a, p, _seed(2))
    assert abs((keep != other).float().mean().item() - 2 * p * (1 - p)) < 0.01
    # The varlen kernels draw from the same [B, A, max_seqlen, max_seqlen] grid.
    cu = torch.tensor([0, 100, 228, 300, 428], dtype=torch.int32, device=DEVICE)
    assert torch.equal(keep, OPS.attention_varlen_dropout_mask(cu, s, a, p, _seed(1)))
    assert bool(OPS.attention_padded_dropout_mask(2, 8, 2, 0.0, None).all())


def test_attention_dropout_changes_the_output_and_drops_the_right_fraction():
    # With V = identity-like rows, out_i = sum_j P_ij keep_ij v_j / (1 - p): the kept mass of each row.
    s, a, d, p = 128, 2, 64, 0.25
    q = torch.zeros(1, s, a, d, device=DEVICE, dtype=torch.float16)  # uniform attention
    k = torch.zeros_like(q)
    v = torch.ones_like(q)
    out0, _ = OPS.attention_padded_fwd(q, k, v, None, 0.125, 0.0, None)
    assert torch.allclose(out0.float(), torch.ones_like(out0.float()))
    out, _ = OPS.attention_padded_fwd(q, k, v, None, 0.125, p, _seed(4))
    kept = out.float()[..., 0] * (1 - p)  # [1, S, A]: fraction of keys kept per row
    keep = OPS.attention_padded_dropout_mask(1, s, a, p, _seed(4))
    torch.testing.assert_close(kept, keep.float().mean(-1).permute(0, 2, 1), atol=2e-3, rtol=0)
    assert abs(1.0 - kept.mean().item() - p) < 0.01


def test_attention_large_head_count_and_long_sequence():
    # BERT-base-like: 12 heads, seq 512, with ragged lengths; no NaN, matches the reference.
    dtype, a, d = torch.bfloat16, 12, 64
    lengths = torch.tensor([512, 300, 1, 511])
    cu = cu_seqlens_from_lengths(lengths).to(DEVICE)
    q, k, v = _packed((int(lengths.sum()),), a, d, dtype)
    out, lse = OPS.attention_varlen_fwd(q, k, v, cu, 512, 0.125, 0.0, None)
    fn = lambda q_, k_, v_: ref.attention_varlen(q_, k_, v_, cu, 512, 0.125)  # noqa: E731
    (o32, _), (olo, _) = references(fn, [q, k, v], dtype)
    check("out", out, o32, olo, dtype)
