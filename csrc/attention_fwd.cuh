// Attention forward: its kernels and launcher (the math and what the kernels share: attention.cuh),
// included by the translation unit of each dtype (attention_fwd_<dtype>.cu); the entry point, with the
// dtype-free kernels (fp32's keep-bits record, the debug dropout mask), is attention_fwd.cu.
#pragma once
#include "attention_host.cuh"

namespace bertfast {
namespace attn {

// ------------------------------------------------------------------ forward
// The fp32 staging of O at the end (o; of dQ, dK, dV likewise in the backward) overlaps the
// tiles that are dead by then; bytes covers both uses.
template <typename T, int D, int BM, int BN>
struct FwdSmem {
  static constexpr int LDT = D + kPadT<T>;  // Q, K, V rows
  static constexpr int LDP = BN + kPadT<T>; // P rows
  static constexpr int LDS = BN + kPadF;    // S rows
  static constexpr int LDO = D + kPadF;     // staging of O
  static constexpr int alpha = 0;
  static constexpr int kvalid = align128(alpha + 1LL * BM * 4);
  static constexpr int q = align128(kvalid + 1LL * BN * 4);
  static constexpr int k = align128(q + 1LL * BM * LDT * sizeof(T));
  static constexpr int v = align128(k + 1LL * BN * LDT * sizeof(T));
  static constexpr int s = align128(v + 1LL * BN * LDT * sizeof(T));
  static constexpr int p = align128(s + 1LL * BM * LDS * 4);
  static constexpr int o = q;
  static constexpr int bytes = cmax(align128(p + 1LL * BM * LDP * sizeof(T)), align128(o + 4LL * BM * LDO));
};

template <typename T, int D, int BM, int BN, int WN>
__global__ void __launch_bounds__(BM / 16 * WN * 32) attention_fwd_kernel(const Params p) {
  using L = FwdSmem<T, D, BM, BN>;
  constexpr int NT = BM / 16 * WN * 32;
  constexpr int SC = BN / WN, DC = D / WN;  // a warp's columns of S and of O
  static_assert(SC % 8 == 0 && DC % 16 == 0, "a warp's columns: whole column groups and tiles");
  extern __shared__ __align__(128) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem + L::q);              // [BM, LDT]
  T* Ks = reinterpret_cast<T*>(smem + L::k);              // [BN, LDT]
  T* Vs = reinterpret_cast<T*>(smem + L::v);              // [BN, LDT]
  float* Ss = reinterpret_cast<float*>(smem + L::s);      // [BM, LDS] scores
  T* Ps = reinterpret_cast<T*>(smem + L::p);              // [BM, LDP] probabilities (kept ones)
  int* kvalid = reinterpret_cast<int*>(smem + L::kvalid); // [BN] key is a token of this sequence
  float* alpha_s = reinterpret_cast<float*>(smem + L::alpha);  // [BM] rescale of O this step; 1/l at the end
  float* Os = reinterpret_cast<float*>(smem + L::o);      // [BM, LDO] O staging, over Q, K, V, S, P

  const int b = blockIdx.z, h = blockIdx.y, m0 = blockIdx.x * BM;
  const Seq sq = seq_of(p, b);
  if (m0 >= sq.len) return;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rg = WN > 1 ? w % (BM / 16) : w, cs = WN > 1 ? w / (BM / 16) : 0;  // row group, column slice
  const int r = lane >> 1, half = lane & 1;  // this lane's softmax row (with its pair lane)
  const int qi = m0 + 16 * rg + r;

  const T* q = static_cast<const T*>(p.q) + b * p.sq.batch + (sq.start + m0) * p.sq.row + h * p.sq.head;
  const T* kb = static_cast<const T*>(p.k) + b * p.sk.batch + sq.start * p.sk.row + h * p.sk.head;
  const T* vb = static_cast<const T*>(p.v) + b * p.sv.batch + sq.start * p.sv.row + h * p.sv.head;
  load_tile<T, BM, D, L::LDT, NT>(Qs, q, p.sq.row, sq.len - m0, p.head_dim, p.vec & kVecQ);

  float* Sw = Ss + 16 * rg * L::LDS;
  T* Pw = Ps + 16 * rg * L::LDP;
  WarpAcc<T, DC> acc;
  acc.init();

  const float scale2 = p.softmax_scale * kLog2e;
  const bool dropout = p.dropout_p > 0.f;
  const Dropout drop(p, b, h);
  float m_run = -kInf, l_run = 0.f;  // running max (log2 units) and sum of exp2(s - m); slice 0 only

  for (int n0 = 0; n0 < sq.len; n0 += BN) {
    __syncthreads();  // every warp is done with the previous K, V
    load_tile<T, BN, D, L::LDT, NT>(Ks, kb + n0 * p.sk.row, p.sk.row, sq.len - n0, p.head_dim, p.vec & kVecK);
    load_tile<T, BN, D, L::LDT, NT>(Vs, vb + n0 * p.sv.row, p.sv.row, sq.len - n0, p.head_dim, p.vec & kVecV);
    for (int j = threadIdx.x; j < BN; j += NT) kvalid[j] = key_valid(p, b, n0 + j, sq.len);
    __syncthreads();

    // S = Q K^T, this warp's columns
    warp_gemm_nt<T, SC, D>(Qs + 16 * rg * L::LDT, L::LDT, Ks + cs * SC * L::LDT, L::LDT, Sw + cs * SC, L::LDS);
    sync_row_group<WN>();

    // Online softmax (slice 0's warp) over this lane's half of row r: its dropout groups (Draws).
    // The scores are read from smem twice rather than held: held, they push the kernel into
    // spilling on sm_90.
    if (cs == 0) {
      using DR = Draws<BN>;
      const DR dr(n0, half);
      const auto score = [&](int c) { return kvalid[c] ? Sw[r * L::LDS + c] * scale2 : -kInf; };
      float mx = -kInf;
#pragma unroll
      for (int d = 0; d < DR::kDraws; ++d) {
#pragma unroll
        for (int k = 0; k < DR::kCols; ++k) mx = fmaxf(mx, score(dr.col(d, k)));
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      const float m_new = fmaxf(m_run, mx);
      const float m_use = m_new == -kInf ? 0.f : m_new;  // no valid key yet: keep exp2 finite
      const float alpha = exp2f(m_run - m_use);
      float rsum = 0.f;
#pragma unroll
      for (int d = 0; d < DR::kDraws; ++d) {
        const unsigned bits = dropout ? drop.group_bits(qi, dr.group(d), p.threshold) : ~0u;
#pragma unroll
        for (int k = 0; k < DR::kCols; ++k) {
          const int c = dr.col(d, k);
          const float pv = exp2f(score(c) - m_use);
          rsum += pv;
          Pw[r * L::LDP + c] = from_f<T>((bits >> dr.bit(k)) & 1u ? pv : 0.f);
        }
      }
      rsum += __shfl_xor_sync(0xffffffffu, rsum, 1);
      l_run = l_run * alpha + rsum;
      m_run = m_new;
      if (half == 0) alpha_s[16 * rg + r] = alpha;
    }
    sync_row_group<WN>();

    acc.scale_rows(alpha_s + 16 * rg);
    acc.template mma<BN>(Pw, L::LDP, Vs + cs * DC, L::LDT);  // O += P V, this warp's columns
  }

  __syncthreads();  // every warp is done with the tiles (O is staged over them) and alpha
  if (cs == 0 && half == 0) {
    alpha_s[16 * rg + r] = l_run > 0.f ? 1.f / (l_run * (1.f - p.dropout_p)) : 0.f;
    if (qi < sq.len)
      p.lse[b * p.lse_batch + h * p.lse_head + sq.start + qi] = l_run > 0.f ? (m_run + log2f(l_run)) * kLn2 : kInf;
  }
  float* Ow = Os + 16 * rg * L::LDO + cs * DC;
  acc.store(Ow, L::LDO);
  __syncthreads();  // 1 / l of every row
  if (qi < sq.len) {
    T* o = static_cast<T*>(p.out) + b * p.so.batch + (sq.start + qi) * p.so.row + h * p.so.head + cs * DC;
    write_row<T, DC>(o, Ow + r * L::LDO, p.head_dim - cs * DC, half, alpha_s[16 * rg + r], p.vec & kVecO);
  }
}

// ------------------------------------------------------------------ forward, fp16/bf16: a warp's rows
// A warp's 16 query rows (a lane's rows row0 and row0 + 8) in the mma C layout, shared by the mma.sync and
// wgmma forwards: the online softmax of a key block's scores (step: the running max kept in raw score
// units, the scale > 0, so each probability is one FFMA and one exp2, exp2(s scale log2 e - m); the row's
// max and sum over its 4 lanes; O rescaled; dropout's draws and their keep bits written), and the end
// (finish: out = O / (l (1 - p)) and lse). Dropout: a lane's columns of a 32-key block are one Philox
// group (Dropout), so one draw per row and block gives 8 of its decisions.
template <typename T, bool kDropout>
struct FwdRows {
  float m_run[2] = {-kInf, -kInf}, l_run[2] = {0.f, 0.f};  // per row: running max of raw scores, this lane's sum
  float scale2;
  Dropout drop;
  [[maybe_unused]] KeepBits keep_bits;  // written with dropout
  int row0, r16, g, t;  // r16: the warp's 16-row block of the sequence (keep bits)
  __device__ __forceinline__ FwdRows(const Params& p, int b, int h, int m0, int w, int lane)
      : scale2(p.softmax_scale * kLog2e),
        drop(kDropout ? p.dropout_p : 0.f, p.seed, static_cast<uint32_t>(b * p.heads + h)), keep_bits(p, b, h),
        row0(m0 + 16 * w + (lane >> 2)), r16((m0 >> 4) + w), g(lane >> 2), t(lane & 3) {}

  // Keys n0 .. n0 + 8 NS - 1 (element e of tile n: row row0 + 8 (e / 2), key n0 + 8n + 2t + e % 2): s
  // becomes P (kept), o is rescaled to the new max. kMasked reads each key's validity from kvalid.
  template <int NS, int NO, bool kMasked>
  __device__ __forceinline__ void step(float (&s)[NS][4], float (&o)[NO][4], int n0, const int* kvalid,
                                       const Params& p) {
    float mx[2] = {m_run[0], m_run[1]};
#pragma unroll
    for (int n = 0; n < NS; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if constexpr (kMasked) {
          if (!kvalid[8 * n + 2 * t + (e & 1)]) s[n][e] = -kInf;
        }
        mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
      }
    }
    float m_use[2], alpha[2], rsum[2] = {0.f, 0.f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      m_use[r] = mx[r] == -kInf ? 0.f : mx[r] * scale2;  // no valid key yet: keep exp2 finite
      alpha[r] = ptx::exp2_ftz(m_run[r] * scale2 - m_use[r]);
      m_run[r] = mx[r];
    }
#pragma unroll
    for (int mb = 0; mb < NS / 4; ++mb) {  // 32-key block mb: this lane's group t of it, rows row0, row0 + 8
      [[maybe_unused]] U4 words[2];
      [[maybe_unused]] unsigned kbyte[2] = {0u, 0u};  // the keep bytes of its 16-key halves
      if constexpr (kDropout) {
        const int group = ((n0 >> 5) + mb) * 4 + t;
        words[0] = drop.group_words(row0, group);
        words[1] = drop.group_words(row0 + 8, group);
      }
#pragma unroll
      for (int n = 4 * mb; n < 4 * mb + 4; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          const float pv = ptx::exp2_ftz(fmaf(s[n][e], scale2, -m_use[r]));
          rsum[r] += pv;
          s[n][e] = pv;
          if constexpr (kDropout) {  // decision 2w + e, w = n % 4: half e of word w
            const uint32_t word = pick(words[r], n & 3);
            const bool keep = (e & 1 ? word >> 16 : word & 0xFFFFu) >= p.threshold;
            if (!keep) s[n][e] = 0.f;
            kbyte[(n >> 1) & 1] |= static_cast<unsigned>(keep) << (4 * r + 2 * (n & 1) + (e & 1));  // KeepBits
          }
        }
      }
      if constexpr (kDropout) {
#pragma unroll
        for (int half = 0; half < 2; ++half)
          *keep_bits.byte(r16, g, (n0 >> 4) + 2 * mb + half, t) = static_cast<uint8_t>(kbyte[half]);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + rsum[r];
#pragma unroll
    for (int n = 0; n < NO; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }
  }

  // Each row's sum over its 4 lanes; out = O / (l (1 - p)); lse.
  template <int NO>
  __device__ __forceinline__ void finish(const Params& p, int b, int h, const Seq& sq, const float (&o)[NO][4]) const {
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = l_run[r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      inv[r] = l > 0.f ? 1.f / (l * (kDropout ? 1.f - p.dropout_p : 1.f)) : 0.f;
      const int qi = row0 + 8 * r;
      if (t == 0 && qi < sq.len)
        p.lse[b * p.lse_batch + h * p.lse_head + sq.start + qi] =
            l > 0.f ? (m_run[r] * scale2 + log2f(l)) * kLn2 : kInf;
    }
    const bool vec_o = p.vec & kVecO;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int qi = row0 + 8 * r;
      if (qi >= sq.len) continue;
      T* out = static_cast<T*>(p.out) + b * p.so.batch + (sq.start + qi) * p.so.row + h * p.so.head;
#pragma unroll
      for (int n = 0; n < NO; ++n)
        store_pair<T>(out, 8 * n + 2 * t, p.head_dim, o[n][2 * r] * inv[r], o[n][2 * r + 1] * inv[r], vec_o);
    }
  }
};

// ------------------------------------------------------------------ forward, fp16/bf16: mma.sync
// NW warps, each owning 16 query rows for the whole loop (BM = 16 NW rows a block). S = Q K^T and
// O += P V run as mma m16n8k16 (ptx.cuh) with their fragments in registers: Q's loaded once
// (D <= 128; above, from shared memory each key block, for the registers), K's and V's through
// ldmatrix (V's transposed). K and V are double-buffered: the next key block's cp.async copies are
// in flight while this one computes. The online softmax (FwdRows) runs on S's accumulators: lane (g, t)
// holds rows g and g + 8 at columns 8n + 2t, 8n + 2t + 1. P goes to the second mma as its A operand
// without leaving registers (the accumulators of two n8 tiles are the A fragment of one k16 step). Key
// blocks with every key valid (all but the last, without a key mask) run a loop of their own, with no
// mask; the others test each key.
template <typename T, int D, int BN>
struct MmaFwdSmem {
  static constexpr int BM = 64;
  static constexpr int LD = D + kPadT<T>;  // padded rows: the 8 rows an ldmatrix reads hit distinct banks
  static constexpr int q = 0;                                            // [BM, LD]
  static constexpr int k = align128(q + 1LL * BM * LD * sizeof(T));      // [2][BN, LD]
  static constexpr int v = align128(k + 2LL * BN * LD * sizeof(T));      // [2][BN, LD]
  static constexpr int kvalid = align128(v + 2LL * BN * LD * sizeof(T)); // [2][BN]
  static constexpr int bytes = align128(kvalid + 2LL * BN * 4);
};

// A forward block's shared memory as L lays it out (MmaFwdSmem, WgmmaFwdSmem): its Q tile, K's and V's
// two stages, the key mask. start() issues the copy of Q (cp.async group 0, or element by element) and
// key block 0's K and V (group 1), for either kernel's tile layout LD.
template <typename T, typename L>
struct FwdTiles {
  T* q;
  T* k;
  T* v;
  int* kvalid;
  __device__ __forceinline__ explicit FwdTiles(unsigned char* smem)
      : q(reinterpret_cast<T*>(smem + L::q)), k(reinterpret_cast<T*>(smem + L::k)),
        v(reinterpret_cast<T*>(smem + L::v)), kvalid(reinterpret_cast<int*>(smem + L::kvalid)) {}
  template <int D, int LD, int NT, typename KV>
  __device__ __forceinline__ void start(const Params& p, int b, int h, const Seq& sq, int m0, const KV& kv) const {
    const T* qg = static_cast<const T*>(p.q) + b * p.sq.batch + (sq.start + m0) * p.sq.row + h * p.sq.head;
    copy_tile<T, L::BM, D, LD, NT>(q, qg, p.sq.row, sq.len - m0, p.head_dim, p.vec & kVecQ);
    ptx::cp_async_commit();
    kv.load(p, 0, k, v);
    ptx::cp_async_commit();
  }
};

// kDropout, kVecKV (K's and V's rows allow 16-byte copies): a kernel per setting, so that each
// carries only the instructions it runs.
template <typename T, int D, int BN, int NW, bool kDropout, bool kVecKV>
__global__ void __launch_bounds__(NW * 32, 1) attention_fwd_mma_kernel(const Params p) {
  using L = MmaFwdSmem<T, D, BN>;
  constexpr int BM = 16 * NW, NT = NW * 32, LD = L::LD;
  constexpr int KS = D / 16, NS = BN / 8, NO = D / 8;  // k-steps of Q K^T; n8 tiles of S and of O
  constexpr bool kQRegs = D <= 128;
  static_assert(BM == L::BM && BN % 32 == 0 && D % 16 == 0 && BN <= NT,
                "whole 32-key blocks, 16-column head tiles, a thread per key of a block");
  extern __shared__ __align__(128) unsigned char smem[];
  const FwdTiles<T, L> tiles(smem);

  const int b = blockIdx.z, h = blockIdx.y, m0 = blockIdx.x * BM;
  const Seq sq = seq_of(p, b);
  if (m0 >= sq.len) return;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const KvStages<T, BN, D, LD, NT, kVecKV> kv(p, b, h, sq);
  // Q lands first (group 0), its fragments read while block 0's K and V (group 1) are in flight.
  tiles.template start<D, LD, NT>(p, b, h, sq, m0, kv);

  FwdRows<T, kDropout> rows(p, b, h, m0, w, lane);
  // The lane's ldmatrix row addresses: A (Q) rows lane % 16, column half lane / 16; B (K) rows
  // lane % 8 + 8 (lane / 16), column half (lane / 8) % 2; B^T (V) rows lane % 16, column half lane / 16.
  const T* qrow = tiles.q + (16 * w + (lane & 15)) * LD + 8 * (lane >> 4);
  const int koff = ((lane & 7) + 8 * (lane >> 4)) * LD + 8 * ((lane >> 3) & 1);
  const int voff = (lane & 15) * LD + 8 * (lane >> 4);

  uint32_t qf[kQRegs ? KS : 1][4];
  if constexpr (kQRegs) {
    ptx::cp_async_wait<1>();
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) ptx::ldmatrix_x4(qf[ks], qrow + 16 * ks);
  }
  float o[NO][4];
#pragma unroll
  for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

  // One key block: kMasked tests each key (kvalid), else every key is valid.
  const auto block = [&](int jb, auto masked) {
    constexpr bool kMasked = decltype(masked)::value;
    const int n0 = jb * BN;
    const int stage = jb & 1;
    if (jb + 1 < kv.nblocks) kv.load(p, jb + 1, tiles.k, tiles.v);
    if constexpr (kMasked) kv.mask(p, b, jb, tiles.kvalid);
    ptx::cp_async_commit();
    ptx::cp_async_wait<1>();  // this thread's copies of block jb (and of Q) have landed
    __syncthreads();          // everyone's have, and the block's key mask is stored
    const T* ks_ = tiles.k + stage * BN * LD;
    const T* vs_ = tiles.v + stage * BN * LD;

    // S = Q K^T (raw scores)
    float s[NS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      uint32_t a[4];
      if constexpr (kQRegs) {
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = qf[ks][i];
      } else {
        ptx::ldmatrix_x4(a, qrow + 16 * ks);
      }
#pragma unroll
      for (int n2 = 0; n2 < NS / 2; ++n2) {  // keys 16 n2 .. 16 n2 + 15: two n8 tiles
        uint32_t kf[4];
        ptx::ldmatrix_x4(kf, ks_ + 16 * n2 * LD + koff + 16 * ks);
        const uint32_t b0[2] = {kf[0], kf[1]}, b1[2] = {kf[2], kf[3]};
        if (ks == 0) {
          ptx::mma_m16n8k16_zero<T>(s[2 * n2], a, b0);
          ptx::mma_m16n8k16_zero<T>(s[2 * n2 + 1], a, b1);
        } else {
          ptx::mma_m16n8k16<T>(s[2 * n2], a, b0);
          ptx::mma_m16n8k16<T>(s[2 * n2 + 1], a, b1);
        }
      }
    }

    rows.template step<NS, NO, kMasked>(s, o, n0, tiles.kvalid + stage * BN, p);

    // O += P V: P from S's accumulators, rounded to T
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[4];
      accumulators_as_a<T>(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int n2 = 0; n2 < NO / 2; ++n2) {  // head columns 16 n2 .. 16 n2 + 15: two n8 tiles
        uint32_t vf[4];
        ptx::ldmatrix_x4_trans(vf, vs_ + 16 * kk * LD + voff + 16 * n2);
        const uint32_t b0[2] = {vf[0], vf[1]}, b1[2] = {vf[2], vf[3]};
        ptx::mma_m16n8k16<T>(o[2 * n2], a, b0);
        ptx::mma_m16n8k16<T>(o[2 * n2 + 1], a, b1);
      }
    }
    __syncthreads();  // every warp is done with this stage: the next block's copies overwrite it
  };
  int jb = 0;
  for (; jb < kv.nfull; ++jb) block(jb, std::false_type{});
  for (; jb < kv.nblocks; ++jb) block(jb, std::true_type{});

  rows.finish(p, b, h, sq, o);
}

// ------------------------------------------------------------------ forward, fp16/bf16: wgmma
// The forward on wgmma (sm_90a; tile head dims 64 and 128): the mma.sync kernel's algorithm with the
// warpgroup's products. The block's 4 warps are one warpgroup over 64 query rows. S = Q K^T reads both
// operands from shared memory; O += P V takes P from registers (S's accumulators) and reads V's tile
// transposed. Q, K and V are stored in wgmma's 128-byte swizzle (kSwizzle128), K and V double-buffered
// through cp.async as in the mma.sync kernel; K's and V's rows must allow 16-byte copies (the launcher
// runs the mma.sync kernel otherwise).
template <typename T, int D, int BN>
struct WgmmaFwdSmem {
  static constexpr int BM = 64;
  static constexpr int q = 0;                               // [BM, D], swizzled (1024-byte aligned)
  static constexpr int k = q + BM * D * 2;                  // [2][BN, D]
  static constexpr int v = k + 2 * BN * D * 2;              // [2][BN, D]
  static constexpr int kvalid = v + 2 * BN * D * 2;         // [2][BN]
  static constexpr int bytes = kvalid + 2 * BN * 4 + 1024;  // + room to align the tiles
  static_assert(BN * D * 2 % 1024 == 0, "each swizzled tile starts 1024-byte aligned");
};

template <typename T, int D, int BN, bool kDropout>
__global__ void __launch_bounds__(128, 1) attention_fwd_wgmma_kernel(const Params p) {
#if defined(BERTFAST_EMU) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = WgmmaFwdSmem<T, D, BN>;
  constexpr int BM = L::BM, NT = 128, KS = D / 16, NS = BN / 8, NO = D / 8;
  static_assert(sizeof(T) == 2 && D % 64 == 0 && D <= 128 && (BN == 32 || BN == 64 || BN == 128) && BN <= NT,
                "16-bit tiles of whole 64-column blocks (N of P V at most 128), BN an N of wgmma, a thread per key");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const FwdTiles<T, L> tiles(ptx::align1024(smem_raw));

  const int b = blockIdx.z, h = blockIdx.y, m0 = blockIdx.x * BM;
  const Seq sq = seq_of(p, b);
  if (m0 >= sq.len) return;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const KvStages<T, BN, D, kSwizzle128, NT, true> kv(p, b, h, sq);
  tiles.template start<D, kSwizzle128, NT>(p, b, h, sq, m0, kv);

  FwdRows<T, kDropout> rows(p, b, h, m0, w, lane);
  // Operand descriptors at k-step 0 (of stage 0 for K, V), moved per step and stage by a constant.
  const uint64_t q_d = ptx::wgmma_desc_k(ptx::smem_addr(tiles.q)), k_d = ptx::wgmma_desc_k(ptx::smem_addr(tiles.k));
  const uint64_t vt_d = ptx::wgmma_desc_mn<BN>(ptx::smem_addr(tiles.v));
  constexpr uint32_t kStage = BN * D * 2;  // bytes of a K or V stage
  float o[NO][4];
#pragma unroll
  for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

  const auto block = [&](int jb, auto masked) {
    const int stage = jb & 1;
    if (jb + 1 < kv.nblocks) kv.load(p, jb + 1, tiles.k, tiles.v);
    if constexpr (decltype(masked)::value) kv.mask(p, b, jb, tiles.kvalid);
    ptx::cp_async_commit();
    ptx::cp_async_wait<1>();
    ptx::fence_proxy_async();  // the landed tiles (and Q's first copies) visible to wgmma
    __syncthreads();
    const uint32_t at = stage * kStage;

    // S = Q K^T (m64 x BN, D / 16 k-steps; raw scores)
    float s[NS][4];
    ptx::wgmma_fence();
    wgmma_issue_nt<T, KS, BM, BN>(s, q_d, k_d, at);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    rows.template step<NS, NO, decltype(masked)::value>(s, o, jb * BN, tiles.kvalid + stage * BN, p);

    // O += P V (m64 x D, BN / 16 k-steps over the keys; P from S's accumulators, V read transposed)
    uint32_t pf[NS / 2][4];
#pragma unroll
    for (int kk = 0; kk < NS / 2; ++kk) accumulators_as_a<T>(pf[kk], s[2 * kk], s[2 * kk + 1]);
    ptx::wgmma_fence();
    wgmma_issue_rs<T, NS / 2, D>(o, pf, vt_d, at, true);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    __syncthreads();  // every warp is done with this stage: the next block's copies overwrite it
  };
  int jb = 0;
  for (; jb < kv.nfull; ++jb) block(jb, std::false_type{});
  for (; jb < kv.nblocks; ++jb) block(jb, std::true_type{});
  rows.finish(p, b, h, sq, o);
#else
  __trap();  // not launched: wgmma_available() is false without the sm_90a build
#endif
}

// fp32's record of the keep bits, drawn apart from its FMA kernel (attention_fwd.cu).
void launch_keep_bits(const Params& p, cudaStream_t stream);

template <typename T, int D>
struct Fwd {
  static int run(const Params& p, cudaStream_t stream) {
    using C = Cfg<T, D>;
    // wgmma (an sm_90 GPU and the sm_90a build) at tile head dims 64 and 128 with 16-byte K and V rows,
    // else mma.sync (fp16/bf16), else the FMA kernel (fp32).
    constexpr bool kWgmmaTile = k16Bit<T> && D % 64 == 0 && D <= 128;
    const bool vec = (p.vec & kVecK) && (p.vec & kVecV);
    if (kWgmmaTile && vec && wgmma_available()) {
      if constexpr (kWgmmaTile) {
        using L = WgmmaFwdSmem<T, D, C::kMmaFwdBN>;
        auto kernel = p.dropout_p > 0.f ? attention_fwd_wgmma_kernel<T, D, C::kMmaFwdBN, true>
                                        : attention_fwd_wgmma_kernel<T, D, C::kMmaFwdBN, false>;
        if (int s = prepare(kernel, L::bytes, "attention_fwd")) return s;
        kernel<<<grid_for(p, L::BM), 128, L::bytes, stream>>>(p);
      }
    } else if constexpr (k16Bit<T>) {
      using L = MmaFwdSmem<T, D, C::kMmaFwdBN>;
      constexpr int BN = C::kMmaFwdBN, NW = L::BM / 16;
      auto kernel = by_settings(p.dropout_p > 0.f, vec, [](auto drop, auto vec_kv) {
        return attention_fwd_mma_kernel<T, D, BN, NW, decltype(drop)::value, decltype(vec_kv)::value>;
      });
      if (int s = prepare(kernel, L::bytes, "attention_fwd")) return s;
      kernel<<<grid_for(p, L::BM), L::BM / 16 * 32, L::bytes, stream>>>(p);
    } else {
      using L = FwdSmem<T, D, C::kFwdBM, C::kFwdBN>;
      auto kernel = attention_fwd_kernel<T, D, C::kFwdBM, C::kFwdBN, C::kFwdWN>;
      if (int s = prepare(kernel, L::bytes, "attention_fwd")) return s;
      kernel<<<grid_for(p, C::kFwdBM), C::kFwdBM / 16 * C::kFwdWN * 32, L::bytes, stream>>>(p);
      if (p.dropout_p > 0.f) {
        BF_CHECK_LAUNCH("attention_fwd");
        launch_keep_bits(p, stream);
      }
    }
    BF_CHECK_LAUNCH("attention_fwd");
    return kOk;
  }
};

template <typename T>
int run_fwd(const Params& p, cudaStream_t stream) {
  return dispatch_head_dim<Fwd, T>(p, stream);
}

}  // namespace attn
}  // namespace bertfast
