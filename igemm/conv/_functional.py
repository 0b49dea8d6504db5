"""The function forms ``conv2d`` and ``conv2d_bn_relu``: a plan from an LRU cache (keyed by the problem and the
chain's structure), the call's own epilogue vectors folded at every call."""
from __future__ import annotations

import weakref
from collections import OrderedDict

from .. import _runtime
from .._runtime import as_tensor, keeps_current_context
from .._runtime import current_context as _current_context
from ._launch import DerivedCache, FoldedVectors
from ._plan import Conv2dPlan, as_epilogue
from ._problem import DTYPES, geometry, pair

__all__ = ["conv2d", "conv2d_bn_relu"]

_PLANS: OrderedDict = OrderedDict()
_CACHE_SIZE = 256


def _plan_for(xt, wt, layout, stride, padding, dilation, chain, precision, residual, device_id) -> Conv2dPlan:
    if xt.dtype not in DTYPES:
        raise TypeError(f"x: dtype {xt.dtype} is not supported (expected float16, bfloat16 or float32)")
    if wt.dtype != xt.dtype:
        raise TypeError(f"w: dtype {wt.dtype} differs from x's {xt.dtype}")
    res_dtype = as_tensor(residual, "residual").dtype if residual is not None else None
    if res_dtype is not None and res_dtype not in DTYPES:
        raise TypeError(f"residual: dtype {res_dtype} is not supported (expected float16, bfloat16 or float32)")
    key = (tuple(xt.shape), tuple(wt.shape), xt.dtype, layout, stride, padding, dilation, chain.signature(),
           precision, res_dtype, device_id)
    plan = _PLANS.get(key)
    if plan is not None:
        _PLANS.move_to_end(key)
        return plan
    geometry(xt.shape, wt.shape, layout, stride, padding, dilation, names=("x", "w"))   # (errors name the arrays)
    # the cached plan holds the structure only; the call's vectors are folded per call
    plan = Conv2dPlan(xt.shape, wt.shape, xt.dtype, layout, stride, padding, dilation, chain.skeleton(), precision,
                      res_dtype if chain.residual_op is not None else None,
                      device_id if device_id is not None else "numpy", _skeleton=True)
    _PLANS[key] = plan
    while len(_PLANS) > _CACHE_SIZE:
        _PLANS.popitem(last=False)
    return plan


def _padding_arg(padding, w, layout: str, stride, dilation):
    """``padding`` as PyTorch takes it (an int, a pair, ``"valid"``, ``"same"``) as a symmetric pair."""
    if not isinstance(padding, str):
        return padding
    if padding == "valid":
        return 0
    if padding != "same":
        raise ValueError(f"padding: expected an int, a pair, 'same' or 'valid', got {padding!r}")
    if pair(stride, "stride") != (1, 1):
        raise ValueError("padding: 'same' is not supported for strided convolutions (as in PyTorch)")
    shape = tuple(as_tensor(w, "w").shape)
    if len(shape) != 4:
        return 0                                  # (the geometry check names w's shape)
    rs = shape[2:] if layout == "NCHW" else shape[1:3]
    tot = [d * (k - 1) for d, k in zip(pair(dilation, "dilation"), rs)]
    if any(t % 2 for t in tot):
        raise NotImplementedError(f"padding: 'same' for a {rs[0]}x{rs[1]} kernel (dilation {dilation}) pads one side "
                                  f"more than the other; igemm pads symmetrically")
    return tot[0] // 2, tot[1] // 2


def _channels_last(x) -> bool:
    """A 4-D (N, C, H, W) torch, numpy or CuPy array whose memory is NHWC (torch's channels_last), and not also
    contiguous."""
    if type(x).__module__.startswith("torch"):
        if x.dim() != 4 or x.is_contiguous():
            return False
        import torch
        return x.is_contiguous(memory_format=torch.channels_last)
    flags = getattr(x, "flags", None)
    return (flags is not None and getattr(x, "ndim", 0) == 4 and not flags.c_contiguous
            and x.transpose(0, 2, 3, 1).flags.c_contiguous)


def _permute(t, axes):
    return t.permute(*axes) if hasattr(t, "permute") else t.transpose(axes)


def _nhwc_view(t, name: str, copy: bool = True):
    v = _permute(t, (0, 2, 3, 1))
    if (v.is_contiguous() if hasattr(v, "is_contiguous") else v.flags.c_contiguous):
        return v
    if not copy:
        raise ValueError(f"{name}: x is channels_last, so {name} must be a channels_last (N, C, H, W) array too")
    return v.contiguous() if hasattr(v, "contiguous") else v.copy()        # (numpy, CuPy: copy() is C order)


def _conv2d_channels_last(x, w, stride, padding, dilation, bias, chain, residual, out, mask_out, precision, stream):
    """layout="NCHW" on channels_last arrays: the NHWC kernel on their NHWC memory (views, no copy of x), the
    output channels_last too."""
    res_op = chain.residual_op
    if residual is None and res_op is not None:
        residual = res_op.residual
    r = conv2d(_permute(x, (0, 2, 3, 1)), _nhwc_view(w, "w"), stride, padding, dilation, bias=bias, layout="NHWC",
               epilogue=chain, residual=_nhwc_view(residual, "residual") if residual is not None else None,
               out=_nhwc_view(out, "out", copy=False) if out is not None else None, mask_out=mask_out,
               precision=precision, stream=stream)
    y, m = r if isinstance(r, tuple) else (r, None)
    y = out if out is not None else _permute(y, (0, 3, 1, 2))
    return (y, m) if isinstance(r, tuple) else y


def conv2d(x, w, stride=1, padding=0, dilation=1, *, bias=None, groups: int = 1, layout: str = "NCHW",
           epilogue=None, residual=None, out=None, mask_out=None, precision: str = "strict", stream=None):
    """2-D convolution (cross-correlation, as ``torch.nn.functional.conv2d``) by implicit GEMM.

    Args:
        x: ``(N, C, H, W)`` (NCHW) or ``(N, H, W, C)`` (NHWC): torch/cupy/jax CUDA tensor or numpy array. An x
            with layout ``"NCHW"`` whose memory is NHWC (torch ``channels_last``; numpy/CuPy strides alike) runs
            the NHWC kernel on it (no copy); y is channels_last too (w and residual are read as channels_last,
            copied if they are not; ``out`` must be).
        w: ``(K, C, R, S)`` (NCHW) or ``(K, R, S, C)`` (NHWC), same dtype as x (fp16, bf16 or fp32).
        stride, dilation: int or pair. padding: int, pair, ``"valid"`` or ``"same"`` (stride 1, symmetric).
        bias: per-output-channel vector added before the epilogue (as ``torch.nn.functional.conv2d``'s).
        groups: 1 (other values raise ``NotImplementedError``).
        layout: ``"NCHW"`` or ``"NHWC"`` (x, w and y alike).
        epilogue: ``igemm.epilogues`` op or chain fused into the store (BatchNorm, Bias, Add, ReLU, PReLU); its
            vectors are read at every call.
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
    if (type(x) is _TORCH_TENSOR and epilogue is None and residual is None and mask_out is None and bias is None
            and groups == 1 and x.is_contiguous()):
        # a repeated plain call on torch tensors: the cached plan checks what it relies on itself and falls
        # back to its general path, which raises the precise error (docs/performance.md: host-conv2d-fast-path)
        try:
            plan = _TORCH_PLANS.get((x.shape, w.shape, x.dtype, x.device, layout, stride, padding, dilation,
                                     precision))
        except TypeError:           # (an unhashable stride, padding or dilation: the general path)
            plan = None
        if plan is not None:
            if out is None and stream is None:
                r = plan._fresh(x, w, None)
                if r is not None:
                    return r
            return plan.run(x, w, out, None, None, stream)      # (its general path keeps the current context)
    return _conv2d(x, w, stride, padding, dilation, bias, groups, layout, epilogue, residual, out, mask_out,
                   precision, stream)


@keeps_current_context
def _conv2d(x, w, stride, padding, dilation, bias, groups, layout, epilogue, residual, out, mask_out, precision,
            stream):
    """conv2d's general path: any array kind and arguments, every argument checked before any launch."""
    for name, a in (("x", x), ("w", w)):
        if a is None:
            raise TypeError(f"{name}: expected an array, got None")
    if isinstance(groups, bool) or not isinstance(groups, int):
        raise TypeError(f"groups: expected an int, got {groups!r}")
    if groups != 1:
        raise NotImplementedError(f"groups: igemm runs groups=1 convolutions, got groups={groups}")
    padding = _padding_arg(padding, w, layout, stride, dilation)
    chain = as_epilogue(epilogue)
    if layout == "NCHW" and _channels_last(x):
        return _conv2d_channels_last(x, w, stride, padding, dilation, bias, chain, residual, out, mask_out,
                                     precision, stream)
    if bias is not None:
        from ..epilogues import Bias, chain as make_chain
        chain = make_chain(Bias(bias), *chain.ops)
    xt, wt = as_tensor(x, "x"), as_tensor(w, "w")
    host = xt.kind == "numpy"
    device_id = None if (host and _runtime.get_backend() == "numpy") else max(xt.device_id, 0)
    if len(wt.shape) == 4:
        chain.validate(wt.shape[0])
    if residual is None and chain.residual_op is not None:
        residual = chain.residual_op.residual
    if residual is not None and chain.residual_op is None:
        raise ValueError("residual: given, but the epilogue has no Add")
    plan = _plan_for(xt, wt, layout, pair(stride, "stride"), pair(padding, "padding"), pair(dilation, "dilation"),
                     chain, precision, residual, device_id)
    if xt.kind == "torch" and not chain.ops and residual is None and mask_out is None:
        _remember(x, w, plan, (layout, stride, padding, dilation, precision))
    folded = None
    if device_id is not None and (chain.affine_ops or chain.prelu_op):
        # fold on the launch stream, so the vectors are ordered before the kernel that reads them
        sh = _runtime.stream_handle(stream, xt.kind, device_id)
        K = plan.problem.K
        if xt.kind == "torch" and chain.torch_foldable():
            # torch vectors: folded again only when one is replaced or updated (docs/performance.md: nn-fold-cache)
            ops = [o for o in chain.ops if o.affine or o is chain.prelu_op]
            tag = (sh, K, tuple((type(o).__name__, getattr(o, "eps", None),
                                 o.alpha if o is chain.prelu_op and not o.per_channel else None) for o in ops))
            folded = _FOLDS.get(tag, tuple(a for o in ops for a in o.arrays().values()),
                                lambda: FoldedVectors(chain, K, device_id, sh, snapshot=False))
        else:
            folded = FoldedVectors(chain, K, device_id, sh, snapshot=False)   # (read at this call)
    return plan.run(x, w, out, residual, mask_out, stream, chain, folded)


_FOLDS = DerivedCache()


_TORCH_TENSOR = None        # torch.Tensor, once a torch call has been seen
_TORCH_PLANS: dict = {}


def _remember(x, w, plan: Conv2dPlan, args: tuple) -> None:
    global _TORCH_TENSOR
    key = (x.shape, w.shape, x.dtype, x.device, *args)
    try:
        hash(key)
    except TypeError:
        return
    import torch
    _TORCH_TENSOR = torch.Tensor
    if len(_TORCH_PLANS) >= _CACHE_SIZE:
        _TORCH_PLANS.clear()
    _TORCH_PLANS[key] = plan


def conv2d_bn_relu(x, w, gamma, beta, mean, var, eps: float = 1e-5, stride=1, padding=0, dilation=1, *,
                   layout: str = "NCHW", residual=None, return_mask: bool = False, out=None,
                   precision: str = "strict", stream=None):
    """``relu(batch_norm(conv2d(x, w)) [+ residual])`` in one kernel (inference BatchNorm).

    Returns ``y``, or ``(y, mask)`` with ``return_mask=True`` (for :func:`igemm.relu_backward`). A repeated call
    on torch tensors reuses its plan and, while gamma, beta, mean and var are the same tensors at the same
    versions, their fold (docs/performance.md: nn-fold-cache).
    """
    T = _TORCH_TENSOR
    if (type(x) is T and out is None and stream is None and type(gamma) is T and type(beta) is T
            and type(mean) is T and type(var) is T):
        key = (x.shape, w.shape, x.dtype, x.get_device(), layout, stride, padding, dilation, eps, precision,
               return_mask, None if residual is None else getattr(residual, "dtype", None))
        try:
            e = _BN_PLANS.get(key)
        except TypeError:           # (an unhashable argument: the general path)
            e = None
        if e is not None and x.is_contiguous() and e.ctx == _current_context():
            # (in line, no helper frames: docs/performance.md: host-function-fresh)
            t = e.t
            sh, f = t.stream_of(e.dev), e.last.get(id(gamma))
            if (f is not None and f[0] == sh and f[1]() is gamma and f[2]() is beta and f[3]() is mean
                    and f[4]() is var and f[5] == (gamma._version, beta._version, mean._version, var._version)):
                folded = f[6]
            else:
                folded = e.fold(gamma, beta, mean, var, eps, sh)
            r = t.fresh(x, w) if residual is None else None
            if r is None:               # (a residual, or a w the plan takes otherwise: its own checks)
                return e.plan.run(x, w, None, residual, None, None, None, folded)
            y, m, xp, wp, yp, _, mp = r
            e.plan._launch(sh, not xp & 15, not wp & 15, xp, wp, yp, 0, mp, folded, False)
            return (y, m) if m is not None else y
    return _conv2d_bn_relu(x, w, gamma, beta, mean, var, eps, stride, padding, dilation, layout, residual,
                           return_mask, out, precision, stream)


@keeps_current_context
def _conv2d_bn_relu(x, w, gamma, beta, mean, var, eps, stride, padding, dilation, layout, residual, return_mask,
                    out, precision, stream):
    """conv2d_bn_relu's general path (every argument checked); remembers the plan for the repeated-call path."""
    chain = _bn_chain(gamma, beta, mean, var, eps, residual is not None, return_mask)
    r = _conv2d(x, w, stride, padding, dilation, None, 1, layout, chain, residual, out, None, precision, stream)
    if type(x).__module__ == "torch" and type(x).__name__ == "Tensor" and x.is_contiguous():
        _remember_bn(x, w, layout, stride, padding, dilation, chain, precision, residual, key_args=(
            eps, precision, return_mask, None if residual is None else getattr(residual, "dtype", None)))
    return r


_BN_PLANS: dict = {}


class _BnEntry:
    """A repeated conv2d_bn_relu call's plan and, by gamma's id, the last fold of each set of BN vectors it ran with
    (stream, weak references to gamma, beta, mean and var, their versions, the folded vectors), checked in line: a
    hit of the shared fold cache costs more host time (docs/performance.md: host-bn-repeat)."""

    __slots__ = ("plan", "last", "t", "ctx", "dev")

    def __init__(self, plan):
        self.plan, self.last, self.t, self.dev = plan, {}, plan._torch, plan.device_id
        self.ctx = plan._ctx_id if plan._torch is not None else None     # (None: no repeated-call path)

    @keeps_current_context
    def fold(self, gamma, beta, mean, var, eps, sh: int) -> FoldedVectors:
        """The fold cache's value (made on a miss), kept as the last fold unless made inside a graph capture."""
        plan = self.plan
        K = plan.problem.K
        folded = _FOLDS.get((sh, K, (("BatchNorm", eps, None),)), (gamma, beta, mean, var),
                            lambda: _bn_fold(gamma, beta, mean, var, eps, K, plan.device_id, sh))
        import torch
        if not torch.cuda.is_current_stream_capturing():
            if len(self.last) >= 64:
                self.last.clear()
            self.last[id(gamma)] = (sh, *map(weakref.ref, (gamma, beta, mean, var)),
                                    (gamma._version, beta._version, mean._version, var._version), folded)
        return folded


def _bn_chain(gamma, beta, mean, var, eps, add: bool, mask: bool):
    from .. import epilogues as ep
    ops = [ep.BatchNorm(gamma, beta, mean, var, eps)] + ([ep.Add()] if add else []) + [ep.ReLU(mask=mask)]
    return ep.chain(*ops)


def _bn_fold(gamma, beta, mean, var, eps, K: int, device_id: int, sh: int) -> FoldedVectors:
    """(a fold-cache miss of the repeated-call path: other vectors, or updated ones) checked, then folded."""
    c = _bn_chain(gamma, beta, mean, var, eps, False, False)
    c.validate(K)
    return FoldedVectors(c, K, device_id, sh, snapshot=False)


def _remember_bn(x, w, layout, stride, padding, dilation, chain, precision, residual, key_args) -> None:
    """The plan the general call used, for the repeated-call path of conv2d_bn_relu."""
    global _TORCH_TENSOR
    _TORCH_TENSOR = type(x)
    xt, wt = as_tensor(x, "x"), as_tensor(w, "w")
    try:
        plan = _plan_for(xt, wt, layout, pair(stride, "stride"), pair(_padding_arg(padding, w, layout, stride,
                         dilation), "padding"), pair(dilation, "dilation"), chain, precision, residual, xt.device_id)
        key = (x.shape, w.shape, x.dtype, x.get_device(), layout, stride, padding, dilation, *key_args)
        hash(key)
    except (TypeError, ValueError):
        return
    if len(_BN_PLANS) >= _CACHE_SIZE:
        _BN_PLANS.clear()
    _BN_PLANS[key] = _BnEntry(plan)
