"""The encoder families' tests' shared pieces (tests/test_roberta.py, test_electra.py, test_distilbert.py,
test_family_integrations.py): a transformers twin loaded from a bertfast checkpoint, padded inputs with
labels for every head, gradients by parameter name, and the checks of what users run the models in
(pipelines, PEFT LoRA, Trainer, sentence-transformers, torch.compile), so each family is checked
against transformers the same way."""
from __future__ import annotations

import contextlib
import tempfile
from unittest import mock

import torch
import transformers

SIDES = ("right", "left", "mixed")


def twin(model, cls_name):
    """transformers' class loaded from ``model``'s checkpoint (eager attention)."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return getattr(transformers, cls_name).from_pretrained(tmp, attn_implementation="eager").eval()


def make_mask(side, batch, seqlen, gen):
    """[B, S] with 1..S real tokens a row (row 0 always padded): at the row's start (right padding),
    its end (left) or alternating (mixed)."""
    lengths = torch.randint(1, seqlen + 1, (batch,), generator=gen)
    lengths[0] = seqlen - 3
    cols = torch.arange(seqlen)[None]
    right, left = cols < lengths[:, None], cols >= (seqlen - lengths)[:, None]
    mask = {"right": right, "left": left}.get(side, torch.where((torch.arange(batch) % 2 == 0)[:, None], left, right))
    return mask.long()


def make_inputs(pad, vocab, side="right", batch=4, seqlen=10, seed=0, choices=None):
    """(input_ids, attention_mask), ids in [3, vocab) at real tokens and ``pad`` at padding;
    with ``choices``, [batch, choices, seqlen]."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, seqlen) if choices is None else (batch * choices, seqlen)
    mask = make_mask(side, *shape, gen)
    ids = torch.where(mask.bool(), torch.randint(3, vocab, shape, generator=gen), pad)
    if choices is not None:
        ids, mask = ids.view(batch, choices, seqlen), mask.view(batch, choices, seqlen)
    return ids, mask


def labels_for(head, ids, mask, seed=1):
    """The labels of a head (class-name suffix) for a batch, at real tokens only."""
    gen = torch.Generator().manual_seed(seed)
    batch = ids.shape[0]
    if head == "ForMaskedLM":
        return {"labels": torch.where((torch.rand(ids.shape, generator=gen) < 0.4) & mask.bool(), ids, -100)}
    if head == "ForTokenClassification":
        return {"labels": torch.where(mask.bool(), torch.randint(0, 2, ids.shape, generator=gen), -100)}
    if head == "ForQuestionAnswering":
        return {"start_positions": torch.randint(0, 5, (batch,), generator=gen),
                "end_positions": torch.randint(0, 5, (batch,), generator=gen)}
    if head == "ForPreTraining":  # ELECTRA's discriminator: 1 where a token was replaced
        return {"labels": torch.randint(0, 2, ids.shape, generator=gen)}
    return {"labels": torch.randint(0, 2, (batch,), generator=gen)}  # sequence classification, multiple choice


def main_output(head, out):
    if head == "Model":
        return out.last_hidden_state
    return out.start_logits if head == "ForQuestionAnswering" else out.logits


def grads(model, loss):
    """{parameter name: gradient}, tied weights under each of their names (transformers' XLM-R
    registers lm_head before the encoder, so the first name differs)."""
    named = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
    got = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {n: g for (n, _), g in zip(named, got) if g is not None}


def assert_grads_close(ours, theirs):
    """Each parameter's gradient within 1e-4 of its norm."""
    assert ours.keys() == theirs.keys(), sorted(set(ours) ^ set(theirs))
    for name in theirs:
        assert (ours[name] - theirs[name]).norm() <= 1e-4 * theirs[name].norm() + 1e-7, name


def choices(head):
    """make_inputs' choices for a head: 3 for multiple choice ([B, 3, S] inputs), else None."""
    return 3 if head == "ForMultipleChoice" else None


def assert_loss_and_grads_match(model, hf, head, ids, mask):
    """The head's loss (within 1e-5) and every gradient (``assert_grads_close``) against transformers'
    twin, on this batch with ``labels_for`` the head. Question answering's batch loses its padding
    first: with padding the span softmax differs (the README's drop-in table)."""
    if head == "ForQuestionAnswering":
        ids, mask = torch.where(mask.bool(), ids, 5), torch.ones_like(mask)
    labels = labels_for(head, ids, mask)
    ours = model(input_ids=ids, attention_mask=mask, **labels)
    theirs = hf(input_ids=ids, attention_mask=mask, **labels)
    torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-5, rtol=1e-5)
    assert_grads_close(grads(model, ours.loss), grads(hf, theirs.loss))


class Auto:
    """bertfast.register_auto() for the block's length."""

    def __enter__(self):
        import bertfast
        bertfast.register_auto()

    def __exit__(self, *exc):
        import bertfast
        bertfast.unregister_auto()


def assert_pipeline_matches(task, path, texts, expected_class):
    """transformers' pipeline of ``path`` built with register_auto (an ``expected_class`` model) gives
    transformers' own results: features within 1e-5, the same labels or tokens with scores within 1e-4."""
    theirs = transformers.pipeline(task, model=path)
    with Auto():
        ours = transformers.pipeline(task, model=path)
    assert type(ours.model) is expected_class
    for text in texts:
        a, b = ours(text), theirs(text)
        if task == "feature-extraction":
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
            continue
        key = lambda r: r.get("token_str", r.get("label", r.get("entity")))  # noqa: E731
        assert [key(r) for r in a] == [key(r) for r in b]
        torch.testing.assert_close(torch.tensor([r["score"] for r in a]), torch.tensor([r["score"] for r in b]),
                                   atol=1e-4, rtol=0)


def compile_fresh(model):
    """torch.compile(model, fullgraph=True) with Dynamo's caches emptied first: every family's encoder
    runs one forward (one code object), so this test compiles it afresh whatever ran before
    (a recompile at new shapes is tests/test_ops.py's)."""
    torch._dynamo.reset()
    return torch.compile(model, fullgraph=True, backend="aot_eager")


def demo_wordpiece(tokenizer_class):
    """``tokenizer_class`` (BertTokenizer, DistilBertTokenizer, ...) over bertfast's demo vocabulary."""
    from importlib import resources
    words = resources.files("bertfast.data").joinpath("demo_vocab.txt").read_text().splitlines()
    return tokenizer_class(vocab={w: i for i, w in enumerate(words)})


def assert_triton_matches_reference(model, ids, mask):
    """``model`` (an MLM class) with every op on the Triton backend (the interpreter on a CPU) against
    the reference encoder and head: the loss within 1e-5 and each gradient within 1e-4 of its norm."""
    import bertfast
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device).train()
    batch = {"input_ids": ids.to(device), "attention_mask": mask.to(device),
             **{k: v.to(device) for k, v in labels_for("ForMaskedLM", ids, mask).items()}}
    params = list(model.parameters())
    with bertfast.use_backend("triton"):
        fast = model(**batch)
        fast_grads = torch.autograd.grad(fast.loss, params, allow_unused=True)
    with bertfast.reference_execution(model):
        ref = model(**batch)
        ref_grads = torch.autograd.grad(ref.loss, params, allow_unused=True)
    torch.testing.assert_close(fast.loss, ref.loss, atol=1e-5, rtol=1e-5)
    for (name, _), a, b in zip(model.named_parameters(), fast_grads, ref_grads):
        if b is not None:
            assert (a - b).norm() <= 1e-4 * b.norm() + 1e-6, name


def assert_lora_matches(ours_class, theirs_class, path, tokenizer, texts, target_modules):
    """PEFT LoRA (random LoRA weights, the same in both) on bertfast's and transformers' sequence
    classifiers from ``path``: logits within 1e-5, every LoRA gradient non-zero and within 1e-3."""
    import peft
    lora = dict(r=4, lora_alpha=64, target_modules=list(target_modules), init_lora_weights=False)
    models = []
    for cls in (ours_class, theirs_class):
        torch.manual_seed(1)
        base = cls.from_pretrained(path).eval()
        models.append(peft.get_peft_model(base, peft.LoraConfig(task_type="SEQ_CLS", **lora)))
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    labels = torch.arange(len(texts)) % 2
    outs = [m(**batch, labels=labels) for m in models]
    torch.testing.assert_close(outs[0].logits, outs[1].logits, atol=1e-5, rtol=0)
    for out in outs:
        out.loss.backward()
    grads = [{n: p.grad for n, p in m.named_parameters() if "lora_" in n} for m in models]
    assert grads[0] and grads[0].keys() == grads[1].keys()
    for name in grads[1]:
        assert grads[0][name] is not None and grads[0][name].abs().sum() > 0, name
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-3, msg=name)
    return models


def trainer_losses(model, tokenizer, texts, out_dir, accumulation=1):
    """The logged losses of transformers' Trainer fine-tuning ``model`` for 2 epochs on ``texts``
    (labels alternating), a batch of 4 (with ``accumulation`` steps), then its evaluation and the
    trainer."""
    rows = [{"text": t, "label": i % 2} for i, t in enumerate(texts * 4)]

    def collate(batch):
        encoded = tokenizer([r["text"] for r in batch], padding=True, return_tensors="pt")
        return {**encoded, "labels": torch.tensor([r["label"] for r in batch])}
    args = transformers.TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=4,
                                          gradient_accumulation_steps=accumulation, num_train_epochs=2,
                                          learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True,
                                          save_strategy="no", seed=0, data_seed=0, disable_tqdm=True,
                                          remove_unused_columns=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows,
                                   data_collator=collate)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, trainer.evaluate(), trainer, collate(rows[:4])


@contextlib.contextmanager
def packed_only():
    """The block's encoders must take their batches packed: unpadding or padding one fails."""
    def refuse(*args, **kwargs):
        raise AssertionError("the encoder unpadded or padded a batch: the unpadded path was not taken end to end")
    with mock.patch("bertfast.model.layout.unpad_mask", refuse), mock.patch("bertfast.model.layout.pad_rows", refuse):
        yield


def sentence_encoder(path, pooling="mean"):
    """sentence-transformers' SentenceTransformer of ``path``'s encoder and a Pooling module."""
    import sentence_transformers as st
    try:
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:  # sentence-transformers before 5.2
        from sentence_transformers.models import Pooling, Transformer
    word = Transformer(path)
    dim = getattr(word, "get_embedding_dimension", None) or word.get_word_embedding_dimension  # renamed in 6.0
    pool = Pooling(dim(), pooling_mode=pooling)
    return st.SentenceTransformer(modules=[word, pool], device="cpu")


def assert_sentence_embeddings_match(path, texts, expected_class, pooling="mean", unpadded=False):
    """sentence-transformers over ``path`` built with register_auto (an ``expected_class`` encoder
    inside) gives transformers' embeddings within 1e-5; ``unpadded``: through ``bertfast.unpadded``,
    the batch flattened into one row of tokens from the tokenizer to the pooling."""
    import bertfast
    theirs = sentence_encoder(path, pooling)
    with Auto():
        ours = sentence_encoder(path, pooling)
    assert any(type(m) is expected_class for m in ours.modules())
    with packed_only() if unpadded else contextlib.nullcontext():
        got = (bertfast.unpadded(ours) if unpadded else ours).encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(got, theirs.encode(texts, convert_to_tensor=True), atol=1e-5, rtol=0)


def assert_compiles_like_eager(model, batch, labels):
    """torch.compile(fullgraph=True) of an MLM model (``compile_fresh``): the loss and every gradient as eager's."""
    eager = model(**batch, labels=labels)
    eager_grads = torch.autograd.grad(eager.loss, list(model.parameters()))
    out = compile_fresh(model)(**batch, labels=labels)
    got = torch.autograd.grad(out.loss, list(model.parameters()))
    torch._dynamo.reset()  # nothing of this compile left to the tests after it
    torch.testing.assert_close(out.loss, eager.loss, atol=1e-5, rtol=0)
    for a, b in zip(got, eager_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def first_real_hidden(encoder, ids, mask):
    """transformers' ``encoder`` on ids / mask ([B, S] or [B, C, S]): each sequence's first real token's
    last hidden state [B * C, H], where bertfast's heads read (transformers' read position 0)."""
    flat_ids, flat_mask = ids.reshape(-1, ids.shape[-1]), mask.reshape(-1, mask.shape[-1])
    hidden = encoder(input_ids=flat_ids, attention_mask=flat_mask).last_hidden_state
    return hidden[torch.arange(len(hidden)), flat_mask.argmax(dim=1)]


def assert_class_matches(model, hf, head, side, ids, mask, first_token_expected):
    """``model`` (eval) against its transformers twin on one padded batch: the head's output at real
    tokens and every hidden state within 1e-5, padded rows of the encoder's output zero. The heads that
    read a sequence's first token (sequence classification, multiple choice) compare whole under right
    padding, else against ``first_token_expected()``: transformers' head at the first real token."""
    ours = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    theirs = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    a, b = main_output(head, ours), main_output(head, theirs)
    assert torch.isfinite(a).all()
    if head in ("ForSequenceClassification", "ForMultipleChoice"):
        torch.testing.assert_close(a, b if side == "right" else first_token_expected(), atol=1e-5, rtol=0)
        return
    real = mask.bool()
    torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=0)
    if head == "Model":
        assert not a[~real].any()  # padded rows are never encoded
    assert len(ours.hidden_states) == len(theirs.hidden_states) == model.config.num_hidden_layers + 1
    for x, y in zip(ours.hidden_states, theirs.hidden_states):
        torch.testing.assert_close(x[real], y[real], atol=1e-5, rtol=0)
