// wgmma (sm_90a): the warpgroup's asynchronous tensor-core product m64nNk16 with fp32 accumulators, as the
// CUDA attention issues it by hand (the PTX ISA's "Asynchronous Warpgroup Level Matrix Multiply-Accumulate").
// A warpgroup is 4 consecutive warps (here a whole 128-thread block). Warp w of it holds rows 16 w .. 16 w + 15
// of the m64 product, in mma.sync's layouts (ptx.cuh): an A fragment in registers is mma.m16n8k16's A
// fragment of those rows, and d[j] is the m16n8 C layout of columns 8 j .. 8 j + 7.
//
// B, and A when it is not in registers, is read from shared memory through a matrix descriptor; bertfast
// uses one layout for it, the 128-byte swizzle. A [ROWS, C] tile of 16-bit elements (C a multiple of 64)
// is C / 64 column blocks, block b at byte b ROWS 128 of the tile (1024-byte aligned), of ROWS rows of
// 128 bytes; 16-byte chunk c of row r sits at chunk c ^ (r % 8) of its row (sw128_offset). The hardware
// applies that XOR to address bits 4-6 from bits 7-9, so a descriptor may start anywhere in an atom. One
// tile is both a K-major operand (rows are M or N, k-step ks its columns 16 ks .. 16 ks + 15:
// wgmma_desc_k, k_major_step) and an MN-major one (rows are k, k-step ks its rows 16 ks .. 16 ks + 15:
// wgmma_desc_mn, mn_major_step, with the product's transpose flag set).
//
// Order (the ISA's rules): wgmma_fence before the first product that reads registers (A, accumulators)
// written by other instructions; wgmma_commit closes the group of products issued since the last one;
// wgmma_wait<N> returns when at most N groups are pending. A product's accumulators and A registers may
// be touched, and its shared memory overwritten, only after the wait that covers it. wgmma reads shared
// memory through the async proxy: a thread's own writes of an operand tile (stores, landed cp.async
// copies) are made visible to it by fence_proxy_async, before the barrier that precedes the product.
// The CPU emulator (emu/emu.h) implements these functions with these semantics, lazily (a group's products
// run at the wait that requires them); tests/ops/test_ptx.py checks them against plain loops.
#pragma once
#include <cstdint>
#include <type_traits>

#include "ptx.cuh"

namespace bertfast {
namespace ptx {

// Element (r, c) of a [ROWS, C] 128-byte-swizzled tile of 16-bit elements, in elements from its start.
template <int ROWS>
__host__ __device__ __forceinline__ int sw128_offset(int r, int c) {
  return (c >> 6) * ROWS * 64 + r * 64 + ((((c >> 3) & 7) ^ (r & 7)) << 3) + (c & 7);
}

// The first 1024-byte-aligned byte of shared memory at or after p (where swizzled tiles may start).
__device__ __forceinline__ unsigned char* align1024(unsigned char* p) {
  return p + ((1024u - (smem_addr(p) & 1023u)) & 1023u);
}

// Matrix descriptor: start address, leading and stride byte offsets (16-byte units), 128-byte swizzle.
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | static_cast<uint64_t>((lbo & 0x3FFFFu) >> 4) << 16 |
         static_cast<uint64_t>((sbo & 0x3FFFFu) >> 4) << 32 | uint64_t{1} << 62;
}
// The descriptor of a swizzled tile at shared address `tile` as a K-major operand at its k-step 0:
// 8-row groups 1024 bytes apart (stride offset); the leading offset is unused with a swizzle (1 by
// convention).
__device__ __forceinline__ uint64_t wgmma_desc_k(uint32_t tile) { return wgmma_desc(tile, 16, 1024); }
// ... as an MN-major operand of ROWS k-rows: 64-column blocks ROWS 128 bytes apart (leading offset),
// groups of 8 k-rows 1024 (stride offset).
template <int ROWS>
__device__ __forceinline__ uint64_t wgmma_desc_mn(uint32_t tile) {
  return wgmma_desc(tile, ROWS * 128, 1024);
}
// Bytes from a tile's k-step 0 to its k-step ks: K-major (16 columns a step, 4 steps a 64-column block
// of ROWS rows), MN-major (16 rows of 128 bytes a step).
template <int ROWS>
__host__ __device__ constexpr uint32_t k_major_step(int ks) {
  return (ks >> 2) * ROWS * 128 + (ks & 3) * 32;
}
__host__ __device__ constexpr uint32_t mn_major_step(int ks) { return ks * 2048; }
// A descriptor moved by `bytes` (a multiple of 16) in shared memory: its start-address field, which
// cannot carry into the next field (shared addresses stay below 2^18). Descriptors are built once and
// moved per k-step and stage, one add each.
__device__ __forceinline__ uint64_t wgmma_desc_add(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

#ifndef BERTFAST_EMU

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Accumulator operands and their list in the instruction text, per N.
#define BF_WGMMA_D32 \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), \
  "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
  "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
  "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
#define BF_WGMMA_R32 \
  "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" "}"
#define BF_WGMMA_D64 \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), \
  "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
  "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
  "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
  "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), \
  "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
  "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
  "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define BF_WGMMA_R64 \
  "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" "}"
#define BF_WGMMA_D128 \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), \
  "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
  "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
  "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
  "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), \
  "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
  "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
  "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), \
  "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), \
  "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
  "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), \
  "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
  "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), \
  "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
  "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), \
  "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
#define BF_WGMMA_R128 \
  "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" "}"

// Operands after the accumulators: SS a, b, scale-d, trans-a, trans-b; RS a[0..3], b, scale-d, trans-b.
#define BF_WGMMA_SS(N, TY, A, B, ACC, TA, TR)                                                                \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" ACC ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N       \
               "k16.f32." TY "." TY " " BF_WGMMA_R##N ", %" A ", %" B ", p, 1, 1, %" TA ", %" TR ";\n}\n"    \
               : BF_WGMMA_D##N                                                                              \
               : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)), "n"(static_cast<int>(kTransA)),         \
                 "n"(static_cast<int>(kTransB))                                                             \
               : "memory")
#define BF_WGMMA_RS(N, TY, A0, A1, A2, A3, B, ACC, TR)                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" ACC ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N       \
               "k16.f32." TY "." TY " " BF_WGMMA_R##N ", {%" A0 ", %" A1 ", %" A2 ", %" A3 "}, %" B           \
               ", p, 1, 1, %" TR ";\n}\n"                                                                   \
               : BF_WGMMA_D##N                                                                              \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)),     \
                 "n"(static_cast<int>(kTransB))                                                             \
               : "memory")

// d (+)= A B for this warp's 16 rows of the warpgroup's m64 x N product: A [64, 16] from shared memory
// (descriptor a; K-major, or MN-major when kTransA), B [16, N] through descriptor b (K-major, or MN-major
// when kTransB); accumulate false: d = A B. T = __half or __nv_bfloat16.
template <typename T, int N, bool kTransB, bool kTransA = false>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], uint64_t a, uint64_t b, bool accumulate) {
  static_assert(N == 32 || N == 64 || N == 128, "wgmma_ss: N of 32, 64 or 128");
  constexpr bool kHalf = std::is_same<T, __half>::value;
  if constexpr (N == 32) {
    if constexpr (kHalf) BF_WGMMA_SS(32, "f16", "16", "17", "18", "19", "20");
    else BF_WGMMA_SS(32, "bf16", "16", "17", "18", "19", "20");
  } else if constexpr (N == 64) {
    if constexpr (kHalf) BF_WGMMA_SS(64, "f16", "32", "33", "34", "35", "36");
    else BF_WGMMA_SS(64, "bf16", "32", "33", "34", "35", "36");
  } else {
    if constexpr (kHalf) BF_WGMMA_SS(128, "f16", "64", "65", "66", "67", "68");
    else BF_WGMMA_SS(128, "bf16", "64", "65", "66", "67", "68");
  }
}

// The same with A from registers: this warp's m16n8k16 A fragment of its 16 rows.
template <typename T, int N, bool kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t b, bool accumulate) {
  static_assert(N == 32 || N == 64 || N == 128, "wgmma_rs: N of 32, 64 or 128");
  constexpr bool kHalf = std::is_same<T, __half>::value;
  if constexpr (N == 32) {
    if constexpr (kHalf) BF_WGMMA_RS(32, "f16", "16", "17", "18", "19", "20", "21", "22");
    else BF_WGMMA_RS(32, "bf16", "16", "17", "18", "19", "20", "21", "22");
  } else if constexpr (N == 64) {
    if constexpr (kHalf) BF_WGMMA_RS(64, "f16", "32", "33", "34", "35", "36", "37", "38");
    else BF_WGMMA_RS(64, "bf16", "32", "33", "34", "35", "36", "37", "38");
  } else {
    if constexpr (kHalf) BF_WGMMA_RS(128, "f16", "64", "65", "66", "67", "68", "69", "70");
    else BF_WGMMA_RS(128, "bf16", "64", "65", "66", "67", "68", "69", "70");
  }
}

#undef BF_WGMMA_SS
#undef BF_WGMMA_RS

#endif  // BERTFAST_EMU

}  // namespace ptx
}  // namespace bertfast
