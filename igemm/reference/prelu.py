"""float64 numpy PReLU and its backward (``torch.nn.functional.prelu`` semantics).

``y = x if x > 0 else alpha[c] * x``; ``alpha`` has one element (shared) or one per channel, the channel
being dim 1 (``layout="NCHW"``) or the last dim (``layout="NHWC"``). Backward:
``dx = dy if x > 0 else alpha[c] * dy``, ``dalpha[c] = sum over channel c of (0 if x > 0 else x * dy)``.
"""
from __future__ import annotations

import numpy as np

__all__ = ["prelu", "prelu_backward", "prelu_channel_axis"]


def prelu_channel_axis(ndim: int, layout: str) -> int | None:
    """The channel axis of an ``ndim``-d input (``None`` below 2-D, where only a shared alpha fits)."""
    if ndim < 2:
        return None
    return 1 if layout == "NCHW" else ndim - 1


def _alpha_b(x: np.ndarray, alpha, layout: str) -> np.ndarray:
    a = np.asarray(alpha, dtype=np.float64).reshape(-1)
    if a.size == 1:
        return a.reshape(())
    axis = prelu_channel_axis(x.ndim, layout)
    if axis is None or x.shape[axis] != a.size:
        raise ValueError(f"alpha with {a.size} elements does not match x of shape {x.shape} ({layout})")
    shape = [1] * x.ndim
    shape[axis] = a.size
    return a.reshape(shape)


def prelu(x, alpha, layout: str = "NCHW") -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return np.where(x > 0, x, _alpha_b(x, alpha, layout) * x)


def prelu_backward(dy, x, alpha, layout: str = "NCHW") -> tuple[np.ndarray, np.ndarray]:
    """``(dx, dalpha)``; ``dalpha`` has ``alpha.size`` elements (1 for a shared alpha)."""
    x = np.asarray(x, dtype=np.float64)
    dy = np.asarray(dy, dtype=np.float64)
    a = _alpha_b(x, alpha, layout)
    pos = x > 0
    dx = np.where(pos, dy, a * dy)
    g = np.where(pos, 0.0, x * dy)
    if a.ndim == 0:
        return dx, np.array([g.sum()])
    axis = prelu_channel_axis(x.ndim, layout)
    return dx, g.sum(axis=tuple(j for j in range(x.ndim) if j != axis))
