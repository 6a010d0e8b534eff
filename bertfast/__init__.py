"""bertfast: fused Triton and CUDA C++ kernels under a drop-in Hugging Face BERT API."""
from bertfast.config import BertConfig

__version__ = "0.1.0"
__all__ = ["BertConfig"]
