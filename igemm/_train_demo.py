"""``python -m igemm train-demo``: a ResNet trained through ``igemm.nn.convert`` next to PyTorch eager.

Both models start from the same random weights and train on the same synthetic data (one fixed random batch with
random labels, so the loss falls as the batch is memorised): channels_last, ``torch.autocast`` in ``--dtype``
(fp16 with ``torch.amp.GradScaler``), SGD with momentum. Prints the loss of both every few steps and, at the end,
images/s (CUDA events around each step, the first steps left out as warm-up) and the losses. The model is
torchvision's (``--model``); without torchvision, a small built-in ResNet (conv-BN-ReLU stem, two residual
blocks). Without a GPU it says so and runs a couple of steps on the CPU with a tiny batch (igemm's ops then compute
with PyTorch's ops, so the times mean nothing). Imports torch only when run.
"""
from __future__ import annotations

import copy
import math
import sys
import time

DATA = {"imagenet": (224, 1000, "resnet50"), "cifar": (32, 10, "resnet18")}   # image size, classes, model


def add_arguments(p) -> None:
    """The ``train-demo`` subcommand's options on the argparse parser ``p``."""
    p.add_argument("--model", default=None, help="a torchvision ResNet (default: resnet50; resnet18 with --data "
                   "cifar); a small built-in ResNet where torchvision is not installed")
    p.add_argument("--data", default="imagenet", choices=sorted(DATA),
                   help="synthetic data shaped as ImageNet (224x224, 1000 classes) or CIFAR (32x32, 10 classes)")
    p.add_argument("--batch", type=int, default=64, help="images per step (on the CPU: at most 2)")
    p.add_argument("--steps", type=int, default=50, help="training steps (on the CPU: at most 2)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                   help="the autocast dtype (float32: no autocast)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (momentum 0.9, weight decay 1e-4)")
    p.add_argument("--every", type=int, default=10, help="print the losses every this many steps")


def tiny_resnet(num_classes: int):
    """A small ResNet-like model (stem of two conv-BN-ReLU, two residual blocks, pooling, linear layer)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, c: int):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

        def forward(self, x):
            out = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(out)) + x)

    return nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
                         nn.Conv2d(32, 64, 3, 2, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                         Block(64), Block(64), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))


def _model(name: str, num_classes: int):
    """(model, description): torchvision's ``name``, or the built-in one without torchvision."""
    try:
        import torchvision
    except ImportError:
        return tiny_resnet(num_classes), f"built-in small ResNet (torchvision is not installed; not {name})"
    fn = getattr(torchvision.models, name, None)
    if fn is None or not callable(fn):
        raise ValueError(f"--model: torchvision.models has no {name!r}")
    return fn(num_classes=num_classes), f"torchvision {name}"


def _progress(total: int):
    """A tqdm bar when tqdm is installed, else None (the loss lines are then the progress)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="train-demo", unit="step", leave=False)


def train_demo(args) -> int:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("train-demo needs torch: pip install 'igemm[torch]'", file=sys.stderr)
        return 2
    import igemm.nn as inn
    if args.batch < 2 or args.steps < 1 or args.every < 1:
        print("train-demo: --batch must be at least 2, --steps and --every at least 1", file=sys.stderr)
        return 2
    size, classes, default_model = DATA[args.data]
    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    N, steps = (args.batch, args.steps) if gpu else (min(args.batch, 2), min(args.steps, 2))
    if not gpu:
        print(f"No CUDA GPU visible: running {steps} step(s) on the CPU with batch {N} in float32 (igemm's ops run "
              "PyTorch's ops there; the times below mean nothing). Run it on a GPU for igemm's kernels.")
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    try:
        base, what = _model(args.model or default_model, classes)
    except ValueError as e:
        print(f"train-demo: {e}", file=sys.stderr)
        return 2
    amp = gpu and args.dtype != "float32"
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(N, 3, size, size, device=dev, generator=g).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, classes, (N,), device=dev, generator=g)

    models = {}
    for name in ("igemm", "pytorch"):
        m = copy.deepcopy(base).to(dev).to(memory_format=torch.channels_last).train()
        run = m
        if name == "igemm":
            run, report = inn.convert(m, inplace=True, return_report=True)   # (shares m's parameters)
            print(report)
            if gpu:
                t0 = time.perf_counter()
                with torch.autocast("cuda", dtype=dtype, enabled=amp):
                    n = inn.precompile(run, x)
                print(f"igemm.nn.precompile: {n} kernels ready in {time.perf_counter() - t0:.1f} s")
        opt = torch.optim.SGD(m.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
        scaler = torch.amp.GradScaler(dev, enabled=amp and dtype == torch.float16)
        models[name] = (run, opt, scaler)
    del base

    def step(name: str):
        run, opt, scaler = models[name]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype, enabled=amp):
            loss = F.cross_entropy(run(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    print(f"\ntrain-demo: {what}, {'ImageNet' if args.data == 'imagenet' else 'CIFAR'}-shaped synthetic data "
          f"({N}x3x{size}x{size}, {classes} classes), {args.dtype if amp else 'float32'}"
          f"{' autocast' if amp else ''}, channels_last, SGD lr {args.lr}, {steps} steps, {dev}\n")
    warm = min(5, steps // 5) if gpu else 0             # steps left out of images/s (cuDNN's and igemm's first)
    times = {k: [] for k in models}
    losses = {k: [] for k in models}
    bar = _progress(steps)
    say = bar.write if bar is not None else print
    for i in range(1, steps + 1):
        for name in models:
            if gpu:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                losses[name].append(step(name))
                b.record()
                times[name].append((a, b))
            else:
                t0 = time.perf_counter()
                losses[name].append(step(name))
                times[name].append(time.perf_counter() - t0)
        if i % args.every == 0 or i in (1, steps):
            li, lt = (float(losses[k][-1]) for k in ("igemm", "pytorch"))
            say(f"step {i:4d}/{steps}  loss  igemm {li:8.4f}  pytorch {lt:8.4f}")
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if gpu:
        torch.cuda.synchronize()
        times = {k: [a.elapsed_time(b) * 1e-3 for a, b in v] for k, v in times.items()}
    print(f"\n| {'model':22s} | {'images/s':>9s} | {'ms/step':>8s} | {'loss, first':>11s} | {'loss, last':>10s} |")
    print(f"|{'-' * 24}|{'-' * 11}|{'-' * 10}|{'-' * 13}|{'-' * 12}|")
    rate = {}
    for name, label in (("igemm", "igemm.nn.convert"), ("pytorch", "PyTorch eager")):
        t = sum(times[name][warm:]) / len(times[name][warm:])
        rate[name] = N / t
        print(f"| {label:22s} | {rate[name]:9.1f} | {t * 1e3:8.2f} | {float(losses[name][0]):11.4f} | "
              f"{float(losses[name][-1]):10.4f} |")
    print(f"\nigemm / PyTorch images/s: {rate['igemm'] / rate['pytorch']:.3f}"
          f" (mean over steps {warm + 1}-{steps}{'' if gpu else '; CPU: not meaningful'})")
    last = float(losses["igemm"][-1])
    if not math.isfinite(last):
        print("igemm's loss is not finite", file=sys.stderr)
        return 1
    return 0
