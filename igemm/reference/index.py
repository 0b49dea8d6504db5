"""float64 numpy ``index_add`` (``torch.Tensor.index_add_`` semantics, out of place).

``out = x.copy(); out[..., index[i], ...] += alpha * source[..., i, ...]`` along ``dim``; duplicate indices
accumulate; an index outside ``[0, x.shape[dim])`` (negative ones included: no wrap-around) is an
``IndexError``.
"""
from __future__ import annotations

import numpy as np

__all__ = ["index_add", "collapse_index_add", "first_bad_index"]


def collapse_index_add(shape, dim: int) -> tuple[int, int, int]:
    """``(outer, indexed, inner)`` of a shape around ``dim`` (a 0-d shape is ``(1, 1, 1)``)."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        return 1, 1, 1
    outer = int(np.prod(shape[:dim], dtype=np.int64)) if dim else 1
    inner = int(np.prod(shape[dim + 1:], dtype=np.int64)) if dim + 1 < len(shape) else 1
    return outer, shape[dim], inner


def first_bad_index(index, size: int):
    """``(position, value)`` of the first index outside ``[0, size)``, or ``None``."""
    idx = np.asarray(index).reshape(-1)
    if idx.size == 0:
        return None
    bad = np.flatnonzero((idx < 0) | (idx >= size))
    if bad.size == 0:
        return None
    return int(bad[0]), int(idx[bad[0]])


def index_add(x, dim: int, index, source, alpha=1.0) -> np.ndarray:
    """float64 copy of ``x`` with ``alpha * source`` added at ``index`` along ``dim``."""
    out = np.array(x, dtype=np.float64, copy=True)
    src = np.asarray(source, dtype=np.float64)
    idx = np.asarray(index).reshape(-1).astype(np.int64)
    shape = out.shape
    if out.ndim == 0:
        if dim not in (0, -1):
            raise IndexError(f"dim {dim} is out of range for a 0-d x")
        out, src, dim = out.reshape(1), src.reshape(1), 0
    nd = out.ndim
    if not -nd <= dim < nd:
        raise IndexError(f"dim {dim} is out of range for x of {nd} dimensions")
    dim %= nd
    if src.ndim != nd or src.shape[dim] != idx.size or any(
            a != b for j, (a, b) in enumerate(zip(src.shape, out.shape)) if j != dim):
        raise ValueError(f"source shape {src.shape} does not match x {out.shape} with {idx.size} indices along {dim}")
    bad = first_bad_index(idx, out.shape[dim])
    if bad is not None:
        raise IndexError(f"index[{bad[0]}] = {bad[1]} is out of range for dimension {dim} of size {out.shape[dim]}")
    np.add.at(np.moveaxis(out, dim, 0), idx, float(alpha) * np.moveaxis(src, dim, 0))
    return out.reshape(shape)
