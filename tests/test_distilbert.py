"""DistilBERT through the fused encoder against transformers' own classes, fp32 on CPU: every class
under right, left and mixed padding (outputs at real tokens and hidden states within 1e-5), losses
and every gradient, checkpoints, errors, the Auto classes and the Triton kernels (what users run it
in: tests/test_family_integrations.py)."""
import pytest
import torch
from family_helpers import (SIDES, assert_class_matches, assert_loss_and_grads_match, assert_triton_matches_reference,
                            choices, first_real_hidden, make_inputs, twin)

import bertfast

transformers = pytest.importorskip("transformers")

HEADS = ("Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
         "ForMultipleChoice")
VOCAB = 4096  # the demo vocabulary's


def make_config(**extra):
    values = dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=40,
                  dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0, qa_dropout=0.0, num_labels=2)
    values.update(extra)
    return transformers.DistilBertConfig(**values)


def build(head, seed=0, **extra):
    torch.manual_seed(seed)
    return getattr(bertfast, "DistilBert" + head)(make_config(**extra))


def first_token_expected(head, hf, ids, mask):
    """transformers' classifier at each sequence's first real token (it reads position 0)."""
    first = first_real_hidden(hf.distilbert, ids, mask)
    logits = hf.classifier(hf.dropout(torch.relu(hf.pre_classifier(first))))
    return logits if head == "ForSequenceClassification" else logits.view(ids.shape[0], -1)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("head", HEADS)
def test_every_class_matches_transformers(head, side):
    model = build(head).eval()
    hf = twin(model, "DistilBert" + head)
    ids, mask = make_inputs(0, VOCAB, side, choices=choices(head))
    assert_class_matches(model, hf, head, side, ids, mask, lambda: first_token_expected(head, hf, ids, mask))


@pytest.mark.parametrize("head", [h for h in HEADS if h != "Model"])
def test_losses_and_gradients_match_transformers(head):
    model = build(head, seed=2).train()  # dropout 0: train mode is deterministic
    hf = twin(model, "DistilBert" + head).train()
    ids, mask = make_inputs(0, VOCAB, "right", seed=3, choices=choices(head))
    assert_loss_and_grads_match(model, hf, head, ids, mask)


def test_checkpoints_of_transformers_load_with_every_key(tmp_path):
    torch.manual_seed(0)
    hf = transformers.DistilBertForMaskedLM(make_config())
    hf.save_pretrained(tmp_path)
    model, info = bertfast.DistilBertForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    assert model.vocab_projector.weight is model.distilbert.embeddings.word_embeddings.weight
    ours = model.state_dict()
    assert set(ours) == set(hf.state_dict())
    for key, value in hf.state_dict().items():
        torch.testing.assert_close(ours[key], value, atol=0, rtol=0)


def test_sinusoidal_positions_are_initialised_as_transformers_does():
    torch.manual_seed(0)
    ours = bertfast.DistilBertModel(make_config(sinusoidal_pos_embds=True))
    theirs = transformers.DistilBertModel(make_config(sinusoidal_pos_embds=True))
    torch.testing.assert_close(ours.embeddings.position_embeddings.weight,
                               theirs.embeddings.position_embeddings.weight, atol=0, rtol=0)


def test_unserved_inputs_and_settings_are_clear_errors():
    model = build("Model").eval()
    ids, mask = make_inputs(0, VOCAB, "left", seed=5)
    with pytest.raises(ValueError, match="DistilBERT has no token types"):
        model(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids))
    with pytest.raises(ValueError, match="DistilBertModel has no pooler"):
        bertfast.DistilBertModel(make_config(), add_pooling_layer=True)
    with pytest.raises(ValueError, match="expected a transformers DistilBertConfig, got .*BertConfig"):
        bertfast.DistilBertModel(transformers.BertConfig(hidden_size=32, num_attention_heads=4))
    with pytest.raises(ValueError, match="DistilBertConfig.activation must be one of"):
        bertfast.DistilBertModel(make_config(activation="relu"))
    with pytest.raises(ValueError, match="DistilBertConfig.dim \\(30\\) must be divisible by n_heads \\(4\\)"):
        bertfast.DistilBertModel(make_config(dim=30))
    embeds = model.embeddings.word_embeddings(ids)  # transformers' positional order: inputs_embeds third
    torch.testing.assert_close(model(None, mask, embeds).last_hidden_state,
                               model(ids, mask).last_hidden_state, atol=1e-6, rtol=0)


def test_register_auto_builds_distilbert_models():
    config = make_config()
    bertfast.register_auto()
    try:
        for auto, head in (("AutoModel", "Model"), ("AutoModelForMaskedLM", "ForMaskedLM"),
                           ("AutoModelForQuestionAnswering", "ForQuestionAnswering")):
            assert type(getattr(transformers, auto).from_config(config)) is getattr(bertfast, "DistilBert" + head)
    finally:
        bertfast.unregister_auto()
    assert type(transformers.AutoModel.from_config(config)) is transformers.DistilBertModel


@pytest.mark.gpu_capable
def test_triton_kernels_match_the_reference():
    """The MLM loss and gradients with every op on Triton (the embeddings op with its zero token-type
    row included) against the reference encoder and head."""
    assert_triton_matches_reference(build("ForMaskedLM"), *make_inputs(0, VOCAB, "mixed", batch=3, seqlen=12, seed=6))


@pytest.mark.parametrize("where", ["attention", "sa_layer_norm", "ffn", "output_layer_norm"])
def test_a_hooked_part_runs_its_hook_with_transformers_results(where):
    """A forward hook on a block's part sends the block through that module (its hook runs, shifting
    its output's features here) and the results and gradients stay transformers' under the same hook."""
    model = build("ForTokenClassification", seed=4).train()
    hf = twin(model, "DistilBertForTokenClassification").train()
    ids, mask = make_inputs(0, VOCAB, "mixed", seed=7)
    labels = {"labels": torch.where(mask.bool(), ids % 2, -100)}

    shift = torch.linspace(-1.0, 1.0, 32)  # not a LayerNorm's invariance (a scale or one shift)

    def hook(module, args, output):  # transformers' attention returns (output, weights)
        return (output[0] + shift, *output[1:]) if isinstance(output, tuple) else output + shift
    for m in (model.distilbert, hf.distilbert):
        getattr(m.transformer.layer[0], where).register_forward_hook(hook)
    plain = build("ForTokenClassification", seed=4).train()(input_ids=ids, attention_mask=mask, **labels).loss
    ours = model(input_ids=ids, attention_mask=mask, **labels).loss
    assert not torch.isclose(ours, plain)  # the hook ran
    assert_loss_and_grads_match(model, hf, "ForTokenClassification", ids, mask)
