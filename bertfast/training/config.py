"""Typed, validated run configurations: one dataclass per command (``PretrainConfig``,
``FinetuneConfig``), its command line built from its fields, named presets (the pre-training
demo; the paper's GLUE, SQuAD and SWAG fine-tuning recipes), and the resolved configuration
saved in the run directory (run_config.json), where ``--resume`` reads it back.

A value comes from, highest first: the command line, a JSON file (``--config run.json``, keys
are option names with ``-`` or ``_``), a preset, the field's default. Every value is checked
against the field's type and choices before a run starts (a JSON ``null``, a string where a
number belongs, an unknown key: an error naming the option, what was expected and what was
given), then against the command's own rules (``check``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, Tuple, Type, TypeVar

C = TypeVar("C", bound="RunConfig")


def option(default: Any, help: str = "", *, group: str = "options", choices: Optional[Sequence[Any]] = None,
           flag: Optional[str] = None, nargs: Optional[str] = None, const: Any = None, hidden: bool = False,
           per_run: bool = True, fixed: bool = False) -> Any:
    """A dataclass field that is also a command-line option (``--field-name`` unless ``flag``).
    ``per_run=False``: a setting of one invocation (where to stop, a progress bar), which a resumed
    run does not take from the saved configuration. ``fixed``: what a resumed run cannot change
    (the model, its data, the optimizer's kind): asking is an error, never a silent no-op."""
    meta = {"help": help, "group": group, "choices": tuple(choices) if choices else None, "flag": flag,
            "nargs": nargs, "const": const, "hidden": hidden, "per_run": per_run, "fixed": fixed}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _describe(kind: Any) -> str:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Union:
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    if origin in (list, List):
        return "a list of " + {int: "integers", float: "numbers", str: "strings"}.get(args[0], str(args[0]))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(kind, str(kind))


def _conforms(value: Any, kind: Any) -> bool:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Union:
        return any(_conforms(value, a) for a in args)
    if kind is type(None):
        return value is None
    if origin in (list, List):
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


class RunConfig:
    """Base of the run configuration dataclasses (``PretrainConfig``, ``FinetuneConfig``)."""

    PRESETS: ClassVar[Dict[str, Dict[str, Any]]] = {}
    FILE: ClassVar[str] = "run_config.json"
    PROG: ClassVar[str] = ""          # the command, and the first line of its --help
    DESCRIPTION: ClassVar[str] = ""

    @classmethod
    def command_parser(cls) -> argparse.ArgumentParser:
        """The command's parser (``bertfast <command> --help`` prints it without importing the command)."""
        return cls.parser(cls.PROG, cls.DESCRIPTION)

    # ------------------------------------------------------------------ building
    @classmethod
    def fields(cls) -> Tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)

    @classmethod
    def types(cls) -> Dict[str, Any]:
        return typing.get_type_hints(cls)

    @classmethod
    def from_dict(cls: Type[C], values: Dict[str, Any], source: str = "the configuration",
                  base: Optional[C] = None) -> C:
        """``base`` (or the defaults) with ``values`` (option names with '-' or '_') over it, checked."""
        names = {f.name: f.name for f in cls.fields()}  # field names and flag names (``set``)
        names.update({f.metadata["flag"].lstrip("-").replace("-", "_"): f.name
                      for f in cls.fields() if f.metadata.get("flag")})
        given = {}
        for key, value in values.items():
            name = names.get(key.lstrip("-").replace("-", "_"))
            if name is None:
                raise ValueError(f"{source}: unknown option {key!r}")
            given[name] = value
        config = dataclasses.replace(base, **given) if base is not None else cls(**given)
        config.validate(source)
        return config

    @classmethod
    def from_preset(cls: Type[C], name: str, **overrides: Any) -> C:
        if name not in cls.PRESETS:
            raise ValueError(f"unknown preset {name!r}; expected one of {sorted(cls.PRESETS)}")
        return cls.from_dict({**cls.PRESETS[name], **overrides}, f"preset {name!r}")

    # ------------------------------------------------------------------ checking
    def validate(self, source: str = "the configuration") -> None:
        types = self.types()
        for f in self.fields():
            value, kind = getattr(self, f.name), types[f.name]
            flag = self.flag_of(f)
            if not _conforms(value, kind):
                raise ValueError(f"{source}: {flag} expects {_describe(kind)}, got {value!r}")
            choices = f.metadata.get("choices")
            if choices and value is not None and value not in choices:
                raise ValueError(f"{source}: {flag} must be one of {list(choices)}, got {value!r}")
        try:
            self.check()
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def check(self) -> None:
        """The command's own rules (ranges, combinations); raise ValueError naming the option."""

    @classmethod
    def flag_of(cls, f: dataclasses.Field) -> str:
        return f.metadata.get("flag") or "--" + f.name.replace("_", "-")

    def require_positive(self, *names: str) -> None:
        """Each named option, unless None, is > 0 (NaN is not)."""
        self._require(names, lambda v: v > 0, "> 0")

    def require_non_negative(self, *names: str) -> None:
        """Each named option, unless None, is >= 0."""
        self._require(names, lambda v: v >= 0, ">= 0")

    def _require(self, names: Sequence[str], ok: Callable[[Any], bool], rule: str) -> None:
        fields = {f.name: f for f in self.fields()}
        for name in names:
            value = getattr(self, name)
            if value is not None and not ok(value):
                raise ValueError(f"{self.flag_of(fields[name])} must be {rule}, got {value}")

    # ------------------------------------------------------------------ the command line
    @classmethod
    def parser(cls, prog: str, description: str) -> argparse.ArgumentParser:
        """Every field as an option; an option not given is absent from the parsed namespace."""
        parser = argparse.ArgumentParser(prog=prog, description=description, argument_default=argparse.SUPPRESS)
        parser.add_argument("--config", help="JSON file of options (keys = option names); flags override it")
        groups: Dict[str, Any] = {}
        types = cls.types()
        for f in cls.fields():
            meta = f.metadata
            group = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
            flag = cls.flag_of(f)
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            # argparse formats help with %: a literal one (e.g. "1% of the steps") is written %%.
            text = (argparse.SUPPRESS if meta.get("hidden")
                    else f"{meta['help']} (default: {default})".lstrip().replace("%", "%%"))
            kind = types[f.name]
            base = kind  # Optional[X] -> X
            if typing.get_origin(kind) is typing.Union:
                base = next(a for a in typing.get_args(kind) if a is not type(None))
            kwargs: Dict[str, Any] = {"dest": f.name, "help": text}
            if base is bool:  # Optional[bool]: None (not given) means "decide from the data"
                kwargs["action"] = "store_true"
            elif typing.get_origin(base) in (list, List):
                kwargs.update(action="append", metavar="VALUE")
            else:
                kwargs["type"] = base
                if meta.get("choices"):
                    kwargs["choices"] = meta["choices"]
                if meta.get("nargs"):
                    kwargs.update(nargs=meta["nargs"], const=meta["const"])
            group.add_argument(flag, **kwargs)
        return parser

    @classmethod
    def from_command_line(cls: Type[C], argv: Sequence[str], prog: str, description: str,
                          preset: Callable[[Dict[str, Any]], Optional[str]] = lambda given: None) -> C:
        """The flags over the JSON ``--config`` file over the saved run (``--resume``, when the
        output directory holds one) over a preset over the defaults. ``preset(given)`` names the
        preset from what the flags and file give (merged, flags winning; ``config``: the file's
        path), or returns None."""
        flags = vars(cls.parser(prog, description).parse_args(list(argv)))
        path = flags.pop("config", None)
        from_file = load_json(path) if path else {}
        given = {**{k.lstrip("-").replace("-", "_"): v for k, v in from_file.items()}, **flags}
        name = preset({**given, "config": path} if path else given)

        def build(preset_name: Optional[str]) -> C:
            config = cls.from_preset(preset_name) if preset_name else cls()
            if from_file:
                config = cls.from_dict(from_file, path, base=config)
            return cls.from_dict(flags, "the command line", base=config)

        config = build(name)
        if getattr(config, "resume", None):
            saved = cls.load(config.output_dir)
            if saved is not None:
                # The preset is the saved run's, not the one these flags alone would pick: `--resume`
                # with no data names the demo, whose per-invocation settings (threads=1, overwrite)
                # must not reach a run made on data (another thread count breaks bit-exact resumption).
                saved_name = preset(saved.to_dict())
                if saved_name != name:
                    config = build(saved_name)
                config = config.over_saved(saved, {**from_file, **flags})
        return config

    # ------------------------------------------------------------------ the run directory
    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, directory: str) -> str:
        """Write the configuration to ``directory/run_config.json`` (atomically)."""
        path = os.path.join(directory, self.FILE)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
        return path

    def over_saved(self: C, saved: C, given: Dict[str, Any], source: str = "the command line") -> C:
        """A resumed run: the ``saved`` run's settings, this invocation's own (``per_run=False``)
        settings, and what ``given`` (this command line and file) changes."""
        own = {f.name: getattr(self, f.name) for f in self.fields() if not f.metadata["per_run"]}
        changed = [f"{f.metadata['flag'] or '--' + f.name.replace('_', '-')} {given[f.name]!r} (the run has "
                   f"{getattr(saved, f.name)!r})" for f in self.fields()
                   if f.metadata["fixed"] and f.name in given and not _same(given[f.name], getattr(saved, f.name))]
        if changed:
            raise ValueError(f"--resume continues the run saved in {self.FILE}, whose model, data and optimizer "
                             f"stay as they were: got {'; '.join(changed)}. Leave those out, or start a new run "
                             f"(another --output-dir, or --init-checkpoint from this one)")
        return self.from_dict(given, source, base=dataclasses.replace(saved, **own))

    @classmethod
    def load(cls: Type[C], directory: str) -> Optional[C]:
        """The configuration saved in ``directory``, or None when it holds none."""
        path = os.path.join(directory, cls.FILE)
        if not os.path.isfile(path):
            return None
        return cls.from_dict(load_json(path), path)


def _same(given: Any, saved: Any) -> bool:
    """Equal settings; paths compared as the files they name."""
    if isinstance(given, str) and isinstance(saved, str) and given != saved and os.sep in given + saved:
        return os.path.realpath(given) == os.path.realpath(saved)
    return given == saved


def parse_overrides(items: Sequence[str]) -> Dict[str, Any]:
    """``--set KEY=VALUE`` flags -> BertConfig overrides; VALUE is read as JSON when it parses, else as a string."""
    out: Dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def load_json(path: str) -> Dict[str, Any]:
    """A JSON object of options; errors name the file and line."""
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a JSON object of option names to values, got {type(values).__name__}")
    return values


# --------------------------------------------------------------------------- bertfast pretrain
# The demonstration run: a small BERT (DEMO_MODEL) that trains in minutes on a laptop CPU, with the
# shipped demo_vocab.txt of DEMO_VOCAB_SIZE word pieces.
DEMO_VOCAB_SIZE = 4096
DEMO_MODEL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512,
                  max_position_embeddings=512)
DEMO = dict(demo=True, preset="demo", output_dir=os.path.join("runs", "demo"), phase1_steps=270, phase2_steps=30,
            global_batch_size=32, micro_batch_size=32, phase2_global_batch_size=8, phase2_micro_batch_size=8, lr=1e-3,
            warmup_steps=30, log_every=10, eval_every=100, eval_batches=4, save_every=100, parity_every=100,
            keep_last=2, demo_vocab_size=DEMO_VOCAB_SIZE, threads=1, overwrite=True)

# Help of the options both commands have.
RESUME_HELP = "resume from a checkpoint directory, or 'auto' (the latest good one in OUTPUT_DIR/checkpoints)"
STOP_AT_STEP_HELP = "save a checkpoint and stop after this step (the run can be resumed)"
OVERWRITE_HELP = ("start afresh in an OUTPUT_DIR holding an earlier run, deleting its checkpoints and records "
                  "(without it, such a run is refused: pass --resume to continue it)")
NONFINITE_HELP = ("when a step's loss or gradient norm is NaN or inf: stop (keeping the last checkpoint, all of whose "
                  "values are finite), or skip the step (on the device with fused AdamW or the triton LAMB; "
                  "otherwise one host read per step)")
MAX_SKIPPED_HELP = "--on-nonfinite skip: stop after this many skipped steps in a row"
PARITY_THRESHOLD_HELP = ("relative difference of loss, logits or gradient norm that counts as divergence (the check "
                         "runs in fp32 with dropout off, where fast and reference agree to ~1e-6)")
MODEL, DATA, SCHEDULE, DIST, LOGS, PARITY = ("model", "data", "schedule", "distributed", "checkpoints and logging",
                                             "parity")


@dataclass
class PretrainConfig(RunConfig):
    """Every option of ``bertfast pretrain``; saved as run_config.json in the output directory."""

    PROG: ClassVar[str] = "bertfast pretrain"
    DESCRIPTION: ClassVar[str] = "BERT pre-training (masked LM + next sentence prediction)"

    demo: bool = option(False, "short demonstration run on the embedded corpus", group=MODEL, fixed=True)
    preset: str = option("bert-base", "tiny | small | bert-base | bert-large | demo (the --demo model: L=2 H=128 "
                                      "A=2)", group=MODEL, fixed=True)
    model_config: Optional[str] = option(None, "a config.json (or a directory holding one) instead of --preset",
                                         group=MODEL, fixed=True)
    init_checkpoint: Optional[str] = option(None, "start from the weights of this checkpoint directory", group=MODEL,
                                            fixed=True)
    config_overrides: List[str] = option([], "override a BertConfig field, e.g. --set hidden_dropout_prob=0.0 "
                                             "(repeatable)", group=MODEL, flag="--set", fixed=True)
    vocab_multiple: int = option(8, "round the vocabulary size up to this multiple (tensor-core friendly)",
                                 group=MODEL, fixed=True)
    execution: str = option("fast", "train through the fast unpadded path or the plain reference encoder",
                            group=MODEL, choices=("fast", "reference"))
    compile: bool = option(False, "torch.compile the model", group=MODEL)
    cuda_graphs: bool = option(False, "capture the training step (forward, backward, clipping, optimizer) in a CUDA "
                                      "graph and replay it; implies --static-shapes (one CUDA process, AdamW or "
                                      "the triton LAMB, bf16 or fp32)", group=MODEL)

    data: Optional[str] = option(None, "phase-1 dataset directory (bertfast prepare, e.g. --max-seq-len 128)",
                                 group=DATA, fixed=True)
    data_phase2: Optional[str] = option(None, "phase-2 dataset directory (e.g. --max-seq-len 512)", group=DATA,
                                        fixed=True)
    eval_data: Optional[str] = option(None, "dataset whose 'eval' split is the held-out set (default: the phase's)",
                                      group=DATA)
    static_shapes: bool = option(False, "pack each micro-batch into one row of a fixed token budget and gather a "
                                        "fixed number of masked positions: every shape static, no host read in the "
                                        "step (what torch.compile and CUDA graphs want)", group=DATA)
    pack_tokens: Optional[int] = option(None, "--static-shapes: tokens of a packed micro-batch in phase 1 (default: "
                                              "micro batch size x max_seq_len, which always fits)", group=DATA)
    phase2_pack_tokens: Optional[int] = option(None, "the same for phase 2", group=DATA)
    max_predictions_per_seq: Optional[int] = option(None, "cap on masked tokens per sequence (default: none; "
                                                          "with --static-shapes ceil(masked-lm-prob x L), every "
                                                          "mask drawn)", group=DATA)
    masked_lm_prob: Optional[float] = option(None, "default: the dataset's (0.15)", group=DATA)
    pad_to_multiple_of: int = option(8, group=DATA)
    prefetch: int = option(2, "micro-batch sets built ahead in a thread (0: off)", group=DATA)

    phase1_steps: Optional[int] = option(None, group=SCHEDULE)
    phase2_steps: Optional[int] = option(None, group=SCHEDULE)
    total_steps: Optional[int] = option(None, "with --phase2-fraction, instead of phase steps", group=SCHEDULE)
    phase2_fraction: float = option(0.1, group=SCHEDULE)
    global_batch_size: int = option(256, group=SCHEDULE)
    micro_batch_size: Optional[int] = option(None, "sequences per forward pass on each rank (default: sized for the "
                                                   "device: up to 16,384 tokens on a GPU of 40 GB or more, else "
                                                   "4,096)", group=SCHEDULE)
    phase2_global_batch_size: Optional[int] = option(None, group=SCHEDULE)
    phase2_micro_batch_size: Optional[int] = option(None, "default: --micro-batch-size when given, else sized "
                                                          "for the device at phase 2's sequence length",
                                                    group=SCHEDULE)
    optimizer: str = option("adamw", group=SCHEDULE, choices=("adamw", "lamb"), fixed=True)
    lr: float = option(1e-4, group=SCHEDULE)
    weight_decay: float = option(0.01, group=SCHEDULE)
    beta1: float = option(0.9, group=SCHEDULE)
    beta2: float = option(0.999, group=SCHEDULE)
    adam_eps: float = option(1e-6, group=SCHEDULE)
    warmup_steps: Optional[int] = option(None, "default: 1% of the steps (10k of 1M)", group=SCHEDULE)
    max_grad_norm: float = option(1.0, "0 disables clipping", group=SCHEDULE)
    precision: str = option("auto", "auto: bf16 autocast on CUDA, fp32 on CPU", group=SCHEDULE,
                            choices=("auto", "fp32", "bf16", "fp16"))
    seed: int = option(42, group=SCHEDULE)
    on_nonfinite: str = option("stop", NONFINITE_HELP, group=SCHEDULE, choices=("stop", "skip"))
    max_skipped_steps: int = option(10, MAX_SKIPPED_HELP, group=SCHEDULE)

    device: Optional[str] = option(None, "default: cuda when available", group=DIST, choices=("cuda", "cpu"))
    fsdp: bool = option(False, "FSDP2 (fully_shard) instead of DDP, for large models", group=DIST)
    threads: Optional[int] = option(None, "torch CPU threads (default: torch's; the demo uses 1, which is fastest "
                                          "on a shared CPU)", group=DIST, per_run=False)

    output_dir: str = option(os.path.join("runs", "pretrain"), group=LOGS)
    save_every: int = option(1000, group=LOGS)
    keep_last: int = option(3, group=LOGS)
    resume: Optional[str] = option(None, RESUME_HELP, group=LOGS, nargs="?", const="auto", per_run=False)
    stop_at_step: Optional[int] = option(None, STOP_AT_STEP_HELP, group=LOGS, per_run=False)
    overwrite: bool = option(False, OVERWRITE_HELP, group=LOGS, per_run=False)
    log_every: int = option(10, group=LOGS)
    eval_every: int = option(500, "0 disables", group=LOGS)
    eval_batches: int = option(20, "micro-batches per evaluation (over all ranks)", group=LOGS)
    tensorboard: bool = option(False, "also log to TensorBoard (if installed)", group=LOGS)
    no_progress: bool = option(False, group=LOGS, per_run=False)
    no_plot: bool = option(False, group=LOGS, per_run=False)

    parity_every: int = option(0, "0 disables", group=PARITY)
    parity_threshold: float = option(1e-3, PARITY_THRESHOLD_HELP, group=PARITY)
    parity_strict: bool = option(False, "stop at the first divergence", group=PARITY)
    demo_vocab_size: int = option(DEMO_VOCAB_SIZE, group=PARITY, hidden=True, fixed=True)
    demo_corpus_max_docs: Optional[int] = option(None, group=PARITY, hidden=True, fixed=True)

    PRESETS: ClassVar[Dict[str, Dict[str, Any]]] = {"demo": DEMO}

    def check(self) -> None:
        positive = ("vocab_multiple", "pad_to_multiple_of", "global_batch_size", "micro_batch_size",
                    "phase2_global_batch_size", "phase2_micro_batch_size", "log_every", "eval_batches",
                    "max_predictions_per_seq", "threads", "demo_vocab_size", "stop_at_step", "max_skipped_steps",
                    "pack_tokens", "phase2_pack_tokens")
        at_least_zero = ("prefetch", "phase1_steps", "phase2_steps", "total_steps", "warmup_steps", "save_every",
                         "keep_last", "eval_every", "parity_every", "weight_decay", "adam_eps", "max_grad_norm")
        self.require_positive(*positive)
        self.require_non_negative(*at_least_zero)
        self.require_positive("lr")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"--beta1 and --beta2 must be in [0, 1), got {self.beta1} and {self.beta2}")
        if not 0.0 <= self.phase2_fraction < 1.0:
            raise ValueError(f"--phase2-fraction must be in [0, 1), got {self.phase2_fraction}")
        if self.masked_lm_prob is not None and not 0.0 < self.masked_lm_prob < 1.0:
            raise ValueError(f"--masked-lm-prob must be in (0, 1), got {self.masked_lm_prob}")
        self.require_positive("parity_threshold")
        packing = [flag for flag, value in (("--pack-tokens", self.pack_tokens),
                                            ("--phase2-pack-tokens", self.phase2_pack_tokens)) if value]
        if packing and not (self.static_shapes or self.cuda_graphs):
            raise ValueError(f"{' and '.join(packing)} size packed batches: add --static-shapes (or --cuda-graphs)")


# --------------------------------------------------------------------------- bertfast finetune
TASKS = ("classification", "regression", "token-classification", "qa", "multiple-choice")

# The paper's fine-tuning settings (section 4): GLUE batch 32 for 3 epochs, the learning rate
# picked on dev among 5e-5, 4e-5, 3e-5 and 2e-5; SQuAD v1.1 3 epochs at 5e-5, batch 32; SQuAD
# v2.0 2 epochs at 5e-5, batch 48; SWAG 3 epochs at 2e-5, batch 16. Sequence lengths, the
# document stride and the query length are those of the paper's released code.
_GLUE = dict(task="classification", max_seq_len=128, batch_size=32, epochs=3.0, lr=3e-5)
_SQUAD = dict(task="qa", max_seq_len=384, doc_stride=128, max_query_length=64, batch_size=32, epochs=3.0, lr=5e-5)
FINETUNE_RECIPES: Dict[str, Dict[str, Any]] = {
    "glue": _GLUE,
    "squad-v1.1": {**_SQUAD, "version_2": False},
    "squad-v2.0": {**_SQUAD, "version_2": True, "batch_size": 48, "epochs": 2.0},
    "swag": dict(task="multiple-choice", max_seq_len=128, batch_size=16, epochs=3.0, lr=2e-5),
}
TASK, FT_MODEL, TRAINING, COLUMNS, QA = ("task", "model", "training", "classification / regression / multiple "
                                         "choice columns", "question answering")


@dataclass
class FinetuneConfig(RunConfig):
    """Every option of ``bertfast finetune``; saved as run_config.json in the output directory."""

    PROG: ClassVar[str] = "bertfast finetune"
    DESCRIPTION: ClassVar[str] = "fine-tune a (pre-trained) BERT on a downstream task"

    recipe: Optional[str] = option(None, "start from the paper's settings for a benchmark (flags override them)",
                                   group=TASK, choices=tuple(FINETUNE_RECIPES))
    task: Optional[str] = option(None, "required (or from --recipe)", group=TASK, choices=TASKS)
    train_file: Optional[str] = option(None, "required", group=TASK)
    eval_file: Optional[str] = option(None, "evaluated after every epoch and at the end", group=TASK)

    model: Optional[str] = option(None, "local checkpoint directory (config.json, weights, vocab.txt)",
                                  group=FT_MODEL)
    preset: Optional[str] = option(None, "build a fresh model of this size instead (needs --vocab)", group=FT_MODEL)
    vocab: Optional[str] = option(None, "vocab.txt (or a directory with one); default: the --model directory's",
                                  group=FT_MODEL)
    config_overrides: List[str] = option([], "override a BertConfig field, e.g. --set hidden_dropout_prob=0.0 "
                                             "(repeatable)", group=FT_MODEL, flag="--set")
    output_dir: str = option(os.path.join("runs", "finetune"), group=FT_MODEL)
    no_save: bool = option(False, "write neither the fine-tuned model nor checkpoints", group=FT_MODEL)

    max_seq_len: int = option(128, group=TRAINING)
    batch_size: int = option(32, group=TRAINING)
    static_shapes: bool = option(False, "pack each training batch into one row of batch size x max_seq_len tokens "
                                        "(x choices, for multiple-choice): fixed shapes, no host read in the step",
                                 group=TRAINING)
    eval_batch_size: int = option(64, group=TRAINING)
    lr: float = option(3e-5, "0 keeps the pre-trained weights (a baseline)", group=TRAINING)
    epochs: float = option(3.0, group=TRAINING)
    warmup_fraction: float = option(0.1, group=TRAINING)
    weight_decay: float = option(0.01, group=TRAINING)
    adam_eps: float = option(1e-6, group=TRAINING)
    max_grad_norm: float = option(1.0, "0 disables clipping", group=TRAINING)
    precision: str = option("auto", "auto: bf16 autocast on CUDA, fp32 on CPU", group=TRAINING,
                            choices=("auto", "fp32", "bf16", "fp16"))
    device: Optional[str] = option(None, "default: cuda when available", group=TRAINING, choices=("cuda", "cpu"))
    seed: int = option(42, group=TRAINING)
    log_every: int = option(50, group=TRAINING)
    save_every: int = option(0, "also checkpoint every N steps (checkpoints are written at the end of every "
                                "epoch)", group=TRAINING)
    keep_last: int = option(2, "checkpoints kept in OUTPUT_DIR/checkpoints", group=TRAINING)
    resume: Optional[str] = option(None, RESUME_HELP, group=TRAINING, nargs="?", const="auto", per_run=False)
    stop_at_step: Optional[int] = option(None, STOP_AT_STEP_HELP, group=TRAINING, per_run=False)
    overwrite: bool = option(False, OVERWRITE_HELP, group=TRAINING, per_run=False)
    on_nonfinite: str = option("stop", NONFINITE_HELP, group=TRAINING, choices=("stop", "skip"))
    max_skipped_steps: int = option(10, MAX_SKIPPED_HELP, group=TRAINING)
    no_progress: bool = option(False, group=TRAINING, per_run=False)

    text_a: Optional[str] = option(None, "first text column (default: sentence1, sentence, text, ...)",
                                   group=COLUMNS)
    text_b: Optional[str] = option(None, "second text column of sentence pairs (default: sentence2, ... if "
                                         "present)", group=COLUMNS)
    label_column: str = option("label", group=COLUMNS)
    labels: Optional[str] = option(None, "comma-separated label names in id order (default: sorted from training)",
                                   group=COLUMNS)
    metric: Optional[str] = option(None, "metric printed first (default per task)", group=COLUMNS)
    no_header: bool = option(False, "CSV/TSV without a header: columns are 0,1,2,...", group=COLUMNS)
    context_column: str = option("sent1", group=COLUMNS)
    question_column: str = option("sent2", group=COLUMNS)
    choice_columns: str = option("ending0,ending1,ending2,ending3", group=COLUMNS)

    doc_stride: int = option(128, group=QA)
    max_query_length: int = option(64, group=QA)
    max_answer_length: int = option(30, group=QA)
    n_best: int = option(20, group=QA)
    version_2: Optional[bool] = option(None, "SQuAD v2.0 (default: detected from is_impossible questions)",
                                       group=QA)
    null_score_diff_threshold: float = option(0.0, group=QA)

    parity_every: int = option(0, "0 disables", group=PARITY)
    parity_threshold: float = option(1e-3, PARITY_THRESHOLD_HELP, group=PARITY)
    parity_strict: bool = option(False, "stop at the first divergence", group=PARITY)

    PRESETS: ClassVar[Dict[str, Dict[str, Any]]] = {name: {**values, "recipe": name}
                                                    for name, values in FINETUNE_RECIPES.items()}

    def check(self) -> None:
        self.require_positive("max_seq_len", "batch_size", "eval_batch_size", "log_every", "doc_stride",
                              "max_query_length", "max_answer_length", "n_best", "stop_at_step", "epochs",
                              "parity_threshold", "max_skipped_steps")
        self.require_non_negative("lr", "weight_decay", "adam_eps", "max_grad_norm", "save_every", "keep_last",
                                  "parity_every")
        if not 0.0 <= self.warmup_fraction <= 1.0:
            raise ValueError(f"--warmup-fraction must be in [0, 1], got {self.warmup_fraction}")
        if self.max_seq_len < 4:
            raise ValueError(f"--max-seq-len must be >= 4 ([CLS], [SEP] and a word piece or two), got "
                             f"{self.max_seq_len}")

    def check_runnable(self) -> None:
        """What a run needs beyond valid values: a task, data and a model."""
        if not self.task or not self.train_file:
            raise ValueError("--task and --train-file are required (--recipe sets --task)")
        if not self.model and not (self.preset and self.vocab):
            raise ValueError("give --model DIR (a checkpoint directory), or --preset NAME with --vocab")
        if self.stop_at_step is not None and self.no_save:
            raise ValueError("--stop-at-step writes a checkpoint to resume from; it cannot be used with --no-save")
