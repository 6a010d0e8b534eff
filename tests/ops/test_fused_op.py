"""FusedOp (bertfast/ops/_common.py): an op's eager training call runs the custom op's own function,
setup_context and backward under a torch.autograd.Function, not the custom op.

Checked on every backend: the two ways give bit-identical outputs and gradients (dropout on, the
QKV bias list, the MLM head's three ops); the eager way never enters a custom op, the other always
does; with EAGER_FUNCTIONS off, under fake tensors and in a backward that records itself
(create_graph) the custom op runs as before; profiles name the call as the custom op does.
"""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from bertfast import ops
from bertfast.ops import _common
from bertfast.testing import BackendUnderTest, cu_seqlens_from_lengths

P = 0.25


def _calls(backend, p=P):
    """op -> (call, the leaves that take gradients), dropout p; tiny inputs (the CUDA emulator is slow)."""
    g = torch.Generator().manual_seed(0)

    def t(*shape, grad=True):
        return backend.tensor(*shape, generator=g).requires_grad_(grad)

    dev = backend.device
    x, res, w, b = t(6, 8), t(6, 8), t(8), t(8)
    qkv, qb, kvb = t(6, 3, 2, 8), t(2, 8), t(2, 2, 8)
    cu = cu_seqlens_from_lengths(torch.tensor([4, 2])).to(dev)
    q, k, v = t(2, 4, 2, 8), t(2, 4, 2, 8), t(2, 4, 2, 8)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool, device=dev)
    ids = torch.tensor([1, 2, 3, 1, 0, 2], device=dev)
    tables = [t(5, 8), t(6, 8), t(2, 8)]
    hidden, dense_w, dense_b = t(2, 3, 8), t(8, 8), t(8)
    dec_w, dec_b = t(10, 8), t(10)
    labels = torch.tensor([[1, -100, 4], [-100, 9, 0]], device=dev)
    return {
        "bias_gelu": (lambda: ops.bias_gelu(x, b), [x, b]),
        "bias_dropout_residual_layernorm": (lambda: ops.bias_dropout_residual_layernorm(x, b, res, w, b, 1e-5, p),
                                            [x, res, w, b]),
        "attention_varlen": (lambda: ops.attention_varlen(qkv, cu, 4, p, qkv_bias=[qb, kvb]), [qkv, qb, kvb]),
        "attention_padded": (lambda: ops.attention(q, k, v, mask, p), [q, k, v]),
        "embeddings": (lambda: ops.embeddings(ids, ids, ids % 2, *tables, w, b, 1e-5, p), [*tables, w, b]),
        "mlm_head_loss": (lambda: ops.mlm_head_loss(hidden, labels, dense_w, dense_b, w, b, 1e-5, dec_w,
                                                    dec_b).loss, [hidden, dense_w, dense_b, w, b, dec_w, dec_b]),
    }


OPS = ["bias_gelu", "bias_dropout_residual_layernorm", "attention_varlen", "attention_padded", "embeddings",
       "mlm_head_loss"]
# The torch backend's attention with dropout on a CPU runs _KeptProbs (no FusedOp): without dropout too.
CASES = [(op, P) for op in OPS] + [("attention_varlen", 0.0), ("attention_padded", 0.0)]


def _custom_calls(monkeypatch) -> list:
    """Every FusedOp's custom op, counting its calls into the returned list (by op name)."""
    seen = []
    for name, op in _common.FUSED_OPS.items():
        def counted(*args, _name=name, _custom=op.custom):
            seen.append(_name)
            return _custom(*args)
        monkeypatch.setattr(op, "custom", counted)
    return seen


def _run(call, leaves, eager: bool, monkeypatch):
    """(output, gradients, custom ops entered) of a forward and backward, one way; dropout from one seed."""
    monkeypatch.setattr(_common, "EAGER_FUNCTIONS", eager)
    seen = _custom_calls(monkeypatch)
    torch.manual_seed(7)
    out = call()
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)
    return out.detach(), grads, list(seen)


@pytest.mark.parametrize("op, p", CASES)
def test_the_eager_function_gives_the_custom_ops_numbers(backend, op, p, monkeypatch):
    call, leaves = _calls(backend, p)[op]
    with backend.forced():
        out, grads, seen = _run(call, leaves, True, monkeypatch)
        ref_out, ref_grads, ref_seen = _run(call, leaves, False, monkeypatch)
    kept = backend.name == "torch" and op.startswith("attention") and p > 0  # _KeptProbs: no FusedOp
    assert seen == [], f"the eager way entered {seen}"
    assert bool(ref_seen) != kept, "with EAGER_FUNCTIONS off every op call goes through its custom op"
    assert torch.equal(out, ref_out)
    for leaf, got, want in zip(leaves, grads, ref_grads):
        assert (got is None) == (want is None)
        if got is not None:
            assert got.dtype == want.dtype == leaf.dtype and torch.equal(got, want)


def test_the_qkv_bias_list_takes_a_gradient_per_tensor(backend, monkeypatch):
    """attention_varlen's qkv_bias is a list argument: flattened for the autograd.Function, each
    tensor its own gradient (the column sums of dqkv over its part)."""
    call, (qkv, qb, kvb) = _calls(backend)["attention_varlen"]
    with backend.forced():
        _, (dqkv, dqb, dkvb), _ = _run(call, [qkv, qb, kvb], True, monkeypatch)
    sums = dqkv.float().sum(0)
    torch.testing.assert_close(dqb.float(), sums[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dkvb.float(), sums[1:], rtol=1e-5, atol=1e-5)


def test_profiles_name_the_op_either_way(monkeypatch):
    call, leaves = _calls(BackendUnderTest("torch", torch.device("cpu")))["bias_dropout_residual_layernorm"]
    names = []
    for eager in (True, False):
        monkeypatch.setattr(_common, "EAGER_FUNCTIONS", eager)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = call()
            torch.autograd.grad(out, leaves, torch.ones_like(out))
        names.append({e.name for e in prof.events() if e.name.startswith("bertfast::")})
    assert names[0] == names[1] == {"bertfast::bias_dropout_residual_layernorm",
                                    "bertfast::bias_dropout_residual_layernorm_backward"}


def test_what_still_takes_the_custom_op(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = _custom_calls(monkeypatch)
    x = torch.randn(4, 8, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    with FakeTensorMode() as mode:
        fake = ops.bias_gelu(mode.from_tensor(x), mode.from_tensor(b))
    assert fake.shape == x.shape and seen == ["bertfast::bias_gelu"]
    # A backward that records itself: the backward op's custom op, which has no autograd of its own
    # (as before FusedOp: a second backward through it is an error, not a wrong number).
    seen.clear()
    (dx,) = torch.autograd.grad(ops.bias_gelu(x, b).sum(), x, create_graph=True)
    assert seen == ["bertfast::bias_gelu_backward"]
    with pytest.raises(RuntimeError, match="no autograd formula"):
        dx.sum().backward()
    # Nothing to differentiate: the function itself, no node.
    seen.clear()
    with torch.no_grad():
        y = _common.FUSED_OPS["bertfast::bias_gelu"](x, b, "none", "torch")
    assert y.grad_fn is None and seen == []


def test_every_op_module_makes_its_custom_ops_fused_ops():
    names = set(_common.FUSED_OPS)
    for op in ("bias_gelu", "bias_dropout_residual_layernorm", "attention_varlen", "attention_padded",
               "embeddings"):
        assert {f"bertfast::{op}", f"bertfast::{op}_backward"} <= names
    assert "bertfast::mlm_head_loss_decoder" in names
    for name, op in _common.FUSED_OPS.items():
        assert (op._function is None) == name.endswith("_backward"), name
