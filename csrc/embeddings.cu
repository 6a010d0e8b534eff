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
#include "common.cuh"

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
  const int64_t step = static_cast<int64_t>(blockDim.x) * VEC;
  float sum = 0.f;
  for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
    float v[VEC];
    gather<P, VEC>(w, ps, ty, c, v);
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
  const float rstd = 1.f / sqrtf(block_sum(sq, red) / static_cast<float>(h) + a.eps);
  const bool dropout = a.p > 0.f;
  const uint64_t seed = dropout ? static_cast<uint64_t>(*a.seed) : 0;
  const float scale = dropout ? 1.f / (1.f - a.p) : 1.f;
  const P* lw = static_cast<const P*>(a.ln_weight);
  const P* lb = static_cast<const P*>(a.ln_bias);
  O* y = static_cast<O*>(a.y) + t * h;
  for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
    float wv[VEC], bv[VEC], out[VEC];
    load_f<P, VEC>(lw + c, wv);
    load_f<P, VEC>(lb + c, bv);
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = (row_buf[c + i] - mean) * rstd * wv[i] + bv[i];
    if (dropout) {
      bool k[VEC];
      keep_vec<VEC>(seed, t, c, a.p, k);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        out[i] = k[i] ? out[i] * scale : 0.f;
        if (a.keep) a.keep[t * h + c + i] = k[i];
      }
    } else if (a.keep) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) a.keep[t * h + c + i] = true;
    }
    store_f<O, VEC>(y + c, out);
  }
  if (threadIdx.x == 0) {
    a.mean[t] = mean;
    a.rstd[t] = rstd;
  }
}

template <typename P, typename O, int VEC>
__global__ void embeddings_bwd_kernel(Args a) {
  // [2 + TT, h] fp32: dln_weight, dln_bias partials, then (type_in_smem) the token-type rows.
  extern __shared__ float acc[];
  __shared__ float2 red[33];
  const int64_t h = a.h;
  float* acc_w = acc;
  float* acc_b = acc + h;
  float* acc_t = acc + 2 * h;
  const int64_t n_acc = 2 + (a.type_in_smem ? a.n_types : 0);
  const int64_t step = static_cast<int64_t>(blockDim.x) * VEC;
  for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
    for (int64_t j = 0; j < n_acc; ++j) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[j * h + c + i] = 0.f;
    }
  }
  const int64_t per_block = (a.t + gridDim.x - 1) / gridDim.x;
  const int64_t t0 = blockIdx.x * per_block;
  const int64_t t1 = t0 + per_block < a.t ? t0 + per_block : a.t;
  const bool dropout = a.p > 0.f;
  const uint64_t seed = dropout ? static_cast<uint64_t>(*a.seed) : 0;
  const float scale = dropout ? 1.f / (1.f - a.p) : 1.f;
  const P* lw = static_cast<const P*>(a.ln_weight);
  const float inv_h = 1.f / static_cast<float>(h);

  for (int64_t t = t0; t < t1; ++t) {
    const int64_t id = load_id(a.ids, a.ids64, t);
    const int64_t pid = load_id(a.pos_ids, a.pos64, t);
    const int64_t tid = load_id(a.type_ids, a.type64, t);
    const P* w = static_cast<const P*>(a.word) + id * h;
    const P* ps = static_cast<const P*>(a.pos) + pid * h;
    const P* ty = static_cast<const P*>(a.type) + tid * h;
    const O* dy = static_cast<const O*>(a.dy) + t * h;
    const float mean = a.mean[t], rstd = a.rstd[t];
    float2 s = make_float2(0.f, 0.f);  // sum g, sum g * xhat
    for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
      float xh[VEC], dz[VEC], wv[VEC];
      gather<P, VEC>(w, ps, ty, c, xh);
      load_f<O, VEC>(dy + c, dz);
      load_f<P, VEC>(lw + c, wv);
      if (dropout) {
        bool k[VEC];
        keep_vec<VEC>(seed, t, c, a.p, k);
#pragma unroll
        for (int i = 0; i < VEC; ++i) dz[i] = k[i] ? dz[i] * scale : 0.f;
      }
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
    const float mg = s.x * inv_h, mgx = s.y * inv_h;
    float* dw = a.dword + id * h;
    float* dp = a.dpos + pid * h;
    float* dt = a.type_in_smem ? acc_t + tid * h : a.dtype + tid * h;
    for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
      float xh[VEC], dz[VEC], wv[VEC];
      gather<P, VEC>(w, ps, ty, c, xh);
      load_f<O, VEC>(dy + c, dz);
      load_f<P, VEC>(lw + c, wv);
      if (dropout) {
        bool k[VEC];
        keep_vec<VEC>(seed, t, c, a.p, k);
#pragma unroll
        for (int i = 0; i < VEC; ++i) dz[i] = k[i] ? dz[i] * scale : 0.f;
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float xhat = (xh[i] - mean) * rstd;
        const float dh = rstd * (dz[i] * wv[i] - mg - xhat * mgx);
        atomicAdd(dw + c + i, dh);
        atomicAdd(dp + c + i, dh);
        if (a.type_in_smem) {
          dt[c + i] += dh;  // this thread's own column: no race
        } else {
          atomicAdd(dt + c + i, dh);
        }
      }
    }
  }
  float* out = a.ws + static_cast<int64_t>(blockIdx.x) * 2 * h;
  for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      out[c + i] = acc_w[c + i];
      out[h + c + i] = acc_b[c + i];
    }
    if (a.type_in_smem && t1 > t0) {
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

int threads_for(int64_t h, int vec) {
  int64_t t = (h / vec + 31) / 32 * 32;
  if (t < 32) t = 32;
  if (t > 256) t = 256;
  return static_cast<int>(t);
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
    embeddings_fwd_kernel<P, O, V><<<static_cast<unsigned>(a.t), threads_for(a.h, V), smem, stream>>>(a);
  } else {
    embeddings_fwd_kernel<P, O, 1><<<static_cast<unsigned>(a.t), threads_for(a.h, 1), smem, stream>>>(a);
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
    embeddings_bwd_kernel<P, O, V><<<static_cast<unsigned>(blocks), threads_for(a.h, V), smem, stream>>>(a);
  } else {
    if (cudaError_t e = allow_smem(embeddings_bwd_kernel<P, O, 1>, smem)) return fail_cuda("embeddings_bwd", e);
    embeddings_bwd_kernel<P, O, 1><<<static_cast<unsigned>(blocks), threads_for(a.h, 1), smem, stream>>>(a);
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
