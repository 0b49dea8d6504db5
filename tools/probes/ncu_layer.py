"""Precompile the kernels tools/probes/ncu_layer.sh will profile (dev machine, no GPU):

    python tools/probes/ncu_layer.py IDX N 'cfg-json' ...   [--arch sm_90a]
"""
import json
import sys

from igemm import _build
from igemm._heuristics import ConvProblem, choose_config
from igemm.conv2d import _override, _stub
from igemm.layers import RESNET50

args = [a for a in sys.argv[1:] if not a.startswith("--arch")]
arch = "sm_90a"
idx, n, cfgs = int(args[0]), int(args[1]), args[2:]
name, C, K, H, R, st, pd = RESNET50[idx]
pb = ConvProblem(n, C, H, H, K, R, R, (st, st), (pd, pd), (1, 1), "float16", "NHWC", "tensorop", (), None)
base = choose_config(pb, arch)
specs = {base}
for c in cfgs:
    if c and c != "cudnn":
        specs.add(_override(base, pb, json.loads(c)))
for s in specs:
    print(s.name(), "splits", s.splits)
print(_build.compile_many(((s.name(), _stub(s)) for s in specs), arch, None), "kernels")
