"""`make compile-report`: registers, spills and shared memory of every kernel on sm_90, no GPU needed.

Triton: each launcher runs at BERT-base and BERT-large shapes (seq 128 and 512; fp16/bf16/fp32
activations with parameters in the activation dtype or fp32, as under autocast; dropout on
and off; attention at head dim 64 and at ATTENTION_HEAD_DIMS, every kernel tile up to 256 and
head dims that are no power of two, in fp16 at head dim 64 only (FULL_MATRIX_FP16_ATTENTION_HEAD_DIMS
says why); the LAMB optimizer's kernels for those parameter dtypes, and the AdamW kernel for fp32
parameters with working copies in the activation dtype)
inside ``kernels._common.compile_only``, so nothing runs and
every launch is recorded with its autotune candidates (its config list pruned for that
shape, as the autotuner would). Each candidate is then compiled for the target by Triton
itself, with an offline stand-in for the GPU driver; the figures are ptxas's own report
(``-v``) and the kernel's shared-memory size.

CUDA: each csrc/*.cu is compiled for sm_90a (the build whose wgmma kernels an H100 runs) with
``nvcc -Xptxas -v``; its shared-memory column is the static size (the attention kernels size
theirs at launch and check it against the device's limit there, failing with a clear error:
csrc/attention_host.cuh, ``prepare``).

A kernel fails the report when it spills registers (any spill store), needs more shared
memory than an sm_90 block can have (227 KiB), or does not compile. Exit status 1 when any
fails. ``--fast`` (what CI runs) covers the training configuration only: BERT-large at seq 512
and 128, bf16 activations, fp32 parameters, dropout 0.1. Runs with triton 3.6 and 3.9.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

SM90_SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90
TARGET_ARCH = 90
CUDA_TARGET_ARCH = "90a"  # the extension's sm_90 build (cuda_build.DEFAULT_ARCHS): its wgmma kernels need it
MODELS = {"bert-base": (768, 12, 3072), "bert-large": (1024, 16, 4096)}  # hidden, heads, ffn
SEQ_BATCH = ((128, 128), (512, 32))  # 16384 tokens either way
VOCAB, POSITIONS, TYPES, MASKED_ROWS = 30522, 512, 2, 64
# Every Triton head-dim tile (16, 32, 64, 128, 256), and 26 and 80 for the masked columns of a
# head dim that is not a power of two (TinyBERT's 26).
ATTENTION_HEAD_DIMS = (16, 26, 32, 64, 80, 128, 256)
# --attention-only: the check after an attention change, every head dim but 64 (which --fast and
# the full matrix cover) at three settings that together cover each operand class with dropout on
# and off: about a quarter of the full matrix's compiles.
ATTENTION_MATRIX = [("bert-large", 512, 32, "bf16", "fp32", 0.1), ("bert-large", 512, 32, "fp16", "act", 0.0),
                    ("bert-base", 128, 128, "fp32", "act", 0.1)]
# The full matrix compiles fp16 attention at these head dims only. fp16 attention compiles to its bf16
# twin's registers, spills and shared memory: every one of the 404 fp16/bf16 pairs of forward, dQ and
# dK/dV candidates at every head dim and dropout setting of the full report of 2026-11-26 (triton 3.9,
# with the keep bits) matched. Compiling them all was a third of the full matrix's time;
# --attention-only still compiles fp16 at every head dim.
FULL_MATRIX_FP16_ATTENTION_HEAD_DIMS = (64,)
# The attention's one-pass backward holds a whole sequence in its key tile, so its candidates are
# listed per length (kernels/attention.py, _FUSED_CANDIDATES): the full matrix also compiles it at
# these shorter lengths, with and without a key mask, at head dim 64 and at 26 (masked columns).
SHORT_SEQUENCES = (16, 32, 64)
SHORT_SEQUENCE_HEAD_DIMS = (26, 64)
SHORT_SEQUENCE_KERNELS = ("_attention_bwd_fused_kernel",)
# Both backwards of sequences the one-pass kernel does not take: dQ by its own kernel and added atomically
# (kernels/attention.py, "Atomic dQ"; BERTFAST_ATTENTION_DQ).
DQ_MODES = ("deterministic", "atomic")
# The MLM decoder's forms: the library's GEMMs around the loss kernel, and the loss in a GEMM's epilogue
# (BERTFAST_MLM_HEAD=fused, kernels/mlm_head_loss.py); the report compiles both, a pre-training step runs
# the first (gpucheck.sizing's estimate of its compiles).
HEAD_MODES = ("library", "fused")


@dataclasses.dataclass
class Row:
    """One compiled kernel: a Triton candidate config or a CUDA template instance."""

    source: str      # "triton" | "cuda"
    kernel: str
    variant: str     # constexpr flags and dtypes (Triton) / template arguments (CUDA)
    config: str      # block sizes, warps, stages ("-" for CUDA)
    registers: Optional[int] = None
    spill_stores: Optional[int] = None
    spill_loads: Optional[int] = None
    shared: Optional[int] = None
    error: str = ""
    order: int = 0   # position in the recorded launch order (shards compile out of order)
    compile_s: Optional[float] = None  # wall seconds to compile it (one core; a CUDA row: its whole source)

    @property
    def problems(self) -> List[str]:
        out = []
        if self.error:
            out.append(self.error)
        if self.spill_stores:
            out.append(f"spills {self.spill_stores} B")
        if self.shared is not None and self.shared > SM90_SHARED_LIMIT:
            out.append(f"shared memory {self.shared} B > {SM90_SHARED_LIMIT} B")
        return out


# --------------------------------------------------------------------------- ptxas output
_FUNC = re.compile(r"Function properties for (\S+)")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Compiling entry function '([^']+)'|Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas(log: str) -> Dict[str, Dict[str, int]]:
    """{function: {registers, spill_stores, spill_loads, smem}} from ``ptxas -v`` output."""
    out: Dict[str, Dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        m = _FUNC.search(line)
        if m:
            current = m.group(1)
            out.setdefault(current, {})
            continue
        m = _SPILL.search(line)
        if m and current:
            out[current].update(spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
            continue
        m = _USED.search(line)
        if not m:
            continue
        if m.group(1):
            current = m.group(1)
            out.setdefault(current, {})
        elif current:
            out[current].update(registers=int(m.group(2)), smem=int(m.group(3) or 0))
    return out


# --------------------------------------------------------------------------- Triton, offline
class OfflineDriver:
    """Enough of a Triton driver for JITFunction.warmup to compile for a GPU this machine lacks."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")

    def get_benchmarker(self):
        raise RuntimeError("compile report: nothing is timed offline")


class _RecordingLauncher:
    """A compiled kernel's launcher that launches nothing: it appends (kernel name, its arguments) to
    ``calls`` (grid, stream, function, metadata, hooks, then the kernel's own arguments)."""

    def __init__(self, calls: list, src, metadata):
        self.calls, self.name = calls, getattr(src, "name", "?")

    def __call__(self, *args):
        self.calls.append((self.name, args))


class _BinaryStandIn:
    """What Triton asks of a driver's utils to load a compiled kernel (no GPU: nothing is loaded)."""

    def load_binary(self, name, kernel, shared, device):
        return object(), object(), 0, 0, 1024  # module, function, registers, spills, max threads

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}


class LaunchRecordingDriver(OfflineDriver):
    """Triton's launch path to its last step on a machine without a GPU: JITFunction.run binds and
    specialises the arguments, compiles for ``arch`` (or finds the kernel compiled) and calls the
    launcher, which records the call in ``calls`` instead of launching. For tests and host-time
    measurements of the GPU launch path (CPU tensors, TRITON_INTERPRET unset)."""

    def __init__(self, arch: int):
        super().__init__(arch)
        self.calls: list = []
        self.launcher_cls = functools.partial(_RecordingLauncher, self.calls)
        self.utils = _BinaryStandIn()


@dataclasses.dataclass
class Launch:
    fn: object       # the @triton.jit function
    args: tuple
    consts: dict
    configs: list    # triton.Config candidates; [None] for a plain kernel (consts are complete)
    case: str
    keys: set = dataclasses.field(default_factory=set)  # the autotuner keys it was launched with (tunings)


Setting = Tuple[str, int, int, str, str, float]


def _ops_with_launches() -> Tuple[str, ...]:
    """The ops whose Triton launches the report compiles: every op bertfast.registry gives ``launches``."""
    from bertfast import registry
    return tuple(op.name for op in registry.ops() if op.launches)


def _matrix(fast: bool) -> List[Setting]:
    """(model, seq, batch, act dtype name, params 'fp32'|'act', dropout p) settings."""
    if fast:  # phase 2, then phase 1 (its attention backward is the one-pass kernel)
        return [("bert-large", 512, 32, "bf16", "fp32", 0.1), ("bert-large", 128, 128, "bf16", "fp32", 0.1)]
    out = []
    for model in MODELS:
        for seq, batch in SEQ_BATCH:
            for act in ("bf16", "fp16", "fp32"):
                for params in (("fp32", "act") if act != "fp32" else ("act",)):
                    for p in (0.0, 0.1):
                        out.append((model, seq, batch, act, params, p))
    return out


def bert_launches(settings: Sequence[Setting], head_dims: Sequence[int] = (64,), ops: Optional[Sequence[str]] = None,
                  padded_attention: bool = True, fp16_head_dims: Optional[Sequence[int]] = None,
                  short_sequences: bool = False, dq_modes: Sequence[str] = ("deterministic",),
                  head_modes: Sequence[str] = ("library",)) -> Iterator[Tuple[str, Callable[[], None]]]:
    """(case label, function that calls the launchers of ``ops`` (default: every op with launches) at
    that setting) for every setting; attention at each of ``head_dims`` (fp16 attention only at those
    also in ``fp16_head_dims``, when given), varlen and (``padded_attention``) padded; with
    ``short_sequences``, at seq 128 the backward also at SHORT_SEQUENCES, at the head dims of
    SHORT_SEQUENCE_HEAD_DIMS given; the backward in each of ``dq_modes`` (BERTFAST_ATTENTION_DQ: where
    the one-pass kernel takes it, the same launch); the MLM decoder in each of ``head_modes``."""
    from bertfast import registry
    from bertfast.gpucheck.op_launches import LaunchSetting
    wanted = _ops_with_launches() if ops is None else tuple(ops)
    for model, seq, batch, act_name, params, p in settings:
        setting = LaunchSetting(model, seq, batch, act_name, params, p, head_dims, padded_attention,
                                fp16_head_dims, short_sequences, tuple(dq_modes), tuple(head_modes))
        for op in registry.ops():
            if op.launches and op.name in wanted:
                yield f"{op.name} [{setting.label}]", functools.partial(registry.resolve(op.launches), setting)


def record_launches(fast: bool, attention_only: bool = False) -> List[Launch]:
    """Every distinct launch (kernel, flags, dtypes) the report's BERT settings make, with its candidates."""
    if attention_only:
        dims = tuple(d for d in ATTENTION_HEAD_DIMS if d != 64)
        return record_settings(ATTENTION_MATRIX, dims, ("attention",), short_sequences=True, dq_modes=DQ_MODES)
    return record_settings(_matrix(fast), (64,) if fast else ATTENTION_HEAD_DIMS,
                           fp16_head_dims=FULL_MATRIX_FP16_ATTENTION_HEAD_DIMS, short_sequences=not fast,
                           dq_modes=DQ_MODES, head_modes=HEAD_MODES)


def record_settings(settings: Sequence[Setting], head_dims: Sequence[int] = (64,), ops: Optional[Sequence[str]] = None,
                    padded_attention: bool = True, fp16_head_dims: Optional[Sequence[int]] = None,
                    short_sequences: bool = False, dq_modes: Sequence[str] = ("deterministic",),
                    head_modes: Sequence[str] = ("library",)) -> List[Launch]:
    """Every distinct launch (kernel, flags, dtypes) at these settings, with its candidates and the
    autotuner keys it was launched with (see bert_launches); ``short_sequences``: the attention's
    one-pass backward also at every shorter key tile (SHORT_SEQUENCES), a launch per tile."""
    from bertfast.kernels._common import compile_only

    by_variant: Dict[tuple, Launch] = {}
    for case, call in bert_launches(settings, head_dims, ops, padded_attention, fp16_head_dims, short_sequences,
                                    dq_modes, head_modes):
        def record(fn, grid, args, consts, configs, key, case=case):
            variant = (fn.__name__, tuple(sorted(consts.items())), _dtypes(args))
            if fn.__name__ in SHORT_SEQUENCE_KERNELS:  # its candidates are its key tile's
                variant += (configs[0].kwargs["BLOCK_N"],)
            if variant not in by_variant:
                by_variant[variant] = Launch(fn, tuple(_stand_in(a) for a in args), dict(consts), list(configs),
                                             case)
            if key is not None:
                by_variant[variant].keys.add(key)
        with compile_only(record):
            call()
    return list(by_variant.values())


def _stand_in(arg):
    """A tensor argument as a one-element tensor Triton specialises alike: the same dtype and the same
    address modulo 16 (shapes and strides reach the kernels as integer arguments). The recorded
    launches would otherwise hold every setting's activations (gigabytes over the full matrix)."""
    import torch
    if not isinstance(arg, torch.Tensor):
        return arg
    offset = (arg.data_ptr() % 16) // arg.element_size()
    return torch.empty(offset + 1, dtype=arg.dtype)[offset:]  # CPU allocations are 64-byte aligned


def _forget_compiled(fn) -> None:
    """Drop the kernels Triton keeps in memory for ``fn`` (each holds its IRs and cubin, megabytes):
    the report reads each compile once. Triton keeps a per-device tuple whose first item is that cache."""
    for entry in getattr(fn, "device_caches", {}).values():
        if isinstance(entry, tuple) and entry and isinstance(entry[0], dict):
            entry[0].clear()


def _dtypes(args: Sequence) -> tuple:
    return tuple(str(a.dtype).replace("torch.", "") for a in args if hasattr(a, "dtype"))


def _describe(launch: Launch) -> str:
    flags = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(launch.consts.items())
                     if not k.startswith("BLOCK") and k != "num_warps")
    dts = sorted(set(_dtypes(launch.args)) - {"int32", "int64", "bool", "uint8"})
    return f"{flags} [{'/'.join(dts)}]"


def _config_text(launch: Launch, config) -> str:
    if config is None:
        blocks = {k: v for k, v in launch.consts.items() if k.startswith("BLOCK") or k == "num_warps"}
        return " ".join(f"{k}={v}" for k, v in sorted(blocks.items()))
    blocks = " ".join(f"{k}={v}" for k, v in config.kwargs.items())
    return f"{blocks} w={config.num_warps} s={config.num_stages}"


def compile_triton(launches: Sequence[Launch], shard: Tuple[int, int] = (0, 1)) -> List[Row]:
    """Compile every candidate of every launch (those of this shard) for sm_90."""
    from bertfast.kernels._common import COMPILE_OPTIONS

    rows: List[Row] = []
    index = 0
    for launch in launches:
        for config in launch.configs:
            index += 1
            if (index - 1) % shard[1] != shard[0]:
                continue
            consts = dict(launch.consts)
            if config is not None:
                consts.update(config.all_kwargs())
            row = Row("triton", launch.fn.__name__, _describe(launch), _config_text(launch, config), order=index)
            log = io.StringIO()
            start = time.perf_counter()
            try:
                with contextlib.redirect_stdout(log):
                    kernel = launch.fn.warmup(*launch.args, grid=(1,), **consts, **COMPILE_OPTIONS)
            except Exception as exc:  # noqa: BLE001 - a kernel that does not compile is a finding
                row.error = f"does not compile: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                rows.append(row)
                continue
            row.compile_s = round(time.perf_counter() - start, 3)
            stats = parse_ptxas(log.getvalue()).get(launch.fn.__name__, {})
            if "registers" not in stats:
                row.error = "no ptxas report (compiled from a cache?)"
            row.registers = stats.get("registers")
            row.spill_stores, row.spill_loads = stats.get("spill_stores"), stats.get("spill_loads")
            row.shared = int(getattr(kernel.metadata, "shared", 0))
            rows.append(row)
            _forget_compiled(launch.fn)
    return rows


def _prepare_offline_triton(cache_dir: str) -> None:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("compile report: TRITON_INTERPRET=1 is set; the report compiles for the GPU, "
                         "run it without the interpreter")
    os.environ["TRITON_CACHE_DIR"] = cache_dir  # fresh: every compile runs ptxas and reports
    import triton
    from triton.runtime.driver import driver
    triton.knobs.nvidia.dump_ptxas_log = True
    driver.set_active(OfflineDriver(TARGET_ARCH))


# --------------------------------------------------------------------------- CUDA
def csrc_dir() -> Optional[Path]:
    here = Path(__file__).resolve().parents[2] / "csrc"
    return here if here.is_dir() else None


def _demangle(names: Sequence[str]) -> Dict[str, str]:
    tool = shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


def cuda_build():
    """The extension build's module (cuda_build.py beside csrc/ in a checkout), or None without csrc/."""
    src = csrc_dir()
    if src is None:
        return None
    spec = importlib.util.spec_from_file_location("cuda_build", src.parent / "cuda_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def find_nvcc() -> Optional[str]:
    """nvcc as the extension build finds it."""
    build = cuda_build()
    return build.find_nvcc() if build is not None else None


def compile_cuda(nvcc: str, source_dir: Path, jobs: int) -> List[Row]:
    """ptxas -v of every csrc/*.cu for sm_90a (the flags of the extension build); one row per kernel."""
    sources = sorted(source_dir.glob("*.cu"))
    flags = ["-std=c++17", "-O3", "-lineinfo", f"-I{source_dir}", "-gencode",
             f"arch=compute_{CUDA_TARGET_ARCH},code=sm_{CUDA_TARGET_ARCH}", "-Xptxas", "-v", "-c"]

    def one(src: Path) -> Tuple[Path, subprocess.CompletedProcess, float]:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            res = subprocess.run([nvcc, *flags, str(src), "-o", os.path.join(tmp, "k.o")], capture_output=True,
                                 text=True)
            return src, res, round(time.perf_counter() - start, 2)

    rows: List[Row] = []
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        results = list(pool.map(one, sources))
    for src, res, seconds in results:
        if res.returncode != 0:
            rows.append(Row("cuda", src.name, "-", "-", error=f"nvcc failed: {res.stderr.strip()[-300:]}",
                            compile_s=seconds))
            continue
        stats = parse_ptxas(res.stdout + res.stderr)
        names = _demangle(list(stats))
        for mangled, s in stats.items():
            pretty = names[mangled].replace("(anonymous namespace)::", "")
            kernel, _, variant = pretty.partition("<")
            rows.append(Row("cuda", f"{src.name}: {kernel.split('(')[0].split('::')[-1]}",
                            ("<" + variant.split(">(")[0] + ">") if variant else "-", "-",
                            registers=s.get("registers"), spill_stores=s.get("spill_stores"),
                            spill_loads=s.get("spill_loads"), shared=s.get("smem"), compile_s=seconds))
    return rows


# --------------------------------------------------------------------------- report
def format_table(rows: Sequence[Row]) -> str:
    header = ("source", "kernel", "variant", "config", "regs", "spill st/ld", "smem", "status")
    body = []
    for r in rows:
        spill = "-" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}"
        body.append((r.source, r.kernel, r.variant, r.config, "-" if r.registers is None else str(r.registers),
                     spill, "-" if r.shared is None else str(r.shared), "; ".join(r.problems) or "ok"))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in [header, *body]]
    return "\n".join(lines)


def summary(rows: Sequence[Row]) -> str:
    """Per kernel: candidates compiled, the most registers, failures."""
    per: Dict[Tuple[str, str], List[Row]] = {}
    for r in rows:
        per.setdefault((r.source, r.kernel), []).append(r)
    lines = [f"{'kernel':58s} {'compiled':>8s} {'max regs':>8s} {'max smem':>9s}  failing"]
    for (source, kernel), group in per.items():
        regs = max((r.registers or 0) for r in group)
        smem = max((r.shared or 0) for r in group)
        bad = sum(1 for r in group if r.problems)
        lines.append(f"{source + ' ' + kernel:58s} {len(group):8d} {regs:8d} {smem:9d}  {bad}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bertfast.gpucheck.compile_report", description=__doc__.split("\n")[0])
    p.add_argument("--fast", action="store_true", help="the training configuration only (what CI runs)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles (default: CPU count)")
    p.add_argument("--json", default=None, help="also write every row to this JSON file")
    p.add_argument("--no-cuda", action="store_true", help="skip the CUDA extension")
    p.add_argument("--no-triton", action="store_true", help="skip the Triton kernels")
    p.add_argument("--attention-only", action="store_true",
                   help="Triton attention kernels only, at ATTENTION_HEAD_DIMS but 64, three settings")
    p.add_argument("--shard", default=None, help=argparse.SUPPRESS)  # i/N: one worker's share of the Triton compiles
    return p


def _triton_rows(args) -> List[Row]:
    """All Triton rows, compiled by ``args.jobs`` worker processes (each records the launches and
    compiles its share: recording is cheap, compiling is not)."""
    if args.jobs <= 1:
        with tempfile.TemporaryDirectory() as cache:
            _prepare_offline_triton(cache)
            return compile_triton(record_launches(args.fast, args.attention_only))
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i in range(args.jobs):
            out = os.path.join(tmp, f"shard{i}.json")
            cmd = [sys.executable, "-m", "bertfast.gpucheck.compile_report", "--no-cuda", "--jobs", "1",
                   "--shard", f"{i}/{args.jobs}", "--json", out] + (["--fast"] if args.fast else []) \
                + (["--attention-only"] if args.attention_only else [])
            procs.append((out, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)))
        rows: List[Row] = []
        for out, proc in procs:
            _, err = proc.communicate()
            if not os.path.exists(out):
                raise SystemExit(f"compile report: a worker failed:\n{err[-2000:]}")
            rows += [Row(**r) for r in json.load(open(out))]
        return sorted(rows, key=lambda r: r.order)


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    if args.shard:
        index, count = (int(x) for x in args.shard.split("/"))
        with tempfile.TemporaryDirectory() as cache:
            _prepare_offline_triton(cache)
            rows = compile_triton(record_launches(args.fast, args.attention_only), (index, count))
        with open(args.json, "w") as fh:
            json.dump([dataclasses.asdict(r) for r in rows], fh)
        return 0

    rows: List[Row] = []
    if not args.no_triton:
        import triton
        scope = "training configuration" if args.fast else "attention, head dims" if args.attention_only \
            else "full matrix"
        print(f"Triton {triton.__version__}: compiling every autotune candidate for sm_{TARGET_ARCH} ({scope}) ...",
              flush=True)
        rows += _triton_rows(args)
    if not args.no_cuda:
        nvcc, src = find_nvcc(), csrc_dir()
        if nvcc is None or src is None:
            print(f"CUDA extension: skipped ({'nvcc not found' if nvcc is None else 'csrc/ not found'})")
        else:
            print(f"CUDA extension: nvcc -Xptxas -v for sm_{CUDA_TARGET_ARCH} ({nvcc}) ...", flush=True)
            rows += compile_cuda(nvcc, src, args.jobs)
    print(format_table(rows))
    print()
    print(summary(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([dataclasses.asdict(r) for r in rows], fh, indent=1)
    failing = [r for r in rows if r.problems]
    print()
    if failing:
        print(f"FAILED: {len(failing)} of {len(rows)} compiled kernels spill, exceed shared memory or do not "
              f"compile (see the status column)")
        return 1
    print(f"ok: {len(rows)} compiled kernels, none spills or exceeds the sm_{TARGET_ARCH} shared-memory limit")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
