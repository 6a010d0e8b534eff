"""Every autotune candidate of every Triton kernel computes what the first one does.

On a GPU the autotuner (kernels/_common.py) times each kernel's candidates and keeps the fastest; it
never checks their results, and every other test runs the first candidate (the fixed mode, or the
interpreter's own blocks). A candidate that masks a tail wrongly would be chosen for its speed and
give wrong answers silently, or fail the bench's parity gate after a loan's time was spent on it. Here
each candidate of each kernel a call launches is pinned (``_common.pinned_candidate``), the others
run their first, and the call's outputs are compared with the first candidates' (block shapes change
only the order of sums). On a GPU the candidates compile; without one they run under the interpreter
with launch() on its GPU path (``stand_in_tuner``), the 16-bit lists included (the interpreter's bf16
is off against the reference, not between candidates). Sizes cross every candidate's blocks: sequences
of 50 and 100 tokens (a bucket of 128), 20 and 45 for fp32 (its tiles are at most 32), 20 and 32 for its
one-pass backward; rows not a multiple of any row tile.
"""
from __future__ import annotations

import os

import pytest
import torch

from bertfast.gpucheck import stages
from bertfast.kernels import _common
# Imported before stand_in_tuner fakes interpreting() False: each module binds interpreting at import, and
# the interpreter's bf16 needs its own (upcast) dots
from bertfast.kernels import attention as K
from bertfast.kernels import bias_dropout_residual_layernorm as L
from bertfast.kernels import bias_gelu as G
from bertfast.kernels import embeddings as E
from bertfast.kernels import mlm_head_loss as M

GPU = torch.cuda.is_available()
DEV = torch.device("cuda" if GPU else "cpu")
BF16, FP32 = torch.bfloat16, torch.float32
# bf16: the first candidate's result may round the other way (a bf16 ulp, 2**-8 of it); fp32: its sums'
# order (observed 4e-7 at these sizes)
TOL = {BF16: dict(rtol=2 ** -7, atol=2e-3), FP32: dict(rtol=1e-4, atol=1e-5)}


@pytest.fixture
def on_gpu_path(monkeypatch, stand_in_tuner):
    """Without a GPU, launch() takes its GPU path (candidates, pinning) under the interpreter."""
    if not GPU:
        stand_in_tuner()
    monkeypatch.delenv(K.DQ_ENV, raising=False)
    monkeypatch.delenv(K.PERSISTENT_ENV, raising=False)


def _tensors(result):
    if result is None:
        return []
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for item in result for t in _tensors(item)]


def _randn(*shape, dtype=FP32, gen=None):
    return torch.randn(*shape, generator=gen).to(dtype).to(DEV)


# Where a GPU check's stage 2 collects the wrong candidates ("kernel:config" lines), for its later stages
# to leave out (BERTFAST_EXCLUDE_CANDIDATES)
FAILURES_ENV = stages.CANDIDATE_FAILURES_ENV


def _record(name, config):
    path = os.environ.get(FAILURES_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"{name}:{config}\n")


def _check(run, want, name, configs, dtype, bad):
    for index in range(1, len(configs)):
        with _common.pinned_candidate(name, index):
            got = _tensors(run())
        for i, (g, w) in enumerate(zip(got, want)):
            try:
                torch.testing.assert_close(g.float(), w.float(), equal_nan=True, **TOL[dtype])
            except AssertionError as exc:
                diff = (g.float() - w.float()).abs().nan_to_num(float("inf")).max().item()
                bad.append(f"{name} candidate {index} ({configs[index]}): output {i} off by {diff:.3g}: "
                           + str(exc).splitlines()[0])
                _record(name, configs[index])


def every_candidate_matches_the_first(case, dtype):
    """``case`` = (forward, backward): forward() runs an op's forward kernels and returns (its outputs to
    compare, what the backward takes), backward(that) its backward kernels (None: no backward). Each runs
    at every kernel's first candidate, then at each other candidate of each of its kernels (the backward
    on the first forward's).
    Returns (kernel name -> its candidates' configs, mismatches as readable lines: kernel, candidate,
    config, output, difference)."""
    forward, backward = case
    with _common.pinned_candidate() as fwd_listed:
        shown, state = forward()
        fwd_want = [t.detach().clone() for t in _tensors(shown)]
    bwd_listed, bwd_want = {}, []
    if backward is not None:
        with _common.pinned_candidate() as bwd_listed:
            bwd_want = [t.detach().clone() for t in _tensors(backward(state))]
    assert fwd_listed or bwd_listed, "the call launched no autotuned kernel"
    bad = []
    for name, configs in fwd_listed.items():
        _check(lambda: forward()[0], fwd_want, name, configs, dtype, bad)
    for name, configs in bwd_listed.items():
        _check(lambda: backward(state), bwd_want, name, configs, dtype, bad)
    listed = dict(fwd_listed)
    for name, configs in bwd_listed.items():  # a kernel of both (the FFN's GEMM): its longer list
        listed[name] = max(listed.get(name, []), configs, key=len)
    return listed, bad


# --------------------------------------------------------------------------- the calls
def keep_in_sequences(bits, lengths):
    """The dropout decisions the keep bits record on each sequence's own [len, len] block (its bytes past
    a sequence's end are not defined): bool [B, A, S, S], False elsewhere; empty without dropout."""
    from test_attention_fused import unpack_keep_bits
    if bits.numel() == 0:
        return bits
    seqlen = max(lengths)
    inside = torch.arange(seqlen)[None, :] < torch.tensor(lengths)[:, None]
    inside = (inside[:, :, None] & inside[:, None, :])[:, None].to(bits.device)
    return unpack_keep_bits(bits, seqlen).to(bits.device) & inside


def attention_varlen(dtype, lengths, dropout_p):
    gen = torch.Generator().manual_seed(11)
    tokens, heads, head_dim = sum(lengths), 2, 64
    q, k, v, dout = (_randn(tokens, heads, head_dim, dtype=dtype, gen=gen) for _ in range(4))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    seed = torch.tensor([1234], dtype=torch.int64, device=DEV)

    def forward():
        out, lse, keep = K.attention_varlen_fwd(q, k, v, cu, max(lengths), 0.125, dropout_p, seed)
        return (out, lse, keep_in_sequences(keep, lengths)), (out, lse, keep)

    def backward(fwd):
        out, lse, keep = fwd
        return K.attention_varlen_bwd(dout, q, k, v, out, lse, cu, max(lengths), 0.125, dropout_p, seed, keep,
                                      torch.float32)  # as training asks: the QKV bias gradient too
    return forward, backward


def attention_padded(dtype, lengths, dropout_p):
    gen = torch.Generator().manual_seed(12)
    batch, seqlen, heads, head_dim = len(lengths), max(lengths), 2, 64
    q, k, v, dout = (_randn(batch, seqlen, heads, head_dim, dtype=dtype, gen=gen) for _ in range(4))
    mask = (torch.arange(seqlen)[None, :] < torch.tensor(lengths)[:, None]).to(DEV)
    seed = torch.tensor([99], dtype=torch.int64, device=DEV)

    def forward():
        out, lse, keep = K.attention_padded_fwd(q, k, v, mask, 0.125, dropout_p, seed)
        return (out, lse, keep_in_sequences(keep, lengths)), (out, lse, keep)

    def backward(fwd):
        out, lse, keep = fwd
        return K.attention_padded_bwd(dout, q, k, v, out, lse, mask, 0.125, dropout_p, seed, keep)
    return forward, backward


# Rows not a multiple of any row tile; BERT-base's widths on a GPU, narrower under the interpreter (its
# row kernels take seconds a row at 768: the tiles differ, the masking and row-group code is the same)
ROWS, HIDDEN, FFN = (77, 768, 3072) if GPU else (37, 128, 512)


def layernorm(dtype):
    gen = torch.Generator().manual_seed(13)
    hidden = HIDDEN
    x, residual, dy = (_randn(ROWS, hidden, dtype=dtype, gen=gen) for _ in range(3))
    bias, w, b = (_randn(hidden, gen=gen) for _ in range(3))
    seed = torch.tensor([7], dtype=torch.int64, device=DEV)

    def forward():
        fwd = L.bias_dropout_residual_layernorm_fwd(x, bias, residual, w, b, 1e-12, 0.1, seed)
        return fwd, fwd

    def backward(fwd):
        _, pre, mean, rstd = fwd
        return L.bias_dropout_residual_layernorm_bwd(dy, pre, mean, rstd, w, 0.1, seed, True, True)
    return forward, backward


def bias_gelu(dtype):
    gen = torch.Generator().manual_seed(14)
    x, dy = (_randn(ROWS, FFN, dtype=dtype, gen=gen) for _ in range(2))
    bias = _randn(FFN, gen=gen)
    return (lambda: (G.bias_gelu_fwd(x, bias), None)), (lambda _: G.bias_gelu_bwd(dy, x, bias))


def ffn_gemms(dtype):
    """The FFN's GEMMs with GELU in their epilogues (kernels/bias_gelu.py), as the model calls them."""
    gen = torch.Generator().manual_seed(15)
    hidden, ffn = 64, 256  # K a multiple of every candidate's BLOCK_K; tokens not of BLOCK_M
    h = _randn(ROWS, hidden, dtype=dtype, gen=gen) * 0.5
    w1, w2 = _randn(ffn, hidden, dtype=dtype, gen=gen) * 0.1, _randn(hidden, ffn, dtype=dtype, gen=gen) * 0.1
    b1, dout = _randn(ffn, dtype=dtype, gen=gen), _randn(ROWS, hidden, dtype=dtype, gen=gen)

    def forward():
        y, z = G.gemm_bias_gelu_fwd(h, w1, b1)  # GELU(h w1^T + b1), and the pre-activation z
        return (y, z), (y, z)

    def backward(fwd):
        return G.gemm_gelu_bwd(dout, w2, fwd[1], bias_dtype=torch.float32)
    return forward, backward


def fused_decoder(dtype):
    """The MLM decoder's own GEMMs (BERTFAST_MLM_HEAD=fused, kernels/mlm_head_loss.py), as the op calls them."""
    gen = torch.Generator().manual_seed(18)
    m, hidden, vocab = 40, 64, 300  # rows not a multiple of BLOCK_M or BLOCK_K; a ragged last tile
    x, w = _randn(m, hidden, dtype=dtype, gen=gen) * 0.5, _randn(vocab, hidden, dtype=dtype, gen=gen) * 0.1
    bias = _randn(vocab, dtype=dtype, gen=gen)
    labels = torch.randint(0, vocab, (m,), generator=gen)
    labels[::5] = -100
    labels, grad = labels.to(DEV), torch.tensor(0.5, device=DEV)

    def forward():
        loss, lse, correct, softmax = M.mlm_logits_gemm_fwd(x, w, bias, labels)
        return (loss, lse, correct, softmax.u, softmax.c), softmax

    def backward(softmax):  # the input gradient's vocabulary split in two: its partials summed
        return M.mlm_softmax_gemms_bwd(softmax, labels, x, w, grad, dtype, True, 2)
    return forward, backward


def embeddings(dtype):
    gen = torch.Generator().manual_seed(16)
    hidden, vocab, positions = HIDDEN, 50, 32
    ids = torch.randint(0, vocab, (ROWS,), generator=gen).to(DEV)
    pos = (torch.arange(ROWS) % positions).to(DEV)
    types = torch.randint(0, 2, (ROWS,), generator=gen).to(DEV)
    tables = (_randn(vocab, hidden, gen=gen), _randn(positions, hidden, gen=gen), _randn(2, hidden, gen=gen))
    w, b = _randn(hidden, gen=gen), _randn(hidden, gen=gen)
    dy = _randn(ROWS, hidden, dtype=dtype, gen=gen)
    seed = torch.tensor([5], dtype=torch.int64, device=DEV)

    def forward():
        fwd = E.embeddings_fwd(ids, pos, types, *tables, w, b, 1e-12, 0.1, seed, dtype)
        return fwd, fwd

    def backward(fwd):
        _, mean, rstd = fwd
        return E.embeddings_bwd(dy, ids, pos, types, *tables, w, b, mean, rstd, 0.1, seed)
    return forward, backward


def mlm_head_loss(dtype):
    gen = torch.Generator().manual_seed(17)
    logits = _randn(37, 1000, dtype=dtype, gen=gen) * 3  # rows: masked tokens; a vocabulary past one tile
    labels = torch.randint(0, 1000, (37,), generator=gen)
    labels[::5] = -100
    labels = labels.to(DEV)

    def forward():
        grad = logits.clone()  # overwritten by its gradient
        return (M.mlm_head_loss_fwd(grad, labels, 0.5, True)[:2], grad), None
    return forward, None


# --------------------------------------------------------------------------- the tests
# Stage 2 of the GPU check (-m "gpu or gpu_capable") runs BERT's training configurations: bf16, dropout
# 0.1 (about 55 candidates compiled beyond the first ones, which its other tests compile; stage 3's
# autotuner then finds many in Triton's cache). The rest run wherever the whole suite does.
GPU_CHECK = pytest.mark.gpu_capable
ATTENTION = {
    # (dtype, lengths, path): the one-pass backward where its lengths reach, else the three kernels or
    # the atomic dQ (forced: FUSED_BWD_MAX_SEQLEN 0)
    "bf16-one-pass": (BF16, [50, 100], "one-pass"),
    "bf16-three-kernel": (BF16, [50, 100], "three-kernel"),
    "bf16-atomic-dq": (BF16, [50, 100], "atomic"),
    "fp32-one-pass": (FP32, [20, 32], "one-pass"),
    "fp32-three-kernel": (FP32, [20, 45], "three-kernel"),  # fp32's tiles are at most 32: a bucket of 64
}
BACKWARD_KERNEL = {"one-pass": "_attention_bwd_fused_kernel", "three-kernel": "_attention_bwd_dkdv_kernel",
                   "atomic": "_attention_bwd_dkdv_atomic_dq_kernel"}


@pytest.mark.parametrize("setting, dropout_p", [
    pytest.param(s, p, id=f"{s}-{p}", marks=[GPU_CHECK] if ATTENTION[s][0] == BF16 and p else [])
    for s in ATTENTION for p in (0.0, 0.1)])
def test_every_attention_candidate_matches_the_first(setting, dropout_p, on_gpu_path, monkeypatch):
    """The varlen form (the encoder's), with the QKV bias gradient as training asks for it."""
    dtype, lengths, path = ATTENTION[setting]
    if path != "one-pass":
        monkeypatch.setattr(K, "FUSED_BWD_MAX_SEQLEN", {False: 0, True: 0})
    if path == "atomic":
        monkeypatch.setenv(K.DQ_ENV, "atomic")
    listed, bad = every_candidate_matches_the_first(attention_varlen(dtype, lengths, dropout_p), dtype)
    assert not bad, "\n".join(bad)
    assert {"_attention_fwd_kernel", BACKWARD_KERNEL[path]} <= set(listed)
    assert len(listed["_attention_fwd_kernel"]) > 1
    if setting == "bf16-one-pass" and dropout_p:  # BERT's phase 1: the PERSISTENT candidate among them
        assert any("PERSISTENT=True" in c for c in listed[BACKWARD_KERNEL[path]]), listed


@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16", marks=GPU_CHECK), pytest.param(FP32, id="fp32")])
def test_every_padded_attention_candidate_matches_the_first(dtype, on_gpu_path):
    """The padded form with a key mask: its forward and (at these lengths) one-pass backward."""
    lengths = [50, 100] if dtype == BF16 else [20, 32]
    listed, bad = every_candidate_matches_the_first(attention_padded(dtype, lengths, 0.1), dtype)
    assert not bad, "\n".join(bad)
    assert {"_attention_fwd_kernel", "_attention_bwd_fused_kernel"} <= set(listed)


ROW_OPS = {"layernorm": layernorm, "bias_gelu": bias_gelu, "embeddings": embeddings, "mlm_head_loss": mlm_head_loss}


@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16", marks=GPU_CHECK), pytest.param(FP32, id="fp32")])
@pytest.mark.parametrize("op", list(ROW_OPS))
def test_every_row_kernel_candidate_matches_the_first(op, dtype, on_gpu_path):
    listed, bad = every_candidate_matches_the_first(ROW_OPS[op](dtype), dtype)
    assert not bad, "\n".join(bad)
    assert max(len(configs) for configs in listed.values()) > 1, listed


@GPU_CHECK
def test_every_ffn_gemm_candidate_matches_the_first(on_gpu_path):
    listed, bad = every_candidate_matches_the_first(ffn_gemms(BF16), BF16)
    assert not bad, "\n".join(bad)
    assert set(listed) == {"_gemm_bias_gelu_kernel"} and len(listed["_gemm_bias_gelu_kernel"]) > 1


@GPU_CHECK
def test_every_decoder_gemm_candidate_matches_the_first(on_gpu_path):
    listed, bad = every_candidate_matches_the_first(fused_decoder(BF16), BF16)
    assert not bad, "\n".join(bad)
    gemms = {"_mlm_logits_gemm_kernel", "_softmax_dx_gemm_kernel", "_softmax_dw_gemm_kernel"}
    assert set(listed) == gemms and all(len(listed[name]) > 1 for name in gemms)


def test_a_wrong_candidate_is_named(on_gpu_path, monkeypatch, tmp_path):
    """The check can fail: a call whose result changes under bias_gelu's forward's second candidate (as
    one that left a row's last column unwritten would) is named with that candidate's config, and recorded
    for BERTFAST_EXCLUDE_CANDIDATES, which then leaves it out."""
    gen = torch.Generator().manual_seed(18)
    x, bias = _randn(ROWS, FFN, gen=gen), _randn(FFN, gen=gen)

    def forward():
        y = G.bias_gelu_fwd(x, bias)
        if _common._PINNED.get("_bias_gelu_fwd_kernel") == 1:
            y[-1, -1] = 0.0
        return y, None
    failures = tmp_path / "failed-candidates.txt"
    monkeypatch.setenv(FAILURES_ENV, str(failures))
    listed, bad = every_candidate_matches_the_first((forward, None), FP32)
    assert len(listed["_bias_gelu_fwd_kernel"]) > 1
    second = listed["_bias_gelu_fwd_kernel"][1]
    assert len(bad) == 1 and bad[0].startswith(f"_bias_gelu_fwd_kernel candidate 1 ({second}): output 0 off by "), bad
    # the record is what BERTFAST_EXCLUDE_CANDIDATES takes: with it, that candidate is no kernel's to run
    assert failures.read_text() == f"_bias_gelu_fwd_kernel:{second}\n"
    monkeypatch.setenv(_common.EXCLUDE_ENV, failures.read_text().strip())
    monkeypatch.delenv(FAILURES_ENV)
    listed, bad = every_candidate_matches_the_first((forward, None), FP32)
    assert not bad and second not in listed["_bias_gelu_fwd_kernel"]
