"""Interleaved A/B of the ops' eager training call: through the torch.library custom ops
(EAGER_FUNCTIONS off) against FusedOp's autograd.Function (on), on a CPU.

  python benchmarks/host-overhead/fused_op_ab.py [rounds]

1. Each overhead-suite op (bertfast/bench/overhead_suite.py, tiny inputs, the torch backend):
   forward + autograd.grad, host µs a call.
2. A pre-training step (forward + backward) of a deep, narrow BertForPreTraining (24 layers of
   hidden 64, batch 4 x 32 with padding), where host time is most of it; transformers' (sdpa) on
   the same weights beside it.
Rounds alternate the order of the two ways; medians and [p20, p80] over rounds.
"""
import statistics
import sys
import time

import torch
import transformers

import bertfast
from bertfast.bench import overhead_suite
from bertfast.ops import _common


def _timed(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _ab(runs, rounds: int, calls: int, scale: float):
    """name -> (median, p20, p80) of each run's time a call, in units of 1 / scale seconds."""
    for fn in runs.values():
        for _ in range(3):
            fn()
    times = {name: [] for name in runs}
    for r in range(rounds):
        for name in (list(runs) if r % 2 else list(reversed(list(runs)))):
            times[name].append(_timed(runs[name], calls) * scale)
    return {name: (statistics.median(v), *statistics.quantiles(v, n=5)[::3]) for name, v in times.items()}


def _way(eager: bool, fn):
    def run():
        _common.EAGER_FUNCTIONS = eager
        fn()
    return run


def ops_table(rounds: int):
    print("| op | custom op (us) | eager function (us) | saved |\n| --- | --- | --- | --- |")
    for name, build in overhead_suite.case_builders().items():
        case = build(torch.Generator().manual_seed(0), torch.float32, torch.device("cpu"))
        step = overhead_suite._grad_step(case.bertfast, case.leaves)
        got = _ab({"custom": _way(False, step), "eager": _way(True, step)}, rounds, 40, 1e6)
        (a, a20, a80), (b, b20, b80) = got["custom"], got["eager"]
        print(f"| {name} | {a:.0f} [{a20:.0f}, {a80:.0f}] | {b:.0f} [{b20:.0f}, {b80:.0f}] "
              f"| {a - b:.0f} ({(a - b) / a:.0%}) |", flush=True)


# A deep, narrow BertForPreTraining: BERT-large's 24 layers (and so its op calls and launches a step)
# at hidden 64, where host time is most of a CPU step. launch_ab.py times it too.
DEEP_NARROW = dict(vocab_size=512, hidden_size=64, num_hidden_layers=24, num_attention_heads=4, intermediate_size=256,
                   max_position_embeddings=64)


def deep_narrow_batch():
    """Inputs for DEEP_NARROW from torch's generator as it stands: batch 4 x 32 with padding, 5
    labelled positions a sequence."""
    ids = torch.randint(5, 512, (4, 32))
    mask = torch.ones(4, 32, dtype=torch.long)
    mask[1, 20:] = mask[3, 9:] = 0
    labels = torch.full((4, 32), -100)
    labels[:, 3:8] = ids[:, 3:8]
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids), labels=labels,
                next_sentence_label=torch.tensor([0, 1, 0, 1]))


def training_step(model, batch):
    def run():
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
    return run


def step_table(rounds: int):
    torch.manual_seed(0)
    fast = bertfast.BertForPreTraining(bertfast.BertConfig(**DEEP_NARROW)).train()
    hf = transformers.BertForPreTraining(transformers.BertConfig(**DEEP_NARROW, attn_implementation="sdpa")).train()
    hf.load_state_dict(fast.state_dict(), strict=False)
    batch = deep_narrow_batch()

    def step(model):
        return training_step(model, batch)

    got = _ab({"transformers (sdpa)": step(hf), "bertfast, custom ops": _way(False, step(fast)),
               "bertfast, eager functions": _way(True, step(fast))}, rounds, 3, 1e3)
    print("\n| step (forward + backward) | ms |\n| --- | --- |")
    for name, (m, p20, p80) in got.items():
        print(f"| {name} | {m:.1f} [{p20:.1f}, {p80:.1f}] |")


if __name__ == "__main__":
    torch.set_num_threads(2)
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 21
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, Python {sys.version.split()[0]}, "
          f"{torch.get_num_threads()} threads, {rounds} rounds")
    ops_table(rounds)
    step_table(rounds)
    _common.EAGER_FUNCTIONS = True
