"""The fused ops as torch.library custom ops: opcheck, autograd against the reference,
torch.compile(fullgraph=True), and the static-shape MLM gather."""
import pytest
import torch

import bertfast
import bertfast.ops as ops
from bertfast import reference
from bertfast.testing import cu_seqlens_from_lengths

OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _leaf(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


def op_samples():
    """(custom op, args) pairs covering every op and its backward."""
    lengths = torch.tensor([3, 0, 5])
    cu = cu_seqlens_from_lengths(lengths)
    seed = torch.tensor([7], dtype=torch.int64)
    q = torch.randn(2, 5, 2, 16, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    ids = torch.tensor([1, 2, 2, 0, 5])
    return [
        (torch.ops.bertfast.bias_gelu, (_leaf(4, 6), _leaf(6), "none", "torch")),
        (torch.ops.bertfast.bias_dropout_residual_layernorm,
         (_leaf(4, 6), _leaf(6), _leaf(4, 6), _leaf(6), _leaf(6), 1e-5, 0.1, seed, "torch")),
        (torch.ops.bertfast.bias_dropout_residual_layernorm,
         (_leaf(4, 6), None, None, _leaf(6), _leaf(6), 1e-5, 0.0, None, "torch")),
        (torch.ops.bertfast.attention_varlen, (_leaf(8, 3, 2, 16), cu, 5, 0.25, 0.1, seed, "torch")),
        (torch.ops.bertfast.attention_padded, (q, torch.randn_like(q), torch.randn_like(q), mask, 0.25, 0.0, None,
                                               "torch")),
        # q, k, v as transformers' attention passes them: [B, A, S, D] transposed to [B, S, A, D]
        (torch.ops.bertfast.attention_padded, (*(_leaf(2, 2, 5, 16).transpose(1, 2) for _ in range(3)), mask, 0.25,
                                               0.0, None, "torch")),
        (torch.ops.bertfast.embeddings, (ids, torch.arange(5), torch.tensor([0, 0, 1, 1, 0]), _leaf(7, 6), _leaf(5, 6),
                                         _leaf(2, 6), _leaf(6), _leaf(6), 1e-12, 0.1, seed, torch.float32, "torch")),
        (torch.ops.bertfast.mlm_head_loss_decoder, (_leaf(5, 6), _leaf(9, 6), _leaf(9), torch.tensor([1, -100, 8, 0, 3]),
                                                   2, True, "torch")),
    ]


@pytest.mark.parametrize("index", range(len(op_samples())))
def test_opcheck(index):
    op, args = op_samples()[index]
    torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS)


def test_every_op_has_three_backends():
    from bertfast import dispatch

    for op in dispatch.ops():
        assert set(dispatch.backends(op)) == {"torch", "triton", "cuda"}, op


def test_attention_varlen_matches_reference_with_gradients():
    lengths = torch.tensor([4, 1, 0, 6])
    cu = cu_seqlens_from_lengths(lengths)
    qkv = torch.randn(int(lengths.sum()), 3, 2, 8, dtype=torch.float64, requires_grad=True)
    out = ops.attention_varlen(qkv, cu, 6)
    q = qkv.detach().clone().requires_grad_()
    ref = reference.attention_varlen(q[:, 0], q[:, 1], q[:, 2], cu, 6)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    grad = torch.randn_like(ref)
    (out.double() * grad).sum().backward()
    (ref * grad).sum().backward()
    torch.testing.assert_close(qkv.grad, q.grad, atol=1e-5, rtol=0)


def test_dropout_draws_a_new_mask_per_call_and_follows_manual_seed():
    x = torch.ones(64, 32)
    w, b = torch.ones(32), torch.zeros(32)
    torch.manual_seed(3)
    first = ops.bias_dropout_residual_layernorm(x, None, x, w, b, 1e-5, 0.5)
    second = ops.bias_dropout_residual_layernorm(x, None, x, w, b, 1e-5, 0.5)
    torch.manual_seed(3)
    again = ops.bias_dropout_residual_layernorm(x, None, x, w, b, 1e-5, 0.5)
    assert not torch.equal(first, second)
    assert torch.equal(first, again)


@pytest.mark.parametrize("max_predictions", [None, 3])
def test_mlm_head_loss_static_and_dynamic_match_full_logits(max_predictions):
    torch.manual_seed(0)
    batch, seqlen, width, vocab = 3, 6, 8, 13
    hidden = torch.randn(batch, seqlen, width, requires_grad=True)
    labels = torch.full((batch, seqlen), -100)
    labels[0, [1, 4]] = torch.tensor([3, 5])
    labels[2, [0, 2, 5]] = torch.tensor([12, 0, 7])
    params = [torch.randn(width, width) * 0.3, torch.randn(width), 1 + 0.1 * torch.randn(width), torch.randn(width)]
    decoder, bias = torch.randn(vocab, width, requires_grad=True), torch.randn(vocab, requires_grad=True)
    got = ops.mlm_head_loss(hidden, labels, *params, 1e-12, decoder, bias, max_predictions_per_seq=max_predictions)
    h = torch.nn.functional.gelu(hidden @ params[0].T + params[1])
    h = torch.nn.functional.layer_norm(h, (width,), params[2], params[3], 1e-12)
    logits = h @ decoder.T + bias
    expected = torch.nn.functional.cross_entropy(logits.view(-1, vocab), labels.view(-1))
    torch.testing.assert_close(got.loss, expected, atol=1e-5, rtol=0)
    assert int(got.num_predictions) == 5
    valid = labels.view(-1) != -100
    assert int(got.num_correct) == int((logits.view(-1, vocab).argmax(-1) == labels.view(-1))[valid].sum())
    g1 = torch.autograd.grad(got.loss, [hidden, decoder, bias])
    g2 = torch.autograd.grad(expected, [hidden, decoder, bias])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_mlm_head_loss_zero_labels_gives_zero_loss_and_zero_gradients():
    hidden = torch.randn(2, 4, 8, requires_grad=True)
    decoder = torch.randn(11, 8, requires_grad=True)
    labels = torch.full((2, 4), -100)
    got = ops.mlm_head_loss(hidden, labels, torch.eye(8), torch.zeros(8), torch.ones(8), torch.zeros(8), 1e-12,
                            decoder, None)
    assert got.loss.item() == 0.0 and int(got.num_predictions) == 0
    gh, gd = torch.autograd.grad(got.loss, [hidden, decoder])
    assert torch.count_nonzero(gh) == 0 and torch.count_nonzero(gd) == 0


def test_static_max_predictions_rejects_nothing_silently():
    labels = torch.full((2, 6), -100)
    labels[0, :4] = 1
    positions = ops.masked_positions(labels, 3)
    assert positions.shape == (6,)  # static: batch * max_predictions
    assert positions[:3].tolist() == [0, 1, 2]  # the first labelled positions of sequence 0


def test_linear_cross_entropy_label_out_of_range_is_a_clear_error():
    with pytest.raises(ValueError, match=r"labels must be in \[0, 9\)"):
        ops.mlm_head_loss_decoder(torch.randn(3, 4), torch.randn(9, 4), None, torch.tensor([1, 9, -100]))


def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    config = bertfast.BertConfig.preset("tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                        num_hidden_layers=1)
    model = bertfast.BertForPreTraining(config)
    ids = torch.randint(1, config.vocab_size, (2, 8))
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    labels = torch.where(torch.rand(2, 8) < 0.4, ids, -100) * mask + (mask - 1) * 100
    nsp = torch.tensor([0, 1])
    eager = model(ids, mask, labels=labels, next_sentence_label=nsp)
    eager_grads = torch.autograd.grad(eager.loss, list(model.parameters()))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(ids, mask, labels=labels, next_sentence_label=nsp)
    torch.testing.assert_close(out.loss, eager.loss, atol=1e-5, rtol=0)
    got = torch.autograd.grad(out.loss, list(model.parameters()))
    for a, b in zip(got, eager_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("form", ["static", "dynamic"])
def test_mlm_head_under_torch_compile_matches_eager(form, monkeypatch):
    """max_predictions_per_seq (static shapes), or a data-dependent count captured by Dynamo."""
    if form == "dynamic":
        monkeypatch.setattr(torch._dynamo.config, "capture_dynamic_output_shape_ops", True)
    torch.manual_seed(0)
    hidden = torch.randn(2, 6, 8, requires_grad=True)
    labels = torch.full((2, 6), -100)
    labels[0, [1, 4]] = torch.tensor([3, 5])
    labels[1, 2] = 7
    params = [torch.randn(8, 8) * 0.3, torch.randn(8), torch.ones(8), torch.zeros(8)]
    decoder = torch.randn(11, 8, requires_grad=True)
    kwargs = dict(max_predictions_per_seq=3) if form == "static" else {}

    def head(h, lab):
        return ops.mlm_head_loss(h, lab, *params, 1e-12, decoder, None, **kwargs).loss

    torch._dynamo.reset()
    expected = head(hidden, labels)
    got = torch.compile(head, fullgraph=True, backend="aot_eager")(hidden, labels)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    g1 = torch.autograd.grad(got, [hidden, decoder])
    g2 = torch.autograd.grad(expected, [hidden, decoder])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
