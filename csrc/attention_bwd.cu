// Attention backward: the delta, dQ and dK/dV kernels and their launcher, which runs them in that
// order: the dQ kernel refines delta for the dK/dV kernel (the math and the why: attention.cuh).
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

// Both WMMA backward kernels ask for a minimum of 1 block per SM: without it ptxas (CUDA 13) capped
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
  dk.init(STw + cs * SC, L::LDF);
  dv.init(STw + cs * SC, L::LDF);

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
  static constexpr bool kRefine = kWmma<T>;  // Delta refined (fp16/bf16; header)
  static constexpr int LDT = D + kPadT<T>;   // Q, dO, K, V rows
  static constexpr int LDS = BN + kPadF;     // S and dP rows
  static constexpr int LDP = BN + kPadT<T>;  // dS (and P) rows
  static constexpr int LDO = D + kPadF;      // staging of dQ
  static constexpr int q = 0;
  static constexpr int dO = align128(q + 1LL * BM * LDT * sizeof(T));
  static constexpr int k = align128(dO + 1LL * BM * LDT * sizeof(T));
  static constexpr int v = align128(k + 1LL * BN * LDT * sizeof(T));
  static constexpr int s = align128(v + 1LL * BN * LDT * sizeof(T));
  static constexpr int dp = align128(s + 4LL * BM * LDS);
  static constexpr int ds = align128(dp + 4LL * BM * LDS);
  static constexpr int pp = align128(ds + 1LL * BM * LDP * sizeof(T));
  static constexpr int kvalid = align128(pp + (kRefine ? 1LL * BM * LDP * sizeof(T) : 0));
  static constexpr int resid = align128(kvalid + 4LL * BN);  // [WN, BM] row sums of dS' (kRefine)
  static constexpr int o = 0;
  static constexpr int bytes = cmax(align128(resid + (kRefine ? 4LL * WN * BM : 0)), align128(o + 4LL * BM * LDO));
};

template <typename T, int D, int BM, int BN, int WN>
__global__ void __launch_bounds__(BM / 16 * WN * 32, 1) attention_bwd_dq_kernel(const Params p) {
  using L = DqSmem<T, D, BM, BN, WN>;
  constexpr bool kRefine = L::kRefine;
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
  T* Ps = reinterpret_cast<T*>(smem + L::pp);         // [BM, LDP] probabilities (kRefine)
  int* kvalid = reinterpret_cast<int*>(smem + L::kvalid);  // [BN]
  float* resid_s = reinterpret_cast<float*>(smem + L::resid);  // [WN, BM] (kRefine)
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
  const float dl = qi < sq.len ? p.delta[stat] : 0.f;  // d_i, refined below (kRefine)

  float* Sw = Ss + 16 * rg * L::LDS;
  float* dPw = dPs + 16 * rg * L::LDS;
  T* dSw = dSs + 16 * rg * L::LDP;
  T* Pw = Ps + 16 * rg * L::LDP;
  WarpAcc<T, DC> dq, pk;  // dQ; sum_j p_ij k_j (kRefine)
  dq.init(Sw + cs * SC, L::LDS);
  if constexpr (kRefine) pk.init(Sw + cs * SC, L::LDS);
  float resid = 0.f;  // this lane's part of r_i = sum_j ds'_ij (kRefine)

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
        if constexpr (kRefine) {
          Pw[r * L::LDP + c] = from_f<T>(pv);
          resid += dsv;
        }
      }
    }
    sync_row_group<WN>();
    dq.template mma<BN>(dSw, L::LDP, Ks + cs * DC, L::LDT);  // dQ += dS K, this warp's columns
    if constexpr (kRefine) pk.template mma<BN>(Pw, L::LDP, Ks + cs * DC, L::LDT);  // += P K
  }
  if constexpr (kRefine) {
    // r_i: the lane pair's columns, then the WN column slices (fixed order: deterministic).
    resid += __shfl_xor_sync(0xffffffffu, resid, 1);
    if (half == 0) resid_s[cs * BM + 16 * rg + r] = resid;
    __syncthreads();
    if (cs == 0 && half == 0) {
      float sum = 0.f;
      for (int c = 0; c < WN; ++c) sum += resid_s[c * BM + 16 * rg + r];
      resid_s[16 * rg + r] = sum;
      if (qi < sq.len) p.delta[stat] = dl + sum;  // Delta_i for the dK/dV kernel
    }
    __syncthreads();
    dq.sub_scaled_rows(pk, resid_s + 16 * rg);  // dQ -= r_i pk_i
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

}  // namespace attn

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
