"""``igemm.nn.MaxPool2d`` and ``igemm.nn.AdaptiveAvgPool2d``: PyTorch's modules on igemm's channels-last kernels
(igemm/pool.py).

A CUDA tensor in ``torch.channels_last`` memory format (16-bit or fp32) runs the forward kernel, which under
autograd also keeps a one-byte window tap per output element for the backward (PyTorch keeps an int64 index);
y and the backward's ``dx`` equal PyTorch's (igemm/pool.py says the one exception). Anything else -- other memory
formats, ``return_indices``, the CPU, ``torch.compile`` and ``torch.export`` (which see ``F.max_pool2d``) -- runs
``torch.nn.MaxPool2d.forward``.

``AdaptiveAvgPool2d`` to 1 x 1 (global average pooling, a classifier's head) runs igemm's kernel on the same
tensors; its backward is PyTorch's (the mean's: dy spread over the pixels and divided by their count), and every
other output size or tensor runs ``torch.nn.AdaptiveAvgPool2d.forward``.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import pool
from . import _ops

__all__ = ["MaxPool2d", "AdaptiveAvgPool2d"]

_DT = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_SMS: dict = {}


def _pair(v) -> tuple:
    return (v, v) if isinstance(v, int) else tuple(v)


def _sms(dev: int) -> int:
    n = _SMS.get(dev)
    if n is None:
        n = _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return n


def _forward(x: torch.Tensor, geom: tuple, dtype: str, keep: bool):
    """y of x (channels-last), and the window taps' bytes where ``keep``."""
    N, C, H, W, OH, OW = geom[:6]
    y = x.new_empty_strided((N, C, OH, OW), (OH * OW * C, 1, OW * C, C))      # (channels-last: nn-out-alloc)
    idx = torch.empty((N, OH, OW, C), dtype=torch.uint8, device=x.device) if keep else None
    dev = x.device.index
    pool.launch_forward(dev, torch.cuda.current_stream(x.device).cuda_stream, dtype, geom, x.data_ptr(),
                        y.data_ptr(), idx.data_ptr() if keep else 0, _sms(dev))
    return y, idx


class _MaxPool(torch.autograd.Function):
    """y from x; the backward from the saved window taps."""

    @staticmethod
    def forward(ctx, x, geom, dtype):
        y, idx = _forward(x, geom, dtype, True)
        ctx.save_for_backward(idx)
        ctx.geom, ctx.dtype = geom, dtype
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        (idx,) = ctx.saved_tensors
        geom = ctx.geom
        N, C, H, W = geom[:4]
        dy = dy.contiguous(memory_format=torch.channels_last)
        dx = torch.empty((N, C, H, W), dtype=dy.dtype, device=dy.device, memory_format=torch.channels_last)
        dev = dy.device.index
        pool.launch_backward(dev, torch.cuda.current_stream(dy.device).cuda_stream, ctx.dtype, geom, dy.data_ptr(),
                             idx.data_ptr(), dx.data_ptr(), _sms(dev))
        return dx, None, None


class MaxPool2d(nn.MaxPool2d):
    """``torch.nn.MaxPool2d`` (same arguments, semantics and results) on igemm's kernels for channels-last CUDA
    tensors (module doc). ``MaxPool2d.from_torch(m)`` makes one with ``m``'s settings."""

    @classmethod
    def from_torch(cls, m: nn.MaxPool2d) -> "MaxPool2d":
        return cls(m.kernel_size, m.stride, m.padding, m.dilation, m.return_indices, m.ceil_mode)

    def _geom(self, x: torch.Tensor):
        """(geometry, dtype) for the kernels, or None where ``torch.nn.MaxPool2d.forward`` runs."""
        if (self.return_indices or not _ops.eager(x) or x.dim() != 4 or x.dtype not in _DT
                or not x.is_contiguous(memory_format=torch.channels_last)):
            return None
        k, s, p, d = _pair(self.kernel_size), _pair(self.stride or self.kernel_size), _pair(self.padding), \
            _pair(self.dilation)
        N, C, H, W = x.shape
        OH, OW = (pool.out_size(n, k[i], s[i], p[i], d[i], self.ceil_mode) for i, n in enumerate((H, W)))
        if pool.fits(_DT[x.dtype], N, C, H, W, OH, OW, k, p, d) is not None:
            return None
        return (N, C, H, W, OH, OW, k, s, p, d), _DT[x.dtype]

    def forward(self, x: torch.Tensor):
        g = self._geom(x)
        if g is None:
            return super().forward(x)
        if torch.is_grad_enabled() and x.requires_grad:
            return _MaxPool.apply(x, *g)
        return _forward(x, *g, False)[0]


def _avg_forward(x: torch.Tensor, dtype: str) -> torch.Tensor:
    N, C, H, W = x.shape
    y = x.new_empty_strided((N, C, 1, 1), (C, 1, C, C))
    pool.launch_avg_global(x.device.index, torch.cuda.current_stream(x.device).cuda_stream, dtype, N, C, H * W,
                           x.data_ptr(), y.data_ptr())
    return y


class _AvgPool(torch.autograd.Function):
    """y from x; the backward is the mean's (``mean_backward``: dy expanded over the pixels, divided by their
    count), as PyTorch's ops."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.shape = x.shape
        return _avg_forward(x, dtype)

    @staticmethod
    def backward(ctx, dy):
        N, C, H, W = ctx.shape
        return dy.expand(N, C, H, W) / (H * W), None


class AdaptiveAvgPool2d(nn.AdaptiveAvgPool2d):
    """``torch.nn.AdaptiveAvgPool2d`` (same argument, results within the dtype's rounding); to 1 x 1 on a
    channels-last CUDA tensor it runs igemm's kernel (module doc). ``AdaptiveAvgPool2d.from_torch(m)`` makes one
    with ``m``'s output size."""

    @classmethod
    def from_torch(cls, m: nn.AdaptiveAvgPool2d) -> "AdaptiveAvgPool2d":
        return cls(m.output_size)

    def _dtype(self, x: torch.Tensor) -> str | None:
        """The kernel's dtype, or None where ``torch.nn.AdaptiveAvgPool2d.forward`` runs."""
        if (_pair(self.output_size) != (1, 1) or not _ops.eager(x) or x.dim() != 4 or x.dtype not in _DT
                or not x.is_contiguous(memory_format=torch.channels_last)):
            return None
        dt = _DT[x.dtype]
        return dt if pool.fits_avg(dt, *x.shape) is None else None

    def forward(self, x: torch.Tensor):
        dt = self._dtype(x)
        if dt is None:
            return super().forward(x)
        if torch.is_grad_enabled() and x.requires_grad:
            return _AvgPool.apply(x, dt)
        return _avg_forward(x, dt)
