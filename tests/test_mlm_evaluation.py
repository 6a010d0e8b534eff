"""MLM evaluation as transformers users run it: Trainer.evaluate with run_mlm.py's metrics, and
(loss, logits) tuples. Training keeps the masked-position-only head (logits None)."""
import tempfile

import pytest
import torch

import bertfast

transformers = pytest.importorskip("transformers")


def _config():
    return bertfast.BertConfig.preset("tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _batch(config, batch=4, seqlen=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, seqlen + 1, (batch,), generator=gen)
    mask = (torch.arange(seqlen)[None] < lengths[:, None]).long()
    ids = torch.randint(5, config.vocab_size, (batch, seqlen), generator=gen) * mask
    labels = torch.where((torch.rand(batch, seqlen, generator=gen) < 0.3) & mask.bool(), ids, -100)
    labels[:, 0] = ids[:, 0]  # at least one label per row
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _twin(model, name):
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return getattr(transformers, name).from_pretrained(tmp, attn_implementation="eager")


@pytest.mark.parametrize("name", ["BertForMaskedLM", "BertForPreTraining"])
def test_logits_with_labels_in_evaluation_and_in_tuples(name):
    torch.manual_seed(0)
    config = _config()
    model = getattr(bertfast, name)(config)
    hf = _twin(model, name).eval()
    batch = _batch(config)
    if name == "BertForPreTraining":
        batch["next_sentence_label"] = torch.tensor([0, 1, 1, 0])
    field = "logits" if name == "BertForMaskedLM" else "prediction_logits"
    real = batch["attention_mask"].bool()  # padded positions: zero rows here, encoded pads there
    with torch.no_grad():
        theirs = hf(**batch)
        model.train()
        assert getattr(model(**batch), field) is None  # training: the masked-position-only head
        assert getattr(model(**batch, return_logits=True), field).shape == getattr(theirs, field).shape
        loss, logits = model(**batch, return_dict=False)[:2]  # a tuple is unpacked as transformers' is
        torch.testing.assert_close(logits[real], getattr(theirs, field)[real], atol=1e-5, rtol=0)
        model.eval()
        out = model(**batch)
        assert getattr(model(**batch, return_logits=False), field) is None
    torch.testing.assert_close(out.loss, theirs.loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(getattr(out, field)[real], getattr(theirs, field)[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(loss, theirs.loss, atol=1e-5, rtol=0)


class _Rows(torch.utils.data.Dataset):
    def __init__(self, batch):
        self.rows = [{k: v[i] for k, v in batch.items()} for i in range(len(batch["input_ids"]))]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _preprocess_logits_for_metrics(logits, labels):
    """run_mlm.py's: the logits may come as a tuple (extra outputs); keep the argmax only."""
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(dim=-1)


def _compute_metrics(eval_preds):
    preds, labels = eval_preds
    labels, preds = labels.reshape(-1), preds.reshape(-1)
    keep = labels != -100
    return {"accuracy": float((preds[keep] == labels[keep]).mean())}


def test_trainer_evaluate_with_run_mlm_metrics_matches_transformers(tmp_path):
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    config = _config()
    model = bertfast.BertForMaskedLM(config)
    hf = _twin(model, "BertForMaskedLM")
    parts = [_batch(config, seed=s) for s in range(3)]
    data = _Rows({k: torch.cat([p[k] for p in parts]) for k in parts[0]})
    results = []
    for i, m in enumerate((model, hf)):
        args = transformers.TrainingArguments(output_dir=str(tmp_path / str(i)), per_device_eval_batch_size=4,
                                              report_to=[], use_cpu=True, disable_tqdm=True)
        trainer = transformers.Trainer(model=m, args=args, eval_dataset=data,
                                       preprocess_logits_for_metrics=_preprocess_logits_for_metrics,
                                       compute_metrics=_compute_metrics)
        results.append(trainer.evaluate())
    ours, theirs = results
    assert ours["eval_accuracy"] == pytest.approx(theirs["eval_accuracy"], abs=1e-6)
    assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], abs=1e-5)
