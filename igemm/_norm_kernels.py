"""BatchNorm kernels' launch side: geometry rules (pure functions of the problem and the SM count), the
kernel stubs, cached launch plans and the launches themselves; :mod:`igemm.norm` validates and calls these.

Device side (``csrc/norm_stats.cuh``, ``csrc/norm_elemt.cuh``): statistics are two launches with no
atomics (kernel 1: each block a fixed slice of a channel, or of a tile of channels, into a workspace;
kernel 2: per channel, the partials merged in slice order), so results are deterministic and the grid
fills the GPU whatever C is; with one slice per channel kernel 1 writes the result itself. Launch
arguments go through ``_kernel.pack_args`` from the ParamSpec lists below (one definition per kernel kind).
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from . import _kernel
from ._kernel import ParamSpec
from ._runtime import DTYPE_CTYPE, DTYPE_SIZES, FLOAT_DTYPES

__all__ = ["RedConfig", "EwConfig", "reduction_config", "elemt_config", "launch_reduction", "reduction_kernels",
           "elemt_kernel", "launch_gather",
           "launch_sum_ranks", "launch_elemt", "instances_for", "compile_stubs", "precompile", "stub_stats_k1",
           "stub_finalize", "stub_gather", "stub_sum_ranks", "stub_forward", "stub_backward", "finalize_per_block",
           "align_of", "LAYOUTS", "THREADS"]

LAYOUTS = ("NCHW", "NHWC")
THREADS = 256
_STATS_UNROLL = 4   # vectors per thread per iteration in the Welford kernels (csrc: U)
_GRAD_UNROLL = 2
_EW_UNROLL = 2
_BLOCKS_PER_SM = 4  # __launch_bounds__(256, 4): every grid below is at most one resident wave
_RED_PARAMS = [ParamSpec(n, "ptr") for n in ("x", "dy", "mask", "mean", "invstd", "part", "out0", "out1",
                                             "out2", "out3", "run_mean", "run_var")] + \
              [ParamSpec(n, "int32") for n in ("C", "S", "gx", "tx", "txs", "P", "mode", "f64")] + \
              [ParamSpec(n, "int64") for n in ("HW", "len", "L", "VPP", "doff", "dv", "dwrap", "shift", "total")] + \
              [ParamSpec("eps", "float32"), ParamSpec("momentum", "float32")]
_EW_PARAMS = [ParamSpec(n, "ptr") for n in ("x", "dy", "res", "mask", "y", "dres", "mean", "invstd", "weight",
                                            "bias", "sum_dy", "sum_dy_xmu", "count")] + \
             [ParamSpec("C", "int32"), ParamSpec("fixed", "int32")] + \
             [ParamSpec(n, "int64") for n in ("HW", "NV", "dhw", "dc", "count_cs")] + \
             [ParamSpec("count_val", "float32")]
_GATHER_PARAMS = [ParamSpec(n, "ptr") for n in ("mean", "var", "cnt", "out0", "out1", "out2", "run_mean",
                                                "run_var")] + \
                 [ParamSpec(n, "int32") for n in ("C", "W", "mode", "f64")] + \
                 [ParamSpec(n, "int64") for n in ("rs", "cnt_rs", "cnt_cs")] + \
                 [ParamSpec("eps", "float32"), ParamSpec("momentum", "float32")]
# the training path's one-launch passes (csrc/norm_train.cuh): the reduction's parameters, the elementwise forward's
# (res, y, weight, bias, NV, dhw, dc, fixed; ewb its blocks; nbt: num_batches_tracked) and the dz pass's and its
# coefficients' (src, dst, z, coef, sel, gamma, M, K, count; dzb, dzt its blocks and their threads)
_CNT_CTYPE = {"float32": "float", "float64": "double", "int32": "int32_t", "int64": "int64_t"}
_STAT_CTYPE = {"float32": "float", "float64": "double"}


# =========================================================================================== configs
def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def align_of(*ptrs: int) -> int:
    """Largest power of two <= 16 dividing every (non-null) pointer."""
    a = 16
    for p in ptrs:
        if p:
            while a > 1 and p % a:
                a //= 2
    return a


def _vec_for(extent: int, itemsize: int, align: int) -> int:
    v = 16 // itemsize
    while v > 1 and (extent % v or v * itemsize > align):
        v //= 2
    return v


@dataclass(frozen=True)
class RedConfig:
    """Kernel-1 geometry of a per-channel reduction (csrc/norm_stats.cuh describes the mapping)."""
    nhwc: bool      # the row kernel (NHWC, or NCHW with HW == 1); else the plane kernel
    vec: int        # V
    blocks: int
    S: int          # slices per channel (NCHW) / per channel tile (NHWC); S == 1: kernel 1 writes results
    L: int          # vectors (NCHW) or rows (NHWC) per slice
    length: int     # vectors per channel (NCHW: N*HW/V) or rows (NHWC: N*HW)
    VPP: int = 1
    doff: int = 0
    dv: int = 0
    dwrap: int = 0
    tx: int = 1
    txs: int = 0
    P: int = 0
    gx: int = 1

    @property
    def final(self) -> bool:
        return self.S == 1

    def workspace_floats(self, C: int) -> int:
        return 0 if self.final else 3 * C * self.S


@lru_cache(maxsize=4096)
def reduction_config(layout: str, N: int, C: int, HW: int, itemsize: int, align: int, sms: int,
                     unroll: int = _STATS_UNROLL, per_sm: int = _BLOCKS_PER_SM) -> RedConfig:
    """Pure function of the problem and the GPU's SM count (at most ``per_sm`` blocks an SM); ``N * HW`` must be
    > 0."""
    if N * HW <= 0:
        raise ValueError("reduction_config needs N * HW > 0")
    target = per_sm * sms
    if layout == "NHWC" or HW == 1:
        M = N * HW
        V = _vec_for(C, itemsize, align)
        P = C // V
        tx = min(32, 1 << (P - 1).bit_length())
        txs = tx.bit_length() - 1
        ty = THREADS // tx
        gx = _ceil_div(P, tx)
        S = max(1, min(target // gx, _ceil_div(M, ty * unroll)))
        L = _ceil_div(M, S)
        S = _ceil_div(M, L)
        return RedConfig(True, V, gx * S, S, L, M, tx=tx, txs=txs, P=P, gx=gx)
    V = _vec_for(HW, itemsize, align)
    VPP = HW // V
    NV = N * VPP
    S = max(1, min(target // C, _ceil_div(NV, THREADS * unroll)))
    L = _ceil_div(NV, S)
    S = _ceil_div(NV, L)
    dn, dv = divmod(THREADS, VPP)
    return RedConfig(False, V, C * S, S, L, NV, VPP=VPP, doff=dn * C * HW + dv * V, dv=dv, dwrap=C * HW - HW)


@dataclass(frozen=True)
class EwConfig:
    """Grid of an elementwise kernel (csrc/norm_elemt.cuh)."""
    nhwc: bool
    vec: int
    blocks: int
    NV: int         # vectors in the tensor
    dhw: int        # a grid step of G*V elements, decomposed (see ChanPos)
    dc: int
    fixed: bool     # every thread keeps its channels (NHWC): coefficients loaded once


@lru_cache(maxsize=4096)
def elemt_config(layout: str, N: int, C: int, HW: int, itemsize: int, align: int, sms: int,
                 target: int | None = None) -> EwConfig:
    """``target``: at most this many blocks (default one wave of 4 an SM)."""
    nhwc = layout == "NHWC" or HW == 1
    V = _vec_for(C if nhwc else HW, itemsize, align)
    NV = N * C * HW // V
    target = target or _BLOCKS_PER_SM * sms
    blocks = max(1, min(target, _ceil_div(NV, THREADS)))
    fixed = False
    if nhwc:
        if NV > blocks * THREADS:                     # threads visit several vectors
            m = C // math.gcd(C, THREADS * V)         # blocks must be a multiple of m for G*V % C == 0
            if blocks % m:
                if m <= target:
                    blocks = (target // m) * m
                elif m <= 4 * target:
                    blocks = m
            fixed = (blocks * THREADS * V) % C == 0
        else:
            fixed = True
    step = blocks * THREADS * V
    if nhwc:
        dhw, dc = 0, step % C
    else:
        dq, dhw = divmod(step, HW)
        dc = dq % C
    return EwConfig(nhwc, V, blocks, NV, dhw, dc, fixed)


# =========================================================================================== launching
_NP_SCALAR = {"int32": "i32", "uint32": "u32", "int64": "i64", "float32": "f32"}


class _Kern:
    """A compiled instance with its packed arguments; a call rewrites the per-call slots and launches.
    (cuLaunchKernel copies the arguments at launch, so the buffer is reused; a lock keeps threads apart.)"""

    __slots__ = ("launcher", "args", "base", "slot", "ctype", "lock")

    def __init__(self, stub: str, device_id: int, blocks: int, params, static: dict, coop: bool = False):
        k = _kernel.load(stub, _cache_name(stub), _entry(stub), device_id)
        self.launcher = _kernel.Launcher(k, int(blocks), THREADS, coop=coop)
        self.args = _kernel.pack_args(params, static)
        self.base = self.args.data.copy()     # static values, every pointer null
        self.slot = {p.name: self.args.slots[p.name] for p in params}
        self.ctype = {p.name: p.ctype for p in params}
        self.lock = threading.Lock()

    def __call__(self, stream, values: dict) -> None:
        a = self.args
        with self.lock:
            a.data[...] = self.base           # nothing carries over from the previous call
            for name, v in values.items():
                i = self.slot[name]
                t = self.ctype[name]
                if t == "ptr":
                    a.u64[i] = int(v) if v else 0
                elif t == "float32":
                    a.f32[2 * i] = float(v)
                elif t == "int32":
                    a.i32[2 * i] = int(v)
                elif t == "int64":
                    a.data.view(np.int64)[i] = int(v)
                else:  # pragma: no cover
                    raise ValueError(f"per-call value of type {t} for {name}")
            self.launcher(stream, a)


    def slots(self, names) -> np.ndarray:
        """The argument-buffer slots of pointer parameters ``names``, for :meth:`run`."""
        return np.array([self.slot[n] for n in names], dtype=np.intp)

    def run(self, stream, slots: np.ndarray, ptrs: list, floats: tuple = ()) -> None:
        """The repeated caller's launch: pointer ``slots`` set to ``ptrs`` and ``(slot, value)`` float32 pairs, every
        other value static (one buffer write instead of :meth:`__call__`'s per-name dispatch)."""
        a = self.args
        with self.lock:
            a.data[...] = self.base
            a.u64[slots] = ptrs
            for i, v in floats:
                a.f32[2 * i] = v
            self.launcher(stream, a)


def _sms(device_id: int) -> int:
    from ._runtime import device_props
    return int(device_props(device_id).multiprocessor_count)


_ENTRIES: dict = {}


def _stub(include: str, entry: str, body: str, params, min_blocks: int | None = _BLOCKS_PER_SM) -> str:
    s = _kernel.render_kernel(include=include, entry=entry, params=params, threads=THREADS,
                              min_blocks=min_blocks, body=body)
    _ENTRIES[s] = entry
    return s


def stub_stats_k1(dtype: str, vec: int, nhwc: bool, final: bool, grad: bool) -> str:
    fn = ("grad_" if grad else "stats_") + ("nhwc" if nhwc else "nchw")
    return _stub("norm_stats.cuh", "igemm_bn_" + fn,
                 f"igemm::norm::{fn}<{DTYPE_CTYPE[dtype]}, {vec}, {'true' if final else 'false'}>(p);",
                 _RED_PARAMS)


def stub_finalize(dtype: str, grad: bool, block: bool = False) -> str:
    sfx = "_block" if block else ""
    if grad:
        return _stub("norm_stats.cuh", "igemm_bn_grad_finalize" + sfx, f"igemm::norm::grad_finalize{sfx}(p);",
                     _RED_PARAMS, None)
    return _stub("norm_stats.cuh", "igemm_bn_stats_finalize" + sfx,
                 f"igemm::norm::stats_finalize{sfx}<{DTYPE_CTYPE[dtype]}>(p);", _RED_PARAMS, None)


def finalize_per_block(C: int, S: int) -> bool:
    """Kernel 2 with a block per channel (few channels, many partials) instead of a warp per channel."""
    return C <= 256 and S >= 64


def stub_gather(in_dtype: str, cnt_dtype: str) -> str:
    return _stub("norm_stats.cuh", "igemm_bn_gather",
                 f"igemm::norm::gather_stats<{_STAT_CTYPE[in_dtype]}, {_CNT_CTYPE[cnt_dtype]}>(p);",
                 _GATHER_PARAMS, None)


def stub_sum_ranks() -> str:
    return _stub("norm_stats.cuh", "igemm_bn_sum_ranks", "igemm::norm::sum_ranks(p);", _GATHER_PARAMS, None)


def stub_forward(dtype: str, vec: int, nhwc: bool, act: int, res: bool) -> str:
    lay = "igemm::norm::kNHWC" if nhwc else "igemm::norm::kNCHW"
    return _stub("norm_elemt.cuh", "igemm_bn_forward",
                 f"igemm::norm::bn_forward<{DTYPE_CTYPE[dtype]}, {vec}, {lay}, {act}, "
                 f"{'true' if res else 'false'}>(p);", _EW_PARAMS)


def stub_backward(dtype: str, vec: int, nhwc: bool, mask: bool, dres: bool) -> str:
    lay = "igemm::norm::kNHWC" if nhwc else "igemm::norm::kNCHW"
    return _stub("norm_elemt.cuh", "igemm_bn_backward",
                 f"igemm::norm::bn_backward<{DTYPE_CTYPE[dtype]}, {vec}, {lay}, {'true' if mask else 'false'}, "
                 f"{'true' if dres else 'false'}>(p);", _EW_PARAMS)


def _entry(stub: str) -> str:
    return _ENTRIES[stub]


def _cache_name(stub: str) -> str:
    """The kernel-cache file name of a stub (the same for precompiling and loading)."""
    return "bn_" + _entry(stub)[len("igemm_bn_"):]


def _red_static(cfg: RedConfig, C: int, HW: int, total: int, mode: int, f64: int) -> dict:
    """A reduction's launch values that stay the same from call to call."""
    return dict(C=C, S=cfg.S, gx=cfg.gx, tx=cfg.tx, txs=cfg.txs, P=cfg.P, mode=mode, f64=f64, HW=HW, len=cfg.length,
                L=cfg.L, VPP=cfg.VPP, doff=cfg.doff, dv=cfg.dv, dwrap=cfg.dwrap, shift=1 if cfg.nhwc else HW,
                total=total)


def _ew_static(cfg: EwConfig, C: int, HW: int, count_cs: int = 0) -> dict:
    """An elementwise pass's launch values that stay the same from call to call."""
    return dict(C=C, fixed=int(cfg.fixed), HW=HW, NV=cfg.NV, dhw=cfg.dhw, dc=cfg.dc, count_cs=count_cs)


@lru_cache(maxsize=1024)
def _red_plan(device_id: int, dtype: str, grad: bool, cfg: RedConfig, C: int, HW: int, total: int, mode: int,
              f64: int):
    static = _red_static(cfg, C, HW, total, mode, f64)
    s1 = stub_stats_k1(dtype, cfg.vec, cfg.nhwc, cfg.final, grad)
    k1 = _Kern(s1, device_id, cfg.blocks, _RED_PARAMS, static)
    k2 = None
    if not cfg.final:
        blk = finalize_per_block(C, cfg.S)
        s2 = stub_finalize(dtype, grad, blk)
        k2 = _Kern(s2, device_id, C if blk else _ceil_div(C, THREADS // 32), _RED_PARAMS, static)
    return k1, k2


@lru_cache(maxsize=256)
def _empty_plan(device_id: int, dtype: str, grad: bool, C: int, mode: int, f64: int, HW: int):
    """Kernel 2 alone with no partials (N * HW == 0): writes the statistics of an empty batch."""
    static = dict(C=C, S=0, mode=mode, f64=f64, HW=HW, shift=HW, total=0)
    s2 = stub_finalize(dtype, grad)
    return _Kern(s2, device_id, _ceil_div(C, THREADS // 32), _RED_PARAMS, static)


def launch_reduction(ctx, *, grad: bool, dtype: str, layout: str, N: int, C: int, HW: int, ptrs: dict,
                     mode: int = 0, f64: bool = False, eps: float = 0.0, momentum: float = 0.0) -> None:
    """Kernel 1 (+ kernel 2) of a per-channel reduction on ``ctx.stream``.

    ``ptrs``: x (and dy, mask, mean, invstd for grad), out0..out3, run_mean/run_var. Stats mode 0 writes
    (mean, var, count) in fp32 (fp64 if ``f64``), mode 1 (mean, invstd) in fp32; grad writes (sum_dy,
    sum_dy_xmu) in fp32/fp64 and grad_weight/grad_bias where given.
    """
    total = N * HW
    values = dict(ptrs)
    values["eps"] = eps
    values["momentum"] = momentum
    if total == 0:
        _empty_plan(ctx.device_id, dtype, grad, C, mode, int(f64), HW)(ctx.stream, values)
        return
    k1, k2, nws = reduction_kernels(ctx.device_id, grad=grad, dtype=dtype, layout=layout, N=N, C=C, HW=HW,
                                    align=align_of(*(values.get(k, 0) for k in ("x", "dy"))), mode=mode, f64=f64)
    ws = None
    if k2 is not None:
        ws, t_ws = ctx.empty((nws,), "float32")
        values["part"] = t_ws.ptr
    k1(ctx.stream, values)
    if k2 is not None:
        k2(ctx.stream, values)
    del ws  # stream-ordered frees (torch/cupy caching allocators, cuda.core pools): safe after the launches


def reduction_kernels(device_id: int, *, grad: bool, dtype: str, layout: str, N: int, C: int, HW: int, align: int,
                      mode: int = 0, f64: bool = False) -> tuple:
    """:func:`launch_reduction`'s kernels for one geometry (``N * HW > 0``) and pointer alignment, found once by a
    caller that launches them many times: ``(kernel 1, kernel 2 or None, workspace floats kernel 2 needs)``."""
    cfg = reduction_config(layout, N, C, HW, DTYPE_SIZES[dtype], align, _sms(device_id),
                           _GRAD_UNROLL if grad else _STATS_UNROLL)
    k1, k2 = _red_plan(device_id, dtype, grad, cfg, C, HW, N * HW, mode, int(f64))
    return k1, k2, cfg.workspace_floats(C) if k2 is not None else 0


def elemt_kernel(device_id: int, *, backward: bool, dtype: str, layout: str, N: int, C: int, HW: int,
                 act_or_mask: int, res: bool, align: int, count_cs: int = 0) -> "_Kern":
    """:func:`launch_elemt`'s kernel for one geometry (``N * C * HW > 0``) and pointer alignment."""
    cfg = elemt_config(layout, N, C, HW, DTYPE_SIZES[dtype], align, _sms(device_id))
    return _ew_plan(device_id, dtype, backward, cfg, act_or_mask, res, C, HW, count_cs)


@lru_cache(maxsize=1024)
def _ew_plan(device_id: int, dtype: str, backward: bool, cfg: EwConfig, act_or_mask: int, res: bool, C: int,
             HW: int, count_cs: int):
    static = _ew_static(cfg, C, HW, count_cs)
    if backward:
        s = stub_backward(dtype, cfg.vec, cfg.nhwc, bool(act_or_mask), res)
    else:
        s = stub_forward(dtype, cfg.vec, cfg.nhwc, act_or_mask, res)
    return _Kern(s, device_id, cfg.blocks, _EW_PARAMS, static)


def launch_elemt(ctx, *, backward: bool, dtype: str, layout: str, N: int, C: int, HW: int, act_or_mask: int,
                 res: bool, ptrs: dict, align_ptrs=(), count_cs: int = 0) -> None:
    """One elementwise pass on ``ctx.stream``: the BN(-Add)(-ReLU) forward (``act_or_mask``: 0 none, 1 ReLU,
    2 ReLU + mask; ``res``: a residual) or the backward (``act_or_mask``: the mask's select; ``res``: the
    residual's gradient written). The vector width follows the alignment of ``align_ptrs``."""
    if N * C * HW == 0:
        return
    elemt_kernel(ctx.device_id, backward=backward, dtype=dtype, layout=layout, N=N, C=C, HW=HW,
                 act_or_mask=act_or_mask, res=res, align=align_of(*align_ptrs), count_cs=count_cs)(ctx.stream, ptrs)


@lru_cache(maxsize=256)
def _gather_plan(device_id: int, in_dtype: str, cnt_dtype: str, C: int, W: int, mode: int, f64: int, rs: int,
                 cnt_rs: int, cnt_cs: int, sum_ranks: bool = False):
    static = dict(C=C, W=W, mode=mode, f64=f64, rs=rs, cnt_rs=cnt_rs, cnt_cs=cnt_cs)
    s = stub_sum_ranks() if sum_ranks else stub_gather(in_dtype, cnt_dtype)
    return _Kern(s, device_id, max(1, _ceil_div(C, THREADS)), _GATHER_PARAMS, static)


def launch_gather(ctx, *, in_dtype: str, cnt_dtype: str, C: int, W: int, rs: int, cnt_rs: int, cnt_cs: int,
                  ptrs: dict, mode: int, f64: bool = False, eps: float = 0.0, momentum: float = 0.0) -> None:
    values = dict(ptrs)
    values["eps"] = eps
    values["momentum"] = momentum
    _gather_plan(ctx.device_id, in_dtype, cnt_dtype, C, W, mode, int(f64), rs, cnt_rs, cnt_cs)(ctx.stream, values)


def launch_sum_ranks(ctx, *, C: int, W: int, ptrs: dict) -> None:
    sync_kernels(ctx.device_id, C, W)[1](ctx.stream, ptrs)


def sync_kernels(device_id: int, C: int, W: int) -> tuple:
    """SyncBatchNorm's merges for a caller that launches them many times: ``(gather, sum_ranks)``, the first merging W
    packed fp64 ``[3, C]`` (mean, var, count) rows into fp32 (mean, invstd, count) with the running update (mode 1),
    the second summing W fp64 ``[2, C]`` (sum_dy, sum_dy_xmu) rows into fp32 (both in rank order)."""
    return (_gather_plan(device_id, "float64", "float64", C, W, 1, 0, 3 * C, 3 * C, 1),
            _gather_plan(device_id, "float64", "float64", C, W, 0, 0, 2 * C, 0, 0, True))


def instances_for(layout: str, N: int, C: int, HW: int, dtype: str, *, sms: int, align: int = 16,
                  stats: bool = True, grad: bool = True, forward=((2, False),), backward=((True, False),)) -> list:
    """The kernel stubs the functions of this module launch for one problem (pure: no GPU needed), e.g. to
    compile them in parallel ahead of time. ``forward``: (act, residual) pairs, act 0 = batch_norm_elemt,
    1 = ReLU, 2 = ReLU + mask; ``backward``: (mask, residual_grad) pairs."""
    out = []
    isz = DTYPE_SIZES[dtype]
    if N * HW == 0:
        return [stub_finalize(dtype, False)] * stats + [stub_finalize(dtype, True)] * grad
    for g, on in ((False, stats), (True, grad)):
        if on:
            cfg = reduction_config(layout, N, C, HW, isz, align, sms, _GRAD_UNROLL if g else _STATS_UNROLL)
            out.append(stub_stats_k1(dtype, cfg.vec, cfg.nhwc, cfg.final, g))
            if not cfg.final:
                out.append(stub_finalize(dtype, g, finalize_per_block(C, cfg.S)))
    if forward or backward:
        ec = elemt_config(layout, N, C, HW, isz, align, sms)
        out += [stub_forward(dtype, ec.vec, ec.nhwc, act, res) for act, res in forward]
        out += [stub_backward(dtype, ec.vec, ec.nhwc, m, d) for m, d in backward]
    return list(dict.fromkeys(out))


def compile_stubs(stubs, arch: str, jobs: int | None = None) -> None:
    """Compile stubs into the disk cache in parallel (nvcc runs outside the GIL)."""
    from . import _build
    _build.compile_many(((_cache_name(s), s) for s in stubs), arch, jobs)


def precompile(arch: str = "sm_90a", *, dtypes=FLOAT_DTYPES, vecs=None, jobs: int | None = None,
               verbose: bool = False) -> int:
    """Compile every kernel instance this module can launch (for ``dtypes``; ``vecs`` restricts the
    vector widths, e.g. ``{1, "max"}``) into the disk cache, in parallel. Returns the number of instances."""
    stubs = []
    for dt in dtypes:
        isz = DTYPE_SIZES[dt]
        vs = [v for v in (1, 2, 4, 8) if v * isz <= 16]
        if vecs is not None:
            vs = [v for v in vs if v in vecs or ("max" in vecs and v * isz == 16)]
        stubs.append(stub_finalize(dt, False))
        stubs.append(stub_finalize(dt, False, True))
        for v in vs:
            for nhwc in (False, True):
                for final in (False, True):
                    for grad in (False, True):
                        stubs.append(stub_stats_k1(dt, v, nhwc, final, grad))
                for act in (0, 1, 2):
                    for res in (False, True):
                        stubs.append(stub_forward(dt, v, nhwc, act, res))
                for m in (False, True):
                    for dres in (False, True):
                        stubs.append(stub_backward(dt, v, nhwc, m, dres))
    stubs.append(stub_finalize("float32", True))
    stubs.append(stub_finalize("float32", True, True))
    stubs.append(stub_sum_ranks())
    from ._norm_train import train_stubs
    stubs += train_stubs()
    for i in ("float32", "float64"):
        for c in _CNT_CTYPE:
            stubs.append(stub_gather(i, c))
    stubs = list(dict.fromkeys(stubs))
    if verbose:
        print(f"compiling {len(stubs)} BatchNorm kernel instances for {arch}", flush=True)
    compile_stubs(stubs, arch, jobs)
    return len(stubs)

