"""A GEMM whose input is also a residual (bertfast.model.residual_linear): the input's two gradients are summed
by the input-gradient GEMM (addmm), not by autograd in an [N, H] add of its own, and every gradient
equals plain autograd's.
"""
import importlib

import pytest
import torch
import torch.nn.functional as F

import bertfast
from bertfast import dispatch
from bertfast.model import residual_linear
from bertfast.testing import AtenLog


def _inputs(count, with_bias, dtype=torch.float32, rows=6, width=8, out=5):
    torch.manual_seed(0)
    x = torch.randn(rows, width, dtype=dtype, requires_grad=True)
    weights = [torch.randn(out + i, width, requires_grad=True) for i in range(count)]
    biases = [torch.randn(out + i, requires_grad=True) for i in range(count)] if with_bias else None
    return x, weights, biases


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize("with_bias", [True, False])
def test_outputs_and_every_gradient_match_plain_autograd(count, with_bias):
    x, weights, biases = _inputs(count, with_bias)
    params = [x, *weights, *(biases or [])]
    y, residual = residual_linear.linear(x, weights, biases)
    expected_y = F.linear(x, torch.cat(weights), None if biases is None else torch.cat(biases))
    torch.testing.assert_close(y, expected_y)
    assert torch.equal(residual, x)
    dy, dres = torch.randn_like(y), torch.randn_like(x)
    got = _grads((y * dy).sum() + (residual * dres).sum(), params)
    want = _grads((expected_y * dy).sum() + (x * dres).sum(), params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_bf16_autocast_computes_in_bf16_and_returns_parameter_dtype_gradients():
    x, weights, biases = _inputs(3, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        xb = x.to(torch.bfloat16)
        y, residual = residual_linear.linear(xb, weights, biases)
        expected = F.linear(xb, torch.cat(weights), torch.cat(biases))
    assert y.dtype == torch.bfloat16 and residual.dtype == torch.bfloat16
    torch.testing.assert_close(y, expected)
    dy, dres = torch.randn_like(y), torch.randn_like(residual)
    params = [x, *weights, *biases]
    got = _grads((y.float() * dy.float()).sum() + (residual.float() * dres.float()).sum(), params)
    want = _grads((expected.float() * dy.float()).sum() + (xb.float() * dres.float()).sum(), params)
    for g, w, p in zip(got, want, params):
        assert g.dtype == p.dtype
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)


def test_several_weights_are_cast_into_one_buffer_not_concatenated():
    """Under autocast the query, key and value weights (and biases) are each cast into their rows of
    one buffer: no cat of cast copies."""
    x, weights, biases = _inputs(3, True)
    with AtenLog() as log, torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = residual_linear.linear(x.to(torch.bfloat16), weights, biases)
    funcs = [f for f, _ in log.calls]
    assert torch.ops.aten.cat.default not in funcs
    assert sum(1 for f in funcs if f == torch.ops.aten.copy_.default) == 6
    torch.testing.assert_close(y.float(), F.linear(x, torch.cat(weights), torch.cat(biases)), rtol=3e-2, atol=3e-2)


def test_an_fp32_input_under_autocast_gets_an_fp32_gradient():
    x, weights, _ = _inputs(1, False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, residual = residual_linear.linear(x, weights)
    assert y.dtype == torch.bfloat16 and residual.dtype == torch.float32
    (dx,) = _grads(y.float().sum() + residual.sum(), [x])
    assert dx.dtype == torch.float32
    torch.testing.assert_close(dx, 1.0 + torch.ones(6, 5) @ weights[0], rtol=2e-2, atol=2e-2)


def test_only_one_output_used():
    x, weights, biases = _inputs(1, True)
    y, residual = residual_linear.linear(x, weights, biases)
    (dx,) = _grads(residual.sum() * 3, [x])  # the GEMM's output unused
    torch.testing.assert_close(dx, torch.full_like(x, 3.0))
    y, residual = residual_linear.linear(x, weights, biases)
    (dx,) = _grads(y.sum(), [x])  # the residual unused
    torch.testing.assert_close(dx, torch.ones(6, 5) @ weights[0])


def test_frozen_parameters_get_no_gradient_and_the_input_still_does():
    x, weights, biases = _inputs(3, True)
    weights[1].requires_grad_(False)
    biases[2].requires_grad_(False)
    y, residual = residual_linear.linear(x, weights, biases)
    (y.sum() + residual.sum()).backward()
    assert weights[1].grad is None and biases[2].grad is None
    assert x.grad is not None and weights[0].grad is not None and biases[0].grad is not None


def test_one_bias_per_weight():
    x, weights, biases = _inputs(3, True)
    with pytest.raises(ValueError, match="one bias per weight"):
        residual_linear.linear(x, weights, biases[:2])


def test_fp32_weights_get_their_gradient_from_an_fp32_out_gemm_where_the_device_has_one(monkeypatch):
    """Under bf16 autocast, fp32 weights' gradients are the GEMM's fp32 result (on CUDA, cuBLAS writing
    fp32), not a bf16 product cast back: here a CPU stand-in for the fp32-out GEMM, called once per
    backward, and the gradients equal its product exactly. fp32 inputs take the plain GEMM."""
    calls = []

    def mm_fp32(a, b):
        calls.append((a.dtype, b.dtype))
        return a.float() @ b.float()
    monkeypatch.setattr(residual_linear, "fp32_gemm_caps", lambda device, dtype: (True, True))
    monkeypatch.setattr(residual_linear, "_mm_fp32", mm_fp32)
    x, weights, biases = _inputs(3, True, rows=64, width=32, out=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        xb = x.to(torch.bfloat16)
        y, _ = residual_linear.linear(xb, weights, biases)
    dy = torch.randn_like(y)
    got = _grads((y.float() * dy.float()).sum(), weights)
    assert calls == [(torch.bfloat16, torch.bfloat16)]
    full = dy.t().float() @ xb.float()
    for g, want in zip(got, full.split([w.shape[0] for w in weights])):
        assert g.dtype == torch.float32 and torch.equal(g, want)
    rounded = (dy.t() @ xb).float()  # what the bf16 GEMM and autograd's cast gave: coarser
    assert not torch.equal(torch.cat(got), rounded)
    # dense: the same node without the residual
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = residual_linear.dense(xb, weights[0], biases[0])
    (dw,) = _grads((y.float() * dy[:, :16].float()).sum(), [weights[0]])
    assert len(calls) == 2 and torch.equal(dw, dy[:, :16].t().float() @ xb.float())
    # fp32 throughout: nothing to round, the plain GEMM
    y, _ = residual_linear.linear(x, weights[:1])
    _grads(y.sum(), weights[:1])
    assert len(calls) == 2


@pytest.mark.gpu
def test_on_a_gpu_the_weight_gradient_is_cublas_fp32_out_gemm():
    from bertfast.ops._common import fp32_gemm_caps
    if not fp32_gemm_caps(torch.device("cuda"), torch.bfloat16)[1]:
        pytest.skip("this torch has no fp32-out GEMM for bf16 inputs")
    torch.manual_seed(0)
    x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(96, 64, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = residual_linear.dense(x, weight)
    dy = torch.randn_like(y)
    (dw,) = _grads((y.float() * dy.float()).sum(), [weight])
    want = torch.mm(dy.t(), x, out_dtype=torch.float32)
    assert dw.dtype == torch.float32 and torch.equal(dw, want)


def _model():
    torch.manual_seed(0)
    config = bertfast.BertConfig.preset("tiny")
    return bertfast.BertModel(config, add_pooling_layer=False), config


def _training_model(dropout: float = 0.0):
    """_model() in training mode, every dropout at ``dropout``."""
    model, config = _model()
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = dropout
    return model, config


def _backward_log(model, ids, mask, fold, monkeypatch):
    if not fold:
        monkeypatch.setattr(residual_linear, "records_grad", lambda *tensors: False)
    model.zero_grad()
    out = model(ids, attention_mask=mask).last_hidden_state
    loss = (out * mask[..., None]).square().sum()
    with AtenLog() as log:
        loss.backward()
    monkeypatch.undo()
    return log.calls, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_layer_backward_adds_no_residual_gradients_of_its_own(monkeypatch):
    """Each layer's two residual-gradient additions ([N, H] adds autograd makes for a tensor used twice)
    are gone: the QKV and FFN-input GEMMs sum them (addmm with an [N, H] input). Gradients unchanged."""
    model, config = _training_model()
    ids = torch.randint(5, 100, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    rows, width = int(mask.sum()), config.hidden_size
    with dispatch.use_backend("torch"):
        folded, got = _backward_log(model, ids, mask, True, monkeypatch)
        plain, want = _backward_log(model, ids, mask, False, monkeypatch)

    def count(calls, func):
        return sum(1 for f, shape in calls if f == func and shape == (rows, width))

    layers = config.num_hidden_layers
    add = torch.ops.aten.add.Tensor
    assert count(plain, add) - count(folded, add) == 2 * layers
    assert count(folded, torch.ops.aten.addmm.default) == 2 * layers
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_bias_grad_false_leaves_the_biases_gradient_to_another_op():
    x, weights, biases = _inputs(3, True)
    y, residual = residual_linear.linear(x, weights, biases, bias_grad=False)
    torch.testing.assert_close(y, F.linear(x, torch.cat(weights), torch.cat(biases)))
    grads = torch.autograd.grad((y.square().sum() + residual.sum()), [x, *weights, *biases], allow_unused=True)
    assert all(g is not None for g in grads[:4]) and all(g is None for g in grads[4:])


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_qkv_bias_gradient_comes_from_the_attention(monkeypatch, dropout):
    """In training the QKV GEMM's node leaves its biases' gradient to the attention op, whose backward
    forms it (bertfast.ops.attention_varlen's qkv_bias: the Triton kernels sum it as they write dqkv):
    one bias gradient per layer from there, and the GEMM's node sums none. (Gradients against plain
    autograd: test_a_layer_backward_adds_no_residual_gradients_of_its_own.)"""
    attention_op = importlib.import_module("bertfast.ops.attention")  # the package exports a function of that name
    model, config = _training_model(dropout)
    calls = []
    split = attention_op._split_bias_grad
    monkeypatch.setattr(attention_op, "_split_bias_grad", lambda *args: calls.append(1) or split(*args))
    ids = torch.randint(5, 100, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with dispatch.use_backend("torch"):
        out = model(ids, attention_mask=mask).last_hidden_state
    with AtenLog() as log:
        out.square().sum().backward()
    width = 3 * config.hidden_size
    assert len(calls) == config.num_hidden_layers
    assert not [f for f, shape in log.calls if f == torch.ops.aten.sum.dim_IntList and shape == (width,)]
    for layer in model.encoder.layer:
        assert all(m.bias.grad is not None and m.bias.grad.abs().sum() > 0
                   for m in (layer.attention.self.query, layer.attention.self.key, layer.attention.self.value))


def test_hooked_modules_are_still_called_as_modules():
    model, config = _model()
    layer = model.encoder.layer[0]
    calls = []
    layer.intermediate.register_forward_hook(lambda *args: calls.append("intermediate"))
    layer.attention.self.register_forward_hook(lambda *args: calls.append("self"))
    ids = torch.randint(5, 100, (2, 5))
    out = model(ids).last_hidden_state
    out.sum().backward()
    assert calls == ["self", "intermediate"]
    assert layer.attention.self.query.weight.grad is not None


def test_a_handed_over_gradient_is_taken_over_once_and_no_other_is():
    """Taken over once, as itself or as a view of all of it (autograd's reshapes on the way); not a
    part of it, nor another tensor; an entry goes with its tensor."""
    from bertfast.ops import _common
    g, other = torch.zeros(4, 3), torch.zeros(4, 3)
    assert _common.hand_over(g) is g
    assert not _common.take_over(other) and not _common.take_over(None) and not _common.take_over(g[:2])
    with torch.enable_grad():  # a backward that records itself (create_graph) writes nothing in place
        assert not _common.take_over(g.view(12))
    with torch.no_grad():  # as a backward runs
        assert _common.take_over(g.view(12)) and not _common.take_over(g)
    _common.hand_over(other)
    key = other.data_ptr()
    del other
    assert key not in _common._HANDED_OVER


def _train_step_log(model, ids, mask, seed, monkeypatch=None, backend="torch", dtype=None):
    model.zero_grad()
    torch.manual_seed(seed)  # the same dropout masks for each run
    with dispatch.use_backend(backend), torch.autocast(ids.device.type, dtype=dtype or torch.float32,
                                                       enabled=dtype is not None):
        out = model(ids, attention_mask=mask).last_hidden_state.float()
    with AtenLog() as log:
        (out * mask[..., None]).square().sum().backward()
    if monkeypatch is not None:
        monkeypatch.undo()
    return log.calls, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_with_dropout_the_gemm_adds_into_the_residuals_gradient_in_place(monkeypatch):
    """With dropout the LayerNorm op hands its residual's gradient over (a tensor of its own, not
    dx), and the QKV and FFN-input GEMMs add into it in place (addmm_): no copy of it first, which
    torch.addmm(C, A, B) makes (48 copies of a [tokens, 1024] activation per BERT-large step in the
    H200 trace of 2026-11-27). The gradients are the same bits as through the copying addmm."""
    from bertfast.ops import _common
    model, config = _model()
    model.train()
    ids = torch.randint(5, 100, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    rows, width = int(mask.sum()), config.hidden_size
    earlier = set(_common._HANDED_OVER)  # another test's tensors still alive, if any
    in_place, got = _train_step_log(model, ids, mask, 7)
    monkeypatch.setattr(residual_linear, "take_over", lambda grad: _common.take_over(grad) and False)
    copying, want = _train_step_log(model, ids, mask, 7, monkeypatch)

    def count(calls, func):
        return sum(1 for f, shape in calls if f == func and shape == (rows, width))

    layers = config.num_hidden_layers
    assert count(in_place, torch.ops.aten.addmm_.default) == 2 * layers
    assert count(in_place, torch.ops.aten.addmm.default) == 0
    assert count(copying, torch.ops.aten.addmm.default) == 2 * layers
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    assert set(_common._HANDED_OVER) <= earlier  # each one handed over was taken over, or is gone with its tensor


def test_a_backward_hook_on_the_output_module_keeps_the_residual_gradient_it_was_given():
    """A full backward hook on BertSelfOutput receives the residual's gradient (its second input)
    and may keep it: then nothing adds into that tensor afterwards (autograd sums x's gradients)."""
    model, config = _model()
    model.train()
    output = model.encoder.layer[0].attention.output
    kept = []
    output.register_full_backward_hook(lambda module, grad_in, grad_out: kept.append(
        (grad_in[1], grad_in[1].clone())))
    ids = torch.randint(5, 100, (2, 7))
    with dispatch.use_backend("torch"):
        model(ids).last_hidden_state.square().sum().backward()
    (held, at_hook), = kept
    assert torch.equal(held, at_hook)


@pytest.mark.gpu
def test_on_a_gpu_the_triton_layer_norm_hands_its_residual_gradient_to_the_gemm():
    """The same on a GPU, Triton's LayerNorm backward under bf16 autocast: the QKV and FFN-input
    GEMMs add into the residuals' gradients in place, with no copy of them first."""
    model, config = _model()
    model.cuda().train()
    ids = torch.randint(5, 100, (3, 9), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    calls, _ = _train_step_log(model, ids, mask, 7, backend="triton", dtype=torch.bfloat16)
    rows, width = int(mask.sum()), config.hidden_size
    in_place = [f for f, shape in calls if f == torch.ops.aten.addmm_.default and shape == (rows, width)]
    copying = [f for f, shape in calls if f == torch.ops.aten.addmm.default and shape == (rows, width)]
    assert len(in_place) == 2 * config.num_hidden_layers and not copying


# ------------------------------------------------------------------ the FFN with GELU in its GEMMs
def _ffn_inputs(rows=10, hidden=16, ffn=40, dtype=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(rows, hidden, dtype=dtype, requires_grad=True)
    w1 = (torch.randn(ffn, hidden) / hidden ** 0.5).requires_grad_()
    b1 = torch.randn(ffn, requires_grad=True)
    w2 = (torch.randn(hidden, ffn) / ffn ** 0.5).requires_grad_()
    return x, w1, b1, w2


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_the_ffn_node_matches_linear_gelu_linear(approximate):
    """residual_linear.ffn on the Triton GEMMs (the interpreter here): the output, the residual and
    every gradient as plain autograd's F.linear, GELU, F.linear."""
    x, w1, b1, w2 = _ffn_inputs()
    with dispatch.use_backend("triton"):
        gemms = residual_linear.ffn_gemms(x, w1, b1, w2)
        assert gemms is importlib.import_module("bertfast.kernels.bias_gelu")
        y, residual = residual_linear.ffn(x, w1, b1, w2, approximate, gemms)
    want = F.linear(F.gelu(F.linear(x, w1, b1), approximate=approximate), w2)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(residual, x)
    dy, dres = torch.randn_like(y), torch.randn_like(x)
    params = [x, w1, b1, w2]
    got = _grads((y * dy).sum() + (residual * dres).sum(), params)
    expected = _grads((want * dy).sum() + (x * dres).sum(), params)
    for name, g, w in zip(("x", "w1", "b1", "w2"), got, expected):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)


def test_ffn_gemms_only_where_a_backend_has_them():
    x, w1, b1, w2 = _ffn_inputs()
    with dispatch.use_backend("torch"):
        assert residual_linear.ffn_gemms(x, w1, b1, w2) is None  # cuBLAS and the bias_gelu op instead
    with dispatch.use_backend("triton"):
        assert residual_linear.ffn_gemms(x, w1, b1, w2) is not None
        assert residual_linear.ffn_gemms(x.half(), w1, b1, w2) is None  # no autocast: dtypes differ
        x12, w12, b12, w212 = _ffn_inputs(hidden=12)
        assert residual_linear.ffn_gemms(x12, w12, b12, w212) is None  # K = 12: not a multiple of 8


def _ffn_calls(monkeypatch):
    gemms = importlib.import_module("bertfast.kernels.bias_gelu")
    calls = []
    for name in ("gemm_bias_gelu_fwd", "gemm_gelu_bwd"):
        fn = getattr(gemms, name)
        monkeypatch.setattr(gemms, name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k))
    return calls


def _weighted_step(model, ids, mask, weights):
    """Gradients of sum(last hidden state * weights) at real tokens on the Triton backend (a sum of
    squares would not do: a LayerNorm's output has a fixed norm, so its gradient is rounding noise)."""
    model.zero_grad()
    with dispatch.use_backend("triton"):
        out = model(ids, attention_mask=mask).last_hidden_state
    (out * weights * mask[..., None]).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _grad_scale(grads, name):
    """The norm a gradient's difference is measured against: its own, but for a key bias, whose gradient
    is zero in exact arithmetic (a softmax ignores a constant added to all of a query's scores), so its
    value is rounding noise (bf16 on a GPU: 1e-4, against 7e-5 for its own norm); for it, the same
    layer's query-bias gradient."""
    if name.endswith(".attention.self.key.bias"):
        name = name[: -len("key.bias")] + "query.bias"
    return grads[name].norm()


def test_a_triton_layer_runs_its_ffn_in_the_gemm_epilogues(monkeypatch):
    """Training on the Triton backend, each layer's FFN is the one node (forward and backward GEMM with
    GELU in the epilogue), with the gradients of the unfused layer; an output module with hooks is
    called as a module instead."""
    model, config = _training_model()
    ids = torch.randint(5, 100, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    weights = torch.randn(2, 7, config.hidden_size)
    calls = _ffn_calls(monkeypatch)
    got = _weighted_step(model, ids, mask, weights)
    layers = config.num_hidden_layers
    assert calls == ["gemm_bias_gelu_fwd"] * layers + ["gemm_gelu_bwd"] * layers
    monkeypatch.setattr(residual_linear, "ffn_gemms", lambda *args: None)
    want = _weighted_step(model, ids, mask, weights)
    assert got.keys() == want.keys()
    for name in want:
        assert (got[name] - want[name]).norm() <= 1e-5 * _grad_scale(want, name) + 1e-7, name
    monkeypatch.undo()
    calls = _ffn_calls(monkeypatch)
    seen = []
    model.encoder.layer[0].output.register_forward_hook(lambda *args: seen.append(1))
    _weighted_step(model, ids, mask, weights)
    assert len(seen) == 1 and calls.count("gemm_bias_gelu_fwd") == layers - 1


@pytest.mark.gpu
def test_on_a_gpu_the_bf16_triton_layer_runs_its_ffn_in_the_gemm_epilogues(monkeypatch):
    """The same under bf16 autocast on a GPU: the fused FFN runs (forward and backward), and every
    gradient is within bf16 rounding of the unfused Triton layer's (GEMM, then the bias_gelu op)."""
    model, config = _training_model()
    model.cuda()
    ids = torch.randint(5, 100, (4, 33), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    weights = torch.randn(4, 33, config.hidden_size, device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return _weighted_step(model, ids, mask, weights)
    calls = _ffn_calls(monkeypatch)
    got = step()
    assert calls.count("gemm_bias_gelu_fwd") == calls.count("gemm_gelu_bwd") == config.num_hidden_layers
    monkeypatch.setattr(residual_linear, "ffn_gemms", lambda *args: None)
    want = step()
    for name in want:
        assert (got[name] - want[name]).norm() <= 3e-2 * _grad_scale(want, name) + 1e-6, name


# --------------------------------------------------------------------------- gradients added in place
def _twice(fn, params, in_place, grad_fn=None):
    """Two backwards of fn() into params' .grad (the second under weight_grads_added_in_place when
    in_place): the gradients, and the aten calls of the second backward."""
    for p in params:
        p.grad = None
    torch.manual_seed(0)
    fn().backward()
    with residual_linear.weight_grads_added_in_place(in_place), AtenLog() as log:
        fn().backward()
    return [p.grad.clone() for p in params], log.calls


@pytest.mark.parametrize("count", [1, 3])
def test_a_second_backward_adds_the_weight_gradients_in_their_gemms(count):
    """Gradient accumulation: with weight_grads_added_in_place on, each weight's gradient is added by
    its GEMM into the .grad the first backward left (an in-place addmm per weight, the QKV's three
    from their columns of dy), where autograd adds it in an add_ of its own; the sums are the same."""
    x, weights, biases = _inputs(count, True, rows=11)  # x and its gradient of no weight's shape
    params = [*weights, *biases]
    dy = torch.randn(11, sum(w.shape[0] for w in weights))

    def loss():
        y, residual = residual_linear.linear(x, weights, biases)
        return (y * dy).sum() + residual.sum()

    fused, fused_calls = _twice(loss, params, True)
    plain, plain_calls = _twice(loss, params, False)
    for name, f, p in zip([f"w{i}" for i in range(count)] + [f"b{i}" for i in range(count)], fused, plain):
        torch.testing.assert_close(f, p, rtol=1e-5, atol=1e-6, msg=name)
    shapes = {tuple(w.shape) for w in weights}
    added = [(op, shape) for op, shape in plain_calls if op is torch.ops.aten.add_.Tensor and shape in shapes]
    assert len(added) == count  # autograd's accumulation, one pass a weight
    assert not [c for c in fused_calls if c[0] is torch.ops.aten.add_.Tensor and c[1] in shapes]
    assert sum(op is torch.ops.aten.addmm_.default and shape in shapes for op, shape in fused_calls) == count


def test_no_gradient_added_in_place_where_autograd_must_hand_it_over():
    """A hooked weight (its hook must see its gradient), torch.autograd.grad (it hands gradients back
    and accumulates into no .grad) and a weight with no .grad yet keep autograd's way, with the
    context on."""
    x, weights, _ = _inputs(1, False)
    w = weights[0]

    def loss():
        return residual_linear.linear(x, weights)[0].square().sum()

    want = torch.autograd.grad(loss(), [w])[0]
    with residual_linear.weight_grads_added_in_place():
        w.grad = None
        loss().backward()  # nothing to add into: autograd's gradient becomes .grad
        torch.testing.assert_close(w.grad, want)
        before = w.grad.clone()
        got = torch.autograd.grad(loss(), [w])[0]
        assert torch.equal(w.grad, before)
        torch.testing.assert_close(got, want)
        seen = []
        handle = w.register_hook(lambda g: seen.append(g.clone()))
        loss().backward()
        handle.remove()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], want)
    torch.testing.assert_close(w.grad, 2 * want)


def test_the_ffn_adds_its_weight_gradients_in_their_gemms():
    """The FFN node on the Triton GEMMs (the interpreter here): both weights' gradients added in place
    into .grad on a second backward, the sums as autograd's."""
    x, w1, b1, w2 = _ffn_inputs()
    dy = torch.randn(x.shape[0], w2.shape[0])

    def loss():
        with dispatch.use_backend("triton"):
            y, residual = residual_linear.ffn(x, w1, b1, w2, "none", residual_linear.ffn_gemms(x, w1, b1, w2))
        return (y * dy).sum() + residual.sum()

    fused, fused_calls = _twice(loss, [w1, b1, w2], True)
    plain, plain_calls = _twice(loss, [w1, b1, w2], False)
    for name, f, p in zip(("w1", "b1", "w2"), fused, plain):
        torch.testing.assert_close(f, p, rtol=1e-5, atol=1e-6, msg=name)
    shapes = {tuple(w1.shape), tuple(w2.shape)}

    def added(calls):
        return [shape for op, shape in calls if op is torch.ops.aten.add_.Tensor and shape in shapes]
    assert sorted(added(plain_calls)) == sorted(shapes) and not added(fused_calls)


@pytest.mark.parametrize("in_place", [True, False], ids=["one-process", "switched-off"])
def test_a_train_steps_later_micro_batches_add_their_gemm_weight_gradients_in_place(monkeypatch, in_place):
    """TrainStep over two micro-batches in one process: the second backward adds no GEMM weight's
    gradient in an add_ of autograd's (the GEMMs add them in place); the gradient norm and the
    parameters after the step are those of the step with the switch off."""
    import copy
    from bertfast.training.step import TrainStep

    model, config = _training_model()
    twin = copy.deepcopy(model)
    batches = [{"ids": torch.randint(5, 100, (2, 9), generator=torch.Generator().manual_seed(i))} for i in (1, 2)]
    gemm_shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    results = []
    for m, adds in ((model, in_place), (twin, False)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        step = TrainStep(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), torch.device("cpu"), "fp32")
        assert step.adds_in_gemms
        step.adds_in_gemms = adds
        backwards = []

        class Out:
            def __init__(self, loss):
                self.loss = loss

        def forward(batch, m=m):
            return Out(m(batch["ids"]).last_hidden_state.square().mean())

        real = torch.Tensor.backward

        def logged(self, *args, **kwargs):
            with AtenLog() as log:
                real(self, *args, **kwargs)
            backwards.append(log.calls)

        monkeypatch.setattr(torch.Tensor, "backward", logged)
        results.append(step(batches, forward))
        monkeypatch.undo()
        added = [shape for op, shape in backwards[1] if op is torch.ops.aten.add_.Tensor and shape in gemm_shapes]
        assert (not added) if adds else len(added) == 6 * config.num_hidden_layers  # Q, K, V, out; the FFN's two
    torch.testing.assert_close(results[0].grad_norm, results[1].grad_norm, rtol=1e-5, atol=0)
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("count", [1, 3])
def test_on_a_gpu_bf16_weight_gradients_are_added_into_fp32_grads_in_place(count):
    """Under bf16 autocast the second backward adds each fp32 weight's gradient into its .grad with an
    fp32-input addmm (the QKV's three from their columns of dy), where this torch has one; the sums as
    autograd's within bf16 GEMM rounding."""
    from bertfast.ops._common import fp32_gemm_caps
    if not fp32_gemm_caps(torch.device("cuda"), torch.bfloat16)[0]:
        pytest.skip("this torch's CUDA addmm takes no fp32 input with bf16 operands: autograd adds the gradients")
    torch.manual_seed(0)
    x = torch.randn(512, 64, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(96, 64, device="cuda", requires_grad=True) for _ in range(count)]
    dy = torch.randn(512, 96 * count, device="cuda")

    def loss():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = residual_linear.linear(x, weights)[0]
        return (y.float() * dy).sum()

    fused, calls = _twice(loss, weights, True)
    plain, _ = _twice(loss, weights, False)
    assert sum(op is torch.ops.aten.addmm.dtype_out for op, _ in calls) == count
    assert not [c for c in calls if c[0] is torch.ops.aten.add_.Tensor and c[1] == (96, 64)]
    for f, p in zip(fused, plain):
        assert f.dtype == torch.float32
        torch.testing.assert_close(f, p, rtol=1e-3, atol=1e-2)
