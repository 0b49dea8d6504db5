"""The bad-input table: one row format, one runner (``tests/test_validation.py``), rows per family.

A row is ``Row(id, build, exc, arg)``:

* ``id``: ``"<function>/<what is wrong>"``, unique over the table;
* ``build(A) -> Call``: makes the call's arguments with the array adapter ``A`` (:class:`NumpyArrays` on
  the numpy backend, :class:`TorchArrays` -- CUDA tensors -- on the GPU) and returns
  ``Call(fn, *args, **kwargs)``; outputs are made pre-filled with a sentinel (``A.full(shape, NAN)``,
  ``A.words(n)``), views of a shared buffer list that buffer in ``Call(..., keep=(buf,))``;
* ``exc``: the exception type expected (TypeError: a wrong type or dtype, None for an array;
  ValueError: a wrong shape/layout/contiguity/alignment/overlap/read-only output/out-of-range value;
  NotImplementedError: not supported yet);
* ``arg``: the argument the message must start with (``"out.var"``, ``"mask_out"``).

Optional: ``match`` (a regex the message must also contain), ``where`` (``"both"``, ``"cpu"``: numpy only,
``"gpu"``: CUDA only), ``launches`` (a documented launch before the error, e.g. index_add's index check),
``multigpu``, ``anywhere`` (the argument may be named anywhere in the message, not first).

The runner snapshots every array it finds among the arguments (tuples, lists and epilogue objects
searched too) and in ``keep``, makes the call, checks the exception type, that the message names ``arg``,
and that no byte of any of those arrays changed; on the GPU also that nothing was launched.

To add a family's rows: a module here with ``ROWS = [...]`` and its name in ``FAMILIES`` below.
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass

import numpy as np

NAN, INF = float("nan"), float("inf")
POISON_WORD = 0xAAAAAAAA
FAMILIES = ("conv", "relu", "index_add", "prelu", "norm", "syncbn", "backward")


class Call:
    """A call to make: ``fn(*args, **kwargs)``; ``keep``: more arrays to watch (buffers behind views)."""

    def __init__(self, fn, *args, keep=(), **kwargs):
        self.fn, self.args, self.kwargs, self.keep = fn, args, kwargs, tuple(keep)

    def __call__(self):
        return self.fn(*self.args, **self.kwargs)

    def values(self):
        return [*self.args, *self.kwargs.values(), *self.keep]


@dataclass(frozen=True)
class Row:
    id: str
    build: object
    exc: object
    arg: str
    match: str = ""
    where: str = "both"
    launches: bool = False
    multigpu: bool = False
    anywhere: bool = False


DROP = object()   # a variant's value meaning "leave this argument out"


def variants(fn, positional: tuple, base):
    """Row builders from one valid call: ``base(A) -> dict`` of every argument (the ``positional`` names
    are passed positionally, in that order, the rest by keyword); ``variant(**changes)`` returns a
    ``build`` with each change applied: a value, :data:`DROP`, or ``f(A, kw)`` computed from the arguments."""
    def variant(**changes):
        def build(A):
            kw = base(A)
            for k, v in changes.items():
                kw[k] = v(A, kw) if callable(v) else v
            kw = {k: v for k, v in kw.items() if v is not DROP}
            args = [kw.pop(k) for k in positional if k in kw]
            keep = kw.pop("keep", ())
            return Call(fn, *args, keep=keep, **kw)
        return build
    return variant


# ============================================================================================== adapters
class _Wrapper:
    """A device array seen through ``__cuda_array_interface__`` only (a read-only flag, or a pointer that
    is not element-aligned): what torch cannot make itself. ``base``: the memory watched."""

    def __init__(self, base, ptr: int, shape, typestr: str, readonly: bool):
        self.base = base
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (ptr, readonly),
                                         "version": 3, "strides": None, "stream": None}


class NumpyArrays:
    """numpy arrays on the numpy backend (the CPU tier)."""
    gpu = False
    device = "numpy"

    def arr(self, a, dtype="float32"):
        return np.array(a, dtype=dtype)

    def randn(self, shape, dtype="float32", seed=0):
        return np.random.default_rng(seed).standard_normal(shape).astype(dtype)

    def full(self, shape, value, dtype="float32"):
        return np.full(shape, value, dtype=dtype)

    def words(self, n, value=POISON_WORD):
        return np.full(n, value, dtype=np.uint32)

    def as_words(self, a):
        """The same memory as 32-bit mask words."""
        return a.view(np.uint32)

    def as_int32(self, a):
        return a.view(np.int32)

    def perm(self, a, axes):
        return a.transpose(axes)

    def view(self, a, shape):
        out = a.reshape(shape)
        assert np.shares_memory(out, a)
        return out

    def channels_last(self, a):
        """NCHW shape, NHWC strides (not contiguous in NCHW order)."""
        return np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)

    def flat(self, a):
        return a.reshape(-1)

    def empty(self, shape, dtype="float32"):
        return np.empty(shape, dtype=dtype)

    def readonly(self, a):
        b = np.array(a, copy=True)
        b.flags.writeable = False
        return b

    def unaligned(self, shape, value=NAN, dtype="float32"):
        """An array whose data pointer is 1 byte past an element boundary."""
        dt = np.dtype(dtype)
        n = int(np.prod(shape))
        raw = np.zeros(n * dt.itemsize + 16, np.uint8)
        start = (-raw.ctypes.data) % 16 + 1
        out = raw[start:start + n * dt.itemsize].view(np.uint8)
        a = np.ndarray(shape, dt, buffer=out.data)          # numpy allows unaligned views built this way
        a[...] = value
        return a

    def snapshot(self, a):
        return np.array(a, copy=True)

    def same(self, a, snap) -> bool:
        return a.shape == snap.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(snap).tobytes()

    def is_array(self, a) -> bool:
        return isinstance(a, np.ndarray)

    def host(self, a):
        """A float64 (floats) copy on the host."""
        a = np.asarray(a)
        return np.array(a, dtype=np.float64) if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else a.copy()

    def host_words(self, m):
        return np.array(m).view(np.uint32)

    def sync(self):
        pass


class TorchArrays:
    """torch CUDA tensors (the GPU tier)."""
    gpu = True
    device = 0

    def __init__(self):
        import torch
        self.torch = torch

    def _dt(self, dtype):
        return getattr(self.torch, dtype)

    def arr(self, a, dtype="float32"):
        a = np.asarray(a)
        if dtype in ("bfloat16", "float16", "float32") and a.dtype.kind == "f":
            return self.torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to("cuda", self._dt(dtype))
        return self.torch.from_numpy(np.array(a, dtype=dtype)).cuda()

    def randn(self, shape, dtype="float32", seed=0):
        return self.arr(np.random.default_rng(seed).standard_normal(shape), dtype)

    def full(self, shape, value, dtype="float32"):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return self.torch.full(shape, value, dtype=self._dt(dtype), device="cuda")

    def empty(self, shape, dtype="float32"):
        return self.torch.empty(shape, dtype=self._dt(dtype), device="cuda")

    def words(self, n, value=POISON_WORD):
        v = int(np.array(value, dtype=np.uint32).view(np.int32))
        return self.torch.full((n,), v, dtype=self.torch.int32, device="cuda")

    def as_words(self, a):
        return a.view(self.torch.int32)

    def as_int32(self, a):
        return a.view(self.torch.int32)

    def perm(self, a, axes):
        return a.permute(axes)

    def view(self, a, shape):
        return a.view(shape)

    def channels_last(self, a):
        return a.contiguous(memory_format=self.torch.channels_last)

    def flat(self, a):
        return a.view(-1)

    def readonly(self, a):
        return _Wrapper(a, a.data_ptr(), tuple(a.shape), _typestr(a), True)

    def unaligned(self, shape, value=NAN, dtype="float32"):
        n = int(np.prod(shape))
        size = self._dt(dtype).itemsize
        raw = self.torch.zeros(n * size + 16, dtype=self.torch.uint8, device="cuda")
        typestr = {"float32": "<f4", "float16": "<f2", "uint32": "<u4", "int32": "<i4", "int64": "<i8"}[dtype]
        return _Wrapper(raw, raw.data_ptr() + 1, shape, typestr, False)

    def snapshot(self, a):
        return np.array(a, copy=True) if isinstance(a, np.ndarray) else a.clone()

    def _bytes(self, t) -> bytes:
        if isinstance(t, np.ndarray):
            return np.ascontiguousarray(t).tobytes()
        return t.detach().reshape(-1).cpu().view(self.torch.uint8).numpy().tobytes()

    def same(self, a, snap) -> bool:
        return tuple(a.shape) == tuple(snap.shape) and self._bytes(a) == self._bytes(snap)

    def is_array(self, a) -> bool:
        return isinstance(a, (np.ndarray, self.torch.Tensor))

    def host(self, a):
        from helpers import to_numpy
        return to_numpy(a)

    def host_words(self, m):
        return m.cpu().numpy().view(np.uint32)

    def sync(self):
        self.torch.cuda.synchronize()

    def misaligned(self, shape, dtype="float32", seed=0, offset=1):
        """A tensor of random values ``offset`` elements into a bigger buffer (not 16-byte aligned)."""
        n = int(np.prod(shape))
        buf = self.torch.empty(n + offset, dtype=self._dt(dtype), device="cuda")
        t = buf[offset:].view(shape)
        t.copy_(self.randn(shape, dtype, seed))
        return t


def _typestr(t) -> str:
    return {"float32": "<f4", "float16": "<f2", "int32": "<i4", "int64": "<i8", "float64": "<f8"}[
        str(t.dtype).split(".")[-1]]


# ============================================================================================== the runner's side
def watched(A, call: Call) -> list:
    """Every array the call can see: its arguments (tuples, lists, igemm objects searched), ``keep``,
    and the memory behind :class:`_Wrapper` views."""
    found, seen = [], set()

    def walk(v, depth=0):
        if id(v) in seen or depth > 4:
            return
        seen.add(id(v))
        if isinstance(v, _Wrapper):
            walk(v.base, depth + 1)
        elif A.is_array(v):
            found.append(v)
        elif isinstance(v, (tuple, list)):
            for e in v:
                walk(e, depth + 1)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            for f in dataclasses.fields(v):
                walk(getattr(v, f.name), depth + 1)
        elif type(v).__module__.split(".")[0] in ("igemm", "epilogues") and hasattr(v, "__dict__"):
            for e in vars(v).values():
                walk(e, depth + 1)
    for v in call.values():
        walk(v)
    return found


def all_rows() -> list[Row]:
    rows = []
    for fam in FAMILIES:
        rows += importlib.import_module(f"validation_rows.{fam}").ROWS
    return rows
