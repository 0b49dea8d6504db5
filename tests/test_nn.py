"""igemm.nn: the custom op (its registration, fake implementation, CPU and CUDA implementations), the modules,
``convert``, channels_last, and the PyTorch machinery around them (torch.compile, torch.export, CUDA graphs).
The CPU tests need only torch (CI); the GPU tests compare with float64 references."""
from __future__ import annotations

import copy
import functools
import pickle
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import igemm.nn as inn  # noqa: E402

from helpers import TOL, rel_err  # noqa: E402

CL = torch.channels_last


class Bottleneck(nn.Module):
    """torchvision's ResNet bottleneck, as it is written there (``out += identity``)."""

    def __init__(self, cin, mid, stride=1):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, mid * 4, 1, bias=False), nn.BatchNorm2d(mid * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != mid * 4:
            self.downsample = nn.Sequential(nn.Conv2d(cin, mid * 4, 1, stride, bias=False), nn.BatchNorm2d(mid * 4))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class Toy(nn.Module):
    """A stem (conv-BN-ReLU in a Sequential), two bottlenecks, a lone conv with bias, and what igemm leaves:
    a grouped conv, a depthwise conv, a transposed conv."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.blocks = nn.Sequential(Bottleneck(16, 8), Bottleneck(32, 8, stride=2))
        self.head = nn.Conv2d(32, 24, 3, padding="same")
        self.grouped = nn.Conv2d(24, 24, 3, padding=1, groups=4)
        self.depthwise = nn.Conv2d(24, 24, 3, padding=1, groups=24)
        self.up = nn.ConvTranspose2d(24, 8, 2, 2)

    def forward(self, x):
        return self.up(self.depthwise(self.grouped(self.head(self.blocks(self.stem(x))))))


class Net(nn.Module):
    """A small ResNet: a 7x7/2 stem, a max pool, two bottlenecks, a global average pool and a classifier."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 7, 2, 3, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.blocks = nn.Sequential(Bottleneck(16, 8), Bottleneck(32, 8, stride=2))
        self.avg = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.avg(self.blocks(self.pool(self.stem(x)))), 1))


class Untraceable(Toy):
    def forward(self, x):
        if x.sum() > 0:                      # data-dependent control flow: symbolic_trace fails
            x = x * 1.0
        return super().forward(x)


def _settle(model, x):
    """BN running statistics from one train-mode forward (no pretrained weights), then eval."""
    model.train()
    with torch.no_grad():
        model(x)
    return model.eval()


def _converted(cls, n: int, fmt=CL):
    """(a converted ``cls()`` in fp16 on the GPU in memory format ``fmt``, its fx forward -- the module calls --, an
    input of ``n`` 64x64 images)."""
    torch.manual_seed(0)
    x = torch.randn(n, 3, 64, 64)
    conv = inn.convert(_settle(cls(), x).cuda().half().to(memory_format=fmt))
    return conv, functools.partial(type(conv).forward.__wrapped__, conv), x.cuda().half().contiguous(memory_format=fmt)


def _capture(f, x):
    """(a CUDA graph of f(x), its output), f warmed up on a side stream first as torch.cuda.graph wants."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        f(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f(x)
    return graph, out


def _ref(x, w, b, bn, residual, stride, padding, dilation, relu):
    """float64 reference of the op."""
    d = lambda t: None if t is None else t.double()           # noqa: E731
    y = F.conv2d(d(x), d(w), d(b), stride, padding, dilation)
    if bn is not None:
        g, be, m, v, eps = bn
        y = F.batch_norm(y, d(m), d(v), d(g), d(be), False, 0.0, eps)
    if residual is not None:
        y = y + d(residual)
    return torch.relu(y) if relu else y


# ------------------------------------------------------------------------------------------------ CPU
def test_op_is_registered_with_a_fake_implementation():
    """The op's schema, and its fake implementation's shapes and memory format (FakeTensorMode: no data)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    assert "igemm::conv2d" in str(torch.ops.igemm.conv2d.default._schema)
    with FakeTensorMode() as mode:
        for fmt, (stride, padding, dilation) in [(torch.contiguous_format, ((1, 1), (1, 1), (1, 1))),
                                                 (CL, ((2, 2), (3, 1), (1, 2)))]:
            x = mode.from_tensor(torch.empty(2, 8, 17, 19).contiguous(memory_format=fmt))
            w = mode.from_tensor(torch.empty(16, 8, 3, 5))
            y = torch.ops.igemm.conv2d(x, w, None, None, None, None, None, 1e-5, None, list(stride), list(padding),
                                       list(dilation), True)
            want = F.conv2d(torch.empty(2, 8, 17, 19), torch.empty(16, 8, 3, 5), None, stride, padding, dilation)
            assert y.shape == want.shape
            assert y.is_contiguous(memory_format=fmt), (fmt, y.stride())


@pytest.mark.parametrize("fmt", ["NCHW", "channels_last"])
def test_cpu_op_matches_the_reference(fmt):
    """The CPU implementation (the op's semantics) against float64, every epilogue combination."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 11, 9, generator=g)
    if fmt == "channels_last":
        x = x.contiguous(memory_format=CL)
    w = torch.randn(10, 6, 3, 3, generator=g) / 5
    b = torch.randn(10, generator=g)
    bn = (torch.rand(10, generator=g) + .5, torch.randn(10, generator=g), torch.randn(10, generator=g),
          torch.rand(10, generator=g) + .5, 1e-3)
    for stride, padding, dilation in [((1, 1), (1, 1), (1, 1)), ((2, 1), (0, 2), (1, 2))]:
        N, K = 2, 10
        P = (11 + 2 * padding[0] - dilation[0] * 2 - 1) // stride[0] + 1
        Q = (9 + 2 * padding[1] - dilation[1] * 2 - 1) // stride[1] + 1
        r = torch.randn(N, K, P, Q, generator=g)
        for bias, use_bn, res, relu in [(None, False, None, False), (b, False, None, True), (None, True, None, True),
                                        (b, True, r, True), (b, True, r, False)]:
            bnv = bn if use_bn else (None,) * 4 + (1e-5,)
            y = inn.conv2d(x, w, bias, *bnv, residual=res, stride=stride, padding=padding, dilation=dilation,
                           relu=relu)
            want = _ref(x, w, bias, bn if use_bn else None, res, stride, padding, dilation, relu)
            assert rel_err(y.double().numpy(), want.numpy()) <= TOL["float32"]
            assert y.is_contiguous(memory_format=CL if fmt == "channels_last" else torch.contiguous_format)


def test_op_bad_arguments_raise_named():
    x, w = torch.randn(1, 4, 8, 8), torch.randn(8, 4, 3, 3)
    cases = [((x[0], w), {}, ValueError, "x: expected a 4-D"), ((x, w[0]), {}, ValueError, "weight: expected"),
             ((x, torch.randn(8, 2, 3, 3)), {}, NotImplementedError, "groups=1"),
             ((x, w, torch.randn(7)), {}, ValueError, "bias: expected a vector of 8"),
             ((x, w), {"bn_mean": torch.randn(8)}, ValueError, "bn_mean, bn_var"),
             ((x, w), {"residual": torch.randn(1, 8, 8, 8)}, ValueError, "residual: expected the output's shape"),
             ((x, w), {"stride": (0, 1)}, ValueError, "stride")]
    for args, kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            inn.conv2d(*args, **kw)


def _convert_report(model):
    return inn.convert(model, return_report=True)


def test_convert_rewrites_the_graph_and_keeps_outputs():
    """Traced: the stem, every bottleneck conv (the third with its add and ReLU) and the lone conv become igemm
    modules; the grouped, depthwise and transposed convs stay, named in the report. On the CPU the modules run
    PyTorch's ops, so the outputs equal the original's; the original model is untouched."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    model = _settle(Toy(), x)
    conv, rep = _convert_report(model)
    assert rep["traced"]
    kinds = rep["converted"]
    assert kinds["stem.0"] == "Conv2dBNReLU" and kinds["blocks.0.conv1"] == "Conv2dBNReLU"
    assert kinds["blocks.0.conv3"] == "Conv2dBNAddReLU" and kinds["blocks.1.conv3"] == "Conv2dBNAddReLU"
    assert kinds["blocks.1.downsample.0"] == "Conv2dBN" and kinds["head"] == "Conv2d"
    assert set(rep["left"]) == {"grouped", "depthwise", "up"}, rep["left"]
    assert len(kinds) == 10 and "converted 1 Conv2d" in str(rep)
    mods = [type(m).__name__ for m in conv.modules()]
    assert mods.count("Conv2dBNAddReLU") == 2 and "BatchNorm2d" in mods        # (inside the fused modules)
    assert not any(isinstance(m, inn.Conv2dBN) for m in model.modules())       # a copy was converted
    with torch.no_grad():
        assert torch.allclose(conv(x), model(x), rtol=1e-5, atol=1e-5)


def test_convert_walks_a_model_that_does_not_trace():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    model = _settle(Untraceable(), x)
    conv, rep = _convert_report(model)
    assert not rep["traced"] and rep["converted"]["stem.0"] == "Conv2dBNReLU"
    assert rep["converted"]["blocks.0.conv1"] == "Conv2d" and set(rep["left"]) == {"grouped", "depthwise", "up"}
    with torch.no_grad():
        assert torch.allclose(conv(x), model(x), rtol=1e-5, atol=1e-5)


def test_program_offsets_share_bytes_only_between_values_that_never_meet():
    """The launch program's workspace plan: aligned offsets; two values whose lifetimes meet never overlap; a
    chain of values (each read by the next) needs two slots."""
    from igemm.nn._program import plan_offsets
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 30))
        sizes = [int(v) for v in rng.integers(1, 5000, n)]
        starts = rng.integers(0, 20, n)
        lives = [(int(a), int(a + rng.integers(0, 6))) for a in starts]
        offs, total = plan_offsets(sizes, lives)
        assert all(o % 256 == 0 for o in offs) and total >= max(sizes)
        for i in range(n):
            assert offs[i] + sizes[i] <= total
            for j in range(i):
                if lives[i][0] <= lives[j][1] and lives[j][0] <= lives[i][1]:
                    assert offs[i] + sizes[i] <= offs[j] or offs[j] + sizes[j] <= offs[i], (i, j)
    offs, total = plan_offsets([1000] * 6, [(i, i + 1) for i in range(6)])
    assert total == 2 * 1024 and len(set(offs)) == 2


def test_program_branches_are_residual_convs_with_layers_to_run_beside():
    """A layer whose one reader adds it as the residual, reading one value with other layers between it and its
    reader, is a branch (ResNet's downsample: placed after the layer it reads, joined before the add); none where
    nothing runs beside it, where the reader takes it for more than the residual, or overlapping a kept one."""
    from igemm.nn._program import branches

    class Node:
        args: tuple = ()

    def run(spec):
        # spec: per layer (its input indices (-1: the run's input), the layer it takes as the residual or None)
        nodes = [Node() for _ in spec]
        inp = Node()
        for n, (ins, _) in zip(nodes, spec):
            n.args = tuple(inp if i < 0 else nodes[i] for i in ins)
        readers = {i: [j for j, (ins, _) in enumerate(spec) if i in ins] for i in range(len(spec))}
        return branches(nodes, lambda i: readers[i][0] if len(readers[i]) == 1 else None,
                        lambda j, i: spec[j][1] == i and spec[j][0].count(i) == 1 and spec[j][0][0] != i)
    stem = [((-1,), None)]
    assert run(stem + [((0,), None), ((1,), None), ((0,), None), ((2, 3), 3)]) == [(3, 0, 4)]
    two = stem + [((0,), None), ((1,), None), ((0,), None), ((2, 3), 3),
                  ((4,), None), ((5,), None), ((4,), None), ((6, 7), 7)]
    assert run(two) == [(3, 0, 4), (7, 4, 8)]
    assert run([((-1,), None), ((-1,), None), ((0, 1), 1)]) == [(1, -1, 2)]      # (from the input)
    assert run(stem + [((0,), None), ((0, 1), 1)]) == []                           # (nothing beside it)
    assert run(stem + [((0,), None), ((1,), None), ((0,), None), ((3, 2), 3)]) == []  # (its reader's x)
    nested = stem + [((0,), None), ((0,), None), ((0,), None), ((3,), None), ((4, 2), 2), ((5,), None),
                     ((6, 1), 1)]
    assert run(nested) == [(1, 0, 7)]          # (layer 2's branch overlaps the first: dropped)


def test_convert_installs_the_program_path_where_the_graph_was_rewritten():
    """The converted GraphModule keeps its forward's signature; on the CPU it runs the modules (no program is
    made); recompile() gives back fx's own forward."""
    import inspect
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    model = _settle(Net(), x)
    conv = inn.convert(model)
    assert str(inspect.signature(conv.forward)) == "(x)"
    with torch.no_grad():
        assert torch.allclose(conv(x), model(x), rtol=1e-5, atol=1e-5)
    assert conv._igemm_programs == {}
    conv._igemm_programs["geometry"] = object()             # (a program holds kernels: copies start without)
    dup = copy.deepcopy(conv)
    assert dup._igemm_programs == {} and hasattr(type(dup).forward, "__wrapped__")
    with torch.no_grad():
        assert torch.equal(dup(x), conv(x)) and torch.equal(pickle.loads(pickle.dumps(conv))(x), conv(x))
    conv.recompile()
    assert not hasattr(type(conv).forward, "__wrapped__")


def test_program_tail_runs_the_graph_as_fx_does():
    """What follows a program's run executes node by node as torch.fx's generated forward would (modules,
    functions, methods, attributes, a nested output), dropping each value after its last reader."""
    from igemm.nn._program import _interpret, _last_uses

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 4)
            self.register_buffer("shift", torch.randn(4))

        def forward(self, x):
            h = torch.flatten(x, 1).relu()
            y = self.fc(h) + self.shift
            return {"y": y.view(-1, 2, 2), "n": (h.sum(1), y.size(0))}
    gm = torch.fx.symbolic_trace(Head())
    x = torch.randn(3, 16, 1, 1)
    nodes = list(gm.graph.nodes)
    env = {nodes[0]: x}
    drop = _last_uses(nodes[1:-1], nodes[-1])
    got, want = _interpret(gm, nodes[1:-1], nodes[-1], env, drop), gm(x)
    assert torch.equal(got["y"], want["y"]) and torch.equal(got["n"][0], want["n"][0]) and got["n"][1] == 3
    assert set(env) == set(nodes[-1].all_input_nodes)        # (x and the others dropped after their last reader)


@pytest.mark.parametrize("model", [Toy, Net])
def test_compile_fullgraph_and_export_on_the_cpu(model):
    """torch.compile(fullgraph=True) traces the converted model with no graph break (the op is opaque, its fake
    implementation gives shapes); torch.export exports it with the op in its graph (Net: with its pools and its
    classifier head as igemm modules, which trace as PyTorch's ops)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    conv = inn.convert(_settle(model(), x))
    if model is Net:
        assert isinstance(conv.fc_igemm, inn.AvgPoolLinear)
    with torch.no_grad():
        want = conv(x)
        got = torch.compile(conv, fullgraph=True, backend="eager")(x)
        assert torch.equal(got, want)
        ep = torch.export.export(conv, (x,))
    assert "igemm.conv2d" in str(ep.graph)
    with torch.no_grad():
        assert torch.equal(ep.module()(x), want)


def test_modules_train_and_differentiate_through_igemm_ops():
    """Training mode runs the training op (no warning); eval mode with gradients wanted runs the inference op
    with its autograd formula; both equal PyTorch's modules, gradients included."""
    from igemm.nn import _modules
    _modules._warned.clear()
    conv, bn = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
    m = inn.Conv2dBNReLU(conv, bn).train()
    ref = copy.deepcopy(nn.Sequential(conv, bn, nn.ReLU()))
    x = torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        y = m(x)
        want = ref(x)
    assert not [i for i in w if "igemm.nn" in str(i.message)]
    assert torch.allclose(y, want, atol=1e-6) and torch.allclose(bn.running_var, ref[1].running_var)
    m.eval(), ref.eval()
    m(x).sum().backward()
    ref(x).sum().backward()
    assert torch.allclose(conv.weight.grad, ref[0].weight.grad, rtol=1e-4, atol=1e-5)
    assert torch.allclose(bn.weight.grad, ref[1].weight.grad, rtol=1e-4, atol=1e-5)
    with pytest.raises(TypeError, match="conv, bn"):
        inn.Conv2dBN(bn, conv)


@pytest.mark.compile
def test_precompile_compiles_what_the_forward_launches(tmp_path, monkeypatch):
    """precompile runs the converted model on fake tensors (no GPU) and compiles each distinct kernel once; the
    plans the forward would build find them in the cache."""
    from igemm import _build
    from igemm.nn import _ops
    monkeypatch.setenv("IGEMM_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    conv = inn.convert(_settle(Toy(), torch.randn(2, 3, 32, 32))).half().to(memory_format=CL)
    x = torch.randn(4, 3, 32, 32).half().contiguous(memory_format=CL)
    calls = []
    monkeypatch.setattr(_build, "compile_many", lambda items, arch, jobs=None: calls.append((list(items), arch))
                        or len({stub for _, stub in items}))
    n = inn.precompile(conv, x, arch="sm_90a", sms=132)
    (items, arch), = calls
    assert arch == "sm_90a" and 1 <= len(items) == n < 10       # ten convs, some sharing a kernel (once each)
    stem = _ops._make_plan(((4, 32, 32, 3), (16, 3, 3, 3), "float16", "NHWC", (2, 2), (1, 1), (1, 1), True, True,
                            None, True), "numpy", arch="sm_90a", sms=132)
    assert stem.kernel() in items


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gpu_op_matches_the_reference(dtype):
    """The CUDA kernel against float64: NCHW and channels_last x (weights in either format), every epilogue
    combination; the output's memory format follows x's."""
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(2)
    for N, C, H, W, K, R, stride, padding in [(2, 32, 14, 14, 64, 3, 1, 1), (3, 16, 9, 11, 32, 1, 2, 0),
                                               (1, 3, 32, 32, 16, 7, 2, 3)]:
        x = torch.randn(N, C, H, W, device="cuda", generator=g).to(dt)
        w = (torch.randn(K, C, R, R, device="cuda", generator=g) / (C * R * R) ** 0.5).to(dt)
        b = torch.randn(K, device="cuda", generator=g).to(dt)
        bn = (torch.rand(K, device="cuda") + .5, torch.randn(K, device="cuda"), torch.randn(K, device="cuda"),
              torch.rand(K, device="cuda") + .5, 1e-5)
        P = (H + 2 * padding - R) // stride + 1
        Q = (W + 2 * padding - R) // stride + 1
        r = torch.randn(N, K, P, Q, device="cuda", generator=g).to(dt)
        for fmt in (torch.contiguous_format, CL):
            xf, wf, rf = (t.contiguous(memory_format=fmt) for t in (x, w, r))
            for bias, use_bn, res, relu in [(None, False, None, False), (b, False, None, True),
                                            (None, True, None, True), (b, True, rf, True)]:
                bnv = bn if use_bn else (None,) * 4 + (1e-5,)
                y = inn.conv2d(xf, wf, bias, *bnv, residual=res, stride=(stride,) * 2, padding=(padding,) * 2,
                               relu=relu)
                want = _ref(x, w, bias, bn if use_bn else None, res, (stride,) * 2, (padding,) * 2, (1, 1), relu)
                label = (dtype, N, C, K, R, fmt, bias is not None, use_bn, res is not None, relu)
                assert y.dtype == dt and y.is_contiguous(memory_format=fmt), label
                assert rel_err(y.double().cpu().numpy(), want.cpu().numpy()) <= TOL[dtype], label


@pytest.mark.gpu
def test_gpu_channels_last_runs_one_kernel_and_sees_in_place_updates():
    """A channels_last call with a channels_last weight launches the conv kernel alone (no copy, no fold: the
    folded vectors are cached); an in-place change of a BN statistic or the weight is seen at the next call."""
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(0)
    conv, bn = nn.Conv2d(64, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64)
    x = torch.randn(8, 64, 28, 28)
    m = _settle(inn.Conv2dBNReLU(conv, bn), x).cuda().half().to(memory_format=CL)
    xc = x.cuda().half().contiguous(memory_format=CL)
    with torch.no_grad():
        y0 = m(xc)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            y1 = m(xc)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        assert len(kernels) == 1 and "igemm" in kernels[0], kernels
        assert torch.equal(y0, y1) and y1.is_contiguous(memory_format=CL)
        bn.running_mean.add_(0.5)
        y2 = m(xc)
        want = torch.relu(F.batch_norm(F.conv2d(xc.double(), m.conv.weight.double(), None, 1, 1),
                                       bn.running_mean.double(), bn.running_var.double(), bn.weight.double(),
                                       bn.bias.double(), False, 0.0, bn.eps))
        assert rel_err(y2.double().cpu().numpy(), want.cpu().numpy()) <= TOL["float16"]
        m.conv.weight.mul_(-1)
        y3 = m(xc)
        assert not torch.equal(y3, y2)


@pytest.mark.gpu
def test_gpu_module_eager_path_equals_the_op():
    """A module's eager forward (igemm called directly, no dispatcher) gives the op's bits in every case it
    handles itself (x channels_last or NCHW, the identity in x's format) and in those it hands to the op's
    general path (an identity in the other format, a misaligned x); a replaced or updated parameter is seen."""
    torch.manual_seed(0)
    conv, bn = nn.Conv2d(32, 64, 3, padding=1, bias=True), nn.BatchNorm2d(64)
    x = torch.randn(4, 32, 16, 16)
    with torch.no_grad():                   # (BN statistics of some data; the module is a block's last conv)
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 1.5)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.normal_()
    m = inn.Conv2dBNAddReLU(conv, bn).eval().cuda().half()
    c, b = m.conv, m.bn

    def op(x, r):
        return inn.conv2d(x, c.weight, c.bias, b.weight, b.bias, b.running_mean, b.running_var, b.eps, r,
                          c.stride, c.padding, c.dilation, True)
    base = torch.randn(4 * 32 * 16 * 16 + 8, device="cuda").half()
    cases = []
    for fmt in (CL, torch.contiguous_format):
        xc = x.cuda().half().contiguous(memory_format=fmt)
        for rfmt in (fmt, CL if fmt is torch.contiguous_format else torch.contiguous_format):
            cases.append((xc, torch.randn(4, 64, 16, 16, device="cuda").half().contiguous(memory_format=rfmt)))
    cases.append((base[1:1 + x.numel()].view(4, 32, 16, 16), cases[2][1]))        # misaligned NCHW x
    with torch.no_grad():
        for i, (xi, r) in enumerate(cases):
            for _ in range(2):                                                     # (the second: cached)
                got, want = m(xi, r), op(xi, r)
                assert torch.equal(got, want) and got.stride() == want.stride(), i
            ref = _ref(xi.float(), c.weight.float(), c.bias.float(),
                       (b.weight, b.bias, b.running_mean, b.running_var, b.eps), r.float(), (1, 1), (1, 1), (1, 1),
                       True)
            assert rel_err(got.double().cpu().numpy(), ref.cpu().numpy()) <= TOL["float16"], i
        y0 = m(*cases[0])
        c.weight = nn.Parameter(c.weight * 2)                                      # another object
        assert torch.equal(m(*cases[0]), op(*cases[0])) and not torch.equal(m(*cases[0]), y0)
        b.weight.mul_(0.5)                                                         # the same object, updated
        assert torch.equal(m(*cases[0]), op(*cases[0]))


@pytest.mark.gpu
def test_gpu_converted_model_compiles_exports_and_captures():
    """The converted toy model on the GPU (fp16, channels_last): eager against float64; torch.compile
    (fullgraph, inductor; mode="reduce-overhead"), torch.export and a CUDA graph replay give eager's outputs bit
    for bit. The graph
    holds the BN folded at capture (no fold kernels in it); an eager call sees a later update at once."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, 32, 32)
    model = _settle(Toy(), x)
    want = model.double()(x.double())
    model = model.float()
    conv = inn.convert(model).cuda().half().to(memory_format=CL)
    xc = x.cuda().half().contiguous(memory_format=CL)
    with torch.no_grad():
        y = conv(xc)
        assert rel_err(y.double().cpu().numpy(), want.detach().numpy()) <= 2 * TOL["float16"]
        assert torch.equal(torch.compile(conv, fullgraph=True)(xc), y)
        ro = torch.compile(conv, mode="reduce-overhead")                # (inductor's CUDA graphs)
        for _ in range(3):                                              # warm-up, record, replay
            yr = ro(xc).clone()
        assert torch.equal(yr, y)
        ep = torch.export.export(conv, (xc,))
        assert torch.equal(ep.module()(xc), y)
        static = xc.clone()
        graph, out = _capture(conv, static)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, y)
        conv.stem_0_igemm.bn.running_mean.add_(1.0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, y) and not torch.equal(conv(xc), y)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["Net-channels_last", "Toy-NCHW"])
def test_gpu_converted_model_runs_as_one_program(case, monkeypatch):
    """A converted model's eager inference forward: the first call runs the modules and makes the program, later
    calls run it -- one launch a layer, the modules' bits, a peak memory within the modules' own. An in-place
    update or a replaced parameter is seen at once (the modules run) and a program is made again once the
    tensors hold still; a hook, a misaligned input, wanted gradients and train mode each run the modules."""
    from torch.profiler import ProfilerActivity, profile

    from igemm.nn import _program
    runs = []                                    # each program run's result (a tensor, or a miss)
    run = _program._Program.run
    monkeypatch.setattr(_program._Program, "run", lambda self, *a: runs.append(run(self, *a)) or runs[-1])
    done = lambda: sum(type(r) is torch.Tensor for r in runs)             # noqa: E731
    name, fmt = case.split("-")
    conv, modules, xc = _converted({"Net": Net, "Toy": Toy}[name], 4,
                                   CL if fmt == "channels_last" else torch.contiguous_format)
    progs = conv._igemm_programs
    entry = lambda: type(next(iter(progs.values())))                       # noqa: E731
    with torch.no_grad():
        y0 = conv(xc)
        (prog,) = progs.values()
        assert type(prog) is _program._Program and runs == []
        tail = {"Net": ["fc_igemm"], "Toy": ["grouped", "depthwise", "up"]}[name]   # (4 images: the head's cuBLAS)
        assert len(prog.mods) == 10 and [n.name for n in prog.tail] == tail
        assert prog.branches == 2                                          # (each block's downsample)
        y1, want = conv(xc), modules(xc)
        assert torch.equal(y1, want) and torch.equal(y0, want) and done() == 1
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            conv(xc)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        kernels = [st for st in prog.steps if type(st.launcher) is not _program._Sync]
        tail_kernels = {"Net": 1, "Toy": 0}[name]                          # (Net: the head's pool, in the tail)
        assert sum(n.startswith("igemm") for n in names) == len(kernels) + tail_kernels and done() == 2, names
        peaks = []
        for f in (conv, modules):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            f(xc)
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - base)
        assert peaks[0] <= 1.25 * peaks[1] + (1 << 20), peaks
        conv.blocks_0_conv1_igemm.bn.running_var.mul_(2)                  # updated in place
        y2, want2 = conv(xc), modules(xc)
        assert torch.equal(y2, want2) and not torch.equal(y2, y1) and entry() is _program._Stale
        assert torch.equal(conv(xc), want2) and entry() is _program._Program       # (made again)
        n = done()
        assert torch.equal(conv(xc), want2) and done() == n + 1
        c3 = conv.blocks_1_conv3_igemm.conv
        c3.weight = nn.Parameter(c3.weight * 2)                            # replaced
        want3 = modules(xc)
        assert not torch.equal(want3, want2)
        for _ in range(3):
            assert torch.equal(conv(xc), want3)
        assert done() == n + 2 and entry() is _program._Program
        seen = []
        h = prog.mods[1].register_forward_hook(lambda m, i, o: seen.append(o.shape))
        assert torch.equal(conv(xc), want3) and len(seen) == 1 and done() == n + 2
        h.remove()
        off = torch.empty(xc.numel() + 8, device="cuda", dtype=xc.dtype)
        xm = off.as_strided(xc.shape, xc.stride(), 1).copy_(xc)
        assert torch.equal(conv(xm), modules(xm)) and done() == n + 2
        assert torch.equal(conv(xc), want3) and done() == n + 3
    conv(xc)                                                               # gradients wanted
    assert done() == n + 3
    conv.train()
    with torch.no_grad():
        conv(xc)
    assert done() == n + 3


@pytest.mark.gpu
def test_gpu_program_in_a_cuda_graph_runs_branches_beside_the_main_path():
    """Captured into a CUDA graph, the program runs each block's downsample on a second stream (a fork before it, a
    join before the add that reads it) and the classifier head (two images) as its last step: each replay gives the
    module calls' bits; run eagerly, its layers stay in one stream."""
    from igemm.nn import _program
    conv, modules, xc = _converted(Net, 2)
    with torch.no_grad():
        want = modules(xc)
        conv(xc)
        (prog,) = conv._igemm_programs.values()
        if torch.cuda.get_device_capability() >= (9, 0):            # (the head's kernel runs in clusters)
            assert prog.tail == [] and type(prog.mods[-1]) is inn.AvgPoolLinear
        syncs = [st.launcher.grid[0] for st in prog.graph_steps if type(st.launcher) is _program._Sync]
        assert syncs == [1, 2, 3] * 2 and not any(type(st.launcher) is _program._Sync for st in prog.steps)
        assert torch.equal(conv(xc), want)
        g, y = _capture(conv, xc)
        for _ in range(3):
            y.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, want)


@pytest.mark.gpu
def test_gpu_program_gives_values_read_after_the_run_their_own_tensors():
    """Features returned beside the logits: values the run reads and the graph's output returns are tensors of
    their own (not views of the workspace), with the module calls' bits and strides."""
    from igemm.nn import _program

    class Features(Net):
        def forward(self, x):
            s = self.stem(x)
            f = self.blocks(self.pool(s))
            return s, f, self.fc(torch.flatten(self.avg(f), 1))
    conv, modules, xc = _converted(Features, 4)
    with torch.no_grad():
        conv(xc)
        (prog,) = conv._igemm_programs.values()
        got, want = conv(xc), modules(xc)
    assert type(prog) is _program._Program and len(prog.exports) == 2        # s and f (the head: cuBLAS's)
    for a, b in zip(got, want):
        assert torch.equal(a, b) and a.stride() == b.stride()
    assert len({t.untyped_storage().data_ptr() for t in got[:2]}) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["resnet18", "resnet50", "mobilenet_v2", "resnext50_32x4d"])
def test_gpu_torchvision_models(name):
    """Converted torchvision models (random weights, BN statistics from one train-mode forward), fp16
    channels_last: the error against the fp32 model is at most PyTorch fp16's own (with a margin of 25%);
    grouped and depthwise convs stay PyTorch's."""
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = getattr(tv.models, name)(num_classes=100).cuda()
    x = torch.randn(8, 3, 224, 224, device="cuda")
    _settle(model, x)
    with torch.no_grad():
        ref = model(x).double()
        half = model.half().to(memory_format=CL)
        xc = x.half().contiguous(memory_format=CL)
        err_torch = rel_err(half(xc).double().cpu().numpy(), ref.cpu().numpy())
        conv, rep = inn.convert(half, return_report=True)
        inn.precompile(conv, xc)                         # (its kernels, in parallel, before the first forward)
        err_igemm = rel_err(conv(xc).double().cpu().numpy(), ref.cpu().numpy())
    assert rep["converted"] and err_igemm <= 1.25 * err_torch + 1e-4, (name, err_igemm, err_torch, str(rep))
    if name in ("mobilenet_v2", "resnext50_32x4d"):
        assert rep["left"], rep
    print(f"{name}: converted {len(rep['converted'])}, left {len(rep['left'])}; rel err vs fp32: igemm "
          f"{err_igemm:.2e}, torch fp16 {err_torch:.2e}")
