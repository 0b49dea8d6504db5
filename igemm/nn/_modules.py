"""``igemm.nn`` modules: a drop-in ``Conv2d`` and the fused ``Conv2dBN``, ``Conv2dBNReLU``, ``Conv2dBNAddReLU``.

In inference (eval mode, no gradient needed: ``torch.no_grad()``) a forward is one ``torch.ops.igemm.conv2d``
call: one igemm kernel on CUDA with the bias, the BatchNorm (folded, re-folded when a parameter or running
statistic changes), the residual and the ReLU in its epilogue. A forward that needs gradients runs PyTorch's ops
(igemm has no convolution backward yet) and says so once; so does anything the kernel does not run (groups != 1,
a padding mode other than zeros, asymmetric ``padding="same"``). On the CPU, and for dtypes other than
fp16/bf16/fp32, the op computes the same with PyTorch's ops.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from . import _ops

__all__ = ["Conv2d", "Conv2dBN", "Conv2dBNReLU", "Conv2dBNAddReLU"]

_warned: set = set()


def _say_once(what: str) -> None:
    if what not in _warned:
        _warned.add(what)
        warnings.warn(f"igemm.nn: {what}: running PyTorch's ops", stacklevel=3)


def _padding(conv: nn.Conv2d) -> tuple | None:
    """The conv's symmetric zero padding as a pair, or None where the igemm kernel cannot run it."""
    if conv.padding_mode != "zeros" or conv.groups != 1:
        return None
    p = conv.padding
    if p == "valid":
        return (0, 0)
    if p == "same":
        tot = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
        return None if any(t % 2 for t in tot) else (tot[0] // 2, tot[1] // 2)
    return tuple(p)


def _why_not(conv: nn.Conv2d, x: torch.Tensor, module: nn.Module, padding) -> str | None:
    """Why this forward cannot run igemm's kernel (None: it can); ``padding``: ``_padding(conv)``."""
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters())):
        return ("training (igemm has no convolution backward yet)" if module.training else
                "gradients needed (igemm has no convolution backward yet; run inference under torch.no_grad())")
    if padding is None:
        if conv.groups != 1:
            return f"groups={conv.groups} (igemm runs groups=1)"
        if conv.padding_mode != "zeros":
            return f"padding_mode={conv.padding_mode!r}"
        return f"padding={conv.padding!r} with an even kernel extent (asymmetric)"
    if x.dim() != 4:
        return f"a {x.dim()}-D input"
    return None           # (the op itself runs PyTorch's ops on the CPU and for dtypes the kernel lacks)


class Conv2d(nn.Conv2d):
    """``torch.nn.Conv2d`` (same arguments, parameters and state dict) running igemm's kernel in inference.

    ``Conv2d.from_torch(conv)`` makes one that shares ``conv``'s parameters.
    """

    @classmethod
    def from_torch(cls, conv: nn.Conv2d) -> "Conv2d":
        m = cls.__new__(cls)
        nn.Module.__init__(m)                      # (its own hooks and containers; conv's settings below)
        own = set(m.__dict__) - {"training"}
        m.__dict__.update({k: v for k, v in conv.__dict__.items() if k not in own})
        m._parameters, m._buffers, m._modules = dict(conv._parameters), dict(conv._buffers), dict(conv._modules)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = _padding(self)
        why = _why_not(self, x, self, pad)
        if why is not None:
            _say_once(f"Conv2d: {why}")
            return super().forward(x)
        p = self._parameters
        if _ops.eager(x):
            return _ops.fast(self, x, None, (p["weight"], p["bias"], None, None, None, None), 1e-5, self.stride, pad,
                             self.dilation, False)
        return _ops.conv2d(x, p["weight"], p["bias"], stride=self.stride, padding=pad, dilation=self.dilation)


class _ConvBN(nn.Module):
    """conv -> BN (-> + identity) (-> ReLU), holding the original ``conv`` and ``bn`` modules."""

    relu = False
    add = False

    def __init__(self, conv: nn.Conv2d, bn: nn.BatchNorm2d):
        super().__init__()
        if not isinstance(conv, nn.Conv2d) or not isinstance(bn, nn.BatchNorm2d):
            raise TypeError(f"conv, bn: expected torch.nn.Conv2d and BatchNorm2d, got {type(conv).__name__} and "
                            f"{type(bn).__name__}")
        if bn.num_features != conv.out_channels:
            raise ValueError(f"bn: {bn.num_features} features for the conv's {conv.out_channels} output channels")
        self.conv, self.bn = conv, bn

    def _torch(self, x, identity):
        y = self.bn(self.conv(x))
        if self.add:
            y = y + identity
        return torch.relu(y) if self.relu else y

    def _forward(self, x: torch.Tensor, identity) -> torch.Tensor:
        c, bn = self._modules["conv"], self._modules["bn"]       # (not nn.Module.__getattr__: per-call cost)
        cp, bp, bb = c._parameters, bn._parameters, bn._buffers
        pad = _padding(c)
        why = _why_not(c, x, self, pad)
        if why is None and (self.training or bb.get("running_mean") is None):
            why = "BatchNorm in training mode (batch statistics)"
        if why is not None:
            _say_once(f"{type(self).__name__}: {why}")
            return self._torch(x, identity)
        res = identity if self.add else None
        tensors = (cp["weight"], cp["bias"], bp["weight"], bp["bias"], bb["running_mean"], bb["running_var"])
        if _ops.eager(x):
            return _ops.fast(self, x, res, tensors, bn.eps, c.stride, pad, c.dilation, self.relu)
        return _ops.conv2d(x, *tensors, bn.eps, res, c.stride, pad, c.dilation, self.relu)


class Conv2dBN(_ConvBN):
    """``bn(conv(x))`` (inference: BN folded into the kernel's epilogue)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, None)


class Conv2dBNReLU(_ConvBN):
    """``relu(bn(conv(x)))`` in one kernel (inference)."""

    relu = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, None)


class Conv2dBNAddReLU(_ConvBN):
    """``relu(bn(conv(x)) + identity)`` in one kernel (inference): a ResNet block's last conv."""

    relu = add = True

    def forward(self, x: torch.Tensor, identity: torch.Tensor) -> torch.Tensor:
        return self._forward(x, identity)
