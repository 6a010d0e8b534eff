// LayerNorm over rows, shared by the row ops that end with one (bias_dropout_residual_layernorm.cu)
// or start with one (embeddings.cu); the op-specific parts come in as callbacks.
//
// Layout: each thread owns VEC consecutive columns at a stride of blockDim.x * VEC, so per-column
// shared-memory state (the row buffer, the gradient partial sums) needs no atomics or barriers.
#pragma once
#include "common.cuh"

namespace bertfast {

// Threads per row: one vector each up to 256 threads, a multiple of 32.
inline int layernorm_threads(int64_t h, int vec) {
  int64_t t = (h / vec + 31) / 32 * 32;
  if (t < 32) t = 32;
  if (t > 256) t = 256;
  return static_cast<int>(t);
}

// Forward of one row, statistics in fp32 (two passes over row_buf [h], which keeps the input):
// load(c, v) gives the input at columns c .. c+VEC-1, emit(c, out) takes
// (v - mean) * rstd * w + b there. Returns {mean, rstd}.
template <typename P, int VEC, typename Load, typename Emit>
__device__ __forceinline__ float2 layernorm_fwd_row(float* row_buf, int64_t h, float eps, const P* w,
                                                   const P* b, float2* red, Load load, Emit emit) {
  const int64_t step = static_cast<int64_t>(blockDim.x) * VEC;
  float sum = 0.f;
  for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
    float v[VEC];
    load(c, v);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      row_buf[c + i] = v[i];
      sum += v[i];
    }
  }
  const float mean = block_sum(sum, red) / static_cast<float>(h);
  float sq = 0.f;
  for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float d = row_buf[c + i] - mean;
      sq += d * d;
    }
  }
  const float var = block_sum(sq, red) / static_cast<float>(h);
  const float rstd = 1.f / sqrtf(var + eps);
  for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
    float wv[VEC], bv[VEC], out[VEC];
    load_f<P, VEC>(w + c, wv);
    load_f<P, VEC>(b + c, bv);
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = (row_buf[c + i] - mean) * rstd * wv[i] + bv[i];
    emit(c, out);
  }
  return make_float2(mean, rstd);
}

// The backward's rows [begin, end) for this block: n rows in equal chunks over the grid.
struct RowRange {
  int64_t begin, end;
};
__device__ __forceinline__ RowRange block_rows(int64_t n) {
  const int64_t per_block = (n + gridDim.x - 1) / gridDim.x;
  const int64_t r0 = blockIdx.x * per_block;
  return RowRange{r0, r0 + per_block < n ? r0 + per_block : n};
}

// acc [rows, h]: this thread's columns set to 0 / copied to out [rows, h].
template <int VEC>
__device__ __forceinline__ void zero_columns(float* acc, int64_t rows, int64_t h) {
  const int64_t step = static_cast<int64_t>(blockDim.x) * VEC;
  for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
    for (int64_t j = 0; j < rows; ++j) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[j * h + c + i] = 0.f;
    }
  }
}
template <int VEC>
__device__ __forceinline__ void copy_columns(float* out, const float* acc, int64_t rows, int64_t h) {
  const int64_t step = static_cast<int64_t>(blockDim.x) * VEC;
  for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
    for (int64_t j = 0; j < rows; ++j) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) out[j * h + c + i] = acc[j * h + c + i];
    }
  }
}

// Backward of one row, with xhat = (x - mean) * rstd and g = dz * w:
//   acc_w += dz * xhat, acc_b += dz   (this block's partial sums of dweight / dbias)
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
// load(c, dz, x) gives dz (the gradient of the output) and the input x at columns c .. c+VEC-1;
// it runs twice per column (re-reading beats holding the row), so it must give the same values.
// emit(c, dx) takes dx there.
template <typename P, int VEC, typename Load, typename Emit>
__device__ __forceinline__ void layernorm_bwd_row(int64_t h, float mean, float rstd, const P* w, float* acc_w,
                                                  float* acc_b, float2* red, Load load, Emit emit) {
  const int64_t step = static_cast<int64_t>(blockDim.x) * VEC;
  float2 s = make_float2(0.f, 0.f);  // sum g, sum g * xhat
  for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
    float dz[VEC], xh[VEC], wv[VEC];
    load(c, dz, xh);
    load_f<P, VEC>(w + c, wv);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      xh[i] = (xh[i] - mean) * rstd;
      acc_w[c + i] += dz[i] * xh[i];
      acc_b[c + i] += dz[i];
      const float g = dz[i] * wv[i];
      s.x += g;
      s.y += g * xh[i];
    }
  }
  s = block_sum2(s, red);
  const float inv_h = 1.f / static_cast<float>(h);
  const float mg = s.x * inv_h, mgx = s.y * inv_h;
  for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
    float dz[VEC], xh[VEC], wv[VEC];
    load(c, dz, xh);
    load_f<P, VEC>(w + c, wv);
#pragma unroll
    for (int i = 0; i < VEC; ++i) dz[i] = rstd * (dz[i] * wv[i] - mg - (xh[i] - mean) * rstd * mgx);
    emit(c, dz);
  }
}

}  // namespace bertfast
