"""`python -m bertfast.perfmodel.mma_rate`: mma.sync's throughput on this GPU, beside the rate the
performance model assumes for it (hardware.Gpu.mma_sync_flops) and the dense peak (wgmma's).

The CUDA attention's kernels issue mma.sync (HMMA); where the tensor cores bind them, their predicted
time is their FLOPs at that assumed rate (docs/perf-model.md, "The CUDA attention"). This times
csrc/ptx_check.cu's ptx_mma_rate_kernel: every warp of 8 blocks an SM runs independent m16n8k16
products on all-ones operands, and the sums it writes are checked before any time counts. Needs a
GPU and the built extension (bertfast._C); a measurement, never a prediction.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional

FLOPS_PER_MMA = 2 * 16 * 8 * 16  # one warp's m16n8k16
MMAS_PER_ITER = 8                # independent products a warp issues per round
WARPS = 4                        # per block


def measure(dtype_name: str = "bf16", iters: int = 4096, blocks_per_sm: int = 8, reps: int = 10) -> Dict[str, object]:
    """The kernel's median time over ``reps`` launches, its TFLOP/s, and that rate against the model's."""
    import torch

    from bertfast.cuda import _common as C
    from bertfast.perfmodel.hardware import gpu_named

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    blocks = props.multi_processor_count * blocks_per_sm
    out = torch.empty(blocks * WARPS, device=dev)
    stream = torch.cuda.current_stream(dev).cuda_stream

    def launch():
        C._C.ptx_mma_rate(out.data_ptr(), blocks, iters, C.DTYPE_CODE[dtype], stream)

    launch()
    torch.cuda.synchronize(dev)
    expected = 16384.0 * iters
    if not bool((out == expected).all()):
        raise RuntimeError(f"mma_rate: the kernel's sums are wrong (expected {expected:g} per warp, got "
                           f"{out.min().item():g} .. {out.max().item():g}): its time would not be of the work")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: List[float] = []
    for _ in range(reps):
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    seconds = sorted(times)[len(times) // 2]
    flops = blocks * WARPS * iters * MMAS_PER_ITER * FLOPS_PER_MMA
    gpu = gpu_named(props.name)
    rate = flops / seconds
    return {"device": props.name, "dtype": dtype_name, "blocks": blocks, "iters": iters, "seconds": seconds,
            "tflops": rate / 1e12, "of_dense_peak": rate / gpu.dense_bf16_flops,
            "assumed_tflops": gpu.mma_sync_flops / 1e12, "of_assumed": rate / gpu.mma_sync_flops}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bertfast.perfmodel.mma_rate", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--iters", type=int, default=4096, help="rounds of 8 products a warp (default 4096)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures to FILE")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("mma_rate: needs a GPU (torch sees no CUDA device): it times mma.sync on the hardware",
              file=sys.stderr)
        return 2
    from bertfast.cuda import _common as C
    available, why = C.extension_status()
    if not available:
        print(f"mma_rate: the CUDA extension is not available: {why}", file=sys.stderr)
        return 2
    r = measure(args.dtype, args.iters)
    print(f"mma.sync m16n8k16 {r['dtype']} on {r['device']}: {r['tflops']:.0f} TFLOP/s "
          f"({100 * r['of_dense_peak']:.0f}% of the dense peak; the perf model assumes {r['assumed_tflops']:.0f}, "
          f"measured/assumed {r['of_assumed']:.2f}); {r['blocks']} blocks x {WARPS} warps x {r['iters']} rounds "
          f"in {r['seconds'] * 1e3:.2f} ms (median of 10)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
