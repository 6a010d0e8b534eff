"""WordPiece tokenisation on Hugging Face ``tokenizers`` (the Rust implementation, offline).

``WordPiece.from_pretrained(path)`` reads a ``vocab.txt`` (or a checkpoint directory that
holds one; ``tokenizer_config.json``'s ``do_lower_case`` is honoured when present).
``WordPiece.train(texts, vocab_size)`` learns a new vocabulary with the special tokens
[PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4. ``save(dir)`` writes vocab.txt plus the two
small JSON files that make the directory loadable by transformers' ``BertTokenizer``.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, List, Optional, Sequence

from bertfast.data.textfile import non_utf8_error

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _require_tokenizers():
    try:
        import tokenizers  # noqa: F401
        from tokenizers import BertWordPieceTokenizer
    except ImportError as e:  # pragma: no cover - tokenizers is a declared extra
        raise ImportError("bertfast data preparation needs the 'tokenizers' package "
                          "(pip install 'bertfast[train]')") from e
    return BertWordPieceTokenizer


def find_vocab_file(path: str) -> str:
    """``path`` itself if it is a file, else ``path/vocab.txt``; a clear error when missing."""
    if os.path.isdir(path):
        candidate = os.path.join(path, "vocab.txt")
        if not os.path.isfile(candidate):
            raise FileNotFoundError(f"no vocab.txt in directory {path!r}")
        return candidate
    if not os.path.isfile(path):
        raise FileNotFoundError(f"vocabulary file {path!r} does not exist")
    return path


VOCAB_FORMAT = "UTF-8 text, one word piece per line"


def read_vocab(vocab_file: str) -> List[str]:
    """The word pieces of a vocab.txt in id order; a ValueError naming ``path:line`` when it is
    not one (binary data, not UTF-8, empty)."""
    try:
        with open(vocab_file, encoding="utf-8") as f:
            tokens = [line.rstrip("\n") for line in f]
    except UnicodeDecodeError:
        line, message = non_utf8_error(vocab_file, VOCAB_FORMAT)
        raise ValueError(f"{vocab_file}:{line}: not a vocabulary file: {message}") from None
    for lineno, tok in enumerate(tokens, 1):
        if "\x00" in tok:  # valid UTF-8, but no text file holds NUL bytes
            raise ValueError(f"{vocab_file}:{lineno}: not a vocabulary file: expected {VOCAB_FORMAT}, "
                             f"found binary data (NUL bytes)")
    while tokens and tokens[-1] == "":
        tokens.pop()
    if not tokens:
        raise ValueError(f"{vocab_file}: empty vocabulary: expected {VOCAB_FORMAT}, "
                         f"including {' '.join(SPECIAL_TOKENS)}")
    return tokens


class WordPiece:
    """A BERT WordPiece tokenizer: ids for segments, pairs, pre-split words; special-token ids."""

    def __init__(self, backend, lowercase: bool):
        self.backend = backend  # tokenizers.BertWordPieceTokenizer
        self.lowercase = lowercase
        vocab = backend.get_vocab()
        self.id_to_token: List[str] = [""] * (max(vocab.values()) + 1)
        for tok, i in vocab.items():
            self.id_to_token[i] = tok
        missing = [t for t in SPECIAL_TOKENS if t not in vocab]
        if missing:
            raise ValueError(f"vocabulary lacks the special tokens {missing}")
        self.pad_id = vocab["[PAD]"]
        self.unk_id = vocab["[UNK]"]
        self.cls_id = vocab["[CLS]"]
        self.sep_id = vocab["[SEP]"]
        self.mask_id = vocab["[MASK]"]

    # -- construction ------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, lowercase: Optional[bool] = None) -> "WordPiece":
        vocab_file = find_vocab_file(path)
        tokens = read_vocab(vocab_file)  # checked here: the backend's errors name no file
        missing = [t for t in SPECIAL_TOKENS if t not in set(tokens)]
        if missing:
            raise ValueError(f"{vocab_file}: the vocabulary lacks the special tokens {' '.join(missing)} "
                             f"(expected a BERT vocab.txt: {VOCAB_FORMAT}, {len(tokens)} lines found)")
        if lowercase is None:
            lowercase = _lowercase_from_config(os.path.dirname(os.path.abspath(vocab_file)))
        if lowercase is None:
            # No config: a vocabulary without upper-case word pieces is an uncased one.
            lowercase = not any(t.strip("#")[:1].isupper() for t in tokens
                                if not (t.startswith("[") and t.endswith("]")))
        BertWordPieceTokenizer = _require_tokenizers()
        backend = BertWordPieceTokenizer(vocab_file, lowercase=lowercase,
                                         strip_accents=None if lowercase else False)
        return cls(backend, lowercase)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, lowercase: bool = True,
              min_frequency: int = 2, limit_alphabet: Optional[int] = None,
              show_progress: bool = False) -> "WordPiece":
        BertWordPieceTokenizer = _require_tokenizers()
        if vocab_size < len(SPECIAL_TOKENS) + 26:
            raise ValueError(f"vocab_size {vocab_size} is too small for a WordPiece vocabulary")
        backend = BertWordPieceTokenizer(lowercase=lowercase, strip_accents=None if lowercase else False)
        if limit_alphabet is None:
            # Leave at least half of a small vocabulary for multi-character pieces.
            limit_alphabet = max(26, min(1000, vocab_size // 4))
        backend.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=min_frequency,
                                    limit_alphabet=limit_alphabet, special_tokens=list(SPECIAL_TOKENS),
                                    show_progress=show_progress)
        return cls(backend, lowercase)

    def save(self, directory: str) -> str:
        """Write vocab.txt, tokenizer_config.json and special_tokens_map.json; returns vocab.txt's path."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "vocab.txt")
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for tok in self.id_to_token:
                f.write(tok + "\n")
        os.replace(tmp, path)
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump({"tokenizer_class": "BertTokenizer", "do_lower_case": self.lowercase,
                       "model_max_length": 512}, f, indent=2)
        with open(os.path.join(directory, "special_tokens_map.json"), "w", encoding="utf-8") as f:
            json.dump({"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]",
                       "sep_token": "[SEP]", "mask_token": "[MASK]"}, f, indent=2)
        return path

    # -- properties --------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.id_to_token)

    @property
    def special_ids(self) -> List[int]:
        return sorted({self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id})

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> List[str]:
        return [self.id_to_token[int(i)] for i in ids]

    def token_to_id(self, token: str) -> Optional[int]:
        return self.backend.token_to_id(token)

    # -- encoding ----------------------------------------------------------------
    def encode_segments(self, texts: Sequence[str]) -> List[List[int]]:
        """Token ids of each text, without special tokens (batched in Rust)."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def encode(self, text: str) -> List[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str):
        """(ids, offsets) of ``text`` without special tokens; offsets are (start, end) characters."""
        e = self.backend.encode(text, add_special_tokens=False)
        return e.ids, e.offsets

    def encode_words(self, words: Sequence[str]) -> List[List[int]]:
        """Ids of each pre-split word (a word can become several pieces, or none if it is blank)."""
        if not words:
            return []
        e = self.backend.encode(list(words), is_pretokenized=True, add_special_tokens=False)
        out: List[List[int]] = [[] for _ in words]
        for tok_id, word in zip(e.ids, e.word_ids):
            if word is not None:
                out[word].append(tok_id)
        return out

    def build_pair(self, ids_a: Sequence[int], ids_b: Optional[Sequence[int]] = None):
        """[CLS] A [SEP] (B [SEP]) and its token_type ids."""
        ids = [self.cls_id, *ids_a, self.sep_id]
        types = [0] * len(ids)
        if ids_b is not None:
            ids += [*ids_b, self.sep_id]
            types += [1] * (len(ids_b) + 1)
        return ids, types

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode(list(ids))


def _lowercase_from_config(directory: str) -> Optional[bool]:
    path = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                value = json.load(f).get("do_lower_case")
            return None if value is None else bool(value)
        except (OSError, ValueError):
            return None
    return None


def vocab_fingerprint(vocab_file: str, lowercase: bool) -> str:
    import hashlib
    h = hashlib.sha256()
    with open(vocab_file, "rb") as f:
        h.update(f.read())
    h.update(b"lower" if lowercase else b"cased")
    return h.hexdigest()[:16]
