"""Fine-tuning data: readers (with errors that name file and line) and model features.

Formats
  * tables (classification, regression, multiple choice): CSV, TSV (GLUE style, no quoting)
    or JSON lines, chosen by extension (.csv, .tsv/.txt, .jsonl/.json); a header row names
    the columns (or ``header=False`` and columns are given by 0-based index);
  * CoNLL (token classification): one token per line, its tag in the last column, blank
    lines between sentences, ``-DOCSTART-`` lines skipped;
  * SQuAD v1.1 / v2.0 JSON (extractive QA): data[].paragraphs[].{context, qas[]} with
    answers[].{text, answer_start} and, for v2.0, is_impossible;
  * Hugging Face ``datasets`` exports (``Dataset.to_json``: JSON lines, one example a line):
    GLUE-style tables read as JSON lines; SQuAD rows {id, context, question, answers: {text:
    [...], answer_start: [...]}} (no answer: v2.0 unanswerable); CoNLL rows {tokens: [...],
    ner_tags: [...]} with tag strings, or tag ids named by ``tag_names`` in id order.

Files must be UTF-8 (a byte-order mark is allowed); every error names ``path:line`` (or the
path, for whole-file problems) and what was expected.

Features are model keyword arguments as Python lists; ``pad_batch`` turns a list of them into
tensors padded to the longest sequence. BERT's input layout is kept: [CLS] A [SEP] (B [SEP]),
token_type 0 for A and 1 for B; pairs longer than ``max_seq_len`` are truncated by
repeatedly dropping the last token of the longer side.
"""
from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from bertfast.contract import IGNORE_INDEX
from bertfast.data.textfile import non_utf8_error
from bertfast.data.tokenization import WordPiece


class DataFormatError(ValueError):
    """Malformed fine-tuning input; the message starts with ``file:line:``."""

    def __init__(self, path: str, line: Optional[int], message: str):
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {message}")
        self.path, self.line = path, line


# =========================================================================== readers
def table_format(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext == ".csv":
        return "csv"
    if ext in (".tsv", ".txt"):
        return "tsv"
    if ext in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    raise DataFormatError(path, None, f"unknown table format {ext!r}: use .csv, .tsv or .jsonl")


def _not_utf8(path: str) -> DataFormatError:
    line, message = non_utf8_error(path)
    return DataFormatError(path, line, message)


def _require_file(path: str) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")


def _read_jsonl(path: str) -> List[Tuple[int, Dict[str, Any]]]:
    """Non-blank lines of a JSON-lines file as (line number, object)."""
    rows: List[Tuple[int, Dict[str, Any]]] = []
    try:
        with open(path, encoding="utf-8-sig") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataFormatError(path, lineno, f"invalid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(obj, dict):
                    raise DataFormatError(path, lineno, f"expected a JSON object, got {_json_type(obj)}")
                rows.append((lineno, obj))
    except UnicodeDecodeError:
        raise _not_utf8(path) from None
    return rows


def is_json_lines(path: str) -> bool:
    """True when the first non-blank line of ``path`` is a JSON object on its own (a JSON-lines file)."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            for line in f:
                if line.strip():
                    if not line.lstrip().startswith("{"):
                        return False
                    try:
                        return isinstance(json.loads(line), dict)
                    except json.JSONDecodeError:
                        return False
    except UnicodeDecodeError:
        raise _not_utf8(path) from None
    return False


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a JSON boolean"
    if isinstance(value, (int, float)):
        return "a JSON number"
    if isinstance(value, str):
        return "a JSON string"
    if value is None:
        return "JSON null"
    return "a JSON array" if isinstance(value, list) else "a JSON object"


def read_table(path: str, header: bool = True) -> List[Tuple[int, Dict[str, Any]]]:
    """Rows as (line number, {column: value}); without a header the keys are "0", "1", ...

    A CSV record may span lines (a quoted field with newlines): its line is the first one.
    """
    _require_file(path)
    fmt = table_format(path)
    if fmt == "jsonl":
        return _read_jsonl(path)
    rows: List[Tuple[int, Dict[str, Any]]] = []
    names: Optional[List[str]] = None
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            if fmt == "csv":
                # strict: an unclosed quote or text after a closing quote is an error, not a merged field
                reader = csv.reader(f, strict=True)
            else:
                reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            end = 0  # last line of the previous record
            try:
                for record in reader:
                    lineno, end = end + 1, reader.line_num
                    if not record or all(not c.strip() for c in record):
                        continue
                    if header and names is None:
                        names = [c.strip() for c in record]
                        continue
                    if names is None:
                        rows.append((lineno, {str(i): v for i, v in enumerate(record)}))
                        continue
                    if len(record) != len(names):
                        spans = f" (the record runs to line {end}: a stray quote?)" if end > lineno else ""
                        raise DataFormatError(path, lineno, f"expected {len(names)} fields ({', '.join(names)}), "
                                                            f"found {len(record)}{spans}")
                    rows.append((lineno, dict(zip(names, record))))
            except csv.Error as e:
                if "unexpected end of data" in str(e):
                    raise DataFormatError(path, end + 1, "malformed CSV: a quoted field opened in the record "
                                                         "starting here is never closed (unclosed quote)") from None
                raise DataFormatError(path, reader.line_num, f"malformed {fmt.upper()} ({e})") from None
    except UnicodeDecodeError:
        raise _not_utf8(path) from None
    return rows


def column(row: Dict[str, Any], name: str, path: str, lineno: int, required: bool = True) -> Any:
    if name not in row:
        if not required:
            return None
        raise DataFormatError(path, lineno, f"missing column {name!r} (columns: {', '.join(map(str, row))})")
    value = row[name]
    if required and (value is None or (isinstance(value, str) and not value.strip())):
        raise DataFormatError(path, lineno, f"empty value in column {name!r}")
    return value


def text_column(row: Dict[str, Any], name: str, path: str, lineno: int, required: bool = True) -> Optional[str]:
    """A text field as a string; a JSON array or object (e.g. a token list) is refused, not str()-ed."""
    value = column(row, name, path, lineno, required)
    if value is None:
        return None
    if isinstance(value, (list, dict, bool)):
        raise DataFormatError(path, lineno, f"column {name!r}: expected text (a string), got {_json_type(value)}"
                                            f" {json.dumps(value)[:60]}")
    return str(value)


def label_names(labels: Sequence[Tuple[int, Any]], path: str) -> List[str]:
    """Classification labels (line, value) as names: strings stripped of surrounding whitespace
    (" 1" is "1"), integral numbers as integers (1.0 is "1"). Values of mixed JSON types (true
    and 1, 1 and "1") are refused: they would be distinct classes that look alike."""
    out: List[str] = []
    first: Optional[Tuple[int, Any]] = None
    for lineno, value in labels:
        if isinstance(value, (list, dict)):
            raise DataFormatError(path, lineno, f"label: expected one class (a string or number), got "
                                                f"{_json_type(value)} {json.dumps(value)[:60]}")
        if first is None:
            first = (lineno, value)
        elif _json_type(value) != _json_type(first[1]):
            raise DataFormatError(path, lineno, f"label {json.dumps(value)} is {_json_type(value)} but line "
                                                f"{first[0]} has {_json_type(first[1])} ({json.dumps(first[1])});"
                                                f" expected one type for all labels")
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        out.append(value.strip() if isinstance(value, str) else str(value))
    return out


TAG_COLUMNS = ("ner_tags", "tags", "labels", "label")  # the tag list of a JSON-lines row


def read_conll(path: str, tag_names: Optional[Sequence[str]] = None,
               tag_column: Optional[str] = None) -> List[Tuple[int, List[str], List[str]]]:
    """Sentences as (line of the first token, words, tags).

    CoNLL text, or JSON lines as ``datasets`` exports them: {"tokens": [...], "ner_tags": [...]}
    (``tag_column`` names another tag list); tag ids are mapped through ``tag_names`` (the
    names in id order), and refused without them (their names are not in the file).
    """
    _require_file(path)
    if is_json_lines(path):
        return _read_token_rows(path, tag_names, tag_column)
    out: List[Tuple[int, List[str], List[str]]] = []
    words: List[str] = []
    tags: List[str] = []
    start = 0
    try:
        with open(path, encoding="utf-8-sig") as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line or line.startswith("-DOCSTART-"):
                    if words:
                        out.append((start, words, tags))
                        words, tags = [], []
                    continue
                parts = line.split()
                if len(parts) < 2:
                    raise DataFormatError(path, lineno, f"expected 'token ... tag' (2 or more columns), got {line!r}")
                if not words:
                    start = lineno
                words.append(parts[0])
                tags.append(parts[-1])
    except UnicodeDecodeError:
        raise _not_utf8(path) from None
    if words:
        out.append((start, words, tags))
    return out


def _read_token_rows(path: str, tag_names: Optional[Sequence[str]],
                     tag_column: Optional[str]) -> List[Tuple[int, List[str], List[str]]]:
    out: List[Tuple[int, List[str], List[str]]] = []
    first: Optional[Tuple[int, Any]] = None  # the first tag: all must be names, or all ids
    for lineno, row in _read_jsonl(path):
        key = tag_column if tag_column in row else next((c for c in TAG_COLUMNS if c in row), None)
        if "tokens" not in row or key is None:
            raise DataFormatError(path, lineno, f"expected a token-classification row with 'tokens' and a tag list "
                                                f"({' or '.join(TAG_COLUMNS)}), found keys {', '.join(row)}")
        words, tags = row["tokens"], row[key]
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise DataFormatError(path, lineno, f"'tokens': expected a list of strings, got {json.dumps(words)[:60]}")
        if not isinstance(tags, list) or len(tags) != len(words):
            raise DataFormatError(path, lineno, f"{key!r}: expected a list of {len(words)} tags (one per token), "
                                                f"got {json.dumps(tags)[:60]}")
        if not words or words == ["-DOCSTART-"]:
            continue
        names: List[str] = []
        for k, t in enumerate(tags):
            if isinstance(t, bool) or not isinstance(t, (int, str)):
                raise DataFormatError(path, lineno, f"{key}[{k}]: expected a tag name or id, got {_json_type(t)}")
            if first is None:
                first = (lineno, t)
            elif isinstance(t, str) != isinstance(first[1], str):
                raise DataFormatError(path, lineno, f"{key}[{k}]: tag {json.dumps(t)} is {_json_type(t)} but line "
                                                    f"{first[0]} has {_json_type(first[1])}; expected all tag names "
                                                    f"or all tag ids")
            if isinstance(t, int):
                if tag_names is None:
                    raise DataFormatError(path, lineno, f"{key!r} holds tag ids ({t}, ...), whose names are not in the "
                                                        f"file: give the tag names in id order (--labels O,B-PER,...)")
                if not 0 <= t < len(tag_names):
                    raise DataFormatError(path, lineno, f"{key}[{k}]: tag id {t} is out of range for the "
                                                        f"{len(tag_names)} tag names {list(tag_names)}")
                t = tag_names[t]
            names.append(t)
        out.append((lineno, words, names))
    return out


@dataclass
class SquadExample:
    qid: str
    question: str
    context: str
    answers: List[Tuple[str, int]]      # (text, character start)
    is_impossible: bool


def _squad_answer(path: str, lineno: Optional[int], where: str, qid: Any, context: str,
                  text: Any, start: Any) -> Tuple[str, int]:
    try:
        if not isinstance(text, str) or isinstance(start, bool):
            raise TypeError
        start = int(start)
    except (TypeError, ValueError):
        raise DataFormatError(path, lineno, f"{where}: expected a text string and an integer answer_start, "
                                            f"got {text!r} and {start!r}") from None
    if context[start:start + len(text)] != text:
        raise DataFormatError(path, lineno, f"{where} (id {qid}): answer text {text!r} "
                                            f"is not at answer_start {start} of the context")
    return text, start


def read_squad(path: str) -> List[SquadExample]:
    """SQuAD JSON, or JSON lines of questions as ``datasets`` exports SQuAD (see the module docstring)."""
    _require_file(path)
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise _not_utf8(path) from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        if is_json_lines(path):
            return _read_squad_rows(path)
        raise DataFormatError(path, e.lineno, f"invalid JSON ({e.msg})") from None
    if isinstance(doc, dict) and "data" not in doc and "question" in doc:  # JSON lines of one question
        return _read_squad_rows(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise DataFormatError(path, None, "expected SQuAD JSON (an object with a 'data' list) or JSON lines "
                                          "of {id, context, question, answers} objects")
    out: List[SquadExample] = []
    for a, article in enumerate(doc["data"]):
        for p, para in enumerate(article.get("paragraphs", [])):
            where = f"data[{a}].paragraphs[{p}]"
            context = para.get("context")
            if not isinstance(context, str):
                raise DataFormatError(path, None, f"{where}: missing 'context' string")
            for q, qa in enumerate(para.get("qas", [])):
                w = f"{where}.qas[{q}]"
                for key in ("id", "question"):
                    if key not in qa:
                        raise DataFormatError(path, None, f"{w}: missing {key!r}")
                impossible = bool(qa.get("is_impossible", False))
                answers = []
                for k, ans in enumerate(qa.get("answers", [])):
                    if not isinstance(ans, dict):
                        raise DataFormatError(path, None, f"{w}.answers[{k}]: expected text and answer_start")
                    answers.append(_squad_answer(path, None, f"{w}.answers[{k}]", qa["id"], context,
                                                 ans.get("text"), ans.get("answer_start")))
                if not answers and not impossible:
                    raise DataFormatError(path, None, f"{w} (id {qa['id']}): no answers and not is_impossible")
                out.append(SquadExample(str(qa["id"]), qa["question"], context, answers, impossible))
    return out


def _read_squad_rows(path: str) -> List[SquadExample]:
    """One question a line: {id, context, question, answers: {text: [...], answer_start: [...]}}
    (``datasets``' layout; a list of {text, answer_start} is read too); no answers: unanswerable."""
    out: List[SquadExample] = []
    for lineno, row in _read_jsonl(path):
        for key in ("id", "context", "question", "answers"):
            if key not in row:
                raise DataFormatError(path, lineno, f"missing {key!r}: expected a SQuAD row {{id, context, question, "
                                                    f"answers: {{text: [...], answer_start: [...]}}}}")
        for key in ("context", "question"):
            if not isinstance(row[key], str):
                raise DataFormatError(path, lineno, f"{key!r}: expected a string, got {_json_type(row[key])}")
        answers = row["answers"]
        if isinstance(answers, dict) and isinstance(answers.get("text"), list) \
                and isinstance(answers.get("answer_start"), list) \
                and len(answers["text"]) == len(answers["answer_start"]):
            pairs = list(zip(answers["text"], answers["answer_start"]))
        elif isinstance(answers, list) and all(isinstance(a, dict) for a in answers):
            pairs = [(a.get("text"), a.get("answer_start")) for a in answers]
        else:
            raise DataFormatError(path, lineno, f"'answers': expected {{text: [...], answer_start: [...]}} (lists of "
                                                f"equal length), got {json.dumps(answers)[:80]}")
        parsed = [_squad_answer(path, lineno, f"answers[{k}]", row["id"], row["context"], t, s)
                  for k, (t, s) in enumerate(pairs)]
        impossible = bool(row.get("is_impossible", not parsed))
        if not parsed and not impossible:
            raise DataFormatError(path, lineno, f"(id {row['id']}): no answers and not is_impossible")
        out.append(SquadExample(str(row["id"]), row["question"], row["context"], parsed, impossible))
    return out


# =========================================================================== features
def truncate_pair(a: List[int], b: Optional[List[int]], max_tokens: int) -> None:
    """Drop the last token of the longer side until len(a) + len(b) <= max_tokens."""
    while len(a) + (len(b) if b is not None else 0) > max_tokens:
        if b is not None and len(b) > len(a):
            b.pop()
        else:
            a.pop()


def encode_pair(tok: WordPiece, text_a: str, text_b: Optional[str], max_seq_len: int) -> Dict[str, List[int]]:
    a = tok.encode(text_a)
    b = tok.encode(text_b) if text_b is not None else None
    truncate_pair(a, b, max_seq_len - (3 if b is not None else 2))
    ids, types = tok.build_pair(a, b)
    return {"input_ids": ids, "token_type_ids": types}


def pad_batch(features: Sequence[Dict[str, Any]], pad_id: int = 0, keys: Optional[Sequence[str]] = None,
              multiple_of: int = 8) -> Dict[str, torch.Tensor]:
    """Pad list-valued features to the longest (rounded up to ``multiple_of``); adds attention_mask.

    input_ids may be [S] per feature, or [C, S] (multiple choice). Labels that are lists are
    padded with -100; scalars are stacked.
    """
    keys = keys or [k for k in features[0] if not k.startswith("_")]
    first = features[0]["input_ids"]
    nested = isinstance(first[0], list)
    lengths = [len(s) for f in features for s in (f["input_ids"] if nested else [f["input_ids"]])]
    length = -(-max(lengths) // multiple_of) * multiple_of
    out: Dict[str, torch.Tensor] = {}

    def pad(seq, value):
        return list(seq) + [value] * (length - len(seq))

    for key in keys:
        values = [f[key] for f in features]
        if key in ("input_ids", "token_type_ids") or (key == "labels" and isinstance(values[0], list)):
            fill = pad_id if key == "input_ids" else (IGNORE_INDEX if key == "labels" else 0)
            if nested and key != "labels":
                arr = [[pad(s, fill) for s in v] for v in values]
            else:
                arr = [pad(v, fill) for v in values]
            out[key] = torch.tensor(arr, dtype=torch.long)
        else:
            dtype = torch.float32 if isinstance(values[0], float) else torch.long
            out[key] = torch.tensor(values, dtype=dtype)
    if nested:
        out["attention_mask"] = torch.tensor([[pad([1] * len(s), 0) for s in f["input_ids"]] for f in features])
    else:
        out["attention_mask"] = torch.tensor([pad([1] * len(f["input_ids"]), 0) for f in features])
    return out


# --------------------------------------------------------------------------- token classification
def token_classification_features(tok: WordPiece, words: List[str], tags: Optional[List[int]],
                                  max_seq_len: int) -> Dict[str, Any]:
    """Label on each word's first piece (-100 on the rest); ``_word_starts`` maps words to positions."""
    pieces = tok.encode_words(words)
    ids = [tok.cls_id]
    labels = [IGNORE_INDEX]
    starts: List[int] = []
    for w, p in enumerate(pieces):
        if not p:
            p = [tok.unk_id]  # a word the normaliser erases entirely still needs a position
        if len(ids) + len(p) > max_seq_len - 1:
            break  # truncated: the remaining words are predicted "O"
        starts.append(len(ids))
        ids.extend(p)
        labels.append(tags[w] if tags is not None else IGNORE_INDEX)
        labels.extend([IGNORE_INDEX] * (len(p) - 1))
    ids.append(tok.sep_id)
    labels.append(IGNORE_INDEX)
    return {"input_ids": ids, "token_type_ids": [0] * len(ids), "labels": labels, "_word_starts": starts,
            "_num_words": len(words)}


# --------------------------------------------------------------------------- question answering
@dataclass
class QAFeature:
    example_index: int
    input_ids: List[int]
    token_type_ids: List[int]
    start_position: int
    end_position: int
    # character span in the context of each position (None outside the context)
    offsets: List[Optional[Tuple[int, int]]] = field(repr=False)

    def as_inputs(self) -> Dict[str, Any]:
        return {"input_ids": self.input_ids, "token_type_ids": self.token_type_ids,
                "start_positions": self.start_position, "end_positions": self.end_position}


def qa_features(tok: WordPiece, examples: Sequence[SquadExample], max_seq_len: int = 384, doc_stride: int = 128,
                max_query_length: int = 64) -> List[QAFeature]:
    """[CLS] question [SEP] context window [SEP]; windows overlap, moving by ``doc_stride`` tokens.

    Training targets: the answer's first and last token when the answer lies inside the
    window, else position 0 ([CLS], "no answer here"); always 0 for impossible questions.
    """
    feats: List[QAFeature] = []
    for ei, ex in enumerate(examples):
        q = tok.encode(ex.question)[:max_query_length]
        ctx_ids, ctx_offsets = tok.encode_with_offsets(ex.context)
        avail = max_seq_len - len(q) - 3
        if avail < 1:
            raise ValueError(f"max_seq_len {max_seq_len} leaves no room for the context after a "
                             f"{len(q)}-token question; raise it or lower max_query_length")
        tok_start = tok_end = None
        if not ex.is_impossible and ex.answers:
            text, char_start = ex.answers[0]
            char_end = char_start + len(text)
            inside = [i for i, (s, e) in enumerate(ctx_offsets) if e > char_start and s < char_end]
            if inside:
                tok_start, tok_end = inside[0], inside[-1]
        start = 0
        while True:
            length = min(avail, len(ctx_ids) - start)
            window = ctx_ids[start:start + length]
            ids, types = tok.build_pair(q, window)
            offset = len(q) + 2  # position of the window's first token
            offsets: List[Optional[Tuple[int, int]]] = [None] * len(ids)
            for i in range(length):
                offsets[offset + i] = tuple(ctx_offsets[start + i])
            s_pos = e_pos = 0
            if tok_start is not None and tok_start >= start and tok_end < start + length:
                s_pos, e_pos = tok_start - start + offset, tok_end - start + offset
            feats.append(QAFeature(ei, ids, types, s_pos, e_pos, offsets))
            if start + length >= len(ctx_ids):
                break
            start += min(doc_stride, length)
    return feats


def qa_predictions(examples: Sequence[SquadExample], features: Sequence[QAFeature], start_logits: np.ndarray,
                   end_logits: np.ndarray, n_best: int = 20, max_answer_length: int = 30,
                   version_2: bool = False, null_threshold: float = 0.0) -> Tuple[Dict[str, str], Dict[str, float]]:
    """Best span per question over its windows; for v2.0, "" when null score - best > threshold.

    Returns (predictions, score_diff per question: null score minus best span score).
    """
    by_example: Dict[int, List[int]] = {}
    for fi, f in enumerate(features):
        by_example.setdefault(f.example_index, []).append(fi)
    preds: Dict[str, str] = {}
    diffs: Dict[str, float] = {}
    for ei, ex in enumerate(examples):
        best_score, best_span = -np.inf, None
        null_score = np.inf
        for fi in by_example.get(ei, []):
            f = features[fi]
            sl, el = start_logits[fi][:len(f.input_ids)], end_logits[fi][:len(f.input_ids)]
            null_score = min(null_score, float(sl[0] + el[0]))
            valid = [i for i, o in enumerate(f.offsets) if o is not None]
            if not valid:
                continue
            cand_s = sorted(valid, key=lambda i: -sl[i])[:n_best]
            cand_e = sorted(valid, key=lambda i: -el[i])[:n_best]
            for s in cand_s:
                for e in cand_e:
                    if e < s or e - s + 1 > max_answer_length:
                        continue
                    score = float(sl[s] + el[e])
                    if score > best_score:
                        best_score, best_span = score, (f.offsets[s][0], f.offsets[e][1])
        text = ex.context[best_span[0]:best_span[1]] if best_span is not None else ""
        diff = null_score - best_score if best_span is not None else np.inf
        diffs[ex.qid] = float(diff)
        preds[ex.qid] = "" if version_2 and diff > null_threshold else text
    return preds, diffs
