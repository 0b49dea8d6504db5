"""Fused conv epilogues vs the conv alone, PyTorch's eager chain and cuDNN's fused calls (same run).

    python benchmarks/bench_epilogues.py --out DIR [--configs fp16-NHWC,fp16-NCHW]

Per ResNet-50 layer (N=32): (a) igemm conv; (b) igemm conv+BN+ReLU with mask; (c) igemm
conv+BN+Add+ReLU with mask; (b) through the function form, ``igemm.conv2d_bn_relu(x, w, gamma, beta, mean, var,
return_mask=True)`` on torch tensors, called back to back (its BN fold cached between calls); peers: eager
``relu(batch_norm(conv2d(x)))`` (eval) and ``+ residual``, ``torch.cudnn_convolution_relu`` /
``torch.cudnn_convolution_add_relu`` with BN folded into w and b.
Then ``relu_backward`` vs ``torch.ops.aten.threshold_backward`` on (16,32,112,112) fp32.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402
from _harness import Bench, geomean  # noqa: E402
from bench_conv import CONFIGS, RESNET50, make_inputs, torch_views  # noqa: E402


def main(argv=None):
    ap = _harness.parser(__doc__)
    ap.add_argument("--configs", default="fp16-NHWC,fp16-NCHW")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layers", default="")
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    import igemm
    from igemm import epilogues as ep
    torch.backends.cudnn.benchmark = True
    bench = Bench("bench_epilogues", args)
    bw = _harness.copy_bandwidth(bench)
    layers = [RESNET50[int(i)] for i in args.layers.split(",")] if args.layers else RESNET50
    stats = {}
    for cfg in args.configs.split(","):
        dtype, layout, precision, _ = CONFIGS[cfg]
        tdt = getattr(torch, dtype)
        for name, C, K, H, R, st, pd in layers:
            N = args.batch
            P = (H + 2 * pd - R) // st + 1
            eb = 2 if dtype != "float32" else 4
            io_bytes = (N * C * H * H + 2 * N * K * P * P) * eb
            xs, w = make_inputs(torch, N, C, K, H, R, dtype, layout, io_bytes)
            g = torch.rand(K, device="cuda") + 0.5
            b = torch.randn(K, device="cuda") * 0.1
            m = torch.randn(K, device="cuda") * 0.1
            v = torch.rand(K, device="cuda") + 0.5
            yshape = (N, K, P, P) if layout == "NCHW" else (N, P, P, K)
            res = [torch.randn(yshape, device="cuda", dtype=tdt) for _ in range(len(xs))]
            plan_a = igemm.Conv2dPlan(xs[0].shape, w.shape, dtype, layout, st, pd, precision=precision)
            plan_b = igemm.Conv2dPlan(xs[0].shape, w.shape, dtype, layout, st, pd, precision=precision,
                                      epilogue=ep.chain(ep.BatchNorm(g, b, m, v), ep.ReLU(mask=True)))
            plan_c = igemm.Conv2dPlan(xs[0].shape, w.shape, dtype, layout, st, pd, precision=precision,
                                      epilogue=ep.chain(ep.BatchNorm(g, b, m, v), ep.Add(), ep.ReLU(mask=True)))
            words = (N * K * P * P + 31) // 32
            outs = [torch.empty(yshape, device="cuda", dtype=tdt) for _ in range(2)]
            masks = [torch.empty(words, device="cuda", dtype=torch.int32) for _ in range(2)]
            ta = bench.time(lambda i: plan_a(xs[i], w, out=outs[i % 2]), len(xs))
            tb = bench.time(lambda i: plan_b(xs[i], w, out=outs[i % 2], mask_out=masks[i % 2]), len(xs))
            tc = bench.time(lambda i: plan_c(xs[i], w, residual=res[i], out=outs[i % 2], mask_out=masks[i % 2]),
                            len(xs))
            tf = bench.time(lambda i: igemm.conv2d_bn_relu(xs[i], w, g, b, m, v, 1e-5, st, pd, layout=layout,
                                                           precision=precision, return_mask=True), len(xs))
            tv = [torch_views(x, w, layout) for x in xs]
            rv = [r.permute(0, 3, 1, 2) if layout == "NHWC" else r for r in res]
            def eager_b(i):
                return F.relu(F.batch_norm(F.conv2d(tv[i][0], tv[i][1], stride=st, padding=pd), m, v, g, b, False))
            def eager_c(i):
                return F.relu(F.batch_norm(F.conv2d(tv[i][0], tv[i][1], stride=st, padding=pd), m, v, g, b, False)
                              + rv[i])
            te_b = bench.time(eager_b, len(xs))
            te_c = bench.time(eager_c, len(xs))
            scale = g / torch.sqrt(v + 1e-5)
            wt = tv[0][1]
            wf = (wt.float() * scale.view(-1, 1, 1, 1)).to(tdt)
            if layout == "NHWC":
                wf = wf.contiguous(memory_format=torch.channels_last)
            bf = (b - m * scale).to(tdt)
            try:
                td_b = bench.time(lambda i: torch.cudnn_convolution_relu(tv[i][0], wf, bf, (st, st), (pd, pd),
                                                                         (1, 1), 1), len(xs))
                td_c = bench.time(lambda i: torch.cudnn_convolution_add_relu(tv[i][0], wf, rv[i], 1.0, bf,
                                                                             (st, st), (pd, pd), (1, 1), 1), len(xs))
            except Exception as e:  # cuDNN may reject a fused configuration
                bench.note(f"{cfg} {name}: cuDNN fused call failed: {type(e).__name__}: {str(e)[:120]}")
                td_b = td_c = float("nan")
            st_ = stats.setdefault(cfg, {"b_over_a": [], "c_over_a": [], "b_over_eager": [], "b_over_dnn": [],
                                         "c_over_dnn": [], "c_bound": [], "fn_over_dnn": []})
            # DRAM floor of (c): x, w, y, the residual and the mask once each at the measured copy bandwidth;
            # (c)/(a) cannot go below max(ta, floor) / ta, whatever the kernel
            c_floor = ((N * C * H * H + K * C * R * R + 2 * N * K * P * P) * eb + 4 * words) / bw
            st_["c_bound"].append(max(ta, c_floor) / ta)
            st_["b_over_a"].append(tb / ta)
            st_["c_over_a"].append(tc / ta)
            st_["b_over_eager"].append(tb / te_b)
            st_["b_over_dnn"].append(tb / td_b)
            st_["c_over_dnn"].append(tc / td_c)
            st_["fn_over_dnn"].append(tf / td_b)
            bench.row(config=cfg, layer=name, conv_us=ta * 1e6, bn_relu_mask_us=tb * 1e6,
                      bn_add_relu_mask_us=tc * 1e6, b_over_a=tb / ta, c_over_a=tc / ta,
                      eager_bn_relu_us=te_b * 1e6, eager_bn_add_relu_us=te_c * 1e6, b_over_eager=tb / te_b,
                      cudnn_relu_us=td_b * 1e6, cudnn_add_relu_us=td_c * 1e6, b_over_cudnn=tb / td_b,
                      c_over_cudnn=tc / td_c, fn_bn_relu_mask_us=tf * 1e6, fn_over_cudnn=tf / td_b,
                      c_floor_us=c_floor * 1e6, c_over_a_bound=max(ta, c_floor) / ta)
            del xs, res, outs, masks
            torch.cuda.empty_cache()
    for cfg, s in stats.items():
        bench.note(f"{cfg}: (b)/(a) worst {max(s['b_over_a']):.3f}, (c)/(a) worst {max(s['c_over_a']):.3f} "
                   f"(bar <= 1.10); (b)/eager geomean {geomean(s['b_over_eager']):.3f} (bar <= 0.6); "
                   f"(b)/cudnn_convolution_relu geomean {geomean(s['b_over_dnn']):.3f}; "
                   f"(c)/cudnn_convolution_add_relu geomean {geomean(s['c_over_dnn']):.3f}; "
                   f"conv2d_bn_relu(return_mask=True)/cudnn_convolution_relu geomean {geomean(s['fn_over_dnn']):.3f} "
                   f"(bar <= 1.0); "
                   f"(c)/(a) lower bound from (c)'s DRAM bytes: worst {max(s['c_bound']):.2f}")
    # relu_backward vs threshold_backward
    shape = (16, 32, 112, 112)
    n_sets = _harness.n_rotations(3 * 4 * 16 * 32 * 112 * 112)
    ys = [torch.randn(shape, device="cuda") for _ in range(n_sets)]
    dys = [torch.randn(shape, device="cuda") for _ in range(n_sets)]
    msk = [igemm.relu_mask(y) for y in ys]
    dx = torch.empty(shape, device="cuda")
    t_ig = bench.time(lambda i: igemm.relu_backward(dys[i], msk[i], out=dx), n_sets)
    t_th = bench.time(lambda i: torch.ops.aten.threshold_backward(dys[i], ys[i], 0.0), n_sets)
    nbytes = 16 * 32 * 112 * 112 * 4
    bench.row(config="fp32", layer="relu_backward (16,32,112,112)", conv_us=float("nan"),
              igemm_us=t_ig * 1e6, threshold_backward_us=t_th * 1e6, ratio=t_ig / t_th,
              igemm_GBps=(2 * nbytes + nbytes / 32) / t_ig / 1e9)
    bench.note(f"relu_backward / threshold_backward = {t_ig / t_th:.3f} (bar <= 0.65)")
    bench.finish()


if __name__ == "__main__":
    main()
