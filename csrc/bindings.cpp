// pybind11 module bertfast._C: thin wrappers over the launchers in bertfast.h.
//
// Pointers and the CUDA stream arrive as Python ints (tensor.data_ptr(),
// torch.cuda.current_stream().cuda_stream; 0 = null); a failing launcher raises RuntimeError
// with its message. Importing the module makes no CUDA call, so it imports without a GPU or
// driver. the bertfast.cuda wrappers validate tensors before calling in here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "bertfast.h"

namespace py = pybind11;
using bertfast::Strides;

namespace {

template <typename T = void>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}
cudaStream_t stream_of(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

void check(int status, const char* what) {
  if (status == 0) return;
  std::string msg = bertfast::last_error();
  if (msg.empty()) msg = std::string(what) + " failed with status " + std::to_string(status);
  throw std::runtime_error(msg);
}

Strides strides(const std::array<int64_t, 3>& s) { return Strides{s[0], s[1], s[2]}; }

using S3 = std::array<int64_t, 3>;

void attention_fwd(uintptr_t q, S3 sq, uintptr_t k, S3 sk, uintptr_t v, S3 sv, uintptr_t out, S3 so,
                   uintptr_t lse, int64_t lse_batch, int64_t lse_head, uintptr_t cu_seqlens, uintptr_t key_mask,
                   int64_t key_mask_batch, int batch, int heads, int head_dim, int max_seqlen, float softmax_scale,
                   float dropout_p, uintptr_t seed, uintptr_t keep, int64_t keep_len, int dtype, uintptr_t stream) {
  bertfast::AttentionParams p{};
  p.q = ptr(q); p.sq = strides(sq);
  p.k = ptr(k); p.sk = strides(sk);
  p.v = ptr(v); p.sv = strides(sv);
  p.out = ptr(out); p.so = strides(so);
  p.lse = ptr<float>(lse); p.lse_batch = lse_batch; p.lse_head = lse_head;
  p.cu_seqlens = ptr<const int32_t>(cu_seqlens);
  p.key_mask = ptr<const uint8_t>(key_mask); p.key_mask_batch = key_mask_batch;
  p.batch = batch; p.heads = heads; p.head_dim = head_dim; p.max_seqlen = max_seqlen;
  p.softmax_scale = softmax_scale; p.dropout_p = dropout_p; p.seed = ptr<const int64_t>(seed); p.dtype = dtype;
  p.keep = ptr<uint8_t>(keep); p.keep_len = keep_len;
  int status;
  {
    py::gil_scoped_release nogil;
    status = bertfast::attention_fwd(p, stream_of(stream));
  }
  check(status, "attention_fwd");
}

void attention_bwd(uintptr_t dout, S3 sdo, uintptr_t q, S3 sq, uintptr_t k, S3 sk, uintptr_t v, S3 sv,
                   uintptr_t out, S3 so, uintptr_t lse, uintptr_t delta, int64_t lse_batch, int64_t lse_head,
                   uintptr_t dq, S3 sdq, uintptr_t dk, S3 sdk, uintptr_t dv, S3 sdv, uintptr_t cu_seqlens,
                   uintptr_t key_mask, int64_t key_mask_batch, int batch, int heads, int head_dim, int max_seqlen,
                   float softmax_scale, float dropout_p, uintptr_t seed, uintptr_t keep, int64_t keep_len, int dtype,
                   uintptr_t stream) {
  bertfast::AttentionParams p{};
  p.dout = ptr(dout); p.sdo = strides(sdo);
  p.q = ptr(q); p.sq = strides(sq);
  p.k = ptr(k); p.sk = strides(sk);
  p.v = ptr(v); p.sv = strides(sv);
  p.out = ptr(out); p.so = strides(so);
  p.lse = ptr<float>(lse); p.delta = ptr<float>(delta); p.lse_batch = lse_batch; p.lse_head = lse_head;
  p.dq = ptr(dq); p.sdq = strides(sdq);
  p.dk = ptr(dk); p.sdk = strides(sdk);
  p.dv = ptr(dv); p.sdv = strides(sdv);
  p.cu_seqlens = ptr<const int32_t>(cu_seqlens);
  p.key_mask = ptr<const uint8_t>(key_mask); p.key_mask_batch = key_mask_batch;
  p.batch = batch; p.heads = heads; p.head_dim = head_dim; p.max_seqlen = max_seqlen;
  p.softmax_scale = softmax_scale; p.dropout_p = dropout_p; p.seed = ptr<const int64_t>(seed); p.dtype = dtype;
  p.keep = ptr<uint8_t>(keep); p.keep_len = keep_len;
  int status;
  {
    py::gil_scoped_release nogil;
    status = bertfast::attention_bwd(p, stream_of(stream));
  }
  check(status, "attention_bwd");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "bertfast CUDA kernels (torch-free launchers; pointers and streams as ints)";
  m.attr("FLOAT32") = static_cast<int>(bertfast::kFloat32);
  m.attr("FLOAT16") = static_cast<int>(bertfast::kFloat16);
  m.attr("BFLOAT16") = static_cast<int>(bertfast::kBFloat16);
#ifdef BERTFAST_CUDA_ARCHS
  m.attr("cuda_archs") = BERTFAST_CUDA_ARCHS;  // compute capabilities compiled in, e.g. "80;90"
#else
  m.attr("cuda_archs") = "";
#endif
#ifdef BERTFAST_CUDA_RUNTIME
  m.attr("cuda_runtime") = BERTFAST_CUDA_RUNTIME;  // "static" or "shared" libcudart
#else
  m.attr("cuda_runtime") = "";
#endif

  m.def("reduction_blocks", &bertfast::reduction_blocks, py::arg("n_rows"),
        "Row blocks (= rows of fp32 partials in the workspace) the backward row ops use.");

  m.def(
      "philox4x32_10",
      [](std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
        std::array<uint32_t, 4> out{};
        bertfast::philox4x32_10_host(c.data(), k.data(), out.data());
        return out;
      },
      py::arg("counter"), py::arg("key"), "Host copy of the kernels' Philox4x32-10 (for tests).");

  m.def(
      "bias_gelu_fwd",
      [](uintptr_t x, int64_t xs, uintptr_t bias, uintptr_t y, int64_t n, int64_t f, int act, int param, int approx,
         uintptr_t stream) {
        int s;
        {
          py::gil_scoped_release nogil;
          s = bertfast::bias_gelu_fwd(ptr(x), xs, ptr(bias), ptr(y), n, f, act, param, approx, stream_of(stream));
        }
        check(s, "bias_gelu_fwd");
      },
      py::arg("x"), py::arg("x_row_stride"), py::arg("bias"), py::arg("y"), py::arg("n"), py::arg("f"),
      py::arg("act_dtype"), py::arg("param_dtype"), py::arg("approximate"), py::arg("stream"));

  m.def(
      "bias_gelu_bwd",
      [](uintptr_t dy, int64_t dys, uintptr_t x, int64_t xs, uintptr_t bias, uintptr_t dx, uintptr_t dbias,
         uintptr_t ws, int64_t n, int64_t f, int act, int param, int approx, uintptr_t stream) {
        int s;
        {
          py::gil_scoped_release nogil;
          s = bertfast::bias_gelu_bwd(ptr(dy), dys, ptr(x), xs, ptr(bias), ptr(dx), ptr(dbias), ptr<float>(ws), n,
                                      f, act, param, approx, stream_of(stream));
        }
        check(s, "bias_gelu_bwd");
      },
      py::arg("dy"), py::arg("dy_row_stride"), py::arg("x"), py::arg("x_row_stride"), py::arg("bias"), py::arg("dx"),
      py::arg("dbias"), py::arg("workspace"), py::arg("n"), py::arg("f"), py::arg("act_dtype"),
      py::arg("param_dtype"), py::arg("approximate"), py::arg("stream"));

  m.def(
      "bias_dropout_residual_layernorm_fwd",
      [](uintptr_t x, int64_t xs, uintptr_t bias, uintptr_t residual, int64_t rs, uintptr_t weight, uintptr_t ln_bias,
         uintptr_t y, uintptr_t pre, uintptr_t mean, uintptr_t rstd, uintptr_t keep, int64_t n, int64_t h, float eps,
         float p, uintptr_t seed, int act, int param, uintptr_t stream) {
        int s;
        {
          py::gil_scoped_release nogil;
          s = bertfast::bias_dropout_residual_layernorm_fwd(ptr(x), xs, ptr(bias), ptr(residual), rs, ptr(weight), ptr(ln_bias), ptr(y),
                                      ptr(pre), ptr<float>(mean), ptr<float>(rstd), ptr<bool>(keep), n, h, eps, p,
                                      ptr<const int64_t>(seed), act, param, stream_of(stream));
        }
        check(s, "bias_dropout_residual_layernorm_fwd");
      },
      py::arg("x"), py::arg("x_row_stride"), py::arg("bias"), py::arg("residual"), py::arg("residual_row_stride"),
      py::arg("weight"), py::arg("ln_bias"), py::arg("y"), py::arg("pre_norm"), py::arg("mean"), py::arg("rstd"),
      py::arg("keep"), py::arg("n"), py::arg("h"), py::arg("eps"), py::arg("dropout_p"), py::arg("seed"),
      py::arg("act_dtype"), py::arg("param_dtype"), py::arg("stream"));

  m.def(
      "bias_dropout_residual_layernorm_bwd",
      [](uintptr_t dy, int64_t dys, uintptr_t pre, int64_t ps, uintptr_t mean, uintptr_t rstd, uintptr_t weight,
         uintptr_t dx, uintptr_t dres, uintptr_t dbias, uintptr_t dweight, uintptr_t dln_bias, uintptr_t ws, int64_t n,
         int64_t h, float p, uintptr_t seed, int act, int param, uintptr_t stream) {
        int s;
        {
          py::gil_scoped_release nogil;
          s = bertfast::bias_dropout_residual_layernorm_bwd(ptr(dy), dys, ptr(pre), ps, ptr<const float>(mean), ptr<const float>(rstd),
                                      ptr(weight), ptr(dx), ptr(dres), ptr(dbias), ptr(dweight), ptr(dln_bias),
                                      ptr<float>(ws), n, h, p, ptr<const int64_t>(seed), act, param,
                                      stream_of(stream));
        }
        check(s, "bias_dropout_residual_layernorm_bwd");
      },
      py::arg("dy"), py::arg("dy_row_stride"), py::arg("pre_norm"), py::arg("pre_row_stride"), py::arg("mean"),
      py::arg("rstd"), py::arg("weight"), py::arg("dx"), py::arg("dresidual"), py::arg("dbias"), py::arg("dweight"),
      py::arg("dln_bias"), py::arg("workspace"), py::arg("n"), py::arg("h"), py::arg("dropout_p"), py::arg("seed"),
      py::arg("act_dtype"), py::arg("param_dtype"), py::arg("stream"));

  m.def(
      "embeddings_fwd",
      [](uintptr_t ids, int ids64, uintptr_t pos_ids, int pos64, uintptr_t type_ids, int type64, uintptr_t word,
         uintptr_t pos, uintptr_t type, uintptr_t lnw, uintptr_t lnb, uintptr_t y, uintptr_t mean, uintptr_t rstd,
         uintptr_t keep, int64_t t, int64_t h, float eps, float p, uintptr_t seed, int table, int out,
         uintptr_t stream) {
        int s;
        {
          py::gil_scoped_release nogil;
          s = bertfast::embeddings_fwd(ptr(ids), ids64, ptr(pos_ids), pos64, ptr(type_ids), type64, ptr(word),
                                       ptr(pos), ptr(type), ptr(lnw), ptr(lnb), ptr(y), ptr<float>(mean),
                                       ptr<float>(rstd), ptr<bool>(keep), t, h, eps, p, ptr<const int64_t>(seed),
                                       table, out, stream_of(stream));
        }
        check(s, "embeddings_fwd");
      },
      py::arg("ids"), py::arg("ids64"), py::arg("pos_ids"), py::arg("pos64"), py::arg("type_ids"), py::arg("type64"),
      py::arg("word"), py::arg("pos"), py::arg("type"), py::arg("ln_weight"), py::arg("ln_bias"), py::arg("y"),
      py::arg("mean"), py::arg("rstd"), py::arg("keep"), py::arg("t"), py::arg("h"), py::arg("eps"),
      py::arg("dropout_p"), py::arg("seed"), py::arg("table_dtype"), py::arg("out_dtype"), py::arg("stream"));

  m.def(
      "embeddings_bwd",
      [](uintptr_t dy, uintptr_t ids, int ids64, uintptr_t pos_ids, int pos64, uintptr_t type_ids, int type64,
         uintptr_t word, uintptr_t pos, uintptr_t type, uintptr_t lnw, uintptr_t mean, uintptr_t rstd,
         uintptr_t sorted_keys, uintptr_t sorted_order, uintptr_t row_bounds, uintptr_t dword, uintptr_t dpos,
         uintptr_t dtype, uintptr_t dlnw, uintptr_t dlnb, uintptr_t ws, uintptr_t dh, uintptr_t chunk_ws, int64_t t,
         int64_t h, int64_t vocab, int64_t n_pos, int64_t n_types, int types_sorted, int64_t chunk, float p,
         uintptr_t seed, int table, int out, uintptr_t stream) {
        int s;
        {
          py::gil_scoped_release nogil;
          s = bertfast::embeddings_bwd(ptr(dy), ptr(ids), ids64, ptr(pos_ids), pos64, ptr(type_ids), type64,
                                       ptr(word), ptr(pos), ptr(type), ptr(lnw), ptr<const float>(mean),
                                       ptr<const float>(rstd), ptr<const int32_t>(sorted_keys),
                                       ptr<const int64_t>(sorted_order), ptr<const int64_t>(row_bounds), ptr(dword),
                                       ptr(dpos), ptr(dtype), ptr(dlnw), ptr(dlnb), ptr<float>(ws), ptr<float>(dh),
                                       ptr<float>(chunk_ws), t, h, vocab, n_pos, n_types, types_sorted, chunk, p,
                                       ptr<const int64_t>(seed), table, out, stream_of(stream));
        }
        check(s, "embeddings_bwd");
      },
      py::arg("dy"), py::arg("ids"), py::arg("ids64"), py::arg("pos_ids"), py::arg("pos64"), py::arg("type_ids"),
      py::arg("type64"), py::arg("word"), py::arg("pos"), py::arg("type"), py::arg("ln_weight"), py::arg("mean"),
      py::arg("rstd"), py::arg("sorted_keys"), py::arg("sorted_order"), py::arg("row_bounds"), py::arg("dword"),
      py::arg("dpos"), py::arg("dtype"), py::arg("dln_weight"), py::arg("dln_bias"), py::arg("workspace"),
      py::arg("dh"), py::arg("chunk_ws"), py::arg("t"), py::arg("h"), py::arg("vocab"), py::arg("n_pos"),
      py::arg("n_types"), py::arg("types_sorted"), py::arg("chunk"), py::arg("dropout_p"), py::arg("seed"),
      py::arg("table_dtype"), py::arg("out_dtype"), py::arg("stream"));

  m.def(
      "mlm_head_loss_fwd",
      [](uintptr_t logits, int64_t rs, uintptr_t labels, uintptr_t loss, uintptr_t lse, uintptr_t correct, int64_t n,
         int64_t v, float grad_scale, int compute_grad, int dtype, uintptr_t stream) {
        int s;
        {
          py::gil_scoped_release nogil;
          s = bertfast::mlm_head_loss_fwd(ptr(logits), rs, ptr<const int64_t>(labels), ptr<float>(loss),
                                              ptr<float>(lse), ptr<bool>(correct), n, v, grad_scale, compute_grad,
                                              dtype, stream_of(stream));
        }
        check(s, "mlm_head_loss_fwd");
      },
      py::arg("logits"), py::arg("row_stride"), py::arg("labels"), py::arg("loss"), py::arg("lse"),
      py::arg("correct"), py::arg("n"), py::arg("v"), py::arg("grad_scale"), py::arg("compute_grad"),
      py::arg("dtype"), py::arg("stream"));

  m.def("attention_fwd", &attention_fwd, py::arg("q"), py::arg("q_strides"), py::arg("k"), py::arg("k_strides"),
        py::arg("v"), py::arg("v_strides"), py::arg("out"), py::arg("out_strides"), py::arg("lse"),
        py::arg("lse_batch"), py::arg("lse_head"), py::arg("cu_seqlens"), py::arg("key_mask"),
        py::arg("key_mask_batch"), py::arg("batch"), py::arg("heads"), py::arg("head_dim"), py::arg("max_seqlen"),
        py::arg("softmax_scale"), py::arg("dropout_p"), py::arg("seed"), py::arg("keep"), py::arg("keep_len"),
        py::arg("dtype"), py::arg("stream"), "Strides are (batch, row, head) in elements.");

  m.def("attention_bwd", &attention_bwd, py::arg("dout"), py::arg("dout_strides"), py::arg("q"), py::arg("q_strides"),
        py::arg("k"), py::arg("k_strides"), py::arg("v"), py::arg("v_strides"), py::arg("out"),
        py::arg("out_strides"), py::arg("lse"), py::arg("delta"), py::arg("lse_batch"), py::arg("lse_head"),
        py::arg("dq"), py::arg("dq_strides"), py::arg("dk"), py::arg("dk_strides"), py::arg("dv"),
        py::arg("dv_strides"), py::arg("cu_seqlens"), py::arg("key_mask"), py::arg("key_mask_batch"),
        py::arg("batch"), py::arg("heads"), py::arg("head_dim"), py::arg("max_seqlen"), py::arg("softmax_scale"),
        py::arg("dropout_p"), py::arg("seed"), py::arg("keep"), py::arg("keep_len"), py::arg("dtype"),
        py::arg("stream"));

  m.def(
      "attention_dropout_mask",
      [](uintptr_t keep, int batch, int heads, int seqlen, float p, uintptr_t seed, uintptr_t stream) {
        int s;
        {
          py::gil_scoped_release nogil;
          s = bertfast::attention_dropout_mask(ptr<bool>(keep), batch, heads, seqlen, p, ptr<const int64_t>(seed),
                                               stream_of(stream));
        }
        check(s, "attention_dropout_mask");
      },
      py::arg("keep"), py::arg("batch"), py::arg("heads"), py::arg("seqlen"), py::arg("dropout_p"), py::arg("seed"),
      py::arg("stream"));

  m.def(
      "ptx_check_mma",
      [](uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t d, int dtype, uintptr_t stream) {
        int s;
        {
          py::gil_scoped_release nogil;
          s = bertfast::ptx_check_mma(ptr(a), ptr(b), ptr<const float>(c), ptr<float>(d), dtype, stream_of(stream));
        }
        check(s, "ptx_check_mma");
      },
      py::arg("a"), py::arg("b"), py::arg("c"), py::arg("d"), py::arg("dtype"), py::arg("stream"));
  m.def(
      "ptx_check_ldmatrix",
      [](uintptr_t src, uintptr_t out, int variant, uintptr_t stream) {
        int s;
        {
          py::gil_scoped_release nogil;
          s = bertfast::ptx_check_ldmatrix(ptr<const uint16_t>(src), ptr<uint32_t>(out), variant, stream_of(stream));
        }
        check(s, "ptx_check_ldmatrix");
      },
      py::arg("src"), py::arg("out"), py::arg("variant"), py::arg("stream"));
  m.def(
      "ptx_check_cp_async",
      [](uintptr_t src, uintptr_t out, int width, uintptr_t stream) {
        int s;
        {
          py::gil_scoped_release nogil;
          s = bertfast::ptx_check_cp_async(ptr<const uint8_t>(src), ptr<uint8_t>(out), width, stream_of(stream));
        }
        check(s, "ptx_check_cp_async");
      },
      py::arg("src"), py::arg("out"), py::arg("width"), py::arg("stream"));
  m.def(
      "ptx_check_wgmma",
      [](uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t d, int dtype, int variant, uintptr_t stream) {
        int s;
        {
          py::gil_scoped_release nogil;
          s = bertfast::ptx_check_wgmma(ptr(a), ptr(b), ptr<const float>(c), ptr<float>(d), dtype, variant,
                                        stream_of(stream));
        }
        check(s, "ptx_check_wgmma");
      },
      py::arg("a"), py::arg("b"), py::arg("c"), py::arg("d"), py::arg("dtype"), py::arg("variant"), py::arg("stream"));
  m.def("wgmma_available", &bertfast::wgmma_available,
        "whether the wgmma kernels run on the current device (an sm_90 GPU, the extension built for sm_90a)");
  m.def(
      "ptx_mma_rate",
      [](uintptr_t out, int blocks, int iters, int dtype, uintptr_t stream) {
        int s;
        {
          py::gil_scoped_release nogil;
          s = bertfast::ptx_mma_rate(ptr<float>(out), blocks, iters, dtype, stream_of(stream));
        }
        check(s, "ptx_mma_rate");
      },
      py::arg("out"), py::arg("blocks"), py::arg("iters"), py::arg("dtype"), py::arg("stream"));
}
