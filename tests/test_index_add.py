import importlib
import shutil

import numpy as np
import pytest

import igemm
from igemm import _build, reference

from helpers import TOL, rel_err, to_numpy

ia = importlib.import_module("igemm.index_add")   # the module (igemm.index_add is the function)


def _naive(x, dim, index, source, alpha):
    """Loop reference, independent of np.add.at/moveaxis."""
    out = np.array(x, dtype=np.float64)
    src = np.asarray(source, dtype=np.float64)
    if out.ndim == 0:
        return out + alpha * src
    dim %= out.ndim
    for i, d in enumerate(np.asarray(index).reshape(-1)):
        sl_x = [slice(None)] * out.ndim
        sl_s = [slice(None)] * out.ndim
        sl_x[dim], sl_s[dim] = int(d), i
        out[tuple(sl_x)] += alpha * src[tuple(sl_s)]
    return out


def _case(rng, shape, dim, n_index, dup=True, idtype=np.int64):
    x = rng.standard_normal(shape)
    size = shape[dim]
    index = rng.integers(0, size, n_index) if dup else rng.permutation(size)[:n_index]
    sshape = list(shape)
    sshape[dim] = n_index
    return x, index.astype(idtype), rng.standard_normal(sshape)


SHAPES = [((7,), 0, 5), ((7,), -1, 12), ((4, 5), 0, 3), ((4, 5), 1, 9), ((3, 4, 5), 1, 6), ((3, 4, 5), -1, 2),
          ((2, 3, 4, 5), 2, 7), ((2, 3, 1, 5, 2), 3, 4), ((2, 3, 4, 5), -4, 1)]


# ------------------------------------------------------------------------------------------ reference
@pytest.mark.parametrize("shape, dim, n", SHAPES)
def test_reference_matches_loops(shape, dim, n, rng):
    x, idx, src = _case(rng, shape, dim, n)
    np.testing.assert_allclose(reference.index_add(x, dim, idx, src, 0.5), _naive(x, dim, idx, src, 0.5), rtol=1e-12)


def test_reference_errors(rng):
    x = rng.standard_normal((4, 3))
    with pytest.raises(IndexError, match=r"index\[1\] = 4"):
        reference.index_add(x, 0, np.array([0, 4]), np.ones((2, 3)))
    with pytest.raises(IndexError, match=r"index\[0\] = -1"):
        reference.index_add(x, 0, np.array([-1, 2]), np.ones((2, 3)))
    with pytest.raises(ValueError):
        reference.index_add(x, 0, np.array([0, 1]), np.ones((2, 4)))
    assert reference.first_bad_index(np.array([0, 1, 2]), 3) is None
    assert reference.first_bad_index(np.array([0, 5, -2]), 3) == (1, 5)


def test_collapse():
    assert reference.collapse_index_add((2, 3, 4, 5), 0) == (1, 2, 60)
    assert reference.collapse_index_add((2, 3, 4, 5), 2) == (6, 4, 5)
    assert reference.collapse_index_add((2, 3, 4, 5), 3) == (24, 5, 1)
    assert reference.collapse_index_add((), 0) == (1, 1, 1)


# ------------------------------------------------------------------------------------------ dispatch
def test_choose_config_bench_cases():
    M = 1024 * 1024
    assert ia.choose_config(1, 32 * M, 1, 15, "float32").kernel == "many"
    assert ia.choose_config(1, 32 * 1024, 1024, 15, "float32").kernel == "many"
    c = ia.choose_config(1, 32, M, 15, "float32")
    assert c == ia.IndexAddConfig("sweep", 4, False)
    assert ia.choose_config(1, 32 * M, 1, 1024, "float32") == ia.IndexAddConfig("many", 1, False)
    assert ia.choose_config(1, 32 * 1024, 1024, 1024, "float16") == ia.IndexAddConfig("many", 8, False)
    # wide (64-bit division) exactly when a dividend reaches 2**31
    assert not ia.choose_config(1, 4, 2 ** 31 - 1, 1, "float32").wide
    assert ia.choose_config(1, 4, 2 ** 31 + 1, 1, "float32") == ia.IndexAddConfig("sweep", 1, True)
    assert ia.choose_config(2, 4, 2 ** 30, 40, "float32", vec=1).wide
    assert not ia.choose_config(2, 4, 2 ** 20, 40, "float32", vec=1).wide


def test_choose_config_deterministic():
    assert ia.choose_config(1, 32, 1 << 20, 15, "float32", deterministic=True).kernel == "sweep"
    assert ia.choose_config(1, 100, 1, 3, "float32", deterministic=True).kernel == "sweep"
    c = ia.choose_config(1, 100, 1, 15, "float32", deterministic=True)
    assert c.kernel == "sort" and c.lanes == 1
    c = ia.choose_config(1, 100, 1024, 1000, "bfloat16", deterministic=True)
    assert c == ia.IndexAddConfig("sort", 8, False, 32)
    with pytest.raises(NotImplementedError):
        ia.choose_config(1, 2 ** 40, 1, 2 ** 30, "float32", deterministic=True)


def test_max_vec():
    assert ia.max_vec("float32", 1024, 0, 256) == 4
    assert ia.max_vec("float32", 1024, 8, 256) == 2
    assert ia.max_vec("float16", 1024, 0, 2) == 1
    assert ia.max_vec("float16", 12, 0, 0) == 4
    assert ia.max_vec("bfloat16", 7, 0, 0) == 1


def _emulate_sort(index, size):
    """The device sort, step by step (sort_tile rank-sort, then sort_merge levels), in Python."""
    n = len(index)
    pos_bits = ia.sort_pos_bits(n)
    keys = [((int(d) if 0 <= d < size else size) << pos_bits) | i for i, d in enumerate(index)]
    out = [None] * n
    for base in range(0, n, 256):
        tile = keys[base:base + 256]
        for k in tile:
            out[base + sum(j < k for j in tile)] = k
    log2w = 8
    while (1 << log2w) < n:
        w, src, out = 1 << log2w, out, [None] * n
        for g in range(n):
            base = (g >> (log2w + 1)) << (log2w + 1)
            mid, end = min(base + w, n), min(base + 2 * w, n)
            key = src[g]
            if g < mid:
                out[g + sum(k < key for k in src[mid:end])] = key
            else:
                out[base + (g - mid) + sum(k < key for k in src[base:mid])] = key
        log2w += 1
    return out, pos_bits


@pytest.mark.parametrize("n", [1, 5, 256, 257, 700, 1100])
def test_sort_algorithm(n, rng):
    index = rng.integers(-2, 40, n)
    keys, pos_bits = _emulate_sort(index, 37)
    assert keys == sorted(keys)
    pos = [k & ((1 << pos_bits) - 1) for k in keys]
    assert sorted(pos) == list(range(n))
    # segments hold equal indices, positions ascending: the accumulation order is the index order
    d = [k >> pos_bits for k in keys]
    for a, b, pa, pb in zip(d, d[1:], pos, pos[1:]):
        assert a < b or (a == b and pa < pb)


# ------------------------------------------------------------------------------------------ numpy backend / API
@pytest.mark.parametrize("shape, dim, n", SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_numpy_backend(shape, dim, n, dtype, numpy_backend, rng):
    x, idx, src = _case(rng, shape, dim, n, idtype=np.int32)
    x, src = x.astype(dtype), src.astype(dtype)
    ref = reference.index_add(x, dim, idx, src, 2.0)
    out = igemm.index_add(x, dim, idx, src, alpha=2.0)
    assert out is x
    assert rel_err(x, ref) <= TOL[dtype]


def test_numpy_backend_0d(numpy_backend):
    x = np.array(1.5, np.float32)
    igemm.index_add(x, 0, np.array([0]), np.array(2.0, np.float32))
    assert float(x) == 3.5
    igemm.index_add(x, -1, np.array(0), np.array(1.0, np.float32), alpha=-1)
    assert float(x) == 2.5


def test_docstring_example(numpy_backend):
    x = np.zeros((3, 2), np.float32)
    igemm.index_add(x, 0, np.array([2, 0, 2]), np.ones((3, 2), np.float32), alpha=2)
    assert x.tolist() == [[2.0, 2.0], [0.0, 0.0], [4.0, 4.0]]


@pytest.mark.parametrize("bad, pos", [([0, 4, 1], 1), ([0, 1, -1], 2), ([7, 0, 0], 0)])
@pytest.mark.parametrize("check_index", [True, False])
def test_bad_index_numpy(bad, pos, check_index, numpy_backend, rng):
    x = rng.standard_normal((4, 5)).astype(np.float32)
    keep = x.copy()
    with pytest.raises(IndexError, match=rf"index\[{pos}\] = {bad[pos]} is out of range for dimension 0"):
        igemm.index_add(x, 0, np.array(bad, np.int32), np.ones((3, 5), np.float32), check_index=check_index)
    np.testing.assert_array_equal(x, keep)


def test_round_alpha():
    assert ia._round_alpha(0.1, "float16") == float(np.float16(0.1))
    assert ia._round_alpha(1.0 + 2 ** -9, "bfloat16") == 1.0          # ties to even
    assert ia._round_alpha(1.0 + 3 * 2 ** -9, "bfloat16") == 1.0 + 2 ** -7
    assert ia._round_alpha(-3.0, "bfloat16") == -3.0
    assert ia._round_alpha(float("inf"), "bfloat16") == float("inf")


def test_all_stubs_cover_dispatch():
    """Every kernel a call can launch is in all_stubs (what precompile() compiles), under its runtime name."""
    stubs = dict((stub, name) for name, stub in ia.all_stubs())
    for dtype in ("float32", "float16", "bfloat16"):
        for idtype in ("int32", "int64"):
            for det in (False, True):
                for outer, size, inner, n in [(1, 32, 1 << 20, 15), (1, 100, 1, 1000), (3, 5, 7, 3), (1, 4, 2 ** 31 + 1, 2),
                                              (2, 9, 40, 700)]:
                    for vec in (1, 2, 4) if dtype == "float32" else (1, 2, 4, 8):
                        if inner % vec:
                            continue
                        cfg = ia.choose_config(outer, size, inner, n, dtype, deterministic=det, vec=vec)
                        for kind, stub in ia.stubs_for(cfg, dtype, idtype):
                            assert stubs.get(stub) == f"index_add_{kind}", (cfg, kind)


# ------------------------------------------------------------------------------------------ compile (CI)
COMPILE = [(ia.IndexAddConfig("few", 4), "float32", "int64"), (ia.IndexAddConfig("many", 8, True), "bfloat16", "int32"),
           (ia.IndexAddConfig("sort", 8, lanes=32), "float16", "int64")]


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("cfg, dtype, idtype", COMPILE, ids=["few-f32", "many-bf16-wide", "sort-f16"])
def test_kernels_compile(cfg, dtype, idtype, arch, tmp_path, monkeypatch):
    monkeypatch.setenv("IGEMM_CACHE_DIR", str(tmp_path))
    for kind, stub in ia.stubs_for(cfg, dtype, idtype, check=cfg.kernel == "few"):
        cubin, _ = _build.compile_cubin(stub, arch, name=f"index_add_{kind}")
        assert cubin[:4] == b"\x7fELF"
    for log in tmp_path.glob("*.log"):
        text = log.read_text()
        assert "spill" not in text or " 0 bytes spill stores" in text, text


# ------------------------------------------------------------------------------------------ GPU
def _torch():
    return pytest.importorskip("torch")


@pytest.fixture
def force(monkeypatch):
    """force(kernel, **kw): make the dispatcher pick ``kernel`` (vec/wide/lanes kept valid)."""
    def apply(kernel):
        orig = ia.choose_config

        def chooser(outer, size, inner, n_index, dtype, *, deterministic=False, sms=132, vec=None):
            c = orig(outer, size, inner, n_index, dtype, deterministic=deterministic, sms=sms, vec=vec)
            kv = inner // c.vec
            if kernel in ("few", "sweep"):
                assert n_index <= ia.FEW_MAX
                return ia.IndexAddConfig(kernel, c.vec, wide=outer * kv >= 2 ** 31)
            if kernel == "many":
                return ia.IndexAddConfig("many", c.vec, wide=outer * n_index * kv >= 2 ** 31)
            return ia.IndexAddConfig("sort", c.vec, lanes=32 if kv >= 16 else 1)
        monkeypatch.setattr(ia, "choose_config", chooser)
        ia._plan.cache_clear()
    yield apply
    ia._plan.cache_clear()


def _gpu_case(torch, rng, shape, dim, n, dtype, idtype, dup=True):
    x64, idx, s64 = _case(rng, shape, dim, n, dup=dup, idtype=np.int32 if idtype == "int32" else np.int64)
    x = torch.from_numpy(x64).to("cuda", getattr(torch, dtype))
    src = torch.from_numpy(s64).to("cuda", getattr(torch, dtype))
    index = torch.from_numpy(idx).cuda()
    return x, index, src


GPU_SHAPES = SHAPES + [((1000,), 0, 15), ((64, 33), 0, 100), ((5, 64, 40), 1, 70), ((3, 7, 1024), 1, 5),
                       ((2, 2, 3, 4, 5, 6), 4, 9), ((300, 128), 0, 1000), ((6, 5000), 1, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_sweep_distinct_and_duplicate_indices_gpu(dtype, force, rng):
    """The default few-index kernel (sweep) has a distinct-indices path (all loads of a window before its
    stores) and an in-order path for duplicates; both against the reference, untouched rows bit-exact."""
    torch = _torch()
    force("sweep")                                   # the default only for >= 4 columns per thread of the GPU
    for dup in (False, True):
        for shape, dim, n in (((32, 4096), 0, 15), ((3, 40, 520), 1, 32), ((16, 8), 0, 9), ((64, 1 << 16), 0, 17)):
            x, index, src = _gpu_case(torch, rng, shape, dim, n, dtype, "int64", dup=dup)
            if dup:
                index[-1] = index[0]                 # at least one duplicate, in different windows of 8
                index[1] = index[0]
            else:
                assert len(set(index.tolist())) == n
            size = shape[dim]
            x0 = x.clone()
            ref = reference.index_add(to_numpy(x0), dim, index.cpu().numpy(), to_numpy(src), 1.0)
            igemm.index_add(x, dim, index, src)
            what = f"{dtype} dup={dup} x{shape} dim {dim} n {n}"
            assert rel_err(to_numpy(x), ref) <= TOL[dtype] * (1 if dtype == "float32" else 2), what
            untouched = np.setdiff1d(np.arange(size), index.cpu().numpy())
            u = torch.from_numpy(untouched).cuda()
            assert torch.equal(x.index_select(dim, u), x0.index_select(dim, u)), what


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [None, "few", "many", "sweep", "sort"])
@pytest.mark.parametrize("idtype", ["int32", "int64"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_index_add_gpu(dtype, idtype, kernel, force, rng):
    torch = _torch()
    deterministic = kernel in ("sweep", "sort")
    if kernel:
        force(kernel)
    for shape, dim, n in GPU_SHAPES:
        if kernel in ("few", "sweep") and n > ia.FEW_MAX:
            continue
        x, index, src = _gpu_case(torch, rng, shape, dim, n, dtype, idtype)
        alpha = float(rng.choice([1.0, -0.5, 3.0]))
        x0 = x.clone()
        expect_t = x0.clone().index_add_(dim, index, src, alpha=alpha)
        ref = reference.index_add(to_numpy(x0), dim, index.cpu().numpy(), to_numpy(src), ia._round_alpha(alpha, dtype))
        out = igemm.index_add(x, dim, index, src, alpha=alpha, deterministic=deterministic)
        assert out is x
        what = f"{dtype}/{idtype} {kernel} x{shape} dim {dim} n {n}"
        tol = TOL[dtype] * (1 if dtype == "float32" else 2)
        assert rel_err(to_numpy(x), ref) <= tol, what
        assert rel_err(to_numpy(x), to_numpy(expect_t)) <= tol, what
        # rows no index names are untouched, bit for bit
        untouched = np.setdiff1d(np.arange(shape[dim]), index.cpu().numpy())
        if untouched.size:
            u = torch.from_numpy(untouched).cuda()
            assert torch.equal(x.index_select(dim, u), x0.index_select(dim, u)), what
        if deterministic:
            x2 = x0.clone()
            igemm.index_add(x2, dim, index, src, alpha=alpha, deterministic=True)
            assert torch.equal(x2, x), f"{what}: not deterministic"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_index_add_heavy_duplicates_gpu(dtype, rng):
    """Thousands of indices on a handful of rows: atomics and the deterministic sort path."""
    torch = _torch()
    for shape, dim, n in [((7,), 0, 5000), ((5, 33), 0, 3000), ((2, 6, 64), 1, 700)]:
        x, index, src = _gpu_case(torch, rng, shape, dim, n, dtype, "int64")
        src /= 30
        x0 = x.clone()
        ref = reference.index_add(to_numpy(x0), dim, index.cpu().numpy(), to_numpy(src))
        # atomics accumulate in the storage precision: hundreds of roundings per row for fp16/bf16
        tol = {"float32": 1e-5, "float16": 5e-2, "bfloat16": 3e-1}[dtype]
        igemm.index_add(x, dim, index, src)
        assert rel_err(to_numpy(x), ref) <= tol
        runs = []
        for _ in range(3):
            xd = x0.clone()
            igemm.index_add(xd, dim, index, src, deterministic=True)
            runs.append(xd)
        assert rel_err(to_numpy(runs[0]), ref) <= (1e-5 if dtype == "float32" else 1e-2)
        assert all(torch.equal(r, runs[0]) for r in runs[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("idtype", ["int32", "int64"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_bad_index_gpu(idtype, deterministic, rng):
    torch = _torch()
    x, index, src = _gpu_case(torch, rng, (6, 40), 0, 20, "float32", idtype)
    x0 = x.clone()
    for pos, val in [(3, 6), (19, -1), (0, 2 ** 31 - 1 if idtype == "int32" else 2 ** 40)]:
        bad = index.clone()
        bad[pos] = val
        if pos != 19:
            bad[19] = 7  # a later bad one: the first is reported
        with pytest.raises(IndexError, match=rf"index\[{pos}\] = {val} is out of range for dimension 0"):
            igemm.index_add(x, 0, bad, src, deterministic=deterministic)
        torch.cuda.synchronize()
        assert torch.equal(x, x0), "x was modified"
        # the context is fine: the same call with good indices works, and so does torch
        igemm.index_add(x, 0, index, src, deterministic=deterministic)
        ref = reference.index_add(to_numpy(x0), 0, index.cpu().numpy(), to_numpy(src))
        assert rel_err(to_numpy(x), ref) <= 1e-5
        x.copy_(x0)
        assert float((x0 * 2).sum()) == pytest.approx(float(x0.sum()) * 2, rel=1e-5)
    # unchecked: bad rows are dropped, never a fault
    bad = index.clone()
    bad[::3] = 1000
    bad[1] = -5
    igemm.index_add(x, 0, bad, src, check_index=False, deterministic=deterministic)
    torch.cuda.synchronize()
    keep = (bad >= 0) & (bad < 6)
    ref = reference.index_add(to_numpy(x0), 0, bad[keep].cpu().numpy(), to_numpy(src[keep]))
    assert rel_err(to_numpy(x), ref) <= 1e-5


@pytest.mark.gpu
def test_bad_index_fast_path_gpu(rng):
    """Same geometry twice (the second call takes the cached torch path), then bad indices there."""
    torch = _torch()
    x, index, src = _gpu_case(torch, rng, (50, 16), 0, 40, "float16", "int64")
    x0 = x.clone()
    igemm.index_add(x, 0, index, src)
    igemm.index_add(x, 0, index, src)
    ref = reference.index_add(to_numpy(x0), 0, np.concatenate([index.cpu().numpy()] * 2),
                              np.concatenate([to_numpy(src)] * 2))
    assert rel_err(to_numpy(x), ref) <= 2e-2
    x1 = x.clone()
    bad = index.clone()
    bad[7] = 50
    with pytest.raises(IndexError, match=r"index\[7\] = 50"):
        igemm.index_add(x, 0, bad, src)
    assert torch.equal(x, x1)
    with pytest.raises(ValueError, match="contiguous"):
        igemm.index_add(x, 0, index, torch.empty(16, 40, dtype=x.dtype, device="cuda").t())


@pytest.mark.gpu
def test_index_add_rejects_gpu(rng):
    torch = _torch()
    x, index, src = _gpu_case(torch, rng, (8, 6), 1, 4, "float32", "int64")
    with pytest.raises(ValueError, match="x: must be contiguous"):
        igemm.index_add(x.t(), 0, index, src.t().contiguous())
    with pytest.raises(ValueError, match="source: must be contiguous"):
        igemm.index_add(x, 1, index, torch.empty(4, 8, device="cuda").t())
    with pytest.raises(ValueError, match="index: must be contiguous"):
        igemm.index_add(x, 1, torch.arange(8, device="cuda")[::2], src)
    with pytest.raises(IndexError, match="index: expected a 1-D"):
        igemm.index_add(x, 1, index.reshape(2, 2), src)
    with pytest.raises(ValueError, match="overlap"):
        igemm.index_add(x, 1, index, x.view(-1)[:32].view(8, 4))
    with pytest.raises(TypeError, match="source"):
        igemm.index_add(x, 1, index, src.half())


@pytest.mark.gpu
def test_index_add_numpy_inputs_gpu(rng):
    x, idx, src = _case(rng, (9, 4, 3), 1, 11)
    x, src = x.astype(np.float32), src.astype(np.float32)
    ref = reference.index_add(x, 1, idx, src, 0.5)
    igemm.index_add(x, 1, idx, src, alpha=0.5)
    assert rel_err(x, ref) <= 1e-5
    keep = x.copy()
    with pytest.raises(IndexError, match=r"index\[2\] = 4"):
        igemm.index_add(x, 1, np.array([0, 1, 4] + [0] * 8), src)
    np.testing.assert_array_equal(x, keep)


@pytest.mark.gpu
def test_index_add_stream_and_unaligned_gpu(rng):
    torch = _torch()
    x, index, src = _gpu_case(torch, rng, (40, 33), 0, 300, "float32", "int64")
    x0 = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        igemm.index_add(x, 0, index, src, stream=s)
        igemm.index_add(x, 0, index, src, stream=s, deterministic=True)
    s.synchronize()
    ref = reference.index_add(to_numpy(x0), 0, np.tile(index.cpu().numpy(), 2), np.concatenate([to_numpy(src)] * 2))
    assert rel_err(to_numpy(x), ref) <= 1e-5
    # odd offsets: packs of 1
    big = torch.randn(41 * 33 + 1, device="cuda")
    xv = big[1:].view(41, 33)
    xv0 = xv.clone()
    igemm.index_add(xv, 0, index % 41, src)
    ref = reference.index_add(to_numpy(xv0), 0, (index % 41).cpu().numpy(), to_numpy(src))
    assert rel_err(to_numpy(xv), ref) <= 1e-5


@pytest.mark.gpu
def test_index_add_0d_and_empty_gpu():
    torch = _torch()
    x = torch.tensor(1.5, device="cuda")
    igemm.index_add(x, 0, torch.tensor([0], device="cuda"), torch.tensor(2.0, device="cuda"))
    assert float(x) == 3.5
    x = torch.ones(4, 0, device="cuda")
    igemm.index_add(x, 0, torch.tensor([1, 3], device="cuda"), torch.ones(2, 0, device="cuda"))
    x = torch.ones(4, 3, device="cuda")
    igemm.index_add(x, 0, torch.zeros(0, dtype=torch.int64, device="cuda"), torch.ones(0, 3, device="cuda"))
    assert float(x.sum()) == 12
    with pytest.raises(IndexError):
        igemm.index_add(torch.ones(0, 3, device="cuda"), 0, torch.tensor([0], device="cuda"),
                        torch.ones(1, 3, device="cuda"))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("kernel", [None, "many", "sort"])
def test_index_add_over_2_31_gpu(kernel, force):
    """x and source past 2**31 elements (fp16): 64-bit offsets and the wide (64-bit division) kernels."""
    torch = _torch()
    if kernel:
        force(kernel)
    K = 2 ** 31 + 5                                                    # odd: packs of 1
    x = torch.ones(3, K, dtype=torch.float16, device="cuda")           # 12.9 GB
    src = torch.empty(2, K, dtype=torch.float16, device="cuda")
    pattern = torch.arange(7, dtype=torch.float16, device="cuda").repeat(K // 7 + 1)[:K]
    src[0].fill_(2.0)
    src[1].copy_(pattern)
    index = torch.tensor([2, 0], device="cuda")
    igemm.index_add(x, 0, index, src, deterministic=kernel == "sort")
    torch.cuda.synchronize()
    assert float(x[2].min()) == 3.0 and float(x[2].max()) == 3.0
    assert bool((x[0] == pattern + 1).all())
    assert float(x[1].min()) == 1.0 and float(x[1].max()) == 1.0
    del x, src
    # 1-D x past 2**31, indices near the end
    n = 2 ** 31 + 100
    x = torch.zeros(n, dtype=torch.float16, device="cuda")
    idx = torch.tensor([n - 1, 5, n - 100, n - 1], device="cuda")
    igemm.index_add(x, 0, idx, torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float16, device="cuda"),
                    deterministic=kernel == "sort")
    assert x[n - 1].item() == 5.0 and x[5].item() == 2.0 and x[n - 100].item() == 3.0
    assert float(x.float().sum()) == 10.0
