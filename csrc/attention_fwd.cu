// Attention forward: its kernel and launcher, and the debug dropout-mask entry point (the math and
// what the kernels share: attention.cuh).
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
  acc.init(Sw + cs * SC, L::LDS);

  const float scale2 = p.softmax_scale * kLog2e;
  const bool dropout = p.dropout_p > 0.f;
  const uint64_t seed = dropout ? static_cast<uint64_t>(*p.seed) : 0;
  const uint64_t drow = static_cast<uint64_t>(b * p.heads + h) * p.max_seqlen + qi;
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

    // Online softmax (slice 0's warp) over this lane's column groups 4 (half + 2 g) .. +3 of row r.
    // The scores are read from smem twice rather than held: held, they push the kernel into
    // spilling on sm_90.
    if (cs == 0) {
      constexpr int G = BN / 8;
      const auto score = [&](int c) { return kvalid[c] ? Sw[r * L::LDS + c] * scale2 : -kInf; };
      float mx = -kInf;
#pragma unroll
      for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int e = 0; e < 4; ++e) mx = fmaxf(mx, score(4 * (half + 2 * g) + e));
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      const float m_new = fmaxf(m_run, mx);
      const float m_use = m_new == -kInf ? 0.f : m_new;  // no valid key yet: keep exp2 finite
      const float alpha = exp2f(m_run - m_use);
      float rsum = 0.f;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        U4 bits{0u, 0u, 0u, 0u};
        if (dropout) bits = dropout_bits(seed, drow, static_cast<uint32_t>((n0 >> 2) + half + 2 * g));
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = 4 * (half + 2 * g) + e;
          const float pv = exp2f(score(c) - m_use);
          rsum += pv;
          const bool keep = !dropout || uniform01(pick(bits, e)) >= p.dropout_p;
          Pw[r * L::LDP + c] = from_f<T>(keep ? pv : 0.f);
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

}  // namespace attn

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
