"""float64 numpy convolutions (cross-correlation, as PyTorch): direct, im2col+GEMM and FFT.

Layouts: NCHW x[N,C,H,W], w[K,C,R,S] -> y[N,K,P,Q]; NHWC x[N,H,W,C], w[K,R,S,C] -> y[N,P,Q,K].
"""
from __future__ import annotations

import numpy as np

__all__ = ["pair", "out_size", "conv2d_direct", "conv2d_im2col", "conv2d_fft", "im2col", "conv_flops"]


def pair(v, name: str = "value") -> tuple[int, int]:
    if isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise ValueError(f"{name}: expected an int or a pair, got {v!r}")
        a, b = v
    else:
        a = b = v
    for x in (a, b):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"{name}: expected integers, got {v!r}")
    return int(a), int(b)


def out_size(H: int, W: int, R: int, S: int, stride, padding, dilation) -> tuple[int, int]:
    (sh, sw), (ph, pw), (dh, dw) = pair(stride), pair(padding), pair(dilation)
    P = (H + 2 * ph - dh * (R - 1) - 1) // sh + 1
    Q = (W + 2 * pw - dw * (S - 1) - 1) // sw + 1
    return P, Q


def conv_flops(N, C, K, R, S, P, Q) -> int:
    return 2 * N * K * P * Q * C * R * S


def _to_nchw(x, w, layout):
    x = np.asarray(x, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    if layout == "NHWC":
        return x.transpose(0, 3, 1, 2), w.transpose(0, 3, 1, 2)
    if layout != "NCHW":
        raise ValueError(f"layout must be 'NCHW' or 'NHWC', got {layout!r}")
    return x, w


def _from_nchw(y, layout):
    return np.ascontiguousarray(y.transpose(0, 2, 3, 1)) if layout == "NHWC" else y


def _geometry(x, w, stride, padding, dilation):
    N, C, H, W = x.shape
    K, Cw, R, S = w.shape
    if Cw != C:
        raise ValueError(f"channels differ: x has {C}, w has {Cw}")
    P, Q = out_size(H, W, R, S, stride, padding, dilation)
    if P <= 0 or Q <= 0:
        raise ValueError(f"empty output: P={P}, Q={Q}")
    return N, C, H, W, K, R, S, P, Q


def conv2d_direct(x, w, stride=1, padding=0, dilation=1, layout="NCHW"):
    """Direct convolution: the sum over the R·S filter taps of shifted, strided input planes."""
    x, w = _to_nchw(x, w, layout)
    (sh, sw), (ph, pw), (dh, dw) = pair(stride), pair(padding), pair(dilation)
    N, C, H, W, K, R, S, P, Q = _geometry(x, w, stride, padding, dilation)
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    y = np.zeros((N, K, P, Q))
    for r in range(R):
        for s in range(S):
            patch = xp[:, :, r * dh: r * dh + sh * (P - 1) + 1: sh, s * dw: s * dw + sw * (Q - 1) + 1: sw]
            y += np.einsum("ncpq,kc->nkpq", patch, w[:, :, r, s], optimize=True)
    return _from_nchw(y, layout)


def im2col(x, R, S, stride=1, padding=0, dilation=1):
    """The (N·P·Q) × (C·R·S) matrix of an NCHW input (rows: output pixels; columns: c, r, s)."""
    x = np.asarray(x, dtype=np.float64)
    (sh, sw), (ph, pw), (dh, dw) = pair(stride), pair(padding), pair(dilation)
    N, C, H, W = x.shape
    P, Q = out_size(H, W, R, S, stride, padding, dilation)
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    cols = np.empty((N, P, Q, C, R, S))
    for r in range(R):
        for s in range(S):
            patch = xp[:, :, r * dh: r * dh + sh * (P - 1) + 1: sh, s * dw: s * dw + sw * (Q - 1) + 1: sw]
            cols[:, :, :, :, r, s] = patch.transpose(0, 2, 3, 1)
    return cols.reshape(N * P * Q, C * R * S)


def conv2d_im2col(x, w, stride=1, padding=0, dilation=1, layout="NCHW"):
    """Explicit im2col then one GEMM: y = im2col(x) @ w.reshape(K, C·R·S).T."""
    x, w = _to_nchw(x, w, layout)
    N, C, H, W, K, R, S, P, Q = _geometry(x, w, stride, padding, dilation)
    cols = im2col(x, R, S, stride, padding, dilation)
    y = (cols @ w.reshape(K, C * R * S).T).reshape(N, P, Q, K).transpose(0, 3, 1, 2)
    return _from_nchw(y, layout)


def conv2d_fft(x, w, stride=1, padding=0, dilation=1, layout="NCHW"):
    """FFT convolution: correlate at stride 1 over the padded input, then subsample by the stride.

    The filter is dilated by inserting zeros; the stride costs the full stride-1 output (sh·sw times
    the work of the strided one).
    """
    x, w = _to_nchw(x, w, layout)
    (sh, sw), (ph, pw), (dh, dw) = pair(stride), pair(padding), pair(dilation)
    N, C, H, W, K, R, S, P, Q = _geometry(x, w, stride, padding, dilation)
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    Hp, Wp = xp.shape[2:]
    Rd, Sd = dh * (R - 1) + 1, dw * (S - 1) + 1
    wd = np.zeros((K, C, Rd, Sd))
    wd[:, :, ::dh, ::dw] = w
    wflip = wd[:, :, ::-1, ::-1]
    X = np.fft.rfft2(xp, s=(Hp, Wp))
    F = np.fft.rfft2(wflip, s=(Hp, Wp))
    Y = np.einsum("ncij,kcij->nkij", X, F, optimize=True)
    full = np.fft.irfft2(Y, s=(Hp, Wp))
    y = full[:, :, Rd - 1: Rd - 1 + sh * (P - 1) + 1: sh, Sd - 1: Sd - 1 + sw * (Q - 1) + 1: sw]
    return _from_nchw(np.ascontiguousarray(y), layout)
