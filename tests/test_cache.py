"""The on-disk kernel cache under concurrency and corruption (issue 8).

* 4 processes compiling the same and different kernels into one empty cache at once: no corruption, each
  gets a correct cubin, every file verifies, no temporary file is left; a second round only reads.
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
    d = tmp_path / "cache"
    monkeypatch.setenv("IGEMM_CACHE_DIR", str(d))
    monkeypatch.delenv("IGEMM_DEBUG", raising=False)
    return d


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
    """4 processes compile one shared kernel and one of their own into the same empty cache at once."""
    cache_dir = tmp_path / "cache"
    shared = ("probe_shared", probe_stub("shared", 2.0))
    jobs = [[shared, (f"probe_own{i}", probe_stub(f"own{i}", float(i)))] for i in range(4)]
    # half of them do their own kernel first, so compiles of different keys overlap too
    jobs = [j if i % 2 == 0 else j[::-1] for i, j in enumerate(jobs)]
    res = _run_workers(cache_dir, jobs, tmp_path)
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


def test_threads_one_empty_cache(cache, fake_nvcc):
    """Threads of one process (what norm.compile_stubs does) into one empty cache."""
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
    _check_cache_dir(cache, {n: next(iter(v)) for n, v in out.items()})


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


def test_failed_write_leaves_nothing(cache, monkeypatch):
    def boom(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="No space"):
        _build.compile_cubin(probe_stub("nospace"), ARCH, name="probe_nospace")
    assert not _files(cache, "*.tmp") and not _files(cache, "*.cubin")


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
