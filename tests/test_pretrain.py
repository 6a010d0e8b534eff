"""bertfast pretrain: two phases, checkpoints (HF layout, atomic, keep-last), bit-exact resume,
two-process DDP on CPU, parity checks (strict mode names the op), LAMB, schedule, config files."""
import dataclasses
import importlib
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from bertfast import pretrain
from bertfast.data.loader import BatchSpec, PretrainingBatches, masking_config_for
from bertfast.data.shards import PretrainingData
from bertfast.parity import ParityError
from bertfast.training import checkpoints
from bertfast.training import optim, phases
from bertfast.training.config import PretrainConfig
from bertfast.training.records import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _args(datasets, out, *extra):
    d1, d2 = datasets
    argv = ["--preset", "tiny", "--data", d1, "--data-phase2", d2, "--phase1-steps", "4", "--phase2-steps", "2",
            "--global-batch-size", "8", "--micro-batch-size", "4", "--phase2-global-batch-size", "4",
            "--phase2-micro-batch-size", "2", "--lr", "1e-3", "--warmup-steps", "2", "--log-every", "1",
            "--eval-every", "0", "--save-every", "100", "--no-progress", "--output-dir", str(out), "--seed", "3",
            *extra]
    return pretrain.parse_args(argv)


def _records(out, kind):
    return [r for r in read_jsonl(os.path.join(str(out), "metrics.jsonl")) if r.get("type") == kind]


# --------------------------------------------------------------------------- end to end
def test_two_phase_run_logs_checkpoints_and_hf_layout(datasets, tmp_path):
    out = tmp_path / "run"
    res = pretrain.run(_args(datasets, out, "--eval-every", "3", "--eval-batches", "2", "--parity-every", "3",
                             "--save-every", "2", "--keep-last", "2"))
    assert sorted(res.losses) == [1, 2, 3, 4, 5, 6] and all(np.isfinite(list(res.losses.values())))
    train = _records(out, "train")
    assert [r["seq_len"] for r in train] == [64] * 4 + [128] * 2            # phase 2 at the longer length
    for r in train:
        for key in ("loss", "mlm_loss", "nsp_loss", "mlm_acc", "nsp_acc", "lr", "grad_norm", "tokens_per_s",
                    "seq_per_s", "tflops_per_s"):
            assert np.isfinite(r[key]), key
        assert r["mfu"] is None                                            # no GPU peak on CPU
        assert abs(r["loss"] - (r["mlm_loss"] + r["nsp_loss"])) < 1e-4
    # Warm-up over 2 steps, then linear decay to 0 at step 6.
    np.testing.assert_allclose([r["lr"] for r in train], [5e-4, 1e-3, 1e-3, 7.5e-4, 5e-4, 2.5e-4], rtol=1e-6)
    evals = _records(out, "eval")
    assert [e["step"] for e in evals] == [3, 6] and all(0 <= e["mlm_acc"] <= 1 for e in evals)
    parity = _records(out, "parity")
    assert [p["step"] for p in parity] == [3, 6]
    assert all(not p["diverged"] and p["loss_abs_diff"] < 1e-5 for p in parity)
    assert os.path.isfile(out / "loss.png")
    # Every 2 steps, keep the last 2.
    assert [s for s, _ in checkpoints.list_checkpoints(str(out / "checkpoints"))] == [4, 6]
    ckpt = res.checkpoint
    assert ckpt.endswith("step_00000006")
    for name in ("config.json", "model.safetensors", "vocab.txt", "training_state.pt", "trainer_state.json"):
        assert os.path.isfile(os.path.join(ckpt, name)), name
    # The checkpoint is a Hugging Face directory: transformers and bertfast load the same model.
    import transformers

    import bertfast
    data = PretrainingData(datasets[0])
    batch = PretrainingBatches(data, BatchSpec(4, 4), seed=0, masking=masking_config_for(data)).micro_batches(0)[0]
    ours = bertfast.BertForPreTraining.from_pretrained(ckpt).eval()
    theirs = transformers.BertForPreTraining.from_pretrained(ckpt).eval()
    with torch.no_grad():
        a = ours(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 token_type_ids=batch["token_type_ids"])
        b = theirs(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   token_type_ids=batch["token_type_ids"])
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(a.prediction_logits[real], b.prediction_logits[real], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.seq_relationship_logits, b.seq_relationship_logits, atol=1e-5, rtol=1e-4)
    # ... and a fine-tuning starting point: `bertfast finetune --model CKPT` takes its encoder and vocabulary.
    from bertfast import finetune
    from bertfast.data import synthetic
    train = str(tmp_path / "cls.csv")
    synthetic.write_classification(train, 16, neutral=False)
    ft = finetune.run(finetune.parse_args(["--task", "classification", "--train-file", train, "--model", ckpt,
                                           "--epochs", "1", "--batch-size", "8", "--max-seq-len", "32", "--lr", "0",
                                           "--no-progress", "--output-dir", str(tmp_path / "ft")]))
    assert ft["steps"] == 2
    tuned = bertfast.BertForSequenceClassification.from_pretrained(str(tmp_path / "ft"))
    torch.testing.assert_close(tuned.bert.encoder.layer[1].output.dense.weight,
                               ours.bert.encoder.layer[1].output.dense.weight, atol=0, rtol=0)   # lr 0
    assert open(os.path.join(str(tmp_path / "ft"), "vocab.txt")).read() == open(os.path.join(ckpt, "vocab.txt")).read()


def test_resume_applies_a_new_learning_rate_and_optimizer_settings(datasets, tmp_path):
    """--resume --lr X: the schedule continues at its step with base rate X (the checkpoint's
    scheduler used to win), and run_config.json records X; so for weight decay and Adam's betas."""
    out = tmp_path / "run"
    pretrain.run(_args(datasets, out, "--stop-at-step", "3"))
    again = pretrain.parse_args(["--output-dir", str(out), "--resume", "--no-progress", "--lr", "4e-3",
                                 "--weight-decay", "0.05", "--beta2", "0.99"])
    trainer = pretrain.Pretrainer(again, pretrain.init_distributed("cpu"))
    try:
        trainer.setup()
        groups = trainer.optimizer.param_groups
        # Step 4 of warm-up 2 then linear decay to 0 at step 6: 0.75 of the base rate.
        assert [g["lr"] for g in groups] == [pytest.approx(3e-3)] * len(groups)
        assert trainer.train_step.scheduler.get_last_lr() == [pytest.approx(3e-3)] * len(groups)
        assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.05]   # no decay on biases and LayerNorms
        assert {g["betas"] for g in groups} == {(0.9, 0.99)}
        assert trainer.step == 3 and trainer.optimizer.state                # the moments are the checkpoint's
    finally:
        trainer.close()
    res = pretrain.run(again)
    np.testing.assert_allclose([r["lr"] for r in _records(out, "train")[-3:]], [3e-3, 2e-3, 1e-3], rtol=1e-6)
    assert sorted(res.losses) == [4, 5, 6]
    assert json.load(open(out / "run_config.json"))["lr"] == 4e-3


@pytest.mark.parametrize("flags, named", [
    (["--preset", "small"], "--preset 'small' (the run has 'tiny')"),
    (["--set", "hidden_dropout_prob=0.3"], "--set ['hidden_dropout_prob=0.3'] (the run has [])"),
    (["--optimizer", "lamb"], "--optimizer 'lamb' (the run has 'adamw')"),
    ("data", "--data"),
])
def test_resume_refuses_to_change_the_model_the_data_or_the_optimizer(datasets, tmp_path, flags, named):
    out = tmp_path / "run"
    pretrain.run(_args(datasets, out, "--stop-at-step", "2"))
    if flags == "data":
        flags = ["--data", datasets[1]]
    argv = ["--output-dir", str(out), "--resume", "--no-progress", *flags]
    with pytest.raises(ValueError, match="--resume continues the run saved in run_config.json") as info:
        pretrain.parse_args(argv)
    assert named in str(info.value) and "start a new run" in str(info.value)
    # The same values as the run's are no change (a path named another way included).
    same = pretrain.parse_args(["--output-dir", str(out), "--resume", "--preset", "tiny",
                                "--data", os.path.relpath(datasets[0])])
    assert same.preset == "tiny"
    assert pretrain.main(argv) == 2


def test_init_checkpoint_with_another_vocabulary_is_refused(datasets, tmp_path, capsys):
    """A checkpoint's 30,522-word table over data tokenized with a few hundred words: its ids would
    mean other words. Refused before training, naming both sizes."""
    from bertfast import BertConfig, BertForPreTraining
    ckpt = tmp_path / "big-vocab"
    BertForPreTraining(BertConfig.preset("tiny", vocab_size=30522)).save_pretrained(ckpt)
    args = _args(datasets, tmp_path / "run", "--init-checkpoint", str(ckpt))
    with pytest.raises(ValueError, match=r"has a 30522-word vocabulary, the data a \d+-word one: the data was "
                                         r"tokenized with another vocabulary"):
        pretrain.run(args)


@pytest.mark.parametrize("shapes", [[], ["--static-shapes"], ["--optimizer", "lamb"]],
                         ids=["unpadded", "packed", "capturable-lamb"])
def test_resume_is_bit_exact(datasets, tmp_path, request, shapes):
    """(capturable-lamb: the triton LAMB, which pretrain builds with its step counts on the device;
    its checkpoint holds them as ints.)"""
    if "lamb" in shapes:
        request.getfixturevalue("triton_lamb")
    dropout = ["--set", "hidden_dropout_prob=0.1", "--set", "attention_probs_dropout_prob=0.1", *shapes]
    full = pretrain.run(_args(datasets, tmp_path / "full", *dropout))
    first = pretrain.run(_args(datasets, tmp_path / "split", *dropout, "--stop-at-step", "3"))
    assert first.stopped_early and sorted(first.losses) == [1, 2, 3]
    ckpt_dir = tmp_path / "split" / "checkpoints"
    # Debris of a run killed while saving: ignored, then cleaned up.
    os.makedirs(ckpt_dir / ".tmp_step_00000004_999")
    assert [s for s, _ in checkpoints.list_checkpoints(str(ckpt_dir))] == [3]
    # The run directory holds the run's settings: --resume needs nothing else (where to stop is not kept).
    again = pretrain.parse_args(["--output-dir", str(tmp_path / "split"), "--resume", "--no-progress"])
    assert again.stop_at_step is None and again.resume == "auto"
    assert again.data == datasets[0] and again.lr == 1e-3 and again.config_overrides == dropout[1:4:2]
    # ...and the demo preset (which `--resume` with no data would name) does not leak in: another
    # thread count alone changes some CPU reductions' bits.
    assert again.threads is None and not again.overwrite and not again.demo
    second = pretrain.run(again)
    assert not os.path.exists(ckpt_dir / ".tmp_step_00000004_999")
    resumed = {**first.losses, **second.losses}
    assert resumed == full.losses                                         # exactly equal floats
    from safetensors.torch import load_file
    a = load_file(os.path.join(full.checkpoint, "model.safetensors"))
    b = load_file(os.path.join(second.checkpoint, "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa = torch.load(os.path.join(full.checkpoint, "training_state.pt"), weights_only=False)
    sb = torch.load(os.path.join(second.checkpoint, "training_state.pt"), weights_only=False)
    for pid, st in sa["optimizer"]["state"].items():
        assert torch.equal(st["exp_avg_sq"], sb["optimizer"]["state"][pid]["exp_avg_sq"])
        assert st["step"] == sb["optimizer"]["state"][pid]["step"]
    if "lamb" in shapes:  # the device step counts were written as ints
        assert {type(st["step"]) for st in sb["optimizer"]["state"].values()} == {int}


def test_atomic_checkpoint_keeps_previous_on_failure(tmp_path):
    d = str(tmp_path)

    def good(tmp):
        open(os.path.join(tmp, "training_state.pt"), "w").write("x")

    checkpoints.atomic_checkpoint(d, 1, good)

    def crash(tmp):
        open(os.path.join(tmp, "training_state.pt"), "w").write("partial")
        raise KeyboardInterrupt("killed while saving")

    with pytest.raises(KeyboardInterrupt):
        checkpoints.atomic_checkpoint(d, 2, crash)
    assert [s for s, _ in checkpoints.list_checkpoints(d)] == [1]                  # the half-written one is invisible
    assert checkpoints.latest_checkpoint(d).endswith("step_00000001")
    for step in (2, 3, 4):
        checkpoints.atomic_checkpoint(d, step, good, keep_last=2)
    assert [s for s, _ in checkpoints.list_checkpoints(d)] == [3, 4]


# --------------------------------------------------------------------------- DDP on CPU
def _torchrun(datasets, out, *extra):
    d1, d2 = datasets
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "bertfast.pretrain",
           "--preset", "tiny", "--data", d1, "--data-phase2", d2, "--phase1-steps", "4",
           "--phase2-steps", "2", "--global-batch-size", "8", "--micro-batch-size", "4",
           "--phase2-global-batch-size", "4", "--phase2-micro-batch-size", "2", "--lr", "1e-3",
           "--warmup-steps", "2", "--log-every", "1", "--eval-every", "0", "--save-every", "100", "--no-progress",
           "--no-plot", "--output-dir", str(out), "--seed", "3", "--device", "cpu", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r["step"]: r["loss"] for r in _records(out, "train")}


NO_DROPOUT = ["--set", "hidden_dropout_prob=0.0", "--set", "attention_probs_dropout_prob=0.0"]


@pytest.fixture(scope="module")
def single_process_run(datasets, tmp_path_factory):
    return pretrain.run(_args(datasets, tmp_path_factory.mktemp("one") / "run", *NO_DROPOUT))


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "ddp-skip"])
def test_two_processes_match_one_process(datasets, tmp_path, single_process_run, mode):
    """Two gloo ranks (each one micro-batch where one process accumulates two) = one process.
    ddp-skip: --on-nonfinite skip reduces the step's flag over the ranks on the device, every step;
    with every step finite, none is skipped."""
    single = single_process_run
    extra = {"ddp": [], "fsdp": ["--fsdp"], "ddp-skip": ["--on-nonfinite", "skip"]}[mode]
    two = _torchrun(datasets, tmp_path / "two", *NO_DROPOUT, *extra)
    if mode == "ddp-skip":
        assert all(r["skipped_steps"] == 0 for r in _records(tmp_path / "two", "train"))
    assert sorted(two) == sorted(single.losses)
    np.testing.assert_allclose([two[s] for s in sorted(two)], [single.losses[s] for s in sorted(two)],
                               rtol=1e-5, atol=1e-6)
    from safetensors.torch import load_file
    a = load_file(os.path.join(single.checkpoint, "model.safetensors"))
    b = load_file(os.path.join(str(tmp_path / "two" / "checkpoints" / "step_00000006"), "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4)


# --------------------------------------------------------------------------- parity
def test_parity_strict_stops_and_names_the_divergent_op(datasets, tmp_path, monkeypatch, capsys):
    from bertfast import dispatch
    torch_backend = importlib.import_module("bertfast.ops.bias_gelu")  # the module, not the function

    # A deliberately wrong bias_gelu backend (output shifted by 1) in the 'triton' slot.
    module_name = "bertfast_test_bad_bias_gelu"
    bad = types.ModuleType(module_name)
    for name in dir(torch_backend):
        if not name.startswith("__"):  # keep the fake module's own __name__
            setattr(bad, name, getattr(torch_backend, name))
    bad.bias_gelu_fwd = lambda x, bias, approximate: torch_backend.bias_gelu_fwd(x, bias, approximate) + 1.0
    monkeypatch.setitem(sys.modules, module_name, bad)
    original = dispatch.get("bias_gelu", "triton")
    dispatch.register_backend(dispatch.Backend("bias_gelu", "triton", module_name, lambda forced, **inputs: []))
    try:
        # Without --parity-strict: a logged warning, and the run goes on.
        res = pretrain.run(_args(datasets, tmp_path / "warn", "--parity-every", "3"))
        assert len(res.parity) == 2 and all(p["diverged"] for p in res.parity)
        assert res.parity[0]["first_divergent_op"] == "bias_gelu" and res.final_step == 6
        assert "DIVERGED" in capsys.readouterr().out
        # With it: the run stops at the first check and names the op.
        with pytest.raises(ParityError) as info:
            pretrain.run(_args(datasets, tmp_path / "p", "--parity-every", "2", "--parity-strict"))
        assert info.value.step == 2 and info.value.report["first_divergent_op"] == "bias_gelu"
        assert "first divergent op: bias_gelu" in str(info.value)
        rc = pretrain.main(["--preset", "tiny", "--data", datasets[0], "--phase1-steps", "1", "--global-batch-size",
                            "4", "--micro-batch-size", "4", "--parity-every", "1", "--parity-strict",
                            "--no-progress", "--no-plot", "--output-dir", str(tmp_path / "q")])
        assert rc == 3 and "bias_gelu" in capsys.readouterr().err
    finally:
        dispatch.register_backend(original)


# --------------------------------------------------------------------------- optimizers, schedule, config
def test_lamb_matches_its_formula_and_param_groups():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 4))
    b = torch.nn.Parameter(torch.randn(4))
    opt = optim.Lamb([{"params": [w], "weight_decay": 0.01}, {"params": [b], "weight_decay": 0.0}],
                  lr=0.1, betas=(0.9, 0.99), eps=1e-6)
    w0, b0 = w.detach().clone(), b.detach().clone()
    m = v = None
    for t in (1, 2):
        g = torch.randn(5, 4)
        w.grad, b.grad = g.clone(), torch.zeros(4)
        m = (1 - 0.9) * g if m is None else 0.9 * m + 0.1 * g
        v = (1 - 0.99) * g * g if v is None else 0.99 * v + 0.01 * g * g
        update = (m / (1 - 0.9 ** t)) / ((v / (1 - 0.99 ** t)).sqrt() + 1e-6) + 0.01 * w0
        trust = w0.norm() / update.norm()
        w0 = w0 - 0.1 * trust * update
        opt.step()
        torch.testing.assert_close(w.detach(), w0, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(b.detach(), b0)                           # zero gradient, no decay: unchanged

    import bertfast
    model = bertfast.BertForPreTraining(bertfast.BertConfig.preset("tiny"))
    decay, no_decay = optim.parameter_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.01
    assert all(n.endswith("bias") or "LayerNorm" in n for n in (names[id(p)] for p in no_decay["params"]))
    assert all(p.ndim == 2 for p in decay["params"])
    n_unique = len({id(p) for p in model.parameters()})
    assert len(decay["params"]) + len(no_decay["params"]) == n_unique   # the tied decoder weight once


def test_config_file_and_errors(datasets, tmp_path):
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({"preset": "tiny", "data": datasets[0], "phase1_steps": 3, "global-batch-size": 4,
                               "micro_batch_size": 2, "lr": 5e-4}))
    args = pretrain.parse_args(["--config", str(cfg), "--lr", "1e-3"])
    assert args.preset == "tiny" and args.phase1_steps == 3 and args.global_batch_size == 4
    assert args.lr == 1e-3                                               # the flag wins over the file
    cfg.write_text(json.dumps({"no_such_option": 1}))
    assert pretrain.main(["--config", str(cfg)]) == 2
    # The tiny preset has 128 positions: a phase-2 dataset at 256 would not fit.
    assert pretrain.main(["--preset", "tiny", "--data", datasets[0], "--phase1-steps", "1", "--phase2-steps", "1",
                          "--no-progress", "--output-dir", str(tmp_path / "x")]) == 2
    with pytest.raises(ValueError, match="global batch size 6 must be a multiple"):
        BatchSpec(6, 4)


def test_cuda_graphs_refuses_what_it_cannot_capture(datasets, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("BERTFAST_LAMB", "foreach")
    argv = ["--preset", "tiny", "--data", datasets[0], "--phase1-steps", "1", "--no-progress", "--cuda-graphs",
            "--optimizer", "lamb", "--on-nonfinite", "skip", "--device", "cpu", "--output-dir", str(tmp_path / "g")]
    assert pretrain.main(argv) == 2
    err = capsys.readouterr().err
    assert ("--cuda-graphs needs a CUDA device (got cpu); the triton LAMB (got BERTFAST_LAMB=foreach: only the "
            "triton one keeps its step counts on the device)\n") in err  # skip mode is captured (on the device)
    monkeypatch.delenv("BERTFAST_LAMB")
    assert pretrain.main(argv) == 2                                    # the triton LAMB is served
    assert "--cuda-graphs needs a CUDA device (got cpu)\n" in capsys.readouterr().err


@pytest.mark.parametrize("values, message", [
    ({"lr": None}, r"--lr expects a number, got None"),
    ({"global_batch_size": "32"}, r"--global-batch-size expects an integer, got '32'"),
    ({"phase1_steps": 2.5}, r"--phase1-steps expects an integer or null, got 2.5"),
    ({"static_shapes": "yes"}, r"--static-shapes expects true or false, got 'yes'"),
    ({"set": "hidden_dropout_prob=0"}, r"--set expects a list of strings"),
    ({"optimizer": "sgd"}, r"--optimizer must be one of \['adamw', 'lamb'\], got 'sgd'"),
    ({"micro_batch_size": 0}, r"--micro-batch-size must be > 0, got 0"),
    ({"max_predictions_per_seq": 0}, r"--max-predictions-per-seq must be > 0, got 0"),
    ({"phase2_fraction": 2}, r"--phase2-fraction must be in \[0, 1\), got 2"),
    ({"lr": -1}, r"--lr must be > 0, got -1"),
    ({"pack_tokens": 4096}, r"--pack-tokens size packed batches: add --static-shapes \(or --cuda-graphs\)"),
    ({"typo_option": 1}, r"unknown option 'typo_option'"),
])
def test_a_config_file_with_a_bad_value_names_the_option(tmp_path, values, message):
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({"data": "d", **values}))
    with pytest.raises(ValueError, match=f"{cfg}: {message}"):
        pretrain.parse_args(["--config", str(cfg)])


@pytest.mark.parametrize("command", ["pretrain", "finetune"])
def test_help_lists_every_option(command, capsys):
    module = importlib.import_module(f"bertfast.{command}")
    with pytest.raises(SystemExit) as stop:
        module.parse_args(["--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0 and "--resume" in out and "--on-nonfinite" in out
    if command == "pretrain":
        assert "1% of the steps" in out                                # a literal % in a help text


def test_a_bad_flag_value_names_the_option_and_the_saved_config_round_trips(tmp_path):
    with pytest.raises(ValueError, match=r"the command line: --eval-batches must be > 0, got 0"):
        pretrain.parse_args(["--data", "d", "--eval-batches", "0"])
    config = pretrain.parse_args(["--data", "d", "--lr", "2e-4", "--set", "a=1", "--set", "b=2"])
    config.save(str(tmp_path))
    assert PretrainConfig.load(str(tmp_path)) == config
    assert PretrainConfig.load(str(tmp_path / "nothing")) is None
    (tmp_path / "run_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object of option names to values, got list"):
        PretrainConfig.load(str(tmp_path))
    demo = PretrainConfig.from_preset("demo")
    assert demo.demo and demo.preset == "demo" and demo.phase1_steps == 270
    with pytest.raises(ValueError, match="unknown preset 'paper'"):
        PretrainConfig.from_preset("paper")


def test_demo_entry_point(tmp_path, capsys):
    rc = pretrain.main(["--demo", "--phase1-steps", "2", "--phase2-steps", "1", "--demo-corpus-max-docs", "150",
                        "--demo-vocab-size", "300", "--eval-every", "3", "--parity-every", "3", "--no-progress",
                        "--output-dir", str(tmp_path / "demo"), "--log-every", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "phase 2: seq 512" in out and "[parity] step 3" in out and "-> ok" in out and "tokens/s" in out
    assert os.path.isfile(tmp_path / "demo" / "loss.png")
    # a shortened demo is not the README's example, and says so rather than comparing losses
    assert ("[pretrain] demo: not the README's example settings (phase1_steps, phase2_steps, log_every, eval_every, "
            "parity_every, demo_vocab_size, demo_corpus_max_docs changed), so its losses are not comparable") in out


def test_demo_says_whether_its_losses_are_the_readmes():
    """Issue 37 (13): the demo's losses differed from the README's example with no word on why. The
    demo names the README's environment and says which case a run is in."""
    example = phases.DEMO_EXAMPLE
    env = {k: example[k] for k in ("python", "torch", "transformers", "device", "cpu_capability")}
    default = PretrainConfig.from_preset("demo")
    same = phases.compare_with_readme(default, env, example["first_loss"], example["last_loss"] + 4e-5)
    assert same.startswith("[pretrain] demo: the same losses as the README's example (first 8.9903, last 6.6135")
    assert "torch 2.13.0+cpu" in same and "cpu_capability AVX512" in same
    # settings that change no loss leave the comparison on
    quiet = dataclasses.replace(default, output_dir="elsewhere", no_progress=True, threads=2, overwrite=False)
    assert phases.compare_with_readme(quiet, env, example["first_loss"], example["last_loss"]) == same
    other_torch = phases.compare_with_readme(default, dict(env, torch="2.9.0+cpu"), 8.99, 6.7)
    assert ("losses first 8.9900, last 6.7000 against the README's 8.9903, 6.6135; other losses are expected here: "
            "this environment differs from the README's in torch 2.9.0+cpu (README: 2.13.0+cpu)") in other_torch
    gpu = phases.compare_with_readme(default, {**{k: env[k] for k in ("python", "torch", "transformers")},
                                               "device": "cuda"}, 8.99, 6.7)
    assert "device cuda (README: cpu)" in gpu and "cpu_capability" not in gpu.split("differs")[1]
    odd = phases.compare_with_readme(default, env, 8.9903, 6.7)
    assert "in the README's environment" in odd and "not expected" in odd and "please report" in odd
    other = phases.compare_with_readme(dataclasses.replace(default, lr=2e-3), env, 8.9903, 6.6135)
    assert other == "[pretrain] demo: not the README's example settings (lr changed), so its losses are not comparable"


def test_readme_quotes_the_demo_example_the_demo_compares_with():
    readme = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md"), encoding="utf-8").read()
    example = phases.DEMO_EXAMPLE
    assert (f"last loss {example['last_loss']:.4f} (first logged {example['first_loss']:.4f})") in readme
    python, torch_version, transformers_version = example["python"], example["torch"], example["transformers"]
    assert f"Python {python}, torch {torch_version} and transformers {transformers_version}" in readme
    assert "[pretrain] demo: the same losses as the README's example" in readme


def test_demo_data_is_reproducible_with_the_shipped_vocabulary(tmp_path):
    """The demo tokenises with the packaged vocabulary, so two fresh preparations are byte-identical."""
    from bertfast.data.prepare import prepare_dataset
    from bertfast.data.tokenization import read_vocab

    tokens = read_vocab(phases.DEMO_VOCAB)
    assert len(tokens) == phases.DEMO_VOCAB_SIZE and tokens[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    outputs = []
    for name in ("a", "b"):
        out = str(tmp_path / name)
        prepare_dataset([], out, vocab=phases.DEMO_VOCAB, max_seq_len=64, workers=None, progress=False,
                        log=lambda *a, **k: None, corpus_max_docs=150)
        outputs.append(out)
    files = sorted(os.path.relpath(os.path.join(root, f), outputs[0])
                   for root, _, names in os.walk(outputs[0]) for f in names if not f.endswith(".json"))
    assert any("train" in f for f in files)
    for rel in files:
        with open(os.path.join(outputs[0], rel), "rb") as a, open(os.path.join(outputs[1], rel), "rb") as b:
            assert a.read() == b.read(), rel


# --------------------------------------------------------------------------- micro-batch sizing
def test_auto_micro_batch_is_the_largest_divisor_of_the_rank_share_within_the_tokens():
    assert phases.auto_micro_batch(256, 128, 16384) == 128   # BERT-large phase 1 on an H100
    assert phases.auto_micro_batch(256, 512, 16384) == 32    # phase 2
    assert phases.auto_micro_batch(32, 128, 16384) == 32     # the rank's share caps it
    assert phases.auto_micro_batch(96, 128, 8192) == 48      # 64 would not divide 96
    assert phases.auto_micro_batch(7, 512, 256) == 1         # never below one sequence
    assert phases.auto_micro_batch(256, 128, 4096) == 32     # a CPU: the former default


def test_micro_batch_tokens_by_device(monkeypatch):
    assert phases.micro_batch_tokens(torch.device("cpu")) == phases.MICRO_BATCH_TOKENS
    for memory, tokens in ((80 * 2 ** 30, phases.LARGE_GPU_MICRO_BATCH_TOKENS),
                           (24 * 2 ** 30, phases.MICRO_BATCH_TOKENS)):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device, memory=memory: types.SimpleNamespace(total_memory=memory))
        assert phases.micro_batch_tokens(torch.device("cuda", 0)) == tokens


def test_micro_batches_sized_per_phase_unless_given(monkeypatch):
    lengths = {"p1": 128, "p2": 512}
    monkeypatch.setattr(phases, "dataset_index", lambda directory: {"max_seq_len": lengths[directory]})
    monkeypatch.setattr(phases, "micro_batch_tokens", lambda device: 16384)
    info = types.SimpleNamespace(device=torch.device("cpu"), world_size=2)
    base = PretrainConfig(data="p1", data_phase2="p2", phase1_steps=10, phase2_steps=2, global_batch_size=512,
                          phase2_global_batch_size=128)
    logged = []
    sized = phases.size_micro_batches(phases.resolve_steps(base), info, logged.append)
    assert (sized.micro_batch_size, sized.phase2_micro_batch_size) == (128, 32)  # 256 and 64 per rank
    assert len(logged) == 2 and "16384 tokens" in logged[0]
    # given: kept; phase 2 with none given takes phase 1's, as before
    given = phases.resolve_steps(dataclasses.replace(base, micro_batch_size=16))
    assert phases.size_micro_batches(given, info, logged.append).phase2_micro_batch_size == 16
    only2 = phases.resolve_steps(dataclasses.replace(base, phase2_micro_batch_size=4))
    assert (phases.size_micro_batches(only2, info, print).micro_batch_size, only2.phase2_micro_batch_size) == (128, 4)
    # a phase with no steps is not sized (its data need not exist)
    no2 = phases.resolve_steps(dataclasses.replace(base, phase2_steps=0, data_phase2=None))
    assert phases.size_micro_batches(no2, info, print).phase2_micro_batch_size is None
