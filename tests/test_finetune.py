"""Fine-tuning: metrics, readers (errors name file and line), features, and every task learning
a small synthetic dataset to a set metric with the tiny preset on CPU."""
import json
import os

import numpy as np
import pytest
import torch

from bertfast import finetune
from bertfast.data import metrics as M
from bertfast.data import synthetic as S
from bertfast.data.tasks import (DataFormatError, SquadExample, qa_features, qa_predictions, read_conll, read_squad,
                                 read_table, token_classification_features)
from bertfast.data.tokenization import WordPiece


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("vocab")
    WordPiece.train(S.corpus_text(), vocab_size=300).save(str(d))
    return str(d)


@pytest.fixture(scope="module")
def tok(vocab_dir):
    return WordPiece.from_pretrained(vocab_dir)


# --------------------------------------------------------------------------- metrics
def test_classification_metrics_hand_computed():
    gold = [1, 1, 1, 0, 0, 0, 0, 1]
    pred = [1, 1, 0, 0, 0, 1, 0, 1]
    # tp=3 fp=1 fn=1 tn=3
    assert M.accuracy(pred, gold) == 0.75
    assert M.f1(pred, gold) == pytest.approx(0.75)
    assert M.matthews_corrcoef(pred, gold) == pytest.approx((3 * 3 - 1 * 1) / np.sqrt(4 * 4 * 4 * 4))
    assert M.matthews_corrcoef([1] * 8, gold) == 0.0                      # undefined -> 0
    # Macro F1 over three classes: per class F1 = 1, 0.5, 0.
    assert M.f1([0, 1, 2, 2], [0, 1, 1, 2], num_classes=3) == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)
    assert M.matthews_corrcoef([0, 1, 2], [0, 1, 2]) == pytest.approx(1.0)


def test_correlations_and_ranks():
    x = [1.0, 2.0, 3.0, 4.0]
    assert M.pearson(x, [2.0, 4.0, 6.0, 8.0]) == pytest.approx(1.0)
    assert M.pearson(x, [8.0, 6.0, 4.0, 2.0]) == pytest.approx(-1.0)
    assert M.rankdata([10, 20, 20, 30]).tolist() == [1.0, 2.5, 2.5, 4.0]
    assert M.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / np.sqrt(4.5 * 5))
    assert M.spearman(x, [1.0, 10.0, 100.0, 1000.0]) == pytest.approx(1.0)   # monotone, not linear


def test_entity_f1_exact_chunks():
    gold = [["B-PER", "I-PER", "O", "B-LOC", "O"], ["B-ORG", "O"]]
    pred = [["B-PER", "I-PER", "O", "B-LOC", "I-LOC"], ["B-ORG", "O"]]   # LOC span too long: wrong
    r = M.entity_f1(pred, gold)
    assert r["precision"] == pytest.approx(2 / 3) and r["recall"] == pytest.approx(2 / 3)
    assert M.get_entities(["I-PER", "I-PER", "B-PER", "O", "I-LOC"]) == [("PER", 0, 1), ("PER", 2, 2), ("LOC", 4, 4)]
    assert M.entity_f1(gold, gold)["f1"] == 1.0


def test_squad_em_f1():
    assert M.normalize_answer("The  Big, red Dog!") == "big red dog"
    golds = {"a": ["the red dog"], "b": ["blue cat", "a blue cat"], "c": [""]}
    r = M.squad_em_f1({"a": "red dog.", "b": "blue", "c": ""}, golds)
    assert r["exact_match"] == pytest.approx(100 * 2 / 3)
    assert r["f1"] == pytest.approx(100 * (1 + 2 / 3 + 1) / 3)
    assert r["NoAns_exact"] == 100.0 and r["HasAns_exact"] == 50.0


# --------------------------------------------------------------------------- features
def test_token_features_label_first_piece(tok):
    words = ["alice", "saw", "initech", "umbrella"] * 3
    feats = token_classification_features(tok, words, list(range(12)), max_seq_len=64)
    labels = feats["labels"]
    assert labels[0] == -100 and labels[-1] == -100
    starts = feats["_word_starts"]
    assert [labels[s] for s in starts] == list(range(12))
    assert sum(l != -100 for l in labels) == 12                   # only first pieces carry labels
    short = token_classification_features(tok, words, list(range(12)), max_seq_len=8)
    assert len(short["input_ids"]) <= 8 and len(short["_word_starts"]) < 12


def test_qa_doc_stride_windows_map_back_to_the_answer(tok):
    context = " ".join(["near far water city house"] * 12) + " the color is red . " + " ".join(["book story"] * 10)
    start = context.index("red")
    ex = SquadExample("q", "what is the color ?", context, [("red", start)], False)
    feats = qa_features(tok, [ex], max_seq_len=32, doc_stride=8, max_query_length=16)
    assert len(feats) > 3
    hits = [f for f in feats if f.start_position > 0]
    assert hits and all(f.start_position == f.end_position for f in hits)
    for f in hits:
        s, e = f.offsets[f.start_position][0], f.offsets[f.end_position][1]
        assert context[s:e] == "red"
    for f in feats:
        assert len(f.input_ids) <= 32 and f.input_ids[0] == tok.cls_id
    # Consecutive windows start doc_stride tokens apart: the first context position's offsets step.
    firsts = [next(o for o in f.offsets if o is not None)[0] for f in feats]
    assert firsts == sorted(firsts) and len(set(firsts)) == len(firsts)
    # Decoding: logits peaked on the answer in one window.
    sl = np.full((len(feats), 32), -5.0)
    el = np.full((len(feats), 32), -5.0)
    sl[:, 0] = el[:, 0] = 0.0
    f0 = feats.index(hits[0])
    sl[f0, hits[0].start_position] = el[f0, hits[0].end_position] = 4.0
    preds, diffs = qa_predictions([ex], feats, sl, el)
    assert preds == {"q": "red"} and diffs["q"] == pytest.approx(-8.0)
    preds2, _ = qa_predictions([ex], feats, sl, el, version_2=True, null_threshold=-9.0)
    assert preds2 == {"q": ""}                                      # null wins under a low threshold


# --------------------------------------------------------------------------- malformed input
def test_readers_name_file_and_line(tmp_path):
    bad_csv = tmp_path / "bad.csv"
    bad_csv.write_text("sentence,label\nhello there,1\nonly one field\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"bad\.csv:3: expected 2 fields"):
        read_table(str(bad_csv))
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"sentence": "a", "label": 0}\n{"sentence": "b", label: 1}\n', encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:2: invalid JSON"):
        read_table(str(bad_jsonl))
    bad_conll = tmp_path / "bad.conll"
    bad_conll.write_text("alice B-PER\nsaw O\n\nbob\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"bad\.conll:4: expected 'token"):
        read_conll(str(bad_conll))
    bad_squad = tmp_path / "bad.json"
    bad_squad.write_text(json.dumps({"data": [{"paragraphs": [{"context": "the color is red .", "qas": [
        {"id": "x1", "question": "q?", "answers": [{"text": "blue", "answer_start": 13}]}]}]}]}), encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"bad\.json: .*x1.*not at answer_start 13"):
        read_squad(str(bad_squad))
    broken = tmp_path / "broken.json"
    broken.write_text('{"data": [\n  {"paragraphs": ]\n}', encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"broken\.json:2: invalid JSON"):
        read_squad(str(broken))


def test_cli_reports_bad_labels_with_line(tmp_path, vocab_dir, capsys):
    train = tmp_path / "train.csv"
    dev = tmp_path / "dev.csv"
    train.write_text("sentence,label\ngood day,pos\nbad day,neg\n", encoding="utf-8")
    dev.write_text("sentence,label\ngood day,pos\nfine day,maybe\n", encoding="utf-8")
    rc = finetune.main(["--task", "classification", "--train-file", str(train), "--eval-file", str(dev),
                        "--preset", "tiny", "--vocab", vocab_dir, "--no-progress", "--no-save",
                        "--output-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "dev.csv:3" in err and "'maybe'" in err
    rc = finetune.main(["--task", "regression", "--train-file", str(train), "--preset", "tiny", "--vocab",
                        vocab_dir, "--no-progress", "--no-save", "--output-dir", str(tmp_path / "o")])
    assert rc == 2 and "train.csv:2: regression label 'pos' is not a number" in capsys.readouterr().err


# --------------------------------------------------------------------------- every task learns
def _run(tmp_path, vocab_dir, *extra, epochs=5, lr=3e-3, batch_size=16, save=False):
    argv = ["--preset", "tiny", "--vocab", vocab_dir, "--lr", str(lr), "--epochs", str(epochs),
            "--batch-size", str(batch_size),
            "--no-progress", "--output-dir", str(tmp_path / "out"), "--seed", "0", *extra]
    if not save:
        argv.append("--no-save")
    return finetune.run(finetune.parse_args(argv))


def test_sequence_pair_classification_learns_and_saves(tmp_path, vocab_dir):
    S.write_classification(str(tmp_path / "train.csv"), 240, seed=0, neutral=False)
    S.write_classification(str(tmp_path / "dev.csv"), 80, seed=1, neutral=False)
    r = _run(tmp_path, vocab_dir, "--task", "classification", "--train-file", str(tmp_path / "train.csv"),
             "--eval-file", str(tmp_path / "dev.csv"), "--max-seq-len", "32", lr=1e-3, batch_size=8, save=True)
    assert r["eval"]["accuracy"] >= 0.9 and r["eval"]["f1"] >= 0.9 and r["eval"]["matthews"] >= 0.8
    assert np.mean(r["train_loss"][-10:]) < 0.8 * np.mean(r["train_loss"][:10])
    out = str(tmp_path / "out")
    saved = json.load(open(os.path.join(out, "config.json")))
    assert saved["id2label"] == {"0": "negative", "1": "positive"}
    assert os.path.isfile(os.path.join(out, "vocab.txt"))
    assert json.load(open(os.path.join(out, "eval_results.json")))["accuracy"] == r["eval"]["accuracy"]
    # The saved directory reloads (bertfast and transformers) to the same predictions.
    from bertfast import BertForSequenceClassification
    tok = WordPiece.from_pretrained(out)
    ids, types = tok.build_pair(tok.encode("it was a good day"), tok.encode("see the city"))
    batch = {"input_ids": torch.tensor([ids]), "token_type_ids": torch.tensor([types])}
    ours = BertForSequenceClassification.from_pretrained(out).eval()
    import transformers
    theirs = transformers.BertForSequenceClassification.from_pretrained(out).eval()
    with torch.no_grad():
        a, b = ours(**batch).logits, theirs(**batch).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert int(a.argmax()) == 1                                       # "positive"


def test_regression_learns(tmp_path, vocab_dir):
    S.write_regression(str(tmp_path / "train.tsv"), 320, seed=0)
    S.write_regression(str(tmp_path / "dev.tsv"), 80, seed=1)
    r = _run(tmp_path, vocab_dir, "--task", "regression", "--train-file", str(tmp_path / "train.tsv"),
             "--eval-file", str(tmp_path / "dev.tsv"), "--label-column", "score", "--max-seq-len", "32")
    assert r["eval"]["pearson"] >= 0.9 and r["eval"]["spearman"] >= 0.85


def test_token_classification_learns(tmp_path, vocab_dir):
    S.write_conll(str(tmp_path / "train.conll"), 240, seed=0)
    S.write_conll(str(tmp_path / "dev.conll"), 60, seed=1)
    r = _run(tmp_path, vocab_dir, "--task", "token-classification", "--train-file", str(tmp_path / "train.conll"),
             "--eval-file", str(tmp_path / "dev.conll"), "--max-seq-len", "32")
    assert r["eval"]["f1"] >= 0.9


@pytest.mark.parametrize("version_2", [False, True], ids=["squad1.1", "squad2.0"])
def test_question_answering_learns(tmp_path, vocab_dir, version_2):
    S.write_squad(str(tmp_path / "train.json"), 200, seed=0, version_2=version_2)
    S.write_squad(str(tmp_path / "dev.json"), 30, seed=1, version_2=version_2)
    r = _run(tmp_path, vocab_dir, "--task", "qa", "--train-file", str(tmp_path / "train.json"),
             "--eval-file", str(tmp_path / "dev.json"), "--max-seq-len", "40", "--doc-stride", "16",
             epochs=10 if version_2 else 5, lr=2e-3)
    if version_2:
        assert r["eval"]["f1"] >= 75 and r["eval"]["NoAns_exact"] >= 60 and r["eval"]["HasAns_f1"] >= 60
    else:
        assert r["eval"]["exact_match"] >= 85 and r["eval"]["f1"] >= 90


def test_multiple_choice_learns(tmp_path, vocab_dir):
    S.write_swag(str(tmp_path / "train.csv"), 200, seed=0)
    S.write_swag(str(tmp_path / "dev.csv"), 60, seed=1)
    r = _run(tmp_path, vocab_dir, "--task", "multiple-choice", "--train-file", str(tmp_path / "train.csv"),
             "--eval-file", str(tmp_path / "dev.csv"), "--max-seq-len", "24", epochs=4)
    assert r["eval"]["accuracy"] >= 0.9


def test_parity_checks_during_finetuning(tmp_path, vocab_dir):
    S.write_classification(str(tmp_path / "train.csv"), 48, seed=0)
    r = _run(tmp_path, vocab_dir, "--task", "classification", "--train-file", str(tmp_path / "train.csv"),
             "--max-seq-len", "32", "--parity-every", "2", epochs=1)
    assert len(r["parity"]) == 1 and not r["parity"][0]["diverged"]
    assert r["parity"][0]["loss_abs_diff"] < 1e-5


@pytest.mark.parametrize("task", ["classification", "regression", "token-classification", "multiple-choice"])
def test_static_shapes_train_like_padded_batches(tmp_path, vocab_dir, task):
    """Packed batches (one row of batch size x max_seq_len tokens, x choices for multiple choice)
    give the padded run's losses, step by step, with dropout off (dropout masks depend on the layout)."""
    if task == "classification":
        S.write_classification(str(tmp_path / "train.csv"), 44, seed=0)
        data = ["--train-file", str(tmp_path / "train.csv")]
    elif task == "regression":  # float targets: NaN in the dummy slots
        S.write_regression(str(tmp_path / "train.tsv"), 44, seed=0)
        data = ["--train-file", str(tmp_path / "train.tsv"), "--label-column", "score"]
    elif task == "multiple-choice":  # each example's choices in consecutive slots
        S.write_swag(str(tmp_path / "train.csv"), 44, seed=0)
        data = ["--train-file", str(tmp_path / "train.csv")]
    else:
        S.write_conll(str(tmp_path / "train.conll"), 44, seed=0)
        data = ["--train-file", str(tmp_path / "train.conll")]
    common = ["--task", task, *data, "--max-seq-len", "32", "--set", "hidden_dropout_prob=0.0",
              "--set", "attention_probs_dropout_prob=0.0"]
    padded = _run(tmp_path / "padded", vocab_dir, *common, epochs=1, batch_size=8)
    packed = _run(tmp_path / "packed", vocab_dir, *common, "--static-shapes", epochs=1, batch_size=8)
    assert len(packed["train_loss"]) == 6                               # the short last batch packs too
    np.testing.assert_allclose(packed["train_loss"], padded["train_loss"], rtol=2e-5)


def test_static_shapes_question_answering_learns(tmp_path, vocab_dir):
    """Packed QA features: each feature's span softmax runs over its own tokens (the padded batch's
    also spans its padding, so the losses differ a little); it learns as the padded run does."""
    S.write_squad(str(tmp_path / "train.json"), 200, seed=0)
    S.write_squad(str(tmp_path / "dev.json"), 30, seed=1)
    r = _run(tmp_path, vocab_dir, "--task", "qa", "--train-file", str(tmp_path / "train.json"),
             "--eval-file", str(tmp_path / "dev.json"), "--max-seq-len", "40", "--doc-stride", "16",
             "--static-shapes", epochs=5, lr=2e-3)
    assert r["eval"]["exact_match"] >= 85 and r["eval"]["f1"] >= 90


# --------------------------------------------------------------------------- configuration, checkpoints, resume
def test_recipes_flags_and_errors_name_the_option(tmp_path):
    squad = finetune.parse_args(["--recipe", "squad-v2.0", "--train-file", "t.json", "--model", "m"])
    assert (squad.task, squad.batch_size, squad.epochs, squad.lr, squad.max_seq_len, squad.version_2) == \
        ("qa", 48, 2.0, 5e-5, 384, True)
    glue = finetune.parse_args(["--recipe", "glue", "--task", "regression", "--lr", "2e-5"])   # flags win
    assert (glue.task, glue.lr, glue.batch_size, glue.epochs) == ("regression", 2e-5, 32, 3.0)
    swag = finetune.parse_args(["--recipe", "swag"])
    assert (swag.task, swag.batch_size, swag.lr) == ("multiple-choice", 16, 2e-5)
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({"recipe": "squad-v1.1", "epochs": 1}))
    from_file = finetune.parse_args(["--config", str(cfg), "--batch-size", "8"])
    assert (from_file.task, from_file.epochs, from_file.batch_size, from_file.version_2) == ("qa", 1.0, 8, False)
    for argv, message in [(["--batch-size", "0"], "the command line: --batch-size must be > 0, got 0"),
                          (["--epochs", "0"], "--epochs must be > 0, got 0.0"),
                          (["--warmup-fraction", "2"], r"--warmup-fraction must be in \[0, 1\], got 2.0"),
                          (["--max-seq-len", "2"], "--max-seq-len must be >= 4"),
                          (["--config", str(tmp_path / "bad.json")], r"bad.json: --eval-batch-size expects an "
                                                                     r"integer, got '8'")]:
        (tmp_path / "bad.json").write_text(json.dumps({"eval_batch_size": "8"}))
        with pytest.raises(ValueError, match=message):
            finetune.parse_args(argv)
    with pytest.raises(ValueError, match="--task and --train-file are required"):
        finetune.run(finetune.parse_args(["--preset", "tiny", "--vocab", "v"]))
    with pytest.raises(ValueError, match="cannot be used with --no-save"):
        finetune.run(finetune.parse_args(["--task", "qa", "--train-file", "t", "--preset", "tiny", "--vocab", "v",
                                          "--stop-at-step", "2", "--no-save"]))


@pytest.mark.parametrize("shapes", [[], ["--static-shapes"]], ids=["padded", "static-shapes"])
def test_finetune_resume_is_bit_exact(tmp_path, vocab_dir, shapes):
    """Stopped mid-epoch and resumed with nothing but --output-dir and --resume, a run (dropout on)
    takes the same steps, evaluations and weights as one that never stopped."""
    S.write_classification(str(tmp_path / "train.csv"), 40, seed=0, neutral=False)
    S.write_classification(str(tmp_path / "dev.csv"), 16, seed=1, neutral=False)

    def argv(out, *extra):
        return ["--task", "classification", "--train-file", str(tmp_path / "train.csv"), "--eval-file",
                str(tmp_path / "dev.csv"), "--preset", "tiny", "--vocab", vocab_dir, "--max-seq-len", "32",
                "--batch-size", "8", "--epochs", "2", "--lr", "1e-3", "--log-every", "2", "--no-progress",
                "--output-dir", str(tmp_path / out), *shapes, *extra]

    full = finetune.run(finetune.parse_args(argv("full")))
    assert full["steps"] == 10 and full["checkpoint"].endswith("step_00000010")
    first = finetune.run(finetune.parse_args(argv("split", "--stop-at-step", "7")))
    assert first["stopped_early"] and first["steps"] == 7
    assert not os.path.exists(tmp_path / "split" / "config.json")        # no final model from a stopped run
    from bertfast.training import checkpoints
    assert [s for s, _ in checkpoints.list_checkpoints(str(tmp_path / "split" / "checkpoints"))] == [5, 7]
    again = finetune.parse_args(["--output-dir", str(tmp_path / "split"), "--resume", "--no-progress"])
    assert again.stop_at_step is None and again.train_file == str(tmp_path / "train.csv") and again.lr == 1e-3
    assert again.static_shapes == bool(shapes)                          # packed again, from the run's settings
    second = finetune.run(again)
    assert first["train_loss"] + second["train_loss"] == full["train_loss"]   # exactly equal floats
    assert second["eval"] == full["eval"]
    assert [r for r in second["history"] if r["type"] == "eval"] == [r for r in full["history"]
                                                                    if r["type"] == "eval"]
    from safetensors.torch import load_file
    a, b = load_file(str(tmp_path / "full" / "model.safetensors")), load_file(str(tmp_path / "split" /
                                                                                   "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # A checkpoint is a fine-tuning starting point in its own right (model, vocabulary).
    assert os.path.isfile(os.path.join(second["checkpoint"], "vocab.txt"))
    steps = [r["step"] for r in json_lines(tmp_path / "split" / "metrics.jsonl") if r["type"] == "train"]
    assert steps == [2, 4, 6, 7, 8, 10]


def json_lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_a_resumed_run_drops_the_records_written_after_its_checkpoint(tmp_path):
    from bertfast.training.records import MetricsLogger
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"type": "train", "step": 2}\n{"type": "eval", "step": 4}\n{"type": "train", "step": 6}\n'
                    '{"type": "train", "st', encoding="utf-8")                # the last write cut by a kill
    logger = MetricsLogger(str(path), resumed_at=4)
    logger.close()
    assert [r["step"] for r in json_lines(path)] == [2, 4]
    assert [r["step"] for r in logger.previous] == [2, 4]                # the resumed run's history so far
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON record"):
        MetricsLogger(str(path), resumed_at=1)


def test_a_stop_signal_is_a_request_to_checkpoint_and_stop():
    import signal
    from bertfast.training.signals import StopRequest
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop = StopRequest().install()
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):                           # a second signal interrupts at once
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_a_stop_request_saves_a_checkpoint_and_stops(tmp_path, vocab_dir, monkeypatch):
    from bertfast.training.signals import StopRequest
    monkeypatch.setattr(StopRequest, "install", lambda self: setattr(self, "requested", True) or self)  # SIGTERM
    S.write_classification(str(tmp_path / "train.csv"), 32, seed=0)
    r = _run(tmp_path, vocab_dir, "--task", "classification", "--train-file", str(tmp_path / "train.csv"),
             "--max-seq-len", "32", epochs=1, batch_size=8, save=True)
    assert r["stopped_early"] and r["steps"] == 1 and r["checkpoint"].endswith("step_00000001")
    assert not os.path.exists(tmp_path / "out" / "config.json")        # no final model: the run is not done
