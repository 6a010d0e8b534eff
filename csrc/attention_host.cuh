// Host-side helpers shared by the attention launchers (attention_fwd.cuh, attention_bwd.cuh) and entry
// points (attention_fwd.cu, attention_bwd.cu): shared-memory opt-in with a clear error, the grid,
// argument checks, the per-tensor choice of 16-byte row accesses, the dispatch onto a tile head dim,
// and the per-dtype launchers.
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

constexpr int kMinHeadDim = 8, kMaxHeadDim = 256;  // bertfast.contract's MIN_HEAD_DIM, MAX_HEAD_DIM

inline int check(const AttentionParams& p, bool backward, const char* name) {
  if (p.batch < 0 || p.batch > 65535 || p.heads < 1 || p.heads > 65535 || p.max_seqlen < 0)
    return fail(kErrArgument, "%s: expected 0 <= batch <= 65535, 1 <= heads <= 65535, max_seqlen >= 0; got %d, %d, %d",
                name, p.batch, p.heads, p.max_seqlen);
  if (p.head_dim < kMinHeadDim || p.head_dim > kMaxHeadDim)
    return fail(kErrUnsupported, "%s: head_dim must be in [%d, %d], got %d", name, kMinHeadDim, kMaxHeadDim,
                p.head_dim);
  // The forward keeps its running max in raw score units, which needs a positive scale.
  if (!(p.softmax_scale > 0.f && p.softmax_scale < kInf))
    return fail(kErrArgument, "%s: softmax_scale must be a finite float > 0, got %g", name, p.softmax_scale);
  if (!(p.dropout_p >= 0.f && p.dropout_p < 1.f))
    return fail(kErrArgument, "%s: dropout_p must be in [0, 1), got %g", name, p.dropout_p);
  if (p.dropout_p > 0.f && p.seed == nullptr) return fail(kErrArgument, "%s: dropout needs a seed", name);
  if (p.dropout_p > 0.f && (p.keep == nullptr || p.keep_len % 128 != 0 || p.keep_len < p.max_seqlen))
    return fail(kErrArgument,
                "%s: dropout needs its keep bits, keep_len a multiple of 128 and >= max_seqlen %d; got %s, "
                "keep_len %lld", name, p.max_seqlen, p.keep == nullptr ? "none" : "a pointer",
                static_cast<long long>(p.keep_len));
  // The backward copies the keep bits in 16-byte rows (KeepTile): the forward's buffer is aligned so.
  if (p.dropout_p > 0.f && !aligned_to(p.keep, 16))
    return fail(kErrArgument, "%s: the keep bits must be 16-byte aligned, got address %p", name,
                static_cast<const void*>(p.keep));
  const int elem = p.dtype == kFloat32 ? 4 : 2;
  bool ok = aligned_to(p.q, elem) && aligned_to(p.k, elem) && aligned_to(p.v, elem) && aligned_to(p.out, elem);
  if (backward)
    ok = ok && aligned_to(p.dout, elem) && aligned_to(p.dq, elem) && aligned_to(p.dk, elem) && aligned_to(p.dv, elem);
  if (!ok) return fail(kErrArgument, "%s: every q/k/v/out/dout/grad pointer must be aligned to its element size", name);
  return kOk;
}

// Whether a tensor's rows allow 16-byte accesses: a 16-byte aligned start, strides and a row
// width (head_dim) of whole 16-byte vectors. Any other tensor moves element by element.
inline bool vec16(const void* ptr, const Strides& s, int head_dim, int elem) {
  const int64_t e = 16 / elem;
  return aligned_to(ptr, 16) && head_dim % e == 0 && s.batch % e == 0 && s.row % e == 0 && s.head % e == 0;
}

inline Params with_vec(const AttentionParams& p) {
  const int elem = p.dtype == kFloat32 ? 4 : 2;
  const auto bit = [&](const void* ptr, const Strides& s, unsigned b) {
    return vec16(ptr, s, p.head_dim, elem) ? b : 0u;
  };
  return Params{p,
                bit(p.q, p.sq, kVecQ) | bit(p.k, p.sk, kVecK) | bit(p.v, p.sv, kVecV) | bit(p.out, p.so, kVecO) |
                    bit(p.dout, p.sdo, kVecDO) | bit(p.dq, p.sdq, kVecDQ) | bit(p.dk, p.sdk, kVecDK) |
                    bit(p.dv, p.sdv, kVecDV),
                keep_threshold(p.dropout_p)};
}

// The instance of a kernel template for a launch's dropout and 16-byte-row settings, which the mma.sync
// kernels take as template arguments (each carries only the instructions it runs): `instance` (a generic
// lambda) gets them as std::bool_constant values and names the kernel.
template <typename F>
inline auto by_settings(bool dropout, bool vec, F instance) {
  using Y = std::true_type;
  using N = std::false_type;
  return dropout ? (vec ? instance(Y{}, Y{}) : instance(Y{}, N{})) : (vec ? instance(N{}, Y{}) : instance(N{}, N{}));
}

// Runs F<T, D>::run(p, stream) on the tile head dim D: the smallest tier >= head_dim, its extra
// columns zero. The tiers: 16, 32, 64 and 128 hold the common head dims exactly (BERT's 64), 96 keeps
// 80 and 96 from padding to 128, 256 is the largest served; a head dim pays at most twice its work (17
// in 32, 129 in 256). Few tiers, since each is compiled for every dtype and arch (and for the CPU
// emulator).
// kLo .. kHi: the tiers a translation unit serves (the backward's two halves; its caller routes the
// head dim), the last of them taking every head dim above it.
template <template <typename, int> class F, typename T, int kLo = 16, int kHi = 256>
inline int dispatch_head_dim(const Params& p, cudaStream_t stream) {
  if constexpr (kLo <= 16) {
    if (kHi == 16 || p.head_dim <= 16) return F<T, 16>::run(p, stream);
  }
  if constexpr (kLo <= 32 && kHi >= 32) {
    if (kHi == 32 || p.head_dim <= 32) return F<T, 32>::run(p, stream);
  }
  if constexpr (kLo <= 64 && kHi >= 64) {
    if (kHi == 64 || p.head_dim <= 64) return F<T, 64>::run(p, stream);
  }
  if constexpr (kLo <= 96 && kHi >= 96) {
    if (kHi == 96 || p.head_dim <= 96) return F<T, 96>::run(p, stream);
  }
  if constexpr (kLo <= 128 && kHi >= 128) {
    if (kHi == 128 || p.head_dim <= 128) return F<T, 128>::run(p, stream);
  }
  if constexpr (kHi >= 256) return F<T, 256>::run(p, stream);
  return kOk;  // not reached: the last tier above takes the rest
}

// Each direction's launcher for one dtype, defined in attention_fwd.cuh and attention_bwd.cuh and
// compiled in a translation unit of its own (attention_{fwd,bwd}_{fp32,fp16,bf16}.cu), so the build
// compiles them side by side: in one file per direction the backward alone took nvcc a minute
// (sm_90a). The fp16/bf16 backward is split again by tile head dim, run_bwd up to kBwdSplitHeadDim and
// run_bwd_wide above it (attention_bwd_<dtype>_wide.cu): whole, each took 30 s, the build's slowest
// source. attention_fwd.cu and attention_bwd.cu check the arguments and pick the dtype's (and half).
constexpr int kBwdSplitHeadDim = 64;
template <typename T>
int run_fwd(const Params& p, cudaStream_t stream);
template <typename T>
int run_bwd(const Params& p, cudaStream_t stream);
template <typename T>
int run_bwd_wide(const Params& p, cudaStream_t stream);

}  // namespace attn
}  // namespace bertfast
