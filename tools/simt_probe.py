"""Probe: the fp32 strict (SIMT) kernel on few-channel NHWC problems, against float64 (GPU)."""
import numpy as np
import torch

import igemm
from igemm import reference

rng = np.random.default_rng(0)
for xs, ws, st, pd, kw in [((2, 37, 21, 24), (16, 7, 1, 24), (2, 1), (3, 0), {}),
                           ((2, 37, 21, 24), (16, 3, 1, 24), (1, 1), (0, 0), {}),
                           ((2, 37, 21, 24), (16, 7, 1, 24), (1, 1), (0, 0), {}),
                           ((2, 37, 21, 24), (16, 3, 3, 24), (1, 1), (1, 1), {}),
                           ((2, 37, 41, 3), (16, 7, 7, 3), (2, 2), (3, 3), {"unfold": False}),
                           ((2, 37, 41, 3), (16, 7, 7, 3), (2, 2), (3, 3), {"unfold": True}),
                           ((2, 37, 41, 3), (16, 7, 7, 3), (2, 2), (3, 3), {"unfold": True, "precision": "tf32"})]:
    x = rng.standard_normal(xs).astype(np.float32)
    w = (rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:]))).astype(np.float32)
    ref = reference.conv2d_direct(x.astype(np.float64), w.astype(np.float64), st, pd, 1, "NHWC")
    plan = igemm.Conv2dPlan(xs, ws, "float32", "NHWC", st, pd, **kw)
    y = plan(torch.from_numpy(x).cuda(), torch.from_numpy(w).cuda()).cpu().numpy()
    err = np.abs(y - ref).max() / np.abs(ref).max()
    bad = np.argwhere(np.abs(y - ref) > 1e-4 * np.abs(ref).max())
    print(xs, ws, st, pd, kw, plan.spec().name(), f"err {err:.3g}", "bad", len(bad), bad[:4].tolist(), flush=True)
