"""BatchNorm family: references, Chan merge on hard data, index math of every kernel (emulated on the CPU),
the numpy backend and validation everywhere; on a GPU the kernels against the float64 reference and
PyTorch over the shape grid of issue 4, graph capture, determinism."""
import threading
from fractions import Fraction

import numpy as np
import pytest

import igemm
from igemm import _norm_kernels, norm, reference

from helpers import TOL, poison, rel_err, to_numpy, to_torch

LAYOUTS = ("NCHW", "NHWC")
DTYPES = ("float32", "float16", "bfloat16")


def make_x(rng, N, C, HW, layout, mu_scale=2.0, hw_shape=None):
    """Per-channel mean/std so that statistics are well-conditioned yet not trivial."""
    mu = rng.uniform(-mu_scale, mu_scale, C)
    sd = rng.uniform(0.5, 2.0, C)
    x = rng.standard_normal((N, C, HW)) * sd[None, :, None] + mu[None, :, None]
    hw = hw_shape or ((HW,) if HW != 1 else (1, 1))
    x = x.reshape((N, C) + hw)
    if layout == "NHWC":
        x = np.moveaxis(x, 1, -1)
    return np.ascontiguousarray(x)


def hw_shape(HW):
    return {1: (1, 1), 49: (7, 7), 12544: (112, 112)}.get(HW, (HW,))


def assert_stats(mean, var, ref_mean, ref_var, tol=1e-5, what=""):
    mean, var = np.asarray(mean, np.float64), np.asarray(var, np.float64)
    scale = np.abs(ref_mean) + np.sqrt(ref_var) + 1e-30
    assert np.all(np.abs(mean - ref_mean) <= tol * scale), f"{what} mean: max err {np.max(np.abs(mean - ref_mean) / scale)}"
    assert np.all(np.abs(var - ref_var) <= tol * ref_var + 1e-30), \
        f"{what} var: max rel err {np.max(np.abs(var - ref_var) / (ref_var + 1e-30))}"


def assert_sums(got, ref, scale, tol, what=""):
    got = np.asarray(got, np.float64)
    err = np.abs(got - ref) / (scale + 1e-30)
    assert np.all(err <= tol), f"{what}: max scaled err {err.max()}"


# ============================================================================================ references
@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_welford_matches_numpy(rng, layout):
    x = make_x(rng, 3, 5, 7, layout)
    m, v, n = reference.welford_stats(x, layout)
    ax = (0, 2) if layout == "NCHW" else (0, 1)
    np.testing.assert_allclose(m, x.mean(axis=ax), rtol=1e-13)
    np.testing.assert_allclose(v, x.var(axis=ax), rtol=1e-12)
    assert np.all(n == 21)
    mean, invstd = reference.batch_norm_stats_ref(x, 1e-5, layout)
    np.testing.assert_allclose(invstd, 1 / np.sqrt(x.var(axis=ax) + 1e-5), rtol=1e-13)


def test_reference_invstd_zero_var_zero_eps():
    np.testing.assert_array_equal(reference.invstd_from_var(np.array([0.0, 4.0]), 0.0), [0.0, 0.5])


def _exact_merge(parts):
    """Exact (Fraction) merge of (mean, var, count) parts, count 0 skipped."""
    n = Fraction(0)
    s1 = Fraction(0)
    s2 = Fraction(0)
    for m, v, c in parts:
        m, v, c = Fraction(m), Fraction(v), Fraction(c)
        n += c
        s1 += c * m
        s2 += c * (v + m * m)
    mean = s1 / n
    return float(mean), float(s2 / n - mean * mean), float(n)


def test_chan_merge_hard_data(rng):
    """mean 1e4, std 1e-3; parts of counts 0, 1 and huge: the merge equals the exact merge, where the
    naive sum/sum-of-squares formula loses everything."""
    data = 1e4 + 1e-3 * rng.standard_normal(10_000)
    cuts = [0, 0, 1, 1, 4000, 4000, 9999, 10_000]            # empty parts, a single element, big parts
    parts = [data[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    means = np.array([p.mean() if p.size else 0.0 for p in parts])[:, None]
    vars_ = np.array([p.var() if p.size else 0.0 for p in parts])[:, None]
    counts = np.array([p.size for p in parts], dtype=np.float64)
    m, v, n = reference.chan_merge(means, vars_, counts)
    assert n[0] == data.size
    np.testing.assert_allclose(m[0], data.mean(), rtol=1e-15)
    np.testing.assert_allclose(v[0], data.var(), rtol=1e-9)
    naive = (data ** 2).sum() / data.size - data.mean() ** 2
    assert abs(naive - data.var()) > 1e-3 * data.var()          # the pitfall is real
    # counts 1 and huge (1e12): against exact rational arithmetic
    parts = [(1e4, 1e-6, 1e12), (1e4 + 1.0, 0.0, 1), (0.0, 0.0, 0), (1e4 - 0.5, 2e-6, 3e11)]
    em, ev, en = _exact_merge(parts)
    m, v, n = reference.chan_merge(np.array([[p[0]] for p in parts]), np.array([[p[1]] for p in parts]),
                                   np.array([p[2] for p in parts], dtype=np.float64))
    assert n[0] == en
    np.testing.assert_allclose(m[0], em, rtol=1e-15)
    np.testing.assert_allclose(v[0], ev, rtol=1e-9)
    # a NaN in a count-0 part must not leak into the result
    m, v, n = reference.chan_merge(np.array([[np.nan], [2.0]]), np.array([[np.nan], [1.0]]), np.array([0, 3.0]))
    assert (m[0], v[0], n[0]) == (2.0, 1.0, 3.0)


def test_chan_merge_per_channel_counts():
    means = np.array([[1.0, 2.0], [3.0, 4.0]])
    vars_ = np.array([[0.0, 1.0], [0.0, 1.0]])
    counts = np.array([[1.0, 0.0], [1.0, 2.0]])
    m, v, n = reference.chan_merge(means, vars_, counts)
    np.testing.assert_allclose(m, [2.0, 4.0])
    np.testing.assert_allclose(v, [1.0, 1.0])
    np.testing.assert_allclose(n, [2.0, 2.0])


# ============================================================================================ index math
# The kernels' loops, replayed in Python (same formulas as csrc/norm_stats.cuh, norm_elemt.cuh): every
# element must be visited exactly once, by a thread that attributes it to its true channel.
def _channel_of(e, layout_nhwc, C, HW):
    return e % C if layout_nhwc else (e // HW) % C


def emulate_reduction(cfg, N, C, HW, unroll):
    """Vectorised over every thread of the grid. The kernels' batched loops (U positions while all are in
    range, then one at a time, or per-position bounds) visit exactly positions start + k*stride < end,
    stepping the incremental tracker once per position; that is what is replayed."""
    T = norm.THREADS
    V = cfg.vec
    seen = np.zeros(N * C * HW, dtype=np.int64)
    b = np.arange(cfg.blocks)[:, None]
    t = np.arange(T)[None, :]
    if not cfg.nhwc:
        c, s = b // cfg.S, b % cfg.S
        g1 = np.minimum(s * cfg.L + cfg.L, cfg.length)
        g = s * cfg.L + t
        n = g // cfg.VPP
        v = g - n * cfg.VPP
        off = (n * C + c) * HW + v * V
        while True:
            act = g < g1
            if not act.any():
                break
            n_true = g // cfg.VPP
            want = (n_true * C + c) * HW + (g - n_true * cfg.VPP) * V
            assert np.array_equal(off[act], np.broadcast_to(want, g.shape)[act])
            for j in range(V):
                e = off[act] + j
                assert np.all((e // HW) % C == np.broadcast_to(c, g.shape)[act])
                np.add.at(seen, e, 1)
            v = v + cfg.dv
            off = off + cfg.doff
            wrap = v >= cfg.VPP
            v = np.where(wrap, v - cfg.VPP, v)
            off = np.where(wrap, off + cfg.dwrap, off)
            g = g + T
    else:
        TY = T >> cfg.txs
        s, bx = b // cfg.gx, b % cfg.gx
        tx, ty = t & (cfg.tx - 1), t >> cfg.txs
        pk = bx * cfg.tx + tx
        r1 = np.minimum(s * cfg.L + cfg.L, cfg.length)
        r = s * cfg.L + ty + 0 * pk
        while True:
            act = (r < r1) & (pk < cfg.P)
            if not act.any():
                break
            for j in range(V):
                e = r[act] * C + np.broadcast_to(pk, r.shape)[act] * V + j
                assert np.all(e % C == np.broadcast_to(pk, r.shape)[act] * V + j)
                np.add.at(seen, e, 1)
            r = r + TY
    assert np.all(seen == 1), f"visited counts {np.unique(seen)}"


REDUCTION_SHAPES = [(1, 1, 1), (3, 1, 1), (2, 3, 49), (4, 3, 3136), (5, 65, 7), (2, 2048, 1), (2, 4, 3136),
                    (1, 1, 12544), (700, 3, 1), (3, 5, 4), (7, 3, 6), (1, 40, 8), (9, 24, 100), (9, 520, 1),
                    (33, 2, 196), (64, 1, 49), (3, 1000, 3)]
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", REDUCTION_SHAPES)
@pytest.mark.parametrize("itemsize", (4, 2))
def test_reduction_index_math(layout, shape, itemsize):
    N, C, HW = shape
    for sms in (1, 3, 132):
        for align in (16, 4, 2):
            if align < itemsize:
                continue
            for unroll in (_norm_kernels._STATS_UNROLL, _norm_kernels._GRAD_UNROLL):
                cfg = norm.reduction_config(layout, N, C, HW, itemsize, align, sms, unroll)
                assert cfg.blocks < 2 ** 31 and cfg.S >= 1
                assert cfg.vec * itemsize <= align
                if cfg.nhwc:
                    assert C % cfg.vec == 0 and cfg.P * cfg.vec == C and cfg.tx * (norm.THREADS >> cfg.txs) == 256
                    assert cfg.blocks <= max(cfg.gx, 4 * sms)
                else:
                    assert HW % cfg.vec == 0 and cfg.blocks <= max(C, 4 * sms)
                if N * C * HW <= 300_000:
                    emulate_reduction(cfg, N, C, HW, unroll)


def emulate_elemt(cfg, N, C, HW, unroll):
    """Vectorised over the grid: each thread's tracked channel at every position it visits (U per
    iteration, the tracker stepped once per position) against the channel of the element."""
    T = norm.THREADS
    V = cfg.vec
    G = cfg.blocks * T
    NV = cfg.NV
    seen = np.zeros(N * C * HW, dtype=np.int64)
    gid = np.arange(G)
    e = gid * V
    if cfg.nhwc:
        hw, c = np.zeros(G, np.int64), e % C
    else:
        q = e // HW
        hw, c = e - q * HW, q % C
    c_first = c.copy()
    vw = gid - gid % 32
    v = gid.copy()
    while (vw < NV).any():
        for u in range(unroll):
            cc = c.copy()
            c = c + cfg.dc
            if not cfg.nhwc:
                hw = hw + cfg.dhw
                wrap = hw >= HW
                hw = np.where(wrap, hw - HW, hw)
                c = np.where(wrap, c + 1, c)
            c = np.where(c >= C, c - C, c)
            vu = v + u * G
            act = (vu < NV) & (vw < NV)
            for j in range(V):
                els = vu[act] * V + j
                chans = _channel_of(els, cfg.nhwc, C, HW)
                want = cc[act] + (j if cfg.nhwc else 0)
                assert np.array_equal(chans, want)
                np.add.at(seen, els, 1)
            if cfg.fixed:
                assert np.array_equal(cc[act], c_first[act])
        vw = vw + unroll * G
        v = v + unroll * G
    assert np.all(seen == 1)


ELEMT_SHAPES = [(1, 1, 1), (2, 3, 49), (1, 32, 784), (5, 65, 7), (3, 2048, 1), (1, 1, 12544), (64, 3, 1),
                (3, 5, 4), (4, 1000, 1), (2, 6, 10), (8, 7, 640), (9, 65, 7), (30, 3, 196), (16, 24, 100)]
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", ELEMT_SHAPES)
@pytest.mark.parametrize("itemsize", (4, 2))
def test_elemt_index_math(layout, shape, itemsize):
    N, C, HW = shape
    for sms in (1, 2, 132):
        for align in (16, 2 * itemsize, itemsize):
            cfg = norm.elemt_config(layout, N, C, HW, itemsize, align, sms)
            assert cfg.NV * cfg.vec == N * C * HW
            for unroll in (1, 2):
                emulate_elemt(cfg, N, C, HW, unroll)


@pytest.mark.parametrize("C", [1, 3, 32, 64, 65, 96, 1000, 2048, 2049, 4095])
@pytest.mark.parametrize("itemsize", (4, 2))
def test_elemt_fixed_channels(C, itemsize):
    """NHWC: the grid keeps every thread on one channel pack when it can (coefficients in registers)."""
    for N, HW in ((64, 3136), (2, 49), (1, 1)):
        cfg = norm.elemt_config("NHWC", N, C, HW, itemsize, 16, 132)
        if cfg.fixed:
            assert cfg.NV <= cfg.blocks * 256 or (cfg.blocks * 256 * cfg.vec) % C == 0
        if C in (32, 64, 2048, 1000, 3, 65):
            assert cfg.fixed
        assert cfg.blocks <= 4 * 4 * 132


# ============================================================================================ numpy backend
@pytest.mark.parametrize("layout", LAYOUTS)
def test_numpy_backend_pipeline(numpy_backend, rng, layout):
    N, C, HW = 3, 4, 10
    x = make_x(rng, N, C, HW, layout, hw_shape=(2, 5)).astype(np.float32)
    m, v, n = igemm.welford(x, layout)
    assert m.dtype == np.float32 and n.tolist() == [30.0] * C
    rm, rv, _ = reference.welford_stats(x, layout)
    assert_stats(m, v, rm, rv, 1e-6)
    mean, invstd = igemm.batch_norm_stats(x, 1e-5, layout)
    np.testing.assert_allclose(invstd, 1 / np.sqrt(rv + 1e-5), rtol=1e-6)
    g, b = rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    res = rng.standard_normal(x.shape).astype(np.float32)
    y, mask = igemm.batch_norm_relu(x, mean, invstd, g, b, res, layout=layout)
    assert y.dtype == np.float32 and mask.dtype == np.uint32 and mask.size == (x.size + 31) // 32
    np.testing.assert_array_equal(mask, igemm.relu_mask(y))
    yref = reference.batch_norm_elemt_ref(x, mean, invstd, g, b, layout, res, relu=True)
    assert rel_err(y, yref) < 1e-6
    y2 = igemm.batch_norm_elemt(x, mean, invstd, g, b, layout=layout)
    assert rel_err(y2, reference.batch_norm_elemt_ref(x, mean, invstd, g, b, layout)) < 1e-6
    y3 = igemm.batch_norm_relu(x, mean, invstd, g, b, return_mask=False, layout=layout)
    assert isinstance(y3, np.ndarray) and y3.shape == x.shape
    dy = rng.standard_normal(x.shape).astype(np.float32)
    sdy, sdx, gw, gb = igemm.batch_norm_backward_reduce(dy, x, mean, invstd, g, mask=mask, layout=layout)
    r = reference.batch_norm_backward_reduce_ref(dy, x, mean, invstd, layout, mask)
    for a, bref in zip((sdy, sdx, gw, gb), r):
        np.testing.assert_allclose(a, bref, rtol=1e-5, atol=1e-5)
    dx, dres = igemm.batch_norm_backward_elemt(dy, x, mean, invstd, g, sdy, sdx, N * HW, mask=mask, layout=layout,
                                               residual_grad=True)
    np.testing.assert_array_equal(dres, igemm.relu_backward(dy, mask))
    dref = reference.batch_norm_backward_elemt_ref(dy, x, mean, invstd, g, sdy, sdx, N * HW, layout, mask)
    assert rel_err(dx, dref) < 1e-6
    dx2, dg, db, dr = igemm.batch_norm_relu_backward(dy, x, mask, mean, invstd, g, residual=True, layout=layout)
    np.testing.assert_allclose(dx2, dx, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dg, gw, rtol=1e-6)
    # the whole BN-Add-ReLU backward against the analytic one in float64
    _check_bn_relu_grad(x, g, b, res, dy, layout, dx2, dg, db, dr)
    # partial outputs, torch-style flags
    out = igemm.batch_norm_backward_reduce(dy, x, mean, invstd, g, False, True, False, layout=layout)
    assert out[0] is None and out[1] is None and out[3] is None and out[2].shape == (C,)


def _check_bn_relu_grad(x, g, b, res, dy, layout, dx, dg, db, dr):
    """Training-mode BN(+Add)+ReLU gradient by finite differences of the float64 reference."""
    x = x.astype(np.float64)

    def loss(xx, gg, bb, rr):
        mean, var, _ = reference.welford_stats(xx, layout)
        y = reference.batch_norm_elemt_ref(xx, mean, 1 / np.sqrt(var + 1e-5), gg, bb, layout, rr, relu=True)
        return float((y * dy).sum())

    eps = 1e-6
    idx = [(0,) * x.ndim, tuple(s - 1 for s in x.shape), tuple(s // 2 for s in x.shape)]
    for i in idx:
        xp, xm = x.copy(), x.copy()
        xp[i] += eps
        xm[i] -= eps
        num = (loss(xp, g, b, res) - loss(xm, g, b, res)) / (2 * eps)
        assert abs(num - dx[i]) < 1e-3 * (1 + abs(num)), (i, num, dx[i])
        rp, rm = res.astype(np.float64), res.astype(np.float64)
        rp = rp.copy()
        rm = rm.copy()
        rp[i] += eps
        rm[i] -= eps
        num = (loss(x, g, b, rp) - loss(x, g, b, rm)) / (2 * eps)
        assert abs(num - dr[i]) < 1e-3 * (1 + abs(num)), (i, num, dr[i])
    for c in range(len(g)):
        gp, gm = g.astype(np.float64), g.astype(np.float64)
        gp = gp.copy()
        gm = gm.copy()
        gp[c] += eps
        gm[c] -= eps
        num = (loss(x, gp, b, res) - loss(x, gm, b, res)) / (2 * eps)
        assert abs(num - dg[c]) < 1e-3 * (1 + abs(num))
        bp, bm = b.astype(np.float64).copy(), b.astype(np.float64).copy()
        bp[c] += eps
        bm[c] -= eps
        num = (loss(x, g, bp, res) - loss(x, g, bm, res)) / (2 * eps)
        assert abs(num - db[c]) < 1e-3 * (1 + abs(num))


def test_numpy_backend_gather_and_running_stats(numpy_backend, rng):
    means = rng.standard_normal((3, 5)).astype(np.float32)
    vars_ = rng.uniform(0.1, 2, (3, 5)).astype(np.float32)
    counts = np.array([4, 0, 7], np.int64)
    m, v, n = igemm.batch_norm_gather_stats(means, vars_, counts)
    rm, rv, rn = reference.chan_merge(means, vars_, counts)
    np.testing.assert_allclose(m, rm, rtol=1e-6)
    np.testing.assert_allclose(v, rv, rtol=1e-6)
    assert n.tolist() == [11.0] * 5 and m.dtype == np.float32
    x = make_x(rng, 4, 5, 3, "NCHW").astype(np.float32)
    run_m = np.zeros(5, np.float32)
    run_v = np.ones(5, np.float32)
    igemm.batch_norm_stats(x, 1e-5, running_mean=run_m, running_var=run_v, momentum=0.25)
    mm, vv, _ = reference.welford_stats(x)
    np.testing.assert_allclose(run_m, 0.25 * mm, rtol=1e-6)
    np.testing.assert_allclose(run_v, 0.75 + 0.25 * vv * 12 / 11, rtol=1e-6)


def test_numpy_backend_empty_batch(numpy_backend):
    x = np.zeros((0, 3, 4, 4), np.float32)
    m, v, n = igemm.welford(x)
    assert m.tolist() == [0.0] * 3 and v.tolist() == [0.0] * 3 and n.tolist() == [0.0] * 3
    mean, invstd = igemm.batch_norm_stats(x, 0.25)
    np.testing.assert_allclose(invstd, 2.0)


class _ThreadWorld:
    def __init__(self, n):
        self.n = n
        self.barrier = threading.Barrier(n)
        self.slots = [None] * n


class ThreadComm:
    """An in-process stand-in for an NCCL communicator (nranks, rank, allgather), one thread a rank."""

    def __init__(self, world, rank):
        self.world, self.rank, self.nranks = world, rank, world.n

    def allgather(self, send, recv, stream=None):
        w = self.world
        w.slots[self.rank] = np.array(send, copy=True)
        w.barrier.wait()
        np.asarray(recv).reshape(w.n, -1)[...] = np.stack([np.asarray(s).ravel() for s in w.slots])
        w.barrier.wait()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sync_stats_threads(numpy_backend, rng, layout):
    """SyncBN through the communicator protocol: uneven batches and an empty rank equal one process."""
    C, HW = 6, 12
    full = make_x(rng, 9, C, HW, layout, hw_shape=(3, 4)).astype(np.float32)
    dy = rng.standard_normal(full.shape).astype(np.float32)
    splits = [0, 5, 5, 9]                        # rank 1 has N = 0
    world = _ThreadWorld(3)
    results = [None] * 3
    errors = []

    def rank_fn(r):
        try:
            comm = ThreadComm(world, r)
            xl, dyl = full[splits[r]:splits[r + 1]], dy[splits[r]:splits[r + 1]]
            mean, invstd, cnt = igemm.sync_batch_norm_stats(xl, 1e-5, comm, layout=layout, return_count=True)
            sums = igemm.sync_batch_norm_backward_reduce(dyl, xl, mean, invstd, None, comm, layout=layout)
            dx = igemm.batch_norm_backward_elemt(dyl, xl, mean, invstd, None, sums[0], sums[1], float(cnt[0]),
                                                 layout=layout)
            results[r] = (mean, invstd, cnt, sums, dx)
        except Exception as e:  # pragma: no cover - surfaced below
            errors.append(e)
            world.barrier.abort()

    threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    mean1, invstd1 = igemm.batch_norm_stats(full, 1e-5, layout)
    s1 = igemm.batch_norm_backward_reduce(dy, full, mean1, invstd1, layout=layout)
    dx1 = igemm.batch_norm_backward_elemt(dy, full, mean1, invstd1, None, s1[0], s1[1], 9 * HW, layout=layout)
    for r in range(3):
        mean, invstd, cnt, sums, dx = results[r]
        np.testing.assert_array_equal(mean, results[0][0])
        np.testing.assert_allclose(mean, mean1, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(invstd, invstd1, rtol=1e-6)
        assert cnt.tolist() == [9.0 * HW] * C
        np.testing.assert_allclose(sums[0], s1[0], rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(sums[1], s1[1], rtol=1e-5, atol=1e-4)
    dx_cat = np.concatenate([results[r][4] for r in range(3)])
    np.testing.assert_allclose(dx_cat, dx1, rtol=1e-5, atol=1e-6)


def test_sync_local_without_comm(numpy_backend, rng):
    x = make_x(rng, 2, 3, 5, "NCHW").astype(np.float32)
    a = igemm.sync_batch_norm_stats(x, 1e-5)
    b = igemm.batch_norm_stats(x, 1e-5)
    np.testing.assert_allclose(a[0], b[0], rtol=1e-7)
    np.testing.assert_allclose(a[1], b[1], rtol=1e-7)
    with pytest.raises(TypeError, match="comm"):
        igemm.sync_batch_norm_stats(x, 1e-5, comm=object())


# ============================================================================================ compile
@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_compile_instances(arch):
    from igemm import _build
    try:
        _build.find_toolchain()
    except _build.ToolchainNotFoundError:
        pytest.skip("no CUDA compiler")
    stubs = [norm.stub_stats_k1("float16", 8, True, False, False),
             norm.stub_forward("bfloat16", 8, False, 2, True),
             norm.stub_backward("float32", 4, True, True, True)]
    for s in stubs:
        cubin, _ = _build.compile_cubin(s, arch, name="bn_ci")
        assert len(cubin) > 1000


# ============================================================================================ GPU
def _gpu_shape_cases():
    combos = [(lay, dt) for lay in LAYOUTS for dt in DTYPES]
    cases = []
    i = 0
    for N in (1, 2, 64):
        for C in (1, 3, 32, 65, 2048):
            for HW in (1, 49, 12544):
                if N * C * HW > 7_000_000:
                    continue
                for k in ((0, 3) if N * C * HW <= 1_000_000 else (0,)):
                    lay, dt = combos[(i + k) % 6]
                    cases.append(pytest.param(N, C, HW, lay, dt, id=f"{lay}-{dt}-N{N}-C{C}-HW{HW}"))
                i += 1
    return cases


def _has_residual(C, HW):
    return bool((C + HW) % 2)


@pytest.fixture(scope="module")
def gpu_kernels():
    """Compile, in parallel, exactly the kernel instances the GPU tests below launch (norm.instances_for
    replays the launch configuration on the CPU); they would otherwise compile one by one at first use."""
    from igemm import _runtime
    arch = _runtime.device_arch(0)
    sms = int(_runtime.device_props(0).multiprocessor_count)
    stubs = [norm.stub_gather(i, c) for i in ("float32", "float64") for c in ("float32", "float64", "int64")]
    for case in _gpu_shape_cases():
        N, C, HW, layout, dtype = case.values
        r = _has_residual(C, HW)
        stubs += norm.instances_for(layout, N, C, HW, dtype, sms=sms, forward=((2, r),), backward=((True, r),))
    for dtype in DTYPES:
        isz = 4 if dtype == "float32" else 2
        for layout in LAYOUTS:
            for align in (16, isz):
                stubs += norm.instances_for(layout, 4, 24, 196, dtype, sms=sms, align=align,
                                            forward=((0, False), (1, False), (2, False)))
            stubs += norm.instances_for(layout, 0, 3, 16, dtype, sms=sms)
    for layout in LAYOUTS:
        for N, C, HW in ((8, 3, 1000), (64, 32, 49), (2, 5, 12544)):
            stubs += norm.instances_for(layout, N, C, HW, "float32", sms=sms, grad=False, forward=(), backward=())
    stubs += norm.instances_for("NCHW", 16, 3, 12544, "float32", sms=sms, forward=(), backward=())
    stubs += norm.instances_for("NHWC", 32, 64, 3136, "float32", sms=sms, forward=(), backward=())
    stubs += norm.instances_for("NCHW", 8, 32, 784, "float16", sms=sms)
    stubs += norm.instances_for("NCHW", 6, 5, 49, "float16", sms=sms, grad=False, forward=(), backward=())
    norm.compile_stubs(stubs, arch)
    return arch


def _torch_nchw(t, layout):
    """A torch tensor in NCHW shape (channels_last strides for NHWC data, as torch's kernels take it)."""
    if layout == "NCHW":
        return t
    return t.permute(0, t.ndim - 1, *range(1, t.ndim - 1))


def _from_nchw(t, layout):
    if layout == "NCHW":
        return t
    return t.permute(0, *range(2, t.ndim), 1)


@pytest.mark.gpu
@pytest.mark.parametrize("N,C,HW,layout,dtype", _gpu_shape_cases())
def test_bn_pipeline_gpu(gpu_kernels, rng, N, C, HW, layout, dtype):
    """Statistics, BN(-Add)-ReLU with mask, backward reduce + elemt with the mask: reference and torch."""
    torch = pytest.importorskip("torch")
    hw = hw_shape(HW)
    x_np = make_x(rng, N, C, HW, layout, hw_shape=hw)
    x = to_torch(x_np, dtype)
    xs = to_numpy(x)                                     # the rounded input, float64
    ref_m, ref_v, ref_n = reference.welford_stats(xs, layout)
    eps = 1e-5
    tol_s = 1e-5
    # --- welford + batch_norm_stats (poisoned outputs)
    outs = tuple(poison(torch.empty(C, device="cuda")) for _ in range(3))
    m, v, n = igemm.welford(x, layout, out=outs)
    assert all(a is b for a, b in zip((m, v, n), outs))
    assert_stats(to_numpy(m), to_numpy(v), ref_m, ref_v, tol_s, "welford")
    assert np.all(to_numpy(n) == ref_n)
    mo = (poison(torch.empty(C, device="cuda")), poison(torch.empty(C, device="cuda")))
    mean, invstd = igemm.batch_norm_stats(x, eps, layout, out=mo)
    scale_m = np.abs(ref_m) + np.sqrt(ref_v) + 1e-30
    assert np.all(np.abs(to_numpy(mean) - ref_m) <= tol_s * scale_m)
    np.testing.assert_allclose(to_numpy(invstd), 1 / np.sqrt(ref_v + eps), rtol=tol_s)
    mean2, invstd2 = igemm.batch_norm_stats(x, eps, layout)              # deterministic, bit for bit
    assert torch.equal(mean, mean2) and torch.equal(invstd, invstd2)
    m64 = tuple(torch.empty(C, device="cuda", dtype=torch.float64) for _ in range(3))
    igemm.welford(x, layout, out=m64)
    assert_stats(to_numpy(m64[0]), to_numpy(m64[1]), ref_m, ref_v, tol_s, "welford fp64")
    xt = _torch_nchw(x, layout)
    tm, ti = torch.batch_norm_stats(xt, eps)
    assert np.all(np.abs(to_numpy(mean) - to_numpy(tm)) <= 1e-4 * scale_m), "mean vs torch"
    np.testing.assert_allclose(to_numpy(invstd), to_numpy(ti), rtol=1e-4, err_msg="invstd vs torch")
    # --- forward: BN-ReLU, with a residual on every other case
    g = to_torch(rng.uniform(0.5, 1.5, C), "float32")
    b = to_torch(rng.uniform(-0.5, 0.5, C), "float32")
    residual = to_torch(rng.standard_normal(x_np.shape), dtype) if _has_residual(C, HW) else None
    y = poison(torch.empty_like(x))
    mask = poison(torch.empty(((x.numel() + 31) // 32,), dtype=torch.int32, device="cuda"))
    y_, mask_ = igemm.batch_norm_relu(x, mean, invstd, g, b, residual, layout=layout, out=y, mask_out=mask)
    assert y_ is y and mask_ is mask
    mask_u = mask.cpu().numpy().view(np.uint32)
    y_np = to_numpy(y)
    assert not np.isnan(y_np).any()
    np.testing.assert_array_equal(mask_u, reference.pack_mask(y_np > 0))
    assert torch.equal(mask, igemm.relu_mask(y))                         # interchangeable with the epilogue's
    pre = reference.batch_norm_elemt_ref(xs, to_numpy(mean), to_numpy(invstd), to_numpy(g), to_numpy(b), layout,
                                         None if residual is None else to_numpy(residual))
    assert rel_err(y_np, np.maximum(pre, 0)) < TOL[dtype]
    sure = np.abs(pre) > 1e-2 * (np.abs(pre).max() + 1e-30)
    bits = reference.unpack_mask(mask_u, x.numel()).reshape(pre.shape)
    np.testing.assert_array_equal(bits[sure], pre[sure] > 0)
    tchain = torch.batch_norm_elemt(xt, g, b, mean, invstd, eps)
    if residual is not None:
        tchain = tchain + _torch_nchw(residual, layout)
    tchain = _from_nchw(torch.relu(tchain), layout)
    assert rel_err(y_np, to_numpy(tchain)) < TOL[dtype]
    # --- backward with the mask
    dy = to_torch(rng.standard_normal(x_np.shape), dtype)
    outs = tuple(poison(torch.empty(C, device="cuda")) for _ in range(4))
    sdy, sdx, gw, gb = igemm.batch_norm_backward_reduce(dy, x, mean, invstd, g, mask=mask, layout=layout, out=outs)
    dys = to_numpy(dy)
    rsdy, rsdx, rgw, rgb = reference.batch_norm_backward_reduce_ref(dys, xs, to_numpy(mean), to_numpy(invstd),
                                                                    layout, mask_u)
    d_sel = np.where(bits, dys, 0.0)
    xc = np.moveaxis(xs, reference.channel_axis(layout, xs.ndim), 0).reshape(C, -1)
    dc = np.moveaxis(d_sel, reference.channel_axis(layout, xs.ndim), 0).reshape(C, -1)
    sc1 = np.abs(dc).sum(1)
    sc2 = (np.abs(dc) * np.abs(xc - to_numpy(mean)[:, None])).sum(1)
    assert_sums(to_numpy(sdy), rsdy, sc1, 1e-5, "sum_dy")
    assert_sums(to_numpy(sdx), rsdx, sc2, 1e-5, "sum_dy_xmu")
    assert_sums(to_numpy(gw), rgw, sc2 * to_numpy(invstd), 1e-5, "grad_weight")
    assert_sums(to_numpy(gb), rgb, sc1, 1e-5, "grad_bias")
    dyt = torch.where(y > 0, dy, torch.zeros_like(dy))
    t4 = torch.batch_norm_backward_reduce(_torch_nchw(dyt, layout), xt, mean, invstd, g, True, True, True)
    # torch's reduction differs in order (and, for 16-bit inputs, in intermediate rounding): its own
    # error bounds the agreement; igemm's sums were checked against float64 above at 1e-5
    ttol = 1e-4 if dtype == "float32" else 2e-3
    assert_sums(to_numpy(sdy), to_numpy(t4[0]), sc1, ttol, "sum_dy vs torch")
    assert_sums(to_numpy(sdx), to_numpy(t4[1]), sc2, ttol, "sum_dy_xmu vs torch")
    dx = poison(torch.empty_like(x))
    dres = poison(torch.empty_like(x)) if residual is not None else None
    r = igemm.batch_norm_backward_elemt(dy, x, mean, invstd, g, sdy, sdx, N * HW, mask=mask, layout=layout,
                                        residual_grad=residual is not None, out=dx, residual_grad_out=dres)
    if residual is not None:
        assert r[0] is dx and r[1] is dres
        assert torch.equal(dres, igemm.relu_backward(dy, mask))
    dref = reference.batch_norm_backward_elemt_ref(dys, xs, to_numpy(mean), to_numpy(invstd), to_numpy(g),
                                                   to_numpy(sdy), to_numpy(sdx), N * HW, layout, mask_u)
    assert rel_err(to_numpy(dx), dref) < TOL[dtype]
    cnt = torch.tensor([N * HW], dtype=torch.int32, device="cuda")
    tdx = torch.batch_norm_backward_elemt(_torch_nchw(dyt, layout), xt, mean, invstd, g, sdy, sdx, cnt)
    assert rel_err(to_numpy(dx), to_numpy(_from_nchw(tdx, layout))) < TOL[dtype]
    # count as a device array (what sync_batch_norm_stats returns)
    dx3 = igemm.batch_norm_backward_elemt(dy, x, mean, invstd, g, sdy, sdx,
                                          torch.full((C,), float(N * HW), device="cuda"), mask=mask, layout=layout)
    assert torch.equal(dx3, dx)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_elemt_variants_gpu(gpu_kernels, rng, dtype, layout):
    """batch_norm_elemt, ReLU without mask, no weight/bias, numpy inputs, an unaligned view (scalar path)."""
    torch = pytest.importorskip("torch")
    N, C, HW = 4, 24, 196
    x_np = make_x(rng, N, C, HW, layout, hw_shape=(14, 14))
    x = to_torch(x_np, dtype)
    mean, invstd = igemm.batch_norm_stats(x, 1e-3, layout)
    xs = to_numpy(x)
    ref = reference.batch_norm_elemt_ref(xs, to_numpy(mean), to_numpy(invstd), None, None, layout)
    y = igemm.batch_norm_elemt(x, mean, invstd, layout=layout)
    assert rel_err(to_numpy(y), ref) < TOL[dtype]
    y2 = igemm.batch_norm_relu(x, mean, invstd, return_mask=False, layout=layout)
    assert torch.is_tensor(y2) and rel_err(to_numpy(y2), np.maximum(ref, 0)) < TOL[dtype]
    # unaligned: a view one element into a bigger buffer (every pointer odd-aligned -> V = 1 kernels)
    big = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")
    xu = big[1:].view(x.shape)
    xu.copy_(x)
    m3, i3 = igemm.batch_norm_stats(xu, 1e-3, layout)
    assert_stats(to_numpy(m3), 1 / to_numpy(i3) ** 2 - 1e-3, to_numpy(mean), 1 / to_numpy(invstd) ** 2 - 1e-3, 1e-5)
    yu, mu = igemm.batch_norm_relu(xu, mean, invstd, layout=layout)
    ya, ma = igemm.batch_norm_relu(x, mean, invstd, layout=layout)
    assert torch.equal(yu, ya) and torch.equal(mu, ma)
    dy = to_torch(rng.standard_normal(x_np.shape), dtype)
    dyu = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")[1:].view(x.shape)
    dyu.copy_(dy)
    ru = igemm.batch_norm_backward_reduce(dyu, xu, mean, invstd, mask=mu, layout=layout)
    ra = igemm.batch_norm_backward_reduce(dy, x, mean, invstd, mask=ma, layout=layout)
    for a, b in zip(ru, ra):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-5, atol=1e-5 * float(b.abs().max()))
    dxu = igemm.batch_norm_backward_elemt(dyu, xu, mean, invstd, None, ra[0], ra[1], N * HW, mask=mu, layout=layout)
    dxa = igemm.batch_norm_backward_elemt(dy, x, mean, invstd, None, ra[0], ra[1], N * HW, mask=ma, layout=layout)
    assert torch.equal(dxu, dxa)
    # numpy arrays in, numpy arrays out, through the GPU
    if dtype != "bfloat16":
        xn = xs.astype(dtype)
        mn, ivn = igemm.batch_norm_stats(xn, 1e-3, layout)
        assert isinstance(mn, np.ndarray)
        np.testing.assert_allclose(mn, to_numpy(mean), rtol=1e-6, atol=1e-6)
        yn, mkn = igemm.batch_norm_relu(xn, mn, ivn, layout=layout)
        assert isinstance(yn, np.ndarray) and mkn.dtype == np.uint32
        np.testing.assert_array_equal(mkn, reference.pack_mask(yn.astype(np.float64) > 0))


@pytest.mark.gpu
def test_hard_data_gpu(gpu_kernels, rng):
    """mean 1e4, std 1e-3 in fp32: the shifted Welford keeps the variance (naive sums would not)."""
    pytest.importorskip("torch")
    for layout in LAYOUTS:
        for N, C, HW in ((8, 3, 1000), (64, 32, 49), (2, 5, 12544)):
            x_np = 1e4 + 1e-3 * rng.standard_normal((N, C, HW))
            if layout == "NHWC":
                x_np = np.ascontiguousarray(np.moveaxis(x_np, 1, -1))
            x = to_torch(x_np, "float32")
            xs = to_numpy(x)
            ref_m, ref_v, _ = reference.welford_stats(xs, layout)
            m, v, n = igemm.welford(x, layout)
            assert_stats(to_numpy(m), to_numpy(v), ref_m, ref_v, 1e-4, f"hard {layout} {N, C, HW}")
            _, invstd = igemm.batch_norm_stats(x, 0.0, layout)
            np.testing.assert_allclose(to_numpy(invstd), 1 / np.sqrt(ref_v), rtol=1e-4)


@pytest.mark.gpu
def test_gather_stats_gpu(gpu_kernels, rng):
    torch = pytest.importorskip("torch")
    W, C = 5, 37
    means = rng.standard_normal((W, C)) + 1e4
    vars_ = rng.uniform(1e-7, 1e-5, (W, C))
    counts = np.array([3, 0, 1, 2 ** 40, 7], dtype=np.int64)
    for mdt in ("float32", "float64"):
        for cdt in ("float32", "float64", "int64"):
            tm = torch.tensor(means, dtype=getattr(torch, mdt), device="cuda")
            tv = torch.tensor(vars_, dtype=getattr(torch, mdt), device="cuda")
            tc = torch.tensor(counts, dtype=getattr(torch, cdt), device="cuda")
            outs = tuple(poison(torch.empty(C, dtype=getattr(torch, mdt), device="cuda")) for _ in range(3))
            m, v, n = igemm.batch_norm_gather_stats(tm, tv, tc, out=outs)
            rm, rv, rn = reference.chan_merge(to_numpy(tm), to_numpy(tv), to_numpy(tc))
            rtol = 1e-6 if mdt == "float32" else 1e-12
            np.testing.assert_allclose(to_numpy(m), rm, rtol=rtol)
            # var ~1e-6 next to means ~1e4 and counts up to 2^40: fp64 merges in another order agree to ~1e-7
            np.testing.assert_allclose(to_numpy(v), rv, rtol=1e-5 if mdt == "float32" else 1e-6)
            np.testing.assert_allclose(to_numpy(n), rn, rtol=rtol)
    # per-rank per-channel counts, and NaN partials on empty ranks are ignored
    cnt2 = rng.integers(0, 4, (W, C)).astype(np.float32)
    means2 = means.copy()
    means2[cnt2 == 0] = np.nan
    m, v, n = igemm.batch_norm_gather_stats(torch.tensor(means2, device="cuda"), torch.tensor(vars_, device="cuda"),
                                            torch.tensor(cnt2, device="cuda"))
    rm, rv, rn = reference.chan_merge(means2, vars_, cnt2)
    np.testing.assert_allclose(to_numpy(m), rm, rtol=1e-12)
    np.testing.assert_allclose(to_numpy(n), rn)
    # against torch's gather (which takes invstd) on benign data
    means3 = rng.standard_normal((W, C))
    vars3 = rng.uniform(0.5, 2, (W, C))
    counts3 = np.array([3, 0, 1, 9, 7])
    eps = 1e-5
    tm = torch.tensor(means3, dtype=torch.float32, device="cuda")
    tv = torch.tensor(vars3, dtype=torch.float32, device="cuda")
    m, v, n = igemm.batch_norm_gather_stats(tm, tv, torch.tensor(counts3, dtype=torch.int64, device="cuda"))
    x_dummy = torch.empty(1, C, device="cuda")
    tmean, tinv = torch.batch_norm_gather_stats_with_counts(x_dummy, tm, 1 / torch.sqrt(tv + eps), None, None, 0.1,
                                                            eps, torch.tensor(counts3, dtype=torch.float32,
                                                                              device="cuda"))
    np.testing.assert_allclose(to_numpy(m), to_numpy(tmean), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(1 / np.sqrt(to_numpy(v) + eps), to_numpy(tinv), rtol=1e-5)


@pytest.mark.gpu
def test_empty_and_running_gpu(gpu_kernels, rng):
    torch = pytest.importorskip("torch")
    for layout in LAYOUTS:
        x = torch.empty((0, 3, 4, 4) if layout == "NCHW" else (0, 4, 4, 3), device="cuda")
        outs = tuple(poison(torch.empty(3, device="cuda")) for _ in range(3))
        m, v, n = igemm.welford(x, layout, out=outs)
        assert m.tolist() == [0.0] * 3 and v.tolist() == [0.0] * 3 and n.tolist() == [0.0] * 3
        mean, invstd = igemm.batch_norm_stats(x, 0.25, layout)
        assert invstd.tolist() == [2.0] * 3
        y, mk = igemm.batch_norm_relu(x, mean, invstd, layout=layout)
        assert y.shape == x.shape and mk.numel() == 0
        s = igemm.batch_norm_backward_reduce(x, x, mean, invstd, layout=layout)
        assert s[0].tolist() == [0.0] * 3
    x = to_torch(make_x(rng, 6, 5, 49, "NCHW", hw_shape=(7, 7)), "float16")
    rm = torch.zeros(5, device="cuda")
    rv = torch.ones(5, device="cuda")
    igemm.batch_norm_stats(x, 1e-5, running_mean=rm, running_var=rv, momentum=0.3)
    mm, vv, nn = reference.welford_stats(to_numpy(x))
    np.testing.assert_allclose(to_numpy(rm), 0.3 * mm, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(to_numpy(rv), 0.7 + 0.3 * vv * nn / (nn - 1), rtol=1e-5)


@pytest.mark.gpu
def test_graph_capture_gpu(gpu_kernels, rng):
    """The whole BN-ReLU training step (stats, forward with mask, backward reduce + elemt) captured in a
    CUDA graph: no host synchronisation anywhere; replays equal eager calls."""
    torch = pytest.importorskip("torch")
    N, C, H = 8, 32, 28
    x = to_torch(make_x(rng, N, C, H * H, "NCHW", hw_shape=(H, H)), "float16")
    dy = to_torch(rng.standard_normal(x.shape), "float16")
    g = torch.rand(C, device="cuda") + 0.5
    b = torch.rand(C, device="cuda") - 0.5
    rm, rv = torch.zeros(C, device="cuda"), torch.ones(C, device="cuda")

    def step():
        mean, invstd = igemm.batch_norm_stats(x, 1e-5, running_mean=rm, running_var=rv)
        y, mask = igemm.batch_norm_relu(x, mean, invstd, g, b)
        sdy, sdx, gw, gb = igemm.batch_norm_backward_reduce(dy, x, mean, invstd, g, mask=mask)
        dx = igemm.batch_norm_backward_elemt(dy, x, mean, invstd, g, sdy, sdx, N * H * H, mask=mask)
        return mean, invstd, y, mask, gw, gb, dx

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        static = step()
    x.copy_(to_torch(make_x(rng, N, C, H * H, "NCHW", hw_shape=(H, H)), "float16"))
    dy.copy_(to_torch(rng.standard_normal(x.shape), "float16"))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    torch.cuda.synchronize()
    for a, e in zip(static, eager):
        assert torch.equal(a, e)


@pytest.mark.gpu
def test_determinism_gpu(gpu_kernels, rng):
    """Same input, same bits: statistics and backward sums over many blocks per channel."""
    torch = pytest.importorskip("torch")
    for layout, shape in (("NCHW", (16, 3, 112, 112)), ("NHWC", (32, 56, 56, 64))):
        x = to_torch(rng.standard_normal(shape), "float32")
        dy = to_torch(rng.standard_normal(shape), "float32")
        r1 = igemm.batch_norm_stats(x, 1e-5, layout)
        r2 = igemm.batch_norm_stats(x.clone(), 1e-5, layout)
        assert all(torch.equal(a, b) for a, b in zip(r1, r2))
        s1 = igemm.batch_norm_backward_reduce(dy, x, r1[0], r1[1], layout=layout)
        s2 = igemm.batch_norm_backward_reduce(dy.clone(), x, r1[0], r1[1], layout=layout)
        assert all(torch.equal(a, b) for a, b in zip(s1, s2))


# ============================================================================================ GPU path, emulated
# The CUDA path of every public function (validation, plans, packed launch arguments, workspace and output
# wiring, modes and flags) run on the CPU: "device" memory is host memory, and each launch is decoded from
# its packed arguments and carried out by a numpy model of the kernel. Catches glue bugs without a GPU.
import ctypes  # noqa: E402
import re  # noqa: E402

from igemm import _kernel, _runtime, syncbn  # noqa: E402

_NPT = {"float": np.float32, "cutlass::half_t": np.float16, "double": np.float64, "int32_t": np.int32,
        "int64_t": np.int64}


def _mem(ptr, n, dtype):
    n = int(n)
    if n <= 0:
        return np.zeros(0, dtype)
    assert ptr, "null pointer dereferenced"
    buf = (ctypes.c_char * (n * np.dtype(dtype).itemsize)).from_address(int(ptr))
    return np.frombuffer(buf, dtype=dtype)


class _FakeTensor(_runtime.Tensor):
    pass


class _FakeCtx:
    """CallContext stand-in: numpy arrays play device arrays (kind "other", device 0)."""

    def __init__(self, arrays, stream=None, **kw):
        self.views = {}
        for name, obj in arrays.items():
            if obj is not None:
                t = _runtime.as_tensor(obj, name)
                t.kind, t.device_id = "other", 0
                self.views[name] = t
        self.backend, self.kind, self.device_id, self.host = "cuda", "other", 0, False
        self.stream = _runtime.RawStream(0)

    def device_view(self, name):
        return self.views[name]

    def empty(self, shape, dtype, name="out"):
        npdt = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "int32": np.int32,
                "uint32": np.uint32}[dtype]
        a = np.empty(shape, npdt)
        if a.dtype.kind == "f":
            a.fill(np.nan)                       # poisoned, like fresh GPU memory in the tests
        else:
            a.fill(0xAA)
        t = _runtime.as_tensor(a, "out")
        t.kind, t.device_id = "other", 0
        return a, t

    def finish(self, obj):
        return obj

    def copy_back(self, name, dev):
        pass


class _FakeLauncher:
    def __init__(self, kernel, grid, block, smem=0, coop=False):
        self.stub = kernel
        self.grid = grid

    def __call__(self, stream, packed):
        m = re.search(r"igemm::norm::(\w+)(?:<([^>]*)>)?\(p\);", self.stub)
        fn, targs = m.group(1), [a.strip() for a in (m.group(2) or "").split(",") if a.strip()]
        nk = _norm_kernels
        params = {"bn_forward": nk._EW_PARAMS, "bn_backward": nk._EW_PARAMS, "gather_stats": nk._GATHER_PARAMS,
                  "sum_ranks": nk._GATHER_PARAMS}.get(fn, nk._RED_PARAMS)
        p = {}
        for spec in params:
            i = packed.slots[spec.name]
            p[spec.name] = {"ptr": lambda: int(packed.u64[i]), "int32": lambda: int(packed.i32[2 * i]),
                            "int64": lambda: int(packed.data.view(np.int64)[i]),
                            "float32": lambda: float(packed.f32[2 * i])}[spec.ctype]()
        getattr(self, fn)(p, targs)

    # --- helpers
    @staticmethod
    def _stats_write(p, T, c, n, mean_y, m2):
        total = p["total"]
        mean = var = 0.0
        if total > 0:
            mean = float(_mem(p["x"] + c * p["shift"] * np.dtype(T).itemsize, 1, T)[0]) + mean_y
            var = max(m2, 0.0) / total
        if p["mode"] == 0:
            dt = np.float64 if p["f64"] else np.float32
            for k, v in (("out0", mean), ("out1", var), ("out2", total)):
                _mem(p[k], c + 1, dt)[c] = v
        else:
            _mem(p["out0"], c + 1, np.float32)[c] = mean
            _mem(p["out1"], c + 1, np.float32)[c] = reference.invstd_from_var(np.array([var]), p["eps"])[0]
        if p["run_mean"] and total > 0:
            mo = p["momentum"]
            rm, rv = _mem(p["run_mean"], c + 1, np.float32), _mem(p["run_var"], c + 1, np.float32)
            rm[c] = (1 - mo) * rm[c] + mo * mean
            if total > 1:
                rv[c] = (1 - mo) * rv[c] + mo * var * total / (total - 1)

    @staticmethod
    def _grad_write(p, c, a, b):
        dt = np.float64 if p["f64"] else np.float32
        _mem(p["out0"], c + 1, dt)[c] = a
        _mem(p["out1"], c + 1, dt)[c] = b
        if p["out2"]:
            _mem(p["out2"], c + 1, np.float32)[c] = b * _mem(p["invstd"], c + 1, np.float32)[c]
        if p["out3"]:
            _mem(p["out3"], c + 1, np.float32)[c] = a

    @staticmethod
    def _slices(p, nhwc, V):
        """[(c, s, flat element indices of the block's share of channel c)] from the launch parameters."""
        C, S, L, length, HW = p["C"], p["S"], p["L"], p["len"], p["HW"]
        out = []
        if not nhwc:
            N = length // p["VPP"]
            for c in range(C):
                idx = (np.arange(N)[:, None] * C + c) * HW + np.arange(HW)[None, :]
                idx = idx.reshape(-1)
                for s in range(S):
                    out.append((c, s, idx[s * L * V:min(s * L + L, length) * V]))
        else:
            for c in range(C):
                for s in range(S):
                    rows = np.arange(s * L, min(s * L + L, length))
                    out.append((c, s, rows * C + c))
        return out, (p["len"] // p["VPP"] * C * HW if not nhwc else p["len"] * C)

    def _part(self, p, c, s, vals):
        C, S = p["C"], p["S"]
        part = _mem(p["part"], 3 * C * S, np.float32)
        for k, v in enumerate(vals):
            part[(k * C + c) * S + s] = v

    # --- kernels
    def stats_nchw(self, p, targs, nhwc=False):
        T, V, final = _NPT[targs[0]], int(targs[1]), targs[2] == "true"
        blocks, numel = self._slices(p, nhwc, V)
        x = _mem(p["x"], numel, T).astype(np.float64)
        for c, s, idx in blocks:
            K = x[c * p["shift"]]
            y = x[idx] - K
            n, mean_y = y.size, (y.mean() if y.size else 0.0)
            m2 = float(((y - mean_y) ** 2).sum())
            if final:
                self._stats_write(p, T, c, n, mean_y, m2)
            else:
                self._part(p, c, s, (n, mean_y, m2))

    def stats_nhwc(self, p, targs):
        self.stats_nchw(p, targs, nhwc=True)

    def stats_finalize(self, p, targs):
        T, C, S = _NPT[targs[0]], p["C"], p["S"]
        part = _mem(p["part"], 3 * C * S, np.float32).astype(np.float64).reshape(3, C, S)
        for c in range(C):
            m, v, n = reference.chan_merge(part[1, c][:, None], part[2, c][:, None] / np.maximum(part[0, c][:, None], 1),
                                           part[0, c])
            self._stats_write(p, T, c, n[0], m[0], v[0] * n[0])

    def stats_finalize_block(self, p, targs):
        assert self.grid == p["C"]
        self.stats_finalize(p, targs)

    def grad_finalize_block(self, p, targs):
        assert self.grid == p["C"]
        self.grad_finalize(p, targs)

    def grad_nchw(self, p, targs, nhwc=False):
        T, V, final = _NPT[targs[0]], int(targs[1]), targs[2] == "true"
        blocks, numel = self._slices(p, nhwc, V)
        dy = _mem(p["dy"], numel, T).astype(np.float64)
        x = _mem(p["x"], numel, T).astype(np.float64)
        if p["mask"]:
            bits = reference.unpack_mask(_mem(p["mask"], (numel + 31) // 32, np.uint32), numel)
            dy = np.where(bits, dy, 0.0)
        mean = _mem(p["mean"], p["C"], np.float32)
        for c, s, idx in blocks:
            a, b = dy[idx].sum(), (dy[idx] * (x[idx] - mean[c])).sum()
            if final:
                self._grad_write(p, c, a, b)
            else:
                self._part(p, c, s, (a, b, 0.0))

    def grad_nhwc(self, p, targs):
        self.grad_nchw(p, targs, nhwc=True)

    def grad_finalize(self, p, targs):
        C, S = p["C"], p["S"]
        part = _mem(p["part"], 3 * C * S, np.float32).astype(np.float64).reshape(3, C, S)
        for c in range(C):
            self._grad_write(p, c, part[0, c].sum(), part[1, c].sum())

    def gather_stats(self, p, targs):
        InT, CntT = _NPT[targs[0]], _NPT[targs[1]]
        C, W = p["C"], p["W"]
        n_in = max((W - 1) * p["rs"] + C, 0)
        mean = _mem(p["mean"], n_in, InT).astype(np.float64)
        var = _mem(p["var"], n_in, InT).astype(np.float64)
        cnt = _mem(p["cnt"], max((W - 1) * p["cnt_rs"] + (C - 1) * p["cnt_cs"] + 1, 0), CntT).astype(np.float64)
        wi, ci = np.arange(W)[:, None], np.arange(C)[None, :]
        m, v, n = reference.chan_merge(mean[wi * p["rs"] + ci], var[wi * p["rs"] + ci],
                                       cnt[wi * p["cnt_rs"] + ci * p["cnt_cs"]]) if W else (np.zeros(C),) * 3
        if p["mode"] == 0:
            dt = np.float64 if p["f64"] else np.float32
            _mem(p["out0"], C, dt)[:] = m
            _mem(p["out1"], C, dt)[:] = v
            _mem(p["out2"], C, dt)[:] = n
        else:
            _mem(p["out0"], C, np.float32)[:] = m
            _mem(p["out1"], C, np.float32)[:] = reference.invstd_from_var(v, p["eps"])
            if p["out2"]:
                _mem(p["out2"], C, np.float32)[:] = n
            if p["run_mean"]:
                rm, rv = _mem(p["run_mean"], C, np.float32), _mem(p["run_var"], C, np.float32)
                nrm, nrv = reference.update_running_stats_ref(rm, rv, m, v, n, p["momentum"])
                rm[:], rv[:] = nrm, nrv

    def sum_ranks(self, p, targs):
        C, W = p["C"], p["W"]
        a = _mem(p["mean"], W * 2 * C, np.float64).reshape(W, 2, C)
        _mem(p["out0"], C, np.float32)[:] = a[:, 0].sum(0)
        _mem(p["out1"], C, np.float32)[:] = a[:, 1].sum(0)

    @staticmethod
    def _chan(p, numel, nhwc):
        i = np.arange(numel)
        return i % p["C"] if nhwc else (i // p["HW"]) % p["C"]

    def bn_forward(self, p, targs):
        T, V, nhwc, act, res = _NPT[targs[0]], int(targs[1]), targs[2].endswith("kNHWC"), int(targs[3]), \
            targs[4] == "true"
        numel = p["NV"] * V
        c = self._chan(p, numel, nhwc)
        x = _mem(p["x"], numel, T).astype(np.float32)
        a = _mem(p["invstd"], p["C"], np.float32) * (_mem(p["weight"], p["C"], np.float32) if p["weight"] else 1)
        b = _mem(p["bias"], p["C"], np.float32) if p["bias"] else np.zeros(p["C"], np.float32)
        t = (x - _mem(p["mean"], p["C"], np.float32)[c]) * a[c] + b[c]
        if res:
            t = t + _mem(p["res"], numel, T).astype(np.float32)
        if act:
            t = np.where((t > 0) | np.isnan(t), t, 0).astype(np.float32)
        y = _mem(p["y"], numel, T)
        y[:] = t.astype(T)
        if act == 2:
            _mem(p["mask"], (numel + 31) // 32, np.uint32)[:] = reference.pack_mask(y.astype(np.float32) > 0)

    def bn_backward(self, p, targs):
        T, V, nhwc, mask, dres = _NPT[targs[0]], int(targs[1]), targs[2].endswith("kNHWC"), targs[3] == "true", \
            targs[4] == "true"
        numel = p["NV"] * V
        C = p["C"]
        c = self._chan(p, numel, nhwc)
        dy = _mem(p["dy"], numel, T).astype(np.float32)
        x = _mem(p["x"], numel, T).astype(np.float32)
        if mask:
            dy = np.where(reference.unpack_mask(_mem(p["mask"], (numel + 31) // 32, np.uint32), numel), dy, 0)
        cnt = (_mem(p["count"], (C - 1) * p["count_cs"] + 1, np.float32)[np.arange(C) * p["count_cs"]]
               if p["count"] else np.full(C, p["count_val"], np.float32))
        norm_ = 1 / cnt
        inv = _mem(p["invstd"], C, np.float32)
        w = _mem(p["weight"], C, np.float32) if p["weight"] else np.ones(C, np.float32)
        mdy = _mem(p["sum_dy"], C, np.float32) * norm_
        f1 = inv * inv * _mem(p["sum_dy_xmu"], C, np.float32) * norm_
        dx = (dy - mdy[c] - (x - _mem(p["mean"], C, np.float32)[c]) * f1[c]) * (w * inv)[c]
        _mem(p["y"], numel, T)[:] = dx.astype(T)
        if dres:
            _mem(p["dres"], numel, T)[:] = dy.astype(T)


@pytest.fixture
def emulated_gpu(monkeypatch):
    nk = _norm_kernels
    caches = (nk._red_plan, nk._empty_plan, nk._ew_plan, nk._gather_plan)
    for f in caches:
        f.cache_clear()
    monkeypatch.setattr(norm, "CallContext", _FakeCtx)
    monkeypatch.setattr(syncbn, "CallContext", _FakeCtx)
    monkeypatch.setattr(_kernel, "load", lambda stub, name, entry, device_id, smem=0: stub)
    monkeypatch.setattr(_kernel, "Launcher", _FakeLauncher)
    monkeypatch.setattr(nk, "_sms", lambda device_id: 2)          # small grids: many slices per channel
    yield
    for f in caches:
        f.cache_clear()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("shape", [(5, 3, 49), (2, 8, 1), (3, 16, 64), (0, 4, 9)])
def test_gpu_path_emulated(emulated_gpu, rng, layout, dtype, shape):
    N, C, HW = shape
    x = make_x(rng, N, C, HW, layout).astype(dtype)
    xs = x.astype(np.float64)
    tol = 1e-5 if dtype == "float32" else 2e-3
    rm_, rv_, rn_ = reference.welford_stats(xs, layout)
    m, v, n = igemm.welford(x, layout)
    assert_stats(m, v, rm_, rv_, 1e-6)
    assert n.tolist() == rn_.tolist()
    o64 = tuple(np.full(C, np.nan) for _ in range(3))
    igemm.welford(x, layout, out=o64)
    assert_stats(o64[0], o64[1], rm_, rv_, 1e-12)
    run_m, run_v = np.zeros(C, np.float32), np.ones(C, np.float32)
    mean, invstd = igemm.batch_norm_stats(x, 1e-3, layout, running_mean=run_m, running_var=run_v, momentum=0.5)
    np.testing.assert_allclose(invstd, reference.invstd_from_var(rv_, 1e-3), rtol=1e-6)
    erm, erv = reference.update_running_stats_ref(np.zeros(C), np.ones(C), rm_, rv_, rn_, 0.5)
    np.testing.assert_allclose(run_m, erm, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(run_v, erv, rtol=1e-6)
    g = rng.uniform(0.5, 1.5, C).astype(np.float32)
    b = rng.uniform(-0.5, 0.5, C).astype(np.float32)
    r = rng.standard_normal(x.shape).astype(dtype)
    y, mask = igemm.batch_norm_relu(x, mean, invstd, g, b, r, layout=layout)
    np.testing.assert_array_equal(mask, reference.pack_mask(y.astype(np.float64) > 0))
    yref = reference.batch_norm_elemt_ref(xs, mean, invstd, g, b, layout, r, relu=True)
    assert rel_err(y, yref) < tol
    y0 = igemm.batch_norm_elemt(x, mean, invstd, layout=layout)
    assert rel_err(y0, reference.batch_norm_elemt_ref(xs, mean, invstd, None, None, layout)) < tol
    dy = rng.standard_normal(x.shape).astype(dtype)
    sdy, sdx, gw, gb = igemm.batch_norm_backward_reduce(dy, x, mean, invstd, g, mask=mask, layout=layout)
    ref4 = reference.batch_norm_backward_reduce_ref(dy, xs, mean, invstd, layout, mask)
    for a_, b_ in zip((sdy, sdx, gw, gb), ref4):
        np.testing.assert_allclose(a_, b_, rtol=1e-5, atol=1e-4)
    none2 = igemm.batch_norm_backward_reduce(dy, x, mean, invstd, g, False, False, True, layout=layout)
    assert none2[0] is None and none2[2] is None
    np.testing.assert_allclose(none2[3], reference.batch_norm_backward_reduce_ref(dy, xs, mean, invstd, layout)[3],
                               rtol=1e-5, atol=1e-4)
    cnt = max(N * HW, 1)
    dx, dres = igemm.batch_norm_backward_elemt(dy, x, mean, invstd, g, sdy, sdx, cnt, mask=mask, layout=layout,
                                               residual_grad=True)
    dref = reference.batch_norm_backward_elemt_ref(dy, xs, mean, invstd, g, sdy, sdx, cnt, layout, mask)
    assert rel_err(dx, dref) < tol
    np.testing.assert_array_equal(dres, reference.relu_backward(dy, mask))
    dx2 = igemm.batch_norm_backward_elemt(dy, x, mean, invstd, g, sdy, sdx, np.full(C, cnt, np.float32), mask=mask,
                                          layout=layout)
    np.testing.assert_array_equal(dx2, dx)
    # SyncBN, one process and two (threads with the communicator protocol), uneven batches
    a1 = syncbn.sync_batch_norm_stats(x, 1e-3, layout=layout, return_count=True)
    np.testing.assert_allclose(a1[0], mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(a1[1], invstd, rtol=1e-6)
    assert a1[2].tolist() == [float(N * HW)] * C
    s1 = syncbn.sync_batch_norm_backward_reduce(dy, x, mean, invstd, g, mask=mask, layout=layout)
    np.testing.assert_allclose(s1[0], sdy, rtol=1e-5, atol=1e-4)
    world = _ThreadWorld(2)
    out = [None, None]
    cut = N // 3

    def rank_fn(rk):
        xl = np.ascontiguousarray(x[:cut] if rk == 0 else x[cut:])
        dl = np.ascontiguousarray(dy[:cut] if rk == 0 else dy[cut:])
        comm = ThreadComm(world, rk)
        st = syncbn.sync_batch_norm_stats(xl, 1e-3, comm, layout=layout, return_count=True)
        sm = syncbn.sync_batch_norm_backward_reduce(dl, xl, st[0], st[1], g, comm, layout=layout)
        out[rk] = (st, sm)

    ths = [threading.Thread(target=rank_fn, args=(k,)) for k in range(2)]
    for t_ in ths:
        t_.start()
    for t_ in ths:
        t_.join()
    for rk in range(2):
        (mm, ii, cc), (sa, sb, _, _) = out[rk]
        np.testing.assert_allclose(mm, mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ii, invstd, rtol=1e-5)
        assert cc.tolist() == [float(N * HW)] * C
        full = reference.batch_norm_backward_reduce_ref(dy, xs, mm, ii, layout)
        np.testing.assert_allclose(sa, full[0], rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(sb, full[1], rtol=1e-5, atol=1e-4)
    # gather with every count dtype and both count shapes
    W = 3
    means = rng.standard_normal((W, C)).astype(np.float32)
    vars_ = rng.uniform(0.1, 1, (W, C)).astype(np.float32)
    for counts in (np.array([2, 0, 5], np.int64), np.array([2, 0, 5], np.int32), np.array([2., 0., 5.]),
                   rng.integers(0, 3, (W, C)).astype(np.float32)):
        gm, gv, gn = igemm.batch_norm_gather_stats(means, vars_, counts)
        em, ev, en = reference.chan_merge(means, vars_, counts)
        np.testing.assert_allclose(gm, em, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(gv, ev, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(gn, en)


def test_gpu_path_emulated_block_finalize(emulated_gpu, monkeypatch, rng):
    """Few channels, many slices: kernel 2 runs a block per channel."""
    monkeypatch.setattr(_norm_kernels, "_sms", lambda device_id: 32)
    seen = []
    orig = _FakeLauncher.__call__

    def spy(self, stream, packed):
        seen.append(re.search(r"igemm::norm::(\w+)", self.stub).group(1))
        return orig(self, stream, packed)

    monkeypatch.setattr(_FakeLauncher, "__call__", spy)
    x = make_x(rng, 64, 4, 1024, "NHWC", hw_shape=(32, 32)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    m, v, n = igemm.welford(x, "NHWC")
    rm_, rv_, _ = reference.welford_stats(x, "NHWC")
    assert_stats(m, v, rm_, rv_, 1e-6)
    s = igemm.batch_norm_backward_reduce(dy, x, m, v, layout="NHWC")
    ref = reference.batch_norm_backward_reduce_ref(dy, x, m, v, "NHWC")
    np.testing.assert_allclose(s[0], ref[0], rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(s[1], ref[1], rtol=1e-5, atol=1e-3)
    assert "stats_finalize_block" in seen and "grad_finalize_block" in seen
