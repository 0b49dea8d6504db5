"""The convolution backward (``conv2d_grad_input``, ``conv2d_grad_weight``, ``conv2d_grad_prologue`` and their
plans) against the float64 references (``igemm.reference.grad``; the references themselves are checked in
``tests/test_backward_ref.py``).

* CPU: the numpy backend's semantics; the GPU path's decomposition (phases, moves, turned convolution) run in
  numpy on the reference convolution, for random problems, with the mask and BN prologue; the phase rules.
* GPU: random problems per op x dtype x layout through the kernels (outputs NaN-poisoned), the mask and the BN
  prologue against PyTorch's unfused chain, fp32 gradients and accumulation, torch/CuPy/numpy inputs.
  ``python tests/test_backward.py precompile [arch]`` compiles every kernel these tests launch.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import igemm
from igemm import reference
from igemm.conv._backward import GradInputProblem, GradWeightProblem, phases_1d

from helpers import TOL, poison, rel_err, to_numpy, to_torch

#: problems per op x dtype x layout of the GPU's random test (the fuzz stage sets 300)
GPU_PROBLEMS = int(os.environ.get("IGEMM_GRAD_PROBLEMS", "24"))


def random_problem(rng, small: bool = True) -> dict:
    """A random valid forward problem (NCHW shapes): strides 1-3, dilation 1-2, 1x1 to 7x7, odd C and K, N=1."""
    while True:
        R = int(rng.choice([1, 1, 2, 3, 3, 5, 7]))
        S = R if rng.random() < 0.8 else int(rng.integers(1, 6))
        st = (int(rng.integers(1, 4)),) * 2 if rng.random() < 0.8 else tuple(int(v) for v in rng.integers(1, 4, 2))
        dil = (1, 1) if rng.random() < 0.7 else tuple(int(v) for v in rng.integers(1, 3, 2))
        pad = tuple(int(v) for v in rng.integers(0, 4, 2))
        N = int(rng.choice([1, 2, 3]))
        C = int(rng.choice([1, 3, 8, 16, 24, 64] if small else [8, 32, 64, 128]))
        K = int(rng.choice([1, 5, 8, 16, 32, 40] if small else [8, 32, 64, 128]))
        H, W = (int(v) for v in rng.integers(1, 20, 2))
        P = (H + 2 * pad[0] - dil[0] * (R - 1) - 1) // st[0] + 1
        Q = (W + 2 * pad[1] - dil[1] * (S - 1) - 1) // st[1] + 1
        if P >= 1 and Q >= 1:
            return dict(N=N, C=C, H=H, W=W, K=K, R=R, S=S, stride=st, padding=pad, dilation=dil, P=P, Q=Q)


def one_by_one(p: dict) -> dict:
    """``p`` made a 1x1 unpadded problem (wgrad's GEMM form)."""
    p = dict(p, R=1, S=1, padding=(0, 0))
    p["P"] = (p["H"] - 1) // p["stride"][0] + 1
    p["Q"] = (p["W"] - 1) // p["stride"][1] + 1
    return p


def shapes(p: dict, layout: str) -> tuple:
    N, C, H, W, K, R, S, P, Q = (p[k] for k in "N C H W K R S P Q".split())
    if layout == "NCHW":
        return (N, C, H, W), (K, C, R, S), (N, K, P, Q)
    return (N, H, W, C), (K, R, S, C), (N, P, Q, K)


def geom(p: dict) -> tuple:
    return p["stride"], p["padding"], p["dilation"]


def problem(i: int) -> dict:
    """The GPU tests' i-th problem (fixed: their kernels are precompiled); every fourth 1x1 unpadded."""
    p = random_problem(np.random.default_rng([i, 7]))
    return one_by_one(p) if i % 4 == 3 else p


# ================================================================================================ CPU
def test_phases_multiply_no_zero():
    """Every filter tap is used by exactly one phase, and every phase's taps meet its congruence."""
    for st in range(1, 5):
        for dil in range(1, 4):
            for R in range(1, 8):
                for pad in range(0, 4):
                    H = 23
                    P = (H + 2 * pad - dil * (R - 1) - 1) // st + 1
                    if P < 1:
                        continue
                    used = []
                    for ph in phases_1d(st, pad, dil, R, H, P):
                        taps = [ph.last - i * ph.step for i in range(ph.taps)]
                        assert all((ph.ph + pad - r * dil) % st == 0 for r in taps), (st, dil, R, pad, ph)
                        used += taps
                    assert sorted(used) == list(range(R)), (st, dil, R, pad, used)


def _prepass(dy, layout, mode, mask, z, coef):
    """The mask / prologue applied to dy by its own move (dgrad, and wgrad's GEMM form reading dy in place)."""
    from igemm.conv._moves import Move, contiguous
    d = np.full(dy.size, np.nan)
    cdim = 1 if layout == "NCHW" else 3
    Move(dy.shape, contiguous(dy.shape), contiguous(dy.shape), cdim=cdim, K=dy.shape[cdim]).run_numpy(
        dy, d, mode=mode, mask=mask, z=z, coef=coef)
    return d.reshape(dy.shape)


def emulate_grad_input(dy, w, x_shape, layout, stride, padding, dilation, mode="plain", mask=None, z=None,
                       coef=None):
    """The GPU dgrad's steps in numpy: the pre-pass move, each phase's filter move, its stride-1 convolution
    (the reference) and its interleave."""
    g = GradInputProblem(x_shape, w.shape, layout, stride, padding, dilation)
    dx = np.full(int(np.prod(x_shape)), np.nan)
    if mode != "plain":
        dy = _prepass(dy, layout, mode, mask, z, coef)
    for ph in g.phases:
        mv, off = g.interleave_move(ph)
        if ph.zero:
            mv.run_numpy(np.zeros(1), dx[off:])
            continue
        f = np.full(g.sub_w_shape(ph), np.nan)
        g.filter_move(ph).run_numpy(w, f.reshape(-1))
        a = g.sub_plan_args(ph)
        y = reference.conv2d_direct(dy, f, 1, a["padding"], a["dilation"], layout)
        assert y.shape == g.sub_y_shape(ph)
        if g.direct:
            return y
        mv.run_numpy(y, dx[off:])
    return dx.reshape(x_shape)


def emulate_grad_weight(x, dy, w_shape, layout, stride, padding, dilation, mode="plain", mask=None, z=None,
                        coef=None):
    """The GPU wgrad's steps in numpy: x and dy turned (the mask / prologue applied to dy), the forward
    convolution of the turned problem (the reference), the permute into dw."""
    g = GradWeightProblem(x.shape, w_shape, layout, stride, padding, dilation)
    role = g.gemm_role(mode != "plain")
    if role is not None:                  # the GEMM form: one operand in place, the other moved
        a = g.gemm_plan_args(role)
        if role == "dy":
            xin = dy if mode == "plain" else _prepass(dy, layout, mode, mask, z, coef)
            wt = np.full(a["w_shape"], np.nan)
            g.gemm_operand_move(role).run_numpy(x, wt.reshape(-1))
        else:
            xin = x
            wt = np.full(a["w_shape"], np.nan)
            g.gemm_operand_move(role).run_numpy(dy, wt.reshape(-1), mode=mode, mask=mask, z=z, coef=coef)
        yt = reference.conv2d_direct(xin.reshape(a["x_shape"]), wt, 1, 0, 1, a["layout"])
        dw = np.full(w_shape, np.nan)
        g.gemm_out_move(role).run_numpy(yt, dw.reshape(-1))
        return dw
    xt = np.full(g.xt_shape, np.nan)
    g.x_move().run_numpy(x, xt.reshape(-1))
    dyt = np.full(g.dyt_shape, np.nan)
    g.dy_move().run_numpy(dy, dyt.reshape(-1), mode=mode, mask=mask, z=z, coef=coef)
    a = g.sub_plan_args()
    yt = reference.conv2d_direct(xt, dyt, a["stride"], a["padding"], a["dilation"], "NHWC")
    assert yt.shape == g.yt_shape
    dw = np.full(w_shape, np.nan)
    g.w_move().run_numpy(yt, dw.reshape(-1))
    return dw


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_gpu_decomposition_emulated(layout, rng):
    """The GPU path's arithmetic (phases, moves, the turned wgrad) equals the references, with the mask and the
    BN prologue applied by the moves."""
    for i in range(80):
        p = random_problem(rng) if i % 4 else one_by_one(random_problem(rng))
        xs, ws, ys = shapes(p, layout)
        x, w, dy = rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(ys)
        K = p["K"]
        mode = ("plain", "mask", "bn")[i % 3]
        mask = reference.pack_mask(rng.random(dy.size) > 0.4) if mode != "plain" else None
        z, coef = (rng.standard_normal(ys), rng.standard_normal((3, K))) if mode == "bn" else (None, None)
        g = reference.grad_prologue_ref(dy, mask, (z, *coef) if mode == "bn" else None, layout)
        ex = reference.conv2d_grad_input_ref(g, w, xs, *geom(p), layout)
        ew = reference.conv2d_grad_weight_ref(x, g, ws, *geom(p), layout)
        gx = emulate_grad_input(dy, w, xs, layout, *geom(p), mode, mask, z, coef)
        gw = emulate_grad_weight(x, dy, ws, layout, *geom(p), mode, mask, z, coef)
        np.testing.assert_allclose(gx, ex, rtol=1e-10, atol=1e-10, err_msg=str(p))
        np.testing.assert_allclose(gw, ew, rtol=1e-10, atol=1e-10, err_msg=str(p))


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_numpy_backend(numpy_backend, layout, rng):
    """The function forms on the numpy backend: the references, in the input's dtype; out=, accumulate."""
    p = dict(N=2, C=3, H=7, W=6, K=5, R=3, S=3, stride=(2, 2), padding=(1, 1), dilation=(1, 1), P=4, Q=3)
    xs, ws, ys = shapes(p, layout)
    x, w, dy = (rng.standard_normal(s).astype(np.float32) for s in (xs, ws, ys))
    dx = igemm.conv2d_grad_input(dy, w, xs, 2, 1, layout=layout)
    assert dx.dtype == np.float32 and dx.shape == xs
    np.testing.assert_allclose(dx, reference.conv2d_grad_input_ref(dy, w, xs, 2, 1, 1, layout), rtol=1e-5,
                               atol=1e-5)
    dw = igemm.conv2d_grad_weight(x, dy, ws, 2, 1, layout=layout)
    ref = reference.conv2d_grad_weight_ref(x, dy, ws, 2, 1, 1, layout)
    np.testing.assert_allclose(dw, ref, rtol=1e-5, atol=1e-5)
    acc = np.ones(ws, np.float32)
    igemm.conv2d_grad_weight(x, dy, ws, 2, 1, layout=layout, out=acc, accumulate=True)
    np.testing.assert_allclose(acc, ref + 1, rtol=1e-5, atol=1e-5)
    mask = reference.pack_mask(rng.random(dy.size) > 0.5)
    m = reference.unpack_mask(mask, dy.size).reshape(dy.shape)
    dx = igemm.conv2d_grad_input(dy, w, xs, 2, 1, layout=layout, mask=mask)
    np.testing.assert_allclose(dx, reference.conv2d_grad_input_ref(np.where(m, dy, 0), w, xs, 2, 1, 1, layout),
                               rtol=1e-5, atol=1e-5)


def test_channels_last_numpy(numpy_backend, rng):
    """layout="NCHW" arrays with NHWC memory (numpy strides, as torch's channels_last): the NHWC path on views,
    outputs with NHWC memory, the NCHW semantics."""
    xs, ws, ys = (2, 5, 9, 7), (4, 5, 3, 3), (2, 4, 5, 4)
    nhwc = lambda a: np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)   # noqa: E731
    x, w, dy = (nhwc(rng.standard_normal(sh).astype(np.float32)) for sh in (xs, ws, ys))
    assert not dy.flags.c_contiguous and dy.transpose(0, 2, 3, 1).flags.c_contiguous
    mask = reference.pack_mask(rng.random(dy.size) > 0.5)            # bits in dy's memory order (NHWC)
    g = np.where(reference.unpack_mask(mask, dy.size).reshape(2, 5, 4, 4).transpose(0, 3, 1, 2), dy, 0)
    dx = igemm.conv2d_grad_input(dy, w, xs, 2, 1, layout="NCHW", mask=mask)
    assert dx.shape == xs and dx.transpose(0, 2, 3, 1).flags.c_contiguous
    np.testing.assert_allclose(dx, reference.conv2d_grad_input_ref(g, w, xs, 2, 1, 1, "NCHW"), rtol=1e-5, atol=1e-5)
    dw = igemm.conv2d_grad_weight(x, dy, ws, 2, 1, layout="NCHW", mask=mask)
    assert dw.shape == ws and dw.transpose(0, 2, 3, 1).flags.c_contiguous
    np.testing.assert_allclose(dw, reference.conv2d_grad_weight_ref(x, g, ws, 2, 1, 1, "NCHW"), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_conv2d_backward_numpy(numpy_backend, layout, rng):
    """conv2d_backward is conv2d_grad_input and conv2d_grad_weight with the same arguments (mask and prologue
    included); a dy that is no output of the problem raises, naming dy, before anything runs."""
    p = dict(N=2, C=3, H=7, W=6, K=5, R=3, S=3, stride=(2, 2), padding=(1, 1), dilation=(1, 1), P=4, Q=3)
    xs, ws, ys = shapes(p, layout)
    x, w, dy, z = (rng.standard_normal(s).astype(np.float32) for s in (xs, ws, ys, ys))
    mask = reference.pack_mask(rng.random(dy.size) > 0.5)
    pro = igemm.GradPrologue(z, rng.standard_normal((3, 5)).astype(np.float32), None, None)
    for kw in ({}, {"mask": mask}, {"mask": mask, "prologue": pro}):
        dx, dw = igemm.conv2d_backward(dy, x, w, 2, 1, layout=layout, **kw)
        np.testing.assert_array_equal(dx, igemm.conv2d_grad_input(dy, w, xs, 2, 1, layout=layout, **kw))
        np.testing.assert_array_equal(dw, igemm.conv2d_grad_weight(x, dy, ws, 2, 1, layout=layout, **kw))
    before = [a.copy() for a in (x, w, dy)]
    with pytest.raises(ValueError, match="dy"):
        igemm.conv2d_backward(dy[:1], x, w, 2, 1, layout=layout, mask=mask)
    for a, b in zip((x, w, dy), before):
        np.testing.assert_array_equal(a, b)


def _bn_chain_ref(dy, x, w, z, mean, invstd, gamma, mask, st, pd, layout, dl=1):
    """The float64 backward of conv -> BN (batch statistics) [-> ReLU]: (dx, dw, dgamma, dbeta, bit ? dy : 0)."""
    K = z.shape[1] if layout == "NCHW" else z.shape[3]
    sums = reference.batch_norm_backward_reduce_ref(dy, z, mean, invstd, layout, mask)
    dz = reference.batch_norm_backward_elemt_ref(dy, z, mean, invstd, gamma, sums[0], sums[1], z.size // K,
                                                 layout=layout, mask=mask)
    g = np.asarray(dy, np.float64) if mask is None else reference.relu_backward(np.asarray(dy, np.float64), mask)
    return (reference.conv2d_grad_input_ref(dz, w, x.shape, st, pd, dl, layout),
            reference.conv2d_grad_weight_ref(x, dz, w.shape, st, pd, dl, layout), sums[2], sums[3], g)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_conv2d_bn_backward_numpy(numpy_backend, layout, rng):
    """conv2d_bn_backward is the float64 chain (BN's sums, dz, both conv gradients, the residual's); bad arguments
    raise naming the argument and change nothing."""
    p = dict(N=2, C=3, H=7, W=6, K=5, R=3, S=3, stride=(2, 2), padding=(1, 1), dilation=(1, 1), P=4, Q=3)
    xs, ws, ys = shapes(p, layout)
    x, w, dy, z = (rng.standard_normal(s).astype(np.float32) for s in (xs, ws, ys, ys))
    ax = (0, 2, 3) if layout == "NCHW" else (0, 1, 2)
    mean = z.mean(ax).astype(np.float32)
    invstd = (1 / np.sqrt(z.var(ax) + 1e-5)).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, 5).astype(np.float32)
    mask = reference.pack_mask(rng.random(dy.size) > 0.5)
    for m, gm in ((None, None), (mask, gamma)):
        got = igemm.conv2d_bn_backward(dy, x, w, z, mean, invstd, gm, 2, 1, mask=m, layout=layout, residual=True)
        want = _bn_chain_ref(dy, x, w, z, mean, invstd, np.ones(5) if gm is None else gm, m, 2, 1, layout)
        for a, b in zip(got, want):
            assert a.shape == b.shape and rel_err(a, b) < 1e-5
        assert igemm.conv2d_bn_backward(dy, x, w, z, mean, invstd, gm, 2, 1, mask=m, layout=layout)[4] is None
    before = [a.copy() for a in (x, w, dy, z, mean, invstd)]
    for kw, name in (({"mean": mean[:4]}, "mean"), ({"w": w[:, :2]}, "w"), ({"mask": mask[:1]}, "mask"),
                     ({"precision": "fp8"}, "precision"), ({"z": z[:1]}, "z")):
        a = dict(dy=dy, x=x, w=w, z=z, mean=mean, invstd=invstd, gamma=gamma, mask=mask, precision="strict") | kw
        with pytest.raises((ValueError, TypeError), match=name):
            igemm.conv2d_bn_backward(a.pop("dy"), a.pop("x"), a.pop("w"), a.pop("z"), a.pop("mean"), a.pop("invstd"),
                                     a.pop("gamma"), 2, 1, layout=layout, **a)
    for a, b in zip((x, w, dy, z, mean, invstd), before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_conv2d_bn_backward_random_numpy(numpy_backend, layout, rng):
    """conv2d_bn_backward on random problems (strides 1-3, dilation, 1x1 to 7x7, odd C and K, N = 1), with and
    without the mask, gamma and the residual's gradient, against the float64 chain. At least 8 values a channel: with
    2 or 3, dz is near zero by construction (what BN removes spans the values) and only its rounding is compared."""
    done = 0
    while done < 12:
        p = random_problem(rng)
        xs, ws, ys = shapes(p, layout)
        if p["N"] * p["P"] * p["Q"] < 8:
            continue
        done += 1
        x, w, dy, z = (rng.standard_normal(s).astype(np.float32) for s in (xs, ws, ys, ys))
        ax = (0, 2, 3) if layout == "NCHW" else (0, 1, 2)
        mean, invstd = z.mean(ax).astype(np.float32), (1 / np.sqrt(z.var(ax) + 1e-5)).astype(np.float32)
        masked = rng.random() < 0.5
        m = reference.pack_mask(rng.random(dy.size) > 0.5) if masked else None
        gm = rng.uniform(0.5, 1.5, p["K"]).astype(np.float32) if masked else None
        got = igemm.conv2d_bn_backward(dy, x, w, z, mean, invstd, gm, *geom(p), mask=m, layout=layout, residual=True)
        want = _bn_chain_ref(dy, x, w, z, mean, invstd, np.ones(p["K"]) if gm is None else gm, m, p["stride"],
                             p["padding"], layout, p["dilation"])
        for a, b in zip(got, want):
            assert a.shape == b.shape and rel_err(a, b) < 1e-5, p


def test_prologue_numpy_matches_bn_backward(numpy_backend, rng):
    """conv2d_grad_prologue's coefficients give batch_norm_backward_elemt's gradient."""
    z = rng.standard_normal((2, 4, 5, 5)).astype(np.float32)
    dy = rng.standard_normal(z.shape).astype(np.float32)
    mean = z.mean((0, 2, 3)).astype(np.float32)
    invstd = (1 / np.sqrt(z.var((0, 2, 3)) + 1e-5)).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, 4).astype(np.float32)
    mask = reference.pack_mask(rng.random(z.size) > 0.5)
    pro = igemm.conv2d_grad_prologue(dy, z, mean, invstd, gamma, mask=mask)
    a, b, c = pro.coef.astype(np.float64)
    got = reference.grad_prologue_ref(dy, mask, (z, a, b, c), "NCHW")
    sums = reference.batch_norm_backward_reduce_ref(dy, z, mean, invstd, "NCHW", mask)
    want = reference.batch_norm_backward_elemt_ref(dy, z, mean, invstd, gamma, sums[0], sums[1], z.size // 4,
                                                   mask=mask)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(pro.grad_bias, sums[0], rtol=1e-5)


def test_move_kernels_compile():
    """The move kernels compile (nvcc; CI has it)."""
    from igemm import _build
    from igemm.conv import _moves
    v = [s for s in _moves.all_variants() if s[0] in ("grad_copy_float16_float16_m2_t0", "grad_copy_float16_float16_m1_v8",
                                                       "grad_copy_float16_float32_m0_acc_v4", "grad_coefficients")]
    assert len(v) == 4
    try:
        _build.find_toolchain()
    except Exception as e:          # (no toolchain: nothing to compile with)
        pytest.skip(f"no CUDA toolchain: {e}")
    assert _build.compile_many(v, "sm_90a", 2) == 4


# ================================================================================================ GPU
def _run_case(torch, p: dict, layout: str, dtype: str, rng, op: str, mode: str = "plain") -> float:
    """One problem through the GPU plan (poisoned output) against the float64 reference; the relative error."""
    xs, ws, ys = shapes(p, layout)
    x, w, dy = (to_torch(rng.standard_normal(s), dtype) for s in (xs, ws, ys))
    K = p["K"]
    mask = pro = None
    if mode != "plain":
        mask = igemm.relu_mask(to_torch(rng.standard_normal(ys), dtype))
    if mode == "bn":
        z = to_torch(rng.standard_normal(ys), dtype)
        coef = torch.tensor(rng.standard_normal((3, K)), dtype=torch.float32, device="cuda")
        pro = igemm.GradPrologue(z, coef)
    m_np = to_numpy(mask).view(np.uint32) if mask is not None else None
    g = reference.grad_prologue_ref(to_numpy(dy), m_np, (to_numpy(pro.z), *to_numpy(pro.coef)) if pro else None,
                                    layout)
    if op == "dgrad":
        plan = igemm.Conv2dGradInputPlan(xs, ws, dtype, layout, *geom(p), mask=mask is not None,
                                         prologue=pro is not None)
        out = poison(torch.empty(xs, dtype=getattr(torch, dtype), device="cuda"))
        plan(dy, w, mask=mask, prologue=pro, out=out)
        again = plan(dy, w, mask=mask, prologue=pro)          # (the torch fast path: no out)
        ref = reference.conv2d_grad_input_ref(g, to_numpy(w), xs, *geom(p), layout)
    else:
        plan = igemm.Conv2dGradWeightPlan(xs, ws, dtype, layout, *geom(p), mask=mask is not None,
                                          prologue=pro is not None)
        out = poison(torch.empty(ws, dtype=getattr(torch, dtype), device="cuda"))
        plan(x, dy, mask=mask, prologue=pro, out=out)
        again = plan(x, dy, mask=mask, prologue=pro)          # (the torch fast path: no out)
        ref = reference.conv2d_grad_weight_ref(to_numpy(x), g, ws, *geom(p), layout)
    torch.cuda.synchronize()
    assert torch.equal(again, out), "the torch fast path and the general path differ"
    return rel_err(to_numpy(out), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["dgrad", "wgrad"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_gpu_random_problems(op, dtype, layout):
    """GPU_PROBLEMS random problems (a fixed seed per item: tools precompile them), every third with the mask,
    every third with the BN prologue."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng([("dgrad", "wgrad").index(op), len(dtype), len(layout)])
    worst = []
    for i in range(GPU_PROBLEMS):
        p = problem(i)
        mode = ("plain", "mask", "bn")[i % 3]
        err = _run_case(torch, p, layout, dtype, rng, op, mode)
        worst.append((err, p, mode))
        assert err <= TOL[dtype], (op, dtype, layout, mode, p, err)
    print(f"{op} {dtype} {layout}: {len(worst)} problems, max rel err {max(worst, key=lambda t: t[0])[0]:.2e}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_gpu_bn_relu_chain_against_torch(layout, rng):
    """conv -> BN (training) -> ReLU: conv2d_grad_prologue + dgrad + wgrad with mask and prologue equal
    autograd's gradients of PyTorch's unfused chain (float64)."""
    torch = pytest.importorskip("torch")
    N, C, H, K = 4, 16, 10, 24
    x = torch.randn(N, C, H, H, dtype=torch.float64, requires_grad=True)
    w = torch.randn(K, C, 3, 3, dtype=torch.float64, requires_grad=True)
    gamma = torch.rand(K, dtype=torch.float64) + 0.5
    beta = torch.randn(K, dtype=torch.float64)
    z = torch.nn.functional.conv2d(x, w, padding=1)
    zb = z.detach().requires_grad_(True)
    y = torch.relu(torch.nn.functional.batch_norm(zb, None, None, gamma, beta, training=True, eps=1e-5))
    dy = torch.randn_like(y)
    (dzb,) = torch.autograd.grad(y, zb, dy)
    dx_ref, dw_ref = torch.autograd.grad(z, (x, w), dzb)
    perm = (lambda t: t.permute(0, 2, 3, 1).contiguous()) if layout == "NHWC" else (lambda t: t.contiguous())
    dev = dict(device="cuda", dtype=torch.float32)
    zc, dyc, xc, wc = (perm(t.detach()).to(**dev) for t in (z, dy, x, w))
    mean = z.mean((0, 2, 3)).to(**dev)
    invstd = (1 / torch.sqrt(z.var((0, 2, 3), unbiased=False) + 1e-5)).to(**dev)
    ybn = perm(torch.nn.functional.batch_norm(z.detach(), None, None, gamma, beta, training=True,
                                              eps=1e-5)).to(**dev)
    mask = igemm.relu_mask(ybn)
    pro = igemm.conv2d_grad_prologue(dyc, zc, mean, invstd, gamma.to(**dev), mask=mask, layout=layout)
    dx = igemm.conv2d_grad_input(dyc, wc, tuple(xc.shape), padding=1, layout=layout, mask=mask, prologue=pro)
    dw = igemm.conv2d_grad_weight(xc, dyc, tuple(wc.shape), padding=1, layout=layout, mask=mask, prologue=pro)
    torch.cuda.synchronize()
    assert rel_err(to_numpy(dx), to_numpy(perm(dx_ref))) < 1e-4
    assert rel_err(to_numpy(dw), to_numpy(perm(dw_ref))) < 1e-4


@pytest.mark.gpu
def test_gpu_fp32_gradient_and_accumulate(rng):
    """dw into an fp32 out from fp16 operands, and accumulate=True adding into it."""
    torch = pytest.importorskip("torch")
    p = dict(N=4, C=32, H=14, W=14, K=48, R=3, S=3, stride=(1, 1), padding=(1, 1), dilation=(1, 1), P=14, Q=14)
    xs, ws, ys = shapes(p, "NHWC")
    x, dy = to_torch(rng.standard_normal(xs), "float16"), to_torch(rng.standard_normal(ys), "float16")
    ref = reference.conv2d_grad_weight_ref(to_numpy(x), to_numpy(dy), ws, 1, 1, 1, "NHWC")
    out = poison(torch.empty(ws, dtype=torch.float32, device="cuda"))
    igemm.conv2d_grad_weight(x, dy, ws, 1, 1, layout="NHWC", out=out)
    assert rel_err(to_numpy(out), ref) < TOL["float16"]
    base = torch.randn(ws, dtype=torch.float32, device="cuda")
    acc = base.clone()
    igemm.conv2d_grad_weight(x, dy, ws, 1, 1, layout="NHWC", out=acc, accumulate=True)
    assert rel_err(to_numpy(acc), ref + to_numpy(base)) < TOL["float16"]


def test_wgrad_nchw_taps_choice():
    """An NCHW 1x1 unpadded wgrad without a native kernel (strict fp32; 16-bit on sm_80) is the GEMM form on the NHWC
    forward with N taps, the smaller operand moved, where P·Q rows load 16 bytes at a time (else the turned
    convolution); the deep reduction is split to fill the GPU (tf32x3-deep-splits)."""
    def plan(xs, ws, st=1, pd=0, dtype="float32", arch="sm_90a"):
        return igemm.Conv2dGradWeightPlan(xs, ws, dtype, "NCHW", st, pd, device="numpy", arch=arch, sms=132)
    p = plan((32, 64, 56, 56), (256, 64, 1, 1))
    pb, spec = p.plan.problem, p.plan.spec()
    assert p.role == "dy" and (pb.N, pb.H, pb.W, pb.C, pb.K, pb.R, pb.S) == (1, 32, 256, 3136, 64, 32, 1)
    assert spec.load_a == spec.load_b == "vec" and spec.splits == 64
    assert plan((32, 1024, 14, 14), (256, 1024, 1, 1)).role == "x"                    # dy moved: K < C
    assert plan((32, 256, 56, 56), (512, 256, 1, 1), 2).role == "dy"                 # strided: x subsampled
    assert plan((32, 64, 7, 7), (256, 64, 1, 1)).role is None                        # 49-element rows
    assert plan((32, 64, 8, 8), (256, 64, 1, 1), 1, 1).role is None                  # padded
    assert plan((32, 64, 56, 56), (256, 64, 3, 3), 1, 1).role is None                # taps
    assert plan((8, 64, 16, 16), (128, 64, 1, 1), dtype="float16", arch="sm_80").role == "dy"
    assert plan((8, 64, 16, 16), (128, 64, 1, 1), dtype="float16").role == "native"


@pytest.mark.gpu
@pytest.mark.parametrize("C, K, st, role", [(96, 128, 1, "dy"), (128, 60, 1, "x"), (96, 128, 2, "dy")])
@pytest.mark.parametrize("mode", ["plain", "mask", "bn"])
def test_gpu_wgrad_gemm_form(C, K, st, role, mode, rng):
    """wgrad's GEMM form (1x1 unpadded NHWC where neither the native kernel (C % 64, K % 8) nor the few-channel one
    (C < 64) runs; N·P·Q % 64 == 0 for its MN-major TMA tiles): either operand read in place, strided, with the mask /
    prologue."""
    torch = pytest.importorskip("torch")
    p = one_by_one(dict(N=2, C=C, H=16, W=16, K=K, R=1, S=1, stride=(st, st), padding=(0, 0), dilation=(1, 1)))
    xs, ws, _ = shapes(p, "NHWC")
    assert igemm.Conv2dGradWeightPlan(xs, ws, "float16", "NHWC", st, mask=mode != "plain").role == role
    assert _run_case(torch, p, "NHWC", "float16", rng, "wgrad", mode) <= TOL["float16"]


@pytest.mark.gpu
@pytest.mark.parametrize("C, K, st, role", [(24, 40, 1, "dy"), (40, 12, 1, "x"), (24, 40, 2, "dy"), (12, 20, 3, "dy")])
@pytest.mark.parametrize("mode", ["plain", "mask", "bn"])
def test_gpu_wgrad_nchw_taps(C, K, st, role, mode, rng):
    """wgrad's NCHW GEMM form (strict fp32, 1x1 unpadded): the NHWC forward with N taps reads one operand in place,
    strided, with the mask / prologue; fp32 ``out`` with accumulation."""
    torch = pytest.importorskip("torch")
    p = one_by_one(dict(N=3, C=C, H=12, W=12, K=K, R=1, S=1, stride=(st, st), padding=(0, 0), dilation=(1, 1)))
    xs, ws, _ = shapes(p, "NCHW")
    plan = igemm.Conv2dGradWeightPlan(xs, ws, "float32", "NCHW", st, mask=mode != "plain")
    assert plan.role == role
    assert _run_case(torch, p, "NCHW", "float32", rng, "wgrad", mode) <= TOL["float32"]
    x, dy = (torch.randn(s, device="cuda") for s in (xs, (3, K, p["P"], p["Q"])))
    base = torch.randn(ws, device="cuda")
    acc = base.clone()
    igemm.conv2d_grad_weight(x, dy, ws, st, layout="NCHW", out=acc, accumulate=True)
    ref = reference.conv2d_grad_weight_ref(to_numpy(x), to_numpy(dy), ws, st, 0, 1, "NCHW")
    assert rel_err(to_numpy(acc), ref + to_numpy(base)) < TOL["float32"]


@pytest.mark.gpu
def test_gpu_channels_last(rng):
    """torch channels_last dy and x with layout="NCHW": no copy of them (the NHWC plan reads their memory), dx and
    dw channels_last, NCHW values; the mask and the BN prologue over the same memory."""
    torch = pytest.importorskip("torch")
    cl = torch.channels_last
    x = torch.randn(4, 16, 12, 12, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    w = torch.randn(24, 16, 3, 3, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    dy = torch.randn(4, 24, 6, 6, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    z = torch.randn_like(dy)
    y = torch.randn_like(dy)
    mask = igemm.relu_mask(y.permute(0, 2, 3, 1))                      # dy's memory order
    mean, invstd = z.float().mean((0, 2, 3)), 1 / (z.float().var((0, 2, 3), unbiased=False) + 1e-5).sqrt()
    gamma = torch.rand(24, device="cuda") + 0.5
    pro = igemm.conv2d_grad_prologue(dy, z, mean, invstd, gamma, mask=mask)
    dx = igemm.conv2d_grad_input(dy, w, tuple(x.shape), 2, 1, mask=mask, prologue=pro)
    dw = igemm.conv2d_grad_weight(x, dy, tuple(w.shape), 2, 1, mask=mask, prologue=pro)
    assert dx.is_contiguous(memory_format=cl) and dw.is_contiguous(memory_format=cl)
    # the reference on plain NCHW copies (the mask unpacked from NHWC order)
    bits = torch.from_numpy(reference.unpack_mask(to_numpy(mask).view(np.uint32), dy.numel()).reshape(4, 6, 6, 24))
    g = torch.where(bits.permute(0, 3, 1, 2).cuda(), dy.float(), 0.)
    zf = z.float()
    dz = gamma[:, None, None] * invstd[:, None, None] * (
        g - g.mean((0, 2, 3), keepdim=True) - (zf - mean[:, None, None]) * invstd[:, None, None] ** 2
        * (g * (zf - mean[:, None, None])).mean((0, 2, 3), keepdim=True))
    rx = reference.conv2d_grad_input_ref(to_numpy(dz), to_numpy(w), tuple(x.shape), 2, 1, 1, "NCHW")
    rw = reference.conv2d_grad_weight_ref(to_numpy(x), to_numpy(dz), tuple(w.shape), 2, 1, 1, "NCHW")
    assert rel_err(to_numpy(dx), rx) < TOL["float16"] and rel_err(to_numpy(dw), rw) < TOL["float16"]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_gpu_conv2d_backward_forms_dz_once(layout, rng, monkeypatch):
    """conv2d_backward on 16-bit torch tensors with NHWC memory: one dz pass for both gradients (counted), dx and dw
    those of conv2d_grad_input and conv2d_grad_weight to one rounding, and within fp16 tolerance of float64."""
    torch = pytest.importorskip("torch")
    from igemm.conv import _backward_functional as bf
    calls = []
    real = bf.launch_dz
    monkeypatch.setattr(bf, "launch_dz", lambda *a, **k: (calls.append(k["mode"]), real(*a, **k))[1])
    cl = torch.channels_last
    x = torch.randn(4, 64, 12, 12, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    w = torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    dy = torch.randn(4, 64, 12, 12, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    z = torch.randn_like(dy)
    mask = igemm.relu_mask(torch.randn_like(dy).permute(0, 2, 3, 1))
    mean, invstd = z.float().mean((0, 2, 3)), 1 / (z.float().var((0, 2, 3), unbiased=False) + 1e-5).sqrt()
    pro = igemm.conv2d_grad_prologue(dy, z, mean, invstd, torch.rand(64, device="cuda") + 0.5, mask=mask)
    v = (lambda t: t.permute(0, 2, 3, 1)) if layout == "NHWC" else (lambda t: t)
    if layout == "NHWC":
        pro = igemm.GradPrologue(v(z), pro.coef, pro.grad_weight, pro.grad_bias)
    for kw, mode in (({"mask": mask}, "mask"), ({"mask": mask, "prologue": pro}, "bn")):
        calls.clear()
        dx, dw = igemm.conv2d_backward(v(dy), v(x), v(w), 1, 1, layout=layout, **kw)
        assert calls == [mode]
        ex = igemm.conv2d_grad_input(v(dy), v(w), tuple(v(x).shape), 1, 1, layout=layout, **kw)
        ew = igemm.conv2d_grad_weight(v(x), v(dy), tuple(v(w).shape), 1, 1, layout=layout, **kw)
        assert dx.shape == ex.shape and dw.shape == ew.shape and dx.stride() == ex.stride()
        assert rel_err(to_numpy(dx), to_numpy(ex)) < 2e-3 and rel_err(to_numpy(dw), to_numpy(ew)) < 2e-3
        if mode == "bn":
            # the float64 chain: dz = a·(bit ? dy : 0) + b·z + c, then both gradients
            a, b, c = to_numpy(pro.coef).astype(np.float64)
            g = reference.grad_prologue_ref(to_numpy(dy.permute(0, 2, 3, 1)), to_numpy(mask).view(np.uint32),
                                            (to_numpy(z.permute(0, 2, 3, 1)), a, b, c), "NHWC")
            xn, wn = to_numpy(x.permute(0, 2, 3, 1)), to_numpy(w.permute(0, 2, 3, 1))
            rx = reference.conv2d_grad_input_ref(g, wn, xn.shape, 1, 1, 1, "NHWC")
            rw = reference.conv2d_grad_weight_ref(xn, g, wn.shape, 1, 1, 1, "NHWC")
            nhwc = (lambda t: t) if layout == "NHWC" else (lambda t: t.permute(0, 2, 3, 1))
            assert rel_err(to_numpy(nhwc(dx)), rx) < TOL["float16"]
            assert rel_err(to_numpy(nhwc(dw)), rw) < TOL["float16"]


@pytest.mark.gpu
@pytest.mark.parametrize("layout,dtype", [("NCHW", "float16"), ("NHWC", "float16"), ("NHWC", "bfloat16")])
def test_gpu_conv2d_bn_backward_one_launch(layout, dtype, rng, monkeypatch):
    """conv2d_bn_backward on 16-bit torch tensors with NHWC memory takes the one-launch path (no separate dz pass),
    and gives the composed calls' results to one rounding and the float64 chain's within the dtype's tolerance."""
    torch = pytest.importorskip("torch")
    from igemm.conv import _backward_functional as bf
    fast = []
    real = bf._bn_once
    monkeypatch.setattr(bf, "_bn_once", lambda *a: (lambda r: (fast.append(r is not None), r)[1])(real(*a)))
    cl, td = torch.channels_last, getattr(torch, dtype)
    x = torch.randn(4, 64, 12, 12, device="cuda", dtype=td).contiguous(memory_format=cl)
    w = (torch.randn(64, 64, 3, 3, device="cuda", dtype=td) / 24).contiguous(memory_format=cl)
    dy = torch.randn(4, 64, 12, 12, device="cuda", dtype=td).contiguous(memory_format=cl)
    z = (torch.randn_like(dy) * 2 + 0.5).contiguous(memory_format=cl)
    zf = z.float()
    mean, invstd = zf.mean((0, 2, 3)), 1 / (zf.var((0, 2, 3), unbiased=False) + 1e-5).sqrt()
    gamma = torch.rand(64, device="cuda") + 0.5
    mask = igemm.relu_mask(torch.randn_like(dy).permute(0, 2, 3, 1))
    v = (lambda t: t.permute(0, 2, 3, 1)) if layout == "NHWC" else (lambda t: t)
    nhwc = (lambda t: t) if layout == "NHWC" else (lambda t: t.permute(0, 2, 3, 1))
    for m, gm in ((mask, gamma), (None, None)):
        fast.clear()
        got = igemm.conv2d_bn_backward(v(dy), v(x), v(w), v(z), mean, invstd, gm, 1, 1, mask=m, layout=layout,
                                       residual=True)
        assert fast == [True] * (2 if layout == "NCHW" else 1)      # (NCHW: the NHWC call on views inside)
        pro = igemm.conv2d_grad_prologue(v(dy), v(z), mean, invstd, gm, mask=m, layout=layout)
        ex, ew = igemm.conv2d_backward(v(dy), v(x), v(w), 1, 1, layout=layout, mask=m, prologue=pro)
        for a, b in zip(got, (ex, ew, pro.grad_weight, pro.grad_bias)):
            assert a.shape == b.shape and a.stride() == b.stride() and rel_err(to_numpy(a), to_numpy(b)) < 2e-3
        if m is None:
            assert got[4] is v(dy) or torch.equal(got[4], v(dy))
        else:
            assert torch.equal(nhwc(got[4]), igemm.relu_backward(dy.permute(0, 2, 3, 1), m))
        n = [to_numpy(t.permute(0, 2, 3, 1)).astype(np.float64) for t in (dy, x, w, z)]
        want = _bn_chain_ref(*n, to_numpy(mean), to_numpy(invstd), to_numpy(gm) if gm is not None else np.ones(64),
                             None if m is None else to_numpy(m).view(np.uint32), 1, 1, "NHWC")
        for a, b in zip((nhwc(got[0]), nhwc(got[1]), got[2], got[3]), want):
            assert rel_err(to_numpy(a).astype(np.float64), b) < TOL[dtype]
    before = [t.clone() for t in (dy, x, w, z, mean)]
    fast.clear()
    with pytest.raises(ValueError, match="mean"):          # (not the one launch's kind: the composed calls raise)
        igemm.conv2d_bn_backward(v(dy), v(x), v(w), v(z), mean[:32], invstd, gamma, 1, 1, mask=mask, layout=layout)
    assert not any(fast) and all(torch.equal(a, b) for a, b in zip((dy, x, w, z, mean), before))


@pytest.mark.gpu
def test_gpu_array_kinds(rng):
    """numpy arrays (copied), CuPy arrays and torch tensors give the same dx."""
    torch = pytest.importorskip("torch")
    p = dict(N=2, C=8, H=9, W=9, K=16, R=3, S=3, stride=(2, 2), padding=(1, 1), dilation=(1, 1), P=5, Q=5)
    xs, ws, ys = shapes(p, "NCHW")
    dy, w = rng.standard_normal(ys).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    ref = reference.conv2d_grad_input_ref(dy, w, xs, 2, 1, 1, "NCHW")
    got = [igemm.conv2d_grad_input(dy, w, xs, 2, 1)]
    got.append(to_numpy(igemm.conv2d_grad_input(torch.from_numpy(dy).cuda(), torch.from_numpy(w).cuda(), xs, 2, 1)))
    try:
        import cupy
        got.append(to_numpy(igemm.conv2d_grad_input(cupy.asarray(dy), cupy.asarray(w), xs, 2, 1)))
    except ImportError:
        pass
    for g in got:
        assert rel_err(g, ref) < TOL["float32"]


# ================================================================================================ precompile
def stubs(n: int = GPU_PROBLEMS) -> dict:
    """{stub: name} of every kernel the GPU tests here launch (sm_90a, 132 SMs)."""
    from igemm.conv import _moves
    out = {s: name for name, s in _moves.all_variants()}
    for cls in (igemm.Conv2dGradInputPlan, igemm.Conv2dGradWeightPlan):      # test_gpu_channels_last
        for sub in cls((4, 12, 12, 16), (24, 3, 3, 16), "float16", "NHWC", 2, 1, mask=True, prologue=True,
                       device="numpy", arch="sm_90a", sms=132).sub_plans():
            name, s = sub.kernel(True, True)
            out[s] = name
    for cls in (igemm.Conv2dGradInputPlan, igemm.Conv2dGradWeightPlan):      # test_gpu_conv2d_backward_forms_dz_once
        for dt, mask, pro in (("float16", False, False), ("float16", True, False), ("float16", True, True),
                              ("bfloat16", False, False)):               # (bf16: ..._bn_backward_one_launch)
            for sub in cls((4, 12, 12, 64), (64, 3, 3, 64), dt, "NHWC", 1, 1, mask=mask, prologue=pro,
                           device="numpy", arch="sm_90a", sms=132).sub_plans():
                name, s = sub.kernel(True, True)
                out[s] = name
    for C, K, st in ((96, 128, 1), (128, 60, 1), (96, 128, 2)):          # test_gpu_wgrad_gemm_form
        p = one_by_one(dict(N=2, C=C, H=16, W=16, K=K, R=1, S=1, stride=(st, st), padding=(0, 0), dilation=(1, 1)))
        xs, ws, _ = shapes(p, "NHWC")
        for fused in (False, True):
            for sub in igemm.Conv2dGradWeightPlan(xs, ws, "float16", "NHWC", st, mask=fused, device="numpy",
                                                  arch="sm_90a", sms=132).sub_plans():
                name, s = sub.kernel(True, True)
                out[s] = name
    from test_backward_native import W_IN_PLACE_DGRAD                              # test_gpu_dgrad_nchw_w_in_place
    for N, C, H, K, cfg in W_IN_PLACE_DGRAD:
        for dt in ("float16", "bfloat16"):
            for mask in (False, True):
                for sub in igemm.Conv2dGradInputPlan(
                        (N, C, H, H), (K, C, 1, 1), dt, "NCHW", 1, 0, mask=mask, device="numpy", arch="sm_90a", sms=132,
                        options=igemm.Conv2dOptions(config=cfg) if cfg else None).sub_plans():
                    name, s = sub.kernel(True, True)
                    out[s] = name
    from test_backward_native import FLIP_DGRAD                                    # test_gpu_dgrad_nchw_flip
    for N, C, H, W, K, R, S, pd, dl in FLIP_DGRAD:
        for dt in ("float16", "bfloat16"):
            for mask in (False, True):
                for sub in igemm.Conv2dGradInputPlan((N, C, H, W), (K, C, R, S), dt, "NCHW", 1, pd, dl, mask=mask,
                                                     device="numpy", arch="sm_90a", sms=132).sub_plans():
                    name, s = sub.kernel(True, True)
                    out[s] = name
    for C, K, st in ((24, 40, 1), (40, 12, 1), (24, 40, 2), (12, 20, 3)):          # test_gpu_wgrad_nchw_taps
        p = one_by_one(dict(N=3, C=C, H=12, W=12, K=K, R=1, S=1, stride=(st, st), padding=(0, 0), dilation=(1, 1)))
        xs, ws, _ = shapes(p, "NCHW")
        for sub in igemm.Conv2dGradWeightPlan(xs, ws, "float32", "NCHW", st, device="numpy", arch="sm_90a",
                                              sms=132).sub_plans():
            name, s = sub.kernel(True, True)
            out[s] = name
    for op in ("dgrad", "wgrad"):
        for dtype in ("float16", "bfloat16", "float32"):
            for layout in ("NCHW", "NHWC"):
                for i in range(n):
                    p = problem(i)
                    xs, ws, _ = shapes(p, layout)
                    cls = igemm.Conv2dGradInputPlan if op == "dgrad" else igemm.Conv2dGradWeightPlan
                    for fused in (False, True):
                        plan = cls(xs, ws, dtype, layout, *geom(p), mask=fused, device="numpy", arch="sm_90a",
                                   sms=132)
                        for sub in plan.sub_plans():
                            name, s = sub.kernel(True, True)
                            out[s] = name
    return out


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "precompile":
        from igemm import _build
        todo = stubs(int(sys.argv[3]) if len(sys.argv) > 3 else GPU_PROBLEMS)
        print(f"compiling {len(todo)} kernels", flush=True)
        print(_build.compile_many([(n, s) for s, n in todo.items()], sys.argv[2] if len(sys.argv) > 2 else "sm_90a"))
    else:
        print("usage: python tests/test_backward.py precompile [arch] [problems]")
