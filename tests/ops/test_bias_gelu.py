"""bias_gelu: the contract on every backend, then what is particular to one backend.

Contract (bertfast/ops/bias_gelu.py): y = GELU(x + bias), erf or tanh form; outputs contiguous in
x's dtype; dbias in bias's dtype, summed in fp32; row-strided x accepted; 0 rows give an empty y
and a zero dbias. Oracle: bertfast.reference in fp32 with autograd (fp32: atol/rtol 1e-5; fp16:
the low-precision rule, docs/testing.md). Without a GPU, Triton runs under the interpreter and
CUDA on the CPU emulator (tests/ops/conftest.py), so shapes stay small; bf16 only on a GPU.
"""
import pytest
import torch

from bertfast import ops
from bertfast import reference as R
from bertfast.testing import BackendUnderTest, assert_close_lowp, check_close, references, run_reference

OP = "bias_gelu"
GPU = torch.cuda.is_available()
LOWP = [torch.float16] + ([torch.bfloat16] if GPU else [])


def inputs(backend, n, f, dtype, bias_dtype=None, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = backend.tensor(n, f, dtype=dtype, scale=scale, generator=g)
    bias = backend.tensor(f, dtype=bias_dtype or dtype, generator=g)
    dy = backend.tensor(n, f, dtype=dtype, generator=g)
    return x, bias, dy


def check(backend, x, bias, dy, approximate):
    """The backend's launchers against the reference; returns (y, dx, dbias)."""
    impl = backend.module(OP)
    y = impl.bias_gelu_fwd(x, bias, approximate)
    dx, db = impl.bias_gelu_bwd(dy, x, bias, approximate)
    assert y.dtype == dx.dtype == x.dtype and db.dtype == bias.dtype
    assert y.is_contiguous() and dx.is_contiguous()
    fn = lambda x_, b_: R.bias_gelu(x_, b_, approximate)  # noqa: E731
    (y32, (dx32, db32)), (ylo, glo) = references(fn, [x, bias], x.dtype, dy)
    check_close("y", y, y32, ylo, x.dtype)
    check_close("dx", dx, dx32, glo[0], x.dtype)
    if x.dtype == torch.float32:
        # dbias sums N terms in another order than torch; its fp32 rounding grows like sqrt(N), so
        # it takes the 2x rule with an fp64 oracle and the fp32 reference as the yardstick.
        _, (_, db64) = run_reference(fn, [x, bias], torch.float64, dy.double())
        assert_close_lowp(db.double().cpu(), db64.cpu(), db32.double().cpu(), name="dbias")
    else:
        check_close("dbias", db, db32, glo[1], x.dtype)
    return y, dx, db


# =========================================================================== the contract, every backend
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("n,f", [(1, 64), (7, 1023)])
def test_matches_reference(backend, n, f, dtype, approximate):
    check(backend, *inputs(backend, n, f, dtype), approximate)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_saturated_arguments_stay_finite(backend, approximate):
    # |z| up to ~30: y -> z or 0 and the gradient -> 1 or 0, never NaN.
    y, dx, _ = check(backend, *inputs(backend, 5, 64, torch.float32, scale=10.0), approximate)
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()


def test_fp32_bias_with_fp16_activations(backend):
    _, _, db = check(backend, *inputs(backend, 9, 96, torch.float16, bias_dtype=torch.float32), "none")
    assert db.dtype == torch.float32


def test_row_strided_inputs(backend):
    n, f = 9, 64
    x, bias, dy = inputs(backend, n, f, torch.float32)
    wide = torch.full((n, 2 * f), float("nan"), device=backend.device)
    wide_dy = torch.full((n, 2 * f), float("nan"), device=backend.device)
    wide[:, :f], wide_dy[:, :f] = x, dy
    y, dx, db = check(backend, wide[:, :f], bias, wide_dy[:, :f], "none")
    impl = backend.module(OP)
    assert torch.equal(y, impl.bias_gelu_fwd(x, bias, "none"))
    dx_c, db_c = impl.bias_gelu_bwd(dy, x, bias, "none")
    assert torch.equal(dx, dx_c) and torch.equal(db, db_c)


def test_empty_rows(backend):
    x, bias, dy = inputs(backend, 0, 64, torch.float32)
    impl = backend.module(OP)
    assert impl.bias_gelu_fwd(x, bias).shape == (0, 64)
    dx, db = impl.bias_gelu_bwd(dy, x, bias)
    assert dx.shape == (0, 64) and db.shape == (64,) and not db.any()


def test_op_autograd_matches_reference(backend):
    x, bias, dy = inputs(backend, 2 * 3, 40, torch.float32)
    x3 = x.view(2, 3, 40).requires_grad_()
    b = bias.clone().requires_grad_()
    with backend.forced():
        y = ops.bias_gelu(x3, b, "tanh")
    y.backward(dy.view(2, 3, 40))
    (y32, (dx32, db32)), _ = references(lambda x_, b_: R.bias_gelu(x_, b_, "tanh"), [x3, b], torch.float32,
                                        dy.view(2, 3, 40))
    check_close("y", y, y32, None, torch.float32)
    check_close("dx", x3.grad, dx32, None, torch.float32)
    check_close("dbias", b.grad, db32, None, torch.float32, atol=1e-4)


def test_launcher_errors_are_clear(fused_backend):
    impl = fused_backend.module(OP)
    x, bias, dy = inputs(fused_backend, 4, 64, torch.float32)
    columns = torch.randn(4, 128, device=fused_backend.device)[:, ::2]
    with pytest.raises(ValueError, match="column stride"):
        impl.bias_gelu_fwd(columns, bias)
    with pytest.raises(ValueError, match="approximate"):
        impl.bias_gelu_fwd(x, bias, "sigmoid")
    with pytest.raises(ValueError, match="bias"):
        impl.bias_gelu_fwd(x, bias[:32])
    with pytest.raises(ValueError, match="dy"):
        impl.bias_gelu_bwd(dy.half(), x, bias)


def test_op_errors_are_clear():
    with pytest.raises(ValueError, match="approximate"):
        ops.bias_gelu(torch.randn(2, 4), torch.randn(4), "erf")
    with pytest.raises(ValueError, match=r"expected bias of shape \[4\]"):
        ops.bias_gelu(torch.randn(2, 4), torch.randn(3))


def test_opcheck():
    x, b = torch.randn(4, 6, requires_grad=True), torch.randn(6, requires_grad=True)
    torch.library.opcheck(torch.ops.bertfast.bias_gelu, (x, b, "none", "torch"))


# =========================================================================== GPU sizes
@pytest.mark.gpu
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("f", [1200, 1536, 3072, 4096])
def test_gpu_lowp_bert_sizes(backend, f, dtype, approximate):
    check(backend, *inputs(backend, 4096, f, dtype), approximate)
    check(backend, *inputs(backend, 4096, f, dtype, bias_dtype=torch.float32), approximate)


@pytest.mark.gpu
def test_gpu_fp32_awkward_width(backend):
    check(backend, *inputs(backend, 515, 4093, torch.float32), "none")


@pytest.mark.gpu
def test_gpu_bf16_fp32_bias_and_row_stride(backend):
    big = backend.tensor(33, 3080, dtype=torch.bfloat16)
    x = big[:, :3072]  # row stride 3080 != F: the CUDA 128-bit path with a row stride
    _, _, db = check(backend, x, backend.tensor(3072), backend.tensor(33, 3072, dtype=torch.bfloat16), "none")
    assert db.dtype == torch.float32


@pytest.mark.gpu
def test_gpu_tuned_config_is_listed_under_the_offline_key(monkeypatch):
    """On a GPU, Triton's autotuner keys a launch as compile_only records it offline: the perf model
    predicts a GPU run's chosen configs by that key (bertfast/bench/profile.py, tuned_report)."""
    from bertfast.kernels import _common
    from bertfast.kernels import bias_gelu as BG
    from bertfast.contract import row_stride
    from bertfast.kernels._rows import n_bucket
    monkeypatch.delenv(_common.AUTOTUNE_ENV, raising=False)  # the GPU check's tests run fixed: tune here
    n, f = 1000, 1536  # a key no other test tunes (n_bucket 1024)
    x = torch.randn(n, f, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(f, device="cuda", dtype=torch.bfloat16)
    y = BG.bias_gelu_fwd(x, bias)
    torch.cuda.synchronize()
    args, consts = (x, bias, y, n, f, row_stride(x), n_bucket(n)), {"APPROX_TANH": False}
    offline = _common.key_values(_common._tuning_key(BG._fwd_tuned, args, consts))
    chosen = {tuple(c["key"]): c["config"] for c in _common.tuned_configs().get("_bias_gelu_fwd_kernel", [])}
    assert offline in chosen, (offline, chosen)
    assert chosen[offline] in {_common.config_text(c) for c in _common.candidates(BG._fwd_tuned, args, consts)}


# =========================================================================== Triton
@pytest.mark.skipif(GPU, reason="on a GPU every Triton test above takes this path")
def test_triton_autotuned_launch_path_under_interpreter(stand_in_tuner):
    """Each pruned candidate runs once on the real buffers (pure outputs) and the best is relaunched."""
    from bertfast.kernels import bias_gelu as BG

    stand_in_tuner(BG._fwd_tuned, BG._bwd_tuned)
    triton = BackendUnderTest("triton", torch.device("cpu"))
    check(triton, *inputs(triton, 37, 300, torch.float32), "none")
    check(triton, *inputs(triton, 37, 300, torch.float32), "tanh")
    assert len(BG._fwd_tuned.cache) == 2 and len(BG._bwd_tuned.cache) == 2


# ------------------------------------------------------------- Triton: the GEMMs with GELU epilogues
def _gemm_inputs(m, n, k, n2, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(DEV_TRITON, dtype)  # noqa: E731
    return t(m, k), t(n, k, scale=k ** -0.5), t(n), t(m, n2), t(n2, n, scale=n ** -0.5)


DEV_TRITON = torch.device("cuda" if GPU else "cpu")


def check_gemm_epilogues(x, w1, b1, dy, w2, approximate):
    """gemm_bias_gelu_fwd and gemm_gelu_bwd against the reference Linear, GELU and Linear."""
    from bertfast.kernels import bias_gelu as BG

    y, z = BG.gemm_bias_gelu_fwd(x, w1, b1, approximate)
    assert y.dtype == z.dtype == x.dtype and y.is_contiguous() and z.is_contiguous()
    up = lambda x_, w_, b_: x_ @ w_.t() + b_  # noqa: E731
    (z32, _), (zlo, _) = references(up, [x, w1, b1], x.dtype)
    check_close("z", z, z32, zlo, x.dtype, atol=2e-5, rtol=2e-5)
    (y32, _), (ylo, _) = references(lambda *t: R.bias_gelu(up(*t), torch.zeros_like(t[2]), approximate),
                                    [x, w1, b1], x.dtype)
    check_close("y", y, y32, ylo, x.dtype, atol=2e-5, rtol=2e-5)
    dz, db = BG.gemm_gelu_bwd(dy, w2, z, approximate, bias_dtype=torch.float32)
    assert dz.dtype == z.dtype and db.dtype == torch.float32
    down = lambda z_, w_: R.bias_gelu(z_, torch.zeros(z_.shape[1], dtype=z_.dtype), approximate) @ w_.t()  # noqa: E731
    (_, (dz32, _)), (_, (dzlo, _)) = references(down, [z.cpu(), w2.cpu()], x.dtype, dy.cpu())
    check_close("dz", dz, dz32, dzlo, x.dtype, atol=2e-5, rtol=2e-5)
    check_close("dbias", db, dz32.sum(0), None if dzlo is None else dzlo.float().sum(0), x.dtype, atol=1e-4, rtol=1e-4)
    return y, z, dz, db


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32] + LOWP, ids=str)
@pytest.mark.parametrize("m,n,k,n2", [(70, 96, 48, 40), (33, 40, 20, 24), (1, 32, 16, 8)],
                         ids=["blocks", "ragged", "one-row"])
def test_triton_gemm_epilogues_match_reference(m, n, k, n2, dtype, approximate):
    # Rows, columns and K past whole tiles (the interpreter's 32 x 32 x 16), several row blocks and
    # dbias partial rows (zeroed by the kernel where a block covers two).
    check_gemm_epilogues(*_gemm_inputs(m, n, k, n2, dtype), approximate)


def test_triton_gemm_epilogues_row_strided_and_empty():
    from bertfast.kernels import bias_gelu as BG

    x, w1, b1, dy, w2 = _gemm_inputs(9, 32, 16, 8, torch.float32)
    wide = torch.zeros(9, 24, device=x.device)
    wide[:, :16] = x
    y, z = BG.gemm_bias_gelu_fwd(wide[:, :16], w1, b1)
    torch.testing.assert_close(y, BG.gemm_bias_gelu_fwd(x, w1, b1)[0])
    y, z_none = BG.gemm_bias_gelu_fwd(x, w1, b1, store_z=False)
    assert z_none is None and torch.equal(y, BG.gemm_bias_gelu_fwd(x, w1, b1)[0])
    y0, z0 = BG.gemm_bias_gelu_fwd(x[:0], w1, b1)
    assert y0.shape == z0.shape == (0, 32)
    dz0, db0 = BG.gemm_gelu_bwd(dy[:0], w2, z[:0])
    assert dz0.shape == (0, 32) and torch.equal(db0, torch.zeros(32, device=x.device))
    yk, zk = BG.gemm_bias_gelu_fwd(x[:, :0], w1[:, :0], b1)  # K = 0: z is the bias
    torch.testing.assert_close(zk, b1.expand(9, 32))


def test_triton_gemm_epilogue_errors_are_clear():
    from bertfast.kernels import bias_gelu as BG

    x, w1, b1, dy, w2 = _gemm_inputs(9, 32, 16, 8, torch.float32)
    with pytest.raises(ValueError, match=r"weight: expected shape \(N, 16\)"):
        BG.gemm_bias_gelu_fwd(x, w1[:, :8], b1)
    with pytest.raises(ValueError, match="weight: expected dtype"):
        BG.gemm_bias_gelu_fwd(x, w1.half(), b1)
    with pytest.raises(ValueError, match=r"bias: expected dtype torch.float32 \(x's\)"):
        BG.gemm_bias_gelu_fwd(x, w1, b1.half())
    with pytest.raises(ValueError, match="approximate: expected one of"):
        BG.gemm_bias_gelu_fwd(x, w1, b1, "erf")
    z = BG.gemm_bias_gelu_fwd(x, w1, b1)[1]
    with pytest.raises(ValueError, match=r"z: expected shape \(9, 32\)"):
        BG.gemm_gelu_bwd(dy, w2, z[:, :16])
    with pytest.raises(ValueError, match=r"weight: expected shape \(8, H\)"):
        BG.gemm_gelu_bwd(dy, w2[:4], z)


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("hidden,ffn", [(768, 3072), (1024, 4096)], ids=["bert-base", "bert-large"])
def test_gpu_gemm_epilogues_bert_sizes(hidden, ffn, approximate):
    check_gemm_epilogues(*_gemm_inputs(2000, ffn, hidden, hidden, torch.bfloat16), approximate)

# =========================================================================== CUDA wrapper validation (no GPU)
def test_cuda_validation(cuda_on_cpu):
    from bertfast.cuda import bias_gelu as C

    x = torch.randn(5, 24, dtype=torch.float16)
    b = torch.randn(24, dtype=torch.float16)
    cuda_on_cpu.reaches(C.bias_gelu_fwd, x, b)
    cuda_on_cpu.reaches(C.bias_gelu_fwd, torch.randn(5, 32, dtype=torch.float16)[:, :24], b.float())  # row-strided
    cuda_on_cpu.reaches(C.bias_gelu_bwd, x, x, b, "tanh")
    cuda_on_cpu.rejects("dtype in", C.bias_gelu_fwd, x.to(torch.int32), b)
    cuda_on_cpu.rejects(r"bias: expected shape \(24,\), got \(23,\)", C.bias_gelu_fwd, x, b[:23])
    cuda_on_cpu.rejects("expected 2 dimensions", C.bias_gelu_fwd, x[0], b)
    cuda_on_cpu.rejects("stride", C.bias_gelu_fwd, x.t().contiguous().t(), b)
    cuda_on_cpu.rejects("approximate: expected one of", C.bias_gelu_fwd, x, b, "erf")
    cuda_on_cpu.rejects(r"dy: expected dtype in \['torch.float16'\]", C.bias_gelu_bwd, x.float(), x, b)
    cuda_on_cpu.rejects("dy: expected shape", C.bias_gelu_bwd, x[:4], x, b)
    assert cuda_on_cpu.calls == ["bias_gelu_fwd", "bias_gelu_fwd", "bias_gelu_bwd"]


def test_cuda_rejects_cpu_tensors():
    from bertfast.cuda import bias_gelu as C

    with pytest.raises(ValueError, match="expected a CUDA tensor, got device cpu"):
        C.bias_gelu_fwd(torch.randn(4, 8), torch.randn(8))
