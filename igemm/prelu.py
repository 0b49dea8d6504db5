"""PReLU: ``prelu(x, alpha)`` and ``prelu_backward(dy, x, alpha) -> (dx, dalpha)``.

``torch.nn.functional.prelu`` semantics: ``y = x if x > 0 else alpha[c] * x``, ``alpha`` one shared value (a
number or a 1-element array) or one per channel; the channel is dim 1 (``layout="NCHW"``, any rank >= 2) or
the last dim (``layout="NHWC"``). The kernels (``csrc/prelu.cuh``) see ``x[O, C, S]`` (NCHW: ``O = N``,
``S = H*W``; NHWC: ``O = N*H*W``, ``S = 1``) and move 16-byte packs whenever the contiguous extent and the
pointers allow it: one alpha load per pack when a pack lies in one channel (NCHW, ``S % pack == 0``) or covers
consecutive channels (NHWC, ``C % pack == 0``), a per-element channel walk otherwise.

The backward reduces ``dalpha`` per channel in fp32 and deterministically (fixed per-block partials, then
a second kernel summing them in order): the same bits on every run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from . import _kernel, _runtime, reference
from ._checks import (check_aligned, check_contiguous, check_dtype, check_layout, check_output, check_shape,
                      check_stream, is_real, require_array)
from ._dispatch import CallContext
from ._kernel import ParamSpec
from ._runtime import DTYPE_CTYPE, DTYPE_SIZES, FLOAT_DTYPES, keeps_current_context
from .index_add import _round_alpha

__all__ = ["prelu", "prelu_backward", "PreluConfig", "forward_config", "LAYOUTS", "all_stubs", "precompile"]

LAYOUTS = ("NCHW", "NHWC")
_THREADS = 256
_TWO31 = 2 ** 31
_MODES = {"scalar_val": 0, "scalar_ptr": 1, "plane": 2, "row": 3, "step": 4}

_P_FWD = [ParamSpec("x", "ptr"), ParamSpec("alpha", "ptr"), ParamSpec("y", "ptr"), ParamSpec("alpha_val", "float32"),
          ParamSpec("n", "int64"), ParamSpec("s", "int64"), ParamSpec("c", "int64"), ParamSpec("s_div", "fastdiv"),
          ParamSpec("c_div", "fastdiv"), ParamSpec("s_div64", "int64"), ParamSpec("c_div64", "int64")]
_P_FLAT = [ParamSpec("dy", "ptr"), ParamSpec("x", "ptr"), ParamSpec("alpha", "ptr"), ParamSpec("dx", "ptr"),
           ParamSpec("partial", "ptr"), ParamSpec("alpha_val", "float32"), ParamSpec("n", "int64")]
_P_CHAN = [ParamSpec("dy", "ptr"), ParamSpec("x", "ptr"), ParamSpec("alpha", "ptr"), ParamSpec("dx", "ptr"),
           ParamSpec("partial", "ptr"), ParamSpec("outer", "int64"), ParamSpec("s", "int64"), ParamSpec("c", "int64")]
_P_FIN = [ParamSpec("partial", "ptr"), ParamSpec("dalpha", "ptr"), ParamSpec("g", "int32"), ParamSpec("c", "int64")]


# ------------------------------------------------------------------------------------------ config
@dataclass(frozen=True)
class PreluConfig:
    """Forward kernel: ``mode`` (``scalar_val``/``scalar_ptr``/``plane``/``row``/``step``, see
    ``csrc/prelu.cuh``), ``vec`` elements per pack, ``wide`` (64-bit divisions: ``n >= 2**31``)."""
    mode: str
    vec: int
    wide: bool = False

    def __post_init__(self):
        if self.mode not in _MODES or self.vec not in (1, 2, 4, 8):
            raise ValueError(f"bad PreluConfig {self}")


def _vec_aligned(dtype: str, *ptrs: int) -> int:
    size = DTYPE_SIZES[dtype]
    v = 16 // size
    while v > 1 and any(p % (v * size) for p in ptrs):
        v //= 2
    return v


def forward_config(n: int, channels: int, inner: int, dtype: str, *, alpha_kind: str, vec: int,
                   alpha_dtype: str = "float32", alpha_ptr: int = 0) -> PreluConfig:
    """Pure rule. ``alpha_kind``: ``"value"`` (a number), ``"one"`` (1-element array) or ``"channel"``;
    ``vec``: the pack the x/y pointers allow (16 bytes at most)."""
    wide = n >= _TWO31
    if alpha_kind == "value":
        return PreluConfig("scalar_val", vec, wide)
    if alpha_kind == "one":
        return PreluConfig("scalar_ptr", vec, wide)
    if inner % vec == 0:
        return PreluConfig("plane", vec, wide)
    if inner == 1 and channels % vec == 0 and alpha_ptr % (vec * DTYPE_SIZES[alpha_dtype]) == 0:
        return PreluConfig("row", vec, wide)
    return PreluConfig("step", vec, wide)


def _next_pow2(v: int) -> int:
    return 1 << max(0, (int(v) - 1).bit_length())


def _sms(device_id: int) -> int:
    return _runtime.device_props(device_id).multiprocessor_count


def _per_sm(kernel, default: int = 8) -> int:
    try:
        return max(1, int(kernel.occupancy.max_active_blocks_per_multiprocessor(_THREADS, 0)))
    except Exception:  # pragma: no cover - older cuda.core
        return default


@lru_cache(maxsize=None)
def _stub(kind: str, dtype: str, adtype: str, vec: int, mode: int, wide: bool) -> str:
    T, TA = DTYPE_CTYPE.get(dtype, "float"), DTYPE_CTYPE.get(adtype, "float")
    ns = "igemm::prelu::"
    if kind == "forward":
        params, body = _P_FWD, f"{ns}forward<{T}, {TA}, {vec}, {mode}, {'true' if wide else 'false'}>(p);"
    elif kind == "backward_flat":
        params, body = _P_FLAT, f"{ns}backward_flat<{T}, {TA}, {vec}, {mode}>(p);"
    elif kind in ("backward_plane", "backward_row"):
        params, body = _P_CHAN, f"{ns}{kind}<{T}, {TA}, {vec}>(p);"
    elif kind == "backward_finish":
        params, body = _P_FIN, f"{ns}backward_finish<{TA}>(p);"
    else:  # pragma: no cover
        raise ValueError(kind)
    return _kernel.render_kernel(include="prelu.cuh", entry=f"igemm_prelu_{kind}", params=params, threads=_THREADS,
                                 body=body)


def all_stubs() -> list[tuple[str, str]]:
    """``(cache name, stub)`` of every kernel instance this module can launch (to precompile a cache)."""
    out = {}
    for dt in FLOAT_DTYPES:
        for adt in sorted({dt, "float32"}):
            out[_stub("backward_finish", "float32", adt, 1, 0, False)] = "prelu_backward_finish"
            for v in (1, 2, 4) if dt == "float32" else (1, 2, 4, 8):
                for mode in _MODES.values():
                    for wide in (False, True):
                        out[_stub("forward", dt, adt, v, mode, wide)] = "prelu_forward"
                for mode in (0, 1):
                    out[_stub("backward_flat", dt, adt, v, mode, False)] = "prelu_backward_flat"
                for kind in ("backward_plane", "backward_row"):
                    out[_stub(kind, dt, adt, v, 0, False)] = f"prelu_{kind}"
    return [(name, stub) for stub, name in out.items()]


def precompile(arch: str = "sm_90a", workers: int = 8) -> int:
    """Compile every instance into the kernel cache (``$IGEMM_CACHE_DIR``), ``workers`` nvcc at a time."""
    from . import _build
    return _build.compile_many(all_stubs(), arch, workers)


def _load(kind: str, dtype: str, adtype: str, vec: int, mode: int, wide: bool, device_id: int):
    return _kernel.load(_stub(kind, dtype, adtype, vec, mode, wide), f"prelu_{kind}", f"igemm_prelu_{kind}",
                        device_id)


# ------------------------------------------------------------------------------------------ validation
@dataclass(frozen=True)
class _Geom:
    outer: int
    channels: int     # 1 for a shared alpha
    inner: int
    n: int
    alpha_kind: str   # "value" | "one" | "channel"


def _is_number(a) -> bool:
    return is_real(a)


def _geometry(tx, ta, alpha, layout: str, name: str = "x") -> _Geom:
    shape = tuple(tx.shape)
    n = tx.numel
    axis = reference.prelu_channel_axis(len(shape), layout)
    if ta is None:
        if not _is_number(alpha):
            got = "None" if alpha is None else type(alpha).__name__
            raise TypeError(f"alpha: expected a real number or an array, got {got}")
        return _Geom(1, 1, n, n, "value")
    check_contiguous(ta, "alpha")
    check_aligned(ta, "alpha")
    if ta.numel == 1:
        return _Geom(1, 1, n, n, "one")
    if axis is None or ta.numel != shape[axis]:
        chan = "no channel dim (below 2-D): alpha must have 1 element" if axis is None else \
            f"{shape[axis]} channels (dim {axis}, layout {layout})"
        raise ValueError(f"alpha: {ta.numel} elements do not fit {name} of shape {shape}: {chan}")
    c = shape[axis]
    if layout == "NCHW":
        outer, inner = shape[0], math.prod(shape[2:]) if len(shape) > 2 else 1
    else:
        outer, inner = math.prod(shape[:-1]), 1
    return _Geom(outer, c, inner, n, "channel")


def _check_x(t, name: str) -> None:
    check_dtype(t, name, FLOAT_DTYPES)
    check_contiguous(t, name)
    check_aligned(t, name)


def _check_alpha_dtype(ta, dtype: str) -> None:
    if ta is not None and ta.dtype not in (dtype, "float32"):
        raise TypeError(f"alpha: dtype {ta.dtype} is not supported with x of {dtype} (expected {dtype} or float32)")


# ------------------------------------------------------------------------------------------ forward
@keeps_current_context
def prelu(x, alpha, *, layout: str = "NCHW", out=None, stream=None):
    """``y = x if x > 0 else alpha * x``, ``alpha`` shared (a number or 1 element) or per channel.

    ``x``: contiguous fp32/fp16/bf16; channels on dim 1 (``layout="NCHW"``, e.g. ``[N, C, H, W]``, any rank >= 2)
    or last (``layout="NHWC"``); below 2-D only a shared alpha fits (as in PyTorch). ``alpha``: a number, or an
    array of 1 or C elements, of x's dtype or float32 (the same framework as ``x``). ``out``: optional output
    (may be ``x`` itself). Computed in fp32, rounded once.

    >>> import numpy as np, igemm
    >>> igemm.prelu(np.array([[-2., 3.], [4., -1.]], np.float32), np.array([0.5, 0.25], np.float32)).tolist()
    [[-1.0, 3.0], [4.0, -0.25]]
    """
    require_array(x, "x")
    check_layout(layout)
    check_stream(stream)
    arr_alpha = None if _is_number(alpha) else alpha
    ctx = CallContext({"x": x, "alpha": arr_alpha, "out": out}, stream)
    tx, ta = ctx.views["x"], ctx.views.get("alpha")
    _check_x(tx, "x")
    _check_alpha_dtype(ta, tx.dtype)
    g = _geometry(tx, ta, alpha, layout)
    if out is not None:                          # out may be x itself (exactly in place)
        check_output(ctx.views["out"], "out", shape=tx.shape, dtypes=(tx.dtype,), inputs={"x": tx, "alpha": ta},
                     alias_ok=("x",))
    aval = _round_alpha(float(alpha), tx.dtype) if g.alpha_kind == "value" else 0.0
    if ctx.backend == "numpy":
        xa = np.asarray(x)
        res = reference.prelu(xa, aval if ta is None else np.asarray(alpha), layout).astype(xa.dtype)
        if out is not None:
            np.asarray(out)[...] = res
            return out
        return res
    ctx.stream  # resolve (and validate) the stream before anything is allocated or launched
    d_x = ctx.device_view("x")
    d_a = ctx.device_view("alpha") if ta is not None else None
    if out is None:
        out_obj, d_y = ctx.empty(tx.shape, tx.dtype)
    else:
        out_obj, d_y = out, ctx.device_view("out")
    if g.n:
        adtype = ta.dtype if ta is not None else tx.dtype
        vec = _vec_aligned(tx.dtype, d_x.ptr, d_y.ptr)
        cfg = forward_config(g.n, g.channels, g.inner, tx.dtype, alpha_kind=g.alpha_kind, vec=vec, alpha_dtype=adtype,
                             alpha_ptr=d_a.ptr if d_a is not None else 0)
        launcher, args = _forward_plan(ctx.device_id, tx.dtype, adtype, cfg, g.n, g.channels, g.inner)
        launcher(ctx.stream, args(d_x.ptr, d_a.ptr if d_a is not None else 0, d_y.ptr, aval))
    if out is not None:
        ctx.copy_back("out", d_y)
        return out
    return ctx.finish(out_obj)


class _Args:
    """Arguments packed once; ``args(*ptrs, alpha_val)`` fills the pointer slots (first) and alpha_val."""
    __slots__ = ("base", "ptr_slots", "val_slot")

    def __init__(self, params, static: dict, ptr_names: tuple, val_name: str | None):
        self.base = _kernel.pack_args(params, static)
        pos, where = 0, {}
        for p in params:
            where[p.name] = pos
            pos += 3 if p.ctype == "fastdiv" else 1
        self.ptr_slots = tuple(where[n] for n in ptr_names)
        self.val_slot = where[val_name] if val_name else None

    def __call__(self, *values) -> "_kernel.PackedArgs":
        a = self.base.copy()
        for i, v in zip(self.ptr_slots, values):
            a.u64[i] = int(v)
        if self.val_slot is not None:
            a.f32[2 * self.val_slot] = float(values[len(self.ptr_slots)])
        return a


@lru_cache(maxsize=256)
def _forward_plan(device_id, dtype, adtype, cfg: PreluConfig, n, channels, inner):
    v, mode = cfg.vec, cfg.mode
    k = _load("forward", dtype, adtype, v, _MODES[mode], cfg.wide, device_id)
    s_div = c_div = 1
    if not cfg.wide:
        if mode == "plane":
            s_div, c_div = inner // v, channels
        elif mode == "row":
            c_div = channels // v
        elif mode == "step":
            s_div, c_div = inner, channels
    static = {"n": n, "s": inner, "c": channels, "s_div": s_div, "c_div": c_div, "s_div64": max(1, inner // v),
              "c_div64": max(1, channels // v)}
    work = -(-(n // v) // 2) if n // v else 1           # threads: 2 packs each (U in forward)
    grid = max(1, min(_sms(device_id) * _per_sm(k), -(-work // _THREADS)))
    return (_kernel.Launcher(k, grid, _THREADS),
            _Args(_P_FWD, static, ("x", "alpha", "y"), "alpha_val"))


# ------------------------------------------------------------------------------------------ backward
@dataclass(frozen=True)
class _BwdPlan:
    kind: str
    launcher: object
    args: _Args
    fin_launcher: object
    fin_args: _Args
    partials: int


def _bwd_vec(dtype: str, extent: int, ptrs) -> int:
    v = _vec_aligned(dtype, *ptrs)
    while v > 1 and extent % v:
        v //= 2
    return v


@lru_cache(maxsize=256)
def _backward_plan(device_id, dtype, adtype, g: _Geom, vec: int) -> _BwdPlan:
    sms = _sms(device_id)
    mode = _MODES["scalar_val" if g.alpha_kind == "value" else "scalar_ptr"]
    if g.alpha_kind != "channel":
        k = _load("backward_flat", dtype, adtype, vec, mode, False, device_id)
        grid = max(1, min(sms * _per_sm(k), -(-max(1, g.n // vec) // _THREADS)))
        launcher = _kernel.Launcher(k, grid, _THREADS)
        args = _Args(_P_FLAT, {"n": g.n}, ("dy", "x", "alpha", "dx", "partial"), "alpha_val")
        kind, parts, chans = "flat", grid, 1
    elif g.inner > 1:
        k = _load("backward_plane", dtype, adtype, vec, 0, False, device_id)
        tx = min(_THREADS, _next_pow2(g.inner // vec))
        ty = _THREADS // tx
        gy = max(1, min(-(-g.outer // ty), -(-(sms * _per_sm(k)) // g.channels), 65535))
        launcher = _kernel.Launcher(k, (g.channels, gy), (tx, ty))
        args = _Args(_P_CHAN, {"outer": g.outer, "s": g.inner, "c": g.channels}, ("dy", "x", "alpha", "dx", "partial"),
                     None)
        kind, parts, chans = "plane", gy, g.channels
    else:
        k = _load("backward_row", dtype, adtype, vec, 0, False, device_id)
        cv = g.channels // vec
        tx = min(_THREADS, _next_pow2(cv))
        ty = _THREADS // tx
        tiles = -(-cv // tx)
        gy = max(1, min(-(-g.outer // ty), -(-(sms * _per_sm(k)) // tiles), 65535))
        launcher = _kernel.Launcher(k, (tiles, gy), (tx, ty))
        args = _Args(_P_CHAN, {"outer": g.outer, "s": 1, "c": g.channels}, ("dy", "x", "alpha", "dx", "partial"), None)
        kind, parts, chans = "row", gy, g.channels
    kf = _load("backward_finish", "float32", adtype, 1, 0, False, device_id)
    fin = _kernel.Launcher(kf, max(1, min(sms * 4, -(-chans // _THREADS))), _THREADS)
    fin_args = _Args(_P_FIN, {"g": parts, "c": chans}, ("partial", "dalpha"), None)
    return _BwdPlan(kind, launcher, args, fin, fin_args, parts * chans)


@keeps_current_context
def prelu_backward(dy, x, alpha, *, layout: str = "NCHW", stream=None):
    """``(dx, dalpha)`` of :func:`prelu`: ``dx = dy if x > 0 else alpha * dy``, ``dalpha[c] = sum over channel
    c of (0 if x > 0 else x * dy)`` (PyTorch's gradient of the weight), reduced in fp32, deterministically.

    ``dalpha`` has ``alpha``'s shape and dtype (shape ``(1,)`` and x's dtype when ``alpha`` is a number).

    >>> import numpy as np, igemm
    >>> x = np.array([[-2., 3.], [4., -1.]], np.float32)
    >>> dx, da = igemm.prelu_backward(np.ones_like(x), x, np.array([0.5, 0.25], np.float32))
    >>> dx.tolist(), da.tolist()
    ([[0.5, 1.0], [1.0, 0.25]], [-2.0, -1.0])
    """
    require_array(dy, "dy")
    require_array(x, "x")
    check_layout(layout)
    check_stream(stream)
    arr_alpha = None if _is_number(alpha) else alpha
    ctx = CallContext({"dy": dy, "x": x, "alpha": arr_alpha}, stream)
    tdy, tx, ta = ctx.views["dy"], ctx.views["x"], ctx.views.get("alpha")
    _check_x(tx, "x")
    check_dtype(tdy, "dy", (tx.dtype,))
    check_shape(tdy, "dy", tx.shape)
    _check_x(tdy, "dy")
    _check_alpha_dtype(ta, tx.dtype)
    g = _geometry(tx, ta, alpha, layout)
    adtype = ta.dtype if ta is not None else tx.dtype
    da_shape = tuple(ta.shape) if ta is not None else (1,)
    aval = _round_alpha(float(alpha), tx.dtype) if g.alpha_kind == "value" else 0.0
    if ctx.backend == "numpy":
        xa = np.asarray(x)
        a_np = aval if ta is None else np.asarray(alpha)
        dx, da = reference.prelu_backward(np.asarray(dy), xa, a_np, layout)
        da_dtype = np.asarray(alpha).dtype if ta is not None else xa.dtype
        return dx.astype(xa.dtype), da.reshape(da_shape).astype(da_dtype)
    ctx.stream  # resolve (and validate) the stream before anything is allocated or launched
    d_dy, d_x = ctx.device_view("dy"), ctx.device_view("x")
    d_a = ctx.device_view("alpha") if ta is not None else None
    dx_obj, d_dx = ctx.empty(tx.shape, tx.dtype)
    da_obj, d_da = ctx.empty(da_shape, adtype, name="dalpha")
    if g.n == 0 or g.channels == 0:
        nbytes = math.prod(da_shape) * DTYPE_SIZES[adtype]
        if nbytes:
            _runtime.memset_d8(d_da.ptr, 0, nbytes, ctx.stream)
        return ctx.finish(dx_obj), ctx.finish(da_obj)
    # pack: 16 bytes where the pointers allow, shrunk until it divides the extent the kernel vectorises
    extent = 16 if g.alpha_kind != "channel" else (g.inner if g.inner > 1 else g.channels)
    vec = _bwd_vec(tx.dtype, extent, (d_dy.ptr, d_x.ptr, d_dx.ptr))
    plan = _backward_plan(ctx.device_id, tx.dtype, adtype, g, vec)
    part_obj, d_part = ctx.workspace((plan.partials,), "float32")
    vals = (d_dy.ptr, d_x.ptr, d_a.ptr if d_a is not None else 0, d_dx.ptr, d_part.ptr)
    plan.launcher(ctx.stream, plan.args(*vals, aval) if plan.kind == "flat" else plan.args(*vals))
    plan.fin_launcher(ctx.stream, plan.fin_args(d_part.ptr, d_da.ptr))
    del part_obj
    return ctx.finish(dx_obj), ctx.finish(da_obj)
