"""Triton kernels, one file per fused op, installed as ``bertfast.kernels``.

Each file holds the math of its op (forward and backward) in a header comment, the
``@triton.jit`` kernels, and launchers that validate, allocate and launch. Launchers take
and return plain tensors; autograd and dispatch live in ``bertfast.ops``. ``lamb.py`` and
``adamw.py`` are the optimizers' steps, outside dispatch (``bertfast.training.optim`` chooses them).

Imported as the top-level ``kernels`` (a Python run from a checkout's root, whose directory comes
first on sys.path), this directory would stand in for the Hugging Face ``kernels`` package, which
transformers 5.25 requires and imports: the import is handed to the next ``kernels`` on sys.path.
"""
if __name__ == "kernels":
    import importlib.util
    import os
    import sys
    from importlib.machinery import PathFinder

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = PathFinder.find_spec(__name__, [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout])
    if _spec is None or _spec.loader is None:
        raise ImportError(f"No module named 'kernels' besides {os.path.dirname(os.path.abspath(__file__))}, "
                          "which is bertfast's Triton kernels: import bertfast.kernels", name=__name__)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _module  # what the import returns, and what the package's own imports find
    _spec.loader.exec_module(_module)
