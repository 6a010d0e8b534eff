"""``bertfast finetune``: fine-tune a (pre-trained) BERT on a downstream task.

Tasks (``--task``) and their heads, inputs and metrics:

  classification        BertForSequenceClassification; CSV/TSV/JSONL with one or two text
                        columns and a label column; accuracy, F1 (binary, else macro), Matthews
  regression            BertForSequenceClassification with one output (MSE); Pearson, Spearman
  token-classification  BertForTokenClassification; CoNLL; the label sits on each word's first
                        word piece; entity-level F1 (exact chunks), token accuracy
  qa                    BertForQuestionAnswering; SQuAD v1.1 / v2.0 JSON; long contexts in
                        windows of --max-seq-len moving by --doc-stride; EM / F1, and for v2.0
                        "no answer" when null score - best span score > --null-score-diff-threshold
  multiple-choice       BertForMultipleChoice; SWAG-style CSV (context, start of the second
                        sentence, one column per ending, label); accuracy

The model comes from a local checkpoint directory (``--model``: config.json, weights and
vocab.txt, e.g. a ``bertfast pretrain`` checkpoint or a Hugging Face BERT directory), or is
built fresh from ``--preset`` with ``--vocab`` (tests). Defaults follow the paper's GLUE
settings: batch 32, lr 3e-5 (the paper picks among 5e-5, 4e-5, 3e-5 and 2e-5), 3 epochs, 10%
linear warm-up then linear decay, AdamW with weight decay 0.01 (none on biases and LayerNorm),
dropout 0.1; ``--recipe glue|squad-v1.1|squad-v2.0|swag`` takes the paper's settings for that
benchmark. Every option is a typed, checked field of ``training.config.FinetuneConfig``.

The run directory (``--output-dir``) holds run_config.json (the resolved settings), metrics.jsonl,
a checkpoint at the end of every epoch (and every ``--save-every`` steps; SIGTERM or Ctrl-C
saves one and stops) under checkpoints/, and at the end the fine-tuned model in HF layout with
the tokenizer files, eval_results.json and, for SQuAD, predictions.json. ``--output-dir DIR
--resume`` continues a stopped run exactly. ``--parity-every N`` checks the fast path against the
reference on training batches.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from bertfast import parity
from bertfast.model.config import BertConfig
from bertfast.data import metrics as M
from bertfast.data.tasks import (DataFormatError, SquadExample, column, encode_pair, is_json_lines, label_names,
                                 pad_batch, qa_features, qa_predictions, read_conll, read_squad, read_table,
                                 text_column, token_classification_features)
from bertfast.data.tokenization import WordPiece
from bertfast.padding import pack_batch
from bertfast.training import checkpoints as ckpt
from bertfast.training import exits
from bertfast.training.config import FinetuneConfig, parse_overrides
from bertfast.training.nonfinite import NonFiniteWatch
from bertfast.training.optim import build_optimizer, warmup_linear_decay
from bertfast.training.precision import autocast_context, resolve_precision
from bertfast.training.records import MetricsLogger, library_progress_bars
from bertfast.training.rundir import RunDirectory
from bertfast.training.signals import StopRequest
from bertfast.training.step import TrainStep

FLOAT32_MAX = float(np.finfo(np.float32).max)
TEXT_A_CANDIDATES = ("sentence1", "sentence", "text", "question1", "premise", "text_a", "question")
TEXT_B_CANDIDATES = ("sentence2", "question2", "hypothesis", "text_b")
# Pairs as GLUE (and its Hugging Face export) names them, checked first: QNLI's (question,
# sentence) would otherwise be read as "sentence" alone.
TEXT_PAIRS = (("sentence1", "sentence2"), ("question1", "question2"), ("premise", "hypothesis"),
              ("question", "sentence"), ("text_a", "text_b"))


def _names(arg: Optional[str]) -> Optional[List[str]]:
    """--labels "a, b" as ["a", "b"]."""
    return [x.strip() for x in arg.split(",")] if arg else None


# =========================================================================== tasks
class Task:
    """Reads files, builds features, and evaluates predictions for one kind of head."""

    model_class_name = ""
    main_metric = ""

    def __init__(self, args: FinetuneConfig, tok: WordPiece, precision: str):
        self.args, self.tok, self.precision = args, tok, precision

    def config_overrides(self) -> Dict[str, Any]:
        return {}

    def load(self, path: str, train: bool) -> Tuple[Any, List[Dict[str, Any]]]:
        """(examples, features) of a file."""
        raise NotImplementedError

    def evaluate(self, model, examples, features) -> Dict[str, Any]:
        raise NotImplementedError

    # shared: logits of every feature, batched, in eval mode
    @torch.no_grad()
    def predict(self, model, features: List[Dict[str, Any]], keys: Sequence[str], outputs: Sequence[str]):
        model.eval()
        out: Dict[str, List[np.ndarray]] = {k: [] for k in outputs}
        bs = self.args.eval_batch_size
        device = next(model.parameters()).device
        for i in range(0, len(features), bs):
            batch = pad_batch(features[i:i + bs], self.tok.pad_id, keys=keys)
            batch = {k: v.to(device) for k, v in batch.items()}
            with autocast_context(device, self.precision):
                res = model(**batch)
            for k in outputs:
                out[k].append(getattr(res, k).float().cpu().numpy())
        model.train()
        return {k: np.concatenate(v) if v else np.zeros(0) for k, v in out.items()}


class SequenceTask(Task):
    model_class_name = "BertForSequenceClassification"

    def __init__(self, args, tok, precision):
        super().__init__(args, tok, precision)
        self.regression = args.task == "regression"
        self.main_metric = args.metric or ("pearson_spearman" if self.regression else "accuracy")
        self.labels: Optional[List[str]] = _names(args.labels)

    def _columns(self, row: Dict[str, Any], path: str, lineno: int) -> Tuple[str, Optional[str], str]:
        if self.args.text_a is None:
            pair = next(((a, b) for a, b in TEXT_PAIRS if a in row and b in row), None)
            if pair is not None:
                return pair[0], self.args.text_b or pair[1], self.args.label_column
        a = self.args.text_a or next((c for c in TEXT_A_CANDIDATES if c in row), None)
        if a is None:
            raise DataFormatError(path, lineno, f"no text column found (tried {', '.join(TEXT_A_CANDIDATES)}); "
                                                f"name it with --text-a")
        b = self.args.text_b
        if b is None and self.args.text_a is None:
            b = next((c for c in TEXT_B_CANDIDATES if c in row), None)
        return a, b, self.args.label_column

    def load(self, path: str, train: bool):
        rows = read_table(path, header=not self.args.no_header)
        if not rows:
            raise DataFormatError(path, None, "no examples")
        a_col, b_col, label_col = self._columns(rows[0][1], path, rows[0][0])
        raw: List[Tuple[int, str, Optional[str], Any]] = []
        for lineno, row in rows:
            text_a = text_column(row, a_col, path, lineno)
            text_b = text_column(row, b_col, path, lineno) if b_col else None
            label = column(row, label_col, path, lineno)
            raw.append((lineno, text_a, text_b, label))
        if self.regression:
            labels = []
            for lineno, _, _, label in raw:
                try:
                    if isinstance(label, (bool, list, dict)):
                        raise TypeError  # float(true) would be 1.0
                    value = float(label)
                except (TypeError, ValueError):
                    raise DataFormatError(path, lineno, f"regression label {label!r} is not a number") from None
                # "nan" and "inf" parse, and 1e39 is inf in float32 (the targets' dtype): each would spoil the loss
                if not abs(value) <= FLOAT32_MAX:
                    raise DataFormatError(path, lineno, f"regression label {label!r} is not a finite float32 number "
                                                        f"(at most {FLOAT32_MAX:.4g} in magnitude)")
                labels.append(value)
        else:
            # " 1" is "1"; true next to 1 is an error (see label_names)
            names = label_names([(r[0], r[3]) for r in raw], path)
            if self.labels is None:
                if not train:
                    raise RuntimeError("the label set comes from the training file; load it first")
                self.labels = sorted(set(names), key=_label_sort_key)
            index = {name: i for i, name in enumerate(self.labels)}
            labels = []
            for (lineno, _, _, label), name in zip(raw, names):
                if name not in index:
                    raise DataFormatError(path, lineno, f"label {label!r} is not one of the known labels "
                                                        f"{self.labels}")
                labels.append(index[name])
        features = []
        for (lineno, a, b, _), y in zip(raw, labels):
            f = encode_pair(self.tok, a, b, self.args.max_seq_len)
            f["labels"] = y
            features.append(f)
        return raw, features

    def config_overrides(self) -> Dict[str, Any]:
        if self.regression:
            return {"id2label": {0: "score"}, "label2id": {"score": 0}, "problem_type": "regression"}
        return {"id2label": dict(enumerate(self.labels)), "label2id": {n: i for i, n in enumerate(self.labels)},
                "problem_type": "single_label_classification"}

    def evaluate(self, model, examples, features):
        out = self.predict(model, features, ("input_ids", "token_type_ids"), ("logits",))["logits"]
        gold = np.array([f["labels"] for f in features])
        if self.regression:
            return M.regression_metrics(out[:, 0], gold)
        return M.classification_metrics(out.argmax(-1), gold, len(self.labels))


class TokenTask(Task):
    model_class_name = "BertForTokenClassification"
    main_metric = "f1"

    def __init__(self, args, tok, precision):
        super().__init__(args, tok, precision)
        self.labels: Optional[List[str]] = _names(args.labels)
        # Only names the user gave map tag ids (JSON lines): a label set sorted from the training
        # file has no relation to the ids of the dataset that wrote them.
        self.tag_names = _names(args.labels)

    def load(self, path: str, train: bool):
        sentences = read_conll(path, self.tag_names, self.args.label_column)
        if not sentences:
            raise DataFormatError(path, None, "no sentences")
        one_line = is_json_lines(path)  # a sentence is one line; in CoNLL text, one token a line
        if self.labels is None:
            tags = sorted({t for _, _, ts in sentences for t in ts}, key=lambda t: (t != "O", t[2:], t))
            self.labels = tags
        index = {t: i for i, t in enumerate(self.labels)}
        features = []
        for lineno, words, tags in sentences:
            for k, t in enumerate(tags):
                if t not in index:
                    raise DataFormatError(path, lineno if one_line else lineno + k,
                                          f"tag {t!r} is not one of the known tags {self.labels}")
            features.append(token_classification_features(self.tok, words, [index[t] for t in tags],
                                                          self.args.max_seq_len))
        return sentences, features

    def config_overrides(self):
        return {"id2label": dict(enumerate(self.labels)), "label2id": {n: i for i, n in enumerate(self.labels)}}

    def evaluate(self, model, examples, features):
        logits = self.predict(model, features, ("input_ids", "token_type_ids"), ("logits",))["logits"]
        pred_tags, gold_tags = [], []
        outside = "O" if "O" in self.labels else self.labels[0]
        for (_, _, tags), f, lg in zip(examples, features, logits):
            best = lg.argmax(-1)
            words = [self.labels[int(best[p])] for p in f["_word_starts"]]
            words += [outside] * (f["_num_words"] - len(words))  # words cut by truncation
            pred_tags.append(words)
            gold_tags.append(tags)
        return M.entity_f1(pred_tags, gold_tags)


class QATask(Task):
    model_class_name = "BertForQuestionAnswering"
    main_metric = "f1"

    def __init__(self, args, tok, precision):
        super().__init__(args, tok, precision)
        self.version_2 = args.version_2  # None: v2.0 when the training file has unanswerable questions

    def load(self, path: str, train: bool):
        examples = read_squad(path)
        if not examples:
            raise DataFormatError(path, None, "no questions")
        if self.version_2 is None and any(e.is_impossible for e in examples):
            self.version_2 = True
        feats = qa_features(self.tok, examples, self.args.max_seq_len, self.args.doc_stride,
                            self.args.max_query_length)
        features = []
        for f in feats:
            d = f.as_inputs()
            d["_qa"] = f
            features.append(d)
        return examples, features

    def config_overrides(self):
        return {"id2label": {0: "start", 1: "end"}, "label2id": {"start": 0, "end": 1}}

    def evaluate(self, model, examples: List[SquadExample], features):
        out = self.predict(model, features, ("input_ids", "token_type_ids"), ("start_logits", "end_logits"))
        preds, diffs = qa_predictions(examples, [f["_qa"] for f in features], out["start_logits"],
                                      out["end_logits"], self.args.n_best, self.args.max_answer_length,
                                      bool(self.version_2), self.args.null_score_diff_threshold)
        golds = {e.qid: ([a for a, _ in e.answers] if not e.is_impossible else [""]) for e in examples}
        result = M.squad_em_f1(preds, golds)
        result["_predictions"] = preds
        return result


class MultipleChoiceTask(Task):
    model_class_name = "BertForMultipleChoice"
    main_metric = "accuracy"

    def load(self, path: str, train: bool):
        rows = read_table(path, header=not self.args.no_header)
        if not rows:
            raise DataFormatError(path, None, "no examples")
        choices = self.args.choice_columns.split(",")
        examples, features = [], []
        for lineno, row in rows:
            context = text_column(row, self.args.context_column, path, lineno)
            start = text_column(row, self.args.question_column, path, lineno, required=False) or ""
            endings = [text_column(row, c, path, lineno) for c in choices]
            label = column(row, self.args.label_column, path, lineno)
            try:
                if isinstance(label, bool) or (isinstance(label, float) and not label.is_integer()):
                    raise TypeError  # int() would take true as 1 and 1.7 as 1
                y = int(label)
            except (TypeError, ValueError):
                raise DataFormatError(path, lineno, f"label {label!r} is not a choice index") from None
            if not 0 <= y < len(choices):
                raise DataFormatError(path, lineno, f"label {y} out of range for {len(choices)} choices")
            enc = [encode_pair(self.tok, context, f"{start} {e}".strip(), self.args.max_seq_len) for e in endings]
            features.append({"input_ids": [x["input_ids"] for x in enc],
                             "token_type_ids": [x["token_type_ids"] for x in enc], "labels": y})
            examples.append((lineno, y))
        return examples, features

    def config_overrides(self):
        return {}

    def evaluate(self, model, examples, features):
        logits = self.predict(model, features, ("input_ids", "token_type_ids"), ("logits",))["logits"]
        gold = np.array([f["labels"] for f in features])
        return {"accuracy": M.accuracy(logits.argmax(-1), gold)}


def _label_sort_key(label: str):
    try:
        return (0, float(label), label)
    except ValueError:
        return (1, 0.0, label)


def make_task(args: FinetuneConfig, tok: WordPiece, precision: str) -> Task:
    return {"classification": SequenceTask, "regression": SequenceTask, "token-classification": TokenTask,
            "qa": QATask, "multiple-choice": MultipleChoiceTask}[args.task](args, tok, precision)


# =========================================================================== arguments
def parse_args(argv: Optional[Sequence[str]] = None) -> FinetuneConfig:
    """Flags over the JSON ``--config`` file over the saved run (``--resume``) over ``--recipe``
    over the defaults."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return FinetuneConfig.from_command_line(argv, FinetuneConfig.PROG, FinetuneConfig.DESCRIPTION,
                                            lambda given: given.get("recipe"))


# =========================================================================== run
def load_model(args: FinetuneConfig, task: Task, tok: WordPiece, resume_from: Optional[str] = None):
    import bertfast.model.task_models as task_models
    cls = getattr(task_models, task.model_class_name)
    overrides = parse_overrides(args.config_overrides)
    overrides.update(task.config_overrides())
    if resume_from:
        model = cls.from_pretrained(resume_from)
    elif args.model:
        model = cls.from_pretrained(args.model, **overrides)
    else:
        vocab_size = -(-tok.vocab_size // 8) * 8
        config = BertConfig.preset(args.preset, vocab_size=vocab_size, **overrides)
        model = cls(config)
    if model.config.vocab_size < tok.vocab_size:
        raise ValueError(f"the model's vocab_size {model.config.vocab_size} is smaller than the vocabulary "
                         f"({tok.vocab_size} word pieces)")
    if model.config.max_position_embeddings < args.max_seq_len:
        raise ValueError(f"--max-seq-len {args.max_seq_len} exceeds the model's max_position_embeddings "
                         f"({model.config.max_position_embeddings})")
    return model


class Finetuner:
    """One fine-tuning run: data, model and optimizer (``setup``), the step loop with logging,
    per-epoch evaluation and checkpoints (``train``), and the fine-tuned model (``finish``)."""

    def __init__(self, args: FinetuneConfig):
        args.check_runnable()
        self.args = args
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.precision = resolve_precision(args.precision, self.device)
        self.ckpt_dir = os.path.join(args.output_dir, "checkpoints")
        self.stop_request = StopRequest()
        self.say = print
        self.run_dir = RunDirectory(args.output_dir, self.ckpt_dir, self.say)
        self.watch = NonFiniteWatch(self.device, args.on_nonfinite == "skip", args.max_skipped_steps)
        self.log_records: Optional[MetricsLogger] = None
        self._order, self._order_epoch = None, None  # the current epoch's visiting order (_batch)

    def setup(self) -> None:
        args = self.args
        resume_from = self.run_dir.open(args, args.resume, args.overwrite)
        self.watch.checkpoint = resume_from
        self.tok = WordPiece.from_pretrained(args.vocab or args.model)
        self.task = make_task(args, self.tok, self.precision)
        _, self.train_features = self.task.load(args.train_file, train=True)
        self.eval_examples = self.eval_features = None
        if args.eval_file:
            self.eval_examples, self.eval_features = self.task.load(args.eval_file, train=False)
        self.keys = [k for k in self.train_features[0] if not k.startswith("_")]

        state = ckpt.load_training_state(resume_from) if resume_from else None
        ckpt.seed_everything(args.seed)
        self.model = load_model(args, self.task, self.tok, resume_from).to(self.device)
        self.model.train()
        self.optimizer = build_optimizer(self.model, "adamw", args.lr, args.weight_decay, eps=args.adam_eps)
        self.steps_per_epoch = math.ceil(len(self.train_features) / args.batch_size)
        self.total_steps = max(1, int(math.ceil(self.steps_per_epoch * args.epochs)))
        schedule = warmup_linear_decay(self.optimizer, int(round(args.warmup_fraction * self.total_steps)),
                                       self.total_steps)
        # Packed batches: labels checked on the host by the task's reader; the model checks values on the device.
        self.train_step = TrainStep(self.model, self.optimizer, schedule, self.device, self.precision,
                                    args.max_grad_norm, skip_nonfinite=args.on_nonfinite == "skip",
                                    device_checks=args.static_shapes)
        self.step = 0
        if state is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            self.train_step.load_state_dict(state)
            self.step = int(state["step"])
            ckpt.restore_rng_state(state["rng"], self.device)
        metrics_file = os.path.join(args.output_dir, "metrics.jsonl")
        self.log_records = MetricsLogger(metrics_file, resumed_at=self.step if state else None)
        self.history = list(self.log_records.previous)  # a resumed run's records so far
        self.say(f"[finetune] {args.task}: {len(self.train_features)} training features, {self.total_steps} steps "
                 f"({args.epochs:g} epochs of {self.steps_per_epoch}), model "
                 f"{self.model.num_parameters() / 1e6:.2f}M parameters, {self.device}, {self.precision}"
                 + (f"; resumed from {resume_from} at step {self.step}" if state else ""))

    def _batch(self, step: int) -> Dict[str, torch.Tensor]:
        """Step ``step``'s batch: epoch e visits the features in a permutation seeded by (seed, e)."""
        epoch, k = divmod(step, self.steps_per_epoch)
        if self._order_epoch != epoch:
            self._order = np.random.default_rng([self.args.seed, epoch]).permutation(len(self.train_features))
            self._order_epoch = epoch
        bs = self.args.batch_size
        chosen = [self.train_features[j] for j in self._order[k * bs:(k + 1) * bs]]
        batch = pad_batch(chosen, self.tok.pad_id, keys=self.keys)
        if self.args.static_shapes:  # the same shapes for a short last batch too
            longest = self.args.max_seq_len
            sequences = bs * (batch["input_ids"].shape[1] if batch["input_ids"].dim() == 3 else 1)  # x choices
            # slots: the sequences, then at most as many dummy ones for the tail
            batch = pack_batch(batch, sequences * longest, longest, slots=2 * sequences)
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def train(self) -> Dict[str, Any]:
        args = self.args
        stop_at = min(self.total_steps, args.stop_at_step or self.total_steps)
        self.stop_request.install()
        bar = None
        if not args.no_progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=self.total_steps, initial=self.step, desc="finetune", unit="step", dynamic_ncols=True)
        tell = bar.write if bar is not None else self.say
        losses: List[torch.Tensor] = []  # per step, on the device: read at the log interval
        logged = 0
        checks: List[Dict[str, Any]] = []
        metrics: Dict[str, Any] = {}
        checkpoint = None
        t0 = time.time()
        try:
            while self.step < stop_at:
                epoch = self.step // self.steps_per_epoch
                batch = self._batch(self.step)
                done = self.train_step([batch], lambda b: self.train_step.forward(self.model, b))
                self.step += 1
                self.watch.observe(self.step, done)
                losses.append(done.outputs[0].loss.detach().float())
                if bar is not None:
                    bar.update(1)
                # What reads values back first makes sure the steps so far were finite.
                if self.step % args.log_every == 0 or self.step == stop_at:
                    window = torch.stack(losses[logged:]).tolist()
                    logged = len(losses)
                    record = {"type": "train", "step": self.step, "epoch": epoch, "loss": float(np.mean(window)),
                              "lr": done.lr, "grad_norm": float(done.grad_norm)}
                    if self.watch.skip:
                        record["skipped_steps"] = self.watch.skipped
                    self._record(record)
                    if bar is not None:
                        bar.set_postfix(loss=f"{window[-1]:.4f}")
                    self.watch.check()
                if args.parity_every and self.step % args.parity_every == 0:
                    self.watch.check()
                    report = parity.check_during_training(self.model, batch, self.step, args.parity_threshold,
                                                          args.parity_strict, tell)
                    checks.append(report)
                    self.log_records.log(report)
                end_of_epoch = self.step % self.steps_per_epoch == 0 or self.step == self.total_steps
                if end_of_epoch and self.eval_features is not None:
                    self.watch.check()
                    metrics = self._evaluate(epoch + 1, tell)
                stop = self.stop_request.requested
                if not args.no_save and (end_of_epoch or stop or self.step == stop_at
                                         or (args.save_every and self.step % args.save_every == 0)):
                    self.watch.check(self.model, self.step)
                    checkpoint = self.watch.checkpoint = self.save_checkpoint()
                if stop:
                    tell(f"[finetune] stopped by signal after step {self.step}; resume with --resume")
                    break
        finally:
            if bar is not None:
                bar.close()
            self.log_records.close()
        if not metrics and self.eval_features is not None and self.step == self.total_steps:
            metrics = self._evaluate(math.ceil(args.epochs), tell)  # a finished run resumed: evaluate it again
        return {"eval": {k: v for k, v in metrics.items() if not k.startswith("_")}, "history": self.history,
                "parity": checks, "train_loss": torch.stack(losses).tolist() if losses else [],
                "output_dir": args.output_dir, "steps": self.step, "checkpoint": checkpoint,
                "stopped_early": self.step < self.total_steps, "stopped_by_signal": self.stop_request.requested,
                "main_metric": self.task.main_metric,
                "time_s": time.time() - t0, "_predictions": metrics.get("_predictions")}

    def _record(self, record: Dict[str, Any]) -> None:
        self.log_records.log(record)
        self.history.append(record)

    def _evaluate(self, epoch: int, tell) -> Dict[str, Any]:
        metrics = self.task.evaluate(self.model, self.eval_examples, self.eval_features)
        shown = {k: round(v, 4) for k, v in metrics.items() if not k.startswith("_") and isinstance(v, float)}
        self._record({"type": "eval", "step": self.step, "epoch": epoch, **shown})
        tell(f"[eval] epoch {epoch}: {self.task.main_metric} {metrics.get(self.task.main_metric, float('nan')):.4f} "
             f"{shown}")
        return metrics

    def save_checkpoint(self) -> str:
        state = {"step": self.step, "optimizer": self.optimizer.state_dict(), **self.train_step.state_dict(),
                 "rng": ckpt.capture_rng_state(self.device), "args": self.args.to_dict()}
        summary = {"step": self.step, "total_steps": self.total_steps, "epoch": self.step / self.steps_per_epoch,
                   "time": time.time()}
        return ckpt.save_training_checkpoint(self.ckpt_dir, self.step, self.model, state, summary,
                                             self.args.keep_last, self.tok.save, self.run_dir.run_id)

    def finish(self, result: Dict[str, Any]) -> None:
        """Save the fine-tuned model (HF layout), its tokenizer, the metrics and the predictions."""
        args, predictions = self.args, result.pop("_predictions")
        if args.no_save or result["stopped_early"]:
            return
        self.watch.check(self.model, self.step)
        self.model.save_pretrained(args.output_dir)
        self.tok.save(args.output_dir)
        with open(os.path.join(args.output_dir, "eval_results.json"), "w", encoding="utf-8") as f:
            json.dump({"task": args.task, "steps": self.step, **result["eval"]}, f, indent=2)
        if predictions is not None:
            with open(os.path.join(args.output_dir, "predictions.json"), "w", encoding="utf-8") as f:
                json.dump(predictions, f, indent=2)
        self.say(f"[finetune] saved the fine-tuned model to {args.output_dir}")


def run(args: FinetuneConfig) -> Dict[str, Any]:
    """Fine-tune with a configuration (``parse_args`` or ``FinetuneConfig``); returns {"eval": metrics,
    "history": [...], "train_loss": [...], "output_dir": ..., ...}."""
    trainer = Finetuner(args)
    try:
        with library_progress_bars(not args.no_progress):
            trainer.setup()
            result = trainer.train()
            trainer.finish(result)
    finally:
        trainer.run_dir.release()
    if result["eval"]:
        trainer.say(f"[finetune] final {result['main_metric']}: "
                    f"{result['eval'].get(result['main_metric'], float('nan')):.4f}")
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line; the exit code says how the run ended (``training.exits``)."""
    return exits.run_command("bertfast finetune", lambda: run(parse_args(argv))["stopped_by_signal"])


if __name__ == "__main__":
    sys.exit(main())
