"""The fused ops: one public function each, a torch.library custom op with autograd and a
backend chosen per call by ``bertfast.dispatch`` (torch | triton | cuda).

One name per op everywhere: ``bertfast/ops/<op>.py`` (the contract, the custom op, the torch
backend), ``kernels/<op>.py`` (Triton), ``csrc/<op>*.cu`` and ``bertfast/cuda/<op>.py`` (CUDA),
``tests/ops/test_<op>.py`` and the benchmark case ``<op>``; ``bertfast.registry`` lists the ops
and what every part of the project runs of each (docs/ops.md).
"""
from bertfast.dispatch import use_backend
from bertfast.ops.attention import attention, attention_varlen
from bertfast.ops.bias_dropout_residual_layernorm import bias_dropout_residual_layernorm
from bertfast.ops.bias_gelu import bias_gelu
from bertfast.ops.embeddings import embeddings
from bertfast.ops.mlm_head_loss import MLMHeadLoss, masked_positions, mlm_head_loss, mlm_head_loss_decoder

__all__ = ["attention", "attention_varlen", "bias_gelu", "bias_dropout_residual_layernorm", "embeddings",
           "mlm_head_loss", "mlm_head_loss_decoder", "masked_positions", "MLMHeadLoss", "use_backend"]
