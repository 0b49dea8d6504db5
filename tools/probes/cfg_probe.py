"""Time one ResNet-50 layer's chains (a) conv, (b) +BN+ReLU(mask), (c) +BN+Add+ReLU(mask) under several
kernel configs (dicts of KernelSpec fields, as Conv2dPlan's ``config``), timed like bench_epilogues (CUDA
graphs, inputs rotated past L2, two alternating outputs):

    python tools/probes/cfg_probe.py IDX|C,K,H,R,STRIDE,PAD LAYOUT '[null, {"stages": 2}, ...]' [passes] [N]
    python tools/probes/cfg_probe.py --batch CASES.json   (a list of [layer, layout, cfgs, passes, N]: every
        kernel compiled first, all CPUs at once, then each case timed)
"""
import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))


def layer(arg: str):
    """(name, C, K, H, R, stride, pad) of a bench_conv layer index or 'C,K,H,R,stride,pad'."""
    from bench_conv import RESNET50
    if "," in arg:                          # a layer of its own: C,K,H,R,stride,pad
        C, K, H, R, st, pd = (int(v) for v in arg.split(","))
        return f"{R}x{R}/{st} {C}->{K} @{H}", C, K, H, R, st, pd
    return RESNET50[int(arg)]


def precompile(cases, arch: str = "sm_90a") -> int:
    """Compile the kernels of ``cases`` ([layer, layout, cfgs, passes, N]) for the three chains, in parallel."""
    from igemm import _build, epilogues as ep
    from igemm._heuristics import ConvProblem, choose_config, kernel_setup
    from igemm.conv2d import _override, _stub
    chains = [ep.chain(), ep.chain(ep.BatchNorm(0, 0, 0, 0), ep.ReLU(mask=True)),
              ep.chain(ep.BatchNorm(0, 0, 0, 0), ep.Add(), ep.ReLU(mask=True))]
    stubs = {}
    for arg, layout, cfgs, _, N in cases:
        _, C, K, H, R, st, pd = layer(str(arg))
        for ch in chains:
            pb = ConvProblem(N, C, H, H, K, R, R, (st, st), (pd, pd), (1, 1), "float16", layout, "tensorop",
                             ch.signature(), "float16" if ch.residual_op else None)
            kpb = kernel_setup(pb, "auto", None, None, arch)[1]
            for cfg in cfgs:
                spec = choose_config(kpb, arch)
                if cfg:
                    spec = _override(spec, kpb, cfg)
                stubs[_stub(spec)] = spec.name()
    def one(item):          # a config a kernel rejects (static_assert) fails again, with its error, when timed
        try:
            _build.compile_cubin(item[0], arch, name=item[1])
            return 1
        except _build.CompileError:
            return 0
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(os.cpu_count() or 2) as ex:
        return sum(ex.map(one, stubs.items()))


def main():
    if sys.argv[1] == "--batch":
        cases = json.loads(Path(sys.argv[2]).read_text())
        print(f"{precompile(cases)} kernels compiled", flush=True)
        for arg, layout, cfgs, passes, N in cases:
            probe(str(arg), layout, cfgs, passes, N)
        return
    probe(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 2,
          int(sys.argv[5]) if len(sys.argv) > 5 else 32)


def probe(arg: str, layout: str, cfgs: list, passes: int, N: int) -> None:
    import torch
    import _harness
    import igemm
    from igemm import epilogues as ep
    from bench_conv import make_inputs
    bench = _harness.Bench("cfg_probe", argparse.Namespace(quick=True, reps=20, warmup=3, out="/tmp/cfg_probe"))
    name, C, K, H, R, st, pd = layer(arg)
    P = (H + 2 * pd - R) // st + 1
    xs, w = make_inputs(torch, N, C, K, H, R, "float16", layout, (N * C * H * H + 2 * N * K * P * P) * 2)
    g, b, m, v = (torch.rand(K, device="cuda") + 0.5 for _ in range(4))
    yshape = (N, K, P, P) if layout == "NCHW" else (N, P, P, K)
    res = [torch.randn(yshape, device="cuda", dtype=torch.float16) for _ in range(len(xs))]
    outs = [torch.empty(yshape, device="cuda", dtype=torch.float16) for _ in range(2)]
    words = (N * K * P * P + 31) // 32
    masks = [torch.empty(words, device="cuda", dtype=torch.int32) for _ in range(2)]
    chains = {"a": None, "b": ep.chain(ep.BatchNorm(g, b, m, v), ep.ReLU(mask=True)),
              "c": ep.chain(ep.BatchNorm(g, b, m, v), ep.Add(), ep.ReLU(mask=True))}
    print(f"{name} {layout} N={N}", flush=True)
    ref = {}
    for p_ in range(passes):
        for cfg in cfgs:
            row, specs = [], {}
            for ch, chain in chains.items():
                try:
                    plan = igemm.Conv2dPlan(xs[0].shape, w.shape, "float16", layout, st, pd, epilogue=chain, config=cfg)
                    specs[ch] = plan.spec().name().replace("conv_float16_", "")
                    if ch == "a":
                        f = lambda i: plan(xs[i], w, out=outs[i % 2])
                    elif ch == "b":
                        f = lambda i: plan(xs[i], w, out=outs[i % 2], mask_out=masks[i % 2])
                    else:
                        f = lambda i: plan(xs[i], w, residual=res[i], out=outs[i % 2], mask_out=masks[i % 2])
                    t = bench.time(f, len(xs))
                    f(0)
                    y = outs[0].float()
                    key = ch
                    if key not in ref:
                        ref[key] = y.clone()
                    err = ((y - ref[key]).abs().max() / ref[key].abs().max()).item()
                    row.append(f"{ch} {t * 1e6:6.1f}{'' if err < 1e-2 else ' ERR%.2g' % err}")
                except Exception as e:
                    row.append(f"{ch} {type(e).__name__}: {str(e)[:80]}")
            names = sorted(set(specs.values()))     # (each chain's kernel where they differ)
            spec = names[0] if len(names) == 1 else " | ".join(f"{c}: {n}" for c, n in specs.items())
            print(f"  {json.dumps(cfg):45s} {' | '.join(row)}   [{spec}]", flush=True)


if __name__ == "__main__":
    main()
