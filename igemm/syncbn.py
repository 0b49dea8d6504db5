"""SyncBatchNorm across processes: statistics and backward sums gathered through NCCL and merged on the
device, in rank order.

``comm`` is a ``torch.distributed`` process group (``None`` = the default group when torch.distributed is
initialised, else a single process), or an NCCL communicator with ``nranks``, ``rank`` and
``allgather(sendbuf, recvbuf, *, stream)`` (nccl4py's ``nccl.core.Communicator``; any object with that
shape). What PyTorch's ``SyncBatchNorm`` gets wrong and this does not:

* each rank sends ``(mean, biased var, count)`` in **fp64**, not ``invstd`` (whose round trip loses the
  variance when ``var << eps``) and not counts in the input dtype (fp16 counts overflow past 65504);
* ranks with count 0 (an empty local batch) are skipped by a select in the merge kernel: **no host
  synchronisation**, so the whole step can be captured in a CUDA graph;
* merges (Chan, fp64) and sums run in a fixed rank order: every rank gets bit-identical results, and the
  same inputs give the same results (deterministic); any C.

The backward's ``sum_dy``/``sum_dy_xmu`` travel the same way (an all-gather of fp64 partials summed in
rank order on the device, rather than an all-reduce whose order NCCL picks); then
``igemm.batch_norm_backward_elemt(..., count=global_count)`` finishes, with the ReLU mask fused if any.
"""
from __future__ import annotations

import numpy as np

from . import _norm_kernels as _nk
from . import reference
from ._checks import check_eps, check_flag, check_layout, check_stream
from ._dispatch import CallContext
from ._norm_checks import check_act, check_like, check_momentum, check_running, check_vec, mask_arg, required
from ._runtime import keeps_current_context

__all__ = ["sync_batch_norm_stats", "sync_batch_norm_backward_reduce", "resolve_comm"]


def resolve_comm(comm):
    """``(kind, handle, world_size, rank)`` with kind ``"torch"``, ``"nccl"`` or ``"local"``."""
    if comm is not None and all(hasattr(comm, a) for a in ("allgather", "nranks", "rank")):
        return "nccl", comm, int(comm.nranks), int(comm.rank)
    dist = None
    try:
        import torch.distributed as dist  # noqa: F811
        if not dist.is_available():
            dist = None
    except Exception:
        dist = None
    if comm is None:
        if dist is not None and dist.is_initialized():
            return "torch", None, int(dist.get_world_size()), int(dist.get_rank())
        return "local", None, 1, 0
    if dist is not None and isinstance(comm, dist.ProcessGroup):
        return "torch", comm, int(dist.get_world_size(comm)), int(dist.get_rank(comm))
    raise TypeError(f"comm: expected a torch.distributed ProcessGroup, an NCCL communicator (nranks, rank, "
                    f"allgather) or None, got {type(comm).__name__}")


def _check_comm_use(kind: str, ctx, stream) -> None:
    if kind == "torch" and ctx.backend == "cuda":
        if ctx.kind != "torch":
            raise TypeError("comm: a torch.distributed group needs torch tensors; for other arrays pass an NCCL "
                            "communicator (nccl4py)")
        if stream is not None:
            raise ValueError("stream: with a torch.distributed group the collective runs on torch's current stream; "
                             "use `with torch.cuda.stream(s):` instead of stream=")


def _allgather_device(kind: str, handle, send_obj, recv_obj, ctx) -> None:
    if kind == "torch":
        import torch.distributed as dist
        dist.all_gather_into_tensor(recv_obj, send_obj, group=handle)
    else:
        handle.allgather(send_obj, recv_obj, stream=int(ctx.stream.handle))


def _allgather_host(kind: str, handle, local: np.ndarray, W: int) -> np.ndarray:
    """numpy backend: ``[W, *local.shape]`` in rank order."""
    local = np.ascontiguousarray(local, dtype=np.float64)
    if kind == "local":
        return local[None]
    if kind == "torch":
        import torch
        import torch.distributed as dist
        t = torch.from_numpy(local.copy())
        parts = [torch.empty_like(t) for _ in range(W)]
        dist.all_gather(parts, t, group=handle)
        return np.stack([p.numpy() for p in parts])
    recv = np.empty((W,) + local.shape, dtype=np.float64)
    handle.allgather(local, recv, stream=None)
    return recv


@keeps_current_context
def sync_batch_norm_stats(x, eps: float = 1e-5, comm=None, *, layout: str = "NCHW", running_mean=None,
                          running_var=None, momentum: float = 0.1, return_count: bool = False, stream=None):
    """``(mean, invstd)`` per channel over the batches of every rank of ``comm`` (fp32), PyTorch's
    ``SyncBatchNorm`` statistics; ``(mean, invstd, count)`` with ``return_count`` (count: the global
    per-channel count, fp32 [C], for :func:`igemm.batch_norm_backward_elemt`).

    Local Welford (as :func:`igemm.welford`, fp64 results), one all-gather of the packed ``[3, C]``
    ``(mean, var, count)``, Chan's merge on the device in rank order (fp64), ranks with count 0 skipped
    without a host synchronisation. Every rank must call it (a rank with an empty batch ``N = 0`` too).
    ``running_mean``/``running_var`` (fp32) get PyTorch's update with the global statistics.

    >>> import numpy as np, igemm
    >>> x = np.array([[[1.], [2.]], [[3.], [6.]]], np.float32)
    >>> [a.tolist() for a in igemm.sync_batch_norm_stats(x, 0.0)]   # no process group: one process
    [[2.0, 4.0], [1.0, 0.5]]
    """
    required({"x": x})
    check_layout(layout)
    e = check_eps(eps)
    mom = check_momentum(momentum)
    return_count = check_flag(return_count, "return_count")
    check_stream(stream)
    kind, handle, W, _rank = resolve_comm(comm)
    ctx = CallContext({"x": x, "running_mean": running_mean, "running_var": running_var}, stream)
    t_x = ctx.views["x"]
    N, C, HW = check_act(t_x, "x", layout)
    check_running(ctx, running_mean, running_var, C, layout)
    _check_comm_use(kind, ctx, stream)
    if ctx.backend == "numpy":
        mean, var, n = reference.welford_stats(np.asarray(x), layout)
        g = _allgather_host(kind, handle, np.stack([mean, var, n]), W)
        m, v, cnt = reference.chan_merge(g[:, 0], g[:, 1], g[:, 2])
        if running_mean is not None:
            rm, rv = reference.update_running_stats_ref(running_mean, running_var, m, v, cnt, mom)
            np.asarray(running_mean)[...] = rm
            np.asarray(running_var)[...] = rv
        res = (m.astype(np.float32), reference.invstd_from_var(v, e).astype(np.float32))
        return res + (cnt.astype(np.float32),) if return_count else res
    d_x = ctx.device_view("x")
    local_obj, local = ctx.empty((3 * C,), "float64")
    _nk.launch_reduction(ctx, grad=False, dtype=t_x.dtype, layout=layout, N=N, C=C, HW=HW, mode=0, f64=True,
                           ptrs=dict(x=d_x.ptr, out0=local.ptr, out1=local.ptr + 8 * C, out2=local.ptr + 16 * C))
    if W > 1:
        g_obj, g = ctx.empty((W * 3 * C,), "float64")
        _allgather_device(kind, handle, local_obj, g_obj, ctx)
    else:
        g_obj, g = local_obj, local
    outs = [ctx.empty((C,), "float32") for _ in range(3 if return_count else 2)]
    d_rm = ctx.device_view("running_mean") if running_mean is not None else None
    d_rv = ctx.device_view("running_var") if running_var is not None else None
    _nk.launch_gather(ctx, in_dtype="float64", cnt_dtype="float64", C=C, W=W, rs=3 * C, cnt_rs=3 * C, cnt_cs=1,
                        mode=1, eps=e, momentum=mom,
                        ptrs=dict(mean=g.ptr, var=g.ptr + 8 * C, cnt=g.ptr + 16 * C, out0=outs[0][1].ptr,
                                  out1=outs[1][1].ptr, out2=outs[2][1].ptr if return_count else 0,
                                  run_mean=d_rm.ptr if d_rm else 0, run_var=d_rv.ptr if d_rv else 0))
    del g_obj, local_obj
    if d_rm is not None:
        ctx.copy_back("running_mean", d_rm)
        ctx.copy_back("running_var", d_rv)
    return tuple(ctx.finish(o[0]) for o in outs)


@keeps_current_context
def sync_batch_norm_backward_reduce(dy, x, mean, invstd, weight=None, comm=None, *, mask=None,
                                    layout: str = "NCHW", stream=None):
    """``(sum_dy, sum_dy_xmu, grad_weight, grad_bias)`` (fp32 [C]) where ``sum_dy`` and ``sum_dy_xmu``
    are summed over every rank of ``comm`` (what ``batch_norm_backward_elemt`` needs, with the global
    count) and ``grad_weight``/``grad_bias`` are this rank's, as in PyTorch's ``SyncBatchNorm`` (the data-
    parallel wrapper reduces parameter gradients). With ``mask`` dy is first replaced by ``bit ? dy : 0``.
    The local sums travel as fp64 and are added in rank order on the device (deterministic, identical on
    every rank).
    """
    required({"dy": dy, "x": x, "mean": mean, "invstd": invstd})
    check_layout(layout)
    check_stream(stream)
    kind, handle, W, _rank = resolve_comm(comm)
    ctx = CallContext({"dy": dy, "x": x, "mean": mean, "invstd": invstd, "weight": weight, "mask": mask}, stream)
    t_x = ctx.views["x"]
    N, C, HW = check_act(t_x, "x", layout)
    check_like(ctx.views["dy"], "dy", t_x, "x")
    for k in ("mean", "invstd", "weight"):
        check_vec(ctx, k, C, layout)
    mask_arg(ctx, "mask", N * C * HW)
    _check_comm_use(kind, ctx, stream)
    if ctx.backend == "numpy":
        sdy, sdx, gw, gb = reference.batch_norm_backward_reduce_ref(
            np.asarray(dy), np.asarray(x), mean, invstd, layout, None if mask is None else np.asarray(mask))
        g = _allgather_host(kind, handle, np.stack([sdy, sdx]), W)
        tot = np.zeros((2, C))
        for w in range(W):
            tot += g[w]
        return tuple(a.astype(np.float32) for a in (tot[0], tot[1], gw, gb))
    d = {k: ctx.device_view(k) for k in ("dy", "x", "mean", "invstd", "mask") if k in ctx.views}
    local_obj, local = ctx.empty((2 * C,), "float64")
    gw = ctx.empty((C,), "float32")
    gb = ctx.empty((C,), "float32")
    _nk.launch_reduction(ctx, grad=True, dtype=t_x.dtype, layout=layout, N=N, C=C, HW=HW, f64=True,
                           ptrs=dict(dy=d["dy"].ptr, x=d["x"].ptr, mask=d["mask"].ptr if "mask" in d else 0,
                                     mean=d["mean"].ptr, invstd=d["invstd"].ptr, out0=local.ptr,
                                     out1=local.ptr + 8 * C, out2=gw[1].ptr, out3=gb[1].ptr))
    g_obj, g = local_obj, local
    if W > 1:
        g_obj, g = ctx.empty((W * 2 * C,), "float64")
        _allgather_device(kind, handle, local_obj, g_obj, ctx)
    sdy = ctx.empty((C,), "float32")
    sdx = ctx.empty((C,), "float32")
    _nk.launch_sum_ranks(ctx, C=C, W=W, ptrs=dict(mean=g.ptr, out0=sdy[1].ptr, out1=sdx[1].ptr))
    del g_obj, local_obj
    return tuple(ctx.finish(o[0]) for o in (sdy, sdx, gw, gb))
