// The attention backward's kernels for bf16 (attention_bwd.cuh), in a translation unit of their own so the
// build compiles the dtypes side by side (attention_host.cuh, run_bwd).
#include "attention_bwd.cuh"

namespace bertfast {
namespace attn {
template int run_bwd<__nv_bfloat16>(const Params& p, cudaStream_t stream);
}  // namespace attn
}  // namespace bertfast
