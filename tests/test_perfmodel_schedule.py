"""The schedule bound: the control bits read from cuobjdump's encodings, one sub-partition's warps replayed
through a loop by hand-built loops whose clocks can be counted, and the bound in a prediction."""
import os

import pytest

from bertfast.perfmodel import model, sass, schedule
from bertfast.perfmodel.hardware import H100

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "attention_fwd_loop.sm90.sass")


def _ins(i, opcode, modifiers="", operands="", stall=1, write=None, read=None, wait=()):
    control = stall | (7 if write is None else write) << 5 | (7 if read is None else read) << 8
    control |= sum(1 << sb for sb in wait) << 11
    return sass.Instruction(16 * i, opcode, modifiers, operands, control=control)


def _loop(*specs):
    """Instructions from (opcode, keyword arguments) pairs, addresses in order, a branch back closing them."""
    out = [_ins(i, op, **kw) for i, (op, kw) in enumerate(specs)]
    return out + [_ins(len(out), "BRA", operands="0x0")]


@pytest.fixture(scope="module")
def attention_loop():
    with open(FIXTURE, encoding="utf-8") as f:
        function = sass.parse(f.read())["_attention_fwd_kernel"]
    return function.body(function.main_loop())


def test_the_control_bits_are_read_from_the_second_encoding_word():
    """Two instructions of the attention forward as cuobjdump prints them: MUFU.EX2 waits 8 clocks
    before the warp's next issue and releases scoreboard 2 when its result is written; the FMUL that
    reads R11 waits on scoreboard 2."""
    text = "\n".join([
        "\t\tFunction : k",
        "        /*1700*/                   MUFU.EX2 R11, R11 ;                  /* 0x0000000b000b7308 */",
        "                                                                        /* 0x000eb00000000800 */",
        "        /*1730*/                   FMUL R56, R56, R11.reuse ;           /* 0x0000000b38387220 */",
        "                                                                        /* 0x084fe20000400000 */"])
    mufu, fmul = sass.parse(text)["k"].instructions
    assert (mufu.stall, mufu.write_scoreboard, mufu.read_scoreboard, mufu.wait_mask) == (8, 2, None, 0)
    assert (fmul.stall, fmul.write_scoreboard, fmul.read_scoreboard, fmul.wait_mask) == (1, None, None, 0b000100)
    # a listing without encodings has no control bits: no stall counts to replay
    bare = sass.parse("\t\tFunction : k\n        /*0000*/                   FMUL R1, R2, R3 ;")["k"].instructions[0]
    assert bare.control is None and bare.stall == 1 and bare.wait_mask == 0
    assert schedule.simulate([bare], 4, 1) is None


def test_a_compiled_loops_control_bits_are_consistent(attention_loop):
    """Read at the wrong bits, the scoreboards would be noise: every scoreboard the attention forward's
    loop waits on is one some instruction of it sets; the fixed-latency arithmetic sets none, every
    shuffle does (variable latency), the cp.async commits set scoreboard 0, which DEPBAR counts."""
    setters = {sb for ins in attention_loop for sb in (ins.write_scoreboard, ins.read_scoreboard) if sb is not None}
    waited = {sb for ins in attention_loop for sb in range(6) if ins.wait_mask >> sb & 1}
    assert waited and waited <= setters
    fixed = ("FFMA", "FMUL", "FADD", "FMNMX")
    assert all(ins.write_scoreboard is None for ins in attention_loop if ins.opcode in fixed)
    assert all(ins.write_scoreboard is not None for ins in attention_loop if ins.opcode == "SHFL")
    assert {ins.write_scoreboard for ins in attention_loop if ins.opcode == "LDGDEPBAR"} == {0}
    assert [ins.operands for ins in attention_loop if ins.opcode == "DEPBAR"] == ["SB0, 0x2"]
    assert all(1 <= ins.stall <= 15 for ins in attention_loop)


def test_independent_arithmetic_issues_a_clock_each():
    loop = _loop(*[("FFMA", {})] * 9)
    one = schedule.simulate(loop, 4, 1)
    assert one.warps == 1 and one.cycles_per_iteration == pytest.approx(10)
    # two programs: two warps a sub-partition, each its 10 issues
    assert schedule.simulate(loop, 4, 2).cycles_per_iteration == pytest.approx(20)


def test_a_variable_latency_result_is_waited_for_and_other_warps_fill_the_wait():
    """MUFU releases scoreboard 0 LATENCY['MUFU'] clocks after it issues; the FMUL waits on it. One
    warp: 20 clocks idle a pass. Four warps of four programs fill them, up to the MUFU pipe's 8 clocks a
    warp-instruction (16 lanes an SM)."""
    loop = _loop(("MUFU", {"modifiers": ".EX2", "write": 0}), ("FMUL", {"wait": (0,)}))
    one = schedule.simulate(loop, 4, 1)
    assert one.cycles_per_iteration == pytest.approx(schedule.LATENCY["MUFU"] + 2)
    assert one.idle["scoreboard"] == pytest.approx(schedule.LATENCY["MUFU"] - 1)
    four = schedule.simulate(loop, 4, 4)
    assert 4 * 3 <= four.cycles_per_iteration < 2 * one.cycles_per_iteration
    assert four.cycles_per_iteration >= 4 * 8  # the MUFU pipe: 8 clocks a warp-instruction a sub-partition


def test_cp_async_groups_in_flight_hide_the_load_latency():
    """A load committed each pass and waited for at the top of the next: with no group left in flight
    (DEPBAR.LE SB0, 0) each pass waits the whole global latency; with one (0x1) the pass before's load
    has had a pass longer."""
    def loop(in_flight):
        return _loop(("DEPBAR", {"modifiers": ".LE", "operands": f"SB0, {in_flight:#x}"}),
                     ("LDGSTS", {"modifiers": ".E.BYPASS.128"}), ("LDGDEPBAR", {"write": 0}),
                     *[("FFMA", {})] * 20)
    latency = H100.global_latency_cycles
    drained = schedule.simulate(loop(0), 4, 1).cycles_per_iteration
    assert drained == pytest.approx(latency + 2, abs=2)
    assert schedule.simulate(loop(1), 4, 1).cycles_per_iteration == pytest.approx(latency / 2 + 1, abs=2)


def test_wgmma_is_queued_on_the_tensor_core_and_waited_for_by_its_group():
    """Four HGMMA 64x64x16 (each warp's quarter 32,768 FLOPs: 32 clocks at a sub-partition's 1,024 a
    clock) read 4 KB of shared memory each (A and B), the last commits the group, WARPGROUP.DEPBAR waits
    for it. One warp: the four products and the group's drain. Waiting for all but one group (0x1),
    two programs keep the tensor core busy: a pass is the tensor core's time."""
    def loop(keep):
        hgmma = [("HGMMA", {"modifiers": ".64x64x16.F32.BF16", "operands": "R24, gdesc[UR12], R24"})] * 3
        return _loop(*hgmma, ("HGMMA", {"modifiers": ".64x64x16.F32.BF16", "operands": "R24, gdesc[UR12], R24, gsb0"}),
                     ("WARPGROUP", {"modifiers": ".DEPBAR.LE", "operands": f"gsb0, {keep:#x}"}), ("FFMA", {}))
    per_product = 2 * 64 * 64 * 16 / 4 / (H100.dense_bf16_flops / H100.sms / H100.clock_hz / 4)
    assert per_product == pytest.approx(32, rel=1e-3)
    # the shared-memory operands (4 KB per warpgroup, a quarter each warp, at 32 bytes a clock) take as long
    assert sass.Instruction(0, "HGMMA", ".64x64x16.F32.BF16", "R24, gdesc[UR12], R24").shared_operand_bytes == 4096
    alone = schedule.simulate(loop(0), 4, 1)
    assert alone.cycles_per_iteration == pytest.approx(4 * per_product + schedule.LATENCY["HGMMA"] + 3, abs=2)
    assert alone.idle["wgmma wait"] > 0
    overlapped = schedule.simulate(loop(1), 4, 2)
    assert overlapped.cycles_per_iteration == pytest.approx(2 * 4 * per_product, rel=0.02)


def test_a_barrier_holds_a_programs_warps_together():
    """Two warps of one 8-warp program on a sub-partition: each pass, the first to reach the barrier
    waits for the other, and both for the barrier's latency."""
    loop = _loop(("FFMA", {}), ("BAR", {"modifiers": ".SYNC.DEFER_BLOCKING", "operands": "0x0"}), ("FFMA", {}))
    got = schedule.simulate(loop, 8, 1)
    assert got.warps == 2
    assert got.cycles_per_iteration == pytest.approx(schedule.LATENCY["BAR"] + 6, abs=2)
    assert got.idle["barrier"] == pytest.approx(schedule.LATENCY["BAR"], abs=2)


def test_the_compiled_loop_replayed(attention_loop):
    """The attention forward's real loop: one warp alone is no faster than its stall counts; a second
    program's warps hide part of the first's waits (the pass takes less than twice as long), and no
    pass takes less than its issue slots or its tensor-core work."""
    one = schedule.simulate(attention_loop, 4, 1)
    assert one.cycles_per_iteration >= sum(ins.stall for ins in attention_loop)
    two = schedule.simulate(attention_loop, 4, 2)
    tensor = sum(ins.mma_flops / 4 for ins in attention_loop) / (H100.dense_bf16_flops / H100.sms / H100.clock_hz / 4)
    assert max(2 * len(attention_loop), 2 * tensor) <= two.cycles_per_iteration < 2 * one.cycles_per_iteration
    assert sum(two.idle.values()) + two.issued_per_iteration == pytest.approx(two.cycles_per_iteration, rel=0.05)


def test_the_replay_skips_idle_clocks_to_the_same_schedule(attention_loop, monkeypatch):
    """Where no warp can issue the replay jumps to the next clock a wait ends: the schedule, its idle
    clocks by reason included, is the one a clock-at-a-time replay gives (the attention's loop at 1-3
    programs, and a barrier's and a load's waits)."""
    barrier = _loop(("FFMA", {}), ("BAR", {"modifiers": ".SYNC.DEFER_BLOCKING", "operands": "0x0"}), ("FFMA", {}))
    load = _loop(("LDG", {"modifiers": ".E", "write": 0}), ("FFMA", {"wait": (0,)}), ("MUFU", {"write": 1}),
                 ("FADD", {"wait": (1,)}))
    cases = [(attention_loop, 4, n) for n in (1, 2, 3)] + [(barrier, 8, 1), (load, 4, 2)]
    skipped = [schedule._replay(loop, warps, n, H100, schedule.ITERATIONS) for loop, warps, n in cases]
    monkeypatch.setattr(schedule, "_next_release", lambda warps, busy, now: now + 1)
    stepped = [schedule._replay(loop, warps, n, H100, schedule.ITERATIONS) for loop, warps, n in cases]
    assert all(s is not None for s in skipped) and skipped == stepped
    assert skipped[-1].idle["scoreboard"] > H100.global_latency_cycles / 2  # the load's wait was skipped over


def test_the_schedule_bound_in_a_prediction(attention_loop):
    """A loop with tensor-core work is priced by its schedule too, and where that is the longer the
    prediction says so; a loop without (a row kernel's) is not: its latency is the latency bound's."""
    function = sass.Function("_attention_fwd_kernel", list(attention_loop))
    work = model.Work(iterations=132 * 2 * 100, tile_elements=128 * 64, programs=132 * 2 * 10, warps=8,
                      hbm_bytes=1e6, registers=124)
    p = model.predict(function, work, H100)
    assert p.resident == 2 and p.schedule["warps"] == 4
    assert p.bounds_s["schedule"] == pytest.approx(100 * p.schedule["cycles_per_iteration"] / H100.clock_hz)
    # two programs an SM, four warps a scheduler: their waits are not all hidden, so the replay takes
    # longer than the issue slots (the largest other bound) and sets the time
    assert p.bounds_s["schedule"] > max(p.bounds_s[k] for k in ("tensor", "issue", "pipe", "memory", "latency"))
    assert p.binding == "schedule" and model.scheduled(p, H100.overlap, H100.memory_overlap)
    assert p.predicted_s == pytest.approx(p.bounds_s["schedule"] / p.wave_efficiency)
    # one program an SM (255 registers): two warps a scheduler hide less
    lone = model.predict(function, model.Work(work.iterations, work.tile_elements, work.programs, 8, 1e6,
                                              registers=255), H100)
    assert lone.resident == 1 and lone.bounds_s["schedule"] > 1.5 * p.bounds_s["schedule"]
    # the same loop without its tensor-core work (a row kernel's): no replay
    plain = [ins for ins in attention_loop if ins.cls != "tensor"]
    rows = model.predict(sass.Function("k", plain), work, H100)
    assert rows.bounds_s["schedule"] == 0 and rows.schedule is None


def test_fit_constant_finds_the_least_loss_under_a_floor():
    """The loss of a prediction floored by a bound (max(a + b x, floor)) has its least where the linear
    fit alone would miss it; the fit stays within [0, top]."""
    measured = [1.0, 1.2]
    def loss(x):
        return sum((max(0.8 + 0.5 * x, floor) / m - 1) ** 2 for m, floor in zip(measured, (0.0, 1.2)))
    best = model.fit_constant(loss)
    assert best == pytest.approx(0.4, abs=1e-6)
    assert model.fit_constant(lambda x: (x + 1) ** 2) == 0.0
    assert model.fit_constant(lambda x: (x - 20) ** 2, top=10.0) == 10.0
