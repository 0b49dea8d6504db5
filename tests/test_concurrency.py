"""Concurrency (issue 8): kernels on two streams at once give what they give serially; one plan called
from two threads is safe; library workspaces are ordered with the stream the work runs on; a thread that
never touched CUDA itself can call igemm.

What is documented as unsupported, and so not tested: concurrent calls on different streams of one conv
plan that keeps scratch (a split-K or stream-K workspace and tickets, the NCHW transpose path's copies of x
and w; ``Conv2dPlan.__call__`` says so).
The kernel cache under concurrent processes is in test_cache.py.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import igemm
from igemm import epilogues as ep
from igemm import reference
from igemm.conv import Conv2dPlan

from helpers import poison, rel_err, to_numpy


def test_plan_call_documents_thread_safety():
    doc = Conv2dPlan.__call__.__doc__
    assert "Thread-safe" in doc, doc
    assert "split-K" in doc and "streams" in doc and "overlap" in doc and "transpose" in doc, doc


def _torch():
    return pytest.importorskip("torch")


def _sleep_on(torch, stream, ms: float = 200.0) -> None:
    """Keep ``stream`` busy for about ``ms`` (so work queued behind it starts late)."""
    cycles = int(torch.cuda.get_device_properties(0).clock_rate * ms) if hasattr(
        torch.cuda.get_device_properties(0), "clock_rate") else int(2e6 * ms)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)


def _conv_setup(torch, rng):
    """An fp16 NHWC BN-Add-ReLU(mask) plan without split-K, two input sets and their serial results."""
    N, H, W, C, K = 8, 28, 28, 64, 64
    w = torch.from_numpy(rng.standard_normal((K, 3, 3, C)) / 24).to("cuda", torch.float16)
    g, b, m, v = (torch.from_numpy(a).float().cuda() for a in (rng.uniform(0.5, 1.5, K), rng.standard_normal(K),
                                                               rng.standard_normal(K), rng.uniform(0.5, 2, K)))
    plan = Conv2dPlan((N, H, W, C), tuple(w.shape), "float16", "NHWC", padding=1,
                      epilogue=ep.chain(ep.BatchNorm(g, b, m, v), ep.Add(), ep.ReLU(mask=True)))
    assert plan.spec().splits == 1
    xs = [torch.from_numpy(rng.standard_normal((N, H, W, C))).to("cuda", torch.float16) for _ in range(2)]
    rs = [torch.from_numpy(rng.standard_normal((N, H, W, K))).to("cuda", torch.float16) for _ in range(2)]
    serial = [plan(x, w, residual=r) for x, r in zip(xs, rs)]
    torch.cuda.synchronize()
    return plan, w, xs, rs, serial


@pytest.mark.gpu
def test_gpu_conv_plan_two_streams(rng):
    torch = _torch()
    plan, w, xs, rs, serial = _conv_setup(torch, rng)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    ys = [poison(torch.empty_like(s[0])) for s in serial]
    ms = [poison(torch.empty_like(s[1])) for s in serial]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    _sleep_on(torch, streams[0], 50)                   # stream 0 starts late: the two overlap differently
    for it in range(20):
        for i, s in enumerate(streams):
            if it % 2:
                plan(xs[i], w, residual=rs[i], out=ys[i], mask_out=ms[i], stream=s)
            else:
                with torch.cuda.stream(s):
                    plan(xs[i], w, residual=rs[i], out=ys[i], mask_out=ms[i])
    torch.cuda.synchronize()
    for i in range(2):
        assert torch.equal(ys[i], serial[i][0]) and torch.equal(ms[i], serial[i][1]), f"stream {i}"


@pytest.mark.gpu
def test_gpu_conv_plan_two_threads(rng):
    """One plan, two threads, each on its own stream and on the shared default stream, checking every call."""
    torch = _torch()
    plan, w, xs, rs, serial = _conv_setup(torch, rng)
    errors = []
    start = threading.Barrier(2)

    def work(i, own_stream):
        try:
            torch.cuda.set_device(0)
            s = torch.cuda.Stream() if own_stream else torch.cuda.current_stream()
            y = torch.empty_like(serial[i][0])
            m = torch.empty_like(serial[i][1])
            start.wait()
            with torch.cuda.stream(s):
                for it in range(60):
                    y.fill_(float("nan"))
                    plan(xs[i], w, residual=rs[i], out=y, mask_out=m)
                    s.synchronize()
                    if not (torch.equal(y, serial[i][0]) and torch.equal(m, serial[i][1])):
                        errors.append(f"thread {i} call {it}: wrong result")
                        return
        except Exception as e:  # reported below
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    for own in (True, False):
        threads = [threading.Thread(target=work, args=(i, own)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors


@pytest.mark.gpu
def test_gpu_conv_plan_two_threads_host_arrays(rng):
    """The general (non-torch) path from two threads: numpy in, numpy out."""
    torch = _torch()
    x = [rng.standard_normal((2, 8, 10, 10)).astype(np.float32) for _ in range(2)]
    w = rng.standard_normal((16, 8, 3, 3)).astype(np.float32) / 8
    plan = Conv2dPlan(x[0].shape, w.shape, "float32", "NCHW", padding=1)
    refs = [reference.conv2d_im2col(xi, w, 1, 1, 1) for xi in x]
    errors = []

    def work(i):
        try:
            for _ in range(20):
                y = plan(x[i], w)
                if not (isinstance(y, np.ndarray) and rel_err(y, refs[i]) <= 1e-5):
                    errors.append(f"thread {i}: wrong result")
                    return
        except Exception as e:
            errors.append(f"thread {i}: {type(e).__name__}: {e}")
    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_gpu_fresh_thread_can_launch(rng):
    """A thread that has made no CUDA call of its own (a worker pool thread): igemm makes the device's
    context current itself; nothing depends on the caller having touched torch in that thread."""
    torch = _torch()
    plan, w, xs, rs, serial = _conv_setup(torch, rng)
    y = poison(torch.empty_like(serial[0][0]))
    m = poison(torch.empty_like(serial[0][1]))
    dy = torch.randn(4096, device="cuda")
    dx = poison(torch.empty_like(dy))
    mask = igemm.relu_mask(torch.randn(4096, device="cuda"))
    torch.cuda.synchronize()
    errors = []

    def work():
        try:
            plan(xs[0], w, residual=rs[0], out=y, mask_out=m)
            igemm.relu_backward(dy, mask, out=dx)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    t = threading.Thread(target=work)
    t.start()
    t.join(120)
    torch.cuda.synchronize()
    assert not errors, errors
    assert torch.equal(y, serial[0][0]) and torch.equal(m, serial[0][1])
    bits = reference.unpack_mask(mask.cpu().numpy(), 4096)
    np.testing.assert_array_equal(to_numpy(dx), np.where(bits, to_numpy(dy), 0))


@pytest.mark.gpu
def test_gpu_families_two_streams(rng):
    """BN statistics (two-kernel reduction), index_add (atomic, exact on integers; and deterministic),
    PReLU forward/backward and relu_backward: two streams at once equal serial, bit for bit."""
    torch = _torch()
    xs = [torch.from_numpy(rng.standard_normal((8, 16, 56, 56))).float().cuda() for _ in range(2)]
    idx = torch.from_numpy(rng.integers(0, 300, 5000)).cuda()
    srcs = [torch.from_numpy(rng.integers(-4, 5, (5000, 64)).astype(np.float32)).cuda() for _ in range(2)]
    alpha = torch.from_numpy(rng.uniform(0, 0.5, 16)).float().cuda()
    masks = [igemm.relu_mask(x) for x in xs]

    scaled = [s * 0.37 for s in srcs]

    def run(i, stream):
        # everything the current stream writes comes first: the side stream then waits for it
        xa = torch.zeros(300, 64, device="cuda")
        xd = torch.zeros(300, 64, device="cuda")
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        out = {"stats": igemm.batch_norm_stats(xs[i], 1e-5, stream=stream)}
        igemm.index_add(xa, 0, idx, srcs[i], stream=stream)
        igemm.index_add(xd, 0, idx, scaled[i], deterministic=True, stream=stream)
        out["index_add"], out["index_add_det"] = xa, xd
        out["prelu"] = igemm.prelu(xs[i], alpha, stream=stream)
        out["prelu_bwd"] = igemm.prelu_backward(xs[1 - i], xs[i], alpha, stream=stream)
        out["relu_bwd"] = igemm.relu_backward(xs[1 - i], masks[i], stream=stream)
        return out

    serial = [run(i, None) for i in range(2)]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    _sleep_on(torch, streams[0], 50)
    conc = [run(i, s) for i, s in enumerate(streams)]
    torch.cuda.synchronize()

    def same(a, b):
        if isinstance(a, (tuple, list)):
            return all(same(u, v) for u, v in zip(a, b))
        return torch.equal(a, b)
    for i in range(2):
        for k in serial[i]:
            assert same(conc[i][k], serial[i][k]), f"{k} on stream {i}"


@pytest.mark.gpu
@pytest.mark.parametrize("func", ["batch_norm_stats", "welford", "backward_reduce_sums_only", "sync_batch_norm_stats"])
def test_gpu_workspace_with_explicit_stream_is_stream_ordered(func, rng):
    """With ``stream=s`` (not the current stream), scratch memory a call allocates and frees must not be
    handed to other work on the current stream while ``s`` still uses it. Stream s is kept busy, the call
    queued behind it, then blocks of the scratch size are taken and zeroed on the current stream: none may
    be written by the kernels that run on s afterwards."""
    torch = _torch()
    x = torch.from_numpy(rng.standard_normal((8, 4, 64, 64))).float().cuda()      # 8 slices per channel
    dy = torch.randn_like(x)
    mean, invstd = igemm.batch_norm_stats(x, 1e-5)

    def call(stream):
        if func == "batch_norm_stats":
            return igemm.batch_norm_stats(x, 1e-5, stream=stream)
        if func == "welford":
            return igemm.welford(x, stream=stream)
        if func == "backward_reduce_sums_only":
            return igemm.batch_norm_backward_reduce(dy, x, mean, invstd, None, False, True, True, stream=stream)
        return igemm.sync_batch_norm_stats(x, 1e-5, stream=stream)
    call(None)                      # compiled and loaded now: the call below only queues its kernels
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    _sleep_on(torch, s, 300)
    res = call(s)
    grabs = [torch.zeros(n, device="cuda") for n in (4, 24, 96, 128, 192, 256) for _ in range(256)]
    torch.cuda.synchronize()
    dirty = sum(int(g.count_nonzero()) for g in grabs)
    assert dirty == 0, f"{func}: kernels on the explicit stream wrote into memory freed to the current stream"
    # and the results are right
    ref_m, ref_v, ref_n = reference.welford_stats(to_numpy(x))
    if func in ("batch_norm_stats", "sync_batch_norm_stats"):
        np.testing.assert_allclose(to_numpy(res[0]), ref_m, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(to_numpy(res[1]), 1 / np.sqrt(ref_v + 1e-5), rtol=1e-5)
    elif func == "welford":
        np.testing.assert_allclose(to_numpy(res[0]), ref_m, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(to_numpy(res[1]), ref_v, rtol=1e-5)
    else:
        assert res[0] is None and res[1] is None
        ref = reference.batch_norm_backward_reduce_ref(to_numpy(dy), to_numpy(x), to_numpy(mean), to_numpy(invstd))
        np.testing.assert_allclose(to_numpy(res[3]), ref[3], rtol=1e-4, atol=1e-3)


def _bn_case(torch, rng):
    x = torch.from_numpy(rng.standard_normal((4, 16, 16, 32))).to("cuda", torch.float16)
    w = torch.from_numpy(rng.standard_normal((64, 3, 3, 32)) / 17).to("cuda", torch.float16)
    vecs = [[a.astype(np.float32) for a in (rng.uniform(0.5, 1.5, 64), rng.standard_normal(64),
                                           rng.standard_normal(64), rng.uniform(0.5, 2, 64))] for _ in range(2)]
    torch.cuda.synchronize()
    return x, w, vecs


def _bn_ref(x, w, V):
    from igemm.reference.epilogue import apply_chain
    pre = reference.conv2d_im2col(to_numpy(x), to_numpy(w), 1, 1, 1, "NHWC")
    return apply_chain(pre, ep.chain(ep.BatchNorm(*V)), "NHWC")


@pytest.mark.gpu
def test_gpu_conv_per_call_vectors_outlive_a_side_stream_kernel(rng):
    """conv2d folds BatchNorm vectors per call (host vectors: uploaded to device buffers). With the kernel
    queued behind other work on a side stream, those buffers must not be freed and reused (here: by the
    next calls' uploads on the default stream) before the kernel has read them."""
    torch = _torch()
    x, w, (V1, V2) = _bn_case(torch, rng)
    igemm.conv2d(x, w, padding=1, layout="NHWC", epilogue=ep.BatchNorm(*V2))     # compile and load first
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    _sleep_on(torch, s, 300)
    y1 = igemm.conv2d(x, w, padding=1, layout="NHWC", epilogue=ep.BatchNorm(*V1), stream=s)
    others = [igemm.conv2d(x, w, padding=1, layout="NHWC", epilogue=ep.BatchNorm(*V2)) for _ in range(4)]
    torch.cuda.synchronize()
    assert rel_err(to_numpy(y1), _bn_ref(x, w, V1)) <= 1e-2, "the side-stream call read another call's vectors"
    assert rel_err(to_numpy(others[-1]), _bn_ref(x, w, V2)) <= 1e-2


@pytest.mark.gpu
def test_gpu_conv_per_call_fold_is_ordered_with_the_kernel(rng):
    """conv2d(..., stream=s) with CUDA BatchNorm vectors: the per-call fold (torch ops) must be ordered before
    the kernel on s even when the current stream is busy."""
    torch = _torch()
    x, w, (V1, _) = _bn_case(torch, rng)
    V = [torch.from_numpy(a).cuda() for a in V1]
    s = torch.cuda.Stream()
    igemm.conv2d(x, w, padding=1, layout="NHWC", epilogue=ep.BatchNorm(*V), stream=s)   # compile and load first
    torch.cuda.synchronize()
    _sleep_on(torch, torch.cuda.current_stream(), 300)        # the current stream starts its work late
    y = igemm.conv2d(x, w, padding=1, layout="NHWC", epilogue=ep.BatchNorm(*V), stream=s)
    torch.cuda.synchronize()
    assert rel_err(to_numpy(y), _bn_ref(x, w, V1)) <= 1e-2, "the kernel ran before its scale/shift were computed"


@pytest.mark.gpu
def test_gpu_split_k_plan_on_two_streams_in_sequence(rng):
    """The supported way to use one split-K plan on two streams: ordered (s2 waits for s1)."""
    torch = _torch()
    x = torch.from_numpy(rng.standard_normal((2, 7, 7, 256))).to("cuda", torch.float16)
    w = torch.from_numpy(rng.standard_normal((256, 3, 3, 256)) / 48).to("cuda", torch.float16)
    plan = Conv2dPlan(x.shape, w.shape, "float16", "NHWC", padding=1, options=igemm.Conv2dOptions(config={"splits": 4}))
    ref = plan(x, w)
    torch.cuda.synchronize()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    s1.wait_stream(torch.cuda.current_stream())
    y1 = plan(x, w, stream=s1)
    s2.wait_stream(s1)
    y2 = plan(x, w, stream=s2)
    torch.cuda.synchronize()
    assert torch.equal(y1, ref) and torch.equal(y2, ref)
