"""Run one ResNet-50 layer through igemm a few times (for ncu):

    python tools/profile_layer.py IDX [layout] [chain] [config-json]    e.g. 5 NHWC none '{"streamk": 1}'
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
cfg = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
name, C, K, H, R, st, pd = RESNET50[idx]
N = 32
xs = (N, C, H, H) if layout == "NCHW" else (N, H, H, C)
ws = (K, C, R, R) if layout == "NCHW" else (K, R, R, C)
x = torch.randn(xs, device="cuda", dtype=torch.float16)
w = torch.randn(ws, device="cuda", dtype=torch.float16) / 30
g, b, m, v = (torch.rand(K, device="cuda") + 0.5 for _ in range(4))
epi = None if chain == "none" else ep.chain(ep.BatchNorm(g, b, m, v), ep.ReLU(mask=True))
plan = igemm.Conv2dPlan(xs, ws, "float16", layout, st, pd, epilogue=epi, config=cfg)
print(name, plan.spec().name(), "splits", plan.spec().splits, flush=True)
for _ in range(4):
    plan(x, w)
torch.cuda.synchronize()
