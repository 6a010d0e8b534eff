"""Binary pre-training shards: memory-mapped numpy arrays plus a JSON index.

Layout of a prepared dataset directory::

    index.json                 format, settings, vocabulary facts, the shards of each split
    vocab.txt (+ tokenizer json files)
    train-00000/ ...           one directory per shard, written to a temp name then renamed
        input_ids.npy          [num_tokens] uint16 (vocab <= 65536) or uint32: every example's
                               [CLS] A [SEP] B [SEP], back to back (already masked if static)
        offsets.npy            [N + 1] int64: example i is input_ids[offsets[i]:offsets[i+1]]
        a_len.npy              [N] uint16: tokens of type 0 ([CLS] A [SEP]); the rest are type 1
        nsp.npy                [N] uint8: 0 = IsNext, 1 = NotNext
        mlm_positions.npy      [N, P] uint16   (static masking only; P = max_predictions_per_seq,
        mlm_labels.npy         [N, P] id dtype  rows padded after mlm_count[i] entries)
        mlm_count.npy          [N] uint16
        meta.json              num_examples, num_tokens, settings hash (a shard whose hash
                               differs from the run's is rebuilt)

A shard directory exists only once complete (atomic rename), so a rerun of ``prepare``
skips every shard that is already there.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

from bertfast.data.textfile import non_utf8_error

FORMAT = "bertfast-pretraining-v1"
INDEX_FILE = "index.json"


def id_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a writer whose temporary files must be left alone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def fsync_dir(path: str) -> None:
    """fsync a directory so a rename inside it survives a crash (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _save_npy(directory: str, name: str, array: np.ndarray) -> None:
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def write_json_atomic(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def shard_is_complete(directory: str, settings_hash: str) -> bool:
    meta_path = os.path.join(directory, "meta.json")
    if not os.path.isfile(meta_path):
        return False
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    return meta.get("settings_hash") == settings_hash


def write_shard(directory: str, arrays: Dict[str, np.ndarray], meta: dict) -> None:
    """Write the arrays and meta.json into a temp directory, fsync, then rename into place."""
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    tmp = directory + f".tmp-{os.getpid()}"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    for name, array in arrays.items():
        _save_npy(tmp, name + ".npy", array)
    with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    if os.path.exists(directory):  # a stale shard from other settings
        shutil.rmtree(directory)
    os.rename(tmp, directory)
    fsync_dir(parent)


@dataclass
class Shard:
    name: str
    input_ids: np.ndarray
    offsets: np.ndarray
    a_len: np.ndarray
    nsp: np.ndarray
    mlm_positions: Optional[np.ndarray] = None
    mlm_labels: Optional[np.ndarray] = None
    mlm_count: Optional[np.ndarray] = None

    @classmethod
    def open(cls, directory: str) -> "Shard":
        def load(name: str, required: bool = True):
            path = os.path.join(directory, name + ".npy")
            if not os.path.isfile(path):
                if required:
                    raise FileNotFoundError(f"shard {directory!r} lacks {name}.npy (incomplete or "
                                            f"not a bertfast shard; rerun `bertfast prepare`)")
                return None
            try:
                return np.load(path, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError, EOFError) as e:
                raise ValueError(f"{path}: expected a numpy .npy array, cannot read it ({e}); "
                                 f"rerun `bertfast prepare`") from None

        shard = cls(os.path.basename(directory), load("input_ids"), load("offsets"), load("a_len"),
                    load("nsp"), load("mlm_positions", False), load("mlm_labels", False),
                    load("mlm_count", False))
        n = len(shard.nsp)
        sizes = {"offsets": (len(shard.offsets), n + 1), "a_len": (len(shard.a_len), n)}
        if shard.mlm_count is not None:
            sizes.update(mlm_count=(len(shard.mlm_count), n), mlm_positions=(len(shard.mlm_positions), n),
                         mlm_labels=(len(shard.mlm_labels), n))
        for name, (got, expected) in sizes.items():
            if got != expected:
                raise ValueError(f"{os.path.join(directory, name + '.npy')}: expected {expected} entries for the "
                                 f"{n} examples of nsp.npy, found {got} (a damaged shard: rerun `bertfast prepare`)")
        if n and int(shard.offsets[-1]) != len(shard.input_ids):
            raise ValueError(f"{os.path.join(directory, 'offsets.npy')}: the last offset {int(shard.offsets[-1])} "
                             f"is not the {len(shard.input_ids)} tokens of input_ids.npy (a damaged shard)")
        return shard

    def __len__(self) -> int:
        return len(self.nsp)


class MissingSplitError(ValueError):
    """The dataset has no shards for the split asked for (a held-out set is optional)."""


def _line_of_key(text: str, key: str) -> Optional[int]:
    """Line of the first ``"key":`` in ``text`` (the index is written one key per line)."""
    needle = json.dumps(key) + ":"
    for lineno, line in enumerate(text.splitlines(), 1):
        if needle in line:
            return lineno
    return None


def read_index(index_path: str) -> dict:
    """A prepared dataset's index.json, checked; errors name ``path:line`` and what was expected."""
    try:
        with open(index_path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        line, message = non_utf8_error(index_path, "the JSON index written by `bertfast prepare`")
        raise ValueError(f"{index_path}:{line}: {message}") from None
    try:
        index = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{index_path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno}); expected the "
                         f"index written by `bertfast prepare` (rerun it)") from None
    if not isinstance(index, dict):
        raise ValueError(f"{index_path}: expected a JSON object (the index written by `bertfast prepare`), "
                         f"got a JSON {type(index).__name__}")
    if index.get("format") != FORMAT:
        raise ValueError(f"{index_path}: unknown format {index.get('format')!r}, expected {FORMAT!r}")

    def bad(key: str, expected: str):
        line = _line_of_key(text, key)
        where = f"{index_path}:{line}" if line else index_path
        got = f"got {index[key]!r}" if key in index else "it is missing"
        return ValueError(f"{where}: {key!r}: expected {expected}, {got}")

    splits = index.get("splits")
    if not isinstance(splits, dict) or not all(
            isinstance(v, list) and all(isinstance(n, str) for n in v) for v in splits.values()):
        raise bad("splits", "an object of split name -> list of shard directory names")
    for key in ("max_seq_len", "vocab_size"):
        if not isinstance(index.get(key), int) or isinstance(index[key], bool) or index[key] < 1:
            raise bad(key, "a positive integer")
    special = index.get("special_ids")
    names = ("pad", "unk", "cls", "sep", "mask")
    if not isinstance(special, dict) or not all(isinstance(special.get(k), int) for k in names):
        raise bad("special_ids", f"an object with integer ids for {', '.join(names)}")
    cap = index.get("max_predictions_per_seq")
    if index.get("static_masking") and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
        raise bad("max_predictions_per_seq", "a positive integer (the dataset is statically masked)")
    return index


def dataset_index(directory: str) -> dict:
    """The checked index of a prepared directory (read_index), without opening its shards."""
    index_path = os.path.join(directory, INDEX_FILE)
    if not os.path.isfile(index_path):
        raise FileNotFoundError(f"{directory!r} is not a prepared pre-training dataset "
                                f"(no {INDEX_FILE}); run `bertfast prepare` first")
    return read_index(index_path)


class PretrainingData:
    """All shards of one split of a prepared directory, indexed 0..N-1 across shards."""

    def __init__(self, directory: str, split: str = "train"):
        index_path = os.path.join(directory, INDEX_FILE)
        self.index = dataset_index(directory)
        names: List[str] = self.index["splits"].get(split, [])
        if not names:
            raise MissingSplitError(f"{directory!r} has no shards for split {split!r}")
        self.directory = directory
        self.split = split
        self.shards = [Shard.open(os.path.join(directory, n)) for n in names]
        counts = np.array([len(s) for s in self.shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        self.max_seq_len: int = int(self.index["max_seq_len"])
        self.vocab_size: int = int(self.index["vocab_size"])
        self.static_masking: bool = bool(self.index.get("static_masking", False))
        if self.static_masking and any(s.mlm_count is None for s in self.shards):
            raise ValueError(f"{index_path}: the index says static_masking but a shard of split {split!r} has no "
                             f"stored masks (mlm_*.npy); rerun `bertfast prepare`")

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def special_ids(self) -> Dict[str, int]:
        return self.index["special_ids"]

    def locate(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(f"example {i} out of range [0, {len(self)})")
        s = int(np.searchsorted(self.starts, i, side="right") - 1)
        return self.shards[s], i - int(self.starts[s])

    def example(self, i: int):
        """(ids int64 [S], a_len, nsp label, (static positions, labels) or None)."""
        shard, j = self.locate(i)
        ids = np.asarray(shard.input_ids[shard.offsets[j]:shard.offsets[j + 1]], dtype=np.int64)
        static = None
        if shard.mlm_positions is not None:
            n = int(shard.mlm_count[j])
            static = (np.asarray(shard.mlm_positions[j, :n], dtype=np.int64),
                      np.asarray(shard.mlm_labels[j, :n], dtype=np.int64))
        return ids, int(shard.a_len[j]), int(shard.nsp[j]), static


def pack_examples(examples: Sequence[tuple], vocab_size: int,
                  max_predictions: Optional[int] = None) -> Dict[str, np.ndarray]:
    """Arrays of one shard from examples (ids, a_len, nsp[, positions, labels])."""
    dt = id_dtype(vocab_size)
    lengths = np.array([len(e[0]) for e in examples], dtype=np.int64)
    arrays = {
        "input_ids": (np.concatenate([np.asarray(e[0]) for e in examples]).astype(dt)
                      if examples else np.zeros(0, dt)),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "a_len": np.array([e[1] for e in examples], dtype=np.uint16),
        "nsp": np.array([e[2] for e in examples], dtype=np.uint8),
    }
    if max_predictions is not None:
        n = len(examples)
        pos = np.zeros((n, max_predictions), np.uint16)
        lab = np.zeros((n, max_predictions), dt)
        cnt = np.zeros(n, np.uint16)
        for i, e in enumerate(examples):
            k = len(e[3])
            pos[i, :k] = e[3]
            lab[i, :k] = e[4]
            cnt[i] = k
        arrays.update(mlm_positions=pos, mlm_labels=lab, mlm_count=cnt)
    return arrays
