"""Working copies of the GEMM weights (bertfast.model.working_weights): which weights get one, when the
forward may use one (fresh: written since its master last changed), and that a run whose
optimizer writes them computes bit for bit what a run casting every weight computes, without
the casts.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bertfast
from bertfast.model import working_weights
from bertfast.training import optim

pytestmark = pytest.mark.gpu_capable
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def gpu_sized_chunks(monkeypatch):
    """The optimizer kernels' GPU chunks under the interpreter too (kernels.lamb's TensorTables, which
    AdamW's tables are): a tiny model's step is then a few programs, not hundreds."""
    from bertfast.kernels import lamb as tables
    monkeypatch.setattr(tables, "INTERP_BLOCK", tables.BLOCK)
    monkeypatch.setattr(tables, "INTERP_CHUNK", tables.CHUNK)


def _model(dropout=0.0):
    torch.manual_seed(0)
    config = bertfast.BertConfig.preset("tiny", hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return bertfast.BertForMaskedLM(config).to(DEVICE)


def _qkv(model, layer=0):
    attention = model.bert.encoder.layer[layer].attention.self
    linears = (attention.query, attention.key, attention.value)
    return [m.weight for m in linears], [m.bias for m in linears]


def test_every_linear_gets_a_copy_and_each_attention_one_qkv_buffer():
    model = _model()
    working = working_weights.WorkingWeights(model)
    try:
        linears = [m for m in model.bert.encoder.modules() if type(m) is torch.nn.Linear]
        assert len(working) == sum(1 + (m.bias is not None) for m in linears)
        assert working.numel == sum(p.numel() for m in linears for p in m.parameters())
        for layer in range(model.config.num_hidden_layers):
            weights, biases = _qkv(model, layer)
            buffer = working_weights.lookup(weights, torch.bfloat16)
            assert buffer.shape == (3 * weights[0].shape[0], weights[0].shape[1])
            assert torch.equal(buffer, torch.cat(weights).to(torch.bfloat16))
            assert torch.equal(working_weights.lookup(biases, torch.bfloat16), torch.cat(biases).to(torch.bfloat16))
        assert working.copy_of(model.bert.embeddings.LayerNorm.weight) is None
        assert working.copy_of(model.bert.embeddings.word_embeddings.weight) is None   # the MLM decoder's
        assert working.copy_of(model.cls.predictions.transform.dense.weight) is None  # the MLM head op casts it
    finally:
        working.release()


def test_a_copy_is_used_only_while_fresh_whole_and_in_order():
    model = _model()
    working = working_weights.WorkingWeights(model)
    try:
        weights, _ = _qkv(model)
        bf16 = torch.bfloat16
        assert working_weights.lookup(weights, bf16) is not None
        assert working_weights.lookup(weights, torch.float16) is None           # another dtype
        assert working_weights.lookup(weights[:2], bf16) is None                # part of the buffer
        assert working_weights.lookup(weights[::-1], bf16) is None              # another order
        assert working_weights.lookup(weights, None) is None                    # no autocast
        with torch.no_grad():
            weights[1].add_(1.0)                                                 # a torch write: version bumped
        assert working_weights.lookup(weights, bf16) is None
        working.refresh([weights[1]])
        assert torch.equal(working_weights.lookup(weights, bf16), torch.cat(weights).to(bf16))
        working.release()
        assert working_weights.lookup(weights, bf16) is None
    finally:
        working.release()


class _Casts(TorchDispatchMode):
    """The casts (copies) of the encoder's fp32 GEMM weights, told by their addresses."""

    def __init__(self, addresses):
        super().__init__()
        self.addresses, self.count = addresses, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            if source.dtype == torch.float32 and source.data_ptr() in self.addresses:
                self.count += 1
        return func(*args, **kwargs)


def _batch(model, generator):
    ids = torch.randint(5, model.config.vocab_size, (2, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = torch.where(torch.rand(ids.shape, generator=generator) < 0.3, ids, -100)
    return {k: v.to(DEVICE) for k, v in dict(input_ids=ids, attention_mask=mask, labels=labels).items()}


def _train(model, working_dtype, steps=3):
    opt = optim.build_optimizer(model, "adamw", 1e-3, implementation="triton", working_dtype=working_dtype)
    generator = torch.Generator().manual_seed(1)
    addresses = {m.weight.data_ptr() for m in model.bert.encoder.modules() if type(m) is torch.nn.Linear}
    casts, losses = [], []
    for _ in range(steps):
        batch = _batch(model, generator)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16), _Casts(addresses) as log:
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        casts.append(log.count)
        losses.append(loss.detach())
    if opt.working is not None:
        opt.working.release()
    return casts, losses


def test_training_on_working_copies_is_bit_identical_to_casting_and_casts_no_encoder_weight(gpu_sized_chunks):
    """The triton AdamW (under the interpreter on a CPU, its GPU-sized chunks) with and without
    working copies, three bf16 steps: the same losses and weights (bit for bit on a CPU), and with
    copies no encoder GEMM weight is cast in a forward (without them, every one is)."""
    ok, why = optim.triton_adamw_availability()
    if not ok:
        pytest.skip(f"the triton AdamW is unavailable: {why}")
    casting, copying = _model(), _model()
    cast_counts, cast_losses = _train(casting, None)
    copy_counts, copy_losses = _train(copying, torch.bfloat16)
    assert all(count >= 4 * casting.config.num_hidden_layers for count in cast_counts), cast_counts
    assert copy_counts == [0, 0, 0]
    # On a GPU two runs of the same step need not agree to the bit (cuBLAS picks its algorithms, the
    # gradients of the tables are summed in any order): close there, identical on a CPU.
    same = torch.equal if DEVICE.type == "cpu" else (
        lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-6))
    assert all(same(a, b) for a, b in zip(cast_losses, copy_losses)), (cast_losses, copy_losses)
    for (name, a), b in zip(casting.named_parameters(), copying.parameters()):
        assert same(a, b), name


def test_raw_pointer_writes_leave_only_the_copies_written_beside_them_fresh(gpu_sized_chunks):
    """bertfast's optimizer kernels bump no version counter, so they report what they wrote: a
    weight written with its registered copy stays fresh; written without it (LAMB; an AdamW with
    no copies, or with a set another has since taken over) it goes stale; a set released or
    collected is forgotten."""
    import gc

    model = _model()
    weights, _ = _qkv(model)
    bf16 = torch.bfloat16
    older = working_weights.WorkingWeights(model)
    working_weights.written(weights, [older.copy_of(p) for p in weights])
    assert working_weights.lookup(weights, bf16) is not None
    working_weights.written(weights[:1], [None])                                # LAMB's report
    assert working_weights.lookup(weights, bf16) is None
    newer = working_weights.WorkingWeights(model)                                # takes the weights over
    assert working_weights.lookup(weights, bf16) is not None
    working_weights.written(weights, [older.copy_of(p) for p in weights])       # the older set's copies
    assert working_weights.lookup(weights, bf16) is None
    newer.refresh()
    ok, why = optim.triton_adamw_availability()
    if ok:  # an AdamW keeping no copies, stepping the same weights
        opt = optim.build_optimizer(model, "adamw", 1e-3, implementation="triton")
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        assert working_weights.lookup(weights, bf16) is None
    newer.refresh()
    assert working_weights.lookup(weights, bf16) is not None
    del newer
    gc.collect()
    assert working_weights.lookup(weights, bf16) is None and not working_weights._ENTRIES
    older.release()
