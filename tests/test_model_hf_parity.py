"""Fast model vs bertfast reference vs transformers, every model class, fp32 on CPU.

Outputs are compared at valid (non-pad) tokens within 1e-5, losses within 1e-5, and the
gradient of every parameter within 1e-4 relative to its norm.
"""
import tempfile

import pytest
import torch

import bertfast
from bertfast.testing import PADDING_MODES, make_lengths, mask_from_lengths

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "tiny": dict(),
    "odd": dict(hidden_size=36, num_attention_heads=2, intermediate_size=50, vocab_size=101, num_hidden_layers=3),
    "one-head": dict(hidden_size=32, num_attention_heads=1, intermediate_size=64, num_hidden_layers=1),
    "tanh": dict(hidden_act="gelu_pytorch_tanh"),
}


def make_config(name, **extra):
    return bertfast.BertConfig.preset("tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                      **CONFIGS[name], **extra)


def make_inputs(config, mode, batch=4, seqlen=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = make_lengths(mode, batch, seqlen, gen)
    mask = mask_from_lengths(lengths, seqlen)
    ids = torch.randint(1, config.vocab_size, (batch, seqlen), generator=gen)
    token_types = torch.randint(0, config.type_vocab_size, (batch, seqlen), generator=gen)
    return ids, mask, token_types


def hf_twin(model, cls_name):
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        hf = getattr(transformers, cls_name).from_pretrained(tmp, attn_implementation="eager")
    return hf.eval()


def grads(model, loss):
    params = dict(model.named_parameters())
    got = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {name: g for name, g in zip(params, got) if g is not None}


def assert_grads_close(a, b, rtol=1e-4, atol=1e-7):
    """|a - b| <= rtol * |b| + atol per parameter (norms); atol covers gradients that are ~0
    by symmetry (e.g. the last LayerNorm bias under a softmax over positions)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for name in a:
        err = (a[name] - b[name]).norm().item()
        bound = rtol * b[name].norm().item() + atol
        assert err <= bound, f"gradient of {name}: error {err:.2e} > {bound:.2e}"


@pytest.mark.parametrize("mode", PADDING_MODES)
@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_bert_model_matches_transformers(config_name, mode):
    torch.manual_seed(0)
    config = make_config(config_name)
    model = bertfast.BertModel(config).eval()
    hf = hf_twin(model, "BertModel")
    ids, mask, tt = make_inputs(config, mode)
    valid = mask.bool()
    ours = model(ids, attention_mask=mask, token_type_ids=tt, output_hidden_states=True)
    theirs = hf(input_ids=ids, attention_mask=mask, token_type_ids=tt, output_hidden_states=True)
    assert torch.isfinite(ours.last_hidden_state).all() and torch.isfinite(ours.pooler_output).all()
    torch.testing.assert_close(ours.last_hidden_state[valid], theirs.last_hidden_state[valid], atol=1e-5, rtol=0)
    assert len(ours.hidden_states) == len(theirs.hidden_states) == config.num_hidden_layers + 1
    for a, b in zip(ours.hidden_states, theirs.hidden_states):
        torch.testing.assert_close(a[valid], b[valid], atol=1e-5, rtol=0)
    has_first = valid[:, 0]  # the pooler reads position 0
    torch.testing.assert_close(ours.pooler_output[has_first], theirs.pooler_output[has_first], atol=1e-5, rtol=0)
    with bertfast.reference_execution(model):
        ref = model(ids, attention_mask=mask, token_type_ids=tt)
    torch.testing.assert_close(ref.last_hidden_state[valid], theirs.last_hidden_state[valid], atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["none", "random", "one"])
def test_reference_encoder_matches_transformers_everywhere(mode):
    """bertfast.reference.encoder (reference_execution) is transformers' padded encoder: hidden
    states and attention probabilities match at every position, padded ones included."""
    torch.manual_seed(0)
    config = make_config("odd")
    model = bertfast.BertModel(config).eval()
    hf = hf_twin(model, "BertModel")
    ids, mask, tt = make_inputs(config, mode)
    with bertfast.reference_execution(model):
        ours = model(ids, attention_mask=mask, token_type_ids=tt, output_hidden_states=True, output_attentions=True)
    theirs = hf(input_ids=ids, attention_mask=mask, token_type_ids=tt, output_hidden_states=True,
                output_attentions=True)
    assert len(ours.attentions) == len(theirs.attentions) == config.num_hidden_layers
    for a, b in zip(ours.hidden_states + ours.attentions, theirs.hidden_states + theirs.attentions):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.pooler_output, theirs.pooler_output, atol=1e-5, rtol=0)


def _pretraining_labels(ids, mask, gen, fraction=0.3):
    labels = torch.where((torch.rand(ids.shape, generator=gen) < fraction) & mask.bool(), ids, -100)
    labels[0, 0] = ids[0, 0] if mask[0, 0] else -100
    return labels


@pytest.mark.parametrize("mode", ["none", "random", "empty"])
@pytest.mark.parametrize("config_name", ["tiny", "odd"])
def test_pretraining_loss_and_gradients_match_transformers(config_name, mode):
    torch.manual_seed(1)
    config = make_config(config_name)
    model = bertfast.BertForPreTraining(config).train()  # dropout 0: train mode is deterministic
    hf = hf_twin(model, "BertForPreTraining").train()
    ids, mask, tt = make_inputs(config, mode, seed=3)
    gen = torch.Generator().manual_seed(5)
    labels = _pretraining_labels(ids, mask, gen)
    nsp = torch.randint(0, 2, (ids.shape[0],), generator=gen)
    ours = model(ids, mask, tt, labels=labels, next_sentence_label=nsp)
    theirs = hf(input_ids=ids, attention_mask=mask, token_type_ids=tt, labels=labels, next_sentence_label=nsp)
    assert ours.prediction_logits is None  # the MLM head ran at labelled positions only
    if mode == "empty":
        # transformers attends uniformly over the pads of a fully padded sequence; bertfast
        # defines its output as 0. Compare what is defined: the MLM loss (no labels there)
        # and the NSP logits of the other sequences.
        hf_logits = hf(input_ids=ids, attention_mask=mask, token_type_ids=tt).prediction_logits
        hf_mlm = torch.nn.functional.cross_entropy(hf_logits.flatten(0, 1), labels.flatten())
        torch.testing.assert_close(ours.mlm_loss, hf_mlm, atol=1e-5, rtol=0)
        torch.testing.assert_close(ours.seq_relationship_logits[1:], theirs.seq_relationship_logits[1:],
                                   atol=1e-5, rtol=0)
        assert torch.isfinite(ours.loss)
        return
    torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.seq_relationship_logits, theirs.seq_relationship_logits, atol=1e-5, rtol=0)
    assert_grads_close(grads(model, ours.loss), grads(hf, theirs.loss))
    # The tied decoder/word-embedding weight is one parameter, so its gradient sums both uses.
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    with bertfast.reference_execution(model):
        ref = model(ids, mask, tt, labels=labels, next_sentence_label=nsp)
    torch.testing.assert_close(ref.loss, theirs.loss, atol=1e-5, rtol=0)
    assert int(ours.mlm_num_predictions) == int((labels != -100).sum())
    assert int(ours.mlm_num_correct) == int(ref.mlm_num_correct)


def test_pretraining_without_labels_returns_full_logits():
    config = make_config("tiny")
    model = bertfast.BertForPreTraining(config).eval()
    hf = hf_twin(model, "BertForPreTraining")
    ids, mask, tt = make_inputs(config, "random")
    ours = model(ids, mask, tt)
    theirs = hf(input_ids=ids, attention_mask=mask, token_type_ids=tt)
    valid = mask.bool()
    torch.testing.assert_close(ours.prediction_logits[valid], theirs.prediction_logits[valid], atol=1e-5, rtol=0)
    assert ours.loss is None  # transformers gives a loss only when both label kinds are given


@pytest.mark.parametrize("config_name", ["tiny", "odd"])
def test_masked_lm_matches_transformers(config_name):
    config = make_config(config_name)
    model = bertfast.BertForMaskedLM(config)
    hf = hf_twin(model, "BertForMaskedLM").train()
    ids, mask, tt = make_inputs(config, "random", seed=7)
    labels = _pretraining_labels(ids, mask, torch.Generator().manual_seed(2))
    ours = model(ids, mask, tt, labels=labels)
    theirs = hf(input_ids=ids, attention_mask=mask, token_type_ids=tt, labels=labels)
    torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-5, rtol=0)
    assert_grads_close(grads(model, ours.loss), grads(hf, theirs.loss))


@pytest.mark.parametrize("problem", ["single_label_classification", "regression", "multi_label_classification"])
def test_sequence_classification_matches_transformers(problem):
    num_labels = 1 if problem == "regression" else 3
    config = make_config("tiny", num_labels=num_labels)
    model = bertfast.BertForSequenceClassification(config)
    hf = hf_twin(model, "BertForSequenceClassification").train()
    ids, mask, tt = make_inputs(config, "random")
    gen = torch.Generator().manual_seed(0)
    if problem == "single_label_classification":
        labels = torch.randint(0, num_labels, (ids.shape[0],), generator=gen)
    elif problem == "regression":
        labels = torch.randn(ids.shape[0], generator=gen)
    else:
        labels = (torch.rand(ids.shape[0], num_labels, generator=gen) > 0.5).float()
    ours = model(ids, mask, tt, labels=labels)
    theirs = hf(input_ids=ids, attention_mask=mask, token_type_ids=tt, labels=labels)
    assert model.config.problem_type == hf.config.problem_type == problem
    torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-5, rtol=0)
    assert_grads_close(grads(model, ours.loss), grads(hf, theirs.loss))


def test_token_classification_matches_transformers():
    config = make_config("tiny", num_labels=5)
    model = bertfast.BertForTokenClassification(config)
    hf = hf_twin(model, "BertForTokenClassification").train()
    ids, mask, tt = make_inputs(config, "random")
    labels = torch.randint(0, 5, ids.shape)
    labels[mask == 0] = -100
    ours = model(ids, mask, tt, labels=labels)
    theirs = hf(input_ids=ids, attention_mask=mask, token_type_ids=tt, labels=labels)
    valid = mask.bool()
    torch.testing.assert_close(ours.logits[valid], theirs.logits[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-5, rtol=0)
    assert_grads_close(grads(model, ours.loss), grads(hf, theirs.loss))


def test_question_answering_matches_transformers_with_clamping():
    config = make_config("tiny", num_labels=2)
    model = bertfast.BertForQuestionAnswering(config)
    hf = hf_twin(model, "BertForQuestionAnswering").train()
    ids, mask, tt = make_inputs(config, "none")
    seqlen = ids.shape[1]
    start = torch.tensor([0, 3, seqlen + 5, 2])  # one position past the end: clamped and ignored
    end = torch.tensor([1, 4, seqlen + 9, -1])  # -1 clamps to 0
    ours = model(ids, mask, tt, start_positions=start, end_positions=end)
    theirs = hf(input_ids=ids, attention_mask=mask, token_type_ids=tt, start_positions=start, end_positions=end)
    torch.testing.assert_close(ours.start_logits, theirs.start_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.end_logits, theirs.end_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-5, rtol=0)
    assert_grads_close(grads(model, ours.loss), grads(hf, theirs.loss))


def test_multiple_choice_matches_transformers():
    config = make_config("tiny")
    model = bertfast.BertForMultipleChoice(config)
    hf = hf_twin(model, "BertForMultipleChoice").train()
    ids, mask, tt = make_inputs(config, "random", batch=6)
    ids, mask, tt = (t.view(2, 3, -1) for t in (ids, mask, tt))
    labels = torch.tensor([2, 0])
    ours = model(ids, mask, tt, labels=labels)
    theirs = hf(input_ids=ids, attention_mask=mask, token_type_ids=tt, labels=labels)
    assert ours.logits.shape == (2, 3)
    torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-5, rtol=0)
    assert_grads_close(grads(model, ours.loss), grads(hf, theirs.loss))


def test_return_dict_false_gives_transformers_tuples():
    config = make_config("tiny", num_labels=3)
    model = bertfast.BertForSequenceClassification(config).eval()
    hf = hf_twin(model, "BertForSequenceClassification")
    ids, mask, tt = make_inputs(config, "none")
    labels = torch.tensor([0, 1, 2, 0])
    ours = model(ids, mask, tt, labels=labels, return_dict=False)
    theirs = hf(input_ids=ids, attention_mask=mask, token_type_ids=tt, labels=labels, return_dict=False)
    assert isinstance(ours, tuple) and len(ours) == len(theirs) == 2
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    out = model(ids, mask, tt)
    assert out[0] is out.logits and out["logits"] is out.logits


def test_state_dict_round_trip_hf_bertfast_hf():
    config = make_config("odd")
    torch.manual_seed(3)
    hf_config = transformers.BertConfig(**{k: v for k, v in config.to_dict().items() if k != "extra"})
    hf = transformers.BertForPreTraining(hf_config).eval()
    ids, mask, tt = make_inputs(config, "random")
    expected = hf(input_ids=ids, attention_mask=mask, token_type_ids=tt).prediction_logits
    with tempfile.TemporaryDirectory() as first, tempfile.TemporaryDirectory() as second:
        hf.save_pretrained(first)
        ours = bertfast.BertForPreTraining.from_pretrained(first).eval()
        ours.save_pretrained(second)
        again = transformers.BertForPreTraining.from_pretrained(second).eval()
    valid = mask.bool()
    for model in (ours, again):
        got = model(input_ids=ids, attention_mask=mask, token_type_ids=tt).prediction_logits
        torch.testing.assert_close(got[valid], expected[valid], atol=1e-5, rtol=0)
    assert ours.cls.predictions.decoder.weight is ours.bert.embeddings.word_embeddings.weight


def test_fully_padded_sequence_changes_nothing_else():
    config = make_config("tiny")
    model = bertfast.BertModel(config).eval()
    ids, mask, tt = make_inputs(config, "random", batch=3)
    alone = model(ids[1:], mask[1:], tt[1:]).last_hidden_state
    mask = mask.clone()
    mask[0] = 0
    out = model(ids, mask, tt)
    assert torch.isfinite(out.last_hidden_state).all() and torch.isfinite(out.pooler_output).all()
    valid = mask[1:].bool()
    torch.testing.assert_close(out.last_hidden_state[1:][valid], alone[valid], atol=1e-6, rtol=0)
    with bertfast.reference_execution(model):
        ref = model(ids, mask, tt)
    assert torch.isfinite(ref.last_hidden_state).all()
