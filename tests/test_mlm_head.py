"""The masked-position-only MLM head against transformers' BertForMaskedLM head on the same weights.

Loss, accuracy and every gradient (hidden states, transform, the tied decoder weight, its
bias), on the torch backend and on Triton (interpreter on CPU), for 0, 1 and all positions
labelled and row-chunk sizes that do and do not divide the number of labelled rows.
"""
import pytest
import torch

import bertfast
import bertfast.ops as ops

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=67, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=48)
    return transformers.BertForMaskedLM(config)


def _labels(kind, batch, seqlen, vocab, gen):
    labels = torch.full((batch, seqlen), -100)
    if kind == "one":
        labels[1, 3] = 5
    elif kind == "all":
        labels = torch.randint(0, vocab, (batch, seqlen), generator=gen)
    elif kind == "some":
        labels = torch.where(torch.rand(batch, seqlen, generator=gen) < 0.4,
                             torch.randint(0, vocab, (batch, seqlen), generator=gen), labels)
    return labels


def _hf_loss(hf, hidden, labels):
    logits = hf.cls(hidden)  # [B, S, V]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    valid = labels.flatten() != -100
    correct = ((logits.flatten(0, 1).argmax(-1) == labels.flatten()) & valid).sum()
    return torch.nan_to_num(loss, nan=0.0), correct


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind, chunk_rows", [("none", None), ("one", None), ("all", 7), ("all", 24),
                                              ("some", 5), ("some", None)])
def test_mlm_head_matches_transformers(hf_model, backend, kind, chunk_rows):
    gen = torch.Generator().manual_seed(1)
    batch, seqlen, vocab = 3, 8, hf_model.config.vocab_size
    hidden = torch.randn(batch, seqlen, hf_model.config.hidden_size, generator=gen, requires_grad=True)
    labels = _labels(kind, batch, seqlen, vocab, gen)
    head = hf_model.cls.predictions
    params = [head.transform.dense.weight, head.transform.dense.bias, head.transform.LayerNorm.weight,
              head.transform.LayerNorm.bias]
    tied = hf_model.bert.embeddings.word_embeddings.weight
    assert head.decoder.weight is tied
    with bertfast.use_backend(backend):
        got = ops.mlm_head_loss(hidden, labels, *params, head.transform.LayerNorm.eps, head.decoder.weight, head.bias,
                                chunk_rows=chunk_rows)
    expected, correct = _hf_loss(hf_model, hidden, labels)
    torch.testing.assert_close(got.loss, expected, atol=1e-5, rtol=0)
    assert int(got.num_correct) == int(correct)
    assert int(got.num_predictions) == int((labels != -100).sum())
    wrt = [hidden, *params, tied, head.bias]
    ours = torch.autograd.grad(got.loss, wrt, allow_unused=True)
    theirs = torch.autograd.grad(expected, wrt, allow_unused=True) if kind != "none" else [None] * len(wrt)
    for name, a, b in zip(["hidden", "dense.w", "dense.b", "ln.w", "ln.b", "decoder(tied)", "bias"], ours, theirs):
        a = torch.zeros_like(wrt[0]) if a is None else a
        if b is None:  # nothing labelled: every gradient is exactly zero, never NaN
            assert torch.count_nonzero(a) == 0, name
            continue
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


def test_model_uses_the_masked_only_head(hf_model, monkeypatch):
    """BertForMaskedLM with labels calls mlm_head_loss on the labelled rows only."""
    seen = {}
    original = ops.mlm_head_loss

    def spy(hidden, labels, *args, **kwargs):
        seen["rows"], seen["labelled"] = hidden.shape[0], int((labels != -100).sum())
        return original(hidden, labels, *args, **kwargs)

    monkeypatch.setattr(ops, "mlm_head_loss", spy)
    model = bertfast.BertForMaskedLM(bertfast.BertConfig.preset("tiny"))
    ids = torch.randint(1, 512, (2, 10))
    mask = torch.tensor([[1] * 10, [1] * 4 + [0] * 6])
    labels = torch.full((2, 10), -100)
    labels[0, 2], labels[1, 1] = 7, 9
    out = model(ids, mask, labels=labels)
    assert seen == {"rows": 14, "labelled": 2}  # the 14 real tokens went in; the head gathers the 2 labelled
    assert out.logits is None and int(out.mlm_num_predictions) == 2
