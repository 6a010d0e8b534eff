"""embeddings: the contract on every backend, then what is particular to one backend.

Contract (bertfast/ops/embeddings.py): y = Dropout(LN(word[ids] + pos[position_ids] +
token_type[token_type_ids])) on unpadded token rows; y [T, H] in out_dtype; mean and rstd fp32 [T]
of the fp32 embedding sum; table gradients scatter-added in fp32 (repeated ids add up) and returned
in each table's dtype; ln gradients in their dtype; 0 tokens give an empty y and zero gradients;
dropout from each backend's own stream, its mask returned by return_dropout_mask; H <= 8192 on
Triton and CUDA (dispatch falls back to torch beyond); fp32 tables with fp16 out; int32/int64 ids.
Oracle: bertfast.reference in fp32 with autograd, fed the backend's keep-mask. The math is fp32,
so y and the table gradients are the oracle rounded once to their dtype (``rounded``); the ln
gradients of low-precision params and GPU sizes take the low-precision rule (docs/testing.md).
Without a GPU, Triton runs under the interpreter and CUDA on the CPU emulator
(tests/ops/conftest.py), so shapes stay small (T <= 20); bf16 only on a GPU.
"""
import contextlib

import pytest
import torch

from bertfast import dispatch, ops
from bertfast import reference as R
from bertfast.testing import BackendUnderTest, check_close, run_reference

OP = "embeddings"
GPU = torch.cuda.is_available()
LOWP = [torch.float16] + ([torch.bfloat16] if GPU else [])
EPS = 1e-12
TABLES = ("word", "pos", "token_type", "ln_weight", "ln_bias")
IDS = ("ids", "pids", "tids")
# One rounding of an fp32 result to the dtype: at most half an ulp, so rtol = one ulp.
ROUNDING = {torch.float32: 1e-5, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def inputs(backend, t, h, vocab=5, positions=7, types=2, dtype=torch.float32, out_dtype=None,
           id_dtypes=(torch.int64, torch.int32, torch.int64), seed=0):
    """Token rows and tables; T > vocab repeats ids. Drawn on the CPU, so every backend sees the same."""
    g = torch.Generator().manual_seed(seed)
    dev = backend.device

    def rnd(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*shape, generator=g)).to(dtype).to(dev)

    ids = [torch.randint(0, n, (t,), generator=g).to(d).to(dev) for n, d in zip((vocab, positions, types), id_dtypes)]
    return dict(zip(IDS, ids), word=rnd(vocab, h), pos=rnd(positions, h, scale=0.5),
                token_type=rnd(types, h, scale=0.5), ln_weight=rnd(h, scale=0.2, shift=1.0), ln_bias=rnd(h, scale=0.2),
                dy=torch.randn(t, h, generator=g).to(out_dtype or dtype).to(dev), out_dtype=out_dtype or dtype)


def seed_tensor(backend, value=321):
    return torch.tensor([value], dtype=torch.int64, device=backend.device)


def forward(backend, inp, p, seed, **kwargs):
    return backend.module(OP).embeddings_fwd(*(inp[k] for k in IDS), *(inp[k] for k in TABLES), EPS, p, seed,
                                             inp["out_dtype"], **kwargs)


def run(backend, inp, p, seed):
    """The backend's launchers: (y, mean, rstd, keep, {param: gradient})."""
    y, mean, rstd, keep = forward(backend, inp, p, seed, return_dropout_mask=True)
    grads = backend.module(OP).embeddings_bwd(inp["dy"], *(inp[k] for k in IDS), *(inp[k] for k in TABLES),
                                              mean, rstd, p, seed)
    return y, mean, rstd, keep, dict(zip(TABLES, grads))


def reference(inp, p, keep, dtype):
    """bertfast.reference in dtype, fed the keep-mask: (y, {param: gradient})."""
    ids = [inp[k].long() for k in IDS]
    fn = lambda *params: R.embeddings(*ids, *params, EPS, p, keep)  # noqa: E731
    y, grads = run_reference(fn, [inp[k] for k in TABLES], dtype, inp["dy"])
    return y, dict(zip(TABLES, grads))


def rounded(name, got, oracle, dtype, atol=1e-5):
    """got is the fp32 oracle rounded once to dtype (fp32 math; no low-precision accumulation)."""
    torch.testing.assert_close(got.float().cpu(), oracle.float().cpu(), rtol=ROUNDING[dtype], atol=atol,
                               msg=lambda m: f"{name}: {m}")


def check(backend, inp, p, seed=None, gpu_sizes=False):
    """The backend's launchers against the reference fed their keep-mask; returns run()'s outcome.

    gpu_sizes: thousands of tokens sum into a few rows (in a fixed order, but not the reference's),
    so every output takes the low-precision rule instead of the one-rounding rule."""
    seed = seed_tensor(backend) if seed is None else seed
    y, mean, rstd, keep, grads = run(backend, inp, p, seed)
    t, h = inp["dy"].shape
    assert y.shape == (t, h) and y.dtype == inp["out_dtype"]
    assert mean.shape == rstd.shape == (t,) and mean.dtype == rstd.dtype == torch.float32
    assert keep.shape == (t, h) and keep.dtype == torch.bool
    if p == 0.0:
        assert keep.all()
    for name in TABLES:
        assert grads[name].dtype == inp[name].dtype and grads[name].shape == inp[name].shape, name
    # The statistics are those of the fp32 sum of the (upcast) rows.
    hsum = sum(inp[table].float()[inp[i].long()] for table, i in zip(TABLES, IDS))
    torch.testing.assert_close(mean, hsum.mean(1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rstd, torch.rsqrt(hsum.var(1, unbiased=False) + EPS), atol=0, rtol=1e-4)

    y32, g32 = reference(inp, p, keep, torch.float32)
    if gpu_sizes:
        lowp = inp["out_dtype"] if inp["out_dtype"] != torch.float32 else inp["word"].dtype
        ylo, glo = reference(inp, p, keep, lowp) if lowp != torch.float32 else (None, {})
        check_close("y", y, y32, ylo, lowp, atol=1e-4, rtol=1e-4)
        for name in TABLES:
            check_close(f"d{name}", grads[name], g32[name], glo.get(name), lowp, atol=1e-4, rtol=1e-4)
        return y, mean, rstd, keep, grads
    rounded("y", y, y32, inp["out_dtype"])
    for name in TABLES[:3]:
        rounded(f"d{name}", grads[name], g32[name], inp[name].dtype)
    lowp = inp["ln_weight"].dtype
    glo = reference(inp, p, keep, lowp)[1] if lowp != torch.float32 else {}
    for name in TABLES[3:]:
        check_close(f"d{name}", grads[name], g32[name], glo.get(name), lowp)
    return y, mean, rstd, keep, grads


# =========================================================================== the contract, every backend
CASES = [  # (T, H, vocab, positions, types, p)
    (20, 1023, 5, 7, 2, 0.1),  # awkward H, every id repeated, dropout
    (9, 64, 3, 4, 6, 0.0),     # 6 token types (Triton: atomics for that table), no dropout
    (1, 64, 3, 4, 1, 0.1),     # one token, one type
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("t,h,vocab,positions,types,p", CASES)
def test_matches_reference(backend, t, h, vocab, positions, types, p, dtype):
    check(backend, inputs(backend, t, h, vocab, positions, types, dtype), p)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_repeated_ids_add_up_in_fp32(backend, dtype, id_dtype):
    # Every token scatters into word row 2 and position row 1: a low-precision running sum of 20
    # terms drifts by ulps, the contract allows one rounding of the fp32 sum (check's ``rounded``).
    inp = inputs(backend, 20, 128, 4, 4, 2, dtype, id_dtypes=(id_dtype,) * 3)
    inp["ids"].fill_(2)
    inp["pids"].fill_(1)
    grads = check(backend, inp, 0.1)[4]
    assert grads["word"][2].abs().max() > 5.0  # a sum of many terms, not one token's gradient


@pytest.mark.parametrize("out_dtype", LOWP, ids=[str(d)[6:] for d in LOWP])
def test_fp32_tables_with_lowp_output(backend, out_dtype):
    # Autocast-style: fp32 master weights, low-precision activations out and dy in.
    inp = inputs(backend, 12, 1023, 11, 8, 2, torch.float32, out_dtype=out_dtype)
    _, _, _, _, grads = check(backend, inp, 0.1)
    assert all(g.dtype == torch.float32 for g in grads.values())


def test_dropout_keeps_one_minus_p_scaled(backend):
    p = 0.1
    inp = inputs(backend, 20, 256)
    s1, s2 = seed_tensor(backend, 11), seed_tensor(backend, 12)
    y0 = forward(backend, inp, 0.0, None)[0]
    y1, _, _, keep1 = forward(backend, inp, p, s1, return_dropout_mask=True)
    dropped = 1.0 - keep1.float().mean().item()
    assert abs(dropped - p) < 0.025, dropped  # 5120 draws: sigma = 0.004
    assert not y1[~keep1].any()
    torch.testing.assert_close(y1[keep1], y0[keep1] / (1.0 - p), atol=1e-6, rtol=1e-6)
    # A function of the seed tensor: the same seed gives the same mask, with or without returning it, and the
    # same bits (on a GPU the kernel that stores the mask has another register layout; Triton's LayerNorm sums
    # do not depend on it: test_triton_results_do_not_depend_on_the_order_of_additions).
    assert torch.equal(forward(backend, inp, p, s1)[0], y1)
    keep2 = forward(backend, inp, p, s2, return_dropout_mask=True)[3]
    differ = (keep1 != keep2).float().mean().item()
    assert abs(differ - 2 * p * (1 - p)) < 0.03, differ  # independent masks for another seed


def test_empty_tokens(backend):
    inp = inputs(backend, 0, 64, dtype=torch.float16, out_dtype=torch.float32)
    seed = seed_tensor(backend)
    y, mean, rstd, keep = forward(backend, inp, 0.1, seed, return_dropout_mask=True)
    assert y.shape == keep.shape == (0, 64) and y.dtype == torch.float32 and mean.shape == rstd.shape == (0,)
    grads = backend.module(OP).embeddings_bwd(inp["dy"], *(inp[k] for k in IDS), *(inp[k] for k in TABLES),
                                              mean, rstd, 0.1, seed)
    for name, grad in zip(TABLES, grads):
        assert grad.shape == inp[name].shape and grad.dtype == inp[name].dtype and not grad.any(), name
    # Through the op and autograd too.
    params = [inp[k].float().requires_grad_() for k in TABLES]
    with backend.forced():
        out = ops.embeddings(*(inp[k] for k in IDS), *params, EPS, 0.1)
    out.sum().backward()
    assert out.shape == (0, 64) and not any(p.grad.any() for p in params)


def test_hidden_size_beyond_fused_limit(backend):
    h = 10000
    inp = inputs(backend, 3, h, 2, 3, 2)
    args = [inp[k] for k in IDS] + [inp[k] for k in TABLES]
    tensors = dict(input_ids=inp["ids"], **{k: inp[k] for k in TABLES})
    keep = torch.ones(3, h, dtype=torch.bool, device=backend.device)
    y32 = reference(inp, 0.0, keep, torch.float32)[0]
    if backend.name == "torch":
        assert dispatch.get(OP, "torch").reasons(True, **tensors) == []
        with backend.forced():
            rounded("y", ops.embeddings(*args, EPS), y32, torch.float32)
    else:
        reasons = backend.module(OP).unsupported(tensors)
        assert len(reasons) == 1 and f"hidden size {h} is outside [1, 8192]" in reasons[0], reasons
        assert backend.module(OP).unsupported(dict(tensors, word=torch.empty(1, 8192))) == []
        with backend.forced(), pytest.raises(dispatch.NoBackendError, match=f"{backend.name}.*hidden size {h}"):
            ops.embeddings(*args, EPS)
    # Unforced, dispatch passes the fused backends over for torch (with the emulator, CUDA is a candidate).
    assert dispatch.select(OP, **tensors) == "torch"
    rounded("y", ops.embeddings(*args, EPS), y32, torch.float32)


def test_row_strided_tables_and_dy(backend):
    t, h = 9, 64
    inp = inputs(backend, t, h, 7, 9, 2)
    strided = dict(inp)
    for name in ("word", "pos", "token_type", "dy"):
        wide = torch.full((inp[name].shape[0], 2 * h), float("nan"), device=backend.device)
        wide[:, :h] = inp[name]
        strided[name] = wide[:, :h]
    seed = seed_tensor(backend, 4)
    y, _, _, keep, grads = run(backend, inp, 0.1, seed)
    y_s, _, _, keep_s, grads_s = run(backend, strided, 0.1, seed)
    assert torch.equal(y_s, y) and torch.equal(keep_s, keep)
    for name in TABLES:
        torch.testing.assert_close(grads_s[name], grads[name], atol=1e-6, rtol=1e-6, msg=lambda m: f"d{name}: {m}")


def test_op_autograd_matches_reference(backend):
    # The whole op (custom op, saved seed, autograd) with dropout and fp16 out from fp32 tables.
    inp = inputs(backend, 12, 40, 5, 6, 2, out_dtype=torch.float16, id_dtypes=(torch.int32,) * 3)
    params = [inp[k].clone().requires_grad_() for k in TABLES]
    with backend.forced():
        y = ops.embeddings(*(inp[k] for k in IDS), *params, EPS, 0.1, out_dtype=torch.float16)
    y.backward(inp["dy"])
    assert y.dtype == torch.float16
    keep = y != 0  # LayerNorm outputs are never exactly 0 here: zeros are the dropped entries
    assert 0 < (~keep).sum() < 0.25 * keep.numel()
    y32, g32 = reference(inp, 0.1, keep, torch.float32)
    rounded("y", y, y32, torch.float16)
    for name, param in zip(TABLES, params):
        rounded(f"d{name}", param.grad, g32[name], torch.float32)


def test_dropout_mask_depends_on_token_row_not_launch(fused_backend):
    # The counter is (token row, column): the first 7 tokens of a launch keep what they keep alone.
    # (The torch backend draws torch.rand over the whole [T, H]: a function of the shape as well.)
    inp = inputs(fused_backend, 20, 64)
    head = dict(inp, **{k: inp[k][:7] for k in IDS})
    seed = seed_tensor(fused_backend, 5)
    keep = forward(fused_backend, inp, 0.3, seed, return_dropout_mask=True)[3]
    assert torch.equal(forward(fused_backend, head, 0.3, seed, return_dropout_mask=True)[3], keep[:7])


def test_launcher_errors_are_clear(fused_backend):
    impl = fused_backend.module(OP)
    inp = inputs(fused_backend, 5, 64, 7, 9, 2)
    ids = [inp[k] for k in IDS]
    tables = [inp[k] for k in TABLES]
    with pytest.raises(ValueError, match="input_ids: expected dtype"):
        impl.embeddings_fwd(ids[0].float(), *ids[1:], *tables, EPS, 0.0, None, torch.float32)
    with pytest.raises(ValueError, match=r"position_ids: expected shape \(5,\)"):
        impl.embeddings_fwd(ids[0], ids[1][:3], ids[2], *tables, EPS, 0.0, None, torch.float32)
    with pytest.raises(ValueError, match="pos: expected shape"):
        impl.embeddings_fwd(*ids, tables[0], torch.randn(9, 32, device=fused_backend.device), *tables[2:], EPS,
                            0.0, None, torch.float32)
    with pytest.raises(ValueError, match="hidden size"):
        big = [torch.zeros(2, 8200, device=fused_backend.device) for _ in range(3)]
        impl.embeddings_fwd(*ids, *big, *(torch.ones(8200, device=fused_backend.device),) * 2, EPS, 0.0, None,
                            torch.float32)
    with pytest.raises(ValueError, match="seed"):
        impl.embeddings_fwd(*ids, *tables, EPS, 0.1, None, torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        impl.embeddings_fwd(*ids, *tables, EPS, 0.0, None, torch.int8)
    y, mean, rstd = impl.embeddings_fwd(*ids, *tables, EPS, 0.0, None, torch.float32)
    with pytest.raises(ValueError, match=r"dy: expected shape \(5, 64\)"):
        impl.embeddings_bwd(y[:4], *ids, *tables, mean, rstd, 0.0, None)
    with pytest.raises(ValueError, match="mean: expected dtype"):
        impl.embeddings_bwd(y, *ids, *tables, mean.half(), rstd, 0.0, None)


def test_op_errors_are_clear():
    ids = torch.zeros(4, dtype=torch.long)
    tables = [torch.randn(3, 8) for _ in range(3)] + [torch.ones(8), torch.zeros(8)]
    with pytest.raises(ValueError, match="input_ids as int32/int64"):
        ops.embeddings(ids.float(), ids, ids, *tables, EPS)
    with pytest.raises(ValueError, match="position_ids as int32/int64"):
        ops.embeddings(ids, ids.view(2, 2), ids, *tables, EPS)
    with pytest.raises(ValueError, match="dropout_p"):
        ops.embeddings(ids, ids, ids, *tables, EPS, 1.0)


def test_opcheck():
    ids = torch.tensor([1, 2, 2, 0, 5])
    params = [torch.randn(*shape, requires_grad=True) for shape in ((7, 6), (5, 6), (2, 6), (6,), (6,))]
    seed = torch.tensor([7], dtype=torch.int64)
    torch.library.opcheck(torch.ops.bertfast.embeddings, (ids, torch.arange(5), torch.tensor([0, 0, 1, 1, 0]),
                                                          *params, 1e-12, 0.1, seed, torch.float32, "torch"))


# =========================================================================== GPU sizes
@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("h", [312, 768, 1024])
def test_gpu_lowp_bert_sizes(backend, h, dtype, p):
    check(backend, inputs(backend, 4096, h, 30522, 512, 2, dtype), p, gpu_sizes=True)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype,table_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                   (torch.bfloat16, torch.float32), (torch.float16, torch.float32)])
@pytest.mark.parametrize("h", [768, 1023])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_gpu_mixed_dtypes(backend, out_dtype, table_dtype, h, p):
    inp = inputs(backend, 70, h, 50, 40, 2, table_dtype, out_dtype=out_dtype)
    inp["ids"][:10] = 3  # repeated ids add up
    check(backend, inp, p, gpu_sizes=True)


@pytest.mark.gpu
def test_gpu_dropout_fraction(backend):
    p = 0.1
    keep = forward(backend, inputs(backend, 512, 1024, 4, 4, 2), p, seed_tensor(backend, 3),
                   return_dropout_mask=True)[3]
    assert abs((1.0 - keep.float().mean().item()) - p) < 0.005  # 524288 draws: sigma = 0.0004


# =========================================================================== Triton
@pytest.mark.skipif(GPU, reason="on a GPU every Triton test above takes this path")
def test_triton_autotuned_launch_path_under_interpreter(stand_in_tuner):
    """The forward is tuned through the autotuner (stood in here) and its results cached per key; the
    backward runs one fixed configuration (its tile and chunk set the order of its sums)."""
    from bertfast.kernels import embeddings as EM

    stand_in_tuner(EM._fwd_tuned)
    triton = BackendUnderTest("triton", torch.device("cpu"))
    check(triton, inputs(triton, 37, 100, 7, 9, 2), 0.1)
    check(triton, inputs(triton, 37, 100, 7, 9, 6), 0.0)
    assert len(EM._fwd_tuned.cache) == 2


@pytest.mark.parametrize("backend", ["triton"], indirect=True)
@pytest.mark.parametrize("limit", [4, 0], ids=["registers", "sorted"])
def test_triton_token_type_gradient_paths(backend, limit, monkeypatch):
    # 3 types: partials in registers (a 4-row block, one row masked) or summed with the sorted tables.
    from bertfast.kernels import embeddings as EM

    monkeypatch.setattr(EM, "_MAX_TYPES_IN_REGISTERS", limit)
    check(backend, inputs(backend, 20, 64, 5, 7, 3), 0.1)


@pytest.mark.parametrize("backend", ["triton"], indirect=True)
def test_triton_results_do_not_depend_on_the_order_of_additions(backend):
    """Permuting the columns of the tables and LayerNorm parameters permutes y and the LayerNorm gradients bit
    for bit and leaves mean and rstd as they are: the LayerNorm sums (kernels/_rows.py, exact_sum) do not
    depend on the order of their terms, which on a GPU follows the register layout Triton picks (storing the
    keep-mask or not changed it, and with it y's last bits); each table row sums its tokens in token order,
    which a column permutation does not change."""
    t, h = 12, 200
    inp = inputs(backend, t, h, 5, 7, 2)
    perm = torch.randperm(h, generator=torch.Generator().manual_seed(5)).to(backend.device)
    permuted = dict(inp, **{k: inp[k][..., perm] for k in TABLES + ("dy",)})
    y, mean, rstd, _, grads = run(backend, inp, 0.0, None)  # p = 0: the mask is keyed by column
    y_p, mean_p, rstd_p, _, grads_p = run(backend, permuted, 0.0, None)
    assert torch.equal(mean_p, mean) and torch.equal(rstd_p, rstd) and torch.equal(y_p, y[:, perm])
    for name in ("ln_weight", "ln_bias"):
        assert torch.equal(grads_p[name], grads[name][perm]), name
    for name in ("word", "pos", "token_type"):
        assert torch.equal(grads_p[name], grads[name][:, perm]), name


@pytest.mark.parametrize("backend", ["triton"], indirect=True)
def test_triton_launcher_rejects_column_strides(backend):
    impl = backend.module(OP)
    inp = inputs(backend, 5, 64, 7, 9, 2)
    ids = [inp[k] for k in IDS]
    tables = [inp[k] for k in TABLES]
    columns = torch.randn(7, 128, device=backend.device)[:, ::2]
    with pytest.raises(ValueError, match="word: expected unit column stride"):
        impl.embeddings_fwd(*ids, columns, *tables[1:], EPS, 0.0, None, torch.float32)
    _, mean, rstd = impl.embeddings_fwd(*ids, *tables, EPS, 0.0, None, torch.float32)
    with pytest.raises(ValueError, match="dy: expected unit column stride"):
        impl.embeddings_bwd(torch.randn(5, 128, device=backend.device)[:, ::2], *ids, *tables, mean, rstd, 0.0, None)


# =========================================================================== CUDA
@pytest.mark.parametrize("backend", ["cuda"], indirect=True)
@pytest.mark.parametrize("types", [128, 130], ids=["shared-memory", "sorted"])
def test_cuda_token_type_gradient_paths(backend, types):
    # Token-type partials sit in shared memory up to 32 KiB (128 rows of H = 64), sorted with the other tables beyond.
    check(backend, inputs(backend, 12, 64, 5, 7, types), 0.1)


def test_cuda_validation(cuda_on_cpu):
    from bertfast.cuda import embeddings as C

    t, h = 7, 24
    ids = torch.randint(0, 10, (t,))
    word, pos, tt = torch.randn(10, h), torch.randn(16, h), torch.randn(2, h)
    lw, lb = torch.ones(h), torch.zeros(h)
    args = (word, pos, tt, lw, lb)
    cuda_on_cpu.reaches(C.embeddings_fwd, ids, ids.int(), ids % 2, *args, 1e-12, 0.1, torch.tensor([1]),
                        torch.bfloat16)
    misaligned = cuda_on_cpu.misaligned((10, h), torch.float32)  # the kernels fall back to scalar loads
    cuda_on_cpu.reaches(C.embeddings_fwd, ids, ids, ids % 2, misaligned, pos, tt, lw, lb, 1e-12, 0.0, None,
                        torch.float32)
    y = torch.randn(t, h, dtype=torch.bfloat16)
    cuda_on_cpu.reaches(C.embeddings_bwd, y, ids, ids, ids % 2, *args, torch.zeros(t), torch.ones(t), 0.0, None)
    cuda_on_cpu.rejects("input_ids: expected dtype", C.embeddings_fwd, ids.float(), ids, ids, *args, 1e-12, 0.0,
                        None, torch.float32)
    cuda_on_cpu.rejects(r"position_ids: expected shape \(7,\)", C.embeddings_fwd, ids, ids[:6], ids, *args, 1e-12,
                        0.0, None, torch.float32)
    cuda_on_cpu.rejects(r"pos: expected shape \(rows > 0, 24\)", C.embeddings_fwd, ids, ids, ids, word,
                        torch.randn(16, 23), tt, lw, lb, 1e-12, 0.0, None, torch.float32)
    cuda_on_cpu.rejects("token_type: expected dtype", C.embeddings_fwd, ids, ids, ids, word, pos, tt.half(), lw, lb,
                        1e-12, 0.0, None, torch.float32)
    cuda_on_cpu.rejects("out_dtype", C.embeddings_fwd, ids, ids, ids, *args, 1e-12, 0.0, None, torch.int8)
    cuda_on_cpu.rejects(r"dy: expected shape \(7, 24\)", C.embeddings_bwd, y[:6], ids, ids, ids, *args,
                        torch.zeros(t), torch.ones(t), 0.0, None)
    assert cuda_on_cpu.calls == ["embeddings_fwd", "embeddings_fwd", "embeddings_bwd"]


def test_cuda_rejects_cpu_tensors():
    from bertfast.cuda import embeddings as C

    ids = torch.zeros(4, dtype=torch.long)
    x, b = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(ValueError, match="expected a CUDA tensor, got device cpu"):
        C.embeddings_fwd(ids, ids, ids, x, x, x, b, b, 1e-12, 0.0, None, torch.float32)

@contextlib.contextmanager
def _programs_in_reverse_order():
    """Under the interpreter, run every launch's programs last to first: another schedule, as a GPU may pick."""
    from triton.runtime import interpreter

    builder = type(interpreter.interpreter_builder)
    launch_order = builder.set_grid_idx

    def reverse(self, x, y, z):
        nx, ny, nz = self.grid_dim
        launch_order(self, nx - 1 - x, ny - 1 - y, nz - 1 - z)
    builder.set_grid_idx = reverse
    try:
        yield
    finally:
        builder.set_grid_idx = launch_order


@pytest.mark.skipif(torch.cuda.is_available(), reason="reorders the programs of the Triton interpreter")
@pytest.mark.parametrize("types", [2, 6], ids=["types-in-registers", "types-sorted"])
def test_triton_table_gradients_do_not_depend_on_the_program_schedule(types):
    """A stopped run resumes bit for bit only if a step's gradients have the same bits every time. The
    GPU runs a launch's programs in any order: fp32 atomics (dword[ids[t]] += dh[t]) then add in that
    order and the last bits change from run to run (a --cuda-graphs run resumed at step 5 ended with
    other word, position and token-type embeddings than the uninterrupted run, with equal losses).
    Each table row must sum its tokens in one fixed order, whatever order the programs run in."""
    from bertfast.kernels import embeddings as EM

    g = torch.Generator().manual_seed(0)
    t, h, vocab, positions = 300, 64, 6, 4      # ~50 tokens per word row, 75 per position row, 3 programs
    ids = [torch.randint(0, n, (t,), generator=g) for n in (vocab, positions, types)]
    tables = [0.02 * torch.randn(n, h, generator=g) for n in (vocab, positions, types)]
    ln = [1 + 0.1 * torch.randn(h, generator=g), 0.1 * torch.randn(h, generator=g)]
    seed = torch.tensor([7], dtype=torch.int64)
    _, mean, rstd = EM.embeddings_fwd(*ids, *tables, *ln, 1e-12, 0.1, seed, torch.float32)
    dy = torch.randn(t, h, generator=g)
    first = EM.embeddings_bwd(dy, *ids, *tables, *ln, mean, rstd, 0.1, seed)
    with _programs_in_reverse_order():
        again = EM.embeddings_bwd(dy, *ids, *tables, *ln, mean, rstd, 0.1, seed)
    for name, a, b in zip(("word", "pos", "token_type", "ln_weight", "ln_bias"), first, again):
        assert torch.equal(a, b), f"d{name}: {(a != b).sum().item()} of {a.numel()} elements differ"
