"""TMA tensor maps for the conv kernel's TMA loader (``KernelSpec.load_b == "tma"``, sm_90a).

The kernel loads each stage with two TMA copies (``csrc/conv/tma.cuh``): A through an *im2col-mode*
map of x (NHWC as a 4-D tensor, the bounding box given by the padding and the filter extent, traversal
strides = the conv stride, so one copy gathers BM consecutive output pixels' taps, zero-filled outside
the image), B through a tiled map of w as the K x Kred matrix. Both use the 128-byte swizzle the wgmma
descriptors read. ``load_a == "tma8"`` (8-channel problems, an autotune candidate) takes eight 16-byte
copies per k-tile into the no-swizzle layout instead. A map holds its tensor's address, so a plan encodes
each map once and then only patches the address word per call (:class:`MapTemplate`); the word is found
by three probe encodes (re-encoding per new address is the fallback if no single word holds it).
"""
from __future__ import annotations

import ctypes

import numpy as np

from .._runtime import DTYPE_SIZES
from ._problem import PATCH_BOX

__all__ = ["tma_kind", "tma_unsupported", "MapTemplate", "ConvMaps", "PatchMap"]

BK = 64            # channels per copy: 128 bytes of a 16-bit type (the SW128 row)


def tma_kind(pb) -> str:
    """The TMA loader kind for the kernel problem ``pb``: ``"tma"`` (a k-tile is 64 channels of one tap) or,
    for 8-channel problems (16-bit C padded to 8: ``pad_channels``), ``"tma8"`` (8 taps of 8 channels);
    NCHW (a 1x1 stride-1 conv): ``"tmamn"`` (64 pixels x 64 channels of x as [N][C][H*W], MN-major)."""
    if pb.layout == "NCHW":
        return "tmamn"
    return "tma8" if pb.C == 8 else "tma"


def tma_unsupported(pb, bm: int) -> str | None:
    """Why the TMA loader cannot run the kernel problem ``pb`` with BM-row tiles (None: it can)."""
    if DTYPE_SIZES[pb.dtype] != 2:
        return "TMA loads need a 16-bit kernel problem"
    if pb.layout == "NCHW":
        if (pb.R, pb.S, pb.stride, pb.padding) != (1, 1, (1, 1), (0, 0)):
            return "NCHW TMA loads (MN-major tiles) need a 1x1 stride-1 conv without padding"
        if pb.C % BK or (pb.H * pb.W) % 64 or bm != 64:
            return "NCHW TMA loads need C % 64 == 0, H*W % 64 == 0 (no tile across images) and 64-row tiles"
        if pb.y_layout != "NCHW":
            return "NCHW TMA loads store NCHW"
        if max(pb.N, pb.C * pb.H * pb.W, pb.K, pb.Kred) >= 2 ** 31:
            return "tensor too large for a tensor map"
        return None
    if pb.layout != "NHWC":
        return "TMA loads need a 16-bit NHWC kernel problem"
    if pb.C % BK and pb.C != 8:
        return f"TMA loads need C % {BK} == 0 (a k-tile is 64 channels of one tap) or C == 8"
    if pb.C == 8 and pb.W + pb.padding[1] >= 0x4000:
        return "8-channel TMA loads zero the taps past R*S with a w offset of 0x4000: W must stay below it"
    lower = (-pb.padding[1], -pb.padding[0])
    upper = (pb.padding[1] - (pb.S - 1) * pb.dilation[1], pb.padding[0] - (pb.R - 1) * pb.dilation[0])
    if not all(-128 <= v <= 127 for v in lower + upper):
        return "padding/filter extent outside the 4-D im2col box range [-128, 127]"
    if max(pb.stride) > 8:
        return "stride > 8 (TMA traversal strides are 1..8)"
    if bm > 256 or max(pb.N, pb.H, pb.W, pb.C, pb.K, pb.Kred) >= 2 ** 31:
        return "tile or tensor too large for a tensor map"
    return None


def _encode(pb, kind: str, args, l2: str, swizzle: str = "CU_TENSOR_MAP_SWIZZLE_128B", elem: str | None = None
            ) -> bytes:
    """``cuTensorMapEncode<kind>(element type, *args, no interleave, swizzle, L2 promotion ``l2``, zero
    fill)`` -> the map's 128 bytes. The element type is the problem's (16-bit), or ``elem="uint32"`` (mask words)."""
    from cuda.bindings import driver as d
    T = d.CUtensorMapDataType
    dt = (T.CU_TENSOR_MAP_DATA_TYPE_UINT32 if elem == "uint32" else
          T.CU_TENSOR_MAP_DATA_TYPE_FLOAT16 if pb.dtype == "float16" else T.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16)
    err, tm = getattr(d, "cuTensorMapEncode" + kind)(
        dt, *args, d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(d.CUtensorMapSwizzle, swizzle), getattr(d.CUtensorMapL2promotion, l2),
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if int(err):
        raise RuntimeError(f"cuTensorMapEncode{kind} failed ({err}) for {pb}")
    return ctypes.string_at(tm.getPtr(), 128)


def _encode_im2col(pb, bm: int, addr: int) -> bytes:
    from cuda.bindings.driver import cuuint32_t as u32, cuuint64_t as u64
    es = 2
    C, H, W, N = pb.C, pb.H, pb.W, pb.N
    return _encode(pb, "Im2col", (
        4, addr, [u64(C), u64(W), u64(H), u64(N)], [u64(C * es), u64(W * C * es), u64(H * W * C * es)],
        [-pb.padding[1], -pb.padding[0]],
        [pb.padding[1] - (pb.S - 1) * pb.dilation[1], pb.padding[0] - (pb.R - 1) * pb.dilation[0]],
        min(BK, C), bm, [u32(1), u32(pb.stride[1]), u32(pb.stride[0]), u32(1)]), "CU_TENSOR_MAP_L2_PROMOTION_L2_128B",
        "CU_TENSOR_MAP_SWIZZLE_NONE" if C == 8 else "CU_TENSOR_MAP_SWIZZLE_128B")   # 8 channels: 16-byte rows


def _encode_mask_im2col(pb, bm: int, addr: int) -> bytes:
    """The im2col map of a ReLU mask over ``pb``'s NHWC input (C % 128 == 0), row for row with
    :func:`_encode_im2col`'s: its words as [N][H][W][C / 32] uint32, 4 words (16 bytes) a pixel from a word
    coordinate, ``bm`` pixels a box."""
    from cuda.bindings.driver import cuuint32_t as u32, cuuint64_t as u64
    C, H, W, N = pb.C // 32, pb.H, pb.W, pb.N
    return _encode(pb, "Im2col", (
        4, addr, [u64(C), u64(W), u64(H), u64(N)], [u64(C * 4), u64(W * C * 4), u64(H * W * C * 4)],
        [-pb.padding[1], -pb.padding[0]],
        [pb.padding[1] - (pb.S - 1) * pb.dilation[1], pb.padding[0] - (pb.R - 1) * pb.dilation[0]],
        4, bm, [u32(1), u32(pb.stride[1]), u32(pb.stride[0]), u32(1)]), "CU_TENSOR_MAP_L2_PROMOTION_NONE",
        "CU_TENSOR_MAP_SWIZZLE_NONE", "uint32")


def _encode_nchw(pb, addr: int) -> bytes:
    """kLoadTmaMN's A map: x NCHW as [N][C][H*W], boxes of 64 pixels x 64 channels (pixels innermost), SW128."""
    from cuda.bindings.driver import cuuint32_t as u32, cuuint64_t as u64
    hw = pb.H * pb.W
    return _encode(pb, "Tiled", (3, addr, [u64(hw), u64(pb.C), u64(pb.N)], [u64(hw * 2), u64(pb.C * hw * 2)],
                                 [u32(64), u32(BK), u32(1)], [u32(1), u32(1), u32(1)]),
                   "CU_TENSOR_MAP_L2_PROMOTION_L2_128B")


def _encode_tiled(pb, bn: int, addr: int) -> bytes:
    from cuda.bindings.driver import cuuint32_t as u32, cuuint64_t as u64
    return _encode(pb, "Tiled", (2, addr, [u64(pb.Kred), u64(pb.K)], [u64(pb.Kred * 2)], [u32(BK), u32(bn)],
                                 [u32(1), u32(1)]), "CU_TENSOR_MAP_L2_PROMOTION_L2_256B")


def _encode_tiled_mn(pb, addr: int) -> bytes:
    """kLoadTmaMN's B map: w as [Kred][K] (a 1x1 filter transposed), boxes of 64 columns x 64 k-rows, SW128."""
    from cuda.bindings.driver import cuuint32_t as u32, cuuint64_t as u64
    return _encode(pb, "Tiled", (2, addr, [u64(pb.K), u64(pb.Kred)], [u64(pb.K * 2)], [u32(64), u32(BK)],
                                 [u32(1), u32(1)]), "CU_TENSOR_MAP_L2_PROMOTION_L2_256B")


class MapTemplate:
    """A tensor map encoded once, re-addressed per call by patching one 64-bit word.

    ``encode(addr) -> 128 bytes``. On the first address the map is encoded for it and for three others
    (+16 bytes, +16 MiB, +64 GiB: low, middle and high address bits); if each time exactly one word, the
    same one, differs and by exactly the address difference, that word is the address field and later
    calls only add ``addr - first``. Otherwise every new address is encoded (cached per address)."""

    __slots__ = ("_encode", "base", "word", "addr0", "_cache")

    def __init__(self, encode):
        self._encode = encode
        self.base = None
        self.word = -1
        self.addr0 = 0
        self._cache: dict = {}

    def _learn(self, addr: int) -> None:
        b0 = np.frombuffer(self._encode(addr), dtype=np.uint64).copy()
        word = None
        try:
            for delta in (16, 16 << 20, 1 << 36):      # low, middle and high address bits
                b1 = np.frombuffer(self._encode(addr + delta), dtype=np.uint64)
                diff = np.nonzero(b1 != b0)[0]
                if (len(diff) != 1 or int(b1[diff[0]]) - int(b0[diff[0]]) != delta
                        or word not in (None, int(diff[0]))):
                    word = -1
                    break
                word = int(diff[0])
        except RuntimeError:                           # the encoder refused a probe address
            word = -1
        self.base, self.addr0, self.word = b0, addr, word

    def write(self, u64: np.ndarray, slot: int, addr: int, full: bool = True) -> None:
        """Put the map for ``addr`` into ``u64[slot:slot + 16]`` (a PackedArgs buffer); ``full=False``: the
        buffer already holds this template's map for another address, patch the address word only."""
        if self.base is None:
            self._learn(addr)
        if self.word >= 0:
            if full:
                u64[slot:slot + 16] = self.base
            u64[slot + self.word] = (int(self.base[self.word]) + addr - self.addr0) & 0xFFFFFFFFFFFFFFFF
            return
        m = self._cache.get(addr)
        if m is None:
            if len(self._cache) > 64:
                self._cache.clear()
            m = self._cache[addr] = np.frombuffer(self._encode(addr), dtype=np.uint64).copy()
        u64[slot:slot + 16] = m


def _encode_patch(pb, addr: int) -> bytes:
    """The patch loader's map (csrc/conv/patch.cuh): x NHWC as [N][H][W*C], boxes of {128 elements, R rows,
    1 image}, no swizzle; zero fill outside x is the conv's padding."""
    from cuda.bindings.driver import cuuint32_t as u32, cuuint64_t as u64
    wc = pb.W * pb.C
    return _encode(pb, "Tiled", (3, addr, [u64(wc), u64(pb.H), u64(pb.N)], [u64(wc * 2), u64(pb.H * wc * 2)],
                                 [u32(PATCH_BOX), u32(pb.R), u32(1)], [u32(1), u32(1), u32(1)]),
                   "CU_TENSOR_MAP_L2_PROMOTION_L2_128B", "CU_TENSOR_MAP_SWIZZLE_NONE")


class PatchMap:
    """The patch kernel's one map (x), with :class:`ConvMaps`' interface (``patch``: its address word, as
    ConvMaps', with no B map)."""

    __slots__ = ("a", "slot_a", "patch")

    def __init__(self, kproblem, slot_a: int):
        self.a = MapTemplate(lambda addr: _encode_patch(kproblem, addr))
        self.slot_a, self.patch = slot_a, None

    def write(self, u64: np.ndarray, x: int, w: int, full: bool) -> None:
        self.a.write(u64, self.slot_a, x, full)
        if self.patch is None and self.a.word >= 0:      # (index, offset) of the address word; no B map
            self.patch = (self.slot_a + self.a.word, int(self.a.base[self.a.word]) - self.a.addr0, None, None)


class MapPair:
    """A kernel's two maps (:class:`MapTemplate` ``a`` and ``b``), written into its argument buffer at ``slot_a`` and
    ``slot_b``."""

    __slots__ = ("a", "b", "slot_a", "slot_b", "patch")

    def __init__(self, a: MapTemplate, b: MapTemplate, slot_a: int, slot_b: int):
        self.a, self.b, self.slot_a, self.slot_b = a, b, slot_a, slot_b
        #: after the first write, where both maps have one address word: (index, offset) per map, so that a
        #: call whose buffer already holds these maps sets ``u64[index] = offset + address`` (callers inline it)
        self.patch = None

    def write(self, u64: np.ndarray, x: int, w: int, full: bool) -> None:
        """``full``: the buffer's map slots do not hold these maps yet (else only the addresses change)."""
        self.a.write(u64, self.slot_a, x, full)
        self.b.write(u64, self.slot_b, w, full)
        if self.patch is None and self.a.word >= 0 and self.b.word >= 0:
            self.patch = (self.slot_a + self.a.word, int(self.a.base[self.a.word]) - self.a.addr0,
                          self.slot_b + self.b.word, int(self.b.base[self.b.word]) - self.b.addr0)


class ConvMaps(MapPair):
    """The two maps of one conv kernel (x im2col-mode, w tiled), written into a plan's argument buffer."""

    __slots__ = ()

    def __init__(self, kproblem, spec, slot_a: int, slot_b: int):
        if spec.load_a == "tmamn":
            a = MapTemplate(lambda addr: _encode_nchw(kproblem, addr))
        else:
            a = MapTemplate(lambda addr: _encode_im2col(kproblem, spec.bm, addr))
        if spec.load_b == "tmamn":
            b = MapTemplate(lambda addr: _encode_tiled_mn(kproblem, addr))
        else:
            b = MapTemplate(lambda addr: _encode_tiled(kproblem, spec.bn, addr))
        super().__init__(a, b, slot_a, slot_b)
