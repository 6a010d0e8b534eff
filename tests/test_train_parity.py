"""Training parity (docs/testing.md): from one seed and one batch stream, with dropout 0, 50
AdamW steps of the fast model, of the reference encoder (same weights), and of transformers'
BertForPreTraining (same weights via the state dict) give the same loss curve and final
parameters in fp32; with dropout on, the model learns the embedded corpus."""
import copy

import numpy as np
import pytest
import torch

import bertfast
from bertfast import pretrain
from bertfast.training.optim import build_optimizer, warmup_linear_decay
from bertfast.data.loader import BatchSpec, PretrainingBatches, masking_config_for
from bertfast.data.prepare import prepare_dataset
from bertfast.data.shards import PretrainingData

STEPS = 50


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("parity-data") / "p1")
    prepare_dataset([], d, vocab_size=400, max_seq_len=64, corpus_max_docs=400, workers=1, progress=False,
                    log=lambda m: None)
    return d


def _train(model, batches, steps=STEPS, lr=1e-3):
    torch.manual_seed(1)
    opt = build_optimizer(model, "adamw", lr, 0.01)
    sched = warmup_linear_decay(opt, 5, steps)
    model.train()
    losses = []
    for step in range(steps):
        out = model(**batches[step])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(out.loss.item())
    return np.array(losses)


def test_fast_reference_and_transformers_train_alike(data_dir):
    transformers = pytest.importorskip("transformers")
    data = PretrainingData(data_dir)
    stream = PretrainingBatches(data, BatchSpec(8, 8), seed=11, masking=masking_config_for(data))
    batches = [stream.micro_batches(s)[0] for s in range(STEPS)]
    assert all((b["attention_mask"] == 0).any() for b in batches[:5])      # real padding in the batches

    config = bertfast.BertConfig.preset("tiny", vocab_size=data.vocab_size, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    fast = bertfast.BertForPreTraining(config)
    ref = copy.deepcopy(fast)
    hf_config = transformers.BertConfig(**{k: v for k, v in config.to_dict().items() if k != "architectures"})
    hf_config._attn_implementation = "eager"
    hf = transformers.BertForPreTraining(hf_config)
    missing, unexpected = hf.load_state_dict(fast.state_dict(), strict=False)
    assert not unexpected and all("position_ids" in k for k in missing), (missing, unexpected)
    assert hf.cls.predictions.decoder.weight.data_ptr() == hf.bert.embeddings.word_embeddings.weight.data_ptr()

    loss_fast = _train(fast, batches)
    with bertfast.reference_execution(ref):
        loss_ref = _train(ref, batches)
    loss_hf = _train(hf, batches)

    # The model learns over the 50 steps, and the three curves coincide.
    assert loss_fast[-10:].mean() < loss_fast[:5].mean() - 0.3
    np.testing.assert_allclose(loss_fast, loss_ref, rtol=0, atol=1e-4)
    np.testing.assert_allclose(loss_ref, loss_hf, rtol=0, atol=1e-4)
    np.testing.assert_allclose(loss_fast, loss_hf, rtol=0, atol=1e-4)
    p_ref = dict(ref.named_parameters())
    p_hf = dict(hf.named_parameters())
    for name, p in fast.named_parameters():
        torch.testing.assert_close(p, p_ref[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(p, p_hf[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_learns_the_embedded_corpus_with_dropout(data_dir, tmp_path):
    args = pretrain.parse_args(["--preset", "tiny", "--data", data_dir, "--phase1-steps", "40",
                                "--global-batch-size", "16", "--micro-batch-size", "16", "--lr", "5e-3",
                                "--warmup-steps", "4", "--log-every", "1", "--eval-every", "40",
                                "--eval-batches", "4", "--save-every", "1000", "--no-progress", "--no-plot",
                                "--output-dir", str(tmp_path / "run"), "--set", "hidden_dropout_prob=0.1",
                                "--set", "attention_probs_dropout_prob=0.1"])
    res = pretrain.run(args)
    losses = np.array([res.losses[s] for s in sorted(res.losses)])
    # From ln(V) + ln(2) ~ 6.7 at the start; 40 steps of a 2-layer H=64 model learn about 0.7.
    assert losses[:5].mean() - losses[-5:].mean() > 0.5, losses
    assert res.evals[-1]["loss"] < losses[:5].mean() - 0.3              # the held-out loss fell too
