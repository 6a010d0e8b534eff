"""The query/key/value projection (bertfast.model.fused_qkv): in inference three GEMMs write their columns of
one buffer, no weight is concatenated; the weights keep storage of their own, so every way of saving
a checkpoint keeps all three.
"""
import pytest
import torch

import bertfast
from bertfast.model import fused_qkv
from bertfast.model.modeling import BertSelfAttention
from bertfast.testing import AtenLog


def _attention():
    torch.manual_seed(0)
    model = bertfast.BertModel(bertfast.BertConfig.preset("tiny"))
    return model, next(m for m in model.modules() if isinstance(m, BertSelfAttention))


def _concatenated(attn, x):
    linears = (attn.query, attn.key, attn.value)
    return torch.nn.functional.linear(x, torch.cat([m.weight for m in linears]), torch.cat([m.bias for m in linears]))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "frozen"])
def test_inference_writes_columns_without_concatenating_weights(mode):
    _, attn = _attention()
    x = torch.randn(7, attn.query.in_features)
    if mode == "frozen":
        for p in attn.parameters():
            p.requires_grad_(False)
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode, torch.enable_grad)
    with context(), AtenLog() as log:
        qkv = attn.qkv(x)
    assert torch.ops.aten.cat.default not in log.ops
    assert log.ops.count(torch.ops.aten.addmm.out) == 3
    with torch.no_grad():
        expected = _concatenated(attn, x)
    torch.testing.assert_close(qkv.flatten(1), expected, rtol=1e-6, atol=1e-6)
    assert qkv.is_contiguous()


def test_training_and_autocast_match_the_concatenated_projection():
    _, attn = _attention()
    x = torch.randn(5, attn.query.in_features, requires_grad=True)
    out = attn.qkv(x).flatten(1)
    torch.testing.assert_close(out, _concatenated(attn, x))
    out.square().sum().backward()
    assert attn.key.weight.grad is not None and x.grad is not None
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        low = attn.qkv(x.detach())
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.flatten(1).float(), out.detach(), rtol=2e-2, atol=2e-2)


def test_a_hooked_or_replaced_projection_is_called_as_a_module():
    _, attn = _attention()
    x = torch.randn(3, attn.query.in_features)
    calls = []
    attn.value.register_forward_hook(lambda *args: calls.append(1))
    with torch.no_grad():
        qkv = attn.qkv(x)
    assert calls == [1]
    torch.testing.assert_close(qkv.flatten(1), _concatenated(attn, x))


def test_mixed_dtypes_take_the_concatenating_path():
    _, attn = _attention()
    x = torch.randn(3, attn.query.in_features, dtype=torch.float64)
    assert not fused_qkv._into_columns(x, [attn.query.weight], [attn.query.bias])


def test_weights_keep_their_own_storage_so_every_save_keeps_them(tmp_path):
    from safetensors.torch import load_file, save_model
    from transformers.pytorch_utils import id_tensor_storage

    model, _ = _attention()
    with torch.no_grad():
        model(torch.randint(5, 100, (2, 6)))
    state = model.state_dict()
    storages = [id_tensor_storage(t) for t in state.values()]
    assert len(set(storages)) == len(storages), "accelerate's safetensors saving keeps one name per storage"
    save_model(model, str(tmp_path / "model.safetensors"))
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert saved.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(saved[name], tensor), name
