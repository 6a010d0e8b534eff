"""Bad input gets a ValueError naming what was expected and what was given."""
import pytest
import torch

import bertfast

CONFIG = bertfast.BertConfig.preset("tiny")


@pytest.fixture(scope="module")
def model():
    return bertfast.BertForPreTraining(CONFIG).eval()


def ids(batch=2, seqlen=6):
    return torch.randint(1, CONFIG.vocab_size, (batch, seqlen))


@pytest.mark.parametrize("kwargs, message", [
    (dict(input_ids=ids().float()), "input_ids: expected an integer tensor, got dtype torch.float32"),
    (dict(input_ids=ids()[0]), r"input_ids: expected shape \[batch, seq_len\], got \(6,\)"),
    (dict(input_ids=ids(seqlen=CONFIG.max_position_embeddings + 1)), "exceeds max_position_embeddings 128"),
    (dict(input_ids=torch.full((2, 6), CONFIG.vocab_size)), r"input_ids: expected values in \[0, vocab_size=512\)"),
    (dict(input_ids=ids(), token_type_ids=torch.full((2, 6), 2)), r"token_type_ids: expected values in \[0, type_vocab"),
    (dict(input_ids=ids(), attention_mask=torch.full((2, 6), 2)), "attention_mask: expected only 0 .* and 1"),
    (dict(input_ids=ids(), attention_mask=torch.ones(2, 5)), r"attention_mask: expected shape \[2, 6\], got \(2, 5\)"),
    (dict(input_ids=ids(), labels=torch.full((2, 6), CONFIG.vocab_size)), r"labels: expected values in \[0, 512\)"),
    (dict(input_ids=ids(), labels=torch.zeros(2, 5, dtype=torch.long)), r"labels: expected shape \(2, 6\)"),
    (dict(input_ids=ids(), next_sentence_label=torch.tensor([0, 2])), r"next_sentence_label: expected values in \[0, 2\)"),
    (dict(input_ids=ids(), encoder_hidden_states=torch.zeros(2, 6, 64)), "encoder only"),
])
def test_bad_inputs_raise_clear_errors(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model(**kwargs)


def test_output_attentions_needs_reference_execution(model):
    with pytest.raises(ValueError, match="reference_execution"):
        model(ids(), output_attentions=True)
    with bertfast.reference_execution(model):
        out = model(ids(), output_attentions=True)
    assert len(out.attentions) == CONFIG.num_hidden_layers


@pytest.mark.parametrize("values, message", [
    (dict(hidden_size=65), "must be divisible by num_attention_heads"),
    (dict(hidden_act="relu"), "hidden_act must be one of"),
    (dict(position_embedding_type="relative_key"), "position_embedding_type must be 'absolute'"),
    (dict(is_decoder=True), "encoder only"),
    (dict(hidden_dropout_prob=1.0), r"hidden_dropout_prob must be in \[0, 1\)"),
    (dict(vocab_size=0), "vocab_size must be a positive int"),
    (dict(problem_type="ranking"), "problem_type must be one of"),
])
def test_bad_config_raises_clear_errors(values, message):
    with pytest.raises(ValueError, match=message):
        bertfast.BertConfig.preset("tiny", **values)


def test_a_transformers_config_is_checked_when_the_model_is_built():
    import transformers

    config = transformers.BertConfig(**{**bertfast.BertConfig.preset("tiny").to_dict(), "hidden_act": "relu"})
    with pytest.raises(ValueError, match="hidden_act must be one of"):
        bertfast.BertModel(config)
    with pytest.raises(ValueError, match="expected a transformers BertConfig"):
        bertfast.BertModel(transformers.RobertaConfig())


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="expected one of"):
        bertfast.BertConfig.preset("bert-huge")
