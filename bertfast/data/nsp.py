"""Next-sentence-prediction examples, built the way the original BERT pipeline builds them.

For each document (a list of tokenised segments), with ``max_num_tokens = max_seq_len - 3``
(room for [CLS], [SEP], [SEP]):

  1. target length: ``max_num_tokens``, or with probability ``short_seq_prob`` a random
     length in [2, max_num_tokens] (drawn once per document, as the original does), so
     the model also sees short sequences;
  2. whole segments are accumulated into a chunk until it reaches the target length
     (or the document ends);
  3. sentence A = the first ``a_end`` segments of the chunk, ``a_end`` uniform in
     [1, len(chunk) - 1] (1 when the chunk has one segment);
  4. with probability 1/2 (always, when the chunk has one segment) B is a random span:
     segments from a random start in another random document, until B reaches the target
     length minus len(A); the chunk's unused segments are put back (the walk resumes at
     them). Otherwise B is the rest of the chunk (the real continuation);
  5. the pair is truncated to max_num_tokens by repeatedly removing one token from the
     longer of A and B, from its front or its back with equal probability.

NSP label: 0 = IsNext (B follows A), 1 = NotNext (B random).

Documents are held as a ``TokenizedCorpus``: flat token ids, segment offsets and document
offsets (numpy, memory-mappable), so worker processes share one copy.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np


@dataclass
class TokenizedCorpus:
    tokens: np.ndarray        # [num_tokens] uint16/uint32: all segments' ids back to back
    seg_offsets: np.ndarray   # [num_segments + 1] int64: segment s is tokens[seg_offsets[s]:seg_offsets[s+1]]
    doc_offsets: np.ndarray   # [num_docs + 1] int64: document d is segments doc_offsets[d]:doc_offsets[d+1]

    @property
    def num_docs(self) -> int:
        return len(self.doc_offsets) - 1

    def document(self, d: int) -> List[np.ndarray]:
        s0, s1 = int(self.doc_offsets[d]), int(self.doc_offsets[d + 1])
        offs = self.seg_offsets[s0:s1 + 1]
        return [self.tokens[offs[i]:offs[i + 1]] for i in range(s1 - s0)]


@dataclass
class Instance:
    tokens_a: List[int]
    tokens_b: List[int]
    is_random_next: bool


def truncate_seq_pair(tokens_a: List[int], tokens_b: List[int], max_num_tokens: int,
                      rng: random.Random) -> None:
    """Trim the longer list, from a random end, one token at a time, until the pair fits.

    The original removes one token per draw (``del longer[0]``: quadratic on a long line);
    here the draws only move [start, end) bounds, one slice at the end applies them, so
    the same tokens go, with the same draws from ``rng``, in linear time.
    """
    a0, a1, b0, b1 = 0, len(tokens_a), 0, len(tokens_b)
    while (a1 - a0) + (b1 - b0) > max_num_tokens:
        front = rng.random() < 0.5
        if a1 - a0 > b1 - b0:
            a0, a1 = (a0 + 1, a1) if front else (a0, a1 - 1)
        else:
            b0, b1 = (b0 + 1, b1) if front else (b0, b1 - 1)
    if (a0, a1) != (0, len(tokens_a)):
        tokens_a[:] = tokens_a[a0:a1]
    if (b0, b1) != (0, len(tokens_b)):
        tokens_b[:] = tokens_b[b0:b1]


def _concat(segments: Sequence[np.ndarray]) -> List[int]:
    out: List[int] = []
    for seg in segments:
        out.extend(seg.tolist())
    return out


def instances_from_document(corpus: TokenizedCorpus, doc_index: int, max_seq_len: int,
                            short_seq_prob: float, rng: random.Random,
                            random_doc_pool: Optional[np.ndarray] = None) -> List[Instance]:
    """All NSP instances of one document (steps 1-5 of the module docstring).

    ``random_doc_pool``: the documents B may be drawn from when random (default: all).
    """
    document = corpus.document(doc_index)
    max_num_tokens = max_seq_len - 3
    if max_num_tokens < 2:
        raise ValueError(f"max_seq_len must be at least 5, got {max_seq_len}")
    target_seq_length = max_num_tokens
    if rng.random() < short_seq_prob:
        target_seq_length = rng.randint(2, max_num_tokens)

    pool_size = corpus.num_docs if random_doc_pool is None else len(random_doc_pool)
    instances: List[Instance] = []
    chunk: List[np.ndarray] = []
    chunk_len = 0
    i = 0
    while i < len(document):
        chunk.append(document[i])
        chunk_len += len(document[i])
        if i == len(document) - 1 or chunk_len >= target_seq_length:
            if chunk:
                a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
                tokens_a = _concat(chunk[:a_end])
                tokens_b: List[int] = []
                if len(chunk) == 1 or rng.random() < 0.5:
                    is_random_next = True
                    target_b_length = target_seq_length - len(tokens_a)
                    # Another document; a corpus of one document can only pair with itself.
                    random_doc = doc_index
                    for _ in range(10):
                        pick = rng.randint(0, pool_size - 1)
                        random_doc = pick if random_doc_pool is None else int(random_doc_pool[pick])
                        if random_doc != doc_index:
                            break
                    other = corpus.document(random_doc)
                    start = rng.randint(0, len(other) - 1)
                    for j in range(start, len(other)):
                        tokens_b.extend(other[j].tolist())
                        if len(tokens_b) >= target_b_length:
                            break
                    # The chunk's segments after A were not used: walk back over them.
                    i -= len(chunk) - a_end
                else:
                    is_random_next = False
                    tokens_b = _concat(chunk[a_end:])
                truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
                if tokens_a and tokens_b:
                    instances.append(Instance(tokens_a, tokens_b, is_random_next))
            chunk = []
            chunk_len = 0
        i += 1
    return instances
