// Attention forward's entry point: the argument checks, then the dtype's launcher (attention_fwd.cuh,
// compiled per dtype in attention_fwd_<dtype>.cu); and the kernels no dtype selects: fp32's keep-bits
// record and the debug dropout-mask entry point.
#include "attention_host.cuh"

namespace bertfast {
namespace attn {

// ------------------------------------------------------------------ keep bits, fp32
// Every byte of the keep bits (KeepBits) drawn in its own layout, two draws a byte (its rows 16R + r
// and 16R + 8 + r): the fp32 forward's record, whose FMA kernel holds no mma tiles. Grid: byte rows
// (x), sequences (y), heads (z).
__global__ void attention_keep_bits_kernel(const Params p) {
  const int b = blockIdx.y, h = blockIdx.z;
  const Dropout drop(p, b, h);
  const KeepBits keep_bits(p, b, h);
  const int64_t rows = p.keep_len / 2;
  for (int64_t br = blockIdx.x; br < rows; br += gridDim.x) {
    const int R = static_cast<int>(br >> 3), r = static_cast<int>(br & 7);
    for (int bc = threadIdx.x; bc < keep_bits.cols; bc += blockDim.x) {
      const int C = bc >> 2, q = bc & 3;  // columns 16C + 8w + 2q + e: group 4 (C / 2) + q, word 2 (C % 2) + w
      unsigned byte = 0;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const U4 words = drop.group_words(16 * R + 8 * hh + r, (C >> 1) * 4 + q);
#pragma unroll
        for (int w = 0; w < 2; ++w)
          byte |= Dropout::kept_halves(pick(words, 2 * (C & 1) + w), p.threshold) << (4 * hh + 2 * w);
      }
      *keep_bits.byte(R, r, C, q) = static_cast<uint8_t>(byte);
    }
  }
}

void launch_keep_bits(const Params& p, cudaStream_t stream) {
  const unsigned rows = static_cast<unsigned>(p.keep_len / 2 < 4096 ? p.keep_len / 2 : 4096);
  attention_keep_bits_kernel<<<dim3(rows, p.batch, p.heads), 128, 0, stream>>>(p);
}

}  // namespace attn

namespace {

using namespace attn;

// ------------------------------------------------------------------ dropout mask (debug)
// keep [rows = batch * heads * S, S]: row (b * A + a) * S + i, column j, exactly as the kernels draw it
// (Dropout): a thread per group of a row, its 8 columns.
__global__ void attention_dropout_mask_kernel(bool* __restrict__ keep, int64_t rows, int s, float dp,
                                              const int64_t* seed_ptr) {
  const int groups = (s + 31) / 32 * 4;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const Dropout drop(dp, seed_ptr, static_cast<uint32_t>(row / s));
    const int i = static_cast<int>(row % s);
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
      const unsigned bits = dp > 0.f ? drop.group_bits(i, g, keep_threshold(dp)) : ~0u;
#pragma unroll
      for (int k = 0; k < 8; ++k) {  // decision k = 2w + e: column 32 (g / 4) + 8w + 2 (g % 4) + e
        const int j = 32 * (g >> 2) + 8 * (k >> 1) + 2 * (g & 3) + (k & 1);
        if (j < s) keep[row * s + j] = (bits >> k) & 1u;
      }
    }
  }
}

}  // namespace

int attention_fwd(const AttentionParams& args, cudaStream_t stream) {
  clear_error();
  if (int s = attn::check(args, false, "attention_fwd")) return s;
  if (args.batch == 0 || args.max_seqlen == 0) return kOk;
  const attn::Params p = attn::with_vec(args);
  BF_DISPATCH_T(p.dtype, T, return attn::run_fwd<T>(p, stream));
  return kOk;
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
