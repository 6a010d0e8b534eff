// Second stage of every "reduce over rows without atomics" in bertfast: the backward kernels
// leave one fp32 partial sum per (row block, column) in a workspace [rows, n_stacked, h]; this
// kernel adds the partials of one stacked slot column by column and casts to the output dtype.
#include "common.cuh"

namespace bertfast {
namespace {

constexpr int kCols = 32;  // columns per block (threadIdx.x): coalesced reads of a partial row
constexpr int kRowLanes = 8;  // partial rows summed in parallel (threadIdx.y)

template <typename OutT>
__global__ void column_sum_kernel(const float* __restrict__ ws,  // [rows, n_stacked, h] fp32
                                  int64_t rows, int n_stacked, int which, int64_t h,
                                  OutT* __restrict__ out) {  // [h]
  __shared__ float part[kRowLanes][kCols + 1];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kCols + threadIdx.x;
  float acc = 0.f;
  if (c < h) {
    for (int64_t r = threadIdx.y; r < rows; r += kRowLanes) acc += ws[(r * n_stacked + which) * h + c];
  }
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < h) {
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < kRowLanes; ++i) total += part[i][threadIdx.x];
    out[c] = from_f<OutT>(total);
  }
}

}  // namespace

int launch_column_sum(const float* ws, int64_t rows, int n_stacked, int which, int64_t h, void* out,
                      int out_dtype, cudaStream_t stream) {
  if (h <= 0) return kOk;
  const dim3 block(kCols, kRowLanes);
  const dim3 grid(static_cast<unsigned>((h + kCols - 1) / kCols));
  BF_DISPATCH_T(out_dtype, OutT,
                column_sum_kernel<OutT><<<grid, block, 0, stream>>>(ws, rows, n_stacked, which, h,
                                                                    static_cast<OutT*>(out)));
  BF_CHECK_LAUNCH("column_sum");
  return kOk;
}

}  // namespace bertfast
