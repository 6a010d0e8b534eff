// Attention forward launcher and the debug dropout-mask entry point (kernels: attention.cuh).
#include "attention_host.cuh"

namespace bertfast {
namespace {

using namespace attn;

// ------------------------------------------------------------------ dropout mask (debug)
// keep [rows = batch * heads * S, S]: row (b * A + a) * S + i, column j, exactly as above.
__global__ void attention_dropout_mask_kernel(bool* __restrict__ keep, int64_t rows, int s, float dp, const int64_t* seed_ptr) {
  const uint64_t seed = dp > 0.f ? static_cast<uint64_t>(*seed_ptr) : 0;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    for (int g = threadIdx.x; 4 * g < s; g += blockDim.x) {
      const U4 bits = dropout_bits(seed, static_cast<uint64_t>(row), static_cast<uint32_t>(g));
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = 4 * g + e;
        if (j < s) keep[row * s + j] = uniform01(pick(bits, e)) >= dp;
      }
    }
  }
}

template <typename T, int D>
struct Fwd {
  static int run(const Params& p, cudaStream_t stream) {
    using C = Cfg<T, D>;
    using L = FwdSmem<T, D, C::kFwdBM, C::kFwdBN>;
    auto kernel = attention_fwd_kernel<T, D, C::kFwdBM, C::kFwdBN, C::kFwdWN>;
    if (int s = prepare(kernel, L::bytes, "attention_fwd")) return s;
    kernel<<<grid_for(p, C::kFwdBM), C::kFwdBM / 16 * C::kFwdWN * 32, L::bytes, stream>>>(p);
    BF_CHECK_LAUNCH("attention_fwd");
    return kOk;
  }
};

}  // namespace

int attention_fwd(const AttentionParams& p, cudaStream_t stream) {
  clear_error();
  if (int s = check(p, false, "attention_fwd")) return s;
  if (p.batch == 0 || p.max_seqlen == 0) return kOk;
  return dispatch<Fwd>(p, stream);
}

int attention_dropout_mask(bool* keep, int batch, int heads, int seqlen, float dropout_p, const int64_t* seed,
                           cudaStream_t stream) {
  clear_error();
  if (batch < 0 || heads < 0 || seqlen < 0)
    return fail(kErrArgument, "attention_dropout_mask: negative size (batch %d, heads %d, seqlen %d)", batch, heads,
                seqlen);
  if (!(dropout_p >= 0.f && dropout_p < 1.f))
    return fail(kErrArgument, "attention_dropout_mask: dropout_p must be in [0, 1), got %g", dropout_p);
  if (dropout_p > 0.f && seed == nullptr) return fail(kErrArgument, "attention_dropout_mask: dropout needs a seed");
  const int64_t rows = static_cast<int64_t>(batch) * heads * seqlen;
  if (rows == 0) return kOk;
  const unsigned blocks = static_cast<unsigned>(rows < 65536 ? rows : 65536);
  attention_dropout_mask_kernel<<<blocks, 128, 0, stream>>>(keep, rows, seqlen, dropout_p, seed);
  BF_CHECK_LAUNCH("attention_dropout_mask");
  return kOk;
}

}  // namespace bertfast
