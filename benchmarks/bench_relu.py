"""ReLU's 1-bit mask kernels: igemm vs PyTorch in the same run.

    python benchmarks/bench_relu.py --out DIR [--quick]

* ``relu_backward(dy, mask)`` (reads dy and 1 bit per element, writes dx) against
  ``torch.ops.aten.threshold_backward(dy, y, 0)`` (what autograd runs for ReLU: reads dy and y, writes dx)
  and ``torch.where(y > 0, dy, 0)``;
* ``relu_mask(y)`` (reads y, writes 1 bit per element) against ``y > 0`` (PyTorch's byte mask, 8 bits per
  element) and ``torch.gt(y, 0, out=bool)`` into a preallocated mask.

Cases: the activations of a ResNet-50 at N = 32 (64x112^2, 256x56^2, 512x28^2, 1024x14^2, 2048x7^2) in
fp16, bf16 and fp32, and an odd size (a mask whose last word is partial). GB/s count each side's own
bytes (mask bits as n/8 bytes, byte masks as n); ``ratio`` is igemm's time over the first peer's. Inputs
rotate past L2; results are checked bit for bit against the peer before timing.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402
from _harness import Bench  # noqa: E402

RESNET50 = [(32, 64, 112, 112), (32, 256, 56, 56), (32, 512, 28, 28), (32, 1024, 14, 14), (32, 2048, 7, 7)]
ODD = (3, 37, 61, 59)          # 401,487 elements: not a multiple of 32
DTYPES = ("float16", "bfloat16", "float32")


def cases(quick: bool):
    out = [(shape, dtype) for dtype in DTYPES for shape in RESNET50 + [ODD]]
    if quick:
        out = [(RESNET50[0], d) for d in DTYPES] + [(RESNET50[2], "float16"), (ODD, "float32")]
    return out


def packed_bits(torch, y):
    """The mask of ``y > 0`` packed on the device with torch ops (int64 words, for the check only)."""
    bits = (y.reshape(-1) > 0).to(torch.int64)
    pad = (-bits.numel()) % 32
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    return (bits.view(-1, 32) << torch.arange(32, device=y.device, dtype=torch.int64)).sum(1)


def check(torch, igemm, y, dy, mask):
    """igemm's mask and dx equal PyTorch's, bit for bit."""
    want = packed_bits(torch, y)
    got = mask.to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(got, want), "relu_mask differs from y > 0"
    dx = igemm.relu_backward(dy, mask)
    ref = torch.ops.aten.threshold_backward(dy, y, 0.0)
    assert torch.equal(dx, ref), "relu_backward differs from threshold_backward"


def main(argv=None):
    ap = _harness.parser(__doc__)
    args = ap.parse_args(argv)
    import torch

    import igemm
    bench = Bench("bench_relu", args)
    bw = _harness.copy_bandwidth(bench)
    bench.note(f"copy bandwidth {bw / 1e9:.0f} GB/s (read+write, torch mul of 1 GiB)")
    for shape, dtype in cases(args.quick):
        tdt = getattr(torch, dtype)
        n = 1
        for s in shape:
            n *= s
        size = torch.empty((), dtype=tdt).element_size()

        def make(i):
            y = torch.randn(shape, device="cuda", dtype=tdt)
            dy = torch.randn(shape, device="cuda", dtype=tdt)
            return y, dy, igemm.relu_mask(y)
        sets = _harness.rotating(make, 3 * n * size, cap=16)
        check(torch, igemm, *sets[0])
        dx = torch.empty(shape, device="cuda", dtype=tdt)
        mask_out = torch.empty_like(sets[0][2])
        byte_mask = torch.empty(shape, device="cuda", dtype=torch.bool)
        zero = torch.zeros((), device="cuda", dtype=tdt)
        t_bwd = bench.time(lambda i: igemm.relu_backward(sets[i][1], sets[i][2], out=dx), len(sets))
        t_thr = bench.time(lambda i: torch.ops.aten.threshold_backward(sets[i][1], sets[i][0], 0.0), len(sets))
        t_where = bench.time(lambda i: torch.where(sets[i][0] > 0, sets[i][1], zero), len(sets))
        t_mask = bench.time(lambda i: igemm.relu_mask(sets[i][0], out=mask_out), len(sets))
        t_gt = bench.time(lambda i: sets[i][0] > 0, len(sets))
        t_gt_out = bench.time(lambda i: torch.gt(sets[i][0], 0, out=byte_mask), len(sets))
        mbytes = -(-n // 32) * 4           # the 1-bit mask, whole 32-bit words
        bench.row(shape="x".join(map(str, shape)), dtype=dtype,
                  bwd_us=t_bwd * 1e6, threshold_backward_us=t_thr * 1e6, where_us=t_where * 1e6,
                  bwd_ratio=t_bwd / t_thr, bwd_GBps=(2 * n * size + mbytes) / t_bwd / 1e9,
                  threshold_backward_GBps=3 * n * size / t_thr / 1e9,
                  bwd_pct_copy=100 * (2 * n * size + mbytes) / t_bwd / bw,
                  mask_us=t_mask * 1e6, gt_us=t_gt * 1e6, gt_out_us=t_gt_out * 1e6, mask_ratio=t_mask / t_gt,
                  mask_GBps=(n * size + mbytes) / t_mask / 1e9, gt_GBps=(n * size + n) / t_gt / 1e9,
                  mask_pct_copy=100 * (n * size + mbytes) / t_mask / bw)
        sets = None  # free before the next case
        torch.cuda.empty_cache()
    bench.note("bwd: igemm.relu_backward(dy, mask, out=dx) vs aten.threshold_backward(dy, y, 0) (autograd's ReLU "
               "backward) and torch.where(y > 0, dy, 0); mask: igemm.relu_mask(y, out=m) (1 bit per element) vs "
               "y > 0 and torch.gt(y, 0, out=bool) (1 byte per element). ratio: igemm / first peer")
    bench.finish()


if __name__ == "__main__":
    main()
