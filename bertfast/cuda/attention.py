"""attention on the CUDA backend (csrc/attention*): FlashAttention-2 style self-attention on
unpadded (varlen) or padded tensors, forward and backward, plus the debug dropout-mask entry points.

Head dims: any from contract.MIN_HEAD_DIM (8) to MAX_HEAD_DIM (256); the kernels run the smallest of
their tile head dims (16, 32, 64, 96, 128, 256) that holds it. Rows need a unit last stride and no
alignment: a tensor whose pointer, strides and rows are whole 16-byte vectors moves as such, any
other one element by element (packed qkv with head dim 26 in fp16, say).

Dropout: the Triton kernel's mask, bit for bit (Philox4x32-7 keyed by the seed and the sequence's
and head's stream; kernels/attention.py's header), kept probabilities scaled by 1 / (1 - p); the
*_dropout_mask functions return exactly that mask.
The forward records its decisions for the backward in the Triton kernel's keep bits (the same shape
and layout, contract.keep_bits_shape: one bit per score element), which the backward reads.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from bertfast.contract import (check_cu_seqlens, check_dropout, check_head_dim, check_keep_bits, check_key_padding_mask,
                               check_qkv, check_tensor, head_dim_reasons, keep_bits_shape, qkv_bias_grad,
                               softmax_scale as _softmax_scale)
from bertfast.cuda import _common as C

MAX_BATCH = 65535  # sequences per launch: the grid's z dimension
# What these kernels are, for `bertfast info`.
KERNELS = ("forward: mma.sync m16n8k16 with fragments in registers, K and V through a cp.async pipeline "
           "(fp16/bf16), FMA (fp32); backward: delta, dQ and dK/dV kernels, mma.sync as the forward for "
           "fp16/bf16 (at head dim 256 a block per half of the columns), FMA for fp32, reading the forward's "
           "keep bits; on an sm_90 GPU from the sm_90a build, at head dims 64 and 128, the forward, dQ and dK/dV "
           "on wgmma (m64nNk16, operands in 128-byte-swizzled shared memory), and at 64 up to 128 tokens the "
           "backward in one pass (no delta kernel); mask and keep bits: Triton's, bit for bit")


def unsupported(inputs) -> list:
    """Dispatch: reasons these inputs exceed this backend's limits ([] when it runs them)."""
    q = inputs["q"]
    reasons = head_dim_reasons(q.shape[-1])
    cu_seqlens = inputs.get("cu_seqlens")
    batch = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else q.shape[0]
    if batch > MAX_BATCH:
        reasons.append(f"{batch} sequences exceed {MAX_BATCH} per launch")
    return reasons


def _check_qkv(names, tensors, ndim: int, layout: str) -> None:
    C.on_device(**dict(zip(names, tensors)))
    check_qkv(names, tensors, ndim, layout)
    check_head_dim(names[0], tensors[0].shape[-1])


def _unit_stride_or_copy(t: torch.Tensor) -> torch.Tensor:
    """Gradients from autograd may come expanded or transposed (stride(-1) != 1): copy those."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_cu_seqlens(cu_seqlens, max_seqlen, device) -> Tuple[int, int]:
    C.on_device(cu_seqlens=cu_seqlens)
    batch, max_seqlen = check_cu_seqlens(cu_seqlens, max_seqlen, device)
    if batch > MAX_BATCH:
        raise ValueError(f"cu_seqlens: expected at most {MAX_BATCH} sequences, got {batch}")
    return batch, max_seqlen


def _key_mask(key_padding_mask, batch: int, seqlen: int, device) -> Optional[torch.Tensor]:
    """[B, S] bool/int (1 = token) -> contiguous uint8, or None."""
    C.on_device(key_padding_mask=key_padding_mask)
    check_key_padding_mask(key_padding_mask, batch, seqlen, device)
    if key_padding_mask is None:
        return None
    if key_padding_mask.dtype == torch.bool:
        return key_padding_mask.contiguous().view(torch.uint8)
    return (key_padding_mask != 0).to(torch.uint8).contiguous()


def _bsh(t: torch.Tensor, varlen: bool) -> Tuple[int, int, int]:
    """(batch, row, head) element strides; varlen tensors have no batch dim."""
    return (0, t.stride(0), t.stride(1)) if varlen else (t.stride(0), t.stride(1), t.stride(2))


dropout_keep_shape = keep_bits_shape


def _fwd(q, k, v, cu_seqlens, key_mask, batch, seqlen, varlen, softmax_scale, dropout_p, seed):
    dev = q.device
    heads, head_dim = q.shape[-2], q.shape[-1]
    if varlen:  # rows outside every sequence: out 0, lse +inf (no kernel writes them)
        out = torch.zeros(q.shape, dtype=q.dtype, device=dev)
        lse = torch.full((heads, q.shape[0]), float("inf"), dtype=torch.float32, device=dev)
        lse_strides = (0, lse.stride(0))
    else:
        out = torch.empty(q.shape, dtype=q.dtype, device=dev)
        lse = torch.empty((batch, heads, seqlen), dtype=torch.float32, device=dev)
        lse_strides = (lse.stride(0), lse.stride(1))
    keep = torch.empty(keep_bits_shape(batch, heads, seqlen, dropout_p), dtype=torch.uint8, device=dev)
    if out.numel() == 0 or batch == 0 or seqlen == 0:
        return out.zero_(), lse.fill_(float("inf")), keep
    C.launch(dev, "attention_fwd", q.data_ptr(), _bsh(q, varlen), k.data_ptr(), _bsh(k, varlen), v.data_ptr(),
            _bsh(v, varlen), out.data_ptr(), _bsh(out, varlen), lse.data_ptr(), *lse_strides,
            C.ptr(cu_seqlens), C.ptr(key_mask), key_mask.stride(0) if key_mask is not None else 0,
            batch, heads, head_dim, seqlen, softmax_scale, dropout_p, C.seed_ptr(seed, dropout_p),
            *_keep_args(keep), C.DTYPE_CODE[q.dtype])
    return out, lse, keep


def _keep_args(keep: torch.Tensor) -> Tuple[int, int]:
    """The keep bits' pointer and length L (0, 0 without dropout)."""
    return (keep.data_ptr(), keep.shape[3] * 4) if keep.dim() == 4 else (0, 0)


def _bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens, key_mask, batch, seqlen, varlen, softmax_scale,
         dropout_p, seed, keep):
    dev = q.device
    heads, head_dim = q.shape[-2], q.shape[-1]
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    lse_strides = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    C.launch(dev, "attention_bwd", dout.data_ptr(), _bsh(dout, varlen), q.data_ptr(), _bsh(q, varlen), k.data_ptr(),
            _bsh(k, varlen), v.data_ptr(), _bsh(v, varlen), out.data_ptr(), _bsh(out, varlen),
            lse.data_ptr(), delta.data_ptr(), *lse_strides, dq.data_ptr(), _bsh(dq, varlen),
            dk.data_ptr(), _bsh(dk, varlen), dv.data_ptr(), _bsh(dv, varlen), C.ptr(cu_seqlens),
            C.ptr(key_mask), key_mask.stride(0) if key_mask is not None else 0, batch, heads,
            head_dim, seqlen, softmax_scale, dropout_p, C.seed_ptr(seed, dropout_p), *_keep_args(keep),
            C.DTYPE_CODE[q.dtype])


def attention_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         max_seqlen: int, softmax_scale: Optional[float], dropout_p: float,
                         seed: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention on unpadded tokens: q, k, v [T, A, D] (views of a packed [T, 3, A, D] are fine)
    -> (out [T, A, D], lse [A, T] fp32; +inf where a row has no key, keep: the keep bits). Sequence b is rows
    cu_seqlens[b]:cu_seqlens[b+1]; max_seqlen >= every length. Rows outside every sequence get
    out 0 and lse +inf."""
    _check_qkv(("q", "k", "v"), (q, k, v), 3, "[T, A, D]")
    batch, max_seqlen = _check_cu_seqlens(cu_seqlens, max_seqlen, q.device)
    softmax_scale = _softmax_scale(softmax_scale, q.shape[-1])
    C.on_device(seed=seed)
    dropout_p = check_dropout(dropout_p, seed, q.device)
    return _fwd(q, k, v, cu_seqlens, None, batch, max_seqlen, True, softmax_scale, dropout_p, seed)


def attention_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                         softmax_scale: Optional[float], dropout_p: float,
                         seed: Optional[torch.Tensor], keep: torch.Tensor, bias_dtype: Optional[torch.dtype] = None):
    """Gradients of attention_varlen_fwd -> dqkv [T, 3, A, D] (dq = dqkv[:, 0], dk, dv likewise;
    zero at rows outside every sequence); given bias_dtype, with the QKV bias gradient
    (contract.qkv_bias_grad: summed from dqkv, not in the kernel)."""
    _check_qkv(("q", "k", "v", "out"), (q, k, v, out), 3, "[T, A, D]")
    C.on_device(dout=dout, lse=lse)
    check_tensor("dout", dout, dtypes=(q.dtype,), shape=q.shape, device=q.device)
    tokens, heads, head_dim = q.shape
    check_tensor("lse", lse, dtypes=(torch.float32,), shape=(heads, tokens), device=q.device)
    batch, max_seqlen = _check_cu_seqlens(cu_seqlens, max_seqlen, q.device)
    softmax_scale = _softmax_scale(softmax_scale, head_dim)
    C.on_device(seed=seed)
    dropout_p = check_dropout(dropout_p, seed, q.device)
    check_keep_bits(keep, batch, heads, max_seqlen, dropout_p, q.device)
    dqkv = torch.zeros((tokens, 3, heads, head_dim), dtype=q.dtype, device=q.device)
    if dqkv.numel() > 0 and batch > 0 and max_seqlen > 0:
        _bwd(_unit_stride_or_copy(dout), q, k, v, out, lse, dqkv[:, 0], dqkv[:, 1], dqkv[:, 2], cu_seqlens, None,
             batch, max_seqlen, True, softmax_scale, dropout_p, seed, keep)
    return qkv_bias_grad(dqkv, bias_dtype)


def attention_padded_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_padding_mask: Optional[torch.Tensor], softmax_scale: Optional[float], dropout_p: float,
                         seed: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention on padded tensors: q, k, v [B, S, A, D], key_padding_mask [B, S] (1 = token, any
    pattern; None = none) -> (out [B, S, A, D], lse [B, A, S] fp32, keep: the keep bits). Query rows at pad
    positions attend to the valid keys; a sequence with no valid key gives out 0 (lse +inf)."""
    _check_qkv(("q", "k", "v"), (q, k, v), 4, "[B, S, A, D]")
    batch, seqlen = q.shape[0], q.shape[1]
    if batch > MAX_BATCH:
        raise ValueError(f"q: expected a batch of at most {MAX_BATCH}, got {batch}")
    key_mask = _key_mask(key_padding_mask, batch, seqlen, q.device)
    softmax_scale = _softmax_scale(softmax_scale, q.shape[-1])
    C.on_device(seed=seed)
    dropout_p = check_dropout(dropout_p, seed, q.device)
    return _fwd(q, k, v, None, key_mask, batch, seqlen, False, softmax_scale, dropout_p, seed)


def attention_padded_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
                         softmax_scale: Optional[float], dropout_p: float, seed: Optional[torch.Tensor],
                         keep: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attention_padded_fwd -> (dq, dk, dv), each [B, S, A, D]; 0 at padding keys."""
    _check_qkv(("q", "k", "v", "out"), (q, k, v, out), 4, "[B, S, A, D]")
    C.on_device(dout=dout, lse=lse)
    check_tensor("dout", dout, dtypes=(q.dtype,), shape=q.shape, device=q.device)
    batch, seqlen, heads, head_dim = q.shape
    if batch > MAX_BATCH:
        raise ValueError(f"q: expected a batch of at most {MAX_BATCH}, got {batch}")
    check_tensor("lse", lse, dtypes=(torch.float32,), shape=(batch, heads, seqlen), device=q.device)
    key_mask = _key_mask(key_padding_mask, batch, seqlen, q.device)
    softmax_scale = _softmax_scale(softmax_scale, head_dim)
    C.on_device(seed=seed)
    dropout_p = check_dropout(dropout_p, seed, q.device)
    check_keep_bits(keep, batch, heads, seqlen, dropout_p, q.device)
    dq, dk, dv = (torch.empty(q.shape, dtype=q.dtype, device=q.device) for _ in range(3))
    if dq.numel() == 0:
        return dq, dk, dv
    _bwd(_unit_stride_or_copy(dout), q, k, v, out, lse, dq, dk, dv, None, key_mask, batch, seqlen, False,
         softmax_scale, dropout_p, seed, keep)
    return dq, dk, dv


def _dropout_mask(batch: int, seqlen: int, num_heads: int, dropout_p: float, seed, device) -> torch.Tensor:
    for name, value in (("batch", batch), ("seqlen", seqlen), ("num_heads", num_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2 ** 31:
            raise ValueError(f"{name}: expected a python int >= 0, got {value!r}")
    dropout_p = check_dropout(dropout_p)
    if dropout_p == 0.0 or batch * num_heads * seqlen == 0:
        return torch.ones((batch, num_heads, seqlen, seqlen), dtype=torch.bool, device=device)
    C.on_device(seed=seed)  # a CPU seed would reach the launch and fail there, unclearly
    check_dropout(dropout_p, seed, device)
    keep = torch.empty((batch, num_heads, seqlen, seqlen), dtype=torch.bool, device=device)
    C.launch(device, "attention_dropout_mask", keep.data_ptr(), batch, num_heads, seqlen, dropout_p, seed.data_ptr())
    return keep


def attention_varlen_dropout_mask(cu_seqlens: torch.Tensor, max_seqlen: int, num_heads: int, dropout_p: float,
                                  seed: Optional[torch.Tensor]) -> torch.Tensor:
    """The keep-mask the varlen kernels draw: bool [B, A, max_seqlen, max_seqlen] (sequence b uses
    its top-left [len_b, len_b] block), for reference.attention_varlen(dropout_mask=...)."""
    batch, max_seqlen = _check_cu_seqlens(cu_seqlens, max_seqlen, cu_seqlens.device)
    return _dropout_mask(batch, max_seqlen, num_heads, dropout_p, seed, cu_seqlens.device)


def attention_padded_dropout_mask(batch: int, seqlen: int, num_heads: int, dropout_p: float,
                                  seed: Optional[torch.Tensor]) -> torch.Tensor:
    """The keep-mask the padded kernels draw: bool [B, A, S, S], on the seed's device (CPU ones
    when there is no dropout and no seed)."""
    device = seed.device if seed is not None else torch.device("cpu")
    return _dropout_mask(batch, seqlen, num_heads, dropout_p, seed, device)


