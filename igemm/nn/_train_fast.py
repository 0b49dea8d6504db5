"""The training op's eager path: a module's calls with one input geometry made once (``TrainCall``), then per
step only pointers and launches, as ``_ops.FastCall`` does for inference.

The op path (``torch.ops.igemm.conv2d_bn_train`` and its backward) validates every array of every function it
calls: about 1 ms of host time per layer and step, four times the GPU time of a ResNet-50 layer's training step
(docs/performance.md: train-eager-path). A ``TrainCall`` holds the conv plan, the dgrad and wgrad plans and the
BatchNorm kernels' configurations; its forward and backward launch them on the current stream. Same kernels,
same order, same results as the op. Used on plain CUDA tensors outside torch.compile (which sees the op).
"""
from __future__ import annotations

import weakref

import torch

from .. import _runtime
from .._norm_kernels import launch_elemt, launch_reduction
from ..conv import Conv2dGradInputPlan, Conv2dGradWeightPlan
from ..conv._backward_functional import _cached
from ..conv._moves import launch_coefficients
from ..relu import relu_backward
from . import _ops

__all__ = ["train"]

_CL = torch.channels_last
_calls: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # module -> {input geometry: TrainCall|None}


class _Ptr:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


class _Ctx:
    """What the BatchNorm launchers take from a call context: the device, the stream, fp32 scratch."""

    __slots__ = ("device_id", "stream", "_dev")

    def __init__(self, device, stream: int):
        self.device_id, self.stream, self._dev = device.index, stream, device

    def empty(self, shape, dtype):
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=self._dev)
        return t, _Ptr(t.data_ptr())


def _f32(v) -> bool:
    return v is None or (v.dtype is torch.float32 and v.is_cuda and v.is_contiguous())


class TrainCall:
    """conv -> BN (batch statistics) [-> + residual] [-> ReLU] for one input geometry: the plans found once."""

    __slots__ = ("plan", "dgrad", "wgrad", "nhwc", "layout", "dtype", "relu", "eps", "z_shape", "N", "K", "HW",
                 "stream_of")

    def __init__(self, x, w, residual, eps, stride, padding, dilation, relu):
        _ops._check(x, w, None, (None, None, None, None), residual, stride, padding, dilation)
        self.nhwc = _ops._nhwc(x)
        self.layout = "NHWC" if self.nhwc else "NCHW"
        key = _ops._plan_key(x, w, None, None, None, stride, padding, dilation, False)
        dev = x.device.index
        self.plan = _ops._plan(key, dev)
        xs, ws, dt = key[0], key[1], key[2]
        st, pd, dl = (tuple(v) for v in (stride, padding, dilation))
        self.dtype, self.relu, self.eps = x.dtype, bool(relu), eps
        self.dgrad, self.wgrad = (_cached(cls, (xs, ws, dt, self.layout, st, pd, dl, "strict", self.relu, True, *extra,
                                                dev),
                                          lambda cls=cls: cls(xs, ws, dt, self.layout, st, pd, dl, mask=self.relu,
                                                              prologue=True, device=dev))
                                  for cls, extra in ((Conv2dGradInputPlan, ()), (Conv2dGradWeightPlan, (dt, False))))
        self.z_shape = self.plan.y_shape
        N, K, P, Q = _ops._out_size(x, w, st, pd, dl)
        self.N, self.K, self.HW = N, K, P * Q
        self.stream_of = torch._C._cuda_getCurrentRawStream

    def _view(self, t):
        """The kernel's view of an NCHW-shaped tensor (NHWC memory: permuted)."""
        return t.permute(0, 2, 3, 1) if self.nhwc else t

    def _back(self, t):
        return t.permute(0, 3, 1, 2) if self.nhwc else t

    def usable(self, x, w, gamma, beta, residual, rm, rv) -> bool:
        """Whether this call's tensors are as the plans want them (else the op path)."""
        fmt = _CL if self.nhwc else torch.contiguous_format
        return (x.is_contiguous(memory_format=fmt) and w.dtype is self.dtype and x.data_ptr() % 16 == 0
                and (residual is None or (residual.is_contiguous(memory_format=fmt) and residual.dtype is self.dtype
                                          and residual.data_ptr() % 16 == 0))
                and all(_f32(v) for v in (gamma, beta, rm, rv)) and (rm is None) == (rv is None)
                and _runtime.current_context() == self.plan._ctx_id)

    def forward(self, x, w, gamma, beta, residual, rm, rv, momentum):
        dev = x.device
        h = self.stream_of(dev.index)
        wv = self._view(w)
        if not wv.is_contiguous():
            wv = wv.contiguous()
        z = torch.empty(self.z_shape, dtype=self.dtype, device=dev)
        self.plan._launch(h, True, wv.data_ptr() % 16 == 0, x.data_ptr(), wv.data_ptr(), z.data_ptr(), 0, 0,
                          _ops._Vectors(None, None), False)
        stats = torch.empty((2, self.K), dtype=torch.float32, device=dev)
        mean, invstd = stats[0], stats[1]
        ctx = _Ctx(dev, h)
        dt = str(self.dtype)[6:]
        launch_reduction(ctx, grad=False, dtype=dt, layout=self.layout, N=self.N, C=self.K, HW=self.HW,
                         ptrs=dict(x=z.data_ptr(), out0=mean.data_ptr(), out1=invstd.data_ptr(),
                                   run_mean=rm.data_ptr() if rm is not None else 0,
                                   run_var=rv.data_ptr() if rv is not None else 0),
                         mode=1, eps=self.eps, momentum=momentum)
        y = torch.empty_like(z)
        n = z.numel()
        mask = torch.empty(((n + 31) // 32) if self.relu else 0, dtype=torch.int32, device=dev)
        rp = self._view(residual).data_ptr() if residual is not None else 0
        launch_elemt(ctx, backward=False, dtype=dt, layout=self.layout, N=self.N, C=self.K, HW=self.HW,
                     act_or_mask=2 if self.relu else 0, res=residual is not None, align_ptrs=(z.data_ptr(),
                                                                                              y.data_ptr(), rp),
                     ptrs={"x": z.data_ptr(), "res": rp, "y": y.data_ptr(), "mask": mask.data_ptr(),
                           "mean": mean.data_ptr(), "invstd": invstd.data_ptr(),
                           "weight": gamma.data_ptr() if gamma is not None else 0,
                           "bias": beta.data_ptr() if beta is not None else 0})
        return self._back(y), self._back(z), mask, mean, invstd

    def backward(self, dy, x, w, z, mask, mean, invstd, gamma, need):
        dev = dy.device
        h = self.stream_of(dev.index)
        fmt = _CL if self.nhwc else torch.contiguous_format
        dyv = self._view(dy.contiguous(memory_format=fmt))
        zv = self._view(z)
        sums = torch.empty((7, self.K), dtype=torch.float32, device=dev)     # 4 sums, then the coefficients
        ptr = [s.data_ptr() for s in sums[:4]]
        coef = sums[4:]
        mp = mask.data_ptr() if self.relu else 0
        dt = str(self.dtype)[6:]
        launch_reduction(_Ctx(dev, h), grad=True, dtype=dt, layout=self.layout, N=self.N, C=self.K, HW=self.HW,
                         ptrs=dict(dy=dyv.data_ptr(), x=zv.data_ptr(), mask=mp, mean=mean.data_ptr(),
                                   invstd=invstd.data_ptr(), out0=ptr[0], out1=ptr[1], out2=ptr[2], out3=ptr[3]))
        launch_coefficients(dev.index, h, self.K, max(self.N * self.HW, 1),
                            gamma=gamma.data_ptr() if gamma is not None else 0, invstd=invstd.data_ptr(),
                            mean=mean.data_ptr(), sum_dy=ptr[0], sum_dy_xmu=ptr[1], coef=coef.data_ptr())
        fp = {"mask": mp, "z": zv.data_ptr(), "coef": coef.data_ptr()}
        dx = dw = dres = None
        if need[0]:
            wv = self._view(w)
            if not wv.is_contiguous():
                wv = wv.contiguous()
            g = self.dgrad
            dxv = torch.empty(g.x_shape, dtype=self.dtype, device=dev)
            with g._lock:
                g._run(h, dyv.data_ptr(), wv.data_ptr(), dxv.data_ptr(), fp)
            dx = self._back(dxv)
        if need[1]:
            g = self.wgrad
            dwv = torch.empty(g.w_shape, dtype=self.dtype, device=dev)
            with g._lock:
                g._run(h, self._view(x).data_ptr(), dyv.data_ptr(), dwv.data_ptr(), fp)
            dw = self._back(dwv)
        if need[4]:
            dres = self._back(relu_backward(dyv, mask)) if self.relu else self._back(dyv)
        return dx, dw, sums[2], sums[3], dres


class _FastTrain(torch.autograd.Function):
    """nn.conv2d_bn_train's y through a TrainCall (the same formula as the op's autograd.Function)."""

    @staticmethod
    def forward(ctx, tc, x, w, gamma, beta, residual, rm, rv, momentum):
        y, z, mask, mean, invstd = tc.forward(x, w, gamma, beta, residual, rm, rv, momentum)
        ctx.tc = tc
        ctx.set_materialize_grads(False)          # (no zero tensors for the outputs that have no gradient)
        ctx.save_for_backward(x, w, z, mask, mean, invstd, gamma)
        ctx.mark_non_differentiable(z, mask, mean, invstd)
        return y, z, mask, mean, invstd

    @staticmethod
    def backward(ctx, dy, _dz, _dmask, _dmean, _dinvstd):
        if dy is None:                            # (y took no part in what was differentiated)
            return (None,) * 9
        x, w, z, mask, mean, invstd, gamma = ctx.saved_tensors
        n = ctx.needs_input_grad
        dx, dw, dg, db, dres = ctx.tc.backward(dy, x, w, z, mask, mean, invstd, gamma, n[1:])
        return (None, dx, dw, dg if n[3] else None, db if n[4] else None, dres if n[5] else None, None, None, None)


def train(owner, x, w, gamma, beta, residual, rm, rv, momentum: float, eps: float, stride, padding, dilation,
          relu: bool):
    """A module's training forward on the eager path, or None where the op path must run it."""
    per = _calls.get(owner)
    if per is None:
        per = _calls[owner] = {}
    key = (x.shape, x.stride(), x.dtype, x.get_device(), w.shape,
           None if residual is None else (residual.shape, residual.stride()))
    tc = per.get(key, False)
    if tc is False:
        ok = _ops.supported(x, w) and (_ops._nhwc(x) or x.is_contiguous())
        tc = per[key] = TrainCall(x, w, residual, eps, stride, padding, dilation, relu) if ok else None
    if tc is None or not tc.usable(x, w, gamma, beta, residual, rm, rv):
        return None
    return _FastTrain.apply(tc, x, w, gamma, beta, residual, rm, rv, float(momentum))
