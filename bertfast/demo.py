"""The parity table printed by `bertfast parity`: the fast model against the reference
encoder and, when installed, transformers, on one random padded batch of a small BERT."""
from __future__ import annotations

import tempfile
from typing import Dict, List, Tuple

import torch

from bertfast import dispatch, registry
from bertfast.config import BertConfig
from bertfast.modeling import reference_execution
from bertfast.task_models import BertForPreTraining
from bertfast.testing import make_lengths, mask_from_lengths

FP32_TOL = 1e-4


def random_batch(config: BertConfig, batch: int, seqlen: int, device: torch.device,
                 generator: torch.Generator) -> Dict[str, torch.Tensor]:
    """Padded MLM+NSP batch with random lengths (one sequence of a single token)."""
    lengths = make_lengths("random", batch, seqlen, generator)
    lengths[-1] = 1
    mask = mask_from_lengths(lengths, seqlen)
    ids = torch.randint(1, config.vocab_size, (batch, seqlen), generator=generator) * mask
    token_types = (torch.arange(seqlen)[None, :] >= (lengths[:, None] // 2)).long() * mask
    labels = torch.where((torch.rand(batch, seqlen, generator=generator) < 0.15) & mask.bool(), ids, -100)
    nsp = torch.randint(0, 2, (batch,), generator=generator)
    return {k: v.to(device) for k, v in dict(input_ids=ids, attention_mask=mask, token_type_ids=token_types,
                                             labels=labels, next_sentence_label=nsp).items()}


def _measure(model, batch) -> Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor]]:
    out = model(**batch, output_hidden_states=True)
    grads = torch.autograd.grad(out.loss, [p for p in model.parameters()], allow_unused=True)
    return out.hidden_states[-1].detach(), out.loss.detach(), [g for g in grads if g is not None]


def parity_table(preset: str, device: torch.device) -> Tuple[str, bool]:
    config = BertConfig.preset(preset, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = BertForPreTraining(config).to(device).eval()
    batch = random_batch(config, 4, min(64, config.max_position_embeddings), device, gen)
    valid = batch["attention_mask"].bool()
    fast = _measure(model, batch)
    with reference_execution(model):
        ref = _measure(model, batch)
    rows = [("reference encoder", ref)]
    try:
        import transformers

        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            hf = transformers.BertForPreTraining.from_pretrained(tmp, attn_implementation="eager").to(device).eval()
        rows.append((f"transformers {transformers.__version__}", _measure(hf, batch)))
    except ImportError:
        rows.append(("transformers", None))
    dtype = next(model.parameters()).dtype
    selected = {op: dispatch.select(op, **registry.form(op)[1].sample_inputs(device, dtype))
                for op in registry.step_forms()}
    lines = [f"bertfast parity: preset {preset!r} ({model.num_parameters() / 1e6:.1f}M params) on {device}, fp32, "
             f"batch 4 with random padding",
             "backends: " + ", ".join(f"{op}={name}" for op, name in selected.items()),
             "", f"{'fast model vs':28s} {'hidden max|diff|':>17s} {'loss |diff|':>12s} {'grad max|diff|':>15s}  ok"]
    all_ok = True
    for name, other in rows:
        if other is None:
            lines.append(f"{name:28s} {'(not installed)':>17s}")
            continue
        hidden = (fast[0][valid] - other[0][valid]).abs().max().item()
        loss = (fast[1] - other[1]).abs().item()
        grad = max((a - b).abs().max().item() for a, b in zip(fast[2], other[2]))
        ok = hidden <= FP32_TOL and loss <= FP32_TOL and grad <= FP32_TOL * 10
        all_ok &= ok
        lines.append(f"{name:28s} {hidden:17.2e} {loss:12.2e} {grad:15.2e}  {'yes' if ok else 'NO'}")
    return "\n".join(lines), all_ok
