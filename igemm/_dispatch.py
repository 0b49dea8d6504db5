"""Where a call runs, and its tensors' way in and out.

Every public function builds a :class:`CallContext` from its array arguments:

* all numpy arrays and the numpy backend selected (no GPU, or ``IGEMM_BACKEND=numpy``) →
  ``ctx.backend == "numpy"``: the function runs its float64 reference (cast to the input dtype);
* otherwise ``"cuda"``: device arrays must all be on one device and of one framework; numpy arrays are
  copied to the device (and results back) only when *every* array argument is numpy;
* outputs are allocated as the inputs' framework (torch → torch, cupy → cupy, numpy → numpy).
"""
from __future__ import annotations

from . import _runtime
from ._checks import check_aligned, check_contiguous, check_dtype, check_no_overlap, check_shape  # noqa: F401
from ._runtime import Tensor, as_tensor

__all__ = ["CallContext"]


class CallContext:
    def __init__(self, arrays: dict, stream=None, *, device_id: int | None = None):
        self.views: dict[str, Tensor] = {}
        for name, obj in arrays.items():
            if obj is not None:
                self.views[name] = as_tensor(obj, name)
        kinds = {v.kind for v in self.views.values()}
        if not self.views:
            raise ValueError("no array arguments")
        self.host = kinds == {"numpy"}
        if "numpy" in kinds and not self.host:
            hosts = sorted(n for n, v in self.views.items() if v.kind == "numpy")
            devs = sorted(n for n, v in self.views.items() if v.kind != "numpy")
            raise TypeError(f"{', '.join(hosts)} host (numpy) but {', '.join(devs)} on the GPU: "
                            f"pass all arrays as CUDA tensors, or all as numpy arrays")
        if not self.host:
            ids = {v.device_id for v in self.views.values()}
            if len(ids) > 1:
                where = ", ".join(f"{n}: cuda:{v.device_id}" for n, v in self.views.items())
                raise ValueError(f"arrays are on different devices ({where})")
            fw = kinds - {"other"}
            self.kind = fw.pop() if len(fw) == 1 else ("other" if not fw else sorted(fw)[0])
            self.device_id = ids.pop()
            self.backend = "cuda"
        else:
            self.kind = "numpy"
            self.backend = _runtime.get_backend()
            self.device_id = device_id if device_id is not None else 0
        self._stream_arg = stream
        self._stream = None
        self._copies: list = []

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

    def finish(self, obj):
        """What the caller gets back for an output object made by :meth:`empty`."""
        if self.host:
            return obj.get(self.stream)
        return obj

    def copy_back(self, name: str, dev: Tensor) -> None:
        """For an in-place numpy argument run on the GPU: copy the device result into the numpy array."""
        v = self.views[name]
        if v.kind == "numpy":
            arr = v.obj
            host = dev.obj.get(self.stream)
            arr[...] = host.view(arr.dtype) if host.dtype != arr.dtype else host
