"""The CUDA backend's attention forward (csrc/attention_fwd.cu, attention_fwd_mma_kernel) read by the
performance model, beside the Triton kernel it is held to (issue 39: within 1.3x).

csrc/attention_fwd.cu is compiled for sm_90 with nvcc (the flags of the extension build) into a cubin
whose SASS the model reads like Triton's (sass.parse, model.predict); ptxas's report gives the
registers. The launch modelled is the one a BERT layer makes: bf16, head dim 64 (the kernel's tile
is the head dim), 16-byte rows, varlen, every key of a full block valid (its unmasked main loop).
"""
from __future__ import annotations

import math
import os
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from bertfast.perfmodel import kernels as K
from bertfast.perfmodel.hardware import Gpu
from bertfast.perfmodel.model import Prediction, Work, predict
from bertfast.perfmodel.sass import Function, disassemble, parse

KERNEL = "attention_fwd_mma_kernel"
SOURCE = "attention_fwd.cu"
# The launch's configuration (csrc/attention.cuh, Cfg and MmaFwdSmem, at head dim 64): 64 query rows
# per block in 4 warps, 64 keys per step, rows padded by 8 elements.
BLOCK_M, BLOCK_N, WARPS = 64, 64, 4
ROW_PAD = 8


def shared_bytes(head_dim: int = K.HEAD_DIM, block_n: int = BLOCK_N) -> int:
    """MmaFwdSmem<T, D, BN>::bytes for 16-bit T: Q [64, D + 8], K and V [2][BN, D + 8], kvalid [2][BN]."""
    def align(x: int) -> int:
        return (x + 127) // 128 * 128
    row = 2 * (head_dim + ROW_PAD)
    k = align(BLOCK_M * row)
    v = align(k + 2 * block_n * row)
    kvalid = align(v + 2 * block_n * row)
    return align(kvalid + 2 * block_n * 4)


def mangled(dropout: bool, head_dim: int = K.HEAD_DIM, block_n: int = BLOCK_N) -> str:
    """The kernel's symbol for bf16 with 16-byte K and V rows."""
    return (f"_ZN8bertfast4attn24{KERNEL}I13__nv_bfloat16Li{head_dim}ELi{block_n}ELi{WARPS}"
            f"ELb{int(dropout)}ELb1EEEvNS0_6ParamsE")


@dataclass
class CompiledCuda:
    functions: Dict[bool, Function]       # dropout -> the kernel's SASS
    registers: Dict[bool, Optional[int]]
    spills: Dict[bool, Optional[int]]


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
def compile_forward() -> CompiledCuda:
    """sm_90 SASS, registers and spills of the forward kernel, with and without dropout."""
    from bertfast.gpucheck.compile_report import TARGET_ARCH, parse_ptxas
    nvcc, src = _nvcc_and_csrc()
    if nvcc is None or src is None:
        raise RuntimeError(f"perf-model: the CUDA attention cannot be compiled: {unavailable()}")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "attention_fwd.cubin")
        res = subprocess.run([nvcc, "-std=c++17", "-O3", f"-I{src}", "-cubin", "-gencode",
                              f"arch=compute_{TARGET_ARCH},code=sm_{TARGET_ARCH}", "-Xptxas", "-v",
                              str(src / SOURCE), "-o", cubin], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"perf-model: nvcc failed on {SOURCE}: {res.stderr.strip()[-500:]}")
        with open(cubin, "rb") as f:
            functions = parse(disassemble(f.read()))
    report = parse_ptxas(res.stdout + res.stderr)
    out = CompiledCuda({}, {}, {})
    for dropout in (False, True):
        name = mangled(dropout)
        if name not in functions:
            raise RuntimeError(f"perf-model: {name} is not in {SOURCE}'s cubin (its template arguments changed?)")
        out.functions[dropout] = functions[name]
        stats = report.get(name, {})
        out.registers[dropout] = stats.get("registers")
        out.spills[dropout] = stats["spill_stores"] + stats["spill_loads"] if "spill_stores" in stats else None
    return out


def work(setting: K.Setting, registers: Optional[int]) -> Work:
    """One varlen launch at ``setting`` (every sequence at full length): a main-loop iteration is one
    64 x 64 block of scores; q, k, v and out (bf16) and lse (fp32) moved once."""
    from bertfast.gpucheck.compile_report import MODELS
    hidden = MODELS[setting.model][0]
    heads = hidden // K.HEAD_DIM
    query_blocks = math.ceil(setting.seq / BLOCK_M)
    programs = setting.batch * heads * query_blocks
    iterations = programs * math.ceil(setting.seq / BLOCK_N)
    moved = 4 * setting.tokens * hidden * 2 + setting.tokens * heads * 4
    return Work(iterations, BLOCK_M * BLOCK_N, programs, WARPS, moved, registers=registers,
                shared_bytes=shared_bytes(), loads_ahead=1)


@dataclass
class CudaForward:
    setting: K.Setting
    prediction: Prediction
    registers: Optional[int]
    spills: Optional[int]


def predict_forward(settings: List[K.Setting], gpu: Gpu) -> List[CudaForward]:
    """The CUDA forward predicted at each setting (its dropout picks the kernel)."""
    compiled = compile_forward()
    out = []
    for setting in settings:
        dropout = setting.dropout > 0
        registers = compiled.registers[dropout]
        prediction = predict(compiled.functions[dropout], work(setting, registers), gpu)
        if compiled.spills[dropout]:
            prediction.notes.append(f"spills {compiled.spills[dropout]} bytes of registers")
        out.append(CudaForward(setting, prediction, registers, compiled.spills[dropout]))
    return out
