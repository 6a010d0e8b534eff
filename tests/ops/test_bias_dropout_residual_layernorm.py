"""bias_dropout_residual_layernorm: the contract on every backend, then what is particular to one backend.

Contract (bertfast/ops/bias_dropout_residual_layernorm.py): y = LN(residual + Dropout(x + bias)) * weight
+ ln_bias, bias and residual optional (neither, with p = 0, is plain LayerNorm). The fwd launcher returns
(y, pre_norm, mean, rstd): y and pre_norm contiguous in x's dtype, pre_norm None exactly when it would equal x
(the backward is then given x); mean and rstd fp32, the statistics of pre_norm AS STORED (rounded to the
activation dtype). Parameter gradients in weight's dtype, reduced in fp32; 0 rows give empty outputs and zero
gradients. Dropout keeps ~1 - p, scales by 1 / (1 - p), is a function of (seed tensor, row, column) regenerated
by the backward, and return_dropout_mask=True returns the mask used; each backend draws its own stream. Triton
and CUDA serve H <= 8192, torch any H. Row-strided x / residual / dy and fp32 parameters with fp16 activations
are accepted: a row-strided input gives the same bits as its contiguous copy, and the forward's bits do not
depend on return_dropout_mask.

Oracle: bertfast.reference in fp32 with autograd, fed the mask the backend drew (fp32: atol/rtol 1e-5, gradients
by the 2x rule against fp64; fp16: the low-precision rule, docs/testing.md; low-precision parameter gradients,
fp32 sums rounded once to their dtype, take that rule before the rounding: ``check_rounded_sum``). Without a
GPU, Triton runs under the interpreter and CUDA on the CPU emulator (tests/ops/conftest.py), so shapes stay
small; bf16 only on a GPU.
"""
import pytest
import torch

from bertfast import dispatch, ops
from bertfast import reference as R
from bertfast.testing import BackendUnderTest, assert_close_lowp, check_close, max_abs_error, references, run_reference

try:  # the Triton tests skip without it (the backend fixture says why)
    import triton
    import triton.language as tl

    from bertfast.kernels._rows import exact_sum
except ImportError:
    triton = None

OP = "bias_dropout_residual_layernorm"
GPU = torch.cuda.is_available()
EPS = 1e-12
NAMES = ("x", "bias", "residual", "weight", "ln_bias")
ROW_SUMS = ("bias", "weight", "ln_bias")


def inputs(backend, n, h, dtype, has_bias=True, has_res=True, param_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    pd = param_dtype or dtype

    def rnd(*shape, dt=dtype, scale=1.0):
        return backend.tensor(*shape, dtype=dt, scale=scale, generator=g)

    return dict(x=rnd(n, h), bias=rnd(h, dt=pd) if has_bias else None, residual=rnd(n, h) if has_res else None,
                weight=(1.0 + rnd(h, dt=torch.float32, scale=0.2)).to(pd), ln_bias=rnd(h, dt=pd, scale=0.2),
                dy=rnd(n, h))


def seed_of(backend, value):
    return torch.tensor([value], dtype=torch.int64, device=backend.device)


def run(backend, inp, p, seed):
    """fwd (with its mask) then bwd of the backend's launchers: ((y, pre, mean, rstd, keep), {name: grad})."""
    impl = backend.module(OP)
    out = impl.bias_dropout_residual_layernorm_fwd(inp["x"], inp["bias"], inp["residual"], inp["weight"],
                                                   inp["ln_bias"], EPS, p, seed, return_dropout_mask=True)
    y, pre, mean, rstd, keep = out
    dx, dbias, dres, dw, dlb = impl.bias_dropout_residual_layernorm_bwd(
        inp["dy"], inp["x"] if pre is None else pre, mean, rstd, inp["weight"], p, seed,
        inp["bias"] is not None, inp["residual"] is not None)
    return out, {"x": dx, "bias": dbias, "residual": dres, "weight": dw, "ln_bias": dlb}


def half_ulp(t, dtype):
    """Half an ulp of dtype at each magnitude |t| (float64): the most one rounding to dtype moves a value."""
    info = torch.finfo(dtype)
    _, exp = torch.frexp(t.double().abs())  # |t| in [2**(exp - 1), 2**exp): an ulp is eps * 2**(exp - 1)
    half = torch.ldexp(torch.full_like(t, info.eps, dtype=torch.float64), exp - 2)
    return torch.where(t.abs() < info.tiny, info.eps * info.tiny / 2, half)  # subnormals: a fixed ulp


def check_rounded_sum(name, got, oracle, yard, factor=2.0, atol=1e-5):
    """A parameter gradient in a low-precision dtype: an fp32 row sum rounded once to that dtype (the contract).

    The low-precision rule holds for the sum before its rounding, and the rounding adds at most half an ulp of
    the dtype at each element. The yardstick's error bounds the first part only: it rounds its own sums too,
    but column by column it may land close to the oracle where the fast path's sum lands near a rounding
    midpoint (N = 9, H = 1023, fp16 on an H200: a column whose fp32 sum from the stored pre_norm, -16.4136, is
    4.2e-3 from the oracle's -16.4178 and rounds to -16.40625, 1.15e-2 off, while the yardstick's largest error
    was 5.6e-3; tests/ops/test_bias_dropout_residual_layernorm.py::test_triton_lowp_parameter_gradients_are_
    fp32_sums_rounded_once checks that rounding is the only one)."""
    assert torch.isfinite(got.float()).all(), f"{name}: NaN/inf"
    rounding = half_ulp(torch.maximum(got.double().abs().cpu(), oracle.double().abs().cpu()), got.dtype)
    err_sum = ((got.double().cpu() - oracle.double().cpu()).abs() - rounding).clamp(min=0.0).max().item()
    err_ref = max_abs_error(yard.cpu(), oracle.cpu())
    bound = factor * err_ref + atol
    assert err_sum <= bound, (f"{name}: fast-path error beyond one rounding to {got.dtype} {err_sum:.3e} exceeds "
                              f"{factor} x reference low-precision error {err_ref:.3e} + atol {atol:.1e} = {bound:.3e}")


def check(backend, inp, p, seed):
    """The backend's launchers against the reference fed their own mask; returns run()'s result."""
    (y, pre, mean, rstd, keep), grads = run(backend, inp, p, seed)
    x, dtype = inp["x"], inp["x"].dtype
    n, h = x.shape
    plain = inp["bias"] is None and inp["residual"] is None and p == 0.0
    assert (pre is None) == plain, "pre_norm is None exactly when it would equal x"
    assert y.dtype == dtype and y.is_contiguous()
    assert plain or (pre.dtype == dtype and pre.is_contiguous())
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == rstd.shape == (n,)
    assert keep.dtype == torch.bool and keep.shape == (n, h)
    assert p > 0.0 or keep.all()
    for name, grad in grads.items():
        if inp[name] is None:
            assert grad is None, name
            continue
        want = dtype if name in ("x", "residual") else inp["weight"].dtype
        assert grad.dtype == want, (name, grad.dtype, want)
        assert name in ROW_SUMS or grad.is_contiguous(), name

    # The statistics are those of pre_norm as stored (x itself for plain LayerNorm).
    var, mu = torch.var_mean((x if plain else pre).float(), dim=1, unbiased=False)
    torch.testing.assert_close(mean, mu, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rstd, torch.rsqrt(var + EPS), atol=0, rtol=1e-4)

    tensors = [inp[k] for k in NAMES]
    fn = lambda x_, b_, r_, w_, lb_: R.bias_dropout_residual_layernorm(x_, b_, r_, w_, lb_, EPS, p, keep)  # noqa: E731
    (y32, g32), (ylo, glo) = references(fn, tensors, dtype, inp["dy"])
    check_close("y", y, y32, ylo, dtype)
    if pre is not None:
        def pre_fn(x_, b_, r_):
            d = R.dropout(x_ if b_ is None else x_ + b_, p, keep)
            return d if r_ is None else d + r_
        (p32, _), (plo, _) = references(pre_fn, tensors[:3], dtype)
        check_close("pre_norm", pre, p32, plo, dtype)
    if dtype == torch.float32:
        # Gradients sum over H columns (dx) or N rows (the parameters) in another order than torch; their fp32
        # rounding grows with the sums, so they take the 2x rule with an fp64 oracle and the fp32 reference
        # as the yardstick.
        g64 = run_reference(fn, tensors, torch.float64, inp["dy"].double())[1]
        for i, name in enumerate(NAMES):
            if inp[name] is not None:
                assert_close_lowp(grads[name].double().cpu(), g64[i].cpu(), g32[i].double().cpu(), name=f"d{name}")
    else:
        for i, name in enumerate(NAMES):
            if inp[name] is None:
                continue
            if name in ROW_SUMS and grads[name].dtype != torch.float32:
                check_rounded_sum(f"d{name}", grads[name], g32[i], glo[i])
            else:
                check_close(f"d{name}", grads[name], g32[i], glo[i], dtype)
    return (y, pre, mean, rstd, keep), grads


# =========================================================================== the contract, every backend
CASES = [  # (N, H, has_bias, has_residual, p): every bias/residual combination with and without dropout
    (7, 64, True, True, 0.0),
    (9, 1023, True, True, 0.1),      # awkward H
    (1, 96, True, True, 0.1),        # one row
    (16, 64, False, False, 0.0),     # plain LayerNorm (the MLM head transform)
    (5, 64, False, False, 0.5),      # dropout alone: pre_norm differs from x
    (7, 333, True, False, 0.2),
    (16, 40, True, False, 0.0),
    (13, 64, False, True, 0.5),
    (6, 100, False, True, 0.0),
    (45, 64, True, True, 0.1),      # backward: three programs of four tiles (two in flight), a partial last
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("n,h,has_bias,has_res,p", CASES)
def test_matches_reference(backend, n, h, has_bias, has_res, p, dtype):
    check(backend, inputs(backend, n, h, dtype, has_bias, has_res), p, seed_of(backend, 1234))


def test_statistics_describe_rounded_pre_norm(backend):
    # fp16 holds only integers in [1024, 2048): rounding pre_norm there moves every element by up to 0.5, so
    # statistics (and a y) of the unrounded sum would miss the tolerances below by far.
    n, h, p = 4, 256, 0.1
    inp = inputs(backend, n, h, torch.float16)
    inp["residual"] = inp["residual"] + 1536
    seed = seed_of(backend, 7)
    impl = backend.module(OP)
    y, pre, mean, rstd, keep = impl.bias_dropout_residual_layernorm_fwd(
        inp["x"], inp["bias"], inp["residual"], inp["weight"], inp["ln_bias"], EPS, p, seed, return_dropout_mask=True)
    w, lb = inp["weight"].double(), inp["ln_bias"].double()

    def stats_and_y(z):
        var, mu = torch.var_mean(z, dim=1, unbiased=False)
        rs = torch.rsqrt(var + EPS)
        return mu, rs, (z - mu[:, None]) * rs[:, None] * w + lb

    mu, rs, want = stats_and_y(pre.double())
    torch.testing.assert_close(mean.double(), mu, atol=1e-3, rtol=0)  # fp32 sums of values near 1536
    torch.testing.assert_close(rstd.double(), rs, atol=0, rtol=1e-4)
    torch.testing.assert_close(y.double(), want, atol=2e-3, rtol=1e-3)  # about one fp16 ulp of y
    # The statistics of the exact sum fail these checks: the test tells the two apart.
    exact_mu, exact_rs, exact_y = stats_and_y(inp["residual"].double()
                                              + R.dropout(inp["x"].double() + inp["bias"].double(), p, keep))
    assert ((mean.double() - exact_mu).abs() > 1e-2).any()
    assert ((rstd.double() - exact_rs).abs() > 1e-3 * rs).any()
    assert (y.double() - exact_y).abs().max() > 0.1


def test_fp32_params_with_fp16_activations(backend):
    inp = inputs(backend, 7, 264, torch.float16, param_dtype=torch.float32)
    _, grads = check(backend, inp, 0.1, seed_of(backend, 5))
    assert grads["bias"].dtype == grads["weight"].dtype == grads["ln_bias"].dtype == torch.float32


def assert_same_bits(name, got, want):
    """got and want bit for bit, or an error saying how many elements differ, where and by how much."""
    if got is None or want is None:
        assert got is None and want is None, name
        return
    differ = got != want
    if differ.any():
        where = differ.nonzero()[:4].tolist()
        gap = (got.double() - want.double()).abs().max().item() if got.is_floating_point() else None
        raise AssertionError(f"{name}: {int(differ.sum())} of {differ.numel()} elements differ (first at "
                             f"{where}), largest difference {gap}")


def test_row_strided_inputs(backend):
    n, h, p = 9, 200, 0.1
    inp = inputs(backend, n, h, torch.float32)
    seed = seed_of(backend, 99)
    strided = dict(inp)
    for k in ("x", "residual", "dy"):
        wide = torch.full((n, 2 * h), float("nan"), device=backend.device)  # a read past a row poisons the result
        wide[:, :h] = inp[k]
        strided[k] = wide[:, :h]
    (y, pre, mean, rstd, keep), grads = check(backend, strided, p, seed)
    (y_c, pre_c, mean_c, rstd_c, keep_c), grads_c = run(backend, inp, p, seed)
    # Each output by name, and how it differs: a failure on a GPU says where to look. The mask and
    # pre_norm are elementwise: the same bits. What goes through a row reduction may differ in the
    # last bit or two: Triton specialises a kernel on its strides (400 is a multiple of 16, 200 not),
    # and the two compiles lay the row out differently (the H100 run of 2026-11-26: y differed in 107
    # of 1800 elements by at most 2.4e-7, mean and rstd equal). A read past the row gives NaN.
    for name, got, want in (("keep", keep, keep_c), ("pre_norm", pre, pre_c)):
        assert_same_bits(name, got, want)
    for name, got, want in (("mean", mean, mean_c), ("rstd", rstd, rstd_c), ("y", y, y_c)) + tuple(
            (f"d{k}", grads[k], grads_c[k]) for k in NAMES):
        if got is None or want is None:
            assert got is None and want is None, name
            continue
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    # A row-strided pre_norm in the backward (a view of a wider saved buffer).
    pre_wide = torch.full((n, 2 * h), float("nan"), device=backend.device)
    pre_wide[:, :h] = pre
    dx = backend.module(OP).bias_dropout_residual_layernorm_bwd(inp["dy"], pre_wide[:, :h], mean, rstd,
                                                                inp["weight"], p, seed, True, True)[0]
    torch.testing.assert_close(dx, grads_c["x"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("has_bias,has_res,p", [(True, True, 0.1), (False, False, 0.0)])
def test_empty_rows(backend, has_bias, has_res, p):
    inp = inputs(backend, 0, 64, torch.float16, has_bias, has_res, param_dtype=torch.float32)
    (y, pre, mean, rstd, keep), grads = run(backend, inp, p, seed_of(backend, 1))
    assert y.shape == (0, 64) and mean.shape == rstd.shape == (0,) and keep.shape == (0, 64)
    assert (pre is None) == (not has_bias and not has_res and p == 0.0)
    assert grads["x"].shape == (0, 64)
    assert (grads["residual"] is not None) == has_res and (not has_res or grads["residual"].shape == (0, 64))
    for name in ROW_SUMS:
        if inp[name] is not None:
            g = grads[name]
            assert g.shape == (64,) and g.dtype == torch.float32 and not g.any(), name
    # Through the op: an empty y and zero parameter gradients.
    w = inp["weight"].clone().requires_grad_()
    lb = inp["ln_bias"].clone().requires_grad_()
    with backend.forced():
        y = ops.bias_dropout_residual_layernorm(inp["x"].view(0, 3, 64), inp["bias"],
                                                None if inp["residual"] is None else inp["residual"].view(0, 3, 64),
                                                w, lb, EPS, p)
    assert y.shape == (0, 3, 64)
    y.sum().backward()
    assert w.grad.shape == (64,) and not w.grad.any() and not lb.grad.any()


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keep_fraction_scale_and_seed(backend, p):
    n, h = 16, 512  # 8K draws: the keep fraction's sigma is at most 0.0055
    x = backend.tensor(n, h)
    w, lb = torch.ones(h, device=backend.device), torch.zeros(h, device=backend.device)
    fwd = backend.module(OP).bias_dropout_residual_layernorm_fwd
    y1, pre1, _, _, keep1 = fwd(x, None, None, w, lb, EPS, p, seed_of(backend, 2024), return_dropout_mask=True)
    assert abs((1.0 - keep1.float().mean().item()) - p) < 0.03
    torch.testing.assert_close(pre1, torch.where(keep1, x / (1.0 - p), 0.0), atol=0, rtol=1e-6)  # kept: / (1 - p)
    y2, pre2, _, _, keep2 = fwd(x, None, None, w, lb, EPS, p, seed_of(backend, 2024), return_dropout_mask=True)
    assert torch.equal(keep1, keep2) and torch.equal(pre1, pre2) and torch.equal(y1, y2)
    keep3 = fwd(x, None, None, w, lb, EPS, p, seed_of(backend, 2025), return_dropout_mask=True)[4]
    differ = (keep1 != keep3).float().mean().item()
    assert abs(differ - 2 * p * (1 - p)) < 0.03, differ  # another seed: an independent mask
    # Neighbouring rows and column groups are not copies of each other (counter layout).
    assert not torch.equal(keep1[0], keep1[1])
    assert not torch.equal(keep1[:, :8], keep1[:, 8:16])


def test_fused_dropout_mask_is_a_function_of_row_and_column(fused_backend):
    # Triton and CUDA key Philox by (seed, row, column): the first rows of a taller input draw the same mask.
    n, h, p = 12, 64, 0.5
    x = fused_backend.tensor(n, h)
    w, lb = torch.ones(h, device=fused_backend.device), torch.zeros(h, device=fused_backend.device)
    fwd = fused_backend.module(OP).bias_dropout_residual_layernorm_fwd
    seed = seed_of(fused_backend, 31)
    keep = fwd(x, None, None, w, lb, EPS, p, seed, return_dropout_mask=True)[4]
    assert torch.equal(fwd(x[:5], None, None, w, lb, EPS, p, seed, return_dropout_mask=True)[4], keep[:5])


def leaves(inp, names):
    return {k: None if inp[k] is None else inp[k].detach().clone().requires_grad_() for k in names}


@pytest.mark.parametrize("plain", [True, False], ids=["layer_norm", "bias_residual"])
def test_op_autograd_matches_reference(backend, plain):
    inp = inputs(backend, 6, 40, torch.float32, has_bias=not plain, has_res=not plain)
    t = leaves(inp, NAMES)
    x3 = t["x"].view(2, 3, 40)
    r3 = None if plain else t["residual"].view(2, 3, 40)
    with backend.forced():
        y = ops.bias_dropout_residual_layernorm(x3, t["bias"], r3, t["weight"], t["ln_bias"], EPS)
    assert y.shape == (2, 3, 40)
    y.backward(inp["dy"].view(2, 3, 40))
    fn = lambda x_, b_, r_, w_, lb_: R.bias_dropout_residual_layernorm(x_, b_, r_, w_, lb_, EPS)  # noqa: E731
    (y32, g32), _ = references(fn, [inp[k] for k in NAMES], torch.float32, inp["dy"])
    check_close("y", y.view(6, 40), y32, None, torch.float32)
    for i, name in enumerate(NAMES):
        if inp[name] is None:
            assert t[name] is None
            continue
        check_close(f"d{name}", t[name].grad, g32[i], None, torch.float32, atol=1e-4 if name in ROW_SUMS else 1e-5)


def test_op_backward_regenerates_the_forward_mask(backend):
    # The custom op with an explicit seed: its forward and its autograd backward draw the mask the
    # launcher returns for that seed.
    n, h, p = 6, 64, 0.5
    inp = inputs(backend, n, h, torch.float32)
    seed = seed_of(backend, 77)
    keep = backend.module(OP).bias_dropout_residual_layernorm_fwd(inp["x"], inp["bias"], inp["residual"],
                                                                  inp["weight"], inp["ln_bias"], EPS, p, seed,
                                                                  return_dropout_mask=True)[4]
    t = leaves(inp, NAMES)
    y, pre, _, _ = torch.ops.bertfast.bias_dropout_residual_layernorm(*(t[k] for k in NAMES), EPS, p, seed,
                                                                      backend.name)
    y.backward(inp["dy"])
    fn = lambda x_, b_, r_, w_, lb_: R.bias_dropout_residual_layernorm(x_, b_, r_, w_, lb_, EPS, p, keep)  # noqa: E731
    (y32, g32), _ = references(fn, [inp[k] for k in NAMES], torch.float32, inp["dy"])
    torch.testing.assert_close(pre, inp["residual"] + torch.where(keep, (inp["x"] + inp["bias"]) / (1 - p), 0.0))
    check_close("y", y, y32, None, torch.float32)
    for i, name in enumerate(NAMES):
        check_close(f"d{name}", t[name].grad, g32[i], None, torch.float32, atol=1e-4 if name in ROW_SUMS else 1e-5)


def test_hidden_size_beyond_fused_limits(backend):
    h = 8200
    x = backend.tensor(2, h)
    w, lb = backend.tensor(h), backend.tensor(h)
    args = dict(x=x, bias=None, residual=None, weight=w, ln_bias=lb)
    reasons = dispatch.get(OP, backend.name).reasons(True, **args)
    if backend.name == "torch":
        assert reasons == []
        with backend.forced():
            y = ops.bias_dropout_residual_layernorm(x, None, None, w, lb, EPS)
        check_close("y", y, R.layer_norm(x, w, lb, EPS), None, torch.float32)
    else:
        assert any("hidden size 8200" in r for r in reasons), reasons
        with backend.forced(), pytest.raises(dispatch.NoBackendError, match=f"{backend.name}.*hidden size 8200"):
            ops.bias_dropout_residual_layernorm(x, None, None, w, lb, EPS)
    # Unforced, dispatch passes the fused backends over for torch.
    assert dispatch.select(OP, **args) == "torch"
    check_close("y", ops.bias_dropout_residual_layernorm(x, None, None, w, lb, EPS), R.layer_norm(x, w, lb, EPS),
                None, torch.float32)


def test_launcher_errors_are_clear(fused_backend):
    impl = fused_backend.module(OP)
    fwd, bwd = impl.bias_dropout_residual_layernorm_fwd, impl.bias_dropout_residual_layernorm_bwd
    inp = inputs(fused_backend, 6, 64, torch.float32)
    x, b, r, w, lb, dy = (inp[k] for k in ("x", "bias", "residual", "weight", "ln_bias", "dy"))
    dev = fused_backend.device
    seed = seed_of(fused_backend, 1)
    columns = torch.randn(6, 128, device=dev)[:, ::2]
    mean, rstd = torch.zeros(6, device=dev), torch.ones(6, device=dev)
    with pytest.raises(ValueError, match="column stride"):
        fwd(columns, b, r, w, lb, EPS, 0.0, None)
    with pytest.raises(ValueError, match="column stride"):
        bwd(dy, columns, mean, rstd, w, 0.0, None, True, True)
    with pytest.raises(ValueError, match="residual"):
        fwd(x, b, r.half(), w, lb, EPS, 0.0, None)
    with pytest.raises(ValueError, match="ln_bias"):
        fwd(x, b, r, w, lb[:63], EPS, 0.0, None)
    with pytest.raises(ValueError, match="seed"):
        fwd(x, b, r, w, lb, EPS, 0.1, None)
    with pytest.raises(ValueError, match="dropout_p"):
        fwd(x, b, r, w, lb, EPS, 1.0, seed)
    with pytest.raises(ValueError, match="eps"):
        fwd(x, b, r, w, lb, float("nan"), 0.0, None)
    with pytest.raises(ValueError, match="rstd"):
        bwd(dy, x, mean, rstd[:5], w, 0.0, None, True, True)
    with pytest.raises(ValueError, match="(dy|pre_norm): expected dtype"):  # dy and pre_norm share a dtype
        bwd(dy.half(), x, mean, rstd, w, 0.0, None, True, True)
    with pytest.raises(ValueError, match="hidden size"):
        wide = torch.zeros(1, 8193, device=dev)
        fwd(wide, None, None, wide[0], wide[0], EPS, 0.0, None)


def test_op_errors_are_clear():
    x, v = torch.randn(2, 4), torch.randn(4)
    with pytest.raises(ValueError, match=r"expected bias of shape \[4\]"):
        ops.bias_dropout_residual_layernorm(x, torch.randn(3), None, v, v, EPS)
    with pytest.raises(ValueError, match=r"expected weight of shape \[4\]"):
        ops.bias_dropout_residual_layernorm(x, None, None, torch.randn(5), v, EPS)
    with pytest.raises(ValueError, match="expected residual of shape"):
        ops.bias_dropout_residual_layernorm(x, None, x[:1], v, v, EPS)
    with pytest.raises(ValueError, match="dropout_p"):
        ops.bias_dropout_residual_layernorm(x, None, None, v, v, EPS, 1.0)


@pytest.mark.parametrize("full", [True, False], ids=["bias_residual_dropout", "layer_norm"])
def test_opcheck(backend, full):
    leaf = lambda *shape: backend.tensor(*shape).requires_grad_()  # noqa: E731
    if full:
        args = (leaf(4, 6), leaf(6), leaf(4, 6), leaf(6), leaf(6), 1e-5, 0.1, seed_of(backend, 7), backend.name)
    else:
        args = (leaf(4, 6), None, None, leaf(6), leaf(6), 1e-5, 0.0, None, backend.name)
    torch.library.opcheck(torch.ops.bertfast.bias_dropout_residual_layernorm, args)


# =========================================================================== GPU sizes
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("h", [312, 384, 768, 1024])
def test_gpu_lowp_bert_sizes(backend, h, dtype):
    seed = seed_of(backend, 77)
    check(backend, inputs(backend, 4096, h, dtype), 0.1, seed)
    check(backend, inputs(backend, 4096, h, dtype, has_bias=False, has_res=False), 0.0, seed)
    check(backend, inputs(backend, 4096, h, dtype, param_dtype=torch.float32), 0.1, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("has_bias,has_res", [(True, True), (False, True), (True, False), (False, False)])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_gpu_bf16_every_combination(backend, has_bias, has_res, p):
    check(backend, inputs(backend, 67, 1023, torch.bfloat16, has_bias, has_res), p, seed_of(backend, 1234))


@pytest.mark.gpu
@pytest.mark.parametrize("h", [1023, 8192])
def test_gpu_fp32_awkward_and_largest_hidden(backend, h):
    check(backend, inputs(backend, 515, h, torch.float32), 0.1, seed_of(backend, 3))


@pytest.mark.gpu
def test_gpu_bf16_fp32_params_and_row_stride(backend):
    n, h = 67, 1024
    inp = inputs(backend, n, h, torch.bfloat16, param_dtype=torch.float32)
    big = backend.tensor(n, h + 64, dtype=torch.bfloat16)
    big[:, :h] = inp["x"]
    inp["x"] = big[:, :h]  # row stride h + 64: the CUDA 128-bit path with a row stride
    _, grads = check(backend, inp, 0.0, None)
    assert grads["bias"].dtype == grads["weight"].dtype == torch.float32


@pytest.mark.gpu
def test_gpu_dropout_fraction_and_seed(backend):
    n, h, p = 512, 1024, 0.1
    x = backend.tensor(n, h, dtype=torch.float16)
    w, lb = torch.ones(h, device=backend.device), torch.zeros(h, device=backend.device)
    fwd = backend.module(OP).bias_dropout_residual_layernorm_fwd
    keep1, keep2, keep3 = (fwd(x, None, None, w, lb, EPS, p, seed_of(backend, s), return_dropout_mask=True)[4]
                           for s in (5, 5, 6))
    dropped = 1.0 - keep1.float().mean().item()
    assert abs(dropped - p) < 0.005, dropped  # 512K draws: sigma = 0.0004
    assert torch.equal(keep1, keep2)
    differ = (keep1 != keep3).float().mean().item()
    assert abs(differ - 2 * p * (1 - p)) < 0.01, differ


# =========================================================================== Triton
@pytest.mark.skipif(GPU, reason="on a GPU every Triton test above takes this path")
def test_triton_autotuned_launch_path_under_interpreter(stand_in_tuner):
    """Each pruned candidate runs once on the real buffers (pure outputs) and the best is relaunched."""
    from bertfast.kernels import bias_dropout_residual_layernorm as LN

    stand_in_tuner(LN._fwd_tuned, LN._bwd_tuned)
    triton = BackendUnderTest("triton", torch.device("cpu"))
    seed = seed_of(triton, 21)
    check(triton, inputs(triton, 37, 100, torch.float32), 0.1, seed)
    check(triton, inputs(triton, 37, 100, torch.float32, has_bias=False, has_res=False), 0.0, seed)
    assert len(LN._fwd_tuned.cache) == 2 and len(LN._bwd_tuned.cache) == 2


@pytest.mark.skipif(GPU, reason="sets the interpreter's tile; on a GPU the autotuner picks it")
def test_triton_results_do_not_depend_on_the_tile_or_row_groups(monkeypatch):
    """The mask is keyed by (seed, row, column), never the tile; the backward's row groups
    (several programs, a partial last one) add their partial sums correctly; the forward gives the
    same bits as row groups (three programs under the interpreter, the last partial) and as one tile
    a program."""
    from bertfast.kernels import _rows
    from bertfast.kernels import bias_dropout_residual_layernorm as LN

    triton = BackendUnderTest("triton", torch.device("cpu"))
    n, h, p = 37, 100, 0.5
    assert _rows.row_groups(n, triton.device, LN.BWD_PROGRAMS_PER_SM) == (3, 16)  # programs of 16, 16 and 5 rows
    assert _rows.row_group_shape(16384, 8 * 132) == (1024, 16)  # BERT-large's 16K rows on an H100
    inp = inputs(triton, n, h, torch.float32)
    seed = seed_of(triton, 8)
    (y, pre, mean, rstd, keep), grads = check(triton, inp, p, seed)
    assert LN.FWD_INTERP["ROW_GROUPS"]  # the runs above: row groups of 16 rows (16, 16 and 5)
    monkeypatch.setattr(LN, "interpreter_rows", lambda block_h, cap: 1)  # one row per tile
    (y1, pre1, _, _, keep1), grads1 = run(triton, inp, p, seed)
    assert torch.equal(keep1, keep) and torch.equal(pre1, pre) and torch.equal(y1, y)
    for name in NAMES:
        torch.testing.assert_close(grads1[name], grads[name], atol=1e-5, rtol=1e-5)
    # the forward as one tile a program (a program per row, then per 16 rows, the last partial)
    x, bias, res, w, lb = (inp[k] for k in ("x", "bias", "residual", "weight", "ln_bias"))
    monkeypatch.setitem(LN.FWD_INTERP, "ROW_GROUPS", 0)
    for rows in (1, 16):
        monkeypatch.setattr(LN, "interpreter_rows", lambda block_h, cap, rows=rows: rows)
        outs = LN.bias_dropout_residual_layernorm_fwd(x, bias, res, w, lb, EPS, p, seed, return_dropout_mask=True)
        y2, pre2, mean2, rstd2, keep2 = outs
        assert torch.equal(keep2, keep) and torch.equal(pre2, pre) and torch.equal(y2, y), rows
        assert torch.equal(mean2, mean) and torch.equal(rstd2, rstd), rows


if triton is not None:
    @triton.jit
    def _exact_sum_kernel(X, ROWS, COLS, M: tl.constexpr, N: tl.constexpr):
        """Row and column sums of an [M, N] fp32 tensor by _rows.exact_sum, in one program."""
        x = tl.load(X + tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :])
        tl.store(ROWS + tl.arange(0, M), exact_sum(x, 1))
        tl.store(COLS + tl.arange(0, N), exact_sum(x, 0))


def exact_sums(x):
    m, n = x.shape
    rows, cols = torch.empty(m, device=x.device), torch.empty(n, device=x.device)
    _exact_sum_kernel[(1,)](x.contiguous(), rows, cols, m, n)
    return rows, cols


@pytest.mark.parametrize("backend", ["triton"], indirect=True)
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast", "ignore:overflow encountered in multiply")
def test_triton_exact_sum_is_order_free_and_accurate(backend):  # (numpy's warnings on the inf and NaN rows)
    """_rows.exact_sum, behind every row and column sum of the LayerNorm kernels: the same bits for any order
    of the terms (a plain tl.sum adds in the order of the register layout, which a row stride's alignment or
    another store in the kernel changes), within an fp32 rounding of the exact sum, NaN for NaN or inf."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 1024, generator=g, dtype=torch.float64)
    x[1] += 1000.0                                   # a large mean: cancellation
    x[2] *= torch.logspace(-30, 0, 1024, dtype=torch.float64)  # thirty decades in one row
    x[3] *= 1e-20                                    # the scale follows the row's magnitude
    x[4] *= 1e30
    x[5, ::2] = -x[5, 1::2]                          # a sum of exactly 0
    x[6] *= 1e-30                                    # below 2**-77: terms kept to 2**-126
    x[7] = 0.0
    x = x.float()
    rows, cols = exact_sums(x.to(backend.device))
    exact = torch.tensor([sum(sorted(r.tolist(), key=abs)) for r in x.double()], dtype=torch.float64)
    err = (rows.double().cpu() - exact).abs()
    assert (err[:6] <= 2.0 ** -24 * exact[:6].abs()).all(), (rows, exact)  # one fp32 rounding
    assert err[6] <= 1024 * 2.0 ** -126 and rows[5] == 0 and rows[7] == 0
    col_exact = x.double().sum(0)  # terms of one column differ by up to 30 decades: the row-1 term leads
    assert ((cols.double().cpu() - col_exact).abs() <= 2.0 ** -24 * col_exact.abs() + 1e-6).all()
    # Any order of the terms: the same bits.
    for seed in range(3):
        perm = torch.randperm(1024, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(exact_sums(x[:, perm].to(backend.device))[0], rows)
        assert torch.equal(exact_sums(x[torch.randperm(8, generator=g)].to(backend.device))[1], cols)
    bad = torch.randn(2, 16)
    bad[0, 3], bad[1, 5] = float("inf"), float("nan")
    rows, cols = exact_sums(bad.to(backend.device))
    assert rows.isnan().all() and cols[3].isnan() and cols[5].isnan() and cols[[0, 1, 2, 4]].isfinite().all()


@pytest.mark.parametrize("backend", ["triton"], indirect=True)
@pytest.mark.parametrize("has_bias,has_res", [(True, True), (False, False)])
def test_triton_results_do_not_depend_on_the_order_of_additions(backend, has_bias, has_res):
    """Permuting the columns of every input permutes every output and gradient, bit for bit, and leaves mean and
    rstd as they are: no sum depends on the order in which its terms are added. On a GPU that order follows the
    register layout Triton picks, which a row stride's alignment or the keep-mask store changes (a plain tl.sum
    gave a strided input and its contiguous copy other last bits); under the interpreter, on numpy's order."""
    n, h = 9, 200
    inp = inputs(backend, n, h, torch.float32, has_bias, has_res)
    perm = torch.randperm(h, generator=torch.Generator().manual_seed(5)).to(backend.device)
    permuted = {k: None if v is None else v[..., perm] for k, v in inp.items()}
    (y, pre, mean, rstd, _), grads = run(backend, inp, 0.0, None)  # p = 0: the mask is keyed by column
    (y_p, pre_p, mean_p, rstd_p, _), grads_p = run(backend, permuted, 0.0, None)
    assert torch.equal(mean_p, mean) and torch.equal(rstd_p, rstd)
    assert torch.equal(y_p, y[:, perm]) and (pre is None or torch.equal(pre_p, pre[:, perm]))
    for name in NAMES:
        if inp[name] is not None:
            assert torch.equal(grads_p[name], grads[name][..., perm]), name


@pytest.mark.parametrize("backend", ["triton"], indirect=True)
def test_triton_lowp_parameter_gradients_are_fp32_sums_rounded_once(backend):
    """fp16 parameter gradients are the fp32 sums rounded once (no fp16 partials or accumulation): the
    backward given the fp16 weight returns exactly its result for the same weight in fp32, rounded; and those
    fp32 sums hold the low-precision rule (check_rounded_sum's case: N = 9, H = 1023, fp16, p = 0.1)."""
    inp = inputs(backend, 9, 1023, torch.float16)
    seed = seed_of(backend, 1234)
    (y, pre, mean, rstd, keep), grads = run(backend, inp, 0.1, seed)
    dx32, dbias32, dres32, dw32, dlb32 = backend.module(OP).bias_dropout_residual_layernorm_bwd(
        inp["dy"], pre, mean, rstd, inp["weight"].float(), 0.1, seed, True, True)
    assert dw32.dtype == dlb32.dtype == dbias32.dtype == torch.float32
    for name, sum32 in (("bias", dbias32), ("weight", dw32), ("ln_bias", dlb32)):
        assert torch.equal(grads[name], sum32.half()), name
    assert torch.equal(dx32, grads["x"]) and torch.equal(dres32, grads["residual"])
    fn = lambda x_, b_, r_, w_, lb_: R.bias_dropout_residual_layernorm(x_, b_, r_, w_, lb_, EPS, 0.1, keep)  # noqa: E731
    (_, g32), (_, glo) = references(fn, [inp[k] for k in NAMES], torch.float16, inp["dy"])
    for i, (name, sum32) in enumerate(zip(NAMES, (None, dbias32, None, dw32, dlb32))):
        if sum32 is not None:
            assert_close_lowp(sum32.double().cpu(), g32[i].double().cpu(), glo[i].double().cpu(), name=f"d{name}")


# =========================================================================== CUDA wrapper validation (no GPU)
def test_cuda_validation(cuda_on_cpu):
    from bertfast.cuda import bias_dropout_residual_layernorm as C

    x = torch.randn(6, 40, dtype=torch.bfloat16)
    w = torch.randn(40)
    seed = torch.tensor([3])
    fwd, bwd = C.bias_dropout_residual_layernorm_fwd, C.bias_dropout_residual_layernorm_bwd
    cuda_on_cpu.reaches(fwd, x, w, x, w, w, 1e-12, 0.1, seed)
    cuda_on_cpu.reaches(fwd, x, None, None, w, w, 1e-12, 0.0, None, return_dropout_mask=True)
    cuda_on_cpu.reaches(fwd, torch.randn(6, 64, dtype=torch.bfloat16)[:, :40], None, x, w, w, 1e-5, 0.0, None)
    mean, rstd = torch.zeros(6), torch.ones(6)
    cuda_on_cpu.reaches(bwd, x, x, mean, rstd, w, 0.1, seed, True, True)
    cuda_on_cpu.rejects("seed: expected an int64 tensor", fwd, x, w, x, w, w, 1e-12, 0.1, None)
    cuda_on_cpu.rejects(r"seed: expected shape \(1,\)", fwd, x, w, x, w, w, 1e-12, 0.1, torch.tensor([1, 2]))
    cuda_on_cpu.rejects("seed: expected dtype", fwd, x, w, x, w, w, 1e-12, 0.1, torch.tensor([1], dtype=torch.int32))
    cuda_on_cpu.rejects(r"dropout_p: expected a float in \[0, 1\)", fwd, x, w, x, w, w, 1e-12, 1.0, seed)
    cuda_on_cpu.rejects("residual: expected dtype", fwd, x, w, x.float(), w, w, 1e-12, 0.0, None)
    cuda_on_cpu.rejects("residual: expected shape", fwd, x, w, x[:5], w, w, 1e-12, 0.0, None)
    cuda_on_cpu.rejects(r"weight: expected shape \(40,\)", fwd, x, w, x, w[:39], w, 1e-12, 0.0, None)
    cuda_on_cpu.rejects("hidden size in", fwd, torch.randn(2, 8200), None, None, torch.ones(8200), torch.ones(8200),
                        1e-12, 0.0, None)
    cuda_on_cpu.rejects("eps", fwd, x, w, x, w, w, float("nan"), 0.0, None)
    cuda_on_cpu.rejects("stride", fwd, torch.randn(40, 6, dtype=torch.bfloat16).t(), w, None, w, w, 1e-12, 0.0, None)
    cuda_on_cpu.rejects(r"mean: expected dtype in \['torch.float32'\]", bwd, x, x, mean.half(), rstd, w, 0.0, None,
                        True, True)
    cuda_on_cpu.rejects(r"rstd: expected shape \(6,\)", bwd, x, x, mean, rstd[:5], w, 0.0, None, True, True)
    cuda_on_cpu.rejects("dy: expected dtype", bwd, x.float(), x, mean, rstd, w, 0.0, None, False, False)
    assert cuda_on_cpu.calls == ["bias_dropout_residual_layernorm_fwd"] * 3 + ["bias_dropout_residual_layernorm_bwd"]


def test_cuda_rejects_cpu_tensors():
    from bertfast.cuda import bias_dropout_residual_layernorm as C

    x, b = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(ValueError, match="expected a CUDA tensor, got device cpu"):
        C.bias_dropout_residual_layernorm_fwd(x, b, x, b, b, 1e-12, 0.0, None)
    with pytest.raises(ValueError, match="expected a CUDA tensor, got device cpu"):
        C.bias_dropout_residual_layernorm_bwd(x, x, torch.zeros(4), torch.ones(4), b, 0.0, None, True, True)
