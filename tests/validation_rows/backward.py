"""Bad inputs of the convolution backward (issue 40, item 5): ``conv2d_grad_input``, ``conv2d_grad_weight``,
``conv2d_grad_prologue``, ``Conv2dGradInputPlan`` and ``Conv2dGradWeightPlan``.

One small problem throughout: x (2, 4, 8, 8), w (3, 4, 3, 3), padding 1 -> dy (2, 3, 8, 8), float32, NCHW; the
ReLU mask of dy is 12 words; a :class:`igemm.GradPrologue` is built directly (z of dy's shape, coef 3 x 3) so
that its rows do not depend on ``conv2d_grad_prologue``. ``GradPrologue`` has ``__slots__`` (no ``__dict__``),
which the runner's ``watched`` does not look into: its arrays are passed in ``keep`` to be watched."""
from __future__ import annotations

import igemm

from . import NAN, Call, Row, variants

V, T = ValueError, TypeError

X, W, DY = (2, 4, 8, 8), (3, 4, 3, 3), (2, 3, 8, 8)
MASK_WORDS = 12                                   # ceil(2*3*8*8 / 32)


def _prologue(A, z=None, coef=None):
    z = A.randn(DY, "float32", 7) if z is None else z
    coef = A.randn((3, 3), "float32", 8) if coef is None else coef
    return igemm.GradPrologue(z, coef)


def _with_prologue(**pro):
    """A change setting ``prologue=`` (and watching its arrays through ``keep``)."""
    def change(A, kw):
        p = _prologue(A, **{k: f(A) for k, f in pro.items()})
        kw["keep"] = (p.z, p.coef)
        return p
    return change


gi = variants(igemm.conv2d_grad_input, ("dy", "w", "x_shape"),
              lambda A: dict(dy=A.randn(DY, "float32", 1), w=A.randn(W, "float32", 2), x_shape=X, padding=1,
                             out=A.full(X, NAN)))
gw = variants(igemm.conv2d_grad_weight, ("x", "dy", "w_shape"),
              lambda A: dict(x=A.randn(X, "float32", 3), dy=A.randn(DY, "float32", 4), w_shape=W, padding=1,
                             out=A.full(W, NAN)))
gp = variants(igemm.conv2d_grad_prologue, ("dy", "z", "mean", "invstd", "gamma"),
              lambda A: dict(dy=A.randn(DY, "float32", 5), z=A.randn(DY, "float32", 6),
                             mean=A.full(3, 0.1), invstd=A.full(3, 2.0), gamma=A.full(3, 1.5)))


def _as(name, dtype):
    """A change: argument ``name`` in another dtype."""
    return lambda A, kw: A.arr(A.host(kw[name]), dtype)


def _gi_out_overlaps_dy(A):
    buf = A.randn((512,), "float32", 9)
    return Call(igemm.conv2d_grad_input, A.view(buf[128:512], DY), A.randn(W, "float32", 2), X, padding=1,
                out=A.view(buf, X), keep=(buf,))


def _gi_out_overlaps_w(A):
    buf = A.randn((600,), "float32", 9)
    return Call(igemm.conv2d_grad_input, A.randn(DY, "float32", 1), A.view(buf[:108], W), X, padding=1,
                out=A.view(buf[88:600], X), keep=(buf,))


def _gw_out_overlaps_x(A):
    buf = A.randn((512,), "float32", 9)
    return Call(igemm.conv2d_grad_weight, A.view(buf, X), A.randn(DY, "float32", 4), W, padding=1,
                out=A.view(buf[400:508], W), keep=(buf,))


def _gw_out_overlaps_dy(A):
    buf = A.randn((400,), "float32", 9)
    return Call(igemm.conv2d_grad_weight, A.randn(X, "float32", 3), A.view(buf[:384], DY), W, padding=1,
                out=A.view(buf[292:400], W), keep=(buf,))


def _gi_plan(built=(), dy_shape=DY, dtype="float32", **call):
    """A call of a dgrad plan built with the flags ``built`` (``("mask",)``, ...); ``call``: name -> f(A), the
    call's fused arguments."""
    def build(A):
        plan = igemm.Conv2dGradInputPlan(X, W, "float32", "NCHW", 1, 1, 1, mask="mask" in built,
                                         prologue="prologue" in built, device=A.device)
        kw = {k: f(A) for k, f in call.items()}
        keep = (kw["prologue"].z, kw["prologue"].coef) if "prologue" in kw else ()
        return Call(plan, A.randn(dy_shape, dtype, 1), A.randn(W, dtype, 2), out=A.full(X, NAN), keep=keep, **kw)
    return build


def _gw_plan(accumulate=False, out_dtype=None, out=lambda A: A.full(W, NAN), **call):
    def build(A):
        plan = igemm.Conv2dGradWeightPlan(X, W, "float32", "NCHW", 1, 1, 1, out_dtype=out_dtype,
                                          accumulate=accumulate, device=A.device)
        kw = {k: f(A) for k, f in call.items()}
        if out is not None:
            kw["out"] = out(A)
        return Call(plan, A.randn(X, "float32", 3), A.randn(DY, "float32", 4), **kw)
    return build


def _mask(n=MASK_WORDS):
    return lambda A, kw: A.words(n, 0x0F0F0F0F)


ROWS = [
    # ------------------------------------------------------------------------- conv2d_grad_input
    Row("conv2d_grad_input/dy-none", gi(dy=None), T, "dy", "expected an array, got None"),
    Row("conv2d_grad_input/w-none", gi(w=None), T, "w", "expected an array, got None"),
    Row("conv2d_grad_input/x_shape-3-ints", gi(x_shape=(2, 4, 8)), V, "x_shape", "4"),
    Row("conv2d_grad_input/x_shape-negative", gi(x_shape=(2, 4, -8, 8)), V, "x_shape", ">= 0"),
    Row("conv2d_grad_input/x_shape-int", gi(x_shape=8), T, "x_shape"),
    Row("conv2d_grad_input/x_shape-float-entry", gi(x_shape=(2, 4, 8.0, 8)), T, "x_shape"),
    Row("conv2d_grad_input/x_shape-zero-batch", gi(x_shape=(0, 4, 8, 8)), V, "x_shape", "empty"),
    Row("conv2d_grad_input/wrong-N", gi(x_shape=(3, 4, 8, 8)), V, "dy", r"expected \(3, 3, 8, 8\)"),
    Row("conv2d_grad_input/wrong-K", gi(dy=lambda A, kw: A.randn((2, 5, 8, 8))), V, "dy", r"expected \(2, 3, 8, 8\)"),
    Row("conv2d_grad_input/wrong-PQ", gi(dy=lambda A, kw: A.randn((2, 3, 7, 8))), V, "dy", "forward problem"),
    Row("conv2d_grad_input/channels-differ", gi(x_shape=(2, 5, 8, 8)), V, "w", "input channels"),
    Row("conv2d_grad_input/dy-3d", gi(dy=lambda A, kw: A.randn((3, 8, 8))), V, "dy"),
    Row("conv2d_grad_input/w-dtype-differs", gi(w=_as("w", "float16")), T, "w", "dy's float32"),
    Row("conv2d_grad_input/float64", gi(dy=_as("dy", "float64"), w=_as("w", "float64")), T, "dy", "float64"),
    Row("conv2d_grad_input/int32", gi(dy=_as("dy", "int32"), w=_as("w", "int32")), T, "dy", "int32"),
    Row("conv2d_grad_input/mask-too-short", gi(mask=_mask(MASK_WORDS - 1)), V, "mask", "at least 12 words"),
    Row("conv2d_grad_input/mask-float", gi(mask=lambda A, kw: A.full(MASK_WORDS, 1.0)), T, "mask"),
    Row("conv2d_grad_input/mask-2d", gi(mask=lambda A, kw: A.view(A.words(MASK_WORDS), (2, 6))), V, "mask", "1-D"),
    Row("conv2d_grad_input/prologue-tuple", gi(prologue=lambda A, kw: (A.randn(DY), A.randn((3, 3)))), T, "prologue",
        "GradPrologue"),
    Row("conv2d_grad_input/prologue-coef-length", gi(prologue=_with_prologue(coef=lambda A: A.randn((3, 2)))),
        V, "prologue.coef", r"\(3, 3\)"),
    Row("conv2d_grad_input/prologue-coef-float16", gi(prologue=_with_prologue(
        coef=lambda A: A.randn((3, 3), "float16"))), T, "prologue.coef", "float32"),
    Row("conv2d_grad_input/prologue-z-shape", gi(prologue=_with_prologue(z=lambda A: A.randn((2, 3, 8, 7)))),
        V, "prologue.z", "shape"),
    Row("conv2d_grad_input/prologue-z-dtype", gi(prologue=_with_prologue(z=lambda A: A.randn(DY, "float16"))),
        T, "prologue.z", "dtype"),
    Row("conv2d_grad_input/out-dtype", gi(out=lambda A, kw: A.full(X, NAN, "float16")), T, "out"),
    Row("conv2d_grad_input/out-shape", gi(out=lambda A, kw: A.full((2, 4, 8, 7), NAN)), V, "out", "shape"),
    Row("conv2d_grad_input/out-noncontiguous", gi(out=lambda A, kw: A.full((2, 4, 8, 16), NAN)[..., ::2]), V, "out",
        "contiguous"),
    Row("conv2d_grad_input/out-read-only", gi(out=lambda A, kw: A.readonly(A.full(X, NAN))), V, "out", "read-only"),
    Row("conv2d_grad_input/out-overlaps-dy", _gi_out_overlaps_dy, V, "out", "overlap"),
    Row("conv2d_grad_input/out-overlaps-w", _gi_out_overlaps_w, V, "out", "overlap"),
    Row("conv2d_grad_input/layout-name", gi(layout="NWHC"), V, "layout"),
    Row("conv2d_grad_input/stride-0", gi(stride=0), V, "stride"),
    Row("conv2d_grad_input/padding-negative", gi(padding=-1), V, "padding"),
    Row("conv2d_grad_input/precision", gi(precision="fast"), V, "precision"),
    Row("conv2d_grad_input/stream-string", gi(stream="default"), T, "stream"),
    # ------------------------------------------------------------------------- conv2d_grad_weight
    Row("conv2d_grad_weight/x-none", gw(x=None), T, "x", "expected an array, got None"),
    Row("conv2d_grad_weight/dy-none", gw(dy=None), T, "dy", "expected an array, got None"),
    Row("conv2d_grad_weight/w_shape-5-ints", gw(w_shape=(3, 4, 3, 3, 1)), V, "w_shape", "4"),
    Row("conv2d_grad_weight/w_shape-negative", gw(w_shape=(3, -4, 3, 3)), V, "w_shape", ">= 0"),
    Row("conv2d_grad_weight/wrong-N", gw(x=lambda A, kw: A.randn((3, 4, 8, 8))), V, "dy", r"expected \(3, 3, 8, 8\)"),
    Row("conv2d_grad_weight/wrong-K", gw(w_shape=(5, 4, 3, 3)), V, "dy", r"expected \(2, 5, 8, 8\)"),
    Row("conv2d_grad_weight/wrong-PQ", gw(dy=lambda A, kw: A.randn((2, 3, 6, 6))), V, "dy", "forward problem"),
    Row("conv2d_grad_weight/channels-differ", gw(w_shape=(3, 5, 3, 3)), V, "w_shape", "input channels"),
    Row("conv2d_grad_weight/filter-does-not-fit", gw(w_shape=(3, 4, 11, 11)), V, "w_shape", "does not fit"),
    Row("conv2d_grad_weight/x-dtype-differs", gw(x=_as("x", "float16")), T, "x", "dy's float32"),
    Row("conv2d_grad_weight/float64", gw(x=_as("x", "float64"), dy=_as("dy", "float64")), T, "dy", "float64"),
    Row("conv2d_grad_weight/out-float16-fp32-problem", gw(out=lambda A, kw: A.full(W, NAN, "float16")), T, "out",
        "float16"),
    Row("conv2d_grad_weight/out-float64", gw(out=lambda A, kw: A.full(W, NAN, "float64")), T, "out"),
    Row("conv2d_grad_weight/out-shape", gw(out=lambda A, kw: A.full((3, 4, 3, 2), NAN)), V, "out", "shape"),
    Row("conv2d_grad_weight/out-noncontiguous", gw(out=lambda A, kw: A.full((3, 4, 3, 6), NAN)[..., ::2]), V, "out",
        "contiguous"),
    Row("conv2d_grad_weight/out-read-only", gw(out=lambda A, kw: A.readonly(A.full(W, NAN))), V, "out", "read-only"),
    Row("conv2d_grad_weight/out-overlaps-x", _gw_out_overlaps_x, V, "out", "overlap"),
    Row("conv2d_grad_weight/out-overlaps-dy", _gw_out_overlaps_dy, V, "out", "overlap"),
    Row("conv2d_grad_weight/accumulate-without-out", gw(out=None, accumulate=True), V, "out", "accumulate"),
    Row("conv2d_grad_weight/accumulate-string", gw(accumulate="no"), T, "accumulate"),
    Row("conv2d_grad_weight/mask-int64", gw(mask=lambda A, kw: A.full(MASK_WORDS, 1, "int64")), T, "mask"),
    Row("conv2d_grad_weight/prologue-coef-length", gw(prologue=_with_prologue(coef=lambda A: A.randn((3, 4)))),
        V, "prologue.coef", r"\(3, 3\)"),
    Row("conv2d_grad_weight/layout-int", gw(layout=4), T, "layout"),
    Row("conv2d_grad_weight/stride-negative", gw(stride=-1), V, "stride"),
    Row("conv2d_grad_weight/stream-float", gw(stream=1.5), T, "stream"),
    # ------------------------------------------------------------------------- conv2d_grad_prologue
    Row("conv2d_grad_prologue/dy-none", gp(dy=None), T, "dy", "expected an array, got None"),
    Row("conv2d_grad_prologue/dy-3d", gp(dy=lambda A, kw: A.randn((2, 3, 64))), V, "dy", "4-D"),
    Row("conv2d_grad_prologue/gamma-length", gp(gamma=lambda A, kw: A.full(2, 1.5)), V, "gamma", "3"),
    Row("conv2d_grad_prologue/gamma-float64", gp(gamma=lambda A, kw: A.full(3, 1.5, "float64")), T, "gamma",
        "float32"),
    Row("conv2d_grad_prologue/layout-name", gp(layout="NHCW"), V, "layout"),
    # ------------------------------------------------------------------------- the plans
    Row("Conv2dGradInputPlan/mask-given-plan-without", _gi_plan(mask=lambda A: A.words(MASK_WORDS)), V, "mask",
        "mask=False"),
    Row("Conv2dGradInputPlan/mask-missing-plan-with", _gi_plan(built=("mask",)), V, "mask", "mask=True"),
    Row("Conv2dGradInputPlan/prologue-given-plan-without", _gi_plan(prologue=_prologue), V, "prologue",
        "prologue=False"),
    Row("Conv2dGradInputPlan/dy-shape", _gi_plan(dy_shape=(2, 3, 8, 9)), V, "dy", "expected shape"),
    Row("Conv2dGradInputPlan/dy-dtype", _gi_plan(dtype="float16"), T, "dy", "expected dtype"),
    Row("Conv2dGradWeightPlan/accumulate-without-out", _gw_plan(accumulate=True, out=None), V, "out", "accumulate"),
    Row("Conv2dGradWeightPlan/out-float16-of-fp32-out_dtype", _gw_plan(out=lambda A: A.full(W, NAN, "float16")), T,
        "out", "float16"),
    Row("Conv2dGradWeightPlan/out_dtype-float16-fp32-problem", lambda A: Call(
        igemm.Conv2dGradWeightPlan, X, W, "float32", "NCHW", 1, 1, 1, out_dtype="float16", device=A.device), V,
        "out_dtype"),
    Row("Conv2dGradInputPlan/mask-flag-string", lambda A: Call(
        igemm.Conv2dGradInputPlan, X, W, "float32", "NCHW", 1, 1, 1, mask="no", device=A.device), T, "mask"),
    Row("Conv2dGradInputPlan/x_shape-3-ints", lambda A: Call(
        igemm.Conv2dGradInputPlan, (2, 4, 8), W, "float32", "NCHW", 1, 1, 1, device=A.device), V, "x_shape"),
]
