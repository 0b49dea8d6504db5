"""Fused epilogues for igemm's convolution (imported as ``igemm.epilogues``).

Small declarative objects, composed with :func:`chain`, applied in order to the fp32 accumulator of
each output element; the output is rounded once at the end::

    from igemm import epilogues as ep
    y, mask = igemm.conv2d(x, w, padding=1,
                           epilogue=ep.chain(ep.BatchNorm(gamma, beta, mean, var, eps=1e-5),
                                             ep.Add(residual), ep.ReLU(mask=True)))

Each op declares the C++ functor it instantiates (``csrc/epilogues.cuh``), the extra inputs it needs
and how it validates them, and (``ReLU(mask=True)``) the extra output it writes. Per-channel affine ops
(``BatchNorm``, ``Bias``) next to each other are folded at plan time into one fp32 ``scale``/``shift`` pair.

Supported chains: at most one affine group (BatchNorm/Bias ops next to each other), at most one ``Add``,
at most one activation (``ReLU`` or ``PReLU``), in any order, except that ``ReLU(mask=True)`` must be last
(its bit is ``y > 0`` of the stored output, which is then exactly "pre-activation > 0").
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Epilogue", "BatchNorm", "Bias", "ReLU", "Add", "PReLU", "Chain", "chain", "Identity"]


class Epilogue:
    """Base class of an epilogue op."""

    #: name of the C++ functor template in csrc/epilogues.cuh
    functor = ""

    def signature(self) -> tuple:
        """Hashable structure (no tensor values): part of the kernel spec and the plan cache key."""
        return (type(self).__name__,)

    def validate(self, K: int) -> None:
        """Check the op's inputs against the output channel count ``K`` (before any launch)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _channel_vector(v, name: str, K: int):
    """Validate a per-channel vector argument: 1-D, K elements, floating, no host/device mix-ups later."""
    from igemm._runtime import as_tensor
    t = as_tensor(v, name)
    if t.ndim != 1 or t.shape[0] != K:
        raise ValueError(f"{name}: expected a 1-D vector of {K} values (one per output channel), got shape {t.shape}")
    if t.dtype not in ("float16", "bfloat16", "float32", "float64"):
        raise TypeError(f"{name}: expected a floating dtype, got {t.dtype}")
    return t


@dataclass(eq=False)
class BatchNorm(Epilogue):
    """Inference BatchNorm per output channel: ``y = (acc - mean) * gamma / sqrt(var + eps) + beta``.

    Folded into fp32 ``scale = gamma / sqrt(var + eps)`` and ``shift = beta - mean * scale``: by a plan
    when it is built, by ``igemm.conv2d`` on every call (torch CUDA vectors: fp32 on their device, on the
    launch stream, no host synchronisation; other arrays: float64 on the host, then uploaded).
    """
    gamma: object
    beta: object
    mean: object
    var: object
    eps: float = 1e-5
    functor = "ScaleShift"

    def __post_init__(self):
        if not (isinstance(self.eps, (int, float)) and self.eps >= 0):
            raise ValueError(f"eps: expected a non-negative number, got {self.eps!r}")

    def validate(self, K: int) -> None:
        for n in ("gamma", "beta", "mean", "var"):
            _channel_vector(getattr(self, n), n, K)

    def __repr__(self) -> str:
        return f"BatchNorm(eps={self.eps})"


@dataclass(eq=False)
class Bias(Epilogue):
    """``y = acc + b[k]`` per output channel."""
    b: object
    functor = "Shift"

    def validate(self, K: int) -> None:
        _channel_vector(self.b, "bias", K)

    def __repr__(self) -> str:
        return "Bias()"


@dataclass(eq=False)
class ReLU(Epilogue):
    """``y = max(acc, 0)`` (NaN stays NaN, as PyTorch). ``mask=True`` also returns the 1-bit mask
    (bit set exactly where the stored ``y > 0``), for :func:`igemm.relu_backward`."""
    mask: bool = False
    functor = "Relu"

    def signature(self) -> tuple:
        return ("ReLU", bool(self.mask))

    def __repr__(self) -> str:
        return f"ReLU(mask={self.mask})"


@dataclass(eq=False)
class Add(Epilogue):
    """``y = acc + residual`` (residual: the output's shape and layout; fp16, bf16 or fp32).

    The residual may be given here or per call (``plan(x, w, residual=r)``, ``conv2d(..., residual=r)``).
    """
    residual: object = None
    functor = "AddResidual"

    def __repr__(self) -> str:
        return "Add()"


@dataclass(eq=False)
class PReLU(Epilogue):
    """``y = acc > 0 ? acc : alpha * acc``, alpha a Python float (scalar) or one value per channel."""
    alpha: object = 0.25
    functor = "PRelu"

    @property
    def per_channel(self) -> bool:
        return not isinstance(self.alpha, (int, float, np.floating))

    def signature(self) -> tuple:
        return ("PReLU", self.per_channel)

    def validate(self, K: int) -> None:
        if self.per_channel:
            from igemm._runtime import as_tensor
            t = as_tensor(self.alpha, "alpha")
            if t.numel == 1 and K != 1:
                raise ValueError("alpha: a one-element array; pass a Python float for a scalar PReLU")
            _channel_vector(self.alpha, "alpha", K)

    def __repr__(self) -> str:
        return f"PReLU({'per-channel' if self.per_channel else self.alpha})"


@dataclass(eq=False)
class Chain(Epilogue):
    """An ordered list of ops (see the module doc for what may be combined)."""
    ops: tuple = field(default_factory=tuple)

    def __post_init__(self):
        ops = tuple(self.ops)
        for o in ops:
            if not isinstance(o, Epilogue) or isinstance(o, Chain):
                raise TypeError(f"chain: expected epilogue ops, got {o!r}")
        kinds = ["affine" if isinstance(o, (BatchNorm, Bias)) else type(o).__name__ for o in ops]
        groups = [k for i, k in enumerate(kinds) if k != "affine" or i == 0 or kinds[i - 1] != "affine"]
        if groups.count("affine") > 1:
            raise NotImplementedError("chain: BatchNorm/Bias ops must be next to each other (one affine group)")
        if kinds.count("Add") > 1:
            raise NotImplementedError("chain: at most one Add")
        if kinds.count("ReLU") + kinds.count("PReLU") > 1:
            raise NotImplementedError("chain: at most one activation (ReLU or PReLU)")
        for i, o in enumerate(ops):
            if isinstance(o, ReLU) and o.mask and i != len(ops) - 1:
                raise ValueError("chain: ReLU(mask=True) must be the last op (its bit is stored y > 0)")
        self.ops = ops

    @property
    def mask(self) -> bool:
        return any(isinstance(o, ReLU) and o.mask for o in self.ops)

    @property
    def residual_op(self) -> Add | None:
        return next((o for o in self.ops if isinstance(o, Add)), None)

    @property
    def affine_ops(self) -> tuple:
        return tuple(o for o in self.ops if isinstance(o, (BatchNorm, Bias)))

    @property
    def prelu_op(self) -> PReLU | None:
        return next((o for o in self.ops if isinstance(o, PReLU)), None)

    def signature(self) -> tuple:
        return tuple(o.signature() for o in self.ops)

    def validate(self, K: int) -> None:
        for o in self.ops:
            o.validate(K)

    def __repr__(self) -> str:
        return "chain(" + ", ".join(map(repr, self.ops)) + ")"


def chain(*ops: Epilogue) -> Chain:
    """Compose epilogue ops, applied left to right."""
    flat = []
    for o in ops:
        flat.extend(o.ops if isinstance(o, Chain) else [o])
    return Chain(tuple(flat))


Identity = Chain(())
