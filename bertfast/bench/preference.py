"""The backend preference table: which fast backend (triton or cuda) each op should prefer on
a GPU model, as measured by `bertfast bench` on that GPU.

After a GPU run, for every op timed on both fast backends, the one with the lower geometric
mean of its fwd+bwd (else fwd) median time over the shared cases comes first; an op that another
case decides (bertfast.registry's preference_case: bias_gelu by the FFN, where training runs it)
takes that case's times, and without them keeps its default order. The table is a JSON file keyed
by GPU name (``bertfast.dispatch.preference_file()``); dispatch reads it for
CUDA inputs on that GPU and otherwise keeps its default order.
"""
from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from typing import Dict, List, Optional

from bertfast import dispatch
from bertfast.bench.results import BERTFAST, Run

FAST = ("triton", "cuda")


def measured_order(run: Run) -> Dict[str, List[str]]:
    """op -> backends, fastest first, from the rows of one run (ops timed on both fast backends)."""
    times: Dict[str, Dict[str, Dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for direction in ("fwd+bwd", "fwd"):
        for row in run.rows:
            if row.suite != "kernels" or not row.ok or row.direction != direction or row.time_ms is None:
                continue
            if not row.impl.startswith(BERTFAST + ":"):
                continue
            backend, _, variant = row.impl[len(BERTFAST) + 1:].partition(" ")
            if backend in FAST:
                times[row.group][backend].setdefault(f"{variant}|{row.case_key()}", row.time_ms.median)
        if times:
            break
    from bertfast import registry
    for spec in registry.ops():  # bias_gelu's order from the FFN, where training runs it, or none
        if spec.preference_case is not None:
            times.pop(spec.name, None)
            if spec.preference_case in times:
                times[spec.name] = times.pop(spec.preference_case)
    order: Dict[str, List[str]] = {}
    for op, per_backend in times.items():
        if set(per_backend) != set(FAST):
            continue
        shared = set(per_backend["triton"]) & set(per_backend["cuda"])
        if not shared:
            continue
        log_ratio = sum(math.log(per_backend["cuda"][c] / per_backend["triton"][c]) for c in shared) / len(shared)
        order[op] = ["cuda", "triton"] if log_ratio < 0 else ["triton", "cuda"]
    return order


def record(run: Run, path: Optional[str] = None) -> Optional[str]:
    """Merge this run's measured order into the table for its GPU; returns the file written, if any."""
    if run.device.kind != "cuda":
        return None
    order = measured_order(run)
    if not order:
        return None
    path = path or dispatch.preference_file()
    table = dispatch.read_preferences(path)
    table.setdefault(run.device.name, {}).update(order)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=2, sort_keys=True)
    os.replace(tmp, path)
    dispatch.reload_preferences()
    return path
