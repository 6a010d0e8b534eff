// Embeddings: gather + sum + LayerNorm + dropout, forward and backward.
//
//   forward (per token t):
//     h    = word[ids[t]] + pos[pos_ids[t]] + type[type_ids[t]]   (summed in fp32)
//     xhat = (h - mean) * rstd   (two-pass fp32 statistics, saved)
//     y    = Dropout(xhat * ln_weight + ln_bias)                   (stored in out_dtype)
//   backward, with dz = keep * dy / (1 - p), g = dz * ln_weight:
//     dln_weight = sum_t dz * xhat,  dln_bias = sum_t dz
//     dh = rstd * (g - mean(g) - xhat * mean(g * xhat))
//     dword[ids[t]] += dh, dpos[pos_ids[t]] += dh, dtype[type_ids[t]] += dh   (fp32 atomics:
//     repeated ids add up; the caller casts the fp32 buffers to each table's dtype)
//
// Forward: one block per token, the fp32 row kept in shared memory between passes.
// Backward: one block per chunk of tokens; each thread owns fixed columns, so the per-block
// partial sums of dln_weight / dln_bias (and of the token-type rows, when the type table is
// small enough to sit in shared memory: usually 2 rows) accumulate in shared memory without
// atomics. Token-type partials are flushed with one atomicAdd per (block, type, column); the
// LayerNorm partials go to the workspace [blocks, 2, H] and column_sum.cu reduces them.
// Limits: H up to 8192.
#include "layernorm.cuh"

namespace bertfast {
namespace {

constexpr int kMaxH = 8192;
constexpr size_t kMaxTypeSmem = 32 * 1024;  // bytes of shared memory for token-type partials

__device__ __forceinline__ int64_t load_id(const void* ids, int is64, int64_t t) {
  return is64 ? static_cast<const int64_t*>(ids)[t] : static_cast<int64_t>(static_cast<const int32_t*>(ids)[t]);
}

struct Args {
  const void* ids; int ids64;
  const void* pos_ids; int pos64;
  const void* type_ids; int type64;
  const void* word;        // [V, h] table dtype
  const void* pos;         // [P, h]
  const void* type;        // [TT, h]
  const void* ln_weight;   // [h] table dtype
  const void* ln_bias;     // [h] table dtype (forward only)
  void* y;                 // forward: [t, h] out dtype
  const void* dy;          // backward: [t, h] out dtype
  float* mean;             // [t]
  float* rstd;             // [t]
  bool* keep;              // forward: [t, h] or null
  float* dword;            // backward: [V, h] fp32
  float* dpos;             // [P, h] fp32
  float* dtype;            // [TT, h] fp32
  float* ws;               // [gridDim.x, 2, h] fp32
  int64_t t, h, n_types;
  float eps, p;
  const int64_t* seed;
  bool type_in_smem;
};

// The fp32 sum of the three embedding rows at columns c .. c+VEC-1.
template <typename P, int VEC>
__device__ __forceinline__ void gather(const P* w, const P* ps, const P* ty, int64_t c, float (&v)[VEC]) {
  float a[VEC], b[VEC];
  load_f<P, VEC>(w + c, v);
  load_f<P, VEC>(ps + c, a);
  load_f<P, VEC>(ty + c, b);
#pragma unroll
  for (int i = 0; i < VEC; ++i) v[i] += a[i] + b[i];
}

template <typename P, typename O, int VEC>
__global__ void embeddings_fwd_kernel(Args a) {
  extern __shared__ float row_buf[];  // [h] fp32 sum of the embeddings
  __shared__ float2 red[33];
  const int64_t t = blockIdx.x, h = a.h;
  const P* w = static_cast<const P*>(a.word) + load_id(a.ids, a.ids64, t) * h;
  const P* ps = static_cast<const P*>(a.pos) + load_id(a.pos_ids, a.pos64, t) * h;
  const P* ty = static_cast<const P*>(a.type) + load_id(a.type_ids, a.type64, t) * h;
  O* y = static_cast<O*>(a.y) + t * h;
  bool* keep = a.keep ? a.keep + t * h : nullptr;
  const RowDropout drop(a.p, a.seed);
  const float2 stats = layernorm_fwd_row<P, VEC>(
      row_buf, h, a.eps, static_cast<const P*>(a.ln_weight), static_cast<const P*>(a.ln_bias), red,
      [&](int64_t c, float (&v)[VEC]) { gather<P, VEC>(w, ps, ty, c, v); },
      [&](int64_t c, float (&out)[VEC]) {
        drop.apply(t, c, out, keep);
        store_f<O, VEC>(y + c, out);
      });
  if (threadIdx.x == 0) {
    a.mean[t] = stats.x;
    a.rstd[t] = stats.y;
  }
}

template <typename P, typename O, int VEC>
__global__ void embeddings_bwd_kernel(Args a) {
  // [2 + TT, h] fp32: dln_weight, dln_bias partials, then (type_in_smem) the token-type rows.
  extern __shared__ float acc[];
  __shared__ float2 red[33];
  const int64_t h = a.h;
  float* acc_t = acc + 2 * h;
  zero_columns<VEC>(acc, 2 + (a.type_in_smem ? a.n_types : 0), h);
  const RowRange rows = block_rows(a.t);
  const RowDropout drop(a.p, a.seed);
  const P* lw = static_cast<const P*>(a.ln_weight);

  for (int64_t t = rows.begin; t < rows.end; ++t) {
    const int64_t id = load_id(a.ids, a.ids64, t);
    const int64_t pid = load_id(a.pos_ids, a.pos64, t);
    const int64_t tid = load_id(a.type_ids, a.type64, t);
    const P* w = static_cast<const P*>(a.word) + id * h;
    const P* ps = static_cast<const P*>(a.pos) + pid * h;
    const P* ty = static_cast<const P*>(a.type) + tid * h;
    const O* dy = static_cast<const O*>(a.dy) + t * h;
    float* dw = a.dword + id * h;
    float* dp = a.dpos + pid * h;
    float* dt = a.type_in_smem ? acc_t + tid * h : a.dtype + tid * h;
    layernorm_bwd_row<P, VEC>(
        h, a.mean[t], a.rstd[t], lw, acc, acc + h, red,
        [&](int64_t c, float (&dz)[VEC], float (&x)[VEC]) {
          gather<P, VEC>(w, ps, ty, c, x);
          load_f<O, VEC>(dy + c, dz);
          drop.apply(t, c, dz);
        },
        [&](int64_t c, const float (&dh)[VEC]) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            atomicAdd(dw + c + i, dh[i]);
            atomicAdd(dp + c + i, dh[i]);
            if (a.type_in_smem) {
              dt[c + i] += dh[i];  // this thread's own column: no race
            } else {
              atomicAdd(dt + c + i, dh[i]);
            }
          }
        });
  }
  copy_columns<VEC>(a.ws + static_cast<int64_t>(blockIdx.x) * 2 * h, acc, 2, h);
  if (a.type_in_smem && rows.end > rows.begin) {
    const int64_t step = static_cast<int64_t>(blockDim.x) * VEC;
    for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
      for (int64_t j = 0; j < a.n_types; ++j) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float v = acc_t[j * h + c + i];
          if (v != 0.f) atomicAdd(a.dtype + j * h + c + i, v);
        }
      }
    }
  }
}

template <typename P, typename O>
bool use_vec(const Args& a, int v) {
  const bool out_ok = aligned_to(a.y, v * sizeof(O)) && aligned_to(a.dy, v * sizeof(O));
  return a.h % v == 0 && out_ok && aligned_to(a.word, v * sizeof(P)) && aligned_to(a.pos, v * sizeof(P)) &&
         aligned_to(a.type, v * sizeof(P)) && aligned_to(a.ln_weight, v * sizeof(P)) &&
         aligned_to(a.ln_bias, v * sizeof(P));
}

template <typename P, typename O>
int run_fwd(const Args& a, cudaStream_t stream) {
  constexpr int V = vec_width<P, O>();
  const size_t smem = static_cast<size_t>(a.h) * sizeof(float);
  if (use_vec<P, O>(a, V)) {
    embeddings_fwd_kernel<P, O, V><<<static_cast<unsigned>(a.t), layernorm_threads(a.h, V), smem, stream>>>(a);
  } else {
    embeddings_fwd_kernel<P, O, 1><<<static_cast<unsigned>(a.t), layernorm_threads(a.h, 1), smem, stream>>>(a);
  }
  BF_CHECK_LAUNCH("embeddings_fwd");
  return kOk;
}

template <typename P, typename O>
int run_bwd(const Args& a, void* dln_weight, void* dln_bias, int table_dtype, cudaStream_t stream) {
  constexpr int V = vec_width<P, O>();
  const size_t smem = static_cast<size_t>((2 + (a.type_in_smem ? a.n_types : 0)) * a.h) * sizeof(float);
  const int64_t blocks = reduction_blocks(a.t);
  if (use_vec<P, O>(a, V)) {
    if (cudaError_t e = allow_smem(embeddings_bwd_kernel<P, O, V>, smem)) return fail_cuda("embeddings_bwd", e);
    embeddings_bwd_kernel<P, O, V><<<static_cast<unsigned>(blocks), layernorm_threads(a.h, V), smem, stream>>>(a);
  } else {
    if (cudaError_t e = allow_smem(embeddings_bwd_kernel<P, O, 1>, smem)) return fail_cuda("embeddings_bwd", e);
    embeddings_bwd_kernel<P, O, 1><<<static_cast<unsigned>(blocks), layernorm_threads(a.h, 1), smem, stream>>>(a);
  }
  BF_CHECK_LAUNCH("embeddings_bwd");
  if (int s = launch_column_sum(a.ws, blocks, 2, 0, a.h, dln_weight, table_dtype, stream)) return s;
  return launch_column_sum(a.ws, blocks, 2, 1, a.h, dln_bias, table_dtype, stream);
}

// Table dtype P and output dtype O: P == O, or P float32 with any O.
#define BF_DISPATCH_PO(table, out, P, O, ...)                                                  \
  BF_DISPATCH_T(out, O,                                                                       \
                if ((table) == (out)) {                                                       \
                  using P = O;                                                                \
                  __VA_ARGS__;                                                                \
                } else if ((table) == kFloat32) {                                             \
                  using P = float;                                                            \
                  __VA_ARGS__;                                                                \
                } else {                                                                      \
                  return fail(kErrArgument, "embeddings: table dtype code %d must equal the " \
                              "output dtype code %d or be float32 (0)", (int)(table), (int)(out)); \
                })

int check_shape(const char* name, int64_t t, int64_t h, float p, const int64_t* seed) {
  if (t < 0 || h <= 0 || h > kMaxH)
    return fail(kErrArgument, "%s: expected t >= 0 and 0 < h <= %d, got t=%lld h=%lld", name, kMaxH,
                (long long)t, (long long)h);
  if (t > 0x7fffffffLL) return fail(kErrArgument, "%s: t=%lld tokens is too many", name, (long long)t);
  if (!(p >= 0.f && p < 1.f)) return fail(kErrArgument, "%s: dropout_p must be in [0, 1), got %g", name, p);
  if (p > 0.f && seed == nullptr) return fail(kErrArgument, "%s: dropout needs a seed", name);
  return kOk;
}

}  // namespace

int embeddings_fwd(const void* ids, int ids64, const void* pos_ids, int pos64, const void* type_ids,
                   int type64, const void* word, const void* pos, const void* type, const void* ln_weight,
                   const void* ln_bias, void* y, float* mean, float* rstd, bool* keep, int64_t t, int64_t h,
                   float eps, float dropout_p, const int64_t* seed, int table_dtype, int out_dtype,
                   cudaStream_t stream) {
  clear_error();
  if (int s = check_shape("embeddings_fwd", t, h, dropout_p, seed)) return s;
  if (t == 0) return kOk;
  Args a{};
  a.ids = ids; a.ids64 = ids64; a.pos_ids = pos_ids; a.pos64 = pos64; a.type_ids = type_ids; a.type64 = type64;
  a.word = word; a.pos = pos; a.type = type; a.ln_weight = ln_weight; a.ln_bias = ln_bias;
  a.y = y; a.mean = mean; a.rstd = rstd; a.keep = keep;
  a.t = t; a.h = h; a.eps = eps; a.p = dropout_p; a.seed = seed;
  BF_DISPATCH_PO(table_dtype, out_dtype, P, O, return run_fwd<P, O>(a, stream));
  return kOk;
}

int embeddings_bwd(const void* dy, const void* ids, int ids64, const void* pos_ids, int pos64,
                   const void* type_ids, int type64, const void* word, const void* pos, const void* type,
                   const void* ln_weight, const float* mean, const float* rstd, float* dword, float* dpos,
                   float* dtype, void* dln_weight, void* dln_bias, float* workspace, int64_t t, int64_t h,
                   int64_t n_types, float dropout_p, const int64_t* seed, int table_dtype, int out_dtype,
                   cudaStream_t stream) {
  clear_error();
  if (int s = check_shape("embeddings_bwd", t, h, dropout_p, seed)) return s;
  if (n_types < 1) return fail(kErrArgument, "embeddings_bwd: n_types must be >= 1, got %lld", (long long)n_types);
  Args a{};
  a.ids = ids; a.ids64 = ids64; a.pos_ids = pos_ids; a.pos64 = pos64; a.type_ids = type_ids; a.type64 = type64;
  a.word = word; a.pos = pos; a.type = type; a.ln_weight = ln_weight;
  a.dy = dy; a.mean = const_cast<float*>(mean); a.rstd = const_cast<float*>(rstd);
  a.dword = dword; a.dpos = dpos; a.dtype = dtype; a.ws = workspace;
  a.t = t; a.h = h; a.n_types = n_types; a.p = dropout_p; a.seed = seed;
  a.type_in_smem = static_cast<size_t>(n_types * h) * sizeof(float) <= kMaxTypeSmem;
  // t == 0 still runs: one block writes zero partials, so dln_weight / dln_bias come out 0.
  BF_DISPATCH_PO(table_dtype, out_dtype, P, O, return run_bwd<P, O>(a, dln_weight, dln_bias, table_dtype, stream));
  return kOk;
}

}  // namespace bertfast
