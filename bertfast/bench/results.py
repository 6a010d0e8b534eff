"""One benchmark figure = one Row; a run = device + config + rows (+ targets), saved as JSON.

A row is an (op or model config, case, direction, implementation) and either a timing with
derived figures (status ``ok``), or no timing at all: ``FAILED PARITY`` (the implementation
disagreed with the reference on the same inputs, so its speed is not reported), ``skipped``
(it cannot run here, with the reason) or ``error`` (it raised while being timed).
"""
from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from bertfast.bench.timing import Memory, Stat

SCHEMA = "bertfast.bench/1"

OK = "ok"
FAILED_PARITY = "FAILED PARITY"
SKIPPED = "skipped"
ERROR = "error"
STATUSES = (OK, FAILED_PARITY, SKIPPED, ERROR)

# Implementation names shared by the suites, the targets and the report.
BERTFAST = "bertfast"  # kernel rows: "bertfast:<backend>[ <variant>]"; model rows: the fast model
FAST_BACKENDS = ("triton", "cuda")  # "bertfast:torch" is the reference backend through dispatch
TORCH_EAGER = "torch eager"
TORCH_COMPILE = "torch.compile"
TORCH_FUSED = "torch fused"  # torch.optim with fused=True
TORCH_FOREACH = "torch foreach"  # torch.optim with foreach=True
SDPA_FLASH = "sdpa:flash"
SDPA_MEM_EFFICIENT = "sdpa:mem_efficient"
SDPA_CUDNN = "sdpa:cudnn"
FULL_HEAD = "full-sequence head"
GEMM_FLOOR = "gemm floor"
BERTFAST_STATIC = "bertfast static shapes"  # model rows: `bertfast pretrain --static-shapes`'s step
BERTFAST_GRAPHS = "bertfast cuda graphs"    # ... and `--cuda-graphs`'s
BERTFAST_REFERENCE = "bertfast reference"
HF_EAGER = "transformers sdpa eager"
HF_COMPILED = "transformers sdpa compiled"
ONNXRUNTIME = "onnxruntime fp32"  # the embeddings benchmark: transformers' encoder exported to ONNX


def case_text(case: Dict[str, Any]) -> str:
    """A case as its fields, "batch=2,seqlen=16,...": what tells it apart in logs, tables and plots."""
    return ",".join(f"{k}={v}" for k, v in case.items())


def impl_family(impl: str) -> str:
    """The family of an implementation name (one of bertfast.bench.options.IMPL_FAMILIES)."""
    if impl == BERTFAST_REFERENCE:
        return "reference"
    if impl in (BERTFAST_STATIC, BERTFAST_GRAPHS):
        return "static-shapes"
    if impl == BERTFAST or impl.startswith(BERTFAST + ":"):
        return "bertfast"
    if impl in (TORCH_EAGER, TORCH_FUSED, TORCH_FOREACH, FULL_HEAD, GEMM_FLOOR):
        return "eager"
    if impl == TORCH_COMPILE:
        return "compiled"
    if impl.startswith("sdpa:"):
        return "sdpa"
    if impl == HF_EAGER:
        return "transformers"
    if impl == HF_COMPILED:
        return "transformers-compiled"
    if impl == ONNXRUNTIME:
        return "onnxruntime"
    raise ValueError(f"unknown implementation {impl!r}: no family")


def bertfast_impl(backend: str, variant: str = "") -> str:
    return f"{BERTFAST}:{backend}" + (f" {variant}" if variant else "")


def is_fast_impl(impl: str) -> bool:
    """A bertfast kernel row on a fast backend (triton or cuda), not the torch reference backend."""
    if not impl.startswith(BERTFAST + ":"):
        return False
    return impl[len(BERTFAST) + 1:].split(" ")[0] in FAST_BACKENDS


@dataclass
class Row:
    suite: str  # "kernels" | "model"
    group: str  # op name ("attention_varlen", ...) or model benchmark ("pretrain_step", ...)
    case: Dict[str, Any]  # shape / config parameters, JSON-serialisable
    direction: str  # "fwd" | "bwd" | "fwd+bwd" | "step" | "inference"
    impl: str  # "bertfast:triton", "torch eager", "torch.compile", "sdpa:flash", "transformers sdpa eager", ...
    status: str = OK
    reason: str = ""  # why skipped / the parity error / the exception
    time_ms: Optional[Stat] = None
    metrics: Dict[str, Stat] = field(default_factory=dict)  # gbps, pct_copy_bw, tflops, mfu, seq_per_s, ...
    memory: Optional[Memory] = None
    parity: Dict[str, Any] = field(default_factory=dict)  # what the gate measured
    work: Dict[str, float] = field(default_factory=dict)  # bytes / flops / tokens the figures divide
    timing: str = ""  # how time_ms was measured (see bertfast.bench.timing.METHODS)
    clocks: Dict[str, Any] = field(default_factory=dict)  # the GPU's while timed (bertfast.bench.clocks)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"row status must be one of {STATUSES}, got {self.status!r}")
        if self.status != OK and (self.time_ms is not None or self.metrics):
            raise ValueError(f"a {self.status!r} row carries no timing or figures ({self.group} {self.impl})")

    @property
    def ok(self) -> bool:
        return self.status == OK

    def case_key(self) -> str:
        return case_text(self.case)

    def label(self) -> str:
        return f"{self.group} [{self.case_key()}] {self.direction}"

    def metric(self, name: str) -> Optional[float]:
        stat = self.metrics.get(name)
        return None if stat is None else stat.median

    def to_dict(self) -> Dict[str, Any]:
        return {
            "suite": self.suite, "group": self.group, "case": dict(self.case), "direction": self.direction,
            "impl": self.impl, "status": self.status, "reason": self.reason,
            "time_ms": self.time_ms.to_dict() if self.time_ms else None,
            "metrics": {k: v.to_dict() for k, v in self.metrics.items()},
            "memory": self.memory.to_dict() if self.memory else None,
            "parity": dict(self.parity),
            "work": dict(self.work),
            "timing": self.timing,
            "clocks": dict(self.clocks),
        }

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Row":
        return cls(
            suite=d["suite"], group=d["group"], case=dict(d["case"]), direction=d["direction"], impl=d["impl"],
            status=d["status"], reason=d.get("reason", ""),
            time_ms=Stat.from_dict(d["time_ms"]) if d.get("time_ms") else None,
            metrics={k: Stat.from_dict(v) for k, v in d.get("metrics", {}).items()},
            memory=Memory(**d["memory"]) if d.get("memory") else None,
            parity=dict(d.get("parity", {})),
            work=dict(d.get("work", {})),
            timing=d.get("timing", ""),
            clocks=dict(d.get("clocks", {})),
        )


def skipped(suite: str, group: str, case: Dict[str, Any], direction: str, impl: str, reason: str) -> Row:
    return Row(suite, group, case, direction, impl, status=SKIPPED, reason=reason)


@dataclass
class Run:
    device: Any  # bertfast.bench.device.DeviceInfo
    config: Dict[str, Any]
    rows: List[Row] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    date: str = field(default_factory=lambda: _dt.datetime.now().astimezone().isoformat(timespec="seconds"))
    targets: List[Dict[str, Any]] = field(default_factory=list)

    def find(self, group: str, impl: Optional[str] = None, direction: Optional[str] = None,
             **case: Any) -> List[Row]:
        """Rows of ``group`` matching impl, direction and every given case field."""
        return [r for r in self.rows
                if r.group == group and (impl is None or r.impl == impl)
                and (direction is None or r.direction == direction)
                and all(r.case.get(k) == v for k, v in case.items())]

    def to_dict(self) -> Dict[str, Any]:
        from bertfast.bench.flops import __doc__ as conventions
        return {
            "schema": SCHEMA,
            "date": self.date,
            "device": self.device.to_dict(),
            "config": dict(self.config),
            "conventions": (conventions or "").strip(),
            "notes": list(self.notes),
            "targets": list(self.targets),
            "rows": [r.to_dict() for r in self.rows],
        }

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Run":
        from bertfast.bench.device import DeviceInfo
        if d.get("schema") != SCHEMA:
            raise ValueError(f"expected a {SCHEMA} results file, got schema {d.get('schema')!r}")
        return cls(device=DeviceInfo.from_dict(d["device"]), config=d["config"],
                   rows=[Row.from_dict(r) for r in d["rows"]], notes=list(d.get("notes", [])),
                   date=d["date"], targets=list(d.get("targets", [])))
