// The attention forward's kernels for fp32 (attention_fwd.cuh), in a translation unit of their own so the
// build compiles the dtypes side by side (attention_host.cuh, run_fwd).
#include "attention_fwd.cuh"

namespace bertfast {
namespace attn {
template int run_fwd<float>(const Params& p, cudaStream_t stream);
}  // namespace attn
}  // namespace bertfast
