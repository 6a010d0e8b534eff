"""Triton kernels, one file per fused op, installed as ``bertfast.kernels``.

Each file holds the math of its op (forward and backward) in a header comment, the
``@triton.jit`` kernels, and launchers that validate, allocate and launch. Launchers take
and return plain tensors; autograd and dispatch live in ``bertfast.ops``. ``lamb.py`` and
``adamw.py`` are the optimizers' steps, outside dispatch (``bertfast.training.optim`` chooses them).
"""
