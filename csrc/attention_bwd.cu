// Attention backward launcher: delta, dQ and dK/dV kernels, in that order: the dQ kernel refines
// delta for the dK/dV kernel (kernels and the why: attention.cuh).
#include "attention_host.cuh"

namespace bertfast {
namespace {

using namespace attn;

template <typename T, int D>
struct Bwd {
  static int run(const Params& p, cudaStream_t stream) {
    using C = Cfg<T, D>;
    attention_bwd_delta_kernel<T><<<grid_for(p, 4), 128, 0, stream>>>(p);
    BF_CHECK_LAUNCH("attention_bwd (delta)");

    using LQ = DqSmem<T, D, C::kDqBM, C::kDqBN, C::kDqWN>;
    auto dq = attention_bwd_dq_kernel<T, D, C::kDqBM, C::kDqBN, C::kDqWN>;
    if (int s = prepare(dq, LQ::bytes, "attention_bwd (dq)")) return s;
    dq<<<grid_for(p, C::kDqBM), C::kDqBM / 16 * C::kDqWN * 32, LQ::bytes, stream>>>(p);
    BF_CHECK_LAUNCH("attention_bwd (dq)");

    using LK = KvSmem<T, D, C::kKvBN, C::kKvBM>;
    auto kv = attention_bwd_dkdv_kernel<T, D, C::kKvBN, C::kKvBM, C::kKvWN>;
    if (int s = prepare(kv, LK::bytes, "attention_bwd (dk, dv)")) return s;
    kv<<<grid_for(p, C::kKvBN), C::kKvBN / 16 * C::kKvWN * 32, LK::bytes, stream>>>(p);
    BF_CHECK_LAUNCH("attention_bwd (dk, dv)");
    return kOk;
  }
};

}  // namespace

int attention_bwd(const AttentionParams& p, cudaStream_t stream) {
  clear_error();
  if (int s = check(p, true, "attention_bwd")) return s;
  if (p.batch == 0 || p.max_seqlen == 0) return kOk;
  return dispatch<Bwd>(p, stream);
}

}  // namespace bertfast
