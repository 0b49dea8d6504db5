"""``igemm.nn.convert``: a model's conv -> BN (-> + identity) -> ReLU patterns, conv -> BN pairs, lone convs,
pooling layers (``nn.MaxPool2d``, ``nn.AdaptiveAvgPool2d`` to 1 x 1) and classifier heads (that average pool ->
flatten -> ``nn.Linear``) replaced by igemm modules.

A model that ``torch.fx.symbolic_trace`` traces (torchvision's CNNs do) is rewritten on its graph: the
patterns are found by data flow, whatever the module structure (a ResNet block's ``out += identity; relu``
included), and its eager inference forward runs its leading igemm layers as one launch program (``_program``).
Otherwise the modules are walked: inside each ``nn.Sequential``, conv, BN (, ReLU) runs are fused; every other
convertible ``nn.Conv2d`` becomes :class:`igemm.nn.Conv2d`. Convolutions igemm does not run
(grouped, depthwise, 1-D/3-D, transposed, other padding modes) stay PyTorch modules.
"""
from __future__ import annotations

import copy
import logging
import operator

import torch
from torch import nn

from . import _program
from ._modules import Conv2d, Conv2dBN, Conv2dBNAddReLU, Conv2dBNReLU, _padding
from ._pool import AdaptiveAvgPool2d, AvgPoolLinear, MaxPool2d, _pair

__all__ = ["convert", "Report"]

log = logging.getLogger("igemm.nn")
_RELU_FUNCS = (torch.relu, torch.nn.functional.relu, torch.relu_)
_ADD_FUNCS = (operator.add, operator.iadd, torch.add)
_OTHER_CONVS = (nn.Conv1d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_BN = (nn.BatchNorm2d, nn.SyncBatchNorm)


class Report(dict):
    """What :func:`convert` did: ``converted`` (module path -> the igemm module's kind) and ``left`` (module
    path -> why it stayed PyTorch's); ``traced``: whether the graph rewrite ran."""

    def __str__(self) -> str:
        kinds: dict = {}
        for k in self["converted"].values():
            kinds[k] = kinds.get(k, 0) + 1
        head = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "nothing"
        left = "; ".join(f"{p}: {why}" for p, why in self["left"].items()) or "none"
        return f"igemm.nn.convert ({'graph' if self['traced'] else 'module walk'}): converted {head}; left: {left}"


def _igemm_pool(m):
    """igemm's module for a PyTorch pooling module it runs (a max pool, a global average pool), else None."""
    if type(m) is nn.MaxPool2d:
        return MaxPool2d.from_torch(m)
    if type(m) is nn.AdaptiveAvgPool2d and _pair(m.output_size) == (1, 1):
        return AdaptiveAvgPool2d.from_torch(m)
    return None


def _head(node, modules):
    """(flatten node, linear node) where ``node`` (a global average pool module's call) starts a classifier head --
    the pool's only reader ``torch.flatten(., 1)`` (or ``nn.Flatten()``, or ``.flatten(1)``), whose only reader is an
    ``nn.Linear`` -- else None."""
    m = modules.get(node.target)
    if type(m) not in (nn.AdaptiveAvgPool2d, AdaptiveAvgPool2d) or _pair(m.output_size) != (1, 1):
        return None
    flat = _single_user(node)
    if flat is None or flat.args[:1] != (node,):
        return None
    fm = modules.get(flat.target) if flat.op == "call_module" else None
    if not ((flat.op == "call_function" and flat.target is torch.flatten or
             flat.op == "call_method" and flat.target == "flatten")
            and list(flat.args[1:]) + list(flat.kwargs.values()) in ([1], [1, -1])
            or type(fm) is nn.Flatten and (fm.start_dim, fm.end_dim) == (1, -1) and len(flat.args) == 1):
        return None
    lin = _single_user(flat)
    if (lin is None or lin.op != "call_module" or type(modules.get(lin.target)) is not nn.Linear
            or lin.args != (flat,) or lin.kwargs):
        return None
    return flat, lin


def _convertible(conv) -> str | None:
    """Why this module stays PyTorch's (None: igemm runs it)."""
    if type(conv) is not nn.Conv2d:
        return None if isinstance(conv, Conv2d) else f"{type(conv).__name__} is not a Conv2d"
    if conv.groups != 1:
        return f"groups={conv.groups}"
    if conv.padding_mode != "zeros":
        return f"padding_mode={conv.padding_mode!r}"
    if _padding(conv) is None:
        return f"padding={conv.padding!r} (asymmetric)"
    return None


def convert(model: nn.Module, *, inplace: bool = False, return_report: bool = False, sync_bn=False):
    """Replace ``model``'s convolutions (and the BN, residual add and ReLU after them) and its ``nn.MaxPool2d`` and
    global ``nn.AdaptiveAvgPool2d`` layers with igemm modules.

    Args:
        model: any ``nn.Module``; its parameters and buffers are shared by the result unless copied
            (``inplace=False``, the default, converts a deep copy).
        inplace: convert ``model`` itself (with a traced graph, the result is still a new ``GraphModule``).
        return_report: also return the :class:`Report` (it is logged on the ``igemm.nn`` logger either way).
        sync_bn: a ``torch.distributed`` process group (None: the default group) to make every BatchNorm a
            SyncBatchNorm first (``torch.nn.SyncBatchNorm.convert_sync_batchnorm``); False (default): as they are.
            A fused module over a SyncBatchNorm trains with the statistics and backward sums of every rank's batch
            (igemm's NCCL-merged Welford statistics; uneven batches too); ``SyncBatchNorm`` layers already in the
            model are fused the same way.

    Returns:
        The converted module (an ``fx.GraphModule`` when the model traced), or ``(module, report)``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    m = model if inplace else copy.deepcopy(model)
    if sync_bn is not False:
        m = nn.SyncBatchNorm.convert_sync_batchnorm(m, sync_bn)
    report = Report(converted={}, left={}, traced=False)
    try:
        gm = torch.fx.symbolic_trace(m)
    except Exception as e:                         # (data-dependent control flow, unsupported ops, ...)
        log.info("igemm.nn.convert: the model does not trace (%s: %s); walking its modules", type(e).__name__, e)
        _walk(m, "", report)
        out = m
    else:
        report["traced"] = True
        _rewrite(gm, report)
        _program.install(gm)
        out = gm
    out.train(model.training)
    log.info("%s", report)
    return (out, report) if return_report else out


def _single_user(node):
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _is_relu(node, modules) -> bool:
    if node is None:
        return False
    if node.op == "call_module":
        return isinstance(modules.get(node.target), nn.ReLU)
    if node.op == "call_function":
        return node.target in _RELU_FUNCS
    return node.op == "call_method" and node.target in ("relu", "relu_")


def _is_add(node) -> bool:
    if node is None or node.kwargs:
        return False
    return ((node.op == "call_function" and node.target in _ADD_FUNCS) or
            (node.op == "call_method" and node.target in ("add", "add_", "__iadd__"))) and len(node.args) == 2


def igemm_module(kind: str, conv: nn.Conv2d, bn: nn.BatchNorm2d | None) -> nn.Module:
    """The igemm module of a pattern (``kind``: "Conv2d", "Conv2dBN", "Conv2dBNReLU", "Conv2dBNAddReLU")."""
    if kind == "Conv2d":
        return Conv2d.from_torch(conv)
    return {"Conv2dBN": Conv2dBN, "Conv2dBNReLU": Conv2dBNReLU, "Conv2dBNAddReLU": Conv2dBNAddReLU}[kind](conv, bn)


def _rewrite(gm, report: Report, make=igemm_module, pools: bool = True) -> None:
    """The graph rewrite: each conv node, with what follows it, as one module call (``make(kind, conv, bn)``),
    and (``pools``) each classifier head as :class:`AvgPoolLinear` and each other pool as igemm's
    (igemm/baselines/cudnn_fused.py builds its cuDNN peer with the same rewrite, its pools and head left PyTorch's)."""
    modules = dict(gm.named_modules())
    graph = gm.graph
    gone = set()
    for node in list(graph.nodes):
        if node.op != "call_module" or node in gone:
            continue
        head = _head(node, modules) if pools else None
        if head is not None:
            flat, lin = head
            name = lin.target.replace(".", "_") + "_igemm"
            gm.add_submodule(name, AvgPoolLinear.from_torch(modules[lin.target]))
            with graph.inserting_before(lin):
                new = graph.call_module(name, (node.args[0],))
            lin.replace_all_uses_with(new)
            for n in (lin, flat, node):
                graph.erase_node(n)
            gone.update((lin, flat))
            report["converted"][node.target] = report["converted"][lin.target] = "AvgPoolLinear"
            continue
        pool = _igemm_pool(modules.get(node.target)) if pools else None
        if pool is not None:
            name = node.target.replace(".", "_") + "_igemm"
            gm.add_submodule(name, pool)
            report["converted"][node.target] = type(pool).__name__
            node.target = name
            continue
        if isinstance(modules.get(node.target), _OTHER_CONVS):
            report["left"][node.target] = type(modules[node.target]).__name__
            continue
        if not isinstance(modules.get(node.target), nn.Conv2d):
            continue
        conv = modules[node.target]
        why = _convertible(conv)
        if why is not None:
            report["left"][node.target] = why
            continue
        chain = [node]
        bn_node = _single_user(node)
        bn = modules.get(bn_node.target) if bn_node is not None and bn_node.op == "call_module" else None
        identity, kind = None, "Conv2d"
        if isinstance(bn, _BN) and bn.num_features == conv.out_channels:
            chain.append(bn_node)
            nxt, kind = _single_user(bn_node), "Conv2dBN"
            if _is_relu(nxt, modules):
                chain.append(nxt)
                kind = "Conv2dBNReLU"
            elif _is_add(nxt) and _is_relu(_single_user(nxt), modules):
                other = nxt.args[1] if nxt.args[0] is bn_node else nxt.args[0]
                if isinstance(other, torch.fx.Node) and other is not bn_node:
                    chain += [nxt, _single_user(nxt)]
                    identity, kind = other, "Conv2dBNAddReLU"
        else:
            bn = None
        mod = make(kind, conv, bn)
        name = node.target.replace(".", "_") + "_igemm"
        gm.add_submodule(name, mod)
        last = chain[-1]
        with graph.inserting_before(last):
            new = graph.call_module(name, (node.args[0],) if identity is None else (node.args[0], identity))
        last.replace_all_uses_with(new)
        for n in reversed(chain):
            graph.erase_node(n)
        report["converted"][node.target] = kind
    graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()


def _walk(module: nn.Module, prefix: str, report: Report) -> None:
    """The module walk (a model that does not trace)."""
    if isinstance(module, nn.Sequential):
        names = list(module._modules)
        i = 0
        while i < len(names):
            c = module._modules[names[i]]
            nxt = module._modules[names[i + 1]] if i + 1 < len(names) else None
            if (type(c) is nn.Conv2d and _convertible(c) is None and isinstance(nxt, _BN)
                    and nxt.num_features == c.out_channels):
                relu = i + 2 < len(names) and isinstance(module._modules[names[i + 2]], nn.ReLU)
                module._modules[names[i]] = (Conv2dBNReLU if relu else Conv2dBN)(c, nxt)
                module._modules[names[i + 1]] = nn.Identity()
                if relu:
                    module._modules[names[i + 2]] = nn.Identity()
                report["converted"][prefix + names[i]] = type(module._modules[names[i]]).__name__
                i += 3 if relu else 2
                continue
            i += 1
    for name, child in module.named_children():
        path = prefix + name
        if type(child) is nn.Conv2d:
            why = _convertible(child)
            if why is None:
                setattr(module, name, Conv2d.from_torch(child))
                report["converted"][path] = "Conv2d"
            else:
                report["left"][path] = why
        elif (pool := _igemm_pool(child)) is not None:
            setattr(module, name, pool)
            report["converted"][path] = type(pool).__name__
        elif isinstance(child, _OTHER_CONVS):
            report["left"][path] = type(child).__name__
        elif not isinstance(child, (Conv2d, Conv2dBN, Conv2dBNReLU, Conv2dBNAddReLU)):
            _walk(child, path + ".", report)
