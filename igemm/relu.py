"""ReLU-mask kernels: ``relu_backward(dy, mask)`` and ``relu_mask(y)``.

The mask is ARCHITECTURE.md's format: ``uint32[ceil(L/32)]`` (``int32`` for torch, which lacks a full
uint32 dtype; same bits), bit ``i % 32`` of word ``i // 32`` set exactly when element ``i`` of the
output, in memory order, is > 0. The conv epilogue, ``batch_norm_relu`` and :func:`relu_mask` all write it.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from . import _kernel, reference
from ._checks import (check_aligned, check_contiguous, check_dtype, check_mask, check_output, check_stream,
                      mask_words, require_array)
from ._dispatch import CallContext
from ._kernel import ParamSpec
from ._runtime import DTYPE_CTYPE, FLOAT_DTYPES, keeps_current_context

__all__ = ["relu_backward", "relu_mask", "mask_words", "mask_dtype_for"]

_BWD_PARAMS = [ParamSpec("dy", "ptr"), ParamSpec("mask", "ptr"), ParamSpec("dx", "ptr"), ParamSpec("n", "int64")]
_MASK_PARAMS = [ParamSpec("y", "ptr"), ParamSpec("mask", "ptr"), ParamSpec("n", "int64")]
_THREADS = 256


def mask_dtype_for(kind: str) -> str:
    """The mask's dtype for outputs of a framework: torch has no full uint32 dtype (same bits as int32)."""
    return "int32" if kind == "torch" else "uint32"


@lru_cache(maxsize=None)
def _stub(func: str, dtype: str, vec: int) -> str:
    params = _BWD_PARAMS if func == "relu_backward" else _MASK_PARAMS
    return _kernel.render_kernel(include="relu.cuh", entry=f"igemm_{func}", params=params, threads=_THREADS,
                                 body=f"igemm::relu::{func}<{DTYPE_CTYPE[dtype]}, {vec}>(p);")


def _vec(dtype: str, *ptrs: int) -> int:
    size = 2 if dtype in ("float16", "bfloat16") else 4
    return 16 // size if all(p % 16 == 0 for p in ptrs) else 1


@lru_cache(maxsize=256)
def _launcher(func: str, dtype: str, vec: int, device_id: int, grid: int, pdl: bool = False):
    k = _kernel.load(_stub(func, dtype, vec), func, f"igemm_{func}", device_id)
    return _kernel.Launcher(k, grid, _THREADS, pdl=pdl)


def _grid(device_id: int, work_items: int) -> int:
    from ._runtime import device_props
    sms = device_props(device_id).multiprocessor_count
    return max(1, min(sms * 8, (work_items + _THREADS - 1) // _THREADS))


@keeps_current_context
def relu_backward(dy, mask, *, out=None, stream=None):
    """Gradient of ReLU from its 1-bit mask: ``dx = dy`` where the bit is set, else ``0``.

    A select, not a product: ``inf``/``NaN`` in ``dy`` where the bit is 0 give 0. For Add-ReLU the same
    ``dx`` is the gradient of both branches. ``dy`` contiguous fp32/fp16/bf16, ``mask`` as written by the
    forward (see module doc).

    >>> import numpy as np, igemm
    >>> dy = np.array([1., -2., 3., 4.], np.float32)
    >>> m = igemm.relu_mask(np.array([0.5, 0., -1., 2.], np.float32))
    >>> igemm.relu_backward(dy, m).tolist()
    [1.0, 0.0, 0.0, 4.0]
    """
    require_array(dy, "dy")
    require_array(mask, "mask")
    check_stream(stream)
    ctx = CallContext({"dy": dy, "mask": mask, "out": out}, stream)
    t_dy, t_mask = ctx.views["dy"], ctx.views["mask"]
    check_dtype(t_dy, "dy", FLOAT_DTYPES)
    check_contiguous(t_dy, "dy")
    check_aligned(t_dy, "dy")
    check_mask(t_mask, "mask", t_dy.numel)
    if out is not None:                          # exactly in place (out is dy) is fine
        check_output(ctx.views["out"], "out", shape=t_dy.shape, dtypes=(t_dy.dtype,),
                     inputs={"dy": t_dy, "mask": t_mask}, alias_ok=("dy",))
    if ctx.backend == "numpy":
        res = reference.relu_backward(np.asarray(dy), np.asarray(mask).view(np.uint32)).astype(np.asarray(dy).dtype)
        if out is not None:
            np.asarray(out)[...] = res
            return out
        return res
    d_dy, d_mask = ctx.device_view("dy"), ctx.device_view("mask")
    if out is None:
        out_obj, d_out = ctx.empty(t_dy.shape, t_dy.dtype)
    else:
        out_obj, d_out = out, ctx.device_view("out")
    n = t_dy.numel
    if n:
        vec = _vec(t_dy.dtype, d_dy.ptr, d_out.ptr)
        grid = _grid(ctx.device_id, max(n // vec // 8, 1))   # one wave, 8 packs in flight a thread
        _launcher("relu_backward", t_dy.dtype, vec, ctx.device_id, grid)(ctx.stream, _kernel.bind_args(
            _BWD_PARAMS, {"dy": d_dy.ptr, "mask": d_mask.ptr, "dx": d_out.ptr, "n": n}))
    if out is not None:
        ctx.copy_back("out", d_out)
        return out
    return ctx.finish(out_obj)


@keeps_current_context
def relu_mask(y, *, out=None, stream=None):
    """Pack ``y > 0`` into the 1-bit ReLU mask (``uint32[ceil(numel/32)]``; ``int32`` for torch).

    Equal, bit for bit, to the mask a fused ReLU epilogue writes for the same output ``y``.
    """
    require_array(y, "y")
    check_stream(stream)
    ctx = CallContext({"y": y, "out": out}, stream)
    t_y = ctx.views["y"]
    check_dtype(t_y, "y", FLOAT_DTYPES)
    check_contiguous(t_y, "y")
    check_aligned(t_y, "y")
    words = mask_words(t_y.numel)
    if out is not None:
        t_out = ctx.views["out"]
        check_mask(t_out, "out", t_y.numel)
        check_output(t_out, "out", inputs={"y": t_y})
    if ctx.backend == "numpy":
        res = reference.pack_mask(np.asarray(y, dtype=np.float64) > 0)
        if out is not None:
            np.asarray(out).view(np.uint32)[:words] = res
            return out
        return res
    d_y = ctx.device_view("y")
    if out is None:
        out_obj, d_out = ctx.empty((words,), mask_dtype_for(ctx.kind))
    else:
        out_obj, d_out = out, ctx.device_view("out")
    launch_mask(ctx.device_id, ctx.stream, t_y.dtype, d_y.ptr, d_out.ptr, t_y.numel)
    if out is not None:
        ctx.copy_back("out", d_out)
        return out
    return ctx.finish(out_obj)


def launch_mask(device_id: int, stream, dtype: str, y_ptr: int, mask_ptr: int, n: int,
                after_kernel: bool = False) -> None:
    """Launch the pack kernel (also used by the conv plan when its epilogue cannot own whole words).
    ``after_kernel``: ``y`` is the output of the kernel just launched on ``stream``; on sm_90+ the pack
    kernel launches as its programmatic dependent (PDL: it waits in the kernel, not behind the launch)."""
    if n == 0:
        return
    vec = _vec(dtype, y_ptr)
    chunks = (mask_words(n) * 32 + 32 * vec - 1) // (32 * vec)
    grid = _grid(device_id, chunks * 32)
    pdl = after_kernel and _pdl_ok(device_id)
    launcher = _launcher("relu_mask", dtype, vec, device_id, grid, pdl)
    args = _kernel.bind_args(_MASK_PARAMS, {"y": y_ptr, "mask": mask_ptr, "n": n})
    if pdl:
        launcher.launch_after(stream, args)
    else:
        launcher(stream, args)


@lru_cache(maxsize=None)
def _pdl_ok(device_id: int) -> bool:
    """Programmatic dependent launch: sm_90 and later."""
    from ._runtime import device
    return device(device_id).compute_capability.major >= 9
