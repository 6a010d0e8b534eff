"""The machine a benchmark runs on: what it is, and two figures measured once per run.

* copy bandwidth: a device-to-device copy of a large buffer (1 GiB on a GPU), counted as
  read + write = 2 x buffer bytes per copy. Memory-bound ops report % of this figure.
* peak matmul rate: a large square GEMM (bf16 8192^3 on a GPU), 2*M*N*K flops per call.
  MFU is reported against this measured peak and against the datasheet dense bf16 peak of the
  GPU (989.4 TFLOP/s for H100 SXM and H200), which the published targets use.

On a CPU the same two measurements run on small buffers in fp32 (the dtype the CPU
suites use) and everything says that these are CPU figures.
"""
from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional

import torch

from bertfast.bench.timing import Stat, TimingPolicy, time_fn
from bertfast.model.mfu import datasheet_bf16_tflops


def slugify(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (the results directory name)."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown-device"


def _version(module: str) -> Optional[str]:
    try:
        mod = __import__(module)
    except Exception:
        return None
    return getattr(mod, "__version__", "unknown")


def _nvidia_driver() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except Exception:
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def compiler_status() -> Dict[str, Any]:
    """Can torch.compile (inductor) run here? It needs a C++ compiler on CPU and triton on GPU."""
    import shutil
    cxx = os.environ.get("CXX") or next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
    return {"cxx": cxx, "triton": _version("triton")}


@dataclass
class DeviceInfo:
    kind: str  # "cuda" or "cpu"
    name: str
    slug: str
    torch_version: str
    python_version: str
    platform: str
    triton_version: Optional[str] = None
    transformers_version: Optional[str] = None
    cuda_version: Optional[str] = None  # torch.version.cuda (the toolkit torch was built with)
    cudnn_version: Optional[int] = None
    driver_version: Optional[str] = None  # nvidia-smi
    capability: Optional[str] = None
    multiprocessors: Optional[int] = None
    memory_bytes: Optional[int] = None
    cpu_threads: int = 1
    triton_interpret: bool = False
    datasheet_bf16_tflops: Optional[float] = None  # the vendor's dense bf16 peak (None: unknown GPU, CPU)
    # A GPU's host CPU: an eager step whose launches outlast its kernels runs at the host's pace
    # (bertfast's eager BERT-large step took 133 ms on one H100 machine and 180 ms on another the
    # same day, its code path unchanged; neither run recorded its CPU).
    host_cpu: Optional[str] = None
    # Measured once per run by calibrate().
    copy_bandwidth_gbps: Optional[Stat] = None
    peak_matmul_tflops: Optional[Stat] = None
    calibration: Dict[str, Any] = field(default_factory=dict)

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda" if self.is_cuda else "cpu")

    def describe(self) -> str:
        if self.is_cuda:
            text = (f"{self.name} (sm {self.capability}, {self.multiprocessors} SMs, "
                    f"{(self.memory_bytes or 0) / 2**30:.0f} GiB), driver {self.driver_version}, "
                    f"CUDA {self.cuda_version}; host {self.host_cpu or 'CPU not recorded'} "
                    f"({self.cpu_threads} threads)")
        else:
            text = (f"CPU: {self.name} ({self.cpu_threads} threads) - no GPU; CPU timings of "
                    f"torch-backend/interpreter paths")
        return (f"{text}; torch {self.torch_version}, triton {self.triton_version}, "
                f"transformers {self.transformers_version}")

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["copy_bandwidth_gbps"] = self.copy_bandwidth_gbps.to_dict() if self.copy_bandwidth_gbps else None
        d["peak_matmul_tflops"] = self.peak_matmul_tflops.to_dict() if self.peak_matmul_tflops else None
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "DeviceInfo":
        d = dict(d)
        for key in ("copy_bandwidth_gbps", "peak_matmul_tflops"):
            if d.get(key) is not None:
                d[key] = Stat.from_dict(d[key])
        return cls(**d)


def detect(device: Optional[str] = None) -> DeviceInfo:
    """Describe the current machine (no measurements): CUDA device 0 if there is one, else the CPU."""
    use_cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    common = dict(
        torch_version=torch.__version__,
        python_version=sys.version.split()[0],
        platform=platform.platform(),
        triton_version=_version("triton"),
        transformers_version=_version("transformers"),
        cpu_threads=torch.get_num_threads(),
        triton_interpret=os.environ.get("TRITON_INTERPRET", "0") == "1",
    )
    if use_cuda:
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r} requested but torch sees no CUDA device")
        index = torch.device(device).index if device is not None and torch.device(device).index else 0
        props = torch.cuda.get_device_properties(index)
        return DeviceInfo(
            kind="cuda", name=props.name, slug=slugify(props.name),
            cuda_version=torch.version.cuda,
            cudnn_version=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            driver_version=_nvidia_driver(),
            capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
            memory_bytes=int(props.total_memory), datasheet_bf16_tflops=datasheet_bf16_tflops(props.name),
            host_cpu=_cpu_name(), **common)
    name = _cpu_name()
    return DeviceInfo(kind="cpu", name=name, slug="cpu-" + slugify(name), **common)


def measure_copy_bandwidth(device: torch.device, nbytes: int, policy: Optional[TimingPolicy] = None) -> Stat:
    """GB/s (1e9 bytes) of ``dst.copy_(src)`` over an ``nbytes`` buffer; read + write counted."""
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device, policy or TimingPolicy(flush_l2=False))
    return t.rate(2.0 * n * 4 / 1e9 * 1e3)  # bytes per ms -> GB/s


def measure_matmul_peak(device: torch.device, size: int, dtype: torch.dtype,
                        policy: Optional[TimingPolicy] = None) -> Stat:
    """TFLOP/s of a [size, size] @ [size, size] matmul in ``dtype`` (2 * size^3 flops per call)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    t = time_fn(lambda: torch.matmul(a, b, out=out), device, policy or TimingPolicy(flush_l2=False))
    return t.rate(2.0 * size ** 3 / 1e12 * 1e3)  # flops per ms -> TFLOP/s


def calibrate(info: DeviceInfo, quick: bool = False) -> DeviceInfo:
    """Measure copy bandwidth and peak matmul rate once and store them (with shapes) in ``info``."""
    device = info.torch_device
    if info.is_cuda:
        nbytes = (256 if quick else 1024) * 2 ** 20
        size, dtype = (4096 if quick else 8192), torch.bfloat16
        policy = TimingPolicy(warmup_ms=50.0, rep_ms=200.0 if quick else 500.0, flush_l2=False)
    else:
        nbytes = (16 if quick else 64) * 2 ** 20
        size, dtype = (512 if quick else 1024), torch.float32
        policy = TimingPolicy(cpu_warmup=1, cpu_reps=5, flush_l2=False)
    from bertfast.bench.clocks import ClockSampler
    with ClockSampler(device) as copy_clocks:
        info.copy_bandwidth_gbps = measure_copy_bandwidth(device, nbytes, policy)
    with ClockSampler(device) as matmul_clocks:
        info.peak_matmul_tflops = measure_matmul_peak(device, size, dtype, policy)
    info.calibration = {
        "copy": f"device-to-device copy of a {nbytes / 2**20:.0f} MiB buffer; read + write counted "
                f"(2 x {nbytes} bytes per copy); GB/s = 1e9 bytes/s",
        "copy_bytes": nbytes,
        "matmul": f"torch.matmul [{size}, {size}] @ [{size}, {size}] in {str(dtype).replace('torch.', '')}; "
                  f"2*M*N*K flops per call",
        "matmul_size": size,
        "matmul_dtype": str(dtype).replace("torch.", ""),
        # the GPU's clocks while each was timed (bench.clocks; empty on a CPU)
        "copy_clocks": copy_clocks.summary(),
        "matmul_clocks": matmul_clocks.summary(),
    }
    return info
