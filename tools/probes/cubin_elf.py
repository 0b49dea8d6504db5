"""Copy cached kernels out as plain ELF cubins, for SASS on the GPU machine (the dev machine has no cuobjdump).

The kernel cache stores each cubin behind a header (``igemm._build._MAGIC`` and a digest line). This script writes
the ELF part of every cached ``*.cubin`` whose name contains each PATTERN to OUT_DIR. Then, on the device:

    for f in OUT_DIR/*.cubin; do cuobjdump -sass $f > $OUT/$(basename $f .cubin).sass; done

Count what matters with grep. Session 27, for example, counted `R2UR`: the uniform-register copies ptxas makes
when it cannot prove a branch warp-uniform.

    python tools/probes/cubin_elf.py CACHE_DIR OUT_DIR PATTERN [PATTERN ...]
"""
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    cache, out, patterns = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for f in sorted(cache.glob("*.cubin")):
        if not all(p in f.name for p in patterns):
            continue
        data = f.read_bytes()
        i = data.find(b"\x7fELF")
        if i < 0:
            print("no ELF in", f.name)
            continue
        (out / f.name).write_bytes(data[i:])
        print(f.name, len(data) - i, "bytes")
        n += 1
    print(n, "cubins written to", out)


if __name__ == "__main__":
    main()
