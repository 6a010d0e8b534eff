"""Evaluation metrics of the fine-tuning tasks, in numpy (no sklearn, no scipy).

  accuracy, f1 (binary: of the positive class; otherwise macro), matthews_corrcoef (multi-class
  form), pearson, spearman (Pearson of average ranks, ties shared), entity_f1 (exact chunk
  match over BIO/IOB1/IOBES tags, as conlleval), squad_em_f1 (SQuAD's answer normalisation,
  best over the gold answers; "" is the gold answer of an unanswerable question).
"""
from __future__ import annotations

import collections
import re
import string
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np


# --------------------------------------------------------------------------- classification
def accuracy(pred: Sequence[int], gold: Sequence[int]) -> float:
    pred, gold = np.asarray(pred), np.asarray(gold)
    return float((pred == gold).mean()) if len(gold) else 0.0


def _confusion(pred: np.ndarray, gold: np.ndarray, num_classes: int) -> np.ndarray:
    cm = np.zeros((num_classes, num_classes), dtype=np.float64)
    np.add.at(cm, (gold, pred), 1)
    return cm  # rows: gold, columns: predicted


def f1(pred: Sequence[int], gold: Sequence[int], num_classes: Optional[int] = None,
       average: str = "auto", positive: int = 1) -> float:
    """Binary F1 of class ``positive`` (two classes, average 'auto'/'binary'), else macro F1."""
    pred, gold = np.asarray(pred, dtype=np.int64), np.asarray(gold, dtype=np.int64)
    k = num_classes or int(max(pred.max(initial=0), gold.max(initial=0)) + 1)
    cm = _confusion(pred, gold, max(k, 2))
    tp = np.diag(cm)
    precision = np.divide(tp, cm.sum(0), out=np.zeros_like(tp), where=cm.sum(0) > 0)
    recall = np.divide(tp, cm.sum(1), out=np.zeros_like(tp), where=cm.sum(1) > 0)
    denom = precision + recall
    per_class = np.divide(2 * precision * recall, denom, out=np.zeros_like(tp), where=denom > 0)
    if average == "binary" or (average == "auto" and k <= 2):
        return float(per_class[positive])
    return float(per_class.mean())


def matthews_corrcoef(pred: Sequence[int], gold: Sequence[int]) -> float:
    """Gorodkin's multi-class MCC (the binary MCC for two classes); 0 when undefined."""
    pred, gold = np.asarray(pred, dtype=np.int64), np.asarray(gold, dtype=np.int64)
    if not len(gold):
        return 0.0
    k = int(max(pred.max(), gold.max()) + 1)
    cm = _confusion(pred, gold, k)
    t = cm.sum(1)   # true counts per class
    p = cm.sum(0)   # predicted counts per class
    c = np.trace(cm)
    s = cm.sum()
    num = c * s - float(t @ p)
    den = np.sqrt(s ** 2 - float(p @ p)) * np.sqrt(s ** 2 - float(t @ t))
    return float(num / den) if den > 0 else 0.0


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    xc, yc = x - x.mean(), y - y.mean()
    den = np.sqrt((xc ** 2).sum() * (yc ** 2).sum())
    return float((xc * yc).sum() / den) if den > 0 else 0.0


def rankdata(x: Sequence[float]) -> np.ndarray:
    """1-based ranks, ties get their average rank."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(1, len(x) + 1)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.zeros(len(counts))
    np.add.at(sums, inverse, ranks)
    return sums[inverse] / counts[inverse]


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    return pearson(rankdata(x), rankdata(y))


def classification_metrics(pred: Sequence[int], gold: Sequence[int], num_classes: int) -> Dict[str, float]:
    return {"accuracy": accuracy(pred, gold), "f1": f1(pred, gold, num_classes),
            "matthews": matthews_corrcoef(pred, gold)}


def regression_metrics(pred: Sequence[float], gold: Sequence[float]) -> Dict[str, float]:
    p, s = pearson(pred, gold), spearman(pred, gold)
    return {"pearson": p, "spearman": s, "pearson_spearman": (p + s) / 2,
            "mse": float(np.mean((np.asarray(pred) - np.asarray(gold)) ** 2)) if len(gold) else 0.0}


# --------------------------------------------------------------------------- entities
def get_entities(tags: Sequence[str]) -> List[Tuple[str, int, int]]:
    """Chunks (type, start, end inclusive) of a tag sequence in BIO / IOB1 / IOBES (conlleval rules)."""
    chunks = []
    prev_tag, prev_type = "O", ""
    start = None
    for i, tag in enumerate(list(tags) + ["O"]):
        if tag in ("O", "", None):
            t, typ = "O", ""
        elif "-" in tag:
            t, typ = tag.split("-", 1)
        else:
            t, typ = tag, ""
        if start is not None and _chunk_ends(prev_tag, t, prev_type, typ):
            chunks.append((prev_type, start, i - 1))
            start = None
        if _chunk_starts(prev_tag, t, prev_type, typ):
            start = i
        prev_tag, prev_type = t, typ
    return chunks


def _chunk_ends(prev: str, tag: str, prev_type: str, typ: str) -> bool:
    if prev in ("E", "S"):
        return True
    if prev == "O":
        return False
    if tag in ("B", "S", "O"):
        return True
    return prev_type != typ


def _chunk_starts(prev: str, tag: str, prev_type: str, typ: str) -> bool:
    if tag in ("B", "S"):
        return True
    if tag == "O":
        return False
    if prev in ("E", "S", "O"):
        return True
    return prev_type != typ


def entity_f1(pred_tags: Sequence[Sequence[str]], gold_tags: Sequence[Sequence[str]]) -> Dict[str, float]:
    """Micro precision / recall / F1 of exactly matching entity chunks, plus token accuracy."""
    n_pred = n_gold = n_correct = 0
    tok_ok = tok_n = 0
    for p, g in zip(pred_tags, gold_tags):
        if len(p) != len(g):
            raise ValueError(f"prediction has {len(p)} tags for a sentence of {len(g)} words")
        pe, ge = set(get_entities(p)), set(get_entities(g))
        n_pred += len(pe)
        n_gold += len(ge)
        n_correct += len(pe & ge)
        tok_ok += sum(a == b for a, b in zip(p, g))
        tok_n += len(g)
    precision = n_correct / n_pred if n_pred else 0.0
    recall = n_correct / n_gold if n_gold else 0.0
    f = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f, "token_accuracy": tok_ok / tok_n if tok_n else 0.0}


# --------------------------------------------------------------------------- SQuAD
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower case, drop punctuation and articles, collapse whitespace (the SQuAD script's rule)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def squad_f1_single(prediction: str, gold: str) -> float:
    p, g = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not p or not g:
        return float(p == g)
    common = collections.Counter(p) & collections.Counter(g)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def squad_em_f1(predictions: Dict[str, str], golds: Dict[str, List[str]]) -> Dict[str, float]:
    """Exact match and F1 in percent over the questions of ``golds`` (missing predictions count as "")."""
    em = f = 0.0
    has_ans = [0.0, 0.0, 0]
    no_ans = [0.0, 0.0, 0]
    for qid, answers in golds.items():
        answers = [a for a in answers if normalize_answer(a)] or [""]
        pred = predictions.get(qid, "")
        e = max(float(normalize_answer(pred) == normalize_answer(a)) for a in answers)
        s = max(squad_f1_single(pred, a) for a in answers)
        em += e
        f += s
        bucket = no_ans if answers == [""] else has_ans
        bucket[0] += e
        bucket[1] += s
        bucket[2] += 1
    n = max(len(golds), 1)
    out = {"exact_match": 100 * em / n, "f1": 100 * f / n, "total": len(golds)}
    if no_ans[2]:
        out.update(HasAns_exact=100 * has_ans[0] / max(has_ans[2], 1), HasAns_f1=100 * has_ans[1] / max(has_ans[2], 1),
                   NoAns_exact=100 * no_ans[0] / no_ans[2], NoAns_f1=100 * no_ans[1] / no_ans[2])
    return out


def mean(values: Iterable[float]) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else 0.0
