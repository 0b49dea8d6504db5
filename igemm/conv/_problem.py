"""The convolution problem: shapes, dtypes, layout, epilogue structure, and the arithmetic every other part of
the conv family shares (output size, GEMM sizes, the width unfold's channel count, the patch loader's boxes).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import check_layout, check_shape_arg
from .._runtime import DTYPE_SIZES
from ..reference.conv import pair

__all__ = ["ConvProblem", "DTYPES", "LAYOUTS", "PRECISIONS", "geometry", "pair", "k_table", "unfold_channels",
           "patch_slots", "patch_bytes", "split_by_cost", "PATCH_BOX", "PATCH_STEP", "PATCH_ALIGN", "PATCH_MAX_BYTES"]

DTYPES = ("float16", "bfloat16", "float32")
LAYOUTS = ("NCHW", "NHWC")
PRECISIONS = ("strict", "tf32")

#: the patch loader's box (csrc/conv/patch.cuh: kPatchBox, kPatchStep, kPatchAlign) and its shared memory cap
PATCH_BOX, PATCH_STEP, PATCH_ALIGN = 128, 120, 8
PATCH_MAX_BYTES = 64 * 1024


def unfold_channels(C: int, S: int, esize: int) -> int:
    """The width unfold's channel count: C' = S*C rounded up to a 16-byte multiple of elements."""
    v = 16 // esize
    return -(-S * C // v) * v


@dataclass(frozen=True)
class ConvProblem:
    """A convolution as the kernel sees it (``Conv2dPlan.kproblem``) or as the user asked for it
    (``Conv2dPlan.problem``): they differ on the NCHW transpose path and the width unfold."""
    N: int
    C: int
    H: int
    W: int
    K: int
    R: int
    S: int
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    dtype: str            # "float16" | "bfloat16" | "float32"
    layout: str           # "NCHW" | "NHWC" (of x; y too unless out_layout says otherwise)
    precision: str        # "strict" | "tf32" (fp32 only; 16-bit types always use tensor cores: "tensorop")
    #: the epilogue chain as its C++ functor types, in order (``igemm.epilogues.Chain.functors``)
    epilogue: tuple = ()
    residual_dtype: str | None = None
    out_layout: str | None = None   # the output's layout when it differs from the input's (NCHW transpose path)
    #: the patch loader's problem (csrc/conv/patch.cuh): x as given, the reduction over the width-unfolded
    #: filter, R x roundup(S*C, 16 bytes) long
    patch: bool = False
    #: the chain ends in ReLU(mask=True): the kernel writes the 1-bit mask
    mask: bool = False

    @classmethod
    def of(cls, N: int, C: int, H: int, W: int, K: int, R: int, S: int, stride, padding, dilation, dtype: str,
           layout: str, precision: str, chain=None, residual_dtype: str | None = None) -> "ConvProblem":
        """The problem with the epilogue ``chain`` (an ``igemm.epilogues`` chain; None: none); ``precision`` is
        the user's (``"strict"``/``"tf32"``), kept for fp32 only."""
        functors, mask = (chain.functors(dtype, residual_dtype), chain.mask) if chain is not None else ((), False)
        return cls(N, C, H, W, K, R, S, tuple(stride), tuple(padding), tuple(dilation), dtype, layout,
                   precision if dtype == "float32" else "tensorop", functors,
                   residual_dtype if chain is not None and chain.residual_op is not None else None, mask=mask)

    @property
    def P(self) -> int:
        return (self.H + 2 * self.padding[0] - self.dilation[0] * (self.R - 1) - 1) // self.stride[0] + 1

    @property
    def Q(self) -> int:
        return (self.W + 2 * self.padding[1] - self.dilation[1] * (self.S - 1) - 1) // self.stride[1] + 1

    @property
    def M(self) -> int:
        return self.N * self.P * self.Q

    @property
    def Kred(self) -> int:
        if self.patch:
            return self.R * unfold_channels(self.C, self.S, DTYPE_SIZES[self.dtype])
        return self.C * self.R * self.S

    @property
    def flops(self) -> int:
        return 2 * self.M * self.K * self.Kred

    @property
    def y_layout(self) -> str:
        return self.out_layout or self.layout

    @property
    def has_residual(self) -> bool:
        return self.residual_dtype is not None


def _shape(s, name: str, what: str) -> tuple:
    t = check_shape_arg(tuple(s) if hasattr(s, "__len__") and not isinstance(s, (str, bytes)) else s, name)
    if len(t) != 4:
        raise ValueError(f"{name}: expected a 4-D {what}, got shape {t}")
    return t


def geometry(x_shape, w_shape, layout: str, stride, padding, dilation, names=("x_shape", "w_shape")):
    """Validate a problem's geometry: ``(N, C, H, W, K, R, S, P, Q, stride, padding, dilation)``; ``names``:
    what the caller calls the two shapes (the arrays themselves for the function forms)."""
    check_layout(layout)
    x_shape = _shape(x_shape, names[0], f"{layout} tensor")
    w_shape = _shape(w_shape, names[1], "filter (" + ("K,C,R,S" if layout == "NCHW" else "K,R,S,C") + ")")
    if layout == "NCHW":
        N, C, H, W = x_shape
        K, Cw, R, S = w_shape
    else:
        N, H, W, C = x_shape
        K, R, S, Cw = w_shape
    if Cw != C:
        raise ValueError(f"{names[1]}: has {Cw} input channels but {names[0]} has {C} ({layout}: x {x_shape}, "
                         f"w {w_shape}); "
                         f"grouped convolution is not supported")
    if min(N, C, H, W, K, R, S) < 1:
        raise ValueError(f"{names[0] if min(N, C, H, W) < 1 else names[1]}: empty tensors are not supported "
                         f"(x {x_shape}, w {w_shape})")
    s, p, d = pair(stride, "stride"), pair(padding, "padding"), pair(dilation, "dilation")
    if min(s) < 1:
        raise ValueError(f"stride: must be >= 1, got {stride!r}")
    if min(p) < 0:
        raise ValueError(f"padding: must be >= 0, got {padding!r}")
    if min(d) < 1:
        raise ValueError(f"dilation: must be >= 1, got {dilation!r}")
    P = (H + 2 * p[0] - d[0] * (R - 1) - 1) // s[0] + 1
    Q = (W + 2 * p[1] - d[1] * (S - 1) - 1) // s[1] + 1
    if P < 1 or Q < 1:
        raise ValueError(f"{names[1]}: the (dilated) filter {R}x{S} (dilation {d}) does not fit {names[0]}'s "
                         f"padded input "
                         f"{H}x{W} (padding {p}): the output would be {P}x{Q}")
    return N, C, H, W, K, R, S, P, Q, s, p, d


def split_by_cost(tiles: int, kt: int, mn: int, slots: int, splits, start: int, per_million: float) -> int:
    """Of the candidate ``splits`` of a ``kt``-k-tile reduction over ``tiles`` output tiles (an ``mn``-element output)
    for ``slots`` resident CTAs, the one of least cost in k-tile times (the fewest on a tie): the rounds of units a CTA
    runs x (a unit's k-tiles + ``start``) + ``per_million`` a split per million fp32 partials (none for one split)."""
    def cost(sp: int) -> float:
        return -(-tiles * sp // slots) * (-(-kt // sp) + start) + (per_million * sp * mn / 1e6 if sp > 1 else 0)
    return min(splits, key=lambda sp: (cost(sp), sp))


def k_table(pb: ConvProblem, bk: int) -> np.ndarray:
    """Per reduction index k (padded to a whole k-tile): the element offset of tap k relative to an
    output pixel's origin tap, and (r·dh, s·dw) packed as two int16 (r·dh = -32768 past Kred: never valid).
    The element-gather loaders read it instead of dividing k per element."""
    R, S, C, H, W = pb.R, pb.S, pb.C, pb.H, pb.W
    dh, dw = pb.dilation
    if (R - 1) * dh > 32767 or (S - 1) * dw > 32767:
        raise NotImplementedError(f"dilated filter extent {(R - 1) * dh}x{(S - 1) * dw} exceeds 32767")
    n = -(-pb.Kred // bk) * bk
    k = np.arange(pb.Kred)
    if pb.layout == "NHWC":
        rs, c = np.divmod(k, C)
        r, s = np.divmod(rs, S)
        delta = (r * dh * W + s * dw) * C + c
    else:
        c, rs = np.divmod(k, R * S)
        r, s = np.divmod(rs, S)
        delta = c * H * W + r * dh * W + s * dw
    tab = np.zeros((n, 2), dtype=np.int32)
    tab[:pb.Kred, 0] = delta
    rdh = np.full(n, -32768, dtype=np.int64)
    sdw = np.zeros(n, dtype=np.int64)
    rdh[:pb.Kred], sdw[:pb.Kred] = r * dh, s * dw
    tab[:, 1] = ((rdh & 0xFFFF) | (sdw << 16)).astype(np.int64).astype(np.uint32).view(np.int32)
    return tab


def patch_slots(pb: ConvProblem, bm: int) -> int:
    """Box slots the patch of the worst BM-row tile takes (csrc/conv/patch.cuh: line 0 from its q0, full
    lines, the last line), over every start q0 a tile can have."""
    Q, sw, SC, C = pb.Q, pb.stride[1], pb.S * pb.C, pb.C

    def boxes(count, a):        # a line's boxes; its first box starts a (0..7) elements early (16-byte starts)
        return ((count - 1) * sw * C + SC + a - 1) // PATCH_STEP + 1
    af = (-pb.padding[1] * C) % PATCH_ALIGN
    nbf = boxes(Q, af)
    best = 0
    for q0 in range(Q):
        first = min(Q - q0, bm)
        rest = bm - first
        best = max(best, boxes(first, (q0 * sw - pb.padding[1]) * C % PATCH_ALIGN) + (rest // Q) * nbf
                   + (boxes(rest % Q, af) if rest % Q else 0))
    return best


def patch_bytes(pb: ConvProblem, bm: int) -> int:
    """The patch's shared memory for BM-row tiles (+16 bytes: a chunk's last 4-byte load may pass the end)."""
    return patch_slots(pb, bm) * pb.R * PATCH_BOX * 2 + 16
