"""One SM sub-partition running a kernel's main loop as ptxas scheduled it: the time its warps take
when their latencies are not hidden.

model.predict's bounds count what a loop asks of each unit (issue slots, pipes, tensor cores, bytes)
as if enough warps were ready to keep every unit busy. A Hopper SM has four sub-partitions (SMSPs),
each with its own scheduler, issuing one warp-instruction per clock; a program of ``w`` warps puts
``w / 4`` on each, and the attention's kernels hold one to three programs per SM (their registers): two
to six warps a scheduler. When each of those waits on a load, a shared-memory read, an exponential
or a barrier, the scheduler has nothing to issue, and no sum of the unit bounds sees it.

The control bits ptxas writes into every instruction (sass.Instruction.control) say how it scheduled
the warp: how many clocks to wait before the warp's next instruction (a fixed-latency result's
distance), and which scoreboards a variable-latency instruction (a load, MUFU, a shuffle) releases
when done and which an instruction waits on. ``simulate`` replays one sub-partition's warps through
``ITERATIONS`` passes of the loop, a clock at a time (from a clock where no warp can issue, on to the
next that ends a wait), with those rules and:

- one issue a clock, to the ready warp that has issued least (programs begin a fraction of a pass
  apart, as programs that started at different times run);
- each pipe busy for its throughput (hardware.Gpu.pipe_rate over 4 sub-partitions); shared memory
  its bytes at a quarter of the SM's 128 a clock, a wgmma's operands read from it included; HGMMA
  queued on the sub-partition's tensor core at a quarter of the SM's dense rate (each warp of a
  warpgroup computes 16 of its 64 rows), a committed group (the HGMMA marked ``gsb0``) done
  ``LATENCY["HGMMA"]`` after its last product drains, ``WARPGROUP.DEPBAR.LE gsb0, N`` waiting until
  at most N groups are in flight; HMMA at mma_sync_flops;
- cp.async loads (LDGSTS) counted in the group LDGDEPBAR commits, ``DEPBAR.LE SBk, N`` waiting until
  at most N groups of scoreboard k are in flight;
- variable latencies from ``LATENCY`` (assumed, from published Hopper microbenchmarks; a GPU run's
  ncu stall reasons are what should set them), global loads at hardware.Gpu.global_latency_cycles;
- a CTA barrier released once the program's warps on the sub-partition arrive (the other three
  sub-partitions run the same warps in step).

The clocks one pass takes in the steady state (the mean over the last half of the passes, and never
less than any unit's own total for a pass: a queue still filling when the replay ends must not hide
it) price the launch: its iterations over the SMs, ``resident`` programs at a time
(model.schedule_bound). What it leaves out: the other programs' traffic lengthening loads beyond the
assumed latency (the memory bounds price bandwidth), bank conflicts, instruction-cache misses, and the
prologue and epilogue (priced by their issue slots).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from bertfast.perfmodel.hardware import H100, Gpu
from bertfast.perfmodel.sass import Instruction

ITERATIONS = 12  # passes simulated; the first half fills the pipelines and queues and is not averaged

# Clocks until a variable-latency result is written (assumed: Hopper microbenchmarks put a shared
# load near 30, MUFU near 20, a shuffle near 25; the wgmma group's drain after its last tensor-core
# work is a guess). Global loads use Gpu.global_latency_cycles.
LATENCY: Dict[str, int] = {"LDS": 30, "LDSM": 30, "LDC": 30, "ULDC": 30, "S2R": 25, "S2UR": 25, "SHFL": 25,
                           "REDUX": 25, "VOTE": 10, "MUFU": 20, "convert": 20, "HGMMA": 40, "HMMA": 20,
                           "MEMBAR": 30, "BAR": 20, "other": 20}
READ_LATENCY = 4  # clocks until a store's (or any scoreboarded read's) sources have been read

_GLOBAL_LOADS = ("LDG", "LDGSTS", "LD", "LDL", "ATOMG", "ATOM", "UTMALDG")
_SB_OPERAND = re.compile(r"SB(\d)\s*,\s*(0x[0-9a-f]+|\d+)")
_GSB_OPERAND = re.compile(r"gsb0\s*,\s*(0x[0-9a-f]+|\d+)")


@dataclass
class Schedule:
    cycles_per_iteration: float     # one pass of the loop by every warp on the sub-partition
    warps: int                      # warps on the sub-partition
    issued_per_iteration: float     # warp-instructions it issues in a pass (every warp's)
    # Clocks in a pass the scheduler issued nothing, by what held the warp that had issued least.
    idle: Dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, object]:
        return {"cycles_per_iteration": self.cycles_per_iteration, "warps": self.warps,
                "issued_per_iteration": self.issued_per_iteration, "idle": self.idle}


@dataclass
class _Warp:
    cta: int
    pc: int = 0
    passes: int = 0
    issued: int = 0
    ready: int = 0                                                   # stall count done
    scoreboards: List[List[int]] = field(default_factory=lambda: [[] for _ in range(6)])  # release clocks
    group: List[int] = field(default_factory=list)                   # cp.async loads since the last commit
    wgmma_open: int = 0                                              # the uncommitted wgmmas' end
    wgmma_groups: List[int] = field(default_factory=list)            # each committed group's end
    at_barrier: bool = False
    released: int = 0                                                # when the last barrier let it go

    def pending(self, sb: int, now: int) -> int:
        self.scoreboards[sb] = [t for t in self.scoreboards[sb] if t > now]
        return len(self.scoreboards[sb])


def pipe_clocks(ins: Instruction, gpu: Gpu) -> Dict[str, float]:
    """SM clocks each pipe but the tensor cores is busy for one warp's ``ins`` (model.predict's pipe
    bound sums them): shared memory at 128 bytes a clock, a wgmma's shared-memory operands included
    (each of its warpgroup's 4 warps issues it: a quarter each); the others at hardware.Gpu.pipe_rate."""
    if ins.cls == "shared":
        return {"shared": ins.access_bytes * 32 / gpu.shared_bytes_per_clock}
    if ins.shared_operand_bytes:
        return {"shared": ins.shared_operand_bytes / 4 / gpu.shared_bytes_per_clock}
    return {pipe: 1.0 / gpu.pipe_rate[pipe] for pipe in gpu.pipes.get(ins.cls, ())}


def _pipe_cycles(ins: Instruction, gpu: Gpu) -> Dict[str, float]:
    """Clocks each pipe of one sub-partition is busy for one warp's ``ins``: pipe_clocks over a quarter
    of the SM, and the tensor core's (a warp's quarter of its warpgroup's wgmma, or one mma.sync)."""
    cycles = {pipe: 4 * c for pipe, c in pipe_clocks(ins, gpu).items()}
    if ins.opcode == "HMMA":
        cycles["tensor"] = ins.mma_flops / (gpu.mma_sync_flops / gpu.sms / gpu.clock_hz / 4)
    elif ins.cls == "tensor":
        cycles["tensor"] = ins.mma_flops / 4 / (gpu.dense_bf16_flops / gpu.sms / gpu.clock_hz / 4)
    return cycles


def _latency(ins: Instruction, gpu: Gpu) -> int:
    if ins.opcode in _GLOBAL_LOADS:
        return gpu.global_latency_cycles
    if ins.opcode in LATENCY:
        return LATENCY[ins.opcode]
    return LATENCY.get(ins.cls, LATENCY["other"])


_REPLAYED: Dict[tuple, Optional[Schedule]] = {}  # a kernel's loop recurs at every setting it is read at


def simulate(loop: Sequence[Instruction], warps_per_program: int, programs: int, gpu: Gpu = H100,
             iterations: int = ITERATIONS) -> Optional[Schedule]:
    """The steady-state clocks of one pass of ``loop`` by the warps ``programs`` resident programs of
    ``warps_per_program`` put on one sub-partition. None when the loop carries no control bits."""
    if not loop or any(ins.control is None for ins in loop):
        return None
    key = (tuple(loop), warps_per_program, programs, repr(gpu), iterations, tuple(sorted(LATENCY.items())))
    if key not in _REPLAYED:
        _REPLAYED[key] = _replay(loop, warps_per_program, programs, gpu, iterations)
    return _REPLAYED[key]


def _replay(loop: Sequence[Instruction], warps_per_program: int, programs: int, gpu: Gpu,
            iterations: int) -> Optional[Schedule]:
    per_smsp = max(1, warps_per_program // 4)
    # Programs start at different times on a GPU: each begins a fraction of a pass after the one before,
    # so one's tensor-core phase can meet another's arithmetic.
    programs = max(1, programs)
    warps = [_Warp(cta, pc=cta * len(loop) // programs) for cta in range(programs) for _ in range(per_smsp)]
    pipes = {ins.address: _pipe_cycles(ins, gpu) for ins in loop}
    busy: Dict[str, float] = {}
    tensor_free = 0.0
    idle: Dict[str, float] = {}
    issued = 0
    marks: List[tuple] = []  # (clock, issued, idle) when every warp had ended 1, 2, ... passes
    now = 0
    limit = 200_000 * iterations
    while any(w.passes < iterations for w in warps):
        if now > limit:
            raise RuntimeError("schedule: the simulated loop did not finish (a wait nothing releases?)")
        order = sorted(range(len(warps)), key=lambda i: (warps[i].issued, i))
        chosen, reason = None, None
        for i in order:
            w = warps[i]
            if w.passes >= iterations:
                continue
            why = _blocked(w, loop[w.pc], now, busy, pipes)
            if why is None:
                chosen = i
                break
            reason = reason or why
        if chosen is None:  # nothing can issue until the next clock a wait ends: on to it
            later = _next_release(warps, busy, now)
            step = (later if later is not None else limit + 1) - now
            idle[reason or "done"] = idle.get(reason or "done", 0) + step
            now += step
            continue
        w = warps[chosen]
        ins = loop[w.pc]
        w.issued += 1
        issued += 1
        w.ready = now + max(1, ins.stall)
        for pipe, cycles in pipes[ins.address].items():
            if pipe != "tensor":
                busy[pipe] = max(busy.get(pipe, 0.0), now) + cycles
        if ins.cls == "tensor":
            tensor_free = max(tensor_free, now) + pipes[ins.address]["tensor"]
            done = int(tensor_free) + _latency(ins, gpu)
            if ins.opcode == "HMMA":
                if ins.write_scoreboard is not None:
                    w.scoreboards[ins.write_scoreboard].append(done)
            else:
                w.wgmma_open = max(w.wgmma_open, done)
                if "gsb0" in ins.operands:  # the wgmma that commits the group (wgmma.commit_group)
                    w.wgmma_groups.append(w.wgmma_open)
                    w.wgmma_open = 0
        elif ins.opcode == "LDGSTS":
            w.group.append(now + _latency(ins, gpu))
        elif ins.opcode == "LDGDEPBAR":
            if ins.write_scoreboard is not None:
                w.scoreboards[ins.write_scoreboard].append(max(w.group, default=now))
            w.group = []
        elif ins.write_scoreboard is not None:
            w.scoreboards[ins.write_scoreboard].append(now + _latency(ins, gpu))
        if ins.read_scoreboard is not None:
            w.scoreboards[ins.read_scoreboard].append(now + READ_LATENCY)
        if ins.opcode == "BAR" and ".SYNC" in ins.modifiers:
            w.at_barrier = True
            mates = [m for m in warps if m.cta == w.cta]
            if all(m.at_barrier for m in mates):
                for m in mates:
                    m.at_barrier = False
                    m.released = now + LATENCY["BAR"]
        w.pc += 1
        if w.pc == len(loop):
            w.pc = 0
            w.passes += 1
            if min(m.passes for m in warps) > len(marks):  # every warp has ended another pass
                marks.append((now, issued, dict(idle)))
        now += 1
    if len(marks) < 2:
        return None
    (t0, issued0, idle0), (t1, issued1, idle1) = marks[len(marks) // 2 - 1], marks[-1]
    passes = len(marks) - len(marks) // 2
    waits = {k: (v - idle0.get(k, 0)) / passes for k, v in idle1.items() if v > idle0.get(k, 0)}
    # A pass can take no less than what its warps ask of each unit: a queue (the tensor core's behind
    # wgmma.wait(1)) that is still filling at the end of the simulated passes would otherwise hide it.
    units: Dict[str, float] = {"issue": float(len(loop))}
    for cycles in pipes.values():
        for pipe, c in cycles.items():
            units[pipe] = units.get(pipe, 0.0) + c
    cycles = max([(t1 - t0) / passes] + [c * len(warps) for c in units.values()])
    return Schedule(cycles, len(warps), (issued1 - issued0) / passes,
                    dict(sorted(waits.items(), key=lambda kv: -kv[1])))


def _next_release(warps: Sequence[_Warp], busy: Dict[str, float], now: int) -> Optional[int]:
    """The first clock after ``now`` at which a wait _blocked checks can end (a barrier ends only when a
    warp issues): until then every warp is held for the same reason. None: no wait ever ends."""
    times = [math.ceil(t) for t in busy.values() if t > now]
    for w in warps:
        times += [t for t in (w.released, w.ready, *w.wgmma_groups) if t > now]
        for board in w.scoreboards:
            times += [t for t in board if t > now]
    return min(times, default=None)


def _blocked(w: _Warp, ins: Instruction, now: int, busy: Dict[str, float],
             pipes: Dict[int, Dict[str, float]]) -> Optional[str]:
    """Why ``w`` cannot issue ``ins`` at ``now`` (None: it can)."""
    if w.at_barrier or now < w.released:
        return "barrier"
    if now < w.ready:
        return "stall count"
    for sb in range(6):
        if ins.wait_mask >> sb & 1 and w.pending(sb, now):
            return "scoreboard"
    if ins.opcode == "DEPBAR":
        m = _SB_OPERAND.search(ins.operands)
        if m and w.pending(int(m.group(1)), now) > int(m.group(2), 0):
            return "cp.async wait"
    if ins.opcode == "WARPGROUP" and ".DEPBAR" in ins.modifiers:
        m = _GSB_OPERAND.search(ins.operands)
        w.wgmma_groups = [t for t in w.wgmma_groups if t > now]
        if len(w.wgmma_groups) > (int(m.group(1), 0) if m else 0):
            return "wgmma wait"
    for pipe in pipes[ins.address]:
        if pipe != "tensor" and busy.get(pipe, 0.0) > now:
            return f"{pipe} pipe"
    return None

