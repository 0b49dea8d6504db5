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
from .. import relu as _relu
from .._kernel import bind_args
from .._norm_kernels import elemt_kernel, reduction_kernels
from ..conv import Conv2dGradInputPlan, Conv2dGradWeightPlan
from ..conv._backward_functional import _cached
from ..conv._moves import dz_fits, launch_coefficients, launch_dz
from . import _ops

__all__ = ["train"]

_CL = torch.channels_last
_PLAIN = {"mask": 0, "z": 0, "coef": 0}
#: the pointer parameters each BatchNorm kernel gets per call, in the order TrainCall passes them
_STATS_PTRS = ("x", "out0", "out1", "part", "run_mean", "run_var")
_FWD_PTRS = ("x", "res", "y", "mask", "mean", "invstd", "weight", "bias")
_GRAD_PTRS = ("dy", "x", "mask", "mean", "invstd", "out0", "out1", "out2", "out3", "part")
_calls: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # module -> {input geometry: TrainCall|None}


def _f32(v) -> bool:
    return v is None or (v.dtype is torch.float32 and v.is_cuda and v.is_contiguous())


class TrainCall:
    """conv -> BN (batch statistics) [-> + residual] [-> ReLU] for one input geometry: the plans and the BatchNorm
    kernels found once (the kernels for 16-byte aligned tensors: fresh outputs, and inputs ``usable`` checks).
    Tensors stay in the module's shapes: the kernels need only their pointers, outputs are allocated in the memory
    format the plans write (channels_last for the NHWC plans), so no call makes a view."""

    __slots__ = ("plan", "dgrad", "wgrad", "nhwc", "fmt", "dtype", "dt", "relu", "res", "eps", "N", "K", "HW",
                 "y_shape", "stream_of", "stats", "bn_fwd", "grad_red", "relu_bwd", "slots")

    def __init__(self, x, w, residual, eps, stride, padding, dilation, relu):
        _ops._check(x, w, None, (None, None, None, None), residual, stride, padding, dilation)
        self.nhwc = _ops._nhwc(x)
        self.fmt = _CL if self.nhwc else torch.contiguous_format
        layout = "NHWC" if self.nhwc else "NCHW"
        key = _ops._plan_key(x, w, None, None, None, stride, padding, dilation, False)
        dev = x.device.index
        self.plan = _ops._plan(key, dev)
        xs, ws, dt = key[0], key[1], key[2]
        st, pd, dl = (tuple(v) for v in (stride, padding, dilation))
        self.dtype, self.dt, self.relu, self.res, self.eps = x.dtype, dt, bool(relu), residual is not None, eps
        self.dgrad, self.wgrad = (_cached(cls, (xs, ws, dt, layout, st, pd, dl, "strict", self.relu, True, *extra, dev),
                                          lambda cls=cls: cls(xs, ws, dt, layout, st, pd, dl, mask=self.relu,
                                                              prologue=True, device=dev))
                                  for cls, extra in ((Conv2dGradInputPlan, ()), (Conv2dGradWeightPlan, (dt, False))))
        N, K, P, Q = _ops._out_size(x, w, st, pd, dl)
        self.N, self.K, self.HW, self.y_shape = N, K, P * Q, (N, K, P, Q)
        self.stream_of = torch._C._cuda_getCurrentRawStream
        geo = dict(dtype=dt, layout=layout, N=N, C=K, HW=P * Q, align=16)
        self.stats = reduction_kernels(dev, grad=False, mode=1, **geo)
        self.bn_fwd = elemt_kernel(dev, backward=False, act_or_mask=2 if self.relu else 0, res=self.res, **geo)
        self.grad_red = reduction_kernels(dev, grad=True, **geo)
        n = N * K * P * Q
        vec = 16 // x.element_size()
        self.relu_bwd = (_relu._launcher("relu_backward", dt, vec, dev, _relu._grid(dev, max(n // vec // 8, 1))), n)
        k1, _, _ = self.stats
        g1, _, _ = self.grad_red
        self.slots = {"stats": k1.slots(_STATS_PTRS), "fwd": self.bn_fwd.slots(_FWD_PTRS),
                      "grad": g1.slots(_GRAD_PTRS), "eps": k1.slot["eps"],
                      "momentum": k1.slot["momentum"]}

    def usable(self, x, w, gamma, beta, residual, rm, rv) -> bool:
        """Whether this call's tensors are as the plans want them (else the op path)."""
        fmt = self.fmt
        return (x.is_contiguous(memory_format=fmt) and w.dtype is self.dtype and x.data_ptr() % 16 == 0
                and (residual is None or (residual.is_contiguous(memory_format=fmt) and residual.dtype is self.dtype
                                          and residual.data_ptr() % 16 == 0))
                and all(_f32(v) for v in (gamma, beta, rm, rv)) and (rm is None) == (rv is None)
                and _runtime.current_context() == self.plan._ctx_id)

    def forward(self, x, w, gamma, beta, residual, rm, rv, momentum):
        dev = x.device
        h = self.stream_of(dev.index)
        if not w.is_contiguous(memory_format=self.fmt):
            w = w.contiguous(memory_format=self.fmt)
        K = self.K
        # (y is an output of its own, not a view: autograd forbids in-place changes of a custom Function's views)
        z = torch.empty(self.y_shape, dtype=self.dtype, device=dev, memory_format=self.fmt)
        y = torch.empty(self.y_shape, dtype=self.dtype, device=dev, memory_format=self.fmt)
        zp, yp = z.data_ptr(), y.data_ptr()
        self.plan._launch(h, True, w.data_ptr() % 16 == 0, x.data_ptr(), w.data_ptr(), zp, 0, 0,
                          _ops._Vectors(None, None), False)
        k1, k2, nws = self.stats
        words = (z.numel() + 31) // 32 if self.relu else 0
        # mean, invstd, kernel 2's partials; the mask's words (int32) after them
        buf = torch.empty((2 * K + nws + words,), dtype=torch.float32, device=dev)
        b = buf.data_ptr()
        ptrs = [zp, b, b + 4 * K, b + 8 * K, rm.data_ptr() if rm is not None else 0,
                rv.data_ptr() if rv is not None else 0]
        mom = ((self.slots["eps"], self.eps), (self.slots["momentum"], momentum))
        k1.run(h, self.slots["stats"], ptrs, mom)
        if k2 is not None:
            k2.run(h, self.slots["stats"], ptrs, mom)
        self.bn_fwd.run(h, self.slots["fwd"], [zp, residual.data_ptr() if residual is not None else 0, yp,
                                               b + 4 * (2 * K + nws), b, b + 4 * K,
                                               gamma.data_ptr() if gamma is not None else 0,
                                               beta.data_ptr() if beta is not None else 0])
        return y, z, buf[2 * K + nws:].view(torch.int32), buf[:K], buf[K:2 * K]

    def backward(self, dy, x, w, z, mask, mean, invstd, gamma, need):
        dev = dy.device
        h = self.stream_of(dev.index)
        fmt = self.fmt
        dy = dy.contiguous(memory_format=fmt)
        if dy.data_ptr() % 16:                    # (the kernels were found for aligned tensors)
            dy = dy.clone(memory_format=fmt)
        K = self.K
        k1, k2, nws = self.grad_red
        sums = torch.empty((7 * K + nws,), dtype=torch.float32, device=dev)   # 4 sums, the coefficients, partials
        b = sums.data_ptr()
        dp, zp, mp = dy.data_ptr(), z.data_ptr(), mask.data_ptr() if self.relu else 0
        ptrs = [dp, zp, mp, mean.data_ptr(), invstd.data_ptr(), b, b + 4 * K, b + 8 * K, b + 12 * K, b + 28 * K]
        k1.run(h, self.slots["grad"], ptrs)
        if k2 is not None:
            k2.run(h, self.slots["grad"], ptrs)
        launch_coefficients(dev.index, h, K, max(self.N * self.HW, 1), gamma=gamma.data_ptr() if gamma is not None
                            else 0, invstd=invstd.data_ptr(), mean=mean.data_ptr(), sum_dy=b, sum_dy_xmu=b + 4 * K,
                            coef=b + 16 * K)
        fp = {"mask": mp, "z": zp, "coef": b + 16 * K}
        src = dp
        dx = dw = dres = None
        # the residual's gradient behind the ReLU (bit ? dy : 0) comes out of the dz pass where that pass runs
        sel = self.relu and need[4]
        if self.nhwc and (need[0] or need[1]) and dz_fits(self.dt, K, dp, zp):
            # dz = a·(bit ? dy : 0) + b·z + c made once here for both plans (docs/performance.md: train-dz-once)
            dz = torch.empty_like(dy)
            dres = torch.empty_like(dy) if sel else None
            launch_dz(dev.index, h, self.dt, dy.numel() // K, K, dp, dz.data_ptr(), mode="bn",
                      sel=dres.data_ptr() if sel else 0, sms=self.dgrad.sms, **fp)
            src, fp = dz.data_ptr(), _PLAIN
        elif need[0] and need[1] and self.wgrad.native is not None:
            dz = torch.empty_like(dy)
            self.dgrad._pre.launch(dev.index, h, self.dt, self.dt, src, dz.data_ptr(), mode="bn", sms=self.dgrad.sms,
                                   **fp)
            src, fp = dz.data_ptr(), _PLAIN
        if need[0]:
            if not w.is_contiguous(memory_format=fmt):
                w = w.contiguous(memory_format=fmt)
            g = self.dgrad
            dx = torch.empty(x.shape, dtype=self.dtype, device=dev, memory_format=fmt)
            with g._lock:
                g._run(h, src, w.data_ptr(), dx.data_ptr(), fp)
        if need[1]:
            g = self.wgrad
            dw = torch.empty(w.shape, dtype=self.dtype, device=dev, memory_format=fmt)
            with g._lock:
                g._run(h, x.data_ptr(), src, dw.data_ptr(), fp)
        if need[4] and dres is None:
            if self.relu:
                launcher, n = self.relu_bwd
                dres = torch.empty_like(dy)
                launcher(h, bind_args(_relu._BWD_PARAMS, {"dy": dp, "mask": mp, "dx": dres.data_ptr(), "n": n}))
            else:
                dres = dy
        return dx, dw, sums[2 * K:3 * K], sums[3 * K:4 * K], dres


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
        ok = _ops.supported(x, w) and (_ops._nhwc(x) or x.is_contiguous()) and x.numel() > 0
        tc = per[key] = TrainCall(x, w, residual, eps, stride, padding, dilation, relu) if ok else None
    if tc is None or not tc.usable(x, w, gamma, beta, residual, rm, rv):
        return None
    return _FastTrain.apply(tc, x, w, gamma, beta, residual, rm, rv, float(momentum))
