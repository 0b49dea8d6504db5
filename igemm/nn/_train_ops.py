"""Training-mode conv -> BatchNorm (batch statistics) [-> + residual] [-> ReLU] as one custom op with a backward:
``torch.ops.igemm.conv2d_bn_train`` and ``torch.ops.igemm.conv2d_bn_train_backward``, joined by
:func:`conv2d_bn_train` (a ``torch.autograd.Function``, which torch.compile traces).

Forward (CUDA): igemm's convolution writes z; one Welford pass gives the batch statistics and updates the running
ones in place (``BatchNorm2d``'s update, in the same kernel); one BN(-Add)-ReLU pass writes y and the 1-bit ReLU
mask. Saved for the backward: x, w, z, the mask and the statistics (never y). Backward (CUDA): one BN-backward
reduction (``conv2d_grad_prologue``: dgamma, dbeta and the per-channel coefficients), then dgrad and wgrad
reading ``dz = a·(bit ? dy : 0) + b·z + c`` (their pre-pass writes it once), and for a residual ``relu_backward``.

The op mutates the running statistics, so ``torch.library.register_autograd`` (functional ops only) cannot
carry its formula; the autograd.Function does, and torch.compile functionalises the op. On the CPU the same
computation in PyTorch ops (float64 too: ``gradcheck``); the mask in igemm's format.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import _ops
from ._autograd import memory_format, pack_mask, unpack_mask

__all__ = ["conv2d_bn_train"]

_ops._lib.define("conv2d_bn_train(Tensor x, Tensor weight, Tensor? bn_weight, Tensor? bn_bias, "
                 "Tensor(a!)? running_mean, Tensor(b!)? running_var, float momentum, float eps, Tensor? residual, "
                 "int[2] stride, int[2] padding, int[2] dilation, bool relu, int group=0) "
                 "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_ops._lib.define("conv2d_bn_train_backward(Tensor grad, Tensor x, Tensor weight, Tensor z, Tensor mask, Tensor mean, "
                 "Tensor invstd, Tensor count, Tensor? bn_weight, int[2] stride, int[2] padding, int[2] dilation, "
                 "bool relu, bool residual, bool[4] output_mask, int group=0) "
                 "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
_GROUPS: list = [None]          # group ids of the ops' ``group`` argument (0: none); torch.distributed process groups


def group_id(process_group) -> int:
    """The ``group`` argument naming ``process_group`` (None: the default group) for SyncBatchNorm statistics."""
    for i, g in enumerate(_GROUPS[1:], 1):
        if g[0] is process_group:
            return i
    _GROUPS.append((process_group,))
    return len(_GROUPS) - 1


def _group(group: int):
    return _GROUPS[group][0]
_DIMS = (0, 2, 3)


def _stat_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _nhwc(t: torch.Tensor) -> torch.Tensor:
    return t.permute(0, 2, 3, 1)


def _f32(v):
    return v.float().contiguous() if v is not None else None


# ------------------------------------------------------------------------------------------------ forward
def _forward_cuda(x, weight, bn_weight, bn_bias, running_mean, running_var, momentum, eps, residual, stride, padding,
                  dilation, relu, group=0):
    from .. import batch_norm_elemt, batch_norm_relu, batch_norm_stats, sync_batch_norm_stats
    if not _ops.supported(x, weight):
        return _forward_torch(x, weight, bn_weight, bn_bias, running_mean, running_var, momentum, eps, residual,
                              stride, padding, dilation, relu, group)
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
    run = dict(running_mean=running_mean, running_var=running_var, momentum=momentum) if fused else {}
    count = x.new_empty(0, dtype=torch.float32)
    if group:                                # SyncBatchNorm: the statistics of every rank's batch (NCCL)
        mean, invstd, count = sync_batch_norm_stats(zv, eps, _group(group), layout=layout, return_count=True, **run)
    else:                                    # (the running update in the statistics kernel)
        mean, invstd = batch_norm_stats(zv, eps, layout, **run)
    if not fused:
        _update(running_mean, running_var, mean, invstd, momentum, eps, _count(z, count))
    g, b = _f32(bn_weight), _f32(bn_bias)
    if relu:
        y, mask = batch_norm_relu(zv, mean, invstd, g, b, rv, True, layout=layout)
    else:
        y = batch_norm_elemt(zv, mean, invstd, g, b, residual=rv, layout=layout)
        mask = x.new_empty(0, dtype=torch.int32)
    return (y.permute(0, 3, 1, 2) if nhwc else y), z, mask, mean, invstd, count


def _count(z, count) -> float:
    """Values per channel of the statistics: this batch's, or the synced batches' (``count``, device)."""
    return float(count[0]) if count.numel() else z.numel() // max(z.shape[1], 1)


def _all_reduce(t, group: int):
    import torch.distributed as dist
    dist.all_reduce(t, group=_group(group))
    return t


def _forward_torch(x, weight, bn_weight, bn_bias, running_mean, running_var, momentum, eps, residual, stride, padding,
                   dilation, relu, group=0):
    _check(x, weight, bn_weight, bn_bias, residual, stride, padding, dilation)
    fmt = memory_format(x)
    z = F.conv2d(x, weight, None, list(stride), list(padding), list(dilation)).contiguous(memory_format=fmt)
    zs = z.to(_stat_dtype(z))
    var, mean = torch.var_mean(zs, dim=_DIMS, unbiased=False)
    count = x.new_empty(0, dtype=torch.float32)
    if group:                                # (sums of n, n·mean, n·E[z²] over the ranks, float64)
        n = z.numel() // max(z.shape[1], 1)
        m64, v64 = mean.double(), var.double()
        tot = _all_reduce(torch.stack([torch.full_like(m64, n), n * m64, n * (v64 + m64 * m64)]), group)
        mean64 = tot[1] / tot[0]
        var, mean = (tot[2] / tot[0] - mean64 * mean64).clamp_min(0).to(mean.dtype), mean64.to(mean.dtype)
        count = tot[0].float()
    invstd = torch.rsqrt(var + eps)
    _update(running_mean, running_var, mean, invstd, momentum, eps, _count(z, count))
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
    return y.contiguous(memory_format=fmt), z, mask, mean, invstd, count


def _forward_fake(x, weight, bn_weight, bn_bias, running_mean, running_var, momentum, eps, residual, stride, padding,
                  dilation, relu, group=0):
    if _ops._recording is not None and x.dtype in _ops._DTYPES and weight.dtype == x.dtype:   # (precompile)
        _ops._recording.append(_ops._plan_key(x, weight, None, None, None, stride, padding, dilation, False))
        _ops._recording.append(_ops.grad_key(x, weight, stride, padding, dilation, relu, True))
    fmt = memory_format(x)
    shape = _ops._out_size(x, weight, stride, padding, dilation)
    y = x.new_empty(shape).contiguous(memory_format=fmt)
    mask = x.new_empty(((math.prod(shape) + 31) // 32) if relu else 0, dtype=torch.int32)
    st = _stat_dtype(x)
    return (y, torch.empty_like(y), mask, x.new_empty(shape[1], dtype=st), x.new_empty(shape[1], dtype=st),
            x.new_empty(shape[1] if group else 0, dtype=torch.float32))


def _check(x, weight, bn_weight, bn_bias, residual, stride, padding, dilation):
    _ops._check(x, weight, None, (bn_weight, bn_bias, None, None), residual, stride, padding, dilation)


def _fp32_vector(t) -> bool:
    return t.dtype == torch.float32 and t.is_cuda and t.dim() == 1 and t.is_contiguous()


@torch.no_grad()
def _update(running_mean, running_var, mean, invstd, momentum, eps, count: float) -> None:
    """``BatchNorm2d``'s running update with PyTorch ops (the CPU; running statistics that are not fp32)."""
    if running_mean is None:
        return
    var = (invstd.double().reciprocal().square() - eps).clamp_min(0) * (count / max(count - 1, 1))
    running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
    running_var.mul_(1 - momentum).add_(var.to(running_var.dtype), alpha=momentum)


_ops._lib.impl("conv2d_bn_train", _forward_cuda, "CUDA")
_ops._lib.impl("conv2d_bn_train", _forward_torch, "CPU")
torch.library.register_fake("igemm::conv2d_bn_train", _forward_fake, lib=_ops._lib)


# ------------------------------------------------------------------------------------------------ backward
def _backward_cuda(grad, x, weight, z, mask, mean, invstd, count, bn_weight, stride, padding, dilation, relu,
                   residual, output_mask, group=0):
    from .. import (conv2d_backward, conv2d_bn_backward, conv2d_grad_input, conv2d_grad_prologue, conv2d_grad_weight,
                    relu_backward, sync_batch_norm_backward_reduce)
    from ..conv._backward_plan import GradPrologue
    if not _ops.supported(x, weight):
        return _backward_torch(grad, x, weight, z, mask, mean, invstd, count, bn_weight, stride, padding, dilation,
                               relu, residual, output_mask, group)
    fmt = memory_format(z)
    if not x.is_contiguous(memory_format=fmt):
        x = x.contiguous(memory_format=fmt)
    dy = grad.contiguous(memory_format=fmt)              # (the mask is over z's memory order)
    m = mask if relu else None
    st, pd, dl = tuple(stride), tuple(padding), tuple(dilation)
    empty = x.new_empty(0)
    w = weight.contiguous(memory_format=fmt)
    if not group and output_mask[0] and output_mask[1]:  # (BN's sums, dz and the residual's gradient in one launch)
        dx, dw, gw, gb, dres = conv2d_bn_backward(dy, x, w, z, mean, invstd, _f32(bn_weight), st, pd, dl, mask=m,
                                                  residual=bool(residual and output_mask[3]))
        return dx, dw, gw, gb, dres if dres is not None else empty
    if group:                  # SyncBatchNorm: the sums of every rank (NCCL), the coefficients with their count
        nhwc = fmt == torch.channels_last
        sdy, sdx, gw, gb = sync_batch_norm_backward_reduce(
            _nhwc(dy) if nhwc else dy, _nhwc(z) if nhwc else z, mean, invstd, _f32(bn_weight), _group(group),
            mask=m, layout="NHWC" if nhwc else "NCHW")
        p = GradPrologue(z, _coefficients(sdy, sdx, mean, invstd, bn_weight, count), gw, gb)
    else:
        p = conv2d_grad_prologue(dy, z, mean, invstd, _f32(bn_weight), mask=m)
    if output_mask[0] and output_mask[1]:                # (dz formed once for both)
        dx, dw = conv2d_backward(dy, x, w, st, pd, dl, mask=m, prologue=p)
    else:
        dx = conv2d_grad_input(dy, w, tuple(x.shape), st, pd, dl, mask=m, prologue=p) if output_mask[0] else empty
        dw = conv2d_grad_weight(x, dy, tuple(weight.shape), st, pd, dl, mask=m, prologue=p) if output_mask[1] \
            else empty
    dres = empty
    if residual and output_mask[3]:
        dres = (_nhwc_back(relu_backward(_nhwc(dy), m)) if fmt == torch.channels_last else relu_backward(dy, m)) \
            if relu else dy
    return dx, dw, p.grad_weight, p.grad_bias, dres


def _nhwc_back(t):
    return t.permute(0, 3, 1, 2)


def _coefficients(sum_dy, sum_dy_xmu, mean, invstd, bn_weight, count):
    """[a; b; c] of ``dz = a·g + b·z + c`` (BatchNorm's backward with these sums and count), fp32 (3, K)."""
    a = invstd * (bn_weight.to(invstd.dtype) if bn_weight is not None else 1.0)
    b = -a * invstd * invstd * (sum_dy_xmu / count)
    return torch.stack([a, b, -a * (sum_dy / count) - b * mean]).contiguous()


def _backward_torch(grad, x, weight, z, mask, mean, invstd, count, bn_weight, stride, padding, dilation, relu,
                    residual, output_mask, group=0):
    fmt = memory_format(z)
    st = _stat_dtype(z)
    g = grad.to(st)
    if relu:
        g = torch.where(unpack_mask(mask, z), g, torch.zeros((), dtype=st, device=g.device))
    xhat = (z.to(st) - mean.view(1, -1, 1, 1)) * invstd.view(1, -1, 1, 1)
    dbeta, dgamma = g.sum(_DIMS), (g * xhat).sum(_DIMS)
    sums = (dbeta, dgamma)
    n = z.numel() // max(z.shape[1], 1)
    if group:                                # (the sums and the count over the ranks; dgamma, dbeta stay local)
        sums = _all_reduce(torch.stack(sums).double(), group).to(st)
        n = count.to(st)
    gam = bn_weight.to(st) if bn_weight is not None else torch.ones_like(mean)
    dz = (gam * invstd).view(1, -1, 1, 1) * (g - (sums[0] / n).view(1, -1, 1, 1)
                                             - xhat * (sums[1] / n).view(1, -1, 1, 1))
    dx, dw, _ = torch.ops.aten.convolution_backward(dz.to(x.dtype), x, weight, None, list(stride), list(padding),
                                                    list(dilation), False, [0, 0], 1,
                                                    [output_mask[0], output_mask[1], False])
    empty = x.new_empty(0)
    dres = g.to(x.dtype).contiguous(memory_format=fmt) if residual and output_mask[3] else empty
    return (dx.contiguous(memory_format=fmt) if dx is not None else empty, dw if dw is not None else empty,
            dgamma, dbeta, dres)


def _backward_fake(grad, x, weight, z, mask, mean, invstd, count, bn_weight, stride, padding, dilation, relu,
                   residual, output_mask, group=0):
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
                padding, dilation, relu, group):
        y, z, mask, mean, invstd, count = torch.ops.igemm.conv2d_bn_train(
            x, weight, bn_weight, bn_bias, running_mean, running_var, momentum, eps, residual, stride, padding,
            dilation, relu, group)
        ctx.set_materialize_grads(False)          # (no zero tensors for the outputs that have no gradient)
        ctx.save_for_backward(x, weight, z, mask, mean, invstd, count, bn_weight)
        ctx.args = (stride, padding, dilation, relu, residual is not None, group)
        ctx.dtypes = (bn_weight.dtype if bn_weight is not None else None,
                      bn_bias.dtype if bn_bias is not None else None)
        ctx.mark_non_differentiable(z, mask, mean, invstd, count)
        return y, z, mask, mean, invstd, count

    @staticmethod
    def backward(ctx, dy, _dz, _dmask, _dmean, _dinvstd, _dcount):
        if dy is None:                            # (y took no part in what was differentiated)
            return (None,) * 14
        x, weight, z, mask, mean, invstd, count, bn_weight = ctx.saved_tensors
        stride, padding, dilation, relu, residual, group = ctx.args
        need = ctx.needs_input_grad
        dx, dw, dg, db, dres = torch.ops.igemm.conv2d_bn_train_backward(
            dy, x, weight, z, mask, mean, invstd, count, bn_weight, stride, padding, dilation, relu, residual,
            [need[0], need[1], need[2] or need[3], need[4]], group)
        return (dx if need[0] else None, dw if need[1] else None,
                dg.to(ctx.dtypes[0]) if need[2] else None, db.to(ctx.dtypes[1]) if need[3] else None,
                dres if need[4] else None, None, None, None, None, None, None, None, None, None)


def conv2d_bn_train(x, weight, bn_weight=None, bn_bias=None, eps: float = 1e-5, residual=None, stride=(1, 1),
                    padding=(0, 0), dilation=(1, 1), relu: bool = True, *, running_mean=None, running_var=None,
                    momentum: float = 0.1, process_group=False) -> tuple:
    """``(y, z, mask, mean, invstd, count)`` of ``relu?(BN(conv(x, w)) [+ residual])`` with BatchNorm in training
    mode (batch statistics, biased variance), differentiable in x, weight, bn_weight, bn_bias and residual; z (the
    conv output), the mask and the statistics are what the backward reads. ``running_mean``/``running_var``,
    when given, get ``BatchNorm2d``'s update in place: ``r = (1 - momentum)·r + momentum·stat``, the variance
    unbiased. ``process_group`` (a torch.distributed group; None: the default group; False: none): SyncBatchNorm,
    the statistics and the backward's sums over every rank's batch (uneven batches too; ``count``: their size
    per channel, else empty)."""
    group = 0 if process_group is False else group_id(process_group)
    return _Train.apply(x, weight, bn_weight, bn_bias, residual, running_mean, running_var, float(momentum),
                        float(eps), list(stride), list(padding), list(dilation), bool(relu), group)
