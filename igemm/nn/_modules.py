"""``igemm.nn`` modules: a drop-in ``Conv2d`` and the fused ``Conv2dBN``, ``Conv2dBNReLU``, ``Conv2dBNAddReLU``.

Inference (eval mode): a forward is one ``torch.ops.igemm.conv2d`` call, one igemm kernel on CUDA with the bias,
the BatchNorm (folded, re-folded when a parameter or running statistic changes), the residual and the ReLU in
its epilogue; it is differentiable (``torch.ops.igemm.conv2d_backward``: igemm's dgrad and wgrad).
Training (BatchNorm with batch statistics): one ``torch.ops.igemm.conv2d_bn_train`` call (conv, statistics,
BN-Add-ReLU writing the 1-bit mask) whose backward is igemm's BN-backward reduction, one pass writing the gradient
that reaches the conv, then dgrad and wgrad; the running statistics are updated as ``BatchNorm2d`` does. Eager
calls on plain CUDA tensors run the same kernels without the op's dispatch and checks (``_train_fast``).
Under ``torch.autocast`` the convolution runs in the autocast dtype (BatchNorm's parameters stay fp32). Over a
``torch.nn.SyncBatchNorm`` (``convert(model, sync_bn=group)``) training syncs the statistics and the backward's
sums across the process group's ranks.
What the kernels do not run (groups != 1, a padding mode other than zeros, asymmetric ``padding="same"``, a
conv bias before a training-mode BatchNorm) runs PyTorch's ops and says so once. On the CPU, and for dtypes
other than fp16/bf16/fp32, the ops compute the same with PyTorch's ops.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from . import _ops, _train_fast, _train_ops

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


def _why_not(conv: nn.Conv2d, x: torch.Tensor, padding) -> str | None:
    """Why this forward cannot run igemm's kernel (None: it can); ``padding``: ``_padding(conv)``."""
    if padding is None:
        if conv.groups != 1:
            return f"groups={conv.groups} (igemm runs groups=1)"
        if conv.padding_mode != "zeros":
            return f"padding_mode={conv.padding_mode!r}"
        return f"padding={conv.padding!r} with an even kernel extent (asymmetric)"
    if x.dim() != 4:
        return f"a {x.dim()}-D input"
    return None           # (the op itself runs PyTorch's ops on the CPU and for dtypes the kernel lacks)


def _direct(x: torch.Tensor, module: nn.Module) -> bool:
    """Whether the forward may skip the op (the eager path): no autograd graph to record, no autocast."""
    return (_ops.eager(x) and not torch.is_autocast_enabled("cuda")
            and not (torch.is_grad_enabled()
                     and (x.requires_grad or any(p.requires_grad for p in module.parameters()))))


def _autocast(*ts):
    """The tensors in the autocast dtype where ``torch.autocast`` is on for CUDA (the conv's operands), else as
    they are."""
    if not torch.is_autocast_enabled("cuda"):
        return ts
    dt = torch.get_autocast_dtype("cuda")
    return tuple(_cast(t, dt) for t in ts)


def _cast(t, dt):
    """``t`` in autocast's ``dt`` where autocast casts it (a floating-point CUDA tensor), else ``t``."""
    return t.to(dt) if t is not None and t.dtype is not dt and t.is_floating_point() and t.is_cuda else t


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

    def _tensors(self) -> tuple:
        """(weight, bias, bn_weight, bn_bias, bn_mean, bn_var) as the eager call hands them to its FastCall."""
        p = self._parameters
        return p["weight"], p["bias"], None, None, None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = _padding(self)
        why = _why_not(self, x, pad)
        if why is not None:
            _say_once(f"Conv2d: {why}")
            return super().forward(x)
        p = self._parameters
        if _direct(x, self):
            return _ops.fast(self, x, None, self._tensors(), 1e-5, self.stride, pad, self.dilation, False)
        x, w, b = _autocast(x, p["weight"], p["bias"])
        return _ops.conv2d(x, w, b, stride=self.stride, padding=pad, dilation=self.dilation)


def _sync_group(bn):
    """A SyncBatchNorm's process group when its statistics are synced (as ``SyncBatchNorm.forward`` decides:
    torch.distributed initialised, more than one rank), else False."""
    if not isinstance(bn, nn.SyncBatchNorm) or not torch.distributed.is_available():
        return False
    dist = torch.distributed
    if not dist.is_initialized() or dist.get_world_size(bn.process_group or dist.group.WORLD) <= 1:
        return False
    return bn.process_group


class _ConvBN(nn.Module):
    """conv -> BN (-> + identity) (-> ReLU), holding the original ``conv`` and ``bn`` modules."""

    relu = False
    add = False

    def __init__(self, conv: nn.Conv2d, bn: nn.BatchNorm2d):
        super().__init__()
        if not isinstance(conv, nn.Conv2d) or not isinstance(bn, (nn.BatchNorm2d, nn.SyncBatchNorm)):
            raise TypeError(f"conv, bn: expected torch.nn.Conv2d and BatchNorm2d (or SyncBatchNorm), got "
                            f"{type(conv).__name__} and {type(bn).__name__}")
        if bn.num_features != conv.out_channels:
            raise ValueError(f"bn: {bn.num_features} features for the conv's {conv.out_channels} output channels")
        self.conv, self.bn = conv, bn

    def _tensors(self) -> tuple:
        """(weight, bias, bn_weight, bn_bias, bn_mean, bn_var) as the eager call hands them to its FastCall."""
        c, bn = self._modules["conv"], self._modules["bn"]
        cp, bp, bb = c._parameters, bn._parameters, bn._buffers
        return cp["weight"], cp["bias"], bp["weight"], bp["bias"], bb.get("running_mean"), bb.get("running_var")

    def _torch(self, x, identity):
        y = self.bn(self.conv(x))
        if self.add:
            y = y + identity
        return torch.relu(y) if self.relu else y

    def _forward(self, x: torch.Tensor, identity) -> torch.Tensor:
        c, bn = self._modules["conv"], self._modules["bn"]       # (not nn.Module.__getattr__: per-call cost)
        cp, bb = c._parameters, bn._buffers
        pad = _padding(c)
        why = _why_not(c, x, pad)
        batch_stats = self.training or bb.get("running_mean") is None
        if why is None and batch_stats and cp["bias"] is not None:
            why = "a conv bias before a training-mode BatchNorm"
        if why is not None:
            _say_once(f"{type(self).__name__}: {why}")
            return self._torch(x, identity)
        res = identity if self.add else None
        if batch_stats:
            return self._train(x, res, pad)
        tensors = self._tensors()
        if _direct(x, self) and (res is None or not res.requires_grad):
            return _ops.fast(self, x, res, tensors, bn.eps, c.stride, pad, c.dilation, self.relu)
        x, w, b, res = _autocast(x, cp["weight"], cp["bias"], res)
        return _ops.conv2d(x, w, b, *tensors[2:], bn.eps, res, c.stride, pad, c.dilation, self.relu)

    def _train(self, x, res, pad):
        """BatchNorm with batch statistics: the training op, then BatchNorm2d's running-statistics update."""
        c, bn = self._modules["conv"], self._modules["bn"]       # (dicts, not nn.Module.__getattr__: per-call cost)
        bp, bb = bn._parameters, bn._buffers
        amp = torch.is_autocast_enabled("cuda")
        if amp:
            dt = torch.get_autocast_dtype("cuda")
            if x.dtype is not dt:
                x = _cast(x, dt)
            if res is not None and res.dtype is not dt:
                res = _cast(res, dt)
        # (under autocast the eager path casts w itself and returns its gradient in fp32)
        w = c._parameters.get("weight")
        if w is None:
            w = c.weight                                # (a parametrization's)
        N, K, P, Q = _ops._out_size(x, w, c.stride, pad, c.dilation) if x.dim() == 4 else (0,) * 4
        if self.training and N * P * Q <= 1:           # (BatchNorm2d's own check)
            raise ValueError(f"Expected more than 1 value per channel when training, got input size "
                             f"{(N, K, P, Q)}")
        rm = rv = nbt = None
        f = 0.0
        if self.training and bn.track_running_stats:     # (as BatchNorm2d.forward, momentum None included)
            n = bb["num_batches_tracked"] if "num_batches_tracked" in bb else bn.num_batches_tracked
            if n is not None:
                if bn.momentum is None:
                    n.add_(1)
                else:                                   # (the eager path's kernel adds it, else add_ below)
                    nbt = n
            f = bn.momentum if bn.momentum is not None else 1.0 / float(n)
            rm = bb["running_mean"] if "running_mean" in bb else bn.running_mean
            rv = bb["running_var"] if "running_var" in bb else bn.running_var
        group = _sync_group(bn) if self.training else False
        gamma, beta = bp.get("weight"), bp.get("bias")
        if gamma is None:
            gamma = bn.weight                           # (a parametrization's, or None: affine=False)
        if beta is None:
            beta = bn.bias
        if _ops.eager(x) and (w.dtype is x.dtype or amp):
            y = _train_fast.train(self, x, w, gamma, beta, res, rm, rv, f, bn.eps, c.stride, pad, c.dilation,
                                  self.relu, nbt, group)
            if y is not None:
                return y
        (w,) = _autocast(w)
        if nbt is not None:
            nbt.add_(1)
        return _train_ops.conv2d_bn_train(x, w, gamma, beta, bn.eps, res, c.stride, pad, c.dilation, self.relu,
                                          running_mean=rm, running_var=rv, momentum=f, process_group=group)[0]


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
