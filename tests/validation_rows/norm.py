"""Bad inputs of the BatchNorm family: statistics, the BN(-Add)-ReLU forward and the backward passes.

x is (2, 3, 4, 4) NCHW (C = 3) unless a row says otherwise; per-channel vectors are fp32 [3]. Outputs and
in-place arguments (out, mask_out, running statistics) are made pre-filled and must stay unchanged.
"""
from __future__ import annotations

import igemm

from . import NAN, Call, Row, variants

V, T = ValueError, TypeError
X = (2, 3, 4, 4)


def _x(A):
    return A.randn(X, "float32", 8)


def _c(A, v=1.0):
    return A.full(3, v)


wf = variants(igemm.welford, ("x",), lambda A: dict(x=_x(A), out=(_c(A, NAN), _c(A, NAN), _c(A, NAN))))
st = variants(igemm.batch_norm_stats, ("x", "eps"),
              lambda A: dict(x=_x(A), eps=1e-5, running_mean=_c(A, 0.0), running_var=_c(A, 1.0),
                             out=(_c(A, NAN), _c(A, NAN))))
ga = variants(igemm.batch_norm_gather_stats, ("means", "vars", "counts"),
              lambda A: dict(means=A.full((2, 3), 1.0), vars=A.full((2, 3), 2.0), counts=A.full(2, 4.0),
                             out=(_c(A, NAN), _c(A, NAN), _c(A, NAN))))
el = variants(igemm.batch_norm_elemt, ("x", "mean", "invstd", "weight", "bias"),
              lambda A: dict(x=_x(A), mean=_c(A, 0.5), invstd=_c(A, 2.0), weight=_c(A), bias=_c(A, 0.0),
                             out=A.full(X, NAN)))
br = variants(igemm.batch_norm_relu, ("x", "mean", "invstd", "gamma", "beta"),
              lambda A: dict(x=_x(A), mean=_c(A, 0.5), invstd=_c(A, 2.0), gamma=_c(A), beta=_c(A, 0.0),
                             out=A.full(X, NAN), mask_out=A.words(3)))
rd = variants(igemm.batch_norm_backward_reduce, ("dy", "x", "mean", "invstd", "weight"),
              lambda A: dict(dy=A.randn(X, "float32", 9), x=_x(A), mean=_c(A, 0.5), invstd=_c(A, 2.0), weight=_c(A),
                             mask=A.words(3, 0x5A5A5A5A), out=tuple(_c(A, NAN) for _ in range(4))))
ee = variants(igemm.batch_norm_backward_elemt, ("dy", "x", "mean", "invstd", "weight", "sum_dy", "sum_dy_xmu",
                                                "count"),
              lambda A: dict(dy=A.randn(X, "float32", 9), x=_x(A), mean=_c(A, 0.5), invstd=_c(A, 2.0), weight=_c(A),
                             sum_dy=_c(A, 0.25), sum_dy_xmu=_c(A, 0.125), count=32, mask=A.words(3, 0x5A5A5A5A),
                             out=A.full(X, NAN)))
rb = variants(igemm.batch_norm_relu_backward, ("dy", "x", "mask", "mean", "invstd", "gamma"),
              lambda A: dict(dy=A.randn(X, "float32", 9), x=_x(A), mask=A.words(3, 0x5A5A5A5A), mean=_c(A, 0.5),
                             invstd=_c(A, 2.0), gamma=_c(A)))


def _view_of(A, k, name, length=3, offset=0):
    """A view of ``length`` elements into argument ``name`` (an overlap)."""
    return A.flat(k[name])[offset:offset + length]


def _share(A, k, n):
    """One array given n times."""
    return (A.full(3, NAN),) * n


def _wf_out_over_x(A):
    x = _x(A)
    return Call(igemm.welford, x, out=(A.flat(x)[:3], _c(A, NAN), _c(A, NAN)), keep=(x,))


def _st_out_over_running(A):
    rm = _c(A, 0.0)
    return Call(igemm.batch_norm_stats, _x(A), 1e-5, running_mean=rm, running_var=_c(A, 1.0), out=(rm, _c(A, NAN)))


def _mask_out_over_out(A):
    out = A.full(X, NAN)
    return Call(igemm.batch_norm_relu, _x(A), _c(A, 0.5), _c(A, 2.0), out=out, mask_out=A.as_words(A.flat(out))[:3],
                keep=(out,))


ROWS = [
    # ------------------------------------------------------------------------------------------- welford
    Row("welford/x-none", wf(x=None), T, "x", "expected an array, got None"),
    Row("welford/x-int", wf(x=lambda A, k: A.full((2, 3, 4), 1, "int32")), T, "x", "dtype int32"),
    Row("welford/x-1d", wf(x=lambda A, k: A.randn(5)), V, "x", "at least 2 dimensions"),
    Row("welford/no-channels", wf(x=lambda A, k: A.full((2, 0, 3), 1.0)), V, "x", "no channels"),
    Row("welford/x-noncontiguous", wf(x=lambda A, k: A.randn((2, 3, 4, 8))[..., ::2]), V, "x", "contiguous"),
    Row("welford/x-unaligned", wf(x=lambda A, k: A.unaligned(X, 1.0)), V, "x", "aligned"),
    Row("welford/layout", wf(layout="NCWH"), V, "layout"),
    Row("welford/layout-none", wf(layout=None), T, "layout"),
    Row("welford/out-tuple-length", wf(out=lambda A, k: k["out"][:2]), T, "out", "tuple of 3"),
    Row("welford/out-an-array", wf(out=lambda A, k: _c(A, NAN)), T, "out", "tuple of 3"),
    Row("welford/out-shape", wf(out=lambda A, k: (k["out"][0], A.full(4, NAN), k["out"][2])), V, "out.var",
        r"expected shape \(3,\)"),
    Row("welford/out-int", wf(out=lambda A, k: (k["out"][0], k["out"][1], A.full(3, 7, "int32"))), T, "out.count"),
    Row("welford/out-mixed-dtypes", wf(out=lambda A, k: (k["out"][0], A.full(3, NAN, "float64"), k["out"][2])), T,
        "out", "share one dtype"),
    Row("welford/out-count-read-only", wf(out=lambda A, k: (*k["out"][:2], A.readonly(k["out"][2]))), V, "out.count",
        "read-only"),
    Row("welford/out-one-array-thrice", wf(out=lambda A, k: _share(A, k, 3)), V, "out.mean", "overlap"),
    Row("welford/out-mean-is-var", wf(out=lambda A, k: (k["out"][0], k["out"][0], k["out"][2])), V, "out.mean",
        "overlap"),
    Row("welford/out-overlaps-x", _wf_out_over_x, V, "out.mean", "overlap"),
    Row("welford/out-noncontiguous", wf(out=lambda A, k: (A.full(6, NAN)[::2], *k["out"][1:])), V, "out.mean",
        "contiguous"),
    Row("welford/out-unaligned", wf(out=lambda A, k: (*k["out"][:2], A.unaligned((3,)))), V, "out.count", "aligned"),
    Row("welford/stream-string", wf(stream="s"), T, "stream"),
    # ------------------------------------------------------------------------------------------- batch_norm_stats
    Row("batch_norm_stats/x-none", st(x=None), T, "x", "expected an array, got None"),
    Row("batch_norm_stats/eps-negative", st(eps=-1.0), V, "eps", ">= 0"),
    Row("batch_norm_stats/eps-nan", st(eps=NAN), V, "eps", "finite"),
    Row("batch_norm_stats/eps-inf", st(eps=float("inf")), V, "eps", "finite"),
    Row("batch_norm_stats/eps-string", st(eps="1e-5"), T, "eps"),
    Row("batch_norm_stats/eps-bool", st(eps=True), T, "eps"),
    Row("batch_norm_stats/eps-none", st(eps=None), T, "eps"),
    Row("batch_norm_stats/eps-complex", st(eps=1e-5j), T, "eps"),
    Row("batch_norm_stats/eps-array", st(eps=lambda A, k: A.arr([1e-5])), T, "eps"),
    Row("batch_norm_stats/momentum-above-one", st(momentum=2.0), V, "momentum"),
    Row("batch_norm_stats/momentum-negative", st(momentum=-0.1), V, "momentum"),
    Row("batch_norm_stats/momentum-nan", st(momentum=NAN), V, "momentum"),
    Row("batch_norm_stats/momentum-string", st(momentum="0.1"), T, "momentum"),
    Row("batch_norm_stats/layout", st(layout="CHWN"), V, "layout"),
    Row("batch_norm_stats/running-mean-only", st(running_var=None), V, "running_var", "give both or neither"),
    Row("batch_norm_stats/running-var-only", st(running_mean=None), V, "running_mean", "give both or neither"),
    Row("batch_norm_stats/running-var-shape", st(running_var=lambda A, k: A.full(4, 1.0)), V, "running_var", "shape"),
    Row("batch_norm_stats/running-var-dtype", st(running_var=lambda A, k: A.full(3, 1.0, "float16")), T,
        "running_var"),
    Row("batch_norm_stats/running-var-read-only", st(running_var=lambda A, k: A.readonly(k["running_var"])), V,
        "running_var", "read-only"),
    Row("batch_norm_stats/running-mean-read-only", st(running_mean=lambda A, k: A.readonly(k["running_mean"])), V,
        "running_mean", "read-only"),
    Row("batch_norm_stats/running-one-array", st(running_var=lambda A, k: k["running_mean"]), V, "running_mean",
        "overlap"),
    Row("batch_norm_stats/running-overlaps-x", st(running_var=lambda A, k: _view_of(A, k, "x")), V, "running_var",
        "overlap"),
    Row("batch_norm_stats/running-noncontiguous", st(running_mean=lambda A, k: A.full(6, 0.0)[::2]), V,
        "running_mean", "contiguous"),
    Row("batch_norm_stats/running-unaligned", st(running_mean=lambda A, k: A.unaligned((3,), 0.0)), V,
        "running_mean", "aligned"),
    Row("batch_norm_stats/out-invstd-read-only", st(out=lambda A, k: (k["out"][0], A.readonly(k["out"][1]))), V,
        "out.invstd", "read-only"),
    Row("batch_norm_stats/out-dtype", st(out=lambda A, k: (k["out"][0], A.full(3, NAN, "float64"))), T,
        "out.invstd"),
    Row("batch_norm_stats/out-overlaps-running", _st_out_over_running, V, "out.mean", "overlap"),
    Row("batch_norm_stats/out-one-array-twice", st(out=lambda A, k: _share(A, k, 2)), V, "out.mean", "overlap"),
    Row("batch_norm_stats/out-overlaps-x", st(out=lambda A, k: (_view_of(A, k, "x"), k["out"][1])), V, "out.mean",
        "overlap"),
    # ------------------------------------------------------------------------------------------- gather
    Row("batch_norm_gather_stats/means-none", ga(means=None), T, "means", "expected an array, got None"),
    Row("batch_norm_gather_stats/vars-none", ga(vars=None), T, "vars", "expected an array, got None"),
    Row("batch_norm_gather_stats/counts-none", ga(counts=None), T, "counts", "expected an array, got None"),
    Row("batch_norm_gather_stats/counts-shape", ga(counts=lambda A, k: A.full(3, 1.0)), V, "counts",
        "expected shape"),
    Row("batch_norm_gather_stats/counts-float16", ga(counts=lambda A, k: A.full(2, 1.0, "float16")), T, "counts"),
    Row("batch_norm_gather_stats/vars-dtype", ga(means=lambda A, k: A.full((2, 3), 1.0, "float64")), T, "vars",
        "dtype"),
    Row("batch_norm_gather_stats/vars-shape", ga(vars=lambda A, k: A.full((2, 4), 1.0)), V, "vars", "shape"),
    Row("batch_norm_gather_stats/means-1d", ga(means=lambda A, k: A.full(3, 1.0)), V, "means", "2-D"),
    Row("batch_norm_gather_stats/means-int", ga(means=lambda A, k: A.full((2, 3), 1, "int32")), T, "means"),
    Row("batch_norm_gather_stats/means-no-channels", ga(means=lambda A, k: A.full((2, 0), 1.0),
                                                      vars=lambda A, k: A.full((2, 0), 1.0)), V, "means",
        "no channels"),
    Row("batch_norm_gather_stats/out-shape", ga(out=lambda A, k: (k["out"][0], A.full(4, NAN), k["out"][2])), V,
        "out.var", "shape"),
    Row("batch_norm_gather_stats/out-dtype", ga(out=lambda A, k: (A.full(3, NAN, "float64"), *k["out"][1:])), T,
        "out.mean"),
    Row("batch_norm_gather_stats/out-read-only", ga(out=lambda A, k: (*k["out"][:2], A.readonly(k["out"][2]))), V,
        "out.count", "read-only"),
    Row("batch_norm_gather_stats/out-one-array-thrice", ga(out=lambda A, k: _share(A, k, 3)), V, "out.mean",
        "overlap"),
    Row("batch_norm_gather_stats/out-overlaps-means", ga(out=lambda A, k: (_view_of(A, k, "means"), *k["out"][1:])),
        V, "out.mean", "overlap"),
    # ------------------------------------------------------------------------------------------- batch_norm_elemt
    Row("batch_norm_elemt/x-none", el(x=None), T, "x", "expected an array, got None"),
    Row("batch_norm_elemt/mean-none", el(mean=None), T, "mean", "expected an array, got None"),
    Row("batch_norm_elemt/invstd-none", el(invstd=None), T, "invstd", "expected an array, got None"),
    Row("batch_norm_elemt/weight-shape", el(weight=lambda A, k: A.full(4, 1.0)), V, "weight", "shape"),
    Row("batch_norm_elemt/bias-dtype", el(bias=lambda A, k: A.full(3, 0.0, "float16")), T, "bias"),
    Row("batch_norm_elemt/mean-2d", el(mean=lambda A, k: A.full((3, 1), 0.0)), V, "mean", "shape"),
    Row("batch_norm_elemt/residual-shape", el(residual=lambda A, k: A.randn((2, 3, 4, 5))), V, "residual", "shape"),
    Row("batch_norm_elemt/residual-dtype", el(residual=lambda A, k: A.randn(X, "float16")), T, "residual"),
    Row("batch_norm_elemt/out-shape", el(out=lambda A, k: A.full((2, 3, 4, 5), NAN)), V, "out", "shape"),
    Row("batch_norm_elemt/out-dtype", el(out=lambda A, k: A.full(X, NAN, "float16")), T, "out"),
    Row("batch_norm_elemt/out-is-x", el(out=lambda A, k: k["x"]), V, "out", "overlap"),
    Row("batch_norm_elemt/out-read-only", el(out=lambda A, k: A.readonly(k["out"])), V, "out", "read-only"),
    Row("batch_norm_elemt/out-overlaps-residual", el(residual=lambda A, k: k["out"]), V, "out", "overlap"),
    Row("batch_norm_elemt/layout", el(layout="nchw"), V, "layout"),
    # ------------------------------------------------------------------------------------------- batch_norm_relu
    Row("batch_norm_relu/mean-shape-nhwc", br(layout="NHWC"), V, "mean", r"expected shape \(4,\)"),
    Row("batch_norm_relu/invstd-dtype", br(invstd=lambda A, k: A.arr([1, 2, 3], "float16")), T, "invstd"),
    Row("batch_norm_relu/residual-shape", br(residual=lambda A, k: A.randn((2, 3, 4, 5))), V, "residual"),
    Row("batch_norm_relu/mean-none", br(mean=None), T, "mean", "expected an array, got None"),
    Row("batch_norm_relu/x-noncontiguous", br(x=lambda A, k: A.channels_last(k["x"])), V, "x", "contiguous"),
    Row("batch_norm_relu/gamma-2d", br(gamma=lambda A, k: A.full((1, 3), 1.0)), V, "gamma", "shape"),
    Row("batch_norm_relu/beta-noncontiguous", br(beta=lambda A, k: A.full(6, 0.0)[::2]), V, "beta", "contiguous"),
    Row("batch_norm_relu/mask-out-too-short", br(mask_out=lambda A, k: A.words(2)), V, "mask_out", "at least 3"),
    Row("batch_norm_relu/mask-out-float", br(mask_out=lambda A, k: A.full(3, NAN)), T, "mask_out"),
    Row("batch_norm_relu/mask-out-2d", br(mask_out=lambda A, k: A.view(A.words(4), (2, 2))), V, "mask_out"),
    Row("batch_norm_relu/mask-out-read-only", br(mask_out=lambda A, k: A.readonly(k["mask_out"])), V, "mask_out",
        "read-only"),
    Row("batch_norm_relu/mask-out-unaligned", br(mask_out=lambda A, k: A.unaligned((3,), 7, "uint32")), V,
        "mask_out", "aligned"),
    Row("batch_norm_relu/mask-out-without-return-mask", br(return_mask=False), V, "mask_out", "return_mask"),
    Row("batch_norm_relu/return-mask-string", br(return_mask="no"), T, "return_mask"),
    Row("batch_norm_relu/mask-out-overlaps-out", _mask_out_over_out, V, "mask_out", "overlap"),
    Row("batch_norm_relu/mask-out-overlaps-x", br(mask_out=lambda A, k: A.as_words(_view_of(A, k, "x"))), V,
        "mask_out", "overlap"),
    Row("batch_norm_relu/out-read-only", br(out=lambda A, k: A.readonly(k["out"])), V, "out", "read-only"),
    Row("batch_norm_relu/out-overlaps-mean", br(mean=lambda A, k: _view_of(A, k, "out")), V, "out", "overlap"),
    Row("batch_norm_relu/stream-float", br(stream=2.5), T, "stream"),
    # ------------------------------------------------------------------------------------------- backward_reduce
    Row("batch_norm_backward_reduce/dy-none", rd(dy=None), T, "dy", "expected an array, got None"),
    Row("batch_norm_backward_reduce/invstd-none", rd(invstd=None), T, "invstd", "expected an array, got None"),
    Row("batch_norm_backward_reduce/dy-shape", rd(dy=lambda A, k: A.randn((1, 3, 4, 4))), V, "dy", "shape"),
    Row("batch_norm_backward_reduce/dy-dtype", rd(dy=lambda A, k: A.randn(X, "float16")), T, "dy", "dtype"),
    Row("batch_norm_backward_reduce/mask-short", rd(mask=lambda A, k: A.words(2)), V, "mask", "at least 3"),
    Row("batch_norm_backward_reduce/mask-float", rd(mask=lambda A, k: A.full(3, 1.0)), T, "mask"),
    Row("batch_norm_backward_reduce/weight-shape", rd(weight=lambda A, k: A.full(2, 1.0)), V, "weight", "shape"),
    Row("batch_norm_backward_reduce/input-g-string", rd(input_g="yes"), T, "input_g"),
    Row("batch_norm_backward_reduce/out-tuple-length", rd(out=lambda A, k: k["out"][:3]), T, "out", "tuple of 4"),
    Row("batch_norm_backward_reduce/out-for-unwanted-sum", rd(input_g=False), V, "out.sum_dy", "input_g"),
    Row("batch_norm_backward_reduce/out-for-unwanted-grad-bias", rd(bias_g=False), V, "out.grad_bias", "bias_g"),
    Row("batch_norm_backward_reduce/out-dtype", rd(out=lambda A, k: (*k["out"][:2], A.full(3, NAN, "float64"),
                                                                     k["out"][3])), T, "out.grad_weight"),
    Row("batch_norm_backward_reduce/out-read-only", rd(out=lambda A, k: (*k["out"][:3], A.readonly(k["out"][3]))),
        V, "out.grad_bias", "read-only"),
    Row("batch_norm_backward_reduce/out-one-array", rd(out=lambda A, k: _share(A, k, 4)), V, "out.sum_dy", "overlap"),
    Row("batch_norm_backward_reduce/out-overlaps-x", rd(out=lambda A, k: (_view_of(A, k, "x"), *k["out"][1:])), V,
        "out.sum_dy", "overlap"),
    Row("batch_norm_backward_reduce/out-overlaps-mean", rd(out=lambda A, k: (k["out"][0], k["mean"], *k["out"][2:])),
        V, "out.sum_dy_xmu", "overlap"),
    # ------------------------------------------------------------------------------------------- backward_elemt
    Row("batch_norm_backward_elemt/count-zero", ee(count=0), V, "count", "> 0"),
    Row("batch_norm_backward_elemt/count-negative", ee(count=-4.0), V, "count", "> 0"),
    Row("batch_norm_backward_elemt/count-nan", ee(count=NAN), V, "count", "finite"),
    Row("batch_norm_backward_elemt/count-string", ee(count="32"), T, "count"),
    Row("batch_norm_backward_elemt/count-none", ee(count=None), T, "count", "got None"),
    Row("batch_norm_backward_elemt/count-bool", ee(count=True), T, "count"),
    Row("batch_norm_backward_elemt/count-shape", ee(count=lambda A, k: A.full(2, 4.0)), V, "count", "expected 1 or 3"),
    Row("batch_norm_backward_elemt/count-dtype", ee(count=lambda A, k: A.full(3, 4.0, "float64")), T, "count"),
    Row("batch_norm_backward_elemt/sum-dy-none", ee(sum_dy=None), T, "sum_dy", "expected an array, got None"),
    Row("batch_norm_backward_elemt/sum-dy-shape", ee(sum_dy=lambda A, k: A.full(4, 0.0)), V, "sum_dy", "shape"),
    Row("batch_norm_backward_elemt/sum-dy-xmu-dtype", ee(sum_dy_xmu=lambda A, k: A.full(3, 0.0, "float16")), T,
        "sum_dy_xmu"),
    Row("batch_norm_backward_elemt/weight-dtype", ee(weight=lambda A, k: A.full(3, 1.0, "float64")), T, "weight"),
    Row("batch_norm_backward_elemt/mask-short", ee(mask=lambda A, k: A.words(1)), V, "mask", "at least 3"),
    Row("batch_norm_backward_elemt/out-shape", ee(out=lambda A, k: A.full((2, 3, 4, 5), NAN)), V, "out", "shape"),
    Row("batch_norm_backward_elemt/out-read-only", ee(out=lambda A, k: A.readonly(k["out"])), V, "out", "read-only"),
    Row("batch_norm_backward_elemt/out-is-dy", ee(out=lambda A, k: k["dy"]), V, "out", "overlap"),
    Row("batch_norm_backward_elemt/residual-grad-out-without-flag", ee(residual_grad_out=lambda A, k: A.full(X, NAN)),
        V, "residual_grad_out", "residual_grad"),
    Row("batch_norm_backward_elemt/residual-grad-string", ee(residual_grad="yes"), T, "residual_grad"),
    Row("batch_norm_backward_elemt/residual-grad-out-is-out", ee(residual_grad=True,
                                                                residual_grad_out=lambda A, k: k["out"]),
        V, "residual_grad_out", "overlap"),
    Row("batch_norm_backward_elemt/residual-grad-out-dtype", ee(residual_grad=True, residual_grad_out=lambda A, k:
                                                                 A.full(X, NAN, "float16")), T, "residual_grad_out"),
    # ------------------------------------------------------------------------------------------- relu_backward
    Row("batch_norm_relu_backward/mask-none", rb(mask=None), T, "mask", "expected an array, got None"),
    Row("batch_norm_relu_backward/count-zero", rb(count=0), V, "count", "> 0"),
    Row("batch_norm_relu_backward/count-shape", rb(count=lambda A, k: A.full(2, 32.0)), V, "count"),
    Row("batch_norm_relu_backward/residual-string", rb(residual="yes"), T, "residual"),
    Row("batch_norm_relu_backward/gamma-shape", rb(gamma=lambda A, k: A.full(4, 1.0)), V, "gamma", "shape"),
    Row("batch_norm_relu_backward/dy-shape", rb(dy=lambda A, k: A.randn((2, 3, 4, 5))), V, "dy", "shape"),
    Row("batch_norm_relu_backward/mask-float", rb(mask=lambda A, k: A.full(3, 1.0)), T, "mask"),
    # ----------------------------------------------------------------------------------- GPU only
    Row("batch_norm_stats/x-on-cpu", st(x=lambda A, k: k["x"].cpu()), T, "x", "cpu", where="gpu"),
    Row("batch_norm_stats/running-var-numpy", st(running_var=lambda A, k: k["running_var"].cpu().numpy()), T,
        "running_var", r"host \(numpy\)", where="gpu"),
    Row("batch_norm_relu/mask-out-numpy", br(mask_out=lambda A, k: k["mask_out"].cpu().numpy()), T, "mask_out",
        r"host \(numpy\)", where="gpu"),
    Row("batch_norm_backward_elemt/count-on-cpu", ee(count=lambda A, k: A.full(3, 32.0).cpu()), T, "count", "cpu",
        where="gpu"),
]
