// Fused bidirectional attention with padding masks, FlashAttention-2 style (templates; the
// launchers live in attention_fwd.cu / attention_bwd.cu and instantiate them per dtype and head dim).
//
// Math, per sequence b and head a, with scale c, queries i and keys j of the sequence
// (padded form: keys with key_padding_mask = 0 are left out; a row with no key gives 0):
//   s_ij = c q_i . k_j,   lse_i = log sum_j exp(s_ij),   p_ij = exp(s_ij - lse_i)
//   o_i  = sum_j (keep_ij / (1 - dp)) p_ij v_j
//   backward, with pd = keep p / (1 - dp) and Delta_i = do_i . o_i:
//     dv_j = sum_i pd_ij do_i
//     dp_ij = keep_ij / (1 - dp) * (do_i . v_j),   ds_ij = p_ij (dp_ij - Delta_i)
//     dq_i = c sum_j ds_ij k_j,   dk_j = c sum_i ds_ij q_i
//   keep_ij = uniform(philox(seed, row = (b * A + a) * S + i, j / 4)[j % 4]) >= dp, S = max_seqlen.
//
// Forward (one block per 64 query rows of one (sequence, head); warp w owns 16 query rows):
//   Q tile stays in shared memory; for each key block: K, V -> smem, S = Q K^T (warp's rows, fp32
//   in smem), online softmax on its rows (running max m, sum l in registers, log2 domain),
//   P -> smem in the input dtype, O = alpha * O + P V in fp32 accumulators.
//   [S, S] never exists; only [64, BN] tiles do.
// Backward: a delta kernel (Delta_i), a dK/dV kernel (one block per key block, warps own key
//   rows, loop over query blocks, recomputing P^T from lse) and a dQ kernel (one block per query
//   block, loop over key blocks). Two kernels instead of atomics: deterministic, no workspace.
// Tensor cores: fp16/bf16 tiles are multiplied with WMMA 16x16x16 (fp32 accumulate). WMMA
//   leaves the element-to-thread map of a fragment unspecified, so everything per element goes
//   through shared memory, except the per-row rescale of the O accumulator: a fragment loaded
//   once from a matrix holding each element's row index tells every thread the row of each of
//   its accumulator elements. fp32 inputs use a plain FMA path with the same structure.
// Limits: head_dim 16, 32, 64, 128; q/k/v/dout/out rows 16-byte aligned (strides multiples of
//   16 bytes); batch <= 65535; heads <= 65535.
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

// Rows [0, ROWS) of a [*, D] tile into smem (row pitch LD); rows >= nvalid are zero (so that
// masked products stay finite). 16-byte accesses; every row start is 16-byte aligned.
template <typename T, int ROWS, int D, int LD, int NT>
__device__ __forceinline__ void load_tile(T* __restrict__ dst, const T* __restrict__ src, int64_t row_stride,
                                          int nvalid) {
  constexpr int EPV = 16 / sizeof(T);
  constexpr int VPR = D / EPV;
  for (int idx = threadIdx.x; idx < ROWS * VPR; idx += NT) {
    const int r = idx / VPR, c = (idx % VPR) * EPV;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (r < nvalid) val = *reinterpret_cast<const uint4*>(src + r * row_stride + c);
    *reinterpret_cast<uint4*>(dst + r * LD + c) = val;
  }
}

// ------------------------------------------------------------------ warp tile products
// C[16, N] (fp32, smem, row pitch ldc) = A[16, K] B^T, A row-major (lda), B row-major [N, K] (ldb).
template <typename T, int N, int K>
__device__ __forceinline__ void warp_gemm_nt(const T* A, int lda, const T* B, int ldb, float* C, int ldc) {
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

  // scratch: 256 floats of warp-private smem, 32-byte aligned.
  __device__ __forceinline__ void init(float* scratch) {
    const int lane = threadIdx.x & 31;
    for (int e = lane; e < 256; e += 32) scratch[e] = static_cast<float>(e / 16);
    __syncwarp();
    Frag m;
    wmma::load_matrix_sync(m, scratch, 16, wmma::mem_row_major);
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
  __device__ __forceinline__ void init(float*) {
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

// Row r (of a warp's 16 staged fp32 rows, pitch ld) times `mul` -> global row dst (D elements,
// 16-byte aligned). Lane pair (2r, 2r+1) writes the two halves of the row.
template <typename T, int D>
__device__ __forceinline__ void write_row(T* dst, const float* staged, int ld, int r, int half, float mul) {
  constexpr int EPV = 16 / sizeof(T);
  constexpr int HALF = D / 2;
#pragma unroll
  for (int c = half * HALF; c < (half + 1) * HALF; c += EPV) {
    float t[EPV];
#pragma unroll
    for (int e = 0; e < EPV; ++e) t[e] = staged[r * ld + c + e] * mul;
    store_f<T, EPV>(dst + c, t);
  }
}

__device__ __forceinline__ bool key_valid(const AttentionParams& p, int b, int j, int len) {
  return j < len && (p.key_mask == nullptr || p.key_mask[b * p.key_mask_batch + j] != 0);
}

// ------------------------------------------------------------------ tile configurations
// Block tiles per (dtype, head dim), chosen so shared memory stays near or under 100 KiB.
template <typename T, int D>
struct Cfg {
  static constexpr bool kF32 = std::is_same<T, float>::value;
  static constexpr int kFwdBM = 64, kFwdBN = D > 64 ? 32 : 64;  // BN 64 spills at D 128 (ptxas, sm_90)
  static constexpr int kDqBM = (kF32 && D > 64) ? 32 : 64, kDqBN = (kF32 || D > 64) ? 32 : 64;
  static constexpr int kKvBN = (kF32 && D > 64) ? 32 : 64, kKvBM = (kF32 || D > 64) ? 32 : 64;
};

// ------------------------------------------------------------------ forward
template <typename T, int D, int BM, int BN>
struct FwdSmem {
  static constexpr int LDT = D + kPadT<T>;            // Q, K, V rows
  static constexpr int LDP = BN + kPadT<T>;           // P rows
  static constexpr int LDS = cmax(BN, D) + kPadF;     // S rows; stages O at the end
  static constexpr int q = 0;
  static constexpr int k = align128(q + 1LL * BM * LDT * sizeof(T));
  static constexpr int v = align128(k + 1LL * BN * LDT * sizeof(T));
  static constexpr int s = align128(v + 1LL * BN * LDT * sizeof(T));
  static constexpr int p = align128(s + 1LL * BM * LDS * 4);
  static constexpr int kvalid = align128(p + 1LL * BM * LDP * sizeof(T));
  static constexpr int alpha = align128(kvalid + 1LL * BN * 4);
  static constexpr int bytes = align128(alpha + 1LL * BM * 4);
};

template <typename T, int D, int BM, int BN>
__global__ void __launch_bounds__(BM / 16 * 32) attention_fwd_kernel(const AttentionParams p) {
  using L = FwdSmem<T, D, BM, BN>;
  constexpr int NT = BM / 16 * 32;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem + L::q);              // [BM, LDT]
  T* Ks = reinterpret_cast<T*>(smem + L::k);              // [BN, LDT]
  T* Vs = reinterpret_cast<T*>(smem + L::v);              // [BN, LDT]
  float* Ss = reinterpret_cast<float*>(smem + L::s);      // [BM, LDS] scores, then O
  T* Ps = reinterpret_cast<T*>(smem + L::p);              // [BM, LDP] probabilities (kept ones)
  int* kvalid = reinterpret_cast<int*>(smem + L::kvalid); // [BN] key is a token of this sequence
  float* alpha_s = reinterpret_cast<float*>(smem + L::alpha);  // [BM] rescale of O this step

  const int b = blockIdx.z, h = blockIdx.y, m0 = blockIdx.x * BM;
  const Seq sq = seq_of(p, b);
  if (m0 >= sq.len) return;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = lane >> 1, half = lane & 1;  // this lane's softmax row (with its pair lane)
  const int qi = m0 + 16 * w + r;

  const T* q = static_cast<const T*>(p.q) + b * p.sq.batch + (sq.start + m0) * p.sq.row + h * p.sq.head;
  const T* kb = static_cast<const T*>(p.k) + b * p.sk.batch + sq.start * p.sk.row + h * p.sk.head;
  const T* vb = static_cast<const T*>(p.v) + b * p.sv.batch + sq.start * p.sv.row + h * p.sv.head;
  load_tile<T, BM, D, L::LDT, NT>(Qs, q, p.sq.row, sq.len - m0);

  float* Sw = Ss + 16 * w * L::LDS;
  T* Pw = Ps + 16 * w * L::LDP;
  WarpAcc<T, D> acc;
  acc.init(Sw);

  const float scale2 = p.softmax_scale * kLog2e;
  const bool dropout = p.dropout_p > 0.f;
  const uint64_t seed = dropout ? static_cast<uint64_t>(*p.seed) : 0;
  const uint64_t drow = static_cast<uint64_t>(b * p.heads + h) * p.max_seqlen + qi;
  float m_run = -kInf, l_run = 0.f;  // running max (log2 units) and sum of exp2(s - m)

  for (int n0 = 0; n0 < sq.len; n0 += BN) {
    __syncthreads();  // every warp is done with the previous K, V
    load_tile<T, BN, D, L::LDT, NT>(Ks, kb + n0 * p.sk.row, p.sk.row, sq.len - n0);
    load_tile<T, BN, D, L::LDT, NT>(Vs, vb + n0 * p.sv.row, p.sv.row, sq.len - n0);
    for (int j = threadIdx.x; j < BN; j += NT) kvalid[j] = key_valid(p, b, n0 + j, sq.len);
    __syncthreads();

    warp_gemm_nt<T, BN, D>(Qs + 16 * w * L::LDT, L::LDT, Ks, L::LDT, Sw, L::LDS);  // S = Q K^T
    __syncwarp();

    // Online softmax over this lane's column groups 4 (half + 2 g) .. +3 of row r.
    constexpr int G = BN / 8;
    float sv[4 * G];
    float mx = -kInf;
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = 4 * (half + 2 * g) + e;
        const float s = kvalid[c] ? Sw[r * L::LDS + c] * scale2 : -kInf;
        sv[4 * g + e] = s;
        mx = fmaxf(mx, s);
      }
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
        const float pv = exp2f(sv[4 * g + e] - m_use);
        rsum += pv;
        const bool keep = !dropout || uniform01(pick(bits, e)) >= p.dropout_p;
        Pw[r * L::LDP + 4 * (half + 2 * g) + e] = from_f<T>(keep ? pv : 0.f);
      }
    }
    rsum += __shfl_xor_sync(0xffffffffu, rsum, 1);
    l_run = l_run * alpha + rsum;
    m_run = m_new;
    if (half == 0) alpha_s[16 * w + r] = alpha;
    __syncwarp();

    acc.scale_rows(alpha_s + 16 * w);
    acc.template mma<BN>(Pw, L::LDP, Vs, L::LDT);  // O += P V
  }

  __syncwarp();
  acc.store(Sw, L::LDS);
  __syncwarp();
  if (qi < sq.len) {
    const float inv = l_run > 0.f ? 1.f / (l_run * (1.f - p.dropout_p)) : 0.f;
    T* o = static_cast<T*>(p.out) + b * p.so.batch + (sq.start + qi) * p.so.row + h * p.so.head;
    write_row<T, D>(o, Sw, L::LDS, r, half, inv);
    if (half == 0) {
      p.lse[b * p.lse_batch + h * p.lse_head + sq.start + qi] =
          l_run > 0.f ? (m_run + log2f(l_run)) * kLn2 : kInf;
    }
  }
}

// ------------------------------------------------------------------ backward: Delta_i = do_i . o_i
template <typename T, int D>
__global__ void __launch_bounds__(128) attention_bwd_delta_kernel(const AttentionParams p) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int b = blockIdx.z, h = blockIdx.y, i = blockIdx.x * 4 + w;
  const Seq sq = seq_of(p, b);
  if (i >= sq.len) return;
  const T* o = static_cast<const T*>(p.out) + b * p.so.batch + (sq.start + i) * p.so.row + h * p.so.head;
  const T* d = static_cast<const T*>(p.dout) + b * p.sdo.batch + (sq.start + i) * p.sdo.row + h * p.sdo.head;
  float s = 0.f;
  for (int c = lane; c < D; c += 32) s += to_f(o[c]) * to_f(d[c]);
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
  static constexpr int pd = align128(f + 4LL * cmax(2 * BN * LDF, BN * LDO));
  static constexpr int ds = align128(pd + 1LL * BN * LDP * sizeof(T));
  static constexpr int lse = align128(ds + 1LL * BN * LDP * sizeof(T));
  static constexpr int delta = align128(lse + 4LL * BM);
  static constexpr int kvalid = align128(delta + 4LL * BM);
  static constexpr int bytes = align128(kvalid + 4LL * BN);
};

template <typename T, int D, int BN, int BM>
__global__ void __launch_bounds__(BN / 16 * 32) attention_bwd_dkdv_kernel(const AttentionParams p) {
  using L = KvSmem<T, D, BN, BM>;
  constexpr int NT = BN / 16 * 32;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Ks = reinterpret_cast<T*>(smem + L::k);        // [BN, LDT]
  T* Vs = reinterpret_cast<T*>(smem + L::v);        // [BN, LDT]
  T* Qs = reinterpret_cast<T*>(smem + L::q);        // [BM, LDT]
  T* dOs = reinterpret_cast<T*>(smem + L::dO);      // [BM, LDT]
  float* F = reinterpret_cast<float*>(smem + L::f); // S^T [BN, LDF] then dP^T [BN, LDF]; staging [BN, LDO]
  T* PdT = reinterpret_cast<T*>(smem + L::pd);      // [BN, LDP] dropped-out probabilities, transposed
  T* dST = reinterpret_cast<T*>(smem + L::ds);      // [BN, LDP] dS^T
  float* lse_s = reinterpret_cast<float*>(smem + L::lse);      // [BM] lse in log2 units (+inf: no row)
  float* delta_s = reinterpret_cast<float*>(smem + L::delta);  // [BM]
  int* kvalid = reinterpret_cast<int*>(smem + L::kvalid);      // [BN]

  const int b = blockIdx.z, h = blockIdx.y, n0 = blockIdx.x * BN;
  const Seq sq = seq_of(p, b);
  if (n0 >= sq.len) return;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;

  const T* k = static_cast<const T*>(p.k) + b * p.sk.batch + (sq.start + n0) * p.sk.row + h * p.sk.head;
  const T* v = static_cast<const T*>(p.v) + b * p.sv.batch + (sq.start + n0) * p.sv.row + h * p.sv.head;
  load_tile<T, BN, D, L::LDT, NT>(Ks, k, p.sk.row, sq.len - n0);
  load_tile<T, BN, D, L::LDT, NT>(Vs, v, p.sv.row, sq.len - n0);
  for (int j = threadIdx.x; j < BN; j += NT) kvalid[j] = key_valid(p, b, n0 + j, sq.len);

  float* STw = F + 16 * w * L::LDF;
  float* dPTw = F + BN * L::LDF + 16 * w * L::LDF;
  T* PdTw = PdT + 16 * w * L::LDP;
  T* dSTw = dST + 16 * w * L::LDP;
  WarpAcc<T, D> dk, dv;
  dk.init(STw);
  dv.init(STw);

  const T* qb = static_cast<const T*>(p.q) + b * p.sq.batch + sq.start * p.sq.row + h * p.sq.head;
  const T* dob = static_cast<const T*>(p.dout) + b * p.sdo.batch + sq.start * p.sdo.row + h * p.sdo.head;
  const float* lse_b = p.lse + b * p.lse_batch + h * p.lse_head + sq.start;
  const float* delta_b = p.delta + b * p.lse_batch + h * p.lse_head + sq.start;
  const float scale2 = p.softmax_scale * kLog2e;
  const bool dropout = p.dropout_p > 0.f;
  const uint64_t seed = dropout ? static_cast<uint64_t>(*p.seed) : 0;
  const float rdrop = 1.f / (1.f - p.dropout_p);
  const uint64_t drow0 = static_cast<uint64_t>(b * p.heads + h) * p.max_seqlen;
  // Elementwise map: lane handles keys 4 jg .. 4 jg + 3 (warp-local) of queries ic + 8 t, so one
  // Philox draw covers four consecutive keys of one query (the RNG's column groups).
  const int jg = lane >> 3, ic = lane & 7;
  const uint32_t colgroup = static_cast<uint32_t>((n0 + 16 * w + 4 * jg) >> 2);

  for (int m0 = 0; m0 < sq.len; m0 += BM) {
    __syncthreads();  // every warp is done with the previous Q, dO, lse, delta
    load_tile<T, BM, D, L::LDT, NT>(Qs, qb + m0 * p.sq.row, p.sq.row, sq.len - m0);
    load_tile<T, BM, D, L::LDT, NT>(dOs, dob + m0 * p.sdo.row, p.sdo.row, sq.len - m0);
    for (int i = threadIdx.x; i < BM; i += NT) {
      const bool ok = m0 + i < sq.len;
      lse_s[i] = ok ? lse_b[m0 + i] * kLog2e : kInf;
      delta_s[i] = ok ? delta_b[m0 + i] : 0.f;
    }
    __syncthreads();

    warp_gemm_nt<T, BM, D>(Ks + 16 * w * L::LDT, L::LDT, Qs, L::LDT, STw, L::LDF);   // S^T = K Q^T
    warp_gemm_nt<T, BM, D>(Vs + 16 * w * L::LDT, L::LDT, dOs, L::LDT, dPTw, L::LDF); // dPd^T = V dO^T
    __syncwarp();

#pragma unroll
    for (int t = 0; t < BM / 8; ++t) {
      const int i = ic + 8 * t;
      const float l2 = lse_s[i], dl = delta_s[i];
      U4 bits{0u, 0u, 0u, 0u};
      if (dropout) bits = dropout_bits(seed, drow0 + m0 + i, colgroup);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int jl = 4 * jg + e;
        const float pv = kvalid[16 * w + jl] ? exp2f(STw[jl * L::LDF + i] * scale2 - l2) : 0.f;
        const bool keep = !dropout || uniform01(pick(bits, e)) >= p.dropout_p;
        const float pd = keep ? pv * rdrop : 0.f;
        const float dpv = keep ? dPTw[jl * L::LDF + i] * rdrop : 0.f;
        PdTw[jl * L::LDP + i] = from_f<T>(pd);
        dSTw[jl * L::LDP + i] = from_f<T>(pv * (dpv - dl));
      }
    }
    __syncwarp();
    dv.template mma<BM>(PdTw, L::LDP, dOs, L::LDT);  // dV += Pd^T dO
    dk.template mma<BM>(dSTw, L::LDP, Qs, L::LDT);   // dK += dS^T Q
  }
  dk.scale(p.softmax_scale);

  __syncthreads();  // the staging rows overlap other warps' S^T / dP^T rows
  float* Ow = F + 16 * w * L::LDO;
  const int r = lane >> 1, half = lane & 1;
  const int kj = n0 + 16 * w + r;
  dv.store(Ow, L::LDO);
  __syncwarp();
  if (kj < sq.len) {
    write_row<T, D>(static_cast<T*>(p.dv) + b * p.sdv.batch + (sq.start + kj) * p.sdv.row + h * p.sdv.head, Ow,
                    L::LDO, r, half, 1.f);
  }
  __syncwarp();
  dk.store(Ow, L::LDO);
  __syncwarp();
  if (kj < sq.len) {
    write_row<T, D>(static_cast<T*>(p.dk) + b * p.sdk.batch + (sq.start + kj) * p.sdk.row + h * p.sdk.head, Ow,
                    L::LDO, r, half, 1.f);
  }
}

// ------------------------------------------------------------------ backward: dQ
template <typename T, int D, int BM, int BN>
struct DqSmem {
  static constexpr int LDT = D + kPadT<T>;         // Q, dO, K, V rows
  static constexpr int LDS = cmax(BN, D) + kPadF;  // S rows; stages dQ at the end
  static constexpr int LDD = BN + kPadF;           // dP rows
  static constexpr int LDP = BN + kPadT<T>;        // dS rows
  static constexpr int q = 0;
  static constexpr int dO = align128(q + 1LL * BM * LDT * sizeof(T));
  static constexpr int k = align128(dO + 1LL * BM * LDT * sizeof(T));
  static constexpr int v = align128(k + 1LL * BN * LDT * sizeof(T));
  static constexpr int s = align128(v + 1LL * BN * LDT * sizeof(T));
  static constexpr int dp = align128(s + 4LL * BM * LDS);
  static constexpr int ds = align128(dp + 4LL * BM * LDD);
  static constexpr int kvalid = align128(ds + 1LL * BM * LDP * sizeof(T));
  static constexpr int bytes = align128(kvalid + 4LL * BN);
};

template <typename T, int D, int BM, int BN>
__global__ void __launch_bounds__(BM / 16 * 32) attention_bwd_dq_kernel(const AttentionParams p) {
  using L = DqSmem<T, D, BM, BN>;
  constexpr int NT = BM / 16 * 32;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem + L::q);          // [BM, LDT]
  T* dOs = reinterpret_cast<T*>(smem + L::dO);        // [BM, LDT]
  T* Ks = reinterpret_cast<T*>(smem + L::k);          // [BN, LDT]
  T* Vs = reinterpret_cast<T*>(smem + L::v);          // [BN, LDT]
  float* Ss = reinterpret_cast<float*>(smem + L::s);  // [BM, LDS] scores; dQ staging at the end
  float* dPs = reinterpret_cast<float*>(smem + L::dp);  // [BM, LDD]
  T* dSs = reinterpret_cast<T*>(smem + L::ds);        // [BM, LDP]
  int* kvalid = reinterpret_cast<int*>(smem + L::kvalid);  // [BN]

  const int b = blockIdx.z, h = blockIdx.y, m0 = blockIdx.x * BM;
  const Seq sq = seq_of(p, b);
  if (m0 >= sq.len) return;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = lane >> 1, half = lane & 1;
  const int qi = m0 + 16 * w + r;

  const T* q = static_cast<const T*>(p.q) + b * p.sq.batch + (sq.start + m0) * p.sq.row + h * p.sq.head;
  const T* dout = static_cast<const T*>(p.dout) + b * p.sdo.batch + (sq.start + m0) * p.sdo.row + h * p.sdo.head;
  load_tile<T, BM, D, L::LDT, NT>(Qs, q, p.sq.row, sq.len - m0);
  load_tile<T, BM, D, L::LDT, NT>(dOs, dout, p.sdo.row, sq.len - m0);
  const int64_t stat = b * p.lse_batch + h * p.lse_head + sq.start + qi;
  const float l2 = qi < sq.len ? p.lse[stat] * kLog2e : kInf;
  const float dl = qi < sq.len ? p.delta[stat] : 0.f;

  float* Sw = Ss + 16 * w * L::LDS;
  float* dPw = dPs + 16 * w * L::LDD;
  T* dSw = dSs + 16 * w * L::LDP;
  WarpAcc<T, D> dq;
  dq.init(Sw);

  const T* kb = static_cast<const T*>(p.k) + b * p.sk.batch + sq.start * p.sk.row + h * p.sk.head;
  const T* vb = static_cast<const T*>(p.v) + b * p.sv.batch + sq.start * p.sv.row + h * p.sv.head;
  const float scale2 = p.softmax_scale * kLog2e;
  const bool dropout = p.dropout_p > 0.f;
  const uint64_t seed = dropout ? static_cast<uint64_t>(*p.seed) : 0;
  const float rdrop = 1.f / (1.f - p.dropout_p);
  const uint64_t drow = static_cast<uint64_t>(b * p.heads + h) * p.max_seqlen + qi;

  for (int n0 = 0; n0 < sq.len; n0 += BN) {
    __syncthreads();
    load_tile<T, BN, D, L::LDT, NT>(Ks, kb + n0 * p.sk.row, p.sk.row, sq.len - n0);
    load_tile<T, BN, D, L::LDT, NT>(Vs, vb + n0 * p.sv.row, p.sv.row, sq.len - n0);
    for (int j = threadIdx.x; j < BN; j += NT) kvalid[j] = key_valid(p, b, n0 + j, sq.len);
    __syncthreads();

    warp_gemm_nt<T, BN, D>(Qs + 16 * w * L::LDT, L::LDT, Ks, L::LDT, Sw, L::LDS);    // S = Q K^T
    warp_gemm_nt<T, BN, D>(dOs + 16 * w * L::LDT, L::LDT, Vs, L::LDT, dPw, L::LDD);  // dPd = dO V^T
    __syncwarp();

    constexpr int G = BN / 8;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      U4 bits{0u, 0u, 0u, 0u};
      if (dropout) bits = dropout_bits(seed, drow, static_cast<uint32_t>((n0 >> 2) + half + 2 * g));
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = 4 * (half + 2 * g) + e;
        const float pv = kvalid[c] ? exp2f(Sw[r * L::LDS + c] * scale2 - l2) : 0.f;
        const bool keep = !dropout || uniform01(pick(bits, e)) >= p.dropout_p;
        const float dpv = keep ? dPw[r * L::LDD + c] * rdrop : 0.f;
        dSw[r * L::LDP + c] = from_f<T>(pv * (dpv - dl));
      }
    }
    __syncwarp();
    dq.template mma<BN>(dSw, L::LDP, Ks, L::LDT);  // dQ += dS K
  }
  dq.scale(p.softmax_scale);
  __syncwarp();
  dq.store(Sw, L::LDS);
  __syncwarp();
  if (qi < sq.len) {
    write_row<T, D>(static_cast<T*>(p.dq) + b * p.sdq.batch + (sq.start + qi) * p.sdq.row + h * p.sdq.head, Sw,
                    L::LDS, r, half, 1.f);
  }
}

}  // namespace attn
}  // namespace bertfast
