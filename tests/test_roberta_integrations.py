"""RoBERTa, XLM-R and CamemBERT inside what Hugging Face users run: pipelines, Trainer, PEFT LoRA,
sentence-transformers and torch.compile, each family against transformers' own class on a small
random checkpoint with a byte-level BPE tokenizer trained here (nothing is downloaded)."""
import json

import pytest
import torch
from family_helpers import Auto, assert_pipeline_matches, compile_fresh

import bertfast

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

FAMILIES = ("Roberta", "XLMRoberta", "Camembert")
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.", "Short one."]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """RoBERTa's tokenizer (<s>=0, <pad>=1, </s>=2, <mask>=4) over a 400-token BPE trained on the texts."""
    path = tmp_path_factory.mktemp("bpe")
    bpe = tokenizers.ByteLevelBPETokenizer()
    corpus = TEXTS * 10 + ["Tokens for a small vocabulary: capital, country, animals, geography, length."] * 5
    bpe.train_from_iterator(corpus, vocab_size=400, min_frequency=1,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    bpe.save_model(str(path))
    vocab = json.loads((path / "vocab.json").read_text())
    merges = [tuple(line.split()) for line in (path / "merges.txt").read_text().splitlines()[1:] if line.strip()]
    return transformers.RobertaTokenizer(vocab=vocab, merges=merges)


def config(family, **extra):
    values = dict(vocab_size=400, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=66, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    values.update(extra)
    return getattr(transformers, f"{family}Config")(**values)


def checkpoint(family, head, tokenizer, tmp_path, **extra):
    """transformers' model of this family and head, seeded random, saved with the tokenizer."""
    torch.manual_seed(0)
    model = getattr(transformers, family + head)(config(family, **extra))
    path = tmp_path / (family + head)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("task, head, extra", [
    ("feature-extraction", "Model", {}),
    ("fill-mask", "ForMaskedLM", {}),
    ("text-classification", "ForSequenceClassification", {"num_labels": 3}),
    ("token-classification", "ForTokenClassification", {"num_labels": 4}),
])
@pytest.mark.parametrize("family", FAMILIES)
def test_pipelines_match_transformers(family, task, head, extra, tokenizer, tmp_path):
    texts = [t.replace("fox", "<mask>").replace("capital", "<mask>") for t in TEXTS[:2]] if task == "fill-mask" \
        else TEXTS
    path = checkpoint(family, head, tokenizer, tmp_path, **extra)
    assert_pipeline_matches(task, path, texts, getattr(bertfast, family + head))


def _train(model_class, path, tokenizer, tmp_path, name):
    model = model_class.from_pretrained(path)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=4,
                                          gradient_accumulation_steps=2, num_train_epochs=2, learning_rate=1e-3,
                                          logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                                          seed=0, data_seed=0, disable_tqdm=True, remove_unused_columns=False)
    rows = [{"text": t, "label": i % 2} for i, t in enumerate(TEXTS * 4)]

    def collate(batch):
        encoded = tokenizer([r["text"] for r in batch], padding=True, return_tensors="pt")
        return {**encoded, "labels": torch.tensor([r["label"] for r in batch])}
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows,
                                   data_collator=collate)
    trainer.train()
    return trainer, trainer.evaluate(), collate(rows[:4])


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_trains_evaluates_saves_and_reloads(family, tokenizer, tmp_path):
    pytest.importorskip("accelerate")
    cls_name = family + "ForSequenceClassification"
    path = checkpoint(family, "ForSequenceClassification", tokenizer, tmp_path)  # the same weights in both
    ours, our_eval, batch = _train(getattr(bertfast, cls_name), path, tokenizer, tmp_path, "ours")
    theirs, their_eval, _ = _train(getattr(transformers, cls_name), path, tokenizer, tmp_path, "theirs")
    our_losses = [h["loss"] for h in ours.state.log_history if "loss" in h]
    their_losses = [h["loss"] for h in theirs.state.log_history if "loss" in h]
    assert len(our_losses) == len(their_losses) > 2
    # bertfast's loss is a mean Trainer averages over the 2 accumulation steps; transformers' RoBERTa,
    # like its BERT, reports their sum (it claims num_items_in_batch and ignores it).
    assert our_losses[0] == pytest.approx(their_losses[0] / 2, rel=1e-3)
    assert abs(our_eval["eval_loss"] - their_eval["eval_loss"]) < 0.05
    ours.save_model(str(tmp_path / "saved"))
    again = getattr(transformers, cls_name).from_pretrained(tmp_path / "saved").eval()  # transformers reads it
    batch.pop("labels")
    with torch.no_grad():
        torch.testing.assert_close(again(**batch).logits, ours.model.eval()(**batch).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_lora_trains_exactly_as_on_transformers(family, tokenizer, tmp_path):
    peft = pytest.importorskip("peft")
    cls_name = family + "ForSequenceClassification"
    path = checkpoint(family, "ForSequenceClassification", tokenizer, tmp_path)
    lora = dict(r=4, lora_alpha=64, target_modules=["query", "value"], init_lora_weights=False)
    models = []
    for module in (bertfast, transformers):
        torch.manual_seed(1)  # the same random LoRA weights in both
        base = getattr(module, cls_name).from_pretrained(path).eval()
        models.append(peft.get_peft_model(base, peft.LoraConfig(task_type="SEQ_CLS", **lora)))
    ours, theirs = models
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    labels = torch.tensor([0, 1, 0])
    plain = getattr(bertfast, cls_name).from_pretrained(path).eval()
    with torch.no_grad():
        assert (ours(**batch).logits - plain(**batch).logits).abs().max() > 1e-3  # LoRA is not bypassed
    ours_out, theirs_out = ours(**batch, labels=labels), theirs(**batch, labels=labels)
    torch.testing.assert_close(ours_out.logits, theirs_out.logits, atol=1e-5, rtol=0)
    ours_out.loss.backward()
    theirs_out.loss.backward()
    lora_grads = [(n, p.grad) for n, p in ours.named_parameters() if "lora_" in n]
    their_grads = dict((n, p.grad) for n, p in theirs.named_parameters() if "lora_" in n)
    assert lora_grads and len(lora_grads) == len(their_grads)
    for name, grad in lora_grads:
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, their_grads[name], atol=1e-5, rtol=1e-3, msg=name)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("family", FAMILIES)
def test_sentence_transformers_embeddings_match(family, pooling, tokenizer, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    try:
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:  # sentence-transformers before 5.2
        from sentence_transformers.models import Pooling, Transformer
    path = checkpoint(family, "Model", tokenizer, tmp_path)

    def encoder():
        word = Transformer(path)
        pool = Pooling(word.get_word_embedding_dimension(), pooling_mode=pooling)
        return st.SentenceTransformer(modules=[word, pool], device="cpu")
    theirs = encoder()
    with Auto():
        ours = encoder()
    assert any(type(m) is getattr(bertfast, family + "Model") for m in ours.modules())
    a, b = ours.encode(TEXTS, convert_to_tensor=True), theirs.encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_compile_fullgraph_matches_eager(family, tokenizer):
    torch.manual_seed(0)
    model = getattr(bertfast, family + "ForMaskedLM")(config(family, num_hidden_layers=1))
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    labels = torch.where((torch.rand(batch["input_ids"].shape) < 0.4) & batch["attention_mask"].bool(),
                         batch["input_ids"], -100)
    eager = model(**batch, labels=labels)
    eager_grads = torch.autograd.grad(eager.loss, list(model.parameters()))
    compiled = compile_fresh(model)
    out = compiled(**batch, labels=labels)
    torch.testing.assert_close(out.loss, eager.loss, atol=1e-5, rtol=0)
    got = torch.autograd.grad(out.loss, list(model.parameters()))
    torch._dynamo.reset()  # nothing of this compile left to the tests after it
    for a, b in zip(got, eager_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
