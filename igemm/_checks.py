"""Argument checks shared by every family: one rule per kind of argument, one exception type per failure.

* ``None`` or a non-array where an array belongs, a wrong dtype, a wrong Python type (a shape given as a
  float, a flag given as a string) -> ``TypeError``;
* a wrong shape, layout, contiguity or alignment, arrays that overlap, an output that cannot be written,
  a value out of range -> ``ValueError`` (:class:`IndexArgumentError`, also an ``IndexError``, where
  PyTorch raises ``IndexError``: a dim or an index out of range);
* a combination not supported yet -> ``NotImplementedError``.

Every message starts with the argument's name (``"out.var: expected shape (3,), got (4,)"``). A family
validates every argument, outputs included, before it writes anything or launches anything.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from ._runtime import Tensor

__all__ = ["IndexArgumentError", "require_array", "check_dtype", "check_contiguous", "check_shape", "check_aligned",
           "check_writable", "check_no_overlap", "check_output", "check_disjoint", "check_real", "check_eps",
           "check_int", "check_shape_arg", "check_flag", "check_layout", "check_stream", "check_mask", "mask_words",
           "is_real", "same_memory"]

LAYOUTS = ("NCHW", "NHWC")


class IndexArgumentError(ValueError, IndexError):
    """A dim or an index out of range, or an index of the wrong rank: a ``ValueError`` by igemm's rule and
    an ``IndexError`` as PyTorch raises for the same failure (as numpy's ``AxisError``)."""


# ------------------------------------------------------------------------------------------- arrays
def require_array(obj, name: str) -> None:
    """``None`` where an array belongs is a TypeError naming the argument (not a KeyError later)."""
    if obj is None:
        raise TypeError(f"{name}: expected an array, got None")


def check_dtype(t: Tensor, name: str, allowed) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported (expected {' or '.join(allowed)})")


def check_contiguous(t: Tensor, name: str) -> None:
    """Row-major contiguous (an empty array is, whatever its strides say)."""
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (shape {t.shape}, strides {t.strides} in elements); "
                         f"call .contiguous() first")


def check_shape(t: Tensor, name: str, shape) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def check_aligned(t: Tensor, name: str, nbytes: int | None = None) -> None:
    """The data pointer is a multiple of ``nbytes`` (default: the element size; kernels load whole
    elements, and numpy's unaligned views would fault on the device)."""
    n = t.itemsize if nbytes is None else nbytes
    if t.numel and t.ptr % n:
        raise ValueError(f"{name}: data pointer {t.ptr:#x} is not {n}-byte aligned")


def _read_only(t: Tensor) -> bool:
    if t.kind == "numpy":
        return not t.obj.flags.writeable
    if t.kind == "torch":
        return False
    cai = getattr(t.obj, "__cuda_array_interface__", None)
    if isinstance(cai, dict):
        data = cai.get("data")
        return bool(data[1]) if isinstance(data, tuple) and len(data) > 1 else False
    return False


def check_writable(t: Tensor, name: str) -> None:
    if _read_only(t):
        raise ValueError(f"{name}: is read-only (igemm writes its results there)")


def _span(t: Tensor) -> tuple[int, int]:
    """[lo, hi) bytes an array touches (negative strides included); empty for an empty array."""
    if t.numel == 0:
        return t.ptr, t.ptr
    lo = hi = 0
    for s, st in zip(t.shape, t.strides):
        d = (s - 1) * st
        if d < 0:
            lo += d
        else:
            hi += d
    return t.ptr + lo * t.itemsize, t.ptr + (hi + 1) * t.itemsize


def same_memory(a: Tensor, b: Tensor) -> bool:
    """``a`` and ``b`` are the same elements in the same order (an exact in-place alias)."""
    return a.ptr == b.ptr and tuple(a.shape) == tuple(b.shape) and tuple(a.strides) == tuple(b.strides) \
        and a.itemsize == b.itemsize


def check_no_overlap(a: Tensor, an: str, b: Tensor, bn: str) -> None:
    """Refuse two arrays whose memory ranges overlap (host or device alike: one semantics)."""
    if (a.kind == "numpy") == (b.kind == "numpy"):      # host and device memory never overlap
        (alo, ahi), (blo, bhi) = _span(a), _span(b)
        if alo < bhi and blo < ahi:
            raise ValueError(f"{an} and {bn} overlap in memory; igemm does not compute in place here")


def check_output(t: Tensor, name: str, *, shape=None, dtypes=None, inputs: dict | None = None,
                 alias_ok=()) -> None:
    """Everything an output must be before anything is written: writable, of ``dtypes``, of ``shape``,
    contiguous, element-aligned, and disjoint from every array of ``inputs`` (name -> Tensor; the names
    in ``alias_ok`` may be the very same memory: the exact in-place case)."""
    check_writable(t, name)
    if dtypes is not None:
        check_dtype(t, name, dtypes)
    if shape is not None:
        check_shape(t, name, shape)
    check_contiguous(t, name)
    check_aligned(t, name)
    for k, v in (inputs or {}).items():
        if v is None or (k in alias_ok and same_memory(t, v)):
            continue
        check_no_overlap(t, name, v, k)


def check_disjoint(views: dict) -> None:
    """No two of ``views`` (name -> Tensor; None entries skipped) overlap: outputs written together."""
    items = [(k, v) for k, v in views.items() if v is not None]
    for i, (an, a) in enumerate(items):
        for bn, b in items[i + 1:]:
            check_no_overlap(a, an, b, bn)


# ------------------------------------------------------------------------------------------- scalars
def is_real(value) -> bool:
    """A real number: Python int/float or a numpy integer/floating scalar; not a bool, not an array."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def check_real(value, name: str, *, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False) -> float:
    """A finite real number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``), as a Python float."""
    if not is_real(value):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    v = float(value)
    bad = not math.isfinite(v) or (lo is not None and (v <= lo if lo_open else v < lo)) \
        or (hi is not None and v > hi)
    if bad:
        lo_s = "" if lo is None else f"{'>' if lo_open else '>='} {lo:g}"
        hi_s = "" if hi is None else f"<= {hi:g}"
        rule = " and ".join(s for s in ("finite", lo_s, hi_s) if s)
        raise ValueError(f"{name}: must be {rule}, got {value!r}")
    return v


def check_eps(eps, name: str = "eps") -> float:
    """BatchNorm's eps everywhere (statistics, SyncBN, the conv epilogue): any real number, finite, >= 0."""
    return check_real(eps, name, lo=0.0)


def check_int(value, name: str, *, lo: int | None = None) -> int:
    """A Python or numpy integer (a float, even ``2.0``, or a bool is refused: TypeError)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    v = int(value)
    if lo is not None and v < lo:
        raise ValueError(f"{name}: must be >= {lo}, got {v}")
    return v


def check_shape_arg(value, name: str, ndim: int | None = None) -> tuple[int, ...]:
    """A shape given as an argument: a tuple/list of integers >= 0 (floats are refused, never truncated)."""
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"{name}: expected a tuple of ints, got {type(value).__name__}")
    dims = tuple(check_int(v, f"{name}[{i}]", lo=0) for i, v in enumerate(value))
    if ndim is not None and len(dims) != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got {len(dims)} ({dims})")
    return dims


def check_flag(value, name: str) -> bool:
    """A bool (or numpy bool): a string or a number where a flag belongs is refused, never taken as truthy."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {type(value).__name__}")
    return bool(value)


def check_layout(layout, name: str = "layout", allowed=LAYOUTS) -> str:
    if not isinstance(layout, str):
        raise TypeError(f"{name}: expected one of {', '.join(map(repr, allowed))}, got {type(layout).__name__}")
    if layout not in allowed:
        raise ValueError(f"{name}: expected {' or '.join(map(repr, allowed))}, got {layout!r}")
    return layout


def check_stream(stream) -> None:
    """``stream=``: None, a raw ``CUstream`` int or a stream object (cuda.core, torch, cupy, anything with
    ``__cuda_stream__``); checked on both backends (the numpy backend runs synchronously and uses none)."""
    if stream is None:
        return
    if isinstance(stream, (bool, np.bool_)) or not (
            isinstance(stream, (int, np.integer)) or any(hasattr(stream, a) for a in _STREAM_ATTRS)):
        raise TypeError(f"stream: expected a cuda.core Stream, torch/cupy stream, __cuda_stream__ object or "
                        f"CUstream int, got {type(stream).__name__}")


_STREAM_ATTRS = ("cuda_stream", "__cuda_stream__", "ptr", "handle")


# ------------------------------------------------------------------------------------------- ReLU mask
MASK_DTYPES = ("uint32", "int32")


def mask_words(numel: int) -> int:
    """Number of 32-bit words of the 1-bit ReLU mask of a tensor with ``numel`` elements."""
    return (numel + 31) // 32


def check_mask(t: Tensor, name: str, numel: int) -> None:
    """A 1-bit ReLU mask (ARCHITECTURE.md's format): 1-D uint32/int32, contiguous, 4-byte aligned, at least
    ``ceil(numel / 32)`` words."""
    check_dtype(t, name, MASK_DTYPES)
    if t.ndim != 1 or t.shape[0] < mask_words(numel):
        raise ValueError(f"{name}: expected a 1-D uint32 array of at least {mask_words(numel)} words for "
                         f"{numel} elements, got shape {tuple(t.shape)}")
    check_contiguous(t, name)
    check_aligned(t, name)
