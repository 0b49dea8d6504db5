"""Kernel specialisation of the conv family: ``KernelSpec`` and ``choose_config(problem, arch)``.

A :class:`KernelSpec` fixes everything that is a template argument of ``igemm::conv::Config``; choosing
it is a pure function of the problem (shapes, dtypes, layout, epilogue structure, pointer alignment)
and the architecture, unit-tested without a GPU.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ._runtime import DTYPE_CTYPE, DTYPE_SIZES

__all__ = ["ConvProblem", "KernelSpec", "choose_config", "candidates", "validate_spec", "choose_splits",
           "nchw_path", "kernel_problem", "kernel_channels", "kernel_setup", "use_unfold", "store_for",
           "regs_epilogue_ok", "patch_config", "patch_bytes", "patch_unsupported", "subsampled", "max_ctas"]


@dataclass(frozen=True)
class ConvProblem:
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
    layout: str           # "NCHW" | "NHWC"
    precision: str        # "strict" | "tf32" (fp32 only; 16-bit types always use tensor cores)
    epilogue: tuple = ()  # Chain.signature()
    residual_dtype: str | None = None
    out_layout: str | None = None   # the output's layout when it differs from the input's (NCHW transpose path)
    #: the patch loader's problem (csrc/conv/patch.cuh): x as given, the reduction over the width-unfolded
    #: filter, R x roundup(S*C, 16 bytes) long (igemm/_unfold.py)
    patch: bool = False

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
            from ._unfold import unfold_channels
            return self.R * unfold_channels(self.C, self.S, DTYPE_SIZES[self.dtype])
        return self.C * self.R * self.S

    @property
    def flops(self) -> int:
        return 2 * self.M * self.K * self.Kred

    @property
    def y_layout(self) -> str:
        return self.out_layout or self.layout

    @property
    def mask(self) -> bool:
        return any(sig == ("ReLU", True) for sig in self.epilogue)


@dataclass(frozen=True)
class KernelSpec:
    dtype: str
    layout: str
    math: str                 # "tensorop" | "tf32x3" | "simt" | "wgmma" | "wgmma_ws"
    bm: int
    bn: int
    bk: int
    wm: int
    wn: int
    stages: int
    load_a: str               # "vec" | "elem" | "tma" | "tma8" (sm_90a wgmma; load_b "tma": igemm/_tma.py)
    load_b: str
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

    @property
    def threads(self) -> int:
        return {"tensorop": self.wm * self.wn * 32, "tf32x3": self.wm * self.wn * 32, "wgmma": self.wm * 128,
                "wgmma_ws": self.wm * 128 + 32}.get(self.math, 256)

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
        return max(main, cs) + (1024 if self.math == "wgmma" else 128)

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
        more where the residual is staged (:attr:`residual_staged`: into stage ``kt``, before the mainloop).
        ``IGEMM_SMEM_TRIM=0``: always :attr:`smem`."""
        import os
        if (self.math != "wgmma" or self.load_b != "tma" or kt >= self.stages
                or os.environ.get("IGEMM_SMEM_TRIM", "1") == "0"):
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
        return 3 * self.bn * 4 + 16 + (8 * self.stages if self.load_b == "tma" else 8 if self.load_a == "patch" else 0)

    def config_type(self) -> str:
        t = DTYPE_CTYPE[self.dtype]
        ns = "igemm::conv::"
        epi = "igemm::epi::Chain<" + ", ".join(self.epilogue) + ">"
        args = [t, t, ns + ("kNHWC" if self.layout == "NHWC" else "kNCHW"),
                ns + {"tensorop": "kTensorOp", "tf32x3": "kTensorOp3", "simt": "kSimt", "wgmma": "kWgmma",
                            "wgmma_ws": "kWgmmaWs"}[self.math],
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
                f"{f'_x{self.ctas}' if self.ctas > 1 else ''}")

    def prelude(self) -> str:
        """Macros in front of the kernel source. ``IGEMM_KERNEL_DEFINES`` (space-separated names, each
        defined to 1) adds the kernels' A/B switches for measurements, e.g. ``IGEMM_NO_RES_STAGE``: they are
        part of the source, hence of the kernel cache key."""
        import os
        extra = "".join(f"\n#define {d} 1" for d in os.environ.get("IGEMM_KERNEL_DEFINES", "").split())
        if self.math not in ("wgmma", "wgmma_ws"):
            return extra.lstrip("\n")
        return ("#define IGEMM_WGMMA 1" + ("\n#define IGEMM_STREAMK 1" if self.streamk else "")
                + (f"\n#define IGEMM_CSPLIT {self.csplit}" if self.csplit > 1 else "")
                + (f"\n#define IGEMM_WS_CTAS {self.ctas}" if self.ctas > 1 else "") + extra)


#: the store modes of NCHW outputs (a channel-major C tile)
NCHW_STORES = ("nchw", "regsnchw")
#: the register epilogues' store modes
REGS_STORES = ("regs", "regsnchw")

_LOADS = {"vec": "kLoadVec", "elem": "kLoadElem", "tma": "kLoadTma", "tma8": "kLoadTmaC8", "patch": "kLoadPatch",
          "tmamn": "kLoadTmaMN"}

PATCH_BOX, PATCH_STEP, PATCH_ALIGN = 128, 120, 8      # csrc/conv/patch.cuh: kPatchBox, kPatchStep, kPatchAlign


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


PATCH_MAX_BYTES = 64 * 1024


def patch_unsupported(pb: ConvProblem, arch: str) -> str | None:
    """Why the patch loader (the width unfold in shared memory, csrc/conv/patch.cuh) cannot run ``pb``
    (the user's problem; None: it can)."""
    import os
    from ._unfold import unfold_channels
    if os.environ.get("IGEMM_PATCH", "1") == "0":
        return "IGEMM_PATCH=0"
    if not arch.startswith("sm_90"):
        return "the patch loader is sm_90 code (TMA, wgmma)"
    if pb.layout != "NHWC" or DTYPE_SIZES[pb.dtype] != 2:
        return "the patch loader reads 16-bit NHWC x"
    if pb.dilation != (1, 1):
        return "the patch loader needs dilation 1"
    if pb.W * pb.C * 2 % 16:
        return "the patch's tensor map needs rows of x (W*C elements) in multiples of 16 bytes"
    if pb.R > 256 or max(pb.N, pb.H, pb.W * pb.C) >= 2 ** 31 or pb.stride[1] * pb.C * 128 >= 2 ** 31:
        return "tensor too large for the patch's tensor map"
    if -(-pb.R * unfold_channels(pb.C, pb.S, 2) // 64) > 8:
        return "the patch kernel keeps the whole filter tile resident: at most 8 k-tiles"
    if patch_bytes(pb, 64) > PATCH_MAX_BYTES:
        return "the patch of a tile would exceed 64 KB of shared memory"
    spec = patch_config(dataclasses.replace(pb, patch=True), bm=64)
    if spec.smem + spec.static_smem > SMEM_LIMIT:
        return f"the patch kernel would need {spec.smem} bytes of shared memory"
    return None


def use_tma(pb: ConvProblem, arch: str, bm: int) -> bool:
    """Whether the wgmma kernel can load through TMA (igemm/_tma.py): sm_90, 16-bit NHWC with C % 64 == 0
    (or C == 8: 8-tap k-tiles, a candidate only), within the tensor maps' limits. ``IGEMM_TMA=0`` turns it off (the cp.async gather then runs)."""
    import os
    from ._tma import tma_unsupported
    return (arch.startswith("sm_90") and os.environ.get("IGEMM_TMA", "1") != "0"
            and tma_unsupported(pb, bm) is None)


def epilogue_functors(problem: ConvProblem) -> tuple[str, ...]:
    """C++ functor types for the problem's chain (affine group folded into one ScaleShift/Shift)."""
    out: list[str] = []
    sig = problem.epilogue
    i = 0
    while i < len(sig):
        kind = sig[i][0]
        if kind in ("BatchNorm", "Bias"):
            j = i
            has_scale = False
            while j < len(sig) and sig[j][0] in ("BatchNorm", "Bias"):
                has_scale |= sig[j][0] == "BatchNorm"
                j += 1
            out.append("igemm::epi::ScaleShift" if has_scale else "igemm::epi::Shift")
            i = j
            continue
        if kind == "Add":
            out.append(f"igemm::epi::AddResidual<{DTYPE_CTYPE[problem.residual_dtype or problem.dtype]}>")
        elif kind == "ReLU":
            out.append(f"igemm::epi::Relu<{'true' if sig[i][1] else 'false'}>")
        elif kind == "PReLU":
            out.append(f"igemm::epi::PRelu<{'true' if sig[i][1] else 'false'}>")
        else:
            raise NotImplementedError(f"epilogue op {kind}")
        i += 1
    return tuple(out)


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
    return not any(sig[0] == "Add" for sig in pb.epilogue) or DTYPE_SIZES[pb.residual_dtype or pb.dtype] == 2


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
    :func:`regs_epilogue_ok` (unless ``regs=False``; ``IGEMM_REG_EPI=0`` turns it off), else :func:`_store`'s
    (the fp32 C tile's modes)."""
    import os
    if regs and regs_epilogue_ok(pb, math, splits) and os.environ.get("IGEMM_REG_EPI", "1") != "0":
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


NCHW_PATHS = ("auto", "native", "transpose")


def nchw_path(pb: ConvProblem, requested: str = "auto", pad: bool | None = None, arch: str | None = None) -> str:
    """How an NCHW problem runs: ``"native"`` (the NCHW gather: one 2-byte element per load for 16-bit
    types) or ``"transpose"`` (x and w transposed to NHWC/KRSC in one kernel, the 16-byte NHWC gather,
    NCHW stores from the epilogue). ``auto``: transpose for 16-bit types whose C allows 16-byte loads
    (C % 8 == 0), or that are padded (``pad=True``, see :func:`kernel_channels`); measured on an H200 in
    benchmarks/bench_conv.py (notes/perf.md). NHWC: always native."""
    if requested not in NCHW_PATHS:
        raise ValueError(f"nchw_path: expected one of {NCHW_PATHS}, got {requested!r}")
    if pb.layout != "NCHW":
        return "native"
    if requested != "auto":
        return requested
    if arch is not None and not pad and use_tma(pb, arch, 64):
        # a 1x1 stride-1 conv with H*W % 64 == 0 reads NCHW x directly: MN-major TMA tiles (load_a "tmamn")
        return "native"
    return "transpose" if DTYPE_SIZES[pb.dtype] == 2 and (pb.C % 8 == 0 or (pad and pb.C < 8)) else "native"


def kernel_channels(pb: ConvProblem, path: str, pad: bool | None = None) -> int:
    """The channel count the conv kernel sees: 8 when a 16-bit problem with C < 8 is run on copies of x
    and w with zero channels added (``pad=True``; the gather then uses 16-byte loads instead of element
    loads), else C. Opt-in: on an H200 the padded conv1 (7x7/2, C = 3 -> 8) measured slower than the
    element gather (218 vs 162 us NHWC; the padded GEMM does 8/3 of the work). The copy needs the NHWC
    side: an NCHW problem pads on its transpose path."""
    if not pad:
        return pb.C
    if DTYPE_SIZES[pb.dtype] != 2 or pb.C >= 8 or (pb.layout == "NCHW" and path != "transpose"):
        raise ValueError("pad_channels=True needs a 16-bit problem with C < 8 (and, for NCHW, the transpose path)")
    return 8


def subsampled(pb: ConvProblem) -> bool:
    """A 1x1 strided conv without padding reads only ``x[:, :, ::sh, ::sw]``: the NCHW transpose path copies
    just those pixels (1x1/2 512->1024 @28, N=32, on an H100: the full transpose took 18.5 us of the call's
    37.7, with the conv itself 19.2; tools/kernel_breakdown.py)."""
    return pb.R == pb.S == 1 and pb.padding == (0, 0) and pb.stride != (1, 1)


def kernel_problem(pb: ConvProblem, path: str, channels: int | None = None) -> ConvProblem:
    """The problem the conv kernel itself sees on ``path`` (the transpose path: NHWC in, NCHW out) with
    ``channels`` input channels (:func:`kernel_channels`)."""
    kp = pb
    if path == "transpose" and pb.layout == "NCHW":
        kp = dataclasses.replace(kp, layout="NHWC", out_layout="NCHW")
        if subsampled(pb):                  # the copy holds only x[:, :, ::sh, ::sw]: a 1x1 stride-1 conv on it
            kp = dataclasses.replace(kp, H=pb.P, W=pb.Q, stride=(1, 1), dilation=(1, 1))
    if channels is not None and channels != pb.C:
        kp = dataclasses.replace(kp, C=channels)
    return kp


def use_unfold(pb: ConvProblem, nchw: str = "auto", pad: bool | None = None, unfold: bool | None = None) -> bool:
    """Whether the plan runs on width-unfolded copies of x and w (``igemm/_unfold.py``: C -> roundup(S*C, V),
    S -> 1, so the gather moves 16 bytes a load). ``auto`` (``None``): for inputs whose pixel is under 16
    bytes (C * element size < 16: conv1's C = 3) with S > 1, either layout, unless ``pad_channels`` or an
    explicit ``nchw_path`` is asked for; 16-bit types only (fp32 conv1 measured slower unfolded: 668 vs
    493 us on an H100, N=32). conv1 (7x7/2, C = 3 -> 24): notes/perf.md."""
    if unfold is None:
        es = DTYPE_SIZES[pb.dtype]
        return not pad and nchw == "auto" and es == 2 and pb.C * es < 16 and pb.S > 1 and _unfold_fits(pb)
    if unfold and (pad or nchw != "auto"):
        raise ValueError("unfold=True replaces the channel pad and the NCHW paths: leave pad_channels and "
                         "nchw_path unset")
    if unfold and not _unfold_fits(pb):
        raise NotImplementedError("unfold=True: the unfolded copy of x is too large for igemm's 32-bit index math")
    return bool(unfold)


def _unfold_fits(pb: ConvProblem) -> bool:
    from ._unfold import fits
    return fits(pb, DTYPE_SIZES[pb.dtype])


def kernel_setup(pb: ConvProblem, nchw: str = "auto", pad: bool | None = None,
                 unfold: bool | str | None = None, arch: str | None = None) -> tuple[str, ConvProblem]:
    """(path, the kernel's problem) for a plan's problem and its options: the width unfold
    (:func:`use_unfold`) as path ``"patch"`` (in shared memory: :func:`patch_unsupported`; ``arch`` given,
    ``unfold`` not ``"copy"``) or ``"unfold"`` (copies of x and w), else the NCHW path (:func:`nchw_path`;
    ``"native"`` for NHWC). ``unfold="patch"`` insists on the former."""
    if unfold not in (None, True, False, "copy", "patch"):
        raise ValueError(f"unfold: expected None, True, False, 'copy' or 'patch', got {unfold!r}")
    if use_unfold(pb, nchw, pad, bool(unfold) if unfold is not None else None):
        if unfold != "copy":
            # NCHW: on an NHWC copy of x (one transpose, C = 3: 9.6 MB for conv1 at N=32, where the unfolded
            # copy is 8x that), stored NCHW by the epilogue
            nhwc = dataclasses.replace(pb, layout="NHWC", out_layout="NCHW") if pb.layout == "NCHW" else pb
            why = patch_unsupported(nhwc, arch) if arch else "no architecture given"
            if why is None:
                return "patch", dataclasses.replace(nhwc, patch=True)
            if unfold == "patch":
                raise NotImplementedError(f"unfold='patch': {why}")
        from ._unfold import unfolded_problem
        return "unfold", unfolded_problem(pb, DTYPE_SIZES[pb.dtype])
    path = nchw_path(pb, nchw, pad, arch)
    return path, kernel_problem(pb, path, kernel_channels(pb, path, pad))


def choose_splits(pb: ConvProblem, bm: int, bn: int, bk: int, sms: int) -> int:
    """Split K when the output tiles cannot fill the GPU: aim at ~2 CTAs per SM, >= 8 k-tiles each."""
    tiles = -(-pb.M // bm) * -(-pb.K // bn)
    kt = -(-pb.Kred // bk)
    if 2 * tiles >= sms or kt < 16:
        return 1
    return max(1, min(-(-sms // tiles), kt // 8, 16))


#: the strict-fp32 FFMA kernel as a config override (``Conv2dPlan(..., config=FFMA_CONFIG)``)
FFMA_CONFIG = {"math": "simt", "bm": 128, "bn": 128, "bk": 8, "wm": 4, "wn": 2, "stages": 3}


def _strict_math() -> str:
    """The strict-fp32 mainloop: ``IGEMM_FP32_STRICT`` = ``tf32x3`` (default) or ``simt`` (the FFMA kernel)."""
    import os
    v = os.environ.get("IGEMM_FP32_STRICT", "tf32x3")
    if v not in ("tf32x3", "simt"):
        raise ValueError(f"IGEMM_FP32_STRICT: expected 'tf32x3' or 'simt', got {v!r}")
    return v


def one_consumer_stages(bn: int) -> int:
    """The one-consumer persistent kernel's ring: as deep as fits beside its C tile (64x64 tiles: 8 stages,
    64x128: 6, 64x256: 3)."""
    return {64: 8, 128: 6}.get(bn, 3)


def _wave_fill(tiles: int, slots: int) -> float:
    """How full the waves of ``tiles`` CTAs over ``slots`` (CTAs an SM x SMs) are: tiles / (waves x slots)."""
    return tiles / (-(-tiles // slots) * slots)


def choose_config(pb: ConvProblem, arch: str = "sm_90a", *, x_aligned: bool = True, w_aligned: bool = True,
                  sms: int = 132) -> KernelSpec:
    """Pick the kernel for a problem. ``x_aligned``/``w_aligned``: base pointers 16-byte aligned."""
    eb = DTYPE_SIZES[pb.dtype]
    ce = 16 // eb
    M, K = pb.M, pb.K
    nchw_residual = pb.residual_dtype is not None and pb.y_layout == "NCHW"   # (rules that measured slower with it)
    if pb.patch:
        return patch_config(pb, sms)
    if pb.dtype == "float32" and pb.precision == "strict" and _strict_math() == "simt":
        math, bm, bn, bk, wm, wn, stages = (FFMA_CONFIG[k] for k in ("math", "bm", "bn", "bk", "wm", "wn", "stages"))
    elif eb == 2 and arch.startswith("sm_90"):
        # One 64-row warpgroup per CTA, several CTAs per SM: measured best on H200 for the ResNet-50
        # layers (tools/sweep.py, notes/perf.md); 64 columns when that is what fills the GPU.
        math, bk, wn, bm, wm = "wgmma", 64, 1, 64, 1
        bn = 64 if K <= 64 else 128
        # 64 columns when that is what fills the GPU -- unless the reduction is deep and 128 columns
        # still give half a wave (3x3 512->512 @7, N=32, Kred 4608, 100 tiles: 64x128 31 us, 64x64 37 us;
        # tools/sweep.py on an H200)
        tiles128 = -(-M // bm) * -(-K // bn)
        if bn == 128 and tiles128 < 2 * sms and not (pb.Kred >= 4096 and 2 * tiles128 >= sms) \
                and not 2 * tiles128 > 3 * sms:
            # (not where the 64-column tiles, 3 CTAs an SM, would spill into a second wave that 64x128 tiles do
            # not need -- session 24, tools/sweep.py, H100, N=8, +BN+ReLU(mask), 200 tiles of 64x128 (400 of
            # 64x64), us, 64x64 s4 -> 64x128 s3: 1x1 256->1024 @14 7.1 -> 5.5, 1x1/2 512->1024 @28 9.3 -> 6.9)
            bn = 64
        stages = 4 if bn == 64 else 3
        if use_tma(pb, arch, 128):
            # TMA loads free the warps of gather work: filters with taps take 128-row tiles (two warpgroups
            # sharing B) when they still give half a wave, and 4 stages when one CTA per SM is all there
            # is (tools/sweep.py with TMA on an H100, N=32: 3x3 256->256 @14 128x128 s4 15.7 us vs 64x64
            # s4 23.7; 3x3 64->64 @56 128x64 s3 32.0 vs 35.0; 3x3 512->512 @7 64x128 s4 20.4 vs s3 21.2;
            # the 1x1 layers are fastest as before; notes/perf.md)
            bn128 = 64 if K <= 64 else 128
            tiles = -(-M // 128) * -(-K // bn128)
            if pb.R * pb.S > 1 and 2 * tiles >= sms:
                bm, wm, bn = 128, 2, bn128
                stages = 3 if tiles >= sms else 4
                if bn == 128 and tiles >= sms and _wave_fill(tiles, sms) > 1.1 * _wave_fill(tiles, 2 * sms):
                    # 128x128 tiles: 3 stages fit 2 CTAs an SM, 4 stages one; where one CTA an SM fills its
                    # waves and two do not, 4 (session 24, tools/sweep.py, H100, N=128, conv+BN+ReLU(mask), us,
                    # s3 -> s4: 3x3 256->256 @14, 392 tiles, 52.4 -> 48.5; 3x3/2 256->256 @28 57.5 -> 55.3; where
                    # both fill them, 3: 3x3 128->128 @28, 784 tiles, 58.9 vs 63.9; 3x3 512->512 @7, 196 tiles,
                    # 49.2 vs 52.1 with 5)
                    stages = 4
            elif (pb.R * pb.S == 1 and 2 * tiles >= sms
                  and (K >= 2048 or K >= 512 and pb.Kred >= 512 and tiles >= 5 * sms)
                  and not nchw_residual):
                # 1x1 with 2048 output channels (ResNet-50's 512->2048 @7 and 1024->2048 /2 @14): 64-row tiles
                # read the 2-4 MB filter once per 64 output rows; 128-row tiles halve that (session 23,
                # tools/sweep.py and tools/probes/cfg_probe.py, N=32, us, 64x128 s3 -> 128x128 s3, conv /
                # +BN+ReLU(mask) / +BN+Add+ReLU(mask)): H100 NHWC 512->2048 11.0 -> 9.5 / 12.8 -> 10.5 / 15.4 ->
                # 12.3, 1024->2048 /2 17.3 -> 15.8 / 19.1 -> 16.3 / 22.6 -> 18.2; NCHW 18.4 -> 15.9 / 21.7 -> 19.3
                # (with a residual 26.3 -> 27.3: not taken), 30.3 -> 26.1 / 33.2 -> 29.4 (37.1 -> 37.6); H200
                # NHWC +BN+ReLU(mask) 12.2 -> 10.1 and 18.1 -> 15.4. (1x1/2 512->1024 @28: 64x128 stays.)
                # And 512+ channels in and out with 5 tiles an SM (session 24, tools/sweep.py, H100, N=128,
                # +BN+ReLU(mask), 64x128 s3 -> 128x128 s3: 1x1/2 512->1024 @28 70.0 -> 61.6, 1x1 1024->512 @14
                # 57.8 -> 50.3; at N=32, 3 and 1.5 tiles an SM, 64x128 is the faster).
                bm, wm, bn, stages = 128, 2, 128, 3
            elif -(-M // bm) * -(-K // bn) < sms:
                stages = 4
        elif pb.R * pb.S > 1 and K <= 64 and pb.layout == "NHWC" and pb.C % ce == 0:
            # the 16-byte gather with few output channels (conv1 unfolded: 7x1, C' = 24, K = 64): 128-row
            # tiles halve the filter's L2 traffic per output row, which bounds it (ncu: L2 62%, DRAM 17%);
            # tools/sweep.py on an H100: N=32 128x64 s4 123.8 us, s3 128.7, 64x64 s4 152.0; N=8 s4 37.3, s3 38.3
            if 2 * -(-M // 128) >= sms:
                bm, wm, stages = 128, 2, 4
    else:
        # fp32 strict: 3xTF32 (tf32x3, fp32 accuracy from three TF32 MMAs per product)
        math = "tf32x3" if pb.dtype == "float32" and pb.precision == "strict" else "tensorop"
        bk = 32 if eb == 2 else 16
        bm, bn = 128, 128
        if K <= 64:
            bn = 64
        wm, wn = 2, 2
        stages = 4
        if math == "tf32x3":
            # two fp32 accumulator sets per thread (csrc/conv/mainloop_sm80.cuh): warp tiles of at most 2048
            # elements. tools/sweep.py on an H100 (N=32, notes/perf.md): 64x128 (32x64 warp tiles) fastest
            # wherever K > 64 (3x3 128->128 @28 NHWC 153.5 us vs 64x64 171.4), 128x64 for K <= 64
            # (3x3 64->64 @56 155 vs 64x64 182); 3 stages for the NCHW gather, 4 for NHWC (within 2%)
            bm, bn = (128, 64) if K <= 64 else (64, 128)
            stages = 3 if pb.layout == "NCHW" else 4
    kt = -(-pb.Kred // bk)
    if math != "simt" and kt <= 2:
        stages = 2           # nothing to pipeline: the smaller footprint buys CTAs in flight instead
    load_a = "vec" if (pb.layout == "NHWC" and pb.C % ce == 0 and x_aligned) else "elem"
    load_b = "vec" if (pb.Kred % ce == 0 and w_aligned) else "elem"
    if math == "wgmma" and pb.layout == "NCHW" and load_b == "vec" and x_aligned and use_tma(pb, arch, bm):
        load_a, load_b = "tmamn", "tma"      # NCHW x read in place as MN-major tiles (1x1, stride 1)
    if math == "wgmma" and load_a == load_b == "vec" and pb.C % 64 == 0 and use_tma(pb, arch, bm):
        # (8-tap TMA k-tiles for 8-channel copies are a candidate only: on an H200 the padded conv1 took
        # 255 us with them, 172 us with the element gather; notes/perf.md)
        load_a = load_b = "tma"
    splits = choose_splits(pb, bm, bn, bk, sms)
    if math == "tf32x3":
        # the compute-bound 3xTF32 tiles want two CTAs an SM: split while the tiles are fewer (sweep:
        # 3x3 256->256 @14, 196 tiles: 2 splits 158 us vs 174; 3x3 512->512 @7, 100 tiles: 2 or 4, 201-225 vs 243-276)
        tiles = -(-M // bm) * -(-K // bn)
        splits = 1 if tiles >= 2 * sms else max(1, min(-(-2 * sms // tiles), 4, -(-pb.Kred // bk) // 8))
    tiles, kt = -(-M // bm) * -(-K // bn), -(-pb.Kred // bk)
    persistent = False
    if math == "wgmma" and load_a == "tma" and bm == 64:
        if splits > 1 and (10 * tiles >= sms or kt <= 32 and pb.R * pb.S == 1) and (kt <= 48 or 4 * tiles >= sms):
            # Few tiles and a deep reduction (batch 1-8 on the 3x3 layers): the persistent kernel's producer
            # warp keeps the TMA loads ahead of the MMA with no CTA barrier per k-tile, which beats split-K
            # unless the tiles are very few and each would run a long reduction alone (tools/sweep.py on an
            # H100, fp16 NHWC: N=1 3x3 128->128 @28, 26 tiles x 18 k-tiles, 5.7 us vs split-K 8.5; N=1 3x3
            # 256->256 @14, 16 x 36: 8.8 vs 10.1; N=8 3x3 512->512 @7, 56 x 72: 15.4 vs 15.9; N=1 @7,
            # 8 x 72, keeps split-K: 9.3 us with 9 splits). Fewer tiles too for a 1x1 of at most 32
            # k-tiles (session 24, tools/sweep.py, H100, N=1 1x1 2048->512 @7, 8 x 32, +BN+ReLU(mask): the cluster
            # k-split 7.5 us vs 4 splits' 10.7)
            persistent = True
        elif splits == 1 and (pb.R * pb.S > 1 or kt >= 16 and not nchw_residual):
            # A filter with taps whose 64-row tiles make at most one wave of single CTAs -- with 128 columns
            # if 64 would not (N=8 3x3 128->128 @28: 196 tiles of 64x64, 98 of 64x128): one CTA per SM is
            # all there is, so the persistent kernel with one consumer and a deep ring takes the whole shared
            # memory (tools/probes/stage_probe.py, H100, fp16 NHWC, us: N=8 3x3 256->256 @14 8.5 vs the
            # per-tile 64x64 s4's 10.9; N=8 128->128 @28 7.3 vs 7.9; N=32 512->512 @7 18.7 vs 20.1; N=1
            # 64->64 @56 3.6 vs 4.0).
            # A 1x1 of 16+ k-tiles (1024-2048 channels in) alike (session 24, tools/probes/cfg_probe.py, H100, us,
            # conv / +BN+ReLU(mask) / +BN+Add+ReLU(mask), per-tile 64x64 s4 -> persistent): 1x1 2048->512 @7 N=32
            # (64x128 s6) NHWC 11.7 / 12.3 / 12.9 -> 10.1 / 10.7 / 11.3, NCHW 21.2 / 22.9 / - -> 19.9 / 21.0-21.8 / -;
            # N=16 (64x64 s8) 10.7 / 11.1 / 11.6 -> 8.4 / 8.6 / 9.3; 1x1 1024->256 @14 N=8 6.7 / 7.1 / 7.6 -> 5.6 /
            # 5.9 / 6.4; 1x1 1024->512 @14 N=4 6.0 / 6.6 / 7.5 -> 5.2 / 5.5 / 6.3. Not an NCHW output with a
            # residual (24.8 -> 24.6-24.8).
            t128 = -(-M // 64) * -(-K // 128)
            if tiles > sms and bn == 64 and K >= 128 and t128 <= sms:
                bn, tiles = 128, t128
            persistent = tiles <= sms
    ctas, ws_stages = 1, 0
    # (a few k-tiles a 64-row tile and at least 5 tiles an SM: the rules for several CTAs an SM below)
    short = math == "wgmma" and load_a in ("tma", "tmamn") and bm == 64 and splits == 1 and kt <= 4 \
        and tiles >= 5 * sms
    if short and bn == 128 and pb.residual_dtype is None and (epilogue_functors(pb) or kt <= 2 and tiles < 12 * sms):
        # A few k-tiles a tile (1x1 convs over 64-256 channels) and several waves: the persistent kernel with one
        # consumer, 2 stages and 3 CTAs an SM, so that each CTA's producer loads its next tile while its
        # consumer stores the last (the per-tile kernel's CTAs wait for their single load, then run the
        # epilogue with no load in flight). tools/epi_probe.py ws, H100, N=32, fp16, us: 1x1 64->256 @56
        # conv+BN+ReLU+mask NHWC 27.4-27.5 vs the per-tile 64x128's 29.1-30.3, NCHW 31.1-32.3 vs 35.1-36.7.
        # Down to 5 tiles an SM (session 23, tools/probes/cfg_probe.py, us, per-tile -> persistent,
        # conv+BN+ReLU+mask NHWC / NCHW): H100 N=16 17.1 -> 13.7, 20.7 -> 15.7; N=12 13.1 -> 10.9, 15.6 -> 12.9;
        # N=8 (784 tiles) 10.2 -> 8.6, 11.9 -> 9.7; H200 N=16 15.5 -> 13.0, 19.3 -> 14.7; N=8 9.4 -> 8.0,
        # 11.1 -> 8.9. Not at N=4 (392 tiles, one a CTA; H200 conv alone 4.4-4.5 -> 4.6) or N=2.
        # The conv alone too, below 12 tiles an SM: H100 N=16 13.4 -> 12.7-12.8, 13.9-14.0 -> 12.3-12.4; N=12
        # 10.6 -> 9.4, 11.0 -> 9.6; N=8 7.8-7.9 -> 7.1, 8.0 -> 7.0; H200 N=16 12.3 -> 10.3, 12.6 -> 10.3; N=8
        # 7.1 -> 6.4, 7.3 -> 6.1. From N=32 (3136 tiles) it splits by card: H200 22.3 -> 20.1-20.3 (NHWC),
        # 23.0-23.1 -> 20.0-20.4 (NCHW); H100 24.6-24.7 -> 25.6-26.0, 25.5-25.7 -> 26.5-26.9: the per-tile kernel
        # stays (no card loses).
        # Two k-tiles too (1x1 128->512 @28, same probe, us, per-tile -> persistent, conv / +BN+ReLU(mask)): H100
        # N=32 (1568 tiles) 16.2 -> 13.8 / 19.8 -> 15.3, NCHW 21.6 -> 19.4 / 27.7 -> 24.1; N=16 9.3 -> 7.8 / 11.5
        # -> 9.5; H200 N=32 14.6-14.7 -> 12.0 / 18.0 -> 15.0, NCHW 19.0 -> 17.5 / 25.1 -> 22.6; N=16 8.6 -> 7.4 /
        # 10.6 -> 9.2; not at N=8 (392 tiles: 5.0 -> 5.3 / 6.3 -> 6.2 on the H100). Up to four k-tiles with a
        # chain (+BN+ReLU(mask), N=32): 1x1 256->1024 @14 H100 14.0 -> 13.3 (NCHW 24.4 -> 23.1), H200 12.9 ->
        # 12.0; 1x1/2 256->512 @56 H100 26.4 -> 24.3 (NCHW 50.1 -> 48.0), H200 23.3 -> 21.8; the conv alone
        # there moves by -0.8 to +0.3 us: not taken.
        # Not taken: with a residual (NHWC 47.1-48.3 vs 44.5-44.8 on the H100; H200, session 23, with the
        # residual staged in the compact C tile at 3 CTAs: 38.5-38.8 vs 36.9-37.0; two k-tiles: below), 8
        # k-tiles (1x1/2 512->1024: 20.6 vs 19.0), 64x64 tiles with 4 CTAs (29.7 NHWC).
        persistent, ctas = True, 3
    elif (short and bn == 128 and kt == 2 and pb.residual_dtype in ("float16", "bfloat16") and pb.layout == "NHWC"
          and pb.out_layout in (None, "NHWC")):
        # Two k-tiles with a 16-bit residual, NHWC: the persistent kernel at 2 CTAs an SM with 3 stages (its fp32 C
        # tile holds the staged residual). 1x1 128->512 @28 conv+BN+Add+ReLU(mask), us, per-tile -> persistent:
        # H100 N=32 30.5 -> 27.7, N=16 18.1 -> 15.6; H200 N=32 27.2 -> 24.8, N=16 16.6 -> 14.0. Not NCHW (H100
        # 36.7 -> 36.1, H200 31.5 -> 32.1), not one k-tile (session 20: 3-4 us slower on 1x1 64->256).
        persistent, ctas = True, 2
    elif short and bn == 64 and pb.R * pb.S == 1 and kt >= 3 and (epilogue_functors(pb) or tiles < 12 * sms):
        # 64-column tiles of a few k-tiles (1x1 256->64 @56, the reduce conv of conv2_x's blocks): 3 CTAs an SM
        # with 3 stages each, the residual too (session 24, tools/probes/cfg_probe.py, H100, us, conv / +BN+ReLU(mask)
        # / +BN+Add+ReLU(mask), per-tile 64x64 s4 -> persistent): N=32 NHWC 24.8 / 26.7 / 32.4 -> 24.6 / 25.1 /
        # 29.9, NCHW 24.9 / 27.9 / 33.3 -> 24.6 / 25.3 / 29.9; N=16 14.2 / 15.5 / 18.3 -> 13.6 / 14.1 / 16.7; N=64
        # 45.4 / 47.9 / 57.4 -> 46.3 / 47.3 / 56.4 (the conv alone: from 12 tiles an SM, per-tile, as above). Not
        # at N=8 (392 tiles: 7.6 / 8.2 / 9.7 -> 7.8 / 8.1 / 9.8).
        persistent, ctas = True, 3
    elif (math == "wgmma" and load_a == "tma" and splits == 1 and not persistent and pb.R * pb.S > 1 and K <= 64
          and pb.layout == "NHWC" and pb.y_layout == "NHWC" and pb.residual_dtype is None and epilogue_functors(pb)
          and -(-M // 64) >= 10 * sms):
        # A 3x3 conv into 64 channels (3x3 64->64 @56) with a chain and no residual, 10+ tiles of 64x64 an SM: the
        # persistent kernel with 64x64 tiles at 3 CTAs an SM, 4 stages each, where the 128x64 per-tile kernel waits
        # out its chain (session 27, tools/probes/cfg_probe.py, conv+BN+ReLU(mask), us, per-tile -> persistent):
        # H100 N=32 27.3-27.5 -> 26.2-26.5, N=64 50.2-50.3 -> 48.4-48.5; H200 N=32 24.1 -> 22.9-23.3. Not at N=16
        # (H100 14.6 -> 14.7-14.9), not the conv alone (N=32 25.9 -> 26.4-26.8), not with a residual or an NCHW
        # output (their larger C tiles do not fit three such CTAs in an SM's shared memory).
        bm, wm, bn, tiles = 64, 1, 64, -(-M // 64)
        persistent, ctas, ws_stages = True, 3, 4
    csplit = 1
    if persistent:
        # one consumer with a deep ring where the tiles are at most one per SM (N=8 3x3 512->512 @7: s8
        # 14.5 us vs two consumers, s4, 15.4; 64x128 tiles take 6 stages: 7 would not fit beside the C
        # tile), else two consumers taking turns over the tiles (or one with 2 stages, ctas CTAs an SM)
        math, splits = "wgmma_ws", 1
        wm, stages = (1, 2 if ctas == 3 and bn == 128 else 3) if ctas > 1 \
            else (1, one_consumer_stages(bn)) if tiles <= sms else (2, 4)
        stages = ws_stages or stages
        if wm == 1 and bn == 64 and 2 * tiles <= sms and kt >= 32:
            # at most half a wave of tiles with a deep reduction: the cluster k-split (two CTAs a tile, the
            # partial sums handed over in distributed shared memory; tools/probes/stage_probe.py, H100,
            # fp16 NHWC, us: N=8 3x3 512->512 @7 12.6 vs 14.9; N=1 256->256 @14 7.3 vs 8.3; with 18 k-tiles,
            # N=1 128->128 @28, 5.9 vs 5.2: the hand-over is not paid back)
            csplit, stages = 2, 6
    store, vec_o, fuse = store_for(pb, math, bn, splits)
    spec = KernelSpec(pb.dtype, pb.layout, math, bm, bn, bk, wm, wn, stages, load_a, load_b, store, vec_o,
                      fuse, epilogue_functors(pb), splits, csplit=csplit, ctas=ctas)
    return dataclasses.replace(spec, min_blocks=min_blocks_for(spec))


def patch_config(pb: ConvProblem, sms: int = 132, **kw) -> KernelSpec:
    """The patch kernel for a patch problem: 128-row tiles (two warpgroups) when they give two waves, 64 or
    128 columns, the whole filter tile resident (stages = k-tiles); ``kw`` overrides."""
    kt = -(-pb.Kred // 64)
    bm = 128 if 2 * -(-pb.M // 128) >= sms else 64
    spec = KernelSpec(pb.dtype, pb.layout, "wgmma", bm, 64 if pb.K <= 64 else 128, 64, bm // 64, 1, max(kt, 2),
                      "patch", "vec", "rows", 8, False, epilogue_functors(pb), 1)
    if "bm" not in kw and bm == 128:        # 64-row tiles where the taller tile's patch would not fit
        tall = dataclasses.replace(spec, patch_bytes=patch_bytes(pb, 128))
        if tall.smem + tall.static_smem > SMEM_LIMIT:
            spec = dataclasses.replace(spec, bm=64, wm=1)
    spec = dataclasses.replace(spec, **kw)
    store, vec_o, fuse = store_for(pb, "wgmma", spec.bn, 1, regs=kw.get("store", "regs") == "regs")
    spec = dataclasses.replace(spec, wm=spec.bm // 64, store=store, vec_o=vec_o, fuse_mask=fuse,
                               patch_bytes=patch_bytes(pb, spec.bm))
    if "bm" not in kw and spec.residual_preloaded and spec.patch_bytes - 16 > PATCH_MAX_BYTES:
        # (the preloaded residual's kernel packs patch offsets in 16 bits; 64-row patches fit: patch_unsupported)
        spec = dataclasses.replace(spec, bm=64, wm=1, patch_bytes=patch_bytes(pb, 64))
    return dataclasses.replace(spec, min_blocks=kw.get("min_blocks", min_blocks_for(spec)))


def min_blocks_for(spec: KernelSpec) -> int:
    """The register cap (``__launch_bounds__`` min blocks) of a spec: single-warpgroup wgmma tiles get 3
    CTAs per SM, 4 where shared memory holds 4 and the accumulators are at most 64 registers a thread
    (BN <= 128). Measured on an H200 (tools/epi_probe.py): 1x1 64->256 @56, 64x128 tile, 2 stages, 4 CTAs:
    conv 33.0 -> 30.0 us, +BN+Add+ReLU+mask 83.4 -> 69.4 us; no change on the layers where smem caps it."""
    if spec.persistent:
        return spec.ctas
    if spec.residual_preloaded:
        # the patch kernel holds the tile's residual pairs in registers from the tile's start: capped so that
        # as many CTAs as shared memory holds (at most 3) keep their registers. conv1 7x7/2 NHWC, 128x64 tiles,
        # H200: 96 registers a thread uncapped, 2 CTAs an SM, conv+BN+Add+ReLU+mask 94.8 us; capped, 3 CTAs,
        # 89.0 us (the residual loaded in the epilogue: 92.1)
        return max(1, min(3, SMEM_PER_SM // (spec.smem + spec.static_smem + 1024)))
    if spec.math == "wgmma" and spec.bm == 128 and spec.store == "regsnchw" and spec.vec_o == 1 and spec.residual:
        # NCHW with P·Q odd and a residual: the epilogue's 2-byte residual loads sit beside the accumulators, and
        # uncapped ptxas gave 3x3 512->512 @7's conv+BN+Add+ReLU(mask) 160-168 registers: one CTA an SM where the
        # other chains run two (H100, N=128, ncu: 78.0 against 63.6 us for conv+BN+ReLU(mask)). Capped at 128
        # where shared memory holds two CTAs: 124 registers, no spills, 77.4-79.2 -> 68.7-69.4 us. (Capping
        # every such 128-row tile changed the code of tiles already under 128 registers, e.g. 3x3 64->64 @56's
        # (c) +0.2 us, so only this one.)
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


def candidates(pb: ConvProblem, arch: str = "sm_90a", sms: int = 132) -> list[KernelSpec]:
    """Valid alternatives to ``choose_config`` for autotuning (tile shape, stages, split-K)."""
    base = choose_config(pb, arch, sms=sms)
    out = [base]
    if base.load_a == "patch":              # tile shapes and both store phases of the patch kernel
        for bm in (64, 128, 256):
            for bn in (64, 128):
                for store in ("regs", "rows"):
                    spec = patch_config(pb, sms, bm=bm, bn=bn, store=store)
                    if spec not in out and validate_spec(spec, pb, raise_=False):
                        out.append(spec)
        return out
    # the alternatives derive from the per-tile kernel (the persistent one, when it is the choice, has no
    # tile, stage or split-K variants of its own)
    tile = base if not base.persistent else dataclasses.replace(base, math="wgmma", wm=base.bm // 64, stages=4,
                                                                 csplit=1)
    def add(smem_store=False, **kw):
        spec = dataclasses.replace(tile, **kw)
        if "splits" not in kw:
            spec = dataclasses.replace(spec, splits=choose_splits(pb, spec.bm, spec.bn, spec.bk, sms))
        store, vec_o, fuse = store_for(pb, spec.math, spec.bn, spec.splits, regs=not smem_store)
        spec = dataclasses.replace(spec, store=store, vec_o=vec_o, fuse_mask=fuse)
        spec = dataclasses.replace(spec, min_blocks=min_blocks_for(spec))
        if spec not in out and validate_spec(spec, pb, raise_=False):
            out.append(spec)
    if base.persistent:
        add()                               # the per-tile kernel (split-K as choose_splits says)
    if tile.store in REGS_STORES:
        add(smem_store=True)                # the fp32 C tile's store phase
    if base.load_b == "tma":
        add(load_a="vec" if pb.layout == "NHWC" else "elem", load_b="vec")
    if base.load_a == base.load_b == "vec" and pb.C == 8 and use_tma(pb, arch, base.bm):
        add(load_a="tma8", load_b="tma")
    if base.load_a == "tma":
        for bn in (64, 128):
            for stages in (3, 4):
                add(math="wgmma_ws", bm=64, wm=2, bn=bn, stages=stages, splits=1)
            # one consumer with a deep ring; and the cluster k-split (two CTAs a tile)
            add(math="wgmma_ws", bm=64, wm=1, bn=bn, stages=one_consumer_stages(bn), splits=1)
        add(math="wgmma_ws", bm=64, wm=1, bn=64, stages=6, splits=1, csplit=2)
    if base.load_a in ("tma", "tmamn"):
        for bn, stages in ((64, 2), (64, 3), (128, 2), (128, 3)):
            # one consumer, several CTAs an SM (a short reduction: the next tile's loads under the epilogue)
            ws = dataclasses.replace(tile, math="wgmma_ws", bm=64, wm=1, bn=bn, stages=stages, splits=1, csplit=1)
            if (c := max_ctas(ws)) > 1:
                add(math="wgmma_ws", bm=64, wm=1, bn=bn, stages=stages, splits=1, ctas=c)
        if tile.store == "regs":             # stream-K: equal shares of tiles x k-tiles, 1 or 2 CTAs an SM
            for bm, bn, stages, sk in ((64, 128, 4, 1), (64, 128, 4, 2), (128, 128, 4, 1), (64, 64, 4, 2)):
                add(math="wgmma", bm=bm, wm=bm // 64, bn=bn, stages=stages, splits=1, streamk=sk)
    if tile.math == "wgmma":
        for bm in (64, 128):
            for bn in (64, 128, 256):
                for stages in (3, 4, 5):
                    add(bm=bm, wm=bm // 64, bn=bn, stages=stages)
        if base.load_b == "tma" or (base.load_a == "vec" and pb.K <= 64):
            # taller tiles: three or four warpgroups share each B stage
            for bm in (192, 256):
                for bn in (64, 128):
                    for stages in (3, 4):
                        add(bm=bm, wm=bm // 64, bn=bn, stages=stages)
    elif base.math == "tf32x3":
        add(**FFMA_CONFIG)                  # the FFMA kernel
        for bm, bn, wm, wn in ((128, 64, 2, 2), (64, 64, 2, 2), (128, 128, 2, 4), (64, 128, 2, 2)):
            for stages in (3, 4):
                for sp in (1, 2, 4):
                    add(bm=bm, bn=bn, wm=wm, wn=wn, stages=stages, splits=sp)
    elif base.math == "tensorop":
        for bm, bn, wm, wn in ((128, 128, 2, 2), (128, 64, 2, 2), (64, 128, 1, 2), (128, 128, 2, 4), (64, 64, 2, 2)):
            for stages in (3, 4):
                add(bm=bm, bn=bn, wm=wm, wn=wn, stages=stages)
    for sp in (1, 2, 4, 8):
        add(splits=sp)
    return out


SMEM_LIMIT = 227 * 1024
#: shared memory an SM has for its CTAs (sm_90: 228 KB, 1 KB of it reserved per CTA)
SMEM_PER_SM = 228 * 1024


def validate_spec(spec: KernelSpec, pb: ConvProblem, raise_: bool = True) -> bool:
    """Whether a (possibly hand-made) spec can run ``pb``; raises NotImplementedError naming why."""
    from ._tma import tma_kind, tma_unsupported
    eb = DTYPE_SIZES[pb.dtype]
    ce = 16 // eb
    why = None
    if spec.dtype != pb.dtype or spec.layout != pb.layout:
        why = "dtype/layout differ from the problem"
    elif spec.math.startswith("wgmma") and (eb != 2 or spec.bk * eb != 128 or spec.bm % 64 or spec.bn not in (64, 128, 192, 256)):
        why = "wgmma needs 16-bit types, BK*size = 128 bytes, BM % 64 == 0, BN in {64,128,192,256}"
    elif spec.math == "simt" and (pb.dtype != "float32" or (spec.bm, spec.bn, spec.bk) != (128, 128, 8)):
        why = "the SIMT kernel is fp32 128x128x8"
    elif pb.dtype == "float32" and pb.precision == "strict" and spec.math not in ("simt", "tf32x3"):
        why = "strict fp32 runs on the FFMA kernel (simt) or 3xTF32 (tf32x3), not on single TF32"
    elif spec.math == "tf32x3" and pb.dtype != "float32":
        why = "3xTF32 is for fp32"
    elif spec.math in ("tensorop", "tf32x3") and (spec.bk * eb not in (32, 64, 128) or (spec.bn // spec.wn) % 16
                                      or (spec.bm // spec.wm) % 16):
        why = "tensor-op tile"
    elif spec.math == "tf32x3" and (spec.bm // spec.wm) * (spec.bn // spec.wn) > 64 * 32:
        why = "3xTF32 warp tiles are at most 64x32 (two fp32 accumulator sets: larger ones spill)"
    elif (spec.load_a.startswith("tma")) != (spec.load_b == "tma") or (spec.load_b == "tma" and not spec.math.startswith("wgmma")):
        why = "TMA loads: both operands, wgmma only"
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
    elif spec.load_b == "tma" and (no_tma := tma_unsupported(pb, spec.bm)):
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
    elif (spec.residual_staged and spec.math == "wgmma" and spec.load_b == "tma" and not spec.streamk
          and spec.bm * spec.bn * 2 > (spec.bm + spec.bn) * spec.bk * eb):
        why = "the TMA mainloop stages the 16-bit residual tile (BM x BN) in one of its stages: it must fit one"
    elif spec.smem + spec.static_smem > SMEM_LIMIT:
        why = f"{spec.smem} bytes of shared memory"
    elif spec.splits < 1 or spec.splits > -(-pb.Kred // spec.bk):
        why = f"splits={spec.splits}"
    elif spec.math in ("tensorop", "tf32x3", "wgmma") and ((spec.bm * spec.bk * eb // 16) % spec.threads
                                                  or (spec.bn * spec.bk * eb // 16) % spec.threads):
        why = "loader partition"
    if why and raise_:
        raise NotImplementedError(f"kernel config {spec.name()}: {why}")
    return why is None
