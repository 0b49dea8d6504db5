"""Training-mode conv -> BatchNorm (batch statistics) [-> + residual] [-> ReLU] as one custom op with a backward:
``torch.ops.igemm.conv2d_bn_train`` and ``torch.ops.igemm.conv2d_bn_train_backward``, joined by
:func:`conv2d_bn_train` (a ``torch.autograd.Function``, which torch.compile traces).

Forward (CUDA): igemm's convolution writes z; one Welford pass gives the batch statistics and updates the running
ones in place (``BatchNorm2d``'s update, in the same kernel); one BN(-Add)-ReLU pass writes y and the 1-bit ReLU
mask. Saved for the backward: x, w, z, the mask and the statistics (never y). Backward (CUDA): one BN-backward
reduction (``conv2d_grad_prologue``: dgamma, dbeta and the per-channel coefficients), then dgrad and wgrad
reading ``dz = a·(bit ? dy : 0) + b·z + c`` on load (dz never stored), and for a residual ``relu_backward``.

The op mutates the running statistics, so ``torch.library.register_autograd`` (functional ops only) cannot
carry its formula; the autograd.Function does, and torch.compile functionalises the op. On the CPU the same
computation in PyTorch ops (float64 too: ``gradcheck``); the mask in igemm's format.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _ops
from ._autograd import memory_format, pack_mask, unpack_mask

__all__ = ["conv2d_bn_train"]

_ops._lib.define("conv2d_bn_train(Tensor x, Tensor weight, Tensor? bn_weight, Tensor? bn_bias, "
                 "Tensor(a!)? running_mean, Tensor(b!)? running_var, float momentum, float eps, Tensor? residual, "
                 "int[2] stride, int[2] padding, int[2] dilation, bool relu) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
_ops._lib.define("conv2d_bn_train_backward(Tensor grad, Tensor x, Tensor weight, Tensor z, Tensor mask, Tensor mean, "
                 "Tensor invstd, Tensor? bn_weight, int[2] stride, int[2] padding, int[2] dilation, bool relu, "
                 "bool residual, bool[4] output_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
_DIMS = (0, 2, 3)


def _stat_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _nhwc(t: torch.Tensor) -> torch.Tensor:
    return t.permute(0, 2, 3, 1)


def _f32(v):
    return v.float().contiguous() if v is not None else None


# ------------------------------------------------------------------------------------------------ forward
def _forward_cuda(x, weight, bn_weight, bn_bias, running_mean, running_var, momentum, eps, residual, stride, padding,
                  dilation, relu):
    from .. import batch_norm_elemt, batch_norm_relu, batch_norm_stats
    if not _ops.supported(x, weight):
        return _forward_torch(x, weight, bn_weight, bn_bias, running_mean, running_var, momentum, eps, residual,
                              stride, padding, dilation, relu)
    _check(x, weight, bn_weight, bn_bias, residual, stride, padding, dilation)
    z = _ops._conv2d_cuda(x, weight, None, None, None, None, None, eps, None, stride, padding, dilation, False)
    fmt = memory_format(x)
    nhwc = fmt == torch.channels_last
    layout, zv = ("NHWC", _nhwc(z)) if nhwc else ("NCHW", z)
    rv = None
    if residual is not None:
        r = residual.contiguous(memory_format=fmt)
        rv = _nhwc(r) if nhwc else r
    fused = running_mean is not None and all(_fp32_vector(t) for t in (running_mean, running_var))
    if fused:                                # (the running update in the statistics kernel)
        mean, invstd = batch_norm_stats(zv, eps, layout, running_mean=running_mean, running_var=running_var,
                                        momentum=momentum)
    else:
        mean, invstd = batch_norm_stats(zv, eps, layout)
        _update(running_mean, running_var, mean, invstd, momentum, eps, z)
    g, b = _f32(bn_weight), _f32(bn_bias)
    if relu:
        y, mask = batch_norm_relu(zv, mean, invstd, g, b, rv, True, layout=layout)
    else:
        y, mask = batch_norm_elemt(zv, mean, invstd, g, b, residual=rv, layout=layout), x.new_empty(0, dtype=torch.int32)
    return (y.permute(0, 3, 1, 2) if nhwc else y), z, mask, mean, invstd


def _forward_torch(x, weight, bn_weight, bn_bias, running_mean, running_var, momentum, eps, residual, stride, padding,
                   dilation, relu):
    _check(x, weight, bn_weight, bn_bias, residual, stride, padding, dilation)
    fmt = memory_format(x)
    z = F.conv2d(x, weight, None, list(stride), list(padding), list(dilation)).contiguous(memory_format=fmt)
    zs = z.to(_stat_dtype(z))
    var, mean = torch.var_mean(zs, dim=_DIMS, unbiased=False)
    invstd = torch.rsqrt(var + eps)
    _update(running_mean, running_var, mean, invstd, momentum, eps, z)
    y = (zs - mean.view(1, -1, 1, 1)) * invstd.view(1, -1, 1, 1)
    if bn_weight is not None:
        y = y * bn_weight.to(y.dtype).view(1, -1, 1, 1)
    if bn_bias is not None:
        y = y + bn_bias.to(y.dtype).view(1, -1, 1, 1)
    if residual is not None:
        y = y + residual.to(y.dtype)
    y = y.to(x.dtype)                                     # (computed in fp32, rounded once: as the CUDA kernel)
    mask = x.new_empty(0, dtype=torch.int32)
    if relu:
        y = torch.relu(y)
        mask = pack_mask((y > 0).contiguous(memory_format=fmt))
    return y.contiguous(memory_format=fmt), z, mask, mean, invstd


def _forward_fake(x, weight, bn_weight, bn_bias, running_mean, running_var, momentum, eps, residual, stride, padding,
                  dilation, relu):
    if _ops._recording is not None and x.dtype in _ops._DTYPES and weight.dtype == x.dtype:   # (precompile)
        _ops._recording.append(_ops._plan_key(x, weight, None, None, None, stride, padding, dilation, False))
        _ops._recording.append(_ops.grad_key(x, weight, stride, padding, dilation, relu, True))
    fmt = memory_format(x)
    shape = _ops._out_size(x, weight, stride, padding, dilation)
    y = x.new_empty(shape).contiguous(memory_format=fmt)
    n = 1
    for s in shape:
        n *= s
    mask = x.new_empty(((n + 31) // 32) if relu else 0, dtype=torch.int32)
    st = _stat_dtype(x)
    return y, torch.empty_like(y), mask, x.new_empty(shape[1], dtype=st), x.new_empty(shape[1], dtype=st)


def _check(x, weight, bn_weight, bn_bias, residual, stride, padding, dilation):
    _ops._check(x, weight, None, (bn_weight, bn_bias, None, None), residual, stride, padding, dilation)


def _fp32_vector(t) -> bool:
    return t.dtype == torch.float32 and t.is_cuda and t.dim() == 1 and t.is_contiguous()


@torch.no_grad()
def _update(running_mean, running_var, mean, invstd, momentum, eps, z) -> None:
    """``BatchNorm2d``'s running update with PyTorch ops (the CPU; running statistics that are not fp32)."""
    if running_mean is None:
        return
    count = z.numel() // max(z.shape[1], 1)
    var = (invstd.double().reciprocal().square() - eps).clamp_min(0) * (count / max(count - 1, 1))
    running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
    running_var.mul_(1 - momentum).add_(var.to(running_var.dtype), alpha=momentum)


_ops._lib.impl("conv2d_bn_train", _forward_cuda, "CUDA")
_ops._lib.impl("conv2d_bn_train", _forward_torch, "CPU")
torch.library.register_fake("igemm::conv2d_bn_train", _forward_fake, lib=_ops._lib)


# ------------------------------------------------------------------------------------------------ backward
def _backward_cuda(grad, x, weight, z, mask, mean, invstd, bn_weight, stride, padding, dilation, relu, residual,
                   output_mask):
    from .. import conv2d_grad_input, conv2d_grad_prologue, conv2d_grad_weight, relu_backward
    if not _ops.supported(x, weight):
        return _backward_torch(grad, x, weight, z, mask, mean, invstd, bn_weight, stride, padding, dilation, relu,
                               residual, output_mask)
    fmt = memory_format(z)
    if not x.is_contiguous(memory_format=fmt):
        x = x.contiguous(memory_format=fmt)
    dy = grad.contiguous(memory_format=fmt)              # (the mask is over z's memory order)
    m = mask if relu else None
    p = conv2d_grad_prologue(dy, z, mean, invstd, _f32(bn_weight), mask=m)
    st, pd, dl = tuple(stride), tuple(padding), tuple(dilation)
    empty = x.new_empty(0)
    dx = conv2d_grad_input(dy, weight.contiguous(memory_format=fmt), tuple(x.shape), st, pd, dl, mask=m,
                           prologue=p) if output_mask[0] else empty
    dw = conv2d_grad_weight(x, dy, tuple(weight.shape), st, pd, dl, mask=m, prologue=p) if output_mask[1] else empty
    dres = empty
    if residual and output_mask[3]:
        dres = (_nhwc_back(relu_backward(_nhwc(dy), m)) if fmt == torch.channels_last else relu_backward(dy, m)) \
            if relu else dy
    return dx, dw, p.grad_weight, p.grad_bias, dres


def _nhwc_back(t):
    return t.permute(0, 3, 1, 2)


def _backward_torch(grad, x, weight, z, mask, mean, invstd, bn_weight, stride, padding, dilation, relu, residual,
                    output_mask):
    fmt = memory_format(z)
    st = _stat_dtype(z)
    g = grad.to(st)
    if relu:
        g = torch.where(unpack_mask(mask, z), g, torch.zeros((), dtype=st, device=g.device))
    xhat = (z.to(st) - mean.view(1, -1, 1, 1)) * invstd.view(1, -1, 1, 1)
    count = z.numel() // max(z.shape[1], 1)
    dbeta, dgamma = g.sum(_DIMS), (g * xhat).sum(_DIMS)
    gam = bn_weight.to(st) if bn_weight is not None else torch.ones_like(mean)
    dz = (gam * invstd).view(1, -1, 1, 1) * (g - (dbeta / count).view(1, -1, 1, 1)
                                             - xhat * (dgamma / count).view(1, -1, 1, 1))
    dx, dw, _ = torch.ops.aten.convolution_backward(dz.to(x.dtype), x, weight, None, list(stride), list(padding),
                                                    list(dilation), False, [0, 0], 1,
                                                    [output_mask[0], output_mask[1], False])
    empty = x.new_empty(0)
    dres = g.to(x.dtype).contiguous(memory_format=fmt) if residual and output_mask[3] else empty
    return (dx.contiguous(memory_format=fmt) if dx is not None else empty, dw if dw is not None else empty,
            dgamma, dbeta, dres)


def _backward_fake(grad, x, weight, z, mask, mean, invstd, bn_weight, stride, padding, dilation, relu, residual,
                   output_mask):
    empty = x.new_empty(0)
    fmt = memory_format(z)
    return (torch.empty_like(x, memory_format=fmt) if output_mask[0] else empty,
            torch.empty_like(weight) if output_mask[1] else empty, torch.empty_like(mean), torch.empty_like(mean),
            torch.empty_like(z, memory_format=fmt) if residual and output_mask[3] else empty)


_ops._lib.impl("conv2d_bn_train_backward", _backward_cuda, "CUDA")
_ops._lib.impl("conv2d_bn_train_backward", _backward_torch, "CPU")
torch.library.register_fake("igemm::conv2d_bn_train_backward", _backward_fake, lib=_ops._lib)


# ------------------------------------------------------------------------------------------------ autograd
class _Train(torch.autograd.Function):
    """conv2d_bn_train's y, differentiable in x, weight, bn_weight, bn_bias and residual."""

    @staticmethod
    def forward(ctx, x, weight, bn_weight, bn_bias, residual, running_mean, running_var, momentum, eps, stride,
                padding, dilation, relu):
        y, z, mask, mean, invstd = torch.ops.igemm.conv2d_bn_train(x, weight, bn_weight, bn_bias, running_mean,
                                                                   running_var, momentum, eps, residual, stride,
                                                                   padding, dilation, relu)
        ctx.save_for_backward(x, weight, z, mask, mean, invstd, bn_weight)
        ctx.args = (stride, padding, dilation, relu, residual is not None)
        ctx.dtypes = (bn_weight.dtype if bn_weight is not None else None,
                      bn_bias.dtype if bn_bias is not None else None)
        ctx.mark_non_differentiable(z, mask, mean, invstd)
        return y, z, mask, mean, invstd

    @staticmethod
    def backward(ctx, dy, _dz, _dmask, _dmean, _dinvstd):
        x, weight, z, mask, mean, invstd, bn_weight = ctx.saved_tensors
        stride, padding, dilation, relu, residual = ctx.args
        need = ctx.needs_input_grad
        dx, dw, dg, db, dres = torch.ops.igemm.conv2d_bn_train_backward(
            dy, x, weight, z, mask, mean, invstd, bn_weight, stride, padding, dilation, relu, residual,
            [need[0], need[1], need[2] or need[3], need[4]])
        return (dx if need[0] else None, dw if need[1] else None,
                dg.to(ctx.dtypes[0]) if need[2] else None, db.to(ctx.dtypes[1]) if need[3] else None,
                dres if need[4] else None, None, None, None, None, None, None, None, None)


def conv2d_bn_train(x, weight, bn_weight=None, bn_bias=None, eps: float = 1e-5, residual=None, stride=(1, 1),
                    padding=(0, 0), dilation=(1, 1), relu: bool = True, *, running_mean=None, running_var=None,
                    momentum: float = 0.1) -> tuple:
    """``(y, z, mask, mean, invstd)`` of ``relu?(BN(conv(x, w)) [+ residual])`` with BatchNorm in training mode
    (batch statistics, biased variance), differentiable in x, weight, bn_weight, bn_bias and residual; z (the
    conv output), the mask and the statistics are what the backward reads. ``running_mean``/``running_var``,
    when given, get ``BatchNorm2d``'s update in place: ``r = (1 - momentum)·r + momentum·stat``, the variance
    unbiased."""
    return _Train.apply(x, weight, bn_weight, bn_bias, residual, running_mean, running_var, float(momentum),
                        float(eps), list(stride), list(padding), list(dilation), bool(relu))
