// Fused bidirectional attention with padding masks, FlashAttention-2 style: the math and design
// below, and what the kernels share (parameters, tile loads, warp tile products, tile configurations).
// The kernels live with their launchers, which instantiate them per dtype and head dim: the forward
// in attention_fwd.cuh, the backward's three in attention_bwd.cuh, each compiled once per dtype
// (attention_{fwd,bwd}_<dtype>.cu) behind its entry point (attention_fwd.cu, attention_bwd.cu).
//
// Math, per sequence b and head a, with scale c, queries i and keys j of the sequence
// (padded form: keys with key_padding_mask = 0 are left out; a row with no key gives 0):
//   s_ij = c q_i . k_j,   lse_i = log sum_j exp(s_ij),   p_ij = exp(s_ij - lse_i)
//   o_i  = sum_j (keep_ij / (1 - dp)) p_ij v_j
//   backward, with pd = keep p / (1 - dp) and Delta_i = sum_j p_ij dp_ij (= do_i . o_i):
//     dv_j = sum_i pd_ij do_i
//     dp_ij = keep_ij / (1 - dp) * (do_i . v_j),   ds_ij = p_ij (dp_ij - Delta_i)
//     dq_i = c sum_j ds_ij k_j,   dk_j = c sum_i ds_ij q_i
//   keep_ij: the Triton kernel's mask, drawn from Philox4x32-7 (Dropout below).
//
// Forward, fp16/bf16: attention_fwd_mma_kernel (attention_fwd.cuh): mma.sync m16n8k16 with every
//   fragment in registers, S and P never in shared memory, K and V double-buffered through cp.async
//   (the design is at the kernel); on an sm_90 GPU from the sm_90a build (wgmma_available), at tile head
//   dims 64 and 128 with 16-byte K and V rows, attention_fwd_wgmma_kernel: the same on wgmma.
// Forward, fp32 (one block per BM query rows of one (sequence, head); a row group of 16 query rows per
//   warp, or per WN warps that split O's columns, see Cfg): Q tile stays in shared memory; for each
//   key block: K, V -> smem, S = Q K^T (row group's rows, fp32 in smem), online softmax on its rows
//   (running max m, sum l in registers, log2 domain), P -> smem in the input dtype,
//   O = alpha * O + P V in fp32 accumulators. [S, S] never exists; only [BM, BN] tiles do.
// Dropout's decisions go from the forward to the backward in the keep bits (KeepBits, the Triton
//   kernel's layout); only the forward draws them. The dQ and dK/dV kernels copy each step's block of
//   them into shared memory with its tiles (KeepTile, attention_bwd.cuh).
// Backward: a delta kernel (d_i = do_i . O_i), a dQ kernel (one block per query block, loop over
//   key blocks), then a dK/dV kernel (one block per key block, warps own key rows, loop over query
//   blocks, recomputing P^T from lse). Two kernels instead of atomics: deterministic, no workspace.
//   fp16/bf16: the stored output O is o rounded, so d_i is off by do_i . (o_i - O_i) (~2^-9 |do_i|
//   |o_i| in bf16). That puts -c sum_i p_ij (Delta_i - d_i) q_i into dk_j, summed over every query
//   attending to key j (the key of a one-token padded sequence: all S rows, p = 1, exact ds = 0),
//   and -c (Delta_i - d_i) pk_i into dq_i, pk_i = sum_j p_ij k_j. So the dQ kernel, which sees all
//   keys of its rows, sums r_i = sum_j ds'_ij with ds'_ij = p_ij (dp_ij - d_i) (= Delta_i - d_i as
//   sum_j p_ij = 1; fp32, before ds' is rounded) and pk_i beside sum_j ds'_ij k_j, takes
//   dq_i = c (sum_j ds'_ij k_j - r_i pk_i) and writes Delta_i = d_i + r_i over d_i (its own rows)
//   for the dK/dV kernel. Cost: one more product and accumulator. fp32: d is exact to fp32 rounding.
// Head dims: the template D is the tile head dim, a multiple of 16 (the tiers are in dispatch,
//   attention_host.cuh); the runtime p.head_dim <= D. Columns >= head_dim are zero in shared
//   memory, so Q K^T, P V, dO V^T, ... are those of the real columns, and are never read from or
//   written to global memory.
// Backward, fp16/bf16: dQ and dK/dV are attention_bwd_dq_mma_kernel and attention_bwd_dkdv_mma_kernel
//   (attention_bwd.cuh: mma.sync, as the forward); at tile head dim 256, where their two accumulators of
//   D / 2 registers a lane do not fit one warp's 16 rows, two blocks per row block each compute half
//   the columns (Cfg::kMmaColumns), each recomputing S and dP over the whole head.
//   On an sm_90 GPU from the sm_90a build (wgmma_available), at tile head dims 64 and 128 with
//   16-byte rows, attention_bwd_dq_wgmma_kernel and attention_bwd_dkdv_wgmma_kernel take their
//   place: the same algorithm with the warpgroup's products (wgmma.cuh). There, at tile head dim 64 with
//   every sequence at most kFusedBwdMaxSeqlen (128) tokens, attention_bwd_fused_wgmma_kernel does the whole
//   backward in one pass instead (one block a sequence and head: whole rows of scores, so Delta is their
//   sum and there is no delta kernel or refinement; Q, K, V and dO read once, not twice).
// fp32: the FMA kernels (attention_fwd_kernel, attention_bwd_dq_kernel, attention_bwd_dkdv_kernel), their
//   S, P and dS through shared memory, products on the CUDA cores (warp_gemm_nt, WarpAcc).
// Global rows move as 16-byte vectors where a tensor's pointer, strides and row width allow it
//   (decided per tensor by the launcher: Params::vec), else element by element.
// Limits: 8 <= head_dim <= 256; batch <= 65535; heads <= 65535.
#pragma once
#include <type_traits>

#include "common.cuh"
#include "ptx.cuh"
#include "wgmma.cuh"

namespace bertfast {
namespace attn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <typename T>
constexpr bool k16Bit = !std::is_same<T, float>::value;  // fp16/bf16: the tensor-core kernels
template <typename T>
constexpr int kPadT = 16 / sizeof(T);  // smem row padding of T tiles: 16 bytes
constexpr int kPadF = 4;               // smem row padding of fp32 tiles: 16 bytes

__host__ __device__ constexpr int align128(long long x) { return static_cast<int>((x + 127) / 128 * 128); }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }

// A launch's parameters plus what the launcher derives from them.
enum : unsigned { kVecQ = 1, kVecK = 2, kVecV = 4, kVecO = 8, kVecDO = 16, kVecDQ = 32, kVecDK = 64, kVecDV = 128 };
struct Params : AttentionParams {
  unsigned vec;        // kVec* bits: that tensor's rows allow 16-byte accesses
  uint32_t threshold;  // dropout keeps a 16-bit draw >= threshold (keep_threshold)
};

struct Seq {
  int64_t start;
  int len;
};
__device__ __forceinline__ Seq seq_of(const AttentionParams& p, int b) {
  if (p.cu_seqlens == nullptr) return {0, p.max_seqlen};
  const int s = p.cu_seqlens[b];
  int len = p.cu_seqlens[b + 1] - s;
  len = len < 0 ? 0 : (len > p.max_seqlen ? p.max_seqlen : len);
  return {s, len};
}

// A smem tile's layout: its row pitch LD (elements), or kSwizzle128, wgmma's 128-byte swizzle (wgmma.cuh)
// for the wgmma kernels' operands. tile_at: where element (r, c) of a [ROWS, D] tile lies.
constexpr int kSwizzle128 = 0;
template <int ROWS, int LD>
__device__ __forceinline__ int tile_at(int r, int c) {
  if constexpr (LD == kSwizzle128) {
    return ptx::sw128_offset<ROWS>(r, c);
  } else {
    return r * LD + c;
  }
}
template <int ROWS, int D, int LD>
__host__ __device__ constexpr int tile_elems() {
  return ROWS * (LD == kSwizzle128 ? D : LD);
}

// Rows [0, ROWS) of a [*, hd] tile into smem as [ROWS, D] (layout LD); rows >= nvalid (so
// that masked products stay finite) and columns >= hd are zero. 16-byte accesses when `vec`
// (then hd is a whole number of vectors), else one element at a time.
template <typename T, int ROWS, int D, int LD, int NT>
__device__ __forceinline__ void load_tile(T* __restrict__ dst, const T* __restrict__ src, int64_t row_stride,
                                          int nvalid, int hd, bool vec) {
  if (vec) {
    constexpr int EPV = 16 / sizeof(T);
    constexpr int VPR = D / EPV;
    for (int idx = threadIdx.x; idx < ROWS * VPR; idx += NT) {
      const int r = idx / VPR, c = (idx % VPR) * EPV;
      uint4 val = make_uint4(0u, 0u, 0u, 0u);
      if (r < nvalid && c < hd) val = *reinterpret_cast<const uint4*>(src + r * row_stride + c);
      *reinterpret_cast<uint4*>(dst + tile_at<ROWS, LD>(r, c)) = val;
    }
  } else {
    // Kept rolled: unrolled, its loads in flight take registers the accumulators need (spills, sm_90).
#pragma unroll 1
    for (int idx = threadIdx.x; idx < ROWS * D; idx += NT) {
      const int r = idx / D, c = idx % D;
      dst[tile_at<ROWS, LD>(r, c)] = r < nvalid && c < hd ? src[r * row_stride + c] : from_f<T>(0.f);
    }
  }
}

// load_tile's element-by-element path, out of line: a tensor without 16-byte rows (an odd head dim
// in packed qkv) is rare, and inlined its loop would sit in the main loop of every launch.
template <typename T, int ROWS, int D, int LD, int NT>
__device__ __noinline__ void load_tile_elementwise(T* dst, const T* src, int64_t row_stride, int nvalid, int hd) {
  load_tile<T, ROWS, D, LD, NT>(dst, src, row_stride, nvalid, hd, false);
}

// This thread's share of copying [ROWS, *] tiles into smem as [ROWS, D] (layout LD), zero beyond
// nvalid rows and hd columns: 16-byte cp.async copies (they join the thread's open group) when the
// tensor's rows allow them (kVec), else load_tile_elementwise (complete on return). Where NT is a
// multiple of the vectors per row, a thread's vectors are one column, RS rows apart: its first
// row's offsets and the stride of RS rows are computed once.
template <typename T, int ROWS, int D, int LD, int NT, bool kVec>
struct TileCopy {
  static constexpr int EPV = 16 / sizeof(T), VPR = D / EPV, N = (ROWS * VPR + NT - 1) / NT;
  static constexpr bool kStrided = NT % VPR == 0;
  static constexpr int RS = kStrided ? NT / VPR : 0;
  int r0, c0, hd;
  bool col_ok;
  int64_t row_stride, rs_stride;
  __device__ __forceinline__ TileCopy(int hd_, int64_t row_stride_)
      : r0(threadIdx.x / VPR), c0(threadIdx.x % VPR * EPV), hd(hd_), col_ok(c0 < hd_), row_stride(row_stride_),
        rs_stride(RS * row_stride_) {}
  // Rows [0, nvalid) of the tile whose first row is src.
  __device__ __forceinline__ void issue(T* dst, const T* src, int nvalid) const {
    if constexpr (!kVec) {
      load_tile_elementwise<T, ROWS, D, LD, NT>(dst, src, row_stride, nvalid, hd);
    } else if constexpr (kStrided) {
      const T* from = src + r0 * row_stride + c0;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        if ((ROWS * VPR) % NT == 0 || r0 + i * RS < ROWS)
          ptx::cp_async<16>(dst + tile_at<ROWS, LD>(r0 + i * RS, c0), from + i * rs_stride,
                           col_ok && r0 + i * RS < nvalid);
      }
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int idx = threadIdx.x + i * NT;
        const int r = idx / VPR, c = idx % VPR * EPV;
        if ((ROWS * VPR) % NT == 0 || idx < ROWS * VPR)
          ptx::cp_async<16>(dst + tile_at<ROWS, LD>(r, c), src + r * row_stride + c, c < hd && r < nvalid);
      }
    }
  }
};

// A tile a block copies once (not in its main loop): TileCopy with the copy path chosen at run time.
template <typename T, int ROWS, int D, int LD, int NT>
__device__ __forceinline__ void copy_tile(T* dst, const T* src, int64_t row_stride, int nvalid, int hd, bool vec) {
  if (vec) {
    TileCopy<T, ROWS, D, LD, NT, true>(hd, row_stride).issue(dst, src, nvalid);
  } else {
    TileCopy<T, ROWS, D, LD, NT, false>(hd, row_stride).issue(dst, src, nvalid);
  }
}

// ------------------------------------------------------------------ mma.sync tile products (ptx.cuh)
// x = A_x B_x^T and y = A_y B_y^T for a warp's 16 rows and NS n8 tiles of columns over KS k-steps of 16:
// the two products of a backward step (S and dP; S^T and dP^T). A's fragments come from registers
// (xr, yr, when kARegs) or through ldmatrix at xa, ya (the lane's row addresses) + 16 ks; B's rows,
// row-major [columns, 16 KS] at pitch LD, through ldmatrix at xb, yb (the lane's offsets) + 16 ks.
template <typename T, int KS, int NS, int LD, bool kARegs, int KR>
__device__ __forceinline__ void mma_pair_nt(float (&x)[NS][4], float (&y)[NS][4], const uint32_t (&xr)[KR][4],
                                            const uint32_t (&yr)[KR][4], const T* xa, const T* ya, const T* xb,
                                            const T* yb) {
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    uint32_t a[4], c[4];
    if constexpr (kARegs) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a[i] = xr[ks][i];
        c[i] = yr[ks][i];
      }
    } else {
      ptx::ldmatrix_x4(a, xa + 16 * ks);
      ptx::ldmatrix_x4(c, ya + 16 * ks);
    }
#pragma unroll
    for (int n2 = 0; n2 < NS / 2; ++n2) {  // columns 16 n2 .. 16 n2 + 15: two n8 tiles
      uint32_t xf[4], yf[4];
      ptx::ldmatrix_x4(xf, xb + 16 * n2 * LD + 16 * ks);
      ptx::ldmatrix_x4(yf, yb + 16 * n2 * LD + 16 * ks);
      const uint32_t x0[2] = {xf[0], xf[1]}, x1[2] = {xf[2], xf[3]};
      const uint32_t y0[2] = {yf[0], yf[1]}, y1[2] = {yf[2], yf[3]};
      if (ks == 0) {
        ptx::mma_m16n8k16_zero<T>(x[2 * n2], a, x0);
        ptx::mma_m16n8k16_zero<T>(x[2 * n2 + 1], a, x1);
        ptx::mma_m16n8k16_zero<T>(y[2 * n2], c, y0);
        ptx::mma_m16n8k16_zero<T>(y[2 * n2 + 1], c, y1);
      } else {
        ptx::mma_m16n8k16<T>(x[2 * n2], a, x0);
        ptx::mma_m16n8k16<T>(x[2 * n2 + 1], a, x1);
        ptx::mma_m16n8k16<T>(y[2 * n2], c, y0);
        ptx::mma_m16n8k16<T>(y[2 * n2 + 1], c, y1);
      }
    }
  }
}

// Two n8 accumulator tiles side by side (16 columns) as the A fragment of an m16n8k16 product, rounded
// to T: one product's output is the next one's input without leaving registers.
template <typename T>
__device__ __forceinline__ void accumulators_as_a(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = ptx::pack2<T>(lo[0], lo[1]);
  a[1] = ptx::pack2<T>(lo[2], lo[3]);
  a[2] = ptx::pack2<T>(hi[0], hi[1]);
  a[3] = ptx::pack2<T>(hi[2], hi[3]);
}

// ------------------------------------------------------------------ wgmma tile products (wgmma.cuh)
// A product's k-steps, issued into the caller's group (its fence, commit and wait are the caller's), for
// the warpgroup's 64 rows and N columns. x (+)= A B^T over KS k-steps, A's tile (MA rows) and B's (N rows)
// K-major at the descriptors given (their k-step 0), B's `at` bytes into its (the stage); the first
// k-step overwrites x.
template <typename T, int KS, int MA, int N>
__device__ __forceinline__ void wgmma_issue_nt(float (&x)[N / 8][4], uint64_t a, uint64_t b, uint32_t at) {
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    ptx::wgmma_ss<T, N, false>(x, ptx::wgmma_desc_add(a, ptx::k_major_step<MA>(ks)),
                               ptx::wgmma_desc_add(b, at + ptx::k_major_step<N>(ks)), ks > 0);
  }
}
// x (+)= A B over KK k-steps of 16, A's fragments in registers (af), B's tile MN-major (read transposed)
// `at` bytes into its; accumulate false: the first k-step overwrites x.
template <typename T, int KK, int N>
__device__ __forceinline__ void wgmma_issue_rs(float (&x)[N / 8][4], const uint32_t (&af)[KK][4], uint64_t b,
                                               uint32_t at, bool accumulate) {
#pragma unroll
  for (int kk = 0; kk < KK; ++kk)
    ptx::wgmma_rs<T, N, true>(x, af[kk], ptx::wgmma_desc_add(b, at + ptx::mn_major_step(kk)), accumulate || kk > 0);
}

// The two wgmma products of a backward step, for the warpgroup's 64 rows and N columns: x = A_x B_x^T
// and y = A_y B_y^T over KS k-steps (S and dP; S^T and dP^T), A's tiles (MA rows) and B's (N rows)
// K-major at the descriptors given (their k-step 0), B's `at` bytes into theirs (the stage); returns
// when both are done.
template <typename T, int KS, int MA, int N>
__device__ __forceinline__ void wgmma_pair_nt(float (&x)[N / 8][4], float (&y)[N / 8][4], uint64_t xa, uint64_t ya,
                                              uint64_t xb, uint64_t yb, uint32_t at) {
  ptx::wgmma_fence();
  wgmma_issue_nt<T, KS, MA, N>(x, xa, xb, at);
  wgmma_issue_nt<T, KS, MA, N>(y, ya, yb, at);
  ptx::wgmma_commit();
  ptx::wgmma_wait<0>();
}

// ... and its last two: x += X B_x and y += Y B_y, X and Y the first products' accumulators (rounded to
// T: A operands from registers, 16 columns a k-step), B's tiles MN-major (read transposed) `at` bytes
// into theirs; returns when both are done (the A registers and B's stage are free again).
template <typename T, int NS, int N>
__device__ __forceinline__ void wgmma_pair_rs(float (&x)[N / 8][4], float (&y)[N / 8][4], const float (&xs)[NS][4],
                                              const float (&ys)[NS][4], uint64_t xb, uint64_t yb, uint32_t at) {
  uint32_t xf[NS / 2][4], yf[NS / 2][4];
#pragma unroll
  for (int kk = 0; kk < NS / 2; ++kk) {
    accumulators_as_a<T>(xf[kk], xs[2 * kk], xs[2 * kk + 1]);
    accumulators_as_a<T>(yf[kk], ys[2 * kk], ys[2 * kk + 1]);
  }
  ptx::wgmma_fence();
  wgmma_issue_rs<T, NS / 2, N>(x, xf, xb, at, true);
  wgmma_issue_rs<T, NS / 2, N>(y, yf, yb, at, true);
  ptx::wgmma_commit();
  ptx::wgmma_wait<0>();
}

// Barrier over the warps that share a row group's smem rows: the warp, or the block when WN > 1
// warps split the row group's columns.
template <int WN>
__device__ __forceinline__ void sync_row_group() {
  if constexpr (WN > 1) {
    __syncthreads();
  } else {
    __syncwarp();
  }
}

// ------------------------------------------------------------------ warp tile products
// C[16, N] (fp32, smem, row pitch ldc) = A[16, K] B^T, A row-major (lda), B row-major [N, K] (ldb), on the
// CUDA cores (the fp32 kernels).
template <typename T, int N, int K>
__device__ __forceinline__ void warp_gemm_nt(const T* A, int lda, const T* B, int ldb, float* C, int ldc) {
  const int lane = threadIdx.x & 31;
  for (int idx = lane; idx < 16 * N; idx += 32) {
    const int r = idx / N, c = idx % N;
    float s = 0.f;
#pragma unroll 8
    for (int k = 0; k < K; ++k) s += to_f(A[r * lda + k]) * to_f(B[c * ldb + k]);
    C[r * ldc + c] = s;
  }
}

// A warp's fp32 accumulator tile [16, N] on the CUDA cores (the fp32 kernels): acc += A[16, K] B[K, N], A
// and B row-major in smem; lane owns row lane / 2 and columns (lane % 2) + 2 i.
template <typename T, int N>
struct WarpAcc {
  float v[N / 2];
  int r, c0;
  __device__ __forceinline__ void init() {
    const int lane = threadIdx.x & 31;
    r = lane >> 1;
    c0 = lane & 1;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) v[i] = 0.f;
  }
  __device__ __forceinline__ void scale_rows(const float* s) {
    const float f = s[r];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) v[i] *= f;
  }
  __device__ __forceinline__ void scale(float s) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) v[i] *= s;
  }
  template <int K>
  __device__ __forceinline__ void mma(const T* A, int lda, const T* B, int ldb) {
    for (int k = 0; k < K; ++k) {
      const float a = to_f(A[r * lda + k]);
#pragma unroll
      for (int i = 0; i < N / 2; ++i) v[i] += a * to_f(B[k * ldb + c0 + 2 * i]);
    }
  }
  __device__ __forceinline__ void store(float* C, int ldc) const {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) C[r * ldc + c0 + 2 * i] = v[i];
  }
};

// A staged fp32 row of a warp's W columns times `mul` -> global row dst, its first n columns
// only (the real ones; n may exceed W or be <= 0). Lane pair (2r, 2r+1) writes it: the two halves
// as 16-byte vectors when `vec` (then n is a whole number of vectors), else alternate elements.
template <typename T, int W>
__device__ __forceinline__ void write_row(T* dst, const float* staged, int n, int half, float mul, bool vec) {
  if (vec) {
    constexpr int EPV = 16 / sizeof(T);
    constexpr int HALF = W / 2;
#pragma unroll
    for (int c = half * HALF; c < (half + 1) * HALF; c += EPV) {
      if (c < n) {
        float t[EPV];
#pragma unroll
        for (int e = 0; e < EPV; ++e) t[e] = staged[c + e] * mul;
        store_f<T, EPV>(dst + c, t);
      }
    }
  } else {
    for (int c = half; c < W && c < n; c += 2) dst[c] = from_f<T>(staged[c] * mul);
  }
}

// Elements c, c + 1 (c even) of a row of 16-bit T as x, y, columns >= hd left alone: one 4-byte store
// when the row allows 16-byte accesses (vec: hd is a whole number of vectors, so the pair is in or out
// together), else element by element.
template <typename T>
__device__ __forceinline__ void store_pair(T* row, int c, int hd, float x, float y, bool vec) {
  if (vec) {
    if (c < hd) *reinterpret_cast<uint32_t*>(row + c) = ptx::pack2<T>(x, y);
  } else {
    if (c < hd) row[c] = from_f<T>(x);
    if (c + 1 < hd) row[c + 1] = from_f<T>(y);
  }
}

// A warp's accumulator rows row0 and row0 + 8 of a sequence (mma's C layout: d[n][i] is column c0 + 8n + 2t
// + i % 2 of row row0 + 8 (i / 2), t = lane % 4), times `mul`, into rows of a [tokens, hd] gradient (dQ, dK
// or dV of head h); rows past the sequence's end are skipped. c0: a multiple of 16-byte vectors.
template <typename T, int NO>
__device__ __forceinline__ void store_rows(void* out, const Strides& s, int b, int h, const Seq& sq, int row0,
                                           const float (&d)[NO][4], float mul, int hd, bool vec, int c0 = 0) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = row0 + 8 * r;
    if (i >= sq.len) continue;
    T* row = static_cast<T*>(out) + b * s.batch + (sq.start + i) * s.row + h * s.head + c0;
#pragma unroll
    for (int n = 0; n < NO; ++n)
      store_pair<T>(row, 8 * n + 2 * t, hd - c0, d[n][2 * r] * mul, d[n][2 * r + 1] * mul, vec);
  }
}

__device__ __forceinline__ bool key_valid(const AttentionParams& p, int b, int j, int len) {
  return j < len && (p.key_mask == nullptr || p.key_mask[b * p.key_mask_batch + j] != 0);
}

// K and V of one (sequence, head) streamed through two smem stages (layout LD), BN keys at a time (the
// main loop of the mma.sync forward, and of the mma.sync and wgmma dQ): load(jb) issues key block jb's
// copies into stage jb % 2 (TileCopy); mask(jb) stores its key mask (kvalid), which only blocks with an
// invalid key need: every block when there is a key mask, else those after the first nfull. A masked
// block stores its own before its first barrier (its stage's mask was last read two blocks before), so
// the loop over the full blocks carries no mask code at all.
template <typename T, int BN, int D, int LD, int NT, bool kVec>
struct KvStages {
  TileCopy<T, BN, D, LD, NT, kVec> kcopy, vcopy;
  const T* k;  // the sequence's first K row of this head
  const T* v;
  int len, nblocks, nfull;
  __device__ __forceinline__ KvStages(const AttentionParams& p, int b, int h, const Seq& sq)
      : kcopy(p.head_dim, p.sk.row), vcopy(p.head_dim, p.sv.row),
        k(static_cast<const T*>(p.k) + b * p.sk.batch + sq.start * p.sk.row + h * p.sk.head),
        v(static_cast<const T*>(p.v) + b * p.sv.batch + sq.start * p.sv.row + h * p.sv.head), len(sq.len),
        nblocks((sq.len + BN - 1) / BN), nfull(p.key_mask == nullptr ? sq.len / BN : 0) {}
  __device__ __forceinline__ void load(const AttentionParams& p, int jb, T* Ks, T* Vs) const {
    const int n0 = jb * BN, stage = jb & 1;
    kcopy.issue(Ks + stage * tile_elems<BN, D, LD>(), k + n0 * p.sk.row, len - n0);
    vcopy.issue(Vs + stage * tile_elems<BN, D, LD>(), v + n0 * p.sv.row, len - n0);
  }
  __device__ __forceinline__ void mask(const AttentionParams& p, int b, int jb, int* kvalid) const {
    if (threadIdx.x < BN) kvalid[(jb & 1) * BN + threadIdx.x] = key_valid(p, b, jb * BN + threadIdx.x, len);
  }
};

// ------------------------------------------------------------------ dropout
// The Triton kernel's mask (kernels/attention.py, "Dropout"), bit for bit: Philox4x32-7 under the key
// seed + (b * A + a) 2^32 (the seed in the low word, the stream of sequence b, head a in the high
// one), at counter (i 2^13 + g, 0, 0, 0) for group g of query row i of the sequence. Group
// g = 4m + q holds columns 32m + 8w + 2q + e (w < 4, e < 2): decision 2w + e is half e of word w,
// kept when its 16 bits are >= ceil(p 2^16). A thread of an mma m16n8 score tile holds column pairs
// 8 apart, so one draw serves 8 of its elements. The threshold comes from the launch's parameters
// (Params::threshold), which the kernels read in place, as they read dropout_p: a register less.
__host__ __device__ inline uint32_t keep_threshold(float dp) { return static_cast<uint32_t>(ceilf(dp * 65536.f)); }
struct Dropout {
  uint32_t k0, k1;
  // stream = b * A + a; the seed is only read when dp > 0 (else the key is 0: no draw is made then).
  __device__ __forceinline__ Dropout(float dp, const int64_t* seed, uint32_t stream) : k0(0), k1(0) {
    if (dp > 0.f) {
      const uint64_t s = static_cast<uint64_t>(*seed);
      k0 = static_cast<uint32_t>(s);
      k1 = static_cast<uint32_t>(s >> 32) + stream;
    }
  }
  __device__ __forceinline__ Dropout(const AttentionParams& p, int b, int h)
      : Dropout(p.dropout_p, p.seed, static_cast<uint32_t>(b * p.heads + h)) {}
  // Group g's 4 Philox words for row i: decision 2w + e is half e of word w >= threshold.
  __device__ __forceinline__ U4 group_words(int i, int g) const {
    return philox4x32<7>(U4{static_cast<uint32_t>(i) * 8192u + static_cast<uint32_t>(g), 0u, 0u, 0u}, k0, k1);
  }
  // A word's two decisions: bit e is half e.
  static __device__ __forceinline__ unsigned kept_halves(uint32_t word, uint32_t threshold) {
    return static_cast<unsigned>((word & 0xFFFFu) >= threshold) | static_cast<unsigned>((word >> 16) >= threshold) << 1;
  }
  // Group g's 8 decisions for row i: bit 2w + e.
  __device__ __forceinline__ unsigned group_bits(int i, int g, uint32_t threshold) const {
    const U4 r = group_words(i, g);
    return kept_halves(r.x, threshold) | kept_halves(r.y, threshold) << 2 | kept_halves(r.z, threshold) << 4 |
           kept_halves(r.w, threshold) << 6;
  }
};

// Dropout's decisions as the forward records them for the backward (Params::keep, the Triton kernel's
// layout): element (16R + 8h + r, 16C + 8w + 2q + e) of (b, a)'s [L, L] scores is bit 4h + 2w + e of
// byte (8R + r, 4C + q) of its [L / 2, L / 4] block (L = keep_len). A lane (g, t) of an mma score
// tile holds one byte's 8 elements: rows g and g + 8, columns 2t and 2t + 1 of two n8 tiles.
struct KeepBits {
  uint8_t* base;  // (b, a)'s block
  int cols;       // bytes a row, L / 4 (a block's offsets fit 32 bits: L <= 2^16 keys, the Philox counter's limit)
  __device__ __forceinline__ KeepBits(const AttentionParams& p, int b, int h)
      : base(p.keep + (static_cast<int64_t>(b) * p.heads + h) * (p.keep_len / 2) * (p.keep_len / 4)),
        cols(static_cast<int>(p.keep_len / 4)) {}
  // The byte of 16-row block R, row r, 16-column block C, column pair q.
  __device__ __forceinline__ uint8_t* byte(int R, int r, int C, int q) const {
    return base + (8 * R + r) * cols + 4 * C + q;
  }
  __device__ __forceinline__ bool kept(int i, int j) const {
    return (*byte(i >> 4, i & 7, j >> 4, (j & 7) >> 1) >> (4 * ((i >> 3) & 1) + 2 * ((j >> 3) & 1) + (j & 1))) & 1;
  }
};

// Lane pair `half`'s share of a row of a [rows, W] score tile whose first column is c0 (absolute,
// c0 % W == 0 below 32 columns): the groups with q % 2 == half, kDraws draws of kCols columns each.
// Draw d is group(d); its k-th column (k = 2 w' + e) is col(d, k) of the tile, decision bit(k).
template <int W>
struct Draws {
  static_assert(W == 8 || W % 16 == 0, "a tile of 8 columns or of whole 16-column tiles");
  static constexpr int kWords = W >= 32 ? 4 : W / 8;  // words of a group inside the tile
  static constexpr int kDraws = W / (4 * kWords);
  static constexpr int kCols = 2 * kWords;
  int group0, half, wb;
  __device__ __forceinline__ Draws(int c0, int half_)
      : group0((c0 >> 5) * 4), half(half_), wb((c0 >> 3) & (4 - kWords)) {}
  __device__ __forceinline__ int group(int d) const { return group0 + 4 * (d >> 1) + half + 2 * (d & 1); }
  __device__ __forceinline__ int col(int d, int k) const {
    return 32 * (d >> 1) + 8 * (k >> 1) + 2 * (half + 2 * (d & 1)) + (k & 1);
  }
  __device__ __forceinline__ int bit(int k) const { return 2 * wb + k; }
};

// ------------------------------------------------------------------ tile configurations
// Block tiles per (dtype, tile head dim): shared memory under 99 KiB where a kernel runs on every GPU
// (sm_86/sm_89 allow a block 99 KiB, sm_80 opts in to 163 KiB, sm_90 to 227 KiB) and no register
// spills on sm_90 (ptxas -v; BN 64 spills at D 128). The fp16/bf16 kernels are the mma.sync ones
// (kMmaFwdBN, kMmaDqBN, kMmaKvBM, kMmaWarps, kMmaColumns; their Smem structs: at D 256 the backward's
// take 66 KiB), on sm_90 the wgmma ones at D 64 and 128 (kWgmmaDqBN, kWgmmaKvBM); the rest serve fp32
// (the FMA kernels): *WN warps split the columns of a row group's accumulators (and of its S tile), 2
// at D 256, where one warp would hold 128 accumulator registers per lane for O or dQ, 256 for dK and
// dV; shared memory at D 256 (forward, dQ, dK/dV) 70, 69 and 70 KiB.
// The backward runs in one pass (attention_bwd_fused_wgmma_kernel) where the longest sequence has at most
// this many tokens, at tile head dim 64, on wgmma.
constexpr int kFusedBwdMaxSeqlen = 128;

template <typename T, int D>
struct Cfg {
  static constexpr bool kBig = D > 128;
  // forward, fp32 (the FMA kernel; fp16/bf16 run the mma.sync one): BM query rows per block, BN keys per step
  static constexpr int kFwdBM = kBig ? 32 : 64;
  static constexpr int kFwdBN = D <= 64 ? 64 : (kBig ? 16 : 32);
  static constexpr int kFwdWN = kBig ? 2 : 1;
  // forward, fp16/bf16 (mma.sync): 64 query rows per block, BN keys per step (its S tile is BN / 2
  // registers a lane, its O accumulator D / 2)
  static constexpr int kMmaFwdBN = D <= 128 ? 64 : 32;
  // The backward's mma.sync kernels: kMmaWarps warps of 16 rows a block (keys for dK/dV, queries for dQ),
  // 2 at D 256 (and a step of 16), where their [rows, D] and [2][step, D] tiles must fit the 99 KiB that
  // sm_86/sm_89 GPUs allow a block
  static constexpr int kMmaWarps = kBig ? 2 : 4;
  // dK, dV, fp16/bf16 (mma.sync): BM queries per step
  static constexpr int kMmaKvBM = D <= 64 ? 64 : (kBig ? 16 : 32);
  // dQ, fp16/bf16 (mma.sync): BN keys per step (two accumulators, dQ and pk, kMmaColumns / 2 registers a
  // lane each; S and dP BN / 2 each)
  static constexpr int kMmaDqBN = D <= 64 ? 64 : (kBig ? 16 : 32);
  // ... when K's or V's rows are copied element by element: at D 128 the copy's call takes the registers
  // of half the S and dP tiles (BN 32 spilled)
  static constexpr int kMmaDqBNElementwise = D <= 96 ? kMmaDqBN : 16;
  // dQ's, dK's and dV's columns a mma.sync block computes: at D 256 two blocks each (their two accumulators
  // of D / 2 registers a lane do not fit one warp), each with S and dP over the whole head
  static constexpr int kMmaColumns = D > 128 ? 128 : D;
  // dQ, fp16/bf16 on wgmma (head dims 64 and 128): 64 queries per block, BN keys per step (wgmma's N;
  // registers as the mma.sync kernel's)
  static constexpr int kWgmmaDqBN = D <= 64 ? 64 : 32;
  // dK, dV, fp16/bf16 on wgmma (head dims 64 and 128): 64 keys per block, BM queries per step
  static constexpr int kWgmmaKvBM = D <= 64 ? 64 : 32;
  // dQ, fp32 (the FMA kernel): BM query rows per block, BN keys per step
  static constexpr int kDqBM = kBig ? 16 : (D > 64 ? 32 : 64);
  static constexpr int kDqBN = kBig ? 16 : 32;
  static constexpr int kDqWN = kBig ? 2 : 1;
  // dK, dV, fp32 (the FMA kernel): BN key rows per block, BM queries per step
  static constexpr int kKvBN = kBig ? 16 : (D > 64 ? 32 : 64);
  static constexpr int kKvBM = kBig ? 16 : 32;
  static constexpr int kKvWN = kBig ? 2 : 1;
};

}  // namespace attn
}  // namespace bertfast
