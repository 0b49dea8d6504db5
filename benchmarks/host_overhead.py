"""Host time per call of the public functions (Python + driver launch), on small tensors so that the GPU
is never the bottleneck, next to the PyTorch call doing the same work; optional cProfile of each.

    python benchmarks/host_overhead.py [--profile] [--calls 3000] [--out DIR]

The device time of these calls is a few microseconds; what is measured is how long the calling thread
is busy per call (perf_counter around chunks of 250 calls, GPU work queued asynchronously; a synchronize
between chunks, not timed, keeps the queue from filling -- so a GPU slower than the host is not timed).
Each igemm call is timed twice in the same run, interleaved chunk by chunk with PyTorch's: launching through
the C launch step (csrc/host/launch.c) and through cuda.bindings (the path without a C compiler).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    import igemm
    from igemm import epilogues as ep
    torch.set_grad_enabled(False)                     # (inference: igemm.nn modules run igemm's kernel)
    dev = "cuda"
    h = torch.float16
    x = torch.randn(8, 64, 14, 14, device=dev, dtype=h)
    xl = x.permute(0, 2, 3, 1).contiguous()                     # NHWC
    w = torch.randn(64, 3, 3, 64, device=dev, dtype=h)          # KRSC
    w_nchw = w.permute(0, 3, 1, 2).contiguous()
    plan = igemm.Conv2dPlan(tuple(xl.shape), tuple(w.shape), "float16", "NHWC", padding=1, device=0)
    g, b = torch.rand(64, device=dev) + 0.5, torch.randn(64, device=dev)
    mu, var = torch.randn(64, device=dev), torch.rand(64, device=dev) + 0.5
    y = plan(xl, w)
    xs = torch.randn(8, 64, 14, 14, device=dev)
    mean, invstd = igemm.batch_norm_stats(xs, 1e-5)
    tgt = torch.zeros(4096, device=dev)
    idx = torch.randint(0, 4096, (64,), device=dev)
    src = torch.randn(64, device=dev)
    alpha = torch.full((64,), 0.25, device=dev)
    # NCHW: the transpose path (x and w transposed, then the conv: two kernels) and a 1x1 read in place
    plan_t = igemm.Conv2dPlan(tuple(x.shape), tuple(w_nchw.shape), "float16", "NCHW", padding=1, device=0)
    y_t = plan_t(x, w_nchw)
    x1 = torch.randn(8, 64, 16, 16, device=dev, dtype=h)
    w1 = torch.randn(64, 64, 1, 1, device=dev, dtype=h)
    plan_1 = igemm.Conv2dPlan(tuple(x1.shape), tuple(w1.shape), "float16", "NCHW", device=0)
    y_1 = plan_1(x1, w1)
    # the backward's plans (dgrad: one phase and its filter move; wgrad: two moves, the turned conv, the dw move)
    gplan_i = igemm.Conv2dGradInputPlan(tuple(xl.shape), tuple(w.shape), "float16", "NHWC", padding=1, device=0)
    gplan_w = igemm.Conv2dGradWeightPlan(tuple(xl.shape), tuple(w.shape), "float16", "NHWC", padding=1, device=0)
    yl = torch.randn(8, 14, 14, 64, device=dev, dtype=h)
    y_nchw = yl.permute(0, 3, 1, 2)
    gplan_i(yl, w), gplan_w(xl, yl)
    import igemm.nn as inn
    block = inn.Conv2dBNReLU(torch.nn.Conv2d(64, 64, 3, padding=1, bias=False), torch.nn.BatchNorm2d(64))
    block = block.to(dev, h).eval().to(memory_format=torch.channels_last)
    ref_block = torch.nn.Sequential(block.conv, block.bn, torch.nn.ReLU())
    xcl = x.contiguous(memory_format=torch.channels_last)
    cases = [
        ("Conv2dPlan call (fp16 NHWC)", lambda: plan(xl, w, out=y), lambda: F.conv2d(x, w_nchw, padding=1)),
        ("Conv2dPlan call (fp16 NCHW 3x3: transpose + conv)", lambda: plan_t(x, w_nchw, out=y_t),
         lambda: F.conv2d(x, w_nchw, padding=1)),
        ("Conv2dPlan call (fp16 NCHW 1x1, x read in place)", lambda: plan_1(x1, w1, out=y_1),
         lambda: F.conv2d(x1, w1)),
        ("conv2d function (fp16 NHWC)", lambda: igemm.conv2d(xl, w, padding=1, layout="NHWC"),
         lambda: F.conv2d(x, w_nchw, padding=1)),
        ("igemm.nn.Conv2dBNReLU (fp16 channels_last, eval)", lambda: block(xcl), lambda: ref_block(xcl)),
        ("conv2d_bn_relu(return_mask=True), repeated (fp16 NHWC)",
         lambda: igemm.conv2d_bn_relu(xl, w, g, b, mu, var, 1e-5, 1, 1, layout="NHWC", return_mask=True),
         lambda: torch.relu(F.batch_norm(F.conv2d(x, w_nchw, padding=1), mu, var, g, b))),
        ("conv2d + BN + ReLU(mask)", lambda: igemm.conv2d(xl, w, padding=1, layout="NHWC",
                                                           epilogue=ep.chain(ep.BatchNorm(g, b, mu, var),
                                                                             ep.ReLU(mask=True))),
         lambda: torch.relu(F.batch_norm(F.conv2d(x, w_nchw, padding=1), mu, var, g, b))),
        ("batch_norm_stats", lambda: igemm.batch_norm_stats(xs, 1e-5), lambda: torch.batch_norm_stats(xs, 1e-5)),
        ("batch_norm_relu (mask)", lambda: igemm.batch_norm_relu(xs, mean, invstd, g, b),
         lambda: torch.relu(torch.batch_norm_elemt(xs, g, b, mean, invstd, 1e-5))),
        ("relu_mask", lambda: igemm.relu_mask(xs), lambda: xs > 0),
        ("index_add (check_index=False)", lambda: igemm.index_add(tgt, 0, idx, src, check_index=False),
         lambda: tgt.index_add_(0, idx, src)),
        ("index_add (default: checked)", lambda: igemm.index_add(tgt, 0, idx, src), lambda: tgt.index_add_(0, idx, src)),
        ("prelu (per-channel)", lambda: igemm.prelu(xs, alpha), lambda: F.prelu(xs, alpha)),
        ("Conv2dGradInputPlan call (fp16 NHWC 3x3, stride 1)", lambda: gplan_i(yl, w),
         lambda: torch.ops.aten.convolution_backward(y_nchw, x, w_nchw, None, [1, 1], [1, 1], [1, 1], False,
                                                     [0, 0], 1, [True, False, False])),
        ("Conv2dGradWeightPlan call (fp16 NHWC 3x3)", lambda: gplan_w(xl, yl),
         lambda: torch.ops.aten.convolution_backward(y_nchw, x, w_nchw, None, [1, 1], [1, 1], [1, 1], False,
                                                     [0, 0], 1, [False, True, False])),
    ]
    rows, profiles = [], {}
    from igemm import _hostlaunch
    c_step = _hostlaunch.status()

    def chunk(fn, python=False):
        def run():
            with _hostlaunch.python_only() if python else contextlib.nullcontext():
                for _ in range(250):
                    fn()
        return run
    for name, fi, ft in cases:
        res = {"c": 0.0, "python": 0.0, "torch": 0.0}
        chunks = {"c": chunk(fi), "python": chunk(fi, python=True), "torch": chunk(ft)}
        for run in (*chunks.values(), *chunks.values()):     # warm-up
            run()
        torch.cuda.synchronize()
        n = -(-args.calls // 250)
        for _ in range(n):                     # interleaved chunks: a drifting host clock hits all three alike
            for who, run in chunks.items():
                t0 = time.perf_counter()
                run()
                res[who] += time.perf_counter() - t0
                torch.cuda.synchronize()
        res = {k: v / (n * 250) * 1e6 for k, v in res.items()}
        if args.profile:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(500):
                fi()
            pr.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
            profiles[name] = s.getvalue()
        rows.append(dict(call=name, igemm_c_us=round(res["c"], 2), igemm_python_us=round(res["python"], 2),
                         torch_us=round(res["torch"], 2), ratio_c=round(res["c"] / res["torch"], 2),
                         ratio_python=round(res["python"] / res["torch"], 2)))
    print(f"launch step: {c_step}")
    print("| call | igemm, C launch step: us (ratio) | igemm, cuda.bindings: us (ratio) | torch us |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['call']} | {r['igemm_c_us']} ({r['ratio_c']}) | {r['igemm_python_us']} ({r['ratio_python']}) "
              f"| {r['torch_us']} |")
    for name, text in profiles.items():
        print(f"\n=== {name}: cProfile of 500 calls, by own time")
        print("\n".join(ln for ln in text.splitlines()[4:] if ln.strip())[:2600])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_overhead.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
