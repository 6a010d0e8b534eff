// Device helpers shared by the bertfast kernels: dtype conversion, aligned vector access,
// the Philox4x32 dropout RNG, warp/block reductions, and launcher error plumbing.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "bertfast.h"

namespace bertfast {

// ------------------------------------------------------------------ errors (status.cu)
int fail(int status, const char* fmt, ...);          // records a message, returns status
int fail_cuda(const char* where, cudaError_t err);  // records "where: cuda message", returns err
void clear_error();
// After a launch: a bad configuration shows up here (execution errors surface later).
#define BF_CHECK_LAUNCH(where)                                     \
  do {                                                             \
    cudaError_t bf_err_ = cudaGetLastError();                      \
    if (bf_err_ != cudaSuccess) return ::bertfast::fail_cuda(where, bf_err_); \
  } while (0)
// Opt a kernel in to more than 48 KiB of dynamic shared memory.
template <typename Kernel>
inline cudaError_t allow_smem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

constexpr float kInf = INFINITY;

// ------------------------------------------------------------------ dtype conversion
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// ------------------------------------------------------------------ aligned vectors
// N consecutive elements moved as one access of N * sizeof(T) bytes (16 bytes = 128-bit).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};
template <typename T, int N>
__device__ __forceinline__ void load_f(const T* p, float (&out)[N]) {
  const Vec<T, N> t = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_f(t.v[i]);
}
template <typename T, int N>
__device__ __forceinline__ void store_f(T* p, const float (&in)[N]) {
  Vec<T, N> t;
#pragma unroll
  for (int i = 0; i < N; ++i) t.v[i] = from_f<T>(in[i]);
  *reinterpret_cast<Vec<T, N>*>(p) = t;
}
// Round through T and back (the value a stored-then-reloaded activation has).
template <typename T>
__device__ __forceinline__ float round_to(float x) { return to_f(from_f<T>(x)); }

inline bool aligned_to(const void* p, int bytes) {
  return p == nullptr || (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

// ------------------------------------------------------------------ Philox4x32
// Counter-based RNG (Salmon et al., SC'11): R rounds of multiply/xor on a 128-bit counter under a
// 64-bit key that is bumped by the Weyl constants after every round. The row ops draw 10 rounds;
// attention draws 7, as the Triton kernel does (attention.cuh).
struct U4 {
  uint32_t x, y, z, w;
};
__host__ __device__ __forceinline__ uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
#ifdef __CUDA_ARCH__
  *hi = __umulhi(a, b);
  return a * b;
#else
  const uint64_t prod = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(prod >> 32);
  return static_cast<uint32_t>(prod);
#endif
}
template <int R>
__host__ __device__ __forceinline__ U4 philox4x32(U4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int round = 0; round < R; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo32(0xD2511F53u, c.x, &hi0);
    const uint32_t lo1 = mulhilo32(0xCD9E8D57u, c.z, &hi1);
    c = U4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}
__host__ __device__ __forceinline__ U4 philox4x32_10(U4 c, uint32_t k0, uint32_t k1) {
  return philox4x32<10>(c, k0, k1);
}
// The four random words for columns 4*colgroup .. 4*colgroup+3 of logical row `row`.
// Every dropout site of bertfast draws keep(row, col) = uniform(dropout_bits(row, col/4)[col%4]) >= p.
__device__ __forceinline__ U4 dropout_bits(uint64_t seed, uint64_t row, uint32_t colgroup) {
  return philox4x32_10(U4{colgroup, static_cast<uint32_t>(row), static_cast<uint32_t>(row >> 32), 0u},
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}
__device__ __forceinline__ uint32_t pick(const U4& r, int i) {
  return i == 0 ? r.x : (i == 1 ? r.y : (i == 2 ? r.z : r.w));
}
// Uniform in [0, 1) from the top 24 bits (exact in fp32).
__device__ __forceinline__ float uniform01(uint32_t r) {
  return static_cast<float>(r >> 8) * (1.0f / 16777216.0f);
}
__device__ __forceinline__ bool keep_scalar(uint64_t seed, uint64_t row, int64_t col, float p) {
  return uniform01(pick(dropout_bits(seed, row, static_cast<uint32_t>(col >> 2)), col & 3)) >= p;
}
// keep[0..N) for columns col .. col+N-1 of `row` (col % 4 == 0 when N % 4 == 0).
template <int N>
__device__ __forceinline__ void keep_vec(uint64_t seed, uint64_t row, int64_t col, float p,
                                         bool (&keep)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int g = 0; g < N / 4; ++g) {
      const U4 r = dropout_bits(seed, row, static_cast<uint32_t>((col >> 2) + g));
      keep[4 * g + 0] = uniform01(r.x) >= p;
      keep[4 * g + 1] = uniform01(r.y) >= p;
      keep[4 * g + 2] = uniform01(r.z) >= p;
      keep[4 * g + 3] = uniform01(r.w) >= p;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) keep[i] = keep_scalar(seed, row, col + i, p);
  }
}
// A row op's dropout at rate p (the seed is only read, and needed, when p > 0).
struct RowDropout {
  bool on;
  uint64_t seed;
  float p, scale;
  __device__ __forceinline__ RowDropout(float p_, const int64_t* seed_ptr)
      : on(p_ > 0.f), seed(on ? static_cast<uint64_t>(*seed_ptr) : 0), p(p_),
        scale(on ? 1.f / (1.f - p_) : 1.f) {}
  // v[i] = keep ? v[i] * scale : 0 at columns col .. col+N-1 of `row`; keep_row (the row's
  // debug mask, or null) gets the mask, all true when off.
  template <int N>
  __device__ __forceinline__ void apply(uint64_t row, int64_t col, float (&v)[N], bool* keep_row = nullptr) const {
    if (on) {
      bool k[N];
      keep_vec<N>(seed, row, col, p, k);
#pragma unroll
      for (int i = 0; i < N; ++i) v[i] = k[i] ? v[i] * scale : 0.f;
      if (keep_row) {
#pragma unroll
        for (int i = 0; i < N; ++i) keep_row[col + i] = k[i];
      }
    } else if (keep_row) {
#pragma unroll
      for (int i = 0; i < N; ++i) keep_row[col + i] = true;
    }
  }
};

// ------------------------------------------------------------------ reductions
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
// red: __shared__ float2[33]. Safe to call repeatedly with the same buffer.
__device__ __forceinline__ float2 block_sum2(float2 v, float2* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v.x = warp_sum(v.x);
  v.y = warp_sum(v.y);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float2 t = lane < nwarps ? red[lane] : make_float2(0.f, 0.f);
    t.x = warp_sum(t.x);
    t.y = warp_sum(t.y);
    if (lane == 0) red[32] = t;
  }
  __syncthreads();
  return red[32];
}
__device__ __forceinline__ float block_sum(float v, float2* red) {
  return block_sum2(make_float2(v, 0.f), red).x;
}

// Column sums of fp32 partials: out[c] = sum_r ws[(r * n_stacked + which) * h + c] (column_sum.cu).
int launch_column_sum(const float* ws, int64_t rows, int n_stacked, int which, int64_t h,
                      void* out, int out_dtype, cudaStream_t stream);

// Dispatch a runtime dtype code onto a C++ type: BF_DISPATCH_T(code, T, ...) runs ... with T.
#define BF_DISPATCH_T(code, T, ...)                     \
  switch (code) {                                      \
    case ::bertfast::kFloat32: {                       \
      using T = float;                                 \
      __VA_ARGS__;                                     \
    } break;                                           \
    case ::bertfast::kFloat16: {                       \
      using T = __half;                                \
      __VA_ARGS__;                                     \
    } break;                                           \
    case ::bertfast::kBFloat16: {                      \
      using T = __nv_bfloat16;                         \
      __VA_ARGS__;                                     \
    } break;                                           \
    default:                                           \
      return ::bertfast::fail(::bertfast::kErrArgument, "unknown dtype code %d", (int)(code)); \
  }

// Activation dtype T with parameter dtype P in {T, float32}.
#define BF_DISPATCH_TP(act, param, T, P, ...)                                          \
  BF_DISPATCH_T(act, T,                                                                \
                if ((param) == (act)) {                                                \
                  using P = T;                                                         \
                  __VA_ARGS__;                                                         \
                } else if ((param) == ::bertfast::kFloat32) {                          \
                  using P = float;                                                     \
                  __VA_ARGS__;                                                         \
                } else {                                                               \
                  return ::bertfast::fail(::bertfast::kErrArgument,                    \
                                          "parameter dtype code %d must equal the "    \
                                          "activation dtype code %d or be float32 (0)", \
                                          (int)(param), (int)(act));                   \
                })

// Vector width (elements) for a row op touching dtypes A and B: 16 bytes of the wider one.
template <typename A, typename B>
constexpr int vec_width() {
  return 16 / (sizeof(A) > sizeof(B) ? sizeof(A) : sizeof(B));
}

}  // namespace bertfast
