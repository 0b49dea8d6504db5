"""The training op's eager path: a fused module's training forward on a plain CUDA tensor outside torch.compile
(which sees the op) through a ``TrainCall`` (nn/_train_call.py: its plans and kernels found once per input
geometry, then per step only pointers and launches, as ``_ops.FastCall`` does for inference) and this module's
autograd Function, which saves what the backward reads and links the layers of a residual block whose gradients
meet (the identity's and the downsampling branch's adds done by dgrad's store, an input remade instead of kept).
"""
from __future__ import annotations

import weakref

import torch

from . import _ops
from ._train_call import TrainCall, _Dgrad

__all__ = ["train"]

_calls: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # module -> {input geometry: TrainCall|None}


class _Link:
    """A residual block's identity path (docs/performance.md: train-identity-add): the residual's gradient
    (``bit ? dy : 0``) that the block's last layer hands to the layer that took the same input first, whose dgrad adds
    it into dx as it stores (autograd would add the input's two gradients with a kernel of its own)."""

    __slots__ = ("pending",)

    def __init__(self):
        self.pending = None


class _Pair:
    """A downsampling block's input gradient (docs/performance.md: train-downsample-add): the block's first layer and
    its downsampling layer read the same input, so x's gradient is the sum of their dx. Armed by the block's last
    layer's backward when it passes a gradient to both (then both backwards run); the first of the two to run hands
    its dx over, the second's dgrad adds it as it stores. Unarmed, each returns its own dx to autograd."""

    __slots__ = ("armed", "ran", "pending")

    def __init__(self):
        self.armed, self.ran, self.pending = False, 0, None


# an input of a layer on this path, (pointer, shape, strides) -> (id of its grad_fn, its version, that layer's _Link)
# (ids, not the nodes: nothing here keeps a graph alive; a match is checked through the layer's own x_fn below)
_starts: dict = {}


def _start(ctx, x) -> None:
    """Record ``x`` as this layer's input, where a later layer's residual may be the same autograd value."""
    ctx.x_fn = fn = x.grad_fn
    ctx.link = ctx.pair = ctx.x_key = None
    if fn is not None:
        ctx.link = link = _Link()
        if len(_starts) > 4096:
            _starts.clear()
        key = (x.data_ptr(), x.shape, x.stride())
        _starts[key] = (id(fn), x._version, link)
        ctx.x_key = (key, x._version, x.output_nr)


def _joined(x, r):
    """The _Link of the layer that took the residual ``r`` as its input, where this layer's input ``x`` comes from that
    layer through at most two such layers (a ResNet block: conv1 [-> conv2] -> this): that layer's backward then runs
    after this one's, every time this one's does with ``r`` needing a gradient. None otherwise."""
    e = _starts.get((r.data_ptr(), r.shape, r.stride()))
    if e is None or e[1] != r._version:
        return None
    n = x.grad_fn
    for _ in range(3):
        if type(n) is not _BACKWARD:
            return None
        if n.link is e[2]:      # (n holds its input's grad_fn: that id is no other node's)
            return e[2] if id(n.x_fn) == e[0] and n.x_fn is r.grad_fn else None
        n = n.x_fn
    return None


def _paired(x, r):
    """A _Pair for the layer whose y is the residual ``r`` (the downsampling layer) and the layer that took the same
    input, from which this layer's input ``x`` comes through at most two such layers (a ResNet block: conv1
    [-> conv2] -> this); None where there is none, or either already has a pair."""
    d = r.grad_fn
    if type(d) is not _BACKWARD or r.output_nr != 0 or d.x_key is None or d.pair is not None:
        return None
    n = x.grad_fn
    for _ in range(3):
        if type(n) is not _BACKWARD:
            return None
        if n.x_fn is d.x_fn and n.x_key == d.x_key and n is not d:
            if n.pair is not None:
                return None
            n.pair = d.pair = p = _Pair()
            return p
        n = n.x_fn
    return None


class _FastTrain(torch.autograd.Function):
    """nn.conv2d_bn_train's y through a TrainCall (the same formula as the op's autograd.Function). Its one output
    is y: z, the statistics and the mask are saved, not returned (an output costs autograd's bookkeeping; a view an
    allocation's worth of host time)."""

    @staticmethod
    def forward(ctx, tc, x, w, gamma, beta, residual, bn):
        rm, rv, momentum, nbt = bn
        y, keep, mp, w = tc.forward(x, w, gamma, beta, residual, rm, rv, momentum, nbt)
        ctx.tc, ctx.mp = tc, mp
        ctx.set_materialize_grads(False)          # (dy None, not zeros, where y has no gradient)
        # an input that is another layer's ReLU(BN(z)) is not kept: wgrad remakes it from that layer's z
        # (docs/performance.md: train-remake-input)
        src = _maker(x)
        ctx.src_fn = src[0] if src is not None else None     # (that layer's node: what remakes x, its BatchNorm)
        ctx.pre = None      # (set by the next layer's backward: the sums its dgrad wrote for this layer's BatchNorm)
        ctx.save_for_backward(None if src is not None else x, w, gamma, keep,
                              *(src[1:] if src is not None else ()))      # (w: the conv's, cast from a master weight)
        # y's pointer and version, and what remakes y: a later layer reading y unchanged keeps these in its place
        # (references until this backward runs; none of them depends on this node: no cycle)
        ctx.y_made = (y.data_ptr(), y._version, keep, gamma, beta) if tc.relu and not tc.res else None
        _start(ctx, x)
        # (behind the ReLU the residual's gradient is a fresh tensor of the dz pass's: it may be added into)
        res = residual is not None and residual.requires_grad
        ctx.res_link = _joined(x, residual) if tc.relu and res else None
        ctx.arms = _paired(x, residual) if res and ctx.res_link is None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        link, pair, add_to, first = ctx.link, ctx.pair, None, False
        ctx.y_made = None
        if link is not None and link.pending is not None:
            add_to, link.pending = link.pending, None
        job = None
        if pair is not None and pair.armed:      # (this layer and the downsampling one read the same x)
            pair.ran += 1
            first = pair.ran == 1
            if not first:
                p, pair.armed, pair.ran, pair.pending = pair.pending, False, 0, None
                if type(p) is _Dgrad:             # (the other's dgrad, deferred: it adds into this one's dx)
                    if dy is None:
                        p = p.run(None)
                    else:
                        job, p = p, None
                if p is not None:
                    add_to = p if add_to is None else add_to + p
        if dy is None:                            # (y took no part in what was differentiated)
            return (None, add_to) + (None,) * 5
        x, w, gamma, keep, *src = ctx.saved_tensors
        n = ctx.needs_input_grad
        fn, pre, ctx.src_fn, ctx.pre = ctx.src_fn, ctx.pre, None, None
        if pre is not None:                       # (dy must be that dgrad's dx, unchanged: nothing added to it)
            d = pre[0]
            if (d.data_ptr(), d.shape, d.stride(), pre[1]) != (dy.data_ptr(), dy.shape, dy.stride(), dy._version):
                pre = None
        # (where x is the ReLU(BN(z)) of the layer before, saved as None, dgrad also makes that layer's BatchNorm sums
        # over dx and, where it does, x itself, else fn.tc.remake does: docs/performance.md, bn-sums-in-dgrad,
        # remake-in-dgrad)
        dx, dw, dg, db, dres, made = ctx.tc.backward(dy, x, w, keep, ctx.mp, gamma, n[1:], add_to, defer=first,
                                                     before=(fn.tc, src[0], fn.mp) if src else None,
                                                     pre=pre[2:] if pre is not None else None,
                                                     remake=src[1:] if src else None)
        if made is not None and job is None and not first:
            fn.pre = (dx, dx._version, *made)
        if job is not None:
            dx = job.run(dx)
        if first:
            # (the other layer of the pair adds it into its dx: this dx, or this dgrad run later into that dx, which
            # spares a strided dgrad the zeroing of the rows no tap reaches)
            pair.pending, dx = dx, None
        if ctx.arms is not None and dx is not None and dres is not None and n[5]:
            ctx.arms.armed, ctx.arms.ran, ctx.arms.pending = True, 0, None     # (both of the pair's backwards run)
        if ctx.res_link is not None and dres is not None and n[5]:
            ctx.res_link.pending, dres = dres, None      # (the block's first layer adds it into its dx)
        return None, dx, dw, dg if n[3] else None, db if n[4] else None, dres if n[5] else None, None


_BACKWARD = _FastTrain._backward_cls
# autograd.Function.apply's own call (its Python wrapper binds no defaults here and, without functorch transforms,
# only unwraps dead functorch wrappers, which an input with a data pointer is not): a few us a layer
_APPLY = super(torch.autograd.Function, _FastTrain).apply
_transforms_active = torch._C._are_functorch_transforms_active


def _maker(x):
    """Where ``x`` is the ReLU(BN(z)) output of a layer of this path (its y, with no residual), unchanged since:
    that layer's node (its TrainCall, ``tc``, and mask address, ``mp``) and what remakes x (its kept z and
    statistics, gamma, beta); None otherwise."""
    fn = x.grad_fn
    if type(fn) is not _BACKWARD or x.output_nr != 0:
        return None
    made = fn.y_made                      # (None once that layer's backward ran: y is a plain input then)
    if made is None or made[0] != x.data_ptr() or made[1] != x._version:
        return None
    return fn, *made[2:]


def train(owner, x, w, gamma, beta, residual, rm, rv, momentum: float, eps: float, stride, padding, dilation,
          relu: bool, nbt=None, group=False):
    """A module's training forward on the eager path (its output y), or None where the op path must run it
    (nothing launched then). ``nbt``: BatchNorm2d's num_batches_tracked, to be incremented here; ``group``:
    SyncBatchNorm's process group (None: the default one), False: none."""
    per = _calls.get(owner)
    if per is None:
        per = _calls[owner] = {}
    key = (x.shape, x.stride(), x.dtype, x.get_device(), w.shape, w.dtype,
           None if residual is None else (residual.shape, residual.stride()), group is not False, id(group))
    tc = per.get(key, False)
    if tc is False:
        # (an fp32 weight with a 16-bit x: autocast's master weight, which the module passes only under autocast)
        master = w.dtype is torch.float32 and x.dtype is not torch.float32
        wk = w.detach().to(x.dtype) if master else w
        ok = _ops.supported(x, wk) and (_ops._nhwc(x) or x.is_contiguous()) and x.numel() > 0
        tc = per[key] = TrainCall(x, wk, residual, eps, stride, padding, dilation, relu, group, master) if ok else None
    if tc is None or not tc.usable(x, w, gamma, beta, residual, rm, rv):
        return None
    apply = _FastTrain.apply if _transforms_active() else _APPLY
    return apply(tc, x, w, gamma, beta, residual, (rm, rv, float(momentum), nbt))
