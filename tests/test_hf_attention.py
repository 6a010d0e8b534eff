"""transformers' BertModel running on bertfast's attention through AttentionInterface."""
import pytest
import torch

import bertfast
import bertfast.hf
from bertfast.testing import make_lengths, mask_from_lengths

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("mode", ["none", "random", "one"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_transformers_bert_on_bertfast_attention_matches_eager(mode, backend):
    bertfast.hf.register()
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=40, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    model = transformers.BertModel(config).eval()
    lengths = make_lengths(mode, 3, 9, torch.Generator().manual_seed(1))
    mask = mask_from_lengths(lengths, 9)
    ids = torch.randint(0, 99, (3, 9))
    model.set_attn_implementation("eager")
    expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
    model.set_attn_implementation("bertfast")
    with bertfast.use_backend(backend):
        got = model(input_ids=ids, attention_mask=mask).last_hidden_state
    valid = mask.bool()
    torch.testing.assert_close(got[valid], expected[valid], atol=1e-5, rtol=0)


def test_key_padding_mask_recovered_from_additive_mask():
    additive = torch.zeros(2, 1, 4, 4)
    additive[0, :, :, 2:] = torch.finfo(torch.float32).min
    keep = bertfast.hf.key_padding_mask_from(additive, 2, 4, torch.device("cpu"))
    assert keep.tolist() == [[True, True, False, False], [True] * 4]


def test_cross_attention_is_refused():
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="self-attention"):
        bertfast.hf.bertfast_attention(torch.nn.Module(), q, torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), None)
