// Checks of the hand-issued PTX (ptx.cuh), one warp each: on a GPU they run the hardware's
// instructions, under the CPU emulator its emulated ones, and tests/ops/test_ptx.py compares both
// with plain loops over the PTX ISA's layouts. Operands go in and out through global memory in the
// ISA's own element terms (element i of a fragment, lane l), written out here independently of
// ptx.cuh and emu.h.
#include "attention_host.cuh"
#include "ptx.cuh"
#include "wgmma.cuh"

namespace bertfast {
namespace {

using attn::prepare;

// mma.m16n8k16: d = a b + c, a [16, 16] row-major, b [16 (k), 8 (n)] row-major, c, d [16, 8] fp32.
template <typename T>
__global__ void ptx_check_mma_kernel(const T* a, const T* b, const float* c, float* d) {
  const int lane = threadIdx.x, group = lane >> 2, tig = lane & 3;  // groupID, threadID_in_group
  uint32_t ra[4], rb[2];
  float rd[4];
  for (int i = 0; i < 8; ++i) {  // a_i: row groupID (+8 for a2, a3, a6, a7), col 2 tig + (i & 1) (+8 for i >= 4)
    const int row = group + ((i == 2 || i == 3 || i == 6 || i == 7) ? 8 : 0);
    const int col = 2 * tig + (i & 1) + (i >= 4 ? 8 : 0);
    T x = a[row * 16 + col];
    const uint32_t bits = *reinterpret_cast<const uint16_t*>(&x);
    if (i & 1) ra[i / 2] |= bits << 16; else ra[i / 2] = bits;
  }
  for (int i = 0; i < 4; ++i) {  // b_i: row (k) 2 tig + (i & 1) (+8 for i >= 2), col (n) groupID
    const int k = 2 * tig + (i & 1) + (i >= 2 ? 8 : 0);
    T x = b[k * 8 + group];
    const uint32_t bits = *reinterpret_cast<const uint16_t*>(&x);
    if (i & 1) rb[i / 2] |= bits << 16; else rb[i / 2] = bits;
  }
  for (int i = 0; i < 4; ++i) rd[i] = c[(group + (i >= 2 ? 8 : 0)) * 8 + 2 * tig + (i & 1)];  // c_i, d_i
  ptx::mma_m16n8k16<T>(rd, ra, rb);
  for (int i = 0; i < 4; ++i) d[(group + (i >= 2 ? 8 : 0)) * 8 + 2 * tig + (i & 1)] = rd[i];
}

// ldmatrix: src holds four 8 x 8 matrices of 16-bit elements, matrix m row r at src[(8m + r) * 8];
// they go to shared memory at a row pitch of 16 elements (rows need not be contiguous), lane l
// addresses row l % 8 of matrix l / 8, and out[4 l + i] is its register i.
__global__ void ptx_check_ldmatrix_kernel(const uint16_t* src, uint32_t* out, int variant) {
  constexpr int kPitch = 16;
  __shared__ __align__(16) uint16_t tile[32 * kPitch];
  const int lane = threadIdx.x;
  for (int c = 0; c < 8; ++c) tile[lane * kPitch + c] = src[lane * 8 + c];
  __syncwarp();
  const uint16_t* row = tile + lane * kPitch;
  uint32_t r[4] = {0u, 0u, 0u, 0u};
  if (variant == 0) ptx::ldmatrix_x4(r, row);
  if (variant == 1) ptx::ldmatrix_x4_trans(r, row);
  if (variant == 2 || variant == 3) {
    uint32_t r2[2];
    if (variant == 2) ptx::ldmatrix_x2(r2, row); else ptx::ldmatrix_x2_trans(r2, row);
    r[0] = r2[0];
    r[1] = r2[1];
  }
  for (int i = 0; i < 4; ++i) out[4 * lane + i] = r[i];
}

// cp.async: lane l copies src bytes [16 l, 16 l + 16) to shared memory as group 0, and bytes
// 512 + [16 l, 16 l + 16) as group 1 (odd lanes: zero-filled), each in copies of N bytes (4, 8 or 16);
// out [3, 512]: the lane's group-0 bytes before any wait (unspecified on the hardware), after
// cp.async.wait_group 1, and its group-1 bytes after wait_group 0.
template <int N>
__global__ void ptx_check_cp_async_kernel(const uint8_t* src, uint8_t* out) {
  extern __shared__ __align__(16) unsigned char buf[];
  const int lane = threadIdx.x;
  for (int c = 0; c < 16; c += N) ptx::cp_async<N>(buf + 16 * lane + c, src + 16 * lane + c, true);
  ptx::cp_async_commit();
  for (int c = 0; c < 16; c += N)
    ptx::cp_async<N>(buf + 512 + 16 * lane + c, src + 512 + 16 * lane + c, lane % 2 == 0);
  ptx::cp_async_commit();
  for (int e = 0; e < 16; ++e) out[16 * lane + e] = buf[16 * lane + e];
  ptx::cp_async_wait<1>();
  for (int e = 0; e < 16; ++e) out[512 + 16 * lane + e] = buf[16 * lane + e];
  ptx::cp_async_wait<0>();
  for (int e = 0; e < 16; ++e) out[1024 + 16 * lane + e] = buf[512 + 16 * lane + e];
}

// wgmma m64nNk16, one warpgroup. Operand tiles go to shared memory in the 128-byte swizzle (sw128_offset)
// and the product reads one k-step of each away from the tiles' starts:
//   variant 0, 1: SS, N 64. A = columns 16..31 of a [64, 64] tile (k-step 1), B^T = columns 80..95 of a
//     [64, 128] tile (k-step 5: the second 64-column block, 32 bytes into its rows), both K-major;
//     variant 0 accumulates onto c, variant 1 does not (scale-d 0).
//   variant 2: RS, N 128. A from registers (a [64, 16], row-major: warp w's mma.m16n8k16 A fragment of
//     rows 16 w ..), B = rows 16..31 of a [32, 128] tile (k-step 1), MN-major (transposed), onto c.
// c, d: [64, N] fp32 row-major; d element (16 w + g + 8 (i / 2 % 2), 8 j + 2 t + i % 2) is register
// 4 j + i % 4 of warp w's lane 4 g + t.
template <typename T>
__global__ void __launch_bounds__(128) ptx_check_wgmma_kernel(const T* a, const T* b, const float* c, float* d,
                                                              int variant) {
#if defined(BERTFAST_EMU) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char buf[];
  unsigned char* base = ptx::align1024(buf);
  T* at = reinterpret_cast<T*>(base);         // [64, 64]
  T* bt = reinterpret_cast<T*>(base + 8192);  // [64, 128] or [32, 128]
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, tig = lane & 3;
  const bool rs = variant == 2, trans_a = variant == 3;
  const int brows = rs ? 32 : 64;
  if (!rs) {  // a [m][k]; transposed (variant 3): the tile's rows are k
    for (int i = tid; i < 64 * 64; i += 128)
      at[trans_a ? ptx::sw128_offset<64>(i % 64, i / 64) : ptx::sw128_offset<64>(i / 64, i % 64)] = a[i];
  }
  for (int i = tid; i < brows * 128; i += 128) {
    const int r = i / 128, col = i % 128;
    bt[rs ? ptx::sw128_offset<32>(r, col) : ptx::sw128_offset<64>(r, col)] = b[i];
  }
  ptx::fence_proxy_async();  // the tiles' stores visible to wgmma's reads (the async proxy)
  __syncthreads();
  const uint32_t sa = ptx::smem_addr(at), sb = ptx::smem_addr(bt);
  if (!rs) {
    float acc[8][4];
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 4; ++i) acc[j][i] = c[(16 * w + g + 8 * (i >> 1)) * 64 + 8 * j + 2 * tig + (i & 1)];
    ptx::wgmma_fence();
    const uint64_t db = ptx::wgmma_desc_add(ptx::wgmma_desc_k(sb), ptx::k_major_step<64>(5));
    if (trans_a) {  // A's k-step 1 is the tile's rows 16 .. 31
      ptx::wgmma_ss<T, 64, false, true>(acc, ptx::wgmma_desc_add(ptx::wgmma_desc_mn<64>(sa), ptx::mn_major_step(1)),
                                        db, true);
    } else {
      ptx::wgmma_ss<T, 64, false>(acc, ptx::wgmma_desc_add(ptx::wgmma_desc_k(sa), ptx::k_major_step<64>(1)), db,
                                  variant == 0);
    }
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 4; ++i) d[(16 * w + g + 8 * (i >> 1)) * 64 + 8 * j + 2 * tig + (i & 1)] = acc[j][i];
  } else {
    uint32_t ra[4];
    for (int i = 0; i < 8; ++i) {  // a_i: row groupID (+8 for a2, a3, a6, a7), col 2 tig + (i & 1) (+8 for i >= 4)
      const int row = 16 * w + g + ((i == 2 || i == 3 || i == 6 || i == 7) ? 8 : 0);
      const int col = 2 * tig + (i & 1) + (i >= 4 ? 8 : 0);
      T x = a[row * 16 + col];
      const uint32_t bits = *reinterpret_cast<const uint16_t*>(&x);
      if (i & 1) ra[i / 2] |= bits << 16; else ra[i / 2] = bits;
    }
    float acc[16][4];
    for (int j = 0; j < 16; ++j)
      for (int i = 0; i < 4; ++i) acc[j][i] = c[(16 * w + g + 8 * (i >> 1)) * 128 + 8 * j + 2 * tig + (i & 1)];
    ptx::wgmma_fence();
    ptx::wgmma_rs<T, 128, true>(acc, ra, ptx::wgmma_desc_add(ptx::wgmma_desc_mn<32>(sb), ptx::mn_major_step(1)), true);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    for (int j = 0; j < 16; ++j)
      for (int i = 0; i < 4; ++i) d[(16 * w + g + 8 * (i >> 1)) * 128 + 8 * j + 2 * tig + (i & 1)] = acc[j][i];
  }
#else
  __trap();  // not launched: wgmma_available() is false without the sm_90a build
#endif
}

// mma.sync's rate: every warp runs `iters` rounds of 8 independent m16n8k16 products on all-ones
// operands (so no round waits for the one before), then writes the sum of its accumulators,
// 32 x 8 x 4 x 16 x iters, to out[warp] (the work cannot be optimized away, and a run is checked).
template <typename T>
__global__ void __launch_bounds__(128) ptx_mma_rate_kernel(float* out, int iters) {
  const uint32_t one = ptx::pack2<T>(1.f, 1.f);
  const uint32_t a[4] = {one, one, one, one}, b[2] = {one, one};
  float d[8][4] = {};
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int j = 0; j < 8; ++j) ptx::mma_m16n8k16<T>(d[j], a, b);
  }
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) sum += d[j][0] + d[j][1] + d[j][2] + d[j][3];
  sum = warp_sum(sum);
  if ((threadIdx.x & 31) == 0) out[blockIdx.x * 4 + (threadIdx.x >> 5)] = sum;
}

}  // namespace

int ptx_mma_rate(float* out, int blocks, int iters, int dtype, cudaStream_t stream) {
  clear_error();
  if (blocks < 1 || iters < 1)
    return fail(kErrArgument, "ptx_mma_rate: expected blocks >= 1 and iters >= 1, got %d and %d", blocks, iters);
  if (dtype == kFloat16) {
    ptx_mma_rate_kernel<__half><<<blocks, 128, 0, stream>>>(out, iters);
  } else if (dtype == kBFloat16) {
    ptx_mma_rate_kernel<__nv_bfloat16><<<blocks, 128, 0, stream>>>(out, iters);
  } else {
    return fail(kErrArgument, "ptx_mma_rate: dtype code must be float16 (%d) or bfloat16 (%d), got %d", kFloat16,
                kBFloat16, dtype);
  }
  BF_CHECK_LAUNCH("ptx_mma_rate");
  return kOk;
}

int ptx_check_mma(const void* a, const void* b, const float* c, float* d, int dtype, cudaStream_t stream) {
  clear_error();
  if (dtype == kFloat16) {
    ptx_check_mma_kernel<__half><<<1, 32, 0, stream>>>(static_cast<const __half*>(a), static_cast<const __half*>(b),
                                                       c, d);
  } else if (dtype == kBFloat16) {
    ptx_check_mma_kernel<__nv_bfloat16><<<1, 32, 0, stream>>>(static_cast<const __nv_bfloat16*>(a),
                                                              static_cast<const __nv_bfloat16*>(b), c, d);
  } else {
    return fail(kErrArgument, "ptx_check_mma: dtype code must be float16 (%d) or bfloat16 (%d), got %d", kFloat16,
                kBFloat16, dtype);
  }
  BF_CHECK_LAUNCH("ptx_check_mma");
  return kOk;
}

int ptx_check_ldmatrix(const uint16_t* src, uint32_t* out, int variant, cudaStream_t stream) {
  clear_error();
  if (variant < 0 || variant > 3)
    return fail(kErrArgument,
                "ptx_check_ldmatrix: variant must be 0 (x4), 1 (x4.trans), 2 (x2) or 3 (x2.trans), got %d", variant);
  ptx_check_ldmatrix_kernel<<<1, 32, 0, stream>>>(src, out, variant);
  BF_CHECK_LAUNCH("ptx_check_ldmatrix");
  return kOk;
}

int ptx_check_cp_async(const uint8_t* src, uint8_t* out, int width, cudaStream_t stream) {
  clear_error();
  if (width == 4) {
    ptx_check_cp_async_kernel<4><<<1, 32, 1024, stream>>>(src, out);
  } else if (width == 8) {
    ptx_check_cp_async_kernel<8><<<1, 32, 1024, stream>>>(src, out);
  } else if (width == 16) {
    ptx_check_cp_async_kernel<16><<<1, 32, 1024, stream>>>(src, out);
  } else {
    return fail(kErrArgument, "ptx_check_cp_async: width must be 4, 8 or 16 bytes a copy, got %d", width);
  }
  BF_CHECK_LAUNCH("ptx_check_cp_async");
  return kOk;
}

int ptx_check_wgmma(const void* a, const void* b, const float* c, float* d, int dtype, int variant,
                    cudaStream_t stream) {
  clear_error();
  if (variant < 0 || variant > 3)
    return fail(kErrArgument,
                "ptx_check_wgmma: variant must be 0 (SS), 1 (SS, d = a b), 2 (RS) or 3 (SS, A transposed), got %d",
                variant);
  if (!wgmma_available())
    return fail(kErrUnsupported, "ptx_check_wgmma: wgmma needs an sm_90 GPU and the extension built for sm_90a "
                "(BERTFAST_CUDA_ARCHS with 90a)");
  constexpr int kBytes = 8192 + 16384 + 1024;  // the two tiles, and room to align them to 1024 bytes
  if (dtype == kFloat16) {
    auto kernel = ptx_check_wgmma_kernel<__half>;
    if (int s = prepare(kernel, kBytes, "ptx_check_wgmma")) return s;
    kernel<<<1, 128, kBytes, stream>>>(static_cast<const __half*>(a), static_cast<const __half*>(b), c, d, variant);
  } else if (dtype == kBFloat16) {
    auto kernel = ptx_check_wgmma_kernel<__nv_bfloat16>;
    if (int s = prepare(kernel, kBytes, "ptx_check_wgmma")) return s;
    kernel<<<1, 128, kBytes, stream>>>(static_cast<const __nv_bfloat16*>(a), static_cast<const __nv_bfloat16*>(b),
                                       c, d, variant);
  } else {
    return fail(kErrArgument, "ptx_check_wgmma: dtype code must be float16 (%d) or bfloat16 (%d), got %d", kFloat16,
                kBFloat16, dtype);
  }
  BF_CHECK_LAUNCH("ptx_check_wgmma");
  return kOk;
}

}  // namespace bertfast
