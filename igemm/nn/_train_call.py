"""``TrainCall``: a fused layer's training step for one input geometry, its plans and kernels found once, then per
call only pointers and launches (the training eager path: nn/_train_fast.py holds its autograd Function).

The op path (``torch.ops.igemm.conv2d_bn_train`` and its backward) validates every array of every function it
calls: about 1 ms of host time per layer and step, four times the GPU time of a ResNet-50 layer's training step
(docs/performance.md: train-eager-path). A ``TrainCall`` holds the conv plan, the dgrad and wgrad plans and the
BatchNorm kernels' configurations; its forward and backward launch them on the current stream. Same kernels,
same order, same results as the op (SyncBatchNorm's collectives included).
"""
from __future__ import annotations

import threading

import torch
from torch.autograd.graph import increment_version

from .. import _runtime
from .. import relu as _relu
from .._kernel import bind_args
from .._norm_kernels import _sms, elemt_kernel, reduction_kernels, sync_kernels
from .._norm_train import TRAIN_BWD_PTRS, held_config, train_kernel
from ..conv import Conv2dGradInputPlan, Conv2dGradWeightPlan, Conv2dPlan
from ..conv._backward_functional import _cached
from ..conv._moves import Move, dz_fits, launch_coefficients, launch_dz
from ..conv._spec import bn_stats_ok
from . import _ops

__all__ = ["TrainCall", "stats_plan"]

_CL = torch.channels_last
_PLAIN = {"mask": 0, "z": 0, "coef": 0}
#: the pointer parameters each BatchNorm kernel gets per call, in the order TrainCall passes them
_STATS_PTRS = ("x", "out0", "out1", "part", "run_mean", "run_var")
_FWD_PTRS = ("x", "res", "y", "mask", "mean", "invstd", "weight", "bias")
_GRAD_PTRS = ("dy", "x", "mask", "mean", "invstd", "out0", "out1", "out2", "out3", "part")
# SyncBatchNorm's: this rank's (mean, var, count) in fp64; the merge of every rank's (syncbn.sync_batch_norm_stats)
_SYNC_STATS_PTRS = ("x", "out0", "out1", "out2", "part")
_GATHER_PTRS = ("mean", "var", "cnt", "out0", "out1", "out2", "run_mean", "run_var")
# the one-launch forward pass's (csrc/norm_train.cuh; the backward's: TRAIN_BWD_PTRS)
_TRAIN_FWD_PTRS = ("x", "part", "out0", "out1", "mean", "invstd", "run_mean", "run_var", "res", "y", "mask", "weight",
                   "bias", "nbt")
_NO_VECTORS = _ops._Vectors(None, None)      # (the conv's epilogue has no per-call vectors; one object: bound once)
_local = threading.local()   # .scratch: (device, stream) -> a float32 buffer for what one call writes and reads at once


def _transient(dev, h: int, n: int):
    """``n`` floats that only launches queued now on stream ``h`` write and read: the stream's scratch, which the
    next call's launches reach only after these in the stream's order (per thread: two threads' launches on one
    stream interleave; a thread's scratch goes with the thread); a fresh tensor while a CUDA graph is captured (its
    memory is the graph's)."""
    if torch.cuda.is_current_stream_capturing():
        return torch.empty((n,), dtype=torch.float32, device=dev)
    d = getattr(_local, "scratch", None)
    if d is None:
        d = _local.scratch = {}
    key = (dev.index, h)
    t = d.get(key)
    if t is None or t.numel() < n:
        t = d[key] = torch.empty((n,), dtype=torch.float32, device=dev)
    return t


def _f32(*vs) -> bool:
    """Whether each of ``vs`` is None or a contiguous fp32 CUDA tensor."""
    for v in vs:
        if v is not None and not (v.dtype is torch.float32 and v.is_cuda and v.is_contiguous()):
            return False
    return True


class TrainCall:
    """conv -> BN (batch statistics) [-> + residual] [-> ReLU] for one input geometry: the plans and the BatchNorm
    kernels found once (the kernels for 16-byte aligned tensors: fresh outputs, and inputs ``usable`` checks).
    Tensors stay in the module's shapes: the kernels need only their pointers, outputs are allocated in the memory
    format the plans write (channels_last for the NHWC plans), so no call makes a view. An fp32 weight with a
    16-bit x (autocast's master weight: ``master``) is cast per call here and its gradient written in fp32 by wgrad's
    split sum, instead of autograd's cast each way (docs/performance.md: train-master-weight)."""

    __slots__ = ("plan", "dgrad", "wgrad", "nhwc", "fmt", "dtype", "dt", "relu", "res", "eps", "N", "K", "HW",
                 "y_shape", "stream_of", "stats", "bn_fwd", "grad_red", "relu_bwd", "slots", "one_fwd", "one_bwd",
                 "conv_stats", "sync", "master", "wdtype", "x_shape", "remade", "zb", "words", "w_shape", "wb", "cast",
                 "_plain", "_conv_way", "defers", "dev", "takes_sums", "_tiles_bwd", "sums_tiles")

    def __init__(self, x, w, residual, eps, stride, padding, dilation, relu, group=False, master=False):
        self.master, self.wdtype = master, torch.float32 if master else w.dtype     # (w: in x's dtype)
        _ops._check(x, w, None, (None, None, None, None), residual, stride, padding, dilation)
        self.nhwc = _ops._nhwc(x)
        self.fmt = _CL if self.nhwc else torch.contiguous_format
        layout = "NHWC" if self.nhwc else "NCHW"
        key = _ops._plan_key(x, w, None, None, None, stride, padding, dilation, False)
        dev = x.device.index
        self.plan = _ops._plan(key, dev)
        xs, ws, dt = key[0], key[1], key[2]
        st, pd, dl = (tuple(v) for v in (stride, padding, dilation))
        self.dtype, self.dt, self.relu, self.res, self.eps = x.dtype, dt, bool(relu), residual is not None, eps
        self.dgrad, self.wgrad = (_cached(cls, (xs, ws, dt, layout, st, pd, dl, "strict", self.relu, True, *extra, dev),
                                          lambda cls=cls, kw=kw: cls(xs, ws, dt, layout, st, pd, dl, mask=self.relu,
                                                                     prologue=True, device=dev, **kw))
                                  for cls, extra, kw in (
                                      (Conv2dGradInputPlan, (), {}),
                                      (Conv2dGradWeightPlan, ("float32" if self.master else dt, False),
                                       {"out_dtype": "float32"} if self.master else {})))
        # a dgrad that zeroes rows no tap reaches (a strided one) is deferred where it can add into another dx instead
        # (_Dgrad: no zeroing, no dx of its own)
        self.defers = self.dgrad.adds and self.dgrad.native.zero
        # dgrad's per-tile sums of the BatchNorm backward of the layer whose ReLU(BN(z)) x is, where its kernel can
        # write them (rows of them; 0: none; docs/performance.md: bn-sums-in-dgrad)
        self.sums_tiles = self.dgrad.native.sums_tiles if self.nhwc and self.dgrad.native is not None else 0
        self.dev = dev
        N, K, P, Q = _ops._out_size(x, w, st, pd, dl)
        self.N, self.K, self.HW, self.y_shape, self.x_shape = N, K, P * Q, (N, K, P, Q), tuple(x.shape)
        # what the backward reads is kept in one allocation (see forward): z (zb bytes, 256-aligned), a master
        # weight's 16-bit copy (wb bytes), then fp32 mean, invstd (SyncBatchNorm: and the count), the BatchNorm
        # launches' partials, the mask's words
        self.zb = -(-N * K * P * Q * x.element_size() // 256) * 256
        self.words = (N * K * P * Q + 31) // 32 if self.relu else 0
        # (the master weight's copy, which dgrad reads too, is cast by a flat move kernel)
        self.w_shape, n = tuple(w.shape), w.numel()
        self.wb = -(-n * x.element_size() // 256) * 256 if master else 0
        self.cast = None
        if master:
            mv, vec = Move((1, 1, 1, n), (n, n, n, 1), (n, n, n, 1)), 4 if n % 4 == 0 else 1
            args = mv.args(0, 0, vec=vec).clone()
            self.cast = (mv.launcher(dev, "float32", dt, vec, sms=self.dgrad.sms),
                         args, args.slots["src"], args.slots["dst"], threading.Lock())
        self.stream_of = torch._C._cuda_getCurrentRawStream
        geo = dict(dtype=dt, layout=layout, N=N, C=K, HW=P * Q, align=16)
        self.stats = reduction_kernels(dev, grad=False, mode=1, **geo)
        self.bn_fwd = elemt_kernel(dev, backward=False, act_or_mask=2 if self.relu else 0, res=self.res, **geo)
        # y = ReLU(BN(z)) again, without the mask, for a later layer that kept z instead of y (remake)
        rk = elemt_kernel(dev, backward=False, act_or_mask=1, res=False, **geo) if self.relu and not self.res else None
        self.remade = (rk, rk.slots(_FWD_PTRS)) if rk is not None else None
        self.grad_red = reduction_kernels(dev, grad=True, **geo)
        n = N * K * P * Q
        vec = 16 // x.element_size()
        self.relu_bwd = (_relu._launcher("relu_backward", dt, vec, dev, _relu._grid(dev, max(n // vec // 8, 1))), n)
        k1, _, _ = self.stats
        g1, _, _ = self.grad_red
        self.slots = {"stats": k1.slots(_STATS_PTRS), "fwd": self.bn_fwd.slots(_FWD_PTRS),
                      "grad": g1.slots(_GRAD_PTRS), "eps": k1.slot["eps"],
                      "momentum": k1.slot["momentum"]}
        # channels-last 16-bit: the BatchNorm passes as one launch each where the GPU holds their grids at once
        # (docs/performance.md: bn-train-one-launch); None: the separate launches above
        self.one_fwd = self.one_bwd = self.conv_stats = self.sync = None
        if group is not False:
            # SyncBatchNorm (a torch.distributed group; None: the default one): the statistics and the backward's
            # sums of every rank's batch, as igemm.syncbn does them (fp64 rows all-gathered, merged in rank order)
            import torch.distributed as dist
            W = dist.get_world_size(group)
            sred = reduction_kernels(dev, grad=False, mode=0, f64=True, **geo)
            gred = reduction_kernels(dev, grad=True, f64=True, **geo)
            gather, sums = sync_kernels(dev, K, W)
            self.sync = (group, W, sred, gred, gather, sums)
            # (the fp64 reductions take the same parameters as the others: "grad"'s slots serve)
            self.slots.update(sync_stats=sred[0].slots(_SYNC_STATS_PTRS), gather=gather.slots(_GATHER_PTRS),
                              g_eps=gather.slot["eps"], g_mom=gather.slot["momentum"],
                              sum_ranks=sums.slots(("mean", "out0", "out1")))
        elif self.nhwc:
            self.one_fwd = train_kernel(dev, backward=False, dtype=dt, N=N, C=K, HW=P * Q,
                                        act=2 if self.relu else 0, res=self.res)
            self.one_bwd = train_kernel(dev, backward=True, dtype=dt, N=N, C=K, HW=P * Q)
            # z's statistics from the conv's epilogue, where its kernel can write them: the forward pass then merges
            # them instead of reading z (docs/performance.md: bn-stats-in-epilogue)
            sp = stats_plan(xs, ws, dt, st, pd, dl, dev) if bn_stats_ok(self.plan.spec()) else None
            tiles = sp.bn_stats_tiles if sp is not None else 0
            kc = train_kernel(dev, backward=False, dtype=dt, N=N, C=K, HW=P * Q, act=2 if self.relu else 0,
                              res=self.res, tiles=tiles) if tiles and self.one_fwd is not None else None
            if kc is not None:
                self.conv_stats = (sp, 3 * tiles * K, *kc)     # (the plan, its statistics' floats, the BN pass)
                self.slots["conv_fwd"] = kc[0].slots(_TRAIN_FWD_PTRS + ("tiles",))
        if self.one_fwd is not None:
            kf = self.one_fwd[0]
            self.slots.update(one_fwd=kf.slots(_TRAIN_FWD_PTRS), one_eps=kf.slot["eps"], one_mom=kf.slot["momentum"])
        if self.one_bwd is not None:
            self.slots["one_bwd"] = self.one_bwd[0].slots(TRAIN_BWD_PTRS)
        # whether this layer's backward takes its sums from the next layer's dgrad (the one-launch pass reads dy and z
        # twice; the held one reads them once, so sums made elsewhere save nothing there)
        self.takes_sums = self.one_bwd is not None and held_config(N, K, P * Q, _sms(dev)) is None
        self._tiles_bwd = {}
        # the forward's two ways, found once: (statistics plan, its floats, BatchNorm pass, its partials, keep's bytes,
        # the mask's offset in keep); the second (no statistics from the conv) has the first two None
        nv = (3 if self.sync is not None else 2) * K
        head = self.zb + self.wb + 4 * nv
        if self.sync is not None:
            k, nws = None, self.sync[2][2]
        elif self.one_fwd is not None:
            k, nws = self.one_fwd
        else:
            k, nws = None, self.stats[2]
        self._plain = (None, 0, k, nws, head + 4 * (nws + self.words), head + 4 * nws)
        self._conv_way = None
        if self.conv_stats is not None:
            sp, nparts, kc, nws = self.conv_stats
            self._conv_way = (sp, nparts, kc, nws, head + 4 * (nws + self.words), head + 4 * nws)

    def remake(self, keep, gamma, beta):
        """y = ReLU(BN(z)) as :meth:`forward` wrote it (the same elementwise arithmetic on the same mean and
        invstd, read from ``keep``: the same bits, in the same shape and memory format), for the wgrad of the layer
        that read y, which kept z instead of y (docs/performance.md: train-remake-input)."""
        k, slots = self.remade
        zp = keep.data_ptr()
        b = zp + self.zb + self.wb
        y = torch.empty(self.y_shape, dtype=self.dtype, device=keep.device, memory_format=self.fmt)
        k.run(self.stream_of(keep.device.index), slots,
              [zp, 0, y.data_ptr(), 0, b, b + 4 * self.K,
               gamma.data_ptr() if gamma is not None else 0, beta.data_ptr() if beta is not None else 0])
        return y

    def usable(self, x, w, gamma, beta, residual, rm, rv) -> bool:
        """Whether this call's tensors are as the plans want them (else the op path)."""
        fmt = self.fmt
        return (x.is_contiguous(memory_format=fmt) and w.dtype is self.wdtype and x.data_ptr() % 16 == 0
                and (residual is None or (residual.is_contiguous(memory_format=fmt) and residual.dtype is self.dtype
                                          and residual.data_ptr() % 16 == 0))
                and _f32(gamma, beta, rm, rv) and (rm is None) == (rv is None)
                and _runtime.current_context() == self.plan._ctx_id)

    def forward(self, x, w, gamma, beta, residual, rm, rv, momentum, nbt=None):
        """The conv, z's statistics (with the running update) and BN(-Add)(-ReLU): ``(y, keep, mask, w)``.
        ``keep`` (bytes) holds what the backward reads, in one allocation: z, a master weight's 16-bit copy, then
        mean, invstd (SyncBatchNorm: and the count per channel) in fp32, the BatchNorm launches' partials and the
        mask's words (``mask``: their address); ``w``: the weight the conv read where it is not in ``keep`` (else
        None). Two allocations a call, y and keep: a layer's host time went mostly to allocations
        (docs/performance.md: train-one-keep)."""
        dev = x.device
        h = self.stream_of(dev.index)
        fmt = self.fmt
        # (y is an output of its own, not a view: autograd forbids in-place changes of a custom Function's views)
        y = torch.empty(self.y_shape, dtype=self.dtype, device=dev, memory_format=fmt)
        wp = w.data_ptr()
        # autocast's fp32 weight is cast here (no autograd node; dw is written in fp32), into keep where it can be
        cast = False
        if self.master:
            cast = not wp & 15 and w.is_contiguous(memory_format=fmt)
            if not cast:
                w = w.to(self.dtype).contiguous(memory_format=fmt)      # (fresh: 16-byte aligned)
                wp = w.data_ptr()
        elif not w.is_contiguous(memory_format=fmt):
            w = w.contiguous(memory_format=fmt)
            wp = w.data_ptr()
        wa = cast or not wp & 15
        way = self._conv_way if wa and self._conv_way is not None else self._plain
        sp, nparts, k, nws, nbytes, mo = way
        keep = torch.empty((nbytes,), dtype=torch.uint8, device=dev)
        zp = keep.data_ptr()
        b = zp + self.zb + self.wb
        mp = zp + mo
        if cast:
            launcher, args, ss, sd, lock = self.cast
            wp = zp + self.zb
            with lock:
                args.u64[ss], args.u64[sd] = w.data_ptr(), wp
                launcher.launch_current(h, args)
            w = None
        yp = y.data_ptr()
        gp, bp = gamma.data_ptr() if gamma is not None else 0, beta.data_ptr() if beta is not None else 0
        rp = residual.data_ptr() if residual is not None else 0
        rmp, rvp = (rm.data_ptr(), rv.data_ptr()) if rm is not None else (0, 0)
        K = self.K
        if sp is not None:
            # the conv writes z and its per-tile statistics (3·tiles·K floats, a transient buffer), then one launch
            # merges them and runs the BatchNorm(-Add)-ReLU pass
            pp = _transient(dev, h, nparts).data_ptr()
            sp._launch(h, True, True, x.data_ptr(), wp, zp, 0, pp, _NO_VECTORS, False)
            slots, extra = self.slots["conv_fwd"], [pp]
        else:
            self.plan._launch(h, True, wa, x.data_ptr(), wp, zp, 0, 0, _NO_VECTORS, False)
            if self.sync is not None:
                self._forward_sync(h, dev, zp, b, mp, yp, gp, bp, rp, rm, rv, momentum, nbt)
                return y, keep, mp, w
            slots, extra = self.slots.get("one_fwd"), []
        if k is not None:
            in_kernel = nbt is not None and nbt.dtype is torch.int64 and nbt.device == dev
            k.run(h, slots, [zp, b + 8 * K, b, b + 4 * K, b, b + 4 * K, rmp, rvp, rp, yp, mp, gp, bp,
                             nbt.data_ptr() if in_kernel else 0, *extra],
                  ((self.slots["one_eps"], self.eps), (self.slots["one_mom"], momentum)))
            if nbt is not None and not in_kernel:
                nbt.add_(1)
            self._changed(rm, rv, nbt if in_kernel else None)
            return y, keep, mp, w
        if nbt is not None:
            nbt.add_(1)
        self._changed(rm, rv, None)
        k1, k2, _ = self.stats
        # mean, invstd, kernel 2's partials
        ptrs = [zp, b, b + 4 * K, b + 8 * K, rmp, rvp]
        mom = ((self.slots["eps"], self.eps), (self.slots["momentum"], momentum))
        k1.run(h, self.slots["stats"], ptrs, mom)
        if k2 is not None:
            k2.run(h, self.slots["stats"], ptrs, mom)
        self.bn_fwd.run(h, self.slots["fwd"], [zp, rp, yp, mp, b, b + 4 * K, gp, bp])
        return y, keep, mp, w

    def _forward_sync(self, h, dev, zp, b, mp, yp, gp, bp, rp, rm, rv, momentum, nbt) -> None:
        """SyncBatchNorm's forward after the conv: this rank's statistics, the all-gather, the merge (with the
        running update: mean, invstd and the global count per channel at ``b``), then the BN(-Add)-ReLU pass."""
        _, W, (k1, k2, _), _, gather, _ = self.sync
        K = self.K
        rows = torch.empty((3 * K * (W + 1),), dtype=torch.float64, device=dev)   # this rank's, then every rank's
        r = rows.data_ptr()
        ptrs = [zp, r, r + 8 * K, r + 16 * K, b + 12 * K]
        k1.run(h, self.slots["sync_stats"], ptrs)
        if k2 is not None:
            k2.run(h, self.slots["sync_stats"], ptrs)
        self._all_gather(rows, 3 * K)
        g = r + 24 * K
        gather.run(h, self.slots["gather"], [g, g + 8 * K, g + 16 * K, b, b + 4 * K, b + 8 * K,
                                             *((rm.data_ptr(), rv.data_ptr()) if rm is not None else (0, 0))],
                   ((self.slots["g_eps"], self.eps), (self.slots["g_mom"], momentum)))
        if nbt is not None:
            nbt.add_(1)
        self._changed(rm, rv, None)
        self.bn_fwd.run(h, self.slots["fwd"], [zp, rp, yp, mp, b, b + 4 * K, gp, bp])

    def _all_gather(self, rows, n: int) -> None:
        """Every rank's ``n`` values into ``rows[n:]`` after this rank's ``rows[:n]`` (rank order)."""
        import torch.distributed as dist
        dist.all_gather_into_tensor(rows[n:], rows[:n], group=self.sync[0])

    @staticmethod
    def _changed(rm, rv, nbt):
        """The version counters of the buffers a kernel changed in place (as the op's ``(a!)`` does), so that what
        is derived from them (the inference fold cache) sees the change."""
        if rm is not None:
            increment_version((rm, rv) if nbt is None else (rm, rv, nbt))

    def backward(self, dy, x, w, keep, mp, gamma, need, add_to=None, defer=False, before=None, pre=None,
                 remake=None):
        """dx, dw, dgamma, dbeta and the residual's gradient (those ``need`` asks for) from dy and what
        :meth:`forward` returned (``w``, ``keep``, the mask at ``mp``), then the sums below (or None). ``defer``: where
        :attr:`defers`, dgrad is not run; in dx's place a :class:`_Dgrad` that runs it later, adding into another
        layer's dx. ``before``: (TrainCall, keep, mask address) of the layer whose ReLU(BN(z)) x is: where dgrad can,
        it also writes that layer's BatchNorm sums over dx, returned as ``(sums, tiles)`` for that layer's backward
        on this dx (its ``pre``), which then reads neither dy nor z for them (docs/performance.md:
        bn-sums-in-dgrad). ``remake`` (with ``x`` None): that layer's (gamma, beta), x being its ReLU(BN(z)): made
        by dgrad beside those sums where it writes them, else by that layer's :meth:`remake` (remake-in-dgrad)."""
        dev = dy.device
        h = self.stream_of(dev.index)
        fmt = self.fmt
        if not dy.is_contiguous(memory_format=fmt):
            dy = dy.contiguous(memory_format=fmt)
        dp = dy.data_ptr()
        if dp & 15:                               # (the kernels were found for aligned tensors)
            dy = dy.clone(memory_format=fmt)
            dp = dy.data_ptr()
        K = self.K
        zp, mp = keep.data_ptr(), mp if self.relu else 0
        wp = w.data_ptr() if w is not None else zp + self.zb        # (None: the weight's cast in keep)
        mean = zp + self.zb + self.wb
        invstd, count = mean + 4 * K, mean + 8 * K if self.sync is not None else 0
        gp = gamma.data_ptr() if gamma is not None else 0
        sel = self.relu and need[4]
        if self.one_bwd is not None and (need[0] or need[1]) and dz_fits(self.dt, K, dp, zp):
            # the sums, the coefficients and dz = a·(bit ? dy : 0) + b·z + c (with the residual's gradient) in one
            # launch; dgrad and wgrad then run plain on dz
            k, nws = self.one_bwd
            slots, extra = self.slots["one_bwd"], []
            tk = self._sums_kernel(pre[1]) if pre is not None and self.takes_sums else None
            if tk is not None:                    # (the sums from the next layer's dgrad)
                k, nws, slots = tk
                extra = [pre[0].data_ptr()]
            sums = torch.empty((7 * K + nws,), dtype=torch.float32, device=dev)
            b = sums.data_ptr()
            dz = torch.empty_like(dy)
            dres = torch.empty_like(dy) if sel else None
            k.run(h, slots, [zp, dp, mp, mean, invstd, b + 28 * K, b, b + 4 * K, b + 8 * K, b + 12 * K, gp,
                             b + 16 * K, dp, dz.data_ptr(), zp, dres.data_ptr() if sel else 0, *extra])
            return self._grads(h, dz.data_ptr(), _PLAIN, wp, x, need, sums, dy if need[4] and not self.relu else dres,
                               add_to, (dz, w, keep) if defer else None, before, remake)
        k1, k2, nws = self.grad_red if self.sync is None else self.sync[3]
        sums = torch.empty((7 * K + nws,), dtype=torch.float32, device=dev)   # 4 sums, the coefficients, partials
        b = sums.data_ptr()
        # SyncBatchNorm: this rank's (sum_dy, sum_dy_xmu) in fp64 rows, every rank's then added in rank order into b;
        # grad_weight and grad_bias stay this rank's, as PyTorch's SyncBatchNorm has them
        rows = None if self.sync is None else torch.empty((2 * K * (self.sync[1] + 1),), dtype=torch.float64,
                                                          device=dev)
        o, e = (b, 4) if rows is None else (rows.data_ptr(), 8)
        ptrs = [dp, zp, mp, mean, invstd, o, o + e * K, b + 8 * K, b + 12 * K, b + 28 * K]
        k1.run(h, self.slots["grad"], ptrs)
        if k2 is not None:
            k2.run(h, self.slots["grad"], ptrs)
        if rows is not None:
            self._all_gather(rows, 2 * K)
            self.sync[5].run(h, self.slots["sum_ranks"], [o + 16 * K, b, b + 4 * K])
        launch_coefficients(dev.index, h, K, max(self.N * self.HW, 1), gamma=gp, invstd=invstd, mean=mean, sum_dy=b,
                            sum_dy_xmu=b + 4 * K, coef=b + 16 * K, counts=count)
        fp = {"mask": mp, "z": zp, "coef": b + 16 * K}
        src = dp
        dres = None
        # the residual's gradient behind the ReLU (bit ? dy : 0) comes out of the dz pass where that pass runs
        if self.nhwc and (need[0] or need[1]) and dz_fits(self.dt, K, dp, zp):
            # dz = a·(bit ? dy : 0) + b·z + c made once here for both plans (docs/performance.md: train-dz-once)
            dz = torch.empty_like(dy)
            dres = torch.empty_like(dy) if sel else None
            launch_dz(dev.index, h, self.dt, dy.numel() // K, K, dp, dz.data_ptr(), mode="bn",
                      sel=dres.data_ptr() if sel else 0, sms=self.dgrad.sms, **fp)
            src, fp = dz.data_ptr(), _PLAIN
        elif need[0] and need[1] and self.wgrad.native is not None:
            dz = torch.empty_like(dy)
            self.dgrad._pre.launch(dev.index, h, self.dt, self.dt, src, dz.data_ptr(), mode="bn", sms=self.dgrad.sms,
                                   **fp)
            src, fp = dz.data_ptr(), _PLAIN
        if need[4] and dres is None:
            if self.relu:
                launcher, n = self.relu_bwd
                dres = torch.empty_like(dy)
                launcher(h, bind_args(_relu._BWD_PARAMS, {"dy": dp, "mask": mp, "dx": dres.data_ptr(), "n": n}))
            else:
                dres = dy
        return self._grads(h, src, fp, wp, x, need, sums, dres, add_to,
                           (dz if src != dp else dy, w, keep) if defer else None, before, remake)

    def _sums_kernel(self, tiles: int):
        """The one-launch backward whose sums are ``tiles`` rows of a dgrad's (kernel, workspace floats, its pointer
        slots), or None where its grid is not resident at once."""
        got = self._tiles_bwd.get(tiles, False)
        if got is False:
            got = train_kernel(self.dev, backward=True, dtype=self.dt, N=self.N, C=self.K, HW=self.HW, tiles=tiles)
            if got is not None:
                got = (*got, got[0].slots(TRAIN_BWD_PTRS + ("tiles",)))
            self._tiles_bwd[tiles] = got
        return got

    def _sums_out(self, before, dev):
        """(the sums' tensor, dgrad's pointers for them) where dgrad can write the BatchNorm sums of the layer
        ``before`` names (:meth:`backward`), else (None, None)."""
        if before is None or not self.sums_tiles or not before[0].takes_sums:
            return None, None
        tc, keep, mp = before
        out = torch.empty((2 * self.sums_tiles * tc.K,), dtype=torch.float32, device=dev)
        zp = keep.data_ptr()
        return out, (zp, mp, zp + tc.zb + tc.wb, out.data_ptr())

    def dgrad_into(self, h, src, wp, fp, add_to, dev, bs=None):
        """dx from ``src`` (with the prologue ``fp``) and the weight at ``wp``; ``add_to`` (None: none): a gradient of
        x's that dx includes, added by dgrad's store where it can (then dx is ``add_to``); ``bs`` (not with
        ``add_to``): the pointers of the BatchNorm sums the kernel also writes (``NativeDgrad.launch``'s ``sums``)."""
        g, fmt = self.dgrad, self.fmt
        add = (add_to is not None and g.adds and add_to.dtype is self.dtype and add_to.data_ptr() % 16 == 0
               and add_to.is_contiguous(memory_format=fmt))
        dx = add_to if add else torch.empty(self.x_shape, dtype=self.dtype, device=dev, memory_format=fmt)
        with g._lock:
            g._run(h, src, wp, dx.data_ptr(), fp, add, bs)
        if add_to is not None and not add:
            dx.add_(add_to)
        return dx

    def _grads(self, h, src, fp, wp, x, need, sums, dres, add_to, defer=None, before=None, remake=None):
        """dgrad and wgrad from ``src`` (dy with the prologue ``fp``, or dz plain), the conv's weight at ``wp`` and
        the outputs of backward; ``add_to``: a gradient of x's to add into dx (dgrad's store adds it where it can);
        ``x``: None where wgrad does not run; ``defer``: the tensors behind ``src`` and ``wp`` (dgrad deferred where
        :attr:`defers` and no gradient is to be added here: dx is a :class:`_Dgrad`); ``before``, ``remake``: as
        :meth:`backward`'s."""
        dev, fmt, K = sums.device, self.fmt, self.K
        dx = dw = made = None
        if need[0] and defer is not None and add_to is None and self.defers:
            dx = _Dgrad(self, src, wp, fp, (defer, sums))
        elif need[0]:
            out, bs = self._sums_out(before, dev) if add_to is None else (None, None)
            if bs is not None and x is None and need[1]:       # (x made beside the sums)
                tc = before[0]
                x = torch.empty(tc.y_shape, dtype=tc.dtype, device=dev, memory_format=tc.fmt)
                gamma, beta = remake
                bs += (x.data_ptr(), bs[2] + 4 * tc.K, gamma.data_ptr() if gamma is not None else 0,
                       beta.data_ptr() if beta is not None else 0)
            dx = self.dgrad_into(h, src, wp, fp, add_to, dev, bs)
            made = (out, self.sums_tiles) if out is not None else None
        if need[1]:
            if x is None:
                x = before[0].remake(before[1], *remake)
            g = self.wgrad
            dw = torch.empty(self.w_shape, dtype=self.wdtype, device=dev, memory_format=fmt)
            with g._lock:
                g._run(h, x.data_ptr(), src, dw.data_ptr(), fp)
        return dx, dw, sums[2 * K:3 * K], sums[3 * K:4 * K], dres, made


def stats_plan(xs, ws, dt: str, stride, padding, dilation, device, **where):
    """The training forward's NHWC conv whose kernel also writes z's per-tile BatchNorm statistics where it can
    (``Conv2dPlan.bn_stats_tiles``); ``device``: a CUDA index (cached), or "numpy" with ``arch``/``sms``."""
    args = (xs, ws, dt, "NHWC", stride, padding, dilation)
    make = lambda: Conv2dPlan(*args, device=device, _skeleton=True, _bn_stats=True, **where)   # noqa: E731
    return make() if device == "numpy" else _cached(Conv2dPlan, ("bn_stats", *args, device), make)


class _Dgrad:
    """A layer's dgrad, deferred (``TrainCall.backward(defer=True)``): run by the layer that reads the same input,
    adding into its dx (docs/performance.md: train-downsample-defer). Holds the tensors its pointers are in."""

    __slots__ = ("tc", "src", "wp", "fp", "refs")

    def __init__(self, tc, src, wp, fp, refs):
        self.tc, self.src, self.wp, self.fp, self.refs = tc, src, wp, fp, refs

    def run(self, dx):
        """dx + this gradient, added by the kernel's store into ``dx`` where it can; ``dx`` None: the gradient."""
        dev = self.refs[1].device
        out = self.tc.dgrad_into(self.tc.stream_of(dev.index), self.src, self.wp, self.fp, dx, dev)
        self.refs = None
        return out
