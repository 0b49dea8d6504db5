"""Debug the patch kernel: python tools/patch_debug.py [DEFINES...] -> one small conv, OK/error, rel err."""
import sys

sys.path.insert(0, "tools")
import numpy as np
import torch

import igemm
from epi_probe import _patch_stub

defs = "".join(f"#define {d} 1\n" for d in sys.argv[1:])
_patch_stub(defs)
x = torch.randn(2, 37, 48, 3, device="cuda", dtype=torch.float16)
w = torch.randn(16, 7, 7, 3, device="cuda", dtype=torch.float16) / 12
plan = igemm.Conv2dPlan(x.shape, w.shape, "float16", "NHWC", 2, 3)
print(plan.spec().name(), flush=True)
try:
    y = plan(x, w)
    torch.cuda.synchronize()
    ref = torch.nn.functional.conv2d(x.permute(0, 3, 1, 2).float(), w.permute(0, 3, 1, 2).float(), stride=2, padding=3)
    err = ((y.permute(0, 3, 1, 2).float() - ref).abs().max() / ref.abs().max()).item()
    print(sys.argv[1:], "OK rel err", err)
except Exception as e:
    print(sys.argv[1:], "ERROR", str(e)[:100])
