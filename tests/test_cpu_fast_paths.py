"""The torch backend's fast CPU paths and the per-call shortcuts (issue: never slower than transformers on CPU).

Their numbers are checked by the op contract tests (tests/ops/, every backend, against the
reference). This file checks that the fast paths are the ones that run, and the shortcuts'
own rules:
  * attention without dropout on CPU runs aten's flash attention for CPU, forward and backward,
    in both forms; with dropout it does not (the mask is the backend's own, from the seed);
  * with dropout and autograd on, the attention entries keep the probabilities and mask for the
    backward (no custom op, no second draw) and give the custom op's numbers;
  * with nothing to differentiate (inference), an op entry calls its launcher, not the custom op,
    with the same result; with autograd on, the op's forward and backward run (the custom op's, or
    its eager autograd.Function: tests/ops/test_fused_op.py), named bertfast::<op> in profiles;
  * inference stays current after a fused optimizer step (which leaves version counters alone);
  * in CPU inference the layers call their modules and the torch backend's attention (Layout.plain),
    with the fused ops' numbers, and only when every layer op would run that backend without autograd;
  * unpadding and padding back are views when the batch has no padding;
  * the inference attention groups sequences of similar lengths, so a short sequence beside a
    long one is not padded to it;
  * bf16 autocast on CPU runs the whole model.
"""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import bertfast
from bertfast import dispatch, ops, reference_execution
from bertfast import padding
from bertfast.ops._common import launch_directly
from bertfast.testing import AtenLog, cu_seqlens_from_lengths

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _torch_attention():
    import importlib
    return importlib.import_module("bertfast.ops.attention")


@pytest.mark.parametrize("lengths", [[6, 6, 6], [6, 2, 0, 5]], ids=["dense", "padded"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_varlen_runs_cpu_flash_only_without_dropout(lengths, dropout_p):
    impl = _torch_attention()
    cu = cu_seqlens_from_lengths(torch.tensor(lengths))
    tokens, heads, head_dim = sum(lengths), 2, 16
    q, k, v = torch.randn(tokens, 3, heads, head_dim).unbind(1)
    seed = torch.tensor([7]) if dropout_p else None
    with AtenLog() as log:
        out, lse, keep = impl.attention_varlen_fwd(q, k, v, cu, max(lengths), None, dropout_p, seed)
        impl.attention_varlen_bwd(torch.randn_like(out), q, k, v, out, lse, cu, max(lengths), None, dropout_p, seed,
                                  keep)
    assert (FLASH in log.ops and FLASH_BWD in log.ops) == (dropout_p == 0.0), sorted(map(str, log.ops))


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_padded_runs_cpu_flash_only_without_dropout(dropout_p):
    impl = _torch_attention()
    q, k, v = torch.randn(2, 5, 3, 2, 8).unbind(2)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    seed = torch.tensor([3]) if dropout_p else None
    with AtenLog() as log:
        out, lse, keep = impl.attention_padded_fwd(q, k, v, mask, None, dropout_p, seed)
        grads = impl.attention_padded_bwd(torch.randn_like(out), q, k, v, out, lse, mask, None, dropout_p, seed,
                                          keep)
    assert (FLASH in log.ops) == (dropout_p == 0.0)
    # the fully padded sequence: out 0, lse +inf, no gradient, whichever path ran
    assert not out[1].any() and torch.isposinf(lse[1]).all() and not grads[0][1].any()


@pytest.mark.parametrize("form", ["dense", "padded", "rows-after", "padded-form", "padded-form-full"])
def test_training_with_dropout_keeps_the_probabilities(form, monkeypatch):
    impl = _torch_attention()
    g = torch.Generator().manual_seed(2)
    heads, head_dim = 2, 8
    if form.startswith("padded-form"):
        qkv = torch.randn(3, 6, 3, heads, head_dim, generator=g)
        mask = torch.tensor([[1] * 6, [1, 1, 0, 0, 0, 0], [0] * 6], dtype=torch.bool)  # the last: no key
        if form == "padded-form-full":
            mask = torch.ones_like(mask)
        call = lambda x: ops.attention(*x.unbind(2), mask, 0.3)  # noqa: E731
    else:
        lengths = {"dense": [6, 6, 6], "padded": [6, 2, 0, 5], "rows-after": [6, 2]}[form]
        cu = cu_seqlens_from_lengths(torch.tensor(lengths))
        qkv = torch.randn(sum(lengths) + (3 if form == "rows-after" else 0), 3, heads, head_dim, generator=g)
        qkv[sum(lengths):] = float("nan")  # rows past the last sequence reach nothing
        call = lambda x: ops.attention_varlen(x, cu, max(lengths), 0.3)  # noqa: E731
    dout = torch.randn(call(qkv).shape, generator=g)

    def run():
        x = qkv.clone().requires_grad_()
        torch.manual_seed(11)  # the op's seed comes from torch's generator
        out = call(x)
        with AtenLog() as backward_log:
            out.backward(dout)
        return out.detach(), x.grad, backward_log.ops

    assert not _custom_ops_run(run)
    out, grad, backward_ops = run()
    assert torch.ops.aten.uniform_.default not in backward_ops, "the backward must not draw the mask again"
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()
    monkeypatch.setattr(impl, "keeps_probs", lambda *args: False)
    assert _custom_ops_run(run)
    out_op, grad_op, _ = run()
    torch.testing.assert_close(out, out_op, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, grad_op, atol=1e-6, rtol=1e-5)


def test_the_kept_probabilities_path_trains_under_bf16_autocast():
    """bf16 autocast on a CPU (`bertfast pretrain --precision bf16`): the kept-probabilities path
    computes in fp32 forward and backward, whether the backward runs inside autocast or after it (its
    forward's matmuls under autocast rounded the probabilities to bf16, and a backward outside it
    refused them), and gives what it gives without autocast on the same bf16 inputs, bit for bit."""
    g = torch.Generator().manual_seed(4)
    cu = cu_seqlens_from_lengths(torch.tensor([5, 3]))
    qkv = torch.randn(8, 3, 2, 8, generator=g).to(torch.bfloat16)
    dout = torch.randn(8, 2, 8, generator=g).to(torch.bfloat16)
    results = []
    for autocast, backward_inside in ((True, False), (True, True), (False, False)):
        x = qkv.clone().requires_grad_()
        torch.manual_seed(6)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), dispatch.use_backend("torch"):
            out = ops.attention_varlen(x, cu, 5, 0.3)
            if backward_inside:
                out.backward(dout)
        if not backward_inside:
            out.backward(dout)
        results.append((out.detach(), x.grad))
    assert results[0][0].dtype == torch.bfloat16
    for out, grad in results[1:]:
        assert torch.equal(results[0][0], out) and torch.equal(results[0][1], grad)


def _custom_ops_run(fn) -> set:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("bertfast::")}


def _op_calls(requires_grad: bool):
    """Each op entry once, on inputs that do or do not require gradients."""
    g = torch.Generator().manual_seed(0)
    rg = dict(requires_grad=requires_grad)
    x, res = torch.randn(6, 8, generator=g, **rg), torch.randn(6, 8, generator=g)
    w, b = torch.randn(8, generator=g, **rg), torch.randn(8, generator=g, **rg)
    qkv = torch.randn(6, 3, 2, 4, generator=g, **rg)
    cu = cu_seqlens_from_lengths(torch.tensor([4, 2]))
    ids = torch.tensor([1, 2, 3, 1, 0, 2])
    tables = [torch.randn(n, 8, generator=g, **rg) for n in (5, 6, 2)]
    return {
        "bias_gelu": lambda: ops.bias_gelu(x, b),
        "bias_dropout_residual_layernorm": lambda: ops.bias_dropout_residual_layernorm(x, b, res, w, b, 1e-5),
        "attention_varlen": lambda: ops.attention_varlen(qkv, cu, 4),
        "attention_padded": lambda: ops.attention(*qkv.view(1, 6, 3, 2, 4).unbind(2)),
        "embeddings": lambda: ops.embeddings(ids, ids, ids % 2, *tables, w, b, 1e-5),
    }


@pytest.mark.parametrize("op", ["bias_gelu", "bias_dropout_residual_layernorm", "attention_varlen",
                                "attention_padded", "embeddings"])
def test_inference_calls_the_launcher_not_the_custom_op(op):
    call = _op_calls(requires_grad=True)[op]
    with_grad = call()
    assert with_grad.requires_grad
    assert _custom_ops_run(call), "autograd on: the op (with its backward) must run"
    with torch.no_grad():
        assert not _custom_ops_run(call), "nothing to differentiate: the launcher is called directly"
        direct = call()
    with torch.inference_mode():
        assert not _custom_ops_run(call)
    torch.testing.assert_close(direct, with_grad.detach(), rtol=0, atol=0)
    # frozen inputs with autograd on: nothing to record either
    assert not _custom_ops_run(_op_calls(requires_grad=False)[op])


def test_launch_directly_rules():
    from torch._subclasses.fake_tensor import FakeTensorMode

    plain, leaf = torch.ones(2), torch.ones(2, requires_grad=True)
    assert launch_directly(plain, None)
    assert not launch_directly(plain, leaf)
    with torch.no_grad():
        assert launch_directly(plain, leaf, torch.nn.Parameter(torch.ones(2)))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(plain)
        with torch.no_grad():
            assert not launch_directly(fake), "fake tensors are traced through the custom op's fake"


# ------------------------------------------------------------------ the model on CPU
def _model():
    torch.manual_seed(0)
    return bertfast.BertModel(bertfast.BertConfig.preset("tiny")).eval()


def _batch():
    ids = torch.randint(5, 500, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    return dict(input_ids=ids, attention_mask=mask)


def _real(hidden, batch):
    """Real tokens only (padded positions are 0 on the fast path, encoded pads in the reference)."""
    return hidden[batch["attention_mask"].bool()]


def _reference(model, batch):
    with torch.no_grad(), reference_execution(model):
        return _real(model(**batch).last_hidden_state, batch)


def test_inference_stays_current_after_a_fused_optimizer_step():
    """torch's fused AdamW writes the weights without bumping their version counters: nothing in the
    inference path may key a cache on them."""
    model, batch = _model(), _batch()
    with torch.inference_mode():
        model(**batch)
    model.train()
    model(**batch).last_hidden_state.square().sum().backward()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    opt.step()
    model.eval()
    with torch.inference_mode():
        out = model(**batch).last_hidden_state
    torch.testing.assert_close(_real(out, batch), _reference(model, batch), atol=2e-5, rtol=1e-5)


def test_bf16_autocast_runs_the_model_on_cpu():
    model, batch = _model(), _batch()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**batch).last_hidden_state
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(_real(out.float(), batch), _reference(model, batch), atol=0.1, rtol=0.05)
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(**batch).last_hidden_state.float().square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.encoder.parameters())


# ------------------------------------------------------------------ plain layers in inference
_LAYER_OPS = ("attention_varlen", "bias_gelu", "bias_dropout_residual_layernorm")


def _layer_op_calls(monkeypatch) -> dict:
    """Counts the calls of the layer ops' entries (the encoder calls them as ``ops.<op>``)."""
    calls = dict.fromkeys(_LAYER_OPS, 0)
    for name in _LAYER_OPS:
        def counted(*args, __name=name, __fn=getattr(ops, name), **kwargs):
            calls[__name] += 1
            return __fn(*args, **kwargs)
        monkeypatch.setattr(ops, name, counted)
    return calls


def _batches():
    g = torch.Generator().manual_seed(3)
    dense = dict(input_ids=torch.randint(5, 500, (2, 12), generator=g),
                 attention_mask=torch.ones(2, 12, dtype=torch.long))
    ids = torch.randint(5, 500, (3, 8), generator=g)
    mask = torch.tensor([[1] * 8, [1] * 3 + [0] * 5, [1] * 6 + [0] * 2])
    # packed: five sequences in one row, one of them empty
    cu = torch.tensor([0, 5, 7, 7, 10, 12], dtype=torch.int32)
    packed = dict(input_ids=torch.randint(5, 500, (1, 12), generator=g), cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                  max_length_q=5, max_length_k=5)
    return {"dense": dense, "padded": dict(input_ids=ids, attention_mask=mask), "packed": packed}


@pytest.mark.parametrize("form", ["dense", "padded", "packed"])
def test_inference_on_cpu_calls_the_modules_with_the_ops_numbers(form, monkeypatch):
    model = _model()
    batch = _batches()[form]
    calls = _layer_op_calls(monkeypatch)
    with torch.inference_mode():
        plain = model(**batch)
    assert calls == dict.fromkeys(_LAYER_OPS, 0), calls
    with torch.enable_grad():  # autograd on: the fused ops run (their torch backend on a CPU)
        fused = model(**batch)
    layers = model.config.num_hidden_layers  # (GELU is aten's after a bias-adding GEMM on a CPU: no bias_gelu op)
    assert calls == {"attention_varlen": layers, "bias_gelu": 0, "bias_dropout_residual_layernorm": 2 * layers}
    torch.testing.assert_close(plain.last_hidden_state, fused.last_hidden_state.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(plain.pooler_output, fused.pooler_output.detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("lengths", [[5, 200, 7, 180, 12, 150, 3, 1, 0], [16, 16, 16], [64, 64, 0, 0], [9, 0, 7]])
def test_inference_attention_groups_sequences_by_length(lengths, monkeypatch):
    """varlen_inference gives each sequence its own attention (aten's SDPA on it alone), running the
    flash kernel on groups of similar lengths: a query beside a passage is not padded to its length."""
    impl = _torch_attention()
    cu = cu_seqlens_from_lengths(torch.tensor(lengths))
    tokens = sum(lengths)
    q, k, v = (torch.randn(tokens, 2, 8) for _ in range(3))
    shapes = []  # [group, length, heads, dim] of each padded call
    padded_fwd = impl.attention_padded_fwd
    monkeypatch.setattr(impl, "attention_padded_fwd", lambda q, *a: shapes.append(q.shape) or padded_fwd(q, *a))
    got = impl.varlen_inference(cu, max(lengths), tokens)(q, k, v)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b > a:
            want = torch.nn.functional.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)))
            torch.testing.assert_close(got[a:b], want.transpose(0, 1), atol=1e-6, rtol=1e-5)
    real = [n for n in lengths if n]
    positions = sum(shape[0] * shape[1] for shape in shapes)
    assert sum(real) <= positions <= 1.25 * sum(real)  # a group's sequences: at least 1 / 1.25 of its longest
    assert len(shapes) == len(set(real)) if len(set(real)) <= 2 else len(shapes) < len(real)


def test_inference_runs_the_ops_when_a_layer_op_would_not_run_plain(monkeypatch):
    from bertfast import dispatch

    model, batch = _model(), _batch()
    calls = _layer_op_calls(monkeypatch)

    def fused_ran() -> bool:
        calls.update(dict.fromkeys(_LAYER_OPS, 0))
        with torch.no_grad():
            model(**batch)
        return calls["attention_varlen"] == model.config.num_hidden_layers

    assert not fused_ran()
    model.train()  # dropout on (the ops draw their own masks)
    assert fused_ran()
    model.eval()
    model.encoder.layer[1].attention.train()  # one module in training mode is enough
    assert fused_ran()
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fused_ran()
    with dispatch.use_backend({"bias_gelu": "triton"}):  # one fused backend (the interpreter) is enough
        assert fused_ran()
    assert not fused_ran()


def test_inference_with_a_hooked_module_runs_its_hook():
    model, batch = _model(), _batch()
    seen = []
    model.encoder.layer[0].attention.self.key.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    with torch.inference_mode():
        model(**batch)
    assert seen == [(int(batch["attention_mask"].sum()), model.config.hidden_size)]


def test_inference_with_a_hooked_layer_part_calls_it_as_a_module(monkeypatch):
    """The plain math calls a layer's Linears, LayerNorms and dropouts, not its parts (BertSelfOutput,
    BertIntermediate, ...): a hook on a part sends the forward to the ops, which call it."""
    model, batch = _model(), _batch()
    with torch.inference_mode():
        want = model(**batch).last_hidden_state
    seen = []
    model.encoder.layer[1].attention.output.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    calls = _layer_op_calls(monkeypatch)
    with torch.inference_mode():
        got = model(**batch).last_hidden_state
    assert seen == [(int(batch["attention_mask"].sum()), model.config.hidden_size)]
    assert calls["attention_varlen"] == model.config.num_hidden_layers
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------ padding
def test_no_padding_means_views():
    x = torch.randn(2, 3, 4)
    rows, _, _ = padding.unpad_mask(torch.ones(2, 3))
    flat = padding.unpad(x, rows)
    assert flat.data_ptr() == x.data_ptr() and flat.shape == (6, 4)
    back = padding.pad_rows(flat, rows, 2, 3)
    assert back.data_ptr() == x.data_ptr() and torch.equal(back, x)

    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    rows, _, _ = padding.unpad_mask(mask)
    flat = padding.unpad(x, rows)
    torch.testing.assert_close(flat, x[mask.bool()])
    back = padding.pad_rows(flat, rows, 2, 3)
    torch.testing.assert_close(back, x * mask[..., None])


def test_on_cpu_the_gemm_adds_the_bias_unless_a_fused_backend_runs():
    """With the torch backend the bias goes into the GEMM (addmm) and GELU is aten's; a fused backend
    (here the Triton interpreter, forced) still gets the bias in its op."""
    from bertfast import dispatch
    from bertfast.model import modeling

    model, batch = _model(), _batch()
    model.train()
    layer = model.encoder.layer[0]
    x = torch.randn(5, model.config.hidden_size)
    assert modeling._bias_in_gemm(x, layer.intermediate.dense, "bias_gelu")
    ran = _custom_ops_run(lambda: model(**batch).last_hidden_state.sum().backward())
    assert "bertfast::bias_gelu" not in ran and "bertfast::bias_dropout_residual_layernorm" in ran
    with dispatch.use_backend("triton"):
        assert not modeling._bias_in_gemm(x, layer.intermediate.dense, "bias_gelu")
