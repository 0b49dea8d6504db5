"""Bad inputs of the SyncBatchNorm functions (no process group: one process)."""
from __future__ import annotations

import igemm

from . import Row, variants

V, T = ValueError, TypeError
X = (2, 3, 4, 4)

ss = variants(igemm.sync_batch_norm_stats, ("x", "eps"),
              lambda A: dict(x=A.randn(X, "float32", 8), eps=1e-5, running_mean=A.full(3, 0.0),
                             running_var=A.full(3, 1.0)))
sr = variants(igemm.sync_batch_norm_backward_reduce, ("dy", "x", "mean", "invstd"),
              lambda A: dict(dy=A.randn(X, "float32", 9), x=A.randn(X, "float32", 8), mean=A.full(3, 0.5),
                             invstd=A.full(3, 2.0), mask=A.words(3, 0x5A5A5A5A)))

ROWS = [
    Row("sync_batch_norm_stats/comm", ss(comm=object()), T, "comm"),
    Row("sync_batch_norm_stats/x-none", ss(x=None), T, "x", "expected an array, got None"),
    Row("sync_batch_norm_stats/eps-negative", ss(eps=-1e-5), V, "eps"),
    Row("sync_batch_norm_stats/eps-string", ss(eps="1e-5"), T, "eps"),
    Row("sync_batch_norm_stats/momentum", ss(momentum=1.5), V, "momentum"),
    Row("sync_batch_norm_stats/layout", ss(layout="NDHWC"), V, "layout"),
    Row("sync_batch_norm_stats/running-mean-only", ss(running_var=None), V, "running_var", "give both or neither"),
    Row("sync_batch_norm_stats/running-var-read-only", ss(running_var=lambda A, k: A.readonly(k["running_var"])), V,
        "running_var", "read-only"),
    Row("sync_batch_norm_stats/running-one-array", ss(running_var=lambda A, k: k["running_mean"]), V,
        "running_mean", "overlap"),
    Row("sync_batch_norm_stats/return-count-string", ss(return_count="yes"), T, "return_count"),
    Row("sync_batch_norm_stats/x-int", ss(x=lambda A, k: A.full(X, 1, "int32")), T, "x"),
    Row("sync_batch_norm_backward_reduce/comm", sr(comm=3), T, "comm"),
    Row("sync_batch_norm_backward_reduce/dy-none", sr(dy=None), T, "dy", "expected an array, got None"),
    Row("sync_batch_norm_backward_reduce/dy-dtype", sr(dy=lambda A, k: A.randn(X, "float16")), T, "dy"),
    Row("sync_batch_norm_backward_reduce/mean-shape", sr(mean=lambda A, k: A.full(4, 0.5)), V, "mean", "shape"),
    Row("sync_batch_norm_backward_reduce/mask-short", sr(mask=lambda A, k: A.words(2)), V, "mask", "at least 3"),
    Row("sync_batch_norm_backward_reduce/layout", sr(layout="HWC"), V, "layout"),
    Row("sync_batch_norm_backward_reduce/stream-string", sr(stream="s"), T, "stream"),
    # ----------------------------------------------------------------------------------- GPU only
    Row("sync_batch_norm_stats/x-on-cpu", ss(x=lambda A, k: k["x"].cpu()), T, "x", "cpu", where="gpu"),
]
