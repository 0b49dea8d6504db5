"""The training path's one-launch BatchNorm passes' launch side (``csrc/norm_train.cuh``): their stubs, grids and
cached kernels, built on :mod:`igemm._norm_kernels`' reductions and elementwise passes. Forward: the statistics, their
merge and BN-(Add-)ReLU with the mask in one cooperative launch; backward: the sums, the dz coefficients and the dz
pass in one (held in registers where the tensor fits: ``held_config``)."""
from __future__ import annotations

from functools import lru_cache

from . import _kernel
from ._kernel import ParamSpec
from ._norm_kernels import (_GRAD_UNROLL, _RED_PARAMS, _STATS_UNROLL, THREADS, RedConfig, _ceil_div, _ew_static,
                            _Kern, _red_static, _sms, _stub, elemt_config, reduction_config)
from ._runtime import DTYPE_CTYPE, DTYPE_SIZES

__all__ = ["HELD_ROWS", "TRAIN_BWD_PTRS", "train_backward_blocks_per_sm", "stub_train", "train_stubs", "held_config",
           "train_kernel"]

_TRAIN_BLOCKS_PER_SM = 3  # the one-launch passes: 80 registers (their phases spill at 64)
HELD_ROWS = 8             # rows of 8 channels a thread holds in the held backward (64 registers of data)
_HELD_BLOCKS_PER_SM = 2   # (128 registers)


def train_backward_blocks_per_sm(nbytes: int, sms: int) -> int:
    """Blocks an SM of the one-launch backward pass over a 16-bit tensor of ``nbytes``: fewer where the tensor is
    small, whose phases are then latency, not bandwidth (docs/performance.md: bn-backward-blocks)."""
    per_sm = nbytes // sms
    return 1 if per_sm < 32 << 10 else 2 if per_sm < 64 << 10 else _TRAIN_BLOCKS_PER_SM

_TRAIN_PARAMS = _RED_PARAMS + [ParamSpec(n, "ptr") for n in ("res", "y", "weight", "bias", "src", "dst", "z", "coef",
                                                              "sel", "gamma", "nbt", "tiles")] + \
                [ParamSpec(n, "int32") for n in ("fixed", "K", "dzt", "ntiles")] + \
                [ParamSpec(n, "int64") for n in ("NV", "dhw", "dc", "ewb", "dzb", "M")] + \
                [ParamSpec("count", "float32")]
#: the pointer parameters of the one-launch backward pass a call sets (``_Kern.run``'s order; the rest are static)
TRAIN_BWD_PTRS = ("x", "dy", "mask", "mean", "invstd", "part", "out0", "out1", "out2", "out3", "gamma", "coef", "src",
                  "dst", "z", "sel")


def stub_train(dtype: str, final: bool, backward: bool, act: int = 0, res: bool = False, conv: bool = False,
               held: bool = False) -> str:
    """The training path's one-launch BatchNorm pass (16-bit channels-last, 8 channels a vector); ``conv``: the
    forward from the conv epilogue's per-tile statistics, the backward from the dgrad epilogue's per-tile sums;
    ``held``: the backward over a tensor held in registers (:data:`HELD_ROWS` rows a thread)."""
    t, f = DTYPE_CTYPE[dtype], "true" if final else "false"
    if held:
        return _stub("norm_train.cuh", "igemm_bn_train_backward_held",
                     f"igemm::norm::bn_train_backward_held<{t}, {HELD_ROWS}, {f}>(p);", _TRAIN_PARAMS,
                     _HELD_BLOCKS_PER_SM)
    if backward:
        return _stub("norm_train.cuh", "igemm_bn_train_backward",
                     f"igemm::norm::bn_train_backward<{t}, 8, {f}{', true' if conv else ''}>(p);", _TRAIN_PARAMS,
                     _TRAIN_BLOCKS_PER_SM)
    return _stub("norm_train.cuh", "igemm_bn_train_forward",
                 f"igemm::norm::bn_train_forward<{t}, 8, {act}, {str(res).lower()}, {f}{', true' if conv else ''}>(p);",
                 _TRAIN_PARAMS, _TRAIN_BLOCKS_PER_SM)


def train_stubs() -> list:
    """Every instance of the one-launch passes."""
    fwd = ((0, False), (0, True), (2, False), (2, True))
    return [stub_train(dt, final, bwd, act, res) for dt in ("float16", "bfloat16") for final in (False, True)
            for bwd, act, res in ((True, 0, False), *((False, a, r) for a, r in fwd))] + \
        [stub_train(dt, False, False, act, res, conv=True) for dt in ("float16", "bfloat16") for act, res in fwd] + \
        [stub_train(dt, False, True, conv=True) for dt in ("float16", "bfloat16")] + \
        [stub_train(dt, final, True, held=True) for dt in ("float16", "bfloat16") for final in (False, True)]


def held_config(N: int, C: int, HW: int, sms: int) -> RedConfig | None:
    """The grid of the held backward (``bn_train_backward_held``) over a channels-last ``(N, HW, C)`` tensor, or
    None where it would need more than :data:`HELD_ROWS` rows a thread at ``_HELD_BLOCKS_PER_SM`` blocks an SM:
    a block an SM where that holds the tensor, else up to two."""
    if C % 8 or N * HW <= 0:
        return None
    for per_sm in (1, _HELD_BLOCKS_PER_SM):
        cfg = reduction_config("NHWC", N, C, HW, 2, 16, sms, HELD_ROWS if per_sm > 1 else 1, per_sm)
        if cfg.L <= HELD_ROWS * (THREADS // cfg.tx):
            return cfg
    return None


@lru_cache(maxsize=1024)
def train_kernel(device_id: int, *, backward: bool, dtype: str, N: int, C: int, HW: int, act: int = 0,
                 res: bool = False, tiles: int = 0):
    """The training path's one-launch BatchNorm pass over a 16-byte aligned channels-last 16-bit ``(N, HW, C)``
    tensor (C % 8 == 0; csrc/norm_train.cuh): ``(kernel, workspace floats)``, or None where its grid would not be
    resident at once on this GPU (the caller then launches the separate kernels). Forward: the statistics, then
    :func:`elemt_kernel`'s pass with ``act``/``res``; backward: the sums, the dz coefficients, then the dz pass of
    ``igemm.conv._moves.launch_dz`` (``M = N * HW``, ``K = C``), from registers where :func:`held_config` fits the
    tensor (``bn_train_backward_held``). ``tiles``: the statistics (forward) are the conv epilogue's, ``tiles``
    rows of them (``Conv2dPlan.bn_stats_tiles``), or the sums (backward) the dgrad epilogue's that wrote dy
    (``NativeDgrad.sums_tiles``), at the ``tiles`` pointer."""
    if DTYPE_SIZES[dtype] != 2 or C % 8 or N * HW <= 0:
        return None
    sms = _sms(device_id)
    held = held_config(N, C, HW, sms) if backward and not tiles else None
    if held is not None:
        got = _train_kernel(device_id, True, dtype, N, C, HW, sms, held, True)
        if got is not None:
            return got
    cfg = reduction_config("NHWC", N, C, HW, 2, 16, sms, _GRAD_UNROLL if backward else _STATS_UNROLL,
                           train_backward_blocks_per_sm(2 * N * HW * C, sms) if backward else _TRAIN_BLOCKS_PER_SM)
    return _train_kernel(device_id, backward, dtype, N, C, HW, sms, cfg, False, act, res, tiles)


def _train_kernel(device_id: int, backward: bool, dtype: str, N: int, C: int, HW: int, sms: int, cfg: RedConfig,
                  held: bool, act: int = 0, res: bool = False, tiles: int = 0):
    """:func:`train_kernel`'s pass on reduction grid ``cfg`` (``held``: the held backward), or None where that
    grid is not one resident wave."""
    from .conv._moves import dz_geometry
    static = dict(_red_static(cfg, C, HW, N * HW, 1, 0), K=C, M=N * HW, count=float(N * HW))
    if backward:                          # (a block of the dz pass for each of this grid's)
        _, dzt = dz_geometry(N * HW, C, sms)
        static["dzb"], static["dzt"] = max(1, min(cfg.blocks, -(-N * HW * (C // 8) // dzt))), dzt
    else:
        ec = elemt_config("NHWC", N, C, HW, 2, 16, sms, cfg.blocks)   # (a block of it for each of this grid's)
        static.update(_ew_static(ec, C, HW), ewb=ec.blocks)
    nws = cfg.workspace_floats(C)
    if tiles:                             # items of 32 channels x L tiles, about one a block (norm_train.cuh)
        gx = _ceil_div(C, 32)
        L = _ceil_div(tiles, max(1, min(tiles, cfg.blocks // gx)))
        S = _ceil_div(tiles, L)
        static.update(gx=gx, L=L, S=S, ntiles=tiles)
        nws = 3 * C * S
    k = _Kern(stub_train(dtype, cfg.final and not tiles, backward, act, res, conv=bool(tiles), held=held), device_id,
              cfg.blocks, _TRAIN_PARAMS, static, coop=True)
    if _kernel.resident_blocks(k.launcher, THREADS) * sms < cfg.blocks:
        return None
    return k, nws
