"""wgrad's native kernel: the weight gradient of a 16-bit NHWC convolution on sm_90a, read where x and dy lie.

GEMM ``dw[k, (r, s, c)] = Σ_(n,p,q) dy[n, p, q, k] · x[n, p·st_h + r·dil_h − pad_h, q·st_w + s·dil_w − pad_w, c]``
with M = K, N = R·S·C and the reduction over the N·P·Q output pixels, 64 a k-tile. A k-tile is two kinds of TMA
copy (csrc/conv/wgrad.cuh): dy's [N·P·Q][K] rows (a tiled map) and the forward's own im2col copy of x at one tap
(zeros outside the image are the padding); both land channels-contiguous and are multiplied as MN-major wgmma
operands. No operand is moved. The reduction splits over ``splits`` CTAs a tile; each split stores its fp32
partial tile and ``split_sum`` adds them in split order (deterministic) into dw, in its dtype or into an fp32
``out`` (``accumulate``). With one split and no accumulation the kernel stores dw itself.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import _kernel, _runtime
from .._kernel import ParamSpec
from .._runtime import DTYPE_CTYPE, DTYPE_SIZES
from ._problem import ConvProblem
from ._tma import BK, MapTemplate, _encode, _encode_im2col, tma_unsupported

__all__ = ["WGRAD_PARAMS", "WgradSpec", "unsupported", "choose_spec", "NativeWgrad"]

#: the native kernel's launch parameters, in order (the stub is rendered from them)
WGRAD_PARAMS = [ParamSpec("y", "ptr"), *(ParamSpec(n, "int32") for n in ("M", "Ncol", "NPQ", "kt_per_split", "sh", "sw",
                                                                         "ph", "pw", "dh", "dw")),
                *(ParamSpec(n, "fastdiv") for n in ("fd_PQ", "fd_Q", "fd_C", "fd_S")),
                ParamSpec("tmA", "tmap"), ParamSpec("tmB", "tmap")]
_SUM_PARAMS = [ParamSpec("src", "ptr"), ParamSpec("dst", "ptr"), ParamSpec("n", "int64"), ParamSpec("splits", "int32")]
_THREADS = 256


@dataclass(frozen=True)
class WgradSpec:
    """The native kernel's template arguments (``igemm::wgrad::wgrad<T, TO, BM, BN, Stages>``) and its split of the
    reduction (a launch value)."""
    dtype: str
    out: str            # what the kernel stores: dw's dtype (one split, no accumulation) or fp32 partials
    bm: int
    bn: int
    stages: int
    splits: int = 1

    @property
    def threads(self) -> int:
        return self.bm * 2              # a warpgroup per 64 rows

    @property
    def smem(self) -> int:
        """Dynamic shared memory, as ``igemm::wgrad::smem_bytes``."""
        return self.stages * (self.bm + self.bn) * BK * 2 + 1024

    def name(self) -> str:
        return f"wgrad_{self.dtype}_{self.bm}x{self.bn}_s{self.stages}_{self.out}"

    def stub(self) -> str:
        t = DTYPE_CTYPE[self.dtype]
        return _kernel.render_kernel(include="conv/wgrad.cuh", entry="igemm_wgrad", params=WGRAD_PARAMS,
                                     threads=self.threads, min_blocks=1, body=(
                                         f"igemm::wgrad::wgrad<{t}, {DTYPE_CTYPE[self.out]}, {self.bm}, {self.bn}, "
                                         f"{self.stages}>(p);"))

    def kernel(self, x_aligned: bool = True, w_aligned: bool = True) -> tuple[str, str]:
        """``(name, source)``, as the forward plans give theirs to the precompile tools."""
        return self.name(), self.stub()


def _forward(g, dtype: str) -> ConvProblem:
    return ConvProblem(g.N, g.C, g.H, g.W, g.K, g.R, g.S, g.stride, g.padding, g.dilation, dtype, "NHWC", "tensorop")


def unsupported(g, dtype: str, layout: str, arch: str) -> str | None:
    """Why the native kernel cannot compute this wgrad (None: it can). ``g``: a ``GradWeightProblem``."""
    if arch != "sm_90a":
        return "the native wgrad kernel is sm_90a's (wgmma, TMA)"
    if layout != "NHWC" or DTYPE_SIZES[dtype] != 2:
        return "the native wgrad kernel reads 16-bit NHWC x and dy"
    if g.C % BK:
        return f"the native wgrad kernel needs C % {BK} == 0 (a copy of x is 64 channels of one tap)"
    if g.K % 8:
        return "the native wgrad kernel needs K % 8 == 0 (dy's rows 16-byte aligned for its tensor map)"
    if g.N * g.P * g.Q == 0:
        return "an empty reduction"
    if max(g.N * g.P * g.Q, g.K * g.R * g.S * g.C) >= 2 ** 31:
        return "tensor too large for the kernel's 32-bit indices"
    return tma_unsupported(_forward(g, dtype), BK)


def choose_spec(g, dtype: str, out: str, accumulate: bool, sms: int) -> WgradSpec:
    """The kernel for ``g``: 64-row tiles, 128 wide where R·S·C is a multiple of 128 and at least 512, else 64; 4
    stages; the reduction split so that the tiles x splits give each SM one CTA (two where a filter wider than 1x1
    would leave more than 40 k-tiles a split), none empty. ``out``: dw's dtype; one split without accumulation
    stores dw itself, else fp32 partials. (docs/performance.md: wgrad-native-tiles)"""
    rsc = g.R * g.S * g.C
    bm, bn = 64, (128 if rsc % 128 == 0 and rsc >= 512 else 64)
    tiles = -(-g.K // bm) * -(-rsc // bn)
    kt = -(-g.N * g.P * g.Q // BK)
    splits = 1
    if tiles < sms:
        splits = min(-(-sms // tiles), kt)
        if g.R * g.S > 1 and kt > 40 * splits:
            splits = min(-(-2 * sms // tiles), kt)
        splits = -(-kt // -(-kt // splits))          # (no empty split)
    return WgradSpec(dtype, out if splits == 1 and not accumulate else "float32", bm, bn, 4, splits)


def _sum_stub(td: str, accumulate: bool) -> str:
    return _kernel.render_kernel(include="conv/wgrad.cuh", entry="igemm_split_sum", params=_SUM_PARAMS,
                                 threads=_THREADS,
                                 body=f"igemm::wgrad::split_sum<{str(accumulate).lower()}, {DTYPE_CTYPE[td]}>(p);")


class _SplitSum:
    """The split sum's kernel for one dw dtype, with the plans' ``kernel()``."""

    __slots__ = ("td", "accumulate")

    def __init__(self, td: str, accumulate: bool):
        self.td, self.accumulate = td, accumulate

    def name(self) -> str:
        return f"split_sum_{self.td}{'_acc' if self.accumulate else ''}"

    def kernel(self, x_aligned: bool = True, w_aligned: bool = True) -> tuple[str, str]:
        return self.name(), _sum_stub(self.td, self.accumulate)


class NativeWgrad:
    """The native kernel (and the split sum) for one wgrad problem; :meth:`launch` on raw pointers."""

    def __init__(self, g, dtype: str, out_dtype: str, accumulate: bool, device_id: int | None, sms: int,
                 spec: WgradSpec | None = None):
        self.g, self.dtype, self.out_dtype, self.accumulate = g, dtype, out_dtype, accumulate
        self.device_id, self.sms = device_id, sms
        self.spec = spec or choose_spec(g, dtype, out_dtype, accumulate, sms)
        self.rsc = g.R * g.S * g.C
        self.numel = g.K * self.rsc
        #: the kernel stores fp32 partials and the split sum adds them into dw
        self.summed = self.spec.out != out_dtype or self.spec.splits > 1 or accumulate
        self._sum = _SplitSum(out_dtype, accumulate) if self.summed else None
        self._conv = self._launch_sum = None

    def kernels(self) -> list:
        """What :meth:`launch` runs, each with ``kernel() -> (name, source)``."""
        return [self.spec] + ([self._sum] if self._sum is not None else [])

    def _values(self) -> dict:
        g, P, Q = self.g, self.g.P, self.g.Q
        kt = -(-g.N * P * Q // BK)
        return dict(M=g.K, Ncol=self.rsc, NPQ=g.N * P * Q, kt_per_split=-(-kt // self.spec.splits), sh=g.stride[0],
                    sw=g.stride[1], ph=g.padding[0], pw=g.padding[1], dh=g.dilation[0], dw=g.dilation[1],
                    fd_PQ=P * Q, fd_Q=Q, fd_C=g.C, fd_S=g.S)

    def _build(self) -> None:
        g, s, dev = self.g, self.spec, self.device_id
        k = _kernel.load(s.stub(), s.name(), "igemm_wgrad", dev, smem=s.smem)
        tiles = -(-g.K // s.bm) * -(-self.rsc // s.bn)
        args = _kernel.pack_args(WGRAD_PARAMS, self._values())
        pb = _forward(g, self.dtype)
        npq = g.N * g.P * g.Q
        from cuda.bindings.driver import cuuint32_t as u32, cuuint64_t as u64
        dy_map = MapTemplate(lambda addr: _encode(pb, "Tiled", (2, addr, [u64(g.K), u64(npq)], [u64(g.K * 2)],
                                                                [u32(64), u32(BK)], [u32(1), u32(1)]),
                                                  "CU_TENSOR_MAP_L2_PROMOTION_L2_128B"))
        x_map = MapTemplate(lambda addr: _encode_im2col(pb, BK, addr))
        self._maps = (dy_map, x_map, args.slots["tmA"], args.slots["tmB"], args.slots["y"])
        self._written = False
        self._conv = (_kernel.Launcher(k, (tiles, 1, s.splits), s.threads, s.smem), args)
        if self.summed:
            self._ws = _runtime.DeviceArray((s.splits * self.numel,), "float32", dev)
            name, src = self._sum.kernel()
            ks = _kernel.load(src, name, "igemm_split_sum", dev)
            grid = max(1, min(self.sms * 8, -(-self.numel // (4 * _THREADS))))
            sargs = _kernel.pack_args(_SUM_PARAMS, dict(src=self._ws.ptr, n=self.numel, splits=s.splits))
            self._launch_sum = (_kernel.Launcher(ks, grid, _THREADS), sargs)

    def launch(self, h: int, x: int, dy: int, dw: int) -> None:
        """dw (or the partials, then their sum into dw) on stream ``h``; x and dy 16-byte aligned."""
        if self._conv is None:
            self._build()
        launcher, args = self._conv
        dy_map, x_map, sa, sb, sy = self._maps
        u = args.u64
        dy_map.write(u, sa, dy, not self._written)
        x_map.write(u, sb, x, not self._written)
        self._written = dy_map.word >= 0 and x_map.word >= 0
        u[sy] = self._ws.ptr if self.summed else dw
        launcher(h, args)
        if self.summed:
            sl, sargs = self._launch_sum
            sargs.u64[sargs.slots["dst"]] = dw
            sl(h, sargs)


def all_variants() -> list[tuple[str, str]]:
    """Every (name, stub) :func:`choose_spec` and the split sum can give (the precompile tools fill the cache with
    them: the tile depends only on R·S·C, the stored type on the split)."""
    out = [WgradSpec(dtype, o, 64, bn, 4).kernel() for dtype in ("float16", "bfloat16") for bn in (64, 128)
           for o in (dtype, "float32")]
    return out + [_SplitSum(td, acc).kernel() for td in ("float16", "bfloat16", "float32") for acc in (False, True)]
