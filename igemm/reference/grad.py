"""float64 numpy references for the convolution backward: the gradients w.r.t. the input and the weight
(PyTorch's ``torch.nn.grad.conv2d_input`` / ``conv2d_weight``), and the gradient that reaches the conv
through a ReLU mask and a BatchNorm(training statistics) backward folded into per-channel ``(a, b, c)``.

Layouts: NCHW x[N,C,H,W], w[K,C,R,S], dy[N,K,P,Q]; NHWC x[N,H,W,C], w[K,R,S,C], dy[N,P,Q,K].
"""
from __future__ import annotations

import numpy as np

from .conv import out_size, pair
from .mask import unpack_mask

__all__ = ["conv2d_grad_input_ref", "conv2d_grad_weight_ref", "grad_prologue_ref", "bn_grad_coefficients_ref"]


def _check_layout(layout: str) -> None:
    if layout not in ("NCHW", "NHWC"):
        raise ValueError(f"layout must be 'NCHW' or 'NHWC', got {layout!r}")


def _nhwc(a, layout: str) -> np.ndarray:
    """A 4-D array of the layout as float64 NHWC (w: KRSC), the layout the taps are contracted in."""
    a = np.asarray(a, dtype=np.float64)
    if a.ndim != 4:
        raise ValueError(f"expected a 4-D array, got shape {a.shape}")
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1)) if layout == "NCHW" else a


def _shape_nchw(shape, layout: str) -> tuple[int, int, int, int]:
    shape = tuple(int(v) for v in shape)
    if len(shape) != 4:
        raise ValueError(f"expected a 4-D shape, got {shape}")
    return (shape[0], shape[3], shape[1], shape[2]) if layout == "NHWC" else shape


def _from_nhwc(a, layout: str) -> np.ndarray:
    return np.ascontiguousarray(a.transpose(0, 3, 1, 2) if layout == "NCHW" else a)


def _check(x_shape, w_shape, dy_shape, stride, padding, dilation):
    """Validate x (N, C, H, W), w (K, C, R, S) and dy (N, P, Q, K) shapes; return (P, Q)."""
    N, C, H, W = x_shape
    K, Cw, R, S = w_shape
    if Cw != C:
        raise ValueError(f"channels differ: x has {C}, w has {Cw}")
    P, Q = out_size(H, W, R, S, stride, padding, dilation)
    if P <= 0 or Q <= 0:
        raise ValueError(f"empty output: P={P}, Q={Q}")
    if tuple(dy_shape) != (N, P, Q, K):
        raise ValueError(f"dy has (N, P, Q, K) {tuple(dy_shape)}, the conv's output is {(N, P, Q, K)}")
    return P, Q


def _tap(r: int, s: int, P: int, Q: int, stride, dilation) -> tuple[slice, slice]:
    """The rows and columns of the padded input that filter tap (r, s) reads, one per output pixel."""
    (sh, sw), (dh, dw) = pair(stride, "stride"), pair(dilation, "dilation")
    return (slice(r * dh, r * dh + sh * (P - 1) + 1, sh), slice(s * dw, s * dw + sw * (Q - 1) + 1, sw))


def conv2d_grad_input_ref(dy, w, x_shape, stride=1, padding=0, dilation=1, layout="NCHW") -> np.ndarray:
    """dx (float64, shaped ``x_shape``): the adjoint of ``conv2d_direct`` w.r.t. x, a scatter over the
    R·S taps. Input pixels that no output reads (padding, or cut off by the floor in P) get 0."""
    _check_layout(layout)
    dy, w = _nhwc(dy, layout), _nhwc(w, layout)
    N, C, H, W = _shape_nchw(x_shape, layout)
    K, R, S, _ = w.shape
    P, Q = _check((N, C, H, W), (K, w.shape[3], R, S), dy.shape, stride, padding, dilation)
    ph, pw = pair(padding, "padding")
    dxp = np.zeros((N, H + 2 * ph, W + 2 * pw, C))
    for r in range(R):
        for s in range(S):
            rows, cols = _tap(r, s, P, Q, stride, dilation)
            dxp[:, rows, cols, :] += dy @ w[:, r, s, :]
    return _from_nhwc(dxp[:, ph: ph + H, pw: pw + W, :], layout)


def conv2d_grad_weight_ref(x, dy, w_shape, stride=1, padding=0, dilation=1, layout="NCHW") -> np.ndarray:
    """dw (float64, shaped ``w_shape``): for each tap, dy contracted with the input plane that tap reads."""
    _check_layout(layout)
    x, dy = _nhwc(x, layout), _nhwc(dy, layout)
    K, C, R, S = _shape_nchw(w_shape, layout)
    N, H, W, Cx = x.shape
    P, Q = _check((N, Cx, H, W), (K, C, R, S), dy.shape, stride, padding, dilation)
    ph, pw = pair(padding, "padding")
    xp = np.pad(x, ((0, 0), (ph, ph), (pw, pw), (0, 0)))
    dyt = dy.reshape(N * P * Q, K).T
    dw = np.zeros((K, R, S, C))
    for r in range(R):
        for s in range(S):
            rows, cols = _tap(r, s, P, Q, stride, dilation)
            dw[:, r, s, :] = dyt @ xp[:, rows, cols, :].reshape(N * P * Q, C)
    return _from_nhwc(dw, layout)


def _per_channel_vec(v, K: int, name: str) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64).ravel()
    if v.size != K:
        raise ValueError(f"{name}: expected {K} per-channel values, got {v.size}")
    return v


def grad_prologue_ref(dy, mask=None, prologue=None, layout="NCHW") -> np.ndarray:
    """The gradient that reaches the conv (float64): ``sel = bit ? dy : 0`` (a select: non-finite dy where
    the bit is 0 gives 0) or dy without a mask; with ``prologue = (z, a, b, c)`` (z shaped like dy, a, b, c
    per output channel) ``a[k]·sel + b[k]·z + c[k]``."""
    _check_layout(layout)
    dy = np.asarray(dy, dtype=np.float64)
    if mask is None:
        sel = dy
    else:
        bits = unpack_mask(mask, dy.size)
        if bits.size != dy.size:
            raise ValueError(f"mask has {bits.size} bits, dy has {dy.size} elements")
        sel = np.where(bits.reshape(dy.shape), dy, 0.0)
    if prologue is None:
        return sel
    z, a, b, c = prologue
    z = np.asarray(z, dtype=np.float64)
    if z.shape != dy.shape:
        raise ValueError(f"z has shape {z.shape}, dy has {dy.shape}")
    ax = 1 if layout == "NCHW" else dy.ndim - 1
    K = dy.shape[ax]
    shape = [1] * dy.ndim
    shape[ax] = K
    a, b, c = (_per_channel_vec(v, K, n).reshape(shape) for v, n in ((a, "a"), (b, "b"), (c, "c")))
    return a * sel + b * z + c


def bn_grad_coefficients_ref(sum_dy, sum_dy_xmu, mean, invstd, gamma, count):
    """Per-channel ``(a, b, c)`` (float64) with ``a·g + b·z + c`` = PyTorch's BatchNorm backward
    ``gamma·invstd·(g - sum_dy/n - (z - mean)·invstd²·sum_dy_xmu/n)``, g the (masked) dy reaching the BN,
    z its input. gamma None means ones; count is n (a scalar or per channel)."""
    sum_dy = np.asarray(sum_dy, dtype=np.float64)
    sum_dy_xmu = np.asarray(sum_dy_xmu, dtype=np.float64)
    mean = np.asarray(mean, dtype=np.float64)
    invstd = np.asarray(invstd, dtype=np.float64)
    gamma = np.ones_like(invstd) if gamma is None else np.asarray(gamma, dtype=np.float64)
    norm = 1.0 / np.asarray(count, dtype=np.float64)
    a = gamma * invstd
    f = invstd * invstd * sum_dy_xmu * norm
    b = -a * f
    c = a * (mean * f - sum_dy * norm)
    return (np.broadcast_to(a, sum_dy.shape).copy(), np.broadcast_to(b, sum_dy.shape).copy(),
            np.broadcast_to(c, sum_dy.shape).copy())
