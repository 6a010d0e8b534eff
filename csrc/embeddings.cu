// Embeddings: gather + sum + LayerNorm + dropout, forward and backward.
//
//   forward (per token t):
//     h    = word[ids[t]] + pos[pos_ids[t]] + type[type_ids[t]]   (summed in fp32)
//     xhat = (h - mean) * rstd   (two-pass fp32 statistics, saved)
//     y    = Dropout(xhat * ln_weight + ln_bias)                   (stored in out_dtype)
//   backward, with dz = keep * dy / (1 - p), g = dz * ln_weight:
//     dln_weight = sum_t dz * xhat,  dln_bias = sum_t dz
//     dh = rstd * (g - mean(g) - xhat * mean(g * xhat))
//     dword[r] = sum of dh[t] over the tokens with ids[t] == r (fp32), likewise dpos and dtype
//
// Forward: one block per token, the fp32 row kept in shared memory between passes.
// Backward: every sum has a fixed order, none uses atomics, so the gradients are the same bits
// whatever the block schedule (a resumed pre-training run continues bit for bit). No host read,
// so it can be captured in a CUDA graph.
//   1. One block per chunk of tokens; each thread owns fixed columns, so the per-block partial sums
//      of dln_weight / dln_bias (and of the token-type rows, when the type table is small enough to
//      sit in shared memory: usually 2 rows) accumulate in shared memory. The partials go to the
//      workspace [blocks, 2, H] and [blocks, TT, H]; column_sum.cu adds them in block order. dh goes
//      to its own workspace [T, H] fp32.
//   2. The caller sorted the table-row keys stably (word ids; V + position ids; V + P + type ids
//      when the types are not in shared memory), so row r's entries sit together in token order at
//      [bounds[r], bounds[r + 1]). The chunk pass cuts the sorted entries into chunks; each thread
//      adds its columns of a chunk's dh rows in order. A row that begins and ends strictly inside
//      the chunk is complete: written there. The chunk's first and last runs, which may go on in
//      the neighbouring chunks, leave partial sums in [chunks, 2, H].
//   3. The row pass (one warp per table row) adds a row's partials in chunk order and writes it in
//      the table dtype, or writes zeros when no token uses it: every row is written once, so there is
//      no zero-fill or cast pass. Chunks of about sqrt(entries) (the wrapper's choice) keep both
//      passes' serial chains short when a hot row ([MASK], position 0) holds many of the tokens.
// Limits: H up to 8192; V + P + TT < 2^31 (int32 keys).
#include "layernorm.cuh"

namespace bertfast {
namespace {

constexpr int kMaxH = 8192;
constexpr size_t kMaxTypeSmem = 32 * 1024;  // bytes of shared memory for token-type partials
constexpr int kRowWarps = 4;  // table rows per block of the row pass (a warp each)
constexpr int kAhead = 4;     // sorted entries the chunk pass loads before adding them (loads in flight)

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
  float* dh;               // backward: [t, h] fp32
  float* ws;               // [gridDim.x, 2, h] fp32
  float* ws_type;          // [gridDim.x, n_types, h] fp32 (unused when types_sorted)
  int64_t t, h, n_types;
  float eps, p;
  const int64_t* seed;
  bool types_sorted;       // the token types go through the table passes, not shared memory
};

// The table passes: n sorted entries, their keys the table rows (word, then position, then type).
struct TableArgs {
  const int32_t* keys;     // [n] sorted row keys
  const int64_t* order;    // [n] each entry's index in the unsorted keys (its token's, + t per table)
  const int64_t* bounds;   // [rows + 1]: row r's entries are [bounds[r], bounds[r + 1])
  const float* dh;         // [t, h] fp32
  float* part;             // [chunks, 2, h] fp32: a chunk's first and last runs' partial sums
  void* word;              // gradients in the table dtype: [V, h]
  void* pos;               // [P, h]
  void* type;              // [TT, h]
  int64_t n, chunk, t, h, vocab, n_pos, rows;
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
  // [2 + TT, h] fp32: dln_weight, dln_bias partials, then (unless types_sorted) the token-type rows.
  extern __shared__ float acc[];
  __shared__ float2 red[33];
  const int64_t h = a.h;
  const int64_t types = a.types_sorted ? 0 : a.n_types;
  float* acc_t = acc + 2 * h;
  zero_columns<VEC>(acc, 2 + types, h);
  const RowRange rows = block_rows(a.t);
  const RowDropout drop(a.p, a.seed);
  const P* lw = static_cast<const P*>(a.ln_weight);

  for (int64_t t = rows.begin; t < rows.end; ++t) {
    const int64_t tid = load_id(a.type_ids, a.type64, t);
    const P* w = static_cast<const P*>(a.word) + load_id(a.ids, a.ids64, t) * h;
    const P* ps = static_cast<const P*>(a.pos) + load_id(a.pos_ids, a.pos64, t) * h;
    const P* ty = static_cast<const P*>(a.type) + tid * h;
    const O* dy = static_cast<const O*>(a.dy) + t * h;
    float* dh_row = a.dh + t * h;
    layernorm_bwd_row<P, VEC>(
        h, a.mean[t], a.rstd[t], lw, acc, acc + h, red,
        [&](int64_t c, float (&dz)[VEC], float (&x)[VEC]) {
          gather<P, VEC>(w, ps, ty, c, x);
          load_f<O, VEC>(dy + c, dz);
          drop.apply(t, c, dz);
        },
        [&](int64_t c, const float (&dh)[VEC]) {
          store_f<float, VEC>(dh_row + c, dh);  // the table passes add it up in a fixed order
          if (!a.types_sorted) {
            float* dt = acc_t + tid * h;
#pragma unroll
            for (int i = 0; i < VEC; ++i) dt[c + i] += dh[i];  // this thread's own column: no race
          }
        });
  }
  copy_columns<VEC>(a.ws + static_cast<int64_t>(blockIdx.x) * 2 * h, acc, 2, h);
  if (types > 0) copy_columns<VEC>(a.ws_type + static_cast<int64_t>(blockIdx.x) * types * h, acc_t, types, h);
}

// Row r's gradient (table dtype P): word rows, then position rows, then type rows.
template <typename P>
__device__ __forceinline__ P* table_row(const TableArgs& a, int64_t r) {
  if (r < a.vocab) return static_cast<P*>(a.word) + r * a.h;
  r -= a.vocab;
  if (r < a.n_pos) return static_cast<P*>(a.pos) + r * a.h;
  return static_cast<P*>(a.type) + (r - a.n_pos) * a.h;
}

// Chunk pass: block (chunk, column block); each thread adds its VEC columns of the chunk's dh rows
// in sorted order. A row met whole here is written; the runs at the chunk's edges go to part.
template <typename P, int VEC>
__global__ void table_chunks_kernel(TableArgs a) {
  const int64_t c = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * VEC;
  if (c >= a.h) return;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * a.chunk;
  const int64_t i1 = i0 + a.chunk < a.n ? i0 + a.chunk : a.n;
  float* edge = a.part + static_cast<int64_t>(blockIdx.x) * 2 * a.h + c;  // [0]: first run, [h]: last
  float acc[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
  int32_t key = a.keys[i0];
  bool first = true;  // acc is the run holding the chunk's first entry (it may have begun before)
  for (int64_t i = i0; i < i1; i += kAhead) {
    int32_t k[kAhead];
    float v[kAhead][VEC];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {  // the loads first, so that kAhead rows are in flight
      if (i + u < i1) {
        k[u] = a.keys[i + u];
        int64_t tok = a.order[i + u];  // < 3 t: a subtraction or two, not a 64-bit division
        tok -= tok >= a.t ? a.t : 0;
        tok -= tok >= a.t ? a.t : 0;
        load_f<float, VEC>(a.dh + tok * a.h + c, v[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      if (i + u >= i1) break;
      if (k[u] != key) {  // a run ends inside the chunk
        if (first) {
          store_f<float, VEC>(edge, acc);
        } else {
          store_f<P, VEC>(table_row<P>(a, key) + c, acc);  // it began inside too: the whole row
        }
        first = false;
        key = k[u];
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] += v[u][j];
    }
  }
  store_f<float, VEC>(first ? edge : edge + a.h, acc);  // the run holding the last entry
}

// Row pass: one warp per table row writes it once: the sum of its partials in chunk order, or
// zeros when no token uses it. Rows the chunk pass wrote (inside one chunk, off its edges) are left.
template <typename P, int VEC>
__global__ void table_rows_kernel(TableArgs a) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= a.rows) return;
  const int64_t b0 = a.bounds[r], b1 = a.bounds[r + 1];
  int64_t c0 = 0, c1 = -1;  // the chunks holding the row's entries (none)
  const float* head = nullptr;
  if (b1 > b0) {
    c0 = b0 / a.chunk;
    c1 = (b1 - 1) / a.chunk;
    const int64_t end0 = (c0 + 1) * a.chunk < a.n ? (c0 + 1) * a.chunk : a.n;
    const bool opens = b0 == c0 * a.chunk;  // the first run of chunk c0, else its last
    if (c0 == c1 && !opens && b1 < end0) return;  // inside one chunk, off its edges: written there
    head = a.part + (c0 * 2 + (opens ? 0 : 1)) * a.h;
  }
  P* out = table_row<P>(a, r);
  for (int64_t c = (threadIdx.x & 31) * VEC; c < a.h; c += 32 * VEC) {
    float acc[VEC];
    if (head) {
      load_f<float, VEC>(head + c, acc);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
    }
#pragma unroll 4
    for (int64_t k = c0 + 1; k <= c1; ++k) {  // the row opens each later chunk: its first run
      float v[VEC];
      load_f<float, VEC>(a.part + k * 2 * a.h + c, v);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] += v[i];
    }
    store_f<P, VEC>(out + c, acc);
  }
}

template <typename P, typename O>
bool use_vec(const Args& a, int v) {
  const bool out_ok = aligned_to(a.y, v * sizeof(O)) && aligned_to(a.dy, v * sizeof(O));
  return a.h % v == 0 && out_ok && aligned_to(a.word, v * sizeof(P)) && aligned_to(a.pos, v * sizeof(P)) &&
         aligned_to(a.type, v * sizeof(P)) && aligned_to(a.ln_weight, v * sizeof(P)) &&
         aligned_to(a.ln_bias, v * sizeof(P)) && aligned_to(a.dh, v * sizeof(float));
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

template <typename P, int VEC>
int run_tables(const TableArgs& a, cudaStream_t stream) {
  if (a.n > 0) {
    const int threads = layernorm_threads(a.h, VEC);
    const dim3 grid(static_cast<unsigned>((a.n + a.chunk - 1) / a.chunk),
                    static_cast<unsigned>((a.h + threads * VEC - 1) / (threads * VEC)));
    table_chunks_kernel<P, VEC><<<grid, threads, 0, stream>>>(a);
    BF_CHECK_LAUNCH("embeddings_bwd (table chunks)");
  }
  const unsigned blocks = static_cast<unsigned>((a.rows + kRowWarps - 1) / kRowWarps);
  table_rows_kernel<P, VEC><<<blocks, 32 * kRowWarps, 0, stream>>>(a);
  BF_CHECK_LAUNCH("embeddings_bwd (table rows)");
  return kOk;
}

template <typename P, typename O>
int run_bwd(const Args& a, const TableArgs& tab, void* dln_weight, void* dln_bias, int table_dtype,
            cudaStream_t stream) {
  constexpr int V = vec_width<P, O>();
  const size_t smem = static_cast<size_t>((2 + (a.types_sorted ? 0 : a.n_types)) * a.h) * sizeof(float);
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
  if (int s = launch_column_sum(a.ws, blocks, 2, 1, a.h, dln_bias, table_dtype, stream)) return s;
  if (!a.types_sorted) {  // [blocks, TT * h]: the type rows' partials, summed in block order
    if (int s = launch_column_sum(a.ws_type, blocks, 1, 0, a.n_types * a.h, tab.type, table_dtype, stream)) return s;
  }
  const bool vec = a.h % 4 == 0 && aligned_to(tab.dh, 16) && aligned_to(tab.part, 16) &&
                   aligned_to(tab.word, 4 * sizeof(P)) && aligned_to(tab.pos, 4 * sizeof(P)) &&
                   aligned_to(tab.type, 4 * sizeof(P));
  return vec ? run_tables<P, 4>(tab, stream) : run_tables<P, 1>(tab, stream);
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
                   const void* ln_weight, const float* mean, const float* rstd, const int32_t* sorted_keys,
                   const int64_t* sorted_order, const int64_t* row_bounds, void* dword, void* dpos, void* dtype,
                   void* dln_weight, void* dln_bias, float* workspace, float* dh, float* chunk_ws, int64_t t,
                   int64_t h, int64_t vocab, int64_t n_pos, int64_t n_types, int types_sorted, int64_t chunk,
                   float dropout_p, const int64_t* seed, int table_dtype, int out_dtype, cudaStream_t stream) {
  clear_error();
  if (int s = check_shape("embeddings_bwd", t, h, dropout_p, seed)) return s;
  if (vocab < 1 || n_pos < 1 || n_types < 1)
    return fail(kErrArgument, "embeddings_bwd: expected tables with rows, got vocab=%lld n_pos=%lld n_types=%lld",
                (long long)vocab, (long long)n_pos, (long long)n_types);
  if (chunk < 1) return fail(kErrArgument, "embeddings_bwd: chunk must be >= 1, got %lld", (long long)chunk);
  if (!types_sorted && static_cast<size_t>(n_types * h) * sizeof(float) > kMaxTypeSmem)
    return fail(kErrArgument, "embeddings_bwd: %lld token types of %lld columns exceed the %zu bytes of shared "
                "memory for their partials: sort them (types_sorted = 1)", (long long)n_types, (long long)h,
                kMaxTypeSmem);
  const int64_t rows = vocab + n_pos + (types_sorted ? n_types : 0);
  if (rows > 0x7fffffffLL)
    return fail(kErrArgument, "embeddings_bwd: %lld table rows do not fit int32 keys", (long long)rows);
  Args a{};
  a.ids = ids; a.ids64 = ids64; a.pos_ids = pos_ids; a.pos64 = pos64; a.type_ids = type_ids; a.type64 = type64;
  a.word = word; a.pos = pos; a.type = type; a.ln_weight = ln_weight;
  a.dy = dy; a.mean = const_cast<float*>(mean); a.rstd = const_cast<float*>(rstd);
  a.dh = dh; a.ws = workspace; a.ws_type = workspace + reduction_blocks(t) * 2 * h;
  a.t = t; a.h = h; a.n_types = n_types; a.p = dropout_p; a.seed = seed;
  a.types_sorted = types_sorted != 0;
  TableArgs tab{};
  tab.keys = sorted_keys; tab.order = sorted_order; tab.bounds = row_bounds; tab.dh = dh; tab.part = chunk_ws;
  tab.word = dword; tab.pos = dpos; tab.type = dtype;
  tab.n = t * (types_sorted ? 3 : 2); tab.chunk = chunk; tab.t = t; tab.h = h;
  tab.vocab = vocab; tab.n_pos = n_pos; tab.rows = rows;
  // t == 0 still runs: one block writes zero partials, so dln_weight / dln_bias (and the type rows)
  // come out 0, and the row pass writes zero rows.
  BF_DISPATCH_PO(table_dtype, out_dtype, P, O,
                 return run_bwd<P, O>(a, tab, dln_weight, dln_bias, table_dtype, stream));
  return kOk;
}

}  // namespace bertfast
