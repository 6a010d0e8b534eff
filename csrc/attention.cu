// Attention launchers: validate, pick the tile configuration for (dtype, head dim), launch.
// The kernels and their math are in attention.cuh.
#include "attention.cuh"

namespace bertfast {
namespace {

using namespace attn;

int max_smem_optin(int* out) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(out, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  return e == cudaSuccess ? kOk : fail_cuda("attention", e);
}

template <typename Kernel>
int prepare(Kernel kernel, int bytes, const char* name) {
  int limit = 0;
  if (int s = max_smem_optin(&limit)) return s;
  if (bytes > limit)
    return fail(kErrUnsupported, "%s: needs %d bytes of shared memory per block, the device allows %d", name,
                bytes, limit);
  if (cudaError_t e = allow_smem(kernel, bytes)) return fail_cuda(name, e);
  return kOk;
}

dim3 grid_for(const AttentionParams& p, int rows_per_block) {
  return dim3(static_cast<unsigned>((p.max_seqlen + rows_per_block - 1) / rows_per_block),
              static_cast<unsigned>(p.heads), static_cast<unsigned>(p.batch));
}

template <typename T, int D>
int fwd(const AttentionParams& p, cudaStream_t stream) {
  using C = Cfg<T, D>;
  using L = FwdSmem<T, D, C::kFwdBM, C::kFwdBN>;
  auto kernel = attn_fwd_kernel<T, D, C::kFwdBM, C::kFwdBN>;
  if (int s = prepare(kernel, L::bytes, "attention_fwd")) return s;
  kernel<<<grid_for(p, C::kFwdBM), C::kFwdBM / 16 * 32, L::bytes, stream>>>(p);
  BF_CHECK_LAUNCH("attention_fwd");
  return kOk;
}

template <typename T, int D>
int bwd(const AttentionParams& p, cudaStream_t stream) {
  using C = Cfg<T, D>;
  attn_delta_kernel<T, D><<<grid_for(p, 4), 128, 0, stream>>>(p);
  BF_CHECK_LAUNCH("attention_bwd (delta)");

  using LK = KvSmem<T, D, C::kKvBN, C::kKvBM>;
  auto kv = attn_bwd_kv_kernel<T, D, C::kKvBN, C::kKvBM>;
  if (int s = prepare(kv, LK::bytes, "attention_bwd (dk, dv)")) return s;
  kv<<<grid_for(p, C::kKvBN), C::kKvBN / 16 * 32, LK::bytes, stream>>>(p);
  BF_CHECK_LAUNCH("attention_bwd (dk, dv)");

  using LQ = DqSmem<T, D, C::kDqBM, C::kDqBN>;
  auto dq = attn_bwd_q_kernel<T, D, C::kDqBM, C::kDqBN>;
  if (int s = prepare(dq, LQ::bytes, "attention_bwd (dq)")) return s;
  dq<<<grid_for(p, C::kDqBM), C::kDqBM / 16 * 32, LQ::bytes, stream>>>(p);
  BF_CHECK_LAUNCH("attention_bwd (dq)");
  return kOk;
}

bool aligned16(const void* ptr, const Strides& s, int elem) {
  const int64_t e = 16 / elem;
  return aligned_to(ptr, 16) && s.batch % e == 0 && s.row % e == 0 && s.head % e == 0;
}

int check(const AttentionParams& p, bool backward, const char* name) {
  if (p.batch < 0 || p.batch > 65535 || p.heads < 1 || p.heads > 65535 || p.max_seqlen < 0)
    return fail(kErrArgument, "%s: expected 0 <= batch <= 65535, 1 <= heads <= 65535, max_seqlen >= 0; got %d, %d, %d",
                name, p.batch, p.heads, p.max_seqlen);
  if (p.head_dim != 16 && p.head_dim != 32 && p.head_dim != 64 && p.head_dim != 128)
    return fail(kErrUnsupported, "%s: head_dim must be 16, 32, 64 or 128, got %d", name, p.head_dim);
  if (!(p.dropout_p >= 0.f && p.dropout_p < 1.f))
    return fail(kErrArgument, "%s: dropout_p must be in [0, 1), got %g", name, p.dropout_p);
  if (p.dropout_p > 0.f && p.seed == nullptr) return fail(kErrArgument, "%s: dropout needs a seed", name);
  const int elem = p.dtype == kFloat32 ? 4 : 2;
  bool ok = aligned16(p.q, p.sq, elem) && aligned16(p.k, p.sk, elem) && aligned16(p.v, p.sv, elem) &&
            aligned16(p.out, p.so, elem);
  if (backward)
    ok = ok && aligned16(p.dout, p.sdo, elem) && aligned16(p.dq, p.sdq, elem) && aligned16(p.dk, p.sdk, elem) &&
         aligned16(p.dv, p.sdv, elem);
  if (!ok) return fail(kErrArgument, "%s: every q/k/v/out/dout/grad pointer and stride must be 16-byte aligned", name);
  return kOk;
}

template <bool kBackward>
int run(const AttentionParams& p, cudaStream_t stream) {
  BF_DISPATCH_T(p.dtype, T, {
    switch (p.head_dim) {
      case 16: return kBackward ? bwd<T, 16>(p, stream) : fwd<T, 16>(p, stream);
      case 32: return kBackward ? bwd<T, 32>(p, stream) : fwd<T, 32>(p, stream);
      case 64: return kBackward ? bwd<T, 64>(p, stream) : fwd<T, 64>(p, stream);
      case 128: return kBackward ? bwd<T, 128>(p, stream) : fwd<T, 128>(p, stream);
      default: return fail(kErrUnsupported, "attention: head_dim %d", p.head_dim);
    }
  });
  return kOk;
}

}  // namespace

int attention_fwd(const AttentionParams& p, cudaStream_t stream) {
  clear_error();
  if (int s = check(p, false, "attention_fwd")) return s;
  if (p.batch == 0 || p.max_seqlen == 0) return kOk;
  return run<false>(p, stream);
}

int attention_bwd(const AttentionParams& p, cudaStream_t stream) {
  clear_error();
  if (int s = check(p, true, "attention_bwd")) return s;
  if (p.batch == 0 || p.max_seqlen == 0) return kOk;
  return run<true>(p, stream);
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
  attn::attn_mask_kernel<<<blocks, 128, 0, stream>>>(keep, rows, seqlen, dropout_p, seed);
  BF_CHECK_LAUNCH("attention_dropout_mask");
  return kOk;
}

}  // namespace bertfast
