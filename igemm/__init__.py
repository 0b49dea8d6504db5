"""igemm: implicit-GEMM convolution with fused epilogues, and the kernels around it, for CUDA GPUs."""

from ._checkout import load_epilogues

load_epilogues()   # (an install has igemm.epilogues already; a checkout on PYTHONPATH loads it here)
from . import epilogues  # noqa: E402
from ._runtime import get_backend, gpu_available, set_backend  # noqa: E402
from .conv import Conv2dOptions, Conv2dPlan, conv2d, conv2d_bn_relu  # noqa: E402
from .conv import (Conv2dGradInputPlan, Conv2dGradWeightPlan, GradPrologue, conv2d_backward,  # noqa: E402
                   conv2d_bn_backward, conv2d_grad_input, conv2d_grad_prologue, conv2d_grad_weight)
from .relu import relu_backward, relu_mask  # noqa: E402
from .index_add import index_add  # noqa: E402
from .prelu import prelu, prelu_backward  # noqa: E402
from .norm import (batch_norm_backward_elemt, batch_norm_backward_reduce, batch_norm_elemt,  # noqa: E402
                   batch_norm_gather_stats, batch_norm_relu, batch_norm_relu_backward, batch_norm_stats, welford)
from .syncbn import sync_batch_norm_backward_reduce, sync_batch_norm_stats  # noqa: E402

__version__ = "0.1.0"

__all__ = ["epilogues", "get_backend", "gpu_available", "set_backend",
           "Conv2dPlan", "Conv2dOptions", "conv2d", "conv2d_bn_relu",
           "Conv2dGradInputPlan", "Conv2dGradWeightPlan", "GradPrologue", "conv2d_grad_input", "conv2d_grad_weight",
           "conv2d_backward", "conv2d_grad_prologue", "conv2d_bn_backward",
           "relu_backward", "relu_mask", "index_add", "prelu", "prelu_backward",
           "welford", "batch_norm_stats", "batch_norm_gather_stats", "batch_norm_elemt", "batch_norm_relu",
           "batch_norm_backward_reduce", "batch_norm_backward_elemt", "batch_norm_relu_backward",
           "sync_batch_norm_stats", "sync_batch_norm_backward_reduce",
           "__version__"]
