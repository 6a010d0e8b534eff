"""kernels/layer_norm.py (bias + dropout + residual + LayerNorm) against bertfast.reference.

CPU: the Triton interpreter, fp32 and fp16, small shapes. GPU-marked: bf16/fp16 at N=4096.
Oracle: the reference in fp32 (autograd for gradients) on the same inputs, fed the kernel's own
keep-mask; fp16/bf16 follow the 2x rule (bertfast.testing.assert_close_lowp) with the reference
run in the low dtype as the yardstick.
"""
import pytest
import torch

from bertfast import reference as R
from bertfast.kernels.layer_norm import (bias_dropout_residual_layernorm_bwd as ln_bwd,
                                         bias_dropout_residual_layernorm_fwd as ln_fwd)
from bertfast.testing import assert_close_lowp

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.gpu_capable  # on CUDA when there is a GPU, else the interpreter
EPS = 1e-12
# fp32: atol 1e-5 plus rtol 1e-5 for values of size > 1.
F32 = dict(atol=1e-5, rtol=1e-5)
ROW_SUMS = ("bias", "weight", "ln_bias")


def make_inputs(n, h, dtype, has_bias, has_res, param_dtype=None, gen_seed=0):
    g = torch.Generator().manual_seed(gen_seed)
    pd = param_dtype or dtype

    def rnd(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dt).to(DEV)

    return dict(x=rnd(n, h), bias=rnd(h, dt=pd) if has_bias else None,
                residual=rnd(n, h) if has_res else None,
                weight=(1.0 + rnd(h, dt=torch.float32, scale=0.2)).to(pd),
                ln_bias=rnd(h, dt=pd, scale=0.2), dy=rnd(n, h))


def reference(inp, p, keep, dtype):
    """(y, pre_norm, {name: grad}) from the reference in `dtype`, autograd through it."""
    names = [k for k in ("x", "bias", "residual", "weight", "ln_bias") if inp[k] is not None]
    leaves = {k: inp[k].detach().to(dtype).requires_grad_() for k in names}
    get = leaves.get
    y = R.bias_dropout_residual_layernorm(get("x"), get("bias"), get("residual"), get("weight"),
                                          get("ln_bias"), EPS, p, keep)
    h = get("x") if get("bias") is None else get("x") + get("bias")
    pre = R.dropout(h, p, keep)
    pre = pre if get("residual") is None else pre + get("residual")
    grads = torch.autograd.grad(y, [leaves[k] for k in names], inp["dy"].to(dtype))
    return y.detach(), pre.detach(), dict(zip(names, grads))


def run_kernel(inp, p, seed):
    y, pre, mean, rstd, keep = ln_fwd(inp["x"], inp["bias"], inp["residual"], inp["weight"], inp["ln_bias"],
                                      EPS, p, seed, return_dropout_mask=True)
    dx, dbias, dres, dw, dlb = ln_bwd(inp["dy"], pre, mean, rstd, inp["weight"], p, seed,
                                      inp["bias"] is not None, inp["residual"] is not None)
    grads = {"x": dx, "bias": dbias, "residual": dres, "weight": dw, "ln_bias": dlb}
    return y, pre, mean, rstd, keep, {k: v for k, v in grads.items() if inp[k] is not None}


def check_against_reference(inp, p, seed, param_dtype=None):
    dtype = inp["x"].dtype
    y, pre, mean, rstd, keep, grads = run_kernel(inp, p, seed)
    y32, pre32, g32 = reference(inp, p, keep, torch.float32)
    assert y.dtype == dtype and pre.dtype == dtype
    assert mean.dtype == rstd.dtype == torch.float32
    for name, grad in grads.items():
        want = inp["x"].dtype if name in ("x", "residual") else (param_dtype or dtype)
        assert grad.dtype == want, (name, grad.dtype, want)
    # Statistics of pre_norm, in fp32.
    var, mu = torch.var_mean(pre32, dim=1, unbiased=False)
    torch.testing.assert_close(mean, mu, **F32)
    torch.testing.assert_close(rstd, torch.rsqrt(var + EPS), atol=1e-4, rtol=1e-4)
    if dtype == torch.float32:
        torch.testing.assert_close(y, y32, **F32)
        torch.testing.assert_close(pre, pre32, **F32)
        # Row sums (dbias, dweight, dln_bias) add N terms in an order other than torch's: their
        # fp32 rounding grows like sqrt(N) (4e-5 for torch itself at N=515, H=8192), so they take
        # the 2x rule with an fp64 oracle and the fp32 reference as the yardstick.
        g64 = reference(inp, p, keep, torch.float64)[2] if any(k in grads for k in ROW_SUMS) else {}
        for name, grad in grads.items():
            if name in ROW_SUMS:
                assert_close_lowp(grad, g64[name], g32[name], name=f"d{name}")
            else:
                torch.testing.assert_close(grad, g32[name], **F32, msg=lambda m: f"{name}: {m}")
    else:
        ylo, prelo, glo = reference(inp, p, keep, dtype)
        assert_close_lowp(y.float(), y32, ylo.float(), name="y")
        assert_close_lowp(pre.float(), pre32, prelo.float(), name="pre_norm")
        for name, grad in grads.items():
            assert_close_lowp(grad.float(), g32[name], glo[name].float(), name=f"d{name}")
    return keep


CASES = [  # (N, H, has_bias, has_residual, p)
    (7, 64, True, True, 0.0),
    (33, 1023, True, True, 0.1),
    (1, 768, True, True, 0.1),
    (33, 64, False, False, 0.0),     # plain LayerNorm (the MLM head transform)
    (7, 1023, True, False, 0.2),
    (33, 64, False, True, 0.5),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("n,h,has_bias,has_res,p", CASES)
def test_matches_reference(n, h, has_bias, has_res, p, dtype):
    inp = make_inputs(n, h, dtype, has_bias, has_res)
    seed = torch.tensor([1234], dtype=torch.int64, device=DEV)
    keep = check_against_reference(inp, p, seed)
    if p == 0.0:
        assert keep.all()


def test_fp32_params_with_fp16_activations():
    inp = make_inputs(7, 1023, torch.float16, True, True, param_dtype=torch.float32)
    seed = torch.tensor([5], dtype=torch.int64, device=DEV)
    check_against_reference(inp, 0.1, seed, param_dtype=torch.float32)


def test_plain_layernorm_returns_x_as_pre_norm():
    inp = make_inputs(7, 64, torch.float32, False, False)
    _, pre, _, _ = ln_fwd(inp["x"], None, None, inp["weight"], inp["ln_bias"], EPS, 0.0, None)
    assert pre is inp["x"]


def test_row_strided_inputs():
    n, h, p = 7, 1023, 0.1
    inp = make_inputs(n, h, torch.float32, True, True)
    seed = torch.tensor([99], dtype=torch.int64, device=DEV)
    wide = {k: torch.zeros(n, 2 * h, device=DEV) for k in ("x", "residual", "dy")}
    strided = dict(inp)
    for k, buf in wide.items():
        buf[:, :h] = inp[k]
        buf[:, h:] = float("nan")  # anything read past a row would poison the result
        strided[k] = buf[:, :h]
    assert strided["x"].stride() == (2 * h, 1)
    y, pre, mean, rstd, keep, grads = run_kernel(strided, p, seed)
    y_c, pre_c, _, _, keep_c, grads_c = run_kernel(inp, p, seed)
    assert torch.equal(y, y_c) and torch.equal(pre, pre_c) and torch.equal(keep, keep_c)
    for name in grads:
        assert torch.equal(grads[name], grads_c[name]), name
    # A row-strided pre_norm in the backward (e.g. a view of a wider saved buffer).
    pre_wide = torch.full((n, 2 * h), float("nan"), device=DEV)
    pre_wide[:, :h] = pre
    dx, *_ = ln_bwd(inp["dy"], pre_wide[:, :h], mean, rstd, inp["weight"], p, seed, True, True)
    assert torch.equal(dx, grads_c["x"])
    check_against_reference(strided, p, seed)


def test_clear_errors():
    inp = make_inputs(6, 64, torch.float32, True, True)
    seed = torch.tensor([1], dtype=torch.int64, device=DEV)
    x_cols = torch.randn(6, 128, device=DEV)[:, ::2]
    with pytest.raises(ValueError, match="column stride"):
        ln_fwd(x_cols, inp["bias"], inp["residual"], inp["weight"], inp["ln_bias"], EPS, 0.0, None)
    with pytest.raises(ValueError, match="column stride"):
        ln_bwd(inp["dy"], x_cols, torch.zeros(6, device=DEV), torch.ones(6, device=DEV), inp["weight"],
               0.0, None, True, True)
    with pytest.raises(ValueError, match="residual"):
        ln_fwd(inp["x"], inp["bias"], inp["residual"].half(), inp["weight"], inp["ln_bias"], EPS, 0.0, None)
    with pytest.raises(ValueError, match="seed"):
        ln_fwd(inp["x"], inp["bias"], inp["residual"], inp["weight"], inp["ln_bias"], EPS, 0.1, None)
    with pytest.raises(ValueError, match="dropout_p"):
        ln_fwd(inp["x"], inp["bias"], inp["residual"], inp["weight"], inp["ln_bias"], EPS, 1.0, seed)
    with pytest.raises(ValueError, match="hidden size"):
        big = torch.zeros(1, 8193, device=DEV)
        ln_fwd(big, None, None, big[0], big[0], EPS, 0.0, None)


def test_empty_rows():
    inp = make_inputs(0, 64, torch.float32, True, True)
    y, pre, mean, rstd = ln_fwd(inp["x"], inp["bias"], inp["residual"], inp["weight"], inp["ln_bias"],
                                EPS, 0.0, None)
    assert y.shape == (0, 64) and mean.shape == (0,)
    dx, dbias, dres, dw, dlb = ln_bwd(inp["dy"], pre, mean, rstd, inp["weight"], 0.0, None, True, True)
    assert dx.shape == (0, 64) and dres.shape == (0, 64)
    assert not dw.any() and not dlb.any() and not dbias.any()


def test_dropout_fraction_determinism_and_independence_of_launch():
    n, h = 96, 1024
    x = torch.randn(n, h, device=DEV)
    w, b = torch.ones(h, device=DEV), torch.zeros(h, device=DEV)
    s1 = torch.tensor([2024], dtype=torch.int64, device=DEV)
    s2 = torch.tensor([2025], dtype=torch.int64, device=DEV)
    for p in (0.1, 0.5):
        y1, _, _, _, keep1 = ln_fwd(x, None, None, w, b, EPS, p, s1, return_dropout_mask=True)
        drop = 1.0 - keep1.float().mean().item()
        assert abs(drop - p) < 0.01, (p, drop)
        y1b, _, _, _, keep1b = ln_fwd(x, None, None, w, b, EPS, p, s1, return_dropout_mask=True)
        assert torch.equal(keep1, keep1b) and torch.equal(y1, y1b)
        _, _, _, _, keep2 = ln_fwd(x, None, None, w, b, EPS, p, s2, return_dropout_mask=True)
        assert (keep1 != keep2).float().mean().item() > p / 2
    # The mask of a row depends on (seed, row, col, H) only: a prefix of the rows gives the same mask.
    _, _, _, _, keep_prefix = ln_fwd(x[:5], None, None, w, b, EPS, 0.5, s1, return_dropout_mask=True)
    assert torch.equal(keep_prefix, keep1[:5])
    # Neighbouring rows and 8-column groups are not copies of each other.
    assert not torch.equal(keep1[0], keep1[1])
    assert not torch.equal(keep1[:, :8], keep1[:, 8:16])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("h", [768, 1024])
def test_gpu_lowp_matches_fp32_reference(h, dtype):
    seed = torch.tensor([77], dtype=torch.int64, device=DEV)
    for has_bias, has_res, p in ((True, True, 0.1), (False, False, 0.0)):
        inp = make_inputs(4096, h, dtype, has_bias, has_res)
        check_against_reference(inp, p, seed)
    inp = make_inputs(4096, h, dtype, True, True, param_dtype=torch.float32)
    check_against_reference(inp, 0.1, seed, param_dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("h", [1023, 8192])
def test_gpu_fp32_awkward_and_large_hidden(h):
    seed = torch.tensor([3], dtype=torch.int64, device=DEV)
    check_against_reference(make_inputs(515, h, torch.float32, True, True), 0.1, seed)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU every test above takes this path")
def test_autotuned_launch_path_under_interpreter(stand_in_tuner):
    """Each pruned candidate runs once on the real buffers (pure outputs) and the best is relaunched."""
    from bertfast.kernels import layer_norm as LN

    stand_in_tuner(LN._bdrln_fwd_tuned, LN._bdrln_bwd_tuned)
    seed = torch.tensor([21], dtype=torch.int64, device=DEV)
    check_against_reference(make_inputs(37, 100, torch.float32, True, True), 0.1, seed)
    check_against_reference(make_inputs(37, 100, torch.float32, False, False), 0.0, seed)
    assert LN._bdrln_fwd_tuned.cache and LN._bdrln_bwd_tuned.cache
