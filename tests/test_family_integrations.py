"""RoBERTa, XLM-R, CamemBERT, ELECTRA and DistilBERT inside what Hugging Face users run: pipelines,
Trainer, PEFT LoRA, sentence-transformers and torch.compile, each family against transformers' own
class on a small random checkpoint (nothing is downloaded): the RoBERTa family with a byte-level BPE
tokenizer trained here, ELECTRA and DistilBERT with bertfast's demo WordPiece vocabulary."""
import json

import pytest
import torch
from family_helpers import (assert_compiles_like_eager, assert_lora_matches, assert_pipeline_matches,
                            assert_sentence_embeddings_match, demo_wordpiece, trainer_losses)

import bertfast

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

ROBERTA = ("Roberta", "XLMRoberta", "Camembert")
FAMILIES = ROBERTA + ("Electra", "DistilBert")
BPE_TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.", "Short one."]
WORDPIECE_TEXTS = ["Return the value of the module.", "The function is called with a list.", "Short one."]
SIZES = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, hidden_size=32, num_hidden_layers=2,
             num_attention_heads=4, intermediate_size=64)


def _bpe(path):
    """RoBERTa's tokenizer (<s>=0, <pad>=1, </s>=2, <mask>=4) over a 400-token BPE trained on the texts."""
    bpe = tokenizers.ByteLevelBPETokenizer()
    corpus = BPE_TEXTS * 10 + ["Tokens for a small vocabulary: capital, country, animals, geography, length."] * 5
    bpe.train_from_iterator(corpus, vocab_size=400, min_frequency=1,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    bpe.save_model(str(path))
    vocab = json.loads((path / "vocab.json").read_text())
    merges = [tuple(line.split()) for line in (path / "merges.txt").read_text().splitlines()[1:] if line.strip()]
    return transformers.RobertaTokenizer(vocab=vocab, merges=merges)


@pytest.fixture(scope="module")
def tokenizers_by_family(tmp_path_factory):
    bpe = _bpe(tmp_path_factory.mktemp("bpe"))
    return {**{family: bpe for family in ROBERTA}, "Electra": demo_wordpiece(transformers.BertTokenizer),
            "DistilBert": demo_wordpiece(transformers.DistilBertTokenizer)}


def texts(family, masked=False):
    """Three texts in the family's tokenizer's vocabulary; ``masked``: the first with a mask token."""
    if family in ROBERTA:
        return [BPE_TEXTS[0].replace("fox", "<mask>")] if masked else BPE_TEXTS
    return [WORDPIECE_TEXTS[0].replace("value", "[MASK]")] if masked else WORDPIECE_TEXTS


def config(family, **extra):
    if family == "DistilBert":
        values = dict(vocab_size=4096, dim=32, n_layers=2, n_heads=4, hidden_dim=64, dropout=0.0,
                      attention_dropout=0.0, seq_classif_dropout=0.0, qa_dropout=0.0)
        values.update({"n_layers": extra.pop("num_hidden_layers")} if "num_hidden_layers" in extra else {})
    elif family == "Electra":
        values = dict(SIZES, vocab_size=4096, embedding_size=16, summary_last_dropout=0.0)
    else:
        values = dict(SIZES, vocab_size=400, max_position_embeddings=66, type_vocab_size=1, pad_token_id=1,
                      bos_token_id=0, eos_token_id=2)
    values.update(extra)
    return getattr(transformers, f"{family}Config")(**values)


def lora_targets(family):
    return ["q_lin", "v_lin"] if family == "DistilBert" else ["query", "value"]


@pytest.fixture
def checkpoint(tokenizers_by_family, tmp_path):
    def make(family, head, **extra):
        """transformers' model of this family and head, seeded random, saved with the tokenizer."""
        torch.manual_seed(0)
        model = getattr(transformers, family + head)(config(family, **extra))
        path = tmp_path / (family + head)
        model.save_pretrained(path)
        tokenizers_by_family[family].save_pretrained(path)
        return str(path)
    return make


@pytest.mark.parametrize("task, head, extra", [
    ("feature-extraction", "Model", {}),
    ("fill-mask", "ForMaskedLM", {}),
    ("text-classification", "ForSequenceClassification", {"num_labels": 3}),
    ("token-classification", "ForTokenClassification", {"num_labels": 4}),
])
@pytest.mark.parametrize("family", FAMILIES)
def test_pipelines_match_transformers(family, task, head, extra, checkpoint):
    assert_pipeline_matches(task, checkpoint(family, head, **extra), texts(family, task == "fill-mask"),
                            getattr(bertfast, family + head))


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_trains_evaluates_saves_and_reloads(family, checkpoint, tokenizers_by_family, tmp_path):
    pytest.importorskip("accelerate")
    cls_name, tokenizer = family + "ForSequenceClassification", tokenizers_by_family[family]
    path = checkpoint(family, "ForSequenceClassification")  # the same weights in both
    ours, our_eval, trainer, batch = trainer_losses(getattr(bertfast, cls_name).from_pretrained(path), tokenizer,
                                                    texts(family), tmp_path / "ours", accumulation=2)
    theirs, their_eval, _, _ = trainer_losses(getattr(transformers, cls_name).from_pretrained(path), tokenizer,
                                              texts(family), tmp_path / "theirs", accumulation=2)
    assert len(ours) == len(theirs) > 2
    # bertfast's loss is a mean Trainer averages over the 2 accumulation steps; transformers' classes, like
    # its BERT, report their sum (they claim num_items_in_batch and ignore it).
    assert ours[0] == pytest.approx(theirs[0] / 2, rel=1e-3)
    assert abs(our_eval["eval_loss"] - their_eval["eval_loss"]) < 0.05
    trainer.save_model(str(tmp_path / "saved"))
    again = getattr(transformers, cls_name).from_pretrained(tmp_path / "saved").eval()  # transformers reads it
    batch.pop("labels")
    with torch.no_grad():
        torch.testing.assert_close(again(**batch).logits, trainer.model.eval()(**batch).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_lora_trains_exactly_as_on_transformers(family, checkpoint, tokenizers_by_family):
    pytest.importorskip("peft")
    cls_name, tokenizer = family + "ForSequenceClassification", tokenizers_by_family[family]
    path = checkpoint(family, "ForSequenceClassification")
    ours, _ = assert_lora_matches(getattr(bertfast, cls_name), getattr(transformers, cls_name), path, tokenizer,
                                  texts(family), lora_targets(family))
    plain = getattr(bertfast, cls_name).from_pretrained(path).eval()
    batch = tokenizer(texts(family), padding=True, return_tensors="pt")
    with torch.no_grad():
        assert (ours(**batch).logits - plain(**batch).logits).abs().max() > 1e-3  # LoRA is not bypassed


@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("family", FAMILIES)
def test_sentence_transformers_embeddings_match(family, pooling, checkpoint):
    pytest.importorskip("sentence_transformers")
    assert_sentence_embeddings_match(checkpoint(family, "Model"), texts(family), getattr(bertfast, family + "Model"),
                                     pooling)


@pytest.mark.parametrize("pooling", ["mean", "cls", "lasttoken"])
@pytest.mark.parametrize("family", FAMILIES)
def test_sentence_transformers_unpadded_embeddings_match(family, pooling, checkpoint):
    """bertfast.unpadded: no padding from the tokenizer to the pooling; transformers' padded embeddings."""
    pytest.importorskip("sentence_transformers", minversion="5.4")
    assert_sentence_embeddings_match(checkpoint(family, "Model"), texts(family), getattr(bertfast, family + "Model"),
                                     pooling, unpadded=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_compile_fullgraph_matches_eager(family, tokenizers_by_family):
    torch.manual_seed(0)
    model = getattr(bertfast, family + "ForMaskedLM")(config(family, num_hidden_layers=1))
    batch = tokenizers_by_family[family](texts(family), padding=True, return_tensors="pt")
    labels = torch.where((torch.rand(batch["input_ids"].shape) < 0.4) & batch["attention_mask"].bool(),
                         batch["input_ids"], -100)
    assert_compiles_like_eager(model, batch, labels)
