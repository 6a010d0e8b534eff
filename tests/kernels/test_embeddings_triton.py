"""kernels/embeddings.py (gather + sum + LayerNorm + dropout on unpadded tokens) against
bertfast.reference.embeddings.

CPU: the Triton interpreter, fp32 and fp16, small shapes with many repeated ids. GPU-marked:
bf16/fp16 at T=4096 with BERT-sized tables. Oracle: the reference in fp32 (autograd scatters
into the tables) fed the kernel's keep-mask; low precision by the 2x rule.
"""
import pytest
import torch

from bertfast import reference as R
from bertfast.kernels.embeddings import embeddings_bwd, embeddings_fwd
from bertfast.testing import assert_close_lowp

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.gpu_capable  # on CUDA when there is a GPU, else the interpreter
EPS = 1e-12
# fp32: table gradients of repeated ids and dln_* sum many terms of size ~1: rtol on top of atol.
F32 = dict(atol=1e-5, rtol=1e-5)
TABLES = ("word", "pos", "token_type", "ln_weight", "ln_bias")


def make_inputs(t, h, vocab, max_pos, types, dtype, out_dtype=None, id_dtype=torch.int64, gen_seed=0):
    g = torch.Generator().manual_seed(gen_seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)

    return dict(
        ids=torch.randint(0, vocab, (t,), generator=g).to(id_dtype).to(DEV),
        pids=torch.randint(0, max_pos, (t,), generator=g).to(torch.int32).to(DEV),
        tids=torch.randint(0, types, (t,), generator=g).to(id_dtype).to(DEV),
        word=rnd(vocab, h), pos=rnd(max_pos, h, scale=0.5), token_type=rnd(types, h, scale=0.5),
        ln_weight=(1.0 + 0.2 * torch.randn(h, generator=g)).to(dtype).to(DEV), ln_bias=rnd(h, scale=0.2),
        dy=torch.randn(t, h, generator=g).to(out_dtype or dtype).to(DEV),
        out_dtype=out_dtype or dtype)


def reference(inp, p, keep, dtype):
    leaves = {k: inp[k].detach().to(dtype).requires_grad_() for k in TABLES}
    y = R.embeddings(inp["ids"].long(), inp["pids"].long(), inp["tids"].long(), leaves["word"], leaves["pos"],
                     leaves["token_type"], leaves["ln_weight"], leaves["ln_bias"], EPS, p, keep)
    grads = torch.autograd.grad(y, [leaves[k] for k in TABLES], inp["dy"].to(dtype))
    return y.detach(), dict(zip(TABLES, grads))


def run_kernel(inp, p, seed):
    tables = [inp[k] for k in TABLES]
    y, mean, rstd, keep = embeddings_fwd(inp["ids"], inp["pids"], inp["tids"], *tables, EPS, p, seed,
                                         inp["out_dtype"], return_dropout_mask=True)
    grads = embeddings_bwd(inp["dy"], inp["ids"], inp["pids"], inp["tids"], *tables, mean, rstd, p, seed)
    return y, mean, rstd, keep, dict(zip(TABLES, grads))


def check_against_reference(inp, p, seed):
    y, mean, rstd, keep, grads = run_kernel(inp, p, seed)
    assert y.dtype == inp["out_dtype"] and mean.dtype == rstd.dtype == torch.float32
    for name in TABLES:
        assert grads[name].dtype == inp[name].dtype and grads[name].shape == inp[name].shape, name
    y32, g32 = reference(inp, p, keep, torch.float32)
    lowp = inp["out_dtype"] if inp["out_dtype"] != torch.float32 else inp["word"].dtype
    if lowp == torch.float32:
        torch.testing.assert_close(y, y32, **F32)
        for name in TABLES:
            torch.testing.assert_close(grads[name], g32[name], **F32, msg=lambda m: f"d{name}: {m}")
    else:
        ylo, glo = reference(inp, p, keep, lowp)
        assert_close_lowp(y.float(), y32, ylo.float(), name="y")
        for name in TABLES:
            assert_close_lowp(grads[name].float(), g32[name], glo[name].float(), name=f"d{name}")
    return keep


CASES = [  # (T, H, vocab, positions, types, p); T >> vocab means many repeated ids
    (33, 1023, 11, 40, 2, 0.1),
    (7, 64, 5, 8, 2, 0.0),
    (33, 768, 50, 16, 2, 0.1),
    (17, 64, 3, 4, 6, 0.2),    # 6 token types: atomic path for the token-type table
    (1, 64, 3, 4, 1, 0.1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("t,h,vocab,max_pos,types,p", CASES)
def test_matches_reference(t, h, vocab, max_pos, types, p, dtype):
    inp = make_inputs(t, h, vocab, max_pos, types, dtype)
    seed = torch.tensor([321], dtype=torch.int64, device=DEV)
    keep = check_against_reference(inp, p, seed)
    if p == 0.0:
        assert keep.all()


def test_all_tokens_share_one_id_int32():
    inp = make_inputs(33, 64, 4, 4, 2, torch.float32, id_dtype=torch.int32)
    inp["ids"].fill_(2)
    inp["pids"].fill_(1)
    seed = torch.tensor([8], dtype=torch.int64, device=DEV)
    check_against_reference(inp, 0.1, seed)


def test_fp32_tables_with_fp16_output():
    # Autocast-style: fp32 master weights, fp16 activations out and fp16 dy in; table grads in fp32.
    inp = make_inputs(33, 1023, 11, 40, 2, torch.float32, out_dtype=torch.float16)
    seed = torch.tensor([9], dtype=torch.int64, device=DEV)
    y, _, _, keep, grads = run_kernel(inp, 0.1, seed)
    y32, g32 = reference(inp, 0.1, keep, torch.float32)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), y32, atol=2e-3, rtol=1e-3)  # fp16 rounding of the output only
    for name in TABLES:
        assert grads[name].dtype == torch.float32
        torch.testing.assert_close(grads[name], g32[name], **F32, msg=lambda m: f"d{name}: {m}")


def test_dropout_fraction_and_determinism():
    inp = make_inputs(64, 1024, 7, 9, 2, torch.float32)
    tables = [inp[k] for k in TABLES]
    s1 = torch.tensor([11], dtype=torch.int64, device=DEV)
    s2 = torch.tensor([12], dtype=torch.int64, device=DEV)
    y1, _, _, keep1 = embeddings_fwd(inp["ids"], inp["pids"], inp["tids"], *tables, EPS, 0.1, s1,
                                     torch.float32, return_dropout_mask=True)
    assert abs((1.0 - keep1.float().mean().item()) - 0.1) < 0.01
    y1b, _, _, keep1b = embeddings_fwd(inp["ids"], inp["pids"], inp["tids"], *tables, EPS, 0.1, s1,
                                       torch.float32, return_dropout_mask=True)
    assert torch.equal(y1, y1b) and torch.equal(keep1, keep1b)
    assert not y1[~keep1].any()
    _, _, _, keep2 = embeddings_fwd(inp["ids"], inp["pids"], inp["tids"], *tables, EPS, 0.1, s2,
                                    torch.float32, return_dropout_mask=True)
    assert not torch.equal(keep1, keep2)


def test_clear_errors():
    inp = make_inputs(5, 64, 7, 9, 2, torch.float32)
    tables = [inp[k] for k in TABLES]
    args = (inp["ids"], inp["pids"], inp["tids"])
    with pytest.raises(ValueError, match="column stride"):
        wide = torch.randn(7, 128, device=DEV)[:, ::2]
        embeddings_fwd(*args, wide, *tables[1:], EPS, 0.0, None, torch.float32)
    with pytest.raises(ValueError, match="position_ids"):
        embeddings_fwd(inp["ids"], inp["pids"][:3], inp["tids"], *tables, EPS, 0.0, None, torch.float32)
    with pytest.raises(ValueError, match="input_ids"):
        embeddings_fwd(inp["ids"].float(), inp["pids"], inp["tids"], *tables, EPS, 0.0, None, torch.float32)
    with pytest.raises(ValueError, match="pos"):
        embeddings_fwd(*args, tables[0], torch.randn(9, 32, device=DEV), *tables[2:], EPS, 0.0, None,
                       torch.float32)
    with pytest.raises(ValueError, match="seed"):
        embeddings_fwd(*args, *tables, EPS, 0.1, None, torch.float32)
    y, mean, rstd = embeddings_fwd(*args, *tables, EPS, 0.0, None, torch.float32)
    with pytest.raises(ValueError, match="column stride"):
        dy_cols = torch.randn(5, 128, device=DEV)[:, ::2]
        embeddings_bwd(dy_cols, *args, *tables, mean, rstd, 0.0, None)


def test_row_strided_dy():
    inp = make_inputs(9, 64, 7, 9, 2, torch.float32)
    seed = torch.tensor([4], dtype=torch.int64, device=DEV)
    _, _, _, _, grads = run_kernel(inp, 0.1, seed)
    wide = torch.full((9, 128), float("nan"), device=DEV)
    wide[:, :64] = inp["dy"]
    strided = dict(inp, dy=wide[:, :64])
    _, _, _, _, grads_s = run_kernel(strided, 0.1, seed)
    for name in TABLES:
        torch.testing.assert_close(grads_s[name], grads[name], **F32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("h", [768, 1024])
def test_gpu_lowp_matches_fp32_reference(h, dtype):
    seed = torch.tensor([55], dtype=torch.int64, device=DEV)
    check_against_reference(make_inputs(4096, h, 30522, 512, 2, dtype), 0.1, seed)
    check_against_reference(make_inputs(4096, h, 30522, 512, 2, dtype), 0.0, seed)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU every test above takes this path")
def test_autotuned_launch_path_under_interpreter(stand_in_tuner):
    """The backward accumulates into zeroed buffers with atomics: its candidates run on scratch copies
    (each adds into its own garbage), then the chosen one runs once on the real, zeroed buffers; a
    trial on the real buffers would add the gradient several times over."""
    from bertfast.kernels import embeddings as EM

    stand_in_tuner(EM._fwd_tuned, EM._bwd_tuned)
    seed = torch.tensor([13], dtype=torch.int64, device=DEV)
    check_against_reference(make_inputs(37, 100, 7, 9, 2, torch.float32), 0.1, seed)
    check_against_reference(make_inputs(37, 100, 7, 9, 6, torch.float32), 0.0, seed)
    assert len(EM._bwd_tuned.cache) == 2
