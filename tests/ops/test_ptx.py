"""The PTX the CUDA attention issues by hand (csrc/ptx.cuh, csrc/wgmma.cuh): mma.sync m16n8k16, ldmatrix,
cp.async and wgmma, run by csrc/ptx_check.cu's one-warp (one-warpgroup) kernels and compared with plain
loops over the PTX ISA's layouts.

Without a GPU the kernels run on the CPU emulator (csrc/emu/emu.h), so a wrong fragment layout in
the emulation fails here, on CPU, before any kernel built on it is trusted; with one they run the
hardware's instructions, which checks the layouts written out in ptx_check.cu and below.
"""
import pytest
import torch

GPU = torch.cuda.is_available()
pytestmark = pytest.mark.gpu_capable


@pytest.fixture(scope="module")
def ext(request):
    """bertfast._C on a GPU, its CPU-emulated build otherwise; (module, device)."""
    if GPU:
        from bertfast.cuda import _common

        available, reason = _common.extension_status()
        if not available:
            pytest.skip(reason)
        return _common._C, torch.device("cuda")
    return request.getfixturevalue("cuda_emulator"), torch.device("cpu")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("dtype,code", [(torch.float16, 1), (torch.bfloat16, 2)], ids=["fp16", "bf16"])
def test_mma_m16n8k16_is_a_times_b_plus_c(ext, dtype, code):
    """Small integers: every product and sum is exact in fp32, so any element read from or written to
    the wrong place of a fragment shows as a wrong value."""
    module, dev = ext
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-8, 9, (16, 16), generator=g).to(dtype)
    b = torch.randint(-8, 9, (16, 8), generator=g).to(dtype)
    c = torch.randint(-50, 51, (16, 8), generator=g).float()
    a, b, c = a.to(dev), b.to(dev), c.to(dev)
    d = torch.full((16, 8), float("nan"), device=dev)
    module.ptx_check_mma(a.data_ptr(), b.data_ptr(), c.data_ptr(), d.data_ptr(), code, 0)
    _sync(dev)
    assert torch.equal(d.cpu(), a.cpu().float() @ b.cpu().float() + c.cpu())


def _matrices():
    """Four 8 x 8 matrices of distinct 16-bit values: matrix m, row r, column c is 256 m + 16 r + c."""
    m, r, c = torch.meshgrid(torch.arange(4), torch.arange(8), torch.arange(8), indexing="ij")
    return (256 * m + 16 * r + c).to(torch.int32)


@pytest.mark.parametrize("variant,count,trans", [(0, 4, False), (1, 4, True), (2, 2, False), (3, 2, True)],
                         ids=["x4", "x4.trans", "x2", "x2.trans"])
def test_ldmatrix_gives_each_lane_its_row_pair(ext, variant, count, trans):
    """Lane l's register i holds elements (l / 4, 2 (l % 4)) and (l / 4, 2 (l % 4) + 1) of matrix i, the
    lower column in the low half; .trans: those of the matrix's transpose."""
    module, dev = ext
    mats = _matrices()
    src = mats.reshape(32, 8).to(torch.int16).to(dev)
    out = torch.zeros(32, 4, dtype=torch.int32, device=dev)
    module.ptx_check_ldmatrix(src.data_ptr(), out.data_ptr(), variant, 0)
    _sync(dev)
    got = out.cpu().to(torch.int64) & 0xFFFFFFFF
    for lane in range(32):
        row, col = lane // 4, 2 * (lane % 4)
        for i in range(count):
            m = mats[i].T if trans else mats[i]
            expected = int(m[row, col]) | (int(m[row, col + 1]) << 16)
            assert int(got[lane, i]) == expected, (lane, i)


@pytest.mark.parametrize("width", [4, 8, 16])
def test_cp_async_lands_by_its_group(ext, width):
    """Copies of ``width`` bytes (16: through L2 only; 4 and 8: the .ca form): group 0 has landed after
    cp.async.wait_group 1, group 1 (zero-filled where a lane's source is invalid) after wait_group 0. The
    emulator lands a group only at the wait that requires it, so there a tile read before its wait reads
    the stale bytes (0xFF: its fill of dynamic shared memory), which is how it catches a pipeline that
    reads too early; the hardware may have landed them, so a GPU run does not look at that read."""
    module, dev = ext
    src = torch.randint(0, 255, (1024,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)).to(dev)
    out = torch.zeros(3, 512, dtype=torch.uint8, device=dev)
    module.ptx_check_cp_async(src.data_ptr(), out.data_ptr(), width, 0)
    _sync(dev)
    out, src = out.cpu(), src.cpu()
    assert torch.equal(out[1], src[:512])
    second = src[512:].clone().view(32, 16)
    second[1::2] = 0
    assert torch.equal(out[2], second.view(512))
    if not GPU:
        assert (out[0] == 0xFF).all()


def _wgmma_operands(dtype, variant):
    """Small integers (exact products and sums in fp32): a, b, c and the expected d of ptx_check_wgmma's
    variant, reading the k-steps ptx_check.cu names (A's columns 16..31 and B^T's 80..95 for the SS
    variants, A's from a tile stored transposed for the fourth, B's rows 16..31 for the RS one)."""
    g = torch.Generator().manual_seed(11 + variant)
    ints = lambda *shape: torch.randint(-4, 5, shape, generator=g).to(dtype)  # noqa: E731
    if variant != 2:
        a, b = ints(64, 64), ints(64, 128)
        c = torch.randint(-50, 51, (64, 64), generator=g).float()
        d = a[:, 16:32].float() @ b[:, 80:96].float().T
        return a, b, c, d if variant == 1 else d + c
    a, b = ints(64, 16), ints(32, 128)
    c = torch.randint(-50, 51, (64, 128), generator=g).float()
    return a, b, c, a.float() @ b[16:32].float() + c


@pytest.mark.parametrize("variant", [0, 1, 2, 3], ids=["ss", "ss-no-accumulate", "rs-transposed", "ss-a-transposed"])
@pytest.mark.parametrize("dtype,code", [(torch.float16, 1), (torch.bfloat16, 2)], ids=["fp16", "bf16"])
def test_wgmma_is_a_times_b_through_swizzled_shared_memory(ext, dtype, code, variant):
    """The operand tiles sit in shared memory in the 128-byte swizzle, and each product starts one k-step
    into them (32 bytes into the rows of a second 64-column block for B^T; 16 rows down, across 128
    columns, for the transposed B), so a wrong descriptor offset, swizzle or fragment layout reads other
    elements and shows as a wrong value. The fourth reads A transposed (MN-major), as the one-pass
    backward reads Pd^T and dS^T."""
    module, dev = ext
    if GPU and not module.wgmma_available():
        pytest.skip("wgmma needs an sm_90 GPU and the extension built for sm_90a")
    a, b, c, expected = _wgmma_operands(dtype, variant)
    d = torch.full_like(expected, float("nan"), device=dev)
    a, b, c = a.to(dev), b.to(dev), c.to(dev)
    module.ptx_check_wgmma(a.data_ptr(), b.data_ptr(), c.data_ptr(), d.data_ptr(), code, variant, 0)
    _sync(dev)
    assert torch.equal(d.cpu(), expected)


def test_check_entry_points_reject_bad_codes(ext):
    module, dev = ext
    buf = torch.zeros(512, device=dev)
    with pytest.raises(RuntimeError, match="float16 .* or bfloat16 .*, got 0"):
        module.ptx_check_mma(buf.data_ptr(), buf.data_ptr(), buf.data_ptr(), buf.data_ptr(), 0, 0)
    with pytest.raises(RuntimeError, match="variant must be .* got 7"):
        module.ptx_check_ldmatrix(buf.data_ptr(), buf.data_ptr(), 7, 0)
    with pytest.raises(RuntimeError, match=r"variant must be 0 \(SS\), 1 .* or 3 \(SS, A transposed\), got 4"):
        module.ptx_check_wgmma(buf.data_ptr(), buf.data_ptr(), buf.data_ptr(), buf.data_ptr(), 1, 4, 0)
    with pytest.raises(RuntimeError, match="width must be 4, 8 or 16 bytes a copy, got 2"):
        module.ptx_check_cp_async(buf.data_ptr(), buf.data_ptr(), 2, 0)


def test_mma_rate_kernel_does_the_work_it_times(ext):
    """bertfast.perfmodel.mma_rate's kernel: each warp's sum is 16384 x iters (all-ones operands, 8
    products a round), so a time it gives is of that work; bad sizes are refused."""
    module, dev = ext
    blocks, iters = 2, 3
    out = torch.zeros(blocks * 4, device=dev)
    module.ptx_mma_rate(out.data_ptr(), blocks, iters, 2, 0)
    _sync(dev)
    assert torch.equal(out.cpu(), torch.full((blocks * 4,), 16384.0 * iters))
    with pytest.raises(RuntimeError, match="expected blocks >= 1 and iters >= 1, got 0 and 3"):
        module.ptx_mma_rate(out.data_ptr(), 0, 3, 2, 0)
