"""Each op's Triton launches at one BERT setting, as a training step calls them (bertfast.registry names
each op's function: its ``launches``), for the compile report (gpucheck.compile_report, which records
them inside ``kernels._common.compile_only``: nothing runs), gpucheck.sizing's estimate of a step's
compiles and the perf model's recorded kernels. The tensors are CPU stand-ins of the setting's shapes,
only compiled against.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from bertfast.gpucheck.compile_report import (MASKED_ROWS, MODELS, POSITIONS, SHORT_SEQUENCE_HEAD_DIMS, SHORT_SEQUENCES,
                                              TYPES, VOCAB)


@dataclasses.dataclass
class LaunchSetting:
    """One BERT setting as an op's launch function (bertfast.registry's ``launches``) takes it: the
    sizes, dtypes and dropout of a training step, and which attention variants to compile."""

    model: str
    seq: int
    batch: int
    act_name: str  # "bf16" | "fp16" | "fp32"
    params: str    # "fp32" | "act"
    p: float       # dropout
    head_dims: Sequence[int] = (64,)
    padded_attention: bool = True
    fp16_head_dims: Optional[Sequence[int]] = None
    short_sequences: bool = False
    dq_modes: Sequence[str] = ("deterministic",)  # the attention backward's dQ modes (BERTFAST_ATTENTION_DQ)
    head_modes: Sequence[str] = ("library",)  # the MLM decoder's forms (BERTFAST_MLM_HEAD)

    def __post_init__(self):
        import torch
        self.hidden, _, self.ffn = MODELS[self.model]
        self.act = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.act_name]
        self.par = torch.float32 if self.params == "fp32" else self.act
        self.tokens = self.seq * self.batch
        self.seed = torch.zeros(1, dtype=torch.int64)

    @property
    def label(self) -> str:
        params = self.params if self.params == "fp32" else self.act_name
        return f"{self.model} seq{self.seq} {self.act_name} params={params} p={self.p}"

    def empty(self, *shape, dtype=None):
        """A CPU tensor of the activation dtype (or ``dtype``): only compiled against, never read."""
        import torch
        return torch.empty(*shape, dtype=self.act if dtype is None else dtype)


def attention_launches(s: LaunchSetting) -> None:
    import torch
    from bertfast.kernels import attention as A
    for head_dim in s.head_dims:
        if s.act_name == "fp16" and s.fp16_head_dims is not None and head_dim not in s.fp16_head_dims:
            continue
        heads_here = s.hidden // head_dim
        qkv = s.empty(s.tokens, 3, heads_here, head_dim)
        q, k, v = qkv.unbind(1)
        cu = torch.arange(0, s.tokens + 1, s.seq, dtype=torch.int32)
        out, lse, keep = A.attention_varlen_fwd(q, k, v, cu, s.seq, 0.125, s.p, s.seed)
        for mode in s.dq_modes:
            with A.using_dq(mode):  # as training asks: with the gradient of the QKV GEMM's fp32 biases
                A.attention_varlen_bwd(torch.empty_like(out), q, k, v, out, lse, cu, s.seq, 0.125, s.p, s.seed,
                                       keep, torch.float32)
        if not s.padded_attention:
            continue
        qp = s.empty(s.batch, s.seq, heads_here, head_dim)
        mask = torch.ones(s.batch, s.seq, dtype=torch.bool)
        outp, lsep, keepp = A.attention_padded_fwd(qp, qp, qp, mask, 0.125, s.p, s.seed)
        for mode in s.dq_modes:
            with A.using_dq(mode):
                A.attention_padded_bwd(outp, qp, qp, qp, outp, lsep, mask, 0.125, s.p, s.seed, keepp)
        if s.short_sequences and s.seq == 128 and head_dim in SHORT_SEQUENCE_HEAD_DIMS:
            for short in SHORT_SEQUENCES:
                if not A.fused_backward(short, head_dim, s.act):
                    continue
                qs = s.empty(2, short, heads_here, head_dim)
                lses = torch.empty(2, heads_here, short)
                keeps = torch.empty(A.dropout_keep_shape(2, heads_here, short, s.p), dtype=torch.uint8)
                for mask_s in (None, torch.ones(2, short, dtype=torch.bool)):
                    A.attention_padded_bwd(qs, qs, qs, qs, qs, lses, mask_s, 0.125, s.p, s.seed, keeps)


def bias_gelu_launches(s: LaunchSetting) -> None:
    import torch
    from bertfast.kernels import bias_gelu as G
    x, bias = s.empty(s.tokens, s.ffn), s.empty(s.ffn, dtype=s.par)
    G.bias_gelu_fwd(x, bias)
    G.bias_gelu_bwd(torch.empty_like(x), x, bias)
    if s.act_name == "fp32":  # fp32 FFNs on a GPU run cuBLAS's GEMMs (residual_linear.ffn_gemms)
        return
    # in the FFN's GEMMs (bertfast.model.residual_linear.ffn: the weights in the activations' dtype)
    h, w1, w2 = s.empty(s.tokens, s.hidden), s.empty(s.ffn, s.hidden), s.empty(s.hidden, s.ffn)
    _, z = G.gemm_bias_gelu_fwd(h, w1, s.empty(s.ffn))
    G.gemm_gelu_bwd(torch.empty_like(h), w2, z, bias_dtype=s.par)


def bias_dropout_residual_layernorm_launches(s: LaunchSetting) -> None:
    from bertfast.kernels import bias_dropout_residual_layernorm as L
    x, residual = s.empty(s.tokens, s.hidden), s.empty(s.tokens, s.hidden)
    bias, w, b = (s.empty(s.hidden, dtype=s.par) for _ in range(3))
    y, pre, mean, rstd = L.bias_dropout_residual_layernorm_fwd(x, bias, residual, w, b, 1e-12, s.p, s.seed)
    L.bias_dropout_residual_layernorm_bwd(y, pre, mean, rstd, w, s.p, s.seed, True, True)
    y, _, mean, rstd = L.bias_dropout_residual_layernorm_fwd(x, None, None, w, b, 1e-12, 0.0, None)
    L.bias_dropout_residual_layernorm_bwd(y, x, mean, rstd, w, 0.0, None, False, False)


def embeddings_launches(s: LaunchSetting) -> None:
    import torch
    from bertfast.kernels import embeddings as E
    ids = [torch.zeros(s.tokens, dtype=torch.int64) for _ in range(3)]  # word, position, token type
    tables = (s.empty(VOCAB, s.hidden, dtype=s.par), s.empty(POSITIONS, s.hidden, dtype=s.par),
              s.empty(TYPES, s.hidden, dtype=s.par))
    vec = s.empty(s.hidden, dtype=s.par)
    y, mean, rstd = E.embeddings_fwd(*ids, *tables, vec, s.empty(s.hidden, dtype=s.par), 1e-12, s.p, s.seed, s.act)
    E.embeddings_bwd(torch.empty_like(y), *ids, *tables, vec, vec, mean, rstd, s.p, s.seed)


def mlm_head_loss_launches(s: LaunchSetting) -> None:
    import torch
    from bertfast.kernels import mlm_head_loss as M
    labels = torch.zeros(MASKED_ROWS, dtype=torch.int64)
    for grad in (True, False):
        M.mlm_head_loss_fwd(s.empty(MASKED_ROWS, VOCAB), labels, 1.0, grad)
    if "fused" not in s.head_modes or s.act_name == "fp32":  # the fused form: bf16 and fp16 only
        return
    x, w = s.empty(MASKED_ROWS, s.hidden), s.empty(VOCAB, s.hidden)
    # the labels' range checked in the statistics kernel, as a step checking on the device runs it
    _, _, _, softmax = M.mlm_logits_gemm_fwd(x, w, s.empty(VOCAB), labels, torch.empty(MASKED_ROWS, dtype=torch.bool))
    M.mlm_softmax_gemms_bwd(softmax, labels, x, w, torch.empty((), dtype=torch.float32), s.par, True)


def lamb_launches(s: LaunchSetting) -> None:
    # The optimizer's kernels take tables of tensors, so one tensor per launch covers every size;
    # what varies is the parameter/gradient dtype, weight decay on or off, 16-byte aligned addresses
    # or not (the third tensor starts one element into its buffer), and the scalars on the host or
    # (capturable, for CUDA graphs) on the device.
    import torch
    from bertfast.kernels import lamb as K
    par, hidden = s.par, s.hidden
    for w, decay, on_device in ((s.empty(hidden, hidden, dtype=par), 0.01, False),
                                (s.empty(hidden, dtype=par), 0.0, False),
                                (s.empty(hidden + 1, dtype=par)[1:], 0.01, False),
                                (s.empty(hidden, hidden, dtype=par), 0.01, True)):
        tables = K.LambTables()
        tables.update([w], [w], [torch.empty(w.shape)], [torch.empty(w.shape)])
        scalars = (dict(lr=torch.empty(()), bias=torch.empty(1, 2), found_inf=torch.empty(())) if on_device
                   else dict(lr=1e-3, bias_correction1=0.1, bias_correction2=1e-3))
        K.lamb_step(tables, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=decay, max_trust_ratio=10.0, **scalars)


def adamw_launches(s: LaunchSetting) -> None:
    # fp32 masters only (bertfast's AdamW takes no others); a working copy in the activations' dtype
    # where it is bf16 or fp16, as pretrain writes one; the scalars on the host or (the step a CUDA
    # graph captures, clipping and skipping) on the device; aligned or not.
    import torch
    from bertfast.kernels import adamw as K
    if s.par != torch.float32:
        return
    hidden = s.hidden
    copy_dtype = s.act if s.act in (torch.bfloat16, torch.float16) else None
    for shape, decay, on_device, offset in (((hidden, hidden), 0.01, True, 0), ((hidden,), 0.0, False, 0),
                                            ((hidden, hidden), 0.01, False, 1)):
        w = s.empty(shape[0] * (shape[1] if len(shape) > 1 else 1) + offset, dtype=s.par)[offset:]
        copy_ = s.empty(w.numel() + offset, dtype=copy_dtype)[offset:] if copy_dtype is not None else None
        tables = K.AdamWTables()
        tables.update([w], [w], [torch.empty(w.shape)], [torch.empty(w.shape)], [copy_])
        scalars = (dict(lr=torch.empty(()), found_inf=torch.empty(()), grad_scale=torch.empty(()))
                   if on_device else dict(lr=1e-3))
        K.adamw_step(tables, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=decay, bias=torch.empty(1, 2), **scalars)
