"""``Conv2dPlan``: a compiled convolution for one problem.

Building a plan fixes the problem, validates it, picks the kernel problem (:mod:`._paths`) and the kernel
(:mod:`._rules`, or ``options.config``, or a remembered autotune choice), compiles it, folds the epilogue's
vectors and precomputes every scalar launch argument. Calling it checks the tensors against the plan, binds
pointers and launches (:mod:`._launch`).
"""
from __future__ import annotations

import dataclasses
import numbers
import threading

import numpy as np

from .. import _kernel, _runtime, reference
from .._checks import check_aligned, check_output, check_stream, require_array
from .._dispatch import CallContext
from .._runtime import DTYPE_SIZES, Tensor, as_tensor, keeps_current_context
from ..fastdiv import MAX_DIVIDEND
from ._launch import FoldedVectors, LaunchRecord, TorchCall, TwoPreps, workspace
from ._options import DEFAULT, Conv2dOptions
from ._paths import kernel_setup, subsampled
from ._problem import DTYPES, PRECISIONS, ConvProblem, geometry, k_table
from ._rules import FFMA_CONFIG, choose_splits, patch_config
from ._spec import (CONV_PARAMS, KernelSpec, bn_stats_ok, min_blocks_for, one_consumer_stages, store_for, stub,
                    validate_spec)
from ._transpose import flip_ok

__all__ = ["Conv2dPlan", "as_epilogue", "resolve_device", "check_tensor"]


def as_epilogue(epilogue):
    """``epilogue`` (None, an op, a chain, or a list of ops) as a Chain."""
    from ..epilogues import Chain, Epilogue, chain
    if epilogue is None:
        return chain()
    if isinstance(epilogue, Chain):
        return epilogue
    if isinstance(epilogue, Epilogue):
        return chain(epilogue)
    if isinstance(epilogue, (list, tuple)):
        return chain(*epilogue)
    raise TypeError(f"epilogue: expected an igemm.epilogues op or chain, got {type(epilogue).__name__}")


def resolve_device(device) -> int | None:
    """A plan's ``device=`` as a CUDA device index, or None for the numpy backend. ``None``: cuda:0 when the
    GPU backend is active, else the numpy backend; an int, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``:
    that GPU; ``"numpy"`` or ``"cpu"``: the numpy backend."""
    if device is None:
        return 0 if _runtime.get_backend() == "cuda" else None
    if isinstance(device, str):
        if device in ("numpy", "cpu"):
            return None
        head, _, idx = device.partition(":")
        if head != "cuda" or (idx and not idx.isdigit()):
            raise ValueError(f"device: expected an int, 'cuda', 'cuda:N', 'numpy' or None, got {device!r}")
        device = int(idx) if idx else 0
    elif hasattr(device, "type") and hasattr(device, "index"):          # torch.device
        if device.type != "cuda":
            return None
        device = device.index or 0
    if isinstance(device, bool) or not isinstance(device, numbers.Integral):
        raise TypeError(f"device: expected an int, 'cuda:N', 'numpy' or None, got {type(device).__name__}")
    if _runtime.get_backend() != "cuda":
        raise ValueError(f"device: cuda:{device} asked for, but the numpy backend is active (no CUDA GPU visible, "
                         f"or set_backend('numpy')); pass device=None or 'numpy' for a numpy-backend plan")
    n = _runtime._device_count()
    if not 0 <= device < n:
        raise ValueError(f"device: cuda:{device} does not exist ({n} CUDA device{'s' if n != 1 else ''} visible)")
    return int(device)


def _dtype_arg(dtype, arg: str = "dtype") -> str:
    name = getattr(dtype, "name", None)
    d = name if isinstance(name, str) else str(dtype).replace("torch.", "")
    if d not in DTYPES:
        raise TypeError(f"{arg}: expected one of {DTYPES}, got {dtype!r}")
    return d


def _tf32(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to TF32 (10-bit mantissa, to nearest, ties away), as the tensor cores' tf32 inputs."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


class Conv2dPlan:
    """A compiled convolution for one problem; ``plan(x, w)`` binds pointers and launches.

    Args:
        x_shape, w_shape: ``(N, C, H, W)`` and ``(K, C, R, S)`` for NCHW, ``(N, H, W, C)`` and
            ``(K, R, S, C)`` for NHWC (sequences of ints).
        dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"`` (x, w and y share it).
        layout: ``"NCHW"`` or ``"NHWC"``.
        stride, padding, dilation: ints or pairs (as ``torch.nn.functional.conv2d``).
        epilogue: an ``igemm.epilogues`` op or chain. Its vectors (BatchNorm, Bias, per-channel PReLU) are
            folded when the plan is built, on either backend: later in-place changes to them are not seen.
        precision: fp32 only: ``"strict"`` (default: fp32 accuracy, computed as 3xTF32 on the tensor cores) or
            ``"tf32"`` (one TF32 pass, ~1e-3 relative error; the numpy backend rounds x and w to TF32 first).
        residual_dtype: dtype of the ``Add`` residual (default: the one given to ``ep.Add``, else ``dtype``).
        device: a CUDA device (int, ``"cuda:N"``, ``torch.device``), ``"numpy"`` for the numpy backend, or None
            (default): cuda:0 when the GPU backend is active, else the numpy backend.
        options: :class:`Conv2dOptions` (NCHW path, width unfold, channel pad, kernel overrides, autotune).
        arch, sms: numpy-backend plans only: the GPU whose kernel :meth:`spec` and :meth:`kernel` describe
            (default ``"sm_90a"`` with 132 SMs, an H100/H200), e.g. to precompile kernels without a GPU. A GPU
            plan takes its device's.

    Example::

        plan = igemm.Conv2dPlan((32, 56, 56, 64), (64, 3, 3, 64), "float16", "NHWC", padding=1)
        y = plan(x, w)           # x, w: torch CUDA tensors; y: a torch tensor
    """

    @keeps_current_context
    def __init__(self, x_shape, w_shape, dtype, layout: str = "NCHW", stride=1, padding=0, dilation=1,
                 epilogue=None, precision: str = "strict", residual_dtype: str | None = None, device=None,
                 options: Conv2dOptions | None = None, *, arch: str | None = None, sms: int | None = None,
                 _skeleton: bool = False, _bn_stats: bool = False, _w_mn: bool = False, _w_flip: bool = False):
        dtype = _dtype_arg(dtype)
        if precision not in PRECISIONS:
            raise ValueError(f"precision: expected 'strict' or 'tf32', got {precision!r}")
        if options is None:
            options = DEFAULT
        elif not isinstance(options, Conv2dOptions):
            raise TypeError(f"options: expected igemm.Conv2dOptions, got {type(options).__name__}")
        N, C, H, W, K, R, S, P, Q, s, p, d = geometry(x_shape, w_shape, layout, stride, padding, dilation)
        self.chain = as_epilogue(epilogue)
        # (the training forward's conv: its kernel also writes y's per-tile BatchNorm statistics where it can;
        # the launch's mask pointer is then their buffer -- igemm/nn/_train_call.py)
        self._bn_stats = bool(_bn_stats) and not self.chain.ops
        # (dgrad's 1x1 on the TMA kernels: w is the filter transposed, [C][K], read as MN-major TMA tiles;
        # its launches are the dgrad plan's -- igemm/conv/_backward_plan.py; NotImplementedError where no kernel can;
        # not autotuned: the candidates read w as [K][C])
        self._w_mn = bool(_w_mn)
        # (a stride-1 NCHW dgrad's sub-convolution on the transpose path: w is the forward's filter [K][C][R][S], which
        # the input preparation moves straight to this problem's flipped KRSC -- no filter move before it
        # (docs/performance.md: dgrad-nchw-flip-in-prep); NotImplementedError where that launch cannot)
        self._w_flip = bool(_w_flip)
        if not _skeleton:
            self.chain.validate(K)
        residual_dtype = self._residual_dtype(residual_dtype, dtype)
        self.device_id = resolve_device(device)
        self.backend = "numpy" if self.device_id is None else "cuda"
        self.options = options
        self.problem = ConvProblem.of(N, C, H, W, K, R, S, s, p, d, dtype, layout, precision, self.chain,
                                      residual_dtype)
        if self.device_id is not None:
            if arch is not None or sms is not None:
                raise ValueError("arch, sms: only for numpy-backend plans (a GPU plan takes its device's)")
            self.arch = _runtime.device_arch(self.device_id)
            self.sms = _runtime.device_props(self.device_id).multiprocessor_count
        else:
            self.arch, self.sms = arch or "sm_90a", 132 if sms is None else int(sms)
        #: "native" or "transpose" (NCHW), "unfold" or "patch" (the width unfold): the kernel runs ``kproblem``
        self.path, self.kproblem = kernel_setup(self.problem, options.nchw_path, options.pad_channels,
                                                options.unfold, self.arch)
        pb, kp = self.problem, self.kproblem
        unf = self.path in ("unfold", "patch")
        #: the kernel reads prepared copies of x (and of w unless ``_w_in_place``) made by one extra kernel
        self._prep = unf or kp.layout != pb.layout or kp.C != pb.C
        self._w_in_place = not unf and kp.C == pb.C and (pb.layout == "NHWC" or R * S == 1)
        if self._w_flip and not (self.path == "transpose" and not self._w_in_place and kp.C == pb.C
                                 and flip_ok(C, K * R * S, R * S, DTYPE_SIZES[dtype])):
            raise NotImplementedError("a flipped filter needs the 16-bit NCHW transpose path with taps, "
                                      "C and K multiples of 8")
        self.x_shape = (N, C, H, W) if layout == "NCHW" else (N, H, W, C)
        self.w_shape = (K, C, R, S) if layout == "NCHW" else (K, R, S, C)
        self.y_shape = (N, K, P, Q) if layout == "NCHW" else (N, P, Q, K)
        self.dtype, self.layout = dtype, layout
        self.numel_y = N * K * P * Q
        self.mask_words = (self.numel_y + 31) // 32
        if pb.M >= MAX_DIVIDEND:
            raise NotImplementedError(f"x_shape: N*P*Q = {pb.M} output pixels; igemm's index math supports < 2**31")
        if C * H * W >= MAX_DIVIDEND or pb.Kred >= MAX_DIVIDEND:
            raise NotImplementedError(f"x_shape: one image has {C * H * W} elements; igemm supports < 2**31 per image")
        self._copy = None                # a patch plan's twin on the copy path, for a misaligned x (built on use)
        self._torch = None
        self._records: dict = {}
        if self.device_id is None:
            self.spec()                  # (the options' config is checked on the numpy backend too)
            self._host_chain = None if _skeleton else self.chain.snapshot()
            return
        self._folded = FoldedVectors(self.chain if not _skeleton else as_epilogue(None), K, self.device_id)
        self._lock = threading.Lock()
        self._ktab = None
        self._xpose = self._setup_prep() if self._prep else None
        self._record(True, True)         # compile the primary kernel now; its context is the plan's
        self._ctx_id = self._records[(True, True)].launcher._ctx_id
        self._setup_torch()

    def _residual_dtype(self, residual_dtype, dtype: str) -> str | None:
        res_op = self.chain.residual_op
        if res_op is None:
            if residual_dtype is not None:
                raise ValueError("residual_dtype: given, but the epilogue has no Add")
            return None
        name = "residual_dtype"
        if residual_dtype is None and res_op.residual is not None:
            residual_dtype, name = as_tensor(res_op.residual, "residual").dtype, "residual"
        return _dtype_arg(residual_dtype, name) if residual_dtype is not None else dtype

    # -------------------------------------------------------------------------------------- the kernel
    def spec(self, x_aligned: bool = True, w_aligned: bool = True) -> KernelSpec:
        """The kernel this plan runs (for 16-byte aligned x and w, or the narrow-load fallback)."""
        cfg = self.options.config
        if cfg is None and x_aligned and w_aligned and self.backend == "cuda" and not self._w_mn:
            from ._autotune import tuned_config
            cfg = tuned_config(self)
        if self._prep:                      # the kernel reads the plan's aligned copies (see _record)
            x_aligned, w_aligned = True, w_aligned or not self._w_in_place
        if isinstance(cfg, KernelSpec):
            spec = cfg
        else:
            from ._rules import choose_config
            spec = choose_config(self.kproblem, self.arch, x_aligned=x_aligned, w_aligned=w_aligned, sms=self.sms,
                                 bn_stats=self._bn_stats)
            if cfg:
                spec = override(spec, self.kproblem, cfg, self.sms)
        if not (x_aligned and w_aligned):
            spec = _unaligned(spec, self.kproblem, x_aligned, w_aligned)
        if self._bn_stats and bn_stats_ok(spec):
            spec = dataclasses.replace(spec, bn_stats=True)
        if self._w_mn:
            if spec.load_a not in ("tmamn", "tma") or spec.bn > 128 or self.kproblem.K % 8:
                raise NotImplementedError(f"kernel config {spec.name()}: a transposed filter needs TMA loads of x "
                                          "(one tap a k-tile), BN <= 128 and K % 8 == 0")
            spec = dataclasses.replace(spec, load_b="tmamn")
        validate_spec(spec, self.kproblem)
        return spec

    @property
    def bn_stats_tiles(self) -> int:
        """A statistics plan's (``_bn_stats``) tile rows S, ``ceil(N*P*Q / BM)``, when its kernel for aligned x and
        w writes them (t[3][S][K] floats at the mask pointer: csrc/conv/epilogue_regs.cuh), else 0."""
        if not self._bn_stats:
            return 0
        spec = self.spec()
        return -(-self.problem.M // spec.bm) if spec.bn_stats else 0

    def kernel(self, x_aligned: bool = True, w_aligned: bool = True) -> tuple[str, str]:
        """``(name, source)`` of the conv kernel this plan launches (its input preparation aside), e.g. to
        compile it ahead of time (``igemm._build.compile_many``)."""
        spec = self.spec(x_aligned, w_aligned)
        return spec.name(), stub(spec)

    def _variant(self, xa: bool, wa: bool) -> tuple[bool, bool]:
        if self._prep:   # the kernel reads the plan's aligned copy of x, and of w unless w is used in place
            return True, wa or not self._w_in_place
        return xa, wa

    def _record(self, xa: bool, wa: bool) -> LaunchRecord:
        """The launch record of the variant for x/w alignment (built on first use, then found by key)."""
        key = self._variant(xa, wa)
        rec = self._records.get(key)
        if rec is None:
            spec = self.spec(*key)
            rec = self._build_record(spec)
            self._records[key] = rec
        self._records[(xa, wa)] = rec
        return rec

    def _build_record(self, spec: KernelSpec) -> LaunchRecord:
        kp = self.kproblem
        k = _kernel.load(stub(spec), spec.name(), "igemm_conv2d_fprop", self.device_id, smem=spec.smem)
        tiles = -(-kp.M // spec.bm) * -(-kp.K // spec.bn)
        kt = -(-kp.Kred // spec.bk)
        grid = (tiles, 1, spec.splits)      # tile blockIdx.x, n-fastest (csrc/conv: tile_coord)
        if spec.persistent:                 # ctas CTAs per SM at most, looping over the tiles (csplit: CTA pairs)
            grid = (spec.csplit * min(tiles, spec.ctas * self.sms // spec.csplit), 1, 1)
        args = _kernel.pack_args(CONV_PARAMS, self._scalar_values())
        ws, smem = None, spec.launch_smem(-(-kt // spec.splits))
        if spec.streamk:                    # equal shares of tiles x k-tiles
            grid, smem = (min(self.sms * spec.streamk, tiles * kt), 1, 1), spec.smem
            ws = workspace(spec, self.device_id, grid[0], grid[0], 0)
        elif spec.splits > 1:
            ws = workspace(spec, self.device_id, tiles, tiles * spec.splits, -(-kt // spec.splits))
        if ws is not None:
            args.u64[args.slots["ws"]], args.u64[args.slots["counters"]] = ws[0].ptr, ws[1].ptr
        args.i32[2 * args.slots["splits"]] = spec.splits if ws is not None else 1
        args.i32[2 * args.slots["kt_per_split"]] = ws[2] if ws is not None else 1 << 30
        if spec.load_a == "elem":
            if self._ktab is None:          # padded for every BK the kernels use (8..64)
                tab = k_table(kp, 64)
                self._ktab = _runtime.DeviceArray(tab.shape, "int32", self.device_id)
                _runtime.memcpy_htod(self._ktab.ptr, tab.ctypes.data, tab.nbytes)
            args.u64[args.slots["ktab"]] = self._ktab.ptr
        maps = None
        if spec.tma:
            from ._tma import ConvMaps
            maps = ConvMaps(kp, spec, args.slots["tmA"], args.slots["tmB"])
        elif spec.load_a == "patch":
            from ._tma import PatchMap
            maps = PatchMap(kp, args.slots["tmA"])
        prep, cx, cw = None, 0, 0
        if self._xpose is not None:
            prep, xs, wsc = self._xpose
            cx, cw = (xs.ptr if xs is not None else 0), (wsc.ptr if wsc is not None else 0)
        return LaunchRecord(spec, _kernel.Launcher(k, grid, spec.threads, smem), args, maps, ws, prep, cx, cw,
                            self.chain.mask and not spec.fuse_mask, self.numel_y, self.dtype, self.device_id)

    def _scalar_values(self) -> dict:
        pb = self.kproblem                  # the channel count the kernel sees (padded copies: 8)
        P, Q = pb.P, pb.Q
        return dict(N=pb.N, H=pb.H, W=pb.W, C=pb.C, K=pb.K, R=pb.R, S=pb.S, P=P, Q=Q, PQ=P * Q, M=pb.M,
                    Kred=pb.Kred, sh=pb.stride[0], sw=pb.stride[1], ph=pb.padding[0], pw=pb.padding[1],
                    dh=pb.dilation[0], dw=pb.dilation[1], x_img=pb.C * pb.H * pb.W,
                    fd_PQ=P * Q, fd_Q=Q, fd_C=pb.C, fd_S=pb.S, fd_RS=pb.R * pb.S, fd_K=pb.K)

    def _setup_prep(self) -> tuple:
        """The prepared copies (scratch owned by the plan) and the one kernel that makes them: NCHW x -> NHWC
        and KCRS w -> KRSC (transpose path), with C padded to the kernel's channel count where it is larger;
        or the width unfold's copies."""
        from ._transpose import Prepared, TransposeJob
        pb, kp, dev = self.problem, self.kproblem, self.device_id
        es, Ck = DTYPE_SIZES[self.dtype], kp.C
        if self.path in ("unfold", "patch"):     # x -> [N][H][Q][C'] (copy path), w -> [K][R][1][C']
            from ._problem import unfold_channels
            from ._unfold import Unfolded, UnfoldJob
            cu = unfold_channels(pb.C, pb.S, es)
            xs = _runtime.DeviceArray((kp.N, kp.H, kp.W, Ck), self.dtype, dev) if self.path == "unfold" else None
            ws = _runtime.DeviceArray((kp.K, kp.R, 1, cu), self.dtype, dev)
            prep = Unfolded(dev, UnfoldJob.for_x(pb, es) if xs is not None else None, xs.ptr if xs is not None else 0,
                            UnfoldJob.for_w(pb, es), ws.ptr)
            if self.path == "patch" and pb.layout == "NCHW":   # the patch kernel reads an NHWC copy of x
                xs = _runtime.DeviceArray((pb.N, pb.H, pb.W, pb.C), self.dtype, dev)
                prep = TwoPreps(Prepared(dev, TransposeJob(pb.N, pb.C, pb.H * pb.W, es), xs.ptr), prep)
            return prep, xs, ws
        sub = (pb.Q, pb.W, pb.stride[0], pb.stride[1], pb.H * pb.W) if pb.layout == "NCHW" and subsampled(pb) else None
        if pb.layout == "NCHW":
            jx = TransposeJob(pb.N, pb.C, kp.H * kp.W, es, pitch=Ck, sub=sub)
            if self._w_flip:                    # w [C][K][R][S] of the forward -> this problem's [K][R'][S'][C]
                jw = TransposeJob(1, pb.C, pb.K * pb.R * pb.S, es, flip=pb.R * pb.S)
            else:
                jw = None if self._w_in_place else TransposeJob(pb.K, pb.C, pb.R * pb.S, es, pitch=Ck)
        else:                                   # NHWC, channels padded
            jx = TransposeJob(1, pb.C, pb.N * pb.H * pb.W, es, pitch=Ck, pad=True)
            jw = TransposeJob(1, pb.C, pb.K * pb.R * pb.S, es, pitch=Ck, pad=True)
        xs = _runtime.DeviceArray((pb.N, kp.H, kp.W, Ck), self.dtype, dev)
        ws = _runtime.DeviceArray((pb.K, pb.R, pb.S, Ck), self.dtype, dev) if jw is not None else None
        return Prepared(dev, jx, xs.ptr, jw, ws.ptr if ws is not None else 0), xs, ws

    def _setup_torch(self) -> None:
        try:
            self._torch = TorchCall(self)
        except ImportError:               # (no torch: every call takes the general path)
            self._torch = None

    # ---------------------------------------------------------------------------------------- calls
    def __call__(self, x, w, *, out=None, residual=None, mask_out=None, stream=None):
        """Run the convolution. Returns ``y``, or ``(y, mask)`` when the chain has ``ReLU(mask=True)``.

        ``out``: preallocated output (contiguous, 16-byte aligned). ``residual``: the ``Add`` input (else
        the one given to ``ep.Add``). ``mask_out``: preallocated mask (``ceil(numel(y)/32)`` uint32/int32).
        Thread-safe (a lock guards the argument buffers). A plan's scratch is shared by its calls: the
        split-K or stream-K workspace, the NCHW transpose path's copies of x and w; calls of one such plan on
        different streams must not overlap in time (order them, or make a plan per stream).
        """
        return self.run(x, w, out, residual, mask_out, stream, None)

    def run(self, x, w, out=None, residual=None, mask_out=None, stream=None, chain=None, folded=None):
        """:meth:`__call__` with another chain of the same structure (``igemm.conv2d``: the call's own vectors,
        folded per call as ``folded`` on the GPU)."""
        t = self._torch
        if t is not None and type(x) is t.Tensor and _runtime.current_context() == self._ctx_id:
            # torch tensors with the plan's context already current: no context to restore afterwards
            r = t.pointers(x, w, out, residual, mask_out)
            if r is not None:
                y, m, xp, wp, yp, rp, mp = r
                h = t.stream_of(self.device_id) if stream is None else \
                    _runtime.stream_handle(stream, "torch", self.device_id)
                self._launch(h, not xp & 15, not wp & 15, xp, wp, yp, rp, mp, folded or self._folded, False)
                return (y, m) if t.want_mask else y
        return self._call(x, w, out, residual, mask_out, stream, chain, folded)

    def _fresh(self, x, w, folded):
        """``run(x, w)`` for a repeated function-form call with no residual, no outputs given and the current
        stream, whose x the caller's key has checked: the call's outputs, or None (the caller's general path
        then runs) unless the plan's context is current and w is as the plan wants. Nothing here changes the
        current context, so the caller needs no keeps_current_context."""
        t = self._torch
        if t is None or _runtime.current_context() != self._ctx_id:
            return None
        r = t.fresh(x, w)
        if r is None:
            return None
        y, m, xp, wp, yp, _, mp = r
        self._launch(t.stream_of(self.device_id), not xp & 15, not wp & 15, xp, wp, yp, 0, mp,
                     folded or self._folded, False)
        return (y, m) if m is not None else y

    def _launch(self, handle: int, xa: bool, wa: bool, x: int, w: int, y: int, res: int, mask: int,
                folded: FoldedVectors, checked: bool = True) -> None:
        rec = self._records.get((xa, wa)) or self._record(xa, wa)
        with self._lock:         # one plan may be called from several threads
            rec.launch(handle, x, w, y, res, mask, folded, checked)

    @keeps_current_context
    def _call(self, x, w, out, residual, mask_out, stream, chain, folded):
        """The general call (any array kind, any current context; errors raised here, before any write)."""
        chain = chain if chain is not None else self.chain
        res_op = chain.residual_op
        if residual is None and res_op is not None:
            residual = res_op.residual
        if res_op is None and residual is not None:
            raise ValueError("residual: given, but the plan's epilogue has no Add")
        if res_op is not None and residual is None:
            raise ValueError("residual: the epilogue has an Add: pass residual= (or give it to ep.Add)")
        require_array(x, "x")
        require_array(w, "w")
        check_stream(stream)
        ctx = CallContext({"x": x, "w": w, "out": out, "residual": residual, "mask_out": mask_out}, stream)
        self._check_call(ctx.views)
        if self.backend == "numpy":
            if not ctx.host:
                raise ValueError("x: this plan was built for the numpy backend (device='numpy'): pass numpy arrays")
            return self._run_numpy(ctx.views, out, mask_out, chain)
        if ctx.device_id != self.device_id:
            raise ValueError(f"x: on cuda:{ctx.device_id} but the plan was built for cuda:{self.device_id}")
        dx, dw = ctx.device_view("x"), ctx.device_view("w")
        if dx.ptr % 16 and self.path == "patch" and self.problem.layout == "NHWC":
            return self._copy_plan().run(x, w, out, residual, mask_out, stream, chain, folded or self._folded)
        y_obj, dy = (out, ctx.device_view("out")) if out is not None else ctx.empty(self.y_shape, self.dtype)
        m_obj = dm = None
        if self.chain.mask:
            if mask_out is None:
                from ..relu import mask_dtype_for
                m_obj, dm = ctx.empty((self.mask_words,), mask_dtype_for(ctx.kind))
            else:
                m_obj, dm = mask_out, ctx.device_view("mask_out")
        self._launch(ctx.stream.handle, dx.ptr % 16 == 0, dw.ptr % 16 == 0, dx.ptr, dw.ptr, dy.ptr,
                     ctx.device_view("residual").ptr if residual is not None else 0,
                     dm.ptr if dm is not None else 0, folded or self._folded)
        if out is not None:
            ctx.copy_back("out", dy)
        y_res = out if out is not None else ctx.finish(y_obj)
        if dm is None:
            return y_res
        if mask_out is not None:
            ctx.copy_back("mask_out", dm)
            return y_res, mask_out
        return y_res, ctx.finish(m_obj)

    def _check_call(self, v: dict) -> None:
        """Every argument against the plan: shapes, dtypes, contiguity, alignment, overlap, writability."""
        self._check(v["x"], "x", self.x_shape, self.dtype)
        self._check(v["w"], "w", self.w_shape, self.dtype)
        inputs = {k: v[k] for k in ("x", "w", "residual") if k in v}
        if "residual" in v:
            self._check(v["residual"], "residual", self.y_shape, self.problem.residual_dtype)
            if v["residual"].kind != "numpy":
                check_aligned(v["residual"], "residual", 16)
        if "out" in v:
            check_output(v["out"], "out", shape=self.y_shape, dtypes=(self.dtype,), inputs=inputs)
            if v["out"].kind != "numpy":
                check_aligned(v["out"], "out", 16)
        if "mask_out" in v:
            mo = v["mask_out"]
            if not self.chain.mask:
                raise ValueError("mask_out: given, but the epilogue has no ReLU(mask=True)")
            check_output(mo, "mask_out", dtypes=("uint32", "int32"), inputs={**inputs, "out": v.get("out")})
            if mo.ndim != 1 or mo.shape[0] < self.mask_words:
                raise ValueError(f"mask_out: expected a 1-D array of >= {self.mask_words} words, got shape {mo.shape}")

    def _check(self, t: Tensor, name: str, shape, dtype) -> None:
        check_tensor(t, name, shape, dtype, self.layout)

    def _run_numpy(self, v: dict, out, mask_out, chain):
        """The numpy backend: the float64 reference with the plan's folded-at-build values (or the call's)."""
        pb = self.problem
        x, w = np.asarray(v["x"].obj), np.asarray(v["w"].obj)
        x64, w64 = x.astype(np.float64), w.astype(np.float64)
        if pb.precision == "tf32":
            x64, w64 = _tf32(x).astype(np.float64), _tf32(w).astype(np.float64)
        pre = reference.conv2d_direct(x64, w64, pb.stride, pb.padding, pb.dilation, self.layout)
        res = np.asarray(v["residual"].obj).astype(np.float64) if "residual" in v else None
        if chain is None or chain is self.chain:
            chain = self._host_chain if self._host_chain is not None else self.chain
        y = chain.reference(pre, residual=res, layout=self.layout).astype(x.dtype)
        m = reference.pack_mask(np.asarray(y, dtype=np.float64) > 0) if self.chain.mask else None
        if out is not None:
            np.asarray(out)[...] = y
            y = out
        if m is None:
            return y
        if mask_out is not None:
            np.asarray(mask_out).view(np.uint32)[:m.size] = m
            m = mask_out
        return y, m

    def _copy_plan(self) -> "Conv2dPlan":
        """This plan on the copy path (``unfold="copy"``): a patch plan's kernel reads x through a tensor map,
        which needs a 16-byte aligned address; calls with another x run here, with this plan's folded vectors."""
        if self._copy is None:
            pb = self.problem
            self._copy = Conv2dPlan(self.x_shape, self.w_shape, self.dtype, self.layout, pb.stride, pb.padding,
                                    pb.dilation, self.chain, "tf32" if pb.precision == "tf32" else "strict",
                                    pb.residual_dtype, self.device_id,
                                    dataclasses.replace(self.options, unfold="copy", nchw_path="auto"), _skeleton=True)
        return self._copy

    def with_options(self, options: Conv2dOptions) -> "Conv2dPlan":
        """This plan's problem with other options (the same chain structure; autotune builds candidates so)."""
        pb = self.problem
        numpy = self.device_id is None
        return Conv2dPlan(self.x_shape, self.w_shape, self.dtype, self.layout, pb.stride, pb.padding, pb.dilation,
                          self.chain, "tf32" if pb.precision == "tf32" else "strict", pb.residual_dtype,
                          "numpy" if numpy else self.device_id, options, arch=self.arch if numpy else None,
                          sms=self.sms if numpy else None, _skeleton=True)

    def __repr__(self) -> str:
        pb = self.problem
        path = f", nchw_path={self.path!r}" if self.path == "transpose" else ""
        if self.path == "unfold":
            path += f", unfolded to {self.kproblem.C} channels"
        elif self.path == "patch":
            path += f", unfolded to {self.kproblem.Kred // self.kproblem.R} channels in shared memory"
        elif self.kproblem.C != pb.C:
            path += f", channels padded to {self.kproblem.C}"
        return (f"Conv2dPlan(x={self.x_shape}, w={self.w_shape}, {self.dtype}, {self.layout}, stride={pb.stride}, "
                f"padding={pb.padding}, dilation={pb.dilation}, epilogue={self.chain!r}, "
                f"device={'numpy' if self.device_id is None else f'cuda:{self.device_id}'}{path})")


def check_tensor(t: Tensor, name: str, shape, dtype: str, layout: str) -> None:
    """A plan's array argument: exactly ``shape`` (in ``layout``), ``dtype``, contiguous."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({layout}), got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous in {layout} order (shape {tuple(t.shape)}, strides "
                         f"{t.strides}); call .contiguous() first")


def _unaligned(spec: KernelSpec, kp: ConvProblem, x_aligned: bool, w_aligned: bool) -> KernelSpec:
    """``spec`` for base pointers that are not 16-byte aligned: element gathers, no TMA."""
    if spec.persistent:             # TMA-only kernel: the per-tile wgmma kernel gathers instead
        spec = dataclasses.replace(spec, math="wgmma", wm=1, stages=min(spec.stages, 4), csplit=1, ctas=1,
                                   min_blocks=1)
    spec = dataclasses.replace(spec, streamk=0)     # (stream-K too: TMA loads only)
    la, lb = (("vec" if kp.layout == "NHWC" else "elem"), "vec") if spec.load_b == "tma" \
        else (spec.load_a, spec.load_b)
    return dataclasses.replace(spec, load_a="elem" if not x_aligned else la, load_b="elem" if not w_aligned else lb)


def override(spec: KernelSpec, pb: ConvProblem, cfg: dict, sms: int = 132) -> KernelSpec:
    """Apply user overrides to a spec, re-deriving what depends on them (store mode, split-K, register cap)."""
    if cfg.get("math") == "simt":
        cfg = {**FFMA_CONFIG, **cfg}        # the FFMA kernel's tile unless given
    if spec.load_a == "patch" and cfg.get("load_a", "patch") == "patch":
        # (the patch kernel re-derives its store and patch size)
        return patch_config(pb, sms, **{k: v for k, v in cfg.items() if k != "load_a"})
    spec = dataclasses.replace(spec, **cfg)
    if spec.load_b == "tma" and (not spec.math.startswith("wgmma") or "load_b" in cfg and cfg["load_b"] != "tma"
                                 or "load_a" in cfg and not cfg["load_a"].startswith("tma")):
        # TMA loads are the wgmma kernel's: another mainloop (or one operand overridden) gathers both
        la, lb = cfg.get("load_a", "vec"), cfg.get("load_b", "vec")
        spec = dataclasses.replace(spec, load_a="vec" if la.startswith("tma") else la, load_b="vec" if lb == "tma" else lb)
    if spec.csplit != 1 and "csplit" not in cfg and (not spec.persistent or spec.wm != 1):
        spec = dataclasses.replace(spec, csplit=1)  # (the cluster k-split is the one-consumer kernel's)
    if spec.persistent and "math" not in cfg:
        if spec.wm == 1 and "stages" not in cfg:     # the one consumer's ring: as deep as the tile allows
            spec = dataclasses.replace(spec, stages=one_consumer_stages(spec.bn))
        if spec.load_a not in ("tma", "tmamn") or spec.splits != 1 or spec.streamk or not validate_spec(spec, pb, raise_=False):
            # the persistent kernel is TMA-only, has 64-row tiles and no split-K or stream-K: gathered loads,
            # other tiles, splits or stream-K asked for run on the per-tile wgmma kernel (4 stages unless asked)
            spec = dataclasses.replace(spec, math="wgmma", wm=spec.bm // 64, stages=cfg.get("stages", 4), csplit=1)
    if not spec.persistent and spec.ctas != 1:
        spec = dataclasses.replace(spec, ctas=1)    # (several CTAs an SM: the persistent kernel's grid)
    if "math" in cfg and not cfg["math"].startswith("wgmma") and "bk" not in cfg:
        spec = dataclasses.replace(spec, bk=(128 if cfg["math"] == "tf32x3_wgmma" else 64) // DTYPE_SIZES[pb.dtype])
        if cfg["math"] in ("tensorop", "tf32x3") and "wn" not in cfg:
            spec = dataclasses.replace(spec, wn=2, wm=spec.bm // 64)
    if spec.math == "tf32x3_wgmma" and "wm" not in cfg:
        spec = dataclasses.replace(spec, wm=spec.bm // 64, wn=1)     # (a warpgroup per 64 rows)
    if "splits" not in cfg:
        spec = dataclasses.replace(spec, splits=1 if spec.persistent or spec.streamk
                                   else choose_splits(pb, spec.bm, spec.bn, spec.bk, sms))
    # the store mode follows the tile: the register epilogue where it can run (unless the fp32 C tile's
    # store phase is asked for by name), else the one the tile's width allows
    store, vec_o, fuse = store_for(pb, spec.math, spec.bn, spec.splits, regs=cfg.get("store", "regs") in ("regs", "regsnchw"))
    spec = dataclasses.replace(spec, store=store, vec_o=vec_o, fuse_mask=fuse)
    if "min_blocks" not in cfg:
        spec = dataclasses.replace(spec, min_blocks=min_blocks_for(spec))
    return spec
