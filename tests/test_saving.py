"""save_pretrained is atomic (issue 16): written next to the target, moved in weights first and config
last; a failed write leaves the previous save untouched and no staging directory behind."""
import errno
import os

import pytest
import torch
import transformers
from transformers import modeling_utils  # its safe_save_file is the weights write the tests break

import bertfast
from bertfast.model import saving


def build(seed):
    torch.manual_seed(seed)
    return bertfast.BertModel(bertfast.BertConfig.preset("tiny", hidden_dropout_prob=0.0,
                                                         attention_probs_dropout_prob=0.0)).eval()


def snapshot(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def assert_same_weights(model, other):
    theirs = other.state_dict()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(theirs[key], value, atol=0, rtol=0)


def leftovers(parent):
    return [n for n in os.listdir(parent) if ".saving-" in n]


def test_a_save_round_trips_through_bertfast_and_transformers(tmp_path):
    model = build(0)
    model.save_pretrained(tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["config.json", "model.safetensors"]
    assert_same_weights(model, bertfast.BertModel.from_pretrained(tmp_path / "ckpt"))
    hf = transformers.BertModel.from_pretrained(tmp_path / "ckpt", attn_implementation="eager").eval()
    assert_same_weights(model, hf)
    ids = torch.randint(1, 512, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).last_hidden_state, hf(ids).last_hidden_state, atol=2e-5, rtol=0)
    assert not leftovers(tmp_path)


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _broken(*args, **kwargs):
    raise RuntimeError("the weights write broke")


@pytest.mark.parametrize("fail, error, message", [
    (_disk_full, OSError, r"the disk is full \([0-9.]+ (bytes|KiB|MiB|GiB) free on .* when the write failed; the "
                          r"weights need about 567.8 KiB\); nothing was changed in .*ckpt \(a previous save there is "
                          r"untouched\)"),
    (_broken, RuntimeError, "the weights write broke"),
])
@pytest.mark.parametrize("sharded", [False, True])
def test_a_failed_weights_write_leaves_the_previous_save_untouched(tmp_path, monkeypatch, fail, error, message,
                                                                   sharded):
    old = build(0)
    target = tmp_path / "ckpt"
    old.save_pretrained(target, **(dict(max_shard_size="200KB") if sharded else {}))
    before = snapshot(target)
    new = build(1)
    new.config.my_marker = "new"  # a new config.json must not appear beside the old weights
    monkeypatch.setattr(modeling_utils, "safe_save_file", fail)
    with pytest.raises(error, match=message) as raised:
        new.save_pretrained(target)
    if fail is _disk_full:
        assert raised.value.errno == errno.ENOSPC
    else:  # other errors keep their type and get a note naming the directory
        assert any(str(target) in note for note in raised.value.__notes__)
    assert snapshot(target) == before
    assert not leftovers(tmp_path)
    monkeypatch.undo()
    assert_same_weights(old, bertfast.BertModel.from_pretrained(target))


def test_the_config_moves_in_last(tmp_path, monkeypatch):
    build(1).save_pretrained(tmp_path / "ckpt")                    # a previous save to protect
    moved = []
    real = os.replace
    monkeypatch.setattr(saving.os, "replace", lambda src, dst: (moved.append(os.path.basename(dst)), real(src, dst)))
    build(0).save_pretrained(tmp_path / "ckpt", max_shard_size="200KB")
    shards = [n for n in moved if n.endswith(".safetensors")]
    assert len(shards) > 1
    assert moved == shards + ["model.safetensors.index.json", "config.json"]


@pytest.mark.parametrize("first, second", [("sharded", "single"), ("single", "sharded")])
def test_stale_weight_files_of_the_previous_save_are_removed(tmp_path, first, second):
    """transformers' own save leaves an old model.safetensors beside new shards, and from_pretrained
    then loads the old weights; bertfast's save removes every weight file it did not write."""
    shard = dict(max_shard_size="200KB")
    target = tmp_path / "ckpt"
    build(0).save_pretrained(target, **(shard if first == "sharded" else {}))
    (target / "tokenizer.json").write_text("{}")  # not a weight file: kept
    new = build(1)
    new.save_pretrained(target, **(shard if second == "sharded" else {}))
    names = sorted(os.listdir(target))
    if second == "single":
        assert names == ["config.json", "model.safetensors", "tokenizer.json"]
    else:
        assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    assert_same_weights(new, bertfast.BertModel.from_pretrained(target))
    assert_same_weights(new, transformers.BertModel.from_pretrained(target))


def test_transformers_keywords_pass_through(tmp_path):
    model = build(0)
    model.save_pretrained(tmp_path / "v", variant="fp16")
    assert "model.fp16.safetensors" in os.listdir(tmp_path / "v")
    assert_same_weights(model, bertfast.BertModel.from_pretrained(tmp_path / "v", variant="fp16"))
    other = build(1)
    model.save_pretrained(tmp_path / "sd", True, other.state_dict())  # is_main_process, state_dict by position
    assert_same_weights(other, bertfast.BertModel.from_pretrained(tmp_path / "sd"))
    model.save_pretrained(tmp_path / "not-main", is_main_process=False)
    assert not os.listdir(tmp_path / "not-main")
    assert not leftovers(tmp_path)


def test_push_to_hub_is_transformers_own(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained",
                        lambda self, directory, **kw: calls.append((directory, kw)))
    build(0).save_pretrained(tmp_path / "hub", push_to_hub=True, repo_id="me/model")
    assert calls == [(tmp_path / "hub", dict(push_to_hub=True, repo_id="me/model"))]


def test_a_killed_save_leaves_no_staging_directory_behind_for_long(tmp_path):
    model = build(0)
    model.save_pretrained(tmp_path / "ckpt")
    dead = tmp_path / ".ckpt.saving-999999999-0123abcd"       # a save killed mid-write (no such pid)
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"partial")
    build(1).save_pretrained(tmp_path / "ckpt")
    assert not leftovers(tmp_path)
    assert_same_weights(build(1), bertfast.BertModel.from_pretrained(tmp_path / "ckpt"))


def test_a_save_into_a_new_or_empty_directory_writes_it_directly(tmp_path, monkeypatch):
    staged = []
    monkeypatch.setattr(saving, "_move_into", lambda *a: staged.append(a))
    (tmp_path / "empty").mkdir()
    build(0).save_pretrained(tmp_path / "empty")
    build(0).save_pretrained(tmp_path / "new")
    assert not staged and sorted(os.listdir(tmp_path / "new")) == ["config.json", "model.safetensors"]
