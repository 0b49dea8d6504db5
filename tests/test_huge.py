"""Huge tensors (issue 8): more than 2**31 elements (and offsets past 2**31 bytes) either compute correctly
(64-bit offsets where needed) or raise a clear error before launch.

GPU + slow; each needs up to ~20 GB (an H200 has 141 GB). Each test holds a file lock, so under
pytest-xdist they still run one at a time (a worker waits for the lock), but better run this file on its
own without xdist: ``pytest tests/test_huge.py -p no:xdist``. Outputs are checked in full, chunk by chunk,
against torch computed on the GPU.
"""
from __future__ import annotations

import contextlib
import gc
import os
import tempfile

import numpy as np
import pytest

import igemm
from igemm import epilogues as ep

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

CH = 1 << 26                 # elements per checking chunk (a multiple of 32: mask words line up)
BIG = 2 ** 31


@pytest.fixture
def torch():
    t = pytest.importorskip("torch")
    yield t
    gc.collect()
    t.cuda.empty_cache()


@pytest.fixture(autouse=True)
def one_at_a_time():
    """A cross-process lock: one huge test on the GPU at a time."""
    import fcntl
    with open(os.path.join(tempfile.gettempdir(), "igemm-huge-tests.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            gc.collect()
            with contextlib.suppress(Exception):
                import torch
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            fcntl.flock(f, fcntl.LOCK_UN)


def need_gb(torch, gb: float) -> None:
    free, _ = torch.cuda.mem_get_info()
    if free < gb * 1e9:
        pytest.skip(f"needs {gb} GB of free GPU memory, {free / 1e9:.1f} GB free")


def _chunks(n: int, ch: int = CH):
    for a in range(0, n, ch):
        yield a, min(n, a + ch)


def _randn(torch, shape, dtype):
    t = torch.empty(shape, dtype=dtype, device="cuda")
    flat = t.view(-1)
    for a, b in _chunks(flat.numel()):
        flat[a:b].normal_()
    return t


def _pack(torch, bits):
    """int64 mask words of a bool vector (bit i % 32 of word i // 32), as the uint32 values."""
    n = bits.numel()
    pad = (-n) % 32
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    w = bits.view(-1, 32).to(torch.int64) << torch.arange(32, device=bits.device, dtype=torch.int64)
    return w.sum(1)


def _assert_mask(torch, mask, y_flat, what: str, base: int = 0) -> None:
    """mask words [base/32 ...] == pack(y_flat > 0), chunk by chunk (base: element offset of y_flat)."""
    assert base % 32 == 0
    for a, b in _chunks(y_flat.numel()):
        ref = _pack(torch, y_flat[a:b] > 0)
        w0 = (base + a) // 32
        got = mask[w0: w0 + ref.numel()].to(torch.int64) & 0xFFFFFFFF
        assert torch.equal(got, ref), f"{what}: mask words from {w0} differ"


def _rel(torch, got, ref) -> float:
    got, ref = got.double(), ref.double()
    return float(torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))


# ============================================================================================== relu
def test_relu_mask_and_backward_past_2_31(torch):
    need_gb(torch, 16)
    n = BIG + 37                                 # odd tail: n % 8 = 5, n % 32 = 5
    y = _randn(torch, (n,), torch.float16)
    for off in (0, 1):                           # 1: a 2-byte aligned view, the scalar path
        yv = y[off:]
        mask = igemm.relu_mask(yv)
        torch.cuda.synchronize()
        assert mask.numel() == (yv.numel() + 31) // 32
        _assert_mask(torch, mask, yv, f"relu_mask offset {off}")
        last = yv.numel() % 32
        if last:
            assert int(mask[-1]) & ~((1 << last) - 1) & 0xFFFFFFFF == 0, "bits past the end"
        dx = torch.empty_like(yv)
        igemm.relu_backward(yv, mask, out=dx)    # dy = y: dx = relu(y)
        torch.cuda.synchronize()
        for a, b in _chunks(yv.numel()):
            seg = yv[a:b]
            assert torch.equal(dx[a:b], torch.where(seg > 0, seg, torch.zeros_like(seg))), f"relu_backward {a}"
        del mask, dx


# ============================================================================================== index_add
@pytest.mark.parametrize("deterministic", [False, True])
def test_index_add_dim1_past_2_31(torch, deterministic):
    """x[2, 4, K] and source[2, 5, K] along dim 1, both past 2**31 elements; duplicate indices; exact
    integer values (so torch's own index_add_ is an exact reference whatever the order)."""
    need_gb(torch, 20)
    K = 2 ** 28 + 3
    x = torch.ones(2, 4, K, dtype=torch.float16, device="cuda")
    src = torch.empty(2, 5, K, dtype=torch.float16, device="cuda")
    pat = (torch.arange(K, device="cuda") % 5).to(torch.float16)
    for o in range(2):
        for j in range(5):
            src[o, j].copy_(pat + (j + o))
    index = torch.tensor([3, 0, 3, 1, 2], device="cuda")
    ref = x.clone()
    ref.index_add_(1, index, src)
    out = igemm.index_add(x, 1, index, src, deterministic=deterministic)
    torch.cuda.synchronize()
    assert out is x
    for o in range(2):
        for d in range(4):
            assert torch.equal(x[o, d], ref[o, d]), f"x[{o}, {d}]"


# ============================================================================================== prelu
@pytest.mark.parametrize("C", [24, 7])
def test_prelu_nhwc_past_2_31(torch, C):
    """Per-channel alpha on the last dim (C % 8 == 0: the row kernel; C odd: the per-element channel walk),
    forward and backward, > 2**31 elements."""
    need_gb(torch, 24)
    rows = BIG // C + 5
    x = _randn(torch, (rows, C), torch.float16)
    alpha = torch.linspace(-1, 1, C, device="cuda")
    y = igemm.prelu(x, alpha, layout="NHWC")
    torch.cuda.synchronize()
    xf, yf = x.view(-1), y.view(-1)
    a_rep = alpha.repeat(CH // C + 2)
    for a, b in _chunks(xf.numel(), (CH // C) * C):             # chunks of whole rows
        seg = xf[a:b]
        al = a_rep[: b - a]
        assert torch.equal(yf[a:b], torch.where(seg > 0, seg, (al * seg.float()).half())), f"prelu at {a}"
    del y, yf
    dy = torch.ones_like(x)
    dx, da = igemm.prelu_backward(dy, x, alpha, layout="NHWC")
    torch.cuda.synchronize()
    dxf = dx.view(-1)
    ref = torch.zeros(C, dtype=torch.float64, device="cuda")
    sabs = torch.zeros(C, dtype=torch.float64, device="cuda")
    for a, b in _chunks(xf.numel(), (CH // C) * C):
        seg = xf[a:b]
        al = a_rep[: b - a]
        assert torch.equal(dxf[a:b], torch.where(seg > 0, torch.ones_like(seg), al.half())), f"dx at {a}"
        g = torch.where(seg > 0, torch.zeros_like(seg), seg).double().view(-1, C)
        ref += g.sum(0)
        sabs += g.abs().sum(0)
    assert torch.all((da.double() - ref).abs() <= 1e-4 * sabs + 1e-3), (da, ref)


def test_prelu_scalar_past_2_31(torch):
    need_gb(torch, 12)
    n = BIG + 11
    x = _randn(torch, (n,), torch.float16)
    y = igemm.prelu(x, -0.3)
    torch.cuda.synchronize()
    a16 = float(np.float16(-0.3))
    for a, b in _chunks(n):
        seg = x[a:b]
        assert torch.equal(y[a:b], torch.where(seg > 0, seg, (a16 * seg.float()).half())), f"at {a}"


# ============================================================================================== conv2d
def _bn(torch, K, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    gamma = torch.rand(K, device="cuda", generator=g) + 0.5
    beta = torch.randn(K, device="cuda", generator=g) * 0.2
    mean = torch.randn(K, device="cuda", generator=g) * 0.2
    var = torch.rand(K, device="cuda", generator=g) + 0.5
    scale = gamma.double() / torch.sqrt(var.double() + 1e-5)
    shift = beta.double() - mean.double() * scale
    return (gamma, beta, mean, var), scale.float(), shift.float()


@pytest.mark.parametrize("layout,H", [("NHWC", 512), ("NCHW", 512), ("NCHW", 500)])
def test_conv_output_past_2_31(torch, layout, H):
    """A 1x1 conv whose output has 64*512*512*160 = 2.7e9 elements (N*P*Q = 2**24), with BN and the fused
    ReLU mask (whose bit offsets pass 2**31 too). NCHW at 500x500 (P*Q % 32 == 16): the mask stored by bytes,
    at byte offsets past 2**28."""
    need_gb(torch, 20)
    N, C, K = 64, 8, 160
    xs = (N, H, H, C) if layout == "NHWC" else (N, C, H, H)
    ws = (K, 1, 1, C) if layout == "NHWC" else (K, C, 1, 1)
    x = _randn(torch, xs, torch.float16)
    w = (torch.randn(ws, device="cuda") / np.sqrt(C)).half()
    V, scale, shift = _bn(torch, K)
    y, mask = igemm.conv2d(x, w, layout=layout, epilogue=ep.chain(ep.BatchNorm(*V), ep.ReLU(mask=True)))
    torch.cuda.synchronize()
    assert y.numel() > BIG
    w2 = w.view(K, C).float()
    PQ = H * H
    if layout == "NHWC":
        xf, yf = x.view(-1, C), y.view(-1, K)
        rows = CH // K
        for a in range(0, N * PQ, rows):
            b = min(N * PQ, a + rows)
            ref = torch.relu((xf[a:b].float() @ w2.t()) * scale + shift)
            assert _rel(torch, yf[a:b], ref) < 1e-2, f"rows {a}:{b}"
            _assert_mask(torch, mask, yf[a:b].reshape(-1), f"rows {a}", base=a * K)
    else:
        for n in range(N):
            ref = torch.relu((w2 @ x[n].view(C, PQ).float()) * scale[:, None] + shift[:, None])
            yn = y[n].view(K, PQ)
            assert _rel(torch, yn, ref) < 1e-2, f"image {n}"
            _assert_mask(torch, mask, yn.reshape(-1), f"image {n}", base=n * K * PQ)


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_conv_input_past_2_31(torch, layout):
    """x of 64*512*512*136 = 2.3e9 elements (4.6 GB: offsets past 2**31 bytes and elements), 1x1 to 8 channels."""
    need_gb(torch, 16)
    N, H, C, K = 64, 512, 136, 8
    xs = (N, H, H, C) if layout == "NHWC" else (N, C, H, H)
    ws = (K, 1, 1, C) if layout == "NHWC" else (K, C, 1, 1)
    x = _randn(torch, xs, torch.float16)
    w = (torch.randn(ws, device="cuda") / np.sqrt(C)).half()
    y = igemm.conv2d(x, w, layout=layout)
    torch.cuda.synchronize()
    assert x.numel() > BIG
    w2 = w.view(K, C).float()
    PQ = H * H
    if layout == "NHWC":
        xf, yf = x.view(-1, C), y.view(-1, K)
        rows = CH // C
        for a in range(0, N * PQ, rows):
            b = min(N * PQ, a + rows)
            assert _rel(torch, yf[a:b], xf[a:b].float() @ w2.t()) < 1e-2, f"rows {a}:{b}"
    else:
        for n in range(N):
            assert _rel(torch, y[n].view(K, PQ), w2 @ x[n].view(C, PQ).float()) < 1e-2, f"image {n}"


def test_conv_index_limits_raise_before_launch(torch):
    """N*P*Q >= 2**31 output pixels, and one image of >= 2**31 elements: NotImplementedError, out untouched."""
    need_gb(torch, 12)
    x = torch.zeros(2, 1, 2 ** 15, 2 ** 15, dtype=torch.float16, device="cuda")        # N*P*Q = 2**31
    w = torch.ones(1, 1, 1, 1, dtype=torch.float16, device="cuda")
    out = torch.full_like(x, float("nan"))
    with pytest.raises(NotImplementedError, match=r"2\*\*31"):
        igemm.conv2d(x, w, out=out)
    torch.cuda.synchronize()
    assert bool(torch.isnan(out).all())
    del x, out
    gc.collect()
    torch.cuda.empty_cache()
    x = torch.zeros(1, 32769, 256, 256, dtype=torch.float16, device="cuda")           # 2**31 + 2**16 per image
    w = torch.ones(1, 32769, 1, 1, dtype=torch.float16, device="cuda")
    with pytest.raises(NotImplementedError, match="per image"):
        igemm.conv2d(x, w, stride=256)
    torch.cuda.synchronize()


# ============================================================================================== BatchNorm
def _stats_ref(torch, x, layout):
    """Per-channel (mean, biased var, count, sum |x|, sum x^2) in float64: chunk statistics merged with Chan."""
    C = x.shape[1] if layout == "NCHW" else x.shape[-1]
    parts = [[] for _ in range(C)]
    if layout == "NCHW":
        for i in range(x.shape[0]):
            for c in range(C):
                plane = x[i, c].reshape(-1)
                for a, b in _chunks(plane.numel()):
                    seg = plane[a:b].double()
                    v, m = torch.var_mean(seg, unbiased=False)
                    parts[c].append((b - a, float(m), float(v) * (b - a), float(seg.abs().sum())))
    else:
        rows = x.view(-1, C)
        step = CH // C
        for a in range(0, rows.shape[0], step):
            seg = rows[a: a + step].double()
            v, m = torch.var_mean(seg, dim=0, unbiased=False)
            sa = seg.abs().sum(0)
            nb = seg.shape[0]
            for c, (mc, vc, sc) in enumerate(zip(m.tolist(), v.tolist(), sa.tolist())):
                parts[c].append((nb, mc, vc * nb, sc))
    out = []
    for c in range(C):
        n = m = q = s = 0.0
        for nb, mb, qb, sb in parts[c]:
            tot = n + nb
            d = mb - m
            m += d * nb / tot
            q += qb + d * d * n * nb / tot
            n = tot
            s += sb
        out.append((m, q / n, n, s))
    m, v, n, s = (torch.tensor(col, dtype=torch.float64, device="cuda") for col in zip(*out))
    return m, v, n, s


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_bn_stats_past_2_31(torch, layout):
    """welford / batch_norm_stats / batch_norm_backward_reduce over > 2**31 elements (a billion per channel
    for NCHW), and batch_norm_relu's output and mask (NCHW)."""
    need_gb(torch, 20)
    if layout == "NCHW":
        x = _randn(torch, (4, 2, 2 ** 28 + 5), torch.float16)
        x[:, 1].mul_(0.5).add_(3.0)
    else:
        x = _randn(torch, (2 ** 26 + 3, 32), torch.float16)
        x.mul_(torch.linspace(0.5, 2, 32, device="cuda").half()).add_(torch.linspace(-2, 2, 32, device="cuda").half())
    assert x.numel() > BIG
    C = x.shape[1] if layout == "NCHW" else x.shape[-1]
    rm, rv, rn, sabs = _stats_ref(torch, x, layout)
    outs = tuple(torch.empty(C, dtype=torch.float64, device="cuda") for _ in range(3))
    m, v, n = igemm.welford(x, layout, out=outs)
    torch.cuda.synchronize()
    assert torch.equal(n, rn), (n, rn)
    scale = rm.abs() + rv.sqrt()
    assert torch.all((m - rm).abs() <= 1e-4 * scale), (m, rm)
    assert torch.all((v - rv).abs() <= 1e-4 * rv), (v, rv)
    mean, invstd = igemm.batch_norm_stats(x, 1e-5, layout)
    assert torch.all((mean.double() - rm).abs() <= 1e-4 * scale)
    assert torch.all(((invstd.double() - 1 / torch.sqrt(rv + 1e-5)) / invstd.double()).abs() <= 1e-4)
    # backward sums with dy = x: sum_dy = sum x, sum_dy_xmu = sum x * (x - mean)
    sdy, sdx, _, _ = igemm.batch_norm_backward_reduce(x, x, mean, invstd, layout=layout)
    torch.cuda.synchronize()
    mk = mean.double()
    ref_sdx = (rv + (rm - mk) * rm) * rn                 # sum x (x - mk) = n var + n mean (mean - mk)
    bound = rn * (rv + rm * rm) + mk.abs() * sabs         # >= sum |x (x - mk)|
    assert torch.all((sdy.double() - rm * rn).abs() <= 1e-4 * sabs), (sdy, rm * rn)
    assert torch.all((sdx.double() - ref_sdx).abs() <= 1e-4 * bound), (sdx, ref_sdx)
    if layout == "NCHW":
        g = torch.tensor([1.5, 0.5], device="cuda")
        b = torch.tensor([0.1, -0.2], device="cuda")
        y, mask = igemm.batch_norm_relu(x, mean, invstd, g, b, layout=layout)
        torch.cuda.synchronize()
        HW = x.shape[2]
        for i in range(x.shape[0]):
            for c in range(C):
                xs, ys = x[i, c], y[i, c]
                ref = torch.relu((xs.float() - mean[c]) * (invstd[c] * g[c]) + b[c])
                assert _rel(torch, ys, ref) < 1e-2, f"batch_norm_relu plane {i, c}"
        _assert_mask(torch, mask, y.view(-1), "batch_norm_relu mask")
        assert y.numel() == 4 * 2 * HW
