"""A pre-training run's phases, set up before the first step: the demo's datasets, the steps of
each phase, the model's configuration from the data, and each phase's data, batches and MLM limit
(``bertfast pretrain``; see bertfast/pretrain.py)."""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import List, Optional

from bertfast.model.config import BertConfig
from bertfast.data.loader import BatchSpec, PretrainingBatches, masking_config_for
from bertfast.data.shards import MissingSplitError, PretrainingData, dataset_index
from bertfast.training.config import DEMO_MODEL, DEMO_VOCAB_SIZE, PretrainConfig, parse_overrides
from bertfast.training.distributed import DistInfo

# The demonstration run's vocabulary, made by WordPiece.train(embedded corpus, 4096) and shipped
# with the package (the run's settings: the "demo" preset of PretrainConfig).
DEMO_VOCAB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "demo_vocab.txt")


# The README's example output: the losses a demo with the default settings logs, and where they were
# measured (tests/test_pretrain.py checks that the README quotes these). Other versions, devices or
# CPU instruction sets round differently and give other, equally valid, losses.
DEMO_EXAMPLE = dict(first_loss=8.9903, last_loss=6.6135, python="3.11.7", torch="2.13.0+cpu",
                    transformers="5.24.0", device="cpu", cpu_capability="AVX512")
# Settings that change no loss (the thread count: 1 and 2 measured alike): a demo with only these
# changed is still the README's example.
DEMO_LOSS_FREE_SETTINGS = ("output_dir", "no_progress", "no_plot", "overwrite", "resume", "threads", "device",
                           "tensorboard", "keep_last")


def demo_environment(device) -> dict:
    """What decides the demo's rounding, in DEMO_EXAMPLE's keys."""
    import platform

    import torch
    import transformers
    env = dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
               device=device.type)
    if device.type == "cpu":
        env["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return env


def compare_with_readme(given: PretrainConfig, environment: dict, first: float, last: float) -> str:
    """One line saying whether a demo's first and last logged losses are the README's example, and
    if not, why not: other settings, another environment, or (not expected) neither."""
    example = DEMO_EXAMPLE
    default = PretrainConfig.from_preset("demo").to_dict()
    ran = given.to_dict()
    changed = [k for k in default if k not in DEMO_LOSS_FREE_SETTINGS and ran.get(k) != default[k]]
    if changed:
        return (f"[pretrain] demo: not the README's example settings ({', '.join(changed)} changed), so its "
                f"losses are not comparable")
    setting = [k for k in example if k not in ("first_loss", "last_loss")]
    where = ", ".join(f"{k} {example[k]}" for k in setting)
    if f"{first:.4f}/{last:.4f}" == f"{example['first_loss']:.4f}/{example['last_loss']:.4f}":  # as printed
        return (f"[pretrain] demo: the same losses as the README's example (first {example['first_loss']:.4f}, last "
                f"{example['last_loss']:.4f}; {where})")
    ours = f"first {first:.4f}, last {last:.4f} against the README's {example['first_loss']:.4f}, " \
           f"{example['last_loss']:.4f}"
    differs = [f"{k} {environment[k]} (README: {example[k]})" for k in setting
               if k in environment and environment[k] != example[k]]
    if differs:
        return (f"[pretrain] demo: losses {ours}; other losses are expected here: this environment differs from "
                f"the README's in {', '.join(differs)}, which rounds differently")
    return (f"[pretrain] demo: losses {ours} in the README's environment ({where}): not expected (another CPU "
            f"model can still round differently); please report it with this output and metrics.jsonl")


def prepare_demo_data(args: PretrainConfig, info: DistInfo, log) -> PretrainConfig:
    """Prepare the two demo datasets (seq 128 and 512) from the embedded corpus (rank 0 only)."""
    from bertfast.data.prepare import prepare_dataset

    d1 = os.path.join(args.output_dir, "data-128")
    d2 = os.path.join(args.output_dir, "data-512")
    cache = os.path.join(args.output_dir, "corpus")
    # At the default size the demo uses the shipped vocabulary (trained once on this corpus):
    # tokenizers' WordPiece trainer breaks ties in a hash-seeded order, so a freshly trained
    # vocabulary, and with it the run, would differ slightly from one process to the next.
    shipped = args.demo_vocab_size == DEMO_VOCAB_SIZE
    if info.is_main:
        prepare_dataset([], d1, vocab=DEMO_VOCAB if shipped else None, vocab_size=args.demo_vocab_size,
                        max_seq_len=128, workers=None, progress=not args.no_progress, log=log, corpus_cache=cache,
                        corpus_max_docs=args.demo_corpus_max_docs)
        prepare_dataset([], d2, vocab=d1, max_seq_len=512, workers=None, progress=not args.no_progress, log=log,
                        corpus_cache=cache, corpus_max_docs=args.demo_corpus_max_docs)
    info.barrier()
    return dataclasses.replace(args, data=args.data or d1, data_phase2=args.data_phase2 or d2)


def resolve_steps(args: PretrainConfig) -> PretrainConfig:
    """The configuration with its derived values filled in: phase steps, phase-2 batch sizes, warm-up."""
    phase1, phase2 = args.phase1_steps, args.phase2_steps
    if phase1 is None and phase2 is None:
        if args.total_steps is None:
            raise ValueError("give --phase1-steps/--phase2-steps or --total-steps (with --phase2-fraction)")
        phase2 = int(round(args.total_steps * args.phase2_fraction))
        phase1 = args.total_steps - phase2
    phase1, phase2 = phase1 or 0, phase2 or 0
    if phase1 + phase2 == 0:
        raise ValueError(f"need a positive number of steps, got phase1={phase1} phase2={phase2}")
    if phase2 and not args.data_phase2:
        raise ValueError("phase 2 needs --data-phase2 (a dataset prepared with --max-seq-len 512)")
    if phase1 and not args.data:
        raise ValueError("phase 1 needs --data (a dataset from `bertfast prepare`)")
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, int(round(0.01 * (phase1 + phase2))))
    return dataclasses.replace(args, phase1_steps=phase1, phase2_steps=phase2, warmup_steps=warmup,
                               phase2_global_batch_size=args.phase2_global_batch_size or args.global_batch_size,
                               phase2_micro_batch_size=args.phase2_micro_batch_size or args.micro_batch_size)


# The micro-batch a phase gets when none is given (--micro-batch-size, --phase2-micro-batch-size):
# about this many tokens per forward pass on each rank. 16,384 on a GPU of 40 GB or more: the
# benchmark's batches (128 sequences at seq 128, phase 1; 32 at seq 512, phase 2), where BERT-large's
# activations take about 14 GB in bf16 and an H100's step is long enough (~70 ms) for the host to
# launch it; a smaller micro-batch leaves an eager step waiting on the host (docs/training.md).
# 4,096 elsewhere (a CPU, a smaller GPU): 32 sequences at seq 128, 8 at seq 512.
LARGE_GPU_MICRO_BATCH_TOKENS = 16384
MICRO_BATCH_TOKENS = 4096
LARGE_GPU_BYTES = 40 * 2 ** 30


def micro_batch_tokens(device) -> int:
    """The tokens of a micro-batch sized for ``device`` (see LARGE_GPU_MICRO_BATCH_TOKENS)."""
    import torch
    if device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory >= LARGE_GPU_BYTES:
        return LARGE_GPU_MICRO_BATCH_TOKENS
    return MICRO_BATCH_TOKENS


def auto_micro_batch(per_rank: int, max_seq_len: int, tokens: int) -> int:
    """The most sequences of ``max_seq_len`` within ``tokens`` (at least one) that divide the rank's
    share ``per_rank`` of the global batch, so the micro-batches make it up exactly."""
    cap = max(1, min(per_rank, tokens // max_seq_len))
    return max(d for d in range(1, cap + 1) if per_rank % d == 0)


def size_micro_batches(args: PretrainConfig, info: DistInfo, log=print) -> PretrainConfig:
    """``args`` (with its steps resolved) with a micro-batch size for each phase that has none: sized
    for the device and the phase's sequence length (micro_batch_tokens). A phase 2 with none given
    takes phase 1's when that was given, as before the sizing."""
    sizes = {}
    tokens = None
    for field, steps, directory, global_batch in (
            ("micro_batch_size", args.phase1_steps, args.data, args.global_batch_size),
            ("phase2_micro_batch_size", args.phase2_steps, args.data_phase2, args.phase2_global_batch_size)):
        if getattr(args, field) is not None or not steps:
            continue
        tokens = tokens or micro_batch_tokens(info.device)
        max_seq_len = int(dataset_index(directory)["max_seq_len"])  # the index alone: build_phases opens the shards
        sizes[field] = auto_micro_batch(max(1, global_batch // info.world_size), max_seq_len, tokens)
        log(f"[pretrain] {field.replace('_', '-')}: {sizes[field]} (sized for {info.device.type}: up to {tokens} "
            f"tokens of {max_seq_len}-token sequences a micro-batch; --{field.replace('_', '-')} sets it)")
    return dataclasses.replace(args, **sizes) if sizes else args


def build_config(args: PretrainConfig, vocab_size: int, max_seq_len: int) -> BertConfig:
    overrides = parse_overrides(args.config_overrides)
    if args.init_checkpoint:
        config = BertConfig.from_pretrained(args.init_checkpoint, **overrides)
    elif args.model_config:
        config = BertConfig.from_pretrained(args.model_config, **overrides)
    elif args.preset == "demo":
        config = BertConfig.preset("small", **{**DEMO_MODEL, **overrides})
    else:
        config = BertConfig.preset(args.preset, **overrides)
    if "vocab_size" not in overrides and not args.init_checkpoint:
        k = max(1, args.vocab_multiple)
        config.vocab_size = -(-vocab_size // k) * k
    if config.vocab_size < vocab_size:
        raise ValueError(f"the model's vocab_size ({config.vocab_size}) is smaller than the data's "
                         f"vocabulary ({vocab_size})")
    slack = -(-vocab_size // 128) * 128  # a table rounded up for the tensor cores, at most to a multiple of 128
    if args.init_checkpoint and config.vocab_size > max(slack, vocab_size + max(1, args.vocab_multiple)):
        raise ValueError(f"--init-checkpoint {args.init_checkpoint} has a {config.vocab_size}-word vocabulary, the "
                         f"data a {vocab_size}-word one: the data was tokenized with another vocabulary, so its ids "
                         f"would mean other words to the model. Prepare the data with the checkpoint's vocabulary "
                         f"(bertfast prepare --vocab {args.init_checkpoint}) or start without --init-checkpoint")
    if config.max_position_embeddings < max_seq_len:
        raise ValueError(f"the model's max_position_embeddings ({config.max_position_embeddings}) is smaller "
                         f"than the data's max_seq_len ({max_seq_len})")
    return config


@dataclass
class Phase:
    index: int
    start: int          # first global step of the phase
    steps: int
    data: PretrainingData
    batches: PretrainingBatches
    spec: BatchSpec
    eval_batches: Optional[PretrainingBatches]
    max_predictions: Optional[int]  # the model's static MLM gather per batch row (a packed row: all its sequences)

    @property
    def end(self) -> int:
        return self.start + self.steps


def static_shapes(args: PretrainConfig) -> bool:
    """Packed batches of fixed shapes: asked for, or needed by CUDA graphs."""
    return args.static_shapes or args.cuda_graphs


def build_phases(args, info: DistInfo, vocab_tokens: Optional[List[str]]) -> List[Phase]:
    phases: List[Phase] = []
    start = 0
    specs = [(args.data, args.phase1_steps, args.global_batch_size, args.micro_batch_size, args.pack_tokens),
             (args.data_phase2, args.phase2_steps, args.phase2_global_batch_size, args.phase2_micro_batch_size,
              args.phase2_pack_tokens)]
    for i, (directory, steps, gbs, mbs, pack_tokens) in enumerate(specs, start=1):
        if not steps:
            continue
        data = PretrainingData(directory, "train")
        max_pred = args.max_predictions_per_seq
        prob = args.masked_lm_prob if args.masked_lm_prob is not None else float(data.index.get("masked_lm_prob", 0.15))
        drawn = max(1, math.ceil(prob * data.max_seq_len))  # the most masks dynamic masking draws in a sequence
        if max_pred is None and data.static_masking:
            max_pred = int(data.index["max_predictions_per_seq"])
        elif max_pred is None and static_shapes(args):
            max_pred = drawn
        elif max_pred is not None and not data.static_masking and max_pred < drawn and info.is_main:
            print(f"[pretrain] note: phase {i}: --max-predictions-per-seq {max_pred} caps the masks that "
                  f"masked-lm-prob {prob:g} draws in a {data.max_seq_len}-token sequence (up to {drawn}): longer "
                  f"sequences get {max_pred}; leave it out to mask every one", flush=True)
        masking = None if data.static_masking else masking_config_for(
            data, vocab_tokens, mlm_prob=args.masked_lm_prob, max_predictions_per_seq=max_pred)
        # With static shapes the model gathers max_pred labelled positions per sequence: the
        # loader refuses (on the host) a sequence with more, instead of its extra labels being dropped.
        # The micro-batch is one packed row, so the model's gather is max_pred per sequence of the row.
        limit = max_pred if static_shapes(args) else None
        pack = (pack_tokens or mbs * data.max_seq_len) if static_shapes(args) else None
        spec = BatchSpec(gbs, mbs, info.world_size, info.rank)
        batches = PretrainingBatches(data, spec, seed=args.seed + 1000 * i, masking=masking,
                                     pad_to_multiple_of=args.pad_to_multiple_of, static_shapes=static_shapes(args),
                                     max_predictions=limit, pack_tokens=pack)
        eval_batches = None
        eval_dir = args.eval_data or directory
        try:
            eval_data = PretrainingData(eval_dir, "eval")
        except MissingSplitError:  # no held-out split: no evaluation (a damaged index is still an error)
            eval_data = None
        if eval_data is not None and len(eval_data):
            emask = None if eval_data.static_masking else masking_config_for(
                eval_data, vocab_tokens, mlm_prob=args.masked_lm_prob, max_predictions_per_seq=max_pred)
            # The held-out set is the same for any number of ranks: micro-batch j of the
            # (unshuffled) eval stream goes to rank j % world_size.
            espec = BatchSpec(mbs, mbs, 1, 0)
            eval_batches = PretrainingBatches(eval_data, espec, seed=args.seed + 7, masking=emask,
                                              pad_to_multiple_of=args.pad_to_multiple_of,
                                              static_shapes=static_shapes(args), shuffle=False,
                                              max_predictions=limit, pack_tokens=pack)
        phases.append(Phase(i, start, steps, data, batches, spec, eval_batches,
                            None if limit is None else limit * mbs))
        start += steps
    return phases
