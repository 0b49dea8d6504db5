"""The on-disk kernel cache under concurrency, corruption and unwritable directories.

* 4 processes compiling the same and different kernels into one empty cache at once: no corruption, each
  gets a correct cubin, every file verifies, no temporary file is left, the shared kernel is compiled
  once; a second round only reads. 6 processes asking for one kernel compile it once (both lock kinds); a
  waiter past the lock timeout compiles itself; a killed lock holder does not block.
* A cache directory that cannot be written is read, and new kernels go to a per-user fallback or memory
  with one warning (simulated by failing syscalls, and for real as a user who does not own the cache).
  Cubins are readable by all; a file as IGEMM_CACHE_DIR is one clear error; stale temporary files are swept.
* A truncated / bit-flipped / foreign cache file is detected (``_build._read_cached`` returns None) and
  rebuilt, rewriting a valid file; a failed write or a failed compile leaves nothing behind.
* On a GPU: a corrupted cubin of a real kernel is rebuilt and the kernel computes the right answer.

Compile-tier tests (nvcc, no GPU). The kernels are tiny hand-written stubs (about a second of nvcc each):
the cache machinery is the same for every stub, and these compile reproducibly (library stubs do not:
their anonymous namespace gets a per-compile symbol hash, so two compiles differ in bytes though not in
behaviour).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np
import pytest

from igemm import _build

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ARCH = "sm_80"

pytestmark = [pytest.mark.compile,
              pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")]


def probe_stub(tag: str, value: float = 1.0) -> str:
    return (f'extern "C" __global__ void igemm_cache_probe_{tag}(float* p) {{\n'
            f"  p[threadIdx.x] = {value!r}f * threadIdx.x;\n}}\n")


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _files(d, pattern="*"):
    return sorted(p.name for p in d.glob(pattern))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory; the per-user fallbacks (``~/.cache/igemm``, ``<tempdir>/igemm-cache-<uid>``)
    are redirected under ``tmp_path`` too (``home/``, ``tmp/``)."""
    d = tmp_path / "cache"
    monkeypatch.setenv("IGEMM_CACHE_DIR", str(d))
    monkeypatch.delenv("IGEMM_DEBUG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return d


@pytest.fixture(params=["flock", "exclusive_file"])
def lock_kind(request, monkeypatch):
    """Both lock mechanisms: flock (POSIX) and the portable O_CREAT|O_EXCL lock file."""
    if request.param == "flock" and os.name != "posix":
        pytest.skip("no flock here")
    if request.param == "exclusive_file":
        monkeypatch.setattr(_build, "fcntl", None, raising=False)
    return request.param


@pytest.fixture
def compiles(monkeypatch):
    """Counts real compiler invocations (cache misses)."""
    calls = []
    orig = _build._compile_nvcc

    def counted(*a, **k):
        calls.append(a[4] if len(a) > 4 else k.get("name"))
        return orig(*a, **k)
    monkeypatch.setattr(_build, "_compile_nvcc", counted)
    return calls


@pytest.fixture
def fake_nvcc(monkeypatch):
    """An instant, deterministic stand-in for nvcc (the cache layer does not care what the bytes are);
    ``delay`` widens the race window of the concurrency tests. Counts its invocations."""
    class Calls(list):
        pass
    calls = Calls()

    def compile_(stub, arch, tc, flags, name):
        calls.append(name)
        time.sleep(compile_.delay)
        body = hashlib.sha256((stub + arch).encode()).digest()
        return b"\x7fELF" + body * 40, "fake log"
    compile_.delay = 0.0
    monkeypatch.setattr(_build, "_compile_nvcc", compile_)
    calls.fake = compile_
    return calls


@pytest.fixture(autouse=True)
def _nvcc_toolchain(monkeypatch):
    monkeypatch.setenv("IGEMM_COMPILER", "nvcc")
    if _build.find_toolchain().kind != "nvcc":
        pytest.skip("nvcc not selected")


# ------------------------------------------------------------------------------------------------ processes
_WORKER = textwrap.dedent('''
    import hashlib, json, os, sys, time
    go, jobs = sys.argv[1], json.loads(sys.argv[2])
    from igemm import _build
    if os.environ.get("PROBE_NO_FCNTL"):
        _build.fcntl = None
    real, count = _build._compile_nvcc, os.environ.get("PROBE_COUNT_FILE")
    if os.environ.get("PROBE_FAKE_DELAY"):
        def real(stub, arch, tc, flags, name):
            time.sleep(float(os.environ["PROBE_FAKE_DELAY"]))
            return b"\\x7fELF" + hashlib.sha256((stub + arch).encode()).digest() * 40, "fake log"

    def counted(*a):
        if count:
            with open(count, "a") as f:
                f.write(a[4] + "\\n")
        return real(*a)
    _build._compile_nvcc = counted
    if os.environ.get("PROBE_NO_COMPILE"):
        def refuse(*a, **k):
            raise SystemExit("cache miss: the compiler was called")
        _build._compile_nvcc = refuse
    t0 = time.time()
    while not os.path.exists(go):
        if time.time() - t0 > 120:
            raise SystemExit("no go signal")
        time.sleep(0.005)
    out = {}
    for name, stub in jobs:
        cubin, key = _build.compile_cubin(stub, "%s", name=name)
        out[name] = [key, hashlib.sha256(cubin).hexdigest(), cubin[:4].hex()]
    print("RESULT " + json.dumps(out))
''' % ARCH)


def _run_workers(cache_dir, job_lists, tmp_path, env_extra=None, timeout=300):
    env = dict(os.environ, IGEMM_CACHE_DIR=str(cache_dir), IGEMM_COMPILER="nvcc",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
    env.pop("IGEMM_DEBUG", None)
    env.update(env_extra or {})
    go = tmp_path / f"go-{time.monotonic_ns()}"
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(go), json.dumps(jobs)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for jobs in job_lists]
    time.sleep(0.5)
    go.write_text("go")                  # all start compiling at (nearly) the same moment
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("cache workers timed out")
        assert p.returncode == 0, f"worker failed (rc {p.returncode}):\n{out[-3000:]}\n{err[-3000:]}"
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT "):]))
    return results


def _check_cache_dir(cache_dir, expected: dict) -> None:
    """Every cubin verifies and holds the expected bytes; nothing temporary is left."""
    assert not _files(cache_dir, "*.tmp"), _files(cache_dir)
    cubins = sorted(cache_dir.glob("*.cubin"))
    assert len(cubins) == len(expected), _files(cache_dir)
    for name, sha in expected.items():
        hits = [p for p in cubins if p.name.startswith(name + "-")]
        assert len(hits) == 1, (name, _files(cache_dir))
        payload = _build._read_cached(hits[0])
        assert payload is not None, f"{hits[0].name} does not verify"
        assert _sha(payload) == sha and payload[:4] == b"\x7fELF"


def test_four_processes_one_empty_cache(tmp_path):
    """4 processes compile one shared kernel and one of their own into the same empty cache at once; the
    shared kernel is compiled once (the others wait for it on its lock)."""
    cache_dir = tmp_path / "cache"
    shared = ("probe_shared", probe_stub("shared", 2.0))
    jobs = [[shared, (f"probe_own{i}", probe_stub(f"own{i}", float(i)))] for i in range(4)]
    # half of them do their own kernel first, so compiles of different keys overlap too
    jobs = [j if i % 2 == 0 else j[::-1] for i, j in enumerate(jobs)]
    count = tmp_path / "compiles.txt"
    res = _run_workers(cache_dir, jobs, tmp_path, {"PROBE_COUNT_FILE": str(count)})
    assert sorted(count.read_text().split()) == sorted(["probe_shared"] + [f"probe_own{i}" for i in range(4)])
    shas = {r["probe_shared"][1] for r in res}
    keys = {r["probe_shared"][0] for r in res}
    assert len(shas) == 1 and len(keys) == 1, "the processes got different bytes for one kernel"
    assert all(r[n][2] == "7f454c46" for r in res for n in r)
    expected = {"probe_shared": shas.pop()}
    for i, r in enumerate(res):
        expected[f"probe_own{i}"] = r[f"probe_own{i}"][1]
    assert len(set(expected.values())) == 5
    _check_cache_dir(cache_dir, expected)
    # second round: everything is a cache hit (the compiler is disabled in the workers), same bytes
    again = _run_workers(cache_dir, [[shared] + [(f"probe_own{i}", probe_stub(f"own{i}", float(i))) for i in range(4)]
                                     for _ in range(2)], tmp_path, {"PROBE_NO_COMPILE": "1"})
    for r in again:
        assert {n: v[1] for n, v in r.items()} == expected
    _check_cache_dir(cache_dir, expected)


def test_threads_one_empty_cache(cache, fake_nvcc, lock_kind):
    """Threads of one process (what norm.compile_stubs does) into one empty cache: each kernel compiles once."""
    fake_nvcc.fake.delay = 0.2
    stubs = [("probe_t_shared", probe_stub("t_shared", 3.0))] + [(f"probe_t{i}", probe_stub(f"t{i}", i + 0.5))
                                                                 for i in range(3)]
    out, errors = {}, []
    barrier = threading.Barrier(4)

    def work(i):
        try:
            barrier.wait()
            for name, stub in (stubs[0], stubs[1 + i % 3]):
                cubin, _ = _build.compile_cubin(stub, ARCH, name=name)
                out.setdefault(name, set()).add(_sha(cubin))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert all(len(v) == 1 for v in out.values())
    assert sorted(fake_nvcc) == sorted(n for n, _ in stubs), "a kernel was compiled more than once"
    _check_cache_dir(cache, {n: next(iter(v)) for n, v in out.items()})
    assert not _files(cache, "*.lock")


# ------------------------------------------------------------------------------------------------ corruption
def _truncate_half(b):
    return b[: len(b) // 2]


def _truncate_header(b):
    return b[:10]


def _flip_payload(b):
    i = len(_build._MAGIC) + 64 + 100
    return b[:i] + bytes([b[i] ^ 0x01]) + b[i + 1:]


def _flip_last(b):
    return b[:-1] + bytes([b[-1] ^ 0x80])


def _flip_digest(b):
    i = len(_build._MAGIC) + 3
    return b[:i] + (b"0" if b[i:i + 1] != b"0" else b"1") + b[i + 1:]


def _bare_cubin(b):
    return b[len(_build._MAGIC) + 64:]              # a valid ELF, but no header/checksum


def _empty(b):
    return b""


def _appended(b):
    return b + b"\0" * 16


CORRUPTIONS = [_truncate_half, _truncate_header, _flip_payload, _flip_last, _flip_digest, _bare_cubin, _empty,
               _appended]


def test_corrupted_file_is_rebuilt_by_nvcc(cache, compiles):
    """With the real compiler: a truncated cubin is rebuilt to the same bytes and a valid file."""
    _corrupt_and_rebuild(_truncate_half, cache, compiles)


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=[c.__name__.strip("_") for c in CORRUPTIONS])
def test_corrupted_file_is_detected_and_rebuilt(corrupt, cache, fake_nvcc):
    _corrupt_and_rebuild(corrupt, cache, fake_nvcc)


def _corrupt_and_rebuild(corrupt, cache, compiles):
    stub = probe_stub("corrupt", 4.0)
    good, key = _build.compile_cubin(stub, ARCH, name="probe_corrupt")
    assert len(compiles) == 1
    path = cache / f"probe_corrupt-{key}.cubin"
    assert _build._read_cached(path) == good
    path.write_bytes(corrupt(path.read_bytes()))
    assert _build._read_cached(path) is None, "a corrupted cache file was accepted"
    again, key2 = _build.compile_cubin(stub, ARCH, name="probe_corrupt")
    assert key2 == key and len(compiles) == 2, "the corrupted file was not rebuilt"
    assert again == good
    assert _build._read_cached(path) == good, "the rebuilt file does not verify"
    assert not _files(cache, "*.tmp")
    third, _ = _build.compile_cubin(stub, ARCH, name="probe_corrupt")
    assert third == good and len(compiles) == 2          # and is used from then on


def test_hit_does_not_compile(cache, fake_nvcc):
    compiles = fake_nvcc
    stub = probe_stub("hit", 5.0)
    a, _ = _build.compile_cubin(stub, ARCH, name="probe_hit")
    b, _ = _build.compile_cubin(stub, ARCH, name="probe_hit")
    assert a == b and len(compiles) == 1
    c, _ = _build.compile_cubin(stub, "sm_90a", name="probe_hit")      # another arch: another key
    assert len(compiles) == 2 and c != a


def test_failed_write_leaves_nothing(cache, fake_nvcc, monkeypatch):
    """A write that fails (disk full, everywhere) leaves no file, fails no call, and warns once: the kernel
    is kept in memory for the process."""
    def boom(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", boom)
    with pytest.warns(UserWarning, match="No space left on device.*kept in memory") as w:
        a, _ = _build.compile_cubin(probe_stub("nospace"), ARCH, name="probe_nospace")
        b, _ = _build.compile_cubin(probe_stub("nospace"), ARCH, name="probe_nospace")
        _build.compile_cubin(probe_stub("nospace2"), ARCH, name="probe_nospace2")
    assert len(w) == 1 and w[0].category.__name__ == "CacheWarning" and a == b and a[:4] == b"\x7fELF"
    assert fake_nvcc == ["probe_nospace", "probe_nospace2"]
    for d in (cache, cache.parent / "home", cache.parent / "tmp"):
        assert not [p for p in d.rglob("*") if p.is_file()], sorted(d.rglob("*"))


def test_compile_error_leaves_nothing(cache):
    with pytest.raises(_build.CompileError, match="probe_bad"):
        _build.compile_cubin('extern "C" __global__ void k() { this is not C++; }\n', ARCH, name="probe_bad")
    assert not _files(cache, "*.cubin") and not _files(cache, "*.tmp")


def test_stale_tmp_file_is_harmless(cache, fake_nvcc):
    compiles = fake_nvcc
    """A temporary file left by a killed writer neither breaks nor shadows the real entry."""
    stub = probe_stub("stale", 6.0)
    cubin, key = _build.compile_cubin(stub, ARCH, name="probe_stale")
    (cache / f"probe_stale-{key}.cubin.abc123.tmp").write_bytes(b"partial")
    again, _ = _build.compile_cubin(stub, ARCH, name="probe_stale")
    assert again == cubin and len(compiles) == 1


# ------------------------------------------------------------------------------------------------ degraded cache
def _block_writes(monkeypatch, *dirs):
    """Writes into ``dirs`` fail with EACCES, as in a directory this user cannot write (root ignores chmod,
    so permission bits cannot show it here): every call that creates, renames or removes a file there."""
    roots = [str(d) for d in dirs]

    def blocked(path):
        p = os.path.abspath(os.fspath(path))
        return any(p == r or p.startswith(r + os.sep) for r in roots)

    def deny(path):
        raise PermissionError(13, "Permission denied", os.fspath(path))

    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    for fn, check in [("open", lambda a, k: (a[1] if len(a) > 1 else k.get("flags", 0)) & writes),
                      ("replace", None), ("rename", None), ("unlink", None), ("mkdir", None)]:
        orig = getattr(os, fn)

        def wrapper(*a, _orig=orig, _check=check, **k):
            targets = a[:2] if fn in ("replace", "rename") else a[:1]
            if any(blocked(t) for t in targets) and (_check is None or _check(a, k)):
                deny(a[0])
            return _orig(*a, **k)
        monkeypatch.setattr(os, fn, wrapper)
    import builtins
    orig_open = builtins.open

    def open_(file, mode="r", *a, **k):
        if isinstance(file, (str, os.PathLike)) and set(mode) & set("wax+") and blocked(file):
            deny(file)
        return orig_open(file, mode, *a, **k)
    monkeypatch.setattr(builtins, "open", open_)


@pytest.mark.parametrize("blocked, lands", [(("cache",), "home/.cache/igemm"),
                                            (("cache", "home"), "tmp/igemm-cache-{uid}"),
                                            (("cache", "home", "tmp"), None)],
                         ids=["home_fallback", "tmp_fallback", "memory"])
@pytest.mark.parametrize("fresh", [True, False], ids=["new_process", "became_unwritable"])
def test_unwritable_cache_dir_degrades(blocked, lands, fresh, cache, fake_nvcc, monkeypatch, recwarn):
    """A cache directory that cannot be written: its entries still load, new kernels compile once into the
    first writable per-user fallback (or memory), with one warning; no call fails. Either so from the start
    (a new process) or from some moment on (a full disk, a remount)."""
    old, _ = _build.compile_cubin(probe_stub("ro_old", 7.0), ARCH, name="probe_ro_old")
    if fresh:
        monkeypatch.setattr(_build, "_dir_state", {}, raising=False)
    before = {p.name: p.read_bytes() for p in cache.iterdir()}
    root = cache.parent
    for sub in ("home", "tmp"):
        (root / sub).mkdir(exist_ok=True)
    _block_writes(monkeypatch, *[root / b for b in blocked])
    again, _ = _build.compile_cubin(probe_stub("ro_old", 7.0), ARCH, name="probe_ro_old")
    assert again == old and fake_nvcc == ["probe_ro_old"] and not recwarn.list, "a readable entry was not used"
    new, key = _build.compile_cubin(probe_stub("ro_new", 8.0), ARCH, name="probe_ro_new")
    assert fake_nvcc == ["probe_ro_old", "probe_ro_new"]
    assert _build.compile_cubin(probe_stub("ro_new", 8.0), ARCH, name="probe_ro_new")[0] == new
    _build.compile_cubin(probe_stub("ro_third", 9.0), ARCH, name="probe_ro_third")
    assert fake_nvcc == ["probe_ro_old", "probe_ro_new", "probe_ro_third"], "a new kernel was compiled twice"
    warned = [w for w in recwarn.list if issubclass(w.category, _build.CacheWarning)]
    assert len(warned) == 1 and str(cache) in str(warned[0].message), [str(w.message) for w in recwarn.list]
    assert {p.name: p.read_bytes() for p in cache.iterdir()} == before
    if lands is not None:
        d = root / lands.format(uid=os.geteuid() if hasattr(os, "geteuid") else "user")
        assert _build._read_cached(d / f"probe_ro_new-{key}.cubin") == new
        assert str(d) in str(warned[0].message)
        assert not _files(d, "*.tmp") and not _files(d, "*.lock")
    else:
        assert "memory" in str(warned[0].message)


_RO_WORKER = textwrap.dedent('''
    import hashlib, json, os, sys, time, warnings
    from igemm import _build
    tc = _build.find_toolchain()                     # everything read from root-only places is read as root
    _build.cutlass_version(), _build.csrc_hash()
    calls = []

    def fake(stub, arch, tc, flags, name):
        calls.append(name)
        return b"\\x7fELF" + hashlib.sha256((stub + arch).encode()).digest() * 40, "fake log"
    _build._compile_nvcc = fake
    if os.geteuid() == 0:                            # become a user who does not own the cache
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = {}
        for name, stub in json.loads(sys.argv[1]):
            out[name] = hashlib.sha256(_build.compile_cubin(stub, "%s", name=name)[0]).hexdigest()
        out[name + "/again"] = hashlib.sha256(_build.compile_cubin(stub, "%s", name=name)[0]).hexdigest()
    print("RESULT " + json.dumps({"out": out, "calls": calls, "uid": os.geteuid(),
                                  "warnings": [str(x.message) for x in w]}))
''' % (ARCH, ARCH))


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX permissions")
def test_read_only_cache_of_another_user(cache, fake_nvcc, monkeypatch):
    """A real read-only cache filled by another user (an image build): a worker process that is not its
    owner (root drops to nobody; permissions do not bind root) loads its kernels and compiles a new one into
    its own fallback, with one warning."""
    base = tempfile.mkdtemp(prefix="igemm-ro-", dir="/tmp")   # pytest's tmp_path is private to its owner
    try:
        os.chmod(base, 0o755)
        ro = os.path.join(base, "cache")
        monkeypatch.setenv("IGEMM_CACHE_DIR", ro)
        old = _sha(_build.compile_cubin(probe_stub("image", 1.5), ARCH, name="probe_image")[0])
        os.chmod(ro, 0o555)
        before = sorted(os.listdir(ro))
        home = os.path.join(base, "home")
        os.mkdir(home)
        if os.geteuid() == 0:
            os.chown(home, 65534, 65534)
        env = dict(os.environ, IGEMM_CACHE_DIR=ro, HOME=home, TMPDIR=home, IGEMM_COMPILER="nvcc",
                   PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
        jobs = [("probe_image", probe_stub("image", 1.5)), ("probe_user", probe_stub("user", 2.5))]
        r = subprocess.run([sys.executable, "-c", _RO_WORKER, json.dumps(jobs)], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        res = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))[7:])
        assert res["uid"] != 0
        assert res["out"]["probe_image"] == old, "the other user's kernel was not loaded"
        assert res["calls"] == ["probe_user"], res["calls"]
        assert len(res["warnings"]) == 1 and ro in res["warnings"][0], res["warnings"]
        assert res["out"]["probe_user/again"] == res["out"]["probe_user"]
        landed = list(os.scandir(os.path.join(home, ".cache", "igemm")))
        assert [e.name for e in landed if e.name.endswith(".cubin")], [e.name for e in landed]
        assert sorted(os.listdir(ro)) == before
    finally:
        if os.path.isdir(os.path.join(base, "cache")):
            os.chmod(os.path.join(base, "cache"), 0o755)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o644), (0o077, 0o600)],
                         ids=["umask022", "umask002", "umask077"])
def test_cubin_file_mode(umask, mode, cache, fake_nvcc):
    """Cubins are readable by every user (0644 less the umask), not mkstemp's 0600."""
    old = os.umask(umask)
    try:
        _, key = _build.compile_cubin(probe_stub(f"mode{umask}"), ARCH, name="probe_mode")
    finally:
        os.umask(old)
    assert (cache / f"probe_mode-{key}.cubin").stat().st_mode & 0o777 == mode


@pytest.mark.parametrize("where", ["file", "below_file"])
def test_cache_dir_is_a_file(where, tmp_path, monkeypatch, fake_nvcc):
    """IGEMM_CACHE_DIR naming a file (or a path below one) is one clear ValueError, before any compile."""
    f = tmp_path / "not_a_dir"
    f.write_text("x")
    monkeypatch.setenv("IGEMM_CACHE_DIR", str(f if where == "file" else f / "sub"))
    with pytest.raises(ValueError, match=r"IGEMM_CACHE_DIR=.* is not a directory \(.*not_a_dir is a file\)"):
        _build.compile_cubin(probe_stub("file"), ARCH, name="probe_file")
    with pytest.raises(ValueError, match="IGEMM_CACHE_DIR"):
        _build.cache_dir()
    assert fake_nvcc == [] and f.read_text() == "x"


def test_info_reports_a_file_cache_dir(tmp_path):
    """``python -m igemm info`` says so in one line and exits 1, without a traceback."""
    f = tmp_path / "not_a_dir"
    f.write_text("x")
    env = dict(os.environ, IGEMM_CACHE_DIR=str(f),
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
    r = subprocess.run([sys.executable, "-m", "igemm", "info"], env=env, cwd=str(tmp_path), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if "not a directory" in ln]
    assert lines == [f"kernel cache: error: IGEMM_CACHE_DIR={f} is not a directory ({f} is a file): "
                     "point IGEMM_CACHE_DIR at a directory"], r.stdout


def test_stale_files_are_swept(cache, fake_nvcc):
    """Temporary and lock files of killed processes (old) are removed on the next write; a live writer's
    (recent) are not, nor is anything else."""
    _build.cache_dir()
    old = time.time() - 2 * 3600
    names = {"k-1.cubin.123-ab.tmp": old, "autotune.x.tmp": old, "k-2.lock": old,
             "k-3.cubin.456-cd.tmp": None, "k-4.lock": None, "k-5.cubin": old, "k-5.log": old}
    for n, t in names.items():
        (cache / n).write_bytes(b"partial")
        if t is not None:
            os.utime(cache / n, (t, t))
    _build.compile_cubin(probe_stub("sweep"), ARCH, name="probe_sweep")
    left = set(_files(cache))
    assert not left & {"k-1.cubin.123-ab.tmp", "autotune.x.tmp", "k-2.lock"}, left
    assert {"k-3.cubin.456-cd.tmp", "k-4.lock", "k-5.cubin", "k-5.log"} <= left, left


# ------------------------------------------------------------------------------------------------ locks
@pytest.mark.parametrize("no_fcntl", [False, True], ids=["flock", "exclusive_file"])
def test_six_processes_compile_once(no_fcntl, tmp_path):
    """6 processes asking for one new kernel at the same moment compile it once; all get the same bytes."""
    shared = ("probe_six", probe_stub("six", 6.5))
    count = tmp_path / "compiles.txt"
    env = {"PROBE_FAKE_DELAY": "1.0", "PROBE_COUNT_FILE": str(count)}
    if no_fcntl:
        env["PROBE_NO_FCNTL"] = "1"
    res = _run_workers(tmp_path / "cache", [[shared]] * 6, tmp_path, env)
    assert count.read_text().split() == ["probe_six"], count.read_text()
    assert len({r["probe_six"][1] for r in res}) == 1
    assert not _files(tmp_path / "cache", "*.lock") and not _files(tmp_path / "cache", "*.tmp")


def test_lock_timeout_falls_back_to_compiling(cache, fake_nvcc, lock_kind, monkeypatch):
    """A caller that waits longer than the lock timeout for another's compile compiles the kernel itself."""
    monkeypatch.setattr(_build, "_LOCK_TIMEOUT_S", 0.5, raising=False)
    delays = iter([5.0, 0.0])
    inner = fake_nvcc.fake

    def slow_first(*a):
        inner.delay = next(delays)
        return inner(*a)
    monkeypatch.setattr(_build, "_compile_nvcc", slow_first)
    stub = probe_stub("timeout", 2.0)
    first = threading.Thread(target=_build.compile_cubin, args=(stub, ARCH), kwargs={"name": "probe_timeout"})
    first.start()
    t0 = time.monotonic()
    while not fake_nvcc and time.monotonic() - t0 < 30:
        time.sleep(0.01)
    t0 = time.monotonic()
    cubin, _ = _build.compile_cubin(stub, ARCH, name="probe_timeout")
    waited = time.monotonic() - t0
    first.join(30)
    assert fake_nvcc == ["probe_timeout"] * 2
    assert 0.45 <= waited < 4.0, f"waited {waited:.2f} s with a 0.5 s lock timeout beside a 5 s compile"
    assert cubin[:4] == b"\x7fELF"


_HOLDER = textwrap.dedent('''
    import os, sys, time
    from igemm import _build
    def hang(*a):
        print("compiling", flush=True)
        time.sleep(600)
    _build._compile_nvcc = hang
    _build.compile_cubin(sys.argv[1], "%s", name="probe_killed")
''' % ARCH)


@pytest.mark.skipif(os.name != "posix", reason="flock only: a lock file outlives its killed holder")
def test_killed_holder_does_not_block(cache, fake_nvcc, monkeypatch):
    """A process killed while compiling (holding the lock) does not make the next caller wait."""
    monkeypatch.setattr(_build, "_LOCK_TIMEOUT_S", 60.0, raising=False)
    stub = probe_stub("killed", 3.5)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, stub], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "compiling"
        assert _files(cache, "*.lock")
    finally:
        p.kill()
        p.wait()
    t0 = time.monotonic()
    _build.compile_cubin(stub, ARCH, name="probe_killed")
    assert time.monotonic() - t0 < 5 and fake_nvcc == ["probe_killed"]
    assert not _files(cache, "*.lock")


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_gpu_corrupted_kernel_is_rebuilt(tmp_path, monkeypatch):
    """A real kernel's cubin corrupted on disk: the next process-level load rebuilds it and computes right."""
    torch = pytest.importorskip("torch")
    import igemm
    from igemm import _runtime, reference, relu
    monkeypatch.setenv("IGEMM_CACHE_DIR", str(tmp_path))

    def fresh_process_state():
        _runtime._kernel_cache.clear()
        relu._launcher.cache_clear()
    fresh_process_state()
    try:
        y = torch.randn(12345, device="cuda")
        ref = reference.pack_mask(y.cpu().numpy() > 0)
        np.testing.assert_array_equal(igemm.relu_mask(y).cpu().numpy().view(np.uint32), ref)
        files = sorted(tmp_path.glob("relu_mask-*.cubin"))
        assert len(files) == 1
        blob = files[0].read_bytes()
        files[0].write_bytes(blob[: len(blob) // 3])
        fresh_process_state()
        np.testing.assert_array_equal(igemm.relu_mask(y).cpu().numpy().view(np.uint32), ref)
        assert _build._read_cached(files[0]) is not None
    finally:
        fresh_process_state()          # later tests reload their kernels from the real cache
