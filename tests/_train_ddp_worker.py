"""One rank of the data-parallel training test (tests/test_train.py starts two with torch.distributed's env://
variables): a small ResNet converted with ``igemm.nn.convert(model, sync_bn=None)`` (SyncBatchNorm over the
default group) in ``DistributedDataParallel`` (on the CPU, where DDP refuses SyncBatchNorm, the gradients averaged
by hand), one step on this rank's share of a batch split unevenly; the
loss is scaled so that DDP's average of the ranks' gradients is the gradient of the whole batch's mean loss.
Rank 0 also runs the PyTorch model (plain BatchNorm) on the whole batch in one process. On CUDA the step runs again
under fp16 autocast (igemm's eager training path, SyncBatchNorm synced there too) against igemm with plain
BatchNorm on the whole batch, and in fp32 with NCHW memory. Results (gradients, running statistics, outputs) go to
OUT/rank<r>.pt.

    python tests/_train_ddp_worker.py OUT_DIR {cpu,cuda} [BENCH_N]

With BENCH_N, both ranks then time a torchvision ResNet-50 AMP step at BENCH_N images a rank: the converted
model with igemm's SyncBN, and PyTorch's model with ``torch.nn.SyncBatchNorm``, each in DDP (ms, images/s).
"""
import copy
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train import small_resnet  # noqa: E402

import igemm.nn as inn  # noqa: E402

SPLIT = (5, 3)


def _batch(device):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(sum(SPLIT), 3, 16, 16, generator=g)
    y = torch.randint(0, 10, (sum(SPLIT),), generator=g)
    return x.to(device).contiguous(memory_format=torch.channels_last), y.to(device)


def _step(model, x, y, scale: float):
    model.zero_grad(set_to_none=True)
    out = model(x)
    (F.cross_entropy(out, y, reduction="sum") * scale).backward()
    return out.detach()


def _bench(rank, world, device, n: int) -> dict:
    import torchvision
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    base = torchvision.models.resnet50()
    x = torch.randn(n, 3, 224, 224, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (n,), device=device)
    res = {}
    for peer in ("igemm", "pytorch"):
        m = copy.deepcopy(base).to(device).to(memory_format=torch.channels_last).train()
        if peer == "igemm":
            run = inn.convert(m, inplace=True, sync_bn=None).train()
            with torch.autocast("cuda", dtype=torch.float16):
                inn.precompile(run, x)
        else:
            run = torch.nn.SyncBatchNorm.convert_sync_batchnorm(m)
        ddp = torch.nn.parallel.DistributedDataParallel(run, device_ids=[rank])
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cuda")
        times = []
        for i in range(15):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(ddp(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            torch.cuda.synchronize()
            if i >= 5:
                times.append(time.perf_counter() - t0)
        ms = sorted(times)[len(times) // 2] * 1e3
        res[peer] = {"ms": ms, "images_s": world * n / ms * 1e3}
        del ddp, run, m, opt
        torch.cuda.empty_cache()
    return res


def _synced_fast_calls(model) -> int:
    """How many of ``model``'s layers ran igemm's eager training path with SyncBatchNorm (not the op path)."""
    from igemm.nn import _train_fast
    return sum(tc is not None and tc.sync is not None for mod in model.modules()
               for tc in (_train_fast._calls.get(mod) or {}).values())


def _amp(base, rank, device, x, y, xs, ys, world) -> dict:
    """The same step under fp16 autocast: DDP + igemm's SyncBatchNorm on the shares against igemm with plain
    BatchNorm on the whole batch in one process (rank 0), both on igemm's eager training path."""
    m = inn.convert(copy.deepcopy(base).to(device), inplace=True, sync_bn=None).train()
    ddp = torch.nn.parallel.DistributedDataParallel(m, device_ids=[rank])
    with torch.autocast("cuda", dtype=torch.float16):
        _step(ddp, xs, ys, world / sum(SPLIT))
    res = {"amp_grads": [p.grad.float().cpu() for p in m.parameters()],
           "amp_fast_sync": _synced_fast_calls(m)}
    if rank == 0:
        ref = inn.convert(copy.deepcopy(base).to(device), inplace=True).train()
        with torch.autocast("cuda", dtype=torch.float16):
            _step(ref, x, y, 1 / sum(SPLIT))
        res["amp_ref_grads"] = [p.grad.float().cpu() for p in ref.parameters()]
    return res


def _nchw(base, rank, device, xs, ys, world) -> dict:
    """The fp32 step again with the model and the input in NCHW (contiguous) memory: the same gradients."""
    m = copy.deepcopy(base).to(device).to(memory_format=torch.contiguous_format)
    params = list(m.parameters())           # (in the PyTorch model's order, as the reference's)
    m = inn.convert(m, inplace=True, sync_bn=None).train()
    ddp = torch.nn.parallel.DistributedDataParallel(m, device_ids=[rank])
    _step(ddp, xs.contiguous(), ys, world / sum(SPLIT))
    return {"nchw_grads": [p.grad.cpu() for p in params], "nchw_fast_sync": _synced_fast_calls(m)}


def main(out_dir: str, kind: str, bench_n: int = 0) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if kind == "cuda":
        torch.backends.cudnn.allow_tf32 = False          # (the reference's convolutions in fp32, as igemm's)
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(3)
    base = small_resnet().to(memory_format=torch.channels_last)
    x, y = _batch(device)
    lo = sum(SPLIT[:rank])
    xs, ys = x[lo:lo + SPLIT[rank]], y[lo:lo + SPLIT[rank]]
    twin = copy.deepcopy(base).to(device)
    params, buffers = list(twin.parameters()), list(twin.buffers())
    ig = inn.convert(twin, inplace=True, sync_bn=None).train()
    if kind == "cuda":
        ddp = torch.nn.parallel.DistributedDataParallel(ig, device_ids=[rank])
        out = _step(ddp, xs, ys, world / sum(SPLIT))  # (DDP averages over ranks: world / total = 1 / total a rank)
    else:                # (DDP refuses SyncBatchNorm modules on the CPU: its gradient average by hand)
        out = _step(ig, xs, ys, world / sum(SPLIT))
        for p in params:
            dist.all_reduce(p.grad)
            p.grad /= world
    res = {"out": out.cpu(), "grads": [p.grad.cpu() for p in params], "buffers": [b.cpu() for b in buffers]}
    if rank == 0:
        ref = copy.deepcopy(base).to(device).train()
        res["ref_out"] = _step(ref, x, y, 1 / sum(SPLIT)).cpu()
        res["ref_grads"] = [p.grad.cpu() for p in ref.parameters()]
        res["ref_buffers"] = [b.cpu() for b in ref.buffers()]
    if kind == "cuda":
        res.update(_amp(base, rank, device, x, y, xs, ys, world))
        res.update(_nchw(base, rank, device, xs, ys, world))
    if bench_n:
        res["bench"] = _bench(rank, world, device, bench_n)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)          # (as _syncbn_worker.py: no destroy_process_group)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0)
