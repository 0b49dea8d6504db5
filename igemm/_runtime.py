"""Devices, streams, tensors, allocation and launch (cuda.core).

Tensors: torch tensors are read through their own attributes (``data_ptr``/``shape``/``stride``: a few
hundred ns, where a ``StridedMemoryView`` costs several µs and does not know bfloat16 without
ml_dtypes); every other device array (cupy, jax, numba, anything with DLPack or the CUDA array
interface) goes through ``cuda.core.utils.StridedMemoryView``. numpy arrays are host data: the GPU
backend copies them in and the results out.

Streams: an explicit ``stream=`` (cuda.core ``Stream``, ``torch.cuda.Stream``, cupy stream, any
``__cuda_stream__`` object or a raw ``CUstream`` int) wins; otherwise torch inputs run on torch's current
stream and cupy inputs on cupy's, so igemm calls order with the framework's own work.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from . import _build, _dlpack, _hostlaunch

__all__ = ["Tensor", "as_tensor", "array_kind", "is_foreign", "foreign_device", "dlpack_stream", "gpu_available",
           "get_backend", "set_backend", "DTYPE_SIZES", "DTYPE_CTYPE", "DeviceArray", "empty", "stream_for",
           "get_kernel", "device"]

DTYPE_SIZES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8,
               "uint32": 4, "uint8": 1, "int8": 1, "bool": 1}
DTYPE_CTYPE = {"float16": "cutlass::half_t", "bfloat16": "cutlass::bfloat16_t", "float32": "float",
               "int32": "int32_t", "int64": "int64_t", "uint32": "uint32_t"}
FLOAT_DTYPES = ("float16", "bfloat16", "float32")

_backend_override: str | None = None


# --------------------------------------------------------------------------------------------- backend
@lru_cache(maxsize=None)
def _gpu_probe() -> tuple[int, str]:
    """(number of visible CUDA devices, why none where it is 0)."""
    try:
        from cuda.bindings import driver
        (err,) = driver.cuInit(0)
        if int(err) != 0:
            return 0, f"cuInit failed ({err})"
        err, n = driver.cuDeviceGetCount()
        if int(err) != 0:
            return 0, f"cuDeviceGetCount failed ({err})"
        return int(n), "" if int(n) else "the CUDA driver sees no device"
    except Exception as e:
        return 0, f"the CUDA driver cannot be loaded ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


def _device_count() -> int:
    return _gpu_probe()[0]


def gpu_available() -> bool:
    """True when a CUDA device is visible and the GPU backend is not disabled."""
    return get_backend() == "cuda"


def get_backend() -> str:
    """``"cuda"`` or ``"numpy"``: ``set_backend`` > ``$IGEMM_BACKEND`` > cuda if a GPU is visible."""
    b = _backend_override or os.environ.get("IGEMM_BACKEND", "auto")
    if b == "auto":
        return "cuda" if _device_count() > 0 else "numpy"
    if b not in ("cuda", "numpy"):
        raise ValueError(f"IGEMM_BACKEND: must be 'auto', 'cuda' or 'numpy', got {b!r}")
    if b == "cuda" and _backend_override is None and _device_count() == 0:
        raise RuntimeError(f"IGEMM_BACKEND=cuda, but no CUDA GPU is visible: {_gpu_probe()[1]}")
    return b


def set_backend(name: str | None) -> None:
    """Force ``"cuda"`` or ``"numpy"`` (``None``/``"auto"`` restores the default).

    ``"cuda"`` where no GPU is visible raises RuntimeError at once (the backend is left unchanged)."""
    global _backend_override
    if name not in (None, "auto", "cuda", "numpy"):
        raise ValueError(f"backend must be 'auto', 'cuda' or 'numpy', got {name!r}")
    if name == "cuda" and _device_count() == 0:
        raise RuntimeError(f"set_backend('cuda'): no CUDA GPU is visible: {_gpu_probe()[1]}. "
                           f"Use set_backend('numpy') (or None) to run the float64 references instead")
    _backend_override = None if name in (None, "auto") else name


# --------------------------------------------------------------------------------------------- tensors
@dataclass
class Tensor:
    """What igemm needs of an array: its pointer, geometry, dtype and origin (``kind``)."""
    obj: object
    kind: str              # "torch" | "cupy" | "jax" | "numpy" | "other"
    ptr: int
    shape: tuple
    strides: tuple         # in elements
    dtype: str
    device_id: int         # -1 for host memory
    stream: int | None = None   # the producer's stream, where the array says (CUDA array interface v3)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    def is_contiguous(self) -> bool:
        if self.numel == 0:
            return True
        expect = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size != 1 and stride != expect:
                return False
            expect *= size
        return True

    def span(self) -> tuple[int, int]:
        """[lo, hi) byte range touched (for overlap checks)."""
        if self.numel == 0:
            return self.ptr, self.ptr
        hi = self.ptr + self.itemsize * (1 + sum((s - 1) * st for s, st in zip(self.shape, self.strides)))
        return self.ptr, hi


def contiguous_strides(shape) -> tuple:
    """Row-major strides, in elements."""
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= s
    return tuple(reversed(st))


def _np_dtype_name(dt) -> str:
    name = np.dtype(dt).name if not isinstance(dt, str) else dt
    return "bool" if name == "bool" else name


def array_kind(obj) -> str:
    """``"torch"``, ``"numpy"``, ``"cupy"``, ``"jax"``, ``"device"`` (igemm's DeviceArray), ``"foreign"`` (another
    DLPack or CUDA array interface producer) or ``"unknown"`` (not an array)."""
    if isinstance(obj, DeviceArray):
        return "device"
    if isinstance(obj, np.ndarray):
        return "numpy"
    mod = type(obj).__module__.split(".")[0]
    if mod == "torch":
        return "torch"
    if mod == "cupy" and hasattr(obj, "__cuda_array_interface__"):
        return "cupy"
    if mod in ("jax", "jaxlib") and hasattr(obj, "__dlpack__"):
        return "jax"
    if hasattr(obj, "__dlpack__") or hasattr(obj, "__cuda_array_interface__"):
        return "foreign"
    return "unknown"                # not an array: as_tensor refuses it, naming the argument


def is_foreign(obj) -> bool:
    """True for arrays read through cuda.core's StridedMemoryView (jax, DLPack, CUDA array interface):
    their view is made with the launch stream, so that the producer orders its work before it."""
    return array_kind(obj) in ("jax", "foreign")


def as_tensor(obj, name: str, stream_ptr: int = -1) -> Tensor:
    """Describe ``obj`` (torch/cupy/jax/numpy/DLPack/CAI array); raises TypeError naming ``name``.

    For jax and other DLPack / CUDA-array-interface producers, ``stream_ptr`` is the consumer (launch)
    stream the producer orders its pending writes before (DLPack ``__dlpack__(stream=...)``, CAI v3's
    ``stream``); ``-1`` (the default) describes the array without ordering anything."""
    kind = array_kind(obj)
    if kind == "device":
        return as_device_tensor(obj)
    if kind == "torch":
        import torch
        if not isinstance(obj, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(obj).__name__}")
        dev = obj.device
        if dev.type != "cuda":
            raise TypeError(f"{name}: a torch tensor on {dev} was given; igemm needs CUDA tensors "
                            f"(or numpy arrays, which it copies)")
        return Tensor(obj, "torch", obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()),
                      str(obj.dtype)[6:], dev.index if dev.index is not None else 0)
    if kind == "numpy":
        if obj.dtype.itemsize and any(s % obj.dtype.itemsize for s in obj.strides):
            raise ValueError(f"{name}: numpy strides {obj.strides} are not multiples of the item size")
        dtname = "bfloat16" if obj.dtype.name == "bfloat16" else _np_dtype_name(obj.dtype)
        return Tensor(obj, "numpy", obj.ctypes.data, obj.shape,
                      tuple(s // obj.dtype.itemsize for s in obj.strides) if obj.dtype.itemsize else obj.strides,
                      dtname, -1)
    if kind == "cupy":
        cai = obj.__cuda_array_interface__
        item = np.dtype(cai["typestr"]).itemsize
        strides = cai.get("strides")
        shape = tuple(cai["shape"])
        if strides is None:
            strides = contiguous_strides(shape)
        else:
            strides = tuple(s // item for s in strides)
        return Tensor(obj, "cupy", int(cai["data"][0]), shape, strides,
                      _np_dtype_name(np.dtype(cai["typestr"])), int(obj.device.id), cai.get("stream"))
    if stream_ptr == -1 and kind == "jax":
        stream_ptr = 1          # jax takes no -1 (no ordering): order the legacy stream, which costs nothing
    try:
        from cuda.core.utils import StridedMemoryView
        view = getattr(StridedMemoryView, "from_any_interface", StridedMemoryView)
        v = view(obj, stream_ptr=dlpack_stream(stream_ptr))
    except Exception as e:
        raise TypeError(f"{name}: expected a CUDA array (torch, cupy, jax, DLPack or CUDA array interface) "
                        f"or a numpy array, got {type(obj).__name__}") from e
    if not v.is_device_accessible:
        raise TypeError(f"{name}: a host array was given through DLPack; pass a numpy array or a CUDA array")
    shape = tuple(v.shape)
    strides = v.strides
    if strides is None:
        strides = contiguous_strides(shape)
    return Tensor(obj, "jax" if kind == "jax" else "other", int(v.ptr), shape, tuple(strides),
                  _np_dtype_name(v.dtype), int(v.device_id))


def foreign_device(obj, name: str) -> int:
    """The CUDA device of a jax/DLPack/CAI array, read without exporting it (``__dlpack_device__``) where
    it can be: the view itself waits for the launch stream."""
    get = getattr(obj, "__dlpack_device__", None)
    if get is not None:
        try:
            typ, dev = get()
        except Exception as e:
            raise TypeError(f"{name}: {type(obj).__name__}.__dlpack_device__() failed: {e}") from e
        if int(typ) in (2, 13):             # kDLCUDA, kDLCUDAManaged
            return int(dev)
        raise TypeError(f"{name}: a host array was given through DLPack; pass a numpy array or a CUDA array")
    return as_tensor(obj, name).device_id


def dlpack_stream(handle: int) -> int:
    """A launch stream handle as DLPack / StridedMemoryView take it: ``-1`` (no ordering) stays, the legacy
    default stream (0) is spelled 1."""
    return 1 if handle == 0 else handle


# --------------------------------------------------------------------------------------------- devices
_tls = threading.local()
_kernel_cache: dict = {}
_kernel_lock = threading.Lock()


def _ctx_api():
    """(cuCtxGetCurrent, cuCtxSetCurrent), or None where there is no CUDA driver (the numpy tier)."""
    global _CTX_API
    if _CTX_API is False:
        try:
            from cuda.bindings import driver
            driver.cuCtxGetCurrent()
            _CTX_API = (driver.cuCtxGetCurrent, driver.cuCtxSetCurrent)
        except Exception:
            _CTX_API = None
    return _CTX_API


_CTX_API = False


def _ctx_int(c) -> int:
    """A CUcontext as an int; cuCtxGetCurrent gives None before the driver is initialised: 0, no context."""
    return int(c) if c is not None else 0


def current_context() -> int:
    """The calling thread's current CUDA context as an int (0: none)."""
    if _hostlaunch.MOD is not None:                # (the C launch step's: no cuda.bindings object made)
        return _hostlaunch.MOD.ctx()
    api = _CTX_API if _CTX_API is not False else _ctx_api()
    return _ctx_int(api[0]()[1]) if api else 0


def device(device_id: int):
    """The cuda.core Device, with its primary context current on this thread.

    Callers leave the context current only for the duration of a public call: every public function's
    general path is wrapped in :func:`keeps_current_context`, which puts the caller's context (torch's current
    device) back, as a torch ``DeviceGuard`` does (the repeated-call paths of plans and function forms run only
    where the plan's context is already current, and change nothing). So the context found here is checked,
    not assumed."""
    devs = getattr(_tls, "devs", None)
    if devs is None:
        devs = _tls.devs = {}
    ent = devs.get(device_id)
    if ent is not None:
        if current_context() != ent[1]:
            ent[0].set_current()
        return ent[0]
    from cuda.core import Device
    d = Device(device_id)
    d.set_current()
    api = _ctx_api()
    devs[device_id] = (d, _ctx_int(api[0]()[1]) if api else -1)
    return d


def keeps_current_context(fn):
    """Decorator of the public entry points: the calling thread's current CUDA context (e.g. torch's
    current device) is the same after the call as before, whichever device the call ran on."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        api = _CTX_API if _CTX_API is not False else _ctx_api()
        if not api:
            return fn(*args, **kwargs)
        prev = current_context()            # (an int: through the C launch step where it is built)
        try:
            return fn(*args, **kwargs)
        finally:
            if current_context() != prev:   # no context before (a fresh thread): none after either
                from cuda.bindings import driver
                api[1](driver.CUcontext(prev))
    return wrapper


@lru_cache(maxsize=None)
def device_arch(device_id: int) -> str:
    d = device(device_id)
    cc = d.compute_capability
    return _build.arch_for((cc.major, cc.minor))


@lru_cache(maxsize=None)
def device_props(device_id: int):
    return device(device_id).properties


def get_kernel(stub: str, name: str, device_id: int, *, entry: str, smem: int = 0):
    """Compile (or fetch) ``stub`` for the device and return its cuda.core Kernel ``entry``, its dynamic
    shared memory limit raised to ``smem`` where that is over 48 KB."""
    arch = device_arch(device_id)
    key = (device_id, stub, entry)
    hit = _kernel_cache.get(key)           # (kernel, its dynamic shared memory limit)
    if hit is not None and smem <= hit[1]:
        device(device_id)     # launchers built from it take their function from the current context
        return hit[0]
    with _kernel_lock:
        hit = _kernel_cache.get(key)
        if hit is None:
            cubin, _ = _build.compile_cubin(stub, arch, name=name)
            device(device_id)
            from cuda.core import ObjectCode
            hit = (ObjectCode.from_cubin(cubin, name=name).get_kernel(entry), 48 * 1024)
        if smem > hit[1]:
            # (also one kernel launched with more than before: the patch kernel's size follows the problem)
            device(device_id)
            _set_max_dynamic_smem(hit[0], smem, device_id)
            hit = (hit[0], smem)
        _kernel_cache[key] = hit
        return hit[0]


def _set_max_dynamic_smem(kernel, nbytes: int, device_id: int) -> None:
    from cuda.bindings import driver
    h = kernel.handle
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    if isinstance(h, driver.CUkernel):
        err, dev = driver.cuDeviceGet(device_id)
        (err,) = driver.cuKernelSetAttribute(attr, nbytes, h, dev)
    else:
        (err,) = driver.cuFuncSetAttribute(h, attr, nbytes)
    if int(err) != 0:
        raise RuntimeError(f"could not raise the kernel's dynamic shared memory to {nbytes} bytes: {err}")


def stream_handle(stream, kind: str, device_id: int) -> int:
    """The raw ``CUstream`` for an explicit ``stream=`` or, if None, the framework's current stream
    (torch, cupy) or the legacy default stream (0)."""
    if stream is None:
        if kind == "torch":
            import torch
            try:
                return torch._C._cuda_getCurrentRawStream(device_id)
            except AttributeError:  # pragma: no cover - older torch
                return torch.cuda.current_stream(device_id).cuda_stream
        if kind == "cupy":
            import cupy
            return cupy.cuda.get_current_stream().ptr
        return 0
    if isinstance(stream, bool):
        raise TypeError("stream: expected a stream, got a bool")
    if isinstance(stream, int):
        return _raw_checked(stream, device_id)
    if hasattr(stream, "cuda_stream"):          # torch.cuda.Stream / ExternalStream
        dev = getattr(stream, "device", None)
        if dev is not None and getattr(dev, "index", None) is not None:
            _check_stream_device(int(dev.index), device_id)
        return int(stream.cuda_stream)
    if hasattr(stream, "__cuda_stream__"):      # cuda.core Stream and other protocol objects
        return _raw_checked(int(stream.__cuda_stream__()[1]), device_id)
    if hasattr(stream, "ptr"):                  # cupy.cuda.Stream
        if getattr(stream, "device_id", None) is not None:
            _check_stream_device(int(stream.device_id), device_id)
            return int(stream.ptr)
        return _raw_checked(int(stream.ptr), device_id)
    if hasattr(stream, "handle"):
        return _raw_checked(int(stream.handle), device_id)
    raise TypeError(f"stream: expected a cuda.core Stream, torch/cupy stream, __cuda_stream__ object or "
                    f"CUstream int, got {type(stream).__name__}")


def _raw_stream_device(h: int) -> int | None:
    """The device ordinal of a CUstream handle (None where the driver cannot tell)."""
    try:
        from cuda.bindings import driver
        err, dev = driver.cuStreamGetDevice(driver.CUstream(h))
    except Exception:                           # pragma: no cover - older driver / bindings
        return None
    return int(dev) if int(err) == 0 else None


def _raw_checked(h: int, device_id: int) -> int:
    """A raw CUstream handle, refused if the driver says it belongs to another device (the legacy and
    per-thread default streams, 0/1/2, belong to every device)."""
    if h not in (0, 1, 2):
        _check_stream_device(_raw_stream_device(h), device_id)
    return h


def _check_stream_device(stream_dev: int | None, device_id: int) -> None:
    if stream_dev is not None and device_id is not None and device_id >= 0 and stream_dev != device_id:
        raise ValueError(f"stream: belongs to cuda:{stream_dev} but the tensors are on cuda:{device_id}")


class RawStream:
    """A CUstream handle with the ``.handle`` attribute the memcpy helpers and launchers read."""
    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __int__(self) -> int:
        return self.handle


_core_streams: dict = {}


def core_stream(stream, device_id: int):
    """A cuda.core Stream for a RawStream / cuda.core Stream / None (the device's default stream)."""
    from cuda.core import Stream
    if stream is None:
        return device(device_id).default_stream
    if isinstance(stream, Stream):
        return stream
    h = int(stream.handle)
    s = _core_streams.get(h)
    if s is None:
        s = _core_streams[h] = device(device_id).default_stream if h == 0 else Stream.from_handle(h)
    return s


def stream_for(stream, kind: str, device_id: int) -> RawStream:
    """A stream object (``.handle`` is the raw CUstream) for ``stream=`` or the framework's current one."""
    return RawStream(stream_handle(stream, kind, device_id))


# --------------------------------------------------------------------------------------------- memory
class DeviceArray:
    """igemm's own device array: outputs for inputs that are neither torch, cupy nor jax arrays, and
    scratch memory.

    Exposes ``__dlpack__`` / ``__dlpack_device__`` (so ``torch.from_dlpack``, ``cupy.from_dlpack``,
    ``jax.dlpack.from_dlpack`` take it zero-copy, the memory kept alive while they hold it),
    ``__cuda_array_interface__`` (v3, with the stream it was written on) and ``.get()`` (to numpy).
    """

    def __init__(self, shape, dtype: str, device_id: int, stream=None):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.device_id = device_id
        n = int(np.prod(self.shape, dtype=np.int64)) * DTYPE_SIZES[dtype]
        dev = device(device_id)
        cs = core_stream(stream, device_id)
        self._buf = dev.allocate(max(n, 1), stream=cs)
        # the launch stream that writes it: consumers order after it
        self._stream = int(stream.handle) if isinstance(stream, RawStream) else int(cs.handle)
        self.ptr = int(self._buf.handle)
        self.nbytes = n

    @property
    def __cuda_array_interface__(self):
        typestr = {"bfloat16": "<V2"}.get(self.dtype) or np.dtype(self.dtype).str
        return {"shape": self.shape, "typestr": typestr, "data": (self.ptr, False), "version": 3,
                "strides": None, "stream": dlpack_stream(self._stream)}

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_dlpack.KDL_CUDA, self.device_id)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule of this array (no copy); ``stream`` (the consumer's) waits for its writes."""
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"__dlpack__: the array is on cuda:{self.device_id}, not {tuple(dl_device)}")
        if copy:
            raise BufferError("__dlpack__: igemm's DeviceArray is exported without a copy (copy=True refused)")
        consumer = _dlpack.consumer_stream(stream)
        if consumer is not None:
            device(self.device_id)
            _dlpack.order_after(self._stream, consumer)
        versioned = max_version is not None and tuple(max_version) >= (1, 0)
        return _dlpack.capsule(self, self.ptr, self.shape, contiguous_strides(self.shape), self.dtype,
                               self.device_id, versioned)

    def get(self, stream=None) -> np.ndarray:
        host_dtype = np.uint16 if self.dtype == "bfloat16" else np.dtype(self.dtype)
        out = np.empty(self.shape, dtype=host_dtype)
        if self.nbytes:
            memcpy_dtoh(out.ctypes.data, self.ptr, self.nbytes, stream)
        if self.dtype == "bfloat16":
            try:
                import ml_dtypes
                out = out.view(ml_dtypes.bfloat16)
            except ImportError:
                pass
        return out


def _check(err, what):
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")


def memcpy_htod(dst: int, src: int, nbytes: int, stream=None) -> None:
    from cuda.bindings import driver
    h = driver.CUstream(int(stream.handle) if stream is not None else 0)
    _check(driver.cuMemcpyHtoDAsync(dst, src, nbytes, h)[0], "cuMemcpyHtoDAsync")
    _check(driver.cuStreamSynchronize(h)[0], "cuStreamSynchronize")


def memcpy_dtoh(dst: int, src: int, nbytes: int, stream=None) -> None:
    from cuda.bindings import driver
    h = driver.CUstream(int(stream.handle) if stream is not None else 0)
    _check(driver.cuMemcpyDtoHAsync(dst, src, nbytes, h)[0], "cuMemcpyDtoHAsync")
    _check(driver.cuStreamSynchronize(h)[0], "cuStreamSynchronize")


def memset_d32_sync(ptr: int, value: int, count: int) -> None:
    from cuda.bindings import driver
    _check(driver.cuMemsetD32(ptr, value, count)[0], "cuMemsetD32")


def memset_d8(ptr: int, value: int, nbytes: int, stream) -> None:
    from cuda.bindings import driver
    _check(driver.cuMemsetD8Async(ptr, value, nbytes, driver.CUstream(int(stream.handle)))[0], "cuMemsetD8Async")


def to_device(t: Tensor, device_id: int, stream) -> tuple[Tensor, DeviceArray]:
    """Copy a numpy-backed Tensor to a fresh device array (contiguous)."""
    arr = np.ascontiguousarray(t.obj)
    d = DeviceArray(arr.shape, t.dtype, device_id, stream)
    if d.nbytes:
        memcpy_htod(d.ptr, arr.ctypes.data, d.nbytes, stream)
    return as_device_tensor(d), d


def as_device_tensor(d: DeviceArray) -> Tensor:
    return Tensor(d, "other", d.ptr, d.shape, contiguous_strides(d.shape), d.dtype, d.device_id, d._stream)


def empty(kind: str, like, shape, dtype: str, device_id: int, stream=None):
    """Allocate an output of the same framework as the inputs; returns ``(obj, Tensor)``."""
    if kind == "torch":
        import torch
        h = int(stream.handle) if stream is not None else None
        if h is not None and h != torch._C._cuda_getCurrentRawStream(device_id):
            # allocate on the launch stream, so torch's caching allocator orders reuse after the kernel
            with torch.cuda.stream(torch.cuda.ExternalStream(h, device=torch.device("cuda", device_id))):
                obj = torch.empty(shape, dtype=getattr(torch, dtype), device=f"cuda:{device_id}")
        else:
            obj = torch.empty(shape, dtype=getattr(torch, dtype), device=f"cuda:{device_id}")
        return obj, as_tensor(obj, "out")
    if kind == "cupy":
        import cupy
        with cupy.cuda.Device(device_id):
            obj = cupy.empty(shape, dtype=dtype)
        return obj, as_tensor(obj, "out")
    d = DeviceArray(shape, dtype, device_id, stream)
    return d, as_device_tensor(d)


def to_host_like(d: DeviceArray, stream) -> np.ndarray:
    return d.get(stream)
