"""Export: torch.export and ONNX (opset 18, onnxruntime) of BertModel and BertForSequenceClassification
(and of the RoBERTa family's) with dynamic batch and sequence length, checked against transformers'
classes at real tokens.

Exporting traces the reference math (plain PyTorch ops, padded layout), never the custom ops.
"""
import pytest
import torch

import bertfast

transformers = pytest.importorskip("transformers")

CASES = [("BertModel", "last_hidden_state"), ("BertForSequenceClassification", "logits"),
         ("RobertaModel", "last_hidden_state"), ("XLMRobertaForSequenceClassification", "logits"),
         ("ElectraModel", "last_hidden_state"), ("DistilBertForSequenceClassification", "logits")]


def _config(cls_name):
    """The tiny preset's sizes in the class's family config (RoBERTa's: 2 more positions, counted from 2;
    ELECTRA's: narrower embeddings; DistilBERT's under its own names)."""
    config = bertfast.BertConfig.preset("tiny")
    sizes = {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                             "intermediate_size")}
    for family in ("XLMRoberta", "Roberta", "Camembert"):
        if cls_name.startswith(family):
            return getattr(transformers, f"{family}Config")(**sizes, pad_token_id=1, max_position_embeddings=130)
    if cls_name.startswith("Electra"):  # with the embeddings projection
        return transformers.ElectraConfig(**sizes, embedding_size=32)
    if cls_name.startswith("DistilBert"):
        return transformers.DistilBertConfig(vocab_size=sizes["vocab_size"], dim=sizes["hidden_size"],
                                             n_layers=sizes["num_hidden_layers"], n_heads=sizes["num_attention_heads"],
                                             hidden_dim=sizes["intermediate_size"])
    return config


def _pair(cls_name, tmp_path):
    torch.manual_seed(0)
    ours = getattr(bertfast, cls_name)(_config(cls_name)).eval()
    ours.save_pretrained(tmp_path)
    theirs = getattr(transformers, cls_name).from_pretrained(tmp_path, attn_implementation="eager").eval()
    return ours, theirs


def _batch(batch, seqlen, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 500, (batch, seqlen), generator=gen)
    mask = torch.ones(batch, seqlen, dtype=torch.long)
    mask[0, seqlen // 2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _dynamic():
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=2, max=128)
    return {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}


def _compare(got, want, mask, key):
    if key == "last_hidden_state":
        got, want = got[mask.bool()], want[mask.bool()]
    torch.testing.assert_close(torch.as_tensor(got), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("cls_name, key", CASES)
def test_torch_export_with_dynamic_batch_and_length(cls_name, key, tmp_path):
    ours, theirs = _pair(cls_name, tmp_path)
    program = torch.export.export(ours, (), _batch(2, 9, 0), dynamic_shapes=_dynamic())
    for batch, seqlen in ((3, 12), (1, 5)):
        kw = _batch(batch, seqlen, batch)
        with torch.no_grad():
            _compare(program.module()(**kw)[key], theirs(**kw)[key], kw["attention_mask"], key)


@pytest.mark.parametrize("cls_name, key", CASES)
def test_onnx_export_runs_in_onnxruntime(cls_name, key, tmp_path):
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    ours, theirs = _pair(cls_name, tmp_path)
    path = str(tmp_path / "model.onnx")
    torch.onnx.export(ours, (), path, kwargs=_batch(2, 9, 0), dynamo=True, opset_version=18,
                      dynamic_shapes=_dynamic())
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    assert names == ["input_ids", "attention_mask"]
    for batch, seqlen in ((3, 12), (1, 5)):
        kw = _batch(batch, seqlen, batch)
        got = session.run(None, {name: kw[name].numpy() for name in names})[0]
        with torch.no_grad():
            _compare(torch.from_numpy(got), theirs(**kw)[key], kw["attention_mask"], key)
