"""The function forms ``conv2d`` and ``conv2d_bn_relu``: a plan from an LRU cache (keyed by the problem and the
chain's structure), the call's own epilogue vectors folded at every call."""
from __future__ import annotations

from collections import OrderedDict

from .. import _runtime
from .._runtime import as_tensor, keeps_current_context
from ._launch import FoldedVectors
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


@keeps_current_context
def conv2d(x, w, stride=1, padding=0, dilation=1, *, layout: str = "NCHW", epilogue=None, residual=None,
           out=None, mask_out=None, precision: str = "strict", stream=None):
    """2-D convolution (cross-correlation, as ``torch.nn.functional.conv2d``) by implicit GEMM.

    Args:
        x: ``(N, C, H, W)`` (NCHW) or ``(N, H, W, C)`` (NHWC): torch/cupy/jax CUDA tensor or numpy array.
        w: ``(K, C, R, S)`` (NCHW) or ``(K, R, S, C)`` (NHWC), same dtype as x (fp16, bf16 or fp32).
        stride, padding, dilation: int or pair.
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
    if type(x) is _TORCH_TENSOR and epilogue is None and residual is None and mask_out is None:
        # a repeated plain call on torch tensors: the cached plan checks what it relies on itself and falls
        # back to its general path, which raises the precise error (docs/performance.md: host-conv2d-fast-path)
        try:
            plan = _TORCH_PLANS.get((x.shape, w.shape, x.dtype, x.device, layout, stride, padding, dilation,
                                     precision))
        except TypeError:           # (an unhashable stride, padding or dilation: the general path)
            plan = None
        if plan is not None:
            return plan.run(x, w, out, None, None, stream)
    for name, a in (("x", x), ("w", w)):
        if a is None:
            raise TypeError(f"{name}: expected an array, got None")
    chain = as_epilogue(epilogue)
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
        folded = FoldedVectors(chain, plan.problem.K, device_id, sh, snapshot=False)   # (read at this call)
    return plan.run(x, w, out, residual, mask_out, stream, chain, folded)


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


@keeps_current_context
def conv2d_bn_relu(x, w, gamma, beta, mean, var, eps: float = 1e-5, stride=1, padding=0, dilation=1, *,
                   layout: str = "NCHW", residual=None, return_mask: bool = False, out=None,
                   precision: str = "strict", stream=None):
    """``relu(batch_norm(conv2d(x, w)) [+ residual])`` in one kernel (inference BatchNorm).

    Returns ``y``, or ``(y, mask)`` with ``return_mask=True`` (for :func:`igemm.relu_backward`).
    """
    from .. import epilogues as ep
    ops = [ep.BatchNorm(gamma, beta, mean, var, eps)]
    if residual is not None:
        ops.append(ep.Add())
    ops.append(ep.ReLU(mask=return_mask))
    return conv2d(x, w, stride, padding, dilation, layout=layout, epilogue=ep.chain(*ops), residual=residual,
                  out=out, precision=precision, stream=stream)
