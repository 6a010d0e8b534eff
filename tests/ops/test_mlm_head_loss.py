"""mlm_head_loss: the contract on every backend, then the shared driver, then what is particular to one backend.

Contract (bertfast/ops/mlm_head_loss.py): labels -100 are ignored, any other label outside [0, V) is a
ValueError from the shared driver (the per-chunk kernel alone treats it as ignored); loss_sum fp32, n_correct
int64 (argmax ties: lowest index); gradients in each input's dtype, independent of chunk_rows; no labelled row
or no row at all gives loss 0 and zero gradients. The per-chunk kernel mlm_head_loss_fwd returns loss, lse and
correct per row and overwrites the (row-strided) logits with grad_scale * (softmax - onehot), 0 on ignored rows.
Oracles: torch cross-entropy in fp32, bertfast.reference.mlm_head_loss_decoder with autograd, and transformers'
BertForMaskedLM head (fp16: the low-precision rule, docs/testing.md). Without a GPU, Triton runs under the
interpreter (block 1024: V = 1000 takes the one-block path, V = 1031 the looped one) and CUDA on the CPU emulator
(tests/ops/conftest.py), so shapes stay small; bf16 only on a GPU.
"""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import bertfast
from bertfast import ops
from bertfast import reference as R
from bertfast.ops.mlm_head_loss import CHUNK_BYTES, _decoder_loss, default_chunk_rows, padded_vocab
from bertfast.ops.mlm_head_loss import mlm_head_loss_fwd as torch_kernel
from bertfast.testing import AtenLog, BackendUnderTest, assert_close_lowp, check_close, references

OP = "mlm_head_loss"
IGNORE = -100
GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
LOWP = [pytest.param(torch.float16, id="fp16")] + ([pytest.param(torch.bfloat16, id="bf16")] if GPU else [])
DTYPES = [pytest.param(torch.float32, id="fp32")] + LOWP


# =========================================================================== helpers
def logits_with_ties(backend, m, v, dtype, seed=0):
    """Logits [m, v] and int64 labels [m] (m >= 6): rows 4, 8, ... ignored, and argmax ties.

    Row 0: columns 5 and v-1 tie (far apart: different blocks), labelled v-1, so not correct. Row 1: the same
    tie, labelled 5 (correct). Row 2: 5 and 200 tie (one block by default), labelled 200 (not correct).
    Row 3: labelled with its argmax.
    """
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(m, v, generator=g) * 3
    labels = torch.randint(0, v, (m,), generator=g)
    labels[4::4] = IGNORE
    for r, (a, b) in enumerate([(5, v - 1), (5, v - 1), (5, 200)]):
        z[r, a] = z[r, b] = 20.0
    labels[:3] = torch.tensor([v - 1, 5, 200])
    z = z.to(dtype)
    labels[3] = z[3].float().argmax()
    return z.to(backend.device), labels.to(backend.device)


def ce_oracle(z, labels, grad_scale):
    """(loss, lse, correct, dlogits) from torch in fp32 on z's values; labels outside [0, V) count as ignored."""
    valid = (labels >= 0) & (labels < z.shape[1])
    labels = torch.where(valid, labels.long(), IGNORE)
    z32 = z.detach().float().requires_grad_()
    loss = F.cross_entropy(z32, labels, ignore_index=IGNORE, reduction="none")
    (grad_scale * loss.sum()).backward()
    correct = (z32.detach().argmax(-1) == labels) & valid
    return loss.detach(), torch.logsumexp(z32.detach(), -1), correct, z32.grad


def check_kernel(backend, logits, labels, grad_scale=0.37, compute_grad=True, atol=1e-5, **kwargs):
    """The backend's mlm_head_loss_fwd on logits (overwritten in place) against ce_oracle; returns correct."""
    loss_ref, lse_ref, correct_ref, grad_ref = ce_oracle(logits, labels, grad_scale)
    before = logits.clone()
    loss, lse, correct = backend.module(OP).mlm_head_loss_fwd(logits, labels, grad_scale, compute_grad, **kwargs)
    assert loss.dtype == lse.dtype == torch.float32 and correct.dtype == torch.bool
    assert loss.shape == lse.shape == correct.shape == labels.shape
    # Statistics are fp32 math on the same (upcast) values as the oracle: fp32 tolerance for every dtype.
    torch.testing.assert_close(loss, loss_ref, atol=atol, rtol=1e-5)
    torch.testing.assert_close(lse, lse_ref, atol=atol, rtol=1e-5)
    assert torch.equal(correct, correct_ref)
    ignored = (labels < 0) | (labels >= logits.shape[1])
    assert not loss[ignored].any()
    if not compute_grad:
        assert torch.equal(logits, before), "compute_grad=False must leave the logits alone"
        return correct
    assert not logits[ignored].any()
    if logits.dtype == torch.float32:
        torch.testing.assert_close(logits, grad_ref, atol=1e-6, rtol=1e-5)
    else:
        # Computed in fp32 and rounded once: the rounding of the oracle to the dtype is the yardstick.
        assert_close_lowp(logits.float(), grad_ref, grad_ref.to(logits.dtype).float(), atol=1e-6, name="dlogits")
    return correct


def problem(backend, m, h, v, dtype, labelled="some", bias=True, param_dtype=None, seed=0):
    """x [m, h], weight [v, h], bias [v] or None, int64 labels [m]; every 4th row labelled with its argmax."""
    g = torch.Generator().manual_seed(seed)
    dev, param_dtype = backend.device, param_dtype or dtype
    x = torch.randn(m, h, generator=g).to(dtype).to(dev)
    w = (torch.randn(v, h, generator=g) * 2 * h ** -0.5).to(param_dtype).to(dev)
    b = (torch.randn(v, generator=g) * 0.1).to(param_dtype).to(dev) if bias else None
    labels = torch.full((m,), IGNORE)
    if labelled == "one":
        labels[m // 2] = 3
    elif labelled in ("some", "all"):
        labels = torch.randint(0, v, (m,), generator=g)
        if labelled == "some":
            labels[::3] = IGNORE
    labels = labels.to(dev)
    if labelled in ("some", "all"):
        logits = F.linear(x[1::4], w.to(dtype), None if b is None else b.to(dtype))
        labels[1::4] = logits.float().argmax(-1)  # so n_correct is not trivially 0
    return x, w, b, labels


def run_decoder(backend, x, w, b, labels, chunk_rows=None, grad_out=0.37):
    """ops.mlm_head_loss_decoder forced onto the backend, backward from grad_out:
    (loss_sum, n_correct, [grad x, grad weight, grad bias or None])."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (x, w, b)]
    with backend.forced():
        loss_sum, n_correct = ops.mlm_head_loss_decoder(*leaves, labels, chunk_rows=chunk_rows)
    loss_sum.backward(torch.tensor(grad_out, device=loss_sum.device))
    return loss_sum.detach(), n_correct, [None if t is None else t.grad for t in leaves]


def check_decoder(backend, x, w, b, labels, chunk_rows=None, grad_out=0.37):
    """run_decoder against the reference (fp32 oracle; the activation dtype as the yardstick)."""
    loss_sum, n_correct, grads = run_decoder(backend, x, w, b, labels, chunk_rows, grad_out)
    assert loss_sum.dtype == torch.float32 and loss_sum.dim() == 0
    assert n_correct.dtype == torch.int64 and n_correct.dim() == 0
    for name, got, t in zip(("grad_x", "grad_weight", "grad_bias"), grads, (x, w, b)):
        assert (got is None) == (t is None) and (got is None or got.dtype == t.dtype), name
    fn = lambda x_, w_, b_: R.mlm_head_loss_decoder(x_, w_, b_, labels)[0]  # noqa: E731
    scale = torch.tensor(grad_out, device=x.device)
    (l32, g32), (llo, glo) = references(fn, [x, w, b], x.dtype, scale)
    check_close("loss_sum", loss_sum, l32, llo, x.dtype, atol=1e-4, lowp_atol=1e-4)
    for name, got, want32, wantlo in zip(("grad_x", "grad_weight", "grad_bias"), grads, g32, glo):
        if got is not None:
            check_close(name, got, want32, wantlo, x.dtype, atol=1e-6, rtol=1e-5)
    # n_correct from logits as the driver sees them: the GEMM in the activation dtype.
    expected = int(R.mlm_head_loss_decoder(x, w.to(x.dtype), None if b is None else b.to(x.dtype), labels)[1])
    # On the CPU the chunk's GEMM rounds like the reference's; cuBLAS may flip a near-tie in low precision.
    assert abs(int(n_correct) - expected) <= (1 if GPU and x.dtype != torch.float32 else 0)
    return loss_sum, n_correct, grads


# =========================================================================== the per-chunk kernel, every backend
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [1000, 1031])
def test_kernel_matches_torch(backend, v, dtype):
    z, labels = logits_with_ties(backend, 6, v, dtype)
    correct = check_kernel(backend, z, labels)
    assert correct[:4].tolist() == [False, True, False, True]  # ties go to the lowest index


@pytest.mark.parametrize("v", [1000, 1031])
def test_kernel_without_gradient_leaves_logits(backend, v):
    z, labels = logits_with_ties(backend, 6, v, torch.float32)
    check_kernel(backend, z, labels, compute_grad=False)


def test_kernel_treats_out_of_range_labels_as_ignored(backend):
    # Only the driver rejects such labels; the kernel must neither read at them nor count them.
    v = 1031
    z, _ = logits_with_ties(backend, 6, v, torch.float32)
    labels = torch.tensor([v, v + 7, -1, -99, 3, IGNORE], device=backend.device)
    check_kernel(backend, z, labels)  # rows 0-3: loss 0, not correct, gradient 0; row 4 as usual
    assert not z[:4].any() and z[4].any()


def test_kernel_ignored_rows_get_exact_zero_gradient_even_with_infinite_scale(backend):
    # A caller's 1 / (no labelled row) is inf: ignored rows still get 0, never NaN.
    z = backend.tensor(6, 1031)
    labels = torch.full((6,), IGNORE, device=backend.device)
    zk = z.clone()
    loss, lse, correct = backend.module(OP).mlm_head_loss_fwd(zk, labels, float("inf"), True)
    assert not loss.any() and not correct.any()
    assert not zk.any()
    torch.testing.assert_close(lse, torch.logsumexp(z, -1), atol=1e-5, rtol=1e-5)


def test_kernel_row_strided_logits_and_int32_labels(backend):
    # Rows of a wider buffer (row stride V + 3: rows 8 bytes off a 16-byte boundary in turn); labels int32, strided.
    m, v = 6, 1031
    z, labels = logits_with_ties(backend, m, v, torch.float32)
    buf = torch.full((m, v + 3), 7.0, device=backend.device)
    buf[:, :v] = z
    labels32 = torch.stack([labels, labels], 1).to(torch.int32)[:, 1]
    correct = check_kernel(backend, buf[:, :v], labels32)
    assert correct[:4].tolist() == [False, True, False, True]
    assert (buf[:, v:] == 7.0).all(), "columns past the vocabulary were written"


def test_kernel_empty_rows(backend):
    logits = torch.empty(0, 50, device=backend.device)
    loss, lse, correct = backend.module(OP).mlm_head_loss_fwd(logits, torch.empty(0, dtype=torch.long,
                                                                                 device=backend.device), 1.0, True)
    assert loss.shape == lse.shape == correct.shape == (0,)


def test_kernel_errors_are_clear(fused_backend):
    fwd = fused_backend.module(OP).mlm_head_loss_fwd
    dev = fused_backend.device
    z = torch.randn(4, 50, device=dev)
    lab = torch.zeros(4, dtype=torch.long, device=dev)
    with pytest.raises(ValueError, match="stride 1 along the vocabulary"):
        fwd(torch.randn(50, 4, device=dev).t(), lab, 1.0, True)
    with pytest.raises(ValueError, match=r"labels: expected shape \(4,\)"):
        fwd(z, lab[:3], 1.0, True)
    with pytest.raises(ValueError, match="labels: expected dtype"):
        fwd(z, lab.float(), 1.0, True)
    with pytest.raises(ValueError, match="logits: expected 2 dimensions"):
        fwd(z[0], lab, 1.0, True)
    with pytest.raises(ValueError, match="logits: expected dtype"):
        fwd(z.to(torch.int32), lab, 1.0, True)
    with pytest.raises(ValueError, match="non-empty vocabulary"):
        fwd(z[:, :0], lab, 1.0, True)


# =========================================================================== the decoder (op + driver), every backend
@pytest.fixture(params=["vocab", "padded-vocab"])
def padded(request, monkeypatch):
    """The decoder's GEMMs over the vocabulary as it is, and over it padded (on a GPU they are)."""
    module = sys.modules["bertfast.ops.mlm_head_loss"]  # the package exports a function of that name
    monkeypatch.setattr(module, "PADDED_DEVICES", {"cpu", "cuda"} if request.param == "padded-vocab" else set())
    return request.param == "padded-vocab"


@pytest.mark.parametrize("chunk_rows,bias", [(1, True), (3, False), (50, False), (None, True)])
def test_decoder_matches_reference(backend, chunk_rows, bias, padded):
    # 5 rows: one per chunk, a ragged last chunk, a chunk larger than the rows, the default (one chunk).
    x, w, b, labels = problem(backend, 5, 16, 1031, torch.float32, bias=bias)
    _, n_correct, grads = check_decoder(backend, x, w, b, labels, chunk_rows)
    assert int(n_correct) > 0
    assert not grads[0][labels == IGNORE].any()


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("chunk_rows,param_dtype", [(None, None), (3, torch.float32)],
                         ids=["one-chunk", "chunked-fp32-params"])
def test_decoder_low_precision(backend, dtype, chunk_rows, param_dtype, padded):
    # fp32 master weights (autocast): GEMMs in the activation dtype, gradients in each input's dtype. Without an
    # out_dtype GEMM (CPU) each chunk's product is rounded once before the fp32 sum: low-precision weights over
    # several chunks then sit at the edge of the 2x rule at these sizes (the GPU test below chunks bf16 weights).
    # grad_out 1 compares the gradients as stored; scaling in backward is checked in fp32 above.
    x, w, b, labels = problem(backend, 6, 32, 1031, dtype, param_dtype=param_dtype)
    _, _, (gx, gw, gb) = check_decoder(backend, x, w, b, labels, chunk_rows, grad_out=1.0)
    assert gx.dtype == dtype and gw.dtype == gb.dtype == (param_dtype or dtype)


@pytest.mark.parametrize("labelled", ["none", "one", "all"])
def test_decoder_label_patterns(backend, labelled):
    x, w, b, labels = problem(backend, 5, 16, 1000, torch.float32, labelled=labelled)
    loss_sum, n_correct, grads = check_decoder(backend, x, w, b, labels, chunk_rows=3)
    if labelled == "none":
        assert float(loss_sum) == 0.0 and int(n_correct) == 0
        assert all(torch.count_nonzero(g) == 0 for g in grads)


def test_decoder_no_rows(backend):
    x, w, b, labels = problem(backend, 0, 16, 1000, torch.float32)
    loss_sum, n_correct, (gx, gw, gb) = run_decoder(backend, x, w, b, labels)
    assert float(loss_sum) == 0.0 and int(n_correct) == 0
    assert gx.shape == (0, 16) and gw.shape == (1000, 16) and gb.shape == (1000,)
    assert torch.count_nonzero(gw) == 0 and torch.count_nonzero(gb) == 0


def test_decoder_without_gradients(backend):
    x, w, b, labels = problem(backend, 6, 16, 1031, torch.float32)
    with backend.forced(), torch.no_grad():
        loss_sum, n_correct = ops.mlm_head_loss_decoder(x, w, b, labels, chunk_rows=4)
    ref = R.mlm_head_loss_decoder(x, w, b, labels)
    torch.testing.assert_close(loss_sum, ref[0], atol=1e-4, rtol=1e-5)
    assert int(n_correct) == int(ref[1])
    # The driver itself: no gradient buffers at all.
    out = _decoder_loss(x, w, b, labels, 4, False, 1.0, backend.module(OP).mlm_head_loss_fwd)
    assert out[2:] == (None, None, None)
    torch.testing.assert_close(out[0], loss_sum, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bad", [1000, 1007, -1, -99])
def test_decoder_label_out_of_range_is_a_value_error(backend, bad):
    x, w, b, labels = problem(backend, 8, 16, 1000, torch.float32, labelled="all")
    labels[5] = bad
    with backend.forced(), pytest.raises(ValueError, match=rf"labels: expected values in \[0, 1000\) or -100 "
                                                           rf"\(ignored\), got {bad} \(at row 5\)"):
        ops.mlm_head_loss_decoder(x, w, b, labels)


def test_op_errors_are_clear():
    x, w, labels = torch.randn(3, 4), torch.randn(9, 4), torch.tensor([1, 2, IGNORE])
    with pytest.raises(ValueError, match=r"expected x \[rows, H\] and weight \[vocab, H\]"):
        ops.mlm_head_loss_decoder(x, w[:, :3], None, labels)
    with pytest.raises(ValueError, match=r"expected labels of shape \[3\]"):
        ops.mlm_head_loss_decoder(x, w, None, labels[:2])
    with pytest.raises(ValueError, match=r"expected bias of shape \[9\]"):
        ops.mlm_head_loss_decoder(x, w, torch.randn(8), labels)
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        ops.mlm_head_loss_decoder(x, w, None, labels, chunk_rows=0)
    with pytest.raises(ValueError, match="labels .* do not match hidden"):
        ops.mlm_head_loss(torch.randn(2, 3, 4), labels, torch.eye(4), torch.zeros(4), torch.ones(4), torch.zeros(4),
                          1e-12, w, None)


@pytest.mark.parametrize("one_chunk", [True, False], ids=["one-chunk", "chunks-of-2"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_opcheck(with_bias, one_chunk, padded):
    """Both forms: one chunk (the gradients in the backward, the backward op's schema and fake too) and
    chunks of 2 rows (computed in the forward)."""
    x, w = torch.randn(5, 6, requires_grad=True), torch.randn(9, 6, requires_grad=True)
    b = torch.randn(9, requires_grad=True) if with_bias else None
    torch.library.opcheck(torch.ops.bertfast.mlm_head_loss_decoder,
                          (x, w, b, torch.tensor([1, -100, 8, 0, 3]), 0 if one_chunk else 2, True, one_chunk, False,
                           "torch"))


# =========================================================================== the whole head, every backend
def head_problem(device, seed=0):
    """hidden [3, 6, 8], labels (2 + 0 + 3 labelled), the transform's parameters, decoder [13, 8], its bias."""
    g = torch.Generator().manual_seed(seed)
    batch, seqlen, width, vocab = 3, 6, 8, 13
    hidden = torch.randn(batch, seqlen, width, generator=g)
    labels = torch.full((batch, seqlen), IGNORE)
    labels[0, [1, 4]] = torch.tensor([3, 5])
    labels[2, [0, 2, 5]] = torch.tensor([12, 0, 7])
    params = [torch.randn(width, width, generator=g) * 0.3, torch.randn(width, generator=g),
              1 + 0.1 * torch.randn(width, generator=g), torch.randn(width, generator=g)]
    decoder, bias = torch.randn(vocab, width, generator=g), torch.randn(vocab, generator=g)
    return (hidden.to(device), labels.to(device), [p.to(device) for p in params], decoder.to(device),
            bias.to(device))


@pytest.mark.parametrize("max_predictions", [None, 3])
def test_head_matches_full_logits(backend, max_predictions):
    hidden, labels, params, decoder, bias = head_problem(backend.device)
    leaves = [t.requires_grad_() for t in (hidden, decoder, bias)]
    with backend.forced():
        got = ops.mlm_head_loss(hidden, labels, *params, 1e-12, decoder, bias, max_predictions_per_seq=max_predictions)
    width, vocab = hidden.shape[-1], decoder.shape[0]
    h = F.layer_norm(F.gelu(hidden @ params[0].T + params[1]), (width,), params[2], params[3], 1e-12)
    logits = (h @ decoder.T + bias).view(-1, vocab)
    expected = F.cross_entropy(logits, labels.view(-1))
    torch.testing.assert_close(got.loss, expected, atol=1e-5, rtol=0)
    assert int(got.num_predictions) == 5
    valid = labels.view(-1) != IGNORE
    assert int(got.num_correct) == int((logits.argmax(-1) == labels.view(-1))[valid].sum())
    for a, b in zip(torch.autograd.grad(got.loss, leaves), torch.autograd.grad(expected, leaves)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("max_predictions", [None, 2])
def test_head_without_labels_gives_zero_loss_and_zero_gradients(backend, max_predictions):
    # Dynamic: no row reaches the decoder at all; static: 2 rows per sequence, all ignored.
    dev = backend.device
    hidden = backend.tensor(2, 4, 8).requires_grad_()
    decoder = backend.tensor(11, 8).requires_grad_()
    labels = torch.full((2, 4), IGNORE, device=dev)
    with backend.forced():
        got = ops.mlm_head_loss(hidden, labels, torch.eye(8, device=dev), torch.zeros(8, device=dev),
                                torch.ones(8, device=dev), torch.zeros(8, device=dev), 1e-12, decoder, None,
                                max_predictions_per_seq=max_predictions)
    assert got.loss.item() == 0.0 and int(got.num_predictions) == 0 and int(got.num_correct) == 0
    gh, gd = torch.autograd.grad(got.loss, [hidden, decoder])
    assert torch.count_nonzero(gh) == 0 and torch.count_nonzero(gd) == 0


@pytest.mark.skipif(not GPU, reason="a host waiting on the device needs a device")
def test_gpu_static_head_with_its_checks_on_the_device_never_waits_on_the_device():
    """The static gather inside ``checks_on_device``, as a pre-training step and the kernel suite run the
    head (bench.kernel_cases): a host read in the call would put host time into the suite's device timing."""
    from bertfast.contract import checks_on_device
    hidden, labels, params, decoder, bias = head_problem("cuda")
    leaves = [t.requires_grad_() for t in (hidden, decoder, bias)]

    def call():
        with checks_on_device():
            got = ops.mlm_head_loss(hidden, labels, *params, 1e-12, decoder, bias, max_predictions_per_seq=3)
            return torch.autograd.grad(got.loss, leaves)
    call()  # autotuning and lazy state may read the device
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads = call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(bool(torch.isfinite(g).all()) for g in grads)


def test_masked_positions_put_labelled_positions_first():
    labels = torch.full((2, 6), IGNORE)
    labels[0, :3] = 1
    labels[1, [2, 5]] = 4
    assert ops.masked_positions(labels).tolist() == [0, 1, 2, 8, 11]
    # Static: exactly batch * max_predictions, each sequence's labelled positions in order, then filler.
    assert ops.masked_positions(labels, 3).tolist() == [0, 1, 2, 8, 11, 6]


def test_masked_positions_at_the_limit_keep_every_label():
    labels = torch.full((2, 6), IGNORE)
    labels[0, [0, 3]] = 1
    labels[1, [1, 5]] = 2
    assert ops.masked_positions(labels, 2).tolist() == [0, 3, 7, 11]


# issue 16: labelled positions beyond max_predictions_per_seq were dropped silently (and a limit of 0 gave loss 0).
@pytest.mark.parametrize("per_seq, limit, error, message", [
    ([2, 3], 2, ValueError, r"sequence 1 has 3 labelled positions \(labels != -100\), more than "
                            r"max_predictions_per_seq=2; the extra ones would be dropped"),
    ([7, 6], 2, ValueError, "sequence 0 has 7 labelled positions"),
    ([1, 0], 0, ValueError, "max_predictions_per_seq: expected a positive int or None, got 0"),
    ([1, 0], -1, ValueError, "max_predictions_per_seq: expected a positive int or None, got -1"),
    ([1, 0], 2.0, ValueError, "max_predictions_per_seq: expected a positive int or None, got 2.0"),
])
def test_labels_beyond_max_predictions_per_seq_raise(per_seq, limit, error, message):
    labels = torch.full((2, 8), IGNORE)
    for row, n in enumerate(per_seq):
        labels[row, :n] = 3
    with pytest.raises(error, match=message):
        ops.masked_positions(labels, limit)
    hidden, decoder = torch.randn(2, 8, 4), torch.randn(11, 4)
    with pytest.raises(error, match=message):
        ops.mlm_head_loss(hidden, labels, torch.eye(4), torch.zeros(4), torch.ones(4), torch.zeros(4), 1e-12,
                          decoder, None, max_predictions_per_seq=limit)


def test_labels_beyond_max_predictions_per_seq_raise_under_torch_compile():
    """No host sync in the graph: torch._assert_async, a RuntimeError with the message on CPU."""
    labels = torch.full((2, 6), IGNORE)
    labels[1, :4] = 3
    torch._dynamo.reset()
    positions = torch.compile(lambda lab: ops.masked_positions(lab, 3), fullgraph=True, backend="aot_eager")
    assert positions(torch.full((2, 6), IGNORE)).shape == (6,)
    with pytest.raises(RuntimeError, match="a sequence has too many labelled positions .* max_predictions_per_seq=3"):
        positions(labels)


@pytest.mark.parametrize("form", ["static", "dynamic"])
def test_head_under_torch_compile_matches_eager(form):
    """max_predictions_per_seq (static shapes), or a data-dependent count captured by Dynamo."""
    # config.patch, not monkeypatch: undoing a monkeypatch deletes the option from Dynamo's config.
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=form == "dynamic"):
        _check_head_under_torch_compile(form)


def _check_head_under_torch_compile(form):
    hidden = torch.randn(2, 6, 8, requires_grad=True)
    labels = torch.full((2, 6), IGNORE)
    labels[0, [1, 4]] = torch.tensor([3, 5])
    labels[1, 2] = 7
    params = [torch.randn(8, 8) * 0.3, torch.randn(8), torch.ones(8), torch.zeros(8)]
    decoder = torch.randn(11, 8, requires_grad=True)
    kwargs = dict(max_predictions_per_seq=3) if form == "static" else {}

    def head(h, lab):
        return ops.mlm_head_loss(h, lab, *params, 1e-12, decoder, None, **kwargs).loss

    torch._dynamo.reset()
    expected = head(hidden, labels)
    got = torch.compile(head, fullgraph=True, backend="aot_eager")(hidden, labels)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    for a, b in zip(torch.autograd.grad(got, [hidden, decoder]), torch.autograd.grad(expected, [hidden, decoder])):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


# =========================================================================== against transformers' BertForMaskedLM head
@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=67, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=48)
    return transformers.BertForMaskedLM(config)


def hf_labels(kind, batch, seqlen, vocab, gen):
    labels = torch.full((batch, seqlen), IGNORE)
    if kind == "one":
        labels[1, 3] = 5
    elif kind == "all":
        labels = torch.randint(0, vocab, (batch, seqlen), generator=gen)
    elif kind == "some":
        labels = torch.where(torch.rand(batch, seqlen, generator=gen) < 0.4,
                             torch.randint(0, vocab, (batch, seqlen), generator=gen), labels)
    return labels


@pytest.mark.parametrize("kind, chunk_rows", [("none", None), ("one", None), ("all", 3), ("all", 8), ("some", 3),
                                              ("some", None)])
def test_head_matches_transformers(hf_model, backend, kind, chunk_rows):
    """Loss, accuracy and every gradient (hidden states, transform, the tied decoder weight, its bias)."""
    model = hf_model.to(backend.device)
    gen = torch.Generator().manual_seed(1)
    batch, seqlen, vocab = 2, 4, model.config.vocab_size
    hidden = torch.randn(batch, seqlen, model.config.hidden_size, generator=gen).to(backend.device).requires_grad_()
    labels = hf_labels(kind, batch, seqlen, vocab, gen).to(backend.device)
    head = model.cls.predictions
    params = [head.transform.dense.weight, head.transform.dense.bias, head.transform.LayerNorm.weight,
              head.transform.LayerNorm.bias]
    tied = model.bert.embeddings.word_embeddings.weight
    assert head.decoder.weight is tied
    with backend.forced():
        got = ops.mlm_head_loss(hidden, labels, *params, head.transform.LayerNorm.eps, head.decoder.weight, head.bias,
                                chunk_rows=chunk_rows)
    logits = model.cls(hidden).flatten(0, 1)  # [B * S, V]
    expected = torch.nan_to_num(F.cross_entropy(logits, labels.flatten()), nan=0.0)  # nothing labelled: 0
    valid = labels.flatten() != IGNORE
    torch.testing.assert_close(got.loss, expected, atol=1e-5, rtol=0)
    assert int(got.num_correct) == int(((logits.argmax(-1) == labels.flatten()) & valid).sum())
    assert int(got.num_predictions) == int(valid.sum())
    wrt = [hidden, *params, tied, head.bias]
    ours = torch.autograd.grad(got.loss, wrt, allow_unused=True)
    theirs = torch.autograd.grad(expected, wrt, allow_unused=True) if kind != "none" else [None] * len(wrt)
    for name, t, a, b in zip(["hidden", "dense.w", "dense.b", "ln.w", "ln.b", "decoder(tied)", "bias"], wrt, ours,
                             theirs):
        a = torch.zeros_like(t) if a is None else a
        if b is None:  # nothing labelled: every gradient is exactly zero, never NaN
            assert torch.count_nonzero(a) == 0, name
            continue
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


def test_model_uses_the_masked_only_head(monkeypatch):
    """BertForMaskedLM with labels calls mlm_head_loss on the real tokens; the head gathers the labelled ones."""
    seen = {}
    original = ops.mlm_head_loss

    def spy(hidden, labels, *args, **kwargs):
        seen["rows"], seen["labelled"] = hidden.shape[0], int((labels != IGNORE).sum())
        return original(hidden, labels, *args, **kwargs)

    monkeypatch.setattr(ops, "mlm_head_loss", spy)
    model = bertfast.BertForMaskedLM(bertfast.BertConfig.preset("tiny"))
    ids = torch.randint(1, 512, (2, 10))
    mask = torch.tensor([[1] * 10, [1] * 4 + [0] * 6])
    labels = torch.full((2, 10), IGNORE)
    labels[0, 2], labels[1, 1] = 7, 9
    out = model(ids, mask, labels=labels)
    assert seen == {"rows": 14, "labelled": 2}
    assert out.logits is None and int(out.mlm_num_predictions) == 2


# =========================================================================== the shared driver
def test_driver_errors_are_clear():
    x, w, b, labels = problem(BackendUnderTest("torch", torch.device(DEV)), 8, 32, 100, torch.float32)
    kernel = torch_kernel  # the driver validates before any kernel runs
    with pytest.raises(ValueError, match=r"weight: expected shape \(V > 0, 32\)"):
        _decoder_loss(x, w[:, :16], b, labels, None, True, 1.0, kernel)
    with pytest.raises(ValueError, match=r"bias: expected shape \(100,\)"):
        _decoder_loss(x, w, b[:50], labels, None, True, 1.0, kernel)
    with pytest.raises(ValueError, match=r"labels: expected shape \(8,\)"):
        _decoder_loss(x, w, b, labels[:7], None, True, 1.0, kernel)
    with pytest.raises(ValueError, match="chunk_rows: expected a positive int"):
        _decoder_loss(x, w, b, labels, 0, True, 1.0, kernel)


def test_driver_accumulates_weight_and_bias_gradients_in_fp32():
    # One row per chunk, per-chunk dlogits 2048, 1, 1, 1 (exact in fp16): the sum 2051 is not an fp16 value
    # (spacing 2 there), so with fp32 parameters only an fp32 accumulator returns it.
    values = iter([2048.0, 1.0, 1.0, 1.0])

    def stub_kernel(logits, labels, grad_scale, compute_grad):
        logits.fill_(next(values))
        zeros = torch.zeros(len(labels), device=logits.device)
        return zeros, zeros, zeros.bool()

    x = torch.ones(4, 2, dtype=torch.float16, device=DEV)
    w, b = torch.zeros(3, 2, device=DEV), torch.zeros(3, device=DEV)
    labels = torch.zeros(4, dtype=torch.long, device=DEV)
    _, _, gx, gw, gb = _decoder_loss(x, w, b, labels, 1, True, 1.0, stub_kernel)
    assert gx.dtype == torch.float16 and gw.dtype == gb.dtype == torch.float32
    assert (gw == 2051.0).all() and (gb == 2051.0).all()


@pytest.mark.parametrize("chunk_rows", [4, 1], ids=["one-chunk", "four-chunks"])
def test_one_chunks_weight_gradient_is_its_gemms_output(chunk_rows):
    """Low-precision weights, one chunk: the weight gradient is the one GEMM's output, in the weight's
    dtype, with no fp32 buffer to write, read and cast (8 bytes an element: 250 MB at BERT-large's
    vocabulary); over several chunks the sums stay fp32 until the end (the test above)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Outputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                self.made.append((out.dtype, tuple(out.shape)))
            return out

    def stub_kernel(logits, labels, grad_scale, compute_grad):
        logits.fill_(3.0)
        zeros = torch.zeros(len(labels), device=logits.device)
        return zeros, zeros, zeros.bool()

    x = torch.ones(4, 2, dtype=torch.bfloat16, device=DEV)
    w, b = torch.zeros(3, 2, dtype=torch.bfloat16, device=DEV), torch.zeros(3, dtype=torch.bfloat16, device=DEV)
    labels = torch.zeros(4, dtype=torch.long, device=DEV)
    with Outputs() as mode:
        _, _, gx, gw, gb = _decoder_loss(x, w, b, labels, chunk_rows, True, 1.0, stub_kernel)
    assert gw.dtype == torch.bfloat16 and (gw == 12.0).all() and (gb == 12.0).all()
    fp32_tables = [shape for dtype, shape in mode.made if dtype == torch.float32 and shape == (3, 2)]
    assert bool(fp32_tables) == (chunk_rows < 4)


@pytest.mark.parametrize("chunk_rows", [None, 2], ids=["one-chunk", "chunks-of-2"])
def test_one_chunk_scales_its_small_operands_not_the_weight_gradient(chunk_rows):
    """One chunk: the forward keeps the logits' gradient and the backward runs the gradient GEMMs with the
    loss's incoming gradient in x [M, H] and on the input gradient, so nothing of the weight gradient's size
    [V, H] is scaled (a pass of 125 MB at BERT-large's vocabulary in bf16). In chunks, the gradients come
    from the forward, for a scale of 1, and the backward scales each."""
    x, w, b, labels = problem(BackendUnderTest("torch", torch.device(DEV)), 6, 16, 1031, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    loss_sum, _ = ops.mlm_head_loss_decoder(*leaves, labels, chunk_rows=chunk_rows)
    with AtenLog() as log:
        loss_sum.backward(torch.tensor(0.37, device=DEV))
    muls = (torch.ops.aten.mul.Tensor, torch.ops.aten.mul_.Tensor)
    scaled = [shape for func, shape in log.calls if func in muls]
    gemms = [shape for func, shape in log.calls if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out)]
    if chunk_rows is None:
        assert (1031, 16) not in scaled and (6, 16) in scaled
        assert (6, 16) in gemms and (1031, 16) in gemms
    else:
        assert (1031, 16) in scaled and not gemms
    check_decoder(BackendUnderTest("torch", torch.device(DEV)), x, w, b, labels, chunk_rows)


@pytest.mark.parametrize("v,elem", [(30522, 2), (30522, 4), (1031, 2), (250_000, 2)])
def test_default_chunk_rows(v, elem):
    cap = default_chunk_rows(10**9, v, elem)
    assert cap % 64 == 0 and cap >= 64
    assert cap * v * elem <= CHUNK_BYTES or cap == 64
    assert (cap + 64) * v * elem > CHUNK_BYTES
    for m in (1, 37, 4915, 20_000, 123_457):
        rows = default_chunk_rows(m, v, elem)
        assert 1 <= rows <= cap
        assert -(-m // rows) == -(-m // cap)  # balanced: no more chunks than the cap requires
    assert default_chunk_rows(4915, 30522, 2) == 2496  # 2 chunks: 2496 + 2419
    assert default_chunk_rows(10**9, 30522, 2) == 4352


def test_the_decoder_gemms_run_over_whole_16_byte_rows_of_vocabulary(monkeypatch):
    """BERT's 30522 is not a whole number of 16-byte bf16 rows, and cuBLAS's Hopper kernels need
    one (the H200 ran the head's GEMMs at ~250 TFLOP/s without it): the driver pads the vocabulary with
    zero weight rows and bias, and the padded logits' gradient is zeroed before the backward's GEMMs,
    so the gradients are those of the V real columns (the decoder tests compare them everywhere)."""
    assert [padded_vocab(30522, e) for e in (2, 4)] == [30528, 30524]
    assert padded_vocab(1000, 2) == 1000 and padded_vocab(1031, 2) == 1032 and padded_vocab(3, 1) == 16
    gemm_ops = (torch.ops.aten.mm.out, torch.ops.aten.addmm.out, torch.ops.aten.mm.default)

    module = sys.modules["bertfast.ops.mlm_head_loss"]
    assert module.PADDED_DEVICES == {"cuda"}  # a CPU's GEMMs do not care: no copy of the weight there
    monkeypatch.setattr(module, "PADDED_DEVICES", {"cpu", "cuda"})
    x, w, b, labels = problem(BackendUnderTest("torch", torch.device(DEV)), 6, 32, 1031, torch.bfloat16)
    with AtenLog() as log:
        _, _, gx, gw, gb = _decoder_loss(x, w, b, labels, None, True, 1.0, torch_kernel)
    gemms = [shape for func, shape in log.calls if func in gemm_ops]
    assert (6, 1032) in gemms and (1032, 32) in gemms and (6, 1031) not in gemms
    assert gx.shape == (6, 32) and gw.shape == (1031, 32) and gb.shape == (1031,)


# =========================================================================== GPU sizes
@pytest.mark.gpu
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_gpu_kernel_bert_vocabulary(backend, dtype, strided):
    # V = 30522: Triton's looped path; CUDA's unaligned rows (strided: rows start at every 2- or 4-byte offset).
    m, v = 37, 30522
    z, labels = logits_with_ties(backend, m, v, dtype)
    buf = torch.full((m, v + (3 if strided else 0)), 7.0, dtype=dtype, device=backend.device)
    buf[:, :v] = z
    correct = check_kernel(backend, buf[:, :v], labels, grad_scale=0.01, atol=1e-4)
    assert correct[:4].tolist() == [False, True, False, True]
    assert (buf[:, v:] == 7.0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_rows", [None, 1000])
def test_gpu_decoder_bert_base(backend, chunk_rows):
    # BERT-base MLM head after gathering: 4096 rows, bf16, the 2x rule against fp32.
    x, w, b, labels = problem(backend, 4096, 768, 30522, torch.bfloat16, labelled="all")
    labels[::50] = IGNORE
    scale = 1.0 / int((labels != IGNORE).sum())  # the mean loss, as the head takes it
    loss_sum, n_correct, grads = run_decoder(backend, x, w, b, labels, chunk_rows, grad_out=scale)
    fn = lambda x_, w_, b_: R.mlm_head_loss_decoder(x_, w_, b_, labels)[0]  # noqa: E731
    (l32, g32), (llo, glo) = references(fn, [x, w, b], torch.bfloat16, torch.tensor(scale, device=x.device))
    check_close("loss_sum", loss_sum, l32, llo, torch.bfloat16, lowp_atol=1e-4)
    for name, got, want32, wantlo in zip(("grad_x", "grad_weight", "grad_bias"), grads, g32, glo):
        assert got.dtype == torch.bfloat16
        check_close(name, got, want32, wantlo, torch.bfloat16)
    # cuBLAS may round a few logits differently from F.linear: allow a handful of flips.
    assert abs(int(n_correct) - int(R.mlm_head_loss_decoder(x, w, b, labels)[1])) <= 4


@pytest.mark.gpu
def test_gpu_fused_decoder_bert_large(fused_mode, monkeypatch):
    """BERTFAST_MLM_HEAD=fused at the kernel suite's BERT-large case (2,432 rows, V = 30522: a ragged last tile,
    the padded rows), bf16, fp32 parameters: the reference's loss and gradients by the 2x rule."""
    from bertfast.kernels import mlm_head_loss as K

    triton = BackendUnderTest("triton", torch.device(DEV))
    x, w, b, labels = problem(triton, 2432, 1024, 30522, torch.bfloat16, labelled="all", param_dtype=torch.float32)
    ran = []
    real = K.mlm_logits_gemm_fwd
    monkeypatch.setattr(K, "mlm_logits_gemm_fwd", lambda *a: ran.append(1) or real(*a))
    scale = 1.0 / x.shape[0]
    loss_sum, n_correct, grads = run_decoder(triton, x, w, b, labels, grad_out=scale)
    assert ran == [1]
    fn = lambda x_, w_, b_: R.mlm_head_loss_decoder(x_, w_, b_, labels)[0]  # noqa: E731
    (l32, g32), (llo, glo) = references(fn, [x, w, b], torch.bfloat16, torch.tensor(scale, device=x.device))
    check_close("loss_sum", loss_sum, l32, llo, torch.bfloat16, lowp_atol=1e-4)
    for name, got, want32, wantlo in zip(("grad_x", "grad_weight", "grad_bias"), grads, g32, glo):
        check_close(name, got, want32, wantlo, torch.bfloat16)
    # argmax from the fp32 logits, the reference's from bf16 ones: a handful of near-ties may flip
    assert abs(int(n_correct) - int(R.mlm_head_loss_decoder(x, w.to(x.dtype), b.to(x.dtype), labels)[1])) <= 8


# =========================================================================== Triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v,block_v", [(1031, 256), (1000, 128)])
def test_triton_looped_path_with_many_blocks(v, block_v, dtype):
    # A fixed block much smaller than V: many blocks and a ragged last one; ties across blocks (5 and v-1).
    triton = BackendUnderTest("triton", torch.device(DEV))
    z, labels = logits_with_ties(triton, 6, v, dtype)
    correct = check_kernel(triton, z, labels, block_v=block_v)
    assert correct[:4].tolist() == [False, True, False, True]


@pytest.mark.skipif(GPU, reason="on a GPU every Triton test above takes this path")
def test_triton_autotuned_in_place_kernel_is_tuned_on_a_scratch_copy(stand_in_tuner):
    """The kernel overwrites its logits with their gradient: every candidate runs on a scratch copy and the
    chosen one once on the real logits. A trial on the real logits would leave the gradient of the gradient."""
    from bertfast.kernels import mlm_head_loss as K

    stand_in_tuner(K._fwd_tuned)
    triton = BackendUnderTest("triton", torch.device("cpu"))
    z, labels = logits_with_ties(triton, 5, 1031, torch.float32)
    wide = torch.full((5, 1040), 7.0)  # row-strided logits: the scratch copy keeps the row stride
    wide[:, :1031] = z
    check_kernel(triton, wide[:, :1031], labels, grad_scale=0.5)
    assert (wide[:, 1031:] == 7.0).all()
    assert len(K._fwd_tuned.cache) == 1


# =========================================================================== Triton: the loss in the GEMM's epilogue
def fused_problem(m, h, v, dtype, bias=True, seed=0):
    """problem()'s x, weight, bias and labels in the activations' dtype on DEV, with argmax labels and ties."""
    triton = BackendUnderTest("triton", torch.device(DEV))
    x, w, b, labels = problem(triton, m, h, v, dtype, bias=bias, seed=seed)
    return x, w.to(dtype), None if b is None else b.to(dtype), labels


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,h,v,bias,split", [(37, 40, 101, True, 1), (5, 16, 70, False, None), (40, 32, 64, True, 3),
                                              (37, 40, 101, True, 2)],
                         ids=["ragged", "no-bias", "whole-tiles", "split"])
def test_fused_forward_and_backward_gemms(m, h, v, bias, split, dtype):
    """mlm_logits_gemm_fwd: the loss, lse and argmax of the fp32 logits; its u and c give the softmax (p = u * c,
    summing to 1 over each labelled row; c 0 on ignored rows). mlm_softmax_gemms_bwd: the gradients of x, the
    weight and the bias for g = grad * (p - onehot) (0 on ignored rows), g never written, two rows sharing a
    label, the input gradient's vocabulary split or not. Under the interpreter the tiles are 32 x 32 (several in
    each direction, ragged ones), H is not a multiple of BLOCK_K in the first case."""
    from bertfast.kernels import mlm_head_loss as K

    x, w, b, labels = fused_problem(m, h, v, dtype, bias)
    if m > 5:
        labels[1] = labels[2] if labels[2] != IGNORE else 7  # two rows, one label: the one-hot's rows add up
    z = F.linear(x.float(), w.float(), None if b is None else b.float())
    loss, lse, correct, softmax = K.mlm_logits_gemm_fwd(x, w, b, labels)
    valid = labels != IGNORE
    safe = labels.clamp_min(0)[:, None]
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(lse, torch.logsumexp(z, 1), atol=tol, rtol=tol)
    torch.testing.assert_close(loss, torch.where(valid, lse - z.gather(1, safe)[:, 0], 0.0), atol=tol, rtol=tol)
    assert torch.equal(correct, valid & (z.argmax(1) == labels)) and int(correct.sum()) > 0
    u, c, vocab = softmax
    assert vocab == v and u.shape == (m, K.softmax_width(v)) and u.shape[1] % 128 == 0 and not u[:, v:].any()
    assert not c[:, ~valid].any()
    p = u[:, :v].float() * c.repeat_interleave(32, 0)[:v].t()
    torch.testing.assert_close(p.sum(1), valid.float(), atol=1e-5, rtol=0)
    want_p = torch.where(valid[:, None], torch.softmax(z, 1), 0.0)
    torch.testing.assert_close(p, want_p, atol=1e-6 if dtype == torch.float32 else 2e-3, rtol=1e-2)

    g = torch.where(valid[:, None], (want_p - F.one_hot(safe[:, 0], v).float()) * 0.37, 0.0)
    gx, gw, gb = K.mlm_softmax_gemms_bwd(softmax, labels, x, w, torch.tensor(0.37, device=DEV), torch.float32,
                                         bias, split)
    assert gx.dtype == dtype and gw.dtype == torch.float32 and (gb is None) == (not bias)
    lowp = dtype != torch.float32
    torch.testing.assert_close(gx.float(), g @ w.float(), atol=2e-2 if lowp else 1e-5, rtol=2e-2 if lowp else 1e-5)
    torch.testing.assert_close(gw, g.t() @ x.float(), atol=1e-2 if lowp else 1e-5, rtol=2e-2 if lowp else 1e-5)
    if bias:
        torch.testing.assert_close(gb, g.sum(0), atol=5e-3 if lowp else 1e-6, rtol=1e-2 if lowp else 1e-5)
    assert not gx[~valid].any()


def test_the_split_input_gradient_is_summed_in_order_and_leaves_its_counts_zero(monkeypatch):
    """Split, the input gradient's last split of each tile adds the fp32 partials in split order (one rounding):
    bit for bit the partials' sum in that order, each partial its split's share (a run with the other splits'
    vocabulary zeroed); its counts of splits done are 0 again after the launch (the autotuner's runs reuse them)."""
    from bertfast.kernels import mlm_head_loss as K

    m, h, v, split = 37, 40, 190, 3  # under the interpreter 6 tiles of 32 columns, 2 a split (the last ragged)
    x, w, b, labels = fused_problem(m, h, v, torch.float32)
    grad = torch.tensor(0.37, device=DEV)
    counts = []
    real = K._dx_counts
    monkeypatch.setattr(K, "_dx_counts", lambda *a: counts.append(real(*a)) or counts[-1])
    softmax = K.mlm_logits_gemm_fwd(x, w, b, labels)[3]
    gx = K.mlm_softmax_gemms_bwd(softmax, labels, x, w, grad, torch.float32, True, split)[0]
    assert len(counts) == 1 and counts[0].numel() > 0 and not counts[0].any()
    per_split = K.cdiv(K.cdiv(v, K._tile_n()), split) * K._tile_n()
    shares = []
    for s in range(split):  # split s's share: u zero outside its vocabulary, the one-hot's part on split 0's only
        u = softmax.u.clone()
        u[:, :s * per_split] = 0
        u[:, (s + 1) * per_split:] = 0
        shares.append(K.mlm_softmax_gemms_bwd(K.DecoderSoftmax(u, softmax.c, v), labels if s == 0 else
                                              torch.full_like(labels, -100), x, w, grad, torch.float32, True, 1)[0])
    assert all(share.any() for share in shares)
    want = shares[0].clone()
    for share in shares[1:]:
        want += share
    assert torch.equal(gx, want) and not torch.equal(gx, shares[2] + shares[1] + shares[0])  # the order shows


def test_the_input_gradients_split_fills_the_gpu():
    """The input gradient's vocabulary split: the least giving six waves of programs at 64 x 128 tiles, at most
    four: BERT-large's 2,432 rows (304 tiles) split 3 ways on 132 SMs, BERT-base's (228) 4, many rows not."""
    from bertfast.kernels import mlm_head_loss as K

    assert [K.dx_split(2432, h, 132) for h in (1024, 768)] == [3, 4]
    assert K.dx_split(16384, 1024, 132) == 1 and K.dx_split(64, 64, 132) == K.DX_SPLIT_MAX
    assert K.dx_split(2432, 1024, 78) == 2  # fewer SMs, fewer partials


def test_fused_kernels_errors_are_clear():
    from bertfast.kernels import mlm_head_loss as K

    x, w, b, labels = fused_problem(4, 8, 50, torch.float32)
    with pytest.raises(ValueError, match="weight: expected dtype"):
        K.mlm_logits_gemm_fwd(x, w.double(), b, labels)
    with pytest.raises(ValueError, match=r"weight: expected shape \(V > 0, 8\)"):
        K.mlm_logits_gemm_fwd(x, w[:, :7], b, labels)
    with pytest.raises(ValueError, match="x: expected a hidden size H >= 1"):
        K.mlm_logits_gemm_fwd(x[:, :0], w[:, :0], b, labels)
    with pytest.raises(ValueError, match="weight: expected unit column stride"):
        K.mlm_logits_gemm_fwd(x, torch.randn(8, 50, device=DEV).t(), b, labels)
    with pytest.raises(ValueError, match="labels: expected dtype"):
        K.mlm_logits_gemm_fwd(x, w, b, labels.int())
    _, _, _, softmax = K.mlm_logits_gemm_fwd(x, w, b, labels)
    one = torch.tensor(1.0, device=DEV)
    with pytest.raises(ValueError, match=r"u: expected shape \(4, 128\)"):
        K.mlm_softmax_gemms_bwd(softmax._replace(u=softmax.u[:, :50]), labels, x, w, one, w.dtype, True)
    with pytest.raises(ValueError, match=r"c: expected shape \(2, 4\)"):
        K.mlm_softmax_gemms_bwd(softmax._replace(c=softmax.c[:1]), labels, x, w, one, w.dtype, True)
    with pytest.raises(ValueError, match="grad: expected dtype"):
        K.mlm_softmax_gemms_bwd(softmax, labels, x, w, one.double(), w.dtype, True)
    loss, _, correct, empty_softmax = K.mlm_logits_gemm_fwd(x[:0], w, b, labels[:0])
    assert loss.shape == correct.shape == (0,)
    gx, gw, gb = K.mlm_softmax_gemms_bwd(empty_softmax, labels[:0], x[:0], w, one, w.dtype, True)
    assert gx.shape == (0, 8) and not gw.any() and not gb.any()


@pytest.fixture
def fused_mode(monkeypatch):
    H = sys.modules["bertfast.ops.mlm_head_loss"]  # the package exports a function of that name
    monkeypatch.setenv(H.MODE_ENV, "fused")
    return H


@pytest.mark.parametrize("dtype,bias,param_dtype",
                         [pytest.param(torch.float32, True, None, id="fp32-bias"),
                          pytest.param(torch.float32, False, None, id="fp32-no-bias")]
                         + [pytest.param(p.values[0], bias, params, id=f"{p.id}-{name}") for p in LOWP
                            for bias, params, name in ((True, None, "bias"), (False, None, "no-bias"),
                                                       (True, torch.float32, "fp32-params"))])
def test_fused_decoder_matches_reference(fused_mode, monkeypatch, dtype, bias, param_dtype):
    """BERTFAST_MLM_HEAD=fused: one chunk's decoder through the fused forward (the spy sees it), the gradients
    from its logits' gradient, the bias gradient its column sums, the loss's incoming gradient applied in the
    backward; against the reference at the contract's tolerances (fp32 parameters: autocast's, cast to the
    activations' dtype for the GEMMs)."""
    from bertfast.kernels import mlm_head_loss as K

    triton = BackendUnderTest("triton", torch.device(DEV))
    x, w, b, labels = problem(triton, 37, 40, 101, dtype, bias=bias, param_dtype=param_dtype)
    ran, backward = [], []
    real, real_bwd = K.mlm_logits_gemm_fwd, K.mlm_softmax_gemms_bwd
    monkeypatch.setattr(K, "mlm_logits_gemm_fwd", lambda *a: ran.append(a[1].dtype) or real(*a))
    monkeypatch.setattr(K, "mlm_softmax_gemms_bwd", lambda *a: backward.append(a[5]) or real_bwd(*a))
    _, n_correct, (gx, gw, gb) = check_decoder(triton, x, w, b, labels, grad_out=0.37 if dtype == torch.float32
                                               else 1.0)
    assert ran == [dtype] and int(n_correct) > 0
    assert backward == [param_dtype or dtype]  # the weight gradient written in the weight's dtype
    assert gx.dtype == dtype and gw.dtype == (param_dtype or dtype) and (gb is None or gb.dtype == gw.dtype)
    assert not gx[labels == IGNORE].any()


def test_fused_decoder_checks_the_labels_range_on_the_device(fused_mode, monkeypatch):
    """Checked on the device (a CUDA graph, torch.compile), the fused decoder's labels' range is its statistics
    kernel's (a flag a row, then one assert: two launches where torch's operations took eight): a label past the
    vocabulary or below 0 but -100 fails with the contract's message."""
    from bertfast.dispatch import use_backend
    from bertfast.kernels import mlm_head_loss as K

    x, w, b, labels = problem(BackendUnderTest("triton", torch.device(DEV)), 6, 16, 70, torch.float32)
    ok = torch.empty(6, dtype=torch.bool, device=DEV)
    K.mlm_logits_gemm_fwd(x, w, b, torch.tensor([-100, 0, 69, 70, -1, -101], device=DEV), ok)
    assert ok.tolist() == [True, True, True, False, False, False]
    if DEV != "cpu":
        return  # on a GPU the assert is the device's, and it ends the process's CUDA context
    monkeypatch.setattr(fused_mode, "value_checks", lambda t: "device")
    spied = []
    real = K.mlm_logits_gemm_fwd
    monkeypatch.setattr(K, "mlm_logits_gemm_fwd", lambda *a: spied.append(a[4] is not None) or real(*a))
    x.requires_grad_()
    for label in (70, -1):
        wrong = labels.clone()
        wrong[2] = label
        with use_backend("triton"), pytest.raises(RuntimeError, match=r"labels: expected values in \[0, 70\)"):
            ops.mlm_head_loss_decoder(x, w, b, wrong)
    assert spied == [True, True]  # the fused forward ran, with the flags


@pytest.mark.parametrize("labelled", ["none", "one"])
def test_fused_decoder_label_patterns(fused_mode, labelled):
    """No labelled row: loss 0 and exactly zero gradients (grad_scale times nothing); one: the reference's."""
    triton = BackendUnderTest("triton", torch.device(DEV))
    x, w, b, labels = problem(triton, 5, 16, 70, torch.float32, labelled=labelled)
    loss_sum, n_correct, grads = check_decoder(triton, x, w, b, labels)
    if labelled == "none":
        assert float(loss_sum) == 0.0 and int(n_correct) == 0 and all(not g.any() for g in grads)


def test_fused_mode_runs_only_where_it_can(fused_mode, monkeypatch):
    """The fused forward where the rows make one chunk on the triton backend; several chunks, other
    backends and a weight of columns keep the library's GEMMs; a mode that is not one of the two is a clear
    error."""
    from bertfast.kernels import mlm_head_loss as K

    ran = []
    real = K.mlm_logits_gemm_fwd
    monkeypatch.setattr(K, "mlm_logits_gemm_fwd", lambda *a: ran.append(1) or real(*a))
    triton = BackendUnderTest("triton", torch.device(DEV))
    x, w, b, labels = problem(triton, 6, 16, 70, torch.float32)
    check_decoder(triton, x, w, b, labels, chunk_rows=4)  # two chunks
    check_decoder(BackendUnderTest("torch", torch.device(DEV)), x, w, b, labels)
    assert ran == []
    check_decoder(triton, x, w, b, labels)
    check_decoder(triton, x.t().contiguous().t(), w, b, labels)  # column-major x: the GEMM takes a copy
    check_decoder(triton, x, w.t().contiguous().t(), b, labels)  # a column-major weight: the library's GEMMs
    assert ran == [1, 1]
    assert "MLM head decoder: fused" in fused_mode.head_summary()
    monkeypatch.setenv(fused_mode.MODE_ENV, "fast")
    with pytest.raises(ValueError, match="BERTFAST_MLM_HEAD: expected one of library, fused, got 'fast'"):
        run_decoder(triton, x, w, b, labels)
    assert "BERTFAST_MLM_HEAD: expected one of" in fused_mode.head_summary()
    with fused_mode.using_head_mode("library"):
        assert fused_mode.head_mode() == "library"
    assert os.environ[fused_mode.MODE_ENV] == "fast"


@pytest.mark.parametrize("with_bias", [True, False])
def test_opcheck_fused(with_bias):
    """The fused form's schema, fake (the softmax's u in whole tiles of 128 columns and its c per tile) and
    autograd on the triton backend, and its backward op's."""
    x, w = torch.randn(5, 6, requires_grad=True), torch.randn(9, 6, requires_grad=True)
    b = torch.randn(9, requires_grad=True) if with_bias else None
    labels = torch.tensor([1, -100, 8, 0, 3], device=DEV)
    args = (x.to(DEV), w.to(DEV), None if b is None else b.to(DEV), labels, 0, True, True, True, "triton")
    with BackendUnderTest("triton", torch.device(DEV)).forced():
        torch.library.opcheck(torch.ops.bertfast.mlm_head_loss_decoder, args)
        with torch.no_grad():
            _, _, u, w_gemm, c = torch.ops.bertfast.mlm_head_loss_decoder(*args)
        torch.library.opcheck(torch.ops.bertfast.mlm_head_loss_decoder_fused_backward,
                              (*(None if t is None else t.detach() for t in args[:3]), w_gemm, u, c, labels,
                               torch.tensor(0.5, device=DEV), "triton"))


# =========================================================================== CUDA wrapper validation (no GPU)
def test_cuda_validation(cuda_on_cpu):
    from bertfast.cuda import mlm_head_loss as C

    logits = torch.randn(5, 33, dtype=torch.float16)
    labels = torch.tensor([1, -100, 32, 0, 5])
    cuda_on_cpu.reaches(C.mlm_head_loss_fwd, logits, labels, 0.5, True)
    cuda_on_cpu.reaches(C.mlm_head_loss_fwd, torch.randn(5, 40, dtype=torch.float16)[:, :33], labels.int(), 1.0,
                        False)
    # Rows need no alignment (V = 30522 rows are not 16-byte aligned): the kernel walks a scalar head.
    cuda_on_cpu.reaches(C.mlm_head_loss_fwd, cuda_on_cpu.misaligned((5, 33), torch.float16), labels, 1.0, True)
    cuda_on_cpu.rejects("labels: expected dtype", C.mlm_head_loss_fwd, logits, labels.float(), 1.0, True)
    cuda_on_cpu.rejects(r"labels: expected shape \(5,\)", C.mlm_head_loss_fwd, logits, labels[:4], 1.0, True)
    cuda_on_cpu.rejects("stride 1 along the vocabulary", C.mlm_head_loss_fwd, torch.randn(33, 5).t(), labels, 1.0,
                        True)
    cuda_on_cpu.rejects("non-empty vocabulary", C.mlm_head_loss_fwd, torch.randn(5, 0), labels, 1.0, True)
    cuda_on_cpu.rejects("logits: expected dtype", C.mlm_head_loss_fwd, logits.to(torch.int32), labels, 1.0, True)
    # The shared driver validates before any chunk reaches the kernel.
    x, w = torch.randn(5, 8), torch.randn(33, 8)
    cuda_on_cpu.reaches(_decoder_loss, x, w, torch.randn(33), labels, 2, True, 0.2, C.mlm_head_loss_fwd)
    cuda_on_cpu.rejects("weight: expected shape", _decoder_loss, x, w[:, :7], None, labels, 2, True, 1.0,
                        C.mlm_head_loss_fwd)
    cuda_on_cpu.rejects("chunk_rows", _decoder_loss, x, w, None, labels, 0, True, 1.0, C.mlm_head_loss_fwd)
    cuda_on_cpu.rejects(r"labels: expected values in \[0, 33\) or -100 \(ignored\), got 33", _decoder_loss, x,
                        w, None, torch.tensor([1, 2, 3, 4, 33]), 2, True, 1.0, C.mlm_head_loss_fwd)
    assert cuda_on_cpu.calls == ["mlm_head_loss_fwd"] * 4


def test_cuda_rejects_cpu_tensors():
    from bertfast.cuda import mlm_head_loss as C

    with pytest.raises(ValueError, match="expected a CUDA tensor, got device cpu"):
        C.mlm_head_loss_fwd(torch.randn(4, 8), torch.zeros(4, dtype=torch.long), 1.0, True)
