"""One TMA-loader conv (per-tile and persistent kernels) per kind of geometry against torch, each in a subprocess-free loop with a hard
time limit per case (a lost mbarrier transaction would hang, not fail): run this before the test tiers.

    timeout 120 python tools/tma_smoke.py
"""
import sys
import time

import torch
import torch.nn.functional as F

import igemm

CASES = [  # N, C, H, W, K, R, stride, pad, dil, config
    (2, 64, 9, 11, 40, 3, 1, 1, 1, None),
    (3, 128, 13, 7, 72, 3, 2, 1, 1, None),
    (2, 64, 12, 12, 64, 3, 1, 2, 2, None),
    (4, 64, 14, 14, 128, 3, 1, 1, 1, {"bm": 128, "wm": 2}),
    (1, 256, 7, 7, 128, 3, 1, 1, 1, {"splits": 3}),
    (32, 64, 56, 56, 64, 3, 1, 1, 1, None),
    # the persistent warp-specialised kernel
    (2, 64, 9, 11, 40, 3, 1, 1, 1, {"math": "wgmma_ws", "bm": 64, "wm": 2, "splits": 1, "bn": 64, "stages": 4}),
    (32, 64, 56, 56, 64, 3, 1, 1, 1, {"math": "wgmma_ws", "bm": 64, "wm": 2, "splits": 1, "bn": 64, "stages": 4}),
    (8, 128, 28, 28, 256, 3, 1, 1, 1, {"math": "wgmma_ws", "bm": 64, "wm": 2, "splits": 1, "bn": 128, "stages": 3}),
    # 8-tap TMA k-tiles on copies padded to 8 channels (conv1)
    (2, 3, 37, 41, 16, 7, 2, 3, 1, "pad"),
    (4, 3, 224, 224, 64, 7, 2, 3, 1, "pad"),
]


def main() -> int:
    bad = 0
    for N, C, H, W, K, R, st, pd, dl, cfg in CASES:
        x = torch.randn(N, H, W, C, device="cuda", dtype=torch.float16)
        w = torch.randn(K, R, R, C, device="cuda", dtype=torch.float16) / (C * R * R) ** 0.5
        pad = cfg == "pad"
        plan = igemm.Conv2dPlan(x.shape, w.shape, "float16", "NHWC", st, pd, dl,
                                config={"load_a": "tma8", "load_b": "tma"} if pad else cfg,
                                pad_channels=True if pad else None)
        t = time.perf_counter()
        y = plan(x, w)
        torch.cuda.synchronize()
        ref = F.conv2d(x.permute(0, 3, 1, 2).double(), w.permute(0, 3, 1, 2).double(), stride=st, padding=pd,
                       dilation=dl).permute(0, 2, 3, 1)
        err = ((y.double() - ref).norm() / ref.norm()).item()
        ok = err < 1e-2
        bad += not ok
        print(f"{plan.spec().name():70s} err {err:.2e} {'ok' if ok else 'FAIL'} ({time.perf_counter() - t:.2f} s)",
              flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
