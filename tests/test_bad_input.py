"""Bad input gets a ValueError naming what was expected and what was given (or the exception type
transformers raises for that case), and a broken checkpoint an error naming its file."""
import json
import re
import shutil

import pytest
import torch

import bertfast

CONFIG = bertfast.BertConfig.preset("tiny")


@pytest.fixture(scope="module")
def model():
    return bertfast.BertForPreTraining(CONFIG).eval()


def ids(batch=2, seqlen=6):
    return torch.randint(1, CONFIG.vocab_size, (batch, seqlen))


@pytest.mark.parametrize("kwargs, message", [
    (dict(input_ids=ids().float()), "input_ids: expected an integer tensor, got dtype torch.float32"),
    (dict(input_ids=ids()[0]), r"input_ids: expected shape \[batch, seq_len\], got \(6,\)"),
    (dict(input_ids=ids(seqlen=CONFIG.max_position_embeddings + 1)), "exceeds max_position_embeddings 128"),
    (dict(input_ids=torch.full((2, 6), CONFIG.vocab_size)), r"input_ids: expected values in \[0, vocab_size=512\)"),
    (dict(input_ids=ids(), token_type_ids=torch.full((2, 6), 2)), r"token_type_ids: expected values in \[0, type_vocab"),
    (dict(input_ids=ids(), attention_mask=torch.full((2, 6), 2)), "attention_mask: expected only 0 .* and 1"),
    (dict(input_ids=ids(), attention_mask=torch.ones(2, 5)), r"attention_mask: expected shape \[2, 6\], got \(2, 5\)"),
    (dict(input_ids=ids(), labels=torch.full((2, 6), CONFIG.vocab_size)), r"labels: expected values in \[0, 512\)"),
    (dict(input_ids=ids(), labels=torch.zeros(2, 5, dtype=torch.long)), r"labels: expected shape \(2, 6\)"),
    (dict(input_ids=ids(), next_sentence_label=torch.tensor([0, 2])), r"next_sentence_label: expected values in \[0, 2\)"),
    (dict(input_ids=ids(), encoder_hidden_states=torch.zeros(2, 6, 64)), "encoder only"),
])
def test_bad_inputs_raise_clear_errors(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model(**kwargs)


def embeds(batch=2, seqlen=6, **kwargs):
    return torch.randn(batch, seqlen, CONFIG.hidden_size, **kwargs)


def with_value(t, value):
    t = t.clone()
    t.view(-1)[3] = value
    return t


def mlm_labels(per_seq):
    labels = torch.full((2, 6), -100)
    labels[:, :per_seq] = 5
    return labels


@pytest.fixture(scope="module")
def models():
    """One model per class, built on first use."""
    built = {}

    def get(name):
        if name not in built:
            torch.manual_seed(0)
            built[name] = getattr(bertfast, name)(CONFIG).eval()
        return built[name]
    return get


# issue 16: inputs that gave a traceback from deep inside the model, or silent garbage.
@pytest.mark.parametrize("cls_name, kwargs, error, message", [
    ("BertModel", dict(input_ids=torch.zeros(2, 0, dtype=torch.long)), ValueError,
     r"input_ids: expected at least one position per sequence, got sequence length 0 \(shape \(2, 0\)\)"),
    ("BertModel", dict(inputs_embeds=embeds(seqlen=0)), ValueError, "inputs_embeds: .* got sequence length 0"),
    ("BertForMultipleChoice", dict(input_ids=torch.zeros(2, 0, 6, dtype=torch.long)), ValueError,
     r"expected inputs of shape \[batch, num_choices >= 1, seq_len\], got \(2, 0, 6\)"),
    ("BertModel", dict(inputs_embeds=embeds(dtype=torch.float64)), ValueError,
     r"inputs_embeds: expected dtype torch.float32 \(the model's\) or a narrower float type, got torch.float64"),
    ("BertModel", dict(inputs_embeds=embeds().long()), ValueError,
     "inputs_embeds: expected a floating-point tensor, got dtype torch.int64"),
    ("BertModel", dict(input_ids=ids().to("meta")), ValueError, "input_ids: expected a tensor with values .* meta device"),
    ("BertModel", dict(input_ids=ids(), attention_mask=torch.ones(2, 6, device="meta")), ValueError,
     "attention_mask: .* meta device"),
    ("BertModel", dict(inputs_embeds=with_value(embeds(), float("nan"))), ValueError,
     "inputs_embeds: expected finite values, got 1 NaN or inf values"),
    ("BertModel", dict(inputs_embeds=with_value(embeds(), float("-inf"))), ValueError,
     "inputs_embeds: expected finite values, got 1 NaN or inf values"),
    ("BertModel", dict(input_ids=ids(), position_ids=torch.arange(6)), ValueError,
     r"position_ids: expected shape \[2, 6\] \(or \[1, 6\], broadcast over the batch\), got \(6,\)"),
    ("BertModel", dict(input_ids=ids(), token_type_ids=torch.zeros(3, 6, dtype=torch.long)), ValueError,
     r"token_type_ids: expected shape \[2, 6\] \(or \[1, 6\]"),
    ("BertForMaskedLM", dict(input_ids=ids(), labels=mlm_labels(3), max_predictions_per_seq=0), ValueError,
     "max_predictions_per_seq: expected a positive int or None, got 0"),
    ("BertForMaskedLM", dict(input_ids=ids(), labels=mlm_labels(3), max_predictions_per_seq=2), ValueError,
     r"sequence 0 has 3 labelled positions \(labels != -100\), more than max_predictions_per_seq=2"),
])
def test_bad_inputs_of_issue_16_raise_clear_errors(models, cls_name, kwargs, error, message):
    with pytest.raises(error, match=message):
        models(cls_name)(**kwargs)


def test_max_predictions_per_seq_is_checked_on_the_reference_path_too(models):
    model = models("BertForMaskedLM")
    with bertfast.reference_execution(model), pytest.raises(ValueError, match="expected a positive int or None, got 0"):
        model(input_ids=ids(), labels=mlm_labels(1), max_predictions_per_seq=0)


def test_output_attentions_needs_reference_execution(model):
    with pytest.raises(ValueError, match="reference_execution"):
        model(ids(), output_attentions=True)
    with bertfast.reference_execution(model):
        out = model(ids(), output_attentions=True)
    assert len(out.attentions) == CONFIG.num_hidden_layers


@pytest.mark.parametrize("values, message", [
    (dict(hidden_size=65), "must be divisible by num_attention_heads"),
    (dict(hidden_act="relu"), "hidden_act must be one of"),
    (dict(position_embedding_type="relative_key"), "position_embedding_type must be 'absolute'"),
    (dict(is_decoder=True), "encoder only"),
    (dict(hidden_dropout_prob=1.0), r"hidden_dropout_prob must be in \[0, 1\)"),
    (dict(vocab_size=0), "vocab_size must be a positive int"),
    (dict(problem_type="ranking"), "problem_type must be one of"),
])
def test_bad_config_raises_clear_errors(values, message):
    with pytest.raises(ValueError, match=message):
        bertfast.BertConfig.preset("tiny", **values)


def test_a_transformers_config_is_checked_when_the_model_is_built():
    import transformers

    config = transformers.BertConfig(**{**bertfast.BertConfig.preset("tiny").to_dict(), "hidden_act": "relu"})
    with pytest.raises(ValueError, match="hidden_act must be one of"):
        bertfast.BertModel(config)
    with pytest.raises(ValueError, match="expected a transformers BertConfig"):
        bertfast.BertModel(transformers.RobertaConfig())


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="expected one of"):
        bertfast.BertConfig.preset("bert-huge")


# ---------------------------------------------------------------- broken checkpoints (issue 16)
def _edit_config(**values):
    def edit(folder):
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **values}))
    return edit


def _truncate(name, keep):
    def edit(folder):
        path = folder / name
        path.write_bytes(path.read_bytes()[:keep])
    return edit


def _as_bin(folder):
    from safetensors.torch import load_file

    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")


def _poison(name, value):
    def edit(folder):
        from safetensors.torch import load_file, save_file

        state = load_file(folder / "model.safetensors")
        state[name].view(-1)[1] = value
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return edit


QUERY = "bert.encoder.layer.1.attention.self.query.weight"
# (edit of a good checkpoint, the file the error names (None: the folder), error, message after the name);
# config cases are checked through BertConfig.from_pretrained and the model's from_pretrained.
CHECKPOINT_CASES = {
    "config not JSON": (lambda f: (f / "config.json").write_text('{"hidden_size": 64,'), "config.json", OSError,
                        "not a valid JSON config file .*line 1 column"),
    "config a JSON list": (lambda f: (f / "config.json").write_text("[1, 2]"), "config.json", OSError,
                           "expected a JSON object of config fields, got a JSON array"),
    "hidden_size null": (_edit_config(hidden_size=None), "config.json", ValueError,
                         "invalid value for 'hidden_size': .*expected int, got NoneType"),
    "hidden_size a string": (_edit_config(hidden_size="3"), "config.json", ValueError,
                             "invalid value for 'hidden_size': .*expected int, got str"),
    "dropout a string": (_edit_config(hidden_dropout_prob="0.1"), "config.json", ValueError,
                         "invalid value for 'hidden_dropout_prob'"),
    "num_hidden_layers 0": (_edit_config(num_hidden_layers=0), "config.json", ValueError,
                            "num_hidden_layers must be a positive int, got 0"),
    "truncated safetensors": (_truncate("model.safetensors", 4000), "model.safetensors", OSError,
                              "cannot read the weights: .* the file is truncated or corrupt"),
    "truncated safetensors tail": (_truncate("model.safetensors", -64), "model.safetensors", OSError,
                                   "cannot read the weights: .* the file is truncated or corrupt"),
    "truncated bin": (lambda f: (_as_bin(f), _truncate("pytorch_model.bin", 300000)(f)), "pytorch_model.bin",
                      OSError, "cannot read the weights: .*central directory .* truncated or corrupt"),
    "NaN weight": (_poison(QUERY, float("nan")), None, ValueError,
                   rf"the loaded weights hold NaN or inf values: {QUERY} \(1 of 4096 values\)"),
    "inf weight": (_poison("cls.predictions.bias", float("inf")), None, ValueError,
                   r"the loaded weights hold NaN or inf values: cls.predictions.bias \(1 of 512 values\)"),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good")
    bertfast.BertForPreTraining(CONFIG).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_broken_checkpoints_raise_errors_naming_the_file(checkpoint, tmp_path, case):
    edit, name, error, message = CHECKPOINT_CASES[case]
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint, folder)
    edit(folder)
    where = re.escape(str(folder / name if name else folder))
    loaders = [bertfast.BertForPreTraining.from_pretrained]
    if name == "config.json":
        loaders.append(bertfast.BertConfig.from_pretrained)
    for load in loaders:
        with pytest.raises(error, match=f"^{where}: {message}"):
            load(folder)


def test_a_good_checkpoint_still_loads(checkpoint):
    assert bertfast.BertConfig.from_pretrained(checkpoint).hidden_size == CONFIG.hidden_size
    bertfast.BertForPreTraining.from_pretrained(checkpoint)
