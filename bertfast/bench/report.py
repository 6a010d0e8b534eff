"""Write a run: results.json (everything), results.md (tables + targets), PNG speedup plots.

Speedups are ratios of median times against the baseline of the same group, case and
direction: torch eager for the kernel suite, transformers (sdpa, eager) for the model suite.
"""
from __future__ import annotations

import json
import math
import os
import textwrap
from typing import Any, Dict, List, Optional, Tuple

from bertfast.bench.clocks import describe as describe_clocks
from bertfast.bench.results import HF_EAGER, TORCH_EAGER, Row, Run, case_text

BASELINE = {"kernels": TORCH_EAGER, "model": HF_EAGER, "overhead": TORCH_EAGER}
CPU_BANNER = ("**CPU run.** These are CPU timings (time.perf_counter) of reference and, with "
              "TRITON_INTERPRET=1, Triton-interpreter paths on {shapes} ({purpose}). They say nothing "
              "about GPU performance.")


def cpu_shapes(run: Run) -> Tuple[str, str]:
    """A CPU run's (shapes, what they are for): tiny ones test the harness; without --quick the
    model suite runs the MiniLM-sized cases CPU users run, against transformers."""
    if run.config.get("cpu_model_cases"):
        return "tiny kernel shapes and MiniLM-sized model cases", "the ratio against transformers is the figure"
    return "tiny shapes", "they check that the harness and the parity gate work"


# --------------------------------------------------------------------------- speedups
def baseline_row(run: Run, row: Row) -> Optional[Row]:
    name = BASELINE.get(row.suite)
    for r in run.rows:
        if (r.suite == row.suite and r.group == row.group and r.case == row.case
                and r.direction == row.direction and r.impl == name and r.ok):
            return r
    return None


def speedup(run: Run, row: Row) -> Optional[float]:
    """Baseline median time / this row's median time (None when either is missing)."""
    if not row.ok:
        return None
    base = baseline_row(run, row)
    if base is None or base is row:
        return None
    return base.time_ms.median / row.time_ms.median


# --------------------------------------------------------------------------- formatting
def _fmt(x: Optional[float], digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def _stat(row: Row, name: str, scale: float = 1.0, digits: int = 3) -> str:
    s = row.metrics.get(name)
    return "" if s is None else _fmt(s.median * scale, digits)


def _time(row: Row) -> str:
    t = row.time_ms
    if t is None:
        return ""
    return f"{_fmt(t.median, 4)} [{_fmt(t.p20, 3)}, {_fmt(t.p80, 3)}]"


def _status(row: Row) -> str:
    if row.ok:
        return "ok"
    reason = row.reason.replace("|", "/").replace("\n", " ")
    if len(reason) > 160:
        reason = reason[:157] + "..."
    return f"**{row.status}**: {reason}" if row.status != "skipped" else f"skipped: {reason}"


def _mem(row: Row) -> str:
    if row.memory is None:
        return ""
    return f"{row.memory.peak_bytes / 2**20:,.0f} (+{row.memory.peak_delta_bytes / 2**20:,.0f})"


def _host(row: Row) -> str:
    s = row.metrics.get("host_us")
    return "" if s is None else f"{_fmt(s.median, 4)} [{_fmt(s.p20, 3)}, {_fmt(s.p80, 3)}]"


def _extra_us(run: Run, row: Row) -> Optional[float]:
    """Overhead suite: host us of this row minus its torch eager row's (None without one)."""
    base = baseline_row(run, row)
    if not row.ok or base is None or base is row or "host_us" not in row.metrics:
        return None
    return row.metrics["host_us"].median - base.metrics["host_us"].median


def _table(header: List[str], lines: List[List[str]]) -> List[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return out


def markdown(run: Run) -> str:
    d = run.device
    md: List[str] = [f"# bertfast benchmark — {d.name}", ""]
    if not d.is_cuda:
        shapes, purpose = cpu_shapes(run)
        md += [CPU_BANNER.format(shapes=shapes, purpose=purpose), ""]
    md += [f"- date: {run.date}", f"- device: {d.describe()}"]
    if d.copy_bandwidth_gbps is not None:
        md.append(f"- measured copy bandwidth: {_fmt(d.copy_bandwidth_gbps.median, 4)} GB/s "
                  f"[p20 {_fmt(d.copy_bandwidth_gbps.p20, 4)}, p80 {_fmt(d.copy_bandwidth_gbps.p80, 4)}] "
                  f"({d.calibration.get('copy', '')}){_while(d.calibration.get('copy_clocks'))}")
    if d.peak_matmul_tflops is not None:
        md.append(f"- measured peak matmul: {_fmt(d.peak_matmul_tflops.median, 4)} TFLOP/s "
                  f"[p20 {_fmt(d.peak_matmul_tflops.p20, 4)}, p80 {_fmt(d.peak_matmul_tflops.p80, 4)}] "
                  f"({d.calibration.get('matmul', '')}){_while(d.calibration.get('matmul_clocks'))}")
    if getattr(d, "datasheet_bf16_tflops", None):
        md.append(f"- datasheet dense bf16 peak: {_fmt(d.datasheet_bf16_tflops, 4)} TFLOP/s (the MFU targets' peak)")
    md.append(f"- config: `{json.dumps(_without_tuned(run.config), sort_keys=True)}`")
    md += ["", "Times in ms: median [p20, p80]. Speedup: baseline median / median (kernels: vs torch eager; "
               "model: vs transformers sdpa eager).", ""]

    md += ["## Targets", ""]
    md += _table(["target", "status", "value", "detail", "device"],
                 [[t["target"], f"**{t['status']}**", _fmt(t["value"]), t["detail"].replace("|", "/"), t["device"]]
                  for t in run.targets])
    md.append("")

    kernels = [r for r in run.rows if r.suite == "kernels"]
    if kernels:
        md += ["## Kernel suite", ""]
        # GB/s and % copy BW from the cold-L2 time where a small kernel's time is a warm re-timing
        md += _table(["op", "case", "dir", "impl", "time ms", "timing", "cold-L2 ms", "host us", "GB/s (cold L2)",
                      "% copy BW", "TFLOP/s", "speedup", "status"],
                     [[r.group, r.case_key(), r.direction, r.impl, _time(r), r.timing, _stat(r, "cold_l2_ms"),
                       _stat(r, "host_us"), _stat(r, "gbps"), _stat(r, "pct_copy_bw"), _stat(r, "tflops"),
                       _fmt(speedup(run, r)), _status(r)]
                      for r in kernels])
        md.append("")
    model = [r for r in run.rows if r.suite == "model"]
    if model:
        md += ["## Model suite", ""]
        md += _table(["benchmark", "case", "impl", "time ms", "seq/s", "real tokens/s", "MFU % (measured peak)",
                      "MFU % (datasheet)", "peak MiB (+delta)", "speedup", "status"],
                     [[r.group, r.case_key(), r.impl, _time(r), _stat(r, "seq_per_s"), _stat(r, "tokens_per_s"),
                       _stat(r, "mfu", 100.0), _stat(r, "mfu_datasheet", 100.0), _mem(r), _fmt(speedup(run, r)),
                       _status(r)]
                      for r in model])
        md.append("")
    overhead = [r for r in run.rows if r.suite == "overhead"]
    if overhead:
        md += ["## Overhead suite", "", "Host microseconds per call on tiny inputs (median [p20, p80]); "
               "+us vs torch eager: this row's median minus the plain-PyTorch row's.", ""]
        md += _table(["op", "case", "dir", "impl", "host us/call", "+us vs torch eager", "status"],
                     [[r.group, r.case_key(), r.direction, r.impl, _host(r), _fmt(_extra_us(run, r)), _status(r)]
                      for r in overhead])
        md.append("")
    md += _clocks_section(run)
    tuned = tuned_rows(run.config)
    if tuned:
        md += ["## Autotuned configs", "", "The config Triton's autotuner chose for each kernel and tuning key "
               "in this run (the timings above ran them; `bertfast perf-model` predicts the same ones).", ""]
        md += _table(["kernel", "tuning key", "config"], tuned)
        md.append("")
    md += ["## Conventions", "", "```", (run.to_dict()["conventions"]), "```", ""]
    if run.notes:
        md += ["## Notes", ""] + [f"- {n}" for n in run.notes] + [""]
    return "\n".join(md)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _while(clocks: Optional[Dict]) -> str:
    text = describe_clocks(clocks or {})
    return f"; while timed: {text}" if text else ""


def _clocks_section(run: Run) -> List[str]:
    """Each model-suite row's clocks, and the spread of the kernel suite's (bench.clocks)."""
    model = [r for r in run.rows if r.suite == "model" and r.clocks]
    kernels = [r for r in run.rows if r.suite == "kernels" and r.clocks]
    if not model and not kernels:
        return []
    md = ["## Clocks", "", "The GPU's SM clock, memory clock, power and temperature while each case was timed "
          "(nvidia-smi every 100 ms, the samples with the GPU busy: median [p20, p80]), and the clock limits "
          "active in them.", ""]
    if model:
        md += _table(["benchmark", "case", "impl", "clocks"],
                     [[r.group, r.case_key(), r.impl, describe_clocks(r.clocks)] for r in model])
        md.append("")
    if kernels:
        sm = sorted(r.clocks["sm_mhz"]["median"] for r in kernels if "sm_mhz" in r.clocks)
        limited = sum(1 for r in kernels if r.clocks.get("limits"))
        unread = sum(1 for r in kernels if "error" in r.clocks)
        spread = f"SM clock medians from {sm[0]:,.0f} to {sm[-1]:,.0f} MHz" if sm else "no SM clock read"
        md += [f"Kernel suite, {_count(len(kernels), 'row')}: {spread}; a clock limit active in "
               f"{_count(limited, 'row')}" + (f"; {unread} not sampled" if unread else "")
               + " (results.json has each row's).", ""]
    return md


def _without_tuned(config: Dict) -> Dict:
    """The run's config less its autotuner choices (and its merged parts' alike): they get a table."""
    out = {k: v for k, v in config.items() if k != "tuned_configs"}
    if isinstance(out.get("parts"), list):
        out["parts"] = [_without_tuned(p) if isinstance(p, dict) else p for p in out["parts"]]
    return out


def tuned_choices(config: Dict) -> Dict[str, Dict[Tuple, str]]:
    """kernel -> tuning key -> the config the run's autotuner chose (a merged run's parts together, once
    each; the perf model predicts those configs: perfmodel/suite.py)."""
    found: Dict[str, Dict[Tuple, str]] = {}
    for part in [config] + [p for p in config.get("parts") or [] if isinstance(p, dict)]:
        for kernel, chosen in (part.get("tuned_configs") or {}).items():
            for c in chosen:
                found.setdefault(kernel, {})[tuple(c["key"])] = c["config"]
    return found


def tuned_rows(config: Dict) -> List[List[str]]:
    """[kernel, key, config] of the run's autotuner choices, one row each."""
    rows = sorted((kernel, json.dumps(list(key)), chosen)
                  for kernel, by_key in tuned_choices(config).items() for key, chosen in by_key.items())
    return [[kernel, f"`{key}`", chosen] for kernel, key, chosen in rows]


def summary(run: Run) -> str:
    """The table printed at the end of a run (plain text, one line per row), then the targets."""
    header = ["suite", "benchmark", "case", "dir", "impl", "median ms", "figure", "speedup", "status"]
    lines = []
    for r in run.rows:
        wanted = ((("pct_copy_bw", "% copy BW", 1.0), ("tflops", "TFLOP/s", 1.0)) if r.suite == "kernels"
                  else (("host_us", "host us/call", 1.0),) if r.suite == "overhead"
                  else (("tokens_per_s", "tok/s", 1.0), ("mfu", "% MFU", 100.0),
                        ("mfu_datasheet", "% MFU datasheet", 100.0)))
        figure = ", ".join(f"{_fmt(r.metrics[name].median * scale)} {unit}"
                           for name, unit, scale in wanted if name in r.metrics)
        status = "ok" if r.ok else f"{r.status}: {r.reason}"
        if len(status) > 90:
            status = status[:87] + "..."
        lines.append([r.suite, r.group, r.case_key(), r.direction, r.impl,
                      _fmt(r.time_ms.median, 4) if r.time_ms else "", figure, _fmt(speedup(run, r)), status])
    widths = [min(max([len(h)] + [len(l[i]) for l in lines]), 60) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    out += ["  ".join(c.ljust(w) for c, w in zip(l, widths)) for l in lines]
    if not run.device.is_cuda:
        out.insert(0, plot_note(run) + ".")
    out += ["", f"targets ({run.device.name}):"]
    out += [f"  [{t['status']}] {t['target']}" + (f" - {t['detail']}" if t["detail"] else "") for t in run.targets]
    return "\n".join(out)


# --------------------------------------------------------------------------- plots
# Fields that follow from the others (padding gives real_tokens and fill, the masking rate gives
# predictions): left off a plot's labels when the rows stay distinct without them.
DERIVED_FIELDS = ("real_tokens", "fill", "predictions")


def case_fields(rows: List[Row]) -> Tuple[List[str], Dict[str, Any]]:
    """(the fields that tell ``rows`` apart, the fields every row shares with their value): a group's
    plot labels its bars with the first and names the second once, in its title."""
    keys: List[str] = []
    for r in rows:
        keys += [k for k in r.case if k not in keys]
    values = {k: {repr(r.case.get(k)) for r in rows} for k in keys}
    shared = {k: rows[0].case.get(k) for k in keys if len(values[k]) == 1 and all(k in r.case for r in rows)}
    varying = [k for k in keys if k not in shared]
    core = [k for k in varying if k not in DERIVED_FIELDS]
    distinct = len({(tuple(repr(r.case.get(k)) for k in core), r.direction, r.impl) for r in rows}) == len(rows)
    return (core if distinct else varying), shared


def _speedup_series(run: Run, suite: str) -> Dict[str, Tuple[str, List[Tuple[str, str, float]]]]:
    """group -> (its title, [(case label, impl, speedup)]) for ok non-baseline rows with a baseline; a
    label names the case fields that vary within the group and the direction, the title the others."""
    rows: Dict[str, List[Tuple[Row, float]]] = {}
    for r in run.rows:
        if r.suite != suite or r.impl == BASELINE[suite]:
            continue
        s = speedup(run, r)
        if s is not None:
            rows.setdefault(r.group, []).append((r, s))
    series = {}
    for group, measured in rows.items():
        shown, shared = case_fields([r for r, _ in measured])
        title = group + (f" ({case_text(shared)})" if shared else "")
        series[group] = (title, [(" ".join(filter(None, (case_text({k: r.case[k] for k in shown if k in r.case}),
                                                          r.direction))), r.impl, s) for r, s in measured])
    return series


def plot_note(run: Run) -> Optional[str]:
    """What a CPU run's plot says on itself: tiny shapes time the harness, not the kernels."""
    if run.device.is_cuda:
        return None
    if run.config.get("cpu_model_cases"):
        return ("CPU timings (perf_counter). Kernel rows: tiny shapes, which measure the harness (Python, dispatch), "
                "not kernel speed; model rows: MiniLM-sized steps against transformers on this CPU")
    return ("CPU timings (perf_counter) of tiny shapes: these ratios measure the harness (Python, dispatch, "
            "interpreter), not kernel speed, and say nothing of a GPU")


def plot_speedups(run: Run, suite: str, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _speedup_series(run, suite)
    title = (f"{suite}: speedup vs {BASELINE[suite]} - {run.device.name}"
             + ("" if run.device.is_cuda else " (CPU timings)"))
    note = plot_note(run)
    header = [title] + (textwrap.wrap(note, 110) if note else [])
    header_in = 0.2 * len(header) + 0.15  # inches above the first axes
    if not series:
        fig, ax = plt.subplots(figsize=(10, 1.5 + header_in))
        ax.text(0.5, 0.5, "no speedups measured in this run", ha="center", va="center")
        ax.set_axis_off()
        _header(fig, header, header_in)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
    impls = sorted({impl for _, rows in series.values() for _, impl, _ in rows})
    colors = {impl: plt.get_cmap("tab10")(i % 10) for i, impl in enumerate(impls)}
    heights = [max(1.2, 0.25 * len(rows) + 0.8) for _, rows in series.values()]
    fig, axes = plt.subplots(len(series), 1, figsize=(10, sum(heights) + header_in), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (group_title, rows) in zip(axes[:, 0], series.values()):
        labels = [f"{case} | {impl}" for case, impl, _ in rows]
        ys = list(range(len(rows)))
        ax.barh(ys, [s for _, _, s in rows], color=[colors[impl] for _, impl, _ in rows])
        ax.axvline(1.0, color="black", linewidth=0.8)
        values = [s for _, _, s in rows]
        if max(values) / max(min(values), 1e-12) > 20:
            ax.set_xscale("log")
        ax.set_yticks(ys)
        ax.set_yticklabels(labels, fontsize=6)
        ax.invert_yaxis()
        ax.set_title(group_title, fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    axes[-1, 0].set_xlabel(f"speedup (x) vs {BASELINE[suite]}")
    _header(fig, header, header_in)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _header(fig, lines: List[str], header_in: float) -> None:
    """The title, then a CPU run's note (in red: it changes how every bar is read), above the axes."""
    top = 1 - header_in / fig.get_figheight()
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.text(0.5, 1 - 0.08 / fig.get_figheight(), lines[0], ha="center", va="top", fontsize=9)
    if len(lines) > 1:
        fig.text(0.5, 1 - 0.3 / fig.get_figheight(), "\n".join(lines[1:]), ha="center", va="top", fontsize=8,
                 color="darkred")


# --------------------------------------------------------------------------- all outputs
def write(run: Run, out_dir: str) -> Dict[str, str]:
    """results.json, results.md, kernels_speedup.png, model_speedup.png in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {
        "json": os.path.join(out_dir, "results.json"),
        "markdown": os.path.join(out_dir, "results.md"),
        "kernels_png": os.path.join(out_dir, "kernels_speedup.png"),
        "model_png": os.path.join(out_dir, "model_speedup.png"),
    }
    write_json(run, out_dir)
    with open(paths["markdown"], "w", encoding="utf-8") as f:
        f.write(markdown(run))
    plot_speedups(run, "kernels", paths["kernels_png"])
    plot_speedups(run, "model", paths["model_png"])
    return paths


def write_json(run: Run, out_dir: str) -> str:
    """results.json alone (what a run saves after each case), whole or not at all: written aside, then
    renamed over the old one, so a run killed while writing leaves the previous file."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "results.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(_finite(run.to_dict()), f, indent=1, allow_nan=False, default=_json_default)
        f.write("\n")
    os.replace(path + ".tmp", path)
    return path


def _finite(obj):
    """JSON has no inf/NaN: write them as null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _json_default(obj):
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def load(path: str) -> Run:
    with open(path, encoding="utf-8") as f:
        return Run.from_dict(json.load(f))
