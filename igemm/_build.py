"""Toolchain discovery, kernel compilation and the two-level kernel cache.

A kernel instance is a tiny generated C++ *stub* (an ``#include`` of a ``csrc/`` header and one
instantiation); it is compiled to a cubin for the device's architecture, cached on disk and loaded
through ``cuda.core``.

Disk cache: ``$IGEMM_CACHE_DIR`` (default ``~/.cache/igemm``), one file per key. The key hashes the
stub, the ``csrc/`` headers it includes (transitively), the CUTLASS version, the compiler identity, the
flags and the architecture. Files carry a SHA-256 of their payload, so a truncated or corrupted file is
detected and rebuilt; they are written to a temporary name and renamed into place (atomic on POSIX),
readable by every user. A lock file per key makes concurrent first calls, in threads or processes,
compile once. A cache directory that cannot be written is read, and new kernels go to a per-user
fallback directory or memory, with one warning.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.resources
import os
import posixpath
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from functools import lru_cache
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: lock files instead (see _entry_lock)
    fcntl = None

__all__ = [
    "Toolchain", "ToolchainNotFoundError", "CompileError", "find_toolchain", "cutlass_include_dir",
    "csrc_dir", "csrc_hash", "arch_for", "compile_cubin", "compile_many", "cache_dir", "cache_status",
    "CacheWarning",
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
    """Directory of the shipped device headers: ``igemm/csrc`` of an install, or the ``csrc/`` beside
    ``igemm/`` in a source checkout used without installing (PYTHONPATH=<repo>)."""
    here = Path(__file__).resolve().parent
    checkout = here.parent / "csrc"
    if not (here / "csrc" / "__init__.py").is_file() and (checkout / "__init__.py").is_file():
        return checkout
    return Path(str(importlib.resources.files("igemm.csrc")))


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
    """The installed nvidia-cutlass version (part of every cache key)."""
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
    """The compiler flags of every kernel (part of its cache key); ``debug`` adds line info."""
    flags = ["-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr"]
    if debug:
        flags.append("-lineinfo")
    return flags


def _key(stub: str, arch: str, tc: Toolchain, flags: list[str]) -> str:
    h = hashlib.sha256()
    for part in (stub, csrc_hash(stub), cutlass_version(), tc.kind, tc.version, " ".join(flags), arch):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:40]


def compile_cubin(stub: str, arch: str, *, name: str = "kernel", toolchain: Toolchain | None = None,
                  use_cache: bool = True) -> tuple[bytes, str]:
    """Compile a stub to a cubin for ``arch``; returns ``(cubin, cache_key)``. Cached on disk.

    Concurrent first calls for one key (threads or processes) compile it once. A cache directory that
    cannot be written never fails the call (see :func:`cache_dir`)."""
    tc = toolchain or find_toolchain()
    debug = os.environ.get("IGEMM_DEBUG", "") not in ("", "0")
    flags = base_flags(debug)
    key = _key(stub, arch, tc, flags)

    def compile_() -> tuple[bytes, str]:
        return (_compile_nvcc if tc.kind == "nvcc" else _compile_nvrtc)(stub, arch, tc, flags, name)
    if not use_cache:
        return compile_()[0], key
    return _cached(f"{name}-{key}", compile_, stub if debug else None), key


# --------------------------------------------------------------------------------------------- disk cache
_LOCK_TIMEOUT_S = 300.0  # a waiter compiles itself after this long: a hung holder delays, never blocks, a call
_STALE_S = 600.0         # a temporary file this old is a killed writer's: a live one renames it within moments
_memory: dict[tuple[str, str], bytes] = {}   # (cache dir, entry) -> cubin, for entries no directory took
_dir_state: dict[str, str | None] = {}       # directory -> why it cannot be written (None: it can)
_warned: set[str] = set()


class CacheWarning(UserWarning):
    """The kernel cache directory cannot be written: new kernels go to a per-user fallback or memory."""


def cache_dir() -> Path:
    """The kernel cache directory, ``$IGEMM_CACHE_DIR`` (default ``~/.cache/igemm``), created if possible.

    Raises ValueError when it, or a parent, is a file. A directory that cannot be created or written is no
    error: its readable entries are used, new ones go to a per-user fallback (``~/.cache/igemm``, then
    ``<tempdir>/igemm-cache-<uid>``) or, failing that, stay in memory, with one :class:`CacheWarning`."""
    env = os.environ.get("IGEMM_CACHE_DIR")
    d = Path(env) if env else _home_cache()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass                                    # unwritable: degrade; a file in the way is reported below
    if not d.is_dir():
        blocker = next((p for p in (d, *d.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            what = f"IGEMM_CACHE_DIR={env}" if env else f"the default kernel cache directory {d}"
            raise ValueError(f"{what} is not a directory ({blocker} is a file): point IGEMM_CACHE_DIR at "
                             "a directory")
    return d


def cache_status() -> str:
    """One line for ``python -m igemm info``: the cache directory and where new kernels go. Raises
    ValueError as :func:`cache_dir` does."""
    dirs = _cache_dirs(cache_dir())
    if _unwritable(dirs[0]) is None:
        return f"{dirs[0]} (writable)"
    to = dirs[1] if len(dirs) > 1 else "memory, for this process only"
    return f"{dirs[0]} (not writable: {_unwritable(dirs[0])}; new kernels go to {to})"


def _home_cache() -> Path:
    return Path.home() / ".cache" / "igemm"


def _tmp_cache() -> Path:
    user = os.geteuid() if hasattr(os, "geteuid") else os.environ.get("USERNAME", "user")
    return Path(tempfile.gettempdir()) / f"igemm-cache-{user}"


def _cache_dirs(primary: Path) -> list[Path]:
    """``[primary]`` when it can be written, else ``[primary, first writable per-user fallback]``
    (``[primary]`` alone when none is: new entries then stay in memory)."""
    if _unwritable(primary) is None:
        return [primary]
    try:
        fallbacks = [_home_cache(), _tmp_cache()]
    except RuntimeError:                        # no home directory
        fallbacks = [_tmp_cache()]
    return [primary, *[d for d in fallbacks if d != primary and _unwritable(d) is None][:1]]


def _unwritable(d: Path) -> str | None:
    """Why new entries cannot be written into ``d`` (None: they can). Probed once per process by writing a
    file, since permission bits do not tell (root ignores them; a read-only mount overrides them). A usable
    directory is swept of what killed processes left."""
    k = str(d)
    if k not in _dir_state:
        why = None
        try:
            shared = d == _tmp_cache()          # in a directory every user can write
            d.mkdir(mode=0o700 if shared else 0o777, parents=True, exist_ok=True)
            st = os.lstat(d)
            if shared and hasattr(os, "geteuid") and (st.st_uid != os.geteuid() or st.st_mode & 0o022
                                                      or not stat.S_ISDIR(st.st_mode)):
                why = "owned by another user, or writable by others"
            else:
                probe = d / f".probe-{os.getpid()}-{os.urandom(4).hex()}.tmp"
                os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
                os.unlink(probe)
        except OSError as e:
            why = e.strerror or str(e)
        _dir_state[k] = why
        if why is None:
            _sweep(d)
    return _dir_state[k]


def _read_cached(path: Path) -> bytes | None:
    """The verified payload of a cache file; None when it is missing, unreadable, truncated or corrupt."""
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
    """Write a cache file through a temporary file renamed into place. Mode 0644 less the umask (not
    mkstemp's 0600): a cache filled by one user, e.g. an image build, serves every user."""
    blob = _MAGIC + hashlib.sha256(data).hexdigest().encode() + data
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _lookup(primary: Path, dirs: list[Path], entry: str) -> bytes | None:
    for d in dirs:
        hit = _read_cached(d / f"{entry}.cubin")
        if hit is not None:
            return hit
    return _memory.get((str(primary), entry))


def _cached(entry: str, compile_, debug_stub: str | None) -> bytes:
    """The cubin of ``entry`` (``<name>-<key>``) from the cache, else compiled once under the entry's lock
    and stored in the first writable directory (memory when none is)."""
    primary = cache_dir()
    hit = _lookup(primary, [primary], entry)
    if hit is not None:
        return hit
    dirs = _cache_dirs(primary)
    hit = _lookup(primary, dirs[1:], entry)
    if hit is not None:
        return hit
    lock_dir = dirs[-1] if _unwritable(dirs[-1]) is None else None
    with _entry_lock(lock_dir, entry):
        hit = _lookup(primary, dirs, entry)     # another process compiled it while this one waited
        if hit is None:
            hit, log = compile_()
            _store(primary, entry, hit, log, debug_stub)
    return hit


def _store(primary: Path, entry: str, cubin: bytes, log: str, debug_stub: str | None) -> None:
    """Write an entry into the first writable directory, else keep it in memory; warn once when that is
    not the cache directory itself."""
    where = None
    while where is None:
        d = next((d for d in _cache_dirs(primary) if _unwritable(d) is None), None)
        if d is None:
            break
        try:
            _write_atomic(d / f"{entry}.cubin", cubin)
        except OSError as e:                    # writable when probed, not now (full, remounted): the next one
            _dir_state[str(d)] = e.strerror or str(e)
            continue
        where = d
        for suffix, text in ((".log", log), (".cu", debug_stub)):
            if text is not None:
                try:
                    (d / f"{entry}{suffix}").write_text(text)
                except OSError:
                    pass
    if where is None:
        _memory[(str(primary), entry)] = cubin
    if where != primary and str(primary) not in _warned:
        _warned.add(str(primary))
        to = f"compiled into {where}" if where else "kept in memory, for this process only"
        warnings.warn(f"igemm: the kernel cache {primary} cannot be written ({_dir_state[str(primary)]}); "
                      f"its kernels are still read, new ones are {to}", CacheWarning, stacklevel=4)


# --------------------------------------------------------------------------------------------- locks
# POSIX: flock, which the kernel drops when its holder dies, so a killed compile never makes others wait.
# Elsewhere (Windows): an O_CREAT|O_EXCL file, taken over once older than the timeout.
@contextlib.contextmanager
def _entry_lock(d: Path | None, entry: str):
    """Hold ``<d>/<entry>.lock`` across threads and processes for up to _LOCK_TIMEOUT_S of waiting; past
    that, or where no lock can be made, the body runs unlocked (at worst a kernel is compiled twice)."""
    if d is None:
        yield
        return
    lock = d / f"{entry}.lock"
    deadline, delay = time.monotonic() + _LOCK_TIMEOUT_S, 0.005
    fd = None
    while True:
        try:
            fd = _try_lock(lock, _LOCK_TIMEOUT_S)
        except OSError:
            break
        if fd is not None or time.monotonic() >= deadline:
            break
        time.sleep(delay)
        delay = min(2 * delay, 0.2)
    try:
        yield
    finally:
        if fd is not None:
            _release(lock, fd)


def _try_lock(lock: Path, stale_s: float) -> int | None:
    """One attempt at ``lock``: the held descriptor, or None while another holds it."""
    if fcntl is None:
        try:
            return os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                if time.time() - os.stat(lock).st_mtime > stale_s:    # its holder died
                    os.unlink(lock)
            except OSError:
                pass
            return None
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.path.samestat(os.fstat(fd), os.stat(lock)):
            return fd
    except (BlockingIOError, FileNotFoundError):
        pass                        # held; or its holder removed it on release: lock the file now there
    except OSError:
        os.close(fd)
        raise
    os.close(fd)
    return None


def _release(lock: Path, fd: int) -> None:
    """Remove the lock file and let go. Under flock it is removed while still held, and _try_lock checks
    that the file it locked is the one at the path, so a waiter never holds a removed file."""
    if fcntl is not None:
        _unlink(lock)
        os.close(fd)
    else:
        os.close(fd)                # Windows cannot remove an open file
        _unlink(lock)


def _sweep(d: Path) -> None:
    """Remove temporary files, and lock files nobody holds, older than _STALE_S: left by killed processes."""
    now = time.time()
    for p in [*d.glob("*.tmp"), *d.glob("*.lock")]:
        try:
            if now - p.stat().st_mtime <= _STALE_S:
                continue
            if p.suffix == ".tmp":
                p.unlink()
            elif (fd := _try_lock(p, _STALE_S)) is not None:
                _release(p, fd)
        except OSError:
            pass


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
