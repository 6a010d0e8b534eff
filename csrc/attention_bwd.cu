// Attention backward's entry point: the argument checks, then the dtype's launcher (attention_bwd.cuh,
// compiled per dtype in attention_bwd_<dtype>.cu, the wider head dims of fp16/bf16 in
// attention_bwd_<dtype>_wide.cu).
#include "attention_host.cuh"

namespace bertfast {

int attention_bwd(const AttentionParams& args, cudaStream_t stream) {
  clear_error();
  if (int s = attn::check(args, true, "attention_bwd")) return s;
  if (args.batch == 0 || args.max_seqlen == 0) return kOk;
  const attn::Params p = attn::with_vec(args);
  BF_DISPATCH_T(p.dtype, T,
                return p.head_dim <= attn::kBwdSplitHeadDim ? attn::run_bwd<T>(p, stream)
                                                            : attn::run_bwd_wide<T>(p, stream));
  return kOk;
}

}  // namespace bertfast
