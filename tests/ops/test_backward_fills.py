"""The fused backends' backward passes allocate their outputs empty and write every element: autograd
hands them None, not zero-filled tensors, for outputs nothing differentiated, and no backward
zero-fills what its kernels then overwrite (on the H200 such fills took 1.5 ms of a 70 ms BERT-large
step: benchmarks/results/nvidia-h200/2026-11-26-2). The Triton row backwards reduce their
per-program partial sums with one column_sums launch (no torch reduction, cast or copy after it)."""
import pytest
import torch

from test_attention import A


def test_backward_fills_nothing_with_zeros(fused_backend):
    """A fused op's backward writes every element it returns, and autograd hands it None (not a
    zero-filled tensor) for the outputs nothing differentiated (ops._common.no_zero_grads): no fill,
    zeros or full in the backward of attention (Triton: the CUDA attention still zero-fills varlen
    outputs), bias+dropout+residual+LayerNorm, embeddings and the MLM decoder loss."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from bertfast import ops

    class Fills(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if "zero" in name or "fill" in name or name in ("full", "full_like", "new_full"):
                self.seen.append(name)
            return func(*args, **(kwargs or {}))

    b = fused_backend
    g = torch.Generator().manual_seed(3)

    def leaf(*shape):
        return b.tensor(*shape, generator=g).requires_grad_()
    cases = {}
    x, res = leaf(12, 32), leaf(12, 32)
    cases["bias_dropout_residual_layernorm"] = lambda: ops.bias_dropout_residual_layernorm(
        x, leaf(32), res, leaf(32), leaf(32), 1e-5, 0.1)
    ids = torch.tensor([1, 5, 2, 7, 1, 3], device=b.device)
    cases["embeddings"] = lambda: ops.embeddings(ids, torch.arange(6, device=b.device), torch.zeros_like(ids),
                                                 leaf(9, 32), leaf(8, 32), leaf(2, 32), leaf(32), leaf(32), 1e-5, 0.1)
    labels = torch.tensor([3, -100, 0, 8], device=b.device)
    cases["mlm_head_loss_decoder"] = lambda: ops.mlm_head_loss_decoder(leaf(4, 32), leaf(9, 32), leaf(9), labels)[0]
    if b.name == "triton":
        cu = torch.tensor([0, 7, 20], dtype=torch.int32, device=b.device)
        cases["attention_varlen"] = lambda: ops.attention_varlen(leaf(20, 3, A, 16), cu, 13, 0.1)
    for name, forward in cases.items():
        with b.forced():
            y = forward()
            with Fills() as fills:
                y.float().sum().backward()
        assert fills.seen == [], f"{name} ({b.name}): the backward zero-filled: {fills.seen}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs under the interpreter (tiles of 2 partial rows)")
@pytest.mark.parametrize("sets,groups", [(1, 1), (2, 5), (3, 4)])
def test_triton_column_sums_adds_the_partials_of_every_set(sets, groups):
    """K sets of G partial rows (several interpreter tiles, the last partial): each set's column sums,
    in its own tensor (separate storage, as a custom op's outputs must be) and dtype."""
    from bertfast.kernels._rows import column_sums

    g = torch.Generator().manual_seed(sets * 10 + groups)
    part = torch.randn(sets, groups, 37, generator=g)
    dtypes = [torch.float32, torch.float16, torch.float32][:sets]
    outs = column_sums(part, dtypes)
    assert len(outs) == sets and len({o.untyped_storage().data_ptr() for o in outs}) == sets
    for k, (out, dtype) in enumerate(zip(outs, dtypes)):
        assert out.shape == (37,) and out.dtype == dtype
        torch.testing.assert_close(out, part[k].double().sum(0).to(dtype), atol=1e-5, rtol=1e-5)
    assert all((o == 0).all() for o in column_sums(torch.empty(2, 0, 5), [torch.float32] * 2))
