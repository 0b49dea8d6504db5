"""The backward's function forms: ``conv2d_grad_input``, ``conv2d_grad_weight`` (a plan from an LRU cache per
problem), ``conv2d_backward`` (both, the gradient reaching the conv formed once), ``conv2d_grad_prologue`` (the
BN-backward reduction and the prologue's coefficients) and ``conv2d_bn_backward`` (a conv -> BN [-> ReLU] block's
backward: the reduction, dz and both gradients)."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .. import _runtime, reference
from .._checks import check_flag, check_layout, check_shape_arg, check_stream, require_array
from .._dispatch import CallContext
from .._runtime import as_tensor, keeps_current_context
from ._backward_plan import Conv2dGradInputPlan, Conv2dGradWeightPlan, GradPrologue
from ._functional import _channels_last, _nhwc_view, _permute
from ._moves import dz_fits, launch_dz
from ._problem import DTYPES, PRECISIONS, geometry, pair

__all__ = ["conv2d_grad_input", "conv2d_grad_weight", "conv2d_backward", "conv2d_grad_prologue", "conv2d_bn_backward"]

_PLANS: OrderedDict = OrderedDict()
_CACHE_SIZE = 256


def _nhwc_prologue(prologue):
    """A prologue for the NHWC call of a channels_last one: its z as an NHWC view (a copy if z is not
    channels_last)."""
    if not isinstance(prologue, GradPrologue):
        return prologue                          # (None, or wrong: the NHWC call raises)
    return GradPrologue(_nhwc_view(prologue.z, "prologue.z"), prologue.coef, prologue.grad_weight,
                        prologue.grad_bias)


def _device_of(t) -> int | None:
    return None if (t.kind == "numpy" and _runtime.get_backend() == "numpy") else max(t.device_id, 0)


def _cached(cls, key: tuple, make):
    plan = _PLANS.get((cls, key))
    if plan is None:
        plan = _PLANS[(cls, key)] = make()
        while len(_PLANS) > _CACHE_SIZE:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end((cls, key))
    return plan


def _problem(shape_arg, shape_name, other, other_name, dy, layout, stride, padding, dilation, grad_input: bool):
    """Validate the forward problem the call's arrays describe; returns (dtype, the plan's shapes, args)."""
    check_layout(layout)
    s = check_shape_arg(tuple(shape_arg) if hasattr(shape_arg, "__len__") else shape_arg, shape_name, 4)
    ot, dt = as_tensor(other, other_name), as_tensor(dy, "dy")
    if dt.dtype not in DTYPES:
        raise TypeError(f"dy: dtype {dt.dtype} is not supported (expected float16, bfloat16 or float32)")
    if ot.dtype != dt.dtype:
        raise TypeError(f"{other_name}: dtype {ot.dtype} differs from dy's {dt.dtype}")
    st, pd, dl = pair(stride, "stride"), pair(padding, "padding"), pair(dilation, "dilation")
    x_shape, w_shape = (s, tuple(ot.shape)) if grad_input else (tuple(ot.shape), s)
    names = (shape_name, other_name) if grad_input else (other_name, shape_name)
    N, C, H, W, K, R, S, P, Q, *_ = geometry(x_shape, w_shape, layout, st, pd, dl, names=names)
    want = (N, K, P, Q) if layout == "NCHW" else (N, P, Q, K)
    if tuple(dt.shape) != want:
        raise ValueError(f"dy: shape {tuple(dt.shape)} is not the output of the forward problem (x {x_shape}, "
                         f"w {w_shape}, stride {st}, padding {pd}, dilation {dl}, {layout}): expected {want}")
    return dt, x_shape, w_shape, (st, pd, dl)


@keeps_current_context
def conv2d_grad_input(dy, w, x_shape, stride=1, padding=0, dilation=1, *, layout: str = "NCHW", mask=None,
                      prologue=None, precision: str = "strict", out=None, stream=None):
    """The gradient of ``conv2d`` with respect to its input (``torch.nn.grad.conv2d_input``), by implicit GEMM.

    Args:
        dy: the gradient of the forward output, ``(N, K, P, Q)`` (NCHW) or ``(N, P, Q, K)`` (NHWC).
        w: the forward filter (``(K, C, R, S)`` / ``(K, R, S, C)``), dy's dtype (fp16, bf16, fp32).
        x_shape: the forward input's shape; stride, padding, dilation: the forward's (ints or pairs).
        layout: ``"NCHW"`` or ``"NHWC"``; an NCHW-shaped dy whose memory is NHWC (torch ``channels_last``) runs the
            NHWC kernels on views and returns dx channels_last (w, prologue.z and out read as channels_last).
        mask: the forward's ReLU bit mask of y (``ReLU(mask=True)``, over dy's memory order): dy is read as
            ``bit ? dy : 0``.
        prologue: a :class:`GradPrologue` from :func:`conv2d_grad_prologue` (conv -> BN -> [+res] -> ReLU in
            training): dy is read as ``a[k]·g + b[k]·z + c[k]``.
        precision: fp32 ``"strict"`` (default) or ``"tf32"``. out: preallocated dx. stream: CUDA stream.

    >>> import numpy as np, igemm
    >>> dy = np.ones((1, 3, 5, 5), np.float32)
    >>> igemm.conv2d_grad_input(dy, np.ones((3, 2, 3, 3), np.float32), (1, 2, 5, 5), padding=1)[0, 0, 0]
    array([12., 18., 18., 18., 12.], dtype=float32)
    """
    require_array(dy, "dy")
    require_array(w, "w")
    check_stream(stream)
    if layout == "NCHW" and _channels_last(dy) and getattr(w, "ndim", 0) == 4:
        # channels_last dy (NHWC memory): the NHWC plan on views, dx channels_last too (w, z, out: NHWC views)
        xs = check_shape_arg(tuple(x_shape) if hasattr(x_shape, "__len__") else x_shape, "x_shape", 4)
        dx = conv2d_grad_input(_permute(dy, (0, 2, 3, 1)), _nhwc_view(w, "w"), (xs[0], xs[2], xs[3], xs[1]), stride,
                               padding, dilation, layout="NHWC", mask=mask, prologue=_nhwc_prologue(prologue),
                               precision=precision, out=_nhwc_view(out, "out", copy=False) if out is not None else None,
                               stream=stream)
        return out if out is not None else _permute(dx, (0, 3, 1, 2))
    dt, x_shape, w_shape, (st, pd, dl) = _problem(x_shape, "x_shape", w, "w", dy, layout, stride, padding,
                                                  dilation, True)
    plan = _dgrad_plan(dt, x_shape, w_shape, layout, (st, pd, dl), precision, mask is not None, prologue is not None)
    return plan(dy, w, mask=mask, prologue=prologue, out=out, stream=stream)


def _dgrad_plan(dt, x_shape, w_shape, layout, geo, precision, mask: bool, prologue: bool) -> Conv2dGradInputPlan:
    dev = _device_of(dt)
    key = (x_shape, w_shape, dt.dtype, layout, *geo, precision, mask, prologue, dev)
    return _cached(Conv2dGradInputPlan, key, lambda: Conv2dGradInputPlan(
        x_shape, w_shape, dt.dtype, layout, *geo, precision=precision, mask=mask, prologue=prologue,
        device=dev if dev is not None else "numpy"))


@keeps_current_context
def conv2d_grad_weight(x, dy, w_shape, stride=1, padding=0, dilation=1, *, layout: str = "NCHW", mask=None,
                       prologue=None, precision: str = "strict", out=None, accumulate: bool = False, stream=None):
    """The gradient of ``conv2d`` with respect to its filter (``torch.nn.grad.conv2d_weight``), by implicit GEMM.

    Args:
        x: the forward input; dy: the forward output's gradient (x's dtype); w_shape: the filter's shape.
        mask, prologue, precision, stream: as :func:`conv2d_grad_input`.
        out: preallocated dw, in x's dtype or float32 (the fp32 gradient of a 16-bit problem).
        accumulate: add the gradient into ``out`` (gradient accumulation) instead of overwriting it.

    >>> import numpy as np, igemm
    >>> x, dy = np.ones((1, 2, 4, 4), np.float32), np.ones((1, 3, 4, 4), np.float32)
    >>> igemm.conv2d_grad_weight(x, dy, (3, 2, 3, 3), padding=1)[0, 0]
    array([[ 9., 12.,  9.],
           [12., 16., 12.],
           [ 9., 12.,  9.]], dtype=float32)
    """
    require_array(x, "x")
    require_array(dy, "dy")
    check_stream(stream)
    if layout == "NCHW" and _channels_last(x) and getattr(dy, "ndim", 0) == 4:
        # channels_last x (NHWC memory): the NHWC plan on views, dw channels_last too (dy, z, out: NHWC views)
        ws = check_shape_arg(tuple(w_shape) if hasattr(w_shape, "__len__") else w_shape, "w_shape", 4)
        dw = conv2d_grad_weight(_permute(x, (0, 2, 3, 1)), _nhwc_view(dy, "dy"), (ws[0], ws[2], ws[3], ws[1]),
                                stride, padding, dilation, layout="NHWC", mask=mask,
                                prologue=_nhwc_prologue(prologue), precision=precision,
                                out=_nhwc_view(out, "out", copy=False) if out is not None else None,
                                accumulate=accumulate, stream=stream)
        return out if out is not None else _permute(dw, (0, 3, 1, 2))
    dt, x_shape, w_shape, (st, pd, dl) = _problem(w_shape, "w_shape", x, "x", dy, layout, stride, padding,
                                                  dilation, False)
    out_dtype = as_tensor(out, "out").dtype if out is not None else dt.dtype
    if out_dtype not in (dt.dtype, "float32"):
        raise TypeError(f"out: expected dtype {dt.dtype} or float32, got {out_dtype}")
    accumulate = check_flag(accumulate, "accumulate")
    plan = _wgrad_plan(dt, x_shape, w_shape, layout, (st, pd, dl), precision, mask is not None, prologue is not None,
                       out_dtype, accumulate)
    return plan(x, dy, mask=mask, prologue=prologue, out=out, stream=stream)


def _wgrad_plan(dt, x_shape, w_shape, layout, geo, precision, mask: bool, prologue: bool, out_dtype: str,
                accumulate: bool) -> Conv2dGradWeightPlan:
    dev = _device_of(dt)
    key = (x_shape, w_shape, dt.dtype, layout, *geo, precision, mask, prologue, out_dtype, accumulate, dev)
    return _cached(Conv2dGradWeightPlan, key, lambda: Conv2dGradWeightPlan(
        x_shape, w_shape, dt.dtype, layout, *geo, precision=precision, mask=mask, prologue=prologue,
        out_dtype=out_dtype, accumulate=accumulate, device=dev if dev is not None else "numpy"))


@keeps_current_context
def conv2d_backward(dy, x, w, stride=1, padding=0, dilation=1, *, layout: str = "NCHW", mask=None, prologue=None,
                    precision: str = "strict", stream=None) -> tuple:
    """Both gradients of ``conv2d``, ``(dx, dw)`` (``torch.ops.aten.convolution_backward`` with
    ``output_mask=[True, True, False]``): :func:`conv2d_grad_input` and :func:`conv2d_grad_weight` with the same
    arguments, ``x_shape`` and ``w_shape`` taken from ``x`` and ``w``.

    With ``mask`` or ``prologue``, the gradient reaching the conv (``bit ? dy : 0``, or the prologue's
    ``a[k]·g + b[k]·z + c[k]``) is formed once for both kernels where the two calls would each form it: torch CUDA
    tensors of 16 bits with NHWC memory (``layout="NHWC"``, or ``channels_last``), K % 8 == 0, on the current
    stream; a mask alone is read by both native kernels themselves where they can (no dz). Elsewhere it is the two
    calls. dx and dw are fresh, in x's dtype.

    >>> import numpy as np, igemm
    >>> x, w = np.ones((1, 2, 4, 4), np.float32), np.ones((3, 2, 3, 3), np.float32)
    >>> dx, dw = igemm.conv2d_backward(np.ones((1, 3, 4, 4), np.float32), x, w, padding=1)
    >>> dx[0, 0, 0].tolist(), dw[0, 0, 0].tolist()
    ([12.0, 18.0, 18.0, 12.0], [9.0, 12.0, 9.0])
    """
    require_array(dy, "dy")
    require_array(x, "x")
    require_array(w, "w")
    check_stream(stream)
    check_layout(layout)
    if (mask is not None or prologue is not None) and stream is None:
        both = _dz_once(dy, x, w, stride, padding, dilation, layout, mask, prologue, precision)
        if both is not None:
            return both
    return (conv2d_grad_input(dy, w, tuple(x.shape), stride, padding, dilation, layout=layout, mask=mask,
                              prologue=prologue, precision=precision, stream=stream),
            conv2d_grad_weight(x, dy, tuple(w.shape), stride, padding, dilation, layout=layout, mask=mask,
                               prologue=prologue, precision=precision, stream=stream))


def _fast_problem(torch, dy, x, w, layout, stride, padding, dilation):
    """``(dy's view, x_shape, w_shape, geometry)`` of a 16-bit NHWC call the one-pass forms may take; None otherwise
    (the composed calls then raise the precise error)."""
    if dy.dtype not in (torch.float16, torch.bfloat16):
        return None
    dt = as_tensor(dy, "dy")
    try:
        _, x_shape, w_shape, geo = _problem(tuple(x.shape), "x_shape", w, "w", dy, layout, stride, padding,
                                            dilation, True)
    except (TypeError, ValueError):
        return None
    return dt, x_shape, w_shape, geo


def _dz_once(dy, x, w, stride, padding, dilation, layout, mask, prologue, precision):
    """:func:`conv2d_backward` with the gradient reaching the conv formed by one dz pass (csrc/conv/backward.cuh:
    grad_dz) and both plans run plain on it; None where the call is not of that kind (nothing launched then).
    Every check of the two plans' torch paths passes before the pass (docs/performance.md: grad-dz-once)."""
    import sys
    torch = sys.modules.get("torch")
    T = torch.Tensor if torch is not None else None
    if T is None or type(dy) is not T or type(x) is not T or not isinstance(w, T) or dy.dim() != 4 or not dy.is_cuda:
        return None
    if layout == "NCHW":
        if not (_channels_last(dy) and _channels_last(x) and _channels_last(w)):
            return None
        z = getattr(prologue, "z", None)
        if prologue is not None and not (isinstance(z, T) and _channels_last(z)):
            return None
        p = prologue if prologue is None else GradPrologue(z.permute(0, 2, 3, 1), prologue.coef,
                                                            prologue.grad_weight, prologue.grad_bias)
        v = (0, 2, 3, 1)
        both = _dz_once(dy.permute(v), x.permute(v), w.permute(v), stride, padding, dilation, "NHWC", mask, p,
                        precision)
        return None if both is None else (both[0].permute(0, 3, 1, 2), both[1].permute(0, 3, 1, 2))
    got = _fast_problem(torch, dy, x, w, layout, stride, padding, dilation)
    if got is None:
        return None
    dt, x_shape, w_shape, geo = got
    dplan = _dgrad_plan(dt, x_shape, w_shape, layout, geo, precision, mask is not None, prologue is not None)
    wplan = _wgrad_plan(dt, x_shape, w_shape, layout, geo, precision, mask is not None, prologue is not None,
                        dt.dtype, False)
    g = dplan.problem
    fd = dplan._torch_fast(dy, w, g.dy_shape, g.w_shape, mask, prologue, None, None)
    fw = wplan._torch_fast(x, dy, g.x_shape, g.dy_shape, mask, prologue, None, None)
    if fd is None or fw is None:
        return None
    fp = fd[2]
    if dplan.fuses_mask(dy.data_ptr(), fp) and wplan.fuses_mask(dy.data_ptr(), fw[2]):
        return None                           # both kernels read the mask themselves: no dz (grad-mask-registers)
    if not dz_fits(dplan.dtype, g.K, dy.data_ptr(), fp["z"], fp["coef"]):
        return None
    dz = torch.empty_like(dy)
    launch_dz(dplan.device_id, fd[1], dplan.dtype, dy.numel() // g.K, g.K, dy.data_ptr(), dz.data_ptr(),
              mode="bn" if fp["coef"] else "mask", sms=dplan.sms, **fp)
    return (conv2d_grad_input(dz, w, x_shape, *geo, layout=layout, precision=precision),
            conv2d_grad_weight(x, dz, w_shape, *geo, layout=layout, precision=precision))


@keeps_current_context
def conv2d_grad_prologue(dy, z, mean, invstd, gamma=None, *, mask=None, layout: str = "NCHW",
                         stream=None) -> GradPrologue:
    """The BN-backward reduction of conv -> BatchNorm (training statistics) [-> + residual] -> ReLU, as the
    prologue the grad kernels apply to dy: ``dz = a[k]·g + b[k]·z + c[k]`` (``g = bit ? dy : 0`` with ``mask``),
    which is PyTorch's ``batch_norm_backward`` of BN's input written per channel.

    Args:
        dy: the gradient of the block's output; z: the conv's output (BN's input), dy's shape and dtype.
        mean, invstd: BN's batch statistics of z (fp32, K); gamma: BN's weight (fp32, K; None: ones).
        mask: the forward's ReLU bit mask (of the BN(+residual) output).

    Returns:
        a :class:`GradPrologue`: ``z``, ``coef`` (fp32, 3 x K: a, b, c), ``grad_weight`` (dgamma) and
        ``grad_bias`` (dbeta), in dy's framework.
    """
    from ..norm import batch_norm_backward_reduce
    require_array(dy, "dy")
    require_array(z, "z")
    check_stream(stream)
    check_layout(layout)
    if layout == "NCHW" and _channels_last(dy):      # channels_last: the NHWC reduction on views
        p = conv2d_grad_prologue(_permute(dy, (0, 2, 3, 1)), _nhwc_view(z, "z"), mean, invstd, gamma, mask=mask,
                                 layout="NHWC", stream=stream)
        return GradPrologue(z, p.coef, p.grad_weight, p.grad_bias)
    t = as_tensor(dy, "dy")
    if t.ndim != 4:
        raise ValueError(f"dy: expected a 4-D {layout} tensor, got shape {tuple(t.shape)}")
    zt = as_tensor(z, "z")                         # (the reduction would name z its x)
    if tuple(zt.shape) != tuple(t.shape) or zt.dtype != t.dtype:
        raise ValueError(f"z: expected dy's shape {tuple(t.shape)} and dtype {t.dtype}, got {tuple(zt.shape)} "
                         f"{zt.dtype}")
    K = t.shape[1] if layout == "NCHW" else t.shape[3]
    count = t.numel // K if K else 0
    if gamma is not None:
        g = as_tensor(gamma, "gamma")
        if g.dtype != "float32":
            raise TypeError(f"gamma: expected float32, got {g.dtype}")
        if tuple(g.shape) != (K,):
            raise ValueError(f"gamma: expected a float32 vector of {K} channels, got {g.dtype} {tuple(g.shape)}")
    sum_dy, sum_dy_xmu, grad_weight, grad_bias = batch_norm_backward_reduce(
        dy, z, mean, invstd, None, True, True, True, mask=mask, layout=layout, stream=stream)
    ctx = CallContext({"gamma": gamma, "mean": mean, "invstd": invstd, "sum_dy": sum_dy,
                       "sum_dy_xmu": sum_dy_xmu}, stream)
    if ctx.backend == "numpy" or ctx.host:
        v = {k: (np.ones(K) if k == "gamma" and gamma is None else np.asarray(ctx.views[k].obj, np.float64))
             for k in ("gamma", "mean", "invstd", "sum_dy", "sum_dy_xmu")}
        coef = np.stack(reference.bn_grad_coefficients_ref(v["sum_dy"], v["sum_dy_xmu"], v["mean"], v["invstd"],
                                                           v["gamma"], count)).astype(np.float32)
        return GradPrologue(z, coef, grad_weight, grad_bias)
    from ._moves import launch_coefficients
    c_obj, c_dev = ctx.empty((3, K), "float32")
    if K:
        launch_coefficients(ctx.device_id, ctx.stream.handle, K, count,
                            gamma=ctx.device_view("gamma").ptr if gamma is not None else 0,
                            invstd=ctx.device_view("invstd").ptr, mean=ctx.device_view("mean").ptr,
                            sum_dy=ctx.device_view("sum_dy").ptr, sum_dy_xmu=ctx.device_view("sum_dy_xmu").ptr,
                            coef=c_dev.ptr)
    return GradPrologue(z, ctx.finish(c_obj), grad_weight, grad_bias)


@keeps_current_context
def conv2d_bn_backward(dy, x, w, z, mean, invstd, gamma=None, stride=1, padding=0, dilation=1, *, mask=None,
                       layout: str = "NCHW", residual: bool = False, precision: str = "strict") -> tuple:
    """The backward of one conv -> BatchNorm (training statistics) [-> + residual] [-> ReLU] block:
    ``(dx, dw, grad_weight, grad_bias, grad_residual)``, the conv's gradients, BN's (dgamma, dbeta) and, with
    ``residual=True``, the residual branch's gradient (``bit ? dy : 0`` with ``mask``, else dy itself; None without).

    It is :func:`conv2d_grad_prologue` and then :func:`conv2d_backward` with that prologue, with their arguments and
    semantics. Where those calls would take torch CUDA tensors of 16 bits with NHWC memory (``layout="NHWC"``, or
    ``channels_last``), K % 8 == 0 and the GPU holds the pass's grid at once, BN's sums, the prologue's coefficients
    and dz (and the residual's gradient) are one cooperative launch (csrc/norm_train.cuh: bn_train_backward), and
    dgrad and wgrad run plain on dz (docs/performance.md: bn-backward-one-launch).

    Args:
        dy: the gradient of the block's output; x, w: the conv's input and weight; z: the conv's output (dy's shape).
        mean, invstd: BN's batch statistics of z (fp32, K); gamma: BN's weight (fp32, K; None: ones).
        mask: the forward's ReLU bit mask (of the BN(+residual) output); None: no ReLU.

    >>> import numpy as np, igemm
    >>> x, w = np.ones((1, 2, 4, 4), np.float32), np.ones((3, 2, 3, 3), np.float32)
    >>> z = igemm.conv2d(x, w, padding=1)
    >>> mean, invstd = z.mean((0, 2, 3)), 1 / np.sqrt(z.var((0, 2, 3)) + 1e-5)
    >>> dy = np.tile(np.arange(4, dtype=np.float32), (1, 3, 4, 1))
    >>> dx, dw, dgamma, dbeta, dres = igemm.conv2d_bn_backward(dy, x, w, z, mean, invstd, padding=1)
    >>> dbeta.tolist(), dres is None
    ([24.0, 24.0, 24.0], True)
    """
    require_array(dy, "dy")
    require_array(x, "x")
    require_array(w, "w")
    require_array(z, "z")
    check_layout(layout)
    check_flag(residual, "residual")
    got = _bn_once(dy, x, w, z, mean, invstd, gamma, stride, padding, dilation, layout, mask, residual, precision)
    if got is not None:
        return got
    # the conv's arguments checked before the reduction launches (its own are checked by conv2d_grad_prologue)
    _problem(tuple(x.shape), "x_shape", w, "w", dy, layout, stride, padding, dilation, True)
    _problem(tuple(w.shape), "w_shape", x, "x", dy, layout, stride, padding, dilation, False)
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected 'strict' or 'tf32', got {precision!r}")
    p = conv2d_grad_prologue(dy, z, mean, invstd, gamma, mask=mask, layout=layout)
    dx, dw = conv2d_backward(dy, x, w, stride, padding, dilation, layout=layout, mask=mask, prologue=p,
                             precision=precision)
    dres = None
    if residual:
        from ..relu import relu_backward
        if mask is None:
            dres = dy
        elif layout == "NCHW" and _channels_last(dy):      # (the mask is over the memory order)
            dres = _permute(relu_backward(_permute(dy, (0, 2, 3, 1)), mask), (0, 3, 1, 2))
        else:
            dres = relu_backward(dy, mask)
    return dx, dw, p.grad_weight, p.grad_bias, dres


_BWD_SLOTS: dict = {}        # one-launch backward kernel -> its pointer slots


def _bn_once(dy, x, w, z, mean, invstd, gamma, stride, padding, dilation, layout, mask, residual, precision):
    """:func:`conv2d_bn_backward` with BN's sums, the coefficients and dz in one launch and both plans plain on dz;
    None where the call is not of that kind (nothing launched then: the composed calls raise the precise error)."""
    import sys
    torch = sys.modules.get("torch")
    T = torch.Tensor if torch is not None else None
    if (T is None or type(dy) is not T or type(x) is not T or not isinstance(w, T) or type(z) is not T
            or dy.dim() != 4 or not dy.is_cuda):
        return None
    if layout == "NCHW":
        if not all(_channels_last(t) for t in (dy, x, w, z)):
            return None
        v, u = (0, 2, 3, 1), (0, 3, 1, 2)
        got = _bn_once(dy.permute(v), x.permute(v), w.permute(v), z.permute(v), mean, invstd, gamma, stride, padding,
                       dilation, "NHWC", mask, residual, precision)
        return None if got is None else (got[0].permute(u), got[1].permute(u), got[2], got[3],
                                         None if got[4] is None else got[4].permute(u))
    got = _fast_problem(torch, dy, x, w, layout, stride, padding, dilation)
    if got is None:
        return None
    dt, x_shape, w_shape, geo = got
    N, P, Q, K = dy.shape
    dev = dy.get_device()
    for t in (mean, invstd) if gamma is None else (mean, invstd, gamma):
        if (type(t) is not T or t.dtype is not torch.float32 or tuple(t.shape) != (K,) or not t.is_contiguous()
                or t.get_device() != dev):
            return None
    from .._norm_train import TRAIN_BWD_PTRS, train_kernel
    one = train_kernel(dev, backward=True, dtype=dt.dtype, N=N, C=K, HW=P * Q)
    if one is None:
        return None
    k, nws = one
    sums = torch.empty((6 * K + nws,), dtype=torch.float32, device=dy.device)
    # sums: sum_dy, sum_dy_xmu, dbeta (K each), the coefficients (3 x K), the partials; dgamma its own
    # (no two returns share memory: torch.library's rule for the op path's outputs)
    dgamma = torch.empty((K,), dtype=torch.float32, device=dy.device)
    coef = sums[3 * K:6 * K].view(3, K)
    dplan = _dgrad_plan(dt, x_shape, w_shape, layout, geo, precision, mask is not None, True)
    wplan = _wgrad_plan(dt, x_shape, w_shape, layout, geo, precision, mask is not None, True, dt.dtype, False)
    g, pro = dplan.problem, GradPrologue(z, coef)
    fd = dplan._torch_fast(dy, w, g.dy_shape, g.w_shape, mask, pro, None, None)
    fw = wplan._torch_fast(x, dy, g.x_shape, g.dy_shape, mask, pro, None, None)
    if fd is None or fw is None or not dz_fits(dplan.dtype, K, dy.data_ptr(), z.data_ptr()):
        return None
    slots = _BWD_SLOTS.get(k)
    if slots is None:
        slots = _BWD_SLOTS[k] = k.slots(TRAIN_BWD_PTRS)
    dz = torch.empty_like(dy)
    sel = torch.empty_like(dy) if residual and mask is not None else None
    b, dp, zp = sums.data_ptr(), dy.data_ptr(), z.data_ptr()
    k.run(fd[1], slots, [zp, dp, fd[2]["mask"], mean.data_ptr(), invstd.data_ptr(), b + 24 * K, b, b + 4 * K,
                         dgamma.data_ptr(), b + 8 * K, gamma.data_ptr() if gamma is not None else 0, b + 12 * K, dp,
                         dz.data_ptr(), zp, sel.data_ptr() if sel is not None else 0])
    dx = conv2d_grad_input(dz, w, x_shape, *geo, layout=layout, precision=precision)
    dw = conv2d_grad_weight(x, dz, w_shape, *geo, layout=layout, precision=precision)
    return dx, dw, dgamma, sums[2 * K:3 * K], sel if sel is not None else (dy if residual else None)
