// Host-side helpers shared by the attention launchers (attention_fwd.cu, attention_bwd.cu):
// shared-memory opt-in with a clear error, the grid, and argument checks.
#pragma once
#include "attention.cuh"

namespace bertfast {
namespace attn {

inline int max_smem_optin(int* out) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(out, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  return e == cudaSuccess ? kOk : fail_cuda("attention", e);
}

template <typename Kernel>
inline int prepare(Kernel kernel, int bytes, const char* name) {
  int limit = 0;
  if (int s = max_smem_optin(&limit)) return s;
  if (bytes > limit)
    return fail(kErrUnsupported, "%s: needs %d bytes of shared memory per block, the device allows %d", name,
                bytes, limit);
  if (cudaError_t e = allow_smem(kernel, bytes)) return fail_cuda(name, e);
  return kOk;
}

inline dim3 grid_for(const AttentionParams& p, int rows_per_block) {
  return dim3(static_cast<unsigned>((p.max_seqlen + rows_per_block - 1) / rows_per_block),
              static_cast<unsigned>(p.heads), static_cast<unsigned>(p.batch));
}

inline bool aligned16(const void* ptr, const Strides& s, int elem) {
  const int64_t e = 16 / elem;
  return aligned_to(ptr, 16) && s.batch % e == 0 && s.row % e == 0 && s.head % e == 0;
}

inline int check(const AttentionParams& p, bool backward, const char* name) {
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

// Runs F<T, D>::run(p, stream) for the runtime dtype and head dim.
template <template <typename, int> class F>
inline int dispatch(const AttentionParams& p, cudaStream_t stream) {
  BF_DISPATCH_T(p.dtype, T, {
    switch (p.head_dim) {
      case 16: return F<T, 16>::run(p, stream);
      case 32: return F<T, 32>::run(p, stream);
      case 64: return F<T, 64>::run(p, stream);
      case 128: return F<T, 128>::run(p, stream);
      default: return fail(kErrUnsupported, "attention: head_dim %d", p.head_dim);
    }
  });
  return kOk;
}

}  // namespace attn
}  // namespace bertfast
