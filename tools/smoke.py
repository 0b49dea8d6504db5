"""Probe the GPU machine: launch overhead of the runtime paths (run once by hand on the device)."""
import time

import numpy as np
import torch

import igemm
from cuda.core.utils import StridedMemoryView

x = torch.randn(1 << 20, device="cuda")
m = igemm.relu_mask(x)
dx = igemm.relu_backward(x, m)
torch.cuda.synchronize()
for label, fn in [("relu_backward call", lambda: igemm.relu_backward(x, m, out=dx)),
                  ("StridedMemoryView(torch)", lambda: StridedMemoryView(x, stream_ptr=-1)),
                  ("torch.empty_like", lambda: torch.empty_like(x))]:
    for _ in range(100):
        fn()
    t = time.perf_counter()
    for _ in range(2000):
        fn()
    print(f"{label}: {(time.perf_counter() - t) / 2000 * 1e6:.2f} us host")
torch.cuda.synchronize()
print("ok", (dx.cpu() == torch.where(x.cpu() > 0, x.cpu(), 0)).all().item())
