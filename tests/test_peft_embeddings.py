"""PEFT LoRA on the word embeddings (common when adding tokens), on bertfast as on transformers."""
import tempfile

import pytest
import torch

import bertfast

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def test_lora_on_word_embeddings_runs_and_trains_as_on_transformers():
    torch.manual_seed(0)
    config = bertfast.BertConfig.preset("tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    base = bertfast.BertForSequenceClassification(config)
    with tempfile.TemporaryDirectory() as tmp:
        base.save_pretrained(tmp)
        models = []
        for cls in (bertfast.BertForSequenceClassification, transformers.BertForSequenceClassification):
            torch.manual_seed(1)  # the same random LoRA weights in both
            model = cls.from_pretrained(tmp, attn_implementation="eager").eval()
            lora = peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, init_lora_weights=False,
                                   target_modules=["word_embeddings"])
            models.append(peft.get_peft_model(model, lora))
    ours, theirs = models
    gen = torch.Generator().manual_seed(2)
    mask = torch.tensor([[1] * 10, [1] * 6 + [0] * 4])
    ids = torch.randint(5, config.vocab_size, (2, 10), generator=gen) * mask
    labels = torch.tensor([0, 1])
    with torch.no_grad():
        assert (ours(input_ids=ids, attention_mask=mask).logits - base.eval()(input_ids=ids, attention_mask=mask)
                .logits).abs().max() > 1e-4  # the adapter is not bypassed
    a = ours(input_ids=ids, attention_mask=mask, labels=labels)
    b = theirs(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=0)
    a.loss.backward()
    b.loss.backward()
    grads = {n: p.grad for n, p in ours.named_parameters() if "lora_" in n}
    theirs_grads = {n: p.grad for n, p in theirs.named_parameters() if "lora_" in n}
    assert grads and grads.keys() == theirs_grads.keys()
    for name, grad in grads.items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, theirs_grads[name], atol=1e-5, rtol=1e-4, msg=name)
