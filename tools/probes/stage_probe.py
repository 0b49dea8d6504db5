"""Probe: deep pipelines (stages 4..12) and split-K for the deep-reduction 3x3 layers at N = 8 and 32.

    python tools/probes/stage_probe.py precompile [arch]   # compile every variant here (no GPU)
    python tools/probes/stage_probe.py run                 # on the GPU: conv alone, fp16 NHWC, cuDNN in the same run

Variants are overrides of the chosen KernelSpec; times are CUDA-graph medians (benchmarks/_harness.py),
inputs rotated past L2 (x only: w is one tensor, as in bench_conv). Each output is checked against cuDNN's.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)

T = {"math": "wgmma"}
def _pt(bm, bn, s, sp):
    return dict(T, bm=bm, wm=bm // 64, bn=bn, stages=s, splits=sp)

def _ws(bn, s, wm=1):
    return dict(math="wgmma_ws", bm=64, wm=wm, bn=bn, stages=s, splits=1)

# (session 13, first run: per-tile stages 4-12 x splits 1-4 and the two-consumer persistent s5 on these
# layers; notes/perf.md) now: the one-consumer persistent kernel (WM = 1) against the chosen
# (second run: the one-consumer persistent kernel WM=1, s4-s12, against the chosen; notes/perf.md) now: the
# cluster k-split (csplit 2: two CTAs a tile, half the k-tiles each, partials handed over in DSMEM)
CS = [{}] + [dict(_ws(64, s), csplit=2) for s in (4, 6, 8)] + [dict(_ws(128, 6), csplit=2)]
LAYERS = [("3x3 512->512 @7", 512, 512, 7, 8, CS), ("3x3 512->512 @7", 512, 512, 7, 1, CS),
          ("3x3 256->256 @14", 256, 256, 14, 1, CS), ("3x3 128->128 @28", 128, 128, 28, 1, CS),
          ("3x3 256->256 @14", 256, 256, 14, 8, CS), ("3x3 64->64 @56", 64, 64, 56, 1, CS),
          ("3x3 512->512 @7", 512, 512, 7, 32, CS)]


def specs(arch="sm_90a"):
    from igemm._heuristics import ConvProblem, choose_config, validate_spec
    from igemm.conv2d import _override
    out = {}
    for li, (name, C, K, H, n, variants) in enumerate(LAYERS):
        pb = ConvProblem(n, C, H, H, K, 3, 3, (1, 1), (1, 1), (1, 1), "float16", "NHWC", "tensorop", (), None)
        base = choose_config(pb, arch)
        for i, v in enumerate(variants):
            try:
                s = _override(base, pb, v) if v else base
            except Exception as e:  # noqa: BLE001
                print("skip", name, n, v, e)
                continue
            if validate_spec(s, pb, raise_=False):
                out[(li, i)] = s
            else:
                print("invalid", name, n, v)
    return out


def main() -> int:
    if sys.argv[1:2] == ["precompile"]:
        from igemm import _build
        from igemm.conv2d import _stub
        arch = sys.argv[2] if len(sys.argv) > 2 else "sm_90a"
        uniq = {s.name(): _stub(s) for s in specs(arch).values()}
        print(f"{_build.compile_many(uniq.items(), arch, None)} kernels")
        return 0
    import argparse

    import torch

    import _harness
    import igemm
    bench = _harness.Bench("stage_probe", argparse.Namespace(quick=True, reps=30, warmup=3, out=None))
    table = specs()
    print("| layer | N | variant | kernel | splits | igemm_us | cudnn_us | ratio | rel_err |\n|---|---|---|---|---|---|---|---|---|")
    for li, (name, C, K, H, n, variants) in enumerate(LAYERS):
        nset = _harness.n_rotations(2 * (n * H * H * C + n * H * H * K))
        xs = [torch.randn(n, H, H, C, device="cuda", dtype=torch.float16) for _ in range(nset)]
        w = torch.randn(K, 3, 3, C, device="cuda", dtype=torch.float16) / (9 * C) ** 0.5
        xc = [x.permute(0, 3, 1, 2) for x in xs]
        wc = w.permute(0, 3, 1, 2)
        t_cudnn = bench.time(lambda j: torch.nn.functional.conv2d(xc[j], wc, padding=1), nset)
        ref = torch.nn.functional.conv2d(xc[0].float(), wc.float(), padding=1).permute(0, 2, 3, 1)
        out = torch.empty(n, H, H, K, device="cuda", dtype=torch.float16)
        for i, v in enumerate(variants):
            s = table.get((li, i))
            if s is None:
                continue
            plan = igemm.Conv2dPlan(tuple(xs[0].shape), tuple(w.shape), "float16", "NHWC", 1, 1, config=s)
            t = bench.time(lambda j: plan(xs[j], w, out=out), nset)
            out.fill_(float("nan"))
            y = plan(xs[0], w, out=out)
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            print(f"| {name} | {n} | {'chosen' if not v else ''} | {s.name().replace('conv_float16_NHWC_', '')} | "
                  f"{s.splits} | {t * 1e6:.1f} | {t_cudnn * 1e6:.1f} | {t / t_cudnn:.2f} | {err:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
