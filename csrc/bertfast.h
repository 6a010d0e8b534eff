// bertfast CUDA launchers: the torch-free C++ API behind the pybind11 module bertfast._C.
//
// Every launcher takes raw device pointers, sizes, strides (in elements) and a cudaStream_t,
// enqueues its kernels on that stream and returns a status: 0 on success, a negative
// bertfast code for a bad argument, or a positive cudaError_t. last_error() gives the message.
// Nothing here allocates device memory: callers (the bertfast.cuda wrappers) pass outputs and
// workspaces, sized with the *_workspace helpers below.
//
// dtype codes: 0 = float32, 1 = float16, 2 = bfloat16. Activations share one dtype; parameters
// (bias, LayerNorm weight/bias) are either the activation dtype or float32; embedding tables
// and their LayerNorm parameters share one dtype that is the output dtype or float32.
// Dropout: keep = uniform(philox(seed, row, column / 4)[column % 4]) >= p, scaled by 1/(1-p);
// seed is a device pointer to one int64 (read only when p > 0), so CUDA graphs can replay it.
#pragma once
#include <cstdint>

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

namespace bertfast {

enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };
enum Status : int { kOk = 0, kErrArgument = -1, kErrUnsupported = -2 };

// Message of the last failing launcher call on this host thread ("" when none).
const char* last_error();

// Number of row blocks (and so rows of per-block partial column sums) the backward row ops
// use for n_rows rows: the workspace of bias_gelu_bwd is [blocks, F] fp32, of
// bias_dropout_residual_layernorm_bwd [blocks, 3, H] fp32, of embeddings_bwd [blocks, 2 (+ TT), H] fp32.
int64_t reduction_blocks(int64_t n_rows);

// Host copy of the device RNG (for tests): Philox4x32-10 of counter c[4] under key k[2].
void philox4x32_10_host(const uint32_t c[4], const uint32_t k[2], uint32_t out[4]);

// ------------------------------------------------------------------ bias + GELU
// y[n, f] = gelu(x[n, f] + bias[f]); approximate: 0 = exact erf form, 1 = tanh form.
int bias_gelu_fwd(const void* x, int64_t x_row_stride, const void* bias, void* y, int64_t n,
                  int64_t f, int act_dtype, int param_dtype, int approximate, cudaStream_t stream);
// dx = dy * gelu'(x + bias) ([n, f] contiguous); dbias[f] = sum_n dx (fp32 partials in workspace).
int bias_gelu_bwd(const void* dy, int64_t dy_row_stride, const void* x, int64_t x_row_stride,
                  const void* bias, void* dx, void* dbias, float* workspace, int64_t n, int64_t f,
                  int act_dtype, int param_dtype, int approximate, cudaStream_t stream);

// ------------------------------------------------------------------ bias + dropout + residual + LayerNorm
// pre = residual + Dropout(x + bias) (rounded to the activation dtype and stored);
// y = (pre - mean) * rstd * weight + ln_bias. bias, residual, keep may be null.
int bias_dropout_residual_layernorm_fwd(const void* x, int64_t x_row_stride, const void* bias, const void* residual,
                  int64_t residual_row_stride, const void* weight, const void* ln_bias, void* y,
                  void* pre_norm, float* mean, float* rstd, bool* keep, int64_t n, int64_t h,
                  float eps, float dropout_p, const int64_t* seed, int act_dtype, int param_dtype,
                  cudaStream_t stream);
// dpre = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * weight; dresidual = dpre;
// dx = Dropout'(dpre); dbias = sum_n dx; dweight = sum_n dy * xhat; dln_bias = sum_n dy.
// dresidual and dbias may be null; dbias takes param_dtype.
int bias_dropout_residual_layernorm_bwd(const void* dy, int64_t dy_row_stride, const void* pre_norm,
                  int64_t pre_row_stride, const float* mean, const float* rstd, const void* weight,
                  void* dx, void* dresidual, void* dbias, void* dweight, void* dln_bias,
                  float* workspace, int64_t n, int64_t h, float dropout_p, const int64_t* seed,
                  int act_dtype, int param_dtype, cudaStream_t stream);

// ------------------------------------------------------------------ embeddings + LayerNorm + dropout
// y[t] = Dropout(LN(word[ids[t]] + pos[pos_ids[t]] + type[type_ids[t]]) * ln_w + ln_b).
// ids are int32 (is64 = 0) or int64 (is64 = 1). Tables and ln params: table_dtype; y: out_dtype.
int embeddings_fwd(const void* ids, int ids64, const void* pos_ids, int pos64, const void* type_ids,
                   int type64, const void* word, const void* pos, const void* type,
                   const void* ln_weight, const void* ln_bias, void* y, float* mean, float* rstd,
                   bool* keep, int64_t t, int64_t h, float eps, float dropout_p,
                   const int64_t* seed, int table_dtype, int out_dtype, cudaStream_t stream);
// Gradients of embeddings_fwd, with no atomics: bitwise the same whatever the block schedule, and no
// host read (CUDA-graph safe). dh, the fp32 gradient of the embedding sum, is stored to dh [t, h] fp32,
// then each table row's tokens are added in a fixed order. The caller sorts the row keys stably:
// ids[t] (word rows), then vocab + pos_ids[t] (position rows), then, when types_sorted,
// vocab + n_pos + type_ids[t]; n = t * (2 + types_sorted) keys, rows = vocab + n_pos (+ n_types).
//   sorted_keys [n] int32, sorted_order [n] int64 (each key's index among the n unsorted keys),
//   row_bounds [rows + 1] int64 (the first sorted index of each key 0 .. rows),
//   chunk_ws [ceil(n / chunk), 2, h] fp32 (chunk: sorted entries per block of the first table pass).
// Unless types_sorted (needed when n_types * h * 4 > 32 KiB), the token types are summed from
// per-block partials instead. workspace: [blocks, 2, h] fp32, then (unless types_sorted)
// [blocks, n_types, h], blocks = reduction_blocks(t). Writes every row of dword [vocab, h],
// dpos [n_pos, h], dtype [n_types, h] (no zeroing needed) and dln_weight/dln_bias, all in table_dtype.
int embeddings_bwd(const void* dy, const void* ids, int ids64, const void* pos_ids, int pos64,
                   const void* type_ids, int type64, const void* word, const void* pos,
                   const void* type, const void* ln_weight, const float* mean, const float* rstd,
                   const int32_t* sorted_keys, const int64_t* sorted_order, const int64_t* row_bounds,
                   void* dword, void* dpos, void* dtype, void* dln_weight, void* dln_bias,
                   float* workspace, float* dh, float* chunk_ws, int64_t t, int64_t h, int64_t vocab,
                   int64_t n_pos, int64_t n_types, int types_sorted, int64_t chunk, float dropout_p,
                   const int64_t* seed, int table_dtype, int out_dtype, cudaStream_t stream);

// ------------------------------------------------------------------ MLM head loss (one chunk, in place)
// Softmax cross-entropy per row m of decoder logits [n, v] (row stride >= v): lse,
// loss = lse - logit[label] (0 when label is -100 or outside [0, v): ignored),
// correct = argmax == label; when compute_grad the row is overwritten with
// grad_scale * (softmax - onehot) (0 on ignored rows).
int mlm_head_loss_fwd(void* logits, int64_t row_stride, const int64_t* labels, float* loss,
                      float* lse, bool* correct, int64_t n, int64_t v, float grad_scale,
                      int compute_grad, int dtype, cudaStream_t stream);

// ------------------------------------------------------------------ attention
// Strides in elements. Token row i of sequence b, head a lives at
//   ptr + b * batch + (start_b + i) * row + a * head
// where start_b = cu_seqlens[b] (varlen) or 0 (padded). lse and delta are fp32 at
//   ptr + b * lse_batch + a * lse_head + start_b + i.
struct Strides {
  int64_t batch, row, head;
};
struct AttentionParams {
  const void* q; Strides sq;
  const void* k; Strides sk;
  const void* v; Strides sv;
  void* out; Strides so;           // forward output; read by the backward (delta)
  const void* dout; Strides sdo;   // backward only
  void* dq; Strides sdq;           // backward outputs
  void* dk; Strides sdk;
  void* dv; Strides sdv;
  float* lse;                      // forward writes, backward reads
  float* delta;                    // backward workspace, same layout as lse
  int64_t lse_batch, lse_head;
  const int32_t* cu_seqlens;       // [batch + 1] for varlen; null for padded
  const uint8_t* key_mask;         // padded: [batch, seqlen] 1 = token (null: all tokens)
  int64_t key_mask_batch;          // batch stride of key_mask
  int batch, heads, head_dim;      // head_dim in [8, 256]; rows need no alignment beyond their dtype's
  int max_seqlen;                  // varlen: max_seqlen; padded: seqlen
  float softmax_scale, dropout_p;
  const int64_t* seed;
  // Dropout's keep bits (with dropout): uint8 [batch, heads, keep_len / 2, keep_len / 4], one bit per
  // score element in the Triton kernel's layout (bertfast.contract.keep_bits_shape; keep_len a
  // multiple of 128, >= max_seqlen): the forward writes its decisions, the backward reads them.
  uint8_t* keep;
  int64_t keep_len;
  int dtype;
};
// Writes out and lse (+inf for a query row with no valid key; its output is 0).
int attention_fwd(const AttentionParams& p, cudaStream_t stream);
// Writes dq, dk, dv (delta is scratch). Rows outside every sequence are not written.
int attention_bwd(const AttentionParams& p, cudaStream_t stream);
// keep[b, a, i, j] (bool, [batch, heads, seqlen, seqlen]) exactly as the attention kernels draw it.
int attention_dropout_mask(bool* keep, int batch, int heads, int seqlen, float dropout_p,
                           const int64_t* seed, cudaStream_t stream);

// Checks of the hand-issued PTX (ptx.cuh, ptx_check.cu), one warp each, for tests/ops/test_ptx.py:
// d = a b + c through mma.m16n8k16 (a [16, 16], b [16, 8] row-major in dtype, c, d [16, 8] fp32);
// ldmatrix variant 0 x4, 1 x4.trans, 2 x2, 3 x2.trans of four 8 x 8 matrices (src [32, 8] 16-bit,
// out [32 lanes, 4] registers); cp.async of 1 KiB in two groups, width bytes a copy (out [3, 512]).
int ptx_check_mma(const void* a, const void* b, const float* c, float* d, int dtype, cudaStream_t stream);
int ptx_check_ldmatrix(const uint16_t* src, uint32_t* out, int variant, cudaStream_t stream);
int ptx_check_cp_async(const uint8_t* src, uint8_t* out, int width, cudaStream_t stream);
// wgmma (wgmma.cuh), one warpgroup: variant 0 d = a b + c and 1 d = a b with A and B from shared memory
// (a [64, 64], b [64, 128]; c, d [64, 64]), 2 d = a b + c with A from registers (a [64, 16], b [32, 128];
// c, d [64, 128]), 3 as 0 with A's tile stored transposed (read MN-major); which k-steps of the tiles each
// reads: ptx_check.cu.
int ptx_check_wgmma(const void* a, const void* b, const float* c, float* d, int dtype, int variant,
                    cudaStream_t stream);
// Whether the wgmma kernels run on the current device: an sm_90 GPU and this build's sm_90a code.
bool wgmma_available();
// mma.sync's throughput (bertfast.perfmodel.mma_rate times it): blocks of 4 warps, each warp iters x 8
// m16n8k16 products on all-ones operands; out[4 * block + warp] = 16384 x iters.
int ptx_mma_rate(float* out, int blocks, int iters, int dtype, cudaStream_t stream);

}  // namespace bertfast
