"""conv2d: references, numpy backend, validation, kernel selection, compilation, and the GPU oracle."""
import contextlib
import dataclasses
import shutil

import numpy as np
import pytest

import igemm
from igemm import _build, reference
from igemm import epilogues as ep
from igemm.conv._problem import ConvProblem
from igemm.conv._rules import candidates, choose_config
from igemm.conv._spec import store_for, validate_spec
from igemm.conv import Conv2dPlan
from igemm.conv._plan import override as _override
from igemm.conv._spec import stub as _stub

from helpers import TOL, poison, rel_err, to_numpy, to_torch

LAYOUTS = ["NCHW", "NHWC"]


def rand_problem(rng, small=True, aligned=None):
    """A random valid problem: (x_shape, w_shape, stride, padding, dilation) for NCHW order."""
    while True:
        N = int(rng.integers(1, 4))
        if aligned is None:
            aligned = rng.random() < 0.5
        C = int(rng.choice([8, 16, 24, 32, 64])) if aligned else int(rng.integers(1, 40))
        K = int(rng.choice([8, 16, 32, 64, 96, 136])) if aligned else int(rng.integers(1, 80))
        R, S = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        H, W = int(rng.integers(1, 24)), int(rng.integers(1, 24))
        st = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        pd = (int(rng.integers(0, 4)), int(rng.integers(0, 4)))
        dl = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        P = (H + 2 * pd[0] - dl[0] * (R - 1) - 1) // st[0] + 1
        Q = (W + 2 * pd[1] - dl[1] * (S - 1) - 1) // st[1] + 1
        if P >= 1 and Q >= 1:
            return (N, C, H, W), (K, C, R, S), st, pd, dl


def to_layout(x_nchw, w_kcrs, layout):
    if layout == "NHWC":
        return np.ascontiguousarray(x_nchw.transpose(0, 2, 3, 1)), np.ascontiguousarray(w_kcrs.transpose(0, 2, 3, 1))
    return x_nchw, w_kcrs


# ------------------------------------------------------------------------------------ references
@pytest.mark.parametrize("layout", LAYOUTS)
def test_references_agree(layout, rng):
    for _ in range(25):
        xs, ws, st, pd, dl = rand_problem(rng)
        x, w = to_layout(rng.standard_normal(xs), rng.standard_normal(ws), layout)
        a = reference.conv2d_direct(x, w, st, pd, dl, layout)
        b = reference.conv2d_im2col(x, w, st, pd, dl, layout)
        c = reference.conv2d_fft(x, w, st, pd, dl, layout)
        assert a.shape == b.shape == c.shape
        np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(c, a, rtol=1e-9, atol=1e-9)


def test_reference_by_definition(rng):
    """The direct reference against a literal 7-deep loop on a tiny problem."""
    x = rng.standard_normal((2, 3, 5, 6))
    w = rng.standard_normal((4, 3, 3, 2))
    st, pd, dl = (2, 1), (1, 2), (1, 2)
    y = reference.conv2d_direct(x, w, st, pd, dl)
    N, C, H, W = x.shape
    K, _, R, S = w.shape
    P, Q = y.shape[2:]
    ref = np.zeros_like(y)
    for n in range(N):
        for k in range(K):
            for p in range(P):
                for q in range(Q):
                    acc = 0.0
                    for c in range(C):
                        for r in range(R):
                            for s in range(S):
                                h, ww = p * st[0] - pd[0] + r * dl[0], q * st[1] - pd[1] + s * dl[1]
                                if 0 <= h < H and 0 <= ww < W:
                                    acc += x[n, c, h, ww] * w[k, c, r, s]
                    ref[n, k, p, q] = acc
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------ numpy backend + API
@pytest.mark.parametrize("layout", LAYOUTS)
def test_numpy_backend(layout, rng, numpy_backend):
    xs, ws, st, pd, dl = (2, 5, 9, 7), (3, 5, 3, 3), (2, 1), (1, 2), (1, 2)
    x, w = to_layout(rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32), layout)
    y = igemm.conv2d(x, w, st, pd, dl, layout=layout)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, reference.conv2d_direct(x, w, st, pd, dl, layout), rtol=1e-5, atol=1e-5)
    plan = Conv2dPlan(x.shape, w.shape, "float32", layout, st, pd, dl, device="numpy")
    np.testing.assert_array_equal(plan(x, w), y)


def _errs():
    x = np.ones((2, 4, 8, 8), np.float32)
    w = np.ones((3, 4, 3, 3), np.float32)
    return x, w


@pytest.mark.parametrize("call, exc, match", [
    (lambda x, w: igemm.conv2d(x, w, layout="NCWH"), ValueError, "layout"),
    (lambda x, w: igemm.conv2d(x[0], w), ValueError, "4-D"),
    (lambda x, w: igemm.conv2d(x, w[:, :3]), ValueError, "input channels"),
    (lambda x, w: igemm.conv2d(x, w, stride=0), ValueError, "stride"),
    (lambda x, w: igemm.conv2d(x, w, padding=-1), ValueError, "padding"),
    (lambda x, w: igemm.conv2d(x, w, dilation=0), ValueError, "dilation"),
    (lambda x, w: igemm.conv2d(x, w, stride=(1, 2, 3)), ValueError, "stride"),
    (lambda x, w: igemm.conv2d(x, w, stride=1.5), TypeError, "stride"),
    (lambda x, w: igemm.conv2d(x[:, :, :2, :2], w, dilation=2), ValueError, "does not fit"),
    (lambda x, w: igemm.conv2d(x.astype(np.float64), w.astype(np.float64)), TypeError, "dtype"),
    (lambda x, w: igemm.conv2d(x.astype(np.int32), w.astype(np.int32)), TypeError, "dtype"),
    (lambda x, w: igemm.conv2d(x, w.astype(np.float16)), TypeError, "w: dtype"),
    (lambda x, w: igemm.conv2d(x, w, precision="fast"), ValueError, "precision"),
    (lambda x, w: igemm.conv2d(x[:, :, ::2], w), ValueError, "contiguous"),
    (lambda x, w: igemm.conv2d(x, w, out=np.empty((2, 3, 7, 7), np.float32)), ValueError, "out"),
    (lambda x, w: igemm.conv2d(x, w, out=np.empty((2, 3, 6, 6), np.float16)), TypeError, "out"),
    (lambda x, w: igemm.conv2d(x, w, epilogue="relu"), TypeError, "epilogue"),
    (lambda x, w: igemm.conv2d(x[:0], w), ValueError, "empty"),
    (lambda x, w: igemm.conv2d(x, w, residual=np.ones((2, 3, 6, 6), np.float32)), ValueError, "Add"),
])
def test_validation_errors(call, exc, match, numpy_backend):
    x, w = _errs()
    with pytest.raises(exc, match=match):
        call(x, w)


def test_out_is_written_in_place(rng, numpy_backend):
    x, w = _errs()
    out = np.full((2, 3, 6, 6), np.nan, np.float32)
    y = igemm.conv2d(x, w, out=out)
    assert y is out and np.all(out == 36)


# ------------------------------------------------------------------------------------ kernel selection
def _chain_of(signature) -> "ep.Chain":
    """A chain of the given structure (``Chain.signature()``), with placeholder vectors."""
    make = {"BatchNorm": lambda: ep.BatchNorm(0, 0, 0, 0), "Bias": lambda: ep.Bias(0), "Add": ep.Add}
    ops = []
    for sig in signature:
        if sig[0] == "ReLU":
            ops.append(ep.ReLU(mask=sig[1]))
        elif sig[0] == "PReLU":
            ops.append(ep.PReLU(np.zeros(1) if sig[1] else 0.25))
        else:
            ops.append(make[sig[0]]())
    return ep.chain(*ops)


def _pb(**kw):
    """A ConvProblem; ``epilogue`` given as a chain's signature (``(("BatchNorm",), ("ReLU", True))``)."""
    base = dict(N=32, C=64, H=56, W=56, K=64, R=3, S=3, stride=(1, 1), padding=(1, 1), dilation=(1, 1),
                dtype="float16", layout="NHWC", precision="tensorop")
    base.update(kw)
    chain = _chain_of(base.pop("epilogue", ()))
    return ConvProblem(**base, epilogue=chain.functors(base["dtype"], base.get("residual_dtype")), mask=chain.mask)


def test_choose_config_rules(monkeypatch):
    from igemm.conv._spec import validate_spec
    s = choose_config(_pb())
    assert (s.math, s.load_a, s.load_b, s.store, s.vec_o) == ("wgmma", "tma", "tma", "regs", 8)
    assert choose_config(_pb(C=32)).load_a == "vec"                       # TMA k-tiles are 64 channels
    assert choose_config(_pb(), "sm_80").load_a == "vec"
    assert (s.bk, s.bn) == (64, 64)
    s80 = choose_config(_pb(), "sm_80")
    assert (s80.math, s80.bk) == ("tensorop", 32)
    assert choose_config(_pb(C=3, R=7, S=7)).load_a == "elem"
    assert choose_config(_pb(C=3, R=7, S=7)).load_b == "elem"          # Kred = 147
    assert choose_config(_pb(layout="NCHW")).load_a == "elem"
    assert choose_config(_pb(), x_aligned=False).load_a == "elem"
    # 3xTF32: on warpgroup MMAs on Hopper (128x128 tiles, 32-element k-tiles), on mma.sync elsewhere
    s32 = choose_config(_pb(dtype="float32", precision="strict"))
    assert (s32.math, s32.bm, s32.bn, s32.bk, s32.wm, s32.wn) == ("tf32x3_wgmma", 128, 64, 32, 2, 1)
    assert choose_config(_pb(dtype="float32", precision="strict"), "sm_80").math == "tf32x3"
    # 3xTF32 splits on mma.sync: up to 4 while the tiles are fewer than two an SM, more for a reduction of >= 256
    # k-tiles (tf32x3-deep-splits: N = 1 3x3 512->512 @7, one tile, 288 k-tiles); on wgmma any count that costs
    # least in waves of one CTA an SM (tf32x3-wgmma-splits: 4 tiles x 32 splits of 4-5 k-tiles, one wave)
    deep = _pb(N=1, C=512, K=512, H=7, W=7, dtype="float32", precision="strict")
    assert choose_config(deep, "sm_80").splits == 16 and choose_config(deep).splits == 32
    assert choose_config(_pb(N=8, C=256, K=256, H=14, W=14, dtype="float32", precision="strict"), "sm_80").splits == 4
    assert choose_config(_pb(N=8, C=256, K=256, H=14, W=14, dtype="float32", precision="strict")).splits == 5
    # a one-k-tile 1x1 alone over 12+ tiles an SM: the persistent kernel, 2 CTAs an SM, 3 stages; not where the
    # kernel writes BatchNorm statistics (persistent-1x1-alone-2ctas)
    one = dict(C=64, K=256, R=1, S=1, padding=(0, 0))
    s = choose_config(_pb(**one))
    assert (s.math, s.ctas, s.stages, s.bn) == ("wgmma_ws", 2, 3, 128)
    assert choose_config(_pb(**one), bn_stats=True).math == "wgmma"
    ffma = Conv2dPlan((2, 64, 9, 9), (32, 64, 3, 3), "float32", padding=1, device="numpy",
                      options=igemm.Conv2dOptions(config={"math": "simt"})).spec()
    assert (ffma.math, ffma.bm, ffma.bn, ffma.bk) == ("simt", 128, 128, 8)      # the FFMA kernel's own tile
    # strict fp32 never runs on single TF32, whatever the config asks
    pb32 = _pb(dtype="float32", precision="strict")
    assert not validate_spec(dataclasses.replace(choose_config(pb32), math="tensorop"), pb32, raise_=False)
    assert validate_spec(dataclasses.replace(choose_config(_pb(dtype="float32", precision="tf32")), math="tf32x3"),
                         _pb(dtype="float32", precision="tf32"), raise_=False)
    assert not validate_spec(dataclasses.replace(choose_config(_pb()), math="tf32x3", bk=32, wm=2, wn=2), _pb(),
                             raise_=False)
    tf = choose_config(_pb(dtype="float32", precision="tf32"))
    assert (tf.math, tf.bk) == ("tensorop", 16)
    big = choose_config(_pb(K=256, epilogue=(("ReLU", True),)))
    assert (big.store, big.fuse_mask) == ("regs", True)                   # the register epilogue
    relu_m = (("ReLU", True),)
    assert choose_config(_pb(K=264, epilogue=relu_m)).fuse_mask is True     # registers: a byte per 8-channel vector
    assert choose_config(_pb(K=262, epilogue=relu_m)).fuse_mask is False    # the fp32 C tile: words would straddle
    assert choose_config(_pb(K=264, epilogue=relu_m), "sm_80").fuse_mask is False   # tiles (K % 32 != 0)
    res = choose_config(_pb(K=256, epilogue=(("Add",), ("ReLU", True)), residual_dtype="float32"))
    assert (res.store, res.fuse_mask) == ("regs", True)
    assert choose_config(_pb(K=256, layout="NCHW", H=28, W=28)).store == "regsnchw"  # NCHW output, registers
    nres = choose_config(_pb(K=256, layout="NCHW", epilogue=(("Add",), ("ReLU", True)), residual_dtype="float16"))
    assert (nres.store, nres.fuse_mask) == ("regsnchw", True)             # a 16-bit residual: staged in the C tile
    nr32 = choose_config(_pb(K=256, layout="NCHW", epilogue=(("Add",), ("ReLU", True)), residual_dtype="float32"))
    assert (nr32.store, nr32.fuse_mask) == ("nchw", True)                 # an fp32 residual: the fp32 C tile
    assert choose_config(_pb(K=256, layout="NCHW"), "sm_80").store == "nchw"
    assert choose_config(_pb(K=256), "sm_80").store == "rows"
    assert choose_config(_pb(N=1, H=7, W=7, C=512, K=512)).store == "rows"           # split-K
    small = choose_config(_pb(N=1, H=7, W=7, C=512, K=512))                      # 8 tiles: split-K
    assert (small.math, small.splits) == ("wgmma", 9)
    for kw in (dict(N=1, H=14, W=14, C=256, K=256), dict(N=8, H=7, W=7, C=512, K=512)):
        ws = choose_config(_pb(**kw))                   # few tiles, deep reduction: the persistent kernel
        assert (ws.math, ws.splits, ws.persistent) == ("wgmma_ws", 1, True) and validate_spec(ws, _pb(**kw))
    # at most one 64-row tile per SM (with 64 columns, else 128): one consumer and a deep ring
    # (and at most half a wave with >= 32 k-tiles: two CTAs a tile, the cluster k-split)
    for kw, want in ((dict(N=8, H=7, W=7, C=512, K=512), (64, 6, 2)),
                     (dict(N=8, H=14, W=14, C=256, K=256), (64, 8, 1)),
                     (dict(N=8, H=28, W=28, C=128, K=128), (128, 6, 1)),
                     (dict(N=32, H=7, W=7, C=512, K=512), (128, 6, 1)),
                     (dict(N=1, H=14, W=14, C=256, K=256), (64, 6, 2)),
                     (dict(N=1, H=28, W=28, C=128, K=128), (64, 8, 1))):
        ws = choose_config(_pb(**kw))
        assert (ws.math, ws.wm, ws.bn, ws.stages, ws.csplit) == ("wgmma_ws", 1, *want), (kw, ws.name())
        assert "IGEMM_WS_CTAS" not in _stub(ws)     # (one CTA an SM: no B-tile bookkeeping compiled in)
        assert validate_spec(ws, _pb(**kw)) and ws.smem + ws.static_smem <= 227 * 1024
        assert ("__cluster_dims__(2, 1, 1)" in _stub(ws)) == ws.name().endswith("_cs2") == (ws.csplit == 2)
    cs = choose_config(_pb(N=8, H=7, W=7, C=512, K=512))
    for cfg in ({"wm": 2}, {"math": "wgmma"}, {"splits": 3}):    # overrides the cluster k-split cannot run drop it
        sp = _override(cs, _pb(N=8, H=7, W=7, C=512, K=512), cfg)
        assert sp.csplit == 1 and validate_spec(sp, _pb(N=8, H=7, W=7, C=512, K=512)), (cfg, sp.name())
    assert not validate_spec(dataclasses.replace(cs, csplit=3), _pb(N=8, H=7, W=7, C=512, K=512), raise_=False)
    assert choose_config(_pb(N=1, H=7, W=7, C=512, K=512, R=1, S=1)).math == "wgmma_ws"   # a 1x1 of 8 k-tiles
    assert choose_config(_pb(N=1, H=7, W=7, C=128, K=512, R=1, S=1)).math == "wgmma"    # 2 k-tiles: per-tile
    assert choose_config(_pb(N=32, H=28, W=28, C=128, K=128)).math == "wgmma"    # enough tiles
    # config overrides the persistent kernel cannot run fall back to the per-tile kernel
    xs, wsh = (8, 7, 7, 512), (512, 3, 3, 512)
    for cfg, want in (({"splits": 4}, ("wgmma", 4)), ({"load_a": "vec", "load_b": "vec"}, ("wgmma", 3)),
                      ({"stages": 3}, ("wgmma_ws", 1))):
        sp = Conv2dPlan(xs, wsh, "float16", "NHWC", 1, 1, device="numpy", options=igemm.Conv2dOptions(config=cfg)).spec()
        assert (sp.math, sp.splits) == want, (cfg, sp.name())
    # stream-K: asked for by config (never a default), no split-K; a misaligned x gathers on the per-tile kernel
    plan = Conv2dPlan((32, 7, 7, 512), wsh, "float16", "NHWC", 1, 1, device="numpy", options=igemm.Conv2dOptions(config={"streamk": 1}))
    sp = plan.spec()
    assert (sp.streamk, sp.splits, sp.store, sp.load_a) == (1, 1, "regs", "tma") and sp.name().endswith("_sk")
    gather = plan.spec(x_aligned=False)
    assert (gather.streamk, gather.math, gather.load_a) == (0, "wgmma", "elem") and validate_spec(gather, plan.kproblem)
    assert not any(choose_config(_pb(**kw)).streamk for kw in (dict(), dict(N=32, H=7, W=7, C=512, K=512)))
    sp = Conv2dPlan(xs, wsh, "float16", "NHWC", 1, 1, device="numpy", options=igemm.Conv2dOptions(config={"streamk": 1})).spec()   # default: persistent
    assert (sp.math, sp.streamk, sp.splits) == ("wgmma", 1, 1), sp.name()
    assert store_for(_pb(K=256, epilogue=(("ReLU", True),)), "wgmma", 128, 1, regs=False)[0] == "rows"
    odd = choose_config(_pb(K=300, epilogue=(("ReLU", True),)))
    assert (odd.store, odd.vec_o, odd.fuse_mask) == ("rows", 1, False)    # words would straddle CTAs
    nchw = choose_config(_pb(layout="NCHW", H=28, W=28, epilogue=(("ReLU", True),)))
    assert (nchw.store, nchw.vec_o, nchw.fuse_mask) == ("regsnchw", 8, True)   # 784 % 8 == 0: each tile's bytes
    nchw56 = choose_config(_pb(layout="NCHW", epilogue=(("ReLU", True),)))
    assert nchw56.fuse_mask
    for hw in (14, 7):                                                    # 4- and 1-pixel vectors: not fused
        assert not choose_config(_pb(layout="NCHW", H=hw, W=hw, epilogue=(("ReLU", True),))).fuse_mask
    nchw32 = choose_config(_pb(layout="NCHW", H=28, W=28, dtype="float32", precision="tf32",
                               epilogue=(("ReLU", True),)))
    assert (nchw32.store, nchw32.fuse_mask) == ("nchw", False)           # the fp32 C tile: whole words only
    for hw, v in ((14, 4), (7, 1), (6, 4), (5, 1)):                       # widest vector dividing P*Q
        assert choose_config(_pb(layout="NCHW", H=hw, W=hw)).vec_o == v
    assert choose_config(_pb(layout="NCHW", H=6, W=5)).vec_o == 2


def test_wide_1x1_takes_128_row_tiles():
    """1x1 convs with 2048 output channels and half a wave of 128-row tiles take 128x128 tiles (the filter
    read once per 128 output rows, not 64), with or without a chain; an NCHW output with a residual keeps
    64-row tiles, as do 1024 output channels."""
    from igemm.conv._paths import kernel_setup
    add = (("BatchNorm",), ("Add",), ("ReLU", True))
    for layout in LAYOUTS:
        for kw in (dict(C=512, H=7, W=7), dict(C=1024, H=14, W=14, stride=(2, 2))):
            for ep, rdt in (((), None), ((("BatchNorm",), ("ReLU", True)), None), (add, "float16")):
                pb = _pb(K=2048, R=1, S=1, padding=(0, 0), layout=layout, epilogue=ep, residual_dtype=rdt, **kw)
                kp = kernel_setup(pb, arch="sm_90a")[1]
                s = choose_config(kp)
                want = (64, 128) if layout == "NCHW" and rdt else (128, 128)
                assert (s.bm, s.bn) == want and s.math == "wgmma" and validate_spec(s, kp), (layout, kw, ep, s.name())
    narrow = choose_config(_pb(C=512, K=1024, H=28, W=28, R=1, S=1, padding=(0, 0), stride=(2, 2)))
    assert narrow.bm == 64, narrow.name()


def test_deep_1x1_takes_the_persistent_kernel():
    """1x1 convs of 16+ k-tiles (1024-2048 input channels) whose tiles make at most a wave take the persistent
    kernel with one consumer and a deep ring, as filters with taps do: 64x128 tiles where 64x64 would be more
    than a wave (1x1 2048->512 @7, N=32), 64x64 with 8 stages where they fit one (N=16); split-K's small batches
    keep their cluster k-split; an NCHW output with a residual, shallower reductions and more tiles stay
    per-tile."""
    from igemm.conv._paths import kernel_setup
    add = (("BatchNorm",), ("Add",), ("ReLU", True))
    kw = dict(C=2048, K=512, H=7, W=7, R=1, S=1, padding=(0, 0))
    for layout in LAYOUTS:
        for N, want in ((32, (64, 128, 6, 1)), (16, (64, 64, 8, 1)), (8, (64, 64, 6, 2))):
            for ep, rdt in (((), None), ((("BatchNorm",), ("ReLU", True)), None), (add, "float16")):
                kp = kernel_setup(_pb(N=N, layout=layout, epilogue=ep, residual_dtype=rdt, **kw), arch="sm_90a")[1]
                s = choose_config(kp)
                if rdt and layout == "NCHW" and N > 8:
                    assert s.math == "wgmma" and (s.bm, s.bn) == (64, 64), (N, s.name())
                    continue
                assert s.math == "wgmma_ws" and (s.bm, s.bn, s.stages, s.csplit) == want, (layout, N, ep, s.name())
                assert s.wm == 1 and s.ctas == 1 and validate_spec(s, kp), s.name()
    for pkw in (dict(N=64, **kw), dict(N=8, C=512, K=256, H=28, W=28, R=1, S=1, padding=(0, 0))):   # 392 tiles; 8 k-tiles
        s = choose_config(kernel_setup(_pb(**pkw), arch="sm_90a")[1])
        assert s.math == "wgmma", (pkw, s.name())


def test_large_batch_tiles():
    """Large batches (N=64-128): 128x128 tiles with taps take 4 stages (one CTA an SM) where that fills the
    waves and 3 stages (two CTAs) would not; 1x1 convs of 512+ channels in and out take 128x128 tiles from 5
    tiles an SM (not an NCHW output with a residual). The N=32 benchmark layers keep their kernels."""
    from igemm.conv._rules import _wave_fill
    from igemm.conv._paths import kernel_setup
    assert _wave_fill(392, 132) == 392 / 396 and _wave_fill(392, 264) == 392 / 528 and _wave_fill(100, 132) == 100 / 132
    add = (("BatchNorm",), ("Add",), ("ReLU", True))
    for layout in LAYOUTS:
        for kw, N, stages in ((dict(C=256, K=256, H=14, W=14), 128, 4), (dict(C=256, K=256, H=14, W=14), 64, 3),
                              (dict(C=256, K=256, H=14, W=14), 32, 4), (dict(C=128, K=128, H=28, W=28), 64, 4),
                              (dict(C=128, K=128, H=28, W=28), 128, 3), (dict(C=128, K=128, H=28, W=28), 32, 3),
                              (dict(C=256, K=256, H=28, W=28, stride=(2, 2)), 128, 4),
                              (dict(C=512, K=512, H=7, W=7), 128, 3)):
            s = choose_config(kernel_setup(_pb(N=N, layout=layout, **kw), arch="sm_90a")[1])
            assert (s.math, s.bm, s.bn, s.stages) == ("wgmma", 128, 128, stages), (kw, N, s.name())
        for kw, N, bm in ((dict(C=512, K=1024, H=28, W=28, stride=(2, 2)), 64, 128),
                          (dict(C=512, K=1024, H=28, W=28, stride=(2, 2)), 128, 128),
                          (dict(C=512, K=1024, H=28, W=28, stride=(2, 2)), 32, 64),
                          (dict(C=1024, K=512, H=14, W=14), 128, 128), (dict(C=1024, K=512, H=14, W=14), 64, 64),
                          (dict(C=512, K=256, H=28, W=28), 128, 64)):          # (256 output channels: 3 tiles an SM)
            for ep, rdt in (((), None), ((("BatchNorm",), ("ReLU", True)), None), (add, "float16")):
                kp = kernel_setup(_pb(N=N, R=1, S=1, padding=(0, 0), layout=layout, epilogue=ep, residual_dtype=rdt,
                                      **kw), arch="sm_90a")[1]
                s = choose_config(kp)
                want = 64 if layout == "NCHW" and rdt else bm
                assert s.math == "wgmma" and (s.bm, s.bn) == (want, 128) and validate_spec(s, kp), (kw, N, ep, s.name())


def test_small_batch_tiles():
    """Small batches: 64x128 tiles stay where 64x64 tiles (3 CTAs an SM) would spill into a second wave that
    they do not need (N=8, 1x1 to 1024 channels: 200 tiles of 64x128); with fewer 64x128 tiles 64 columns still
    fill the GPU. Split-K gives way to the cluster k-split at a handful of tiles with at most 32 k-tiles (N=1,
    1x1 2048->512 @7), not with more (3x3 512->512 @7, 72)."""
    from igemm.conv._paths import kernel_setup
    add = (("BatchNorm",), ("Add",), ("ReLU", True))
    for layout in LAYOUTS:
        for kw, N, bn in ((dict(C=256, K=1024, H=14, W=14), 8, 128),
                          (dict(C=512, K=1024, H=28, W=28, stride=(2, 2)), 8, 128),
                          (dict(C=256, K=1024, H=14, W=14), 4, 64),                # 104 tiles of 64x128
                          (dict(C=512, K=128, H=28, W=28), 8, 64)):                # 98
            for ep, rdt in (((), None), ((("BatchNorm",), ("ReLU", True)), None), (add, "float16")):
                s = choose_config(kernel_setup(_pb(N=N, R=1, S=1, padding=(0, 0), layout=layout, epilogue=ep,
                                                   residual_dtype=rdt, **kw), arch="sm_90a")[1])
                assert s.math == "wgmma" and (s.bm, s.bn, s.splits) == (64, bn, 1), (kw, N, s.name())
        one = choose_config(kernel_setup(_pb(N=1, C=2048, K=512, H=7, W=7, R=1, S=1, padding=(0, 0), layout=layout),
                                         arch="sm_90a")[1])
        assert (one.math, one.csplit, one.splits) == ("wgmma_ws", 2, 1), one.name()
        deep = choose_config(kernel_setup(_pb(N=1, C=512, K=512, H=7, W=7, layout=layout), arch="sm_90a")[1])
        assert deep.math == "wgmma" and deep.splits > 1, deep.name()


def test_launch_smem_and_residual_staging(monkeypatch):
    """A TMA kernel whose reduction is shorter than its ring launches with the stages it touches, one more
    where it stages a 16-bit residual there (KernelSpec.residual_staged: NHWC register epilogue, or NCHW with
    vectors of at least 4 pixels; not an fp32 residual, not 1- or 2-pixel vectors)."""
    one = ((("BatchNorm",), ("Add",), ("ReLU", True)))
    kw = dict(H=56, W=56, K=256, R=1, S=1, padding=(0, 0))
    plain = choose_config(_pb(**kw), bn_stats=True)     # (the per-tile kernel: alone it is persistent-1x1-alone-2ctas)
    res16 = choose_config(_pb(**kw, epilogue=one, residual_dtype="float16"))
    res32 = choose_config(_pb(**kw, epilogue=one, residual_dtype="float32"))
    stage = (plain.bm + plain.bn) * plain.bk * 2
    assert (plain.stages, plain.load_b) == (2, "tma")
    assert not plain.residual_staged and res16.residual_staged and not res32.residual_staged
    assert plain.launch_smem(1) == max(stage, plain.bm * (plain.bn + 8) * 4) + 1024
    assert res16.launch_smem(1) == res16.smem                    # both stages: k-tile 0 and the residual
    assert res16.launch_smem(1) > plain.launch_smem(1)
    nchw = choose_config(_pb(layout="NCHW", H=7, W=7, epilogue=one, residual_dtype="float16"))
    assert (nchw.store, nchw.vec_o, nchw.residual_staged) == ("regsnchw", 1, False)
    nchw14 = choose_config(_pb(layout="NCHW", H=14, W=14, epilogue=one, residual_dtype="bfloat16"))
    assert (nchw14.store, nchw14.vec_o, nchw14.residual_staged) == ("regsnchw", 4, True)
    nchw30 = choose_config(_pb(layout="NCHW", H=6, W=5, epilogue=one, residual_dtype="float16"))
    assert (nchw30.store, nchw30.vec_o, nchw30.residual_staged) == ("regsnchw", 2, False)
    # the persistent kernel stages any V at its tile's start (kStageResidualNchwWs), but not with the cluster
    # k-split, whose C tile takes rank 1's partial sums
    ws7 = dataclasses.replace(nchw, math="wgmma_ws", bm=64, wm=1, csplit=1)
    assert ws7.persistent and ws7.residual_staged
    assert not dataclasses.replace(ws7, bn=64, csplit=2).residual_staged
    assert not dataclasses.replace(ws7, epilogue=ws7.epilogue[:1]).residual_staged
    # the per-tile 128-row NCHW tile with P·Q odd and a residual is capped at 128 registers where shared memory
    # holds two CTAs (min_blocks_for): its chain without the residual, or with 4 stages, is not
    from igemm.conv._spec import min_blocks_for
    t7 = dataclasses.replace(nchw, math="wgmma", bm=128, wm=2, bn=128, stages=3, load_a="tma", csplit=1, ctas=1)
    assert (t7.store, t7.vec_o, t7.residual, min_blocks_for(t7)) == ("regsnchw", 1, True, 2)
    assert min_blocks_for(dataclasses.replace(t7, epilogue=t7.epilogue[:1])) == 1
    assert min_blocks_for(dataclasses.replace(t7, stages=4)) == 1
    from igemm.conv._paths import kernel_setup     # 3x3 512->512 @7, N=128: the transpose path's choice
    pb7 = _pb(N=128, layout="NCHW", H=7, W=7, C=512, K=512, epilogue=one, residual_dtype="float16")
    big = choose_config(kernel_setup(pb7, "auto", None, None, "sm_90a")[1], "sm_90a")
    assert (big.bm, big.stages, big.store, big.vec_o, big.min_blocks) == (128, 3, "regsnchw", 1, 2), big.name()
    # the staged tile must fit one stage (csrc: static_assert): 256x128 and 128x256 tiles are refused, and
    # are not autotuning candidates (they failed to compile there)
    pb = _pb(H=28, W=28, C=128, K=128, epilogue=one, residual_dtype="float16")
    for layout in ("NHWC", "NCHW"):
        pbl = dataclasses.replace(pb, layout=layout)
        big = [s for s in candidates(pbl) if s.residual_staged and s.load_b == "tma" and s.bm * s.bn >= 256 * 128]
        assert big == [], [s.name() for s in big]
    tall = dataclasses.replace(choose_config(pb), bm=256, wm=4, bn=128, stages=3)
    assert tall.residual_staged
    with pytest.raises(NotImplementedError, match="residual tile"):
        validate_spec(tall, pb)


def test_tma_choice_and_limits(monkeypatch):
    """The TMA loader: sm_90 16-bit NHWC with C % 64 == 0 inside the 4-D im2col box limits; the NCHW
    transpose path's kernel problem qualifies; IGEMM_TMA=0 and misaligned pointers fall back."""
    from igemm.conv._spec import validate_spec
    from igemm.conv._paths import kernel_setup
    from igemm.conv._tma import tma_unsupported
    assert tma_unsupported(_pb(), 64) is None
    assert "C % 64" in tma_unsupported(_pb(C=96), 64) and "C % 64" in tma_unsupported(_pb(C=16), 64)
    assert "1x1 stride-1" in tma_unsupported(_pb(layout="NCHW"), 64)
    # NCHW 1x1 stride 1, H*W % 64 == 0: MN-major TMA tiles of x in place (no transpose), 64-row tiles only
    n1 = _pb(layout="NCHW", K=256, R=1, S=1, padding=(0, 0))
    assert tma_unsupported(n1, 64) is None and "64-row" in tma_unsupported(n1, 128)
    assert "H*W % 64" in tma_unsupported(_pb(layout="NCHW", H=28, W=28, R=1, S=1, padding=(0, 0)), 64)
    assert "16-bit" in tma_unsupported(_pb(layout="NCHW", R=1, S=1, padding=(0, 0), dtype="float32"), 64)
    path, kn = kernel_setup(n1, arch="sm_90a")
    sn = choose_config(kn)
    assert (path, kn.layout, sn.load_a, sn.load_b, sn.bm, sn.store) == ("native", "NCHW", "tmamn", "tma", 64, "regsnchw")
    assert kernel_setup(n1)[0] == "transpose" and kernel_setup(n1, arch="sm_80")[0] == "transpose"
    assert choose_config(kn, x_aligned=False).load_a == "elem"
    assert "box" in tma_unsupported(_pb(padding=(129, 1)), 64)
    assert "box" in tma_unsupported(_pb(R=9, dilation=(20, 1)), 64)        # upper corner 1 - 160
    assert "stride" in tma_unsupported(_pb(stride=(9, 1), R=9, padding=(4, 1)), 64)
    assert choose_config(_pb(dtype="bfloat16", C=128, R=1, S=1, stride=(2, 2), padding=(0, 0))).load_a == "tma"
    assert choose_config(_pb(dtype="float32", precision="tf32")).load_a != "tma"
    c8pb = _pb(C=8, R=7, S=7, stride=(2, 2), padding=(3, 3))                     # conv1 padded to 8 channels
    assert choose_config(c8pb).load_a == "vec"                                   # 8-tap TMA measured slower
    from igemm.conv._rules import candidates
    assert any(c.load_a == "tma8" and validate_spec(c, c8pb) for c in candidates(c8pb))
    assert "0x4000" in tma_unsupported(_pb(C=8, W=20000), 64)
    assert choose_config(_pb(), x_aligned=False).load_a == "elem"
    s = choose_config(_pb(), w_aligned=False)
    assert (s.load_a, s.load_b) == ("vec", "elem")
    path, kp = kernel_setup(_pb(layout="NCHW"))
    assert path == "transpose" and choose_config(kp).load_a == "tma"
    tma = choose_config(_pb())
    with pytest.raises(NotImplementedError, match="both operands"):
        validate_spec(dataclasses.replace(tma, load_b="vec"), _pb())
    with pytest.raises(NotImplementedError, match="C % 64"):
        validate_spec(dataclasses.replace(tma, dtype="float16"), _pb(C=32))
    over = Conv2dPlan((2, 8, 8, 64), (32, 3, 3, 64), "float16", "NHWC", padding=1, device="numpy", options=igemm.Conv2dOptions(config={"math": "tensorop"})).spec()
    assert (over.math, over.load_a, over.load_b) == ("tensorop", "vec", "vec")
    assert choose_config(_pb(), "sm_80").load_a == "vec"                # TMA is sm_90's
    # a plan's unaligned fallback drops TMA for both operands
    plan = Conv2dPlan((2, 8, 8, 64), (32, 3, 3, 64), "float16", "NHWC", padding=1, device="numpy", options=igemm.Conv2dOptions(config=tma))
    assert (plan.spec().load_a, plan.spec(w_aligned=False).load_b, plan.spec(w_aligned=False).load_a) == \
        ("tma", "elem", "vec")


def test_tma_map_template():
    """The per-call address patch: learned from two encodes when one word holds the address; otherwise
    every address is encoded (cached)."""
    from igemm.conv._tma import MapTemplate
    enc_calls = []

    def plain(addr):                       # address in word 2, everything else fixed
        enc_calls.append(addr)
        w = np.arange(16, dtype=np.uint64)
        w[2] = addr
        return w.tobytes()
    t = MapTemplate(plain)
    buf = np.zeros(20, dtype=np.uint64)
    t.write(buf, 3, 0x7f0000001000)
    n0 = len(enc_calls)
    for a in (0x7f0000001000, 0x7f0000abc000, 0x10):
        t.write(buf, 3, a, full=False)
        assert int(buf[5]) == a and buf[3] == 0 and buf[4] == 1 and buf[0] == 0 and buf[19] == 0
    assert len(enc_calls) == n0 and t.word == 2

    def packed(addr):                      # address split over two words: no single-word patch
        w = np.zeros(16, dtype=np.uint64)
        w[0], w[1] = addr & 0xFFFF, addr >> 16
        return w.tobytes()
    t = MapTemplate(packed)
    for a in (0x123450, 0x999990, 0x123450):
        t.write(buf, 0, a)
        assert np.array_equal(buf[:16], np.frombuffer(packed(a), dtype=np.uint64))
    assert t.word == -1


def test_packed_args_tmap_slots():
    from igemm._kernel import ParamSpec, pack_args, render_kernel
    params = [ParamSpec("a", "ptr"), ParamSpec("m", "tmap"), ParamSpec("n", "int32")]
    a = pack_args(params, {"a": 5, "m": bytes(range(128)), "n": 7})
    assert a.slots == {"a": 0, "m": 1, "n": 17} and len(a.data) == 18
    assert list(a.ptrs - a.ptrs[0]) == [0, 8, 136]
    assert a.data[1:17].tobytes() == bytes(range(128)) and a.i32[34] == 7
    b = a.bind({"n": 9})
    assert b.i32[34] == 9 and b.data[1:17].tobytes() == bytes(range(128))
    stub = render_kernel(include="x.cuh", entry="k", params=params, body="", threads=128)
    assert "const __grid_constant__ IgemmTensorMap m" in stub and "&m" in stub


def test_split_k_choice():
    small = _pb(N=2, H=7, W=7, C=512, K=512)                              # 16 tiles, 72 k-tiles
    s = choose_config(small)
    tiles = -(-small.M // s.bm) * -(-small.K // s.bn)
    assert s.splits > 1 and tiles * s.splits >= 132
    assert choose_config(_pb()).splits == 1                              # 3x3 64->64 @56 fills the GPU
    assert choose_config(_pb(H=7, W=7, C=8, K=512)).splits == 1           # too few k-tiles to split
    deep = choose_config(_pb(H=7, W=7, C=512, K=512))                        # ResNet-50 3x3 512 @7, N=32
    assert (deep.bn, deep.splits) == (128, 1)                                # measured: 31 vs 37 us (bn 64)


def test_candidates_are_valid():
    from igemm.conv._rules import candidates
    from igemm.conv._spec import validate_spec
    for pb in (_pb(), _pb(H=7, W=7, C=512, K=512, epilogue=(("ReLU", True),)), _pb(layout="NCHW", K=256),
               _pb(dtype="float32", precision="tf32")):
        cands = candidates(pb)
        assert len(cands) > 3 and len(set(cands)) == len(cands)
        for c in cands:
            assert validate_spec(c, pb)
        assert cands[0] == choose_config(pb)
    for arch in ("sm_80",):
        for c in candidates(_pb(), arch):
            assert c.math == "tensorop"


def test_config_override_and_rejection():
    plan = Conv2dPlan((2, 8, 8, 16), (32, 3, 3, 16), "float16", "NHWC", padding=1, device="numpy", options=igemm.Conv2dOptions(config={"bn": 128, "splits": 2}))
    s = plan.spec()
    assert (s.bn, s.splits, s.store) == (128, 2, "linear")
    with pytest.raises(NotImplementedError, match="wgmma"):
        Conv2dPlan((2, 8, 8, 16), (32, 3, 3, 16), "float32", "NHWC", padding=1, device="numpy",
                   precision="tf32", options=igemm.Conv2dOptions(config={"math": "wgmma", "bk": 16})).spec()
    with pytest.raises(ValueError, match="unknown"):
        Conv2dPlan((2, 8, 8, 16), (32, 3, 3, 16), "float16", "NHWC", device="numpy", options=igemm.Conv2dOptions(config={"tile": 3})).spec()


def test_nchw_path_choice():
    """16-bit NCHW with C % 8 == 0 runs the transpose path: an NHWC-gather kernel that stores NCHW."""
    from igemm.conv._paths import kernel_problem, nchw_path
    assert nchw_path(_pb(layout="NCHW")) == "transpose"
    assert nchw_path(_pb(layout="NCHW", C=3)) == "native"                     # conv1 (unless padded)
    assert nchw_path(_pb(layout="NCHW", C=3), pad=True) == "transpose"
    assert nchw_path(_pb(layout="NCHW", C=12)) == "native"                    # no 16-byte gather either way
    assert nchw_path(_pb(layout="NCHW", dtype="float32", precision="strict")) == "native"
    # strict fp32 on Hopper's 3xTF32 wgmma kernel: transposed where 9+ taps run at stride 1 or a 1x1 is strided
    # (tf32x3-wgmma-nchw)
    f32 = dict(layout="NCHW", dtype="float32", precision="strict")
    assert nchw_path(_pb(**f32), arch="sm_90a") == "transpose"
    assert nchw_path(_pb(**f32), arch="sm_80") == "native"
    assert nchw_path(_pb(**f32, stride=(2, 2)), arch="sm_90a") == "native"
    assert nchw_path(_pb(**f32, R=1, S=1, padding=(0, 0)), arch="sm_90a") == "native"
    assert nchw_path(_pb(**f32, R=1, S=1, padding=(0, 0), stride=(2, 2)), arch="sm_90a") == "transpose"
    assert nchw_path(_pb(**f32, C=3), arch="sm_90a") == "native"                # (no 16-byte gather)
    assert nchw_path(_pb(layout="NCHW", dtype="float32", precision="tf32"), arch="sm_90a") == "native"
    assert nchw_path(_pb(layout="NCHW"), "native") == "native"
    assert nchw_path(_pb(), "transpose") == "native"                          # NHWC has nothing to transpose
    with pytest.raises(ValueError, match="nchw_path"):
        nchw_path(_pb(layout="NCHW"), "fast")
    # 1x1 strided without padding: the copy holds x[:, :, ::s, ::s], the kernel runs a 1x1 stride-1 conv on it
    b = _pb(layout="NCHW", C=512, K=1024, H=28, W=28, R=1, S=1, stride=(2, 2), padding=(0, 0))
    kb = kernel_problem(b, "transpose")
    assert (kb.H, kb.W, kb.stride, kb.P, kb.Q, kb.M, kb.layout, kb.y_layout) == (14, 14, (1, 1), 14, 14, b.M, "NHWC", "NCHW")
    for keep in (dataclasses.replace(b, padding=(1, 1)), dataclasses.replace(b, R=3, S=3), dataclasses.replace(b, stride=(1, 1))):
        assert kernel_problem(keep, "transpose").H == 28
    from igemm.conv import _transpose as T
    assert T.TransposeJob(2, 3, 5000, 2).mode(0, 0) == T.WIDEVEC             # conv1's x: 4 x 1024 tiles
    assert T.TransposeJob(2, 3, 5000, 2).mode(2, 0) == T.WIDE                # (misaligned: element accesses)
    assert T.TransposeJob(2, 3, 5001, 2).mode(0, 0) == T.WIDE
    assert T.TransposeJob(2, 3, 5000, 2).mode(0, 0, first=False) == T.COLSVEC        # (all 3 rows a tile)
    assert T.TransposeJob(2, 3, 5000, 2, pitch=8).mode(0, 0) == T.SCALAR64
    assert T.TransposeJob(2, 64, 196, 2, sub=(14, 28, 2, 2, 784)).mode(16, 16) == T.SUBVEC   # 1x1/2 @28
    assert T.TransposeJob(2, 64, 196, 2, sub=(14, 28, 2, 2, 784)).mode(4, 16) == T.SUB      # x 4-byte aligned
    assert T.TransposeJob(2, 64, 49, 2, sub=(7, 14, 2, 2, 196)).mode(16, 16) == T.SUB       # odd Q
    assert T.TransposeJob(2, 64, 196, 4, sub=(14, 28, 2, 2, 784)).mode(16, 16) == T.SUB     # fp32
    assert T.TransposeJob(2, 60, 196, 2, sub=(14, 28, 2, 2, 784)).mode(16, 16) == T.SUB     # rows % 8
    # a filter's taps (KCRS -> KRSC, cols = R*S <= 16): 256-row tiles with 16-byte accesses, rows % 8 == 0
    assert T.TransposeJob(512, 512, 9, 2).mode(0, 0, first=False) == T.ROWSVEC
    assert T.TransposeJob(512, 512, 9, 2).geometry(T.ROWSVEC) == (2, 1, 1024)
    assert T.TransposeJob(4, 130, 9, 2).mode(0, 0, first=False) == T.SCALAR16          # rows % 8 != 0
    assert T.TransposeJob(4, 128, 9, 2, pitch=136).mode(0, 0, first=False) == T.SCALAR16
    assert T.TransposeJob(4, 128, 9, 4).mode(0, 0, first=False) == T.SCALAR16          # fp32
    assert T.TransposeJob(4, 128, 9, 2).mode(0, 8, first=False) == T.SCALAR16          # misaligned
    # an image of 196 or 49 pixels (cols % 8 != 0, rows % 8 == 0): run_rows(cols) rows a tile, 16-byte accesses;
    # its mirror (the twin's dx back to NCHW, a KRSC filter back to KCRS): all rows x run_rows(rows) cols
    assert T.TransposeJob(32, 1024, 196, 2).mode(0, 0) == T.ROWSVEC and T.run_rows(196) == 40
    assert T.TransposeJob(32, 1024, 196, 2).geometry(T.ROWSVEC) == (26, 1, 832)
    assert T.TransposeJob(32, 196, 1024, 2).mode(0, 0, first=False) == T.COLSVEC
    assert T.TransposeJob(32, 49, 512, 2).geometry(T.COLSVEC) == (1, 3, 96) and T.run_rows(49) == 176
    assert T.TransposeJob(512, 9, 512, 2).mode(0, 0) == T.COLSVEC
    assert T.TransposeJob(32, 1024, 522, 2).mode(0, 0) == T.SCALAR64                 # runs under 16 rows
    assert T.TransposeJob(32, 196, 1024, 2).mode(0, 8) == T.SCALAR64                 # misaligned
    assert T.TransposeJob(32, 196, 1024, 2, pitch=200).mode(0, 0) == T.SCALAR64      # padded
    assert T.TransposeJob(32, 196, 1024, 4).mode(0, 0) == T.SCALAR64                 # fp32
    # the scatter (a strided 1x1 twin's dx back, zeros between): 64 channels x 64 pixels, 16-byte stores where
    # H*W % 8 == 0 and dx is aligned; 16-bit, C % 8 == 0 and an aligned source only
    sc = T.TransposeJob(32, 196, 512, 2, pitch=784, scatter=(14, 28, 2, 2))
    assert sc.mode(0, 0) == T.SCATTERVEC and sc.mode(0, 8) == T.SCATTER and sc.geometry(T.SCATTERVEC) == (8, 13, 3328)
    assert T.TransposeJob(2, 20, 64, 2, pitch=143, scatter=(5, 11, 3, 3)).mode(0, 0) == T.SCATTER
    with pytest.raises(ValueError, match="aligned"):
        sc.mode(8, 0)
    for bad in ((4, 512), (2, 60)):
        with pytest.raises(ValueError, match="scatter"):
            T.TransposeJob(32, 196, bad[1], bad[0], pitch=784, scatter=(14, 28, 2, 2))
    with pytest.raises(ValueError, match="sub"):
        T.TransposeJob(2, 64, 900, 2, sub=(30, 28, 1, 1, 784))               # more columns than pixels
    with pytest.raises(ValueError, match="job 0"):
        T.Prepared(0, T.TransposeJob(1, 8, 8, 2), 0, T.TransposeJob(2, 64, 196, 2, sub=(14, 28, 2, 2, 784)), 0)
    kp = kernel_problem(_pb(layout="NCHW", epilogue=(("ReLU", True),)), "transpose")
    s = choose_config(kp)
    assert (kp.layout, kp.y_layout, s.layout, s.load_a, s.store, s.fuse_mask) == (
        "NHWC", "NCHW", "NHWC", "tma", "regsnchw", True)
    plan = Conv2dPlan((2, 64, 14, 14), (32, 64, 3, 3), "float16", "NCHW", padding=1, device="numpy")
    assert plan.path == "transpose" and plan.spec(x_aligned=False).load_a == "tma"   # reads its own copy
    assert plan.y_shape == (2, 32, 14, 14) and "transpose" in repr(plan)
    one = Conv2dPlan((2, 64, 14, 14), (32, 64, 1, 1), "float16", "NCHW", device="numpy")
    assert one.spec(w_aligned=False).load_b == "elem"                          # 1x1: w is read in place
    nat = Conv2dPlan((2, 64, 14, 14), (32, 64, 3, 3), "float16", "NCHW", padding=1, device="numpy", options=igemm.Conv2dOptions(nchw_path="native"))
    assert (nat.path, nat.spec().layout, nat.spec().load_a) == ("native", "NCHW", "elem")
    x = np.random.default_rng(0).standard_normal((1, 8, 5, 5)).astype(np.float16)
    w = np.random.default_rng(1).standard_normal((4, 8, 3, 3)).astype(np.float16)
    yt = Conv2dPlan(x.shape, w.shape, "float16", "NCHW", padding=1, device="numpy")(x, w)   # numpy backend
    assert rel_err(yt, reference.conv2d_direct(x, w, 1, 1, 1)) < 1e-2


def test_channel_pad_choice():
    """pad_channels=True: 16-bit problems with C < 8 run on copies padded to 8 channels (16-byte gathers)."""
    from igemm.conv._paths import kernel_channels, kernel_setup
    assert kernel_setup(_pb(C=3, R=7, S=7), unfold=False)[1].C == 3          # opt-in (measured slower)
    assert kernel_setup(_pb(C=3, R=7, S=7), pad=True)[1].C == 8
    path, kp = kernel_setup(_pb(layout="NCHW", C=5), pad=True)
    assert (path, kp.layout, kp.y_layout, kp.C) == ("transpose", "NHWC", "NCHW", 8)
    with pytest.raises(ValueError, match="pad_channels"):
        kernel_setup(_pb(layout="NCHW", C=5), "native", True)                 # native NCHW cannot pad
    assert kernel_channels(_pb(C=3, dtype="float32", precision="tf32"), "native") == 3
    with pytest.raises(ValueError, match="pad_channels"):
        kernel_channels(_pb(C=3, dtype="float32", precision="tf32"), "native", True)
    with pytest.raises(ValueError, match="pad_channels"):
        kernel_channels(_pb(C=12), "native", True)
    plan = Conv2dPlan((2, 17, 17, 3), (32, 7, 7, 3), "float16", "NHWC", 2, 3, device="numpy", options=igemm.Conv2dOptions(pad_channels=True))
    s = plan.spec(x_aligned=False, w_aligned=False)
    assert (plan.kproblem.C, s.load_a, s.load_b) == (8, "vec", "vec") and "padded to 8" in repr(plan)   # own copies
    assert plan.y_shape == (2, 9, 9, 32)
    x = np.random.default_rng(0).standard_normal((1, 6, 6, 3)).astype(np.float16)
    w = np.random.default_rng(1).standard_normal((4, 3, 3, 3)).astype(np.float16)
    y = Conv2dPlan(x.shape, w.shape, "float16", "NHWC", padding=1, device="numpy", options=igemm.Conv2dOptions(pad_channels=True))(x, w)  # numpy
    assert rel_err(y, reference.conv2d_direct(x, w, 1, 1, 1, "NHWC")) < 1e-2


def _patch_a_tiles(x: np.ndarray, pb, bm: int) -> np.ndarray:
    """csrc/conv/patch.cuh in numpy, from its own index math: every tile's patch (boxes of x viewed as
    [N][H][W*C], zero outside) in a NaN-poisoned region of the plan's size, then the A k-tiles built from it
    (an 8-lane chunk: the kept lanes read at the chunk's element offset). Returns A, M x KT*64."""
    from igemm.conv._problem import PATCH_ALIGN as AL, PATCH_BOX as BOX, PATCH_STEP as STEP, patch_slots
    N, H, W, C = x.shape
    R, S, sw, pw, sh, ph = pb.R, pb.S, pb.stride[1], pb.padding[1], pb.stride[0], pb.padding[0]
    P, Q, M, cu, sc = pb.P, pb.Q, pb.M, pb.Kred // pb.R, pb.S * pb.C
    KT = -(-pb.Kred // 64)
    xf = x.reshape(N, H, W * C)
    elems = lambda count: ((count - 1) * sw + S) * C
    boxes = lambda e: (e - 1) // STEP + 1
    slots = patch_slots(pb, bm)
    A = np.full((M, KT * 64), np.nan)
    for m0 in range(0, M, bm):
        g0, q0 = divmod(m0, Q)
        gL, qL = divmod(min(m0 + bm, M) - 1, Q)
        a0, af = (q0 * sw - pw) * C % AL, (-pw * C) % AL                # box starts on 16-byte boundaries
        nb0, nbf = boxes(elems((qL + 1 if gL == g0 else Q) - q0) + a0), boxes(elems(Q) + af)
        slot = lambda l: 0 if l == 0 else nb0 + (l - 1) * nbf
        patch = np.full(slots * R * BOX + 8, np.nan)          # + 16 bytes (patch_bytes)
        for g in range(g0, gL + 1):
            qa, qb = (q0 if g == g0 else 0), (qL if g == gL else Q - 1)
            n, p_ = divmod(g, P)
            a = a0 if g == g0 else af
            h, c0 = p_ * sh - ph, (qa * sw - pw) * C - a
            assert c0 % AL == 0
            for k in range(boxes(elems(qb - qa + 1) + a)):
                base = (slot(g - g0) + k) * R * BOX
                assert base + R * BOX <= slots * R * BOX, "patch slots overflow"
                hh = h + np.arange(R)[:, None]
                cc = c0 + k * STEP + np.arange(BOX)[None, :]
                ok = (hh >= 0) & (hh < H) & (cc >= 0) & (cc < W * C)
                patch[base:base + R * BOX] = np.where(ok, xf[n, np.clip(hh, 0, H - 1), np.clip(cc, 0, W * C - 1)], 0).ravel()
        for m in range(m0, min(m0 + bm, M)):
            g, q = divmod(m, Q)
            l = g - g0
            jb, rb = (q - (q0 if l == 0 else 0)) * sw * C + (a0 if l == 0 else af), slot(l) * R * BOX
            for kk0 in range(0, KT * 64, 8):
                r, lane0 = divmod(kk0, cu)
                keep = max(0, min(8, sc - lane0)) if r < R else 0
                A[m, kk0:kk0 + 8] = 0
                if keep:
                    e = jb + lane0
                    bx = e // STEP
                    idx = rb + bx * R * BOX + r * BOX + (e - bx * STEP)
                    assert idx + 9 <= patch.size                  # the fifth 4-byte load stays inside
                    A[m, kk0:kk0 + keep] = patch[idx:idx + keep]
    return A


def test_patch_residual_preload_rules():
    """The patch kernel preloads a 16-bit residual into registers (KernelSpec.residual_preloaded: the NHWC
    register epilogue, BN <= 128) with a register cap for 3 CTAs an SM where shared memory holds 3, and packs
    its patch offsets in 16 bits: a bigger patch falls back to 64-row tiles, and a hand-made spec is refused."""
    from igemm.conv._problem import PATCH_MAX_BYTES
    from igemm.conv._paths import kernel_setup
    from igemm.conv._rules import patch_config
    add = (("BatchNorm",), ("Add",), ("ReLU", True))

    def spec(layout="NHWC", ep=add, rdt=None, N=32, H=224, W=224, R=7, **kw):
        pb = _pb(N=N, C=3, H=H, W=W, K=64, R=R, S=R, stride=(2, 2), padding=(R // 2, R // 2), layout=layout,
                 epilogue=ep, residual_dtype=rdt)
        path, kp = kernel_setup(pb, arch="sm_90a")
        assert path == "patch"
        return patch_config(kp, **kw), kp

    c, _ = spec()
    assert (c.bm, c.bn, c.store, c.residual_preloaded, c.min_blocks) == (128, 64, "regs", True, 3)
    assert 3 * (c.smem + c.static_smem + 1024) <= 228 * 1024
    b, _ = spec(ep=(("BatchNorm",), ("ReLU", True)))
    assert (b.residual_preloaded, b.min_blocks) == (False, 1)
    assert not spec(layout="NCHW")[0].residual_preloaded               # the NCHW register epilogue stages it
    assert not spec(rdt="float32")[0].residual_preloaded               # an fp32 residual: 2 registers a pair
    # 11x11/2 over 4-pixel output lines: a 128-row tile's patch holds 33 lines (91 KB), a 64-row tile's 17
    big, kp = spec(N=64, H=400, W=8, R=11)
    assert big.residual_preloaded and big.bm == 64 and big.patch_bytes - 16 <= PATCH_MAX_BYTES
    tall = patch_config(kp, bm=128)
    assert tall.patch_bytes - 16 > PATCH_MAX_BYTES
    with pytest.raises(NotImplementedError, match="16 bits"):
        validate_spec(tall, kp)
    relu = dataclasses.replace(kp, epilogue=_chain_of((("ReLU", False),)).functors("float16"), mask=False)  # no residual
    assert patch_config(relu).bm == 128 and validate_spec(patch_config(relu), relu)


def test_patch_loader_index_math(rng):
    """The patch kernel's tiles, lines, box slots and chunk offsets (emulated in numpy, NaN-poisoned patch)
    build exactly the im2col matrix of the width-unfolded problem, for random few-channel problems and both
    tile heights; the slot count the plan reserves is never exceeded; the path choice."""
    from test_conv_prep import _unfold_numpy
    from igemm.conv._paths import kernel_setup, patch_unsupported
    from igemm.conv._rules import patch_config
    from igemm.conv._spec import validate_spec
    from igemm.conv._unfold import UnfoldJob, unfolded_problem
    conv1 = _pb(N=32, C=3, H=224, W=224, K=64, R=7, S=7, stride=(2, 2), padding=(3, 3))
    path, kp = kernel_setup(conv1, arch="sm_90a")
    assert (path, kp.patch, kp.Kred, kp.C, kp.W) == ("patch", True, 168, 3, 224)
    spec = choose_config(kp)
    assert (spec.load_a, spec.load_b, spec.bm, spec.stages, spec.splits, spec.store) == ("patch", "vec", 128, 3, 1, "regs")
    assert spec.smem + spec.static_smem <= 75 * 1024                   # three CTAs an SM
    assert kernel_setup(conv1)[0] == "unfold" and kernel_setup(conv1, arch="sm_80a")[0] == "unfold"
    assert kernel_setup(conv1, unfold="copy", arch="sm_90a")[0] == "unfold"
    # NCHW: the patch kernel on an NHWC copy of x, storing NCHW; rows of x not in 16-byte multiples: the copy path
    path, kn = kernel_setup(_pb(C=3, R=7, S=7, layout="NCHW"), arch="sm_90a")
    assert (path, kn.layout, kn.out_layout, kn.patch) == ("patch", "NHWC", "NCHW", True)
    assert choose_config(kn).store == "regsnchw"
    assert kernel_setup(_pb(C=3, W=10, R=7, S=7, layout="NCHW"), arch="sm_90a")[0] == "unfold"
    assert patch_unsupported(_pb(C=3, R=3, S=3, dilation=(1, 2)), "sm_90a")
    with pytest.raises(NotImplementedError, match="patch"):
        kernel_setup(_pb(C=3, W=10, R=7, S=7, layout="NCHW"), unfold="patch", arch="sm_90a")
    with pytest.raises(NotImplementedError, match="patch kernel"):
        validate_spec(patch_config(kp, splits=2), kp)
    for deep in (_pb(N=64, C=7, H=64, W=64, K=256, R=7, S=7, padding=(3, 3)),      # 7 k-tiles, 128 columns
                 _pb(N=64, C=3, H=64, W=8, K=64, R=7, S=7, padding=(3, 3))):        # 8 pixels a line
        path, dp = kernel_setup(deep, arch="sm_90a")
        assert path == "patch" and validate_spec(choose_config(dp), dp)          # a default that fits
    tested = 0
    for i in range(10):
        C, R, S = int(rng.integers(1, 8)), int(rng.integers(1, 8)), int(rng.integers(2, 8))
        sw, pw = int(rng.integers(1, 4)), int(rng.integers(0, S))
        W = 8 * int(rng.integers(1, 6))                                  # W*C*2 % 16 == 0
        H, N = int(rng.integers(1, 12)), int(rng.integers(1, 3))
        pb = _pb(N=N, C=C, H=H, W=W, K=8, R=R, S=S, stride=(int(rng.integers(1, 3)), sw),
                 padding=(int(rng.integers(0, R)), pw))
        if pb.P < 1 or pb.Q < 1 or C * 2 >= 16:
            continue
        path, kp = kernel_setup(pb, unfold=True, arch="sm_90a")
        assert path == "patch", patch_unsupported(pb, "sm_90a")
        x = rng.standard_normal((N, H, W, C))
        up = unfolded_problem(pb, 2)
        xu = _unfold_numpy(x, UnfoldJob.for_x(pb, 2)).reshape(up.N, up.H, up.W, up.C)
        # the unfolded problem's im2col: row m = (n, p, q), column r*C' + lane
        n_, p_, q_ = np.unravel_index(np.arange(pb.M), (N, pb.P, pb.Q))
        want = np.zeros((pb.M, -(-kp.Kred // 64) * 64))
        for r in range(R):
            h = p_ * pb.stride[0] - pb.padding[0] + r
            ok = (h >= 0) & (h < H)
            want[:, r * up.C:(r + 1) * up.C] = np.where(ok[:, None], xu[n_, np.clip(h, 0, H - 1), q_], 0)
        for bm in (64, 128):
            got = _patch_a_tiles(x, kp, bm)
            np.testing.assert_array_equal(got, want, err_msg=f"{pb} bm={bm}")
        tested += 1
    assert tested >= 5


def test_plan_limits():
    with pytest.raises(NotImplementedError, match="2\\*\\*31"):
        Conv2dPlan((1 << 12, 1, 1 << 10, 1 << 10), (1, 1, 1, 1), "float16", device="numpy")


# ------------------------------------------------------------------------------------ compilation (CI)
COMPILE_CASES = [
    ("fp16 NHWC", _pb()),
    ("bf16 NCHW", _pb(dtype="bfloat16", layout="NCHW", K=128)),
    ("fp32 strict", _pb(dtype="float32", precision="strict", layout="NCHW")),
    ("tf32", _pb(dtype="float32", precision="tf32", K=256)),
    ("bf16 NHWC TMA 128x128 stride 2", _pb(dtype="bfloat16", C=128, K=256, stride=(2, 2))),
    ("fp16 conv1 padded to 8 channels", _pb(C=8, R=7, S=7, stride=(2, 2), padding=(3, 3),
                                                       epilogue=(("ReLU", True),))),
    ("fp16 NCHW transpose path", ConvProblem(**{**_pb(layout="NCHW", epilogue=(("ReLU", True),)).__dict__,
                                                "layout": "NHWC", "out_layout": "NCHW"})),
    # 128-column wgmma tiles with the register epilogue: the identity chain, and BN+Add+ReLU+mask
    ("fp16 NHWC 3x3 128->128 identity", _pb(C=128, K=128, H=28, W=28)),
    # (sm_90a: the persistent kernel with 3 CTAs an SM, MN-major A, the transposed stmatrix)
    ("fp16 NCHW 1x1 MN-major TMA", _pb(layout="NCHW", K=256, R=1, S=1, padding=(0, 0),
                                       epilogue=(("BatchNorm",), ("ReLU", True)))),
    ("fp16 NHWC 1x1 64->256 BN+Add+ReLU", _pb(K=256, R=1, S=1, padding=(0, 0),
                                               epilogue=(("BatchNorm",), ("Add",), ("ReLU", True)),
                                               residual_dtype="float16")),
    # the persistent kernel: one consumer with a deep ring (N=8 3x3 256 @14), the cluster k-split (N=8 @7)
    ("fp16 NHWC persistent one consumer", _pb(N=8, C=256, K=256, H=14, W=14,
                                              epilogue=(("BatchNorm",), ("ReLU", True)))),
    ("fp16 NHWC cluster k-split BN+Add+ReLU", _pb(N=8, C=512, K=512, H=7, W=7,
                                                  epilogue=(("BatchNorm",), ("Add",), ("ReLU", True)),
                                                  residual_dtype="float16")),
    # the per-tile TMA kernel with 128x128 tiles, 4 stages and the residual staged in a freed stage (3x3 256 @14)
    ("fp16 NHWC 3x3 256 @14 BN+Add+ReLU", _pb(C=256, K=256, H=14, W=14,
                                               epilogue=(("BatchNorm",), ("Add",), ("ReLU", True)),
                                               residual_dtype="float16")),
]


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("label, pb", COMPILE_CASES, ids=[c[0] for c in COMPILE_CASES])
def test_kernel_compiles(label, pb, arch, tmp_path, monkeypatch):
    monkeypatch.setenv("IGEMM_CACHE_DIR", str(tmp_path))
    spec = choose_config(pb, arch)
    cubin, _ = _build.compile_cubin(_stub(spec), arch, name=spec.name())
    assert cubin[:4] == b"\x7fELF"
    log = next(tmp_path.glob("*.log")).read_text()
    assert "spill" not in log or " 0 bytes spill stores" in log, log
    # ptxas serialising the wgmma pipeline (C7514) cost a 3x3 512->512 @7 conv 70% on an H100
    assert "C7514" not in log and "serialized" not in log, log


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_persistent_and_tma8_kernels_compile(tmp_path, monkeypatch):
    from igemm.conv._rules import candidates
    from igemm.conv._spec import validate_spec
    monkeypatch.setenv("IGEMM_CACHE_DIR", str(tmp_path))
    pb = _pb(K=256, epilogue=(("BatchNorm",), ("Add",), ("ReLU", True)), residual_dtype="float16")
    ws = [c for c in candidates(pb) if c.persistent]
    assert ws and all(validate_spec(c, pb) and c.threads == 128 * c.wm + 32 and c.splits == 1 for c in ws)
    assert {(c.wm, c.csplit) for c in ws} == {(2, 1), (1, 1), (1, 2)}    # two consumers, one, the cluster k-split
    c8pb = _pb(C=8, R=7, S=7, stride=(2, 2), padding=(3, 3), epilogue=(("ReLU", True),))
    t8 = [c for c in candidates(c8pb) if c.load_a == "tma8"]          # and the 8-tap TMA candidate
    from igemm.conv._paths import kernel_setup                          # and the patch kernel (conv1 + BN+ReLU+mask)
    patch = choose_config(kernel_setup(_pb(C=3, R=7, S=7, stride=(2, 2), padding=(3, 3), K=64,
                                           epilogue=(("BatchNorm",), ("ReLU", True))), arch="sm_90a")[1])
    assert patch.load_a == "patch"
    sk = [c for c in candidates(_pb(C=256, H=7, W=7, K=256, epilogue=(("BatchNorm",), ("ReLU", True))))
          if c.streamk]                                                   # and stream-K
    assert sk and all(c.store == "regs" and c.splits == 1 for c in sk)
    for spec in (ws[0], ws[-1], t8[0], patch, sk[0]):
        cubin, _ = _build.compile_cubin(_stub(spec), "sm_90a", name=spec.name())
        assert cubin[:4] == b"\x7fELF"
    for log in tmp_path.glob("*.log"):
        assert " 0 bytes spill stores" in log.read_text() and "C7514" not in log.read_text()


# ------------------------------------------------------------------------------------ GPU
def _run_case(torch, dtype, layout, xs, ws, st, pd, dl, rng, precision="strict", check_torch=True):
    x64 = rng.standard_normal(xs)
    w64 = rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:]))
    x64, w64 = to_layout(x64, w64, layout)
    x, w = to_torch(x64, dtype), to_torch(w64, dtype)
    ref = reference.conv2d_direct(to_numpy(x), to_numpy(w), st, pd, dl, layout)
    out = poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda"))
    y = igemm.conv2d(x, w, st, pd, dl, layout=layout, out=out, precision=precision)
    assert y is out
    tol = TOL["tf32" if precision == "tf32" else dtype]
    err = rel_err(to_numpy(y), ref)
    problem = f"{dtype}/{precision} {layout} x{xs} w{ws} stride{st} pad{pd} dil{dl}"
    assert err <= tol, f"{problem}: rel err {err:.3g} > {tol}"
    if check_torch:
        import torch.nn.functional as F
        xt = x if layout == "NCHW" else x.permute(0, 3, 1, 2)
        wt = w if layout == "NCHW" else w.permute(0, 3, 1, 2)
        yt = F.conv2d(xt.double(), wt.double(), stride=st, padding=pd, dilation=dl)
        if layout == "NHWC":
            yt = yt.permute(0, 2, 3, 1)
        assert rel_err(to_numpy(y), yt.cpu().numpy()) <= tol, problem
    return err


PRECISIONS = [("float16", "strict"), ("bfloat16", "strict"), ("float32", "strict"), ("float32", "tf32")]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype, precision", PRECISIONS, ids=["fp16", "bf16", "fp32", "tf32"])
def test_gpu_random_problems(dtype, precision, layout, rng):
    """300 random problems per dtype x layout against the float64 reference (and torch on 1 in 5)."""
    torch = pytest.importorskip("torch")
    worst = 0.0
    for i in range(300):
        xs, ws, st, pd, dl = rand_problem(rng)
        worst = max(worst, _run_case(torch, dtype, layout, xs, ws, st, pd, dl, rng, precision, check_torch=i % 5 == 0))
    print(f"{dtype}/{precision} {layout}: worst rel err {worst:.3g}")


EDGE = [
    ((1, 3, 11, 13), (5, 3, 3, 3), 1, 1, 1),            # N=1, C=3, K odd
    ((2, 1, 9, 9), (7, 1, 3, 3), 1, 1, 1),              # C=1
    ((2, 5, 8, 8), (9, 5, 3, 3), 1, 1, 1),              # C=5
    ((2, 64, 14, 14), (96, 64, 1, 1), 1, 0, 1),         # 1x1
    ((2, 3, 37, 41), (16, 3, 7, 7), 2, 3, 1),           # 7x7 stride 2 pad 3 (conv1-like)
    ((2, 16, 17, 17), (8, 16, 3, 3), 1, 2, 2),          # dilation 2
    ((3, 8, 1, 1), (4, 8, 1, 1), 1, 0, 1),              # H, W = 1
    ((3, 8, 2, 3), (4, 8, 3, 3), 1, 1, 1),
    ((3, 8, 7, 5), (4, 8, 3, 3), 2, 1, 1),
    ((2, 8, 5, 5), (4, 8, 3, 3), 1, 3, 1),              # padding larger than R/2
    ((2, 8, 4, 6), (4, 8, 2, 2), 1, 4, 2),
    ((2, 40, 6, 6), (33, 40, 3, 3), 1, 1, 1),           # Kred = 360, not a multiple of BK
    ((1, 24, 5, 5), (300, 24, 3, 3), 1, 1, 1),          # K > 256, not a multiple of 8
    ((4, 16, 128, 96), (8, 16, 1, 1), 1, 0, 1),         # many CTAs along M
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype, precision", PRECISIONS, ids=["fp16", "bf16", "fp32", "tf32"])
def test_gpu_edge_set(dtype, precision, layout, rng):
    torch = pytest.importorskip("torch")
    for xs, ws, st, pd, dl in EDGE:
        _run_case(torch, dtype, layout, xs, ws, (st, st), (pd, pd), (dl, dl), rng, precision)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_large_npq(layout, rng):
    """N*P*Q >= 2^21 output pixels (checked against torch in float64 on the GPU)."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    xs, ws = (8, 16, 512, 512), (24, 16, 3, 3)
    x64, w64 = to_layout(rng.standard_normal(xs), rng.standard_normal(ws) / 12, layout)
    x, w = to_torch(x64, "float16"), to_torch(w64, "float16")
    y = igemm.conv2d(x, w, 1, 1, layout=layout)
    xt = x if layout == "NCHW" else x.permute(0, 3, 1, 2)
    wt = w if layout == "NCHW" else w.permute(0, 3, 1, 2)
    ref = F.conv2d(xt.double(), wt.double(), padding=1)
    if layout == "NHWC":
        ref = ref.permute(0, 2, 3, 1)
    assert y.numel() // 24 >= 1 << 21                    # N*P*Q output pixels
    err = (torch.linalg.vector_norm((y.double() - ref)) / torch.linalg.vector_norm(ref)).item()
    assert err < 1e-2


def _check_plan(torch, plan, x, w, layout, st, pd, dl, tol):
    y = plan(x, w)
    ref = reference.conv2d_direct(to_numpy(x), to_numpy(w), st, pd, dl, layout)
    err = rel_err(to_numpy(y), ref)
    assert err <= tol, f"{plan.spec().name()} splits={plan.spec().splits}: {err}"
    return y


from igemm.conv._rules import FFMA_CONFIG as FFMA  # noqa: E402  (the strict-fp32 FFMA kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_strict_fp32_paths(layout, rng):
    """Strict fp32 on its mainloops -- 3xTF32 on wgmma (the default on Hopper), on mma.sync and the FFMA kernel
    (forced) -- within the fp32 tolerance on random problems and deep reductions (Kred 4608), and 3xTF32 measurably
    more accurate than single TF32 on the same inputs (it would not be if the small parts were lost)."""
    torch = pytest.importorskip("torch")
    cases = [rand_problem(rng) for _ in range(40)]
    cases += [((4, 512, 7, 7), (64, 512, 3, 3), (1, 1), (1, 1), (1, 1)),
              ((2, 256, 14, 14), (96, 256, 3, 3), (2, 2), (1, 1), (1, 1))]
    worst = {"tf32x3_wgmma": 0.0, "tf32x3": 0.0, "simt": 0.0}
    mma_sync = {"math": "tf32x3", "bm": 64, "wm": 2, "wn": 2}
    gain = []
    for xs, ws, st, pd, dl in cases:
        x64, w64 = to_layout(rng.standard_normal(xs), rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:])), layout)
        x, w = to_torch(x64, "float32"), to_torch(w64, "float32")
        ref = reference.conv2d_direct(to_numpy(x), to_numpy(w), st, pd, dl, layout)
        for math_, cfg in (("tf32x3_wgmma", None), ("tf32x3", mma_sync), ("simt", FFMA)):
            plan = Conv2dPlan(x.shape, w.shape, "float32", layout, st, pd, dl, precision="strict", options=igemm.Conv2dOptions(config=cfg))
            assert plan.spec().math == math_
            out = poison(torch.empty(plan.y_shape, dtype=x.dtype, device="cuda"))
            err = rel_err(to_numpy(plan(x, w, out=out)), ref)
            assert err <= TOL["float32"], f"{math_} x{xs} w{ws} stride{st} pad{pd} dil{dl}: {err:.3g}"
            worst[math_] = max(worst[math_], err)
            if math_ == "tf32x3_wgmma":
                e3 = err
        e1 = rel_err(to_numpy(igemm.conv2d(x, w, st, pd, dl, layout=layout, precision="tf32")), ref)
        gain.append(e1 / max(e3, 1e-12))
    print(f"strict fp32 {layout}: worst rel err 3xTF32 wgmma {worst['tf32x3_wgmma']:.3g}, mma.sync "
          f"{worst['tf32x3']:.3g}, FFMA {worst['simt']:.3g}; "
          f"TF32/3xTF32 error ratio median {sorted(gain)[len(gain) // 2]:.0f}")
    assert sorted(gain)[len(gain) // 2] > 20


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_strict_fp32_specials(layout, rng):
    """Strict fp32 with inf, -inf and NaN among x and w (a split-K case too): every mainloop gives IEEE's classes
    where the float64 direct convolution does (3xTF32's cross terms never make a NaN of inf x a small part) and
    the finite outputs within tolerance."""
    torch = pytest.importorskip("torch")
    for xs, ws, pd, cfg in [((2, 16, 6, 6), (24, 16, 3, 3), 1, {}), ((1, 512, 4, 4), (40, 512, 1, 1), 0, {"splits": 4})]:
        x64 = rng.standard_normal(xs)
        w64 = rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:]))
        x64[0, 1, 2, 3], x64[-1, 2, 0, 0], x64[0, 3, 1, 1] = np.inf, -np.inf, np.nan
        w64[1, 5, 0, 0] = -np.inf
        ref = np.zeros((xs[0], ws[0], xs[2] + 2 * pd - ws[2] + 1, xs[3] + 2 * pd - ws[3] + 1))
        xp = np.pad(x64, ((0, 0), (0, 0), (pd, pd), (pd, pd)))
        with np.errstate(invalid="ignore"):      # the float64 direct sum, tap by tap (no BLAS: IEEE throughout)
            for r in range(ws[2]):
                for s in range(ws[3]):
                    patch = xp[:, :, r:r + ref.shape[2], s:s + ref.shape[3]]
                    ref += (patch[:, None] * w64[None, :, :, r, s, None, None]).sum(axis=2)
        xl, wl = to_layout(x64, w64, layout)
        x, w = to_torch(xl, "float32"), to_torch(wl, "float32")
        want = ref if layout == "NCHW" else ref.transpose(0, 2, 3, 1)
        for math_, c in (("tf32x3_wgmma", cfg), ("tf32x3", {**cfg, "math": "tf32x3", "bm": 64, "wm": 2, "wn": 2}),
                         ("simt", {**cfg, **FFMA})):
            plan = Conv2dPlan(x.shape, w.shape, "float32", layout, 1, pd, options=igemm.Conv2dOptions(config=c))
            assert plan.spec().math == math_
            got = to_numpy(plan(x, w, out=poison(torch.empty(plan.y_shape, dtype=x.dtype, device="cuda"))))
            for cls in (np.isnan, np.isposinf, np.isneginf):
                np.testing.assert_array_equal(cls(got), cls(want), err_msg=f"{math_} {xs} {cls.__name__}")
            fin = np.isfinite(want)
            assert fin.sum() > want.size // 4 and rel_err(got[fin], want[fin]) <= TOL["float32"], math_


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_mma_sync_path(dtype, layout, rng):
    """The sm_80 mma.sync mainloop (the default on A100/L40; forced here on Hopper) on random problems."""
    torch = pytest.importorskip("torch")
    for _ in range(60):
        xs, ws, st, pd, dl = rand_problem(rng)
        x64, w64 = to_layout(rng.standard_normal(xs), rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:])), layout)
        x, w = to_torch(x64, dtype), to_torch(w64, dtype)
        plan = Conv2dPlan(x.shape, w.shape, dtype, layout, st, pd, dl, options=igemm.Conv2dOptions(config={"math": "tensorop"}))
        assert plan.spec().math == "tensorop"
        _check_plan(torch, plan, x, w, layout, st, pd, dl, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype, precision", PRECISIONS, ids=["fp16", "bf16", "fp32", "tf32"])
def test_gpu_split_k(dtype, precision, layout, rng):
    """Split-K: forced splits on odd shapes, deterministic (bitwise equal reruns), tickets reset."""
    torch = pytest.importorskip("torch")
    for xs, ws, st, pd, dl, splits in [((2, 40, 7, 7), (72, 40, 3, 3), 1, 1, 1, 3),
                                       ((1, 96, 5, 6), (130, 96, 3, 3), 1, 1, 1, 5),
                                       ((3, 24, 9, 9), (17, 24, 5, 5), 2, 2, 1, 2)]:
        x64, w64 = to_layout(rng.standard_normal(xs), rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:])), layout)
        x, w = to_torch(x64, dtype), to_torch(w64, dtype)
        plan = Conv2dPlan(x.shape, w.shape, dtype, layout, st, pd, dl, precision=precision, options=igemm.Conv2dOptions(config={"splits": splits}))
        assert plan.spec().splits == splits
        y1 = _check_plan(torch, plan, x, w, layout, st, pd, dl, TOL["tf32" if precision == "tf32" else dtype])
        for _ in range(3):
            assert torch.equal(plan(x, w), y1)


TMA_CASES = [   # NCHW-order shapes, stride, padding, dilation, config override
    ((2, 64, 9, 11), (40, 64, 3, 3), 1, 1, 1, None),              # M tail, K = 40 (OOB filter rows)
    ((3, 128, 13, 7), (72, 128, 3, 3), 2, 1, 1, None),            # stride 2, odd map
    ((2, 64, 12, 12), (64, 64, 3, 3), 1, 2, 2, None),             # dilation 2
    ((2, 64, 10, 10), (96, 64, 5, 5), 1, 0, 1, None),             # no padding, 5x5
    ((2, 64, 6, 7), (64, 64, 7, 7), 3, 3, 1, None),               # stride 3, 7x7, pad 3
    ((2, 192, 8, 8), (130, 192, 1, 1), 1, 0, 1, None),            # 1x1, K = 130
    ((2, 128, 15, 15), (256, 128, 1, 1), 2, 0, 1, None),          # 1x1 stride 2 (downsample)
    ((4, 64, 14, 14), (128, 64, 3, 3), 1, 1, 1, {"bm": 128, "wm": 2}),   # two warpgroups, BM = 128
    ((2, 64, 9, 9), (256, 64, 3, 3), 1, 1, 1, {"bn": 256}),
    ((1, 256, 7, 7), (128, 256, 3, 3), 1, 1, 1, {"splits": 3}),   # split-K over the TMA k-tiles
    ((2, 64, 16, 16), (64, 64, 3, 3), 1, 1, 1, {"stages": 5}),
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_tma_loader(dtype, layout, rng):
    """The TMA loader (im2col-mode A, tiled B; NCHW runs it on its transpose path) against the float64
    reference and bitwise against the cp.async gather (same k-tiles, same wgmma order), plain and with
    BN+Add+ReLU(mask); three different x/w buffers per plan exercise the per-call address patch."""
    torch = pytest.importorskip("torch")
    from igemm import epilogues as ep
    for xs, ws, st, pd, dl, cfg in TMA_CASES:
        K = ws[0]
        g_, b_, m_, v_ = (torch.rand(K, device="cuda", dtype=torch.float32) + 0.5 for _ in range(4))
        chain = ep.chain(ep.BatchNorm(g_, b_, m_, v_), ep.Add(), ep.ReLU(mask=True))
        plans = {}
        for kind, extra in (("tma", {}), ("vec", {"load_a": "vec", "load_b": "vec"})):
            c = {**(cfg or {}), **extra}
            # (NCHW: the transpose path by name -- 1x1 stride-1 cases would otherwise read x in place, "tmamn")
            nchw = "transpose" if layout == "NCHW" else "auto"
            plans[kind] = (Conv2dPlan(to_layout_shape(xs, layout), to_layout_shape(ws, layout), dtype, layout,
                                      st, pd, dl, options=igemm.Conv2dOptions(config=c or None, nchw_path=nchw)),
                           Conv2dPlan(to_layout_shape(xs, layout), to_layout_shape(ws, layout), dtype, layout,
                                      st, pd, dl, epilogue=chain, options=igemm.Conv2dOptions(config=c or None, nchw_path=nchw)))
        assert plans["tma"][0].spec().load_a == "tma" and plans["tma"][1].spec().load_a == "tma"
        assert plans["vec"][0].spec().load_a == "vec"
        for _ in range(3):                          # fresh buffers: new addresses in the tensor maps
            x64, w64 = to_layout(rng.standard_normal(xs), rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:])), layout)
            x, w = to_torch(x64, dtype), to_torch(w64, dtype)
            ref = reference.conv2d_direct(to_numpy(x), to_numpy(w), (st, st), (pd, pd), (dl, dl), layout)
            res = to_torch(rng.standard_normal(ref.shape), dtype)
            ch = 1 if layout == "NCHW" else 3
            shape = [1, 1, 1, 1]
            shape[ch] = K
            scale = to_numpy(g_) / np.sqrt(to_numpy(v_) + 1e-5)
            pre = (ref - to_numpy(m_).reshape(shape)) * scale.reshape(shape) + to_numpy(b_).reshape(shape) \
                + to_numpy(res)
            outs = {}
            for kind, (plain, fused) in plans.items():
                y = plain(x, w, out=poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda")))
                err = rel_err(to_numpy(y), ref)
                name = f"{kind} {layout} {xs} {ws} s{st} p{pd} d{dl} {cfg}: {plain.spec().name()}"
                assert err <= TOL[dtype], f"{name}: {err}"
                yf, mf = fused(x, w, residual=res, out=poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda")),
                               mask_out=torch.full(((ref.size + 31) // 32,), -1, dtype=torch.int32, device="cuda"))
                err = rel_err(to_numpy(yf), np.maximum(pre, 0))
                assert err <= TOL[dtype], f"{name} fused: {err}"
                assert torch.equal(mf, igemm.relu_mask(yf)), f"{name}: mask differs from y > 0"
                outs[kind] = (y, yf, mf)
            for a, b in zip(outs["tma"], outs["vec"]):
                assert torch.equal(a, b), f"TMA and gather differ: {layout} {xs} {ws} {cfg}"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sms", [None, 5], ids=["all-SMs", "5-CTAs"])
@pytest.mark.parametrize("wm", [2, 1], ids=["two-consumers", "one-consumer"])
def test_gpu_persistent_kernel(dtype, layout, sms, wm, rng, monkeypatch):
    """The persistent warp-specialised kernel (a producer warp, two consumer warpgroups taking turns, or
    one consumer with a deep ring) against the float64 reference and bitwise against the per-tile TMA
    kernel, plain and with BN+Add+ReLU(mask). With 5 CTAs every CTA loops over many tiles: the stage
    rings wrap many times and the two consumers get unequal tile counts; the one consumer's producer
    runs on into its next tile's k-tiles during each epilogue. The 16-bit residual is staged in shared
    memory at each tile's start (NHWC, and NCHW whatever its vector: V = 1 for 9x11 and 7x7 outputs)."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace
    from igemm import epilogues as ep
    from igemm import _runtime
    if sms is not None:     # the plan sizes the persistent grid from the SM count
        monkeypatch.setattr(_runtime, "device_props", lambda d: SimpleNamespace(multiprocessor_count=sms))
    cases = [((2, 64, 9, 11), (40, 64, 3, 3), 1, 1, 1, {"bn": 64, "stages": 3}),
             ((3, 128, 13, 7), (72, 128, 3, 3), 2, 1, 1, {"bn": 128, "stages": 3}),
             ((4, 64, 14, 14), (256, 64, 3, 3), 1, 1, 1, {"bn": 64, "stages": 4}),      # 4 column tiles
             ((2, 192, 8, 8), (130, 192, 1, 1), 1, 0, 1, {"bn": 128, "stages": 3}),
             ((2, 64, 12, 12), (64, 64, 3, 3), 1, 2, 2, {"bn": 64, "stages": 4}),
             ((2, 256, 7, 7), (136, 256, 3, 3), 1, 1, 1, {"bn": 64, "stages": 4})]
    for xs, ws, st, pd, dl, cfg in cases:
        if wm == 1:                 # the default's deep rings
            cfg = {**cfg, "stages": 8 if cfg["bn"] == 64 else 6}
        K = ws[0]
        g_, b_, m_, v_ = (torch.rand(K, device="cuda", dtype=torch.float32) + 0.5 for _ in range(4))
        chain = ep.chain(ep.BatchNorm(g_, b_, m_, v_), ep.Add(), ep.ReLU(mask=True))
        xsl, wsl = to_layout_shape(xs, layout), to_layout_shape(ws, layout)
        pers = {"math": "wgmma_ws", "bm": 64, "wm": wm, "splits": 1, **cfg}
        nchw = "transpose" if layout == "NCHW" else "auto"      # (the persistent kernel reads NHWC TMA tiles)
        plans = {kind: [Conv2dPlan(xsl, wsl, dtype, layout, st, pd, dl, epilogue=e, options=igemm.Conv2dOptions(config=c, nchw_path=nchw))
                        for e in (None, chain)]
                 for kind, c in (("ws", pers), ("tile", {"math": "wgmma", "bm": 64, "wm": 1, "bn": cfg["bn"],
                                                         "splits": 1}))}
        assert all(p.spec().persistent and p.spec().wm == wm for p in plans["ws"])
        assert plans["tile"][0].spec().load_a == "tma" and not plans["tile"][0].spec().persistent
        for _ in range(2):
            x64, w64 = to_layout(rng.standard_normal(xs), rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:])), layout)
            x, w = to_torch(x64, dtype), to_torch(w64, dtype)
            ref = reference.conv2d_direct(to_numpy(x), to_numpy(w), (st, st), (pd, pd), (dl, dl), layout)
            res = to_torch(rng.standard_normal(ref.shape), dtype)
            outs = {}
            for kind, (plain, fused) in plans.items():
                y = plain(x, w, out=poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda")))
                name = f"{kind} {layout} {xs} {ws} {cfg} sms={sms}: {plain.spec().name()}"
                assert rel_err(to_numpy(y), ref) <= TOL[dtype], name
                yf, mf = fused(x, w, residual=res, out=poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda")),
                               mask_out=torch.full(((ref.size + 31) // 32,), -1, dtype=torch.int32, device="cuda"))
                assert torch.equal(mf, igemm.relu_mask(yf)), f"{name}: mask differs from y > 0"
                outs[kind] = (y, yf, mf)
            for a, b in zip(outs["ws"], outs["tile"]):
                assert torch.equal(a, b), f"persistent and per-tile kernels differ: {layout} {xs} {ws} {cfg} sms={sms}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sms", [None, 3], ids=["all-SMs", "3-CTAs"])
def test_gpu_persistent_nchw_residual_staged(dtype, sms, rng, monkeypatch):
    """The persistent kernel stages a 16-bit NCHW residual into its C tile at each tile's start whatever the
    store vector (kStageResidualNchwWs): V = 1 (P·Q odd: 2-byte loads), V = 2 (P·Q % 4 == 2: 4-byte cp.async)
    and V = 4. conv+BN+Add+ReLU(mask) against the float64 reference, bitwise against the per-tile kernel (which
    loads the residual after its mainloop), mask equal to y > 0, outputs poisoned; K tails, several images a
    tile. With 3 CTAs every CTA stages for many tiles, its C tile refilled after each epilogue."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace
    from igemm import epilogues as ep
    from igemm import _runtime
    if sms is not None:
        monkeypatch.setattr(_runtime, "device_props", lambda d: SimpleNamespace(multiprocessor_count=sms))
    for xs, ws, v in (((3, 64, 7, 7), (96, 64, 3, 3), 1), ((3, 64, 6, 5), (72, 64, 3, 3), 2),
                      ((2, 64, 10, 10), (136, 64, 3, 3), 4)):
        K = ws[0]
        g_, b_, m_, v_ = (torch.rand(K, device="cuda", dtype=torch.float32) + 0.5 for _ in range(4))
        chain = ep.chain(ep.BatchNorm(g_, b_, m_, v_), ep.Add(), ep.ReLU(mask=True))
        cfg = {"bm": 64, "wm": 1, "bn": 64, "stages": 4, "splits": 1}
        plans = {kind: Conv2dPlan(xs, ws, dtype, "NCHW", 1, 1, 1, epilogue=chain, options=igemm.Conv2dOptions(config={**cfg, "math": m}, nchw_path="transpose"))
                 for kind, m in (("ws", "wgmma_ws"), ("tile", "wgmma"))}
        sp = plans["ws"].spec()
        assert (sp.persistent, sp.store, sp.vec_o, sp.residual_staged) == (True, "regsnchw", v, True), sp.name()
        assert not plans["tile"].spec().persistent
        x64, w64 = rng.standard_normal(xs), rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:]))
        x, w = to_torch(x64, dtype), to_torch(w64, dtype)
        ref = reference.conv2d_direct(to_numpy(x), to_numpy(w), (1, 1), (1, 1), (1, 1), "NCHW")
        res = to_torch(rng.standard_normal(ref.shape), dtype)
        sc = to_numpy(g_) / np.sqrt(to_numpy(v_) + 1e-5)
        pre = (ref - to_numpy(m_).reshape(1, K, 1, 1)) * sc.reshape(1, K, 1, 1) + to_numpy(b_).reshape(1, K, 1, 1) \
            + to_numpy(res)
        outs = {}
        for kind, plan in plans.items():
            name = f"{kind} {xs} {ws} V={v} sms={sms}: {plan.spec().name()}"
            y, m = plan(x, w, residual=res, out=poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda")),
                        mask_out=torch.full(((ref.size + 31) // 32,), -1, dtype=torch.int32, device="cuda"))
            err = rel_err(to_numpy(y), np.maximum(pre, 0))
            assert err <= TOL[dtype], f"{name}: {err}"
            assert torch.equal(m, igemm.relu_mask(y)), f"{name}: mask differs from y > 0"
            outs[kind] = (y, m)
        for a, b in zip(outs["ws"], outs["tile"]):
            assert torch.equal(a, b), f"persistent and per-tile kernels differ: {xs} {ws} V={v} sms={sms}"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sms", [None, 4], ids=["all-SMs", "2-clusters"])
def test_gpu_cluster_ksplit(dtype, layout, sms, rng, monkeypatch):
    """The cluster k-split (two CTAs a tile, each over half the k-tiles; rank 1's fp32 partial sums handed
    to rank 0 in distributed shared memory) against the float64 reference, plain and with BN+Add+ReLU(mask),
    outputs poisoned, reruns bitwise equal (the hand-over adds in a fixed order). Odd k-tile counts (rank 0
    runs one more), a K tail, 128 columns, stride and dilation. With 2 clusters every pair loops over many
    tiles: the hand-over's two barriers turn over many times."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace
    from igemm import epilogues as ep
    from igemm import _runtime
    if sms is not None:     # the plan sizes the persistent grid from the SM count
        monkeypatch.setattr(_runtime, "device_props", lambda d: SimpleNamespace(multiprocessor_count=sms))
    cases = [((2, 512, 7, 7), (136, 512, 3, 3), 1, 1, 1, {"bn": 64, "stages": 6}),      # 72 k-tiles, K tail
             ((3, 192, 9, 10), (64, 192, 3, 3), 1, 1, 1, {"bn": 64, "stages": 4}),      # 27 k-tiles
             ((2, 128, 8, 8), (200, 128, 3, 3), 2, 1, 1, {"bn": 128, "stages": 6}),    # stride 2, 128 columns
             ((1, 64, 12, 12), (64, 64, 3, 3), 1, 2, 2, {"bn": 64, "stages": 8})]      # dilation 2, 9 k-tiles
    cax = 1 if layout == "NCHW" else -1
    for xs, ws, st, pd, dl, cfg in cases:
        K = ws[0]
        g_, b_, m_, v_ = (torch.rand(K, device="cuda", dtype=torch.float32) + 0.5 for _ in range(4))
        chain = ep.chain(ep.BatchNorm(g_, b_, m_, v_), ep.Add(), ep.ReLU(mask=True))
        c = {"math": "wgmma_ws", "bm": 64, "wm": 1, "splits": 1, "csplit": 2, **cfg}
        nchw = "transpose" if layout == "NCHW" else "auto"
        xsl, wsl = to_layout_shape(xs, layout), to_layout_shape(ws, layout)
        plain, fused = (Conv2dPlan(xsl, wsl, dtype, layout, st, pd, dl, epilogue=e, options=igemm.Conv2dOptions(config=c, nchw_path=nchw))
                        for e in (None, chain))
        assert plain.spec().csplit == 2 and fused.spec().csplit == 2, plain.spec().name()
        sc = to_numpy(g_) / np.sqrt(to_numpy(v_) + 1e-5)
        shape = [1, 1, 1, 1]
        shape[cax] = K
        sc, sh = sc.reshape(shape), (to_numpy(b_) - to_numpy(m_) * sc).reshape(shape)
        x64, w64 = to_layout(rng.standard_normal(xs), rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:])), layout)
        x, w = to_torch(x64, dtype), to_torch(w64, dtype)
        ref = reference.conv2d_direct(to_numpy(x), to_numpy(w), (st, st), (pd, pd), (dl, dl), layout)
        res = to_torch(rng.standard_normal(ref.shape), dtype)
        ref_f = np.maximum(ref * sc + sh + to_numpy(res), 0)
        name = f"{layout} {xs} {ws} {cfg} sms={sms}: {plain.spec().name()}"
        y = plain(x, w, out=poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda")))
        assert rel_err(to_numpy(y), ref) <= TOL[dtype], name
        yf, mf = fused(x, w, residual=res, out=poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda")),
                       mask_out=torch.full(((ref.size + 31) // 32,), -1, dtype=torch.int32, device="cuda"))
        assert rel_err(to_numpy(yf), ref_f) <= TOL[dtype], f"fused {name}"
        assert torch.equal(mf, igemm.relu_mask(yf)), f"{name}: mask differs from y > 0"
        for _ in range(2):
            assert torch.equal(plain(x, w), y), f"{name}: rerun differs"
            assert torch.equal(fused(x, w, residual=res)[0], yf), f"fused {name}: rerun differs"


def test_persistent_several_ctas_an_sm():
    """The 1x1 layers of up to four k-tiles without a residual and with several waves (at least 5 tiles an SM)
    take the persistent kernel with one consumer, 2 stages and 3 CTAs an SM (launch bounds and grid to match)
    with a chain, and without one at one or two k-tiles below 12 tiles an SM; with two k-tiles and a 16-bit
    residual (NHWC), 2 CTAs and 3 stages; a residual on one k-tile, fewer tiles or a deeper reduction (8 k-tiles)
    keep the per-tile kernel; 3x3 64->64 @56 with a chain (NHWC, N >= 32): 64x64 tiles, 3 CTAs, 4 stages. Several
    CTAs fit the SM's shared memory, and the spec refuses more than fit, or several CTAs on another kernel."""
    from igemm.conv._spec import SMEM_PER_SM, max_ctas
    from igemm.conv._rules import candidates
    from igemm.conv._paths import kernel_setup
    bnrm = (("BatchNorm",), ("ReLU", True))
    for layout in LAYOUTS:
        pb = _pb(N=32, H=56, W=56, C=64, K=256, R=1, S=1, padding=(0, 0), layout=layout, epilogue=bnrm)
        sp = choose_config(pb)
        assert (sp.math, sp.wm, sp.bm, sp.bn, sp.stages, sp.ctas, sp.min_blocks) == \
            ("wgmma_ws", 1, 64, 128, 2, 3, 3), sp.name()
        assert sp.load_a == ("tmamn" if layout == "NCHW" else "tma") and sp.name().endswith("_x3")
        assert validate_spec(sp, pb) and 3 * (sp.smem + sp.static_smem + 1024) <= SMEM_PER_SM
        assert "__launch_bounds__(160, 3)" in _stub(sp) and "#define IGEMM_WS_CTAS 3" in _stub(sp)
        assert not validate_spec(dataclasses.replace(sp, ctas=4), pb, raise_=False)          # does not fit
        two = dataclasses.replace(sp, wm=2, ctas=1, min_blocks=1)      # two consumers: NHWC only (MN-major A: one)
        assert validate_spec(two, pb, raise_=False) == (layout == "NHWC"), two.name()
        base = dict(N=32, H=56, W=56, C=64, K=256, R=1, S=1, padding=(0, 0), layout=layout, epilogue=bnrm)
        for kw in (dict(N=8), dict(N=8, epilogue=()), dict(N=16, epilogue=()),      # 784 and 1568 tiles
                   dict(C=128, K=512, H=28, W=28), dict(C=128, K=512, H=28, W=28, epilogue=())):   # 2 k-tiles
            same = choose_config(kernel_setup(_pb(**{**base, **kw}), arch="sm_90a")[1])   # (NCHW @28: transposed)
            assert (same.math, same.ctas, same.min_blocks, same.stages) == ("wgmma_ws", 3, 3, 2), (kw, same.name())
        # up to four k-tiles with a chain (1x1 256->1024 @14); the conv alone there keeps the per-tile kernel
        four = choose_config(kernel_setup(_pb(**{**base, "C": 256, "K": 1024, "H": 14, "W": 14}), arch="sm_90a")[1])
        assert (four.math, four.ctas) == ("wgmma_ws", 3), four.name()
        four_a = choose_config(kernel_setup(_pb(**{**base, "C": 256, "K": 1024, "H": 14, "W": 14, "epilogue": ()}),
                                            arch="sm_90a")[1])
        assert (four_a.math, four_a.ctas) == ("wgmma", 1), four_a.name()
        # two k-tiles with a 16-bit residual, NHWC: 2 CTAs an SM, 3 stages (the fp32 C tile holds the residual)
        two = choose_config(kernel_setup(_pb(**{**base, "C": 128, "K": 512, "H": 28, "W": 28,
                                                "epilogue": (("BatchNorm",), ("Add",), ("ReLU", True)),
                                                "residual_dtype": "bfloat16"}), arch="sm_90a")[1])
        if layout == "NHWC":
            assert (two.math, two.ctas, two.min_blocks, two.stages, two.residual_staged) == \
                ("wgmma_ws", 2, 2, 3, True), two.name()
            assert 2 * (two.smem + two.static_smem + 1024) <= SMEM_PER_SM
        else:
            assert two.math == "wgmma" and two.ctas == 1, two.name()
        for kw in (dict(epilogue=(("BatchNorm",), ("Add",), ("ReLU", True)), residual_dtype="float16"),
                   dict(N=4), dict(N=4, epilogue=()), dict(C=512)):
            other = choose_config(_pb(**{**base, **kw}))
            assert other.ctas == 1 and other.math == "wgmma", (kw, other.name())
        # the conv alone at 3136 tiles of one k-tile: 2 CTAs, 3 stages (persistent-1x1-alone-2ctas; 3 CTAs measured
        # faster on an H200, slower on an H100), not where the kernel writes BatchNorm statistics
        alone = choose_config(_pb(**{**base, "epilogue": ()}))
        assert (alone.math, alone.ctas, alone.stages) == ("wgmma_ws", 2, 3), alone.name()
        assert choose_config(_pb(**{**base, "epilogue": ()}), bn_stats=True).math == "wgmma"
        alts = [c for c in candidates(pb) if c.ctas > 1]
        assert alts and all(validate_spec(c, pb) and c.ctas == max_ctas(c) for c in alts)
        # 64-column tiles of 3-4 k-tiles (1x1 256->64 @56) from 5 tiles an SM: 3 CTAs, 3 stages, any chain and
        # residual (fp32 too), the conv alone below 12 tiles an SM; not at N=8 (392 tiles), not at one k-tile
        # (1x1 64->64)
        for N in (16, 32, 64):
            for ep, rdt in ((() if N < 64 else bnrm, None), (bnrm, None),
                            ((("BatchNorm",), ("Add",), ("ReLU", True)), "float16"),
                            ((("BatchNorm",), ("Add",), ("ReLU", True)), "float32")):
                kp = kernel_setup(_pb(**{**base, "N": N, "C": 256, "K": 64, "epilogue": ep, "residual_dtype": rdt}),
                                  arch="sm_90a")[1]
                narrow = choose_config(kp)
                assert (narrow.math, narrow.bn, narrow.ctas, narrow.min_blocks, narrow.stages) == \
                    ("wgmma_ws", 64, 3, 3, 3), (N, ep, rdt, narrow.name())
                assert validate_spec(narrow, kp) and 3 * (narrow.smem + narrow.static_smem + 1024) <= SMEM_PER_SM
        for kw in (dict(N=8, C=256, K=64), dict(C=64, K=64), dict(N=64, C=256, K=64, epilogue=())):
            other = choose_config(kernel_setup(_pb(**{**base, **kw}), arch="sm_90a")[1])
            assert other.ctas == 1 and other.math == "wgmma", (kw, other.name())
    # a 3x3 conv into 64 channels with a chain, NHWC, from 10 tiles of 64x64 an SM (3x3 64->64 @56 at N >= 32):
    # 64x64 tiles, 3 CTAs an SM, 4 stages; not at N=16, not the conv alone, a residual or an NCHW output
    three = dict(N=32, H=56, W=56, C=64, K=64, R=3, S=3, padding=(1, 1), layout="NHWC", epilogue=bnrm)
    for N in (32, 64):
        kp = kernel_setup(_pb(**{**three, "N": N}), arch="sm_90a")[1]
        sp = choose_config(kp)
        assert (sp.math, sp.bm, sp.bn, sp.wm, sp.stages, sp.ctas, sp.min_blocks) == \
            ("wgmma_ws", 64, 64, 1, 4, 3, 3), sp.name()
        assert validate_spec(sp, kp) and 3 * (sp.smem + sp.static_smem + 1024) <= SMEM_PER_SM
    for kw in (dict(N=16), dict(epilogue=()), dict(epilogue=(("BatchNorm",), ("Add",), ("ReLU", True)),
                                                   residual_dtype="float16"), dict(layout="NCHW")):
        other = choose_config(kernel_setup(_pb(**{**three, **kw}), arch="sm_90a")[1])
        assert other.ctas == 1 and other.math == "wgmma" and other.bm == 128, (kw, other.name())
    one = _pb(N=32, H=56, W=56, C=64, K=256, R=1, S=1, padding=(0, 0))
    assert not validate_spec(dataclasses.replace(choose_config(one, bn_stats=True), ctas=2), one, raise_=False)
    plan = Conv2dPlan((32, 56, 56, 64), (256, 1, 1, 64), "float16", "NHWC", 1, 0, device="numpy", options=igemm.Conv2dOptions(config={"math": "wgmma_ws", "bm": 64, "wm": 1, "bn": 128, "stages": 2, "ctas": 3, "splits": 1}))
    assert plan.spec().ctas == 3
    gather = plan.spec(x_aligned=False)         # (misaligned x: the per-tile kernel gathers, one CTA each)
    assert (gather.math, gather.ctas, gather.min_blocks) == ("wgmma", 1, 1)


#: test_gpu_persistent_several_ctas's problems (x NCHW, w KCRS, stride, padding, dilation; tools/precompile_tests.py
#: compiles their kernels) and the two plans each chain runs on
SEVERAL_CTAS_CASES = [((2, 64, 16, 16), (256, 64, 1, 1), 1, 0, 1),       # one k-tile, 2 column blocks
                      ((3, 64, 16, 16), (600, 64, 1, 1), 1, 0, 1),       # 5 column blocks, a K tail
                      ((2, 128, 8, 16), (192, 128, 1, 1), 1, 0, 1),      # 2 k-tiles
                      ((2, 64, 15, 13), (136, 64, 1, 1), 2, 0, 1),       # stride 2, M and K tails
                      ((1, 64, 9, 11), (130, 64, 3, 3), 1, 1, 1),        # 9 k-tiles, NHWC's fp32 C tile
                      ((2, 256, 12, 12), (72, 256, 1, 1), 1, 0, 1, 64),  # 64-column tiles, 4 k-tiles, a K tail
                      ((1, 192, 10, 9), (64, 192, 1, 1), 1, 0, 1, 64),  # 64-column tiles, 3 k-tiles, an M tail
                      ((2, 64, 12, 10), (64, 64, 3, 3), 1, 1, 1, 64, 4)]  # 3x3 into 64 channels, 4 stages


def several_ctas_plans(*args, bn: int = 128, stages: int = 0, **kw) -> dict:
    """{"ws": ``Conv2dPlan(*args, **kw)`` on the persistent kernel with 3 CTAs an SM (2 where its C tile is
    the larger one: a staged residual, or the fp32 tile's store), "tile": on the per-tile kernel of the same
    64 x ``bn`` tile} (64 columns: 3 stages, as choose_config's 1x1 256->64 rule; 128: 2; or ``stages``)"""
    ws = {"math": "wgmma_ws", "bm": 64, "wm": 1, "bn": bn, "stages": stages or (2 if bn == 128 else 3), "splits": 1}
    try:
        plan = Conv2dPlan(*args, **kw, options=igemm.Conv2dOptions(config={**ws, "ctas": 3}))
        plan.spec()
    except NotImplementedError:
        plan = Conv2dPlan(*args, **kw, options=igemm.Conv2dOptions(config={**ws, "ctas": 2}))
    return {"ws": plan, "tile": Conv2dPlan(*args, **kw, options=igemm.Conv2dOptions(config={**ws, "math": "wgmma"}))}


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sms", [None, 2], ids=["all-SMs", "2-SMs"])
def test_gpu_persistent_several_ctas(dtype, layout, sms, rng, monkeypatch):
    """The persistent kernel with one consumer and several CTAs an SM (ctas; its C tile at the register
    epilogue's size where no residual is staged) against the float64 reference and bitwise against the
    per-tile TMA kernel of the same tile, plain, with BN+ReLU(mask) and with BN+Add+ReLU(mask), outputs
    poisoned. On 2 SMs (6 or 4 CTAs) every CTA runs many tiles: with 5 column blocks (K = 600, a tail) a
    CTA's column block changes from tile to tile, so its producer reloads B and its consumer the channel
    vectors; with 2 it stays, and both are skipped after the first. NCHW: the 1x1 stride-1 cases read x in
    place (MN-major A), the others run on the NHWC copy. The 64-column cases add an fp32 residual."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace
    from igemm import epilogues as ep
    from igemm import _runtime
    if sms is not None:     # the plan sizes the persistent grid from the SM count
        monkeypatch.setattr(_runtime, "device_props", lambda d: SimpleNamespace(multiprocessor_count=sms))
    for xs, ws, st, pd, dl, *rest in SEVERAL_CTAS_CASES:
        K, bn, stages = ws[0], (rest or [128])[0], (rest[1:] or [0])[0]
        g_, b_, m_, v_ = (torch.rand(K, device="cuda", dtype=torch.float32) + 0.5 for _ in range(4))
        chains = {"plain": None, "bn_relu_mask": ep.chain(ep.BatchNorm(g_, b_, m_, v_), ep.ReLU(mask=True)),
                  "bn_add_relu_mask": ep.chain(ep.BatchNorm(g_, b_, m_, v_), ep.Add(), ep.ReLU(mask=True))}
        if bn == 64:
            chains["bn_add32_relu_mask"] = chains["bn_add_relu_mask"]
        xsl, wsl = to_layout_shape(xs, layout), to_layout_shape(ws, layout)
        x64, w64 = to_layout(rng.standard_normal(xs), rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:])), layout)
        x, w = to_torch(x64, dtype), to_torch(w64, dtype)
        ref = reference.conv2d_direct(to_numpy(x), to_numpy(w), (st, st), (pd, pd), (dl, dl), layout)
        res = to_torch(rng.standard_normal(ref.shape), dtype)
        res32 = to_torch(rng.standard_normal(ref.shape), "float32")
        shape = [1, 1, 1, 1]
        shape[1 if layout == "NCHW" else -1] = K
        sc = to_numpy(g_) / np.sqrt(to_numpy(v_) + 1e-5)
        sc, sh = sc.reshape(shape), (to_numpy(b_) - to_numpy(m_) * sc).reshape(shape)
        for cn, chain in chains.items():
            outs = {}
            for kind, plan in several_ctas_plans(xsl, wsl, dtype, layout, st, pd, dl, epilogue=chain, bn=bn,
                                                 stages=stages,
                                                 residual_dtype="float32" if "add32" in cn else None).items():
                sp = plan.spec()
                assert sp.persistent == (kind == "ws") and (sp.ctas > 1) == (kind == "ws"), sp.name()
                name = f"{kind} {cn} {layout} {xs} {ws} sms={sms}: {sp.name()}"
                out = poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda"))
                if chain is None:
                    y = plan(x, w, out=out)
                    assert rel_err(to_numpy(y), ref) <= TOL[dtype], name
                    outs[kind] = (y,)
                    continue
                args = {"residual": res32 if "add32" in cn else res} if "add" in cn else {}
                y, m = plan(x, w, out=out, **args,
                            mask_out=torch.full(((ref.size + 31) // 32,), -1, dtype=torch.int32, device="cuda"))
                assert torch.equal(m, igemm.relu_mask(y)), f"{name}: mask differs from y > 0"
                want = np.maximum(ref * sc + sh + (to_numpy(args["residual"]) if args else 0), 0)
                assert rel_err(to_numpy(y), want) <= TOL[dtype], name
                outs[kind] = (y, m)
            for a, b in zip(outs["ws"], outs["tile"]):
                assert torch.equal(a, b), f"persistent ({cn}) and per-tile kernels differ: {layout} {xs} {ws} sms={sms}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sms", [None, 3], ids=["all-SMs", "3-SMs"])
def test_gpu_streamk(dtype, sms, rng, monkeypatch):
    """Stream-K (CTAs sharing tiles x k-tiles equally; a split tile's partial sums handed to the CTA that
    stores it) against the float64 reference, plain and with BN+Add+ReLU(mask), twice per plan (the
    flags must be clear again after a launch). All SMs: tiny shares, a tile split over many CTAs; 3 SMs:
    every CTA runs many tiles and pieces of others."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace
    from igemm import epilogues as ep
    from igemm import _runtime
    if sms is not None:
        monkeypatch.setattr(_runtime, "device_props", lambda d: SimpleNamespace(multiprocessor_count=sms))
    cases = [((2, 7, 7, 256), 256, 3, 1, {"bm": 64, "wm": 1, "bn": 128, "streamk": 1}),
             ((3, 9, 5, 128), 72, 3, 1, {"bm": 64, "wm": 1, "bn": 64, "streamk": 2}),      # K tail
             ((1, 14, 14, 64), 136, 3, 2, {"bm": 128, "wm": 2, "bn": 128, "streamk": 1}),  # M and K tails
             ((2, 6, 6, 192), 64, 1, 1, {"bm": 64, "wm": 1, "bn": 64, "streamk": 2})]      # 3 k-tiles
    for xs, K, R, st, cfg in cases:
        C = xs[-1]
        V = [torch.rand(K, device="cuda") + 0.5 for _ in range(4)]
        chain = ep.chain(ep.BatchNorm(*V), ep.Add(), ep.ReLU(mask=True))
        for epi in (None, chain):
            plan = Conv2dPlan(xs, (K, R, R, C), dtype, "NHWC", st, R // 2, epilogue=epi, options=igemm.Conv2dOptions(config={**cfg, "stages": 4}))
            spec = plan.spec()
            assert spec.streamk and spec.store == "regs" and spec.splits == 1, spec.name()
            for _ in range(2):
                x = to_torch(rng.standard_normal(xs), dtype)
                w = to_torch(rng.standard_normal((K, R, R, C)) / np.sqrt(R * R * C), dtype)
                ref = reference.conv2d_direct(to_numpy(x), to_numpy(w), st, R // 2, 1, "NHWC")
                label = f"{dtype} x{xs} K={K} R={R} st={st} {cfg} sms={sms} {epi!r}"
                y = poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda"))
                if epi is None:
                    assert rel_err(to_numpy(plan(x, w, out=y)), ref) <= TOL[dtype], label
                    continue
                res = to_torch(rng.standard_normal(ref.shape), dtype)
                sc = to_numpy(V[0]) / np.sqrt(to_numpy(V[3]) + 1e-5)
                want = np.maximum(ref * sc + (to_numpy(V[1]) - to_numpy(V[2]) * sc) + to_numpy(res), 0)
                y, mask = plan(x, w, residual=res, out=y,
                               mask_out=torch.full(((ref.size + 31) // 32,), -1, dtype=torch.int32, device="cuda"))
                assert rel_err(to_numpy(y), want) <= TOL[dtype], label
                assert torch.equal(mask, igemm.relu_mask(y)), label


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_small_batch_default_configs(dtype, rng):
    """The default plans of the small-batch 3x3 layers (the persistent kernel for few tiles and a deep
    reduction, split-K for very few tiles) against the float64 reference, plain and with BN+ReLU+mask."""
    torch = pytest.importorskip("torch")
    from igemm import epilogues as ep
    for n, c, h, want in ((1, 256, 14, "wgmma_ws"), (8, 512, 7, "wgmma_ws"), (1, 512, 7, "wgmma"),
                          (1, 128, 28, "wgmma_ws"), (8, 256, 14, "wgmma_ws"), (8, 128, 28, "wgmma_ws"),
                          (32, 512, 7, "wgmma_ws")):
        xs, ws = (n, h, h, c), (c, 3, 3, c)
        g_, b_, m_, v_ = (torch.rand(c, device="cuda", dtype=torch.float32) + 0.5 for _ in range(4))
        for chain in (None, ep.chain(ep.BatchNorm(g_, b_, m_, v_), ep.ReLU(mask=True))):
            plan = Conv2dPlan(xs, ws, dtype, "NHWC", 1, 1, epilogue=chain)
            assert plan.spec().math == want, plan.spec().name()
            x64 = rng.standard_normal(xs)
            w64 = rng.standard_normal(ws) / np.sqrt(9 * c)
            x, w = to_torch(x64, dtype), to_torch(w64, dtype)
            ref = reference.conv2d_direct(to_numpy(x), to_numpy(w), (1, 1), (1, 1), (1, 1), "NHWC")
            out = poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda"))
            if chain is None:
                assert rel_err(to_numpy(plan(x, w, out=out)), ref) <= TOL[dtype], plan.spec().name()
                continue
            sc = to_numpy(g_) / np.sqrt(to_numpy(v_) + 1e-5)
            ref = np.maximum(ref * sc + (to_numpy(b_) - to_numpy(m_) * sc), 0)
            y, mask = plan(x, w, out=out)
            assert rel_err(to_numpy(y), ref) <= TOL[dtype], plan.spec().name()
            assert torch.equal(mask, igemm.relu_mask(y)), plan.spec().name()


def to_layout_shape(shape, layout):
    return (shape[0], shape[2], shape[3], shape[1]) if layout == "NHWC" else shape


_PERSISTENT = {"math": "wgmma_ws", "bm": 64, "wm": 2, "splits": 1}


def _both_store_phases(torch, x, w, dtype, layout, st, pd, chain, cfg, stores, ref, label):
    """One conv on the register epilogue (``stores[0]``) and on the fp32 C tile's store phase (``stores[1]``,
    asked for by ``config={"store": ...}``) of the same tile: identical bits of y (and mask), y poisoned
    first and fully written, the plain conv within tolerance of ``ref``, the mask equal to y > 0."""
    outs = []
    for store in stores:
        c = dict(cfg or {})
        if store == stores[1]:
            c["store"] = store
        plan = Conv2dPlan(x.shape, w.shape, dtype, layout, st, pd, epilogue=chain, options=igemm.Conv2dOptions(config=c or None))
        spec = plan.spec()
        assert (spec.store == stores[0]) == (store == stores[0]), spec.name()   # (the fp32 tile: rows or linear)
        if "math" in c:                     # (without one the default may be either kernel)
            assert spec.persistent == (c["math"] == "wgmma_ws"), spec.name()
        y = poison(torch.empty(plan.y_shape, dtype=x.dtype, device="cuda"))
        kw = {"out": y}
        if chain is not None and chain.mask:
            kw["mask_out"] = torch.full((plan.mask_words,), -1, dtype=torch.int32, device="cuda")
        r = plan(x, w, **kw)
        outs.append(r if isinstance(r, tuple) else (r,))
    label = f"{label} {chain!r} {cfg}: {spec.name()}"
    for a, b in zip(*outs):
        assert torch.equal(a.view(torch.int16) if a.is_floating_point() else a,
                           b.view(torch.int16) if b.is_floating_point() else b), label
    assert not torch.isnan(outs[0][0]).any(), f"unwritten (poisoned) elements: {label}"
    if chain is None:
        assert rel_err(to_numpy(outs[0][0]), ref) <= TOL[dtype], label
    if len(outs[0]) == 2:
        assert torch.equal(outs[0][1], igemm.relu_mask(outs[0][0])), label


#: test_gpu_register_epilogue_bitwise's cases (x NHWC, K, R = S, stride, config); tools/precompile_tests.py compiles
#: their kernels
REGS_BITWISE_CASES = [
    ((2, 9, 11, 64), 256, 3, 1, None), ((3, 7, 5, 64), 136, 1, 1, None),
    ((2, 13, 13, 32), 64, 3, 2, None), ((1, 30, 30, 64), 128, 3, 1, {"bm": 128, "wm": 2}),
    ((2, 5, 6, 16), 24, 3, 1, None), ((2, 40, 33, 64), 64, 3, 1, {"bm": 128, "wm": 2}),
    # the residual staged in a freed stage (a reduction of at least `stages` k-tiles) with a K tail
    ((2, 9, 11, 64), 136, 3, 1, None),
    # the persistent kernel's consumers (per-tile vectors, their own C tiles, the residual staged there)
    ((2, 9, 11, 64), 256, 3, 1, {**_PERSISTENT, "bn": 128, "stages": 3}),
    ((3, 7, 5, 64), 136, 1, 1, {**_PERSISTENT, "bn": 64, "stages": 2}),
    ((2, 9, 11, 64), 256, 3, 1, {**_PERSISTENT, "wm": 1, "bn": 128, "stages": 6})]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_register_epilogue_bitwise(dtype, rng):
    """The register epilogue (store "regs": chain on the accumulators, 16-bit C tile, mask bytes from the
    store loop's vectors) against the fp32 C tile's store phase of the same tile: identical bits of y and
    mask, over M and K tails, 64/128-row tiles (TMA and gather loads) and the persistent kernel, K % 32 == 0
    or not (the fp32 C tile then leaves the mask to relu_mask, whose last word ends in zero bits), the chains
    with a 16-bit residual (staged in shared memory where the kernel can: a freed stage, the persistent
    kernel's C tile) or an fp32 one among them; y and mask poisoned first."""
    torch = pytest.importorskip("torch")
    from igemm import epilogues as ep
    for xs, K, R, st, cfg in REGS_BITWISE_CASES:
        C = xs[-1]
        x = to_torch(rng.standard_normal(xs), dtype)
        w = to_torch(rng.standard_normal((K, R, R, C)) / np.sqrt(R * R * C), dtype)
        V = [torch.rand(K, device="cuda") + 0.5 for _ in range(4)]
        P = (xs[1] + 2 * (R // 2) - R) // st + 1
        Q = (xs[2] + 2 * (R // 2) - R) // st + 1
        r16 = to_torch(rng.standard_normal((xs[0], P, Q, K)), dtype)
        r32 = to_torch(rng.standard_normal((xs[0], P, Q, K)), "float32")
        ref = reference.conv2d_direct(to_numpy(x), to_numpy(w), st, R // 2, 1, "NHWC")
        for chain in (None, ep.chain(ep.BatchNorm(*V), ep.ReLU(mask=True)), ep.chain(ep.PReLU(V[0] - 1.0)),
                      ep.chain(ep.Bias(V[1]), ep.ReLU()), ep.chain(ep.Bias(V[1]), ep.PReLU(0.25)),
                      ep.chain(ep.BatchNorm(*V), ep.Add(r16), ep.ReLU(mask=True)),
                      ep.chain(ep.Add(r32), ep.BatchNorm(*V), ep.ReLU())):
            _both_store_phases(torch, x, w, dtype, "NHWC", st, R // 2, chain, cfg, ("regs", "rows"), ref,
                               f"{dtype} x{xs} K={K} R={R}")


#: test_gpu_register_epilogue_nchw_bitwise's cases (x NCHW, w KCRS, stride, padding, config); tools/precompile_tests.py
#: compiles their kernels
NCHW_BITWISE_CASES = [
    ((2, 64, 8, 8), (40, 64, 3, 3), 1, 1, None),                        # TMA, K tail, V = 8, fused mask
    ((3, 72, 7, 7), (130, 72, 3, 3), 1, 1, None),                       # gather, V = 1, K tail
    ((2, 64, 14, 14), (64, 64, 3, 3), 1, 1, {"bm": 128, "wm": 2}),      # V = 4, 128-row tiles
    ((2, 32, 6, 5), (48, 32, 3, 3), 1, 1, None),                        # V = 2
    ((3, 64, 9, 11), (136, 64, 3, 3), 1, 1, {**_PERSISTENT, "bn": 128, "stages": 3}),
    ((3, 64, 16, 16), (72, 64, 1, 1), 1, 0, None),                      # MN-major TMA (1x1 in place)
    # the fused mask across tiles and images (word stores and byte stores alike):
    # 128-row tiles, tiles across images with odd word offsets and an M tail (P*Q = 96), the persistent
    # kernel with a K tail
    ((2, 64, 16, 16), (64, 64, 3, 3), 1, 1, {"bm": 128, "wm": 2}),
    ((3, 64, 8, 12), (72, 64, 3, 3), 1, 1, None),
    ((2, 64, 8, 8), (136, 64, 3, 3), 1, 1, {**_PERSISTENT, "bn": 128, "stages": 3}),
    ((3, 64, 9, 11), (136, 64, 3, 3), 1, 1, {**_PERSISTENT, "wm": 1, "bn": 64, "stages": 8}),
    ((2, 3, 37, 48), (70, 3, 7, 7), 2, 3, None),                        # the patch kernel
    # the fused mask's byte stores (P*Q % 8 == 0, % 32 != 0): tiles across images, an M tail, the last word
    # of the tensor part-filled (1 * 35 * 8 elements), 128-row tiles, the persistent kernel
    ((1, 64, 4, 2), (35, 64, 3, 3), 1, 1, None),
    ((2, 64, 12, 12), (72, 64, 3, 3), 1, 1, {"bm": 128, "wm": 2}),
    ((3, 64, 4, 6), (136, 64, 3, 3), 1, 1, {**_PERSISTENT, "bn": 128, "stages": 3}),
    # V = 1 (the mask from the separate kernel): the tensor's last word part-filled (35 * 9 elements), several
    # images a tile (P*Q = 9; P*Q = 1), 128-row tiles, the persistent kernel's residual in one batch of loads
    ((1, 64, 3, 3), (35, 64, 3, 3), 1, 1, None),
    ((9, 64, 5, 5), (96, 64, 3, 3), 1, 0, None),
    ((40, 64, 3, 3), (72, 64, 3, 3), 1, 0, {"bm": 128, "wm": 2}),
    ((5, 64, 7, 7), (136, 64, 3, 3), 1, 1, {**_PERSISTENT, "wm": 1, "bn": 64, "stages": 8})]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_register_epilogue_nchw_bitwise(dtype, rng):
    """The NCHW register epilogue (store "regsnchw": chain on the accumulators, a channel-major 16-bit C
    tile, vectors along each channel's pixels, mask bytes from the 8-pixel vectors) against the fp32 C
    tile's NCHW store phase of the same tile: identical bits of y and mask on every NCHW kernel path (the
    transpose path's TMA and gather kernels, 64/128-row tiles, the persistent kernel; the MN-major 1x1 path;
    the patch kernel), output vectors of 8, 4, 2 and 1 pixels (8: mask fused, a byte beside each vector,
    P*Q % 32 == 0 or not; the tensor's last word part-filled), M and K tails, 16-bit
    residuals of either type (staged in the C tile: zeros past the tails); y and mask poisoned first; plain
    results against the float64 reference."""
    torch = pytest.importorskip("torch")
    from igemm import epilogues as ep
    for xs, ws, st, pd, cfg in NCHW_BITWISE_CASES:
        x = to_torch(rng.standard_normal(xs), dtype)
        w = to_torch(rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:])), dtype)
        K = ws[0]
        V = [torch.rand(K, device="cuda") + 0.5 for _ in range(4)]
        ref = reference.conv2d_direct(to_numpy(x), to_numpy(w), st, pd, 1, "NCHW")
        r16 = to_torch(rng.standard_normal(ref.shape), dtype)
        rother = to_torch(rng.standard_normal(ref.shape), "bfloat16" if dtype == "float16" else "float16")
        for chain in (None, ep.chain(ep.BatchNorm(*V), ep.ReLU(mask=True)), ep.chain(ep.PReLU(V[0] - 1.0)),
                      ep.chain(ep.Bias(V[1]), ep.ReLU()), ep.chain(ep.Bias(V[1]), ep.PReLU(0.25)),
                      ep.chain(ep.BatchNorm(*V), ep.Add(r16), ep.ReLU(mask=True)),
                      ep.chain(ep.Add(rother), ep.Bias(V[1]), ep.PReLU(V[0] - 1.0))):
            _both_store_phases(torch, x, w, dtype, "NCHW", st, pd, chain, cfg, ("regsnchw", "nchw"), ref,
                               f"{dtype} x{xs} w{ws}")


@pytest.mark.gpu
@pytest.mark.parametrize("launch", ["C", "cuda.bindings"])
def test_gpu_torch_fast_path(rng, launch):
    """Both launch steps (csrc/host/launch.c, which the GPU machine must build, and cuda.bindings): see
    _torch_fast_path."""
    from igemm import _hostlaunch
    if launch == "C":
        assert _hostlaunch.get() is not None, _hostlaunch.status()
    with contextlib.nullcontext() if launch == "C" else _hostlaunch.python_only():
        _torch_fast_path(rng)


def _torch_fast_path(rng):
    """The torch fast path (torch tensors, the plan's context current: checks against precomputed values, then
    the one bind step) and the general path give the same bits: every call's new x, w, y, mask pointers reach
    the argument buffer and the TMA maps' address words, and plans that prepare copies first (the NCHW
    transpose, the subsampled copy, the width unfold of w, the NCHW patch path's transpose + unfold) launch
    the preparation the same way; calls in between on another variant (a misaligned x: the gather kernel, the
    copy plan or the preparation's element variant), with per-call vectors (conv2d's folded BN) or from a
    thread with no current context take the general path and leave the buffers right for the next fast call.
    Each result equals the general path's bit for bit (y and mask poisoned first) and the float64 reference."""
    torch = pytest.importorskip("torch")
    import threading
    from igemm import epilogues as ep
    for layout, xs, ws, st, pd, cfg in [
            ("NHWC", (2, 9, 11, 64), (128, 3, 3, 64), 1, 1, None),                # TMA maps
            ("NHWC", (1, 7, 7, 256), (256, 3, 3, 256), 1, 1, {"splits": 4}),     # split-K slots
            ("NHWC", (2, 37, 48, 3), (64, 7, 7, 3), 2, 3, None),                  # patch map + w unfold
            ("NCHW", (2, 64, 8, 8), (96, 64, 3, 3), 1, 1, None),                  # x and w transposed
            ("NCHW", (2, 64, 16, 16), (128, 64, 1, 1), 2, 0, None),               # the subsampled copy
            ("NCHW", (2, 3, 32, 64), (64, 3, 7, 7), 2, 3, None)]:                 # transpose + unfold
        K = ws[0]
        V = [torch.rand(K, device="cuda") + 0.5 for _ in range(4)]
        plan = Conv2dPlan(xs, ws, "float16", layout, st, pd,
                          epilogue=ep.chain(ep.BatchNorm(*V), ep.ReLU(mask=True)), options=igemm.Conv2dOptions(config=cfg))
        assert plan.spec().fuse_mask, plan.spec().name()
        general = []
        general_call = plan._call
        plan._call = lambda *a: (general.append(1), general_call(*a))[1]
        n = int(np.prod(xs))
        xb = to_torch(rng.standard_normal(n + 8), "float16")
        xs_ = [to_torch(rng.standard_normal(xs), "float16") for _ in range(3)] + [xb[1:1 + n].view(xs)]
        wts = [to_torch(rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:])), "float16") for _ in range(2)]
        seq = [(0, 0), (1, 0), (2, 1), (3, 1), (0, 0), (1, 1), (2, 0)]       # (x, w): x 3 is misaligned
        label = f"{layout} {xs} {ws}: {plan.path} {plan.spec().name()}"
        for i, (xi, wi) in enumerate(seq):
            x, w = xs_[xi], wts[wi]
            y = poison(torch.empty(plan.y_shape, dtype=torch.float16, device="cuda"))
            m = torch.full((plan.mask_words,), -1, dtype=torch.int32, device="cuda")
            before = len(general)
            if i == 5:                                   # a thread with no current context: the general path
                th = threading.Thread(target=lambda: plan(x, w, out=y, mask_out=m))
                th.start()
                th.join()
            else:
                plan(x, w, out=y, mask_out=m)
            fast = len(general) == before
            y2, m2 = general_call(x, w, None, None, None, None, None, None)
            assert torch.equal(y.view(torch.int16), y2.view(torch.int16)) and torch.equal(m, m2), (label, i)
            if i in (0, 1, 4, 6):
                assert fast, f"{label}: call {i} took the general path"
            if i == 3:      # a misaligned x: the gather variant, fast; the NHWC patch plan hands it to its copy plan
                assert fast != (layout == "NHWC" and plan.path == "patch"), f"{label}: call {i}"
            if i == 5:
                assert not fast, f"{label}: a thread with no current context should take the general path"
        yp, mp = plan(xs_[2], torch.nn.Parameter(wts[0], requires_grad=False))     # w as a module's weight
        ya, ma = plan(xs_[2], wts[0])                                                 # allocating y and the mask
        assert torch.equal(yp, ya) and torch.equal(mp, ma), label
        ref = reference.conv2d_direct(to_numpy(xs_[2]), to_numpy(wts[0]), st, pd, 1, layout)
        cs = (1, K, 1, 1) if layout == "NCHW" else (1, 1, 1, K)
        sc = (to_numpy(V[0]) / np.sqrt(to_numpy(V[3]) + 1e-5)).reshape(cs)
        want = np.maximum((ref - to_numpy(V[2]).reshape(cs)) * sc + to_numpy(V[1]).reshape(cs), 0)
        assert rel_err(to_numpy(y), want) <= TOL["float16"], label
        # conv2d's per-call folded vectors: the plan's own are used again afterwards
        yf = igemm.conv2d(xs_[0], wts[0], st, pd, layout=layout,
                          epilogue=ep.chain(ep.BatchNorm(*(v * 2 for v in V)), ep.ReLU(mask=True)))[0]
        y0, _ = plan(xs_[0], wts[0])
        y1, _ = general_call(xs_[0], wts[0], None, None, None, None, None, None)
        assert torch.equal(y0, y1) and not torch.equal(yf, y0), label


@pytest.mark.gpu
def test_gpu_plan_in_cuda_graph(rng):
    """A plan call (split-K included) captured in a CUDA graph and replayed on new inputs."""
    torch = pytest.importorskip("torch")
    from igemm import epilogues as ep
    x = torch.randn(4, 7, 7, 256, device="cuda", dtype=torch.float16)
    w = torch.randn(256, 3, 3, 256, device="cuda", dtype=torch.float16) / 48
    g_, b_, m_, v_ = (torch.rand(256, device="cuda") + 0.5 for _ in range(4))
    plan = Conv2dPlan(x.shape, w.shape, "float16", "NHWC", padding=1,
                      epilogue=ep.chain(ep.BatchNorm(g_, b_, m_, v_), ep.ReLU(mask=True)), options=igemm.Conv2dOptions(config={"splits": 4}))
    y = torch.empty(4, 7, 7, 256, device="cuda", dtype=torch.float16)
    mask = torch.empty((y.numel() + 31) // 32, device="cuda", dtype=torch.int32)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        plan(x, w, out=y, mask_out=mask)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan(x, w, out=y, mask_out=mask)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = plan(x, w)[0]
        assert torch.equal(y, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("hw,C", [(14, 256), (7, 512)])
def test_gpu_unfused_mask_after_the_conv(hw, C, rng):
    """Where the NCHW epilogue cannot own whole mask bytes (P*Q % 8 != 0), relu_mask packs y > 0 after the
    conv, launched on sm_90+ as its programmatic dependent (PDL: it may start during the conv's last wave
    and waits in the kernel). Its mask must be the one of the conv's finished y: y and mask poisoned before
    every call, back-to-back calls on a side stream with new inputs, a CUDA graph replay; each mask equal
    to relu_mask(y) run on its own, and y to the float64 reference."""
    torch = pytest.importorskip("torch")
    from igemm import epilogues as ep
    from igemm import relu as relu_mod
    N, K = 8, C                                               # (tools/precompile_tests.py's shapes)
    ws = (K, C, 3, 3)
    w = to_torch(rng.standard_normal(ws) / np.sqrt(C * 9), "float16")
    V = [torch.rand(K, device="cuda") + 0.5 for _ in range(4)]
    V[1] = V[1] - 1.0                                         # (a shift that makes some outputs negative)
    plan = Conv2dPlan((N, C, hw, hw), ws, "float16", "NCHW", 1, 1,
                      epilogue=ep.chain(ep.BatchNorm(*V), ep.ReLU(mask=True)))
    assert not plan.spec().fuse_mask, plan.spec().name()
    if torch.cuda.get_device_capability()[0] >= 9:
        assert relu_mod._pdl_ok(plan.device_id)
    xs = [to_torch(rng.standard_normal((N, C, hw, hw)), "float16") for _ in range(4)]
    ys = [poison(torch.empty(plan.y_shape, dtype=torch.float16, device="cuda")) for _ in xs]
    ms = [torch.full((plan.mask_words,), -1, dtype=torch.int32, device="cuda") for _ in xs]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for x, y, m in zip(xs, ys, ms):
            plan(x, w, out=y, mask_out=m)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    for x, y, m in zip(xs, ys, ms):
        assert not torch.isnan(y).any()
        assert torch.equal(m, igemm.relu_mask(y))
    ref = reference.conv2d_direct(to_numpy(xs[0]), to_numpy(w), 1, 1, 1, "NCHW")
    sc = (V[0] / torch.sqrt(V[3] + 1e-5)).double().cpu().numpy()
    sh = V[1].double().cpu().numpy() - V[2].double().cpu().numpy() * sc
    ref = np.maximum(ref * sc[None, :, None, None] + sh[None, :, None, None], 0)
    assert rel_err(to_numpy(ys[0]), ref) <= TOL["float16"]
    y, m = ys[0], ms[0]
    with torch.cuda.stream(s):
        plan(xs[1], w, out=y, mask_out=m)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan(xs[1], w, out=y, mask_out=m)
    for x in xs:
        xs[1].copy_(x)
        y.fill_(float("nan"))
        m.fill_(-1)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(m, igemm.relu_mask(y)) and not torch.isnan(y).any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_nchw_paths(dtype, rng):
    """NCHW both ways (native gather, transpose path) on shapes that take every transpose variant:
    16-byte tiles (H*W % 8 == 0), element tiles (7x7, 14x14, misaligned x), 1x1 (w read in place,
    misaligned w), partial 64-tiles; plain and BN+Add+ReLU(mask) chains; y and mask poisoned first."""
    torch = pytest.importorskip("torch")
    from igemm import epilogues as ep
    cases = [((2, 64, 8, 8), (40, 64, 3, 3), 1, 1, 0, 0), ((3, 72, 7, 7), (130, 72, 3, 3), 1, 1, 0, 0),
             ((2, 16, 14, 14), (64, 16, 1, 1), 1, 0, 0, 1), ((2, 136, 9, 11), (24, 136, 5, 3), 2, 2, 1, 0),
             ((1, 8, 28, 28), (8, 8, 3, 3), 1, 1, 1, 1), ((2, 200, 6, 6), (72, 200, 1, 1), 2, 0, 0, 0),
             ((2, 32, 6, 5), (48, 32, 3, 3), 1, 1, 0, 0),                  # P*Q = 30: 4-byte output vectors
             # 1x1 strided, no padding: the transpose copies only x[:, :, ::s, ::s] (odd maps, misaligned x;
             # C = 128: TMA loads on the copy)
             ((2, 64, 9, 11), (48, 64, 1, 1), 2, 0, 0, 0), ((2, 24, 14, 13), (40, 24, 1, 1), 3, 0, 1, 0),
             ((3, 128, 28, 28), (256, 128, 1, 1), 2, 0, 0, 0),
             # 1x1 stride 1, H*W % 64 == 0: "native" reads NCHW x as MN-major TMA tiles (misaligned x: the gather)
             ((2, 64, 8, 8), (96, 64, 1, 1), 1, 0, 0, 0), ((3, 128, 16, 16), (136, 128, 1, 1), 1, 0, 0, 0),
             ((2, 64, 8, 16), (64, 64, 1, 1), 1, 0, 1, 0)]
    for xs, ws, st, pd, xoff, woff in cases:
        xb = to_torch(rng.standard_normal(int(np.prod(xs)) + 8), dtype)
        wb = to_torch(rng.standard_normal(int(np.prod(ws)) + 8) / np.sqrt(np.prod(ws[1:])), dtype)
        x = xb[xoff:xoff + int(np.prod(xs))].view(xs)
        w = wb[woff:woff + int(np.prod(ws))].view(ws)
        K = ws[0]
        g_, b_, m_, v_ = (torch.rand(K, device="cuda", dtype=torch.float32) + 0.5 for _ in range(4))
        ref = reference.conv2d_direct(to_numpy(x), to_numpy(w), st, pd, 1, "NCHW")
        res = to_torch(rng.standard_normal(ref.shape), dtype)
        scale = to_numpy(g_) / np.sqrt(to_numpy(v_) + 1e-5)
        pre = (ref - to_numpy(m_)[None, :, None, None]) * scale[None, :, None, None] \
            + to_numpy(b_)[None, :, None, None] + to_numpy(res)
        for path in ("native", "transpose"):
            plan = Conv2dPlan(x.shape, w.shape, dtype, "NCHW", st, pd, options=igemm.Conv2dOptions(nchw_path=path))
            assert plan.path == path
            if path == "transpose" and ws[2:] == (1, 1) and pd == 0 and st != 1:
                assert plan.kproblem.H == ref.shape[2] and plan.kproblem.stride == (1, 1), plan.kproblem
            if path == "native" and ws[2:] == (1, 1) and pd == 0 and st == 1 and xs[1] % 64 == 0 and xoff == 0:
                assert plan.spec().load_a == "tmamn", plan.spec().name()
                assert Conv2dPlan(x.shape, w.shape, dtype, "NCHW", st, pd).path == "native"   # (auto)
            for _ in range(2):                      # the second call reuses the plan's scratch
                y = plan(x, w, out=poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda")))
                err = rel_err(to_numpy(y), ref)
                assert err <= TOL[dtype], f"{path} {xs} {ws}: {plan.spec().name()} {err}"
            fused = Conv2dPlan(x.shape, w.shape, dtype, "NCHW", st, pd,
                               epilogue=ep.chain(ep.BatchNorm(g_, b_, m_, v_), ep.Add(), ep.ReLU(mask=True)), options=igemm.Conv2dOptions(nchw_path=path))
            mo = torch.full(((int(np.prod(ref.shape)) + 31) // 32,), -1, dtype=torch.int32, device="cuda")
            y, m = fused(x, w, residual=res, mask_out=mo,
                         out=poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda")))
            err = rel_err(to_numpy(y), np.maximum(pre, 0))
            assert err <= TOL[dtype], f"{path} fused {xs}: {err}"
            assert torch.equal(m, igemm.relu_mask(y)), f"{path} fused {xs}: mask differs from y > 0"


def _bn_add_case(torch, rng, ref, K, layout, dtype):
    """BatchNorm vectors (gamma, beta, mean, var on the GPU), a residual, and the float64 BN(ref) + residual
    (before the ReLU) for a BN+Add+ReLU chain on a conv whose float64 result is ``ref``."""
    g_, b_, m_, v_ = (torch.rand(K, device="cuda", dtype=torch.float32) + 0.5 for _ in range(4))
    res = to_torch(rng.standard_normal(ref.shape), dtype)
    cshape = (1, K, 1, 1) if layout == "NCHW" else (1, 1, 1, K)
    sc = (to_numpy(g_) / np.sqrt(to_numpy(v_) + 1e-5)).reshape(cshape)
    pre = (ref - to_numpy(m_).reshape(cshape)) * sc + to_numpy(b_).reshape(cshape) + to_numpy(res)
    return (g_, b_, m_, v_), res, pre


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_channel_pad(dtype, layout, rng):
    """C < 8 on copies padded to 8 channels (pad_channels=True), and with the element gather: conv1-like
    7x7/2, C = 1, 5, 7, a misaligned x, BN+Add+ReLU(mask); y and mask poisoned first."""
    torch = pytest.importorskip("torch")
    from igemm import epilogues as ep
    for xs, ws, st, pd, xoff in [((2, 3, 37, 41), (16, 3, 7, 7), 2, 3, 0), ((2, 1, 9, 9), (7, 1, 3, 3), 1, 1, 1),
                                 ((3, 5, 8, 8), (9, 5, 3, 3), 1, 1, 0), ((1, 7, 6, 5), (40, 7, 1, 1), 1, 0, 1)]:
        x64, w64 = to_layout(rng.standard_normal(xs), rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:])), layout)
        xb = to_torch(np.concatenate([np.zeros(8), x64.ravel()]), dtype)
        x = xb[8 - xoff:8 - xoff + x64.size].view(x64.shape)
        w = to_torch(w64, dtype)
        ref = reference.conv2d_direct(to_numpy(x), to_numpy(w), st, pd, 1, layout)
        (g_, b_, m_, v_), res, pre = _bn_add_case(torch, rng, ref, ws[0], layout, dtype)
        for pad, unf in ((True, None), (None, False)):
            plan = Conv2dPlan(x.shape, w.shape, dtype, layout, st, pd, options=igemm.Conv2dOptions(pad_channels=pad, unfold=unf))
            assert (plan.kproblem.C == 8) == bool(pad), plan
            for _ in range(2):
                y = plan(x, w, out=poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda")))
                err = rel_err(to_numpy(y), ref)
                assert err <= TOL[dtype], f"pad={pad} {layout} {xs}: {plan.spec().name()} {err}"
            fused = Conv2dPlan(x.shape, w.shape, dtype, layout, st, pd,
                               epilogue=ep.chain(ep.BatchNorm(g_, b_, m_, v_), ep.Add(), ep.ReLU(mask=True)), options=igemm.Conv2dOptions(pad_channels=pad, unfold=unf))
            mo = torch.full(((int(np.prod(ref.shape)) + 31) // 32,), -1, dtype=torch.int32, device="cuda")
            y, m = fused(x, w, residual=res, mask_out=mo,
                         out=poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda")))
            assert rel_err(to_numpy(y), np.maximum(pre, 0)) <= TOL[dtype], f"pad={pad} fused {layout} {xs}"
            assert torch.equal(m, igemm.relu_mask(y))
        # 8-tap TMA k-tiles on the padded copies (an autotune candidate): bitwise equal to their 16-byte gather
        tma = Conv2dPlan(x.shape, w.shape, dtype, layout, st, pd, options=igemm.Conv2dOptions(pad_channels=True, config={"load_a": "tma8", "load_b": "tma"}))
        gat = Conv2dPlan(x.shape, w.shape, dtype, layout, st, pd, options=igemm.Conv2dOptions(pad_channels=True))
        assert (tma.spec().load_a, gat.spec().load_a) == ("tma8", "vec")
        assert torch.equal(tma(x, w), gat(x, w)), f"tma8 vs gather {layout} {xs}"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype, precision", PRECISIONS, ids=["fp16", "bf16", "fp32", "tf32"])
def test_gpu_unfold(dtype, precision, layout, rng):
    """The width unfold (conv1's default path) against the float64 reference: conv1-like 7x7/2, odd C,
    stride/padding/dilation along the width, a misaligned x, BN+Add+ReLU(mask); y and mask poisoned first;
    the element gather (unfold=False) on the same inputs agrees."""
    torch = pytest.importorskip("torch")
    from igemm import epilogues as ep
    tol = TOL["tf32" if precision == "tf32" else dtype]
    for xs, ws, st, pd, dl, xoff in [((2, 3, 37, 41), (16, 3, 7, 7), 2, 3, 1, 0),
                                     ((2, 1, 9, 9), (7, 1, 3, 3), 1, 1, 1, 1),
                                     ((3, 2, 11, 13), (40, 2, 3, 5), (1, 2), (2, 1), (1, 2), 0),
                                     ((1, 3, 20, 19), (70, 3, 5, 3), (2, 3), (0, 2), (2, 1), 1)]:
        x64, w64 = to_layout(rng.standard_normal(xs), rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:])), layout)
        xb = to_torch(np.concatenate([np.zeros(8), x64.ravel()]), dtype)
        x = xb[8 - xoff:8 - xoff + x64.size].view(x64.shape)
        w = to_torch(w64, dtype)
        ref = reference.conv2d_direct(to_numpy(x), to_numpy(w), st, pd, dl, layout)
        plan = Conv2dPlan(x.shape, w.shape, dtype, layout, st, pd, dl, precision=precision, options=igemm.Conv2dOptions(unfold="copy"))
        assert plan.path == "unfold" and plan.spec().load_a == "vec", plan
        for _ in range(2):
            y = plan(x, w, out=poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda")))
            err = rel_err(to_numpy(y), ref)
            assert err <= tol, f"{layout} {xs} {ws}: {plan.spec().name()} {err}"
        y0 = Conv2dPlan(x.shape, w.shape, dtype, layout, st, pd, dl, precision=precision, options=igemm.Conv2dOptions(unfold=False))(x, w)
        assert rel_err(to_numpy(y0), to_numpy(y)) <= 2 * tol
        (g_, b_, m_, v_), res, pre = _bn_add_case(torch, rng, ref, ws[0], layout, dtype)
        fused = Conv2dPlan(x.shape, w.shape, dtype, layout, st, pd, dl, precision=precision,
                           epilogue=ep.chain(ep.BatchNorm(g_, b_, m_, v_), ep.Add(), ep.ReLU(mask=True)), options=igemm.Conv2dOptions(unfold="copy"))
        mo = torch.full(((int(np.prod(ref.shape)) + 31) // 32,), -1, dtype=torch.int32, device="cuda")
        y, m = fused(x, w, residual=res, mask_out=mo, out=poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda")))
        assert rel_err(to_numpy(y), np.maximum(pre, 0)) <= tol, f"fused {layout} {xs}"
        assert torch.equal(m, igemm.relu_mask(y))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_patch(dtype, rng):
    """The width unfold in shared memory (the patch kernel, NHWC) against the float64 reference: conv1-like
    7x7/2; many lines a tile (Q = 16, 7); a box wider than x's row (W*C < 128); K tails (40, 70: the fp32 C
    tile's store); C = 1; R > H; a tile across images; plain and BN+Add+ReLU(mask), y and mask poisoned;
    the copy path's result (bitwise where the tile is the same); a misaligned x (the copy plan)."""
    torch = pytest.importorskip("torch")
    from igemm import epilogues as ep
    for xs, ws, st, pd in [((2, 37, 48, 3), (16, 7, 7, 3), 2, 3),
                           ((3, 12, 16, 4), (40, 3, 5, 4), 1, (1, 2)),
                           ((2, 20, 40, 2), (70, 3, 4, 2), (1, 3), (0, 1)),
                           ((2, 30, 64, 1), (24, 5, 7, 1), 2, 2),
                           ((1, 2, 40, 3), (8, 3, 3, 3), 1, 1),
                           ((5, 7, 8, 6), (64, 3, 3, 6), 1, 1)]:
        x64 = rng.standard_normal(xs)
        w64 = rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:]))
        x, w = to_torch(x64, dtype), to_torch(w64, dtype)
        ref = reference.conv2d_direct(to_numpy(x), to_numpy(w), st, pd, 1, "NHWC")
        plan = Conv2dPlan(x.shape, w.shape, dtype, "NHWC", st, pd)
        assert plan.path == "patch" and plan.spec().load_a == "patch", plan
        copy = Conv2dPlan(x.shape, w.shape, dtype, "NHWC", st, pd, options=igemm.Conv2dOptions(unfold="copy"))
        for _ in range(2):
            y = plan(x, w, out=poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda")))
            err = rel_err(to_numpy(y), ref)
            assert err <= TOL[dtype], f"{xs} {ws}: {plan.spec().name()} {err}"
        yc = copy(x, w)
        if (plan.spec().bm, plan.spec().bn, plan.spec().store) == (copy.spec().bm, copy.spec().bn, copy.spec().store):
            assert torch.equal(y, yc), f"patch vs copy {xs} {ws}"          # the same tile and reduction order
        assert rel_err(to_numpy(yc), to_numpy(y)) <= TOL[dtype]
        xb = to_torch(np.concatenate([np.zeros(7), x64.ravel(), np.zeros(1)]), dtype)
        xm = xb[7:7 + x64.size].view(x64.shape)                     # x's values, 14 bytes past a 16-byte boundary
        assert xm.data_ptr() % 16 and torch.equal(xm, x)
        assert rel_err(to_numpy(plan(xm, w)), ref) <= TOL[dtype]
        (g_, b_, m_, v_), res, pre = _bn_add_case(torch, rng, ref, ws[0], "NHWC", dtype)
        fused = Conv2dPlan(x.shape, w.shape, dtype, "NHWC", st, pd,
                           epilogue=ep.chain(ep.BatchNorm(g_, b_, m_, v_), ep.Add(), ep.ReLU(mask=True)))
        assert fused.spec().load_a == "patch"
        mo = torch.full(((int(np.prod(ref.shape)) + 31) // 32,), -1, dtype=torch.int32, device="cuda")
        y, m = fused(x, w, residual=res, mask_out=mo, out=poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda")))
        assert rel_err(to_numpy(y), np.maximum(pre, 0)) <= TOL[dtype], f"fused {xs} {ws}"
        assert torch.equal(m, igemm.relu_mask(y))
        ym, mm = fused(xm, w, residual=res)
        assert torch.equal(ym, y) and torch.equal(mm, m), f"fused, misaligned x {xs}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_patch_residual_preloaded(dtype, rng):
    """The patch kernel's residual loaded into registers at the tile's start (KernelSpec.residual_preloaded)
    on 128-row tiles (two warpgroups: enough tiles for two waves), BN = 64 under the 3-CTA register cap and
    BN = 128, a row tail and a K tail; BN+Add+ReLU(mask) against the float64 reference, y and mask poisoned."""
    torch = pytest.importorskip("torch")
    from igemm import epilogues as ep
    for xs, ws in [((2, 200, 200, 3), (64, 7, 7, 3)), ((3, 150, 152, 3), (120, 7, 7, 3))]:
        x = to_torch(rng.standard_normal(xs), dtype)
        w = to_torch(rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:])), dtype)
        ref = reference.conv2d_direct(to_numpy(x), to_numpy(w), 2, 3, 1, "NHWC")
        (g_, b_, m_, v_), res, pre = _bn_add_case(torch, rng, ref, ws[0], "NHWC", dtype)
        fused = Conv2dPlan(x.shape, w.shape, dtype, "NHWC", 2, 3,
                           epilogue=ep.chain(ep.BatchNorm(g_, b_, m_, v_), ep.Add(), ep.ReLU(mask=True)))
        s = fused.spec()
        assert (s.load_a, s.bm, s.bn, s.residual_preloaded) == ("patch", 128, 64 if ws[0] <= 64 else 128, True), s
        assert ref.shape[0] * ref.shape[1] * ref.shape[2] % 128 and (s.min_blocks == 3 or s.bn == 128)
        mo = torch.full(((int(np.prod(ref.shape)) + 31) // 32,), -1, dtype=torch.int32, device="cuda")
        y, m = fused(x, w, residual=res, mask_out=mo, out=poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda")))
        assert rel_err(to_numpy(y), np.maximum(pre, 0)) <= TOL[dtype], f"{xs} {ws}"
        assert torch.equal(m, igemm.relu_mask(y))
        big = np.abs(pre) > 0.05                              # away from the rounding boundary: the exact bit
        bits = np.unpackbits(to_numpy(m).view(np.uint8), bitorder="little")[:pre.size].reshape(pre.shape)
        assert np.array_equal(bits[big], (pre > 0)[big])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_patch_nchw(dtype, rng):
    """NCHW few-channel inputs on the patch kernel: x transposed to an NHWC copy (the 4 x 1024 transpose tile
    for C <= 4), y stored NCHW from the fp32 C tile; conv1-like 7x7/2, K tails, misaligned x (read by the
    transpose only), plain and BN+Add+ReLU(mask) with y and mask poisoned."""
    torch = pytest.importorskip("torch")
    from igemm import epilogues as ep
    for xs, ws, st, pd in [((2, 3, 37, 48), (16, 3, 7, 7), 2, 3), ((2, 4, 12, 16), (40, 4, 3, 5), 1, (1, 2)),
                           ((1, 3, 40, 40), (64, 3, 7, 7), 2, 3), ((2, 6, 20, 40), (70, 6, 3, 4), (1, 3), (0, 1))]:
        x64 = rng.standard_normal(xs)
        x, w = to_torch(x64, dtype), to_torch(rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:])), dtype)
        ref = reference.conv2d_direct(to_numpy(x), to_numpy(w), st, pd, 1, "NCHW")
        plan = Conv2dPlan(x.shape, w.shape, dtype, "NCHW", st, pd)
        assert plan.path == "patch" and plan.spec().load_a == "patch" and plan.spec().store == "regsnchw", plan
        for _ in range(2):
            y = plan(x, w, out=poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda")))
            assert rel_err(to_numpy(y), ref) <= TOL[dtype], f"{xs} {ws}: {plan.spec().name()}"
        xb = to_torch(np.concatenate([np.zeros(3), x64.ravel(), np.zeros(1)]), dtype)
        xm = xb[3:3 + x64.size].view(xs)                            # 6 bytes past a 16-byte boundary
        assert xm.data_ptr() % 16 and torch.equal(plan(xm, w), y)
        (g_, b_, m_, v_), res, pre = _bn_add_case(torch, rng, ref, ws[0], "NCHW", dtype)
        fused = Conv2dPlan(x.shape, w.shape, dtype, "NCHW", st, pd,
                           epilogue=ep.chain(ep.BatchNorm(g_, b_, m_, v_), ep.Add(), ep.ReLU(mask=True)))
        assert fused.path == "patch"
        mo = torch.full(((int(np.prod(ref.shape)) + 31) // 32,), -1, dtype=torch.int32, device="cuda")
        y, m = fused(x, w, residual=res, mask_out=mo, out=poison(torch.empty(ref.shape, dtype=x.dtype, device="cuda")))
        assert rel_err(to_numpy(y), np.maximum(pre, 0)) <= TOL[dtype], f"fused {xs} {ws}"
        assert torch.equal(m, igemm.relu_mask(y))


@pytest.mark.gpu
def test_gpu_patch_kernel_smem_grows(rng):
    """One patch kernel, two problems: the second needs more dynamic shared memory (more lines a tile, more
    boxes) than the one that loaded the kernel, so the plan raises the function's limit (a random problem
    on the H100 once failed its launch with CUDA_ERROR_INVALID_VALUE)."""
    torch = pytest.importorskip("torch")
    plans = []
    for xs, ws, st, pd in [((2, 37, 48, 3), (16, 7, 7, 3), 2, 3), ((4, 40, 4, 6), (16, 7, 3, 6), 1, (3, 1))]:
        x = to_torch(rng.standard_normal(xs), "float16")
        w = to_torch(rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:])), "float16")
        plan = Conv2dPlan(x.shape, w.shape, "float16", "NHWC", st, pd)
        plans.append(plan)
        y = plan(x, w, out=poison(torch.empty((xs[0], plan.problem.P, plan.problem.Q, ws[0]), dtype=x.dtype, device="cuda")))
        ref = reference.conv2d_direct(to_numpy(x), to_numpy(w), st, pd, 1, "NHWC")
        assert rel_err(to_numpy(y), ref) <= TOL["float16"], plan
    a, b = (p.spec() for p in plans)
    assert a.name() == b.name() and b.smem > a.smem > 48 * 1024, (a.smem, b.smem)


@pytest.mark.gpu
def test_gpu_unfold_in_graph_and_function(rng):
    """conv1 through igemm.conv2d takes the unfold by default; its two launches replay in a CUDA graph."""
    torch = pytest.importorskip("torch")
    x = torch.randn(2, 64, 64, 3, device="cuda", dtype=torch.float16)
    w = torch.randn(64, 7, 7, 3, device="cuda", dtype=torch.float16) / 12
    plan = Conv2dPlan(x.shape, w.shape, "float16", "NHWC", 2, 3)
    assert plan.path == "patch"                   # (sm_90; two launches: w's unfold, the conv)
    y = torch.empty(2, 32, 32, 64, device="cuda", dtype=torch.float16)
    _replay_in_graph(torch, plan, x, w, y, 12, lambda: reference.conv2d_direct(to_numpy(x), to_numpy(w), 2, 3, 1, "NHWC"))
    yf = igemm.conv2d(x, w, 2, 3, layout="NHWC")
    assert rel_err(to_numpy(yf), reference.conv2d_direct(to_numpy(x), to_numpy(w), 2, 3, 1, "NHWC")) <= TOL["float16"]


@pytest.mark.gpu
def test_gpu_nchw_transpose_path_in_graph(rng):
    """The transpose path (two launches) captured in a CUDA graph, replayed on new inputs."""
    torch = pytest.importorskip("torch")
    x = torch.randn(4, 64, 14, 14, device="cuda", dtype=torch.float16)
    w = torch.randn(96, 64, 3, 3, device="cuda", dtype=torch.float16) / 24
    plan = Conv2dPlan(x.shape, w.shape, "float16", "NCHW", padding=1)
    assert plan.path == "transpose"
    y = torch.empty(4, 96, 14, 14, device="cuda", dtype=torch.float16)
    _replay_in_graph(torch, plan, x, w, y, 24,
                     lambda: to_numpy(torch.nn.functional.conv2d(x.double(), w.double(), padding=1)))


def _replay_in_graph(torch, plan, x, w, y, w_scale, ref_fn):
    """Capture ``plan(x, w, out=y)`` (its preparation launch and the conv) in a CUDA graph, then replay it
    three times on fresh x and w with y poisoned, against ``ref_fn()``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        plan(x, w, out=y)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan(x, w, out=y)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        w.copy_(torch.randn_like(w) / w_scale)
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(to_numpy(y), ref_fn()) <= TOL[str(y.dtype).replace("torch.", "")]


@pytest.mark.gpu
def test_gpu_autotune(rng, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    import igemm.conv._autotune as at
    monkeypatch.setenv("IGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("IGEMM_AUTOTUNE", "1")
    monkeypatch.setattr(at, "_mem", None)
    x = torch.randn(2, 9, 9, 64, device="cuda", dtype=torch.float16)
    w = torch.randn(96, 3, 3, 64, device="cuda", dtype=torch.float16) / 24
    plan = Conv2dPlan(x.shape, w.shape, "float16", "NHWC", padding=1)
    _check_plan(torch, plan, x, w, "NHWC", 1, 1, 1, TOL["float16"])
    assert (tmp_path / "autotune.json").exists()
    monkeypatch.setenv("IGEMM_AUTOTUNE", "0")
    monkeypatch.setattr(at, "_mem", None)
    again = Conv2dPlan(x.shape, w.shape, "float16", "NHWC", padding=1)
    assert again.spec() == plan.spec()


@pytest.mark.gpu
def test_gpu_interop_and_streams(rng):
    torch = pytest.importorskip("torch")
    x64 = rng.standard_normal((2, 8, 10, 10)).astype(np.float32)
    w64 = rng.standard_normal((4, 8, 3, 3)).astype(np.float32)
    ref = reference.conv2d_direct(x64, w64, 1, 1, 1)
    # numpy in, numpy out
    y = igemm.conv2d(x64, w64, padding=1)
    assert isinstance(y, np.ndarray) and rel_err(y, ref) < 1e-5
    # torch on a side stream
    s = torch.cuda.Stream()
    x, w = torch.from_numpy(x64).cuda(), torch.from_numpy(w64).cuda()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        y = igemm.conv2d(x, w, padding=1)
    s.synchronize()
    assert rel_err(y.cpu().numpy(), ref) < 1e-5
    y2 = igemm.conv2d(x, w, padding=1, stream=s)
    s.synchronize()
    assert torch.equal(y, y2)
    # cupy in, cupy out
    cupy = pytest.importorskip("cupy")
    yc = igemm.conv2d(cupy.asarray(x64), cupy.asarray(w64), padding=1)
    assert isinstance(yc, cupy.ndarray) and rel_err(cupy.asnumpy(yc), ref) < 1e-5


@pytest.mark.gpu
def test_gpu_misaligned_input_takes_narrow_loads(rng):
    torch = pytest.importorskip("torch")
    buf = torch.randn(1 + 2 * 12 * 12 * 16, device="cuda", dtype=torch.float16)
    x = buf[1:].view(2, 12, 12, 16)              # 2-byte aligned only
    w = torch.randn(8, 3, 3, 16, device="cuda", dtype=torch.float16)
    y = igemm.conv2d(x, w, padding=1, layout="NHWC")
    ref = reference.conv2d_direct(to_numpy(x), to_numpy(w), 1, 1, 1, "NHWC")
    assert rel_err(to_numpy(y), ref) < 1e-2
    out = torch.empty(1 + y.numel(), device="cuda", dtype=torch.float16)[1:].view(y.shape)
    with pytest.raises(ValueError, match="aligned"):
        igemm.conv2d(x, w, padding=1, layout="NHWC", out=out)


@pytest.mark.gpu
def test_gpu_errors_before_launch(rng):
    torch = pytest.importorskip("torch")
    x = torch.randn(2, 8, 10, 10, device="cuda")
    w = torch.randn(4, 8, 3, 3, device="cuda")
    out = torch.full((2, 4, 8, 8), 7.0, device="cuda")
    with pytest.raises(TypeError, match="cpu"):
        igemm.conv2d(x.cpu(), w)
    with pytest.raises(TypeError):
        igemm.conv2d(x, w.cpu().numpy())
    with pytest.raises(ValueError, match="shape"):
        igemm.conv2d(x, w, out=out[:, :, :7])
    with pytest.raises(ValueError, match="contiguous"):
        igemm.conv2d(x, w, out=out.transpose(2, 3))
    with pytest.raises(ValueError, match="overlap"):
        igemm.conv2d(x, w, out=x.view(-1)[: out.numel()].view(out.shape))
    assert torch.all(out == 7.0)


@pytest.mark.gpu
def test_function_fast_path_repeats_and_still_validates(rng):
    """A repeated plain igemm.conv2d call on torch tensors takes the cached-plan path: same answers as the
    first call, and a changed argument (dtype, shape, a bad out=) still gets the general path's checks."""
    torch = pytest.importorskip("torch")
    x = torch.randn(2, 8, 10, 10, device="cuda")
    w = torch.randn(6, 8, 3, 3, device="cuda")
    ref = reference.conv2d_direct(x.double().cpu().numpy(), w.double().cpu().numpy(), 1, 1, 1, "NCHW")
    ys = [igemm.conv2d(x, w, padding=1) for _ in range(3)]
    for y in ys:
        assert rel_err(y.double().cpu().numpy(), ref) <= TOL["float32"]
        assert torch.equal(y, ys[0])
    out = torch.full((2, 6, 10, 10), float("nan"), device="cuda")
    assert igemm.conv2d(x, w, padding=1, out=out) is out and torch.equal(out, ys[0])
    with pytest.raises(TypeError, match="dtype"):
        igemm.conv2d(x, w.half(), padding=1)
    with pytest.raises(ValueError):
        igemm.conv2d(x, w, padding=1, out=torch.empty(2, 6, 9, 9, device="cuda"))
    with pytest.raises(ValueError, match="overlap"):
        igemm.conv2d(x, w, padding=1, out=x.view(-1)[:1200].view(2, 6, 10, 10))
    y2 = igemm.conv2d(x[:1], w, padding=1)                  # another shape: its own plan
    assert torch.equal(y2, ys[0][:1])
