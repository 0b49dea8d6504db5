"""Where a call runs, and its tensors' way in and out.

Every public function builds a :class:`CallContext` from its array arguments:

* all numpy arrays and the numpy backend selected (no GPU, or ``IGEMM_BACKEND=numpy``) →
  ``ctx.backend == "numpy"``: the function runs its float64 reference (cast to the input dtype);
* otherwise ``"cuda"``: device arrays must all be on one device and of one framework; numpy arrays are
  copied to the device (and results back) only when *every* array argument is numpy;
* the launch stream: ``stream=`` if given, else the framework's current stream (torch, cupy), else the
  legacy default stream;
* producers are ordered before the launch as each array's protocol says: jax and other DLPack producers
  through ``__dlpack__(stream=<launch stream>)``, cupy (and any CUDA array interface v3 producer, igemm's
  own DeviceArray included) through the interface's ``stream``: the launch stream waits for it. torch
  tensors carry no stream: torch's rule holds (the current stream is the producer's; with another
  ``stream=``, order it yourself, e.g. ``s.wait_stream(torch.cuda.current_stream())``);
* outputs are allocated as the inputs' framework (torch → torch, cupy → cupy, jax → jax through DLPack,
  numpy → numpy; any other producer → igemm's DeviceArray, which exposes ``__dlpack__``).
"""
from __future__ import annotations

from . import _dlpack, _runtime
from ._runtime import Tensor, as_tensor

__all__ = ["CallContext"]


class CallContext:
    """One call's arrays (``views``: name → Tensor), backend, device, framework ``kind`` and launch stream."""

    def __init__(self, arrays: dict, stream=None, *, device_id: int | None = None):
        self.views: dict[str, Tensor] = {}
        foreign: dict = {}                 # jax / DLPack / CAI arrays: viewed once the launch stream is known
        for name, obj in arrays.items():
            if obj is None:
                continue
            if _runtime.is_foreign(obj):
                foreign[name] = obj
            else:
                self.views[name] = as_tensor(obj, name)
        if not self.views and not foreign:
            raise ValueError("no array arguments")
        kinds = {v.kind for v in self.views.values()}
        if foreign:
            kinds |= {_runtime.array_kind(o) for o in foreign.values()}
            kinds = {k if k != "foreign" else "other" for k in kinds}
        self.host = kinds == {"numpy"}
        if "numpy" in kinds and not self.host:
            hosts = sorted(n for n, v in self.views.items() if v.kind == "numpy")
            devs = sorted([n for n, v in self.views.items() if v.kind != "numpy"] + list(foreign))
            raise TypeError(f"{', '.join(hosts)} host (numpy) but {', '.join(devs)} on the GPU: "
                            f"pass all arrays as CUDA tensors, or all as numpy arrays")
        self._stream_arg = stream
        self._stream = None
        self._copies: list = []
        if not self.host:
            devices = {n: v.device_id for n, v in self.views.items()}
            devices.update({n: _runtime.foreign_device(o, n) for n, o in foreign.items()})
            ids = set(devices.values())
            if len(ids) > 1:
                where = ", ".join(f"{n}: cuda:{d}" for n, d in devices.items())
                raise ValueError(f"arrays are on different devices ({where})")
            fw = kinds - {"other"}
            self.kind = fw.pop() if len(fw) == 1 else ("other" if not fw else sorted(fw)[0])
            self.device_id = ids.pop()
            self.backend = "cuda"
            self._order_producers(arrays, foreign)
        else:
            self.kind = "numpy"
            self.backend = _runtime.get_backend()
            self.device_id = device_id if device_id is not None else 0

    def _order_producers(self, arrays: dict, foreign: dict) -> None:
        """Views of the foreign arrays made with the launch stream (their producers order themselves
        before it); the launch stream waits for the stream a CUDA array interface names."""
        waits = {v.stream for v in self.views.values() if v.stream is not None}
        if not foreign and not waits:
            return
        launch = self.stream.handle
        waits = {p for p in waits if not _dlpack.same_stream(p, launch)}
        if foreign or waits:
            _runtime.device(self.device_id)
        for name, obj in foreign.items():
            self.views[name] = as_tensor(obj, name, stream_ptr=launch)
        if foreign:
            self.views = {n: self.views[n] for n in arrays if n in self.views}   # the arguments' order
        for producer in waits:
            _dlpack.order_after(producer, launch)

    # -- cuda side --------------------------------------------------------------------------------
    @property
    def stream(self):
        if self._stream is None:
            kind = self.kind if self.kind in ("torch", "cupy") else "other"
            self._stream = _runtime.stream_for(self._stream_arg, kind, self.device_id)
        return self._stream

    def device_view(self, name: str) -> Tensor:
        """The argument on the device (numpy arrays are copied in, contiguous)."""
        v = self.views[name]
        if v.kind != "numpy":
            return v
        _runtime.device(self.device_id)
        dv, keep = _runtime.to_device(v, self.device_id, self.stream)
        self._copies.append(keep)
        return dv

    def empty(self, shape, dtype: str, name: str = "out"):
        """A fresh output; returns (object to hand back, device Tensor)."""
        kind = self.kind if self.kind in ("torch", "cupy") else "other"
        obj, t = _runtime.empty(kind, None, tuple(shape), dtype, self.device_id, self.stream)
        return obj, t

    def workspace(self, shape, dtype: str):
        """Scratch memory freed in order with the launches: the framework's allocator on its current stream; a
        stream-ordered allocation on an explicit ``stream=`` (the framework would not order it with that one).
        Returns (object to keep alive, device Tensor)."""
        if self._stream_arg is None:
            return self.empty(shape, dtype, name="workspace")
        d = _runtime.DeviceArray(shape, dtype, self.device_id, self.stream)
        return d, _runtime.as_device_tensor(d)

    def finish(self, obj):
        """What the caller gets back for an output object made by :meth:`empty`: a numpy array for numpy
        inputs, a jax array (zero-copy, through DLPack) for jax inputs, else ``obj`` itself."""
        if self.host:
            return obj.get(self.stream)
        if self.kind == "jax":
            import jax.dlpack
            return jax.dlpack.from_dlpack(obj)
        return obj

    def copy_back(self, name: str, dev: Tensor) -> None:
        """For an in-place numpy argument run on the GPU: copy the device result into the numpy array."""
        v = self.views[name]
        if v.kind == "numpy":
            arr = v.obj
            host = dev.obj.get(self.stream)
            arr[...] = host.view(arr.dtype) if host.dtype != arr.dtype else host
