"""Reading sm_90 SASS: instructions, their classes, and a kernel's main loop.

The text is ``cuobjdump -sass`` of a cubin (the disassembler Triton's package carries, or the CUDA
toolkit's). Each instruction line reads ``/*0140*/  @!P0 OPCODE.MODIFIERS operands ;`` and ends with
its encoding's low 64 bits; the next line holds the high 64, whose top 23 are the control bits ptxas
scheduled it with (Instruction.control: schedule.py replays them). A loop is
a backward branch: ``BRA`` to an earlier address; its body is every instruction from the target
to the branch. The main loop is the shortest loop with the most tensor-core instructions, the first
of equals (the attention kernels' loop over full key or query blocks); its copies, the loops with as
many tensor-core instructions (over the masked tail block, or with masked keys: longer, their masks
cost instructions), do not run when lengths are multiples of the block (``tail_copies``). Without
tensor-core work the main loop is the largest loop (a row kernel's loop over row tiles); a kernel
without a loop is its whole body, run once per program.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

# Instruction classes: what an opcode occupies (hardware.Gpu.pipes maps a class to its pipes, and
# pipe_rate gives each pipe's warp-instructions per clock per SM). "uniform", "sync" and "control"
# only take issue slots.
CLASSES = ("tensor", "fp32", "imad", "int", "mufu", "convert", "shared", "global", "shuffle", "uniform", "sync",
           "control", "other")
_CLASS_OF = {
    "tensor": ("HGMMA", "HMMA", "QGMMA", "IMMA", "BMMA", "DMMA"),
    # Single-precision arithmetic, and I2FP (Hopper's integer-to-float in the FMA pipe).
    "fp32": ("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FSET", "FCHK", "FSWZADD", "HADD2", "HMUL2",
             "HFMA2", "HMNMX2", "HSETP2", "I2FP"),
    # Integer multiply(-add) and dot products: the FMA pipe's heavy half, not the ALU (IMAD.MOV and
    # IMAD.SHL are ptxas moving ALU work there).
    "imad": ("IMAD", "IMUL", "IDP"),
    # Integer and logic, moves and packing conversions (the 64-lane ALU).
    "int": ("IADD3", "IADD", "VIADD", "VIADDMNMX", "LOP3", "LOP", "SHF", "SHL", "SHR", "SEL", "PRMT",
            "ISETP", "LEA", "IABS", "IMNMX", "VIMNMX", "SGXT", "BMSK", "BREV", "FLO", "POPC", "MOV", "CS2R",
            "P2R", "R2P", "PLOP3", "F2FP", "ICMP"),
    "mufu": ("MUFU",),
    "convert": ("F2F", "F2I", "I2F", "FRND", "I2I", "F2IP"),
    "shared": ("LDS", "STS", "LDSM", "STSM", "ATOMS"),
    "global": ("LDG", "STG", "LDGSTS", "RED", "REDG", "ATOM", "ATOMG", "LD", "ST", "LDL", "STL", "UTMALDG", "UTMASTG",
               "UBLKCP", "UTMAPF", "CCTL"),
    "shuffle": ("SHFL", "REDUX", "VOTE", "MATCH"),
    "sync": ("BAR", "DEPBAR", "LDGDEPBAR", "MEMBAR", "FENCE", "WARPGROUP", "WARPSYNC", "SYNCS", "ARRIVES",
             "ERRBAR", "ELECT"),
    "control": ("BRA", "EXIT", "BSSY", "BSYNC", "RET", "CALL", "JMP", "BRX", "NOP", "YIELD", "BPT", "WARPGROUP_ARRIVE"),
}
OPCODE_CLASS = {op: cls for cls, ops in _CLASS_OF.items() for op in ops}

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Za-z0-9_]+)*)\s*([^;]*);")
_HIGH_WORD = re.compile(r"^\s*/\*\s*0x([0-9a-f]{16})\s*\*/\s*$")
_FUNCTION = re.compile(r"Function\s*:\s*(\S+)")
_GMMA_SHAPE = re.compile(r"\.(\d+)x(\d+)x(\d+)")
_HMMA_SHAPE = re.compile(r"^\.(16)(8)(16|8)\b")  # HMMA.16816: mma.sync m16n8k16 (m16n8k8: .1688)


@dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str           # "HGMMA"
    modifiers: str        # ".64x64x16.F32.BF16"
    operands: str
    predicate: str = ""   # "@!P0", or "" when unconditional
    # The scheduling control bits ptxas sets in the top 23 bits of the 128-bit encoding (the second
    # hex word cuobjdump prints): stall cycles before the warp's next issue, the scoreboards this
    # instruction sets (written result, read sources) and those it waits on. None: not read.
    control: Optional[int] = None

    @property
    def stall(self) -> int:
        return self.control & 0xF if self.control is not None else 1

    @property
    def write_scoreboard(self) -> Optional[int]:
        """The scoreboard released when a variable-latency result is written (None: fixed latency)."""
        sb = (self.control >> 5) & 7 if self.control is not None else 7
        return None if sb == 7 else sb

    @property
    def read_scoreboard(self) -> Optional[int]:
        """The scoreboard released once the sources are read (a store's data register may then change)."""
        sb = (self.control >> 8) & 7 if self.control is not None else 7
        return None if sb == 7 else sb

    @property
    def wait_mask(self) -> int:
        """The scoreboards (bit i: scoreboard i) that must be clear before this instruction issues."""
        return (self.control >> 11) & 0x3F if self.control is not None else 0

    @property
    def cls(self) -> str:
        if self.opcode.startswith("U") and self.opcode not in OPCODE_CLASS:
            return "uniform"  # ULDC, UIADD3, UMOV ...: the uniform datapath, one issue slot
        return OPCODE_CLASS.get(self.opcode, "other")

    @property
    def branch_target(self) -> Optional[int]:
        if self.opcode != "BRA":
            return None
        m = re.search(r"0x([0-9a-f]+)", self.operands)
        return int(m.group(1), 16) if m else None

    @property
    def access_bytes(self) -> int:
        """Bytes per thread of a load or store: .64 / .128 suffixes, 4 without one (narrower accesses
        take a full shared-memory wavefront too); LDSM/STSM .M88.N: N 8x8 matrices of 16-bit values."""
        if self.opcode in ("LDSM", "STSM"):
            x = re.search(r"\.M88\.(\d)", self.modifiers)
            return 4 * int(x.group(1)) if x else 4
        m = re.search(r"\.(64|128)\b", self.modifiers)
        return int(m.group(1)) // 8 if m else 4

    @property
    def shared_operand_bytes(self) -> int:
        """Shared-memory bytes one wgmma (HGMMA mMnNkK, per warpgroup) reads for its operands: B (N x K)
        always, A (M x K) unless it comes from registers (``HGMMA R24, R100, gdesc[..]``: A in R100;
        ``HGMMA R24, gdesc[..], ...``: both through the one descriptor pair). 0 for other instructions."""
        if self.opcode not in ("HGMMA", "QGMMA"):
            return 0
        m = _GMMA_SHAPE.search(self.modifiers)
        if not m:
            return 0
        rows, cols, depth = (int(x) for x in m.groups())
        size = 4 if ".TF32" in self.modifiers else 1 if ("E4M3" in self.modifiers or "E5M2" in self.modifiers) else 2
        sources = [op.strip() for op in self.operands.split(",")][1:]
        a_shared = bool(sources) and sources[0].startswith("gdesc")
        return (rows * depth * a_shared + cols * depth) * size

    @property
    def mma_flops(self) -> int:
        """Floating-point operations of one wgmma (HGMMA mMnNkK: 2·M·N·K per warpgroup) or one mma.sync
        (HMMA.16816: 2·16·8·16 per warp), else 0."""
        if self.cls != "tensor":
            return 0
        m = _GMMA_SHAPE.search(self.modifiers) if self.opcode != "HMMA" else _HMMA_SHAPE.search(self.modifiers)
        if not m:
            return 0
        a, b, c = (int(x) for x in m.groups())
        return 2 * a * b * c


@dataclass
class Function:
    name: str
    instructions: List[Instruction] = field(default_factory=list)

    def loops(self) -> List[Tuple[int, int]]:
        """(first index, last index) of every loop body: a branch back to an earlier address (not the
        branch to itself that ends every kernel after its EXIT)."""
        index = {ins.address: i for i, ins in enumerate(self.instructions)}
        out = []
        for i, ins in enumerate(self.instructions):
            target = ins.branch_target
            if target is not None and target < ins.address and target in index:
                out.append((index[target], i))
        return out

    def _tensor(self, span: Tuple[int, int]) -> int:
        return sum(1 for ins in self.body(span) if ins.cls == "tensor")

    def main_loop(self) -> Optional[Tuple[int, int]]:
        """The shortest loop with the most tensor-core instructions (the first of equals); without any,
        the largest loop. None: the kernel has no loop."""
        loops = self.loops()
        if not loops:
            return None
        tensor = {span: self._tensor(span) for span in loops}
        most = max(tensor.values())
        if most:
            return min((span for span in loops if tensor[span] == most), key=lambda span: (span[1] - span[0], span[0]))
        return max(loops, key=lambda span: (span[1] - span[0], -span[0]))

    def tail_copies(self) -> List[Tuple[int, int]]:
        """The other loops with the main loop's tensor-core work: its copies for a masked tail block or
        masked keys, which do not run at lengths that are multiples of the block."""
        main = self.main_loop()
        if main is None or not self._tensor(main):
            return []
        return [span for span in self.loops() if span != main and self._tensor(span) == self._tensor(main)]

    def body(self, span: Optional[Tuple[int, int]]) -> List[Instruction]:
        return self.instructions if span is None else self.instructions[span[0]:span[1] + 1]


def parse(text: str) -> Dict[str, Function]:
    """Functions of a ``cuobjdump -sass`` listing, by name, their instructions in address order."""
    functions: Dict[str, Function] = {}
    current: Optional[Function] = None
    for line in text.splitlines():
        m = _FUNCTION.search(line)
        if m:
            current = functions.setdefault(m.group(1), Function(m.group(1)))
            continue
        m = _LINE.search(line)
        if m and current is not None:
            current.instructions.append(Instruction(int(m.group(1), 16), m.group(3), m.group(4) or "",
                                                    m.group(5).strip(), (m.group(2) or "").strip()))
            continue
        m = _HIGH_WORD.match(line)
        if m and current is not None and current.instructions and current.instructions[-1].control is None:
            # the line after an instruction's: its encoding's high 64 bits, whose top 23 are the control
            current.instructions[-1] = replace(current.instructions[-1], control=int(m.group(1), 16) >> 41)
    return functions


def class_counts(instructions: Sequence[Instruction]) -> Dict[str, int]:
    counts = Counter(ins.cls for ins in instructions)
    return {cls: counts.get(cls, 0) for cls in CLASSES}


def find_cuobjdump() -> Optional[str]:
    """cuobjdump: the one Triton's NVIDIA backend carries, else the CUDA toolkit's on PATH."""
    try:
        import triton
        bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        if os.access(bundled, os.X_OK):
            return bundled
    except ImportError:
        pass
    return shutil.which("cuobjdump")


def disassemble(cubin: bytes, tool: Optional[str] = None) -> str:
    tool = tool or find_cuobjdump()
    if tool is None:
        raise RuntimeError("perf-model: no cuobjdump found (Triton's NVIDIA backend carries one; or put the CUDA "
                           "toolkit's bin on PATH)")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([tool, "-sass", path], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"perf-model: cuobjdump failed: {out.stderr.strip()[-300:]}")
    return out.stdout
