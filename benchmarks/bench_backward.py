"""ResNet-50 convolution backward (dgrad, wgrad) and the fused backward chains: igemm vs cuDNN in the same run.

    python benchmarks/bench_backward.py --out DIR [--configs fp16-NHWC,bf16-NHWC,fp16-NCHW,fp32-NCHW]
        [--ops dgrad,wgrad] [--fused mask,bn-chain] [--batch 32] [--layers 0,2,9] [--quick]
    (also: fp32-NHWC; tf32-NHWC, igemm precision="tf32" against cuDNN with allow_tf32)

Rows per configuration x layer x op: igemm's plan (Conv2dGradInputPlan for dgrad, Conv2dGradWeightPlan for
wgrad, called with a preallocated out, inputs rotated past L2) against cuDNN through
``torch.ops.aten.convolution_backward`` (output_mask dgrad [T,F,F], wgrad [F,T,F]; cudnn.benchmark=True; NHWC
passed as NCHW-shaped channels_last views), ratio igemm/cuDNN, igemm's TFLOP/s (2·N·P·Q·K·C·R·S / t), % of
the measured fp16 GEMM peak, and the max relative error (max|a - ref| / max|ref|) of igemm and of cuDNN
against float64 (torch.nn.grad.conv2d_input / conv2d_weight on float64 CUDA copies). fp32 configs are strict:
igemm precision="strict", cuDNN with allow_tf32 False. conv1 (7x7/2, C=3) has wgrad rows only: its input
gradient is never needed in training. ``timing`` says how each peer was timed (graph replay, or CUDA events
where a call could not be captured).

Fused rows (fp16-NHWC only, when it is among --configs):
  <op>+mask  the plan built with mask=True, called with the forward ReLU bitmask; overhead = masked / unmasked
             plan time (unmasked_us); cudnn_us is PyTorch's chain threshold_backward + convolution_backward.
  bn-chain   the conv -> BN -> ReLU backward for the selected ops: igemm's conv2d_grad_prologue + dgrad plan +
             wgrad plan (prologue=True, mask=True; both ops: conv2d_bn_backward, BN's sums and dz one launch) against
             threshold_backward -> native_batch_norm_backward -> convolution_backward (output_mask [T,T,F]), each
             timed as one callable; errors are the max over dx, dw, dgamma, dbeta against the float64 chain. z is
             the conv output, y = ReLU(BN(z)) gives the mask.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402
from _harness import Bench, geomean  # noqa: E402
from bench_conv import gemm_peak  # noqa: E402

from igemm.layers import RESNET50, RESNET50_MORE  # noqa: E402

CONFIGS = {  # name: (dtype, layout, igemm precision, cuDNN allow_tf32)
    "fp16-NHWC": ("float16", "NHWC", "strict", False),
    "bf16-NHWC": ("bfloat16", "NHWC", "strict", False),
    "fp16-NCHW": ("float16", "NCHW", "strict", False),
    "fp32-NCHW": ("float32", "NCHW", "strict", False),
    "fp32-NHWC": ("float32", "NHWC", "strict", False),
    "tf32-NHWC": ("float32", "NHWC", "tf32", True),
}
OPS = ("dgrad", "wgrad")
FUSED = ("mask", "bn-chain")
FUSED_CONFIG = "fp16-NHWC"
EPS = 1e-5
DEV = "cuda"

#: (name, C, K, H (= W), R (= S), stride, padding, has_dgrad): ResNet-50's distinct shapes, forward and backward
LAYERS = [(*spec, not spec[0].startswith("conv1")) for spec in RESNET50 + RESNET50_MORE]
#: --quick: conv1 (wgrad), 1x1 64->256 @56, 3x3 128->128 @28, 3x3 512->512 @7, 3x3/2 128->128 @56, 1x1 256->64 @56
QUICK = (0, 2, 3, 5, 7, 8)
COLS = ("igemm_us", "cudnn_us", "ratio", "tflops", "pct_peak", "err_igemm", "err_cudnn")


def mem(t, layout):
    """An NCHW-shaped tensor (any memory format) -> a contiguous tensor in the layout's memory order."""
    return t.permute(0, 2, 3, 1).contiguous() if layout == "NHWC" else t.contiguous()


def view(t, layout):
    """A tensor in the layout's memory order -> its NCHW-shaped view for torch (channels_last for NHWC)."""
    return t.permute(0, 3, 1, 2) if layout == "NHWC" else t


def rel_err(a, ref) -> float:
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


def make_case(torch, layer, N: int, cfg: str):
    name, C, K, H, R, st, pd, has_dgrad = layer
    dtype, layout, precision, allow_tf32 = CONFIGS[cfg]
    tdt = getattr(torch, dtype)
    return SimpleNamespace(name=name, cfg=cfg, N=N, C=C, K=K, H=H, R=R, st=st, pd=pd, has_dgrad=has_dgrad,
                           P=(H + 2 * pd - R) // st + 1, dtype=dtype, tdt=tdt, layout=layout, precision=precision,
                           allow_tf32=allow_tf32, esize=torch.finfo(tdt).bits // 8)


def flops(c, ops=("dgrad",)) -> int:
    return len(ops) * 2 * c.N * c.P * c.P * c.K * c.C * c.R * c.R


def make_sets(torch, igemm, c, fused: bool):
    """Input sets in the layout's memory order, enough to rotate past L2: x, dy; with ``fused`` also z (the conv
    output), its per-channel fp32 mean / invstd, y = ReLU(BN(z)) and y's bitmask. Returns (sets, w, gamma)."""
    import torch.nn.functional as F
    dev = DEV
    w = mem(torch.randn(c.K, c.C, c.R, c.R, device=dev, dtype=c.tdt) / (c.C * c.R * c.R) ** 0.5, c.layout)
    gamma = torch.rand(c.K, device=dev) + 0.5
    beta = torch.rand(c.K, device=dev) - 0.5

    def one(i):
        s = SimpleNamespace(x=mem(torch.randn(c.N, c.C, c.H, c.H, device=dev, dtype=c.tdt), c.layout),
                            dy=mem(torch.randn(c.N, c.K, c.P, c.P, device=dev, dtype=c.tdt), c.layout))
        if fused:
            zv = F.conv2d(view(s.x, c.layout), view(w, c.layout), stride=c.st, padding=c.pd)
            zf = zv.float()
            s.mean = zf.mean((0, 2, 3))
            s.invstd = torch.rsqrt(zf.var((0, 2, 3), unbiased=False) + EPS)
            yv = torch.relu((zf - s.mean[:, None, None]) * (s.invstd * gamma)[:, None, None] + beta[:, None, None])
            s.z, s.y = mem(zv, c.layout), mem(yv.to(c.tdt), c.layout)
            s.mask = igemm.relu_mask(s.y)
            del zv, zf, yv
        return s

    xb, yb = c.N * c.C * c.H * c.H * c.esize, c.N * c.K * c.P * c.P * c.esize
    return _harness.rotating(one, xb + yb * (3 if fused else 1), cap=16), w, gamma


class Runner:
    def __init__(self, bench, torch, igemm, peak: float):
        self.bench, self.torch, self.igemm, self.peak = bench, torch, igemm, peak
        self.ratios: dict[tuple, list] = {}     # (config, op, what) -> [(value, layer)]
        self.fallbacks: set[str] = set()

    # ------------------------------------------------------------------------------------------ helpers
    def time(self, fn, n: int):
        t = self.bench.time(fn, n)
        last = self.bench.last
        if "error" in last:
            self.fallbacks.add(last["error"][:200])
        return t, last.get("method", "?")

    def cudnn(self, c, x, w, dz, output_mask):
        """torch.ops.aten.convolution_backward on NCHW-shaped views (cuDNN)."""
        return self.torch.ops.aten.convolution_backward(dz, x, w, None, [c.st] * 2, [c.pd] * 2, [1, 1], False,
                                                        [0, 0], 1, output_mask)

    def reference(self, c, xv, wv, dzv, op):
        """float64 dx or dw from NCHW-shaped views (CUDA copies)."""
        tg = self.torch.nn.grad
        xd, wd, dzd = xv.double(), wv.double(), dzv.double()
        if op == "dgrad":
            return tg.conv2d_input(xd.shape, wd, dzd, stride=c.st, padding=c.pd)
        return tg.conv2d_weight(xd, wd.shape, dzd, stride=c.st, padding=c.pd)

    def plan(self, c, op, x, w, **kw):
        Plan = self.igemm.Conv2dGradInputPlan if op == "dgrad" else self.igemm.Conv2dGradWeightPlan
        # device=x.device: the GPU (device=None would silently give a numpy-backend plan where no GPU is active)
        return Plan(tuple(x.shape), tuple(w.shape), c.dtype, layout=c.layout, stride=c.st, padding=c.pd, dilation=1,
                    precision=c.precision, device=x.device, **kw)

    def row(self, c, op, **kw):
        self.bench.row(layer=c.name, config=c.cfg, op=op, **{k: kw.pop(k, "") for k in COLS}, **kw)

    def keep(self, c, op, what, value):
        self.ratios.setdefault((c.cfg, op, what), []).append((value, c.name))

    def guard(self, c, op, fn) -> None:
        """One row: an exception is printed and recorded as an 'error' row, and the table goes on."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one failing case must not stop the table
            print(f"[{c.cfg} {c.name} {op}] failed:", file=sys.stderr)
            traceback.print_exc()
            self.row(c, op, error=f"{type(e).__name__}: {e}"[:300])
            try:
                self.torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - a sticky CUDA error: the next rows will say so too
                pass

    # ------------------------------------------------------------------------------------------ rows
    def plain_row(self, c, sets, w, op):
        """igemm's plan vs cuDNN's convolution_backward, one op."""
        V = lambda t: view(t, c.layout)  # noqa: E731
        plan = self.plan(c, op, sets[0].x, w)
        run = (lambda s, out: plan(s.dy, w, out=out)) if op == "dgrad" else (lambda s, out: plan(s.x, s.dy, out=out))
        got = run(sets[0], None)
        outs = [self.torch.empty_like(got) for _ in range(2)]
        t_ig, m_ig = self.time(lambda i: run(sets[i], outs[i % 2]), len(sets))
        om = [op == "dgrad", op == "wgrad", False]
        dnn = lambda s: self.cudnn(c, V(s.x), V(w), V(s.dy), om)[0 if op == "dgrad" else 1]  # noqa: E731
        t_dnn, m_dnn = self.time(lambda i: dnn(sets[i]), len(sets))
        ref = self.reference(c, V(sets[0].x), V(w), V(sets[0].dy), op)
        err_ig, err_dnn = rel_err(V(got), ref), rel_err(dnn(sets[0]), ref)
        f = flops(c)
        self.keep(c, op, "ratio", t_ig / t_dnn)
        self.row(c, op, igemm_us=t_ig * 1e6, cudnn_us=t_dnn * 1e6, ratio=t_ig / t_dnn, tflops=f / t_ig / 1e12,
                 pct_peak=100 * f / t_ig / self.peak, err_igemm=err_ig, err_cudnn=err_dnn, timing=f"{m_ig}/{m_dnn}")

    def mask_row(self, c, sets, w, op):
        """The plan with mask=True (the ReLU gradient fused into dy's load) vs the unmasked plan and vs PyTorch's
        threshold_backward + convolution_backward."""
        torch, V = self.torch, (lambda t: view(t, c.layout))
        plain, masked = self.plan(c, op, sets[0].x, w), self.plan(c, op, sets[0].x, w, mask=True)

        def run(p, s, out, **kw):
            return p(s.dy, w, out=out, **kw) if op == "dgrad" else p(s.x, s.dy, out=out, **kw)

        got = run(masked, sets[0], None, mask=sets[0].mask)
        outs = [torch.empty_like(got) for _ in range(2)]
        t_plain, _ = self.time(lambda i: run(plain, sets[i], outs[i % 2]), len(sets))
        t_mask, m_ig = self.time(lambda i: run(masked, sets[i], outs[i % 2], mask=sets[i].mask), len(sets))
        om = [op == "dgrad", op == "wgrad", False]

        def chain(s):
            g = torch.ops.aten.threshold_backward(V(s.dy), V(s.y), 0)
            return self.cudnn(c, V(s.x), V(w), g, om)[0 if op == "dgrad" else 1]

        t_dnn, m_dnn = self.time(lambda i: chain(sets[i]), len(sets))
        s0 = sets[0]
        ref = self.reference(c, V(s0.x), V(w), torch.where(V(s0.y) > 0, V(s0.dy), 0), op)
        err_ig, err_dnn = rel_err(V(got), ref), rel_err(chain(s0), ref)
        f = flops(c)
        self.keep(c, op + "+mask", "overhead", t_mask / t_plain)
        self.keep(c, op + "+mask", "ratio", t_mask / t_dnn)
        self.row(c, op + "+mask", igemm_us=t_mask * 1e6, cudnn_us=t_dnn * 1e6, ratio=t_mask / t_dnn,
                 tflops=f / t_mask / 1e12, pct_peak=100 * f / t_mask / self.peak, err_igemm=err_ig, err_cudnn=err_dnn,
                 timing=f"{m_ig}/{m_dnn}", unmasked_us=t_plain * 1e6, overhead=t_mask / t_plain)

    def bn_row(self, c, sets, w, gamma, ops, label):
        """ReLU -> BN -> conv backward: igemm's prologue + fused plans vs PyTorch's three-call chain."""
        torch, igemm, V = self.torch, self.igemm, (lambda t: view(t, c.layout))
        dplan = self.plan(c, "dgrad", sets[0].x, w, mask=True, prologue=True) if "dgrad" in ops else None
        wplan = self.plan(c, "wgrad", sets[0].x, w, mask=True, prologue=True) if "wgrad" in ops else None

        def ours(s, dxo=None, dwo=None):
            if dplan and wplan:                 # (both gradients: the block's backward in one call)
                return igemm.conv2d_bn_backward(s.dy, s.x, w, s.z, s.mean, s.invstd, gamma, c.st, c.pd,
                                                mask=s.mask, layout=c.layout)[:4]
            pro = igemm.conv2d_grad_prologue(s.dy, s.z, s.mean, s.invstd, gamma, mask=s.mask, layout=c.layout)
            dx = dplan(s.dy, w, mask=s.mask, prologue=pro, out=dxo) if dplan else None
            dw = wplan(s.x, s.dy, mask=s.mask, prologue=pro, out=dwo) if wplan else None
            return dx, dw, pro.grad_weight, pro.grad_bias

        def theirs(s, dtype=None):
            cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
            g = torch.ops.aten.threshold_backward(cast(V(s.dy)), cast(V(s.y)), 0)
            dz, dgamma, dbeta = torch.ops.aten.native_batch_norm_backward(
                g, cast(V(s.z)), cast(gamma), None, None, cast(s.mean), cast(s.invstd), True, EPS, [True] * 3)
            dx, dw, _ = self.cudnn(c, cast(V(s.x)), cast(V(w)), dz, ["dgrad" in ops, "wgrad" in ops, False])
            return dx, dw, dgamma, dbeta

        got = ours(sets[0])
        dxo = [torch.empty_like(got[0]) if dplan else None for _ in range(2)]
        dwo = [torch.empty_like(got[1]) if wplan else None for _ in range(2)]
        t_ig, m_ig = self.time(lambda i: ours(sets[i], dxo[i % 2], dwo[i % 2]), len(sets))
        t_dnn, m_dnn = self.time(lambda i: theirs(sets[i]), len(sets))
        ref = theirs(sets[0], torch.float64)        # the same chain in float64 (CUDA)
        mine = (V(got[0]) if dplan else None, V(got[1]) if wplan else None, got[2], got[3])
        err_ig = max(rel_err(a, r) for a, r in zip(mine, ref) if r is not None)
        err_dnn = max(rel_err(a, r) for a, r in zip(theirs(sets[0]), ref) if r is not None)
        f = flops(c, ops)
        self.keep(c, label, "ratio", t_ig / t_dnn)
        self.row(c, label, igemm_us=t_ig * 1e6, cudnn_us=t_dnn * 1e6, ratio=t_ig / t_dnn,
                 tflops=f / t_ig / 1e12, pct_peak=100 * f / t_ig / self.peak, err_igemm=err_ig, err_cudnn=err_dnn,
                 timing=f"{m_ig}/{m_dnn}")

    # ------------------------------------------------------------------------------------------ driver
    def layer(self, cfg: str, layer, N: int, ops, fused) -> None:
        torch = self.torch
        c = make_case(torch, layer, N, cfg)
        torch.backends.cudnn.allow_tf32 = c.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = c.allow_tf32
        ops = [op for op in ops if op == "wgrad" or c.has_dgrad]
        if not ops:
            return
        sets = None

        def build():
            nonlocal sets
            sets = make_sets(torch, self.igemm, c, bool(fused))        # (both fused rows read y's mask)

        self.guard(c, "inputs", build)
        if sets is not None:
            sets, w, gamma = sets
            for op in ops:
                self.guard(c, op, lambda op=op: self.plain_row(c, sets, w, op))
            if "mask" in fused:
                for op in ops:
                    self.guard(c, op + "+mask", lambda op=op: self.mask_row(c, sets, w, op))
            if "bn-chain" in fused:
                label = "bn-chain " + "+".join(ops)
                self.guard(c, label, lambda: self.bn_row(c, sets, w, gamma, ops, label))
        del sets
        torch.cuda.empty_cache()

    def notes(self) -> None:
        order = list(CONFIGS)
        for (cfg, op, what), vals in sorted(self.ratios.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1:])):
            v, worst = max(vals)
            label = "masked/unmasked plan" if what == "overhead" else "igemm/cuDNN"
            self.bench.note(f"{cfg} {op}: geomean {label} = {geomean([x for x, _ in vals]):.3f} over {len(vals)} "
                            f"layers, worst {v:.3f} ({worst})")
        for e in sorted(self.fallbacks):
            self.bench.note(f"graph capture failed, CUDA events used instead: {e}")


def main(argv=None):
    ap = _harness.parser(__doc__)
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    ap.add_argument("--configs", default="fp16-NHWC,bf16-NHWC,fp16-NCHW,fp32-NCHW",
                    help=f"comma-separated, of: {', '.join(CONFIGS)}")
    ap.add_argument("--ops", default="dgrad,wgrad", help="comma-separated, of: dgrad, wgrad")
    ap.add_argument("--fused", default="mask,bn-chain", help=f"fused rows on {FUSED_CONFIG}: mask, bn-chain ('' none)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layers", default="", help="comma-separated indices into LAYERS (default: all; --quick: "
                    f"{','.join(map(str, QUICK))})")
    args = ap.parse_args(argv)
    configs, ops, fused = ([s for s in a.split(",") if s] for a in (args.configs, args.ops, args.fused))
    for names, known, what in ((configs, CONFIGS, "config"), (ops, OPS, "op"), (fused, FUSED, "fused row")):
        bad = [n for n in names if n not in known]
        if bad:
            ap.error(f"unknown {what}: {', '.join(bad)} (known: {', '.join(known)})")
    idx = [int(i) for i in args.layers.split(",")] if args.layers else (list(QUICK) if args.quick else None)
    layers = [LAYERS[i] for i in idx] if idx is not None else LAYERS
    import torch

    import igemm
    torch.backends.cudnn.benchmark = True
    bench = Bench("bench_backward" + ("" if args.batch == 32 else f"_n{args.batch}"), args)
    peak = gemm_peak(bench, torch)
    bench.note(f"measured fp16 GEMM peak {peak / 1e12:.0f} TFLOP/s (8192^3 torch.matmul); batch {args.batch}")
    run = Runner(bench, torch, igemm, peak)
    for cfg in configs:
        for layer in layers:
            run.layer(cfg, layer, args.batch, ops, fused if cfg == FUSED_CONFIG else ())
    run.notes()
    bench.note("ratio < 1: igemm faster. fp32 configs: igemm precision='strict', cuDNN allow_tf32=False. "
               "err: max|a - ref| / max|ref| against float64.")
    bench.finish()


if __name__ == "__main__":
    main()
