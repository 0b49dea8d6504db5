"""ResNet-50 conv layers: igemm vs cuDNN (torch, cudnn.benchmark=True), timed in the same run.

    python benchmarks/bench_conv.py --out DIR [--configs fp16-NHWC,fp16-NCHW,fp16-NCHW-native,fp32-NCHW] [--batch 32]
    (also: fp16-NHWC-gather, the cp.async gather instead of TMA loads; bf16-NHWC; tf32-NHWC;
     fp32-NHWC, fp32-NCHW-transpose, fp32-NCHW-ffma: strict fp32 on the other paths and the FFMA kernel)

For each layer and configuration: igemm median time (CUDA events, inputs rotated past L2), cuDNN's,
the ratio, TFLOP/s, % of the measured fp16 GEMM peak, the memory floor (bytes / copy bandwidth), the
max relative error against a float64 convolution (igemm's and cuDNN's), and the host time of one plan call.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402
from _harness import Bench, geomean  # noqa: E402

from igemm.layers import RESNET50  # noqa: E402,F401  (bench_epilogues and tools import it from here)

CONFIGS = {  # name: (dtype, layout, igemm precision, cuDNN allow_tf32)
    "fp16-NHWC": ("float16", "NHWC", "strict", False),
    "fp16-NCHW": ("float16", "NCHW", "strict", False),          # igemm's default NCHW path (auto)
    "fp16-NCHW-native": ("float16", "NCHW", "strict", False),   # the NCHW gather, forced (nchw_path="native")
    "fp16-NHWC-gather": ("float16", "NHWC", "strict", False),   # the cp.async gather forced (no TMA loads)
    "fp16-NHWC-pad": ("float16", "NHWC", "strict", False),      # pad_channels=True (C < 8 -> 8: conv1)
    "fp16-NCHW-pad": ("float16", "NCHW", "strict", False),
    "fp16-NHWC-elem": ("float16", "NHWC", "strict", False),     # unfold=False (conv1: the element gather)
    "fp16-NCHW-elem": ("float16", "NCHW", "strict", False),
    "bf16-NHWC": ("bfloat16", "NHWC", "strict", False),
    "fp32-NCHW": ("float32", "NCHW", "strict", False),         # strict fp32: 3xTF32 (tf32x3) by default
    "fp32-NHWC": ("float32", "NHWC", "strict", False),
    "fp32-NCHW-transpose": ("float32", "NCHW", "strict", False),  # nchw_path="transpose"
    "fp32-NCHW-ffma": ("float32", "NCHW", "strict", False),     # the FFMA (simt) kernel, forced
    "fp32-NCHW-elem": ("float32", "NCHW", "strict", False),
    "tf32-NHWC": ("float32", "NHWC", "tf32", True),
}


from igemm.conv._rules import FFMA_CONFIG as FFMA  # noqa: E402  (the strict-fp32 FFMA kernel)


def make_inputs(torch, N, C, K, H, R, dtype, layout, n_sets_bytes):
    tdt = getattr(torch, dtype)
    def one(i):
        x = torch.randn(N, C, H, H, device="cuda", dtype=tdt)
        if layout == "NHWC":
            x = x.permute(0, 2, 3, 1).contiguous()
        return x
    sets = _harness.rotating(one, n_sets_bytes, cap=16)
    w = torch.randn(K, C, R, R, device="cuda", dtype=tdt) / (C * R * R) ** 0.5
    if layout == "NHWC":
        w = w.permute(0, 2, 3, 1).contiguous()
    return sets, w


def torch_views(x, w, layout):
    """NCHW-shaped views for torch (channels_last memory for NHWC)."""
    if layout == "NHWC":
        return x.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2)
    return x, w


def main(argv=None):
    ap = _harness.parser(__doc__)
    ap.add_argument("--configs", default="fp16-NHWC,fp16-NCHW,fp16-NCHW-native,fp32-NCHW")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layers", default="", help="comma-separated layer indices (default: all)")
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    import igemm
    torch.backends.cudnn.benchmark = True
    bench = Bench("bench_conv" + ("" if args.batch == 32 else f"_n{args.batch}"), args)
    peak = gemm_peak(bench, torch)
    bw = _harness.copy_bandwidth(bench)
    bench.note(f"measured fp16 GEMM peak {peak / 1e12:.0f} TFLOP/s (8192^3 torch.matmul); copy bandwidth "
               f"{bw / 1e9:.0f} GB/s (read+write)")
    layers = [RESNET50[int(i)] for i in args.layers.split(",")] if args.layers else RESNET50
    ratios = {}
    for cfg in args.configs.split(","):
        dtype, layout, precision, allow_tf32 = CONFIGS[cfg]
        torch.backends.cudnn.allow_tf32 = allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
        for name, C, K, H, R, st, pd in layers:
            N = args.batch
            P = (H + 2 * pd - R) // st + 1
            eb = 2 if dtype != "float32" else 4
            io_bytes = (N * C * H * H + N * K * P * P + K * C * R * R) * eb
            xs, w = make_inputs(torch, N, C, K, H, R, dtype, layout, io_bytes)
            plan = igemm.Conv2dPlan(xs[0].shape, w.shape, dtype, layout, st, pd, precision=precision, options=igemm.Conv2dOptions(nchw_path=("native" if cfg.endswith("-native") else
                                               "transpose" if cfg.endswith("-transpose") else "auto"), config=FFMA if cfg.endswith("-ffma") else None, pad_channels=True if cfg.endswith("-pad") and C < 8 else None, unfold=False if cfg.endswith(("-elem", "-pad")) else None))
            if cfg.endswith("-gather") and plan.spec().load_b == "tma":
                plan = igemm.Conv2dPlan(xs[0].shape, w.shape, dtype, layout, st, pd, precision=precision, options=igemm.Conv2dOptions(config={"load_a": "vec", "load_b": "vec"}))
            spec = plan.spec()
            outs = [torch.empty(plan.y_shape, device="cuda", dtype=xs[0].dtype) for _ in range(2)]
            t_ig = bench.time(lambda i: plan(xs[i], w, out=outs[i % 2]), len(xs))
            tv = [torch_views(x, w, layout) for x in xs]
            t_dnn = bench.time(lambda i: F.conv2d(tv[i][0], tv[i][1], stride=st, padding=pd), len(xs))
            # correctness against float64
            y = plan(xs[0], w)
            xt, wt = tv[0]
            ref = F.conv2d(xt.double(), wt.double(), stride=st, padding=pd)
            if layout == "NHWC":
                ref = ref.permute(0, 2, 3, 1)
            err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
            y_dnn = F.conv2d(xt, wt, stride=st, padding=pd)          # cuDNN's own error, same settings
            if layout == "NHWC":
                y_dnn = y_dnn.permute(0, 2, 3, 1)
            err_dnn = ((y_dnn.double() - ref).abs().max() / ref.abs().max()).item()
            del y_dnn
            # host time of one call, igemm's plan and torch's F.conv2d (cuDNN) alike
            host = host_time(lambda: plan(xs[0], w, out=outs[0]))
            host_dnn = host_time(lambda: F.conv2d(xt, wt, stride=st, padding=pd))
            flops = 2 * N * K * P * P * C * R * R
            ratio = t_ig / t_dnn
            ratios.setdefault(cfg, []).append(ratio)
            bench.row(config=cfg, layer=name, igemm_us=t_ig * 1e6, cudnn_us=t_dnn * 1e6, ratio=ratio,
                      igemm_tflops=flops / t_ig / 1e12, cudnn_tflops=flops / t_dnn / 1e12,
                      pct_peak=100 * flops / t_ig / peak, mem_floor_us=io_bytes / bw * 1e6,
                      max_rel_err=err, cudnn_rel_err=err_dnn, host_us=host * 1e6, cudnn_host_us=host_dnn * 1e6,
                      kernel=("transpose+" if plan.path == "transpose" else "")
                      + ("unfold+" if plan.path == "unfold" else
                         f"pad{plan.kproblem.C}+" if plan.kproblem.C != plan.problem.C else "") + spec.name())
            del xs, outs
            torch.cuda.empty_cache()
    for cfg, rs in ratios.items():
        bench.note(f"{cfg}: geomean igemm/cuDNN = {geomean(rs):.3f}, worst {max(rs):.3f}")
    bench.finish()


def gemm_peak(bench, torch) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    t = bench.time(lambda i: a @ b, reps=10, warmup=3)
    return 2 * 8192 ** 3 / t


def host_time(fn, n: int = 200) -> float:
    """Host seconds per call (few enough calls that the launch queue never fills and blocks; a deep queue of
    the layer's kernels still costs the driver more per launch than an idle GPU: benchmarks/host_overhead.py
    measures the call on small tensors)."""
    import torch
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    return dt


if __name__ == "__main__":
    main()
