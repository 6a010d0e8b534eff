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
built fresh from ``--preset`` with ``--vocab`` (tests). Defaults follow the paper: batch 32,
lr 3e-5 (the paper searches {5e-5, 3e-5, 2e-5}), 3 epochs, 10% linear warm-up then linear
decay, AdamW with weight decay 0.01 (none on biases and LayerNorm), dropout 0.1. The
fine-tuned model is saved in HF layout with the tokenizer files and the metrics.
``--parity-every N`` checks the fast path against the reference on training batches.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from bertfast import parity
from bertfast.config import BertConfig
from bertfast.data import metrics as M
from bertfast.data.tasks import (DataFormatError, SquadExample, column, encode_pair, pad_batch,
                                 qa_features, qa_predictions, read_conll, read_squad, read_table,
                                 token_classification_features)
from bertfast.data.tokenization import WordPiece
from bertfast.training.checkpoints import seed_everything
from bertfast.training.optim import build_optimizer, warmup_linear_decay
from bertfast.training.options import apply_config_file, parse_overrides
from bertfast.training.precision import autocast_context, resolve_precision
from bertfast.training.records import MetricsLogger
from bertfast.training.step import TrainStep

TASKS = ("classification", "regression", "token-classification", "qa", "multiple-choice")
TEXT_A_CANDIDATES = ("sentence1", "sentence", "text", "question1", "premise", "text_a", "question")
TEXT_B_CANDIDATES = ("sentence2", "question2", "hypothesis", "text_b")


# =========================================================================== tasks
class Task:
    """Reads files, builds features, and evaluates predictions for one kind of head."""

    model_class_name = ""
    main_metric = ""

    def __init__(self, args: argparse.Namespace, tok: WordPiece):
        self.args, self.tok = args, tok

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
            with autocast_context(device, self.args.resolved_precision):
                res = model(**batch)
            for k in outputs:
                out[k].append(getattr(res, k).float().cpu().numpy())
        model.train()
        return {k: np.concatenate(v) if v else np.zeros(0) for k, v in out.items()}


class SequenceTask(Task):
    model_class_name = "BertForSequenceClassification"

    def __init__(self, args, tok):
        super().__init__(args, tok)
        self.regression = args.task == "regression"
        self.main_metric = args.metric or ("pearson_spearman" if self.regression else "accuracy")
        self.labels: Optional[List[str]] = args.labels.split(",") if args.labels else None

    def _columns(self, row: Dict[str, Any], path: str, lineno: int) -> Tuple[str, Optional[str], str]:
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
            text_a = str(column(row, a_col, path, lineno))
            text_b = str(column(row, b_col, path, lineno)) if b_col else None
            label = column(row, label_col, path, lineno)
            raw.append((lineno, text_a, text_b, label))
        if self.regression:
            labels = []
            for lineno, _, _, label in raw:
                try:
                    labels.append(float(label))
                except (TypeError, ValueError):
                    raise DataFormatError(path, lineno, f"regression label {label!r} is not a number") from None
        else:
            if self.labels is None:
                if not train:
                    raise RuntimeError("the label set comes from the training file; load it first")
                found = sorted({str(r[3]) for r in raw}, key=_label_sort_key)
                self.labels = found
            index = {name: i for i, name in enumerate(self.labels)}
            labels = []
            for lineno, _, _, label in raw:
                if str(label) not in index:
                    raise DataFormatError(path, lineno, f"label {label!r} is not one of the known labels "
                                                        f"{self.labels}")
                labels.append(index[str(label)])
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

    def __init__(self, args, tok):
        super().__init__(args, tok)
        self.labels: Optional[List[str]] = args.labels.split(",") if args.labels else None

    def load(self, path: str, train: bool):
        sentences = read_conll(path)
        if not sentences:
            raise DataFormatError(path, None, "no sentences")
        if self.labels is None:
            tags = sorted({t for _, _, ts in sentences for t in ts}, key=lambda t: (t != "O", t[2:], t))
            self.labels = tags
        index = {t: i for i, t in enumerate(self.labels)}
        features = []
        for lineno, words, tags in sentences:
            for k, t in enumerate(tags):
                if t not in index:
                    raise DataFormatError(path, lineno + k, f"tag {t!r} is not one of the known tags {self.labels}")
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

    def load(self, path: str, train: bool):
        examples = read_squad(path)
        if not examples:
            raise DataFormatError(path, None, "no questions")
        if self.args.version_2 is None and any(e.is_impossible for e in examples):
            self.args.version_2 = True
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
                                      bool(self.args.version_2), self.args.null_score_diff_threshold)
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
            context = str(column(row, self.args.context_column, path, lineno))
            start = column(row, self.args.question_column, path, lineno, required=False) or ""
            endings = [str(column(row, c, path, lineno)) for c in choices]
            label = column(row, self.args.label_column, path, lineno)
            try:
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


def make_task(args, tok) -> Task:
    return {"classification": SequenceTask, "regression": SequenceTask, "token-classification": TokenTask,
            "qa": QATask, "multiple-choice": MultipleChoiceTask}[args.task](args, tok)


# =========================================================================== arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bertfast finetune", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", help="JSON file of options (keys = option names); flags override it")
    p.add_argument("--task", choices=TASKS, required=False)
    p.add_argument("--train-file")
    p.add_argument("--eval-file", help="evaluated after every epoch and at the end")
    g = p.add_argument_group("model")
    g.add_argument("--model", help="local checkpoint directory (config.json, weights, vocab.txt)")
    g.add_argument("--preset", help="build a fresh model of this size instead (needs --vocab)")
    g.add_argument("--vocab", help="vocab.txt (or a directory with one); default: the --model directory's")
    g.add_argument("--set", dest="config_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a BertConfig field, e.g. --set hidden_dropout_prob=0.0")
    g.add_argument("--output-dir", default=os.path.join("runs", "finetune"))
    g.add_argument("--no-save", action="store_true", help="do not write the fine-tuned model")
    g = p.add_argument_group("training")
    g.add_argument("--max-seq-len", type=int, default=128)
    g.add_argument("--batch-size", type=int, default=32)
    g.add_argument("--eval-batch-size", type=int, default=64)
    g.add_argument("--lr", type=float, default=3e-5)
    g.add_argument("--epochs", type=float, default=3.0)
    g.add_argument("--warmup-fraction", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-eps", type=float, default=1e-6)
    g.add_argument("--max-grad-norm", type=float, default=1.0)
    g.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto")
    g.add_argument("--device", choices=("cuda", "cpu"), default=None)
    g.add_argument("--seed", type=int, default=42)
    g.add_argument("--log-every", type=int, default=50)
    g.add_argument("--no-progress", action="store_true")
    g = p.add_argument_group("classification / regression / multiple choice columns")
    g.add_argument("--text-a", help="first text column (default: sentence1, sentence, text, ...)")
    g.add_argument("--text-b", help="second text column of sentence pairs (default: sentence2, ... if present)")
    g.add_argument("--label-column", default="label")
    g.add_argument("--labels", help="comma-separated label names in id order (default: sorted from training)")
    g.add_argument("--metric", help="metric that selects nothing but is printed first (default per task)")
    g.add_argument("--no-header", action="store_true", help="CSV/TSV without a header: columns are 0,1,2,...")
    g.add_argument("--context-column", default="sent1")
    g.add_argument("--question-column", default="sent2")
    g.add_argument("--choice-columns", default="ending0,ending1,ending2,ending3")
    g = p.add_argument_group("question answering")
    g.add_argument("--doc-stride", type=int, default=128)
    g.add_argument("--max-query-length", type=int, default=64)
    g.add_argument("--max-answer-length", type=int, default=30)
    g.add_argument("--n-best", type=int, default=20)
    g.add_argument("--version-2", dest="version_2", action="store_true", default=None,
                   help="SQuAD v2.0 (default: detected from is_impossible questions)")
    g.add_argument("--null-score-diff-threshold", type=float, default=0.0)
    g = p.add_argument_group("parity")
    g.add_argument("--parity-every", type=int, default=0)
    g.add_argument("--parity-threshold", type=float, default=1e-3,
                   help="relative difference of loss, logits or gradient norm that counts as divergence (the check runs "
                        "in fp32 with dropout off, where fast and reference agree to ~1e-6)")
    g.add_argument("--parity-strict", action="store_true")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = apply_config_file(build_parser(), argv)
    if not args.task or not args.train_file:
        raise ValueError("--task and --train-file are required")
    if not args.model and not (args.preset and args.vocab):
        raise ValueError("give --model DIR (a checkpoint directory), or --preset NAME with --vocab")
    return args


# =========================================================================== run
def load_model(args, task: Task, tok: WordPiece):
    import bertfast.modeling as modeling
    cls = getattr(modeling, task.model_class_name)
    overrides = parse_overrides(args.config_overrides)
    overrides.update(task.config_overrides())
    if args.model:
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


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Fine-tune with parsed arguments; returns {"eval": metrics, "history": [...], "output_dir": ...}."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.resolved_precision = resolve_precision(args.precision, device)
    tok = WordPiece.from_pretrained(args.vocab or args.model)
    task = make_task(args, tok)
    _, train_features = task.load(args.train_file, train=True)
    eval_examples = eval_features = None
    if args.eval_file:
        eval_examples, eval_features = task.load(args.eval_file, train=False)

    seed_everything(args.seed)
    model = load_model(args, task, tok).to(device)
    model.train()
    optimizer = build_optimizer(model, "adamw", args.lr, args.weight_decay, eps=args.adam_eps)
    steps_per_epoch = math.ceil(len(train_features) / args.batch_size)
    total = max(1, int(math.ceil(steps_per_epoch * args.epochs)))
    train_step = TrainStep(model, optimizer, warmup_linear_decay(optimizer, int(round(args.warmup_fraction * total)),
                                                                 total),
                           device, args.resolved_precision, args.max_grad_norm)
    say = print
    say(f"[finetune] {args.task}: {len(train_features)} training features, {total} steps "
        f"({args.epochs:g} epochs of {steps_per_epoch}), model {model.num_parameters() / 1e6:.2f}M parameters, "
        f"{device}, {args.resolved_precision}")
    keys = [k for k in train_features[0] if not k.startswith("_")]
    history: List[Dict[str, Any]] = []
    checks: List[Dict[str, Any]] = []
    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=total, desc="finetune", unit="step", dynamic_ncols=True)
    tell = bar.write if bar is not None else say
    os.makedirs(args.output_dir, exist_ok=True)
    logger = MetricsLogger(os.path.join(args.output_dir, "metrics.jsonl"))
    step, epoch = 0, 0
    t0 = time.time()
    losses: List[torch.Tensor] = []  # per step, on the device: read at the log interval
    metrics: Dict[str, Any] = {}
    try:
        while step < total:
            order = np.random.default_rng([args.seed, epoch]).permutation(len(train_features))
            for i in range(0, len(order), args.batch_size):
                if step >= total:
                    break
                batch = pad_batch([train_features[j] for j in order[i:i + args.batch_size]], tok.pad_id, keys=keys)
                batch = {k: v.to(device) for k, v in batch.items()}
                done = train_step([batch], lambda b: train_step.forward(model, b))
                step += 1
                losses.append(done.outputs[0].loss.detach().float())
                if bar is not None:
                    bar.update(1)
                if step % args.log_every == 0 or step == total:
                    window = torch.stack(losses[-args.log_every:]).tolist()
                    rec = {"type": "train", "step": step, "epoch": epoch, "loss": float(np.mean(window)),
                           "lr": done.lr, "grad_norm": float(done.grad_norm)}
                    logger.log(rec)
                    history.append(rec)
                    if bar is not None:
                        bar.set_postfix(loss=f"{window[-1]:.4f}")
                if args.parity_every and step % args.parity_every == 0:
                    report = parity.check_during_training(model, batch, step, args.parity_threshold,
                                                          args.parity_strict, tell)
                    checks.append(report)
                    logger.log(report)
            epoch += 1
            if eval_features is not None:
                metrics = task.evaluate(model, eval_examples, eval_features)
                shown = {k: round(v, 4) for k, v in metrics.items() if not k.startswith("_") and isinstance(v, float)}
                rec = {"type": "eval", "step": step, "epoch": epoch, **shown}
                logger.log(rec)
                history.append(rec)
                tell(f"[eval] epoch {epoch}: {task.main_metric} {metrics.get(task.main_metric, float('nan')):.4f} "
                     f"{shown}")
    finally:
        if bar is not None:
            bar.close()
        logger.close()
    losses = torch.stack(losses).tolist() if losses else []
    result = {"eval": {k: v for k, v in metrics.items() if not k.startswith("_")}, "history": history,
              "parity": checks, "train_loss": losses, "output_dir": args.output_dir, "steps": step,
              "main_metric": task.main_metric, "time_s": time.time() - t0}
    if not args.no_save:
        model.save_pretrained(args.output_dir)
        tok.save(args.output_dir)
        with open(os.path.join(args.output_dir, "eval_results.json"), "w", encoding="utf-8") as f:
            json.dump({"task": args.task, "steps": step, **result["eval"]}, f, indent=2)
        if "_predictions" in metrics:
            with open(os.path.join(args.output_dir, "predictions.json"), "w", encoding="utf-8") as f:
                json.dump(metrics["_predictions"], f, indent=2)
        say(f"[finetune] saved the fine-tuned model to {args.output_dir}")
    if metrics:
        say(f"[finetune] final {task.main_metric}: {metrics.get(task.main_metric, float('nan')):.4f}")
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = parse_args(argv)
        run(args)
    except (DataFormatError, FileNotFoundError, ValueError) as e:
        print(f"bertfast finetune: error: {e}", file=sys.stderr)
        return 2
    except parity.ParityError as e:
        print(f"bertfast finetune: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
