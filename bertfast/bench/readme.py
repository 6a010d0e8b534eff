"""`python -m bertfast.bench.readme RESULTS_DIR [--readme README.md]`: the README's result table from a run.

The table sits between the lines ``<!-- results:begin -->`` and ``<!-- results:end -->`` of
the README; everything else in the file is left as it is. Only GPU runs go there: the targets
are GPU targets, and a CPU run measures none of them.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from bertfast.bench import report
from bertfast.bench.results import Run

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def _cell(text: str) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def render_table(run: Run, results_dir: str) -> str:
    """Markdown: where the figures come from, then one line per target."""
    value = lambda v: "" if v is None else f"{v:.3g}"  # noqa: E731
    lines = [f"Measured on {run.device.name} on {run.date[:10]} (`{results_dir}`); every line is that run's "
             f"own evaluation (met / not met / not measured).", "",
             "| target | status | value | detail |", "| --- | --- | --- | --- |"]
    lines += [f"| {_cell(t['target'])} | {t['status']} | {value(t['value'])} | {_cell(t['detail'])} |"
              for t in run.targets]
    return "\n".join(lines)


def update_readme(readme_path: str, run: Run, results_dir: str) -> None:
    """Replace the text between the result markers of ``readme_path`` with the run's table."""
    if not run.device.is_cuda:
        raise ValueError(f"readme: {results_dir} is a CPU run; the README's table shows GPU runs only")
    with open(readme_path, encoding="utf-8") as f:
        text = f.read()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"readme: expected the lines {BEGIN} and {END} (in that order) in {readme_path}")
    new = text[:start + len(BEGIN)] + "\n" + render_table(run, results_dir) + "\n" + text[end:]
    with open(readme_path, "w", encoding="utf-8") as f:
        f.write(new)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bertfast.bench.readme", description=__doc__.split("\n")[0])
    p.add_argument("results_dir", help="a directory holding results.json (a GPU run)")
    p.add_argument("--readme", default="README.md")
    args = p.parse_args(argv)
    path = os.path.join(args.results_dir, "results.json")
    try:
        if not os.path.exists(path):
            raise ValueError(f"readme: expected {path}")
        update_readme(args.readme, report.load(path), args.results_dir)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"updated the result table of {args.readme} from {args.results_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
