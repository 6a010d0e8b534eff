"""transformers-style model tests for every bertfast class (after transformers' common model tests).

Each class is a transformers PreTrainedModel: save/load round trips (safetensors, shards,
.bin), loading info, dtype, embedding resize and tying, gradient checkpointing, hidden
states and return_dict from the config, inputs_embeds, problem types, training, module
semantics (hooks, replaced Linears, quantized modules) and the padded-label rule.
"""

import pytest
import torch
import torch.nn as nn

import bertfast
from bertfast.model.task_models import MODEL_CLASSES

transformers = pytest.importorskip("transformers")

CLASSES = sorted(MODEL_CLASSES)
SEQ = 9


def config(**extra):
    values = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    values.update(extra)
    return bertfast.BertConfig.preset("tiny", **values)


def inputs(cls_name, batch=3, seqlen=SEQ, seed=0, labels=False, cfg=None):
    """Forward keywords for one class, padding in the last two sequences; labels on real tokens only."""
    cfg = cfg or config()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, cfg.vocab_size, (batch, seqlen), generator=gen)
    mask = torch.ones(batch, seqlen, dtype=torch.long)
    mask[1, seqlen - 3:] = 0
    mask[2, 2:] = 0
    kw = dict(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids))
    if labels:
        if cls_name in ("BertForMaskedLM", "BertForPreTraining", "BertForTokenClassification"):
            high = cfg.vocab_size if cls_name != "BertForTokenClassification" else cfg.num_labels
            lab = torch.randint(0, high, (batch, seqlen), generator=gen)
            kw["labels"] = lab.masked_fill(mask == 0, -100)
        elif cls_name == "BertForSequenceClassification":
            kw["labels"] = torch.randint(0, cfg.num_labels, (batch,), generator=gen)
        elif cls_name == "BertForMultipleChoice":
            kw["labels"] = torch.randint(0, 2, (batch,), generator=gen)
        elif cls_name == "BertForQuestionAnswering":
            kw["start_positions"] = torch.tensor([1, 2, 0])[:batch]
            kw["end_positions"] = torch.tensor([3, 4, 1])[:batch]
        if cls_name == "BertForPreTraining":
            kw["next_sentence_label"] = torch.randint(0, 2, (batch,), generator=gen)
    if cls_name == "BertForMultipleChoice":  # [B, C=2, S]: the second choice reverses the tokens
        kw = {k: (torch.stack([v, v.flip(1) if k == "input_ids" else v], dim=1) if v.dim() == 2 else v)
              for k, v in kw.items()}
    return kw


def first_output(out):
    return out[0] if not hasattr(out, "keys") else next(iter(out.values()))


def build(cls_name, **extra):
    torch.manual_seed(0)
    return getattr(bertfast, cls_name)(config(**extra)).eval()


# ---------------------------------------------------------------- PreTrainedModel machinery
@pytest.mark.parametrize("cls_name", CLASSES)
def test_is_a_transformers_bert_model(cls_name):
    model = build(cls_name)
    assert isinstance(model, transformers.PreTrainedModel)
    assert isinstance(model, transformers.models.bert.modeling_bert.BertPreTrainedModel)
    assert model.base_model is (model if cls_name == "BertModel" else model.bert)
    assert model.get_input_embeddings() is model.base_model.embeddings.word_embeddings
    assert not model.can_generate()
    if cls_name in ("BertForMaskedLM", "BertForPreTraining"):
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("cls_name", CLASSES)
def test_save_load_round_trip_and_transformers_reads_it(cls_name, tmp_path):
    model = build(cls_name)
    kw = inputs(cls_name)
    model.save_pretrained(tmp_path)
    again = getattr(bertfast, cls_name).from_pretrained(tmp_path).eval()
    theirs = getattr(transformers, cls_name).from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        ours, back, hf = model(**kw), again(**kw), theirs(**kw)
    assert list(ours.keys()) == list(hf.keys())
    valid = kw["attention_mask"].bool()
    for key in ours.keys():
        torch.testing.assert_close(back[key], ours[key], atol=1e-6, rtol=0)
    # transformers' padded rows differ by design (bertfast's are zeros): compare real tokens / pooled outputs.
    a, b = first_output(ours), first_output(hf)
    if a.shape[:-1] == valid.shape or a.shape == valid.shape:
        a, b = a[valid], b[valid]
    torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


def test_sharded_and_bin_checkpoints_load(tmp_path):
    model = build("BertForPreTraining")
    kw = inputs("BertForPreTraining")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    from safetensors.torch import load_file
    model.save_pretrained(tmp_path / "bin")
    state = load_file(tmp_path / "bin" / "model.safetensors")
    (tmp_path / "bin" / "model.safetensors").unlink()
    torch.save(state, tmp_path / "bin" / "pytorch_model.bin")
    with torch.no_grad():
        want = model(**kw).prediction_logits
        for sub in ("sharded", "bin"):
            got = bertfast.BertForPreTraining.from_pretrained(tmp_path / sub).eval()(**kw).prediction_logits
            torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_head_checkpoint_loads_base_and_reports_what_it_left(tmp_path):
    build("BertForPreTraining").save_pretrained(tmp_path)
    model, info = bertfast.BertForSequenceClassification.from_pretrained(tmp_path, num_labels=5,
                                                                         output_loading_info=True)
    assert model.classifier.out_features == 5
    assert set(info["missing_keys"]) == {"classifier.weight", "classifier.bias"}
    assert any(k.startswith("cls.") for k in info["unexpected_keys"])
    # a classifier of another size: an error, or re-initialised with ignore_mismatched_sizes
    model.save_pretrained(tmp_path / "five")
    with pytest.raises(Exception, match="size mismatch|ignore_mismatched_sizes"):
        bertfast.BertForSequenceClassification.from_pretrained(tmp_path / "five", num_labels=2)
    two = bertfast.BertForSequenceClassification.from_pretrained(tmp_path / "five", num_labels=2,
                                                                 ignore_mismatched_sizes=True)
    assert two.classifier.out_features == 2


def test_state_dict_argument_and_add_pooling_layer(tmp_path):
    source = build("BertModel")
    source.save_pretrained(tmp_path)
    model = bertfast.BertModel.from_pretrained(None, config=source.config, state_dict=source.state_dict(),
                                               add_pooling_layer=False)
    assert model.pooler is None
    torch.testing.assert_close(model.embeddings.word_embeddings.weight, source.embeddings.word_embeddings.weight)
    model.save_pretrained(tmp_path / "again")
    import json
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert "add_pooling_layer" not in saved and "attn_implementation" not in saved


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bfloat16", "auto"])
def test_dtype_on_load_and_save(dtype, tmp_path):
    build("BertModel").to(torch.float16).save_pretrained(tmp_path)
    model = bertfast.BertModel.from_pretrained(tmp_path, dtype=dtype)
    assert model.dtype == (torch.float16 if dtype == "auto" else torch.bfloat16)
    model.save_pretrained(tmp_path / "again")  # a dtype in config.json never breaks saving
    assert bertfast.BertModel.from_pretrained(tmp_path / "again", dtype="auto").dtype == model.dtype


def test_device_map_loads(tmp_path):
    pytest.importorskip("accelerate")
    build("BertModel").save_pretrained(tmp_path)
    assert bertfast.BertModel.from_pretrained(tmp_path, device_map="cpu").device.type == "cpu"


def test_attention_implementations_of_transformers_are_refused(tmp_path):
    build("BertModel").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="does not support"):
        bertfast.BertModel.from_pretrained(tmp_path, attn_implementation="sdpa")


@pytest.mark.parametrize("cls_name", ["BertForMaskedLM", "BertForPreTraining", "BertModel"])
def test_resize_token_embeddings_keeps_weights_tied(cls_name):
    model = build(cls_name)
    model.resize_token_embeddings(600)
    assert model.config.vocab_size == 600
    assert model.get_input_embeddings().weight.shape[0] == 600
    if cls_name != "BertModel":
        decoder = model.get_output_embeddings()
        assert decoder.weight is model.get_input_embeddings().weight
        assert decoder.bias.shape == (600,) and decoder.bias is model.cls.predictions.bias
    ids = torch.tensor([[1, 599, 598, 2]])
    out = model(ids, labels=ids) if cls_name != "BertModel" else model(ids)
    if cls_name != "BertModel":
        assert torch.isfinite(out.loss if cls_name == "BertForMaskedLM" else out.mlm_loss)


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("cls_name", ["BertForMaskedLM", "BertForSequenceClassification"])
def test_gradient_checkpointing_gives_the_same_gradients(cls_name, use_reentrant):
    """With dropout on: checkpointing replays the layer's random state, so gradients match exactly.
    (Both runs call enable_input_require_grads, whose embedding hook checkpointing may add, so both
    take the same, hooked, embedding path.)"""
    def run(checkpointing):
        model = build(cls_name, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1).train()
        model.enable_input_require_grads()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
            assert model.is_gradient_checkpointing
        torch.manual_seed(1)
        model(**inputs(cls_name, labels=True)).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = run(False), run(True)
    assert plain.keys() == checkpointed.keys() and len(plain) > 30
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)


def test_enable_input_require_grads_reaches_the_embeddings():
    """PEFT's hook on the input embeddings runs (the fused embedding op would bypass it)."""
    model = build("BertModel").train()
    for p in model.parameters():
        p.requires_grad_(False)
    model.enable_input_require_grads()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    out = model(**inputs("BertModel")).last_hidden_state
    assert out.requires_grad


@pytest.mark.parametrize("cls_name", CLASSES)
def test_hidden_states_and_return_dict_from_the_config(cls_name):
    model = build(cls_name, output_hidden_states=True, return_dict=False)
    out = model(**inputs(cls_name))
    assert isinstance(out, tuple)
    states = out[-1]
    assert len(states) == model.config.num_hidden_layers + 1
    twin = build(cls_name)
    dict_out = twin(**inputs(cls_name), output_hidden_states=True)
    assert len(dict_out.to_tuple()) == len(out)
    torch.testing.assert_close(dict_out.hidden_states[-1], states[-1], atol=0, rtol=0)


@pytest.mark.parametrize("cls_name", CLASSES)
def test_inputs_embeds_equal_input_ids(cls_name):
    model = build(cls_name)
    kw = inputs(cls_name)
    ids = kw.pop("input_ids")
    embeds = model.get_input_embeddings()(ids)
    with torch.no_grad():
        a, b = model(input_ids=ids, **kw), model(inputs_embeds=embeds, **kw)
    for key in a.keys():
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=0)


@pytest.mark.parametrize("problem_type, labels", [
    ("regression", torch.tensor([[0.5], [1.5], [-1.0]])),
    ("single_label_classification", torch.tensor([0, 2, 1])),
    ("multi_label_classification", torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]])),
])
def test_problem_types_match_transformers(problem_type, labels, tmp_path):
    num_labels = 1 if problem_type == "regression" else 3
    model = build("BertForSequenceClassification", num_labels=num_labels, problem_type=problem_type)
    model.save_pretrained(tmp_path)
    hf = transformers.BertForSequenceClassification.from_pretrained(tmp_path, attn_implementation="eager").eval()
    kw = inputs("BertForSequenceClassification")
    torch.testing.assert_close(model(**kw, labels=labels).loss, hf(**kw, labels=labels).loss, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- batches with nothing to learn from (issue 16)
def _nothing_to_learn(cls_name, case):
    """(model, forward keywords): every label ignored, or an empty batch with labels."""
    extra = {}
    if cls_name.endswith(("regression", "multi_label")):
        cls_name, problem = cls_name.split(":")
        extra = dict(num_labels=1 if problem == "regression" else 3, problem_type=problem + (
            "_classification" if problem == "multi_label" else ""))
    model = build(cls_name, **extra).train()
    kw = inputs(cls_name, labels=True, cfg=config(**extra))
    if "problem_type" in extra:
        kw["labels"] = torch.rand(3, extra["num_labels"]).round()
    if case == "empty batch":
        return model, {k: v[:0] for k, v in kw.items()}
    for key in ("labels", "next_sentence_label"):
        if key in kw:
            kw[key] = torch.full_like(kw[key], -100)
    if cls_name == "BertForQuestionAnswering":  # positions past the sequence are ignored (transformers' rule)
        kw["start_positions"], kw["end_positions"] = torch.full((3,), SEQ + 4), torch.full((3,), SEQ + 1)
    return model, kw


LOSS_CLASSES = [c for c in CLASSES if c != "BertModel"]


@pytest.mark.parametrize("case, cls_name", [("all ignored", c) for c in LOSS_CLASSES] + [
    ("empty batch", c) for c in LOSS_CLASSES + ["BertForSequenceClassification:regression",
                                                 "BertForSequenceClassification:multi_label"]])
def test_a_batch_with_nothing_to_learn_from_gives_zero_loss_and_zero_gradients(case, cls_name):
    """bertfast's choice (README, drop-in table): transformers' loss is NaN here, bertfast's 0, so
    an optimizer step on such a batch changes nothing instead of writing NaN into the weights."""
    model, kw = _nothing_to_learn(cls_name, case)
    out = model(**kw)
    assert out.loss.item() == 0.0
    for extra in ("mlm_loss", "nsp_loss"):
        if getattr(out, extra, None) is not None:
            assert getattr(out, extra).item() == 0.0
    out.loss.backward()
    nonzero = [n for n, p in model.named_parameters() if p.grad is not None and torch.count_nonzero(p.grad)]
    assert not nonzero, nonzero


def test_some_ignored_labels_give_transformers_mean(tmp_path):
    """The zero-safe means equal transformers' wherever transformers' loss is finite."""
    model = build("BertForPreTraining")
    model.save_pretrained(tmp_path)
    hf = transformers.BertForPreTraining.from_pretrained(tmp_path, attn_implementation="eager").eval()
    kw = dict(input_ids=inputs("BertForPreTraining")["input_ids"], labels=torch.full((3, SEQ), -100),
              next_sentence_label=torch.tensor([1, -100, 0]))
    kw["labels"][0, 2], kw["labels"][2, 5] = 7, 11
    with torch.no_grad():
        torch.testing.assert_close(model(**kw).loss, hf(**kw).loss, atol=2e-5, rtol=0)


# ---------------------------------------------------------------- ids of one row broadcast (issue 16)
@pytest.mark.parametrize("cls_name", ["BertModel", "BertForMultipleChoice"])
def test_position_and_token_type_ids_of_one_row_broadcast_as_in_transformers(cls_name, tmp_path):
    model = build(cls_name)
    model.save_pretrained(tmp_path)
    hf = getattr(transformers, cls_name).from_pretrained(tmp_path, attn_implementation="eager").eval()
    kw = inputs(cls_name)
    del kw["attention_mask"], kw["token_type_ids"]  # no padding: transformers' padded rows differ by design
    # positions that run on by one (from 3): restarts without an attention mask are packed sequences
    # (tests/test_position_packing.py)
    row = dict(position_ids=torch.arange(SEQ)[None] + 3, token_type_ids=(torch.arange(SEQ)[None] > 4).long())
    full = {k: v.expand(kw["input_ids"].shape) for k, v in row.items()}
    with torch.no_grad():
        ours, expanded, theirs = model(**kw, **row), model(**kw, **full), hf(**kw, **row)
    for key in ours.keys():
        torch.testing.assert_close(ours[key], expanded[key], atol=0, rtol=0)
        torch.testing.assert_close(ours[key], theirs[key], atol=2e-5, rtol=0)


@pytest.mark.parametrize("cls_name", CLASSES)
def test_training_steps_lower_the_loss_and_reach_every_used_weight(cls_name):
    if cls_name == "BertModel":
        pytest.skip("BertModel has no loss")
    model = build(cls_name).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kw = inputs(cls_name, labels=True)
    losses = []
    for step in range(8):
        opt.zero_grad()
        loss = model(**kw).loss
        loss.backward()
        if step == 0:
            unreached = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum()]
            unreached = [n for n in unreached if "pooler" not in n and "token_type" not in n]
            assert not unreached, unreached
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


# ---------------------------------------------------------------- module semantics
def _all_hooks(model, fired):
    return [m.register_forward_hook(lambda mod, args, out, name=name: fired.append(name))
            for name, m in model.named_modules() if name]


def test_hooks_fire_on_every_module_transformers_calls(tmp_path):
    """With a hook on every module nothing is fused away: each module transformers' BERT calls
    (and that bertfast has) runs, and the output still matches transformers."""
    model = build("BertForSequenceClassification")
    model.save_pretrained(tmp_path)
    hf = transformers.BertForSequenceClassification.from_pretrained(tmp_path, attn_implementation="eager").eval()
    kw = inputs("BertForSequenceClassification")
    ours_fired, hf_fired = [], []
    _all_hooks(model, ours_fired)
    _all_hooks(hf, hf_fired)
    with torch.no_grad():
        ours, theirs = model(**kw), hf(**kw)
    torch.testing.assert_close(ours.logits, theirs.logits, atol=2e-5, rtol=0)
    our_modules = {n for n, _ in model.named_modules()}
    expected = {n for n in hf_fired if n in our_modules}
    assert expected - set(ours_fired) == set()
    assert len(set(ours_fired)) >= 0.9 * len(set(hf_fired))


@pytest.mark.parametrize("name", ["bert.embeddings.word_embeddings", "bert.encoder.layer.0.attention.self.query",
                                  "bert.encoder.layer.1.intermediate.dense", "bert.encoder.layer.0.output.LayerNorm",
                                  "cls.predictions.transform.dense", "cls.predictions.decoder"])
def test_a_hook_on_one_module_fires_and_can_change_the_output(name):
    model = build("BertForMaskedLM")
    kw = inputs("BertForMaskedLM", labels=True)
    with torch.no_grad():
        before = model(**kw).loss
        fired = []

        def hook(module, args, out):  # a shift, not a scale: LayerNorm would undo a scale
            fired.append(name)
            return out + torch.linspace(-10, 10, out.shape[-1])

        handle = model.get_submodule(name).register_forward_hook(hook)
        after = model(**kw).loss
        handle.remove()
        again = model(**kw).loss
    assert fired == [name]
    assert not torch.allclose(before, after)
    torch.testing.assert_close(again, before, atol=0, rtol=0)


class _ScaledLinear(nn.Linear):
    """A Linear subclass whose forward differs: it must be called, never fused as a plain Linear."""

    def forward(self, x):
        return super().forward(x) * 2.0


def test_a_replaced_linear_is_called_as_a_module():
    model = build("BertModel")
    kw = inputs("BertModel")
    with torch.no_grad():
        base = model(**kw).last_hidden_state
        layer = model.encoder.layer[0].attention.self
        scaled = _ScaledLinear(layer.value.in_features, layer.value.out_features)
        scaled.load_state_dict(layer.value.state_dict())
        layer.value = scaled
        changed = model(**kw).last_hidden_state
        with bertfast.reference_execution(model):
            reference = model(**kw).last_hidden_state
    valid = kw["attention_mask"].bool()
    assert (changed - base)[valid].abs().max() > 1e-3
    torch.testing.assert_close(changed[valid], reference[valid], atol=1e-5, rtol=0)


def test_dynamic_quantization_runs_the_quantized_modules(tmp_path):
    model = build("BertForSequenceClassification")
    model.save_pretrained(tmp_path)
    hf = transformers.BertForSequenceClassification.from_pretrained(tmp_path, attn_implementation="eager").eval()
    quantize = torch.ao.quantization.quantize_dynamic
    ours, theirs = quantize(model, {nn.Linear}, dtype=torch.qint8), quantize(hf, {nn.Linear}, dtype=torch.qint8)
    kw = inputs("BertForSequenceClassification")
    with torch.no_grad():
        got, want, unquantized = ours(**kw).logits, theirs(**kw).logits, model(**kw).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert (got - unquantized).abs().max() > 0  # the quantized Linears ran


# ---------------------------------------------------------------- labels at padded positions
def test_mlm_labels_at_padding_are_ignored_on_every_path():
    model = build("BertForMaskedLM")
    kw = inputs("BertForMaskedLM", labels=True)
    padded = kw["attention_mask"] == 0
    noisy = dict(kw, labels=kw["labels"].masked_fill(padded, 7))
    with torch.no_grad():
        want = model(**kw).loss
        fast = model(**noisy)
        static = model(**noisy, max_predictions_per_seq=SEQ)
        with bertfast.reference_execution(model):
            reference = model(**noisy).loss
    for got in (fast.loss, static.loss, reference):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert int(fast.mlm_num_predictions) == int((kw["labels"] != -100).sum())


def test_token_classification_labels_at_padding_are_ignored():
    model = build("BertForTokenClassification")
    kw = inputs("BertForTokenClassification", labels=True)
    noisy = dict(kw, labels=kw["labels"].masked_fill(kw["attention_mask"] == 0, 1))
    with torch.no_grad():
        torch.testing.assert_close(model(**noisy).loss, model(**kw).loss, atol=0, rtol=0)


def test_trainer_keywords_are_accepted_and_foreign_ones_refused():
    model = build("BertForSequenceClassification")
    kw = inputs("BertForSequenceClassification", labels=True)
    torch.testing.assert_close(model(**kw, num_items_in_batch=torch.tensor(7)).loss, model(**kw).loss)
    with pytest.raises(ValueError, match="encoder only"):
        model(**kw, encoder_hidden_states=torch.zeros(3, SEQ, 64))
    with pytest.raises(ValueError, match="head_mask"):
        model(**kw, head_mask=torch.ones(2, 4))
