"""index_add: the five cases of the seed article (fp32, dim 0), igemm vs torch ``index_add_`` in the same run.

    python benchmarks/bench_index_add.py --out DIR [--quick] [--no-graph]

Per case: igemm median time per call (``bench.time``: replays of a CUDA graph of one input rotation; CUDA
events around each call where capture is impossible, as for ``check_index=True``, which synchronises), with
``check_index=False`` (the kernel: what PyTorch's asynchronous device assert costs it) and with the default
``check_index=True`` (an extra kernel and a stream synchronisation); ``deterministic=True``; torch's
``index_add_``; the ratio; the device time per call of both from a CUDA graph of 20 back-to-back calls;
the launch floor (an empty kernel, timed the same way); GB/s (source read + touched rows of x read and written +
index) and % of the measured copy bandwidth; the host time of one igemm call; and the bar of the issue.
Indices are distinct (``randperm``); index/source sets rotate past L2 (x is 128 MB in every case).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402
from _harness import Bench  # noqa: E402

M = 1024 * 1024
K = 1024
# name, x shape, source shape, PyTorch on an H200 (issue), bar: ("abs", us) or ("ratio", x torch)
CASES = [
    ("x(32M) src(15)", (32 * M,), (15,), 7.5, ("ratio", 0.6)),
    ("x(32K,1024) src(15,1024)", (32 * K, 1024), (15, 1024), 14.2, ("ratio", 0.6)),
    ("x(32,1024,1024) src(15,1024,1024)", (32, 1024, 1024), (15, 1024, 1024), 77.8, ("abs", 50.0)),
    ("x(32M) src(1024)", (32 * M,), (1024,), 5.0, ("ratio", 0.6)),
    ("x(32K,1024) src(1024,1024)", (32 * K, 1024), (1024, 1024), 12.8, ("abs", 6.0)),
]
GRAPH_CALLS = 20


def graph_time(bench, torch, fn, n_inputs: int) -> float | None:
    """Device seconds per call: GRAPH_CALLS calls captured in one CUDA graph, replays timed."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(3):
                fn(i % n_inputs)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(GRAPH_CALLS):
                fn(i % n_inputs)
        torch.cuda.synchronize()
        t = bench.time(lambda i: g.replay(), reps=max(5, bench.args.reps // 4), warmup=2)
        return t / GRAPH_CALLS
    except Exception as e:  # graph capture is a convenience, never a failure of the benchmark
        bench.note(f"graph timing failed: {type(e).__name__}: {e}"[:300])
        try:
            torch.cuda.synchronize()
        except Exception:
            pass
        return None


def host_time(torch, fn, n_inputs: int, calls: int = 200) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(calls):
        fn(i % n_inputs)
    t = (time.perf_counter() - t) / calls
    torch.cuda.synchronize()
    return t


def main(argv=None):
    ap = _harness.parser(__doc__)
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph device timings")
    args = ap.parse_args(argv)
    import torch

    import igemm
    ia = sys.modules["igemm.index_add"]
    bench = Bench("bench_index_add", args)
    bw = _harness.copy_bandwidth(bench)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bench.note(f"copy bandwidth {bw / 1e9:.0f} GB/s (read+write, torch copy_ of 1 GiB); {sms} SMs")
    use_graph = not args.no_graph
    for name, xs, ss, torch_h200, (bar_kind, bar_val) in CASES:
        x = torch.randn(xs, device="cuda")
        n = ss[0]
        src_bytes = 4 * int(torch.tensor(ss).prod())
        set_bytes = 2 * src_bytes + 8 * n

        def make(i):
            return torch.randperm(xs[0], device="cuda")[:n].contiguous(), torch.randn(ss, device="cuda")
        sets = _harness.rotating(make, set_bytes, cap=32)
        inner = src_bytes // 4 // n
        cfg = ia.choose_config(1, xs[0], inner, n, "float32", sms=sms)
        det_cfg = ia.choose_config(1, xs[0], inner, n, "float32", sms=sms, deterministic=True)

        def ig(i):
            igemm.index_add(x, 0, sets[i][0], sets[i][1], check_index=False)

        def ig_checked(i):
            igemm.index_add(x, 0, sets[i][0], sets[i][1])

        def ig_det(i):
            igemm.index_add(x, 0, sets[i][0], sets[i][1], deterministic=True, check_index=False)

        def th(i):
            x.index_add_(0, sets[i][0], sets[i][1])

        # correctness spot check before timing
        x0 = x.clone()
        ig(0)
        ref = x0.index_add_(0, sets[0][0], sets[0][1])
        err = float((x - ref).abs().max())
        del x0, ref
        t_ig = bench.time(ig, len(sets))
        method = bench.last.get("method")
        t_chk = bench.time(ig_checked, len(sets))
        t_det = bench.time(ig_det, len(sets))
        t_th = bench.time(th, len(sets))
        h_ig = host_time(torch, ig, len(sets))
        moved = 2 * src_bytes + 8 * n + src_bytes   # source read, touched rows of x read + written, index
        bar_us = bar_val if bar_kind == "abs" else bar_val * t_th * 1e6
        row = dict(case=name, kernel=f"{cfg.kernel}/v{cfg.vec}", igemm_us=t_ig * 1e6, checked_us=t_chk * 1e6,
                   det_us=t_det * 1e6, det_kernel=det_cfg.kernel, torch_us=t_th * 1e6, ratio=t_ig / t_th,
                   host_us=h_ig * 1e6, GBps=moved / t_ig / 1e9, pct_copy=100 * moved / t_ig / bw,
                   bar_us=bar_us, bar_met=t_ig * 1e6 <= bar_us, torch_h200_issue_us=torch_h200, max_abs_err=err,
                   method=method)
        if use_graph:
            g_th = graph_time(bench, torch, th, len(sets))
            g_ig = graph_time(bench, torch, ig, len(sets)) if g_th else None
            use_graph = bool(g_ig and g_th)   # a failed capture: no more graphs in this run
            if use_graph:
                gbar = bar_val if bar_kind == "abs" else bar_val * g_th * 1e6
                row.update(dev_igemm_us=g_ig * 1e6, dev_torch_us=g_th * 1e6, dev_ratio=g_ig / g_th,
                           dev_bar_met=g_ig * 1e6 <= gbar)
        bench.row(**row)
        sets = x = None  # free before the next case
        torch.cuda.empty_cache()
    # the launch floor: an empty kernel timed the same way
    floor = bench.time(_harness.empty_kernel(0), 1)
    bench.note(f"launch floor: an empty kernel takes {floor * 1e6:.2f} us timed the same way "
               f"({bench.last.get('method')}); a bar below it cannot be met by any kernel")
    bench.note("igemm_us/torch_us: per call, from CUDA-graph replays of one input rotation (bench.time; `method` "
               "says graph, or events if capture failed), check_index=False; checked_us: the default "
               "check_index=True; det_us: deterministic=True; dev_*: per call from a CUDA graph of 20 calls; "
               "bar: <= 50 us (case 3), <= 6 us (case 5), <= 0.6x torch (others)")
    bench.finish()


if __name__ == "__main__":
    main()
