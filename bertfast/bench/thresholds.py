"""The performance targets' thresholds (benchmarks/README.md), one number each and free of torch:
bench/targets.py evaluates a GPU run against them, the performance model (bertfast/perfmodel) its
predictions, and `bertfast perf-model --help` stays light."""
from __future__ import annotations

MFU = {("bert-large", 128): 0.50, ("bert-base", 128): 0.50, ("bert-large", 512): 0.45}  # (model, seq): of the peak
FINETUNE_RATIO = 0.85  # padded real tokens/s within 15% of unpadded
ROW_OP_BANDWIDTH = 0.90  # of the measured copy bandwidth, each row op forward and backward
ATTENTION_TFLOPS = 215.0  # FlashAttention-2's published H100 fwd+bwd figure (head dim 64, seq 512)
MLM_HEAD_VS_FULL = 5.0  # at least, in time and in peak memory, against the full-sequence head
MLM_HEAD_FLOOR = 1.25  # at most this many times its own GEMMs' time
MODEL_NAMES = {"bert-large": "BERT-large", "bert-base": "BERT-base"}  # the targets' models, as their texts name them
