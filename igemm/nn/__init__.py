"""igemm inside PyTorch models (needs ``torch``: ``pip install 'igemm[torch]'``).

- ``torch.ops.igemm.conv2d``: the fused convolution as a custom op (fake implementation included:
  ``torch.compile(fullgraph=True)``, ``torch.export`` and CUDA graphs take it), differentiable through
  ``torch.ops.igemm.conv2d_backward`` (igemm's dgrad and wgrad, the ReLU read as the 1-bit mask);
  :func:`conv2d` calls it.
- ``torch.ops.igemm.conv2d_bn_train`` (:func:`conv2d_bn_train`): conv -> BatchNorm with batch statistics
  [-> + residual] [-> ReLU] for training (the running statistics updated as ``BatchNorm2d`` does), whose
  backward fuses BN's backward into dgrad's and wgrad's load.
- ``torch.ops.igemm.prelu`` (:func:`prelu`) and ``torch.ops.igemm.index_add`` (:func:`index_add`, out of place),
  differentiable.
- Modules: :class:`Conv2d` (a drop-in ``torch.nn.Conv2d``), :class:`Conv2dBN`, :class:`Conv2dBNReLU`,
  :class:`Conv2dBNAddReLU` (inference: BatchNorm folded into the kernel; training: the training op).
- :class:`MaxPool2d`: a drop-in ``torch.nn.MaxPool2d`` whose backward keeps one byte an output element;
  :class:`AdaptiveAvgPool2d`: a drop-in ``torch.nn.AdaptiveAvgPool2d`` (global average pooling on igemm's kernel);
  :class:`AvgPoolLinear`: a classifier head (that pool, a flatten and an ``nn.Linear``), one kernel at 1-2 images.
- :func:`convert`: a model's convolution patterns (and pools and classifier head) replaced by those modules;
  :func:`precompile`: their kernels (a training model's backward included) compiled ahead of the first step (in
  parallel, no GPU needed).

channels_last inputs run igemm's NHWC kernels without a copy and give channels_last outputs.
"""
from ._ops import conv2d, precompile
from . import _autograd  # noqa: F401  (conv2d's backward op and autograd formula)
from ._train_ops import conv2d_bn_train
from ._more_ops import index_add, prelu
from ._modules import Conv2d, Conv2dBN, Conv2dBNAddReLU, Conv2dBNReLU
from ._pool import AdaptiveAvgPool2d, AvgPoolLinear, MaxPool2d
from ._convert import Report, convert

__all__ = ["conv2d", "conv2d_bn_train", "prelu", "index_add", "precompile", "Conv2d", "Conv2dBN", "Conv2dBNReLU",
           "Conv2dBNAddReLU", "MaxPool2d", "AdaptiveAvgPool2d", "AvgPoolLinear",
           "convert", "Report"]
