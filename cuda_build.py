"""How setup.py builds bertfast._C from csrc/ (filled in by the CUDA backend work).

BERTFAST_BUILD_CUDA=auto|0|1: auto builds when nvcc is found, 1 requires it, 0 skips.
"""


def cuda_extension_kwargs():
    return {}
