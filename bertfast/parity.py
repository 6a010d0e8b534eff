"""Parity of the fast model against the reference on a real batch (docs/testing.md).

``check_batch`` runs one batch through the fast path and through the reference encoder,
on the same weights, in fp32 with dropout off, and reports the divergence of loss, logits
and gradient norm. When they diverge, ``first_divergent_op`` names the first op (in forward
order) that alone, on its selected backend with every other op on the torch backend, moves
the output away from the all-torch run. The model's mode and gradients are left untouched.
``check_during_training`` is the check ``--parity-every`` runs in pretrain and finetune.
`bertfast parity` (``parity_table``) prints the fast model against the reference encoder and, when
installed, transformers, on one random padded batch of a small BERT.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import math
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from bertfast import dispatch, registry
from bertfast.model.config import BertConfig
from bertfast.dispatch import use_backend
from bertfast.model.modeling import reference_execution
from bertfast.model.task_models import BertForPreTraining
from bertfast.testing import make_lengths, mask_from_lengths


@dataclass
class ParityReport:
    loss_fast: float
    loss_ref: float
    loss_abs_diff: float
    loss_rel_diff: float
    logits_max_abs_diff: float
    logits_rel_diff: float  # max |logits difference| / max |reference logits|
    grad_norm_fast: float
    grad_norm_ref: float
    grad_norm_rel_diff: float
    worst_rel_diff: float  # the largest of the three relative differences
    first_divergent_op: Optional[str]
    ok: bool  # worst_rel_diff <= the tolerance

    def to_dict(self) -> Dict[str, object]:
        return asdict(self)


def loss_only(model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """The keyword that keeps an MLM model from adding full logits [B, S, V] beside its loss in
    evaluation (what transformers' callers get; a check comparing losses never reads them)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"return_logits": False} if "labels" in batch and "return_logits" in params else {}


def _run(model: torch.nn.Module, batch: Dict[str, torch.Tensor]):
    params = [p for p in model.parameters() if p.requires_grad]
    out = model(**batch, **loss_only(model, batch))
    logits = _logits(out)
    if getattr(out, "loss", None) is None:  # BertModel has no loss: compare outputs only
        return None, logits, None
    grads = torch.autograd.grad(out.loss, params, allow_unused=True)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None))
    return out.loss.detach().double(), logits.detach().double(), norm.item()


def _logits(out) -> torch.Tensor:
    for name in ("seq_relationship_logits", "logits", "start_logits", "prediction_logits", "last_hidden_state"):
        value = getattr(out, name, None)
        if value is not None:
            return value
    raise ValueError("parity: the model output has no logits to compare")


def _fp32_copy(model: torch.nn.Module) -> torch.nn.Module:
    if all(p.dtype == torch.float32 for p in model.parameters()):
        return model
    return copy.deepcopy(model).float()


@contextlib.contextmanager
def _strict_fp32(device_type: str):
    """No autocast and no TF32 inside a check: both would swamp the differences it looks for."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.autocast(device_type=device_type, enabled=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def check_batch(model: torch.nn.Module, batch: Dict[str, torch.Tensor], tol: float = 1e-3) -> ParityReport:
    """Fast vs reference on ``batch`` (model keyword arguments, labels included), fp32, dropout off.

    ok: the relative differences of loss, logits and gradient norm are all within ``tol``
    (fp32 paths agree to ~1e-6; the default leaves a wide margin).
    """
    subject = _fp32_copy(model)
    was_training = subject.training
    subject.eval()
    try:
        with _strict_fp32(next(subject.parameters()).device.type):
            loss_f, logits_f, norm_f = _run(subject, batch)
            with reference_execution(subject):
                loss_r, logits_r, norm_r = _run(subject, batch)
            loss_diff = abs(loss_f - loss_r).item() if loss_f is not None else 0.0
            loss_rel = loss_diff / max(abs(loss_r.item()), 1e-12) if loss_r is not None else 0.0
            logits_diff = (logits_f - logits_r).abs().max().item() if logits_f.numel() else 0.0
            logits_rel = logits_diff / max(logits_r.abs().max().item(), 1e-12) if logits_r.numel() else 0.0
            grad_rel = abs(norm_f - norm_r) / max(norm_r, 1e-12) if norm_f is not None else 0.0
            worst = max(loss_rel, logits_rel, grad_rel)
            ok = worst <= tol
            culprit = None if ok else first_divergent_op(subject, batch, tol=min(tol, 1e-4))
    finally:
        subject.train(was_training)
    nan = float("nan")
    return ParityReport(float(loss_f) if loss_f is not None else nan, float(loss_r) if loss_r is not None else nan,
                        loss_diff, loss_rel, logits_diff, logits_rel, norm_f if norm_f is not None else nan,
                        norm_r if norm_r is not None else nan, grad_rel, worst, culprit, ok)


def _signature(model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> List[torch.Tensor]:
    """[last hidden state at real tokens, loss, gradient norm] of one forward+backward (what a wrong
    op can move: a scale error is mostly normalised away in the forward pass, not in the gradient)."""
    out = model(**batch, output_hidden_states=True, **loss_only(model, batch))
    hidden = out.hidden_states[-1]
    mask = batch.get("attention_mask")
    if mask is not None and mask.shape == hidden.shape[:-1]:
        hidden = hidden[mask.bool()]
    parts = [hidden.detach().double()]
    loss = getattr(out, "loss", None)
    if loss is not None:
        grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None))
        parts += [loss.detach().double().reshape(1), norm.reshape(1)]
    return parts


def first_divergent_op(model: torch.nn.Module, batch: Dict[str, torch.Tensor], tol: float = 1e-4) -> Optional[str]:
    """The first op (forward order) whose selected backend alone, every other op on the torch
    backend, moves the last hidden state, the loss or the gradient norm by more than ``tol``
    (relative) off the all-torch run."""
    with use_backend("torch"):
        baseline = _signature(model, batch)
    every = [form.name for form in registry.forms()]
    for op in registry.step_forms():  # the step's forms, in its order
        others = {name: "torch" for name in every if name != op}
        with use_backend(others):
            signature = _signature(model, batch)
        moved = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
                    for a, b in zip(signature, baseline) if b.numel())
        if moved > tol:
            return op
    return "reference encoder (no single op diverges: check the unpadded path)"


class ParityError(RuntimeError):
    """Raised under --parity-strict when the fast path diverges from the reference."""

    def __init__(self, step: int, report: Dict[str, Any]):
        self.step, self.report = step, report
        super().__init__(f"parity check failed at step {step}: loss fast {report.get('loss_fast'):.6g} vs "
                         f"reference {report.get('loss_ref'):.6g} (abs diff {report.get('loss_abs_diff'):.3g}), "
                         f"grad-norm rel diff {report.get('grad_norm_rel_diff'):.3g}; first divergent op: "
                         f"{report.get('first_divergent_op')}")


def check_during_training(model: torch.nn.Module, batch: Dict[str, torch.Tensor], step: int, threshold: float,
                          strict: bool, say: Callable[[str], None],
                          max_over_ranks: Optional[Callable[[float], float]] = None) -> Dict[str, Any]:
    """``check_batch`` on a training batch: the report as a record (type 'parity', step, diverged:
    the worst relative difference over all ranks is past ``threshold``), said in one line; under
    ``strict`` a divergence raises ParityError."""
    report = check_batch(model, batch, tol=threshold).to_dict()
    worst = report["worst_rel_diff"]  # loss, logits and gradient norm, relative
    worst = worst if math.isfinite(worst) else float("inf")
    worst_all = max_over_ranks(worst) if max_over_ranks is not None else worst
    report.update(type="parity", step=step, diverged=bool(worst_all > threshold), max_rel_diff_all_ranks=worst_all)
    say(f"[parity] step {step}: loss fast {report['loss_fast']:.6f} ref {report['loss_ref']:.6f} "
        f"(rel {report['loss_rel_diff']:.2e}), grad-norm rel diff {report['grad_norm_rel_diff']:.2e}, logits max "
        f"diff {report['logits_max_abs_diff']:.2e} (rel {report['logits_rel_diff']:.2e}) -> "
        + (f"DIVERGED; first divergent op: {report['first_divergent_op']}" if report["diverged"] else "ok"))
    if report["diverged"] and strict:
        raise ParityError(step, report)
    return report


# ---------------------------------------------------------------- `bertfast parity`: the table
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


def main(argv: Optional[List[str]] = None) -> int:
    """`bertfast parity`: fast vs reference (and transformers when installed) on a small random BERT."""
    from bertfast.cli import parity_parser

    args = parity_parser().parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    rows, ok = parity_table(args.preset, torch.device(device))
    sys.stdout.write(rows + "\n")
    return 0 if ok else 1
