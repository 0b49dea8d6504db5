"""Time every kernel candidate on the ResNet-50 benchmark layers (to tune ``choose_config``).

    python tools/sweep.py --out DIR [--configs fp16-NHWC,fp16-NCHW] [--compile-only] [--jobs 16]
        [--layers 0,2 | --shapes 'C,K,H,R,stride,pad;...'] [--epilogue none|bn_relu_mask|bn_add_relu_mask]

Compiles all candidates in parallel first (or only that, with --compile-only, to fill a cache that can
travel), then times each with CUDA graphs (benchmarks/_harness.py) and prints, per layer, the default
choice, the best candidate and the five fastest.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sweep-out")
    ap.add_argument("--configs", default="fp16-NHWC,fp16-NCHW")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--epilogue", default="none", choices=["none", "bn_relu_mask", "bn_add_relu_mask"])
    ap.add_argument("--layers", default="", help="comma-separated layer indices (default: all)")
    ap.add_argument("--shapes", default="", help="layers of their own instead: 'C,K,H,R,stride,pad;...'")
    args = ap.parse_args(argv)
    from bench_conv import CONFIGS, RESNET50

    from igemm import _build
    from igemm import epilogues as ep
    from igemm.conv._problem import ConvProblem
    from igemm.conv._rules import candidates
    from igemm.conv._paths import kernel_setup
    from igemm.conv._spec import stub as _stub
    add = args.epilogue == "bn_add_relu_mask"

    def make_chain(*bn):
        if args.epilogue == "none":
            return ep.chain()
        return ep.chain(ep.BatchNorm(*bn), *((ep.Add(),) if add else ()), ep.ReLU(mask=True))
    chain = make_chain(0, 0, 0, 0)
    work = []
    for cfg in args.configs.split(","):
        dtype, layout, precision, _ = CONFIGS[cfg]
        layers = [RESNET50[int(i)] for i in args.layers.split(",")] if args.layers else RESNET50
        if args.shapes:
            layers = []
            for sh in args.shapes.split(";"):
                C, K, H, R, st, pd = (int(v) for v in sh.split(","))
                layers.append((f"{R}x{R}/{st} {C}->{K} @{H}", C, K, H, R, st, pd))
        for name, C, K, H, R, st, pd in layers:
            pb = ConvProblem.of(args.batch, C, H, H, K, R, R, (st, st), (pd, pd), (1, 1), dtype, layout, precision,
                                chain, dtype)
            # the kernel's own problem (NCHW: the transpose path's NHWC-in/NCHW-out kernel where it applies)
            work.append((cfg, name, pb, candidates(kernel_setup(pb, arch=args.arch)[1], args.arch)))
    specs = {s: _stub(s) for _, _, _, cs in work for s in cs}
    print(f"{len(specs)} distinct kernels", flush=True)

    def one(item):
        spec, stub = item
        try:
            _build.compile_cubin(stub, args.arch, name=spec.name())
        except Exception as e:
            return f"FAILED {spec.name()}: {str(e)[:300]}"
        return None
    with ThreadPoolExecutor(args.jobs) as ex:
        for r in ex.map(one, specs.items()):
            if r:
                print(r, flush=True)
    if args.compile_only:
        return 0

    import torch

    import _harness
    import igemm
    bench = _harness.Bench("sweep", argparse.Namespace(quick=True, reps=20, warmup=3, out=args.out))
    results = []
    for cfg, name, pb, cands in work:
        tdt = getattr(torch, pb.dtype)
        xs = (pb.N, pb.C, pb.H, pb.W) if pb.layout == "NCHW" else (pb.N, pb.H, pb.W, pb.C)
        wsh = (pb.K, pb.C, pb.R, pb.S) if pb.layout == "NCHW" else (pb.K, pb.R, pb.S, pb.C)
        io = (pb.N * pb.C * pb.H * pb.W + pb.M * pb.K) * 2
        x = _harness.rotating(lambda i: torch.randn(xs, device="cuda", dtype=tdt), io, cap=8)
        w = torch.randn(wsh, device="cuda", dtype=tdt) / (pb.C * pb.R * pb.S) ** 0.5
        y = torch.empty((pb.N, pb.K, pb.P, pb.Q) if pb.layout == "NCHW" else (pb.N, pb.P, pb.Q, pb.K),
                        device="cuda", dtype=tdt)
        mask = torch.empty((y.numel() + 31) // 32, device="cuda", dtype=torch.int32)
        g, b, m, v = (torch.rand(pb.K, device="cuda") + 0.5 for _ in range(4))
        real_chain = make_chain(g, b, m, v)
        res = _harness.rotating(lambda i: torch.randn_like(y), io, cap=8) if add else None
        kw = {"out": y} if not chain.mask else {"out": y, "mask_out": mask}
        kws = [{**kw, "residual": res[i]} if add else kw for i in range(len(x))]   # (res: as many sets as x)
        times = []
        ref = None
        for spec in cands:
            try:
                plan = igemm.Conv2dPlan(xs, wsh, pb.dtype, pb.layout, pb.stride, pb.padding, epilogue=real_chain, options=igemm.Conv2dOptions(config=spec))
                t = bench.time(lambda i: plan(x[i], w, **kws[i]), len(x))
                out = plan(x[0], w, **kws[0])
                out = out[0] if isinstance(out, tuple) else out
                if ref is None:
                    ref = out.float().clone()
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                times.append((t, spec, err))
            except Exception as e:
                print(f"{cfg} {name} {spec.name()}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        times.sort(key=lambda r: r[0])
        default_t = next((t for t, s, _ in times if s == cands[0]), float("nan"))
        best_t, best, err = times[0]
        print(f"\n{cfg} {name}: default {cands[0].name()} s{cands[0].splits} {default_t * 1e6:.1f} us; "
              f"best {best.name()} s{best.splits} {best_t * 1e6:.1f} us (x{default_t / best_t:.2f})", flush=True)
        for t, s, e in times[:5]:
            print(f"   {t * 1e6:8.1f} us  {s.name()} splits={s.splits} maxdiff={e:.2g}")
        results.append({"config": cfg, "layer": name, "default_us": default_t * 1e6, "best_us": best_t * 1e6,
                        "best": best.__dict__, "top": [(t * 1e6, s.name(), s.splits) for t, s, _ in times[:8]]})
        del x, y, res, kws
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
