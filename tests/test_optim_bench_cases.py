"""The bench's optimizer cases (`bertfast bench --ops adamw,lamb`) on CPU: each implementation passes
the parity gate before it is timed, and a wrong one is refused."""
import pytest
import torch

from bertfast.training import optim
from optim_helpers import GPU, _require, _require_triton_adamw


# The triton runs are the ones a GPU check should repeat on CUDA.
pytestmark = pytest.mark.gpu_capable


def _bench_rows(ops, backends=("torch",)):
    from bertfast.bench import device, kernels_suite
    from bertfast.bench.common import SuiteContext
    from bertfast.bench.timing import TimingPolicy

    ctx = SuiteContext(device=device.detect("cpu"), quick=True, dtype=torch.float32, backends=backends,
                       compile=False, policy=TimingPolicy(cpu_warmup=0, cpu_reps=1), ops=ops, log=lambda text: None)
    return {(r.group, r.impl): r for r in kernels_suite.run(ctx)}


@pytest.mark.skipif(GPU, reason="the CPU case list (one tiny model); a GPU runs BERT's parameters")
def test_benchmark_cases_gate_then_time_both_optimizers(monkeypatch):
    """`bertfast bench --ops adamw,lamb` on CPU: each implementation passes the parity gate against
    the for-loop / reference step and is timed; a LAMB whose updates are 1% too large is refused."""
    rows = _bench_rows(("adamw", "lamb"))
    assert set(rows) == {("adamw", "torch fused"), ("adamw", "torch foreach"), ("adamw", "torch eager"),
                         ("lamb", "bertfast:torch foreach"), ("lamb", "torch eager")}
    for key, row in rows.items():
        assert row.direction == "step" and row.case["model"] == "micro", key
        assert row.ok and row.time_ms.median > 0 and row.metrics["gbps"].median > 0, (key, row.reason)

    right = optim._foreach_lamb

    def wrong(params, grads, exp_avgs, exp_avg_sqs, steps, group):
        right(params, grads, exp_avgs, exp_avg_sqs, steps, {**group, "lr": group["lr"] * 1.01})
    monkeypatch.setattr(optim, "_foreach_lamb", wrong)
    row = _bench_rows(("lamb",))[("lamb", "bertfast:torch foreach")]
    assert row.status == "FAILED PARITY" and row.time_ms is None and "step/lr: max error" in row.reason


@pytest.mark.skipif(GPU, reason="the CPU case list (one tiny model); a GPU runs BERT's parameters")
def test_benchmark_cases_gate_then_time_the_triton_optimizers():
    """Under the interpreter: the host-step and the capturable triton LAMB, and the triton AdamW,
    pass the gate and are timed."""
    _require("triton")
    _require_triton_adamw()
    rows = _bench_rows(("lamb", "adamw"), backends=("triton",))
    assert set(rows) == {("lamb", "bertfast:triton"), ("lamb", "bertfast:triton capturable"), ("lamb", "torch eager"),
                         ("adamw", "bertfast:triton"), ("adamw", "torch fused"), ("adamw", "torch foreach"),
                         ("adamw", "torch eager")}
    for key, row in rows.items():
        assert row.ok and row.time_ms.median > 0, (key, row.reason)
