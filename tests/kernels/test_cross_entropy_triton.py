"""kernels/cross_entropy.py against torch: the per-row kernel (loss, lse, argmax, in-place
gradient) and the chunked linear + cross-entropy driver (against
bertfast.reference.mlm_head_loss_decoder and autograd).

CPU runs the kernel under the Triton interpreter in fp32 and fp16; bf16 and the
autotuned path are covered by the GPU-marked tests.
"""
import pytest
import torch
import torch.nn.functional as F

from bertfast import reference
from bertfast.kernels.cross_entropy import (
    CHUNK_BYTES,
    _launch_softmax_cross_entropy,
    default_chunk_rows,
    linear_cross_entropy_fwd,
    softmax_cross_entropy_,
)
from bertfast.testing import assert_close_lowp

IGNORE = -100
DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu_capable  # on CUDA when there is a GPU, else the interpreter


def _logits_with_ties(M, V, dtype, device=DEV):
    """Random logits [M, V] and labels [M] with ignored rows and argmax ties.

    Row 0: tie between columns 5 and V-1 (apart by more than any block), label the later
    one (argmax picks 5, so not correct). Row 1: same tie, label 5 (correct). Row 2: tie
    within one block (5 and 200), label 200 (not correct). Row 3: label = argmax.
    """
    z = torch.randn(M, V, device=device) * 3
    labels = torch.randint(0, V, (M,), device=device)
    labels[4::4] = IGNORE
    for r, (a, b) in enumerate([(5, V - 1), (5, V - 1), (5, 200)]):
        z[r, a] = z[r, b] = 20.0
    labels[0], labels[1], labels[2] = V - 1, 5, 200
    z = z.to(dtype)
    labels[3] = z[3].float().argmax()
    return z, labels


def _torch_ce(z32, labels, grad_scale):
    """(loss [M], lse [M], correct [M], grad [M, V]) from torch, computed on z32."""
    zr = z32.detach().clone().requires_grad_()
    loss = F.cross_entropy(zr, labels, ignore_index=IGNORE, reduction="none")
    (grad_scale * loss.sum()).backward()
    correct = (z32.argmax(-1) == labels) & (labels != IGNORE)
    return loss.detach(), torch.logsumexp(z32, -1), correct, zr.grad


# --------------------------------------------------------------------------- softmax_cross_entropy_
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("V,block_v", [(1000, None), (1031, None), (1031, 256), (1000, 128)])
def test_softmax_cross_entropy_matches_torch(dtype, V, block_v):
    # block_v None: the default (1024 under the interpreter: V=1000 one block, V=1031 two);
    # 256 / 128: the looped two-pass path with many blocks and a ragged last one.
    M, grad_scale = 37, 0.37
    z, labels = _logits_with_ties(M, V, dtype)
    z32 = z.float()
    ref_loss, ref_lse, ref_correct, ref_grad = _torch_ce(z32, labels, grad_scale)

    zk = z.clone()
    loss, lse, correct = _launch_softmax_cross_entropy(zk, labels, grad_scale, True, block_v)

    # Statistics are fp32 math on the same (upcast) values as the oracle: fp32 tolerance.
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert correct.dtype == torch.bool
    assert torch.equal(correct, ref_correct)
    assert correct[:4].tolist() == [False, True, False, True]
    assert (loss[labels == IGNORE] == 0).all()
    assert zk.dtype == dtype
    assert (zk[labels == IGNORE] == 0).all()
    if dtype == torch.float32:
        torch.testing.assert_close(zk, ref_grad, atol=1e-6, rtol=1e-5)
    else:
        zr = z.clone().requires_grad_()
        (grad_scale * F.cross_entropy(zr, labels, ignore_index=IGNORE, reduction="sum")).backward()
        assert_close_lowp(zk.float(), ref_grad, zr.grad.float(), name="dlogits")


@pytest.mark.parametrize("V", [1000, 1031])
def test_softmax_cross_entropy_no_grad_leaves_logits(V):
    z, labels = _logits_with_ties(9, V, torch.float32)
    zk = z.clone()
    loss, lse, correct = softmax_cross_entropy_(zk, labels, 1.0, False)
    assert torch.equal(zk, z)
    ref_loss, ref_lse, ref_correct, _ = _torch_ce(z, labels, 1.0)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.equal(correct, ref_correct)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the tests above take this path")
def test_autotuned_in_place_kernel_is_tuned_on_a_scratch_copy(stand_in_tuner):
    """The kernel overwrites its logits with their gradient: every candidate runs on a scratch copy
    and the chosen one once on the real logits. A trial on the real logits would leave the gradient
    of the gradient there."""
    from bertfast.kernels import cross_entropy as CE

    stand_in_tuner(CE._softmax_cross_entropy_tuned)
    z, labels = _logits_with_ties(5, 1031, torch.float32)
    ref_loss, _, _, ref_grad = _torch_ce(z, labels, 0.5)
    wide = torch.full((5, 1040), 7.0)  # row-strided logits: the scratch copy keeps the row stride
    zk = wide[:, :1031]
    zk.copy_(z)
    loss, _, _ = softmax_cross_entropy_(zk, labels, 0.5, True)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(zk, ref_grad, atol=1e-6, rtol=1e-5)
    assert (wide[:, 1031:] == 7.0).all()
    assert len(CE._softmax_cross_entropy_tuned.cache) == 1


def test_softmax_cross_entropy_all_ignored():
    # Ignored rows get an exact 0 gradient even with grad_scale = inf (1 / 0 labelled rows).
    z = torch.randn(6, 1031, device=DEV)
    labels = torch.full((6,), IGNORE, device=DEV)
    zk = z.clone()
    loss, lse, correct = softmax_cross_entropy_(zk, labels, float("inf"), True)
    assert (loss == 0).all() and not correct.any()
    assert (zk == 0).all()
    torch.testing.assert_close(lse, torch.logsumexp(z, -1), atol=1e-5, rtol=1e-5)


def test_softmax_cross_entropy_row_strided_and_int32_labels():
    # Rows of a wider buffer: stride(0) = V + 13; the extra columns must stay untouched.
    # Labels: int32, a strided view.
    M, V = 11, 1031
    buf = torch.randn(M, V + 13, device=DEV)
    before = buf.clone()
    labels = torch.randint(0, V, (M, 2), device=DEV, dtype=torch.int32)[:, 1]
    labels[3] = IGNORE
    ref_loss, ref_lse, ref_correct, ref_grad = _torch_ce(buf[:, :V], labels.long(), 0.5)
    loss, lse, correct = softmax_cross_entropy_(buf[:, :V], labels, 0.5, True)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(buf[:, :V], ref_grad, atol=1e-6, rtol=1e-5)
    assert torch.equal(buf[:, V:], before[:, V:])


def test_softmax_cross_entropy_empty_and_validation():
    loss, lse, correct = softmax_cross_entropy_(torch.empty(0, 50, device=DEV),
                                                torch.empty(0, dtype=torch.long, device=DEV), 1.0, True)
    assert loss.shape == lse.shape == correct.shape == (0,)
    z = torch.randn(4, 50, device=DEV)
    lab = torch.zeros(4, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match="stride 1 along the vocabulary"):
        softmax_cross_entropy_(torch.randn(50, 4, device=DEV).t(), lab, 1.0, True)
    with pytest.raises(ValueError, match=r"labels: expected shape \(4,\)"):
        softmax_cross_entropy_(z, lab[:3], 1.0, True)
    with pytest.raises(ValueError, match="labels: expected dtype"):
        softmax_cross_entropy_(z, lab.float(), 1.0, True)
    with pytest.raises(ValueError, match="logits: expected 2 dimensions"):
        softmax_cross_entropy_(z[0], lab, 1.0, True)


# --------------------------------------------------------------------------- linear_cross_entropy_fwd
def _problem(M, H, V, dtype, labelled="some", bias=True, param_dtype=None, device=DEV):
    """x [M, H], weight [V, H], bias [V] | None, labels [M] (some rows set to their argmax)."""
    param_dtype = param_dtype or dtype
    x = torch.randn(M, H, device=device)
    w = torch.randn(V, H, device=device) * H ** -0.5 * 2
    b = torch.randn(V, device=device) * 0.1 if bias else None
    if labelled == "none":
        labels = torch.full((M,), IGNORE, device=device)
    elif labelled == "one":
        labels = torch.full((M,), IGNORE, device=device)
        labels[M // 2] = 3
    else:
        labels = torch.randint(0, V, (M,), device=device)
        if labelled == "some":
            labels[::3] = IGNORE
        # Every 4th row labelled with its argmax, so n_correct is not trivially 0.
        logits = F.linear(x.to(dtype), w.to(dtype), b.to(dtype) if bias else None).float()
        labels[1::4] = logits[1::4].argmax(-1)
    return (x.to(dtype), w.to(param_dtype), b.to(param_dtype) if bias else None, labels)


def _reference_grads(x, w, b, labels, grad_scale):
    """reference.mlm_head_loss_decoder and the autograd gradients of grad_scale * loss_sum."""
    xr = x.detach().clone().requires_grad_()
    wr = w.detach().clone().requires_grad_()
    br = b.detach().clone().requires_grad_() if b is not None else None
    loss_sum, n_correct = reference.mlm_head_loss_decoder(xr, wr, br, labels)
    (grad_scale * loss_sum).backward()
    return loss_sum.detach(), n_correct, xr.grad, wr.grad, (br.grad if br is not None else None)


def _n_labelled(labels):
    return int((labels != IGNORE).sum())


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunk_rows", [1, 7, 37, 50, None])
def test_linear_cross_entropy_fp32_chunks(chunk_rows, bias):
    M, H, V = 37, 48, 1031
    x, w, b, labels = _problem(M, H, V, torch.float32, bias=bias)
    n = _n_labelled(labels)
    ref = _reference_grads(x, w, b, labels, 1.0 / n)
    loss_sum, n_correct, gx, gw, gb = linear_cross_entropy_fwd(x, w, b, labels, chunk_rows, True, 1.0 / n)
    assert loss_sum.dtype == torch.float32 and loss_sum.dim() == 0
    assert n_correct.dtype == torch.int64 and n_correct.dim() == 0
    torch.testing.assert_close(loss_sum, ref[0], atol=1e-4, rtol=1e-5)
    assert int(n_correct) == int(ref[1]) and int(n_correct) > 0
    # Mean loss equals transformers' CrossEntropyLoss(ignore_index=-100) mean.
    mean_ref = torch.nn.CrossEntropyLoss(ignore_index=IGNORE)(F.linear(x, w, b), labels)
    torch.testing.assert_close(loss_sum / n, mean_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gx, ref[2], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gw, ref[3], atol=1e-6, rtol=1e-5)
    if bias:
        torch.testing.assert_close(gb, ref[4], atol=1e-6, rtol=1e-5)
    else:
        assert gb is None
    assert (gx[labels == IGNORE] == 0).all()


@pytest.mark.parametrize("labelled", ["none", "one", "all"])
def test_linear_cross_entropy_label_patterns(labelled):
    M, H, V = 29, 32, 1000
    x, w, b, labels = _problem(M, H, V, torch.float32, labelled=labelled)
    n = _n_labelled(labels)
    # No labelled row: the caller's 1 / 0 may be inf; nothing may turn into NaN.
    grad_scale = 1.0 / n if n else float("inf")
    loss_sum, n_correct, gx, gw, gb = linear_cross_entropy_fwd(x, w, b, labels, 7, True, grad_scale)
    if n == 0:
        assert float(loss_sum) == 0.0 and int(n_correct) == 0
        for g in (gx, gw, gb):
            assert (g == 0).all()
        return
    ref = _reference_grads(x, w, b, labels, grad_scale)
    torch.testing.assert_close(loss_sum, ref[0], atol=1e-4, rtol=1e-5)
    assert int(n_correct) == int(ref[1])
    for got, want in zip((gx, gw, gb), ref[2:]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("chunk_rows", [7, None])
def test_linear_cross_entropy_fp16(chunk_rows):
    M, H, V = 40, 64, 1031
    x, w, b, labels = _problem(M, H, V, torch.float16)
    gs = 1.0 / _n_labelled(labels)
    ref32 = _reference_grads(x.float(), w.float(), b.float(), labels, gs)
    ref16 = _reference_grads(x, w, b, labels, gs)
    loss_sum, n_correct, gx, gw, gb = linear_cross_entropy_fwd(x, w, b, labels, chunk_rows, True, gs)
    assert (gx.dtype, gw.dtype, gb.dtype) == (torch.float16,) * 3
    assert_close_lowp(loss_sum, ref32[0], ref16[0], name="loss_sum")
    # Same fp16 logits as the fp16 reference on CPU (same GEMM, bitwise): same argmax. On
    # GPU cuBLAS may round a logit differently per chunk size: allow one near-tie flip.
    assert abs(int(n_correct) - int(ref16[1])) <= (0 if DEV == "cpu" else 1)
    for name, got, want32, want16 in zip(("grad_x", "grad_weight", "grad_bias"), (gx, gw, gb),
                                         ref32[2:], ref16[2:]):
        assert_close_lowp(got.float(), want32, want16.float(), name=name)


def test_linear_cross_entropy_fp32_params_fp16_activations():
    # fp32 master weights with fp16 activations: GEMMs in fp16, grads in the params' dtype.
    M, H, V = 24, 32, 1000
    x, w, b, labels = _problem(M, H, V, torch.float16, param_dtype=torch.float32)
    gs = 1.0 / _n_labelled(labels)
    ref32 = _reference_grads(x.float(), w, b, labels, gs)
    ref16 = _reference_grads(x, w.half(), b.half(), labels, gs)
    loss_sum, n_correct, gx, gw, gb = linear_cross_entropy_fwd(x, w, b, labels, 10, True, gs)
    assert (gx.dtype, gw.dtype, gb.dtype) == (torch.float16, torch.float32, torch.float32)
    assert_close_lowp(loss_sum, ref32[0], ref16[0], name="loss_sum")
    assert_close_lowp(gx.float(), ref32[2], ref16[2].float(), name="grad_x")
    assert_close_lowp(gw, ref32[3], ref16[3].float(), name="grad_weight")
    assert_close_lowp(gb, ref32[4], ref16[4].float(), name="grad_bias")


def test_linear_cross_entropy_no_grad_and_empty():
    M, H, V = 13, 32, 1031
    x, w, b, labels = _problem(M, H, V, torch.float32)
    ref = reference.mlm_head_loss_decoder(x, w, b, labels)
    out = linear_cross_entropy_fwd(x, w, b, labels, 5, False, 1.0)
    assert out[2:] == (None, None, None)
    torch.testing.assert_close(out[0], ref[0], atol=1e-4, rtol=1e-5)
    assert int(out[1]) == int(ref[1])

    # No rows at all (no masked position in the batch).
    x0, lab0 = x[:0], labels[:0]
    loss_sum, n_correct, gx, gw, gb = linear_cross_entropy_fwd(x0, w, b, lab0, None, True, 1.0)
    assert float(loss_sum) == 0.0 and int(n_correct) == 0
    assert gx.shape == (0, H) and gw.shape == (V, H) and gb.shape == (V,)
    assert (gw == 0).all() and (gb == 0).all()


def test_linear_cross_entropy_label_out_of_range():
    M, H, V = 8, 32, 1000
    x, w, b, labels = _problem(M, H, V, torch.float32, labelled="all")
    for bad in (V, V + 7, -1, -99):
        lab = labels.clone()
        lab[5] = bad
        with pytest.raises(ValueError, match=rf"labels: expected values in \[0, {V}\) or -100 .*got {bad} \(at row 5\)"):
            linear_cross_entropy_fwd(x, w, b, lab, None, True, 1.0)


def test_linear_cross_entropy_validation():
    x, w, b, labels = _problem(8, 32, 100, torch.float32)
    with pytest.raises(ValueError, match=r"weight: expected shape \(V > 0, 32\)"):
        linear_cross_entropy_fwd(x, w[:, :16], b, labels, None, True, 1.0)
    with pytest.raises(ValueError, match=r"bias: expected shape \(100,\)"):
        linear_cross_entropy_fwd(x, w, b[:50], labels, None, True, 1.0)
    with pytest.raises(ValueError, match=r"labels: expected shape \(8,\)"):
        linear_cross_entropy_fwd(x, w, b, labels[:7], None, True, 1.0)
    with pytest.raises(ValueError, match="chunk_rows: expected a positive int"):
        linear_cross_entropy_fwd(x, w, b, labels, 0, True, 1.0)


@pytest.mark.parametrize("V,elem", [(30522, 2), (30522, 4), (1031, 2), (250_000, 2)])
def test_default_chunk_rows(V, elem):
    cap = default_chunk_rows(10**9, V, elem)
    assert cap % 64 == 0 and cap >= 64
    assert cap * V * elem <= CHUNK_BYTES or cap == 64
    assert (cap + 64) * V * elem > CHUNK_BYTES
    for M in (1, 37, 4915, 20_000, 123_457):
        rows = default_chunk_rows(M, V, elem)
        assert 1 <= rows <= cap
        # Balanced: no more chunks than the cap requires.
        assert -(-M // rows) == -(-M // cap)
    assert default_chunk_rows(4915, 30522, 2) == 2496  # 2 chunks: 2496 + 2419
    assert default_chunk_rows(10**9, 30522, 2) == 4352


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("chunk_rows", [None, 1000])
def test_linear_cross_entropy_bf16_bert_base_gpu(chunk_rows):
    # BERT-base MLM head: M masked rows after gathering, bf16, 2x rule against fp32.
    M, H, V = 4096, 768, 30522
    x, w, b, labels = _problem(M, H, V, torch.bfloat16, labelled="all", device="cuda")
    labels[::50] = IGNORE
    gs = 1.0 / _n_labelled(labels)
    ref32 = _reference_grads(x.float(), w.float(), b.float(), labels, gs)
    ref16 = _reference_grads(x, w, b, labels, gs)
    loss_sum, n_correct, gx, gw, gb = linear_cross_entropy_fwd(x, w, b, labels, chunk_rows, True, gs)
    assert_close_lowp(loss_sum, ref32[0], ref16[0], name="loss_sum")
    # cuBLAS may round a few logits differently from F.linear: allow a handful of flips.
    assert abs(int(n_correct) - int(ref16[1])) <= 4
    for name, got, want32, want16 in zip(("grad_x", "grad_weight", "grad_bias"), (gx, gw, gb),
                                         ref32[2:], ref16[2:]):
        assert got.dtype == torch.bfloat16
        assert_close_lowp(got.float(), want32, want16.float(), name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_cross_entropy_gpu(dtype):
    # Autotuned kernel on a BERT vocabulary, ties across blocks included.
    M, V, gs = 300, 30522, 0.01
    z, labels = _logits_with_ties(M, V, dtype, device="cuda")
    z32 = z.float()
    ref_loss, ref_lse, ref_correct, ref_grad = _torch_ce(z32, labels, gs)
    zk = z.clone()
    loss, lse, correct = softmax_cross_entropy_(zk, labels, gs, True)
    torch.testing.assert_close(loss, ref_loss, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
    assert torch.equal(correct, ref_correct)
    if dtype == torch.float32:
        torch.testing.assert_close(zk, ref_grad, atol=1e-7, rtol=1e-5)
    else:
        zr = z.clone().requires_grad_()
        (gs * F.cross_entropy(zr, labels, ignore_index=IGNORE, reduction="sum")).backward()
        assert_close_lowp(zk.float(), ref_grad, zr.grad.float(), name="dlogits")
