"""Bad input (issue 8): each kind of wrong argument is a clear error raised before anything is launched;
valid-but-unusual input (empty tensors, zero-sized dims, NaN/Inf, misaligned views, in place) gives the
reference's answer. Never a crash, never a partial write.

* ``BAD``: one row per kind: a builder making the call from an array *adapter* (numpy arrays on the numpy
  backend in the CPU tier; torch CUDA tensors on the GPU), the exception type and a regex on its message.
  Every output and in-place argument the call could write is poisoned first and must be bit-identical
  afterwards. On the GPU the kernel launcher is instrumented: a bad call launches nothing (rows marked
  ``launches`` excepted: index_add's documented index-check kernel), and the context stays usable.
* ``GPU_BAD``: device-specific kinds (host tensors, mixed host/device, misaligned or overlapping ``out``,
  stream objects, devices).
* ``OK``: valid inputs at the edges, checked against numpy's IEEE semantics / the float64 reference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

import igemm
from igemm import epilogues as ep
from igemm import reference
from igemm.conv import Conv2dPlan
from igemm.reference.epilogue import apply_chain

from helpers import TOL, rel_err, to_numpy

NAN, INF = float("nan"), float("inf")
POISON_WORD = 0xAAAAAAAA


# ============================================================================================== adapters
class NumpyArrays:
    """numpy arrays on the numpy backend (the CPU tier)."""
    gpu = False
    device = None

    def arr(self, a, dtype="float32"):
        return np.array(a, dtype=dtype)

    def randn(self, shape, dtype="float32", seed=0):
        return np.random.default_rng(seed).standard_normal(shape).astype(dtype)

    def full(self, shape, value, dtype="float32"):
        return np.full(shape, value, dtype=dtype)

    def words(self, n, value=POISON_WORD):
        return np.full(n, value, dtype=np.uint32)

    def perm(self, a, axes):
        return a.transpose(axes)

    def channels_last(self, a):
        """NCHW shape, NHWC strides (not contiguous in NCHW order)."""
        return np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)

    def flat(self, a):
        return a.reshape(-1)

    def snapshot(self, a):
        return np.array(a, copy=True)

    def same(self, a, snap) -> bool:
        return a.shape == snap.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(snap).tobytes()

    def empty(self, shape, dtype="float32"):
        return np.empty(shape, dtype=dtype)

    def host(self, a):
        """A float64 (floats) copy on the host."""
        a = np.asarray(a)
        return np.array(a, dtype=np.float64) if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else a.copy()

    def host_words(self, m):
        return np.array(m).view(np.uint32)

    def sync(self):
        pass


class TorchArrays:
    """torch CUDA tensors (the GPU tier)."""
    gpu = True
    device = 0

    def __init__(self):
        import torch
        self.torch = torch

    def _dt(self, dtype):
        return getattr(self.torch, dtype)

    def arr(self, a, dtype="float32"):
        a = np.asarray(a)
        if dtype in ("bfloat16", "float16", "float32") and a.dtype.kind == "f":
            return self.torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to("cuda", self._dt(dtype))
        return self.torch.from_numpy(np.array(a, dtype=dtype)).cuda()

    def randn(self, shape, dtype="float32", seed=0):
        return self.arr(np.random.default_rng(seed).standard_normal(shape), dtype)

    def full(self, shape, value, dtype="float32"):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return self.torch.full(shape, value, dtype=self._dt(dtype), device="cuda")

    def empty(self, shape, dtype="float32"):
        return self.torch.empty(shape, dtype=self._dt(dtype), device="cuda")

    def words(self, n, value=POISON_WORD):
        v = int(np.array(value, dtype=np.uint32).view(np.int32))
        return self.torch.full((n,), v, dtype=self.torch.int32, device="cuda")

    def perm(self, a, axes):
        return a.permute(axes)

    def channels_last(self, a):
        return a.contiguous(memory_format=self.torch.channels_last)

    def flat(self, a):
        return a.view(-1)

    def snapshot(self, a):
        return np.array(a, copy=True) if isinstance(a, np.ndarray) else a.clone()

    def _bytes(self, t) -> bytes:
        if isinstance(t, np.ndarray):
            return np.ascontiguousarray(t).tobytes()
        return t.detach().reshape(-1).cpu().view(self.torch.uint8).numpy().tobytes()

    def same(self, a, snap) -> bool:
        return tuple(a.shape) == tuple(snap.shape) and self._bytes(a) == self._bytes(snap)

    def host(self, a):
        return to_numpy(a)

    def host_words(self, m):
        return m.cpu().numpy().view(np.uint32)

    def sync(self):
        self.torch.cuda.synchronize()

    # device-only helpers
    def misaligned(self, shape, dtype="float32", seed=0, offset=1):
        """A tensor of random values ``offset`` elements into a bigger buffer (not 16-byte aligned)."""
        n = int(np.prod(shape))
        buf = self.torch.empty(n + offset, dtype=self._dt(dtype), device="cuda")
        t = buf[offset:].view(shape)
        t.copy_(self.randn(shape, dtype, seed))
        return t


# ============================================================================================== rows
@dataclass
class Bad:
    id: str
    build: object          # (adapter) -> (call, [arrays that must stay unchanged])
    exc: object            # exception type (or tuple)
    match: str
    where: str = "both"    # "both" | "cpu" | "gpu"
    launches: bool = False  # a (documented) launch before the error is allowed on the GPU
    multigpu: bool = False


def _conv_xw(A, dtype="float32"):
    return A.randn((2, 4, 8, 8), dtype, 1), A.randn((3, 4, 3, 3), dtype, 2)


def _conv_out(A, shape=(2, 3, 6, 6), dtype="float32"):
    return A.full(shape, NAN, dtype)


def _bn_vecs(A, K=3):
    rng = np.random.default_rng(3)
    return [A.arr(v.astype(np.float32)) for v in (rng.uniform(0.5, 1.5, K), rng.standard_normal(K),
                                                 rng.standard_normal(K), rng.uniform(0.5, 2, K))]


def conv_row(kw_fn=None, x_fn=None, w_fn=None, out_fn=_conv_out, mask_fn=None):
    """A conv2d call; a poisoned ``out`` (``out_fn``) and ``mask_out`` (``mask_fn``) are made first and
    watched; ``kw_fn(A)`` gives the other kwargs, evaluated inside the call (epilogue objects may raise)."""
    def build(A):
        x, w = _conv_xw(A)
        x = x_fn(A, x) if x_fn else x
        w = w_fn(A, w) if w_fn else w
        fixed = {}
        if out_fn is not None:
            fixed["out"] = out_fn(A)
        if mask_fn is not None:
            fixed["mask_out"] = mask_fn(A)

        def call():
            kw = dict(fixed)
            kw.update(kw_fn(A) if kw_fn else {})
            return igemm.conv2d(x, w, **kw)
        return call, list(fixed.values())
    return build


def _plan_row(x_shape, dtype="float32"):
    def build(A):
        plan = Conv2dPlan((2, 4, 8, 8), (3, 4, 3, 3), "float32", "NCHW", device=A.device)
        x = A.randn(x_shape, dtype, 1)
        w = A.randn((3, 4, 3, 3), dtype, 2)
        out = _conv_out(A)
        return (lambda: plan(x, w, out=out)), [out]
    return build


def relu_row(dy_fn=None, mask_fn=None, out_fn=None):
    def build(A):
        dy = A.randn((64,), "float32", 4)
        mask = A.words(2, 0x0F0F0F0F)
        if dy_fn:
            dy = dy_fn(A, dy)
        if mask_fn:
            mask = mask_fn(A, mask)
        kw = {}
        watched = []
        if out_fn:
            kw["out"] = out_fn(A)
            watched.append(kw["out"])
        return (lambda: igemm.relu_backward(dy, mask, **kw)), watched
    return build


def index_row(mod):
    """index_add on x (5, 4): ``mod(A, dict)`` edits the arguments; x must stay unchanged."""
    def build(A):
        a = dict(x=A.randn((5, 4), "float32", 5), dim=0, index=A.arr([0, 2, 4], "int64"),
                 source=A.randn((3, 4), "float32", 6), alpha=1.0)
        mod(A, a)
        x = a["x"]
        return (lambda: igemm.index_add(x, a["dim"], a["index"], a["source"], alpha=a["alpha"],
                                        stream=a.get("stream"))), [x]
    return build


def _set(**kv):
    def mod(A, a):
        for k, v in kv.items():
            a[k] = v(A, a) if callable(v) else v
    return mod


def prelu_row(x_fn=None, alpha_fn=None, kw_fn=None, backward=False):
    def build(A):
        x = A.randn((2, 3, 4), "float32", 7)
        alpha = A.arr([0.1, 0.2, 0.3])
        if x_fn:
            x = x_fn(A, x)
        if alpha_fn:
            alpha = alpha_fn(A, alpha)
        kw = kw_fn(A) if kw_fn else {}
        watched = [kw["out"]] if "out" in kw else []
        if backward:
            dy = kw.pop("dy")
            return (lambda: igemm.prelu_backward(dy, x, alpha, **kw)), watched
        return (lambda: igemm.prelu(x, alpha, **kw)), watched
    return build


def bn_row(fn):
    """``fn(A, x, c3)`` returns (call, watched) for x (2, 3, 4, 4) and fp32 per-channel vectors c3."""
    def build(A):
        x = A.randn((2, 3, 4, 4), "float32", 8)
        c3 = A.arr([1.0, 2.0, 3.0])
        return fn(A, x, c3)
    return build


def _bn_relu_call(A, x, c3, **kw):
    kw.setdefault("out", A.full(tuple(x.shape), NAN))
    kw.setdefault("mask_out", A.words(3))
    mean, invstd = kw.pop("mean", c3), kw.pop("invstd", c3)
    return (lambda: igemm.batch_norm_relu(x, mean, invstd, **kw)), [kw["out"], kw["mask_out"]]


BAD = [
    # ------------------------------------------------------------------------------------------- conv2d
    Bad("conv/x-float64", conv_row(None, lambda A, x: A.arr(A.host(x), "float64"),
                                   lambda A, w: A.arr(A.host(w), "float64")), TypeError, "dtype float64"),
    Bad("conv/int32", conv_row(None, lambda A, x: A.arr(A.host(x), "int32"), lambda A, w: A.arr(A.host(w), "int32")),
        TypeError, "dtype int32"),
    Bad("conv/w-dtype-differs", conv_row(None, w_fn=lambda A, w: A.arr(A.host(w), "float16")), TypeError, "w: dtype"),
    Bad("conv/layout-name", conv_row(lambda A: {"layout": "NWHC"}), ValueError, "layout"),
    Bad("conv/x-3d", conv_row(None, lambda A, x: x[0]), ValueError, "4-D"),
    Bad("conv/w-5d", conv_row(None, w_fn=lambda A, w: w[None]), ValueError, "4-D"),
    Bad("conv/channels-differ", conv_row(None, w_fn=lambda A, w: A.randn((3, 3, 3, 3), "float32", 2)), ValueError,
        "input channels"),
    Bad("conv/x-noncontiguous", conv_row(None, lambda A, x: x[:, :, ::2], out_fn=lambda A: _conv_out(A, (2, 3, 2, 6))),
        ValueError, "contiguous"),
    Bad("conv/x-channels-last-strides", conv_row(None, lambda A, x: A.channels_last(x)), ValueError, "contiguous"),
    Bad("conv/out-shape", conv_row(out_fn=lambda A: _conv_out(A, (2, 3, 7, 7))), ValueError, "out: expected shape"),
    Bad("conv/out-dtype", conv_row(out_fn=lambda A: _conv_out(A, dtype="float16")), TypeError, "out"),
    Bad("conv/out-noncontiguous", conv_row(out_fn=lambda A: _conv_out(A, (2, 3, 6, 12))[..., ::2]), ValueError,
        "contiguous"),
    Bad("conv/empty-batch", conv_row(None, lambda A, x: x[:0], out_fn=None), ValueError, "empty"),
    Bad("conv/zero-width", conv_row(None, lambda A, x: A.full((2, 4, 8, 0), 1.0), out_fn=None), ValueError, "empty"),
    Bad("conv/zero-filters", conv_row(None, w_fn=lambda A, w: A.full((0, 4, 3, 3), 1.0), out_fn=None), ValueError,
        "empty"),
    Bad("conv/filter-does-not-fit", conv_row(lambda A: {"dilation": 2}, lambda A, x: A.randn((2, 4, 2, 2)),
                                             out_fn=None), ValueError, "does not fit"),
    Bad("conv/stride-0", conv_row(lambda A: {"stride": 0}), ValueError, "stride"),
    Bad("conv/stride-triple", conv_row(lambda A: {"stride": (1, 2, 3)}), ValueError, "stride"),
    Bad("conv/stride-float", conv_row(lambda A: {"stride": 1.5}), TypeError, "stride"),
    Bad("conv/padding-negative", conv_row(lambda A: {"padding": -1}), ValueError, "padding"),
    Bad("conv/dilation-0", conv_row(lambda A: {"dilation": 0}), ValueError, "dilation"),
    Bad("conv/precision", conv_row(lambda A: {"precision": "fast"}), ValueError, "precision"),
    Bad("conv/epilogue-type", conv_row(lambda A: {"epilogue": "relu"}), TypeError, "epilogue"),
    Bad("conv/bn-vector-length", conv_row(lambda A: {"epilogue": ep.BatchNorm(*[v[:2] for v in _bn_vecs(A)])}),
        ValueError, "gamma.*3"),
    Bad("conv/bn-vector-int", conv_row(lambda A: {"epilogue": ep.BatchNorm(
        *[A.arr(A.host(v), "int32") if i == 2 else v for i, v in enumerate(_bn_vecs(A))])}), TypeError, "mean"),
    Bad("conv/bn-vector-2d", conv_row(lambda A: {"epilogue": ep.BatchNorm(*[v.reshape(3, 1) for v in _bn_vecs(A)])}),
        ValueError, "1-D"),
    Bad("conv/bn-eps-negative", conv_row(lambda A: {"epilogue": ep.BatchNorm(*_bn_vecs(A), eps=-1.0)}), ValueError,
        "eps"),
    Bad("conv/bias-length", conv_row(lambda A: {"epilogue": ep.Bias(A.arr([1.0, 2.0]))}), ValueError, "bias"),
    Bad("conv/prelu-alpha-length", conv_row(lambda A: {"epilogue": ep.PReLU(A.arr([0.1, 0.2]))}), ValueError,
        "alpha"),
    Bad("conv/prelu-alpha-one-element", conv_row(lambda A: {"epilogue": ep.PReLU(A.arr([0.1]))}), ValueError,
        "Python float"),
    Bad("conv/residual-shape", conv_row(lambda A: {"epilogue": ep.Add(A.randn((2, 3, 6, 5)))}), ValueError,
        "residual.*shape"),
    Bad("conv/residual-int", conv_row(lambda A: {"epilogue": ep.Add(A.full((2, 3, 6, 6), 1, "int32"))}), TypeError,
        "residual"),
    Bad("conv/residual-without-add", conv_row(lambda A: {"residual": A.randn((2, 3, 6, 6))}), ValueError, "Add"),
    Bad("conv/add-without-residual", conv_row(lambda A: {"epilogue": ep.Add()}), ValueError, "pass residual"),
    Bad("conv/mask-out-without-mask", conv_row(lambda A: {"epilogue": ep.ReLU()}, mask_fn=lambda A: A.words(7)),
        ValueError, "mask_out"),
    Bad("conv/mask-out-too-short", conv_row(lambda A: {"epilogue": ep.ReLU(mask=True)}, mask_fn=lambda A: A.words(6)),
        ValueError, "mask_out"),
    Bad("conv/mask-out-float", conv_row(lambda A: {"epilogue": ep.ReLU(mask=True)}, mask_fn=lambda A: A.full(7, NAN)),
        ValueError, "mask_out"),
    Bad("conv/mask-relu-not-last", conv_row(lambda A: {"epilogue": ep.chain(ep.ReLU(mask=True), ep.Bias(A.arr(
        [1.0, 2.0, 3.0])))}), ValueError, "last"),
    Bad("conv/two-activations", conv_row(lambda A: {"epilogue": ep.chain(ep.ReLU(), ep.PReLU(0.1))}),
        NotImplementedError, "activation"),
    Bad("conv/plan-x-shape", _plan_row((2, 4, 9, 8)), ValueError, "x: expected shape"),
    Bad("conv/plan-x-dtype", _plan_row((2, 4, 8, 8), "float16"), TypeError, "x: expected dtype"),
    Bad("conv/plan-too-many-pixels", lambda A: ((lambda: Conv2dPlan((2 ** 12, 1, 2 ** 10, 2 ** 10), (1, 1, 1, 1),
                                                                    "float16", device=A.device)), []),
        NotImplementedError, r"2\*\*31"),
    Bad("conv/plan-image-too-big", lambda A: ((lambda: Conv2dPlan((1, 32769, 256, 256), (1, 32769, 1, 1), "float16",
                                                                  stride=256, device=A.device)), []),
        NotImplementedError, r"per image"),
    Bad("conv/plan-config-field", lambda A: ((lambda: Conv2dPlan((2, 8, 8, 16), (32, 3, 3, 16), "float16", "NHWC",
                                                                 device=A.device, config={"tile": 3}).spec()), []),
        ValueError, "unknown"),
    # ------------------------------------------------------------------------------------------- relu
    Bad("relu_backward/mask-too-short", relu_row(mask_fn=lambda A, m: m[:1]), ValueError, "mask"),
    Bad("relu_backward/mask-float", relu_row(mask_fn=lambda A, m: A.full(2, 1.0)), TypeError, "mask"),
    Bad("relu_backward/mask-2d", relu_row(mask_fn=lambda A, m: A.words(4).reshape(2, 2)), ValueError, "mask"),
    Bad("relu_backward/dy-int", relu_row(dy_fn=lambda A, dy: A.full(64, 1, "int32")), TypeError, "dy"),
    Bad("relu_backward/dy-noncontiguous", relu_row(dy_fn=lambda A, dy: A.randn((128,))[::2]), ValueError,
        "contiguous"),
    Bad("relu_backward/out-shape", relu_row(out_fn=lambda A: A.full(63, NAN)), ValueError, "out"),
    Bad("relu_backward/out-dtype", relu_row(out_fn=lambda A: A.full(64, NAN, "float16")), TypeError, "out"),
    Bad("relu_mask/y-int", lambda A: ((lambda: igemm.relu_mask(A.full(40, 1, "int32"))), []), TypeError, "y"),
    Bad("relu_mask/out-too-short", lambda A: (lambda o: ((lambda: igemm.relu_mask(A.randn(65), out=o)), [o]))(
        A.words(2)), ValueError, "out"),
    # ------------------------------------------------------------------------------------------- index_add
    Bad("index_add/index-past-end", index_row(_set(index=lambda A, a: A.arr([0, 5, 1], "int64"))), IndexError,
        r"index\[1\] = 5 is out of range", launches=True),
    Bad("index_add/index-negative", index_row(_set(index=lambda A, a: A.arr([0, 1, -1], "int32"))), IndexError,
        r"index\[2\] = -1 is out of range", launches=True),
    Bad("index_add/source-dtype", index_row(_set(source=lambda A, a: A.randn((3, 4), "float16"))), TypeError,
        "source"),
    Bad("index_add/index-float", index_row(_set(index=lambda A, a: A.arr([0.0, 1.0, 2.0]))), TypeError, "index"),
    Bad("index_add/x-int", index_row(_set(x=lambda A, a: A.full((5, 4), 1, "int32"),
                                          source=lambda A, a: A.full((3, 4), 1, "int32"))), TypeError, "x"),
    Bad("index_add/dim-out-of-range", index_row(_set(dim=2)), IndexError, "dim"),
    Bad("index_add/dim-float", index_row(_set(dim=0.0)), TypeError, "dim"),
    Bad("index_add/source-shape", index_row(_set(source=lambda A, a: A.randn((3, 5)))), ValueError,
        r"source: expected shape \(3, 4\)"),
    Bad("index_add/source-rank", index_row(_set(source=lambda A, a: A.randn((3, 4, 1)))), ValueError,
        "source: expected 2 dimensions"),
    Bad("index_add/index-2d", index_row(_set(index=lambda A, a: A.arr([[0], [1], [2]], "int64"))), IndexError,
        "1-D"),
    Bad("index_add/alpha-complex", index_row(_set(alpha=1j)), TypeError, "alpha"),
    Bad("index_add/alpha-string", index_row(_set(alpha="2")), TypeError, "alpha"),
    Bad("index_add/source-noncontiguous", index_row(_set(source=lambda A, a: A.perm(A.randn((4, 3)), (1, 0)))),
        ValueError, "contiguous"),
    # ------------------------------------------------------------------------------------------- prelu
    Bad("prelu/alpha-count", prelu_row(alpha_fn=lambda A, a: A.arr([0.1, 0.2, 0.3, 0.4])), ValueError,
        "alpha: 4 elements"),
    Bad("prelu/alpha-float64", prelu_row(alpha_fn=lambda A, a: A.arr([0.1, 0.2, 0.3], "float64")), TypeError, "alpha"),
    Bad("prelu/alpha-string", prelu_row(alpha_fn=lambda A, a: "0.1"), TypeError, "alpha"),
    Bad("prelu/layout", prelu_row(kw_fn=lambda A: {"layout": "NWC"}), ValueError, "layout"),
    Bad("prelu/x-float64", prelu_row(x_fn=lambda A, x: A.arr(A.host(x), "float64")), TypeError, "x"),
    Bad("prelu/x-noncontiguous", prelu_row(x_fn=lambda A, x: A.perm(A.randn((2, 4, 3)), (0, 2, 1))), ValueError,
        "contiguous"),
    Bad("prelu/out-shape", prelu_row(kw_fn=lambda A: {"out": A.full((2, 3), NAN)}), ValueError, "out"),
    Bad("prelu/out-dtype", prelu_row(kw_fn=lambda A: {"out": A.full((2, 3, 4), NAN, "float16")}), ValueError, "out"),
    Bad("prelu/1d-channel-alpha", prelu_row(x_fn=lambda A, x: A.randn((5,))), ValueError, "below 2-D"),
    Bad("prelu_backward/dy-shape", prelu_row(kw_fn=lambda A: {"dy": A.randn((2, 3, 5))}, backward=True), ValueError,
        "dy"),
    Bad("prelu_backward/dy-dtype", prelu_row(kw_fn=lambda A: {"dy": A.randn((2, 3, 4), "float16")}, backward=True),
        ValueError, "dy"),
    # ------------------------------------------------------------------------------------------- BatchNorm
    Bad("welford/layout", bn_row(lambda A, x, c: ((lambda: igemm.welford(x, "NCWH")), [])), ValueError, "layout"),
    Bad("welford/x-1d", bn_row(lambda A, x, c: ((lambda: igemm.welford(A.randn(5))), [])), ValueError,
        "at least 2 dimensions"),
    Bad("welford/no-channels", bn_row(lambda A, x, c: ((lambda: igemm.welford(A.full((2, 0, 3), 1.0))), [])),
        ValueError, "no channels"),
    Bad("welford/x-int", bn_row(lambda A, x, c: ((lambda: igemm.welford(A.full((2, 3, 4), 1, "int32"))), [])),
        TypeError, "x: dtype int32"),
    Bad("welford/out-tuple-length", bn_row(lambda A, x, c: ((lambda: igemm.welford(x, out=(c, c))), [c])), TypeError,
        "out"),
    Bad("welford/out-shape", bn_row(lambda A, x, c: (lambda o: ((lambda: igemm.welford(x, out=o)), list(o)))(
        (A.full(3, NAN), A.full(4, NAN), A.full(3, NAN)))), ValueError, "out.var: expected shape"),
    Bad("welford/out-mixed-dtypes", bn_row(lambda A, x, c: (lambda o: ((lambda: igemm.welford(x, out=o)), list(o)))(
        (A.full(3, NAN), A.full(3, NAN, "float64"), A.full(3, NAN)))), TypeError, "share one dtype"),
    Bad("batch_norm_stats/eps-negative", bn_row(lambda A, x, c: ((lambda: igemm.batch_norm_stats(x, -1.0)), [])),
        ValueError, "eps"),
    Bad("batch_norm_stats/eps-nan", bn_row(lambda A, x, c: ((lambda: igemm.batch_norm_stats(x, NAN)), [])),
        ValueError, "eps"),
    Bad("batch_norm_stats/momentum", bn_row(lambda A, x, c: ((lambda: igemm.batch_norm_stats(x, momentum=2.0)), [])),
        ValueError, "momentum"),
    Bad("batch_norm_stats/running-mean-only", bn_row(lambda A, x, c: (
        (lambda: igemm.batch_norm_stats(x, running_mean=c)), [c])), ValueError, "running_mean and running_var"),
    Bad("batch_norm_stats/running-var-shape", bn_row(lambda A, x, c: (lambda rv: (
        (lambda: igemm.batch_norm_stats(x, running_mean=c, running_var=rv)), [c, rv]))(A.full(4, 1.0))),
        ValueError, "running_var"),
    Bad("batch_norm_relu/mean-shape-nhwc", bn_row(lambda A, x, c: _bn_relu_call(A, x, c, layout="NHWC")), ValueError,
        r"mean: expected shape \(4,\)"),
    Bad("batch_norm_relu/invstd-dtype", bn_row(lambda A, x, c: _bn_relu_call(A, x, c, invstd=A.arr([1, 2, 3],
                                                                                                   "float16"))),
        TypeError, "invstd"),
    Bad("batch_norm_relu/residual-shape", bn_row(lambda A, x, c: _bn_relu_call(A, x, c, residual=A.randn(
        (2, 3, 4, 5)))), ValueError, "residual"),
    Bad("batch_norm_relu/mask-out-too-short", bn_row(lambda A, x, c: _bn_relu_call(A, x, c, mask_out=A.words(2))),
        ValueError, "mask_out"),
    Bad("batch_norm_relu/mean-missing", bn_row(lambda A, x, c: _bn_relu_call(A, x, c, mean=None)), TypeError,
        "required"),
    Bad("batch_norm_backward_reduce/mask-short", bn_row(lambda A, x, c: (
        (lambda: igemm.batch_norm_backward_reduce(x, x, c, c, mask=A.words(2))), [])), ValueError, "mask"),
    Bad("batch_norm_backward_reduce/dy-shape", bn_row(lambda A, x, c: (
        (lambda: igemm.batch_norm_backward_reduce(x[:1], x, c, c)), [])), ValueError, "dy: shape"),
    Bad("batch_norm_backward_elemt/count-zero", bn_row(lambda A, x, c: (
        (lambda: igemm.batch_norm_backward_elemt(x, x, c, c, None, c, c, 0)), [])), ValueError, "count: must be > 0"),
    Bad("batch_norm_backward_elemt/count-shape", bn_row(lambda A, x, c: (
        (lambda: igemm.batch_norm_backward_elemt(x, x, c, c, None, c, c, A.full(2, 4.0))), [])), ValueError,
        "count: expected 1 or 3"),
    Bad("batch_norm_backward_elemt/out-shape", bn_row(lambda A, x, c: (lambda o: (
        (lambda: igemm.batch_norm_backward_elemt(x, x, c, c, None, c, c, 32, out=o)), [o]))(A.full((2, 3, 4, 5), NAN))),
        ValueError, "out"),
    Bad("batch_norm_gather_stats/counts-shape", bn_row(lambda A, x, c: (
        (lambda: igemm.batch_norm_gather_stats(A.full((2, 3), 1.0), A.full((2, 3), 1.0), A.full(3, 1.0))), [])),
        ValueError, "counts: expected shape"),
    Bad("batch_norm_gather_stats/vars-dtype", bn_row(lambda A, x, c: (
        (lambda: igemm.batch_norm_gather_stats(A.full((2, 3), 1.0, "float64"), A.full((2, 3), 1.0),
                                               A.full(2, 1.0))), [])), TypeError, "vars: dtype"),
    Bad("sync_batch_norm_stats/comm", bn_row(lambda A, x, c: ((lambda: igemm.sync_batch_norm_stats(
        x, 1e-5, comm=object())), [])), TypeError, "comm"),
]


# ---------------------------------------------------------------------------------------------- GPU-only kinds
def _gpu_conv(fn):
    def build(A):
        x, w = _conv_xw(A)
        return fn(A, x, w)
    return build


def _buf_view(A, shape, offset, dtype="float32", fill=NAN):
    n = int(np.prod(shape))
    buf = A.full(n + offset, fill, dtype)
    return buf, buf[offset:].view(shape)


GPU_BAD = [
    Bad("conv/x-on-cpu", _gpu_conv(lambda A, x, w: ((lambda: igemm.conv2d(x.cpu(), w)), [])), TypeError, "cpu"),
    Bad("conv/w-numpy-x-cuda", _gpu_conv(lambda A, x, w: (lambda o: ((lambda: igemm.conv2d(
        x, w.cpu().numpy(), out=o)), [o]))(_conv_out(A))), TypeError, r"host \(numpy\)"),
    Bad("conv/out-numpy", _gpu_conv(lambda A, x, w: (lambda o: ((lambda: igemm.conv2d(x, w, out=o)), [o]))(
        np.full((2, 3, 6, 6), np.nan, np.float32))), TypeError, r"host \(numpy\)"),
    Bad("conv/bn-vector-on-cpu", _gpu_conv(lambda A, x, w: (lambda o: ((lambda: igemm.conv2d(
        x, w, out=o, epilogue=ep.BatchNorm(*[v.cpu() for v in _bn_vecs(A)]))), [o]))(_conv_out(A))), TypeError,
        "gamma.*cpu"),
    Bad("conv/out-misaligned", _gpu_conv(lambda A, x, w: (lambda bv: ((lambda: igemm.conv2d(x, w, out=bv[1])),
                                                                      [bv[0]]))(_buf_view(A, (2, 3, 6, 6), 1))),
        ValueError, "aligned"),
    Bad("conv/residual-misaligned", _gpu_conv(lambda A, x, w: (lambda o, r: ((lambda: igemm.conv2d(
        x, w, out=o, epilogue=ep.Add(), residual=r)), [o]))(_conv_out(A), _buf_view(A, (2, 3, 6, 6), 2, fill=1.0)[1])),
        ValueError, "residual.*aligned"),
    Bad("conv/out-overlaps-x", _gpu_conv(lambda A, x, w: ((lambda: igemm.conv2d(
        x, w, out=A.flat(x)[:216].view(2, 3, 6, 6))), [x])), ValueError, "overlap"),
    Bad("conv/out-overlaps-w", _gpu_conv(lambda A, x, w: (lambda big: (
        (lambda: igemm.conv2d(x, big[:108].view(3, 4, 3, 3), out=big[100:316].view(2, 3, 6, 6))), [big]))(
        A.randn((316,)))), ValueError, "overlap"),
    Bad("conv/mask-out-overlaps-out", _gpu_conv(lambda A, x, w: (lambda big: (
        (lambda: igemm.conv2d(x, w, epilogue=ep.ReLU(mask=True), out=big[:216].view(2, 3, 6, 6),
                              mask_out=big.view(A.torch.int32)[208:215])), [big]))(A.full(224, NAN))),
        ValueError, "overlap"),
    Bad("conv/mask-out-overlaps-x", _gpu_conv(lambda A, x, w: (
        (lambda: igemm.conv2d(x, w, epilogue=ep.ReLU(mask=True), out=_conv_out(A),
                              mask_out=A.flat(x).view(A.torch.int32)[:7])), [x])), ValueError, "overlap"),
    Bad("conv/stream-type", _gpu_conv(lambda A, x, w: (lambda o: ((lambda: igemm.conv2d(
        x, w, out=o, stream="default")), [o]))(_conv_out(A))), TypeError, "stream"),
    Bad("conv/plan-stream-type", _gpu_conv(lambda A, x, w: (lambda o, p: ((lambda: p(x, w, out=o, stream=1.5)), [o]))(
        _conv_out(A), Conv2dPlan((2, 4, 8, 8), (3, 4, 3, 3), "float32"))), TypeError, "stream"),
    Bad("relu_backward/dy-on-cpu", relu_row(dy_fn=lambda A, dy: dy.cpu()), TypeError, "cpu", where="gpu"),
    Bad("relu_backward/out-overlaps-dy", lambda A: (lambda buf: (
        (lambda: igemm.relu_backward(buf[:64], A.words(2, 0x0F0F0F0F), out=buf[1:65])), [buf]))(A.randn((65,))),
        ValueError, "overlap"),
    Bad("relu_backward/out-overlaps-mask", lambda A: (lambda buf: (
        (lambda: igemm.relu_backward(A.randn((64,)), buf.view(A.torch.int32)[:2], out=buf)), [buf]))(
        A.randn((64,))), ValueError, "overlap"),
    Bad("relu_mask/out-overlaps-y", lambda A: (lambda y: (
        (lambda: igemm.relu_mask(y, out=y.view(A.torch.int32)[1:4])), [y]))(A.randn((96,))), ValueError, "overlap"),
    Bad("relu_backward/stream-type", relu_row(), TypeError, "stream", where="gpu"),   # build replaced below
    Bad("index_add/index-on-cpu", index_row(_set(index=lambda A, a: a["index"].cpu())), TypeError, "cpu"),
    Bad("index_add/x-overlaps-source", lambda A: (lambda buf: (
        (lambda: igemm.index_add(buf[:20].view(5, 4), 0, A.arr([0, 1, 2], "int64"), buf[8:20].view(3, 4))), [buf]))(
        A.randn((20,))), ValueError, "overlap"),
    Bad("index_add/stream-type", index_row(lambda A, a: a.update(stream="s")), TypeError, "stream"),
    Bad("prelu/out-overlaps-x", prelu_row(kw_fn=None), ValueError, "overlap"),                 # build replaced below
    Bad("prelu/out-overlaps-alpha", lambda A: (lambda buf: (
        (lambda: igemm.prelu(A.randn((2, 3, 4)), buf[:3], out=buf.view(2, 3, 4))), [buf]))(A.randn((24,))),
        ValueError, "overlap"),
    Bad("prelu/stream-type", prelu_row(kw_fn=lambda A: {"stream": object()}), TypeError, "stream"),
    Bad("batch_norm_stats/out-overlaps-x", bn_row(lambda A, x, c: (
        (lambda: igemm.batch_norm_stats(x, out=(A.flat(x)[:3], A.full(3, NAN)))), [x])), ValueError, "overlap"),
    Bad("batch_norm_relu/mask-out-overlaps-x", bn_row(lambda A, x, c: (
        (lambda: igemm.batch_norm_relu(x, c, c, mask_out=A.flat(x).view(A.torch.int32)[:4])), [x])), ValueError,
        "overlap"),
    Bad("batch_norm_stats/stream-type", bn_row(lambda A, x, c: ((lambda: igemm.batch_norm_stats(x, stream=2.5)), [])),
        TypeError, "stream"),
    Bad("batch_norm_stats/x-on-cpu", bn_row(lambda A, x, c: ((lambda: igemm.batch_norm_stats(x.cpu())), [])),
        TypeError, "cpu"),
    Bad("conv/plan-other-device", _gpu_conv(lambda A, x, w: (lambda p: ((lambda: p(x, w)), []))(
        Conv2dPlan((2, 4, 8, 8), (3, 4, 3, 3), "float32", device=1))), ValueError, "cuda:1", multigpu=True),
    Bad("conv/tensors-on-two-devices", _gpu_conv(lambda A, x, w: ((lambda: igemm.conv2d(x, w.to("cuda:1"))), [])),
        ValueError, "different devices", multigpu=True),
    Bad("relu_backward/stream-of-other-device", lambda A: (lambda s: (
        (lambda: igemm.relu_backward(A.randn((64,)), A.words(2), stream=s)), []))(A.torch.cuda.Stream(device=1)),
        (ValueError, RuntimeError), "stream|device|launch", multigpu=True),
]


def _relu_stream_type(A):
    dy, mask = A.randn((64,)), A.words(2)
    out = A.full(64, NAN)
    return (lambda: igemm.relu_backward(dy, mask, out=out, stream="default")), [out]


def _prelu_out_overlaps_x(A):
    buf = A.randn((25,))
    x = buf[:24].view(2, 3, 4)
    return (lambda: igemm.prelu(x, A.arr([0.1, 0.2, 0.3]), out=buf[1:].view(2, 3, 4))), [buf]


for _r in GPU_BAD:
    if _r.id == "relu_backward/stream-type":
        _r.build = _relu_stream_type
    elif _r.id == "prelu/out-overlaps-x":
        _r.build = _prelu_out_overlaps_x


# ============================================================================================== runners
def _ids(rows):
    return [r.id for r in rows]


def test_table_size():
    """Issue 8: >= 30 kinds of bad input."""
    kinds = {r.id for r in BAD + GPU_BAD}
    assert len(kinds) == len(BAD) + len(GPU_BAD) and len(kinds) >= 30


@pytest.mark.parametrize("row", [r for r in BAD if r.where != "gpu"], ids=_ids([r for r in BAD if r.where != "gpu"]))
def test_bad_input_numpy(row, numpy_backend):
    A = NumpyArrays()
    call, watched = row.build(A)
    snaps = [A.snapshot(w) for w in watched]
    with pytest.raises(row.exc, match=row.match):
        call()
    for w, s in zip(watched, snaps):
        assert A.same(w, s), f"{row.id}: an output/in-place argument was written before the error"


@pytest.fixture
def launches(monkeypatch):
    """Records every kernel launch (igemm launches through _kernel.Launcher, every family)."""
    from igemm import _kernel
    seen = []
    orig = _kernel.Launcher.__call__

    def record(self, stream, args):
        seen.append(self)
        return orig(self, stream, args)
    monkeypatch.setattr(_kernel.Launcher, "__call__", record)
    return seen


def _context_is_healthy(A) -> None:
    y = A.randn((100,), "float32", 99)
    m = igemm.relu_mask(y)
    A.sync()
    np.testing.assert_array_equal(A.host_words(m), reference.pack_mask(A.host(y) > 0))


# Rows seen failing on a GPU and not fixed yet: id -> what was seen (marked xfail(strict) below).
KNOWN_GPU_BUGS: dict = {}


@pytest.mark.gpu
@pytest.mark.parametrize("row", [r for r in BAD + GPU_BAD if r.where != "cpu"],
                         ids=_ids([r for r in BAD + GPU_BAD if r.where != "cpu"]))
def test_bad_input_gpu(row, launches, request):
    pytest.importorskip("torch")
    if row.multigpu:
        import torch
        if torch.cuda.device_count() < 2:
            pytest.skip("needs two CUDA GPUs")
    if row.id in KNOWN_GPU_BUGS:
        request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN_GPU_BUGS[row.id]))
    A = TorchArrays()
    call, watched = row.build(A)
    A.sync()
    snaps = [A.snapshot(w) for w in watched]
    launches.clear()
    with pytest.raises(row.exc, match=row.match):
        call()
    n_launched = len(launches)
    A.sync()                                       # an asynchronous fault would surface here
    if not row.launches:
        assert n_launched == 0, f"{row.id}: {n_launched} kernel(s) launched before the error"
    for w, s in zip(watched, snaps):
        assert A.same(w, s), f"{row.id}: an output/in-place argument was written"
    _context_is_healthy(A)


# ============================================================================================== valid edge inputs
def tf32_round(a) -> np.ndarray:
    """float64 copy of fp32 values rounded to TF32 as the kernels do (``cvt.rna.tf32.f32``: 10 mantissa bits,
    ties away from zero; inf and NaN kept): a tf32 reference on these sees only the accumulation's error."""
    a = np.asarray(a, dtype=np.float32)
    b = ((a.view(np.uint32).astype(np.uint64) + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(a), a, b).astype(np.float64)


def _ieee_conv(x, w, stride, padding, dilation, layout):
    """float64 conv without BLAS (elementwise products, np.sum): NaN/Inf propagate exactly as IEEE says."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    if layout == "NHWC":
        x, w = x.transpose(0, 3, 1, 2), w.transpose(0, 3, 1, 2)
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    N, C, H, W = x.shape
    K, _, R, S = w.shape
    P = (H + 2 * ph - dh * (R - 1) - 1) // sh + 1
    Q = (W + 2 * pw - dw * (S - 1) - 1) // sw + 1
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    terms = np.empty((N, K, P, Q, C, R, S))
    for r in range(R):
        for s in range(S):
            patch = xp[:, :, r * dh: r * dh + sh * (P - 1) + 1: sh, s * dw: s * dw + sw * (Q - 1) + 1: sw]
            terms[..., r, s] = patch.transpose(0, 2, 3, 1)[:, None] * w[None, :, None, None, :, r, s]
    y = terms.reshape(N, K, P, Q, -1).sum(-1)
    return np.ascontiguousarray(y.transpose(0, 2, 3, 1)) if layout == "NHWC" else y


def _assert_ieee(got, ref, tol, what):
    got = np.asarray(got, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(ref), err_msg=f"{what}: +inf positions")
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref), err_msg=f"{what}: -inf positions")
    fin = np.isfinite(ref)
    assert rel_err(got[fin], ref[fin]) <= tol, what


def _specials_like(rng, shape):
    v = rng.standard_normal(shape)
    flat = v.reshape(-1)
    idx = rng.permutation(flat.size)
    k = max(1, flat.size // 40)
    flat[idx[:k]] = np.nan
    flat[idx[k:2 * k]] = np.inf
    flat[idx[2 * k:3 * k]] = -np.inf
    return v


from igemm.conv._rules import FFMA_CONFIG as FFMA  # noqa: E402  (the strict-fp32 FFMA kernel)


def ok_conv_ieee(A, dtype="float32", layout="NCHW", precision="strict", ffma=False):
    rng = np.random.default_rng(11)
    xs, ws = ((2, 5, 7, 6), (8, 5, 3, 3)) if layout == "NCHW" else ((2, 7, 6, 8), (16, 3, 3, 8))
    x = A.arr(_specials_like(rng, xs), dtype)
    wv = rng.choice([-1, 1], ws) * (0.1 + np.abs(rng.standard_normal(ws))) / 4      # no zero weights
    w = A.arr(wv, dtype)
    K = ws[0]
    g = np.where(np.arange(K) % 2, -1.0, 1.0) * rng.uniform(0.5, 1.5, K)                   # scales of both signs
    V = [A.arr(v.astype(np.float32)) for v in (g, rng.standard_normal(K), rng.standard_normal(K),
                                               rng.uniform(0.5, 2, K))]
    xh, wh = A.host(x), A.host(w)
    if precision == "tf32":
        xh, wh = tf32_round(xh), tf32_round(wh)
    pre = _ieee_conv(xh, wh, (1, 1), (1, 1), (1, 1), layout)
    tol = TOL["tf32" if precision == "tf32" else dtype]
    for chain in (ep.chain(ep.BatchNorm(*V)), ep.chain(ep.BatchNorm(*V), ep.ReLU(mask=True))):
        with np.errstate(invalid="ignore"):
            ref = apply_chain(pre, chain, layout)
        if ffma:          # the FFMA kernel by name: IEEE products and sums
            r = igemm.Conv2dPlan(tuple(x.shape), tuple(w.shape), dtype, layout, 1, 1, epilogue=chain,
                                 precision=precision, config=FFMA)(x, w)
        else:
            r = igemm.conv2d(x, w, 1, 1, layout=layout, epilogue=chain, precision=precision)
        y, m = r if chain.mask else (r, None)
        what = f"conv {dtype}/{precision}{' ffma' if ffma else ''} {layout} {chain!r}"
        _assert_ieee(A.host(y), ref, tol, what)     # (3xTF32 too: infinities meet only the other's big part)
        if m is not None:
            bits = reference.unpack_mask(A.host_words(m), ref.size).reshape(ref.shape)
            with np.errstate(invalid="ignore"):
                np.testing.assert_array_equal(bits, A.host(y) > 0, err_msg=what)
    assert np.isnan(pre).any() and np.isinf(pre).any()


def ok_relu_specials(A):
    vals = np.array([NAN, INF, -INF, 0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30] * 13, np.float32)
    y = A.arr(vals)
    m = igemm.relu_mask(y)
    np.testing.assert_array_equal(A.host_words(m)[: (vals.size + 31) // 32], reference.pack_mask(vals > 0))
    dy = A.arr(np.roll(vals, 3))
    dx = igemm.relu_backward(dy, m)
    expect = np.where(vals > 0, np.roll(vals, 3), 0.0)          # a select: inf/NaN where the bit is 0 give 0
    np.testing.assert_array_equal(A.host(dx), expect)


def ok_relu_inplace(A):
    v = np.random.default_rng(12).standard_normal(1000).astype(np.float32)
    dy = A.arr(v)
    m = A.words(32, 0x5A5A5A5A)
    r = igemm.relu_backward(dy, m, out=dy)
    assert r is dy
    np.testing.assert_array_equal(A.host(dy), np.where(reference.unpack_mask(A.host_words(m), 1000), v, 0.0))


def ok_relu_empty(A):
    y = A.empty(0)
    m = igemm.relu_mask(y)
    assert A.host_words(m).size == 0
    dx = igemm.relu_backward(y, A.empty(0, "uint32" if not A.gpu else "int32"))
    assert A.host(dx).size == 0


def ok_index_add_empty(A):
    x = A.randn((4, 3), "float32", 13)
    keep = A.snapshot(x)
    igemm.index_add(x, 0, A.empty(0, "int64"), A.empty((0, 3)))
    assert A.same(x, keep)
    z = A.empty((4, 0))
    igemm.index_add(z, 0, A.arr([1, 3], "int64"), A.empty((2, 0)))
    assert A.host(z).shape == (4, 0)


def ok_index_add_nan(A):
    rng = np.random.default_rng(14)
    x = A.randn((6, 5), "float32", 15)
    src = rng.standard_normal((3, 5))
    src[1, 2] = np.nan
    src[2, 4] = np.inf
    idx = np.array([4, 1, 1])
    x0 = A.host(x)
    with np.errstate(invalid="ignore"):
        ref = reference.index_add(x0, 0, idx, src.astype(np.float32))
    igemm.index_add(x, 0, A.arr(idx, "int64"), A.arr(src))
    _assert_ieee(A.host(x), ref, 1e-6, "index_add NaN/inf source")


def ok_prelu_specials(A):
    rng = np.random.default_rng(16)
    xv = _specials_like(rng, (3, 4, 5))
    alpha = np.array([0.5, -0.25, 2.0, 1e-3], np.float32)
    x = A.arr(xv)
    y = igemm.prelu(x, A.arr(alpha))
    with np.errstate(invalid="ignore"):
        ref = reference.prelu(A.host(x), alpha.astype(np.float64))
    _assert_ieee(A.host(y), ref, 1e-6, "prelu NaN/inf")


def ok_prelu_inplace(A):
    x = A.randn((2, 3, 5), "float32", 17)
    x0 = A.host(x)
    assert igemm.prelu(x, 0.25, out=x) is x
    np.testing.assert_allclose(A.host(x), np.where(x0 > 0, x0, 0.25 * x0), rtol=1e-6)


def ok_prelu_empty(A):
    e = A.empty((0, 3, 4))
    assert A.host(igemm.prelu(e, A.arr([0.1, 0.2, 0.3]))).shape == (0, 3, 4)
    dx, da = igemm.prelu_backward(e, e, A.arr([0.1, 0.2, 0.3]))
    assert A.host(dx).shape == (0, 3, 4) and np.all(A.host(da) == 0)


def ok_bn_empty_batch(A):
    for layout, shape in (("NCHW", (0, 3, 4, 4)), ("NHWC", (0, 4, 4, 3))):
        x = A.full(shape, 1.0)
        m, v, n = igemm.welford(x, layout)
        assert A.host(m).tolist() == [0.0] * 3 and A.host(v).tolist() == [0.0] * 3 and A.host(n).tolist() == [0.0] * 3
        mean, invstd = igemm.batch_norm_stats(x, 0.25, layout)
        assert A.host(invstd).tolist() == [2.0] * 3
        y, mk = igemm.batch_norm_relu(x, mean, invstd, layout=layout)
        assert A.host(y).shape == shape and A.host_words(mk).size == 0


def ok_bn_specials(A):
    rng = np.random.default_rng(18)
    xv = rng.standard_normal((3, 4, 5, 5))
    xv[1, 1, 2, 3] = np.nan          # channel 1: a NaN
    xv[2, 2, 0, 0] = np.inf          # channel 2: an inf
    x = A.arr(xv)
    m, v, n = igemm.welford(x)
    with np.errstate(invalid="ignore"):
        rm, rv, _ = reference.welford_stats(A.host(x))
    bad = np.array([False, True, True, False])
    mh, vh = A.host(m), A.host(v)
    assert np.all(~np.isfinite(mh[bad])) and np.all(~np.isfinite(vh[bad])), (mh, vh)
    np.testing.assert_allclose(mh[~bad], rm[~bad], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(vh[~bad], rv[~bad], rtol=1e-5)
    mean, invstd = igemm.batch_norm_stats(x, 1e-5)
    assert np.all(~np.isfinite(A.host(invstd)[bad]))
    # batch_norm_relu: NaN stays NaN with mask bit 0, +inf stays +inf with bit 1
    c = A.arr(np.ones(4, np.float32))
    zero = A.arr(np.zeros(4, np.float32))
    y, mk = igemm.batch_norm_relu(x, zero, c)
    yh = A.host(y)
    assert np.isnan(yh[1, 1, 2, 3]) and yh[2, 2, 0, 0] == np.inf
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(A.host_words(mk), reference.pack_mask(yh > 0))


def ok_conv_mixed_residual_in_add(A):
    """A residual of another dtype given inside ep.Add (not residual=) works like residual= does."""
    rng = np.random.default_rng(19)
    x = A.arr(rng.standard_normal((1, 2, 5, 5)), "float16")
    w = A.arr(rng.standard_normal((3, 2, 3, 3)) / 4, "float16")
    r = A.arr(rng.standard_normal((1, 3, 5, 5)), "float32")
    via_kw = igemm.conv2d(x, w, padding=1, epilogue=ep.chain(ep.Add(), ep.ReLU()), residual=r)
    via_add = igemm.conv2d(x, w, padding=1, epilogue=ep.chain(ep.Add(r), ep.ReLU()))
    ref = np.maximum(reference.conv2d_im2col(A.host(x), A.host(w), 1, 1, 1) + A.host(r), 0)
    assert rel_err(A.host(via_kw), ref) <= 1e-2 and rel_err(A.host(via_add), ref) <= 1e-2


def ok_numpy_vectors_with_cuda_x(A):
    rng = np.random.default_rng(20)
    x, w = A.randn((2, 4, 6, 6), "float32", 21), A.randn((5, 4, 3, 3), "float32", 22)
    V = [v.astype(np.float32) for v in (rng.uniform(0.5, 1.5, 5), rng.standard_normal(5), rng.standard_normal(5),
                                       rng.uniform(0.5, 2, 5))]
    chain = ep.chain(ep.BatchNorm(*V), ep.ReLU())
    y = igemm.conv2d(x, w, padding=1, epilogue=chain)
    ref = apply_chain(reference.conv2d_im2col(A.host(x), A.host(w), 1, 1, 1), chain, "NCHW")
    assert rel_err(A.host(y), ref) <= 1e-5


def ok_misaligned_views(A):
    """Views 1 element into a buffer: narrow loads everywhere, same answers."""
    x, w = A.misaligned((2, 6, 6, 8)), A.randn((4, 3, 3, 8))
    y = igemm.conv2d(x, w, padding=1, layout="NHWC")
    assert rel_err(A.host(y), reference.conv2d_im2col(A.host(x), A.host(w), 1, 1, 1, "NHWC")) <= 1e-5
    dy = A.misaligned((777,))
    m = igemm.relu_mask(A.misaligned((777,), seed=3))
    dx = A.misaligned((777,), seed=4)
    igemm.relu_backward(dy, m, out=dx)
    np.testing.assert_array_equal(A.host(dx), np.where(reference.unpack_mask(A.host_words(m), 777), A.host(dy), 0.0))
    xb = A.misaligned((3, 5, 7, 9))
    mean, invstd = igemm.batch_norm_stats(xb, 1e-5)
    rm, rv, _ = reference.welford_stats(A.host(xb))
    np.testing.assert_allclose(A.host(mean), rm, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(A.host(invstd), 1 / np.sqrt(rv + 1e-5), rtol=1e-5)
    xi = A.misaligned((7, 9))
    x0 = A.host(xi)
    igemm.index_add(xi, 0, A.arr([6, 0, 6], "int64"), A.arr(np.ones((3, 9))))
    np.testing.assert_allclose(A.host(xi), reference.index_add(x0, 0, np.array([6, 0, 6]), np.ones((3, 9))),
                               rtol=1e-6)
    xp = A.misaligned((2, 3, 7))
    yp = igemm.prelu(xp, A.arr([0.1, 0.2, 0.3]))
    np.testing.assert_allclose(A.host(yp), reference.prelu(A.host(xp), np.array([0.1, 0.2, 0.3], np.float32)),
                               rtol=1e-6)


def ok_side_stream(A):
    """An explicit torch stream (not the current one) and a cupy stream for torch tensors."""
    torch = A.torch
    s = torch.cuda.Stream()
    y = A.randn((5000,), "float32", 23)
    torch.cuda.synchronize()
    m = igemm.relu_mask(y, stream=s)
    s.synchronize()
    np.testing.assert_array_equal(A.host_words(m), reference.pack_mask(A.host(y) > 0))
    try:
        import cupy
    except ImportError:
        return
    cs = cupy.cuda.Stream(non_blocking=True)
    m2 = igemm.relu_mask(y, stream=cs)
    cs.synchronize()
    assert torch.equal(m, m2)


OK = [
    ("conv/ieee-fp32-nchw", lambda A: ok_conv_ieee(A, "float32", "NCHW"), "both"),
    ("conv/ieee-fp32-nhwc", lambda A: ok_conv_ieee(A, "float32", "NHWC"), "both"),
    ("conv/ieee-fp32-ffma-nchw", lambda A: ok_conv_ieee(A, "float32", "NCHW", ffma=True), "gpu"),
    ("conv/ieee-fp32-ffma-nhwc", lambda A: ok_conv_ieee(A, "float32", "NHWC", ffma=True), "gpu"),
    ("conv/ieee-fp16-nhwc", lambda A: ok_conv_ieee(A, "float16", "NHWC"), "gpu"),
    ("conv/ieee-bf16-nchw", lambda A: ok_conv_ieee(A, "bfloat16", "NCHW"), "gpu"),
    ("conv/ieee-tf32-nhwc", lambda A: ok_conv_ieee(A, "float32", "NHWC", "tf32"), "gpu"),
    ("conv/mixed-residual-in-add", ok_conv_mixed_residual_in_add, "both"),
    ("conv/numpy-vectors-cuda-x", ok_numpy_vectors_with_cuda_x, "gpu"),
    ("relu/nan-inf-signed-zero", ok_relu_specials, "both"),
    ("relu/in-place", ok_relu_inplace, "both"),
    ("relu/empty", ok_relu_empty, "both"),
    ("index_add/empty-index-and-zero-size-dim", ok_index_add_empty, "both"),
    ("index_add/nan-inf-source", ok_index_add_nan, "both"),
    ("prelu/nan-inf", ok_prelu_specials, "both"),
    ("prelu/in-place", ok_prelu_inplace, "both"),
    ("prelu/empty", ok_prelu_empty, "both"),
    ("bn/empty-batch", ok_bn_empty_batch, "both"),
    ("bn/nan-inf", ok_bn_specials, "both"),
    ("all/misaligned-views", ok_misaligned_views, "gpu"),
    ("all/side-streams", ok_side_stream, "gpu"),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")     # numpy's own NaN/inf arithmetic in the references
@pytest.mark.parametrize("name, fn", [(n, f) for n, f, w in OK if w == "both"],
                         ids=[n for n, f, w in OK if w == "both"])
def test_edge_inputs_numpy(name, fn, numpy_backend):
    fn(NumpyArrays())


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name, fn", [(n, f) for n, f, w in OK], ids=[n for n, f, w in OK])
def test_edge_inputs_gpu(name, fn):
    pytest.importorskip("torch")
    A = TorchArrays()
    fn(A)
    A.sync()
    _context_is_healthy(A)


def test_nan_eps_and_inf_eps_rejected(numpy_backend):
    x = np.ones((2, 3, 4), np.float32)
    for eps in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError, match="eps"):
            igemm.batch_norm_stats(x, eps)


# ============================================================================================== launch glue (CPU)
def _driver_recorder(monkeypatch, n_slots: dict):
    """Stand-ins for the driver: kernels load as a dummy, and cuLaunchKernel records, per launch, the 64-bit
    value behind each entry of the ``void*[]`` it is handed (read while the call is in progress)."""
    import ctypes
    import types

    from cuda.bindings import driver

    from igemm import _kernel
    calls = []

    def launch(func, gx, gy, gz, bx, by, bz, smem, stream, args, extra):
        n = n_slots["n"]
        ptrs = (ctypes.c_uint64 * n).from_address(int(args))
        calls.append([ctypes.c_uint64.from_address(p).value for p in ptrs])
        return (0,)
    monkeypatch.setattr(driver, "cuLaunchKernel", launch)
    monkeypatch.setattr(_kernel, "load", lambda *a, **k: types.SimpleNamespace(handle=0))
    return calls


def _n_entries(params) -> int:
    return sum(3 if p.ctype == "fastdiv" else 1 for p in params)


def _f32(v: int) -> float:
    return float(np.array([v & 0xFFFFFFFF], np.uint32).view(np.float32)[0])


def test_index_add_launch_arguments_reach_the_driver(monkeypatch):
    """What cuLaunchKernel receives for an index_add launch: the pointers and alpha in their slots."""
    import importlib

    from igemm import _runtime
    ia = importlib.import_module("igemm.index_add")
    n = {"n": _n_entries(ia._P_MANY)}
    calls = _driver_recorder(monkeypatch, n)
    monkeypatch.setattr(ia, "_sms", lambda device_id: 132)
    plan = ia._Plan(0, "float32", "int64", 1, 10, 4, 3, ia.IndexAddConfig("many", 4))
    plan.run(_runtime.RawStream(0), 0x1000, 0x2000, 0x3000, 0.5)
    assert len(calls) == 1
    slots = calls[0]
    assert slots[:3] == [0x1000, 0x2000, 0x3000] and _f32(slots[3]) == 0.5


def test_prelu_launch_arguments_reach_the_driver(monkeypatch):
    import importlib

    from igemm import _runtime
    pm = importlib.import_module("igemm.prelu")
    n = {"n": _n_entries(pm._P_FWD)}
    calls = _driver_recorder(monkeypatch, n)
    monkeypatch.setattr(pm, "_sms", lambda device_id: 132)
    cfg = pm.forward_config(24, 3, 8, "float32", alpha_kind="channel", vec=4)
    launcher, args = pm._forward_plan.__wrapped__(0, "float32", "float32", cfg, 24, 3, 8)   # no plan cache
    launcher(_runtime.RawStream(0), args(0x1000, 0x2000, 0x3000, 0.25))
    assert len(calls) == 1
    slots = calls[0]
    assert slots[:3] == [0x1000, 0x2000, 0x3000] and _f32(slots[3]) == 0.25


def test_index_add_torch_stream_lookup(monkeypatch):
    """index_add's torch fast path resolves the current stream (a second call with a remembered geometry)."""
    import importlib
    import types
    ia = importlib.import_module("igemm.index_add")
    fake = types.SimpleNamespace(_C=types.SimpleNamespace(_cuda_getCurrentRawStream=lambda device_id: 0))
    monkeypatch.setattr(ia, "_torch", fake)
    s = ia._torch_stream(0)
    assert int(getattr(s, "handle", s)) == 0


def test_stream_device_rule():
    """A stream of another device is refused before anything is queued (the GPU row needs two GPUs)."""
    from igemm import _runtime
    with pytest.raises(ValueError, match="cuda:1 but the tensors are on cuda:0"):
        _runtime._check_stream_device(1, 0)
    _runtime._check_stream_device(0, 0)
    _runtime._check_stream_device(None, 0)          # the driver could not tell: no claim
    with pytest.raises(TypeError, match="bool"):
        _runtime.stream_handle(True, "other", 0)


@pytest.mark.gpu
def test_current_device_kept_across_devices_gpu():
    """Calls on tensors of cuda:1 run there and leave torch's current device (cuda:0) as it was -- as torch's own
    ops do; then the same calls on cuda:0 still run on cuda:0 (a device switch must not stick)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    torch.cuda.set_device(0)
    rng = np.random.default_rng(5)
    x_np = rng.standard_normal((2, 8, 9, 9)).astype(np.float32)
    w_np = rng.standard_normal((4, 8, 3, 3)).astype(np.float32)
    ref = reference.conv2d_direct(x_np.astype(np.float64), w_np.astype(np.float64), (1, 1), (1, 1), (1, 1), "NCHW")
    results = {}
    for dev in ("cuda:1", "cuda:0", "cuda:1"):
        x, w = torch.from_numpy(x_np).to(dev), torch.from_numpy(w_np).to(dev)
        y = igemm.conv2d(x, w, padding=1)
        assert torch.cuda.current_device() == 0, f"conv2d on {dev} changed the current device"
        assert y.device == x.device
        assert rel_err(to_numpy(y), ref) <= TOL["float32"], dev
        plan = Conv2dPlan(tuple(x.shape), tuple(w.shape), "float32", padding=1, device=x.device.index)
        assert torch.cuda.current_device() == 0, f"Conv2dPlan on {dev} changed the current device"
        y2 = plan(x, w)
        assert torch.equal(y, y2)
        m = igemm.relu_mask(y)
        mean, invstd = igemm.batch_norm_stats(x, 1e-5)
        xi = torch.zeros(10, device=dev)
        igemm.index_add(xi, 0, torch.tensor([1, 3], device=dev), torch.ones(2, device=dev))
        p = igemm.prelu(x, torch.tensor([0.25], device=dev))
        torch.cuda.synchronize(dev)
        assert torch.cuda.current_device() == 0, f"a call on {dev} changed the current device"
        for t in (m, mean, invstd, xi, p):
            assert t.device == x.device
        assert xi.tolist() == [0, 1, 0, 1, 0, 0, 0, 0, 0, 0]
        np.testing.assert_array_equal(to_numpy(p), np.where(x_np > 0, x_np, 0.25 * x_np).astype(np.float32))
        results.setdefault(dev, []).append(to_numpy(mean))
    np.testing.assert_array_equal(results["cuda:1"][0], results["cuda:1"][1])


@pytest.mark.gpu
def test_fresh_process_without_cuda_initialised_gpu(tmp_path):
    """In a new process where nothing has initialised CUDA yet (the driver reports no context), building a
    host plan, numpy-backend calls and a first GPU call all work, and the context guard restores "none"."""
    import subprocess
    import sys
    pytest.importorskip("torch")
    code = (
        "import numpy as np, igemm\n"
        "from igemm.conv2d import Conv2dPlan\n"
        "p = Conv2dPlan((1, 4, 6, 6), (2, 4, 3, 3), 'float32', padding=1, device=None)\n"
        "x = np.random.default_rng(0).standard_normal((1, 4, 6, 6)).astype(np.float32)\n"
        "w = np.ones((2, 4, 3, 3), np.float32)\n"
        "y = igemm.conv2d(x, w, padding=1)\n"
        "import torch\n"
        "yt = igemm.conv2d(torch.from_numpy(x).cuda(), torch.from_numpy(w).cuda(), padding=1)\n"
        "assert np.allclose(yt.cpu().numpy(), y, rtol=1e-5, atol=1e-5)\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


def test_launch_after_is_pdl_with_a_configuration_per_stream(monkeypatch):
    """Launcher.launch_after (relu_mask after a conv, sm_90+): cuLaunchKernelEx with programmatic stream
    serialization, the launcher's grid, block and shared memory, on the caller's stream; one configuration
    per stream, so that a call on another stream (another thread's) never rewrites one in use. Without
    PDL (pdl=False: before sm_90) a plain cuLaunchKernel."""
    import types

    from cuda.bindings import driver

    from igemm import _kernel
    ex, plain = [], []

    def launch_ex(cfg, func, args, extra):
        a = cfg.attrs[0]
        ex.append((cfg, int(cfg.hStream), cfg.numAttrs, a.id, a.value.programmaticStreamSerializationAllowed,
                   (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ), (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ),
                   cfg.sharedMemBytes, int(args)))
        return (0,)
    monkeypatch.setattr(driver, "cuLaunchKernelEx", launch_ex)
    monkeypatch.setattr(driver, "cuLaunchKernel", lambda *a: (plain.append(a), (0,))[1])
    args = types.SimpleNamespace(address=0x5000)
    for pdl in (True, False):
        ln = _kernel.Launcher(types.SimpleNamespace(handle=0), 7, 256, 1024, pdl=pdl)
        ln._raw = None
        ln._get_ctx, ln._set_ctx, ln._ctx, ln._ctx_id = (lambda: (0, None)), (lambda c: None), None, 0
        for s in (0x11, 0x22, 0x11):
            ln.launch_after(s, args)
    assert len(plain) == 3 and len(ex) == 3
    assert [e[1] for e in ex] == [0x11, 0x22, 0x11] and ex[0][0] is ex[2][0] and ex[0][0] is not ex[1][0]
    for e in ex:
        assert e[2:] == (1, driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1,
                         (7, 1, 1), (256, 1, 1), 1024, 0x5000), e
