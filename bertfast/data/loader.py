"""Pre-training batches: a deterministic, resumable, rank-aware stream over prepared shards.

The examples of a split are read as an endless stream of epochs; epoch e visits them in the
order ``permutation_e`` (seeded by (seed, e)). Global batch ``t`` is stream positions
``[t*G, (t+1)*G)``, so the data position of a run is just its step, and nothing needs to
be saved beyond it to resume exactly. With W ranks and A accumulation steps the global batch
is cut into W*A micro-batches of M = G / (W*A) examples; rank r takes the A consecutive
micro-batches ``r*A .. r*A + A - 1``. One process with A*W accumulation steps therefore
sees exactly the micro-batches that W processes see together.

Dynamic masking (the default) draws each example's mask from a generator keyed by
(seed, epoch, example index): a new mask every epoch, identical on resume and independent of
batch shapes. Static masking uses the mask stored in the shard.

A micro-batch is a dict of torch tensors, the keyword arguments of ``BertForPreTraining``:
input_ids, token_type_ids, attention_mask [B, L] (L = longest sequence rounded up to
``pad_to_multiple_of``, or the dataset's max_seq_len with ``static_shapes``), labels [B, L]
(-100 except at masked positions) and next_sentence_label [B].

Packed (``pack_tokens``, ``--static-shapes``): the micro-batch's sequences one after another in
one row of exactly ``pack_tokens`` tokens, the keyword arguments of a packed forward:
input_ids, token_type_ids, position_ids, labels [1, T], cu_seq_lens_q [K + 1] int32,
max_length_q (the dataset's max_seq_len, an int) and next_sentence_label [K]. The unused tail
is cut into dummy sequences of at most max_seq_len padding tokens, and K = B + ceil(T / max_seq_len)
slots leave room for any tail: unused slots are empty sequences. Dummy and empty slots have
next-sentence label -100, so nothing but real sequences counts anywhere; every shape is fixed.

``max_predictions`` (the model's static MLM gather size, ``--static-shapes``) is checked here,
on the host: a sequence with more masked labels is a ValueError naming the shard and
sequence (stored masks are checked when the batches are built), never labels dropped.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch

from bertfast.contract import IGNORE_INDEX
from bertfast.data.masking import MaskingConfig, example_rng, mask_sequence
from bertfast.data.shards import PretrainingData
from bertfast.padding import pack_batch


@dataclass
class BatchSpec:
    global_batch_size: int
    micro_batch_size: int
    world_size: int = 1
    rank: int = 0

    def __post_init__(self):
        per_rank = self.global_batch_size // self.world_size
        if self.global_batch_size % self.world_size or per_rank % self.micro_batch_size:
            raise ValueError(
                f"global batch size {self.global_batch_size} must be a multiple of world size "
                f"{self.world_size} x micro batch size {self.micro_batch_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} not in [0, {self.world_size})")

    @property
    def accumulation_steps(self) -> int:
        return self.global_batch_size // (self.world_size * self.micro_batch_size)


class PretrainingBatches:
    """Micro-batches of global step ``t`` for one rank: ``batches.micro_batches(t)``."""

    def __init__(self, data: PretrainingData, spec: BatchSpec, seed: int = 0,
                 masking: Optional[MaskingConfig] = None, pad_to_multiple_of: int = 8,
                 static_shapes: bool = False, shuffle: bool = True, max_predictions: Optional[int] = None,
                 pack_tokens: Optional[int] = None):
        """``max_predictions``: the masked labels per sequence the model will gather (its static
        MLM shape); a sequence with more is an error, not labels silently dropped. ``pack_tokens``:
        pack each micro-batch into one row of this many tokens (see the module docstring)."""
        if len(data) == 0:
            raise ValueError(f"{data.directory!r} split {data.split!r} has no examples")
        if not data.static_masking and masking is None:
            raise ValueError("the dataset is not statically masked: pass a MaskingConfig")
        self.data = data
        self.spec = spec
        self.seed = int(seed)
        self.masking = masking
        self.pad_to_multiple_of = max(1, int(pad_to_multiple_of))
        self.static_shapes = static_shapes
        self.shuffle = shuffle
        self.pad_id = int(data.special_ids["pad"])
        self._perm_cache: Dict[int, np.ndarray] = {}
        self.max_predictions = None if max_predictions is None else int(max_predictions)
        self.pack_tokens = None if pack_tokens is None else int(pack_tokens)
        if self.pack_tokens is not None and self.pack_tokens < data.max_seq_len:
            raise ValueError(f"pack_tokens: expected at least max_seq_len ({data.max_seq_len}) tokens per micro-batch, "
                             f"got {self.pack_tokens}")
        if self.max_predictions is not None:
            if self.max_predictions < 1:
                raise ValueError(f"max_predictions must be >= 1, got {self.max_predictions}")
            if data.static_masking:
                self._check_static_counts()

    def _too_many_labels(self, index: int, count: int, most: Optional[int] = None) -> ValueError:
        shard, j = self.data.locate(index)
        if self.data.static_masking:
            most = most or int(self.data.index.get("max_predictions_per_seq") or count)
            fix = (f"raise --max-predictions-per-seq to {most} or more, or re-prepare the data with "
                   f"`bertfast prepare --static-masking --max-predictions-per-seq {self.max_predictions}`")
        else:
            fix = f"cap the masking at MaskingConfig(max_predictions_per_seq={self.max_predictions})"
        return ValueError(
            f"{self.data.directory}: split {self.data.split!r} shard {shard.name} sequence {j} (example {index}) "
            f"has {count} masked labels, more than the {self.max_predictions} predictions per sequence the model "
            f"gathers (max_predictions_per_seq); the rest would be dropped silently: {fix}")

    def _out_of_vocabulary(self, index: int, token: int) -> ValueError:
        shard, j = self.data.locate(index)
        return ValueError(
            f"{self.data.directory}: split {self.data.split!r} shard {shard.name} sequence {j} (example {index}) "
            f"holds token id {token}, outside the data's {self.data.vocab_size}-word vocabulary (index.json): the "
            f"shard was written with another vocabulary or is damaged; prepare the data again (bertfast prepare)")

    def _check_static_counts(self) -> None:
        """Stored masks over the limit fail here, before training (read only when the cap the data
        was prepared with is above the limit: the counts are one small array per shard)."""
        prepared = self.data.index.get("max_predictions_per_seq")
        if prepared is not None and int(prepared) <= self.max_predictions:
            return
        for k, shard in enumerate(self.data.shards):
            if shard.mlm_count is None or not len(shard):
                continue
            over = np.flatnonzero(np.asarray(shard.mlm_count) > self.max_predictions)
            if len(over):
                most = max(int(np.max(s.mlm_count)) for s in self.data.shards if s.mlm_count is not None and len(s))
                first = int(over[0])
                raise self._too_many_labels(int(self.data.starts[k]) + first, int(shard.mlm_count[first]), most)

    @property
    def steps_per_epoch(self) -> float:
        return len(self.data) / self.spec.global_batch_size

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._perm_cache.get(epoch)
        if perm is None:
            if self.shuffle:
                bits = np.random.Philox(key=[self.seed & (2**64 - 1), 0x5EED], counter=[0, 0, 0, epoch])
                perm = np.random.Generator(bits).permutation(len(self.data))
            else:
                perm = np.arange(len(self.data))
            self._perm_cache = {epoch: perm}  # keep one epoch; steps move forward
            perm = self._perm_cache[epoch]
        return perm

    def stream_items(self, start: int, count: int):
        """(epoch, example index) of stream positions [start, start + count)."""
        n = len(self.data)
        out = []
        for p in range(start, start + count):
            epoch = p // n
            out.append((epoch, int(self._permutation(epoch)[p % n])))
        return out

    def rank_items(self, step: int):
        spec = self.spec
        per_rank = spec.global_batch_size // spec.world_size
        start = step * spec.global_batch_size + spec.rank * per_rank
        return self.stream_items(start, per_rank)

    def micro_batches(self, step: int) -> List[Dict[str, torch.Tensor]]:
        items = self.rank_items(step)
        m = self.spec.micro_batch_size
        return [self.collate(items[i:i + m]) for i in range(0, len(items), m)]

    def example(self, epoch: int, index: int):
        ids, a_len, nsp, static = self.data.example(index)
        top = int(ids.max()) if len(ids) else -1  # a few hundred ids: cheap, and never a raw IndexError
        if top >= self.data.vocab_size:
            raise self._out_of_vocabulary(index, top)
        if static is not None:
            positions, labels = static
        else:
            ids, positions, labels = mask_sequence(ids, self.masking, example_rng(self.seed, epoch, index))
        # Host-side (numpy) check of what the model's fixed-size gather would drop: no device sync.
        if self.max_predictions is not None and len(positions) > self.max_predictions:
            raise self._too_many_labels(index, len(positions))
        return ids, a_len, nsp, positions, labels

    def collate(self, items) -> Dict[str, Any]:
        examples = [self.example(e, i) for e, i in items]
        batch = self._padded(examples)
        if self.pack_tokens is None:
            return batch
        used = int(batch["attention_mask"].sum())
        if used > self.pack_tokens:
            shard, j = self.data.locate(items[0][1])
            raise ValueError(f"{self.data.directory}: a micro-batch of {len(examples)} sequences (the first: shard "
                             f"{shard.name} sequence {j}) holds {used} tokens, more than the {self.pack_tokens} of "
                             f"its packed row (pack_tokens): raise pack_tokens or lower the micro batch size")
        return pack_batch(batch, self.pack_tokens, self.data.max_seq_len)

    def _padded(self, examples) -> Dict[str, torch.Tensor]:
        if self.static_shapes:
            length = self.data.max_seq_len
        else:
            longest = max(len(ex[0]) for ex in examples)
            k = self.pad_to_multiple_of
            length = min(-(-longest // k) * k, max(self.data.max_seq_len, longest))
        b = len(examples)
        input_ids = np.full((b, length), self.pad_id, dtype=np.int64)
        token_type = np.zeros((b, length), dtype=np.int64)
        attention = np.zeros((b, length), dtype=np.int64)
        labels = np.full((b, length), IGNORE_INDEX, dtype=np.int64)
        nsp = np.zeros(b, dtype=np.int64)
        for r, (ids, a_len, nsp_label, positions, lab) in enumerate(examples):
            n = len(ids)
            input_ids[r, :n] = ids
            token_type[r, a_len:n] = 1
            attention[r, :n] = 1
            labels[r, positions] = lab
            nsp[r] = nsp_label
        return {"input_ids": torch.from_numpy(input_ids), "token_type_ids": torch.from_numpy(token_type),
                "attention_mask": torch.from_numpy(attention), "labels": torch.from_numpy(labels),
                "next_sentence_label": torch.from_numpy(nsp)}


def sequence_lengths(batch: Dict[str, Any]) -> torch.Tensor:
    """Tokens of each slot of a micro-batch, 0 for a packed row's dummy and empty slots (on the batch's device)."""
    if "cu_seq_lens_q" not in batch:
        return batch["attention_mask"].sum(1)
    real = batch["next_sentence_label"] != IGNORE_INDEX
    return batch["cu_seq_lens_q"].diff() * real


def masking_config_for(data: PretrainingData, id_to_token: Optional[List[str]] = None,
                       mlm_prob: Optional[float] = None, max_predictions_per_seq: Optional[int] = None,
                       whole_word: Optional[bool] = None) -> MaskingConfig:
    """The masking settings recorded in a dataset's index (each overridable)."""
    from bertfast.data.masking import continuation_flags
    idx = data.index
    sp = data.special_ids
    whole_word = bool(idx.get("whole_word_masking", False)) if whole_word is None else whole_word
    return MaskingConfig(
        vocab_size=data.vocab_size, mask_id=int(sp["mask"]),
        special_ids=tuple(sorted({int(v) for v in sp.values()})),
        mlm_prob=float(idx.get("masked_lm_prob", 0.15)) if mlm_prob is None else mlm_prob,
        max_predictions_per_seq=max_predictions_per_seq,
        whole_word=whole_word,
        continuation=continuation_flags(id_to_token) if whole_word and id_to_token is not None else None)


class Prefetcher:
    """Builds the micro-batches of upcoming steps in a background thread (order kept)."""

    def __init__(self, fn, start_step: int, depth: int = 2, pin_memory: bool = False):
        self.fn = fn
        self.pin_memory = pin_memory
        self.q: "queue.Queue" = queue.Queue(maxsize=depth)
        self.next_step = start_step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(start_step,), daemon=True)
        self._thread.start()

    def _run(self, step: int) -> None:
        while not self._stop.is_set():
            try:
                batches = self.fn(step)
                if self.pin_memory:
                    batches = [{k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in mb.items()}
                               for mb in batches]
                item = (step, batches, None)
            except BaseException as e:  # surfaced in the consumer
                item = (step, None, e)
            while not self._stop.is_set():
                try:
                    self.q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return
            step += 1

    def get(self, step: int):
        got_step, batches, err = self.q.get()
        if err is not None:
            raise err
        if got_step != step:
            raise RuntimeError(f"prefetcher out of order: wanted step {step}, got {got_step}")
        return batches

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __iter__(self) -> Iterator:  # pragma: no cover - convenience
        while True:
            yield self.get(self.next_step)
            self.next_step += 1
