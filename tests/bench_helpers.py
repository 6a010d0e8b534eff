"""The bench tests' shared stand-ins (tests/test_bench_*.py): a fake GPU, a synthetic run whose targets
are known, a quick CPU suite context and a PNG check, so each file builds its runs the same way."""
from __future__ import annotations

import torch

from bertfast.bench import device as devmod
from bertfast.bench.common import SuiteContext
from bertfast.bench.results import (FULL_HEAD, GEMM_FLOOR, HF_COMPILED, HF_EAGER, SDPA_FLASH, SDPA_MEM_EFFICIENT,
                                    TORCH_EAGER, Row, Run)
from bertfast.bench.targets import evaluate_targets
from bertfast.bench.timing import Memory, Stat, TimingPolicy


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _fake_device(kind: str) -> devmod.DeviceInfo:
    info = devmod.DeviceInfo(kind=kind, name="Fake GPU 80GB" if kind == "cuda" else "Fake CPU",
                             slug=devmod.slugify("Fake GPU 80GB" if kind == "cuda" else "Fake CPU"),
                             torch_version=torch.__version__, python_version="3", platform="test")
    info.copy_bandwidth_gbps = Stat(3000.0, 2900.0, 3100.0, 10)
    info.peak_matmul_tflops = Stat(800.0, 790.0, 810.0, 10)
    return info


def _row(group, impl, ms, direction="fwd+bwd", suite="kernels", metrics=None, memory=None, **case):
    return Row(suite, group, case, direction, impl, time_ms=Stat(ms, ms, ms, 3),
               metrics={k: Stat(v, v, v, 3) for k, v in (metrics or {}).items()}, memory=memory,
               work={"bytes": 1e9})


def _synthetic_run(kind="cuda") -> Run:
    rows = []
    # pretraining steps: base meets everything, large is too slow.
    for model, fast_ms, mfu in (("bert-base", 100.0, 0.55), ("bert-large", 300.0, 0.40)):
        case = dict(model=model, seqlen=128, batch=128, micro_batches=2, global_batch=256)
        rows += [_row("pretrain_step", "bertfast", fast_ms, "step", "model", {"mfu": mfu}, **case),
                 _row("pretrain_step", HF_EAGER, 300.0, "step", "model", **case),
                 _row("pretrain_step", HF_COMPILED, 160.0, "step", "model", **case)]
    for lengths, batch, fill, tps in (("padded", 32, 0.5, 85.0), ("no-padding", 16, 1.0, 100.0)):
        rows.append(_row("finetune_step", "bertfast", 10.0, "step", "model", {"tokens_per_s": tps},
                         model="bert-base", seqlen=128, batch=batch, lengths=lengths, real_tokens=2048, fill=fill))
    for op in ("bias_gelu", "bias_dropout_residual_layernorm", "embeddings"):
        for direction in ("fwd", "bwd"):
            rows.append(_row(op, "bertfast:triton", 1.0, direction, metrics={"pct_copy_bw": 93.0}, tokens=16384))
            rows.append(_row(op, "bertfast:cuda", 1.2, direction, metrics={"pct_copy_bw": 80.0}, tokens=16384))
            rows.append(_row(op, TORCH_EAGER, 3.0, direction, metrics={"pct_copy_bw": 30.0}, tokens=16384))
    att = dict(batch=128, seqlen=128, heads=12, head_dim=64)
    rows += [_row("attention", "bertfast:triton varlen", 1.0, padding="none", **att),
             _row("attention", SDPA_FLASH, 1.1, padding="none", **att),
             _row("attention", "bertfast:triton varlen", 1.0, padding="finetune", **att),
             _row("attention", SDPA_MEM_EFFICIENT, 1.5, padding="finetune", **att)]  # only 1.5x: not met
    head = dict(model="bert-base", tokens=16384)
    rows += [_row("mlm_head_loss", "bertfast:triton", 2.0, memory=Memory(10 * 2**30, 2**30), **head),
             _row("mlm_head_loss", FULL_HEAD, 12.0, memory=Memory(20 * 2**30, 6 * 2**30), **head),
             _row("mlm_head_loss", GEMM_FLOOR, 1.7, **head)]
    run = Run(device=_fake_device(kind), config={"quick": False}, rows=rows)
    run.targets = evaluate_targets(run)
    return run


def _check_png(path):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.image as mpimg
    image = mpimg.imread(path)
    assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 50


def _cpu_ctx(**kw) -> SuiteContext:
    info = devmod.detect("cpu")
    devmod.calibrate(info, quick=True)
    base = dict(device=info, quick=True, dtype=torch.float32, backends=("torch",), compile=False,
                with_transformers=False, policy=TimingPolicy(cpu_warmup=0, cpu_reps=2),
                step_policy=TimingPolicy(cpu_warmup=0, cpu_reps=1), log=lambda s: None)
    base.update(kw)
    return SuiteContext(**base)
