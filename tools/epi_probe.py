"""Probe: how the fused epilogue's cost on epilogue-bound layers moves with occupancy and tile width.

    python tools/epi_probe.py precompile [arch] [SET]   # compile every variant here (no GPU)
    python tools/epi_probe.py run [SET]                 # on the GPU: (a) conv, (b) +BN+ReLU+mask, (c) +Add

SET: "tiles" (default: the 1x1 layers, tile and occupancy variants), "stage" (ResNet-50's layers after
conv1, N=32: the residual staged in shared memory, as built, against IGEMM_NO_RES_STAGE's loads after the
mainloop) or "ws" (the 1x1 layers, NHWC and NCHW, on the persistent kernel with one consumer and several CTAs
an SM).

Variants are overrides of the chosen KernelSpec (min_blocks = CTAs per SM the register cap allows, bn,
stages); times are CUDA-graph medians (benchmarks/_harness.py), inputs rotated past L2.
"""
from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

# (name, C, K, H, R, stride, pad, N)
LAYERS = [("1x1 64->256 @56", 64, 256, 56, 1, 1, 0, 32), ("1x1/2 512->1024 @28", 512, 1024, 28, 1, 2, 0, 32)]
# spec overrides; "define": macros prepended to the kernel source (the kernels' A/B switches:
# IGEMM_RASTER_M = the m-fastest tile order, IGEMM_NO_EPI_PROLOGUE = no early vectors / residual prefetch)
# "env": environment variables set while the variant's plans are made (IGEMM_SMEM_TRIM=0: launch with
# every stage's shared memory even when the reduction has fewer k-tiles than stages)
_SK = {"splits": 1, "stages": 4, "math": "wgmma"}    # stream-K variants (CTAs per SM)
VARIANTS = [{}, {"bn": 64}, {"bm": 128, "wm": 2, "bn": 64}, {"bm": 128, "wm": 2, "bn": 128, "stages": 3},
            {"bn": 256}, {"bn": 64, "min_blocks": 6}]


def _resnet_n32():
    from igemm.layers import RESNET50          # every layer after conv1 (whose patch kernel stages nothing), N=32
    return [(*layer, 32) for layer in RESNET50[1:]]


RESNET_N32 = _resnet_n32()
_WS = {"math": "wgmma_ws", "wm": 1, "splits": 1}     # the persistent kernel, one consumer, `ctas` CTAs an SM
WS_VARIANTS = [{}, {**_WS, "bn": 64, "stages": 2, "ctas": 4}, {**_WS, "bn": 64, "stages": 2, "ctas": 5},
               {**_WS, "bn": 64, "stages": 3, "ctas": 3}, {**_WS, "bn": 128, "stages": 2, "ctas": 3},
               {**_WS, "bn": 128, "stages": 3, "ctas": 2}, {**_WS, "bn": 128, "stages": 4, "ctas": 1}]
SETS = {"tiles": (LAYERS, VARIANTS), "stage": (RESNET_N32, [{}, {"define": "IGEMM_NO_RES_STAGE"}]),
        "ws": (LAYERS, WS_VARIANTS)}
_TWO_LAYOUTS = ("ws",)     # sets that run NCHW too (the 1x1 64->256 layer's native MN-major kernel)
LAYOUTS = ("NHWC",)


def _use_set(name: str) -> None:
    global LAYERS, VARIANTS, LAYOUTS
    LAYERS, VARIANTS = SETS[name]
    LAYOUTS = ("NHWC", "NCHW") if name in _TWO_LAYOUTS else ("NHWC",)


def _defines(v) -> str:
    return "".join(f"#define {d} 1\n" for d in v.get("define", "").split())


def _patch_stub(defines: str) -> None:
    """Make igemm.conv2d render kernels with `defines` in front (the kernel cache key follows the text)."""
    c = sys.modules["igemm.conv2d"]
    orig = getattr(c, "_stub_orig", c._stub)
    c._stub_orig = orig
    c._stub = lambda spec: defines + orig(spec)


def precompile_variants(table: dict, variants: list, arch: str) -> int:
    """Compile every spec of a probe's table ({(..., variant index): spec}) with its variant's macros."""
    from igemm import _build
    from igemm.conv2d import _stub
    sp = {(s, _defines(variants[k[-1]])): _defines(variants[k[-1]]) + _stub(s) for k, s in table.items()}
    return _build.compile_many(((s.name(), st) for (s, _), st in sp.items()), arch, None)


def _chains(ep, vecs=None):
    g = vecs or (0, 0, 0, 0)
    return {"a": ep.chain(), "b": ep.chain(ep.BatchNorm(*g), ep.ReLU(mask=True)),
            "c": ep.chain(ep.BatchNorm(*g), ep.Add(), ep.ReLU(mask=True))}


def specs(arch="sm_90a"):
    from igemm import epilogues as ep
    from igemm._heuristics import ConvProblem, choose_config, kernel_setup, max_ctas, validate_spec
    from igemm.conv2d import _override
    out = {}
    for (name, C, K, H, R, st, pd, N), layout in ((l, lo) for l in LAYERS for lo in LAYOUTS):
        for cn, ch in _chains(ep).items():
            pb = ConvProblem(N, C, H, H, K, R, R, (st, st), (pd, pd), (1, 1), "float16", layout, "tensorop",
                             ch.signature(), "float16" if ch.residual_op else None)
            pb = kernel_setup(pb, arch=arch)[1]          # (the kernel's problem: NCHW may run on NHWC copies)
            base = choose_config(pb, arch)
            for i, v in enumerate(VARIANTS):
                kw = {k: x for k, x in v.items() if k not in ("define", "env")}
                try:
                    s = _override(base, pb, kw) if kw else base
                except Exception:
                    continue
                if s.ctas > 1 and not validate_spec(s, pb, raise_=False):   # (c)'s C tile is larger: fewer CTAs
                    s = dataclasses.replace(s, ctas=max_ctas(s, s.ctas), min_blocks=max_ctas(s, s.ctas))
                if validate_spec(s, pb, raise_=False) and 65536 // (s.threads * s.min_blocks) >= 80:
                    out[(name, layout, cn, i)] = s
    return out


def _check(x, w, res, vec, st, pd, plan, layout="NHWC") -> str:
    """(c) of the last variant against torch in fp32: max relative error, and mask == (y > 0) everywhere."""
    import torch
    g, b, m, v = vec
    y, mask = plan(x, w, residual=res, out=torch.full_like(res, float("nan")))
    nchw = (lambda t: t) if layout == "NCHW" else (lambda t: t.permute(0, 3, 1, 2))
    ref = torch.nn.functional.conv2d(nchw(x).float(), nchw(w).float(), stride=st, padding=pd)
    sc = g / torch.sqrt(v + 1e-5)
    ref = ref * sc[None, :, None, None] + (b - m * sc)[None, :, None, None]
    ref = torch.relu((ref if layout == "NCHW" else ref.permute(0, 2, 3, 1)) + res.float())
    rel = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    bits = (y.reshape(-1) > 0).to(torch.int64)
    n = bits.numel()
    bits = torch.nn.functional.pad(bits, (0, (-n) % 32)).reshape(-1, 32)
    words = (bits << torch.arange(32, device=bits.device)).sum(1)
    ok = torch.equal(words.to(torch.int64) & 0xFFFFFFFF, mask.reshape(-1).to(torch.int64) & 0xFFFFFFFF)
    return f"rel {rel:.1e}, mask {'ok' if ok else 'MISMATCH'}"


def main() -> int:
    if sys.argv[1:2] == ["precompile"]:
        arch = sys.argv[2] if len(sys.argv) > 2 else "sm_90a"
        _use_set(sys.argv[3] if len(sys.argv) > 3 else "tiles")
        print(f"{precompile_variants(specs(arch), VARIANTS, arch)} kernels")
        return 0
    _use_set(sys.argv[2] if len(sys.argv) > 2 else "tiles")
    import argparse

    import torch

    import _harness
    import igemm
    from igemm import epilogues as ep
    bench = _harness.Bench("epi_probe", argparse.Namespace(quick=True, reps=30, warmup=3, out=None))
    table = specs()
    print("| layer | variant | spec | a_us | b_us | c_us | b/a | c/a | (c) check |\n|---|---|---|---|---|---|---|---|---|")
    for (name, C, K, H, R, st, pd, N), layout in ((l, lo) for l in LAYERS for lo in LAYOUTS):
        P = (H + 2 * pd - R) // st + 1
        nset = _harness.n_rotations((N * H * H * C + 2 * N * P * P * K) * 2)
        sh = (lambda n, h, c: (n, c, h, h)) if layout == "NCHW" else (lambda n, h, c: (n, h, h, c))
        xs = [torch.randn(*sh(N, H, C), device="cuda", dtype=torch.float16) for _ in range(nset)]
        res = [torch.randn(*sh(N, P, K), device="cuda", dtype=torch.float16) for _ in range(nset)]
        w = torch.randn(*sh(K, R, C), device="cuda", dtype=torch.float16) / (C * R * R) ** 0.5
        vec = (torch.rand(K, device="cuda") + 0.5, torch.randn(K, device="cuda") * 0.1,
               torch.randn(K, device="cuda") * 0.1, torch.rand(K, device="cuda") + 0.5)
        outs = [torch.empty(*sh(N, P, K), device="cuda", dtype=torch.float16) for _ in range(2)]
        masks = [torch.empty((N * P * P * K + 31) // 32, device="cuda", dtype=torch.int32) for _ in range(2)]
        for i, v in enumerate(VARIANTS):
            t = {}
            desc = ""
            _patch_stub(_defines(v))
            for k, x in v.get("env", {}).items():
                os.environ[k] = x
            for cn, ch in _chains(ep, vec).items():
                s = table.get((name, layout, cn, i))
                if s is None:
                    break
                desc = f"{s.math} {s.bm}x{s.bn} s{s.stages} mb{s.min_blocks} x{s.ctas}"
                plan = igemm.Conv2dPlan(tuple(xs[0].shape), tuple(w.shape), "float16", layout, st, pd, epilogue=ch,
                                        config=s)
                if cn == "a":
                    t[cn] = bench.time(lambda j: plan(xs[j], w, out=outs[j % 2]), nset)
                elif cn == "b":
                    t[cn] = bench.time(lambda j: plan(xs[j], w, out=outs[j % 2], mask_out=masks[j % 2]), nset)
                else:
                    t[cn] = bench.time(lambda j: plan(xs[j], w, residual=res[j], out=outs[j % 2],
                                                      mask_out=masks[j % 2]), nset)
            err = _check(xs[0], w, res[0], vec, st, pd, plan, layout) if len(t) == 3 else ""
            for k in v.get("env", {}):
                del os.environ[k]
            if len(t) == 3:
                print(f"| {layout} {name} | {v or 'chosen'} | {desc} | {t['a'] * 1e6:.1f} | {t['b'] * 1e6:.1f} | "
                      f"{t['c'] * 1e6:.1f} | {t['b'] / t['a']:.2f} | {t['c'] / t['a']:.2f} | {err} |", flush=True)
        del xs, res, outs, masks
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
