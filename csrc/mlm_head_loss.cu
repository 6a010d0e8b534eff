// mlm_head_loss: softmax cross-entropy over the vocabulary for one chunk of decoder logits, in place.
//
//   per row m of logits x [M, V] with label y (-100 = ignored):
//     lse     = log sum_j exp(x_j)        (online max / sum in fp32, one pass)
//     loss    = lse - x_y                  (0 on ignored rows)
//     correct = y != -100 and argmax_j x_j == y   (ties: lowest index, as torch.argmax)
//     grad    = grad_scale * (exp(x_j - lse) - [j == y])   written over x (0 on ignored rows)
//   A label outside [0, V) is treated like -100 (checking would need a host sync; the Python
//   caller that wants the check does it).
//
// One block per row. Rows need not start 16-byte aligned (V = 30522 is not a multiple of 8),
// so each row is walked as a scalar head up to the first 16-byte boundary, a 128-bit body and
// a scalar tail; the second pass (the gradient) reads the row again, which is hot in L2.
#include <climits>

#include "common.cuh"

namespace bertfast {
namespace {

constexpr int kThreads = 512;

struct State {
  float m, s;     // running max and sum of exp(x - m)
  float best;     // argmax value
  int64_t arg;    // argmax index
};

__device__ __forceinline__ void visit(State& st, float x, int64_t j) {
  if (x > st.m) {
    st.s = st.s * expf(st.m - x) + 1.f;  // exp(-inf) = 0 on the first finite value
    st.m = x;
  } else if (x != -kInf) {
    st.s += expf(x - st.m);
  }
  if (x > st.best || (x == st.best && j < st.arg)) {
    st.best = x;
    st.arg = j;
  }
}

__device__ __forceinline__ void merge(State& a, const State& b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -kInf) {
    a.s = 0.f;
  } else {
    a.s = a.s * expf(a.m - m) + b.s * expf(b.m - m);
  }
  a.m = m;
  if (b.best > a.best || (b.best == a.best && b.arg < a.arg)) {
    a.best = b.best;
    a.arg = b.arg;
  }
}

__device__ __forceinline__ State shfl_state(const State& st, int offset) {
  State o;
  o.m = __shfl_xor_sync(0xffffffffu, st.m, offset);
  o.s = __shfl_xor_sync(0xffffffffu, st.s, offset);
  o.best = __shfl_xor_sync(0xffffffffu, st.best, offset);
  o.arg = __shfl_xor_sync(0xffffffffu, st.arg, offset);
  return o;
}

// Calls f(j, T& element) over one row: a scalar head up to 16-byte alignment, VEC-wide body, tail.
template <typename T, int VEC, typename F>
__device__ __forceinline__ void for_row(T* row, int64_t v, F&& f) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(row);
  int64_t head = static_cast<int64_t>(((16 - addr % 16) % 16) / sizeof(T));
  if (head > v) head = v;
  const int64_t n_vec = (v - head) / VEC;
  const int64_t tail = head + n_vec * VEC;
  for (int64_t j = threadIdx.x; j < head; j += blockDim.x) f(j, row[j]);
  for (int64_t i = threadIdx.x; i < n_vec; i += blockDim.x) {
    Vec<T, VEC>* p = reinterpret_cast<Vec<T, VEC>*>(row + head + i * VEC);
    Vec<T, VEC> t = *p;
#pragma unroll
    for (int k = 0; k < VEC; ++k) f(head + i * VEC + k, t.v[k]);
    *p = t;  // the first pass leaves it unchanged; the second wrote the gradient into t
  }
  for (int64_t j = tail + threadIdx.x; j < v; j += blockDim.x) f(j, row[j]);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
mlm_head_loss_fwd_kernel(T* __restrict__ logits,            // [M, V], row stride rs; overwritten by the gradient
            int64_t rs,
            const int64_t* __restrict__ labels,  // [M]
            float* __restrict__ loss,            // [M]
            float* __restrict__ lse_out,         // [M]
            bool* __restrict__ correct,          // [M]
            int64_t v, float grad_scale, bool compute_grad) {
  constexpr int VEC = 16 / sizeof(T);
  __shared__ State part[kThreads / 32];
  __shared__ float lse_sh;
  const int64_t m = blockIdx.x;
  T* row = logits + m * rs;
  const int64_t label = labels[m];
  const bool active = label >= 0 && label < v;  // -100 and out-of-range labels are ignored
  const float x_label = (threadIdx.x == 0 && active) ? to_f(row[label]) : 0.f;  // before the row changes

  // Pass 1 reads without writing: a scalar visitor that leaves elements as they are.
  State st{-kInf, 0.f, -kInf, LLONG_MAX};
  {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(row);
    int64_t head = static_cast<int64_t>(((16 - addr % 16) % 16) / sizeof(T));
    if (head > v) head = v;
    const int64_t n_vec = (v - head) / VEC;
    const int64_t tail = head + n_vec * VEC;
    for (int64_t j = threadIdx.x; j < head; j += blockDim.x) visit(st, to_f(row[j]), j);
    for (int64_t i = threadIdx.x; i < n_vec; i += blockDim.x) {
      float x[VEC];
      load_f<T, VEC>(row + head + i * VEC, x);
#pragma unroll
      for (int k = 0; k < VEC; ++k) visit(st, x[k], head + i * VEC + k);
    }
    for (int64_t j = tail + threadIdx.x; j < v; j += blockDim.x) visit(st, to_f(row[j]), j);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) merge(st, shfl_state(st, o));
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = st;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) merge(st, part[w]);
    const float lse = st.m + logf(st.s);
    lse_sh = lse;
    lse_out[m] = lse;
    loss[m] = active ? lse - x_label : 0.f;
    correct[m] = active && st.arg == label;
  }
  __syncthreads();
  if (!compute_grad) return;
  const float lse = lse_sh;
  for_row<T, VEC>(row, v, [&](int64_t j, T& e) {
    const float g = active ? grad_scale * (expf(to_f(e) - lse) - (j == label ? 1.f : 0.f)) : 0.f;
    e = from_f<T>(g);
  });
}

}  // namespace

int mlm_head_loss_fwd(void* logits, int64_t row_stride, const int64_t* labels, float* loss, float* lse,
                          bool* correct, int64_t n, int64_t v, float grad_scale, int compute_grad, int dtype,
                          cudaStream_t stream) {
  clear_error();
  if (n < 0 || v <= 0 || row_stride < v)
    return fail(kErrArgument, "mlm_head_loss_fwd: expected n >= 0, v > 0, row_stride >= v; got n=%lld v=%lld "
                "row_stride=%lld", (long long)n, (long long)v, (long long)row_stride);
  if (n > 0x7fffffffLL) return fail(kErrArgument, "mlm_head_loss_fwd: n=%lld rows is too many", (long long)n);
  if (n == 0) return kOk;
  BF_DISPATCH_T(dtype, T,
                mlm_head_loss_fwd_kernel<T><<<static_cast<unsigned>(n), kThreads, 0, stream>>>(
                    static_cast<T*>(logits), row_stride, labels, loss, lse, correct, v, grad_scale,
                    compute_grad != 0));
  BF_CHECK_LAUNCH("mlm_head_loss_fwd");
  return kOk;
}

}  // namespace bertfast
