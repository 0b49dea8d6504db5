"""Argument checks and output plumbing of the BatchNorm family (:mod:`igemm.norm`, :mod:`igemm.syncbn`).

Every function of the family validates all of its arguments -- outputs and in-place arguments (``out``,
``mask_out``, running statistics) included: writable, dtype, shape, contiguity, alignment, no overlap
with any input or with each other -- before it writes or launches anything, on both backends. The rules
and messages are :mod:`igemm._checks`'s.
"""
from __future__ import annotations

import numpy as np

from ._checks import (check_aligned, check_contiguous, check_disjoint, check_dtype, check_mask, check_output,
                      check_real, is_real, require_array)
from ._runtime import FLOAT_DTYPES

__all__ = ["geometry", "check_act", "check_like", "check_vec", "check_running", "out_dict", "check_outs",
           "check_momentum", "check_count", "check_partials", "required", "mask_arg", "alloc", "ret", "np_ret", "host",
           "CNT_DTYPES"]

CNT_DTYPES = ("float32", "float64", "int32", "int64")


def geometry(t, layout: str, name: str = "x") -> tuple[int, int, int]:
    """(N, C, HW) of an activation tensor in ``layout``."""
    if t.ndim < 2:
        want = "(N, C, ...)" if layout == "NCHW" else "(N, ..., C)"
        raise ValueError(f"{name}: expected at least 2 dimensions {want} for layout {layout}, got shape "
                         f"{tuple(t.shape)}")
    shape = tuple(int(s) for s in t.shape)
    if layout == "NCHW":
        N, C, rest = shape[0], shape[1], shape[2:]
    else:
        N, C, rest = shape[0], shape[-1], shape[1:-1]
    HW = 1
    for s in rest:
        HW *= s
    if C < 1:
        raise ValueError(f"{name}: has no channels (shape {shape}, layout {layout}: C = {C})")
    if C >= 2 ** 31:
        raise ValueError(f"{name}: {C} channels is more than igemm supports (< 2**31)")
    return N, C, HW


def check_act(t, name: str, layout: str) -> tuple[int, int, int]:
    """An activation: fp32/fp16/bf16, contiguous, aligned; returns (N, C, HW)."""
    check_dtype(t, name, FLOAT_DTYPES)
    check_contiguous(t, name)
    check_aligned(t, name)
    return geometry(t, layout, name)


def check_like(t, name: str, ref, ref_name: str) -> None:
    """An activation shaped and typed like ``ref`` (dy like x, a residual like x)."""
    if tuple(t.shape) != tuple(ref.shape):
        raise ValueError(f"{name}: shape {tuple(t.shape)} differs from {ref_name}'s {tuple(ref.shape)}")
    if t.dtype != ref.dtype:
        raise TypeError(f"{name}: dtype {t.dtype} differs from {ref_name}'s {ref.dtype}")
    check_contiguous(t, name)
    check_aligned(t, name)


def check_vec(ctx, name: str, C: int, layout: str, dtypes=("float32",)) -> None:
    """A per-channel vector, if given: 1-D, C elements, contiguous, aligned, fp32."""
    t = ctx.views.get(name)
    if t is None:
        return
    check_dtype(t, name, dtypes)
    if tuple(t.shape) != (C,):
        raise ValueError(f"{name}: expected shape ({C},) (one value per channel; C = {C} with layout {layout}), "
                         f"got {tuple(t.shape)}")
    check_contiguous(t, name)
    check_aligned(t, name)


def check_running(ctx, running_mean, running_var, C: int, layout: str, inputs=("x",)) -> None:
    """Running statistics updated in place: both or neither, fp32 [C], writable, apart from the inputs and
    from each other."""
    if (running_mean is None) != (running_var is None):
        missing = "running_var" if running_var is None else "running_mean"
        raise ValueError(f"{missing}: None while the other is given (running_mean and running_var: give both "
                         f"or neither)")
    if running_mean is None:
        return
    ins = {k: ctx.views.get(k) for k in inputs}
    for k in ("running_mean", "running_var"):
        check_vec(ctx, k, C, layout)
        check_output(ctx.views[k], k, inputs=ins)
    check_disjoint({k: ctx.views[k] for k in ("running_mean", "running_var")})


def out_dict(out, names: tuple, what: str) -> dict:
    """``out=(a, b, ...)`` as ``{"out.a": a, ...}`` (None entries: allocated)."""
    if out is None:
        return {}
    if not isinstance(out, (tuple, list)) or len(out) != len(names):
        raise TypeError(f"out: expected None or a tuple of {len(names)} arrays ({', '.join(names)}) for {what}, "
                        f"got {type(out).__name__}" + (f" of length {len(out)}" if isinstance(out, (tuple, list))
                                                       else ""))
    return {f"out.{n}": o for n, o in zip(names, out) if o is not None}


def check_outs(ctx, keys, shape, dtypes, inputs=(), also=()) -> None:
    """The given ``out.*`` arrays among ``keys``: writable, of ``dtypes`` and ``shape``, contiguous, aligned,
    apart from every input of ``inputs`` and from each other and the outputs ``also`` (other in-place
    arguments written by the same call)."""
    ins = {k: ctx.views.get(k) for k in inputs}
    for k in keys:
        t = ctx.views.get(k)
        if t is not None:
            check_output(t, k, shape=shape, dtypes=dtypes, inputs=ins)
    check_disjoint({k: ctx.views.get(k) for k in (*keys, *also)})


def check_momentum(m) -> float:
    return check_real(m, "momentum", lo=0.0, hi=1.0)


def check_count(ctx, count, C: int):
    """``count`` of the backward: a number > 0 or a 1- or C-element fp32 array. Returns (value, cs, array?)."""
    if "count" not in ctx.views:
        if count is None:
            raise TypeError(f"count: expected a number or an fp32 array of 1 or {C} elements, got None")
        if not is_real(count):
            raise TypeError(f"count: expected a number or an fp32 array of 1 or {C} elements, got "
                            f"{type(count).__name__}")
        return check_real(count, "count", lo=0.0, lo_open=True), 0, False
    t = ctx.views["count"]
    check_dtype(t, "count", ("float32",))
    check_contiguous(t, "count")
    check_aligned(t, "count")
    n = t.numel
    if n not in (1, C) or t.ndim > 1:
        raise ValueError(f"count: expected 1 or {C} elements (global count, per channel or one), got shape "
                         f"{tuple(t.shape)}")
    return 0.0, (1 if n == C and C > 1 else 0), True


def check_partials(ctx, mname: str, vname: str, cname: str):
    """Validate [W, C] means/vars and [W] or [W, C] counts; returns (W, C, cnt_rs, cnt_cs)."""
    tm, tv, tc = ctx.views[mname], ctx.views[vname], ctx.views[cname]
    check_dtype(tm, mname, ("float32", "float64"))
    if tm.ndim != 2:
        raise ValueError(f"{mname}: expected a 2-D array [world_size, C], got shape {tuple(tm.shape)}")
    W, C = (int(s) for s in tm.shape)
    if C < 1:
        raise ValueError(f"{mname}: has no channels (shape {tuple(tm.shape)})")
    check_contiguous(tm, mname)
    check_aligned(tm, mname)
    check_like(tv, vname, tm, mname)
    check_dtype(tc, cname, CNT_DTYPES)
    check_contiguous(tc, cname)
    check_aligned(tc, cname)
    if tuple(tc.shape) == (W,):
        return W, C, 1, 0
    if tuple(tc.shape) == (W, C):
        return W, C, C, 1
    raise ValueError(f"{cname}: expected shape ({W},) (one count per rank) or ({W}, {C}), got {tuple(tc.shape)}")


def required(values: dict) -> None:
    """``None`` where an array belongs: TypeError naming the first such argument."""
    for name, v in values.items():
        require_array(v, name)


def mask_arg(ctx, name: str, numel: int) -> None:
    if name in ctx.views:
        check_mask(ctx.views[name], name, numel)


# ------------------------------------------------------------------------------------------- outputs
def alloc(ctx, key: str, shape, dtype: str):
    """(object, device Tensor, given) for an output: the caller's ``out`` if given, else a fresh one."""
    if key in ctx.views:
        return ctx.views[key].obj, ctx.device_view(key), True
    obj, t = ctx.empty(shape, dtype)
    return obj, t, False


def ret(ctx, key: str, out):
    obj, t, given = out
    if given:
        ctx.copy_back(key, t)
        return obj
    return ctx.finish(obj)


def np_ret(value, out_obj, dtype):
    """numpy backend: cast ``value`` into the caller's ``out`` (returned) or a new array of ``dtype``."""
    if out_obj is not None:
        o = np.asarray(out_obj)
        o[...] = np.asarray(value).astype(o.dtype)
        return out_obj
    return np.asarray(value).astype(dtype)


def host(a):
    return None if a is None else np.asarray(a)

