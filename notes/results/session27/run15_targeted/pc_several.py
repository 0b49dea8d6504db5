"""Compile test_gpu_persistent_several_ctas's kernels only (session 27's targeted GPU run)."""
import sys
from pathlib import Path
sys.path.insert(0, "."); sys.path.insert(0, "tests"); sys.path.insert(0, "tools")
import igemm._build as b
b.csrc_dir = lambda: Path("csrc").resolve()
from igemm import _build
from igemm.conv2d import _stub
from precompile_tests import chains, shape
from test_conv import SEVERAL_CTAS_CASES, several_ctas_plans
specs = {}
for xs, ws, st, pd, dl, *rest in SEVERAL_CTAS_CASES:
    bn, stages = (rest or [128])[0], (rest[1:] or [0])[0]
    for dtype in ("float16", "bfloat16"):
        for layout in ("NCHW", "NHWC"):
            runs = [(ch, None) for ch in chains(ws[0])] + ([(chains(ws[0])[2], "float32")] if bn == 64 else [])
            for ch, rdt in runs:
                for p in several_ctas_plans(shape(xs, layout), shape(ws, layout), dtype, layout, st, pd, dl,
                                            epilogue=ch, device=None, bn=bn, stages=stages, residual_dtype=rdt).values():
                    s = p.spec()
                    specs[s.name() + str(s.epilogue)] = (s.name(), _stub(s))
print(len(specs), "kernels")
print(_build.compile_many(specs.values(), "sm_90a", None), "compiled")
