"""``python -m igemm compare``: implicit GEMM vs explicit im2col+GEMM vs FFT vs direct vs cuDNN.

For every layer (the ResNet-50 convolutions plus a sweep over filter size, stride, batch and channels)
and every algorithm: median time, TFLOP/s, the extra device memory the algorithm allocates (measured),
and the max relative error against a float64 convolution. Writes a markdown table, JSON and a PNG
plot (time and memory per layer) under ``--out``. Without a GPU the same command runs the numpy
implementations on small sizes and says so. ``benchmarks/compare_algorithms.py`` runs the same code.

    python -m igemm compare --out compare-out                       # ResNet-50 (N=32) + sweep, fp16 NHWC
    python -m igemm compare --quick --layout NCHW --dtype float32   # fewer cases and repetitions
    python -m igemm compare --layers resnet50 --algorithms implicit,im2col,cudnn
    python -m igemm compare --list                                  # the layers a selection gives
    python -m igemm compare --precompile --arch sm_90a              # compile its kernels (no GPU needed)

How each number is taken (GPU):

* time: each call of an algorithm does all of its steps (im2col kernel + GEMM; pad, transforms,
  multiply-accumulate, inverse, crop; ...) and allocates its output. CUDA events around each call,
  L2 flushed before each, the host's enqueueing hidden behind a GPU sleep; median (p10/p90 in the JSON).
* extra memory: torch's caching allocator statistics: bytes the algorithm keeps after ``setup`` plus
  the peak above that during its first call, minus its output. nvmath-python allocates its workspaces
  and results through torch's allocator for torch operands (``MatmulOptions.allocator`` /
  ``FFTOptions.allocator`` default to ``torch.cuda.caching_allocator_alloc``), and torch allocates
  cuDNN's workspace there too. igemm's implicit GEMM allocates nothing through torch: its extra memory
  is its split-K workspace, which ``Conv2dPlan`` allocates outside torch and the report reads from the plan.
* error: ``max|y - ref| / max|ref|`` against a float64 convolution (torch, first images of the batch).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
import traceback

import numpy as np

from ._algorithms import ALGORITHMS, LABELS, NUMPY, NUMPY_LABELS, Problem, Unavailable
from ._layers import RESNET50, Layer, numpy_size, resnet50, select_layers, sweep  # noqa: F401
from ._report import markdown, plot, summary

__all__ = ["Layer", "RESNET50", "resnet50", "sweep", "select_layers", "run", "main", "add_cli"]



class _Progress:
    def __init__(self, total: int, enabled: bool = True):
        self.total, self.i, self.bar = total, 0, None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc="compare", unit="run", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                self.bar = None

    def step(self, what: str) -> None:
        self.i += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(what[:60], refresh=False)
            self.bar.update(1)
        else:
            print(f"[{self.i}/{self.total}] {what}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ===================================================================================== GPU runner
def _time(timer, alg, reps: int, warmup: int) -> dict:
    """``alg()`` timed with the L2 flushed before each call and the host's enqueueing hidden; about a second
    per case at most."""
    one = timer.time(lambda i: alg(), reps=1, warmup=warmup)["median"]
    return timer.time(lambda i: alg(), reps=int(max(3, min(reps, 1.0 / max(one, 1e-9)))), warmup=0)


def _alloc_stats(torch) -> tuple[int, int, int]:
    """(current, peak, rounding) bytes of torch's caching allocator: the bytes requested by callers where
    torch counts them (``requested_bytes``), else the allocated blocks (rounded up to 512 bytes)."""
    s = torch.cuda.memory_stats()
    if "requested_bytes.all.current" in s:
        return int(s["requested_bytes.all.current"]), int(s["requested_bytes.all.peak"]), 1
    return int(s.get("allocated_bytes.all.current", 0)), int(s.get("allocated_bytes.all.peak", 0)), 512


def gpu_environment() -> dict:
    import torch
    env = {"backend": "cuda", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "cuda": torch.version.cuda,
           "host": platform.node(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import nvmath
        env["nvmath-python"] = nvmath.__version__
    except Exception as e:
        env["nvmath-python"] = f"unavailable ({type(e).__name__})"
    try:
        import cuda.core
        env["cuda.core"] = cuda.core.__version__
    except Exception:
        pass
    try:
        from .. import __version__, _build
        env["igemm"] = __version__
        env["compiler"] = _build.find_toolchain().describe()
    except Exception:
        pass
    return env


def _gpu_reference(torch, x, w, pb: Problem, nb: int):
    F = torch.nn.functional
    xs = x[:nb]
    xr = (xs if pb.layout == "NCHW" else xs.permute(0, 3, 1, 2)).double()
    wr = (w if pb.layout == "NCHW" else w.permute(0, 3, 1, 2)).double()
    return F.conv2d(xr, wr, None, pb.stride, pb.padding, pb.dilation)        # NCHW float64


def _gpu_error(torch, y, ref, pb: Problem, nb: int) -> float:
    yr = y[:nb] if pb.layout == "NCHW" else y[:nb].permute(0, 3, 1, 2)
    yr = yr.double()
    if not bool(torch.isfinite(yr).all()):
        return float("inf")
    den = ref.abs().max().item()
    return (yr - ref).abs().max().item() / (den if den > 0 else 1.0)


def measure_gpu(torch, alg, x, w) -> tuple:
    """Set ``alg`` up and run it once; returns ``(y, extra_bytes)``: bytes kept by ``setup`` + the peak of
    the first call above that, minus the output (torch's allocator), + what it holds outside torch."""
    torch.cuda.synchronize()
    m0 = _alloc_stats(torch)[0]
    alg.setup(x, w)
    torch.cuda.synchronize()
    kept = _alloc_stats(torch)[0] - m0
    torch.cuda.reset_peak_memory_stats()
    m1 = _alloc_stats(torch)[0]
    y = alg()
    torch.cuda.synchronize()
    _, peak, rnd = _alloc_stats(torch)
    y_bytes = -(-y.untyped_storage().nbytes() // rnd) * rnd
    return y, max(0, kept) + max(0, peak - m1 - y_bytes) + alg.outside_bytes


def precompile(layers, dtype: str, layout: str, precision: str, algorithms, arch: str, jobs: int,
               sms: int = 132, verbose: bool = True) -> int:
    """Compile the igemm kernels (implicit GEMM, im2col, direct) the comparison of ``layers`` needs."""
    from . import _algorithms as A
    from .. import _build
    stubs = {}
    for layer in layers:
        pb = layer.problem(dtype, layout, precision)
        if "implicit" in algorithms:
            from ..conv import Conv2dPlan
            name, src = Conv2dPlan(pb.x_shape, pb.w_shape, dtype, layout, pb.stride, pb.padding,
                                   pb.dilation, precision=precision, device="numpy", arch=arch, sms=sms).kernel()
            stubs[name] = src
        if "im2col" in algorithms:
            vec = A.im2col_vec(pb)
            stubs[A.im2col_name(dtype, layout, vec)] = A.im2col_stub(dtype, layout, vec)
        if "direct" in algorithms:
            stubs[A.direct_name(dtype, layout)] = A.direct_stub(dtype, layout)
    t0 = time.time()
    _build.compile_many(stubs.items(), arch, max(1, jobs))
    if verbose:
        print(f"{len(stubs)} kernels for {arch} in {time.time() - t0:.0f} s into {_build.cache_dir()}",
              file=sys.stderr)
    return len(stubs)


def _row(layer: Layer, pb: Problem, algo: str, labels: dict = LABELS) -> dict:
    return {"layer": layer.name, "group": layer.group, "N": pb.N, "C": pb.C, "K": pb.K, "H": pb.H, "W": pb.W,
            "R": pb.R, "S": pb.S, "stride": pb.stride[0], "pad": pb.padding[0], "dtype": pb.dtype,
            "layout": pb.layout, "algorithm": algo, "label": labels[algo], "status": "ok", "note": "",
            "time_us": None, "p10_us": None, "p90_us": None, "tflops": None, "extra_bytes": None,
            "extra_mib": None, "max_rel_err": None, "reps": None, "flops": pb.flops}


def _run_gpu(layers, args, progress) -> tuple[list, list]:
    import torch

    from . import _algorithms as A
    from .. import _runtime
    dev = torch.cuda.current_device()
    flags = (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = args.precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = False
    rows, notes = [], []
    cap = int(args.mem_cap * 2 ** 30)
    try:
        if any(a in args.algorithms for a in ("implicit", "im2col", "direct")):
            try:
                t0 = time.time()
                n = precompile(layers, args.dtype, args.layout, args.precision, args.algorithms,
                               _runtime.device_arch(dev), args.jobs, _runtime.device_props(dev).multiprocessor_count,
                               verbose=False)
                print(f"{n} igemm kernels compiled or found in the cache in {time.time() - t0:.0f} s", file=sys.stderr)
            except Exception as e:   # plans compile on demand anyway
                print(f"warning: parallel precompile failed ({type(e).__name__}: {e}); compiling on demand",
                      file=sys.stderr)
        from .._timing import GpuTimer
        timer = GpuTimer(flush_l2=True, hide_host=True)
        gen = torch.Generator(device="cuda")
        gen.manual_seed(0)
        for layer in layers:
            pb = layer.problem(args.dtype, args.layout, args.precision)
            tdt = getattr(torch, pb.dtype)
            x = torch.randn(pb.x_shape, device="cuda", generator=gen).to(tdt)
            w = (torch.randn(pb.w_shape, device="cuda", generator=gen) / (pb.C * pb.R * pb.S) ** 0.5).to(tdt)
            nb = min(pb.N, 4)
            ref = _gpu_reference(torch, x, w, pb, nb)
            for algo in args.algorithms:
                row = _row(layer, pb, algo)
                alg = y = None
                try:
                    alg = A.make_gpu(algo, pb, dev)
                    est = alg.estimate_bytes()
                    if est > cap:
                        raise Unavailable(f"needs ~{est / 2 ** 30:.1f} GiB of workspace > --mem-cap "
                                          f"{args.mem_cap:g} GiB")
                    y, extra = measure_gpu(torch, alg, x, w)
                    row["max_rel_err"] = _gpu_error(torch, y, ref, pb, nb)
                    y = None
                    t = _time(timer, alg, args.reps, args.warmup)
                    row.update(time_us=t["median"] * 1e6, p10_us=t["p10"] * 1e6, p90_us=t["p90"] * 1e6,
                               reps=t["reps"], tflops=pb.flops / t["median"] / 1e12, extra_bytes=int(extra),
                               extra_mib=extra / 2 ** 20, note=alg.note)
                except (Unavailable, NotImplementedError) as e:
                    row.update(status="skipped", note=str(e))
                except torch.cuda.OutOfMemoryError as e:
                    row.update(status="skipped", note=f"out of memory ({str(e).splitlines()[0][:120]})")
                except Exception as e:
                    first = str(e).splitlines()[0][:200] if str(e) else ""
                    row.update(status="error", note=f"{type(e).__name__}: {first}")
                    print(f"\n{layer.name} / {algo}: error", file=sys.stderr)
                    traceback.print_exc()
                finally:
                    if alg is not None:
                        try:
                            alg.close()
                        except Exception:
                            pass
                    del alg, y
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                rows.append(row)
                progress.step(f"{layer.name} / {algo}")
            del x, w, ref
            torch.cuda.empty_cache()
    finally:
        (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
         torch.backends.cuda.matmul.allow_tf32) = flags
    prec = f"{args.dtype}{' (' + args.precision + ')' if args.dtype == 'float32' else ''}"
    notes += [
        f"GPU backend, {prec}, {args.layout}; inputs N(0,1), filters scaled by 1/sqrt(C·R·S).",
        "time: median of CUDA-event-timed calls (up to --reps, fewer for slow cases: ~1 s per case), L2 flushed "
        "before each call, host enqueueing hidden behind a GPU sleep; every algorithm's call includes all its "
        "steps and allocating its output. TFLOP/s = 2·N·K·P·Q·C·R·S / time for every algorithm.",
        "extra memory: measured with torch's caching-allocator statistics (requested bytes: kept after setup + "
        "peak above that during the first call, minus the output); nvmath-python draws its workspaces and results from "
        "torch's allocator for torch operands (its default allocator), and torch gives cuDNN its workspace "
        "there. igemm's implicit GEMM allocates nothing through torch: its extra memory is the split-K "
        "workspace (fp32 partial tiles + tickets) that Conv2dPlan allocates outside torch, read from the plan "
        "(its launch records); 0 when the plan does not split K.",
        "im2col + GEMM: igemm's im2col kernel materialises the GEMM operand, then one cuBLAS(Lt) GEMM through "
        "nvmath-python. NHWC: cols[N·P·Q, R·S·C] @ w[K, R·S·C]^T = y[N·P·Q, K], already NHWC. NCHW: one batched "
        "GEMM y[n][K, P·Q] = w[K, C·R·S] @ cols[n][C·R·S, P·Q] (w broadcast over the batch), already NCHW. No "
        "permute copy in either layout; extra memory = the cols matrix + cuBLAS workspace. fp32 'strict' uses "
        "CUBLAS_COMPUTE_32F, 'tf32' COMPUTE_32F_FAST_TF32; fp16/bf16 accumulate in fp32.",
        "FFT: computed in float32 whatever the input dtype (cuFFT's half-precision transforms need power-of-2 "
        "sizes); the padded input is rounded up to a 2·3·5·7-smooth transform size; the filter (dilated by "
        "inserting zeros) is transformed on every call, as cuDNN's FFT algorithms do; the multiply-accumulate "
        "over C is a complex64 batched matmul over the frequencies (torch.bmm: the pointwise stage, not a GEMM "
        "baseline). A stride computes the full stride-1 output and subsamples it: the inverse transform and "
        "the multiply-accumulate cost stride_h·stride_w times what the strided output needs.",
        "Not counted anywhere: memory the libraries allocate internally when planning (cuFFT plan data, "
        "cuBLAS handles) and loaded kernel code.",
        "direct: csrc/baselines/direct_conv.cuh, one output element per thread, fp32 accumulation, no tiling.",
        f"cuDNN: torch.nn.functional.conv2d, cudnn.benchmark=True (its choice made before timing), "
        f"allow_tf32={args.precision == 'tf32'}; NHWC tensors enter as channels_last views.",
        "max rel err: max|y - ref| / max|ref| against a float64 convolution (torch) of the first min(N, 4) images.",
    ]
    return rows, notes


# ===================================================================================== numpy runner
def _run_numpy(layers, args, progress) -> tuple[list, list]:
    import tracemalloc

    from .. import reference
    from .._runtime import set_backend
    dtype = args.dtype if args.dtype != "bfloat16" else "float32"
    notes = ["numpy backend (no CUDA GPU, or --backend numpy): the numpy implementations on small sizes "
             "(N 1/2/4, spatial size / 8, at most 128 channels); times are host times (perf_counter), not GPU."]
    if dtype != args.dtype:
        notes.append("bfloat16 has no numpy dtype: the numpy backend runs float32.")
    notes += [
        "implicit: igemm.conv2d on its numpy backend (the float64 reference, no im2col matrix); im2col: the "
        "im2col matrix in the GPU kernel's layout and one matmul; fft: the GPU FFT algorithm's steps with "
        "numpy.fft (float64); direct: the float64 reference (a sum over the filter taps). cuDNN needs a GPU.",
        "extra memory: host bytes the call allocated (tracemalloc peak minus the output), float64 "
        "temporaries included.",
        "max rel err: max|y - ref| / max|ref| against reference.conv2d_direct in float64.",
    ]
    set_backend("numpy")
    was_tracing = tracemalloc.is_tracing()
    rows, seen = [], set()
    try:
        rng = np.random.default_rng(0)
        for layer in layers:
            small = numpy_size(layer)
            if small.name in seen:                  # two layers that shrink to the same small problem
                for _ in args.algorithms:
                    progress.step(f"{small.name} (again)")
                continue
            seen.add(small.name)
            pb = small.problem(dtype, args.layout)
            x = rng.standard_normal(pb.x_shape).astype(dtype)
            w = (rng.standard_normal(pb.w_shape) / np.sqrt(pb.C * pb.R * pb.S)).astype(dtype)
            ref = reference.conv2d_direct(x, w, pb.stride, pb.padding, pb.dilation, pb.layout)
            for algo in args.algorithms:
                row = _row(small, pb, algo, NUMPY_LABELS)
                try:
                    if algo not in NUMPY:
                        raise Unavailable("needs a CUDA GPU and torch")
                    fn = NUMPY[algo]
                    if not was_tracing:
                        tracemalloc.start()
                    tracemalloc.reset_peak()
                    base = tracemalloc.get_traced_memory()[0]
                    y = fn(x, w, pb)
                    peak = tracemalloc.get_traced_memory()[1] - base - np.asarray(y).nbytes
                    if not was_tracing:
                        tracemalloc.stop()          # tracing slows allocation down: time without it
                    y = np.asarray(y, dtype=np.float64)
                    den = np.abs(ref).max()
                    row["max_rel_err"] = (float(np.abs(y - ref).max() / (den if den > 0 else 1.0))
                                          if np.all(np.isfinite(y)) else float("inf"))
                    ts = []
                    for _ in range(max(1, args.reps)):
                        t0 = time.perf_counter()
                        fn(x, w, pb)
                        ts.append(time.perf_counter() - t0)
                    ts.sort()
                    med = statistics.median(ts)
                    row.update(time_us=med * 1e6, p10_us=ts[0] * 1e6, p90_us=ts[-1] * 1e6, reps=len(ts),
                               tflops=pb.flops / med / 1e12, extra_bytes=int(max(0, peak)),
                               extra_mib=max(0, peak) / 2 ** 20)
                except Unavailable as e:
                    row.update(status="skipped", note=str(e))
                except Exception as e:
                    row.update(status="error", note=f"{type(e).__name__}: {e}")
                    traceback.print_exc()
                rows.append(row)
                progress.step(f"{small.name} / {algo}")
    finally:
        if not was_tracing and tracemalloc.is_tracing():
            tracemalloc.stop()
        set_backend(None)
    return rows, notes


# ===================================================================================== outputs
def _command(argv) -> str:
    a0 = sys.argv[0] if sys.argv else "python"
    if a0.endswith(os.path.join("igemm", "__main__.py")) or a0 in ("-m", ""):
        head = "python -m igemm"
    elif a0.endswith("compare_algorithms.py"):
        head = "python benchmarks/compare_algorithms.py"
    else:
        head = "python -m igemm"
    if head == "python -m igemm":
        argv = list(argv)
        if not argv or argv[0] != "compare":
            argv = ["compare"] + argv
    return " ".join([head] + [shlex.quote(a) for a in argv])


def run(args) -> int:
    """Run the comparison described by parsed ``args``; writes ``compare_<backend>_<dtype>_<layout>.{md,json,png}``."""
    from .._runtime import get_backend
    args.algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()] \
        if isinstance(args.algorithms, str) else list(args.algorithms)
    bad = [a for a in args.algorithms if a not in ALGORITHMS]
    if bad:
        print(f"--algorithms: unknown {bad} (expected {', '.join(ALGORITHMS)})", file=sys.stderr)
        return 2
    if args.dtype != "float32" and args.precision == "tf32":
        print("--precision tf32 applies to --dtype float32 only", file=sys.stderr)
        return 2
    if args.quick:
        args.reps = min(args.reps, 7)
        args.warmup = min(args.warmup, 2)
    try:
        layers = select_layers(args.layers, args.match, args.batch, args.quick)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if args.list:
        for l in layers:
            pb = l.problem(args.dtype, args.layout, args.precision)
            print(f"{l.group:9s} {l.name:40s} x{pb.x_shape} w{pb.w_shape} -> y{pb.y_shape} "
                  f"{pb.flops / 1e9:8.2f} GFLOP")
        return 0
    if args.precompile:
        precompile(layers, args.dtype, args.layout, args.precision, args.algorithms, args.arch, args.jobs)
        return 0
    if not layers:
        print("no layers selected (check --layers / --match)", file=sys.stderr)
        return 2
    backend = args.backend
    if backend == "auto":
        backend = get_backend()
    if backend == "cuda":
        try:
            import torch
            if not torch.cuda.is_available():
                raise ImportError("torch sees no CUDA device")
        except ImportError as e:
            print(f"the GPU comparison needs torch with CUDA ({e}); running the numpy backend", file=sys.stderr)
            backend = "numpy"
    if backend == "numpy":
        print("No CUDA GPU (or --backend numpy): running the numpy implementations on small sizes "
              "(host times, host memory).", file=sys.stderr)
        args.reps = min(args.reps, 2 if args.quick else 3)
    progress = _Progress(len(layers) * len(args.algorithms), enabled=not args.no_progress)
    try:
        rows, notes = (_run_gpu if backend == "cuda" else _run_numpy)(layers, args, progress)
    finally:
        progress.close()
    env = gpu_environment() if backend == "cuda" else {
        "backend": "numpy", "numpy": np.__version__, "python": platform.python_version(),
        "host": platform.node(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.makedirs(args.out, exist_ok=True)
    dtype = args.dtype if backend == "cuda" or args.dtype != "bfloat16" else "float32"
    tf32 = "_tf32" if args.precision == "tf32" else ""
    stem = os.path.join(args.out, f"compare_{backend}_{dtype}{tf32}_{args.layout}")
    result = {"command": _command(args.argv) if getattr(args, "argv", None) is not None else "python -m igemm compare",
              "backend": backend, "env": env, "algorithms": args.algorithms,
              "labels": {a: (LABELS if backend == "cuda" else NUMPY_LABELS)[a] for a in args.algorithms},
              "config": {"dtype": dtype, "layout": args.layout, "precision": args.precision, "reps": args.reps,
                         "warmup": args.warmup, "quick": args.quick, "layers": args.layers, "match": args.match,
                         "batch": args.batch, "mem_cap_gib": args.mem_cap},
              "rows": rows, "notes": notes, "plot": None}
    result["summary"] = summary(result)
    if not args.no_plot:
        p = plot(result, stem + ".png")
        if p is None:
            result["notes"].append("plot skipped: matplotlib is not installed (pip install matplotlib)")
        result["plot"] = p
    md = markdown(result)
    with open(stem + ".md", "w") as f:
        f.write(md)
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(md)
    print(f"wrote {stem}.md, {stem}.json" + (f", {result['plot']}" if result["plot"] else " (no plot)"))
    if backend == "numpy":
        print("(numpy backend: no CUDA GPU was used)")
    errors = [r for r in rows if r["status"] == "error"]
    return 1 if errors else 0


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--out", default="compare-out", help="directory for the .md, .json and .png (default compare-out)")
    p.add_argument("--layers", default="resnet50,sweep",
                   help="comma-separated groups: resnet50, sweep (= filter,batch,channels), filter, batch, "
                        "channels, all (default resnet50,sweep)")
    p.add_argument("--match", default="", help="keep only layers whose name contains one of these comma-separated "
                                               "substrings (see --list)")
    p.add_argument("--list", action="store_true", help="print the selected layers and exit")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS),
                   help=f"comma-separated subset of {','.join(ALGORITHMS)} (default all)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--precision", default="strict", choices=["strict", "tf32"],
                   help="float32 only: strict fp32 (default) or TF32 tensor cores, for every algorithm")
    p.add_argument("--layout", default="NHWC", choices=["NHWC", "NCHW"])
    p.add_argument("--batch", type=int, default=32, help="batch of the ResNet-50 layers (default 32)")
    p.add_argument("--reps", type=int, default=20, help="timed calls per case (median reported; default 20)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a smaller sweep and fewer repetitions")
    p.add_argument("--mem-cap", type=float, default=16.0,
                   help="skip (and report) a case whose workspace would exceed this many GiB (default 16)")
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "numpy"])
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--precompile", action="store_true",
                   help="only compile the kernels the selection needs for --arch (no GPU needed), then exit")
    p.add_argument("--arch", default="sm_90a", help="architecture for --precompile (default sm_90a)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compiles")
    return p


def _cli(args) -> int:
    return run(args)


def add_cli(subparsers) -> None:
    """Add the ``compare`` subcommand to ``python -m igemm``."""
    p = subparsers.add_parser("compare", help="implicit GEMM vs im2col+GEMM vs FFT vs direct vs cuDNN: time, memory",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(fn=_with_argv(_cli))


def _with_argv(fn):
    def call(args):
        if getattr(args, "argv", None) is None:
            argv = sys.argv[1:]
            args.argv = argv
        return fn(args)
    return call


def main(argv=None) -> int:
    """``benchmarks/compare_algorithms.py``: the same comparison as ``python -m igemm compare``."""
    ap = argparse.ArgumentParser(prog="compare_algorithms.py", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
