"""mlm_head_loss: the masked-LM loss computed only at labelled positions.

mlm_head_loss gathers the rows that carry a label, runs the head transform (dense -> bias+GELU ->
LayerNorm, through those fused ops) and then the decoder stage, mlm_head_loss_decoder: the
projection onto the vocabulary (weight tied to the word embeddings) and softmax cross-entropy, in
row chunks, so logits for all masked rows never exist at once. No second logits pass: the forward
writes each chunk's logits' gradient over its logits. Where the rows make one chunk (BERT's 15% of a
batch, up to 4,352 rows at V = 30522 in bf16), the forward keeps it and the backward runs the gradient
GEMMs with the loss's incoming gradient folded into their small operands (_one_chunk_grads); over
several chunks the gradients are computed chunk by chunk in the forward, for a loss scale of 1, and the
backward scales them. The chunked driver (``_decoder_loss``) is the same for every backend; a
backend provides only the per-chunk kernel:

    mlm_head_loss_fwd(logits [rows, V], labels [rows], grad_scale, compute_grad)
        -> (loss [rows] fp32, lse [rows] fp32, correct [rows] bool), and with compute_grad the
           logits are overwritten by grad_scale * (softmax - onehot(label)) (0 on ignored rows).

BERTFAST_MLM_HEAD=fused (head_mode): one chunk's forward on a backend that has the fused kernels (Triton's)
is instead its own GEMM with the loss's statistics in the epilogue (mlm_logits_gemm_fwd), and its backward
two GEMMs of its own that form the logits' gradient as they load the forward's softmax, never writing it
(mlm_softmax_gemms_bwd: _fused_forward, _mlm_head_loss_decoder_fused_backward). Its loss and argmax come
from fp32 logits (the label's as x's row times the weight's, in fp32), not from logits rounded to the
activations' dtype, so n_correct may differ where two logits round to one value. Checked on the device,
its labels' range is its statistics kernel's (a flag a row, one assert).

Contract (every backend): labels -100 are ignored; any other label outside [0, V) is a ValueError
(one device sync, in the driver); the kernel alone treats such labels as ignored. The sum of the
loss over labelled rows is fp32; gradients come back in each input's dtype, the weight and bias
gradients accumulated in fp32 over chunks. No labelled row: loss 0 and zero gradients. The torch
backend is at the end of this file; the Triton and CUDA kernels are
bertfast.kernels.mlm_head_loss and bertfast.cuda.mlm_head_loss.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from bertfast import dispatch
from bertfast.contract import (FLOAT_DTYPES, ID_DTYPES, IGNORE_INDEX, check_tensor, env_choice, env_setting,
                               padded_vocab, value_checks)
from bertfast.ops._common import distinct, empty, fp32_gemm_caps, fused_op, no_zero_grads
from bertfast.ops.bias_dropout_residual_layernorm import bias_dropout_residual_layernorm
from bertfast.ops.bias_gelu import bias_gelu

OP = "mlm_head_loss"
Tensor = torch.Tensor


@fused_op("bertfast::mlm_head_loss_decoder")
def _mlm_head_loss_decoder(x: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, chunk_rows: int,
                          compute_grad: bool, one_chunk: bool, fused: bool, backend: str
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss_sum, n_correct, and what the backward needs). one_chunk (with compute_grad): the logits'
    gradient [M, Vp] for a loss scale of 1 and the GEMMs' weight (empty where that is ``weight`` itself), the
    gradients' GEMMs left to the backward; ``fused`` (the loss in the GEMM's epilogue): the softmax's u, the
    GEMMs' weight and the softmax's c (kernels/mlm_head_loss.py, DecoderSoftmax); otherwise the three
    gradients, computed chunk by chunk for a loss scale of 1."""
    impl = dispatch.get(OP, backend).impl
    if one_chunk:
        labels, _, vp = _checked(x, weight, bias, labels, chunk_rows or None, labels_on_device=not fused)
        if fused:
            loss_sum, n_correct, u, w, c = _fused_forward(x, weight, bias, labels, impl)
            return distinct([loss_sum, n_correct, u, empty(weight) if w is weight else w, c], [x, weight, bias, labels])
        loss_sum, n_correct, dlogits, w = _one_chunk_forward(x, weight, bias, labels, vp, 1.0, impl.mlm_head_loss_fwd)
        return distinct([loss_sum, n_correct, dlogits, empty(weight) if w is weight else w, empty(weight)],
                        [x, weight, bias, labels])
    kernel = impl.mlm_head_loss_fwd
    # chunk_rows 0: the default (logits of one chunk within a memory budget).
    loss_sum, n_correct, gx, gw, gb = _decoder_loss(x, weight, bias, labels, chunk_rows or None, compute_grad, 1.0,
                                                    kernel)
    return distinct([loss_sum, n_correct, empty(x) if gx is None else gx, empty(weight) if gw is None else gw,
                     empty(weight) if gb is None else gb], [x, weight, bias, labels])


@_mlm_head_loss_decoder.register_fake
def _(x, weight, bias, labels, chunk_rows, compute_grad, one_chunk, fused, backend):
    scalar = x.new_empty((), dtype=torch.float32)
    count = x.new_empty((), dtype=torch.int64)
    if not compute_grad:
        return scalar, count, empty(x), empty(weight), empty(weight)
    if one_chunk:
        vocab, width = weight.shape
        if fused:
            u_shape, c_shape = dispatch.get(OP, backend).impl.softmax_shapes(x.shape[0], vocab)
            w = empty(weight) if weight.dtype == x.dtype else x.new_empty((vocab, width))
            return scalar, count, x.new_empty(u_shape), w, x.new_empty(c_shape, dtype=torch.float32)
        vp = _gemm_vocab(vocab, x)
        w = empty(weight) if vp == vocab and weight.dtype == x.dtype else x.new_empty((vp, width))
        return scalar, count, x.new_empty((x.shape[0], vp)), w, empty(weight)
    gb = torch.empty_like(bias) if bias is not None else empty(weight)
    return scalar, count, torch.empty_like(x), torch.empty_like(weight), gb


def _setup(ctx, inputs, output):
    x, weight, bias, labels, _, ctx.computed_grad, ctx.one_chunk, ctx.fused, ctx.backend = inputs
    ctx.has_bias = bias is not None
    if ctx.fused:  # the GEMMs' weight, the softmax's u and c, the labels
        ctx.save_for_backward(x, weight, bias, output[3], output[2], output[4], labels)
    else:
        ctx.save_for_backward(*((x, weight, bias, output[3], output[2]) if ctx.one_chunk else output[2:]))
    no_zero_grads(ctx)


def _backward(ctx, d_loss_sum, _d_correct, _d2, _d3, _d4):
    if d_loss_sum is None:
        return (None,) * 9
    if not ctx.computed_grad:
        raise RuntimeError("mlm_head_loss_decoder: backward called on a forward run without gradients")
    if ctx.fused:
        gx, gw, gb = _mlm_head_loss_decoder_fused_backward(*ctx.saved_tensors, d_loss_sum, ctx.backend)
    elif ctx.one_chunk:
        gx, gw, gb = _mlm_head_loss_decoder_backward(*ctx.saved_tensors, d_loss_sum)
    else:
        gx, gw, gb = ctx.saved_tensors
        gx, gw, gb = gx * d_loss_sum.to(gx.dtype), gw * d_loss_sum.to(gw.dtype), gb * d_loss_sum.to(gb.dtype)
    return gx, gw, gb if ctx.has_bias else None, None, None, None, None, None, None


_mlm_head_loss_decoder.register_autograd(_backward, setup_context=_setup)


@fused_op("bertfast::mlm_head_loss_decoder_backward")
def _mlm_head_loss_decoder_backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], w: Tensor, dlogits: Tensor,
                                   grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk's (grad x, grad weight, grad bias or empty) from the forward's logits' gradient, the loss's
    incoming gradient ``grad`` in them (_one_chunk_grads); w: the GEMMs' weight, or empty for ``weight``."""
    gx, gw, gb = _one_chunk_grads(x, weight, bias, w if w.numel() else weight, dlogits, grad)
    return distinct([gx, gw, empty(weight) if gb is None else gb], [x, weight, bias, w, dlogits, grad])


@_mlm_head_loss_decoder_backward.register_fake
def _(x, weight, bias, w, dlogits, grad):
    return torch.empty_like(x), torch.empty_like(weight), empty(weight) if bias is None else torch.empty_like(bias)


@fused_op("bertfast::mlm_head_loss_decoder_fused_backward")
def _mlm_head_loss_decoder_fused_backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], w: Tensor, u: Tensor,
                                         c: Tensor, labels: Tensor, grad: Tensor, backend: str
                                         ) -> tuple[Tensor, Tensor, Tensor]:
    """The fused decoder's (grad x, grad weight, grad bias or empty): the logits' gradient formed inside the
    backward's GEMMs from the forward's softmax (u, c) and never written; w: the GEMMs' weight, or empty for
    ``weight``."""
    impl = dispatch.get(OP, backend).impl
    softmax = impl.DecoderSoftmax(u, c, weight.shape[0])
    gx, gw, gb = impl.mlm_softmax_gemms_bwd(softmax, labels, x, w if w.numel() else weight, grad.float(),
                                            weight.dtype, bias is not None)
    gb = empty(weight) if gb is None else gb.to(bias.dtype)
    return distinct([gx, gw, gb], [x, weight, bias, w, u, c, labels, grad])


@_mlm_head_loss_decoder_fused_backward.register_fake
def _(x, weight, bias, w, u, c, labels, grad, backend):
    return torch.empty_like(x), torch.empty_like(weight), empty(weight) if bias is None else torch.empty_like(bias)


def mlm_head_loss_decoder(x: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                          chunk_rows: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """(sum of CE over labelled rows (fp32 scalar), number of rows whose argmax equals the label).

    x [M, H], weight [V, H], bias [V] or None, labels [M] (-100 = ignored).
    """
    name = "mlm_head_loss_decoder"
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{name}: expected x [rows, H] and weight [vocab, H], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if labels.shape != x.shape[:1]:
        raise ValueError(f"{name}: expected labels of shape [{x.shape[0]}], got {tuple(labels.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{name}: expected bias of shape [{weight.shape[0]}], got {tuple(bias.shape)}")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"{name}: chunk_rows must be >= 1, got {chunk_rows}")
    compute_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    backend = dispatch.select(OP, x=x, weight=weight, bias=bias, labels=labels)
    one_chunk = compute_grad and _one_chunk(x.shape[0], chunk_rows, weight.shape[0], x.element_size())
    fused = fused_decoder(backend, x, weight) and one_chunk  # the mode checked on every call
    loss_sum, n_correct, _, _, _ = _mlm_head_loss_decoder(x, weight, bias, labels.long(), chunk_rows or 0,
                                                          compute_grad, one_chunk, fused, backend)
    return loss_sum, n_correct


def _one_chunk(rows, chunk_rows: Optional[int], vocab: int, element_size: int) -> bool:
    """Whether the decoder's rows make one chunk, whose gradients then wait for the backward. A row count
    Dynamo took from the data (an unbacked size, known only when the graph runs) goes chunked."""
    one = rows <= (chunk_rows or default_chunk_rows(rows, vocab, element_size))
    if not torch.compiler.is_compiling():
        return one
    try:  # False where it is not known when tracing (not a guard: that fails on an unbacked size)
        from torch.fx.experimental.symbolic_shapes import guard_or_false
    except ImportError:  # an older torch: chunked under torch.compile
        return False
    return guard_or_false(one)


class MLMHeadLoss(NamedTuple):
    loss: Tensor  # mean CE over labelled positions (0 when there are none)
    num_correct: Tensor  # int64: labelled positions whose argmax equals the label
    num_predictions: Tensor  # int64: labelled positions


def masked_positions(labels: Tensor, max_predictions_per_seq: Optional[int] = None) -> Tensor:
    """Flat indices of the labelled positions of labels [B, S].

    Without max_predictions_per_seq the count is data-dependent. With it, exactly
    B * max_predictions_per_seq indices come back (static shape): each sequence's labelled
    positions first, then unlabelled ones as filler (their label is -100, so they add nothing).
    Labelled positions beyond the limit raise an error rather than being dropped silently: a
    ValueError on CPU; elsewhere, and under torch.compile, torch._assert_async (no host sync:
    on CUDA a device-side assert, reported at the next sync).
    """
    if max_predictions_per_seq is None:
        if torch.compiler.is_compiling() and not torch._dynamo.config.capture_dynamic_output_shape_ops:
            # nonzero has a data-dependent size, which Dynamo captures only with
            # capture_dynamic_output_shape_ops=True; otherwise every position is a row (unlabelled
            # ones add nothing). max_predictions_per_seq gives the sparse static form.
            return torch.arange(labels.numel(), device=labels.device)
        return (labels.reshape(-1) != IGNORE_INDEX).nonzero().flatten()
    k = check_max_predictions_per_seq(max_predictions_per_seq)
    batch, seqlen = labels.shape
    unlabelled = (labels == IGNORE_INDEX).view(torch.int8)  # a view: sorted as 0s and 1s
    flags, order = torch.sort(unlabelled, dim=1, stable=True)  # labelled first, in order
    if k < seqlen and labels.numel():  # otherwise no sequence can hold more than the limit
        _check_predictions_per_seq(flags[:, k], unlabelled, k)
    starts = torch.arange(0, batch * seqlen, seqlen, device=labels.device)
    return (order[:, :min(k, seqlen)] + starts[:, None]).flatten()


def check_max_predictions_per_seq(k: Optional[int]) -> Optional[int]:
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise ValueError(f"max_predictions_per_seq: expected a positive int or None, got {k!r}")
    return k


def _check_predictions_per_seq(next_flag: Tensor, unlabelled: Tensor, limit: int) -> None:
    """Each sequence's labelled positions at most ``limit``: next_flag [B], each sequence's flag after its first
    ``limit`` in sorted order (1: unlabelled, so no more labelled ones); unlabelled [B, S] the flags."""
    def message(which: str) -> str:
        return (f"mlm_head_loss: {which} labelled positions (labels != {IGNORE_INDEX}), more than "
                f"max_predictions_per_seq={limit}; the extra ones would be dropped: raise the limit or mask fewer "
                f"tokens")
    if next_flag.device.type == "cpu" and value_checks(next_flag) == "host":
        over = (next_flag == 0).nonzero().flatten()
        if over.numel():  # on the host already: name the sequence
            i = int(over[0])
            raise ValueError(message(f"sequence {i} has {int((unlabelled[i] == 0).sum())}"))
        return
    # No host sync on an accelerator (this path serves CUDA graphs): checked on the device, in two kernels.
    torch._assert_async(next_flag.all(), message("a sequence has too many"))


def mlm_head_loss(hidden: Tensor, labels: Tensor, dense_weight: Tensor, dense_bias: Tensor, ln_weight: Tensor,
                  ln_bias: Tensor, eps: float, decoder_weight: Tensor, decoder_bias: Optional[Tensor],
                  approximate: str = "none", max_predictions_per_seq: Optional[int] = None,
                  chunk_rows: Optional[int] = None) -> MLMHeadLoss:
    """MLM loss computed only where labels != -100.

    hidden [B, S, H] (or [N, H] with labels [N]); the transform (dense, GELU, LayerNorm) and the
    decoder run on the gathered rows only. Mean over labelled positions as transformers computes it.
    """
    width = hidden.shape[-1]
    flat_labels = labels.reshape(-1)
    if flat_labels.numel() * width != hidden.numel():
        raise ValueError(f"mlm_head_loss: labels {tuple(labels.shape)} do not match hidden {tuple(hidden.shape)}")
    if max_predictions_per_seq is not None:
        if labels.dim() != 2:
            raise ValueError("mlm_head_loss: max_predictions_per_seq needs labels of shape [batch, seq]")
        positions = masked_positions(labels, max_predictions_per_seq)
    else:
        positions = masked_positions(flat_labels[None])
    rows = hidden.reshape(-1, width).index_select(0, positions)  # [M, H]
    picked_labels = flat_labels.index_select(0, positions)
    h = bias_gelu(F.linear(rows, dense_weight), dense_bias, approximate)
    h = bias_dropout_residual_layernorm(h, None, None, ln_weight, ln_bias, eps)
    loss_sum, num_correct = mlm_head_loss_decoder(h, decoder_weight, decoder_bias, picked_labels, chunk_rows)
    num_predictions = (picked_labels != IGNORE_INDEX).sum()
    return MLMHeadLoss(loss_sum / num_predictions.clamp_min(1), num_correct, num_predictions)


# ------------------------------------------------------------------ the chunked driver (every backend)
# Default size of one chunk of logits: chunk_rows * V * element_size <= 256 MiB.
CHUNK_BYTES = 256 * 2**20
CHUNK_ROW_MULTIPLE = 64


def default_chunk_rows(num_rows: int, vocab_size: int, element_size: int,
                       budget_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk when the caller passes chunk_rows=None.

    The cap is the largest multiple of 64 rows whose logits fit budget_bytes (256 MiB:
    4352 rows for V=30522 in bf16), at least 64. Rows are then spread evenly over the
    chunks the cap requires (rounded up to a multiple of 64, never above the cap), so
    e.g. 4915 rows run as 2 chunks of 2496 + 2419 rather than 4352 + 563.
    """
    cap = max(CHUNK_ROW_MULTIPLE,
              budget_bytes // max(1, vocab_size * element_size) // CHUNK_ROW_MULTIPLE * CHUNK_ROW_MULTIPLE)
    if num_rows <= cap:
        return max(1, num_rows)
    n_chunks = -(-num_rows // cap)
    per_chunk = -(-num_rows // n_chunks)
    return min(cap, -(-per_chunk // CHUNK_ROW_MULTIPLE) * CHUNK_ROW_MULTIPLE)


def _accumulate_grad_weight(acc: torch.Tensor, dlogits_t: torch.Tensor, x_c: torch.Tensor,
                            first: bool) -> None:
    """acc [V, H] = (first) or += dlogits_t [V, rows] @ x_c [rows, H].

    acc in the inputs' dtype (fp32 inputs; or one chunk's low-precision gradient, its one GEMM):
    the GEMM writes or adds into it. An fp32 acc for low-precision inputs: cuBLAS accumulates in
    fp32 and, where torch allows out_dtype, writes or adds its fp32 result straight into acc;
    otherwise (CPU) each chunk's product is rounded to the input dtype once before the fp32 add.
    """
    if acc.dtype == x_c.dtype:
        if first:
            torch.mm(dlogits_t, x_c, out=acc)
        else:
            acc.addmm_(dlogits_t, x_c)
        return
    can_addmm, can_mm = fp32_gemm_caps(x_c.device, x_c.dtype)
    if first and can_mm:
        torch.mm(dlogits_t, x_c, out_dtype=torch.float32, out=acc)
    elif first:
        acc.copy_(torch.mm(dlogits_t, x_c))
    elif can_addmm:
        torch.addmm(acc, dlogits_t, x_c, out_dtype=torch.float32, out=acc)
    elif can_mm:
        acc.add_(torch.mm(dlogits_t, x_c, out_dtype=torch.float32))
    else:
        acc.add_(torch.mm(dlogits_t, x_c))


# Devices whose decoder GEMMs run over the padded vocabulary (padded_vocab): where cuBLAS needs it.
# A CPU's GEMMs do not care, and padding there would only copy the weight each call.
PADDED_DEVICES = {"cuda"}


def _padded_rows(t: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """t ([V] or [V, H]) cast to ``dtype`` into the first V rows of a [rows(, H)] buffer, the rest 0
    (t cast alone, no copy when it has that dtype, where rows is V)."""
    if rows == t.shape[0]:
        return t.to(dtype)
    out = torch.empty((rows, *t.shape[1:]), dtype=dtype, device=t.device)
    out[t.shape[0]:].zero_()
    out[: t.shape[0]].copy_(t)
    return out


def _label_range(vocab_size: int) -> str:
    return f"labels: expected values in [0, {vocab_size}) or {IGNORE_INDEX} (ignored)"


def _check_label_range(labels: torch.Tensor, vocab_size: int, on_device: bool = True) -> None:
    """ValueError when a label is neither -100 nor in [0, V). One device sync (.any()), or none (an
    assert on the device: see ``contract.value_checks``; on_device False: the caller's kernels check them
    there, as the fused decoder's statistics do)."""
    mode = value_checks(labels)
    if mode == "off" or (mode == "device" and not on_device):
        return
    bad = (labels >= vocab_size) | ((labels < 0) & (labels != IGNORE_INDEX))
    if mode == "device":
        torch._assert_async(~bad.any(), _label_range(vocab_size))
    elif bool(bad.any()):
        value = int(labels[bad][0])
        raise ValueError(f"{_label_range(vocab_size)}, got {value} (at row {int(bad.nonzero()[0, 0])})")


def _decoder_loss(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
                  chunk_rows: Optional[int], compute_grad: bool, grad_scale: float, kernel):
    """Sum of softmax cross-entropy of x @ weight.T + bias over labelled rows, chunk by chunk.

    x: [M, H] activations (fp32/fp16/bf16); weight: [V, H]; bias: [V] or None (parameters,
    any float dtype: the GEMMs run in x's dtype); labels: [M] int64 (-100 = ignored);
    chunk_rows: rows per chunk, or None for default_chunk_rows (logits chunk <= 256 MiB).
    compute_grad: also return the gradients of grad_scale * loss_sum (grad_scale = 1 / number
    of labelled rows gives the mean loss).

    Returns (loss_sum fp32 scalar, n_correct int64 scalar, grad_x [M, H] in x's dtype,
    grad_weight [V, H] in weight's dtype, grad_bias [V] in bias's dtype); the three grads
    are None without compute_grad (grad_bias also without bias).
    Raises ValueError for a label outside [0, V) other than -100 (this check syncs).
    """
    labels, chunk_rows, vp = _checked(x, weight, bias, labels, chunk_rows)
    (M, H), V = x.shape, weight.shape[0]
    grad_scale = float(grad_scale)
    if compute_grad and M <= chunk_rows:  # one chunk (or none): the op's own backward, here at once
        loss_sum, n_correct, dlogits, w = _one_chunk_forward(x, weight, bias, labels, vp, grad_scale, kernel)
        return (loss_sum, n_correct, *_one_chunk_grads(x, weight, bias, w, dlogits, None))

    dev = x.device
    loss_sum = torch.zeros((), dtype=torch.float32, device=dev)
    n_correct = torch.zeros((), dtype=torch.int64, device=dev)
    grad_x = grad_w_acc = grad_b_acc = None
    if compute_grad:  # several chunks: the weight and bias gradients summed over them in fp32
        grad_x = torch.empty(M, H, dtype=x.dtype, device=dev)
        grad_w_acc = torch.empty(vp, H, dtype=torch.float32, device=dev)  # the first chunk writes it all
        if bias is not None:
            grad_b_acc = torch.zeros(V, dtype=torch.float32, device=dev)
    w = _padded_rows(weight, vp, x.dtype)                                # [Vp, H]
    b = None if bias is None else _padded_rows(bias, vp, x.dtype)       # [Vp]
    logits_buf = torch.empty(min(chunk_rows, M), vp, dtype=x.dtype, device=dev)
    for r0 in range(0, M, chunk_rows):
        r1 = min(r0 + chunk_rows, M)
        x_c = x[r0:r1]                                       # [rows, H]
        padded = logits_buf[: r1 - r0]                       # [rows, Vp], contiguous
        loss, correct = _chunk_loss(x_c, w, b, labels[r0:r1], V, padded, grad_scale, compute_grad, kernel)
        loss_sum += loss.sum()
        n_correct += correct.sum()
        if compute_grad:                                     # padded now holds dlogits, its pad 0
            torch.mm(padded, w, out=grad_x[r0:r1])           # [rows, H]
            _accumulate_grad_weight(grad_w_acc, padded.t(), x_c, first=(r0 == 0))
            if grad_b_acc is not None:
                grad_b_acc += padded[:, :V].sum(0, dtype=torch.float32)

    if not compute_grad:
        return loss_sum, n_correct, None, None, None
    grad_weight = grad_w_acc[:V].to(weight.dtype)
    grad_bias = grad_b_acc.to(bias.dtype) if grad_b_acc is not None else None
    return loss_sum, n_correct, grad_x, grad_weight, grad_bias


def _checked(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
             chunk_rows: Optional[int], labels_on_device: bool = True) -> tuple[torch.Tensor, int, int]:
    """The decoder's inputs checked: (labels as int64, rows per chunk, the GEMMs' vocabulary); the labels'
    range on the device here unless ``labels_on_device`` is False (the fused decoder's kernels check it)."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    M, H = x.shape
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=2, device=x.device)
    V = weight.shape[0]
    if weight.shape[1] != H or V == 0:
        raise ValueError(f"weight: expected shape (V > 0, {H}) matching x [M, H] = {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES, shape=(V,), device=x.device)
    check_tensor("labels", labels, dtypes=ID_DTYPES, shape=(M,), device=x.device)
    labels = labels.to(torch.int64).contiguous()
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(M, V, x.element_size())
    if not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool) or chunk_rows < 1:
        raise ValueError(f"chunk_rows: expected a positive int or None, got {chunk_rows!r}")
    _check_label_range(labels, V, labels_on_device)
    return labels, chunk_rows, _gemm_vocab(V, x)


def _gemm_vocab(vocab_size: int, x: torch.Tensor) -> int:
    """The decoder GEMMs' vocabulary for activations x: on a GPU padded to whole 16-byte rows
    (padded_vocab), with zero weight rows and bias, and the pad's logits zeroed before the
    gradient GEMMs read them, so they add nothing."""
    return padded_vocab(vocab_size, x.element_size()) if x.device.type in PADDED_DEVICES else vocab_size


def _chunk_loss(x_c: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], labels_c: torch.Tensor, vocab: int,
                out: torch.Tensor, grad_scale: float, compute_grad: bool, kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: its logits x_c @ w.T + b into ``out`` [rows, Vp], then the kernel over their first
    ``vocab`` columns; (loss [rows], correct [rows]). With compute_grad, ``out`` then holds the
    logits' gradient (grad_scale times), its pad zeroed."""
    if b is not None:
        torch.addmm(b, x_c, w.t(), out=out)
    else:
        torch.mm(x_c, w.t(), out=out)
    loss, _, correct = kernel(out[:, :vocab], labels_c, grad_scale, compute_grad)  # row stride Vp
    if compute_grad and out.shape[1] != vocab:
        out[:, vocab:].zero_()
    return loss, correct


def _one_chunk_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
                       vp: int, grad_scale: float, kernel):
    """All rows as one chunk: (loss_sum, n_correct, the logits' gradient [M, Vp] (grad_scale times; the
    pad 0), the GEMMs' weight [Vp, H] in x's dtype: ``weight`` itself where it is that already)."""
    w = _padded_rows(weight, vp, x.dtype)
    b = None if bias is None else _padded_rows(bias, vp, x.dtype)
    dlogits = torch.empty(x.shape[0], vp, dtype=x.dtype, device=x.device)
    loss, correct = _chunk_loss(x, w, b, labels, weight.shape[0], dlogits, grad_scale, True, kernel)
    return loss.sum(dtype=torch.float32), correct.sum(dtype=torch.int64), dlogits, w


def _one_chunk_grads(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], w: torch.Tensor,
                     dlogits: torch.Tensor, scale: Optional[torch.Tensor]):
    """(grad x, grad weight, grad bias or None) of one chunk from its logits' gradient dlogits [M, >= Vp]
    (0 past V) and the GEMMs' weight w [Vp, H] (Vp: V, or the padded vocabulary). scale, the loss's
    incoming gradient (0-dim; None for 1), goes where it is small: into x before the weight gradient's
    GEMM, onto the input gradient after its GEMM, and onto the bias gradient, not over a [V, H] gradient
    (a pass of 125 MB at BERT-large's vocabulary in bf16, 250 in fp32). The weight gradient is its one
    GEMM's output, in the weight's dtype where that is x's (cuBLAS rounds its fp32 sum once), else fp32."""
    M, H = x.shape
    V = weight.shape[0]
    grad_x = torch.mm(dlogits, w)
    if scale is not None:
        grad_x.mul_(scale)
        x = x * scale
    acc = (torch.empty if M else torch.zeros)(w.shape[0], H, device=x.device,
                                              dtype=x.dtype if weight.dtype == x.dtype else torch.float32)
    if M:
        _accumulate_grad_weight(acc, dlogits.t(), x, first=True)
    grad_bias = None
    if bias is not None:
        grad_b = dlogits[:, :V].sum(0, dtype=torch.float32)
        grad_bias = (grad_b if scale is None else grad_b * scale).to(bias.dtype)
    return grad_x, acc[:V].to(weight.dtype), grad_bias


# ------------------------------------------------------------------ the loss in the GEMM's epilogue
MODE_ENV = "BERTFAST_MLM_HEAD"
MODES = ("library", "fused")


def head_mode() -> str:
    """BERTFAST_MLM_HEAD: "library" (default: the decoder's GEMMs cuBLAS's, the loss kernel between them)
    or "fused" (one chunk's GEMMs bertfast's own, the loss inside them, where the backend has them:
    kernels/mlm_head_loss.py, "the loss in the GEMM's epilogue")."""
    return env_choice(MODE_ENV, MODES)


def using_head_mode(mode: str):
    """BERTFAST_MLM_HEAD set to ``mode`` inside the block (the bench's fused case), as it was after."""
    return env_setting(MODE_ENV, mode, MODES)


def head_summary() -> str:
    """`bertfast info`'s line: how one chunk's decoder runs."""
    try:
        mode = head_mode()
    except ValueError as exc:
        return f"MLM head decoder: {exc}"
    how = {"library": "the library's GEMMs (cuBLAS on a GPU), the loss kernel between them",
           "fused": "the triton backend's GEMMs with the loss inside them (its statistics in the forward's "
                    "epilogue, its gradient formed by the backward's), where the rows make one chunk (other "
                    "backends, several chunks and a column-major weight: the library's)"}[mode]
    return f"MLM head decoder: {mode}: {how} ({MODE_ENV}: {' or '.join(MODES)})"


def fused_decoder(backend: str, x: Tensor, weight: Tensor) -> bool:
    """Whether one chunk's decoder runs fused here: BERTFAST_MLM_HEAD=fused, a backend with the fused
    kernels (Triton's), a hidden size of at least 1 and a weight of rows (a Linear's, or tied
    embeddings': the GEMM reads it, or its cast, as it is)."""
    return (head_mode() == "fused" and x.shape[1] > 0 and (weight.shape[1] < 2 or weight.stride(1) == 1)
            and hasattr(dispatch.get(OP, backend).impl, "mlm_logits_gemm_fwd"))


def _fused_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, impl):
    """All rows as one chunk, the loss in the forward GEMM's epilogue: (loss_sum, n_correct, the softmax's u,
    the GEMMs' weight [V, H] in x's dtype (``weight`` itself where it is that already), the softmax's c)."""
    x = x if x.stride(1) == 1 else x.contiguous()  # the GEMM's rows of unit stride
    w = weight.to(x.dtype)
    # checked on the device, the labels' range is the statistics kernel's: two launches where torch's ops take 8
    ok = torch.empty(labels.shape, dtype=torch.bool, device=labels.device) if value_checks(labels) == "device" else None
    loss, _, correct, softmax = impl.mlm_logits_gemm_fwd(x, w, None if bias is None else bias.to(x.dtype), labels, ok)
    if ok is not None:
        torch._assert_async(ok.all(), _label_range(weight.shape[0]))
    return loss.sum(dtype=torch.float32), correct.sum(dtype=torch.int64), softmax.u, w, softmax.c


# ------------------------------------------------------------------ the torch backend
def mlm_head_loss_fwd(logits, labels, grad_scale, compute_grad):
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    valid = (labels >= 0) & (labels < logits.shape[1])
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    picked = lf.gather(1, safe[:, None].long())[:, 0]
    loss = torch.where(valid, lse - picked, torch.zeros_like(lse))
    correct = valid & (lf.argmax(-1) == labels)
    if compute_grad:
        grad = torch.softmax(lf, dim=-1)
        grad[torch.arange(len(labels), device=labels.device), safe] -= 1.0
        # where, not a product with the mask: 0 * inf (a caller's 1 / no labelled row) would be NaN.
        logits.copy_(torch.where(valid[:, None], grad * grad_scale, 0.0))
    return loss, lse, correct
