"""Epilogue references in float64: BatchNorm folding and whole chains, straight from the definitions."""
from __future__ import annotations

import numpy as np

__all__ = ["fold_batch_norm", "fold_affine", "apply_chain", "host_f64"]


def host_f64(v) -> np.ndarray:
    """Any array (torch, cupy, numpy, scalar) as a float64 numpy array."""
    mod = type(v).__module__.split(".")[0]
    if mod == "torch":
        return v.detach().double().cpu().numpy()
    if mod == "cupy":
        return v.get().astype(np.float64)
    if hasattr(v, "get") and not isinstance(v, np.ndarray):
        return np.asarray(v.get(), dtype=np.float64)
    return np.asarray(v, dtype=np.float64)


def fold_batch_norm(gamma, beta, mean, var, eps):
    """Inference BN as ``y = x * scale + shift``: scale = gamma/sqrt(var+eps), shift = beta - mean*scale."""
    gamma, beta, mean, var = (host_f64(a) for a in (gamma, beta, mean, var))
    scale = gamma / np.sqrt(var + eps)
    return scale, beta - mean * scale


def fold_affine(ops, K: int):
    """Fold consecutive BatchNorm/Bias ops into one (scale, shift) pair, float64."""
    scale = np.ones(K)
    shift = np.zeros(K)
    for op in ops:
        if type(op).__name__ == "BatchNorm":
            s, t = fold_batch_norm(op.gamma, op.beta, op.mean, op.var, op.eps)
            scale, shift = scale * s, shift * s + t
        elif type(op).__name__ == "Bias":
            shift = shift + host_f64(op.b).reshape(-1)
        else:
            raise TypeError(f"not an affine op: {op!r}")
    return scale, shift


def apply_chain(pre, chain, layout: str, residual=None, folded=None):
    """Apply an epilogue chain to the float64 pre-epilogue output ``pre`` (NCHW or NHWC), op by op.

    Uses the ops' definitions (BatchNorm unfolded), not the folded vectors, so that it checks folding too.
    """
    y = np.array(pre, dtype=np.float64)
    shape = [1] * y.ndim
    shape[1 if layout == "NCHW" else y.ndim - 1] = -1

    def per_channel(v):
        return host_f64(v).reshape(shape)

    for op in chain.ops:
        name = type(op).__name__
        if name == "BatchNorm":
            y = (y - per_channel(op.mean)) / np.sqrt(per_channel(op.var) + op.eps) * per_channel(op.gamma) \
                + per_channel(op.beta)
        elif name == "Bias":
            y = y + per_channel(op.b)
        elif name == "Add":
            r = residual if residual is not None else op.residual
            y = y + host_f64(r)
        elif name == "ReLU":
            y = np.where((y > 0) | np.isnan(y), y, 0.0)
        elif name == "PReLU":
            a = per_channel(op.alpha) if op.per_channel else float(op.alpha)
            y = np.where(y > 0, y, a * y)
        else:
            raise NotImplementedError(name)
    return y
