"""The C fast launch (csrc/fastlaunch.c, igemm/_fastlaunch.py), on the CPU: built with the host compiler and
driven with a recording stand-in for cuLaunchKernel -- each launch's function, grid, block, shared memory,
stream and kernelParams, and the argument buffers' slots as they were when the launch was made. (On the GPU,
tests/test_conv.py::test_gpu_lean_launch runs plans through it against the Python launch.)"""
from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest

from igemm import _fastlaunch

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler")

_PROTO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *([ctypes.c_uint] * 7), ctypes.c_void_p,
                          ctypes.c_void_p, ctypes.c_void_p)


@pytest.fixture(scope="module")
def fl(tmp_path_factory):
    return _fastlaunch._load(_fastlaunch.build(tmp_path_factory.mktemp("fl")))


class Recorder:
    """A cuLaunchKernel stand-in: records each call, with a copy of the watched buffers at that moment."""

    def __init__(self, fl, bufs, fail_at=-1, code=700):
        self.calls, self.bufs, self.fail_at, self.code = [], bufs, fail_at, code
        self.cb = _PROTO(self._call)                  # (kept alive: the module holds only its address)
        fl.set_launch(ctypes.cast(self.cb, ctypes.c_void_p).value)

    def _call(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self.calls.append(((f, gx, gy, gz, bx, by, bz, smem, stream or 0, params, extra),
                           [b.copy() for b in self.bufs]))
        return self.code if len(self.calls) - 1 == self.fail_at else 0


def _buf(n):
    b = np.full(n, 0xDEAD, dtype=np.uint64)
    return b, int(b.ctypes.data)


def test_launch_writes_slots_then_launches(fl):
    main, pm = _buf(12)
    p1, pp1 = _buf(4)
    p2, pp2 = _buf(4)
    rec = _fastlaunch.pack(0x1111, 0xAAA0, pm, (3, 4, 5), (128, 1, 1), 4096, (0, 1, 2, 3, 4), maps=(6, 100, 8, 200),
                           copies=(0x7000, -1),
                           preps=[(0x2222, 0xBBB0, pp1, (7, 1, 1), (256, 1, 1), 0, 0, 1, 1, 0),
                                  (0x3333, 0xCCC0, pp2, (9, 2, 1), (64, 2, 1), 16, 2, 3, 0, 2)])
    r = Recorder(fl, [main, p1, p2])
    x, w, y, res, m = 0x10000, 0x20000, 0x30000, 0x40000, 0x50000
    assert fl.launch(rec, 0x77, x, w, y, res, m) == 0
    assert [c[0] for c in r.calls] == [
        (0x2222, 7, 1, 1, 256, 1, 1, 0, 0x77, 0xBBB0, None),
        (0x3333, 9, 2, 1, 64, 2, 1, 16, 0x77, 0xCCC0, None),
        (0x1111, 3, 4, 5, 128, 1, 1, 4096, 0x77, 0xAAA0, None)]
    # the first preparation's slots (0: x, 1: 0) were set when it launched; the second's (2: 0, 3: w)
    assert list(r.calls[0][1][1][:2]) == [x, 0]
    assert list(r.calls[1][1][2][2:4]) == [0, w]
    # the conv reads the copy of x (0x7000) and the caller's w; maps' address words = offset + pointer
    want = [0x7000, w, y, res, m, 0xDEAD, 100 + 0x7000, 0xDEAD, 200 + w, 0xDEAD, 0xDEAD, 0xDEAD]
    assert list(r.calls[2][1][0]) == want
    assert list(main) == want


def test_launch_without_maps_or_preps(fl):
    main, pm = _buf(6)
    rec = _fastlaunch.pack(0x1, 0x2, pm, (1, 1, 1), (32, 1, 1), 0, (4, 3, 2, 1, 0))
    r = Recorder(fl, [main])
    assert fl.launch(rec, 0, 11, 22, 33, 0, 0) == 0
    assert len(r.calls) == 1 and list(main) == [0, 0, 33, 22, 11, 0xDEAD]


def test_launch_reports_the_drivers_error(fl):
    main, pm = _buf(6)
    p1, pp1 = _buf(2)
    rec = _fastlaunch.pack(0x1, 0x2, pm, (1, 1, 1), (32, 1, 1), 0, (0, 1, 2, 3, 4),
                           preps=[(0x9, 0x8, pp1, (1, 1, 1), (32, 1, 1), 0, 0, 1, 1, 2)])
    r = Recorder(fl, [main], fail_at=0, code=719)
    assert fl.launch(rec, 0, 1, 2, 3, 4, 5) == 719          # the preparation failed: the conv is not launched
    assert len(r.calls) == 1 and list(main) == [0xDEAD] * 6
    from igemm import _kernel
    assert "kernel launch failed" in str(_kernel.launch_error(719))


def test_raw(fl):
    r = Recorder(fl, [])
    assert fl.raw(0x5, 1, 2, 3, 4, 5, 6, 7, 0x99, 0x1234) == 0
    assert r.calls[0][0] == (0x5, 1, 2, 3, 4, 5, 6, 7, 0x99, 0x1234, None)


def test_bad_records_raise(fl):
    Recorder(fl, [])
    main, pm = _buf(6)
    good = _fastlaunch.pack(0x1, 0x2, pm, (1, 1, 1), (32, 1, 1), 0, (0, 1, 2, 3, 4))
    for bad in (good[:-8], good + b"\0" * 8, b"", good[:-8] + (3).to_bytes(8, "little")):
        with pytest.raises(ValueError, match="malformed"):
            fl.launch(bad, 0, 1, 2, 3, 4, 5)
    with pytest.raises(TypeError):
        fl.launch(bytearray(good), 0, 1, 2, 3, 4, 5)
    with pytest.raises(TypeError):
        fl.launch(good, 0, 1, 2, 3, 4)
    with pytest.raises(OverflowError):
        fl.launch(good, 0, -1, 2, 3, 4, 5)
    with pytest.raises(ValueError):
        _fastlaunch.pack(0x1, 0x2, pm, (1, 1, 1), (32, 1, 1), 0, (0, 1, 2, 3, 4), preps=[()] * 3)
    assert list(main) == [0xDEAD] * 6


def test_build_is_cached(tmp_path):
    p1 = _fastlaunch.build(tmp_path)
    t = p1.stat().st_mtime_ns
    assert _fastlaunch.build(tmp_path) == p1 and p1.stat().st_mtime_ns == t
    assert not [f for f in tmp_path.iterdir() if f.name.endswith(".tmp.so")]


def test_off_switch(monkeypatch):
    monkeypatch.setattr(_fastlaunch, "_state", {})
    monkeypatch.setenv("IGEMM_FAST_LAUNCH", "0")
    assert _fastlaunch.get() is None and "IGEMM_FAST_LAUNCH=0" in _fastlaunch.status()


def test_no_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises((RuntimeError, OSError)):
        _fastlaunch.build(tmp_path)
