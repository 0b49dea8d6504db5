"""The host fast path: ``csrc/fastlaunch.c``, a small CPython extension that calls the driver's
``cuLaunchKernel`` for every launcher (``raw``), writes a lean record's pointer slots and launches it
(``launch``), and runs a whole conv plan call -- checks, allocation, launch -- for the common case
(``conv``; see ``Conv2dPlan._arm``).

It is built on first use with the host's C compiler (``$CC``, else ``cc``/``gcc``) against this Python's
headers, into the kernel cache (``$IGEMM_CACHE_DIR``), keyed by its source, the Python ABI and the
compiler. Without a compiler or headers -- or with ``IGEMM_FAST_LAUNCH=0`` -- every launch takes the
cuda.bindings path, which does the same thing more slowly: :func:`get` returns None and :func:`status`
says why.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

__all__ = ["get", "status", "pack", "build", "HEAD", "PREP"]

HEAD, PREP = 22, 14            # int64 fields of a record's head and of each preparation (see fastlaunch.c)
_NAME = "igemm_fastlaunch"
_lock = threading.Lock()
_state: dict = {}              # "mod": the module or None, "why": the reason it is None


def _source() -> Path:
    from ._build import csrc_dir
    return csrc_dir() / "fastlaunch.c"


def _compiler() -> list[str] | None:
    cc = os.environ.get("CC")
    if cc:
        return cc.split()
    for name in ("cc", "gcc", "clang"):
        p = shutil.which(name)
        if p:
            return [p]
    return None


def build(cache: Path | None = None) -> Path:
    """Compile the extension (or find it in the cache); its path. Raises RuntimeError with the
    compiler's output when it cannot be built."""
    from ._build import cache_dir
    src = _source().read_bytes()
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install cc/gcc)")
    inc = sysconfig.get_paths()["include"]
    if not (Path(inc) / "Python.h").is_file():
        raise RuntimeError(f"no Python.h in {inc} (install this Python's development headers)")
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    key = hashlib.sha256(src + repr((sys.version, suffix, cc, inc)).encode()).hexdigest()[:16]
    d = cache or cache_dir()
    path = d / f"{_NAME}-{key}{suffix}"
    if path.is_file():
        return path
    fd, tmp = tempfile.mkstemp(dir=d, prefix=path.name + ".", suffix=".tmp.so")
    os.close(fd)
    cmd = cc + ["-O2", "-shared", "-fPIC", "-std=c99", "-D_GNU_SOURCE", "-I", inc, str(_source()), "-o", tmp, "-ldl"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout}{r.stderr}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _load(path: Path):
    loader = importlib.machinery.ExtensionFileLoader(_NAME, str(path))
    spec = importlib.util.spec_from_file_location(_NAME, str(path), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def get():
    """The extension module with the driver's ``cuLaunchKernel`` found, or None (see :func:`status`).
    Built and loaded once per process."""
    if "mod" in _state:
        return _state["mod"]
    with _lock:
        if "mod" not in _state:
            mod, why = None, ""
            if os.environ.get("IGEMM_FAST_LAUNCH", "1") == "0":
                why = "off (IGEMM_FAST_LAUNCH=0)"
            else:
                try:
                    m = _load(build())
                    if m.init():
                        mod = m
                    else:
                        why = "libcuda.so.1 not loaded, or without cuLaunchKernel / cuCtxGetCurrent"
                except (RuntimeError, OSError, ImportError) as e:
                    why = f"not built: {e}"
            _state["why"] = why
            _state["mod"] = mod
    return _state["mod"]


def status() -> str:
    """'active', or why plan calls launch through cuda.bindings instead."""
    return "active" if get() is not None else _state.get("why", "")


def pack(func: int, params: int, buf: int, grid, block, smem: int, slots, maps=(-1, 0, -1, 0), copies=(-1, -1),
         preps=()) -> bytes:
    """A launch record for ``launch``: ``slots`` = the argument slots of x, w, y, residual, mask (-1: none);
    ``maps`` = (ia, oa, ib, ob), the tensor maps' address words and offsets; ``copies`` = the addresses the
    conv reads instead of x, w (-1: the caller's); ``preps`` = up to two preparation launches, each
    (func, params, buf, grid, block, smem, slot0, slot1, sel0, sel1) with sel 0/1/2 = 0/x/w."""
    if len(preps) > 2:
        raise ValueError("at most two preparation launches")
    f = [func, params, buf, *grid, *block, smem, *slots, *maps, *copies, len(preps)]
    for p in preps:
        pf, pp, pb, pg, pbl, ps, s0, s1, e0, e1 = p
        f += [pf, pp, pb, *pg, *pbl, ps, s0, s1, e0, e1]
    if len(f) != HEAD + PREP * len(preps):
        raise ValueError("malformed launch record")
    return struct.pack(f"<{len(f)}q", *f)
