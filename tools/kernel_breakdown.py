"""Per-kernel device time of a plan call (torch.profiler), e.g. the NCHW transpose path's transpose and conv:

    python tools/kernel_breakdown.py [--configs fp16-NCHW,fp16-NHWC] [--layers 0,1] [--batch 32]

Each layer's plan runs 30 times on inputs rotated past the L2; prints the mean time of each kernel it
launched, per call.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="fp16-NCHW,fp16-NHWC")
    ap.add_argument("--layers", default="")
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    import _harness
    import igemm
    from bench_conv import CONFIGS, RESNET50, make_inputs
    layers = [RESNET50[int(i)] for i in args.layers.split(",")] if args.layers else RESNET50
    print("| config | layer | kernel | us per call |\n|---|---|---|---|")
    for cfg in args.configs.split(","):
        dtype, layout, precision, _ = CONFIGS[cfg]
        for name, C, K, H, R, st, pd in layers:
            N = args.batch
            P = (H + 2 * pd - R) // st + 1
            eb = 2 if dtype != "float32" else 4
            xs, w = make_inputs(torch, N, C, K, H, R, dtype, layout, (N * C * H * H + N * K * P * P) * eb)
            plan = igemm.Conv2dPlan(xs[0].shape, w.shape, dtype, layout, st, pd, precision=precision)
            out = torch.empty(plan.y_shape, device="cuda", dtype=xs[0].dtype)
            for i in range(5):
                plan(xs[i % len(xs)], w, out=out)
            torch.cuda.synchronize()
            calls = 30
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(calls):
                    plan(xs[i % len(xs)], w, out=out)
                torch.cuda.synchronize()
            tot = defaultdict(float)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    tot[e.name] += e.device_time
            for k, t in sorted(tot.items(), key=lambda kv: -kv[1]):
                print(f"| {cfg} | {name} | {k[:60]} | {t / calls:.1f} |")
            del xs, out
            torch.cuda.empty_cache()
    _ = _harness
    return 0


if __name__ == "__main__":
    sys.exit(main())
