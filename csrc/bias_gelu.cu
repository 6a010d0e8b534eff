// bias + GELU, forward and backward.
//
//   forward:  h = x + bias,  y = gelu(h)
//     exact: gelu(h) = h * Phi(h) = 0.5 h (1 + erf(h / sqrt 2))
//     tanh:  gelu(h) = 0.5 h (1 + tanh(u)),  u = sqrt(2/pi) (h + 0.044715 h^3)
//   backward: dx = dy * gelu'(h),  dbias = sum_rows dx
//     exact: gelu'(h) = Phi(h) + h * phi(h),  phi(h) = exp(-h^2 / 2) / sqrt(2 pi)
//     tanh:  gelu'(h) = 0.5 (1 + t) + 0.5 h (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 h^2),  t = tanh(u)
//
// Layout: each thread owns VEC consecutive columns (one 128-bit access when the row length,
// row strides and pointers allow, else VEC = 1) and walks rows blockIdx.y, +gridDim.y, ...
// so the bias slice is loaded once. dbias: each (column, blockIdx.y) keeps an fp32 partial in
// the workspace [gridDim.y, F]; column_sum.cu adds them (no atomics, deterministic).
// Math in fp32 with precise erff/tanhf/expf (the module is built without --use_fast_math).
#include "common.cuh"

namespace bertfast {
namespace {

constexpr int kThreads = 128;
constexpr float kSqrtHalf = 0.70710678118654752f;   // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143268f; // 1 / sqrt(2 pi)
constexpr float kSqrt2OverPi = 0.79788456080286536f;
constexpr float kTanhCoef = 0.044715f;

__device__ __forceinline__ float gelu(float h, bool tanh_form) {
  if (tanh_form) return 0.5f * h * (1.f + tanhf(kSqrt2OverPi * (h + kTanhCoef * h * h * h)));
  return 0.5f * h * (1.f + erff(h * kSqrtHalf));
}

__device__ __forceinline__ float gelu_grad(float h, bool tanh_form) {
  if (tanh_form) {
    const float h2 = h * h;
    const float t = tanhf(kSqrt2OverPi * (h + kTanhCoef * h * h2));
    return 0.5f * (1.f + t) + 0.5f * h * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kTanhCoef * h2);
  }
  return 0.5f * (1.f + erff(h * kSqrtHalf)) + h * kInvSqrt2Pi * expf(-0.5f * h * h);
}

template <typename T, typename P, int VEC>
__global__ void __launch_bounds__(kThreads)
bias_gelu_fwd_kernel(const T* __restrict__ x,     // [n, f], row stride xs
                     int64_t xs,
                     const P* __restrict__ bias,  // [f]
                     T* __restrict__ y,           // [n, f] contiguous
                     int64_t n, int64_t f, bool tanh_form) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (c >= f) return;
  float b[VEC];
  load_f<P, VEC>(bias + c, b);
  for (int64_t row = blockIdx.y; row < n; row += gridDim.y) {
    float v[VEC];
    load_f<T, VEC>(x + row * xs + c, v);
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = gelu(v[i] + b[i], tanh_form);
    store_f<T, VEC>(y + row * f + c, v);
  }
}

template <typename T, typename P, int VEC>
__global__ void __launch_bounds__(kThreads)
bias_gelu_bwd_kernel(const T* __restrict__ dy,    // [n, f], row stride dys
                     int64_t dys,
                     const T* __restrict__ x,     // [n, f], row stride xs
                     int64_t xs,
                     const P* __restrict__ bias,  // [f]
                     T* __restrict__ dx,          // [n, f] contiguous
                     float* __restrict__ ws,      // [gridDim.y, f] fp32 partial dbias
                     int64_t n, int64_t f, bool tanh_form) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (c >= f) return;
  float b[VEC], acc[VEC];
  load_f<P, VEC>(bias + c, b);
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
  for (int64_t row = blockIdx.y; row < n; row += gridDim.y) {
    float g[VEC], v[VEC];
    load_f<T, VEC>(dy + row * dys + c, g);
    load_f<T, VEC>(x + row * xs + c, v);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      v[i] = g[i] * gelu_grad(v[i] + b[i], tanh_form);
      acc[i] += v[i];
    }
    store_f<T, VEC>(dx + row * f + c, v);
  }
  float* out = ws + static_cast<int64_t>(blockIdx.y) * f + c;
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = acc[i];
}

template <int VEC>
dim3 grid_for(int64_t n, int64_t f, int64_t rows) {
  const int64_t col_blocks = (f / VEC + kThreads - 1) / kThreads;
  return dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(rows));
}

// Rows of blocks for the forward: about 2048 blocks in all, at most one block row per row.
int64_t fwd_rows(int64_t n, int64_t col_blocks) {
  int64_t rows = (2048 + col_blocks - 1) / col_blocks;
  if (rows > n) rows = n;
  if (rows > 65535) rows = 65535;
  return rows < 1 ? 1 : rows;
}

template <typename T, typename P>
int run_fwd(const void* x, int64_t xs, const void* bias, void* y, int64_t n, int64_t f, bool tanh_form,
            cudaStream_t stream) {
  constexpr int V = vec_width<T, P>();
  const bool vec = f % V == 0 && xs % V == 0 && aligned_to(x, 16) && aligned_to(y, 16) &&
                   aligned_to(bias, V * sizeof(P));
  if (vec) {
    const int64_t cb = (f / V + kThreads - 1) / kThreads;
    bias_gelu_fwd_kernel<T, P, V><<<grid_for<V>(n, f, fwd_rows(n, cb)), kThreads, 0, stream>>>(
        static_cast<const T*>(x), xs, static_cast<const P*>(bias), static_cast<T*>(y), n, f, tanh_form);
  } else {
    const int64_t cb = (f + kThreads - 1) / kThreads;
    bias_gelu_fwd_kernel<T, P, 1><<<grid_for<1>(n, f, fwd_rows(n, cb)), kThreads, 0, stream>>>(
        static_cast<const T*>(x), xs, static_cast<const P*>(bias), static_cast<T*>(y), n, f, tanh_form);
  }
  BF_CHECK_LAUNCH("bias_gelu_fwd");
  return kOk;
}

template <typename T, typename P>
int run_bwd(const void* dy, int64_t dys, const void* x, int64_t xs, const void* bias, void* dx,
            float* ws, int64_t n, int64_t f, bool tanh_form, int param_dtype, void* dbias,
            cudaStream_t stream) {
  constexpr int V = vec_width<T, P>();
  const int64_t rows = reduction_blocks(n);
  const bool vec = f % V == 0 && xs % V == 0 && dys % V == 0 && aligned_to(x, 16) &&
                   aligned_to(dy, 16) && aligned_to(dx, 16) && aligned_to(bias, V * sizeof(P)) &&
                   aligned_to(ws, 16);
  if (vec) {
    bias_gelu_bwd_kernel<T, P, V><<<grid_for<V>(n, f, rows), kThreads, 0, stream>>>(
        static_cast<const T*>(dy), dys, static_cast<const T*>(x), xs, static_cast<const P*>(bias),
        static_cast<T*>(dx), ws, n, f, tanh_form);
  } else {
    bias_gelu_bwd_kernel<T, P, 1><<<grid_for<1>(n, f, rows), kThreads, 0, stream>>>(
        static_cast<const T*>(dy), dys, static_cast<const T*>(x), xs, static_cast<const P*>(bias),
        static_cast<T*>(dx), ws, n, f, tanh_form);
  }
  BF_CHECK_LAUNCH("bias_gelu_bwd");
  return launch_column_sum(ws, rows, 1, 0, f, dbias, param_dtype, stream);
}

int check_common(int64_t n, int64_t f, int approximate) {
  if (n < 0 || f <= 0) return fail(kErrArgument, "bias_gelu: expected n >= 0 and f > 0, got n=%lld f=%lld",
                                   (long long)n, (long long)f);
  if (approximate != 0 && approximate != 1)
    return fail(kErrArgument, "bias_gelu: approximate must be 0 (none) or 1 (tanh), got %d", approximate);
  if (f > (int64_t)65535 * kThreads * 8)
    return fail(kErrArgument, "bias_gelu: f=%lld too large", (long long)f);
  return kOk;
}

}  // namespace

int bias_gelu_fwd(const void* x, int64_t x_row_stride, const void* bias, void* y, int64_t n, int64_t f,
                  int act_dtype, int param_dtype, int approximate, cudaStream_t stream) {
  clear_error();
  if (int s = check_common(n, f, approximate)) return s;
  if (n == 0) return kOk;
  BF_DISPATCH_TP(act_dtype, param_dtype, T, P,
                 return run_fwd<T, P>(x, x_row_stride, bias, y, n, f, approximate == 1, stream));
  return kOk;
}

int bias_gelu_bwd(const void* dy, int64_t dy_row_stride, const void* x, int64_t x_row_stride,
                  const void* bias, void* dx, void* dbias, float* workspace, int64_t n, int64_t f,
                  int act_dtype, int param_dtype, int approximate, cudaStream_t stream) {
  clear_error();
  if (int s = check_common(n, f, approximate)) return s;
  if (n == 0) {  // dbias of an empty batch is zero
    if (cudaError_t e = cudaMemsetAsync(dbias, 0, f * (param_dtype == kFloat32 ? 4 : 2), stream))
      return fail_cuda("bias_gelu_bwd", e);
    return kOk;
  }
  BF_DISPATCH_TP(act_dtype, param_dtype, T, P,
                 return run_bwd<T, P>(dy, dy_row_stride, x, x_row_stride, bias, dx, workspace, n, f,
                                      approximate == 1, param_dtype, dbias, stream));
  return kOk;
}

}  // namespace bertfast
