"""``index_add(x, dim, index, source, alpha=1)``: ``torch.Tensor.index_add_`` on the GPU, in place.

The problem is collapsed to ``x[O, D, K]``, ``source[O, N, K]``, ``index[N]`` (``O``: product of the dims
before ``dim``, ``D = x.shape[dim]``, ``K``: product of the dims after it), so the kernels' index
arithmetic is one or two divmods whatever the rank (``csrc/index_add.cuh``). Kernels, by
:func:`choose_config`:

* ``sweep`` -- at most :data:`FEW_MAX` indices and ``O*K/vec`` columns enough to fill the GPU: each
  block stages the indices in shared memory once and each thread sweeps all of them down its column with
  plain read-modify-writes (it owns the column: race-free, deterministic; with distinct indices a window's
  loads are all in flight before its stores). ``few`` is the same sweep with vector reductions into ``x``
  (kept for comparison: slower on an H200);
* ``many`` -- otherwise: one thread per source pack (16 bytes when ``K`` and the pointers allow);
* ``deterministic=True``: no float atomics. Few indices: the ``few`` sweep with plain read-modify-writes
  (one thread owns each column, so duplicates apply in index order). Otherwise ``sort``: 64-bit keys
  ``(index, position)`` are sorted on the device (rank-sort tiles, then pairwise merges), and one owner per
  distinct index sums its source rows in position order in fp32 and updates ``x`` once.

Grids fill the GPU (``8 x`` SMs blocks of 256 threads, grid-stride loops); offsets are 64-bit, divisions use
fast division below ``2**31`` and 64-bit division above.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from . import _kernel, _runtime, reference
from ._checks import (IndexArgumentError, check_aligned, check_contiguous, check_dtype, check_flag, check_no_overlap,
                      check_stream, check_writable, is_real, require_array)
from ._dispatch import CallContext
from ._kernel import ParamSpec
from ._runtime import DTYPE_CTYPE, DTYPE_SIZES, FLOAT_DTYPES, keeps_current_context

__all__ = ["index_add", "IndexAddConfig", "choose_config", "FEW_MAX", "all_stubs", "precompile"]

#: Most indices the ``few`` kernel stages in shared memory (``kFewMax`` in ``csrc/index_add.cuh``).
FEW_MAX = 32
INDEX_DTYPES = ("int32", "int64")
_THREADS = 256
_BLOCKS_PER_SM = 8
_SORT_TILE = 256          # kSortTile
_TWO31 = 2 ** 31
_ICTYPE = {"int32": "int32_t", "int64": "int64_t"}

_P_CHECK = [ParamSpec("index", "ptr"), ParamSpec("status", "ptr"), ParamSpec("n", "int64"), ParamSpec("d", "int64")]
_P_FEW = [ParamSpec("x", "ptr"), ParamSpec("index", "ptr"), ParamSpec("src", "ptr"), ParamSpec("alpha", "float32"),
          ParamSpec("cols", "int64"), ParamSpec("kv", "fastdiv"), ParamSpec("kv64", "int64"), ParamSpec("n", "int32"),
          ParamSpec("d", "int64"), ParamSpec("k", "int64")]
_P_MANY = [ParamSpec("x", "ptr"), ParamSpec("index", "ptr"), ParamSpec("src", "ptr"), ParamSpec("alpha", "float32"),
           ParamSpec("nvec", "int64"), ParamSpec("kv", "fastdiv"), ParamSpec("nidx", "fastdiv"),
           ParamSpec("kv64", "int64"), ParamSpec("n64", "int64"), ParamSpec("d", "int64"), ParamSpec("k", "int64")]
_P_TILE = [ParamSpec("index", "ptr"), ParamSpec("keys", "ptr"), ParamSpec("n", "int64"), ParamSpec("d", "int64"),
           ParamSpec("pos_bits", "int32")]
_P_MERGE = [ParamSpec("keys_in", "ptr"), ParamSpec("keys_out", "ptr"), ParamSpec("n", "int64"),
            ParamSpec("log2w", "int32")]
_P_ACC = [ParamSpec("x", "ptr"), ParamSpec("src", "ptr"), ParamSpec("keys", "ptr"), ParamSpec("alpha", "float32"),
          ParamSpec("n", "int64"), ParamSpec("outer", "int64"), ParamSpec("d", "int64"), ParamSpec("k", "int64"),
          ParamSpec("kv", "int64"), ParamSpec("pos_bits", "int32")]


# ------------------------------------------------------------------------------------------ config
@dataclass(frozen=True)
class IndexAddConfig:
    """Which kernel runs: ``kernel`` is ``"few"``, ``"many"``, ``"sweep"`` (deterministic few) or ``"sort"``
    (deterministic many); ``vec`` elements per pack; ``wide``: 64-bit divisions (a dividend >= 2**31);
    ``lanes``: threads per segment in the sort path's accumulation (1 or 32)."""
    kernel: str
    vec: int
    wide: bool = False
    lanes: int = 1

    def __post_init__(self):
        if self.kernel not in ("few", "many", "sweep", "sort"):
            raise ValueError(f"kernel: expected few/many/sweep/sort, got {self.kernel!r}")
        if self.vec not in (1, 2, 4, 8) or self.lanes not in (1, 32):
            raise ValueError(f"bad vec {self.vec} / lanes {self.lanes}")


def max_vec(dtype: str, inner: int, *ptrs: int) -> int:
    """Largest pack (elements, at most 16 bytes) dividing ``inner`` with every pointer aligned to it."""
    size = DTYPE_SIZES[dtype]
    v = 16 // size
    while v > 1 and (inner % v or any(p % (v * size) for p in ptrs)):
        v //= 2
    return v


def sort_pos_bits(n_index: int) -> int:
    return max(1, (n_index - 1).bit_length())


def choose_config(outer: int, size: int, inner: int, n_index: int, dtype: str, *, deterministic: bool = False,
                  sms: int = 132, vec: int | None = None) -> IndexAddConfig:
    """Pure dispatch rule (tested without a GPU). ``vec`` defaults to the largest pack dividing ``inner``."""
    v = max_vec(dtype, inner) if vec is None else vec
    kv = inner // v
    cols = outer * kv
    if deterministic:
        if n_index <= FEW_MAX and (n_index <= 4 or cols >= sms * _THREADS):
            return IndexAddConfig("sweep", v, wide=cols >= _TWO31)
        if int(size).bit_length() + sort_pos_bits(n_index) > 64:
            raise NotImplementedError(f"deterministic index_add: {size} rows x {n_index} indices do not fit the "
                                      f"64-bit sort key")
        return IndexAddConfig("sort", v, lanes=32 if kv >= 16 else 1)
    if n_index <= FEW_MAX and cols >= sms * _THREADS * 4:
        # one thread owns each column, so plain read-modify-writes are race-free: the sweep (measured
        # faster than the vector reductions of "few" on an H200: 50.9 vs 56.2 us on x(32,1024,1024) src(15,..))
        return IndexAddConfig("sweep", v, wide=cols >= _TWO31)
    return IndexAddConfig("many", v, wide=outer * n_index * kv >= _TWO31)


# ------------------------------------------------------------------------------------------ kernels
@lru_cache(maxsize=None)
def _stub(kind: str, dtype: str, idtype: str, vec: int, flag_a: bool, flag_b: bool, lanes: int) -> str:
    T, I = DTYPE_CTYPE.get(dtype, "float"), _ICTYPE.get(idtype, "int64_t")
    b = lambda f: "true" if f else "false"  # noqa: E731
    ns = "igemm::index_add::"
    if kind == "check":
        params, body = _P_CHECK, f"{ns}check<{I}>(p);"
    elif kind == "few":      # flag_a: atomic, flag_b: wide
        params, body = _P_FEW, f"{ns}few<{T}, {I}, {vec}, {b(flag_a)}, {b(flag_b)}>(p);"
    elif kind == "many":     # flag_b: wide
        params, body = _P_MANY, f"{ns}many<{T}, {I}, {vec}, {b(flag_b)}>(p);"
    elif kind == "sort_tile":
        params, body = _P_TILE, f"{ns}sort_tile<{I}>(p);"
    elif kind == "sort_merge":
        params, body = _P_MERGE, f"{ns}sort_merge(p);"
    elif kind == "det_accumulate":
        params, body = _P_ACC, f"{ns}det_accumulate<{T}, {vec}, {lanes}>(p);"
    else:  # pragma: no cover
        raise ValueError(kind)
    return _kernel.render_kernel(include="index_add.cuh", entry=f"igemm_index_add_{kind}", params=params,
                                 threads=_THREADS, body=body)


def stubs_for(config: IndexAddConfig, dtype: str, idtype: str, check: bool = True) -> list[tuple[str, str]]:
    """``(kind, stub)`` of every kernel a call with ``config`` launches (for compile tests / precompiling)."""
    c = config
    out = [("check", _stub("check", "float32", idtype, 1, False, False, 1))] if check else []
    if c.kernel in ("few", "sweep"):
        out.append(("few", _stub("few", dtype, idtype, c.vec, c.kernel == "few", c.wide, 1)))
    elif c.kernel == "many":
        out.append(("many", _stub("many", dtype, idtype, c.vec, True, c.wide, 1)))
    else:
        out += [("sort_tile", _stub("sort_tile", "float32", idtype, 1, False, False, 1)),
                ("sort_merge", _stub("sort_merge", "float32", "int64", 1, False, False, 1)),
                ("det_accumulate", _stub("det_accumulate", dtype, "int64", c.vec, False, False, c.lanes))]
    return out


def all_stubs() -> list[tuple[str, str]]:
    """``(cache name, stub)`` of every kernel instance this module can launch (to precompile a cache)."""
    out = {}
    for it in INDEX_DTYPES:
        out[_stub("check", "float32", it, 1, False, False, 1)] = "index_add_check"
        out[_stub("sort_tile", "float32", it, 1, False, False, 1)] = "index_add_sort_tile"
    out[_stub("sort_merge", "float32", "int64", 1, False, False, 1)] = "index_add_sort_merge"
    for dt in FLOAT_DTYPES:
        for v in (1, 2, 4) if dt == "float32" else (1, 2, 4, 8):
            for lanes in (1, 32):
                out[_stub("det_accumulate", dt, "int64", v, False, False, lanes)] = "index_add_det_accumulate"
            for it in INDEX_DTYPES:
                for wide in (False, True):
                    out[_stub("many", dt, it, v, True, wide, 1)] = "index_add_many"
                    for atomic in (False, True):
                        out[_stub("few", dt, it, v, atomic, wide, 1)] = "index_add_few"
    return [(name, stub) for stub, name in out.items()]


def precompile(arch: str = "sm_90a", workers: int = 8) -> int:
    """Compile every instance into the kernel cache (``$IGEMM_CACHE_DIR``), ``workers`` nvcc at a time."""
    from . import _build
    return _build.compile_many(all_stubs(), arch, workers)


def _sms(device_id: int) -> int:
    return _runtime.device_props(device_id).multiprocessor_count


def _grid(device_id: int, work: int, kernel=None, per_sm: int = _BLOCKS_PER_SM) -> int:
    """Blocks of 256 threads for ``work`` threads, at most one full wave (the kernel's occupancy x SMs)."""
    if kernel is not None:
        try:
            per_sm = max(1, int(kernel.occupancy.max_active_blocks_per_multiprocessor(_THREADS, 0)))
        except Exception:  # pragma: no cover - older cuda.core
            pass
    return max(1, min(_sms(device_id) * per_sm, -(-work // _THREADS)))


class _Args:
    """A launch-argument list packed once; per call only the named dynamic slots are replaced."""
    __slots__ = ("base", "slots")

    def __init__(self, params, static: dict, dynamic: tuple):
        self.base = _kernel.pack_args(params, static)
        pos, where = 0, {}
        for p in params:
            where[p.name] = (pos, p.ctype)
            pos += 3 if p.ctype == "fastdiv" else 1
        self.slots = tuple(where[n] for n in dynamic)

    def __call__(self, *values) -> "_kernel.PackedArgs":
        a = self.base.copy()
        for (i, ct), v in zip(self.slots, values):
            if ct == "ptr":
                a.u64[i] = int(v)
            elif ct == "float32":
                a.f32[2 * i] = float(v)
            elif ct == "int64":
                a.data.view(np.int64)[i] = int(v)
            else:
                a.i32[2 * i] = int(v)
        return a


class _Plan:
    """Kernels, grids and packed scalars of one problem; ``run`` binds pointers and alpha and launches."""

    def __init__(self, device_id, dtype, idtype, outer, size, inner, n_index, config: IndexAddConfig):
        self.config, self.n, self.dtype = config, n_index, dtype
        c, dev = config, device_id
        kv = inner // c.vec
        common = {"d": size, "k": inner}
        self.launches = []
        if c.kernel in ("few", "sweep"):
            k = _kernel.load(_stub("few", dtype, idtype, c.vec, c.kernel == "few", c.wide, 1), "index_add_few",
                             "igemm_index_add_few", dev)
            cols = outer * kv
            args = _Args(_P_FEW, {**common, "cols": cols, "kv": 1 if c.wide else kv, "kv64": kv, "n": n_index},
                         ("x", "index", "src", "alpha"))
            self.launches.append((_kernel.Launcher(k, _grid(dev, cols, k), _THREADS), args))
        elif c.kernel == "many":
            k = _kernel.load(_stub("many", dtype, idtype, c.vec, True, c.wide, 1), "index_add_many",
                             "igemm_index_add_many", dev)
            nvec = outer * n_index * kv
            args = _Args(_P_MANY, {**common, "nvec": nvec, "kv": 1 if c.wide else kv, "nidx": 1 if c.wide else n_index,
                                   "kv64": kv, "n64": n_index}, ("x", "index", "src", "alpha"))
            self.launches.append((_kernel.Launcher(k, _grid(dev, nvec, k), _THREADS), args))
        else:
            pos_bits = sort_pos_bits(n_index)
            kt = _kernel.load(_stub("sort_tile", "float32", idtype, 1, False, False, 1), "index_add_sort_tile",
                              "igemm_index_add_sort_tile", dev)
            km = _kernel.load(_stub("sort_merge", "float32", "int64", 1, False, False, 1), "index_add_sort_merge",
                              "igemm_index_add_sort_merge", dev)
            ka = _kernel.load(_stub("det_accumulate", dtype, "int64", c.vec, False, False, c.lanes),
                              "index_add_det_accumulate", "igemm_index_add_det_accumulate", dev)
            self.tile = (_kernel.Launcher(kt, _grid(dev, n_index, kt), _THREADS),
                         _Args(_P_TILE, {"n": n_index, "d": size, "pos_bits": pos_bits}, ("index", "keys")))
            self.merges = []
            log2w = 8  # kSortTile == 2**8
            while (1 << log2w) < n_index:
                self.merges.append((_kernel.Launcher(km, _grid(dev, n_index, km), _THREADS),
                                    _Args(_P_MERGE, {"n": n_index, "log2w": log2w}, ("keys_in", "keys_out"))))
                log2w += 1
            self.acc = (_kernel.Launcher(ka, _grid(dev, n_index * outer * c.lanes, ka), _THREADS),
                        _Args(_P_ACC, {"n": n_index, "outer": outer, "d": size, "k": inner, "kv": kv,
                                       "pos_bits": pos_bits}, ("x", "src", "keys", "alpha")))

    def run(self, stream, x_ptr: int, idx_ptr: int, src_ptr: int, alpha: float, alloc=None) -> list:
        """Launch; returns the workspaces (keep them alive until the launches are queued)."""
        if self.config.kernel != "sort":
            for launcher, args in self.launches:
                launcher(stream, args(x_ptr, idx_ptr, src_ptr, alpha))
            return []
        bufs = [alloc(self.n), alloc(self.n)]
        a, b = bufs[0][1].ptr, bufs[1][1].ptr
        launcher, args = self.tile
        launcher(stream, args(idx_ptr, a))
        for launcher, args in self.merges:
            launcher(stream, args(a, b))
            a, b = b, a
        launcher, args = self.acc
        launcher(stream, args(x_ptr, src_ptr, a, alpha))
        return bufs


@lru_cache(maxsize=256)
def _plan(device_id, dtype, idtype, outer, size, inner, n_index, deterministic, vec) -> _Plan:
    cfg = choose_config(outer, size, inner, n_index, dtype, deterministic=deterministic, sms=_sms(device_id), vec=vec)
    return _Plan(device_id, dtype, idtype, outer, size, inner, n_index, cfg)


# ------------------------------------------------------------------------------------------ index check
_status_bufs: dict = {}
_status_lock = threading.Lock()


def _status(device_id: int, stream):
    """A uint64 status word per (device, stream, thread), kept at UINT64_MAX between calls."""
    key = (device_id, int(stream.handle), threading.get_ident())
    buf = _status_bufs.get(key)
    if buf is None:
        with _status_lock:
            buf = _runtime.DeviceArray((1,), "int64", device_id, stream)
            _runtime.memset_d8(buf.ptr, 0xFF, 8, stream)
            _status_bufs[key] = buf
    return buf


@lru_cache(maxsize=64)
def _check_launcher(device_id: int, idtype: str, n_index: int):
    k = _kernel.load(_stub("check", "float32", idtype, 1, False, False, 1), "index_add_check",
                     "igemm_index_add_check", device_id)
    return _kernel.Launcher(k, _grid(device_id, n_index, per_sm=4), _THREADS)


def _device_check(device_id: int, stream, idtype: str, idx_ptr: int, n_index: int, size: int):
    """First ``(position, value)`` of an index outside [0, size), or None. Costs one small kernel (reads the
    index once) and a synchronisation of ``stream`` (an 8-byte device-to-host copy)."""
    st = _status(device_id, stream)
    _check_launcher(device_id, idtype, n_index)(
        stream, _kernel.pack_args(_P_CHECK, {"index": idx_ptr, "status": st.ptr, "n": n_index, "d": size}))
    host = np.empty(1, np.uint64)
    _runtime.memcpy_dtoh(host.ctypes.data, st.ptr, 8, stream)
    pos = int(host[0])
    if pos == 2 ** 64 - 1:
        return None
    val = np.empty(1, np.dtype(idtype))
    _runtime.memcpy_dtoh(val.ctypes.data, idx_ptr + pos * DTYPE_SIZES[idtype], DTYPE_SIZES[idtype], stream)
    _runtime.memset_d8(st.ptr, 0xFF, 8, stream)
    return pos, int(val[0])


def _raise_bad(bad, dim: int, size: int, x_shape) -> None:
    pos, val = bad
    raise IndexArgumentError(f"index: index[{pos}] = {val} is out of range for dimension {dim} of x (shape "
                             f"{tuple(x_shape)}, size {size}); x was not modified")


# ------------------------------------------------------------------------------------------ validation
@dataclass(frozen=True)
class _Geom:
    dim: int
    outer: int
    size: int
    inner: int
    n_index: int
    dtype: str
    idtype: str
    x_shape: tuple


def _validate(tx, tidx, tsrc, dim) -> _Geom:
    check_dtype(tx, "x", FLOAT_DTYPES)
    if tsrc.dtype != tx.dtype:
        raise TypeError(f"source: dtype {tsrc.dtype} differs from x's {tx.dtype}")
    check_dtype(tidx, "index", INDEX_DTYPES)
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise TypeError(f"dim: expected an int, got {type(dim).__name__}")
    nd = tx.ndim
    lo, hi = (-1, 0) if nd == 0 else (-nd, nd - 1)
    if not lo <= dim <= hi:
        raise IndexArgumentError(f"dim: {dim} is out of range for x of shape {tuple(tx.shape)} (expected {lo} to {hi})")
    dim = int(dim) % max(nd, 1)
    if tidx.ndim > 1:
        raise IndexArgumentError(f"index: expected a 1-D (or 0-d) tensor of indices, got shape {tuple(tidx.shape)}")
    n_index = tidx.numel
    if tsrc.ndim != nd:
        raise ValueError(f"source: expected {nd} dimensions like x {tuple(tx.shape)}, got shape {tuple(tsrc.shape)}")
    if nd == 0:
        if n_index != 1:
            raise ValueError(f"index: a 0-d x takes exactly one index, got {n_index}")
    else:
        want = tuple(tx.shape[:dim]) + (n_index,) + tuple(tx.shape[dim + 1:])
        if tuple(tsrc.shape) != want:
            raise ValueError(f"source: expected shape {want} (x {tuple(tx.shape)} with {n_index} indices along dim "
                             f"{dim}), got {tuple(tsrc.shape)}")
    for t, name in ((tx, "x"), (tsrc, "source"), (tidx, "index")):
        check_contiguous(t, name)
        check_aligned(t, name)
    check_writable(tx, "x")
    check_no_overlap(tx, "x", tsrc, "source")
    check_no_overlap(tx, "x", tidx, "index")
    outer, size, inner = reference.collapse_index_add(tx.shape, dim)
    return _Geom(dim, outer, size, inner, n_index, tx.dtype, tidx.dtype, tuple(tx.shape))


def _alpha_value(alpha, dtype: str) -> float:
    """alpha rounded to x's dtype, as torch converts it."""
    if not is_real(alpha):
        raise TypeError(f"alpha: expected a real number, got {type(alpha).__name__}")
    return _round_alpha(float(alpha), dtype)


@lru_cache(maxsize=1024)
def _round_alpha(a: float, dtype: str) -> float:
    if dtype == "float16":
        return float(np.float16(a))
    if dtype == "bfloat16":
        bits = int(np.array(a, np.float32).view(np.uint32))
        if (bits & 0x7F800000) != 0x7F800000:   # finite: round to nearest even
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFFFFFF
        return float(np.array(bits & 0xFFFF0000, np.uint32).view(np.float32))
    return float(np.float32(a))


# ------------------------------------------------------------------------------------------ entry point
@keeps_current_context
def index_add(x, dim: int, index, source, alpha=1, *, deterministic: bool = False, check_index: bool = True,
              stream=None):
    """In place ``x.index_add_(dim, index, source, alpha=alpha)``: ``x[..., index[i], ...] += alpha *
    source[..., i, ...]`` along ``dim``; duplicate indices accumulate. Returns ``x``.

    ``x`` and ``source``: contiguous fp32/fp16/bf16 of one dtype, any rank, ``source`` shaped like ``x`` but
    ``len(index)`` along ``dim`` (negative ``dim`` counts from the end); ``index``: contiguous int32/int64,
    1-D (or 0-d). fp16/bf16 accumulate into ``x`` with fp16/bf16 atomics, like PyTorch.

    ``check_index=True`` (default): an index outside ``[0, x.shape[dim])`` -- negative ones included --
    raises an ``IndexError`` (also a ``ValueError``) naming its position and value, and ``x`` is left unchanged; the CUDA context
    stays usable. For a device ``index`` this costs a small extra kernel reading the index once and a
    synchronisation of the stream: the call waits for the work queued before it, and takes ~35 us more
    host time than ``check_index=False`` (H200, ``benchmarks/host_overhead.py``: 45 vs 12 us); numpy
    indices are checked on the host for free. ``check_index=False`` skips both: a bad index then raises
    nothing and its source rows are dropped (never a fault, never a trap).

    ``deterministic=True``: no float atomics, bit-identical results run to run (duplicates summed in index
    order in fp32); slower when there are many indices (a device sort of the index).

    >>> import numpy as np, igemm
    >>> x = np.zeros((3, 2), np.float32)
    >>> igemm.index_add(x, 0, np.array([2, 0, 2]), np.ones((3, 2), np.float32), alpha=2).tolist()
    [[2.0, 2.0], [0.0, 0.0], [4.0, 4.0]]
    """
    if deterministic is False and stream is None:
        done = _fast_torch(x, dim, index, source, alpha, check_index)
        if done is not None:
            return done
    for v, name in ((x, "x"), (index, "index"), (source, "source")):
        require_array(v, name)
    check_flag(deterministic, "deterministic")
    check_flag(check_index, "check_index")
    check_stream(stream)
    ctx = CallContext({"x": x, "index": index, "source": source}, stream)
    tx, tidx, tsrc = ctx.views["x"], ctx.views["index"], ctx.views["source"]
    g = _validate(tx, tidx, tsrc, dim)
    a = _alpha_value(alpha, g.dtype)
    if ctx.host and (check_index or ctx.backend == "numpy"):
        bad = reference.first_bad_index(np.asarray(index), g.size)
        if bad is not None:
            _raise_bad(bad, g.dim, g.size, g.x_shape)
    if ctx.backend == "numpy":
        res = reference.index_add(np.asarray(x), g.dim, np.asarray(index), np.asarray(source), a)
        xa = np.asarray(x)
        xa[...] = res.astype(xa.dtype)
        return x
    ctx.stream  # resolve (and validate) the stream before anything is copied or launched
    d_x, d_idx, d_src = ctx.device_view("x"), ctx.device_view("index"), ctx.device_view("source")
    if check_index and not ctx.host and g.n_index:
        bad = _device_check(ctx.device_id, ctx.stream, g.idtype, d_idx.ptr, g.n_index, g.size)
        if bad is not None:
            _raise_bad(bad, g.dim, g.size, g.x_shape)
    if g.outer * g.inner * g.n_index:
        vec = max_vec(g.dtype, g.inner, d_x.ptr, d_src.ptr)
        plan = _plan(ctx.device_id, g.dtype, g.idtype, g.outer, g.size, g.inner, g.n_index, bool(deterministic), vec)
        # workspaces (sort path) live until every launch is queued; their frees are stream-ordered
        plan.run(ctx.stream, d_x.ptr, d_idx.ptr, d_src.ptr, a, alloc=lambda n: ctx.workspace((n,), "int64"))
    if ctx.host:
        ctx.copy_back("x", d_x)
    elif ctx.kind == "torch" and not deterministic and stream is None:
        _remember(x, dim, index, source, g)
    return x


# ------------------------------------------------------------------------------------------ torch fast path
# A call repeating a validated (shapes, dtypes, dim, devices) signature on torch CUDA tensors skips the
# generic tensor views and validation: a few attribute reads, the pointer checks and the launch.
_fast_geoms: dict = {}
_torch = None


def _fast_key(x, dim, index, source):
    return (x.shape, x.dtype, index.shape, index.dtype, source.shape, source.dtype, dim, x.get_device(),
            index.get_device(), source.get_device())


def _remember(x, dim, index, source, g: _Geom) -> None:
    global _torch
    if _torch is None:
        import torch
        _torch = torch
    if len(_fast_geoms) > 1024:
        _fast_geoms.clear()
    _fast_geoms[_fast_key(x, dim, index, source)] = g


def _torch_stream(device_id: int):
    raw = getattr(_torch._C, "_cuda_getCurrentRawStream", None)
    h = int(raw(device_id)) if raw is not None else int(_torch.cuda.current_stream(device_id).cuda_stream)
    return _runtime.RawStream(h)


def _fast_torch(x, dim, index, source, alpha, check_index):
    if _torch is None or type(x) is not _torch.Tensor or type(index) is not _torch.Tensor \
            or type(source) is not _torch.Tensor or not _fast_geoms or type(dim) is not int \
            or type(check_index) is not bool:         # anything unusual: the generic path validates it
        return None
    try:
        g = _fast_geoms.get(_fast_key(x, dim, index, source))
    except TypeError:  # unhashable dim
        return None
    if g is None or not (x.is_contiguous() and index.is_contiguous() and source.is_contiguous()):
        return None
    itemsize = DTYPE_SIZES[g.dtype]
    xp, sp, ip = x.data_ptr(), source.data_ptr(), index.data_ptr()
    xe = xp + x.numel() * itemsize
    if (xp < sp + source.numel() * itemsize and sp < xe) or (xp < ip + g.n_index * DTYPE_SIZES[g.idtype] and ip < xe):
        return None                                   # overlap: the generic path raises
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        return None
    dev = x.get_device()
    _runtime.device(dev)
    stream = _torch_stream(dev)
    a = _round_alpha(float(alpha), g.dtype)
    if check_index and g.n_index:
        bad = _device_check(dev, stream, g.idtype, ip, g.n_index, g.size)
        if bad is not None:
            _raise_bad(bad, g.dim, g.size, g.x_shape)
    if g.outer * g.inner * g.n_index:
        vec = max_vec(g.dtype, g.inner, xp, sp)
        _plan(dev, g.dtype, g.idtype, g.outer, g.size, g.inner, g.n_index, False, vec).run(stream, xp, ip, sp, a)
    return x
