"""Copy the cubins a GPU run needs (tools/precompile_all.sh's sets) from the kernel cache into another
directory, so the carried cache holds no stale or sweep-only kernels.

    python tools/cache_subset.py DEST [arch=sm_90a] [sms=132]
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    dest = Path(sys.argv[1])
    arch = sys.argv[2] if len(sys.argv) > 2 else "sm_90a"
    sms = int(sys.argv[3]) if len(sys.argv) > 3 else 132
    from igemm import _build
    seen = []

    def record_many(items, arch_, jobs=None):
        items = list(items)
        seen.extend((name, stub) for name, stub in items)
        return len(items)

    def record_one(stub, arch_, *, name="kernel", **kw):
        seen.append((name, stub))
        return b"", ""

    _build.compile_many = record_many
    _build.compile_cubin = record_one
    import argparse

    import igemm.__main__ as M
    M.precompile(argparse.Namespace(epilogues=True, configs="float16:NHWC:strict,float16:NCHW:strict,"
                                    "float32:NCHW:strict,bfloat16:NHWC:strict", jobs=1, arch=arch, batch=32,
                                    backward=True))
    import importlib
    ia, pr, nm = (importlib.import_module(f"igemm.{m}") for m in ("index_add", "prelu", "norm"))
    ia.precompile(arch, 1)
    pr.precompile(arch, 1)
    nm.precompile(arch, jobs=1)
    import test_fuzz
    import test_syncbn
    test_syncbn._warm_kernels(arch, sms)
    for stub, name in test_fuzz.fuzz_stubs().items():
        seen.append((name, stub))
    for b in (8, 1):                    # bench_conv --batch 8 / --batch 1
        M.precompile(argparse.Namespace(epilogues=False, configs="float16:NHWC:strict,float16:NCHW:strict",
                                        jobs=1, arch=arch, batch=b, backward=False))
    sys.path.insert(0, str(ROOT / "tools"))
    import precompile_tests            # the GPU tests' non-default conv kernels
    seen.extend(precompile_tests.test_stubs().values())
    import test_backward               # the backward tests and fuzz (300 problems, as precompile_all.sh), training
    import test_train
    import test_train_graphs
    for stub, name in test_backward.stubs(300).items():
        seen.append((name, stub))
    test_train.precompile(arch)
    test_train_graphs.precompile(arch)
    from igemm.baselines import compare
    try:
        compare.main(["--precompile", "--arch", arch])
    except SystemExit:
        pass
    tc = _build.find_toolchain()
    flags = _build.base_flags(False)
    src = _build.cache_dir()
    dest.mkdir(parents=True, exist_ok=True)
    n = missing = 0
    for name, stub in seen:
        f = f"{name}-{_build._key(stub, arch, tc, flags)}.cubin"
        if (src / f).exists():
            if not (dest / f).exists():
                shutil.copy2(src / f, dest / f)
                n += 1
        else:
            missing += 1
    print(f"{n} cubins copied to {dest} ({missing} not in the cache: they compile on first use)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
