"""kernels/_philox.py: the Philox4x32 the Triton attention's dropout mask draws from, against Random123's
known answer, a numpy Philox, and tl.randint4x, word for word.

Without a GPU the kernel runs under the interpreter (the uint64 product); with one, the PTX wide
multiply the compiled kernels use, which is how a GPU run checks it.
"""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from bertfast.kernels._philox import philox4x32

pytestmark = pytest.mark.gpu_capable
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def philox4x32_numpy(counter, key, rounds):
    """Philox4x32-R (Salmon et al., SC'11) on numpy arrays: counter word 0 varies, words 1-3 are 0."""
    c = [counter.astype(np.uint64), *(np.zeros_like(counter, dtype=np.uint64) for _ in range(3))]
    k0, k1 = np.uint64(key & 0xFFFFFFFF), np.uint64(key >> 32)
    mask = np.uint64(0xFFFFFFFF)
    for _ in range(rounds):
        p0, p1 = np.uint64(0xD2511F53) * c[0], np.uint64(0xCD9E8D57) * c[2]
        c = [((p1 >> np.uint64(32)) ^ c[1] ^ k0) & mask, p1 & mask, ((p0 >> np.uint64(32)) ^ c[3] ^ k1) & mask,
             p0 & mask]
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    return c


@triton.jit
def _words_kernel(SEED, OFFSETS, OUT, n, N_ROUNDS: tl.constexpr, TRITONS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    seed = tl.load(SEED)
    offset = tl.load(OFFSETS + i, mask=ok, other=0)
    if TRITONS:
        r0, r1, r2, r3 = tl.randint4x(seed, offset, N_ROUNDS)
    else:
        r0, r1, r2, r3 = philox4x32(seed, offset, N_ROUNDS)
    tl.store(OUT + i, r0.to(tl.int32, bitcast=True), mask=ok)
    tl.store(OUT + n + i, r1.to(tl.int32, bitcast=True), mask=ok)
    tl.store(OUT + 2 * n + i, r2.to(tl.int32, bitcast=True), mask=ok)
    tl.store(OUT + 3 * n + i, r3.to(tl.int32, bitcast=True), mask=ok)


def _words(seed: int, offsets: np.ndarray, rounds: int, tritons: bool = False) -> np.ndarray:
    """[4, n] uint32 words of philox4x32 (or tl.randint4x) at each offset."""
    n, block = len(offsets), 128
    out = torch.empty(4 * n, dtype=torch.int32, device=DEVICE)
    seed_t = torch.tensor([seed], dtype=torch.int64, device=DEVICE)
    # int32, as the kernels' counters: offsets of 2**31 and above wrap to negative ones, the same 32 bits
    offsets_t = torch.from_numpy(offsets.astype(np.int64).astype(np.int32)).to(DEVICE)
    _words_kernel[(triton.cdiv(n, block),)](seed_t, offsets_t, out, n, N_ROUNDS=rounds, TRITONS=tritons, BLOCK=block)
    return out.cpu().numpy().view(np.uint32).reshape(4, n)


def test_random123_known_answer():
    # Philox4x32-10 at counter 0 under key 0 (Random123's kat_vectors; csrc's test_cuda_ext checks the same).
    words = _words(0, np.zeros(1, dtype=np.int64), 10)
    assert [int(w[0]) for w in words] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


@pytest.mark.parametrize("rounds", [7, 10])
@pytest.mark.parametrize("seed", [12345, 2**40 + 77, -3], ids=["seed", "high-word", "negative"])
def test_words_are_philox_and_tritons(rounds, seed):
    """The attention's 7 rounds and the row ops' 10, seeds with a high word and negative ones, counters
    across the 32-bit range (the top bit set too): the numpy Philox and tl.randint4x, word for word."""
    offsets = np.concatenate([np.arange(300), np.array([2**13 * 511 + 7, 2**31 - 1, 2**31, 2**32 - 1])])
    words = _words(seed, offsets, rounds)
    expected = philox4x32_numpy(offsets.astype(np.uint64) % 2**32, seed % 2**64, rounds)
    np.testing.assert_array_equal(words, np.stack(expected).astype(np.uint32))
    np.testing.assert_array_equal(words, _words(seed, offsets, rounds, tritons=True))
