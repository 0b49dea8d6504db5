"""Toolchain discovery, kernel compilation and the two-level kernel cache.

A kernel instance is a tiny generated C++ *stub* (an ``#include`` of a ``csrc/`` header and one
instantiation); it is compiled to a cubin for the device's architecture, cached on disk and loaded
through ``cuda.core``.

Disk cache: ``$IGEMM_CACHE_DIR`` (default ``~/.cache/igemm``), one file per key. The key hashes the
stub, the ``csrc/`` headers it includes (transitively), the CUTLASS version, the compiler identity, the
flags and the architecture. Files are written to a temporary name and renamed into place (atomic on POSIX), and carry
a SHA-256 of their payload, so a truncated or corrupted file is detected and rebuilt; concurrent
processes compiling the same key both produce a valid file and the last rename wins.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

__all__ = [
    "Toolchain", "ToolchainNotFoundError", "CompileError", "find_toolchain", "cutlass_include_dir",
    "csrc_dir", "csrc_hash", "arch_for", "compile_cubin", "compile_many", "cache_dir",
]

_MAGIC = b"IGEMMCUBIN1\n"


class ToolchainNotFoundError(RuntimeError):
    """No CUDA compiler could be found."""


class CompileError(RuntimeError):
    """The CUDA compiler rejected a generated kernel instance."""


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """A CUDA C++ compiler igemm can use.

    kind: ``"nvcc"`` or ``"nvrtc"``; source: where it was found (``CUDA_HOME``, ``PATH``,
    ``pip:nvidia-cuda-nvcc``, ``pip:nvidia-cuda-nvrtc``); version: the compiler's own version string.
    """
    kind: str
    path: str | None
    version: str
    source: str
    include_dirs: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"{self.kind} {self.version} ({self.source}{': ' + self.path if self.path else ''})"


# --------------------------------------------------------------------------------------------- paths
def csrc_dir() -> Path:
    """Directory of the shipped device headers (``csrc/`` in the repo, ``igemm/csrc`` in a wheel)."""
    here = Path(__file__).resolve().parent.parent / "csrc"
    if (here / "__init__.py").is_file() and (here / "common.cuh").is_file():
        return here   # the checkout this igemm was imported from (an editable install may map igemm.csrc elsewhere)
    try:
        return Path(str(importlib.resources.files("igemm.csrc")))
    except ModuleNotFoundError:  # a source checkout on PYTHONPATH, not installed
        return Path(__file__).resolve().parent.parent / "csrc"


@lru_cache(maxsize=None)
def cutlass_include_dir() -> str:
    """CUTLASS/CuTe headers from the nvidia-cutlass wheel (never vendored)."""
    try:
        import cutlass_library
    except ImportError as e:  # pragma: no cover - dependency of the package
        raise ToolchainNotFoundError("nvidia-cutlass is not installed: pip install 'nvidia-cutlass==4.2.*'") from e
    inc = os.path.join(cutlass_library.source_path, "include")
    if not os.path.isfile(os.path.join(inc, "cute", "tensor.hpp")):
        raise ToolchainNotFoundError(f"CUTLASS headers not found under {inc}")
    return inc


@lru_cache(maxsize=None)
def cutlass_version() -> str:
    try:
        from importlib.metadata import version
        return version("nvidia-cutlass")
    except Exception:  # pragma: no cover
        return "unknown"


_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def csrc_hash(stub: str | None = None) -> str:
    """SHA-256 over the csrc/ headers a stub includes, transitively (name and content); over every
    header when ``stub`` is None. Part of every cache key: editing a header rebuilds exactly the kernels
    that include it."""
    d = csrc_dir()
    if stub is None:
        names = sorted(p.relative_to(d).as_posix() for p in d.rglob("*.cuh"))
    else:
        # a quoted include is looked up beside the including header first, then in csrc/ (as nvcc does)
        names, todo = set(), [("", n) for n in _INCLUDE.findall(stub)]
        while todo:
            base, inc = todo.pop()
            n = next((c for c in (posixpath.normpath(posixpath.join(base, inc)), posixpath.normpath(inc))
                      if not c.startswith("../") and (d / c).is_file()), None)
            if n is None or n in names:
                continue
            names.add(n)
            todo.extend((posixpath.dirname(n), i) for i in _INCLUDE.findall((d / n).read_text()))
        names = sorted(names)
    h = hashlib.sha256()
    for n in names:
        h.update(n.encode())
        h.update((d / n).read_bytes())
    return h.hexdigest()


def cache_dir() -> Path:
    d = Path(os.environ.get("IGEMM_CACHE_DIR") or Path.home() / ".cache" / "igemm")
    d.mkdir(parents=True, exist_ok=True)
    return d


# --------------------------------------------------------------------------------------------- discovery
def _nvcc_version(path: str) -> str:
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    m = re.search(r"release [\d.]+, V([\d.]+)", out)
    build = re.search(r"Build (\S+)", out)
    return (m.group(1) if m else "unknown") + (f" ({build.group(1)})" if build else "")


def _pip_nvidia_dirs() -> list[Path]:
    dirs = []
    for base in sys.path:
        for sub in ("nvidia/cu13", "nvidia/cuda_nvcc", "nvidia/cuda_nvrtc"):
            p = Path(base) / sub
            if p.is_dir():
                dirs.append(p)
    return dirs


@lru_cache(maxsize=None)
def find_toolchain(prefer: str | None = None) -> Toolchain:
    """Find a CUDA compiler: ``$CUDA_HOME``/``$CUDA_PATH``, ``nvcc`` on ``PATH``, or the pip wheels.

    ``prefer`` (or ``$IGEMM_COMPILER``) = ``"nvcc"`` or ``"nvrtc"`` picks one when both exist.
    """
    prefer = prefer or os.environ.get("IGEMM_COMPILER") or "nvcc"
    if prefer not in ("nvcc", "nvrtc"):
        raise ValueError(f"IGEMM_COMPILER must be 'nvcc' or 'nvrtc', got {prefer!r}")
    candidates: list[Toolchain] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            p = os.path.join(root, "bin", "nvcc")
            candidates.append(Toolchain("nvcc", p, _nvcc_version(p), var))
            break
    on_path = shutil.which("nvcc")
    if on_path and not any(c.path == on_path for c in candidates):
        candidates.append(Toolchain("nvcc", on_path, _nvcc_version(on_path), "PATH"))
    for d in _pip_nvidia_dirs():
        p = d / "bin" / "nvcc"
        if p.is_file() and os.access(p, os.X_OK):
            candidates.append(Toolchain("nvcc", str(p), _nvcc_version(str(p)), "pip:nvidia-cuda-nvcc"))
    nvrtc = _find_nvrtc()
    if nvrtc is not None:
        candidates.append(nvrtc)
    if not candidates:
        raise ToolchainNotFoundError(
            "igemm compiles its kernels at first use and found no CUDA compiler. Provide one of:\n"
            "  1. a CUDA toolkit: set CUDA_HOME (or CUDA_PATH) to its root, e.g. /usr/local/cuda;\n"
            "  2. nvcc on PATH;\n"
            "  3. the pip toolkit: pip install 'igemm[toolkit]' (nvidia-cuda-nvcc, nvidia-cuda-nvrtc, "
            "nvidia-cuda-cccl, nvidia-cuda-runtime 13.0).")
    for c in candidates:
        if c.kind == prefer:
            return c
    return candidates[0]


def _find_nvrtc() -> Toolchain | None:
    """NVRTC through cuda.core's Program, with the CUDA headers of the pip wheels (CUDA 13 layout)."""
    try:
        from cuda.bindings import nvrtc as _nvrtc
        err, major, minor = _nvrtc.nvrtcVersion()
        if int(err) != 0:
            return None
    except Exception:
        return None
    incs = []
    for d in _pip_nvidia_dirs():
        for sub in ("include", "include/cccl"):
            if (d / sub).is_dir():
                incs.append(str(d / sub))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root:
            for sub in ("include", "include/cccl"):
                if os.path.isdir(os.path.join(root, sub)):
                    incs.append(os.path.join(root, sub))
    if not any(os.path.isfile(os.path.join(i, "cuda_fp16.h")) for i in incs):
        return None
    return Toolchain("nvrtc", None, f"{major}.{minor}", "pip:nvidia-cuda-nvrtc", tuple(incs))


# --------------------------------------------------------------------------------------------- arch
def arch_for(cc: tuple[int, int]) -> str:
    """Compilation target for a compute capability: sm_90a/sm_100a take their arch-specific suffix."""
    major, minor = cc
    if (major, minor) < (8, 0):
        raise NotImplementedError(f"igemm needs compute capability >= 8.0 (cp.async, bf16 MMA); got {major}.{minor}")
    if major in (9, 10):
        return f"sm_{major}{minor}a"
    return f"sm_{major}{minor}"


def _nvcc_arch_flags(arch: str) -> list[str]:
    num = arch[3:]
    return [f"-gencode=arch=compute_{num},code={arch}"]


# --------------------------------------------------------------------------------------------- compile
def base_flags(debug: bool) -> list[str]:
    flags = ["-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr"]
    if debug:
        flags.append("-lineinfo")
    return flags


_compile_lock = threading.Lock()


def _key(stub: str, arch: str, tc: Toolchain, flags: list[str]) -> str:
    h = hashlib.sha256()
    for part in (stub, csrc_hash(stub), cutlass_version(), tc.kind, tc.version, " ".join(flags), arch):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:40]


def _read_cached(path: Path) -> bytes | None:
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    if not blob.startswith(_MAGIC) or len(blob) < len(_MAGIC) + 64:
        return None
    digest = blob[len(_MAGIC):len(_MAGIC) + 64].decode("ascii", "replace")
    payload = blob[len(_MAGIC) + 64:]
    if hashlib.sha256(payload).hexdigest() != digest:
        return None
    return payload


def _write_atomic(path: Path, data: bytes) -> None:
    blob = _MAGIC + hashlib.sha256(data).hexdigest().encode() + data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def compile_cubin(stub: str, arch: str, *, name: str = "kernel", toolchain: Toolchain | None = None,
                  use_cache: bool = True) -> tuple[bytes, str]:
    """Compile a stub to a cubin for ``arch``; returns ``(cubin, cache_key)``. Cached on disk."""
    tc = toolchain or find_toolchain()
    debug = os.environ.get("IGEMM_DEBUG", "") not in ("", "0")
    flags = base_flags(debug)
    key = _key(stub, arch, tc, flags)
    path = cache_dir() / f"{name}-{key}.cubin"
    if use_cache:
        hit = _read_cached(path)
        if hit is not None:
            return hit, key
    cubin, log = (_compile_nvcc if tc.kind == "nvcc" else _compile_nvrtc)(stub, arch, tc, flags, name)
    if use_cache:
        _write_atomic(path, cubin)
        try:
            (cache_dir() / f"{name}-{key}.log").write_text(log)
        except OSError:
            pass
        if debug:
            (cache_dir() / f"{name}-{key}.cu").write_text(stub)
    return cubin, key


def _compile_nvcc(stub: str, arch: str, tc: Toolchain, flags: list[str], name: str) -> tuple[bytes, str]:
    with tempfile.TemporaryDirectory(prefix="igemm-") as tmp:
        src = os.path.join(tmp, f"{name}.cu")
        out = os.path.join(tmp, f"{name}.cubin")
        with open(src, "w") as f:
            f.write(stub)
        cmd = [tc.path, "-cubin", *flags, *_nvcc_arch_flags(arch), "-Xptxas=-v",
               f"-I{csrc_dir()}", f"-I{cutlass_include_dir()}", "-o", out, src]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise CompileError(f"nvcc failed ({tc.describe()}) for {name}:\n{r.stderr[-6000:]}\n--- stub ---\n{stub}")
        with open(out, "rb") as f:
            return f.read(), r.stderr


def _compile_nvrtc(stub: str, arch: str, tc: Toolchain, flags: list[str], name: str) -> tuple[bytes, str]:
    from cuda.core import Program, ProgramOptions
    opts = ProgramOptions(std="c++17", arch=arch, device_as_default_execution_space=True,
                          include_path=[str(csrc_dir()), cutlass_include_dir(), *tc.include_dirs],
                          define_macro=["NDEBUG"], lineinfo="-lineinfo" in flags)
    try:
        prog = Program(stub, code_type="c++", options=opts)
        obj = prog.compile("cubin", logs=None)
    except Exception as e:
        raise CompileError(f"NVRTC failed for {name}: {e}\n--- stub ---\n{stub}") from e
    return bytes(obj.code), ""


def compile_many(items, arch: str, jobs: int | None = None) -> int:
    """Compile ``(name, stub)`` pairs into the disk cache, ``jobs`` compilers at a time (nvcc runs outside
    the GIL, so threads suffice). Duplicate stubs are compiled once. Returns the number of stubs."""
    from concurrent.futures import ThreadPoolExecutor
    unique = dict((stub, name) for name, stub in items)
    with ThreadPoolExecutor(jobs or os.cpu_count() or 2) as ex:
        list(ex.map(lambda it: compile_cubin(it[0], arch, name=it[1]), unique.items()))
    return len(unique)
