"""Pooling of channels-last tensors (csrc/pool.cuh): 2-D max pooling, the kernels behind :class:`igemm.nn.MaxPool2d`,
and global average pooling (:func:`launch_avg_global`), behind :class:`igemm.nn.AdaptiveAvgPool2d` to 1 x 1.

The forward keeps, per output element, the window tap of its maximum in one byte (``kh * KW + kw``, PyTorch's
choice of maximum: the first in window order, or the last NaN), instead of the int64 flat index PyTorch's
``max_pool2d_with_indices`` writes (8x the bytes); the backward gathers ``dy`` into ``dx`` through those bytes in
PyTorch's order and precision, so ``dx`` equals PyTorch's (``torch.equal``). One difference: a window holding only
-inf sends its gradient to its first tap, where PyTorch's channels-last kernel sends it to the image's pixel
(0, 0). The geometry is ``torch.nn.MaxPool2d``'s (kernel, stride, padding, dilation, ceil_mode); :func:`fits`
says where these kernels run.

Global average pooling is PyTorch's ``adaptive_avg_pool2d`` to 1 x 1, which PyTorch computes as a mean: the sum in
fp32 times ``float(1 / (H * W))``, rounded once to the dtype (the sum's order is igemm's: csrc/pool.cuh).

The classifier head (:func:`launch_avg_linear`, behind :class:`igemm.nn.AvgPoolLinear` for one or two images) is
that pool, flattened, then ``torch.nn.functional.linear``: y = m @ w.T + b with m the pool's output in the dtype,
the products summed in fp32 and rounded once; one kernel in clusters of CTAs (sm_90+, 16-bit; for more images and
for fp32 the pool and cuBLAS are faster: docs/performance.md, classifier-head).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from . import _kernel
from ._kernel import ParamSpec
from ._runtime import DTYPE_CTYPE, DTYPE_SIZES

__all__ = ["out_size", "fits", "fits_avg", "fits_head", "launch_forward", "launch_backward", "launch_avg_global",
           "launch_avg_linear", "all_variants", "precompile"]

_GEOM = [*(ParamSpec(n, "int32") for n in ("C", "KH", "KW", "sh", "sw", "ph", "pw", "dh", "dw"))]
_FWD_PARAMS = [*(ParamSpec(n, "ptr") for n in ("x", "y", "idx")), ParamSpec("NV", "int64"),
               ParamSpec("H", "int32"), ParamSpec("W", "int32"), *_GEOM,
               *(ParamSpec(n, "fastdiv") for n in ("fd_CV", "fd_OW", "fd_OH"))]
_BWD_PARAMS = [*(ParamSpec(n, "ptr") for n in ("dy", "idx", "dx")), ParamSpec("NV", "int64"),
               ParamSpec("OH", "int32"), ParamSpec("OW", "int32"), *_GEOM,
               *(ParamSpec(n, "fastdiv") for n in ("fd_CV", "fd_W", "fd_H")), ParamSpec("band", "int32")]
_AVG_PARAMS = [ParamSpec("x", "ptr"), ParamSpec("y", "ptr"), *(ParamSpec(n, "int32") for n in ("HW", "C", "CV",
                                                                                                  "cblocks")),
               ParamSpec("inv", "float32")]
_AVG_VECS = 32                                 # a block's channel vectors (csrc/pool.cuh: kAvgVecs)
_HEAD_PARAMS = [*(ParamSpec(n, "ptr") for n in ("x", "w", "b", "y")),
                *(ParamSpec(n, "int32") for n in ("N", "HW", "C", "O", "Cs", "Og", "L")), ParamSpec("inv", "float32")]
# csrc/pool.cuh: kHeadCluster, kHeadImages, kHeadChannels, kHeadOutputs, kHeadThreads
HEAD_CLUSTER, HEAD_IMAGES, _HEAD_CHANNELS, _HEAD_OUTPUTS, _HEAD_THREADS = 8, 2, 1024, 128, 256
_HEAD_NI = (1, 2)                              # the head's variants: the images a launch takes
HEAD_DTYPES = ("float16", "bfloat16")
_THREADS = 256
_BAND_SMEM = 44 * 1024                         # csrc/pool.cuh: kBandSmem
_BAND_MAX = 32                                 # (a band's input rows: a block's work bounded)
DTYPES = ("float16", "bfloat16", "float32")


def out_size(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """One output extent, as PyTorch's ``pooling_output_shape``: with ``ceil_mode`` the last window must start
    inside the input or its left padding."""
    out = (size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def vec(dtype: str, C: int, *ptrs: int) -> int:
    """Channels a thread takes: 16 bytes where C and every pointer allow, else one."""
    v = 16 // DTYPE_SIZES[dtype]
    return v if C % v == 0 and not any(p % 16 for p in ptrs) else 1


def fits(dtype: str, N: int, C: int, H: int, W: int, OH: int, OW: int, k: tuple, p: tuple, d: tuple) -> str | None:
    """Why these kernels cannot run this pooling (None: they can): the dtype, a window of more than 254 taps
    (one byte a tap, 255 meaning none), padding past half the window (PyTorch's error), an empty tensor, or
    more than 2^31 - 1 pixel-vectors in a pass (32-bit indices)."""
    if dtype not in DTYPES:
        return f"dtype {dtype} (the kernels take {', '.join(DTYPES)})"
    if k[0] * k[1] > 254:
        return f"a {k[0]}x{k[1]} window (at most 254 taps)"
    if any(2 * p[i] > (k[i] - 1) * d[i] + 1 for i in (0, 1)):
        return "padding past half the window"
    if min(N, C, H, W, OH, OW) <= 0:
        return "an empty tensor"
    if N * max(H * W, OH * OW) * C >= 2 ** 31:
        return "a tensor of 2^31 elements or more"
    return None


#: square windows whose forward has its own kernel (taps unrolled: csrc/pool.cuh); 0: any window
WINDOWS = (0, 2, 3)


def fits_avg(dtype: str, N: int, C: int, H: int, W: int) -> str | None:
    """Why the global average pooling kernel cannot run (None: it can): the dtype, an empty tensor, or more than
    2^31 - 1 blocks or pixels."""
    if dtype not in DTYPES:
        return f"dtype {dtype} (the kernels take {', '.join(DTYPES)})"
    if min(N, C, H, W) <= 0:
        return "an empty tensor"
    if N * -(-C // _AVG_VECS) >= 2 ** 31 or H * W >= 2 ** 31:
        return "2^31 blocks or pixels or more"
    return None


def fits_head(dtype: str, N: int, C: int, H: int, W: int, O: int, cc: tuple = (9, 0)) -> str | None:
    """Why the classifier head's kernel cannot run (None: it can): the dtype, a device before sm_90 (clusters),
    more than :data:`HEAD_IMAGES` images, C not a multiple of 16 bytes' elements or above
    8 x 1024, an empty tensor, or 2^31 elements or more in x or w."""
    if dtype not in HEAD_DTYPES:
        return f"dtype {dtype} (the kernel takes {', '.join(HEAD_DTYPES)})"
    if tuple(cc) < (9, 0):
        return f"compute capability {cc[0]}.{cc[1]} (the kernel runs in clusters: 9.0 or later)"
    if min(N, C, H, W, O) <= 0:
        return "an empty tensor"
    if N > HEAD_IMAGES:
        return f"{N} images (at most {HEAD_IMAGES})"
    v = 16 // DTYPE_SIZES[dtype]
    if C % v or C > HEAD_CLUSTER * _HEAD_CHANNELS:
        return f"{C} channels (a multiple of {v}, at most {HEAD_CLUSTER * _HEAD_CHANNELS})"
    if N * H * W * C >= 2 ** 31 or O * C >= 2 ** 31:
        return "a tensor of 2^31 elements or more"
    return None


def _head_shape(N: int, C: int, HW: int, O: int, v: int) -> tuple:
    """(clusters, outputs a cluster, channels a CTA, pixel lanes): a CTA for each of 16 (at most) output slices
    and 8 channel slices (ResNet-50's 1000 x 2048: 128 CTAs of 63 outputs x 256 channels), more slices where an
    output slice would pass kHeadOutputs; lanes fill the CTA's threads with (image, vector) items."""
    clusters = max(min(16, -(-O // 8)), -(-O // _HEAD_OUTPUTS))
    og = -(-O // clusters)
    cs = -(-(-(-C // HEAD_CLUSTER)) // v) * v
    items = N * (cs // v)
    lanes = 1
    while items * lanes * 2 <= _HEAD_THREADS and lanes * 2 <= HW:
        lanes *= 2
    return clusters, og, cs, lanes


@lru_cache(maxsize=256)
def _head_template(N: int, C: int, HW: int, O: int, v: int) -> tuple:
    clusters, og, cs, lanes = _head_shape(N, C, HW, O, v)
    return clusters, _kernel.pack_args(_HEAD_PARAMS, dict(N=N, HW=HW, C=C, O=O, Cs=cs, Og=og, L=lanes,
                                                          inv=np.float32(1.0) / np.float32(HW)))


def _head_stub(dtype: str, ni: int) -> str:
    return _kernel.render_kernel(include="pool.cuh", entry="igemm_avgpool_linear", params=_HEAD_PARAMS,
                                 # (two CTAs an SM, a few registers spilled: faster than one, docs/performance.md)
                                 threads=_HEAD_THREADS, cluster=HEAD_CLUSTER, min_blocks=2,
                                 body=f"igemm::pool::avgpool_linear<{DTYPE_CTYPE[dtype]}, "
                                      f"{16 // DTYPE_SIZES[dtype]}, {ni}>(p);")


def _head_name(dtype: str, ni: int) -> str:
    return f"avgpool_linear_{dtype}_n{ni}"


@lru_cache(maxsize=64)
def _head_launcher(dtype: str, ni: int, device_id: int, grid: int):
    k = _kernel.load(_head_stub(dtype, ni), _head_name(dtype, ni), "igemm_avgpool_linear", device_id)
    return _kernel.Launcher(k, grid, _HEAD_THREADS)


def head_parts(device_id: int, dtype: str, N: int, C: int, HW: int, O: int) -> tuple:
    """The classifier head's (launcher, packed arguments with zero pointers), :func:`fits_head` true."""
    clusters, tmpl = _head_template(N, C, HW, O, 16 // DTYPE_SIZES[dtype])
    ni = next(n for n in _HEAD_NI if n >= N)
    return _head_launcher(dtype, ni, device_id, clusters * HEAD_CLUSTER), tmpl


def launch_avg_linear(device_id: int, stream: int, dtype: str, N: int, C: int, HW: int, O: int, x: int, w: int,
                      b: int, y: int) -> None:
    """y[n, o] = linear(mean of x[n, :, :, :] over its ``HW`` pixels, w, b) (x channels-last (N, C, H, W), w
    (O, C) row-major, b (O,) or 0, y (N, O)); x and w 16-byte aligned, :func:`fits_head` true."""
    launcher, args = head_parts(device_id, dtype, N, C, HW, O)
    launcher(stream, args.bind(dict(x=x, w=w, b=b, y=y)))


def _ks(k: tuple) -> int:
    """The forward kernel's window template argument for a ``k`` window."""
    return k[0] if k[0] == k[1] and k[0] in WINDOWS else 0


def _stub(kind: str, dtype: str, v: int, idx: bool = False, ks: int = 0, ss: int = 0) -> str:
    t = DTYPE_CTYPE[dtype]
    if kind == "avg":
        return _kernel.render_kernel(include="pool.cuh", entry="igemm_avgpool_global", params=_AVG_PARAMS,
                                     threads=_THREADS, body=f"igemm::pool::avgpool_global<{t}, {v}>(p);")
    if kind == "fwd":
        # (4 blocks an SM: 64 registers instead of 70-73; docs/performance.md: maxpool-packed-max)
        return _kernel.render_kernel(include="pool.cuh", entry="igemm_maxpool_fwd", params=_FWD_PARAMS,
                                     threads=_THREADS, min_blocks=4, body=f"igemm::pool::maxpool_fwd<{t}, {v}, "
                                                            f"{str(idx).lower()}, {ks}>(p);")
    if kind == "band":
        return _kernel.render_kernel(include="pool.cuh", entry="igemm_maxpool_band", params=_BWD_PARAMS,
                                     threads=_THREADS, body=f"igemm::pool::maxpool_bwd_band<{t}, {v}>(p);")
    return _kernel.render_kernel(include="pool.cuh", entry="igemm_maxpool_bwd", params=_BWD_PARAMS,
                                 threads=_THREADS, body=f"igemm::pool::maxpool_bwd<{t}, {v}, {ks}, {ss}>(p);")


def _name(kind: str, dtype: str, v: int, idx: bool = False, ks: int = 0, ss: int = 0) -> str:
    if kind == "avg":
        return f"avgpool_global_{dtype}_v{v}"
    if kind == "band":
        return f"maxpool_band_{dtype}_v{v}"
    if kind == "bwd":      # (ks: at most this many windows a dimension hold a pixel, 0: any; ss: the stride, 0: any)
        return f"maxpool_bwd_{dtype}_v{v}{f'_w{ks}' if ks else ''}{f'_s{ss}' if ss else ''}"
    return f"maxpool_{kind}_{dtype}_v{v}{'_idx' if idx else ''}{f'_k{ks}' if ks else ''}"


@lru_cache(maxsize=64)
def _launcher(kind: str, dtype: str, v: int, idx: bool, device_id: int, grid: int, ks: int = 0, ss: int = 0):
    entry = "igemm_avgpool_global" if kind == "avg" else f"igemm_maxpool_{kind}"
    k = _kernel.load(_stub(kind, dtype, v, idx, ks, ss), _name(kind, dtype, v, idx, ks, ss), entry, device_id)
    return _kernel.Launcher(k, grid, _THREADS)


@lru_cache(maxsize=256)
def _template(kind: str, v: int, N: int, C: int, H: int, W: int, OH: int, OW: int, k: tuple, s: tuple, p: tuple,
              d: tuple, band: int = 0) -> _kernel.PackedArgs:
    """A pass's packed arguments for one geometry, pointers zero (``bind`` fills a copy); ``band``: the band
    backward's input rows a block."""
    g = dict(C=C, KH=k[0], KW=k[1], sh=s[0], sw=s[1], ph=p[0], pw=p[1], dh=d[0], dw=d[1], fd_CV=C // v)
    if kind == "fwd":
        return _kernel.pack_args(_FWD_PARAMS, dict(g, NV=N * OH * OW * C // v, H=H, W=W, fd_OW=OW, fd_OH=OH))
    return _kernel.pack_args(_BWD_PARAMS, dict(g, NV=N * H * W * C // v, OH=OH, OW=OW, fd_W=W, fd_H=H, band=band))


def _band_rows(H: int, OH: int, KH: int, ph: int, band: int) -> int:
    """The most dy rows a band of ``band`` input rows reads (stride 2, dilation 1: csrc/pool.cuh's r0, r1)."""
    most = 0
    for h0 in range(0, H, band):
        a0, a1 = h0 + ph, min(h0 + band, H) - 1 + ph
        r0 = 0 if a0 < KH else (a0 - KH) // 2 + 1
        most = max(most, min(a1 // 2 + 1, OH) - r0)
    return most


@lru_cache(maxsize=256)
def band_rows(dtype: str, v: int, geom: tuple, sms: int) -> int:
    """Input rows a block of the band backward takes (csrc/pool.cuh: maxpool_bwd_band), 0 where it does not run:
    16-bit vectors, stride 2 and dilation 1 with at most two windows a dimension over a pixel, dy rows of a whole
    number of 16 bytes of taps; the largest even band whose dy rows and taps fit kBandSmem and whose blocks still
    fill the SMs twice (docs/performance.md: maxpool-bwd-band)."""
    N, C, H, W, OH, OW, k, s, p, d = geom
    if (dtype == "float32" or v * DTYPE_SIZES[dtype] != 16 or tuple(s) != (2, 2) or tuple(d) != (1, 1)
            or max(k) > 4 or OW * C % 16):
        return 0
    best = 0
    for band in range(2, min(H + 1, _BAND_MAX) + 1, 2):
        if (_band_rows(H, OH, k[0], p[0], band) * OW * C * (DTYPE_SIZES[dtype] + 1) > _BAND_SMEM
                or N * -(-H // band) < 2 * sms):
            break
        best = band
    return best


def _grid(nv: int, sms: int) -> int:
    return max(1, min(-(-nv // _THREADS), sms * 2048 // _THREADS))     # at most one wave of resident threads


def forward_parts(device_id: int, dtype: str, geom: tuple, v: int, idx: bool, sms: int) -> tuple:
    """The forward's (launcher, packed arguments with zero pointers) for channels of ``v`` a thread."""
    N, C, H, W, OH, OW = geom[:6]
    return (_launcher("fwd", dtype, v, idx, device_id, _grid(N * OH * OW * C // v, sms), _ks(geom[6])),
            _template("fwd", v, *geom))


def launch_forward(device_id: int, stream: int, dtype: str, geom: tuple, x: int, y: int, idx: int = 0,
                   sms: int = 132) -> None:
    """y (and, with ``idx``, the window taps) of x, channels-last; ``geom`` = (N, C, H, W, OH, OW, k, s, p, d)
    with :func:`fits` true; x, y and idx as :func:`vec` was given."""
    launcher, args = forward_parts(device_id, dtype, geom, vec(dtype, geom[1], x, y, idx), bool(idx), sms)
    launcher(stream, args.bind(dict(x=x, y=y, idx=idx)))


def launch_backward(device_id: int, stream: int, dtype: str, geom: tuple, dy: int, idx: int, dx: int,
                    sms: int = 132) -> None:
    """dx of the forward that wrote ``idx``, from dy (channels-last, the forward's output geometry)."""
    N, C, H, W = geom[:4]
    v = vec(dtype, C, dy, idx, dx)
    k, st, d = geom[6], geom[7], geom[9]
    # 16-bit: the unrolled kernel where at most two windows a dimension hold a pixel (fp32 is slower on it:
    # docs/performance.md, maxpool-bwd-unrolled)
    mw = 2 if dtype != "float32" and all(-(-((k[i] - 1) * d[i] + 1) // st[i]) <= 2 for i in (0, 1)) else 0
    # (there, stride 2 and dilation 1 as the kernel's constants: docs/performance.md, maxpool-bwd-stride-known)
    ss = 2 if mw and tuple(st) == (2, 2) and tuple(d) == (1, 1) else 0
    band = band_rows(dtype, v, tuple(geom), sms) if ss else 0
    if band:
        launcher = _launcher("band", dtype, v, False, device_id, N * -(-H // band))
    else:
        launcher = _launcher("bwd", dtype, v, False, device_id, _grid(N * H * W * C // v, sms), mw, ss)
    launcher(stream, _template("bwd", v, *geom, band).bind(dict(dy=dy, idx=idx, dx=dx)))


@lru_cache(maxsize=256)
def _avg_template(v: int, C: int, HW: int) -> _kernel.PackedArgs:
    cv = C // v
    return _kernel.pack_args(_AVG_PARAMS, dict(HW=HW, C=C, CV=cv, cblocks=-(-cv // _AVG_VECS),
                                               inv=np.float32(1.0) / np.float32(HW)))


def avg_parts(device_id: int, dtype: str, N: int, C: int, HW: int, v: int) -> tuple:
    """The global average pool's (launcher, packed arguments with zero pointers) for channels of ``v`` a thread."""
    return _launcher("avg", dtype, v, False, device_id, N * -(-(C // v) // _AVG_VECS)), _avg_template(v, C, HW)


def launch_avg_global(device_id: int, stream: int, dtype: str, N: int, C: int, HW: int, x: int, y: int) -> None:
    """y[n, c] = the mean of x[n, :, :, c] over its ``HW`` pixels (x channels-last, y (N, C)), with
    :func:`fits_avg` true."""
    launcher, args = avg_parts(device_id, dtype, N, C, HW, vec(dtype, C, x, y))
    launcher(stream, args.bind(dict(x=x, y=y)))


def all_variants(arch: str = "sm_90a") -> list[tuple[str, str]]:
    """Every (name, stub) the passes can launch on ``arch`` (the classifier head: sm_90 or later)."""
    out = []
    for dt in DTYPES:
        for v in sorted({1, 16 // DTYPE_SIZES[dt]}):
            out += [(_name("fwd", dt, v, i, ks), _stub("fwd", dt, v, i, ks)) for i in (False, True) for ks in WINDOWS]
            out += [(_name("bwd", dt, v, ks=mw, ss=ss), _stub("bwd", dt, v, ks=mw, ss=ss))
                    for mw, ss in (((0, 0), (2, 0), (2, 2)) if dt != "float32" else ((0, 0),))]
            if dt != "float32" and v > 1:
                out.append((_name("band", dt, v), _stub("band", dt, v)))
            out.append((_name("avg", dt, v), _stub("avg", dt, v)))
        if int(arch[3:].rstrip("af")) >= 90 and dt in HEAD_DTYPES:
            out += [(_head_name(dt, ni), _head_stub(dt, ni)) for ni in _HEAD_NI]
    return out


def precompile(arch: str, jobs: int | None = None) -> int:
    """Compile every pooling kernel for ``arch`` (dev machine: fills the kernel cache)."""
    from . import _build
    return _build.compile_many(all_variants(arch), arch, jobs)
