"""Max pooling (igemm.nn.MaxPool2d's kernels) and global average pooling (igemm.nn.AdaptiveAvgPool2d's) against
PyTorch's, in the same run.

    python benchmarks/bench_pool.py --out DIR [--quick] [--batches 32,128,256]

ResNet's max pool (3x3, stride 2, padding 1) after conv1: x (N, 64, 112, 112) channels_last, fp16 (and bf16 and
fp32 at the first batch). Forward: igemm keeping its one-byte window taps (the training forward) against
``torch.ops.aten.max_pool2d_with_indices`` (int64 indices); inference: igemm without them against
``F.max_pool2d``. Backward: igemm's gather against ``aten.max_pool2d_with_indices_backward``. Inputs rotate past L2;
igemm's y and dx are checked against PyTorch's (torch.equal) before timing. GB/s count each side's own bytes; % copy
is igemm's against the copy bandwidth measured in the same run.

Global average pooling (a second table): ResNet-50's head, x (N, 2048, 7, 7) channels_last at N = 1 and the batches,
fp16 (and bf16 and fp32 at the first batch), against ``F.adaptive_avg_pool2d(x, 1)`` (PyTorch's mean); igemm's y is
checked against the float64 mean first.

The classifier head (a third table): ResNet-50's, x (N, 2048, 7, 7) channels_last -> (N, 1000), at N = 1 and 2 (the
images its kernel takes) in fp16 and bf16: igemm's one kernel (``igemm.nn.AvgPoolLinear``) against igemm's pool then
``F.linear`` (the module's path for more images) and PyTorch's ``adaptive_avg_pool2d`` -> flatten -> ``F.linear``;
the kernel's y is checked against float64 first.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402
from _harness import Bench  # noqa: E402


def main(argv=None):
    ap = _harness.parser(__doc__)
    ap.add_argument("--batches", default="32,128,256")
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from igemm import pool
    from igemm.nn import _pool
    bench = Bench("bench_pool", args)
    bw = _harness.copy_bandwidth(bench)
    bench.note(f"copy bandwidth {bw / 1e9:.0f} GB/s (read+write, torch mul of 1 GiB)")
    batches = [int(b) for b in args.batches.split(",")]
    cases = [(N, "float16") for N in batches] + [(batches[0], dt) for dt in ("bfloat16", "float32")]
    if args.quick:
        cases = cases[:1]
    k, s, p, d = (3, 3), (2, 2), (1, 1), (1, 1)
    aten = torch.ops.aten
    for N, dtype in cases:
        tdt = getattr(torch, dtype)
        C, H = 64, 112
        OH = pool.out_size(H, 3, 2, 1, 1, False)
        geom = (N, C, H, H, OH, OH, k, s, p, d)
        size = torch.empty((), dtype=tdt).element_size()
        nx, ny = N * C * H * H, N * C * OH * OH

        def make(i):
            x = torch.randn((N, C, H, H), device="cuda", dtype=tdt).contiguous(memory_format=torch.channels_last)
            dy = torch.randn((N, C, OH, OH), device="cuda", dtype=tdt).contiguous(memory_format=torch.channels_last)
            return x, dy
        sets = _harness.rotating(make, (nx + ny) * size, cap=8)
        x0, dy0 = sets[0]
        y_t, ind_t = aten.max_pool2d_with_indices(x0, [3, 3], [2, 2], [1, 1], [1, 1], False)
        y_i, idx = _pool._forward(x0, geom, dtype, True)
        assert torch.equal(y_i, y_t), "igemm's y differs from PyTorch's"
        dx_t = aten.max_pool2d_with_indices_backward(dy0, x0, [3, 3], [2, 2], [1, 1], [1, 1], False, ind_t)
        dx_i = torch.empty_like(x0)
        pool.launch_backward(0, torch.cuda.current_stream().cuda_stream, dtype, geom, dy0.data_ptr(), idx.data_ptr(),
                             dx_i.data_ptr())
        assert torch.equal(dx_i, dx_t), "igemm's dx differs from PyTorch's"
        inds = [aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1], [1, 1], False)[1] for x, _ in sets]
        idxs = [_pool._forward(x, geom, dtype, True)[1] for x, _ in sets]
        t_fwd = bench.time(lambda i: _pool._forward(sets[i][0], geom, dtype, True), len(sets))
        t_fwd_t = bench.time(lambda i: aten.max_pool2d_with_indices(sets[i][0], [3, 3], [2, 2], [1, 1], [1, 1], False),
                             len(sets))
        t_inf = bench.time(lambda i: _pool._forward(sets[i][0], geom, dtype, False), len(sets))
        t_inf_t = bench.time(lambda i: F.max_pool2d(sets[i][0], 3, 2, 1), len(sets))
        # (the stream read at each call: the timer captures the calls on its own stream)
        t_bwd = bench.time(lambda i: pool.launch_backward(0, torch.cuda.current_stream().cuda_stream, dtype, geom,
                                                          sets[i][1].data_ptr(), idxs[i].data_ptr(), dx_i.data_ptr()),
                           len(sets))
        t_bwd_t = bench.time(lambda i: aten.max_pool2d_with_indices_backward(
            sets[i][1], sets[i][0], [3, 3], [2, 2], [1, 1], [1, 1], False, inds[i]), len(sets))
        b_fwd, b_bwd = (nx + ny) * size + ny, (nx + ny) * size + ny
        bench.row(x=f"{N}x{C}x{H}x{H}", dtype=dtype,
                  train_fwd_us=t_fwd * 1e6, torch_fwd_us=t_fwd_t * 1e6, fwd_ratio=t_fwd / t_fwd_t,
                  fwd_pct_copy=100 * b_fwd / t_fwd / bw,
                  infer_us=t_inf * 1e6, torch_infer_us=t_inf_t * 1e6, infer_ratio=t_inf / t_inf_t,
                  bwd_us=t_bwd * 1e6, torch_bwd_us=t_bwd_t * 1e6, bwd_ratio=t_bwd / t_bwd_t,
                  bwd_pct_copy=100 * b_bwd / t_bwd / bw,
                  fwd_GBps=b_fwd / t_fwd / 1e9, torch_fwd_GBps=((nx + ny) * size + 8 * ny) / t_fwd_t / 1e9)
        sets = inds = idxs = None
        torch.cuda.empty_cache()
    avg = Bench("bench_avgpool", args)
    acases = [(N, "float16") for N in dict.fromkeys([1] + batches)] + [(batches[0], dt) for dt in ("bfloat16",
                                                                                                  "float32")]
    for N, dtype in acases[:1] if args.quick else acases:
        tdt = getattr(torch, dtype)
        C, H = 2048, 7
        nbytes = N * C * (H * H + 1) * torch.empty((), dtype=tdt).element_size()
        sets = _harness.rotating(lambda i: torch.randn((N, C, H, H), device="cuda", dtype=tdt).contiguous(
            memory_format=torch.channels_last), nbytes)
        x0 = sets[0]
        ref = x0.double().mean((2, 3), keepdim=True)
        err = float(((_pool._avg_forward(x0, dtype).double() - ref).abs().max() / ref.abs().max()))
        assert err < (1e-5 if dtype == "float32" else 1e-2), f"igemm's mean: relative error {err}"
        t_i = avg.time(lambda i: _pool._avg_forward(sets[i], dtype), len(sets))
        t_t = avg.time(lambda i: F.adaptive_avg_pool2d(sets[i], 1), len(sets))
        avg.row(x=f"{N}x{C}x{H}x{H}", dtype=dtype, igemm_us=t_i * 1e6, torch_us=t_t * 1e6, ratio=t_i / t_t,
                pct_copy=100 * nbytes / t_i / bw, rel_err=err)
        sets = None
        torch.cuda.empty_cache()
    avg.note("igemm: the global average pool's kernel into a new (N, C, 1, 1) channels-last tensor; torch: "
             "F.adaptive_avg_pool2d(x, 1); % copy: x and y over the copy bandwidth; rel_err: max |y - mean| / max |mean| "
             "against float64")
    avg.finish()
    head = Bench("bench_head", args)
    hcases = [(N, dt) for dt in ("float16", "bfloat16") for N in (1, 2)]
    for N, dtype in hcases[:1] if args.quick else hcases:
        tdt = getattr(torch, dtype)
        C, H, O = 2048, 7, 1000
        lin = torch.nn.Linear(C, O).to("cuda", tdt).requires_grad_(False)
        m = _pool.AvgPoolLinear.from_torch(lin)
        sets = _harness.rotating(lambda i: torch.randn((N, C, H, H), device="cuda", dtype=tdt).contiguous(
            memory_format=torch.channels_last), N * C * H * H * lin.weight.element_size())
        x0 = sets[0]
        assert m._dtype(x0) == dtype, "the head's kernel does not run"
        ref = x0.double().mean((2, 3)).to(tdt).double() @ lin.weight.double().T + lin.bias.double()
        with torch.no_grad():
            err = float((m(x0).double() - ref).abs().max() / ref.abs().max())
        assert err < 1e-2, f"igemm's head: relative error {err}"
        with torch.no_grad():
            t_k = head.time(lambda i: m(sets[i]), len(sets))
            t_p = head.time(lambda i: F.linear(torch.flatten(_pool._avg_forward(sets[i], dtype), 1), lin.weight,
                                               lin.bias), len(sets))
            t_t = head.time(lambda i: F.linear(torch.flatten(F.adaptive_avg_pool2d(sets[i], 1), 1), lin.weight,
                                               lin.bias), len(sets))
        head.row(x=f"{N}x{C}x{H}x{H}", out=O, dtype=dtype, head_us=t_k * 1e6, pool_linear_us=t_p * 1e6,
                 torch_us=t_t * 1e6, vs_pool_linear=t_k / t_p, vs_torch=t_k / t_t, rel_err=err)
        sets = None
        torch.cuda.empty_cache()
    head.note("head: igemm.nn.AvgPoolLinear's one kernel; pool_linear: igemm's global average pool then F.linear "
              "(cuBLAS); torch: F.adaptive_avg_pool2d -> flatten -> F.linear; rel_err: max |y - ref| / max |ref| "
              "against float64 (the pool's mean rounded to the dtype)")
    head.finish()
    bench.note("train_fwd: y and the one-byte window taps (igemm) / y and int64 indices (torch "
               "max_pool2d_with_indices); infer: y only (F.max_pool2d); bwd: dx from dy and those indices. "
               "ratio: igemm / torch. % copy: igemm's bytes (x, y, taps; dy, taps, dx) over the copy bandwidth")
    bench.finish()


if __name__ == "__main__":
    main()
