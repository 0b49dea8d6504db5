"""The conv's operand preparation on its own: the batched transpose (NCHW -> NHWC, KCRS -> KRSC, the channel pad,
the subsampled copy of a 1x1 strided conv) and the width unfold (csrc/conv/transpose.cuh, unfold.cuh;
igemm/conv/_transpose.py, _unfold.py): job geometry, numpy emulation, compilation, and the kernels' exact bits."""
import shutil

import numpy as np
import pytest

import igemm
from igemm import _build, reference
from igemm.conv import Conv2dPlan

from helpers import rel_err
from test_conv import LAYOUTS, _pb, _stub, choose_config, to_layout


def _unfold_numpy(src: np.ndarray, job) -> np.ndarray:
    """csrc/conv/unfold.cuh's job in numpy, from the job's own fields (strides in elements)."""
    flat = src.ravel()
    out = np.zeros((job.A, job.B, job.Q, job.Cp), src.dtype)
    sa, sb, sc, sw = job.strides
    for s in range(job.S):
        for c in range(job.C):
            w = np.arange(job.Q) * job.stride - job.pad + s * job.dil
            ok = (w >= 0) & (w < job.width)
            idx = (np.arange(job.A)[:, None, None] * sa + np.arange(job.B)[None, :, None] * sb + c * sc
                   + np.where(ok, w, 0)[None, None, :] * sw)
            out[:, :, :, s * job.C + c] = np.where(ok[None, None, :], flat[idx], 0)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unfold_choice_and_geometry(layout, rng):
    """The width unfold: when it is chosen, and that a conv of the unfolded copies (the jobs' index math,
    emulated in numpy) with the unfolded problem equals the conv, over strides, paddings and dilations."""
    from igemm.conv._paths import kernel_setup, use_unfold
    from igemm.conv._unfold import UnfoldJob, unfold_channels
    assert use_unfold(_pb(C=3, R=7, S=7, layout=layout))                               # conv1, fp16
    assert not use_unfold(_pb(C=3, R=7, S=7, layout=layout, dtype="float32", precision="strict"))  # measured slower
    assert not use_unfold(_pb(C=4, R=3, S=3, dtype="float32", precision="strict"))    # 16-byte pixels already
    assert not use_unfold(_pb(C=3, R=3, S=1))                                          # nothing to unfold
    assert not use_unfold(_pb(C=3, R=7, S=7), pad=True) and not use_unfold(_pb(C=3, R=7, S=7), "native")
    assert use_unfold(_pb(C=12, R=3, S=3), unfold=True) and not use_unfold(_pb(C=3, R=7, S=7), unfold=False)
    with pytest.raises(ValueError, match="unfold"):
        use_unfold(_pb(C=3), pad=True, unfold=True)
    assert (unfold_channels(3, 7, 2), unfold_channels(3, 7, 4), unfold_channels(1, 3, 2)) == (24, 24, 8)
    path, kp = kernel_setup(_pb(C=3, R=7, S=7, H=30, W=30, stride=(2, 2), padding=(3, 3), layout=layout))
    assert (path, kp.C, kp.S, kp.W, kp.layout, kp.y_layout, kp.stride, kp.padding) == (
        "unfold", 24, 1, 15, "NHWC", layout, (2, 1), (3, 0))
    s = choose_config(kp)
    assert (s.load_a, s.load_b, kp.Kred) == ("vec", "vec", 168)
    big = kernel_setup(_pb(N=32, C=3, R=7, S=7, H=224, W=224, K=64, stride=(2, 2), padding=(3, 3)))[1]
    assert (choose_config(big).bm, choose_config(big).wm) == (128, 2)                  # conv1, N=32
    plan = Conv2dPlan((2, 3, 30, 30) if layout == "NCHW" else (2, 30, 30, 3),
                      (64, 3, 7, 7) if layout == "NCHW" else (64, 7, 7, 3), "float16", layout, 2, 3, device="numpy", options=igemm.Conv2dOptions(unfold="copy"))
    assert plan.path == "unfold" and "unfolded to 24" in repr(plan)
    assert plan.spec(x_aligned=False, w_aligned=False).load_a == "vec"                # reads its own copies
    for _ in range(12):
        C, R, S = int(rng.integers(1, 6)), int(rng.integers(1, 5)), int(rng.integers(1, 6))
        st, pd, dl = ((int(rng.integers(1, 4)), int(rng.integers(1, 4))), (int(rng.integers(0, 3)),
                      int(rng.integers(0, 3))), (int(rng.integers(1, 3)), int(rng.integers(1, 3))))
        H, W = int(rng.integers(dl[0] * (R - 1) + 1, 14)), int(rng.integers(dl[1] * (S - 1) + 1, 14))
        pb = _pb(N=2, C=C, H=H, W=W, K=5, R=R, S=S, stride=st, padding=pd, dilation=dl, layout=layout,
                 dtype="float32", precision="strict")
        x, w = to_layout(rng.standard_normal((2, C, H, W)), rng.standard_normal((5, C, R, S)), layout)
        path, kp = kernel_setup(pb, unfold=True)
        jx, jw = UnfoldJob.for_x(pb, 4), UnfoldJob.for_w(pb, 4)
        xu = _unfold_numpy(x, jx).reshape(kp.N, kp.H, kp.W, kp.C)
        wu = _unfold_numpy(w, jw).reshape(kp.K, kp.R, 1, kp.C)
        got = reference.conv2d_direct(xu, wu, kp.stride, kp.padding, kp.dilation, "NHWC")
        want = reference.conv2d_direct(x, w, st, pd, dl, layout)
        if layout == "NCHW":
            got = got.transpose(0, 3, 1, 2)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=str(pb))


def _transpose_tiles_numpy(job, mode: int, src: np.ndarray) -> np.ndarray:
    """csrc/conv/transpose.cuh's run tiles (ROWSVEC, COLSVEC) and scatter tiles in numpy, block by block from the
    job's geometry (run_tile's block -> tile order); every tile's shared-memory footprint checked against the
    kernel's 8704 elements. Destination elements no block writes stay NaN."""
    from igemm.conv import _transpose as T
    B, rows, cols, pitch = job.batch, job.rows, job.cols, job.pitch
    s = src.reshape(B, rows, cols)
    dst = np.full((B, cols, pitch), np.nan)
    tr, tc, blocks = job.geometry(mode)
    for b in range(blocks):
        ct, rest = b % tc, b // tc
        rt, img = rest % tr, rest // tr
        if mode == T.ROWSVEC:
            r0 = rt * T.run_rows(cols)
            n = min(T.run_rows(cols), rows - r0)
            assert n > 0 and n % 8 == 0 and n * cols <= 8704
            dst[img, :, r0:r0 + n] = s[img, r0:r0 + n, :].T
        elif mode == T.COLSVEC:
            c0 = ct * T.run_rows(rows)
            n = min(T.run_rows(rows), cols - c0)
            assert n > 0 and n % 8 == 0 and n * rows <= 8704
            dst[img, c0:c0 + n, :] = s[img, :, c0:c0 + n].T
        else:                                       # SCATTER(VEC): 64 channels x 64 destination pixels
            q, w_, sh, sw = job.scatter
            ch, px = np.arange(rt * 64, min(rt * 64 + 64, cols)), np.arange(ct * 64, min(ct * 64 + 64, pitch))
            h, w = px // w_, px % w_
            on = (h % sh == 0) & (w % sw == 0)
            val = s[img][np.where(on, (h // sh) * q + w // sw, 0)][:, ch]          # [pixels][channels]
            dst[img][np.ix_(ch, px)] = np.where(on[:, None], val, 0).T
    return dst


def test_transpose_tiles_emulated(rng):
    """The run and scatter tiles' geometry covers each destination element once with the right source element
    (numpy emulation of the kernel's block -> tile order): images of 196 and 49 pixels, a 3x3 filter, tails of rows
    and columns, the scatter of strided 1x1s (odd sizes, strides 2 and 3)."""
    from igemm.conv import _transpose as T
    for B, R, C in ((3, 1032, 196), (2, 520, 49), (2, 40, 500), (4, 512, 9), (3, 196, 1032), (2, 49, 520),
                    (4, 9, 512), (2, 1, 64), (2, 500, 40)):
        job = T.TransposeJob(B, R, C, 2)
        mode = job.mode(0, 0, first=False)
        assert mode == (T.ROWSVEC if R % 8 == 0 else T.COLSVEC), (B, R, C)
        a = rng.standard_normal((B, R, C))
        np.testing.assert_array_equal(_transpose_tiles_numpy(job, mode, a), a.transpose(0, 2, 1),
                                      err_msg=str((B, R, C)))
    for B, C, H, W, sh, sw in ((2, 64, 28, 28, 2, 2), (3, 72, 13, 11, 3, 3), (2, 136, 16, 14, 2, 1),
                               (1, 64, 9, 20, 1, 2)):
        P, Q = (H - 1) // sh + 1, (W - 1) // sw + 1
        job = T.TransposeJob(B, P * Q, C, 2, pitch=H * W, scatter=(Q, W, sh, sw))
        a = rng.standard_normal((B, P * Q, C))
        want = np.zeros((B, C, H, W))
        want[:, :, ::sh, ::sw] = a.reshape(B, P, Q, C).transpose(0, 3, 1, 2)
        got = _transpose_tiles_numpy(job, job.mode(0, 0), a)
        np.testing.assert_array_equal(got.reshape(B, C, H, W), want, err_msg=str((B, C, H, W, sh, sw)))


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_transpose_kernel_compiles(arch, tmp_path, monkeypatch):
    from igemm.conv import _transpose
    monkeypatch.setenv("IGEMM_CACHE_DIR", str(tmp_path))
    T = _transpose
    for e, a, b in ((2, T.VEC, T.SCALAR16), (2, T.PAD, T.PAD), (4, T.SCALAR16, T.PAD), (2, T.VEC, T.ROWSVEC),
                    (2, T.COLSVEC, T.ROWSVEC), (2, T.SCATTERVEC, T.VEC), (2, T.SCATTER, T.PAD)):
        cubin, _ = _build.compile_cubin(T._stub(e, a, b), arch, name=T._name(e, a, b))
        assert cubin[:4] == b"\x7fELF"


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_unfold_kernels_compile(arch, tmp_path, monkeypatch):
    """The width unfold (2- and 4-byte elements) and the conv kernel of an unfolded conv1."""
    from igemm.conv import _unfold
    from igemm.conv._paths import kernel_setup
    monkeypatch.setenv("IGEMM_CACHE_DIR", str(tmp_path))
    for name, stub in _unfold.all_variants():
        cubin, _ = _build.compile_cubin(stub, arch, name=name)
        assert cubin[:4] == b"\x7fELF"
    kp = kernel_setup(_pb(C=3, R=7, S=7, stride=(2, 2), padding=(3, 3), layout="NCHW",
                          epilogue=(("ReLU", True),)))[1]
    spec = choose_config(kp, arch)
    cubin, _ = _build.compile_cubin(_stub(spec), arch, name=spec.name())
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.gpu
def test_gpu_transpose_kernel(rng):
    """The batched transpose on its own: every tile variant, exact bits."""
    torch = pytest.importorskip("torch")
    from igemm.conv import _transpose
    for dt, (B, R, C) in [(torch.float16, (3, 64, 3136)), (torch.bfloat16, (2, 72, 196)),
                          (torch.float16, (5, 130, 9)), (torch.float32, (2, 33, 70)), (torch.float16, (1, 8, 8)),
                          (torch.float16, (3, 300, 16)), (torch.float32, (2, 513, 1)), (torch.float16, (2, 9, 17)),
                          (torch.float16, (3, 3, 5000)), (torch.float32, (2, 4, 1500)), (torch.bfloat16, (2, 1, 2048)),
                          (torch.float16, (2, 3, 5003)),
                          # 256-row 16-byte tiles of a filter's taps (one full tile and a tail; 3 taps)
                          (torch.float16, (4, 512, 9)), (torch.bfloat16, (3, 264, 9)), (torch.float16, (2, 16, 3)),
                          # run tiles of images of 196 and 49 pixels (a tail tile of rows), wider rows, and the
                          # mirror: all rows x run_rows(rows) columns (a tail tile of columns)
                          (torch.float16, (3, 1032, 196)), (torch.bfloat16, (2, 520, 49)),
                          (torch.float16, (2, 40, 500)),
                          (torch.float16, (3, 196, 1032)), (torch.bfloat16, (2, 49, 520)), (torch.float16, (4, 9, 512)),
                          (torch.float16, (2, 1, 64)), (torch.float16, (2, 500, 40))]:
        for pitch in {R, R + 5}:                                 # zero-filled channels past R
            a = torch.randn(B, R, C, device="cuda").to(dt)
            o = torch.full((B, C, pitch), float("nan"), device="cuda", dtype=dt)
            es = a.element_size()
            _transpose.launch_pair(0, torch.cuda.current_stream().cuda_stream,
                                   _transpose.TransposeJob(B, R, C, es, pitch=pitch), a.data_ptr(), o.data_ptr())
            p = torch.cat([a.transpose(1, 2), torch.zeros(B, C, pitch - R, device="cuda", dtype=dt)], 2)
            torch.cuda.synchronize()
            assert torch.equal(o, p), (dt, B, R, C, pitch)
            pa = torch.full((C * B, pitch), float("nan"), device="cuda", dtype=dt)   # channel pad of B*C pixels
            src = a.reshape(B * C, R)                            # the same memory as B*C pixels of R channels
            _transpose.launch_pair(0, torch.cuda.current_stream().cuda_stream,
                                   _transpose.TransposeJob(1, R, B * C, es, pitch=pitch, pad=True), src.data_ptr(),
                                   pa.data_ptr())
            torch.cuda.synchronize()
            assert torch.equal(pa[:, :R], src) and not pa[:, R:].any(), (dt, B, R, C, pitch, "pad")
        es = torch.tensor([], dtype=dt).element_size()
        a = torch.randn(B, R, C, device="cuda").to(dt)
        b = torch.randn(2, 24, 40, device="cuda").to(dt)
        oa = torch.full((B, C, R), float("nan"), device="cuda", dtype=dt)
        ob = torch.full((2, 40, 24), float("nan"), device="cuda", dtype=dt)
        ja, jb = _transpose.TransposeJob(B, R, C, es), _transpose.TransposeJob(2, 24, 40, es)
        _transpose.launch_pair(0, torch.cuda.current_stream().cuda_stream, ja, a.data_ptr(), oa.data_ptr(),
                               jb, b.data_ptr(), ob.data_ptr())
        torch.cuda.synchronize()
        assert torch.equal(oa, a.transpose(1, 2)) and torch.equal(ob, b.transpose(1, 2)), (dt, B, R, C)
    # subsampled jobs: x[:, :, ::sh, ::sw] NCHW -> NHWC (a 1x1 strided conv's pixels), with a second job
    for dt, (B, R, H, W), (sh, sw), pitch in [(torch.float16, (2, 64, 9, 11), (2, 2), 64),
                                              (torch.float32, (3, 5, 14, 13), (3, 1), 8),
                                              (torch.bfloat16, (1, 130, 28, 28), (2, 3), 130),
                                              # 8-byte pair loads (16-bit, sw = 2, W % 4 == 0): several
                                              # 64-column tiles, a partial one, two row tiles with a tail
                                              (torch.float16, (3, 136, 28, 28), (2, 2), 136),
                                              (torch.bfloat16, (2, 64, 9, 20), (2, 2), 64),
                                              (torch.float16, (2, 8, 16, 8), (1, 2), 8)]:
        a = torch.randn(B, R, H, W, device="cuda").to(dt)
        sub = a[:, :, ::sh, ::sw]
        P, Q = sub.shape[2], sub.shape[3]
        o = torch.full((B, P, Q, pitch), float("nan"), device="cuda", dtype=dt)
        b = torch.randn(2, 24, 40, device="cuda").to(dt)
        ob = torch.full((2, 40, 24), float("nan"), device="cuda", dtype=dt)
        es = a.element_size()
        job = _transpose.TransposeJob(B, R, P * Q, es, pitch=pitch, sub=(Q, W, sh, sw, H * W))
        vec = es == 2 and sw == 2 and W % 4 == 0 and pitch == R and R % 8 == 0
        assert job.mode(a.data_ptr(), o.data_ptr()) == (_transpose.SUBVEC if vec else _transpose.SUB)
        _transpose.launch_pair(0, torch.cuda.current_stream().cuda_stream, job, a.data_ptr(), o.data_ptr(),
                               _transpose.TransposeJob(2, 24, 40, es), b.data_ptr(), ob.data_ptr())
        torch.cuda.synchronize()
        want = torch.cat([sub.permute(0, 2, 3, 1), torch.zeros(B, P, Q, pitch - R, device="cuda", dtype=dt)], 3)
        assert torch.equal(o, want) and torch.equal(ob, b.transpose(1, 2)), (dt, B, R, H, W, sh, sw)
    # scattered jobs, the inverse: [B][P*Q][C] -> [B][C][H*W] with the zeros between (16-byte stores where H*W % 8 == 0
    # and the destination is aligned; element stores at an odd size and at a misaligned destination)
    for dt, (B, C, H, W), (sh, sw), off in [(torch.float16, (2, 512, 28, 28), (2, 2), 0),
                                            (torch.bfloat16, (3, 72, 13, 11), (3, 3), 0),
                                            (torch.float16, (2, 136, 16, 14), (2, 1), 1),
                                            (torch.float16, (1, 64, 9, 20), (1, 2), 0)]:
        P, Q = (H - 1) // sh + 1, (W - 1) // sw + 1
        a = torch.randn(B, P * Q, C, device="cuda").to(dt)
        o = torch.full((B * C * H * W + off,), float("nan"), device="cuda", dtype=dt)
        job = _transpose.TransposeJob(B, P * Q, C, 2, pitch=H * W, scatter=(Q, W, sh, sw))
        vec = (H * W) % 8 == 0 and off == 0
        assert job.mode(a.data_ptr(), o[off:].data_ptr()) == (_transpose.SCATTERVEC if vec else _transpose.SCATTER)
        _transpose.launch_pair(0, torch.cuda.current_stream().cuda_stream, job, a.data_ptr(), o[off:].data_ptr())
        torch.cuda.synchronize()
        want = torch.zeros(B, C, H, W, device="cuda", dtype=dt)
        want[:, :, ::sh, ::sw] = a.reshape(B, P, Q, C).permute(0, 3, 1, 2)
        assert torch.equal(o[off:].reshape(B, C, H, W), want), (dt, B, C, H, W, sh, sw, off)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_unfold_kernel(layout, rng):
    """The width unfold kernel on its own: x and w copies of random few-channel problems (strides, padding,
    dilation, both element sizes) equal the numpy emulation bit for bit, outputs poisoned first."""
    torch = pytest.importorskip("torch")
    from igemm.conv._problem import ConvProblem
    from igemm import _kernel
    from igemm.conv._unfold import Unfolded, UnfoldJob
    for dtype, (N, C, H, W, K, R, S, st, pd, dl) in [
            (torch.float16, (2, 3, 17, 19, 8, 7, 7, 2, 3, 1)), (torch.bfloat16, (1, 2, 9, 30, 4, 3, 5, 1, 2, 1)),
            (torch.float32, (2, 3, 11, 13, 4, 3, 3, 2, 1, 2)), (torch.float16, (3, 1, 8, 8, 2, 1, 5, 1, 2, 1))]:
        es = torch.tensor([], dtype=dtype).element_size()
        pb = ConvProblem.of(N, C, H, W, K, R, S, (st, st), (pd, pd), (dl, dl), str(dtype)[6:], layout, "strict")
        jx, jw = UnfoldJob.for_x(pb, es), UnfoldJob.for_w(pb, es)
        xs = (N, C, H, W) if layout == "NCHW" else (N, H, W, C)
        ws = (K, C, R, S) if layout == "NCHW" else (K, R, S, C)
        x, w = torch.randn(xs, device="cuda").to(dtype), torch.randn(ws, device="cuda").to(dtype)
        ox = torch.full((jx.A, jx.B, jx.Q, jx.Cp), float("nan"), device="cuda").to(dtype)
        ow = torch.full((jw.A, jw.B, jw.Q, jw.Cp), float("nan"), device="cuda").to(dtype)
        _kernel.run_steps(Unfolded(0, jx, ox.data_ptr(), jw, ow.data_ptr()).steps(x.data_ptr(), w.data_ptr()),
                          torch.cuda.current_stream().cuda_stream, x.data_ptr(), w.data_ptr())
        torch.cuda.synchronize()
        bits = torch.int16 if es == 2 else torch.int32
        for got, src, job in ((ox, x, jx), (ow, w, jw)):
            want = _unfold_numpy(src.view(bits).cpu().numpy(), job)
            assert np.array_equal(got.view(bits).cpu().numpy(), want), (dtype, layout, job.A, job.Cp)


def test_prepared_remembers_the_variant_of_each_alignment(monkeypatch):
    """A preparation picks its variant from the sources' alignment once per (src0 % 16, src1 % 16): its launch
    step is the variant the job modes give for every source, binding the two sources; a one-shot call
    launches it with the call's pointers."""
    from igemm import _kernel
    from igemm.conv import _transpose as T
    launched = []

    class FakeLauncher:
        def __init__(self, key):
            self.key = key

        def __call__(self, stream, args):
            launched.append((self.key, args.u64[args.slots["src0"]], args.u64[args.slots["src1"]]))
    monkeypatch.setattr(T, "_launcher", lambda e, m0, m1, dev, blocks: FakeLauncher((e, m0, m1)))
    jobs = [(T.TransposeJob(2, 64, 196, 2, sub=(14, 28, 2, 2, 784)), T.TransposeJob(96, 64, 9, 2)),
            (T.TransposeJob(2, 3, 5000, 2), None), (T.TransposeJob(2, 64, 64, 2), T.TransposeJob(32, 64, 9, 2)),
            (T.TransposeJob(1, 3, 4096, 2, pitch=8, pad=True), T.TransposeJob(1, 3, 147, 2, pitch=8, pad=True))]
    for j0, j1 in jobs:
        prep = T.Prepared(0, j0, 0x10000, j1, 0x20000 if j1 is not None else 0)
        for a, b in [(0x1000, 0x2000), (0x1008, 0x2000), (0x1002, 0x2004), (0x3000, 0x4010), (0x1008, 0x2002),
                     (0x5000, 0x6000)]:
            want = (j0.esize, j0.mode(a, 0x10000), j1.mode(b, 0x20000, first=False) if j1 is not None else T.SCALAR64)
            (step,) = prep.steps(a, b)
            sl = step.args.slots
            assert step.launcher.key == want, (a, b)
            assert step.binds == ((sl["src0"], _kernel.SRC_X, 0), (sl["src1"], _kernel.SRC_W, 0))
            assert prep.steps(a, b)[0].launcher is step.launcher       # remembered
            launched.clear()
            prep(0, a, b)
            assert launched == [(want, a, b)], (a, b, launched, want)
