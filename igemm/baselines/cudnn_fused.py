"""The cuDNN peer of a converted network: the same graph rewrite as ``igemm.nn.convert``, each pattern on
``torch.cudnn_convolution_relu`` / ``torch.cudnn_convolution_add_relu`` (plain convs on ``F.conv2d``) with the
BatchNorm folded into w and b -- PyTorch's fastest inference form of the same network; its other layers (max
pools included) stay PyTorch's. Needs torch."""
from __future__ import annotations

import copy

__all__ = ["cudnn_fused"]


def _module(kind: str, conv, bn):
    import torch
    import torch.nn.functional as F
    from torch import nn

    from igemm.nn._modules import _padding

    class Fused(nn.Module):
        def __init__(self):
            super().__init__()
            w = conv.weight.detach().float()
            b = conv.bias.detach().float() if conv.bias is not None else torch.zeros(w.shape[0], device=w.device)
            if bn is not None:
                s = bn.weight.float() * torch.rsqrt(bn.running_var.float() + bn.eps)
                w = w * s.view(-1, 1, 1, 1)
                b = (b - bn.running_mean.float()) * s + bn.bias.float()
            dt = conv.weight.dtype
            self.register_buffer("w", w.to(dt).contiguous(memory_format=torch.channels_last))
            self.register_buffer("b", b.to(dt))
            self.args = (list(conv.stride), list(_padding(conv)), list(conv.dilation), 1)

        def forward(self, x, identity=None):
            if kind == "Conv2dBNAddReLU":
                return torch.cudnn_convolution_add_relu(x, self.w, identity, 1.0, self.b, *self.args)
            if kind == "Conv2dBNReLU":
                return torch.cudnn_convolution_relu(x, self.w, self.b, *self.args)
            return F.conv2d(x, self.w, self.b, *self.args)
    return Fused()


def cudnn_fused(model):
    """A copy of ``model`` (in eval mode, traceable by torch.fx) with its conv patterns on cuDNN's fused calls."""
    import torch

    from igemm.nn._convert import Report, _rewrite
    gm = torch.fx.symbolic_trace(copy.deepcopy(model))
    _rewrite(gm, Report(converted={}, left={}, traced=True), _module, pools=False)
    return gm.eval()
