"""Whole networks through igemm.nn.convert against cuDNN's fused calls and PyTorch, fp16 channels_last inference.

    python benchmarks/bench_nn.py [--models resnet50,...] [--batches 1,32,128] [--compile] [--out DIR]

torchvision models with random weights and BN running statistics from one train-mode forward (no network
needed). Peers, timed in the same run, each one CUDA graph of a forward replayed (benchmarks/_harness.py):
  - igemm: ``igemm.nn.convert(model)``; also its eager time (no graph, CUDA events around each forward);
  - cuDNN fused: ``igemm.baselines.cudnn_fused`` -- the same rewrite with each pattern on
    ``torch.cudnn_convolution_relu`` / ``torch.cudnn_convolution_add_relu``, BN folded into w and b;
  - PyTorch: the model itself (eager modules, cuDNN convolutions, separate BN and ReLU kernels);
  - with --compile: ``torch.compile(model)`` (inductor, default mode), graph-captured like the others.
Errors: relative to the fp32 model on the same input, for igemm and for PyTorch fp16.
"""
from __future__ import annotations

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import Bench, geomean, parser  # noqa: E402


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet50,resnet18,resnet101,wide_resnet50_2,vgg16_bn")
    p.add_argument("--batches", default="32", help="batch sizes for resnet50 (the other models: 32)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile(model)")
    args = p.parse_args()
    import torch
    import torchvision

    import igemm.nn as inn
    from igemm.baselines.cudnn_fused import cudnn_fused
    bench = Bench("bench_nn", args)
    ratios = []
    for name in args.models.split(","):
        batches = [int(b) for b in args.batches.split(",")] if name == "resnet50" else [32]
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)().cuda()
        model.train()
        with torch.no_grad():
            model(torch.randn(16, 3, 224, 224, device="cuda"))
        model.eval()
        for N in batches:
            x32 = torch.randn(N, 3, 224, 224, device="cuda")
            with torch.no_grad():
                ref = model(x32).double()
                half = copy.deepcopy(model).half().to(memory_format=torch.channels_last)
                x = x32.half().contiguous(memory_format=torch.channels_last)
                ig, rep = inn.convert(half, return_report=True)
                inn.precompile(ig, x)                  # (its kernels in parallel, before the first forward)
                dnn = cudnn_fused(half)
                peers = {"igemm": ig, "cudnn_fused": dnn, "pytorch": half}
                if args.compile:
                    peers["compile"] = torch.compile(half)
                t = {k: bench.time(lambda i, m=m: m(x)) for k, m in peers.items()}
                t_eager = bench.time(lambda i: ig(x), graph=False)
                err = {k: float(((peers[k](x).double() - ref).norm() / ref.norm()).item()) for k in ("igemm", "pytorch")}
            r = t["igemm"] / t["cudnn_fused"]
            ratios.append(r)
            bench.row(model=name, N=N, igemm_ms=t["igemm"] * 1e3, cudnn_fused_ms=t["cudnn_fused"] * 1e3,
                      pytorch_ms=t["pytorch"] * 1e3, compile_ms=t["compile"] * 1e3 if "compile" in t else "",
                      igemm_over_cudnn=r, igemm_eager_over_graph=t_eager / t["igemm"],
                      igemm_err=err["igemm"], torch_fp16_err=err["pytorch"],
                      converted=len(rep["converted"]), left=len(rep["left"]))
            torch.cuda.empty_cache()
    bench.note("ms: one forward, median of CUDA-graph replays; igemm_eager_over_graph: igemm's forward without a "
               "graph (events around each) over its graph time; errors: relative L2 against the fp32 model.")
    bench.note(f"igemm/cudnn_fused geomean over the rows: {geomean(ratios):.3f}")
    bench.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
