"""Test session set-up.

Without a GPU, Triton kernels run under the interpreter: TRITON_INTERPRET must be set
before triton is first imported, so it is set here, at collection time.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests never reach the Hugging Face Hub: a hub id fails at once instead of waiting on a network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
