"""One definition of each kernel family's launch parameters, the stub rendered from it, and launching.

Kernels take flat scalar parameters (no struct by value). A family declares its parameters once, as
a list of :class:`ParamSpec`; :func:`render_kernel` generates from that list the C++ ``struct Params``,
the ``extern "C" __global__`` signature and the initialiser that rebuilds the struct on the device, and
:func:`pack_args` packs the values in the same order into a :class:`PackedArgs` buffer, which
:class:`Launcher` hands to ``cuLaunchKernel``. The family's header only sees ``Params``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import _hostlaunch, _runtime
from .fastdiv import magic

__all__ = ["ParamSpec", "PackedArgs", "render_kernel", "pack_args", "Launcher", "load", "resident_blocks"]


@dataclass(frozen=True)
class ParamSpec:
    """One launch parameter: ``ctype`` is ``ptr`` (a Python int), ``fastdiv`` (a divisor, passed as
    ``int32 d, uint32 mul, uint32 shr`` and rebuilt as ``igemm::FastDiv``), ``int32``, ``uint32``,
    ``int64``, ``float32``, ``tmap`` (a 128-byte TMA tensor map, ``CUtensorMap``'s bytes, passed as a
    ``__grid_constant__`` parameter; the kernel sees its address as ``const void*``) or ``blob`` (128 bytes of
    launch values passed the same way: a struct the kernel reads through that address)."""
    name: str
    ctype: str


_NP = {"int32": np.int32, "uint32": np.uint32, "int64": np.int64, "float32": np.float32}
_C = {"int32": "int32_t", "uint32": "uint32_t", "int64": "int64_t", "float32": "float"}


def render_kernel(*, include: str, entry: str, params: list[ParamSpec], body: str, threads: int,
                  min_blocks: int | None = None, prelude: str = "", cluster: int = 1) -> str:
    """The whole generated stub: include, Params struct, kernel signature and a one-line body.
    ``cluster`` > 1: compile-time cluster dimensions (cluster, 1, 1) -- a plain launch then runs the grid
    in clusters (its x extent must be a multiple)."""
    fields, sig, init = [], [], []
    tmap_type = ""
    for p in params:
        if p.ctype in ("tmap", "blob"):
            tmap_type = "struct alignas(64) IgemmTensorMap { unsigned long long bytes[16]; };\n"
            fields.append(f"  const void* {p.name};")
            sig.append(f"const __grid_constant__ IgemmTensorMap {p.name}")
            init.append(f"&{p.name}")
        elif p.ctype == "ptr":
            fields.append(f"  const void* {p.name};")
            sig.append(f"const void* {p.name}")
            init.append(p.name)
        elif p.ctype == "fastdiv":
            fields.append(f"  igemm::FastDiv {p.name};")
            sig += [f"int32_t {p.name}_d", f"uint32_t {p.name}_m", f"uint32_t {p.name}_s"]
            init.append(f"igemm::FastDiv{{{p.name}_d, {p.name}_m, {p.name}_s}}")
        else:
            fields.append(f"  {_C[p.ctype]} {p.name};")
            sig.append(f"{_C[p.ctype]} {p.name}")
            init.append(p.name)
    bounds = f"__launch_bounds__({threads}{', ' + str(min_blocks) if min_blocks else ''})"
    if cluster > 1:
        bounds += f" __cluster_dims__({cluster}, 1, 1)"
    return (f'{prelude}\n#include "{include}"\n'
            f"{tmap_type}namespace {{\nstruct Params {{\n" + "\n".join(fields) + "\n};\n}\n"
            f'extern "C" __global__ void {bounds} {entry}({", ".join(sig)}) {{\n'
            f"  const Params p{{{', '.join(init)}}};\n  {body}\n}}\n")


class PackedArgs:
    """Launch arguments packed once into one buffer: 8 bytes a slot (16 for a ``tmap`` or ``blob``), plus the
    ``void*[]`` that ``cuLaunchKernel`` takes. A plan builds it once and only rewrites its pointer slots
    per call."""

    __slots__ = ("slots", "data", "u64", "i32", "f32", "ptrs", "address", "_tls", "_starts", "kind_of")

    def __init__(self, params: list[ParamSpec], values: dict):
        entries = []
        for p in params:
            v = values.get(p.name, 0)
            if p.ctype == "fastdiv":
                d, m, s = magic(int(v) if v else 1)
                entries += [(p.name + "_d", "int32", d), (p.name + "_m", "uint32", m), (p.name + "_s", "uint32", s)]
            else:
                entries.append((p.name, p.ctype, v))
        self.kind_of = {e[0]: e[1] for e in entries}
        starts, n = [], 0
        for e in entries:
            starts.append(n)
            n += 16 if e[1] in ("tmap", "blob") else 1
        self._starts = np.asarray(starts, dtype=np.uint64)
        self._tls = None
        self.data = np.zeros(n, dtype=np.uint64)
        self.u64 = self.data
        self.i32 = self.data.view(np.int32)       # slot i's low word is i32[2 * i]
        self.f32 = self.data.view(np.float32)
        self.slots = {}
        for (name, ctype, v), i in zip(entries, starts):
            if ctype not in ("ptr", "int64", "int32", "uint32", "float32", "tmap", "blob"):
                raise ValueError(f"unknown parameter type {ctype!r} for {name}")
            self.slots[name] = i
            self._put(i, ctype, v)
        self.ptrs, self.address = self._pointers(self.data)

    def _pointers(self, data):
        ptrs = self._starts * np.uint64(8) + np.uint64(data.ctypes.data)
        return ptrs, int(ptrs.ctypes.data)

    def clone(self) -> "PackedArgs":
        """An independent buffer with these values (a launch program's step owns one: igemm/nn/_program.py)."""
        c = object.__new__(PackedArgs)
        c.slots, c._tls, c._starts, c.kind_of = self.slots, None, self._starts, self.kind_of
        c.data = self.data.copy()
        c.u64, c.i32, c.f32 = c.data, c.data.view(np.int32), c.data.view(np.float32)
        c.ptrs, c.address = self._pointers(c.data)
        return c

    def copy(self) -> "PackedArgs":
        """These values in this thread's scratch buffer of the template (allocated once per thread):
        valid until the next ``copy()``/``bind()`` of the same template on the same thread -- launch it
        first (cuLaunchKernel copies the arguments when it is called)."""
        tls = self._tls
        if tls is None:
            import threading
            tls = self._tls = threading.local()
        c = getattr(tls, "c", None)
        if c is None:
            c = tls.c = self.clone()
        else:
            c.data[...] = self.data
        return c

    def bind(self, values: dict) -> "PackedArgs":
        """:meth:`copy` with the named slots set (pointers, int32/int64/float32 scalars)."""
        c = self.copy()
        for name, v in values.items():
            c._put(self.slots[name], self.kind_of[name], v)
        return c

    def _put(self, i: int, kind: str, v) -> None:
        """Slot ``i`` = ``v`` as its parameter type (int32/uint32/float32 in the slot's low word)."""
        if kind == "ptr":
            self.u64[i] = int(v)
        elif kind in ("tmap", "blob"):
            self.u64[i:i + 16] = np.frombuffer(bytes(v), dtype=np.uint64) if v else 0
        elif kind == "int64":
            self.data.view(np.int64)[i] = int(v)
        elif kind == "float32":
            self.f32[2 * i] = float(v)
        elif kind == "uint32":
            self.data.view(np.uint32)[2 * i] = int(v)
        else:
            self.i32[2 * i] = int(v)


_TEMPLATES: dict = {}


def bind_args(params: list[ParamSpec], values: dict) -> PackedArgs:
    """``pack_args`` for per-call launches: a template per parameter list (zeros), bound in this thread's
    scratch buffer (see :meth:`PackedArgs.copy`). Fastdiv parameters are not supported here."""
    key = id(params)
    t = _TEMPLATES.get(key)
    if t is None or t[0] is not params:
        assert not any(p.ctype == "fastdiv" for p in params), "bind_args: fastdiv parameters need pack_args"
        t = _TEMPLATES[key] = (params, PackedArgs(params, {}))
    return t[1].bind(values)


def pack_args(params: list[ParamSpec], values: dict) -> PackedArgs:
    """Pack launch arguments in declaration order; missing pointers are nullptr, missing scalars 0."""
    return PackedArgs(params, values)


_cu_streams: dict = {}


def _cu_stream(handle: int):
    s = _cu_streams.get(handle)
    if s is None:
        from cuda.bindings import driver
        s = _cu_streams[handle] = driver.CUstream(handle)
    return s


# A launch step: a launcher, its packed arguments and the binds a call makes into them, each
# ``(slot, source, base)``: ``args[slot] = base + (0, x, w, y, residual, mask)[source]``. A conv plan's launch
# record is its steps (preparations, then the conv), run by csrc/host/launch.c or igemm.conv._launch.
ZERO, SRC_X, SRC_W, SRC_Y, SRC_RES, SRC_MASK = range(6)


class Step(NamedTuple):
    launcher: "Launcher"
    args: PackedArgs
    binds: tuple


def run_steps(steps, stream: int, x: int = 0, w: int = 0, y: int = 0, res: int = 0, mask: int = 0) -> None:
    """Bind and launch steps in order, each making its context current (a one-shot launch; a plan's record
    runs its steps in igemm.conv._launch)."""
    vals = (0, x, w, y, res, mask)
    for launcher, args, binds in steps:
        for slot, src, base in binds:
            args.u64[slot] = base + vals[src]
        launcher(stream, args)


class Launcher:
    """A compiled kernel and its launch configuration: ``launcher(stream, packed_args)`` launches.

    Every family launches the same way: ``cuLaunchKernel`` (cuda.bindings) with a pointer array into a
    :class:`PackedArgs` buffer (cuda.core's ``launch`` converts every argument on every call; with the
    conv family's 46 scalars that is most of a call's host time). ``stream`` is a raw ``CUstream`` int
    or anything with a ``handle`` (a cuda.core Stream).
    """

    __slots__ = ("kernel", "func", "grid", "block", "smem", "_launch", "_ctx", "_ctx_id", "_get_ctx", "_set_ctx",
                 "_fn", "_pdl", "_pdl_cfg", "coop")

    def __init__(self, kernel, grid, block, smem: int = 0, pdl: bool = False, coop: bool = False):
        from cuda.bindings import driver
        self.kernel = kernel
        h = kernel.handle
        if isinstance(h, driver.CUkernel):
            err, f = driver.cuKernelGetFunction(h)
            if int(err) != 0:
                raise RuntimeError(f"cuKernelGetFunction failed: {err}")
            h = f
        self.func = h
        g = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
        b = tuple(block) if isinstance(block, (tuple, list)) else (block,)
        self.grid = tuple(int(v) for v in g) + (1,) * (3 - len(g))
        self.block = tuple(int(v) for v in b) + (1,) * (3 - len(b))
        self.smem = int(smem)
        # coop: a cooperative launch (cuLaunchCooperativeKernel: the whole grid resident at once, for a kernel with
        # grid barriers; the caller sized the grid by the occupancy)
        self.coop = bool(coop)
        self._launch = driver.cuLaunchCooperativeKernel if coop else driver.cuLaunchKernel
        # the function belongs to the context current now (its device's primary context, see
        # _runtime.device); a launch makes it current if the caller's is another device's
        api = _runtime._ctx_api()                  # None without a driver (launches then are stand-ins)
        self._get_ctx, self._set_ctx = api if api else (None, None)
        self._ctx = self._get_ctx()[1] if api else None
        self._ctx_id = _runtime._ctx_int(self._ctx) if api else 0
        self._fn = int(h)
        self._pdl = bool(pdl) and hasattr(driver, "cuLaunchKernelEx")   # launch_after: the device is sm_90+
        self._pdl_cfg = {}                            # stream handle -> CUlaunchConfig (launch_after)
        if api:
            _hostlaunch.get()                         # (built and loaded once per process)

    def __call__(self, stream, args: PackedArgs) -> None:
        handle = stream if isinstance(stream, int) else int(stream.handle)
        self.make_current()
        self.launch_current(handle, args)

    def make_current(self) -> None:
        """Make this launcher's context current if it is not (the public call's keeps_current_context
        wrapper restores the caller's afterwards)."""
        if self._get_ctx is not None and _runtime.current_context() != self._ctx_id:
            self._set_ctx(self._ctx)

    def launch_current(self, handle: int, args: PackedArgs) -> None:
        """Launch on the raw stream ``handle``; the caller has made sure this launcher's context is current.
        Through the C launch step where it is built (docs/performance.md: host-c-bind-step)."""
        g, b = self.grid, self.block
        m = _hostlaunch.MOD
        if m is not None:
            err = (m.coop if self.coop else m.raw)(self._fn, g[0], g[1], g[2], b[0], b[1], b[2], self.smem, handle,
                                                    args.address)
        elif self.coop:
            (err,) = self._launch(self.func, g[0], g[1], g[2], b[0], b[1], b[2], self.smem, _cu_stream(handle),
                                  args.address)
        else:
            (err,) = self._launch(self.func, g[0], g[1], g[2], b[0], b[1], b[2], self.smem, _cu_stream(handle),
                                  args.address, 0)
        if err:
            raise launch_error(err)

    def launch_after(self, stream, args: PackedArgs) -> None:
        """Launch as a programmatic dependent of the kernel before it on ``stream`` (PDL, sm_90+): the grid
        may start while that kernel's last CTAs still run; the kernel must call ``pdl_wait()``
        (csrc/common.cuh) before it reads that kernel's outputs. Elsewhere (before sm_90, no
        cuLaunchKernelEx, the CPU tests' stand-in driver) a plain launch."""
        if self._get_ctx is None or not self._pdl or self.coop:
            return self(stream, args)
        from cuda.bindings import driver
        handle = stream if isinstance(stream, int) else int(stream.handle)
        self.make_current()
        # a launch configuration per stream, made once and never changed after (a Launcher is shared
        # between plans and threads: one configuration whose stream each call rewrote could launch on
        # another thread's stream)
        cfg = self._pdl_cfg.get(handle)
        if cfg is None:
            cfg = driver.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self.grid
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.block
            cfg.sharedMemBytes = self.smem
            cfg.hStream = _cu_stream(handle)
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            cfg.attrs = [attr]
            cfg.numAttrs = 1
            if len(self._pdl_cfg) >= 64:
                self._pdl_cfg = {}
            self._pdl_cfg[handle] = cfg
        (err,) = driver.cuLaunchKernelEx(cfg, self.func, args.address, 0)
        if err:
            raise launch_error(err)


def resident_blocks(launcher: Launcher, threads: int, smem: int = 0) -> int:
    """How many blocks of ``threads`` threads of the launcher's kernel an SM holds at once (0 without a driver):
    what sizes a cooperative launch's grid."""
    if launcher._get_ctx is None:
        return 0
    from cuda.bindings import driver
    launcher.make_current()
    err, n = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(launcher.func, threads, smem)
    if int(err) != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed: {err}")
    return int(n)


def launch_error(err) -> RuntimeError:
    """The error for a failed cuLaunchKernel (``err``: its CUresult, an enum or an int)."""
    if isinstance(err, int):
        try:
            from cuda.bindings import driver
            err = driver.CUresult(err)
        except (ImportError, ValueError):
            pass
    return RuntimeError(f"kernel launch failed: {err}")


def load(stub: str, name: str, entry: str, device_id: int, smem: int = 0):
    """Compile-or-fetch the stub's kernel for ``device_id``."""
    return _runtime.get_kernel(stub, name, device_id, entry=entry, smem=smem)
