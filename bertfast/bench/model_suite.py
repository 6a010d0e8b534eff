"""Model suite: whole training steps and inference, bertfast against transformers and the reference.

Benchmarks (``--models`` names):
  pretrain   BertForPreTraining training step (forward with MLM + NSP labels, backward, AdamW step),
             BERT-base and BERT-large at seq 128 and 512, NSP-pair lengths (mostly full); on a GPU
             the targets' global batch of 256 (bench.options.GLOBAL_BATCH), micro-batches accumulated into one
             optimizer step: 2 x 128 at seq 128, 8 x 32 at seq 512.
  finetune   BertForSequenceClassification training step on a batch with mean length 50% of max
             ("padded") and on the same real tokens as full sequences ("no-padding").
  inference  BertModel forward latency at batch 1, 8, 64 (full-length sequences); on a CPU also
             XLM-R's, ELECTRA's and DistilBERT's encoders (bench.families), full and at mean length 50%.
  embeddings sentence-transformers encoding a corpus of short queries and longer passages, on
             bertfast (unpadded end to end), transformers and onnxruntime: sentences/s
             (bertfast/bench/embeddings.py).

Implementations: ``bertfast`` (the fast unpadded path, default backends), ``bertfast reference``
(the same model object under ``bertfast.reference_execution``), ``transformers sdpa eager`` and
``transformers sdpa compiled`` (``attn_implementation="sdpa"``, the same weights). On a GPU every
step runs under bf16 autocast with fp32 master weights; on a CPU in fp32. The pre-training step
has two more: ``bertfast static shapes`` and ``bertfast cuda graphs``, the step of ``bertfast
pretrain --static-shapes`` and ``--cuda-graphs`` (``training.TrainStep`` and ``GraphedTrainStep``:
the batch packed into one row, a fixed number of MLM predictions, checks on the device, the
gradient norm; the graph warmed up and captured before timing).

Parity before timing: the bertfast model must pass ``bertfast.parity.check_batch`` on the
benchmark batch (fp32, dropout off; a pre-training case's first micro-batch); a transformers model
must match the bertfast reference on the same weights and batch (loss, logits, gradient norm). A
path that fails is not timed.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from bertfast.model import mfu as bert_flops
from bertfast.parity import loss_only
from bertfast.bench import families
from bertfast.bench.common import (Stopped, SuiteContext, compile_skip_reason, describe_lengths, dtype_name,
                                   free_memory, generator_for, mask_from, sequence_lengths, short_error, strict_fp32,
                                   time_plans)
from bertfast.bench.options import GLOBAL_BATCH, MODEL_BENCHMARKS
from bertfast.bench.results import (BERTFAST, BERTFAST_GRAPHS, BERTFAST_REFERENCE, BERTFAST_STATIC, ERROR,
                                    FAILED_PARITY, HF_COMPILED, HF_EAGER, Row, case_text, skipped)
from bertfast.bench.timing import TimingPolicy

SUITE = "model"
BENCHMARKS = MODEL_BENCHMARKS
IMPLS = (BERTFAST, BERTFAST_STATIC, BERTFAST_GRAPHS, BERTFAST_REFERENCE, HF_EAGER, HF_COMPILED)
LOSS_TOL = GRAD_TOL = LOGITS_TOL = 1e-3  # as bertfast.parity.check_batch


# --------------------------------------------------------------------------- cases
def _cases(ctx: SuiteContext) -> Dict[str, List[Tuple]]:
    """benchmark -> [(preset, seqlen, batch)]; pre-training cases add the micro-batches of each step,
    inference cases their length mode (none: full sequences) and, for a family other than BERT, the
    family (bench.families)."""
    if not ctx.device.is_cuda and ctx.cpu_model_cases:
        # What CPU users run (MiniLM-sized sentence encoders): batch 1 and 32, full and mean 50% length;
        # training steps at batch 8 (finetune's no-padding rows hold the padded batch's tokens: batch 8).
        # Inference again for each other encoder family, full and at mean length 50%.
        return {"pretrain": [("minilm", 128, 8, 1)], "finetune": [("minilm", 128, 16)],
                "inference": [("minilm", 128, 1, "none"), ("minilm", 128, 32, "none"),
                              ("minilm", 128, 32, "finetune")]
                + [("minilm", 128, 32, mode, family) for family in families.FAMILIES[1:]
                   for mode in ("none", "finetune")]}
    if not ctx.device.is_cuda:
        # two micro-batches, so that the accumulating step a GPU's cases take runs in the tests too
        return {"pretrain": [("tiny", 32, 4, 2)], "finetune": [("tiny", 32, 4)],
                "inference": [("tiny", 32, 1, "none"), ("tiny", 32, 8, "none")]
                + [("tiny", 32, 4, "finetune", family) for family in families.FAMILIES[1:]]}
    if ctx.quick:
        return {"pretrain": [("bert-base", 128, 32, 1)], "finetune": [("bert-base", 128, 32)],
                "inference": [("bert-base", 128, b, "none") for b in (1, 8, 64)]}
    return GPU_CASES


# A GPU's pre-training case accumulates the targets' GLOBAL_BATCH / batch micro-batches into each
# optimizer step, so the optimizer's and clipping's passes are counted once per 256 sequences, as a
# pre-training run pays them.
GPU_CASES = {  # the headline target first: a budget-limited run measures it before anything else
    # pretrain: (preset, seqlen, micro-batch size, micro-batches a step)
    "pretrain": [(model, seq, batch, GLOBAL_BATCH // batch)
                 for model, seq, batch in (("bert-large", 128, 128), ("bert-base", 128, 128), ("bert-large", 512, 32),
                                           ("bert-base", 512, 32))],
    "finetune": [("bert-base", 128, 32), ("bert-base", 512, 32), ("bert-large", 128, 32)],
    "inference": [(m, 128, b, "none") for m in ("bert-base", "bert-large") for b in (1, 8, 64)],
}


def _config(preset: str, family: str = "bert"):
    """bertfast's BertConfig of the preset; another family's transformers config of its sizes."""
    from bertfast import BertConfig
    return BertConfig.preset(preset) if family == "bert" else families.config(preset, family)


# --------------------------------------------------------------------------- batches
def _segments(lengths: Sequence[int], seqlen: int) -> torch.Tensor:
    """token_type_ids: 0 for the first half of each sequence's real tokens (segment A), 1 after."""
    pos = torch.arange(seqlen)[None, :]
    lens = torch.tensor(list(lengths))[:, None]
    return ((pos >= lens // 2) & (pos < lens)).long()


def _input_ids(config, lengths: Sequence[int], seqlen: int, gen: torch.Generator) -> torch.Tensor:
    ids = torch.randint(5, config.vocab_size, (len(lengths), seqlen), generator=gen)
    mask = mask_from(lengths, seqlen, torch.device("cpu"))
    return torch.where(mask, ids, torch.full_like(ids, config.pad_token_id))


def pretrain_batch(config, lengths: Sequence[int], seqlen: int, gen: torch.Generator,
                   device: torch.device) -> Tuple[Dict[str, torch.Tensor], int]:
    """A BertForPreTraining batch and its number of MLM predictions (15% of real tokens after [CLS])."""
    mask = mask_from(lengths, seqlen, torch.device("cpu"))
    candidates = mask.clone()
    candidates[:, 0] = False
    score = torch.rand(mask.shape, generator=gen).masked_fill(~candidates, 2.0)
    n_per_seq = [max(1, round(0.15 * (n - 1))) if n > 1 else 0 for n in lengths]
    labels = torch.full(mask.shape, -100, dtype=torch.long)
    order = score.argsort(dim=1)
    for b, n in enumerate(n_per_seq):
        chosen = order[b, :n]
        labels[b, chosen] = torch.randint(5, config.vocab_size, (n,), generator=gen)
    batch = {"input_ids": _input_ids(config, lengths, seqlen, gen), "attention_mask": mask.long(),
             "token_type_ids": _segments(lengths, seqlen), "labels": labels,
             "next_sentence_label": torch.randint(0, 2, (len(lengths),), generator=gen)}
    return {k: v.to(device) for k, v in batch.items()}, sum(n_per_seq)


def classification_batch(config, lengths: Sequence[int], seqlen: int, gen: torch.Generator,
                         device: torch.device) -> Dict[str, torch.Tensor]:
    mask = mask_from(lengths, seqlen, torch.device("cpu"))
    batch = {"input_ids": _input_ids(config, lengths, seqlen, gen), "attention_mask": mask.long(),
             "token_type_ids": _segments(lengths, seqlen),
             "labels": torch.randint(0, config.num_labels, (len(lengths),), generator=gen)}
    return {k: v.to(device) for k, v in batch.items()}


def packed_pretrain_batch(batch: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """``batch`` as ``bertfast pretrain --static-shapes`` feeds it: one row of batch x seq_len tokens,
    and the MLM head's static gather for the row as its default sizes it (ceil(0.15 x seq_len) per
    sequence, for each of the batch's sequences)."""
    from bertfast.padding import pack_batch

    b, s = batch["input_ids"].shape
    packed = pack_batch(batch, b * s, s)
    packed["max_predictions_per_seq"] = b * math.ceil(0.15 * s)
    return packed


def inference_batch(config, lengths: Sequence[int], seqlen: int, gen: torch.Generator,
                    device: torch.device) -> Dict[str, torch.Tensor]:
    """An encoder's batch: with token types where the family has two (BERT, ELECTRA)."""
    b = classification_batch(config, lengths, seqlen, gen, device)
    b.pop("labels")
    if getattr(config, "type_vocab_size", 0) < 2:
        b.pop("token_type_ids")
    return b


# --------------------------------------------------------------------------- transformers
def transformers_twin(model: torch.nn.Module, kind: str):
    """A transformers model (attn_implementation='sdpa') holding a copy of ``model``'s weights."""
    import transformers

    if isinstance(model.config, transformers.BertConfig):
        cfg = model.config.to_dict()
        for key in ("extra", "model_type", "architectures"):
            cfg.pop(key, None)
        hf_config = transformers.BertConfig(**cfg)
        cls = {"pretrain": transformers.BertForPreTraining, "finetune": transformers.BertForSequenceClassification,
               "inference": transformers.BertModel}[kind]
    else:  # another family's encoder: its config is transformers' already
        hf_config, cls = model.config, getattr(transformers, type(model).__name__)
    hf = cls._from_config(hf_config, attn_implementation="sdpa")
    state = model.state_dict()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    params = {n for n, _ in hf.named_parameters()}
    lost = [k for k in missing if k in params]
    if lost or unexpected:
        raise RuntimeError(f"bertfast -> transformers weights do not line up: missing {lost[:5]}, "
                           f"unexpected {list(unexpected)[:5]}")
    return hf.to(next(model.parameters()).device)


def transformers_skip_reason(ctx: SuiteContext) -> Optional[str]:
    if not ctx.with_transformers:
        return "transformers rows disabled (--no-transformers)"
    try:
        import transformers  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"transformers is not installed ({short_error(exc, 120)})"
    return None


# --------------------------------------------------------------------------- parity
def _primary(out) -> torch.Tensor:
    for name in ("seq_relationship_logits", "logits", "last_hidden_state"):
        value = out.get(name) if isinstance(out, dict) else getattr(out, name, None)
        if value is not None:
            return value
    raise ValueError("model output has no logits or hidden states")


def _eval_fp32(module: torch.nn.Module, batch: Dict[str, torch.Tensor], forward=None, want_grad: bool = True):
    """(loss or None, primary output at valid tokens, grad norm or None), fp32, autocast off."""
    fwd = module if forward is None else forward  # a compiled module has no truth value
    params = [p for p in module.parameters() if p.requires_grad]
    with torch.autocast(next(module.parameters()).device.type, enabled=False):
        out = fwd(**batch, **loss_only(module, batch))
    loss = out["loss"] if isinstance(out, dict) and "loss" in out else getattr(out, "loss", None)
    primary = _primary(out).detach().double()
    if primary.dim() == 3:  # [B, S, H]: compare real tokens only
        primary = primary[batch["attention_mask"].bool()]
    norm = None
    if loss is not None and want_grad:
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads if g is not None))
    return (None if loss is None else float(loss.detach())), primary, norm


def parity_vs_reference(model, batch, other: torch.nn.Module, forward=None) -> Dict[str, Any]:
    """``other`` (a transformers model holding ``model``'s weights) vs the bertfast reference."""
    from bertfast import reference_execution

    modes = (model.training, other.training)
    model.eval()
    other.eval()
    try:
        with reference_execution(model):
            loss_r, prim_r, norm_r = _eval_fp32(model, batch)
        loss_o, prim_o, norm_o = _eval_fp32(other, batch, forward)
    finally:
        model.train(modes[0])
        other.train(modes[1])
    report = {"logits_max_abs_diff": float((prim_o - prim_r).abs().max()) if prim_r.numel() else 0.0}
    ok = report["logits_max_abs_diff"] <= LOGITS_TOL
    if loss_r is not None:
        report.update(loss_ref=loss_r, loss_other=loss_o, loss_abs_diff=abs(loss_o - loss_r),
                      grad_norm_ref=norm_r, grad_norm_other=norm_o,
                      grad_norm_rel_diff=abs(norm_o - norm_r) / max(norm_r, 1e-12))
        ok = ok and report["loss_abs_diff"] <= LOSS_TOL and report["grad_norm_rel_diff"] <= GRAD_TOL
    report["ok"] = ok
    return report


def parity_fast(model, batch) -> Dict[str, Any]:
    """The bertfast fast path vs its reference execution on the benchmark batch."""
    if "labels" in batch:
        from bertfast.parity import check_batch
        return check_batch(model, batch).to_dict()
    from bertfast import reference_execution

    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            _, fast, _ = _eval_fp32(model, batch, want_grad=False)
            with reference_execution(model):
                _, ref, _ = _eval_fp32(model, batch, want_grad=False)
    finally:
        model.train(was)
    diff = float((fast - ref).abs().max()) if ref.numel() else 0.0
    return {"hidden_max_abs_diff": diff, "ok": diff <= LOGITS_TOL}


def parity_packed(model, batch, packed, padded: Optional[float] = None) -> Dict[str, Any]:
    """The packed batch's fast path vs its reference, and its loss vs the padded batch's (the same
    real tokens: the same loss). ``padded``: that loss, when the padded batch's gate has it already."""
    from bertfast.parity import check_batch

    report = check_batch(model, packed).to_dict()
    if padded is None:
        padded = check_batch(model, batch).loss_fast
    report["padded_loss_fast"] = padded
    report["packed_vs_padded_loss_rel_diff"] = abs(report["loss_fast"] - padded) / max(abs(padded), 1e-12)
    report["ok"] = bool(report["ok"]) and report["packed_vs_padded_loss_rel_diff"] <= LOSS_TOL
    return report


def _gate_failure(report: Dict[str, Any]) -> Dict[str, str]:
    """A row's status and reason for a gate that did not pass: FAILED PARITY where it ran and the
    paths disagree, ERROR where it could not run (the fp32 gate's memory, say: no verdict on parity)."""
    if report.get("error"):
        return {"status": ERROR, "reason": f"while checking parity: {report['error']}"}
    return {"status": FAILED_PARITY, "reason": _parity_message(report)}


def _parity_message(report: Dict[str, Any]) -> str:
    shown = {k: (f"{v:.3e}" if isinstance(v, float) else v) for k, v in report.items() if k != "ok"}
    return "disagrees with the reference: " + ", ".join(f"{k}={v}" for k, v in shown.items())


# --------------------------------------------------------------------------- steps
def _autocast_dtype(ctx: SuiteContext) -> Optional[torch.dtype]:
    return ctx.dtype if ctx.device.is_cuda and ctx.dtype != torch.float32 else None


def make_train_step(ctx: SuiteContext, module: torch.nn.Module, batches: Sequence[Dict[str, torch.Tensor]],
                    forward: Optional[Callable] = None, reference: bool = False) -> Callable[[], None]:
    """One optimizer step over the micro-batches: zero grads, then for each a forward (autocast on
    GPU) and the backward of its loss over their number (autograd adds the gradients), then AdamW."""

    fused = {"fused": True} if ctx.device.is_cuda else {}
    opt = torch.optim.AdamW(module.parameters(), lr=1e-5, weight_decay=0.01, **fused)
    dtype = _autocast_dtype(ctx)
    fwd = module if forward is None else forward  # a compiled module has no truth value
    dev_type = ctx.torch_device.type
    count = len(batches)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for batch in batches:
            with torch.autocast(dev_type, dtype=dtype or torch.float32, enabled=dtype is not None):
                out = fwd(**batch)
            loss = out["loss"] if isinstance(out, dict) else out.loss
            (loss / count if count > 1 else loss).backward()
        opt.step()

    return _through_reference(step, module) if reference else step


def _precision(ctx: SuiteContext) -> str:
    """The suite's precision as TrainStep names it (fp32, bf16, fp16)."""
    return dtype_name(_autocast_dtype(ctx) or torch.float32)


def packed_step_skip_reason(ctx: SuiteContext, graphs: bool) -> Optional[str]:
    """Why the static-shape (``graphs``: CUDA-graph) pre-training step cannot run here, or None:
    for graphs, what ``bertfast pretrain --cuda-graphs`` would refuse (one process, AdamW, eager)."""
    if not graphs:
        return None
    from bertfast.training.graphs import check_supported
    try:
        check_supported(ctx.torch_device, 1, "adamw", _precision(ctx), False, "fast")
    except ValueError as exc:
        return str(exc)
    return None


def make_packed_train_step(ctx: SuiteContext, module: torch.nn.Module, packed: Sequence[Dict[str, Any]],
                           graphs: bool) -> Callable[[], None]:
    """``bertfast pretrain``'s own step on the packed micro-batches: TrainStep (``--static-shapes``) or
    GraphedTrainStep (``--cuda-graphs``, run here through its eager warm-up and the capture, so the
    timed calls are replays), with pretrain's default optimizer and clipping (training.config
    PretrainConfig; training.optim.pretrain_optimizer): on a GPU in bf16 the triton AdamW writing the
    working copies of the GEMM weights, the gradients clipped at norm 1.0. The H200 runs of
    2026-11-27 timed these rows with torch's fused AdamW and no working copies, casting every GEMM
    weight in every forward: not the step pretrain runs. The step's TrainStep is its
    ``train_step`` attribute."""
    from bertfast.training.config import PretrainConfig
    from bertfast.training.graphs import GraphedTrainStep
    from bertfast.training.optim import pretrain_optimizer
    from bertfast.training.step import TrainStep

    args = PretrainConfig()
    precision = _precision(ctx)
    opt = pretrain_optimizer(module, args, precision)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    if graphs:
        train_step = GraphedTrainStep(module, opt, schedule, ctx.torch_device, precision, args.max_grad_norm)
    else:
        train_step = TrainStep(module, opt, schedule, ctx.torch_device, precision, args.max_grad_norm,
                               device_checks=True)

    def step() -> None:
        train_step(packed, lambda mb: train_step.forward(module, mb))

    step.train_step = train_step  # type: ignore[attr-defined]
    for _ in range(GraphedTrainStep.WARMUP_STEPS + 1 if graphs else 0):
        step()
    return step


def make_infer_step(ctx: SuiteContext, module: torch.nn.Module, batch: Dict[str, torch.Tensor],
                    reference: bool = False) -> Callable[[], None]:

    dtype = _autocast_dtype(ctx)
    dev_type = ctx.torch_device.type

    def step() -> None:
        with torch.inference_mode(), torch.autocast(dev_type, dtype=dtype or torch.float32,
                                                    enabled=dtype is not None):
            module(**batch)

    return _through_reference(step, module) if reference else step


def _through_reference(step: Callable[[], None], module: torch.nn.Module) -> Callable[[], None]:
    """``step`` with ``module`` run by the plain reference encoder."""
    from bertfast import reference_execution

    def ref_step() -> None:
        with reference_execution(module):
            step()
    return ref_step


# --------------------------------------------------------------------------- one benchmark
def _figures(ctx: SuiteContext, t, batch_size: int, tokens: int, model_flops: float):
    """Throughputs, and MFU against the measured matmul peak (mfu) and the datasheet peak (mfu_datasheet)."""
    metrics = {"seq_per_s": t.rate(batch_size * 1e3), "tokens_per_s": t.rate(tokens * 1e3),
               "tflops": t.rate(model_flops / 1e9)}
    peak = ctx.device.peak_matmul_tflops
    if peak is not None:
        metrics["mfu"] = t.rate(model_flops / (peak.median * 1e9))
    if ctx.device.datasheet_bf16_tflops:
        metrics["mfu_datasheet"] = t.rate(model_flops / (ctx.device.datasheet_bf16_tflops * 1e9))
    return metrics


def _bench(ctx: SuiteContext, group: str, case: Dict[str, Any], direction: str, kind: str,
           batches: Sequence[Dict[str, torch.Tensor]], lengths, model_flops: float, policy: TimingPolicy) -> List[Row]:
    """All implementations of one benchmark case: build, gate (on the first of its micro-batches), then
    time a step over all of them (``lengths``: every micro-batch's)."""
    import bertfast

    batch = batches[0]

    preset, family = case["model"], case.get("family", "bert")
    config = _config(preset, family)
    cls = {"pretrain": bertfast.BertForPreTraining, "finetune": bertfast.BertForSequenceClassification,
           "inference": families.encoder_class(family)}[kind]
    torch.manual_seed(0)
    model = cls(config).to(ctx.torch_device)
    model.train(kind != "inference")
    tokens, bsz = sum(lengths), len(lengths)
    work = {"flops": model_flops, "tokens": tokens, "sequences": bsz}
    hf_impls = [impl for impl in (HF_EAGER, HF_COMPILED) if ctx.wants(impl)]
    hf_reason = transformers_skip_reason(ctx)
    hf = None
    if hf_reason is None and hf_impls:
        try:
            hf = transformers_twin(model, kind)
            hf.train(kind != "inference")
        except Exception as exc:  # noqa: BLE001
            hf_reason = f"could not build the transformers model: {short_error(exc)}"

    def row(impl: str, **kw) -> Row:
        return Row(SUITE, group, dict(case), direction, impl, work=dict(work), **kw)

    # 1. parity gates, all before any weight update.
    plans: List[Tuple[str, Callable[[], Callable[[], None]], Dict[str, Any]]] = []
    rows: List[Row] = []
    fast_report: Dict[str, Any] = {}
    if ctx.wants(BERTFAST):
        try:
            with strict_fp32():
                report = fast_report = parity_fast(model, batch)
        except Exception as exc:  # noqa: BLE001
            report = {"ok": False, "error": short_error(exc)}
        if report.get("ok"):
            plans.append((BERTFAST, lambda: (make_infer_step(ctx, model, batch) if kind == "inference"
                                             else make_train_step(ctx, model, batches)), report))
        else:
            rows.append(row(BERTFAST, parity=report, **_gate_failure(report)))
    if kind == "pretrain":
        packed_gate: Optional[Tuple[Any, Dict[str, Any]]] = None  # (packed batches, report): one for both rows
        for impl, graphs in ((BERTFAST_STATIC, False), (BERTFAST_GRAPHS, True)):
            if not ctx.wants(impl):
                continue
            reason = packed_step_skip_reason(ctx, graphs)
            if reason:
                rows.append(skipped(SUITE, group, dict(case), direction, impl, reason))
                continue
            if packed_gate is None:
                try:
                    packed = [packed_pretrain_batch(b) for b in batches]
                    with strict_fp32():
                        packed_gate = packed, parity_packed(model, batch, packed[0], fast_report.get("loss_fast"))
                except Exception as exc:  # noqa: BLE001
                    packed_gate = None, {"ok": False, "error": short_error(exc)}
            packed, report = packed_gate
            if report.get("ok"):
                plans.append((impl, lambda g=graphs: make_packed_train_step(ctx, model, packed, g), report))
            else:
                rows.append(row(impl, parity=report, **_gate_failure(report)))
    if ctx.wants(BERTFAST_REFERENCE):
        plans.append((BERTFAST_REFERENCE, lambda: (make_infer_step(ctx, model, batch, reference=True)
                                                   if kind == "inference"
                                                   else make_train_step(ctx, model, batches, reference=True)),
                      {"gate": "the reference itself"}))
    if hf is None:
        rows += [skipped(SUITE, group, dict(case), direction, impl, hf_reason) for impl in hf_impls]
    else:
        for impl in hf_impls:
            forward = hf
            if impl == HF_COMPILED:
                reason = compile_skip_reason(ctx)
                if reason:
                    rows.append(skipped(SUITE, group, dict(case), direction, impl, reason))
                    continue
                import torch._dynamo as dynamo
                dynamo.reset()
                forward = torch.compile(hf)
            try:
                with strict_fp32():
                    report = parity_vs_reference(model, batch, hf, forward)
            except Exception as exc:  # noqa: BLE001
                # Environments where compile cannot run were skipped above (compile_skip_reason):
                # anything raised here is an error, shown as one.
                rows.append(row(impl, **_gate_failure({"error": short_error(exc)})))
                continue
            if not report["ok"]:
                rows.append(row(impl, parity=report, **_gate_failure(report)))
                continue
            if kind == "inference":
                plans.append((impl, lambda f=forward: make_infer_step(ctx, f, batch), report))
            else:
                plans.append((impl, lambda f=forward: make_train_step(ctx, hf, batches, forward=f), report))

    # 2. timing (common.time_plans: on a CPU in turns).
    def timed(impl: str, t, mem, report, clocks) -> None:
        if isinstance(t, BaseException):
            rows.append(row(impl, status=ERROR, reason=f"while timing: {short_error(t)}", parity=report))
            return
        rows.append(row(impl, time_ms=t, metrics=_figures(ctx, t, bsz, tokens, model_flops), memory=mem,
                        parity=report, clocks=clocks))
        ctx.log(f"  {group} {case_text(case)} {impl:28s} {t.median:9.3f} ms")

    time_plans(ctx, plans, policy, timed)
    order = {name: i for i, name in enumerate(IMPLS)}
    rows.sort(key=lambda r: order.get(r.impl, len(order)))
    model = hf = None  # drop the models (the plans' closures share these cells) before freeing memory
    free_memory()
    return rows


# --------------------------------------------------------------------------- the suite
def _skipped_case(ctx: SuiteContext, group: str, case: Dict[str, Any], direction: str, reason: str) -> List[Row]:
    from bertfast.bench import embeddings
    impls = [impl for impl in (embeddings.IMPLS if group == embeddings.GROUP else IMPLS) if ctx.wants(impl)]
    return [skipped(SUITE, group, dict(case), direction, impl, reason) for impl in impls]


def run(ctx: SuiteContext) -> List[Row]:
    dev = ctx.torch_device
    policy = ctx.step_policy
    cases = _cases(ctx)
    left = []  # cases the time budget did not reach

    def bench_or_skip(group, case, direction, *args, bench=_bench) -> List[Row]:
        if not ctx.wants_case(case):
            return []
        if ctx.budget_spent():
            left.append(case)
            return ctx.record(_skipped_case(ctx, group, case, direction, ctx.budget_reason()))
        try:
            case_rows = bench(ctx, group, case, direction, *args)
        except Stopped as stop:  # the cases after this one are built as the suite goes: only this one is known
            ctx.record(_skipped_case(ctx, group, case, direction, stop.reason(running=True)))
            raise
        return ctx.record(case_rows)
    ctx.note("model suite: " + ("bf16 autocast with fp32 master weights, fused AdamW" if _autocast_dtype(ctx)
                                else "fp32, no autocast, AdamW") + "; dropout 0.1 as configured; MFU = model "
             "FLOPs on real tokens / step time / peak: the measured matmul peak (mfu) and the datasheet dense "
             "bf16 peak (mfu_datasheet, where the GPU is known; the targets use it); the static-shape and "
             "CUDA-graph pre-training rows run bertfast pretrain's own step on the packed batch, with its "
             "default optimizer (AdamW: triton, writing the GEMM weights' working copies, where it runs) and "
             "clipping at norm 1.0")
    rows: List[Row] = []
    wanted = ctx.models or BENCHMARKS

    if "pretrain" in wanted:
        for preset, seqlen, batch_size, micro in cases["pretrain"]:
            ctx.log(f"[model] pretrain {preset} seq {seqlen} global batch {batch_size * micro} = {micro} x "
                    f"{batch_size}")
            config = _config(preset)
            gen = generator_for("pretrain", preset, seqlen, batch_size)
            batches, lengths, n_pred = [], [], 0
            for _ in range(micro):  # drawn in turn from one generator: the first as a case of one micro-batch
                mb_lengths = sequence_lengths("pretrain", batch_size, seqlen, gen)
                mb, mb_pred = pretrain_batch(config, mb_lengths, seqlen, gen, dev)
                batches.append(mb)
                lengths += mb_lengths
                n_pred += mb_pred
            flops = bert_flops.training_step_flops(
                bert_flops.bert_forward_flops(config, lengths, "pretraining", n_pred))
            case = {"model": preset, "seqlen": seqlen, "batch": batch_size, "micro_batches": micro,
                    "global_batch": batch_size * micro, "lengths": "pretrain", **describe_lengths(lengths, seqlen),
                    "predictions": n_pred}
            rows += bench_or_skip("pretrain_step", case, "step", "pretrain", batches, lengths, flops, policy)

    if "finetune" in wanted:
        for preset, seqlen, batch_size in cases["finetune"]:
            config = _config(preset)
            gen = generator_for("finetune", preset, seqlen, batch_size)
            padded = sequence_lengths("finetune", batch_size, seqlen, gen)
            # The same real tokens as full sequences: batch/2 rows of seqlen (finetune lengths pair up to seqlen).
            full = [seqlen] * (sum(padded) // seqlen)
            for label, lengths in (("padded", padded), ("no-padding", full)):
                ctx.log(f"[model] finetune {preset} seq {seqlen} {label} batch {len(lengths)}")
                batch = classification_batch(config, lengths, seqlen, gen, dev)
                flops = bert_flops.training_step_flops(
                    bert_flops.bert_forward_flops(config, lengths, "classification", num_labels=config.num_labels))
                case = {"model": preset, "seqlen": seqlen, "batch": len(lengths), "lengths": label,
                        **describe_lengths(lengths, seqlen)}
                rows += bench_or_skip("finetune_step", case, "step", "finetune", [batch], lengths, flops, policy)

    if "inference" in wanted:
        for preset, seqlen, batch_size, mode, *family in cases["inference"]:
            family = family[0] if family else "bert"
            ctx.log(f"[model] inference {preset}{'' if family == 'bert' else ' ' + family} seq {seqlen} "
                    f"batch {batch_size} lengths {mode}")
            config = _config(preset, family)
            gen = generator_for("inference", preset, seqlen, batch_size, *(() if mode == "none" else (mode,)))
            lengths = sequence_lengths(mode, batch_size, seqlen, gen)
            batch = inference_batch(config, lengths, seqlen, gen, dev)
            flops = bert_flops.bert_forward_flops(config, lengths, "none")
            case = {"model": preset, **({} if family == "bert" else {"family": family}), "seqlen": seqlen,
                    "batch": batch_size, "lengths": mode, **describe_lengths(lengths, seqlen)}
            rows += bench_or_skip("inference", case, "inference", "inference", [batch], lengths, flops, policy)

    if "embeddings" in wanted:
        from bertfast.bench import embeddings
        for preset, family, n_texts, batch_size in embeddings.cases(ctx):
            ctx.log(f"[model] embeddings {preset} {family} {n_texts} texts batch {batch_size}")
            case, texts, lengths = embeddings.prepare(preset, family, n_texts, batch_size)
            rows += bench_or_skip(embeddings.GROUP, case, "inference", texts, lengths, _figures, bench=embeddings.bench)
    if left:
        ctx.log(f"  time budget spent: {len(left)} model case(s) not run")
    return rows
