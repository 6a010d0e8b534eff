"""What ``bertfast pretrain`` and ``bertfast finetune`` share, one module per concern:

  step         the optimizer step: micro-batch accumulation, autocast, fp16 loss scaling,
               gradient sync on the last micro-batch, clipping, optimizer and schedule
  optim        parameter groups, AdamW / LAMB, warm-up + linear decay
  checkpoints  RNG state capture/restore, atomic checkpoint directories with keep-last-K
  distributed  torchrun's process group and the collectives a run needs
  records      metrics.jsonl (and TensorBoard), named device-side sums, the loss plot
  precision    fp32 / bf16 / fp16 and the autocast context
  config       typed, validated run configurations (``PretrainConfig``) with presets, their
               command line, and run_config.json in the run directory
  options      ``--set KEY=VALUE`` overrides and JSON option files (finetune's argparse)

The MFU model is ``bertfast.flops``; the parity check during training is
``bertfast.parity.check_during_training``.
"""
