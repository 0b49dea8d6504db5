"""Compile a set of kernels from two ``csrc/`` trees and compare the cubins, anonymous-namespace hashes aside.

A change to the device headers that leaves every cubin identical (a move, a split, a rename, comments) keeps
the kernels' results and speed; this checks it without a GPU. The stubs are rendered by this checkout's Python
and compiled, uncached, once against each tree (``--jobs`` compilers at a time, ~2 GB each).

    python tools/cubin_identical.py OLD_CSRC [--new NEW_CSRC] [--rename NEW=OLD ...] [--sets bench,prep,extra,baselines]
                                    [--match REGEX] [--jobs 2]

``--rename NEW=OLD`` rewrites ``#include "NEW"`` into ``#include "OLD"`` in the stubs compiled against
OLD_CSRC, for headers the change moved. For example, against the tree before the split into csrc/conv/:

    git archive <commit> csrc | tar -x -C /tmp/old
    python tools/cubin_identical.py /tmp/old/csrc --rename conv/fprop.cuh=conv2d_fprop.cuh \\
        --rename conv/transpose.cuh=transpose.cuh --rename conv/unfold.cuh=unfold.cuh \\
        --rename baselines/im2col.cuh=im2col.cuh --rename baselines/direct_conv.cuh=direct_conv.cuh

The sets: ``bench`` the kernels of ``igemm precompile``'s ResNet-50 set (N=32: fp16 and bf16, NHWC and NCHW,
each path bench_conv times, no epilogue, BN+ReLU(mask) and BN+Add+ReLU(mask); fp32 strict and TF32 without an
epilogue); ``prep`` every transpose and unfold variant; ``extra`` the autotune candidates of a few problems that
the default configs leave out (the persistent kernel with one or two consumers, the cluster k-split, several
CTAs an SM, stream-K, the patch kernel's tiles, NCHW register epilogues with a residual); ``baselines`` the
comparison's im2col and direct kernels; ``families`` every index_add and prelu kernel. Prints each kernel that differs and ``N identical of N``; exits 1
if any differs.
"""
from __future__ import annotations

import argparse
import hashlib
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import igemm._build as _build  # noqa: E402
from igemm import epilogues as ep  # noqa: E402
from igemm.conv._paths import kernel_setup  # noqa: E402
from igemm.conv._plan import override as _override  # noqa: E402
from igemm.conv._problem import ConvProblem  # noqa: E402
from igemm.conv._rules import candidates, choose_config  # noqa: E402
from igemm.conv._spec import stub as _stub  # noqa: E402
from igemm.layers import RESNET50  # noqa: E402

CHAINS = {"none": ep.chain(), "bn_relu_mask": ep.chain(ep.BatchNorm(0, 0, 0, 0), ep.ReLU(mask=True)),
          "bn_add_relu_mask": ep.chain(ep.BatchNorm(0, 0, 0, 0), ep.Add(), ep.ReLU(mask=True))}


def _problem(N, C, H, K, R, st, pd, dtype, layout, chain, precision="tensorop"):
    return ConvProblem.of(N, C, H, H, K, R, R, (st, st), (pd, pd), (1, 1), dtype, layout,
                          "tf32" if precision == "tf32" else "strict", CHAINS[chain], dtype)


def bench_set(arch: str) -> dict[str, str]:
    """{stub: name} of the ResNet-50 benchmark kernels (as ``igemm precompile --epilogues`` compiles them)."""
    out = {}
    configs = [(dt, "tensorop", c) for dt in ("float16", "bfloat16") for c in CHAINS]
    configs += [("float32", prec, "none") for prec in ("strict", "tf32")]
    for dtype, precision, chain in configs:
        for layout in ("NHWC", "NCHW"):
            for _, C, K, H, R, st, pd in RESNET50:
                pb = _problem(32, C, H, K, R, st, pd, dtype, layout, chain, precision)
                paths = [("auto", None), ("native", None)] if layout == "NCHW" else [("auto", None)]
                if C * (4 if dtype == "float32" else 2) < 16:          # bench_conv's -elem configs
                    paths.append(("auto", False))
                for path, unfold in paths:
                    kp = kernel_setup(pb, path, None, unfold, arch)[1]
                    spec = choose_config(kp, arch)
                    out[_stub(spec)] = spec.name()
                    if spec.load_b == "tma":                             # bench_conv's -gather config
                        g = _override(spec, kp, {"load_a": "vec", "load_b": "vec"})
                        out[_stub(g)] = g.name()
    return out


def prep_set(arch: str) -> dict[str, str]:
    """Every transpose and unfold kernel (the conv's operand preparation)."""
    from igemm.conv import _transpose, _unfold
    return {stub: name for name, stub in _transpose.all_variants() + _unfold.all_variants()}


#: (N, C, H, K, R, stride, pad, dtype, layout, chain): problems whose candidates cover the kernel variants
EXTRA_PROBLEMS = [
    (32, 512, 7, 512, 3, 1, 1, "float16", "NHWC", "bn_add_relu_mask"),    # stream-K, cluster k-split, one consumer
    (32, 512, 7, 512, 3, 1, 1, "float16", "NCHW", "bn_add_relu_mask"),    # NCHW regs, V = 1, staged residual
    (32, 128, 28, 128, 3, 1, 1, "bfloat16", "NCHW", "bn_add_relu_mask"),  # NCHW regs, V = 8, the fused mask
    (32, 64, 56, 256, 1, 1, 0, "float16", "NHWC", "bn_relu_mask"),        # several CTAs an SM (TMA)
    (32, 64, 56, 256, 1, 1, 0, "float16", "NCHW", "bn_relu_mask"),        # several CTAs an SM (MN-major A)
    (32, 256, 14, 256, 3, 1, 1, "float16", "NHWC", "none"),               # two consumers, no epilogue
    (32, 3, 224, 64, 7, 2, 3, "float16", "NHWC", "bn_add_relu_mask"),     # the patch kernel, preloaded residual
    (32, 3, 224, 64, 7, 2, 3, "bfloat16", "NCHW", "bn_relu_mask"),        # the patch kernel, NCHW output
]


def _variant(spec) -> str | None:
    """The kernel variant a candidate exercises beyond the per-tile defaults, or None."""
    if spec.streamk:
        return "streamk"
    if spec.csplit > 1:
        return "csplit"
    if spec.ctas > 1:
        return "ctas"
    if spec.persistent:
        return f"persistent{spec.wm}"
    if spec.load_a == "patch":
        return f"patch{spec.bm}x{spec.bn}{spec.store}"
    if spec.store == "regsnchw":
        return f"regsnchw{spec.bn}"
    return None


def extra_set(arch: str, per_variant: int = 2) -> dict[str, str]:
    """Up to ``per_variant`` candidates of each variant of each problem in EXTRA_PROBLEMS."""
    out = {}
    for N, C, H, K, R, st, pd, dtype, layout, chain in EXTRA_PROBLEMS:
        pb = kernel_setup(_problem(N, C, H, K, R, st, pd, dtype, layout, chain), "auto", None, None, arch)[1]
        seen: dict[str, int] = {}
        for spec in candidates(pb, arch):
            v = _variant(spec)
            if v is not None and seen.get(v, 0) < per_variant:
                seen[v] = seen.get(v, 0) + 1
                out[_stub(spec)] = spec.name()
    return out


def baselines_set(arch: str) -> dict[str, str]:
    """The comparison's im2col and direct-convolution kernels."""
    from igemm.baselines import _algorithms as A
    out = {}
    for dtype in ("float16", "bfloat16", "float32"):
        for layout in ("NHWC", "NCHW"):
            out[A.direct_stub(dtype, layout)] = A.direct_name(dtype, layout)
            for vec in ((1, 16 // (4 if dtype == "float32" else 2)) if layout == "NHWC" else (1,)):
                out[A.im2col_stub(dtype, layout, vec)] = A.im2col_name(dtype, layout, vec)
    return out


def families_set(arch: str) -> dict[str, str]:
    """Every index_add and prelu kernel (the elementwise families that share csrc/elementwise.cuh)."""
    import importlib
    ia, pr = (importlib.import_module(f"igemm.{m}") for m in ("index_add", "prelu"))   # (the modules, not the
    return {stub: name for name, stub in ia.all_stubs() + pr.all_stubs()}            # functions of the same names)


SETS = {"bench": bench_set, "prep": prep_set, "extra": extra_set, "baselines": baselines_set,
        "families": families_set}

_ANON = re.compile(rb"(_INTERNAL_|_GLOBAL__N__|_cu_)[0-9a-f]{8}")


def normalise(cubin: bytes) -> bytes:
    """The cubin with the per-source hashes of anonymous-namespace names zeroed (they hash the stub's text)."""
    return _ANON.sub(rb"\g<1>00000000", cubin)


def compile_all(items: list[tuple[str, str]], csrc: Path, arch: str, jobs: int) -> list[bytes | None]:
    """Each (stub, name) compiled against the headers in ``csrc``, uncached (None where it fails)."""
    _build.csrc_dir = lambda: csrc          # (compile_cubin reads the include path and cache key through it)

    def one(item):
        try:
            return _build.compile_cubin(item[0], arch, name=item[1], use_cache=False)[0]
        except _build.CompileError as e:
            print(f"FAILED {item[1]} against {csrc}: {str(e)[:2000]}", flush=True)
            return None
    with ThreadPoolExecutor(jobs) as ex:
        return list(ex.map(one, items))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path, help="the csrc/ tree to compare against")
    ap.add_argument("--new", type=Path, default=ROOT / "csrc", help="the csrc/ tree under test (default: this checkout's)")
    ap.add_argument("--rename", action="append", default=[], metavar="NEW=OLD",
                    help="include name in this checkout's stubs = its name in OLD (repeatable)")
    ap.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of {', '.join(SETS)}")
    ap.add_argument("--match", default="", metavar="REGEX", help="only the kernels whose name matches")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    renames = [r.split("=", 1) for r in args.rename]
    if any(len(r) != 2 for r in renames):
        ap.error("--rename takes NEW=OLD")
    specs: dict[str, str] = {}
    for s in args.sets.split(","):
        if s not in SETS:
            ap.error(f"unknown set {s!r}")
        found = SETS[s](args.arch)
        print(f"{s}: {len(found)} kernels", flush=True)
        specs.update(found)
    items = [(stub, name) for stub, name in specs.items() if re.search(args.match, name)]
    print(len(items), "kernels", flush=True)

    def old_stub(stub: str) -> str:
        for new, old in renames:
            stub = stub.replace(f'#include "{new}"', f'#include "{old}"')
        return stub
    old = compile_all([(old_stub(stub), name) for stub, name in items], args.old.resolve(), args.arch, args.jobs)
    new = compile_all(items, args.new.resolve(), args.arch, args.jobs)
    same = 0
    for (stub, name), o, n in zip(items, old, new):
        if o is not None and n is not None and normalise(o) == normalise(n):
            same += 1
        else:
            print("DIFFERENT", name, hashlib.sha256(stub.encode()).hexdigest()[:8])   # (names omit the chain)
    print(same, "identical of", len(items))
    return 0 if same == len(items) else 1


if __name__ == "__main__":
    sys.exit(main())
