"""Algorithm comparison (issue 6): numpy algorithms, the GPU kernels' index math emulated on the CPU,
the CLI on the numpy backend, compilation of the im2col and direct kernels, and the GPU algorithms."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from igemm.baselines import _algorithms as A
from igemm import _build, reference
from igemm.baselines.compare import main as compare_main
from igemm.baselines.compare import numpy_size, select_layers
from igemm.fastdiv import divmod_like_device

from helpers import TOL, rel_err, to_numpy, to_torch

LAYOUTS = ["NCHW", "NHWC"]
ROOT = Path(__file__).resolve().parent.parent


def rand_problem(rng, dtype="float32", layout="NCHW"):
    while True:
        N = int(rng.integers(1, 4))
        C = int(rng.choice([1, 3, 5, 8, 16, 24]))
        K = int(rng.integers(1, 20))
        R, S = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        H, W = int(rng.integers(1, 16)), int(rng.integers(1, 16))
        st = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        pd = (int(rng.integers(0, 4)), int(rng.integers(0, 4)))
        dl = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        try:
            return A.Problem(N, C, H, W, K, R, S, st, pd, dl, dtype, layout)
        except ValueError:
            continue


def inputs(rng, pb, dtype=np.float64):
    x = rng.standard_normal(pb.x_shape).astype(dtype)
    w = (rng.standard_normal(pb.w_shape) / np.sqrt(pb.C * pb.R * pb.S)).astype(dtype)
    return x, w


def direct_ref(x, w, pb):
    return reference.conv2d_direct(x, w, pb.stride, pb.padding, pb.dilation, pb.layout)


# ------------------------------------------------------------------------------------ numpy algorithms
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ["im2col", "fft", "direct"])
def test_numpy_algorithms_match_direct(name, layout, rng):
    """Each numpy algorithm (float64 inputs) against the direct reference."""
    fn = {"im2col": A.im2col_gemm_numpy, "fft": A.fft_conv_numpy, "direct": A.NUMPY["direct"]}[name]
    for _ in range(40):
        pb = rand_problem(rng, layout=layout)
        x, w = inputs(rng, pb)
        ref = direct_ref(x, w, pb)
        y = fn(x, w, pb)
        assert y.shape == ref.shape == pb.y_shape
        np.testing.assert_allclose(y, ref, rtol=1e-9, atol=1e-9, err_msg=str(pb))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_numpy_table_float32(layout, rng, numpy_backend):
    """The NUMPY table (what the CLI runs), float32 in and out, implicit = igemm's numpy backend."""
    for _ in range(8):
        pb = rand_problem(rng, layout=layout)
        x, w = inputs(rng, pb, np.float32)
        ref = direct_ref(x, w, pb)
        for name, fn in A.NUMPY.items():
            y = fn(x, w, pb)
            assert y.dtype == np.float32 and y.shape == pb.y_shape, name
            assert rel_err(y, ref) < 1e-6, (name, pb)


def test_good_fft_size():
    for n in range(1, 400):
        m = A.good_fft_size(n)
        assert m >= n
        r = m
        for f in (2, 3, 5, 7):
            while r % f == 0:
                r //= f
        assert r == 1
        assert all(A.good_fft_size(k) == m for k in range(n, m + 1))   # smallest such size
    assert A.good_fft_size(58) == 60 and A.good_fft_size(230) == 240 and A.good_fft_size(11) == 12


def test_problem_validation():
    with pytest.raises(ValueError, match="layout"):
        A.Problem(1, 1, 4, 4, 1, 3, 3, layout="NWHC")
    with pytest.raises(TypeError, match="dtype"):
        A.Problem(1, 1, 4, 4, 1, 3, 3, dtype="float64")
    with pytest.raises(ValueError, match="empty"):
        A.Problem(1, 1, 2, 2, 1, 3, 3)
    pb = A.Problem(2, 3, 9, 7, 4, 3, 2, 2, (1, 0), 1, "float16", "NHWC")
    assert pb.x_shape == (2, 9, 7, 3) and pb.w_shape == (4, 3, 2, 3) and pb.y_shape == (2, 5, 3, 4)
    assert pb.flops == 2 * 2 * 4 * 5 * 3 * 3 * 3 * 2


# ------------------------------------------------------------------------------------ kernels' index math
def test_launch_values_cover_every_parameter():
    """pack_args fills a missing scalar with 0: every non-pointer parameter must have a value."""
    pb = A.Problem(2, 8, 9, 7, 5, 3, 2, 2, 1, 2, "float16", "NHWC")
    for params, vals in ((A.IM2COL_PARAMS, A.im2col_launch_values(pb, 8)),
                         (A.IM2COL_PARAMS, A.im2col_launch_values(A.Problem(2, 8, 9, 7, 5, 3, 2, layout="NCHW"), 1)),
                         (A.DIRECT_PARAMS, A.direct_launch_values(pb))):
        missing = {p.name for p in params if p.ctype != "ptr"} - set(vals)
        assert not missing


def emulate_im2col(x, pb, vec):
    """csrc/baselines/im2col.cuh's loops and index decode (FastDiv as the device computes it), over every thread."""
    v = A.im2col_launch_values(pb, vec)
    dm = divmod_like_device
    out = np.full(int(np.prod(A.im2col_cols_shape(pb))), np.nan)
    writes = np.zeros(out.size, np.int64)
    rows, L, RB = v["rows"], v["row_len"], v["rows_per_iter"]
    Kd, PQ = pb.C * pb.R * pb.S, pb.P * pb.Q
    g = 0
    while g * RB < rows:                               # every group (the grid-stride loop's union)
        m0 = g * RB
        nloc = min(RB, rows - m0) * L
        assert nloc < 2 ** 31
        l = np.arange(nloc)                            # every thread's l (the block-stride loop's union)
        mi, j = dm(l, v["fd_L"])
        m = m0 + mi
        if pb.layout == "NHWC":
            n, pq = dm(m, v["fd_PQ"])
            pp, q = dm(pq, v["fd_Q"])
            kk = j * vec
            rs, c = dm(kk, v["fd_C"])
            r, s = dm(rs, v["fd_S"])
        else:
            n, kk = dm(m, v["fd_Kd"])
            c, rs = dm(kk, v["fd_RS"])
            r, s = dm(rs, v["fd_S"])
            pp, q = dm(j, v["fd_Q"])
        h = pp * v["sh"] - v["ph"] + r * v["dh"]
        w = q * v["sw"] - v["pw"] + s * v["dw"]
        ok = (h >= 0) & (h < pb.H) & (w >= 0) & (w < pb.W)
        hc, wc = np.clip(h, 0, pb.H - 1), np.clip(w, 0, pb.W - 1)
        for e in range(vec):
            if pb.layout == "NHWC":
                val = np.where(ok, x[n, hc, wc, c + e], 0.0)
                off = m * Kd + kk + e
            else:
                val = np.where(ok, x[n, c, hc, wc], 0.0)
                off = m * PQ + j
            out[off] = val
            np.add.at(writes, off, 1)
        g += 1
    assert np.all(writes == 1), "every element of cols written exactly once"
    return out.reshape(A.im2col_cols_shape(pb))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_im2col_kernel_index_math(layout, rng):
    for _ in range(30):
        pb = rand_problem(rng, layout=layout)
        x = rng.standard_normal(pb.x_shape)
        want = A.im2col_cols_numpy(x, pb)
        vecs = [1] if layout == "NCHW" else [v for v in (1, 2, 4, 8) if pb.C % v == 0]
        for vec in vecs:
            np.testing.assert_array_equal(emulate_im2col(x, pb, vec), want, err_msg=f"{pb} vec={vec}")


def test_im2col_vec_choice():
    pb = A.Problem(1, 64, 8, 8, 8, 3, 3, dtype="float16", layout="NHWC")
    assert A.im2col_vec(pb) == 8 and A.im2col_vec(pb, 16, 32) == 8 and A.im2col_vec(pb, 8) == 4
    assert A.im2col_vec(A.Problem(1, 3, 8, 8, 8, 3, 3, dtype="float16")) == 1
    assert A.im2col_vec(A.Problem(1, 6, 8, 8, 8, 3, 3, dtype="float32")) == 2
    assert A.im2col_vec(A.Problem(1, 64, 8, 8, 8, 3, 3, dtype="float32", layout="NCHW")) == 1


def emulate_direct(x, w, pb):
    """csrc/baselines/direct_conv.cuh: decode each thread's output index, loop over the taps, fp32 accumulation."""
    v = A.direct_launch_values(pb)
    dm = divmod_like_device
    e = np.arange(v["total"])
    if pb.layout == "NHWC":
        t, k = dm(e, v["fd_K"])
        t, q = dm(t, v["fd_Q"])
        n, pp = dm(t, v["fd_P"])
        assert np.array_equal(np.stack([n, pp, q, k]), np.stack(np.unravel_index(e, pb.y_shape)))
    else:
        t, q = dm(e, v["fd_Q"])
        t, pp = dm(t, v["fd_P"])
        n, k = dm(t, v["fd_K"])
        assert np.array_equal(np.stack([n, k, pp, q]), np.stack(np.unravel_index(e, pb.y_shape)))
    x32, w32 = x.astype(np.float32), w.astype(np.float32)
    acc = np.zeros(e.size, np.float32)
    h0, w0 = pp * v["sh"] - v["ph"], q * v["sw"] - v["pw"]
    for c in range(pb.C):
        for r in range(pb.R):
            h = h0 + r * v["dh"]
            for s in range(pb.S):
                ww = w0 + s * v["dw"]
                ok = (h >= 0) & (h < pb.H) & (ww >= 0) & (ww < pb.W)
                hc, wc = np.clip(h, 0, pb.H - 1), np.clip(ww, 0, pb.W - 1)
                if pb.layout == "NHWC":
                    xv, wv = x32[n, hc, wc, c], w32[k, r, s, c]
                else:
                    xv, wv = x32[n, c, hc, wc], w32[k, c, r, s]
                acc += np.where(ok, xv * wv, np.float32(0))
    return acc.reshape(pb.y_shape)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_direct_kernel_index_math(layout, rng):
    for _ in range(15):
        pb = rand_problem(rng, layout=layout)
        x, w = inputs(rng, pb)
        assert rel_err(emulate_direct(x, w, pb), direct_ref(x, w, pb)) < 1e-5


def test_size_limits():
    big = A.Problem(1 << 12, 1, 1 << 10, 1 << 10, 1, 1, 1, layout="NHWC")
    with pytest.raises(A.Unavailable, match="2\\*\\*31"):
        A.direct_launch_values(big)
    with pytest.raises(A.Unavailable, match="2\\*\\*31"):
        A.im2col_launch_values(big, 1)


# ------------------------------------------------------------------------------------ layers and CLI
def test_layer_selection():
    r50 = select_layers("resnet50")
    assert len(r50) == 7 and all(l.N == 32 for l in r50)
    assert len(select_layers("resnet50", batch=8)) == 7 and select_layers("resnet50", batch=8)[0].N == 8
    sw = select_layers("sweep")
    assert {l.R for l in sw if l.group == "filter"} == {1, 3, 5, 7, 11}
    assert {l.stride for l in sw if l.group == "filter"} == {1, 2}
    assert {l.N for l in sw if l.group == "batch"} == {1, 8, 32}
    assert {l.C for l in sw if l.group == "channels"} == {16, 32, 64, 128, 256, 512}
    assert len(select_layers("all")) == len(r50) + len(sw)
    assert len(select_layers("sweep", quick=True)) < len(sw)
    assert all("3x3" in l.name for l in select_layers("all", match="3x3"))
    names = [l.name for l in select_layers("all")]
    assert len(set(names)) == len(names)
    with pytest.raises(ValueError, match="unknown group"):
        select_layers("vgg")
    for l in select_layers("all"):
        s = numpy_size(l)
        assert s.N <= 4 and s.C <= 128 and s.H <= max(l.H // 8, l.R)
        s.problem("float32", "NHWC")                    # valid


def _check_outputs(out: Path, backend: str):
    mds, jsons = list(out.glob("compare_*.md")), list(out.glob("compare_*.json"))
    assert len(mds) == 1 and len(jsons) == 1
    md = mds[0].read_text()
    data = json.loads(jsons[0].read_text())
    assert data["backend"] == backend and data["rows"]
    assert "compare" in data["command"] and data["command"] in md
    try:
        import matplotlib  # noqa: F401
        pngs = list(out.glob("compare_*.png"))
        assert len(pngs) == 1 and pngs[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert data["plot"] and str(pngs[0].name) in md
    except ImportError:
        assert "matplotlib" in " ".join(data["notes"])
    return md, data


def test_cli_numpy_backend(tmp_path):
    """``python -m igemm compare --quick --out DIR`` on the numpy backend writes .md, .json and .png."""
    env = dict(os.environ, IGEMM_BACKEND="numpy", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "igemm", "compare", "--quick", "--out", str(tmp_path), "--no-progress"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "numpy backend" in r.stdout and "numpy" in r.stderr
    md, data = _check_outputs(tmp_path, "numpy")
    assert "Ran on the numpy backend" in md
    algos = {row["algorithm"] for row in data["rows"]}
    assert algos == set(A.ALGORITHMS)
    for row in data["rows"]:
        if row["algorithm"] == "cudnn":
            assert row["status"] == "skipped"
        else:
            assert row["status"] == "ok", row
            assert row["time_us"] > 0 and row["max_rel_err"] < 1e-2 and row["extra_bytes"] >= 0
    fft = [r for r in data["rows"] if r["algorithm"] == "fft"]
    im2col = [r for r in data["rows"] if r["algorithm"] == "im2col"]
    assert all(f["extra_bytes"] > 0 for f in fft) and all(i["extra_bytes"] > 0 for i in im2col)


def test_benchmark_script_numpy(tmp_path, numpy_backend):
    """benchmarks/compare_algorithms.py runs the same code (here in-process, a few layers)."""
    rc = compare_main(["--backend", "numpy", "--layers", "resnet50", "--match", "3x3 64->64", "--dtype", "float32",
                       "--layout", "NCHW", "--out", str(tmp_path), "--no-progress",
                       "--algorithms", "im2col,fft,direct"])
    assert rc == 0
    md, data = _check_outputs(tmp_path, "numpy")
    assert [r["algorithm"] for r in data["rows"]] == ["im2col", "fft", "direct"]
    assert data["config"]["layout"] == "NCHW"


def test_cli_list_and_errors(capsys):
    assert compare_main(["--list", "--layers", "resnet50"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 7
    assert compare_main(["--algorithms", "winograd", "--out", "unused"]) == 2
    assert compare_main(["--layers", "resnet50", "--match", "nothing-matches", "--out", "unused"]) == 2


def test_main_registers_subcommand():
    r = subprocess.run([sys.executable, "-m", "igemm", "compare", "--help"], capture_output=True, text=True,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0 and "--mem-cap" in r.stdout


# ------------------------------------------------------------------------------------ compilation (CI)
COMPILE_CASES = [
    ("im2col fp16 NHWC v8", lambda: (A.im2col_stub("float16", "NHWC", 8), A.im2col_name("float16", "NHWC", 8))),
    ("im2col fp32 NCHW", lambda: (A.im2col_stub("float32", "NCHW", 1), A.im2col_name("float32", "NCHW", 1))),
    ("direct bf16 NHWC", lambda: (A.direct_stub("bfloat16", "NHWC"), A.direct_name("bfloat16", "NHWC"))),
    ("direct fp32 NCHW", lambda: (A.direct_stub("float32", "NCHW"), A.direct_name("float32", "NCHW"))),
]


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("label, make", COMPILE_CASES, ids=[c[0] for c in COMPILE_CASES])
def test_kernels_compile(label, make, arch, tmp_path, monkeypatch):
    monkeypatch.setenv("IGEMM_CACHE_DIR", str(tmp_path))
    stub, name = make()
    cubin, _ = _build.compile_cubin(stub, arch, name=name)
    assert cubin[:4] == b"\x7fELF"
    log = next(tmp_path.glob("*.log")).read_text()
    assert "spill" not in log or " 0 bytes spill stores" in log, log


# ------------------------------------------------------------------------------------ GPU
GPU_CASES = [   # (N, C, H, W, K, R, S, stride, padding, dilation)
    (2, 8, 9, 9, 16, 3, 3, 1, 1, 1),
    (1, 3, 17, 15, 8, 7, 7, 2, 3, 1),            # conv1-like, C=3 (narrow im2col loads)
    (2, 16, 8, 8, 24, 1, 1, 1, 0, 1),            # 1x1
    (2, 16, 11, 11, 8, 1, 1, 2, 0, 1),           # 1x1 stride 2
    (3, 5, 10, 7, 7, 3, 2, (2, 1), (1, 0), 1),   # odd everything
    (2, 8, 12, 12, 8, 3, 3, 1, 2, 2),            # dilation 2
    (2, 12, 9, 9, 16, 5, 5, 2, 2, 1),            # 5x5 stride 2
    (1, 16, 13, 13, 4, 11, 11, 1, 5, 1),         # 11x11
    (2, 24, 7, 7, 1, 3, 3, 1, 1, 1),             # K = 1
    (2, 1, 6, 6, 5, 1, 1, 1, 0, 1),              # C = 1, 1x1: a one-column im2col matrix
]


def _gpu_check(torch, name, dtype, layout, case, rng):
    N, C, H, W, K, R, S, st, pd, dl = case
    pb = A.Problem(N, C, H, W, K, R, S, st, pd, dl, dtype, layout)
    x64, w64 = inputs(rng, pb)
    x, w = to_torch(x64, dtype), to_torch(w64, dtype)
    ref = direct_ref(to_numpy(x), to_numpy(w), pb)
    alg = A.make_gpu(name, pb)
    try:
        alg.setup(x, w)
        for _ in range(2):                     # twice: state carried between calls (FFT's C2R operand, ...)
            y = alg()
            torch.cuda.synchronize()
            assert tuple(y.shape) == pb.y_shape and y.dtype == getattr(torch, dtype)
            assert y.is_contiguous()
            err = rel_err(to_numpy(y), ref)
            tol = TOL[dtype] * (10 if (name == "fft" and dtype == "float32") else 1)
            assert err <= tol, f"{name} {pb}: rel err {err:.3g} > {tol}"
    finally:
        alg.close()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", list(A.ALGORITHMS))
def test_gpu_algorithms(name, dtype, layout, rng):
    """Each GPU algorithm against the float64 reference on a small sweep (fp32: FFT rounding allowed 1e-4)."""
    torch = pytest.importorskip("torch")
    if name in ("im2col", "fft"):
        pytest.importorskip("nvmath")
    flags = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for case in GPU_CASES:
            _gpu_check(torch, name, dtype, layout, case, rng)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_bf16_and_tf32(layout, rng):
    torch = pytest.importorskip("torch")
    names = [n for n in A.ALGORITHMS if n not in ("im2col", "fft")]
    try:
        import nvmath  # noqa: F401
        names += ["im2col", "fft"]
    except ImportError:
        pass
    for name in names:
        _gpu_check(torch, name, "bfloat16", layout, GPU_CASES[0], rng)
    for name in ("implicit", "im2col"):
        if name in names:
            N, C, H, W, K, R, S, st, pd, dl = GPU_CASES[0]
            pb = A.Problem(N, C, H, W, K, R, S, st, pd, dl, "float32", layout, "tf32")
            x64, w64 = inputs(rng, pb)
            x, w = to_torch(x64, "float32"), to_torch(w64, "float32")
            alg = A.make_gpu(name, pb)
            alg.setup(x, w)
            y = alg()
            alg.close()
            assert rel_err(to_numpy(y), direct_ref(x64, w64, pb)) <= TOL["tf32"], name


@pytest.mark.gpu
def test_gpu_memory_accounting(rng):
    """Measured extra memory: im2col holds at least its matrix; implicit GEMM reports its split-K workspace."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("nvmath")
    from igemm.baselines.compare import measure_gpu
    pb = A.Problem(4, 64, 14, 14, 64, 3, 3, 1, 1, 1, "float16", "NHWC")
    x64, w64 = inputs(rng, pb)
    x, w = to_torch(x64, "float16"), to_torch(w64, "float16")
    alg = A.make_gpu("im2col", pb)
    y, extra = measure_gpu(torch, alg, x, w)
    alg.close()
    assert extra >= 4 * 14 * 14 * 64 * 9 * 2
    pb7 = A.Problem(2, 512, 7, 7, 512, 3, 3, 1, 1, 1, "float16", "NHWC")
    x = to_torch(rng.standard_normal(pb7.x_shape), "float16")
    w = to_torch(rng.standard_normal(pb7.w_shape) / 48, "float16")
    alg = A.make_gpu("implicit", pb7)
    y, extra = measure_gpu(torch, alg, x, w)
    assert extra == alg.outside_bytes
    if alg.plan.spec().splits > 1:
        assert extra > 0


@pytest.mark.gpu
def test_gpu_compare_end_to_end(tmp_path):
    """The comparison itself on the GPU (a few layers): every algorithm runs, files are written."""
    pytest.importorskip("torch")
    rc = compare_main(["--quick", "--layers", "resnet50,filter", "--match", "3x3 64->64,filter 5x5,filter 11x11",
                       "--out", str(tmp_path), "--no-progress"])
    md, data = _check_outputs(tmp_path, "cuda")
    errors = [r for r in data["rows"] if r["status"] == "error"]
    assert rc == 0 and not errors, errors
    try:
        import nvmath  # noqa: F401
        assert all(r["status"] == "ok" for r in data["rows"]), [r for r in data["rows"] if r["status"] != "ok"]
    except ImportError:
        pass
    for r in data["rows"]:
        if r["status"] == "ok":
            assert r["time_us"] > 0 and r["max_rel_err"] < 2e-2, r
