"""``python -m igemm demo | precompile | compare | info``."""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from .layers import RESNET50


def _shapes(layout, N, C, K, H, R):
    if layout == "NCHW":
        return (N, C, H, H), (K, C, R, R)
    return (N, H, H, C), (K, R, R, C)


def demo(args) -> int:
    import igemm
    from igemm import reference
    gpu = igemm.get_backend() == "cuda"
    layout, dtype = args.layout, args.dtype
    rng = np.random.default_rng(0)
    if not gpu:
        print("No CUDA GPU visible: running the numpy backend (float64 reference) on a small batch "
              "(N=1, spatial size / 8).")
    N = args.batch if gpu else 1
    rows = []
    for name, C, K, H, R, st, pd in RESNET50:
        Hs = H if gpu else max(R, H // 8)
        xs, ws = _shapes(layout, N, C, K, Hs, R)
        if gpu:
            import torch
            tdt = getattr(torch, dtype)
            x = torch.randn(xs, device="cuda", dtype=tdt)
            w = (torch.randn(ws, device="cuda", dtype=tdt) / np.sqrt(C * R * R)).to(tdt)
            plan = igemm.Conv2dPlan(xs, ws, dtype, layout, st, pd)
            y = plan(x, w)
            torch.cuda.synchronize()
            reps = 20
            t0 = torch.cuda.Event(enable_timing=True)
            t1 = torch.cuda.Event(enable_timing=True)
            t0.record()
            for _ in range(reps):
                plan(x, w, out=y)
            t1.record()
            torch.cuda.synchronize()
            t = t0.elapsed_time(t1) / reps * 1e-3
            # reference on a slice of the batch (float64 on the GPU through torch, for speed)
            import torch.nn.functional as F
            xr = x[:2].double() if layout == "NCHW" else x[:2].double().permute(0, 3, 1, 2)
            wr = w.double() if layout == "NCHW" else w.double().permute(0, 3, 1, 2)
            ref = F.conv2d(xr, wr, stride=st, padding=pd)
            if layout == "NHWC":
                ref = ref.permute(0, 2, 3, 1)
            err = ((y[:2].double() - ref).abs().max() / ref.abs().max()).item()
            P = ref.shape[2] if layout == "NCHW" else ref.shape[1]
        else:
            x = rng.standard_normal(xs).astype(np.float32)
            w = (rng.standard_normal(ws) / np.sqrt(C * R * R)).astype(np.float32)
            t0 = time.perf_counter()
            y = igemm.conv2d(x, w, st, pd, layout=layout)
            t = time.perf_counter() - t0
            ref = reference.conv2d_im2col(x, w, st, pd, 1, layout)
            err = float(np.abs(y - ref).max() / np.abs(ref).max())
            P = y.shape[2] if layout == "NCHW" else y.shape[1]
        flops = 2 * N * K * P * P * C * R * R
        rows.append((name, t * 1e6, flops / t / 1e12, err))
    print(f"\nigemm demo: ResNet-50 conv layers, N={N}, {dtype if gpu else 'float32'} {layout}"
          f"{'' if gpu else ' (numpy backend)'}\n")
    print(f"| {'layer':24s} | {'time (us)':>10s} | {'TFLOP/s':>8s} | {'max rel err':>11s} |")
    print(f"|{'-' * 26}|{'-' * 12}|{'-' * 10}|{'-' * 13}|")
    bad = 0
    tol = {"float16": 1e-2, "bfloat16": 2e-2, "float32": 1e-5}[dtype if gpu else "float32"]
    for name, us, tf, err in rows:
        flag = "" if err <= tol else "  FAIL"
        bad += err > tol
        print(f"| {name:24s} | {us:10.1f} | {tf:8.2f} | {err:11.2e} |{flag}")
    return 1 if bad else 0


def precompile(args) -> int:
    """Compile the kernels of the ResNet-50 benchmark set (and their fused epilogues) in parallel."""
    import igemm
    from igemm import _build
    from igemm import epilogues as ep
    from igemm.conv import _transpose, _unfold

    def chains(K):
        v = [np.ones(K, np.float32)] * 4
        return {"none": ep.chain(), "bn_relu_mask": ep.chain(ep.BatchNorm(*v), ep.ReLU(mask=True)),
                "bn_add_relu_mask": ep.chain(ep.BatchNorm(*v), ep.Add(), ep.ReLU(mask=True))}
    configs = [c.split(":") for c in args.configs.split(",")]
    kernels = {}
    for dtype, layout, precision in configs:
        for _, C, K, H, R, st, pd in RESNET50:
            xs, ws = _shapes(layout, args.batch, C, K, H, R)
            for cname, ch in chains(K).items():
                if cname != "none" and not args.epilogues:
                    continue
                paths = [("auto", None), ("native", None)] if layout == "NCHW" else [("auto", None)]
                if C * (4 if dtype == "float32" else 2) < 16:      # bench_conv's -elem configs: no unfold
                    paths.append(("auto", False))
                for path, unfold in paths:                          # bench_conv times each
                    plan = igemm.Conv2dPlan(xs, ws, dtype, layout, st, pd, epilogue=ch, precision=precision,
                                            device="numpy", arch=args.arch,
                                            options=igemm.Conv2dOptions(nchw_path=path, unfold=unfold))
                    name, src = plan.kernel()
                    kernels[src] = name
                    if plan.spec().load_b == "tma":   # bench_conv's fp16-NHWC-gather times the cp.async gather too
                        name, src = plan.with_options(igemm.Conv2dOptions(
                            nchw_path=path, unfold=unfold, config={"load_a": "vec", "load_b": "vec"})).kernel()
                        kernels[src] = name
    t0 = time.time()
    n = _build.compile_many(((name, src) for src, name in kernels.items()), args.arch, args.jobs)
    n += _transpose.precompile(args.arch, args.jobs)      # the NCHW transpose path's kernels
    n += _unfold.precompile(args.arch, args.jobs)         # the width unfold's (conv1)
    print(f"{n} kernels for {args.arch} in {time.time() - t0:.0f} s into {_build.cache_dir()}")
    return 0


def info(args) -> int:
    import igemm
    from igemm import _build
    print("igemm", igemm.__version__, "backend:", igemm.get_backend())
    try:
        print("compiler:", _build.find_toolchain().describe())
    except Exception as e:
        print("compiler: none -", e)
    print("CUTLASS headers:", _build.cutlass_include_dir())
    try:
        print("kernel cache:", _build.cache_status())
    except ValueError as e:
        print("kernel cache: error:", e)
        return 1
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m igemm")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run the ResNet-50 conv layers through igemm and check them")
    d.add_argument("--layout", default="NHWC", choices=["NCHW", "NHWC"])
    d.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    d.add_argument("--batch", type=int, default=32)
    d.set_defaults(fn=demo)
    p = sub.add_parser("precompile", help="fill the kernel cache for the ResNet-50 benchmark set")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--configs", default="float16:NHWC:strict,float16:NCHW:strict,float32:NCHW:strict")
    p.add_argument("--epilogues", action="store_true", help="also the fused BN-ReLU(-Add) variants")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    p.set_defaults(fn=precompile)
    i = sub.add_parser("info", help="toolchain, backend and cache")
    i.set_defaults(fn=info)
    sub.add_parser("compare", help="implicit GEMM vs im2col+GEMM vs FFT vs direct vs cuDNN (igemm.baselines; "
                   "`python -m igemm compare --help`)", add_help=False)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["compare"]:          # the baselines package, imported only when asked for
        from .baselines.compare import main as compare
        return compare(argv[1:])
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
