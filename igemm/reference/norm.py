"""float64 numpy references for BatchNorm: Welford statistics, Chan's merge, BN(+Add)(+ReLU) forward
with the 1-bit mask, and the backward reductions/elementwise pass, all with PyTorch's meaning.

Layouts: ``"NCHW"`` is ``x[N, C, *spatial]`` (channel axis 1), ``"NHWC"`` is ``x[N, *spatial, C]``
(channel axis -1). Statistics are per channel over every other axis; variances are biased (``M2/n``).
"""
from __future__ import annotations

import numpy as np

from .mask import pack_mask, unpack_mask

__all__ = ["channel_axis", "welford_stats", "chan_merge", "invstd_from_var", "batch_norm_stats_ref",
           "batch_norm_gather_stats_ref", "batch_norm_elemt_ref", "batch_norm_relu_ref",
           "batch_norm_backward_reduce_ref", "batch_norm_backward_elemt_ref", "update_running_stats_ref"]


def channel_axis(layout: str, ndim: int) -> int:
    if layout == "NCHW":
        return 1
    if layout == "NHWC":
        return ndim - 1
    raise ValueError(f"layout must be 'NCHW' or 'NHWC', got {layout!r}")


def _per_channel(x, layout):
    """(x as float64 moved to [C, rest], axis)."""
    x = np.asarray(x, dtype=np.float64)
    ax = channel_axis(layout, x.ndim)
    return np.moveaxis(x, ax, 0).reshape(x.shape[ax], -1), ax


def _bcast(v, layout, ndim):
    """Per-channel vector shaped to broadcast against x."""
    v = np.asarray(v, dtype=np.float64)
    shape = [1] * ndim
    shape[channel_axis(layout, ndim)] = v.size
    return v.reshape(shape)


def welford_stats(x, layout: str = "NCHW"):
    """Per-channel ``(mean, biased var, count)`` in float64 (two-pass). Empty channels: 0, 0, 0."""
    xc, _ = _per_channel(x, layout)
    n = xc.shape[1]
    if n == 0:
        z = np.zeros(xc.shape[0])
        return z, z.copy(), z.copy()
    mean = xc.mean(axis=1)
    var = ((xc - mean[:, None]) ** 2).mean(axis=1)
    return mean, var, np.full(xc.shape[0], float(n))


def chan_merge(means, vars_, counts):
    """Chan's parallel merge of per-part ``(mean, biased var, count)`` rows ``[W, C]`` (counts ``[W]`` or
    ``[W, C]``), in row order, float64. Parts with count 0 contribute nothing (never NaN)."""
    means = np.asarray(means, dtype=np.float64)
    vars_ = np.asarray(vars_, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.float64)
    if means.ndim == 1:
        means, vars_ = means[None], vars_[None]
    W, C = means.shape
    if counts.ndim == 1:
        counts = np.repeat(counts[:, None], C, axis=1)
    n = np.zeros(C)
    m = np.zeros(C)
    q = np.zeros(C)
    for w in range(W):
        nb, mb, vb = counts[w], means[w], vars_[w]
        take = nb > 0
        first = take & (n == 0)
        both = take & (n > 0)
        nn = n + nb
        with np.errstate(invalid="ignore", divide="ignore"):
            d = mb - m
            r = np.where(both, nb / np.where(nn > 0, nn, 1), 0.0)
            m_new = np.where(both, m + d * r, m)
            q_new = np.where(both, q + vb * nb + d * d * n * r, q)
        m = np.where(first, mb, m_new)
        q = np.where(first, vb * nb, q_new)
        n = np.where(take, nn, n)
    var = np.where(n > 0, q / np.where(n > 0, n, 1), 0.0)
    return m, var, n


def invstd_from_var(var, eps: float):
    """PyTorch's ``InvStd``: ``1/sqrt(var + eps)``, and 0 where ``var == 0 and eps == 0``."""
    var = np.asarray(var, dtype=np.float64)
    with np.errstate(divide="ignore"):
        out = 1.0 / np.sqrt(var + eps)
    if eps == 0:
        out = np.where(var == 0, 0.0, out)
    return out


def batch_norm_stats_ref(x, eps: float, layout: str = "NCHW"):
    mean, var, _ = welford_stats(x, layout)
    return mean, invstd_from_var(var, eps)


def update_running_stats_ref(running_mean, running_var, mean, var, count, momentum: float):
    """PyTorch's running-statistics update (unbiased variance; unchanged where count <= 1 for the var,
    count == 0 for the mean)."""
    rm = np.asarray(running_mean, dtype=np.float64)
    rv = np.asarray(running_var, dtype=np.float64)
    count = np.broadcast_to(np.asarray(count, dtype=np.float64), rm.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        unbiased = np.where(count > 1, var * count / np.where(count > 1, count - 1, 1), 0.0)
    rm_new = np.where(count > 0, (1 - momentum) * rm + momentum * mean, rm)
    rv_new = np.where(count > 1, (1 - momentum) * rv + momentum * unbiased, rv)
    return rm_new, rv_new


def batch_norm_gather_stats_ref(means, vars_, counts, eps: float | None = None):
    """Merge per-rank partials; ``(mean, var, count)``, or ``(mean, invstd, count)`` when eps is given."""
    m, v, n = chan_merge(means, vars_, counts)
    if eps is None:
        return m, v, n
    return m, invstd_from_var(v, eps), n


def batch_norm_elemt_ref(x, mean, invstd, weight=None, bias=None, layout: str = "NCHW", residual=None,
                         relu: bool = False):
    """``(x - mean) * invstd * weight + bias (+ residual)``, then ReLU if asked (NaN kept), float64."""
    x = np.asarray(x, dtype=np.float64)
    nd = x.ndim
    w = 1.0 if weight is None else _bcast(weight, layout, nd)
    b = 0.0 if bias is None else _bcast(bias, layout, nd)
    y = (x - _bcast(mean, layout, nd)) * (_bcast(invstd, layout, nd) * w) + b
    if residual is not None:
        y = y + np.asarray(residual, dtype=np.float64)
    if relu:
        y = np.where(np.isnan(y) | (y > 0), y, 0.0)
    return y


def batch_norm_relu_ref(x, mean, invstd, weight=None, bias=None, layout: str = "NCHW", residual=None,
                        out_dtype=None):
    """``(y, mask)``: y as ``out_dtype`` (default float64) and the mask of the *stored* y (> 0)."""
    y = batch_norm_elemt_ref(x, mean, invstd, weight, bias, layout, residual, relu=True)
    if out_dtype is not None:
        y = y.astype(out_dtype)
    return y, pack_mask(np.asarray(y, dtype=np.float64) > 0)


def _masked(dy, mask):
    dy = np.asarray(dy, dtype=np.float64)
    if mask is None:
        return dy
    bits = unpack_mask(mask, dy.size).reshape(dy.shape)
    return np.where(bits, dy, 0.0)


def batch_norm_backward_reduce_ref(dy, x, mean, invstd, layout: str = "NCHW", mask=None):
    """``(sum_dy, sum_dy_xmu, grad_weight, grad_bias)``; dy is first masked (select) when a mask is given."""
    d = _masked(dy, mask)
    x = np.asarray(x, dtype=np.float64)
    dc, _ = _per_channel(d, layout)
    xc, _ = _per_channel(x, layout)
    mean = np.asarray(mean, dtype=np.float64)
    sum_dy = dc.sum(axis=1)
    sum_dy_xmu = (dc * (xc - mean[:, None])).sum(axis=1)
    return sum_dy, sum_dy_xmu, sum_dy_xmu * np.asarray(invstd, dtype=np.float64), sum_dy


def batch_norm_backward_elemt_ref(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count,
                                  layout: str = "NCHW", mask=None):
    """PyTorch's ``batch_norm_backward_elemt`` with dy masked (select) when a mask is given:
    ``dx = (dy - sum_dy/n - (x - mean) * invstd^2 * sum_dy_xmu/n) * weight * invstd``."""
    d = _masked(dy, mask)
    x = np.asarray(x, dtype=np.float64)
    nd = x.ndim
    count = np.asarray(count, dtype=np.float64)
    norm = 1.0 / count
    if count.ndim == 1 and count.size > 1:
        norm = _bcast(norm, layout, nd)
    inv = _bcast(invstd, layout, nd)
    w = 1.0 if weight is None else _bcast(weight, layout, nd)
    mean_dy = _bcast(sum_dy, layout, nd) * norm
    f1 = inv * inv * _bcast(sum_dy_xmu, layout, nd) * norm
    return (d - mean_dy - (x - _bcast(mean, layout, nd)) * f1) * (w * inv)
