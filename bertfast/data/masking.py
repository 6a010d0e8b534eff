"""Masked-LM corruption (the paper's 15% / 80-10-10 rule), for one sequence at a time.

Per sequence: the candidates are the non-special tokens (not [CLS], [SEP], [PAD], [MASK]);
``num_to_predict = min(max_predictions_per_seq, max(1, round(len(candidates) * mlm_prob)))``
positions are chosen uniformly without replacement (whole words at a time with
``whole_word``: a piece starting with "##" joins the previous piece's word). Each chosen
token becomes [MASK] with probability 0.8, a uniformly random non-special token with 0.1,
and stays unchanged with 0.1; its original id is the label. Positions come back sorted.

Randomness comes from a ``numpy.random.Generator`` passed in; the loaders derive one per
example from (seed, epoch, example index), so a mask is a pure function of those three
numbers: independent of batch size, worker count, rank, and of where a run was resumed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np


@dataclass(frozen=True)
class MaskingConfig:
    vocab_size: int
    mask_id: int
    special_ids: Tuple[int, ...]
    mlm_prob: float = 0.15
    max_predictions_per_seq: Optional[int] = None
    whole_word: bool = False
    # word-continuation flags per vocabulary id (True for "##..." pieces); needed for whole_word
    continuation: Optional[np.ndarray] = None

    def __post_init__(self):
        if not 0.0 < self.mlm_prob < 1.0:
            raise ValueError(f"mlm_prob must be in (0, 1), got {self.mlm_prob}")
        if self.whole_word and self.continuation is None:
            raise ValueError("whole_word masking needs the vocabulary's continuation flags")

    @property
    def random_token_ids(self) -> np.ndarray:
        ids = getattr(self, "_random_ids", None)
        if ids is None:
            ids = np.setdiff1d(np.arange(self.vocab_size, dtype=np.int64),
                               np.asarray(self.special_ids, dtype=np.int64))
            object.__setattr__(self, "_random_ids", ids)
        return ids

    @property
    def special_lookup(self) -> np.ndarray:
        table = getattr(self, "_special_table", None)
        if table is None:
            table = np.zeros(self.vocab_size, dtype=bool)
            table[np.asarray(self.special_ids, dtype=np.int64)] = True
            object.__setattr__(self, "_special_table", table)
        return table


def continuation_flags(id_to_token: Sequence[str]) -> np.ndarray:
    return np.array([t.startswith("##") for t in id_to_token], dtype=bool)


def example_rng(seed: int, epoch: int, index: int, stream: int = 0) -> np.random.Generator:
    """The generator for one example: a pure function of (seed, epoch, index, stream)."""
    # Philox: the key holds (seed, stream); the example sits in the high counter words, so
    # the low word that advances while drawing never reaches another example's stream.
    key = [int(seed) & (2**64 - 1), int(stream) & (2**64 - 1)]
    counter = [0, 0, int(index) & (2**64 - 1), int(epoch) & (2**64 - 1)]
    return np.random.Generator(np.random.Philox(key=key, counter=counter))


def mask_sequence(ids: np.ndarray, cfg: MaskingConfig,
                  rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Corrupt one sequence. Returns (masked ids [S], positions [P] int64 sorted, labels [P] int64)."""
    ids = np.asarray(ids)
    is_special = cfg.special_lookup[ids]
    candidates = np.flatnonzero(~is_special)
    n_cand = len(candidates)
    if n_cand == 0:
        return ids.copy(), np.zeros(0, np.int64), np.zeros(0, np.int64)
    num_to_predict = max(1, int(round(n_cand * cfg.mlm_prob)))
    if cfg.max_predictions_per_seq is not None:
        num_to_predict = min(num_to_predict, cfg.max_predictions_per_seq)

    if not cfg.whole_word:
        chosen = np.sort(rng.permutation(candidates)[:num_to_predict])
    else:
        # Group candidates into words: a "##" piece continues the word of the piece before it.
        cont = cfg.continuation[ids[candidates]]
        prev_is_cand = np.concatenate([[False], np.diff(candidates) == 1])
        starts = ~(cont & prev_is_cand)
        word_id = np.cumsum(starts) - 1
        n_words = int(word_id[-1]) + 1
        picked = []
        total = 0
        for w in rng.permutation(n_words):
            members = candidates[word_id == w]
            if total + len(members) > num_to_predict:
                continue
            picked.append(members)
            total += len(members)
            if total >= num_to_predict:
                break
        chosen = np.sort(np.concatenate(picked)) if picked else np.zeros(0, np.int64)

    labels = ids[chosen].astype(np.int64)
    out = ids.copy()
    r = rng.random(len(chosen))
    to_mask = r < 0.8
    to_random = (r >= 0.8) & (r < 0.9)
    out[chosen[to_mask]] = cfg.mask_id
    n_random = int(to_random.sum())
    if n_random:
        pool = cfg.random_token_ids
        out[chosen[to_random]] = pool[rng.integers(0, len(pool), size=n_random)]
    return out, chosen.astype(np.int64), labels
