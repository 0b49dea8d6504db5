"""The conv plan's launch path: one :class:`LaunchRecord` per kernel variant of a plan, built once, and one bind
step (:meth:`LaunchRecord.launch`) that every call takes, whichever way its tensors came in.

A record owns its argument buffer (every scalar, the split-K workspace, the TMA tensor maps written once), so a
call only writes the slots that change: x, w, y, residual, mask, the epilogue's vectors, and the tensor maps'
address words. :class:`TorchCall` holds what a call on torch tensors checks, precomputed, so that such calls
need no :class:`~igemm._dispatch.CallContext`.
"""
from __future__ import annotations

import math
import operator
import struct
import threading
import weakref

import numpy as np

from .. import _hostlaunch, _kernel, _runtime
from .._kernel import PackedArgs
from .._runtime import DTYPE_SIZES
from ._spec import KernelSpec

__all__ = ["LaunchRecord", "FoldedVectors", "DerivedCache", "TorchCall", "TwoPreps"]


class FoldedVectors:
    """An epilogue's per-channel fp32 vectors on the device: ``scale``, ``shift`` (the affine group), ``alpha``
    (a per-channel PReLU) as pointers (0 where absent), and a scalar PReLU's slope.

    torch CUDA vectors are folded with torch ops on their device, on the launch stream (no host
    synchronisation); anything else is folded on the host in float64 and uploaded (stream-ordered).
    ``device_id=None``: host (float64) only, for the numpy backend (:attr:`host`). ``snapshot``: a plan's
    vectors, which later in-place changes of the caller's tensors must not reach (a per-channel PReLU slope
    is copied; the folded scale and shift are new tensors anyway).
    """

    __slots__ = ("scale", "shift", "alpha", "alpha_scalar", "host", "_keep")

    def __init__(self, chain, K: int, device_id: int | None, stream: int = 0, snapshot: bool = True):
        self.scale = self.shift = self.alpha = 0
        self._keep: list = []
        pr = chain.prelu_op
        self.alpha_scalar = np.float32(pr.alpha if pr is not None and not pr.per_channel else 0.0)
        self.host = None
        if device_id is not None and chain.torch_foldable():
            self._fold_torch(chain, pr, K, device_id, stream, snapshot)
            return
        host = {}
        folded = chain.fold(K)
        if folded is not None:
            host["scale"], host["shift"] = folded
        if pr is not None and pr.per_channel:
            host["alpha"] = pr.alpha_vector()
        self.host = host
        if device_id is not None:
            rs = _runtime.RawStream(stream)
            for name, arr in host.items():
                d = _runtime.DeviceArray((K,), "float32", device_id, rs)   # stream-ordered on the launch stream
                a32 = np.ascontiguousarray(arr, dtype=np.float32)
                _runtime.memcpy_htod(d.ptr, a32.ctypes.data, a32.nbytes, rs)
                self._keep.append(d)
                setattr(self, name, d.ptr)

    def _fold_torch(self, chain, pr, K: int, device_id: int, stream: int, snapshot: bool) -> None:
        import torch
        dev = torch.device("cuda", device_id)

        def fold():
            folded = chain.fold_torch(K, dev)
            if folded is not None:
                self._set("scale", folded[0])
                self._set("shift", folded[1])
            if pr is not None and pr.per_channel:
                a = pr.alpha.float().contiguous().reshape(-1)
                self._set("alpha", a.clone() if snapshot and a.data_ptr() == pr.alpha.data_ptr() else a)
        if stream and stream != torch._C._cuda_getCurrentRawStream(device_id):
            with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=dev)):
                fold()
        else:
            fold()

    def _set(self, name: str, t) -> None:
        self._keep.append(t)
        setattr(self, name, t.data_ptr())


class DerivedCache:
    """Values derived from torch tensors (folded epilogue vectors, a weight's kernel view), kept while every source
    tensor is the same object at the same version counter (``_version`` counts in-place updates): an update is
    seen at the next call. A CUDA graph captured on a hit reads the kept values (it runs with the tensors as
    they were at capture); a miss during a capture is computed inside the graph and not kept (its values exist
    only at replays)."""

    def __init__(self, size: int = 512):
        self._d: dict = {}
        self._size = size
        self._lock = threading.Lock()

    def get(self, tag, tensors: tuple, make):
        """``make()``, or its value from an earlier call with the same ``tag`` on the same tensors (None
        allowed) at the same versions. A hit is C-level maps only (the repeated-call paths' host time:
        docs/performance.md: nn-fold-cache)."""
        ids = tuple(map(id, tensors))
        key = (tag, ids)
        e = self._d.get(key)
        if e is not None:
            try:
                stamp = tuple(map(_VERSION, tensors))
            except AttributeError:                          # (a None among them)
                stamp = _stamp(tensors)
            if e[0] == stamp:
                for r, t in zip(e[1], tensors):   # the same objects still: an id may be reused after a collection
                    if r() is not t:
                        break
                else:
                    return e[2]
        v = make()
        import torch
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return v
        with self._lock:
            if len(self._d) >= self._size:
                self._d.clear()
            self._d[key] = (_stamp(tensors), tuple(weakref.ref(t) if t is not None else _none for t in tensors),
                            v)
        return v


_VERSION = operator.attrgetter("_version")


def _none():
    return None


def _stamp(tensors) -> tuple:
    return tuple(t._version if t is not None else -1 for t in tensors)


class TwoPreps:
    """Two input preparations in a row (the NCHW patch path's transpose of x and unfold of w), with one
    preparation's interface: :meth:`steps`."""

    __slots__ = ("first", "second")

    def __init__(self, first, second):
        self.first, self.second = first, second

    def steps(self, x: int, w: int) -> list:
        return (self.first.steps(x, 0, (_kernel.SRC_X, _kernel.ZERO))
                + self.second.steps(0, w, (_kernel.ZERO, _kernel.SRC_W)))


class LaunchRecord:
    """One kernel variant of a plan, ready to launch (see the module doc).

    ``prep``: the preparation that copies x (and w) first (NCHW transpose, channel pad, width unfold), with the
    copies' addresses ``copy_x``/``copy_w`` the kernel reads instead (0: the caller's tensor). ``mask_after``:
    the chain writes a mask the epilogue cannot (it does not own whole words): a pack kernel runs after.

    A call's launches are this record's steps (:class:`igemm._kernel.Step`: the preparation's, then the
    conv's), made once per alignment of x and w (a preparation's variant depends on it) and packed for
    ``csrc/host/launch.c``, which binds and launches them in one call; where it is not built, :meth:`launch`
    runs the same steps through cuda.bindings.
    """

    __slots__ = ("spec", "launcher", "args", "f32", "slots", "maps", "workspace", "prep", "copy_x", "copy_w",
                 "mask_after", "numel_y", "dtype", "device_id", "_bound", "_folded", "_remap")

    def __init__(self, spec: KernelSpec, launcher: _kernel.Launcher, args: PackedArgs, maps, workspace, prep,
                 copy_x: int, copy_w: int, mask_after: bool, numel_y: int, dtype: str, device_id: int):
        self.spec, self.launcher, self.args, self.maps, self.workspace = spec, launcher, args, maps, workspace
        self.prep, self.copy_x, self.copy_w, self.mask_after = prep, copy_x, copy_w, mask_after
        self.numel_y, self.dtype, self.device_id = numel_y, dtype, device_id
        self.f32 = args.f32
        s = args.slots
        self.slots = (s["scale"], s["shift"], s["alpha"], 2 * s["alpha_scalar"])
        self._bound: dict = {}                     # (x % 16) | (w % 16) << 4 -> (packed record, steps)
        self._folded = None                        # the FoldedVectors whose slots the buffer holds
        self._remap = False                        # the maps hold no single address word: encoded per call

    def launch(self, stream: int, x: int, w: int, y: int, res: int, mask: int, folded: FoldedVectors,
               checked: bool = True) -> None:
        """The bind step and the launches (under the plan's lock). ``checked=False``: the caller has made sure
        the launcher's context is current."""
        if folded is not self._folded:
            self._write_folded(folded)
        b = self._bound.get((x & 15) | (w & 15) << 4)
        if b is None:
            b = self._bind(x, w)
        if checked:
            self.launcher.make_current()
        if self._remap:
            self.maps.write(self.args.u64, self.copy_x or x, self.copy_w or w, True)
        m = _hostlaunch.MOD
        if m is not None:
            err = m.launch(b[0], stream, x, w, y, res, mask)
            if err:
                raise _kernel.launch_error(err)
        else:
            vals = (0, x, w, y, res, mask)
            for launcher, u, binds, args in b[1]:
                for slot, src, base in binds:
                    u[slot] = base + vals[src]
                launcher.launch_current(stream, args)
        if self.mask_after and mask:
            from ..relu import launch_mask
            launch_mask(self.device_id, _runtime.RawStream(stream), self.dtype, y, mask, self.numel_y,
                        after_kernel=True)

    def _write_folded(self, folded: FoldedVectors) -> None:
        u, (ss, st, sa, saf) = self.args.u64, self.slots
        u[ss], u[st], u[sa] = folded.scale, folded.shift, folded.alpha
        self.f32[saf] = folded.alpha_scalar
        self._folded = folded                      # (held: no other object can take its id while it is bound)

    def steps(self, x: int, w: int) -> list:
        """The call's launch steps for x and w of these alignments (the first call also writes the tensor
        maps, whose address words later calls patch)."""
        Z, X, W = _kernel.ZERO, _kernel.SRC_X, _kernel.SRC_W
        sl = self.args.slots
        bx = (sl["x"], Z, self.copy_x) if self.copy_x else (sl["x"], X, 0)
        bw = (sl["w"], Z, self.copy_w) if self.copy_w else (sl["w"], W, 0)
        binds = [bx, bw, (sl["y"], _kernel.SRC_Y, 0), (sl["residual"], _kernel.SRC_RES, 0),
                 # (a statistics kernel's mask pointer is its statistics' buffer: KernelSpec.bn_stats)
                 (sl["ws" if self.spec.bn_stats else "mask"], _kernel.SRC_MASK, 0)]
        if self.maps is not None:
            xe, we = self.copy_x or x, self.copy_w or w
            self.maps.write(self.args.u64, xe, we, True)
            mw = self.maps.patch                   # (a word, its offset, b word, its offset), or None
            if mw is None:
                self._remap = True
            else:
                ia, oa, ib, ob = mw
                binds.append((ia, Z, oa + self.copy_x) if self.copy_x else (ia, X, oa))
                if ib is not None:
                    binds.append((ib, Z, ob + self.copy_w) if self.copy_w else (ib, W, ob))
        pre = self.prep.steps(x, w) if self.prep is not None else []
        return pre + [_kernel.Step(self.launcher, self.args, tuple(binds))]

    def _bind(self, x: int, w: int) -> tuple:
        steps = self.steps(x, w)
        b = self._bound[(x & 15) | (w & 15) << 4] = (
            pack_record(steps), [(s.launcher, memoryview(s.args.data), s.binds, s.args) for s in steps])
        return b


def pack_record(steps) -> bytes:
    """Steps as csrc/host/launch.c's launch record (its layout: that file's head comment)."""
    f = [len(steps)]
    for launcher, args, binds in steps:
        f += [launcher._fn, args.address, args.data.ctypes.data, *launcher.grid, *launcher.block, launcher.smem,
              len(binds)]
        for slot, src, base in binds:
            f += [slot, src, base]
    return struct.pack(f"<{len(f)}q", *f)


class TorchCall:
    """What a plan call on torch tensors checks, precomputed (every shape, byte extent and dtype is fixed by the
    plan). :meth:`pointers` returns the call's outputs and pointers, or None when anything is unusual: the
    general path then raises the precise error."""

    __slots__ = ("Tensor", "Parameter", "dtype", "res_dtype", "device", "device_index", "x_shape", "w_shape",
                 "y_shape", "y_nbytes", "x_nbytes", "w_nbytes", "res_nbytes", "mask_words", "int32", "stream_of",
                 "empty_like", "y_template", "mask_template", "want_mask", "residual_op", "patch_nhwc")

    def __init__(self, plan):
        import torch
        self.Tensor, self.Parameter = torch.Tensor, torch.nn.Parameter    # (a module's weight is a Parameter)
        self.dtype = getattr(torch, plan.dtype)
        rdt = plan.problem.residual_dtype
        self.res_dtype = getattr(torch, rdt) if rdt else None
        self.device = torch.device("cuda", plan.device_id)
        self.device_index = plan.device_id
        self.x_shape, self.w_shape = torch.Size(plan.x_shape), torch.Size(plan.w_shape)
        self.y_shape = torch.Size(plan.y_shape)
        es = DTYPE_SIZES[plan.dtype]
        self.y_nbytes = plan.numel_y * es
        self.res_nbytes = plan.numel_y * DTYPE_SIZES[rdt] if rdt else 0
        self.x_nbytes, self.w_nbytes = math.prod(plan.x_shape) * es, math.prod(plan.w_shape) * es
        self.mask_words = plan.mask_words
        self.int32 = torch.int32
        self.stream_of = torch._C._cuda_getCurrentRawStream
        self.empty_like = torch.empty_like
        self.y_template = self.mask_template = None      # (made at the first call that allocates)
        self.want_mask = plan.chain.mask
        self.residual_op = plan.chain.residual_op
        self.patch_nhwc = plan.path == "patch" and plan.problem.layout == "NHWC"

    def _templates(self) -> None:
        """empty_like of an expanded one-element tensor: the cheapest torch allocation of an output."""
        import torch
        self.y_template = torch.empty((1,) * 4, dtype=self.dtype, device=self.device).expand(self.y_shape)
        if self.want_mask:
            self.mask_template = torch.empty((1,), dtype=torch.int32, device=self.device).expand(self.mask_words)

    def _ok(self, t, dtype, shape) -> bool:
        return (type(t) is self.Tensor and t.dtype is dtype and t.get_device() == self.device_index
                and t.shape == shape and t.is_contiguous())

    def pointers(self, x, w, out, residual, mask_out):
        """``(y, mask, x, w, y, residual, mask pointers)`` or None."""
        T, P, dt = self.Tensor, self.Parameter, self.dtype
        if ((type(w) is not T and type(w) is not P) or x.dtype is not dt or w.dtype is not dt
                or x.get_device() != self.device_index or w.get_device() != self.device_index
                or x.shape != self.x_shape or w.shape != self.w_shape or not x.is_contiguous()
                or not w.is_contiguous()):
            return None
        if residual is None and self.residual_op is not None:
            residual = self.residual_op.residual
        if (residual is None) != (self.residual_op is None):
            return None
        xp, wp, rp = x.data_ptr(), w.data_ptr(), 0
        if xp % 16 and self.patch_nhwc:
            return None                            # (the general path hands it to the copy plan)
        extents = [(xp, self.x_nbytes), (wp, self.w_nbytes)]
        if residual is not None:
            if not self._ok(residual, self.res_dtype, self.y_shape):
                return None
            rp = residual.data_ptr()
            if rp % 16:
                return None
            extents.append((rp, self.res_nbytes))
        if out is None:
            if self.y_template is None:
                self._templates()
            out = self.empty_like(self.y_template)
            yp = out.data_ptr()
        else:
            if not self._ok(out, dt, self.y_shape):
                return None
            yp = out.data_ptr()
            if yp % 16 or not _apart(yp, self.y_nbytes, extents):
                return None
        mp = 0
        if self.want_mask:
            if mask_out is None:                   # (a fresh allocation overlaps nothing)
                if self.mask_template is None:
                    self._templates()
                mask_out = self.empty_like(self.mask_template)
                mp = mask_out.data_ptr()
            elif (type(mask_out) is not T or mask_out.dtype is not self.int32
                  or mask_out.get_device() != self.device_index or mask_out.dim() != 1
                  or mask_out.shape[0] < self.mask_words or not mask_out.is_contiguous()):
                return None
            else:
                mp = mask_out.data_ptr()
                if not _apart(mp, self.mask_words * 4, extents + [(yp, self.y_nbytes)]):
                    return None
        elif mask_out is not None:
            return None
        return out, mask_out, xp, wp, yp, rp, mp

    def fresh(self, x, w):
        """:meth:`pointers` of a call with no residual and fresh outputs whose x the caller's key has checked
        (shape, dtype, device; contiguous): the function forms' repeated calls (docs/performance.md:
        host-function-fresh)."""
        T = self.Tensor
        if ((type(w) is not T and type(w) is not self.Parameter) or w.dtype is not self.dtype
                or w.get_device() != self.device_index or w.shape != self.w_shape or not w.is_contiguous()
                or self.residual_op is not None):
            return None
        xp = x.data_ptr()
        if xp % 16 and self.patch_nhwc:
            return None
        if self.y_template is None:
            self._templates()
        y = self.empty_like(self.y_template)
        if self.want_mask:                         # (fresh allocations overlap nothing)
            m = self.empty_like(self.mask_template)
            return y, m, xp, w.data_ptr(), y.data_ptr(), 0, m.data_ptr()
        return y, None, xp, w.data_ptr(), y.data_ptr(), 0, 0


def _apart(p: int, n: int, extents) -> bool:
    """Whether bytes [p, p+n) overlap none of the (pointer, nbytes) extents."""
    for q, m in extents:
        if q < p + n and p < q + m:
            return False
    return True


def workspace(spec: KernelSpec, device_id: int, slots: int, partials: int, kt_per_split: int) -> tuple:
    """Partial fp32 tiles and ``slots`` int32 tickets/flags (zeroed once; the kernel leaves them zero).
    Split-K: a ticket per tile, a partial per tile and split; stream-K: a flag and a partial per CTA."""
    ws = _runtime.DeviceArray((partials * spec.bm * spec.bn,), "float32", device_id)
    cnt = _runtime.DeviceArray((slots,), "int32", device_id)
    _runtime.memset_d32_sync(cnt.ptr, 0, slots)
    return ws, cnt, kt_per_split
