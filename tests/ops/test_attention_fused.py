"""attention: what is particular to the fused backends (Triton, CUDA), beyond the contract.

The contract on every backend is tests/ops/test_attention.py (dropout: test_attention_dropout.py,
GPU sizes: test_attention_gpu_sizes.py); this file takes its inputs and its checks against the
reference (check_varlen, check_padded: fed the backend's own dropout mask) from there. Here: the
Triton and CUDA launchers validate their own arguments (the torch backend's are reached only through
the op, which validates); without a GPU, Triton's autotuned launch path runs under the interpreter
and its dropout mask does not depend on block sizes; CUDA runs bf16 on the CPU emulator (the
interpreter's bf16 is wrong), and the CUDA wrappers' validation runs on CPU tensors (cuda_on_cpu,
tests/ops/conftest.py).
"""
import pytest
import torch

from bertfast.testing import BackendUnderTest, check_close, references
from test_attention import (A, BF16, FP16, FP32, PADDED, VARLEN, check_padded, check_varlen, key_mask,
                            lengths_of, padded_inputs, seed_of, varlen_inputs)
from test_philox import philox4x32_numpy

GPU = torch.cuda.is_available()
NO_KEEP = torch.empty(0, dtype=torch.uint8)  # keep bits of a forward without dropout


def unpack_keep_bits(bits, seqlen):
    """Triton's keep bits [B, A, L / 2, L / 4] as the bool mask [B, A, seqlen, seqlen] they record, written
    out from kernels/attention.py's header ("Keep bits"): bit 4h + 2w + e of byte (8R + r, 4C + q) is
    element (16R + 8h + r, 16C + 8w + 2q + e)."""
    batch, heads, half, _ = bits.shape
    length = 2 * half
    flags = torch.stack([(bits.cpu().to(torch.int32) >> k) & 1 for k in range(8)], -1).bool()
    flags = flags.view(batch, heads, length // 16, 8, length // 16, 4, 2, 2, 2)  # [..., R, r, C, q, h, w, e]
    flags = flags.permute(0, 1, 2, 6, 3, 4, 7, 5, 8)                              # [..., R, h, r, C, w, q, e]
    return flags.reshape(batch, heads, length, length)[:, :, :seqlen, :seqlen]


def pack_keep_bits(keep, length):
    """The keep bits [B, A, L / 2, L / 4] (L = ``length``) of mask ``keep`` [B, A, S, S] packed in torch, the
    inverse of unpack_keep_bits (0 past S)."""
    batch, heads, seqlen, _ = keep.shape
    full = torch.zeros(batch, heads, length, length, dtype=torch.int32)
    full[:, :, :seqlen, :seqlen] = keep.cpu().to(torch.int32)
    full = full.view(batch, heads, length // 16, 2, 8, length // 16, 2, 4, 2)  # [..., R, h, r, C, w, q, e]
    full = full.permute(0, 1, 2, 4, 5, 7, 3, 6, 8)                             # [..., R, r, C, q, h, w, e]
    weights = 1 << torch.arange(8, dtype=torch.int32)                          # bit 4h + 2w + e
    return (full.reshape(batch, heads, length // 2, length // 4, 8) * weights).sum(-1).to(torch.uint8)


def assert_bits_record(bits, keep, lengths):
    """The keep bits hold mask ``keep`` [B, A, S, S] on each sequence's own [len, len] block (the bytes
    past a sequence's end are not defined)."""
    recorded = unpack_keep_bits(bits, keep.shape[-1])
    for b, length in enumerate(lengths):
        assert torch.equal(recorded[b, :, :length, :length], keep[b, :, :length, :length].cpu()), f"sequence {b}"


def assert_all_kept_gradients(impl, q, k, v, dout, cu, max_len, p, seed, lse, bits, atol):
    """A backend's varlen backward handed keep bits that keep everything gives the gradients of the
    all-kept mask (still scaled by 1 / (1 - p)): the reference's, fp32."""
    from bertfast import reference as R

    every = torch.ones((cu.shape[0] - 1, q.shape[1], max_len, max_len), dtype=torch.bool)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out_every = R.attention_varlen(*leaves, cu, max_len, None, p, every)  # (the backward's delta reads it)
    out_every.backward(dout)
    dqkv = impl.attention_varlen_bwd(dout, q, k, v, out_every.detach(), lse, cu, max_len, None, p, seed,
                                     torch.full_like(bits, 255))
    for i, leaf in enumerate(leaves):
        torch.testing.assert_close(dqkv[:, i], leaf.grad, atol=atol, rtol=1e-4)


# =========================================================================== launchers (Triton and CUDA)
def test_launcher_errors_are_clear(fused_backend):
    impl = fused_backend.module(VARLEN)
    dev = fused_backend.device
    q = torch.randn(10, A, 32, device=dev)
    cu = torch.tensor([0, 10], dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="head dim"):
        impl.attention_varlen_fwd(q[..., :4], q[..., :4], q[..., :4], cu, 10, 0.1, 0.0, None)
    with pytest.raises(ValueError, match="k: expected dtype"):
        impl.attention_varlen_fwd(q, q.half(), q, cu, 10, 0.1, 0.0, None)
    with pytest.raises(ValueError, match="cu_seqlens: expected dtype"):
        impl.attention_varlen_fwd(q, q, q, cu.long(), 10, 0.1, 0.0, None)
    with pytest.raises(ValueError, match="max_seqlen"):
        impl.attention_varlen_fwd(q, q, q, cu, 10.0, 0.1, 0.0, None)
    with pytest.raises(ValueError, match="softmax_scale"):
        impl.attention_varlen_fwd(q, q, q, cu, 10, 0.0, 0.0, None)
    with pytest.raises(ValueError, match="dropout_p"):
        impl.attention_varlen_fwd(q, q, q, cu, 10, 0.1, 1.0, torch.tensor([1], device=dev))
    with pytest.raises(ValueError, match="seed"):
        impl.attention_varlen_fwd(q, q, q, cu, 10, 0.1, 0.1, None)
    qt = torch.randn(10, 32, A, device=dev).transpose(1, 2)
    with pytest.raises(ValueError, match="contiguous last"):
        impl.attention_varlen_fwd(qt, qt, qt, cu, 10, 0.1, 0.0, None)
    with pytest.raises(ValueError, match=r"lse: expected shape \(2, 10\)"):
        impl.attention_varlen_bwd(q, q, q, q, q, torch.zeros(10, A, device=dev), cu, 10, 0.1, 0.0, None, NO_KEEP)
    qp = torch.randn(2, 5, A, 32, device=dev)
    padded = fused_backend.module(PADDED)
    with pytest.raises(ValueError, match="key_padding_mask"):
        padded.attention_padded_fwd(qp, qp, qp, torch.ones(2, 4, device=dev), 0.1, 0.0, None)
    with pytest.raises(ValueError, match="bool or integer"):
        padded.attention_padded_fwd(qp, qp, qp, torch.ones(2, 5, device=dev), 0.1, 0.0, None)
    with pytest.raises(ValueError, match="num_heads"):
        padded.attention_padded_dropout_mask(2, 5, -1, 0.1, torch.tensor([1], device=dev))


# =========================================================================== Triton
@pytest.fixture(params=["one-pass", "one-pass-persistent", "three-kernel", "atomic-dq"])
def triton_backward(request, monkeypatch):
    """Triton's attention backward as each path runs it: the one-pass kernel (what sequences up to
    FUSED_BWD_MAX_SEQLEN take, so every short test), the same with a few programs taking every
    (sequence, head) in turn (its PERSISTENT candidate; under the interpreter, in place of its usual
    blocks), the three kernels (longer ones) or, under BERTFAST_ATTENTION_DQ=atomic, the delta and
    dK/dV kernels with dQ added atomically, forced."""
    from bertfast.kernels import attention as K

    monkeypatch.delenv(K.DQ_ENV, raising=False)
    if request.param == "one-pass-persistent":
        if GPU:
            pytest.skip("the interpreter's blocks: on a GPU the tuned and forced candidates are tested")
        monkeypatch.setitem(K._INTERP, "fused", dict(K._INTERP["fused"], PERSISTENT=True, ITEM_STAGES=2))
    elif request.param != "one-pass":
        monkeypatch.setattr(K, "FUSED_BWD_MAX_SEQLEN", {False: 0, True: 0})
    if request.param == "atomic-dq":
        monkeypatch.setenv(K.DQ_ENV, "atomic")
    return request.param


@pytest.mark.skipif(GPU, reason="on a GPU every Triton attention test takes this path")
def test_triton_autotuned_launch_path_under_interpreter(stand_in_tuner, triton_backward):
    """Each pruned candidate runs once on the real buffers (pure outputs) and the best is relaunched."""
    from bertfast.kernels import attention as K

    tuned = {"one-pass": (K._fwd_tuned, K._bwd_fused_tuned), "one-pass-persistent": (K._fwd_tuned, K._bwd_fused_tuned),
             "three-kernel": (K._fwd_tuned, K._bwd_dkdv_tuned, K._bwd_dq_tuned),
             "atomic-dq": (K._fwd_tuned, K._bwd_dkdv_atomic_dq_tuned)}[triton_backward]
    stand_in_tuner(*tuned)
    triton = BackendUnderTest("triton", torch.device("cpu"))
    lengths = torch.tensor([9, 20])
    q, k, v, dout, cu = varlen_inputs(triton, lengths, seed=18)
    check_varlen(triton, q, k, v, dout, cu, 20, p=0.2, seed=seed_of(triton, 5))
    q, k, v, dout = padded_inputs(triton, 2, 20, seed=18)
    check_padded(triton, q, k, v, dout, key_mask("scattered", 2, 20, seed=18))
    for kernel in tuned:
        assert len(kernel.cache) == 2  # one tuning key per form


def _launched(monkeypatch, call):
    """The names of the kernels ``call`` launches (recorded, nothing runs)."""
    from bertfast.kernels import _common

    names = []
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    with _common.compile_only(lambda fn, *rest: names.append(fn.__name__)):
        call()
    return names


@pytest.mark.parametrize("seqlen,dtype,head_dim,one_pass", [
    (128, BF16, 64, True), (129, BF16, 64, False), (128, FP16, 26, True), (128, BF16, 80, False),
    (32, FP32, 64, True), (33, FP32, 64, False), (1, FP32, 8, True)])
def test_triton_backward_takes_one_pass_up_to_its_limits(monkeypatch, seqlen, dtype, head_dim, one_pass):
    """Sequences up to FUSED_BWD_MAX_SEQLEN (128; fp32 32) at head dims up to 64 take the one-pass
    kernel, whose key tile holds the whole sequence; the others the three kernels."""
    from bertfast.kernels import attention as K

    q = torch.empty(2 * seqlen, 3, 2, head_dim, dtype=dtype).unbind(1)
    cu = torch.tensor([0, seqlen, 2 * seqlen], dtype=torch.int32)
    lse = torch.empty(2, 2 * seqlen)
    names = _launched(monkeypatch, lambda: K.attention_varlen_bwd(q[0], *q, q[0], lse, cu, seqlen, None, 0.0, None,
                                                                  NO_KEEP))
    backward = [n for n in names if n != "_attention_outside_rows_kernel"]
    assert backward == (["_attention_bwd_fused_kernel"] if one_pass else
                        ["_attention_bwd_delta_kernel", "_attention_bwd_dq_kernel", "_attention_bwd_dkdv_kernel"])
    assert K.fused_backward(seqlen, head_dim, dtype) is one_pass
    assert K.fused_block_n(seqlen) >= seqlen


@pytest.mark.parametrize("mode,deterministic,kernels", [
    ("atomic", False, ["_attention_bwd_delta_kernel", "_attention_bwd_dkdv_atomic_dq_kernel",
                       "_attention_bwd_dq_store_kernel"]),
    ("atomic", True, ["_attention_bwd_delta_kernel", "_attention_bwd_dq_kernel", "_attention_bwd_dkdv_kernel"]),
    ("deterministic", False, ["_attention_bwd_delta_kernel", "_attention_bwd_dq_kernel",
                              "_attention_bwd_dkdv_kernel"])])
def test_triton_backward_adds_dq_atomically_when_asked(monkeypatch, mode, deterministic, kernels):
    """BERTFAST_ATTENTION_DQ=atomic (header, "Atomic dQ") replaces the dQ kernel past the one-pass
    kernel's lengths, unless torch.use_deterministic_algorithms is on; the one-pass kernel is unchanged,
    `bertfast info` says which runs, and a value it does not know is refused by name."""
    from bertfast.info import report
    from bertfast.kernels import attention as K

    monkeypatch.setenv(K.DQ_ENV, mode)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic)

    def names(seqlen):
        q = torch.empty(2 * seqlen, 3, 2, 64, dtype=BF16).unbind(1)
        cu = torch.tensor([0, seqlen, 2 * seqlen], dtype=torch.int32)
        lse = torch.empty(2, 2 * seqlen)
        launched = _launched(monkeypatch, lambda: K.attention_varlen_bwd(q[0], *q, q[0], lse, cu, seqlen, None, 0.0,
                                                                         None, NO_KEEP))
        return [n for n in launched if n != "_attention_outside_rows_kernel"]

    assert names(129) == kernels
    assert names(128) == ["_attention_bwd_fused_kernel"]
    expected = "deterministic" if deterministic else mode
    assert f"Triton attention dQ (sequences over 128 tokens): {expected} (" in report()
    monkeypatch.setenv(K.DQ_ENV, "fast")
    with pytest.raises(ValueError, match="BERTFAST_ATTENTION_DQ: expected one of deterministic, atomic, got 'fast'"):
        names(129)
    assert "Triton attention dQ: BERTFAST_ATTENTION_DQ: expected one of" in report()


@pytest.mark.parametrize("form", [VARLEN, PADDED])
def test_triton_atomic_dq_adds_every_key_block(monkeypatch, form):
    """The atomic dQ sums its rows over several key blocks a sequence (70 tokens in blocks of 32 under the
    interpreter), with dropout, padding keys, a padded head dim and the QKV bias gradient, against the
    reference and the deterministic path (the same to fp32 rounding: other orders of addition)."""
    from bertfast.kernels import attention as K

    dev = torch.device("cuda" if GPU else "cpu")
    triton = BackendUnderTest("triton", dev)
    seed, p = seed_of(triton, 21), 0.2
    monkeypatch.setenv(K.DQ_ENV, "atomic")
    if form == VARLEN:
        lengths = torch.tensor([70, 33, 0, 5])
        q, k, v, dout, cu = varlen_inputs(triton, lengths, FP32, 26, extra=2, seed=14)
        *_, atomic = check_varlen(triton, q, k, v, dout, cu, 70, p=p, seed=seed)
        monkeypatch.setenv(K.DQ_ENV, "deterministic")
        *_, plain = check_varlen(triton, q, k, v, dout, cu, 70, p=p, seed=seed)
    else:
        q, k, v, dout = padded_inputs(triton, 3, 70, FP32, 32, seed=14)
        mask = key_mask("scattered", 3, 70, seed=14)
        *_, atomic = check_padded(triton, q, k, v, dout, mask, p=p, seed=seed)
        monkeypatch.setenv(K.DQ_ENV, "deterministic")
        *_, plain = check_padded(triton, q, k, v, dout, mask, p=p, seed=seed)
        atomic, plain = torch.stack(atomic, 2), torch.stack(plain, 2)
    torch.testing.assert_close(atomic, plain, atol=5e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", ["deterministic", "atomic"])
def test_triton_backward_grids_cover_every_block(monkeypatch, mode):
    """Each backward kernel's grid, at every candidate config, has a program per block of its own
    axis: dQ per query block (BLOCK_M), dK/dV per key block (BLOCK_N), a sequence head and batch row
    each (the interpreter's tiles are alike, so its tests would not see a grid of the other axis)."""
    from bertfast.kernels import _common, attention as K

    monkeypatch.setenv(K.DQ_ENV, mode)
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    seqlen, heads, grids = 300, 2, []
    q = torch.empty(2 * seqlen, 3, heads, 64, dtype=BF16).unbind(1)
    cu = torch.tensor([0, seqlen, 2 * seqlen], dtype=torch.int32)

    def record(fn, grid, args, consts, configs, key):
        for config in configs:
            meta = dict(consts, **(config.all_kwargs() if config is not None else {}))
            grids.append((fn.__name__, meta, grid(meta) if callable(grid) else grid))
    with _common.compile_only(record):
        K.attention_varlen_bwd(q[0], *q, q[0], torch.empty(heads, 2 * seqlen), cu, seqlen, None, 0.0, None, NO_KEEP)
    axis = {"_attention_bwd_dq_kernel": "BLOCK_M", "_attention_bwd_dkdv_kernel": "BLOCK_N",
            "_attention_bwd_dkdv_atomic_dq_kernel": "BLOCK_N"}
    checked = [name for name, meta, grid in grids if name in axis]
    assert set(checked) == ({"_attention_bwd_dkdv_atomic_dq_kernel"} if mode == "atomic" else
                            {"_attention_bwd_dq_kernel", "_attention_bwd_dkdv_kernel"})
    for name, meta, grid in grids:
        if name in axis:
            assert tuple(grid) == (-(-seqlen // meta[axis[name]]), heads, 2), (name, meta)


@pytest.mark.parametrize("form, head_dim, switch, offered", [("varlen", 64, None, True), ("varlen", 64, "0", False),
                                                              ("varlen", 32, None, False), ("padded", 64, None, False)])
def test_triton_persistent_one_pass_candidate_only_where_it_compiles_without_spills(monkeypatch, form, head_dim,
                                                                                      switch, offered):
    """The one-pass backward's PERSISTENT candidate is tuned for the varlen form at head dim 64 only
    (elsewhere it spilled: kernels/attention.py, PERSISTENT_HEAD_DIM), unless BERTFAST_ATTENTION_PERSISTENT=0,
    after the first candidate, which the fixed mode runs; its grid is a program per SM (3 off a GPU),
    the others' a program per pair."""
    from bertfast.kernels import _common, attention as K

    monkeypatch.setattr(_common, "interpreting", lambda: False)
    if switch is None:
        monkeypatch.delenv(K.PERSISTENT_ENV, raising=False)
    else:
        monkeypatch.setenv(K.PERSISTENT_ENV, switch)
    seqlen, heads, batch, got = 128, 2, 2, []

    def record(fn, grid, args, consts, configs, key):
        if fn.__name__ == "_attention_bwd_fused_kernel":
            got.extend((bool(c.kwargs.get("PERSISTENT")), grid(dict(consts, **c.all_kwargs()))) for c in configs)
    with _common.compile_only(record):
        if form == "varlen":
            q = torch.empty(batch * seqlen, 3, heads, head_dim, dtype=BF16).unbind(1)
            cu = torch.tensor([0, seqlen, 2 * seqlen], dtype=torch.int32)
            K.attention_varlen_bwd(q[0], *q, q[0], torch.empty(heads, batch * seqlen), cu, seqlen, None, 0.0, None,
                                   NO_KEEP)
        else:
            q = torch.empty(batch, seqlen, 3, heads, head_dim, dtype=BF16).unbind(2)
            K.attention_padded_bwd(q[0], *q, q[0], torch.empty(batch, heads, seqlen), None, None, 0.0, None, NO_KEEP)
    assert got and not got[0][0]
    assert [grid for persistent, grid in got if persistent] == ([(3,)] if offered else [])
    assert all(grid == (1, heads, batch) for persistent, grid in got if not persistent)


@pytest.mark.skipif(GPU, reason="sets the interpreter's blocks")
def test_triton_persistent_one_pass_sums_the_bias_gradient_per_pair_of_query_blocks(monkeypatch):
    """The PERSISTENT one-pass backward writes the QKV bias gradient's dQ sums a row per two query blocks
    and none past a sequence's end: with 16-query blocks, sequences of 70 and 66 tokens run 8 blocks
    (128 keys), 4 pairs, where each sequence has 3 rows, so the pair past each end must not write into
    the next sequence's rows (or past the last: without the check the interpreter's process aborts).
    dqkv and the bias gradient as the first candidate's."""
    from bertfast.kernels import attention as K

    triton = BackendUnderTest("triton", torch.device("cpu"))
    lengths = torch.tensor([70, 5, 0, 66])
    q, k, v, dout, cu = varlen_inputs(triton, lengths, FP16, 32, seed=3)
    seed = seed_of(triton, 4)
    out, lse, bits = K.attention_varlen_fwd(q, k, v, cu, 70, None, 0.1, seed)
    plain = K.attention_varlen_bwd(dout, q, k, v, out, lse, cu, 70, None, 0.1, seed, bits, FP32)
    monkeypatch.setitem(K._INTERP, "fused", dict(K._INTERP["fused"], PERSISTENT=True, ITEM_STAGES=2))
    assert K.bias_grad_rows(70, 32, FP16) == 3  # pairs of 16 queries
    persistent = K.attention_varlen_bwd(dout, q, k, v, out, lse, cu, 70, None, 0.1, seed, bits, FP32)
    torch.testing.assert_close(persistent[0], plain[0], atol=0, rtol=0)
    torch.testing.assert_close(persistent[1], plain[1], atol=1e-5, rtol=1e-5)


PATH_CASES = {  # up to 30 tokens: the one-pass kernel's fp32 limit is 32
    "varlen-fp32": ("varlen", "random", FP32, 32, 0.0),
    "varlen-empty-dropout": ("varlen", "empty", FP32, 32, 0.2),  # zero-length sequences, one 30 long
    "varlen-fp16-dropout-d26": ("varlen", "random", FP16, 26, 0.1),
    "padded-scattered-dropout": ("padded", "scattered", FP32, 32, 0.2),  # keys anywhere, one sequence all pads
    "padded-fp16": ("padded", "random", FP16, 16, 0.0),
}


@pytest.mark.parametrize("case", list(PATH_CASES))
def test_triton_backward_paths_match_the_reference(triton_backward, case):
    """Both backward paths, forced, against the reference (fed the kernels' own mask): tails of query
    blocks, padding keys, empty sequences and rows, a padded head dim, dropout."""
    form, kind, dtype, head_dim, p = PATH_CASES[case]
    triton = BackendUnderTest("triton", torch.device("cuda" if GPU else "cpu"))
    seed = seed_of(triton, 31) if p else None
    if form == "varlen":
        lengths = lengths_of(kind, 3, 30, seed=4)
        q, k, v, dout, cu = varlen_inputs(triton, lengths, dtype, head_dim, seed=4)
        check_varlen(triton, q, k, v, dout, cu, 30, p=p, seed=seed)
    else:
        q, k, v, dout = padded_inputs(triton, 3, 30, dtype, head_dim, seed=4)
        check_padded(triton, q, k, v, dout, key_mask(kind, 3, 30, seed=4), p=p, seed=seed)


@pytest.mark.parametrize("dtype", [FP32, FP16], ids=["fp32", "fp16"])
def test_triton_qkv_bias_gradient_from_the_backward_kernels(triton_backward, dtype):
    """Each backward path sums the QKV bias gradient from its registers (kernels/attention.py, "QKV bias
    gradient"): the column sums of dqkv in the dtype asked for, with empty sequences, a padded head dim,
    dropout and rows after the last sequence, and dqkv bit for bit as without it."""
    from bertfast.kernels import attention as K
    from test_attention import check_bias_grad

    dev = torch.device("cuda" if GPU else "cpu")
    triton = BackendUnderTest("triton", dev)
    seed, p = seed_of(triton, 12), 0.2
    lengths = torch.tensor([30, 0, 17, 1])
    q, k, v, dout, cu = varlen_inputs(triton, lengths, FP32, 26, extra=3, seed=9)
    out, lse, bits = K.attention_varlen_fwd(q, k, v, cu, 30, None, p, seed)
    plain = K.attention_varlen_bwd(dout, q, k, v, out, lse, cu, 30, None, p, seed, bits)
    dqkv, dbias = K.attention_varlen_bwd(dout, q, k, v, out, lse, cu, 30, None, p, seed, bits, dtype)
    assert torch.equal(dqkv, plain)
    check_bias_grad(dbias, dqkv, dtype)
    with pytest.raises(ValueError, match="bias_dtype: expected one of"):
        K.attention_varlen_bwd(dout, q, k, v, out, lse, cu, 30, None, p, seed, bits, torch.int32)


def test_triton_backward_paths_agree(monkeypatch):
    """The one-pass kernel and the three kernels: the same gradients to fp32 rounding (delta from the
    score rows or from dO . O, the products summed in other orders), with dropout and padding keys."""
    from bertfast.kernels import attention as K

    dev = torch.device("cuda" if GPU else "cpu")
    triton = BackendUnderTest("triton", dev)
    seed, p = seed_of(triton, 8), 0.25
    q, k, v, dout = padded_inputs(triton, 3, 30, FP32, 32, seed=6)
    mask = key_mask("random", 3, 30, seed=6).to(dev)
    out, lse, bits = K.attention_padded_fwd(q, k, v, mask, None, p, seed)
    one_pass = K.attention_padded_bwd(dout, q, k, v, out, lse, mask, None, p, seed, bits)
    monkeypatch.setattr(K, "FUSED_BWD_MAX_SEQLEN", {False: 0, True: 0})
    three = K.attention_padded_bwd(dout, q, k, v, out, lse, mask, None, p, seed, bits)
    for name, a, b in zip(("dq", "dk", "dv"), one_pass, three):
        torch.testing.assert_close(a, b, atol=5e-6, rtol=1e-5, msg=name)


@pytest.mark.skipif(GPU, reason="sets the interpreter's block sizes")
def test_triton_dropout_does_not_depend_on_block_sizes(monkeypatch):
    """The mask is a pure function of (seed, sequence, head, row, column): other blocks, same mask,
    the same keep bits from a 16 x 16 and a 32 x 64 forward tile, and the same gradients from either."""
    from bertfast.kernels import attention as K

    triton = BackendUnderTest("triton", torch.device("cpu"))
    seed, p = seed_of(triton, 99), 0.3
    q, k, v, dout, cu = varlen_inputs(triton, torch.tensor([37, 6]), seed=19)
    keep = K.attention_varlen_dropout_mask(cu, 37, A, p, seed)
    out, lse, bits = K.attention_varlen_fwd(q, k, v, cu, 37, None, p, seed)
    monkeypatch.setitem(K._INTERP, "mask", {"BLOCK_M": 32, "BLOCK_N": 16})
    monkeypatch.setitem(K._INTERP, "fwd", {"BLOCK_M": 32, "BLOCK_N": 64})
    assert torch.equal(keep, K.attention_varlen_dropout_mask(cu, 37, A, p, seed))
    out2, lse2, bits2 = K.attention_varlen_fwd(q, k, v, cu, 37, None, p, seed)
    assert_bits_record(bits, keep, [37, 6])
    assert_bits_record(bits2, keep, [37, 6])
    grads = [K.attention_varlen_bwd(dout, q, k, v, out, lse, cu, 37, None, p, seed, b) for b in (bits, bits2)]
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)
    # Other blocks round differently; one mask bit flipped would move an output by ~0.1.
    torch.testing.assert_close(out2, out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse2, lse, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(GPU, reason="the interpreter's launch configuration")
def test_triton_backward_reads_the_forwards_keep_bits(triton_backward):
    """Every backward kernel takes the mask from the keep bits, not from the seed: handed bits that keep
    everything, they give the gradients of the all-kept mask (still scaled by 1 / (1 - p)); handed none,
    or bits of another shape, they refuse."""
    from bertfast.kernels import attention as K

    triton = BackendUnderTest("triton", torch.device("cpu"))
    seed, p = seed_of(triton, 3), 0.2
    lengths = [30, 6]  # within the one-pass kernel's fp32 limit
    q, k, v, dout, cu = varlen_inputs(triton, torch.tensor(lengths), seed=22)
    out, lse, bits = K.attention_varlen_fwd(q, k, v, cu, 30, None, p, seed)
    assert bits.dtype == torch.uint8 and bits.shape == K.dropout_keep_shape(2, A, 30, p) == (2, A, 64, 32)
    assert_bits_record(bits, K.attention_varlen_dropout_mask(cu, 30, A, p, seed), lengths)

    assert_all_kept_gradients(K, q, k, v, dout, cu, 30, p, seed, lse, bits, atol=1e-5)

    with pytest.raises(ValueError, match=r"keep: expected shape \(2, 2, 64, 32\), got \(0,\)"):
        K.attention_varlen_bwd(dout, q, k, v, out, lse, cu, 30, None, p, seed, NO_KEEP)
    with pytest.raises(ValueError, match="keep: expected dtype"):
        K.attention_varlen_bwd(dout, q, k, v, out, lse, cu, 30, None, p, seed, bits.to(torch.int32))


@pytest.mark.gpu_capable
@pytest.mark.parametrize("dtype", [FP32, FP16, BF16], ids=["fp32", "fp16", "bf16"])
def test_triton_keep_bits_round_trip(dtype, triton_backward):
    """Each half of the keep bits alone, in each of its two implementations (fp32 draws its bytes and
    gathers them back element by element; fp16/bf16 pack the dropped tile and read it back in registers):
    the forward's bits hold the drawn mask, and the backward reading bits packed in torch from that mask
    gives the reference's gradients, then the same as from the forward's own bits. (The H200 run of
    2026-11-27 found fp32 gradients with dropout wrong and could not say which half was.)"""
    from bertfast import reference as R
    from bertfast.kernels import attention as K

    if dtype == BF16 and not GPU:
        pytest.skip("the interpreter's bf16 is wrong: Triton bf16 runs in the GPU tests")
    triton = BackendUnderTest("triton", torch.device("cuda" if GPU else "cpu"))
    seed, p = seed_of(triton, 31), 0.25
    lengths = [30, 6, 17] if triton_backward == "one-pass" else [77, 6, 30]
    max_len = max(lengths)
    q, k, v, dout, cu = varlen_inputs(triton, torch.tensor(lengths), dtype, seed=24)
    out, lse, bits = K.attention_varlen_fwd(q, k, v, cu, max_len, None, p, seed)
    keep = K.attention_varlen_dropout_mask(cu, max_len, A, p, seed)
    assert_bits_record(bits, keep, lengths)

    packed = pack_keep_bits(keep, 2 * bits.shape[2]).to(triton.device)
    assert torch.equal(unpack_keep_bits(packed, max_len), keep.cpu())
    dqkv = K.attention_varlen_bwd(dout, q, k, v, out, lse, cu, max_len, None, p, seed, packed)
    fn = lambda q_, k_, v_: R.attention_varlen(q_, k_, v_, cu, max_len, None, p, keep)  # noqa: E731
    (_, g32), (_, glo) = references(fn, [q, k, v], dtype, dout)
    for i, name in enumerate(("dq", "dk", "dv")):
        check_close(name, dqkv[:, i], g32[i], glo[i], dtype, atol=2e-5, rtol=1e-4)
    # The forward's bytes past a sequence's end are not defined, and do not count.
    assert torch.equal(K.attention_varlen_bwd(dout, q, k, v, out, lse, cu, max_len, None, p, seed, bits), dqkv)


@pytest.mark.skipif(GPU, reason="sets the interpreter's launch configuration")
def test_triton_dkdv_orientations_agree(monkeypatch):
    """The three-kernel backward's dK/dV computed keys-major (the mask transposed) and query-major (the
    forward's layout): the same mask, the same gradients (to fp32 rounding: the products run in another
    order)."""
    from bertfast.kernels import attention as K

    monkeypatch.setattr(K, "FUSED_BWD_MAX_SEQLEN", {False: 0, True: 0})
    triton = BackendUnderTest("triton", torch.device("cpu"))
    seed, p = seed_of(triton, 7), 0.25
    q, k, v, dout, cu = varlen_inputs(triton, torch.tensor([37, 6, 20]), seed=21)
    out, lse, bits = K.attention_varlen_fwd(q, k, v, cu, 37, None, p, seed)
    grads = {}
    for query_major in (True, False):
        monkeypatch.setitem(K._INTERP, "dkdv", {"BLOCK_M": 16, "BLOCK_N": 32, "QUERY_MAJOR": query_major})
        grads[query_major] = K.attention_varlen_bwd(dout, q, k, v, out, lse, cu, 37, None, p, seed, bits)
    torch.testing.assert_close(grads[False], grads[True], atol=1e-6, rtol=1e-5)
    assert torch.equal(grads[False][:, 0], grads[True][:, 0])  # dQ: the same kernel


@pytest.mark.parametrize("seed", [12345, 2**40 + 77, -3], ids=["seed", "high-word", "negative"])
def test_dropout_mask_is_the_documented_function(fused_backend, seed):
    """kernels/attention.py's header, written out in numpy, for both fused backends (csrc/attention.cuh
    draws the same mask): Philox4x32-7 keyed by (seed, b * A + h) at counter i * 2**13 + g; column
    32m + 8w + 2q + e is group 4m + q, half e of word w, kept when those 16 bits are >= ceil(p * 2**16).
    Seeds with a high word and negative ones: the stream is added to the key's high word, mod 2**32."""
    import math

    import numpy as np
    from bertfast.kernels import attention as K

    impl = fused_backend.module(PADDED)
    batch, heads, seqlen, p = 2, 3, 40, 0.3
    keep = impl.attention_padded_dropout_mask(batch, seqlen, heads, p, seed_of(fused_backend, seed)).cpu().numpy()
    i, j = np.meshgrid(np.arange(seqlen), np.arange(seqlen), indexing="ij")
    group = (j // 32) * 4 + (j % 8) // 2
    word, half = (j // 8) % 4, j % 2
    threshold = math.ceil(p * 65536)
    for b in range(batch):
        for h in range(heads):
            key = (seed + ((b * heads + h) << 32)) % 2**64
            words = philox4x32_numpy((i * 8192 + group).astype(np.uint64), key, K.N_ROUNDS.value)
            r = np.choose(word, words)
            bits = np.where(half == 1, r >> np.uint64(16), r & np.uint64(0xFFFF))
            np.testing.assert_array_equal(keep[b, h], bits >= threshold, err_msg=f"sequence {b}, head {h}")


MMA_TILES = [(12, FP16), (32, BF16), (64, BF16), (80, FP16), (100, FP16), (128, BF16), (256, FP16)]


@pytest.mark.parametrize("fused_backend", ["cuda"], indirect=True)
@pytest.mark.parametrize("head_dim,dtype", MMA_TILES,
                         ids=[f"d{d}-{'bf16' if t == BF16 else 'fp16'}" for d, t in MMA_TILES])
def test_cuda_mma_kernels_at_every_tile_head_dim(fused_backend, head_dim, dtype):
    """The fp16/bf16 mma.sync and wgmma kernels (forward, dQ, dK/dV; K and V, or Q and dO, double-buffered
    through cp.async) at each tile head dim they compile (16, 32, 64, 96, 128, 256, where the backward runs
    a block per half of the columns; 12, 80 and 100 pad theirs, 12 and 100 copy rows element by element,
    which dQ at 128 does in tiles of its own), with dropout, over several blocks (77 rows: two blocks of 64, or three of 32, the last
    partial) and a short sequence. The forward, dQ and dK/dV at 64 and 128 (16-byte rows) are the wgmma
    kernels on an sm_90 GPU and on the emulator, which emulates one (at 64 the backward takes one pass
    here: test_cuda_one_pass_backward_at_head_dim_64); the next test runs the mma.sync kernels there."""
    lengths = torch.tensor([77, 5])
    q, k, v, dout, cu = varlen_inputs(fused_backend, lengths, dtype, head_dim, heads=1, packed=False, seed=6)
    check_varlen(fused_backend, q, k, v, dout, cu, 77, p=0.1, seed=seed_of(fused_backend, 9))


@pytest.mark.skipif(GPU, reason="a GPU's compute capability is its own: the emulator's is set here")
@pytest.mark.parametrize("fused_backend", ["cuda"], indirect=True)
@pytest.mark.parametrize("head_dim,dtype", [(64, FP16), (128, BF16)], ids=["d64-fp16", "d128-bf16"])
def test_cuda_without_wgmma_is_the_mma_sync_kernels(fused_backend, head_dim, dtype, monkeypatch):
    """On a GPU other than sm_90 (the emulator told it is an A100), the forward, dQ and dK/dV at the tile
    head dims wgmma serves run the mma.sync kernels, which must give the same contract."""
    from bertfast.cuda import _common

    assert _common._C.wgmma_available()  # the emulated sm_90, whose kernels at 64 and 128 are wgmma
    monkeypatch.setenv("BERTFAST_EMU_ARCH", "80")
    assert not _common._C.wgmma_available()
    lengths = torch.tensor([77, 5])
    q, k, v, dout, cu = varlen_inputs(fused_backend, lengths, dtype, head_dim, heads=1, packed=False, seed=6)
    check_varlen(fused_backend, q, k, v, dout, cu, 77, p=0.1, seed=seed_of(fused_backend, 9))


@pytest.mark.parametrize("fused_backend", ["cuda"], indirect=True)
def test_cuda_mma_backward_at_head_dim_256_without_dropout(fused_backend):
    """At tile head dim 256 the mma.sync dQ and dK/dV run two blocks per row block, one per half of the
    gradient's columns (each recomputing S and dP over the whole head); without dropout K and V (and Q,
    dO) are copied 16 bytes at a time (with dropout, dQ's K and V element by element: the tile test)."""
    lengths = torch.tensor([77, 5])
    q, k, v, dout, cu = varlen_inputs(fused_backend, lengths, BF16, 256, heads=1, seed=5)
    check_varlen(fused_backend, q, k, v, dout, cu, 77)


ONE_PASS_CASES = {  # form, lengths (varlen) or [batch, seqlen] and mask kind (padded), dtype, dropout
    "varlen-128-dropout": ("varlen", [128, 70, 0], BF16, 0.2),  # two warpgroups; one full, one empty sequence
    "varlen-64": ("varlen", [64, 9], FP16, 0.0),                # one warpgroup
    "padded-mask-dropout": ("padded", (2, 100, "scattered"), BF16, 0.1),  # key mask, one sequence all pads
    "varlen-150-two-kernels": ("varlen", [150, 5], BF16, 0.1),   # past 128 tokens: the dQ and dK/dV kernels
}


@pytest.mark.parametrize("fused_backend", ["cuda"], indirect=True)
@pytest.mark.parametrize("case", list(ONE_PASS_CASES))
def test_cuda_one_pass_backward_at_head_dim_64(fused_backend, case):
    """At head dim 64 the wgmma backward takes one pass (attention_bwd_fused_wgmma_kernel) up to 128 tokens:
    one block per sequence and head, a warpgroup per 64 tokens, Pd and dS read transposed from shared
    memory; keys past a sequence's end are zero rows, keys under a mask are tested. Longer sequences take
    the dQ and dK/dV kernels. Both against the reference, with dropout, empty and all-padding sequences."""
    form, shape, dtype, p = ONE_PASS_CASES[case]
    seed = seed_of(fused_backend, 17) if p else None
    if form == "varlen":
        lengths = torch.tensor(shape)
        q, k, v, dout, cu = varlen_inputs(fused_backend, lengths, dtype, 64, seed=3)
        check_varlen(fused_backend, q, k, v, dout, cu, int(lengths.max()), p=p, seed=seed)
    else:
        batch, seqlen, kind = shape
        q, k, v, dout = padded_inputs(fused_backend, batch, seqlen, dtype, 64, seed=3)
        check_padded(fused_backend, q, k, v, dout, key_mask(kind, batch, seqlen, seed=3), p=p, seed=seed)


@pytest.mark.parametrize("fused_backend", ["cuda"], indirect=True)
def test_cuda_one_pass_backward_with_very_negative_scores(fused_backend):
    """Every score -200 (lse about -196): a key past a sequence's end, a zero row of K, scores 0, whose
    exp(-lse) overflows fp32; the one-pass kernel clamps its p to 1 (no real p exceeds 1), where it meets
    zero K and V rows, so the gradients stay finite and match the reference."""
    lengths = torch.tensor([5, 70])
    q, k, v, dout, cu = varlen_inputs(fused_backend, lengths, BF16, 64, seed=8)
    with torch.no_grad():
        q.zero_()
        k.zero_()
        q[..., 0] = 40.0
        k[..., 0] = -40.0  # q . k / sqrt(64) = -200
    check_varlen(fused_backend, q, k, v, dout, cu, 70)


@pytest.mark.parametrize("fused_backend", ["cuda"], indirect=True)
@pytest.mark.parametrize("dtype", [FP32, FP16, BF16], ids=["fp32", "fp16", "bf16"])
def test_cuda_keep_bits_are_tritons_layout_and_the_backward_reads_them(fused_backend, dtype):
    """The CUDA forward records its decisions in the Triton kernel's keep bits (contract.keep_bits_shape:
    fp16/bf16 from its mma tiles, fp32 by a kernel drawing each byte), and its backward reads them: bits
    packed in torch from the drawn mask give the same gradients, and bits that keep everything give the
    reference's gradients of the all-kept mask; without bits, or with bits of another shape, it refuses."""
    from bertfast import contract

    impl, dev = fused_backend.module(VARLEN), fused_backend.device
    seed, p, lengths = seed_of(fused_backend, 41), 0.25, [77, 6]  # 77: two 64-key blocks, the last masked
    q, k, v, dout, cu = varlen_inputs(fused_backend, torch.tensor(lengths), dtype, seed=25)
    out, lse, bits = impl.attention_varlen_fwd(q, k, v, cu, 77, None, p, seed)
    assert bits.dtype == torch.uint8 and bits.shape == contract.keep_bits_shape(2, A, 77, p) == (2, A, 64, 32)
    keep = impl.attention_varlen_dropout_mask(cu, 77, A, p, seed)
    assert_bits_record(bits, keep, lengths)

    dqkv = impl.attention_varlen_bwd(dout, q, k, v, out, lse, cu, 77, None, p, seed, bits)
    packed = pack_keep_bits(keep, 128).to(dev)
    assert torch.equal(impl.attention_varlen_bwd(dout, q, k, v, out, lse, cu, 77, None, p, seed, packed), dqkv)

    if dtype == FP32:  # the bits are read by the same code in every dtype; fp32 compares tightly
        assert_all_kept_gradients(impl, q, k, v, dout, cu, 77, p, seed, lse, bits, atol=2e-5)
    with pytest.raises(ValueError, match=r"keep: expected shape \(2, 2, 64, 32\), got \(0,\)"):
        impl.attention_varlen_bwd(dout, q, k, v, out, lse, cu, 77, None, p, seed, NO_KEEP.to(dev))


@pytest.mark.parametrize("fused_backend", ["cuda"], indirect=True)
def test_cuda_draws_the_triton_mask(fused_backend):
    """The CUDA attention draws Triton's mask bit for bit (csrc/attention.cuh, Dropout): varlen, lengths
    past one and two 32-column blocks and not multiples of 8, at rates whose thresholds round."""
    from bertfast.kernels import attention as K

    dev = fused_backend.device
    cu = torch.tensor([0, 37, 43, 113], dtype=torch.int32, device=dev)
    impl = fused_backend.module(VARLEN)
    for p, seed in ((0.1, 5), (0.5, 2**33 + 1), (1 / 3, -17)):
        s = seed_of(fused_backend, seed)
        keep = impl.attention_varlen_dropout_mask(cu, 70, A, p, s)
        assert torch.equal(keep, K.attention_varlen_dropout_mask(cu, 70, A, p, s)), (p, seed)


def test_triton_varlen_outputs_are_not_zero_filled_but_rows_outside_every_sequence_are_cleared():
    """The varlen outputs are allocated empty (a zero-fill wrote all of out and three times that for
    dqkv); _clear_outside_rows sets the rows before cu_seqlens[0] and from cu_seqlens[B] on to 0 and
    lse to +inf there, and leaves every row of a sequence to the attention kernels."""
    from bertfast.kernels import attention as K

    dev = torch.device("cuda" if GPU else "cpu")
    tokens, row = 150, 3 * A * 16  # 150 rows: three 64-row programs, the last partial
    for bounds in ([5, 70, 71, 100], [0, 150], [0, 64], [64, 64], [0]):
        cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
        out = torch.full((tokens, 3, A, 16), float("nan"), device=dev)
        lse = torch.full((A, tokens), float("nan"), device=dev)
        K._clear_outside_rows(out, lse, cu)
        outside = torch.tensor([r < bounds[0] or r >= bounds[-1] for r in range(tokens)], device=dev)
        flat = out.reshape(tokens, row)
        assert (flat[outside] == 0).all() and flat[~outside].isnan().all(), bounds
        assert torch.isposinf(lse[:, outside]).all() and lse[:, ~outside].isnan().all(), bounds


# =========================================================================== CUDA
@pytest.mark.skipif(GPU, reason="bf16 runs in the GPU tests there")
def test_cuda_bf16_on_the_emulator(fused_backend):
    # The emulator runs bf16 correctly (the interpreter does not): the bf16 tensor-core path on CPU.
    if fused_backend.name != "cuda":
        pytest.skip("the interpreter's bf16 is wrong: Triton bf16 runs in the GPU tests")
    lengths = torch.tensor([70, 0, 9])  # 70 > one 64-query block; a zero-length sequence
    q, k, v, dout, cu = varlen_inputs(fused_backend, lengths, BF16, 64, heads=1, seed=20)
    check_varlen(fused_backend, q, k, v, dout, cu, 70, p=0.1, seed=seed_of(fused_backend, 3))
    q, k, v, dout = padded_inputs(fused_backend, dtype=BF16, head_dim=128, seed=20)
    check_padded(fused_backend, q, k, v, dout, key_mask("scattered", seed=20))


# --------------------------------------------------------------------------- wrapper validation (no GPU)
def test_cuda_validation(cuda_on_cpu):
    from bertfast.cuda import attention as C

    t, a, d = 9, 2, 32
    q, k, v = torch.randn(t, 3, a, d, dtype=FP16).unbind(1)  # packed views: row stride 3 A D, head stride D
    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    seed = torch.tensor([11])
    lse = torch.zeros(a, t)
    cuda_on_cpu.reaches(C.attention_varlen_fwd, q, k, v, cu, 5, 0.2, 0.1, seed)
    cuda_on_cpu.reaches(C.attention_varlen_fwd, q, k, v, cu, 5, None, 0.0, None)  # None: 1/sqrt(D)
    cuda_on_cpu.reaches(C.attention_varlen_bwd, torch.randn(t, a, d, dtype=FP16), q, k, v,
                        torch.randn(t, a, d, dtype=FP16), lse, cu, 5, 0.2, 0.0, None, NO_KEEP)
    # Any head dim in [8, 256]; rows need no alignment (the kernels fall back to element accesses).
    cuda_on_cpu.reaches(C.attention_varlen_fwd, q[..., :26], k[..., :26], v[..., :26], cu, 5, 0.2, 0.0, None)
    for bad in (7, 264):
        x = torch.randn(t, a, bad, dtype=FP16)
        cuda_on_cpu.rejects(rf"head dim in \[8, 256\], got {bad}", C.attention_varlen_fwd, x, x, x, cu, 5, 0.2, 0.0,
                            None)
    cuda_on_cpu.reaches(C.attention_varlen_fwd, cuda_on_cpu.misaligned((t, a, d), FP16), k, v, cu, 5, 0.2, 0.0, None)
    odd = torch.randn(t, a * d + 1, dtype=FP16)[:, : a * d].view(t, a, d)  # row stride 65 elements
    cuda_on_cpu.reaches(C.attention_varlen_fwd, odd, k, v, cu, 5, 0.2, 0.0, None)
    head_strided = torch.randn(t, d, a, dtype=FP16).transpose(1, 2)  # stride(-1) == A
    cuda_on_cpu.rejects("contiguous last", C.attention_varlen_fwd, head_strided, k, v, cu, 5, 0.2, 0.0, None)
    cuda_on_cpu.rejects("k: expected dtype", C.attention_varlen_fwd, q, k.float(), v, cu, 5, 0.2, 0.0, None)
    cuda_on_cpu.rejects(r"v: expected shape \(9, 2, 32\)", C.attention_varlen_fwd, q, k, v[:8], cu, 5, 0.2, 0.0,
                        None)
    cuda_on_cpu.rejects("cu_seqlens: expected dtype", C.attention_varlen_fwd, q, k, v, cu.long(), 5, 0.2, 0.0, None)
    cuda_on_cpu.rejects("max_seqlen: expected a python int", C.attention_varlen_fwd, q, k, v, cu, 5.0, 0.2, 0.0,
                        None)
    cuda_on_cpu.rejects("seed: expected an int64 tensor", C.attention_varlen_fwd, q, k, v, cu, 5, 0.2, 0.1, None)
    cuda_on_cpu.rejects(r"lse: expected shape \(2, 9\)", C.attention_varlen_bwd, q, q, k, v, q, lse.t(), cu, 5, 0.2,
                        0.0, None, NO_KEEP)
    cuda_on_cpu.rejects("softmax_scale", C.attention_varlen_fwd, q, k, v, cu, 5, float("inf"), 0.0, None)

    b, s = 2, 5
    qp = torch.randn(b, s, a, d, dtype=BF16)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    cuda_on_cpu.reaches(C.attention_padded_fwd, qp, qp, qp, mask, 0.2, 0.0, None)
    cuda_on_cpu.reaches(C.attention_padded_fwd, qp, qp, qp, mask.long(), 0.2, 0.0, None)
    cuda_on_cpu.reaches(C.attention_padded_bwd, qp, qp, qp, qp, qp, torch.zeros(b, a, s), None, 0.2, 0.0, None,
                        NO_KEEP)
    cuda_on_cpu.rejects(r"key_padding_mask: expected shape \(2, 5\)", C.attention_padded_fwd, qp, qp, qp,
                        mask[:, :4], 0.2, 0.0, None)
    cuda_on_cpu.rejects("bool or integer", C.attention_padded_fwd, qp, qp, qp, mask.float(), 0.2, 0.0, None)
    cuda_on_cpu.rejects("expected 4 dimensions", C.attention_padded_fwd, qp[0], qp[0], qp[0], None, 0.2, 0.0, None)
    cuda_on_cpu.rejects(r"lse: expected shape \(2, 2, 5\)", C.attention_padded_bwd, qp, qp, qp, qp, qp,
                        torch.zeros(b, s, a), None, 0.2, 0.0, None, NO_KEEP)

    cuda_on_cpu.reaches(C.attention_padded_dropout_mask, 2, 5, 2, 0.1, seed)
    cuda_on_cpu.reaches(C.attention_varlen_dropout_mask, cu, 5, 2, 0.1, seed)
    cuda_on_cpu.rejects("num_heads: expected a python int", C.attention_padded_dropout_mask, 2, 5, -1, 0.1, seed)
    assert cuda_on_cpu.calls == ["attention_fwd", "attention_fwd", "attention_bwd"] + ["attention_fwd"] * 5 + [
        "attention_bwd", "attention_dropout_mask", "attention_dropout_mask"]


def test_cuda_rejects_cpu_tensors():
    from bertfast.cuda import attention as C

    q = torch.randn(6, 2, 16)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="expected a CUDA tensor, got device cpu"):
        C.attention_varlen_fwd(q, q, q, cu, 6, 0.25, 0.0, None)
    qp = torch.randn(1, 6, 2, 16)
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        C.attention_padded_fwd(qp, qp, qp, None, 0.25, 0.0, None)
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        C.attention_padded_dropout_mask(1, 4, 2, 0.1, torch.zeros(1, dtype=torch.long))


def test_cuda_dropout_mask_without_dropout_needs_no_gpu():
    from bertfast.cuda import attention as C

    keep = C.attention_padded_dropout_mask(2, 3, 4, 0.0, None)
    assert keep.shape == (2, 4, 3, 3) and keep.dtype == torch.bool and keep.all()
