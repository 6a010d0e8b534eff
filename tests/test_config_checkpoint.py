"""BertConfig presets and JSON, checkpoint directories (safetensors, .bin, legacy names), read by transformers."""
import json

import pytest
import torch

import bertfast
from bertfast.model.config import head_dim
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")


def test_presets_have_the_paper_sizes():
    base, large = bertfast.BertConfig.preset("bert-base"), bertfast.BertConfig.preset("bert-large")
    assert (base.num_hidden_layers, base.hidden_size, base.num_attention_heads, base.intermediate_size) == \
        (12, 768, 12, 3072)
    assert (large.num_hidden_layers, large.hidden_size, large.num_attention_heads, large.intermediate_size) == \
        (24, 1024, 16, 4096)
    assert head_dim(base) == head_dim(large) == 64
    with torch.device("meta"):
        assert 105e6 < bertfast.BertForPreTraining(base).num_parameters() < 115e6  # "110M"
        assert 330e6 < bertfast.BertForPreTraining(large).num_parameters() < 345e6  # "340M"


def test_config_json_round_trips_through_transformers(tmp_path):
    ours = bertfast.BertConfig.preset("tiny", num_labels=3, problem_type="regression", classifier_dropout=0.2)
    ours.save_pretrained(tmp_path)
    theirs = transformers.BertConfig.from_pretrained(tmp_path)
    assert theirs.hidden_size == ours.hidden_size and theirs.num_labels == 3
    assert theirs.problem_type == "regression" and theirs.classifier_dropout == 0.2
    theirs.save_pretrained(tmp_path / "again")
    back = bertfast.BertConfig.from_pretrained(tmp_path / "again")
    assert back.num_labels == 3 and back.id2label == ours.id2label and back.hidden_size == ours.hidden_size


def test_unknown_config_keys_are_kept(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64,
                                                      "num_attention_heads": 4, "my_key": 3}))
    config = bertfast.BertConfig.from_pretrained(tmp_path)
    assert config.my_key == 3 and config.to_dict()["my_key"] == 3


def _tiny_hf(tmp_path, **save):
    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                                                 num_attention_heads=4, intermediate_size=40))
    hf.save_pretrained(tmp_path, **save)
    return hf.eval()


def test_pytorch_bin_with_legacy_gamma_beta_and_position_ids(tmp_path):
    hf = _tiny_hf(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    legacy = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
              for k, v in state.items()}
    legacy["bert.embeddings.position_ids"] = torch.arange(512)[None]
    (tmp_path / "model.safetensors").unlink()
    torch.save(legacy, tmp_path / "pytorch_model.bin")
    ours = bertfast.BertForPreTraining.from_pretrained(str(tmp_path)).eval()
    ids = torch.randint(0, 99, (2, 7))
    torch.testing.assert_close(ours(ids).prediction_logits, hf(input_ids=ids).prediction_logits, atol=1e-5, rtol=0)


def test_base_model_checkpoint_loads_into_head_models_and_back(tmp_path):
    _tiny_hf(tmp_path)
    base = bertfast.BertModel.from_pretrained(str(tmp_path))  # drops the "bert." prefix, ignores the heads
    base.save_pretrained(str(tmp_path / "base"))
    classifier = bertfast.BertForSequenceClassification.from_pretrained(str(tmp_path / "base"), num_labels=4)
    torch.testing.assert_close(classifier.bert.embeddings.word_embeddings.weight,
                               base.embeddings.word_embeddings.weight)
    assert classifier.classifier.out_features == 4


def test_missing_and_unexpected_weights_are_reported_in_the_loading_info(tmp_path):
    _tiny_hf(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["bert.encoder.layer.1.output.dense.weight"]
    state["bert.encoder.surprise"] = torch.zeros(1)
    save_file(state, tmp_path / "model.safetensors")
    _, info = bertfast.BertForPreTraining.from_pretrained(str(tmp_path), output_loading_info=True)
    assert "bert.encoder.layer.1.output.dense.weight" in info["missing_keys"]
    assert "bert.encoder.surprise" in info["unexpected_keys"]


def test_a_missing_local_directory_is_a_clear_error(tmp_path):
    with pytest.raises(OSError, match="nowhere"):
        bertfast.BertModel.from_pretrained(str(tmp_path / "nowhere"))
