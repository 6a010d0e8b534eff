"""Interleaved A/B on a CPU: bertfast inference with and without its plain layers (``Layout.plain``),
against transformers' BertModel (sdpa) on the same weights, in one process.

    python benchmarks/cpu-vs-transformers/plain_layers_ab.py --batch 1 --rounds 60
    python benchmarks/cpu-vs-transformers/plain_layers_ab.py --batch 32 --rounds 8 --lengths half

Each round times one forward of each of the three in turn (so a change in the machine's load falls
on all three alike) and the medians are printed. "ops" is the path from before the plain layers:
``BertModel._plain_attention`` answering None makes every layer call the fused ops' entries.
"""
import argparse
import statistics
import time

import torch
import transformers

import bertfast
from bertfast.model import modeling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--lengths", choices=["full", "half"], default="full",
                        help="half: lengths uniform in [S/4, 3S/4] (mean 50%%)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    config = bertfast.BertConfig.preset("minilm")
    fast = bertfast.BertModel(config).eval()
    hf_config = transformers.BertConfig(**config.to_dict())
    hf_config._attn_implementation = "sdpa"
    hf = transformers.BertModel(hf_config).eval()
    hf.load_state_dict(fast.state_dict())

    batch, seqlen = args.batch, args.seqlen
    ids = torch.randint(5, config.vocab_size, (batch, seqlen))
    lengths = torch.full((batch,), seqlen)
    if args.lengths == "half":
        lengths = torch.randint(seqlen // 4, 3 * seqlen // 4 + 1, (batch,), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(seqlen)[None] < lengths[:, None]).long()

    plain_attention = modeling.BertModel._plain_attention
    runs = {"plain": (fast, plain_attention), "ops": (fast, lambda *a: None), "transformers": (hf, None)}
    times = {name: [] for name in runs}
    with torch.inference_mode():
        for r in range(args.rounds + 2):  # two warm-up rounds
            for name, (model, plain) in runs.items():
                if plain is not None:
                    modeling.BertModel._plain_attention = plain
                t0 = time.perf_counter()
                model(input_ids=ids, attention_mask=mask)
                if r >= 2:
                    times[name].append(time.perf_counter() - t0)
    modeling.BertModel._plain_attention = plain_attention
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    hf_ms = ms["transformers"]
    print(f"batch {batch} x {seqlen} ({args.lengths}), {args.rounds} rounds, {args.threads} threads: "
          f"transformers {hf_ms:.2f} ms | bertfast ops {ms['ops']:.2f} ms (x{hf_ms / ms['ops']:.3f}) | "
          f"bertfast plain {ms['plain']:.2f} ms (x{hf_ms / ms['plain']:.3f})")


if __name__ == "__main__":
    main()
