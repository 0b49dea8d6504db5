"""Probe: split-K and tile width for the deep-reduction, few-tile layers (3x3 @7 and @14) at N = 1, 8, 32.

    python tools/split_probe.py precompile [arch]     # compile every variant here (no GPU)
    python tools/split_probe.py run                   # on the GPU: conv alone, fp16 NHWC, cuDNN in the same run

Variants are overrides of the chosen KernelSpec (bn, splits); times are CUDA-graph medians
(benchmarks/_harness.py), inputs rotated past L2. Each variant's output is checked against cuDNN's.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from epi_probe import _defines, _patch_stub, precompile_variants  # noqa: E402  (tools/, the script's folder)

LAYERS = [("3x3 512->512 @7", 512, 512, 7), ("3x3 256->256 @14", 256, 256, 14)]
BATCHES = (1, 8, 32)
# "define": macros prepended to the kernel source (IGEMM_RASTER_M: the m-fastest tile order)
VARIANTS = [{}, {"define": "IGEMM_RASTER_M"}, {"bn": 64}, {"splits": 1}, {"splits": 2}, {"splits": 4},
            {"splits": 8}, {"bn": 64, "splits": 2}, {"bn": 64, "splits": 4}, {"bn": 64, "splits": 8}]




def specs(arch="sm_90a"):
    from igemm._heuristics import ConvProblem, choose_config, validate_spec
    from igemm.conv2d import _override
    out = {}
    for name, C, K, H in LAYERS:
        for n in BATCHES:
            pb = ConvProblem(n, C, H, H, K, 3, 3, (1, 1), (1, 1), (1, 1), "float16", "NHWC", "tensorop", (), None)
            base = choose_config(pb, arch)
            for i, v in enumerate(VARIANTS):
                kw = {k: x for k, x in v.items() if k != "define"}
                try:
                    s = _override(base, pb, kw) if kw else base
                except Exception:
                    continue
                if validate_spec(s, pb, raise_=False):
                    out[(name, n, i)] = s
    return out


def main() -> int:
    if sys.argv[1:2] == ["precompile"]:
        arch = sys.argv[2] if len(sys.argv) > 2 else "sm_90a"
        print(f"{precompile_variants(specs(arch), VARIANTS, arch)} kernels")
        return 0
    import argparse

    import torch

    import _harness
    import igemm
    bench = _harness.Bench("split_probe", argparse.Namespace(quick=True, reps=30, warmup=3, out=None))
    table = specs()
    print("| layer | N | variant | spec | splits | igemm_us | cudnn_us | ratio | rel_err |\n|---|---|---|---|---|---|---|---|---|")
    for name, C, K, H in LAYERS:
        for n in BATCHES:
            nset = _harness.n_rotations(2 * (n * H * H * C + n * H * H * K))
            xs = [torch.randn(n, H, H, C, device="cuda", dtype=torch.float16) for _ in range(nset)]
            w = torch.randn(K, 3, 3, C, device="cuda", dtype=torch.float16) / (9 * C) ** 0.5
            xc = [x.permute(0, 3, 1, 2) for x in xs]           # channels_last views for cuDNN
            wc = w.permute(0, 3, 1, 2)
            t_cudnn = bench.time(lambda j: torch.nn.functional.conv2d(xc[j], wc, padding=1), nset)
            ref = torch.nn.functional.conv2d(xc[0].float(), wc.float(), padding=1).permute(0, 2, 3, 1)
            out = torch.empty(n, H, H, K, device="cuda", dtype=torch.float16)
            for i, v in enumerate(VARIANTS):
                s = table.get((name, n, i))
                if s is None:
                    continue
                _patch_stub(_defines(v))
                plan = igemm.Conv2dPlan(tuple(xs[0].shape), tuple(w.shape), "float16", "NHWC", 1, 1, config=s)
                t = bench.time(lambda j: plan(xs[j], w, out=out), nset)
                out.fill_(float("nan"))
                y = plan(xs[0], w, out=out)
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                print(f"| {name} | {n} | {v or 'chosen'} | {s.bm}x{s.bn} s{s.stages} {s.store} | {s.splits} | "
                      f"{t * 1e6:.1f} | {t_cudnn * 1e6:.1f} | {t / t_cudnn:.2f} | {err:.1e} |", flush=True)
            del xs, xc
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
