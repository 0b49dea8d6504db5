"""``python -m igemm demo | train-demo | precompile | compare | info``."""
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


def _host(a: np.ndarray, dtype: str) -> np.ndarray:
    """float data as a host array of ``dtype`` (bfloat16 through ml_dtypes)."""
    if dtype == "bfloat16":
        import ml_dtypes
        return a.astype(ml_dtypes.bfloat16)
    return a.astype(dtype)


def _gpu_layer(plan, x: np.ndarray, w: np.ndarray, dtype: str, reps: int = 20):
    """(seconds per call, y on the host) for a plan launched on igemm's own device arrays (no framework)."""
    from cuda.bindings import driver

    from igemm import _runtime
    dev = plan.device_id
    stream = _runtime.device(dev).create_stream()
    xd, wd = (_runtime.to_device(_runtime.as_tensor(a, n), dev, stream)[1] for a, n in ((x, "x"), (w, "w")))
    y = _runtime.DeviceArray(plan.y_shape, dtype, dev, stream)
    plan(xd, wd, out=y, stream=stream)                     # compile, load, warm up
    h = driver.CUstream(int(stream.handle))
    e0, e1 = driver.cuEventCreate(0)[1], driver.cuEventCreate(0)[1]
    driver.cuEventRecord(e0, h)
    for _ in range(reps):
        plan(xd, wd, out=y, stream=stream)
    driver.cuEventRecord(e1, h)
    driver.cuEventSynchronize(e1)
    ms = driver.cuEventElapsedTime(e0, e1)[1]
    for e in (e0, e1):
        driver.cuEventDestroy(e)
    return ms * 1e-3 / reps, y.get(stream)


def demo(args) -> int:
    """ResNet-50's conv layers through igemm, each checked against the float64 reference: the sizes run are
    the sizes printed (the numpy backend, without a GPU, runs them at 1/8 of the spatial size by default)."""
    import re

    import igemm
    from igemm import reference
    gpu = igemm.get_backend() == "cuda"
    layout, dtype = args.layout, args.dtype
    N = args.batch if args.batch is not None else (32 if gpu else 1)
    scale = args.scale if args.scale is not None else (1 if gpu else 8)
    if N < 1 or scale < 1:
        print("demo: --batch and --scale must be positive integers", file=sys.stderr)
        return 2
    if dtype == "bfloat16":
        try:
            import ml_dtypes  # noqa: F401  (host bfloat16 arrays)
        except ImportError:
            print("demo: --dtype bfloat16 needs ml_dtypes for its host arrays (a dependency of igemm: "
                  "pip install ml-dtypes)", file=sys.stderr)
            return 2
    rng = np.random.default_rng(0)
    if not gpu:
        print(f"No CUDA GPU visible: running the numpy backend (float64 reference, rounded to {dtype}) on the CPU.")
    rows = []
    for name, C, K, H, R, st, pd in RESNET50:
        Hs = max(R, H // scale)
        xs, ws = _shapes(layout, N, C, K, Hs, R)
        x = _host(rng.standard_normal(xs), dtype)
        w = _host(rng.standard_normal(ws) / np.sqrt(C * R * R), dtype)
        if gpu:
            t, y = _gpu_layer(igemm.Conv2dPlan(xs, ws, dtype, layout, st, pd), x, w, dtype)
        else:
            t0 = time.perf_counter()
            y = igemm.conv2d(x, w, st, pd, layout=layout)
            t = time.perf_counter() - t0
        ref = reference.conv2d_im2col(x[:1].astype(np.float64), w.astype(np.float64), st, pd, 1, layout)
        err = float(np.abs(y[:1].astype(np.float64) - ref).max() / np.abs(ref).max())
        P = ref.shape[2] if layout == "NCHW" else ref.shape[1]
        flops = reference.conv_flops(N, C, K, R, R, P, P)
        rows.append((re.sub(r"@\d+$", f"@{Hs}", name), t * 1e6, flops / t, err))
    unit, div, fmt = ("TFLOP/s", 1e12, "10.1f") if gpu else ("GFLOP/s", 1e9, "10.3f")
    print(f"\nigemm demo: ResNet-50 conv layers, N={N}, {dtype} {layout}, {'cuda' if gpu else 'numpy'} backend"
          f"{f', spatial size 1/{scale}' if scale != 1 else ''} (error of image 0 against float64)\n")
    print(f"| {'layer':24s} | {'time (us)':>10s} | {unit:>10s} | {'max rel err':>11s} |")
    print(f"|{'-' * 26}|{'-' * 12}|{'-' * 12}|{'-' * 13}|")
    bad = 0
    tol = {"float16": 1e-2, "bfloat16": 2e-2, "float32": 1e-5}[dtype]
    for name, us, rate, err in rows:
        flag = "" if err <= tol else "  FAIL"
        bad += err > tol
        print(f"| {name:24s} | {us:10.1f} | {rate / div:{fmt}} | {err:11.2e} |{flag}")
    if gpu and args.network:
        bad += _network(N)
    return 1 if bad else 0


def _network(N: int) -> int:
    """A whole torchvision ResNet-50 through igemm.nn.convert (fp16 channels_last inference) against PyTorch and
    cuDNN's fused calls: time per forward (one CUDA graph each) and error against the fp32 model. Skipped, with
    a line saying why, without torch or torchvision."""
    try:
        import torch
        import torchvision
    except ImportError as e:
        print(f"\n(whole network skipped: {e.name} is not installed; the layers above are the demo)")
        return 0
    import igemm.nn as inn
    from igemm._timing import GpuTimer
    from igemm.baselines.cudnn_fused import cudnn_fused
    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda()
    with torch.no_grad():
        model(torch.randn(16, 3, 224, 224, device="cuda"))          # BN statistics (train mode), then eval
        model.eval()
        x32 = torch.randn(N, 3, 224, 224, device="cuda")
        ref = model(x32).double()
        half = model.half().to(memory_format=torch.channels_last)
        x = x32.half().contiguous(memory_format=torch.channels_last)
        conv = inn.convert(half)
        inn.precompile(conv, x)
        peers = {"igemm.nn.convert": conv, "cuDNN fused (BN folded)": cudnn_fused(half), "PyTorch": half}
        timer = GpuTimer()
        print(f"\nigemm demo: torchvision ResNet-50, N={N}, fp16 channels_last, inference (one CUDA graph a forward)\n")
        print(f"| {'model':24s} | {'ms':>8s} | {'rel err vs fp32':>15s} |")
        print(f"|{'-' * 26}|{'-' * 10}|{'-' * 17}|")
        errs = {}
        for name, m in peers.items():
            t = timer.time(lambda i, m=m: m(x), graph=True)["median"]
            errs[name] = float(((m(x).double() - ref).norm() / ref.norm()).item())
            print(f"| {name:24s} | {t * 1e3:8.3f} | {errs[name]:15.2e} |")
    return int(errs["igemm.nn.convert"] > 2 * errs["PyTorch"] + 1e-3)


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
                    if layout == "NHWC" and plan.spec().load_b == "tma":   # bench_conv's fp16-NHWC-gather times
                        # the cp.async gather too
                        name, src = plan.with_options(igemm.Conv2dOptions(
                            nchw_path=path, unfold=unfold, config={"load_a": "vec", "load_b": "vec"})).kernel()
                        kernels[src] = name
    if args.backward:                                       # bench_backward's plans
        from igemm.conv import _moves, _native, _native_nchw, _wgrad_small
        from igemm.layers import RESNET50_MORE
        kernels.update({src: name for name, src in _moves.all_variants() + _native.all_variants()
                        + _native_nchw.all_variants() + _wgrad_small.all_variants()})
        for dtype, layout, precision in configs:
            for _, C, K, H, R, st, pd in RESNET50 + RESNET50_MORE:
                xs, ws = _shapes(layout, args.batch, C, K, H, R)
                for cls in (igemm.Conv2dGradInputPlan, igemm.Conv2dGradWeightPlan):
                    for fused in (False, True):        # (wgrad's GEMM form reads another operand in place)
                        plan = cls(xs, ws, dtype, layout, st, pd, precision=precision, mask=fused, device="numpy",
                                   arch=args.arch)
                        for sub in plan.sub_plans():
                            name, src = sub.kernel()
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
    from igemm import _hostlaunch
    print("launch step:", _hostlaunch.status())
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m igemm")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run the ResNet-50 conv layers through igemm and check them")
    d.add_argument("--layout", default="NHWC", choices=["NCHW", "NHWC"])
    d.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    d.add_argument("--batch", type=int, default=None, help="images per layer (default: 32 on a GPU, 1 without)")
    d.add_argument("--scale", type=int, default=None,
                   help="divide the spatial size by this (default: 1 on a GPU, 8 without)")
    d.add_argument("--no-network", dest="network", action="store_false",
                   help="skip the whole-network run (a GPU with torch and torchvision: ResNet-50 via igemm.nn)")
    d.set_defaults(fn=demo)
    from . import _train_demo            # (imports torch only when it runs)
    t = sub.add_parser("train-demo", help="train a ResNet through igemm.nn next to PyTorch (synthetic data, AMP)")
    _train_demo.add_arguments(t)
    t.set_defaults(fn=_train_demo.train_demo)
    p = sub.add_parser("precompile", help="fill the kernel cache for the ResNet-50 benchmark set")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--configs", default="float16:NHWC:strict,float16:NCHW:strict,float32:NCHW:strict")
    p.add_argument("--epilogues", action="store_true", help="also the fused BN-ReLU(-Add) variants")
    p.add_argument("--backward", action="store_true", help="also the backward's (bench_backward's layers)")
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
