"""The encoder families' tests' shared pieces (tests/test_roberta.py, tests/test_electra.py): a
transformers twin loaded from a bertfast checkpoint, padded inputs with labels for every head, and
gradients by parameter name, so each family is checked against transformers the same way."""
from __future__ import annotations

import tempfile

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


def assert_loss_and_grads_match(model, hf, head, ids, mask):
    """The head's loss (within 1e-5) and every gradient (``assert_grads_close``) against transformers'
    twin, on this batch with ``labels_for`` the head."""
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
