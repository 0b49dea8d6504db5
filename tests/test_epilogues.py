"""Fused epilogues: objects, folding, the numpy backend, and every chain on the GPU (with the ReLU mask)."""
import numpy as np
import pytest

import igemm
from igemm import epilogues as ep
from igemm import reference
from igemm.reference.epilogue import apply_chain, fold_batch_norm

from helpers import TOL, poison, rel_err, to_numpy, to_torch
from test_conv import to_layout


def bn_vectors(rng, K, lib=np.asarray):
    gamma = rng.uniform(0.5, 1.5, K)
    beta = rng.standard_normal(K) * 0.2
    mean = rng.standard_normal(K) * 0.2
    var = rng.uniform(0.5, 2.0, K)
    return [lib(v.astype(np.float32)) for v in (gamma, beta, mean, var)]


# ------------------------------------------------------------------------------------ CPU tier
def test_fold_batch_norm_against_definition(rng):
    g, b, m, v = (a.astype(np.float64) for a in bn_vectors(rng, 17))
    x = rng.standard_normal((5, 17))
    scale, shift = fold_batch_norm(g, b, m, v, 1e-3)
    np.testing.assert_allclose(x * scale + shift, (x - m) / np.sqrt(v + 1e-3) * g + b, rtol=1e-12, atol=1e-12)


def test_fold_affine_bias_then_bn(rng):
    from igemm.reference.epilogue import fold_affine
    g, b, m, v = (a.astype(np.float64) for a in bn_vectors(rng, 6))
    bias = rng.standard_normal(6)
    scale, shift = fold_affine([ep.Bias(bias), ep.BatchNorm(g, b, m, v, 1e-5)], 6)
    x = rng.standard_normal((3, 6))
    np.testing.assert_allclose(x * scale + shift, ((x + bias) - m) / np.sqrt(v + 1e-5) * g + b, rtol=1e-12)


def test_epilogue_validation(rng, numpy_backend):
    g, b, m, v = bn_vectors(rng, 4)
    x = rng.standard_normal((1, 3, 6, 6)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    with pytest.raises(ValueError, match="gamma.*4"):
        igemm.conv2d(x, w, epilogue=ep.BatchNorm(g[:3], b, m, v))
    with pytest.raises(TypeError, match="mean"):
        igemm.conv2d(x, w, epilogue=ep.BatchNorm(g, b, m.astype(np.int32), v))
    with pytest.raises(ValueError, match="eps"):
        ep.BatchNorm(g, b, m, v, eps=-1)
    with pytest.raises(ValueError, match="residual.*shape"):
        igemm.conv2d(x, w, epilogue=ep.chain(ep.Add(), ep.ReLU()), residual=np.ones((1, 4, 5, 4), np.float32))
    with pytest.raises(ValueError, match="residual.*shape"):          # NHWC-shaped residual on an NCHW output
        igemm.conv2d(np.ascontiguousarray(x[:, :, :, :5]), w, epilogue=ep.Add(np.ones((1, 4, 3, 4), np.float32)))
    with pytest.raises(ValueError, match="pass residual"):
        igemm.conv2d(x, w, epilogue=ep.Add())
    with pytest.raises(TypeError, match="residual"):
        igemm.conv2d(x, w, epilogue=ep.Add(np.ones((1, 4, 4, 4), np.int32)))
    with pytest.raises(ValueError, match="alpha.*4"):
        igemm.conv2d(x, w, epilogue=ep.PReLU(np.ones(3, np.float32)))
    with pytest.raises(ValueError, match="last"):
        ep.chain(ep.ReLU(mask=True), ep.Add())
    with pytest.raises(NotImplementedError, match="activation"):
        ep.chain(ep.ReLU(), ep.PReLU(0.1))
    with pytest.raises(NotImplementedError, match="affine"):
        ep.chain(ep.Bias(g), ep.ReLU(), ep.Bias(g))
    with pytest.raises(TypeError, match="epilogue"):
        ep.chain("relu")


CHAINS = {
    "bn": lambda V, r: ep.BatchNorm(*V, eps=1e-5),
    "bn_relu": lambda V, r: ep.chain(ep.BatchNorm(*V), ep.ReLU()),
    "bn_relu_mask": lambda V, r: ep.chain(ep.BatchNorm(*V), ep.ReLU(mask=True)),
    "bn_add_relu": lambda V, r: ep.chain(ep.BatchNorm(*V), ep.Add(r), ep.ReLU()),
    "bn_add_relu_mask": lambda V, r: ep.chain(ep.BatchNorm(*V), ep.Add(r), ep.ReLU(mask=True)),
    "prelu_scalar": lambda V, r: ep.PReLU(0.2),
    "prelu_channel": lambda V, r: ep.PReLU(V[0] - 1.0),
    "bias_relu": lambda V, r: ep.chain(ep.Bias(V[1]), ep.ReLU()),
}


@pytest.mark.parametrize("name", list(CHAINS))
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_numpy_backend_chains(name, layout, rng, numpy_backend):
    x, w = to_layout(rng.standard_normal((2, 3, 7, 6)).astype(np.float32),
                     rng.standard_normal((5, 3, 3, 3)).astype(np.float32), layout)
    V = bn_vectors(rng, 5)
    yshape = (2, 5, 7, 6) if layout == "NCHW" else (2, 7, 6, 5)
    res = rng.standard_normal(yshape).astype(np.float32)
    chain = CHAINS[name](V, res)
    out = igemm.conv2d(x, w, padding=1, layout=layout, epilogue=chain)
    pre = reference.conv2d_direct(x, w, 1, 1, 1, layout)
    ref = apply_chain(pre, ep.chain(chain), layout)
    y = out[0] if isinstance(out, tuple) else out
    assert rel_err(y, ref) < 1e-5
    # an independent formula for the BN chains
    if name.startswith("bn"):
        sh = (1, -1, 1, 1) if layout == "NCHW" else (1, 1, 1, -1)
        g, b, m, v = (a.astype(np.float64).reshape(sh) for a in V)
        z = (pre - m) / np.sqrt(v + 1e-5) * g + b + (res if "add" in name else 0)
        if "relu" in name:
            z = np.maximum(z, 0)
        assert rel_err(y, z) < 1e-5
    if name.endswith("mask"):
        np.testing.assert_array_equal(out[1], reference.pack_mask(y > 0))


# ------------------------------------------------------------------------------------ GPU tier
def _shape_family(rng, layout):
    """Random problems spanning the store modes: K <= 128 (linear), K > 128 (rows, with/without fused
    mask), NCHW maps with P*Q % 32 == 0 or not, odd sizes."""
    N = int(rng.integers(1, 4))
    C = int(rng.choice([8, 16, 32]))      # the loaders are covered by test_conv; fewer kernel variants here
    K = int(rng.choice([8, 24, 64, 100, 128, 160, 256, 200]))
    H = int(rng.choice([4, 7, 8, 14, 16]))
    W = int(rng.choice([4, 7, 8, 14, 16]))
    R = int(rng.choice([1, 3]))
    st = int(rng.choice([1, 1, 2]))
    return (N, C, H, W), (K, C, R, R), st, R // 2


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CHAINS))
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gpu_chains(name, layout, dtype, rng):
    torch = pytest.importorskip("torch")
    for _ in range(50):
        xs, ws, st, pd = _shape_family(rng, layout)
        x64, w64 = to_layout(rng.standard_normal(xs), rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:])), layout)
        x, w = to_torch(x64, dtype), to_torch(w64, dtype)
        pre = reference.conv2d_direct(to_numpy(x), to_numpy(w), st, pd, 1, layout)
        K = ws[0]
        V = bn_vectors(rng, K, lambda a: torch.from_numpy(a).cuda())
        res = to_torch(rng.standard_normal(pre.shape), dtype)
        chain = ep.chain(CHAINS[name](V, res))
        y_pre_ref = apply_chain(pre, ep.chain(*[o for o in chain.ops if not isinstance(o, ep.ReLU)]), layout,
                                residual=to_numpy(res))
        ref = apply_chain(pre, chain, layout, residual=to_numpy(res))
        out = poison(torch.empty(pre.shape, dtype=x.dtype, device="cuda"))
        want_mask = chain.mask
        words = (out.numel() + 31) // 32
        mask = poison(torch.empty(words, dtype=torch.int32, device="cuda")) if want_mask else None
        r = igemm.conv2d(x, w, st, pd, layout=layout, epilogue=chain, out=out, mask_out=mask)
        label = f"{name} {dtype} {layout} x{xs} w{ws} stride {st}"
        y = to_numpy(out)
        assert rel_err(y, ref) <= TOL[dtype], label
        if want_mask:
            assert r[1] is mask
            bits = reference.unpack_mask(mask.cpu().numpy(), y.size).reshape(y.shape)
            np.testing.assert_array_equal(bits, y > 0, err_msg=label + ": mask != (y > 0)")
            sure = np.abs(y_pre_ref) > 4 * TOL[dtype] * (np.abs(y_pre_ref).max() + 1e-30)
            np.testing.assert_array_equal(bits[sure], (y_pre_ref > 0)[sure], err_msg=label + ": mask vs reference")
            m = mask.cpu().numpy().view(np.uint32)
            if y.size % 32:
                assert m[-1] >> (y.size % 32) == 0, label + ": bits past the end"
            # the fused mask is interchangeable with the standalone one
            np.testing.assert_array_equal(m, igemm.relu_mask(out).cpu().numpy().view(np.uint32))
            dy = torch.randn_like(out)
            dx = igemm.relu_backward(dy, mask)
            np.testing.assert_array_equal(to_numpy(dx), np.where(bits, to_numpy(dy), 0))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_relu_stores_positive_zero(layout, dtype, rng):
    """A ReLU chain stores +0 (never -0) wherever the value before it is <= 0, also where a negative value
    would round to -0 in the output's type, and exactly +0 where a positive one rounds to 0: the register
    epilogue's max.NaN(v, 0) and 16-bit conversion (one F2FP.RELU in ptxas's SASS), and the fp32 C tile's
    store phase.
    A 1x1 conv with identity weights (acc = x exactly) and BN scales of 1 and of 2^-30 (fp16) / 2^-140 (bf16:
    below its smallest subnormal)."""
    torch = pytest.importorskip("torch")
    C = 64
    tiny = 2.0 ** (-30 if dtype == "float16" else -140)
    gamma = np.where(np.arange(C) % 2 == 0, 1.0, tiny)
    # acc * scale + shift with scale = gamma / sqrt(var + eps) = gamma (var + eps = 1 in fp32), shift = 0
    V = [torch.from_numpy(a.astype(np.float32)).cuda()
         for a in (gamma, np.zeros(C), np.zeros(C), np.full(C, 1.0 - 2.0 ** -20))]
    eps = 2.0 ** -20
    x64, w64 = to_layout(rng.standard_normal((2, C, 8, 8)), np.eye(C).reshape(C, C, 1, 1), layout)
    x, w = to_torch(x64, dtype), to_torch(w64, dtype)
    xs = to_numpy(x)
    g = gamma[:, None, None] if layout == "NCHW" else gamma
    # a residual on the scale-1 channels only (0 on the tiny ones): acc * scale + r is exact in fp32
    res = to_torch(np.where(g == 1.0, rng.standard_normal(xs.shape), 0.0), dtype)
    for chain in (ep.chain(ep.BatchNorm(*V, eps=eps), ep.ReLU(mask=True)),
                  ep.chain(ep.BatchNorm(*V, eps=eps), ep.ReLU()),
                  ep.chain(ep.BatchNorm(*V, eps=eps), ep.Add(), ep.ReLU(mask=True))):
        pre = xs * g + (to_numpy(res) if chain.residual_op is not None else 0.0)    # exact in float64
        for store in (None, "rows" if layout == "NHWC" else "nchw"):
            plan = igemm.Conv2dPlan(x.shape, w.shape, dtype, layout, epilogue=chain, options=igemm.Conv2dOptions(config={"store": store} if store else None))
            label = f"{dtype} {layout} {chain!r} {plan.spec().name()}"
            assert plan.spec().store.startswith("regs") == (store is None), label   # the register epilogue first
            y = poison(torch.empty(plan.y_shape, dtype=x.dtype, device="cuda"))
            kw = {"out": y}
            if chain.mask:
                kw["mask_out"] = poison(torch.empty(plan.mask_words, dtype=torch.int32, device="cuda"))
            if chain.residual_op is not None:
                kw["residual"] = res
            r = plan(x, w, **kw)
            yh = to_numpy(y)
            want = to_numpy(to_torch(np.maximum(pre, 0.0), dtype))       # rounded once, +0 where pre <= 0
            assert rel_err(yh, want) <= TOL[dtype], label
            np.testing.assert_array_equal(yh == 0, want == 0, err_msg=label)
            assert not np.signbit(yh).any(), f"{label}: -0 stored"
            assert (yh[pre < 0] == 0).all() and (yh == 0).any() and (pre[yh == 0] != 0).any(), label
            if chain.mask:
                bits = reference.unpack_mask(r[1].cpu().numpy(), yh.size).reshape(yh.shape)
                np.testing.assert_array_equal(bits, yh > 0, err_msg=label)


@pytest.mark.gpu
def test_gpu_conv2d_bn_relu_and_plan(rng):
    torch = pytest.importorskip("torch")
    x = torch.randn(4, 16, 16, 32, device="cuda", dtype=torch.float16)
    w = torch.randn(64, 3, 3, 32, device="cuda", dtype=torch.float16) / 17
    g, b, m, v = bn_vectors(rng, 64, lambda a: torch.from_numpy(a).cuda())
    r = torch.randn(4, 16, 16, 64, device="cuda", dtype=torch.float16)
    y, mask = igemm.conv2d_bn_relu(x, w, g, b, m, v, 1e-5, padding=1, layout="NHWC", residual=r, return_mask=True)
    plan = igemm.Conv2dPlan(x.shape, w.shape, "float16", "NHWC", padding=1,
                            epilogue=ep.chain(ep.BatchNorm(g, b, m, v), ep.Add(), ep.ReLU(mask=True)))
    y2, mask2 = plan(x, w, residual=r)
    assert torch.equal(y, y2) and torch.equal(mask, mask2)
    import torch.nn.functional as F
    ref = F.relu(F.batch_norm(F.conv2d(x.permute(0, 3, 1, 2).float(), w.permute(0, 3, 1, 2).float(), padding=1),
                              m, v, g, b, False, 0.0, 1e-5) + r.permute(0, 3, 1, 2).float()).permute(0, 2, 3, 1)
    assert rel_err(y.float().cpu().numpy(), ref.cpu().numpy()) < 1e-2
