"""Left, right and mixed padding through every head that reads the pooler.

bertfast pools each sequence's first real token. With right padding (or none) that is position 0,
transformers' choice, and the outputs equal transformers'. With left padding transformers pools the
encoded pad token at position 0; bertfast's unpadded layout has none there, and pooling it once gave
every left-padded row the same vector (one logit for every text). The expectation below is built
from transformers' own hidden states: its pooler and head applied at the first real token.
"""
import tempfile

import pytest
import torch

import bertfast

transformers = pytest.importorskip("transformers")

SIDES = ("right", "left", "mixed")


def _config():
    return bertfast.BertConfig.preset("tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                      num_labels=3)


def _mask(side, batch, seqlen, gen):
    """[B, S] masks with 1..S real tokens per row: at the end of the row (left padding), at its start
    (right), or alternating per row (mixed)."""
    lengths = torch.randint(1, seqlen + 1, (batch,), generator=gen)
    lengths[0] = seqlen - 2  # a row that is padded whatever the draw
    cols = torch.arange(seqlen)[None, :]
    right = cols < lengths[:, None]
    left = cols >= (seqlen - lengths)[:, None]
    if side == "right":
        return right.long()
    if side == "left":
        return left.long()
    return torch.where((torch.arange(batch) % 2 == 0)[:, None], left, right).long()


def _inputs(config, side, batch=4, seqlen=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = _mask(side, batch, seqlen, gen)
    ids = torch.randint(5, config.vocab_size, (batch, seqlen), generator=gen) * mask  # pads are id 0
    types = torch.randint(0, 2, (batch, seqlen), generator=gen) * mask
    return ids, mask, types


def _twin(model, cls_name):
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return getattr(transformers, cls_name).from_pretrained(tmp, attn_implementation="eager").eval()


def _pooled_at_first_real(hf_bert, ids, mask, types):
    """transformers' encoder, then its pooler at each row's first real token."""
    hidden = hf_bert(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    first = mask.argmax(dim=1)
    return hf_bert.pooler.activation(hf_bert.pooler.dense(hidden[torch.arange(len(first)), first]))


HEADS = {
    "BertModel": lambda hf, pooled: pooled,
    "BertForSequenceClassification": lambda hf, pooled: hf.classifier(pooled),
    "BertForPreTraining": lambda hf, pooled: hf.cls.seq_relationship(pooled),
}


FIELD = {"BertModel": "pooler_output", "BertForPreTraining": "seq_relationship_logits"}  # else "logits"


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("name", sorted(HEADS))
def test_pooled_heads_read_the_first_real_token(name, side):
    torch.manual_seed(0)
    config = _config()
    model = getattr(bertfast, name)(config).eval()
    hf = _twin(model, name)
    ids, mask, types = _inputs(config, side)
    field = FIELD.get(name, "logits")
    with torch.no_grad():
        ours = getattr(model(input_ids=ids, attention_mask=mask, token_type_ids=types), field)
        with bertfast.reference_execution(model):
            ref = getattr(model(input_ids=ids, attention_mask=mask, token_type_ids=types), field)
        hf_bert = hf if name == "BertModel" else hf.bert
        want = HEADS[name](hf, _pooled_at_first_real(hf_bert, ids, mask, types))
        theirs = getattr(hf(input_ids=ids, attention_mask=mask, token_type_ids=types), field)
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=0)  # the reference pools the same token
    starts_real = mask[:, 0].bool()  # where position 0 is real, transformers' own output is the same
    torch.testing.assert_close(ours[starts_real], theirs[starts_real], atol=1e-5, rtol=0)
    # Never one vector for every padded row: different texts, different outputs.
    padded = ~mask.bool().all(dim=1)
    assert padded.sum() >= 2
    rows = ours[padded]
    assert not torch.allclose(rows[0], rows[1], atol=1e-4)


@pytest.mark.parametrize("side", SIDES)
def test_multiple_choice_reads_each_choices_first_real_token(side):
    torch.manual_seed(0)
    config = _config()
    model = bertfast.BertForMultipleChoice(config).eval()
    hf = _twin(model, "BertForMultipleChoice")
    ids, mask, types = _inputs(config, side, batch=6)
    shape = (2, 3, ids.shape[1])  # 2 examples of 3 choices
    with torch.no_grad():
        ours = model(input_ids=ids.view(shape), attention_mask=mask.view(shape), token_type_ids=types.view(shape))
        want = hf.classifier(_pooled_at_first_real(hf.bert, ids, mask, types)).view(2, 3)
    torch.testing.assert_close(ours.logits, want, atol=1e-5, rtol=0)


def test_left_padding_with_positions_from_the_first_token_matches_right_padding():
    """A text left-padded, with position ids counted from its first real token, is the same text
    right-padded: the same token states and the same classification."""
    torch.manual_seed(0)
    config = _config()
    model = bertfast.BertForSequenceClassification(config).eval()
    ids, right, types = _inputs(config, "right")
    lengths = right.sum(1)
    seqlen = ids.shape[1]
    shift = seqlen - lengths  # each row's pad count, moved to the front
    cols = torch.arange(seqlen)[None, :]
    source = (cols - shift[:, None]) % seqlen  # left-padded column j holds right-padded column j - shift
    left_ids, left_mask, left_types = (t.gather(1, source) for t in (ids, right, types))
    positions = (cols - shift[:, None]).clamp(min=0)
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=right, token_type_ids=types)
        b = model(input_ids=left_ids, attention_mask=left_mask, token_type_ids=left_types, position_ids=positions)
    torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=0)
