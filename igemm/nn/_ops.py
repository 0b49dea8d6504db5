"""igemm's convolution as a PyTorch custom op, ``torch.ops.igemm.conv2d`` (namespace ``igemm``), with a fake
(meta) implementation, so that ``torch.compile(fullgraph=True)`` traces it, ``torch.export`` exports it and CUDA
graphs capture it.

``conv2d(x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps, residual, stride, padding, dilation, relu)``
is ``relu?(bn?(conv2d(x, weight) + bias) + residual?)`` with inference BatchNorm. On CUDA it is one igemm kernel:
a plan per problem (cached), the BN and bias folded into fp32 ``scale``/``shift`` vectors that are cached by
the tensors' identity and version counters (an in-place update of any of them is seen at the next call) and
passed per call. A channels_last x (NHWC memory) runs the NHWC kernel on it without a copy and gives a
channels_last output; any other x runs the NCHW kernel on ``x.contiguous()``. On the CPU (and for the fake
implementation's semantics) the same result from PyTorch ops.

Registered with ``torch.library.Library.define``/``impl`` (a lower per-call cost than ``@custom_op``:
docs/performance.md: nn-op-registration).
"""
from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.functional as F

from .. import _runtime
from ..conv._launch import DerivedCache

__all__ = ["conv2d", "precompile", "SCHEMA", "supported"]

SCHEMA = ("conv2d(Tensor x, Tensor weight, Tensor? bias, Tensor? bn_weight, Tensor? bn_bias, Tensor? bn_mean, "
          "Tensor? bn_var, float eps, Tensor? residual, int[2] stride, int[2] padding, int[2] dilation, "
          "bool relu) -> Tensor")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CL = torch.channels_last

_lib = torch.library.Library("igemm", "DEF")
_lib.define(SCHEMA)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the CUDA kernel runs this call (else the op's PyTorch implementation does)."""
    return x.is_cuda and x.dtype in _DTYPES and weight.dtype == x.dtype and x.dim() == 4 and weight.dim() == 4


def _nhwc(x: torch.Tensor) -> bool:
    """x's memory is channels_last (and not also plain contiguous: then NCHW, as PyTorch suggests)."""
    return not x.is_contiguous() and x.is_contiguous(memory_format=_CL)


def _out_size(x, weight, stride, padding, dilation) -> tuple:
    N, _, H, W = x.shape
    K, _, R, S = weight.shape
    P = (H + 2 * padding[0] - dilation[0] * (R - 1) - 1) // stride[0] + 1
    Q = (W + 2 * padding[1] - dilation[1] * (S - 1) - 1) // stride[1] + 1
    return N, K, P, Q


def _check(x, weight, bias, bn, residual, stride, padding, dilation) -> None:
    """The op's arguments, named (before any launch); the plan checks the rest against the problem."""
    if x.dim() != 4:
        raise ValueError(f"x: expected a 4-D (N, C, H, W) tensor, got {x.dim()}-D shape {tuple(x.shape)}")
    if weight.dim() != 4:
        raise ValueError(f"weight: expected a 4-D (K, C, R, S) tensor, got shape {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[1]:
        raise NotImplementedError(f"weight: {weight.shape[1]} input channels for x's {x.shape[1]}: igemm runs "
                                  f"groups=1 convolutions only")
    K = weight.shape[0]
    for name, v in (("bias", bias), *zip(("bn_weight", "bn_bias", "bn_mean", "bn_var"), bn)):
        if v is not None and (v.dim() != 1 or v.shape[0] != K):
            raise ValueError(f"{name}: expected a vector of {K} values (one per output channel), got shape "
                             f"{tuple(v.shape)}")
    if (bn[2] is None) != (bn[3] is None):
        raise ValueError("bn_mean, bn_var: give both or neither")
    for name, v in (("stride", stride), ("dilation", dilation)):
        if len(v) != 2 or min(v) < 1:
            raise ValueError(f"{name}: expected two positive ints, got {list(v)}")
    if len(padding) != 2 or min(padding) < 0:
        raise ValueError(f"padding: expected two ints >= 0, got {list(padding)}")
    if residual is not None and tuple(residual.shape) != _out_size(x, weight, stride, padding, dilation):
        raise ValueError(f"residual: expected the output's shape "
                         f"{_out_size(x, weight, stride, padding, dilation)}, got {tuple(residual.shape)}")


def _fold(weight_dtype, bias, bn, eps, K, device):
    """(scale or None, shift or None) in fp32: ``y * scale + shift`` = BN(y + bias)."""
    g, b, mean, var = bn
    if mean is None:
        if g is not None or b is not None:
            raise ValueError("bn_weight, bn_bias: given without bn_mean and bn_var")
        return None, (bias.float().contiguous() if bias is not None else None)
    s = torch.rsqrt(var.float() + eps)
    if g is not None:
        s = s * g.float()
    shift = -mean.float() * s if bias is None else (bias.float() - mean.float()) * s
    if b is not None:
        shift = shift + b.float()
    return s.contiguous(), shift.contiguous()


_vectors = DerivedCache()
_weights = DerivedCache()
_plans: dict = {}
_plans_lock = threading.Lock()


class _Vectors:
    """Per-call fp32 vectors in a plan's argument slots (the FoldedVectors interface, no folding)."""

    __slots__ = ("scale", "shift", "alpha", "alpha_scalar", "_keep")

    def __init__(self, scale, shift):
        self.scale = scale.data_ptr() if scale is not None else 0
        self.shift = shift.data_ptr() if shift is not None else 0
        self.alpha, self.alpha_scalar, self._keep = 0, 0.0, (scale, shift)


def _plan_key(x, weight, bias, bn_mean, residual, stride, padding, dilation, relu) -> tuple:
    """What the plan of a call depends on: the kernel's view of x and w (NHWC for a channels_last x), the
    epilogue's structure, the residual's dtype."""
    N, C, H, W = x.shape
    K, _, R, S = weight.shape
    nhwc = _nhwc(x)
    return ((N, H, W, C) if nhwc else (N, C, H, W), (K, R, S, C) if nhwc else (K, C, R, S),
            str(x.dtype).replace("torch.", ""), "NHWC" if nhwc else "NCHW", tuple(stride), tuple(padding),
            tuple(dilation), bn_mean is not None, bn_mean is not None or bias is not None,
            str(residual.dtype).replace("torch.", "") if residual is not None else None, bool(relu))


def _make_plan(key: tuple, device, **where):
    """The plan of a key (``device``: a CUDA index, or "numpy" with ``arch``/``sms`` for ahead-of-time builds)."""
    from .. import epilogues as ep
    from ..conv import Conv2dPlan
    xs, ws, dtype, layout, stride, padding, dilation, has_scale, has_shift, res_dtype, relu = key
    ops = []
    if has_scale:
        ops.append(ep.BatchNorm(None, None, None, None))            # (the scale-and-shift functor; per-call vectors)
    elif has_shift:
        ops.append(ep.Bias(None))
    if res_dtype is not None:
        ops.append(ep.Add())
    if relu:
        ops.append(ep.ReLU())
    return Conv2dPlan(xs, ws, dtype, layout, stride, padding, dilation, ep.chain(*ops), residual_dtype=res_dtype,
                      device=device, _skeleton=True, **where)


def _plan(key: tuple, device_index: int):
    plan = _plans.get((key, device_index))
    if plan is None:
        with _plans_lock:
            plan = _plans.get((key, device_index))
            if plan is None:
                plan = _plans[(key, device_index)] = _make_plan(key, device_index)
    return plan


def _conv2d_cuda(x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps, residual, stride, padding, dilation,
                 relu):
    bn = (bn_weight, bn_bias, bn_mean, bn_var)
    _check(x, weight, bias, bn, residual, stride, padding, dilation)
    if not supported(x, weight):
        return _conv2d_torch(x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps, residual, stride, padding,
                             dilation, relu)
    K = weight.shape[0]
    scale, shift = _vectors.get(eps, (bias, *bn), lambda: _fold(weight.dtype, bias, bn, eps, K, x.device))
    plan = _plan(_plan_key(x, weight, bias, bn_mean, residual, stride, padding, dilation, relu), x.device.index)
    if _nhwc(x):
        xv = x.permute(0, 2, 3, 1)
        if weight.is_contiguous(memory_format=_CL):
            wv = weight.permute(0, 2, 3, 1)
        else:          # (a model whose weights stay NCHW-contiguous: one KRSC copy, kept while the weight is)
            wv = _weights.get("krsc", (weight,), lambda: weight.permute(0, 2, 3, 1).contiguous())
        rv = None
        if residual is not None:
            rv = residual.permute(0, 2, 3, 1)
            if not rv.is_contiguous():
                rv = rv.contiguous()
        return plan.run(xv, wv, None, rv, None, None, None, _Vectors(scale, shift)).permute(0, 3, 1, 2)
    rv = residual.contiguous() if residual is not None else None
    return plan.run(x.contiguous(), weight.contiguous(), None, rv, None, None, None, _Vectors(scale, shift))


def _conv2d_torch(x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps, residual, stride, padding, dilation,
                  relu):
    """The op in PyTorch ops (the CPU, and what the CUDA kernel computes), in x's memory format."""
    bn = (bn_weight, bn_bias, bn_mean, bn_var)
    _check(x, weight, bias, bn, residual, stride, padding, dilation)
    y = F.conv2d(x, weight, bias, list(stride), list(padding), list(dilation))
    if bn_mean is not None:
        y = F.batch_norm(y, bn_mean, bn_var, bn_weight, bn_bias, False, 0.0, eps)
    if residual is not None:
        y = y + residual
    if relu:
        y = torch.relu(y)
    return y.contiguous(memory_format=_CL if _nhwc(x) else torch.contiguous_format)


_recording: list | None = None          # precompile(): the plan keys of the calls a fake forward makes


def _conv2d_fake(x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps, residual, stride, padding, dilation,
                 relu):
    if _recording is not None and x.dtype in _DTYPES and weight.dtype == x.dtype:   # (any device: ahead of time)
        _recording.append(_plan_key(x, weight, bias, bn_mean, residual, stride, padding, dilation, relu))
        _recording.append(grad_key(x, weight, stride, padding, dilation, relu, False))
    out = x.new_empty(_out_size(x, weight, stride, padding, dilation))
    return out.contiguous(memory_format=_CL) if _nhwc(x) else out


_lib.impl("conv2d", _conv2d_cuda, "CUDA")
_lib.impl("conv2d", _conv2d_torch, "CPU")
torch.library.register_fake("igemm::conv2d", _conv2d_fake, lib=_lib)


def conv2d(x, weight, bias=None, bn_weight=None, bn_bias=None, bn_mean=None, bn_var=None, eps: float = 1e-5,
           residual=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), relu: bool = False) -> torch.Tensor:
    """``torch.ops.igemm.conv2d`` (see the module doc); stride, padding, dilation: pairs of ints."""
    return torch.ops.igemm.conv2d(x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, float(eps), residual,
                                  list(stride), list(padding), list(dilation), bool(relu))


def precompile(model, *inputs, arch: str | None = None, sms: int | None = None, jobs: int | None = None,
               backward: bool | None = None) -> int:
    """Compile, in parallel, the kernels ``model`` (e.g. ``igemm.nn.convert(...)``'s result) launches for these
    inputs (example tensors: their shapes, dtypes and memory formats; they may be on the CPU), so that its first
    forward compiles nothing. Runs the model on fake tensors (no computation, no GPU needed). ``arch``/``sms``:
    the target GPU (default: cuda:0's where there is one, else sm_90a with 132 SMs). ``backward`` (default: the
    model is in training mode): also the dgrad and wgrad kernels of a training step. Returns the kernel count."""
    global _recording
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .. import _build
    if arch is None and sms is None and torch.cuda.is_available():
        from .. import _runtime
        arch, sms = _runtime.device_arch(0), _runtime.device_props(0).multiprocessor_count
    arch, sms = arch or "sm_90a", 132 if sms is None else int(sms)
    backward = getattr(model, "training", False) if backward is None else bool(backward)
    calls: list = []
    # (a training forward counts num_batches_tracked on the real buffers: put them back)
    kept = [(b, b.clone()) for b in model.buffers()] if isinstance(model, torch.nn.Module) else []
    _recording = calls
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
            model(*[mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in inputs])
    finally:
        _recording = None
        with torch.no_grad():
            for b, v in kept:
                b.copy_(v)
    items = {}
    for key in dict.fromkeys(calls):
        if key[0] == "grad":
            if backward:
                items.update(_grad_kernels(key[1:], arch, sms))
        else:
            name, src = _make_plan(key, "numpy", arch=arch, sms=sms).kernel()
            items[src] = name
    if backward and items:
        from ..conv import _moves
        items.update({src: name for name, src in _moves.all_variants()})
    from ._pool import AdaptiveAvgPool2d, AvgPoolLinear, MaxPool2d
    if isinstance(model, torch.nn.Module) and any(isinstance(m, (MaxPool2d, AdaptiveAvgPool2d, AvgPoolLinear))
                                                  for m in model.modules()):
        from .. import pool
        items.update({src: name for name, src in pool.all_variants(arch)})
    return _build.compile_many([(n, s) for s, n in items.items()], arch, jobs)


def grad_key(x, weight, stride, padding, dilation, mask: bool, prologue: bool) -> tuple:
    """What a call's dgrad and wgrad plans depend on (recorded by the fake implementations for precompile)."""
    fwd = _plan_key(x, weight, None, None, None, stride, padding, dilation, False)
    return ("grad", *fwd[:7], bool(mask), bool(prologue))


def _grad_kernels(key: tuple, arch: str, sms: int) -> dict:
    from ..conv import Conv2dGradInputPlan, Conv2dGradWeightPlan
    xs, ws, dtype, layout, stride, padding, dilation, mask, prologue = key
    out = {}
    # (16-bit training: also wgrad writing fp32, the eager path's gradient of autocast's master weight)
    for cls, kw in ((Conv2dGradInputPlan, {}), (Conv2dGradWeightPlan, {}),
                    *(((Conv2dGradWeightPlan, {"out_dtype": "float32"}),) if prologue and dtype != "float32" else ())):
        plan = cls(xs, ws, dtype, layout, stride, padding, dilation, mask=mask, prologue=prologue, device="numpy",
                   arch=arch, sms=sms, **kw)
        for sub in plan.sub_plans():
            name, src = sub.kernel()
            out[src] = name
    if prologue and layout == "NHWC":     # (the training forward's conv with z's statistics)
        from ._train_call import stats_plan
        name, src = stats_plan(xs, ws, dtype, stride, padding, dilation, "numpy", arch=arch, sms=sms).kernel()
        out[src] = name
    return out


# ------------------------------------------------------------------------------------------- the eager path
def eager(x) -> bool:
    """Whether a module's forward may call igemm directly (a plain CUDA tensor, not under torch.compile or
    export, which see the op): the dispatcher's cost per call skipped (docs/performance.md: nn-eager-path)."""
    return type(x) is torch.Tensor and x.is_cuda and not torch.compiler.is_compiling()


_calls: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()     # module -> {input geometry: FastCall}


def call_key(x, residual) -> tuple:
    """The input geometry a module's :class:`FastCall` belongs to (x's and the residual's)."""
    return (x.shape, x.stride(), x.dtype, x.get_device(),
            None if residual is None else (residual.shape, residual.stride(), residual.dtype))


def fast(owner, x, residual, tensors: tuple, eps: float, stride, padding, dilation, relu: bool):
    """A module's eager forward: the op's result, computed by the module's :class:`FastCall` for this input
    geometry. ``tensors``: (weight, bias, bn_weight, bn_bias, bn_mean, bn_var)."""
    per = _calls.get(owner)
    if per is None:
        per = _calls[owner] = {}
    key = call_key(x, residual)
    fc = per.get(key)
    if fc is None:
        fc = per[key] = FastCall(x, residual, tensors, eps, tuple(stride), tuple(padding), tuple(dilation), relu)
    return fc(x, residual, tensors)


class FastCall:
    """One module's calls with one input geometry (x's shape, strides, dtype, device; the residual's): the
    arguments checked and the plan found once; the weight's kernel view and the folded vectors derived again
    only when one of the tensors is another object or at another version; then pointers, a new output, and the
    plan's launch record."""

    __slots__ = ("plan", "nhwc", "args", "tensors", "ids", "stamp", "wv", "vectors", "proto", "out", "res_ok",
                 "stream_of")

    def __init__(self, x, residual, tensors, eps, stride, padding, dilation, relu):
        w, b, *bn = tensors
        _check(x, w, b, bn, residual, stride, padding, dilation)
        self.args = (eps, stride, padding, dilation, relu)
        self.nhwc = _nhwc(x)
        self.plan = _plan(_plan_key(x, w, b, bn[2], residual, stride, padding, dilation, relu), x.device.index)
        fmt = _CL if self.nhwc else torch.contiguous_format
        self.res_ok = residual is None or residual.is_contiguous(memory_format=fmt)
        ys = self.plan.y_shape             # (N, P, Q, K) for an NHWC plan, else (N, K, P, Q)
        # y made in its final shape and strides by one new_empty_strided (an NHWC empty_like and a permute cost
        # ~3.5x its host time: docs/performance.md, nn-out-alloc)
        if self.nhwc:
            N, P, Q, K = ys
            self.out = ((N, K, P, Q), (P * Q * K, 1, Q * K, K))
        else:
            N, K, P, Q = ys
            self.out = ((N, K, P, Q), (K * P * Q, P * Q, Q, 1))
        self.proto = torch.empty(0, dtype=x.dtype, device=x.device)
        self.stream_of = torch._C._cuda_getCurrentRawStream
        self.tensors, self.ids, self.stamp = None, None, None

    def _derive(self, tensors) -> None:
        w, b, *bn = tensors
        scale, shift = _fold(w.dtype, b, bn, self.args[0], w.shape[0], w.device)
        if self.nhwc:
            wv = w.permute(0, 2, 3, 1)
            if not wv.is_contiguous():
                wv = wv.contiguous()
        else:
            wv = w.contiguous()
        derived = (wv, _Vectors(scale, shift))
        if torch.cuda.is_current_stream_capturing():     # (values that exist only at replay: not kept)
            return derived
        self.wv, self.vectors = derived
        # (the tensors are held: no other object can take one's id while it is compared against)
        self.tensors, self.ids = tensors, list(map(id, tensors))
        self.stamp = [t._version for t in tensors if t is not None]
        return derived

    def __call__(self, x, residual, tensors):
        if list(map(id, tensors)) != self.ids or [t._version for t in tensors if t is not None] != self.stamp:
            wv, vectors = self._derive(tensors)
        else:
            wv, vectors = self.wv, self.vectors
        plan, xp, wp = self.plan, x.data_ptr(), wv.data_ptr()
        rp = residual.data_ptr() if residual is not None else 0
        if (xp & 15 or rp & 15 or wp & 15 or not self.res_ok
                or _runtime.current_context() != plan._ctx_id):      # the general path: copies, checks, context
            return _conv2d_cuda(x, tensors[0], tensors[1], *tensors[2:], self.args[0], residual, *self.args[1:])
        y = self.proto.new_empty_strided(*self.out)
        plan._launch(self.stream_of(plan.device_id), True, True, xp, wp, y.data_ptr(), rp, 0, vectors, False)
        return y
