"""Check the benchmark's own fused kernels (bench_epilogues' layers, N=32, fp16): conv+BN+ReLU(mask) and
conv+BN+Add+ReLU(mask) against PyTorch's fp32 chain on the same inputs, outputs and masks poisoned first.
Runs in seconds where the bench kernels are cached, so an A/B run of kernel variants can check each one:

    python tools/probes/epi_check.py [--configs fp16-NHWC,fp16-NCHW] [--layers 0,2]

Per layer and chain: max |y - ref| / max |ref| (fp16 bar 1e-2), mask == (y > 0) of the kernel's own
output everywhere (exact), and mask == (ref > 0) wherever |ref| exceeds the rounding tolerance. Exits 1
on any failure.
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))


def pack_bits(torch, b):
    """The 1-bit mask of a bool tensor in its memory order (bit i % 32 of word i // 32), as int64 words."""
    b = b.reshape(-1)
    pad = (-b.numel()) % 32
    if pad:
        b = torch.cat([b, torch.zeros(pad, dtype=torch.bool, device=b.device)])
    w = (b.view(-1, 32).to(torch.int64) << torch.arange(32, device=b.device, dtype=torch.int64)).sum(1)
    return w


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="fp16-NHWC,fp16-NCHW")
    ap.add_argument("--layers", default="")
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    import igemm
    from igemm import epilogues as ep
    from bench_conv import CONFIGS, RESNET50
    torch.manual_seed(0)
    layers = [RESNET50[int(i)] for i in args.layers.split(",")] if args.layers else RESNET50
    bad = 0
    for cfg in args.configs.split(","):
        dtype, layout, precision, _ = CONFIGS[cfg]
        tdt = getattr(torch, dtype)
        for name, C, K, H, R, st, pd in layers:
            N = args.batch
            P = (H + 2 * pd - R) // st + 1
            x = torch.randn(N, C, H, H, device="cuda", dtype=tdt)
            w = torch.randn(K, C, R, R, device="cuda", dtype=tdt) / (C * R * R) ** 0.5
            g, v = torch.rand(K, device="cuda") + 0.5, torch.rand(K, device="cuda") + 0.5
            b, m = torch.randn(K, device="cuda") * 0.1, torch.randn(K, device="cuda") * 0.1
            r = torch.randn(N, K, P, P, device="cuda", dtype=tdt)
            conv = F.conv2d(x.float(), w.float(), stride=st, padding=pd)
            bn = F.batch_norm(conv, m, v, g, b, False, 0.0, 1e-5)
            if layout == "NHWC":
                to = lambda t: t.permute(0, 2, 3, 1).contiguous()   # noqa: E731
            else:
                to = lambda t: t.contiguous()   # noqa: E731
            xi, wi, ri = to(x), to(w), to(r)
            for chain_name, pre, extra in (("bn_relu_mask", bn, ()), ("bn_add_relu_mask", bn + r.float(), (ep.Add(),))):
                plan = igemm.Conv2dPlan(xi.shape, wi.shape, dtype, layout, st, pd, precision=precision,
                                        epilogue=ep.chain(ep.BatchNorm(g, b, m, v), *extra, ep.ReLU(mask=True)))
                y = torch.full(to(pre).shape, float("nan"), device="cuda", dtype=tdt)
                words = (y.numel() + 31) // 32
                mask = torch.full((words,), -0x55555556, device="cuda", dtype=torch.int32)   # 0xAAAAAAAA
                kw = {"residual": ri} if extra else {}
                plan(xi, wi, out=y, mask_out=mask, **kw)
                torch.cuda.synchronize()
                ref = to(pre)
                yr = torch.relu(ref)
                err = ((y.float() - yr).abs().max() / yr.abs().max()).item()
                mk = mask.to(torch.int64) & 0xFFFFFFFF
                own = bool((mk == pack_bits(torch, y > 0)).all())
                tol = 1e-2 * yr.abs().max().item()
                sure = ref.abs() > tol
                mref = pack_bits(torch, ref > 0)
                sure_w = pack_bits(torch, sure)
                vs_ref = bool(((mk ^ mref) & sure_w).eq(0).all())
                ok = err <= 1e-2 and own and vs_ref and not torch.isnan(y).any().item()
                bad += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {cfg} {name} {chain_name} {plan.spec().name()[:60]}: "
                      f"rel err {err:.2e}, mask==(y>0) {own}, mask==(ref>0) where sure {vs_ref}", flush=True)
    print(f"{bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
