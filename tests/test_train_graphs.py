"""Training a converted model inside CUDA graphs: ``torch.cuda.make_graphed_callables`` captures the forward and
backward of an ``igemm.nn.convert``-ed model in train mode (batch statistics, running statistics, the fused
backward), and every replay equals the eager run (the same kernels on the same memory).

    python tests/test_train_graphs.py precompile [arch]     compiles every kernel the GPU tests launch
"""
from __future__ import annotations

import copy
import sys

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import igemm.nn as inn  # noqa: E402

from test_train import CL, Block, _rel, small_resnet  # noqa: E402


def _wide(classes=10):
    """64 and 128 channels: the 3x3 and 1x1 convolutions run the native dgrad and wgrad kernels on sm_90a."""
    return nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(), Block(64, 64),
                         Block(64, 128, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, classes))


@pytest.mark.gpu
@pytest.mark.parametrize("make", [small_resnet, _wide], ids=["narrow", "wide"])
def test_gpu_converted_training_replays_as_eager(make):
    """fp16 autocast, channels_last: three steps of graph replays give the eager run's losses and gradients, and
    the same BatchNorm running statistics (both start from the buffers the capture's warm-up left)."""
    torch.manual_seed(7)
    base = make().cuda().to(memory_format=CL).train()
    eager_m, graph_m = copy.deepcopy(base), copy.deepcopy(base)
    eager, graphed = inn.convert(eager_m, inplace=True).train(), inn.convert(graph_m, inplace=True).train()
    x = torch.randn(16, 3, 16, 16, device="cuda").contiguous(memory_format=CL)
    t = torch.randint(0, 10, (16,), device="cuda")
    with torch.autocast("cuda", torch.float16, cache_enabled=False):
        graphed = torch.cuda.make_graphed_callables(graphed, (x,))
    with torch.no_grad():
        for a, b in zip(eager_m.buffers(), graph_m.buffers()):
            a.copy_(b)
    for _ in range(3):
        losses = []
        for m, params in ((eager, eager_m), (graphed, graph_m)):
            params.zero_grad(set_to_none=True)
            with torch.autocast("cuda", torch.float16, cache_enabled=False):
                loss = nn.functional.cross_entropy(m(x), t)
            loss.backward()
            losses.append(loss.detach())
        assert _rel(losses[1], losses[0]) < 1e-6
        for (name, a), b in zip(eager_m.named_parameters(), graph_m.parameters()):
            assert b.grad is not None and _rel(b.grad, a.grad) < 1e-5, name
    for (name, a), b in zip(eager_m.named_buffers(), graph_m.buffers()):
        assert torch.equal(a, b) if not a.is_floating_point() else _rel(b, a) < 1e-6, name


def precompile(arch: str = "sm_90a") -> int:
    """Compile the kernels the GPU tests launch (no GPU): both models' forward and backward in fp16."""
    x = torch.randn(16, 3, 16, 16).half().contiguous(memory_format=CL)
    return sum(inn.precompile(inn.convert(make()).half().to(memory_format=CL).train(), x, arch=arch, sms=132)
               for make in (small_resnet, _wide))


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "precompile":
        print(precompile(*sys.argv[2:3]), "kernels")
    else:
        print("usage: python tests/test_train_graphs.py precompile [arch]")
