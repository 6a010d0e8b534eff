"""Training under faults: NaN runs stop (or skip) and keep only finite checkpoints; one run per
output directory (a lock, and an earlier run is neither mixed with nor overwritten silently);
resume follows the run's own lineage; damaged checkpoints are named and passed over; a full
disk names the path; kill -9 at any moment (also while a checkpoint is written) and SIGTERM
lose nothing past the last checkpoint; the exit code says how a run ended."""
import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from bertfast import finetune, pretrain
from bertfast.data import synthetic as S
from bertfast.data.tokenization import WordPiece
from bertfast.training import checkpoints, exits
from bertfast.training.records import read_jsonl
from bertfast.training.rundir import RunDirectory
from bertfast.training.step import TrainStep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _argv(datasets, out, *extra):
    d1, d2 = datasets
    return ["--preset", "tiny", "--data", d1, "--data-phase2", d2, "--phase1-steps", "4", "--phase2-steps", "2",
            "--global-batch-size", "8", "--micro-batch-size", "4", "--phase2-global-batch-size", "4",
            "--phase2-micro-batch-size", "2", "--lr", "1e-3", "--warmup-steps", "2", "--log-every", "1",
            "--eval-every", "0", "--save-every", "1", "--keep-last", "10", "--no-progress", "--no-plot",
            "--output-dir", str(out), "--seed", "3", "--device", "cpu", *extra]


def _steps(out):
    return [s for s, _ in checkpoints.list_checkpoints(os.path.join(str(out), "checkpoints"))]


def _losses(out):
    return {r["step"]: r["loss"] for r in read_jsonl(os.path.join(str(out), "metrics.jsonl")) if r["type"] == "train"}


def _all_finite(checkpoint):
    return all(torch.isfinite(t).all() for t in load_file(os.path.join(checkpoint, "model.safetensors")).values())


# --------------------------------------------------------------------------- non-finite values
@pytest.mark.parametrize("extra", [[], ["--optimizer", "lamb"], ["--max-grad-norm", "0"], ["--adam-eps", "0"]])
def test_a_diverging_run_stops_and_keeps_only_finite_checkpoints(datasets, tmp_path, capsys, extra):
    out = tmp_path / "run"
    rc = pretrain.main(_argv(datasets, out, "--lr", "1e12", "--keep-last", "2", *extra))
    err = capsys.readouterr().err
    assert rc == exits.NONFINITE, err
    assert "training stopped" in err and ("non-finite" in err or "NaN or inf" in err)
    kept = checkpoints.list_checkpoints(str(out / "checkpoints"))
    assert all(_all_finite(path) for _, path in kept)                 # keep-last never dropped them for NaN ones
    if kept:
        assert kept[-1][1] in err                                     # the error names where to resume
    assert max(_losses(out)) < 6                                      # it did not train on to the end


def test_no_progress_silences_the_libraries_progress_bars_too(datasets, tmp_path, capfd):
    """--no-progress: no bar at all, transformers' "Writing model shards" at each checkpoint
    included; its setting is back as it was after the run."""
    from transformers.utils import logging as hf_logging
    assert pretrain.main(_argv(datasets, tmp_path / "run")) == 0
    out, err = capfd.readouterr()
    assert _steps(tmp_path / "run") and "model shards" not in out + err and "it/s]" not in out + err
    assert hf_logging.is_progress_bar_enabled()


def test_skip_mode_leaves_the_parameters_of_a_nonfinite_step_untouched():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    step = TrainStep(model, opt, sched, torch.device("cpu"), "fp32", skip_nonfinite=True)

    class Out:
        def __init__(self, loss):
            self.loss = loss

    def forward(batch):
        return Out((model(batch["x"]) ** 2).mean() * batch["scale"])

    before = model.weight.detach().clone()
    done = step([{"x": torch.ones(2, 3), "scale": torch.tensor(float("nan"))}], forward)
    assert done.skipped and not bool(done.finite) and torch.equal(model.weight, before)
    done = step([{"x": torch.ones(2, 3), "scale": torch.tensor(1.0)}], forward)
    assert not done.skipped and bool(done.finite) and not torch.equal(model.weight, before)


@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_an_optimizer_with_found_inf_skips_on_the_device_as_if_the_step_never_ran(monkeypatch, request, optimizer):
    """Fused AdamW and a capturable LAMB take the flag as their found_inf: no host read (the
    host-side check would raise here), and the parameters, moments and step count after a skipped
    step and a good one are those of an optimizer that only saw the good one."""
    from bertfast.training import step as step_module
    from bertfast.training.optim import build_optimizer

    if optimizer == "lamb":
        request.getfixturevalue("triton_lamb")
    options = dict(fused=True) if optimizer == "adamw" else dict(implementation="triton", capturable=True)

    def host_read(flag):
        raise AssertionError("the device skip read its flag on the host")

    monkeypatch.setattr(step_module, "_on_every_rank", host_read)

    class Out:
        def __init__(self, loss):
            self.loss = loss

    def make():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        opt = build_optimizer(model, optimizer, 0.1, **options)
        step = TrainStep(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), torch.device("cpu"),
                         "fp32", skip_nonfinite=True)
        return model, opt, step, lambda b: Out((model(b["x"]) ** 2).mean() * b["scale"])

    model, opt, step, forward = make()
    assert step.skips_on_device
    done = step([{"x": torch.ones(2, 3), "scale": torch.tensor(float("inf"))}], forward)
    assert isinstance(done.skipped, torch.Tensor) and bool(done.skipped) and not bool(done.finite)
    done = step([{"x": torch.ones(2, 3), "scale": torch.tensor(1.0)}], forward)
    assert not bool(done.skipped)
    ref_model, ref_opt, _, ref_forward = make()
    ref_forward({"x": torch.ones(2, 3), "scale": torch.tensor(1.0)}).loss.backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], ref_opt.state[q][key]), key
    assert not hasattr(opt, "found_inf")                              # left for no later step to see


def test_the_watch_counts_device_skips_and_stops_at_the_next_check():
    from bertfast.training.nonfinite import NonFiniteError, NonFiniteWatch
    from bertfast.training.step import StepResult

    watch = NonFiniteWatch(torch.device("cpu"), skip=True, max_skipped_steps=3)
    watch.checkpoint = "runs/x/checkpoints/step_00000004"
    for step, skipped in enumerate([False, True, True, False, True, True, True, False], start=1):
        loss = torch.tensor(float("nan") if skipped else 1.0, dtype=torch.float64)
        watch.observe(step, StepResult([], loss, torch.tensor(2.0), 0.1, ~torch.tensor(skipped),
                                       torch.tensor(skipped)))
        if step == 6:
            watch.check()                                             # 2 in a row: not yet
    assert watch.skipped == 5
    with pytest.raises(NonFiniteError, match=r"3 steps in a row from step 5 had a non-finite loss or gradient norm "
                                             r"and were skipped \(the last: loss nan, gradient norm 2\);"
                                             r" the last checkpoint, runs/x/checkpoints/step_00000004"):
        watch.check()


@pytest.mark.parametrize("optimizer", ["adamw", "lamb", "lamb-triton"])
def test_skip_mode_skips_and_counts_then_stops_after_too_many_in_a_row(datasets, tmp_path, capsys, request,
                                                                        optimizer):
    """Fused AdamW and the triton LAMB (which pretrain builds capturable) skip on the device: the
    second skip is logged, then the check after it stops the run. The foreach LAMB's step reads
    its flag on the host: the second skip stops the run at once."""
    if optimizer == "lamb-triton":
        request.getfixturevalue("triton_lamb")
    on_device = optimizer != "lamb"
    out = tmp_path / "run"
    rc = pretrain.main(_argv(datasets, out, "--lr", "1e12", "--on-nonfinite", "skip", "--max-skipped-steps", "2",
                             "--optimizer", optimizer.split("-")[0]))
    err = capsys.readouterr().err
    assert rc == exits.NONFINITE and "2 steps in a row" in err and "were skipped" in err
    records = [r for r in read_jsonl(str(out / "metrics.jsonl")) if r["type"] == "train"]
    first_skip = int(err.split("2 steps in a row from step ")[1].split()[0])
    assert records[-1]["step"] == first_skip + (1 if on_device else 0)
    assert records[-1]["skipped_steps"] == (2 if on_device else 1)
    assert all(_all_finite(path) for _, path in checkpoints.list_checkpoints(str(out / "checkpoints")))
    assert max(s for s, _ in checkpoints.list_checkpoints(str(out / "checkpoints"))) == first_skip  # none at the stop


def test_a_checkpoint_is_refused_while_a_parameter_is_not_finite():
    from bertfast.training.nonfinite import NonFiniteError, NonFiniteWatch
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    watch = NonFiniteWatch(torch.device("cpu"))
    watch.checkpoint = "runs/x/checkpoints/step_00000004"
    watch.check(model, 5)                                             # finite: nothing to say
    with torch.no_grad():
        model[1].bias[2] = float("inf")
    with pytest.raises(NonFiniteError, match=r"after step 5 the model holds NaN or inf \(1.bias \(1 of 3 values\)\)"
                                             r".*runs/x/checkpoints/step_00000004"):
        watch.check(model, 5)


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("vocab")
    WordPiece.train(S.corpus_text(), vocab_size=300).save(str(d))
    return str(d)


def test_fine_tuning_refuses_a_label_that_overflows_float32_without_saving_a_model(tmp_path, vocab_dir, capsys):
    train = tmp_path / "train.tsv"
    S.write_regression(str(train), 32, seed=0)
    lines = train.read_text().splitlines()
    lines[5] = lines[5].split("\t")[0] + "\t1e39"                     # finite in float64, inf in float32
    train.write_text("\n".join(lines) + "\n")
    rc = finetune.main(["--task", "regression", "--train-file", str(train), "--label-column", "score", "--preset",
                        "tiny", "--vocab", vocab_dir, "--epochs", "1", "--batch-size", "8", "--max-seq-len", "32",
                        "--log-every", "100", "--no-progress", "--output-dir", str(tmp_path / "ft")])
    err = capsys.readouterr().err
    assert rc == exits.USAGE and "train.tsv:6" in err and "not a finite float32 number" in err  # refused as data
    assert not os.path.exists(tmp_path / "ft" / "config.json")        # no all-NaN model saved


# --------------------------------------------------------------------------- the output directory
def test_a_second_run_on_a_directory_in_use_is_refused(datasets, tmp_path, capsys):
    out = tmp_path / "run"
    first = RunDirectory(str(out), str(out / "checkpoints"))
    first.lock()
    try:
        rc = pretrain.main(_argv(datasets, out))
    finally:
        first.release()
    err = capsys.readouterr().err
    assert rc == exits.USAGE and "is in use by another run" in err and f"pid {os.getpid()}" in err
    assert pretrain.main(_argv(datasets, out)) == exits.OK           # released: the directory is free again


def test_a_fresh_run_into_a_finished_run_is_refused_unless_overwrite(datasets, tmp_path, capsys):
    out = tmp_path / "run"
    assert pretrain.main(_argv(datasets, out, "--save-every", "2")) == exits.OK
    first = _losses(out)
    rc = pretrain.main(_argv(datasets, out, "--lr", "2e-3"))
    err = capsys.readouterr().err
    assert rc == exits.USAGE and "holds an earlier run (checkpoints up to step 6, metrics.jsonl)" in err
    assert _losses(out) == first and _steps(out) == [2, 4, 6]       # untouched
    assert pretrain.main(_argv(datasets, out, "--lr", "2e-3", "--overwrite", "--save-every", "3")) == exits.OK
    assert _steps(out) == [3, 6] and _losses(out) != first
    run = json.load(open(out / "run.json"))
    assert len(run["starts"]) == 1 and run["starts"][0]["resumed_from"] is None


def test_resuming_an_older_checkpoint_sets_the_later_ones_aside(datasets, tmp_path):
    full = tmp_path / "full"
    assert pretrain.main(_argv(datasets, full)) == exits.OK
    out = tmp_path / "run"
    assert pretrain.main(_argv(datasets, out, "--stop-at-step", "5")) == exits.OK
    step2 = os.path.join(str(out), "checkpoints", "step_00000002")
    assert pretrain.main(_argv(datasets, out, "--resume", step2, "--stop-at-step", "3")) == exits.OK
    assert _steps(out) == [1, 2, 3]
    aside = sorted(n for n in os.listdir(out / "checkpoints") if ".abandoned-" in n)
    assert [n.split(".")[0] for n in aside] == ["step_00000003", "step_00000004", "step_00000005"]
    assert pretrain.main(_argv(datasets, out, "--resume")) == exits.OK   # auto: continues from 3, not 5
    assert _losses(out) == _losses(full)                              # and bit-exactly
    run = json.load(open(out / "run.json"))
    assert [s["step"] for s in run["starts"]] == [0, 2, 3]
    manifest = json.load(open(os.path.join(checkpoints.latest_checkpoint(str(out / "checkpoints")),
                                           "manifest.json")))
    assert manifest["run_id"] == run["run_id"]


def test_a_crash_between_the_renames_of_a_resave_loses_nothing(tmp_path):
    d = str(tmp_path)

    def write(tmp):
        open(os.path.join(tmp, checkpoints.STATE_FILE), "w").write("state")

    path = checkpoints.atomic_checkpoint(d, 7, write)
    os.rename(path, path + ".old_4242")                               # killed after the first rename
    checkpoints.remove_stale_temp(d)
    assert _steps_in(d) == [7] and open(os.path.join(path, checkpoints.STATE_FILE)).read() == "state"
    checkpoints.atomic_checkpoint(d, 7, write)
    os.makedirs(path + ".old_4243")                                   # killed after the second rename
    checkpoints.remove_stale_temp(d)
    assert os.listdir(d) == ["step_00000007"]


def _steps_in(d):
    return [s for s, _ in checkpoints.list_checkpoints(d)]


# --------------------------------------------------------------------------- damaged checkpoints
def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip_a_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("damage, name", [(_truncate, "model.safetensors"), (_flip_a_byte, "training_state.pt"),
                                          (os.remove, "config.json")])
def test_a_damaged_newest_checkpoint_is_named_and_the_one_before_is_used(datasets, tmp_path, capsys, damage, name):
    out = tmp_path / "run"
    assert pretrain.main(_argv(datasets, out, "--stop-at-step", "3")) == exits.OK
    newest = os.path.join(str(out), "checkpoints", "step_00000003")
    damage(os.path.join(newest, name))
    # Named explicitly: an error naming the file.
    assert pretrain.main(_argv(datasets, out, "--resume", newest)) == exits.USAGE
    assert os.path.join(newest, name) in capsys.readouterr().err
    # --resume auto: set aside, and the run continues from step 2.
    assert pretrain.main(_argv(datasets, out, "--resume")) == exits.OK
    said = capsys.readouterr().out
    assert os.path.join(newest, name) in said and "set aside" in said
    assert json.load(open(out / "run.json"))["starts"][-1]["step"] == 2
    assert _steps(out)[-1] == 6 and any(n.startswith("step_00000003.damaged-") for n in os.listdir(out / "checkpoints"))


# --------------------------------------------------------------------------- a full disk
def test_a_full_disk_names_the_path_and_keeps_the_earlier_checkpoints(datasets, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    real_save = torch.save

    def save(obj, f, *a, **k):
        if "step_00000003" in str(f):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(checkpoints.torch, "save", save)
    rc = pretrain.main(_argv(datasets, out))
    err = capsys.readouterr().err
    assert rc == exits.IO and "could not write the checkpoint" in err and "step_00000003" in err
    assert "the disk is full" in err and "MB free" in err
    assert _steps(out) == [1, 2] and not [n for n in os.listdir(out / "checkpoints") if n.startswith(".tmp")]


def test_a_real_full_file_system(datasets, tmp_path, capsys):
    """The same on a 2 MB tmpfs (root only: skipped where mounting is not allowed)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        rc = pretrain.main(_argv(datasets, mnt / "run"))
        err = capsys.readouterr().err
        assert rc == exits.IO and "the disk is full" in err and str(mnt) in err, err
        kept = checkpoints.list_checkpoints(str(mnt / "run" / "checkpoints"))
        assert all(checkpoints.verify_checkpoint(path) for _, path in kept)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


# --------------------------------------------------------------------------- kill -9 and SIGTERM
# The run is slowed while a checkpoint is written (after the weights and training state, before
# the manifest), so the test can kill it there.
SLOW_SAVE = """
import sys, time
from bertfast.training import checkpoints
write = checkpoints.write_manifest
checkpoints.write_manifest = lambda *a, **k: (time.sleep(0.5), write(*a, **k))
from bertfast import pretrain
sys.exit(pretrain.main(sys.argv[1:]))
"""


def _start(argv):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, "-c", SLOW_SAVE, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)


def _wait_for(proc, ready, timeout=120):
    t0 = time.time()
    while not ready():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() - t0 < timeout
        time.sleep(0.005)


def test_sigterm_during_the_set_up_exits_75_and_loses_nothing(datasets, tmp_path, monkeypatch, capsys):
    """A SIGTERM before the first step (here: while the steps are resolved, before the model is
    built) stops the run with exit 75 and no step taken; --resume then runs it all."""
    real = pretrain.resolve_steps

    def resolve_steps(args):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(args)

    monkeypatch.setattr(pretrain, "resolve_steps", resolve_steps)
    assert pretrain.main(_argv(datasets, tmp_path / "run")) == exits.STOPPED
    assert "stopped by signal before step 1" in capsys.readouterr().out
    assert _steps(tmp_path / "run") == [] and not _losses(tmp_path / "run")
    monkeypatch.undo()
    assert pretrain.main(_argv(datasets, tmp_path / "run", "--resume")) == exits.OK
    assert _steps(tmp_path / "run")[-1] == 6


def test_kill_minus_nine_and_sigterm_lose_nothing(datasets, tmp_path):
    ref = _start(_argv(datasets, tmp_path / "ref", "--threads", "1"))
    assert ref.wait(300) == exits.OK, ref.stdout.read()
    argv = _argv(datasets, tmp_path / "run", "--threads", "1", "--resume")
    ckpt_dir = tmp_path / "run" / "checkpoints"

    # 1. kill -9 while step 2's checkpoint is being written.
    proc = _start(argv)
    _wait_for(proc, lambda: ckpt_dir.is_dir() and any(n.startswith(".tmp_step_00000002") for n in os.listdir(ckpt_dir)))
    proc.kill()
    proc.wait()
    assert _steps(tmp_path / "run") == [1]
    # 2. SIGTERM after step 4: a checkpoint of the step it was in, then exit 75.
    proc = _start(argv)
    _wait_for(proc, lambda: 4 in _steps(tmp_path / "run"))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == exits.STOPPED
    assert "stopped by signal" in proc.stdout.read()
    # 3. The rest.
    proc = _start(argv)
    assert proc.wait(300) == exits.OK, proc.stdout.read()
    assert _losses(tmp_path / "run") == _losses(tmp_path / "ref")   # exactly: nothing lost, nothing repeated
    assert _steps(tmp_path / "run")[-1] == 6 and not any(n.startswith(".") for n in os.listdir(ckpt_dir))

