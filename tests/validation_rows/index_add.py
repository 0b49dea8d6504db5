"""Bad inputs of index_add (x is written in place: it must stay unchanged)."""
from __future__ import annotations

import igemm
from igemm._checks import IndexArgumentError

from . import Call, Row, variants

V, T, IA = ValueError, TypeError, IndexArgumentError

ia = variants(igemm.index_add, ("x", "dim", "index", "source"),
              lambda A: dict(x=A.randn((5, 4), "float32", 5), dim=0, index=A.arr([0, 2, 4], "int64"),
                             source=A.randn((3, 4), "float32", 6), alpha=1.0))


def _x_over_source(A):
    buf = A.randn((20,))
    return Call(igemm.index_add, A.view(buf[:20], (5, 4)), 0, A.arr([0, 1, 2], "int64"), A.view(buf[8:20], (3, 4)),
                keep=(buf,))


def _x_over_index(A):
    buf = A.full(20, 0.0)
    idx = A.as_int32(buf)[:3]
    return Call(igemm.index_add, A.view(buf, (5, 4)), 0, idx, A.randn((3, 4)), keep=(buf,))


ROWS = [
    Row("index_add/x-none", ia(x=None), T, "x", "expected an array, got None"),
    Row("index_add/index-none", ia(index=None), T, "index", "expected an array, got None"),
    Row("index_add/source-none", ia(source=None), T, "source", "expected an array, got None"),
    Row("index_add/index-list", ia(index=[0, 1, 2]), T, "index"),
    Row("index_add/index-past-end", ia(index=lambda A, k: A.arr([0, 5, 1], "int64")), IA, "index",
        r"index\[1\] = 5 is out of range", launches=True),
    Row("index_add/index-negative", ia(index=lambda A, k: A.arr([0, 1, -1], "int32")), IA, "index",
        r"index\[2\] = -1 is out of range", launches=True),
    Row("index_add/source-dtype", ia(source=lambda A, k: A.randn((3, 4), "float16")), T, "source"),
    Row("index_add/index-float", ia(index=lambda A, k: A.arr([0.0, 1.0, 2.0])), T, "index"),
    Row("index_add/index-int16", ia(index=lambda A, k: A.full(3, 1, "int16")), T, "index"),
    Row("index_add/x-int", ia(x=lambda A, k: A.full((5, 4), 1, "int32"), source=lambda A, k: A.full((3, 4), 1, "int32")),
        T, "x"),
    Row("index_add/x-float64", ia(x=lambda A, k: A.full((5, 4), 1.0, "float64"),
                                  source=lambda A, k: A.full((3, 4), 1.0, "float64")), T, "x"),
    Row("index_add/dim-out-of-range", ia(dim=2), IA, "dim"),
    Row("index_add/dim-negative-out-of-range", ia(dim=-3), IA, "dim"),
    Row("index_add/dim-float", ia(dim=0.0), T, "dim"),
    Row("index_add/dim-none", ia(dim=None), T, "dim"),
    Row("index_add/dim-bool", ia(dim=False), T, "dim"),
    Row("index_add/source-shape", ia(source=lambda A, k: A.randn((3, 5))), V, "source", r"expected shape \(3, 4\)"),
    Row("index_add/source-rank", ia(source=lambda A, k: A.randn((3, 4, 1))), V, "source", "expected 2 dimensions"),
    Row("index_add/source-too-few-rows", ia(source=lambda A, k: A.randn((2, 4))), V, "source", "shape"),
    Row("index_add/index-2d", ia(index=lambda A, k: A.arr([[0], [1], [2]], "int64")), IA, "index", "1-D"),
    Row("index_add/alpha-complex", ia(alpha=1j), T, "alpha"),
    Row("index_add/alpha-string", ia(alpha="2"), T, "alpha"),
    Row("index_add/alpha-bool", ia(alpha=True), T, "alpha"),
    Row("index_add/alpha-none", ia(alpha=None), T, "alpha"),
    Row("index_add/alpha-array", ia(alpha=lambda A, k: A.arr([2.0])), T, "alpha"),
    Row("index_add/x-noncontiguous", ia(x=lambda A, k: A.perm(A.randn((4, 5)), (1, 0))), V, "x", "contiguous"),
    Row("index_add/source-noncontiguous", ia(source=lambda A, k: A.perm(A.randn((4, 3)), (1, 0))), V, "source",
        "contiguous"),
    Row("index_add/index-noncontiguous", ia(index=lambda A, k: A.arr([0, 9, 2, 9, 4, 9], "int64")[::2]), V, "index",
        "contiguous"),
    Row("index_add/x-read-only", ia(x=lambda A, k: A.readonly(k["x"])), V, "x", "read-only"),
    Row("index_add/x-unaligned", ia(x=lambda A, k: A.unaligned((5, 4), 1.0)), V, "x", "aligned"),
    Row("index_add/source-unaligned", ia(source=lambda A, k: A.unaligned((3, 4), 1.0)), V, "source", "aligned"),
    Row("index_add/index-unaligned", ia(index=lambda A, k: A.unaligned((3,), 1, "int64")), V, "index", "aligned"),
    Row("index_add/x-overlaps-source", _x_over_source, V, "x", "overlap"),
    Row("index_add/x-overlaps-index", _x_over_index, V, "x", "overlap"),
    Row("index_add/deterministic-string", ia(deterministic="yes"), T, "deterministic"),
    Row("index_add/check-index-int", ia(check_index=1), T, "check_index"),
    Row("index_add/stream-string", ia(stream="s"), T, "stream"),
    # ----------------------------------------------------------------------------------- GPU only
    Row("index_add/index-on-cpu", ia(index=lambda A, k: k["index"].cpu()), T, "index", "cpu", where="gpu"),
    Row("index_add/source-numpy", ia(source=lambda A, k: k["source"].cpu().numpy()), T, "source",
        r"host \(numpy\)", where="gpu"),
    Row("index_add/index-on-other-device", ia(index=lambda A, k: k["index"].to("cuda:1")), V, "x",
        "different devices", where="gpu", multigpu=True, anywhere=True),
]
