"""Run one ResNet-50 layer through igemm (or cuDNN) a few times (for ncu):

    python tools/profile_layer.py IDX [layout] [chain] [config-json] [N]    e.g. 5 NHWC none '{"streamk": 1}' 8

chain: none | bn_relu_mask | bn_add_relu_mask | cudnn (F.conv2d on the same tensors, channels_last for NHWC); N defaults to 32.
"""
import json
import sys

import torch

import igemm
from igemm import epilogues as ep

sys.path.insert(0, "benchmarks")
from bench_conv import RESNET50  # noqa: E402

idx = int(sys.argv[1])
layout = sys.argv[2] if len(sys.argv) > 2 else "NHWC"
chain = sys.argv[3] if len(sys.argv) > 3 else "none"
cfg = json.loads(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] not in ("", "null") else None
N = int(sys.argv[5]) if len(sys.argv) > 5 else 32
name, C, K, H, R, st, pd = RESNET50[idx]
xs = (N, C, H, H) if layout == "NCHW" else (N, H, H, C)
ws = (K, C, R, R) if layout == "NCHW" else (K, R, R, C)
x = torch.randn(xs, device="cuda", dtype=torch.float16)
w = torch.randn(ws, device="cuda", dtype=torch.float16) / 30
if chain == "cudnn":
    xt, wt = (x, w) if layout == "NCHW" else (x.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2))
    print(name, "cuDNN", "N", N, flush=True)
    for _ in range(4):
        torch.nn.functional.conv2d(xt, wt, stride=st, padding=pd)
    torch.cuda.synchronize()
    sys.exit(0)
g, b, m, v = (torch.rand(K, device="cuda") + 0.5 for _ in range(4))
ops = {"none": (), "bn_relu_mask": (ep.BatchNorm(g, b, m, v), ep.ReLU(mask=True)),
       "bn_add_relu_mask": (ep.BatchNorm(g, b, m, v), ep.Add(), ep.ReLU(mask=True))}[chain]
epi = ep.chain(*ops) if ops else None
plan = igemm.Conv2dPlan(xs, ws, "float16", layout, st, pd, epilogue=epi, options=igemm.Conv2dOptions(config=cfg))
res = torch.randn(plan.y_shape, device="cuda", dtype=torch.float16) if chain == "bn_add_relu_mask" else None
print(name, plan.spec().name(), "splits", plan.spec().splits, "N", N, flush=True)
for _ in range(4):
    plan(x, w, residual=res) if res is not None else plan(x, w)
torch.cuda.synchronize()
