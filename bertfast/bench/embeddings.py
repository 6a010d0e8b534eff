"""The model suite's ``embeddings`` benchmark: sentence-transformers encoding a corpus of short
queries and longer passages, as retrieval and semantic search encode theirs.

Each implementation encodes the whole corpus, tokenization included, in batches of the case's
size: mean pooling and normalisation (what e5, bge and MiniLM sentence encoders do).

  bertfast                 sentence-transformers over bertfast's encoder through ``bertfast.unpadded``:
                           each batch is one row of tokens from the tokenizer to the pooling
  transformers sdpa eager  sentence-transformers over transformers' encoder (sdpa attention): batches
                           padded to their longest text, the texts sorted by length first (the baseline)
  onnxruntime fp32         transformers' encoder exported by torch.onnx (opset 18, dynamic batch and
                           length), run by onnxruntime's CPU provider on the same sorted, padded
                           batches, pooled and normalised the same way (CPU only)

The corpus: half queries (3 to 12 words), half passages (30 to 200 words), words of bertfast's demo
vocabulary (one token each); a seeded random model of the case's family and size, saved with a
WordPiece tokenizer, so nothing is downloaded. sentences/s is the rows' seq_per_s. Parity before
timing: each implementation's embeddings within 1e-4 of transformers' (fp32; cosine similarity at
least 0.999 under autocast).
"""
from __future__ import annotations

import contextlib
import functools
import io
import os
import tempfile
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from bertfast.bench import families
from bertfast.bench.common import SuiteContext, generator_for, short_error, strict_fp32, time_plans
from bertfast.bench.results import BERTFAST, ERROR, FAILED_PARITY, HF_EAGER, ONNXRUNTIME, Row, case_text, skipped

GROUP = "embeddings"
IMPLS = (BERTFAST, HF_EAGER, ONNXRUNTIME)
FAMILIES = ("bert", "xlm-roberta")  # of bench.families: the models sentence encoders are
MAX_SEQ_LENGTH = 256
FP32_TOL, AUTOCAST_COSINE = 1e-4, 0.999


def cases(ctx: SuiteContext) -> List[Tuple[str, str, int, int]]:
    """[(preset, family, texts, batch size)]."""
    if not ctx.device.is_cuda:
        if ctx.cpu_model_cases:  # MiniLM-L12-H384's shape: e5-small, bge-small, multilingual-e5-small
            return [("minilm", family, 128, 32) for family in FAMILIES]
        return [("tiny", "bert", 16, 8)]
    if ctx.quick:
        return [("bert-base", "bert", 1024, 128)]
    return [("bert-base", family, 2048, 128) for family in FAMILIES]


# --------------------------------------------------------------------------- corpus and models
def corpus(texts: int, gen: torch.Generator) -> List[str]:
    """``texts`` texts, alternately a query (3-12 words, a question) and a passage (30-200 words,
    sentences of 5-20 words), from the demo vocabulary's whole words."""
    words = [w for w in _demo_vocab() if w.isalpha() and w.islower() and len(w) > 1]

    def pick(n: int) -> List[str]:
        return [words[i] for i in torch.randint(0, len(words), (n,), generator=gen).tolist()]

    def passage(n: int) -> str:
        sentences, left = [], n
        while left > 0:
            k = min(left, int(torch.randint(5, 21, (1,), generator=gen)))
            sentences.append(" ".join(pick(k)) + " .")
            left -= k
        return " ".join(sentences)

    out = []
    for i in range(texts):
        if i % 2 == 0:
            out.append(" ".join(pick(int(torch.randint(3, 13, (1,), generator=gen)))) + " ?")
        else:
            out.append(passage(int(torch.randint(30, 201, (1,), generator=gen))))
    return out


def _demo_vocab() -> List[str]:
    from importlib import resources
    return resources.files("bertfast.data").joinpath("demo_vocab.txt").read_text().splitlines()


def demo_tokenizer(family: str):
    """The demo vocabulary's WordPiece tokenizer; for XLM-R without token types, as XLM-R's own."""
    import transformers
    tokenizer = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(_demo_vocab())})
    if family == "xlm-roberta":
        tokenizer.model_input_names = ["input_ids", "attention_mask"]
    return tokenizer


def save_model(preset: str, family: str, path: str) -> None:
    """A seeded random transformers encoder of the family and size, saved with ``demo_tokenizer``."""
    import transformers
    tokenizer = demo_tokenizer(family)
    torch.manual_seed(0)
    config = families.config(preset, family, pad_token_id=tokenizer.pad_token_id, vocab_size=len(tokenizer),
                             max_positions=512)
    transformers.AutoModel.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def length_sorted(texts: Sequence[str]) -> List[int]:
    """The order sentence-transformers encodes texts in: longest (in characters) first."""
    return sorted(range(len(texts)), key=lambda i: -len(texts[i]))


def prepare(preset: str, family: str, n_texts: int, batch_size: int) -> Tuple[Dict[str, Any], List[str], List[int]]:
    """(the case, its corpus, each text's tokens). The case's fill is its real tokens over the
    positions a padded implementation runs: the length-sorted batches, each padded to its longest."""
    texts = corpus(n_texts, generator_for(GROUP, preset, family, n_texts))
    lengths = [len(ids) for ids in demo_tokenizer(family)(texts, truncation=True,
                                                          max_length=MAX_SEQ_LENGTH)["input_ids"]]
    order = length_sorted(texts)
    padded = sum(max(lengths[i] for i in order[s:s + batch_size]) * len(order[s:s + batch_size])
                 for s in range(0, n_texts, batch_size))
    case = {"model": preset, "family": family, "texts": n_texts, "batch": batch_size, "lengths": "queries+passages",
            "real_tokens": sum(lengths), "fill": round(sum(lengths) / padded, 3)}
    return case, texts, lengths


def sentence_model(path: str, device: torch.device, bertfast_encoder: bool):
    """sentence-transformers' Transformer, mean Pooling and Normalize over ``path``: transformers'
    encoder (sdpa), or bertfast's (built through register_auto) encoding unpadded."""
    import sentence_transformers as st
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    import bertfast

    def build():
        kwargs = {} if bertfast_encoder else {"model_kwargs": {"attn_implementation": "sdpa"}}
        word = Transformer(path, max_seq_length=MAX_SEQ_LENGTH, **kwargs)
        width = getattr(word, "get_embedding_dimension", None) or word.get_word_embedding_dimension  # 6.0 renamed it
        return st.SentenceTransformer(modules=[word, Pooling(width(), "mean"), Normalize()], device=str(device))
    if not bertfast_encoder:
        return build()
    bertfast.register_auto()
    try:
        return bertfast.unpadded(build())
    finally:
        bertfast.unregister_auto()


class OnnxEncoder:
    """transformers' encoder exported to ONNX and run by onnxruntime (CPU), encoding as
    sentence-transformers does: length-sorted padded batches, mean pooling, normalised."""

    def __init__(self, model, path: str, batch_size: int):
        import onnxruntime

        self.tokenizer, self.batch_size = model.tokenizer, batch_size
        sample = {k: torch.from_numpy(v) for k, v in self._tokenize(["a short text", "another text"]).items()}
        dims = {name: {0: torch.export.Dim("batch"), 1: torch.export.Dim("length")} for name in sample}
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # the exporter's chatter
            warnings.simplefilter("ignore")
            torch.onnx.export(model[0].auto_model.eval(), (), path, kwargs=sample, dynamo=True, opset_version=18,
                              dynamic_shapes=dims, output_names=["last_hidden_state"])
        self.session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]

    def _tokenize(self, texts: Sequence[str]):
        return self.tokenizer(list(texts), padding=True, truncation=True, max_length=MAX_SEQ_LENGTH,
                              return_tensors="np")

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        import numpy as np
        order, pieces = length_sorted(texts), []
        for start in range(0, len(order), self.batch_size):
            batch = self._tokenize([texts[i] for i in order[start:start + self.batch_size]])
            hidden = self.session.run(None, {k: batch[k] for k in self.inputs})[0]
            mask = batch["attention_mask"][..., None].astype(np.float32)
            mean = (hidden * mask).sum(1) / np.maximum(mask.sum(1), 1e-9)
            pieces.append(mean / np.maximum(np.linalg.norm(mean, axis=1, keepdims=True), 1e-12))
        out = np.empty((len(texts), pieces[0].shape[1]), dtype=np.float32)
        out[order] = np.concatenate(pieces)
        return torch.from_numpy(out)


# --------------------------------------------------------------------------- one case
def _parity(got: torch.Tensor, want: torch.Tensor, autocast: bool) -> Dict[str, Any]:
    got, want = got.float().cpu(), want.float().cpu()
    if autocast:
        cosine = float(torch.nn.functional.cosine_similarity(got, want, dim=1).min())
        return {"ok": cosine >= AUTOCAST_COSINE, "min_cosine": cosine, "tol": AUTOCAST_COSINE}
    err = float((got - want).abs().max())
    return {"ok": err <= FP32_TOL, "max_abs_err": err, "tol": FP32_TOL}


def bench(ctx: SuiteContext, group: str, case: Dict[str, Any], direction: str, texts: Sequence[str],
          lengths: Sequence[int], figures: Callable) -> List[Row]:
    """All implementations of one case (``prepare``'s): build, gate against transformers' fp32
    embeddings, then time. ``figures``: the model suite's throughputs and MFU of a timing."""
    from bertfast.model import mfu as bert_flops
    from bertfast.sentence import unsupported_version
    reason = unsupported_version()
    if reason:
        return [skipped("model", group, dict(case), direction, impl, reason) for impl in IMPLS if ctx.wants(impl)]
    dev, n_texts, batch_size = ctx.torch_device, len(texts), case["batch"]
    autocast = ctx.device.is_cuda and ctx.dtype != torch.float32
    rows: List[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        save_model(case["model"], case["family"], tmp)
        theirs = sentence_model(tmp, dev, bertfast_encoder=False)
        flops = bert_flops.bert_forward_flops(theirs[0].auto_model.config, lengths, "none")
        work = {"flops": flops, "tokens": sum(lengths), "sequences": n_texts}

        def row(impl: str, **kw) -> Row:
            return Row("model", group, dict(case), direction, impl, work=dict(work), **kw)

        def encoding(model) -> Callable[[], torch.Tensor]:
            def encode() -> torch.Tensor:
                with torch.inference_mode(), torch.autocast(dev.type, dtype=ctx.dtype, enabled=autocast):
                    return model.encode(texts, batch_size=batch_size, convert_to_tensor=True, show_progress_bar=False)
            return encode

        with strict_fp32(), torch.inference_mode():
            want = theirs.encode(texts, batch_size=batch_size, convert_to_tensor=True, show_progress_bar=False)
        builders: List[Tuple[str, Callable[[], Callable[[], torch.Tensor]]]] = []
        if ctx.wants(BERTFAST):
            builders.append((BERTFAST, lambda: encoding(sentence_model(tmp, dev, bertfast_encoder=True))))
        if ctx.wants(HF_EAGER):
            if ctx.with_transformers:
                builders.append((HF_EAGER, lambda: encoding(theirs)))
            else:
                rows.append(skipped("model", group, dict(case), direction, HF_EAGER,
                                    "transformers rows disabled (--no-transformers)"))
        if ctx.wants(ONNXRUNTIME):
            reason = onnx_skip_reason(ctx)
            if reason:
                rows.append(skipped("model", group, dict(case), direction, ONNXRUNTIME, reason))
            else:
                onnx_path = os.path.join(tmp, "model.onnx")
                builders.append((ONNXRUNTIME, lambda: functools.partial(
                    OnnxEncoder(theirs, onnx_path, batch_size).encode, texts)))
        plans = []
        for impl, build in builders:
            try:
                step = build()
                with strict_fp32():
                    report = _parity(step(), want, autocast and impl != ONNXRUNTIME)
            except Exception as exc:  # noqa: BLE001
                rows.append(row(impl, status=ERROR, reason=short_error(exc)))
                continue
            if report["ok"]:
                plans.append((impl, lambda s=step: s, report))
            else:
                rows.append(row(impl, status=FAILED_PARITY, parity=report,
                                reason=f"embeddings differ from transformers': {report}"))

        def timed(impl, t, mem, report, clocks) -> None:
            if isinstance(t, BaseException):
                rows.append(row(impl, status=ERROR, reason=f"while timing: {short_error(t)}", parity=report))
                return
            rows.append(row(impl, time_ms=t, metrics=figures(ctx, t, n_texts, sum(lengths), flops), memory=mem,
                            parity=report, clocks=clocks))
            ctx.log(f"  {group} {case_text(case)} {impl:28s} {t.median:9.1f} ms")

        time_plans(ctx, plans, ctx.step_policy, timed)
    rows.sort(key=lambda r: IMPLS.index(r.impl))
    return rows


def onnx_skip_reason(ctx: SuiteContext) -> Optional[str]:
    if ctx.device.is_cuda:
        return "onnxruntime runs on the CPU rows only (its CUDA provider is not what this bench compares)"
    for module in ("onnxruntime", "onnxscript", "onnx"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install bertfast[hf])"
    return None
