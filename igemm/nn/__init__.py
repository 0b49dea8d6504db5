"""igemm inside PyTorch models (needs ``torch``: ``pip install 'igemm[torch]'``).

- ``torch.ops.igemm.conv2d``: the fused convolution as a custom op (fake implementation included:
  ``torch.compile(fullgraph=True)``, ``torch.export`` and CUDA graphs take it); :func:`conv2d` calls it.
- Modules: :class:`Conv2d` (a drop-in ``torch.nn.Conv2d``), :class:`Conv2dBN`, :class:`Conv2dBNReLU`,
  :class:`Conv2dBNAddReLU` (BatchNorm folded into the kernel in inference).
- :func:`convert`: a model's convolution patterns replaced by those modules; :func:`precompile`: their kernels
  compiled ahead of the first forward (in parallel, no GPU needed).

channels_last inputs run igemm's NHWC kernel without a copy and give channels_last outputs.
"""
from ._ops import conv2d, precompile
from ._modules import Conv2d, Conv2dBN, Conv2dBNAddReLU, Conv2dBNReLU
from ._convert import Report, convert

__all__ = ["conv2d", "precompile", "Conv2d", "Conv2dBN", "Conv2dBNReLU", "Conv2dBNAddReLU", "convert", "Report"]
