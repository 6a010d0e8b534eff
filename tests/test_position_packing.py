"""Packed sequences read from position ids: given position_ids and no attention_mask (nor
cu_seq_lens_q), a token whose position is not the one before it plus one starts a sequence and
attention stays within each, as transformers 5.25 reads them (``DataCollatorWithFlattening``'s
default batch: one row, positions restarting at each sequence).

  * BERT, RoBERTa and ELECTRA encode each sequence as if it ran alone (transformers of any version
    run on the sequence alone), and as transformers 5.25 and later encode the row; DistilBERT, whose
    transformers masks read no position ids, attends over the row as transformers' does;
  * an attention mask given (even of ones) reads no packing;
  * the fast path (torch, Triton) trains as the reference encoder with its per-query mask does;
  * the rows are cut with one host read, which torch.compile(fullgraph=True) refuses with an error
    naming cu_seq_lens_q; with graph breaks allowed, the compiled model gives eager's loss and gradients.
"""
import pytest
import torch
from packaging.version import Version

import bertfast
from bertfast.model import model_inputs
from bertfast.model.layout import Layout
from family_helpers import twin

transformers = pytest.importorskip("transformers")
# transformers' masks read restarting position ids as packed sequences from 5.25 on (masking_utils).
TRANSFORMERS_PACKS = Version(transformers.__version__) >= Version("5.25")

SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
# Two rows of 12: sequences of 5, 3 and 4 tokens, then 8 and 4.
LENGTHS = [[5, 3, 4], [8, 4]]
SEQ = 12


def _config(family):
    if family == "DistilBert":
        return transformers.DistilBertConfig(vocab_size=99, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                             dropout=0.0, attention_dropout=0.0)
    if family == "Electra":
        return transformers.ElectraConfig(vocab_size=99, embedding_size=16, **SIZES)
    if family == "Roberta":
        return transformers.RobertaConfig(vocab_size=99, max_position_embeddings=40, type_vocab_size=1,
                                          pad_token_id=1, **SIZES)
    return transformers.BertConfig(vocab_size=99, **SIZES)


def _positions(first=0):
    """[2, SEQ]: each sequence of LENGTHS numbered from ``first``."""
    return torch.stack([torch.cat([torch.arange(n) + first for n in row]) for row in LENGTHS])


def _bounds(row):
    starts = [sum(LENGTHS[row][:k]) for k in range(len(LENGTHS[row]))]
    return list(zip(starts, starts[1:] + [SEQ]))


def _model(family, head="Model"):
    torch.manual_seed(0)
    return getattr(bertfast, family + head)(_config(family)).eval()


@pytest.mark.parametrize("execution", ["fast", "reference"])
@pytest.mark.parametrize("family", ["Bert", "Roberta", "Electra"])
def test_restarting_positions_encode_each_sequence_alone(family, execution):
    model = _model(family)
    hf = twin(model, family + "Model")
    ids = torch.randint(3, 99, (2, SEQ), generator=torch.Generator().manual_seed(1))
    positions = _positions(first=2 if family == "Roberta" else 0)  # RoBERTa numbers from padding_idx + 1
    context = bertfast.reference_execution(model) if execution == "reference" else torch.enable_grad()
    with context, torch.no_grad():
        ours = model(input_ids=ids, position_ids=positions, output_attentions=execution == "reference")
        theirs = hf(input_ids=ids, position_ids=positions, output_attentions=execution == "reference")
        for row in range(2):
            for start, end in _bounds(row):
                alone = hf(input_ids=ids[row:row + 1, start:end], position_ids=positions[row:row + 1, start:end])
                torch.testing.assert_close(ours.last_hidden_state[row, start:end], alone.last_hidden_state[0],
                                           atol=2e-5, rtol=0)
                if start == 0 and family != "Electra":  # the pooler reads each row's first token
                    torch.testing.assert_close(ours.pooler_output[row], alone.pooler_output[0], atol=2e-5, rtol=0)
        if TRANSFORMERS_PACKS:
            torch.testing.assert_close(ours.last_hidden_state, theirs.last_hidden_state, atol=2e-5, rtol=0)
            if execution == "reference":  # block-diagonal probabilities, as transformers gives them
                for a, b in zip(ours.attentions, theirs.attentions):
                    torch.testing.assert_close(a, b, atol=2e-6, rtol=0)
    if execution == "reference":
        probs = ours.attentions[0]
        assert probs.shape == (2, 4, SEQ, SEQ)
        assert not probs[0, :, :5, 5:].any() and not probs[0, :, 5:8, 8:].any()   # no look past a sequence


def test_distilbert_attends_over_the_row_as_transformers_does():
    """transformers' DistilBERT masks read no position ids, on any version: nor do bertfast's."""
    model = _model("DistilBert")
    hf = twin(model, "DistilBertModel")
    ids = torch.randint(3, 99, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, theirs = model(input_ids=ids, position_ids=_positions()), hf(input_ids=ids, position_ids=_positions())
    torch.testing.assert_close(ours.last_hidden_state, theirs.last_hidden_state, atol=2e-5, rtol=0)


def test_an_attention_mask_given_reads_no_packing():
    """A mask given, of ones too, keeps each row one sequence (transformers reads packing only without it)."""
    model = _model("Bert")
    hf = twin(model, "BertModel")
    ids = torch.randint(3, 99, (2, SEQ), generator=torch.Generator().manual_seed(3))
    ones = torch.ones_like(ids)
    with torch.no_grad():
        ours = model(input_ids=ids, position_ids=_positions(), attention_mask=ones)
        theirs = hf(input_ids=ids, position_ids=_positions(), attention_mask=ones)
        packed = model(input_ids=ids, position_ids=_positions())
    torch.testing.assert_close(ours.last_hidden_state, theirs.last_hidden_state, atol=2e-5, rtol=0)
    assert not torch.allclose(ours.last_hidden_state, packed.last_hidden_state, atol=1e-3)


def test_positions_of_one_row_broadcast_their_restarts():
    model = _model("Bert")
    ids = torch.randint(3, 99, (2, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        one_row = model(input_ids=ids, position_ids=_positions()[:1])
        both = model(input_ids=ids, position_ids=_positions()[:1].expand(2, SEQ))
    torch.testing.assert_close(one_row.last_hidden_state, both.last_hidden_state, atol=0, rtol=0)


def test_segmented_layout_cuts_each_row_where_its_positions_restart():
    starts = model_inputs.position_restarts(_positions())
    assert starts.tolist()[0] == [True, False, False, False, False, True, False, False, True, False, False, False]
    layout = Layout.segmented(starts)
    assert layout.cu_seqlens.tolist() == [0, 5, 8, 12, 20, 24] and layout.max_seqlen == 8
    assert layout.cu_seqlens.dtype == torch.int32 and layout.index.tolist() == list(range(2 * SEQ))


def _pretraining_batch(vocab):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, vocab, (2, SEQ), generator=g)
    labels = torch.where(torch.rand(ids.shape, generator=g) < 0.4, ids, -100)
    labels[0, 0] = ids[0, 0]
    return dict(input_ids=ids, position_ids=_positions(), labels=labels, next_sentence_label=torch.tensor([0, 1]))


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_restarting_positions_train_as_the_reference(backend):
    """The pre-training loss and every gradient through the varlen op over the cut sequences (torch, or
    Triton under the interpreter) as the reference encoder's, whose mask keeps each sequence apart."""
    model = _model("Bert", "ForPreTraining").train()
    batch = _pretraining_batch(model.config.vocab_size)
    with bertfast.use_backend(backend):
        loss, grads = _loss_and_grads(model, batch)
    with bertfast.reference_execution(model):
        ref_loss, ref_grads = _loss_and_grads(model, batch)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_restarting_positions_under_torch_compile():
    """Cutting the rows has a data-dependent size: fullgraph=True stops with the error naming the static
    form (cu_seq_lens_q); a graph break runs the forward eagerly, with eager's loss and gradients."""
    model = _model("Bert", "ForPreTraining").train()
    batch = _pretraining_batch(model.config.vocab_size)
    eager, eager_grads = _loss_and_grads(model, batch)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="position_ids with no attention_mask(.|\\n)*cu_seq_lens_q"):
        torch.compile(lambda b: model(**b).loss, fullgraph=True)(batch)
    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    got = torch.compile(lambda b: model(**b).loss)(batch)
    got.backward()
    torch._dynamo.reset()
    torch.testing.assert_close(got.detach(), eager, atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, eager_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_transformers_flattening_collator_default_batch():
    """DataCollatorWithFlattening's default (position ids, no cu_seq_lens_q) encodes each sequence as its
    cu_seq_lens_q form does."""
    from transformers import DataCollatorWithFlattening

    model = _model("Bert")
    features = [{"input_ids": s} for s in ([2, 17, 33, 9, 3], [2, 41, 3], [2, 8, 8, 15, 27, 11, 3])]
    by_positions = DataCollatorWithFlattening()(features, return_tensors="pt")
    by_bounds = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False)(
        features, return_tensors="pt")
    assert "cu_seq_lens_q" not in by_positions and "position_ids" in by_positions
    with torch.no_grad():
        ours = model(input_ids=by_positions["input_ids"], position_ids=by_positions["position_ids"])
        bounds = model(input_ids=by_bounds["input_ids"], cu_seq_lens_q=by_bounds["cu_seq_lens_q"],
                       max_length_q=by_bounds["max_length_q"])
    torch.testing.assert_close(ours.last_hidden_state, bounds.last_hidden_state, atol=1e-5, rtol=0)


def test_transformers_encoders_on_bertfast_attention_refuse_packing_clearly():
    """transformers' own BERT with attn_implementation="bertfast" gets a per-query mask for packed
    sequences (5.25 and later), which the key-padding attention cannot serve: a clear error."""
    if not TRANSFORMERS_PACKS:
        pytest.skip("transformers before 5.25 reads no packing from position ids")
    import bertfast.hf

    bertfast.hf.register()
    hf = twin(_model("Bert"), "BertModel")
    hf.set_attn_implementation("bertfast")
    ids = torch.randint(3, 99, (2, SEQ), generator=torch.Generator().manual_seed(6))
    with pytest.raises(ValueError, match="packed by position ids"):
        hf(input_ids=ids, position_ids=_positions())
