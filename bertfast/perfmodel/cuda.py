"""The CUDA backend's attention kernels an H100 runs, all on wgmma (csrc/attention_fwd.cuh's
attention_fwd_wgmma_kernel, csrc/attention_bwd.cuh's attention_bwd_dq_wgmma_kernel and
attention_bwd_dkdv_wgmma_kernel, or up to 128 tokens its one-pass attention_bwd_fused_wgmma_kernel) read
by the performance model, beside the Triton kernels they are held to (issue 39: within 1.3x).

Each source (the bf16 translation units, attention_fwd_bf16.cu and attention_bwd_bf16.cu) is compiled
for sm_90a with nvcc (the flags of the extension build) into a cubin whose SASS the model reads like
Triton's (sass.parse, model.predict); ptxas's report gives the registers.
The launches modelled are the ones a BERT layer makes: bf16, head dim 64 (the kernels' tile is the
head dim), 16-byte rows, varlen, every key of a block valid (their unmasked main loops). The two-kernel
backward has a delta kernel (a dot product a row) beside these, left out on both sides; the one-pass
backward has none, on either side.
"""
from __future__ import annotations

import math
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from bertfast.perfmodel import kernels as K
from bertfast.perfmodel.hardware import Gpu
from bertfast.perfmodel.model import Prediction, Work, predict
from bertfast.perfmodel.sass import Function, disassemble, parse

RATIO = 1.3  # a CUDA kernel's predicted time, at most this times Triton's (issue 39)
FUSED_MAX_SEQ = 128  # csrc/attention.cuh's kFusedBwdMaxSeqlen: the one-pass backward's longest sequence


@dataclass(frozen=True)
class CudaKernel:
    name: str          # the kernel template's name
    source: str        # its file in csrc/
    triton: str        # the Triton kernel doing its work, predicted beside it
    direction: str     # fwd / bwd
    rows: int          # rows a block owns (queries, or keys for dK/dV): 16 a warp
    step: int          # keys (queries for dK/dV) a main-loop step
    own: int           # [rows, D] tiles a block copies once (the forward's Q; dQ's Q, dO; dK/dV's K, V)
    arrays: int        # [2][step] 4-byte arrays beside the streamed tiles (a key mask; lse and Delta)
    tensors: int       # bf16 [tokens, hidden] tensors it reads or writes, each once
    stats: int         # fp32 [heads, tokens] rows it reads or writes (lse; Delta, which dQ also writes)
    products: int      # mma products a score element takes part in (2 head-dim flops each)
    one_pass: bool = False  # the one-pass backward: rows = step = every token, nothing streamed, no loop
    keep: bool = False  # its stages carry their block's keep bits (KeepTile: [2][rows x step / 8] bytes)

    @property
    def warps(self) -> int:
        """A block's warps: 4, or the one-pass backward's warpgroup per 64 tokens."""
        return self.rows // 16 if self.one_pass else 4

    def mangled(self, dropout: bool, head_dim: int = K.HEAD_DIM) -> str:
        """The symbol of the bf16 kernel: template <T, D, step, dropout> (one warpgroup; its streamed
        rows 16-byte), <T, D, warpgroups, dropout, key mask> for the one-pass backward (no key mask)."""
        prefix = f"_ZN8bertfast4attn{len(self.name)}{self.name}I13__nv_bfloat16Li{head_dim}E"
        if self.one_pass:
            return f"{prefix}Li{self.warps // 4}ELb{int(dropout)}ELb0EEEvNS0_6ParamsE"
        return f"{prefix}Li{self.step}ELb{int(dropout)}EEEvNS0_6ParamsE"

    def shared_bytes(self, head_dim: int = K.HEAD_DIM) -> int:
        """WgmmaFwdSmem / WgmmaDqSmem / WgmmaKvSmem / WgmmaFusedSmem bytes for 16-bit T: the block's own
        [rows, D] tiles, the two streamed ones double-buffered ([2][step, D]: K and V, or Q and dO), then
        its [2][step] arrays of 4 bytes and the backward's two keep tiles (a bit a score of a rows x step
        block); the one-pass backward's own tiles, its two [rows, step] tiles (Pd, dS) and its [rows] array
        (the key mask). Tiles are whole 1024-byte atoms of the 128-byte swizzle (unpadded rows), with 1024
        bytes more to align them at run time."""
        row = 2 * head_dim
        tiles = self.own * self.rows * row
        if self.one_pass:
            return tiles + 2 * self.rows * self.step * 2 + self.rows * 4 + 1024
        keep = 2 * self.rows * self.step // 8 if self.keep else 0
        return tiles + 2 * (2 * self.step * row) + self.arrays * 2 * self.step * 4 + keep + 1024


FORWARD = CudaKernel("attention_fwd_wgmma_kernel", "attention_fwd_bf16.cu", "_attention_fwd_kernel", "fwd", 64, 64,
                     own=1, arrays=1, tensors=4, stats=1, products=2)  # Q K^T, P V
DQ = CudaKernel("attention_bwd_dq_wgmma_kernel", "attention_bwd_bf16.cu", "_attention_bwd_dq_kernel", "bwd", 64, 64,
                own=2, arrays=1, tensors=5, stats=3, products=4, keep=True)  # Q K^T, dO V^T, dS' K, P K
DKDV = CudaKernel("attention_bwd_dkdv_wgmma_kernel", "attention_bwd_bf16.cu", "_attention_bwd_dkdv_kernel", "bwd", 64,
                  64, own=2, arrays=2, tensors=6, stats=2, products=4, keep=True)  # K Q^T, V dO^T, Pd^T dO, dS^T Q
FUSED = CudaKernel("attention_bwd_fused_wgmma_kernel", "attention_bwd_bf16.cu", "_attention_bwd_fused_kernel", "bwd",
                   FUSED_MAX_SEQ, FUSED_MAX_SEQ, own=4, arrays=0, tensors=7, stats=1, products=5,
                   one_pass=True)  # Q K^T, dO V^T, dS K, Pd^T dO, dS^T Q
KERNELS = (FORWARD, DQ, DKDV, FUSED)


def kernels_at(setting: K.Setting) -> Tuple[CudaKernel, ...]:
    """The kernels a launch at ``setting`` runs: the forward, then the one-pass backward up to
    FUSED_MAX_SEQ tokens, else dQ and dK/dV."""
    return (FORWARD, FUSED) if setting.seq <= FUSED_MAX_SEQ else (FORWARD, DQ, DKDV)


@dataclass
class CompiledCuda:
    functions: Dict[Tuple[str, bool], Function] = field(default_factory=dict)  # (kernel, dropout) -> SASS
    registers: Dict[Tuple[str, bool], Optional[int]] = field(default_factory=dict)
    spills: Dict[Tuple[str, bool], Optional[int]] = field(default_factory=dict)


def _nvcc_and_csrc() -> Tuple[Optional[str], Optional[Path]]:
    from bertfast.gpucheck.compile_report import csrc_dir, find_nvcc
    return find_nvcc(), csrc_dir()


def unavailable() -> Optional[str]:
    """Why the CUDA attention cannot be read here (None: it can)."""
    nvcc, src = _nvcc_and_csrc()
    if src is None:
        return "csrc/ is not beside the package (a checkout has it)"
    if nvcc is None:
        return "nvcc not found (the CUDA kernels compile with it)"
    return None


@lru_cache(maxsize=1)
def compile_kernels() -> CompiledCuda:
    """sm_90 SASS, registers and spills of each kernel of KERNELS, with and without dropout."""
    from bertfast.gpucheck.compile_report import CUDA_TARGET_ARCH, parse_ptxas
    nvcc, src = _nvcc_and_csrc()
    if nvcc is None or src is None:
        raise RuntimeError(f"perf-model: the CUDA attention cannot be compiled: {unavailable()}")
    out = CompiledCuda()
    for source in sorted({k.source for k in KERNELS}):
        with tempfile.TemporaryDirectory() as tmp:
            cubin = os.path.join(tmp, "k.cubin")
            res = subprocess.run([nvcc, "-std=c++17", "-O3", f"-I{src}", "-cubin", "-gencode",
                                  f"arch=compute_{CUDA_TARGET_ARCH},code=sm_{CUDA_TARGET_ARCH}", "-Xptxas", "-v",
                                  str(src / source), "-o", cubin], capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"perf-model: nvcc failed on {source}: {res.stderr.strip()[-500:]}")
            with open(cubin, "rb") as f:
                functions = parse(disassemble(f.read()))
        report = parse_ptxas(res.stdout + res.stderr)
        for kernel in (k for k in KERNELS if k.source == source):
            for dropout in (False, True):
                name = kernel.mangled(dropout)
                if name not in functions:
                    raise RuntimeError(f"perf-model: {name} is not in {source}'s cubin (its template arguments "
                                       "changed?)")
                stats = report.get(name, {})
                key = (kernel.name, dropout)
                out.functions[key] = functions[name]
                out.registers[key] = stats.get("registers")
                out.spills[key] = stats["spill_stores"] + stats["spill_loads"] if "spill_stores" in stats else None
    return out


def work(kernel: CudaKernel, setting: K.Setting, registers: Optional[int]) -> Work:
    """One varlen launch at ``setting`` (every sequence at full length): a main-loop iteration is one
    rows x step block of scores (the one-pass backward's whole body, once a block). Bytes, each tensor
    once: the forward reads q, k, v and writes out (bf16) and lse (fp32); dQ reads q, k, v, dO, lse and
    Delta and writes dq and the refined Delta; dK/dV reads q, k, v, dO, lse and Delta and writes dk, dv;
    the one-pass backward reads q, k, v, dO and lse and writes dq, dk, dv; with dropout the keep bits (one
    bit a score element) are written by the forward and read by the others."""
    from bertfast.gpucheck.compile_report import MODELS
    hidden = MODELS[setting.model][0]
    heads = hidden // K.HEAD_DIM
    programs = setting.batch * heads * math.ceil(setting.seq / kernel.rows)
    iterations = programs * math.ceil(setting.seq / kernel.step)
    moved = kernel.tensors * setting.tokens * hidden * 2 + kernel.stats * setting.tokens * heads * 4
    if setting.dropout > 0:
        moved += setting.batch * heads * setting.seq ** 2 / 8
    return Work(iterations, kernel.rows * kernel.step, programs, kernel.warps, moved, registers=registers,
                shared_bytes=kernel.shared_bytes(), loads_ahead=1)


@dataclass
class CudaPrediction:
    kernel: CudaKernel
    setting: K.Setting
    prediction: Prediction
    registers: Optional[int]
    spills: Optional[int]


def predict_kernels(settings: List[K.Setting], gpu: Gpu) -> List[CudaPrediction]:
    """Each kernel a launch runs (kernels_at) predicted at each setting (its dropout picks the kernel)."""
    compiled = compile_kernels()
    out = []
    for setting in settings:
        for kernel in kernels_at(setting):
            key = (kernel.name, setting.dropout > 0)
            prediction = predict(compiled.functions[key], work(kernel, setting, compiled.registers[key]), gpu)
            if compiled.spills[key]:
                prediction.notes.append(f"spills {compiled.spills[key]} bytes of registers")
            out.append(CudaPrediction(kernel, setting, prediction, compiled.registers[key], compiled.spills[key]))
    return out


TRITON_DELTA = "_attention_bwd_delta_kernel"


def beside_triton(results: Sequence, settings: Sequence[K.Setting], gpu: Gpu, log=print) -> List[Dict[str, object]]:
    """Each kernel a launch runs at each setting (kernels_at) beside the Triton kernel doing the same work
    there, from ``results`` (report.analyse's KernelResults; both backends take one pass at seq 128),
    then the attention as a whole (kernel "forward+backward": the CUDA kernels against every Triton
    attention kernel the setting runs, each side without its delta kernel): prediction, instructions per
    element, binding bound and the ratio of the two times, one line logged each. [] with a line saying
    why where they cannot be compiled here."""
    why = unavailable()
    if why is not None:
        log(f"CUDA attention: not read ({why})")
        return []
    rows = []
    for f in predict_kernels(list(settings), gpu):
        p = f.prediction
        triton = [r.prediction.predicted_s for r in results
                  if r.setting == f.setting and r.kernel == f.kernel.triton and r.prediction is not None]
        ratio = p.predicted_s / triton[0] if triton else None
        rows.append({"setting": f.setting.label(), "kernel": f.kernel.name, "direction": f.kernel.direction,
                     "registers": f.registers, "spills": f.spills, "seconds": p.predicted_s,
                     "instructions_per_element": p.per_element["total"], "binding": p.binding,
                     "bounds_s": p.bounds_s, "triton_kernel": f.kernel.triton,
                     "triton_seconds": triton[0] if triton else None, "ratio": ratio,
                     "within": None if ratio is None else ratio <= RATIO, "notes": p.notes})
        beside = "no Triton kernel of its own here" if ratio is None else (
            f"{ratio:.2f}x Triton's {f.kernel.triton.strip('_').replace('_kernel', '')} "
            f"({'within' if ratio <= RATIO else 'NOT within'} {RATIO:g}x)")
        log(f"CUDA {f.kernel.name} (csrc/{f.kernel.source}), {f.setting.label()}: {p.predicted_s * 1e6:.0f} us, "
            f"{p.per_element['total']:.1f} instr/elem, bound by {p.binding}, {f.registers} registers: {beside}"
            + (f" [{'; '.join(p.notes)}]" if p.notes else ""))
    for setting in settings:
        cuda = sum(r["seconds"] for r in rows if r["setting"] == setting.label())
        triton = [r for r in results if r.setting == setting and r.kernel.startswith("_attention_")
                  and r.kernel != TRITON_DELTA and r.prediction is not None]
        if not triton:
            continue
        triton_s = sum(r.prediction.predicted_s for r in triton)
        ratio = cuda / triton_s
        rows.append({"setting": setting.label(), "kernel": "forward+backward", "direction": "both",
                     "registers": None, "spills": None, "seconds": cuda, "instructions_per_element": None,
                     "binding": None, "bounds_s": None, "triton_kernel": "+".join(sorted(r.kernel for r in triton)),
                     "triton_seconds": triton_s, "ratio": ratio, "within": ratio <= RATIO, "notes": []})
        log(f"CUDA attention forward+backward, {setting.label()}: {cuda * 1e6:.0f} us against Triton's "
            f"{triton_s * 1e6:.0f} us ({len(triton)} kernels), {ratio:.2f}x "
            f"({'within' if ratio <= RATIO else 'NOT within'} {RATIO:g}x; the delta kernels left out)")
    return rows
