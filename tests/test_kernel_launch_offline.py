"""The GPU launch path (kernels/_common.launch) through Triton's own JITFunction, not the interpreter:
a process without TRITON_INTERPRET compiles for sm_90 and launches through a driver that records
each launch instead of running it (compile_report.LaunchRecordingDriver). A launch after the first
with the same key skips the autotuner and passes the JIT function the config it chose: the same
compiled kernel, grid and arguments as the first launch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, os
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    from triton.runtime.driver import driver
    from bertfast.gpucheck.compile_report import TARGET_ARCH, LaunchRecordingDriver
    rec = LaunchRecordingDriver(TARGET_ARCH)
    driver.set_active(rec)
    from bertfast.kernels import _common, bias_dropout_residual_layernorm as K

    def one_shot(fn, quantiles=None, **kwargs):  # each candidate "timed" by one launch
        fn()
        return [1.0, 1.0, 1.0]
    K._fwd_tuned._do_bench = one_shot
    K._fwd_tuned.__dict__.pop("do_bench", None)
    tuner_runs = []
    tuner_run = K._fwd_tuned.run
    K._fwd_tuned.run = lambda *a, **k: tuner_runs.append(1) or tuner_run(*a, **k)

    n, h = 64, 1024
    x, res = torch.randn(n, h, dtype=torch.bfloat16), torch.randn(n, h, dtype=torch.bfloat16)
    b, w, lb, seed = torch.randn(h), torch.randn(h), torch.randn(h), torch.tensor([7])

    def forward():
        K.bias_dropout_residual_layernorm_fwd(x, b, res, w, lb, 1e-12, 0.1, seed)
        return rec.calls[-1]

    def described(call):
        name, args = call
        return {"name": name, "grid": list(args[:3]), "function": id(args[4]),
                "args": [[str(a.dtype), list(a.shape)] if isinstance(a, torch.Tensor) else repr(a) for a in args[9:]]}

    out = {}
    for mode in ("1", "0"):
        os.environ["BERTFAST_AUTOTUNE"] = mode
        before_runs, before_calls = len(tuner_runs), len(rec.calls)
        first = forward()
        first_calls = len(rec.calls) - before_calls
        second = forward()
        out[mode] = {"first": described(first), "second": described(second), "first_calls": first_calls,
                     "second_calls": len(rec.calls) - before_calls - first_calls,
                     "tuner_runs": len(tuner_runs) - before_runs}
    # what the tuned launches after the first pass: the autotuner's choice, the constexprs, the options
    key = next(k for k in _common._LAUNCH_KWARGS if k[0] == id(K._fwd_tuned) and k[1])
    chosen = _common._LAUNCH_KWARGS[key]
    out["chosen_matches_best"] = all(chosen[k] == v for k, v in K._fwd_tuned.best_config.all_kwargs().items())
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def recorded():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    if res.returncode != 0 or not lines:
        if "ptxas" in res.stderr and "not found" in res.stderr:
            pytest.skip("this Triton cannot compile for sm_90 here (no ptxas)")
        pytest.fail(f"exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("mode", ["1", "0"], ids=["tuned", "fixed"])
def test_a_repeated_launch_runs_the_same_compiled_kernel_without_the_autotuner(recorded, mode):
    got = recorded[mode]
    assert got["second"] == got["first"]  # same compiled function, grid and argument kinds
    assert got["second_calls"] == 1
    if mode == "1":
        assert got["tuner_runs"] == 1  # the first launch only: it tuned (each candidate once) and launched
        assert got["first_calls"] >= 1
    else:
        assert got["tuner_runs"] == 0 and got["first_calls"] == 1
    assert got["first"]["name"] == "_bias_dropout_residual_layernorm_fwd_kernel"


def test_the_remembered_config_is_the_autotuners_choice(recorded):
    assert recorded["chosen_matches_best"]
