"""RoBERTa, XLM-R and CamemBERT through the fused encoder against transformers' own classes, fp32 on
CPU: every class of each family, outputs at real tokens within 1e-5, losses within 1e-5, each
parameter's gradient within 1e-4 of its norm; RoBERTa's positions (left padding, packed
sequences, inputs_embeds, given position_ids); the Auto classes; the Triton kernels.
"""
import pytest
import torch
from family_helpers import (SIDES, assert_class_matches, assert_loss_and_grads_match, choices, first_real_hidden, grads,
                            labels_for, twin)
from family_helpers import make_inputs as _make_inputs

import bertfast
from bertfast.padding import pack_batch

transformers = pytest.importorskip("transformers")

FAMILIES = ("Roberta", "XLMRoberta", "Camembert")
HEADS = ("Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
         "ForMultipleChoice")
PAD = 1  # RoBERTa's padding id: positions count from 2


def make_config(family="Roberta", **extra):
    values = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=40, type_vocab_size=1, pad_token_id=PAD, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, num_labels=2)
    values.update(extra)
    return getattr(transformers, f"{family}Config")(**values)


def make_inputs(side="right", **kw):
    return _make_inputs(PAD, 99, side, **kw)


def build(family, head, seed=0, **extra):
    torch.manual_seed(seed)
    return getattr(bertfast, family + head)(make_config(family, **extra))


def first_token_expected(head, hf, ids, mask):
    """transformers' head applied at each sequence's first real token (where bertfast applies it;
    transformers reads position 0, under left padding a pad token)."""
    first = first_real_hidden(hf.roberta, ids, mask)
    if head == "ForSequenceClassification":
        return hf.classifier(first[:, None])
    return hf.classifier(hf.roberta.pooler.activation(hf.roberta.pooler.dense(first))).view(ids.shape[0], -1)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_class_matches_transformers(family, head, side):
    model = build(family, head).eval()
    hf = twin(model, family + head)
    ids, mask = make_inputs(side, choices=choices(head))
    assert_class_matches(model, hf, head, side, ids, mask, lambda: first_token_expected(head, hf, ids, mask))


@pytest.mark.parametrize("head", [h for h in HEADS if h != "Model"])
@pytest.mark.parametrize("family", FAMILIES)
def test_losses_and_gradients_match_transformers(family, head):
    model = build(family, head, seed=2).train()  # dropout 0: train mode is deterministic
    hf = twin(model, family + head).train()
    ids, mask = make_inputs("right", seed=3, choices=choices(head))
    assert_loss_and_grads_match(model, hf, head, ids, mask)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_checkpoints_load_with_every_key_and_the_tied_head(family, tmp_path):
    torch.manual_seed(0)
    hf = getattr(transformers, f"{family}ForMaskedLM")(make_config(family))
    hf.save_pretrained(tmp_path)
    model, info = getattr(bertfast, f"{family}ForMaskedLM").from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    assert isinstance(model, getattr(transformers, f"{family}PreTrainedModel"))
    assert model.lm_head.decoder.weight is model.roberta.embeddings.word_embeddings.weight
    ours = {k: v for k, v in model.state_dict().items()}
    for key, value in hf.state_dict().items():
        torch.testing.assert_close(ours[key], value, atol=0, rtol=0)
    base = getattr(bertfast, f"{family}Model").from_pretrained(tmp_path)  # the encoder of a head checkpoint
    torch.testing.assert_close(base.embeddings.word_embeddings.weight, hf.roberta.embeddings.word_embeddings.weight)


def test_reference_execution_matches_transformers_at_every_position():
    model = build("Roberta", "ForMaskedLM").eval()
    hf = twin(model, "RobertaForMaskedLM")
    ids, mask = make_inputs("mixed")
    with bertfast.reference_execution(model):
        ours = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    theirs = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-5, rtol=0)
    for a, b in zip(ours.hidden_states, theirs.hidden_states):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_packed_sequences_count_their_own_positions_from_padding_idx():
    """Each packed sequence numbers its tokens from padding_idx + 1, as the padded batch does:
    transformers' RoBERTa would count across the whole packed row."""
    model = build("Roberta", "ForMaskedLM").eval()
    ids, mask = make_inputs("right", seed=4)
    batch = {"input_ids": ids, "attention_mask": mask, **labels_for("ForMaskedLM", ids, mask)}
    padded = model(**batch, output_hidden_states=True)
    packed = model(**pack_batch(batch, tokens=48, max_seqlen=10, position_ids=False), output_hidden_states=True)
    used = int(mask.sum())
    torch.testing.assert_close(packed.hidden_states[-1][0, :used], padded.hidden_states[-1][mask.bool()],
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(packed.loss, padded.loss, atol=1e-6, rtol=1e-6)


def test_position_ids_counted_from_zero_are_refused_with_the_fix():
    model = build("Roberta", "Model").eval()
    ids, mask = make_inputs("right", seed=4)
    with pytest.raises(ValueError, match=r"padding_idx \+ 1 = 2 .*pack_batch\(\.\.\., position_ids=False\)"):
        model(**pack_batch({"input_ids": ids, "attention_mask": mask}, tokens=48, max_seqlen=10))
    with pytest.raises(ValueError, match=r"padding_idx \+ 1 = 2"):
        model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(ids.shape[1])[None])
    # transformers' own numbering, given explicitly, is the default
    given = transformers.models.roberta.modeling_roberta.RobertaEmbeddings.create_position_ids_from_input_ids(ids, PAD)
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask, position_ids=given).last_hidden_state,
                               model(input_ids=ids, attention_mask=mask).last_hidden_state, atol=0, rtol=0)


def test_inputs_embeds_under_left_padding_number_positions_from_the_mask():
    """With inputs_embeds transformers numbers every position, pads included (a left-padded text then
    reads shifted positions); bertfast numbers the mask's tokens, as input_ids give."""
    model = build("Roberta", "Model").eval()
    ids, mask = make_inputs("left", seed=5)
    embeds = model.embeddings.word_embeddings(ids)
    real = mask.bool()
    torch.testing.assert_close(model(inputs_embeds=embeds, attention_mask=mask).last_hidden_state[real],
                               model(input_ids=ids, attention_mask=mask).last_hidden_state[real], atol=1e-6, rtol=0)


def test_family_configs_and_lengths_are_checked():
    with pytest.raises(ValueError, match="expected a transformers RobertaConfig or XLMRobertaConfig or "
                                         "CamembertConfig, got transformers.*BertConfig"):
        bertfast.RobertaModel(transformers.BertConfig(vocab_size=99, hidden_size=32, num_attention_heads=4))
    with pytest.raises(ValueError, match="expected a transformers BertConfig, got .*RobertaConfig"):
        bertfast.BertModel(make_config())
    with pytest.raises(ValueError, match="RobertaConfig.pad_token_id must be an int"):
        bertfast.RobertaModel(make_config(pad_token_id=None))
    model = bertfast.XLMRobertaModel(make_config("Roberta"))  # the family's configs are interchangeable
    ids = torch.full((1, 39), 5)
    with pytest.raises(ValueError, match="sequence length 39 exceeds max_position_embeddings 40 less the first "
                                         r"token's position, padding_idx \+ 1 = 2: 38 tokens"):
        model(input_ids=ids)
    assert model(input_ids=ids[:, :38]).last_hidden_state.shape == (1, 38, 32)


def test_register_auto_builds_each_family_and_unregister_restores():
    configs = {family: make_config(family) for family in FAMILIES}
    bertfast.register_auto()
    try:
        for family, config in configs.items():
            for auto, head in (("AutoModel", "Model"), ("AutoModelForMaskedLM", "ForMaskedLM"),
                               ("AutoModelForMultipleChoice", "ForMultipleChoice")):
                assert type(getattr(transformers, auto).from_config(config)) is getattr(bertfast, family + head)
    finally:
        bertfast.unregister_auto()
    built = transformers.AutoModelForMaskedLM.from_config(configs["XLMRoberta"])
    assert type(built) is transformers.XLMRobertaForMaskedLM


@pytest.mark.gpu_capable
def test_triton_kernels_match_the_reference():
    """Every op on the Triton backend (the interpreter on a CPU): loss, logits and gradients against
    the reference encoder and head."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build("XLMRoberta", "ForMaskedLM").to(device).train()
    ids, mask = make_inputs("mixed", batch=3, seqlen=12, seed=6)
    batch = {"input_ids": ids.to(device), "attention_mask": mask.to(device),
             **{k: v.to(device) for k, v in labels_for("ForMaskedLM", ids, mask).items()}}
    params = [p for p in model.parameters()]
    with bertfast.use_backend("triton"):
        fast = model(**batch, return_logits=True)
        fast_grads = torch.autograd.grad(fast.loss, params, allow_unused=True)
    with bertfast.reference_execution(model):
        ref = model(**batch, return_logits=True)
        ref_grads = torch.autograd.grad(ref.loss, params, allow_unused=True)
    torch.testing.assert_close(fast.loss, ref.loss, atol=1e-5, rtol=1e-5)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(fast.logits[real], ref.logits[real], atol=1e-4, rtol=0)
    for (name, _), a, b in zip(model.named_parameters(), fast_grads, ref_grads):
        if b is not None:
            assert (a - b).norm() <= 1e-4 * b.norm() + 1e-6, name


def test_gradient_checkpointing_and_resize_keep_the_results():
    model = build("Camembert", "ForMaskedLM", seed=7).train()
    ids, mask = make_inputs("mixed", seed=8)
    labels = labels_for("ForMaskedLM", ids, mask)
    plain = grads(model, model(input_ids=ids, attention_mask=mask, **labels).loss)
    model.gradient_checkpointing_enable()
    checkpointed = grads(model, model(input_ids=ids, attention_mask=mask, **labels).loss)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5)
    model.resize_token_embeddings(120)
    assert model.lm_head.decoder.weight is model.roberta.embeddings.word_embeddings.weight
    assert model.lm_head.decoder.weight.shape[0] == model.lm_head.bias.shape[0] == 120
    assert model(input_ids=ids, attention_mask=mask).logits.shape == (*ids.shape, 120)
