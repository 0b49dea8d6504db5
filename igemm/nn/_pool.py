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

``AvgPoolLinear`` is a classifier's head -- that pool, ``torch.flatten(., 1)`` and an ``nn.Linear`` -- as one module
(``convert`` makes it from that pattern): for inference on one or two 16-bit images it is one kernel; otherwise the
pool above and ``torch.nn.functional.linear`` (cuBLAS), which also give its gradients.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import pool
from . import _ops

__all__ = ["MaxPool2d", "AdaptiveAvgPool2d", "AvgPoolLinear"]

_DT = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_SMS: dict = {}
_CC: dict = {}


def _cc(dev: int) -> tuple:
    c = _CC.get(dev)
    if c is None:
        c = _CC[dev] = torch.cuda.get_device_capability(dev)
    return c


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
        if torch.is_grad_enabled():                  # (a double backward: differentiable ops only)
            return dy.expand(N, C, H, W) / (H * W), None
        # the same division, written channels-last as x is (the next layer's backward reads it so): one pass, where
        # the expanded quotient would be copied again (docs/performance.md: avgpool-bwd-channels-last)
        dx = torch.empty((N, C, H, W), dtype=dy.dtype, device=dy.device, memory_format=torch.channels_last)
        return torch.div(dy.expand(N, C, H, W), H * W, out=dx), None


class AdaptiveAvgPool2d(nn.AdaptiveAvgPool2d):
    """``torch.nn.AdaptiveAvgPool2d`` (same argument, results within the dtype's rounding); to 1 x 1 on a
    channels-last CUDA tensor it runs igemm's kernel (module doc). ``AdaptiveAvgPool2d.from_torch(m)`` makes one
    with ``m``'s output size."""

    @classmethod
    def from_torch(cls, m: nn.AdaptiveAvgPool2d) -> "AdaptiveAvgPool2d":
        return cls(m.output_size)

    def _dtype(self, x: torch.Tensor) -> str | None:
        """The kernel's dtype, or None where ``torch.nn.AdaptiveAvgPool2d.forward`` runs."""
        return _avg_dtype(x) if _pair(self.output_size) == (1, 1) else None

    def forward(self, x: torch.Tensor):
        return _avg_pool(x) if _pair(self.output_size) == (1, 1) else super().forward(x)


def _avg_dtype(x: torch.Tensor) -> str | None:
    """The global average pool kernel's dtype for ``x``, or None where PyTorch's pool runs."""
    if (not _ops.eager(x) or x.dim() != 4 or x.dtype not in _DT
            or not x.is_contiguous(memory_format=torch.channels_last)):
        return None
    dt = _DT[x.dtype]
    return dt if pool.fits_avg(dt, *x.shape) is None else None


def _avg_pool(x: torch.Tensor) -> torch.Tensor:
    """``adaptive_avg_pool2d(x, 1)`` on igemm's kernel where it runs, else PyTorch's."""
    dt = _avg_dtype(x)
    if dt is None:
        return nn.functional.adaptive_avg_pool2d(x, 1)
    if torch.is_grad_enabled() and x.requires_grad:
        return _AvgPool.apply(x, dt)
    return _avg_forward(x, dt)


class AvgPoolLinear(nn.Module):
    """A classifier head: ``linear(flatten(adaptive_avg_pool2d(x, 1), 1), weight, bias)`` -- a global average pool, a
    flatten and an ``nn.Linear`` -- as one module: ``x`` (N, C, H, W) -> (N, out_features). ``weight`` and ``bias`` are
    ``nn.Linear``'s; ``AvgPoolLinear.from_torch(linear)`` shares a Linear's parameters.

    Inference (no gradient to record, no autocast) on a channels-last fp16 or bf16 CUDA tensor of up to
    ``pool.HEAD_IMAGES`` images of the weight's dtype runs one kernel (the pool's mean rounded to the dtype, as
    PyTorch's pool returns it, then the products summed in fp32: igemm/pool.py); anything else runs
    :class:`AdaptiveAvgPool2d`'s pool and ``torch.nn.functional.linear`` (cuBLAS, which is faster for more images
    and for fp32: docs/performance.md, classifier-head)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        lin = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
        self.in_features, self.out_features = in_features, out_features
        self.weight = lin.weight
        self.register_parameter("bias", lin.bias)

    @classmethod
    def from_torch(cls, linear: nn.Linear) -> "AvgPoolLinear":
        """The head over ``linear`` (its parameter objects, shared)."""
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features, m.out_features = linear.in_features, linear.out_features
        m._parameters = dict(linear._parameters)
        return m

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def _tensors(self) -> tuple:
        p = self._parameters
        return p["weight"], p["bias"]

    def _dtype(self, x: torch.Tensor) -> str | None:
        """The head kernel's dtype for ``x``, or None where the pool and ``linear`` run."""
        w, b = self._parameters["weight"], self._parameters["bias"]
        dt = _avg_dtype(x)
        if (dt is None or x.shape[0] > pool.HEAD_IMAGES or w.dtype != x.dtype or w.device != x.device
                or not w.is_contiguous() or w.shape != (self.out_features, x.shape[1])
                or (x.data_ptr() | w.data_ptr()) & 15 or torch.is_autocast_enabled("cuda")
                or torch.is_grad_enabled() and (x.requires_grad or w.requires_grad
                                                or b is not None and b.requires_grad)
                or b is not None and (b.dtype != x.dtype or b.device != x.device or b.dim() != 1
                                      or b.shape[0] != self.out_features or b.stride(0) != 1)):
            return None
        N, C, H, W = x.shape
        dev = x.device.index
        return dt if pool.fits_head(dt, N, C, H, W, self.out_features, _cc(dev)) is None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = self._dtype(x)
        if dt is None:
            return nn.functional.linear(torch.flatten(_avg_pool(x), 1), self.weight, self.bias)
        N, C, H, W = x.shape
        b = self._parameters["bias"]
        y = torch.empty((N, self.out_features), dtype=x.dtype, device=x.device)
        pool.launch_avg_linear(x.device.index, torch.cuda.current_stream(x.device).cuda_stream, dt, N, C, H * W,
                               self.out_features, x.data_ptr(), self.weight.data_ptr(),
                               b.data_ptr() if b is not None else 0, y.data_ptr())
        return y
