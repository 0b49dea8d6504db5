"""Epilogue references in float64: BatchNorm folding and whole chains, from each op's own definition."""
from __future__ import annotations

import numpy as np

__all__ = ["fold_batch_norm", "fold_affine", "apply_chain", "host_f64"]


def host_f64(v) -> np.ndarray:
    """Any array (torch, cupy, jax, numpy) or scalar as a float64 numpy array."""
    mod = type(v).__module__.split(".")[0]
    if mod == "torch":
        return v.detach().double().cpu().numpy()
    if mod == "cupy":
        return v.get().astype(np.float64)
    return np.asarray(v, dtype=np.float64)


def fold_batch_norm(gamma, beta, mean, var, eps):
    """Inference BN as ``y = x * scale + shift``: scale = gamma/sqrt(var+eps), shift = beta - mean*scale."""
    gamma, beta, mean, var = (host_f64(a) for a in (gamma, beta, mean, var))
    scale = gamma / np.sqrt(var + eps)
    return scale, beta - mean * scale


def fold_affine(ops, K: int):
    """Fold consecutive affine ops (BatchNorm/Bias) into one float64 (scale, shift) pair."""
    scale, shift = np.ones(K), np.zeros(K)
    for op in ops:
        scale, shift = op.fold(scale, shift)
    return scale, shift


def apply_chain(pre, chain, layout: str, residual=None):
    """Apply an epilogue chain to the float64 pre-epilogue output ``pre`` (NCHW or NHWC), op by op.

    Uses the ops' definitions (BatchNorm unfolded), not the folded vectors, so that it checks folding too.
    """
    return chain.reference(pre, residual=residual, layout=layout)
