"""The conv kernel's choice: ``choose_config(problem, arch, sms)``, a pure function of the kernel problem.

It starts from a base per mainloop and applies the rules of :data:`RULES` in order: each rule is a named row
with a one-line reason (its slug names the decision and its measurements in docs/performance.md), a condition
on the draft spec and the change it makes. Rules in one group are alternatives: the first whose condition holds
fires. ``choose_config(..., trace=[])`` lists the rules that fired. Also here: the patch kernel's config,
split-K, and the autotune candidates.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from .._runtime import DTYPE_SIZES
from ._problem import PATCH_MAX_BYTES, ConvProblem, patch_bytes, split_by_cost
from ._spec import (REGS_STORES, SMEM_LIMIT, KernelSpec, max_ctas, min_blocks_for, one_consumer_stages, store_for,
                    validate_spec)
from ._tma import tma_unsupported

__all__ = ["choose_config", "candidates", "choose_splits", "patch_config", "use_tma", "RULES", "Rule", "FFMA_CONFIG"]

#: the strict-fp32 FFMA kernel as a config override (``Conv2dOptions(config=FFMA_CONFIG)``)
FFMA_CONFIG = {"math": "simt", "bm": 128, "bn": 128, "bk": 8, "wm": 4, "wn": 2, "stages": 3}


def use_tma(pb: ConvProblem, arch: str, bm: int) -> bool:
    """Whether the wgmma kernel can load through TMA (igemm/conv/_tma.py): sm_90, 16-bit NHWC with C % 64 == 0
    (or C == 8: 8-tap k-tiles, a candidate only), NCHW 1x1 stride 1, within the tensor maps' limits."""
    return arch.startswith("sm_90") and tma_unsupported(pb, bm) is None


def choose_splits(pb: ConvProblem, bm: int, bn: int, bk: int, sms: int) -> int:
    """Split K when the output tiles cannot fill the GPU: a CTA an SM, >= 8 k-tiles each (at most 16 splits);
    ~2 CTAs an SM, >= 32 k-tiles each, for reductions >= 256 k-tiles deep (docs/performance.md: wgrad-splits)."""
    tiles = -(-pb.M // bm) * -(-pb.K // bn)
    kt = -(-pb.Kred // bk)
    if 2 * tiles >= sms or kt < 16:
        return 1
    if kt >= 256:   # a reduction hundreds of k-tiles deep (the turned wgrad problems): ~2 CTAs an SM, >= 32 each
        return max(1, min(-(-2 * sms // tiles), kt // 32, 128))
    return max(1, min(-(-sms // tiles), kt // 8, 16))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _wave_fill(tiles: int, slots: int) -> float:
    """How full the waves of ``tiles`` CTAs over ``slots`` (CTAs an SM x SMs) are: tiles / (waves x slots)."""
    return tiles / (_cdiv(tiles, slots) * slots)


@dataclass
class _Draft:
    """The spec being chosen, and the problem's quantities the rules read."""
    pb: ConvProblem
    arch: str
    sms: int
    x_aligned: bool
    w_aligned: bool
    bn_stats: bool = False      # the plan's kernel should write its output's BatchNorm statistics (bn_stats_ok)
    math: str = ""
    bm: int = 0
    bn: int = 0
    bk: int = 0
    wm: int = 1
    wn: int = 1
    stages: int = 0
    load_a: str = ""
    load_b: str = ""
    splits: int = 1
    persistent: bool = False
    ctas: int = 1
    ws_stages: int = 0
    csplit: int = 1
    fired: list = field(default_factory=list)

    def update(self, **kw) -> None:
        for k, v in kw.items():
            setattr(self, k, v)

    @property
    def ce(self) -> int:                # elements in 16 bytes
        return 16 // DTYPE_SIZES[self.pb.dtype]

    @property
    def taps(self) -> int:
        return self.pb.R * self.pb.S

    @property
    def tiles(self) -> int:
        return _cdiv(self.pb.M, self.bm) * _cdiv(self.pb.K, self.bn)

    @property
    def kt(self) -> int:
        return _cdiv(self.pb.Kred, self.bk)

    @property
    def bn128(self) -> int:             # the 128-row tiles' width
        return 64 if self.pb.K <= 64 else 128

    @property
    def tiles128(self) -> int:          # 128-row tiles of that width
        return _cdiv(self.pb.M, 128) * _cdiv(self.pb.K, self.bn128)

    @property
    def tma128(self) -> bool:           # TMA loads of 128-row tiles
        return use_tma(self.pb, self.arch, 128)

    @property
    def nchw_residual(self) -> bool:    # an NCHW output with a residual (several rules measured slower with it)
        return self.pb.residual_dtype is not None and self.pb.y_layout == "NCHW"

    @property
    def short(self) -> bool:
        """A few k-tiles a 64-row TMA tile, one split, and at least 5 tiles an SM (the several-CTAs rules)."""
        return (self.math == "wgmma" and self.load_a in ("tma", "tmamn") and self.bm == 64 and self.splits == 1
                and self.kt <= 4 and self.tiles >= 5 * self.sms)

    def spec(self) -> KernelSpec:
        pb = self.pb
        store, vec_o, fuse = store_for(pb, self.math, self.bn, self.splits)
        spec = KernelSpec(pb.dtype, pb.layout, self.math, self.bm, self.bn, self.bk, self.wm, self.wn, self.stages,
                          self.load_a, self.load_b, store, vec_o, fuse, pb.epilogue, self.splits, csplit=self.csplit,
                          ctas=self.ctas)
        return dataclasses.replace(spec, min_blocks=min_blocks_for(spec))


@dataclass(frozen=True)
class Rule:
    """One decision of :func:`choose_config`: ``when(draft)`` -> ``then(draft)``."""
    name: str                           # its slug in docs/performance.md's decision log
    why: str                            # the reason, in a line
    when: Callable[[_Draft], bool]
    then: Callable[[_Draft], None]


def _always(d: _Draft) -> bool:
    return True


def _mma_sync(d: _Draft) -> None:
    pb = d.pb
    d.update(math="tf32x3" if pb.dtype == "float32" and pb.precision == "strict" else "tensorop",
             bk=32 if d.ce == 8 else 16, bm=128, bn=64 if pb.K <= 64 else 128, wm=2, wn=2, stages=4)


def _base_loads(d: _Draft) -> None:
    pb = d.pb
    d.load_a = "vec" if (pb.layout == "NHWC" and pb.C % d.ce == 0 and d.x_aligned) else "elem"
    d.load_b = "vec" if (pb.Kred % d.ce == 0 and d.w_aligned) else "elem"


def _tf32x3_splits(d: _Draft) -> None:
    d.splits = 1 if d.tiles >= 2 * d.sms else max(1, min(_cdiv(2 * d.sms, d.tiles), 4, d.kt // 8))
    if d.kt >= 256 and d.tiles < 2 * d.sms:    # the turned wgrad's deep reductions (tf32x3-deep-splits)
        d.splits = max(d.splits, _deep_splits(d.tiles, d.kt, d.pb.M * d.pb.K, 3 * d.sms))


def _deep_splits(tiles: int, kt: int, mn: int, slots: int) -> int:
    """The power-of-two split (<= 128) of a ``kt``-k-tile reduction over ``tiles`` tiles of an ``mn``-element output
    for ``slots`` resident CTAs that minimises the rounds of units a CTA runs x (its k-tiles + 2) + 64 k-tile times a
    split per million partials; fitted to the strict fp32 wgrad's tile x split sweep (ResNet-50, N = 32, H200)."""
    return split_by_cost(tiles, kt, mn, slots, [1 << i for i in range(8) if 1 << i <= kt], 2, 64)


#: the 3xTF32 wgmma kernel's split candidates (any count: a split-K wave of one CTA an SM is filled by counts
#: other than powers of two)
_WGMMA_SPLITS = (*range(1, 17), 20, 24, 28, 32, 40, 48, 64, 96, 128)


def _tf32x3_wgmma_splits(d: _Draft) -> None:
    """The split of least cost for one CTA an SM: the rounds of units a CTA runs x (its k-tiles + 2) + a k-tile
    time a split per million fp32 partials; each split 4+ k-tiles. Fitted to the tile x split sweep of ResNet-50's
    forward and turned wgrad layers (N = 32, H200; docs/performance.md: tf32x3-wgmma)."""
    d.splits = split_by_cost(d.tiles, d.kt, d.pb.M * d.pb.K, d.sms,
                             [s for s in _WGMMA_SPLITS if s == 1 or 4 * s <= d.kt], 2, 1)


def _wider(d: _Draft) -> bool:
    """More than a wave of 64-column tiles that 128 columns would bring to one wave at most."""
    return (d.tiles > d.sms and d.bn == 64 and d.pb.K >= 128
            and _cdiv(d.pb.M, 64) * _cdiv(d.pb.K, 128) <= d.sms)


def _consumers(d: _Draft) -> None:
    if d.ctas > 1:
        wm, stages = 1, 2 if d.ctas == 3 and d.bn == 128 else 3
    else:
        wm, stages = (1, one_consumer_stages(d.bn)) if d.tiles <= d.sms else (2, 4)
    d.update(math="wgmma_ws", splits=1, wm=wm, stages=d.ws_stages or stages)


def _wgmma(d: _Draft) -> bool:
    return d.math == "wgmma"


def _tma_64_rows(d: _Draft) -> bool:
    return d.math == "wgmma" and d.load_a == "tma" and d.bm == 64


#: The rules, in order; each inner tuple is a group of alternatives (the first that applies fires).
RULES: tuple[tuple[Rule, ...], ...] = (
    # -- the mainloop and its tile
    (Rule("wgmma-64-rows", "16-bit on Hopper: one 64-row warpgroup a CTA (several CTAs an SM), 64 columns for "
          "K <= 64, else 128",
          lambda d: d.ce == 8 and d.arch.startswith("sm_90"),
          lambda d: d.update(math="wgmma", bk=64, wn=1, bm=64, wm=1, bn=64 if d.pb.K <= 64 else 128)),
     Rule("tf32x3-wgmma", "strict fp32 on Hopper: 3xTF32 on warpgroup MMAs, 128x128 tiles (64 wide for K <= 64), "
          "4 stages",
          lambda d: d.pb.dtype == "float32" and d.pb.precision == "strict" and d.arch.startswith("sm_90"),
          lambda d: d.update(math="tf32x3_wgmma", bk=32, bm=128, wm=2, wn=1, bn=64 if d.pb.K <= 64 else 128,
                             stages=4)),
     Rule("mma-sync", "elsewhere (fp32 on Hopper: single TF32): mma.sync 128x128 tiles (64 wide for K <= 64); "
          "strict fp32 as 3xTF32",
          _always, _mma_sync)),
    (Rule("bn64-fill", "64 columns where 128 would leave the GPU under-filled, unless a deep reduction still "
          "gives half a wave or 64 columns would spill into a second wave",
          lambda d: (_wgmma(d) and d.bn == 128 and d.tiles < 2 * d.sms
                     and not (d.pb.Kred >= 4096 and 2 * d.tiles >= d.sms) and not 2 * d.tiles > 3 * d.sms),
          lambda d: d.update(bn=64)),),
    (Rule("wgmma-stages", "4 stages for 64-column tiles, 3 for 128 (what fits several CTAs an SM)",
          _wgmma, lambda d: d.update(stages=4 if d.bn == 64 else 3)),),
    (Rule("tma-taps-128-rows", "TMA loads, a filter with taps, half a wave of 128-row tiles: two warpgroups "
          "share B; 4 stages where one CTA an SM is all there is",
          lambda d: _wgmma(d) and d.tma128 and d.taps > 1 and 2 * d.tiles128 >= d.sms,
          lambda d: d.update(bm=128, wm=2, bn=d.bn128, stages=3 if d.tiles128 >= d.sms else 4)),
     Rule("1x1-wide-128-rows", "1x1 into 2048 channels, or 512+ in and out with 5 tiles an SM: 128-row tiles "
          "halve the filter's reads (not an NCHW output with a residual)",
          lambda d: (_wgmma(d) and d.tma128 and d.taps == 1 and 2 * d.tiles128 >= d.sms
                     and (d.pb.K >= 2048 or d.pb.K >= 512 and d.pb.Kred >= 512 and d.tiles128 >= 5 * d.sms)
                     and not d.nchw_residual),
          lambda d: d.update(bm=128, wm=2, bn=128, stages=3)),
     Rule("one-wave-4-stages", "TMA loads and less than a wave of tiles: 4 stages",
          lambda d: _wgmma(d) and d.tma128 and d.tiles < d.sms, lambda d: d.update(stages=4)),
     Rule("gather-few-k-128-rows", "the 16-byte gather with taps and K <= 64 (conv1 unfolded): 128-row tiles halve "
          "the filter's L2 traffic per output row",
          lambda d: (_wgmma(d) and not d.tma128 and d.taps > 1 and d.pb.K <= 64 and d.pb.layout == "NHWC"
                     and d.pb.C % d.ce == 0 and 2 * _cdiv(d.pb.M, 128) >= d.sms),
          lambda d: d.update(bm=128, wm=2, stages=4))),
    (Rule("128x128-4-stages", "128x128 tiles: 4 stages (one CTA an SM) where one CTA an SM fills its waves and "
          "two do not",
          lambda d: ("tma-taps-128-rows" in d.fired and d.bn == 128 and d.tiles128 >= d.sms
                     and _wave_fill(d.tiles128, d.sms) > 1.1 * _wave_fill(d.tiles128, 2 * d.sms)),
          lambda d: d.update(stages=4)),),
    (Rule("tf32x3-tiles", "3xTF32 keeps two fp32 accumulator sets: warp tiles of at most 2048 elements (64x128, "
          "128x64 for K <= 64); 3 stages for the NCHW gather",
          lambda d: d.math == "tf32x3",
          lambda d: d.update(bm=128 if d.pb.K <= 64 else 64, bn=64 if d.pb.K <= 64 else 128,
                             stages=3 if d.pb.layout == "NCHW" else 4)),),
    (Rule("short-reduction-2-stages", "at most 2 k-tiles: nothing to pipeline, the smaller footprint buys CTAs "
          "(not the 3xTF32 wgmma kernel, one CTA an SM, whose loads then wait)",
          lambda d: d.math not in ("simt", "tf32x3_wgmma") and d.kt <= 2, lambda d: d.update(stages=2)),),
    # -- the loads
    (Rule("loads-16-byte", "16-byte gathers where the layout, channel count and alignment allow, else elements",
          _always, _base_loads),),
    (Rule("nchw-in-place-tma", "NCHW 1x1 stride-1 with H*W % 64 == 0: x read in place as MN-major TMA tiles",
          lambda d: (_wgmma(d) and d.pb.layout == "NCHW" and d.load_b == "vec" and d.x_aligned
                     and use_tma(d.pb, d.arch, d.bm)),
          lambda d: d.update(load_a="tmamn", load_b="tma")),),
    (Rule("tma-loads", "16-bit NHWC with C % 64 == 0: both operands by TMA (the warps do no gather work)",
          lambda d: _wgmma(d) and d.load_a == d.load_b == "vec" and d.pb.C % 64 == 0 and use_tma(d.pb, d.arch, d.bm),
          lambda d: d.update(load_a="tma", load_b="tma")),),
    # -- split-K
    (Rule("tf32x3-splits", "the compute-bound 3xTF32 tiles want two CTAs an SM: split while the tiles are fewer",
          lambda d: d.math == "tf32x3", _tf32x3_splits),
     Rule("tf32x3-wgmma-splits", "3xTF32 on wgmma: the split of least cost in rounds of one-CTA-an-SM waves "
          "(partials counted)",
          lambda d: d.math == "tf32x3_wgmma", _tf32x3_wgmma_splits),
     Rule("split-k-fill", "split K when the tiles cannot fill the GPU (~2 CTAs an SM, >= 8 k-tiles each)",
          _always, lambda d: d.update(splits=choose_splits(d.pb, d.bm, d.bn, d.bk, d.sms)))),
    # -- the persistent warp-specialised kernel
    (Rule("persistent-over-splitk", "few tiles and a deep reduction: the persistent kernel's producer warp beats "
          "split-K unless the tiles are very few and each would run a long reduction alone",
          lambda d: (_tma_64_rows(d) and d.splits > 1 and (10 * d.tiles >= d.sms or d.kt <= 32 and d.taps == 1)
                     and (d.kt <= 48 or 4 * d.tiles >= d.sms)),
          lambda d: d.update(persistent=True)),
     Rule("persistent-one-wave", "at most one wave of single CTAs (128 columns if 64 would not): the persistent "
          "kernel with one consumer and a deep ring (a 1x1 of 16+ k-tiles, or 4+ within one wave of 64-column "
          "tiles; not an NCHW residual 1x1)",
          lambda d: (_tma_64_rows(d) and d.splits == 1
                     and (d.taps > 1 or not d.nchw_residual and (d.kt >= 16 or d.kt >= 4 and d.tiles <= d.sms))
                     and (d.tiles <= d.sms or _wider(d))),
          lambda d: d.update(bn=128 if _wider(d) else d.bn, persistent=True))),
    (Rule("persistent-1x1-3ctas", "a few k-tiles a tile and several waves (1x1 over 64-256 channels) with a chain: "
          "3 persistent CTAs an SM, so each CTA's next loads run under its epilogue",
          lambda d: (d.short and d.bn == 128 and d.pb.residual_dtype is None
                     and (bool(d.pb.epilogue) or d.kt <= 2 and d.tiles < 12 * d.sms)),
          lambda d: d.update(persistent=True, ctas=3)),
     Rule("persistent-1x1-alone-2ctas", "a one-k-tile 1x1 alone (no chain, no statistics) over 12+ tiles an SM: "
          "2 persistent CTAs an SM, 3 stages",
          lambda d: (d.short and d.bn == 128 and d.kt == 1 and not d.pb.epilogue and d.pb.residual_dtype is None
                     and not d.bn_stats),
          lambda d: d.update(persistent=True, ctas=2)),
     Rule("persistent-residual-2ctas", "two k-tiles with a 16-bit residual, NHWC: 2 persistent CTAs an SM, 3 stages",
          lambda d: (d.short and d.bn == 128 and d.kt == 2 and d.pb.residual_dtype in ("float16", "bfloat16")
                     and d.pb.layout == "NHWC" and d.pb.out_layout in (None, "NHWC")),
          lambda d: d.update(persistent=True, ctas=2)),
     Rule("persistent-64col-3ctas", "64-column 1x1 tiles of 3-4 k-tiles (1x1 256->64): 3 persistent CTAs an SM",
          lambda d: (d.short and d.bn == 64 and d.taps == 1 and d.kt >= 3
                     and (bool(d.pb.epilogue) or d.tiles < 12 * d.sms)),
          lambda d: d.update(persistent=True, ctas=3)),
     Rule("persistent-3x3-64-3ctas", "3x3 into 64 channels with a chain, 10+ tiles an SM, NHWC, no residual: "
          "64x64 persistent tiles, 3 CTAs an SM, 4 stages",
          lambda d: (_wgmma(d) and d.load_a == "tma" and d.splits == 1 and not d.persistent and d.taps > 1
                     and d.pb.K <= 64 and d.pb.layout == "NHWC" and d.pb.y_layout == "NHWC"
                     and d.pb.residual_dtype is None and bool(d.pb.epilogue) and _cdiv(d.pb.M, 64) >= 10 * d.sms),
          lambda d: d.update(bm=64, wm=1, bn=64, persistent=True, ctas=3, ws_stages=4))),
    (Rule("persistent-consumers", "one consumer and a deep ring where the tiles are at most one an SM, else two "
          "consumers taking turns (one with 2-3 stages when several CTAs share an SM)",
          lambda d: d.persistent, _consumers),),
    (Rule("cluster-ksplit", "at most half a wave of 64x64 tiles and 32+ k-tiles: two CTAs a tile in a cluster",
          lambda d: d.persistent and d.wm == 1 and d.bn == 64 and 2 * d.tiles <= d.sms and d.kt >= 32,
          lambda d: d.update(csplit=2, stages=6)),),
)


def choose_config(pb: ConvProblem, arch: str = "sm_90a", *, x_aligned: bool = True, w_aligned: bool = True,
                  sms: int = 132, trace: list | None = None, bn_stats: bool = False) -> KernelSpec:
    """The kernel for the kernel problem ``pb`` on ``arch`` with ``sms`` SMs (``x_aligned``/``w_aligned``: the base
    pointers are 16-byte aligned). ``trace``: a list that receives the names of the rules that fired; ``bn_stats``:
    the plan asks its kernel for the output's BatchNorm statistics (the training forward)."""
    if pb.patch:
        return patch_config(pb, sms)
    d = _Draft(pb, arch, sms, x_aligned, w_aligned, bn_stats)
    for group in RULES:
        for rule in group:
            if rule.when(d):
                rule.then(d)
                d.fired.append(rule.name)
                break
    if trace is not None:
        trace.extend(d.fired)
    return d.spec()


def patch_config(pb: ConvProblem, sms: int = 132, **kw) -> KernelSpec:
    """The patch kernel for a patch problem: 128-row tiles (two warpgroups) when they give two waves, 64 or
    128 columns, the whole filter tile resident (stages = k-tiles); ``kw`` overrides."""
    kt = -(-pb.Kred // 64)
    bm = 128 if 2 * -(-pb.M // 128) >= sms else 64
    spec = KernelSpec(pb.dtype, pb.layout, "wgmma", bm, 64 if pb.K <= 64 else 128, 64, bm // 64, 1, max(kt, 2),
                      "patch", "vec", "rows", 8, False, pb.epilogue, 1)
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
    elif base.math == "tf32x3_wgmma":
        add(**FFMA_CONFIG)                  # the FFMA kernel, and the mma.sync 3xTF32 kernel's tiles
        for bm, bn, wm, wn in ((128, 64, 2, 2), (64, 128, 2, 2)):
            add(math="tf32x3", bk=16, bm=bm, bn=bn, wm=wm, wn=wn, stages=4)
        for bm in (64, 128):
            for bn in (64, 128):
                for stages in (3, 4):
                    for sp in (1, 2, 4):
                        add(bm=bm, bn=bn, wm=bm // 64, stages=stages, splits=sp)
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

