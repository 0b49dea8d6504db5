"""wgrad of a 16-bit NCHW 1x1 stride-1 convolution with x and dy read where they lie (csrc/conv/wgrad_nchw.cuh).

``dw[k, c] = Σ_(n, j) dy[n, k, j] · x[n, c, j]`` over the images n and the P·Q pixels j: in NCHW both operands are
rows of pixels, K-major for a GEMM M = K, N = C whose reduction runs over the pixels, so the kernel loads them with
3-D tensor maps ([N][K][P·Q], [N][C][P·Q]; a k-tile is 64 pixels of one image) and multiplies them as wgmma takes
the forward's operands, where the general NCHW path transposes x and dy to NHWC first (docs/performance.md:
wgrad-nchw-1x1). Its tiles, splits and split sum are the NHWC kernel's (:func:`._native.choose_spec`).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from .._kernel import ParamSpec
from .._runtime import DTYPE_CTYPE
from ._native import BK, WS_TILES, NativeWgrad, WgradSpec, _encode, _Launch

__all__ = ["WGRAD_NCHW_PARAMS", "WgradNchwSpec", "NativeWgradNchw", "unsupported", "all_variants"]

#: the kernel's launch parameters, in order: dw (or the partials), M = K, Ncol = C, the k-tiles (N × a k-tile per
#: 64 pixels of an image), their split, the k-tiles an image (fd_T) and the two maps
WGRAD_NCHW_PARAMS = [ParamSpec("y", "ptr"),
                     *(ParamSpec(n, "int32") for n in ("M", "Ncol", "kt", "kt_per_split", "splits")),
                     ParamSpec("fd_T", "fastdiv"), ParamSpec("tmA", "tmap"), ParamSpec("tmB", "tmap")]


@dataclass(frozen=True)
class WgradNchwSpec(WgradSpec):
    """The NCHW kernel's template arguments (``igemm::grad::wgrad_nchw<T, TO, BM, BN, Stages, Ws>``): a
    :class:`WgradSpec` without the mask."""

    _include = "conv/wgrad_nchw.cuh"

    def name(self) -> str:
        return "wgrad_nchw" + super().name()[len("wgrad"):]

    def stub(self) -> str:
        return self._render("wgrad_nchw", WGRAD_NCHW_PARAMS,
                            f"{DTYPE_CTYPE[self.dtype]}, {DTYPE_CTYPE[self.out]}, {self.bm}, {self.bn}")


def unsupported(g, dtype: str, arch: str) -> str | None:
    """Why this kernel cannot compute the NCHW wgrad problem ``g`` (None: it can)."""
    pq = g.P * g.Q
    for bad, why in ((arch != "sm_90a", "sm_90a (TMA and wgmma)"),
                     (dtype not in ("float16", "bfloat16"), "a 16-bit dtype"),
                     (g.layout != "NCHW", "NCHW"),
                     ((g.R, g.S, g.stride, g.padding) != (1, 1, (1, 1), (0, 0)), "a 1x1 stride-1 convolution without "
                      "padding (dy's pixels are x's)"),
                     (pq % 8, "P·Q % 8 == 0 (an image's rows of pixels 16-byte aligned for the tensor maps)"),
                     (g.C % 8, "C % 8 == 0 (dw's rows in 16-byte vectors, the split sum in float4s)"),
                     (max(g.N * g.C * pq, g.N * g.K * pq) >= 2 ** 31, "tensors under 2^31 elements")):
        if bad:
            return f"the NCHW 1x1 wgrad kernel needs {why}"
    return None


class NativeWgradNchw(NativeWgrad):
    """The NCHW 1x1 kernel (and the split sum) for one problem; :meth:`launch` on raw pointers, as
    :class:`NativeWgrad`'s (no mask: the plan forms ``bit ? dy : 0`` first)."""

    def __init__(self, g, dtype: str, out_dtype: str, accumulate: bool, device_id: int | None, sms: int,
                 spec: WgradNchwSpec | None = None):
        if spec is None:                     # (the NHWC kernel's tiles and splits for the same GEMM)
            from ._native import choose_spec
            spec = WgradNchwSpec(**vars(choose_spec(g.nhwc(), dtype, out_dtype, accumulate, sms)))
        super().__init__(g, dtype, out_dtype, accumulate, device_id, sms, spec)

    def fuses_mask(self, mask: int) -> bool:
        """Never: the plan applies a mask / prologue by the NCHW dz move first."""
        return False

    def kernels(self) -> list:
        """The kernel and the split sum (no masked twin)."""
        return [self.spec] + ([self._sum] if self.summed(self.spec) else [])

    def _values(self, s) -> dict:
        g = self.g
        tpi = -(-g.P * g.Q // BK)
        kt = g.N * tpi
        return dict(M=g.K, Ncol=g.C, kt=kt, kt_per_split=-(-kt // s.splits), splits=s.splits, fd_T=tpi)

    def _maps(self) -> list:
        from cuda.bindings.driver import cuuint32_t as u32, cuuint64_t as u64
        g, pq = self.g, self.g.P * self.g.Q
        pb = SimpleNamespace(dtype=self.dtype)

        def rows(ch: int):                   # [N][ch][P·Q] as (pixel, channel, image), boxes of 64 x 64
            return lambda addr: _encode(pb, "Tiled", (3, addr, [u64(pq), u64(ch), u64(g.N)],
                                                      [u64(pq * 2), u64(ch * pq * 2)], [u32(BK), u32(64), u32(1)],
                                                      [u32(1)] * 3), "CU_TENSOR_MAP_L2_PROMOTION_L2_128B")
        return [("tmA", rows(g.K), 0), ("tmB", rows(g.C), 1)]

    def _conv_launch(self, s) -> _Launch:
        tiles = -(-self.g.K // s.bm) * -(-self.g.C // s.bn)
        return _Launch(s, "igemm_wgrad_nchw", WGRAD_NCHW_PARAMS, self._values(s), s.grid(tiles * s.splits, self.sms),
                       self.device_id, self._maps())


def all_variants() -> list[tuple[str, str]]:
    """Every (name, stub) the NCHW kernel can be given (its tiles are :func:`._native.choose_spec`'s)."""
    dts = ("float16", "bfloat16")
    return [WgradNchwSpec(dt, o, bm, bn, st, 1, True).kernel() for dt in dts for o in (dt, "float32")
            for bm, bn, st in WS_TILES]
