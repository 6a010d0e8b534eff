"""``bertfast pretrain``: BERT pre-training (masked LM + next sentence prediction).

The paper's recipe (docs/architecture.md, "The model"): two phases, sequence length 128 for 90% of the
steps then 512; Adam(W) with lr 1e-4, betas (0.9, 0.999), weight decay 0.01 except on biases
and LayerNorm, 10k warm-up steps then linear decay; batch 256. Here:

  * data: shards from ``bertfast prepare`` (``--data`` for phase 1, ``--data-phase2`` for
    phase 2, each with its own max_seq_len), masked dynamically per epoch (or statically);
  * global batch = micro batch x accumulation steps x ranks; DDP (no_sync while
    accumulating) or FSDP2 (``--fsdp``: parameters, gradients and optimizer states sharded,
    the tied embedding/decoder weight kept as one parameter of the root shard group) under
    torchrun, NCCL on GPUs, gloo on CPU;
  * AdamW (fused on CUDA) or LAMB (``--optimizer lamb``) for large batches; warm-up +
    linear decay; gradient clipping; bf16 autocast on GPU (fp16 with loss scaling, or fp32;
    fp32 on CPU);
  * the fast unpadded model with the masked-only MLM head: ``BertForPreTraining(**batch)``;
  * checkpoints every ``--save-every`` steps: the model in HF layout (plus the vocabulary,
    so a checkpoint is a fine-tuning starting point), optimizer, scheduler, loss scaler,
    step (= data position) and every rank's RNG states; written atomically (temp dir, fsync,
    rename, with a SHA-256 manifest); the last ``--keep-last`` kept. ``--resume`` continues
    bit-for-bit; the output directory is locked, and holds one run (``--overwrite`` replaces
    an earlier one); a NaN/inf loss or gradient norm stops the run (``--on-nonfinite``);
    docs/training.md;
  * logging: a tqdm bar; loss, MLM/NSP accuracy, lr, grad norm, real tokens/s, sequences/s
    and MFU in ``metrics.jsonl`` (and TensorBoard when installed, ``--tensorboard``), a
    held-out evaluation every ``--eval-every`` steps, ``loss.png`` at the end;
  * ``--parity-every N``: every N steps ``bertfast.parity.check_batch`` runs the step's first
    micro-batch through the fast and reference paths (fp32, dropout off); past
    ``--parity-threshold`` (relative, on loss, logits and gradient norm) it warns, and with
    ``--parity-strict`` the run stops and names the first divergent op;
  * ``--static-shapes``: packed micro-batches of fixed shapes and no host read in the step;
    ``--cuda-graphs``: the step captured in a CUDA graph and replayed (training.graphs).

``bertfast pretrain`` with no arguments (or ``--demo``) runs a short demonstration: a small
BERT on the embedded corpus (the standard library's docstrings, prepared on the fly into
``runs/demo``), with throughput and parity checks printed; a few minutes on a 2-core CPU.
Options can also come from a JSON file: ``--config run.json`` (keys are option names). Every
option is a typed, checked field of ``training.config.PretrainConfig``; the resolved settings are
saved as ``OUTPUT_DIR/run_config.json``, and ``--resume`` starts from them.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

from bertfast import parity
from bertfast.model import mfu
from bertfast.contract import IGNORE_INDEX
from bertfast.data.loader import Prefetcher, sequence_lengths
from bertfast.data.tokenization import read_vocab
from bertfast.model.modeling import REFERENCE
from bertfast.training import checkpoints as ckpt
from bertfast.training import exits, graphs
from bertfast.training.config import PretrainConfig
from bertfast.training.distributed import (DistInfo, all_reduce_max, all_reduce_sum, any_rank, broadcast_object,
                                           gather_objects, init_distributed)
from bertfast.training.nonfinite import NonFiniteWatch
from bertfast.training.optim import pretrain_optimizer, warmup_linear_decay
from bertfast.training.phases import (Phase, build_config, build_phases, compare_with_readme, demo_environment,
                                      prepare_demo_data, resolve_steps, size_micro_batches)
from bertfast.training.precision import resolve_precision
from bertfast.training.records import (MetricsLogger, RunningSums, format_duration, library_progress_bars,
                                       plot_loss_curve, read_jsonl)
from bertfast.training.rundir import RunDirectory
from bertfast.training.signals import StopRequest
from bertfast.training.step import StepResult, TrainStep

TOKENIZER_FILES = ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json")


# ============================================================================ arguments
def parse_args(argv: Optional[Sequence[str]] = None) -> PretrainConfig:
    """Flags over the JSON ``--config`` file over the saved run (``--resume``) over the demo preset
    over the defaults.

    The demo runs with ``--demo``, and also when neither ``--data``, ``--data-phase2`` nor
    ``--config`` is given (so ``bertfast pretrain`` alone runs it). A resumed run starts from the
    run_config.json its output directory holds.
    """
    def preset(given: Dict[str, Any]) -> Optional[str]:
        wants_demo = given.get("demo") or not (given.get("data") or given.get("data_phase2") or given.get("config"))
        return "demo" if wants_demo else None

    argv = list(sys.argv[1:] if argv is None else argv)
    return PretrainConfig.from_command_line(argv, PretrainConfig.PROG, PretrainConfig.DESCRIPTION, preset)


def wrap_model(model: torch.nn.Module, args, info: DistInfo) -> torch.nn.Module:
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard
        # One shard group per encoder layer (gathered only while that layer runs), and the root
        # group for the rest: embeddings, pooler and heads, so the tied word-embedding / decoder
        # weight stays one parameter of one group.
        for layer in model.bert.encoder.layer:
            fully_shard(layer)
        fully_shard(model)
        return model
    if info.distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP
        kwargs = {"device_ids": [info.device.index]} if info.device.type == "cuda" else {}
        return DDP(model, broadcast_buffers=False, **kwargs)
    return model


# ============================================================================ the run
@dataclass
class RunResult:
    losses: Dict[int, float] = field(default_factory=dict)   # step (1-based) -> mean loss of that step
    evals: List[Dict[str, Any]] = field(default_factory=list)
    parity: List[Dict[str, Any]] = field(default_factory=list)
    final_step: int = 0
    stopped_early: bool = False      # before the last step (--stop-at-step or a signal)
    stopped_by_signal: bool = False
    checkpoint: Optional[str] = None
    output_dir: str = ""


class Pretrainer:
    # What a log window adds up on the device (one host read per window).
    WINDOW = ("loss", "mlm_loss", "nsp_loss", "mlm_correct", "nsp_correct", "tokens", "sum_len_sq", "predictions",
              "sequences")

    def __init__(self, args: PretrainConfig, info: DistInfo, stop_request: Optional[StopRequest] = None):
        self.args, self.info = args, info
        self.device = info.device
        self.precision = resolve_precision(args.precision, self.device)
        self.log_records: Optional[MetricsLogger] = None  # opened in setup(): a resumed run appends
        self.ckpt_dir = os.path.join(args.output_dir, "checkpoints")
        self.run_dir = RunDirectory(args.output_dir, self.ckpt_dir, self.say)
        self.stop_request = stop_request or StopRequest()  # run() installs its own before any work
        self.watch = NonFiniteWatch(self.device, args.on_nonfinite == "skip", args.max_skipped_steps)

    def say(self, msg: str) -> None:
        if self.info.is_main:
            from tqdm.auto import tqdm
            tqdm.write(msg)

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        args, info = self.args, self.info
        # The main process locks and settles the output directory; every rank learns the outcome.
        opened: Any = None
        if info.is_main:
            try:
                opened = self.run_dir.open(args, args.resume, args.overwrite)
            except (ValueError, FileNotFoundError) as e:
                opened = e
        opened = broadcast_object(opened, info)
        if isinstance(opened, Exception):
            raise opened
        resume_from = opened
        self.watch.checkpoint = resume_from
        resume_state = ckpt.load_training_state(resume_from) if resume_from else None
        self.log_records = MetricsLogger(os.path.join(args.output_dir, "metrics.jsonl"),
                                         os.path.join(args.output_dir, "tensorboard") if args.tensorboard else None,
                                         enabled=info.is_main,
                                         resumed_at=resume_state["step"] if resume_state else None)

        first_data = args.data if args.phase1_steps else args.data_phase2
        self.tokenizer_dir = first_data
        vocab_file = os.path.join(first_data, "vocab.txt")
        vocab_tokens = read_vocab(vocab_file) if os.path.isfile(vocab_file) else None
        self.phases = build_phases(args, info, vocab_tokens)
        max_len = max(ph.data.max_seq_len for ph in self.phases)
        vocab_size = max(ph.data.vocab_size for ph in self.phases)

        # The same initial weights on every rank (FSDP shards them without a broadcast) ...
        ckpt.seed_everything(args.seed)
        from bertfast.model.task_models import BertForPreTraining
        if resume_from:
            model = BertForPreTraining.from_pretrained(resume_from)
        else:
            config = build_config(args, vocab_size, max_len)
            model = (BertForPreTraining.from_pretrained(args.init_checkpoint, config=config)
                     if args.init_checkpoint else BertForPreTraining(config))
        if args.execution == REFERENCE:
            model.bert.execution = REFERENCE
        self.config = model.config
        # ... and a different dropout stream on each rank.
        ckpt.seed_everything(args.seed + 1_000_003 * info.rank)
        if args.cuda_graphs:
            graphs.check_supported(self.device, info.world_size, args.optimizer, self.precision, args.compile,
                                   args.execution)
        self.raw_model = model.to(self.device)
        self.model = wrap_model(self.raw_model, args, info)
        self.forward_model = torch.compile(self.model) if args.compile else self.model
        self.optimizer = pretrain_optimizer(self.model, args, self.precision)
        self.total_steps = sum(ph.steps for ph in self.phases)
        schedule = warmup_linear_decay(self.optimizer, args.warmup_steps, self.total_steps)
        if args.cuda_graphs:
            self.train_step = graphs.GraphedTrainStep(self.model, self.optimizer, schedule, self.device,
                                                      self.precision, args.max_grad_norm,
                                                      skip_nonfinite=args.on_nonfinite == "skip")
        else:
            # Packed batches were checked by the loader: the model checks values on the device.
            self.train_step = TrainStep(self.model, self.optimizer, schedule, self.device, self.precision,
                                        args.max_grad_norm, self._no_sync if info.distributed else None,
                                        skip_nonfinite=args.on_nonfinite == "skip", device_checks=args.static_shapes)
        self.peak = mfu.peak_bf16_flops(self.device)
        self.step = 0
        if resume_state:
            self._load_training_state(resume_state)

        n_params = self.raw_model.num_parameters()
        accum = ", ".join(f"phase {ph.index}: seq {ph.data.max_seq_len}, {ph.steps} steps, global batch "
                          f"{ph.spec.global_batch_size} = {ph.spec.micro_batch_size} x {ph.spec.accumulation_steps}"
                          f" accum x {info.world_size} rank(s)" for ph in self.phases)
        self.say(f"[pretrain] model: {n_params / 1e6:.2f}M parameters (L={self.config.num_hidden_layers} "
                 f"H={self.config.hidden_size} A={self.config.num_attention_heads} V={self.config.vocab_size}), "
                 f"{args.execution} path, device {self.device}, {self.precision}, optimizer {args.optimizer} "
                 f"lr {args.lr:g} warm-up {args.warmup_steps}"
                 + (", CUDA graphs" if args.cuda_graphs else ", static shapes (packed)" if args.static_shapes else ""))
        self.say(f"[pretrain] {accum}")
        if resume_from:
            self.say(f"[pretrain] resumed from {resume_from} at step {self.step}")

    # ------------------------------------------------------------------ checkpoints
    def _model_state_for_saving(self):
        """(model on CPU to save_pretrained, optimizer state dict); FSDP gathers full states on rank 0."""
        if not self.args.fsdp:
            return self.raw_model, graphs.host_lrs(self.optimizer.state_dict())
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd = get_model_state_dict(self.model, options=opts)
        osd = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
        if not self.info.is_main:
            return None, None
        from bertfast.model.task_models import BertForPreTraining
        with torch.device("meta"):
            copy = BertForPreTraining(self.config)
        copy = copy.to_empty(device="cpu")
        copy.load_state_dict(msd, strict=False)
        copy.tie_weights()
        return copy, osd

    def save_checkpoint(self) -> Optional[str]:
        args, info = self.args, self.info
        rng = gather_objects(ckpt.capture_rng_state(self.device), info)
        model_to_save, optim_state = self._model_state_for_saving()
        path = None
        if info.is_main:
            phase = self._phase_of(max(self.step - 1, 0))
            state = {"step": self.step, "optimizer": optim_state, **self.train_step.state_dict(),
                     "rng": rng, "world_size": info.world_size,
                     "data": {"phase": phase.index, "phase_step": self.step - phase.start,
                              "samples_seen_in_phase": (self.step - phase.start) * phase.spec.global_batch_size},
                     "args": args.to_dict()}

            def tokenizer_files(tmp: str) -> None:
                for name in TOKENIZER_FILES:
                    src = os.path.join(self.tokenizer_dir, name)
                    if os.path.isfile(src):
                        shutil.copyfile(src, os.path.join(tmp, name))

            summary = {"step": self.step, "total_steps": self.total_steps, **state["data"],
                       "world_size": info.world_size, "time": time.time()}
            path = ckpt.save_training_checkpoint(self.ckpt_dir, self.step, model_to_save, state, summary,
                                                 args.keep_last, tokenizer_files, self.run_dir.run_id)
        info.barrier()
        path = broadcast_object(path, info)
        self.watch.checkpoint = path
        return path

    def _load_training_state(self, state: Dict[str, Any]) -> None:
        # This run's hyper-parameters, not the checkpoint's: a resumed run may change them (the
        # moments, step counts and schedule position come from the checkpoint).
        hyper = [{k: g[k] for k in ("weight_decay", "betas", "eps") if k in g} for g in self.optimizer.param_groups]
        if self.args.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"],
                                     options=StateDictOptions(full_state_dict=True))
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        for group, own in zip(self.optimizer.param_groups, hyper):
            group.update(own)
        self.train_step.load_state_dict(state)
        schedule = self.train_step.scheduler  # its lambda is this run's (warm-up, steps); its base rate too:
        schedule.base_lrs = [self.args.lr] * len(self.optimizer.param_groups)
        for group, rate in zip(self.optimizer.param_groups, schedule.lr_lambdas):
            group["initial_lr"] = self.args.lr
            group["lr"] = self.args.lr * rate(schedule.last_epoch)
        schedule._last_lr = [group["lr"] for group in self.optimizer.param_groups]  # what get_last_lr() reports
        self.step = int(state["step"])
        rngs = state["rng"]
        if state.get("world_size") != self.info.world_size:
            self.say(f"[pretrain] warning: checkpoint written by {state.get('world_size')} rank(s), resuming on "
                     f"{self.info.world_size}: data order is kept, dropout RNG streams are not")
        ckpt.restore_rng_state(rngs[self.info.rank % len(rngs)], self.device)

    # ------------------------------------------------------------------ helpers
    def _phase_of(self, step: int) -> Phase:
        for ph in self.phases:
            if step < ph.end:
                return ph
        return self.phases[-1]

    def _to_device(self, mb: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        nb = self.device.type == "cuda"
        return {k: v.to(self.device, non_blocking=nb) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}

    def _forward(self, mb: Dict[str, torch.Tensor], phase: Phase, **kwargs: Any):
        extra = {} if phase.max_predictions is None else {"max_predictions_per_seq": phase.max_predictions}
        return self.train_step.forward(self.forward_model, mb, **extra, **kwargs)

    def _no_sync(self):
        return _fsdp_no_sync(self.model) if self.args.fsdp else self.model.no_sync()

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, phase: Phase) -> Optional[Dict[str, float]]:
        if phase.eval_batches is None:
            return None
        was_training = self.raw_model.training
        self.model.eval()
        n_avail = max(1, int(len(phase.eval_batches.data) // phase.eval_batches.spec.global_batch_size))
        sums = RunningSums(("loss", "mlm_loss", "mlm_correct", "predictions", "nsp_correct", "sequences"),
                           self.device)
        for j in range(self.info.rank, min(self.args.eval_batches, n_avail), self.info.world_size):
            mb = self._to_device(phase.eval_batches.micro_batches(j)[0])
            out = self._forward(mb, phase, return_logits=False)  # the loss and counts only: no full logits
            b = (sequence_lengths(mb) > 0).sum()
            sums.add(loss=out.loss * b, mlm_loss=out.mlm_loss * b, mlm_correct=out.mlm_num_correct,
                     predictions=out.mlm_num_predictions, nsp_correct=_nsp_correct(out, mb), sequences=b)
        total = sums.read(self._sum_over_ranks)
        self.model.train(was_training)
        n = max(total["sequences"], 1.0)
        return {"loss": total["loss"] / n, "mlm_loss": total["mlm_loss"] / n,
                "mlm_acc": total["mlm_correct"] / max(total["predictions"], 1.0),
                "nsp_acc": total["nsp_correct"] / n, "sequences": int(total["sequences"])}

    def _sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(values, self.info)

    # ------------------------------------------------------------------ training
    def train(self) -> RunResult:
        args, info = self.args, self.info
        result = RunResult(output_dir=args.output_dir)
        self.stop_request.install()
        stop_at = min(self.total_steps, args.stop_at_step) if args.stop_at_step else self.total_steps
        if any_rank(self.stop_request.requested, info):  # a signal during the set-up: no step taken, nothing lost
            self.say(f"[pretrain] stopped by signal before step {self.step + 1}; resume with --resume")
            result.stopped_early = result.stopped_by_signal = True
            stop_at = self.step
        bar = None
        if info.is_main and not args.no_progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=self.total_steps, initial=self.step, desc="pretrain", unit="step", dynamic_ncols=True)

        def batches_for(step: int):
            ph = self._phase_of(step)
            return ph.batches.micro_batches(step - ph.start)

        prefetch = (Prefetcher(batches_for, self.step, depth=args.prefetch, pin_memory=self.device.type == "cuda")
                    if args.prefetch > 0 and self.step < stop_at else None)
        window = _Window(RunningSums(self.WINDOW, self.device))
        last_phase = None
        self.model.train()
        try:
            while self.step < stop_at:
                phase = self._phase_of(self.step)
                if last_phase is not None and phase.index != last_phase:
                    self.say(f"[pretrain] phase {phase.index}: sequence length {phase.data.max_seq_len}")
                last_phase = phase.index
                micro = prefetch.get(self.step) if prefetch is not None else batches_for(self.step)
                micro = [self._to_device(mb) for mb in micro]
                done = self.train_step(micro, lambda mb: self._forward(mb, phase))
                window.add(done, micro)
                self.step += 1
                self.watch.observe(self.step, done)
                if bar is not None:
                    bar.update(1)
                # A log window never straddles two phases (their sequence lengths differ). What
                # reads values back first makes sure the steps so far were finite.
                if self.step % args.log_every == 0 or self.step in (stop_at, phase.end):
                    self._log_window(window, phase, done, result, bar)
                    self._check_finite()
                if args.parity_every and self.step % args.parity_every == 0:
                    self._check_finite()
                    self._check_parity(micro[0], result)
                if args.eval_every and (self.step % args.eval_every == 0 or self.step == self.total_steps):
                    self._check_finite()
                    self._evaluate(phase, result)
                stop_now = any_rank(self.stop_request.requested, info)
                if ((args.save_every and self.step % args.save_every == 0) or self.step in (stop_at, self.total_steps)
                        or stop_now):
                    self._check_finite(parameters=True)
                    result.checkpoint = self.save_checkpoint()
                if stop_now:
                    self.say(f"[pretrain] stopped by signal after step {self.step}; resume with --resume")
                    result.stopped_early = result.stopped_by_signal = True
                    break
        finally:
            if prefetch is not None:
                prefetch.close()
            if bar is not None:
                bar.close()
        result.final_step = self.step
        if self.step < self.total_steps:
            result.stopped_early = True
        return result

    def _check_finite(self, parameters: bool = False) -> None:
        """Stop if a step so far was not finite (and, before a checkpoint, if a parameter is not)."""
        self.watch.check(self.raw_model if parameters else None, self.step,
                         lambda value: all_reduce_max(value, self.info))

    def _log_window(self, window: _Window, phase: Phase, done: StepResult, result: RunResult, bar) -> None:
        """Reduce the window's sums over ranks (the one host sync of the window) and log them."""
        info = self.info
        total = window.sums.read(self._sum_over_ranks)
        per_step = (all_reduce_sum(torch.stack(window.losses), info) / info.world_size).tolist()
        for k, value in enumerate(per_step):
            result.losses[self.step - len(per_step) + 1 + k] = value
        elapsed = time.perf_counter() - window.t0
        steps = info.world_size * window.steps  # the losses are per-rank means of each step
        grad_norm = float(done.grad_norm)
        record = {"type": "train", "step": self.step, "phase": phase.index, "seq_len": phase.data.max_seq_len,
                  "loss": total["loss"] / steps, "mlm_loss": total["mlm_loss"] / steps,
                  "nsp_loss": total["nsp_loss"] / steps,
                  "mlm_acc": total["mlm_correct"] / max(total["predictions"], 1.0),
                  "nsp_acc": total["nsp_correct"] / max(total["sequences"], 1.0),
                  "lr": done.lr, "grad_norm": grad_norm, "tokens_per_s": total["tokens"] / elapsed,
                  "seq_per_s": total["sequences"] / elapsed, "step_time_s": elapsed / window.steps}
        work = mfu.training_step_flops(mfu.bert_forward_flops_from_counts(
            self.config, total["tokens"], total["sum_len_sq"], total["sequences"], "pretraining",
            total["predictions"]))
        record["tflops_per_s"] = work / elapsed / 1e12
        record["mfu"] = mfu.mfu(work, elapsed, self.peak * info.world_size) if self.peak else None
        if self.watch.skip:
            record["skipped_steps"] = self.watch.skipped
        self.log_records.log(record)
        mfu_text = "n/a" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%"
        if bar is not None:
            bar.set_postfix(loss=f"{record['loss']:.3f}", mlm=f"{record['mlm_acc']:.2f}",
                            nsp=f"{record['nsp_acc']:.2f}", tok_s=f"{record['tokens_per_s']:.0f}", mfu=mfu_text)
        elif info.is_main:
            print(f"step {self.step}/{self.total_steps} loss {record['loss']:.4f} mlm_acc {record['mlm_acc']:.3f} "
                  f"nsp_acc {record['nsp_acc']:.3f} lr {done.lr:.3g} gnorm {grad_norm:.3f} "
                  f"tok/s {record['tokens_per_s']:.0f} seq/s {record['seq_per_s']:.1f} MFU {mfu_text}", flush=True)
        window.reset()

    def _check_parity(self, batch: Dict[str, torch.Tensor], result: RunResult) -> None:
        if self.args.fsdp:
            if self.step == self.args.parity_every:
                self.say("[parity] skipped under --fsdp: the reference needs whole (unsharded) "
                         "parameters; run the parity check without --fsdp")
            return
        report = parity.check_during_training(self.raw_model, batch, self.step, self.args.parity_threshold,
                                              self.args.parity_strict, self.say,
                                              lambda worst: all_reduce_max(worst, self.info))
        result.parity.append(report)
        self.log_records.log(report)

    def _evaluate(self, phase: Phase, result: RunResult) -> None:
        ev = self.evaluate(phase)
        if ev is None:
            return
        ev.update(type="eval", step=self.step, phase=phase.index)
        result.evals.append(ev)
        self.log_records.log(ev)
        self.say(f"[eval] step {self.step}: loss {ev['loss']:.4f} mlm_acc {ev['mlm_acc']:.3f} "
                 f"nsp_acc {ev['nsp_acc']:.3f} ({ev['sequences']} held-out sequences)")

    # ------------------------------------------------------------------ the end
    def finish(self, result: RunResult) -> None:
        self.log_records.close()
        if self.info.is_main and not self.args.no_plot:
            png = plot_loss_curve(os.path.join(self.args.output_dir, "metrics.jsonl"),
                                  os.path.join(self.args.output_dir, "loss.png"))
            if png:
                self.say(f"[pretrain] loss curve: {png}")

    def close(self) -> None:
        """Whatever happened: close the records and unlock the output directory."""
        if self.log_records is not None:
            self.log_records.close()
        self.run_dir.release()


def _nsp_correct(out, mb: Dict[str, torch.Tensor]) -> torch.Tensor:
    return (out.seq_relationship_logits.detach().argmax(-1) == mb["next_sentence_label"]).sum()


class _Window:
    """A log window: sums of the steps since the last log line, their per-step losses and start time."""

    def __init__(self, sums: RunningSums):
        self.sums = sums
        self.reset()

    def add(self, done: StepResult, micro: List[Dict[str, torch.Tensor]]) -> None:
        count = len(micro)
        for out, mb in zip(done.outputs, micro):
            lengths = sequence_lengths(mb).double()
            self.sums.add(loss=out.loss.detach().double() / count, mlm_loss=out.mlm_loss.detach() / count,
                          nsp_loss=out.nsp_loss.detach() / count,
                          mlm_correct=out.mlm_num_correct, nsp_correct=_nsp_correct(out, mb),
                          tokens=lengths.sum(), sum_len_sq=(lengths ** 2).sum(),
                          predictions=(mb["labels"] != IGNORE_INDEX).sum(), sequences=(lengths > 0).sum())
        self.losses.append(done.loss)
        self.steps += 1

    def reset(self) -> None:
        self.sums.reset()
        self.losses: List[torch.Tensor] = []
        self.steps = 0
        self.t0 = time.perf_counter()


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


# ============================================================================ entry points
def run(args: PretrainConfig) -> RunResult:
    """Pre-train with a configuration (``parse_args`` or ``PretrainConfig``); returns the losses and evaluations."""
    if args.threads:
        torch.set_num_threads(args.threads)
    stop = StopRequest().install()  # first: a SIGTERM during the set-up still ends with exit 75
    info = init_distributed(args.device)
    given = args
    try:
        log = (lambda m: print(m, flush=True)) if info.is_main else (lambda m: None)
        if args.demo:
            args = prepare_demo_data(args, info, log)
        args = size_micro_batches(resolve_steps(args), info, log)
        trainer = Pretrainer(args, info, stop)
        try:
            with library_progress_bars(info.is_main and not args.no_progress):
                trainer.setup()
                t0 = time.time()
                result = trainer.train()
                trainer.finish(result)
        finally:
            trainer.close()
        if info.is_main:
            records = read_jsonl(os.path.join(args.output_dir, "metrics.jsonl"))
            train = [r for r in records if r.get("type") == "train"]
            if train:
                last = train[-1]
                tok_s = sum(r["tokens_per_s"] for r in train[-5:]) / len(train[-5:])
                last_mfu = last.get("mfu")
                print(f"[pretrain] done: step {result.final_step}/{trainer.total_steps} in "
                      f"{format_duration(time.time() - t0)}; last loss {last['loss']:.4f} (first logged "
                      f"{train[0]['loss']:.4f}); {tok_s:.0f} real tokens/s; MFU "
                      f"{'n/a (no GPU peak known)' if last_mfu is None else f'{100 * last_mfu:.1f}%'}", flush=True)
                if args.demo and result.final_step == trainer.total_steps:
                    print(compare_with_readme(given, demo_environment(info.device), train[0]["loss"], last["loss"]),
                          flush=True)
            if result.parity:
                worst = max(p["max_rel_diff_all_ranks"] for p in result.parity)
                print(f"[pretrain] parity: {len(result.parity)} check(s), worst relative difference "
                      f"{worst:.2e} (threshold {args.parity_threshold:g})", flush=True)
            if result.checkpoint:
                print(f"[pretrain] checkpoint: {result.checkpoint}", flush=True)
        return result
    finally:
        info.shutdown()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line; the exit code says how the run ended (``training.exits``)."""
    try:
        args = parse_args(argv)
    except ValueError as e:
        print(f"bertfast pretrain: error: {e}", file=sys.stderr)
        return exits.USAGE
    if args.demo:
        print("[pretrain] demonstration run: a small BERT on the embedded corpus (no --data given, or --demo)",
              flush=True)
    return exits.run_command("bertfast pretrain", lambda: run(args).stopped_by_signal)


if __name__ == "__main__":
    sys.exit(main())
