"""What every fused op shares: three backends implementing one launcher contract, the dropout
seed policy, and the whole model under torch.compile(fullgraph=True). Each op's own contract is
tested on every backend in tests/ops/test_<op>.py."""
import importlib
import inspect

import pytest
import torch
import transformers

import bertfast
import bertfast.ops as ops
from bertfast import dispatch, registry

def test_every_op_has_three_backends_named_after_it():
    for op in dispatch.ops():
        spec, _ = registry.form(op)
        table = dispatch.backends(op)
        assert set(table) == {"torch", "triton", "cuda"}, op
        assert [b.module for b in table.values()] == [f"bertfast.ops.{spec.name}", f"bertfast.kernels.{spec.name}",
                                                      f"bertfast.cuda.{spec.name}"], op
        assert op.startswith(spec.name), (op, spec.name)  # attention_varlen and attention_padded: op attention
    assert {registry.form(op)[0].name for op in dispatch.ops()} == {op.name for op in registry.ops() if op.forms}


def _positional(fn):
    """Names of the parameters every backend must take (test-only extras have defaults)."""
    return [p.name for p in inspect.signature(fn).parameters.values() if p.default is inspect.Parameter.empty]


@pytest.mark.parametrize("op", [op.name for op in registry.ops() if op.forms])
def test_backends_implement_one_launcher_contract(op):
    spec = registry.get(op)
    torch_backend, *fused = (importlib.import_module(spec.module(b)) for b in ("torch", "triton", "cuda"))
    assert spec.launchers
    for name in spec.launchers:
        expected = _positional(getattr(torch_backend, name))
        for backend in fused:
            assert _positional(getattr(backend, name)) == expected, (backend.__name__, name)
    for backend in fused:  # the limits each fused backend declares to dispatch
        assert callable(backend.unsupported), backend.__name__


def test_a_forced_backend_beyond_its_declared_limits_raises_with_the_reason():
    x = torch.randn(2, 8200)  # wider than the fused LayerNorm kernels' one-tile rows
    w, b = torch.ones(8200), torch.zeros(8200)
    assert dispatch.select("bias_dropout_residual_layernorm", x=x, bias=None, residual=None, weight=w,
                           ln_bias=b) == "torch"
    with ops.use_backend("triton"), pytest.raises(dispatch.NoBackendError, match="hidden size 8200"):
        ops.bias_dropout_residual_layernorm(x, None, None, w, b, 1e-5)


def test_dropout_draws_a_new_mask_per_call_and_follows_manual_seed():
    x = torch.ones(64, 32)
    w, b = torch.ones(32), torch.zeros(32)
    torch.manual_seed(3)
    first = ops.bias_dropout_residual_layernorm(x, None, x, w, b, 1e-5, 0.5)
    second = ops.bias_dropout_residual_layernorm(x, None, x, w, b, 1e-5, 0.5)
    torch.manual_seed(3)
    again = ops.bias_dropout_residual_layernorm(x, None, x, w, b, 1e-5, 0.5)
    assert not torch.equal(first, second)
    assert torch.equal(first, again)


def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    config = bertfast.BertConfig.preset("tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                        num_hidden_layers=1)
    model = bertfast.BertForPreTraining(config)
    ids = torch.randint(1, config.vocab_size, (2, 8))
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    labels = torch.where(torch.rand(2, 8) < 0.4, ids, -100) * mask + (mask - 1) * 100
    nsp = torch.tensor([0, 1])
    eager = model(ids, mask, labels=labels, next_sentence_label=nsp)
    eager_grads = torch.autograd.grad(eager.loss, list(model.parameters()))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(ids, mask, labels=labels, next_sentence_label=nsp)
    torch.testing.assert_close(out.loss, eager.loss, atol=1e-5, rtol=0)
    got = torch.autograd.grad(out.loss, list(model.parameters()))
    for a, b in zip(got, eager_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_torch_compile_follows_new_shapes_through_a_dynamic_recompile():
    """A second shape makes Dynamo recompile with a symbolic batch and length: fullgraph once stopped
    there at dispatch (a symbolic size cannot be passed as a constant), and token_type_ids given only
    then (static beside the symbolic ids) were refused as of the wrong shape. BERT's and RoBERTa's
    encoders (one forward, one code object) at three shapes against eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    sizes = dict(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    models = [bertfast.BertModel(bertfast.BertConfig(**sizes)).eval(),
              bertfast.RobertaModel(transformers.RobertaConfig(**sizes, pad_token_id=1, type_vocab_size=1)).eval()]
    try:
        for model in models:
            compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
            for batch, seqlen, types in ((3, 10, False), (2, 12, False), (4, 7, True)):
                ids = torch.randint(3, 99, (batch, seqlen))
                mask = torch.ones_like(ids)
                mask[0, seqlen // 2:] = 0
                kw = dict(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids) if types else None)
                with torch.no_grad():
                    got, want = compiled(**kw).last_hidden_state, model(**kw).last_hidden_state
                torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=0)
    finally:
        torch._dynamo.reset()
