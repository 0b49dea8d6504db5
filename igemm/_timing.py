"""The one GPU timer: the median device time of a call, after a warm-up.

:class:`GpuTimer` records CUDA events (cuda.bindings, so it needs no framework) around each call on one
stream, or captures a whole rotation of calls into a CUDA graph and times its replays (``graph=True``: the GPU's
time alone, no launch gaps; needs torch, the callers' framework). ``flush_l2=True`` clears the L2 before each
timed call, outside the events; ``hide_host=True`` queues a spin kernel first so the host's enqueueing is not
timed. The benchmark harness (benchmarks/_harness.py), the baselines comparison and autotune all time with it.
"""
from __future__ import annotations

import statistics
import time

__all__ = ["GpuTimer", "L2_BYTES"]

#: more than the L2 of the GPUs igemm targets (H100: 50 MB, H200: 60 MB)
L2_BYTES = 60 * 1024 * 1024


def _check(res, what: str):
    err = res[0] if isinstance(res, tuple) else res
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return res[1] if isinstance(res, tuple) and len(res) > 1 else None


class GpuTimer:
    """Median GPU time of calls on ``stream`` (a raw ``CUstream`` int; None: torch's current stream if torch
    is loaded, else the legacy default stream). The device's context must be current (the callers' is)."""

    def __init__(self, stream: int | None = None, *, flush_l2: bool = False, hide_host: bool = False):
        from cuda.bindings import driver
        self._d = driver
        self._stream = stream
        self._flush = None
        if flush_l2:
            self._flush = _check(driver.cuMemAlloc(2 * L2_BYTES), "cuMemAlloc")
        self.hide_host = hide_host
        self._cycles_per_s = None

    def __del__(self):
        if getattr(self, "_flush", None) is not None:
            self._d.cuMemFree(self._flush)

    def _handle(self) -> int:
        if self._stream is not None:
            return self._stream
        import sys
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return torch.cuda.current_stream().cuda_stream
        return 0

    def time(self, fn, *, n_inputs: int = 1, reps: int = 20, warmup: int = 3, graph: bool = False) -> dict:
        """``fn(i)`` (``i`` cycling over ``n_inputs`` input sets) timed: ``{"median", "p10", "p90", "reps",
        "method", "host_s"}`` in seconds. ``graph``: replay a CUDA graph of a whole rotation (at least 8
        calls); falls back to events where capture fails (``"error"`` says why)."""
        for i in range(max(warmup, n_inputs)):
            fn(i % n_inputs)
        self._sync()
        if graph:
            try:
                return self._graph(fn, n_inputs, reps)
            except Exception as e:  # noqa: BLE001 - a call that cannot be captured (it synchronises): events
                self._sync()
                out = self._events(fn, n_inputs, reps)
                out["error"] = repr(e)
                return out
        return self._events(fn, n_inputs, reps)

    # -------------------------------------------------------------------------------------- events
    def _events(self, fn, n_inputs: int, reps: int) -> dict:
        d, h = self._d, self._handle()
        s = d.CUstream(h)
        evs = [(_check(d.cuEventCreate(0), "cuEventCreate"), _check(d.cuEventCreate(0), "cuEventCreate"))
               for _ in range(reps)]
        try:
            host = 0.0
            if self.hide_host:
                self._spin(h, reps)
            for i, (a, b) in enumerate(evs):
                if self._flush is not None:
                    d.cuMemsetD8Async(self._flush, 0, 2 * L2_BYTES, s)
                d.cuEventRecord(a, s)
                t0 = time.perf_counter()
                fn(i % n_inputs)
                if i == 0:
                    host = time.perf_counter() - t0
                d.cuEventRecord(b, s)
            _check(d.cuEventSynchronize(evs[-1][1]), "cuEventSynchronize")
            ts = sorted(_check(d.cuEventElapsedTime(a, b), "cuEventElapsedTime") * 1e-3 for a, b in evs)
        finally:
            for a, b in evs:
                d.cuEventDestroy(a)
                d.cuEventDestroy(b)
        return {"median": statistics.median(ts), "p10": ts[len(ts) // 10], "p90": ts[(9 * len(ts)) // 10],
                "reps": reps, "method": "events", "host_s": host}

    def _spin(self, h: int, reps: int) -> None:
        """Queue a spin kernel long enough to cover the host's enqueueing of ``reps`` calls (torch's _sleep)."""
        import torch
        if not hasattr(torch.cuda, "_sleep"):
            return
        if self._cycles_per_s is None:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(2_000_000)
            b.record()
            torch.cuda.synchronize()
            self._cycles_per_s = 2_000_000 / max(a.elapsed_time(b) * 1e-3, 1e-9)
        with torch.cuda.stream(torch.cuda.ExternalStream(h)):
            torch.cuda._sleep(int(min(2.0, reps * 1e-4) * self._cycles_per_s))

    # -------------------------------------------------------------------------------------- graphs
    def _graph(self, fn, n_inputs: int, reps: int) -> dict:
        import torch
        per = n_inputs * max(1, -(-8 // n_inputs))
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(per):               # warm the capture stream too
                fn(i % n_inputs)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        # captured on the stream it was warmed on: what a call keeps per stream (a function form's BN fold) is
        # found in the capture as in a loop of calls, not made again inside the graph
        with torch.cuda.graph(g, stream=s):
            for i in range(per):
                fn(i % n_inputs)
        torch.cuda.synchronize()
        replays = max(7, min(25, reps // 2))
        g.replay()
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
        for a, b in ev:
            a.record()
            g.replay()
            b.record()
        torch.cuda.synchronize()
        ts = sorted(a.elapsed_time(b) * 1e-3 / per for a, b in ev)
        del g
        return {"median": statistics.median(ts), "p10": ts[0], "p90": ts[-1], "reps": replays * per,
                "method": "graph", "host_s": 0.0}

    def _sync(self) -> None:
        _check(self._d.cuStreamSynchronize(self._d.CUstream(self._handle())), "cuStreamSynchronize")
