"""kernels/bias_gelu.py against bertfast.reference.bias_gelu (exact erf and tanh GELU).

CPU: the Triton interpreter, fp32 and fp16, small shapes. GPU-marked: bf16/fp16 at N=4096.
Oracle: the reference in fp32 with autograd; low precision by the 2x rule.
"""
import pytest
import torch

from bertfast import reference as R
from bertfast.kernels.bias_gelu import bias_gelu_bwd, bias_gelu_fwd
from bertfast.testing import assert_close_lowp

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.gpu_capable  # on CUDA when there is a GPU, else the interpreter
# fp32: atol 1e-5 plus rtol 1e-5 for values of size > 1.
F32 = dict(atol=1e-5, rtol=1e-5)


def make_inputs(n, f, dtype, bias_dtype=None, scale=1.0, gen_seed=0):
    g = torch.Generator().manual_seed(gen_seed)
    x = (torch.randn(n, f, generator=g) * scale).to(dtype).to(DEV)
    bias = torch.randn(f, generator=g).to(bias_dtype or dtype).to(DEV)
    dy = torch.randn(n, f, generator=g).to(dtype).to(DEV)
    return x, bias, dy


def reference(x, bias, dy, approximate, dtype):
    xr = x.detach().to(dtype).requires_grad_()
    br = bias.detach().to(dtype).requires_grad_()
    y = R.bias_gelu(xr, br, approximate)
    dx, db = torch.autograd.grad(y, [xr, br], dy.to(dtype))
    return y.detach(), dx, db


def check(x, bias, dy, approximate):
    y = bias_gelu_fwd(x, bias, approximate)
    dx, db = bias_gelu_bwd(dy, x, bias, approximate)
    assert y.dtype == dx.dtype == x.dtype and db.dtype == bias.dtype
    assert y.is_contiguous() and dx.is_contiguous()
    y32, dx32, db32 = reference(x, bias, dy, approximate, torch.float32)
    if x.dtype == torch.float32:
        torch.testing.assert_close(y, y32, **F32)
        torch.testing.assert_close(dx, dx32, **F32)
        # dbias sums N terms in an order other than torch's; its fp32 rounding grows like sqrt(N),
        # so it takes the 2x rule with an fp64 oracle and the fp32 reference as the yardstick.
        assert_close_lowp(db, reference(x, bias, dy, approximate, torch.float64)[2], db32, name="dbias")
    else:
        ylo, dxlo, dblo = reference(x, bias, dy, approximate, x.dtype)
        assert_close_lowp(y.float(), y32, ylo.float(), name="y")
        assert_close_lowp(dx.float(), dx32, dxlo.float(), name="dx")
        assert_close_lowp(db.float(), db32, dblo.float(), name="dbias")
    return y, dx, db


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("n,f", [(1, 768), (7, 1023), (33, 64)])
def test_matches_reference(n, f, dtype, approximate):
    check(*make_inputs(n, f, dtype), approximate)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_large_and_tiny_arguments(approximate):
    # Saturated tails (|z| up to ~30): finite, y -> z or 0, gradient -> 1 or 0.
    x, bias, dy = make_inputs(5, 64, torch.float32, scale=10.0)
    y, dx, _ = check(x, bias, dy, approximate)
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()


def test_fp32_bias_with_fp16_activations():
    x, bias, dy = make_inputs(33, 1023, torch.float16, bias_dtype=torch.float32)
    _, _, db = check(x, bias, dy, "none")
    assert db.dtype == torch.float32


def test_row_strided_inputs():
    n, f = 33, 64
    x, bias, dy = make_inputs(n, f, torch.float32)
    xw = torch.full((n, 2 * f), float("nan"), device=DEV)
    dyw = torch.full((n, 2 * f), float("nan"), device=DEV)
    xw[:, :f], dyw[:, :f] = x, dy
    y = bias_gelu_fwd(xw[:, :f], bias, "none")
    dx, db = bias_gelu_bwd(dyw[:, :f], xw[:, :f], bias, "none")
    assert torch.equal(y, bias_gelu_fwd(x, bias, "none"))
    dx_c, db_c = bias_gelu_bwd(dy, x, bias, "none")
    assert torch.equal(dx, dx_c) and torch.equal(db, db_c)
    check(xw[:, :f], bias, dyw[:, :f], "tanh")


def test_clear_errors():
    x, bias, dy = make_inputs(4, 64, torch.float32)
    x_cols = torch.randn(4, 128, device=DEV)[:, ::2]
    with pytest.raises(ValueError, match="column stride"):
        bias_gelu_fwd(x_cols, bias)
    with pytest.raises(ValueError, match="column stride"):
        bias_gelu_bwd(x_cols, x, bias)
    with pytest.raises(ValueError, match="approximate"):
        bias_gelu_fwd(x, bias, "sigmoid")
    with pytest.raises(ValueError, match="bias"):
        bias_gelu_fwd(x, bias[:32])
    with pytest.raises(ValueError, match="dy"):
        bias_gelu_bwd(dy.half(), x, bias)


def test_empty_rows():
    x, bias, dy = make_inputs(0, 64, torch.float32)
    assert bias_gelu_fwd(x, bias).shape == (0, 64)
    dx, db = bias_gelu_bwd(dy, x, bias)
    assert dx.shape == (0, 64) and db.shape == (64,) and not db.any()


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("f", [3072, 4096])
def test_gpu_lowp_matches_fp32_reference(f, dtype, approximate):
    check(*make_inputs(4096, f, dtype), approximate)
    check(*make_inputs(4096, f, dtype, bias_dtype=torch.float32), approximate)


@pytest.mark.gpu
def test_gpu_fp32_awkward_width():
    check(*make_inputs(515, 4093, torch.float32), "none")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU every test above takes this path")
def test_autotuned_launch_path_under_interpreter(stand_in_tuner):
    """Each pruned candidate runs once on the real buffers (pure outputs) and the best is relaunched."""
    from bertfast.kernels import bias_gelu as BG

    stand_in_tuner(BG._fwd_tuned, BG._bwd_tuned)
    check(*make_inputs(37, 300, torch.float32), "none")
    check(*make_inputs(37, 300, torch.float32), "tanh")
    assert len(BG._fwd_tuned.cache) == 2 and len(BG._bwd_tuned.cache) == 2
