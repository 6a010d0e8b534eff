"""ELECTRA through the fused encoder against transformers' own classes, fp32 on CPU: every class,
with the embeddings projection (embedding_size below the hidden size) and without; outputs at real
tokens within 1e-5, losses within 1e-5, each parameter's gradient within 1e-4 of its norm; then
the Auto classes, the Triton kernels, pipelines, Trainer, PEFT LoRA, sentence-transformers and
torch.compile, with bertfast's demo WordPiece vocabulary as the tokenizer."""
from importlib import resources

import pytest
import torch
from family_helpers import (SIDES, Auto, assert_loss_and_grads_match, assert_pipeline_matches, compile_fresh,
                            labels_for, main_output, make_inputs, twin)

import bertfast

transformers = pytest.importorskip("transformers")

HEADS = ("Model", "ForPreTraining", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification",
         "ForQuestionAnswering", "ForMultipleChoice")
TEXTS = ["Return the value of the module.", "The function is called with a list.", "Short one."]
VOCAB = 4096  # the demo vocabulary's


def make_config(embedding_size=16, **extra):
    values = dict(vocab_size=VOCAB, embedding_size=embedding_size, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=40, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, summary_last_dropout=0.0, num_labels=2)
    values.update(extra)
    return transformers.ElectraConfig(**values)


def build(head, seed=0, **extra):
    torch.manual_seed(seed)
    return getattr(bertfast, "Electra" + head)(make_config(**extra))


def first_token_expected(head, hf, ids, mask):
    """transformers' head at each sequence's first real token (it reads position 0)."""
    flat_ids, flat_mask = ids.reshape(-1, ids.shape[-1]), mask.reshape(-1, mask.shape[-1])
    hidden = hf.electra(input_ids=flat_ids, attention_mask=flat_mask).last_hidden_state
    first = hidden[torch.arange(len(hidden)), flat_mask.argmax(dim=1)][:, None]
    if head == "ForSequenceClassification":
        return hf.classifier(first)
    return hf.classifier(hf.sequence_summary(first)).view(ids.shape[0], -1)


@pytest.mark.parametrize("embedding_size", [16, 32])
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("head", HEADS)
def test_every_class_matches_transformers(head, side, embedding_size):
    model = build(head, embedding_size=embedding_size).eval()
    assert hasattr(model.base_model, "embeddings_project") == (embedding_size != 32)
    hf = twin(model, "Electra" + head)
    ids, mask = make_inputs(0, VOCAB, side, choices=3 if head == "ForMultipleChoice" else None)
    ours = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    theirs = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    a, b = main_output(head, ours), main_output(head, theirs)
    assert torch.isfinite(a).all()
    if head in ("ForSequenceClassification", "ForMultipleChoice"):
        torch.testing.assert_close(a, b if side == "right" else first_token_expected(head, hf, ids, mask),
                                   atol=1e-5, rtol=0)
        return
    real = mask.bool()
    torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=0)
    assert len(ours.hidden_states) == len(theirs.hidden_states) == 3  # the projected embeddings first
    for x, y in zip(ours.hidden_states, theirs.hidden_states):
        torch.testing.assert_close(x[real], y[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("head", [h for h in HEADS if h != "Model"])
def test_losses_and_gradients_match_transformers(head):
    model = build(head, seed=2).train()  # dropout 0: train mode is deterministic
    hf = twin(model, "Electra" + head).train()
    ids, mask = make_inputs(0, VOCAB, "right", seed=3, choices=3 if head == "ForMultipleChoice" else None)
    if head == "ForQuestionAnswering":  # with padding the span softmax differs (the README's drop-in table)
        ids, mask = torch.where(mask.bool(), ids, 5), torch.ones_like(mask)
    assert_loss_and_grads_match(model, hf, head, ids, mask)


def test_discriminator_loss_counts_only_the_masks_tokens_and_is_zero_without_any():
    model = build("ForPreTraining").eval()
    ids, mask = make_inputs(0, VOCAB, "left", seed=4)
    labels = labels_for("ForPreTraining", ids, mask)["labels"]
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    flipped = torch.where(mask.bool(), labels, 1 - labels)  # labels at padding change nothing
    assert model(input_ids=ids, attention_mask=mask, labels=flipped).loss == loss
    empty = model(input_ids=ids, attention_mask=torch.zeros_like(mask), labels=labels)
    assert empty.loss == 0 and torch.isfinite(empty.logits).all()


def test_checkpoints_of_transformers_load_with_every_key(tmp_path):
    torch.manual_seed(0)
    hf = transformers.ElectraForMaskedLM(make_config())
    hf.save_pretrained(tmp_path)
    model, info = bertfast.ElectraForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    assert model.generator_lm_head.weight is model.electra.embeddings.word_embeddings.weight
    ours = model.state_dict()
    for key, value in hf.state_dict().items():
        torch.testing.assert_close(ours[key], value, atol=0, rtol=0)


def test_unserved_settings_are_clear_errors():
    with pytest.raises(ValueError, match="summary_type must be 'first'.*got 'mean'"):
        bertfast.ElectraForMultipleChoice(make_config(summary_type="mean"))
    with pytest.raises(ValueError, match="ElectraModel has no pooler"):
        bertfast.ElectraModel(make_config(), add_pooling_layer=True)
    with pytest.raises(ValueError, match="expected a transformers ElectraConfig, got .*BertConfig"):
        bertfast.ElectraModel(transformers.BertConfig(hidden_size=32, num_attention_heads=4))
    model = build("Model").eval()
    with pytest.raises(ValueError, match=r"inputs_embeds: expected \[batch, seq_len, 16\]"):
        model(inputs_embeds=torch.zeros(1, 4, 32))
    ids, mask = make_inputs(0, VOCAB, "left", seed=5)
    embeds = model.embeddings.word_embeddings(ids)
    torch.testing.assert_close(model(inputs_embeds=embeds, attention_mask=mask).last_hidden_state,
                               model(input_ids=ids, attention_mask=mask).last_hidden_state, atol=1e-6, rtol=0)


def test_register_auto_builds_electra_models():
    config = make_config()
    bertfast.register_auto()
    try:
        for auto, head in (("AutoModel", "Model"), ("AutoModelForPreTraining", "ForPreTraining"),
                           ("AutoModelForMaskedLM", "ForMaskedLM"),
                           ("AutoModelForMultipleChoice", "ForMultipleChoice")):
            assert type(getattr(transformers, auto).from_config(config)) is getattr(bertfast, "Electra" + head)
    finally:
        bertfast.unregister_auto()
    assert type(transformers.AutoModelForPreTraining.from_config(config)) is transformers.ElectraForPreTraining


@pytest.mark.gpu_capable
def test_triton_kernels_match_the_reference():
    """Every op on the Triton backend (the interpreter on a CPU): the generator's loss and
    gradients, through the embeddings projection, against the reference encoder and head."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build("ForMaskedLM").to(device).train()
    ids, mask = make_inputs(0, VOCAB, "mixed", batch=3, seqlen=12, seed=6)
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


# ------------------------------------------------------------------ what users run it in
@pytest.fixture(scope="module")
def tokenizer():
    words = resources.files("bertfast.data").joinpath("demo_vocab.txt").read_text().splitlines()
    return transformers.BertTokenizer(vocab={w: i for i, w in enumerate(words)})


def checkpoint(head, tokenizer, tmp_path, **extra):
    torch.manual_seed(0)
    path = tmp_path / head
    getattr(transformers, "Electra" + head)(make_config(**extra)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("task, head", [("feature-extraction", "Model"), ("fill-mask", "ForMaskedLM"),
                                        ("text-classification", "ForSequenceClassification"),
                                        ("token-classification", "ForTokenClassification")])
def test_pipelines_match_transformers(task, head, tokenizer, tmp_path):
    texts = [t.replace("value", "[MASK]") for t in TEXTS[:1]] if task == "fill-mask" else TEXTS
    assert_pipeline_matches(task, checkpoint(head, tokenizer, tmp_path), texts, getattr(bertfast, "Electra" + head))


def test_peft_lora_trains_exactly_as_on_transformers(tokenizer, tmp_path):
    peft = pytest.importorskip("peft")
    path = checkpoint("ForSequenceClassification", tokenizer, tmp_path)
    lora = dict(r=4, lora_alpha=64, target_modules=["query", "value"], init_lora_weights=False)
    models = []
    for module in (bertfast, transformers):
        torch.manual_seed(1)
        base = module.ElectraForSequenceClassification.from_pretrained(path).eval()
        models.append(peft.get_peft_model(base, peft.LoraConfig(task_type="SEQ_CLS", **lora)))
    ours, theirs = models
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    labels = torch.tensor([0, 1, 0])
    ours_out, theirs_out = ours(**batch, labels=labels), theirs(**batch, labels=labels)
    torch.testing.assert_close(ours_out.logits, theirs_out.logits, atol=1e-5, rtol=0)
    ours_out.loss.backward()
    theirs_out.loss.backward()
    their_grads = {n: p.grad for n, p in theirs.named_parameters() if "lora_" in n}
    lora_grads = [(n, p.grad) for n, p in ours.named_parameters() if "lora_" in n]
    assert lora_grads and len(lora_grads) == len(their_grads)
    for name, grad in lora_grads:
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, their_grads[name], atol=1e-5, rtol=1e-3, msg=name)


def test_trainer_trains_like_transformers(tokenizer, tmp_path):
    pytest.importorskip("accelerate")
    path = checkpoint("ForSequenceClassification", tokenizer, tmp_path)
    rows = [{"text": t, "label": i % 2} for i, t in enumerate(TEXTS * 4)]

    def collate(batch):
        encoded = tokenizer([r["text"] for r in batch], padding=True, return_tensors="pt")
        return {**encoded, "labels": torch.tensor([r["label"] for r in batch])}
    losses = []
    for module in (bertfast, transformers):
        args = transformers.TrainingArguments(output_dir=str(tmp_path / module.__name__), per_device_train_batch_size=4,
                                              num_train_epochs=2, learning_rate=1e-3, logging_steps=1, report_to=[],
                                              use_cpu=True, save_strategy="no", seed=0, data_seed=0,
                                              disable_tqdm=True, remove_unused_columns=False)
        trainer = transformers.Trainer(model=module.ElectraForSequenceClassification.from_pretrained(path), args=args,
                                       train_dataset=rows, data_collator=collate)
        trainer.train()
        losses.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
    assert len(losses[0]) == len(losses[1]) > 2
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)  # no accumulation: the same losses step by step


def test_sentence_transformers_and_torch_compile(tokenizer, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    try:
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:  # sentence-transformers before 5.2
        from sentence_transformers.models import Pooling, Transformer
    path = checkpoint("Model", tokenizer, tmp_path)

    def encoder():
        word = Transformer(path)
        return st.SentenceTransformer(modules=[word, Pooling(word.get_word_embedding_dimension())], device="cpu")
    theirs = encoder()
    with Auto():
        ours = encoder()
    assert any(type(m) is bertfast.ElectraModel for m in ours.modules())
    torch.testing.assert_close(ours.encode(TEXTS, convert_to_tensor=True), theirs.encode(TEXTS, convert_to_tensor=True),
                               atol=1e-5, rtol=0)
    model = build("ForMaskedLM", num_hidden_layers=1)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    labels = torch.where(batch["attention_mask"].bool(), batch["input_ids"], -100)
    eager = model(**batch, labels=labels)
    compiled = compile_fresh(model)(**batch, labels=labels)
    torch._dynamo.reset()  # nothing of this compile left to the tests after it
    torch.testing.assert_close(compiled.loss, eager.loss, atol=1e-5, rtol=0)
