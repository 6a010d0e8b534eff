"""Query, key and value weights in one buffer (bertfast.fused_qkv): the attention's GEMM runs over views
of it, with no copy per call, and everything that moves or reloads a model keeps them together.

The numbers must be the concatenating path's: a model whose three weights were pulled apart (so each
call concatenates them) gives the same outputs and gradients, to the bit on CPU in fp32.
"""
import copy
import io

import pytest
import torch

import bertfast
from bertfast import fused_qkv
from bertfast.modeling import BertSelfAttention


def _model(cls=bertfast.BertForSequenceClassification):
    torch.manual_seed(0)
    return cls(bertfast.BertConfig.preset("tiny"))


def _attentions(model):
    return [m for m in model.modules() if isinstance(m, BertSelfAttention)]


def _shared(attn) -> bool:
    linears = (attn.query, attn.key, attn.value)
    return (fused_qkv.joined([m.weight for m in linears]) is not None
            and fused_qkv.joined([m.bias for m in linears]) is not None)


def _all_shared(model) -> bool:
    return all(_shared(a) for a in _attentions(model))


def _pulled_apart(model):
    """A copy whose query/key/value tensors each have storage of their own: the concatenating path."""
    other = copy.deepcopy(model)
    for attn in _attentions(other):
        for m in (attn.query, attn.key, attn.value):
            m.weight.data, m.bias.data = m.weight.data.clone(), m.bias.data.clone()
        assert not _shared(attn)
    return other


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 500, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 6:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1, 1]))


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_joined_is_a_view_only_of_back_to_back_tensors():
    buffer = torch.arange(12.0)
    a, b, c = buffer[:4], buffer[4:8], buffer[8:]
    view = fused_qkv.joined([a, b, c])
    assert view is not None and view.data_ptr() == buffer.data_ptr() and torch.equal(view, buffer)
    assert fused_qkv.joined([a, c, b]) is None, "out of order"
    assert fused_qkv.joined([a, c]) is None, "a gap"
    assert fused_qkv.joined([a, b.clone(), c]) is None, "another storage"
    assert fused_qkv.joined([buffer.view(3, 4)[:, :2], buffer.view(3, 4)[:, 2:]]) is None, "not contiguous"
    rows = torch.zeros(6, 4)
    assert fused_qkv.joined([rows[:2], rows[2:5], rows[5:]]).shape == (6, 4)


def test_a_new_model_moved_copied_or_reloaded_keeps_them_in_one_buffer(tmp_path):
    model = _model()
    assert _all_shared(model)
    params = {n: p for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters())
    model.to(torch.float64)
    assert _all_shared(model)
    # the same Parameter objects: an optimizer made before the move still holds the model's weights
    assert all(p is params[n] for n, p in model.named_parameters())
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {id(p) for p in params.values()}
    model.float()
    assert _all_shared(model.half()) and _all_shared(model.float())
    assert _all_shared(copy.deepcopy(model))
    pickled = io.BytesIO()
    torch.save(model, pickled)
    pickled.seek(0)
    assert _all_shared(torch.load(pickled, weights_only=False))
    assert _all_shared(copy.deepcopy(model).to_empty(device="cpu"))

    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(fresh, assign=True)
    assert _all_shared(model)
    model.save_pretrained(tmp_path)
    loaded, info = type(model).from_pretrained(tmp_path, output_loading_info=True)
    assert _all_shared(loaded) and not info["missing_keys"]
    assert _all_shared(type(model).from_pretrained(tmp_path, dtype=torch.bfloat16))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


def test_saved_files_hold_three_separate_tensors(tmp_path):
    from safetensors.torch import load_file

    model = _model()
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    attn = _attentions(model)[0]
    for part in ("query", "key", "value"):
        for kind in ("weight", "bias"):
            name = f"bert.encoder.layer.0.attention.self.{part}.{kind}"
            assert torch.equal(saved[name], getattr(getattr(attn, part), kind)), name


@pytest.mark.parametrize("train", [True, False])
def test_same_numbers_as_concatenating(train):
    model = _model().train(train)
    if train:
        for m in model.modules():  # dropout would draw another mask in each model
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    apart = _pulled_apart(model)
    batch = _batch()
    logits, grads = _step(model, batch)
    logits_apart, grads_apart = _step(apart, batch)
    assert torch.equal(logits, logits_apart)
    assert grads.keys() == grads_apart.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_apart[name]), name
    with torch.inference_mode():
        assert torch.equal(model(**batch).logits, apart(**batch).logits)


def test_bf16_autocast_matches_concatenating():
    model = _model()
    apart = _pulled_apart(model)
    batch = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, grads = _step(model.eval(), batch)
        logits_apart, grads_apart = _step(apart.eval(), batch)
    torch.testing.assert_close(logits, logits_apart, rtol=0, atol=0)
    for name in grads:
        assert grads[name].dtype == torch.float32, name
        torch.testing.assert_close(grads[name], grads_apart[name], rtol=1e-6, atol=1e-6, msg=name)


def test_frozen_weights_get_no_gradient_and_the_input_still_does():
    attn = _attentions(_model())[0]
    for p in attn.parameters():
        p.requires_grad_(False)
    x = torch.randn(5, attn.query.in_features, requires_grad=True)
    attn.qkv(x).square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert all(p.grad is None for p in attn.parameters())
    expected = torch.autograd.grad(
        torch.cat([attn.query(x), attn.key(x), attn.value(x)], 1).square().sum(), x)[0]
    torch.testing.assert_close(x.grad, expected)


def test_a_replaced_weight_falls_back_to_concatenating():
    model = _model().eval()
    attn = _attentions(model)[0]
    attn.key.weight = torch.nn.Parameter(attn.key.weight.detach() * 2)  # a new tensor, elsewhere
    assert not _shared(attn)
    x = torch.randn(4, attn.query.in_features)
    expected = torch.cat([attn.query(x), attn.key(x), attn.value(x)], 1)
    torch.testing.assert_close(attn.qkv(x).flatten(1), expected)
