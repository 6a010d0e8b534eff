"""Interleaved A/B of the Triton launch path's host time on a CPU: the ops' eager training calls on the
Triton backend as a GPU runs them (Triton's JITFunction, not the interpreter), every kernel compiled
for sm_90 and "launched" by compile_report.LaunchRecordingDriver, which records the launch instead of
making it. So each figure is the op's whole host path but the CUDA driver's launch call.

  python benchmarks/host-overhead/launch_ab.py [rounds]      (TRITON_INTERPRET unset)

A: launches as before 2026-12-06 (each autotuned launch through Triton's Autotuner.run; grids and
   buckets through triton.cdiv and triton.next_power_of_2). B: as now (kernels/_common.launch
   remembers each launch key's kwargs; host cdiv and next_power_of_2 on plain ints).
Autotuned, each candidate "timed" by one launch. Rounds alternate the order; medians, [p20, p80].

1. Each overhead-suite op (bertfast/bench/overhead_suite.py, tiny bf16 inputs): forward +
   autograd.grad, host us a call.
2. A pre-training step of a 24-layer, hidden-64 BertForPreTraining: BERT-large's launches a step.
"""
import os
import statistics
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)
os.environ["BERTFAST_AUTOTUNE"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

from bertfast import dispatch  # noqa: E402
from bertfast.bench import overhead_suite  # noqa: E402
from bertfast.gpucheck.compile_report import TARGET_ARCH, LaunchRecordingDriver  # noqa: E402
from bertfast.kernels import _common  # noqa: E402
from bertfast.kernels import (_rows, attention, bias_dropout_residual_layernorm, bias_gelu, embeddings,  # noqa: E402
                              mlm_head_loss)

MODULES = (_rows, attention, bias_dropout_residual_layernorm, bias_gelu, embeddings, mlm_head_loss)


def former_launch(kernel, grid, args, consts, *, interp=None, scratch=()):
    """kernels/_common.launch as it was: every autotuned launch through the autotuner."""
    fn = _common.jit_function(kernel)
    if not _common._is_tuned(kernel):
        fn[grid](*args, **consts, **_common.COMPILE_OPTIONS)
    elif scratch:
        config = _common._choose_on_scratch(kernel, grid, args, consts, scratch)
        fn[grid](*args, **consts, **config.all_kwargs(), **_common.COMPILE_OPTIONS)
    else:
        kernel[grid](*args, **consts, **_common.COMPILE_OPTIONS)


def way(former: bool, step):
    launch = former_launch if former else _common.launch
    cdiv = triton.cdiv if former else _common.cdiv
    pow2 = triton.next_power_of_2 if former else _common.next_power_of_2

    def run():
        for module in MODULES:
            module.__dict__.update(launch=launch, cdiv=cdiv, next_power_of_2=pow2)
        step()
    return run


def one_shot(fn, quantiles=None, **kwargs):
    fn()
    return [1.0, 1.0, 1.0]


def _ab(runs, rounds: int, calls: int):
    """name -> (median, p20, p80) of each run's host microseconds a call, rounds in alternating order."""
    times = {k: [] for k in runs}
    for r in range(rounds):
        for k in (list(runs) if r % 2 else list(reversed(list(runs)))):
            start = time.perf_counter()
            for _ in range(calls):
                runs[k]()
            times[k].append((time.perf_counter() - start) / calls * 1e6)
    return {k: (statistics.median(v), *statistics.quantiles(v, n=5)[::3]) for k, v in times.items()}


def step_table(rec, rounds: int) -> None:
    """A pre-training step (forward + backward) of a deep, narrow BertForPreTraining (24 layers of
    hidden 64, batch 4 x 32 with padding): BERT-large's launches, with little CPU arithmetic."""
    import bertfast
    from fused_op_ab import DEEP_NARROW, deep_narrow_batch, training_step  # beside this script
    torch.manual_seed(0)
    model = bertfast.BertForPreTraining(bertfast.BertConfig(**DEEP_NARROW)).train()
    step = training_step(model, deep_narrow_batch())
    runs = {"A": way(True, step), "B": way(False, step)}
    for fn in runs.values():
        for _ in range(2):
            fn()
    before = len(rec.calls)
    runs["B"]()
    launches = len(rec.calls) - before
    (a, a20, a80), (b, b20, b80) = (v for v in _ab(runs, rounds, 1).values())
    print(f"\n| step (forward + backward, Triton backend) | launches | A: before (ms) | B: now (ms) | saved |\n"
          f"| --- | --- | --- | --- | --- |\n| 24 x hidden 64, batch 4 x 32 | {launches} | {a / 1e3:.1f} "
          f"[{a20 / 1e3:.1f}, {a80 / 1e3:.1f}] | {b / 1e3:.1f} [{b20 / 1e3:.1f}, {b80 / 1e3:.1f}] "
          f"| {(a - b) / 1e3:.1f} ({(a - b) / a:.0%}) |")


def main(rounds: int) -> None:
    rec = LaunchRecordingDriver(TARGET_ARCH)
    driver.set_active(rec)
    for tuner in _common._TUNERS:
        tuner._do_bench = one_shot
        tuner.__dict__.pop("do_bench", None)
    allowed = dispatch.device_reasons
    dispatch.device_reasons = lambda backend, forced, tensors: [] if backend == "triton" else allowed(
        backend, forced, tensors)
    print(f"triton {triton.__version__}, torch {torch.__version__}, {rounds} rounds\n")
    print("| op (fwd+bwd, Triton backend) | launches | A: before (us) | B: now (us) | saved |")
    print("| --- | --- | --- | --- | --- |")
    with dispatch.use_backend("triton"):
        for name, build in overhead_suite.case_builders().items():
            case = build(torch.Generator().manual_seed(0), torch.bfloat16, torch.device("cpu"))
            step = overhead_suite._grad_step(case.bertfast, case.leaves)
            runs = {"A": way(True, step), "B": way(False, step)}
            try:
                for fn in runs.values():
                    for _ in range(3):
                        fn()
            except Exception as exc:  # noqa: BLE001 - a case this harness cannot run is said, not hidden
                print(f"| {name} | not run: {type(exc).__name__}: {str(exc)[:120]} | | | |", flush=True)
                continue
            before = len(rec.calls)
            runs["B"]()
            launches = len(rec.calls) - before
            (a, a20, a80), (b, b20, b80) = (v for v in _ab(runs, rounds, 50).values())
            print(f"| {name} | {launches} | {a:.0f} [{a20:.0f}, {a80:.0f}] | {b:.0f} [{b20:.0f}, {b80:.0f}] "
                  f"| {a - b:.0f} ({(a - b) / a:.0%}) |", flush=True)
        step_table(rec, rounds)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 21)
