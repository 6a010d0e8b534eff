"""The GPU's clocks, power and limit reasons while a case is timed (nvidia-smi, sampled every 100 ms).

Why: a kernel's time depends on the SM clock it ran at, and a GPU under sustained load lowers its
clock to stay within its power limit. In the H200 run of 2026-11-27 every kernel of the BERT-large
step replayed from a CUDA graph (back to back, the GPU never idle) took 5-16% longer than the same
kernel in the eager step (host-bound: the GPU idle most of the time), where 3% more tokens (the
static shapes' padding) explain only part of it. No run recorded its clocks, so the cause could not
be told apart from the kernels' own; a step's MFU is read against the clock it ran at from now on.

``ClockSampler(device)`` runs ``nvidia-smi --query-gpu ... -lms 100`` for the GPU as long as its
block lasts and ``summary()`` gives, over the samples the GPU was busy in (the idle reason unset):
the SM and memory clocks (MHz), the power draw (W) and temperature as Stats, the share of samples
each limit reason was active in, and the maxima the GPU allows. On a CPU it samples nothing and the
summary is empty; where nvidia-smi is missing or fails, the summary is ``{"error": ...}``, which the
report shows.
"""
from __future__ import annotations

import functools
import itertools
import shutil
import subprocess
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from bertfast.bench.timing import Stat, summarize

INTERVAL_MS = 100
SHORT_MS = 3 * INTERVAL_MS  # a block shorter than this may hold no busy sample; its summary is empty
# NVML's clock event reasons (nvidia-smi's clocks_event_reasons.active, a bit mask), by bit.
REASONS = {
    0x1: "idle",
    0x2: "applications clocks",
    0x4: "power cap",
    0x8: "hw slowdown",
    0x10: "sync boost",
    0x20: "sw thermal",
    0x40: "hw thermal",
    0x80: "power brake",
    0x100: "display clocks",
}
IDLE = 0x1
# The query's fields in order; drivers before 535 name the reasons clocks_throttle_reasons.
_FIELDS = ["clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "clocks_event_reasons.active"]
_OLD_REASONS = "clocks_throttle_reasons.active"
_STATIC = ["clocks.max.sm", "clocks.max.mem", "power.limit"]


def _number(text: str) -> Optional[float]:
    try:
        return float(text.strip())
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def _mask(text: str) -> Optional[int]:
    try:
        return int(text.strip(), 16)
    except ValueError:
        return None


def parse_samples(lines: Sequence[str]) -> List[Dict[str, Any]]:
    """nvidia-smi's csv,noheader,nounits lines of _FIELDS: one dict a line it could read."""
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(_FIELDS):
            continue
        sm, mem, power, temp = (_number(p) for p in parts[:4])
        mask = _mask(parts[4])
        if sm is None or mask is None:
            continue
        out.append({"sm_mhz": sm, "mem_mhz": mem, "power_w": power, "temp_c": temp, "reasons": mask})
    return out


def _busy(samples: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The samples taken with the GPU working (the idle reason unset)."""
    return [s for s in samples if not s["reasons"] & IDLE]


def summarize_samples(samples: Sequence[Dict[str, Any]], static: Optional[Dict[str, float]] = None
                      ) -> Dict[str, Any]:
    """The busy samples' clocks, power and temperature as Stat dicts, each limit reason's share of them
    (idle and none left out) and the GPU's maxima (``static``)."""
    busy = _busy(samples)
    if not busy:
        return {"error": f"no sample with the GPU busy ({len(samples)} idle)" if samples else "no sample read"}
    out: Dict[str, Any] = {"samples": len(busy), "idle_samples": len(samples) - len(busy)}
    for name in ("sm_mhz", "mem_mhz", "power_w", "temp_c"):
        values = [s[name] for s in busy if s[name] is not None]
        if values:
            out[name] = summarize(values).to_dict()
    shares = {}
    for bit, reason in REASONS.items():
        if bit == IDLE:
            continue
        hits = sum(1 for s in busy if s["reasons"] & bit)
        if hits:
            shares[reason] = round(hits / len(busy), 3)
    out["limits"] = shares
    out.update(static or {})
    return out


def _query(smi: str, gpu: str, fields: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run([smi, "-i", gpu, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=20)


def _gpu_ids(device: torch.device) -> List[str]:
    """nvidia-smi's names for torch's device to try: its UUID (CUDA's device order need not be
    nvidia-smi's), then its index."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    ids = [str(index)]
    if uuid is not None:
        text = str(uuid)
        ids.insert(0, text if text.startswith("GPU-") else f"GPU-{text}")
    return ids


@functools.lru_cache(maxsize=None)
def _setup(smi: str, device: str, gpu: Optional[str]):
    """(nvidia-smi's id of the GPU, the fields it answers, its maxima), or why it cannot be sampled:
    asked once a process (each nvidia-smi call takes a tenth of a second or more)."""
    gpus = [gpu] if gpu else _gpu_ids(torch.device(device))
    for gpu, reasons in itertools.product(gpus, (_FIELDS[-1], _OLD_REASONS)):
        fields = _FIELDS[:-1] + [reasons]
        first = _query(smi, gpu, fields)
        if first.returncode == 0:
            break
    else:
        return f"not sampled: nvidia-smi exited {first.returncode}: {first.stderr.strip()[:200]}"
    static = _query(smi, gpu, _STATIC)
    values = [_number(v) for v in static.stdout.strip().split(",")] if static.returncode == 0 else []
    names = ("max_sm_mhz", "max_mem_mhz", "power_limit_w")
    return gpu, fields, {name: v for name, v in zip(names, values) if v is not None}


class ClockSampler:
    """``with ClockSampler(device) as clocks: ...``, then ``clocks.summary()`` (see the module's text)."""

    def __init__(self, device: torch.device, smi: Optional[str] = None, gpu: Optional[str] = None):
        self.device = device
        self.active = device.type == "cuda"
        self.smi = smi or shutil.which("nvidia-smi")
        self.gpu = gpu
        self.fields = list(_FIELDS)
        self.proc: Optional[subprocess.Popen] = None
        self.static: Dict[str, float] = {}
        self.error: Optional[str] = None
        self.lines: List[str] = []
        self.seconds = 0.0

    def _start(self) -> None:
        if self.smi is None:
            self.error = "not sampled: no nvidia-smi on PATH"
            return
        try:
            found = _setup(self.smi, str(self.device), self.gpu)
            if isinstance(found, str):
                self.error = found
                return
            self.gpu, self.fields, self.static = found
            self.proc = subprocess.Popen(
                [self.smi, "-i", self.gpu, f"--query-gpu={','.join(self.fields)}", "--format=csv,noheader,nounits",
                 f"--loop-ms={INTERVAL_MS}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
            self.error = f"not sampled: {type(exc).__name__}: {exc}"

    def _stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        self.lines = out.splitlines()
        self.proc = None

    def __enter__(self) -> "ClockSampler":
        self.seconds = time.perf_counter()
        if self.active:
            self._start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop()
        self.seconds = time.perf_counter() - self.seconds

    def summary(self) -> Dict[str, Any]:
        """Empty on a CPU, and for a block too short to sample (under SHORT_MS with no busy sample)."""
        if not self.active:
            return {}
        if self.error:
            return {"error": self.error}
        samples = parse_samples(self.lines)
        if not _busy(samples) and self.seconds * 1e3 < SHORT_MS:
            return {}
        return summarize_samples(samples, self.static)


def describe(clocks: Dict[str, Any]) -> str:
    """One line: 'SM 1,755 MHz [1,740, 1,770] of 1,980, memory 2,619 MHz, 690 W of 700, 61 C; power cap
    in 85% of samples' (or the error)."""
    if not clocks:
        return ""
    if "error" in clocks:
        return f"clocks {clocks['error']}"

    def of(limit: str) -> str:
        return f" of {clocks[limit]:,.0f}" if limit in clocks else ""
    parts = []
    if "sm_mhz" in clocks:
        sm = Stat.from_dict(clocks["sm_mhz"])
        parts.append(f"SM {sm.median:,.0f} MHz [{sm.p20:,.0f}, {sm.p80:,.0f}]{of('max_sm_mhz')}")
    if "mem_mhz" in clocks:
        parts.append(f"memory {clocks['mem_mhz']['median']:,.0f} MHz")
    if "power_w" in clocks:
        parts.append(f"{clocks['power_w']['median']:,.0f} W{of('power_limit_w')}")
    if "temp_c" in clocks:
        parts.append(f"{clocks['temp_c']['p80']:.0f} C")
    text = ", ".join(parts)
    limits = clocks.get("limits") or {}
    reasons = "; ".join(f"{name} in {share:.0%} of samples" for name, share in limits.items())
    text += f"; {reasons}" if reasons else "; no clock limit active"
    return f"{text} ({clocks.get('samples', 0)} samples)"
