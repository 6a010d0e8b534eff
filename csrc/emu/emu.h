// CPU emulation of the CUDA features the bertfast kernels use, so that the kernels themselves
// (csrc/*.cu, *.cuh, source-transformed by build_emu.py) can run and be tested on a machine
// without a GPU. Not part of the real build.
//
// Every CUDA thread of a block is a std::thread; blocks of a grid run one after another, in
// order (x fastest) unless BERTFAST_EMU_BLOCK_ORDER says "reverse" or "shuffle:<seed>" (a fixed
// permutation per seed), so a test can check that results do not depend on the block schedule.
//   __syncthreads / __syncwarp      std::barrier over the block / the warp (a thread that returns
//                                   drops out of both, as an exited CUDA thread does)
//   __shfl_xor_sync                 exchange through the warp's slots, two warp barriers
//   shared memory                   per-block buffer (dynamic: filled with 0xFF bytes, so reading
//                                   memory nobody wrote gives NaN); static __shared__ -> static
//   atomicAdd                       std::atomic_ref
//   bertfast::ptx (ptx.cuh)         ldmatrix: lanes post their row addresses, each reads its elements
//                                   from them; mma_m16n8k16: operands meet in warp scratch under the
//                                   PTX ISA's layouts, fp32 sums in k order; cp.async: a thread's
//                                   copies are queued by group and land at the cp_async_wait that
//                                   requires them (the latest moment the hardware may land them), so
//                                   a tile read before its wait reads stale bytes. A misaligned
//                                   address aborts, as it faults on the hardware. exp2_ftz: exp2
//                                   with subnormals flushed (exact where the hardware is 2 ulp).
//   wgmma (wgmma.cuh)               a thread's products are queued by commit group and run at the
//                                   wgmma_wait that requires them (warp-collective there: A fragments
//                                   meet in warp scratch), reading shared memory then and writing the
//                                   accumulators only then; the descriptor's 128-byte swizzle is applied
//                                   to emulated shared addresses, where dynamic shared memory starts at
//                                   kSharedBase (not 1024-aligned: a kernel must align its tiles itself).
//                                   A product issued without a wgmma_fence since the last wait, or
//                                   after a thread's cp.async copies landed without a fence_proxy_async
//                                   (wgmma reads through the async proxy), aborts.
// Lanes do not run in lockstep here, so a missing __syncwarp shows up as a wrong result more
// readily than on hardware.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
// nvcc's inlining hint; the host compiler has no such keyword (empty: a libstdc++ header's
// __attribute__((__noinline__)) then reads __attribute__(()), still valid).
#ifndef __noinline__
#define __noinline__
#endif

namespace emu {

struct Warp {
  explicit Warp(int n) : bar(n) {}
  std::barrier<> bar;
  uint64_t slots[32];
  float A[256], B[256], C[256];
};

struct Block {
  explicit Block(int n) : bar(n) {}
  std::barrier<> bar;
  std::vector<std::unique_ptr<Warp>> warps;
  unsigned char* dyn = nullptr;
  size_t dyn_bytes = 0;
};

inline thread_local Block* tl_block = nullptr;
inline thread_local Warp* tl_warp = nullptr;
inline thread_local int tl_lane = 0;

inline unsigned char* dyn_smem() { return tl_block->dyn; }

}  // namespace emu

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

inline void __syncthreads() { emu::tl_block->bar.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::tl_warp->bar.arrive_and_wait(); }

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int offset, int = 32) {
  static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
  emu::Warp* w = emu::tl_warp;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  w->slots[emu::tl_lane] = bits;
  w->bar.arrive_and_wait();
  const uint64_t other = w->slots[emu::tl_lane ^ offset];
  w->bar.arrive_and_wait();
  T r;
  std::memcpy(&r, &other, sizeof(T));
  return r;
}

template <typename T>
inline cudaError_t cudaFuncSetAttribute(T*, enum cudaFuncAttribute, int) {
  return cudaSuccess;
}

inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }

namespace emu {

// The order blocks 0 .. n-1 (linear, x fastest) run in: BERTFAST_EMU_BLOCK_ORDER (see the top).
inline std::vector<uint64_t> block_order(uint64_t n) {
  std::vector<uint64_t> order(n);
  std::iota(order.begin(), order.end(), uint64_t{0});
  const char* env = std::getenv("BERTFAST_EMU_BLOCK_ORDER");
  const std::string mode = env ? env : "";
  if (mode == "reverse") {
    std::reverse(order.begin(), order.end());
  } else if (mode.rfind("shuffle:", 0) == 0) {
    std::mt19937_64 rng(std::stoull(mode.substr(8)));
    std::shuffle(order.begin(), order.end(), rng);
  }
  return order;
}

// Runs kernel(args...) over the grid, one block at a time, one std::thread per CUDA thread.
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t, Args&&... args) {
  const int nthreads = static_cast<int>(block.x * block.y * block.z);
  for (const uint64_t b : block_order(static_cast<uint64_t>(grid.x) * grid.y * grid.z)) {
    const unsigned bx = static_cast<unsigned>(b % grid.x), by = static_cast<unsigned>(b / grid.x % grid.y),
                   bz = static_cast<unsigned>(b / grid.x / grid.y);
    Block blk(nthreads);
    const int nwarps = (nthreads + 31) / 32;
    for (int w = 0; w < nwarps; ++w)
      blk.warps.emplace_back(new Warp(w == nwarps - 1 ? nthreads - 32 * w : 32));
    const size_t bytes = smem > 0 ? smem : 16;
    unsigned char* dyn = static_cast<unsigned char*>(::operator new[](bytes, std::align_val_t(128)));
    std::memset(dyn, 0xFF, bytes);
    blk.dyn = dyn;
    blk.dyn_bytes = bytes;
    std::vector<std::thread> threads;
    threads.reserve(nthreads);
    for (int t = 0; t < nthreads; ++t) {
      threads.emplace_back([&, t]() {
        tl_block = &blk;
        tl_warp = blk.warps[t / 32].get();
        tl_lane = t % 32;
        threadIdx = make_uint3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
        blockIdx = make_uint3(bx, by, bz);
        blockDim = block;
        gridDim = grid;
        kernel(KArgs(args)...);
        tl_warp->bar.arrive_and_drop();
        tl_block->bar.arrive_and_drop();
      });
    }
    for (auto& th : threads) th.join();
    ::operator delete[](dyn, std::align_val_t(128));
  }
}

}  // namespace emu

namespace emu {

inline float as_float(float v) { return v; }
inline float as_float(__half v) { return __half2float(v); }
inline float as_float(__nv_bfloat16 v) { return __bfloat162float(v); }

}  // namespace emu

// ------------------------------------------------------------------ bertfast::ptx (ptx.cuh)
namespace emu {

[[noreturn]] inline void misaligned(const char* what, const void* p) {
  std::fprintf(stderr, "emu: %s: address %p is not 16-byte aligned\n", what, p);
  std::abort();
}

struct Copy {
  void* dst;
  const void* src;
  bool valid;
  int bytes;
};
inline thread_local std::vector<Copy> tl_open;                 // this thread's uncommitted copies
inline thread_local std::vector<std::vector<Copy>> tl_groups;  // its committed groups, oldest first
inline thread_local bool tl_landed_unfenced = false;  // copies landed since its last fence_proxy_async

template <typename T>
inline float half_bits_to_float(uint32_t reg, int hi) {
  const uint16_t bits = static_cast<uint16_t>(hi ? reg >> 16 : reg & 0xFFFFu);
  T v;
  std::memcpy(&v, &bits, 2);
  return as_float(v);
}

// NM 8 x 8 matrices of 16-bit elements, rows addressed by lanes 8i .. 8i + 7.
template <int NM, bool TRANS>
inline void ldmatrix(uint32_t* r, const void* row) {
  if (reinterpret_cast<uintptr_t>(row) % 16 && tl_lane < 8 * NM) misaligned("ldmatrix", row);
  Warp* w = tl_warp;
  const int lane = tl_lane, g = lane >> 2, t = lane & 3;
  w->slots[lane] = reinterpret_cast<uint64_t>(row);
  w->bar.arrive_and_wait();
  for (int i = 0; i < NM; ++i) {
    const auto at = [&](int rr, int c) { return reinterpret_cast<const uint16_t*>(w->slots[8 * i + rr])[c]; };
    const uint32_t lo = TRANS ? at(2 * t, g) : at(g, 2 * t);
    const uint32_t hi = TRANS ? at(2 * t + 1, g) : at(g, 2 * t + 1);
    r[i] = lo | (hi << 16);
  }
  w->bar.arrive_and_wait();
}

}  // namespace emu

namespace bertfast {
namespace ptx {

inline void ldmatrix_x4(uint32_t (&r)[4], const void* row) { emu::ldmatrix<4, false>(r, row); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) { emu::ldmatrix<4, true>(r, row); }
inline void ldmatrix_x2(uint32_t (&r)[2], const void* row) { emu::ldmatrix<2, false>(r, row); }
inline void ldmatrix_x2_trans(uint32_t (&r)[2], const void* row) { emu::ldmatrix<2, true>(r, row); }

template <typename T>
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  emu::Warp* w = emu::tl_warp;
  const int lane = emu::tl_lane, g = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; ++i) {
    for (int e = 0; e < 2; ++e)
      w->A[(g + 8 * (i & 1)) * 16 + 2 * t + e + 8 * (i >> 1)] = emu::half_bits_to_float<T>(a[i], e);
  }
  for (int i = 0; i < 2; ++i) {
    for (int e = 0; e < 2; ++e) w->B[(2 * t + e + 8 * i) * 8 + g] = emu::half_bits_to_float<T>(b[i], e);  // (k, n)
  }
  w->bar.arrive_and_wait();
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
    float s = d[i];
    for (int k = 0; k < 16; ++k) s += w->A[row * 16 + k] * w->B[k * 8 + col];
    out[i] = s;
  }
  w->bar.arrive_and_wait();
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}

template <typename T>
inline void mma_m16n8k16_zero(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  for (float& x : d) x = 0.f;
  mma_m16n8k16<T>(d, a, b);
}

inline float exp2_ftz(float x) {
  const float y = std::exp2(std::fpclassify(x) == FP_SUBNORMAL ? 0.f : x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.f : y;
}

template <int N>
inline void cp_async(void* dst, const void* src, bool valid) {
  static_assert(N == 4 || N == 8 || N == 16, "cp.async copies 4, 8 or 16 bytes");
  if (reinterpret_cast<uintptr_t>(dst) % N) emu::misaligned("cp.async (shared)", dst);
  if (valid && reinterpret_cast<uintptr_t>(src) % N) emu::misaligned("cp.async (global)", src);
  emu::tl_open.push_back({dst, src, valid, N});
}
inline void cp_async_commit() {
  emu::tl_groups.push_back(std::move(emu::tl_open));
  emu::tl_open.clear();
}
template <int N>
inline void cp_async_wait() {
  while (emu::tl_groups.size() > static_cast<size_t>(N)) {
    for (const emu::Copy& c : emu::tl_groups.front()) {
      if (c.valid) {
        std::memcpy(c.dst, c.src, c.bytes);
      } else {
        std::memset(c.dst, 0, c.bytes);
      }
      emu::tl_landed_unfenced = true;
    }
    emu::tl_groups.erase(emu::tl_groups.begin());
  }
}

}  // namespace ptx
}  // namespace bertfast

// ------------------------------------------------------------------ wgmma (wgmma.cuh)
namespace emu {

constexpr uint32_t kSharedBase = 0x480;  // emulated shared address of dynamic shared memory's first byte

[[noreturn]] inline void wgmma_fail(const char* why) {
  std::fprintf(stderr, "emu: wgmma: %s\n", why);
  std::abort();
}

struct WgmmaOp {
  float* d;       // this thread's accumulators, [n / 8][4]
  int n;
  bool bf16, trans_a, trans_b, accumulate, a_regs;
  uint32_t a[4];  // A fragment (a_regs), as the registers held it at issue
  uint64_t da, db;
};
inline thread_local std::vector<WgmmaOp> tl_wg_open;
inline thread_local std::vector<std::vector<WgmmaOp>> tl_wg_groups;
inline thread_local bool tl_wg_fenced = false;

// The 16-bit element at an emulated shared address, as float.
inline float shared_elem(uint32_t addr, bool bf16) {
  const int64_t off = static_cast<int64_t>(addr) - kSharedBase;
  if (off < 0 || off + 2 > static_cast<int64_t>(tl_block->dyn_bytes) || addr % 2)
    wgmma_fail("an operand element lies outside the block's dynamic shared memory");
  uint16_t bits;
  std::memcpy(&bits, tl_block->dyn + off, 2);
  return bf16 ? half_bits_to_float<__nv_bfloat16>(bits, 0) : half_bits_to_float<__half>(bits, 0);
}

// Shared address of element (mn, k) of a K-major operand, or of (k, mn) of an MN-major one, under a
// 128-byte-swizzle descriptor: the canonical layouts (wgmma.cuh), then address bits 4-6 ^= bits 7-9.
inline uint32_t operand_addr(uint64_t desc, int mn, int k, bool mn_major) {
  if ((desc >> 62) != 1u) wgmma_fail("only the 128-byte swizzle is emulated");
  if ((desc >> 49) & 7u) wgmma_fail("only base offset 0 is emulated");
  const uint32_t start = static_cast<uint32_t>(desc & 0x3FFFu) << 4;
  const uint32_t lbo = static_cast<uint32_t>((desc >> 16) & 0x3FFFu) << 4;
  const uint32_t sbo = static_cast<uint32_t>((desc >> 32) & 0x3FFFu) << 4;
  if (!mn_major && (start & 127u) + 32u > 128u) wgmma_fail("a K-major k-step crosses its 128-byte row");
  const uint32_t logical = mn_major ? start + (mn % 64) * 2 + (mn / 64) * lbo + (k % 8) * 128 + (k / 8) * sbo
                                    : start + (mn % 8) * 128 + (mn / 8) * sbo + k * 2;
  return logical ^ (((logical >> 7) & 7u) << 4);
}

// One product, for this thread's share of its warp's 16 rows (all lanes of the warp call it together).
inline void wgmma_run(const WgmmaOp& op) {
  Warp* w = tl_warp;
  const int lane = tl_lane, g = lane >> 2, t = lane & 3, rank = (threadIdx.x >> 5) & 3;  // warp in warpgroup
  if (op.a_regs) {
    for (int i = 0; i < 4; ++i) {
      for (int e = 0; e < 2; ++e) {
        w->A[(g + 8 * (i & 1)) * 16 + 2 * t + e + 8 * (i >> 1)] =
            op.bf16 ? half_bits_to_float<__nv_bfloat16>(op.a[i], e) : half_bits_to_float<__half>(op.a[i], e);
      }
    }
  } else {
    for (int k = 0; k < 8; ++k) {  // lane: row lane % 16, columns 8 (lane / 16) ..
      const int row = lane & 15, col = 8 * (lane >> 4) + k;
      w->A[row * 16 + col] = shared_elem(operand_addr(op.da, 16 * rank + row, col, op.trans_a), op.bf16);
    }
  }
  w->bar.arrive_and_wait();
  std::vector<float> out(op.n / 2);
  for (int j = 0; j < op.n / 8; ++j) {
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i >> 1), col = 8 * j + 2 * t + (i & 1);
      float s = op.accumulate ? op.d[4 * j + i] : 0.f;
      for (int k = 0; k < 16; ++k)
        s += w->A[row * 16 + k] * shared_elem(operand_addr(op.db, col, k, op.trans_b), op.bf16);
      out[4 * j + i] = s;
    }
  }
  w->bar.arrive_and_wait();
  std::copy(out.begin(), out.end(), op.d);
}

template <typename T, int N, bool kTransB, bool kTransA>
inline void wgmma_issue(float (&d)[N / 8][4], const uint32_t* a, uint64_t da, uint64_t db, bool accumulate) {
  static_assert(N == 32 || N == 64 || N == 128, "wgmma: N of 32, 64 or 128");
  if (!tl_wg_fenced) wgmma_fail("wgmma.mma_async without a wgmma.fence since the last wgmma.wait_group");
  if (tl_landed_unfenced) wgmma_fail("wgmma.mma_async after cp.async copies landed without a fence.proxy.async");
  WgmmaOp op{&d[0][0], N, std::is_same<T, __nv_bfloat16>::value, kTransA, kTransB, accumulate, a != nullptr, {}, da,
             db};
  if (a) std::copy(a, a + 4, op.a);
  tl_wg_open.push_back(op);
}

}  // namespace emu

namespace bertfast {
namespace ptx {

// Emulated shared address of p, which must lie in the block's dynamic shared memory.
inline uint32_t smem_addr(const void* p) {
  const int64_t off = static_cast<const unsigned char*>(p) - emu::tl_block->dyn;
  if (off < 0 || off > static_cast<int64_t>(emu::tl_block->dyn_bytes))
    emu::wgmma_fail("smem_addr of a pointer outside the block's dynamic shared memory");
  return emu::kSharedBase + static_cast<uint32_t>(off);
}

inline void wgmma_fence() { emu::tl_wg_fenced = true; }
inline void fence_proxy_async() { emu::tl_landed_unfenced = false; }
inline void wgmma_commit() {
  emu::tl_wg_groups.push_back(std::move(emu::tl_wg_open));
  emu::tl_wg_open.clear();
}
template <int N>
inline void wgmma_wait() {
  while (emu::tl_wg_groups.size() > static_cast<size_t>(N)) {
    for (const emu::WgmmaOp& op : emu::tl_wg_groups.front()) emu::wgmma_run(op);
    emu::tl_wg_groups.erase(emu::tl_wg_groups.begin());
  }
  emu::tl_wg_fenced = false;
}
template <typename T, int N, bool kTransB, bool kTransA = false>
inline void wgmma_ss(float (&d)[N / 8][4], uint64_t a, uint64_t b, bool accumulate) {
  emu::wgmma_issue<T, N, kTransB, kTransA>(d, nullptr, a, b, accumulate);
}
template <typename T, int N, bool kTransB>
inline void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t b, bool accumulate) {
  emu::wgmma_issue<T, N, kTransB, false>(d, a, 0, b, accumulate);
}

}  // namespace ptx
}  // namespace bertfast
