"""Bad data files get an error naming path:line (or the path) and what was expected; Hugging Face
``datasets`` JSON-lines exports are read as what they are (issue 16)."""
import json
import math
import os
import random
import re

import numpy as np
import pytest

from bertfast import finetune, pretrain
from bertfast.data import corpus as corpus_mod
from bertfast.data.loader import BatchSpec, PretrainingBatches, masking_config_for
from bertfast.data.nsp import TokenizedCorpus, instances_from_document, truncate_seq_pair
from bertfast.data.prepare import main as prepare_main
from bertfast.data.prepare import prepare_dataset
from bertfast.data.shards import PretrainingData
from bertfast.data.tasks import DataFormatError, read_conll, read_squad, read_table
from bertfast.data.tokenization import WordPiece
from bertfast.training import phases
from bertfast.training.distributed import DistInfo

QUIET = dict(progress=False, log=lambda m: None, workers=1)
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu red green blue".split()


def write_corpus(path, n_docs=30, seed=0):
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n_docs):
            for _ in range(rng.randint(3, 8)):
                f.write(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) + ".\n")
            f.write("\n")
    return str(path)


@pytest.fixture(scope="module")
def corpus_and_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-data")
    corpus = write_corpus(root / "corpus.txt")
    vocab_dir = str(root / "dynamic")
    prepare_dataset([corpus], vocab_dir, vocab_size=120, max_seq_len=64, eval_docs=3, **QUIET)
    return corpus, vocab_dir


@pytest.fixture(scope="module")
def static_data(corpus_and_vocab, tmp_path_factory):
    """Statically masked with up to 20 labels a sequence (30% masking: most have more than 5)."""
    corpus, vocab_dir = corpus_and_vocab
    out = str(tmp_path_factory.mktemp("static") / "data")
    prepare_dataset([corpus], out, vocab=vocab_dir, max_seq_len=64, static_masking=True, masked_lm_prob=0.3,
                    max_predictions_per_seq=20, eval_docs=3, **QUIET)
    return out


# =========================================================================== 1. max_predictions_per_seq
def test_static_masks_over_the_limit_are_refused_before_training(static_data):
    data = PretrainingData(static_data, "train")
    counts = np.concatenate([np.asarray(s.mlm_count) for s in data.shards])
    assert counts.max() > 5                                   # the case of the issue: labels would be dropped
    with pytest.raises(ValueError, match=rf"{re.escape(static_data)}: split 'train' shard train-00000 sequence "
                                         rf"\d+ \(example \d+\) has \d+ masked labels, more than the 5 predictions.*"
                                         rf"raise --max-predictions-per-seq to {counts.max()} or more.*re-prepare"):
        PretrainingBatches(data, BatchSpec(4, 4), static_shapes=True, max_predictions=5)
    # The limit the data was prepared with (or more) is fine: every label reaches the model.
    batches = PretrainingBatches(data, BatchSpec(4, 4), static_shapes=True, max_predictions=20)
    mb = batches.micro_batches(0)[0]
    assert int((mb["labels"] != -100).sum(1).max()) <= 20


def test_build_phases_wires_the_static_shape_limit(static_data, corpus_and_vocab, tmp_path):
    common = ["--preset", "tiny", "--phase1-steps", "2", "--global-batch-size", "4", "--micro-batch-size", "4",
              "--static-shapes", "--max-predictions-per-seq", "5", "--output-dir", str(tmp_path / "o")]
    args = pretrain.parse_args(["--data", static_data, *common])
    with pytest.raises(ValueError, match=r"has \d+ masked labels, more than the 5 predictions"):
        pretrain.build_phases(args, DistInfo(), None)
    # Dynamic masking caps the labels it draws at the same number: never over the limit.
    _, dynamic = corpus_and_vocab
    args = pretrain.parse_args(["--data", dynamic, "--masked-lm-prob", "0.5", *common])
    phase = pretrain.build_phases(args, DistInfo(), None)[0]
    # The loader's limit is per sequence; the model gathers it for each of the 4 sequences of a packed row.
    assert phase.max_predictions == 5 * 4 and phase.batches.max_predictions == 5
    assert phase.eval_batches is not None and phase.eval_batches.max_predictions == 5
    for step in range(3):
        mb = phase.batches.micro_batches(step)[0]
        labelled = (mb["labels"][0] != -100).long()
        cu = mb["cu_seq_lens_q"].long()
        per_sequence = [int(labelled[a:b].sum()) for a, b in zip(cu[:-1], cu[1:])]
        assert max(per_sequence) == 5


@pytest.mark.parametrize("prob", [0.15, 0.4])
def test_static_shape_limit_follows_the_masking_probability(corpus_and_vocab, tmp_path, capsys, prob):
    """--static-shapes without --max-predictions-per-seq gathers ceil(p x L) per sequence, so
    dynamic masking never drops a mask whatever --masked-lm-prob is; a smaller cap is said."""
    _, dynamic = corpus_and_vocab
    common = ["--data", dynamic, "--preset", "tiny", "--phase1-steps", "2", "--global-batch-size", "4",
              "--micro-batch-size", "4", "--static-shapes", "--masked-lm-prob", str(prob),
              "--output-dir", str(tmp_path / "o")]
    phase = pretrain.build_phases(pretrain.parse_args(common), DistInfo(), None)[0]
    want = math.ceil(prob * phase.data.max_seq_len)
    assert phase.batches.max_predictions == want and phase.max_predictions == want * 4
    assert "caps the masks" not in capsys.readouterr().out
    pretrain.build_phases(pretrain.parse_args([*common, "--max-predictions-per-seq", str(want - 1)]), DistInfo(),
                          None)
    assert f"caps the masks that masked-lm-prob {prob:g} draws" in capsys.readouterr().out


def test_dynamic_masks_over_the_limit_are_refused(corpus_and_vocab):
    _, dynamic = corpus_and_vocab
    data = PretrainingData(dynamic, "train")
    uncapped = masking_config_for(data, mlm_prob=0.5)
    batches = PretrainingBatches(data, BatchSpec(4, 4), masking=uncapped, max_predictions=2)
    with pytest.raises(ValueError, match=rf"{re.escape(dynamic)}: split 'train' shard train-\d+ sequence \d+ "
                                         r"\(example \d+\) has \d+ masked labels, more than the 2 predictions"):
        batches.micro_batches(0)


# =========================================================================== 2. linear truncation
def _truncate_original(tokens_a, tokens_b, max_num_tokens, rng):
    """The quadratic original, as the oracle."""
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def test_truncation_is_unchanged_and_linear():
    gen = random.Random(0)
    for case in range(300):
        a = list(range(gen.randint(0, 60)))
        b = list(range(100, 100 + gen.randint(0, 60)))
        limit = gen.randint(0, 90)
        r1, r2 = random.Random(case), random.Random(case)
        a1, b1, a2, b2 = list(a), list(b), list(a), list(b)
        truncate_seq_pair(a1, b1, limit, r1)
        _truncate_original(a2, b2, limit, r2)
        assert (a1, b1) == (a2, b2), case
        assert r1.random() == r2.random()                     # the same number of draws
    # A 200k-token line (one segment: one document, paired with a random short one) in well under a
    # second; the original took minutes on lines of this size.
    seg = 200_000
    corpus = TokenizedCorpus(np.arange(seg + 20, dtype=np.uint32), np.array([0, seg, seg + 10, seg + 20]),
                             np.array([0, 1, 3]))
    insts = instances_from_document(corpus, 0, 128, 0.0, random.Random(1))
    assert len(insts) == 1 and len(insts[0].tokens_a) + len(insts[0].tokens_b) == 125
    a = insts[0].tokens_a
    assert a == list(range(a[0], a[0] + len(a)))               # a contiguous span of the line


# =========================================================================== 3-4. table of bad files
def _tok():
    return WordPiece.from_pretrained(phases.DEMO_VOCAB)


def _task(kind, *flags):
    args = finetune.parse_args(["--task", kind, "--preset", "tiny", "--vocab", phases.DEMO_VOCAB, *flags])
    return finetune.make_task(args, _tok(), "fp32")


def _index(directory):
    with open(os.path.join(directory, "index.json"), encoding="utf-8") as f:
        return f.read()


def _write(tmp_path, name, content):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return str(path)


def _jsonl(*rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


CASES = [
    # --- 3. non-UTF-8 bytes: path:line
    ("tsv-not-utf8", "train.tsv", b"sentence\tlabel\ngood\t1\nbad \xff\xfe\t0\n", lambda p: read_table(p),
     DataFormatError, r"train\.tsv:3: expected UTF-8 text, found byte 0xff \(not UTF-8\) at column 5"),
    ("csv-not-utf8", "train.csv", b"sentence,label\n" + b"fine,1\n" * 3000 + b"caf\xe9,0\n", lambda p: read_table(p),
     DataFormatError, r"train\.csv:3002: expected UTF-8 text, found byte 0xe9"),
    ("conll-not-utf8", "train.conll", b"alice B-PER\nsaw O\n\nbob\xc3 B-PER\n", lambda p: read_conll(p),
     DataFormatError, r"train\.conll:4: expected UTF-8 text"),
    ("jsonl-not-utf8", "train.jsonl", b'{"sentence": "a", "label": 1}\n{"sentence": "\xff", "label": 0}\n',
     lambda p: read_table(p), DataFormatError, r"train\.jsonl:2: expected UTF-8 text"),
    ("squad-not-utf8", "squad.json", b'{"data": [\n{"paragraphs": "\x80"}]}', lambda p: read_squad(p),
     DataFormatError, r"squad\.json:2: expected UTF-8 text"),
    ("corpus-not-utf8", "corpus.txt", b"one two three.\n" * 2000 + b"\n" + b"bad \xff line.\n",
     lambda p: list(corpus_mod.read_documents([p])), corpus_mod.CorpusError,
     r"corpus\.txt:2002: expected UTF-8 text, found byte 0xff"),
    ("prepare-not-utf8", "corpus.txt", b"one two three.\n" * 2000 + b"\n" + b"bad \xff line.\n",
     lambda p: prepare_dataset([p], p + ".out", vocab_size=100, **QUIET), ValueError, r"corpus\.txt:2002: "),
    # --- 3. CSV quotes: the line of the record that has them
    ("csv-unclosed-quote", "train.csv", 'sentence,label\ngood,1\n"bad day,0\nfine,1\nok,0\n',
     lambda p: read_table(p), DataFormatError, r"train\.csv:3: malformed CSV: .*never closed \(unclosed quote\)"),
    ("csv-text-after-quote", "train.csv", 'sentence,label\ngood,1\n"bad" day,0\n', lambda p: read_table(p),
     DataFormatError, r"train\.csv:3: malformed CSV"),
    # --- 3. vocabularies
    ("vocab-binary", "vocab.txt", b"[PAD]\n[UNK]\n\x00\x01\x02\x03\n", lambda p: WordPiece.from_pretrained(p),
     ValueError, r"vocab\.txt:3: not a vocabulary file: expected UTF-8 text, one word piece per line, found binary"),
    ("vocab-not-utf8", "vocab.txt", b"[PAD]\n\x89PNG\r\n", lambda p: WordPiece.from_pretrained(p),
     ValueError, r"vocab\.txt:2: not a vocabulary file: expected UTF-8 text"),
    ("vocab-empty", "vocab.txt", "", lambda p: WordPiece.from_pretrained(p),
     ValueError, r"vocab\.txt: empty vocabulary: expected .*\[PAD\] \[UNK\] \[CLS\] \[SEP\] \[MASK\]"),
    ("vocab-no-specials", "vocab.txt", "a\nb\n", lambda p: WordPiece.from_pretrained(p),
     ValueError, r"vocab\.txt: the vocabulary lacks the special tokens \[PAD\] \[UNK\] \[CLS\] \[SEP\] \[MASK\]"),
    # --- 4. fine-tuning values accepted silently before
    ("json-list-as-text", "train.jsonl", _jsonl({"sentence": "good", "label": 1},
                                                {"sentence": ["bad", "day"], "label": 0}),
     lambda p: _task("classification").load(p, True), DataFormatError,
     r"train\.jsonl:2: column 'sentence': expected text \(a string\), got a JSON array"),
    ("json-mixed-label-types", "train.jsonl", _jsonl({"sentence": "a", "label": True}, {"sentence": "b", "label": 0},
                                                     {"sentence": "c", "label": 1}),
     lambda p: _task("classification").load(p, True), DataFormatError,
     r"train\.jsonl:2: label 0 is a JSON number but line 1 has a JSON boolean \(true\); expected one type"),
    ("json-list-label", "train.jsonl", _jsonl({"sentence": "a", "label": [0, 1]}),
     lambda p: _task("classification").load(p, True), DataFormatError,
     r"train\.jsonl:1: label: expected one class .*got a JSON array"),
    ("json-bool-regression", "train.jsonl", _jsonl({"sentence": "a", "label": 0.5}, {"sentence": "b", "label": True}),
     lambda p: _task("regression").load(p, True), DataFormatError,
     r"train\.jsonl:2: regression label True is not a number"),
    ("nan-regression", "train.tsv", "sentence\tlabel\na\t0.5\nb\t0.25\nc\tnan\n",
     lambda p: _task("regression").load(p, True), DataFormatError,
     r"train\.tsv:4: regression label 'nan' is not a finite float32 number"),
    ("float32-overflow-regression", "train.tsv", "sentence\tlabel\na\t0.5\nb\t-1e39\n",
     lambda p: _task("regression").load(p, True), DataFormatError,
     r"train\.tsv:3: regression label '-1e39' is not a finite float32 number \(at most 3.403e\+38 in magnitude\)"),
    ("choice-label-fraction", "swag.jsonl", _jsonl({"sent1": "a", "sent2": "b", "ending0": "c", "ending1": "d",
                                                    "ending2": "e", "ending3": "f", "label": 1.5}),
     lambda p: _task("multiple-choice").load(p, True), DataFormatError,
     r"swag\.jsonl:1: label 1\.5 is not a choice index"),
    # --- 4. Hugging Face exports that cannot be read correctly: refused, never garbage
    ("hf-conll-ids-without-names", "train.jsonl", _jsonl({"id": "0", "tokens": ["EU", "rejects"], "ner_tags": [3, 0]}),
     lambda p: read_conll(p), DataFormatError,
     r"train\.jsonl:1: 'ner_tags' holds tag ids \(3, \.\.\.\), whose names are not in the file: .*--labels"),
    ("hf-conll-id-out-of-range", "train.jsonl", _jsonl({"tokens": ["EU"], "ner_tags": [9]}),
     lambda p: read_conll(p, ["O", "B-ORG"]), DataFormatError,
     r"train\.jsonl:1: ner_tags\[0\]: tag id 9 is out of range for the 2 tag names"),
    ("hf-conll-length-mismatch", "train.jsonl", _jsonl({"tokens": ["a", "b"], "ner_tags": ["O"]}),
     lambda p: read_conll(p), DataFormatError, r"train\.jsonl:1: 'ner_tags': expected a list of 2 tags"),
    ("hf-squad-answer-misplaced", "train.jsonl",
     _jsonl({"id": "a", "context": "the sky is blue .", "question": "color?",
             "answers": {"text": ["blue"], "answer_start": [11]}},
            {"id": "b", "context": "the sky is blue .", "question": "color?",
             "answers": {"text": ["blue"], "answer_start": [3]}}),
     lambda p: read_squad(p), DataFormatError, r"train\.jsonl:2: answers\[0\] \(id b\): answer text 'blue' is not at "
                                               r"answer_start 3"),
    ("hf-squad-bad-json-line", "train.jsonl",
     _jsonl({"id": "a", "context": "c", "question": "q", "answers": {"text": [], "answer_start": []}}) + "{oops\n",
     lambda p: read_squad(p), DataFormatError, r"train\.jsonl:2: invalid JSON"),
]


@pytest.mark.parametrize("name, filename, content, read, error, message", CASES, ids=[c[0] for c in CASES])
def test_bad_files_name_path_line_and_expectation(tmp_path, name, filename, content, read, error, message):
    path = _write(tmp_path, filename, content)
    with pytest.raises(error, match=message):
        read(path)


# --- the shard index (damaged copies of a real one)
@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace('"splits": {', '"splits": {,', 1), r"index\.json:\d+: invalid JSON \(.*\); expected the index"),
    (lambda t: "[1, 2]", r"index\.json: expected a JSON object .*got a JSON list"),
    (lambda t: t.replace('"max_seq_len": 64', '"max_seq_len": "64"'), r"index\.json:\d+: 'max_seq_len': expected a "
                                                                       r"positive integer, got '64'"),
    (lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != "splits"}),
     r"index\.json: 'splits': expected an object .*, it is missing"),
])
def test_a_damaged_shard_index_is_named(corpus_and_vocab, tmp_path, edit, message):
    import shutil
    _, src = corpus_and_vocab
    copy = str(tmp_path / "copy")
    shutil.copytree(src, copy)
    text = edit(_index(src))
    with open(os.path.join(copy, "index.json"), "w", encoding="utf-8") as f:
        f.write(text)
    with pytest.raises(ValueError, match=message):
        PretrainingData(copy, "train")
    if "invalid JSON" in message:  # the line is the one of the damage
        line = int(re.search(r"index\.json:(\d+):", _raise_message(copy)).group(1))
        assert '"splits": {,' in text.splitlines()[line - 1]


def _raise_message(directory):
    try:
        PretrainingData(directory, "train")
    except ValueError as e:
        return str(e)
    raise AssertionError("no error")


# --- prepare's settings
@pytest.mark.parametrize("flags, message", [
    (["--eval-fraction", "2"], r"eval_fraction \(--eval-fraction\) must be a fraction in \[0, 1\), got 2\.0"),
    (["--eval-fraction", "-0.1"], r"eval_fraction .* got -0\.1"),
    (["--static-masking", "--max-predictions-per-seq", "0"], r"--max-predictions-per-seq\) must be >= 1, got 0"),
    (["--static-masking", "--max-predictions-per-seq", "-3"], r"--max-predictions-per-seq\) must be >= 1, got -3"),
    (["--masked-lm-prob", "1.5"], r"masked_lm_prob \(--masked-lm-prob\) must be in \(0, 1\), got 1\.5"),
    (["--num-shards", "0"], r"num_shards \(--num-shards\) must be >= 1, got 0"),
])
def test_prepare_refuses_bad_settings(corpus_and_vocab, tmp_path, capsys, flags, message):
    corpus, _ = corpus_and_vocab
    out = tmp_path / "out"
    assert prepare_main([corpus, "-o", str(out), "--vocab-size", "100", "--no-progress", *flags]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()                                   # refused before anything is written


# =========================================================================== 4. formats now read correctly
def test_classification_labels_are_stripped(tmp_path):
    path = _write(tmp_path, "train.csv", "sentence,label\ngood day,1\nbad day, 1\nfine,0 \nok,0\n")
    task = _task("classification")
    _, feats = task.load(path, True)
    assert task.labels == ["0", "1"] and [f["labels"] for f in feats] == [1, 1, 0, 0]
    spaced = _task("classification", "--labels", "neg, pos")
    assert spaced.labels == ["neg", "pos"]


@pytest.mark.parametrize("rows, pair, labels", [
    ([{"sentence": "good day", "label": 1, "idx": 0}, {"sentence": "bad day", "label": 0, "idx": 1}],  # SST-2
     ("good day", None), [1, 0]),
    ([{"sentence1": "a b", "sentence2": "c d", "label": 1, "idx": 0},                                  # MRPC
      {"sentence1": "e", "sentence2": "f", "label": 0, "idx": 1}], ("a b", "c d"), [1, 0]),
    ([{"question": "what color", "sentence": "it is red", "label": 0, "idx": 0},                      # QNLI
      {"question": "where", "sentence": "nowhere", "label": 1, "idx": 1}], ("what color", "it is red"), [0, 1]),
    ([{"premise": "p", "hypothesis": "h", "label": 2, "idx": 0},                                       # MNLI
      {"premise": "q", "hypothesis": "i", "label": 0, "idx": 1}], ("p", "h"), [1, 0]),
])
def test_hf_glue_exports_load(tmp_path, rows, pair, labels):
    path = _write(tmp_path, "train.json", _jsonl(*rows))
    task = _task("classification")
    raw, feats = task.load(path, True)
    assert raw[0][1:3] == pair and [f["labels"] for f in feats] == labels
    ids, types = feats[0]["input_ids"], feats[0]["token_type_ids"]
    assert (1 in types) == (pair[1] is not None)              # a pair is encoded as one
    assert ids.count(task.tok.sep_id) == (2 if pair[1] is not None else 1)


def test_hf_squad_export_loads(tmp_path):
    ctx = "the color of the ball is red . it is round ."
    path = _write(tmp_path, "train.jsonl", _jsonl(
        {"id": "q1", "title": "t", "context": ctx, "question": "what color is the ball ?",
         "answers": {"text": ["red", "red"], "answer_start": [25, 25]}},
        {"id": "q2", "title": "t", "context": ctx, "question": "what shape ?",
         "answers": {"text": ["round"], "answer_start": [37]}},
        {"id": "q3", "title": "t", "context": ctx, "question": "who owns it ?",
         "answers": {"text": [], "answer_start": []}}))
    examples = read_squad(path)
    assert [(e.qid, e.answers, e.is_impossible) for e in examples] == [
        ("q1", [("red", 25), ("red", 25)], False), ("q2", [("round", 37)], False), ("q3", [], True)]
    assert examples[1].question == "what shape ?" and examples[1].context == ctx
    task = _task("qa")
    _, feats = task.load(path, True)
    assert task.version_2 is True                             # an unanswerable question: v2.0
    f = feats[0]["_qa"]
    start, end = f.offsets[f.start_position][0], f.offsets[f.end_position][1]
    assert ctx[start:end] == "red"
    assert feats[2]["start_positions"] == feats[2]["end_positions"] == 0
    # One question in the file: still JSON lines, not a SQuAD document without 'data'.
    one = _write(tmp_path, "one.json", _jsonl({"id": 7, "context": ctx, "question": "q",
                                               "answers": {"text": ["red"], "answer_start": [25]}}))
    assert [(e.qid, e.answers) for e in read_squad(one)] == [("7", [("red", 25)])]


def test_hf_conll_exports_load(tmp_path):
    names = ["O", "B-PER", "I-PER", "B-LOC"]
    ids_path = _write(tmp_path, "ids.jsonl", _jsonl(
        {"id": "0", "tokens": ["alice", "smith", "saw", "paris"], "pos_tags": [1, 1, 2, 1], "ner_tags": [1, 2, 0, 3]},
        {"id": "1", "tokens": ["-DOCSTART-"], "ner_tags": [0]},
        {"id": "2", "tokens": ["bob", "left"], "ner_tags": [1, 0]}))
    assert read_conll(ids_path, names) == [(1, ["alice", "smith", "saw", "paris"], ["B-PER", "I-PER", "O", "B-LOC"]),
                                           (3, ["bob", "left"], ["B-PER", "O"])]
    names_path = _write(tmp_path, "names.jsonl", _jsonl({"tokens": ["bob", "left"], "ner_tags": ["B-PER", "O"]}))
    assert read_conll(names_path) == [(1, ["bob", "left"], ["B-PER", "O"])]
    # Another tag list by --label-column; mixed ids and names are refused.
    assert read_conll(ids_path, ["NN", "NNP", "VBD"], "pos_tags")[0][2] == ["NNP", "NNP", "VBD", "NNP"]
    mixed = _write(tmp_path, "mixed.jsonl", _jsonl({"tokens": ["a"], "ner_tags": ["O"]},
                                                   {"tokens": ["b"], "ner_tags": [0]}))
    with pytest.raises(DataFormatError, match=r"mixed\.jsonl:2: ner_tags\[0\]: tag 0 is a JSON number but line 1"):
        read_conll(mixed, names)
    # Through the task: --labels names the ids, and the labels are the tags, not '0]}'.
    task = _task("token-classification", "--labels", ",".join(names))
    sentences, feats = task.load(ids_path, True)
    assert task.labels == names
    first = [lab for lab in feats[0]["labels"] if lab != -100]
    assert first == [1, 2, 0, 3]
    bad = _write(tmp_path, "bad.jsonl", _jsonl({"tokens": ["a"], "ner_tags": ["O"]}, {"tokens": ["b"],
                                                                                     "ner_tags": ["B-XYZ"]}))
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:2: tag 'B-XYZ' is not one of the known tags"):
        task.load(bad, False)


# --- prepare's I/O failures and leftovers
@pytest.mark.parametrize("code, cause", [(28, "the disk is full"), (30, "the file system is read-only"),
                                         (13, "permission denied")])
def test_prepare_names_a_write_failure_and_exits_5(corpus_and_vocab, tmp_path, monkeypatch, capsys, code, cause):
    """A full disk, a read-only or forbidden target: exit 5 (as pretrain and finetune), naming the
    cause, the file and the free space; never a raw OSError (simulated: as root here, permissions
    do not stop a write)."""
    import bertfast.data.prepare as prep
    corpus, vocab_dir = corpus_and_vocab
    out = tmp_path / "out"

    def fail(directory, arrays, meta):
        raise OSError(code, os.strerror(code), os.path.join(directory, "input_ids.npy"))

    monkeypatch.setattr(prep, "write_shard", fail)
    rc = prepare_main([corpus, "-o", str(out), "--vocab", vocab_dir, "--no-progress", "--workers", "1"])
    err = capsys.readouterr().err
    assert rc == 5, err
    assert f"could not write the dataset {out}: {cause}" in err and "input_ids.npy" in err and "MB free" in err
    assert "Traceback" not in err


def test_prepare_removes_what_a_killed_prepare_left(corpus_and_vocab, tmp_path):
    """A prepare killed while writing leaves NAME.tmp-<pid>: the next one removes those whose process
    is gone (a live process's are left alone)."""
    corpus, vocab_dir = corpus_and_vocab
    out = tmp_path / "out"
    dead, live = out / "train-00000.tmp-999999999", out / "train-00001.tmp-1"
    for path in (dead, live):
        path.mkdir(parents=True)
        (path / "input_ids.npy").write_bytes(b"half")
    said = []
    prepare_dataset([corpus], str(out), vocab=vocab_dir, max_seq_len=64, eval_docs=3, progress=False,
                    log=said.append, workers=1)
    assert not dead.exists() and live.exists()
    assert any(str(dead) in line and "stopped while writing" in line for line in said)


def test_token_ids_outside_the_vocabulary_name_the_shard(corpus_and_vocab, tmp_path):
    """A shard holding ids past the data's vocabulary (written with another one, or damaged): the
    loader names the shard and sequence, never a raw IndexError from the masking."""
    import shutil
    _, vocab_dir = corpus_and_vocab
    copy = tmp_path / "data"
    shutil.copytree(vocab_dir, copy)
    ids_path = copy / "train-00000" / "input_ids.npy"
    ids = np.load(ids_path)
    ids[3] = 5000
    np.save(ids_path, ids)
    data = PretrainingData(str(copy), "train")
    batches = PretrainingBatches(data, BatchSpec(len(data), len(data)), masking=masking_config_for(data))
    with pytest.raises(ValueError, match=r"split 'train' shard train-00000 sequence 0 \(example \d+\) holds token "
                                         r"id 5000, outside the data's \d+-word vocabulary"):
        batches.micro_batches(0)
