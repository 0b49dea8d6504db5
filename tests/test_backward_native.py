"""The backward's native kernels (igemm/conv/_native.py, _native_dgrad.py, csrc/conv/grad_sm90.cuh, dgrad_sm90.cuh;
the NCHW 1x1 wgrad, igemm/conv/_native_nchw.py): where they run, their arithmetic emulated in numpy, their
compilation, and on the GPU against float64 (plain, with the mask, with the BN prologue; fp32 ``out`` and
``accumulate``); the channels-last dz pass that applies the mask / prologue before them. Their kernels are
precompiled from ``all_variants()`` (``python -m igemm precompile --backward``)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import igemm
from igemm import reference
from igemm.conv._backward import GradInputProblem, GradWeightProblem

from helpers import TOL, poison, rel_err, to_numpy, to_torch
from test_backward import _run_case, geom, shapes


def _geometry(N, C, H, W, K, R, S, st, pad, dil) -> dict:
    P = (H + 2 * pad - dil * (R - 1) - 1) // st + 1
    Q = (W + 2 * pad - dil * (S - 1) - 1) // st + 1
    return dict(N=N, C=C, H=H, W=W, K=K, R=R, S=S, stride=(st, st), padding=(pad, pad), dilation=(dil, dil), P=P, Q=Q)


#: wgrad's native kernel (16-bit NHWC, C % 64 == 0, K % 8 == 0): partial tiles in M and N, N·P·Q not a multiple of
#: 64, strides, dilation, 1x1 to 7x7, one split and many (N, C, H, W, K, R, S, stride, padding, dilation)
NATIVE_WGRAD = [(2, 64, 12, 12, 64, 3, 3, 1, 1, 1), (3, 128, 9, 11, 40, 3, 3, 2, 1, 1),
                (1, 64, 15, 15, 136, 1, 1, 1, 0, 1), (2, 64, 20, 20, 24, 7, 7, 2, 3, 1),
                (2, 192, 10, 10, 256, 3, 3, 1, 2, 2), (4, 64, 28, 28, 64, 1, 1, 2, 0, 1),
                (8, 64, 56, 56, 64, 3, 3, 1, 1, 1), (2, 512, 7, 7, 512, 3, 3, 1, 1, 1)]


#: dgrad's native kernel (16-bit NHWC, K % 64 == 0, C % 8 == 0): strides 1-3 (zero phases too), dilation, padding
#: past dilation·(R − 1) (a cropped sub-output), 1x1 to 7x7, R != S
NATIVE_DGRAD = [(2, 64, 12, 12, 64, 3, 3, 1, 1, 1), (1, 40, 15, 15, 128, 1, 1, 1, 0, 1),
                (2, 24, 20, 20, 64, 7, 7, 1, 3, 1), (2, 192, 10, 10, 256, 3, 3, 1, 2, 2),
                (3, 136, 9, 11, 64, 3, 3, 1, 0, 1), (2, 64, 9, 7, 64, 5, 5, 1, 1, 1),
                (8, 64, 56, 56, 64, 3, 3, 1, 1, 1), (2, 512, 7, 7, 512, 3, 3, 1, 1, 1),
                (2, 64, 13, 12, 64, 3, 3, 2, 1, 1), (2, 128, 14, 14, 64, 1, 1, 2, 0, 1),
                (1, 64, 11, 11, 128, 3, 3, 3, 1, 2), (2, 64, 8, 8, 64, 3, 3, 1, 3, 1),
                (2, 32, 9, 10, 64, 5, 3, 2, 2, 1), (4, 128, 28, 28, 128, 3, 3, 2, 1, 1),
                (2, 64, 13, 11, 64, 1, 1, 3, 0, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", NATIVE_DGRAD, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_dgrad_native(case, dtype, rng):
    """dgrad's native kernel (dy and w read in place) against float64, plain, with the mask and with the prologue."""
    torch = pytest.importorskip("torch")
    p = _geometry(*case)
    xs, ws, _ = shapes(p, "NHWC")
    assert igemm.Conv2dGradInputPlan(xs, ws, dtype, "NHWC", *geom(p)).native is not None
    for mode in ("plain", "mask", "bn"):
        assert _run_case(torch, p, "NHWC", dtype, rng, "dgrad", mode) <= TOL[dtype], mode


@pytest.mark.gpu
@pytest.mark.parametrize("case", [NATIVE_DGRAD[i] for i in (0, 1, 8, 9, 13)], ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_dgrad_native_adds(case, dtype, rng):
    """dgrad's store adding into dx (``_run(..., add=True)``: the training path's identity gradient) equals the plain
    dgrad then a torch add, bit for bit, zero phases (stride > 1) included: rows no tap reaches keep dx."""
    torch = pytest.importorskip("torch")
    p = _geometry(*case)
    xs, ws, ys = shapes(p, "NHWC")
    plan = igemm.Conv2dGradInputPlan(xs, ws, dtype, "NHWC", *geom(p))
    assert plan.adds
    dy, w, old = (to_torch(rng.standard_normal(s), dtype) for s in (ys, ws, xs))
    h = torch.cuda.current_stream().cuda_stream
    plain, dx = poison(torch.empty_like(old)), old.clone()
    plan._run(h, dy.data_ptr(), w.data_ptr(), plain.data_ptr(), {"mask": 0, "z": 0, "coef": 0})
    plan._run(h, dy.data_ptr(), w.data_ptr(), dx.data_ptr(), {"mask": 0, "z": 0, "coef": 0}, add=True)
    torch.cuda.synchronize()
    assert torch.equal(dx, plain + old)


@pytest.mark.gpu
@pytest.mark.parametrize("case", NATIVE_WGRAD, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_wgrad_native(case, dtype, rng):
    """wgrad's native kernel (x and dy read in place) against float64, plain, with the mask and with the prologue;
    dw into an fp32 out and accumulated there."""
    torch = pytest.importorskip("torch")
    p = _geometry(*case)
    xs, ws, ys = shapes(p, "NHWC")
    assert igemm.Conv2dGradWeightPlan(xs, ws, dtype, "NHWC", *geom(p)).role == "native"
    _check_wgrad(torch, p, dtype, rng)


def _check_wgrad(torch, p: dict, dtype: str, rng, layout: str = "NHWC") -> tuple:
    """A wgrad plan against float64: plain, with the mask and with the prologue; dw into an fp32 out and
    accumulated there. Returns (x, dy, the float64 dw) of the last check."""
    xs, ws, ys = shapes(p, layout)
    for mode in ("plain", "mask", "bn"):
        assert _run_case(torch, p, layout, dtype, rng, "wgrad", mode) <= TOL[dtype], mode
    x, dy = to_torch(rng.standard_normal(xs), dtype), to_torch(rng.standard_normal(ys), dtype)
    ref = reference.conv2d_grad_weight_ref(to_numpy(x), to_numpy(dy), ws, *geom(p), layout)
    base = torch.randn(ws, dtype=torch.float32, device="cuda")
    out, acc = poison(torch.empty(ws, dtype=torch.float32, device="cuda")), base.clone()
    igemm.conv2d_grad_weight(x, dy, ws, *geom(p), layout=layout, out=out)
    igemm.conv2d_grad_weight(x, dy, ws, *geom(p), layout=layout, out=acc, accumulate=True)
    assert rel_err(to_numpy(out), ref) < TOL[dtype]
    assert rel_err(to_numpy(acc), ref + to_numpy(base)) < TOL[dtype]
    return x, dy, ref


#: the NCHW 1x1 kernel (P·Q % 8 == 0, C % 8 == 0) through the plan: an image's pixels in one partial k-tile (P·Q =
#: 56), partial tiles in M and N, N = 1, the rules' 64 x 64 and 128 x 64 tiles (N, C, H, W, K, 1, 1, 1, 0, 1)
NATIVE_NCHW_WGRAD = [(2, 64, 7, 8, 40, 1, 1, 1, 0, 1), (2, 200, 12, 10, 136, 1, 1, 1, 0, 1),
                     (1, 64, 28, 28, 256, 1, 1, 1, 0, 1), (4, 256, 14, 16, 128, 1, 1, 1, 0, 1),
                     (8, 128, 16, 16, 256, 1, 1, 1, 0, 1), (2, 8, 8, 8, 24, 1, 1, 1, 0, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", NATIVE_NCHW_WGRAD, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_wgrad_nchw_native(case, dtype, rng):
    """The NCHW 1x1 wgrad kernel (x and dy read in place) against float64: plain, with the mask and with the
    prologue (formed first), dw into an fp32 out and accumulated there, and dw in its own dtype."""
    from igemm.conv import _native_nchw
    plan = _check_nchw_wgrad(case, dtype, rng)
    assert isinstance(plan.native, _native_nchw.NativeWgradNchw) and plan._nchw is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_wgrad_nchw_variants(dtype, rng):
    """Each NCHW 1x1 kernel variant against float64 on partial tiles in M and N (K = 200, C = 136, P·Q = 120: two
    k-tiles an image, the second partial), launched as for a GPU of 1 and of 132 SMs, with one split storing dw and
    with two and five storing partials."""
    torch = pytest.importorskip("torch")
    from igemm.conv import _native_nchw
    h = torch.cuda.current_stream().cuda_stream
    xs, ws = (3, 136, 12, 10), (200, 136, 1, 1)
    g = GradWeightProblem(xs, ws, "NCHW", 1, 0, 1)
    x, dy = to_torch(rng.standard_normal(xs), dtype), to_torch(rng.standard_normal((3, 200, 12, 10)), dtype)
    ref = reference.conv2d_grad_weight_ref(to_numpy(x), to_numpy(dy), ws, 1, 0, 1, "NCHW")
    names = [n for n, _ in _native_nchw.all_variants() if n.startswith(f"wgrad_nchw_{dtype}_")]
    for n in names:
        f = n.split("_")                                 # wgrad nchw dtype BMxBN sS out [ws]
        bm, bn = map(int, f[3].split("x"))
        for splits in ((1,) if f[5] == dtype else (2, 5)):
            spec = _native_nchw.WgradNchwSpec(dtype, f[5], bm, bn, int(f[4][1:]), splits, "_ws" in n)
            assert spec.name() == n
            for sms in (1, 132):
                dw = poison(torch.empty(ws, dtype=getattr(torch, dtype), device="cuda"))
                _native_nchw.NativeWgradNchw(g, dtype, dtype, False, 0, sms, spec).launch(
                    h, x.data_ptr(), dy.data_ptr(), dw.data_ptr())
                torch.cuda.synchronize()
                assert rel_err(to_numpy(dw), ref) < TOL[dtype], (n, splits, sms)


def _check_nchw_wgrad(case: tuple, dtype: str, rng):
    """An NCHW wgrad plan against float64 (``_check_wgrad``), then dw in its own dtype; returns the plan."""
    torch = pytest.importorskip("torch")
    p = _geometry(*case)
    xs, ws, ys = shapes(p, "NCHW")
    plan = igemm.Conv2dGradWeightPlan(xs, ws, dtype, "NCHW", *geom(p))
    x, dy, ref = _check_wgrad(torch, p, dtype, rng, "NCHW")
    dw = poison(torch.empty(ws, dtype=getattr(torch, dtype), device="cuda"))
    plan(x, dy, out=dw)
    assert rel_err(to_numpy(dw), ref) < TOL[dtype]
    return plan


#: NCHW wgrads on the NHWC twin's kernel: strided unpadded 1x1s (x only where read: 8-byte pair loads, element
#: loads at stride 3), a 1x1 of 49 pixels an image (dy by the 16-byte run tiles, dw written by the twin), a 3x3 over
#: 7 x 7 images (dw' back by the mirror tiles), a 5x3 filter, the few-channel twin (conv1's 3 channels, 7x7 / 2), a
#: 9x9 filter
NCHW_TWIN_WGRAD = [(2, 64, 14, 14, 128, 1, 1, 2, 0, 1), (2, 64, 13, 11, 64, 1, 1, 3, 0, 1),
                   (3, 64, 7, 7, 136, 1, 1, 1, 0, 1), (2, 64, 7, 7, 128, 3, 3, 1, 1, 1),
                   (2, 128, 9, 10, 64, 5, 3, 1, 1, 1), (2, 3, 30, 30, 64, 7, 7, 2, 3, 1),
                   (2, 64, 12, 12, 64, 9, 9, 1, 4, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", NCHW_TWIN_WGRAD, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_wgrad_nchw_twin(case, dtype, rng):
    """A 16-bit NCHW wgrad on its NHWC twin's kernel against float64: plain, with the mask and with the prologue,
    dw into an fp32 out and accumulated there, and dw in its own dtype."""
    plan = _check_nchw_wgrad(case, dtype, rng)
    assert plan._nchw is not None and plan.native.g.layout == "NHWC"


def test_wgrad_native_choice():
    """wgrad's native kernel where it can run (sm_90a, 16-bit NHWC, C % 64 == 0, K % 8 == 0), the reason where not;
    its split of the reduction fills the GPU, and one split stores dw directly."""
    from igemm.conv import _native
    g = GradWeightProblem((2, 12, 12, 64), (64, 3, 3, 64), "NHWC", 1, 1, 1)
    assert _native.unsupported(g, "float16", "NHWC", "sm_90a") is None
    for args, why in ((("float16", "NHWC", "sm_80"), "sm_90a"), (("float32", "NHWC", "sm_90a"), "16-bit"),
                      (("float16", "NCHW", "sm_90a"), "NHWC")):
        assert why in _native.unsupported(g, *args)
    assert "C % 64" in _native.unsupported(GradWeightProblem((2, 12, 12, 32), (64, 3, 3, 32), "NHWC", 1, 1, 1),
                                          "float16", "NHWC", "sm_90a")
    assert "K % 8" in _native.unsupported(GradWeightProblem((2, 12, 12, 64), (60, 3, 3, 64), "NHWC", 1, 1, 1),
                                         "float16", "NHWC", "sm_90a")
    big = GradWeightProblem((32, 56, 56, 64), (64, 3, 3, 64), "NHWC", 1, 1, 1)      # 9 tiles, 1568 k-tiles
    s = _native.choose_spec(big, "float16", "float16", False, 132)
    assert (s.bm, s.bn, s.ws, s.out, s.splits) == (64, 64, False, "float32", 44)     # 3 CTAs an SM, filled
    wide = GradWeightProblem((32, 7, 7, 512), (512, 3, 3, 512), "NHWC", 1, 1, 1)     # 144 tiles of 128 x 128
    s = _native.choose_spec(wide, "float16", "float16", False, 132)
    assert (s.bm, s.bn, s.ws, s.splits) == (128, 128, True, 1)
    assert s.out == "float16" and _native.choose_spec(wide, "float16", "float16", True, 132).out == "float32"
    deep = GradWeightProblem((256, 7, 7, 512), (512, 3, 3, 512), "NHWC", 1, 1, 1)    # 8x the reduction: split
    assert _native.choose_spec(deep, "float16", "float16", False, 132).splits == 3
    few = GradWeightProblem((32, 7, 7, 512), (2048, 1, 1, 512), "NHWC", 1, 0, 1)      # 64 tiles, one split
    s = _native.choose_spec(few, "float16", "float16", False, 132)
    assert (s.bm, s.bn, s.ws, s.splits, s.out) == (128, 64, True, 1, "float16")
    for N in (32, 256):                              # a 1x1 of 4 tiles: a deep ring, one CTA an SM
        one = GradWeightProblem((N, 56, 56, 64), (256, 1, 1, 64), "NHWC", 1, 0, 1)
        s = _native.choose_spec(one, "float16", "float16", False, 132)
        assert (s.bm, s.bn, s.ws, s.stages, s.splits) == (64, 64, True, 8, 33)
        assert s.smem + 1024 <= _native._SM_SMEM and replace(s, mask=True).smem + 1024 <= _native._SM_SMEM
    for N, spec in ((32, (128, 64, 6, 4)), (256, (128, 128, 4, 8))):   # short splits of 128 x 128 tiles: 128 x 64
        one = GradWeightProblem((N, 14, 14, 1024), (256, 1, 1, 1024), "NHWC", 1, 0, 1)
        s = _native.choose_spec(one, "float16", "float16", False, 132)
        assert (s.bm, s.bn, s.stages, s.splits, s.ws) == (*spec, True)
        k = _native.NativeWgrad(one, "float16", "float16", False, None, 132)       # the masked twin: 128 x 128
        m = k.mask_spec
        assert k.spec == s and (m.bm, m.bn, m.stages, m.ws, m.mask) == (128, 128, 4, True, True)
        assert [v.kernel()[0] for v in k.kernels()] == [s.name(), m.name(), "split_sum_float16"]
    wide1 = GradWeightProblem((32, 14, 14, 1024), (200, 1, 1, 1024), "NHWC", 1, 0, 1)   # 64 x 128 tiles: 6 stages
    s = _native.choose_spec(wide1, "float16", "float16", False, 132)
    assert (s.bm, s.bn, s.stages, s.splits, s.ws) == (64, 128, 6, 4, True)
    assert s.smem + 1024 <= _native._SM_SMEM and replace(s, mask=True).smem + 1024 <= _native._SM_SMEM
    for tiles, kt in ((1, 1), (9, 1568), (36, 98), (144, 49), (7, 5)):
        sp = _native._best_splits(tiles, kt, 2 ** 20, 132)
        assert 1 <= sp <= kt and (sp - 1) * -(-kt // sp) < kt, (tiles, kt, sp)      # no empty split
    plan = igemm.Conv2dGradWeightPlan((32, 56, 56, 64), (64, 3, 3, 64), "float16", "NHWC", 1, 1, device="numpy")
    assert plan.role == "native" and [k.kernel()[0] for k in plan.sub_plans()] == [
        plan.native.spec.name(), plan.native.spec.name() + "_m", "split_sum_float16"]
    assert igemm.Conv2dGradWeightPlan((32, 56, 56, 64), (64, 3, 3, 64), "float16", "NHWC", 1, 1, device="numpy",
                                      arch="sm_80").role is None


def test_wgrad_nchw_choice(rng):
    """The NCHW 1x1 wgrad kernel where it can run (sm_90a, 16-bit, 1x1 stride 1 unpadded, P·Q % 8 == 0, C % 8 == 0),
    the NHWC twin on transposed copies elsewhere; its tiles and splits are the NHWC kernel's, and its k-tiles (64
    pixels of one image, units = tiles x splits as packed) sum to dw (numpy, unit by unit)."""
    from igemm.conv import _native, _native_nchw
    g = GradWeightProblem((32, 64, 56, 56), (256, 64, 1, 1), "NCHW", 1, 0, 1)
    assert _native_nchw.unsupported(g, "float16", "sm_90a") is None
    for args, why in ((("float16", "sm_80"), "sm_90a"), (("float32", "sm_90a"), "16-bit")):
        assert why in _native_nchw.unsupported(g, *args)
    for xs, ws, st, pad, why in (((2, 64, 14, 14), (64, 64, 1, 1), 1, 0, "P·Q % 8"),
                                 ((2, 60, 8, 8), (64, 60, 1, 1), 1, 0, "C % 8"),
                                 ((2, 64, 8, 8), (64, 64, 3, 3), 1, 1, "1x1"),
                                 ((2, 64, 16, 16), (64, 64, 1, 1), 2, 0, "1x1")):
        assert why in _native_nchw.unsupported(GradWeightProblem(xs, ws, "NCHW", st, pad, 1), "float16", "sm_90a")
        plan = igemm.Conv2dGradWeightPlan(xs, ws, "float16", "NCHW", st, pad, device="numpy")
        assert not isinstance(plan.native, _native_nchw.NativeWgradNchw)
    # the twin of a strided unpadded 1x1: the stride-1 1x1 on x[:, :, ::2, ::2] (the transpose's subsampled job),
    # writing dw itself (accumulating there); a 3x3's twin is the problem in NHWC, its dw' transposed back
    sub = igemm.Conv2dGradWeightPlan((32, 512, 28, 28), (1024, 512, 1, 1), "float16", "NCHW", 2, 0, device="numpy",
                                     accumulate=True, out_dtype="float32")
    t = sub.native.g
    assert (t.x_shape, t.stride, t.layout, sub.native.spec.out) == ((32, 14, 14, 512), (1, 1), "NHWC", "float32")
    assert sub.native.accumulate and sub.problem.x_job().sub == (14, 28, 2, 2, 784)
    for st, pad, R in ((2, 1, 1), (1, 0, 1), (2, 1, 3)):
        q = igemm.Conv2dGradWeightPlan((2, 64, 14, 14), (64, 64, R, R), "float16", "NCHW", st, pad, device="numpy",
                                       accumulate=True, out_dtype="float32")
        job = q.problem.x_job()
        assert q.native.g.x_shape == (2, 14, 14, 64) and job.sub is None and job.cols == 196
        assert q.native.accumulate == (R == 1)
    plan = igemm.Conv2dGradWeightPlan((32, 64, 56, 56), (256, 64, 1, 1), "float16", "NCHW", device="numpy")
    k = plan.native
    assert isinstance(k, _native_nchw.NativeWgradNchw) and plan._nchw is None and not k.fuses_mask(0)
    twin = _native.choose_spec(g.nhwc(), "float16", "float16", False, 132)
    assert vars(k.spec) == vars(twin) and k.spec.name().startswith("wgrad_nchw_")
    assert [s.kernel()[0] for s in plan.sub_plans()] == [k.spec.name(), "split_sum_float16"]
    for xs, ws, bm, bn, splits in (((2, 24, 7, 8), (40, 24, 1, 1), 64, 64, 3), ((3, 200, 5, 8), (136, 200, 1, 1),
                                                                                  128, 128, 2)):
        gg = GradWeightProblem(xs, ws, "NCHW", 1, 0, 1)
        kk = _native_nchw.NativeWgradNchw(gg, "float16", "float16", False, None, 132,
                                          _native_nchw.WgradNchwSpec("float16", "float32", bm, bn, 4, splits))
        v = kk._values(kk.spec)
        x, dy = rng.standard_normal(xs), rng.standard_normal((xs[0], ws[0], xs[2], xs[3]))
        pq, xr, dyr = xs[2] * xs[3], None, None
        xr = np.zeros((xs[0], -(-xs[1] // bn) * bn, v["fd_T"] * 64))
        dyr = np.zeros((xs[0], -(-ws[0] // bm) * bm, v["fd_T"] * 64))
        xr[:, :xs[1], :pq], dyr[:, :ws[0], :pq] = x.reshape(xs[0], xs[1], pq), dy.reshape(xs[0], ws[0], pq)
        tn, tiles = -(-v["Ncol"] // bn), -(-v["M"] // bm) * -(-v["Ncol"] // bn)
        dw = np.zeros((v["splits"], dyr.shape[1], xr.shape[1]))
        for u in range(tiles * v["splits"]):            # WgradNchwWork::unit / issue
            z, t = divmod(u, tiles)
            m0, n0 = t // tn * bm, t % tn * bn
            kt0 = z * v["kt_per_split"]
            for kt in range(kt0, min(v["kt"], kt0 + v["kt_per_split"])):
                n, j = divmod(kt, v["fd_T"])
                dw[z, m0:m0 + bm, n0:n0 + bn] += dyr[n, m0:m0 + bm, 64 * j:64 * j + 64] @ \
                    xr[n, n0:n0 + bn, 64 * j:64 * j + 64].T
        want = reference.conv2d_grad_weight_ref(x, dy, ws, 1, 0, 1, "NCHW")
        assert rel_err(dw.sum(0)[:ws[0], :xs[1]].reshape(ws), want) < 1e-12


#: NCHW dgrads on the NHWC twin's kernel (dy and w transposed, dx moved back): 3x3/2 (four phases, odd
#: sizes), a strided 1x1 (three zero phases, which its copies write; w read as it is), stride 3 with dilation, a
#: stride-1 3x3 over 7 x 7 images (dy and dx by the 16-byte run tiles); the strided 1x1s' twins are stride-1 1x1s, dx
#: scattered back with the zeros (16-byte stores where H·W % 8 == 0)
NCHW_TWIN_DGRAD = [(2, 64, 13, 11, 64, 3, 3, 2, 1, 1), (2, 72, 14, 13, 128, 1, 1, 2, 0, 1),
                   (1, 64, 11, 11, 128, 3, 3, 3, 1, 2), (3, 128, 7, 7, 64, 3, 3, 1, 1, 1),
                   (2, 64, 16, 14, 128, 1, 1, 2, 0, 1), (2, 64, 13, 11, 64, 1, 1, 3, 0, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", NCHW_TWIN_DGRAD, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_dgrad_nchw_twin(case, dtype, rng):
    """A 16-bit NCHW dgrad on its NHWC twin's kernel against float64: plain, with the mask and with the prologue
    (applied on dy's move to NHWC); it does not add into dx."""
    pytest.importorskip("torch")
    import torch
    p = _geometry(*case)
    xs, ws, _ = shapes(p, "NCHW")
    plan = igemm.Conv2dGradInputPlan(xs, ws, dtype, "NCHW", *geom(p))
    assert plan._nchw is not None and not plan.adds and plan.native.g.layout == "NHWC"
    for mode in ("plain", "mask", "bn"):
        assert _run_case(torch, p, "NCHW", dtype, rng, "dgrad", mode) <= TOL[dtype], mode


#: NCHW 1x1 stride-1 dgrads with w read as it lies (MN-major B tiles), on the forward's in-place kernel (H·W % 64 ==
#: 0): the per-tile kernel at 64 and 128 columns (a partial column tile), the persistent kernel of three CTAs an SM;
#: on the transpose path's TMA kernel (dy copied to NHWC; 196, 49 and 100 pixels): per-tile at 64 and 128 columns,
#: persistent with a partial column tile (N, C, H, K, config)
W_IN_PLACE_DGRAD = [(2, 96, 16, 128, None), (2, 192, 8, 64, {"bn": 128}), (16, 64, 56, 256, None),
                    (4, 256, 56, 64, None), (2, 96, 14, 128, None), (3, 192, 7, 128, {"bn": 128}),
                    (2, 136, 10, 64, {"math": "wgmma_ws", "bm": 64, "wm": 1, "bn": 128, "stages": 3, "splits": 1,
                                      "ctas": 2})]


@pytest.mark.gpu
@pytest.mark.parametrize("case", W_IN_PLACE_DGRAD, ids=lambda c: "x".join(map(str, c[:4])))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_dgrad_nchw_w_in_place(case, dtype, rng):
    """A 16-bit NCHW 1x1 dgrad reads w [K][C] in place (no filter move) against float64: plain, with the mask and the
    prologue (the rules' own kernels), and with w at an address that is not 16-byte aligned (copied first)."""
    torch = pytest.importorskip("torch")
    N, C, H, K, cfg = case
    p = _geometry(N, C, H, H, K, 1, 1, 1, 0, 1)
    xs, ws, _ = shapes(p, "NCHW")
    opt = igemm.Conv2dOptions(config=cfg) if cfg else None
    plan = igemm.Conv2dGradInputPlan(xs, ws, dtype, "NCHW", 1, 0, options=opt)
    assert [q._w_mn and q.spec().load_b for q in plan.sub_plans()] == ["tmamn"]
    if cfg is None:
        for mode in ("plain", "mask", "bn"):
            assert _run_case(torch, p, "NCHW", dtype, rng, "dgrad", mode) <= TOL[dtype], mode
    t = getattr(torch, dtype)
    dy = torch.randn(N, K, H, H, device="cuda", dtype=t)
    flat = torch.randn(K * C + 1, device="cuda", dtype=t)
    for w in (flat[:-1].view(ws), flat[1:].view(ws)):            # (the second: 2 bytes past an aligned base)
        out = poison(torch.empty(xs, device="cuda", dtype=t))
        plan(dy, w, out=out)
        ref = reference.conv2d_grad_input_ref(to_numpy(dy), to_numpy(w), xs, 1, 0, 1, "NCHW")
        assert rel_err(to_numpy(out), ref) <= TOL[dtype]


def test_dgrad_nchw_twin_choice():
    """A strided 16-bit NCHW dgrad, or a stride-1 one with taps over images under 64 pixels, runs its NHWC twin's
    native kernel (sm_90a, K % 64 == 0, C % 8 == 0); other stride-1 ones, fp32, or a twin the kernel cannot run keep
    the forward's kernels by phases; the twin does not add into dx."""
    def plan(xs, ws, dtype="float16", st=2, pad=1, arch="sm_90a"):
        return igemm.Conv2dGradInputPlan(xs, ws, dtype, "NCHW", st, pad, device="numpy", arch=arch)
    p = plan((32, 128, 56, 56), (128, 128, 3, 3))
    assert p._nchw is not None and p.native.g.x_shape == (32, 56, 56, 128) and not p.adds
    assert [k.kernel()[0] for k in p.sub_plans()] == [s.name() for s in p.native.kernels()]
    with pytest.raises(ValueError, match="add"):
        p._run(0, 0, 0, 0, {"mask": 0, "z": 0, "coef": 0}, add=True)
    one = plan((32, 512, 28, 28), (1024, 512, 1, 1), pad=0)          # a strided 1x1: the stride-1 1x1, dx scattered
    assert one.native.g.x_shape == (32, 14, 14, 512) and one.native.g.stride == (1, 1)
    assert one.problem.dx_job().scatter == (14, 28, 2, 2) and p.problem.dx_job().scatter is None
    small = plan((32, 512, 7, 7), (512, 512, 3, 3), st=1)                        # 49 pixels an image, 9 taps
    assert small._nchw is not None and small.native.g.stride == (1, 1)
    for q in (plan((32, 128, 56, 56), (128, 128, 3, 3), st=1), plan((2, 64, 8, 8), (64, 64, 3, 3), "float32"),
              plan((32, 512, 7, 7), (2048, 512, 1, 1), st=1, pad=0), plan((2, 64, 8, 8), (64, 64, 3, 3), st=1),
              plan((2, 64, 8, 8), (60, 64, 3, 3)), plan((2, 64, 8, 8), (64, 64, 3, 3), arch="sm_80")):
        assert q._nchw is None and q.native is None


def test_dgrad_nchw_w_in_place_choice():
    """An NCHW 1x1 stride-1 dgrad whose sub-convolution loads by TMA (16-bit, sm_90a, K % 64 == 0; x in place where
    H·W % 64 == 0, else on the transpose path) reads w as it lies (MN-major B tiles, no filter move) where C % 8 == 0;
    elsewhere the filter is moved."""
    def plan(xs, ws, dtype="float16", arch="sm_90a"):
        return igemm.Conv2dGradInputPlan(xs, ws, dtype, "NCHW", 1, 0, device="numpy", arch=arch, sms=132)
    for xs, ws, kind in (((32, 64, 56, 56), (256, 64, 1, 1), "tmamntmamn"),
                         ((32, 256, 56, 56), (64, 256, 1, 1), "tmamntmamn"),
                         ((32, 1024, 14, 14), (256, 1024, 1, 1), "tmatmamn"), ((32, 512, 7, 7), (2048, 512, 1, 1),
                                                                              "tmatmamn")):
        (sub,) = plan(xs, ws).sub_plans()
        assert sub._w_mn and sub.spec().load_b == "tmamn" and kind in sub.kernel()[0]
    for q in (plan((32, 64, 56, 56), (256, 64, 1, 1), "float32"), plan((2, 100, 14, 14), (128, 100, 1, 1)),
              plan((2, 96, 16, 16), (200, 96, 1, 1)), plan((2, 96, 16, 16), (128, 96, 1, 1), arch="sm_80")):
        assert not any(s._w_mn for s in q.sub_plans())


FLIP_DGRAD = [(2, 64, 12, 12, 64, 3, 3, 1, 1), (3, 40, 9, 11, 16, 5, 3, 2, 2), (2, 128, 14, 14, 256, 3, 3, 1, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", FLIP_DGRAD, ids=lambda c: "x".join(map(str, c[:7])))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_dgrad_nchw_flip(case, dtype, rng):
    """A 16-bit NCHW stride-1 dgrad with taps makes its sub-convolution's flipped KRSC filter from w in the
    transpose path's launch (no filter move) against float64: R != S and dilation 2 (the flip along both axes),
    with the mask and the prologue, and with w at an address that is not 16-byte aligned (copied first)."""
    torch = pytest.importorskip("torch")
    N, C, H, W, K, R, S, pad, dil = case
    p = _geometry(N, C, H, W, K, R, S, 1, pad, dil)
    xs, ws, ys = shapes(p, "NCHW")
    plan = igemm.Conv2dGradInputPlan(xs, ws, dtype, "NCHW", 1, pad, dil)
    assert plan.native is None and [q._w_flip for q in plan.sub_plans()] == [True]
    for mode in ("plain", "mask", "bn"):
        assert _run_case(torch, p, "NCHW", dtype, rng, "dgrad", mode) <= TOL[dtype], mode
    t = getattr(torch, dtype)
    dy = torch.randn(ys, device="cuda", dtype=t)
    flat = torch.randn(K * C * R * S + 1, device="cuda", dtype=t)
    for w in (flat[:-1].view(ws), flat[1:].view(ws)):            # (the second: 2 bytes past an aligned base)
        out = poison(torch.empty(xs, device="cuda", dtype=t))
        plan(dy, w, out=out)
        ref = reference.conv2d_grad_input_ref(to_numpy(dy), to_numpy(w), xs, 1, pad, dil, "NCHW")
        assert rel_err(to_numpy(out), ref) <= TOL[dtype]


def test_dgrad_nchw_flip_choice():
    """A 16-bit NCHW stride-1 dgrad with taps whose sub-convolution takes the transpose path (K % 8 == 0) and whose
    filter rows are whole 16-byte vectors (C·R·S % 8 == 0) has it flip w in that launch; a 1x1, fp32, a strided or
    an NHWC problem, or those counts off 8, move the filter first."""
    def plan(xs, ws, dtype="float16", st=1, pad=1, layout="NCHW"):
        return igemm.Conv2dGradInputPlan(xs, ws, dtype, layout, st, pad, device="numpy", arch="sm_90a", sms=132)
    for xs, ws in (((32, 64, 56, 56), (64, 64, 3, 3)), ((32, 128, 28, 28), (128, 128, 3, 3)),
                   ((32, 256, 14, 14), (256, 256, 3, 3)), ((2, 56, 9, 9), (16, 56, 3, 5))):
        (sub,) = plan(xs, ws).sub_plans()
        assert sub._w_flip and sub.path == "transpose"
    from igemm.conv import _transpose as T
    job = T.TransposeJob(1, 256, 256 * 9, 2, flip=9)
    assert job.mode(0, 0, first=False) == T.VECFLIP and job.geometry(T.VECFLIP) == (4, 36, 144)
    for bad in (dict(first=True), dict(src=8)):
        with pytest.raises(ValueError, match="flip"):
            job.mode(bad.get("src", 0), 0, first=bad.get("first", False))
    with pytest.raises(ValueError, match="flip"):
        T.TransposeJob(1, 60, 64 * 9, 2, flip=9)          # rows % 8
    with pytest.raises(ValueError, match="flip"):
        T.TransposeJob(1, 64, 64 * 9, 4, flip=9)          # fp32
    for q in (plan((32, 64, 56, 56), (64, 64, 1, 1), pad=0), plan((2, 64, 8, 8), (64, 64, 3, 3), "float32"),
              plan((2, 64, 16, 16), (64, 64, 3, 3), st=2), plan((2, 60, 9, 9), (16, 60, 3, 3)),
              plan((2, 64, 9, 9), (20, 64, 3, 3))):
        assert not any(getattr(s, "_w_flip", False) for s in q.sub_plans())
    q = plan((2, 9, 9, 64), (40, 3, 3, 64), layout="NHWC")          # (K % 64: the forward's kernels, not native)
    assert q.native is None and q.sub_plans() and not any(s._w_flip for s in q.sub_plans())


def test_dz_pass_geometry():
    """The dz pass's launch: where it runs (16-bit, K % 8 == 0, K <= 2048, aligned pointers), and blocks of a
    multiple of K / 8 threads (the kernel keeps a thread's channels across its pixels), one wave at most, no
    block without a pixel."""
    from igemm.conv import _moves
    assert _moves.dz_fits("float16", 64, 256, 512) and _moves.dz_fits("bfloat16", 2048)
    for args in (("float32", 64), ("float16", 60), ("float16", 2056), ("float16", 64, 256, 8)):
        assert not _moves.dz_fits(*args), args
    for K in range(8, 2049, 8):
        for M in (1, 7, 1000, 401408):
            grid, block = _moves.dz_geometry(M, K, 132)
            kc = K // 8
            assert block % kc == 0 and 0 < block <= 256 and grid * block <= 132 * 2048 + block, (M, K)
            assert (grid - 1) * block < M * kc, (M, K)


@pytest.mark.gpu
@pytest.mark.parametrize("M,K", [(1, 8), (37, 40), (300, 64), (17, 2048)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_dz_pass(M, K, dtype, rng):
    """The channels-last dz pass (``_moves.launch_dz``) against float64: the mask's select (non-finite dy where the
    bit is 0 gives 0), the BN prologue with and without a mask, and the select written beside it."""
    torch = pytest.importorskip("torch")
    from igemm.conv import _moves
    dy, z, y = (to_torch(rng.standard_normal((M, K)), dtype) for _ in range(3))
    dy[y <= 0] = float("inf")
    mask = igemm.relu_mask(y)
    coef = torch.tensor(rng.standard_normal((3, K)), dtype=torch.float32, device="cuda")
    h = torch.cuda.current_stream().cuda_stream
    finite = to_torch(rng.standard_normal((M, K)), dtype)
    for mode, m in (("mask", mask), ("bn", mask), ("bn", None)):
        if m is None:
            dy = finite                            # (no mask: every element reaches dz)
        dz, sel = poison(torch.empty_like(dy)), poison(torch.empty_like(dy))
        assert _moves.dz_fits(dtype, K, dy.data_ptr(), dz.data_ptr(), z.data_ptr(), coef.data_ptr())
        _moves.launch_dz(0, h, dtype, M, K, dy.data_ptr(), dz.data_ptr(), mode=mode,
                         mask=m.data_ptr() if m is not None else 0, z=z.data_ptr() if mode == "bn" else 0,
                         coef=coef.data_ptr() if mode == "bn" else 0, sel=sel.data_ptr())
        torch.cuda.synchronize()
        bits = to_numpy(m).view(np.uint32) if m is not None else None
        pro = (to_numpy(z), *to_numpy(coef)) if mode == "bn" else None
        d = to_numpy(dy)
        assert rel_err(to_numpy(dz), reference.grad_prologue_ref(d, bits, pro, "NHWC")) < TOL[dtype], mode
        if m is not None:
            assert rel_err(to_numpy(sel), reference.grad_prologue_ref(d, bits, None, "NHWC")) == 0, mode


def emulate_native_dgrad(dy, w, x_shape, stride, padding, dilation, bm=128, bn=64):
    """The native dgrad kernel's arithmetic in numpy (NHWC), unit by unit as csrc/conv/dgrad_sm90.cuh runs it, from
    the launch values igemm/conv/_native_dgrad.py packs (the phases' ``DgradPhase`` bytes decoded by _PHASE_FIELDS):
    unit u belongs to the last phase whose u0 <= u; its sub-output pixel (n, i, j) sums dy at (i − pad + t·dil, j −
    pad + u·dil) (zero outside) times w at the filter's tap (last − t·step, ...), and lands at dx (ph + st·(i −
    crop), ...) inside the phase's rows. dx starts zeroed (the memset), or NaN where the rows' copies write the zeros
    of the pixels beside them (``fills_zeros``: DgradWork::zeros)."""
    from igemm.conv import _native_dgrad
    g = GradInputProblem(x_shape, w.shape, "NHWC", stride, padding, dilation)
    zeros = _native_dgrad.fills_zeros(g)
    dx = np.full(x_shape, np.nan) if zeros else np.zeros(x_shape)
    live = _native_dgrad._live_phases(g)
    nf = len(_native_dgrad._PHASE_FIELDS)
    for i0 in range(0, len(live), _native_dgrad.MAX_PHASES):
        v = _native_dgrad.launch_values(g, live[i0:i0 + _native_dgrad.MAX_PHASES], bm, bn)
        fs = []
        for i in range(v["nph"]):
            raw = np.frombuffer(v[f"f{i}"], dtype=np.int32)
            f = dict(zip(_native_dgrad._PHASE_FIELDS, raw[:nf].tolist()))
            f.update({n: int(raw[nf + 3 * j]) for j, n in enumerate(_native_dgrad._PHASE_DIVS)})   # (the divisors' d)
            fs.append(f)
        kb, tn = v["fd_KB"], -(-g.C // bn)
        for u in range(v["units"]):
            f = fs[sum(1 for j in range(1, v["nph"]) if u >= fs[j]["u0"])]
            m0, n0 = (u - f["u0"]) // tn * bm, (u - f["u0"]) % tn * bn
            rows = np.arange(m0, min(m0 + bm, f["M"]))
            n, ij = np.divmod(rows, f["fd_PQ"])
            i, j = np.divmod(ij, f["fd_Q"])
            acc = np.zeros((len(rows), min(bn, g.C - n0)))
            assert f["KT"] == f["fd_T"] * (f["KT"] // (f["fd_T"] * kb)) * kb
            for tap in range(f["KT"] // kb):
                t, uu = divmod(tap, f["fd_T"])
                hh, ww = i - f["ph"] + t * f["dh"], j - f["pw"] + uu * f["dw"]
                ok = (hh >= 0) & (hh < g.P) & (ww >= 0) & (ww < g.Q)
                a = np.where(ok[:, None], dy[n, np.clip(hh, 0, g.P - 1), np.clip(ww, 0, g.Q - 1)], 0)
                acc += a @ w[:, f["lh"] - t * f["eh"], f["lw"] - uu * f["ew"], n0:n0 + acc.shape[1]]
            i, j = i - f["crop_h"], j - f["crop_w"]
            keep = (i >= 0) & (i < f["rows_h"]) & (j >= 0) & (j < f["rows_w"])
            dx[n[keep], f["ph_h"] + v["st_h"] * i[keep], f["ph_w"] + v["st_w"] * j[keep], n0:n0 + acc.shape[1]] = \
                acc[keep]
            if zeros:                          # (the kernel's block of st_h x st_w pixels at (st_h·i, st_w·j))
                for a in range(v["st_h"]):
                    for b in range(v["st_w"]):
                        h, ww = v["st_h"] * i + a, v["st_w"] * j + b
                        z = (a + b > 0) & (h < g.H) & (ww < g.W)
                        dx[n[z], h[z], ww[z], n0:n0 + acc.shape[1]] = 0
    return dx


def test_native_launch_signatures():
    """The plans launch every native kernel object the same way: launch(h, a, b, out, mask) (the few-channel wgrad
    too, which takes no mask but 0)."""
    import inspect
    from igemm.conv import _native, _native_dgrad, _wgrad_small
    for cls in (_native.NativeWgrad, _native_dgrad.NativeDgrad, _wgrad_small.SmallWgrad):
        inspect.signature(cls.launch).bind(None, 0, 0, 0, 0, mask=0)     # (TypeError where it cannot)
        inspect.signature(cls.launch).bind(None, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="mask"):
        _wgrad_small.SmallWgrad.launch(None, 0, 0, 0, 0, 16)


def test_dgrad_phase_struct():
    """_PHASE_FIELDS and _PHASE_DIVS name csrc/conv/dgrad_sm90.cuh's DgradPhase fields in its order (the launch packs
    them by position)."""
    import re
    from igemm import _build
    from igemm.conv import _native_dgrad
    src = (_build.csrc_dir() / "conv" / "dgrad_sm90.cuh").read_text()
    body = re.search(r"struct DgradPhase \{(.*?)\};", src, re.S).group(1)
    ints = re.search(r"int32_t ([^;]*);", body).group(1)
    divs = re.search(r"FastDiv ([^;]*);", body).group(1)
    assert [n.strip() for n in ints.split(",")] == list(_native_dgrad._PHASE_FIELDS)
    assert [n.strip() for n in divs.split(",")] == list(_native_dgrad._PHASE_DIVS)


def test_native_dgrad_emulated(rng):
    """The native dgrad's units and phase mapping (which phase a unit is, its taps, padding, crop, where its rows
    land), as packed for the kernel, equal the reference."""
    for case in NATIVE_DGRAD:
        p = _geometry(*case)
        xs, ws, ys = shapes(p, "NHWC")
        dy, w = rng.standard_normal(ys), rng.standard_normal(ws)
        want = reference.conv2d_grad_input_ref(dy, w, xs, *geom(p), "NHWC")
        for bm, bn in ((128, 64), (64, 128)):
            assert rel_err(emulate_native_dgrad(dy, w, xs, *geom(p), bm, bn), want) < 1e-12, (case, bm, bn)


def test_dgrad_native_choice():
    """dgrad's native kernel where it can run (sm_90a, 16-bit NHWC, K % 64 == 0, C % 8 == 0; any stride, by
    phases), the reason where not."""
    from igemm.conv import _native_dgrad
    g = GradInputProblem((2, 12, 12, 64), (64, 3, 3, 64), "NHWC", 1, 1, 1)
    assert _native_dgrad.dgrad_unsupported(g, "float16", "NHWC", "sm_90a") is None
    assert "sm_90a" in _native_dgrad.dgrad_unsupported(g, "float16", "NHWC", "sm_80")
    for shapes_, why in ((((2, 12, 12, 64), (48, 3, 3, 64)), "K % 64"), (((2, 12, 12, 60), (64, 3, 3, 60)), "C % 8")):
        assert why in _native_dgrad.dgrad_unsupported(GradInputProblem(*shapes_, "NHWC", 1, 1, 1), "float16", "NHWC",
                                                "sm_90a")
    plan = igemm.Conv2dGradInputPlan((32, 56, 56, 64), (64, 3, 3, 64), "float16", "NHWC", 1, 1, device="numpy")
    assert plan.native is not None and [k.kernel()[0] for k in plan.sub_plans()] == [
        "dgrad_float16_128x64_s3_ws_tma", "dgrad_float16_128x64_s3_ws_add_tma", "dgrad_float16_128x64_s3_ws_tma_m",
        "dgrad_float16_128x64_s3_ws_tma_bs"]
    strided = igemm.Conv2dGradInputPlan((32, 56, 56, 128), (128, 3, 3, 128), "float16", "NHWC", 2, 1, device="numpy")
    assert strided.native is not None and not strided.native.zero
    assert igemm.Conv2dGradInputPlan((32, 56, 56, 256), (512, 1, 1, 256), "float16", "NHWC", 2, 0,
                                     device="numpy").native.zero        # (three of the four phases are zero)
    def spec(xs, ws, st=1, pad=1):
        g = GradInputProblem(xs, ws, "NHWC", st, pad, 1)
        s = _native_dgrad.choose_dgrad_spec(g, "float16", 132)
        want = "tensor" if st == 1 and pad <= ws[1] // 2 else "zeros" if ws[1] == 1 and pad == 0 else "rows"
        assert s.store == want        # (stride 1, no crop: dx's rows; a strided 1x1: the copies write the zeros)
        return s.bm, s.bn, s.stages, s.ws
    assert spec((32, 56, 56, 64), (64, 3, 3, 64)) == (128, 64, 3, True)              # C = 64
    # TMA stores: 128 x 128 in the persistent kernel but for small grids
    assert spec((32, 56, 56, 256), (64, 1, 1, 256), pad=0) == (128, 128, 5, True)    # 1 k-tile
    assert spec((32, 14, 14, 1024), (256, 1, 1, 1024), pad=0) == (128, 128, 5, True)  # 4
    assert spec((32, 7, 7, 512), (512, 3, 3, 512)) == (64, 128, 6, True)             # 52 tiles of 128 x 128
    assert spec((32, 28, 28, 128), (128, 3, 3, 128)) == (64, 128, 6, True)           # 196, C = 128
    assert spec((32, 14, 14, 256), (256, 3, 3, 256)) == (128, 128, 5, True)          # 98, C = 256
    assert spec((256, 28, 28, 128), (128, 3, 3, 128)) == (128, 128, 5, True)         # 1568
    # bulk copies a row (strided): persistent from two waves of 128 x 128 tiles, four with several phases
    assert spec((32, 56, 56, 256), (64, 1, 1, 256), 2, 0) == (128, 128, 5, True)     # 392 tiles, one phase
    assert spec((32, 28, 28, 512), (1024, 1, 1, 512), 2, 0) == (128, 128, 3, False)  # 196
    assert spec((32, 56, 56, 128), (128, 3, 3, 128), 2) == (128, 128, 5, True)       # 784, four phases
    assert spec((32, 28, 28, 256), (256, 3, 3, 256), 2) == (128, 128, 3, False)      # 392, four phases
    assert spec((256, 14, 14, 512), (512, 3, 3, 512), 2) == (128, 128, 5, True)      # 1568


#: every kernel all_variants() gives, on problems that give it partial tiles (dgrad: stride 1, where the TMA-store
#: twins run; strided 1x1s, whose zero phases the "zeros" twins write, W odd and stride 3; strided, four phases in
#: one launch); the masked twins where K % 128 == 0
VARIANT_DGRAD = ((3, 136, 11, 13, 128, 3, 3, 1, 1, 1), (2, 200, 14, 13, 64, 1, 1, 2, 0, 1),
                 (2, 72, 13, 11, 128, 3, 3, 2, 1, 1), (2, 64, 10, 11, 128, 1, 1, 3, 0, 1))
VARIANT_WGRAD = ((3, 128, 11, 13, 200, 3, 3, 1, 1, 1), (2, 64, 15, 14, 136, 1, 1, 2, 0, 1),
                 (2, 128, 9, 10, 128, 3, 3, 1, 1, 1))     # (K % 128 == 0: the masked twins run)


def _masked(torch, rng, dy):
    """A random mask of dy (half its bits set, as ``relu_mask`` packs them) and ``bit ? dy : 0``."""
    bits = rng.integers(0, 2, dy.numel())
    mask = torch.tensor(reference.pack_mask(bits).view(np.int32), device="cuda")
    keep = torch.tensor(bits.reshape(dy.shape).astype(bool), device="cuda")
    return mask, torch.where(keep, dy, torch.zeros_like(dy))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_native_variants(dtype, rng):
    """Each native kernel variant against float64, launched as for a GPU of 1 and of 132 SMs: with one SM a
    persistent CTA runs many units (tiles, and wgrad's splits) one after another through its ring. A masked variant
    (``_m``, the mask read in its registers) equals its plain twin on ``bit ? dy : 0``, bit for bit."""
    torch = pytest.importorskip("torch")
    from igemm.conv import _native, _native_dgrad
    h = torch.cuda.current_stream().cuda_stream
    # (the sums twins write what only the training path reads: tests/test_norm_train.py, test_gpu_dgrad_bn_sums)
    names = {n for n, _ in _native.all_variants() if n.startswith((f"dgrad_{dtype}_", f"wgrad_{dtype}_"))
             and not n.endswith("_bs")}
    seen = set()
    for case in VARIANT_DGRAD:
        p = _geometry(*case)
        xs, ws, ys = shapes(p, "NHWC")
        g = GradInputProblem(xs, ws, "NHWC", *geom(p))
        dy, w = to_torch(rng.standard_normal(ys), dtype), to_torch(rng.standard_normal(ws), dtype)
        mask, dz = _masked(torch, rng, dy)
        refs = {d: reference.conv2d_grad_input_ref(to_numpy(d), to_numpy(w), xs, *geom(p), "NHWC") for d in (dy, dz)}
        for n, _ in _native.all_variants():
            if not n.startswith(f"dgrad_{dtype}_") or n not in names:
                continue
            bm, bn = map(int, n.split("_")[2].split("x"))
            add = "_add" in n                      # (the adding twin: into zeros)
            store = "tensor" if "_tma" in n else "zeros" if "_zrows" in n else "rows"
            masked = n.endswith("_m")
            if (store == "tensor" and not _native_dgrad.tma_rows(g)
                    or store == "zeros" and not _native_dgrad.fills_zeros(g)):
                continue
            spec = _native_dgrad.DgradSpec(dtype, bm, bn, int(n.split("_")[3][1:]), "_ws" in n, add, store)
            for sms in (1, 132):
                dx = torch.zeros(xs, dtype=getattr(torch, dtype), device="cuda") if add else \
                    poison(torch.empty(xs, dtype=getattr(torch, dtype), device="cuda"))
                k = _native_dgrad.NativeDgrad(g, dtype, 0, sms, spec)
                if masked and not k.fuses_mask(mask.data_ptr()):
                    continue
                k.launch(h, dy.data_ptr(), w.data_ptr(), dx.data_ptr(), add, mask.data_ptr() if masked else 0)
                torch.cuda.synchronize()
                assert rel_err(to_numpy(dx), refs[dz if masked else dy]) < TOL[dtype], (case, n, sms)
                if masked:
                    plain = poison(torch.empty_like(dx))
                    k.launch(h, dz.data_ptr(), w.data_ptr(), plain.data_ptr())
                    torch.cuda.synchronize()
                    assert torch.equal(dx, plain), (case, n, sms)
                seen.add(n)
    for case in VARIANT_WGRAD:
        p = _geometry(*case)
        xs, ws, ys = shapes(p, "NHWC")
        g = GradWeightProblem(xs, ws, "NHWC", *geom(p))
        x, dy = to_torch(rng.standard_normal(xs), dtype), to_torch(rng.standard_normal(ys), dtype)
        mask, dz = _masked(torch, rng, dy)
        refs = {d: reference.conv2d_grad_weight_ref(to_numpy(x), to_numpy(d), ws, *geom(p), "NHWC") for d in (dy, dz)}
        for n, _ in _native.all_variants():
            if not n.startswith(f"wgrad_{dtype}_"):
                continue
            bm, bn = map(int, n.split("_")[2].split("x"))
            out, ws_, masked = n.split("_")[4], "_ws" in n, n.endswith("_m")
            if bn == 128 and (g.R * g.S * g.C) % 128:
                continue
            for splits in ((1,) if out == dtype else (2, 5)):
                spec = _native.WgradSpec(dtype, out, bm, bn, int(n.split("_")[3][1:]), splits, ws_)
                for sms in (1, 132):
                    dw = poison(torch.empty(ws, dtype=getattr(torch, dtype), device="cuda"))
                    k = _native.NativeWgrad(g, dtype, dtype, False, 0, sms, spec)
                    if masked and not k.fuses_mask(mask.data_ptr()):
                        continue
                    k.launch(h, x.data_ptr(), dy.data_ptr(), dw.data_ptr(), mask.data_ptr() if masked else 0)
                    torch.cuda.synchronize()
                    assert rel_err(to_numpy(dw), refs[dz if masked else dy]) < TOL[dtype], (case, n, splits, sms)
                    if masked:
                        plain = poison(torch.empty_like(dw))
                        k.launch(h, x.data_ptr(), dz.data_ptr(), plain.data_ptr())
                        torch.cuda.synchronize()
                        assert torch.equal(dw, plain), (case, n, splits, sms)
                    seen.add(n)
    assert seen == names, names - seen


def test_split_sum_grid():
    """The split sum's grid: a float4 a thread, blocks of 256 where they are two an SM or more, else of 64 (a small dw
    still spread over the SMs), every element covered or a whole wave launched."""
    from igemm.conv._native import sum_grid
    assert sum_grid(16384, 132) == (64, 64) and sum_grid(589824, 132) == (576, 256)
    for n in (4, 16384, 36864, 131072, 270336, 270340, 589824, 4 << 20):
        for sms in (1, 78, 132):
            grid, block = sum_grid(n, sms)
            assert block in (64, 256) and grid >= 1
            assert grid * block * 4 >= n or grid * block == sms * 2048, (n, sms)


@pytest.mark.gpu
def test_gpu_split_sum_launch(rng):
    """The split sum of 9, 33 and 64 splits (a 64-k-tile reduction) against float64, its bits the same whatever the
    launch (the grids of 1 and 132 SMs): each element's partials are added in split order."""
    torch = pytest.importorskip("torch")
    from igemm.conv import _native
    h = torch.cuda.current_stream().cuda_stream
    xs, ws = (4, 32, 32, 64), (72, 1, 1, 64)
    g = GradWeightProblem(xs, ws, "NHWC", 1, 0, 1)
    x, dy = to_torch(rng.standard_normal(xs), "float16"), to_torch(rng.standard_normal((4, 32, 32, 72)), "float16")
    ref = reference.conv2d_grad_weight_ref(to_numpy(x), to_numpy(dy), ws, 1, 0, 1, "NHWC")
    for splits in (9, 33, 64):
        got = []
        for sms in (1, 132):
            dw = poison(torch.empty(ws, dtype=torch.float32, device="cuda"))
            spec = _native.WgradSpec("float16", "float32", 64, 64, 8, splits, True)
            _native.NativeWgrad(g, "float16", "float32", False, 0, sms, spec).launch(
                h, x.data_ptr(), dy.data_ptr(), dw.data_ptr())
            torch.cuda.synchronize()
            assert rel_err(to_numpy(dw), ref) < 1e-4, (splits, sms)
            got.append(dw)
        assert torch.equal(*got), splits


def test_native_mask_rules():
    """Where the native kernels read the mask themselves (a pixel's words whole 16-byte TMA rows: K % 128 == 0, the
    mask 16-byte aligned), and what the masked twins add: the stages' mask rows, the template argument, the CTAs an
    SM of the plain twin (a register cap where shared memory holds two)."""
    from igemm.conv import _native, _native_dgrad
    from dataclasses import replace
    dg = lambda K: _native_dgrad.NativeDgrad(GradInputProblem((2, 14, 14, 64), (K, 3, 3, 64), "NHWC", 1, 1, 1),
                                             "float16", None, 132)
    wg = lambda K: _native.NativeWgrad(GradWeightProblem((2, 14, 14, 64), (K, 3, 3, 64), "NHWC", 1, 1, 1), "float16",
                                       "float16", False, None, 132)
    for make in (dg, wg):
        assert make(128).fuses_mask(256) and make(256).fuses_mask(4096)
        assert not make(64).fuses_mask(256) and not make(192).fuses_mask(256) and not make(128).fuses_mask(264)
    d = _native_dgrad.DgradSpec("float16", 128, 128, 3)
    m = replace(d, mask=True)
    assert m.name() == d.name() + "_m" and m.smem == d.smem + 3 * 128 * 16
    assert "3, false, false, 2, true>(p)" in m.stub() and "__launch_bounds__(256, 2)" in m.stub()
    assert "3, false, false, 2, false>(p)" in d.stub() and "__launch_bounds__(256, 1)" in d.stub()
    w = _native.WgradSpec("float16", "float32", 128, 128, 4, 1, True)
    mw = replace(w, mask=True)
    assert mw.name() == w.name() + "_m" and mw.smem == w.smem + 4 * 64 * 16
    assert "4, true, true>(p)" in mw.stub() and "__launch_bounds__(288, 1)" in mw.stub()
    plan = igemm.Conv2dGradInputPlan((2, 14, 14, 64), (128, 3, 3, 64), "float16", "NHWC", 1, 1, mask=True,
                                     device="numpy")
    fp = {"mask": 4096, "z": 0, "coef": 0}
    assert plan.native is not None and plan.fuses_mask(1024, fp)
    assert not plan.fuses_mask(1032, fp) and not plan.fuses_mask(1024, dict(fp, coef=512))


def test_native_kernels_compile():
    """The native wgrad kernel, its masked twin and its split sum, the native dgrad kernel with its adding and masked
    twins, and the NCHW 1x1 wgrad kernel compile (nvcc; CI has it)."""
    from igemm import _build
    try:
        _build.find_toolchain()
    except Exception as e:          # (no toolchain: nothing to compile with)
        pytest.skip(f"no CUDA toolchain: {e}")
    plan = igemm.Conv2dGradWeightPlan((32, 14, 14, 128), (256, 3, 3, 128), "bfloat16", "NHWC", 1, 1, device="numpy")
    dplan = igemm.Conv2dGradInputPlan((32, 14, 14, 128), (256, 3, 3, 128), "bfloat16", "NHWC", 1, 1, device="numpy")
    nplan = igemm.Conv2dGradWeightPlan((32, 256, 28, 28), (128, 256, 1, 1), "float16", "NCHW", device="numpy")
    ks = [k.kernel() for k in plan.sub_plans() + dplan.sub_plans() + nplan.sub_plans()[:1]]
    assert len(ks) == 7 and _build.compile_many(ks, "sm_90a", 2) == 7      # (each with its masked twin; NCHW 1x1)


#: the few-channel wgrad (C < 64, R·S·C <= 256): every column-block count NT = 1..8 in both forms (the rows form
#: where W·C % 8 == 0), a partial last unit of a row (Q % 64, Q % 16), strides 1-3, dilation, R != S, K past one
#: 64-row block (72, 136), C = 1, and ResNet's conv1
SMALL_WGRAD = [(1, 1, 9, 72, 8, 1, 1, 1, 0, 1), (3, 5, 11, 13, 24, 3, 3, 1, 1, 1), (2, 4, 10, 14, 24, 3, 3, 1, 1, 1),
               (2, 8, 9, 9, 32, 3, 3, 1, 1, 1), (2, 4, 20, 150, 16, 5, 5, 3, 2, 1), (2, 16, 12, 12, 72, 3, 3, 2, 1, 2),
               (2, 20, 10, 10, 40, 3, 3, 1, 1, 1), (2, 24, 9, 9, 16, 3, 3, 1, 0, 1), (1, 28, 9, 10, 136, 3, 3, 1, 1, 1),
               (2, 7, 17, 15, 8, 3, 5, 1, 2, 2), (2, 3, 30, 30, 64, 7, 7, 2, 3, 1), (2, 3, 224, 224, 64, 7, 7, 2, 3, 1)]


def emulate_small_wgrad(x, dy, g, rows: bool):
    """The few-channel wgrad kernel's arithmetic in numpy (NHWC), unit by unit as csrc/conv/wgrad_small.cuh. rows:
    a unit is an output row, its patch the R input rows whole in rows of ROWP elements at LEFT (zero margins), B's
    column j = (r, s, c) at off_j = r·ROWP + LEFT + (s·dw − pw)·C + c + q·sw·C; gather: 64 pixels, the patch
    [r][c][column] (zeros outside the image), off_j = (r·C + c)·WB + s·dw + q·sw. Pixels past the row's end read 0
    on both sides."""
    from igemm.conv import _wgrad_small as ws
    (sh, sw), (ph, pw), (dh, dw) = g.stride, g.padding, g.dilation
    rsc = g.R * g.S * g.C
    rs, c = np.divmod(np.arange(rsc), g.C)
    r, s = np.divmod(rs, g.S)
    left, rowp = ws._rows_geometry(g)
    WB = ws._patch(g)
    off = r * rowp + left + (s * dw - pw) * g.C + c if rows else (r * g.C + c) * WB + s * dw
    ps = sw * g.C if rows else sw
    QB = g.Q if rows else ws.QB
    out = np.zeros((g.K, rsc))
    for n in range(g.N):
        for p in range(g.P):
            h = p * sh - ph + np.arange(g.R) * dh
            hok = (h >= 0) & (h < g.H)
            for q0 in range(0, g.Q, QB):
                nq = min(QB, g.Q - q0)
                if rows:
                    xs = np.zeros((g.R, rowp))
                    xs[hok, left:left + g.W * g.C] = x[n, h[hok]].reshape(-1, g.W * g.C)
                else:
                    wg = q0 * sw - pw + np.arange(WB)
                    ok = hok[:, None] & ((wg >= 0) & (wg < g.W))[None, :]
                    patch = np.where(ok[..., None], x[n, np.clip(h, 0, g.H - 1)][:, np.clip(wg, 0, g.W - 1)], 0)
                    xs = patch.transpose(0, 2, 1)                               # [r][c][column]
                xs = xs.reshape(-1)
                q = np.arange(-(-nq // 16) * 16)
                b = np.where((q < nq)[:, None], xs[off[None, :] + q[:, None] * ps], 0)
                a = np.zeros((len(q), g.K))
                a[:nq] = dy[n, p, q0:q0 + nq]
                out += a.T @ b
    return out.reshape(g.K, g.R, g.S, g.C)


def test_small_wgrad_emulated(rng):
    """The few-channel wgrad's units, patches and column offsets, both forms, equal the reference (conv1 itself:
    too slow here)."""
    from igemm.conv import _wgrad_small as wsm
    for case in SMALL_WGRAD[:-1]:
        p = _geometry(*case)
        xs, ws, ys = shapes(p, "NHWC")
        g = GradWeightProblem(xs, ws, "NHWC", *geom(p))
        x, dy = rng.standard_normal(xs), rng.standard_normal(ys)
        want = reference.conv2d_grad_weight_ref(x, dy, ws, *geom(p), "NHWC")
        for rows in (False, True) if wsm.rows_form(g) else (False,):
            assert rel_err(emulate_small_wgrad(x, dy, g, rows), want) < 1e-12, (case, rows)


def test_small_wgrad_choice():
    """The few-channel kernel where the native one cannot run and C < 64, R·S·C <= 256, K % 8 == 0 (any sm_80+);
    the reason where not; NT covers R·S·C; the plan launches it and the split sum."""
    from igemm.conv import _wgrad_small as ws
    conv1 = GradWeightProblem((32, 224, 224, 3), (64, 7, 7, 3), "NHWC", 2, 3, 1)
    assert ws.unsupported(conv1, "float16", "NHWC") is None and ws.choose_spec(conv1, "float16").nt == 5
    for args, why in ((("float32", "NHWC"), "16-bit"), (("float16", "NCHW"), "NHWC")):
        assert why in ws.unsupported(conv1, *args)
    for xs, wsh, why in (((2, 9, 9, 64), (64, 1, 1, 64), "C < 64"), ((2, 9, 9, 32), (64, 3, 3, 32), "R·S·C"),
                         ((2, 9, 9, 3), (60, 3, 3, 3), "K % 8"), ((2, 9, 9, 3), (64, 1, 1, 3), None)):
        got = ws.unsupported(GradWeightProblem(xs, wsh, "NHWC", 1, 0, 1), "bfloat16", "NHWC")
        assert (got is None) if why is None else why in got, (xs, wsh, got)
    assert [ws.choose_spec(GradWeightProblem((1, 9, 9, c), (8, 3, 3, c), "NHWC", 1, 1, 1), "float16").nt
            for c in (1, 3, 4, 7, 8, 28)] == [1, 1, 2, 2, 3, 8]
    for arch in ("sm_90a", "sm_80"):
        plan = igemm.Conv2dGradWeightPlan((32, 224, 224, 3), (64, 7, 7, 3), "float16", "NHWC", 2, 3, device="numpy",
                                          arch=arch)
        assert plan.role == "native" and isinstance(plan.native, ws.SmallWgrad)
        assert [k.kernel()[0] for k in plan.sub_plans()] == ["wgrad_small_float16_n5_rows", "split_sum_float16"]
        assert plan.native.splits == 3 * 132 and plan.native.units == 32 * 112        # (a unit an output row)
    gather = GradWeightProblem((2, 30, 30, 3), (64, 7, 7, 3), "NHWC", 2, 3, 1)        # (W·C = 90)
    assert not ws.rows_form(gather) and ws.SmallWgrad(gather, "float16", "float16", False, None, 132).units == 2 * 15
    assert igemm.Conv2dGradWeightPlan((2, 9, 9, 64), (64, 3, 3, 64), "float16", "NHWC", 1, 1, device="numpy",
                                      arch="sm_80").role is None          # (C = 64 on sm_80: the turned convolution)


@pytest.mark.gpu
@pytest.mark.parametrize("case", SMALL_WGRAD, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_wgrad_small(case, dtype, rng):
    """The few-channel wgrad against float64: plain, with the mask and with the prologue; fp32 out and accumulate;
    each form launched as for 1 SM (a CTA runs every unit: one split) and 132."""
    torch = pytest.importorskip("torch")
    from igemm.conv import _wgrad_small as wsm
    p = _geometry(*case)
    xs, ws, ys = shapes(p, "NHWC")
    assert isinstance(igemm.Conv2dGradWeightPlan(xs, ws, dtype, "NHWC", *geom(p)).native, wsm.SmallWgrad)
    x, dy, ref = _check_wgrad(torch, p, dtype, rng)
    g = GradWeightProblem(xs, ws, "NHWC", *geom(p))
    h = torch.cuda.current_stream().cuda_stream
    nt = wsm.choose_spec(g, dtype).nt
    for rows in (True, False) if wsm.rows_form(g) else (False,):
        for sms in (1, 132):
            dw = poison(torch.empty(ws, dtype=getattr(torch, dtype), device="cuda"))
            k = wsm.SmallWgrad(g, dtype, dtype, False, 0, sms, wsm.SmallWgradSpec(dtype, nt, rows))
            k.launch(h, x.data_ptr(), dy.data_ptr(), dw.data_ptr())
            torch.cuda.synchronize()
            assert rel_err(to_numpy(dw), ref) < TOL[dtype], (rows, sms)


def test_small_wgrad_variants_tested():
    """SMALL_WGRAD reaches every kernel all_variants() gives (the GPU test runs both forms where the rows form can)."""
    from igemm.conv import _wgrad_small as ws
    seen = set()
    for c in SMALL_WGRAD:
        p = _geometry(*c)
        g = GradWeightProblem(*shapes(p, "NHWC")[:2], "NHWC", *geom(p))
        nt = ws.choose_spec(g, "float16").nt
        seen |= {ws.SmallWgradSpec("float16", nt, rows).name() for rows in {False, ws.rows_form(g)}}
    assert seen == {n for n, _ in ws.all_variants() if n.startswith("wgrad_small_float16_")}


def test_wgrad_nchw_native(rng):
    """An NCHW 16-bit wgrad runs its NHWC twin's kernel after x and dy go to NHWC (dy by a move with the mask /
    prologue) and moves dw back: those moves in numpy around the NHWC reference equal the NCHW reference,
    accumulation included; the plans pick it where the twin has a kernel."""
    for case in ((2, 64, 9, 10, 24, 3, 3, 2, 1, 1), (2, 3, 12, 11, 16, 5, 5, 1, 2, 2)):
        p = _geometry(*case)
        xs, ws, ys = shapes(p, "NCHW")
        g = GradWeightProblem(xs, ws, "NCHW", *geom(p))
        gn = g.nhwc()
        x, dy, z = rng.standard_normal(xs), rng.standard_normal(ys), rng.standard_normal(ys)
        mask = np.packbits(rng.random(dy.size) < 0.5, bitorder="little")
        mask = np.pad(mask, (0, -len(mask) % 4)).view(np.uint32)
        coef = rng.standard_normal((3, g.K))
        base = rng.standard_normal(ws)
        dym, wm = g.nhwc_moves()
        xt, dyt = x.transpose(0, 2, 3, 1), np.zeros(gn.dy_shape)          # (x: the forward's transpose)
        dym.run_numpy(dy, dyt, mode="bn", mask=mask, z=z, coef=coef)
        wt = reference.conv2d_grad_weight_ref(xt, dyt, gn.w_shape, *geom(p), "NHWC")
        dw = base.copy()
        wm.run_numpy(wt, dw, accumulate=True)
        d = reference.grad_prologue_ref(dy, mask, (z, *coef), "NCHW")
        want = reference.conv2d_grad_weight_ref(x, d, ws, *geom(p), "NCHW") + base
        assert rel_err(dw, want) < 1e-12, case
        plan = igemm.Conv2dGradWeightPlan(xs, ws, "float16", "NCHW", *geom(p), device="numpy", arch="sm_90a")
        assert plan.role == "native" and plan._nchw is not None
    assert igemm.Conv2dGradWeightPlan((2, 32, 9, 9), (16, 32, 3, 3), "float16", "NCHW", 1, 1, device="numpy",
                                      arch="sm_90a").role is None      # (the twin: C = 32, R·S·C = 288: none)
    assert igemm.Conv2dGradWeightPlan((2, 64, 9, 9), (16, 64, 3, 3), "float32", "NCHW", 1, 1, device="numpy",
                                      arch="sm_90a").role is None
