"""The launch step in C: ``csrc/host/launch.c``, a small CPython extension that calls the driver's
``cuLaunchKernel`` for every :class:`~igemm._kernel.Launcher` (``raw``; ``coop``: ``cuLaunchCooperativeKernel``)
and runs a conv plan's launch record -- its argument binds and launches -- in one call (``launch``; see
:class:`igemm.conv._launch.LaunchRecord`).

It is built on first use with the host's C compiler (``$CC``, else ``cc``/``gcc``/``clang``) against this
Python's headers, into the kernel cache (``$IGEMM_CACHE_DIR``), keyed by its source, the Python ABI and the
compiler. Without a compiler or headers every launch goes through cuda.bindings instead, with the same
semantics and more host time per call: :data:`MOD` is None and :func:`status` says why.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

__all__ = ["MOD", "get", "status", "build", "load", "python_only"]

_NAME = "igemm_hostlaunch"
MOD = None                     # the extension with the driver found, once get() has run; else None
_lock = threading.Lock()
_state: dict = {}              # "mod": the module or None, "why": the reason it is None


def _source() -> Path:
    from ._build import csrc_dir
    return csrc_dir() / "host" / "launch.c"


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
        os.replace(tmp, path)       # (atomic: concurrent first builds each publish a whole file)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load(path: Path | None = None):
    """The extension module, built if needed (its driver entry points not looked up: see :func:`get`)."""
    path = path or build()
    loader = importlib.machinery.ExtensionFileLoader(_NAME, str(path))
    spec = importlib.util.spec_from_file_location(_NAME, str(path), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def get():
    """The extension module with the driver's entry points found, or None (see :func:`status`); built and
    loaded once per process, then also in :data:`MOD`."""
    global MOD
    if "mod" in _state:
        return _state["mod"]
    with _lock:
        if "mod" not in _state:
            mod, why = None, ""
            try:                           # load the driver where there is one: init() looks in the loaded one
                from cuda.bindings import driver
                driver.cuCtxGetCurrent()
            except Exception:
                pass
            try:
                m = load()
                if m.init():
                    mod = m
                else:
                    why = ("libcuda.so.1 not loaded, or without cuLaunchKernel / cuLaunchCooperativeKernel / "
                           "cuCtxGetCurrent / cuEventRecord / cuStreamWaitEvent")
            except (RuntimeError, OSError, ImportError, ValueError) as e:   # (ValueError: a bad cache dir)
                why = f"not built: {e}"
            _state["why"] = why
            _state["mod"] = MOD = mod
    return _state["mod"]


def status() -> str:
    """'C (csrc/host/launch.c)', or why launches go through cuda.bindings instead."""
    return "C (csrc/host/launch.c)" if get() is not None else f"cuda.bindings ({_state.get('why', '')})"


@contextlib.contextmanager
def python_only():
    """Launch through cuda.bindings inside this block (every launcher and plan, this process): how the tests
    and ``benchmarks/host_overhead.py`` run the path a machine without a C compiler takes. Not thread-safe."""
    global MOD
    get()
    saved, MOD = MOD, None
    try:
        yield
    finally:
        MOD = saved
