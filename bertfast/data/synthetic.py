"""Small synthetic but learnable fine-tuning datasets, written in the real file formats.

Used by the tests (each task must train to a set metric on CPU in seconds) and handy for
trying ``bertfast finetune`` without downloading anything. Every generator is seeded.

  classification   CSV  sentence1, sentence2, label: the polarity word of sentence1
                   (good/great/fine vs bad/awful/poor vs neutral words) decides the label
  regression       TSV  sentence, score: 1.25 x (number of "good" words), plus noise
  token            CoNLL: filler words with person / location / organisation names (BIO)
  qa               SQuAD JSON: filler sentences around "the <attr> is <value> ." facts;
                   "what is the <attr> ?"; v2.0 adds paragraphs without a fact (no answer)
  multiple choice  SWAG CSV: sent1 states a fact, sent2 starts restating it; the right ending
                   is the fact's value, the wrong ones filler words
"""
from __future__ import annotations

import csv
import json
import random
from typing import List

FILLER = ("the a this that one some many few it they we you see saw make made take took go went come came "
          "day night time year way thing place world hand part water city house room book story word "
          "small large old new long short quick slow early late open close near far under over").split()
POSITIVE = ("good", "great", "fine")
NEGATIVE = ("bad", "awful", "poor")
PERSONS = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi")
LOCATIONS = (("paris",), ("london",), ("new", "york"), ("san", "francisco"), ("rome",), ("cairo",))
ORGS = (("acme",), ("globex",), ("initech",), ("umbrella", "corp"))
ATTRIBUTES = {"color": ("red", "blue", "green", "yellow", "black", "white"),
              "size": ("tiny", "small", "medium", "big", "huge"),
              "shape": ("round", "square", "flat", "oval"),
              "owner": PERSONS,
              "city": ("paris", "london", "rome", "cairo", "tokyo")}


def _filler(rng: random.Random, lo: int, hi: int) -> List[str]:
    return [rng.choice(FILLER) for _ in range(rng.randint(lo, hi))]


def write_classification(path: str, n: int, seed: int = 0, neutral: bool = True) -> None:
    rng = random.Random(seed)
    labels = ["positive", "negative", "neutral"] if neutral else ["positive", "negative"]
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sentence1", "sentence2", "label"])
        for _ in range(n):
            label = rng.choice(labels)
            words = _filler(rng, 3, 8)
            if label != "neutral":
                words.insert(rng.randint(0, len(words)), rng.choice(POSITIVE if label == "positive" else NEGATIVE))
            w.writerow([" ".join(words), " ".join(_filler(rng, 2, 6)), label])


def write_regression(path: str, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        f.write("sentence\tscore\n")
        for _ in range(n):
            k = rng.randint(0, 4)
            words = _filler(rng, 2, 6)
            for _ in range(k):
                words.insert(rng.randint(0, len(words)), "good")
            f.write(f"{' '.join(words)}\t{1.25 * k + rng.uniform(-0.2, 0.2):.3f}\n")


def write_conll(path: str, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        f.write("-DOCSTART- -X- -X- O\n\n")
        for _ in range(n):
            tokens: List[tuple] = []
            for _ in range(rng.randint(2, 4)):
                for word in _filler(rng, 1, 3):
                    tokens.append((word, "O"))
                kind, names = rng.choice([("PER", [(p,) for p in PERSONS]), ("LOC", LOCATIONS), ("ORG", ORGS)])
                for i, word in enumerate(rng.choice(names)):
                    tokens.append((word, ("B-" if i == 0 else "I-") + kind))
            for word, tag in tokens:
                f.write(f"{word} NN O {tag}\n")
            f.write("\n")


def write_squad(path: str, n_paragraphs: int, seed: int = 0, version_2: bool = False,
                filler_sentences: int = 2, facts: int = 1) -> None:
    """Paragraphs of filler sentences and ``facts`` "the <attr> is <value> ." sentences; one
    question per fact. With ``version_2`` a third of the paragraphs state no fact and ask an
    unanswerable question."""
    rng = random.Random(seed)
    data = []
    qid = 0
    for p in range(n_paragraphs):
        impossible = version_2 and p % 3 == 2
        attrs = rng.sample(sorted(ATTRIBUTES), 1 if impossible else facts)
        values = {a: rng.choice(ATTRIBUTES[a]) for a in attrs}
        sentences = [" ".join(_filler(rng, 3, 7)) + " ." for _ in range(rng.randint(1, filler_sentences + 1))]
        if not impossible:
            for a in attrs:
                sentences.insert(rng.randint(0, len(sentences)), f"the {a} is {values[a]} .")
        context = " ".join(sentences)
        qas = []
        for a in attrs:
            if impossible:
                qas.append({"id": f"q{qid}", "question": f"what is the {a} ?", "answers": [], "is_impossible": True})
            else:
                start = context.index(f"the {a} is ") + len(f"the {a} is ")
                qas.append({"id": f"q{qid}", "question": f"what is the {a} ?",
                            "answers": [{"text": values[a], "answer_start": start}], "is_impossible": False})
            qid += 1
        data.append({"title": f"t{p}", "paragraphs": [{"context": context, "qas": qas}]})
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"version": "v2.0" if version_2 else "1.1", "data": data}, f)


def write_swag(path: str, n: int, seed: int = 0) -> None:
    """sent1 states a fact, sent2 starts restating it; the right ending is the fact's value,
    the three wrong ones are filler words (learnable from the endings alone: this exercises
    the [B, C, S] plumbing and the per-choice scoring, not reasoning)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["video-id", "fold-ind", "startphrase", "sent1", "sent2", "gold-source",
                    "ending0", "ending1", "ending2", "ending3", "label"])
        for i in range(n):
            a = rng.choice(sorted(ATTRIBUTES))
            right = rng.choice(ATTRIBUTES[a])
            wrong = rng.sample(FILLER, 3)
            sent1 = " ".join(_filler(rng, 1, 4)) + f" the {a} is {right} ."
            sent2 = f"so its {a} is"
            label = rng.randint(0, 3)
            endings = wrong[:label] + [right] + wrong[label:]
            w.writerow([f"v{i}", i, f"{sent1} {sent2}", sent1, sent2, "gold", *[e + " ." for e in endings], label])


def corpus_text(seed: int = 0, n_lines: int = 400) -> List[str]:
    """Lines covering every word above, to train a small WordPiece vocabulary on."""
    rng = random.Random(seed)
    words = (list(FILLER) + list(POSITIVE) + list(NEGATIVE) + list(PERSONS)
             + [w for group in (LOCATIONS, ORGS) for name in group for w in name]
             + list(ATTRIBUTES) + [v for vs in ATTRIBUTES.values() for v in vs]
             + ["what", "is", "so", "its", "?", ".", ","])
    lines = [" ".join(words)]
    for _ in range(n_lines):
        lines.append(" ".join(rng.choice(words) for _ in range(12)))
    return lines
