"""The conv kernel's specialisation: ``KernelSpec`` (every template argument of ``igemm::conv::Config``), its
shared memory, store modes and register cap, the check that a spec can run a problem, the launch parameters and
the generated stub (an ``#include`` and one instantiation).
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import _kernel
from .._kernel import ParamSpec
from .._runtime import DTYPE_CTYPE, DTYPE_SIZES
from ._problem import PATCH_MAX_BYTES, ConvProblem, patch_bytes
from ._tma import tma_kind, tma_unsupported

__all__ = ["KernelSpec", "CONV_PARAMS", "stub", "validate_spec", "bn_stats_ok", "store_for", "regs_epilogue_ok",
           "min_blocks_for", "max_ctas", "one_consumer_stages", "NCHW_STORES", "REGS_STORES", "SMEM_LIMIT",
           "SMEM_PER_SM"]

#: The conv family's launch parameters, in order (the one definition; the stub is rendered from it).
CONV_PARAMS = [
    ParamSpec("x", "ptr"), ParamSpec("w", "ptr"), ParamSpec("y", "ptr"), ParamSpec("residual", "ptr"),
    ParamSpec("scale", "ptr"), ParamSpec("shift", "ptr"), ParamSpec("alpha", "ptr"), ParamSpec("mask", "ptr"),
    ParamSpec("ws", "ptr"), ParamSpec("counters", "ptr"), ParamSpec("ktab", "ptr"),
    ParamSpec("alpha_scalar", "float32"), ParamSpec("splits", "int32"), ParamSpec("kt_per_split", "int32"),
    *(ParamSpec(n, "int32") for n in ("N", "H", "W", "C", "K", "R", "S", "P", "Q", "PQ", "M", "Kred",
                                      "sh", "sw", "ph", "pw", "dh", "dw")),
    ParamSpec("x_img", "int64"),
    *(ParamSpec(n, "fastdiv") for n in ("fd_PQ", "fd_Q", "fd_C", "fd_S", "fd_RS", "fd_K")),
    ParamSpec("tmA", "tmap"), ParamSpec("tmB", "tmap"),     # TMA loader only (igemm/conv/_tma.py)
]

#: shared memory a CTA may take, and an SM has for its CTAs (sm_90: 228 KB, 1 KB of it reserved per CTA)
SMEM_LIMIT = 227 * 1024
SMEM_PER_SM = 228 * 1024


@dataclass(frozen=True)
class KernelSpec:
    dtype: str
    layout: str
    math: str                 # "tensorop" | "tf32x3" | "simt" | "wgmma" | "wgmma_ws" | "tf32x3_wgmma"
    bm: int
    bn: int
    bk: int
    wm: int
    wn: int
    stages: int
    load_a: str               # "vec" | "elem" | "tma" | "tma8" | "tmamn" | "patch" (sm_90a: igemm/conv/_tma.py)
    load_b: str               # "vec" | "elem" | "tma" | "tmamn" (w given as [Kred][K]: a 1x1 dgrad's filter)
    store: str                # "rows" | "linear" | "nchw" | "regs" | "regsnchw" (register epilogues: store_for)
    vec_o: int
    fuse_mask: bool
    epilogue: tuple = ()      # C++ functor types, in order
    splits: int = 1           # split-K factor (a launch parameter, not a template argument)
    min_blocks: int = 1
    patch_bytes: int = 0      # load_a "patch": the input patch's shared memory (problem-dependent, not in the code)
    streamk: int = 0          # stream-K (the per-tile TMA kernel): CTAs per SM sharing the tiles x k-tiles; 0: off
    csplit: int = 1           # 2: the persistent kernel's cluster k-split (two CTAs a tile, each half the k-tiles)
    #: the persistent kernel's CTAs per SM (grid min(tiles, ctas x SMs)): more than one where the reduction is
    #: short and the epilogue long (a 1x1 conv's single k-tile), so that each CTA's producer loads its next
    #: tile while its consumer runs the epilogue, beside the other CTAs' mainloops
    ctas: int = 1
    #: the register epilogue also writes the output's per-tile BatchNorm statistics (the training forward's;
    #: csrc/conv/epilogue_regs.cuh: tile_bn_stats) to the launch's ``ws``
    bn_stats: bool = False

    @property
    def threads(self) -> int:
        return {"tensorop": self.wm * self.wn * 32, "tf32x3": self.wm * self.wn * 32, "wgmma": self.wm * 128,
                "wgmma_ws": self.wm * 128 + 32, "tf32x3_wgmma": self.wm * 128}.get(self.math, 256)

    @property
    def tma(self) -> bool:
        """Both operands arrive by TMA copies (B K-major, or MN-major: ``"tmamn"``)."""
        return self.load_b in ("tma", "tmamn")

    @property
    def persistent(self) -> bool:
        """The persistent warp-specialised kernel: grid min(tiles, ctas x SMs), WM consumer warpgroups of
        BM-row tiles and a producer warp (``Config`` kWgmmaWs)."""
        return self.math == "wgmma_ws"

    @property
    def smem(self) -> int:
        """Dynamic shared memory, exactly as ``Config::kSmemBytes`` computes it."""
        eb = DTYPE_SIZES[self.dtype]
        main = self.stages * (self.bm + self.bn) * self.bk * (4 if self.math == "simt" else eb)
        if self.math == "tf32x3_wgmma":      # B's small parts (double-buffered) and cross parts
            main += 3 * self.bn * self.bk * eb
        if self.store not in NCHW_STORES:    # pixel-major C tile (Config::kCsPixelMajor)
            cs = self.bm * (self.bn + 8) * 4
        else:
            cs = self.bn * (self.bm + 4) * 4
        if self.persistent:                  # a stage ring and a C tile per consumer warpgroup
            if self.store in REGS_STORES and self.csplit == 1 and not self.residual:   # (Config::kCsCompact)
                cs = self.bn * (self.bm + 8) * 2 + self.bn * (self.bm // 32) * 4 if self.store == "regsnchw" \
                    else self.bm * (self.bn + 8) * 2
            return self.wm * (main + cs) + 1024
        if self.load_a == "patch":           # two A buffers, B for the whole reduction, then the patch
            main = (2 * self.bm + self.stages * self.bn) * self.bk * eb + self.patch_bytes
        return max(main, cs) + (1024 if self.math in ("wgmma", "tf32x3_wgmma") else 128)

    @property
    def residual(self) -> bool:
        """Whether the epilogue chain reads a residual."""
        return any(f.startswith("igemm::epi::AddResidual<") for f in self.epilogue)

    @property
    def residual16(self) -> bool:
        """Whether the epilogue chain reads a 16-bit (half or bfloat16: cutlass types) residual."""
        return any(f.startswith("igemm::epi::AddResidual<cutlass::") for f in self.epilogue)

    @property
    def residual_staged(self) -> bool:
        """Whether the kernel stages a 16-bit residual in shared memory during the mainloop
        (csrc/conv/residual.cuh: kStageResidual, kStageResidualNchw, kStageResidualNchwWs): the register
        epilogues, NHWC with BN <= 128 or NCHW with vectors of 4 pixels or more; the per-tile TMA kernel and the
        persistent one, which stages NCHW with any vector (at the tile's start, but not with the cluster k-split)."""
        return self.residual16 and (self.store == "regs" and self.bn <= 128
                                    or self.store == "regsnchw" and (self.vec_o >= 4
                                                                     or self.persistent and self.csplit == 1))

    @property
    def residual_preloaded(self) -> bool:
        """Whether the patch kernel loads a 16-bit residual into registers at the tile's start
        (csrc/conv/residual.cuh: kPreloadResidual): the NHWC register epilogue, BN <= 128."""
        return self.residual16 and self.load_a == "patch" and self.store == "regs" and self.bn <= 128

    def launch_smem(self, kt: int) -> int:
        """Dynamic shared memory for a launch whose CTAs run ``kt`` k-tiles each: the TMA mainloop lays its
        stages out one after another and touches only the first ``min(kt, stages)``, so a short reduction
        (a 1x1 conv over 64 channels: one k-tile) launches with less and fits more CTAs per SM -- one stage
        more where the residual is staged (:attr:`residual_staged`: into stage ``kt``, before the mainloop)."""
        if self.math != "wgmma" or not self.tma or kt >= self.stages:
            return self.smem
        used = max(kt, 1) + (1 if self.residual_staged and not self.streamk else 0)
        if used >= self.stages:
            return self.smem
        main = used * (self.bm + self.bn) * self.bk * DTYPE_SIZES[self.dtype]
        cs = self.bm * (self.bn + 8) * 4 if self.store not in NCHW_STORES else self.bn * (self.bm + 4) * 4
        return max(main, cs) + 1024

    @property
    def static_smem(self) -> int:
        if self.persistent:                  # per consumer: channel vectors, full and empty barriers (+ xfer)
            return self.wm * (3 * self.bn * 4 + 16 * self.stages) + 16
        return 3 * self.bn * 4 + 16 + (8 * self.stages if self.tma else 8 if self.load_a == "patch" else 0)

    def config_type(self) -> str:
        t = DTYPE_CTYPE[self.dtype]
        ns = "igemm::conv::"
        epi = "igemm::epi::Chain<" + ", ".join(self.epilogue) + ">"
        args = [t, t, ns + ("kNHWC" if self.layout == "NHWC" else "kNCHW"),
                ns + {"tensorop": "kTensorOp", "tf32x3": "kTensorOp3", "simt": "kSimt", "wgmma": "kWgmma",
                            "wgmma_ws": "kWgmmaWs", "tf32x3_wgmma": "kWgmmaTf32x3"}[self.math],
                self.bm, self.bn, self.bk, self.wm, self.wn, self.stages,
                ns + _LOADS[self.load_a], ns + _LOADS[self.load_b],
                ns + {"rows": "kStoreRows", "linear": "kStoreLinear", "nchw": "kStoreNCHW",
                      "regs": "kStoreRegs", "regsnchw": "kStoreRegsNCHW"}[self.store],
                self.vec_o, "true" if self.fuse_mask else "false", epi]
        return ns + "Config<" + ", ".join(str(a) for a in args) + ">"

    def name(self) -> str:
        return (f"conv_{self.dtype}_{self.layout}_{self.math}_{self.bm}x{self.bn}x{self.bk}_w{self.wm}x{self.wn}"
                f"_s{self.stages}_{self.load_a}{self.load_b}_{self.store}{self.vec_o}{'_m' if self.fuse_mask else ''}"
                f"{'_sk' if self.streamk else ''}{f'_cs{self.csplit}' if self.csplit > 1 else ''}"
                f"{f'_x{self.ctas}' if self.ctas > 1 else ''}{'_bs' if self.bn_stats else ''}")

    def prelude(self) -> str:
        """Macros in front of the kernel source (the Hopper kernels' compile-time variants)."""
        if self.math not in ("wgmma", "wgmma_ws", "tf32x3_wgmma"):
            return ""
        return ("#define IGEMM_WGMMA 1" + ("\n#define IGEMM_STREAMK 1" if self.streamk else "")
                + (f"\n#define IGEMM_CSPLIT {self.csplit}" if self.csplit > 1 else "")
                + (f"\n#define IGEMM_WS_CTAS {self.ctas}" if self.ctas > 1 else "")
                + ("\n#define IGEMM_BN_STATS 1" if self.bn_stats else ""))


#: the store modes of NCHW outputs (a channel-major C tile)
NCHW_STORES = ("nchw", "regsnchw")
#: the register epilogues' store modes
REGS_STORES = ("regs", "regsnchw")

_LOADS = {"vec": "kLoadVec", "elem": "kLoadElem", "tma": "kLoadTma", "tma8": "kLoadTmaC8", "patch": "kLoadPatch",
          "tmamn": "kLoadTmaMN"}


def regs_epilogue_ok(pb: ConvProblem, math: str, splits: int) -> bool:
    """Whether a register epilogue (the chain on the accumulators, a 16-bit C tile, the mask from its
    stored vectors; ``csrc/conv/epilogue_regs*.cuh`` epilogue_regs_by / epilogue_regs_nchw_by) can store this problem: the
    per-tile wgmma kernel or the persistent one, 16-bit output, no split-K; NHWC with K % 8 == 0 (16-byte
    vectors, store ``"regs"``), or NCHW with a 16-bit residual if any (staged in the 16-bit C tile; store
    ``"regsnchw"``)."""
    if math not in ("wgmma", "wgmma_ws") or splits != 1 or DTYPE_SIZES[pb.dtype] != 2:
        return False
    if pb.y_layout == "NHWC":
        return pb.K % 8 == 0
    return pb.residual_dtype is None or DTYPE_SIZES[pb.residual_dtype] == 2


def _regs_store(pb: ConvProblem) -> tuple[str, int, bool]:
    """A register epilogue's (store, output vector width, mask fusion): NHWC, a mask byte from each 8-channel
    vector (K % 8 == 0, as the register epilogue needs); NCHW, the widest vector inside one image's plane (as
    :func:`_store`) and a mask byte from each 8-pixel vector (P·Q % 8 == 0)."""
    if pb.y_layout == "NHWC":
        return "regs", 8, pb.mask
    _, v, _ = _store(pb, 0)
    return "regsnchw", v, pb.mask and v == 8


def store_for(pb: ConvProblem, math: str, bn: int, splits: int, regs: bool = True) -> tuple[str, int, bool]:
    """Store mode, output vector width and mask fusion for a kernel: the register epilogue where
    :func:`regs_epilogue_ok` (unless ``regs=False``), else :func:`_store`'s (the fp32 C tile's modes)."""
    if regs and regs_epilogue_ok(pb, math, splits):
        return _regs_store(pb)
    return _store(pb, bn)


def _store(pb: ConvProblem, bn: int) -> tuple[str, int, bool]:
    """Store mode, output vector width and whether the ReLU mask can be fused (the CTA owns whole words)."""
    vo = 16 // DTYPE_SIZES[pb.dtype]
    if pb.y_layout == "NHWC":
        if pb.K <= bn:
            return "linear", vo, pb.mask                 # the CTA owns rows [m0, m0+BM) of all K channels
        return "rows", (vo if pb.K % vo == 0 else 1), pb.mask and pb.K % 32 == 0
    PQ = pb.P * pb.Q
    v = vo
    while PQ % v:           # the widest vector that stays inside one image's plane (14x14: 4, 7x7: 1)
        v //= 2
    return "nchw", v, pb.mask and PQ % 32 == 0


def one_consumer_stages(bn: int) -> int:
    """The one-consumer persistent kernel's ring: as deep as fits beside its C tile (64x64 tiles: 8 stages,
    64x128: 6, 64x256: 3)."""
    return {64: 8, 128: 6}.get(bn, 3)


def min_blocks_for(spec: KernelSpec) -> int:
    """The register cap (``__launch_bounds__`` min blocks) of a spec: single-warpgroup wgmma tiles get 3
    CTAs per SM, 4 where shared memory holds 4 and the accumulators are at most 64 registers a thread
    (BN <= 128; docs/performance.md: min-blocks-4)."""
    if spec.persistent:
        return spec.ctas
    if spec.residual_preloaded:
        # the preloaded residual pairs live in registers from the tile's start: cap them so that as many CTAs
        # as shared memory holds (at most 3) keep theirs (docs/performance.md: patch-residual-cap)
        return max(1, min(3, SMEM_PER_SM // (spec.smem + spec.static_smem + 1024)))
    if spec.math == "wgmma" and spec.bm == 128 and spec.store == "regsnchw" and spec.vec_o == 1 and spec.residual:
        # NCHW with P·Q odd and a residual: uncapped, the 2-byte residual loads beside the accumulators took
        # 160+ registers and one CTA an SM; capped at two CTAs where shared memory holds them, and only this
        # tile (docs/performance.md: nchw-residual-cap)
        return 2 if 2 * (spec.smem + spec.static_smem + 1024) <= SMEM_PER_SM else 1
    if spec.math != "wgmma" or spec.bm != 64:
        return 1
    if spec.bn <= 128 and 4 * (spec.smem + spec.static_smem) <= SMEM_LIMIT:
        return 4
    return 3


def max_ctas(spec: KernelSpec, cap: int = 4) -> int:
    """The most CTAs of a persistent spec an SM holds (shared memory; at most ``cap``; registers: the launch
    bounds then cap each thread at 65536 / (threads x CTAs))."""
    return max(1, min(cap, SMEM_PER_SM // (spec.smem + spec.static_smem + 1024)))


def validate_spec(spec: KernelSpec, pb: ConvProblem, raise_: bool = True) -> bool:
    """Whether a (possibly hand-made) spec can run ``pb``; raises NotImplementedError naming why."""
    eb = DTYPE_SIZES[pb.dtype]
    ce = 16 // eb
    why = None
    if spec.dtype != pb.dtype or spec.layout != pb.layout:
        why = "dtype/layout differ from the problem"
    elif spec.math.startswith("wgmma") and (eb != 2 or spec.bk * eb != 128 or spec.bm % 64 or spec.bn not in (64, 128, 192, 256)):
        why = "wgmma needs 16-bit types, BK*size = 128 bytes, BM % 64 == 0, BN in {64,128,192,256}"
    elif spec.math == "simt" and (pb.dtype != "float32" or (spec.bm, spec.bn, spec.bk) != (128, 128, 8)):
        why = "the SIMT kernel is fp32 128x128x8"
    elif pb.dtype == "float32" and pb.precision == "strict" and spec.math not in ("simt", "tf32x3", "tf32x3_wgmma"):
        why = "strict fp32 runs on the FFMA kernel (simt) or 3xTF32 (tf32x3, tf32x3_wgmma), not on single TF32"
    elif spec.math in ("tf32x3", "tf32x3_wgmma") and pb.dtype != "float32":
        why = "3xTF32 is for fp32"
    elif spec.math == "tf32x3_wgmma" and (spec.bk != 32 or spec.bm not in (64, 128) or spec.wm != spec.bm // 64
                                          or spec.wn != 1 or spec.bn not in (64, 128) or spec.tma
                                          or spec.load_a == "patch" or spec.store in REGS_STORES):
        why = ("3xTF32 on wgmma: BK 32, one 64-row warpgroup per 64 rows (BM 64 or 128), BN 64 or 128, gathered "
               "loads, the fp32 C tile's store")
    elif spec.math in ("tensorop", "tf32x3") and (spec.bk * eb not in (32, 64, 128) or (spec.bn // spec.wn) % 16
                                      or (spec.bm // spec.wm) % 16):
        why = "tensor-op tile"
    elif spec.math == "tf32x3" and (spec.bm // spec.wm) * (spec.bn // spec.wn) > 64 * 32:
        why = "3xTF32 warp tiles are at most 64x32 (two fp32 accumulator sets: larger ones spill)"
    elif (spec.load_a.startswith("tma")) != spec.tma or (spec.tma and not spec.math.startswith("wgmma")):
        why = "TMA loads: both operands, wgmma only"
    elif spec.load_b == "tmamn" and (spec.load_a not in ("tmamn", "tma") or spec.bn > 128):
        why = "MN-major B tiles (w as [Kred][K]): with one-tap TMA A tiles, BN <= 128"
    elif spec.load_a.startswith("tma") and spec.load_a != tma_kind(pb):
        why = f"TMA loads of this problem are {tma_kind(pb)!r}"
    elif spec.streamk and (spec.math != "wgmma" or spec.load_a != "tma" or spec.store != "regs" or spec.splits != 1):
        why = "stream-K: the per-tile TMA wgmma kernel with the register epilogue, no split-K"
    elif spec.persistent and (spec.load_a not in ("tma", "tmamn") or spec.bm != 64 or spec.wm not in (1, 2)
                              or spec.splits != 1 or spec.bn not in (64, 128, 256)
                              or spec.load_a == "tmamn" and spec.wm != 1):
        why = ("the persistent kernel: TMA loads, one or two consumer warpgroups of 64-row tiles (one with NCHW x "
               "in place), no split-K")
    elif spec.csplit != 1 and (spec.csplit != 2 or not spec.persistent or spec.wm != 1 or -(-pb.Kred // spec.bk) < 2):
        why = "the cluster k-split: csplit 2, the persistent kernel with one consumer, at least 2 k-tiles"
    elif spec.ctas != 1 and (spec.ctas < 1 or not spec.persistent or spec.csplit != 1
                             or spec.ctas * (spec.smem + spec.static_smem + 1024) > SMEM_PER_SM):
        why = (f"ctas={spec.ctas}: several CTAs an SM are the persistent kernel's (no cluster k-split), "
               f"as many as {SMEM_PER_SM} bytes of shared memory hold")
    elif spec.bn_stats and not bn_stats_ok(spec):
        why = "BatchNorm statistics: the per-tile wgmma kernel's NHWC register epilogue (not stream-K, not the patch " \
              "kernel), BN 64 or 128"
    elif spec.tma and (no_tma := tma_unsupported(pb, spec.bm)):
        why = no_tma
    elif (spec.load_a == "patch") != pb.patch:
        why = "patch loads are the patch problem's, and only its"
    elif spec.load_a == "patch" and (spec.math != "wgmma" or spec.load_b != "vec" or spec.splits != 1
                                     or spec.stages < -(-pb.Kred // spec.bk) or spec.patch_bytes < patch_bytes(pb, spec.bm)):
        why = "the patch kernel: per-tile wgmma, gathered filter, no split-K, stages >= k-tiles, its patch's smem"
    elif spec.residual_preloaded and spec.patch_bytes - 16 > PATCH_MAX_BYTES:
        why = "the patch kernel with a preloaded residual packs patch offsets in 16 bits: a patch of at most 64 KB"
    elif spec.load_a == "vec" and not (pb.layout == "NHWC" and pb.C % ce == 0):
        why = f"16-byte activation loads need NHWC and C % {ce} == 0"
    elif spec.load_b == "vec" and pb.Kred % ce:
        why = f"16-byte filter loads need C*R*S % {ce} == 0"
    elif spec.store in REGS_STORES and (not regs_epilogue_ok(pb, spec.math, spec.splits)
                                        or (spec.store, spec.vec_o, spec.fuse_mask) != _regs_store(pb)):
        why = ("the register epilogues: wgmma, 16-bit output, no split-K; NHWC with K % 8 == 0 (regs), "
               "NCHW with a 16-bit residual if any (regsnchw)")
    elif spec.store not in REGS_STORES and (spec.store, spec.vec_o, spec.fuse_mask) != _store(pb, spec.bn)[:2] + (spec.fuse_mask and _store(pb, spec.bn)[2],):
        why = "store mode does not match the tile"
    elif spec.store not in REGS_STORES and spec.fuse_mask and not _store(pb, spec.bn)[2]:
        why = "the mask cannot be fused for this shape"
    elif (spec.residual_staged and spec.math == "wgmma" and spec.tma and not spec.streamk
          and spec.bm * spec.bn * 2 > (spec.bm + spec.bn) * spec.bk * eb):
        why = "the TMA mainloop stages the 16-bit residual tile (BM x BN) in one of its stages: it must fit one"
    elif spec.smem + spec.static_smem > SMEM_LIMIT:
        why = f"{spec.smem} bytes of shared memory"
    elif spec.splits < 1 or spec.splits > -(-pb.Kred // spec.bk):
        why = f"splits={spec.splits}"
    elif spec.math in ("tensorop", "tf32x3", "wgmma", "tf32x3_wgmma") and ((spec.bm * spec.bk * eb // 16) % spec.threads
                                                  or (spec.bn * spec.bk * eb // 16) % spec.threads):
        why = "loader partition"
    if why and raise_:
        raise NotImplementedError(f"kernel config {spec.name()}: {why}")
    return why is None


def bn_stats_ok(spec: KernelSpec) -> bool:
    """Whether ``spec``'s kernel writes its output's BatchNorm statistics (``bn_stats``) where asked: the per-tile
    wgmma kernels' NHWC register epilogue, not the patch kernel's (conv1 at N = 256: its epilogue +116 us against the
    statistics pass's 94; docs/performance.md: bn-stats-in-epilogue)."""
    return (spec.math == "wgmma" and spec.store == "regs" and not spec.streamk and spec.splits == 1
            and spec.bn in (64, 128) and spec.load_a != "patch")


def stub(spec: KernelSpec) -> str:
    """The generated source of ``spec``'s kernel (its cache key with the headers' hash)."""
    return _kernel.render_kernel(include="conv/fprop.cuh", entry="igemm_conv2d_fprop", params=CONV_PARAMS,
                                 threads=spec.threads, min_blocks=spec.min_blocks, prelude=spec.prelude(),
                                 cluster=spec.csplit, body=f"igemm::conv::fprop<{spec.config_type()}>(p);")
