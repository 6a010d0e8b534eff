"""``bertfast prepare``: plain text -> WordPiece ids -> NSP examples -> binary shards.

Stages (each resumable: its output is written under a temp name and renamed when done, and a
rerun with the same settings skips what exists):

  1. corpus: the input files (``--doc-split blank|file``), or with no inputs the embedded
     corpus (the standard library's docstrings; see ``bertfast.data.corpus``);
  2. vocabulary: ``--vocab`` (a vocab.txt or a checkpoint directory holding one), or a new
     WordPiece vocabulary of ``--vocab-size`` trained on the corpus; saved as
     ``OUTPUT/vocab.txt`` with the tokenizer's JSON files;
  3. tokenisation: every segment to ids (HF tokenizers, batched, multi-threaded in Rust),
     stored flat in ``OUTPUT/tokenized/`` (memory-mapped by the next stage);
  4. examples: documents are split into a held-out ``eval`` set and ``--num-shards``
     training shards; worker processes (``--workers``, default: the CPU cores) build each
     shard's NSP examples (``bertfast.data.nsp``), ``--dupe-factor`` passes over its
     documents, shuffled, optionally masked once and stored (``--static-masking``);
  5. ``OUTPUT/index.json`` lists the shards (``bertfast.data.shards``).

Usage: ``bertfast prepare [FILES/DIRS ...] --output DIR [--vocab PATH | --vocab-size N]
[--max-seq-len 128] [--short-seq-prob 0.1] [--dupe-factor 1] [--static-masking]``
"""
from __future__ import annotations

import argparse
import array
import errno
import hashlib
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from bertfast.data import corpus as corpus_mod
from bertfast.data.masking import MaskingConfig, continuation_flags, example_rng, mask_sequence
from bertfast.data.nsp import TokenizedCorpus, instances_from_document
from bertfast.data.shards import (FORMAT, INDEX_FILE, id_dtype, pack_examples, process_alive, shard_is_complete,
                                  write_json_atomic, write_shard)
from bertfast.data.tokenization import WordPiece, vocab_fingerprint

TOKENIZED_DIR = "tokenized"


def _progress(iterable=None, **kwargs):
    from tqdm.auto import tqdm
    kwargs.setdefault("disable", not kwargs.pop("enabled", True))
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, **kwargs)


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _int_seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little")


# --------------------------------------------------------------------------- stage 3
def tokenize_corpus(files: Sequence[str], tok: WordPiece, out_dir: str, doc_split: str,
                    fingerprint: str, progress: bool = True, batch_docs: int = 2000) -> TokenizedCorpus:
    """Tokenise every document of ``files`` into ``out_dir`` (skipped if already done for ``fingerprint``)."""
    meta_path = os.path.join(out_dir, "meta.json")
    if os.path.isfile(meta_path):
        with open(meta_path, encoding="utf-8") as f:
            if json.load(f).get("fingerprint") == fingerprint:
                return load_tokenized(out_dir)
    tmp = out_dir + f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    dt = id_dtype(tok.vocab_size)
    seg_offsets = array.array("q", [0])
    doc_offsets = array.array("q", [0])
    n_tokens = 0
    bar = _progress(desc="tokenize", unit="doc", enabled=progress)
    with open(os.path.join(tmp, "tokens.bin"), "wb") as out:
        def flush(batch: List[List[str]]) -> None:
            nonlocal n_tokens
            flat = [seg for doc in batch for seg in doc]
            encoded = tok.encode_segments(flat)
            k = 0
            for doc in batch:
                n_seg = 0
                for ids in encoded[k:k + len(doc)]:
                    if ids:  # a segment of only whitespace/control characters has no tokens
                        out.write(np.asarray(ids, dtype=dt).tobytes())
                        n_tokens += len(ids)
                        seg_offsets.append(n_tokens)
                        n_seg += 1
                k += len(doc)
                if n_seg:
                    doc_offsets.append(len(seg_offsets) - 1)
            bar.update(len(batch))

        batch: List[List[str]] = []
        for doc in corpus_mod.read_documents(files, doc_split=doc_split):
            batch.append(doc)
            if len(batch) >= batch_docs:
                flush(batch)
                batch = []
        if batch:
            flush(batch)
        out.flush()
        os.fsync(out.fileno())
    bar.close()
    np.save(os.path.join(tmp, "seg_offsets.npy"), np.frombuffer(seg_offsets, dtype=np.int64))
    np.save(os.path.join(tmp, "doc_offsets.npy"), np.frombuffer(doc_offsets, dtype=np.int64))
    with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
        json.dump({"fingerprint": fingerprint, "dtype": dt.name, "num_tokens": n_tokens,
                   "num_segments": len(seg_offsets) - 1, "num_docs": len(doc_offsets) - 1}, f, indent=2)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.rename(tmp, out_dir)
    return load_tokenized(out_dir)


def load_tokenized(out_dir: str) -> TokenizedCorpus:
    with open(os.path.join(out_dir, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    n = int(meta["num_tokens"])
    path = os.path.join(out_dir, "tokens.bin")
    tokens = (np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r", shape=(n,)) if n
              else np.zeros(0, np.dtype(meta["dtype"])))
    return TokenizedCorpus(tokens, np.load(os.path.join(out_dir, "seg_offsets.npy")),
                           np.load(os.path.join(out_dir, "doc_offsets.npy")))


# --------------------------------------------------------------------------- stage 4
_WORKER_CORPUS: Dict[str, TokenizedCorpus] = {}


def build_shard(job: dict) -> dict:
    """Build one shard (runs in a worker process). Returns its name and size; skips a finished shard."""
    directory = job["directory"]
    name = os.path.basename(directory)
    if shard_is_complete(directory, job["settings_hash"]):
        with open(os.path.join(directory, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
        return {"name": name, "num_examples": meta["num_examples"], "num_tokens": meta["num_tokens"],
                "skipped": True}
    corpus = _WORKER_CORPUS.get(job["corpus_dir"])
    if corpus is None:
        corpus = _WORKER_CORPUS[job["corpus_dir"]] = load_tokenized(job["corpus_dir"])
    s = job["settings"]
    rng = random.Random(_int_seed(s["seed"], job["split"], job["shard_index"]))
    pool = np.asarray(job["pool"], dtype=np.int64)
    cls_id, sep_id = job["cls_id"], job["sep_id"]
    examples = []
    for _ in range(s["dupe_factor"]):
        for d in job["docs"]:
            for inst in instances_from_document(corpus, int(d), s["max_seq_len"], s["short_seq_prob"],
                                                rng, random_doc_pool=pool):
                ids = np.array([cls_id, *inst.tokens_a, sep_id, *inst.tokens_b, sep_id], dtype=np.int64)
                examples.append([ids, len(inst.tokens_a) + 2, int(inst.is_random_next)])
    rng.shuffle(examples)
    max_pred = None
    if s["static_masking"]:
        max_pred = s["max_predictions_per_seq"]
        mcfg = MaskingConfig(vocab_size=job["vocab_size"], mask_id=job["mask_id"],
                             special_ids=tuple(job["special_ids"]), mlm_prob=s["masked_lm_prob"],
                             max_predictions_per_seq=max_pred, whole_word=s["whole_word_masking"],
                             continuation=job.get("continuation"))
        stream = _int_seed("static-mask", job["split"], job["shard_index"])
        for i, ex in enumerate(examples):
            masked, pos, lab = mask_sequence(ex[0], mcfg, example_rng(s["seed"], 0, i, stream))
            ex[0] = masked
            ex.extend([pos, lab])
    arrays = pack_examples(examples, job["vocab_size"], max_pred)
    meta = {"num_examples": len(examples), "num_tokens": int(len(arrays["input_ids"])),
            "settings_hash": job["settings_hash"], "split": job["split"]}
    write_shard(directory, arrays, meta)
    return {"name": name, "num_examples": meta["num_examples"], "num_tokens": meta["num_tokens"],
            "skipped": False}


def split_documents(num_docs: int, eval_docs: int, num_shards: int, seed: int):
    """(eval doc ids, [train doc ids of each shard]) from a seeded permutation."""
    perm = np.random.default_rng(_int_seed(seed, "split") % 2**63).permutation(num_docs)
    eval_ids = np.sort(perm[:eval_docs])
    train = perm[eval_docs:]
    return eval_ids, [np.sort(train[k::num_shards]) for k in range(num_shards)]


# --------------------------------------------------------------------------- driver
def prepare_dataset(inputs: Sequence[str], output: str, *, vocab: Optional[str] = None,
                    vocab_size: int = 30522, lowercase: Optional[bool] = None, max_seq_len: int = 128,
                    short_seq_prob: float = 0.1, dupe_factor: int = 1, masked_lm_prob: float = 0.15,
                    max_predictions_per_seq: int = 20, static_masking: bool = False,
                    whole_word_masking: bool = False, num_shards: Optional[int] = None,
                    docs_per_shard: int = 4096, eval_fraction: float = 0.02,
                    eval_docs: Optional[int] = None, workers: Optional[int] = None, seed: int = 12345,
                    doc_split: str = "blank", corpus_max_docs: Optional[int] = None,
                    corpus_max_files: Optional[int] = None, corpus_cache: Optional[str] = None,
                    progress: bool = True, log=print) -> str:
    """The whole pipeline (see the module docstring); returns ``output``. Library form of ``main``."""
    t0 = time.time()
    if max_seq_len < 8:
        raise ValueError(f"max_seq_len must be >= 8, got {max_seq_len}")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise ValueError(f"short_seq_prob must be in [0, 1], got {short_seq_prob}")
    if dupe_factor < 1:
        raise ValueError(f"dupe_factor must be >= 1, got {dupe_factor}")
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction (--eval-fraction) must be a fraction in [0, 1), got {eval_fraction}")
    if eval_docs is not None and eval_docs < 0:
        raise ValueError(f"eval_docs (--eval-docs) must be >= 0, got {eval_docs}")
    if not 0.0 < masked_lm_prob < 1.0:
        raise ValueError(f"masked_lm_prob (--masked-lm-prob) must be in (0, 1), got {masked_lm_prob}")
    # Recorded in the index and used as the model's static MLM shape: 0 would mask nothing.
    if max_predictions_per_seq < 1:
        raise ValueError(f"max_predictions_per_seq (--max-predictions-per-seq) must be >= 1, "
                         f"got {max_predictions_per_seq}")
    for name, value in (("num_shards", num_shards), ("workers", workers), ("docs_per_shard", docs_per_shard)):
        if value is not None and value < 1:
            raise ValueError(f"{name} (--{name.replace('_', '-')}) must be >= 1, got {value}")
    os.makedirs(output, exist_ok=True)
    for leftover in remove_stale_temporaries(output):
        log(f"[prepare] removed {leftover}: left by a prepare that was stopped while writing")

    # 1. corpus
    if inputs:
        files = corpus_mod.expand_inputs(inputs)
        corpus_name = f"{len(files)} file(s)"
    else:
        files = [corpus_mod.stdlib_corpus_file(corpus_cache or os.path.join(output, "corpus"),
                                               max_files=corpus_max_files, max_docs=corpus_max_docs)]
        doc_split = "blank"
        corpus_name = f"embedded corpus (Python {sys.version_info[0]}.{sys.version_info[1]} stdlib docstrings)"
    corpus_fp = corpus_mod.files_fingerprint(files)
    log(f"[prepare] corpus: {corpus_name}")

    # 2. vocabulary
    if vocab is not None:
        tok = WordPiece.from_pretrained(vocab, lowercase=lowercase)
        tok.save(output)
        vocab_source = {"file": os.path.abspath(vocab)}
    else:
        lowercase = True if lowercase is None else lowercase
        vocab_source = {"trained_on": corpus_fp, "vocab_size": vocab_size, "lowercase": lowercase,
                        "doc_split": doc_split}
        meta_path = os.path.join(output, "vocab_source.json")
        reuse = False
        if os.path.isfile(meta_path) and os.path.isfile(os.path.join(output, "vocab.txt")):
            with open(meta_path, encoding="utf-8") as f:
                reuse = json.load(f) == vocab_source
        if reuse:
            tok = WordPiece.from_pretrained(output, lowercase=lowercase)
        else:
            log(f"[prepare] training a WordPiece vocabulary of {vocab_size} on the corpus")
            texts = (seg for doc in corpus_mod.read_documents(files, doc_split=doc_split) for seg in doc)
            tok = WordPiece.train(texts, vocab_size=vocab_size, lowercase=lowercase, show_progress=False)
            tok.save(output)
            write_json_atomic(meta_path, vocab_source)
    vocab_fp = vocab_fingerprint(os.path.join(output, "vocab.txt"), tok.lowercase)
    log(f"[prepare] vocabulary: {tok.vocab_size} word pieces (lowercase={tok.lowercase})")

    # 3. tokenisation
    tokenized_dir = os.path.join(output, TOKENIZED_DIR)
    corpus = tokenize_corpus(files, tok, tokenized_dir, doc_split, _hash([corpus_fp, vocab_fp, doc_split]),
                             progress=progress)
    n_docs = corpus.num_docs
    if n_docs == 0:
        raise ValueError(f"the corpus ({corpus_name}) contains no text")
    log(f"[prepare] {n_docs} documents, {len(corpus.tokens)} tokens")

    # 4. shards
    if eval_docs is None:
        eval_docs = int(round(eval_fraction * n_docs))
        if eval_fraction > 0 and n_docs >= 10:
            eval_docs = max(eval_docs, 1)
    eval_docs = max(0, min(eval_docs, n_docs - 1))
    n_train = n_docs - eval_docs
    if num_shards is None:
        num_shards = max(1, math.ceil(n_train / docs_per_shard))
    num_shards = max(1, min(num_shards, n_train))
    settings = {"max_seq_len": max_seq_len, "short_seq_prob": short_seq_prob, "dupe_factor": dupe_factor,
                "masked_lm_prob": masked_lm_prob, "max_predictions_per_seq": max_predictions_per_seq,
                "static_masking": static_masking, "whole_word_masking": whole_word_masking, "seed": seed,
                "num_shards": num_shards, "eval_docs": eval_docs}
    settings_hash = _hash([settings, corpus_fp, vocab_fp, doc_split])
    eval_ids, shard_docs = split_documents(n_docs, eval_docs, num_shards, seed)
    train_pool = np.sort(np.concatenate(shard_docs))
    eval_pool = eval_ids if len(eval_ids) >= 2 else np.arange(n_docs)
    common = {"settings": settings, "settings_hash": settings_hash, "corpus_dir": tokenized_dir,
              "vocab_size": tok.vocab_size, "cls_id": tok.cls_id, "sep_id": tok.sep_id,
              "mask_id": tok.mask_id, "special_ids": tok.special_ids}
    if static_masking and whole_word_masking:
        common["continuation"] = continuation_flags(tok.id_to_token)
    jobs = [dict(common, directory=os.path.join(output, f"train-{k:05d}"), split="train", shard_index=k,
                 docs=shard_docs[k], pool=train_pool) for k in range(num_shards)]
    if eval_docs:
        jobs.append(dict(common, directory=os.path.join(output, "eval-00000"), split="eval", shard_index=0,
                         docs=eval_ids, pool=eval_pool))
    if workers is None:
        # Worker processes start in about a second each: worth it for real corpora only.
        workers = (os.cpu_count() or 1) if n_docs >= 20000 else 1
    workers = max(1, min(workers, len(jobs)))
    bar = _progress(total=len(jobs), desc="shards", unit="shard", enabled=progress)
    results = []
    if workers == 1:
        for job in jobs:
            results.append(build_shard(job))
            bar.update(1)
    else:
        # spawn: the parent holds tokenizer/torch threads that must not be forked.
        with mp.get_context("spawn").Pool(workers) as pool:
            for res in pool.imap_unordered(build_shard, jobs):
                results.append(res)
                bar.update(1)
    bar.close()
    by_name = {r["name"]: r for r in results}
    splits = {"train": [f"train-{k:05d}" for k in range(num_shards)]}
    if eval_docs:
        splits["eval"] = ["eval-00000"]
    counts = {split: int(sum(by_name[n]["num_examples"] for n in names)) for split, names in splits.items()}
    skipped = sum(r["skipped"] for r in results)

    # 5. index
    index = {"format": FORMAT, "settings": settings, "settings_hash": settings_hash,
             "max_seq_len": max_seq_len, "vocab_size": tok.vocab_size, "id_dtype": id_dtype(tok.vocab_size).name,
             "lowercase": tok.lowercase, "static_masking": static_masking,
             "max_predictions_per_seq": max_predictions_per_seq, "masked_lm_prob": masked_lm_prob,
             "whole_word_masking": whole_word_masking,
             "special_ids": {"pad": tok.pad_id, "unk": tok.unk_id, "cls": tok.cls_id, "sep": tok.sep_id,
                             "mask": tok.mask_id},
             "vocab_source": vocab_source, "corpus": corpus_name, "corpus_fingerprint": corpus_fp,
             "num_documents": n_docs, "splits": splits, "num_examples": counts,
             "shard_examples": {n: by_name[n]["num_examples"] for names in splits.values() for n in names}}
    write_json_atomic(os.path.join(output, INDEX_FILE), index)
    log(f"[prepare] {counts.get('train', 0)} training and {counts.get('eval', 0)} held-out examples in "
        f"{len(jobs)} shard(s) ({skipped} already done) -> {output} ({time.time() - t0:.1f}s)")
    return output


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bertfast prepare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("inputs", nargs="*", help="corpus files, directories (*.txt) or globs; none = the "
                                             "embedded corpus (Python standard library docstrings)")
    p.add_argument("--output", "-o", default="runs/data", help="dataset directory")
    p.add_argument("--vocab", help="vocab.txt, or a checkpoint directory with one (default: train one)")
    p.add_argument("--vocab-size", type=int, default=30522, help="size of a newly trained vocabulary")
    p.add_argument("--lowercase", dest="lowercase", action="store_true", default=None)
    p.add_argument("--no-lowercase", dest="lowercase", action="store_false")
    p.add_argument("--doc-split", choices=("blank", "file"), default="blank",
                   help="documents are blank-line-separated blocks, or whole files")
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--short-seq-prob", type=float, default=0.1)
    p.add_argument("--dupe-factor", type=int, default=1, help="passes over the corpus (the original used 10)")
    p.add_argument("--masked-lm-prob", type=float, default=0.15)
    p.add_argument("--max-predictions-per-seq", type=int, default=20)
    p.add_argument("--static-masking", action="store_true", help="mask once here and store the masks")
    p.add_argument("--whole-word-masking", action="store_true")
    p.add_argument("--num-shards", type=int, default=None)
    p.add_argument("--docs-per-shard", type=int, default=4096)
    p.add_argument("--eval-fraction", type=float, default=0.02, help="documents held out for evaluation")
    p.add_argument("--eval-docs", type=int, default=None, help="exact number of held-out documents")
    p.add_argument("--workers", type=int, default=None,
                   help="processes (default: the CPU cores for corpora of 20k+ documents, else 1)")
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--corpus-max-docs", type=int, default=None, help="cap the embedded corpus")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        prepare_dataset(args.inputs, args.output, vocab=args.vocab, vocab_size=args.vocab_size,
                        lowercase=args.lowercase, max_seq_len=args.max_seq_len,
                        short_seq_prob=args.short_seq_prob, dupe_factor=args.dupe_factor,
                        masked_lm_prob=args.masked_lm_prob,
                        max_predictions_per_seq=args.max_predictions_per_seq,
                        static_masking=args.static_masking, whole_word_masking=args.whole_word_masking,
                        num_shards=args.num_shards, docs_per_shard=args.docs_per_shard,
                        eval_fraction=args.eval_fraction, eval_docs=args.eval_docs, workers=args.workers,
                        seed=args.seed, doc_split=args.doc_split, corpus_max_docs=args.corpus_max_docs,
                        progress=not args.no_progress)
    except (ValueError, FileNotFoundError, corpus_mod.CorpusError) as e:
        print(f"bertfast prepare: error: {e}", file=sys.stderr)
        return 2  # bad input, as every bertfast command (bertfast.training.exits.USAGE)
    except OSError as e:  # a full disk, a read-only or forbidden output directory: named, with the free space
        print(f"bertfast prepare: error: {write_failure(args.output, e)}", file=sys.stderr)
        return 5  # an I/O failure, as pretrain and finetune (bertfast.training.exits.IO)
    return 0


def write_failure(output: str, e: OSError) -> str:
    """What stopped writing the dataset: the cause in words, the file, the free space there."""
    where = os.path.abspath(output)
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)  # the nearest existing parent: its file system
    try:
        free = f"{shutil.disk_usage(where).free / 2**20:.0f} MB free"
    except OSError:
        free = "free space unknown"
    cause = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
             errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
             errno.EPERM: "permission denied"}.get(e.errno, f"{type(e).__name__}: {e.strerror or e}")
    path = e.filename or output
    return f"could not write the dataset {output}: {cause} ({path}; {free} on its file system)"


def remove_stale_temporaries(directory: str) -> List[str]:
    """Remove ``*.tmp-<pid>`` entries of ``directory`` whose process is gone (a prepare killed while
    writing a shard or the tokenized corpus); returns their paths."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        stem, sep, pid = name.rpartition(".tmp-")
        if not sep or not stem or not pid.isdigit() or process_alive(int(pid)):
            continue
        path = os.path.join(directory, name)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
        removed.append(path)
    return removed


if __name__ == "__main__":
    sys.exit(main())
