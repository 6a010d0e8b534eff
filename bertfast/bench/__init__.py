"""bertfast.bench: the benchmark harness (`bertfast bench`, `python -m bertfast.bench`).

options (the command's options, torch-free), cli (the run), device (what the machine is; copy
bandwidth and peak matmul measured once per run), timing (CUDA events / perf_counter, median p20
p80), flops (the work each figure divides), gate (parity before timing), kernels_suite (its cases:
kernel_cases) and model_suite, targets, report (JSON, markdown, PNG).
"""
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    from bertfast.bench.cli import main as _main
    return _main(argv)


__all__ = ["main"]
