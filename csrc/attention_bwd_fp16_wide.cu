// The attention backward's kernels for fp16 at tile head dims above 64 (attention_bwd.cuh), in a translation
// unit of their own so the build compiles them beside the rest (attention_host.cuh, run_bwd_wide).
#include "attention_bwd.cuh"

namespace bertfast {
namespace attn {
template int run_bwd_wide<__half>(const Params& p, cudaStream_t stream);
}  // namespace attn
}  // namespace bertfast
