"""`python -m bertfast.bench.readme [RESULTS_DIR ...]`: the README's result table, from the filed GPU runs.

The table sits between the lines ``<!-- results:begin -->`` and ``<!-- results:end -->`` of
the README; everything else in the file is left as it is. Only GPU runs go there: the targets
are GPU targets, and a CPU run measures none of them. A GPU loan measures some targets, not all
(the loan's parts: docs/gpu-check.md), so each line is the newest run that measured its target
(met or not met, or a value from part of its cases), named on the line; a target no run measured
shows the newest run's line.
Without RESULTS_DIR, every run filed under benchmarks/results/.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
from typing import List, Optional, Sequence, Tuple

from bertfast.bench import report
from bertfast.bench.results import Run

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def _cell(text: str) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


MEASURED = ("met", "not met")
Filed = Tuple[Run, str]  # a run and its directory, as the README names it


def render_table(runs: Sequence[Filed]) -> str:
    """Markdown: one line per target of the newest run, each from the newest run that measured it."""
    value = lambda v: "" if v is None else f"{v:.3g}"  # noqa: E731
    runs = sorted(runs, key=lambda filed: filed[0].date, reverse=True)
    newest = runs[0][0]
    lines = ["Each target's line is the newest GPU run that measured it (met / not met, or a value from part of "
             "its cases: not measured), evaluated when that run was filed; the newest run: "
             f"{newest.device.name}, {newest.date[:10]} (`{runs[0][1]}`).", "",
             "| target | status | value | detail | run |", "| --- | --- | --- | --- | --- |"]

    def measured(t, target) -> bool:
        return t.get("id") == target.get("id") and (t["status"] in MEASURED or t["value"] is not None)

    for target in newest.targets:
        run, where, line = next(((run, where, t) for run, where in runs for t in run.targets if measured(t, target)),
                                (newest, runs[0][1], target))
        lines.append(f"| {_cell(line['target'])} | {line['status']} | {value(line['value'])} | {_cell(line['detail'])} "
                     f"| {_cell(run.device.name)}, `{where}` |")
    return "\n".join(lines)


def update_readme(readme_path: str, runs: Sequence[Filed]) -> None:
    """Replace the text between the result markers of ``readme_path`` with the runs' table."""
    if not runs:
        raise ValueError("readme: expected at least one GPU run")
    for run, where in runs:
        if not run.device.is_cuda:
            raise ValueError(f"readme: {where} is a CPU run; the README's table shows GPU runs only")
    with open(readme_path, encoding="utf-8") as f:
        text = f.read()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"readme: expected the lines {BEGIN} and {END} (in that order) in {readme_path}")
    new = text[:start + len(BEGIN)] + "\n" + render_table(runs) + "\n" + text[end:]
    with open(readme_path, "w", encoding="utf-8") as f:
        f.write(new)


def filed_runs(repo: str, dirs: Optional[Sequence[str]] = None) -> List[Filed]:
    """The runs in ``dirs`` (default: every one under ``repo``/benchmarks/results), each with its
    directory relative to ``repo``."""
    if not dirs:
        dirs = sorted(os.path.dirname(p) for p in glob.glob(os.path.join(repo, "benchmarks", "results", "*", "*",
                                                                          "results.json")))
    runs = []
    for d in dirs:
        path = os.path.join(d, "results.json")
        if not os.path.exists(path):
            raise ValueError(f"readme: expected {path}")
        runs.append((report.load(path), os.path.relpath(d, repo)))
    return runs


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bertfast.bench.readme", description=__doc__.split("\n")[0])
    p.add_argument("results_dirs", nargs="*", help="directories holding results.json (GPU runs); "
                   "default: every run under benchmarks/results/")
    p.add_argument("--readme", default="README.md")
    args = p.parse_args(argv)
    repo = os.path.dirname(os.path.abspath(args.readme))
    try:
        update_readme(args.readme, filed_runs(repo, args.results_dirs))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"updated the result table of {args.readme}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
