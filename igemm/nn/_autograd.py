"""The backward of ``torch.ops.igemm.conv2d``: ``torch.ops.igemm.conv2d_backward`` (custom op, fake included) and
its autograd formula (``torch.library.register_autograd``), so gradients flow through the fused op in eager,
``torch.compile`` and ``torch.export``.

The op is ``y = relu?(scale·(conv(x, w) + bias) + shift + residual)`` with inference BatchNorm folded into
``scale``/``shift``. Its gradient at the conv is ``dc = scale[k]·(y > 0 ? dy : 0)``; on CUDA igemm's dgrad and
wgrad read ``y > 0`` as the 1-bit mask (``relu_mask``) and never materialise dc: ``dx = dgrad(g, scale·w)`` and
``dw = scale·wgrad(x, g)`` (both linear in k). The small gradients (bias, BN affine and statistics, residual)
are PyTorch reductions; those of the BN statistics or weight recompute the conv once (rarely needed: frozen
BatchNorm fine-tuning).

Mask helpers shared with the training op (:mod:`._train_ops`): igemm's 1-bit mask in torch, for the CPU path.
"""
from __future__ import annotations

import numpy as np
import torch

from .. import reference
from . import _ops

__all__ = ["BACKWARD_SCHEMA", "conv2d_backward", "pack_mask", "unpack_mask", "memory_format"]

BACKWARD_SCHEMA = ("conv2d_backward(Tensor grad, Tensor x, Tensor weight, Tensor? y, Tensor? scale, int[2] stride, "
                   "int[2] padding, int[2] dilation, bool[2] output_mask) -> (Tensor, Tensor)")
_ops._lib.define(BACKWARD_SCHEMA)
_DIMS = (0, 2, 3)


def memory_format(t: torch.Tensor) -> torch.memory_format:
    """The memory format igemm's ops give their outputs for an input ``t`` (channels_last: NHWC memory)."""
    return torch.channels_last if _ops._nhwc(t) else torch.contiguous_format


def pack_mask(bits: torch.Tensor) -> torch.Tensor:
    """igemm's 1-bit mask (int32 words; bit ``i % 32`` of word ``i // 32`` is element ``i`` in memory order) of a
    bool tensor: ``igemm.reference.pack_mask`` on the host (the CPU path; a CUDA tensor makes a round trip)."""
    words = reference.pack_mask(_memory_order(bits).detach().cpu().numpy()).view(np.int32)
    return torch.from_numpy(words).to(bits.device)


def unpack_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The bool tensor (``like``'s shape; bits in ``like``'s memory order) of a mask."""
    bits = torch.from_numpy(reference.unpack_mask(mask.detach().cpu().numpy(), like.numel())).to(mask.device)
    if memory_format(like) == torch.channels_last:
        N, C, H, W = like.shape
        return bits.view(N, H, W, C).permute(0, 3, 1, 2)
    return bits.view(like.shape)


def _memory_order(t: torch.Tensor) -> torch.Tensor:
    return t.permute(0, 2, 3, 1) if t.dim() == 4 and memory_format(t) == torch.channels_last else t.contiguous()


def _vec(v: torch.Tensor) -> torch.Tensor:
    return v.view(1, -1, 1, 1)


# ----------------------------------------------------------------------------------- conv2d_backward (dx, dw)
def _backward_cuda(grad, x, weight, y, scale, stride, padding, dilation, output_mask):
    from .. import conv2d_grad_input, conv2d_grad_weight, relu_mask
    if not _ops.supported(x, weight):
        return _backward_torch(grad, x, weight, y, scale, stride, padding, dilation, output_mask)
    fmt = memory_format(x)
    if not x.is_contiguous(memory_format=fmt):
        x = x.contiguous()
    dy = grad.contiguous(memory_format=fmt)           # (the mask is over y's memory order, x's format)
    mask = relu_mask(_memory_order(y.contiguous(memory_format=fmt))) if y is not None else None
    dx = dw = x.new_empty(0)
    if output_mask[0]:
        w = weight if scale is None else (weight * _vec(scale).transpose(0, 1)).to(weight.dtype)
        dx = conv2d_grad_input(dy, w.contiguous(memory_format=fmt), tuple(x.shape), tuple(stride), tuple(padding),
                               tuple(dilation), mask=mask)
    if output_mask[1]:
        dw = conv2d_grad_weight(x, dy, tuple(weight.shape), tuple(stride), tuple(padding), tuple(dilation),
                                mask=mask)
        if scale is not None:
            dw = (dw * _vec(scale).transpose(0, 1)).to(weight.dtype)
    return dx, dw


def _backward_torch(grad, x, weight, y, scale, stride, padding, dilation, output_mask):
    g = grad if y is None else torch.where(y > 0, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
    if scale is not None:
        g = (g * _vec(scale)).to(grad.dtype)
    dx, dw, _ = torch.ops.aten.convolution_backward(g, x, weight, None, list(stride), list(padding), list(dilation),
                                                    False, [0, 0], 1, [output_mask[0], output_mask[1], False])
    return (dx.contiguous(memory_format=memory_format(x)) if dx is not None else x.new_empty(0),
            dw if dw is not None else x.new_empty(0))


def _backward_fake(grad, x, weight, y, scale, stride, padding, dilation, output_mask):
    dx = torch.empty_like(x, memory_format=memory_format(x)) if output_mask[0] else x.new_empty(0)
    dw = torch.empty_like(weight) if output_mask[1] else x.new_empty(0)
    return dx, dw


_ops._lib.impl("conv2d_backward", _backward_cuda, "CUDA")
_ops._lib.impl("conv2d_backward", _backward_torch, "CPU")
torch.library.register_fake("igemm::conv2d_backward", _backward_fake, lib=_ops._lib)


# ----------------------------------------------------------------------------------- conv2d's autograd formula
def _setup(ctx, inputs, output):
    x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps, residual, stride, padding, dilation, relu = inputs
    ctx.save_for_backward(x, weight, output if relu else None, bias, bn_weight, bn_mean, bn_var)
    ctx.args = (eps, stride, padding, dilation)
    ctx.dtypes = [t.dtype if t is not None else None for t in inputs[2:7]]      # (each gradient in its input's)


def _backward(ctx, dy):
    x, weight, y, bias, bn_weight, bn_mean, bn_var = ctx.saved_tensors
    eps, stride, padding, dilation = ctx.args
    need = ctx.needs_input_grad
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32      # (fp32 for the 16-bit dtypes)
    scale = invstd = None
    if bn_mean is not None:
        invstd = torch.rsqrt(bn_var.to(acc) + eps)
        scale = invstd * bn_weight.to(acc) if bn_weight is not None else invstd
    dx = dw = None
    if need[0] or need[1]:
        dx, dw = torch.ops.igemm.conv2d_backward(dy, x, weight, y, scale, stride, padding, dilation,
                                                 [need[0], need[1]])
        dx, dw = (dx if need[0] else None), (dw if need[1] else None)
    small = [None] * 7                                   # bias, bn_weight, bn_bias, bn_mean, bn_var, -, residual
    if any(need[2:7]) or need[8]:
        g = dy if y is None else torch.where(y > 0, dy, torch.zeros((), dtype=dy.dtype, device=dy.device))
        gsum = g.to(acc).sum(_DIMS)
        small[0] = gsum * scale if scale is not None else gsum
        small[2] = gsum
        small[3] = -gsum * scale if scale is not None else None
        if need[3] or need[6]:                           # BN's weight and variance see the conv's output
            c = torch.ops.igemm.conv2d(x, weight, bias, None, None, None, None, eps, None, stride, padding, dilation,
                                       False).to(acc) - _vec(bn_mean.to(acc))
            gc = (g.to(acc) * c).sum(_DIMS)
            small[1] = gc * invstd
            g1 = bn_weight.to(acc) if bn_weight is not None else 1.0
            small[4] = -0.5 * gc * g1 * invstd ** 3
        small[6] = g
    grads = [v.to(dt) if need[2 + i] and v is not None else None for i, (v, dt) in enumerate(zip(small, ctx.dtypes))]
    return dx, dw, *grads, None, small[6] if need[8] else None, None, None, None, None


torch.library.register_autograd("igemm::conv2d", _backward, setup_context=_setup, lib=_ops._lib)


def conv2d_backward(grad, x, weight, y=None, scale=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1),
                    output_mask=(True, True)) -> tuple:
    """``torch.ops.igemm.conv2d_backward``: (dx, dw) of ``conv2d`` for the gradient ``grad`` of its output, read as
    ``scale[k]·(y > 0 ? grad : 0)`` (``y``: the ReLU's output, or None; ``scale``: fp32 per output channel, or
    None). An output not asked for in ``output_mask`` is an empty tensor."""
    return torch.ops.igemm.conv2d_backward(grad, x, weight, y, scale, list(stride), list(padding), list(dilation),
                                           [bool(m) for m in output_mask])
