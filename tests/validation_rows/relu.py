"""Bad inputs of relu_backward and relu_mask."""
from __future__ import annotations

import igemm

from . import NAN, Call, Row, variants

V, T = ValueError, TypeError

bwd = variants(igemm.relu_backward, ("dy", "mask"),
               lambda A: dict(dy=A.randn((64,), "float32", 4), mask=A.words(2, 0x0F0F0F0F), out=A.full(64, NAN)))
pack = variants(igemm.relu_mask, ("y",), lambda A: dict(y=A.randn((65,), "float32", 5), out=A.words(3)))


def _dy_out_overlap(A):
    buf = A.randn((65,))
    return Call(igemm.relu_backward, buf[:64], A.words(2, 0x0F0F0F0F), out=buf[1:65], keep=(buf,))


def _out_over_mask(A):
    buf = A.full(64, NAN)
    return Call(igemm.relu_backward, A.randn((64,)), A.as_words(buf)[:2], out=buf, keep=(buf,))


def _mask_out_over_y(A):
    y = A.randn((96,))
    return Call(igemm.relu_mask, y, out=A.as_words(y)[1:4], keep=(y,))


ROWS = [
    Row("relu_backward/dy-none", bwd(dy=None), T, "dy", "expected an array, got None"),
    Row("relu_backward/mask-none", bwd(mask=None), T, "mask", "expected an array, got None"),
    Row("relu_backward/dy-list", bwd(dy=[1.0, 2.0]), T, "dy"),
    Row("relu_backward/dy-int", bwd(dy=lambda A, k: A.full(64, 1, "int32")), T, "dy"),
    Row("relu_backward/dy-float64", bwd(dy=lambda A, k: A.full(64, 1.0, "float64")), T, "dy", "float64"),
    Row("relu_backward/dy-noncontiguous", bwd(dy=lambda A, k: A.randn((128,))[::2]), V, "dy", "contiguous"),
    Row("relu_backward/dy-unaligned", bwd(dy=lambda A, k: A.unaligned((64,), 1.0)), V, "dy", "aligned"),
    Row("relu_backward/mask-float", bwd(mask=lambda A, k: A.full(2, 1.0)), T, "mask"),
    Row("relu_backward/mask-int64", bwd(mask=lambda A, k: A.full(2, 1, "int64")), T, "mask"),
    Row("relu_backward/mask-too-short", bwd(mask=lambda A, k: k["mask"][:1]), V, "mask", "at least 2 words"),
    Row("relu_backward/mask-2d", bwd(mask=lambda A, k: A.view(A.words(4), (2, 2))), V, "mask"),
    Row("relu_backward/mask-noncontiguous", bwd(mask=lambda A, k: A.words(4)[::2]), V, "mask", "contiguous"),
    Row("relu_backward/mask-unaligned", bwd(mask=lambda A, k: A.unaligned((2,), 7, "uint32")), V, "mask", "aligned"),
    Row("relu_backward/out-shape", bwd(out=lambda A, k: A.full(63, NAN)), V, "out", "shape"),
    Row("relu_backward/out-dtype", bwd(out=lambda A, k: A.full(64, NAN, "float16")), T, "out", "dtype"),
    Row("relu_backward/out-noncontiguous", bwd(out=lambda A, k: A.full(128, NAN)[::2]), V, "out", "contiguous"),
    Row("relu_backward/out-read-only", bwd(out=lambda A, k: A.readonly(A.full(64, NAN))), V, "out", "read-only"),
    Row("relu_backward/out-unaligned", bwd(out=lambda A, k: A.unaligned((64,))), V, "out", "aligned"),
    Row("relu_backward/out-overlaps-dy", _dy_out_overlap, V, "out", "overlap"),
    Row("relu_backward/out-overlaps-mask", _out_over_mask, V, "out", "overlap"),
    Row("relu_backward/out-string", bwd(out="dx"), T, "out"),
    Row("relu_backward/stream-string", bwd(stream="default"), T, "stream"),
    Row("relu_backward/stream-float", bwd(stream=1.5), T, "stream"),
    Row("relu_mask/y-none", pack(y=None), T, "y", "expected an array, got None"),
    Row("relu_mask/y-int", pack(y=lambda A, k: A.full(40, 1, "int32")), T, "y"),
    Row("relu_mask/y-noncontiguous", pack(y=lambda A, k: A.randn((130,))[::2]), V, "y", "contiguous"),
    Row("relu_mask/y-unaligned", pack(y=lambda A, k: A.unaligned((65,), 1.0)), V, "y", "aligned"),
    Row("relu_mask/out-too-short", pack(out=lambda A, k: A.words(2)), V, "out", "at least 3 words"),
    Row("relu_mask/out-float", pack(out=lambda A, k: A.full(3, NAN)), T, "out"),
    Row("relu_mask/out-2d", pack(out=lambda A, k: A.view(A.words(4), (2, 2))), V, "out"),
    Row("relu_mask/out-noncontiguous", pack(out=lambda A, k: A.words(6)[::2]), V, "out", "contiguous"),
    Row("relu_mask/out-read-only", pack(out=lambda A, k: A.readonly(A.words(3))), V, "out", "read-only"),
    Row("relu_mask/out-unaligned", pack(out=lambda A, k: A.unaligned((3,), 7, "uint32")), V, "out", "aligned"),
    Row("relu_mask/out-overlaps-y", _mask_out_over_y, V, "out", "overlap"),
    Row("relu_mask/stream-bool", pack(stream=True), T, "stream"),
    # ----------------------------------------------------------------------------------- GPU only
    Row("relu_backward/dy-on-cpu", bwd(dy=lambda A, k: k["dy"].cpu()), T, "dy", "cpu", where="gpu"),
    Row("relu_backward/out-numpy", bwd(out=lambda A, k: k["out"].cpu().numpy()), T, "out", r"host \(numpy\)",
        where="gpu"),
    Row("relu_mask/y-numpy-out-cuda", pack(y=lambda A, k: k["y"].cpu().numpy()), T, "y", r"host \(numpy\)",
        where="gpu"),
    Row("relu_backward/stream-of-other-device", bwd(stream=lambda A, k: A.torch.cuda.Stream(device=1)), V, "stream",
        "cuda:1", where="gpu", multigpu=True),
]
