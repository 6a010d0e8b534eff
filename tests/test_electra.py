"""ELECTRA through the fused encoder against transformers' own classes, fp32 on CPU: every class,
with the embeddings projection (embedding_size below the hidden size) and without; outputs at real
tokens within 1e-5, losses within 1e-5, each parameter's gradient within 1e-4 of its norm; then
the Auto classes and the Triton kernels (what users run it in: tests/test_family_integrations.py)."""
import pytest
import torch
from family_helpers import (SIDES, assert_class_matches, assert_loss_and_grads_match, assert_triton_matches_reference,
                            choices, first_real_hidden, labels_for, make_inputs, twin)

import bertfast

transformers = pytest.importorskip("transformers")

HEADS = ("Model", "ForPreTraining", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification",
         "ForQuestionAnswering", "ForMultipleChoice")
VOCAB = 4096  # the demo vocabulary's


def make_config(embedding_size=16, **extra):
    values = dict(vocab_size=VOCAB, embedding_size=embedding_size, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=40, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, summary_last_dropout=0.0, num_labels=2)
    values.update(extra)
    return transformers.ElectraConfig(**values)


def build(head, seed=0, **extra):
    torch.manual_seed(seed)
    return getattr(bertfast, "Electra" + head)(make_config(**extra))


def first_token_expected(head, hf, ids, mask):
    """transformers' head at each sequence's first real token (it reads position 0)."""
    first = first_real_hidden(hf.electra, ids, mask)[:, None]
    if head == "ForSequenceClassification":
        return hf.classifier(first)
    return hf.classifier(hf.sequence_summary(first)).view(ids.shape[0], -1)


@pytest.mark.parametrize("embedding_size", [16, 32])
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("head", HEADS)
def test_every_class_matches_transformers(head, side, embedding_size):
    model = build(head, embedding_size=embedding_size).eval()
    assert hasattr(model.base_model, "embeddings_project") == (embedding_size != 32)
    hf = twin(model, "Electra" + head)
    ids, mask = make_inputs(0, VOCAB, side, choices=choices(head))
    # hidden states too: the projected embeddings first
    assert_class_matches(model, hf, head, side, ids, mask, lambda: first_token_expected(head, hf, ids, mask))


@pytest.mark.parametrize("head", [h for h in HEADS if h != "Model"])
def test_losses_and_gradients_match_transformers(head):
    model = build(head, seed=2).train()  # dropout 0: train mode is deterministic
    hf = twin(model, "Electra" + head).train()
    ids, mask = make_inputs(0, VOCAB, "right", seed=3, choices=choices(head))
    assert_loss_and_grads_match(model, hf, head, ids, mask)


def test_discriminator_loss_counts_only_the_masks_tokens_and_is_zero_without_any():
    model = build("ForPreTraining").eval()
    ids, mask = make_inputs(0, VOCAB, "left", seed=4)
    labels = labels_for("ForPreTraining", ids, mask)["labels"]
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    flipped = torch.where(mask.bool(), labels, 1 - labels)  # labels at padding change nothing
    assert model(input_ids=ids, attention_mask=mask, labels=flipped).loss == loss
    empty = model(input_ids=ids, attention_mask=torch.zeros_like(mask), labels=labels)
    assert empty.loss == 0 and torch.isfinite(empty.logits).all()


def test_checkpoints_of_transformers_load_with_every_key(tmp_path):
    torch.manual_seed(0)
    hf = transformers.ElectraForMaskedLM(make_config())
    hf.save_pretrained(tmp_path)
    model, info = bertfast.ElectraForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    assert model.generator_lm_head.weight is model.electra.embeddings.word_embeddings.weight
    ours = model.state_dict()
    for key, value in hf.state_dict().items():
        torch.testing.assert_close(ours[key], value, atol=0, rtol=0)


def test_unserved_settings_are_clear_errors():
    with pytest.raises(ValueError, match="summary_type must be 'first'.*got 'mean'"):
        bertfast.ElectraForMultipleChoice(make_config(summary_type="mean"))
    with pytest.raises(ValueError, match="ElectraModel has no pooler"):
        bertfast.ElectraModel(make_config(), add_pooling_layer=True)
    with pytest.raises(ValueError, match="expected a transformers ElectraConfig, got .*BertConfig"):
        bertfast.ElectraModel(transformers.BertConfig(hidden_size=32, num_attention_heads=4))
    model = build("Model").eval()
    with pytest.raises(ValueError, match=r"inputs_embeds: expected \[batch, seq_len, 16\]"):
        model(inputs_embeds=torch.zeros(1, 4, 32))
    ids, mask = make_inputs(0, VOCAB, "left", seed=5)
    embeds = model.embeddings.word_embeddings(ids)
    torch.testing.assert_close(model(inputs_embeds=embeds, attention_mask=mask).last_hidden_state,
                               model(input_ids=ids, attention_mask=mask).last_hidden_state, atol=1e-6, rtol=0)


def test_register_auto_builds_electra_models():
    config = make_config()
    bertfast.register_auto()
    try:
        for auto, head in (("AutoModel", "Model"), ("AutoModelForPreTraining", "ForPreTraining"),
                           ("AutoModelForMaskedLM", "ForMaskedLM"),
                           ("AutoModelForMultipleChoice", "ForMultipleChoice")):
            assert type(getattr(transformers, auto).from_config(config)) is getattr(bertfast, "Electra" + head)
    finally:
        bertfast.unregister_auto()
    assert type(transformers.AutoModelForPreTraining.from_config(config)) is transformers.ElectraForPreTraining


@pytest.mark.gpu_capable
def test_triton_kernels_match_the_reference():
    """The generator's loss and gradients with every op on Triton, through the embeddings projection,
    against the reference encoder and head."""
    assert_triton_matches_reference(build("ForMaskedLM"), *make_inputs(0, VOCAB, "mixed", batch=3, seqlen=12, seed=6))
