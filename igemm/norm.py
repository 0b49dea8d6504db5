"""BatchNorm kernels: per-channel statistics (Welford + Chan), the fused BN(-Add)-ReLU forward with the
1-bit mask, and the backward reductions / elementwise pass with the mask's ReLU gradient fused in.

Names and meanings follow PyTorch's ``torch.batch_norm_*`` functions (which ``SyncBatchNorm`` is built
from); :mod:`igemm.syncbn` adds the cross-process pieces.

Layouts: ``"NCHW"`` means ``x[N, C, *spatial]`` and ``"NHWC"`` means ``x[N, *spatial, C]`` (for a
torch ``channels_last`` tensor pass ``x.permute(0, 2, 3, 1)``, which is contiguous); tensors must be
contiguous. Inputs fp32/fp16/bf16, every accumulation in fp32 (fp64 for the final merges); per-channel
vectors (mean, invstd, weight, bias, sums, running stats) are fp32.

Device side (``csrc/norm_stats.cuh``, ``csrc/norm_elemt.cuh``): statistics are two launches with no
atomics (kernel 1: each block a fixed slice of a channel, or of a tile of channels, into a workspace;
kernel 2: per channel, the partials merged in slice order), so results are deterministic and the grid
fills the GPU whatever C is; with one slice per channel kernel 1 writes the result itself.
The mask is ARCHITECTURE.md's (bit ``i % 32`` of word ``i // 32`` is set exactly when stored ``y[i] > 0``),
bit for bit what :func:`igemm.relu_mask` and the conv epilogue write.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from . import _kernel, reference
from ._dispatch import CallContext, check_contiguous, check_dtype, check_no_overlap
from ._runtime import keeps_current_context
from ._kernel import ParamSpec
from ._runtime import DTYPE_CTYPE, DTYPE_SIZES, FLOAT_DTYPES
from .relu import _check_mask as _relu_check_mask
from .relu import mask_dtype_for, mask_words

__all__ = ["welford", "batch_norm_stats", "batch_norm_gather_stats", "batch_norm_elemt", "batch_norm_relu",
           "batch_norm_backward_reduce", "batch_norm_backward_elemt", "batch_norm_relu_backward",
           "reduction_config", "elemt_config", "instances_for", "compile_stubs", "precompile", "LAYOUTS"]

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
_CNT_CTYPE = {"float32": "float", "float64": "double", "int32": "int32_t", "int64": "int64_t"}
_STAT_CTYPE = {"float32": "float", "float64": "double"}


# =========================================================================================== configs
def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _align_of(*ptrs: int) -> int:
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
                     unroll: int = _STATS_UNROLL) -> RedConfig:
    """Pure function of the problem and the GPU's SM count; ``N * HW`` must be > 0."""
    if N * HW <= 0:
        raise ValueError("reduction_config needs N * HW > 0")
    target = _BLOCKS_PER_SM * sms
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
def elemt_config(layout: str, N: int, C: int, HW: int, itemsize: int, align: int, sms: int) -> EwConfig:
    nhwc = layout == "NHWC" or HW == 1
    V = _vec_for(C if nhwc else HW, itemsize, align)
    NV = N * C * HW // V
    target = _BLOCKS_PER_SM * sms
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

    def __init__(self, stub: str, device_id: int, blocks: int, params, static: dict):
        k = _kernel.load(stub, _cache_name(stub), _entry(stub), device_id)
        self.launcher = _kernel.Launcher(k, int(blocks), THREADS)
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


@lru_cache(maxsize=1024)
def _red_plan(device_id: int, dtype: str, grad: bool, cfg: RedConfig, C: int, HW: int, total: int, mode: int,
              f64: int):
    static = dict(C=C, S=cfg.S, gx=cfg.gx, tx=cfg.tx, txs=cfg.txs, P=cfg.P, mode=mode, f64=f64, HW=HW,
                  len=cfg.length, L=cfg.L, VPP=cfg.VPP, doff=cfg.doff, dv=cfg.dv, dwrap=cfg.dwrap,
                  shift=1 if cfg.nhwc else HW, total=total)
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
    align = _align_of(*(values.get(k, 0) for k in ("x", "dy")))
    cfg = reduction_config(layout, N, C, HW, DTYPE_SIZES[dtype], align, _sms(ctx.device_id),
                           _GRAD_UNROLL if grad else _STATS_UNROLL)
    k1, k2 = _red_plan(ctx.device_id, dtype, grad, cfg, C, HW, total, mode, int(f64))
    ws = None
    if k2 is not None:
        ws, t_ws = ctx.empty((cfg.workspace_floats(C),), "float32")
        values["part"] = t_ws.ptr
    k1(ctx.stream, values)
    if k2 is not None:
        k2(ctx.stream, values)
    del ws  # stream-ordered frees (torch/cupy caching allocators, cuda.core pools): safe after the launches


@lru_cache(maxsize=1024)
def _ew_plan(device_id: int, dtype: str, backward: bool, cfg: EwConfig, act_or_mask: int, res: bool, C: int,
             HW: int, count_cs: int):
    static = dict(C=C, fixed=int(cfg.fixed), HW=HW, NV=cfg.NV, dhw=cfg.dhw, dc=cfg.dc, count_cs=count_cs)
    if backward:
        s = stub_backward(dtype, cfg.vec, cfg.nhwc, bool(act_or_mask), res)
    else:
        s = stub_forward(dtype, cfg.vec, cfg.nhwc, act_or_mask, res)
    return _Kern(s, device_id, cfg.blocks, _EW_PARAMS, static)


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
    _gather_plan(ctx.device_id, "float64", "float64", C, W, 0, 0, 2 * C, 0, 0, True)(ctx.stream, ptrs)


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
    for i in ("float32", "float64"):
        for c in _CNT_CTYPE:
            stubs.append(stub_gather(i, c))
    stubs = list(dict.fromkeys(stubs))
    if verbose:
        print(f"compiling {len(stubs)} BatchNorm kernel instances for {arch}", flush=True)
    compile_stubs(stubs, arch, jobs)
    return len(stubs)


# =========================================================================================== validation
def _check_mask(t, numel: int, name: str = "mask") -> None:
    """relu's mask check; an empty mask of an empty tensor passes (numpy gives it zero strides)."""
    if t.numel == 0 and numel == 0 and t.ndim == 1:
        check_dtype(t, name, ("uint32", "int32"))
        return
    _relu_check_mask(t, numel, name)


def _check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'NCHW' or 'NHWC', got {layout!r}")


def _geometry(t, layout: str, name: str = "x") -> tuple[int, int, int]:
    """(N, C, HW) of an activation tensor in ``layout``."""
    if t.ndim < 2:
        want = "(N, C, ...)" if layout == "NCHW" else "(N, ..., C)"
        raise ValueError(f"{name}: expected at least 2 dimensions {want} for layout {layout}, got shape "
                         f"{tuple(t.shape)}")
    shape = tuple(int(s) for s in t.shape)
    if layout == "NCHW":
        N, C, rest = shape[0], shape[1], shape[2:]
    else:
        N, C, rest = shape[0], shape[-1], shape[1:-1]
    HW = 1
    for s in rest:
        HW *= s
    if C < 1:
        raise ValueError(f"{name}: has no channels (shape {shape}, layout {layout}: C = {C})")
    if C >= 2 ** 31:
        raise ValueError(f"{name}: {C} channels is more than igemm supports (< 2**31)")
    return N, C, HW


def _contiguous(t, name: str) -> None:
    if t.numel:  # numpy gives empty arrays zero strides
        check_contiguous(t, name)


def _check_act(t, name: str, layout: str) -> tuple[int, int, int]:
    check_dtype(t, name, FLOAT_DTYPES)
    _contiguous(t, name)
    return _geometry(t, layout, name)


def _check_like(t, name: str, ref, ref_name: str) -> None:
    if tuple(t.shape) != tuple(ref.shape):
        raise ValueError(f"{name}: shape {tuple(t.shape)} differs from {ref_name}'s {tuple(ref.shape)}")
    if t.dtype != ref.dtype:
        raise TypeError(f"{name}: dtype {t.dtype} differs from {ref_name}'s {ref.dtype}")
    _contiguous(t, name)


def _check_vec(ctx, name: str, C: int, layout: str, dtypes=("float32",)) -> None:
    """A per-channel vector: 1-D, C elements, contiguous, fp32."""
    t = ctx.views.get(name)
    if t is None:
        return
    check_dtype(t, name, dtypes)
    if tuple(t.shape) != (C,):
        raise ValueError(f"{name}: expected shape ({C},) (one value per channel; C = {C} with layout {layout}), "
                         f"got {tuple(t.shape)}")
    check_contiguous(t, name)


def _out_dict(out, names: tuple, what: str) -> dict:
    if out is None:
        return {}
    if not isinstance(out, (tuple, list)) or len(out) != len(names):
        raise TypeError(f"out: expected None or a tuple of {len(names)} arrays ({', '.join(names)}) for {what}, "
                        f"got {type(out).__name__}" + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
    return {f"out.{n}": o for n, o in zip(names, out) if o is not None}


def _check_outs(ctx, keys, shape, dtypes, inputs=()) -> None:
    for k in keys:
        t = ctx.views.get(k)
        if t is None:
            continue
        check_dtype(t, k, dtypes)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{k}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
        check_contiguous(t, k)
        for i in inputs:
            if i in ctx.views:
                check_no_overlap(t, k, ctx.views[i], i)


def _check_eps(eps) -> float:
    try:
        e = float(eps)
    except (TypeError, ValueError):
        raise TypeError(f"eps: expected a number, got {type(eps).__name__}") from None
    if not e >= 0.0 or not math.isfinite(e):
        raise ValueError(f"eps: must be finite and >= 0, got {eps!r}")
    return e


def _check_momentum(m) -> float:
    try:
        v = float(m)
    except (TypeError, ValueError):
        raise TypeError(f"momentum: expected a number, got {type(m).__name__}") from None
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"momentum: must be in [0, 1], got {m!r}")
    return v


# =========================================================================================== outputs
def _alloc(ctx, key: str, shape, dtype: str):
    """(object, device Tensor, given) for an output: the caller's ``out`` if given, else a fresh one."""
    if key in ctx.views:
        return ctx.views[key].obj, ctx.device_view(key), True
    obj, t = ctx.empty(shape, dtype)
    return obj, t, False


def _ret(ctx, key: str, out):
    obj, t, given = out
    if given:
        ctx.copy_back(key, t)
        return obj
    return ctx.finish(obj)


def _np_ret(value, out_obj, dtype):
    """numpy backend: cast ``value`` into the caller's ``out`` (returned) or a new array of ``dtype``."""
    if out_obj is not None:
        o = np.asarray(out_obj)
        o[...] = np.asarray(value).astype(o.dtype)
        return out_obj
    return np.asarray(value).astype(dtype)


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes  # numpy has no bfloat16; only reachable with ml_dtypes inputs
        return ml_dtypes.bfloat16
    return np.dtype(name)


def _host(a):
    return None if a is None else np.asarray(a)


# =========================================================================================== statistics
@keeps_current_context
def welford(x, layout: str = "NCHW", *, out=None, stream=None):
    """Per-channel ``(mean, var, count)`` of ``x``: biased variance (``M2 / count``), fp32 results.

    Welford per thread on ``x - K_c`` (``K_c`` the channel's first element, so a large mean costs no
    precision), Chan merges across threads, warps and blocks in a fixed order (deterministic). ``count``
    is ``N * H * W`` for every channel (fp32: exact up to 2**24). ``out=(mean, var, count)`` may give
    fp64 arrays, which get fp64 results. An empty batch gives zeros.

    >>> import numpy as np, igemm
    >>> x = np.arange(12, dtype=np.float32).reshape(2, 3, 2)      # N=2, C=3, L=2
    >>> [a.tolist() for a in igemm.welford(x)]
    [[3.5, 5.5, 7.5], [9.25, 9.25, 9.25], [4.0, 4.0, 4.0]]
    """
    _check_layout(layout)
    outs = _out_dict(out, ("mean", "var", "count"), "welford")
    ctx = CallContext({"x": x, **outs}, stream)
    t_x = ctx.views["x"]
    N, C, HW = _check_act(t_x, "x", layout)
    keys = ("out.mean", "out.var", "out.count")
    _check_outs(ctx, keys, (C,), ("float32", "float64"), ("x",))
    given = {ctx.views[k].dtype for k in keys if k in ctx.views}
    if len(given) > 1:
        raise TypeError(f"out: mean, var and count must share one dtype, got {sorted(given)}")
    odt = given.pop() if given else "float32"
    if ctx.backend == "numpy":
        vals = reference.welford_stats(np.asarray(x), layout)
        o = out or (None, None, None)
        return tuple(_np_ret(v, oo, odt) for v, oo in zip(vals, o))
    d_x = ctx.device_view("x")
    res = [_alloc(ctx, k, (C,), odt) for k in keys]
    launch_reduction(ctx, grad=False, dtype=t_x.dtype, layout=layout, N=N, C=C, HW=HW,
                     ptrs=dict(x=d_x.ptr, out0=res[0][1].ptr, out1=res[1][1].ptr, out2=res[2][1].ptr),
                     mode=0, f64=odt == "float64")
    return tuple(_ret(ctx, k, r) for k, r in zip(keys, res))


@keeps_current_context
def batch_norm_stats(x, eps: float = 1e-5, layout: str = "NCHW", *, running_mean=None, running_var=None,
                     momentum: float = 0.1, out=None, stream=None):
    """``(mean, invstd)`` per channel, fp32, as ``torch.batch_norm_stats``: ``invstd = 1/sqrt(var + eps)``
    with the biased variance (0 where ``var == 0 and eps == 0``).

    One pass over ``x`` (see :func:`welford`); the grid fills the GPU whatever C (no block per channel).
    With ``running_mean``/``running_var`` (fp32, updated in place on the device) they also get PyTorch's
    training update: ``r = (1 - momentum) * r + momentum * stat`` with the unbiased variance.

    >>> import numpy as np, igemm
    >>> x = np.array([[[1.], [2.]], [[3.], [6.]]], np.float32)      # N=2, C=2, L=1
    >>> [np.round(a, 4).tolist() for a in igemm.batch_norm_stats(x, 0.0)]
    [[2.0, 4.0], [1.0, 0.5]]
    """
    _check_layout(layout)
    e = _check_eps(eps)
    mom = _check_momentum(momentum)
    outs = _out_dict(out, ("mean", "invstd"), "batch_norm_stats")
    ctx = CallContext({"x": x, "running_mean": running_mean, "running_var": running_var, **outs}, stream)
    t_x = ctx.views["x"]
    N, C, HW = _check_act(t_x, "x", layout)
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var: give both or neither")
    _check_vec(ctx, "running_mean", C, layout)
    _check_vec(ctx, "running_var", C, layout)
    keys = ("out.mean", "out.invstd")
    _check_outs(ctx, keys, (C,), ("float32",), ("x", "running_mean", "running_var"))
    if ctx.backend == "numpy":
        mean, var, n = reference.welford_stats(np.asarray(x), layout)
        if running_mean is not None:
            rm, rv = reference.update_running_stats_ref(running_mean, running_var, mean, var, n, mom)
            np.asarray(running_mean)[...] = rm
            np.asarray(running_var)[...] = rv
        o = out or (None, None)
        return (_np_ret(mean, o[0], np.float32), _np_ret(reference.invstd_from_var(var, e), o[1], np.float32))
    d_x = ctx.device_view("x")
    res = [_alloc(ctx, k, (C,), "float32") for k in keys]
    d_rm = ctx.device_view("running_mean") if running_mean is not None else None
    d_rv = ctx.device_view("running_var") if running_var is not None else None
    launch_reduction(ctx, grad=False, dtype=t_x.dtype, layout=layout, N=N, C=C, HW=HW,
                     ptrs=dict(x=d_x.ptr, out0=res[0][1].ptr, out1=res[1][1].ptr,
                               run_mean=d_rm.ptr if d_rm else 0, run_var=d_rv.ptr if d_rv else 0),
                     mode=1, eps=e, momentum=mom)
    if d_rm is not None:
        ctx.copy_back("running_mean", d_rm)
        ctx.copy_back("running_var", d_rv)
    return tuple(_ret(ctx, k, r) for k, r in zip(keys, res))


def _check_partials(ctx, mname: str, vname: str, cname: str):
    """Validate [W, C] means/vars and [W] or [W, C] counts; returns (W, C, cnt_rs, cnt_cs)."""
    tm, tv, tc = ctx.views[mname], ctx.views[vname], ctx.views[cname]
    check_dtype(tm, mname, ("float32", "float64"))
    if tm.ndim != 2:
        raise ValueError(f"{mname}: expected a 2-D array [world_size, C], got shape {tuple(tm.shape)}")
    W, C = (int(s) for s in tm.shape)
    if C < 1:
        raise ValueError(f"{mname}: has no channels (shape {tuple(tm.shape)})")
    _check_like(tv, vname, tm, mname)
    check_contiguous(tm, mname)
    check_dtype(tc, cname, tuple(_CNT_CTYPE))
    check_contiguous(tc, cname)
    if tuple(tc.shape) == (W,):
        return W, C, 1, 0
    if tuple(tc.shape) == (W, C):
        return W, C, C, 1
    raise ValueError(f"{cname}: expected shape ({W},) (one count per rank) or ({W}, {C}), got {tuple(tc.shape)}")


@keeps_current_context
def batch_norm_gather_stats(means, vars, counts, *, out=None, stream=None):  # noqa: A002 - PyTorch's name
    """Chan's parallel merge of per-rank partials: ``means``/``vars`` ``[W, C]`` (biased variances, fp32 or
    fp64), ``counts`` ``[W]`` or ``[W, C]`` (fp32/fp64/int32/int64) → merged ``(mean, var, count)`` ``[C]``
    in the means' dtype. Merged in fp64, in rank order (deterministic); ranks with count 0 are skipped on
    the device (no host synchronisation). Unlike ``torch.batch_norm_gather_stats_with_counts`` this takes
    variances, not invstd (which loses the variance when var << eps).

    >>> import numpy as np, igemm
    >>> m, v, n = igemm.batch_norm_gather_stats(np.array([[0.], [2.], [5.]]), np.array([[1.], [1.], [9.]]),
    ...                                         np.array([2., 2., 0.]))
    >>> m.tolist(), v.tolist(), n.tolist()
    ([1.0], [2.0], [4.0])
    """
    outs = _out_dict(out, ("mean", "var", "count"), "batch_norm_gather_stats")
    ctx = CallContext({"means": means, "vars": vars, "counts": counts, **outs}, stream)
    W, C, cnt_rs, cnt_cs = _check_partials(ctx, "means", "vars", "counts")
    odt = ctx.views["means"].dtype
    keys = ("out.mean", "out.var", "out.count")
    _check_outs(ctx, keys, (C,), (odt,), ("means", "vars", "counts"))
    if ctx.backend == "numpy":
        vals = reference.chan_merge(np.asarray(means), np.asarray(vars), np.asarray(counts))
        o = out or (None, None, None)
        return tuple(_np_ret(v, oo, odt) for v, oo in zip(vals, o))
    dm, dv, dc = (ctx.device_view(k) for k in ("means", "vars", "counts"))
    res = [_alloc(ctx, k, (C,), odt) for k in keys]
    launch_gather(ctx, in_dtype=odt, cnt_dtype=dc.dtype, C=C, W=W, rs=C, cnt_rs=cnt_rs, cnt_cs=cnt_cs,
                  ptrs=dict(mean=dm.ptr, var=dv.ptr, cnt=dc.ptr, out0=res[0][1].ptr, out1=res[1][1].ptr,
                            out2=res[2][1].ptr), mode=0, f64=odt == "float64")
    return tuple(_ret(ctx, k, r) for k, r in zip(keys, res))


# =========================================================================================== forward
def _forward(x, mean, invstd, weight, bias, residual, act: int, layout, out, mask_out, stream, what: str):
    _check_layout(layout)
    ctx = CallContext({"x": x, "mean": mean, "invstd": invstd, "weight": weight, "bias": bias,
                       "residual": residual, "out": out, "mask_out": mask_out}, stream)
    t_x = ctx.views["x"]
    N, C, HW = _check_act(t_x, "x", layout)
    for k in ("mean", "invstd", "weight", "bias"):
        if k not in ctx.views and k in ("mean", "invstd"):
            raise TypeError(f"{k}: required")
        _check_vec(ctx, k, C, layout)
    if residual is not None:
        _check_like(ctx.views["residual"], "residual", t_x, "x")
    if out is not None:
        _check_like(ctx.views["out"], "out", t_x, "x")
        for k in ("x", "residual", "mean", "invstd", "weight", "bias"):
            if k in ctx.views:
                check_no_overlap(ctx.views["out"], "out", ctx.views[k], k)
    numel = N * C * HW
    if mask_out is not None:
        if act != 2:
            raise ValueError(f"mask_out: {what} writes no mask here (return_mask=False)")
        _check_mask(ctx.views["mask_out"], numel, "mask_out")
        for k in ("x", "residual", "out"):
            if k in ctx.views:
                check_no_overlap(ctx.views["mask_out"], "mask_out", ctx.views[k], k)
    if ctx.backend == "numpy":
        xd = np.asarray(x)
        y = reference.batch_norm_elemt_ref(xd, mean, invstd, _host(weight), _host(bias), layout, _host(residual),
                                           relu=act != 0)
        y = _np_ret(y, out, xd.dtype)
        if act != 2:
            return y
        m = reference.pack_mask(np.asarray(y, dtype=np.float64) > 0)
        if mask_out is not None:
            mo = np.asarray(mask_out)
            mo.view(np.uint32)[:m.size] = m
            return y, mask_out
        return y, m
    d = {k: ctx.device_view(k) for k in ("x", "mean", "invstd", "weight", "bias", "residual") if k in ctx.views}
    yres = _alloc(ctx, "out", t_x.shape, t_x.dtype)
    mres = _alloc(ctx, "mask_out", (mask_words(numel),), mask_dtype_for(ctx.kind)) if act == 2 else None
    if numel:
        cfg = elemt_config(layout, N, C, HW, t_x.itemsize,
                           _align_of(d["x"].ptr, yres[1].ptr, d["residual"].ptr if "residual" in d else 0),
                           _sms(ctx.device_id))
        k = _ew_plan(ctx.device_id, t_x.dtype, False, cfg, act, "residual" in d, C, HW, 0)
        k(ctx.stream, {"x": d["x"].ptr, "res": d["residual"].ptr if "residual" in d else 0, "y": yres[1].ptr,
                       "mask": mres[1].ptr if mres else 0, "mean": d["mean"].ptr, "invstd": d["invstd"].ptr,
                       "weight": d["weight"].ptr if "weight" in d else 0,
                       "bias": d["bias"].ptr if "bias" in d else 0})
    y = _ret(ctx, "out", yres)
    if act != 2:
        return y
    return y, _ret(ctx, "mask_out", mres)


@keeps_current_context
def batch_norm_elemt(x, mean, invstd, weight=None, bias=None, *, residual=None, layout: str = "NCHW", out=None,
                     stream=None):
    """``y = (x - mean) * invstd * weight + bias (+ residual)`` per channel, computed in fp32, stored in x's
    dtype (``torch.batch_norm_elemt``; note the argument order of :func:`batch_norm_relu`, not torch's
    ``(input, weight, bias, mean, invstd, eps)``). ``weight``/``bias`` None mean 1 and 0.
    """
    return _forward(x, mean, invstd, weight, bias, residual, 0, layout, out, None, stream, "batch_norm_elemt")


@keeps_current_context
def batch_norm_relu(x, mean, invstd, gamma=None, beta=None, residual=None, return_mask: bool = True, *,
                    layout: str = "NCHW", out=None, mask_out=None, stream=None):
    """Fused BN(-Add)-ReLU in one pass: ``y = relu((x - mean) * invstd * gamma + beta [+ residual])``
    and, with ``return_mask``, the 1-bit ReLU mask: ``uint32[ceil(numel/32)]`` (``int32`` for torch), bit
    ``i % 32`` of word ``i // 32`` set exactly when the stored ``y`` at memory offset ``i`` is > 0 (so
    ``mask == igemm.relu_mask(y)`` bit for bit; NaN gives 0 and stays NaN in y, as ``torch.relu``).
    The backward needs the mask and x, never y: :func:`batch_norm_relu_backward`.

    >>> import numpy as np, igemm
    >>> x = np.array([[[-1., 0.5, 2.]]], np.float32)                  # N=1, C=1, L=3
    >>> y, m = igemm.batch_norm_relu(x, np.zeros(1, np.float32), np.ones(1, np.float32))
    >>> y.tolist(), int(m[0])
    ([[[0.0, 0.5, 2.0]]], 6)
    """
    return _forward(x, mean, invstd, gamma, beta, residual, 2 if return_mask else 1, layout, out,
                    mask_out if return_mask else None, stream, "batch_norm_relu")


# =========================================================================================== backward
@keeps_current_context
def batch_norm_backward_reduce(dy, x, mean, invstd, weight=None, input_g: bool = True, weight_g: bool = True,
                               bias_g: bool = True, *, mask=None, layout: str = "NCHW", out=None, stream=None):
    """``(sum_dy, sum_dy_xmu, grad_weight, grad_bias)`` per channel (fp32), as
    ``torch.batch_norm_backward_reduce``: ``sum_dy = Σ dy``, ``sum_dy_xmu = Σ dy·(x − mean)``,
    ``grad_weight = sum_dy_xmu · invstd``, ``grad_bias = sum_dy``; entries not asked for
    (``input_g``/``weight_g``/``bias_g``) are None. With ``mask`` (from :func:`batch_norm_relu`) dy is
    first replaced by ``bit ? dy : 0`` (a select), i.e. these are BN-ReLU's gradients. Deterministic.
    ``weight`` is accepted for PyTorch's signature and not used (nor is it by PyTorch).
    """
    _check_layout(layout)
    outs = _out_dict(out, ("sum_dy", "sum_dy_xmu", "grad_weight", "grad_bias"), "batch_norm_backward_reduce")
    ctx = CallContext({"dy": dy, "x": x, "mean": mean, "invstd": invstd, "weight": weight, "mask": mask,
                       **outs}, stream)
    t_x = ctx.views["x"]
    N, C, HW = _check_act(t_x, "x", layout)
    _check_like(ctx.views["dy"], "dy", t_x, "x")
    for k in ("mean", "invstd", "weight"):
        _check_vec(ctx, k, C, layout)
    if mask is not None:
        _check_mask(ctx.views["mask"], N * C * HW)
    keys = ("out.sum_dy", "out.sum_dy_xmu", "out.grad_weight", "out.grad_bias")
    _check_outs(ctx, keys, (C,), ("float32",), ("dy", "x", "mean", "invstd", "mask"))
    want = (input_g, input_g, weight_g, bias_g)
    if ctx.backend == "numpy":
        vals = reference.batch_norm_backward_reduce_ref(np.asarray(dy), np.asarray(x), mean, invstd, layout,
                                                        _host(mask))
        o = out or (None,) * 4
        return tuple(_np_ret(v, oo, np.float32) if w else None for v, oo, w in zip(vals, o, want))
    d = {k: ctx.device_view(k) for k in ("dy", "x", "mean", "invstd", "mask") if k in ctx.views}
    res = [_alloc(ctx, k, (C,), "float32") if (w or k in ctx.views) else None for k, w in zip(keys, want)]
    if res[0] is None:  # the sums are always computed; scratch when not asked for
        res[0] = (*ctx.empty((C,), "float32"), False)
        res[1] = (*ctx.empty((C,), "float32"), False)
    launch_reduction(ctx, grad=True, dtype=t_x.dtype, layout=layout, N=N, C=C, HW=HW,
                     ptrs=dict(dy=d["dy"].ptr, x=d["x"].ptr, mask=d["mask"].ptr if "mask" in d else 0,
                               mean=d["mean"].ptr, invstd=d["invstd"].ptr, out0=res[0][1].ptr, out1=res[1][1].ptr,
                               out2=res[2][1].ptr if res[2] else 0, out3=res[3][1].ptr if res[3] else 0))
    return tuple(_ret(ctx, k, r) if (r is not None and w) else None for k, r, w in zip(keys, res, want))


def _count_arg(ctx, count, C: int):
    """(count_val, count_cs, has_array) for a Python number or a 1- or C-element fp32 array."""
    if "count" not in ctx.views:
        if isinstance(count, bool) or not isinstance(count, (int, float, np.integer, np.floating)):
            raise TypeError(f"count: expected a number or an fp32 array of 1 or {C} elements, got "
                            f"{type(count).__name__}")
        if not count > 0:
            raise ValueError(f"count: must be > 0, got {count}")
        return float(count), 0, False
    t = ctx.views["count"]
    check_dtype(t, "count", ("float32",))
    check_contiguous(t, "count")
    n = t.numel
    if n not in (1, C) or t.ndim > 1:
        raise ValueError(f"count: expected 1 or {C} elements (global count, per channel or one), got shape "
                         f"{tuple(t.shape)}")
    return 0.0, (1 if n == C and C > 1 else 0), True


@keeps_current_context
def batch_norm_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count, *, mask=None,
                              layout: str = "NCHW", residual_grad: bool = False, out=None, residual_grad_out=None,
                              stream=None):
    """``dx = (dy − sum_dy/n − (x − mean)·invstd²·sum_dy_xmu/n)·weight·invstd`` (PyTorch's
    ``batch_norm_backward_elemt``; ``weight`` None means 1), with dy replaced by ``bit ? dy : 0`` (a
    select) when ``mask`` is given. ``count`` is the global count n: a number, or an fp32 device array of 1
    or C elements (what :func:`igemm.sync_batch_norm_stats` returns with ``return_count=True``; for
    PyTorch's per-rank int counts pass ``counts.sum().float()``). With ``residual_grad`` also returns the
    residual's gradient of BN-Add-ReLU, the masked dy itself: ``(dx, d_residual)``.
    """
    _check_layout(layout)
    ctx = CallContext({"dy": dy, "x": x, "mean": mean, "invstd": invstd, "weight": weight, "sum_dy": sum_dy,
                       "sum_dy_xmu": sum_dy_xmu, "count": count if not _is_number(count) else None, "mask": mask,
                       "out": out, "residual_grad_out": residual_grad_out}, stream)
    t_x = ctx.views["x"]
    N, C, HW = _check_act(t_x, "x", layout)
    _check_like(ctx.views["dy"], "dy", t_x, "x")
    for k in ("mean", "invstd", "sum_dy", "sum_dy_xmu"):
        if k not in ctx.views:
            raise TypeError(f"{k}: required")
    for k in ("mean", "invstd", "weight", "sum_dy", "sum_dy_xmu"):
        _check_vec(ctx, k, C, layout)
    count_val, count_cs, count_arr = _count_arg(ctx, count, C)
    numel = N * C * HW
    if mask is not None:
        _check_mask(ctx.views["mask"], numel)
    if residual_grad_out is not None and not residual_grad:
        raise ValueError("residual_grad_out: given but residual_grad is False")
    for k in ("out", "residual_grad_out"):
        if k in ctx.views:
            _check_like(ctx.views[k], k, t_x, "x")
            for i in ("dy", "x", "mask", "mean", "invstd", "weight", "sum_dy", "sum_dy_xmu", "count"):
                if i in ctx.views:
                    check_no_overlap(ctx.views[k], k, ctx.views[i], i)
    if "out" in ctx.views and "residual_grad_out" in ctx.views:
        check_no_overlap(ctx.views["out"], "out", ctx.views["residual_grad_out"], "residual_grad_out")
    if ctx.backend == "numpy":
        cnt = count_val if not count_arr else np.asarray(count, dtype=np.float64).ravel()
        dx = reference.batch_norm_backward_elemt_ref(dy, x, mean, invstd, _host(weight), sum_dy, sum_dy_xmu, cnt,
                                                     layout, _host(mask))
        xdt = np.asarray(x).dtype
        dx = _np_ret(dx, out, xdt)
        if not residual_grad:
            return dx
        dres = reference.relu_backward(np.asarray(dy), np.asarray(mask).view(np.uint32)) if mask is not None \
            else np.asarray(dy)
        return dx, _np_ret(dres, residual_grad_out, xdt)
    d = {k: ctx.device_view(k) for k in ("dy", "x", "mean", "invstd", "weight", "sum_dy", "sum_dy_xmu", "count",
                                         "mask") if k in ctx.views}
    dxr = _alloc(ctx, "out", t_x.shape, t_x.dtype)
    drr = _alloc(ctx, "residual_grad_out", t_x.shape, t_x.dtype) if residual_grad else None
    if numel:
        cfg = elemt_config(layout, N, C, HW, t_x.itemsize,
                           _align_of(d["dy"].ptr, d["x"].ptr, dxr[1].ptr, drr[1].ptr if drr else 0),
                           _sms(ctx.device_id))
        k = _ew_plan(ctx.device_id, t_x.dtype, True, cfg, int(mask is not None), bool(residual_grad), C, HW,
                     count_cs)
        k(ctx.stream, {"dy": d["dy"].ptr, "x": d["x"].ptr, "mask": d["mask"].ptr if "mask" in d else 0,
                       "y": dxr[1].ptr, "dres": drr[1].ptr if drr else 0, "mean": d["mean"].ptr,
                       "invstd": d["invstd"].ptr, "weight": d["weight"].ptr if "weight" in d else 0,
                       "sum_dy": d["sum_dy"].ptr, "sum_dy_xmu": d["sum_dy_xmu"].ptr,
                       "count": d["count"].ptr if "count" in d else 0, "count_val": count_val})
    dx = _ret(ctx, "out", dxr)
    if not residual_grad:
        return dx
    return dx, _ret(ctx, "residual_grad_out", drr)


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


@keeps_current_context
def batch_norm_relu_backward(dy, x, mask, mean, invstd, gamma=None, *, count=None, residual: bool = False,
                             layout: str = "NCHW", stream=None):
    """Backward of :func:`batch_norm_relu` (training mode, batch statistics) from ``x`` and the mask, never
    y: ``(dx, dgamma, dbeta)``, plus ``d_residual`` when ``residual`` (BN-Add-ReLU). Two passes:
    :func:`batch_norm_backward_reduce` then :func:`batch_norm_backward_elemt`, both with the mask's select.
    ``count`` defaults to this batch's ``N*H*W`` (pass the global count under SyncBN).
    """
    sdy, sdx, gw, gb = batch_norm_backward_reduce(dy, x, mean, invstd, gamma, True, True, True, mask=mask,
                                                  layout=layout, stream=stream)
    if count is None:
        t_x = CallContext({"x": x}).views["x"]
        N, C, HW = _geometry(t_x, layout)
        count = max(N * HW, 1)
    r = batch_norm_backward_elemt(dy, x, mean, invstd, gamma, sdy, sdx, count, mask=mask, layout=layout,
                                  residual_grad=residual, stream=stream)
    if residual:
        return r[0], gw, gb, r[1]
    return r, gw, gb
