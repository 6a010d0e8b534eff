// Fused bidirectional attention with padding masks, FlashAttention-2 style (templates; the
// launchers live in attention_fwd.cu / attention_bwd.cu and instantiate them per dtype and head dim).
//
// Math, per sequence b and head a, with scale c, queries i and keys j of the sequence
// (padded form: keys with key_padding_mask = 0 are left out; a row with no key gives 0):
//   s_ij = c q_i . k_j,   lse_i = log sum_j exp(s_ij),   p_ij = exp(s_ij - lse_i)
//   o_i  = sum_j (keep_ij / (1 - dp)) p_ij v_j
//   backward, with pd = keep p / (1 - dp) and Delta_i = sum_j p_ij dp_ij (= do_i . o_i):
//     dv_j = sum_i pd_ij do_i
//     dp_ij = keep_ij / (1 - dp) * (do_i . v_j),   ds_ij = p_ij (dp_ij - Delta_i)
//     dq_i = c sum_j ds_ij k_j,   dk_j = c sum_i ds_ij q_i
//   keep_ij = uniform(philox(seed, row = (b * A + a) * S + i, j / 4)[j % 4]) >= dp, S = max_seqlen.
//
// Forward (one block per BM query rows of one (sequence, head); a row group of 16 query rows per
//   warp, or per WN warps that split O's columns, see Cfg): Q tile stays in shared memory; for each
//   key block: K, V -> smem, S = Q K^T (row group's rows, fp32 in smem), online softmax on its rows
//   (running max m, sum l in registers, log2 domain), P -> smem in the input dtype,
//   O = alpha * O + P V in fp32 accumulators. [S, S] never exists; only [BM, BN] tiles do.
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
// Tensor cores: fp16/bf16 tiles are multiplied with WMMA 16x16x16 (fp32 accumulate). WMMA
//   leaves the element-to-thread map of a fragment unspecified, so everything per element goes
//   through shared memory, except the per-row rescale of the O accumulator: a fragment loaded
//   once from a matrix holding each element's row index tells every thread the row of each of
//   its accumulator elements. fp32 inputs use a plain FMA path with the same structure.
// Global rows move as 16-byte vectors where a tensor's pointer, strides and row width allow it
//   (decided per tensor by the launcher: Params::vec), else element by element.
// Limits: 8 <= head_dim <= 256; batch <= 65535; heads <= 65535.
#pragma once
#include <mma.h>

#include <type_traits>

#include "common.cuh"

namespace bertfast {
namespace attn {

using namespace nvcuda;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <typename T>
constexpr bool kWmma = !std::is_same<T, float>::value;
template <typename T>
constexpr int kPadT = 16 / sizeof(T);  // smem row padding of T tiles: 16 bytes
constexpr int kPadF = 4;               // smem row padding of fp32 tiles: 16 bytes

__host__ __device__ constexpr int align128(long long x) { return static_cast<int>((x + 127) / 128 * 128); }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }

// A launch's parameters plus what the launcher derives from them.
enum : unsigned { kVecQ = 1, kVecK = 2, kVecV = 4, kVecO = 8, kVecDO = 16, kVecDQ = 32, kVecDK = 64, kVecDV = 128 };
struct Params : AttentionParams {
  unsigned vec;  // kVec* bits: that tensor's rows allow 16-byte accesses
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

// Rows [0, ROWS) of a [*, hd] tile into smem as [ROWS, D] (row pitch LD); rows >= nvalid (so
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
      *reinterpret_cast<uint4*>(dst + r * LD + c) = val;
    }
  } else {
    // Kept rolled: unrolled, its loads in flight take registers the accumulators need (spills, sm_90).
#pragma unroll 1
    for (int idx = threadIdx.x; idx < ROWS * D; idx += NT) {
      const int r = idx / D, c = idx % D;
      dst[r * LD + c] = r < nvalid && c < hd ? src[r * row_stride + c] : from_f<T>(0.f);
    }
  }
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
// C[16, N] (fp32, smem, row pitch ldc) = A[16, K] B^T, A row-major (lda), B row-major [N, K] (ldb).
template <typename T, int N, int K>
__device__ __forceinline__ void warp_gemm_nt(const T* A, int lda, const T* B, int ldb, float* C, int ldc) {
  static_assert(!kWmma<T> || (N % 16 == 0 && K % 16 == 0), "WMMA tiles are 16 wide");
  if constexpr (kWmma<T>) {
#pragma unroll
    for (int n = 0; n < N / 16; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
      wmma::fill_fragment(c, 0.f);
#pragma unroll
      for (int k = 0; k < K / 16; ++k) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;  // b(k, n) = B[n, k]
        wmma::load_matrix_sync(a, A + k * 16, lda);
        wmma::load_matrix_sync(b, B + n * 16 * ldb + k * 16, ldb);
        wmma::mma_sync(c, a, b, c);
      }
      wmma::store_matrix_sync(C + n * 16, c, ldc, wmma::mem_row_major);
    }
  } else {
    const int lane = threadIdx.x & 31;
    for (int idx = lane; idx < 16 * N; idx += 32) {
      const int r = idx / N, c = idx % N;
      float s = 0.f;
#pragma unroll 8
      for (int k = 0; k < K; ++k) s += to_f(A[r * lda + k]) * to_f(B[c * ldb + k]);
      C[r * ldc + c] = s;
    }
  }
}

// A warp's fp32 accumulator tile [16, N]: acc += A[16, K] B[K, N], A and B row-major in smem.
template <typename T, int N, bool kUseWmma = kWmma<T>>
struct WarpAcc;

template <typename T, int N>
struct WarpAcc<T, N, true> {
  using Frag = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  Frag f[N / 16];
  int rows[Frag::num_elements];  // tile row of element e (the same map for every fragment)

  // scratch: a warp-private fp32 [16, 16] block of smem (row pitch ld), 32-byte aligned.
  __device__ __forceinline__ void init(float* scratch, int ld) {
    const int lane = threadIdx.x & 31;
    for (int e = lane; e < 256; e += 32) scratch[e / 16 * ld + e % 16] = static_cast<float>(e / 16);
    __syncwarp();
    Frag m;
    wmma::load_matrix_sync(m, scratch, ld, wmma::mem_row_major);
#pragma unroll
    for (int e = 0; e < Frag::num_elements; ++e) rows[e] = static_cast<int>(m.x[e]);
    __syncwarp();
#pragma unroll
    for (int n = 0; n < N / 16; ++n) wmma::fill_fragment(f[n], 0.f);
  }
  __device__ __forceinline__ void scale_rows(const float* s) {  // row r *= s[r]
#pragma unroll
    for (int n = 0; n < N / 16; ++n) {
#pragma unroll
      for (int e = 0; e < Frag::num_elements; ++e) f[n].x[e] *= s[rows[e]];
    }
  }
  __device__ __forceinline__ void scale(float s) {
#pragma unroll
    for (int n = 0; n < N / 16; ++n) {
#pragma unroll
      for (int e = 0; e < Frag::num_elements; ++e) f[n].x[e] *= s;
    }
  }
  __device__ __forceinline__ void sub_scaled_rows(const WarpAcc& o, const float* s) {  // row r -= s[r] o's row r
#pragma unroll
    for (int n = 0; n < N / 16; ++n) {
#pragma unroll
      for (int e = 0; e < Frag::num_elements; ++e) f[n].x[e] -= s[rows[e]] * o.f[n].x[e];
    }
  }
  template <int K>
  __device__ __forceinline__ void mma(const T* A, int lda, const T* B, int ldb) {
#pragma unroll
    for (int k = 0; k < K / 16; ++k) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
      wmma::load_matrix_sync(a, A + k * 16, lda);
#pragma unroll
      for (int n = 0; n < N / 16; ++n) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
        wmma::load_matrix_sync(b, B + k * 16 * ldb + n * 16, ldb);
        wmma::mma_sync(f[n], a, b, f[n]);
      }
    }
  }
  __device__ __forceinline__ void store(float* C, int ldc) const {
#pragma unroll
    for (int n = 0; n < N / 16; ++n) wmma::store_matrix_sync(C + n * 16, f[n], ldc, wmma::mem_row_major);
  }
};

// FMA path: lane owns row lane / 2 and columns (lane % 2) + 2 i.
template <typename T, int N>
struct WarpAcc<T, N, false> {
  float v[N / 2];
  int r, c0;
  __device__ __forceinline__ void init(float*, int) {
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
  __device__ __forceinline__ void sub_scaled_rows(const WarpAcc& o, const float* s) {
    const float f = s[r];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) v[i] -= f * o.v[i];
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

__device__ __forceinline__ bool key_valid(const AttentionParams& p, int b, int j, int len) {
  return j < len && (p.key_mask == nullptr || p.key_mask[b * p.key_mask_batch + j] != 0);
}

// ------------------------------------------------------------------ tile configurations
// Block tiles per (dtype, tile head dim): shared memory under 100 KiB (sm_80 opts in to 163 KiB,
// sm_90 to 227 KiB) and no register spills on sm_90 (ptxas -v; BN 64 spills at D 128).
// *WN warps split the columns of a row group's accumulators (and of its S tile): at D 256 one
// warp would hold 128 accumulator registers per lane for O or dQ, 256 for dK and dV. dK/dV splits
// 16-bit tiles 4 ways (2 ways still spills), fp32 ones 2 ways (its FMA slices need not be 16
// wide, so its tiles stay small). Shared memory at D 256 (forward, dQ, dK/dV): 80, 80 and 96 KiB
// for 16-bit types, 70, 69 and 70 KiB for fp32.
template <typename T, int D>
struct Cfg {
  static constexpr bool kF32 = std::is_same<T, float>::value;
  static constexpr bool kBig = D > 128;
  // forward: BM query rows per block, BN keys per step
  static constexpr int kFwdBM = kF32 && kBig ? 32 : 64;
  static constexpr int kFwdBN = D <= 64 ? 64 : (kF32 && kBig ? 16 : 32);
  static constexpr int kFwdWN = kBig ? 2 : 1;
  // dQ: BM query rows per block, BN keys per step (fp16/bf16: two accumulators, dQ and sum_j p_ij k_j)
  static constexpr int kDqBM = kBig ? (kF32 ? 16 : 32) : (kF32 && D > 64 ? 32 : 64);
  static constexpr int kDqBN = kF32 && kBig ? 16 : (kF32 || D > 64 ? 32 : 64);
  static constexpr int kDqWN = kBig ? 2 : 1;
  // dK, dV: BN key rows per block, BM queries per step
  static constexpr int kKvBN = kBig ? 16 : (kF32 && D > 64 ? 32 : 64);
  static constexpr int kKvBM = kBig ? (kF32 ? 16 : 64) : (kF32 || D > 64 ? 32 : 64);
  static constexpr int kKvWN = kBig ? (kF32 ? 2 : 4) : 1;
};

// ------------------------------------------------------------------ forward
// The fp32 staging of O at the end (o; of dQ, dK, dV likewise in the backward) overlaps the
// tiles that are dead by then; bytes covers both uses.
template <typename T, int D, int BM, int BN>
struct FwdSmem {
  static constexpr int LDT = D + kPadT<T>;  // Q, K, V rows
  static constexpr int LDP = BN + kPadT<T>; // P rows
  static constexpr int LDS = BN + kPadF;    // S rows
  static constexpr int LDO = D + kPadF;     // staging of O
  static constexpr int alpha = 0;
  static constexpr int kvalid = align128(alpha + 1LL * BM * 4);
  static constexpr int q = align128(kvalid + 1LL * BN * 4);
  static constexpr int k = align128(q + 1LL * BM * LDT * sizeof(T));
  static constexpr int v = align128(k + 1LL * BN * LDT * sizeof(T));
  static constexpr int s = align128(v + 1LL * BN * LDT * sizeof(T));
  static constexpr int p = align128(s + 1LL * BM * LDS * 4);
  static constexpr int o = q;
  static constexpr int bytes = cmax(align128(p + 1LL * BM * LDP * sizeof(T)), align128(o + 4LL * BM * LDO));
};

template <typename T, int D, int BM, int BN, int WN>
__global__ void __launch_bounds__(BM / 16 * WN * 32) attention_fwd_kernel(const Params p) {
  using L = FwdSmem<T, D, BM, BN>;
  constexpr int NT = BM / 16 * WN * 32;
  constexpr int SC = BN / WN, DC = D / WN;  // a warp's columns of S and of O
  static_assert(SC % 8 == 0 && DC % 16 == 0, "a warp's columns: whole column groups and tiles");
  extern __shared__ __align__(128) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem + L::q);              // [BM, LDT]
  T* Ks = reinterpret_cast<T*>(smem + L::k);              // [BN, LDT]
  T* Vs = reinterpret_cast<T*>(smem + L::v);              // [BN, LDT]
  float* Ss = reinterpret_cast<float*>(smem + L::s);      // [BM, LDS] scores
  T* Ps = reinterpret_cast<T*>(smem + L::p);              // [BM, LDP] probabilities (kept ones)
  int* kvalid = reinterpret_cast<int*>(smem + L::kvalid); // [BN] key is a token of this sequence
  float* alpha_s = reinterpret_cast<float*>(smem + L::alpha);  // [BM] rescale of O this step; 1/l at the end
  float* Os = reinterpret_cast<float*>(smem + L::o);      // [BM, LDO] O staging, over Q, K, V, S, P

  const int b = blockIdx.z, h = blockIdx.y, m0 = blockIdx.x * BM;
  const Seq sq = seq_of(p, b);
  if (m0 >= sq.len) return;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rg = WN > 1 ? w % (BM / 16) : w, cs = WN > 1 ? w / (BM / 16) : 0;  // row group, column slice
  const int r = lane >> 1, half = lane & 1;  // this lane's softmax row (with its pair lane)
  const int qi = m0 + 16 * rg + r;

  const T* q = static_cast<const T*>(p.q) + b * p.sq.batch + (sq.start + m0) * p.sq.row + h * p.sq.head;
  const T* kb = static_cast<const T*>(p.k) + b * p.sk.batch + sq.start * p.sk.row + h * p.sk.head;
  const T* vb = static_cast<const T*>(p.v) + b * p.sv.batch + sq.start * p.sv.row + h * p.sv.head;
  load_tile<T, BM, D, L::LDT, NT>(Qs, q, p.sq.row, sq.len - m0, p.head_dim, p.vec & kVecQ);

  float* Sw = Ss + 16 * rg * L::LDS;
  T* Pw = Ps + 16 * rg * L::LDP;
  WarpAcc<T, DC> acc;
  acc.init(Sw + cs * SC, L::LDS);

  const float scale2 = p.softmax_scale * kLog2e;
  const bool dropout = p.dropout_p > 0.f;
  const uint64_t seed = dropout ? static_cast<uint64_t>(*p.seed) : 0;
  const uint64_t drow = static_cast<uint64_t>(b * p.heads + h) * p.max_seqlen + qi;
  float m_run = -kInf, l_run = 0.f;  // running max (log2 units) and sum of exp2(s - m); slice 0 only

  for (int n0 = 0; n0 < sq.len; n0 += BN) {
    __syncthreads();  // every warp is done with the previous K, V
    load_tile<T, BN, D, L::LDT, NT>(Ks, kb + n0 * p.sk.row, p.sk.row, sq.len - n0, p.head_dim, p.vec & kVecK);
    load_tile<T, BN, D, L::LDT, NT>(Vs, vb + n0 * p.sv.row, p.sv.row, sq.len - n0, p.head_dim, p.vec & kVecV);
    for (int j = threadIdx.x; j < BN; j += NT) kvalid[j] = key_valid(p, b, n0 + j, sq.len);
    __syncthreads();

    // S = Q K^T, this warp's columns
    warp_gemm_nt<T, SC, D>(Qs + 16 * rg * L::LDT, L::LDT, Ks + cs * SC * L::LDT, L::LDT, Sw + cs * SC, L::LDS);
    sync_row_group<WN>();

    // Online softmax (slice 0's warp) over this lane's column groups 4 (half + 2 g) .. +3 of row r.
    // The scores are read from smem twice rather than held: held, they push the kernel into
    // spilling on sm_90.
    if (cs == 0) {
      constexpr int G = BN / 8;
      const auto score = [&](int c) { return kvalid[c] ? Sw[r * L::LDS + c] * scale2 : -kInf; };
      float mx = -kInf;
#pragma unroll
      for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int e = 0; e < 4; ++e) mx = fmaxf(mx, score(4 * (half + 2 * g) + e));
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      const float m_new = fmaxf(m_run, mx);
      const float m_use = m_new == -kInf ? 0.f : m_new;  // no valid key yet: keep exp2 finite
      const float alpha = exp2f(m_run - m_use);
      float rsum = 0.f;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        U4 bits{0u, 0u, 0u, 0u};
        if (dropout) bits = dropout_bits(seed, drow, static_cast<uint32_t>((n0 >> 2) + half + 2 * g));
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = 4 * (half + 2 * g) + e;
          const float pv = exp2f(score(c) - m_use);
          rsum += pv;
          const bool keep = !dropout || uniform01(pick(bits, e)) >= p.dropout_p;
          Pw[r * L::LDP + c] = from_f<T>(keep ? pv : 0.f);
        }
      }
      rsum += __shfl_xor_sync(0xffffffffu, rsum, 1);
      l_run = l_run * alpha + rsum;
      m_run = m_new;
      if (half == 0) alpha_s[16 * rg + r] = alpha;
    }
    sync_row_group<WN>();

    acc.scale_rows(alpha_s + 16 * rg);
    acc.template mma<BN>(Pw, L::LDP, Vs + cs * DC, L::LDT);  // O += P V, this warp's columns
  }

  __syncthreads();  // every warp is done with the tiles (O is staged over them) and alpha
  if (cs == 0 && half == 0) {
    alpha_s[16 * rg + r] = l_run > 0.f ? 1.f / (l_run * (1.f - p.dropout_p)) : 0.f;
    if (qi < sq.len)
      p.lse[b * p.lse_batch + h * p.lse_head + sq.start + qi] = l_run > 0.f ? (m_run + log2f(l_run)) * kLn2 : kInf;
  }
  float* Ow = Os + 16 * rg * L::LDO + cs * DC;
  acc.store(Ow, L::LDO);
  __syncthreads();  // 1 / l of every row
  if (qi < sq.len) {
    T* o = static_cast<T*>(p.out) + b * p.so.batch + (sq.start + qi) * p.so.row + h * p.so.head + cs * DC;
    write_row<T, DC>(o, Ow + r * L::LDO, p.head_dim - cs * DC, half, alpha_s[16 * rg + r], p.vec & kVecO);
  }
}

// ------------------------------------------------------------------ backward: Delta_i = do_i . o_i
template <typename T>
__global__ void __launch_bounds__(128) attention_bwd_delta_kernel(const Params p) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int b = blockIdx.z, h = blockIdx.y, i = blockIdx.x * 4 + w;
  const Seq sq = seq_of(p, b);
  if (i >= sq.len) return;
  const T* o = static_cast<const T*>(p.out) + b * p.so.batch + (sq.start + i) * p.so.row + h * p.so.head;
  const T* d = static_cast<const T*>(p.dout) + b * p.sdo.batch + (sq.start + i) * p.sdo.row + h * p.sdo.head;
  float s = 0.f;
  for (int c = lane; c < p.head_dim; c += 32) s += to_f(o[c]) * to_f(d[c]);
  s = warp_sum(s);
  if (lane == 0) p.delta[b * p.lse_batch + h * p.lse_head + sq.start + i] = s;
}

// ------------------------------------------------------------------ backward: dK, dV
template <typename T, int D, int BN, int BM>
struct KvSmem {
  static constexpr int LDT = D + kPadT<T>;    // K, V, Q, dO rows
  static constexpr int LDF = BM + kPadF;      // S^T, dP^T rows (fp32)
  static constexpr int LDP = BM + kPadT<T>;   // Pd^T, dS^T rows (T)
  static constexpr int LDO = D + kPadF;       // staging of dK, dV (fp32)
  static constexpr int k = 0;
  static constexpr int v = align128(k + 1LL * BN * LDT * sizeof(T));
  static constexpr int q = align128(v + 1LL * BN * LDT * sizeof(T));
  static constexpr int dO = align128(q + 1LL * BM * LDT * sizeof(T));
  static constexpr int f = align128(dO + 1LL * BM * LDT * sizeof(T));
  static constexpr int pd = align128(f + 2 * 4LL * BN * LDF);  // S^T and dP^T
  static constexpr int ds = align128(pd + 1LL * BN * LDP * sizeof(T));
  static constexpr int lse = align128(ds + 1LL * BN * LDP * sizeof(T));
  static constexpr int delta = align128(lse + 4LL * BM);
  static constexpr int kvalid = align128(delta + 4LL * BM);
  static constexpr int o = 0;
  static constexpr int bytes = cmax(align128(kvalid + 4LL * BN), align128(o + 4LL * BN * LDO));
};

template <typename T, int D, int BN, int BM, int WN>
__global__ void __launch_bounds__(BN / 16 * WN * 32) attention_bwd_dkdv_kernel(const Params p) {
  using L = KvSmem<T, D, BN, BM>;
  constexpr int NT = BN / 16 * WN * 32;
  constexpr int SC = BM / WN, DC = D / WN;  // a warp's columns of S^T / dP^T and of dK, dV
  static_assert(SC % 8 == 0 && DC % 16 == 0, "a warp's columns: whole column groups and tiles");
  extern __shared__ __align__(128) unsigned char smem[];
  T* Ks = reinterpret_cast<T*>(smem + L::k);        // [BN, LDT]
  T* Vs = reinterpret_cast<T*>(smem + L::v);        // [BN, LDT]
  T* Qs = reinterpret_cast<T*>(smem + L::q);        // [BM, LDT]
  T* dOs = reinterpret_cast<T*>(smem + L::dO);      // [BM, LDT]
  float* F = reinterpret_cast<float*>(smem + L::f); // S^T [BN, LDF] then dP^T [BN, LDF]
  T* PdT = reinterpret_cast<T*>(smem + L::pd);      // [BN, LDP] dropped-out probabilities, transposed
  T* dST = reinterpret_cast<T*>(smem + L::ds);      // [BN, LDP] dS^T
  float* lse_s = reinterpret_cast<float*>(smem + L::lse);      // [BM] lse in log2 units (+inf: no row)
  float* delta_s = reinterpret_cast<float*>(smem + L::delta);  // [BM]
  int* kvalid = reinterpret_cast<int*>(smem + L::kvalid);      // [BN]
  float* Os = reinterpret_cast<float*>(smem + L::o);           // [BN, LDO] staging, over the tiles

  const int b = blockIdx.z, h = blockIdx.y, n0 = blockIdx.x * BN;
  const Seq sq = seq_of(p, b);
  if (n0 >= sq.len) return;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rg = WN > 1 ? w % (BN / 16) : w, cs = WN > 1 ? w / (BN / 16) : 0;  // row group (16 keys), column slice

  const T* k = static_cast<const T*>(p.k) + b * p.sk.batch + (sq.start + n0) * p.sk.row + h * p.sk.head;
  const T* v = static_cast<const T*>(p.v) + b * p.sv.batch + (sq.start + n0) * p.sv.row + h * p.sv.head;
  load_tile<T, BN, D, L::LDT, NT>(Ks, k, p.sk.row, sq.len - n0, p.head_dim, p.vec & kVecK);
  load_tile<T, BN, D, L::LDT, NT>(Vs, v, p.sv.row, sq.len - n0, p.head_dim, p.vec & kVecV);
  for (int j = threadIdx.x; j < BN; j += NT) kvalid[j] = key_valid(p, b, n0 + j, sq.len);

  float* STw = F + 16 * rg * L::LDF;
  float* dPTw = F + BN * L::LDF + 16 * rg * L::LDF;
  T* PdTw = PdT + 16 * rg * L::LDP;
  T* dSTw = dST + 16 * rg * L::LDP;
  WarpAcc<T, DC> dk, dv;
  dk.init(STw + cs * SC, L::LDF);
  dv.init(STw + cs * SC, L::LDF);

  const T* qb = static_cast<const T*>(p.q) + b * p.sq.batch + sq.start * p.sq.row + h * p.sq.head;
  const T* dob = static_cast<const T*>(p.dout) + b * p.sdo.batch + sq.start * p.sdo.row + h * p.sdo.head;
  const float* lse_b = p.lse + b * p.lse_batch + h * p.lse_head + sq.start;
  const float* delta_b = p.delta + b * p.lse_batch + h * p.lse_head + sq.start;
  const float scale2 = p.softmax_scale * kLog2e;
  const bool dropout = p.dropout_p > 0.f;
  const uint64_t seed = dropout ? static_cast<uint64_t>(*p.seed) : 0;
  const float rdrop = 1.f / (1.f - p.dropout_p);
  const uint64_t drow0 = static_cast<uint64_t>(b * p.heads + h) * p.max_seqlen;
  // Elementwise map: lane handles keys 4 jg .. 4 jg + 3 (of the row group) of queries
  // cs SC + ic + 8 t, so one Philox draw covers four consecutive keys of one query (the RNG's
  // column groups).
  const int jg = lane >> 3, ic = lane & 7;
  const uint32_t colgroup = static_cast<uint32_t>((n0 + 16 * rg + 4 * jg) >> 2);

  for (int m0 = 0; m0 < sq.len; m0 += BM) {
    __syncthreads();  // every warp is done with the previous Q, dO, lse, delta
    load_tile<T, BM, D, L::LDT, NT>(Qs, qb + m0 * p.sq.row, p.sq.row, sq.len - m0, p.head_dim, p.vec & kVecQ);
    load_tile<T, BM, D, L::LDT, NT>(dOs, dob + m0 * p.sdo.row, p.sdo.row, sq.len - m0, p.head_dim,
                                    p.vec & kVecDO);
    for (int i = threadIdx.x; i < BM; i += NT) {
      const bool ok = m0 + i < sq.len;
      lse_s[i] = ok ? lse_b[m0 + i] * kLog2e : kInf;
      delta_s[i] = ok ? delta_b[m0 + i] : 0.f;
    }
    __syncthreads();

    // S^T = K Q^T, dPd^T = V dO^T: this warp's query columns
    warp_gemm_nt<T, SC, D>(Ks + 16 * rg * L::LDT, L::LDT, Qs + cs * SC * L::LDT, L::LDT, STw + cs * SC, L::LDF);
    warp_gemm_nt<T, SC, D>(Vs + 16 * rg * L::LDT, L::LDT, dOs + cs * SC * L::LDT, L::LDT, dPTw + cs * SC, L::LDF);
    __syncwarp();

    // Kept rolled: each step is a Philox draw already; unrolled, bf16 at D 128 spills (sm_90).
#pragma unroll 1
    for (int t = 0; t < SC / 8; ++t) {
      const int i = cs * SC + ic + 8 * t;
      const float l2 = lse_s[i], dl = delta_s[i];
      U4 bits{0u, 0u, 0u, 0u};
      if (dropout) bits = dropout_bits(seed, drow0 + m0 + i, colgroup);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int jl = 4 * jg + e;
        const float pv = kvalid[16 * rg + jl] ? exp2f(STw[jl * L::LDF + i] * scale2 - l2) : 0.f;
        const bool keep = !dropout || uniform01(pick(bits, e)) >= p.dropout_p;
        const float pd = keep ? pv * rdrop : 0.f;
        const float dpv = keep ? dPTw[jl * L::LDF + i] * rdrop : 0.f;
        PdTw[jl * L::LDP + i] = from_f<T>(pd);
        dSTw[jl * L::LDP + i] = from_f<T>(pv * (dpv - dl));
      }
    }
    sync_row_group<WN>();
    dv.template mma<BM>(PdTw, L::LDP, dOs + cs * DC, L::LDT);  // dV += Pd^T dO, this warp's columns
    dk.template mma<BM>(dSTw, L::LDP, Qs + cs * DC, L::LDT);   // dK += dS^T Q
  }
  dk.scale(p.softmax_scale);

  __syncthreads();  // every warp is done with the tiles: the staging overlaps them
  float* Ow = Os + 16 * rg * L::LDO + cs * DC;
  const int r = lane >> 1, half = lane & 1;
  const int kj = n0 + 16 * rg + r;
  const int64_t row = sq.start + kj;
  dv.store(Ow, L::LDO);
  __syncwarp();
  if (kj < sq.len) {
    write_row<T, DC>(static_cast<T*>(p.dv) + b * p.sdv.batch + row * p.sdv.row + h * p.sdv.head + cs * DC,
                     Ow + r * L::LDO, p.head_dim - cs * DC, half, 1.f, p.vec & kVecDV);
  }
  __syncwarp();
  dk.store(Ow, L::LDO);
  __syncwarp();
  if (kj < sq.len) {
    write_row<T, DC>(static_cast<T*>(p.dk) + b * p.sdk.batch + row * p.sdk.row + h * p.sdk.head + cs * DC,
                     Ow + r * L::LDO, p.head_dim - cs * DC, half, 1.f, p.vec & kVecDK);
  }
}

// ------------------------------------------------------------------ backward: dQ
template <typename T, int D, int BM, int BN, int WN>
struct DqSmem {
  static constexpr bool kRefine = kWmma<T>;  // Delta refined (fp16/bf16; header)
  static constexpr int LDT = D + kPadT<T>;   // Q, dO, K, V rows
  static constexpr int LDS = BN + kPadF;     // S and dP rows
  static constexpr int LDP = BN + kPadT<T>;  // dS (and P) rows
  static constexpr int LDO = D + kPadF;      // staging of dQ
  static constexpr int q = 0;
  static constexpr int dO = align128(q + 1LL * BM * LDT * sizeof(T));
  static constexpr int k = align128(dO + 1LL * BM * LDT * sizeof(T));
  static constexpr int v = align128(k + 1LL * BN * LDT * sizeof(T));
  static constexpr int s = align128(v + 1LL * BN * LDT * sizeof(T));
  static constexpr int dp = align128(s + 4LL * BM * LDS);
  static constexpr int ds = align128(dp + 4LL * BM * LDS);
  static constexpr int pp = align128(ds + 1LL * BM * LDP * sizeof(T));
  static constexpr int kvalid = align128(pp + (kRefine ? 1LL * BM * LDP * sizeof(T) : 0));
  static constexpr int resid = align128(kvalid + 4LL * BN);  // [WN, BM] row sums of dS' (kRefine)
  static constexpr int o = 0;
  static constexpr int bytes = cmax(align128(resid + (kRefine ? 4LL * WN * BM : 0)), align128(o + 4LL * BM * LDO));
};

template <typename T, int D, int BM, int BN, int WN>
__global__ void __launch_bounds__(BM / 16 * WN * 32) attention_bwd_dq_kernel(const Params p) {
  using L = DqSmem<T, D, BM, BN, WN>;
  constexpr bool kRefine = L::kRefine;
  constexpr int NT = BM / 16 * WN * 32;
  constexpr int SC = BN / WN, DC = D / WN;  // a warp's columns of S / dP and of dQ
  static_assert(SC % 8 == 0 && DC % 16 == 0, "a warp's columns: whole column groups and tiles");
  extern __shared__ __align__(128) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem + L::q);          // [BM, LDT]
  T* dOs = reinterpret_cast<T*>(smem + L::dO);        // [BM, LDT]
  T* Ks = reinterpret_cast<T*>(smem + L::k);          // [BN, LDT]
  T* Vs = reinterpret_cast<T*>(smem + L::v);          // [BN, LDT]
  float* Ss = reinterpret_cast<float*>(smem + L::s);  // [BM, LDS] scores
  float* dPs = reinterpret_cast<float*>(smem + L::dp);  // [BM, LDS]
  T* dSs = reinterpret_cast<T*>(smem + L::ds);        // [BM, LDP]
  T* Ps = reinterpret_cast<T*>(smem + L::pp);         // [BM, LDP] probabilities (kRefine)
  int* kvalid = reinterpret_cast<int*>(smem + L::kvalid);  // [BN]
  float* resid_s = reinterpret_cast<float*>(smem + L::resid);  // [WN, BM] (kRefine)
  float* Os = reinterpret_cast<float*>(smem + L::o);  // [BM, LDO] dQ staging, over the tiles

  const int b = blockIdx.z, h = blockIdx.y, m0 = blockIdx.x * BM;
  const Seq sq = seq_of(p, b);
  if (m0 >= sq.len) return;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rg = WN > 1 ? w % (BM / 16) : w, cs = WN > 1 ? w / (BM / 16) : 0;  // row group, column slice
  const int r = lane >> 1, half = lane & 1;
  const int qi = m0 + 16 * rg + r;

  const T* q = static_cast<const T*>(p.q) + b * p.sq.batch + (sq.start + m0) * p.sq.row + h * p.sq.head;
  const T* dout = static_cast<const T*>(p.dout) + b * p.sdo.batch + (sq.start + m0) * p.sdo.row + h * p.sdo.head;
  load_tile<T, BM, D, L::LDT, NT>(Qs, q, p.sq.row, sq.len - m0, p.head_dim, p.vec & kVecQ);
  load_tile<T, BM, D, L::LDT, NT>(dOs, dout, p.sdo.row, sq.len - m0, p.head_dim, p.vec & kVecDO);
  const int64_t stat = b * p.lse_batch + h * p.lse_head + sq.start + qi;
  const float l2 = qi < sq.len ? p.lse[stat] * kLog2e : kInf;
  const float dl = qi < sq.len ? p.delta[stat] : 0.f;  // d_i, refined below (kRefine)

  float* Sw = Ss + 16 * rg * L::LDS;
  float* dPw = dPs + 16 * rg * L::LDS;
  T* dSw = dSs + 16 * rg * L::LDP;
  T* Pw = Ps + 16 * rg * L::LDP;
  WarpAcc<T, DC> dq, pk;  // dQ; sum_j p_ij k_j (kRefine)
  dq.init(Sw + cs * SC, L::LDS);
  if constexpr (kRefine) pk.init(Sw + cs * SC, L::LDS);
  float resid = 0.f;  // this lane's part of r_i = sum_j ds'_ij (kRefine)

  const T* kb = static_cast<const T*>(p.k) + b * p.sk.batch + sq.start * p.sk.row + h * p.sk.head;
  const T* vb = static_cast<const T*>(p.v) + b * p.sv.batch + sq.start * p.sv.row + h * p.sv.head;
  const float scale2 = p.softmax_scale * kLog2e;
  const bool dropout = p.dropout_p > 0.f;
  const uint64_t seed = dropout ? static_cast<uint64_t>(*p.seed) : 0;
  const float rdrop = 1.f / (1.f - p.dropout_p);
  const uint64_t drow = static_cast<uint64_t>(b * p.heads + h) * p.max_seqlen + qi;

  for (int n0 = 0; n0 < sq.len; n0 += BN) {
    __syncthreads();
    load_tile<T, BN, D, L::LDT, NT>(Ks, kb + n0 * p.sk.row, p.sk.row, sq.len - n0, p.head_dim, p.vec & kVecK);
    load_tile<T, BN, D, L::LDT, NT>(Vs, vb + n0 * p.sv.row, p.sv.row, sq.len - n0, p.head_dim, p.vec & kVecV);
    for (int j = threadIdx.x; j < BN; j += NT) kvalid[j] = key_valid(p, b, n0 + j, sq.len);
    __syncthreads();

    // S = Q K^T, dPd = dO V^T: this warp's key columns
    warp_gemm_nt<T, SC, D>(Qs + 16 * rg * L::LDT, L::LDT, Ks + cs * SC * L::LDT, L::LDT, Sw + cs * SC, L::LDS);
    warp_gemm_nt<T, SC, D>(dOs + 16 * rg * L::LDT, L::LDT, Vs + cs * SC * L::LDT, L::LDT, dPw + cs * SC, L::LDS);
    __syncwarp();

#pragma unroll
    for (int g = 0; g < SC / 8; ++g) {
      const int c0 = cs * SC + 4 * (half + 2 * g);
      U4 bits{0u, 0u, 0u, 0u};
      if (dropout) bits = dropout_bits(seed, drow, static_cast<uint32_t>((n0 + c0) >> 2));
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = c0 + e;
        const float pv = kvalid[c] ? exp2f(Sw[r * L::LDS + c] * scale2 - l2) : 0.f;
        const bool keep = !dropout || uniform01(pick(bits, e)) >= p.dropout_p;
        const float dpv = keep ? dPw[r * L::LDS + c] * rdrop : 0.f;
        const float dsv = pv * (dpv - dl);
        dSw[r * L::LDP + c] = from_f<T>(dsv);
        if constexpr (kRefine) {
          Pw[r * L::LDP + c] = from_f<T>(pv);
          resid += dsv;
        }
      }
    }
    sync_row_group<WN>();
    dq.template mma<BN>(dSw, L::LDP, Ks + cs * DC, L::LDT);  // dQ += dS K, this warp's columns
    if constexpr (kRefine) pk.template mma<BN>(Pw, L::LDP, Ks + cs * DC, L::LDT);  // += P K
  }
  if constexpr (kRefine) {
    // r_i: the lane pair's columns, then the WN column slices (fixed order: deterministic).
    resid += __shfl_xor_sync(0xffffffffu, resid, 1);
    if (half == 0) resid_s[cs * BM + 16 * rg + r] = resid;
    __syncthreads();
    if (cs == 0 && half == 0) {
      float sum = 0.f;
      for (int c = 0; c < WN; ++c) sum += resid_s[c * BM + 16 * rg + r];
      resid_s[16 * rg + r] = sum;
      if (qi < sq.len) p.delta[stat] = dl + sum;  // Delta_i for the dK/dV kernel
    }
    __syncthreads();
    dq.sub_scaled_rows(pk, resid_s + 16 * rg);  // dQ -= r_i pk_i
  }
  dq.scale(p.softmax_scale);

  __syncthreads();  // every warp is done with the tiles: the staging overlaps them
  float* Ow = Os + 16 * rg * L::LDO + cs * DC;
  dq.store(Ow, L::LDO);
  __syncwarp();
  if (qi < sq.len) {
    write_row<T, DC>(static_cast<T*>(p.dq) + b * p.sdq.batch + (sq.start + qi) * p.sdq.row + h * p.sdq.head + cs * DC,
                     Ow + r * L::LDO, p.head_dim - cs * DC, half, 1.f, p.vec & kVecDQ);
  }
}

}  // namespace attn
}  // namespace bertfast
