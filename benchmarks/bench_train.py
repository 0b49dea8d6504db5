"""ResNet-50 training step through igemm.nn.convert against PyTorch eager and torch.compile, AMP fp16 channels_last.

    python benchmarks/bench_train.py [--batches 128,256] [--steps 20] [--compile] [--graphs] [--host] [--no-check]
        [--loss-steps 100] [--out DIR] [--quick]

torchvision resnet50, random weights (``torch.manual_seed(0)``), channels_last model and input,
``torch.backends.cudnn.benchmark = True``. A step: ``zero_grad(set_to_none=True)``, the forward and the cross
entropy under ``torch.autocast("cuda", dtype=torch.float16)``, ``scaler.scale(loss).backward()``,
``scaler.step(opt)``, ``scaler.update()`` (``torch.amp.GradScaler``; SGD lr 0.1, momentum 0.9, weight decay 1e-4);
synthetic data: one fixed random batch (N, 3, 224, 224) and random labels. Peers, timed in the same process, each a
deep copy of the same initial model with its own optimizer and scaler, one at a time (the previous one freed):
  - igemm: ``igemm.nn.convert(model)`` in train mode (conv -> BN (-> + identity) -> ReLU as
    ``torch.ops.igemm.conv2d_bn_train``, igemm's fused backward), its kernels compiled first by
    ``igemm.nn.precompile`` (forward and backward, under autocast so fp16's);
  - pytorch: the model itself, eager (cuDNN convolutions, separate BN, add and ReLU kernels);
  - with --compile: ``torch.compile(model)`` (inductor, default mode), more warm-up steps for the compilation;
  - with --graphs: ``igemm+graphs`` and ``pytorch+graphs``, each model's forward and backward captured once by
    ``torch.cuda.make_graphed_callables`` (under ``torch.autocast(..., cache_enabled=False)``, as PyTorch requires)
    and replayed every step; the loss, the GradScaler and the optimizer run eagerly around the replays. ``vs_*``
    compare each peer with the eager ones (no graph), so a graphed peer's ratio includes the host time it saves.
Timing: ``--warmup`` steps, then ``--steps`` steps with CUDA events around each (benchmarks/_harness.py's timer,
no graph: the GradScaler synchronises), the median reported, with p10-p90 spread; images/s = N / median;
``vs_pytorch`` / ``vs_compile``: the peer's step time over that peer's (below 1: faster). ``peak_GB``:
``torch.cuda.max_memory_allocated()`` over one step (after ``reset_peak_memory_stats``), model, gradients and
optimizer state included; ``mem_vs_pytorch``: over eager's (both blank for the graphed peers: their graphs'
memory pools are allocated at capture and not counted there). With --host, ``host_fwd_ms`` / ``host_bwd_ms``: the
process's CPU time (every thread: the backward runs on autograd's device thread) to queue a step's forward
(zero_grad, the model, the loss) and its backward, with the GPU kept busy in front (``torch.cuda._sleep``, ~0.1 s)
so that nothing waits for it; medians of 10 steps after the timed ones. Where it exceeds the GPU's time for the same
part, an eager step is bound by the host.

--check (default; --no-check skips it), at N = 32 from the same initial weights and batch:
  (a) gradients of one step: each parameter's, for igemm AMP and PyTorch AMP (loss scaled by 2^16, halved until
      finite, then unscaled), relative error ||g - ref|| / ||ref|| against the fp32 model's (no autocast, TF32
      off); the max and median over parameters of igemm_err / max(pytorch_amp_err, 1e-7). Bar: max <= 2.
  (b) BatchNorm running mean and var after 5 full steps, igemm AMP against PyTorch AMP: per buffer
      ||igemm - pytorch|| / ||pytorch||, the max over buffers. Bar: <= 1e-3.
  (c) --loss-steps full steps on the fixed batch, igemm AMP and PyTorch AMP: the loss at steps 1, 10, 50, 100
      (those within --loss-steps, and the last) and |igemm - pytorch| / pytorch at the last. Bar: <= 10%.
Each bar is printed as met or unmet, from the numbers as measured; the exit status is 1 when one is unmet.
--quick: the first batch size only, 3 warm-up steps, --loss-steps at most 20.
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import Bench, geomean, parser  # noqa: E402

LR, MOMENTUM, WD = 0.1, 0.9, 1e-4
CHECK_N = 32
DEV = "cuda"
FLOOR = 1e-7            # (a): the floor of PyTorch AMP's error in the ratio
LOSS_AT = (1, 10, 50, 100)


def _setup(base, peer: str, x, lr: float = LR):
    """(model to call, model holding the torchvision names and the parameters, optimizer, scaler) for a peer:
    a deep copy of ``base`` on the GPU, channels_last, train mode."""
    import torch

    import igemm.nn as inn
    m = copy.deepcopy(base).to(DEV).to(memory_format=torch.channels_last).train()
    run = m
    if peer.endswith("+graphs"):
        run, m2, _, _ = _setup(base, peer.split("+")[0], x, lr)
        with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
            run = torch.cuda.make_graphed_callables(run, (x,))
        m = m2
    elif peer == "igemm":
        run = inn.convert(m, inplace=True)       # (shares m's parameters and buffers)
        run.train()
        with torch.autocast("cuda", dtype=torch.float16):
            inn.precompile(run, x)
    elif peer == "compile":
        torch._dynamo.reset()
        run = torch.compile(m)
    opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=MOMENTUM, weight_decay=WD)
    return run, m, opt, torch.amp.GradScaler(DEV)


def _stepper(model, opt, scaler, x, y, amp: bool = True, graphs: bool = False):
    """One training step as a callable (returns the loss tensor); ``amp``: fp16 autocast (else fp32); ``graphs``:
    the model is a graphed callable (autocast's cast cache off, as its capture had it)."""
    import torch
    import torch.nn.functional as F

    def step(i=0):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp, cache_enabled=not graphs):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss
    return step


def _free() -> None:
    import torch
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _batch(N: int, seed: int = 1):
    import torch
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(N, 3, 224, 224, device=DEV, generator=g).contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, 1000, (N,), device=DEV, generator=g)


def _time_one(bench: Bench, base, peer: str, x, y) -> dict:
    """The timer's result for one peer's step, with ``peak`` (bytes), ``setup_s`` and ``warm_s``; what it built is
    freed on return."""
    import torch
    t0 = time.perf_counter()
    run, _, opt, scaler = _setup(base, peer, x)
    setup_s = time.perf_counter() - t0
    step = _stepper(run, opt, scaler, x, y, graphs=peer.endswith("+graphs"))
    warm = bench.args.warmup + (bench.args.compile_warmup if peer == "compile" else 0)
    t0 = time.perf_counter()
    bench.time(step, reps=bench.args.reps, warmup=warm, graph=False)
    r = dict(bench.last, warm_s=time.perf_counter() - t0, setup_s=setup_s)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    r["peak"] = torch.cuda.max_memory_allocated()
    if bench.args.host:
        r["host"] = _host(run, opt, scaler, x, y, peer.endswith("+graphs"))
    return r


def _host(model, opt, scaler, x, y, graphs: bool, n: int = 10) -> tuple:
    """(forward, backward): medians over ``n`` steps of the process's CPU time to queue them, the GPU kept busy in
    front (module doc)."""
    import torch
    import torch.nn.functional as F
    fwd, bwd = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)           # (~0.1 s of GPU clock cycles: longer than the host's step)
        c0 = time.process_time()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, cache_enabled=not graphs):
            loss = F.cross_entropy(model(x), y)
        c1 = time.process_time()
        scaler.scale(loss).backward()
        c2 = time.process_time()
        scaler.step(opt)
        scaler.update()
        fwd.append(c1 - c0)
        bwd.append(c2 - c1)
    torch.cuda.synchronize()
    return statistics.median(fwd), statistics.median(bwd)


def time_peers(bench: Bench, base, N: int, peers: list) -> None:
    """One row per peer at batch N."""
    x, y = _batch(N)
    res = {}
    for peer in peers:
        try:
            res[peer] = _time_one(bench, base, peer, x, y)
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, the others still run
            traceback.print_exc()
            res[peer] = {"error": f"{type(e).__name__}: {e}"}
        _free()
    for peer in peers:
        r = res[peer]
        if "error" in r:
            bench.row(peer=peer, N=N, error=r["error"])
            continue
        t = r["median"]
        row = dict(peer=peer, N=N, ms=t * 1e3, spread_pct=100 * (r["p90"] - r["p10"]) / t, images_s=N / t)
        for k in ("pytorch", "compile"):
            if k in peers:
                row[f"vs_{k}"] = t / res[k]["median"] if "median" in res[k] else ""
        graphed = peer.endswith("+graphs")         # (the graphs' private pools: not in max_memory_allocated)
        row["peak_GB"] = "" if graphed else r["peak"] / 1e9
        row["mem_vs_pytorch"] = (r["peak"] / res["pytorch"]["peak"] if "peak" in res["pytorch"] and not graphed
                                 else "")
        if "host" in r:
            row["host_fwd_ms"], row["host_bwd_ms"] = (v * 1e3 for v in r["host"])
        row["warmup_s"] = r["warm_s"] + r["setup_s"]
        bench.row(**row)
    del x, y


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _grads(base, peer: str, x, y, amp: bool) -> dict:
    """name -> fp32 gradient of one step's loss (AMP: scaled by 2^16, halved until every gradient is finite)."""
    import torch
    import torch.nn.functional as F
    run, m, _, _ = _setup(base, peer, x)
    scale = 2.0 ** 16 if amp else 1.0
    for _ in range(40):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            loss = F.cross_entropy(run(x), y)
        (loss * scale).backward()
        g = {n: p.grad.float() / scale for n, p in m.named_parameters() if p.grad is not None}
        if all(bool(v.isfinite().all()) for v in g.values()):
            return g
        scale /= 2
    raise RuntimeError(f"{peer}: no finite gradients at any loss scale")


def _train(base, peer: str, x, y, steps: int, stats_at: int = 5, lr: float = LR, amp: bool = True):
    """(losses of ``steps`` full steps (AMP, or fp32 with TF32 off), name -> BN running mean/var after step
    ``stats_at``)."""
    import torch
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    if not amp:
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        run, m, opt, scaler = _setup(base, peer, x, lr)
        step = _stepper(run, opt, scaler, x, y, amp)
        losses, stats = [], {}
        for i in range(1, steps + 1):
            losses.append(float(step().item()))
            if i == stats_at:
                stats = {n: b.detach().clone() for n, b in m.named_buffers()
                         if n.endswith(("running_mean", "running_var"))}
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    return losses, stats


def _stat_errs(a: dict, b: dict) -> dict:
    return {k: _rel(a[k], v) for k, v in b.items()}


def check(bench: Bench, base) -> list:
    """The correctness checks (a), (b), (c); notes on the bench, and [(bar, met)]."""
    import torch
    x, y = _batch(CHECK_N, seed=2)
    bars = []
    # (a) one step's gradients against the fp32 model's (no TF32 anywhere in the reference)
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = _grads(base, "pytorch", x, y, amp=False)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    _free()
    err_t = {n: _rel(g, ref[n]) for n, g in _grads(base, "pytorch", x, y, amp=True).items()}
    _free()
    err_i = {n: _rel(g, ref[n]) for n, g in _grads(base, "igemm", x, y, amp=True).items()}
    _free()
    missing = sorted(set(ref) - set(err_i))
    ratios = {n: err_i[n] / max(err_t[n], FLOOR) for n in err_i}
    worst = max(ratios, key=ratios.get)
    over = sum(r > 2 for r in ratios.values())
    ok = ratios[worst] <= 2 and not missing
    bars.append(("(a) gradients: igemm AMP error <= 2x PyTorch AMP's, every parameter", ok))
    bench.note(f"(a) gradients at N={CHECK_N}, relative error against fp32 over {len(ratios)} parameters: igemm AMP "
               f"median {statistics.median(err_i.values()):.3g}, max {max(err_i.values()):.3g}; PyTorch AMP median "
               f"{statistics.median(err_t.values()):.3g}, max {max(err_t.values()):.3g}; ratio igemm/PyTorch median "
               f"{statistics.median(ratios.values()):.3g}, geomean {geomean(list(ratios.values())):.3g}, max "
               f"{ratios[worst]:.3g} ({worst}); {over} over 2"
               f"{f'; no gradient from igemm for {missing}' if missing else ''} -> bar {'met' if ok else 'UNMET'}")
    del ref
    # (b) running statistics after 5 steps and (c) the loss over --loss-steps steps, at the linearly scaled
    # learning rate (0.1 per 256 images) so that the fixed batch is learned rather than diverged from. Beside
    # each, the floor: how far PyTorch AMP is from PyTorch fp32 (TF32 off) on the same measure; and (b0) the
    # statistics alone (lr 0: no drift of the weights).
    n = bench.args.loss_steps
    lr = LR * CHECK_N / 256
    runs = {name: _train(base, peer, x, y, max(5, n), lr=lr, amp=amp) for name, peer, amp in
            (("igemm", "igemm", True), ("pytorch", "pytorch", True), ("fp32", "pytorch", False))}
    _free()
    (li, si), (lt, st), (lf, sf) = runs["igemm"], runs["pytorch"], runs["fp32"]
    s0i, s0t, s0f = (_train(base, peer, x, y, 5, lr=0.0, amp=amp)[1]
                     for peer, amp in (("igemm", True), ("pytorch", True), ("pytorch", False)))
    _free()
    e0, f0 = _stat_errs(s0i, s0t), _stat_errs(s0t, s0f)
    errs, floor = _stat_errs(si, st), _stat_errs(st, sf)
    wk, w0 = max(errs, key=errs.get), max(e0, key=e0.get)
    ok0 = e0[w0] <= 1e-3
    ok = errs[wk] <= 1e-3
    bars.append(("(b0) BN running stats after 5 steps at lr 0: max relative error <= 1e-3", ok0))
    bars.append(("(b) BN running stats after 5 steps: max relative error <= 1e-3", ok))
    bench.note(f"(b0) BN running mean/var after 5 steps at lr 0 (the weights fixed), igemm AMP vs PyTorch AMP over "
               f"{len(e0)} buffers: max {e0[w0]:.3g} ({w0}), median {statistics.median(e0.values()):.3g}; the floor, "
               f"PyTorch AMP vs PyTorch fp32: max {max(f0.values()):.3g}, median {statistics.median(f0.values()):.3g} "
               f"-> bar {'met' if ok0 else 'UNMET'}")
    bench.note(f"(b) BN running mean/var after 5 steps at lr {lr:g}, igemm AMP vs PyTorch AMP over {len(errs)} "
               f"buffers: max {errs[wk]:.3g} ({wk}), median {statistics.median(errs.values()):.3g}; the floor, PyTorch "
               f"AMP vs PyTorch fp32: max {max(floor.values()):.3g}, median {statistics.median(floor.values()):.3g} "
               f"-> bar {'met' if ok else 'UNMET'}")
    if n >= 1:
        at = [s for s in LOSS_AT if s <= n] + ([n] if n not in LOSS_AT else [])
        d, d0 = abs(li[-1] - lt[-1]) / abs(lt[-1]), abs(lf[-1] - lt[-1]) / abs(lt[-1])
        ok = d <= 0.1
        bars.append((f"(c) loss at step {n} within 10% of PyTorch AMP's", ok))
        bench.note(f"(c) loss on one fixed batch (N={CHECK_N}, lr {lr:g}), igemm AMP / PyTorch AMP / PyTorch fp32 at "
                   f"steps " + ", ".join(f"{s}: {li[s - 1]:.4g} / {lt[s - 1]:.4g} / {lf[s - 1]:.4g}" for s in at) +
                   f"; relative difference to PyTorch AMP at step {n}: igemm {d:.3g}, PyTorch fp32 {d0:.3g} -> "
                   f"bar {'met' if ok else 'UNMET'}")
    return bars


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.set_defaults(warmup=5, reps=20)
    p.add_argument("--steps", dest="reps", type=int, help="timed steps per peer and batch (the median reported; "
                   "the same as --reps; default 20)")
    p.add_argument("--batches", default="128,256", help="batch sizes to time")
    p.add_argument("--compile", action="store_true", help="also time torch.compile(model)")
    p.add_argument("--compile-warmup", type=int, default=10, help="extra warm-up steps for torch.compile")
    p.add_argument("--graphs", action="store_true", help="also time igemm and PyTorch with the forward and backward "
                   "captured in CUDA graphs (torch.cuda.make_graphed_callables)")
    p.add_argument("--host", action="store_true", help="also measure the host's time to queue a step's forward and "
                   "backward (process CPU time, the GPU kept busy in front)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help=f"gradient, running-statistics and loss checks at N={CHECK_N}")
    p.add_argument("--loss-steps", type=int, default=100, help="steps of the loss check (c)")
    args = p.parse_args()
    if args.quick:
        args.loss_steps = min(args.loss_steps, 20)
    import torch
    import torchvision
    torch.backends.cudnn.benchmark = True
    bench = Bench("bench_train", args)
    torch.manual_seed(0)
    base = torchvision.models.resnet50()                   # (on the CPU: each peer copies it to the GPU)
    peers = (["igemm", "pytorch"] + (["compile"] if args.compile else [])
             + (["igemm+graphs", "pytorch+graphs"] if args.graphs else []))
    batches = [int(b) for b in args.batches.split(",")]
    for N in batches[:1] if args.quick else batches:
        time_peers(bench, base, N, peers)
    bench.note(f"a step: zero_grad, AMP fp16 forward + cross entropy, GradScaler backward, SGD (lr {LR}, momentum "
               f"{MOMENTUM}, weight decay {WD}); ms: median of {args.reps} steps (CUDA events around each) after "
               f"{args.warmup} warm-up steps (+{args.compile_warmup} for compile); vs_*: step time over that peer's; "
               f"peak_GB: max_memory_allocated over one step; warmup_s: setup (igemm: convert + precompile; compile: "
               f"the first steps compile) and the warm-up and timed steps, seconds of the host.")
    for N in sorted({r["N"] for r in bench.rows}):
        for peer in ("igemm", "igemm+graphs"):
            ig = [r for r in bench.rows if r["N"] == N and r["peer"] == peer and "ms" in r]
            if ig and ig[0]["vs_pytorch"] != "":
                c = ig[0].get("vs_compile", "")
                bench.note(f"N={N}: {peer} {ig[0]['images_s']:.0f} images/s, {ig[0]['vs_pytorch']:.3f}x PyTorch "
                           f"eager's step time" + (f", {c:.3f}x torch.compile's" if c != "" else ""))
    bars = []
    if args.check:
        try:
            bars = check(bench, base)
        except Exception as e:  # noqa: BLE001 - the timings above are still written
            traceback.print_exc()
            bench.note(f"check failed: {type(e).__name__}: {e}")
            bars = [("checks ran", False)]
    for what, ok in bars:
        bench.note(f"bar {'met' if ok else 'UNMET'}: {what}")
    bench.finish()
    return 0 if all(ok for _, ok in bars) else 1


if __name__ == "__main__":
    sys.exit(main())
