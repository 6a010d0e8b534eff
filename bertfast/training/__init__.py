"""What ``bertfast pretrain`` and ``bertfast finetune`` share, one module per concern:

  step         the optimizer step: micro-batch accumulation, autocast, fp16 loss scaling,
               gradient sync on the last micro-batch, clipping, optimizer and schedule
  optim        parameter groups, AdamW / LAMB, warm-up + linear decay
  checkpoints  RNG state capture/restore, atomic checkpoint directories with keep-last-K, the
               training checkpoint (model, tokenizer, training_state.pt, a SHA-256 manifest) and
               ``--resume`` (verified; a damaged checkpoint is set aside)
  signals      SIGTERM / SIGINT: checkpoint at the end of the step, then stop
  rundir       the output directory: a lock, the run's identity and lineage, --overwrite, and
               setting aside the checkpoints of an abandoned continuation
  nonfinite    NaN/inf loss, gradient norm or parameters: watched on the device, stop or skip
  exits        the exit codes (docs/training.md)
  distributed  torchrun's process group and the collectives a run needs
  records      metrics.jsonl (and TensorBoard), named device-side sums, the loss plot
  precision    fp32 / bf16 / fp16 and the autocast context
  config       typed, validated run configurations (``PretrainConfig``, ``FinetuneConfig``)
               with presets, their command line, run_config.json in the run directory, and
               ``--set KEY=VALUE`` model overrides

The MFU model is ``bertfast.model.mfu``; the parity check during training is
``bertfast.parity.check_during_training``.
"""
