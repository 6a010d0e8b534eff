"""The pre-training data pipeline: corpus reading, NSP examples, masking, shards, prepare, loader."""
import json
import os
import random

import numpy as np
import pytest
import torch

from bertfast.data import corpus as corpus_mod
from bertfast.data.loader import BatchSpec, PretrainingBatches, masking_config_for, sequence_lengths
from bertfast.data.masking import MaskingConfig, continuation_flags, example_rng, mask_sequence
from bertfast.data.nsp import TokenizedCorpus, instances_from_document, truncate_seq_pair
from bertfast.data.prepare import main as prepare_main
from bertfast.data.prepare import prepare_dataset
from bertfast.data.shards import PretrainingData
from bertfast.data.tokenization import WordPiece

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
         "sigma tau upsilon phi chi psi omega red green blue cyan magenta yellow black white").split()


def write_corpus(path, n_docs=40, seed=0, sentences=(3, 9)):
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for d in range(n_docs):
            for _ in range(rng.randint(*sentences)):
                f.write(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + ".\n")
            f.write("\n")
    return path


def synthetic_corpus(doc_lengths, seg_len=5):
    """A corpus whose token ids are their global positions: contiguity is checkable."""
    seg_offsets, doc_offsets, pos = [0], [0], 0
    for n_segs in doc_lengths:
        for _ in range(n_segs):
            pos += seg_len
            seg_offsets.append(pos)
        doc_offsets.append(len(seg_offsets) - 1)
    return TokenizedCorpus(np.arange(pos, dtype=np.uint32), np.array(seg_offsets), np.array(doc_offsets))


# --------------------------------------------------------------------------- corpus
def test_read_documents_blank_and_file(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("one.\ntwo.\n\n\nthree.\n  \nfour. Five.\n", encoding="utf-8")
    assert list(corpus_mod.read_documents([str(p)], "blank")) == [["one.", "two."], ["three."], ["four. Five."]]
    assert list(corpus_mod.read_documents([str(p)], "file")) == [["one.", "two.", "three.", "four. Five."]]
    long = "First sentence here. " * 30
    segs = corpus_mod.split_long_line(long, 100)
    assert len(segs) > 1 and all(len(s) <= 100 for s in segs)
    assert " ".join(segs) == long.strip()


def test_read_documents_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\n\xff\xfe broken\n")
    with pytest.raises(corpus_mod.CorpusError, match="bad.txt"):
        list(corpus_mod.read_documents([str(bad)]))
    with pytest.raises(corpus_mod.CorpusError, match="missing"):
        corpus_mod.expand_inputs([str(tmp_path / "missing*.txt")])


def test_embedded_corpus_is_deterministic():
    a = corpus_mod.stdlib_documents(max_files=40)
    b = corpus_mod.stdlib_documents(max_files=40)
    assert a == b and len(a) > 20
    assert all(len(doc) >= 2 and all(seg.strip() for seg in doc) for doc in a)


# --------------------------------------------------------------------------- NSP examples
def test_truncate_seq_pair_trims_longer_side():
    rng = random.Random(0)
    a, b = list(range(10)), list(range(100, 103))
    truncate_seq_pair(a, b, 8, rng)
    assert len(a) + len(b) == 8 and b == [100, 101, 102]
    # Removed tokens come from the ends only: what is left is contiguous.
    assert a == list(range(a[0], a[0] + 5))


def test_nsp_instances_follow_the_paper_pipeline():
    corpus = synthetic_corpus([8] * 30 + [1] * 5, seg_len=6)
    doc_of = np.repeat(np.arange(corpus.num_docs), np.diff(corpus.doc_offsets) * 6)
    rng = random.Random(3)
    max_seq_len = 40
    n_random = n_total = 0
    for d in range(corpus.num_docs):
        for inst in instances_from_document(corpus, d, max_seq_len, short_seq_prob=0.1, rng=rng):
            a, b = inst.tokens_a, inst.tokens_b
            assert a and b and len(a) + len(b) <= max_seq_len - 3
            assert np.all(np.diff(a) == 1) and np.all(np.diff(b) == 1)   # contiguous spans
            assert set(doc_of[a]) == {d}
            if inst.is_random_next:
                assert set(doc_of[b]) != {d}                          # another document
                n_random += 1
            else:
                assert set(doc_of[b]) == {d} and b[0] > a[-1]         # the continuation
            n_total += 1
    # One-segment documents always take a random B; the rest are about half and half.
    assert 0.4 < n_random / n_total < 0.7, (n_random, n_total)


def test_nsp_short_seq_prob_and_determinism():
    corpus = synthetic_corpus([40] * 10, seg_len=4)

    def lengths(p, seed):
        rng = random.Random(seed)
        return [len(i.tokens_a) + len(i.tokens_b) for d in range(10)
                for i in instances_from_document(corpus, d, 64, p, rng)]

    assert lengths(0.0, 1) == lengths(0.0, 1)
    long = lengths(0.0, 1)
    assert np.mean(long) > 50                     # chunks fill up to the target length
    short = lengths(1.0, 1)
    assert np.mean(short) < np.mean(long) - 10    # every document draws a shorter target


# --------------------------------------------------------------------------- masking
def _mask_cfg(**kw):
    return MaskingConfig(vocab_size=1000, mask_id=4, special_ids=(0, 1, 2, 3, 4), **kw)


def test_masking_counts_and_80_10_10():
    cfg = _mask_cfg()
    n_mask = n_random = n_same = n_chosen = 0
    for i in range(400):
        ids = np.concatenate([[2], np.arange(10, 110) + i, [3], np.arange(200, 160, -1), [3]])
        out, pos, lab = mask_sequence(ids, cfg, example_rng(7, 0, i))
        n_cand = len(ids) - 3
        assert len(pos) == round(0.15 * n_cand)
        assert np.all(np.diff(pos) > 0) and np.all(lab == ids[pos])
        assert not np.isin(ids[pos], [2, 3]).any()                  # never a special token
        unchanged = np.ones(len(ids), bool)
        unchanged[pos] = False
        assert np.array_equal(out[unchanged], ids[unchanged])
        n_chosen += len(pos)
        n_mask += int((out[pos] == 4).sum())
        n_same += int((out[pos] == ids[pos]).sum())
        n_random += int(((out[pos] != 4) & (out[pos] != ids[pos])).sum())
        assert not np.isin(out[pos][out[pos] != 4], [0, 1, 2, 3]).any()
    assert abs(n_mask / n_chosen - 0.8) < 0.02
    assert abs(n_random / n_chosen - 0.1) < 0.015   # (a random draw equal to the original counts as kept)
    assert abs(n_same / n_chosen - 0.1) < 0.015


def test_masking_cap_determinism_and_whole_words():
    ids = np.concatenate([[2], np.arange(10, 210), [3]])
    out1 = mask_sequence(ids, _mask_cfg(max_predictions_per_seq=7), example_rng(1, 2, 3))
    out2 = mask_sequence(ids, _mask_cfg(max_predictions_per_seq=7), example_rng(1, 2, 3))
    assert len(out1[1]) == 7
    assert all(np.array_equal(x, y) for x, y in zip(out1, out2))
    other_epoch = mask_sequence(ids, _mask_cfg(max_predictions_per_seq=7), example_rng(1, 3, 3))
    assert not np.array_equal(out1[1], other_epoch[1])
    # Whole words: ids >= 500 are "##" continuations; a word is masked entirely or not at all.
    vocab = [f"w{i}" if i < 500 else f"##w{i}" for i in range(1000)]
    cfg = _mask_cfg(whole_word=True, continuation=continuation_flags(vocab))
    words = [[10 + k] + [500 + 3 * k + j for j in range(k % 3)] for k in range(60)]
    seq = np.array([2] + [t for w in words for t in w] + [3])
    for i in range(20):
        _, pos, _ = mask_sequence(seq, cfg, example_rng(0, 0, i))
        chosen = set(pos.tolist())
        start = 1
        for w in words:
            span = set(range(start, start + len(w)))
            assert span <= chosen or not (span & chosen)
            start += len(w)


# --------------------------------------------------------------------------- prepare + shards
@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("prep")
    corpus = write_corpus(str(root / "corpus.txt"), n_docs=60)
    out = str(root / "data")
    prepare_dataset([corpus], out, vocab_size=200, max_seq_len=48, num_shards=3, eval_docs=6, workers=1,
                    dupe_factor=2, progress=False, log=lambda m: None)
    return corpus, out


def test_prepare_writes_consistent_shards(prepared):
    corpus, out = prepared
    index = json.load(open(os.path.join(out, "index.json")))
    assert index["splits"]["train"] == ["train-00000", "train-00001", "train-00002"]
    assert index["id_dtype"] == "uint16" and index["vocab_size"] <= 200
    data = PretrainingData(out, "train")
    tok = WordPiece.from_pretrained(out)
    assert len(data) == index["num_examples"]["train"] > 50
    labels = []
    for i in range(len(data)):
        ids, a_len, nsp, static = data.example(i)
        assert static is None and len(ids) <= 48
        assert ids[0] == tok.cls_id and ids[a_len - 1] == tok.sep_id and ids[-1] == tok.sep_id
        assert (ids == tok.sep_id).sum() == 2 and 3 <= a_len < len(ids) - 1
        labels.append(nsp)
    assert 0.3 < np.mean(labels) < 0.75
    assert len(PretrainingData(out, "eval")) > 0
    # The tokens decode back to corpus words.
    text = tok.decode(data.example(0)[0])
    assert any(w in text for w in WORDS)


def test_prepare_is_resumable_and_worker_count_independent(prepared, tmp_path):
    corpus, out = prepared
    shard = os.path.join(out, "train-00001", "input_ids.npy")
    mtime = os.stat(shard).st_mtime_ns
    messages = []
    prepare_dataset([corpus], out, vocab_size=200, max_seq_len=48, num_shards=3, eval_docs=6, workers=1,
                    dupe_factor=2, progress=False, log=messages.append)
    assert os.stat(shard).st_mtime_ns == mtime                    # finished shards are skipped
    assert any("4 already done" in m for m in messages)
    # A shard lost (e.g. killed mid-run before its rename) is rebuilt identically.
    import shutil
    copy = str(tmp_path / "copy")
    shutil.copytree(out, copy)
    before = np.load(os.path.join(copy, "train-00002", "input_ids.npy"))
    shutil.rmtree(os.path.join(copy, "train-00002"))
    os.makedirs(os.path.join(copy, "train-00002.tmp-123"))        # debris of a killed worker
    prepare_dataset([corpus], copy, vocab_size=200, max_seq_len=48, num_shards=3, eval_docs=6, workers=2,
                    dupe_factor=2, progress=False, log=lambda m: None)
    assert np.array_equal(np.load(os.path.join(copy, "train-00002", "input_ids.npy")), before)


def test_prepare_static_masking_and_existing_vocab(prepared, tmp_path):
    corpus, out = prepared
    out2 = str(tmp_path / "static")
    rc = prepare_main([corpus, "-o", out2, "--vocab", out, "--max-seq-len", "32", "--static-masking",
                       "--max-predictions-per-seq", "3", "--eval-docs", "0", "--workers", "1", "--no-progress"])
    assert rc == 0
    data = PretrainingData(out2, "train")
    assert data.static_masking and open(os.path.join(out2, "vocab.txt")).read() == \
        open(os.path.join(out, "vocab.txt")).read()
    mask_id = data.special_ids["mask"]
    n_mask = n_pos = 0
    for i in range(len(data)):
        ids, _, _, (pos, lab) = data.example(i)
        assert 1 <= len(pos) <= 3 and np.all(pos < len(ids))
        n_mask += int((ids[pos] == mask_id).sum())
        n_pos += len(pos)
    assert 0.65 < n_mask / n_pos < 0.95


def test_prepare_cli_errors(tmp_path, capsys):
    rc = prepare_main([str(tmp_path / "nope.txt"), "-o", str(tmp_path / "o"), "--no-progress"])
    assert rc == 2 and "nope.txt" in capsys.readouterr().err


# --------------------------------------------------------------------------- loader
def test_loader_batches_ranks_and_resume(prepared):
    _, out = prepared
    data = PretrainingData(out, "train")
    masking = masking_config_for(data)

    def make(gbs, mbs, world=1, rank=0):
        return PretrainingBatches(data, BatchSpec(gbs, mbs, world, rank), seed=5, masking=masking)

    one = make(8, 2)
    micro = one.micro_batches(3)
    assert len(micro) == 4
    b = micro[0]
    assert b["input_ids"].shape[1] % 8 == 0 and b["labels"].shape == b["input_ids"].shape
    assert torch.equal(b["attention_mask"].sum(1) > 0, torch.ones(2, dtype=torch.bool))
    # token_type is 1 exactly on segment B: after the first [SEP], up to the last real token.
    sep = data.special_ids["sep"]
    for r in range(2):
        n = int(b["attention_mask"][r].sum())
        first_sep = int((b["input_ids"][r, :n] == sep).nonzero()[0])   # specials are never masked
        assert (b["token_type_ids"][r, :first_sep + 1] == 0).all()
        assert (b["token_type_ids"][r, first_sep + 1:n] == 1).all()
        assert (b["token_type_ids"][r, n:] == 0).all() and (b["input_ids"][r, n:] == 0).all()
    # Two ranks (no accumulation) see exactly the micro-batches of one rank accumulating.
    ranks = [make(8, 2, 2, r).micro_batches(3) for r in range(2)]
    for mine, theirs in zip(micro, ranks[0] + ranks[1]):
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    # Pure function of the step: a fresh stream (a resumed run) gives the same batch.
    again = make(8, 2).micro_batches(3)
    assert all(torch.equal(x[k], y[k]) for x, y in zip(micro, again) for k in x)
    # A new epoch re-masks the same examples differently.
    n = len(data)
    items_e0 = one.stream_items(0, n)
    items_e1 = one.stream_items(n, n)
    idx = items_e0[0][1]
    pos1 = next(p for p, (e, i) in enumerate(items_e1) if i == idx)
    assert not torch.equal(one.collate([items_e0[0]])["labels"], one.collate([items_e1[pos1]])["labels"])
    assert [i for _, i in items_e0] != [i for _, i in items_e1]        # and reshuffles them
    # Static shapes: padded to max_seq_len.
    static = PretrainingBatches(data, BatchSpec(4, 4), seed=5, masking=masking, static_shapes=True)
    assert static.micro_batches(0)[0]["input_ids"].shape == (4, data.max_seq_len)


def test_loader_packs_micro_batches_into_fixed_rows(prepared):
    _, out = prepared
    data = PretrainingData(out, "train")
    masking = masking_config_for(data)
    s = data.max_seq_len
    padded = PretrainingBatches(data, BatchSpec(8, 4), seed=5, masking=masking)
    packed = PretrainingBatches(data, BatchSpec(8, 4), seed=5, masking=masking, pack_tokens=4 * s)
    shapes = set()
    for step in range(3):
        for pad, row in zip(padded.micro_batches(step), packed.micro_batches(step)):
            shapes.add(tuple((k, tuple(v.shape)) if isinstance(v, torch.Tensor) else (k, v) for k, v in row.items()))
            mask = pad["attention_mask"].bool()
            used = int(mask.sum())
            # The same sequences, one after another, then padding.
            for name in ("input_ids", "token_type_ids", "labels"):
                assert torch.equal(row[name][0, :used], pad[name][mask]), name
            assert (row["input_ids"][0, used:] == data.special_ids["pad"]).all()
            assert (row["labels"][0, used:] == -100).all()
            cu = row["cu_seq_lens_q"].long()
            lengths = cu.diff()
            assert cu[0] == 0 and cu[-1] == 4 * s and (lengths >= 0).all() and (lengths <= s).all()
            assert torch.equal(lengths[:4], mask.sum(1))
            # Dummy tail pieces and empty slots: no NSP label; real sequences: theirs.
            assert torch.equal(row["next_sentence_label"][:4], pad["next_sentence_label"])
            assert (row["next_sentence_label"][4:] == -100).all()
            assert row["max_length_q"] == s and row["next_sentence_label"].shape == (4 + 4,)
            starts = cu[:-1]
            for k in range(len(lengths)):  # positions restart in every sequence (the tail's too)
                assert torch.equal(row["position_ids"][0, starts[k]:starts[k] + lengths[k]], torch.arange(lengths[k]))
            assert torch.equal(sequence_lengths(row), torch.cat([lengths[:4], torch.zeros(4, dtype=torch.long)]))
    assert len(shapes) == 1                                     # every micro-batch: the same shapes
    # A budget that cannot hold a micro-batch, or a sequence, is refused with what to change.
    small = PretrainingBatches(data, BatchSpec(8, 4), seed=5, masking=masking, pack_tokens=s)
    with pytest.raises(ValueError, match=rf"a micro-batch of 4 sequences .* holds \d+ tokens, more than the {s} of "
                                         r"its packed row \(pack_tokens\): raise pack_tokens"):
        small.micro_batches(0)
    with pytest.raises(ValueError, match=rf"pack_tokens: expected at least max_seq_len \({s}\)"):
        PretrainingBatches(data, BatchSpec(8, 4), masking=masking, pack_tokens=s - 1)
