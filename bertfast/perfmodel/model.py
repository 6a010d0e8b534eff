"""A kernel's predicted time on the GPU of ``hardware``, from its SASS and the work it is given.

The main loop's instructions (sass.Function.main_loop) run once per tile of work: ``iterations``
tiles of ``tile_elements`` elements each, over the whole launch; the instructions outside it run
once per program. Every warp of a program runs the same instructions, so a launch issues
``instructions x warps`` warp-instructions. Four bounds, each the time the launch would take if
only that resource limited it, and the waves:

- tensor: the wgmma FLOPs (one HGMMA per warpgroup of 4 warps) at the dense bf16 peak, and the
  mma.sync FLOPs (HMMA, per warp) at hardware.Gpu.mma_sync_flops;
- issue: warp-instructions at ``issue_per_clock`` per SM;
- pipe: the busiest execution pipe (fp32, int, MUFU, conversions, shuffles at their rates; shared
  memory at 128 bytes per clock);
- memory: the launch's HBM bytes at the achievable bandwidth;
- latency: Little's law. An SM keeps only the loads its resident programs have issued in flight:
  the bytes one main-loop iteration (or a loopless program) loads, its copies into shared memory
  (LDGSTS) times the iterations a software pipeline runs ahead (Work.loads_ahead; a load into
  registers is in flight for one iteration at most), times the programs running on it at once
  (registers and the grid allow). Reads then arrive at SMs x in-flight bytes /
  memory_latency_s at best: a kernel with few programs per SM is bound by latency, not bandwidth
  (the row kernels that ran two programs per SM measured 2-2.5x their bandwidth bound on the H200);
- schedule: one SM sub-partition replaying the main loop as ptxas scheduled it, a clock at a time
  (schedule.simulate): its warps' stall counts and scoreboard waits, which the other bounds treat as
  hidden by other warps, with only the few warps the resident programs give it. Priced for loops with
  tensor-core work (the attention), where one or two programs an SM leave latencies exposed; a row
  kernel's exposed latency is the latency bound's;
- waves: P programs spread over the SMs give some SMs ceil(P / SMs) programs and others
  one fewer, so the launch lasts as long as the busiest SM (the bounds are divided by that
  efficiency, (P / SMs) / ceil(P / SMs)). Programs resident per SM (registers, shared memory,
  warps) are reported: one program of 4 warps per SM hides latency poorly, which the schedule bound
  prices.

predicted = the largest of tensor, max(issue, pipe) and max(memory, latency) + overlap x the sum of the
other two, or the schedule bound where that is longer, each part divided by the wave efficiency
except the memory part of a launch whose programs are all resident at once (HBM bandwidth is shared
by the whole GPU: an SM with one program fewer does not slow the others' reads). ``overlap``
(hardware.Gpu) says how imperfectly the units overlap, 0 being perfect: ``memory_overlap`` where
memory binds a kernel without tensor-core work (a row kernel's arithmetic hides under its loads),
``overlap`` elsewhere (the attention, whatever binds it). These are estimates for planning, never
measurements.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from bertfast.perfmodel.hardware import H100, Gpu
from bertfast.perfmodel.sass import Function, Instruction, class_counts
from bertfast.perfmodel.schedule import Schedule, pipe_clocks, simulate


@dataclass
class Work:
    """What one launch does: its tiles, programs and traffic (the perf model's kernel table)."""

    iterations: float        # main-loop iterations over the launch (programs when there is no loop)
    tile_elements: int       # elements one iteration (or program) handles
    programs: int            # programs in the grid
    warps: int               # warps per program
    hbm_bytes: float         # bytes the op moves to and from HBM (each tensor once)
    registers: Optional[int] = None
    shared_bytes: int = 0
    overhead_bytes: float = 0.0  # and what the launch moves beside them (partial sums): timed, not useful bandwidth
    loads_ahead: int = 1         # main-loop iterations whose loads are in flight at once (a software
    #                              pipeline of S stages keeps S - 1)

    @property
    def moved_bytes(self) -> float:
        return self.hbm_bytes + self.overhead_bytes


@dataclass
class Prediction:
    kernel: str
    loop: bool                         # False: no loop, the whole body per program
    per_element: Dict[str, float]      # main-loop thread-instructions per element, by class, and "total"
    bounds_s: Dict[str, float]         # tensor, issue, pipe, memory, latency
    parts_s: Dict[str, float]          # tensor, compute (= max(issue, pipe)), memory (= max(memory,
    #                                    latency)): what overlaps
    binding: str                       # the largest bound's name (the pipe's name for "pipe")
    resident: int                      # programs per SM
    wave_efficiency: float
    single_wave: bool                  # every program resident at once (the memory part is not divided)
    predicted_s: float
    tensor_flops: float                # tensor-core FLOPs the launch runs (wgmma and mma.sync)
    notes: List[str] = field(default_factory=list)
    schedule: Optional[Dict[str, object]] = None  # schedule.Schedule.to_dict() of the simulated main loop

    def to_dict(self) -> Dict[str, object]:
        return {"kernel": self.kernel, "loop": self.loop, "per_element": self.per_element, "bounds_s": self.bounds_s,
                "parts_s": self.parts_s,
                "binding": self.binding, "resident_per_sm": self.resident, "wave_efficiency": self.wave_efficiency,
                "single_wave": self.single_wave, "predicted_s": self.predicted_s, "tensor_flops": self.tensor_flops,
                "notes": self.notes, "schedule": self.schedule}


def resident_per_sm(work: Work, gpu: Gpu = H100) -> int:
    """Programs one SM holds at once: registers, shared memory, warps and the block limit."""
    limits = [gpu.max_blocks_per_sm, gpu.max_warps_per_sm // work.warps]
    if work.registers:
        # registers are allocated per warp in units of 256 (8 per thread)
        per_warp = math.ceil(work.registers * 32 / 256) * 256
        limits.append(gpu.registers_per_sm // (per_warp * work.warps))
    if work.shared_bytes:
        limits.append(gpu.shared_per_sm // work.shared_bytes)
    return max(0, min(limits))


def _pipe_clocks(instructions: List[Instruction], gpu: Gpu) -> Dict[str, float]:
    """Clocks per warp each pipe is busy for one pass over ``instructions``."""
    clocks: Dict[str, float] = {}
    for ins in instructions:
        for pipe, c in pipe_clocks(ins, gpu).items():
            clocks[pipe] = clocks.get(pipe, 0.0) + c
    return clocks


_LOADS = ("LDG", "LDGSTS")


def global_bytes(instructions: List[Instruction], warps: int) -> Tuple[float, float]:
    """(loaded, stored) global-memory bytes of one pass over ``instructions`` by a program of
    ``warps`` warps (every lane of each LDG/LDGSTS and STG counted, masked or not)."""
    loaded = sum(ins.access_bytes for ins in instructions if ins.opcode in _LOADS) * 32 * warps
    stored = sum(ins.access_bytes for ins in instructions if ins.opcode == "STG") * 32 * warps
    return float(loaded), float(stored)


def loop_and_rest(function: Function) -> Tuple[Optional[Tuple[int, int]], List[Instruction], List[Instruction]]:
    """(the main loop's span, its instructions, the instructions outside it that run: not its tail
    copies, sass.Function.tail_copies, idle at the full lengths predicted). Without a loop the whole
    body is the "loop", run once per program, and nothing is outside it."""
    span = function.main_loop()
    if span is None:
        return None, function.instructions, []
    skipped = [span, *function.tail_copies()]
    rest = [ins for i, ins in enumerate(function.instructions) if not any(a <= i <= b for a, b in skipped)]
    return span, function.body(span), rest


def latency_bound(loop: List[Instruction], rest: List[Instruction], work: Work, resident: int,
                  gpu: Gpu = H100) -> float:
    """Seconds the launch's reads take when each SM has only its programs' loads of one iteration
    in flight (Little's law; the module's note). 0 when the kernel loads nothing it can count."""
    loop_loads, loop_stores = global_bytes(loop, work.warps)
    rest_loads, rest_stores = global_bytes(rest, work.warps)
    if loop_loads == 0:
        return 0.0
    loads = loop_loads * work.iterations + rest_loads * work.programs
    stores = loop_stores * work.iterations + rest_stores * work.programs
    read_bytes = work.moved_bytes * loads / (loads + stores)
    concurrent = min(max(resident, 1), work.programs / gpu.sms)
    # Only copies into shared memory (LDGSTS, a software pipeline's) run loads_ahead iterations ahead: a
    # load into registers (LDG) is read before the loop's next pass loads into the same registers, so it
    # is in flight for one pass at most, however far ahead the source prefetches.
    copied, _ = global_bytes([ins for ins in loop if ins.opcode == "LDGSTS"], work.warps)
    in_flight = gpu.sms * concurrent * (loop_loads + copied * (work.loads_ahead - 1))
    return read_bytes * gpu.memory_latency_s / in_flight


def schedule_bound(loop: List[Instruction], rest: List[Instruction], work: Work, resident: int,
                   gpu: Gpu = H100) -> Tuple[float, Optional[Schedule]]:
    """(seconds, the simulation): the main loop's iterations at the simulated sub-partition's clocks a
    pass, the programs an SM holds at once running side by side, and the instructions outside the loop
    at their issue slots. (0, None) for a loop without tensor-core work or without control bits."""
    if not any(ins.cls == "tensor" for ins in loop):
        return 0.0, None
    concurrent = max(1, min(resident, math.ceil(work.programs / gpu.sms)))
    simulated = simulate(loop, work.warps, concurrent, gpu)
    if simulated is None:
        return 0.0, None
    loop_s = work.iterations / (gpu.sms * concurrent) * simulated.cycles_per_iteration / gpu.clock_hz
    rest_s = len(rest) * work.warps * work.programs / (gpu.issue_per_clock * gpu.sms * gpu.clock_hz)
    return loop_s + rest_s, simulated


def predict(function: Function, work: Work, gpu: Gpu = H100) -> Prediction:
    span, loop, rest = loop_and_rest(function)
    counts = class_counts(loop)
    threads = 32 * work.warps
    per_element = {cls: n * threads / work.tile_elements for cls, n in counts.items() if n}
    per_element["total"] = len(loop) * threads / work.tile_elements

    # Warp-instructions and pipe clocks over the launch (per SM: spread over every SM).
    warp_instr = (len(loop) * work.iterations + len(rest) * work.programs) * work.warps
    pipes = {name: c * work.iterations * work.warps for name, c in _pipe_clocks(loop, gpu).items()}
    for name, c in _pipe_clocks(rest, gpu).items():
        pipes[name] = pipes.get(name, 0.0) + c * work.programs * work.warps
    sm_clock = gpu.sms * gpu.clock_hz
    def flops(instructions: List[Instruction], wgmma: bool) -> float:
        # an HGMMA is issued by each warp of its warpgroup (4 warps share its FLOPs); an HMMA by one warp
        return sum(ins.mma_flops for ins in instructions if (ins.opcode != "HMMA") == wgmma) / (4 if wgmma else 1)

    wgmma_flops = (flops(loop, True) * work.iterations + flops(rest, True) * work.programs) * work.warps
    sync_flops = (flops(loop, False) * work.iterations + flops(rest, False) * work.programs) * work.warps
    tensor_flops = wgmma_flops + sync_flops
    busiest = max(pipes, key=pipes.get) if pipes else "fma"
    resident = resident_per_sm(work, gpu)
    notes = []
    if resident == 0:
        notes.append("does not fit on an SM (registers or shared memory)")
        resident = 1
    bounds = {"tensor": wgmma_flops / gpu.dense_bf16_flops + sync_flops / gpu.mma_sync_flops,
              "issue": warp_instr / (gpu.issue_per_clock * sm_clock),
              "pipe": pipes.get(busiest, 0.0) / sm_clock,
              "memory": work.moved_bytes / gpu.achievable_hbm_bytes_per_s,
              "latency": latency_bound(loop, rest, work, resident, gpu)}
    simulated = None
    if span is not None:
        bounds["schedule"], simulated = schedule_bound(loop, rest, work, resident, gpu)
    compute = max(bounds["issue"], bounds["pipe"])
    parts = {"tensor": bounds["tensor"], "compute": compute, "memory": max(bounds["memory"], bounds["latency"])}
    top = max(parts, key=parts.get)
    per_sm = work.programs / gpu.sms
    efficiency = per_sm / math.ceil(per_sm)
    single_wave = work.programs <= resident * gpu.sms
    binding = {"compute": "issue" if bounds["issue"] >= bounds["pipe"] else busiest,
               "memory": "latency" if bounds["latency"] > bounds["memory"] else "memory"}.get(top, top)
    prediction = Prediction(function.name, span is not None, per_element, bounds, parts, binding, resident,
                            efficiency, single_wave, 0.0, tensor_flops, notes,
                            simulated.to_dict() if simulated is not None else None)
    prediction.predicted_s = retime(prediction, gpu.overlap, gpu.memory_overlap)
    if scheduled(prediction, gpu.overlap, gpu.memory_overlap):
        prediction.binding = "schedule"
    return prediction


def _waved_parts(prediction: Prediction, latency_factor: float) -> Tuple[Dict[str, float], str]:
    """(tensor, compute and memory parts after the waves, the largest's name), the memory latency
    scaled by ``latency_factor`` (the latency bound is linear in it)."""
    b, efficiency = prediction.bounds_s, prediction.wave_efficiency
    memory = max(b["memory"], b["latency"] * latency_factor)
    parts = {"tensor": b["tensor"] / efficiency, "compute": max(b["issue"], b["pipe"]) / efficiency,
             "memory": memory if prediction.single_wave else memory / efficiency}
    return parts, max(parts, key=parts.get)


def streaming(prediction: Prediction, latency_factor: float = 1.0) -> bool:
    """Whether ``memory_overlap`` prices the kernel: memory binds it and it has no tensor-core work."""
    return _waved_parts(prediction, latency_factor)[1] == "memory" and prediction.bounds_s["tensor"] == 0


def retime(prediction: Prediction, overlap: float, memory_overlap: float, latency_factor: float = 1.0) -> float:
    """The prediction's time under other constants (what calibration fits): the two overlaps, and
    the memory latency scaled by ``latency_factor``."""
    parts, top = _waved_parts(prediction, latency_factor)
    chosen = memory_overlap if streaming(prediction, latency_factor) else overlap
    return max(parts[top] + chosen * (sum(parts.values()) - parts[top]),
               prediction.bounds_s.get("schedule", 0.0) / prediction.wave_efficiency)


def scheduled(prediction: Prediction, overlap: float, memory_overlap: float) -> bool:
    """Whether the schedule bound sets the prediction's time under these constants."""
    schedule_s = prediction.bounds_s.get("schedule", 0.0) / prediction.wave_efficiency
    return schedule_s > 0 and retime(prediction, overlap, memory_overlap) == schedule_s


def fit_constant(loss: Callable[[float], float], top: float = 10.0) -> float:
    """The constant in [0, top] with the least ``loss``: a grid 0.01 apart, then a golden-section search
    around its best point (the predictions are piecewise linear in an overlap, the schedule bound a
    floor under them, so the loss need not be one parabola)."""
    grid = [i / 100 for i in range(int(top * 100) + 1)]
    best = min(grid, key=lambda x: (loss(x), x))
    lo, hi = max(0.0, best - 0.01), min(top, best + 0.01)
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(60):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if loss(a) <= loss(b):
            hi = b
        else:
            lo = a
    mid = (lo + hi) / 2
    return mid if round(loss(mid), 12) < round(loss(best), 12) else best


def time_with_overlap(prediction: Prediction, overlap: float) -> float:
    """The prediction's time with one overlap constant whatever binds it (report.fit_overlap, for the
    kernels memory_overlap does not price)."""
    return retime(prediction, overlap, overlap)
