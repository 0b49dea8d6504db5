"""BatchNorm kernels against PyTorch in the same run, with the device-copy bandwidth floor.

    python3 benchmarks/bench_norm.py --out DIR [--quick] [--no-graph]

Rows: batch_norm_stats (PyTorch ``torch.batch_norm_stats``), the fused BN-ReLU / BN-Add-ReLU forward with
its 1-bit mask (PyTorch chain ``relu(batch_norm_elemt(x) [+ r])``, which writes no mask), and the
backward from the mask (``batch_norm_backward_reduce`` + ``batch_norm_backward_elemt``; PyTorch chain
``where(y > 0, dy, 0)`` → ``batch_norm_backward_reduce`` → ``batch_norm_backward_elemt``, which needs y).

Timing: inputs rotate through more than twice the L2, so every call reads device memory. ``us`` is device
time per call: the calls are captured in a CUDA graph (for both peers) and the graph replayed, so host
launch overhead does not count; ``eager_us`` is the harness's per-call CUDA-event time (host-bound when the
Python call takes longer than the kernel) and ``host_us`` igemm's Python time per call. GB/s counts the
bytes a kernel must move (inputs read once, outputs written once); ``%copy`` is against the measured
device-to-device copy bandwidth (read + write).
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _harness import Bench, copy_bandwidth, n_rotations, parser  # noqa: E402

EPS = 1e-5


def _nchw(t, layout):
    return t if layout == "NCHW" else t.permute(0, 3, 1, 2)


def _shape(shape, layout):
    N, C, H, W = shape
    return shape if layout == "NCHW" else (N, H, W, C)


class Timer:
    def __init__(self, bench, use_graph: bool):
        self.bench, self.use_graph = bench, use_graph
        self.notes = set()

    def device(self, fn, n_inputs: int) -> float:
        """Seconds per call of fn(i): CUDA-graph replay of many calls (falls back to events per call)."""
        import torch
        if not self.use_graph:
            return self.bench.time(fn, n_inputs)
        calls = max(2 * n_inputs, 16)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(s):
                for i in range(n_inputs):
                    fn(i)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                for k in range(calls):
                    fn(k % n_inputs)
        except Exception as e:  # pragma: no cover - reported in the notes
            torch.cuda.synchronize()
            self.notes.add(f"graph capture failed ({type(e).__name__}: {e}); event timing used instead")
            return self.bench.time(fn, n_inputs)
        reps = max(5, self.bench.args.reps // 5)
        return self.bench.time(lambda i: g.replay(), 1, reps=reps, warmup=2) / calls

    def eager(self, fn, n_inputs: int) -> float:
        return self.bench.time(fn, n_inputs)

    @staticmethod
    def host(fn, n_inputs: int, calls: int = 200) -> float:
        import torch
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k in range(calls):
            fn(k % n_inputs)
        t = (time.perf_counter() - t0) / calls
        torch.cuda.synchronize()
        return t


def _cases(quick: bool):
    stats = [((16, 32, 112, 112), "float32", "NCHW", 15.0), ((16, 32, 112, 112), "float32", "NHWC", "torch"),
             ((64, 256, 56, 56), "float16", "NCHW", 35.0), ((64, 256, 56, 56), "float16", "NHWC", "torch")]
    if not quick:
        stats += [((16, 32, 112, 112), "float16", "NCHW", None), ((64, 256, 56, 56), "float32", "NCHW", None),
                  ((64, 2048, 7, 7), "float16", "NCHW", None), ((64, 2048, 7, 7), "float16", "NHWC", None),
                  ((256, 64, 1, 1), "float32", "NCHW", None)]
    # (shape, dtype, barred): the BN-ReLU bar shapes with the dtypes its statistics bars pair them with
    # ((16,32,112,112) fp32, (64,256,56,56) fp16); the other dtype of each shape is reported, not barred
    ew = [((16, 32, 112, 112), "float32", True), ((16, 32, 112, 112), "float16", False),
          ((64, 256, 56, 56), "float16", True), ((64, 256, 56, 56), "float32", False)]
    return stats, (ew[:3] if quick else ew)


def _precompile(stats_cases, ew_cases) -> None:
    """Compile every instance the run launches, in parallel, before timing anything."""
    from igemm import _runtime, norm
    arch = _runtime.device_arch(0)
    sms = int(_runtime.device_props(0).multiprocessor_count)
    stubs = [norm.stub_gather("float32", "float32")]
    for (N, C, H, W), dtype, layout, _ in stats_cases:
        stubs += norm.instances_for(layout, N, C, H * W, dtype, sms=sms, grad=False, forward=(), backward=())
    for (N, C, H, W), dtype, _ in ew_cases:
        for layout in ("NCHW", "NHWC"):
            stubs += norm.instances_for(layout, N, C, H * W, dtype, sms=sms, forward=((2, False), (2, True)))
    t0 = time.time()
    norm.compile_stubs(stubs, arch)
    print(f"{len(set(stubs))} kernel instances ready in {time.time() - t0:.0f} s", flush=True)


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--no-graph", action="store_true", help="time with events per call only")
    args = p.parse_args()
    import torch

    import igemm

    bench = Bench("bench_norm", args)
    tm = Timer(bench, not args.no_graph)
    stats_cases, ew_cases = _cases(args.quick)
    _precompile(stats_cases, ew_cases)
    copy_bw = copy_bandwidth(bench)
    bench.row(kernel="device copy (floor)", shape="1 GiB", dtype="", layout="", us=2 * (1 << 30) / copy_bw * 1e6,
              torch_us="", speedup="", GBps=copy_bw / 1e9, pct_copy=100.0, bar="", met="")

    def add(kernel, shape, dtype, layout, t_ig, t_th, nbytes, bar, met, eager=None, host=None, torch_eager=None,
            same_bw=None):
        bench.row(kernel=kernel, shape="x".join(map(str, shape)), dtype=dtype, layout=layout, us=t_ig * 1e6,
                  torch_us=t_th * 1e6 if t_th else "", speedup=(t_th / t_ig) if t_th else "",
                  GBps=nbytes / t_ig / 1e9, pct_copy=100.0 * nbytes / t_ig / copy_bw,
                  pct_same_size_copy=100.0 * nbytes / t_ig / same_bw if same_bw else "", bar=bar,
                  met=("yes" if met else "NO") if met is not None else "",
                  eager_us=eager * 1e6 if eager else "", torch_eager_us=torch_eager * 1e6 if torch_eager else "",
                  host_us=host * 1e6 if host else "")

    _stats_rows(torch, igemm, tm, add, stats_cases)
    _elementwise_rows(torch, igemm, tm, add, ew_cases, copy_bw)
    _gather_row(torch, igemm, tm, add)

    bench.note("us: device time per call from CUDA-graph replay (both peers); eager_us: CUDA events around each "
               "eager call (includes host time when the call is host-bound); host_us: igemm's Python time per call.")
    bench.note("GB/s: bytes the kernel must move (reads once + writes once, mask = numel/8 bytes); %copy: of the "
               "measured device-to-device copy bandwidth (read + write).")
    bench.note("bar column: the issue's bars; in parentheses: reported, not barred (the other dtype of each bar "
               "shape, and the two passes of the backward); %same-size copy: of torch's copy of this row's "
               "tensor size, rotated like the inputs.")
    bench.note("PyTorch's BN-ReLU chain writes no 1-bit mask (its backward needs y); its bytes are not the row's bytes.")
    bench.note("backward rows: the mask's ReLU gradient is fused (a select) into both passes; PyTorch's chain first "
               "materialises where(y > 0, dy, 0).")
    for n in sorted(tm.notes):
        bench.note(n)
    bench.finish()
    return 0


def _stats_rows(torch, igemm, tm, add, cases) -> None:
    """batch_norm_stats against torch.batch_norm_stats."""
    dev = "cuda"
    for shape, dtype, layout, bar in cases:
        tdt = getattr(torch, dtype)
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.finfo(tdt).bits // 8
        nset = n_rotations(nbytes)
        xs = [torch.randn(_shape(shape, layout), device=dev, dtype=tdt) * 2 + 1 for _ in range(nset)]
        t_ig = tm.device(lambda i: igemm.batch_norm_stats(xs[i], EPS, layout), nset)
        t_th = tm.device(lambda i: torch.batch_norm_stats(_nchw(xs[i], layout), EPS), nset)
        ev_ig = tm.eager(lambda i: igemm.batch_norm_stats(xs[i], EPS, layout), nset)
        ev_th = tm.eager(lambda i: torch.batch_norm_stats(_nchw(xs[i], layout), EPS), nset)
        host_ig = tm.host(lambda i: igemm.batch_norm_stats(xs[i], EPS, layout), nset)
        if bar == "torch":
            bar_s, met = "<= torch", t_ig <= t_th
        elif bar is not None:
            bar_s, met = f"<= {bar:g} us", t_ig * 1e6 <= bar
        else:
            bar_s, met = "", None
        add("batch_norm_stats", shape, dtype, layout, t_ig, t_th, nbytes, bar_s, met, ev_ig, host_ig, ev_th)


def _elementwise_rows(torch, igemm, tm, add, cases, copy_bw: float) -> None:
    """BN-ReLU forward with mask (and + residual), the two backward passes and the whole backward."""
    dev = "cuda"
    for shape, dtype, barred in cases:
        for layout in ("NCHW", "NHWC"):
            tdt = getattr(torch, dtype)
            C = shape[1]
            numel = 1
            for s in shape:
                numel *= s
            isz = torch.finfo(tdt).bits // 8
            tb = numel * isz
            mb = (numel + 31) // 32 * 4
            nset = n_rotations(3 * tb)
            g = torch.rand(C, device=dev) + 0.5
            b = torch.rand(C, device=dev) - 0.5
            xs = [torch.randn(_shape(shape, layout), device=dev, dtype=tdt) for _ in range(nset)]
            rs = [torch.randn_like(xs[0]) for _ in range(nset)]
            dys = [torch.randn_like(xs[0]) for _ in range(nset)]
            # the copy bandwidth at this size (x -> a fresh tensor, rotated like the kernels' inputs): what a
            # kernel moving these bytes can reach once its launch and tail are counted
            outs = [torch.empty_like(xs[0]) for _ in range(nset)]
            same_bw = 2 * tb / tm.device(lambda i: torch.mul(xs[i], 1, out=outs[i]), nset)
            del outs

            def bar_of(text):
                return (text, True) if barred else (f"({text})", False)
            stats = [igemm.batch_norm_stats(x, EPS, layout) for x in xs]
            fwd = [igemm.batch_norm_relu(xs[i], *stats[i], g, b, layout=layout) for i in range(nset)]
            ys = [f[0] for f in fwd]
            masks = [f[1] for f in fwd]
            count = numel // C
            cnt_t = torch.tensor([count], dtype=torch.int32, device=dev)
            for add_res in (False, True):
                name = "bn_add_relu fwd+mask" if add_res else "bn_relu fwd+mask"

                def f_ig(i, add_res=add_res):
                    return igemm.batch_norm_relu(xs[i], stats[i][0], stats[i][1], g, b, rs[i] if add_res else None,
                                                 layout=layout)

                def f_th(i, add_res=add_res):
                    y = torch.batch_norm_elemt(_nchw(xs[i], layout), g, b, stats[i][0], stats[i][1], EPS)
                    if add_res:
                        y = y + _nchw(rs[i], layout)
                    return torch.relu(y)

                nbytes = tb * (3 if add_res else 2) + mb
                t_ig, t_th = tm.device(f_ig, nset), tm.device(f_th, nset)
                bar_s, on = bar_of(">= 80% copy, < torch")
                add(name, shape, dtype, layout, t_ig, t_th, nbytes, bar_s,
                    (nbytes / t_ig >= 0.8 * copy_bw and t_ig < t_th) if on else None, tm.eager(f_ig, nset),
                    tm.host(f_ig, nset), tm.eager(f_th, nset), same_bw)

            def r_ig(i):
                return igemm.batch_norm_backward_reduce(dys[i], xs[i], stats[i][0], stats[i][1], g, mask=masks[i],
                                                        layout=layout)

            sums = [r_ig(i) for i in range(nset)]

            def e_ig(i):
                return igemm.batch_norm_backward_elemt(dys[i], xs[i], stats[i][0], stats[i][1], g, sums[i][0],
                                                       sums[i][1], count, mask=masks[i], layout=layout)

            def bwd_ig(i):
                s = r_ig(i)
                return igemm.batch_norm_backward_elemt(dys[i], xs[i], stats[i][0], stats[i][1], g, s[0], s[1], count,
                                                       mask=masks[i], layout=layout)

            def bwd_th(i):
                d = torch.where(ys[i] > 0, dys[i], torch.zeros((), device=dev, dtype=tdt))
                dn, xn = _nchw(d, layout), _nchw(xs[i], layout)
                s = torch.batch_norm_backward_reduce(dn, xn, stats[i][0], stats[i][1], g, True, True, True)
                return torch.batch_norm_backward_elemt(dn, xn, stats[i][0], stats[i][1], g, s[0], s[1], cnt_t)

            def red_th(i):
                d = torch.where(ys[i] > 0, dys[i], torch.zeros((), device=dev, dtype=tdt))
                return torch.batch_norm_backward_reduce(_nchw(d, layout), _nchw(xs[i], layout), stats[i][0],
                                                        stats[i][1], g, True, True, True)

            n_red, n_el = 2 * tb + mb, 3 * tb + mb
            t_r, t_rt = tm.device(r_ig, nset), tm.device(red_th, nset)
            # the two passes are reported; the bar is on the backward they make together
            add("  backward_reduce (mask)", shape, dtype, layout, t_r, t_rt, n_red, "(part)", None,
                tm.eager(r_ig, nset), tm.host(r_ig, nset), tm.eager(red_th, nset), same_bw)
            t_e = tm.device(e_ig, nset)
            add("  backward_elemt (mask)", shape, dtype, layout, t_e, None, n_el, "(part)", None,
                tm.eager(e_ig, nset), tm.host(e_ig, nset), None, same_bw)
            t_b, t_bt = tm.device(bwd_ig, nset), tm.device(bwd_th, nset)
            bar_s, on = bar_of(">= 80% copy, < torch")
            add("bn_relu backward (reduce+elemt)", shape, dtype, layout, t_b, t_bt, n_red + n_el, bar_s,
                ((n_red + n_el) / t_b >= 0.8 * copy_bw and t_b < t_bt) if on else None, tm.eager(bwd_ig, nset),
                tm.host(bwd_ig, nset), tm.eager(bwd_th, nset), same_bw)


def _gather_row(torch, igemm, tm, add) -> None:
    """the merge of per-rank partials (SyncBN) against torch.batch_norm_gather_stats_with_counts."""
    dev = "cuda"
    W, C = 8, 2048
    means = torch.randn(W, C, device=dev)
    vars_ = torch.rand(W, C, device=dev) + 0.5
    counts = torch.full((W,), 1000.0, device=dev)
    t_ig = tm.device(lambda i: igemm.batch_norm_gather_stats(means, vars_, counts), 1)
    inv = 1 / torch.sqrt(vars_ + EPS)
    xd = torch.empty(1, C, device=dev)
    t_th = tm.device(lambda i: torch.batch_norm_gather_stats_with_counts(xd, means, inv, None, None, 0.1, EPS,
                                                                          counts), 1)
    add("batch_norm_gather_stats", (W, C), "float32", "", t_ig, t_th, 3 * W * C * 4 + 3 * C * 4, "", None)


if __name__ == "__main__":
    sys.exit(main())
