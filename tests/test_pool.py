"""Pooling (igemm/pool.py, csrc/pool.cuh, igemm.nn.MaxPool2d, igemm.nn.AdaptiveAvgPool2d, igemm.nn.AvgPoolLinear): the
output geometry and where the kernels run (CPU), the modules' fallbacks and ``convert`` (CPU), the kernels'
compilation (nvcc), and on the GPU the max pool's forward and backward against PyTorch's (ties, NaN, -inf, padding,
dilation, ceil_mode, odd channel counts, each dtype), the global average pool against float64 and PyTorch's
backward, and the classifier head against float64, outputs poisoned first."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import igemm.nn as inn  # noqa: E402
from igemm import pool  # noqa: E402

#: (C, H, W, kernel, stride, padding, dilation, ceil_mode): ResNet's, PyTorch's defaults, dilation, ceil_mode, a
#: rectangular window, channel counts off the 16-byte vector (one channel a thread); the 2x2 and 3x3 windows run
#: their own forward kernels (taps unrolled), the others the generic one (both vector widths)
GEOMS = [(64, 20, 18, 3, 2, 1, 1, False), (8, 9, 9, 2, 2, 0, 1, False), (16, 11, 13, 3, 1, 1, 2, False),
         (24, 10, 7, 3, 2, 1, 1, True), (8, 12, 9, (3, 2), (2, 1), (1, 0), 1, True), (3, 9, 10, 3, 2, 1, 1, False),
         (5, 7, 6, 2, 1, 1, 1, True), (3, 9, 8, (2, 3), 1, 0, 1, False), (16, 13, 12, 4, 3, 1, 1, False)]


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def test_out_size_is_pytorchs():
    """pool.out_size gives F.max_pool2d's output extent (ceil_mode's rule included) wherever PyTorch accepts the
    geometry."""
    for n, k, s, p, d, ceil in itertools.product(range(1, 12), (1, 2, 3, 4), (1, 2, 3), (0, 1, 2), (1, 2),
                                                 (False, True)):
        if 2 * p > (k - 1) * d + 1:
            continue
        try:
            want = F.max_pool2d(torch.zeros(1, 1, n, 1), (k, 1), (s, 1), (p, 0), (d, 1), ceil).shape[2]
        except RuntimeError:                 # (an output of size < 1)
            continue
        assert pool.out_size(n, k, s, p, d, ceil) == want, (n, k, s, p, d, ceil)


def test_fits():
    ok = (2, 8, 10, 10, 5, 5, (3, 3), (1, 1), (1, 1))
    assert pool.fits("float16", *ok) is None and pool.fits("float32", *ok) is None
    assert "dtype" in pool.fits("float64", *ok)
    assert "254" in pool.fits("float16", 2, 8, 40, 40, 1, 1, (16, 16), (0, 0), (1, 1))
    assert "half" in pool.fits("float16", 2, 8, 10, 10, 5, 5, (3, 3), (2, 2), (1, 1))
    assert "empty" in pool.fits("float16", 0, 8, 10, 10, 5, 5, (3, 3), (1, 1), (1, 1))
    assert "2^31" in pool.fits("float16", 2 ** 16, 64, 256, 256, 128, 128, (3, 3), (1, 1), (1, 1))


def test_module_falls_back_off_the_kernels():
    """On the CPU, for an NCHW-contiguous tensor or with return_indices the module is torch.nn.MaxPool2d: equal
    outputs, gradients and indices; from_torch keeps every setting."""
    torch.manual_seed(0)
    ref = nn.MaxPool2d((3, 2), (2, 1), (1, 0), 2, ceil_mode=True)
    m = inn.MaxPool2d.from_torch(ref)
    assert (m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode, m.return_indices) == \
        (ref.kernel_size, ref.stride, ref.padding, ref.dilation, ref.ceil_mode, ref.return_indices)
    x = torch.randn(2, 3, 11, 9, requires_grad=True)
    y, yr = m(x), ref(x)
    assert torch.equal(y, yr)
    g = torch.randn_like(y)
    assert torch.equal(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(yr, x, g)[0])
    out, ind = inn.MaxPool2d(3, 2, 1, return_indices=True)(x)
    want, wind = F.max_pool2d(x, 3, 2, 1, return_indices=True)
    assert torch.equal(out, want) and torch.equal(ind, wind)


class _Branchy(nn.Module):
    """Does not trace (data-dependent control flow): convert walks its modules."""

    def __init__(self):
        super().__init__()
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.avg = nn.AvgPool2d(2)
        self.head = nn.AdaptiveAvgPool2d((1, 1))
        self.grid = nn.AdaptiveAvgPool2d(2)

    def forward(self, x):
        return self.head(self.pool(x)) if x.sum() > 0 else self.grid(self.avg(x))


def test_convert_replaces_max_pools_and_global_average_pools():
    """Traced or walked, each nn.MaxPool2d becomes igemm.nn.MaxPool2d and each nn.AdaptiveAvgPool2d to 1 x 1
    igemm.nn.AdaptiveAvgPool2d (other pools stay), named in the report."""
    seq = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.MaxPool2d(3, 2, 1), nn.AvgPool2d(2),
                        nn.AdaptiveAvgPool2d(2), nn.AdaptiveAvgPool2d(1))
    conv, rep = inn.convert(seq, return_report=True)
    assert rep["traced"] and rep["converted"]["1"] == "MaxPool2d" and rep["converted"]["4"] == "AdaptiveAvgPool2d"
    assert "2" not in rep["converted"] and "3" not in rep["converted"]
    assert sum(isinstance(m, inn.MaxPool2d) for m in conv.modules()) == 1
    assert sum(isinstance(m, inn.AdaptiveAvgPool2d) for m in conv.modules()) == 1
    conv, rep = inn.convert(_Branchy(), return_report=True)
    assert not rep["traced"] and rep["converted"] == {"pool": "MaxPool2d", "head": "AdaptiveAvgPool2d"}
    assert isinstance(conv.pool, inn.MaxPool2d) and type(conv.avg) is nn.AvgPool2d
    assert isinstance(conv.head, inn.AdaptiveAvgPool2d) and type(conv.grid) is nn.AdaptiveAvgPool2d
    x = torch.rand(2, 3, 8, 8)
    assert torch.equal(conv(x), _Branchy()(x))


def test_fits_avg():
    assert pool.fits_avg("float16", 2, 2048, 7, 7) is None and pool.fits_avg("float32", 1, 3, 1, 1) is None
    assert "dtype" in pool.fits_avg("float64", 2, 8, 7, 7)
    assert "empty" in pool.fits_avg("bfloat16", 2, 0, 7, 7)
    assert "2^31" in pool.fits_avg("float16", 1, 8, 2 ** 16, 2 ** 15)


def test_fits_head_and_its_shape():
    """Where the classifier head's kernel runs, and its grid: every output and channel owned by one CTA, each within
    the kernel's shared arrays (csrc/pool.cuh: kHeadOutputs, kHeadChannels), its pool's items and lanes in one pass of
    the CTA's threads where there are several lanes."""
    assert pool.fits_head("float16", 2, 2048, 7, 7, 1000) is None and pool.fits_head("bfloat16", 1, 8, 1, 1, 1) is None
    assert "dtype" in pool.fits_head("float32", 1, 2048, 7, 7, 1000)
    assert "9.0" in pool.fits_head("float16", 1, 2048, 7, 7, 1000, (8, 0))
    assert "3 images (at most 2)" in pool.fits_head("float16", 3, 2048, 7, 7, 1000)
    assert "multiple of 8" in pool.fits_head("bfloat16", 1, 2044, 7, 7, 1000)
    assert "at most 8192" in pool.fits_head("float16", 1, 8200, 7, 7, 1000)
    assert "empty" in pool.fits_head("float16", 1, 2048, 7, 7, 0)
    assert "2^31" in pool.fits_head("float16", 2, 8192, 2 ** 12, 2 ** 5, 10)
    assert pool._head_shape(1, 2048, 49, 1000, 8) == (16, 63, 256, 8)
    for N, C, HW, O in itertools.product((1, 2), (8, 24, 512, 2048, 8192), (1, 3, 49), (1, 7, 1000, 21843)):
        v = 8
        clusters, og, cs, lanes = pool._head_shape(N, C, HW, O, v)
        assert clusters * og >= O and (clusters - 1) * og < O and og <= 128
        assert cs % v == 0 and 8 * cs >= C and cs <= 1024 and 1 <= lanes <= max(1, HW)
        assert lanes == 1 or N * (cs // v) * lanes <= 256


class _Head(nn.Module):
    def __init__(self, flat):
        super().__init__()
        self.body = nn.Conv2d(3, 16, 3)
        self.avg = nn.AdaptiveAvgPool2d(1)
        self.flat = flat
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        f = self.avg(self.body(x))
        f = {"function": lambda: torch.flatten(f, 1), "method": lambda: f.flatten(1), "kwarg": lambda: torch.flatten(
            f, start_dim=1), "module": lambda: self.flat(f), "view": lambda: f.view(f.shape[0], -1)}[self.kind]()
        return self.fc(f)


@pytest.mark.parametrize("kind", ["function", "method", "kwarg", "module", "view"])
def test_convert_makes_the_classifier_head_one_module(kind):
    """A global average pool -> flatten -> nn.Linear becomes one igemm.nn.AvgPoolLinear sharing the Linear's
    parameters (the flatten as a function, a method, with start_dim, or nn.Flatten()); on the CPU its forward is
    the three modules'. A reshape by view is not matched: the pool alone is converted."""
    torch.manual_seed(0)
    model = _Head(nn.Flatten())
    model.kind = kind
    conv, rep = inn.convert(model, return_report=True)
    heads = [m for m in conv.modules() if isinstance(m, inn.AvgPoolLinear)]
    x = torch.randn(2, 3, 9, 8)
    with torch.no_grad():
        assert torch.allclose(conv(x), model(x), rtol=1e-6, atol=1e-6)
    if kind == "view":
        assert not heads and rep["converted"]["avg"] == "AdaptiveAvgPool2d" and "fc" not in rep["converted"]
        return
    (head,) = heads
    assert rep["converted"]["avg"] == rep["converted"]["fc"] == "AvgPoolLinear"
    assert head.weight is conv.fc_igemm.weight and head.in_features == 16 and head.out_features == 5
    assert not any(type(m) in (nn.Linear, inn.AdaptiveAvgPool2d, nn.Flatten) for m in conv.modules())
    assert sorted(conv.state_dict()) == ["body_igemm.bias", "body_igemm.weight", "fc_igemm.bias", "fc_igemm.weight"]


def test_convert_leaves_heads_whose_values_are_read_elsewhere():
    """The pattern needs each value read once: features returned beside the logits, a flatten to another
    start_dim, or a pool of another size keep PyTorch's modules (the pools igemm runs converted alone)."""
    class Feats(_Head):
        def forward(self, x):
            f = self.avg(self.body(x))
            return f, self.fc(torch.flatten(f, 1))

    class Grid(_Head):
        def __init__(self):
            super().__init__(None)
            self.avg, self.fc = nn.AdaptiveAvgPool2d(2), nn.Linear(64, 5)

        def forward(self, x):
            return self.fc(torch.flatten(self.avg(self.body(x)), 1))
    for model in (Feats(None), Grid()):
        model.kind = None
        conv, rep = inn.convert(model, return_report=True)
        assert not any(isinstance(m, inn.AvgPoolLinear) for m in conv.modules()) and "fc" not in rep["converted"]
        x = torch.randn(2, 3, 9, 8)
        for a, b in zip(torch.utils._pytree.tree_leaves(conv(x)), torch.utils._pytree.tree_leaves(model(x))):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_head_module_off_the_kernel_is_the_pytorch_chain():
    """On the CPU (and wherever the kernel does not run) AvgPoolLinear is adaptive_avg_pool2d -> flatten ->
    F.linear: the same output and gradients; made as nn.Linear's own (no bias too)."""
    torch.manual_seed(0)
    for bias in (True, False):
        m = inn.AvgPoolLinear(12, 7, bias=bias)
        assert m.weight.shape == (7, 12) and (m.bias is not None) == bias and "bias=" + str(bias) in repr(m)
        x = torch.randn(3, 12, 5, 4, requires_grad=True)
        y = m(x)
        yr = F.linear(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1), m.weight, m.bias)
        assert y.shape == (3, 7) and torch.equal(y, yr)
        g = torch.randn_like(y)
        got = torch.autograd.grad(y, [x, m.weight], g)
        want = torch.autograd.grad(yr, [x, m.weight], g)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_avg_module_falls_back_off_the_kernel():
    """On the CPU, for an NCHW-contiguous tensor and for an output size other than 1 x 1 the module is
    torch.nn.AdaptiveAvgPool2d: equal outputs and gradients; from_torch keeps the output size."""
    torch.manual_seed(0)
    for size in (1, (1, 1), (2, 3)):
        ref = nn.AdaptiveAvgPool2d(size)
        m = inn.AdaptiveAvgPool2d.from_torch(ref)
        assert m.output_size == ref.output_size
        x = torch.randn(2, 3, 11, 9, requires_grad=True)
        y, yr = m(x), ref(x)
        assert torch.equal(y, yr)
        g = torch.randn_like(y)
        assert torch.equal(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(yr, x, g)[0])


def test_pool_kernels_compile():
    """Every pooling kernel compiles (nvcc; CI has it)."""
    from igemm import _build
    try:
        _build.find_toolchain()
    except Exception as e:          # (no toolchain: nothing to compile with)
        pytest.skip(f"no CUDA toolchain: {e}")
    ks = pool.all_variants()
    assert len(ks) == 62 and _build.compile_many(ks, "sm_90a", 2) == 62
    assert len(pool.all_variants("sm_80")) == 58                  # (the classifier head runs in clusters: sm_90+)


def test_band_rows():
    """The band backward's rows a block: ResNet's max pool takes bands whose dy rows and taps fit the kernel's
    shared memory while the blocks fill the SMs twice; not fp32, one-channel vectors, other strides, dilation, tap
    rows off 16 bytes, or too few blocks."""
    g = lambda N, C=64, H=112, W=112, k=3, s=2, p=1, d=1: (N, C, H, W, pool.out_size(H, k, s, p, d, False),  # noqa
                                                          pool.out_size(W, k, s, p, d, False), (k, k), (s, s),
                                                          (p, p), (d, d))
    assert pool.band_rows("float16", 8, g(256), 132) == 6 and pool.band_rows("bfloat16", 8, g(32), 132) == 6
    assert pool._band_rows(112, 56, 3, 1, 6) * 56 * 64 * 3 <= pool._BAND_SMEM < pool._band_rows(112, 56, 3, 1, 8) * \
        56 * 64 * 3
    assert pool.band_rows("float16", 8, g(8), 132) == 2            # (8 x 56 blocks: more rows would not fill)
    assert pool.band_rows("float16", 8, g(1), 132) == 0
    assert pool.band_rows("float32", 4, g(256), 132) == 0 and pool.band_rows("float16", 1, g(256), 132) == 0
    assert pool.band_rows("float16", 8, g(256, s=1), 132) == 0 and pool.band_rows("float16", 8, g(256, d=2), 132) == 0
    assert pool.band_rows("float16", 8, g(256, C=8, W=13), 132) == 0        # (7 x 8 taps a dy row)
    assert pool.band_rows("float16", 8, g(256, C=1024, W=112), 132) == 0    # (one dy row past the shared memory)
    assert pool.band_rows("float16", 8, g(3, C=24, H=10, W=7), 2) == 8     # (3 images x 2 bands, the last of 2 rows)


def _input(rng, shape, dtype):
    """Small integers (ties in most windows), a few NaN, and -inf away from the border (so no window holds -inf
    alone: igemm/pool.py's one difference from PyTorch), channels-last."""
    a = rng.integers(-3, 4, shape).astype(np.float64)
    a[rng.random(shape) < 0.01] = np.nan
    inner = np.zeros(shape, bool)
    inner[..., 1:-1, 1:-1] = True
    a[inner & (rng.random(shape) < 0.02)] = -np.inf
    return torch.tensor(a, dtype=getattr(torch, dtype), device="cuda").contiguous(memory_format=torch.channels_last)


@pytest.mark.gpu
@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: "-".join(map(str, g)))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gpu_max_pool_is_pytorchs(geom, dtype, rng):
    """The kernels' y and dx equal F.max_pool2d's and autograd's through it (NaN where PyTorch's are), through the
    module and through the launches into poisoned outputs; eval without autograd keeps no taps."""
    C, H, W, k, s, p, d, ceil = geom
    torch_mod = nn.MaxPool2d(k, s, p, d, ceil_mode=ceil)
    m = inn.MaxPool2d.from_torch(torch_mod)
    x = _input(rng, (3, C, H, W), dtype).requires_grad_()
    y, yr = m(x), torch_mod(x)
    assert y.is_contiguous(memory_format=torch.channels_last) and y.grad_fn is not None
    assert "MaxPool" in type(y.grad_fn).__name__
    assert torch.equal(y.isnan(), yr.isnan()) and torch.equal(y.nan_to_num(), yr.nan_to_num())
    xf = x.detach().float()
    assert torch.isfinite(F.max_pool2d(torch.where(xf.isnan(), 0.0, xf), k, s, p, d, ceil)).all()
    g = torch.randn_like(y)
    dx, dxr = torch.autograd.grad(y, x, g)[0], torch.autograd.grad(yr, x, g)[0]
    assert torch.equal(dx, dxr)
    # the launches, outputs poisoned
    K, S, P, D = _pair(k), _pair(s), _pair(p), _pair(d)
    OH, OW = yr.shape[2:]
    geo = (3, C, H, W, OH, OW, K, S, P, D)
    yp = torch.full_like(yr, float("nan"))
    idx = torch.full((3, OH, OW, C), 0xAA, dtype=torch.uint8, device="cuda")
    h = torch.cuda.current_stream().cuda_stream
    pool.launch_forward(0, h, dtype, geo, x.data_ptr(), yp.data_ptr(), idx.data_ptr())
    assert torch.equal(yp.isnan(), yr.isnan()) and torch.equal(yp.nan_to_num(), yr.nan_to_num())
    assert int(idx.max()) < K[0] * K[1]
    dxp = torch.full_like(x, float("nan"))
    gc = g.contiguous(memory_format=torch.channels_last)
    pool.launch_backward(0, h, dtype, geo, gc.data_ptr(), idx.data_ptr(), dxp.data_ptr())
    assert torch.equal(dxp, dxr)
    # (as if on two SMs: where the band backward takes the geometry, several bands an image)
    dxp.fill_(float("nan"))
    pool.launch_backward(0, h, dtype, geo, gc.data_ptr(), idx.data_ptr(), dxp.data_ptr(), sms=2)
    assert torch.equal(dxp, dxr)
    with torch.no_grad():
        assert torch.equal(m(x).nan_to_num(), yr.nan_to_num())


#: (N, C, H, W): ResNet's head, one pixel, fp32's 4-channel vectors but not fp16's 8, one channel a thread, the
#: four-pixel loop with a remainder, a second (partial) block of channel vectors
AVG_SHAPES = [(2, 2048, 7, 7), (1, 64, 1, 1), (3, 12, 5, 9), (2, 5, 3, 4), (1, 40, 60, 61), (5, 264, 7, 7)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", AVG_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "offset"])
def test_gpu_global_avg_pool(shape, dtype, aligned, rng):
    """y against the float64 mean (relative error by dtype), through the module and through the launch into a
    poisoned output, channels-last (N, C, 1, 1); x one element off 16 bytes runs one channel a thread; dx equals
    PyTorch's backward through nn.AdaptiveAvgPool2d, channels-last as x (and with create_graph); no_grad keeps no
    graph."""
    N, C, H, W = shape
    dt = getattr(torch, dtype)
    a = torch.tensor(rng.standard_normal((N, H, W, C)) + 1.0, dtype=dt, device="cuda")
    if not aligned:
        buf = torch.empty(a.numel() + 1, dtype=dt, device="cuda")
        buf[1:] = a.reshape(-1)
        a = buf[1:].view(N, H, W, C)
    x = a.permute(0, 3, 1, 2).requires_grad_()
    assert x.is_contiguous(memory_format=torch.channels_last) and (x.data_ptr() % 16 == 0) == aligned
    ref = x.detach().double().mean((2, 3), keepdim=True)
    tol = {"float16": 1e-2, "bfloat16": 1e-2, "float32": 1e-5}[dtype]
    torch_mod = nn.AdaptiveAvgPool2d(1)
    m = inn.AdaptiveAvgPool2d.from_torch(torch_mod)
    y = m(x)
    assert y.shape == (N, C, 1, 1) and y.is_contiguous(memory_format=torch.channels_last)
    assert "AvgPool" in type(y.grad_fn).__name__
    assert float((y.detach().double() - ref).abs().max() / ref.abs().max()) < tol
    yp = torch.full((N, C, 1, 1), float("nan"), dtype=dt, device="cuda")
    pool.launch_avg_global(0, torch.cuda.current_stream().cuda_stream, dtype, N, C, H * W, x.data_ptr(),
                           yp.data_ptr())
    assert torch.equal(yp, y)
    g = torch.randn_like(y)
    dx = torch.autograd.grad(y, x, g)[0]
    dxr = torch.autograd.grad(torch_mod(x), x, g)[0]
    assert torch.equal(dx, dxr) and dx.is_contiguous(memory_format=torch.channels_last)
    dx2 = torch.autograd.grad(m(x), x, g, create_graph=True)[0]       # (differentiable: PyTorch's ops)
    assert torch.equal(dx2, dxr)
    with torch.no_grad():
        y2 = m(x)
    assert y2.grad_fn is None and torch.equal(y2, y.detach())


@pytest.mark.gpu
def test_gpu_max_pool_in_a_converted_model():
    """A converted max pool -> conv -> global average pool model: y and x's gradient as PyTorch's (the max pool
    routes exactly; the conv and the mean within fp32 rounding), channels_last; an NCHW-contiguous input runs
    torch.nn.MaxPool2d's forward."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.MaxPool2d(3, 2, 1), nn.Conv2d(64, 32, 1, bias=False), nn.AdaptiveAvgPool2d(1)).cuda()
    conv = inn.convert(base).train()
    pool_mod = next(q for q in conv.modules() if isinstance(q, inn.MaxPool2d))
    assert sum(isinstance(q, inn.AdaptiveAvgPool2d) for q in conv.modules()) == 1
    x = torch.randn(4, 64, 21, 20, device="cuda").contiguous(memory_format=torch.channels_last).requires_grad_()
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        y, yr = conv(x), base(x)
        assert torch.allclose(y, yr, rtol=1e-5, atol=1e-5)
        gx = torch.autograd.grad(y.square().sum(), x)[0]
        gr = torch.autograd.grad(yr.square().sum(), x)[0]
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    assert torch.allclose(gx, gr, rtol=1e-5, atol=1e-5) and torch.equal(gx == 0, gr == 0)
    xn = torch.randn(4, 64, 16, 16, device="cuda")        # NCHW-contiguous: torch.nn.MaxPool2d's forward
    assert torch.equal(pool_mod(xn), F.max_pool2d(xn, 3, 2, 1))


def _need_clusters():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the classifier head's kernel runs in clusters (sm_90+)")


HEAD_SHAPES = [(1, 2048, 7, 7, 1000), (2, 2048, 7, 7, 1000), (2, 512, 7, 7, 1000), (2, 64, 1, 1, 10),
               (1, 24, 5, 9, 3), (2, 8192, 2, 3, 129), (1, 128, 14, 14, 2500), (2, 40, 3, 3, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", HEAD_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_classifier_head(shape, dtype, rng):
    """AvgPoolLinear's kernel against float64 (the pool's mean rounded to the dtype as PyTorch's pool returns it,
    then the linear) through the module and through the launch into a poisoned output, with a bias and without;
    against PyTorch's pool -> flatten -> linear within the dtype's rounding; gradients wanted, more images than
    the kernel takes, fp32, autocast and an NCHW input run that chain."""
    _need_clusters()
    N, C, H, W, O = shape
    dt = getattr(torch, dtype)
    x = torch.tensor(rng.standard_normal((N, H, W, C)) + 0.5, dtype=dt, device="cuda").permute(0, 3, 1, 2)
    lin = nn.Linear(C, O).to("cuda", dt)
    m = inn.AvgPoolLinear.from_torch(lin)
    tol = 1e-2
    for bias in (True, False):
        b = lin.bias if bias else None
        pooled = x.double().mean((2, 3)).to(dt).double()
        ref = pooled @ lin.weight.double().T + (b.double() if bias else 0)
        y = torch.full((N, O), float("nan"), dtype=dt, device="cuda")
        pool.launch_avg_linear(0, torch.cuda.current_stream().cuda_stream, dtype, N, C, H * W, O, x.data_ptr(),
                               lin.weight.data_ptr(), b.data_ptr() if bias else 0, y.data_ptr())
        err = float((y.double() - ref).abs().max() / ref.abs().max())
        assert err < tol, (bias, err)
        if bias:
            with torch.no_grad():
                got = m(x)
                want = F.linear(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1), lin.weight, lin.bias)
            assert torch.equal(got, y) and got.grad_fn is None
            assert float((got.double() - want.double()).abs().max() / want.double().abs().max()) < tol
    with torch.no_grad():
        assert m._dtype(x) == dtype
        assert m._dtype(x.contiguous()) is None or C == 1 or H * W == 1
        with torch.autocast("cuda"):
            assert m._dtype(x) is None
        big = x.repeat(3, 1, 1, 1).contiguous(memory_format=torch.channels_last)
        assert m._dtype(big) is None
        m32 = inn.AvgPoolLinear.from_torch(nn.Linear(C, O).cuda().requires_grad_(False))
        assert m32._dtype(x.float()) is None
    assert m._dtype(x) is None                                  # (the weight wants its gradient)
    y = m(x)
    assert y.grad_fn is not None


@pytest.mark.gpu
def test_gpu_converted_head_checks_its_arguments_before_launching():
    """The head's kernel runs only on what it takes: a misaligned x or weight, a weight of another dtype or
    non-contiguous run PyTorch's chain (same values within rounding)."""
    _need_clusters()
    torch.manual_seed(0)
    lin = nn.Linear(64, 10).cuda().half().requires_grad_(False)
    m = inn.AvgPoolLinear.from_torch(lin)
    x = torch.randn(2, 64, 7, 7, device="cuda", dtype=torch.half).contiguous(memory_format=torch.channels_last)
    assert m._dtype(x) == "float16"
    buf = torch.empty(x.numel() + 8, device="cuda", dtype=x.dtype)
    xm = buf[1:1 + x.numel()].as_strided(x.shape, x.stride()).copy_(x)
    assert m._dtype(xm) is None and torch.allclose(m(xm), m(x), rtol=1e-2, atol=1e-3)
    m.weight = nn.Parameter(lin.weight.detach().t().contiguous().t(), requires_grad=False)
    assert m._dtype(x) is None and torch.allclose(m(x), lin(x.mean((2, 3))), rtol=1e-2, atol=1e-3)
