"""igemm: implicit-GEMM convolution with fused epilogues, and the kernels around it, for CUDA GPUs."""
from ._runtime import get_backend, gpu_available, set_backend
from .relu import relu_backward, relu_mask

__version__ = "0.1.0"

__all__ = ["get_backend", "gpu_available", "set_backend", "relu_backward", "relu_mask", "__version__"]
