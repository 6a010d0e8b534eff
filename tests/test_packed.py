"""Packed sequences: a batch as one row of tokens [1, T] with transformers' cu_seq_lens_q /
max_length_q, the static-shape form of the unpadded step (issue: a step the GPU can run at full
speed).

  * a packed batch gives what the same sequences padded give: hidden states at tokens, pooled
    outputs, MLM and NSP losses and every gradient; on the fast and the reference paths, for
    the pre-training, classification, regression, multi-label and multiple-choice heads; packed
    QA gives each sequence's own span loss;
  * the unused tail (dummy sequences) and empty slots change nothing; an empty slot pools to 0;
  * bad packing is refused with an error naming what was expected;
  * value checks asked for on the device assert there, with no host read, and can fail;
  * the packed training step compiles under torch.compile(fullgraph=True) and a new packing of
    the same shapes does not recompile.
"""
import pytest
import torch

import bertfast
from bertfast import BertConfig, contract, reference_execution
from bertfast.model import model_inputs
from bertfast.contract import IGNORE_INDEX
from bertfast.padding import pack_batch

S = 8                  # max_length_q: the padded batch's sequence length
LENGTHS = [5, 3, 7]


def _config(**overrides):
    return BertConfig.preset("tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **overrides)


def _padded(vocab_size: int, seed: int = 0, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    ids = torch.randint(5, vocab_size, (b, S), generator=g)
    mask = (torch.arange(S)[None] < torch.tensor(lengths)[:, None]).long()
    types = (torch.arange(S)[None] >= 2).long().expand(b, S).clone()
    labels = torch.full((b, S), IGNORE_INDEX)
    for r, n in enumerate(lengths):
        picked = torch.randperm(n, generator=g)[:2]
        labels[r, picked] = ids[r, picked]
    nsp = torch.randint(0, 2, (b,), generator=g)
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels, next_sentence_label=nsp)


def _pack(batch, tokens: int, slots: int):
    packed = pack_batch(batch, tokens, S, slots)
    assert packed["cu_seq_lens_q"].diff()[len(LENGTHS)] > 0          # a dummy tail sequence
    return packed


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(model, batch, **kw):
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kw)
    out.loss.backward()
    return out, _grads(model)


@pytest.mark.parametrize("execution", ["fast", "reference"])
def test_packed_pretraining_matches_padded(execution):
    torch.manual_seed(0)
    model = bertfast.BertForPreTraining(_config())
    padded = _padded(model.config.vocab_size)
    packed = _pack(padded, tokens=20, slots=5)
    context = reference_execution(model) if execution == "reference" else torch.enable_grad()
    with context:
        ref, ref_grads = _run(model, padded)
        out, grads = _run(model, packed)
        fixed, fixed_grads = _run(model, packed, max_predictions_per_seq=10)  # the row's static gather
    for o, g in ((out, grads), (fixed, fixed_grads)):
        for name in ("loss", "mlm_loss", "nsp_loss"):
            torch.testing.assert_close(getattr(o, name), getattr(ref, name), atol=1e-5, rtol=1e-5)
        assert int(o.mlm_num_predictions) == int(ref.mlm_num_predictions) == 6
        torch.testing.assert_close(o.seq_relationship_logits[:3], ref.seq_relationship_logits, atol=1e-5, rtol=1e-5)
        assert g.keys() == ref_grads.keys()
        for name in g:
            torch.testing.assert_close(g[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("execution", ["fast", "reference"])
def test_packed_encoder_outputs_and_default_positions(execution):
    torch.manual_seed(1)
    model = bertfast.BertModel(_config()).eval()
    padded = _padded(model.config.vocab_size)
    packed = _pack(padded, tokens=22, slots=6)
    mask = padded["attention_mask"].bool()
    context = reference_execution(model) if execution == "reference" else torch.no_grad()
    with context, torch.no_grad():
        ref = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"],
                    token_type_ids=padded["token_type_ids"])
        args = dict(input_ids=packed["input_ids"], token_type_ids=packed["token_type_ids"],
                    cu_seq_lens_q=packed["cu_seq_lens_q"], max_length_q=S)
        out = model(**args)  # positions counted from 0 in each sequence
        explicit = model(**args, position_ids=model_inputs.packed_positions(
            model_inputs.Packed(packed["cu_seq_lens_q"], S), 22))
    assert out.last_hidden_state.shape == (1, 22, model.config.hidden_size)
    torch.testing.assert_close(out.last_hidden_state[0, :15], ref.last_hidden_state[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(explicit.last_hidden_state, out.last_hidden_state, atol=0, rtol=0)
    assert out.pooler_output.shape == (6, model.config.hidden_size)
    torch.testing.assert_close(out.pooler_output[:3], ref.pooler_output, atol=1e-5, rtol=1e-5)
    assert out.pooler_output[3].abs().sum() > 0              # the dummy tail is a sequence ...
    assert not out.pooler_output[4:].any()                    # ... an empty slot pools to 0


def test_packed_reference_runs_only_the_slots_holding_tokens(monkeypatch):
    """The reference runs a packed row as a padded batch of its non-empty sequences (the spare
    slots would double its memory: the 2026-11-26 H100 bench ran out of 80 GB on BERT-large
    seq-512's packed gate), and still answers for all K slots: the real sequences' attention
    probabilities as the padded batch's (at real queries), zeros at the empty slots, which pool to 0."""
    from bertfast import reference

    torch.manual_seed(2)
    model = bertfast.BertModel(_config()).eval()
    padded = _padded(model.config.vocab_size)
    packed = _pack(padded, tokens=22, slots=8)                # 3 sequences, 1 dummy tail, 4 empty slots
    seen = []
    encoder = reference.encoder
    monkeypatch.setattr(reference, "encoder", lambda bert, ids, mask, *a: seen.append(tuple(ids.shape)) or
                        encoder(bert, ids, mask, *a))
    with reference_execution(model), torch.no_grad():
        ref = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"],
                    token_type_ids=padded["token_type_ids"], output_attentions=True)
        out = model(input_ids=packed["input_ids"], token_type_ids=packed["token_type_ids"],
                    cu_seq_lens_q=packed["cu_seq_lens_q"], max_length_q=S, output_attentions=True)
    assert seen == [(3, S), (4, S)]                           # the padded batch, then the 4 held slots
    assert len(out.attentions) == model.config.num_hidden_layers
    for got, want in zip(out.attentions, ref.attentions):
        assert got.shape == (8,) + tuple(want.shape[1:])
        for b, n in enumerate(LENGTHS):                      # the real queries' rows (padded ones read other inputs)
            torch.testing.assert_close(got[b, :, :n], want[b, :, :n], atol=1e-6, rtol=1e-5)
        assert got[3].any() and not got[4:].any()
    mask = padded["attention_mask"].bool()
    torch.testing.assert_close(out.last_hidden_state[0, :15], ref.last_hidden_state[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.pooler_output[:3], ref.pooler_output, atol=1e-5, rtol=1e-5)
    assert not out.pooler_output[4:].any()


def test_pack_batch_layout_and_errors():
    batch = _padded(100, lengths=[5, 3, 7])
    packed = pack_batch(batch, tokens=30, max_seqlen=S)
    # 15 tokens, then the tail of 15 as dummy sequences of at most 8; slots: 3 + ceil(30 / 8) = 7
    assert packed["cu_seq_lens_q"].tolist() == [0, 5, 8, 15, 23, 30, 30, 30]
    assert packed["next_sentence_label"].tolist()[3:] == [IGNORE_INDEX] * 4
    assert packed["position_ids"][0].tolist() == [*range(5), *range(3), *range(7), *range(8), *range(7)]
    assert packed["input_ids"].shape == (1, 30) and (packed["labels"][0, 15:] == IGNORE_INDEX).all()
    assert "attention_mask" not in packed and packed["max_length_q"] == S
    with pytest.raises(ValueError, match="holds 15 tokens, more than the 12 of the packed row"):
        pack_batch(batch, tokens=12, max_seqlen=S)
    with pytest.raises(ValueError, match="a sequence of 7 tokens, longer than max_seqlen=6"):
        pack_batch(batch, tokens=30, max_seqlen=6)
    with pytest.raises(ValueError, match="need 5 slots, got slots=4"):
        pack_batch(batch, tokens=30, max_seqlen=S, slots=4)
    targets = pack_batch(dict(batch, labels=torch.rand(3)), tokens=30, max_seqlen=S)["labels"]
    assert targets.shape == (7,) and targets[3:].isnan().all()   # float targets: NaN marks no target
    with pytest.raises(ValueError, match="labels holds NaN or infinite per-sequence values"):
        pack_batch(dict(batch, labels=torch.tensor([0.5, float("inf"), 1.0])), tokens=30, max_seqlen=S)


def test_packed_positions_restart_in_each_sequence():
    cu = torch.tensor([0, 3, 3, 7, 9], dtype=torch.int32)
    positions = model_inputs.packed_positions(model_inputs.Packed(cu, 4), 9)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 1]]


def test_packed_classification_heads_match_padded():
    torch.manual_seed(2)
    cfg = _config(num_labels=3)
    padded = _padded(cfg.vocab_size)
    packed = _pack(padded, tokens=20, slots=5)
    common = dict(input_ids=packed["input_ids"], token_type_ids=packed["token_type_ids"],
                  cu_seq_lens_q=packed["cu_seq_lens_q"], max_length_q=S)
    model = bertfast.BertForSequenceClassification(cfg)
    labels = torch.tensor([0, 2, 1])
    slot_labels = torch.tensor([0, 2, 1, IGNORE_INDEX, IGNORE_INDEX])
    ref, ref_grads = _run(model, dict(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"],
                                      token_type_ids=padded["token_type_ids"], labels=labels))
    out, grads = _run(model, dict(common, labels=slot_labels))
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[:3], ref.logits, atol=1e-5, rtol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)

    model = bertfast.BertForTokenClassification(cfg)
    tags = padded["labels"].clamp(min=0) % 3
    ref, _ = _run(model, dict(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"],
                              token_type_ids=padded["token_type_ids"], labels=tags))
    row = torch.full((1, 20), IGNORE_INDEX)
    row[0, :15] = tags[padded["attention_mask"].bool()]
    out, _ = _run(model, dict(common, labels=row))
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("problem_type", ["regression", "multi_label_classification"])
def test_packed_float_targets_leave_out_the_slots_without_one(problem_type):
    """Regression and multi-label targets: pack_batch gives the dummy and empty slots NaN targets,
    which the packed loss leaves out; the real slots give the padded batch's loss and gradients."""
    torch.manual_seed(5)
    num_labels = 1 if problem_type == "regression" else 4
    cfg = _config(num_labels=num_labels, problem_type=problem_type)
    padded = _padded(cfg.vocab_size)
    g = torch.Generator().manual_seed(6)
    targets = (torch.randn(3, generator=g) if num_labels == 1
               else torch.randint(0, 2, (3, num_labels), generator=g).float())
    padded = dict(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"],
                  token_type_ids=padded["token_type_ids"], labels=targets)
    packed = _pack(padded, tokens=20, slots=5)
    assert packed["labels"][:3].equal(targets) and packed["labels"][3:].isnan().all()
    model = bertfast.BertForSequenceClassification(cfg)
    ref, ref_grads = _run(model, padded)
    out, grads = _run(model, packed)
    assert out.loss.isfinite()
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[:3], ref.logits, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    # Unpacked, a NaN target is the caller's error: the loss says so instead of skipping the example.
    nan_target = dict(padded, labels=targets.clone().index_fill_(0, torch.tensor([1]), float("nan")))
    assert model(**nan_target).loss.isnan()
    with pytest.raises(ValueError, match="labels holds NaN or infinite per-sequence values"):
        pack_batch(nan_target, 20, S, 5)


def _qa_positions(lengths, g):
    """A start and an end inside each sequence."""
    start = torch.tensor([int(torch.randint(0, n, (1,), generator=g)) for n in lengths])
    end = torch.tensor([int(torch.randint(int(s), n, (1,), generator=g)) for s, n in zip(start, lengths)])
    return start, end


@pytest.mark.parametrize("execution", ["fast", "reference"])
def test_packed_question_answering_spans_each_sequence(execution):
    """Packed QA: logits [1, T]; the loss is the mean over sequences of each sequence's own span
    loss (its softmax over its own tokens), as the sequences give one at a time with no padding;
    a position outside its sequence and the -100 of the dummy slots count nowhere."""
    torch.manual_seed(7)
    cfg = _config(num_labels=2)
    model = bertfast.BertForQuestionAnswering(cfg)
    padded = _padded(cfg.vocab_size)
    start, end = _qa_positions(LENGTHS, torch.Generator().manual_seed(8))
    start[1] = LENGTHS[1] + 2   # in the padding: ignored in the packed form
    padded = dict(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"],
                  token_type_ids=padded["token_type_ids"], start_positions=start, end_positions=end)
    packed = _pack(padded, tokens=20, slots=5)
    assert packed["start_positions"][3:].eq(IGNORE_INDEX).all()
    context = reference_execution(model) if execution == "reference" else torch.enable_grad()
    with context:
        out, grads = _run(model, packed)
        assert out.start_logits.shape == out.end_logits.shape == (1, 20)
        model.zero_grad(set_to_none=True)
        total, each = 0.0, []
        for r, n in enumerate(LENGTHS):
            one = model(input_ids=padded["input_ids"][r:r + 1, :n],
                        token_type_ids=padded["token_type_ids"][r:r + 1, :n])
            each.append(one.start_logits[0])
            if r != 1:  # sequence 1's start lies in its padding: 2 starts count, and 3 ends
                total = total + torch.nn.functional.cross_entropy(one.start_logits, start[r:r + 1]) / 2 / 2
            total = total + torch.nn.functional.cross_entropy(one.end_logits, end[r:r + 1]) / 3 / 2
        total.backward()
        ref_grads = _grads(model)
    torch.testing.assert_close(out.loss, total, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.start_logits[0, :15], torch.cat(each), atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_packed_question_answering_edge_slots_and_errors():
    torch.manual_seed(9)
    model = bertfast.BertForQuestionAnswering(_config(num_labels=2))
    ids = torch.randint(5, 100, (1, 10))
    cu = torch.tensor([0, 4, 4, 10], dtype=torch.int32)       # an empty slot in the middle
    common = dict(input_ids=ids, cu_seq_lens_q=cu, max_length_q=6)
    nothing = model(**common, start_positions=torch.full((3,), IGNORE_INDEX), end_positions=torch.tensor([4, 0, 6]))
    assert nothing.loss == 0                                  # nothing to learn from: 0, not NaN
    nothing.loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    model.zero_grad(set_to_none=True)
    loss = model(**common, start_positions=torch.tensor([0, 0, 5]), end_positions=torch.tensor([[3], [0], [5]])).loss
    loss.backward()                                           # the empty slot's 0 is outside it: ignored
    assert loss.isfinite() and all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None)
    with pytest.raises(ValueError, match=r"start_positions: expected integer positions, one per packed sequence "
                                         r"\[3\] .* got torch.int64 of shape \(2,\)"):
        model(**common, start_positions=torch.tensor([0, 1]), end_positions=torch.tensor([0, 1, 2]))


def test_packed_multiple_choice_matches_padded():
    """pack_batch keeps each example's choices in consecutive slots and adds num_choices; the
    packed logits of the real examples, the loss and the gradients are the padded batch's."""
    torch.manual_seed(10)
    model = bertfast.BertForMultipleChoice(_config())
    g = torch.Generator().manual_seed(11)
    lengths = torch.tensor([[5, 3, 7], [2, 8, 4]])                   # 2 examples x 3 choices
    padded = dict(input_ids=torch.randint(5, 100, (2, 3, S), generator=g),
                  attention_mask=(torch.arange(S) < lengths[..., None]).long(),
                  token_type_ids=(torch.arange(S) >= 2).long().expand(2, 3, S).clone(), labels=torch.tensor([2, 0]))
    packed = pack_batch(padded, tokens=48, max_seqlen=S, slots=12)
    assert packed["num_choices"] == 3 and packed["labels"].tolist() == [2, 0, IGNORE_INDEX, IGNORE_INDEX]
    assert packed["cu_seq_lens_q"].diff()[:6].tolist() == [5, 3, 7, 2, 8, 4]
    ref, ref_grads = _run(model, padded)
    out, grads = _run(model, packed)
    assert out.logits.shape == (4, 3)
    torch.testing.assert_close(out.logits[:2], ref.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    assert pack_batch(padded, tokens=48, max_seqlen=S)["cu_seq_lens_q"].numel() - 1 == 12  # 6 + 6, in groups of 3
    with pytest.raises(ValueError, match="3 choices per example need slots in groups of 3, got slots=13"):
        pack_batch(padded, tokens=48, max_seqlen=S, slots=13)
    with pytest.raises(ValueError, match=r"labels of shape \(3,\) is neither per token \[2, 3, 8, ...\] nor per "
                                         r"example \[2, ...\]"):
        pack_batch(dict(padded, labels=torch.tensor([0, 1, 2])), tokens=48, max_seqlen=S)
    for wrong in (None, 5, True):
        with pytest.raises(ValueError, match=r"packed sequences need num_choices, .* dividing the 12 slots"):
            model(**dict(packed, num_choices=wrong))
    with pytest.raises(ValueError, match="num_choices=2, but the inputs hold 3 choices"):
        model(**padded, num_choices=2)


def _bad(name):
    ids = torch.randint(5, 100, (1, 10))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    cases = {
        "batch": (dict(input_ids=ids.expand(2, 10), cu_seq_lens_q=cu, max_length_q=6),
                  r"expected inputs of shape \[1, tokens\], got batch 2"),
        "mask": (dict(input_ids=ids, attention_mask=torch.ones(1, 10), cu_seq_lens_q=cu, max_length_q=6),
                 "expected no attention_mask"),
        "no max_length_q": (dict(input_ids=ids, cu_seq_lens_q=cu), "max_length_q: expected a positive int"),
        "stray max_length_q": (dict(input_ids=ids, max_length_q=6), r"packed sequences need cu_seq_lens_q"),
        "float cu": (dict(input_ids=ids, cu_seq_lens_q=cu.float(), max_length_q=6),
                     r"cu_seq_lens_q: expected an integer tensor"),
        "short tail": (dict(input_ids=ids, cu_seq_lens_q=torch.tensor([0, 4, 9], dtype=torch.int32), max_length_q=6),
                       r"cu_seq_lens_q: expected 0 first, 10 \(the packed tokens\) last"),
        "too long": (dict(input_ids=ids, cu_seq_lens_q=cu, max_length_q=5), r"steps in \[0, max_length_q=5\]"),
        "k values": (dict(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=torch.tensor([0, 5, 10], dtype=torch.int32),
                          max_length_q=6), "cu_seq_lens_k: .*expected cu_seq_lens_q's values"),
        "k max": (dict(input_ids=ids, cu_seq_lens_q=cu, max_length_q=6, max_length_k=7),
                  r"max_length_k: .*expected max_length_q \(6\), got 7"),
        "positions": (dict(input_ids=ids, cu_seq_lens_q=cu, max_length_q=600),
                      "sequence length 600 exceeds max_position_embeddings 128"),
    }
    return cases[name]


@pytest.mark.parametrize("case", ["batch", "mask", "no max_length_q", "stray max_length_q", "float cu", "short tail",
                                  "too long", "k values", "k max", "positions"])
def test_bad_packing_is_refused(case):
    kwargs, message = _bad(case)
    model = bertfast.BertModel(_config())
    with pytest.raises(ValueError, match=message):
        model(**kwargs)


def test_k_side_equal_to_q_side_is_accepted():
    model = bertfast.BertModel(_config()).eval()
    ids = torch.randint(5, 100, (1, 10))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    a = model(input_ids=ids, cu_seq_lens_q=cu, max_length_q=6).last_hidden_state
    b = model(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=6,
              max_length_k=6).last_hidden_state
    torch.testing.assert_close(a, b, atol=0, rtol=0)


# ------------------------------------------------------------------ checks on the device
def test_value_checks_mode():
    cpu, meta = torch.zeros(2), torch.zeros(2, device="meta")  # meta stands for an accelerator here
    assert contract.value_checks(cpu) == "host" and contract.value_checks(meta) == "host"
    with contract.checks_on_device():
        assert contract.value_checks(cpu) == "host"            # a host read on CPU costs nothing
        assert contract.value_checks(meta) == "device"
    assert contract.value_checks(meta) == "host"


@pytest.mark.parametrize("device_checks", [False, True])
def test_train_step_asks_for_device_checks(device_checks):
    from bertfast.training.step import TrainStep
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = TrainStep(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), torch.device("cpu"), "fp32",
                     device_checks=device_checks)
    meta = torch.zeros(2, device="meta")  # stands for an accelerator tensor
    assert step.forward(lambda: contract.value_checks(meta), {}) == ("device" if device_checks else "host")


@pytest.mark.parametrize("what", ["input_ids", "token_type_ids", "cu_seq_lens_q", "labels", "next_sentence_label"])
def test_device_checks_assert_and_can_fail(monkeypatch, what):
    """The device form of each check (forced here on CPU, where torch._assert_async raises at once)."""
    cfg = _config()
    model = bertfast.BertForPreTraining(cfg)
    packed = _pack(_padded(cfg.vocab_size), tokens=20, slots=5)
    monkeypatch.setattr(model_inputs, "value_checks", lambda t: "device")
    model(**packed)  # valid: every assert holds
    bad = dict(packed)
    if what == "input_ids":
        bad[what] = packed[what].clone().index_fill_(1, torch.tensor([3]), cfg.vocab_size)
    elif what == "token_type_ids":
        bad[what] = packed[what].clone().fill_(2)
    elif what == "cu_seq_lens_q":
        bad[what] = torch.tensor([0, 5, 8, 19, 20, 20], dtype=torch.int32)  # a step of 11 > max_length_q
    elif what == "labels":
        bad[what] = packed[what].clone().index_fill_(1, torch.tensor([0]), -7)
    else:
        bad[what] = torch.tensor([0, 1, 5, IGNORE_INDEX, IGNORE_INDEX])
    with pytest.raises(RuntimeError, match=what):
        model(**bad)


# ------------------------------------------------------------------ torch.compile
def test_packed_training_step_compiles_fullgraph_without_recompiles():
    torch.manual_seed(3)
    model = bertfast.BertForPreTraining(_config())
    first = _pack(_padded(model.config.vocab_size, seed=0), tokens=20, slots=5)
    second = _pack(_padded(model.config.vocab_size, seed=1, lengths=[2, 8, 6]), tokens=20, slots=5)

    def loss(batch):
        return model(**batch, max_predictions_per_seq=10).loss

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True)  # a graph break is an error
    for batch in (first, second):
        model.zero_grad(set_to_none=True)
        eager = loss(batch)
        eager.backward()
        eager_grads = _grads(model)
        model.zero_grad(set_to_none=True)
        with torch._dynamo.config.patch(error_on_recompile=batch is second):  # new values, same shapes
            got = compiled(batch)
        got.backward()
        torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)
        grads = _grads(model)
        assert grads.keys() == eager_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], eager_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def _fine_tuning_batch(head, vocab_size: int):
    """A packed batch with targets for each fine-tuning head."""
    g = torch.Generator().manual_seed(12)
    padded = _padded(vocab_size)
    padded = dict(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"],
                  token_type_ids=padded["token_type_ids"])
    if head is bertfast.BertForMultipleChoice:
        padded = {k: v[None].expand(2, *v.shape).clone() for k, v in padded.items()}
        return pack_batch(dict(padded, labels=torch.tensor([1, 2])), tokens=48, max_seqlen=S)
    if head is bertfast.BertForQuestionAnswering:
        start, end = _qa_positions(LENGTHS, g)
        return _pack(dict(padded, start_positions=start, end_positions=end), tokens=20, slots=5)
    return _pack(dict(padded, labels=torch.randn(3, generator=g)), tokens=20, slots=5)   # regression


@pytest.mark.parametrize("head", [bertfast.BertForSequenceClassification, bertfast.BertForQuestionAnswering,
                                  bertfast.BertForMultipleChoice], ids=["regression", "qa", "multiple-choice"])
def test_packed_fine_tuning_losses_compile_fullgraph(head):
    """The packed losses added for fine-tuning (NaN-masked targets, per-sequence spans, choice groups)
    read nothing back to the host: torch.compile(fullgraph=True) takes them whole."""
    torch.manual_seed(13)
    model = head(_config(num_labels=1 if head is bertfast.BertForSequenceClassification else 2))
    batch = _fine_tuning_batch(head, model.config.vocab_size)

    def loss(b):
        return model(**b).loss

    eager = loss(batch)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(loss, fullgraph=True)(batch), eager, atol=1e-5, rtol=1e-5)
    assert eager.isfinite() and eager > 0


def test_transformers_flattening_collator_feeds_the_model():
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True): its batch, as given, encodes each
    sequence as the padded batch does."""
    from transformers import DataCollatorWithFlattening

    torch.manual_seed(4)
    model = bertfast.BertModel(_config()).eval()
    sequences = [[2, 17, 33, 9, 3], [2, 41, 3], [2, 8, 8, 15, 27, 11, 3]]
    flat = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": s} for s in sequences], return_tensors="pt")
    flat.pop("labels")  # the collator's causal-LM labels; BertModel takes none
    padded = torch.zeros(3, 7, dtype=torch.long)
    mask = torch.zeros(3, 7, dtype=torch.long)
    for r, s in enumerate(sequences):
        padded[r, :len(s)], mask[r, :len(s)] = torch.tensor(s), 1
    with torch.no_grad():
        out = model(**flat)
        ref = model(input_ids=padded, attention_mask=mask)
    torch.testing.assert_close(out.last_hidden_state[0], ref.last_hidden_state[mask.bool()], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.pooler_output, ref.pooler_output, atol=1e-5, rtol=1e-5)
