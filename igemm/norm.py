"""BatchNorm kernels: per-channel statistics (Welford + Chan), the fused BN(-Add)-ReLU forward with the
1-bit mask, and the backward reductions / elementwise pass with the mask's ReLU gradient fused in.

Names and meanings follow PyTorch's ``torch.batch_norm_*`` functions (which ``SyncBatchNorm`` is built
from); :mod:`igemm.syncbn` adds the cross-process pieces.

Layouts: ``"NCHW"`` means ``x[N, C, *spatial]`` and ``"NHWC"`` means ``x[N, *spatial, C]`` (for a
torch ``channels_last`` tensor pass ``x.permute(0, 2, 3, 1)``, which is contiguous); tensors must be
contiguous. Inputs fp32/fp16/bf16, every accumulation in fp32 (fp64 for the final merges); per-channel
vectors (mean, invstd, weight, bias, sums, running stats) are fp32.

Every function validates all of its arguments (outputs and in-place ones included) before it writes or
launches anything (:mod:`igemm._norm_checks`); the kernels, their geometry and launches are in
:mod:`igemm._norm_kernels` (statistics: two deterministic launches, no atomics).
The mask is ARCHITECTURE.md's (bit ``i % 32`` of word ``i // 32`` is set exactly when stored ``y[i] > 0``),
bit for bit what :func:`igemm.relu_mask` and the conv epilogue write.
"""
from __future__ import annotations

import numpy as np

from . import reference
from ._checks import check_eps, check_flag, check_layout, check_output, check_stream, is_real
from ._dispatch import CallContext
from ._norm_checks import (alloc, check_act, check_count, check_like, check_momentum, check_outs, check_partials,
                           check_running, check_vec, host, mask_arg, np_ret, out_dict, required, ret)
from ._norm_kernels import (LAYOUTS, THREADS, compile_stubs, elemt_config, finalize_per_block,  # noqa: F401
                            instances_for, launch_elemt, launch_gather, launch_reduction, precompile,
                            reduction_config, stub_backward, stub_finalize, stub_forward, stub_gather,
                            stub_stats_k1, stub_sum_ranks)
from ._runtime import keeps_current_context
from .relu import mask_dtype_for, mask_words

__all__ = ["welford", "batch_norm_stats", "batch_norm_gather_stats", "batch_norm_elemt", "batch_norm_relu",
           "batch_norm_backward_reduce", "batch_norm_backward_elemt", "batch_norm_relu_backward",
           "reduction_config", "elemt_config", "instances_for", "compile_stubs", "precompile", "LAYOUTS"]


# =========================================================================================== statistics
@keeps_current_context
def welford(x, layout: str = "NCHW", *, out=None, stream=None):
    """Per-channel ``(mean, var, count)`` of ``x``: biased variance (``M2 / count``), fp32 results.

    Welford per thread on ``x - K_c`` (``K_c`` the channel's first element, so a large mean costs no
    precision), Chan merges across threads, warps and blocks in a fixed order (deterministic). ``count``
    is ``N * H * W`` for every channel (fp32: exact up to 2**24). ``out=(mean, var, count)`` may give
    fp64 arrays, which get fp64 results. An empty batch gives zeros.

    >>> import numpy as np, igemm
    >>> x = np.arange(12, dtype=np.float32).reshape(2, 3, 2)      # N=2, C=3, L=2
    >>> [a.tolist() for a in igemm.welford(x)]
    [[3.5, 5.5, 7.5], [9.25, 9.25, 9.25], [4.0, 4.0, 4.0]]
    """
    required({"x": x})
    check_layout(layout)
    check_stream(stream)
    outs = out_dict(out, ("mean", "var", "count"), "welford")
    ctx = CallContext({"x": x, **outs}, stream)
    t_x = ctx.views["x"]
    N, C, HW = check_act(t_x, "x", layout)
    keys = ("out.mean", "out.var", "out.count")
    check_outs(ctx, keys, (C,), ("float32", "float64"), ("x",))
    given = {ctx.views[k].dtype for k in keys if k in ctx.views}
    if len(given) > 1:
        raise TypeError(f"out: mean, var and count must share one dtype, got {sorted(given)}")
    odt = given.pop() if given else "float32"
    if ctx.backend == "numpy":
        vals = reference.welford_stats(np.asarray(x), layout)
        o = out or (None, None, None)
        return tuple(np_ret(v, oo, odt) for v, oo in zip(vals, o))
    d_x = ctx.device_view("x")
    res = [alloc(ctx, k, (C,), odt) for k in keys]
    launch_reduction(ctx, grad=False, dtype=t_x.dtype, layout=layout, N=N, C=C, HW=HW,
                     ptrs=dict(x=d_x.ptr, out0=res[0][1].ptr, out1=res[1][1].ptr, out2=res[2][1].ptr),
                     mode=0, f64=odt == "float64")
    return tuple(ret(ctx, k, r) for k, r in zip(keys, res))


@keeps_current_context
def batch_norm_stats(x, eps: float = 1e-5, layout: str = "NCHW", *, running_mean=None, running_var=None,
                     momentum: float = 0.1, out=None, stream=None):
    """``(mean, invstd)`` per channel, fp32, as ``torch.batch_norm_stats``: ``invstd = 1/sqrt(var + eps)``
    with the biased variance (0 where ``var == 0 and eps == 0``). ``eps``: any real number, finite, >= 0.

    One pass over ``x`` (see :func:`welford`); the grid fills the GPU whatever C (no block per channel).
    With ``running_mean``/``running_var`` (fp32, updated in place on the device) they also get PyTorch's
    training update: ``r = (1 - momentum) * r + momentum * stat`` with the unbiased variance.

    >>> import numpy as np, igemm
    >>> x = np.array([[[1.], [2.]], [[3.], [6.]]], np.float32)      # N=2, C=2, L=1
    >>> [np.round(a, 4).tolist() for a in igemm.batch_norm_stats(x, 0.0)]
    [[2.0, 4.0], [1.0, 0.5]]
    """
    required({"x": x})
    check_layout(layout)
    e = check_eps(eps)
    mom = check_momentum(momentum)
    check_stream(stream)
    outs = out_dict(out, ("mean", "invstd"), "batch_norm_stats")
    ctx = CallContext({"x": x, "running_mean": running_mean, "running_var": running_var, **outs}, stream)
    t_x = ctx.views["x"]
    N, C, HW = check_act(t_x, "x", layout)
    check_running(ctx, running_mean, running_var, C, layout)
    keys = ("out.mean", "out.invstd")
    check_outs(ctx, keys, (C,), ("float32",), ("x",), also=("running_mean", "running_var"))
    if ctx.backend == "numpy":
        mean, var, n = reference.welford_stats(np.asarray(x), layout)
        if running_mean is not None:
            rm, rv = reference.update_running_stats_ref(running_mean, running_var, mean, var, n, mom)
            np.asarray(running_mean)[...] = rm
            np.asarray(running_var)[...] = rv
        o = out or (None, None)
        return (np_ret(mean, o[0], np.float32), np_ret(reference.invstd_from_var(var, e), o[1], np.float32))
    d_x = ctx.device_view("x")
    res = [alloc(ctx, k, (C,), "float32") for k in keys]
    d_rm = ctx.device_view("running_mean") if running_mean is not None else None
    d_rv = ctx.device_view("running_var") if running_var is not None else None
    launch_reduction(ctx, grad=False, dtype=t_x.dtype, layout=layout, N=N, C=C, HW=HW,
                     ptrs=dict(x=d_x.ptr, out0=res[0][1].ptr, out1=res[1][1].ptr,
                               run_mean=d_rm.ptr if d_rm else 0, run_var=d_rv.ptr if d_rv else 0),
                     mode=1, eps=e, momentum=mom)
    if d_rm is not None:
        ctx.copy_back("running_mean", d_rm)
        ctx.copy_back("running_var", d_rv)
    return tuple(ret(ctx, k, r) for k, r in zip(keys, res))


@keeps_current_context
def batch_norm_gather_stats(means, vars, counts, *, out=None, stream=None):  # noqa: A002 - PyTorch's name
    """Chan's parallel merge of per-rank partials: ``means``/``vars`` ``[W, C]`` (biased variances, fp32 or
    fp64), ``counts`` ``[W]`` or ``[W, C]`` (fp32/fp64/int32/int64) → merged ``(mean, var, count)`` ``[C]``
    in the means' dtype. Merged in fp64, in rank order (deterministic); ranks with count 0 are skipped on
    the device (no host synchronisation). Unlike ``torch.batch_norm_gather_stats_with_counts`` this takes
    variances, not invstd (which loses the variance when var << eps).

    >>> import numpy as np, igemm
    >>> m, v, n = igemm.batch_norm_gather_stats(np.array([[0.], [2.], [5.]]), np.array([[1.], [1.], [9.]]),
    ...                                         np.array([2., 2., 0.]))
    >>> m.tolist(), v.tolist(), n.tolist()
    ([1.0], [2.0], [4.0])
    """
    required({"means": means, "vars": vars, "counts": counts})
    check_stream(stream)
    outs = out_dict(out, ("mean", "var", "count"), "batch_norm_gather_stats")
    ctx = CallContext({"means": means, "vars": vars, "counts": counts, **outs}, stream)
    W, C, cnt_rs, cnt_cs = check_partials(ctx, "means", "vars", "counts")
    odt = ctx.views["means"].dtype
    keys = ("out.mean", "out.var", "out.count")
    check_outs(ctx, keys, (C,), (odt,), ("means", "vars", "counts"))
    if ctx.backend == "numpy":
        vals = reference.chan_merge(np.asarray(means), np.asarray(vars), np.asarray(counts))
        o = out or (None, None, None)
        return tuple(np_ret(v, oo, odt) for v, oo in zip(vals, o))
    dm, dv, dc = (ctx.device_view(k) for k in ("means", "vars", "counts"))
    res = [alloc(ctx, k, (C,), odt) for k in keys]
    launch_gather(ctx, in_dtype=odt, cnt_dtype=dc.dtype, C=C, W=W, rs=C, cnt_rs=cnt_rs, cnt_cs=cnt_cs,
                  ptrs=dict(mean=dm.ptr, var=dv.ptr, cnt=dc.ptr, out0=res[0][1].ptr, out1=res[1][1].ptr,
                            out2=res[2][1].ptr), mode=0, f64=odt == "float64")
    return tuple(ret(ctx, k, r) for k, r in zip(keys, res))


# =========================================================================================== forward
def _forward(x, mean, invstd, weight, bias, residual, act: int, layout, out, mask_out, stream,
             names=("weight", "bias")):
    """BN(-Add)(-ReLU) forward; ``act`` 0: none, 1: ReLU, 2: ReLU and the mask (``mask_out``). ``names``:
    what the caller calls weight and bias (``gamma``/``beta`` for batch_norm_relu), for the messages."""
    required({"x": x, "mean": mean, "invstd": invstd})
    check_layout(layout)
    check_stream(stream)
    wk, bk = names
    inputs = ("x", "mean", "invstd", wk, bk, "residual")
    ctx = CallContext({"x": x, "mean": mean, "invstd": invstd, wk: weight, bk: bias, "residual": residual,
                       "out": out, "mask_out": mask_out}, stream)
    t_x = ctx.views["x"]
    N, C, HW = check_act(t_x, "x", layout)
    for k in ("mean", "invstd", wk, bk):
        check_vec(ctx, k, C, layout)
    if residual is not None:
        check_like(ctx.views["residual"], "residual", t_x, "x")
    ins = {k: ctx.views.get(k) for k in inputs}
    if out is not None:
        check_output(ctx.views["out"], "out", shape=t_x.shape, dtypes=(t_x.dtype,), inputs=ins)
    numel = N * C * HW
    if mask_out is not None:
        mask_arg(ctx, "mask_out", numel)
        check_output(ctx.views["mask_out"], "mask_out", inputs={**ins, "out": ctx.views.get("out")})
    if ctx.backend == "numpy":
        xd = np.asarray(x)
        y = reference.batch_norm_elemt_ref(xd, mean, invstd, host(weight), host(bias), layout, host(residual),
                                           relu=act != 0)
        y = np_ret(y, out, xd.dtype)
        if act != 2:
            return y
        m = reference.pack_mask(np.asarray(y, dtype=np.float64) > 0)
        if mask_out is not None:
            np.asarray(mask_out).view(np.uint32)[:m.size] = m
            return y, mask_out
        return y, m
    ptr = {k: (ctx.device_view(k).ptr if k in ctx.views else 0) for k in inputs}
    yres = alloc(ctx, "out", t_x.shape, t_x.dtype)
    mres = alloc(ctx, "mask_out", (mask_words(numel),), mask_dtype_for(ctx.kind)) if act == 2 else None
    launch_elemt(ctx, backward=False, dtype=t_x.dtype, layout=layout, N=N, C=C, HW=HW, act_or_mask=act,
                 res=residual is not None, align_ptrs=(ptr["x"], yres[1].ptr, ptr["residual"]),
                 ptrs={"x": ptr["x"], "res": ptr["residual"], "y": yres[1].ptr, "mask": mres[1].ptr if mres else 0,
                       "mean": ptr["mean"], "invstd": ptr["invstd"], "weight": ptr[wk], "bias": ptr[bk]})
    y = ret(ctx, "out", yres)
    if act != 2:
        return y
    return y, ret(ctx, "mask_out", mres)


@keeps_current_context
def batch_norm_elemt(x, mean, invstd, weight=None, bias=None, *, residual=None, layout: str = "NCHW", out=None,
                     stream=None):
    """``y = (x - mean) * invstd * weight + bias (+ residual)`` per channel, computed in fp32, stored in x's
    dtype (``torch.batch_norm_elemt``; note the argument order of :func:`batch_norm_relu`, not torch's
    ``(input, weight, bias, mean, invstd, eps)``). ``weight``/``bias`` None mean 1 and 0.
    """
    return _forward(x, mean, invstd, weight, bias, residual, 0, layout, out, None, stream)


@keeps_current_context
def batch_norm_relu(x, mean, invstd, gamma=None, beta=None, residual=None, return_mask: bool = True, *,
                    layout: str = "NCHW", out=None, mask_out=None, stream=None):
    """Fused BN(-Add)-ReLU in one pass: ``y = relu((x - mean) * invstd * gamma + beta [+ residual])``
    and, with ``return_mask``, the 1-bit ReLU mask: ``uint32[ceil(numel/32)]`` (``int32`` for torch), bit
    ``i % 32`` of word ``i // 32`` set exactly when the stored ``y`` at memory offset ``i`` is > 0 (so
    ``mask == igemm.relu_mask(y)`` bit for bit; NaN gives 0 and stays NaN in y, as ``torch.relu``).
    ``mask_out`` with ``return_mask=False`` is refused (it would not be written).
    The backward needs the mask and x, never y: :func:`batch_norm_relu_backward`.

    >>> import numpy as np, igemm
    >>> x = np.array([[[-1., 0.5, 2.]]], np.float32)                  # N=1, C=1, L=3
    >>> y, m = igemm.batch_norm_relu(x, np.zeros(1, np.float32), np.ones(1, np.float32))
    >>> y.tolist(), int(m[0])
    ([[[0.0, 0.5, 2.0]]], 6)
    """
    if not check_flag(return_mask, "return_mask") and mask_out is not None:
        raise ValueError("mask_out: given but return_mask is False (no mask is written)")
    return _forward(x, mean, invstd, gamma, beta, residual, 2 if return_mask else 1, layout, out, mask_out, stream,
                    ("gamma", "beta"))


# =========================================================================================== backward
_GRAD_INPUTS = ("dy", "x", "mean", "invstd", "weight", "mask")
_GRAD_OUTS = ("out.sum_dy", "out.sum_dy_xmu", "out.grad_weight", "out.grad_bias")


def _reduce_context(dy, x, mean, invstd, weight, want, mask, layout, out, stream, wname="weight"):
    """Validate :func:`batch_norm_backward_reduce`'s arguments; returns (ctx, N, C, HW). ``wname``: what
    the caller calls the weight (for the messages)."""
    required({"dy": dy, "x": x, "mean": mean, "invstd": invstd})
    check_layout(layout)
    check_stream(stream)
    outs = out_dict(out, tuple(k[4:] for k in _GRAD_OUTS), "batch_norm_backward_reduce")
    ctx = CallContext({"dy": dy, "x": x, "mean": mean, "invstd": invstd, wname: weight, "mask": mask,
                       **outs}, stream)
    t_x = ctx.views["x"]
    N, C, HW = check_act(t_x, "x", layout)
    check_like(ctx.views["dy"], "dy", t_x, "x")
    for k in ("mean", "invstd", wname):
        check_vec(ctx, k, C, layout)
    mask_arg(ctx, "mask", N * C * HW)
    for k, w, flag in zip(_GRAD_OUTS, want, ("input_g", "input_g", "weight_g", "bias_g")):
        if k in ctx.views and not w:
            raise ValueError(f"{k}: given but {flag} is False (it would not be written)")
    check_outs(ctx, _GRAD_OUTS, (C,), ("float32",), (*_GRAD_INPUTS, wname))
    return ctx, N, C, HW


@keeps_current_context
def batch_norm_backward_reduce(dy, x, mean, invstd, weight=None, input_g: bool = True, weight_g: bool = True,
                               bias_g: bool = True, *, mask=None, layout: str = "NCHW", out=None, stream=None):
    """``(sum_dy, sum_dy_xmu, grad_weight, grad_bias)`` per channel (fp32), as
    ``torch.batch_norm_backward_reduce``: ``sum_dy = Σ dy``, ``sum_dy_xmu = Σ dy·(x − mean)``,
    ``grad_weight = sum_dy_xmu · invstd``, ``grad_bias = sum_dy``; entries not asked for
    (``input_g``/``weight_g``/``bias_g``) are None (an ``out`` entry for one of them is refused). With
    ``mask`` (from :func:`batch_norm_relu`) dy is first replaced by ``bit ? dy : 0`` (a select), i.e. these
    are BN-ReLU's gradients. Deterministic. ``weight`` is accepted for PyTorch's signature and not used (nor
    is it by PyTorch).
    """
    want = tuple(check_flag(v, n) for v, n in ((input_g, "input_g"), (input_g, "input_g"), (weight_g, "weight_g"),
                                               (bias_g, "bias_g")))
    ctx, N, C, HW = _reduce_context(dy, x, mean, invstd, weight, want, mask, layout, out, stream)
    return _reduce_run(ctx, want, layout, N, C, HW, out)


def _reduce_run(ctx, want, layout, N, C, HW, out):
    if ctx.backend == "numpy":
        v = ctx.views
        vals = reference.batch_norm_backward_reduce_ref(np.asarray(v["dy"].obj), np.asarray(v["x"].obj),
                                                        v["mean"].obj, v["invstd"].obj, layout,
                                                        host(v["mask"].obj) if "mask" in v else None)
        o = out or (None,) * 4
        return tuple(np_ret(r, oo, np.float32) if w else None for r, oo, w in zip(vals, o, want))
    d = {k: ctx.device_view(k) for k in ("dy", "x", "mean", "invstd", "mask") if k in ctx.views}
    res = [alloc(ctx, k, (C,), "float32") if w else None for k, w in zip(_GRAD_OUTS, want)]
    if res[0] is None:  # the sums are always computed; scratch when not asked for
        res[0] = (*ctx.empty((C,), "float32"), False)
        res[1] = (*ctx.empty((C,), "float32"), False)
    launch_reduction(ctx, grad=True, dtype=ctx.views["x"].dtype, layout=layout, N=N, C=C, HW=HW,
                     ptrs=dict(dy=d["dy"].ptr, x=d["x"].ptr, mask=d["mask"].ptr if "mask" in d else 0,
                               mean=d["mean"].ptr, invstd=d["invstd"].ptr, out0=res[0][1].ptr, out1=res[1][1].ptr,
                               out2=res[2][1].ptr if res[2] else 0, out3=res[3][1].ptr if res[3] else 0))
    return tuple(ret(ctx, k, r) if (r is not None and w) else None for k, r, w in zip(_GRAD_OUTS, res, want))


_ELEMT_INPUTS = ("dy", "x", "mask", "mean", "invstd", "weight", "sum_dy", "sum_dy_xmu", "count")


def _elemt_context(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count, mask, layout, residual_grad, out,
                   residual_grad_out, stream, wname="weight"):
    """Validate :func:`batch_norm_backward_elemt`'s arguments; returns (ctx, N, C, HW, count_val, count_cs).
    ``wname``: what the caller calls the weight (for the messages; ``ctx`` holds it as ``weight``)."""
    required({"dy": dy, "x": x, "mean": mean, "invstd": invstd, "sum_dy": sum_dy, "sum_dy_xmu": sum_dy_xmu})
    check_layout(layout)
    check_stream(stream)
    if not check_flag(residual_grad, "residual_grad") and residual_grad_out is not None:
        raise ValueError("residual_grad_out: given but residual_grad is False (it would not be written)")
    ctx = CallContext({"dy": dy, "x": x, "mean": mean, "invstd": invstd, wname: weight, "sum_dy": sum_dy,
                       "sum_dy_xmu": sum_dy_xmu, "count": count if _is_array(count) else None, "mask": mask,
                       "out": out, "residual_grad_out": residual_grad_out}, stream)
    t_x = ctx.views["x"]
    N, C, HW = check_act(t_x, "x", layout)
    check_like(ctx.views["dy"], "dy", t_x, "x")
    for k in ("mean", "invstd", wname, "sum_dy", "sum_dy_xmu"):
        check_vec(ctx, k, C, layout)
    count_val, count_cs, _ = check_count(ctx, count, C)
    mask_arg(ctx, "mask", N * C * HW)
    if wname in ctx.views:
        ctx.views["weight"] = ctx.views.pop(wname)
    ins = {k: ctx.views.get(k) for k in _ELEMT_INPUTS}
    for k in ("out", "residual_grad_out"):
        if k in ctx.views:
            check_output(ctx.views[k], k, shape=t_x.shape, dtypes=(t_x.dtype,), inputs=ins)
    if "out" in ctx.views and "residual_grad_out" in ctx.views:
        check_output(ctx.views["residual_grad_out"], "residual_grad_out", inputs={"out": ctx.views["out"]})
    return ctx, N, C, HW, count_val, count_cs


@keeps_current_context
def batch_norm_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count, *, mask=None,
                              layout: str = "NCHW", residual_grad: bool = False, out=None, residual_grad_out=None,
                              stream=None):
    """``dx = (dy − sum_dy/n − (x − mean)·invstd²·sum_dy_xmu/n)·weight·invstd`` (PyTorch's
    ``batch_norm_backward_elemt``; ``weight`` None means 1), with dy replaced by ``bit ? dy : 0`` (a
    select) when ``mask`` is given. ``count`` is the global count n: a number > 0, or an fp32 device array of
    1 or C elements (what :func:`igemm.sync_batch_norm_stats` returns with ``return_count=True``; for
    PyTorch's per-rank int counts pass ``counts.sum().float()``). With ``residual_grad`` also returns the
    residual's gradient of BN-Add-ReLU, the masked dy itself: ``(dx, d_residual)``.
    """
    ctx, N, C, HW, count_val, count_cs = _elemt_context(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count,
                                                        mask, layout, residual_grad, out, residual_grad_out, stream)
    return _elemt_run(ctx, layout, N, C, HW, count, count_val, count_cs, bool(residual_grad))


def _elemt_run(ctx, layout, N, C, HW, count, count_val, count_cs, residual_grad: bool):
    v = ctx.views
    obj = {k: (v[k].obj if k in v else None) for k in (*_ELEMT_INPUTS, "out", "residual_grad_out")}
    if ctx.backend == "numpy":
        cnt = count_val if "count" not in v else np.asarray(count, dtype=np.float64).ravel()
        dx = reference.batch_norm_backward_elemt_ref(obj["dy"], obj["x"], obj["mean"], obj["invstd"],
                                                     host(obj["weight"]), obj["sum_dy"], obj["sum_dy_xmu"], cnt,
                                                     layout, host(obj["mask"]))
        xdt = np.asarray(obj["x"]).dtype
        dx = np_ret(dx, obj["out"], xdt)
        if not residual_grad:
            return dx
        dy = np.asarray(obj["dy"])
        dres = reference.relu_backward(dy, np.asarray(obj["mask"]).view(np.uint32)) if "mask" in v else dy
        return dx, np_ret(dres, obj["residual_grad_out"], xdt)
    d = {k: ctx.device_view(k) for k in _ELEMT_INPUTS if k in v}
    t_x = v["x"]
    dxr = alloc(ctx, "out", t_x.shape, t_x.dtype)
    drr = alloc(ctx, "residual_grad_out", t_x.shape, t_x.dtype) if residual_grad else None
    ptr = {k: (d[k].ptr if k in d else 0) for k in _ELEMT_INPUTS}
    launch_elemt(ctx, backward=True, dtype=t_x.dtype, layout=layout, N=N, C=C, HW=HW,
                 act_or_mask=int("mask" in d), res=residual_grad, count_cs=count_cs,
                 align_ptrs=(ptr["dy"], ptr["x"], dxr[1].ptr, drr[1].ptr if drr else 0),
                 ptrs={**ptr, "y": dxr[1].ptr, "dres": drr[1].ptr if drr else 0, "count_val": count_val})
    dx = ret(ctx, "out", dxr)
    if not residual_grad:
        return dx
    return dx, ret(ctx, "residual_grad_out", drr)


def _is_array(v) -> bool:
    """Anything but a number or None (an array: validated as one)."""
    return v is not None and not is_real(v)


@keeps_current_context
def batch_norm_relu_backward(dy, x, mask, mean, invstd, gamma=None, *, count=None, residual: bool = False,
                             layout: str = "NCHW", stream=None):
    """Backward of :func:`batch_norm_relu` (training mode, batch statistics) from ``x`` and the mask, never
    y: ``(dx, dgamma, dbeta)``, plus ``d_residual`` when ``residual`` (BN-Add-ReLU). Two passes:
    :func:`batch_norm_backward_reduce` then :func:`batch_norm_backward_elemt`, both with the mask's select.
    ``count`` defaults to this batch's ``N*H*W`` (pass the global count under SyncBN). Every argument is
    validated before the first pass.
    """
    required({"mask": mask})
    want = (True,) * 4
    residual = check_flag(residual, "residual")
    ctx, N, C, HW = _reduce_context(dy, x, mean, invstd, gamma, want, mask, layout, None, stream, "gamma")
    if count is None:
        count = max(N * HW, 1)
    # the sums are not there yet: validate the second pass's other arguments with placeholders (mean)
    _elemt_context(dy, x, mean, invstd, gamma, mean, mean, count, mask, layout, residual, None, None, stream, "gamma")
    sdy, sdx, gw, gb = _reduce_run(ctx, want, layout, N, C, HW, None)
    ectx, N, C, HW, count_val, count_cs = _elemt_context(dy, x, mean, invstd, gamma, sdy, sdx, count, mask,
                                                         layout, residual, None, None, stream)
    r = _elemt_run(ectx, layout, N, C, HW, count, count_val, count_cs, residual)
    if residual:
        return r[0], gw, gb, r[1]
    return r, gw, gb

