"""igemm: implicit-GEMM convolution with fused epilogues, and the kernels around it, for CUDA GPUs."""


def _load_checkout_epilogues() -> None:
    """In a source checkout used without installing (PYTHONPATH=<repo>), load the top-level ``epilogues/``
    as ``igemm.epilogues``, which an install makes it; nothing else of the repository root is importable."""
    import importlib.util
    import os
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    init = os.path.join(os.path.dirname(here), "epilogues", "__init__.py")
    installed = os.path.isfile(os.path.join(here, "epilogues", "__init__.py"))
    if installed or not os.path.isfile(init) or "igemm.epilogues" in sys.modules:
        return                                          # installed (or already loaded)
    spec = importlib.util.spec_from_file_location("igemm.epilogues", init,
                                                  submodule_search_locations=[os.path.dirname(init)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["igemm.epilogues"] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules["igemm.epilogues"]
        raise


_load_checkout_epilogues()
from . import epilogues  # noqa: E402
from ._runtime import get_backend, gpu_available, set_backend  # noqa: E402
from .conv import Conv2dOptions, Conv2dPlan, conv2d, conv2d_bn_relu  # noqa: E402
from .relu import relu_backward, relu_mask  # noqa: E402
from .index_add import index_add  # noqa: E402
from .prelu import prelu, prelu_backward  # noqa: E402
from .norm import (batch_norm_backward_elemt, batch_norm_backward_reduce, batch_norm_elemt,  # noqa: E402
                   batch_norm_gather_stats, batch_norm_relu, batch_norm_relu_backward, batch_norm_stats, welford)
from .syncbn import sync_batch_norm_backward_reduce, sync_batch_norm_stats  # noqa: E402

__version__ = "0.1.0"

__all__ = ["epilogues", "get_backend", "gpu_available", "set_backend", "Conv2dPlan", "Conv2dOptions", "conv2d", "conv2d_bn_relu",
           "relu_backward", "relu_mask", "index_add", "prelu", "prelu_backward",
           "welford", "batch_norm_stats", "batch_norm_gather_stats", "batch_norm_elemt", "batch_norm_relu",
           "batch_norm_backward_reduce", "batch_norm_backward_elemt", "batch_norm_relu_backward",
           "sync_batch_norm_stats", "sync_batch_norm_backward_reduce",
           "__version__"]
