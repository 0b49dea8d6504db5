"""Bad inputs of conv2d and Conv2dPlan (the conv family's rows).

``PENDING``: rows whose message does not yet start with the argument's name (or that write before the
error); the runner marks them ``xfail(strict=True)``, so a fix shows up as an unexpected pass and the
entry is removed.
"""
from __future__ import annotations

import numpy as np

import igemm
from igemm import epilogues as ep
from igemm.conv import Conv2dPlan

from . import NAN, Call, Row

V, T, NI = ValueError, TypeError, NotImplementedError


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

        def call(x, w, **fixed):
            return igemm.conv2d(x, w, **fixed, **(kw_fn(A) if kw_fn else {}))
        return Call(call, x, w, **fixed)
    return build


def _plan_row(x_shape, dtype="float32"):
    def build(A):
        plan = Conv2dPlan((2, 4, 8, 8), (3, 4, 3, 3), "float32", "NCHW", device=A.device)
        return Call(plan, A.randn(x_shape, dtype, 1), A.randn((3, 4, 3, 3), dtype, 2), out=_conv_out(A))
    return build


def _gpu_conv(fn):
    def build(A):
        x, w = _conv_xw(A)
        return fn(A, x, w)
    return build


def _buf_view(A, shape, offset, dtype="float32", fill=NAN):
    n = int(np.prod(shape))
    buf = A.full(n + offset, fill, dtype)
    return buf, A.view(buf[offset:], shape)


def _out_overlaps_w(A, x, w):
    big = A.randn((316,))
    return Call(igemm.conv2d, x, A.view(big[:108], (3, 4, 3, 3)), out=A.view(big[100:316], (2, 3, 6, 6)), keep=(big,))


def _mask_out_overlaps_out(A, x, w):
    big = A.full(224, NAN)
    return Call(igemm.conv2d, x, w, epilogue=ep.ReLU(mask=True), out=A.view(big[:216], (2, 3, 6, 6)),
                mask_out=A.as_words(big)[208:215], keep=(big,))


def _bn_vector_on_cpu(A, x, w):
    out = _conv_out(A)
    return Call(lambda: igemm.conv2d(x, w, out=out, epilogue=ep.BatchNorm(*[v.cpu() for v in _bn_vecs(A)])),
                keep=(x, w, out))


ROWS = [
    Row("conv/x-float64", conv_row(None, lambda A, x: A.arr(A.host(x), "float64"),
                                   lambda A, w: A.arr(A.host(w), "float64")), T, "x", "dtype float64", anywhere=True),
    Row("conv/int32", conv_row(None, lambda A, x: A.arr(A.host(x), "int32"), lambda A, w: A.arr(A.host(w), "int32")),
        T, "x", "dtype int32", anywhere=True),
    Row("conv/w-dtype-differs", conv_row(None, w_fn=lambda A, w: A.arr(A.host(w), "float16")), T, "w", "w: dtype"),
    Row("conv/layout-name", conv_row(lambda A: {"layout": "NWHC"}), V, "layout"),
    Row("conv/x-3d", conv_row(None, lambda A, x: x[0]), V, "x", "4-D"),
    Row("conv/w-5d", conv_row(None, w_fn=lambda A, w: w[None]), V, "w", "4-D"),
    Row("conv/channels-differ", conv_row(None, w_fn=lambda A, w: A.randn((3, 3, 3, 3), "float32", 2)), V, "w",
        "input channels", anywhere=True),
    Row("conv/x-noncontiguous", conv_row(None, lambda A, x: x[:, :, ::2], out_fn=lambda A: _conv_out(A, (2, 3, 2, 6))),
        V, "x", "contiguous"),
    # (a channels_last x is accepted as NHWC memory; then out must be channels_last too)
    Row("conv/x-channels-last-out-nchw", conv_row(None, lambda A, x: A.channels_last(x)), V, "out", "channels_last"),
    Row("conv/out-shape", conv_row(out_fn=lambda A: _conv_out(A, (2, 3, 7, 7))), V, "out", "out: expected shape"),
    Row("conv/out-dtype", conv_row(out_fn=lambda A: _conv_out(A, dtype="float16")), T, "out"),
    Row("conv/out-noncontiguous", conv_row(out_fn=lambda A: _conv_out(A, (2, 3, 6, 12))[..., ::2]), V, "out",
        "contiguous"),
    Row("conv/empty-batch", conv_row(None, lambda A, x: x[:0], out_fn=None), V, "x", "empty", anywhere=True),
    Row("conv/zero-width", conv_row(None, lambda A, x: A.full((2, 4, 8, 0), 1.0), out_fn=None), V, "x", "empty",
        anywhere=True),
    Row("conv/zero-filters", conv_row(None, w_fn=lambda A, w: A.full((0, 4, 3, 3), 1.0), out_fn=None), V, "w",
        "empty", anywhere=True),
    Row("conv/filter-does-not-fit", conv_row(lambda A: {"dilation": 2}, lambda A, x: A.randn((2, 4, 2, 2)),
                                             out_fn=None), V, "w", "does not fit", anywhere=True),
    Row("conv/stride-0", conv_row(lambda A: {"stride": 0}), V, "stride"),
    Row("conv/stride-triple", conv_row(lambda A: {"stride": (1, 2, 3)}), V, "stride"),
    Row("conv/stride-float", conv_row(lambda A: {"stride": 1.5}), T, "stride"),
    Row("conv/padding-negative", conv_row(lambda A: {"padding": -1}), V, "padding"),
    Row("conv/dilation-0", conv_row(lambda A: {"dilation": 0}), V, "dilation"),
    Row("conv/precision", conv_row(lambda A: {"precision": "fast"}), V, "precision"),
    Row("conv/epilogue-type", conv_row(lambda A: {"epilogue": "relu"}), T, "epilogue"),
    Row("conv/bn-vector-length", conv_row(lambda A: {"epilogue": ep.BatchNorm(*[v[:2] for v in _bn_vecs(A)])}),
        V, "gamma", "gamma.*3"),
    Row("conv/bn-vector-int", conv_row(lambda A: {"epilogue": ep.BatchNorm(
        *[A.arr(A.host(v), "int32") if i == 2 else v for i, v in enumerate(_bn_vecs(A))])}), T, "mean"),
    Row("conv/bn-vector-2d", conv_row(lambda A: {"epilogue": ep.BatchNorm(*[v.reshape(3, 1) for v in _bn_vecs(A)])}),
        V, "gamma", "1-D"),
    Row("conv/bn-eps-negative", conv_row(lambda A: {"epilogue": ep.BatchNorm(*_bn_vecs(A), eps=-1.0)}), V, "eps"),
    Row("conv/bias-length", conv_row(lambda A: {"epilogue": ep.Bias(A.arr([1.0, 2.0]))}), V, "bias"),
    Row("conv/prelu-alpha-length", conv_row(lambda A: {"epilogue": ep.PReLU(A.arr([0.1, 0.2]))}), V, "alpha"),
    Row("conv/prelu-alpha-one-element", conv_row(lambda A: {"epilogue": ep.PReLU(A.arr([0.1]))}), V, "alpha",
        "Python float"),
    Row("conv/residual-shape", conv_row(lambda A: {"epilogue": ep.Add(A.randn((2, 3, 6, 5)))}), V, "residual",
        "residual.*shape"),
    Row("conv/residual-int", conv_row(lambda A: {"epilogue": ep.Add(A.full((2, 3, 6, 6), 1, "int32"))}), T,
        "residual"),
    Row("conv/residual-without-add", conv_row(lambda A: {"residual": A.randn((2, 3, 6, 6))}), V, "residual", "Add"),
    Row("conv/add-without-residual", conv_row(lambda A: {"epilogue": ep.Add()}), V, "residual", "pass residual",
        anywhere=True),
    Row("conv/mask-out-without-mask", conv_row(lambda A: {"epilogue": ep.ReLU()}, mask_fn=lambda A: A.words(7)),
        V, "mask_out"),
    Row("conv/mask-out-too-short", conv_row(lambda A: {"epilogue": ep.ReLU(mask=True)}, mask_fn=lambda A: A.words(6)),
        V, "mask_out"),
    Row("conv/mask-out-float", conv_row(lambda A: {"epilogue": ep.ReLU(mask=True)}, mask_fn=lambda A: A.full(7, NAN)),
        T, "mask_out"),
    Row("conv/mask-relu-not-last", conv_row(lambda A: {"epilogue": ep.chain(ep.ReLU(mask=True), ep.Bias(A.arr(
        [1.0, 2.0, 3.0])))}), V, "epilogue", "last", anywhere=True),
    Row("conv/two-activations", conv_row(lambda A: {"epilogue": ep.chain(ep.ReLU(), ep.PReLU(0.1))}), NI,
        "epilogue", "activation", anywhere=True),
    Row("conv/plan-x-shape", _plan_row((2, 4, 9, 8)), V, "x", "x: expected shape"),
    Row("conv/plan-x-dtype", _plan_row((2, 4, 8, 8), "float16"), T, "x", "x: expected dtype"),
    Row("conv/plan-too-many-pixels", lambda A: Call(Conv2dPlan, (2 ** 12, 1, 2 ** 10, 2 ** 10), (1, 1, 1, 1),
                                                    "float16", device=A.device), NI, "x_shape", r"2\*\*31",
        anywhere=True),
    Row("conv/plan-image-too-big", lambda A: Call(Conv2dPlan, (1, 32769, 256, 256), (1, 32769, 1, 1), "float16",
                                                  stride=256, device=A.device), NI, "x_shape", "per image",
        anywhere=True),
    Row("conv/plan-config-field", lambda A: Call(lambda: Conv2dPlan((2, 8, 8, 16), (32, 3, 3, 16), "float16", "NHWC",
                                                                    device=A.device, options=igemm.Conv2dOptions(config={"tile": 3})).spec()),
        V, "config", "unknown", anywhere=True),
    # ----------------------------------------------------------------------------------- GPU only
    Row("conv/x-on-cpu", _gpu_conv(lambda A, x, w: Call(igemm.conv2d, x.cpu(), w)), T, "x", "cpu", where="gpu"),
    Row("conv/w-numpy-x-cuda", _gpu_conv(lambda A, x, w: Call(igemm.conv2d, x, w.cpu().numpy(), out=_conv_out(A))),
        T, "w", r"host \(numpy\)", where="gpu"),
    Row("conv/out-numpy", _gpu_conv(lambda A, x, w: Call(igemm.conv2d, x, w, out=np.full((2, 3, 6, 6), np.nan,
                                                                                         np.float32))),
        T, "out", r"host \(numpy\)", where="gpu"),
    Row("conv/bn-vector-on-cpu", _gpu_conv(_bn_vector_on_cpu), T, "gamma", "gamma.*cpu", where="gpu"),
    Row("conv/out-misaligned", _gpu_conv(lambda A, x, w: (lambda bv: Call(igemm.conv2d, x, w, out=bv[1], keep=(bv[0],)))(
        _buf_view(A, (2, 3, 6, 6), 1))), V, "out", "aligned", where="gpu"),
    Row("conv/residual-misaligned", _gpu_conv(lambda A, x, w: Call(
        igemm.conv2d, x, w, out=_conv_out(A), epilogue=ep.Add(), residual=_buf_view(A, (2, 3, 6, 6), 2, fill=1.0)[1])),
        V, "residual", "residual.*aligned", where="gpu"),
    Row("conv/out-overlaps-x", _gpu_conv(lambda A, x, w: Call(igemm.conv2d, x, w, out=A.view(A.flat(x)[:216],
                                                                                             (2, 3, 6, 6)))),
        V, "out", "overlap", where="gpu"),
    Row("conv/out-overlaps-w", _gpu_conv(_out_overlaps_w), V, "out", "overlap", where="gpu"),
    Row("conv/mask-out-overlaps-out", _gpu_conv(_mask_out_overlaps_out), V, "mask_out", "overlap", where="gpu"),
    Row("conv/mask-out-overlaps-x", _gpu_conv(lambda A, x, w: Call(
        igemm.conv2d, x, w, epilogue=ep.ReLU(mask=True), out=_conv_out(A), mask_out=A.as_words(A.flat(x))[:7])),
        V, "mask_out", "overlap", where="gpu"),
    Row("conv/stream-type", _gpu_conv(lambda A, x, w: Call(igemm.conv2d, x, w, out=_conv_out(A), stream="default")),
        T, "stream", where="gpu"),
    Row("conv/plan-stream-type", _gpu_conv(lambda A, x, w: Call(Conv2dPlan((2, 4, 8, 8), (3, 4, 3, 3), "float32"), x,
                                                                w, out=_conv_out(A), stream=1.5)),
        T, "stream", where="gpu"),
    Row("conv/plan-other-device", _gpu_conv(lambda A, x, w: Call(
        Conv2dPlan((2, 4, 8, 8), (3, 4, 3, 3), "float32", device=1), x, w)), V, "x", "cuda:1", where="gpu",
        multigpu=True, anywhere=True),
    Row("conv/tensors-on-two-devices", _gpu_conv(lambda A, x, w: Call(igemm.conv2d, x, w.to("cuda:1"))), V, "w",
        "different devices", where="gpu", multigpu=True, anywhere=True),
]

PENDING: dict = {}
