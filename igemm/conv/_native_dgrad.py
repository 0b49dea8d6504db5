"""dgrad's native kernel (csrc/conv/dgrad_sm90.cuh on grad_sm90.cuh's mainloops; the launch and spec machinery of
:mod:`._native`): 16-bit NHWC on sm_90a, dy and w read where they lie.

**dgrad.** Per output phase (``GradInputProblem.phases``; stride 1 has one), the stride-1 convolution of dy with the
phase's taps of the flipped filter: GEMM M = N x the phase's sub-output, N = C, reduction over taps x K (a k-tile =
one tap x 64 channels of dy). A = dy through an im2col map (the phase's padding and dilation), B = w as
[K][R·S][C] at the filter's tap, an MN-major operand: no filter move. Up to four phases are one launch (their tiles
one list of units; each phase a ``DgradPhase`` parameter and its own map of dy). The tile leaves asynchronously, by
a TMA store where the phase's rows are dx's (stride 1), else by a bulk copy a row into the phase's rows of dx (no
interleave); a zero phase is a memset of dx first, except where the one live phase's rows are the corners of dx's
stride blocks (a strided 1x1: ``fills_zeros``), whose copies also write the block's zeros.

Its masked twin (``mask=True``) is :mod:`._native`'s "The mask". Its sums twin (``sums=True``, name suffix ``_bs``;
the persistent kernel with TMA stores at two CTAs an SM: ``DgradSpec.has_sums_twin``), for the training path, also
writes per tile the BatchNorm backward's sums of the layer whose output gradient dx is (that layer's z, mask bits
and means loaded at the tile's start, summed after its store; docs/performance.md: bn-sums-in-dgrad).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .. import _runtime
from .._kernel import ParamSpec
from .._runtime import DTYPE_CTYPE, DTYPE_SIZES
from ..fastdiv import magic
from ._native import _Grid, _Launch, _m, _unsupported
from ._problem import ConvProblem
from ._tma import BK, _encode, _encode_im2col, _encode_mask_im2col, tma_unsupported

__all__ = ["DGRAD_PARAMS", "DGRAD_SUMS_PARAMS", "DgradSpec", "dgrad_unsupported", "choose_dgrad_spec", "tma_rows",
           "fills_zeros", "launch_values", "NativeDgrad", "dgrad_variants"]

#: dgrad's launch: what its phases share (tmY: dx as [N·H·W][C], the TMA store's map), then up to four phases
#: (heaviest first), each a 128-byte ``blob`` (``DgradPhase``: _PHASE_FIELDS) and its im2col map of dy
DGRAD_PARAMS = [ParamSpec("y", "ptr"),
                *(ParamSpec(n, "int32") for n in ("C", "S", "H", "W", "st_h", "st_w", "nph", "units")),
                ParamSpec("fd_KB", "fastdiv"), ParamSpec("tmB", "tmap"), ParamSpec("tmY", "tmap"),
                *(ParamSpec(f"f{i}", "blob") for i in range(4)), *(ParamSpec(f"tmA{i}", "tmap") for i in range(4)),
                *(ParamSpec(f"tmM{i}", "tmap") for i in range(4))]
#: the sums twin's (``DgradSpec.sums``): the layer before's z, ReLU mask and batch mean, where the sums go, and (bx
#: non-null) where its ReLU(BN(z)) goes, from its invstd, gamma and beta
DGRAD_SUMS_PARAMS = DGRAD_PARAMS + [ParamSpec(n, "ptr") for n in ("bz", "bmask", "bmean", "bsum", "bx", "binv",
                                                                    "bgamma", "bbeta")]
#: csrc/conv/dgrad_sm90.cuh's ``DgradPhase``, in order: int32 fields, then fast divisors (d, mul, shr)
_PHASE_FIELDS = ("M", "KT", "u0", "ph", "pw", "dh", "dw", "lh", "lw", "eh", "ew", "crop_h", "crop_w", "rows_h",
                 "rows_w", "ph_h", "ph_w")
_PHASE_DIVS = ("fd_PQ", "fd_Q", "fd_T")
MAX_PHASES = 4
_SUMS_SLOTS = ("bz", "bmask", "bmean", "bsum", "bx", "binv", "bgamma", "bbeta")   # NativeDgrad.launch's sums
#: DgradSpec.store -> (its kernel name's suffix, csrc/conv/grad_store.cuh's GradStore)
_STORES = {"tensor": ("_tma", 1), "rows": ("_rows", 2), "zeros": ("_zrows", 3)}


@dataclass(frozen=True)
class DgradSpec(_Grid):
    """The dgrad kernel's template arguments (``igemm::grad::dgrad<T, BM, BN, Stages, Ws, Add, Store, Mask[, Sums]>``;
    ``add``: its store adds into dx; ``store``: how the tile leaves its shared-memory C tile -- "tensor" (a TMA store
    of the tile, for one phase whose rows are dx's: :func:`tma_rows`), "rows" (a bulk copy a row, any phase) or
    "zeros" (as "rows", and each row copies zeros to the pixels beside it that no tap reaches: :func:`fills_zeros`))."""
    dtype: str
    bm: int
    bn: int
    stages: int
    ws: bool = False
    add: bool = False
    store: str = "rows"
    mask: bool = False  # dy read as bit ? dy : 0 (the forward's ReLU mask; docs/performance.md: grad-mask-registers)
    sums: bool = False  # the layer before's BatchNorm sums too (ws, "tensor"; docs/performance.md: bn-sums-in-dgrad)

    @property
    def _out(self) -> str:
        return self.dtype

    @property
    def _static(self) -> int:
        return self.bm * self.bn // 2 if self.sums else 0     # (float red[2][2·BM / 32][BN])

    @property
    def has_sums_twin(self) -> bool:
        """Whether this plain spec has a sums twin: the persistent kernel with TMA stores (stride 1) at two CTAs an
        SM, where one CTA's epilogue (the sums) runs beside the other's mainloop; at one CTA an SM the tensor cores
        wait for it, and the sums cost dgrad what they save the BatchNorm pass (bn-sums-in-dgrad)."""
        return (self.ws and self.store == "tensor" and not (self.add or self.mask or self.sums)
                and replace(self, sums=True).per_sm >= 2)

    @property
    def _mask_rows(self) -> int:
        return self.bm    # (a stage's mask rows: one a row of A)

    @property
    def _zero_row(self) -> int:
        return self.bn * DTYPE_SIZES[self.dtype] if self.store == "zeros" else 0   # (the copies' source)

    _include = "conv/dgrad_sm90.cuh"

    def name(self) -> str:
        return (f"dgrad_{self.dtype}_{self.bm}x{self.bn}_s{self.stages}{self._suffix()}{'_add' if self.add else ''}"
                f"{_STORES[self.store][0]}{_m(self.mask)}{'_bs' if self.sums else ''}")

    def stub(self) -> str:
        tail = f", {str(self.add).lower()}, {_STORES[self.store][1]}, {str(self.mask).lower()}"
        return self._render("dgrad", DGRAD_SUMS_PARAMS if self.sums else DGRAD_PARAMS,
                            f"{DTYPE_CTYPE[self.dtype]}, {self.bm}, {self.bn}", tail + (", true" if self.sums else ""))


def _sub(g, ph, dtype: str) -> ConvProblem:
    """A dgrad phase as a forward problem: dy (N, P, Q, K) convolved with the phase's taps (stride 1, the phase's
    padding and dilation) to its sub-output (``ph.h.out`` x ``ph.w.out``)."""
    return ConvProblem(g.N, g.K, g.P, g.Q, g.C, ph.h.taps, ph.w.taps, (1, 1), (ph.h.pad, ph.w.pad),
                       (ph.h.dil, ph.w.dil), dtype, "NHWC", "tensorop")


def dgrad_unsupported(g, dtype: str, layout: str, arch: str) -> str | None:
    """Why the native dgrad kernel cannot compute this problem (None: it can). ``g``: a ``GradInputProblem``."""
    why = _unsupported("dgrad", dtype, layout, arch, (
        (g.K % BK, f"K % {BK} == 0 (a k-tile is 64 channels of dy)"),
        (g.C % 8, "C % 8 == 0 (w's rows 16-byte aligned for its tensor map)"),
        (g.N * g.H * g.W == 0 or max(g.N * g.H * g.W * max(g.C, g.K), g.K * g.R * g.S * g.C) >= 2 ** 31,
         "a non-empty dx, and tensors under 2^31 elements (32-bit indices)")))
    for ph in g.phases:
        if why is None and not ph.zero:
            why = tma_unsupported(_sub(g, ph, dtype), 128)
    return why


def choose_dgrad_spec(g, dtype: str, sms: int) -> DgradSpec:
    """One kernel for every phase, chosen for the first launch's phases (docs/performance.md: dgrad-one-launch,
    dgrad-tma-store, dgrad-bulk-rows). The tile leaves by a TMA store where :func:`tma_rows` (stride 1, nothing
    cropped: the sub-output's rows are dx's), else by a bulk copy a row. Tiles, by C and the launch's 128 x 128 tiles
    t:
    - C <= 64: 128 x 64 tiles in the persistent kernel, 3 stages (two CTAs an SM);
    - t < SMs / 2, or a TMA store with C <= 128 and t < 2 SMs: 64 x 128 tiles in the persistent kernel, 6 stages;
    - a TMA store, or t >= 2 SMs (4 SMs where the launch has several phases, whose tiles differ in length): 128 x 128
      in the persistent kernel with 5 stages (the asynchronous store leaves the consumers to the next tile);
    - else per-tile 128 x 128 with 3 stages (two CTAs an SM: the hardware hands out the tiles as CTAs finish).
    Where :func:`fills_zeros`, the rows' copies also write dx's zeros (no memset first: dgrad-fill-zeros)."""
    return replace(_choose_tiles(g, dtype, sms), store="tensor" if tma_rows(g) else "zeros" if fills_zeros(g)
                   else "rows")


def _choose_tiles(g, dtype: str, sms: int) -> DgradSpec:
    if g.C <= 64:
        return DgradSpec(dtype, 128, 64, 3, True)
    live, tma = _live_phases(g)[:MAX_PHASES], tma_rows(g)    # (the first launch's phases)
    t128 = sum(-(-g.N * ph.h.out * ph.w.out // 128) for ph in live) * -(-g.C // 128)
    if 2 * t128 < sms or (tma and g.C <= 128 and t128 < 2 * sms):
        return DgradSpec(dtype, 64, 128, 6, True)
    if tma or t128 >= (2 if len(live) == 1 else 4) * sms:
        return DgradSpec(dtype, 128, 128, 5, True)
    return DgradSpec(dtype, 128, 128, 3)


def tma_rows(g) -> bool:
    """Whether dgrad's sub-output is dx itself, row for row (one phase, stride 1, nothing cropped): then its tiles
    leave by TMA stores into dx as a [N·H·W][C] matrix (dgrad-tma-store)."""
    live = _live_phases(g)
    if len(live) != 1 or tuple(g.stride) != (1, 1):
        return False
    h, w = live[0].h, live[0].w
    return h.crop == 0 and w.crop == 0 and (h.out, w.out) == (h.rows, w.rows) == (g.H, g.W)


def fills_zeros(g) -> bool:
    """Whether dgrad's one live phase is dx's pixels (st_h·i, st_w·j) for every i < ceil(H / st_h), j < ceil(W /
    st_w) and the other phases are zero (a strided 1x1 without padding): then each stored row's block of st_h x
    st_w pixels holds every zero once, and the rows' copies write them (dgrad-fill-zeros)."""
    live = _live_phases(g)
    if len(live) != 1 or len(g.phases) == 1:
        return False
    h, w = live[0].h, live[0].w
    return (h.ph, w.ph, h.crop, w.crop) == (0, 0, 0, 0) and (h.out, w.out) == (h.rows, w.rows) == (
        -(-g.H // g.stride[0]), -(-g.W // g.stride[1]))


def _live_phases(g) -> list:
    """The phases a tap reaches, heaviest (most taps) first: the order of their units in a launch."""
    return sorted((ph for ph in g.phases if not ph.zero), key=lambda ph: -ph.h.taps * ph.w.taps)


def _phase_bytes(values: dict) -> bytes:
    """One phase's ``DgradPhase`` (128 bytes)."""
    f = np.zeros(32, dtype=np.int32)
    f[:len(_PHASE_FIELDS)] = [values[n] for n in _PHASE_FIELDS]
    f[len(_PHASE_FIELDS):len(_PHASE_FIELDS) + 3 * len(_PHASE_DIVS)] = np.array(
        [v for n in _PHASE_DIVS for v in magic(values[n])], dtype=np.uint32).view(np.int32)
    return f.tobytes()


def launch_values(g, phases, bm: int, bn: int) -> dict:
    """One dgrad launch's values (DGRAD_PARAMS but the pointer and the maps) for up to four live phases: each phase's
    ``DgradPhase`` bytes (``f0``..) and its units after the previous phases' (``units``: all of them)."""
    kb = -(-g.K // BK)
    values = dict(C=g.C, S=g.S, H=g.H, W=g.W, st_h=g.stride[0], st_w=g.stride[1], nph=len(phases), fd_KB=kb)
    u0 = 0
    for i, ph in enumerate(phases):
        h, w = ph.h, ph.w
        m = g.N * h.out * w.out
        values[f"f{i}"] = _phase_bytes(dict(
            M=m, KT=h.taps * w.taps * kb, u0=u0, ph=h.pad, pw=w.pad, dh=h.dil, dw=w.dil, lh=h.last, lw=w.last,
            eh=h.step, ew=w.step, crop_h=h.crop, crop_w=w.crop, rows_h=h.rows, rows_w=w.rows, ph_h=h.ph, ph_w=w.ph,
            fd_PQ=h.out * w.out, fd_Q=w.out, fd_T=w.taps))
        u0 += -(-m // bm) * -(-g.C // bn)
    values["units"] = u0
    return values


class NativeDgrad:
    """The dgrad kernel for one problem: a launch per four live output phases (one at stride 1), after a memset of
    dx where a phase is zero; :meth:`launch` on raw pointers."""

    def __init__(self, g, dtype: str, device_id: int | None, sms: int, spec: DgradSpec | None = None):
        self.g, self.dtype, self.device_id, self.sms = g, dtype, device_id, sms
        self.spec = spec or choose_dgrad_spec(g, dtype, sms)
        if self.spec.store == "tensor" and not tma_rows(g):
            raise ValueError(f"{self.spec.name()}: a TMA store needs dx's rows to be the sub-output's")
        if self.spec.store == "zeros" and not fills_zeros(g):
            raise ValueError(f"{self.spec.name()}: the rows' copies write the zeros of a strided 1x1's dx only")
        self.zero = any(ph.zero for ph in g.phases)
        self._launches = {}                    # add -> a launch a group of live phases

    def kernels(self) -> list:
        """The plain kernel, its adding twin, its masked twin and (:attr:`sums_tiles`) its sums twin."""
        return [self._spec(False, False), self._spec(True, False), self._spec(False, True)] + (
            [self._spec(False, False, True)] if self.sums_tiles else [])

    def _spec(self, add: bool, mask: bool, sums: bool = False) -> DgradSpec:
        """The kernel of a launch (an adding one leaves the zeros as they are: "rows" for "zeros")."""
        s = replace(self.spec, add=add, mask=mask, sums=sums)
        return replace(s, store="rows") if add and s.store == "zeros" else s

    @property
    def sums_tiles(self) -> int:
        """The rows of BatchNorm sums :meth:`launch` writes with ``sums`` (its tiles of rows), or 0 where its spec has
        no sums twin (``DgradSpec.has_sums_twin``)."""
        s = self.spec
        if not s.has_sums_twin:
            return 0
        return launch_values(self.g, _live_phases(self.g), s.bm, s.bn)["units"] // -(-self.g.C // s.bn)

    def fuses_mask(self, mask: int) -> bool:
        """Whether :meth:`launch` applies a mask at ``mask`` itself: its maps' rows (a pixel's words) are 16-byte
        multiples, K % 128 == 0."""
        return self.g.K % 128 == 0 and mask % 16 == 0

    def _launch(self, phases, add: bool, mask: bool, sums: bool) -> _Launch:
        g = self.g
        s = self._spec(add, mask, sums)
        values = launch_values(g, phases, s.bm, s.bn)
        from cuda.bindings.driver import cuuint32_t as u32, cuuint64_t as u64
        maps = [(f"tmA{i}", lambda addr, pb=_sub(g, ph, self.dtype): _encode_im2col(pb, s.bm, addr), 0)
                for i, ph in enumerate(phases)]
        if mask:
            maps += [(f"tmM{i}", lambda addr, pb=_sub(g, ph, self.dtype): _encode_mask_im2col(pb, s.bm, addr), 3)
                     for i, ph in enumerate(phases)]
        rs, pb = g.R * g.S, _sub(g, phases[0], self.dtype)
        if s.store == "tensor":
            maps.append(("tmY", lambda addr: _encode(pb, "Tiled", (2, addr, [u64(g.C), u64(g.N * g.H * g.W)],
                                                                   [u64(g.C * 2)], [u32(64), u32(s.bm)],
                                                                   [u32(1), u32(1)]),
                                                     "CU_TENSOR_MAP_L2_PROMOTION_NONE"), 2))
        maps.append(("tmB", lambda addr: _encode(pb, "Tiled", (3, addr, [u64(g.C), u64(rs), u64(g.K)],
                                                               [u64(g.C * 2), u64(rs * g.C * 2)],
                                                               [u32(64), u32(1), u32(BK)], [u32(1)] * 3),
                                                 "CU_TENSOR_MAP_L2_PROMOTION_L2_256B"), 1))
        return _Launch(s, "igemm_dgrad", DGRAD_SUMS_PARAMS if sums else DGRAD_PARAMS, values,
                       s.grid(values["units"], self.sms), self.device_id, maps)

    def launch(self, h: int, dy: int, w: int, dx: int, add: bool = False, mask: int = 0, sums=None) -> None:
        """dx on stream ``h`` (``add``: dx += the gradient, rounded once after the sum as a separate add would be);
        dy and w 16-byte aligned; ``mask`` (0: none, else without ``add``): the forward's ReLU mask of dy, read in
        the kernel (:meth:`fuses_mask`). ``sums`` (None: none; neither ``add`` nor ``mask``, and
        :attr:`sums_tiles`): the pointers (z, mask or 0, mean, out[, x, invstd, gamma or 0, beta or 0]) of the layer
        before's BatchNorm, whose backward's sums the kernel writes to ``out`` as [2][sums_tiles][C] floats, and with
        ``x`` its ReLU(BN(z)) into x (csrc/conv/dgrad_sm90.cuh: DgradWork::sums, remake)."""
        key = (add, mask != 0, sums is not None)
        ks = self._launches.get(key)
        if ks is None:
            live = _live_phases(self.g)
            if key[2] and (add or mask or not self.sums_tiles or not (sums[0] and sums[2] and sums[3])):
                raise ValueError("sums: the plain kernel's where it has a sums twin (sums_tiles), without add or "
                                 "mask, with z, the means and the output")
            ks = [self._launch(live[i:i + MAX_PHASES], *key) for i in range(0, len(live), MAX_PHASES)]
            # (with the sums, each launch's slots of their pointers, looked up once)
            ks = self._launches[key] = [(k, tuple(k.args.slots[n] for n in _SUMS_SLOTS) if key[2] else ())
                                        for k in ks]
        if self.zero and not add and self.spec.store != "zeros":   # rows no tap reaches: zero at memset speed
            g = self.g
            _runtime.memset_d8(dx, 0, g.N * g.H * g.W * g.C * DTYPE_SIZES[self.dtype], _runtime.RawStream(h))
        for k, sl in ks:
            if sl:
                u = k.args.u64
                for i, ptr in zip(sl, (*sums, 0, 0, 0, 0)):
                    u[i] = ptr
            k(h, dy, w, dx, mask)


def dgrad_variants() -> list[tuple[str, str]]:
    """Every (name, stub) :func:`choose_dgrad_spec` and its twins can give (the tiles depend only on C and the
    launch's tile count)."""
    dts, ws = ("float16", "bfloat16"), ((128, 64, 3, True), (128, 128, 5, True), (64, 128, 6, True))
    return [DgradSpec(dt, *t, add, store, mask).kernel() for dt in dts
            for add, mask in ((False, False), (True, False), (False, True))
            for store in ("tensor", "rows") + (() if add else ("zeros",)) for t in ws + ((128, 128, 3, False),)] + \
        [replace(s, sums=True).kernel() for dt in dts for s in (DgradSpec(dt, *t, store="tensor") for t in ws)
         if s.has_sums_twin]
