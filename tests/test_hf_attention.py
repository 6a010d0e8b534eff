"""transformers' models running on bertfast's attention through AttentionInterface, and every
case the kernel does not serve refused with a clear error."""
import pytest
import torch

import bertfast
import bertfast.hf
from bertfast.testing import make_lengths, mask_from_lengths

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=40)


@pytest.fixture(autouse=True)
def registered():
    bertfast.hf.register()


def _batch(seed=1):
    ids = torch.randint(5, 99, (3, 9), generator=torch.Generator().manual_seed(seed))
    return ids, mask_from_lengths(torch.tensor([9, 4, 1]), 9)


def _hidden(model, implementation, ids, mask):
    model.set_attn_implementation(implementation)
    return model(input_ids=ids, attention_mask=mask).last_hidden_state


@pytest.mark.parametrize("mode", ["none", "random", "one"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_transformers_bert_on_bertfast_attention_matches_eager(mode, backend):
    torch.manual_seed(0)
    config = transformers.BertConfig(**SMALL, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    model = transformers.BertModel(config).eval()
    lengths = make_lengths(mode, 3, 9, torch.Generator().manual_seed(1))
    mask = mask_from_lengths(lengths, 9)
    ids = torch.randint(0, 99, (3, 9))
    expected = _hidden(model, "eager", ids, mask)
    with bertfast.use_backend(backend):
        got = _hidden(model, "bertfast", ids, mask)
    valid = mask.bool()
    torch.testing.assert_close(got[valid], expected[valid], atol=1e-5, rtol=0)


def _family(name):
    no_dropout = dict(attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    t = transformers
    return {
        "roberta": lambda: t.RobertaModel(t.RobertaConfig(**SMALL, **no_dropout)),
        "xlm-roberta": lambda: t.XLMRobertaModel(t.XLMRobertaConfig(**SMALL, **no_dropout)),
        "camembert": lambda: t.CamembertModel(t.CamembertConfig(**SMALL, **no_dropout)),
        "electra": lambda: t.ElectraModel(t.ElectraConfig(**SMALL, embedding_size=16, **no_dropout)),
        "albert": lambda: t.AlbertModel(t.AlbertConfig(**SMALL, embedding_size=16, **no_dropout)),
        "distilbert": lambda: t.DistilBertModel(t.DistilBertConfig(vocab_size=99, dim=32, n_layers=2, n_heads=2,
                                                                   hidden_dim=40, dropout=0.0, attention_dropout=0.0)),
        # every layer global: no sliding window reaches the attention function
        "modernbert-global": lambda: t.ModernBertModel(t.ModernBertConfig(
            **SMALL, global_attn_every_n_layers=1, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
            sep_token_id=2, attention_dropout=0.0, mlp_dropout=0.0, embedding_dropout=0.0)),
    }[name]()


@pytest.mark.parametrize("family", ["roberta", "xlm-roberta", "camembert", "electra", "albert", "distilbert",
                                    "modernbert-global"])
def test_encoder_families_on_bertfast_attention_match_sdpa(family):
    torch.manual_seed(0)
    model = _family(family).eval()
    ids, mask = _batch()
    expected = _hidden(model, "sdpa", ids, mask)
    got = _hidden(model, "bertfast", ids, mask)
    valid = mask.bool()
    torch.testing.assert_close(got[valid], expected[valid], atol=1e-5, rtol=0)


def test_compiled_fullgraph_matches_sdpa_and_checks_the_mask_on_the_device():
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(**SMALL, attention_probs_dropout_prob=0.0,
                                                           hidden_dropout_prob=0.0)).eval()
    ids, mask = _batch()
    expected = _hidden(model, "sdpa", ids, mask)
    model.set_attn_implementation("bertfast")
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
    valid = mask.bool()
    torch.testing.assert_close(got[valid], expected[valid], atol=1e-5, rtol=0)

    attend = torch.compile(lambda q, m: bertfast.hf.bertfast_attention(_Encoder(), q, q, q, m)[0],
                           backend="aot_eager", fullgraph=True)
    q = torch.randn(2, 2, 5, 8)
    with pytest.raises(RuntimeError, match="key-padding masks only"):
        attend(q, torch.randn(2, 1, 5, 5))


def test_key_padding_mask_recovered_from_additive_mask():
    additive = torch.zeros(2, 1, 4, 4)
    additive[0, :, :, 2:] = torch.finfo(torch.float32).min
    keep = bertfast.hf.key_padding_mask_from(additive, 2, 4, torch.device("cpu"))
    assert keep.tolist() == [[True, True, False, False], [True] * 4]


# ------------------------------------------------------------------ what the kernel does not serve
class _Encoder(torch.nn.Module):
    is_causal = False


def _qkv(seqlen=5):
    q = torch.randn(2, 2, seqlen, 8)
    return q, torch.randn_like(q), torch.randn_like(q)


def test_cross_attention_is_refused():
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="self-attention only.*cross-attention"):
        bertfast.hf.bertfast_attention(_Encoder(), q, torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), None)


def test_causal_attention_is_refused():
    decoder = transformers.BertModel(transformers.BertConfig(**SMALL, is_decoder=True)).eval()
    decoder.set_attn_implementation("bertfast")
    ids, mask = _batch()
    with pytest.raises(ValueError, match="BertSelfAttention is causal"):
        decoder(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="causal"):
        bertfast.hf.bertfast_attention(_Encoder(), *_qkv(), None, is_causal=True)
    with pytest.raises(ValueError, match="causal"):  # a module that does not say is taken as causal, as sdpa does
        bertfast.hf.bertfast_attention(torch.nn.Module(), *_qkv(), None)


def test_modernbert_sliding_window_is_refused():
    config = transformers.ModernBertConfig(**{**SMALL, "num_hidden_layers": 3}, local_attention=4,
                                           global_attn_every_n_layers=3, pad_token_id=0, bos_token_id=1,
                                           eos_token_id=2, cls_token_id=1, sep_token_id=2)
    model = transformers.ModernBertModel(config).eval()
    model.set_attn_implementation("bertfast")
    ids, mask = _batch()
    with pytest.raises(ValueError, match="does not serve a sliding window: ModernBertAttention passed sliding_window"):
        model(input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("kwarg", ["sliding_window", "softcap", "s_aux", "sinks", "position_bias", "head_mask"])
def test_unserved_arguments_are_refused(kwarg):
    with pytest.raises(ValueError, match=f"does not serve .*{kwarg}="):
        bertfast.hf.bertfast_attention(_Encoder(), *_qkv(), None, **{kwarg: 1})
    bertfast.hf.bertfast_attention(_Encoder(), *_qkv(), None, **{kwarg: None})  # None: not asked for


def _bias_mask():
    bias = torch.zeros(2, 1, 5, 5)
    bias[0, 0] = torch.randn(5, 5)  # a relative position bias folded into an additive mask
    return bias


@pytest.mark.parametrize("mask", [
    _bias_mask(),
    torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 1, 5, 5),  # causal
    (torch.arange(5)[:, None] - torch.arange(5)).abs().le(1).expand(2, 1, 5, 5),  # sliding window
], ids=["position bias", "causal", "window"])
def test_masks_that_are_not_key_padding_are_refused(mask):
    with pytest.raises(ValueError, match="key-padding masks only"):
        bertfast.hf.bertfast_attention(_Encoder(), *_qkv(), mask)


def test_a_mask_changed_in_place_is_checked_again():
    mask = torch.zeros(2, 1, 5, 5)
    mask[1, ..., 3:] = torch.finfo(torch.float32).min
    bertfast.hf.bertfast_attention(_Encoder(), *_qkv(), mask)
    bertfast.hf.bertfast_attention(_Encoder(), *_qkv(), mask)  # the same tensor: checked once
    mask[0, 0, 2, 1] = 0.5
    with pytest.raises(ValueError, match="key-padding masks only"):
        bertfast.hf.bertfast_attention(_Encoder(), *_qkv(), mask)


# ------------------------------------------------------------------ families that never call it
def _own_attention(name):
    if name == "deberta-v2":
        return transformers.DebertaV2Model, transformers.DebertaV2Config(**SMALL)
    return transformers.MPNetModel, transformers.MPNetConfig(**SMALL)


@pytest.mark.parametrize("family", ["deberta-v2", "mpnet"])
def test_families_with_their_own_attention_refuse_it_when_built_or_loaded(family, tmp_path):
    model_class, config = _own_attention(family)
    model_class(config).save_pretrained(tmp_path)
    message = f"{model_class.__name__} computes attention in its own code"
    with pytest.raises(ValueError, match=message):
        model_class.from_pretrained(tmp_path, attn_implementation="bertfast")
    with pytest.raises(ValueError, match=message):
        transformers.AutoModel.from_pretrained(tmp_path, attn_implementation="bertfast")
    config._attn_implementation = "bertfast"
    with pytest.raises(ValueError, match=message):
        model_class(config)


def test_bertfast_classes_say_their_attention_always_runs(tmp_path):
    """Asked of bertfast's own classes, the "bertfast" attention is refused with what to do
    instead, never with advice the class would refuse too."""
    bertfast.BertModel(bertfast.BertConfig(**SMALL)).save_pretrained(tmp_path)
    message = "bertfast's own class, whose fused attention always runs; leave attn_implementation out"
    with pytest.raises(ValueError, match=message) as info:
        bertfast.BertModel.from_pretrained(tmp_path, attn_implementation="bertfast")
    assert "sdpa" not in str(info.value)
    assert bertfast.BertModel.from_pretrained(tmp_path, attn_implementation="eager") is not None


@pytest.mark.parametrize("family", ["deberta-v2", "mpnet"])
def test_families_with_their_own_attention_keep_it_when_set_later(family):
    model_class, config = _own_attention(family)
    model = model_class(config)
    model.set_attn_implementation("bertfast")  # transformers warns and leaves it unchanged
    assert model.config._attn_implementation != "bertfast"


def test_register_is_idempotent():
    get_correct = transformers.PreTrainedModel.get_correct_attn_implementation
    bertfast.hf.register()
    assert transformers.PreTrainedModel.get_correct_attn_implementation is get_correct
    model = transformers.BertModel(transformers.BertConfig(**SMALL))
    assert model.get_correct_attn_implementation("sdpa") == "sdpa"  # other names pass through
