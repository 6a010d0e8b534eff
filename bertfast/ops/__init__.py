"""The fused ops: one public function each, a torch.library custom op with autograd and a
backend chosen per call by ``bertfast.dispatch`` (torch | triton | cuda)."""
from bertfast.dispatch import use_backend
from bertfast.ops.attention import attention, attention_varlen
from bertfast.ops.bias_gelu import bias_gelu
from bertfast.ops.embeddings import embeddings
from bertfast.ops.layer_norm import bias_dropout_residual_layernorm, layer_norm
from bertfast.ops.mlm_head import MLMHeadLoss, linear_cross_entropy, masked_positions, mlm_head_loss

__all__ = ["attention", "attention_varlen", "bias_gelu", "bias_dropout_residual_layernorm", "layer_norm",
           "embeddings", "linear_cross_entropy", "mlm_head_loss", "masked_positions", "MLMHeadLoss",
           "use_backend"]
