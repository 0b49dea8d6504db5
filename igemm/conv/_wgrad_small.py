"""wgrad for few input channels (csrc/conv/wgrad_small.cuh): C < 64 and R·S·C <= 256, 16-bit NHWC, sm_80 and later.

A network's first convolution (ResNet's 7x7 / 2 over 3 channels) is where this runs: the native wgrad copies 64
channels of one tap a TMA box (C % 64 == 0), and the turned convolution moves dy (51 MB at N = 32) twice for a
reduction of 147 columns. This kernel reads dy and x where they lie: dy's pixel rows by cp.async, and x's input rows
either whole by cp.async (the rows form: W·C % 8 == 0, the next output row loading while one multiplies) or
gathered element by element, and multiplies them with mma.sync; each CTA's fp32 partial
dw goes to the split sum of :mod:`._native` (the grid is the split: deterministic).
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import _kernel, _runtime
from .._kernel import ParamSpec
from .._runtime import DTYPE_CTYPE, DTYPE_SIZES
from ._native import _SM_SMEM, _SUM_PARAMS, _SplitSum, sum_grid

__all__ = ["SMALL_PARAMS", "SmallWgradSpec", "unsupported", "choose_spec", "SmallWgrad", "all_variants"]

#: the kernel's launch parameters, in order: partials, x, dy, the problem, the patch width WB and the units
SMALL_PARAMS = [ParamSpec("y", "ptr"), ParamSpec("x", "ptr"), ParamSpec("dy", "ptr"),
                *(ParamSpec(n, "int32") for n in ("K", "H", "W", "C", "Q", "rsc", "R", "S", "sh", "sw", "ph", "pw",
                                                  "dh", "dw", "WB", "ROWP", "LEFT", "xs_bytes", "units")),
                *(ParamSpec(n, "fastdiv") for n in ("fd_QC", "fd_P", "fd_WB", "fd_WC8"))]
QB = 64                 # output pixels a unit (kSmallQB)
THREADS = 128           # kSmallThreads
MAX_RSC = 4 * 8 * 8     # columns: 4 warps x at most 8 blocks of 8
MAX_SMEM = 48 * 1024


def _patch(g) -> int:
    """WB: the input columns a gather unit's 64 output pixels reach."""
    return (QB - 1) * g.stride[1] + (g.S - 1) * g.dilation[1] + 1


def rows_form(g) -> bool:
    """Whether the rows form runs ``g``: input rows of whole 16-byte chunks, an output row's dy within 32 KB and
    two buffers within 100 KB (two CTAs an SM)."""
    return g.W * g.C % 8 == 0 and g.Q <= 256 and smem_bytes(g, True) <= 100 * 1024


def _rows_geometry(g) -> tuple[int, int]:
    """(LEFT, ROWP): where a shared input row starts (the left padding's elements before it, 16-byte rounded) and
    its length, with the zero margins the last 16-pixel step reaches."""
    qpad = -(-g.Q // 16) * 16
    left = -(-g.padding[1] * g.C // 8) * 8
    reach = max(g.W, (qpad - 1) * g.stride[1] + (g.S - 1) * g.dilation[1] - g.padding[1] + 1) * g.C
    return left, -(-(left + reach) // 8) * 8


def _xs_bytes(g, rows: bool) -> int:
    """A unit's patch in shared memory: R rows of ROWP elements, or the gather's [R][C][WB] 16-byte rounded."""
    if rows:
        return g.R * _rows_geometry(g)[1] * 2
    return -(-g.R * g.C * _patch(g) * 2 // 16) * 16


def smem_bytes(g, rows: bool) -> int:
    """rows: two buffers of an output row's dy (64 channels) and a patch; gather: one of 64 pixels' and a patch."""
    if rows:
        return 2 * (-(-g.Q // 16) * 16 * 128 + _xs_bytes(g, True))
    return QB * 128 + _xs_bytes(g, False)


@dataclass(frozen=True)
class SmallWgradSpec:
    """``igemm::grad::wgrad_small<T, NT, Rows>``: NT column blocks of 8 a warp (4 warps: 32·NT columns of R·S·C),
    the rows form or the gather form."""
    dtype: str
    nt: int
    rows: bool = True

    @property
    def ctas(self) -> int:
        """CTAs an SM the grid holds (the launch bounds): 3, or 2 where 3 would spill the accumulators (NT >= 7)."""
        return 3 if self.nt <= 6 else 2

    def name(self) -> str:
        return f"wgrad_small_{self.dtype}_n{self.nt}{'_rows' if self.rows else ''}"

    def stub(self) -> str:
        return _kernel.render_kernel(include="conv/wgrad_small.cuh", entry="igemm_wgrad_small", params=SMALL_PARAMS,
                                     threads=THREADS, min_blocks=self.ctas,
                                     body=f"igemm::grad::wgrad_small<{DTYPE_CTYPE[self.dtype]}, {self.nt}, "
                                          f"{str(self.rows).lower()}>(p);")

    def kernel(self, x_aligned: bool = True, w_aligned: bool = True) -> tuple[str, str]:
        return self.name(), self.stub()


def unsupported(g, dtype: str, layout: str) -> str | None:
    """Why this kernel cannot compute ``g`` (a ``GradWeightProblem``), None where it can."""
    if layout != "NHWC" or DTYPE_SIZES[dtype] != 2:
        return "the few-channel wgrad kernel reads 16-bit NHWC tensors"
    rsc = g.R * g.S * g.C
    needs = ((g.C >= 64, "C < 64 (more channels: the native kernel's TMA boxes)"),
             (rsc > MAX_RSC, f"R·S·C <= {MAX_RSC}"),
             (g.K % 8, "K % 8 == 0 (dy's rows 16-byte aligned)"),
             (not rows_form(g) and smem_bytes(g, False) > MAX_SMEM,
              f"an input patch within {MAX_SMEM // 1024} KB of shared memory"),
             (g.N * g.P * g.Q == 0 or max(g.N * g.H * g.W * g.C, g.N * g.P * g.Q * g.K, g.K * rsc) >= 2 ** 31,
              "a non-empty reduction and tensors under 2^31 elements"))
    return next((f"the few-channel wgrad kernel needs {what}" for failed, what in needs if failed), None)


def choose_spec(g, dtype: str) -> SmallWgradSpec:
    """The fewest column blocks a warp that cover R·S·C; the rows form where it runs."""
    blocks = -(-g.R * g.S * g.C // 8)
    return SmallWgradSpec(dtype, -(-blocks // 4), rows_form(g))


class SmallWgrad:
    """The kernel and the split sum for one problem, :class:`._native.NativeWgrad`'s interface: :meth:`launch` on
    raw pointers (dy 16-byte aligned)."""

    def __init__(self, g, dtype: str, out_dtype: str, accumulate: bool, device_id: int | None, sms: int,
                 spec: SmallWgradSpec | None = None):
        self.g, self.dtype, self.out_dtype, self.accumulate = g, dtype, out_dtype, accumulate
        self.device_id, self.sms = device_id, sms
        self.spec = spec or choose_spec(g, dtype)
        self.rsc = g.R * g.S * g.C
        self.numel = g.K * self.rsc
        self.units = g.N * g.P * (1 if self.spec.rows else -(-g.Q // QB))
        self.smem = smem_bytes(g, self.spec.rows)
        #: the split: one partial a CTA, as many CTAs as stay resident (at most one a unit)
        ctas = min(self.spec.ctas, _SM_SMEM // (self.smem + 1024))
        self.splits = min(self.units, ctas * sms)
        self._sum = _SplitSum(out_dtype, accumulate)
        self._k = None

    def kernels(self) -> list:
        return [self.spec, self._sum]

    def _build(self) -> None:
        g, dev = self.g, self.device_id
        wb, rows = _patch(g), self.spec.rows
        left, rowp = _rows_geometry(g)
        values = dict(K=g.K, H=g.H, W=g.W, C=g.C, Q=g.Q, rsc=self.rsc, R=g.R, S=g.S, sh=g.stride[0], sw=g.stride[1],
                      ph=g.padding[0], pw=g.padding[1], dh=g.dilation[0], dw=g.dilation[1], WB=wb, ROWP=rowp,
                      LEFT=left, xs_bytes=_xs_bytes(g, rows), units=self.units, fd_QC=-(-g.Q // QB), fd_P=g.P,
                      fd_WB=wb, fd_WC8=max(1, g.W * g.C // 8))
        smem = self.smem
        k = _kernel.load(self.spec.stub(), self.spec.name(), "igemm_wgrad_small", dev, smem=smem)
        self._ws = _runtime.DeviceArray((self.splits * self.numel,), "float32", dev)
        args = _kernel.pack_args(SMALL_PARAMS, dict(values, y=self._ws.ptr))
        launch = _kernel.Launcher(k, (self.splits, -(-g.K // 64)), THREADS, smem)
        name, src = self._sum.kernel()
        ks = _kernel.load(src, name, "igemm_split_sum", dev)
        sargs = _kernel.pack_args(_SUM_PARAMS, dict(src=self._ws.ptr, n=self.numel, splits=self.splits))
        self._k = (launch, args, _kernel.Launcher(ks, *sum_grid(self.numel, self.sms)), sargs)

    def launch(self, h: int, x: int, dy: int, dw: int, mask: int = 0) -> None:
        """dw on stream ``h``: the partials, then their sum into dw (added to it with ``accumulate``). ``mask``: 0
        (the native kernels' signature; this one reads dy as it is, the plans form ``bit ? dy : 0`` first)."""
        if mask:
            raise ValueError("mask: the few-channel wgrad reads no mask (form bit ? dy : 0 first)")
        if self._k is None:
            self._build()
        launch, args, slaunch, sargs = self._k
        s = args.slots
        args.u64[s["x"]], args.u64[s["dy"]] = x, dy
        launch(h, args)
        sargs.u64[sargs.slots["dst"]] = dw
        slaunch(h, sargs)


def all_variants() -> list[tuple[str, str]]:
    """Every (name, stub) :func:`choose_spec` can give (the precompile tools fill the cache with them)."""
    return [SmallWgradSpec(dt, nt, rows).kernel() for dt in ("float16", "bfloat16")
            for nt in range(1, MAX_RSC // 32 + 1) for rows in (True, False)]
