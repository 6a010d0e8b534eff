"""`python -m bertfast.bench.merge --out DIR PART [PART ...]`: one run from several benchmark runs.

The staged GPU check runs the benchmark in parts (the headline step, the kernel suite, the rest),
each its own `bertfast bench` invocation with its own results directory. This merges them into
one run on one device: rows in order, notes once each, the targets evaluated on all the rows
together, and writes results.json / results.md / plots like a single run.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence

from bertfast.bench import report
from bertfast.bench.results import Run
from bertfast.bench.targets import evaluate_targets


def merge_runs(dirs: Sequence[str]) -> Run:
    """The runs in ``dirs`` (each holding a results.json) as one run; they must share a device."""
    if not dirs:
        raise ValueError("merge: expected at least one results directory, got none")
    runs = []
    for d in dirs:
        path = os.path.join(d, "results.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"merge: expected {path}")
        runs.append(report.load(path))
    first = runs[0]
    for d, run in zip(dirs[1:], runs[1:]):
        if run.device.name != first.device.name:
            raise ValueError(f"merge: {dirs[0]} ran on {first.device.name!r} but {d} on {run.device.name!r}")
    merged = Run(device=first.device, config={"merged_from": list(dirs), "parts": [r.config for r in runs]},
                 date=max(r.date for r in runs))
    for run in runs:
        merged.rows += run.rows
        merged.notes += [n for n in run.notes if n not in merged.notes]
    merged.targets = evaluate_targets(merged)
    return merged


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bertfast.bench.merge", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for the merged results")
    p.add_argument("parts", nargs="+", help="results directories of the runs to merge")
    args = p.parse_args(argv)
    try:
        run = merge_runs(args.parts)
    except (FileNotFoundError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 2
    paths = report.write(run, args.out)
    print(report.summary(run))
    print(f"merged {len(args.parts)} run(s) ({len(run.rows)} rows) into {paths['json']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
