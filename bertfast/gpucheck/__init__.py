"""The GPU check, built to fit fresh GPU machines lent for 15 minutes at a time (scripts/gpu-loan.sh
runs stages 1-3 in one loan).

``python -m bertfast.gpucheck plan`` (``make gpu-plan``) prints the stages with their estimated
minutes; ``python -m bertfast.gpucheck run [--stage K] --out DIR`` (``make gpu-check``) runs
them and leaves every log and result in DIR; ``python -m bertfast.gpucheck land DIR`` files a
GPU run under benchmarks/results/ and regenerates the README's result table.
``python -m bertfast.gpucheck.compile_report`` (``make compile-report``) shows, without a
GPU, the registers, spills and shared memory of every kernel and autotune candidate on sm_90.
"""
