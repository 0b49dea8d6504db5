"""DLPack export of igemm's own device allocations (:class:`igemm._runtime.DeviceArray`).

So that jax (and any DLPack consumer: torch, cupy, numba) can take igemm's outputs zero-copy, a
``DeviceArray`` answers ``__dlpack__`` with a capsule built here with ctypes: the DLPack 0.8 layout
(``"dltensor"``) or, when the consumer asks for ``max_version >= (1, 0)``, the 1.x one
(``"dltensor_versioned"``). cuda.core's ``StridedMemoryView.__dlpack__`` would do the same but cannot
export bfloat16.

Lifetime: every capsule holds a strong reference to its owner (the ``DeviceArray``, so its cuda.core
``Buffer``) in :data:`_live` until the consumer calls the deleter (or, if it never took the capsule, until
the capsule is destroyed); only then can the memory go back to the pool.
"""
from __future__ import annotations

import ctypes
import threading

__all__ = ["capsule", "dl_dtype", "consumer_stream", "same_stream", "order_after", "KDL_CUDA"]

KDL_CUDA = 2                   # DLDeviceType kDLCUDA
_CODES = {"int": 0, "uint": 1, "float": 2, "bfloat": 4, "bool": 6}
_DTYPES = {"float16": ("float", 16), "bfloat16": ("bfloat", 16), "float32": ("float", 32),
           "float64": ("float", 64), "int8": ("int", 8), "int32": ("int", 32), "int64": ("int", 64),
           "uint8": ("uint", 8), "uint32": ("uint", 32), "bool": ("bool", 8)}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]
_DLManagedTensorVersioned._fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                                      ("deleter", _Deleter), ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]

_NAME = b"dltensor"
_NAME_V = b"dltensor_versioned"
_live: dict = {}               # struct address -> (struct, shape, strides, owner)
_lock = threading.Lock()


def _release(addr: int) -> None:
    with _lock:
        _live.pop(addr, None)


@_Deleter
def _deleter(addr):            # called by the consumer when it is done with the tensor (any thread)
    _release(addr)


_PyCapsule_Destructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _capi(name: str, restype, *argtypes):
    """A private prototype of a C-API function (``ctypes.pythonapi``'s are shared with every other user)."""
    return ctypes.PYFUNCTYPE(restype, *argtypes)((name, ctypes.pythonapi))


_PyCapsule_New = _capi("PyCapsule_New", ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, _PyCapsule_Destructor)
_PyCapsule_IsValid = _capi("PyCapsule_IsValid", ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)
_PyCapsule_GetPointer = _capi("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)


def _destroy(cap, name: bytes) -> None:
    # a capsule still named "dltensor" was never consumed: the tensor is released with it
    if _PyCapsule_IsValid(cap, name):
        _release(_PyCapsule_GetPointer(cap, name))


_destructor = _PyCapsule_Destructor(lambda cap: _destroy(cap, _NAME))
_destructor_v = _PyCapsule_Destructor(lambda cap: _destroy(cap, _NAME_V))


def dl_dtype(dtype: str) -> tuple[int, int]:
    """DLPack ``(code, bits)`` of an igemm dtype name; BufferError for one DLPack cannot carry."""
    try:
        kind, bits = _DTYPES[dtype]
    except KeyError:
        raise BufferError(f"dtype {dtype} has no DLPack type") from None
    return _CODES[kind], bits


def capsule(owner, ptr: int, shape: tuple, strides: tuple, dtype: str, device_id: int,
            versioned: bool = False):
    """A DLPack capsule viewing ``ptr`` (``shape``, ``strides`` in elements, ``dtype``) on cuda:``device_id``;
    ``owner`` stays alive until the consumer releases the capsule."""
    code, bits = dl_dtype(dtype)
    n = len(shape)
    c_shape = (ctypes.c_int64 * max(n, 1))(*shape)
    c_strides = (ctypes.c_int64 * max(n, 1))(*strides)
    m = _DLManagedTensorVersioned() if versioned else _DLManagedTensor()
    t = m.dl_tensor
    t.data, t.device = ptr, _DLDevice(KDL_CUDA, device_id)
    t.ndim, t.dtype = n, _DLDataType(code, bits, 1)
    t.shape, t.strides, t.byte_offset = c_shape, c_strides, 0
    m.deleter = _deleter
    if versioned:
        m.version = _DLPackVersion(1, 0)
        m.flags = 0
    addr = ctypes.addressof(m)
    with _lock:
        _live[addr] = (m, c_shape, c_strides, owner)
    return _PyCapsule_New(addr, _NAME_V if versioned else _NAME, _destructor_v if versioned else _destructor)


def consumer_stream(stream) -> int | None:
    """The CUstream a DLPack consumer named in ``__dlpack__(stream=...)``: None for ``-1`` (no ordering
    wanted); ``None`` and ``1`` mean the legacy default stream, ``2`` the per-thread one (DLPack's CUDA
    rules; ``0`` is ambiguous and refused)."""
    if stream is None:
        return 1
    if isinstance(stream, bool) or not isinstance(stream, int):
        raise TypeError(f"__dlpack__: stream must be an int or None, got {type(stream).__name__}")
    if stream == -1:
        return None
    if stream == 0:
        raise ValueError("__dlpack__: stream=0 is ambiguous for CUDA; pass 1 (legacy default) or 2 (per-thread)")
    return stream


def _ok(err, what: str) -> None:
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")


def same_stream(a: int, b: int) -> bool:
    """Whether two raw CUstream handles name the same stream (0 and 1 are both the legacy default)."""
    return a == b or (a in (0, 1) and b in (0, 1))


def order_after(producer: int | None, consumer: int) -> None:
    """Make the ``consumer`` stream wait for the work queued so far on ``producer`` (raw CUstream handles in
    the current context; the legacy default stream may be spelled 0 or 1; None: nothing to wait for).
    What DLPack's ``__dlpack__(stream=...)`` and the CUDA array interface's ``stream`` ask of each side."""
    if producer is None or same_stream(producer, consumer):
        return
    p, c = (1 if producer == 0 else producer), (1 if consumer == 0 else consumer)
    from cuda.bindings import driver
    err, ev = driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    _ok(err, "cuEventCreate")
    try:
        _ok(driver.cuEventRecord(ev, driver.CUstream(p))[0], "cuEventRecord")
        _ok(driver.cuStreamWaitEvent(driver.CUstream(c), ev, 0)[0], "cuStreamWaitEvent")
    finally:
        driver.cuEventDestroy(ev)
