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


# ---- conv(st, x, w, out, residual, mask_out): a plan call's checks in C, with stand-in tensors ----------------
class FakeTensor:
    """What conv() reads of a torch tensor: dtype, get_device(), shape, is_contiguous(), data_ptr()."""

    def __init__(self, shape, dtype="f16", ptr=0x10000, dev=0, contig=True, raises=False):
        self.shape, self.dtype, self.ptr, self.dev, self.contig, self.raises = tuple(shape), dtype, ptr, dev, contig, raises

    def get_device(self):
        if self.raises:
            raise RuntimeError("accessor failed")
        return self.dev

    def is_contiguous(self):
        return self.contig

    def data_ptr(self):
        return self.ptr



class FakeParameter(FakeTensor):
    """(torch.nn.Parameter's stand-in: w may be one)"""


class OtherSubclass(FakeTensor):
    """(any other subclass is declined: it may override what the accessors mean)"""


_CTX = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))


class Conv:
    """A plan's state tuple for conv(), its buffer and record, a recording launch and a stand-in context."""
    XS, WS, YS = (2, 4, 4, 8), (8, 3, 3, 8), (2, 4, 4, 8)

    def __init__(self, fl, mask=True, add=None, ctx=0xC0):
        self.buf, pm = _buf(8)
        self.rec = _fastlaunch.pack(0x1, 0xA0, pm, (2, 1, 1), (128, 1, 1), 0, (0, 1, 2, 3, 4))
        self.armed = bytearray(b"\x01")
        self.allocs = []
        self.bad_alloc = False
        self.cur = ctx
        self.ctx_cb = _CTX(self._ctx)
        fl.set_ctx_get(ctypes.cast(self.ctx_cb, ctypes.c_void_p).value)
        self.rt = Recorder(fl, [self.buf])
        self.fl = fl
        nb = 2 * int(np.prod(self.YS))
        self.st = (FakeTensor, "f16", "f16", "i32", 0, self.XS, self.WS, self.YS, 2 * int(np.prod(self.XS)),
                   2 * int(np.prod(self.WS)), nb, nb if add is not None else 0, 8 if mask else 0,
                   None, FakeTensor((8,), "i32", 0) if mask else None,
                   lambda dev: 0x5EED, self.armed, self.rec, 0xC0, add, FakeParameter, self._empty_like)

    def _ctx(self, out):
        out[0] = self.cur
        return 0

    def _empty_like(self, t):
        """(torch.empty_like's stand-in: a contiguous tensor of t's shape and dtype)"""
        out = FakeTensor(t.shape, t.dtype, 0xA0000 if t.dtype == "i32" else 0x90000, contig=not self.bad_alloc)
        self.allocs.append(out)
        return out

    def __call__(self, x, w, out=None, residual=None, mask_out=None):
        return self.fl.conv(self.st, x, w, out, residual, mask_out)


def test_conv_launches_with_the_calls_pointers(fl):
    c = Conv(fl)
    x, w = FakeTensor(Conv.XS, ptr=0x1000), FakeTensor(Conv.WS, ptr=0x3000)
    y, m = c(x, w)
    assert (y.ptr, m.ptr) == (0x90000, 0xA0000) and len(c.rt.calls) == 1
    assert c.rt.calls[0][0][8] == 0x5EED                         # the current stream
    assert list(c.buf[:5]) == [0x1000, 0x3000, 0x90000, 0, 0xA0000]
    out, mo = FakeTensor(Conv.YS, ptr=0x40000), FakeTensor((9,), "i32", ptr=0x50000)
    r = c(x, w, out=out, mask_out=mo)
    assert r[0] is out and r[1] is mo and list(c.buf[:5]) == [0x1000, 0x3000, 0x40000, 0, 0x50000]
    c(x, FakeParameter(Conv.WS, ptr=0x6000))
    assert len(c.rt.calls) == 3 and c.buf[1] == 0x6000


def test_conv_residual_the_callers_or_the_plans(fl):
    class Add:
        residual = FakeTensor(Conv.YS, ptr=0x70000)
    c = Conv(fl, mask=False, add=Add())
    x, w = FakeTensor(Conv.XS, ptr=0x1000), FakeTensor(Conv.WS, ptr=0x3000)
    y = c(x, w)
    assert isinstance(y, FakeTensor) and c.buf[3] == 0x70000
    c(x, w, residual=FakeTensor(Conv.YS, ptr=0x80000))
    assert c.buf[3] == 0x80000 and len(c.rt.calls) == 2
    Add.residual = None                                          # no residual anywhere: the Python path raises
    assert c(x, w) is None and len(c.rt.calls) == 2


def test_conv_declines_without_launching(fl):
    """Every mismatch returns None (the Python path then raises or handles it) and launches nothing."""
    c = Conv(fl)
    X = lambda **k: FakeTensor(Conv.XS, **{"ptr": 0x1000, **k})
    W = lambda **k: FakeTensor(Conv.WS, **{"ptr": 0x3000, **k})
    Y = lambda **k: FakeTensor(Conv.YS, **{"ptr": 0x40000, **k})
    M = lambda n=8, **k: FakeTensor((n,), **{"dtype": "i32", "ptr": 0x50000, **k})
    cases = {
        "x dtype": dict(x=X(dtype="f32")), "w device": dict(w=W(dev=1)), "x shape": dict(x=FakeTensor((2, 4, 4, 9))),
        "x rank": dict(x=FakeTensor((2, 4, 4))), "w not contiguous": dict(w=W(contig=False)),
        "x misaligned": dict(x=X(ptr=0x1008)), "x accessor raises": dict(x=X(raises=True)),
        "x not a tensor": dict(x=object()), "x a Parameter": dict(x=FakeParameter(Conv.XS, ptr=0x1000)),
        "w another subclass": dict(w=OtherSubclass(Conv.WS, ptr=0x3000)), "out shape": dict(out=FakeTensor((2, 4, 4, 7))),
        "out misaligned": dict(out=Y(ptr=0x40008)), "out overlaps x": dict(out=Y(ptr=0x1000 + 64)),
        "out dtype": dict(out=Y(dtype="f32")), "mask too short": dict(out=Y(), mask_out=M(7)),
        "mask 2-D": dict(out=Y(), mask_out=FakeTensor((8, 1), "i32", 0x50000)),
        "mask dtype": dict(out=Y(), mask_out=M(dtype="f16")), "mask overlaps y": dict(out=Y(), mask_out=M(ptr=0x40000)),
        "residual without Add": dict(residual=Y(ptr=0x60000)),
    }
    for name, kw in cases.items():
        args = dict(x=X(), w=W(), out=None, residual=None, mask_out=None)
        args.update(kw)
        assert c(**args) is None, name
    c.armed[0] = 0
    assert c(X(), W()) is None, "disarmed"
    c.armed[0] = 1
    c.cur = 0xC1
    assert c(X(), W()) is None, "another context current"
    assert not c.rt.calls and list(c.buf) == [0xDEAD] * 8
    c.cur = 0xC0
    assert c(X(), W()) is not None and len(c.rt.calls) == 1


def test_conv_no_mask_plan(fl):
    c = Conv(fl, mask=False)
    x, w = FakeTensor(Conv.XS, ptr=0x1000), FakeTensor(Conv.WS, ptr=0x3000)
    assert c(x, w, mask_out=FakeTensor((8,), "i32", 0x50000)) is None
    y = c(x, w)
    assert isinstance(y, FakeTensor) and c.buf[4] == 0 and c.allocs == [y]     # (the empty_like stand-in)


def test_conv_allocates_from_templates(fl):
    """y is empty_like(x) where y has x's shape, else empty_like(y's template); the mask, empty_like(its
    template); an allocation that is not contiguous is declined (the Python path allocates)."""
    c = Conv(fl, mask=True)
    x, w = FakeTensor(Conv.XS, ptr=0x1000), FakeTensor(Conv.WS, ptr=0x3000)
    y, m = c(x, w)
    assert y.shape == Conv.XS and m.shape == (8,) and c.allocs == [y, m] and list(c.buf[:5]) == [
        0x1000, 0x3000, 0x90000, 0, 0xA0000]
    tpl = FakeTensor((2, 4, 4, 16), "f16", 0)
    c.st = c.st[:13] + (tpl,) + c.st[14:]
    y, m = c(x, w)
    assert y.shape == (2, 4, 4, 16)
    c.bad_alloc = True
    assert c(x, w) is None and len(c.rt.calls) == 2


def test_conv_reports_a_failed_launch(fl):
    c = Conv(fl)
    c.rt.fail_at, c.rt.code = 0, 700
    with pytest.raises(RuntimeError, match="kernel launch failed: CUresult 700"):
        c(FakeTensor(Conv.XS, ptr=0x1000), FakeTensor(Conv.WS, ptr=0x3000))
