"""A training step with no host read, and the same step replayed from a CUDA graph (GPU only),
each with fused AdamW and with the capturable (triton) LAMB:

  * a packed pre-training step (forward, backward, clipping, the optimizer) under
    torch.cuda.set_sync_debug_mode("error") with checks on the device: no host sync at all;
  * GraphedTrainStep gives the eager step's losses, learning rates and parameters, through
    warm-up, capture, replays and a change of batch shape (a new phase);
  * with dropout on, every replay draws new dropout masks;
  * --on-nonfinite skip: no host sync either, and a replay whose loss is NaN changes nothing
    (the optimizer's found_inf), as the eager step skips it;
  * `bertfast pretrain --cuda-graphs` runs end to end and matches --static-shapes without graphs;
  * a --cuda-graphs run stopped and resumed gives the uninterrupted run's losses and weights,
    bit for bit (dropout on: the resumed run's eager warm-up steps replace replays).
"""
import copy

import pytest
import torch

import bertfast
from bertfast import BertConfig
from bertfast.padding import pack_batch
from bertfast.training.graphs import GraphedTrainStep
from bertfast.training.optim import build_optimizer, warmup_linear_decay
from bertfast.training.step import TrainStep

pytestmark = pytest.mark.gpu

S = 32
OPTIMIZERS = pytest.mark.parametrize("optimizer", ["adamw", "lamb"])


def _model(dropout: float = 0.0):
    cfg = BertConfig.preset("tiny", hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return bertfast.BertForPreTraining(cfg).cuda()


def _batch(seed: int, batch: int = 4, seqlen: int = S):
    """A packed pre-training micro-batch on the GPU: ``batch`` sequences of random lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seqlen // 2, seqlen + 1, (batch,), generator=g)
    mask = (torch.arange(seqlen)[None] < lengths[:, None]).long()
    ids = torch.randint(5, BertConfig.preset("tiny").vocab_size, (batch, seqlen), generator=g) * mask
    labels = torch.where((torch.rand(batch, seqlen, generator=g) < 0.15) & mask.bool(), ids, -100)
    padded = dict(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids), labels=labels,
                  next_sentence_label=torch.randint(0, 2, (batch,), generator=g))
    packed = pack_batch(padded, batch * seqlen, seqlen)
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in packed.items()}


def _step(model, kind, precision="fp32", steps=10, lr=1e-3, skip=False, optimizer="adamw"):
    opt = build_optimizer(model, optimizer, lr, capturable=optimizer == "lamb")
    schedule = warmup_linear_decay(opt, 2, steps)
    if kind == "graph":
        return GraphedTrainStep(model, opt, schedule, torch.device("cuda"), precision, max_grad_norm=1.0,
                                skip_nonfinite=skip)
    return TrainStep(model, opt, schedule, torch.device("cuda"), precision, max_grad_norm=1.0, device_checks=True,
                     skip_nonfinite=skip)


def _forward(step, model, predictions):
    """The step's forward (values checked on the device: both steps ask for it) with the row's MLM gather."""
    return lambda mb: step.forward(model, mb, max_predictions_per_seq=predictions)


@OPTIMIZERS
@pytest.mark.parametrize("skip", [False, True], ids=["stop", "skip"])
def test_packed_step_never_syncs_with_the_host(skip, optimizer):
    model = _model(dropout=0.1)
    step = _step(model, "eager", precision="bf16", skip=skip, optimizer=optimizer)
    assert step.skips_on_device
    forward = _forward(step, model, 4 * S)
    step([_batch(0)], forward)  # first call: autotuning, lazy state, probes (host reads allowed)
    batches = [_batch(seed) for seed in (1, 2)]  # on the GPU before the check: their upload waits by design
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for mb in batches:
            done = step([mb], forward)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(done.loss) and bool(done.finite)


@OPTIMIZERS
def test_graphed_step_matches_eager_through_capture_replays_and_a_new_shape(optimizer):
    torch.manual_seed(0)
    eager_model = _model()
    graph_model = copy.deepcopy(eager_model)
    eager, graphed = _step(eager_model, "eager", optimizer=optimizer), _step(graph_model, "graph", optimizer=optimizer)
    short = [_batch(seed) for seed in range(6)]                       # warm-up 3, capture, 2 replays
    long = [_batch(10 + seed, batch=2, seqlen=2 * S) for seed in range(5)]  # new shapes: warm-up 3 again
    for mb in short + long:
        predictions = mb["input_ids"].shape[1]
        a = eager([mb], _forward(eager, eager_model, predictions))
        b = graphed([mb], _forward(graphed, graph_model, predictions))
        assert a.lr == pytest.approx(b.lr)
        torch.testing.assert_close(b.loss, a.loss, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(b.grad_norm, a.grad_norm, atol=1e-6, rtol=1e-5)
    assert graphed.replays == 3 + 2
    for (name, p), q in zip(eager_model.named_parameters(), graph_model.parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5, msg=name)


def test_each_replay_draws_new_dropout_masks():
    model = _model(dropout=0.1)
    step = _step(model, "graph", precision="bf16", lr=0.0)  # the weights stay put: only dropout moves the loss
    mb = _batch(0)
    losses = [float(step([mb], _forward(step, model, 4 * S)).loss) for _ in range(6)]
    assert step.replays == 3
    assert len(set(losses[-3:])) == 3                                   # each replay: new masks


def _cuda_kernels(fn):
    """Names of the CUDA kernels ``fn`` runs (a graph replay's too)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def test_graphed_adamw_step_neither_zeroes_nor_adds_into_its_gradients():
    """The captured AdamW step keeps the backward's own gradients, as the eager step does: a
    BERT-large replay on an H100 spent 2.1 ms zeroing fixed gradient buffers and adding into them,
    and 1.0 ms multiplying them by the clipping factor."""
    torch.manual_seed(0)
    model, eager_model = _model(), _model()
    graphed, eager = _step(model, "graph"), _step(eager_model, "eager")
    mb = _batch(0)
    for _ in range(4):  # warm-up 3, then the capture and its first replay
        graphed([mb], _forward(graphed, model, 4 * S))
        eager([mb], _forward(eager, eager_model, 4 * S))
    addresses = [p.grad.data_ptr() for p in model.parameters() if p.grad is not None]
    replay = _cuda_kernels(lambda: graphed([mb], _forward(graphed, model, 4 * S)))
    eager_step = _cuda_kernels(lambda: eager([mb], _forward(eager, eager_model, 4 * S)))
    assert graphed.replays == 2 and len(replay) > 50, replay  # the profiler sees into the replay
    assert [p.grad.data_ptr() for p in model.parameters() if p.grad is not None] == addresses
    assert not [k for k in replay if "ZeroFunctor" in k], replay  # torch._foreach_zero_ of the gradients
    # nor multiplies them by the clipping factor: fused AdamW applies it (TrainStep.clip)
    assert not [k for k in replay if "BinaryOpScalarTensorFunctor" in k and "multiplies" in k], replay
    replay_adds, eager_adds = ([k for k in kernels if "CUDAFunctor_add" in k] for kernels in (replay, eager_step))
    assert len(replay_adds) <= len(eager_adds), (replay_adds, eager_adds)


class _Scaled:
    """A model output whose loss is multiplied by the batch's "scale" (NaN makes the step non-finite)."""

    def __init__(self, out, scale):
        self.loss = out.loss * scale


@OPTIMIZERS
def test_graphed_step_skips_a_nonfinite_replay_as_the_eager_step_does(optimizer):
    torch.manual_seed(1)
    eager_model = _model()
    graph_model = copy.deepcopy(eager_model)
    eager = _step(eager_model, "eager", skip=True, optimizer=optimizer)
    graphed = _step(graph_model, "graph", skip=True, optimizer=optimizer)

    def forward(step, model):
        return lambda mb: _Scaled(step.forward(model, {k: v for k, v in mb.items() if k != "scale"},
                                               max_predictions_per_seq=4 * S), mb["scale"])

    scales = [1.0] * 5 + [float("nan"), 1.0]                          # warm-up 3, capture, replay, NaN, replay
    for seed, scale in enumerate(scales):
        mb = dict(_batch(seed), scale=torch.tensor(scale, device="cuda"))
        before = [p.detach().clone() for p in graph_model.parameters()]
        a = eager([mb], forward(eager, eager_model))
        b = graphed([mb], forward(graphed, graph_model))
        assert bool(a.skipped) == bool(b.skipped) == (scale != scale)
        if scale != scale:
            assert all(torch.equal(p, q) for p, q in zip(graph_model.parameters(), before))
    assert graphed.replays == 4
    for (name, p), q in zip(eager_model.named_parameters(), graph_model.parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5, msg=name)
        torch.testing.assert_close(graphed.optimizer.state[q]["step"], eager.optimizer.state[p]["step"])
    assert float(next(iter(graphed.optimizer.state.values()))["step"]) == len(scales) - 1


@OPTIMIZERS
def test_pretrain_cuda_graphs_matches_static_shapes(datasets, tmp_path, optimizer):
    from bertfast import pretrain

    def run(out, *extra):
        argv = ["--preset", "tiny", "--data", datasets[0], "--phase1-steps", "8", "--global-batch-size", "8",
                "--micro-batch-size", "4", "--lr", "1e-3", "--warmup-steps", "2", "--log-every", "1",
                "--eval-every", "0", "--save-every", "100", "--no-progress", "--output-dir", str(tmp_path / out),
                "--seed", "3", "--precision", "fp32", "--set", "hidden_dropout_prob=0.0",
                "--set", "attention_probs_dropout_prob=0.0", "--device", "cuda", "--optimizer", optimizer, *extra]
        return pretrain.run(pretrain.parse_args(argv))

    graphed, plain = run("graphs", "--cuda-graphs"), run("static", "--static-shapes")
    assert sorted(graphed.losses) == list(range(1, 9))
    for step, loss in plain.losses.items():
        assert graphed.losses[step] == pytest.approx(loss, rel=1e-5), step


@OPTIMIZERS
def test_pretrain_cuda_graphs_resumes_bit_exactly(datasets, tmp_path, optimizer):
    from safetensors.torch import load_file

    from bertfast import pretrain

    def argv(out, *extra):
        return ["--preset", "tiny", "--data", datasets[0], "--phase1-steps", "10", "--global-batch-size", "8",
                "--micro-batch-size", "4", "--lr", "1e-3", "--warmup-steps", "2", "--log-every", "1",
                "--eval-every", "0", "--save-every", "100", "--no-progress", "--output-dir", str(tmp_path / out),
                "--seed", "3", "--precision", "bf16", "--device", "cuda", "--cuda-graphs", "--optimizer", optimizer,
                *extra]

    full = pretrain.run(pretrain.parse_args(argv("full")))
    first = pretrain.run(pretrain.parse_args(argv("split", "--stop-at-step", "5")))   # eager 1-3, replays 4-5
    second = pretrain.run(pretrain.parse_args(["--output-dir", str(tmp_path / "split"), "--resume",
                                               "--no-progress"]))                      # eager 6-8, replays 9-10
    resumed = {**first.losses, **second.losses}
    assert sorted(resumed) == list(range(1, 11))
    assert {s: resumed[s] for s in resumed if resumed[s] != full.losses[s]} == {}      # exactly equal floats
    a = load_file(f"{full.checkpoint}/model.safetensors")
    b = load_file(f"{second.checkpoint}/model.safetensors")
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
