"""One rank of the two-GPU SyncBN test (tests/test_syncbn.py starts two of these with torch.distributed's
env:// variables). For every case: igemm's sync functions on this rank's share of a deterministic batch
(uneven shares, an empty one in some cases), and on rank 0 the single-process functions over the whole
batch. Results go to OUT/rank<r>.npz; a case that raises records its traceback under "<case>__error".

    python tests/_syncbn_worker.py OUT_DIR
"""
import datetime
import faulthandler
import os
import sys
import time
import traceback

import numpy as np

CASES = {
    "nchw_f32": dict(layout="NCHW", dtype="float32", C=32, hw=(7, 7), split=(3, 5)),
    "nhwc_f16": dict(layout="NHWC", dtype="float16", C=65, hw=(5, 6), split=(4, 1)),
    "nchw_bf16_rank1_empty": dict(layout="NCHW", dtype="bfloat16", C=3, hw=(16, 16), split=(6, 0)),
    "nhwc_f32_rank0_empty": dict(layout="NHWC", dtype="float32", C=2048, hw=(7, 7), split=(0, 3)),
    "nchw_f32_big": dict(layout="NCHW", dtype="float32", C=64, hw=(56, 56), split=(5, 11)),
    "nhwc_f16_big": dict(layout="NHWC", dtype="float16", C=256, hw=(28, 28), split=(9, 7)),
    "graph_nchw_f16": dict(layout="NCHW", dtype="float16", C=16, hw=(14, 14), split=(2, 3), graph=True),
}
EPS = 1e-5


def make_case(name, spec):
    rng = np.random.default_rng(sum(map(ord, name)))
    C, hw, layout = spec["C"], spec["hw"], spec["layout"]
    n = sum(spec["split"])
    mu = rng.uniform(-2, 2, C)
    sd = rng.uniform(0.5, 2, C)
    x = rng.standard_normal((n, C) + hw) * sd[:, None, None] + mu[:, None, None]
    dy = rng.standard_normal((n, C) + hw)
    if layout == "NHWC":
        x = np.moveaxis(x, 1, -1)
        dy = np.moveaxis(dy, 1, -1)
    g = rng.uniform(0.5, 1.5, C)
    b = rng.uniform(-0.5, 0.5, C)
    return np.ascontiguousarray(x), np.ascontiguousarray(dy), g, b


def to_np(t):
    import torch
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    if t.dtype == torch.int32:
        return t.cpu().numpy().view(np.uint32)
    return t.detach().cpu().numpy()


def run_step(igemm, x, dy, g, b, layout, sync: bool):
    if sync:
        mean, invstd, count = igemm.sync_batch_norm_stats(x, EPS, None, layout=layout, return_count=True)
    else:
        mean, invstd = igemm.batch_norm_stats(x, EPS, layout)
        count = x.numel() // (x.shape[1] if layout == "NCHW" else x.shape[-1])
    y, mask = igemm.batch_norm_relu(x, mean, invstd, g, b, layout=layout)
    if sync:
        sdy, sdx, gw, gb = igemm.sync_batch_norm_backward_reduce(dy, x, mean, invstd, g, None, mask=mask,
                                                                 layout=layout)
    else:
        sdy, sdx, gw, gb = igemm.batch_norm_backward_reduce(dy, x, mean, invstd, g, mask=mask, layout=layout)
    dx = igemm.batch_norm_backward_elemt(dy, x, mean, invstd, g, sdy, sdx, count, mask=mask, layout=layout)
    return dict(mean=mean, invstd=invstd, count=count, y=y, mask=mask, sum_dy=sdy, sum_dy_xmu=sdx, grad_weight=gw,
                grad_bias=gb, dx=dx)


def main(out_dir):
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    t0 = time.perf_counter()

    def log(msg):                      # progress in the rank's log, so a hang shows where it stopped
        print(f"[rank {rank} {time.perf_counter() - t0:7.2f}s] {msg}", flush=True)

    # a stuck rank prints every thread's stack into its log (the test reads the log on a timeout)
    faulthandler.dump_traceback_later(int(os.environ.get("IGEMM_SYNCBN_STACKS_S", "90")), repeat=True)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank),
                            timeout=datetime.timedelta(seconds=int(os.environ.get("IGEMM_SYNCBN_NCCL_S", "120"))))
    log("process group up")
    import igemm

    results = {}
    for name, spec in CASES.items():
        log(f"{name}: start")
        try:
            x_full, dy_full, g_np, b_np = make_case(name, spec)
            layout, dtype = spec["layout"], getattr(torch, spec["dtype"])
            lo = sum(spec["split"][:rank])
            hi = lo + spec["split"][rank]
            dev = torch.device("cuda", rank)

            def t(a, dt=dtype):
                return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(device=dev, dtype=dt)

            x, dy = t(x_full[lo:hi]), t(dy_full[lo:hi])
            g, b = t(g_np, torch.float32), t(b_np, torch.float32)
            if spec.get("graph"):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        run_step(igemm, x, dy, g, b, layout, True)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=side):
                    static = run_step(igemm, x, dy, g, b, layout, True)
                x.copy_(t(x_full[lo:hi] * 0.5 + 0.25))
                dy.copy_(t(dy_full[lo:hi][::-1]))
                graph.replay()
                torch.cuda.synchronize()
                eager = run_step(igemm, x, dy, g, b, layout, True)
                torch.cuda.synchronize()
                same = all(torch.equal(static[k], eager[k]) for k in static if torch.is_tensor(static[k]))
                results[f"{name}__graph_equal"] = np.array(int(same))
                res = eager
            else:
                res = run_step(igemm, x, dy, g, b, layout, True)
            torch.cuda.synchronize()
            for k, v in res.items():
                results[f"{name}__{k}"] = to_np(v) if torch.is_tensor(v) else np.array(v)
            if rank == 0:
                xf, dyf = t(x_full), t(dy_full)
                if spec.get("graph"):
                    xf, dyf = t(x_full * 0.5 + 0.25), t(np.concatenate([dy_full[lo2:hi2][::-1] for lo2, hi2 in
                                                                       _bounds(spec["split"])]))
                single = run_step(igemm, xf, dyf, g, b, layout, False)
                torch.cuda.synchronize()
                for k, v in single.items():
                    results[f"{name}__single_{k}"] = to_np(v) if torch.is_tensor(v) else np.array(v)
        except Exception:
            tb = traceback.format_exc()
            results[f"{name}__error"] = np.array(tb)
            with open(os.path.join(out_dir, f"errors-rank{rank}.txt"), "a") as f:  # survives a hang of the peer
                f.write(f"--- {name}\n{tb}\n")
        np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **results)   # what we have so far, every case
        log(f"{name}: {'error' if f'{name}__error' in results else 'done'}; barrier")
        dist.barrier()
    dist.barrier()
    faulthandler.cancel_dump_traceback_later()
    log("finished")
    # no destroy_process_group(): on the 2xH200 machine (torch 2.11) it never returned after the graph case
    # (an NCCL all-gather captured in a CUDA graph), with every result already written; the process exits
    # here and the driver tears its contexts down.
    sys.stdout.flush()
    os._exit(0)


def _bounds(split):
    lo = 0
    for n in split:
        yield lo, lo + n
        lo += n


if __name__ == "__main__":
    main(sys.argv[1])
