"""The C launch step (csrc/host/launch.c, igemm/_hostlaunch.py) on the CPU: built with the host compiler and
driven with a recording stand-in for cuLaunchKernel, it binds and launches a conv launch record exactly as
the cuda.bindings path does -- each launch's function, grid, block, shared memory, stream and kernelParams,
and every argument buffer as it was when the launch was made. On the GPU the whole suite runs through it.
"""
from __future__ import annotations

import ctypes
import shutil
import sysconfig
import types
from pathlib import Path

import numpy as np
import pytest

from igemm import _hostlaunch, _kernel
from igemm.conv import _launch, _transpose
from igemm.conv._spec import CONV_PARAMS

pytestmark = pytest.mark.skipif(
    (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")) is None
    or not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file(), reason="no C compiler or Python.h")

_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *([ctypes.c_uint] * 7), ctypes.c_void_p,
                           ctypes.c_void_p, ctypes.c_void_p)
_CTX = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))
_RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_WAIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)


@pytest.fixture(scope="module")
def hl(tmp_path_factory):
    return _hostlaunch.load(_hostlaunch.build(tmp_path_factory.mktemp("hl")))


class Driver:
    """cuLaunchKernel, cuCtxGetCurrent, cuEventRecord and cuStreamWaitEvent stand-ins: each launch recorded with a
    copy of the watched buffers at that moment (the C module gets their addresses; the Python path's fake
    launchers report the same), each event record and wait as ("record", event, stream) / ("wait", stream, event)."""

    def __init__(self, hl, bufs, fail_at=-1, code=700):
        self.calls, self.bufs, self.fail_at, self.code = [], bufs, fail_at, code
        self.cb, self.ctx = _LAUNCH(self._launch), _CTX(self._ctx)    # (kept alive: C holds their addresses)
        self.rec = _RECORD(lambda e, st: self.record(("record", e, st or 0)))
        self.wait = _WAIT(lambda st, e, flags: self.record(("wait", st or 0, e)))
        hl.set_driver(*(ctypes.cast(f, ctypes.c_void_p).value for f in (self.cb, self.ctx, self.rec, self.wait)))

    def _launch(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        return self.record((f, gx, gy, gz, bx, by, bz, smem, stream or 0, params))

    def record(self, call) -> int:
        self.calls.append((call, [b.copy() for b in self.bufs]))
        return self.code if len(self.calls) - 1 == self.fail_at else 0

    def _ctx(self, out):
        out[0] = 0x5EED
        return 0


class FakeLauncher:
    """A Launcher's attributes (function, grid, block, shared memory) with the Python path's launch recorded."""

    def __init__(self, fn, grid, block, smem, driver=None):
        self._fn, self.grid, self.block, self.smem, self.driver = fn, grid, block, smem, driver

    def launch_current(self, stream, args):
        err = self.driver.record((self._fn, *self.grid, *self.block, self.smem, stream, args.address))
        if err:
            raise _kernel.launch_error(err)

    def make_current(self):
        pass


class FakeMaps:
    """Tensor maps whose address words are x + 40 and w + 24 (the patch the record then binds per call)."""

    def __init__(self, slot_a, slot_b):
        self.sa, self.sb, self.patch = slot_a, slot_b, None

    def write(self, u64, x, w, full):
        u64[self.sa + 1], u64[self.sb + 1] = x + 40, w + 24
        u64[self.sa + 9] = 0xAB                          # a word no call changes
        self.patch = (self.sa + 1, 40, self.sb + 1, 24)


class FakeUnfold:
    def __init__(self, launcher):
        self.launcher = launcher
        self.args = _kernel.pack_args([_kernel.ParamSpec("src0", "ptr"), _kernel.ParamSpec("src1", "ptr")], {})

    def steps(self, x, w, codes=(_kernel.SRC_X, _kernel.SRC_W)):
        return [_kernel.Step(self.launcher, self.args, ((0, codes[0], 0), (1, codes[1], 0)))]


def _records(kind, monkeypatch, driver):
    """A LaunchRecord of each preparation kind, every launcher a fake, and the buffers a launch may write."""
    args = _kernel.pack_args(CONV_PARAMS, {"N": 2, "K": 64})
    conv = FakeLauncher(0x1111, (3, 4, 5), (384, 1, 1), 200704, driver)
    maps = FakeMaps(args.slots["tmA"], args.slots["tmB"])
    prep, cx, cw, bufs = None, 0, 0, [args.data]
    if kind == "transpose":
        monkeypatch.setattr(_transpose, "_launcher",
                            lambda e, m0, m1, dev, blocks: FakeLauncher(0x2000 + 16 * m0 + m1, (blocks, 1, 1),
                                                                        (256, 1, 1), 0, driver))
        prep = _transpose.Prepared(0, _transpose.TransposeJob(2, 64, 196, 2), 0x70000,
                                   _transpose.TransposeJob(64, 64, 9, 2), 0x80000)
        cx, cw = 0x70000, 0x80000
    elif kind == "two":
        monkeypatch.setattr(_transpose, "_launcher",
                            lambda e, m0, m1, dev, blocks: FakeLauncher(0x3000 + 16 * m0 + m1, (blocks, 1, 1),
                                                                        (256, 1, 1), 0, driver))
        unf = FakeUnfold(FakeLauncher(0x4444, (9, 1, 1), (128, 1, 1), 16, driver))
        prep = _launch.TwoPreps(_transpose.Prepared(0, _transpose.TransposeJob(2, 3, 5000, 2), 0x70000), unf)
        cx, cw = 0x70000, 0x90000
        bufs.append(unf.args.data)
    spec = types.SimpleNamespace(bn_stats=kind == "stats")     # (a conv with BN statistics: the mask pointer to ws)
    rec = _launch.LaunchRecord(spec, conv, args, maps, None, prep, cx, cw, False, 1000, "float16", 0)
    return rec, bufs


class Folded:
    scale, shift, alpha, alpha_scalar = 0xA100, 0xA200, 0, np.float32(0.25)


@pytest.mark.parametrize("kind", ["plain", "transpose", "two", "stats"])
def test_c_and_python_bind_and_launch_alike(hl, monkeypatch, kind):
    """The same calls (several alignments, each record reused) through the C module and through cuda.bindings'
    path: the same launches in the same order, with the same buffers at each launch."""
    seen, recs = {}, {}
    calls = [(0x10000, 0x20000), (0x10008, 0x20002), (0x30000, 0x40000), (0x10008, 0x20002)]
    for path in ("c", "python"):
        driver = Driver(hl, [])
        rec, bufs = _records(kind, monkeypatch, driver)
        driver.bufs = bufs
        for x, w in calls:
            if path == "c":
                monkeypatch.setattr(_hostlaunch, "MOD", hl)
                rec.launch(0x77, x, w, 0x50000 + x, 0x60000, 0x1230, Folded, checked=False)
            else:
                monkeypatch.setattr(_hostlaunch, "MOD", None)
                rec.launch(0x77, x, w, 0x50000 + x, 0x60000, 0x1230, Folded, checked=True)
        seen[path], recs[path] = driver.calls, rec
    c, py = seen["c"], seen["python"]
    # (kernelParams differ: each path built its own record; each is that record's own pointer array)
    assert [k[:-1] for k, _ in c] == [k[:-1] for k, _ in py]
    n_steps = {"plain": 1, "transpose": 2, "two": 3, "stats": 1}[kind]
    for path, calls_ in seen.items():
        assert [k[-1] for k, _ in calls_[n_steps - 1::n_steps]] == [recs[path].args.address] * len(calls)
    for (k, bc), (_, bp) in zip(c, py):
        for a, b in zip(bc, bp):
            assert np.array_equal(a, b), k
    assert len(c) == n_steps * len(calls)
    # what the conv step saw on the first call: its pointers, the folded vectors, the maps' address words
    sl, last = recs["c"].args.slots, c[n_steps - 1][1][0]
    x, w = calls[0]
    xe, we = {"plain": (x, w), "transpose": (0x70000, 0x80000), "two": (0x70000, 0x90000), "stats": (x, w)}[kind]
    mask, ws = (0, 0x1230) if kind == "stats" else (0x1230, 0)
    assert (last[sl["x"]], last[sl["w"]], last[sl["y"]], last[sl["residual"]], last[sl["mask"]], last[sl["ws"]]) == \
        (xe, we, 0x50000 + x, 0x60000, mask, ws)
    assert (last[sl["scale"]], last[sl["shift"]], last[sl["alpha"]]) == (0xA100, 0xA200, 0)
    assert last.view(np.float32)[2 * sl["alpha_scalar"]] == np.float32(0.25)
    assert (last[sl["tmA"] + 1], last[sl["tmB"] + 1], last[sl["tmA"] + 9]) == (xe + 40, we + 24, 0xAB)
    if kind == "two":   # the transpose reads x (nothing for its second source), the unfold w only
        unf_buf = c[1][1][1]
        assert (unf_buf[0], unf_buf[1]) == (0, w)


def test_a_failed_launch_raises_and_stops(hl, monkeypatch):
    """A failing cuLaunchKernel: the later steps are not launched and the call raises with the CUresult."""
    driver = Driver(hl, [], fail_at=0, code=98)
    rec, driver.bufs = _records("transpose", monkeypatch, driver)
    monkeypatch.setattr(_hostlaunch, "MOD", hl)
    with pytest.raises(RuntimeError, match="launch failed"):
        rec.launch(0x77, 0x10000, 0x20000, 0x30000, 0, 0, Folded)
    assert len(driver.calls) == 1


@pytest.mark.parametrize("bad", ["empty", "steps", "binds", "source", "short", "long"])
def test_a_malformed_record_writes_nothing(hl, bad):
    buf = np.full(8, 0xDEAD, dtype=np.uint64)
    driver = Driver(hl, [buf])
    head = [0x1111, 0xAAA0, int(buf.ctypes.data), 1, 1, 1, 32, 1, 1, 0]
    good = [1, *head, 2, 0, 1, 0, 1, 2, 5]
    f = {"empty": [], "steps": [0], "binds": [1, *head, 17] + [0, 1, 0] * 17, "source": [1, *head, 1, 0, 6, 0],
         "short": good[:-1], "long": good + [0]}[bad]
    rec = np.asarray(f, dtype=np.int64).tobytes()
    with pytest.raises(ValueError, match="malformed"):
        hl.launch(rec, 0, 1, 2, 3, 4, 5)
    assert (buf == 0xDEAD).all() and driver.calls == []
    assert hl.launch(np.asarray(good, dtype=np.int64).tobytes(), 9, 0x100, 0x200, 0, 0, 0) == 0
    assert buf[0] == 0x100 and buf[1] == 0x205 and driver.calls[0][0] == (0x1111, 1, 1, 1, 32, 1, 1, 0, 9, 0xAAA0)


def test_a_program_binds_its_values_and_launches_every_step(hl):
    """program(): more steps than a plan's record may hold, each bind from the values tuple (source i: vals[i]),
    launched in order; a bind naming a source past the tuple is malformed (nothing written or launched)."""
    bufs = [np.full(4, 0xDEAD, dtype=np.uint64) for _ in range(6)]
    driver = Driver(hl, bufs)
    f = [6]
    for i, b in enumerate(bufs):             # step i: slot 0 <- vals[i % 5] + i, slot 3 <- the constant 0x99
        f += [0x1000 + i, 0xA000 + i, int(b.ctypes.data), i + 1, 1, 1, 128, 1, 1, 0, 2, 0, i % 5, i, 3, 0, 0x99]
    vals = (0, 0x10000, 0x20000, 0x30000, 0x40000)
    assert hl.program(np.asarray(f, dtype=np.int64).tobytes(), 7, vals) == 0
    assert [c[0] for c, _ in driver.calls] == [0x1000 + i for i in range(6)]
    for i, (call, seen) in enumerate(driver.calls):
        assert call == (0x1000 + i, i + 1, 1, 1, 128, 1, 1, 0, 7, 0xA000 + i)
        assert seen[i][0] == vals[i % 5] + i and seen[i][3] == 0x99
    bad = list(f)
    bad[-5] = 5                                # the last step's first bind: source 5 of a 5-value tuple
    for b in bufs:
        b[:] = 0xDEAD
    driver.calls.clear()
    with pytest.raises(ValueError, match="malformed"):
        hl.program(np.asarray(bad, dtype=np.int64).tobytes(), 7, vals)
    assert driver.calls == [] and all((b == 0xDEAD).all() for b in bufs)
    with pytest.raises(TypeError):
        hl.program(np.asarray(f, dtype=np.int64).tobytes(), 7, tuple(range(65)))


def test_a_program_runs_a_branch_on_a_second_stream(hl):
    """Stream steps (function 0): FORK records the event on the call's stream and makes the second stream wait for
    it, the next launches go there; MAIN brings them back; JOIN records the other event on the second stream and
    makes the call's stream wait. A stream step with binds or an unknown operation is malformed (nothing
    launched), and without the record and wait entry points a program with one raises."""
    bufs = [np.zeros(2, dtype=np.uint64)]
    driver = Driver(hl, bufs)
    b = int(bufs[0].ctypes.data)
    launch = lambda fn: [fn, 0xA0, b, 1, 1, 1, 32, 1, 1, 0, 0]                      # noqa: E731
    sync = lambda op, ev: [0, 0, 0, op, ev, 0x5D, 0, 0, 0, 0, 0]                     # noqa: E731
    f = [7, *sync(1, 0xE1), *launch(0x10), *sync(2, 0), *launch(0x11), *launch(0x12), *sync(3, 0xE2), *launch(0x13)]
    assert hl.program(np.asarray(f, dtype=np.int64).tobytes(), 0x77, (0,)) == 0
    got = [c if c[0] in ("record", "wait") else (c[0], c[8]) for c, _ in driver.calls]
    assert got == [("record", 0xE1, 0x77), ("wait", 0x5D, 0xE1), (0x10, 0x5D), (0x11, 0x77), (0x12, 0x77),
                   ("record", 0xE2, 0x5D), ("wait", 0x77, 0xE2), (0x13, 0x77)]
    for bad in ([1, *sync(4, 0xE1)], [1, 0, 0, 0, 1, 0xE1, 0x5D, 0, 0, 0, 0, 1, 0, 0, 0]):
        driver.calls.clear()
        with pytest.raises(ValueError, match="malformed"):
            hl.program(np.asarray(bad, dtype=np.int64).tobytes(), 0x77, (0,))
        assert driver.calls == []
    hl.set_driver(ctypes.cast(driver.cb, ctypes.c_void_p).value, ctypes.cast(driver.ctx, ctypes.c_void_p).value)
    with pytest.raises(RuntimeError, match="cuEventRecord"):
        hl.program(np.asarray(f, dtype=np.int64).tobytes(), 0x77, (0,))
    assert driver.calls == []


def test_raw_coop_and_ctx(hl):
    """raw and coop launch with their arguments as given (coop through the stand-in's launch: it has no cooperative
    entry point), and a malformed call raises."""
    driver = Driver(hl, [])
    assert hl.raw(0x1111, 2, 3, 4, 5, 6, 7, 8, 9, 0xAAA0) == 0
    assert hl.coop(0x2222, 3, 1, 1, 256, 1, 1, 0, 7, 0xBBB0) == 0
    assert [c for c, _ in driver.calls] == [(0x1111, 2, 3, 4, 5, 6, 7, 8, 9, 0xAAA0), (0x2222, 3, 1, 1, 256, 1, 1, 0, 7,
                                                                                       0xBBB0)]
    assert hl.ctx() == 0x5EED
    for f in (hl.raw, hl.coop):
        with pytest.raises(TypeError):
            f(1, 2, 3)
