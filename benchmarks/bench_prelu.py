"""PReLU forward and backward: igemm vs PyTorch (``F.prelu`` and its autograd backward) in the same run.

    python benchmarks/bench_prelu.py --out DIR [--quick]

Cases: (96,64,112,112) fp32 per-channel NCHW (the issue's bar: >= 90% of the measured copy bandwidth; PyTorch
240 us on an H200), then the InsightFace-like shapes at N=128 (64x56^2, 128x28^2, 256x14^2, 512x7^2) in fp16 and
fp32, NCHW and NHWC (torch on the channels_last tensor of the same memory). Forward GB/s counts x read + y
written; backward counts dy and x read + dx written (dalpha is negligible). Inputs rotate past L2.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402
from _harness import Bench  # noqa: E402

BIG = (96, 64, 112, 112)
INSIGHTFACE = [(128, 64, 56, 56), (128, 128, 28, 28), (128, 256, 14, 14), (128, 512, 7, 7)]


def cases(quick: bool):
    out = [(BIG, "float32", "NCHW", True)]
    for dtype in ("float16", "float32"):
        for layout in ("NCHW", "NHWC"):
            for shape in INSIGHTFACE:
                out.append((shape, dtype, layout, False))
    if quick:
        out = out[:1] + [c for c in out[1:] if c[2] == "NCHW"]
    return out


def main(argv=None):
    ap = _harness.parser(__doc__)
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    import igemm
    pm = sys.modules["igemm.prelu"]
    bench = Bench("bench_prelu", args)
    bw = _harness.copy_bandwidth(bench)
    bench.note(f"copy bandwidth {bw / 1e9:.0f} GB/s (read+write, torch copy_ of 1 GiB)")
    for shape, dtype, layout, barred in cases(args.quick):
        tdt = getattr(torch, dtype)
        N, C, H, W = shape
        numel = N * C * H * W
        size = 2 if dtype != "float32" else 4

        def make(i):
            x = torch.randn(shape, device="cuda", dtype=tdt)
            dy = torch.randn(shape, device="cuda", dtype=tdt)
            if layout == "NHWC":   # channels_last memory; igemm gets the NHWC view, torch the NCHW one
                x = x.to(memory_format=torch.channels_last)
                dy = dy.to(memory_format=torch.channels_last)
            return x, dy
        sets = _harness.rotating(make, 3 * numel * size, cap=16)
        w = (torch.rand(C, device="cuda") * 0.5).to(tdt)

        def ig_view(t):
            return t.permute(0, 2, 3, 1) if layout == "NHWC" else t

        def ig_fwd(i):
            return igemm.prelu(ig_view(sets[i][0]), w, layout=layout)

        def th_fwd(i):
            return F.prelu(sets[i][0], w)

        def ig_bwd(i):
            return igemm.prelu_backward(ig_view(sets[i][1]), ig_view(sets[i][0]), w, layout=layout)

        # torch's backward as autograd runs it (aten._prelu_kernel_backward, then the weight's reduction),
        # called directly: autograd.grad inside a CUDA-graph capture fails, and a failed capture leaves
        # torch's CUDA generator marked as capturing (every later torch.randn then raises)
        wv = w.view(1, C, 1, 1)
        red_dims = (0, 2, 3)

        def th_bwd(i):
            x, dy = sets[i]
            dx, dw = torch.ops.aten._prelu_kernel_backward(dy, x, wv)
            return dx, dw.sum(red_dims)

        xr0 = sets[0][0].detach().requires_grad_(True)
        wr0 = w.detach().clone().requires_grad_(True)
        ag_dx, ag_dw = torch.autograd.grad(F.prelu(xr0, wr0), (xr0, wr0), sets[0][1])

        # correctness spot check
        y = ig_fwd(0)
        err = float((y.float() - ig_view(th_fwd(0)).float()).abs().max())
        dx, da = ig_bwd(0)
        tdx, tdw = th_bwd(0)
        assert float((tdx.float() - ag_dx.float()).abs().max()) == 0.0, "aten backward differs from autograd's dx"
        del xr0, wr0, ag_dx, ag_dw
        err_dx = float((dx.float() - ig_view(tdx).float()).abs().max())
        err_da = float((da.float() - tdw.float()).abs().max() / tdw.float().abs().max().clamp_min(1e-30))
        t_ig, t_th = bench.time(ig_fwd, len(sets)), bench.time(th_fwd, len(sets))
        tb_ig, tb_th = bench.time(ig_bwd, len(sets)), bench.time(th_bwd, len(sets))
        fwd_bytes, bwd_bytes = 2 * numel * size, 3 * numel * size
        x0 = ig_view(sets[0][0])
        cfg = pm.forward_config(numel, C, H * W if layout == "NCHW" else 1, dtype, alpha_kind="channel",
                                vec=pm._vec_aligned(dtype, x0.data_ptr()), alpha_dtype=dtype, alpha_ptr=w.data_ptr())
        row = dict(shape="x".join(map(str, shape)), dtype=dtype, layout=layout, mode=f"{cfg.mode}/v{cfg.vec}",
                   fwd_us=t_ig * 1e6, torch_fwd_us=t_th * 1e6, fwd_ratio=t_ig / t_th, fwd_GBps=fwd_bytes / t_ig / 1e9,
                   fwd_pct_copy=100 * fwd_bytes / t_ig / bw,
                   bwd_us=tb_ig * 1e6, torch_bwd_us=tb_th * 1e6, bwd_ratio=tb_ig / tb_th,
                   bwd_GBps=bwd_bytes / tb_ig / 1e9, bwd_pct_copy=100 * bwd_bytes / tb_ig / bw,
                   err_y=err, err_dx=err_dx, rel_err_dalpha=err_da)
        if barred:
            row.update(bar="fwd >= 90% copy bw", bar_met=fwd_bytes / t_ig >= 0.9 * bw)
        bench.row(**row)
        sets = None  # free before the next case
        torch.cuda.empty_cache()
    bench.note("fwd: igemm.prelu vs F.prelu; bwd: igemm.prelu_backward (dx, dalpha) vs the kernels autograd runs for "
               "F.prelu w.r.t. (x, weight): aten._prelu_kernel_backward + the weight sum; NHWC: igemm on the NHWC view of channels_last memory, torch on the "
               "channels_last NCHW tensor")
    bench.finish()


if __name__ == "__main__":
    main()
