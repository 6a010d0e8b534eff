"""embeddings on the fused backends: the table gradients do not depend on the block schedule.

A resumed pre-training run must continue bit for bit (docs/training.md), so neither csrc/embeddings.cu
nor kernels/embeddings.py adds a table gradient with atomics. The wrapper stably sorts the row keys (word
ids, then V + position ids, then, when the token-type partials do not fit, V + P + type ids) and the
sorted entries are cut into chunks: a row inside a chunk is written there, the rows at a chunk's edges
leave partial sums, and a last pass writes every other row once: the sum of its chunks' partials in
order, or zeros. CUDA's backward kernel stores dh (the fp32 gradient of the summed embedding row, [T, H])
and its first table pass adds a chunk's dh rows; Triton's backward walks the sorted entries itself,
computing each entry's dh row as it goes. Both add a chunk's entries in token order, then the chunks in
order (test_table_rows_sum_in_a_fixed_order checks it to the bit on each). Token types kept aside (shared
memory, registers): per-block partials, summed in block order.

On the CPU emulator (tests/ops/conftest.py) BERTFAST_EMU_BLOCK_ORDER runs the blocks of every launch
reversed or shuffled; on a GPU the same test compares repeated runs. The chunk (CUDA's ``sort_chunk``,
Triton's ``_TABLE_CHUNK``) is patched small so that a few tokens already span several chunks (hot rows,
rows at chunk edges, rows inside one).
"""
import pytest
import torch

from bertfast import dispatch

OP = "embeddings"
EPS = 1e-12
TABLES = ("word", "pos", "token_type", "ln_weight", "ln_bias")
ROUNDING = {torch.float32: 1e-5, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}  # one ulp


def make(device, t, h, vocab, positions, types, dtype=torch.float32, out_dtype=None, hot=None, seed=0):
    """Ids and tables drawn on the CPU. The last word row and position row are never used; hot (a word
    id) takes every other token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab - 1, (t,), generator=g)
    if hot is not None:
        ids[::2] = hot
    pids = torch.randint(0, positions - 1, (t,), generator=g).int()
    tids = torch.randint(0, types, (t,), generator=g)
    rnd = lambda *s, scale=1.0, shift=0.0: (shift + scale * torch.randn(*s, generator=g)).to(dtype)  # noqa: E731
    tables = dict(word=rnd(vocab, h), pos=rnd(positions, h, scale=0.5), token_type=rnd(types, h, scale=0.5),
                  ln_weight=rnd(h, scale=0.2, shift=1.0), ln_bias=rnd(h, scale=0.2))
    dy = torch.randn(t, h, generator=g).to(out_dtype or dtype)
    to = lambda x: x.to(device)  # noqa: E731
    return dict(ids=[to(ids), to(pids), to(tids)], tables={k: to(v) for k, v in tables.items()}, dy=to(dy),
                out_dtype=out_dtype or dtype)


def grads(name, inp, p=0.0, seed=None):
    """{param: gradient} of backend ``name``'s launchers (forward for mean/rstd, then backward)."""
    impl = dispatch.get(OP, name).impl
    tables = [inp["tables"][k] for k in TABLES]
    _, mean, rstd = impl.embeddings_fwd(*inp["ids"], *tables, EPS, p, seed, inp["out_dtype"])
    return dict(zip(TABLES, impl.embeddings_bwd(inp["dy"], *inp["ids"], *tables, mean, rstd, p, seed)))


@pytest.fixture
def small_chunks(monkeypatch):
    """Three sorted entries per chunk of CUDA's first table pass, four of Triton's (a power of two)."""
    from bertfast.cuda import embeddings as CE
    from bertfast.kernels import embeddings as EM

    monkeypatch.setattr(CE, "sort_chunk", lambda n: 3)
    monkeypatch.setattr(EM, "_TABLE_CHUNK", 4)


CASES = {  # T, H, vocab, positions, types, table dtype, out dtype, hot word id
    "hot-ids": (24, 64, 9, 7, 2, torch.float32, None, 3),
    "hot-ids-many-chunks": (48, 32, 9, 7, 2, torch.float32, None, 3),  # 24 + entries: 6 + small chunks
    "one-token": (1, 64, 4, 3, 2, torch.float32, None, None),
    "no-tokens": (0, 64, 4, 3, 2, torch.float32, None, None),
    "bf16": (20, 64, 6, 5, 2, torch.bfloat16, None, 1),
    "fp32-tables-bf16-out": (12, 40, 6, 5, 2, torch.float32, torch.bfloat16, 2),
    "two-column-blocks-vec": (10, 1100, 5, 4, 2, torch.float32, None, 0),  # 1100 / 4 > 256 threads
    "two-column-blocks-scalar": (10, 301, 5, 4, 3, torch.float16, None, 0),  # H % 4 != 0: one column each
    "3-types": (16, 64, 6, 5, 3, torch.float32, None, 2),
    "130-types-sorted": (16, 64, 6, 5, 130, torch.float32, None, 2),  # 130 x 64 x 4 B > 32 KiB of partials
}


@pytest.mark.parametrize("backend", ["cuda", "triton"], indirect=True)
@pytest.mark.parametrize("chunk", ["small", "default"])
@pytest.mark.parametrize("case", list(CASES))
def test_table_gradients_match_torch(backend, case, chunk, request):
    t, h, vocab, positions, types, dtype, out_dtype, hot = CASES[case]
    if chunk == "small":
        request.getfixturevalue("small_chunks")
    inp = make(backend.device, t, h, vocab, positions, types, dtype, out_dtype, hot)
    got, want = grads(backend.name, inp), grads("torch", inp)
    for name in TABLES[:3]:
        table = inp["tables"][name]
        assert got[name].dtype == table.dtype and got[name].shape == table.shape, name
        torch.testing.assert_close(got[name].float().cpu(), want[name].float().cpu(), rtol=ROUNDING[table.dtype],
                                   atol=1e-5, msg=lambda m: f"d{name}: {m}")
    for name, n_rows in (("word", vocab), ("pos", positions)):
        assert not got[name][n_rows - 1].any(), f"d{name}: the unused last row is not exactly 0"
    used = torch.zeros(types, dtype=torch.bool)
    used[inp["ids"][2].cpu()] = True
    assert not got["token_type"][~used.to(backend.device)].any(), "dtoken_type: unused rows are not exactly 0"
    if hot is not None and t > 2:
        assert got["word"][hot].float().abs().max() > 1.0  # a sum of many tokens' gradients


def chunked_sum(rows, keys, dh, chunk):
    """The fixed order of the table passes: rows' entries sorted stably by key, cut at multiples of
    chunk; each piece summed in token order from 0, then the pieces in order (fp32 throughout)."""
    order = torch.sort(keys, stable=True).indices
    out = torch.zeros(rows, dh.shape[1])
    pieces = {}
    for pos, i in enumerate(order.tolist()):
        k = int(keys[i])
        piece = pieces.setdefault(k, {}).setdefault(pos // chunk, torch.zeros(dh.shape[1]))
        piece += dh[i]
    for k, by_chunk in pieces.items():
        acc = torch.zeros(dh.shape[1])
        for c in sorted(by_chunk):
            acc += by_chunk[c]
        out[k] = acc
    return out


@pytest.mark.parametrize("backend", ["cuda", "triton"], indirect=True)
def test_table_rows_sum_in_a_fixed_order(backend, small_chunks):
    # dh exactly: with all word rows equal, h (so dh) does not depend on the word ids, and with one token
    # per word row (ids = arange) dword is dh itself. Then repeated and hot ids must give these rows summed
    # in the fixed order, to the bit: no atomics, no other order.
    chunk = 3 if backend.name == "cuda" else 4  # small_chunks
    t, h, vocab = 14, 48, 16
    inp = make(backend.device, t, h, vocab, 5, 2, hot=None, seed=3)
    inp["tables"]["word"] = inp["tables"]["word"][:1].expand(vocab, h).contiguous()
    seed = torch.tensor([9], dtype=torch.int64, device=backend.device)
    inp["ids"][0] = torch.arange(t, device=backend.device)
    dh = grads(backend.name, inp, 0.1, seed)["word"][:t].cpu()
    ids = torch.tensor([5, 5, 1, 5, 0, 5, 5, 9, 1, 5, 5, 12, 5, 5])  # hot 5 spans chunks; 9, 12 inside one
    inp["ids"][0] = ids.to(backend.device)
    got = grads(backend.name, inp, 0.1, seed)
    assert torch.equal(got["word"].cpu(), chunked_sum(vocab, ids, dh, chunk))
    pids = inp["ids"][1].cpu().long()
    # Position keys follow the T word keys in the sorted order: the chunk edges fall at (T + j) // chunk.
    want = chunked_sum(5 + vocab, torch.cat([ids, pids + vocab]), torch.cat([dh, dh]), chunk)[vocab:]
    assert torch.equal(got["pos"].cpu(), want)


@pytest.mark.parametrize("backend", ["cuda"], indirect=True)
@pytest.mark.parametrize("types", [3, 130], ids=["types-shared-memory", "types-sorted"])
def test_results_do_not_depend_on_the_block_schedule(backend, small_chunks, types, monkeypatch):
    # Many tokens of one word, position and type row in different blocks: added with atomics, the order
    # (and the last bits) would follow the schedule.
    inp = make(backend.device, 40, 64, 6, 4, types, hot=2, seed=1)
    seed = torch.tensor([5], dtype=torch.int64, device=backend.device)
    orders = ["", "reverse", "shuffle:1", "shuffle:2"] if backend.emulated else [""] * 4
    runs = []
    for order in orders:
        monkeypatch.setenv("BERTFAST_EMU_BLOCK_ORDER", order)
        runs.append(grads("cuda", inp, 0.1, seed))
    for order, run in zip(orders[1:], runs[1:]):
        for name in TABLES:
            assert torch.equal(run[name], runs[0][name]), f"d{name} differs with block order {order!r}"
