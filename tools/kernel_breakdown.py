"""Per-kernel device time of a plan call (torch.profiler), e.g. the NCHW transpose path's transpose and conv:

    python tools/kernel_breakdown.py [--configs fp16-NCHW,fp16-NHWC] [--layers 0,1] [--batch 32] [--chains a,b,c]

Each layer's plan runs 30 times on inputs rotated past the L2; prints the mean time of each kernel it
launched, per call. --chains: a = the conv alone, b = + BN + ReLU(mask), c = + BN + Add + ReLU(mask)
(bench_epilogues' three calls; b and c pass mask_out, c a fresh fp16 residual per input).
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
    ap.add_argument("--chains", default="a")
    args = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    import _harness
    import igemm
    from bench_conv import CONFIGS, RESNET50, make_inputs
    from igemm import epilogues as ep
    layers = [RESNET50[int(i)] for i in args.layers.split(",")] if args.layers else RESNET50
    print("| config | layer | chain | kernel | us per call |\n|---|---|---|---|---|")
    for cfg in args.configs.split(","):
        dtype, layout, precision, _ = CONFIGS[cfg]
        for name, C, K, H, R, st, pd in layers:
            N = args.batch
            P = (H + 2 * pd - R) // st + 1
            eb = 2 if dtype != "float32" else 4
            xs, w = make_inputs(torch, N, C, K, H, R, dtype, layout, (N * C * H * H + N * K * P * P) * eb)
            out = None
            for cn in args.chains.split(","):
                vec = [torch.rand(K, device="cuda") + 0.5, torch.randn(K, device="cuda") * 0.1,
                       torch.randn(K, device="cuda") * 0.1, torch.rand(K, device="cuda") + 0.5]
                ch = {"a": None, "b": ep.chain(ep.BatchNorm(*vec), ep.ReLU(mask=True)),
                      "c": ep.chain(ep.BatchNorm(*vec), ep.Add(), ep.ReLU(mask=True))}[cn]
                plan = igemm.Conv2dPlan(xs[0].shape, w.shape, dtype, layout, st, pd, precision=precision,
                                        **({"epilogue": ch} if ch is not None else {}))
                out = torch.empty(plan.y_shape, device="cuda", dtype=xs[0].dtype)
                mask = torch.empty((out.numel() + 31) // 32, device="cuda", dtype=torch.int32)
                res = [torch.randn_like(out) for _ in xs] if cn == "c" else None
                kw = (lambda i: {}) if cn == "a" else (
                    (lambda i: {"mask_out": mask}) if cn == "b" else (lambda i: {"mask_out": mask, "residual": res[i]}))
                for i in range(5):
                    plan(xs[i % len(xs)], w, out=out, **kw(i % len(xs)))
                torch.cuda.synchronize()
                calls = 30
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for i in range(calls):
                        plan(xs[i % len(xs)], w, out=out, **kw(i % len(xs)))
                    torch.cuda.synchronize()
                tot = defaultdict(float)
                for e in prof.events():
                    if e.device_type == torch.autograd.DeviceType.CUDA:
                        tot[e.name] += e.device_time
                for k, t in sorted(tot.items(), key=lambda kv: -kv[1]):
                    print(f"| {cfg} | {name} | {cn} | {k[:60]} | {t / calls:.1f} |", flush=True)
                del res
            del xs, out
            torch.cuda.empty_cache()
    _ = _harness
    return 0


if __name__ == "__main__":
    sys.exit(main())
