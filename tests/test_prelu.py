import importlib
import shutil

import numpy as np
import pytest

import igemm
from igemm import _build, reference

from helpers import TOL, poison, rel_err, to_numpy

pm = importlib.import_module("igemm.prelu")   # the module (igemm.prelu is the function)


def _loops(x, alpha, layout):
    """Element-by-element reference (independent of broadcasting)."""
    x = np.asarray(x, np.float64)
    a = np.asarray(alpha, np.float64).reshape(-1)
    y = np.empty_like(x)
    axis = 1 if layout == "NCHW" else x.ndim - 1
    for idx in np.ndindex(x.shape):
        w = a[0] if a.size == 1 else a[idx[axis]]
        y[idx] = x[idx] if x[idx] > 0 else w * x[idx]
    return y


# ------------------------------------------------------------------------------------------ reference
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("shape", [(2, 3), (2, 3, 4), (2, 3, 4, 5), (1, 2, 3, 2, 2)])
def test_reference(shape, layout, rng):
    x = rng.standard_normal(shape)
    c = shape[1] if layout == "NCHW" else shape[-1]
    for alpha in (rng.standard_normal(c), np.array([0.3])):
        np.testing.assert_allclose(reference.prelu(x, alpha, layout), _loops(x, alpha, layout), rtol=1e-15)
        dy = rng.standard_normal(shape)
        dx, da = reference.prelu_backward(dy, x, alpha, layout)
        a = np.asarray(alpha).reshape(-1)
        axis = 1 if layout == "NCHW" else x.ndim - 1
        exp_da = np.zeros(a.size)
        exp_dx = np.empty_like(x)
        for idx in np.ndindex(x.shape):
            ci = 0 if a.size == 1 else idx[axis]
            exp_dx[idx] = dy[idx] if x[idx] > 0 else a[ci] * dy[idx]
            if not x[idx] > 0:
                exp_da[ci] += x[idx] * dy[idx]
        np.testing.assert_allclose(dx, exp_dx, rtol=1e-15)
        np.testing.assert_allclose(da, exp_da, rtol=1e-12)
    # finite differences of sum(y * dy) in alpha
    alpha = rng.standard_normal(c)
    dy = rng.standard_normal(shape)
    _, da = reference.prelu_backward(dy, x, alpha, layout)
    eps = 1e-6
    for j in range(c):
        ap, am = alpha.copy(), alpha.copy()
        ap[j] += eps
        am[j] -= eps
        fd = ((reference.prelu(x, ap, layout) - reference.prelu(x, am, layout)) * dy).sum() / (2 * eps)
        assert abs(fd - da[j]) <= 1e-6 * max(1.0, abs(da[j]))


# ------------------------------------------------------------------------------------------ dispatch
def test_forward_config():
    fc = pm.forward_config
    assert fc(100, 1, 100, "float32", alpha_kind="value", vec=4).mode == "scalar_val"
    assert fc(100, 1, 100, "float32", alpha_kind="one", vec=4).mode == "scalar_ptr"
    assert fc(96 * 64 * 12544, 64, 12544, "float32", alpha_kind="channel", vec=4) == pm.PreluConfig("plane", 4)
    assert fc(1, 512, 49, "float16", alpha_kind="channel", vec=8).mode == "step"          # 7x7, NCHW
    assert fc(1, 64, 1, "float16", alpha_kind="channel", vec=8, alpha_dtype="float32", alpha_ptr=256).mode == "row"
    assert fc(1, 64, 1, "float16", alpha_kind="channel", vec=8, alpha_dtype="float32", alpha_ptr=16).mode == "step"
    assert fc(1, 12, 1, "float16", alpha_kind="channel", vec=8).mode == "step"            # NHWC, C % 8 != 0
    assert fc(2 ** 31, 64, 2 ** 25, "float16", alpha_kind="channel", vec=8).wide


def test_vec_helpers():
    assert pm._vec_aligned("float32", 0, 32) == 4
    assert pm._vec_aligned("float16", 0, 4) == 2
    assert pm._bwd_vec("float16", 196, (0, 0, 0)) == 4
    assert pm._bwd_vec("float32", 49, (0, 0, 0)) == 1
    assert pm._next_pow2(1) == 1 and pm._next_pow2(49) == 64 and pm._next_pow2(3136) == 4096


def _emulate_channels(mode, n, C, S, V):
    """Channel of every element as forward's pack_alphas computes it (FastDiv as the device does it)."""
    from igemm.fastdiv import div_like_device
    out = []
    for v in range(n // V):
        if mode == "plane":
            q = int(div_like_device(v, S // V))
            out += [q - int(div_like_device(q, C)) * C] * V
        elif mode == "row":
            c0 = (v - int(div_like_device(v, C // V)) * (C // V)) * V
            out += [c0 + j for j in range(V)]
        else:
            e0 = v * V
            q = int(div_like_device(e0, S))
            r, c = e0 - q * S, q - int(div_like_device(q, C)) * C
            for _ in range(V):
                out.append(c)
                r += 1
                if r == S:
                    r, c = 0, (0 if c + 1 == C else c + 1)
    return np.array(out + [(e // S) % C for e in range(n // V * V, n)])


@pytest.mark.parametrize("outer, C, S, V", [(3, 5, 8, 4), (2, 7, 49, 8), (2, 5, 7, 4), (4, 12, 1, 4), (3, 7, 1, 8),
                                            (2, 16, 1, 8), (2, 3, 2, 8), (1, 9, 3, 2)])
def test_channel_math(outer, C, S, V):
    n = outer * C * S
    cfg = pm.forward_config(n, C, S, "float16", alpha_kind="channel", vec=V)
    np.testing.assert_array_equal(_emulate_channels(cfg.mode, n, C, S, V), (np.arange(n) // S) % C)


# ------------------------------------------------------------------------------------------ numpy backend / API
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_numpy_backend(layout, dtype, numpy_backend, rng):
    x = rng.standard_normal((2, 5, 3, 4)).astype(dtype)
    c = 5 if layout == "NCHW" else 4
    for alpha in (rng.standard_normal(c).astype(dtype), np.array([0.25], np.float32), 0.1, np.float32(-2.0)):
        a_ref = np.array([pm._round_alpha(float(alpha), dtype)]) if np.ndim(alpha) == 0 else alpha
        y = igemm.prelu(x, alpha, layout=layout)
        ref = reference.prelu(x, a_ref, layout)
        assert y.dtype == x.dtype and rel_err(y, ref) <= TOL[dtype]
        dy = rng.standard_normal(x.shape).astype(dtype)
        dx, da = igemm.prelu_backward(dy, x, alpha, layout=layout)
        rdx, rda = reference.prelu_backward(dy, x, a_ref, layout)
        assert dx.dtype == x.dtype and rel_err(dx, rdx) <= TOL[dtype]
        assert rel_err(da, rda) <= max(TOL[dtype], 1e-3)
        assert da.shape == (np.shape(alpha) if np.ndim(alpha) else (1,))
    out = np.empty_like(x)
    assert igemm.prelu(x, 0.5, layout=layout, out=out) is out
    igemm.prelu(x, 0.5, layout=layout, out=x)   # in place
    assert rel_err(x, out) == 0


def test_docstring_examples(numpy_backend):
    y = igemm.prelu(np.array([[-2., 3.], [4., -1.]], np.float32), np.array([0.5, 0.25], np.float32))
    assert y.tolist() == [[-1.0, 3.0], [4.0, -0.25]]
    x = np.array([[-2., 3.], [4., -1.]], np.float32)
    dx, da = igemm.prelu_backward(np.ones_like(x), x, np.array([0.5, 0.25], np.float32))
    assert dx.tolist() == [[0.5, 1.0], [1.0, 0.25]] and da.tolist() == [-2.0, -1.0]


def test_alpha_fits_the_channel_dim_of_its_layout(numpy_backend, rng):
    """(Bad inputs: tests/validation_rows/prelu.py.) 4 values fit x (2, 3, 4) as NHWC; a 1-D input takes a
    shared alpha."""
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    a = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    np.testing.assert_allclose(igemm.prelu(x, a, layout="NHWC"), np.where(x > 0, x, a * x), rtol=1e-6)
    assert igemm.prelu(np.array([-1.0, 2.0], np.float32), np.array([0.5], np.float32)).tolist() == [-0.5, 2.0]


def test_all_stubs_cover_dispatch():
    """Every kernel the plans can load is in all_stubs (what precompile() compiles), under its runtime name."""
    stubs = dict((stub, name) for name, stub in pm.all_stubs())
    for dtype in ("float32", "float16", "bfloat16"):
        for adtype in {dtype, "float32"}:
            for vec in (1, 2, 4) if dtype == "float32" else (1, 2, 4, 8):
                for kind_alpha in ("value", "one", "channel"):
                    for n, c, s in [(100, 5, 20), (2 ** 31 + 8, 8, 1), (49 * 3, 3, 49)]:
                        cfg = pm.forward_config(n, c, s, dtype, alpha_kind=kind_alpha, vec=vec, alpha_dtype=adtype)
                        stub = pm._stub("forward", dtype, adtype, cfg.vec, pm._MODES[cfg.mode], cfg.wide)
                        assert stubs.get(stub) == "prelu_forward"
                for mode in (0, 1):
                    assert stubs.get(pm._stub("backward_flat", dtype, adtype, vec, mode, False)) == "prelu_backward_flat"
                for k in ("backward_plane", "backward_row"):
                    assert stubs.get(pm._stub(k, dtype, adtype, vec, 0, False)) == f"prelu_{k}"
            assert stubs.get(pm._stub("backward_finish", "float32", adtype, 1, 0, False)) == "prelu_backward_finish"


# ------------------------------------------------------------------------------------------ compile (CI)
COMPILE = [("forward", "float32", "float32", 4, 2, False), ("forward", "float16", "float32", 8, 4, False),
           ("backward_plane", "bfloat16", "bfloat16", 8, 0, False), ("backward_row", "float16", "float32", 8, 0, False),
           ("backward_finish", "float32", "float16", 1, 0, False)]


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("spec", COMPILE, ids=lambda s: f"{s[0]}-{s[1]}-{s[3]}")
def test_kernels_compile(spec, arch, tmp_path, monkeypatch):
    monkeypatch.setenv("IGEMM_CACHE_DIR", str(tmp_path))
    cubin, _ = _build.compile_cubin(pm._stub(*spec), arch, name=f"prelu_{spec[0]}")
    assert cubin[:4] == b"\x7fELF"
    text = next(tmp_path.glob("*.log")).read_text()
    assert "spill" not in text or " 0 bytes spill stores" in text, text


# ------------------------------------------------------------------------------------------ GPU
def _torch():
    return pytest.importorskip("torch")


SHAPES = [("NCHW", (2, 16, 8, 8)), ("NCHW", (3, 5, 7, 7)), ("NCHW", (2, 64, 14, 14)), ("NCHW", (2, 8, 13)),
          ("NCHW", (5, 12)), ("NCHW", (2, 3, 2, 3, 5)), ("NCHW", (1, 7, 1, 1)), ("NHWC", (2, 8, 8, 16)),
          ("NHWC", (3, 7, 7, 12)), ("NHWC", (2, 5, 5, 64)), ("NHWC", (4, 3)), ("NHWC", (3, 2, 2, 7)),
          ("NHWC", (2, 6, 6, 520))]


def _to_nchw(t, layout):
    if layout == "NCHW" or t.ndim < 3:
        return t
    return t.movedim(-1, 1)


def _alphas(torch, rng, c, dtype):
    return [("number", float(rng.uniform(-1, 1))),
            ("one", torch.tensor([0.2], dtype=getattr(torch, dtype), device="cuda")),
            ("chan", torch.from_numpy(rng.uniform(-1, 1, c)).to("cuda", getattr(torch, dtype))),
            ("chan-f32", torch.from_numpy(rng.uniform(-1, 1, c)).to("cuda", torch.float32))]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("layout, shape", SHAPES, ids=[f"{l}{s}" for l, s in SHAPES])
def test_prelu_gpu(layout, shape, dtype, rng):
    torch = _torch()
    import torch.nn.functional as F
    x = torch.from_numpy(rng.standard_normal(shape)).to("cuda", getattr(torch, dtype))
    x.view(-1)[::11] = 0.0
    c = shape[1] if layout == "NCHW" else shape[-1]
    for kind, alpha in _alphas(torch, rng, c, dtype):
        a_np = np.array([pm._round_alpha(alpha, dtype)]) if kind == "number" else to_numpy(alpha)
        ref = reference.prelu(to_numpy(x), a_np, layout)
        out = poison(torch.empty_like(x))
        y = igemm.prelu(x, alpha, layout=layout, out=out)
        assert y is out
        what = f"{dtype} {layout}{shape} alpha {kind}"
        assert rel_err(to_numpy(y), ref) <= TOL[dtype], what
        w = torch.tensor([alpha], device="cuda") if kind == "number" else alpha
        yt = F.prelu(_to_nchw(x, layout), w.to(x.dtype))
        assert rel_err(to_numpy(_to_nchw(y, layout)), to_numpy(yt)) <= TOL[dtype], what
        y2 = igemm.prelu(x, alpha, layout=layout)
        assert torch.equal(y2, y), what
        # backward: reference, torch autograd, determinism
        dy = torch.from_numpy(rng.standard_normal(shape)).to("cuda", getattr(torch, dtype))
        dx, da = igemm.prelu_backward(dy, x, alpha, layout=layout)
        rdx, rda = reference.prelu_backward(to_numpy(dy), to_numpy(x), a_np, layout)
        assert rel_err(to_numpy(dx), rdx) <= TOL[dtype], what
        da_tol = 1e-4 if dtype == "float32" else 1e-2
        assert rel_err(to_numpy(da).reshape(-1), rda) <= da_tol, what
        exp_dtype = x.dtype if kind == "number" else alpha.dtype
        assert da.dtype == exp_dtype and tuple(da.shape) == ((1,) if kind == "number" else tuple(alpha.shape)), what
        xt = _to_nchw(x, layout).detach().clone().requires_grad_(True)
        wt = w.to(x.dtype).detach().clone().requires_grad_(True)
        F.prelu(xt, wt).backward(_to_nchw(dy, layout))
        assert rel_err(to_numpy(_to_nchw(dx, layout)), to_numpy(xt.grad)) <= TOL[dtype], what
        # torch reduces dalpha in the input dtype (fp16/bf16 sums of thousands of terms): compare with its
        # fp32 autograd instead; igemm's dalpha (fp32 accumulation) was checked against float64 above
        xf = _to_nchw(x, layout).float().detach().requires_grad_(True)
        wf = w.to(x.dtype).float().detach().clone().requires_grad_(True)
        F.prelu(xf, wf).backward(_to_nchw(dy, layout).float())
        assert rel_err(to_numpy(da).reshape(-1), to_numpy(wf.grad).reshape(-1)) <= da_tol, what
        dx2, da2 = igemm.prelu_backward(dy, x, alpha, layout=layout)
        assert torch.equal(dx2, dx) and torch.equal(da2, da), f"{what}: not deterministic"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_prelu_unaligned_and_large_gpu(dtype, rng):
    """Views at odd offsets (smaller packs / scalar path, tails) and a big NCHW tensor."""
    torch = _torch()
    for layout, shape in [("NCHW", (3, 6, 5, 9)), ("NHWC", (3, 5, 9, 16)), ("NCHW", (7, 33))]:
        n = int(np.prod(shape))
        for off in (1, 2, 3):
            base = torch.from_numpy(rng.standard_normal(n + off)).to("cuda", getattr(torch, dtype))
            x = base[off:].view(shape)
            c = shape[1] if layout == "NCHW" else shape[-1]
            alpha = torch.from_numpy(rng.uniform(-1, 1, c)).to("cuda", torch.float32)
            y = igemm.prelu(x, alpha, layout=layout)
            ref = reference.prelu(to_numpy(x), to_numpy(alpha), layout)
            assert rel_err(to_numpy(y), ref) <= TOL[dtype], (layout, shape, off)
            dyb = torch.from_numpy(rng.standard_normal(n + off)).to("cuda", getattr(torch, dtype))
            dx, da = igemm.prelu_backward(dyb[off:].view(shape), x, alpha, layout=layout)
            rdx, rda = reference.prelu_backward(to_numpy(dyb[off:].view(shape)), to_numpy(x), to_numpy(alpha), layout)
            assert rel_err(to_numpy(dx), rdx) <= TOL[dtype] and rel_err(to_numpy(da), rda) <= 1e-3, (layout, shape, off)
    x = torch.randn(32, 64, 56, 56, device="cuda").to(getattr(torch, dtype))
    alpha = torch.rand(64, device="cuda") * 0.5
    y = igemm.prelu(x, alpha)
    assert rel_err(to_numpy(y), reference.prelu(to_numpy(x), to_numpy(alpha))) <= TOL[dtype]
    dy = torch.randn_like(x)
    dx, da = igemm.prelu_backward(dy, x, alpha)
    rdx, rda = reference.prelu_backward(to_numpy(dy), to_numpy(x), to_numpy(alpha))
    assert rel_err(to_numpy(dx), rdx) <= TOL[dtype] and rel_err(to_numpy(da), rda) <= 1e-3


@pytest.mark.gpu
def test_prelu_numpy_inputs_and_empty_gpu(rng):
    torch = _torch()
    x = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    a = rng.uniform(0, 1, 3).astype(np.float32)
    y = igemm.prelu(x, a)
    assert isinstance(y, np.ndarray) and rel_err(y, reference.prelu(x, a)) <= 1e-6
    dx, da = igemm.prelu_backward(np.ones_like(x), x, a)
    rdx, rda = reference.prelu_backward(np.ones_like(x), x, a)
    assert rel_err(dx, rdx) <= 1e-6 and rel_err(da, rda) <= 1e-5
    e = torch.empty(0, 3, 4, device="cuda")
    assert igemm.prelu(e, 0.2).shape == e.shape
    dx, da = igemm.prelu_backward(e, e, torch.ones(3, device="cuda"))
    assert dx.shape == e.shape and float(da.abs().sum()) == 0
    with pytest.raises(ValueError, match="contiguous"):
        igemm.prelu(torch.randn(2, 3, 4, 4, device="cuda").to(memory_format=torch.channels_last), 0.2)


@pytest.mark.gpu
@pytest.mark.slow
def test_prelu_over_2_31_gpu():
    """More than 2**31 elements: the wide (64-bit division) forward and 64-bit offsets everywhere."""
    torch = _torch()
    x = torch.empty(2, 16, 2 ** 26 + 1, dtype=torch.float16, device="cuda")   # 2**31 + 32 elements, odd plane
    x.uniform_(-1, 1)
    alpha = torch.linspace(-1, 1, 16, device="cuda")
    y = igemm.prelu(x, alpha)
    yt = torch.where(x > 0, x, (alpha.view(1, 16, 1) * x.float()).half())
    assert torch.equal(y, yt)
    del y, yt
    dy = torch.ones_like(x)
    dx, da = igemm.prelu_backward(dy, x, alpha)
    assert torch.equal(dx, torch.where(x > 0, dy, (alpha.view(1, 16, 1) * dy.float()).half()))
    ref = torch.where(x > 0, 0, x.float()).sum(dim=(0, 2))
    assert torch.allclose(da, ref, rtol=1e-3)
