"""Fused epilogues for igemm's convolution (imported as ``igemm.epilogues``).

Small declarative objects, composed with :func:`chain`, applied in order to the fp32 accumulator of
each output element; the output is rounded once at the end::

    from igemm import epilogues as ep
    y, mask = igemm.conv2d(x, w, padding=1,
                           epilogue=ep.chain(ep.BatchNorm(gamma, beta, mean, var, eps=1e-5),
                                             ep.Add(residual), ep.ReLU(mask=True)))

Each op is self-contained: it names the C++ functor it instantiates (``csrc/epilogues.cuh``), validates its
own inputs, folds itself (per-channel affine ops next to each other become one fp32 ``scale``/``shift`` pair,
in float64 on the host or in fp32 with torch on the vectors' device), applies its float64 definition (the
reference and the numpy backend), and declares the extra outputs it writes (``ReLU(mask=True)``: the mask).

Supported chains: at most one affine group (BatchNorm/Bias ops next to each other), at most one ``Add``,
at most one activation (``ReLU`` or ``PReLU``), in any order, except that ``ReLU(mask=True)`` must be last
(its bit is ``y > 0`` of the stored output, which is then exactly "pre-activation > 0").

A :class:`~igemm.Conv2dPlan` folds its chain's vectors once, when it is built (later in-place changes to them
are not seen: build a new plan); :func:`igemm.conv2d` folds them at every call. Both backends alike.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace

import numpy as np

from igemm.reference.epilogue import host_f64 as _host64   # (public: the float64 references)

__all__ = ["Epilogue", "BatchNorm", "Bias", "ReLU", "Add", "PReLU", "Chain", "chain", "Identity"]

_CTYPE = {"float16": "cutlass::half_t", "bfloat16": "cutlass::bfloat16_t", "float32": "float"}
_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _dtype_name(dt) -> str:
    """A dtype of any framework as igemm's name ("float16", ...): torch.float16, np.dtype, jax dtypes."""
    name = getattr(dt, "name", None)
    return name if isinstance(name, str) else str(dt).rsplit(".", 1)[-1]


def _is_torch_cuda(v) -> bool:
    return type(v).__module__.split(".")[0] == "torch" and getattr(v, "is_cuda", False)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _vector(v, name: str, K: int) -> None:
    """Check a per-channel vector: an array (any framework) of K floating values."""
    if v is None:
        raise TypeError(f"{name}: expected a 1-D array of {K} values (one per output channel), got None")
    shape, dtype = getattr(v, "shape", None), getattr(v, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"{name}: expected an array (torch, cupy, jax or numpy), got {type(v).__name__}")
    if type(v).__module__.split(".")[0] == "torch" and not v.is_cuda:
        raise TypeError(f"{name}: a torch tensor on {v.device} was given; pass a CUDA tensor (or a numpy array)")
    if len(shape) != 1 or int(shape[0]) != K:
        raise ValueError(f"{name}: expected a 1-D vector of {K} values (one per output channel), "
                         f"got shape {tuple(shape)}")
    if _dtype_name(dtype) not in _FLOATS:
        raise TypeError(f"{name}: expected a floating dtype, got {_dtype_name(dtype)}")


class Epilogue:
    """Base class of an epilogue op."""

    #: name of the C++ functor template in csrc/epilogues.cuh
    functor = ""
    #: a per-channel affine op (``y * scale + shift``): folds with its neighbours into one functor
    affine = False
    #: extra outputs the kernel writes for this op
    outputs: tuple = ()

    def signature(self) -> tuple:
        """Hashable structure (no tensor values): part of the plan cache key."""
        return (type(self).__name__,)

    def functor_type(self, residual_dtype: str) -> str:
        """The C++ type this op instantiates (affine ops: the group's, see :meth:`Chain.functors`)."""
        return f"igemm::epi::{self.functor}"

    def arrays(self) -> dict:
        """The op's array arguments by name (None where not given)."""
        return {}

    def validate(self, K: int) -> None:
        """Check the op's inputs against the output channel count ``K`` (before any launch)."""

    def skeleton(self) -> "Epilogue":
        """The op without its arrays: what a cached plan keeps."""
        return self

    def snapshot(self) -> "Epilogue":
        """The op with its arrays copied to float64 host arrays (a plan's values at build time)."""
        return replace(self, **{k: None if v is None else _host64(v) for k, v in self.arrays().items()})

    def fold(self, scale: np.ndarray, shift: np.ndarray) -> tuple:
        """(affine ops) ``y * scale + shift`` followed by this op, as a new float64 (scale, shift)."""
        raise TypeError(f"{self!r} is not an affine op")

    def fold_torch(self, scale, shift) -> tuple:
        """(affine ops) :meth:`fold` in fp32 torch ops on the vectors' device (``scale``/``shift`` may be None)."""
        raise TypeError(f"{self!r} is not an affine op")

    def reference(self, y: np.ndarray, channel, residual=None) -> np.ndarray:
        """This op's float64 definition applied to ``y``; ``channel(v)`` broadcasts a per-channel vector."""
        raise NotImplementedError(type(self).__name__)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@dataclass(eq=False, repr=False)
class BatchNorm(Epilogue):
    """Inference BatchNorm per output channel: ``y = (acc - mean) * gamma / sqrt(var + eps) + beta``.

    Folded into fp32 ``scale = gamma / sqrt(var + eps)`` and ``shift = beta - mean * scale`` (torch CUDA
    vectors: fp32 on their device, on the launch stream, no host synchronisation; other arrays: float64 on
    the host, then uploaded).
    """
    gamma: object
    beta: object
    mean: object
    var: object
    eps: float = 1e-5
    functor = "ScaleShift"
    affine = True

    def __post_init__(self):
        if not _is_real(self.eps):      # (the same rule as every family's eps: igemm._checks.check_eps)
            raise TypeError(f"eps: expected a real number, got {type(self.eps).__name__}")
        if not math.isfinite(self.eps) or self.eps < 0:
            raise ValueError(f"eps: must be finite and >= 0, got {self.eps!r}")
        self.eps = float(self.eps)

    def arrays(self) -> dict:
        return {"gamma": self.gamma, "beta": self.beta, "mean": self.mean, "var": self.var}

    def validate(self, K: int) -> None:
        for n, v in self.arrays().items():
            _vector(v, n, K)

    def skeleton(self) -> "BatchNorm":
        return BatchNorm(None, None, None, None, self.eps)

    def fold(self, scale, shift):
        g, b, m, v = (_host64(a).reshape(-1) for a in (self.gamma, self.beta, self.mean, self.var))
        s = g / np.sqrt(v + self.eps)
        return scale * s, shift * s + (b - m * s)

    def fold_torch(self, scale, shift):
        import torch
        s = torch.rsqrt(self.var.float() + self.eps).mul_(self.gamma.float())
        sh = torch.addcmul(self.beta.float(), self.mean.float(), s, value=-1.0)
        if shift is not None:
            sh = torch.addcmul(sh, shift, s)        # (prev * s) + this op's shift
        return (s if scale is None else scale.mul_(s)), sh

    def reference(self, y, channel, residual=None):
        return (y - channel(self.mean)) / np.sqrt(channel(self.var) + self.eps) * channel(self.gamma) \
            + channel(self.beta)

    def __repr__(self) -> str:
        return f"BatchNorm(eps={self.eps})"


@dataclass(eq=False, repr=False)
class Bias(Epilogue):
    """``y = acc + b[k]`` per output channel."""
    b: object
    functor = "Shift"
    affine = True

    def arrays(self) -> dict:
        return {"bias": self.b}

    def snapshot(self) -> "Bias":
        return Bias(_host64(self.b))

    def validate(self, K: int) -> None:
        _vector(self.b, "bias", K)

    def skeleton(self) -> "Bias":
        return Bias(None)

    def fold(self, scale, shift):
        return scale, shift + _host64(self.b).reshape(-1)

    def fold_torch(self, scale, shift):
        b = self.b.float()
        return scale, (b.clone() if shift is None else shift + b)

    def reference(self, y, channel, residual=None):
        return y + channel(self.b)

    def __repr__(self) -> str:
        return "Bias()"


@dataclass(eq=False, repr=False)
class ReLU(Epilogue):
    """``y = max(acc, 0)`` (NaN stays NaN, as PyTorch). ``mask=True`` also returns the 1-bit mask
    (bit set exactly where the stored ``y > 0``), for :func:`igemm.relu_backward`."""
    mask: bool = False
    functor = "Relu"

    def __post_init__(self):
        if not isinstance(self.mask, (bool, np.bool_)):
            raise TypeError(f"mask: expected a bool, got {self.mask!r}")
        self.mask = bool(self.mask)
        self.outputs = ("mask",) if self.mask else ()

    def signature(self) -> tuple:
        return ("ReLU", self.mask)

    def functor_type(self, residual_dtype: str) -> str:
        return f"igemm::epi::Relu<{'true' if self.mask else 'false'}>"

    def reference(self, y, channel, residual=None):
        return np.where((y > 0) | np.isnan(y), y, 0.0)

    def __repr__(self) -> str:
        return f"ReLU(mask={self.mask})"


@dataclass(eq=False, repr=False)
class Add(Epilogue):
    """``y = acc + residual`` (residual: the output's shape and layout; fp16, bf16 or fp32).

    The residual may be given here or per call (``plan(x, w, residual=r)``, ``conv2d(..., residual=r)``).
    """
    residual: object = None
    functor = "AddResidual"

    def functor_type(self, residual_dtype: str) -> str:
        return f"igemm::epi::AddResidual<{_CTYPE[residual_dtype]}>"

    def skeleton(self) -> "Add":
        return Add(None)

    def snapshot(self) -> "Add":
        return self                     # (the residual is a per-call input, never folded)

    def reference(self, y, channel, residual=None):
        r = residual if residual is not None else self.residual
        if r is None:
            raise ValueError("residual: the chain has an Add but no residual was given")
        return y + _host64(r)

    def __repr__(self) -> str:
        return "Add()"


@dataclass(eq=False, repr=False)
class PReLU(Epilogue):
    """``y = acc > 0 ? acc : alpha * acc``, alpha a real number (scalar) or one value per channel."""
    alpha: object = 0.25
    functor = "PRelu"

    def __post_init__(self):
        if self.alpha is None:
            raise TypeError("alpha: expected a real number or a per-channel array, got None")
        if _is_real(self.alpha):
            if not math.isfinite(self.alpha):
                raise ValueError(f"alpha: must be finite, got {self.alpha!r}")
            self.alpha = float(self.alpha)
        elif not isinstance(self.alpha, _PerChannel) and (isinstance(self.alpha, (str, bytes, bool))
                                                          or not hasattr(self.alpha, "shape")):
            raise TypeError(f"alpha: expected a real number or a per-channel array, got {type(self.alpha).__name__}")

    @property
    def per_channel(self) -> bool:
        return not isinstance(self.alpha, float)

    def signature(self) -> tuple:
        return ("PReLU", self.per_channel)

    def functor_type(self, residual_dtype: str) -> str:
        return f"igemm::epi::PRelu<{'true' if self.per_channel else 'false'}>"

    def arrays(self) -> dict:
        return {"alpha": self.alpha} if self.per_channel else {}

    def validate(self, K: int) -> None:
        if self.per_channel:
            shape = getattr(self.alpha, "shape", None)
            if shape is not None and len(shape) == 1 and int(shape[0]) == 1 and K != 1:
                raise ValueError("alpha: a one-element array; pass a Python float for a scalar PReLU")
            _vector(self.alpha, "alpha", K)

    def skeleton(self) -> "PReLU":
        return self if not self.per_channel else PReLU(_PerChannel())

    def alpha_vector(self) -> np.ndarray:
        """(per channel) the slopes as float64."""
        return _host64(self.alpha).reshape(-1)

    def reference(self, y, channel, residual=None):
        a = channel(self.alpha) if self.per_channel else self.alpha
        return np.where(y > 0, y, a * y)

    def __repr__(self) -> str:
        return f"PReLU({'per-channel' if self.per_channel else self.alpha})"


class _PerChannel:
    """Placeholder for a per-channel PReLU alpha in a cached plan's skeleton chain."""


@dataclass(eq=False, repr=False)
class Chain(Epilogue):
    """An ordered list of ops (see the module doc for what may be combined)."""
    ops: tuple = field(default_factory=tuple)

    def __post_init__(self):
        ops = tuple(self.ops)
        for o in ops:
            if not isinstance(o, Epilogue) or isinstance(o, Chain):
                raise TypeError(f"epilogue: expected igemm.epilogues ops, got {o!r}")
        kinds = ["affine" if o.affine else type(o).__name__ for o in ops]
        groups = [k for i, k in enumerate(kinds) if k != "affine" or i == 0 or kinds[i - 1] != "affine"]
        if groups.count("affine") > 1:
            raise NotImplementedError("epilogue: BatchNorm/Bias ops must be next to each other (one affine group)")
        if kinds.count("Add") > 1:
            raise NotImplementedError("epilogue: at most one Add")
        if kinds.count("ReLU") + kinds.count("PReLU") > 1:
            raise NotImplementedError("epilogue: at most one activation (ReLU or PReLU)")
        for i, o in enumerate(ops):
            if o.outputs and i != len(ops) - 1:
                raise ValueError("epilogue: ReLU(mask=True) must be the last op (its bit is stored y > 0)")
        self.ops = ops

    @property
    def mask(self) -> bool:
        """Whether the chain writes the 1-bit ReLU mask."""
        return any("mask" in o.outputs for o in self.ops)

    @property
    def outputs(self) -> tuple:
        return tuple(n for o in self.ops for n in o.outputs)

    @property
    def residual_op(self) -> Add | None:
        return next((o for o in self.ops if isinstance(o, Add)), None)

    @property
    def affine_ops(self) -> tuple:
        return tuple(o for o in self.ops if o.affine)

    @property
    def prelu_op(self) -> PReLU | None:
        return next((o for o in self.ops if isinstance(o, PReLU)), None)

    def signature(self) -> tuple:
        return tuple(o.signature() for o in self.ops)

    def functors(self, dtype: str, residual_dtype: str | None = None) -> tuple[str, ...]:
        """The C++ functor types, in order: an affine group is one ``ScaleShift`` (``Shift`` if it only adds)."""
        out: list[str] = []
        for i, o in enumerate(self.ops):
            if o.affine:
                if i and self.ops[i - 1].affine:
                    continue
                j = i
                while j < len(self.ops) and self.ops[j].affine:
                    j += 1
                scales = any(op.functor == "ScaleShift" for op in self.ops[i:j])
                out.append("igemm::epi::ScaleShift" if scales else "igemm::epi::Shift")
            else:
                out.append(o.functor_type(residual_dtype or dtype))
        return tuple(out)

    def arrays(self) -> dict:
        return {k: v for o in self.ops for k, v in o.arrays().items()}

    def validate(self, K: int) -> None:
        for o in self.ops:
            o.validate(K)

    def skeleton(self) -> "Chain":
        return Chain(tuple(o.skeleton() for o in self.ops))

    def snapshot(self) -> "Chain":
        return Chain(tuple(o.snapshot() for o in self.ops))

    def fold(self, K: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The affine group as float64 (scale, shift) of K values; None without one."""
        if not self.affine_ops:
            return None
        scale, shift = np.ones(K), np.zeros(K)
        for o in self.affine_ops:
            scale, shift = o.fold(scale, shift)
        return scale, shift

    def fold_torch(self, K: int, device) -> tuple | None:
        """:meth:`fold` in fp32 torch ops on ``device`` (every vector a torch CUDA tensor there)."""
        if not self.affine_ops:
            return None
        import torch
        scale = shift = None
        for o in self.affine_ops:
            scale, shift = o.fold_torch(scale, shift)
        if scale is None:
            scale = torch.ones(K, dtype=torch.float32, device=device)
        return scale.contiguous().reshape(-1), shift.contiguous().reshape(-1)

    def torch_foldable(self) -> bool:
        """Whether every vector of the chain is a torch CUDA tensor (folded with torch, no host round trip)."""
        vs = list(self.arrays().values())
        return bool(vs) and all(_is_torch_cuda(v) for v in vs)

    def reference(self, y, channel=None, residual=None, *, layout: str = "NCHW") -> np.ndarray:
        """The chain's float64 definition (op by op, BatchNorm unfolded) applied to ``y`` in ``layout``."""
        y = np.array(y, dtype=np.float64)
        if channel is None:
            shape = [1] * y.ndim
            shape[1 if layout == "NCHW" else y.ndim - 1] = -1

            def channel(v):
                return _host64(v).reshape(shape)
        for o in self.ops:
            y = o.reference(y, channel, residual)
        return y

    def __repr__(self) -> str:
        return "chain(" + ", ".join(map(repr, self.ops)) + ")"


def chain(*ops: Epilogue) -> Chain:
    """Compose epilogue ops, applied left to right."""
    flat = []
    for o in ops:
        flat.extend(o.ops if isinstance(o, Chain) else [o])
    return Chain(tuple(flat))


Identity = Chain(())
