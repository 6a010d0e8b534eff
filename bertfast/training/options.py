"""Run options from the command line, a JSON file (``--config run.json``) and ``--set KEY=VALUE``."""
from __future__ import annotations

import json
from typing import Any, Dict, Sequence


def parse_overrides(items: Sequence[str]) -> Dict[str, Any]:
    """``--set KEY=VALUE`` flags -> config overrides; VALUE is read as JSON when it parses, else as a string."""
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


def load_json_config(path: str) -> Dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        try:
            values = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a JSON object of option names to values")
    return values


def set_parser_defaults(parser, values: Dict[str, Any], source: str) -> None:
    """Make ``values`` (option names with '-' or '_') the parser's defaults; unknown keys are errors."""
    dests = {a.dest for a in parser._actions}
    normalised = {}
    for k, v in values.items():
        dest = k.lstrip("-").replace("-", "_")
        if dest not in dests:
            raise ValueError(f"{source}: unknown option {k!r}")
        normalised[dest] = v
    parser.set_defaults(**normalised)


def apply_config_file(parser, argv: Sequence[str], config_key: str = "config"):
    """Parse ``argv``; if it names a JSON config file, its values become defaults under the flags."""
    args, _ = parser.parse_known_args(argv)
    path = getattr(args, config_key, None)
    if path:
        set_parser_defaults(parser, load_json_config(path), path)
    return parser.parse_args(argv)
