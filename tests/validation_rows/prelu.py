"""Bad inputs of prelu and prelu_backward."""
from __future__ import annotations

import igemm

from . import NAN, Call, Row, variants

V, T = ValueError, TypeError

fwd = variants(igemm.prelu, ("x", "alpha"),
               lambda A: dict(x=A.randn((2, 3, 4), "float32", 7), alpha=A.arr([0.1, 0.2, 0.3]),
                              out=A.full((2, 3, 4), NAN)))
bwd = variants(igemm.prelu_backward, ("dy", "x", "alpha"),
               lambda A: dict(dy=A.randn((2, 3, 4), "float32", 8), x=A.randn((2, 3, 4), "float32", 7),
                              alpha=A.arr([0.1, 0.2, 0.3])))


def _out_over_x(A):
    buf = A.randn((25,))
    return Call(igemm.prelu, A.view(buf[:24], (2, 3, 4)), A.arr([0.1, 0.2, 0.3]), out=A.view(buf[1:], (2, 3, 4)),
                keep=(buf,))


def _out_over_alpha(A):
    buf = A.randn((24,))
    return Call(igemm.prelu, A.randn((2, 3, 4)), buf[:3], out=A.view(buf, (2, 3, 4)), keep=(buf,))


ROWS = [
    Row("prelu/x-none", fwd(x=None), T, "x", "expected an array, got None"),
    Row("prelu/alpha-none", fwd(alpha=None), T, "alpha", "got None"),
    Row("prelu/alpha-bool", fwd(alpha=True), T, "alpha"),
    Row("prelu/alpha-string", fwd(alpha="0.1"), T, "alpha"),
    Row("prelu/alpha-complex", fwd(alpha=0.5j), T, "alpha"),
    Row("prelu/alpha-count", fwd(alpha=lambda A, k: A.arr([0.1, 0.2, 0.3, 0.4])), V, "alpha", "alpha: 4 elements"),
    Row("prelu/alpha-float64", fwd(alpha=lambda A, k: A.arr([0.1, 0.2, 0.3], "float64")), T, "alpha"),
    Row("prelu/alpha-int32", fwd(alpha=lambda A, k: A.arr([1, 2, 3], "int32")), T, "alpha"),
    Row("prelu/alpha-noncontiguous", fwd(alpha=lambda A, k: A.arr([0.1, 9, 0.2, 9, 0.3, 9])[::2]), V, "alpha",
        "contiguous"),
    Row("prelu/alpha-unaligned", fwd(alpha=lambda A, k: A.unaligned((3,), 0.25)), V, "alpha", "aligned"),
    Row("prelu/layout", fwd(layout="NWC"), V, "layout"),
    Row("prelu/layout-not-a-string", fwd(layout=1), T, "layout"),
    Row("prelu/x-float64", fwd(x=lambda A, k: A.arr(A.host(k["x"]), "float64")), T, "x"),
    Row("prelu/x-int", fwd(x=lambda A, k: A.full((2, 3, 4), 1, "int32")), T, "x"),
    Row("prelu/x-noncontiguous", fwd(x=lambda A, k: A.perm(A.randn((2, 4, 3)), (0, 2, 1))), V, "x", "contiguous"),
    Row("prelu/x-unaligned", fwd(x=lambda A, k: A.unaligned((2, 3, 4), 1.0)), V, "x", "aligned"),
    Row("prelu/1d-channel-alpha", fwd(x=lambda A, k: A.randn((5,)), out=lambda A, k: A.full(5, NAN)), V, "alpha",
        "below 2-D"),
    Row("prelu/nhwc-channel-count", fwd(layout="NHWC"), V, "alpha", "layout NHWC"),
    Row("prelu/out-shape", fwd(out=lambda A, k: A.full((2, 3), NAN)), V, "out", "shape"),
    Row("prelu/out-dtype", fwd(out=lambda A, k: A.full((2, 3, 4), NAN, "float16")), T, "out", "dtype"),
    Row("prelu/out-noncontiguous", fwd(out=lambda A, k: A.full((2, 3, 8), NAN)[..., ::2]), V, "out", "contiguous"),
    Row("prelu/out-read-only", fwd(out=lambda A, k: A.readonly(A.full((2, 3, 4), NAN))), V, "out", "read-only"),
    Row("prelu/out-unaligned", fwd(out=lambda A, k: A.unaligned((2, 3, 4))), V, "out", "aligned"),
    Row("prelu/out-overlaps-x", _out_over_x, V, "out", "overlap"),
    Row("prelu/out-overlaps-alpha", _out_over_alpha, V, "out", "overlap"),
    Row("prelu/stream-object", fwd(stream=object()), T, "stream"),
    Row("prelu_backward/dy-none", bwd(dy=None), T, "dy", "expected an array, got None"),
    Row("prelu_backward/x-none", bwd(x=None), T, "x", "expected an array, got None"),
    Row("prelu_backward/alpha-none", bwd(alpha=None), T, "alpha", "got None"),
    Row("prelu_backward/dy-shape", bwd(dy=lambda A, k: A.randn((2, 3, 5))), V, "dy", "shape"),
    Row("prelu_backward/dy-dtype", bwd(dy=lambda A, k: A.randn((2, 3, 4), "float16")), T, "dy", "dtype"),
    Row("prelu_backward/dy-noncontiguous", bwd(dy=lambda A, k: A.perm(A.randn((2, 4, 3)), (0, 2, 1))), V, "dy",
        "contiguous"),
    Row("prelu_backward/dy-unaligned", bwd(dy=lambda A, k: A.unaligned((2, 3, 4), 1.0)), V, "dy", "aligned"),
    Row("prelu_backward/x-int", bwd(x=lambda A, k: A.full((2, 3, 4), 1, "int32")), T, "x"),
    Row("prelu_backward/alpha-count", bwd(alpha=lambda A, k: A.arr([0.1, 0.2])), V, "alpha", "2 elements"),
    Row("prelu_backward/alpha-dtype", bwd(alpha=lambda A, k: A.arr([0.1, 0.2, 0.3], "float16")), T, "alpha"),
    Row("prelu_backward/layout", bwd(layout="CHW"), V, "layout"),
    Row("prelu_backward/stream-string", bwd(stream="0"), T, "stream"),
    # ----------------------------------------------------------------------------------- GPU only
    Row("prelu/alpha-numpy", fwd(alpha=lambda A, k: k["alpha"].cpu().numpy()), T, "alpha", r"host \(numpy\)",
        where="gpu"),
    Row("prelu_backward/x-on-cpu", bwd(x=lambda A, k: k["x"].cpu()), T, "x", "cpu", where="gpu"),
]
