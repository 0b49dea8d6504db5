"""Training through igemm: the autograd formulas of ``torch.ops.igemm.conv2d`` and ``igemm.nn.conv2d_bn_train``, the
training-mode modules (batch statistics, running statistics as ``BatchNorm2d``), torch.compile of a training
step, and precompile of a training step's kernels. The CPU tests need only torch (CI): gradcheck in float64 on
the ops' CPU implementations. The GPU tests compare igemm's gradients with float64 ones, allowing at most twice
the error of PyTorch's own CUDA computation in the same dtype (plus a floor).

    python tests/test_train.py precompile [arch]     compiles every kernel the GPU tests launch
"""
from __future__ import annotations

import copy
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.autograd import gradcheck  # noqa: E402

import igemm.nn as inn  # noqa: E402
from igemm import Conv2dGradInputPlan, reference  # noqa: E402
from igemm.nn import _autograd  # noqa: E402

CL = torch.channels_last
TOL = {torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float32: 1e-5}


class Block(nn.Module):
    """A ResNet basic block: conv-BN-ReLU, conv-BN, + identity (or a strided 1x1 conv-BN), ReLU."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))) + identity)


def small_resnet(classes=10):
    return nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), Block(16, 16),
                         Block(16, 32, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))


def _rel(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


# ------------------------------------------------------------------------------------------------ CPU
def test_ops_are_registered_with_fake_and_autograd():
    for name in ("conv2d", "conv2d_backward", "conv2d_bn_train", "conv2d_bn_train_backward"):
        op = getattr(torch.ops.igemm, name).default
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("igemm::conv2d", "Autograd")   # (the training op: an
    # autograd.Function, since it mutates the running statistics)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(2, 8, 9, 9).contiguous(memory_format=CL)
        y, z, mask, mean, invstd, count = inn.conv2d_bn_train(x, torch.empty(4, 8, 3, 3), stride=(2, 2),
                                                              padding=(1, 1))
        assert y.shape == z.shape == (2, 4, 5, 5) and y.is_contiguous(memory_format=CL)
        assert mask.shape == ((2 * 4 * 25 + 31) // 32,) and mask.dtype == torch.int32 and mean.shape == (4,)
        assert count.shape == (0,)                # (no process group: the count is this batch's)


@pytest.mark.parametrize("fmt", [torch.contiguous_format, CL])
def test_mask_packing_matches_igemms_format(fmt):
    torch.manual_seed(0)
    bits = (torch.randn(3, 5, 4, 7) > 0).contiguous(memory_format=fmt)
    mem = bits.permute(0, 2, 3, 1) if fmt == CL else bits
    want = reference.pack_mask(mem.numpy()).view(np.int32)
    m = _autograd.pack_mask(bits)
    assert np.array_equal(m.numpy(), want)
    assert torch.equal(_autograd.unpack_mask(m, bits), bits)


@pytest.mark.parametrize("fmt", [torch.contiguous_format, CL])
@pytest.mark.parametrize("relu,residual", [(False, False), (True, False), (True, True), (False, True)])
def test_train_op_gradcheck_float64(fmt, relu, residual):
    torch.manual_seed(1)
    d = torch.float64
    x = torch.randn(2, 3, 7, 6, dtype=d).contiguous(memory_format=fmt).requires_grad_()
    w = torch.randn(4, 3, 3, 3, dtype=d, requires_grad=True)
    g, b = (torch.rand(4, dtype=d) + 0.5).requires_grad_(), torch.randn(4, dtype=d, requires_grad=True)
    r = torch.randn(2, 4, 4, 6, dtype=d).contiguous(memory_format=fmt).requires_grad_() if residual else None
    f = lambda x, w, g, b, r: inn.conv2d_bn_train(x, w, g, b, 1e-5, r, (2, 1), (1, 1), (1, 1), relu)[0]  # noqa: E731
    assert gradcheck(f, (x, w, g, b, r))


@pytest.mark.parametrize("fmt", [torch.contiguous_format, CL])
@pytest.mark.parametrize("relu,residual,bn", [(False, False, False), (True, True, True), (True, False, True)])
def test_conv2d_op_gradcheck_float64(fmt, relu, residual, bn):
    """Every input of the fused inference op has its gradient: x, w, bias, BN's four vectors, the residual."""
    torch.manual_seed(2)
    d = torch.float64
    x = torch.randn(2, 3, 6, 5, dtype=d).contiguous(memory_format=fmt).requires_grad_()
    w = torch.randn(4, 3, 3, 3, dtype=d, requires_grad=True)
    bias = torch.randn(4, dtype=d, requires_grad=True)
    vecs = [torch.rand(4, dtype=d) + 0.5, torch.randn(4, dtype=d), torch.randn(4, dtype=d),
            torch.rand(4, dtype=d) + 0.5] if bn else [None] * 4
    vecs = [v.requires_grad_() if v is not None else None for v in vecs]
    r = torch.randn(2, 4, 3, 5, dtype=d).contiguous(memory_format=fmt).requires_grad_() if residual else None
    f = lambda x, w, bias, g, b, m, v, r: inn.conv2d(x, w, bias, g, b, m, v, 1e-5, r, (2, 1), (1, 1), (1, 1),  # noqa
                                                     relu)
    assert gradcheck(f, (x, w, bias, *vecs, r))


@pytest.mark.parametrize("fmt", [torch.contiguous_format, CL])
@pytest.mark.parametrize("channels", [1, 5])
def test_prelu_and_index_add_ops_gradcheck_float64(fmt, channels):
    torch.manual_seed(9)
    d = torch.float64
    x = torch.randn(2, 5, 4, 3, dtype=d).contiguous(memory_format=fmt).requires_grad_()
    w = (torch.rand(channels, dtype=d) * 0.5).requires_grad_()
    assert gradcheck(inn.prelu, (x, w))
    assert torch.equal(inn.prelu(x, w), torch.nn.functional.prelu(x, w))
    src = torch.randn(2, 3, 4, 3, dtype=d, requires_grad=True)
    idx = torch.tensor([4, 0, 4])
    assert gradcheck(lambda x, s: inn.index_add(x, 1, idx, s, 0.5), (x, src))
    assert torch.equal(inn.index_add(x, 1, idx, src, 0.5), torch.index_add(x, 1, idx, src, alpha=0.5))


def _train_pair(dtype=torch.float64, fmt=torch.contiguous_format, device="cpu", setup=None):
    """(igemm model, PyTorch model, the igemm model's parameters and buffers in the PyTorch model's order)."""
    torch.manual_seed(3)
    ref = small_resnet().to(device=device, dtype=dtype).to(memory_format=fmt)
    if setup is not None:
        setup(ref)
    twin = copy.deepcopy(ref)
    params, buffers = list(twin.parameters()), list(twin.buffers())      # (the converted model shares them)
    return inn.convert(twin, inplace=True).train(), ref.train(), params, buffers


@pytest.mark.parametrize("momentum,track", [(0.1, True), (None, True), (0.3, False)])
def test_modules_train_as_pytorch_float64(momentum, track):
    """Outputs, every gradient and BatchNorm's buffers after three steps equal PyTorch's (float64, CPU)."""
    def setup(m):
        for bn in m.modules():
            if isinstance(bn, nn.BatchNorm2d):
                bn.momentum, bn.track_running_stats = momentum, track
                if not track:
                    bn.running_mean = bn.running_var = bn.num_batches_tracked = None

    ig, ref, params, buffers = _train_pair(setup=setup)
    for _ in range(3):
        x = torch.randn(4, 3, 12, 12, dtype=torch.float64)
        y1, y2 = ig(x), ref(x)
        assert _rel(y1, y2) < 1e-12
        y1.square().sum().backward()
        y2.square().sum().backward()
    for (name, b), a in zip(ref.named_parameters(), params):
        assert _rel(a.grad, b.grad) < 1e-12, name
    for (name, b), a in zip(ref.named_buffers(), buffers):
        assert torch.equal(a, b) if not a.is_floating_point() else _rel(a, b) < 1e-12, name
    assert len(buffers) == (18 if track else 0)          # (six BatchNorms)
    ig.eval(), ref.eval()
    assert _rel(ig(x), ref(x)) < 1e-12


def test_compile_fullgraph_training_step_on_the_cpu():
    """torch.compile(fullgraph=True) traces the training ops (forward, autograd, running statistics)."""
    ig, ref, params, buffers = _train_pair(torch.float32)
    x = torch.randn(4, 3, 12, 12)
    y1, y2 = torch.compile(ig, fullgraph=True)(x), ref(x)
    assert _rel(y1, y2) < 1e-5
    y1.sum().backward(), y2.sum().backward()
    for a, b in zip(params, ref.parameters()):
        assert _rel(a.grad, b.grad) < 1e-4
    for a, b in zip(buffers, ref.buffers()):
        assert torch.equal(a, b) if not a.is_floating_point() else _rel(a, b) < 1e-5


def test_precompile_of_a_training_model_records_its_backward(monkeypatch):
    from igemm import _build
    from igemm.nn import _ops
    ig = _train_pair(torch.float16, CL)[0]
    x = torch.randn(4, 3, 12, 12).half().contiguous(memory_format=CL)
    seen = []
    monkeypatch.setattr(_build, "compile_many", lambda items, arch, jobs=None: seen.append(list(items)) or 0)
    before = [b.clone() for b in ig.buffers()]
    inn.precompile(ig, x, arch="sm_90a", sms=132)
    assert all(torch.equal(a, b) for a, b in zip(ig.buffers(), before))      # (num_batches_tracked not counted)
    inn.precompile(ig.eval(), x, arch="sm_90a", sms=132)
    train, infer = ({n for n, _ in s} for s in seen)
    assert len(infer) < len(train) and any(n.startswith("grad_copy") for n in train)
    dgrad = Conv2dGradInputPlan((4, 12, 12, 16), (16, 3, 3, 16), "float16", "NHWC", 1, 1, mask=True,
                                prologue=True, device="numpy", arch="sm_90a", sms=132)
    assert all(sub.kernel()[0] in train for sub in dgrad.sub_plans())
    assert _ops._recording is None


@pytest.fixture
def cuda_path_on_numpy(monkeypatch, numpy_backend):
    """The ops' CUDA implementations run on CPU tensors: igemm's functions on the numpy backend (torch CPU tensors
    passed as numpy views, results back as tensors) and PyTorch's conv for the forward kernel."""
    import igemm
    from igemm.conv._backward_plan import GradPrologue
    from igemm.nn import _ops

    def to_np(a):
        if isinstance(a, GradPrologue):
            return GradPrologue(*(to_np(getattr(a, k)) for k in ("z", "coef", "grad_weight", "grad_bias")))
        return a.numpy() if isinstance(a, torch.Tensor) else a

    def to_torch(a):
        if isinstance(a, tuple):
            return tuple(to_torch(v) for v in a)
        if isinstance(a, GradPrologue):
            return GradPrologue(*(to_torch(getattr(a, k)) for k in ("z", "coef", "grad_weight", "grad_bias")))
        return torch.from_numpy(a.view(np.int32) if a.dtype == np.uint32 else a) if isinstance(a, np.ndarray) else a

    for name in ("batch_norm_stats", "batch_norm_relu", "batch_norm_elemt", "conv2d_grad_input", "conv2d_grad_weight",
                 "conv2d_backward", "conv2d_bn_backward", "conv2d_grad_prologue", "relu_backward", "relu_mask",
                 "sync_batch_norm_stats", "sync_batch_norm_backward_reduce"):
        f = getattr(igemm, name)
        monkeypatch.setattr(igemm, name, lambda *a, f=f, **k: to_torch(f(*map(to_np, a),
                                                                          **{n: to_np(v) for n, v in k.items()})))
    monkeypatch.setattr(_ops, "supported", lambda x, w: True)
    monkeypatch.setattr(_ops, "_conv2d_cuda", _ops._conv2d_torch)


@pytest.mark.parametrize("fmt", [torch.contiguous_format, CL])
@pytest.mark.parametrize("relu,residual,sync", [(True, True, False), (False, False, False), (True, False, True),
                                                (False, True, True)])
def test_cuda_implementations_match_the_cpu_ones(cuda_path_on_numpy, fmt, relu, residual, sync):
    """The CUDA implementations' steps (statistics with the running update, BN-ReLU and its mask, the prologue,
    dgrad and wgrad through the mask and prologue, the inference op's scale folded into w and dw), run through
    igemm's numpy backend, equal the CPU implementations (fp32). ``sync``: the SyncBatchNorm path (igemm's sync
    functions, one process; the coefficients from the synced sums and count)."""
    from igemm.nn import _autograd, _train_ops
    torch.manual_seed(6)
    x = torch.randn(2, 8, 7, 6).contiguous(memory_format=fmt)
    w, g, b = torch.randn(16, 8, 3, 3), torch.rand(16) + 0.5, torch.randn(16)
    r = torch.randn(2, 16, 4, 6).contiguous(memory_format=fmt) if residual else None
    geo = ([2, 1], [1, 1], [1, 1])
    rv = torch.rand(16) + 0.5
    run = {k: (torch.zeros(16), rv.clone()) for k in ("cuda", "cpu")}
    group = _train_ops.group_id(None) if sync else 0
    got = _train_ops._forward_cuda(x, w, g, b, *run["cuda"], 0.1, 1e-5, r, *geo, relu, group)
    want = _train_ops._forward_torch(x, w, g, b, *run["cpu"], 0.1, 1e-5, r, *geo, relu)
    assert got[0].is_contiguous(memory_format=fmt)
    assert torch.equal(got[2], want[2])                                   # the mask, bit for bit
    assert got[5].shape == ((16,) if sync else (0,)) and (not sync or torch.all(got[5] == 2 * 4 * 6))
    for a, e in [*zip(got[:2] + got[3:5], want[:2] + want[3:5]), *zip(run["cuda"], run["cpu"])]:
        assert _rel(a, e) < 1e-6
    dy, (y, z, mask, mean, invstd, count) = torch.randn_like(want[0]), want
    args = (dy, x, w, z, mask, mean, invstd)
    rest = (g, *geo, relu, residual, [True] * 4)
    for a, e in zip(_train_ops._backward_cuda(*args, got[5], *rest, group), _train_ops._backward_torch(*args, count,
                                                                                                        *rest)):
        assert a.shape == e.shape and (a.numel() == 0 or _rel(a, e) < 1e-6)
    y = torch.relu(torch.randn_like(want[0])) if relu else None
    args = (dy, x, w, y, torch.rand(16) + 0.5, *geo, [True, True])
    for a, e in zip(_autograd._backward_cuda(*args), _autograd._backward_torch(*args)):
        assert _rel(a, e) < 1e-6


def test_train_op_bad_arguments_raise_named_before_anything_changes():
    x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    rm, rv = torch.zeros(4), torch.ones(4)
    cases = [(dict(bn_weight=torch.ones(5)), ValueError, "bn_weight"),
             (dict(bn_bias=torch.ones(3)), ValueError, "bn_bias"),
             (dict(residual=torch.randn(2, 4, 5, 5)), ValueError, "residual"),
             (dict(stride=(0, 1)), ValueError, "stride"),
             (dict(padding=(-1, 0)), ValueError, "padding")]
    for kw, err, name in cases:
        with pytest.raises(err, match=name):
            inn.conv2d_bn_train(x, w, running_mean=rm, running_var=rv, **kw)
        assert torch.equal(rm, torch.zeros(4)) and torch.equal(rv, torch.ones(4))
    with pytest.raises(NotImplementedError, match="groups=1"):
        inn.conv2d_bn_train(x, torch.randn(4, 1, 3, 3))
    with pytest.raises(ValueError, match="x: expected a 4-D"):
        inn.conv2d_bn_train(x[0], w)


def test_convert_sync_bn_without_distributed_trains_as_batchnorm():
    """``convert(model, sync_bn=None)`` makes the BatchNorms SyncBatchNorms; with no process group initialised
    (or one rank) they train on the local batch, as PyTorch's SyncBatchNorm does: outputs, gradients and
    buffers equal the BatchNorm model's (float64)."""
    from igemm.nn import _modules
    torch.manual_seed(3)
    ref = small_resnet().double().train()
    twin = copy.deepcopy(ref)
    params, buffers = list(twin.parameters()), list(twin.buffers())
    ig = inn.convert(twin, inplace=True, sync_bn=None).train()
    fused = [m for m in ig.modules() if isinstance(m, _modules._ConvBN)]
    assert len(fused) == 6 and all(isinstance(m.bn, nn.SyncBatchNorm) for m in fused)
    assert all(_modules._sync_group(m.bn) is False for m in fused)
    x = torch.randn(4, 3, 12, 12, dtype=torch.float64)
    y1, y2 = ig(x), ref(x)
    assert _rel(y1, y2) < 1e-12
    y1.square().sum().backward()
    y2.square().sum().backward()
    for a, (name, b) in zip(params, ref.named_parameters()):
        assert _rel(a.grad, b.grad) < 1e-12, name
    for a, b in zip(buffers, ref.buffers()):
        assert _rel(a.double(), b.double()) < 1e-12


def test_a_conv_bias_before_training_batchnorm_runs_pytorch_and_says_so():
    from igemm.nn import _modules
    _modules._warned.clear()
    conv, bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
    m = inn.Conv2dBNReLU(conv, bn).train()
    with pytest.warns(UserWarning, match="conv bias before a training-mode BatchNorm"):
        y = m(torch.randn(2, 3, 8, 8))
    y.sum().backward()
    assert conv.bias.grad is not None


# ------------------------------------------------------------------------------------------------ GPU
def _problem(seed, dtype, fmt, relu, residual, stride):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 24, 14, 13, generator=g)
    w = torch.randn(40, 24, 3, 3, generator=g) / 15
    gamma, beta = torch.rand(40, generator=g) + 0.5, torch.randn(40, generator=g)
    P, Q = (14 - 1) // stride + 1, (13 - 1) // stride + 1
    r = torch.randn(4, 40, P, Q, generator=g) if residual else None
    dy = torch.randn(4, 40, P, Q, generator=g)
    return x, w, gamma, beta, r, dy


CASES = [(dt, fmt, relu, res, st) for dt in (torch.float16, torch.bfloat16, torch.float32) for fmt in ("NCHW", "CL")
         for relu, res, st in ((True, False, 1), (True, True, 2), (False, False, 1))]


def _grads(fn, inputs, dy):
    ins = [t.detach().requires_grad_() if t is not None else None for t in inputs]
    y = fn(*ins)
    y.backward(dy)
    return y.detach(), [t.grad if t is not None else None for t in ins]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,fmt,relu,residual,stride", CASES)
def test_gpu_train_op_gradients(dtype, fmt, relu, residual, stride):
    """y, dx, dw, dgamma, dbeta, d_residual of conv -> BN (batch statistics) [+ residual] [-> ReLU] against
    float64; the error at most twice PyTorch's (cuDNN + BN in the same dtype) plus TOL."""
    mf = CL if fmt == "CL" else torch.contiguous_format
    x, w, gamma, beta, r, dy = _problem(len(fmt) + stride + relu * 3, dtype, fmt, relu, residual, stride)

    def run(device, dt, impl):
        c = lambda t: None if t is None else t.to(device=device, dtype=dt).contiguous(memory_format=mf) \
            if t.dim() == 4 else t.to(device=device, dtype=torch.float64 if dt == torch.float64 else torch.float32)
        return _grads(impl, [c(x), c(w), c(gamma), c(beta), c(r)], c(dy))

    ours = lambda x, w, g, b, r: inn.conv2d_bn_train(x, w, g, b, 1e-5, r, (stride,) * 2, (1, 1), (1, 1), relu)[0]

    def torch_chain(x, w, g, b, r):
        y = torch.nn.functional.batch_norm(torch.nn.functional.conv2d(x, w, None, stride, 1), None, None, g, b,
                                           True, 0.0, 1e-5)
        y = y + r if r is not None else y
        return torch.relu(y) if relu else y

    want = run("cpu", torch.float64, ours)
    got = run("cuda", dtype, ours)
    peer = run("cuda", dtype, torch_chain)
    assert got[0].is_contiguous(memory_format=mf)
    for name, a, b, p in zip(("y", "dx", "dw", "dgamma", "dbeta", "dres"), [got[0], *got[1]], [want[0], *want[1]],
                             [peer[0], *peer[1]]):
        if b is None:
            continue
        e, ep = _rel(a, b), _rel(p, b)
        assert e <= 2 * ep + TOL[dtype], f"{name}: igemm {e:.2e}, PyTorch {ep:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,fmt,relu,residual,stride", [c for c in CASES if c[0] != torch.bfloat16])
def test_gpu_conv2d_op_gradients(dtype, fmt, relu, residual, stride):
    """The inference op's backward (BN folded: dx through scale·w, dw scaled after wgrad; the ReLU as igemm's
    mask) against float64; the error at most twice PyTorch's (cuDNN and BN in the same dtype) plus TOL: a 16-bit
    forward flips the ReLU of values within rounding of zero, PyTorch's as much as igemm's."""
    mf = CL if fmt == "CL" else torch.contiguous_format
    x, w, gamma, beta, r, dy = _problem(7 + stride + relu, dtype, fmt, relu, residual, stride)
    g = torch.Generator().manual_seed(17 + stride + relu)       # (not the global generator: the same every run)
    mean, var = torch.randn(40, generator=g) * 0.1, torch.rand(40, generator=g) + 0.5

    def run(device, dt, torch_ops=False):
        c = lambda t: None if t is None else t.to(device=device, dtype=dt).contiguous(memory_format=mf)  # noqa
        v = lambda t: t.to(device=device, dtype=torch.float64 if dt == torch.float64 else torch.float32)  # noqa
        op = (lambda *a: inn._ops._conv2d_torch(*a)) if torch_ops else torch.ops.igemm.conv2d
        return _grads(lambda x, w, r: op(x, w, None, v(gamma), v(beta), v(mean), v(var), 1e-5, r, [stride] * 2,
                                         [1, 1], [1, 1], relu), [c(x), c(w), c(r)], c(dy))

    got, want, peer = run("cuda", dtype), run("cpu", torch.float64), run("cuda", dtype, torch_ops=True)
    for name, a, b, p in zip(("y", "dx", "dw", "dres"), [got[0], *got[1]], [want[0], *want[1]],
                             [peer[0], *peer[1]]):
        if b is not None:
            e, ep = _rel(a, b), _rel(p, b)
            assert e <= 2 * ep + TOL[dtype], f"{name}: igemm {e:.2e}, PyTorch {ep:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, CL])
def test_gpu_prelu_and_index_add_gradients(dtype, fmt):
    """igemm's PReLU and index_add ops (forward and backward kernels) against float64 autograd."""
    torch.manual_seed(10)
    x = torch.randn(4, 16, 9, 7).contiguous(memory_format=fmt)
    w, dy = torch.rand(16) * 0.5, torch.randn(4, 16, 9, 7)
    src, idx = torch.randn(4, 6, 9, 7), torch.tensor([3, 0, 15, 3, 7, 0])

    def run(device, dt, fn, *ins):
        ins = [t.to(device=device, dtype=dt if t.dim() == 4 else (torch.float64 if dt == torch.float64
                                                                  else torch.float32)).requires_grad_()
               for t in ins]
        y = fn(*ins)
        y.backward(dy.to(device=device, dtype=dt).contiguous(memory_format=fmt))
        return [y.detach(), *(t.grad for t in ins)]

    for fn, ins in ((inn.prelu, (x, w)), (lambda a, s: inn.index_add(a, 1, idx.to(a.device), s, 0.5), (x, src))):
        got, want = run("cuda", dtype, fn, *ins), run("cpu", torch.float64, fn, *ins)
        for a, b in zip(got, want):
            assert _rel(a, b) <= 2 * TOL[dtype]


@pytest.mark.gpu
def test_gpu_gradcheck_fp32():
    """torch.autograd.gradcheck of the training op on the GPU in fp32 (strict): finite differences in fp32,
    so a step and tolerances of 1e-2."""
    torch.manual_seed(4)
    x = torch.randn(2, 8, 6, 6, device="cuda", requires_grad=True)
    w = (torch.randn(8, 8, 3, 3, device="cuda") / 5).requires_grad_()
    g, b = (torch.rand(8, device="cuda") + 0.5).requires_grad_(), torch.randn(8, device="cuda", requires_grad=True)
    f = lambda x, w, g, b: inn.conv2d_bn_train(x, w, g, b, 1e-5, None, (1, 1), (1, 1), (1, 1), False)[0]  # noqa
    assert gradcheck(f, (x, w, g, b), eps=1e-2, atol=2e-2, rtol=2e-2, nondet_tol=1e-5)


@pytest.mark.gpu
def test_gpu_amp_training_step_matches_pytorch():
    """A small ResNet, channels_last, fp16 autocast: one step's gradients against the fp32 model's, no worse
    than twice PyTorch AMP's error (plus 1e-3); BN buffers after three steps equal PyTorch AMP's to 1e-3. Every
    layer's statistics but the stem's come from its conv's epilogue (TrainCall.conv_stats), and every layer takes the
    fp32 weight itself (TrainCall.master: dw written in fp32)."""
    from igemm.nn import _train_fast
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(5)
    ref32 = small_resnet().cuda().to(memory_format=CL).train()
    amp, twin = copy.deepcopy(ref32), copy.deepcopy(ref32)
    params, buffers = list(twin.parameters()), list(twin.buffers())
    ig = inn.convert(twin, inplace=True).train()
    x = torch.randn(16, 3, 16, 16, device="cuda").contiguous(memory_format=CL)
    t = torch.randint(0, 10, (16,), device="cuda")
    for step in range(3):
        for m, auto in ((ref32, False), (amp, True), (ig, True)):
            m.zero_grad(set_to_none=True)
            with torch.autocast("cuda", torch.float16, enabled=auto):
                loss = nn.functional.cross_entropy(m(x), t)
            loss.backward()
        if step == 0:
            for (name, c), a, b in zip(ref32.named_parameters(), params, amp.parameters()):
                assert _rel(a.grad, c.grad) <= 2 * _rel(b.grad, c.grad) + 1e-3, name
    for (name, b), a in zip(amp.named_buffers(), buffers):
        assert torch.equal(a, b) if not a.is_floating_point() else _rel(a, b) < 1e-3, name
    calls = [tc for m in ig.modules() for tc in (_train_fast._calls.get(m) or {}).values()]
    assert len(calls) == 6 and all((tc.conv_stats is None) == (tc.plan.spec().load_a == "patch") for tc in calls)
    assert all(tc.master for tc in calls)         # (fp32 weights cast per call, their gradients written in fp32)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["NCHW", "CL"])
def test_gpu_eager_path_equals_the_op_path(monkeypatch, fmt):
    """The modules' eager path (TrainCall: plans found once, pointers and launches per step) gives what the op
    path gives: outputs, every gradient, BN's buffers (fp16 autocast, three steps). The same kernels but for the
    statistics (the eager path's from the conv epilogue's tiles: another fp32 summation order), so y may differ by
    an fp16 rounding and the gradients by what that carries through three layers: 2e-3."""
    from igemm.nn import _train_fast
    mf = CL if fmt == "CL" else torch.contiguous_format
    torch.manual_seed(8)
    base = small_resnet().cuda().to(memory_format=mf).train()
    runs = []
    for eager in (True, False):
        twin = copy.deepcopy(base)
        params, buffers = list(twin.parameters()), list(twin.buffers())
        ig = inn.convert(twin, inplace=True).train()
        with monkeypatch.context() as mp:
            if not eager:
                mp.setattr(_train_fast, "train", lambda *a, **k: None)
            for step in range(3):
                x = torch.randn(8, 3, 16, 16, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
                ig.zero_grad(set_to_none=True)
                with torch.autocast("cuda", torch.float16):
                    y = ig(x.contiguous(memory_format=mf))
                y.float().square().sum().backward()
        runs.append((y.detach(), [p.grad for p in params], [b.clone() for b in buffers]))
        if eager:
            assert sum(tc is not None for per in _train_fast._calls.values() for tc in per.values()) >= 6
    (ye, ge, be), (yo, go, bo) = runs
    assert _rel(ye, yo) < 1e-3
    for a, b in zip(ge + be, go + bo):
        assert _rel(a, b) < 2e-3


@pytest.mark.gpu
def test_gpu_identity_gradient_added_by_dgrad(monkeypatch):
    """The identity block's input gradient: the last layer hands the residual's gradient to the first layer, whose
    dgrad adds it as it stores (nn/_train_fast.py: _Link) -- the same bits as autograd adding the two, every other
    gradient too; the downsampling block is not linked."""
    from igemm.nn import _train_fast
    torch.manual_seed(3)
    base = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(), Block(64, 64),
                         Block(64, 128, 2)).cuda().to(memory_format=CL).train()
    x = torch.randn(4, 3, 12, 12, device="cuda").contiguous(memory_format=CL)
    runs, links = [], []
    real = _train_fast._joined
    for linked in (True, False):
        twin = copy.deepcopy(base)
        params = list(twin.parameters())
        ig = inn.convert(twin, inplace=True).train()
        with monkeypatch.context() as mp:
            mp.setattr(_train_fast, "_joined", (lambda *a: links.append(real(*a)) or links[-1]) if linked
                       else (lambda *a: None))
            with torch.autocast("cuda", torch.float16):
                y = ig(x)
            y.float().square().sum().backward()
        runs.append([p.grad for p in params])
    assert sum(ln is not None for ln in links) == 1          # the identity block only
    for a, b in zip(*runs):
        assert torch.equal(a, b)


class _BlockDownLast(Block):
    """Block with the downsampling branch computed after the main path (torchvision's order)."""

    def forward(self, x):
        y = self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))
        return torch.relu(y + self.down(x))


@pytest.mark.gpu
def test_gpu_transient_scratch_is_the_threads():
    """The eager path's scratch (nn/_train_call.py: _transient) is reused per thread and stream, grows to the largest
    request, and is freed with its thread (a program training from short-lived threads keeps none of theirs)."""
    import gc
    import threading
    import weakref

    from igemm.nn import _train_call
    dev, h = torch.device("cuda", 0), torch.cuda.current_stream().cuda_stream
    refs = []

    def work():
        t = _train_call._transient(dev, h, 100)
        assert _train_call._transient(dev, h, 60) is t and t.numel() >= 100
        refs.append(weakref.ref(t))
        assert _train_call._transient(dev, h, 1000).numel() >= 1000
        refs.append(weakref.ref(_train_call._transient(dev, h, 1)))

    mine = _train_call._transient(dev, h, 10)
    th = threading.Thread(target=work)
    th.start()
    th.join()
    gc.collect()
    assert len(refs) == 2 and refs[0]() is None and refs[1]() is None
    assert _train_call._transient(dev, h, 10) is mine


@pytest.mark.gpu
def test_gpu_downsample_gradient_added_by_dgrad(monkeypatch):
    """A downsampling block's input gradient: of its first layer and its downsampling layer, which read the same x,
    the one whose backward runs first (the downsampling one) defers its dgrad, which the other runs after its own,
    adding into its dx as it stores (nn/_train_fast.py: _Pair; nn/_train_call.py: _Dgrad; the strided dgrad then zeroes no rows) --
    the same bits as autograd adding the two, every other gradient and the input's too; the pair is disarmed after
    the backward. With the branch computed first, convert gives the add to the downsampling conv (the first conv in
    the graph whose BN an add follows): no pair there, and the same bits again."""
    from igemm.nn import _train_fast
    torch.manual_seed(6)
    base = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), Block(32, 64, 2),
                         _BlockDownLast(64, 128, 2)).cuda().to(memory_format=CL).train()
    x = torch.randn(4, 3, 16, 16, device="cuda").contiguous(memory_format=CL)
    runs, pairs, added = [], [], []
    real, real_run = _train_fast._paired, _train_fast._Dgrad.run
    for paired in (True, False):
        twin = copy.deepcopy(base)
        params = list(twin.parameters())
        ig = inn.convert(twin, inplace=True).train()
        xi = x.clone().requires_grad_()
        with monkeypatch.context() as mp:
            mp.setattr(_train_fast, "_paired", (lambda *a: pairs.append(real(*a)) or pairs[-1]) if paired
                       else (lambda *a: None))
            mp.setattr(_train_fast._Dgrad, "run", lambda self, dx: added.append(dx is not None) or real_run(self, dx))
            with torch.autocast("cuda", torch.float16):
                y = ig(xi)
            y.float().square().sum().backward()
        runs.append([xi.grad] + [p.grad for p in params])
    assert sum(p is not None for p in pairs) == 1 and not any(p.armed or p.pending is not None for p in pairs if p)
    assert added == [True]                    # (the deferred dgrad ran once, into the other layer's dx)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["NCHW", "CL"])
def test_gpu_an_input_made_by_bn_relu_is_remade_not_kept(monkeypatch, fmt):
    """A layer whose input is another layer's ReLU(BN(z)) keeps that layer's z, not the input (its node saves no
    x), and its wgrad reads y remade from z (nn/_train_fast.py: _maker). The remade y has the bits of the
    forward's, so every gradient and buffer equals what keeping y gives (fp16 autocast)."""
    from igemm.nn import _train_fast
    mf = CL if fmt == "CL" else torch.contiguous_format
    torch.manual_seed(4)
    base = nn.Sequential(nn.Conv2d(8, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.Conv2d(32, 48, 3, 2, 1, bias=False), nn.BatchNorm2d(48), nn.ReLU(),
                         nn.Conv2d(48, 16, 1, bias=False), nn.BatchNorm2d(16, affine=False)
                         ).cuda().to(memory_format=mf).train()
    x = torch.randn(6, 8, 14, 14, device="cuda").contiguous(memory_format=mf)
    runs = []
    for remade in (True, False):
        twin = copy.deepcopy(base)
        params, buffers = list(twin.parameters()), list(twin.buffers())
        ig = inn.convert(twin, inplace=True).train()
        assert sum(isinstance(m, inn.Conv2dBNReLU) for m in ig.modules()) == 2
        with monkeypatch.context() as mp:
            if not remade:
                mp.setattr(_train_fast, "_maker", lambda x: None)
            with torch.autocast("cuda", torch.float16):
                y = ig(x)
            last = y.grad_fn                              # the 1x1 layer's node; x_fn: the layer before it
            nodes = [last, last.x_fn, last.x_fn.x_fn]
            assert all(type(n) is _train_fast._BACKWARD for n in nodes)
            assert [n.saved_tensors[0] is None for n in nodes] == [remade, remade, False]
            y.float().square().sum().backward()
        runs.append((y.detach(), [p.grad for p in params], [b.clone() for b in buffers]))
    (ya, ga, ba), (yb, gb, bb) = runs
    assert torch.equal(ya, yb)
    for i, (a, b) in enumerate(zip(ga + ba, gb + bb)):
        assert torch.equal(a, b), (i, _rel(a, b))


SUMS_X = (32, 64, 56, 56)


def _sums_chain():
    return nn.Sequential(nn.Conv2d(64, 64, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.Conv2d(64, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.Conv2d(64, 64, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.Conv2d(64, 64, 3, 2, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.Conv2d(64, 32, 1, bias=False), nn.BatchNorm2d(32))


@pytest.mark.gpu
def test_gpu_bn_sums_made_by_the_next_dgrad(monkeypatch):
    """A layer whose input is another layer's ReLU(BN(z)) has its dgrad also write that layer's BatchNorm backward
    sums over dx (nn/_train_call.py: TrainCall._sums_out), which that layer's backward adds instead of reading dy and
    z (docs/performance.md: bn-sums-in-dgrad): here through a stride-1 3x3's dgrad and a 1x1's (TMA stores), on
    tensors too large for the held backward (which takes no sums); not through the strided 3x3's. Those two dgrads
    also remake their input for wgrad (the remake kernel runs for the other two layers only). Every gradient and
    buffer is what the sums over dy and z give, to their fp32 summation order (fp16 autocast)."""
    from igemm.nn import _train_call
    torch.manual_seed(9)
    base = _sums_chain().cuda().to(memory_format=CL).train()
    x = torch.randn(*SUMS_X, device="cuda").contiguous(memory_format=CL).requires_grad_()
    runs, used, remade = [], [], []
    real, real_remake = _train_call.TrainCall._sums_kernel, _train_call.TrainCall.remake
    for fused in (True, False):
        twin = copy.deepcopy(base)
        params, buffers = list(twin.parameters()), list(twin.buffers())
        ig = inn.convert(twin, inplace=True).train()
        x.grad = None
        with monkeypatch.context() as mp:
            mp.setattr(_train_call.TrainCall, "_sums_kernel", lambda self, t: used.append(real(self, t)) or used[-1])
            mp.setattr(_train_call.TrainCall, "remake", lambda self, *a: remade.append(fused) or real_remake(self, *a))
            if not fused:
                mp.setattr(_train_call.TrainCall, "_sums_out", lambda self, before, dev: (None, None))
            with torch.autocast("cuda", torch.float16):
                y = ig(x)
            y.float().square().sum().backward()
        runs.append([x.grad] + [p.grad for p in params] + [b.clone() for b in buffers])
    assert len(used) == 2 and all(u is not None for u in used)        # (the first two layers' BatchNorms)
    assert remade.count(True) == 2 and remade.count(False) == 4
    for i, (a, b) in enumerate(zip(*runs)):
        assert _rel(a, b) < 1e-3, (i, _rel(a, b))


def _ddp(tmp_path, kind: str, bench_n: int = 0) -> list:
    """Both ranks of tests/_train_ddp_worker.py (two processes, env://): their results."""
    import os
    import socket
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NCCL_NVLS_ENABLE="0",
               PYTHONPATH=os.pathsep.join(p for p in (os.path.dirname(here), os.environ.get("PYTHONPATH", "")) if p))
    procs = [subprocess.Popen([sys.executable, os.path.join(here, "_train_ddp_worker.py"), str(tmp_path), kind,
                               str(bench_n)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


def _check_ddp(r0, r1, tol):
    """DDP with igemm's SyncBatchNorm over uneven shares (5 and 3 images) equals one process over the batch."""
    assert _rel(torch.cat([r0["out"], r1["out"]]), r0["ref_out"]) < tol
    for a, b, ref in zip(r0["grads"], r1["grads"], r0["ref_grads"]):
        assert torch.equal(a, b) and _rel(a, ref) < tol
    for a, b, ref in zip(r0["buffers"], r1["buffers"], r0["ref_buffers"]):
        assert _rel(a.double(), ref.double()) < tol and _rel(b.double(), ref.double()) < tol


def test_ddp_sync_batchnorm_on_the_cpu(tmp_path):
    """Two processes (gloo): the ops' CPU implementations sync the statistics and the backward's sums."""
    import torch.distributed as dist
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    _check_ddp(*_ddp(tmp_path, "cpu"), 1e-5)


@pytest.mark.multigpu
def test_gpu_ddp_sync_batchnorm_two_gpus(tmp_path):
    """Two GPUs (NCCL): igemm's NCCL-merged Welford statistics and synced backward sums under DDP, uneven
    batches; then a ResNet-50 AMP step beside PyTorch DDP + SyncBatchNorm (printed)."""
    pytest.importorskip("torchvision")
    r0, r1 = _ddp(tmp_path, "cuda", 64)
    _check_ddp(r0, r1, 1e-4)
    # fp16 autocast: every fused layer on the eager path, synced; the gradients equal one process's on the batch
    from igemm.nn._modules import _ConvBN
    n_fused = sum(isinstance(m, _ConvBN) for m in inn.convert(small_resnet()).modules())
    assert r0["amp_fast_sync"] == r1["amp_fast_sync"] == n_fused > 0
    for a, b, ref in zip(r0["amp_grads"], r1["amp_grads"], r0["amp_ref_grads"]):
        assert torch.equal(a, b) and _rel(a, ref) < 1e-2
    # fp32 with NCHW memory: the same path in the other layout, against the PyTorch model on the batch
    assert r0["nchw_fast_sync"] == r1["nchw_fast_sync"] == n_fused
    for a, b, ref in zip(r0["nchw_grads"], r1["nchw_grads"], r0["ref_grads"]):
        assert torch.equal(a, b) and _rel(a, ref) < 1e-4
    for r, res in enumerate((r0, r1)):
        b = res["bench"]
        print(f"rank {r}, ResNet-50 AMP DDP step at 64 images a rank: igemm {b['igemm']['ms']:.1f} ms "
              f"({b['igemm']['images_s']:.0f} images/s), PyTorch SyncBatchNorm {b['pytorch']['ms']:.1f} ms "
              f"({b['pytorch']['images_s']:.0f} images/s)")


# ------------------------------------------------------------------------------------------------ precompile
def precompile(arch: str = "sm_90a") -> int:
    """Compile the kernels the GPU tests launch (fake tensors, no GPU)."""
    n = 0
    for dtype, fmt, relu, residual, stride in CASES:
        mf = CL if fmt == "CL" else torch.contiguous_format
        x, w, gamma, beta, r, _ = (t.to(dtype).contiguous(memory_format=mf) if t is not None and t.dim() == 4
                                   else t for t in _problem(0, dtype, fmt, relu, residual, stride))
        n += inn.precompile(lambda x, w, r: inn.conv2d_bn_train(x, w, gamma, beta, 1e-5, r, (stride,) * 2, (1, 1),
                                                                (1, 1), relu),
                            x, w, r, arch=arch, sms=132, backward=True)
        n += inn.precompile(lambda x, w, r: inn.conv2d(x, w, None, gamma, beta, gamma, gamma, 1e-5, r, (stride,) * 2,
                                                       (1, 1), (1, 1), relu), x, w, r, arch=arch, sms=132,
                            backward=True)
    x = torch.randn(2, 8, 6, 6)
    n += inn.precompile(lambda x, w: inn.conv2d_bn_train(x, w, None, None, 1e-5, None, (1, 1), (1, 1), (1, 1), False),
                        x, torch.randn(8, 8, 3, 3), arch=arch, sms=132, backward=True)
    ig = inn.convert(small_resnet()).half().to(memory_format=CL).train()
    n += inn.precompile(ig, torch.randn(16, 3, 16, 16).half().contiguous(memory_format=CL), arch=arch, sms=132)
    ig = inn.convert(_sums_chain()).half().to(memory_format=CL).train()     # test_gpu_bn_sums_made_by_the_next_dgrad
    n += inn.precompile(ig, torch.randn(*SUMS_X).half().contiguous(memory_format=CL), arch=arch, sms=132)
    for mf in (CL, torch.contiguous_format):                                 # the DDP test's shares (fp32)
        ig = inn.convert(small_resnet()).to(memory_format=mf).train()
        for share in (5, 3):
            n += inn.precompile(ig, torch.randn(share, 3, 16, 16).contiguous(memory_format=mf), arch=arch, sms=132)
    return n


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "precompile":
        print(precompile(*sys.argv[2:3]), "kernels")
    else:
        print("usage: python tests/test_train.py precompile [arch]")
