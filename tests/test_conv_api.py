"""The conv API's semantics on both backends: where a plan is built without a GPU, when epilogue vectors are read,
what ``precision="tf32"`` means on the numpy backend, nothing written on error, every argument honoured or refused
(issue 38, items 4, 5, 6, 8 and 10; the table of bad inputs is tests/validation_rows/conv.py)."""
import numpy as np
import pytest

import igemm
from igemm import epilogues as ep
from igemm import reference
from igemm.conv._plan import _tf32

from helpers import rel_err, to_numpy


def _xw(rng, dtype=np.float32, N=2, C=4, H=8, K=3):
    return rng.standard_normal((N, C, H, H)).astype(dtype), (rng.standard_normal((K, C, 3, 3)) / 6).astype(dtype)


def _bn(rng, K=3):
    return [rng.uniform(0.5, 1.5, K).astype(np.float32), rng.standard_normal(K).astype(np.float32),
            rng.standard_normal(K).astype(np.float32), rng.uniform(0.5, 2, K).astype(np.float32)]


# ----------------------------------------------------------------------------- item 4: plans without a GPU
def test_item4_plan_default_device_follows_the_backend(numpy_backend):
    plan = igemm.Conv2dPlan((2, 4, 8, 8), (3, 4, 3, 3), "float32", padding=1)
    assert plan.backend == "numpy" and plan.device_id is None and "device=numpy" in repr(plan)
    with pytest.raises(ValueError, match="^device: cuda:0 asked for, but the numpy backend is active"):
        igemm.Conv2dPlan((2, 4, 8, 8), (3, 4, 3, 3), "float32", padding=1, device=0)
    with pytest.raises(TypeError, match="^device:"):
        igemm.Conv2dPlan((2, 4, 8, 8), (3, 4, 3, 3), "float32", padding=1, device=1.0)
    with pytest.raises(ValueError, match="^device:"):
        igemm.Conv2dPlan((2, 4, 8, 8), (3, 4, 3, 3), "float32", padding=1, device="gpu")


def test_item4_numpy_plan_checks_its_options(numpy_backend):
    """A numpy-backend plan checks ``options.config`` as a GPU plan does (for sm_90a)."""
    with pytest.raises(ValueError, match="^config: unknown fields"):
        igemm.Conv2dOptions(config={"tile": 3})
    with pytest.raises(NotImplementedError, match="kernel config"):
        igemm.Conv2dPlan((2, 8, 8, 16), (32, 3, 3, 16), "float16", "NHWC", device="numpy",
                         options=igemm.Conv2dOptions(config={"bm": 96}))
    name, src = igemm.Conv2dPlan((2, 8, 8, 64), (64, 3, 3, 64), "float16", "NHWC", padding=1, device="numpy",
                                 arch="sm_80").kernel()
    assert "kTensorOp" in src and name.startswith("conv_float16_NHWC_tensorop")


@pytest.mark.gpu
def test_item4_plan_default_device_is_the_gpu():
    plan = igemm.Conv2dPlan((2, 4, 8, 8), (3, 4, 3, 3), "float32", padding=1)
    assert plan.backend == "cuda" and plan.device_id == 0
    with pytest.raises(ValueError, match="^arch, sms"):
        igemm.Conv2dPlan((2, 4, 8, 8), (3, 4, 3, 3), "float32", padding=1, device=0, arch="sm_80")


# ------------------------------------------------------------------- item 5: one semantics for vectors
def _item5(rng, make, run, host):
    """A plan folds its chain's vectors when built; conv2d reads them at every call -- same on both backends."""
    x, w = _xw(rng)
    V = _bn(rng)
    Vd = [make(v.copy()) for v in V]
    chain = ep.chain(ep.BatchNorm(*Vd), ep.PReLU(make(np.full(3, 0.25, np.float32))))
    plan = run(lambda xx, ww: igemm.Conv2dPlan(x.shape, w.shape, "float32", padding=1, epilogue=chain))(None, None)
    before = host(plan(make(x), make(w)))
    Vd[0] *= 5                                        # gamma, in place, after the plan was built
    chain.ops[1].alpha *= 0                           # and the PReLU slope
    after = host(plan(make(x), make(w)))
    fresh = host(igemm.conv2d(make(x), make(w), padding=1, epilogue=chain))
    np.testing.assert_array_equal(before, after)
    pre = reference.conv2d_direct(x.astype(np.float64), w.astype(np.float64), 1, 1)
    want = ep.chain(ep.BatchNorm(*[v * (5 if i == 0 else 1) for i, v in enumerate(V)]), ep.PReLU(0.0)).reference(pre)
    assert rel_err(fresh, want) < 1e-5 and rel_err(before, want) > 1e-2


def test_item5_plan_folds_at_build_numpy(numpy_backend, rng):
    _item5(rng, lambda a: a, lambda f: f, np.asarray)


@pytest.mark.gpu
def test_item5_plan_folds_at_build_gpu(rng):
    torch = pytest.importorskip("torch")
    _item5(rng, lambda a: torch.from_numpy(np.array(a)).cuda(), lambda f: f, to_numpy)


# ----------------------------------------------------------------------- item 6: tf32 on the numpy backend
def test_item6_tf32_on_the_numpy_backend_rounds_the_inputs(numpy_backend, rng):
    x, w = _xw(rng)
    tf = igemm.conv2d(x, w, padding=1, precision="tf32")
    strict = igemm.conv2d(x, w, padding=1)
    want = reference.conv2d_direct(_tf32(x).astype(np.float64), _tf32(w).astype(np.float64), 1, 1)
    assert rel_err(tf, want) < 1e-6 and 1e-5 < rel_err(tf, strict) < 1e-3
    u = _tf32(x).view(np.uint32)
    assert not (u & 0x1FFF).any()                     # 10 mantissa bits kept


# --------------------------------------------------------------------------- item 8: nothing written
def test_item8_conv_readonly_mask_out_writes_nothing(numpy_backend, rng):
    x, w = _xw(rng)
    out = np.full((2, 3, 8, 8), np.nan, np.float32)
    mask = np.zeros(4, np.uint32)
    mask.flags.writeable = False
    with pytest.raises(ValueError, match="^mask_out: .*read-only"):
        igemm.conv2d(x, w, padding=1, epilogue=ep.ReLU(mask=True), out=out, mask_out=mask)
    assert np.isnan(out).all()


def test_item8_conv_readonly_out_and_out_overlapping_mask(numpy_backend, rng):
    x, w = _xw(rng)
    out = np.full((2, 3, 8, 8), np.nan, np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="^out: .*read-only"):
        igemm.conv2d(x, w, padding=1, out=out)
    buf = np.full(2 * 3 * 8 * 8 + 8, np.nan, np.float32)
    with pytest.raises(ValueError, match="^mask_out and out overlap"):
        igemm.conv2d(x, w, padding=1, epilogue=ep.ReLU(mask=True), out=buf[:384].reshape(2, 3, 8, 8),
                     mask_out=buf[376:].view(np.uint32))
    assert np.isnan(buf).all()


# ------------------------------------------------------------------------- item 10: clear, uniform errors
@pytest.mark.parametrize("call, name", [
    (lambda x, w, p: p(None, w), "x"),
    (lambda x, w, p: p(x, None), "w"),
    (lambda x, w, p: igemm.conv2d(None, w), "x"),
    (lambda x, w, p: igemm.conv2d(x, None), "w"),
], ids=["plan-x", "plan-w", "conv2d-x", "conv2d-w"])
def test_item10_conv_none_names_the_argument(numpy_backend, rng, call, name):
    x, w = _xw(rng)
    plan = igemm.Conv2dPlan(x.shape, w.shape, "float32", padding=1)
    with pytest.raises(TypeError, match=f"^{name}: expected an array, got None"):
        call(x, w, plan)


def test_item10_conv_residual_without_add_names_residual(numpy_backend, rng):
    x, w = _xw(rng)
    r = np.ones((2, 3, 8, 8), np.float32)
    with pytest.raises(ValueError, match="^residual: given, but the epilogue has no Add"):
        igemm.conv2d(x, w, padding=1, residual=r)
    plan = igemm.Conv2dPlan(x.shape, w.shape, "float32", padding=1)
    with pytest.raises(ValueError, match="^residual: given, but the plan's epilogue has no Add"):
        plan(x, w, residual=r)
    with pytest.raises(ValueError, match="^residual_dtype: given, but the epilogue has no Add"):
        igemm.Conv2dPlan(x.shape, w.shape, "float32", padding=1, residual_dtype="float16")


def test_item10_conv_numbers_and_shapes(numpy_backend, rng):
    x, w = _xw(rng)
    V = _bn(rng)
    y = igemm.conv2d(x, w, padding=1, epilogue=ep.chain(ep.BatchNorm(*V, eps=np.float32(1e-5)),
                                                        ep.PReLU(np.int64(0))))
    assert np.isfinite(y).all() and (y >= 0).all()
    for bad, exc in (("1e-5", TypeError), (True, TypeError), (float("nan"), ValueError), (-1.0, ValueError)):
        with pytest.raises(exc, match="^eps:"):
            ep.BatchNorm(*V, eps=bad)
    with pytest.raises(TypeError, match="^alpha:"):
        ep.PReLU("0.25")
    with pytest.raises(TypeError, match=r"^x_shape\[0\]: expected an int"):
        igemm.Conv2dPlan((8.7, 4, 8, 8), (3, 4, 3, 3), "float32")
    with pytest.raises(TypeError, match="^x_shape:"):
        igemm.Conv2dPlan(None, (3, 4, 3, 3), "float32")
    with pytest.raises(TypeError, match="^stride: expected integers"):
        igemm.Conv2dPlan((2, 4, 8, 8), (3, 4, 3, 3), "float32", stride=1.0)


def test_item10_conv_one_exception_type_per_failure(numpy_backend, rng):
    """Wrong dtypes are TypeErrors (out, mask_out, residual alike), wrong shapes ValueErrors."""
    x, w = _xw(rng)
    with pytest.raises(TypeError, match="^out:"):
        igemm.conv2d(x, w, padding=1, out=np.empty((2, 3, 8, 8), np.float16))
    with pytest.raises(TypeError, match="^mask_out:"):
        igemm.conv2d(x, w, padding=1, epilogue=ep.ReLU(mask=True), mask_out=np.empty(4, np.float32))
    with pytest.raises(TypeError, match="^residual:"):
        igemm.conv2d(x, w, padding=1, epilogue=ep.Add(), residual=np.ones((2, 3, 8, 8), np.int32))
    with pytest.raises(ValueError, match="^out:"):
        igemm.conv2d(x, w, padding=1, out=np.empty((2, 3, 8, 7), np.float32))
    with pytest.raises(TypeError, match="^stream:"):
        igemm.Conv2dPlan(x.shape, w.shape, "float32", padding=1)(x, w, stream="default")


# --------------------------------------------------------------------------- PyTorch's conv2d arguments
def _ref_conv(x, w, b, stride, padding, dilation):
    y = reference.conv2d_direct(np.asarray(x, np.float64), np.asarray(w, np.float64), stride, padding, dilation,
                                "NCHW")
    return y + np.asarray(b, np.float64).reshape(1, -1, 1, 1) if b is not None else y


def test_conv2d_bias_and_string_padding(numpy_backend, rng):
    """``bias=`` (added before the epilogue) and ``padding="same"``/``"valid"`` as in PyTorch; ``groups`` != 1,
    strided or asymmetric "same", and unknown strings raise, naming the argument."""
    x = rng.standard_normal((2, 4, 7, 9)).astype(np.float32)
    w = rng.standard_normal((5, 4, 3, 5)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    y = igemm.conv2d(x, w, padding="same", bias=b)
    assert y.shape == (2, 5, 7, 9) and rel_err(y, _ref_conv(x, w, b, 1, (1, 2), 1)) <= 1e-6
    y = igemm.conv2d(x, w, padding="same", dilation=2, bias=b, epilogue=ep.ReLU())
    assert rel_err(y, np.maximum(_ref_conv(x, w, b, 1, (2, 4), 2), 0)) <= 1e-6
    assert igemm.conv2d(x, w, padding="valid").shape == (2, 5, 5, 5)
    for kw, exc, msg in [(dict(groups=2), NotImplementedError, "groups"), (dict(groups=1.0), TypeError, "groups"),
                         (dict(padding="same", stride=2), ValueError, "padding"),
                         (dict(padding="full"), ValueError, "padding"),
                         (dict(bias=b[:4]), ValueError, "bias")]:
        with pytest.raises(exc, match=msg):
            igemm.conv2d(x, w, **kw)
    with pytest.raises(NotImplementedError, match="padding"):
        igemm.conv2d(x, w[:, :, :2, :2], padding="same")
    # an (N, C, H, W) array with NHWC memory (torch's channels_last): the NHWC call, y with NHWC memory too
    xl = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    yl = igemm.conv2d(xl, w, padding="same", bias=b)
    assert yl.transpose(0, 2, 3, 1).flags.c_contiguous and rel_err(yl, _ref_conv(x, w, b, 1, (1, 2), 1)) <= 1e-6


@pytest.mark.gpu
def test_conv2d_channels_last_and_cached_folds_gpu(rng):
    """A channels_last torch x with layout="NCHW": the NHWC kernel on its memory, a channels_last y equal to the
    NCHW call's; the residual, out and mask as in an NHWC call. Torch BN vectors are folded once and folded
    again after an in-place update or when another tensor is given."""
    torch = pytest.importorskip("torch")
    cl = torch.channels_last
    x = torch.randn(2, 32, 12, 12, device="cuda").half()
    w = (torch.randn(64, 32, 3, 3, device="cuda") / 17).half()
    b = torch.randn(64, device="cuda")
    g, be, m, v = (torch.rand(64, device="cuda") + .5, torch.randn(64, device="cuda"),
                   torch.randn(64, device="cuda"), torch.rand(64, device="cuda") + .5)
    r = torch.randn(2, 64, 12, 12, device="cuda").half()
    chain = ep.chain(ep.BatchNorm(g, be, m, v), ep.Add(), ep.ReLU(mask=True))
    y0, m0 = igemm.conv2d(x, w, padding=1, bias=b, epilogue=chain, residual=r)
    xc, wc, rc = (t.contiguous(memory_format=cl) for t in (x, w, r))
    y1, m1 = igemm.conv2d(xc, wc, padding=1, bias=b, epilogue=chain, residual=rc)
    assert y1.is_contiguous(memory_format=cl) and y1.shape == y0.shape
    assert rel_err(y1.float().cpu().numpy(), y0.float().cpu().numpy()) <= 5e-3
    assert torch.equal(m1, igemm.relu_mask(y1.permute(0, 2, 3, 1).contiguous()))       # memory (NHWC) order
    out = torch.full_like(y0, float("nan")).contiguous(memory_format=cl)
    y2, _ = igemm.conv2d(xc, w, padding=1, bias=b, epilogue=chain, residual=rc, out=out)   # w copied to KRSC
    assert y2 is out and torch.equal(out, y1)
    with pytest.raises(ValueError, match="out"):
        igemm.conv2d(xc, wc, padding=1, epilogue=chain, residual=rc, out=torch.empty_like(y0))
    # the fold cache: the same vectors twice, then updated in place, then other tensors
    m_before = m.clone()
    ya = igemm.conv2d(x, w, padding=1, epilogue=ep.chain(ep.BatchNorm(g, be, m, v), ep.ReLU()))
    yb = igemm.conv2d(x, w, padding=1, epilogue=ep.chain(ep.BatchNorm(g, be, m, v), ep.ReLU()))
    m.add_(1.0)
    yc = igemm.conv2d(x, w, padding=1, epilogue=ep.chain(ep.BatchNorm(g, be, m, v), ep.ReLU()))
    want = torch.relu(torch.nn.functional.batch_norm(torch.nn.functional.conv2d(x.double(), w.double(), padding=1),
                                                     m.double(), v.double(), g.double(), be.double(), False, 0, 1e-5))
    assert torch.equal(ya, yb) and not torch.equal(yb, yc)
    assert rel_err(yc.double().cpu().numpy(), want.cpu().numpy()) <= 1e-2
    yd = igemm.conv2d(x, w, padding=1, epilogue=ep.chain(ep.BatchNorm(g, be, m_before, v), ep.ReLU()))
    assert torch.equal(yd, ya)


@pytest.mark.gpu
def test_function_forms_fresh_output_path_gpu(rng, monkeypatch):
    """Repeated function-form calls without a residual (conv2d; conv2d_bn_relu with and without the mask) launch
    on fresh outputs with x checked once (TorchCall.fresh): the first call's bits each call, w as a tensor or a
    module's Parameter; an in-place update of a BN vector is seen; a thread with no current context takes the
    general path instead and is left with no context, as before the call."""
    torch = pytest.importorskip("torch")
    import threading
    from igemm import _runtime
    from igemm.conv._launch import TorchCall
    x = torch.randn(2, 10, 10, 32, device="cuda").half()
    w = (torch.randn(48, 3, 3, 32, device="cuda") / 17).half()
    g, b, m, v = (torch.rand(48, device="cuda") + .5, torch.randn(48, device="cuda"),
                  torch.randn(48, device="cuda"), torch.rand(48, device="cuda") + .5)
    calls = [lambda wt: igemm.conv2d(x, wt, padding=1, layout="NHWC"),
             lambda wt: igemm.conv2d_bn_relu(x, wt, g, b, m, v, 1e-5, 1, 1, layout="NHWC", return_mask=True),
             lambda wt: igemm.conv2d_bn_relu(x, wt, g, b, m, v, 1e-5, 1, 1, layout="NHWC")]
    first = [c(w) for c in calls]
    fresh = []
    inner = TorchCall.fresh

    def spy(self, *a):
        r = inner(self, *a)
        fresh.append(r is not None)
        return r
    monkeypatch.setattr(TorchCall, "fresh", spy)

    def same(a, b):
        a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
        return all(torch.equal(p.view(torch.int16) if p.is_floating_point() else p,
                               q.view(torch.int16) if q.is_floating_point() else q) for p, q in zip(a, b))
    for wt in (w, torch.nn.Parameter(w, requires_grad=False)):
        for i, c in enumerate(calls):
            r1, r2 = c(wt), c(wt)
            assert same(r1, first[i]) and same(r2, first[i]), i
            assert (r1[0] if i == 1 else r1).data_ptr() != (r2[0] if i == 1 else r2).data_ptr(), i
    assert fresh == [True] * 12
    v.mul_(2.0)
    y2 = calls[2](w)
    assert fresh[-1] and len(fresh) == 13 and not torch.equal(y2, first[2])
    assert torch.equal(y2, igemm.conv2d(x, w, padding=1, layout="NHWC",
                                        epilogue=ep.chain(ep.BatchNorm(g, b, m, v.clone()), ep.ReLU())))
    v.div_(2.0)
    seen = {}

    def other_thread():
        seen["before"] = _runtime.current_context()
        seen["r"] = [c(w) for c in calls]
        seen["after"] = _runtime.current_context()
    fresh.clear()
    th = threading.Thread(target=other_thread)
    th.start()
    th.join()
    assert seen["before"] == 0 and seen["after"] == 0 and not any(fresh)
    assert all(same(r, f) for r, f in zip(seen["r"], first))


@pytest.mark.gpu
def test_conv2d_bn_relu_repeated_calls_gpu(rng):
    """conv2d_bn_relu's repeated-call path (the plan and the fold reused) gives the first call's bits, sees an
    in-place update of a statistic and other tensors, keeps the folds of two vector sets alternated on one
    geometry apart, and still checks what changed (a wrong-length vector)."""
    torch = pytest.importorskip("torch")
    x = torch.randn(2, 10, 10, 32, device="cuda").half()
    w = (torch.randn(48, 3, 3, 32, device="cuda") / 17).half()
    r = torch.randn(2, 10, 10, 48, device="cuda").half()
    g, b, m, v = (torch.rand(48, device="cuda") + .5, torch.randn(48, device="cuda"),
                  torch.randn(48, device="cuda"), torch.rand(48, device="cuda") + .5)

    def call(*vec, **kw):
        return igemm.conv2d_bn_relu(x, w, *vec, 1e-5, 1, 1, layout="NHWC", residual=r, return_mask=True, **kw)
    y0, m0 = call(g, b, m, v)
    y1, m1 = call(g, b, m, v)
    assert torch.equal(y0, y1) and torch.equal(m0, m1)
    v.mul_(2.0)
    y2, _ = call(g, b, m, v)
    y3, _ = igemm.conv2d(x, w, padding=1, layout="NHWC", residual=r,
                         epilogue=ep.chain(ep.BatchNorm(g, b, m, v.clone()), ep.Add(), ep.ReLU(mask=True)))
    assert torch.equal(y2, y3) and not torch.equal(y2, y0)
    y4, _ = call(g.clone(), b, m, v)
    assert torch.equal(y4, y2)
    g2, b2, m2, v2 = (t * 1.5 for t in (g, b, m, v))      # another layer of the same geometry, alternated
    y5, _ = call(g2, b2, m2, v2)
    for _ in range(2):
        assert torch.equal(call(g, b, m, v)[0], y2) and torch.equal(call(g2, b2, m2, v2)[0], y5)
    b2.add_(0.5)
    assert not torch.equal(call(g2, b2, m2, v2)[0], y5) and torch.equal(call(g, b, m, v)[0], y2)
    with pytest.raises(ValueError, match="gamma"):
        call(g[:40], b, m, v)
