"""igemm's PReLU and index_add as differentiable custom ops: ``torch.ops.igemm.prelu`` (its backward
``torch.ops.igemm.prelu_backward``: igemm's deterministic dweight) and ``torch.ops.igemm.index_add`` (out of
place, as ``torch.index_add``), each with a fake implementation and a ``register_autograd`` formula. CUDA: igemm's
kernels (a channels_last x runs PReLU's NHWC kernel on its permuted view); the CPU: PyTorch's ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _ops
from ._autograd import memory_format

__all__ = ["prelu", "index_add"]

_lib = _ops._lib
_lib.define("prelu(Tensor x, Tensor weight) -> Tensor")
_lib.define("prelu_backward(Tensor grad, Tensor x, Tensor weight) -> (Tensor, Tensor)")
_lib.define("index_add(Tensor x, int dim, Tensor index, Tensor source, float alpha=1) -> Tensor")


def _cuda_ok(*ts) -> bool:
    return all(t.is_cuda and t.dtype in _ops._DTYPES for t in ts)


def _channels(x):
    """(x's view for igemm, layout): a channels_last 4-D x as its NHWC view."""
    if x.dim() == 4 and _ops._nhwc(x):
        return x.permute(0, 2, 3, 1), "NHWC"
    return x.contiguous(), "NCHW"


# ------------------------------------------------------------------------------------------------ PReLU
def _prelu_cuda(x, weight):
    from .. import prelu
    if not _cuda_ok(x) or weight.dtype not in (x.dtype, torch.float32):
        return _prelu_torch(x, weight)
    v, layout = _channels(x)
    y = prelu(v, weight.contiguous(), layout=layout)
    return y.permute(0, 3, 1, 2) if layout == "NHWC" else y


def _prelu_torch(x, weight):
    return F.prelu(x, weight.to(x.dtype)).contiguous(memory_format=memory_format(x) if x.dim() == 4
                                                     else torch.contiguous_format)


def _prelu_fake(x, weight):
    return torch.empty_like(x, memory_format=memory_format(x) if x.dim() == 4 else torch.contiguous_format)


def _prelu_backward_cuda(grad, x, weight):
    from .. import prelu_backward
    if not _cuda_ok(x, grad) or weight.dtype not in (x.dtype, torch.float32):
        return _prelu_backward_torch(grad, x, weight)
    v, layout = _channels(x)
    g = grad.contiguous(memory_format=memory_format(x)) if x.dim() == 4 else grad.contiguous()
    dx, dw = prelu_backward(g.permute(0, 2, 3, 1) if layout == "NHWC" else g, v, weight.contiguous(), layout=layout)
    return (dx.permute(0, 3, 1, 2) if layout == "NHWC" else dx), dw


def _prelu_backward_torch(grad, x, weight):
    neg = x <= 0
    w = weight.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    shape = [1, -1] + [1] * (x.dim() - 2) if weight.numel() > 1 else [1] * x.dim()
    dx = torch.where(neg, grad * w.view(shape).to(grad.dtype), grad)
    prod = torch.where(neg, x.to(w.dtype) * grad.to(w.dtype), torch.zeros((), dtype=w.dtype, device=x.device))
    dims = [d for d in range(x.dim()) if not (weight.numel() > 1 and d == 1)]
    dw = prod.sum(dims).reshape(weight.shape).to(weight.dtype)
    return dx, dw


def _prelu_backward_fake(grad, x, weight):
    return _prelu_fake(x, weight), torch.empty_like(weight)


_lib.impl("prelu", _prelu_cuda, "CUDA")
_lib.impl("prelu", _prelu_torch, "CPU")
torch.library.register_fake("igemm::prelu", _prelu_fake, lib=_lib)
_lib.impl("prelu_backward", _prelu_backward_cuda, "CUDA")
_lib.impl("prelu_backward", _prelu_backward_torch, "CPU")
torch.library.register_fake("igemm::prelu_backward", _prelu_backward_fake, lib=_lib)


def _prelu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _prelu_grad(ctx, grad):
    x, weight = ctx.saved_tensors
    dx, dw = torch.ops.igemm.prelu_backward(grad, x, weight)
    return (dx if ctx.needs_input_grad[0] else None), (dw if ctx.needs_input_grad[1] else None)


torch.library.register_autograd("igemm::prelu", _prelu_grad, setup_context=_prelu_setup, lib=_lib)


# ------------------------------------------------------------------------------------------------ index_add
def _index_add_cuda(x, dim, index, source, alpha):
    from .. import index_add
    if not _cuda_ok(x, source) or source.dtype != x.dtype:
        return _index_add_torch(x, dim, index, source, alpha)
    out = x.contiguous().clone()
    index_add(out, dim, index.contiguous(), source.contiguous(), alpha)
    return out


def _index_add_torch(x, dim, index, source, alpha):
    return torch.index_add(x.contiguous(), dim, index, source, alpha=alpha)


def _index_add_fake(x, dim, index, source, alpha):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_lib.impl("index_add", _index_add_cuda, "CUDA")
_lib.impl("index_add", _index_add_torch, "CPU")
torch.library.register_fake("igemm::index_add", _index_add_fake, lib=_lib)


def _index_add_setup(ctx, inputs, output):
    _, dim, index, _, alpha = inputs
    ctx.save_for_backward(index)
    ctx.args = (dim, alpha)


def _index_add_grad(ctx, grad):
    (index,), (dim, alpha) = ctx.saved_tensors, ctx.args
    dsource = grad.index_select(dim, index) * alpha if ctx.needs_input_grad[3] else None
    return (grad if ctx.needs_input_grad[0] else None), None, None, dsource, None


torch.library.register_autograd("igemm::index_add", _index_add_grad, setup_context=_index_add_setup, lib=_lib)


def prelu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``torch.ops.igemm.prelu``: ``F.prelu(x, weight)`` (weight: 1 or C values, x's dtype or fp32), differentiable
    (dweight reduced deterministically)."""
    return torch.ops.igemm.prelu(x, weight)


def index_add(x: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, alpha: float = 1) -> torch.Tensor:
    """``torch.ops.igemm.index_add``: ``torch.index_add(x, dim, index, source, alpha=alpha)`` (out of place),
    differentiable in x and source."""
    return torch.ops.igemm.index_add(x, int(dim), index, source, float(alpha))
