"""The H100 the performance model predicts for: every constant in one place, with where it comes from.

Datasheet and whitepaper: NVIDIA H100 Tensor Core GPU datasheet and the "NVIDIA H100 Tensor Core GPU
Architecture" whitepaper (SXM5 part). Throughput per pipe: the CUDA C++ Programming Guide's table of
arithmetic instruction throughput, compute capability 9.0. The achievable bandwidth: a copy timed on
an H100 of the machines this project is lent. Where a figure is an assumption, it says so; the
memory latency and the overlap where memory binds a row kernel are fitted to a GPU run's kernels;
``overlap`` (the attention's) is assumed until a run measures such a kernel unchanged since
(docs/perf-model.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict


@dataclass(frozen=True)
class Gpu:
    name: str = "H100 SXM5 80GB"
    sms: int = 132                       # datasheet
    clock_hz: float = 1.83e9             # the boost clock the datasheet's peaks are computed at (989.4e12 / 540,672)
    dense_bf16_flops: float = 989.4e12   # datasheet, dense (no sparsity): 4096 FLOP per clock per SM
    hbm_bytes_per_s: float = 3.35e12     # datasheet, HBM3
    # A device-to-device copy, read + write counted, on an H100 of the machines this project is lent
    # (2026-11-13, as the machines' notes record it: this project has not timed an H100 itself yet).
    achievable_hbm_bytes_per_s: float = 3.0e12
    # cuBLAS on BERT's GEMMs: the BERT-large seq-128 step's linear layers, 28.9 TFLOP on the model
    # suite's 15,691 real tokens, in 39.7 ms of GEMM kernels as traced in this project's H200 run
    # (2026-11-26; the H100 has the same tensor cores).
    gemm_flops: float = 727e12
    # mma.sync (HMMA in SASS, Ampere's warp-level instruction, which the CUDA attention issues): Hopper's
    # full tensor-core rate is wgmma's (HGMMA), and the older instruction reaches only part of it.
    # Assumed: half the dense peak, for planning, until a GPU run times it (python -m
    # bertfast.perfmodel.mma_rate, a step of the GPU check's stage 1).
    mma_sync_flops: float = 494.7e12
    launch_gap_s: float = 1.0e-6         # assumed: between back-to-back kernels on the device (a CUDA graph)
    # How long a global load takes to return under load (Little's law in model.latency_bound): fitted
    # to the H100 run of 2026-11-26 (report.fit_memory_constants), whose LayerNorm backward (four
    # programs per SM, one 4 KB row of loads each in flight) read at 2.3 TB/s, 76% of the copy
    # bandwidth, at real lengths. Unloaded HBM latency on Hopper is roughly 0.5-0.7 us; queues under
    # load lengthen it (the H200 run's older LayerNorm backward put it at 1.2-2.4 us).
    memory_latency_s: float = 1.9e-6
    # A global load's round trip as one warp sees it, for schedule.simulate (assumed: Hopper's L2 hits
    # take about 260 clocks and HBM reads 500-700 unloaded; the attention's K and V tiles are read by
    # every query block, mostly from L2).
    global_latency_cycles: int = 600
    issue_per_clock: int = 4             # warp-instructions issued per clock per SM (4 schedulers, 1 each)
    registers_per_sm: int = 65536
    shared_per_sm: int = 228 * 1024
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    # Warp-instructions per clock per SM each pipe completes: lanes per clock / 32 (programming guide,
    # cc 9.0: fp32 add/mul/fma 128 lanes, 32-bit integer and logic 64, integer multiply-add 64, MUFU 16,
    # conversions 16, warp shuffle 32). Shared memory moves 128 bytes per clock per SM: a 4-byte-per-lane
    # access is one clock, a 16-byte one four (shared_bytes_per_clock). "tensor" is timed by FLOPs.
    pipe_rate: Dict[str, float] = field(default_factory=lambda: {
        "fma": 4.0, "fmaheavy": 2.0, "alu": 2.0, "mufu": 0.5, "convert": 0.5, "shuffle": 1.0})
    # The pipes each instruction class occupies. Integer multiply-adds run on the FMA pipe's heavy half
    # (64 lanes), beside FP32 on both halves (128), not on the ALU, which runs the other integer and
    # logic instructions (Nsight Compute's Kernel Profiling Guide, "Pipelines": fma, fmaheavy, alu).
    pipes: Dict[str, tuple] = field(default_factory=lambda: {
        "fp32": ("fma",), "imad": ("fma", "fmaheavy"), "int": ("alu",), "mufu": ("mufu",),
        "convert": ("convert",), "shuffle": ("shuffle",)})
    shared_bytes_per_clock: int = 128
    # Imperfect overlap of the bounds: predicted time = the largest bound + overlap x the others
    # (0 is perfect overlap). For kernels with tensor-core work (the attention), whatever binds them,
    # and where the issue slots bind: an assumption, until a GPU run measures such a kernel unchanged
    # since (report.fit_overlap).
    overlap: float = 0.25
    # Where memory binds a kernel without tensor-core work (the row kernels): fitted with
    # memory_latency_s to the same H100 run (report.fit_memory_constants). Its bias+GELU forward and
    # LayerNorm forward moved their bytes at the copy bandwidth (99% and 102%, the latter's bytes then
    # counted 25% high: 82% of its true 134 MB; kernels.CONDITIONAL_ARGS), their instructions
    # hidden under their loads; the former 0.25 had predicted 14-20% more time.
    memory_overlap: float = 0.0


H100 = Gpu()
# The H200: the H100's processor (the same SMs, clock and dense bf16 peak, by its datasheet) with
# HBM3e at 4.8 TB/s; achievable: the copy measured in this project's H200 run (2026-11-26).
H200 = Gpu(name="H200 SXM 141GB", hbm_bytes_per_s=4.8e12, achievable_hbm_bytes_per_s=4.215e12)


def gpu_named(name: str) -> Gpu:
    """The constants for a device name as torch reports it ('NVIDIA H200', 'NVIDIA H100 80GB HBM3')."""
    return H200 if "H200" in name.upper() else H100


def device_gpu(device: Dict[str, object]) -> Gpu:
    """The constants for a GPU run's device (results.json's "device": its name, and the copy bandwidth
    the run measured, which replaces the stated one where it is there)."""
    gpu = gpu_named(str(device.get("name") or ""))
    copy = (device.get("copy_bandwidth_gbps") or {}).get("median")
    return replace(gpu, achievable_hbm_bytes_per_s=copy * 1e9) if copy else gpu
