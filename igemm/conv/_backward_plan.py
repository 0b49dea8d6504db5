"""``Conv2dGradInputPlan`` and ``Conv2dGradWeightPlan``: the convolution backward, compiled once per problem.

Each holds the forward plans of its problem (:mod:`._backward`: dgrad's phases, wgrad's turned convolution) or
the native kernels (:mod:`._native`), the operand moves around them and their scratch; a call checks the tensors,
then launches moves and convolutions in stream order. The numpy backend runs the float64 references
(``igemm.reference``) on the same arguments.
"""
from __future__ import annotations

import math
import sys
import threading

import numpy as np

from .. import _runtime, reference
from .._checks import check_aligned, check_flag, check_mask, check_output, check_stream, require_array
from .._dispatch import CallContext
from .._runtime import DTYPE_SIZES, keeps_current_context
from . import _native, _native_dgrad, _native_nchw, _transpose, _wgrad_small
from ._backward import GradInputProblem, GradWeightProblem, Phase
from ._moves import Move, contiguous, dz_fits, launch_dz
from ._plan import Conv2dPlan, _dtype_arg, _tf32, check_tensor, resolve_device
from ._problem import PRECISIONS

__all__ = ["Conv2dGradInputPlan", "Conv2dGradWeightPlan", "GradPrologue"]


class GradPrologue:
    """The BN-backward prologue of a conv followed by BatchNorm (training statistics) [+ residual] and ReLU:
    the gradient reaching the conv is ``dz = a[k]·g + b[k]·z + c[k]`` with ``g = bit ? dy : 0`` (``mask=``) or
    ``dy``, ``z`` the conv's output and ``coef = [a; b; c]`` (fp32, 3 x K). Made by
    :func:`igemm.conv2d_grad_prologue`, which also gives BN's own gradients ``grad_weight`` (dgamma) and
    ``grad_bias`` (dbeta)."""

    __slots__ = ("z", "coef", "grad_weight", "grad_bias")

    def __init__(self, z, coef, grad_weight=None, grad_bias=None):
        self.z, self.coef, self.grad_weight, self.grad_bias = z, coef, grad_weight, grad_bias

    def __repr__(self) -> str:
        return f"GradPrologue(z={getattr(self.z, 'shape', None)}, coef={getattr(self.coef, 'shape', None)})"


class _GradPlan:
    """What both plans share: arguments, the forward plans' device, scratch, the prologue's checks."""

    def _setup(self, dtype, layout, precision, mask, prologue, device):
        self.dtype = _dtype_arg(dtype)
        if precision not in PRECISIONS:
            raise ValueError(f"precision: expected 'strict' or 'tf32', got {precision!r}")
        self.layout, self.precision = layout, precision
        self.mask, self.prologue = check_flag(mask, "mask"), check_flag(prologue, "prologue")
        self.device_id = resolve_device(device)
        self.backend = "numpy" if self.device_id is None else "cuda"
        self._scratch: dict[str, _runtime.DeviceArray] = {}
        self._lock = threading.Lock()

    def _prepass(self, h: int, move: Move, dy: int, dz: int, mode: str, fp: dict) -> None:
        """dy -> dz with the call's mask / prologue (or only realigned): the channels-last dz pass where it fits
        (docs/performance.md: grad-dz-pass), else ``move``."""
        g = self.problem
        if mode != "plain" and self.layout == "NHWC" and dz_fits(self.dtype, g.K, dy, dz, fp["z"], fp["coef"]):
            return launch_dz(self.device_id, h, self.dtype, math.prod(g.dy_shape) // g.K, g.K, dy, dz, mode=mode,
                             sms=self.sms, **fp)
        move.launch(self.device_id, h, self.dtype, self.dtype, dy, dz, mode=mode, sms=self.sms, **fp)

    def _nhwc_inputs(self, h: int, other, src: int, dst: int, dy: int, dyt: int, mode: str, fp: dict) -> None:
        """An NCHW plan's inputs to its NHWC twin: the operand at ``src`` by the transpose job ``other()`` into
        ``dst`` (``other`` None: no other operand), and dy [N][K][PQ] -> dyt [N][PQ][K] in the same launch, or by
        the tiled move ``self._nchw[0]`` where the mask / prologue apply (the launches made at the first call:
        ``self._xpose``)."""
        g, dev, dt = self.problem, self.device_id, self.dtype
        if self._xpose is None:
            jdy = _transpose.TransposeJob(g.N, g.K, g.P * g.Q, 2)
            if other is None:
                self._xpose = [_transpose.Prepared(dev, jdy, dyt), None, None]
            else:
                job = other()
                self._xpose = [_transpose.Prepared(dev, job, dst, jdy, dyt), _transpose.Prepared(dev, job, dst), None]
        if mode == "plain":
            self._xpose[0](h, *((dy,) if other is None else (src, dy)))
        else:
            if other is not None:
                self._xpose[1](h, src)
            self._nchw[0].launch(dev, h, dt, dt, dy, dyt, mode=mode, sms=self.sms, **fp)

    def _nhwc_output(self, h: int, job, src: int, dst: int) -> None:
        """The NHWC twin's output at ``src`` into ``dst`` by the transpose job ``job()`` (its launch kept for this
        ``dst``)."""
        back = self._xpose[2]
        if back is None or back.dst0 != dst:
            back = self._xpose[2] = _transpose.Prepared(self.device_id, job(), dst)
        back(h, src)

    def _target(self, arch, sms) -> tuple[str, int]:
        """(architecture, SM count) the plan's kernels are for: its device's, or the given ones (numpy plans)."""
        if self.device_id is not None:
            return _runtime.device_arch(self.device_id), _runtime.device_props(self.device_id).multiprocessor_count
        return arch or "sm_90a", 132 if sms is None else int(sms)

    def _sub_plan(self, args: dict, options, arch, sms, **kw) -> Conv2dPlan:
        return Conv2dPlan(args["x_shape"], args["w_shape"], self.dtype, args["layout"], args["stride"],
                          args["padding"], args["dilation"], precision=self.precision,
                          device="numpy" if self.device_id is None else self.device_id, options=options,
                          arch=arch if self.device_id is None else None, sms=sms if self.device_id is None else None,
                          **kw)

    def _general(self, a: tuple, b: tuple, out_shape, out_dtype: str, mask, prologue, out, stream):
        """The call for any array kind: ``a``, ``b`` = (name, array, shape); every check before any launch, the
        numpy backend's references, or the views' pointers to :meth:`_run`."""
        (na, a, sa), (nb, b, sb) = a, b
        require_array(a, na)
        require_array(b, nb)
        check_stream(stream)
        ctx = CallContext({na: a, nb: b, **self._arrays(mask, prologue), "out": out}, stream)
        v = ctx.views
        self._check(v[na], na, sa, self.dtype)
        self._check(v[nb], nb, sb, self.dtype)
        self._check_fused(v, self.problem.dy_shape, self.problem.K, mask, prologue)
        if out is not None:
            check_output(v["out"], "out", shape=out_shape, dtypes=(out_dtype,),
                         inputs={k: t for k, t in v.items() if k != "out"})
            if v["out"].kind != "numpy":
                check_aligned(v["out"], "out", 16)    # (a convolution's epilogue may store into it)
        if self.backend == "numpy":
            return self._numpy(v, out)
        if ctx.device_id != self.device_id:
            raise ValueError(f"{na}: on cuda:{ctx.device_id} but the plan was built for cuda:{self.device_id}")
        o_obj, d_out = (out, ctx.device_view("out")) if out is not None else ctx.empty(out_shape, out_dtype)
        with self._lock:
            self._run(ctx.stream.handle, ctx.device_view(na).ptr, ctx.device_view(nb).ptr, d_out.ptr,
                      _fused_ptrs(ctx))
        if out is not None:
            ctx.copy_back("out", d_out)
            return out
        return ctx.finish(o_obj)

    def _buf(self, name: str, shape, dtype: str) -> int:
        b = self._scratch.get(name)
        if b is None:
            b = self._scratch[name] = _runtime.DeviceArray(tuple(shape), dtype, self.device_id)
        return b.ptr

    def _check(self, t, name: str, shape, dtype) -> None:
        check_tensor(t, name, shape, dtype, self.layout)

    def _check_fused(self, v: dict, dy_shape, K: int, mask, prologue) -> None:
        """mask= and prologue= against the plan and dy."""
        numel = int(np.prod(dy_shape))
        if (mask is not None) != self.mask:
            raise ValueError(f"mask: {'given' if mask is not None else 'missing'}, but the plan was built with "
                             f"mask={self.mask}")
        if (prologue is not None) != self.prologue:
            raise ValueError(f"prologue: {'given' if prologue is not None else 'missing'}, but the plan was built "
                             f"with prologue={self.prologue}")
        if mask is not None:
            check_mask(v["mask"], "mask", numel)
        if prologue is not None:
            if not isinstance(prologue, GradPrologue):
                raise TypeError(f"prologue: expected igemm.GradPrologue (from igemm.conv2d_grad_prologue), got "
                                f"{type(prologue).__name__}")
            self._check(v["z"], "prologue.z", dy_shape, self.dtype)
            c = v["coef"]
            if c.dtype != "float32":
                raise TypeError(f"prologue.coef: expected float32, got {c.dtype}")
            if tuple(c.shape) != (3, K) or not c.is_contiguous():
                raise ValueError(f"prologue.coef: expected a contiguous float32 array of shape (3, {K}), got "
                                 f"{c.dtype} {tuple(c.shape)}")

    @staticmethod
    def _arrays(mask, prologue) -> dict:
        d = {"mask": mask}
        if isinstance(prologue, GradPrologue):
            d.update(z=prologue.z, coef=prologue.coef)
        return d

    def _numpy_dy(self, v: dict, dy) -> np.ndarray:
        """The gradient reaching the conv, float64 (the mask and prologue applied)."""
        pro = None
        if "z" in v:
            c = np.asarray(v["coef"].obj, np.float64)
            pro = (np.asarray(v["z"].obj), c[0], c[1], c[2])
        m = np.asarray(v["mask"].obj).view(np.uint32) if "mask" in v else None
        return reference.grad_prologue_ref(np.asarray(dy), m, pro, self.layout)

    def _fused_move(self, dy_shape, K: int) -> Move:
        """dgrad's pre-pass: dy -> dz in place of order (the mask / prologue applied)."""
        cdim = 1 if self.layout == "NCHW" else 3
        st = contiguous(dy_shape)
        return Move(tuple(dy_shape), st, st, cdim=cdim, K=K)

    def _torch_fast(self, a, b, a_shape, b_shape, mask, prologue, out, stream):
        """A call on torch CUDA tensors exactly as the plan wants them (on its device, its dtype and shapes,
        contiguous; a fresh output; the current stream): ``(torch, stream handle, fused pointers)``, else None
        (the general path, which raises the precise error). Skips the array views of the general path."""
        t = _TORCH[0]
        if t is None:
            if "torch" not in sys.modules or self.backend != "cuda":
                return None
            import torch
            t = _TORCH[0] = torch
        T = t.Tensor
        if (out is not None or stream is not None or type(a) is not T or type(b) not in (T, t.nn.Parameter)
                or (mask is not None) != self.mask or (prologue is not None) != self.prologue):
            return None
        dt = getattr(t, self.dtype)
        for v, shape in ((a, a_shape), (b, b_shape)):
            if (v.dtype is not dt or v.get_device() != self.device_id or tuple(v.shape) != shape
                    or not v.is_contiguous()):
                return None
        fp = {"mask": 0, "z": 0, "coef": 0}
        dy_shape = self.problem.dy_shape
        if mask is not None:
            if (type(mask) is not T or mask.dtype not in (t.int32, t.uint32) or mask.dim() != 1
                    or mask.shape[0] < (math.prod(dy_shape) + 31) // 32 or not mask.is_contiguous()
                    or mask.get_device() != self.device_id or mask.data_ptr() % 4):
                return None
            fp["mask"] = mask.data_ptr()
        if prologue is not None:
            z, c = getattr(prologue, "z", None), getattr(prologue, "coef", None)
            if (type(prologue) is not GradPrologue or type(z) is not T or type(c) is not T or z.dtype is not dt
                    or tuple(z.shape) != dy_shape or not z.is_contiguous() or z.get_device() != self.device_id
                    or c.dtype is not t.float32 or tuple(c.shape) != (3, self.problem.K) or not c.is_contiguous()
                    or c.get_device() != self.device_id):
                return None
            fp["z"], fp["coef"] = z.data_ptr(), c.data_ptr()
        return t, t._C._cuda_getCurrentRawStream(self.device_id), fp


class Conv2dGradInputPlan(_GradPlan):
    """dgrad compiled for one forward problem: ``plan(dy, w)`` returns dx (``x_shape``, dy's dtype).

    Args follow :class:`igemm.Conv2dPlan` (``x_shape``, ``w_shape`` of the forward problem); ``mask``,
    ``prologue``: whether calls pass the forward's ReLU mask of y / a :class:`GradPrologue`.
    """

    @keeps_current_context
    def __init__(self, x_shape, w_shape, dtype, layout: str = "NCHW", stride=1, padding=0, dilation=1, *,
                 precision: str = "strict", mask: bool = False, prologue: bool = False, device=None, options=None,
                 arch: str | None = None, sms: int | None = None):
        self.problem = g = GradInputProblem(x_shape, w_shape, layout, stride, padding, dilation)
        self._setup(dtype, layout, precision, mask, prologue, device)
        self.x_shape, self.w_shape, self.dy_shape = g.x_shape, g.w_shape, g.dy_shape
        self._pre = self._fused_move(g.dy_shape, g.K)
        self.native = self._nchw = self._xpose = None
        na_arch, na_sms = self._target(arch, sms)
        if options is None and _native_dgrad.dgrad_unsupported(g, self.dtype, layout, na_arch) is None:
            #: the native kernel (sm_90a, 16-bit NHWC, stride 1: dy and w read in place, conv/_native_dgrad.py)
            self.native = _native_dgrad.NativeDgrad(g, self.dtype, self.device_id, na_sms)
        elif (options is None and layout == "NCHW" and (g.stride != (1, 1) or (g.R * g.S > 1 and g.H * g.W < 64))
              and _native_dgrad.dgrad_unsupported(g.nhwc_twin(), self.dtype, "NHWC", na_arch) is None):
            # a strided NCHW dgrad, or one with taps over images under 64 pixels: the NHWC twin's kernel on
            # transposed copies of dy and w (a 1x1's w as it is), dx transposed back (a strided unpadded 1x1's twin a
            # stride-1 1x1, its dx scattered back with the zeros; docs/performance.md: dgrad-nchw-twin,
            # dgrad-nchw-twin-small, dgrad-nchw-scatter)
            self.native = _native_dgrad.NativeDgrad(g.nhwc_twin(), self.dtype, self.device_id, na_sms)
            self._nchw = g.nhwc_moves()
        self._wcopy = Move(g.w_shape, contiguous(g.w_shape), contiguous(g.w_shape))
        if self.native is not None:
            self.sms, self.plans = na_sms, {}
            return
        def sub_plan(ph: Phase) -> Conv2dPlan:
            # a 1x1's filter [K][C] is the sub-convolution's transposed: read in place as MN-major TMA tiles where
            # the sub-convolution loads by TMA; a stride-1 filter with taps is flipped into the KRSC the
            # sub-convolution's transpose path reads, in that launch (no filter move: docs/performance.md,
            # dgrad-nchw-w-in-place, dgrad-nchw-flip-in-prep)
            for ok, kw in ((g.w_transposed_ok(), {"_w_mn": True}), (g.w_flipped_ok(), {"_w_flip": True})):
                if ok:
                    try:
                        return self._sub_plan(g.sub_plan_args(ph), options, arch, sms, **kw)
                    except NotImplementedError:
                        pass
            return self._sub_plan(g.sub_plan_args(ph), options, arch, sms)
        self.plans = {i: sub_plan(ph) for i, ph in enumerate(g.phases) if not ph.zero}
        self.sms = next(iter(self.plans.values())).sms if self.plans else (sms or 132)
        # what a call launches, made once: the pre-pass, then per live phase its plan, filter move and interleave
        self._phases = [(i, self.plans[i], g.filter_move(ph), *g.interleave_move(ph), g.sub_w_shape(ph))
                        for i, ph in enumerate(g.phases) if not ph.zero]
        self._zero = any(ph.zero for ph in g.phases)
        self._ymax = max((math.prod(g.sub_y_shape(ph)) for ph in g.phases if not ph.zero), default=1)
        self._dx_bytes = math.prod(g.x_shape) * DTYPE_SIZES[self.dtype]

    def sub_plans(self) -> list:
        """The forward plans this plan launches (e.g. to compile their kernels ahead of time); for the native kernel,
        its kernel (with the plans' ``kernel()``)."""
        return self.native.kernels() if self.native is not None else list(self.plans.values())

    @property
    def adds(self) -> bool:
        """Whether ``_run(..., add=True)`` adds into dx (the native kernel's store does, not its NCHW twin's)."""
        return self.native is not None and self._nchw is None

    def __call__(self, dy, w, *, mask=None, prologue=None, out=None, stream=None):
        """dx for ``dy`` (the forward output's gradient) and the filter ``w``. ``out``: a preallocated dx."""
        g = self.problem
        fast = self._torch_fast(dy, w, g.dy_shape, g.w_shape, mask, prologue, out, stream)
        if fast is not None:
            dx = fast[0].empty(g.x_shape, dtype=dy.dtype, device=dy.device)
            with self._lock:
                self._run(fast[1], dy.data_ptr(), w.data_ptr(), dx.data_ptr(), fast[2])
            return dx
        return self._general(("dy", dy, g.dy_shape), ("w", w, g.w_shape), g.x_shape, self.dtype, mask, prologue,
                             out, stream)

    def _numpy(self, v: dict, out):
        g = self.problem
        d = self._numpy_dy(v, v["dy"].obj)
        wt = np.asarray(v["w"].obj)
        if self.dtype == "float32" and self.precision == "tf32":
            d, wt = _tf32(d), _tf32(wt)
        res = reference.conv2d_grad_input_ref(d, wt, g.x_shape, g.stride, g.padding, g.dilation, self.layout)
        return _numpy_out(res, out, np.asarray(v["dy"].obj).dtype)

    def fuses_mask(self, dy: int, fp: dict) -> bool:
        """Whether a call with these pointers reads the mask in the native kernel (no dz: grad-mask-registers)."""
        return (self.native is not None and self._nchw is None and _mode(fp) == "mask" and dy % 16 == 0
                and self.native.fuses_mask(fp["mask"]))

    def _run(self, h: int, dy: int, w: int, dx: int, fp: dict, add: bool = False, sums=None) -> None:
        """The launches on stream ``h``; ``fp``: the mask / prologue pointers (0: none); ``add``: dx += the gradient
        (the native kernel only: see :attr:`adds`); ``sums``: the native kernel also writes the BatchNorm sums of the
        layer before (``NativeDgrad.launch``'s; the training path's, docs/performance.md: bn-sums-in-dgrad)."""
        g, dev, es, dt = self.problem, self.device_id, DTYPE_SIZES[self.dtype], self.dtype
        if add and not self.adds:
            raise ValueError("add: only the native dgrad kernel on NHWC tensors adds into dx")
        if sums is not None and (self.native is None or self._nchw is not None):
            raise ValueError("sums: only the native dgrad kernel on NHWC tensors writes them")
        mode = _mode(fp)
        if self._nchw is not None:
            return self._run_nchw(h, dy, w, dx, mode, fp)
        fused = self.fuses_mask(dy, fp) and not add and sums is None
        if (mode != "plain" and not fused) or dy % 16:   # (an unaligned dy is moved too: the phases read aligned rows)
            dz = self._buf("dz", g.dy_shape, dt)
            self._prepass(h, self._pre, dy, dz, mode, fp)
            dy = dz
        if self.native is not None:
            return self.native.launch(h, dy, self._w_aligned(h, w), dx, add, fp["mask"] if fused else 0, sums)
        if self._zero:                        # rows no tap reaches: zero at memset speed first
            _runtime.memset_d8(dx, 0, self._dx_bytes, _runtime.RawStream(h))
        for i, plan, fmove, imove, off, f_shape in self._phases:
            if plan._w_mn or plan._w_flip:    # (w read as it is: a 16-byte aligned base for the map / the moves)
                f = self._w_aligned(h, w)
            else:
                f = self._buf(f"w{i}", f_shape, dt)
                fmove.launch(dev, h, dt, dt, w, f, sms=self.sms)
            y = dx if g.direct else self._buf("y", (self._ymax,), dt)
            plan._launch(h, True, True, dy, f, y, 0, 0, plan._folded)
            if not g.direct:
                imove.launch(dev, h, dt, dt, y, dx + off * es, sms=self.sms)

    def _w_aligned(self, h: int, w: int) -> int:
        """w, or its copy where it is not 16-byte aligned (the native kernel's tensor map needs it)."""
        if w % 16 == 0:
            return w
        wc = self._buf("wc", self.problem.w_shape, self.dtype)
        self._wcopy.launch(self.device_id, h, self.dtype, self.dtype, w, wc, sms=self.sms)
        return wc

    def _run_nchw(self, h: int, dy: int, w: int, dx: int, mode: str, fp: dict) -> None:
        """The NHWC twin's kernel on NHWC copies: dy and w by the forward's NCHW -> NHWC transpose pair in one
        launch (dy by a tiled move where the mask / prologue apply), then the twin's dx transposed into dx."""
        g, dt, t = self.problem, self.dtype, self.native.g
        dyt, dxt = self._buf("dyt", t.dy_shape, dt), self._buf("dxt", t.x_shape, dt)
        if g.R * g.S == 1:                    # a 1x1's w [K][C] is its twin's
            wt = self._w_aligned(h, w)
            self._nhwc_inputs(h, None, 0, 0, dy, dyt, mode, fp)
        else:                                 # w [K][C][RS] -> [K][RS][C] beside dy
            wt = self._buf("wt", t.w_shape, dt)
            self._nhwc_inputs(h, lambda: _transpose.TransposeJob(g.K, g.C, g.R * g.S, 2), w, wt, dy, dyt, mode, fp)
        self.native.launch(h, dyt, wt, dxt)
        self._nhwc_output(h, g.dx_job, dxt, dx)          # the twin's dx [N][pixels][C] -> dx [N][C][HW]


class Conv2dGradWeightPlan(_GradPlan):
    """wgrad compiled for one forward problem: ``plan(x, dy)`` returns dw (``w_shape``, ``out_dtype``).

    ``out_dtype``: dw's dtype (default: x's; ``"float32"`` for fp32 gradients of a 16-bit problem);
    ``accumulate``: add into ``out`` (gradient accumulation) instead of overwriting it. ``role``: ``"native"``
    (x and dy read in place: sm_90a, 16-bit NHWC, C % 64 == 0, K % 8 == 0; or 16-bit NHWC with C < 64,
    R·S·C <= 256, K % 8 == 0: the few-channel kernel, :mod:`._wgrad_small`; a 16-bit NCHW problem runs its NHWC
    twin's kernel on transposed copies), ``"dy"``/``"x"`` (the 1x1 GEMM form) or None (the turned convolution);
    ``options`` (for the forward plans) selects the forward-kernel forms.
    """

    @keeps_current_context
    def __init__(self, x_shape, w_shape, dtype, layout: str = "NCHW", stride=1, padding=0, dilation=1, *,
                 precision: str = "strict", mask: bool = False, prologue: bool = False, out_dtype=None,
                 accumulate: bool = False, device=None, options=None, arch: str | None = None,
                 sms: int | None = None):
        self.problem = g = GradWeightProblem(x_shape, w_shape, layout, stride, padding, dilation)
        self._setup(dtype, layout, precision, mask, prologue, device)
        self.out_dtype = _dtype_arg(out_dtype, "out_dtype") if out_dtype is not None else self.dtype
        if self.out_dtype not in (self.dtype, "float32"):
            raise ValueError(f"out_dtype: expected {self.dtype!r} or 'float32', got {self.out_dtype!r}")
        self.accumulate = check_flag(accumulate, "accumulate")
        self.x_shape, self.w_shape, self.dy_shape = g.x_shape, g.w_shape, g.dy_shape
        self.native = None
        arch, sms = self._target(arch, sms)
        #: "native" (x and dy read in place: conv/_native.py on sm_90a, conv/_wgrad_small.py for few channels), the
        #: GEMM form's in-place operand ("dy", "x"), or None: the turned convolution (module doc)
        self.role = g.gemm_role(self.mask or self.prologue)
        self._nchw = self._xpose = None
        if options is None and layout == "NHWC":
            self.native = _native_wgrad(g, self.dtype, self.out_dtype, self.accumulate, self.device_id, arch, sms)
        elif options is None and DTYPE_SIZES[self.dtype] == 2:
            if _native_nchw.unsupported(g, self.dtype, arch) is None:      # a 1x1: x and dy read in place
                self.native = _native_nchw.NativeWgradNchw(g, self.dtype, self.out_dtype, self.accumulate,
                                                           self.device_id, sms)
            else:
                # NCHW: the NHWC twin's kernel after x and dy are transposed to NHWC (dy by a move with the mask /
                # prologue; a strided unpadded 1x1's x only where it reads it, its twin a stride-1 1x1), then dw
                # transposed back, or moved where it is fp32 or accumulates; a 1x1's twin writes dw itself
                # (docs/performance.md: wgrad-nchw-native, wgrad-nchw-dw-transpose, wgrad-nchw-1x1-twin)
                one = g.R * g.S == 1
                self.native = _native_wgrad(g.nhwc_twin(), self.dtype, self.out_dtype, one and self.accumulate,
                                            self.device_id, arch, sms)
                if self.native is not None:
                    self._nchw = g.nhwc_moves()
        if self.native is not None:
            self.role, self.sms = "native", sms
            self._pre = self._fused_move(g.dy_shape, g.K)
            self._xcopy = Move(g.x_shape, contiguous(g.x_shape), contiguous(g.x_shape))
            return
        if self.role is not None:
            self.plan = self._sub_plan(g.gemm_plan_args(self.role), options, arch, sms)
            if not _gemm_form_runs(self.plan, layout):
                self.role = None               # (no kernel that reads it in place: the turned convolution)
        if self.role is None:
            self.plan = self._sub_plan(g.sub_plan_args(), options, arch, sms)
            self._moves = (g.x_move(), g.dy_move(), g.w_move())
        else:
            self._moves = (g.gemm_operand_move(self.role), self._fused_move(g.dy_shape, g.K),
                           g.gemm_out_move(self.role))
            self._wt_shape = g.gemm_plan_args(self.role)["w_shape"]
        self.sms = self.plan.sms

    def sub_plans(self) -> list:
        """The forward plan this plan launches (e.g. to compile its kernels ahead of time); for the native kernel,
        its kernels (each with the plans' ``kernel()``)."""
        return self.native.kernels() if self.native is not None else [self.plan]

    def __call__(self, x, dy, *, mask=None, prologue=None, out=None, stream=None):
        """dw for the forward input ``x`` and the output gradient ``dy``; ``out`` (required with
        ``accumulate=True``): dw's array (``w_shape``, ``out_dtype``)."""
        g = self.problem
        fast = None if self.accumulate else self._torch_fast(x, dy, g.x_shape, g.dy_shape, mask, prologue, out,
                                                             stream)
        if fast is not None:
            torch = fast[0]
            dw = torch.empty(g.w_shape, dtype=getattr(torch, self.out_dtype), device=x.device)
            with self._lock:
                self._run(fast[1], x.data_ptr(), dy.data_ptr(), dw.data_ptr(), fast[2])
            return dw
        if self.accumulate and out is None:
            raise ValueError("out: required with accumulate=True (the array the gradient is added to)")
        return self._general(("x", x, g.x_shape), ("dy", dy, g.dy_shape), g.w_shape, self.out_dtype, mask, prologue,
                             out, stream)

    def _numpy(self, v: dict, out):
        g = self.problem
        d = self._numpy_dy(v, v["dy"].obj)
        xt = np.asarray(v["x"].obj)
        if self.dtype == "float32" and self.precision == "tf32":
            d, xt = _tf32(d), _tf32(xt)
        res = reference.conv2d_grad_weight_ref(xt, d, g.w_shape, g.stride, g.padding, g.dilation, self.layout)
        if self.accumulate:
            res = res + np.asarray(out, np.float64)
        return _numpy_out(res, out, np.dtype(self.out_dtype) if self.out_dtype != "bfloat16"
                          else np.asarray(v["x"].obj).dtype)

    def _run(self, h: int, x: int, dy: int, dw: int, fp: dict) -> None:
        """The launches on stream ``h``; ``fp``: the mask / prologue pointers (0: none)."""
        if self.native is not None:
            return self._run_native(h, x, dy, dw, fp)
        if self.role is not None:
            return self._run_gemm(h, x, dy, dw, fp)
        g, dev = self.problem, self.device_id
        xt = self._buf("xt", g.xt_shape, self.dtype)
        dyt = self._buf("dyt", g.dyt_shape, self.dtype)
        yt = self._buf("yt", g.yt_shape, self.dtype)
        xm, dym, wm = self._moves
        xm.launch(dev, h, self.dtype, self.dtype, x, xt, sms=self.sms)
        dym.launch(dev, h, self.dtype, self.dtype, dy, dyt, mode=_mode(fp), sms=self.sms, **fp)
        self.plan._launch(h, True, True, xt, dyt, yt, 0, 0, self.plan._folded)
        wm.launch(dev, h, self.dtype, self.out_dtype, yt, dw, accumulate=self.accumulate, sms=self.sms)

    def fuses_mask(self, dy: int, fp: dict) -> bool:
        """Whether a call with these pointers reads the mask in the native kernel (no dz: grad-mask-registers)."""
        return (isinstance(self.native, _native.NativeWgrad) and self._nchw is None and _mode(fp) == "mask"
                and dy % 16 == 0 and self.native.fuses_mask(fp["mask"]))

    def _run_native(self, h: int, x: int, dy: int, dw: int, fp: dict) -> None:
        """The native kernel: x and dy read in place (a misaligned one, or dy under a mask / prologue, copied);
        NCHW: x and dy transposed to NHWC (dy by a move with the mask / prologue), dw transposed (or moved) back."""
        g, dev, dt = self.problem, self.device_id, self.dtype
        mode = _mode(fp)
        if self._nchw is not None:
            t = self.native.g
            xt, dyt = self._buf("xt", t.x_shape, dt), self._buf("dyt", g.dy_shape, dt)
            # x [N][C][HW] -> [N][HW][C] (x[:, :, ::sh, ::sw] for a strided unpadded 1x1) beside dy
            self._nhwc_inputs(h, g.x_job, x, xt, dy, dyt, mode, fp)
            if g.R * g.S == 1:                 # dw' [K][1][1][C] is dw [K][C][1][1]
                return self.native.launch(h, xt, dyt, dw)
            wt = self._buf("wt", g.w_shape, self.out_dtype)
            self.native.launch(h, xt, dyt, wt)
            if self.accumulate or self.out_dtype != dt:
                return self._nchw[1].launch(dev, h, self.out_dtype, self.out_dtype, wt, dw,
                                            accumulate=self.accumulate, sms=self.sms)
            # dw' [K][RS][C] -> dw [K][C][RS] (the move is slower: wgrad-nchw-dw-transpose)
            return self._nhwc_output(h, lambda: _transpose.TransposeJob(g.K, g.R * g.S, g.C, 2), wt, dw)
        fused = self.fuses_mask(dy, fp)
        if (mode != "plain" and not fused) or dy % 16:
            dz = self._buf("dz", g.dy_shape, dt)
            self._prepass(h, self._pre, dy, dz, mode, fp)
            dy = dz
        if x % 16:
            xc = self._buf("xc", g.x_shape, dt)
            self._xcopy.launch(dev, h, dt, dt, x, xc, sms=self.sms)
            x = xc
        self.native.launch(h, x, dy, dw, fp["mask"] if fused else 0)

    def _run_gemm(self, h: int, x: int, dy: int, dw: int, fp: dict) -> None:
        """The GEMM form (1x1 unpadded): the in-place operand read where it lies, the other moved (NHWC: MN-major
        tiles of the NCHW 1x1 forward; NCHW: rows of the NHWC forward whose filter has N taps)."""
        g, dev, role = self.problem, self.device_id, self.role
        mode = _mode(fp)
        opm, prem, outm = self._moves
        wt = self._buf("wt", self._wt_shape, self.dtype)
        if role == "dy":
            opm.launch(dev, h, self.dtype, self.dtype, x, wt, sms=self.sms)
            src = dy
            if mode != "plain" or dy % 16:       # dy read in place: the mask / prologue need their own pass
                src = self._buf("dz", g.dy_shape, self.dtype)
                self._prepass(h, prem, dy, src, mode, fp)
        else:
            opm.launch(dev, h, self.dtype, self.dtype, dy, wt, mode=mode, sms=self.sms, **fp)
            src = x
        direct = not g.gemm_out_transposed(role) and not self.accumulate and self.out_dtype == self.dtype
        yt = dw if direct else self._buf("yt", (g.K * g.C,), self.dtype)
        self.plan._launch(h, src % 16 == 0, True, src, wt, yt, 0, 0, self.plan._folded)
        if not direct:
            outm.launch(dev, h, self.dtype, self.out_dtype, yt, dw, accumulate=self.accumulate, sms=self.sms)


def _gemm_form_runs(plan: Conv2dPlan, layout: str) -> bool:
    """Whether the GEMM form's forward plan reads its in-place operand whole: NHWC, the NCHW 1x1 forward's MN-major
    TMA tiles; NCHW, the NHWC forward's 16-byte (or TMA) rows of P·Q channels (else the turned convolution)."""
    spec = plan.spec()
    if layout == "NHWC":
        return plan.path == "native" and spec.load_a == "tmamn"
    return spec.load_a in ("vec", "tma") and spec.load_b in ("vec", "tma")


def _native_wgrad(g, dtype: str, out_dtype: str, accumulate: bool, device_id, arch: str, sms: int):
    """The kernel that reads the NHWC problem ``g``'s x and dy in place: the native one (sm_90a, C % 64 == 0), the
    few-channel one (C < 64, R·S·C <= 256), or None."""
    if _native.unsupported(g, dtype, "NHWC", arch) is None:
        return _native.NativeWgrad(g, dtype, out_dtype, accumulate, device_id, sms)
    if _wgrad_small.unsupported(g, dtype, "NHWC") is None:
        return _wgrad_small.SmallWgrad(g, dtype, out_dtype, accumulate, device_id, sms)
    return None


def _numpy_out(res: np.ndarray, out, dtype):
    if out is not None:
        np.asarray(out)[...] = res
        return out
    return res.astype(dtype)


_TORCH = [None]          # torch, once a plan call has seen it imported


def _mode(fp: dict) -> str:
    return "bn" if fp["coef"] else ("mask" if fp["mask"] else "plain")


def _fused_ptrs(ctx) -> dict:
    v = ctx.views
    return {k: ctx.device_view(k).ptr if k in v else 0 for k in ("mask", "z", "coef")}
