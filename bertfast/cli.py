"""The `bertfast` command: one subcommand per use of the package."""
from __future__ import annotations

import importlib
import sys
from typing import List, Optional

COMMANDS = {
    "info": ("bertfast.info", "what runs on this machine (backends, devices) and why not"),
    "parity": ("bertfast.parity", "fast model vs reference (and transformers) on a small random BERT"),
    "prepare": ("bertfast.data.prepare", "tokenise a corpus into pre-training shards"),
    "pretrain": ("bertfast.pretrain", "pre-train BERT (MLM + NSP), single GPU/CPU or torchrun"),
    "finetune": ("bertfast.finetune", "fine-tune on classification, NER, SQuAD or multiple choice"),
    "bench": ("bertfast.bench", "benchmark kernels and training steps against the usual alternatives"),
    "gpu-check": ("bertfast.gpucheck.runner", "the staged GPU check: plan, run (or --dry-run on CPU), land"),
    "compile-report": ("bertfast.gpucheck.compile_report", "registers/spills/shared memory of every kernel on sm_90"),
    "perf-model": ("bertfast.perfmodel.report", "H100 speed predicted from the kernels' sm_90 SASS, against the targets"),
}


# Commands whose module imports torch, transformers and the kernels (seconds): their --help is
# printed from a parser that imports none of them ("module:function" returning it).
LIGHT_HELP = {
    "pretrain": "bertfast.training.config:PretrainConfig.command_parser",
    "finetune": "bertfast.training.config:FinetuneConfig.command_parser",
    "info": "bertfast.info:parser",
    "parity": "bertfast.cli:parity_parser",
    "bench": "bertfast.bench.options:parser",
    "perf-model": "bertfast.perfmodel.report:parser",
}


def parity_parser():
    """`bertfast parity`'s options (its module imports torch and the models: they are here)."""
    import argparse
    parser = argparse.ArgumentParser(
        prog="bertfast parity",
        description="Fast model vs reference (and transformers when installed) on a small random BERT: loss, "
                    "hidden states and gradients, in fp32, with the largest differences and whether they are "
                    "within tolerance. Exit 1 when a path diverges.")
    parser.add_argument("--preset", default="small", help="model preset (default: small)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (default: cuda when torch sees a GPU)")
    return parser


def _light_parser(name: str):
    module, _, attr = LIGHT_HELP[name].partition(":")
    target = importlib.import_module(module)
    for part in attr.split("."):
        target = getattr(target, part)
    return target()


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:{width}s}  {help_}" for name, (_, help_) in COMMANDS.items())
    return f"usage: bertfast <command> [options]\n\ncommands:\n{rows}\n\n`bertfast <command> --help` for options."


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"bertfast: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if name in LIGHT_HELP and any(a in ("-h", "--help") for a in rest):
        _light_parser(name).print_help()
        return 0
    try:
        module = importlib.import_module(COMMANDS[name][0])
        return int(module.main(rest) or 0)
    except ImportError as exc:
        missing_dependency = isinstance(exc, ModuleNotFoundError) or "pip install" in str(exc)
        if not missing_dependency:
            raise
        print(f"bertfast {name}: {exc}\n(the extras: pip install 'bertfast[train]', '[bench]', '[hf]' or "
              f"'[test]' for all)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
