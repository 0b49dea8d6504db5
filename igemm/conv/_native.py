"""The backward's native kernels (csrc/conv/grad_sm90.cuh, dgrad_sm90.cuh): 16-bit NHWC on sm_90a, every operand read
where it lies: wgrad here, dgrad in :mod:`._native_dgrad` (on this module's launch and spec machinery).

**wgrad.** The weight gradient, read from x and dy in place.

GEMM ``dw[k, (r, s, c)] = Σ_(n,p,q) dy[n, p, q, k] · x[n, p·st_h + r·dil_h − pad_h, q·st_w + s·dil_w − pad_w, c]``
with M = K, N = R·S·C and the reduction over the N·P·Q output pixels, 64 a k-tile. A k-tile is two kinds of TMA
copy: dy's [N·P·Q][K] rows (a tiled map) and the forward's own im2col copy of x at one tap
(zeros outside the image are the padding); both land channels-contiguous and are multiplied as MN-major wgmma
operands. No operand is moved. The reduction splits over ``splits`` CTAs a tile; each split stores its fp32
partial tile and ``split_sum`` adds them in split order (deterministic) into dw, in its dtype or into an fp32
``out`` (``accumulate``). With one split and no accumulation the kernel stores dw itself.

**The mask.** Each kernel has a masked twin (``mask=True``, name suffix ``_m``) that reads dy as ``bit ? dy : 0``
with the forward's ReLU mask (docs/performance.md: grad-mask-registers): a stage also brings the mask words of its
A rows (a TMA map of the mask as uint32 words, 16 bytes a row: dgrad an im2col map row for row with dy's, wgrad a
tiled one), and the consumers load A's fragments into registers, AND them with their bits and multiply with A from
registers. The maps need a pixel's words in 16-byte multiples (K % 128 == 0: ``fuses_mask``); elsewhere the plans
form dz first.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .. import _kernel, _runtime
from .._kernel import ParamSpec
from .._runtime import DTYPE_CTYPE, DTYPE_SIZES
from ._problem import ConvProblem, split_by_cost
from ._tma import BK, MapTemplate, _encode, _encode_im2col, tma_unsupported

__all__ = ["WGRAD_PARAMS", "WgradSpec", "unsupported", "choose_spec", "NativeWgrad", "all_variants"]

#: the native kernel's launch parameters, in order (the stub is rendered from them)
WGRAD_PARAMS = [ParamSpec("y", "ptr"), *(ParamSpec(n, "int32") for n in ("M", "Ncol", "NPQ", "kt_per_split", "splits",
                                                                         "sh", "sw", "ph", "pw", "dh", "dw")),
                *(ParamSpec(n, "fastdiv") for n in ("fd_PQ", "fd_Q", "fd_C", "fd_S")),
                ParamSpec("tmA", "tmap"), ParamSpec("tmB", "tmap"), ParamSpec("tmM", "tmap")]
_SUM_PARAMS = [ParamSpec("src", "ptr"), ParamSpec("dst", "ptr"), ParamSpec("n", "int64"), ParamSpec("splits", "int32")]
_THREADS = 256
#: the persistent wgrad kernel's (BM, BN, stages), as :func:`choose_spec` gives them (and the NCHW 1x1 kernel's)
WS_TILES = ((128, 64, 4), (128, 128, 4), (128, 64, 6), (64, 64, 8), (64, 128, 6))
_SM_SMEM = 233472                       # shared memory an sm_90 SM holds (228 KB); a CTA reserves 1 KB of it


class _Grid:
    """What the wgrad and dgrad specs share: threads, shared memory and the grid of their kernel (``ws``: the
    persistent warp-specialised form, grad_ws, with a producer warp and its own C tile; else a CTA a unit), and
    their stub (``igemm::grad::<op><targs, Stages, Ws>``)."""

    @property
    def threads(self) -> int:
        return self.bm * 2 + (32 if self.ws else 0)     # a warpgroup per 64 rows (and grad_ws's producer warp)

    @property
    def smem(self) -> int:
        """Dynamic shared memory: the stages (with their mask rows), grad_ws's C tile, dgrad's zeros and the
        1024-byte alignment."""
        ctile = self.bm * (self.bn + 16 // DTYPE_SIZES[self._out]) * DTYPE_SIZES[self._out] if self.ws else 0
        return self.stages * ((self.bm + self.bn) * BK * 2 + self._mask_rows * 16 * self.mask) + ctile + \
            self._zero_row + 1024

    @property
    def per_sm(self) -> int:
        """CTAs an SM's shared memory holds (its dynamic and static bytes, and the 1 KB a CTA reserves)."""
        return _SM_SMEM // (self.smem + self._static + 1024)

    def grid(self, units: int, sms: int) -> int:
        """CTAs for ``units`` units: one each, or (ws) as many as stay resident at once, at most one a unit."""
        return min(units, max(1, self.per_sm) * sms) if self.ws else units

    _static = 0           # (static shared memory past the 1 KB a CTA reserves: the dgrad sums' reduction)

    _zero_row = 0         # (dgrad's "zeros" store: BN zeros in shared memory)
    _include = "conv/grad_sm90.cuh"

    def _suffix(self) -> str:
        return "_ws" if self.ws else ""

    def _render(self, op: str, params, targs: str, tail: str = "") -> str:
        targs = f"{targs}, {self.stages}, {str(self.ws).lower()}{tail}"
        # a masked twin (A's fragments in registers) or a sums twin keeps its plain twin's CTAs an SM where shared
        # memory holds two
        blocks = min(2, self.per_sm) if self.mask or self._static else 1
        return _kernel.render_kernel(include=self._include, entry=f"igemm_{op}", params=params,
                                     threads=self.threads, min_blocks=blocks, body=f"igemm::grad::{op}<{targs}>(p);")

    def kernel(self, x_aligned: bool = True, w_aligned: bool = True) -> tuple[str, str]:
        """``(name, source)``, as the forward plans give theirs to the precompile tools."""
        return self.name(), self.stub()


@dataclass(frozen=True)
class WgradSpec(_Grid):
    """The wgrad kernel's template arguments (``igemm::grad::wgrad<T, TO, BM, BN, Stages, Ws>``) and its split of
    the reduction (a launch value)."""
    dtype: str
    out: str            # what the kernel stores: dw's dtype (one split, no accumulation) or fp32 partials
    bm: int
    bn: int
    stages: int
    splits: int = 1
    ws: bool = False
    mask: bool = False  # dy read as bit ? dy : 0 (the forward's ReLU mask; docs/performance.md: grad-mask-registers)

    @property
    def _out(self) -> str:
        return self.out

    _mask_rows = BK       # (a stage's mask rows: one a pixel of the k-tile)

    def name(self) -> str:
        return f"wgrad_{self.dtype}_{self.bm}x{self.bn}_s{self.stages}_{self.out}{self._suffix()}{_m(self.mask)}"

    def stub(self) -> str:
        return self._render("wgrad", WGRAD_PARAMS,
                            f"{DTYPE_CTYPE[self.dtype]}, {DTYPE_CTYPE[self.out]}, {self.bm}, {self.bn}",
                            f", {str(self.mask).lower()}")


def _m(mask: bool) -> str:
    return "_m" if mask else ""


def _forward(g, dtype: str) -> ConvProblem:
    return ConvProblem(g.N, g.C, g.H, g.W, g.K, g.R, g.S, g.stride, g.padding, g.dilation, dtype, "NHWC", "tensorop")


def _unsupported(op: str, dtype: str, layout: str, arch: str, needs) -> str | None:
    """The reason a native kernel cannot run: not sm_90a, not 16-bit NHWC, or the first ``(failed, what it needs)``
    of ``needs`` that failed."""
    if arch != "sm_90a":
        return f"the native {op} kernel is sm_90a's (wgmma, TMA)"
    if layout != "NHWC" or DTYPE_SIZES[dtype] != 2:
        return f"the native {op} kernel reads 16-bit NHWC tensors"
    return next((f"the native {op} kernel needs {what}" for failed, what in needs if failed), None)


def unsupported(g, dtype: str, layout: str, arch: str) -> str | None:
    """Why the native wgrad kernel cannot compute this problem (None: it can). ``g``: a ``GradWeightProblem``."""
    why = _unsupported("wgrad", dtype, layout, arch, (
        (g.C % BK, f"C % {BK} == 0 (a copy of x is 64 channels of one tap)"),
        (g.K % 8, "K % 8 == 0 (dy's rows 16-byte aligned for its tensor map)"),
        (g.N * g.P * g.Q == 0 or max(g.N * g.P * g.Q, g.K * g.R * g.S * g.C) >= 2 ** 31,
         "a reduction of 1 to 2^31 - 1 pixels and dw under 2^31 elements (32-bit indices)")))
    return why or tma_unsupported(_forward(g, dtype), BK)


def _whole(kt: int, splits: int) -> int:
    """The fewest splits that still give each split at most ceil(kt / splits) of ``kt`` k-tiles (none empty)."""
    return -(-kt // -(-kt // splits))


def _wgrad(dtype: str, out: str, accumulate: bool, bm: int, bn: int, stages: int, splits: int = 1,
           ws: bool = False) -> WgradSpec:
    """The spec whose kernel stores dw itself (in ``out``) with one split and no accumulation, else fp32 partials."""
    return WgradSpec(dtype, out if splits == 1 and not accumulate else "float32", bm, bn, stages, splits, ws)


def _best_splits(tiles: int, kt: int, mn: int, slots: int) -> int:
    """The split of a ``kt``-k-tile reduction over ``tiles`` tiles of an M x N = ``mn`` dw for ``slots`` resident
    CTAs that minimises a cost in k-tile times: the rounds of units a CTA runs x (its k-tiles + 8 for a unit's
    start and store) + the fp32 partials written and summed (8 bytes an element a split, ~1 MB a k-tile time).
    Fitted to the 128 x 128 persistent kernel's sweep over ResNet-50's layers at N = 32 and 256 (H100)."""
    top = min(kt, max(1, 8 * slots // tiles))
    sp = split_by_cost(tiles, kt, mn, slots, range(1, top + 1), 8, 8)
    return _whole(kt, sp)


def choose_spec(g, dtype: str, out: str, accumulate: bool, sms: int, masked: bool = False) -> WgradSpec:
    """The kernel for ``g`` (docs/performance.md: wgrad-native-tiles, wgrad-ws-128, wgrad-1x1-deep-ring):
    - K and R·S·C multiples of 128: 128 x 128 tiles in the persistent kernel (4 stages, a CTA an SM), the reduction
      split by :func:`_best_splits`; where that leaves one split and at most half the SMs a tile, 128 x 64 tiles
      (twice as many CTAs; wgrad-ws-128x64); a 1x1 whose splits that way run under 64 k-tiles each takes 128 x 64
      tiles with 6 stages instead, as many splits as fill one CTA an SM;
    - else a 1x1: the persistent kernel on 64-row tiles (as below), 8 stages (6 where 128 wide), as many splits as
      fill one CTA an SM;
    - else per-tile 64-row tiles, 128 wide where R·S·C is a multiple of 128 and at least 512 (else 64), 4 stages,
      the reduction split so that the tiles x splits fill the CTAs an SM holds, none empty.
    ``out``: dw's dtype; one split without accumulation stores dw itself, else fp32 partials. ``masked``: the tiles
    for the masked twin (A through registers), where a 1x1's short splits keep 128 x 128 tiles."""
    rsc = g.R * g.S * g.C
    kt = -(-g.N * g.P * g.Q // BK)
    one = g.R * g.S == 1
    if g.K % 128 == 0 and rsc % 128 == 0:
        tiles = g.K // 128 * (rsc // 128)
        splits = _best_splits(tiles, kt, g.K * rsc, sms)
        if masked or not (one and splits > 1 and kt < 64 * splits):
            bn = 64 if splits == 1 and 2 * tiles <= sms else 128
            return _wgrad(dtype, out, accumulate, 128, bn, 4, splits, True)
        # a 1x1's short splits: its reads are the time, so a deeper ring of smaller tiles; not for the masked twin,
        # whose A fragments through registers cost the most per product on 64-wide tiles (wgrad-1x1-deep-ring)
        return _one_wave(dtype, out, accumulate, 128, 64, 6, g.K, rsc, kt, sms)
    bm, bn = 64, (128 if rsc % 128 == 0 and rsc >= 512 else 64)
    if one:
        return _one_wave(dtype, out, accumulate, bm, bn, 8 if bn == 64 else 6, g.K, rsc, kt, sms)
    tiles = -(-g.K // bm) * -(-rsc // bn)
    spec = WgradSpec(dtype, "float32", bm, bn, 4)
    slots = max(1, spec.per_sm) * sms
    splits = 1
    if tiles < slots:
        splits = _whole(kt, min(slots // tiles, kt))
    return _wgrad(dtype, out, accumulate, bm, bn, 4, splits)


def _one_wave(dtype: str, out: str, accumulate: bool, bm: int, bn: int, stages: int, K: int, rsc: int, kt: int,
              sms: int) -> WgradSpec:
    """The persistent kernel on ``bm`` x ``bn`` tiles, split so that the units fill one CTA an SM once."""
    tiles = -(-K // bm) * -(-rsc // bn)
    return _wgrad(dtype, out, accumulate, bm, bn, stages, _whole(kt, min(max(1, sms // tiles), kt)), True)


def _sum_stub(td: str, accumulate: bool) -> str:
    return _kernel.render_kernel(include="conv/grad_sm90.cuh", entry="igemm_split_sum", params=_SUM_PARAMS,
                                 threads=_THREADS,
                                 body=f"igemm::grad::split_sum<{str(accumulate).lower()}, {DTYPE_CTYPE[td]}>(p);")


def sum_grid(numel: int, sms: int) -> tuple[int, int]:
    """The split sum's (grid, block): a float4 a thread, in blocks of 256 where that gives two an SM, else of 64 (a
    small dw's sum then still spreads over the SMs: docs/performance.md, split-sum-eight); at most a wave."""
    block = 256 if numel // 4 >= 2 * 256 * sms else 64
    return max(1, min(sms * 2048 // block, -(-numel // (4 * block)))), block


class _SplitSum:
    """The split sum's kernel for one dw dtype, with the plans' ``kernel()``."""

    __slots__ = ("td", "accumulate")

    def __init__(self, td: str, accumulate: bool):
        self.td, self.accumulate = td, accumulate

    def name(self) -> str:
        return f"split_sum_{self.td}{'_acc' if self.accumulate else ''}"

    def kernel(self, x_aligned: bool = True, w_aligned: bool = True) -> tuple[str, str]:
        return self.name(), _sum_stub(self.td, self.accumulate)


class _Launch:
    """A native kernel's launch: its packed arguments (written once) and its tensor maps, each a
    :class:`~._tma.MapTemplate` at a parameter, re-addressed per call to operand ``a``, ``b`` or the output ``y``
    (``maps``: (parameter, encode(address), 0 for a / 1 for b / 2 for y / 3 for the mask))."""

    def __init__(self, spec, entry: str, params, values: dict, grid, device_id: int, maps):
        k = _kernel.load(spec.stub(), spec.name(), entry, device_id, smem=spec.smem)
        self.args = _kernel.pack_args(params, values)
        self.launcher = _kernel.Launcher(k, grid, spec.threads, spec.smem)
        s = self.args.slots
        self.maps = [(s[name], MapTemplate(encode), op) for name, encode, op in maps]
        self.slot_y = s["y"]
        #: after the first write, where every map has one address word: (index, offset, operand) per map, so that a
        #: call sets ``u64[index] = offset + address``
        self.patch = None

    def __call__(self, h: int, a: int, b: int, y: int, mask: int = 0) -> None:
        u, p = self.args.u64, self.patch
        ops = (a, b, y, mask)
        if p is None:
            for slot, t, op in self.maps:
                t.write(u, slot, ops[op], True)
            if all(t.word >= 0 for _, t, _ in self.maps):
                self.patch = [(slot + t.word, int(t.base[t.word]) - t.addr0, op) for slot, t, op in self.maps]
        else:                                 # (the maps are in the buffer: their address words only)
            for i, off, op in p:
                u[i] = (off + ops[op]) & 0xFFFFFFFFFFFFFFFF
        u[self.slot_y] = y
        self.launcher(h, self.args)


class NativeWgrad:
    """The wgrad kernel (and the split sum) for one problem; :meth:`launch` on raw pointers."""

    def __init__(self, g, dtype: str, out_dtype: str, accumulate: bool, device_id: int | None, sms: int,
                 spec: WgradSpec | None = None):
        self.g, self.dtype, self.out_dtype, self.accumulate = g, dtype, out_dtype, accumulate
        self.device_id, self.sms = device_id, sms
        self.spec = spec or choose_spec(g, dtype, out_dtype, accumulate, sms)
        #: the masked twin's: the plain kernel's tiles, or the 128 x 128 ones where those are a 1x1's narrow deep ring
        self.mask_spec = replace(spec or choose_spec(g, dtype, out_dtype, accumulate, sms, masked=True), mask=True)
        self.rsc = g.R * g.S * g.C
        self.numel = g.K * self.rsc
        self._sum = _SplitSum(out_dtype, accumulate)
        self._conv, self._ws = {}, None

    def summed(self, s: WgradSpec) -> bool:
        """Whether spec ``s``'s kernel stores fp32 partials that the split sum adds into dw."""
        return s.out != self.out_dtype or s.splits > 1 or self.accumulate

    def fuses_mask(self, mask: int) -> bool:
        """Whether :meth:`launch` applies a mask at ``mask`` itself: its map's rows (a pixel's words) are 16-byte
        multiples, K % 128 == 0."""
        return self.g.K % 128 == 0 and mask % 16 == 0

    def kernels(self) -> list:
        """What :meth:`launch` runs, each with ``kernel() -> (name, source)``: the plain kernel, its masked twin and
        the split sum."""
        return [self.spec, self.mask_spec] + ([self._sum] if self.summed(self.spec) or self.summed(self.mask_spec)
                                              else [])

    def _values(self, s: WgradSpec) -> dict:
        g, P, Q = self.g, self.g.P, self.g.Q
        kt = -(-g.N * P * Q // BK)
        return dict(M=g.K, Ncol=self.rsc, NPQ=g.N * P * Q, kt_per_split=-(-kt // s.splits),
                    splits=s.splits, sh=g.stride[0],
                    sw=g.stride[1], ph=g.padding[0], pw=g.padding[1], dh=g.dilation[0], dw=g.dilation[1],
                    fd_PQ=P * Q, fd_Q=Q, fd_C=g.C, fd_S=g.S)

    def _conv_launch(self, s: WgradSpec) -> _Launch:
        """The kernel's launch for spec ``s`` (dy through a tiled map, x through the forward's im2col map)."""
        g = self.g
        tiles = -(-g.K // s.bm) * -(-self.rsc // s.bn)
        pb = _forward(g, self.dtype)
        npq = g.N * g.P * g.Q
        from cuda.bindings.driver import cuuint32_t as u32, cuuint64_t as u64
        return _Launch(
            s, "igemm_wgrad", WGRAD_PARAMS, self._values(s), s.grid(tiles * s.splits, self.sms), self.device_id,
            [("tmA", lambda addr: _encode(pb, "Tiled", (2, addr, [u64(g.K), u64(npq)], [u64(g.K * 2)],
                                                        [u32(64), u32(BK)], [u32(1), u32(1)]),
                                          "CU_TENSOR_MAP_L2_PROMOTION_L2_128B"), 0),
             ("tmB", lambda addr: _encode_im2col(pb, BK, addr), 1)]
            + ([("tmM", lambda addr: _encode(pb, "Tiled", (2, addr, [u64(g.K // 32), u64(npq)], [u64(g.K // 8)],
                                                           [u32(4), u32(BK)], [u32(1), u32(1)]),
                                             "CU_TENSOR_MAP_L2_PROMOTION_NONE", "CU_TENSOR_MAP_SWIZZLE_NONE", "uint32"),
                 3)] if s.mask else []))

    def _build(self, mask: bool) -> tuple:
        """(the kernel's launch, the split sum's (launcher, arguments) or None) for the plain or the masked spec."""
        s, dev = self.mask_spec if mask else self.spec, self.device_id
        summed = None
        if self.summed(s):
            if self._ws is None:                  # (the partials of either spec)
                n = max(t.splits for t in (self.spec, self.mask_spec) if self.summed(t))
                self._ws = _runtime.DeviceArray((n * self.numel,), "float32", dev)
            name, src = self._sum.kernel()
            ks = _kernel.load(src, name, "igemm_split_sum", dev)
            sargs = _kernel.pack_args(_SUM_PARAMS, dict(src=self._ws.ptr, n=self.numel, splits=s.splits))
            summed = (_kernel.Launcher(ks, *sum_grid(self.numel, self.sms)), sargs)
        self._conv[mask] = (self._conv_launch(s), summed)
        return self._conv[mask]

    def launch(self, h: int, x: int, dy: int, dw: int, mask: int = 0) -> None:
        """dw (or the partials, then their sum into dw) on stream ``h``; x and dy 16-byte aligned; ``mask`` (0:
        none): the forward's ReLU mask of dy, read in the kernel (:meth:`fuses_mask`)."""
        conv, summed = self._conv.get(mask != 0) or self._build(mask != 0)
        conv(h, dy, x, self._ws.ptr if summed else dw, mask)
        if summed:
            sl, sargs = summed
            sargs.u64[sargs.slots["dst"]] = dw
            sl(h, sargs)


def all_variants() -> list[tuple[str, str]]:
    """Every (name, stub) :func:`choose_spec`, dgrad's ``choose_dgrad_spec`` (:mod:`._native_dgrad`) and the split
    sum can give (the precompile tools fill the cache with them: the tiles depend only on the channel counts, wgrad's
    stored type on its split)."""
    dts = ("float16", "bfloat16")
    out = [WgradSpec(dt, o, 64, bn, 4, mask=m).kernel() for dt in dts for bn in (64, 128) for o in (dt, "float32")
           for m in (False, True)]
    out += [WgradSpec(dt, o, bm, bn, st, 1, True, m).kernel() for dt in dts for o in (dt, "float32")
            for bm, bn, st in WS_TILES for m in ((False,) if st == 6 and bm == 128 else (False, True))]     # (its masked twin: 128 x 128)
    from ._native_dgrad import dgrad_variants
    return out + dgrad_variants() + [_SplitSum(td, acc).kernel() for td in ("float16", "bfloat16", "float32")
                                     for acc in (False, True)]
