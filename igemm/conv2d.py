"""conv2d forward as an implicit GEMM, with fused epilogues: ``Conv2dPlan``, ``conv2d``, ``conv2d_bn_relu``.

A :class:`Conv2dPlan` fixes the problem (shapes, dtype, layout, stride/padding/dilation, precision,
epilogue structure), validates it, picks and compiles the kernel (``choose_config``), folds BatchNorm
into fp32 scale/shift vectors and precomputes every scalar launch argument (GEMM sizes, magic
numbers). Calling it only checks the tensors against the plan, binds pointers and launches.
:func:`conv2d` fetches plans from an LRU cache.
"""
from __future__ import annotations

import dataclasses
import math
import threading
from collections import OrderedDict

import numpy as np

from . import _fastlaunch, _kernel, _runtime, reference
from ._dispatch import CallContext
from ._runtime import keeps_current_context
from ._heuristics import ConvProblem, KernelSpec, choose_config, kernel_setup, subsampled, validate_spec
from ._kernel import ParamSpec
from ._runtime import DTYPE_SIZES, Tensor, as_tensor
from .fastdiv import MAX_DIVIDEND
from .reference.conv import pair

__all__ = ["Conv2dPlan", "conv2d", "conv2d_bn_relu", "CONV_PARAMS"]

#: The conv family's launch parameters, in order (the one definition; the stub is rendered from it).
CONV_PARAMS = [
    ParamSpec("x", "ptr"), ParamSpec("w", "ptr"), ParamSpec("y", "ptr"), ParamSpec("residual", "ptr"),
    ParamSpec("scale", "ptr"), ParamSpec("shift", "ptr"), ParamSpec("alpha", "ptr"), ParamSpec("mask", "ptr"),
    ParamSpec("ws", "ptr"), ParamSpec("counters", "ptr"), ParamSpec("ktab", "ptr"),
    ParamSpec("alpha_scalar", "float32"), ParamSpec("splits", "int32"), ParamSpec("kt_per_split", "int32"),
    *(ParamSpec(n, "int32") for n in ("N", "H", "W", "C", "K", "R", "S", "P", "Q", "PQ", "M", "Kred",
                                      "sh", "sw", "ph", "pw", "dh", "dw")),
    ParamSpec("x_img", "int64"),
    *(ParamSpec(n, "fastdiv") for n in ("fd_PQ", "fd_Q", "fd_C", "fd_S", "fd_RS", "fd_K")),
    ParamSpec("tmA", "tmap"), ParamSpec("tmB", "tmap"),     # TMA loader only (igemm/_tma.py)
]

_DTYPES = ("float16", "bfloat16", "float32")
_LAYOUTS = ("NCHW", "NHWC")
_PRECISIONS = ("strict", "tf32")


def _stub(spec: KernelSpec) -> str:
    return _kernel.render_kernel(include="conv/fprop.cuh", entry="igemm_conv2d_fprop", params=CONV_PARAMS,
                                 threads=spec.threads, min_blocks=spec.min_blocks, prelude=spec.prelude(),
                                 cluster=spec.csplit,
                                 body=f"igemm::conv::fprop<{spec.config_type()}>(p);")


def _as_epilogue(epilogue):
    from .epilogues import Chain, Epilogue, chain
    if epilogue is None:
        return chain()
    if isinstance(epilogue, Chain):
        return epilogue
    if isinstance(epilogue, Epilogue):
        return chain(epilogue)
    if isinstance(epilogue, (list, tuple)):
        return chain(*epilogue)
    raise TypeError(f"epilogue: expected an igemm.epilogues op or chain, got {type(epilogue).__name__}")


def _geometry(x_shape, w_shape, layout, stride, padding, dilation):
    if layout not in _LAYOUTS:
        raise ValueError(f"layout: expected 'NCHW' or 'NHWC', got {layout!r}")
    x_shape, w_shape = tuple(int(s) for s in x_shape), tuple(int(s) for s in w_shape)
    if len(x_shape) != 4:
        raise ValueError(f"x: expected a 4-D {layout} tensor, got shape {x_shape}")
    if len(w_shape) != 4:
        raise ValueError(f"w: expected a 4-D filter ({'K,C,R,S' if layout == 'NCHW' else 'K,R,S,C'}), got shape {w_shape}")
    if layout == "NCHW":
        N, C, H, W = x_shape
        K, Cw, R, S = w_shape
    else:
        N, H, W, C = x_shape
        K, R, S, Cw = w_shape
    if Cw != C:
        raise ValueError(f"w: has {Cw} input channels but x has {C} ({layout}: x {x_shape}, w {w_shape}); "
                         f"grouped convolution is not supported")
    if min(N, C, H, W, K, R, S) < 1:
        raise ValueError(f"empty tensors are not supported: x {x_shape}, w {w_shape}")
    s, p, d = pair(stride, "stride"), pair(padding, "padding"), pair(dilation, "dilation")
    if min(s) < 1:
        raise ValueError(f"stride: must be >= 1, got {stride!r}")
    if min(p) < 0:
        raise ValueError(f"padding: must be >= 0, got {padding!r}")
    if min(d) < 1:
        raise ValueError(f"dilation: must be >= 1, got {dilation!r}")
    P = (H + 2 * p[0] - d[0] * (R - 1) - 1) // s[0] + 1
    Q = (W + 2 * p[1] - d[1] * (S - 1) - 1) // s[1] + 1
    if P < 1 or Q < 1:
        raise ValueError(f"the (dilated) filter {R}x{S} (dilation {d}) does not fit the padded input "
                         f"{H}x{W} (padding {p}): output would be {P}x{Q}")
    return N, C, H, W, K, R, S, P, Q, s, p, d


def _k_table(pb: ConvProblem, bk: int) -> np.ndarray:
    """Per reduction index k (padded to a whole k-tile): the element offset of tap k relative to an
    output pixel's origin tap, and (r·dh, s·dw) packed as two int16 (r·dh = -32768 past Kred: never valid).
    The element-gather loaders read it instead of dividing k per element."""
    R, S, C, H, W = pb.R, pb.S, pb.C, pb.H, pb.W
    dh, dw = pb.dilation
    if (R - 1) * dh > 32767 or (S - 1) * dw > 32767:
        raise NotImplementedError(f"dilated filter extent {(R - 1) * dh}x{(S - 1) * dw} exceeds 32767")
    n = -(-pb.Kred // bk) * bk
    k = np.arange(pb.Kred)
    if pb.layout == "NHWC":
        rs, c = np.divmod(k, C)
        r, s = np.divmod(rs, S)
        delta = (r * dh * W + s * dw) * C + c
    else:
        c, rs = np.divmod(k, R * S)
        r, s = np.divmod(rs, S)
        delta = c * H * W + r * dh * W + s * dw
    tab = np.zeros((n, 2), dtype=np.int32)
    tab[:pb.Kred, 0] = delta
    rdh = np.full(n, -32768, dtype=np.int64)
    sdw = np.zeros(n, dtype=np.int64)
    rdh[:pb.Kred], sdw[:pb.Kred] = r * dh, s * dw
    tab[:, 1] = ((rdh & 0xFFFF) | (sdw << 16)).astype(np.int64).astype(np.uint32).view(np.int32)
    return tab


_CU_STREAMS = _kernel._cu_streams       # raw stream handle -> its CUstream (the lean launch reads it directly)


def torch_empty(shape, dtype, device):
    import torch
    return torch.empty(shape, dtype=dtype, device=device)


def _apart(p: int, n: int, *extents) -> bool:
    """Whether bytes [p, p+n) overlap none of the (pointer, nbytes) pairs in ``extents`` (0 pointers skipped)."""
    for i in range(0, len(extents), 2):
        q = extents[i]
        if q and q < p + n and p < q + extents[i + 1]:
            return False
    return True


def _override(spec: KernelSpec, pb: ConvProblem, cfg: dict) -> KernelSpec:
    """Apply user overrides to a spec, re-deriving what depends on them (store mode, split-K)."""
    from ._heuristics import choose_splits, store_for
    bad = set(cfg) - {f.name for f in dataclasses.fields(KernelSpec)}
    if bad:
        raise ValueError(f"config: unknown fields {sorted(bad)}")
    if spec.load_a == "patch" and cfg.get("load_a", "patch") == "patch":
        from ._heuristics import patch_config        # (the patch kernel re-derives its store and patch size)
        return patch_config(pb, 132, **{k: v for k, v in cfg.items() if k != "load_a"})
    spec = dataclasses.replace(spec, **cfg)
    if spec.load_b == "tma" and (not spec.math.startswith("wgmma") or "load_b" in cfg and cfg["load_b"] != "tma"
                                 or "load_a" in cfg and not cfg["load_a"].startswith("tma")):
        # TMA loads are the wgmma kernel's: another mainloop (or one operand overridden) gathers both
        la, lb = cfg.get("load_a", "vec"), cfg.get("load_b", "vec")
        spec = dataclasses.replace(spec, load_a="vec" if la.startswith("tma") else la, load_b="vec" if lb == "tma" else lb)
    if spec.csplit != 1 and "csplit" not in cfg and (not spec.persistent or spec.wm != 1):
        spec = dataclasses.replace(spec, csplit=1)  # (the cluster k-split is the one-consumer kernel's)
    if spec.persistent and "math" not in cfg:
        from ._heuristics import one_consumer_stages, validate_spec
        if spec.wm == 1 and "stages" not in cfg:     # the one consumer's ring: as deep as the tile allows
            spec = dataclasses.replace(spec, stages=one_consumer_stages(spec.bn))
        if spec.load_a not in ("tma", "tmamn") or spec.splits != 1 or spec.streamk or not validate_spec(spec, pb, raise_=False):
            # the persistent kernel is TMA-only, has 64-row tiles and no split-K or stream-K: gathered
            # loads, other tiles, splits or stream-K asked for run on the per-tile wgmma kernel (with its
            # 4 stages unless asked: a deep ring may not fit its tile)
            spec = dataclasses.replace(spec, math="wgmma", wm=spec.bm // 64, stages=cfg.get("stages", 4), csplit=1)
    if not spec.persistent and spec.ctas != 1:
        spec = dataclasses.replace(spec, ctas=1)    # (several CTAs an SM: the persistent kernel's grid)
    if "math" in cfg and not cfg["math"].startswith("wgmma") and "bk" not in cfg:
        spec = dataclasses.replace(spec, bk={"simt": 8}.get(cfg["math"], 64 // DTYPE_SIZES[pb.dtype]))
        if cfg["math"] in ("tensorop", "tf32x3") and "wn" not in cfg:
            spec = dataclasses.replace(spec, wn=2, wm=spec.bm // 64)
    if "splits" not in cfg:
        spec = dataclasses.replace(spec, splits=1 if spec.persistent or spec.streamk
                                   else choose_splits(pb, spec.bm, spec.bn, spec.bk, 132))
    # the store mode follows the tile: the register epilogue where it can run (unless the fp32 C tile's
    # store phase is asked for by name), else the one the tile's width allows
    store, vec_o, fuse = store_for(pb, spec.math, spec.bn, spec.splits, regs=cfg.get("store", "regs") in ("regs", "regsnchw"))
    spec = dataclasses.replace(spec, store=store, vec_o=vec_o, fuse_mask=fuse)
    if "min_blocks" not in cfg:
        from ._heuristics import min_blocks_for
        spec = dataclasses.replace(spec, min_blocks=min_blocks_for(spec))
    return spec


class _Folded:
    """An epilogue's per-channel fp32 vectors on the device (``scale``, ``shift``, ``alpha`` pointers).

    torch CUDA vectors are folded with torch ops on their device (no host synchronisation); anything
    else is folded on the host in float64 and uploaded.
    """

    def __init__(self, chain, K: int, device_id: int | None, stream: int = 0):
        self.scale = self.shift = self.alpha = 0
        self._keep = []
        aff = chain.affine_ops
        pr = chain.prelu_op
        self.alpha_scalar = float(pr.alpha) if pr is not None and not pr.per_channel else 0.0
        vectors = [getattr(o, n) for o in aff for n in ("gamma", "beta", "mean", "var", "b") if hasattr(o, n)]
        if pr is not None and pr.per_channel:
            vectors.append(pr.alpha)
        self.host = None
        if device_id is not None and vectors and all(type(v).__module__.split(".")[0] == "torch"
                                                     and v.is_cuda for v in vectors):
            import torch
            cur = torch._C._cuda_getCurrentRawStream(device_id)
            if stream and stream != cur:
                with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=torch.device("cuda", device_id))):
                    self._fold_torch(aff, pr, K, device_id)
            else:
                self._fold_torch(aff, pr, K, device_id)
            return
        from .reference.epilogue import fold_affine, host_f64
        host = {}
        if aff:
            host["scale"], host["shift"] = fold_affine(aff, K)
        if pr is not None and pr.per_channel:
            host["alpha"] = host_f64(pr.alpha).reshape(-1)
        self.host = host
        if device_id is not None:
            rs = _runtime.RawStream(stream)
            for name, arr in host.items():
                d = _runtime.DeviceArray((K,), "float32", device_id, rs)   # stream-ordered on the launch stream
                a32 = np.ascontiguousarray(arr, dtype=np.float32)
                _runtime.memcpy_htod(d.ptr, a32.ctypes.data, a32.nbytes, rs)
                self._keep.append(d)
                setattr(self, name, d.ptr)

    def _fold_torch(self, aff, pr, K, device_id):
        # fp32, few ops (this runs on every call of the function API): per BatchNorm
        # s = gamma * rsqrt(var + eps), shift = beta - mean * s; composed in chain order
        import torch
        scale = shift = None
        for op in aff:
            if type(op).__name__ == "BatchNorm":
                s = torch.rsqrt(op.var.float() + op.eps).mul_(op.gamma.float())
                sh = torch.addcmul(op.beta.float(), op.mean.float(), s, value=-1.0)
                if shift is not None:
                    sh = torch.addcmul(sh, shift, s)        # (prev * s) + this op's shift
                scale = s if scale is None else scale.mul_(s)
                shift = sh
            else:
                b = op.b.float()
                shift = b.clone() if shift is None else shift + b
        if aff:
            dev = torch.device("cuda", device_id)
            if scale is None:
                scale = torch.ones(K, dtype=torch.float32, device=dev)
            self._set("scale", scale.contiguous().reshape(-1))
            self._set("shift", shift.contiguous().reshape(-1))
        if pr is not None and pr.per_channel:
            self._set("alpha", pr.alpha.float().contiguous().reshape(-1))

    def _set(self, name, t):
        self._keep.append(t)
        setattr(self, name, t.data_ptr())

    def ptr_args(self) -> tuple:
        return self.scale, self.shift, self.alpha


class Conv2dPlan:
    """A compiled convolution for one problem; ``plan(x, w)`` binds pointers and launches.

    Args:
        x_shape, w_shape: ``(N, C, H, W)`` and ``(K, C, R, S)`` for NCHW, ``(N, H, W, C)`` and
            ``(K, R, S, C)`` for NHWC.
        dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"`` (x, w and y share it).
        layout: ``"NCHW"`` or ``"NHWC"``.
        stride, padding, dilation: ints or pairs (as ``torch.nn.functional.conv2d``).
        epilogue: an ``igemm.epilogues`` op or chain (BatchNorm/Bias vectors are folded now).
        precision: fp32 only: ``"strict"`` (default: fp32 accuracy, computed as 3xTF32 on the tensor cores --
            each operand split into two TF32 parts, three MMAs per product, the accumulators promoted into
            fp32 registers every 4 k-tiles; ``IGEMM_FP32_STRICT=simt`` or ``config={"math": "simt"}``: the
            IEEE FFMA kernel) or ``"tf32"`` (one TF32 pass, ~1e-3 relative error).
        residual_dtype: dtype of the ``Add`` residual (default: ``dtype``).
        device: CUDA device index (default 0); ``None`` builds a plan for the numpy backend.
        config: override the kernel choice: a dict of ``KernelSpec`` fields (``{"bn": 256, "splits": 2}``,
            ``{"math": "wgmma_ws", "bm": 64, "wm": 2}`` for the persistent kernel (``"wm": 1``: one
            consumer; with ``"csplit": 2`` two CTAs a tile in a cluster; ``"ctas": 3`` three CTAs an SM, as
            the one k-tile 1x1 layers with a chain take by default), ``{"streamk": 1}`` for stream-K
            with one CTA per SM) or a whole ``KernelSpec``; checked, ``NotImplementedError`` if it cannot
            run the problem.
            ``IGEMM_AUTOTUNE=1`` instead times the candidates on first use and remembers the fastest.
        nchw_path: NCHW only: ``"auto"`` (default), ``"native"`` (the NCHW gather) or ``"transpose"`` (x and
            w are transposed to NHWC/KRSC by one extra kernel into plan-owned scratch, then gathered with
            16-byte loads; y is still stored NCHW by the epilogue). ``auto`` takes the transpose path for
            16-bit types with C % 8 == 0 (faster on every such ResNet-50 layer measured, notes/perf.md)
            and with ``pad_channels=True``.
            The scratch makes concurrent calls of one such plan on different streams unsafe (as split-K's).
        pad_channels: ``True``: 16-bit with C < 8 (conv1's C = 3) runs on copies of x and w with C padded
            to 8 zero channels (one extra kernel, plan-owned scratch; on the transpose path for NCHW), so
            the gather uses 16-byte loads. Off by default: on an H200 the padded conv1 measured slower
            than the element gather (notes/perf.md).
        unfold: the width unfold (``igemm/_unfold.py``): C channels and an R x S filter become C' = S*C
            (rounded up to 16 bytes) channels and an R x 1 filter, so A is moved 16 bytes at a time and the
            reduction is R*C' (conv1: 168, against 392 padded). On sm_90, 16-bit NHWC (dilation 1) it runs in
            shared memory: each CTA loads its input patch once by TMA and builds its A tiles from it
            (``csrc/conv/patch.cuh``; only w is copied); elsewhere on copies of x and w made by one extra
            kernel. ``None`` (default): on for pixels under 16 bytes (C * element size < 16, conv1's C = 3)
            with S > 1, either layout (y is still stored in ``layout``); ``True``: on; ``"copy"`` / ``"patch"``:
            on, that way; ``False``: the element gather.

    Example::

        plan = igemm.Conv2dPlan((32, 56, 56, 64), (64, 3, 3, 64), "float16", "NHWC", padding=1)
        y = plan(x, w)           # x, w: torch CUDA tensors; y: a torch tensor
    """

    @keeps_current_context
    def __init__(self, x_shape, w_shape, dtype: str, layout: str = "NCHW", stride=1, padding=0, dilation=1,
                 epilogue=None, precision: str = "strict", residual_dtype: str | None = None,
                 device: int | None = 0, config=None, nchw_path: str = "auto", pad_channels: bool | None = None,
                 unfold: bool | str | None = None, _skeleton: bool = False):
        dtype = str(dtype).replace("torch.", "")
        if dtype not in _DTYPES:
            raise TypeError(f"dtype: expected one of {_DTYPES}, got {dtype!r}")
        if precision not in _PRECISIONS:
            raise ValueError(f"precision: expected 'strict' or 'tf32', got {precision!r}")
        N, C, H, W, K, R, S, P, Q, s, p, d = _geometry(x_shape, w_shape, layout, stride, padding, dilation)
        self.chain = _as_epilogue(epilogue)
        if not _skeleton:
            self.chain.validate(K)
        res_op = self.chain.residual_op
        if res_op is None and residual_dtype is not None:
            raise ValueError("residual_dtype given but the epilogue has no Add")
        if res_op is not None:
            if residual_dtype is None and res_op.residual is not None:
                residual_dtype = as_tensor(res_op.residual, "residual").dtype
            residual_dtype = residual_dtype or dtype
            if residual_dtype not in _DTYPES:
                raise TypeError(f"residual: dtype {residual_dtype} not supported (expected one of {_DTYPES})")
        self.problem = ConvProblem(N, C, H, W, K, R, S, s, p, d, dtype, layout,
                                   precision if dtype == "float32" else "tensorop",
                                   self.chain.signature(), residual_dtype)
        pb = self.problem
        #: "native" or "transpose" (NCHW), "unfold" (either layout); the kernel runs ``kproblem`` (NHWC in,
        #: ``layout`` out on the latter two)
        self._path_options = dict(nchw_path=nchw_path, pad_channels=pad_channels, unfold=unfold)   # (autotune)
        self.arch = _runtime.device_arch(device) if device is not None else "sm_90a"
        #: "patch" (the width unfold in shared memory): the kernel problem is ``pb`` with the unfolded filter's
        #: reduction (``ConvProblem.patch``), and only w is copied
        self.nchw_path, self.kproblem = kernel_setup(pb, nchw_path, pad_channels, unfold, self.arch)
        kp = self.kproblem
        unf = self.nchw_path in ("unfold", "patch")
        #: the kernel reads prepared copies of x (and of w unless ``_w_in_place``) made by one extra kernel
        self._prep = unf or kp.layout != pb.layout or kp.C != pb.C
        self._w_in_place = not unf and kp.C == pb.C and (pb.layout == "NHWC" or R * S == 1)
        self.x_shape = tuple(int(v) for v in x_shape)
        self.w_shape = tuple(int(v) for v in w_shape)
        self.y_shape = (N, K, P, Q) if layout == "NCHW" else (N, P, Q, K)
        self.dtype, self.layout = dtype, layout
        self.numel_y = N * K * P * Q
        self.mask_words = (self.numel_y + 31) // 32
        if pb.M >= MAX_DIVIDEND:
            raise NotImplementedError(f"N*P*Q = {pb.M} output pixels: igemm's index math supports < 2**31")
        if C * H * W >= MAX_DIVIDEND or pb.Kred >= MAX_DIVIDEND:
            raise NotImplementedError(f"one image of x has {C * H * W} elements: igemm supports < 2**31 per image")
        self.device_id = device
        self.backend = "numpy" if device is None else "cuda"
        self._specs: dict = {}
        self._folded = _Folded(self.chain, K, device) if not _skeleton else _Folded(_as_epilogue(None), K, None)
        self._config = config
        self._copy = None                # a patch plan's twin on the copy path, for a misaligned x (built on use)
        self.sms = _runtime.device_props(device).multiprocessor_count if device is not None else 132
        self._fast = None
        self._ktab = None
        self._xpose = None
        self._split_args = None          # the launcher whose split-K values are in the argument buffer
        self._maps: dict = {}            # launcher -> its TMA tensor maps (igemm/_tma.py), TMA kernels only
        self._maps_in_args = None        # the ConvMaps whose maps are in the argument buffer
        self._lean_recs: dict = {}       # launcher -> its lean launch record (_lean)
        self._cfast = self._cst = None   # the C call (igemm_fastlaunch.conv) and its state tuple (_arm)
        self._armed = bytearray(1)       # 1: the argument buffer holds the aligned launcher's values (_arm)
        self._ctx_id = -1
        if device is not None:
            self._primary = self.spec()
            self._args = self._scalar_args()
            self._slot = self._args.slots
            self._u64 = memoryview(self._args.data)     # slot writes: faster than numpy item assignment
            self._lock = threading.Lock()
            # compile the primary kernel now; its context is the plan's (the lean launch's condition)
            self._aligned = self._launcher(True, True)[0]
            self._ctx_id = self._aligned._ctx_id
            if self._prep:
                self._setup_prep()
            self._setup_fast()

    # -------------------------------------------------------------------------------------- setup
    def _scalar_args(self) -> list:
        pb = self.kproblem                  # the channel count the kernel sees (padded copies: 8)
        P, Q = pb.P, pb.Q
        vals = dict(N=pb.N, H=pb.H, W=pb.W, C=pb.C, K=pb.K, R=pb.R, S=pb.S, P=P, Q=Q, PQ=P * Q, M=pb.M,
                    Kred=pb.Kred, sh=pb.stride[0], sw=pb.stride[1], ph=pb.padding[0], pw=pb.padding[1],
                    dh=pb.dilation[0], dw=pb.dilation[1], x_img=pb.C * pb.H * pb.W,
                    fd_PQ=P * Q, fd_Q=Q, fd_C=pb.C, fd_S=pb.S, fd_RS=pb.R * pb.S, fd_K=pb.K,
                    scale=self._folded.scale, shift=self._folded.shift,
                    alpha=self._folded.alpha, alpha_scalar=self._alpha_scalar())
        return _kernel.pack_args(CONV_PARAMS, vals)

    def _alpha_scalar(self) -> float:
        pr = self.chain.prelu_op
        return float(pr.alpha) if pr is not None and not pr.per_channel else 0.0

    def spec(self, x_aligned: bool = True, w_aligned: bool = True) -> KernelSpec:
        """The kernel this plan runs (for 16-byte aligned x and w, or the narrow-load fallback)."""
        cfg = self._config
        if cfg is None and x_aligned and w_aligned and self.backend == "cuda":
            from ._autotune import tuned_config
            cfg = tuned_config(self)
        if self._prep:                      # the kernel reads the plan's aligned copies (see _launcher)
            x_aligned, w_aligned = True, w_aligned or not self._w_in_place
        if isinstance(cfg, KernelSpec):
            spec = cfg
        else:
            spec = choose_config(self.kproblem, self.arch, x_aligned=x_aligned, w_aligned=w_aligned, sms=self.sms)
            if cfg:
                spec = _override(spec, self.kproblem, cfg)
        if not (x_aligned and w_aligned):
            if spec.persistent:             # TMA-only kernel: the per-tile wgmma kernel gathers instead
                spec = dataclasses.replace(spec, math="wgmma", wm=1, stages=min(spec.stages, 4), csplit=1, ctas=1,
                                           min_blocks=1)
            spec = dataclasses.replace(spec, streamk=0)     # (stream-K too: TMA loads only)
            la, lb = (("vec" if self.kproblem.layout == "NHWC" else "elem"), "vec") if spec.load_b == "tma" \
                else (spec.load_a, spec.load_b)
            spec = dataclasses.replace(spec, load_a="elem" if not x_aligned else la,
                                       load_b="elem" if not w_aligned else lb)
        validate_spec(spec, self.kproblem)
        return spec

    def _launcher(self, xa: bool, wa: bool):
        if self._prep:
            # the kernel reads the plan's aligned copy of x, and of w unless w is used in place (1x1 KCRS is KRSC)
            xa, wa = True, wa or not self._w_in_place
        key = (xa, wa)
        l = self._specs.get(key)
        if l is None:
            spec = self._primary if key == (True, True) else self.spec(xa, wa)
            k = _kernel.load(_stub(spec), spec.name(), "igemm_conv2d_fprop", self.device_id, smem=spec.smem)
            tiles = -(-self.problem.M // spec.bm) * -(-self.problem.K // spec.bn)
            grid = (tiles, 1, spec.splits)      # tile blockIdx.x, n-fastest (csrc/conv/config.cuh, tile_coord)
            if spec.persistent:                 # ctas CTAs per SM at most, looping over the tiles
                grid = (spec.csplit * min(tiles, spec.ctas * self.sms // spec.csplit), 1, 1)   # (csplit: CTA pairs a tile)
            kt = -(-self.kproblem.Kred // spec.bk)  # the kernel's reduction (padded or unfolded copies: longer)
            ws = None
            if spec.streamk:                    # equal shares of tiles x k-tiles (csrc/conv/streamk_sm90.cuh, fprop_streamk)
                grid = (min(self.sms * spec.streamk, tiles * kt), 1, 1)
                ws = self._workspace(spec, grid[0], grid[0], 0)
            elif spec.splits > 1:
                ws = self._workspace(spec, tiles, tiles * spec.splits, -(-kt // spec.splits))
            if spec.load_a == "elem" and self._ktab is None:
                tab = _k_table(self.kproblem, 64)      # padded for every BK the kernels use (8..64)
                d = _runtime.DeviceArray(tab.shape, "int32", self.device_id)
                _runtime.memcpy_htod(d.ptr, tab.ctypes.data, tab.nbytes)
                self._ktab = d
                self._args.u64[self._slot["ktab"]] = d.ptr
            l = (_kernel.Launcher(k, grid, spec.threads,
                                  spec.smem if spec.streamk else spec.launch_smem(-(-kt // spec.splits))), spec, ws)
            if spec.load_b == "tma":
                from ._tma import ConvMaps
                self._maps[l[0]] = ConvMaps(self.kproblem, spec, self._slot["tmA"], self._slot["tmB"])
            elif spec.load_a == "patch":
                from ._tma import PatchMap
                self._maps[l[0]] = PatchMap(self.kproblem, self._slot["tmA"])
            self._specs[key] = l
        return l

    def _setup_prep(self) -> None:
        """The prepared copies (scratch owned by the plan) and the one kernel that makes them: NCHW x -> NHWC
        and KCRS w -> KRSC (transpose path), with C padded to the kernel's channel count where it is larger."""
        from ._transpose import Prepared, TransposeJob
        pb, Ck = self.problem, self.kproblem.C
        es = DTYPE_SIZES[self.dtype]
        if self.nchw_path in ("unfold", "patch"):  # x -> [N][H][Q][C'] (copy path), w -> [K][R][1][C'] (igemm/_unfold.py)
            from ._unfold import Unfolded, UnfoldJob, unfold_channels
            kp = self.kproblem
            cu = unfold_channels(pb.C, pb.S, es)
            xs = None
            if self.nchw_path == "unfold":
                xs = _runtime.DeviceArray((kp.N, kp.H, kp.W, Ck), self.dtype, self.device_id)
            ws = _runtime.DeviceArray((kp.K, kp.R, 1, cu), self.dtype, self.device_id)
            prep = Unfolded(self.device_id, UnfoldJob.for_x(pb, es) if xs is not None else None,
                            xs.ptr if xs is not None else 0, UnfoldJob.for_w(pb, es), ws.ptr)
            if self.nchw_path == "patch" and pb.layout == "NCHW":   # the patch kernel reads an NHWC copy of x
                xs = _runtime.DeviceArray((pb.N, pb.H, pb.W, pb.C), self.dtype, self.device_id)
                prep = _TwoPreps(Prepared(self.device_id, TransposeJob(pb.N, pb.C, pb.H * pb.W, es), xs.ptr), prep)
            self._xpose = (prep, xs, ws)
            return
        sub = None
        if pb.layout == "NCHW" and subsampled(pb):   # only the pixels a 1x1 strided conv reads (kernel_problem)
            sub = (pb.Q, pb.W, pb.stride[0], pb.stride[1], pb.H * pb.W)
        if pb.layout == "NCHW":
            jx = TransposeJob(pb.N, pb.C, self.kproblem.H * self.kproblem.W, es, pitch=Ck, sub=sub)
            jw = None if self._w_in_place else TransposeJob(pb.K, pb.C, pb.R * pb.S, es, pitch=Ck)
        else:                                   # NHWC, channels padded
            jx = TransposeJob(1, pb.C, pb.N * pb.H * pb.W, es, pitch=Ck, pad=True)
            jw = TransposeJob(1, pb.C, pb.K * pb.R * pb.S, es, pitch=Ck, pad=True)
        xs = _runtime.DeviceArray((pb.N, self.kproblem.H, self.kproblem.W, Ck), self.dtype, self.device_id)
        ws = _runtime.DeviceArray((pb.K, pb.R, pb.S, Ck), self.dtype, self.device_id) if jw is not None else None
        prep = Prepared(self.device_id, jx, xs.ptr, jw, ws.ptr if ws is not None else 0)
        self._xpose = (prep, xs, ws)

    def _workspace(self, spec: KernelSpec, slots: int, partials: int, kt_per_split: int) -> tuple:
        """Partial fp32 tiles and ``slots`` int32 tickets/flags (zeroed once; the kernel leaves them zero).
        Split-K: a ticket per tile, a partial per tile and split; stream-K: a flag and a partial per CTA."""
        ws = _runtime.DeviceArray((partials * spec.bm * spec.bn,), "float32", self.device_id)
        cnt = _runtime.DeviceArray((slots,), "int32", self.device_id)
        _runtime.memset_d32_sync(cnt.ptr, 0, slots)
        return ws, cnt, kt_per_split

    # -------------------------------------------------------------------------------------- call
    def __call__(self, x, w, *, out=None, residual=None, mask_out=None, stream=None, _folded=None):
        """Run the convolution. Returns ``y``, or ``(y, mask)`` when the chain has ``ReLU(mask=True)``.

        ``out``: preallocated output (contiguous, 16-byte aligned). ``residual``: the ``Add`` input (else
        the one given to ``ep.Add``). ``mask_out``: preallocated mask (``ceil(numel(y)/32)`` uint32/int32).
        Thread-safe (a lock guards the shared argument buffer). A plan's scratch is shared by its calls: the
        split-K or stream-K workspace, the NCHW transpose path's copies of x and w (:attr:`nchw_path`); calls
        of one such plan on different streams must not overlap in time (order them, or make a plan per
        stream).
        """
        c = self._cfast
        if c is not None and stream is None and _folded is None:
            r = c(self._cst, x, w, out, residual, mask_out)      # the whole call in C (see _arm), or None
            if r is not None:
                return r
        f = self._fast
        if f is not None and type(x) is f[0] and f[16]() == self._ctx_id:
            # torch tensors with the plan's context already current (the usual case): nothing to restore
            # afterwards, so no keeps_current_context wrapper, and the launch may skip its own check
            r = self._call_torch(x, w, out, residual, mask_out, stream, _folded, True)
            if r is not None:
                return r
        return self._call(x, w, out=out, residual=residual, mask_out=mask_out, stream=stream, _folded=_folded)

    @keeps_current_context
    def _call(self, x, w, *, out=None, residual=None, mask_out=None, stream=None, _folded=None):
        """The general call (any array kind, any current context; errors raised here)."""
        if self._fast is not None and type(x) is self._fast[0]:
            r = self._call_torch(x, w, out, residual, mask_out, stream, _folded)
            if r is not None:
                return r
        res_op = self.chain.residual_op
        if residual is None and res_op is not None:
            residual = res_op.residual
        if res_op is None and residual is not None:
            raise ValueError("residual given but the plan's epilogue has no Add")
        if res_op is not None and residual is None:
            raise ValueError("the epilogue has an Add: pass residual= (or give it to ep.Add)")
        ctx = CallContext({"x": x, "w": w, "out": out, "residual": residual, "mask_out": mask_out}, stream)
        v = ctx.views
        self._check(v["x"], "x", self.x_shape, self.dtype)
        self._check(v["w"], "w", self.w_shape, self.dtype)
        if residual is not None:
            self._check(v["residual"], "residual", self.y_shape, self.problem.residual_dtype)
        if out is not None:
            self._check(v["out"], "out", self.y_shape, self.dtype)
            if v["out"].ptr % 16:
                raise ValueError(f"out: data pointer {v['out'].ptr:#x} is not 16-byte aligned")
            for other in ("x", "w", "residual"):
                if other in v:
                    from ._dispatch import check_no_overlap
                    check_no_overlap(v["out"], "out", v[other], other)
        want_mask = self.chain.mask
        if mask_out is not None:
            if not want_mask:
                raise ValueError("mask_out given but the epilogue has no ReLU(mask=True)")
            mo = v["mask_out"]
            if mo.dtype not in ("uint32", "int32") or mo.ndim != 1 or mo.shape[0] < self.mask_words or not mo.is_contiguous():
                raise ValueError(f"mask_out: expected a contiguous 1-D uint32/int32 array of >= {self.mask_words} "
                                 f"words, got {mo.dtype} {mo.shape}")
            from ._dispatch import check_no_overlap
            for other in ("x", "w", "residual", "out"):
                if other in v:
                    check_no_overlap(mo, "mask_out", v[other], other)
        if residual is not None and v["residual"].kind != "numpy" and v["residual"].ptr % 16:
            raise ValueError(f"residual: data pointer {v['residual'].ptr:#x} is not 16-byte aligned")
        if ctx.backend == "numpy" or self.backend == "numpy":
            return self._run_numpy(ctx, out, mask_out, _folded)
        if ctx.device_id != self.device_id:
            raise ValueError(f"tensors are on cuda:{ctx.device_id} but the plan was built for cuda:{self.device_id}")
        dx, dw = ctx.device_view("x"), ctx.device_view("w")
        if dx.ptr % 16 and self.nchw_path == "patch" and self.problem.layout == "NHWC":
            return self._copy_plan()(x, w, out=out, residual=residual, mask_out=mask_out, stream=stream,
                                     _folded=_folded or self._folded)
        launcher, spec, ws = self._launcher(dx.ptr % 16 == 0, dw.ptr % 16 == 0)
        if out is None:
            y_obj, dy = ctx.empty(self.y_shape, self.dtype)
        else:
            y_obj, dy = out, ctx.device_view("out")
        m_obj = dm = None
        if want_mask:
            if mask_out is None:
                from .relu import mask_dtype_for
                m_obj, dm = ctx.empty((self.mask_words,), mask_dtype_for(ctx.kind))
            else:
                m_obj, dm = mask_out, ctx.device_view("mask_out")
        self._launch(ctx.stream.handle, launcher, spec, ws, dx.ptr, dw.ptr, dy.ptr,
                     ctx.device_view("residual").ptr if residual is not None else 0,
                     dm.ptr if dm is not None else 0, _folded)
        if out is not None:
            ctx.copy_back("out", dy)
            y_res = out
        else:
            y_res = ctx.finish(y_obj)
        if want_mask:
            if mask_out is not None:
                ctx.copy_back("mask_out", dm)
                return y_res, mask_out
            return y_res, ctx.finish(m_obj)
        return y_res

    def _lean(self, launcher):
        """``launcher``'s lean launch record, or None: its calls take :meth:`_launch`. Lean: no separate mask
        kernel, and an argument buffer that already holds everything but the call's pointers -- its split-K
        slots and its tensor maps (which then change in one address word each) were written by an earlier
        :meth:`_launch`. The record: the driver's function, grid, block, shared memory, the slots a call
        writes (x, w, y, residual, mask; the maps' address words and offsets, -1 where there is none), and,
        for plans that prepare copies of x and w first (the NCHW transpose, the width unfold; 16-byte aligned
        x and w only), the preparation's own lean launch and the copies' addresses the conv reads instead
        (-1: the caller's tensor)."""
        rec = self._lean_recs.get(launcher)
        if rec is not None:
            return rec
        spec = next(v[1] for v in self._specs.values() if v[0] is launcher)
        if self.chain.mask and not spec.fuse_mask:
            self._lean_recs[launcher] = False              # for good: the mask is a kernel of its own
            return None
        pre, cx, cw = None, -1, -1
        if self._xpose is not None:
            prep, xs, wsc = self._xpose
            pre = prep.lean_fn(0, 0)                       # (the aligned variant)
            if pre is None:
                return None                                # not yet: a call builds it first
            cx, cw = (xs.ptr if xs is not None else -1), (wsc.ptr if wsc is not None else -1)
        maps = self._maps.get(launcher)
        if self._split_args is not launcher or (maps is not None and (maps is not self._maps_in_args
                                                                      or maps.patch is None)):
            return None                                    # not yet: _launch writes them first
        sl = self._slot
        ia, oa, ib, ob = maps.patch if maps is not None else (-1, 0, -1, 0)
        g, b = launcher.grid, launcher.block
        ib, ob = (-1, 0) if ib is None else (ib, ob)          # (a patch map has no B map)
        # the C fast launch (igemm/_fastlaunch.py) does the same slot writes and launches in one call
        fl, crec = _fastlaunch.get(), None
        if fl is not None:
            crec = _fastlaunch.pack(launcher._fn, self._args.address, int(self._args.data.ctypes.data), g, b,
                                    launcher.smem, (sl["x"], sl["w"], sl["y"], sl["residual"], sl["mask"]),
                                    (ia, oa, ib, ob), (cx, cw), pre.preps if pre is not None else ())
        rec = (launcher._launch, launcher.func, g[0], g[1], g[2], b[0], b[1], b[2], launcher.smem, sl["x"], sl["w"],
               sl["y"], sl["residual"], sl["mask"], ia, oa, ib, ob, pre, cx, cw, crec, fl.launch if crec else None)
        self._lean_recs[launcher] = rec
        return rec

    def _arm(self, crec: bytes, fl) -> None:
        """(Under the plan's lock, right after a lean launch of the aligned launcher through ``crec``.) Let
        the C call (``igemm_fastlaunch.conv``, see csrc/fastlaunch.c) run the next calls: its state tuple is
        built once; :meth:`_launch` disarms it before it writes the buffer. Not on a free-threaded Python,
        where the GIL does not make the C call's check-and-launch one step."""
        import sys
        if not getattr(sys, "_is_gil_enabled", lambda: True)():
            return
        if self._cst is None:
            T, tdt, rdt, dev, xs, ws_, ys, nb, i32, cur, di, xnb, wnb, rnb, res_op, want_mask, _, P = self._fast
            import torch

            def template(shape, dt):       # (allocation templates: torch.empty_like of a one-element tensor
                return torch.empty((1,) * len(shape), dtype=dt, device=dev).expand(shape)   # expanded: contiguous)
            self._cst = (T, tdt, rdt, i32, di, tuple(xs), tuple(ws_), tuple(ys), xnb, wnb, nb, rnb,
                         self.mask_words if want_mask else 0, None if tuple(ys) == tuple(xs) else template(ys, tdt),
                         template((self.mask_words,), i32) if want_mask else None, cur, self._armed, crec,
                         self._ctx_id, res_op, P, torch.empty_like)
            self._cfast = fl.conv
        self._armed[0] = 1

    def _launch(self, stream: int, launcher, spec, ws, x, w, y, res, mask, folded) -> None:
        # (no device() here: each Launcher makes its own context current, e.g. on a thread that never touched CUDA)
        sl = self._slot
        with self._lock:   # one plan may be called from several threads
            self._armed[0] = 0                 # the C call may not launch until a lean launch re-arms it
            if self._xpose is not None:        # NCHW transpose path: x (and w) into the plan's scratch
                prep, xs, wsc = self._xpose
                prep(stream, x, w)
                if xs is not None:
                    x = xs.ptr
                if wsc is not None:
                    w = wsc.ptr
            a = self._args
            u = a.u64
            u[sl["x"]] = x
            u[sl["w"]] = w
            u[sl["y"]] = y
            u[sl["residual"]] = res
            u[sl["mask"]] = mask
            if self._maps:
                maps = self._maps.get(launcher)
                if maps is not None:
                    if maps is self._maps_in_args and maps.patch is not None:   # only the addresses change
                        ia, oa, ib, ob = maps.patch
                        u[ia] = oa + x
                        if ib is not None:
                            u[ib] = ob + w
                    else:
                        maps.write(u, x, w, maps is not self._maps_in_args)
                        self._maps_in_args = maps
            if self._split_args is not launcher:     # split-K slots: rewritten when the launcher changes
                if ws is not None:
                    u[sl["ws"]], u[sl["counters"]] = ws[0].ptr, ws[1].ptr
                    a.i32[2 * sl["splits"]], a.i32[2 * sl["kt_per_split"]] = spec.splits, ws[2]
                else:
                    a.i32[2 * sl["splits"]], a.i32[2 * sl["kt_per_split"]] = 1, 1 << 30
                self._split_args = launcher
            if folded is not None:
                u[sl["scale"]], u[sl["shift"]], u[sl["alpha"]] = folded.ptr_args()
                a.f32[2 * sl["alpha_scalar"]] = folded.alpha_scalar
                launcher(stream, a)
                u[sl["scale"]], u[sl["shift"]], u[sl["alpha"]] = self._folded.ptr_args()
                a.f32[2 * sl["alpha_scalar"]] = self._alpha_scalar()
            else:
                launcher(stream, a)
        if mask and not spec.fuse_mask:
            from .relu import launch_mask
            launch_mask(self.device_id, _runtime.RawStream(stream), self.dtype, y, mask, self.numel_y,
                        after_kernel=True)

    def _copy_plan(self) -> "Conv2dPlan":
        """This plan on the copy path (``unfold="copy"``): a patch plan's kernel reads x through a tensor map,
        which needs a 16-byte aligned address; calls with another x run here, with this plan's folded
        epilogue vectors."""
        if self._copy is None:
            pb = self.problem
            self._copy = Conv2dPlan(self.x_shape, self.w_shape, self.dtype, self.layout, pb.stride, pb.padding,
                                    pb.dilation, epilogue=self.chain, residual_dtype=pb.residual_dtype,
                                    device=self.device_id, unfold="copy")
        return self._copy

    def _setup_fast(self) -> None:
        """The torch fast path: what a call checks, precomputed (anything unusual takes the general path,
        which raises the precise error)."""
        self._fast = None
        try:
            import torch
        except ImportError:
            return
        tdt = getattr(torch, self.dtype)
        rdt = getattr(torch, self.problem.residual_dtype) if self.problem.residual_dtype else None
        dev = torch.device("cuda", self.device_id)
        es = DTYPE_SIZES[self.dtype]
        nb = self.numel_y * es
        rnb = self.numel_y * DTYPE_SIZES[self.problem.residual_dtype] if rdt is not None else 0
        xnb, wnb = math.prod(self.x_shape) * es, math.prod(self.w_shape) * es
        api = _runtime._ctx_api()
        if not api:
            return
        fl = _fastlaunch.get()
        if fl is not None:
            ctx = fl.ctx                                   # the current context as an int, from C
        else:
            get = api[0]

            def ctx():
                c = get()[1]
                return int(c) if c is not None else 0
        self._fast = (torch.Tensor, tdt, rdt, dev, torch.Size(self.x_shape), torch.Size(self.w_shape),
                      torch.Size(self.y_shape), nb, torch.int32, torch._C._cuda_getCurrentRawStream,
                      self.device_id, xnb, wnb, rnb, self.chain.residual_op, self.chain.mask, ctx,
                      torch.nn.Parameter)        # (w is usually a module's Parameter: as good as a Tensor here)

    def _call_torch(self, x, w, out, residual, mask_out, stream, folded, ctx_current=False):
        # checked with ints and cached sizes (tensor.device builds an object per access; the plan fixes
        # every shape, so byte extents for the overlap checks are constants). ctx_current: the plan's context
        # is the current one (the lean launch may run).
        T, tdt, rdt, dev, xs, ws_, ys, nb, i32, cur, di, xnb, wnb, rnb, res_op, want_mask, _, P = self._fast
        if ((type(w) is not T and type(w) is not P) or x.dtype is not tdt or w.dtype is not tdt or x.get_device() != di
                or w.get_device() != di or x.shape != xs or w.shape != ws_ or not x.is_contiguous()
                or not w.is_contiguous()):
            return None
        if residual is None and res_op is not None:
            residual = res_op.residual
        if (residual is None) != (res_op is None):
            return None
        rp = 0
        if residual is not None:
            if (type(residual) is not T or residual.dtype is not rdt or residual.get_device() != di
                    or residual.shape != ys or not residual.is_contiguous()):
                return None
            rp = residual.data_ptr()
            if rp % 16:
                return None
        xp, wp = x.data_ptr(), w.data_ptr()
        if xp % 16 and self.nchw_path == "patch" and self.problem.layout == "NHWC":
            return None                        # (the general path hands it to the copy plan)
        if out is None:
            out = torch_empty(ys, tdt, dev)
            yp = out.data_ptr()
        else:
            if (type(out) is not T or out.dtype is not tdt or out.get_device() != di or out.shape != ys
                    or not out.is_contiguous()):
                return None
            yp = out.data_ptr()
            if yp % 16 or (not _apart(yp, nb, xp, xnb, wp, wnb, rp, rnb) if rp else
                           (xp < yp + nb and yp < xp + xnb) or (wp < yp + nb and yp < wp + wnb)):
                return None
        mp = 0
        if want_mask:
            if mask_out is None:
                mask_out = torch_empty((self.mask_words,), i32, dev)
            elif (type(mask_out) is not T or mask_out.dtype is not i32 or mask_out.get_device() != di
                  or mask_out.dim() != 1 or mask_out.shape[0] < self.mask_words or not mask_out.is_contiguous()):
                return None
            mp = mask_out.data_ptr()
            if not _apart(mp, self.mask_words * 4, xp, xnb, wp, wnb, rp, rnb, yp, nb):
                return None
        elif mask_out is not None:
            return None
        launcher, spec, wsp = ((self._specs.get((True, True)) if not (xp | wp) & 15 else
                                self._specs.get((xp % 16 == 0, wp % 16 == 0)))
                               or self._launcher(xp % 16 == 0, wp % 16 == 0))
        h = cur(di) if stream is None else _runtime.stream_handle(stream, "torch", di)
        if ctx_current and folded is None:
            # the lean launch (see _lean), inline: this is most of a call's host time after the driver's
            rec = self._lean_recs.get(launcher)
            if rec is None:
                rec = self._lean(launcher)
            if rec and (rec[18] is None or not (xp | wp) & 15):
                with self._lock:
                    if self._split_args is launcher and (rec[14] < 0 or self._maps_in_args is self._maps[launcher]):
                        crec = rec[21]
                        if crec is not None:             # in C: the slot writes below and the launches
                            err = rec[22](crec, h, xp, wp, yp, rp, mp)
                            if err:
                                raise _kernel.launch_error(err)
                            if launcher is self._aligned and not self._armed[0]:
                                self._arm(crec, rec[22].__self__)
                            return (out, mask_out) if want_mask else out
                        (launch, fn, g0, g1, g2, b0, b1, b2, smem, sx, sw, sy, sr, sm, ia, oa, ib, ob, pre, cx,
                         cw) = rec[:21]
                        u = self._u64
                        cs = _CU_STREAMS.get(h) or _kernel._cu_stream(h)
                        if pre is not None:              # the copies of x and w the kernel reads
                            pre(cs, xp, wp)
                            if cx >= 0:
                                xp = cx
                            if cw >= 0:
                                wp = cw
                        u[sx] = xp
                        u[sw] = wp
                        u[sy] = yp
                        u[sr] = rp
                        u[sm] = mp
                        if ia >= 0:
                            u[ia] = oa + xp
                            if ib >= 0:
                                u[ib] = ob + wp
                        (err,) = launch(fn, g0, g1, g2, b0, b1, b2, smem, cs, self._args.address, 0)
                        if err:
                            raise _kernel.launch_error(err)
                        return (out, mask_out) if want_mask else out
        self._launch(h, launcher, spec, wsp, xp, wp, yp, rp, mp, folded)
        return (out, mask_out) if want_mask else out

    def _check(self, t: Tensor, name: str, shape, dtype) -> None:
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} ({self.layout}), got {tuple(t.shape)}")
        if t.dtype != dtype:
            raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous in {self.layout} order (shape {t.shape}, strides "
                             f"{t.strides}); call .contiguous() first")

    def _run_numpy(self, ctx, out, mask_out, folded=None):
        from .reference.epilogue import apply_chain
        v = ctx.views
        pb = self.problem
        x = np.asarray(v["x"].obj)
        w = np.asarray(v["w"].obj)
        pre = reference.conv2d_direct(x.astype(np.float64), w.astype(np.float64), pb.stride, pb.padding,
                                      pb.dilation, self.layout)
        res = np.asarray(v["residual"].obj).astype(np.float64) if "residual" in v else None
        chain = folded.chain if folded is not None else self.chain
        y64 = apply_chain(pre, chain, self.layout, residual=res)
        y = y64.astype(x.dtype)
        if out is not None:
            np.asarray(out)[...] = y
            y = out
        if self.chain.mask:
            m = reference.pack_mask(np.asarray(y, dtype=np.float64) > 0)
            if mask_out is not None:
                np.asarray(mask_out).view(np.uint32)[:m.size] = m
                m = mask_out
            return y, m
        return y

    def __repr__(self) -> str:
        pb = self.problem
        path = f", nchw_path={self.nchw_path!r}" if self.nchw_path == "transpose" else ""
        if self.nchw_path == "unfold":
            path += f", unfolded to {self.kproblem.C} channels"
        elif self.nchw_path == "patch":
            path += f", unfolded to {self.kproblem.Kred // self.kproblem.R} channels in shared memory"
        elif self.kproblem.C != pb.C:
            path += f", channels padded to {self.kproblem.C}"
        return (f"Conv2dPlan(x={self.x_shape}, w={self.w_shape}, {self.dtype}, {self.layout}, stride={pb.stride}, "
                f"padding={pb.padding}, dilation={pb.dilation}, epilogue={self.chain!r}{path})")


class _TwoPreps:
    """Two input preparations in a row, called as one (``prep(stream, x, w)``): the NCHW patch path's
    transpose of x (job 0 of a :class:`~igemm._transpose.Prepared`) and unfold of w."""

    __slots__ = ("first", "second")

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __call__(self, stream: int, x: int, w: int) -> None:
        self.first(stream, x, 0)
        self.second(stream, 0, w)

    def lean_fn(self, x: int = 0, w: int = 0):
        f1, f2 = self.first.lean_fn(x, 0), self.second.lean_fn(0, w)
        if f1 is None or f2 is None:
            return None

        def f(cs, x: int, w: int) -> None:
            f1(cs, x, 0)
            f2(cs, 0, w)
        f.preps = [f1.preps[0][:8] + (1, 0), f2.preps[0][:8] + (0, 2)]     # (fast-launch record entries)
        return f


# ------------------------------------------------------------------------------------------ functions
_PLAN_CACHE: OrderedDict = OrderedDict()
_PLAN_CACHE_SIZE = 256


def _plan_for(xt: Tensor, wt: Tensor, layout, stride, padding, dilation, chain, precision, residual, device_id):
    if xt.dtype not in _DTYPES:
        raise TypeError(f"x: dtype {xt.dtype} is not supported (expected float16, bfloat16 or float32)")
    if wt.dtype != xt.dtype:
        raise TypeError(f"w: dtype {wt.dtype} differs from x's {xt.dtype}")
    res_dtype = as_tensor(residual, "residual").dtype if residual is not None else None
    key = (xt.shape, wt.shape, xt.dtype, layout, stride, padding, dilation, chain.signature(), precision,
           res_dtype, device_id)
    plan = _PLAN_CACHE.get(key)
    if plan is not None:
        _PLAN_CACHE.move_to_end(key)
        return plan
    from .epilogues import Chain
    # the cached plan holds the structure only; vectors are folded per call (see conv2d)
    skeleton = Chain(tuple(_skeleton(o) for o in chain.ops))
    plan = Conv2dPlan(xt.shape, wt.shape, xt.dtype, layout, stride, padding, dilation, skeleton, precision,
                      res_dtype, device_id, _skeleton=True)
    _PLAN_CACHE[key] = plan
    while len(_PLAN_CACHE) > _PLAN_CACHE_SIZE:
        _PLAN_CACHE.popitem(last=False)
    return plan


def _skeleton(op):
    """The op with its tensors dropped: what a cached plan keeps of an epilogue."""
    from . import epilogues as ep
    if isinstance(op, ep.BatchNorm):
        return ep.BatchNorm(None, None, None, None, op.eps)
    if isinstance(op, ep.Bias):
        return ep.Bias(None)
    if isinstance(op, ep.Add):
        return ep.Add(None)
    if isinstance(op, ep.PReLU):
        return ep.PReLU(op.alpha if not op.per_channel else _PerChannel())
    return op


class _PerChannel:
    """Placeholder for a per-channel PReLU alpha in a cached plan's skeleton chain."""


@keeps_current_context
def conv2d(x, w, stride=1, padding=0, dilation=1, *, layout: str = "NCHW", epilogue=None, residual=None,
           out=None, mask_out=None, precision: str = "strict", stream=None):
    """2-D convolution (cross-correlation, as ``torch.nn.functional.conv2d``) by implicit GEMM.

    Args:
        x: ``(N, C, H, W)`` (NCHW) or ``(N, H, W, C)`` (NHWC): torch/cupy/jax CUDA tensor or numpy array.
        w: ``(K, C, R, S)`` (NCHW) or ``(K, R, S, C)`` (NHWC), same dtype as x (fp16, bf16 or fp32).
        stride, padding, dilation: int or pair.
        layout: ``"NCHW"`` or ``"NHWC"`` (x, w and y alike). y is always written in ``layout`` by the
            kernel's epilogue; 16-bit NCHW inputs with C % 8 == 0 are first copied to NHWC by one extra
            kernel, which measured faster end to end than gathering them
            in place (see :class:`Conv2dPlan`'s ``nchw_path`` to choose).
        epilogue: ``igemm.epilogues`` op or chain fused into the store (BatchNorm, Bias, Add, ReLU, PReLU).
        residual: input of an ``Add`` in the chain (else the one given to ``ep.Add``).
        out, mask_out: preallocated outputs. precision: fp32 ``"strict"`` (default) or ``"tf32"``.
        stream: CUDA stream (default: the framework's current stream).

    Returns:
        ``y`` (the inputs' framework), or ``(y, mask)`` when the chain ends in ``ReLU(mask=True)``.

    >>> import numpy as np, igemm
    >>> x = np.random.default_rng(0).standard_normal((1, 2, 5, 5)).astype(np.float32)
    >>> w = np.ones((3, 2, 3, 3), np.float32)
    >>> igemm.conv2d(x, w, padding=1).shape
    (1, 3, 5, 5)
    """
    fast = _FAST_T is not None and type(x) is _FAST_T and epilogue is None and residual is None and mask_out is None
    if fast:
        # a repeated plain call on torch tensors: the cached plan checks what it relies on itself
        # (types, dtypes, devices, shapes, contiguity, alignment, overlap) and falls back when unsure
        try:
            key = (x.shape, w.shape, x.dtype, x.device, layout, stride, padding, dilation, precision)
            plan = _FAST_PLANS.get(key)
        except TypeError:                       # unhashable stride/padding/dilation: the general path
            fast, plan = False, None
        if plan is not None:
            r = plan._call_torch(x, w, out, None, None, stream, None)
            if r is not None:
                return r
    chain = _as_epilogue(epilogue)
    xt, wt = as_tensor(x, "x"), as_tensor(w, "w")
    device_id = None if (xt.kind == "numpy" and _runtime.get_backend() == "numpy") else max(xt.device_id, 0)
    if len(wt.shape) == 4:
        chain.validate(wt.shape[0])
    if residual is None and chain.residual_op is not None:
        residual = chain.residual_op.residual
    plan = _plan_for(xt, wt, layout, pair(stride, "stride"), pair(padding, "padding"), pair(dilation, "dilation"),
                     chain, precision, residual, device_id)
    folded = None
    if chain.affine_ops or chain.prelu_op:
        # fold on the launch stream, so the vectors are ordered before the kernel that reads them
        sh = _runtime.stream_handle(stream, xt.kind, device_id) if device_id is not None else 0
        folded = _Folded(chain, plan.problem.K, device_id, sh)
    if folded is not None:
        folded.chain = chain
    y = plan(x, w, out=out, residual=residual, mask_out=mask_out, stream=stream, _folded=folded)
    if xt.kind == "torch" and plan._fast is not None and not chain.ops and residual is None and mask_out is None:
        _remember_fast(x, plan, (x.shape, w.shape, x.dtype, x.device, layout, stride, padding, dilation, precision))
    return y


_FAST_T = None            # torch.Tensor, once a plain torch call has been seen
_FAST_PLANS: dict = {}


def _remember_fast(x, plan, key) -> None:
    global _FAST_T
    try:
        hash(key)
    except TypeError:
        return
    _FAST_T = plan._fast[0]
    if len(_FAST_PLANS) >= _PLAN_CACHE_SIZE:
        _FAST_PLANS.clear()
    _FAST_PLANS[key] = plan


@keeps_current_context
def conv2d_bn_relu(x, w, gamma, beta, mean, var, eps: float = 1e-5, stride=1, padding=0, dilation=1, *,
                   layout: str = "NCHW", residual=None, return_mask: bool = False, out=None,
                   precision: str = "strict", stream=None):
    """``relu(batch_norm(conv2d(x, w)) [+ residual])`` in one kernel (inference BatchNorm).

    Returns ``y``, or ``(y, mask)`` with ``return_mask=True`` (for :func:`igemm.relu_backward`).
    """
    from . import epilogues as ep
    ops = [ep.BatchNorm(gamma, beta, mean, var, eps)]
    if residual is not None:
        ops.append(ep.Add())
    ops.append(ep.ReLU(mask=return_mask))
    return conv2d(x, w, stride, padding, dilation, layout=layout, epilogue=ep.chain(*ops), residual=residual,
                  out=out, precision=precision, stream=stream)
