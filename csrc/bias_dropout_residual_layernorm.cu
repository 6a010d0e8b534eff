// bias + dropout + residual + LayerNorm, forward and backward.
//
//   forward (per row, H columns, statistics in fp32):
//     pre  = residual + Dropout(x + bias)          stored in the activation dtype (saved for bwd)
//     mean = sum(pre) / H,  var = sum((pre - mean)^2) / H  (two passes), rstd = 1 / sqrt(var + eps)
//     y    = (pre - mean) * rstd * weight + ln_bias
//   backward, with xhat = (pre - mean) * rstd, g = dy * weight:
//     dpre      = rstd * (g - mean(g) - xhat * mean(g * xhat))
//     dresidual = dpre,  dx = keep * dpre / (1 - p),  dbias = sum_rows dx
//     dweight   = sum_rows dy * xhat,  dln_bias = sum_rows dy
//   The statistics are taken over the rounded pre (what the backward reads back), so the
//   backward is the exact derivative of what the forward computed.
//
// Forward: one block per row; each thread owns VEC consecutive columns at a stride of
// blockDim * VEC (128-bit accesses when H, the row strides and pointers allow; else VEC = 1) and
// keeps its fp32 pre values in shared memory between passes (it only reads back its own slots).
// Backward: one block per chunk of rows; per-column fp32 partial sums of dweight / dln_bias /
// dbias live in shared memory [3, H] (each thread owns its columns: no atomics) and are written
// to the workspace [blocks, 3, H] at the end; column_sum.cu reduces them.
// Limits: H up to 8192 (shared memory 12 H bytes in the backward).
#include "layernorm.cuh"

namespace bertfast {
namespace {

constexpr int kMaxH = 8192;

struct FwdArgs {
  const void* x; int64_t xs;         // [n, h], row stride xs
  const void* bias;                  // [h] or null
  const void* residual; int64_t rs;  // [n, h] or null, row stride rs
  const void* weight;                // [h]
  const void* ln_bias;               // [h]
  void* y;                           // [n, h] contiguous
  void* pre;                         // [n, h] contiguous
  float* mean;                       // [n]
  float* rstd;                       // [n]
  bool* keep;                        // [n, h] or null: the dropout keep-mask (debug)
  int64_t n, h;
  float eps, p;
  const int64_t* seed;
};

template <typename T, typename P, int VEC>
__global__ void bias_dropout_residual_layernorm_fwd_kernel(FwdArgs a) {
  extern __shared__ float row_buf[];  // [h] fp32 pre of this row
  __shared__ float2 red[33];
  const int64_t r = blockIdx.x;
  const int64_t h = a.h;
  const T* x = static_cast<const T*>(a.x) + r * a.xs;
  const T* res = a.residual ? static_cast<const T*>(a.residual) + r * a.rs : nullptr;
  const P* bias = static_cast<const P*>(a.bias);
  T* pre = static_cast<T*>(a.pre) + r * h;
  T* y = static_cast<T*>(a.y) + r * h;
  bool* keep = a.keep ? a.keep + r * h : nullptr;
  const RowDropout drop(a.p, a.seed);

  const float2 stats = layernorm_fwd_row<P, VEC>(
      row_buf, h, a.eps, static_cast<const P*>(a.weight), static_cast<const P*>(a.ln_bias), red,
      [&](int64_t c, float (&v)[VEC]) {
        load_f<T, VEC>(x + c, v);
        if (bias) {
          float b[VEC];
          load_f<P, VEC>(bias + c, b);
#pragma unroll
          for (int i = 0; i < VEC; ++i) v[i] += b[i];
        }
        drop.apply(r, c, v, keep);
        if (res) {
          float rv[VEC];
          load_f<T, VEC>(res + c, rv);
#pragma unroll
          for (int i = 0; i < VEC; ++i) v[i] += rv[i];
        }
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[i] = round_to<T>(v[i]);  // the statistics see the stored pre
        store_f<T, VEC>(pre + c, v);
      },
      [&](int64_t c, const float (&out)[VEC]) { store_f<T, VEC>(y + c, out); });
  if (threadIdx.x == 0) {
    a.mean[r] = stats.x;
    a.rstd[r] = stats.y;
  }
}

struct BwdArgs {
  const void* dy; int64_t dys;    // [n, h], row stride dys
  const void* pre; int64_t ps;    // [n, h], row stride ps
  const float* mean;              // [n]
  const float* rstd;              // [n]
  const void* weight;             // [h]
  void* dx;                       // [n, h] contiguous
  void* dres;                     // [n, h] contiguous or null
  float* ws;                      // [gridDim.x, 3, h]: dweight, dln_bias, dbias partials
  int64_t n, h;
  float p;
  const int64_t* seed;
  bool has_bias;
};

template <typename T, typename P, int VEC>
__global__ void bias_dropout_residual_layernorm_bwd_kernel(BwdArgs a) {
  extern __shared__ float acc[];  // [3, h]: dweight, dln_bias, dbias partial sums of this block
  __shared__ float2 red[33];
  const int64_t h = a.h;
  float* acc_db = acc + 2 * h;
  zero_columns<VEC>(acc, 3, h);
  const RowRange rows = block_rows(a.n);
  const RowDropout drop(a.p, a.seed);
  const P* w = static_cast<const P*>(a.weight);

  for (int64_t r = rows.begin; r < rows.end; ++r) {
    const T* dy = static_cast<const T*>(a.dy) + r * a.dys;
    const T* pre = static_cast<const T*>(a.pre) + r * a.ps;
    T* dx = static_cast<T*>(a.dx) + r * h;
    T* dres = a.dres ? static_cast<T*>(a.dres) + r * h : nullptr;
    layernorm_bwd_row<P, VEC>(
        h, a.mean[r], a.rstd[r], w, acc, acc + h, red,
        [&](int64_t c, float (&dz)[VEC], float (&x)[VEC]) {
          load_f<T, VEC>(dy + c, dz);
          load_f<T, VEC>(pre + c, x);
        },
        [&](int64_t c, float (&d)[VEC]) {  // d: dpre, then dx
          if (dres) store_f<T, VEC>(dres + c, d);
          drop.apply(r, c, d);
          if (a.has_bias) {
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc_db[c + i] += d[i];
          }
          store_f<T, VEC>(dx + c, d);
        });
  }
  copy_columns<VEC>(a.ws + static_cast<int64_t>(blockIdx.x) * 3 * h, acc, 3, h);
}

template <typename T, typename P>
int run_fwd(const FwdArgs& a, cudaStream_t stream) {
  constexpr int V = vec_width<T, P>();
  const bool vec = a.h % V == 0 && a.xs % V == 0 && (a.residual == nullptr || a.rs % V == 0) &&
                   aligned_to(a.x, 16) && aligned_to(a.residual, 16) && aligned_to(a.y, 16) &&
                   aligned_to(a.pre, 16) && aligned_to(a.bias, V * sizeof(P)) &&
                   aligned_to(a.weight, V * sizeof(P)) && aligned_to(a.ln_bias, V * sizeof(P));
  const size_t smem = static_cast<size_t>(a.h) * sizeof(float);
  const dim3 grid(static_cast<unsigned>(a.n));
  if (vec) {
    bias_dropout_residual_layernorm_fwd_kernel<T, P, V><<<grid, layernorm_threads(a.h, V), smem, stream>>>(a);
  } else {
    bias_dropout_residual_layernorm_fwd_kernel<T, P, 1><<<grid, layernorm_threads(a.h, 1), smem, stream>>>(a);
  }
  BF_CHECK_LAUNCH("bias_dropout_residual_layernorm_fwd");
  return kOk;
}

template <typename T, typename P>
int run_bwd(const BwdArgs& a, void* dbias, void* dweight, void* dln_bias, int param_dtype,
            cudaStream_t stream) {
  constexpr int V = vec_width<T, P>();
  const bool vec = a.h % V == 0 && a.dys % V == 0 && a.ps % V == 0 && aligned_to(a.dy, 16) &&
                   aligned_to(a.pre, 16) && aligned_to(a.dx, 16) && aligned_to(a.dres, 16) &&
                   aligned_to(a.weight, V * sizeof(P));
  const size_t smem = static_cast<size_t>(3 * a.h) * sizeof(float);
  const int64_t blocks = reduction_blocks(a.n);
  if (vec) {
    if (cudaError_t e = allow_smem(bias_dropout_residual_layernorm_bwd_kernel<T, P, V>, smem)) return fail_cuda("bias_dropout_residual_layernorm_bwd", e);
    bias_dropout_residual_layernorm_bwd_kernel<T, P, V><<<static_cast<unsigned>(blocks), layernorm_threads(a.h, V), smem, stream>>>(a);
  } else {
    if (cudaError_t e = allow_smem(bias_dropout_residual_layernorm_bwd_kernel<T, P, 1>, smem)) return fail_cuda("bias_dropout_residual_layernorm_bwd", e);
    bias_dropout_residual_layernorm_bwd_kernel<T, P, 1><<<static_cast<unsigned>(blocks), layernorm_threads(a.h, 1), smem, stream>>>(a);
  }
  BF_CHECK_LAUNCH("bias_dropout_residual_layernorm_bwd");
  if (int s = launch_column_sum(a.ws, blocks, 3, 0, a.h, dweight, param_dtype, stream)) return s;
  if (int s = launch_column_sum(a.ws, blocks, 3, 1, a.h, dln_bias, param_dtype, stream)) return s;
  if (dbias) return launch_column_sum(a.ws, blocks, 3, 2, a.h, dbias, param_dtype, stream);
  return kOk;
}

int check_shape(const char* name, int64_t n, int64_t h, float p) {
  if (n < 0 || h <= 0 || h > kMaxH)
    return fail(kErrArgument, "%s: expected n >= 0 and 0 < h <= %d, got n=%lld h=%lld", name, kMaxH,
                (long long)n, (long long)h);
  if (n > 0x7fffffffLL) return fail(kErrArgument, "%s: n=%lld rows is too many", name, (long long)n);
  if (!(p >= 0.f && p < 1.f)) return fail(kErrArgument, "%s: dropout_p must be in [0, 1), got %g", name, p);
  return kOk;
}

}  // namespace

int bias_dropout_residual_layernorm_fwd(const void* x, int64_t x_row_stride, const void* bias, const void* residual,
                  int64_t residual_row_stride, const void* weight, const void* ln_bias, void* y,
                  void* pre_norm, float* mean, float* rstd, bool* keep, int64_t n, int64_t h, float eps,
                  float dropout_p, const int64_t* seed, int act_dtype, int param_dtype,
                  cudaStream_t stream) {
  clear_error();
  if (int s = check_shape("bias_dropout_residual_layernorm_fwd", n, h, dropout_p)) return s;
  if (dropout_p > 0.f && seed == nullptr) return fail(kErrArgument, "bias_dropout_residual_layernorm_fwd: dropout needs a seed");
  if (n == 0) return kOk;
  const FwdArgs a{x, x_row_stride, bias, residual, residual_row_stride, weight, ln_bias, y, pre_norm,
                  mean, rstd, keep, n, h, eps, dropout_p, seed};
  BF_DISPATCH_TP(act_dtype, param_dtype, T, P, return run_fwd<T, P>(a, stream));
  return kOk;
}

int bias_dropout_residual_layernorm_bwd(const void* dy, int64_t dy_row_stride, const void* pre_norm, int64_t pre_row_stride,
                  const float* mean, const float* rstd, const void* weight, void* dx, void* dresidual,
                  void* dbias, void* dweight, void* dln_bias, float* workspace, int64_t n, int64_t h,
                  float dropout_p, const int64_t* seed, int act_dtype, int param_dtype,
                  cudaStream_t stream) {
  clear_error();
  if (int s = check_shape("bias_dropout_residual_layernorm_bwd", n, h, dropout_p)) return s;
  if (dropout_p > 0.f && seed == nullptr) return fail(kErrArgument, "bias_dropout_residual_layernorm_bwd: dropout needs a seed");
  const BwdArgs a{dy, dy_row_stride, pre_norm, pre_row_stride, mean, rstd, weight, dx, dresidual,
                  workspace, n, h, dropout_p, seed, dbias != nullptr};
  // n == 0 still runs: one block writes zero partials, so the parameter gradients come out 0.
  BF_DISPATCH_TP(act_dtype, param_dtype, T, P,
                 return run_bwd<T, P>(a, dbias, dweight, dln_bias, param_dtype, stream));
  return kOk;
}

}  // namespace bertfast
