"""The convolution algorithms that :mod:`igemm.baselines.compare` measures, on the GPU and in numpy.

GPU (torch CUDA tensors; each algorithm a class: the constructor validates and plans, ``setup(x, w)``
binds the inputs and allocates what the algorithm keeps, ``alg()`` runs one convolution on torch's
current stream and returns ``y`` as a new tensor, ``close()`` frees library resources):

========== =======================================================================================
implicit   igemm's implicit GEMM (:class:`igemm.Conv2dPlan`)
im2col     igemm's im2col kernel (``csrc/baselines/im2col.cuh``) materialises the GEMM operand, then one
           cuBLAS(Lt) GEMM through nvmath-python. NHWC: ``y[NPQ, K] = cols[NPQ, RSC] @ w[K, RSC]^T``;
           NCHW: a batched GEMM ``y[n][K, PQ] = w[K, CRS] @ cols[n][CRS, PQ]`` (w broadcast over the
           batch). Both land directly in the output layout: no permute copy.
fft        cuFFT through nvmath-python, in float32 whatever the input dtype: pad to a 2·3·5·7-smooth
           size, R2C of input and (dilated, every call) filter, pointwise multiply-accumulate over C as a
           complex64 batched matmul over frequencies (torch.bmm), C2R, crop; a stride subsamples the
           full stride-1 result.
direct     ``csrc/baselines/direct_conv.cuh``: one output per thread, fp32 accumulation
cudnn      ``torch.nn.functional.conv2d`` (cuDNN)
========== =======================================================================================

numpy (no GPU): ``NUMPY[name](x, w, problem)`` for implicit (igemm's numpy backend), im2col, fft and
direct; the im2col and FFT versions follow the GPU versions' matrix layouts step by step.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .. import _kernel, _runtime, reference
from .._kernel import ParamSpec
from .._runtime import DTYPE_CTYPE, DTYPE_SIZES
from ..fastdiv import MAX_DIVIDEND
from ..reference.conv import conv_flops, out_size, pair

__all__ = ["ALGORITHMS", "LABELS", "NUMPY_LABELS", "Problem", "Unavailable", "make_gpu", "NUMPY", "good_fft_size",
           "fft_geometry", "im2col_launch_values", "direct_launch_values", "IM2COL_PARAMS", "DIRECT_PARAMS"]

ALGORITHMS = ("implicit", "im2col", "fft", "direct", "cudnn")
LABELS = {"implicit": "implicit GEMM (igemm)", "im2col": "im2col + GEMM (cuBLAS)", "fft": "FFT (cuFFT)",
          "direct": "direct", "cudnn": "cuDNN (torch)"}
NUMPY_LABELS = {"implicit": "implicit GEMM (igemm numpy backend)", "im2col": "im2col + GEMM (numpy)",
                "fft": "FFT (numpy.fft)", "direct": "direct (numpy)", "cudnn": "cuDNN (torch)"}
_THREADS = 256


class Unavailable(Exception):
    """The algorithm cannot run this case here (missing package, size limit, memory cap): a skip."""


@dataclass(frozen=True)
class Problem:
    """One convolution: sizes, stride/padding/dilation pairs, dtype, layout, fp32 precision."""
    N: int
    C: int
    H: int
    W: int
    K: int
    R: int
    S: int
    stride: tuple = (1, 1)
    padding: tuple = (0, 0)
    dilation: tuple = (1, 1)
    dtype: str = "float16"
    layout: str = "NHWC"
    precision: str = "strict"

    def __post_init__(self):
        for f in ("stride", "padding", "dilation"):
            object.__setattr__(self, f, pair(getattr(self, f), f))
        if self.layout not in ("NCHW", "NHWC"):
            raise ValueError(f"layout: expected 'NCHW' or 'NHWC', got {self.layout!r}")
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise TypeError(f"dtype: expected float16, bfloat16 or float32, got {self.dtype!r}")
        if self.precision not in ("strict", "tf32"):
            raise ValueError(f"precision: expected 'strict' or 'tf32', got {self.precision!r}")
        if min(self.P, self.Q) < 1:
            raise ValueError(f"empty output for {self}")

    @property
    def P(self) -> int:
        return out_size(self.H, self.W, self.R, self.S, self.stride, self.padding, self.dilation)[0]

    @property
    def Q(self) -> int:
        return out_size(self.H, self.W, self.R, self.S, self.stride, self.padding, self.dilation)[1]

    @property
    def x_shape(self) -> tuple:
        return (self.N, self.C, self.H, self.W) if self.layout == "NCHW" else (self.N, self.H, self.W, self.C)

    @property
    def w_shape(self) -> tuple:
        return (self.K, self.C, self.R, self.S) if self.layout == "NCHW" else (self.K, self.R, self.S, self.C)

    @property
    def y_shape(self) -> tuple:
        return (self.N, self.K, self.P, self.Q) if self.layout == "NCHW" else (self.N, self.P, self.Q, self.K)

    @property
    def flops(self) -> int:
        return conv_flops(self.N, self.C, self.K, self.R, self.S, self.P, self.Q)

    @property
    def esize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    def io_bytes(self) -> int:
        return (self.N * self.C * self.H * self.W + self.K * self.C * self.R * self.S
                + self.N * self.K * self.P * self.Q) * self.esize


# ============================================================================ kernels: im2col, direct
#: im2col launch parameters (csrc/baselines/im2col.cuh), in order: the one definition.
IM2COL_PARAMS = [
    ParamSpec("x", "ptr"), ParamSpec("cols", "ptr"),
    *(ParamSpec(n, "int32") for n in ("N", "H", "W", "C", "R", "S", "P", "Q", "sh", "sw", "ph", "pw", "dh", "dw",
                                      "rows", "row_len", "rows_per_iter")),
    *(ParamSpec(n, "fastdiv") for n in ("fd_L", "fd_PQ", "fd_Q", "fd_C", "fd_S", "fd_RS", "fd_Kd")),
]
#: direct-convolution launch parameters (csrc/baselines/direct_conv.cuh), in order.
DIRECT_PARAMS = [
    ParamSpec("x", "ptr"), ParamSpec("w", "ptr"), ParamSpec("y", "ptr"),
    *(ParamSpec(n, "int32") for n in ("N", "H", "W", "C", "K", "R", "S", "P", "Q", "sh", "sw", "ph", "pw", "dh",
                                      "dw", "total")),
    *(ParamSpec(n, "fastdiv") for n in ("fd_K", "fd_P", "fd_Q")),
]


def _geometry_values(pb: Problem) -> dict:
    (sh, sw), (ph, pw), (dh, dw) = pb.stride, pb.padding, pb.dilation
    return dict(N=pb.N, H=pb.H, W=pb.W, C=pb.C, R=pb.R, S=pb.S, P=pb.P, Q=pb.Q, sh=sh, sw=sw, ph=ph, pw=pw,
                dh=dh, dw=dw)


def im2col_vec(pb: Problem, *ptrs: int) -> int:
    """Channels per thread of the NHWC im2col (16 bytes when C and the pointers allow it); 1 for NCHW."""
    if pb.layout == "NCHW":
        return 1
    v = 16 // pb.esize
    while v > 1 and (pb.C % v or any(p % (v * pb.esize) for p in ptrs)):
        v //= 2
    return v


def im2col_cols_shape(pb: Problem) -> tuple:
    """Shape of the materialised matrix: NHWC ``(N·P·Q, R·S·C)``, NCHW ``(N, C·R·S, P·Q)``."""
    Kd = pb.C * pb.R * pb.S
    if pb.layout == "NHWC":
        return (pb.N * pb.P * pb.Q, Kd)
    return (pb.N, Kd, pb.P * pb.Q)


def im2col_launch_values(pb: Problem, vec: int) -> dict:
    """Every scalar launch argument of the im2col kernel (the plan-time checks raise Unavailable)."""
    Kd, PQ = pb.C * pb.R * pb.S, pb.P * pb.Q
    if pb.layout == "NHWC":
        rows, row_len = pb.N * PQ, Kd // vec
    else:
        rows, row_len = pb.N * Kd, PQ
    if rows >= MAX_DIVIDEND or pb.N * PQ >= MAX_DIVIDEND or Kd >= MAX_DIVIDEND or row_len >= 1 << 30:
        raise Unavailable(f"im2col: {rows} rows of {row_len}: the kernel's index math needs < 2**31")
    rows_per_iter = max(1, min(-(-2048 // row_len), (1 << 30) // row_len))
    v = _geometry_values(pb)
    v.update(rows=rows, row_len=row_len, rows_per_iter=rows_per_iter, fd_L=row_len, fd_PQ=PQ, fd_Q=pb.Q,
             fd_C=pb.C, fd_S=pb.S, fd_RS=pb.R * pb.S, fd_Kd=Kd)
    return v


def direct_launch_values(pb: Problem) -> dict:
    total = pb.N * pb.K * pb.P * pb.Q
    if total >= MAX_DIVIDEND:
        raise Unavailable(f"direct: {total} outputs: the kernel's index math needs < 2**31")
    v = _geometry_values(pb)
    v.update(K=pb.K, total=total, fd_K=pb.K, fd_P=pb.P, fd_Q=pb.Q)
    return v


@lru_cache(maxsize=None)
def im2col_stub(dtype: str, layout: str, vec: int) -> str:
    t = DTYPE_CTYPE[dtype]
    body = (f"igemm::im2col::im2col_nhwc<{t}, {vec}>(p);" if layout == "NHWC"
            else f"igemm::im2col::im2col_nchw<{t}>(p);")
    return _kernel.render_kernel(include="baselines/im2col.cuh", entry="igemm_im2col", params=IM2COL_PARAMS,
                                 threads=_THREADS, body=body)


def im2col_name(dtype: str, layout: str, vec: int) -> str:
    return f"im2col_{dtype}_{layout}_v{vec}"


@lru_cache(maxsize=None)
def direct_stub(dtype: str, layout: str) -> str:
    return _kernel.render_kernel(include="baselines/direct_conv.cuh", entry="igemm_direct_conv", params=DIRECT_PARAMS,
                                 threads=_THREADS,
                                 body=f"igemm::direct::conv<{DTYPE_CTYPE[dtype]}, "
                                      f"{'true' if layout == 'NHWC' else 'false'}>(p);")


def direct_name(dtype: str, layout: str) -> str:
    return f"direct_conv_{dtype}_{layout}"


def _sms(device_id: int) -> int:
    return _runtime.device_props(device_id).multiprocessor_count


def _torch_stream(device_id: int) -> int:
    return _runtime.stream_handle(None, "torch", device_id)


# ============================================================================ FFT geometry
def good_fft_size(n: int) -> int:
    """The smallest m >= n whose prime factors are all 2, 3, 5 or 7 (fast cuFFT sizes)."""
    m = max(1, int(n))
    while True:
        r = m
        for f in (2, 3, 5, 7):
            while r % f == 0:
                r //= f
        if r == 1:
            return m
        m += 1


def fft_geometry(pb: Problem) -> dict:
    """Transform sizes: the padded input ``Hp x Wp`` rounded up to fast sizes ``Hf x Wf``; ``Wh = Wf//2+1``
    complex columns; ``L = Hf·Wh`` frequencies; ``Rd x Sd`` the dilated filter."""
    (ph, pw), (dh, dw) = pb.padding, pb.dilation
    Hp, Wp = pb.H + 2 * ph, pb.W + 2 * pw
    Hf, Wf = good_fft_size(Hp), good_fft_size(Wp)
    Wh = Wf // 2 + 1
    return dict(Hp=Hp, Wp=Wp, Hf=Hf, Wf=Wf, Wh=Wh, L=Hf * Wh, Rd=dh * (pb.R - 1) + 1, Sd=dw * (pb.S - 1) + 1)


def fft_bytes(pb: Problem) -> int:
    """Rough bytes the GPU FFT path holds at its peak (to skip cases above ``--mem-cap`` before trying)."""
    g = fft_geometry(pb)
    real = 4 * g["Hf"] * g["Wf"] * (pb.N * pb.C + pb.K * pb.C + pb.N * pb.K)
    cplx = 8 * g["L"] * (2 * pb.N * pb.C + 2 * pb.K * pb.C + 2 * pb.N * pb.K)
    return int(1.25 * (real + cplx))


# ============================================================================ GPU algorithms
def _nvmath():
    try:
        import nvmath  # noqa: F401
        from nvmath import fft  # noqa: F401
        from nvmath.linalg import advanced  # noqa: F401
    except ImportError as e:
        raise Unavailable("nvmath-python not installed") from e
    except Exception as e:  # a broken install (libraries, bindings): report, do not crash the comparison
        raise Unavailable(f"nvmath-python unusable: {type(e).__name__}: {e}") from e
    return nvmath


def _torch():
    try:
        import torch
    except ImportError as e:
        raise Unavailable("torch not installed") from e
    return torch


class _GpuAlgorithm:
    name = ""
    note = ""          # set by a call that had to do something worth reporting

    def __init__(self, pb: Problem, device_id: int = 0):
        self.pb = pb
        self.device_id = device_id
        self.torch = _torch()

    def estimate_bytes(self) -> int:
        """Extra device bytes expected (only to skip cases above the memory cap; the report measures)."""
        return 0

    @property
    def outside_bytes(self) -> int:
        """Device bytes this algorithm holds outside torch's allocator (reported with the measured ones)."""
        return 0

    def setup(self, x, w) -> None:
        self.x, self.w = x, w

    def close(self) -> None:
        pass

    def _check_inputs(self, x, w) -> None:
        pb, t = self.pb, self.torch
        tdt = getattr(t, pb.dtype)
        for name, a, shape in (("x", x, pb.x_shape), ("w", w, pb.w_shape)):
            if tuple(a.shape) != shape or a.dtype != tdt or not a.is_cuda or not a.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous {pb.dtype} CUDA tensor of shape {shape} "
                                 f"({pb.layout}), got {a.dtype} {tuple(a.shape)}")

    def _empty_y(self):
        t = self.torch
        return t.empty(self.pb.y_shape, dtype=getattr(t, self.pb.dtype), device=self.x.device)


class ImplicitGemm(_GpuAlgorithm):
    name = "implicit"

    def __init__(self, pb, device_id=0):
        super().__init__(pb, device_id)
        from ..conv import Conv2dPlan
        self.plan = Conv2dPlan(pb.x_shape, pb.w_shape, pb.dtype, pb.layout, pb.stride, pb.padding, pb.dilation,
                               precision=pb.precision, device=device_id)

    @property
    def outside_bytes(self) -> int:
        """The split-K workspace (fp32 partial tiles + per-tile tickets) Conv2dPlan allocates outside torch."""
        n = 0
        for rec in {id(r): r for r in self.plan._records.values()}.values():   # (ws, counters, kt_per_split)
            if rec.workspace is not None:
                n += int(rec.workspace[0].nbytes) + int(rec.workspace[1].nbytes)
        return n

    def setup(self, x, w):
        self._check_inputs(x, w)
        super().setup(x, w)

    def __call__(self):
        return self.plan(self.x, self.w)


class Im2colGemm(_GpuAlgorithm):
    name = "im2col"

    def __init__(self, pb, device_id=0):
        super().__init__(pb, device_id)
        self.nvmath = _nvmath()
        im2col_launch_values(pb, 1)          # size checks
        self.mm = None

    def estimate_bytes(self) -> int:
        n = 1
        for s in im2col_cols_shape(self.pb):
            n *= s
        return n * self.pb.esize

    def setup(self, x, w):
        self._check_inputs(x, w)
        super().setup(x, w)
        t, pb = self.torch, self.pb
        self.cols = t.empty(im2col_cols_shape(pb), dtype=x.dtype, device=x.device)
        vec = im2col_vec(pb, x.data_ptr(), self.cols.data_ptr())
        vals = im2col_launch_values(pb, vec)
        vals.update(x=x.data_ptr(), cols=self.cols.data_ptr())
        groups = -(-vals["rows"] // vals["rows_per_iter"])
        grid = max(1, min(groups, _sms(self.device_id) * 16))
        k = _kernel.load(im2col_stub(pb.dtype, pb.layout, vec), im2col_name(pb.dtype, pb.layout, vec),
                         "igemm_im2col", self.device_id)
        self.launcher = _kernel.Launcher(k, grid, _THREADS)
        self.args = _kernel.pack_args(IM2COL_PARAMS, vals)
        Kd = pb.C * pb.R * pb.S
        w2 = w.view(pb.K, Kd)                   # KCRS -> [K, C·R·S];  KRSC -> [K, R·S·C]
        if pb.layout == "NHWC":
            a, b = self.cols, w2.t()            # [NPQ, Kd] @ [Kd, K] -> [NPQ, K] = y (NHWC)
        else:
            a, b = w2, self.cols                # [K, Kd] @ [N, Kd, PQ] -> [N, K, PQ] = y (NCHW)
        options = None
        if pb.dtype == "float32" and pb.precision == "tf32":
            options = {"compute_type": self.nvmath.linalg.ComputeType.COMPUTE_32F_FAST_TF32}
        self.mm = self.nvmath.linalg.advanced.Matmul(a, b, options=options)
        self.mm.plan()

    def __call__(self):
        self.launcher(_torch_stream(self.device_id), self.args)
        r = self.mm.execute()
        if not r.is_contiguous():               # only for degenerate shapes (C·R·S = 1): a's order is then COL
            self.note = "GEMM result came back column-major: one copy to the output layout (timed)"
            r = r.contiguous()
        return r.view(self.pb.y_shape)

    def close(self):
        if self.mm is not None:
            self.mm.free()
            self.mm = None


class FftConv(_GpuAlgorithm):
    name = "fft"

    def __init__(self, pb, device_id=0):
        super().__init__(pb, device_id)
        self.nvmath = _nvmath()
        self.g = fft_geometry(pb)
        self.plans = []

    def estimate_bytes(self) -> int:
        return fft_bytes(self.pb)

    def setup(self, x, w):
        self._check_inputs(x, w)
        super().setup(x, w)
        t, pb, g = self.torch, self.pb, self.g
        N, C, K, H, W = pb.N, pb.C, pb.K, pb.H, pb.W
        (ph, pw), (dh, dw) = pb.padding, pb.dilation
        Hf, Wf, Wh = g["Hf"], g["Wf"], g["Wh"]
        dev = x.device
        self.xp = t.zeros((N, C, Hf, Wf), dtype=t.float32, device=dev)
        self.wp = t.zeros((K, C, Hf, Wf), dtype=t.float32, device=dev)
        self.x_in = self.xp[:, :, ph:ph + H, pw:pw + W]                       # interior; borders stay 0
        self.w_in = self.wp[:, :, 0:g["Rd"]:dh, 0:g["Sd"]:dw]                 # dilated taps; the rest stays 0
        self.x_src = x if pb.layout == "NCHW" else x.permute(0, 3, 1, 2)
        self.w_src = w if pb.layout == "NCHW" else w.permute(0, 3, 1, 2)
        fft = self.nvmath.fft
        r2c = {"fft_type": "R2C", "result_layout": "natural"}
        self.fx = fft.FFT(self.xp, axes=[2, 3], options=r2c)
        self.plans.append(self.fx)
        self.fx.plan()
        self.fw = fft.FFT(self.wp, axes=[2, 3], options=r2c)
        self.plans.append(self.fw)
        self.fw.plan()
        proto = t.zeros((N, K, Hf, Wh), dtype=t.complex64, device=dev)
        # C2R: nvmath copies its operand into a buffer of its own (cuFFT overwrites C2R input); each call
        # hands it the pointwise product through reset_operand_unchecked (that copy does the permute).
        self.fy = fft.FFT(proto, axes=[2, 3], options={"fft_type": "C2R", "result_layout": "natural",
                                                       "last_axis_parity": "even" if Wf % 2 == 0 else "odd"})
        self.plans.append(self.fy)
        self.fy.plan()
        del proto
        self.scale = 1.0 / (Hf * Wf)            # cuFFT transforms are unnormalised

    def __call__(self):
        t, pb, g = self.torch, self.pb, self.g
        N, C, K = pb.N, pb.C, pb.K
        Hf, Wh, L = g["Hf"], g["Wh"], g["L"]
        (sh, sw) = pb.stride
        dev = self.xp.device
        self.x_in.copy_(self.x_src)                                          # pad (and cast to fp32)
        self.w_in.copy_(self.w_src)                                          # dilate
        self.w_in.mul_(self.scale)
        X = self.fx.execute()                                                # [N, C, Hf, Wh]
        Xb = t.empty((L, N, C), dtype=t.complex64, device=dev)
        Xb.view(Hf, Wh, N, C).copy_(X.permute(2, 3, 0, 1))
        del X
        Fw = self.fw.execute()                                               # [K, C, Hf, Wh]
        Fb = t.empty((L, C, K), dtype=t.complex64, device=dev)
        t.conj_physical(Fw.permute(2, 3, 1, 0), out=Fb.view(Hf, Wh, C, K))   # correlation: X * conj(F)
        del Fw
        Yb = t.bmm(Xb, Fb)                                                   # [L, N, K]: sum over C
        del Xb, Fb
        self.fy.reset_operand_unchecked(Yb.view(Hf, Wh, N, K).permute(2, 3, 0, 1))
        del Yb
        full = self.fy.execute()                                             # [N, K, Hf, Wf] float32
        crop = full[:, :, 0:sh * (pb.P - 1) + 1:sh, 0:sw * (pb.Q - 1) + 1:sw]
        y = self._empty_y()
        (y if pb.layout == "NCHW" else y.permute(0, 3, 1, 2)).copy_(crop)
        return y

    def close(self):
        for p in self.plans:
            try:
                p.free()
            except Exception:
                pass
        self.plans = []


class DirectConv(_GpuAlgorithm):
    name = "direct"

    def __init__(self, pb, device_id=0):
        super().__init__(pb, device_id)
        self.vals = direct_launch_values(pb)
        grid = max(1, min(-(-self.vals["total"] // _THREADS), _sms(device_id) * 32))
        k = _kernel.load(direct_stub(pb.dtype, pb.layout), direct_name(pb.dtype, pb.layout), "igemm_direct_conv",
                         device_id)
        self.launcher = _kernel.Launcher(k, grid, _THREADS)

    def setup(self, x, w):
        self._check_inputs(x, w)
        super().setup(x, w)
        vals = dict(self.vals, x=x.data_ptr(), w=w.data_ptr())
        self.args = _kernel.pack_args(DIRECT_PARAMS, vals)
        self.slot_y = self.args.slots["y"]

    def __call__(self):
        y = self._empty_y()
        self.args.u64[self.slot_y] = y.data_ptr()
        self.launcher(_torch_stream(self.device_id), self.args)
        return y


class CudnnConv(_GpuAlgorithm):
    """torch.nn.functional.conv2d. For NHWC the tensors go in as channels_last NCHW views (no copies);
    the caller sets ``torch.backends.cudnn`` flags (benchmark, allow_tf32)."""
    name = "cudnn"

    def setup(self, x, w):
        self._check_inputs(x, w)
        super().setup(x, w)
        nhwc = self.pb.layout == "NHWC"
        self.xt = x.permute(0, 3, 1, 2) if nhwc else x
        self.wt = w.permute(0, 3, 1, 2) if nhwc else w
        self()                                  # cudnn.benchmark picks its algorithm here, before measuring

    def __call__(self):
        pb = self.pb
        y = self.torch.nn.functional.conv2d(self.xt, self.wt, None, pb.stride, pb.padding, pb.dilation)
        return y.permute(0, 2, 3, 1) if pb.layout == "NHWC" else y


_GPU = {"implicit": ImplicitGemm, "im2col": Im2colGemm, "fft": FftConv, "direct": DirectConv, "cudnn": CudnnConv}


def make_gpu(name: str, pb: Problem, device_id: int = 0) -> _GpuAlgorithm:
    """The GPU algorithm ``name`` planned for ``pb`` (raises :class:`Unavailable` when it cannot run here)."""
    if name not in _GPU:
        raise ValueError(f"algorithm: expected one of {ALGORITHMS}, got {name!r}")
    return _GPU[name](pb, device_id)


# ============================================================================ numpy algorithms
def _nchw(x, w, layout):
    if layout == "NHWC":
        return x.transpose(0, 3, 1, 2), w.transpose(0, 3, 1, 2)
    return x, w


def im2col_cols_numpy(x, pb: Problem) -> np.ndarray:
    """The matrix the GPU im2col kernel writes, in its layout (float64)."""
    xn = x.transpose(0, 3, 1, 2) if pb.layout == "NHWC" else x
    ref = reference.im2col(xn, pb.R, pb.S, pb.stride, pb.padding, pb.dilation)     # [NPQ, (c, r, s)]
    NPQ, PQ = pb.N * pb.P * pb.Q, pb.P * pb.Q
    if pb.layout == "NHWC":
        return ref.reshape(NPQ, pb.C, pb.R, pb.S).transpose(0, 2, 3, 1).reshape(NPQ, pb.R * pb.S * pb.C)
    return np.ascontiguousarray(ref.reshape(pb.N, PQ, pb.C * pb.R * pb.S).transpose(0, 2, 1))


def im2col_gemm_numpy(x, w, pb: Problem) -> np.ndarray:
    """Explicit im2col + one GEMM with the GPU version's matrix layouts (float64)."""
    cols = im2col_cols_numpy(x, pb)
    w2 = np.asarray(w, dtype=np.float64).reshape(pb.K, -1)
    if pb.layout == "NHWC":
        return (cols @ w2.T).reshape(pb.y_shape)
    return (w2 @ cols).reshape(pb.y_shape)             # [K, Kd] @ [N, Kd, PQ] -> [N, K, PQ]


def _cmatmul(a, b):
    """Complex batched matmul as four real ones (numpy's complex GEMM can be far slower than its real one)."""
    ar, ai, br, bi = (np.ascontiguousarray(v) for v in (a.real, a.imag, b.real, b.imag))
    return (ar @ br - ai @ bi) + 1j * (ar @ bi + ai @ br)


def fft_conv_numpy(x, w, pb: Problem) -> np.ndarray:
    """The GPU FFT algorithm's steps in numpy (float64/complex128, numpy's FFT scaled like cuFFT's)."""
    g = fft_geometry(pb)
    N, C, K, H, W = pb.N, pb.C, pb.K, pb.H, pb.W
    (sh, sw), (ph, pw), (dh, dw) = pb.stride, pb.padding, pb.dilation
    Hf, Wf, Wh, L = g["Hf"], g["Wf"], g["Wh"], g["L"]
    xs, ws = _nchw(np.asarray(x, dtype=np.float64), np.asarray(w, dtype=np.float64), pb.layout)
    xp = np.zeros((N, C, Hf, Wf))
    xp[:, :, ph:ph + H, pw:pw + W] = xs
    wp = np.zeros((K, C, Hf, Wf))
    wp[:, :, 0:g["Rd"]:dh, 0:g["Sd"]:dw] = ws
    wp[:, :, 0:g["Rd"]:dh, 0:g["Sd"]:dw] *= 1.0 / (Hf * Wf)
    X = np.fft.rfft2(xp)                                        # [N, C, Hf, Wh] (unnormalised, as cuFFT)
    Xb = np.empty((L, N, C), dtype=np.complex128)
    Xb.reshape(Hf, Wh, N, C)[...] = X.transpose(2, 3, 0, 1)
    del X
    F = np.fft.rfft2(wp)                                        # [K, C, Hf, Wh]
    Fb = np.empty((L, C, K), dtype=np.complex128)
    Fb.reshape(Hf, Wh, C, K)[...] = np.conj(F.transpose(2, 3, 1, 0))
    del F
    Yb = _cmatmul(Xb, Fb)                                       # [L, N, K]
    Y = Yb.reshape(Hf, Wh, N, K).transpose(2, 3, 0, 1)          # [N, K, Hf, Wh]
    full = np.fft.irfft2(Y, s=(Hf, Wf)) * (Hf * Wf)             # cuFFT's C2R does not divide by Hf*Wf
    crop = full[:, :, 0:sh * (pb.P - 1) + 1:sh, 0:sw * (pb.Q - 1) + 1:sw]
    return np.ascontiguousarray(crop.transpose(0, 2, 3, 1) if pb.layout == "NHWC" else crop)


def _numpy_implicit(x, w, pb):
    from ..conv import conv2d
    return conv2d(x, w, pb.stride, pb.padding, pb.dilation, layout=pb.layout)


def _cast(fn):
    def run(x, w, pb):
        return fn(x, w, pb).astype(x.dtype)
    run.__name__ = fn.__name__
    return run


#: numpy implementations (the numpy backend of ``python -m igemm compare``): ``NUMPY[name](x, w, pb)``.
NUMPY = {
    "implicit": _numpy_implicit,
    "im2col": _cast(im2col_gemm_numpy),
    "fft": _cast(fft_conv_numpy),
    "direct": _cast(lambda x, w, pb: reference.conv2d_direct(x, w, pb.stride, pb.padding, pb.dilation, pb.layout)),
}
