"""The backward's operand moves (csrc/conv/backward.cuh: ``grad_copy``, ``grad_dz``, ``grad_coefficients``).

A :class:`Move` is one 4-D copy ``dst[i] = f(src[base + Σ (i_d + off_d)·ss_d])`` with zero outside the source
bounds: the filter flips of dgrad, its phase interleave, the activations' transposes of wgrad, the final dw
permute (with a dtype change and ``accumulate``), and the ReLU-mask / BN-backward prologue applied on the way.
:func:`launch_dz` is that prologue's pass for a channels-last 16-bit dy, at copy speed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

from .. import _kernel
from .._kernel import ParamSpec
from .._runtime import DTYPE_CTYPE, DTYPE_SIZES

__all__ = ["Move", "MODES", "launch_coefficients", "dz_fits", "dz_geometry", "launch_dz", "contiguous",
           "precompile", "all_variants"]

MODES = {"plain": 0, "mask": 1, "bn": 2}

_PARAMS = [*(ParamSpec(n, "ptr") for n in ("src", "dst", "mask", "z", "coef")),
           *(ParamSpec(f"d{i}", "int32") for i in range(4)),
           *(ParamSpec(f"off{i}", "int32") for i in range(4)),
           *(ParamSpec(f"lim{i}", "int32") for i in range(4)),
           *(ParamSpec(f"ss{i}", "int64") for i in range(4)), ParamSpec("base", "int64"),
           *(ParamSpec(f"ds{i}", "int64") for i in range(4)),
           ParamSpec("cdim", "int32"), ParamSpec("K", "int32"),
           *(ParamSpec(f"fd{i}", "fastdiv") for i in (1, 2, 3))]
_DZ_PARAMS = [*(ParamSpec(n, "ptr") for n in ("src", "dst", "mask", "z", "coef", "sel")), ParamSpec("M", "int64"),
              ParamSpec("K", "int32")]
_COEF_PARAMS = [*(ParamSpec(n, "ptr") for n in ("gamma", "invstd", "mean", "sum_dy", "sum_dy_xmu", "coef", "counts")),
                ParamSpec("K", "int32"), ParamSpec("count", "float32")]
_THREADS = 256


def contiguous(shape) -> tuple:
    """Element strides of a contiguous array of ``shape``."""
    st, acc = [], 1
    for n in reversed(tuple(shape)):
        st.append(acc)
        acc *= n
    return tuple(reversed(st))


@dataclass(frozen=True, eq=False)         # (hashed by identity: a plan keeps its moves, their packed arguments cached)
class Move:
    """One copy over the destination dims ``shape`` (``dst_strides``: its element strides). Source element of
    destination index i: ``base + Σ (i_d + off_d)·src_strides_d``, read only where every
    ``0 <= i_d + off_d < lim_d`` (else 0). ``tb``: the source's contiguous dim, for the tiled kernel (None: one
    element a thread); ``cdim``: the dim that indexes the BN prologue's channel vectors."""
    shape: tuple
    src_strides: tuple
    dst_strides: tuple
    off: tuple = (0, 0, 0, 0)
    lim: tuple | None = None        # None: the shape (no bounds beyond it)
    base: int = 0
    tb: int | None = None
    cdim: int = 0
    K: int = 0

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def _vector_layout(self) -> int:
        """The widest V (8, 4; 0: none) whose rows this move's shape, strides and bounds allow (grad_vector);
        the pointers' alignment is the call's to check."""
        lim = self.lim if self.lim is not None else self.shape
        if not (self.src_strides[3] == 1 and self.dst_strides[3] == 1 and self.off[3] == 0
                and lim[3] >= self.shape[3]):
            return 0
        for v in (8, 4):
            if (self.shape[3] % v == 0 and self.base % v == 0
                    and all(s % v == 0 for s in (*self.src_strides[:3], *self.dst_strides[:3]))):
                return v
        return 0

    def args(self, src: int, dst: int, mask: int = 0, z: int = 0, coef: int = 0, vec: int = 1) -> _kernel.PackedArgs:
        """The launch arguments: the move's own packed once (:func:`_template`), the pointers bound per call."""
        return _template(self, vec).bind({"src": src, "dst": dst, "mask": mask, "z": z, "coef": coef})

    def _values(self, vec: int) -> dict:
        v = {"base": self.base, "cdim": self.cdim, "K": self.K}
        lim = self.lim if self.lim is not None else self.shape
        for i in range(4):
            v.update({f"d{i}": self.shape[i], f"off{i}": self.off[i], f"lim{i}": lim[i],
                      f"ss{i}": self.src_strides[i], f"ds{i}": self.dst_strides[i]})
            if i:
                v[f"fd{i}"] = max(1, self.shape[i] // (vec if i == 3 and vec > 1 else 1))
        return v

    def vec(self, ts: str, td: str, src: int, dst: int, z: int = 0) -> int:
        """Elements a thread: 0 tiled (``tb``: 0 or 2), V > 1 where dim 3 is unit-stride and unbounded on both sides and
        every row starts 16-byte aligned (:func:`grad_vector`), else 1."""
        if self.tb is not None and self.tb != 3:
            assert self.tb in (0, 2), "the tiled kernel's source dim: 0 or 2"
            return 0
        v = 16 // max(DTYPE_SIZES[ts], DTYPE_SIZES[td])
        ok = (self._vector_layout >= v and (src + self.base * DTYPE_SIZES[ts]) % 16 == 0 and dst % 16 == 0
              and z % 16 == 0)
        return v if ok else 1

    def launcher(self, device_id: int, ts: str, td: str, vec: int, mode: str = "plain", accumulate: bool = False,
                 sms: int = 132) -> _kernel.Launcher:
        if vec == 0:           # x: the (dim tb, dim 3) tiles; y, z: the other two dims (grid-stride past 65535)
            s, tb = self.shape, self.tb
            o0, o1 = [d for d in range(3) if d != tb]
            grid = (-(-s[tb] // 32) * -(-s[3] // 32), min(s[o1], 65535), min(s[o0], 65535))
            block = (32, 8)
        else:
            grid, block = max(1, min(sms * 8, -(-self.numel // (_THREADS * vec)))), _THREADS
        return _launcher(ts, td, MODES[mode], bool(accumulate), vec, self.tb if vec == 0 else 0, device_id, grid,
                         block)

    def run_numpy(self, src, dst, *, mode: str = "plain", accumulate: bool = False, mask=None, z=None,
                  coef=None) -> None:
        """The same move on flat numpy arrays (float64 arithmetic; the CPU tests check the GPU's moves with it).
        ``dst`` is written through its flat view at the destination strides."""
        import numpy as np
        idx = np.indices(self.shape, dtype=np.int64).reshape(4, -1)
        lim = self.lim if self.lim is not None else self.shape
        j = idx + np.asarray(self.off, np.int64)[:, None]
        ok = np.all((j >= 0) & (j < np.asarray(lim, np.int64)[:, None]), axis=0)
        so = self.base + (j * np.asarray(self.src_strides, np.int64)[:, None]).sum(0)
        so = np.where(ok, so, 0)
        v = np.where(ok, np.asarray(src, np.float64).ravel()[so] if src is not None and np.asarray(src).size
                     else 0.0, 0.0)
        if mode != "plain" and mask is not None:
            bits = (np.asarray(mask).view(np.uint32)[so >> 5] >> (so & 31)) & 1
            v = np.where(ok & (bits == 1), v, 0.0)
        if mode == "bn":
            k = j[self.cdim]
            c = np.asarray(coef, np.float64).reshape(3, -1)
            zz = np.asarray(z, np.float64).ravel()[so]
            v = np.where(ok, c[0][np.where(ok, k, 0)] * v + c[1][np.where(ok, k, 0)] * zz
                         + c[2][np.where(ok, k, 0)], 0.0)
        do = (idx * np.asarray(self.dst_strides, np.int64)[:, None]).sum(0)
        flat = dst.reshape(-1)
        if accumulate:
            v = v + flat[do].astype(np.float64)
        flat[do] = v.astype(flat.dtype)

    def launch(self, device_id: int, stream: int, ts: str, td: str, src: int, dst: int, *, mode: str = "plain",
               accumulate: bool = False, mask: int = 0, z: int = 0, coef: int = 0, sms: int = 132) -> None:
        if self.numel:
            vec = self.vec(ts, td, src, dst, z)
            self.launcher(device_id, ts, td, vec, mode, accumulate, sms)(
                stream, self.args(src, dst, mask, z, coef, vec))


@lru_cache(maxsize=1024)
def _template(move: Move, vec: int) -> _kernel.PackedArgs:
    """A move's packed arguments, pointers zero (never written: ``bind`` fills a per-thread copy)."""
    return _kernel.pack_args(_PARAMS, move._values(vec))


def _stub(ts: str, td: str, mode: int, accumulate: bool, vec: int, tb: int) -> str:
    body = (f"igemm::backward::grad_copy<{mode}, {str(accumulate).lower()}, {vec}, {tb}, "
            f"{DTYPE_CTYPE[ts]}, {DTYPE_CTYPE[td]}>(p);")
    return _kernel.render_kernel(include="conv/backward.cuh", entry="igemm_grad_copy", params=_PARAMS,
                                 threads=_THREADS, body=body)


def _name(ts: str, td: str, mode: int, accumulate: bool, vec: int, tb: int) -> str:
    return f"grad_copy_{ts}_{td}_m{mode}{'_acc' if accumulate else ''}_" + (f"t{tb}" if vec == 0 else f"v{vec}")


@lru_cache(maxsize=512)
def _launcher(ts, td, mode, accumulate, vec, tb, device_id, grid, block):
    k = _kernel.load(_stub(ts, td, mode, accumulate, vec, tb), _name(ts, td, mode, accumulate, vec, tb),
                     "igemm_grad_copy", device_id)
    return _kernel.Launcher(k, grid, block)


def _coef_stub() -> str:
    return _kernel.render_kernel(include="conv/backward.cuh", entry="igemm_grad_coefficients", params=_COEF_PARAMS,
                                 threads=_THREADS, body="igemm::backward::grad_coefficients(p);")


@lru_cache(maxsize=64)
def _coef_launcher(device_id: int, grid: int):
    k = _kernel.load(_coef_stub(), "grad_coefficients", "igemm_grad_coefficients", device_id)
    return _kernel.Launcher(k, grid, _THREADS)


@lru_cache(maxsize=256)
def _coef_template(K: int, count: float) -> _kernel.PackedArgs:
    """The coefficient kernel's packed arguments for (K, count), pointers zero (``bind`` fills a copy)."""
    return _kernel.pack_args(_COEF_PARAMS, dict(K=K, count=count))


def launch_coefficients(device_id: int, stream: int, K: int, count: int, *, gamma: int, invstd: int, mean: int,
                        sum_dy: int, sum_dy_xmu: int, coef: int, counts: int = 0) -> None:
    """coef[3, K] = [a; b; c] of the BN-backward prologue (csrc/conv/backward.cuh: grad_coefficients); ``counts``:
    a device pointer to the values per channel (fp32 [K]) instead of ``count``."""
    _coef_launcher(device_id, -(-K // _THREADS))(stream, _coef_template(K, float(count)).bind(dict(
        gamma=gamma, invstd=invstd, mean=mean, sum_dy=sum_dy, sum_dy_xmu=sum_dy_xmu, coef=coef, counts=counts)))


def _dz_stub(dtype: str, mode: int) -> str:
    return _kernel.render_kernel(include="conv/backward.cuh", entry="igemm_grad_dz", params=_DZ_PARAMS,
                                 threads=_THREADS, body=f"igemm::backward::grad_dz<{mode}, {DTYPE_CTYPE[dtype]}>(p);")


@lru_cache(maxsize=64)
def _dz_launcher(dtype: str, mode: int, device_id: int, grid: int, block: int):
    k = _kernel.load(_dz_stub(dtype, mode), f"grad_dz_{dtype}_m{mode}", "igemm_grad_dz", device_id)
    return _kernel.Launcher(k, grid, block)


@lru_cache(maxsize=256)
def _dz_template(M: int, K: int) -> _kernel.PackedArgs:
    return _kernel.pack_args(_DZ_PARAMS, dict(M=M, K=K))


def dz_fits(dtype: str, K: int, *ptrs: int) -> bool:
    """Whether :func:`launch_dz` takes this pass: 16-bit, K % 8 == 0 and K <= 2048 (a block's threads cover whole
    rows), every pointer 16-byte aligned (0: absent)."""
    return DTYPE_SIZES[dtype] == 2 and K % 8 == 0 and 0 < K <= 8 * _THREADS and not any(p % 16 for p in ptrs)


def launch_dz(device_id: int, stream: int, dtype: str, M: int, K: int, src: int, dst: int, *, mode: str,
              mask: int = 0, z: int = 0, coef: int = 0, sel: int = 0, sms: int = 132) -> None:
    """dz (and, with ``sel``, the select ``bit ? dy : 0``) of a channels-last dy as M pixels x K channels, the
    mask / BN prologue applied (csrc/conv/backward.cuh: grad_dz); the caller checked :func:`dz_fits`. One wave of
    blocks, each a multiple of K / 8 threads (a thread's channels fixed)."""
    grid, block = dz_geometry(M, K, sms)
    _dz_launcher(dtype, MODES[mode], device_id, grid, block)(stream, _dz_template(M, K).bind(dict(
        src=src, dst=dst, mask=mask, z=z, coef=coef, sel=sel)))


def dz_geometry(M: int, K: int, sms: int) -> tuple[int, int]:
    """(grid, block) of the dz pass: blocks of a multiple of K / 8 threads (so every thread's 8-channel chunk is the
    same at each of its pixels), at most one wave of 2048 threads an SM, none without a pixel."""
    kc = K // 8
    block = kc * (_THREADS // kc)
    return max(1, min(sms * max(1, 2048 // block), -(-M * kc // block))), block


def all_variants() -> list[tuple[str, str]]:
    """Every (name, stub) the backward's moves can launch: plain moves between any two types (accumulating
    into fp32), the mask / BN modes within one type; tiled, one element or 16 bytes a thread; the dz pass; the flat
    fp32 -> 16-bit cast."""
    out = [("grad_coefficients", _coef_stub())]
    out += [(f"grad_dz_{dt}_m{m}", _dz_stub(dt, m)) for dt in ("float16", "bfloat16") for m in (1, 2)]
    dts = ("float16", "bfloat16", "float32")
    for ts in dts:
        for td in dts:
            for mode in MODES.values():
                for acc in (False, True):
                    if (td != ts and td != "float32") or (mode and (acc or td != ts)):
                        continue
                    for vec, tb in ((0, 0), (0, 2), (1, 0), (16 // max(DTYPE_SIZES[ts], DTYPE_SIZES[td]), 0)):
                        out.append((_name(ts, td, mode, acc, vec, tb), _stub(ts, td, mode, acc, vec, tb)))
    # fp32 into 16 bits, flat: the training forward's cast of autocast's master weight (nn/_train_call.py)
    out += [(_name("float32", td, 0, False, vec, 0), _stub("float32", td, 0, False, vec, 0))
            for td in ("float16", "bfloat16") for vec in (1, 4)]
    return out


def precompile(arch: str, jobs: int | None = None) -> int:
    """Compile every move kernel for ``arch`` (dev machine: fills the kernel cache)."""
    from .. import _build
    return _build.compile_many(all_variants(), arch, jobs)
