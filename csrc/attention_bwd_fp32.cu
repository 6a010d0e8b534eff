// The attention backward's kernels for fp32 (attention_bwd.cuh), both halves of the head dims (the FMA
// kernels compile quickly), in a translation unit of their own so the build compiles the dtypes side by
// side (attention_host.cuh, run_bwd and run_bwd_wide).
#include "attention_bwd.cuh"

namespace bertfast {
namespace attn {
template int run_bwd<float>(const Params& p, cudaStream_t stream);
template int run_bwd_wide<float>(const Params& p, cudaStream_t stream);
}  // namespace attn
}  // namespace bertfast
