"""Shared benchmark harness: CUDA-event timing with warm-up, L2 rotation, medians, peers, tables.

Usage in a bench script::

    from _harness import Bench, rotating, copy_bandwidth
    bench = Bench("bench_norm", args)                 # args from bench.parser()
    t = bench.time(lambda i: fn(xs[i]), n_inputs=len(xs))   # median seconds, spread in bench.last
    bench.row(layer="...", igemm_us=..., torch_us=..., ratio=...)
    bench.finish()                                    # prints markdown, writes JSON + .md under --out

Timing (igemm._timing.GpuTimer, the one timer of the project): ``warmup`` calls, then the calls are captured
into a CUDA graph (a whole input rotation per graph) and the graph is replayed with CUDA events around each
replay: the median per-call time over the replays is reported (GPU time only, no host launch overhead). Calls
that cannot be captured are timed with events around each call instead. ``rotating(make, nbytes)`` builds
enough independent input sets that cycling through them touches more than ``L2_BYTES`` x 2, so each
timed call reads device memory, not L2.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

from igemm._timing import L2_BYTES


def parser(desc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=desc)
    p.add_argument("--out", default="bench-out", help="directory for the JSON and markdown results")
    p.add_argument("--reps", type=int, default=50, help="timed repetitions per case (median reported)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="fewer cases and repetitions")
    return p


def n_rotations(bytes_per_set: int, floor: int = 2, cap: int = 64) -> int:
    """How many independent input sets make one cycle exceed twice the L2."""
    if bytes_per_set <= 0:
        return floor
    return max(floor, min(cap, -(-2 * L2_BYTES // bytes_per_set)))


def rotating(make, bytes_per_set: int, cap: int = 64) -> list:
    return [make(i) for i in range(n_rotations(bytes_per_set, cap=cap))]


def environment() -> dict:
    import torch
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "cuda": torch.version.cuda,
           "sms": torch.cuda.get_device_properties(0).multi_processor_count,
           "host": platform.node(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import cuda.core
        env["cuda.core"] = cuda.core.__version__
    except Exception:
        pass
    try:
        from igemm import _build
        env["compiler"] = _build.find_toolchain().describe()
    except Exception:
        pass
    return env


class Bench:
    def __init__(self, name: str, args):
        self.name = name
        self.args = args
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.env = environment()
        self.last = {}
        self._timer = None
        if args.quick:
            args.reps = min(args.reps, 20)
            args.warmup = min(args.warmup, 3)

    def time(self, fn, n_inputs: int = 1, reps: int | None = None, warmup: int | None = None,
             graph: bool = True) -> float:
        """Median seconds of one ``fn(i)`` (``i`` cycles over ``n_inputs`` input sets), timed by
        :class:`igemm._timing.GpuTimer`.

        With ``graph=True`` (default) the calls are captured into a CUDA graph (one graph holds a whole
        rotation of at least 8 calls) and the graph is replayed, so the time is the GPU's alone, with no
        host launch overhead in it; the median over replays of the per-call time is reported. If capture
        fails (a call synchronises), CUDA events around each call are used instead (``last['method']``).
        """
        from igemm._timing import GpuTimer
        if self._timer is None:
            self._timer = GpuTimer()
        r = self._timer.time(fn, n_inputs=n_inputs, reps=reps or self.args.reps,
                             warmup=self.args.warmup if warmup is None else warmup, graph=graph)
        self.last = r
        return r["median"]

    def row(self, **kw) -> None:
        self.rows.append(kw)

    def note(self, text: str) -> None:
        self.notes.append(text)

    def markdown(self) -> str:
        if not self.rows:
            return "(no rows)"
        cols = list(dict.fromkeys(k for r in self.rows for k in r))
        def fmt(v):
            if isinstance(v, float):
                return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
            return str(v)
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in self.rows:
            lines.append("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |")
        return "\n".join(lines)

    def finish(self) -> None:
        os.makedirs(self.args.out, exist_ok=True)
        md = (f"## {self.name}\n\n{self.env}\n\n" + self.markdown() + "\n\n" +
              "\n".join(f"- {n}" for n in self.notes) + "\n")
        with open(os.path.join(self.args.out, f"{self.name}.md"), "w") as f:
            f.write(md)
        with open(os.path.join(self.args.out, f"{self.name}.json"), "w") as f:
            json.dump({"env": self.env, "rows": self.rows, "notes": self.notes}, f, indent=1, default=str)
        print(md)


def copy_bandwidth(bench: Bench, nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth of an SM copy kernel (bytes read + written per second).

    ``torch.mul(a, 1, out=b)`` rather than ``b.copy_(a)``: captured in a graph, a plain copy becomes a
    copy-engine memcpy node, which is slower than what kernels reach.
    """
    import torch
    a = torch.full((nbytes // 4,), 1.5, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    # 2 GB per call: events around each call cost nothing; no graph capture (and no RNG) here, so a
    # bench's first random inputs are not drawn right after a capture
    t = bench.time(lambda i: torch.mul(a, 1.0, out=b), reps=20, warmup=3, graph=False)
    return 2 * nbytes / t


def geomean(xs) -> float:
    xs = [x for x in xs if x and x > 0]
    if not xs:
        return float("nan")
    import math
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def empty_kernel(device_id: int = 0):
    """A launcher of an empty kernel (1 block of 32 threads) on torch's current stream: the launch floor
    that any kernel's time, measured the same way, includes."""
    import torch

    from igemm import _kernel
    from igemm._kernel import ParamSpec
    params = [ParamSpec("unused", "ptr")]
    stub = _kernel.render_kernel(include="common.cuh", entry="igemm_noop", params=params, threads=32, body="(void)p;")
    launcher = _kernel.Launcher(_kernel.load(stub, "noop", "igemm_noop", device_id), 1, 32)
    args = _kernel.pack_args(params, {})
    return lambda i=0: launcher(torch.cuda.current_stream().cuda_stream, args)
