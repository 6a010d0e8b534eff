// Attention backward: the delta, dQ and dK/dV kernels and their launcher, which runs them in that
// order: the dQ kernel refines delta for the dK/dV kernel (the math and the why: attention.cuh); and the
// one-pass kernel that replaces all three for short sequences on wgmma. Included by the translation units
// of each dtype (attention_bwd_<dtype>.cu, and for fp16/bf16 attention_bwd_<dtype>_wide.cu: the tile head
// dims above 64); the entry point is attention_bwd.cu.
#pragma once
#include "attention_host.cuh"

namespace bertfast {
namespace attn {

// ------------------------------------------------------------------ backward: Delta_i = do_i . o_i
template <typename T>
__global__ void __launch_bounds__(128) attention_bwd_delta_kernel(const Params p) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int b = blockIdx.z, h = blockIdx.y, i = blockIdx.x * 4 + w;
  const Seq sq = seq_of(p, b);
  if (i >= sq.len) return;
  const T* o = static_cast<const T*>(p.out) + b * p.so.batch + (sq.start + i) * p.so.row + h * p.so.head;
  const T* d = static_cast<const T*>(p.dout) + b * p.sdo.batch + (sq.start + i) * p.sdo.row + h * p.sdo.head;
  float s = 0.f;
  for (int c = lane; c < p.head_dim; c += 32) s += to_f(o[c]) * to_f(d[c]);
  s = warp_sum(s);
  if (lane == 0) p.delta[b * p.lse_batch + h * p.lse_head + sq.start + i] = s;
}

// ------------------------------------------------------------------ backward: dK, dV
template <typename T, int D, int BN, int BM>
struct KvSmem {
  static constexpr int LDT = D + kPadT<T>;    // K, V, Q, dO rows
  static constexpr int LDF = BM + kPadF;      // S^T, dP^T rows (fp32)
  static constexpr int LDP = BM + kPadT<T>;   // Pd^T, dS^T rows (T)
  static constexpr int LDO = D + kPadF;       // staging of dK, dV (fp32)
  static constexpr int k = 0;
  static constexpr int v = align128(k + 1LL * BN * LDT * sizeof(T));
  static constexpr int q = align128(v + 1LL * BN * LDT * sizeof(T));
  static constexpr int dO = align128(q + 1LL * BM * LDT * sizeof(T));
  static constexpr int f = align128(dO + 1LL * BM * LDT * sizeof(T));
  static constexpr int pd = align128(f + 2 * 4LL * BN * LDF);  // S^T and dP^T
  static constexpr int ds = align128(pd + 1LL * BN * LDP * sizeof(T));
  static constexpr int lse = align128(ds + 1LL * BN * LDP * sizeof(T));
  static constexpr int delta = align128(lse + 4LL * BM);
  static constexpr int kvalid = align128(delta + 4LL * BM);
  static constexpr int o = 0;
  static constexpr int bytes = cmax(align128(kvalid + 4LL * BN), align128(o + 4LL * BN * LDO));
};

// Both FMA backward kernels (fp32) ask for a minimum of 1 block per SM: without it ptxas (CUDA 13) capped
// some variants at 64-128 registers and spilled to raise occupancy.
template <typename T, int D, int BN, int BM, int WN>
__global__ void __launch_bounds__(BN / 16 * WN * 32, 1) attention_bwd_dkdv_kernel(const Params p) {
  using L = KvSmem<T, D, BN, BM>;
  constexpr int NT = BN / 16 * WN * 32;
  constexpr int SC = BM / WN, DC = D / WN;  // a warp's columns of S^T / dP^T and of dK, dV
  static_assert(SC % 8 == 0 && DC % 16 == 0, "a warp's columns: whole column groups and tiles");
  extern __shared__ __align__(128) unsigned char smem[];
  T* Ks = reinterpret_cast<T*>(smem + L::k);        // [BN, LDT]
  T* Vs = reinterpret_cast<T*>(smem + L::v);        // [BN, LDT]
  T* Qs = reinterpret_cast<T*>(smem + L::q);        // [BM, LDT]
  T* dOs = reinterpret_cast<T*>(smem + L::dO);      // [BM, LDT]
  float* F = reinterpret_cast<float*>(smem + L::f); // S^T [BN, LDF] then dP^T [BN, LDF]
  T* PdT = reinterpret_cast<T*>(smem + L::pd);      // [BN, LDP] dropped-out probabilities, transposed
  T* dST = reinterpret_cast<T*>(smem + L::ds);      // [BN, LDP] dS^T
  float* lse_s = reinterpret_cast<float*>(smem + L::lse);      // [BM] lse in log2 units (+inf: no row)
  float* delta_s = reinterpret_cast<float*>(smem + L::delta);  // [BM]
  int* kvalid = reinterpret_cast<int*>(smem + L::kvalid);      // [BN]
  float* Os = reinterpret_cast<float*>(smem + L::o);           // [BN, LDO] staging, over the tiles

  const int b = blockIdx.z, h = blockIdx.y, n0 = blockIdx.x * BN;
  const Seq sq = seq_of(p, b);
  if (n0 >= sq.len) return;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rg = WN > 1 ? w % (BN / 16) : w, cs = WN > 1 ? w / (BN / 16) : 0;  // row group (16 keys), column slice

  const T* k = static_cast<const T*>(p.k) + b * p.sk.batch + (sq.start + n0) * p.sk.row + h * p.sk.head;
  const T* v = static_cast<const T*>(p.v) + b * p.sv.batch + (sq.start + n0) * p.sv.row + h * p.sv.head;
  load_tile<T, BN, D, L::LDT, NT>(Ks, k, p.sk.row, sq.len - n0, p.head_dim, p.vec & kVecK);
  load_tile<T, BN, D, L::LDT, NT>(Vs, v, p.sv.row, sq.len - n0, p.head_dim, p.vec & kVecV);
  for (int j = threadIdx.x; j < BN; j += NT) kvalid[j] = key_valid(p, b, n0 + j, sq.len);

  float* STw = F + 16 * rg * L::LDF;
  float* dPTw = F + BN * L::LDF + 16 * rg * L::LDF;
  T* PdTw = PdT + 16 * rg * L::LDP;
  T* dSTw = dST + 16 * rg * L::LDP;
  WarpAcc<T, DC> dk, dv;
  dk.init();
  dv.init();

  const T* qb = static_cast<const T*>(p.q) + b * p.sq.batch + sq.start * p.sq.row + h * p.sq.head;
  const T* dob = static_cast<const T*>(p.dout) + b * p.sdo.batch + sq.start * p.sdo.row + h * p.sdo.head;
  const float* lse_b = p.lse + b * p.lse_batch + h * p.lse_head + sq.start;
  const float* delta_b = p.delta + b * p.lse_batch + h * p.lse_head + sq.start;
  const float scale2 = p.softmax_scale * kLog2e;
  const bool dropout = p.dropout_p > 0.f;
  const KeepBits keep_bits(p, b, h);  // the forward's decisions (with dropout)
  const float rdrop = 1.f / (1.f - p.dropout_p);
  // Elementwise map: lane handles keys 8 w' + 2 jg + e (w', e < 2) of the row group, of queries
  // cs SC + ic + 8 t: the four decisions of a query are in one keep byte (column pair jg).
  const int jg = lane >> 3, ic = lane & 7;
  const int key16 = (n0 >> 4) + rg;  // the row group's 16-key block

  for (int m0 = 0; m0 < sq.len; m0 += BM) {
    __syncthreads();  // every warp is done with the previous Q, dO, lse, delta
    load_tile<T, BM, D, L::LDT, NT>(Qs, qb + m0 * p.sq.row, p.sq.row, sq.len - m0, p.head_dim, p.vec & kVecQ);
    load_tile<T, BM, D, L::LDT, NT>(dOs, dob + m0 * p.sdo.row, p.sdo.row, sq.len - m0, p.head_dim,
                                    p.vec & kVecDO);
    for (int i = threadIdx.x; i < BM; i += NT) {
      const bool ok = m0 + i < sq.len;
      lse_s[i] = ok ? lse_b[m0 + i] * kLog2e : kInf;
      delta_s[i] = ok ? delta_b[m0 + i] : 0.f;
    }
    __syncthreads();

    // S^T = K Q^T, dPd^T = V dO^T: this warp's query columns
    warp_gemm_nt<T, SC, D>(Ks + 16 * rg * L::LDT, L::LDT, Qs + cs * SC * L::LDT, L::LDT, STw + cs * SC, L::LDF);
    warp_gemm_nt<T, SC, D>(Vs + 16 * rg * L::LDT, L::LDT, dOs + cs * SC * L::LDT, L::LDT, dPTw + cs * SC, L::LDF);
    __syncwarp();

    // Kept rolled: unrolled, bf16 at D 128 spills (sm_90).
#pragma unroll 1
    for (int t = 0; t < SC / 8; ++t) {
      const int i = cs * SC + ic + 8 * t, qi = m0 + i;
      const float l2 = lse_s[i], dl = delta_s[i];
      // bit 4h + 2w' + e of the byte: h = (qi / 8) % 2
      const unsigned bits = dropout ? *keep_bits.byte(qi >> 4, qi & 7, key16, jg) >> (4 * ((qi >> 3) & 1)) : ~0u;
#pragma unroll
      for (int k = 0; k < 4; ++k) {  // k = 2 w' + e
        const int jl = 8 * (k >> 1) + 2 * jg + (k & 1);
        const float pv = kvalid[16 * rg + jl] ? exp2f(STw[jl * L::LDF + i] * scale2 - l2) : 0.f;
        const bool keep = (bits >> k) & 1u;
        const float pd = keep ? pv * rdrop : 0.f;
        const float dpv = keep ? dPTw[jl * L::LDF + i] * rdrop : 0.f;
        PdTw[jl * L::LDP + i] = from_f<T>(pd);
        dSTw[jl * L::LDP + i] = from_f<T>(pv * (dpv - dl));
      }
    }
    sync_row_group<WN>();
    dv.template mma<BM>(PdTw, L::LDP, dOs + cs * DC, L::LDT);  // dV += Pd^T dO, this warp's columns
    dk.template mma<BM>(dSTw, L::LDP, Qs + cs * DC, L::LDT);   // dK += dS^T Q
  }
  dk.scale(p.softmax_scale);

  __syncthreads();  // every warp is done with the tiles: the staging overlaps them
  float* Ow = Os + 16 * rg * L::LDO + cs * DC;
  const int r = lane >> 1, half = lane & 1;
  const int kj = n0 + 16 * rg + r;
  const int64_t row = sq.start + kj;
  dv.store(Ow, L::LDO);
  __syncwarp();
  if (kj < sq.len) {
    write_row<T, DC>(static_cast<T*>(p.dv) + b * p.sdv.batch + row * p.sdv.row + h * p.sdv.head + cs * DC,
                     Ow + r * L::LDO, p.head_dim - cs * DC, half, 1.f, p.vec & kVecDV);
  }
  __syncwarp();
  dk.store(Ow, L::LDO);
  __syncwarp();
  if (kj < sq.len) {
    write_row<T, DC>(static_cast<T*>(p.dk) + b * p.sdk.batch + row * p.sdk.row + h * p.sdk.head + cs * DC,
                     Ow + r * L::LDO, p.head_dim - cs * DC, half, 1.f, p.vec & kVecDK);
  }
}

// ------------------------------------------------------------------ backward: dQ
template <typename T, int D, int BM, int BN, int WN>
struct DqSmem {
  static constexpr int LDT = D + kPadT<T>;   // Q, dO, K, V rows
  static constexpr int LDS = BN + kPadF;     // S and dP rows
  static constexpr int LDP = BN + kPadT<T>;  // dS rows
  static constexpr int LDO = D + kPadF;      // staging of dQ
  static constexpr int q = 0;
  static constexpr int dO = align128(q + 1LL * BM * LDT * sizeof(T));
  static constexpr int k = align128(dO + 1LL * BM * LDT * sizeof(T));
  static constexpr int v = align128(k + 1LL * BN * LDT * sizeof(T));
  static constexpr int s = align128(v + 1LL * BN * LDT * sizeof(T));
  static constexpr int dp = align128(s + 4LL * BM * LDS);
  static constexpr int ds = align128(dp + 4LL * BM * LDS);
  static constexpr int kvalid = align128(ds + 1LL * BM * LDP * sizeof(T));
  static constexpr int o = 0;
  static constexpr int bytes = cmax(align128(kvalid + 4LL * BN), align128(o + 4LL * BM * LDO));
};

template <typename T, int D, int BM, int BN, int WN>
__global__ void __launch_bounds__(BM / 16 * WN * 32, 1) attention_bwd_dq_kernel(const Params p) {
  using L = DqSmem<T, D, BM, BN, WN>;
  constexpr int NT = BM / 16 * WN * 32;
  constexpr int SC = BN / WN, DC = D / WN;  // a warp's columns of S / dP and of dQ
  static_assert(SC % 8 == 0 && DC % 16 == 0, "a warp's columns: whole column groups and tiles");
  extern __shared__ __align__(128) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem + L::q);          // [BM, LDT]
  T* dOs = reinterpret_cast<T*>(smem + L::dO);        // [BM, LDT]
  T* Ks = reinterpret_cast<T*>(smem + L::k);          // [BN, LDT]
  T* Vs = reinterpret_cast<T*>(smem + L::v);          // [BN, LDT]
  float* Ss = reinterpret_cast<float*>(smem + L::s);  // [BM, LDS] scores
  float* dPs = reinterpret_cast<float*>(smem + L::dp);  // [BM, LDS]
  T* dSs = reinterpret_cast<T*>(smem + L::ds);        // [BM, LDP]
  int* kvalid = reinterpret_cast<int*>(smem + L::kvalid);  // [BN]
  float* Os = reinterpret_cast<float*>(smem + L::o);  // [BM, LDO] dQ staging, over the tiles

  const int b = blockIdx.z, h = blockIdx.y, m0 = blockIdx.x * BM;
  const Seq sq = seq_of(p, b);
  if (m0 >= sq.len) return;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rg = WN > 1 ? w % (BM / 16) : w, cs = WN > 1 ? w / (BM / 16) : 0;  // row group, column slice
  const int r = lane >> 1, half = lane & 1;
  const int qi = m0 + 16 * rg + r;

  const T* q = static_cast<const T*>(p.q) + b * p.sq.batch + (sq.start + m0) * p.sq.row + h * p.sq.head;
  const T* dout = static_cast<const T*>(p.dout) + b * p.sdo.batch + (sq.start + m0) * p.sdo.row + h * p.sdo.head;
  load_tile<T, BM, D, L::LDT, NT>(Qs, q, p.sq.row, sq.len - m0, p.head_dim, p.vec & kVecQ);
  load_tile<T, BM, D, L::LDT, NT>(dOs, dout, p.sdo.row, sq.len - m0, p.head_dim, p.vec & kVecDO);
  const int64_t stat = b * p.lse_batch + h * p.lse_head + sq.start + qi;
  const float l2 = qi < sq.len ? p.lse[stat] * kLog2e : kInf;
  const float dl = qi < sq.len ? p.delta[stat] : 0.f;  // Delta_i, exact to fp32 rounding (header)

  float* Sw = Ss + 16 * rg * L::LDS;
  float* dPw = dPs + 16 * rg * L::LDS;
  T* dSw = dSs + 16 * rg * L::LDP;
  WarpAcc<T, DC> dq;
  dq.init();

  const T* kb = static_cast<const T*>(p.k) + b * p.sk.batch + sq.start * p.sk.row + h * p.sk.head;
  const T* vb = static_cast<const T*>(p.v) + b * p.sv.batch + sq.start * p.sv.row + h * p.sv.head;
  const float scale2 = p.softmax_scale * kLog2e;
  const bool dropout = p.dropout_p > 0.f;
  const KeepBits keep_bits(p, b, h);  // the forward's decisions (with dropout)
  const float rdrop = 1.f / (1.f - p.dropout_p);

  for (int n0 = 0; n0 < sq.len; n0 += BN) {
    __syncthreads();
    load_tile<T, BN, D, L::LDT, NT>(Ks, kb + n0 * p.sk.row, p.sk.row, sq.len - n0, p.head_dim, p.vec & kVecK);
    load_tile<T, BN, D, L::LDT, NT>(Vs, vb + n0 * p.sv.row, p.sv.row, sq.len - n0, p.head_dim, p.vec & kVecV);
    for (int j = threadIdx.x; j < BN; j += NT) kvalid[j] = key_valid(p, b, n0 + j, sq.len);
    __syncthreads();

    // S = Q K^T, dPd = dO V^T: this warp's key columns
    warp_gemm_nt<T, SC, D>(Qs + 16 * rg * L::LDT, L::LDT, Ks + cs * SC * L::LDT, L::LDT, Sw + cs * SC, L::LDS);
    warp_gemm_nt<T, SC, D>(dOs + 16 * rg * L::LDT, L::LDT, Vs + cs * SC * L::LDT, L::LDT, dPw + cs * SC, L::LDS);
    __syncwarp();

    // This lane's half of row r: columns 4 (half + 2 g) + e.
#pragma unroll
    for (int g = 0; g < SC / 8; ++g) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = cs * SC + 4 * (half + 2 * g) + e;
        const float pv = kvalid[c] ? exp2f(Sw[r * L::LDS + c] * scale2 - l2) : 0.f;
        const bool keep = !dropout || keep_bits.kept(qi, n0 + c);
        const float dpv = keep ? dPw[r * L::LDS + c] * rdrop : 0.f;
        const float dsv = pv * (dpv - dl);
        dSw[r * L::LDP + c] = from_f<T>(dsv);
      }
    }
    sync_row_group<WN>();
    dq.template mma<BN>(dSw, L::LDP, Ks + cs * DC, L::LDT);  // dQ += dS K, this warp's columns
  }
  dq.scale(p.softmax_scale);

  __syncthreads();  // every warp is done with the tiles: the staging overlaps them
  float* Ow = Os + 16 * rg * L::LDO + cs * DC;
  dq.store(Ow, L::LDO);
  __syncwarp();
  if (qi < sq.len) {
    write_row<T, DC>(static_cast<T*>(p.dq) + b * p.sdq.batch + (sq.start + qi) * p.sdq.row + h * p.sdq.head + cs * DC,
                     Ow + r * L::LDO, p.head_dim - cs * DC, half, 1.f, p.vec & kVecDQ);
  }
}

// ------------------------------------------------------------------ backward, fp16/bf16: the keep bits
// The keep bits of one block of scores, QR queries by KC keys: bytes (8R + r, 4C + q) of KeepBits over
// its 16-query blocks R and 16-key blocks C, a [QR / 2, KC / 4] byte tile. The dQ and dK/dV kernels copy
// it into shared memory with the rest of the stage (cp.async, one group), so that their step reads it
// there: read from global memory in the step, a byte's ~600 clocks went uncovered (two warps a
// scheduler). A tile row is whole copies of 16 bytes (8 or 4 in tiles of 32 or 16 keys), aligned as
// keep_len is a multiple of 128 and the buffer 16-byte aligned (the launcher checks both).
template <int QR, int KC, int NT>
struct KeepTile {
  static constexpr int kRowBytes = KC / 4;
  static constexpr int kCopy = kRowBytes % 16 == 0 ? 16 : (kRowBytes % 8 == 0 ? 8 : 4);
  static constexpr int kPerRow = kRowBytes / kCopy, kCopies = QR / 2 * kPerRow;
  static constexpr int bytes = QR / 2 * kRowBytes;
  static_assert(QR % 16 == 0 && KC % 16 == 0 && kCopies <= NT, "whole 16 x 16 blocks of scores, a copy a thread");
  const uint8_t* src;  // this thread's copy of the block at (q0, k0)
  int at;              // its bytes' place in the tile
  bool active;
  // A thread's piece of the block of queries q0 .. q0 + QR - 1 and keys k0 .. k0 + KC - 1 (multiples of
  // 16), its addresses set once; a step moves the source by a constant.
  __device__ __forceinline__ KeepTile(const Params& p, int b, int h, int q0, int k0)
      : src(KeepBits(p, b, h).byte(q0 >> 4, threadIdx.x / kPerRow, k0 >> 4, threadIdx.x % kPerRow * kCopy)),
        at(threadIdx.x / kPerRow * kRowBytes + threadIdx.x % kPerRow * kCopy), active(threadIdx.x < kCopies) {}
  // The block `steps` blocks further along the queries (dK/dV's steps) into dst.
  __device__ __forceinline__ void issue_queries(const Params& p, uint8_t* dst, int steps) const {
    if (active) ptx::cp_async<kCopy>(dst + at, src + static_cast<int64_t>(steps) * (QR / 2) * (p.keep_len / 4), true);
  }
  // The block `steps` blocks further along the keys (dQ's steps) into dst.
  __device__ __forceinline__ void issue_keys(uint8_t* dst, int steps) const {
    if (active) ptx::cp_async<kCopy>(dst + at, src + steps * kRowBytes, true);
  }
};

// ------------------------------------------------------------------ backward, fp16/bf16: dK, dV
// A warp's 16 keys of dK and dV (a lane's keys key0 + g and key0 + g + 8) in the mma C layout of the
// transposed scores, shared by the mma.sync and wgmma kernels: the per-element step from S^T and dP^T
// to Pd^T and dS^T (step) and the end that stores dK (scaled by c) and dV (finish). Element i of tile
// n: key key0 + g + 8 (i / 2), query m0 + 8n + 2t + i % 2; pd = keep p / (1 - dp) and
// ds = p (keep dp / (1 - dp) - Delta_i), with p = exp2(s c log2 e - lse_i log2 e). Queries past the
// end of the sequence read lse = +inf, so their p is 0. The keep bits of this transposed tile (the
// step's KeepTile of BN keys, the block's): queries 16c + 2t + e and 16c + 8 + 2t + e are its byte
// (8c + 2t + e, 4w + g / 2), bit 4 (n % 2) + 2 (key's half) + g % 2.
template <typename T, int BN, bool kDropout>
struct KvRows {
  static constexpr int kKeepRow = BN / 4;  // bytes a row of the step's keep tile
  float scale2, rdrop;
  int key0, g, t, kcol;
  bool key_ok[2];
  __device__ __forceinline__ KvRows(const Params& p, int b, const Seq& sq, int n0, int w, int lane)
      : scale2(p.softmax_scale * kLog2e), rdrop(kDropout ? 1.f / (1.f - p.dropout_p) : 1.f), key0(n0 + 16 * w),
        g(lane >> 2), t(lane & 3), kcol(4 * w + (lane >> 3)) {
#pragma unroll
    for (int r = 0; r < 2; ++r) key_ok[r] = key_valid(p, b, key0 + g + 8 * r, sq.len);
  }

  // Queries m0 .. m0 + 8 NS - 1 (their lse in log2 units and Delta at lse2, dl; their keep tile at keep);
  // s becomes Pd^T, dp dS^T. kMasked zeroes the probabilities of invalid keys.
  template <int NS, bool kMasked>
  __device__ __forceinline__ void step(float (&s)[NS][4], float (&dp)[NS][4], const float* lse2, const float* dl,
                                       [[maybe_unused]] const uint8_t* keep) const {
#pragma unroll
    for (int c = 0; c < NS / 2; ++c) {  // queries 16c .. 16c + 15
      [[maybe_unused]] unsigned kbyte[2];
      if constexpr (kDropout) {
#pragma unroll
        for (int e = 0; e < 2; ++e) kbyte[e] = keep[(8 * c + 2 * t + e) * kKeepRow + kcol];
      }
#pragma unroll
      for (int n = 2 * c; n < 2 * c + 2; ++n) {
        const float2 l2 = *reinterpret_cast<const float2*>(lse2 + 8 * n + 2 * t);
        const float2 d2 = *reinterpret_cast<const float2*>(dl + 8 * n + 2 * t);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int e = i & 1, r = i >> 1;
          float pv = ptx::exp2_ftz(fmaf(s[n][i], scale2, -(e ? l2.y : l2.x)));
          if constexpr (kMasked) {
            if (!key_ok[r]) pv = 0.f;
          }
          float pd = pv * rdrop, dpv = dp[n][i] * rdrop;
          if constexpr (kDropout) {
            if (!((kbyte[e] >> (4 * (n & 1) + 2 * r + (g & 1))) & 1u)) pd = dpv = 0.f;
          }
          s[n][i] = pd;
          dp[n][i] = pv * (dpv - (e ? d2.y : d2.x));
        }
      }
    }
  }

  // dK scaled by c; rows of keys in the sequence
  template <int NO>
  __device__ __forceinline__ void finish(const Params& p, int b, int h, const Seq& sq, const float (&dk)[NO][4],
                                         const float (&dv)[NO][4], int c0 = 0) const {
    store_rows<T, NO>(p.dk, p.sdk, b, h, sq, key0 + g, dk, p.softmax_scale, p.head_dim, p.vec & kVecDK, c0);
    store_rows<T, NO>(p.dv, p.sdv, b, h, sq, key0 + g, dv, 1.f, p.head_dim, p.vec & kVecDV, c0);
  }
};

// A dK/dV block's shared memory as L lays it out (MmaKvSmem, WgmmaKvSmem): its own K and V tiles, Q's
// and dO's two stages with their queries' lse (log2 units, +inf past the sequence), Delta and keep bits
// (KeepTile, with dropout). start() issues the block's copies of K and V (cp.async group 0, or element by
// element) and query block 0's (group 1); load(ib) query block ib's copies into stage ib % 2 and reads
// its lse and Delta, a thread's one query, into registers, which put(ib) stores in the stage at the top
// of block ib, before its first barrier: a block's work after their read (stored right after it, they
// held every warp ~600 clocks a block; stored at the block's end, ptxas hoisted the log2 scaling back up
// to the read). LD: the tiles' layout; kVec: Q's and dO's rows copied 16 bytes at a time.
template <typename T, typename L, int D, int LD, int NT, bool kVec, bool kDropout>
struct KvTiles {
  static constexpr int BM = L::BM;
  using Keep = KeepTile<BM, L::BN, NT>;
  struct Stats {
    float lse, delta;
  };
  T* k;
  T* v;
  T* q;
  T* dO;
  float* lse;
  float* delta;
  uint8_t* keep;
  TileCopy<T, BM, D, LD, NT, kVec> qcopy, docopy;
  [[maybe_unused]] Keep keepcopy;
  const T* qb;  // the sequence's first Q, dO row of this head; its first lse, Delta
  const T* dob;
  const float* lse_b;
  const float* delta_b;
  int len, nblocks, n0;
  __device__ __forceinline__ KvTiles(unsigned char* smem, const Params& p, int b, int h, const Seq& sq, int n0_)
      : k(reinterpret_cast<T*>(smem + L::k)), v(reinterpret_cast<T*>(smem + L::v)),
        q(reinterpret_cast<T*>(smem + L::q)), dO(reinterpret_cast<T*>(smem + L::dO)),
        lse(reinterpret_cast<float*>(smem + L::lse)), delta(reinterpret_cast<float*>(smem + L::delta)),
        keep(smem + L::keep), qcopy(p.head_dim, p.sq.row), docopy(p.head_dim, p.sdo.row),
        keepcopy(p, b, h, 0, n0_),
        qb(static_cast<const T*>(p.q) + b * p.sq.batch + sq.start * p.sq.row + h * p.sq.head),
        dob(static_cast<const T*>(p.dout) + b * p.sdo.batch + sq.start * p.sdo.row + h * p.sdo.head),
        lse_b(p.lse + b * p.lse_batch + h * p.lse_head + sq.start),
        delta_b(p.delta + b * p.lse_batch + h * p.lse_head + sq.start), len(sq.len),
        nblocks((sq.len + BM - 1) / BM), n0(n0_) {}
  __device__ __forceinline__ Stats load(const Params& p, int ib) const {
    const int m0 = ib * BM, stage = ib & 1;
    // The keep bits first: issued after the tiles, they spilled the mma.sync kernel at D 96 (ptxas, sm_90).
    if constexpr (kDropout) keepcopy.issue_queries(p, keep + stage * Keep::bytes, ib);
    qcopy.issue(q + stage * tile_elems<BM, D, LD>(), qb + m0 * p.sq.row, len - m0);
    docopy.issue(dO + stage * tile_elems<BM, D, LD>(), dob + m0 * p.sdo.row, len - m0);
    Stats st{kInf, 0.f};
    if (threadIdx.x < BM && m0 + threadIdx.x < len) st = Stats{lse_b[m0 + threadIdx.x], delta_b[m0 + threadIdx.x]};
    return st;
  }
  // Block ib's lse and Delta, from load(ib), into its stage (last read by block ib - 2): seen after the
  // block's first barrier.
  __device__ __forceinline__ void put(const Stats& st, int ib) const {
    if (threadIdx.x < BM) {
      lse[(ib & 1) * BM + threadIdx.x] = st.lse * kLog2e;
      delta[(ib & 1) * BM + threadIdx.x] = st.delta;
    }
  }
  // Block 0's lse and Delta.
  __device__ __forceinline__ Stats start(const Params& p, int b, int h, const Seq& sq) const {
    const T* kg = static_cast<const T*>(p.k) + b * p.sk.batch + (sq.start + n0) * p.sk.row + h * p.sk.head;
    const T* vg = static_cast<const T*>(p.v) + b * p.sv.batch + (sq.start + n0) * p.sv.row + h * p.sv.head;
    copy_tile<T, L::BN, D, LD, NT>(k, kg, p.sk.row, sq.len - n0, p.head_dim, p.vec & kVecK);
    copy_tile<T, L::BN, D, LD, NT>(v, vg, p.sv.row, sq.len - n0, p.head_dim, p.vec & kVecV);
    ptx::cp_async_commit();
    const Stats first = load(p, 0);
    ptx::cp_async_commit();
    return first;
  }
};

// dK, dV on mma.sync: NW warps, each owning 16 keys for the whole loop (64 keys a block), over the query
// blocks of BM: S^T = K Q^T and dP^T = V dO^T as mma m16n8k16 (K's and V's A fragments from registers at
// D <= 64, else from shared memory each step; Q's and dO's rows through ldmatrix); then KvRows::step, and
// dV += Pd^T dO and dK += dS^T Q, Pd^T and dS^T the A fragments of their accumulators (as P in the
// forward) and dO, Q through ldmatrix .trans. Q, dO, lse and Delta are double-buffered (KvTiles); keys
// are masked only in blocks that hold an invalid one (their loop of their own).
template <typename T, int D, int BM_, int BN_>
struct MmaKvSmem {
  static constexpr int BN = BN_, BM = BM_;
  static constexpr int LD = D + kPadT<T>;
  static constexpr int k = 0;                                             // [BN, LD]
  static constexpr int v = align128(k + 1LL * BN * LD * sizeof(T));       // [BN, LD]
  static constexpr int q = align128(v + 1LL * BN * LD * sizeof(T));       // [2][BM, LD]
  static constexpr int dO = align128(q + 2LL * BM * LD * sizeof(T));      // [2][BM, LD]
  static constexpr int lse = align128(dO + 2LL * BM * LD * sizeof(T));    // [2][BM] log2 units, +inf: no row
  static constexpr int delta = align128(lse + 2LL * BM * 4);              // [2][BM]
  static constexpr int keep = align128(delta + 2LL * BM * 4);             // [2][BM / 2, BN / 4] (KeepTile)
  static constexpr int bytes = align128(keep + 2LL * (BM / 2) * (BN / 4));
};

template <typename T, int D, int BM, int NW, bool kDropout, bool kVecQD>
__global__ void __launch_bounds__(NW * 32, 1) attention_bwd_dkdv_mma_kernel(const Params p) {
  using L = MmaKvSmem<T, D, BM, 16 * NW>;
  constexpr int BN = 16 * NW, NT = NW * 32, LD = L::LD;
  constexpr int DC = Cfg<T, D>::kMmaColumns, NC = D / DC;  // dK's, dV's columns a block; blocks a key block
  constexpr int KS = D / 16, NS = BM / 8, NO = DC / 8;  // k-steps over the head; n8 tiles of S^T, of dK, dV
  constexpr bool kKVRegs = D <= 64;
  static_assert(BN == L::BN && BM % 16 == 0 && D % 16 == 0 && BM <= NT, "whole 16-row tiles, a thread per query");
  extern __shared__ __align__(128) unsigned char smem[];

  const int b = blockIdx.z, h = blockIdx.y, n0 = blockIdx.x / NC * BN, c0 = blockIdx.x % NC * DC;
  const Seq sq = seq_of(p, b);
  if (n0 >= sq.len) return;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  using Tiles = KvTiles<T, L, D, LD, NT, kVecQD, kDropout>;
  const Tiles tiles(smem, p, b, h, sq, n0);
  // K and V land first (group 0), their fragments read while query block 0 (group 1) is in flight.
  typename Tiles::Stats stats = tiles.start(p, b, h, sq);  // lse and Delta of the block put next
  const KvRows<T, BN, kDropout> rows(p, b, sq, n0, w, lane);
  // ldmatrix row addresses: A (K, V) rows lane % 16, column half lane / 16; B (Q, dO) rows lane % 8 +
  // 8 (lane / 16), column half (lane / 8) % 2; B^T (Q, dO transposed) rows lane % 16, column half lane / 16.
  const int aoff = (16 * w + (lane & 15)) * LD + 8 * (lane >> 4);
  const int boff = ((lane & 7) + 8 * (lane >> 4)) * LD + 8 * ((lane >> 3) & 1);
  const int toff = (lane & 15) * LD + 8 * (lane >> 4);

  uint32_t kf[kKVRegs ? KS : 1][4], vf[kKVRegs ? KS : 1][4];
  if constexpr (kKVRegs) {
    ptx::cp_async_wait<1>();
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      ptx::ldmatrix_x4(kf[ks], tiles.k + aoff + 16 * ks);
      ptx::ldmatrix_x4(vf[ks], tiles.v + aoff + 16 * ks);
    }
  }
  float dk[NO][4], dv[NO][4];
#pragma unroll
  for (int n = 0; n < NO; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) dk[n][i] = dv[n][i] = 0.f;
  }

  // One query block: kMasked zeroes the probabilities of invalid keys.
  const auto block = [&](int ib, auto masked) {
    const int stage = ib & 1;
    tiles.put(stats, ib);
    if (ib + 1 < tiles.nblocks) stats = tiles.load(p, ib + 1);
    ptx::cp_async_commit();
    ptx::cp_async_wait<1>();  // this thread's copies of block ib (and of K, V) have landed
    __syncthreads();          // everyone's have, and the block's lse and Delta are stored
    const T* qs = tiles.q + stage * BM * LD;
    const T* dos = tiles.dO + stage * BM * LD;

    // S^T = K Q^T, dP^T = V dO^T; then s is Pd^T, dp dS^T
    float s[NS][4], dp[NS][4];
    mma_pair_nt<T, KS, NS, LD, kKVRegs>(s, dp, kf, vf, tiles.k + aoff, tiles.v + aoff, qs + boff, dos + boff);
    rows.template step<NS, decltype(masked)::value>(s, dp, tiles.lse + stage * BM, tiles.delta + stage * BM,
                                                   tiles.keep + stage * Tiles::Keep::bytes);

    // dV += Pd^T dO, dK += dS^T Q
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      uint32_t pa[4], da[4];
      accumulators_as_a<T>(pa, s[2 * kk], s[2 * kk + 1]);
      accumulators_as_a<T>(da, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
      for (int n2 = 0; n2 < NO / 2; ++n2) {  // head columns c0 + 16 n2 .. c0 + 16 n2 + 15: two n8 tiles
        uint32_t of[4], qf[4];
        ptx::ldmatrix_x4_trans(of, dos + 16 * kk * LD + toff + c0 + 16 * n2);
        ptx::ldmatrix_x4_trans(qf, qs + 16 * kk * LD + toff + c0 + 16 * n2);
        const uint32_t o0[2] = {of[0], of[1]}, o1[2] = {of[2], of[3]};
        const uint32_t q0[2] = {qf[0], qf[1]}, q1[2] = {qf[2], qf[3]};
        ptx::mma_m16n8k16<T>(dv[2 * n2], pa, o0);
        ptx::mma_m16n8k16<T>(dv[2 * n2 + 1], pa, o1);
        ptx::mma_m16n8k16<T>(dk[2 * n2], da, q0);
        ptx::mma_m16n8k16<T>(dk[2 * n2 + 1], da, q1);
      }
    }
    __syncthreads();  // every warp is done with this stage: the next block's copies overwrite it
  };
  const bool all_keys = p.key_mask == nullptr && n0 + BN <= sq.len;
  if (all_keys) {
    for (int ib = 0; ib < tiles.nblocks; ++ib) block(ib, std::false_type{});
  } else {
    for (int ib = 0; ib < tiles.nblocks; ++ib) block(ib, std::true_type{});
  }
  rows.finish(p, b, h, sq, dk, dv, c0);
}

// dK, dV on wgmma (sm_90a; tile head dims 64 and 128): the mma.sync kernel's algorithm with the
// warpgroup's products, the mirror of the wgmma dQ kernel. The block's 4 warps are one warpgroup over
// 64 keys. S^T = K Q^T and dP^T = V dO^T read both operands from shared memory; dV += Pd^T dO and
// dK += dS^T Q take Pd^T and dS^T from registers and read dO's and Q's tiles transposed. K, V, Q and dO
// are stored in wgmma's 128-byte swizzle; Q's and dO's rows must allow 16-byte copies (the launcher runs
// the mma.sync kernel otherwise).
template <typename T, int D, int BM_>
struct WgmmaKvSmem {
  static constexpr int BN = 64, BM = BM_;
  static constexpr int k = 0;                                    // [BN, D], swizzled (1024-byte aligned)
  static constexpr int v = k + BN * D * 2;                       // [BN, D]
  static constexpr int q = v + BN * D * 2;                       // [2][BM, D]
  static constexpr int dO = q + 2 * BM * D * 2;                  // [2][BM, D]
  static constexpr int lse = dO + 2 * BM * D * 2;                // [2][BM]
  static constexpr int delta = lse + 2 * BM * 4;                 // [2][BM]
  static constexpr int keep = delta + 2 * BM * 4;                // [2][BM / 2, BN / 4] (KeepTile)
  static constexpr int bytes = keep + 2 * (BM / 2) * (BN / 4) + 1024;  // + room to align the tiles
  static_assert(BM * D * 2 % 1024 == 0, "each swizzled tile starts 1024-byte aligned");
};

template <typename T, int D, int BM, bool kDropout>
__global__ void __launch_bounds__(128, 1) attention_bwd_dkdv_wgmma_kernel(const Params p) {
#if defined(BERTFAST_EMU) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = WgmmaKvSmem<T, D, BM>;
  constexpr int BN = L::BN, NT = 128, KS = D / 16, NO = D / 8;
  static_assert(sizeof(T) == 2 && D % 64 == 0 && (BM == 32 || BM == 64 || BM == 128) && BM <= NT,
                "16-bit tiles of whole 64-column blocks, BM an N of wgmma, a thread per query");
  extern __shared__ __align__(1024) unsigned char smem_raw[];

  const int b = blockIdx.z, h = blockIdx.y, n0 = blockIdx.x * BN;
  const Seq sq = seq_of(p, b);
  if (n0 >= sq.len) return;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  using Tiles = KvTiles<T, L, D, kSwizzle128, NT, true, kDropout>;
  const Tiles tiles(ptx::align1024(smem_raw), p, b, h, sq, n0);
  typename Tiles::Stats stats = tiles.start(p, b, h, sq);  // lse and Delta of the block put next
  const KvRows<T, BN, kDropout> rows(p, b, sq, n0, w, lane);
  // Operand descriptors at k-step 0 (of stage 0 for Q, dO), moved per step and stage by a constant.
  const uint64_t k_d = ptx::wgmma_desc_k(ptx::smem_addr(tiles.k)), v_d = ptx::wgmma_desc_k(ptx::smem_addr(tiles.v));
  const uint64_t q_d = ptx::wgmma_desc_k(ptx::smem_addr(tiles.q)), do_d = ptx::wgmma_desc_k(ptx::smem_addr(tiles.dO));
  const uint64_t qt_d = ptx::wgmma_desc_mn<BM>(ptx::smem_addr(tiles.q));
  const uint64_t dot_d = ptx::wgmma_desc_mn<BM>(ptx::smem_addr(tiles.dO));
  constexpr uint32_t kStage = BM * D * 2;  // bytes of a Q or dO stage
  float dk[NO][4], dv[NO][4];
#pragma unroll
  for (int n = 0; n < NO; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) dk[n][i] = dv[n][i] = 0.f;
  }

  const auto block = [&](int ib, auto masked) {
    const int stage = ib & 1;
    tiles.put(stats, ib);
    if (ib + 1 < tiles.nblocks) stats = tiles.load(p, ib + 1);
    ptx::cp_async_commit();
    ptx::cp_async_wait<1>();
    ptx::fence_proxy_async();  // the landed tiles (and Q's, dO's, or K's, V's first copies) visible to wgmma
    __syncthreads();
    const uint32_t at = stage * kStage;

    // S^T = K Q^T, dP^T = V dO^T (m64 x BM, D / 16 k-steps); then s is Pd^T, dp dS^T
    float s[BM / 8][4], dp[BM / 8][4];
    wgmma_pair_nt<T, KS, BN, BM>(s, dp, k_d, v_d, q_d, do_d, at);
    rows.template step<BM / 8, decltype(masked)::value>(s, dp, tiles.lse + stage * BM, tiles.delta + stage * BM,
                                                       tiles.keep + stage * Tiles::Keep::bytes);
    // dV += Pd^T dO, dK += dS^T Q (m64 x D, BM / 16 k-steps over the queries; dO, Q read transposed)
    wgmma_pair_rs<T, BM / 8, D>(dv, dk, s, dp, dot_d, qt_d, at);
    __syncthreads();  // every warp is done with this stage: the next block's copies overwrite it
  };
  const bool all_keys = p.key_mask == nullptr && n0 + BN <= sq.len;
  if (all_keys) {
    for (int ib = 0; ib < tiles.nblocks; ++ib) block(ib, std::false_type{});
  } else {
    for (int ib = 0; ib < tiles.nblocks; ++ib) block(ib, std::true_type{});
  }
  rows.finish(p, b, h, sq, dk, dv);
#else
  __trap();  // not launched: wgmma_available() is false without the sm_90a build
#endif
}

// ------------------------------------------------------------------ backward, fp16/bf16: dQ
// A warp's 16 query rows of dQ (a lane's rows row0 and row0 + 8) in the mma C layout, shared by the
// mma.sync and wgmma kernels: the rows' lse (log2 units; +inf past the sequence: p = 0) and d_i, the
// per-element step from S and dP to P and dS' (step), and the end (finish) that sums r_i, writes Delta_i
// and stores dq_i = c (dQ_i - r_i pk_i).
template <typename T, bool kDropout>
struct DqRows {
  float l2[2], dl[2];
  float resid[2] = {0.f, 0.f};  // this lane's part of r_i
  float scale2, rdrop;
  int row0, krow, g, t;  // krow: the lane's row of the step's keep tile (8w + g)
  __device__ __forceinline__ DqRows(const Params& p, int b, int h, const Seq& sq, int m0, int w, int lane)
      : scale2(p.softmax_scale * kLog2e), rdrop(kDropout ? 1.f / (1.f - p.dropout_p) : 1.f),
        row0(m0 + 16 * w + (lane >> 2)), krow(8 * w + (lane >> 2)), g(lane >> 2), t(lane & 3) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int qi = row0 + 8 * r;
      const int64_t stat = b * p.lse_batch + h * p.lse_head + sq.start + qi;
      l2[r] = qi < sq.len ? p.lse[stat] * kLog2e : kInf;
      dl[r] = qi < sq.len ? p.delta[stat] : 0.f;
    }
  }

  // The step's 8 NS keys (element i of tile n: row row0 + 8 (i / 2), key 8n + 2t + i % 2 of the step); s
  // becomes P, dp dS'. kMasked reads each key's validity from kvalid; keep: the step's KeepTile, whose
  // byte (8w + g, 4c + t) holds the lane's 8 decisions for keys 16c .. 16c + 15.
  template <int NS, bool kMasked>
  __device__ __forceinline__ void step(float (&s)[NS][4], float (&dp)[NS][4], const int* kvalid,
                                       [[maybe_unused]] const uint8_t* keep) {
#pragma unroll
    for (int c = 0; c < NS / 2; ++c) {  // keys 16c .. 16c + 15: the lane's keep byte
      [[maybe_unused]] unsigned kbyte = 0u;
      if constexpr (kDropout) kbyte = keep[krow * (2 * NS) + 4 * c + t];
#pragma unroll
      for (int n = 2 * c; n < 2 * c + 2; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = i >> 1;
          float pv = ptx::exp2_ftz(fmaf(s[n][i], scale2, -l2[r]));
          if constexpr (kMasked) {
            if (!kvalid[8 * n + 2 * t + (i & 1)]) pv = 0.f;
          }
          float dpv = dp[n][i] * rdrop;
          if constexpr (kDropout) {
            if (!((kbyte >> (4 * r + 2 * (n & 1) + (i & 1))) & 1u)) dpv = 0.f;
          }
          const float dsv = pv * (dpv - dl[r]);
          resid[r] += dsv;
          s[n][i] = pv;
          dp[n][i] = dsv;
        }
      }
    }
  }

  // r_i over the row's 4 lanes (a fixed order: deterministic), Delta_i for the dK/dV kernel, then
  // dq_i = c (dQ_i - r_i pk_i): columns c0 .. c0 + 8 NO - 1 (at head dim 256 a block for each half of the
  // columns; both sum the same r_i, the first writes Delta_i).
  template <int NO>
  __device__ __forceinline__ void finish(const Params& p, int b, int h, const Seq& sq, const float (&dq)[NO][4],
                                         const float (&pk)[NO][4], int c0 = 0) const {
    const bool vec_q = p.vec & kVecDQ;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float ri = resid[r];
      ri += __shfl_xor_sync(0xffffffffu, ri, 1);
      ri += __shfl_xor_sync(0xffffffffu, ri, 2);
      const int qi = row0 + 8 * r;
      if (qi >= sq.len) continue;
      if (t == 0 && c0 == 0) p.delta[b * p.lse_batch + h * p.lse_head + sq.start + qi] = dl[r] + ri;
      T* dqr = static_cast<T*>(p.dq) + b * p.sdq.batch + (sq.start + qi) * p.sdq.row + h * p.sdq.head + c0;
#pragma unroll
      for (int n = 0; n < NO; ++n) {
        const float x = (dq[n][2 * r] - ri * pk[n][2 * r]) * p.softmax_scale;
        const float y = (dq[n][2 * r + 1] - ri * pk[n][2 * r + 1]) * p.softmax_scale;
        store_pair<T>(dqr, 8 * n + 2 * t, p.head_dim - c0, x, y, vec_q);
      }
    }
  }
};

// A dQ block's shared memory as L lays it out (MmaDqSmem, WgmmaDqSmem): its own Q and dO tiles, K's and
// V's two stages with their key mask and keep bits (KeepTile, with dropout). start() issues the block's
// copies of Q and dO (cp.async group 0, or element by element) and key block 0's (group 1); load(jb) key
// block jb's into stage jb % 2, for either kernel's tile layout LD.
template <typename T, typename L, int NT, bool kDropout>
struct DqTiles {
  using Keep = KeepTile<L::BM, L::BN, NT>;
  T* q;
  T* dO;
  T* k;
  T* v;
  int* kvalid;
  uint8_t* keep;
  [[maybe_unused]] Keep keepcopy;
  int m0;
  __device__ __forceinline__ DqTiles(unsigned char* smem, const Params& p, int b, int h, int m0_)
      : q(reinterpret_cast<T*>(smem + L::q)), dO(reinterpret_cast<T*>(smem + L::dO)),
        k(reinterpret_cast<T*>(smem + L::k)), v(reinterpret_cast<T*>(smem + L::v)),
        kvalid(reinterpret_cast<int*>(smem + L::kvalid)), keep(smem + L::keep), keepcopy(p, b, h, m0_, 0), m0(m0_) {}
  template <typename KV>
  __device__ __forceinline__ void load(const Params& p, int jb, const KV& kv) const {
    // The keep bits first: issued after K and V, they spilled the mma.sync kernel at D 64 and 96 (ptxas).
    if constexpr (kDropout) keepcopy.issue_keys(keep + (jb & 1) * Keep::bytes, jb);
    kv.load(p, jb, k, v);
  }
  template <int D, int LD, typename KV>
  __device__ __forceinline__ void start(const Params& p, int b, int h, const Seq& sq, const KV& kv) const {
    const T* qg = static_cast<const T*>(p.q) + b * p.sq.batch + (sq.start + m0) * p.sq.row + h * p.sq.head;
    const T* dog = static_cast<const T*>(p.dout) + b * p.sdo.batch + (sq.start + m0) * p.sdo.row + h * p.sdo.head;
    copy_tile<T, L::BM, D, LD, NT>(q, qg, p.sq.row, sq.len - m0, p.head_dim, p.vec & kVecQ);
    copy_tile<T, L::BM, D, LD, NT>(dO, dog, p.sdo.row, sq.len - m0, p.head_dim, p.vec & kVecDO);
    ptx::cp_async_commit();
    load(p, 0, kv);
    ptx::cp_async_commit();
  }
};

// dQ on mma.sync: NW warps, each owning 16 query rows for the whole loop (64 rows a block), over the key
// blocks of BN, K and V double-buffered through cp.async (as the forward). S = Q K^T and dP = dO V^T as mma
// m16n8k16 (Q's and dO's A fragments from registers at D <= 32, else from shared memory each step: at 64
// those registers made the dropout kernel spill; K's and V's rows through ldmatrix); per element p = exp2(s
// c log2 e - lse_i log2 e) and ds' = p (keep dp / (1 - dp) - d_i); then dQ += dS' K and pk += P K, dS' and
// P the A fragments of their accumulators and K through ldmatrix .trans (one load serves both). The delta
// refinement (header): r_i = sum_j ds'_ij over the row's 4 lanes, dq_i = c (dQ_i - r_i pk_i), Delta_i = d_i
// + r_i written for the dK/dV kernel. The keep bits are the forward's tile layout: lane (g, t), 16-key
// block C holds one byte. Rows past the sequence's end read lse = +inf (p = 0); keys are masked only in
// blocks that hold an invalid one (their loop of their own), which store their mask (KvStages::mask).
template <typename T, int D, int BN_, int BM_>
struct MmaDqSmem {
  static constexpr int BM = BM_, BN = BN_;
  static constexpr int LD = D + kPadT<T>;
  static constexpr int q = 0;                                              // [BM, LD]
  static constexpr int dO = align128(q + 1LL * BM * LD * sizeof(T));       // [BM, LD]
  static constexpr int k = align128(dO + 1LL * BM * LD * sizeof(T));       // [2][BN, LD]
  static constexpr int v = align128(k + 2LL * BN * LD * sizeof(T));        // [2][BN, LD]
  static constexpr int kvalid = align128(v + 2LL * BN * LD * sizeof(T));   // [2][BN]
  static constexpr int keep = align128(kvalid + 2LL * BN * 4);             // [2][BM / 2, BN / 4] (KeepTile)
  static constexpr int bytes = align128(keep + 2LL * (BM / 2) * (BN / 4));
};

template <typename T, int D, int BN, int NW, bool kDropout, bool kVecKV>
__global__ void __launch_bounds__(NW * 32, 1) attention_bwd_dq_mma_kernel(const Params p) {
  using L = MmaDqSmem<T, D, BN, 16 * NW>;
  constexpr int BM = 16 * NW, NT = NW * 32, LD = L::LD;
  constexpr int DC = Cfg<T, D>::kMmaColumns, NC = D / DC;  // dQ's columns a block; blocks a query block
  constexpr int KS = D / 16, NO = DC / 8;  // k-steps over the head; n8 tiles of the block's dQ columns
  constexpr bool kQRegs = D <= 32;
  static_assert(BM == L::BM && BN % 16 == 0 && D % 16 == 0 && BN <= NT, "whole 16-key tiles, a thread per key");
  extern __shared__ __align__(128) unsigned char smem[];

  const int b = blockIdx.z, h = blockIdx.y, m0 = blockIdx.x / NC * BM, c0 = blockIdx.x % NC * DC;
  const Seq sq = seq_of(p, b);
  if (m0 >= sq.len) return;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  using Tiles = DqTiles<T, L, NT, kDropout>;
  const Tiles tiles(smem, p, b, h, m0);
  const KvStages<T, BN, D, LD, NT, kVecKV> kv(p, b, h, sq);
  // Q and dO land first (group 0), their fragments read while block 0's K and V (group 1) are in flight.
  tiles.template start<D, LD>(p, b, h, sq, kv);

  DqRows<T, kDropout> rows(p, b, h, sq, m0, w, lane);
  // ldmatrix row addresses: A (Q, dO) rows lane % 16, column half lane / 16; B (K, V) rows lane % 8 +
  // 8 (lane / 16), column half (lane / 8) % 2; B^T (K transposed) rows lane % 16, column half lane / 16.
  const int aoff = (16 * w + (lane & 15)) * LD + 8 * (lane >> 4);
  const int boff = ((lane & 7) + 8 * (lane >> 4)) * LD + 8 * ((lane >> 3) & 1);
  const int toff = (lane & 15) * LD + 8 * (lane >> 4);

  uint32_t qf[kQRegs ? KS : 1][4], of[kQRegs ? KS : 1][4];
  if constexpr (kQRegs) {
    ptx::cp_async_wait<1>();
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      ptx::ldmatrix_x4(qf[ks], tiles.q + aoff + 16 * ks);
      ptx::ldmatrix_x4(of[ks], tiles.dO + aoff + 16 * ks);
    }
  }
  float dq[NO][4], pk[NO][4];
#pragma unroll
  for (int n = 0; n < NO; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) dq[n][i] = pk[n][i] = 0.f;
  }

  // One key block: kMasked tests each key (kvalid), else every key is valid.
  const auto block = [&](int jb, auto masked) {
    const int stage = jb & 1;
    if (jb + 1 < kv.nblocks) tiles.load(p, jb + 1, kv);
    if constexpr (decltype(masked)::value) kv.mask(p, b, jb, tiles.kvalid);
    ptx::cp_async_commit();
    ptx::cp_async_wait<1>();  // this thread's copies of block jb (and of Q, dO) have landed
    __syncthreads();          // everyone's have, and the block's key mask is stored
    const T* ks_ = tiles.k + stage * BN * LD;
    const T* vs_ = tiles.v + stage * BN * LD;

    // S = Q K^T, dP = dO V^T; then s is P, dp dS'
    float s[BN / 8][4], dp[BN / 8][4];
    mma_pair_nt<T, KS, BN / 8, LD, kQRegs>(s, dp, qf, of, tiles.q + aoff, tiles.dO + aoff, ks_ + boff, vs_ + boff);
    rows.template step<BN / 8, decltype(masked)::value>(s, dp, tiles.kvalid + stage * BN,
                                                       tiles.keep + stage * Tiles::Keep::bytes);

    // dQ += dS' K, pk += P K
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t pa[4], da[4];
      accumulators_as_a<T>(pa, s[2 * kk], s[2 * kk + 1]);
      accumulators_as_a<T>(da, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
      for (int n2 = 0; n2 < NO / 2; ++n2) {  // head columns c0 + 16 n2 .. c0 + 16 n2 + 15: two n8 tiles
        uint32_t kf[4];
        ptx::ldmatrix_x4_trans(kf, ks_ + 16 * kk * LD + toff + c0 + 16 * n2);
        const uint32_t k0[2] = {kf[0], kf[1]}, k1[2] = {kf[2], kf[3]};
        ptx::mma_m16n8k16<T>(dq[2 * n2], da, k0);
        ptx::mma_m16n8k16<T>(dq[2 * n2 + 1], da, k1);
        ptx::mma_m16n8k16<T>(pk[2 * n2], pa, k0);
        ptx::mma_m16n8k16<T>(pk[2 * n2 + 1], pa, k1);
      }
    }
    __syncthreads();  // every warp is done with this stage: the next block's copies overwrite it
  };
  int jb = 0;
  for (; jb < kv.nfull; ++jb) block(jb, std::false_type{});
  for (; jb < kv.nblocks; ++jb) block(jb, std::true_type{});
  rows.finish(p, b, h, sq, dq, pk, c0);
}

// dQ on wgmma (sm_90a; tile head dims 64 and 128): the mma.sync kernel's algorithm with the warpgroup's
// products. The block's 4 warps are one warpgroup over 64 query rows. S = Q K^T and dP = dO V^T read
// both operands from shared memory (no fragment loads); dQ += dS' K and pk += P K take dS' and P from
// registers and read the same K tile transposed. Q, dO, K and V are stored in wgmma's 128-byte swizzle
// (kSwizzle128), K and V double-buffered through cp.async as in the mma.sync kernel; K's and V's rows
// must allow 16-byte copies (the launcher runs the mma.sync kernel otherwise).
template <typename T, int D, int BN_>
struct WgmmaDqSmem {
  static constexpr int BM = 64, BN = BN_;
  static constexpr int q = 0;                                    // [BM, D], swizzled (1024-byte aligned)
  static constexpr int dO = q + BM * D * 2;                      // [BM, D]
  static constexpr int k = dO + BM * D * 2;                      // [2][BN, D]
  static constexpr int v = k + 2 * BN * D * 2;                   // [2][BN, D]
  static constexpr int kvalid = v + 2 * BN * D * 2;              // [2][BN]
  static constexpr int keep = kvalid + 2 * BN * 4;               // [2][BM / 2, BN / 4] (KeepTile)
  static constexpr int bytes = keep + 2 * (BM / 2) * (BN / 4) + 1024;  // + room to align the tiles
  static_assert(BN * D * 2 % 1024 == 0, "each swizzled tile starts 1024-byte aligned");
};

template <typename T, int D, int BN, bool kDropout>
__global__ void __launch_bounds__(128, 1) attention_bwd_dq_wgmma_kernel(const Params p) {
#if defined(BERTFAST_EMU) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = WgmmaDqSmem<T, D, BN>;
  constexpr int BM = L::BM, NT = 128, KS = D / 16, NO = D / 8;
  static_assert(sizeof(T) == 2 && D % 64 == 0 && (BN == 32 || BN == 64 || BN == 128) && BN <= NT,
                "16-bit tiles of whole 64-column blocks, BN an N of wgmma, a thread per key");
  extern __shared__ __align__(1024) unsigned char smem_raw[];

  const int b = blockIdx.z, h = blockIdx.y, m0 = blockIdx.x * BM;
  const Seq sq = seq_of(p, b);
  if (m0 >= sq.len) return;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  using Tiles = DqTiles<T, L, NT, kDropout>;
  const Tiles tiles(ptx::align1024(smem_raw), p, b, h, m0);
  const KvStages<T, BN, D, kSwizzle128, NT, true> kv(p, b, h, sq);
  tiles.template start<D, kSwizzle128>(p, b, h, sq, kv);

  DqRows<T, kDropout> rows(p, b, h, sq, m0, w, lane);
  // Operand descriptors at k-step 0 (of stage 0 for K, V), moved per step and stage by a constant.
  const uint64_t q_d = ptx::wgmma_desc_k(ptx::smem_addr(tiles.q)), do_d = ptx::wgmma_desc_k(ptx::smem_addr(tiles.dO));
  const uint64_t k_d = ptx::wgmma_desc_k(ptx::smem_addr(tiles.k)), v_d = ptx::wgmma_desc_k(ptx::smem_addr(tiles.v));
  const uint64_t kt_d = ptx::wgmma_desc_mn<BN>(ptx::smem_addr(tiles.k));
  constexpr uint32_t kStage = BN * D * 2;  // bytes of a K or V stage
  float dq[NO][4], pk[NO][4];
#pragma unroll
  for (int n = 0; n < NO; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) dq[n][i] = pk[n][i] = 0.f;
  }

  const auto block = [&](int jb, auto masked) {
    const int stage = jb & 1;
    if (jb + 1 < kv.nblocks) tiles.load(p, jb + 1, kv);
    if constexpr (decltype(masked)::value) kv.mask(p, b, jb, tiles.kvalid);
    ptx::cp_async_commit();
    ptx::cp_async_wait<1>();
    ptx::fence_proxy_async();  // the landed tiles (and Q's, dO's, or K's, V's first copies) visible to wgmma
    __syncthreads();
    const uint32_t at = stage * kStage;

    // S = Q K^T, dP = dO V^T (m64 x BN, D / 16 k-steps); then s is P, dp dS'
    float s[BN / 8][4], dp[BN / 8][4];
    wgmma_pair_nt<T, KS, BM, BN>(s, dp, q_d, do_d, k_d, v_d, at);
    rows.template step<BN / 8, decltype(masked)::value>(s, dp, tiles.kvalid + stage * BN,
                                                       tiles.keep + stage * Tiles::Keep::bytes);
    // dQ += dS' K, pk += P K (m64 x D, BN / 16 k-steps over the keys; K read transposed for both)
    wgmma_pair_rs<T, BN / 8, D>(dq, pk, dp, s, kt_d, kt_d, at);
    __syncthreads();  // every warp is done with this stage: the next block's copies overwrite it
  };
  int jb = 0;
  for (; jb < kv.nfull; ++jb) block(jb, std::false_type{});
  for (; jb < kv.nblocks; ++jb) block(jb, std::true_type{});
  rows.finish(p, b, h, sq, dq, pk);
#else
  __trap();  // not launched: wgmma_available() is false without the sm_90a build
#endif
}


// ------------------------------------------------------------------ backward in one pass, short sequences
// Sequences of at most 64 NWG tokens at tile head dim 64, on wgmma (sm_90a): one block per (sequence, head),
// NWG warpgroups, holding every query, key and value of the sequence, computes dQ, dK and dV in one pass
// over them (no delta kernel, no second read of Q, K, V and dO: the two-kernel backward reads each twice).
// Warpgroup w owns queries 64 w .. 64 w + 63, then keys 64 w .. 64 w + 63:
//   1. S = Q K^T and dP = dO V^T over every key (m64 x S, both operands from shared memory); the rows are
//      whole, so Delta_i = sum_j p_ij dp_ij is summed here in fp32 (exact: nothing to refine);
//      Pd = keep p / (1 - dp) and dS = p (dp - Delta) go to shared memory, and dQ = c dS K takes dS from
//      registers (K read transposed) and is written.
//   2. After a barrier: dV = Pd^T dO and dK = c dS^T Q for the warpgroup's keys, A read transposed from
//      the stored Pd and dS (every query's rows), B (dO, Q) transposed.
// Keys past the sequence's end are zero rows of K and V (the copies zero them), so without a key mask
// they add nothing to Delta or dQ: their p is clamped to 1 (it is <= 1 for every real key; unclamped,
// exp(-lse) could overflow), and their dK, dV rows are not written. With a key mask (kKeyMask) each
// key's validity is tested. The tiles are the 128-byte swizzle; Pd and dS are [S queries, S keys]. Q's,
// dO's, K's and V's rows must allow 16-byte copies (the launcher runs the two-kernel backward otherwise).
template <typename T, int D, int NWG>
struct WgmmaFusedSmem {
  static constexpr int S = 64 * NWG;             // the tokens a block holds
  static constexpr int q = 0;                    // [S, D], swizzled (1024-byte aligned)
  static constexpr int dO = q + S * D * 2;       // [S, D]
  static constexpr int k = dO + S * D * 2;       // [S, D]
  static constexpr int v = k + S * D * 2;        // [S, D]
  static constexpr int pd = v + S * D * 2;       // [S, S]
  static constexpr int ds = pd + S * S * 2;      // [S, S]
  static constexpr int kvalid = ds + S * S * 2;  // [S]
  static constexpr int bytes = kvalid + S * 4 + 1024;  // + room to align the tiles
};

template <typename T, int D, int NWG, bool kDropout, bool kKeyMask>
__global__ void __launch_bounds__(128 * NWG, 1) attention_bwd_fused_wgmma_kernel(const Params p) {
#if defined(BERTFAST_EMU) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = WgmmaFusedSmem<T, D, NWG>;
  constexpr int S = L::S, NT = 128 * NWG, KS = D / 16, NS = S / 8, NO = D / 8;
  static_assert(sizeof(T) == 2 && D == 64 && (NWG == 1 || NWG == 2),
                "16-bit tiles at head dim 64 (S, dP and dQ take 160 registers a thread), 64 or 128 tokens");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = ptx::align1024(smem_raw);
  T* qs = reinterpret_cast<T*>(smem + L::q);
  T* dos = reinterpret_cast<T*>(smem + L::dO);
  T* ks = reinterpret_cast<T*>(smem + L::k);
  T* vs = reinterpret_cast<T*>(smem + L::v);
  T* pds = reinterpret_cast<T*>(smem + L::pd);
  T* dss = reinterpret_cast<T*>(smem + L::ds);
  [[maybe_unused]] int* kvalid = reinterpret_cast<int*>(smem + L::kvalid);

  const int b = blockIdx.z, h = blockIdx.y;
  const Seq sq = seq_of(p, b);
  if (sq.len <= 0) return;
  const int wg = threadIdx.x >> 7, w = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const auto first = [&](const void* x, const Strides& s) {
    return static_cast<const T*>(x) + b * s.batch + sq.start * s.row + h * s.head;
  };
  using Copy = TileCopy<T, S, D, kSwizzle128, NT, true>;
  Copy(p.head_dim, p.sq.row).issue(qs, first(p.q, p.sq), sq.len);
  Copy(p.head_dim, p.sdo.row).issue(dos, first(p.dout, p.sdo), sq.len);
  Copy(p.head_dim, p.sk.row).issue(ks, first(p.k, p.sk), sq.len);
  Copy(p.head_dim, p.sv.row).issue(vs, first(p.v, p.sv), sq.len);
  ptx::cp_async_commit();
  if constexpr (kKeyMask) {
    if (threadIdx.x < S) kvalid[threadIdx.x] = key_valid(p, b, threadIdx.x, sq.len);
  }
  const int m0 = 64 * wg;                  // the warpgroup's first query, then its first key
  const int row0 = m0 + 16 * w + g;        // this lane's rows (queries, then keys) row0 and row0 + 8
  const int64_t stat = b * p.lse_batch + h * p.lse_head + sq.start;
  float l2[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) l2[r] = row0 + 8 * r < sq.len ? p.lse[stat + row0 + 8 * r] * kLog2e : kInf;
  ptx::cp_async_wait<0>();
  ptx::fence_proxy_async();  // the landed tiles visible to wgmma
  __syncthreads();

  if (m0 < sq.len) {
    // S = Q K^T, dP = dO V^T: the warpgroup's 64 queries against every key
    float s[NS][4], dp[NS][4];
    const uint64_t k_d = ptx::wgmma_desc_k(ptx::smem_addr(ks)), v_d = ptx::wgmma_desc_k(ptx::smem_addr(vs));
    wgmma_pair_nt<T, KS, S, S>(s, dp, ptx::wgmma_desc_k(ptx::smem_addr(qs + m0 * D)),
                               ptx::wgmma_desc_k(ptx::smem_addr(dos + m0 * D)), k_d, v_d, 0);
    // s becomes P (Pd stored), dp keep dP / (1 - dp); element i of tile n: row row0 + 8 (i / 2), key
    // 8n + 2t + i % 2; a lane's keep byte holds keys 16c .. 16c + 15 of its two rows.
    const float scale2 = p.softmax_scale * kLog2e;
    const float rdrop = kDropout ? 1.f / (1.f - p.dropout_p) : 1.f;
    [[maybe_unused]] const KeepBits keep_bits(p, b, h);
    float delta[2] = {0.f, 0.f};
#pragma unroll
    for (int c = 0; c < NS / 2; ++c) {
      [[maybe_unused]] unsigned kbyte = 0u;
      if constexpr (kDropout) kbyte = *keep_bits.byte((m0 >> 4) + w, g, c, t);
#pragma unroll
      for (int n = 2 * c; n < 2 * c + 2; ++n) {
        float pd[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = i >> 1;
          float pv = fminf(ptx::exp2_ftz(fmaf(s[n][i], scale2, -l2[r])), 1.f);
          if constexpr (kKeyMask) {
            if (!kvalid[8 * n + 2 * t + (i & 1)]) pv = 0.f;
          }
          float dpv = dp[n][i] * rdrop;
          pd[i] = pv * rdrop;
          if constexpr (kDropout) {
            if (!((kbyte >> (4 * r + 2 * (n & 1) + (i & 1))) & 1u)) dpv = pd[i] = 0.f;
          }
          delta[r] = fmaf(pv, dpv, delta[r]);
          s[n][i] = pv;
          dp[n][i] = dpv;
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          *reinterpret_cast<uint32_t*>(pds + ptx::sw128_offset<S>(row0 + 8 * r, 8 * n + 2 * t)) =
              ptx::pack2<T>(pd[2 * r], pd[2 * r + 1]);
        }
      }
    }
    // Delta over the row's 4 lanes (a fixed order: deterministic), then dS
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      delta[r] += __shfl_xor_sync(0xffffffffu, delta[r], 1);
      delta[r] += __shfl_xor_sync(0xffffffffu, delta[r], 2);
    }
    uint32_t dsa[NS / 2][4];  // dS as the A fragments of dQ's k-steps (16 keys each), stored as they are
#pragma unroll
    for (int n = 0; n < NS; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) dp[n][i] = s[n][i] * (dp[n][i] - delta[i >> 1]);
    }
#pragma unroll
    for (int kk = 0; kk < NS / 2; ++kk) {
      accumulators_as_a<T>(dsa[kk], dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // a[i]: row row0 + 8 (i % 2), keys 16 kk + 8 (i / 2) + 2t, + 1
        *reinterpret_cast<uint32_t*>(dss + ptx::sw128_offset<S>(row0 + 8 * (i & 1), 16 * kk + 8 * (i >> 1) + 2 * t)) =
            dsa[kk][i];
      }
    }
    // dQ = c dS K (m64 x D, S / 16 k-steps over the keys; K read transposed)
    float dq[NO][4];
    const uint64_t kt_d = ptx::wgmma_desc_mn<S>(ptx::smem_addr(ks));
    ptx::wgmma_fence();
    wgmma_issue_rs<T, NS / 2, D>(dq, dsa, kt_d, 0, false);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    store_rows<T, NO>(p.dq, p.sdq, b, h, sq, row0, dq, p.softmax_scale, p.head_dim, p.vec & kVecDQ);
  } else {
    // No query here (a sequence of at most 64 tokens in a 128-token block): the rows of Pd and dS the
    // other warpgroups read are zero.
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int i = 0; i < 64 * S * 2 / 16 / 128; ++i) {  // 16-byte stores into each 64-column block's rows
      const int e = 8 * (threadIdx.x - 128 * wg + 128 * i), cb = e / (64 * 64);
      *reinterpret_cast<uint4*>(pds + cb * S * 64 + m0 * 64 + e % (64 * 64)) = zero;
      *reinterpret_cast<uint4*>(dss + cb * S * 64 + m0 * 64 + e % (64 * 64)) = zero;
    }
  }
  ptx::fence_proxy_async();  // this thread's Pd and dS stores visible to wgmma
  __syncthreads();

  if (m0 < sq.len) {
    // dV = Pd^T dO, dK = c dS^T Q for the warpgroup's keys (m64 x D, S / 16 k-steps over the queries)
    float dk[NO][4], dv[NO][4];
    const uint64_t pdt_d = ptx::wgmma_desc_mn<S>(ptx::smem_addr(pds + m0 * S));
    const uint64_t dst_d = ptx::wgmma_desc_mn<S>(ptx::smem_addr(dss + m0 * S));
    const uint64_t dot_d = ptx::wgmma_desc_mn<S>(ptx::smem_addr(dos)), qt_d = ptx::wgmma_desc_mn<S>(ptx::smem_addr(qs));
    ptx::wgmma_fence();
#pragma unroll
    for (int ks_ = 0; ks_ < S / 16; ++ks_) {
      const uint32_t at = ptx::mn_major_step(ks_);
      ptx::wgmma_ss<T, D, true, true>(dv, ptx::wgmma_desc_add(pdt_d, at), ptx::wgmma_desc_add(dot_d, at), ks_ > 0);
      ptx::wgmma_ss<T, D, true, true>(dk, ptx::wgmma_desc_add(dst_d, at), ptx::wgmma_desc_add(qt_d, at), ks_ > 0);
    }
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    store_rows<T, NO>(p.dk, p.sdk, b, h, sq, row0, dk, p.softmax_scale, p.head_dim, p.vec & kVecDK);
    store_rows<T, NO>(p.dv, p.sdv, b, h, sq, row0, dv, 1.f, p.head_dim, p.vec & kVecDV);
  }
#else
  __trap();  // not launched: wgmma_available() is false without the sm_90a build
#endif
}

template <typename T, int D>
struct Bwd {
  static int run(const Params& p, cudaStream_t stream) {
    using C = Cfg<T, D>;
    // The wgmma kernels' tiles (fp16/bf16, head dims 64 and 128), and whether this device runs them
    // (asked once a launch: an sm_90 GPU and the sm_90a build).
    constexpr bool kWgmmaTile = k16Bit<T> && D % 64 == 0 && D <= 128;
    const bool wgmma = kWgmmaTile && wgmma_available();
    const bool vec_kv = (p.vec & kVecK) && (p.vec & kVecV), vec_qd = (p.vec & kVecQ) && (p.vec & kVecDO);
    if constexpr (k16Bit<T> && D == 64) {
      if (wgmma && vec_kv && vec_qd && p.max_seqlen <= kFusedBwdMaxSeqlen) return run_fused(p, stream);
    }

    attention_bwd_delta_kernel<T><<<grid_for(p, 4), 128, 0, stream>>>(p);
    BF_CHECK_LAUNCH("attention_bwd (delta)");

    // dQ: wgmma with 16-byte K and V rows, else mma.sync (fp16/bf16), else the FMA kernel (fp32).
    if (wgmma && vec_kv) {
      if constexpr (kWgmmaTile) {
        constexpr int BN = C::kWgmmaDqBN;
        using LW = WgmmaDqSmem<T, D, BN>;
        auto dq = p.dropout_p > 0.f ? attention_bwd_dq_wgmma_kernel<T, D, BN, true>
                                    : attention_bwd_dq_wgmma_kernel<T, D, BN, false>;
        if (int s = prepare(dq, LW::bytes, "attention_bwd (dq)")) return s;
        dq<<<grid_for(p, LW::BM), 128, LW::bytes, stream>>>(p);
      }
    } else if constexpr (k16Bit<T>) {
      constexpr int BN = C::kMmaDqBN, BE = C::kMmaDqBNElementwise, NW = C::kMmaWarps;
      // At D 256 with dropout the 16-byte copies' state spills the kernel (sm_90): K, V element by element.
      constexpr bool kBigDrop = D > 128;
      const bool vec = vec_kv && !(kBigDrop && p.dropout_p > 0.f);
      auto dq = by_settings(p.dropout_p > 0.f, vec, [](auto drop, auto vec_) {
        constexpr bool kVec = decltype(vec_)::value && !(kBigDrop && decltype(drop)::value);
        return attention_bwd_dq_mma_kernel<T, D, kVec ? BN : BE, NW, decltype(drop)::value, kVec>;
      });
      const int bytes = vec ? MmaDqSmem<T, D, BN, 16 * NW>::bytes : MmaDqSmem<T, D, BE, 16 * NW>::bytes;
      if (int s = prepare(dq, bytes, "attention_bwd (dq)")) return s;
      dim3 grid = grid_for(p, 16 * NW);
      grid.x *= D / C::kMmaColumns;  // a block per query block and column slice
      dq<<<grid, NW * 32, bytes, stream>>>(p);
    } else {
      using LQ = DqSmem<T, D, C::kDqBM, C::kDqBN, C::kDqWN>;
      auto dq = attention_bwd_dq_kernel<T, D, C::kDqBM, C::kDqBN, C::kDqWN>;
      if (int s = prepare(dq, LQ::bytes, "attention_bwd (dq)")) return s;
      dq<<<grid_for(p, C::kDqBM), C::kDqBM / 16 * C::kDqWN * 32, LQ::bytes, stream>>>(p);
    }
    BF_CHECK_LAUNCH("attention_bwd (dq)");

    // dK, dV: as dQ, wgmma where Q's and dO's rows allow 16-byte copies.
    if (wgmma && vec_qd) {
      if constexpr (kWgmmaTile) {
        using LW = WgmmaKvSmem<T, D, C::kWgmmaKvBM>;
        auto kv = p.dropout_p > 0.f ? attention_bwd_dkdv_wgmma_kernel<T, D, LW::BM, true>
                                    : attention_bwd_dkdv_wgmma_kernel<T, D, LW::BM, false>;
        if (int s = prepare(kv, LW::bytes, "attention_bwd (dk, dv)")) return s;
        kv<<<grid_for(p, LW::BN), 128, LW::bytes, stream>>>(p);
      }
    } else if constexpr (k16Bit<T>) {
      constexpr int BM = C::kMmaKvBM, NW = C::kMmaWarps;
      using LK = MmaKvSmem<T, D, BM, 16 * NW>;
      auto kv = by_settings(p.dropout_p > 0.f, vec_qd, [](auto drop, auto vec) {
        return attention_bwd_dkdv_mma_kernel<T, D, BM, NW, decltype(drop)::value, decltype(vec)::value>;
      });
      if (int s = prepare(kv, LK::bytes, "attention_bwd (dk, dv)")) return s;
      dim3 grid = grid_for(p, LK::BN);
      grid.x *= D / C::kMmaColumns;  // a block per key block and column slice
      kv<<<grid, NW * 32, LK::bytes, stream>>>(p);
    } else {
      using LK = KvSmem<T, D, C::kKvBN, C::kKvBM>;
      auto kv = attention_bwd_dkdv_kernel<T, D, C::kKvBN, C::kKvBM, C::kKvWN>;
      if (int s = prepare(kv, LK::bytes, "attention_bwd (dk, dv)")) return s;
      kv<<<grid_for(p, C::kKvBN), C::kKvBN / 16 * C::kKvWN * 32, LK::bytes, stream>>>(p);
    }
    BF_CHECK_LAUNCH("attention_bwd (dk, dv)");
    return kOk;
  }

  // Sequences of at most kFusedBwdMaxSeqlen tokens: the one-pass kernel, one block per (sequence, head),
  // one warpgroup per 64 tokens of the longest.
  static int run_fused(const Params& p, cudaStream_t stream) {
    const auto pick = [&](auto nwg) -> int {
      constexpr int NWG = decltype(nwg)::value;
      using LF = WgmmaFusedSmem<T, D, NWG>;
      // by_settings' two flags: dropout, and a key mask (whose keys the kernel tests)
      auto kernel = by_settings(p.dropout_p > 0.f, p.key_mask != nullptr, [](auto drop, auto mask) {
        return attention_bwd_fused_wgmma_kernel<T, D, NWG, decltype(drop)::value, decltype(mask)::value>;
      });
      if (int s = prepare(kernel, LF::bytes, "attention_bwd (one pass)")) return s;
      kernel<<<grid_for(p, LF::S), 128 * NWG, LF::bytes, stream>>>(p);
      BF_CHECK_LAUNCH("attention_bwd (one pass)");
      return kOk;
    };
    return p.max_seqlen <= 64 ? pick(std::integral_constant<int, 1>{}) : pick(std::integral_constant<int, 2>{});
  }
};

// Tile head dims up to kBwdSplitHeadDim, and above it (attention_host.cuh).
template <typename T>
int run_bwd(const Params& p, cudaStream_t stream) {
  return dispatch_head_dim<Bwd, T, 16, kBwdSplitHeadDim>(p, stream);
}
template <typename T>
int run_bwd_wide(const Params& p, cudaStream_t stream) {
  return dispatch_head_dim<Bwd, T, kBwdSplitHeadDim + 1, 256>(p, stream);
}

}  // namespace attn
}  // namespace bertfast
