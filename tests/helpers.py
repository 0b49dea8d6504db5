"""Shared test helpers: tolerances by dtype, torch conversion, poisoning."""
from __future__ import annotations

import numpy as np

TOL = {"float32": 1e-5, "tf32": 1e-3, "float16": 1e-2, "bfloat16": 1e-2}


def torch_dtype(name: str):
    import torch
    return getattr(torch, name)


def to_torch(a: np.ndarray, dtype: str, device="cuda"):
    import torch
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(device=device, dtype=torch_dtype(dtype))


def to_numpy(t) -> np.ndarray:
    """float64 numpy copy of a torch tensor / cupy array / numpy array."""
    mod = type(t).__module__.split(".")[0]
    if mod == "torch":
        if not t.is_floating_point():
            return t.detach().cpu().numpy()
        if t.dtype.itemsize < 4:                   # fp16/bf16: numpy has no bf16; widening is exact
            t = t.float()
        return t.detach().cpu().numpy().astype(np.float64)     # fp64 stays exact (no fp32 round trip)
    if mod == "cupy":
        return t.get()
    return np.asarray(t)


def rel_err(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    den = np.linalg.norm(ref.ravel())
    return float(np.linalg.norm((out - ref).ravel()) / (den if den > 0 else 1.0))


def poison(t):
    """Fill a fresh output with NaN (floats) or 0xA5 bytes (ints) so unwritten elements fail."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-1431655766)  # 0xAAAAAAAA
    return t
