"""Bad input (issue 38, items 8-10): each kind of wrong argument is a clear error naming the argument, raised
before anything is written or launched; valid-but-unusual input (empty tensors, zero-sized dims, NaN/Inf,
misaligned views, in place) gives the reference's answer. Never a crash, never a partial write.

* The bad-input table lives in ``tests/validation_rows/`` (one module per family; the row format and how to
  add one are in its ``__init__``). One runner, two tiers: numpy arrays on the numpy backend here, CUDA
  tensors (torch) on the GPU, same rows. Every array argument is snapshotted first (outputs pre-filled with a
  sentinel) and must be bit-identical afterwards; on the GPU nothing may be launched (rows marked
  ``launches`` excepted: index_add's documented index-check kernel) and the context stays usable.
* ``test_item<N>_*``: one test per defect of issue 38 (items 8, 9, 10) for the standalone families.
* ``OK``: valid inputs at the edges, checked against numpy's IEEE semantics / the float64 reference.
"""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

import igemm
from igemm import epilogues as ep
from igemm import reference
from igemm.conv import Conv2dPlan
from igemm.reference.epilogue import apply_chain

from helpers import TOL, rel_err, to_numpy
from validation_rows import NAN, INF, NumpyArrays, TorchArrays, all_rows, watched
from validation_rows.conv import PENDING as CONV_PENDING

ROWS = all_rows()
CPU_ROWS = [r for r in ROWS if r.where != "gpu"]
GPU_ROWS = [r for r in ROWS if r.where != "cpu"]
# Rows seen failing on a GPU and not fixed yet: id -> what was seen (marked xfail(strict) below).
KNOWN_GPU_BUGS: dict = {}


# ============================================================================================== the table
def test_table_size():
    """>= 200 distinct bad-input rows over all families, >= 130 of them outside conv."""
    ids = [r.id for r in ROWS]
    assert len(set(ids)) == len(ids), sorted({i for i in ids if ids.count(i) > 1})
    assert len(ids) >= 200 and sum(not i.startswith("conv/") for i in ids) >= 130, len(ids)


def _names_arg(row, msg: str) -> bool:
    """The message starts with the argument's name (``row.anywhere``: names it somewhere, as a word)."""
    pat = rf"(?<![\w.]){re.escape(row.arg)}(?![\w])"
    return bool(re.search(pat, msg) if row.anywhere else re.match(pat, msg))


def _expect_error(A, row, launches=None):
    """Make the call, check the exception, the message and that no byte of any watched array changed."""
    call = row.build(A)
    arrays = watched(A, call)
    A.sync()
    snaps = [A.snapshot(a) for a in arrays]
    if launches is not None:
        launches.clear()
    with pytest.raises(row.exc) as info:
        call()
    n_launched = len(launches) if launches is not None else 0
    A.sync()                                       # an asynchronous fault would surface here
    msg = str(info.value)
    assert _names_arg(row, msg), f"{row.id}: the message does not name {row.arg!r}: {msg!r}"
    if row.match:
        assert re.search(row.match, msg), f"{row.id}: {row.match!r} not in {msg!r}"
    if launches is not None and not row.launches:
        assert n_launched == 0, f"{row.id}: {n_launched} kernel(s) launched before the error"
    for a, s in zip(arrays, snaps):
        assert A.same(a, s), f"{row.id}: an argument was written before the error"


def _pending(row, request, gpu: bool = False) -> None:
    reason = CONV_PENDING.get(row.id) or (KNOWN_GPU_BUGS.get(row.id) if gpu else None)
    if reason:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))


@pytest.mark.parametrize("row", CPU_ROWS, ids=[r.id for r in CPU_ROWS])
def test_bad_input_numpy(row, numpy_backend, request):
    _pending(row, request)
    _expect_error(NumpyArrays(), row)


@pytest.fixture
def launches(monkeypatch):
    """Records every kernel launch (igemm launches through _kernel.Launcher, every family)."""
    from igemm import _kernel
    seen = []
    orig = _kernel.Launcher.__call__

    def record(self, stream, args):
        seen.append(self)
        return orig(self, stream, args)
    monkeypatch.setattr(_kernel.Launcher, "__call__", record)
    return seen


def _context_is_healthy(A) -> None:
    y = A.randn((100,), "float32", 99)
    m = igemm.relu_mask(y)
    A.sync()
    np.testing.assert_array_equal(A.host_words(m), reference.pack_mask(A.host(y) > 0))


@pytest.mark.gpu
@pytest.mark.parametrize("row", GPU_ROWS, ids=[r.id for r in GPU_ROWS])
def test_bad_input_gpu(row, launches, request):
    pytest.importorskip("torch")
    if row.multigpu:
        import torch
        if torch.cuda.device_count() < 2:
            pytest.skip("needs two CUDA GPUs")
    _pending(row, request, gpu=True)
    A = TorchArrays()
    _expect_error(A, row, launches)
    _context_is_healthy(A)


# ============================================================================================== issue 38, items 8-10
# One test per defect, on the numpy backend (the GPU runs the same checks: the table's GPU tier).
def _c3(v=0.0):
    return np.full(3, v, np.float32)


def _x4():
    return np.random.default_rng(30).standard_normal((2, 3, 4, 4)).astype(np.float32)


def test_item8_batch_norm_relu_readonly_mask_out_writes_nothing(numpy_backend):
    out, mask_out = np.full((2, 3, 4, 4), np.nan, np.float32), np.zeros(3, np.uint32)
    mask_out.flags.writeable = False
    with pytest.raises(ValueError, match="^mask_out: .*read-only"):
        igemm.batch_norm_relu(_x4(), _c3(), _c3(1.0), out=out, mask_out=mask_out)
    assert np.isnan(out).all()


def test_item8_batch_norm_stats_running_var_readonly_writes_nothing(numpy_backend):
    rm, rv = _c3(0.0), _c3(1.0)
    rv.flags.writeable = False
    with pytest.raises(ValueError, match="^running_var: .*read-only"):
        igemm.batch_norm_stats(_x4(), 1e-5, running_mean=rm, running_var=rv)
    assert rm.tolist() == [0.0] * 3


def test_item8_welford_count_readonly_writes_nothing(numpy_backend):
    mean, var, count = _c3(np.nan), _c3(np.nan), _c3(np.nan)
    count.flags.writeable = False
    with pytest.raises(ValueError, match="^out.count: .*read-only"):
        igemm.welford(_x4(), out=(mean, var, count))
    assert np.isnan(mean).all() and np.isnan(var).all()


def test_item8_welford_one_array_for_three_outputs_refused(numpy_backend):
    o = _c3(np.nan)
    with pytest.raises(ValueError, match="^out.mean and out.var overlap"):
        igemm.welford(_x4(), out=(o, o, o))
    assert np.isnan(o).all()


def test_item8_overlap_refused_on_the_numpy_backend_too(numpy_backend):
    buf = np.arange(65, dtype=np.float32)
    with pytest.raises(ValueError, match="^out and dy overlap"):
        igemm.relu_backward(buf[:64], np.full(2, 0xFFFFFFFF, np.uint32), out=buf[1:])
    assert buf.tolist() == list(range(65))
    igemm.relu_backward(buf[:64], np.full(2, 0xFFFFFFFF, np.uint32), out=buf[:64])    # exactly in place: fine


def test_item8_index_add_readonly_x_refused_by_name(numpy_backend):
    x = np.zeros((5, 4), np.float32)
    x.flags.writeable = False
    with pytest.raises(ValueError, match="^x: .*read-only"):
        igemm.index_add(x, 0, np.array([0, 1]), np.ones((2, 4), np.float32))


def test_item8_unaligned_output_refused(numpy_backend):
    out = NumpyArrays().unaligned((64,))
    with pytest.raises(ValueError, match="^out: .*aligned"):
        igemm.relu_backward(np.ones(64, np.float32), np.zeros(2, np.uint32), out=out)
    assert np.isnan(out).all()


def test_item9_batch_norm_relu_mask_out_without_return_mask_refused(numpy_backend):
    m = np.full(3, 0xAAAAAAAA, np.uint32)
    with pytest.raises(ValueError, match="^mask_out: given but return_mask is False"):
        igemm.batch_norm_relu(_x4(), _c3(), _c3(1.0), return_mask=False, mask_out=m)
    assert (m == 0xAAAAAAAA).all()


def test_item9_backward_reduce_out_for_unrequested_gradient_refused(numpy_backend):
    outs = tuple(_c3(np.nan) for _ in range(4))
    x = _x4()
    with pytest.raises(ValueError, match="^out.grad_weight: given but weight_g is False"):
        igemm.batch_norm_backward_reduce(x, x, _c3(), _c3(1.0), weight_g=False, out=outs)
    assert all(np.isnan(o).all() for o in outs)


def test_item9_flags_are_bools_not_truthy_values(numpy_backend):
    x = np.zeros((5, 4), np.float32)
    with pytest.raises(TypeError, match="^deterministic: expected True or False"):
        igemm.index_add(x, 0, np.array([0]), np.ones((1, 4), np.float32), deterministic="no")
    with pytest.raises(TypeError, match="^return_mask"):
        igemm.batch_norm_relu(_x4(), _c3(), _c3(1.0), return_mask="no")
    assert not x.any()


def test_item9_stream_checked_on_the_numpy_backend(numpy_backend):
    with pytest.raises(TypeError, match="^stream"):
        igemm.relu_backward(np.ones(64, np.float32), np.zeros(2, np.uint32), stream="default")
    with pytest.raises(TypeError, match="^stream"):
        igemm.welford(_x4(), stream=1.5)


@pytest.mark.gpu
def test_item9_index_add_fast_path_refuses_what_the_generic_path_refuses_gpu():
    """A repeated torch call takes index_add's fast path; a flag or dim of the wrong type still goes to the
    checks (nothing launched, x unchanged) instead of being taken as truthy."""
    torch = pytest.importorskip("torch")
    x = torch.zeros(5, 4, device="cuda")
    idx, src = torch.tensor([0, 2], device="cuda"), torch.ones(2, 4, device="cuda")
    igemm.index_add(x, 0, idx, src)
    igemm.index_add(x, 0, idx, src)                 # the geometry is remembered: the fast path
    keep = x.clone()
    for kw, name in ((dict(check_index=1), "check_index"), (dict(deterministic=0), "deterministic")):
        with pytest.raises(TypeError, match=f"^{name}"):
            igemm.index_add(x, 0, idx, src, **kw)
    with pytest.raises(TypeError, match="^dim"):
        igemm.index_add(x, 0.0, idx, src)
    torch.cuda.synchronize()
    assert torch.equal(x, keep)


@pytest.mark.parametrize("call, name", [
    (lambda: igemm.relu_backward(np.ones(4, np.float32), None), "mask"),
    (lambda: igemm.relu_backward(None, np.zeros(1, np.uint32)), "dy"),
    (lambda: igemm.relu_mask(None), "y"),
    (lambda: igemm.index_add(np.zeros((3, 2), np.float32), 0, None, np.ones((1, 2), np.float32)), "index"),
    (lambda: igemm.index_add(None, 0, np.array([0]), np.ones((1, 2), np.float32)), "x"),
    (lambda: igemm.prelu(None, 0.25), "x"),
    (lambda: igemm.batch_norm_relu(_x4(), None, _c3(1.0)), "mean"),
    (lambda: igemm.batch_norm_backward_elemt(_x4(), _x4(), _c3(), _c3(1.0), None, None, _c3(), 32), "sum_dy"),
    (lambda: igemm.batch_norm_gather_stats(np.ones((2, 3)), None, np.ones(2)), "vars"),
    (lambda: igemm.sync_batch_norm_backward_reduce(_x4(), _x4(), _c3(), None), "invstd"),
], ids=["relu_backward-mask", "relu_backward-dy", "relu_mask-y", "index_add-index", "index_add-x", "prelu-x",
        "batch_norm_relu-mean", "backward_elemt-sum_dy", "gather_stats-vars", "sync_reduce-invstd"])
def test_item10_none_for_an_array_is_a_type_error_naming_it(numpy_backend, call, name):
    with pytest.raises(TypeError, match=f"^{name}: expected an array, got None"):
        call()


def test_item10_eps_is_any_real_number(numpy_backend):
    x = _x4()
    ref = igemm.batch_norm_stats(x, 1e-5)[1]
    for eps in (np.float32(1e-5), np.float64(1e-5), 1e-5):
        np.testing.assert_allclose(igemm.batch_norm_stats(x, eps)[1], ref, rtol=1e-6)
        np.testing.assert_allclose(igemm.sync_batch_norm_stats(x, eps)[1], ref, rtol=1e-6)
    for eps in (0, np.int64(0), np.float16(0.0)):
        igemm.batch_norm_stats(x, eps)
    for eps, exc in (("1e-5", TypeError), (True, TypeError), (None, TypeError), (1e-5j, TypeError),
                     (np.array([1e-5]), TypeError), (-1e-5, ValueError), (math.nan, ValueError),
                     (math.inf, ValueError)):
        with pytest.raises(exc, match="^eps"):
            igemm.batch_norm_stats(x, eps)
        with pytest.raises(exc, match="^eps"):
            igemm.sync_batch_norm_stats(x, eps)


def test_item10_one_exception_type_per_kind_of_failure(numpy_backend):
    """Wrong dtype: TypeError; wrong shape or out-of-range value: ValueError -- in every family."""
    x = np.ones((2, 3, 4), np.float32)
    with pytest.raises(TypeError, match="^out: dtype"):
        igemm.prelu(x, 0.25, out=np.empty((2, 3, 4), np.float16))
    with pytest.raises(ValueError, match="^out: expected shape"):
        igemm.prelu(x, 0.25, out=np.empty((2, 3, 5), np.float32))
    with pytest.raises(TypeError, match="^dy: dtype"):
        igemm.prelu_backward(x.astype(np.float16), x, 0.25)
    with pytest.raises(TypeError, match="^out: dtype"):
        igemm.relu_backward(np.ones(64, np.float32), np.zeros(2, np.uint32), out=np.empty(64, np.float16))
    with pytest.raises(TypeError, match="^out.mean: dtype"):
        igemm.batch_norm_stats(_x4(), out=(np.empty(3, np.float16), None))
    with pytest.raises(ValueError, match="^dim"):
        igemm.index_add(np.zeros((3, 2), np.float32), 2, np.array([0]), np.ones((1, 2), np.float32))
    with pytest.raises(ValueError, match=r"^index: index\[0\] = 7"):
        igemm.index_add(np.zeros((3, 2), np.float32), 0, np.array([7]), np.ones((1, 2), np.float32))
    with pytest.raises(IndexError):      # ... and still the IndexError PyTorch raises for these
        igemm.index_add(np.zeros((3, 2), np.float32), 0, np.array([7]), np.ones((1, 2), np.float32))


def test_item10_shapes_given_as_floats_are_refused():
    from igemm._checks import check_int, check_shape_arg
    assert check_shape_arg((2, np.int64(8)), "x_shape", 2) == (2, 8)
    for bad in ((2, 8.7), (2, 8.0), (2, True), [2.0]):
        with pytest.raises(TypeError, match=r"^x_shape\["):
            check_shape_arg(bad, "x_shape")
    with pytest.raises(TypeError, match="^x_shape"):
        check_shape_arg(8, "x_shape")
    with pytest.raises(ValueError, match="^x_shape"):
        check_shape_arg((2, 3), "x_shape", 4)
    with pytest.raises(TypeError, match="^dim"):
        check_int(1.0, "dim")


def test_item10_no_pdl_switch(monkeypatch):
    """PDL after a conv is on for sm_90+ whatever the environment says (no IGEMM_PDL switch ships)."""
    import types

    from igemm import _runtime, relu
    monkeypatch.setenv("IGEMM_PDL", "0")
    relu._pdl_ok.cache_clear()
    cc = {0: 9, 1: 8}
    monkeypatch.setattr(_runtime, "device", lambda i: types.SimpleNamespace(
        compute_capability=types.SimpleNamespace(major=cc[i], minor=0)))
    try:
        assert relu._pdl_ok(0) is True and relu._pdl_ok(1) is False
    finally:
        relu._pdl_ok.cache_clear()


def test_family_modules_and_functions_are_short():
    """No family module over 600 lines, no function over 120 (the lead's conv modules are checked there)."""
    import ast
    import pathlib
    root = pathlib.Path(igemm.__file__).parent
    for name in ("relu", "norm", "_norm_kernels", "_norm_train", "_norm_checks", "index_add", "prelu", "syncbn",
                 "_checks", "_dispatch"):
        src = (root / f"{name}.py").read_text()
        assert len(src.splitlines()) <= 600, name
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno < 120, f"{name}.{node.name}"
    assert callable(igemm.norm.precompile)          # tools/precompile_all.sh calls it


# ============================================================================================== valid edge inputs
def tf32_round(a) -> np.ndarray:
    """float64 copy of fp32 values rounded to TF32 as the kernels do (``cvt.rna.tf32.f32``: 10 mantissa bits,
    ties away from zero; inf and NaN kept): a tf32 reference on these sees only the accumulation's error."""
    a = np.asarray(a, dtype=np.float32)
    b = ((a.view(np.uint32).astype(np.uint64) + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(a), a, b).astype(np.float64)


def _ieee_conv(x, w, stride, padding, dilation, layout):
    """float64 conv without BLAS (elementwise products, np.sum): NaN/Inf propagate exactly as IEEE says."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    if layout == "NHWC":
        x, w = x.transpose(0, 3, 1, 2), w.transpose(0, 3, 1, 2)
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    N, C, H, W = x.shape
    K, _, R, S = w.shape
    P = (H + 2 * ph - dh * (R - 1) - 1) // sh + 1
    Q = (W + 2 * pw - dw * (S - 1) - 1) // sw + 1
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    terms = np.empty((N, K, P, Q, C, R, S))
    for r in range(R):
        for s in range(S):
            patch = xp[:, :, r * dh: r * dh + sh * (P - 1) + 1: sh, s * dw: s * dw + sw * (Q - 1) + 1: sw]
            terms[..., r, s] = patch.transpose(0, 2, 3, 1)[:, None] * w[None, :, None, None, :, r, s]
    y = terms.reshape(N, K, P, Q, -1).sum(-1)
    return np.ascontiguousarray(y.transpose(0, 2, 3, 1)) if layout == "NHWC" else y


def _assert_ieee(got, ref, tol, what):
    got = np.asarray(got, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(ref), err_msg=f"{what}: +inf positions")
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref), err_msg=f"{what}: -inf positions")
    fin = np.isfinite(ref)
    assert rel_err(got[fin], ref[fin]) <= tol, what


def _specials_like(rng, shape):
    v = rng.standard_normal(shape)
    flat = v.reshape(-1)
    idx = rng.permutation(flat.size)
    k = max(1, flat.size // 40)
    flat[idx[:k]] = np.nan
    flat[idx[k:2 * k]] = np.inf
    flat[idx[2 * k:3 * k]] = -np.inf
    return v


from igemm.conv._rules import FFMA_CONFIG as FFMA  # noqa: E402  (the strict-fp32 FFMA kernel)


def ok_conv_ieee(A, dtype="float32", layout="NCHW", precision="strict", ffma=False):
    rng = np.random.default_rng(11)
    xs, ws = ((2, 5, 7, 6), (8, 5, 3, 3)) if layout == "NCHW" else ((2, 7, 6, 8), (16, 3, 3, 8))
    x = A.arr(_specials_like(rng, xs), dtype)
    wv = rng.choice([-1, 1], ws) * (0.1 + np.abs(rng.standard_normal(ws))) / 4      # no zero weights
    w = A.arr(wv, dtype)
    K = ws[0]
    g = np.where(np.arange(K) % 2, -1.0, 1.0) * rng.uniform(0.5, 1.5, K)                   # scales of both signs
    V = [A.arr(v.astype(np.float32)) for v in (g, rng.standard_normal(K), rng.standard_normal(K),
                                               rng.uniform(0.5, 2, K))]
    xh, wh = A.host(x), A.host(w)
    if precision == "tf32":
        xh, wh = tf32_round(xh), tf32_round(wh)
    pre = _ieee_conv(xh, wh, (1, 1), (1, 1), (1, 1), layout)
    tol = TOL["tf32" if precision == "tf32" else dtype]
    for chain in (ep.chain(ep.BatchNorm(*V)), ep.chain(ep.BatchNorm(*V), ep.ReLU(mask=True))):
        with np.errstate(invalid="ignore"):
            ref = apply_chain(pre, chain, layout)
        if ffma:          # the FFMA kernel by name: IEEE products and sums
            r = igemm.Conv2dPlan(tuple(x.shape), tuple(w.shape), dtype, layout, 1, 1, epilogue=chain,
                                 precision=precision, options=igemm.Conv2dOptions(config=FFMA))(x, w)
        else:
            r = igemm.conv2d(x, w, 1, 1, layout=layout, epilogue=chain, precision=precision)
        y, m = r if chain.mask else (r, None)
        what = f"conv {dtype}/{precision}{' ffma' if ffma else ''} {layout} {chain!r}"
        _assert_ieee(A.host(y), ref, tol, what)     # (3xTF32 too: infinities meet only the other's big part)
        if m is not None:
            bits = reference.unpack_mask(A.host_words(m), ref.size).reshape(ref.shape)
            with np.errstate(invalid="ignore"):
                np.testing.assert_array_equal(bits, A.host(y) > 0, err_msg=what)
    assert np.isnan(pre).any() and np.isinf(pre).any()


def ok_relu_specials(A):
    vals = np.array([NAN, INF, -INF, 0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30] * 13, np.float32)
    y = A.arr(vals)
    m = igemm.relu_mask(y)
    np.testing.assert_array_equal(A.host_words(m)[: (vals.size + 31) // 32], reference.pack_mask(vals > 0))
    dy = A.arr(np.roll(vals, 3))
    dx = igemm.relu_backward(dy, m)
    expect = np.where(vals > 0, np.roll(vals, 3), 0.0)          # a select: inf/NaN where the bit is 0 give 0
    np.testing.assert_array_equal(A.host(dx), expect)


def ok_relu_inplace(A):
    v = np.random.default_rng(12).standard_normal(1000).astype(np.float32)
    dy = A.arr(v)
    m = A.words(32, 0x5A5A5A5A)
    r = igemm.relu_backward(dy, m, out=dy)
    assert r is dy
    np.testing.assert_array_equal(A.host(dy), np.where(reference.unpack_mask(A.host_words(m), 1000), v, 0.0))


def ok_relu_empty(A):
    y = A.empty(0)
    m = igemm.relu_mask(y)
    assert A.host_words(m).size == 0
    dx = igemm.relu_backward(y, A.empty(0, "uint32" if not A.gpu else "int32"))
    assert A.host(dx).size == 0


def ok_index_add_empty(A):
    x = A.randn((4, 3), "float32", 13)
    keep = A.snapshot(x)
    igemm.index_add(x, 0, A.empty(0, "int64"), A.empty((0, 3)))
    assert A.same(x, keep)
    z = A.empty((4, 0))
    igemm.index_add(z, 0, A.arr([1, 3], "int64"), A.empty((2, 0)))
    assert A.host(z).shape == (4, 0)


def ok_index_add_nan(A):
    rng = np.random.default_rng(14)
    x = A.randn((6, 5), "float32", 15)
    src = rng.standard_normal((3, 5))
    src[1, 2] = np.nan
    src[2, 4] = np.inf
    idx = np.array([4, 1, 1])
    x0 = A.host(x)
    with np.errstate(invalid="ignore"):
        ref = reference.index_add(x0, 0, idx, src.astype(np.float32))
    igemm.index_add(x, 0, A.arr(idx, "int64"), A.arr(src))
    _assert_ieee(A.host(x), ref, 1e-6, "index_add NaN/inf source")


def ok_prelu_specials(A):
    rng = np.random.default_rng(16)
    xv = _specials_like(rng, (3, 4, 5))
    alpha = np.array([0.5, -0.25, 2.0, 1e-3], np.float32)
    x = A.arr(xv)
    y = igemm.prelu(x, A.arr(alpha))
    with np.errstate(invalid="ignore"):
        ref = reference.prelu(A.host(x), alpha.astype(np.float64))
    _assert_ieee(A.host(y), ref, 1e-6, "prelu NaN/inf")


def ok_prelu_inplace(A):
    x = A.randn((2, 3, 5), "float32", 17)
    x0 = A.host(x)
    assert igemm.prelu(x, 0.25, out=x) is x
    np.testing.assert_allclose(A.host(x), np.where(x0 > 0, x0, 0.25 * x0), rtol=1e-6)


def ok_prelu_empty(A):
    e = A.empty((0, 3, 4))
    assert A.host(igemm.prelu(e, A.arr([0.1, 0.2, 0.3]))).shape == (0, 3, 4)
    dx, da = igemm.prelu_backward(e, e, A.arr([0.1, 0.2, 0.3]))
    assert A.host(dx).shape == (0, 3, 4) and np.all(A.host(da) == 0)


def ok_bn_empty_batch(A):
    for layout, shape in (("NCHW", (0, 3, 4, 4)), ("NHWC", (0, 4, 4, 3))):
        x = A.full(shape, 1.0)
        m, v, n = igemm.welford(x, layout)
        assert A.host(m).tolist() == [0.0] * 3 and A.host(v).tolist() == [0.0] * 3 and A.host(n).tolist() == [0.0] * 3
        mean, invstd = igemm.batch_norm_stats(x, 0.25, layout)
        assert A.host(invstd).tolist() == [2.0] * 3
        y, mk = igemm.batch_norm_relu(x, mean, invstd, layout=layout)
        assert A.host(y).shape == shape and A.host_words(mk).size == 0


def ok_bn_specials(A):
    rng = np.random.default_rng(18)
    xv = rng.standard_normal((3, 4, 5, 5))
    xv[1, 1, 2, 3] = np.nan          # channel 1: a NaN
    xv[2, 2, 0, 0] = np.inf          # channel 2: an inf
    x = A.arr(xv)
    m, v, n = igemm.welford(x)
    with np.errstate(invalid="ignore"):
        rm, rv, _ = reference.welford_stats(A.host(x))
    bad = np.array([False, True, True, False])
    mh, vh = A.host(m), A.host(v)
    assert np.all(~np.isfinite(mh[bad])) and np.all(~np.isfinite(vh[bad])), (mh, vh)
    np.testing.assert_allclose(mh[~bad], rm[~bad], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(vh[~bad], rv[~bad], rtol=1e-5)
    mean, invstd = igemm.batch_norm_stats(x, 1e-5)
    assert np.all(~np.isfinite(A.host(invstd)[bad]))
    # batch_norm_relu: NaN stays NaN with mask bit 0, +inf stays +inf with bit 1
    c = A.arr(np.ones(4, np.float32))
    zero = A.arr(np.zeros(4, np.float32))
    y, mk = igemm.batch_norm_relu(x, zero, c)
    yh = A.host(y)
    assert np.isnan(yh[1, 1, 2, 3]) and yh[2, 2, 0, 0] == np.inf
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(A.host_words(mk), reference.pack_mask(yh > 0))


def ok_conv_mixed_residual_in_add(A):
    """A residual of another dtype given inside ep.Add (not residual=) works like residual= does."""
    rng = np.random.default_rng(19)
    x = A.arr(rng.standard_normal((1, 2, 5, 5)), "float16")
    w = A.arr(rng.standard_normal((3, 2, 3, 3)) / 4, "float16")
    r = A.arr(rng.standard_normal((1, 3, 5, 5)), "float32")
    via_kw = igemm.conv2d(x, w, padding=1, epilogue=ep.chain(ep.Add(), ep.ReLU()), residual=r)
    via_add = igemm.conv2d(x, w, padding=1, epilogue=ep.chain(ep.Add(r), ep.ReLU()))
    ref = np.maximum(reference.conv2d_im2col(A.host(x), A.host(w), 1, 1, 1) + A.host(r), 0)
    assert rel_err(A.host(via_kw), ref) <= 1e-2 and rel_err(A.host(via_add), ref) <= 1e-2


def ok_numpy_vectors_with_cuda_x(A):
    rng = np.random.default_rng(20)
    x, w = A.randn((2, 4, 6, 6), "float32", 21), A.randn((5, 4, 3, 3), "float32", 22)
    V = [v.astype(np.float32) for v in (rng.uniform(0.5, 1.5, 5), rng.standard_normal(5), rng.standard_normal(5),
                                       rng.uniform(0.5, 2, 5))]
    chain = ep.chain(ep.BatchNorm(*V), ep.ReLU())
    y = igemm.conv2d(x, w, padding=1, epilogue=chain)
    ref = apply_chain(reference.conv2d_im2col(A.host(x), A.host(w), 1, 1, 1), chain, "NCHW")
    assert rel_err(A.host(y), ref) <= 1e-5


def ok_misaligned_views(A):
    """Views 1 element into a buffer: narrow loads everywhere, same answers."""
    x, w = A.misaligned((2, 6, 6, 8)), A.randn((4, 3, 3, 8))
    y = igemm.conv2d(x, w, padding=1, layout="NHWC")
    assert rel_err(A.host(y), reference.conv2d_im2col(A.host(x), A.host(w), 1, 1, 1, "NHWC")) <= 1e-5
    dy = A.misaligned((777,))
    m = igemm.relu_mask(A.misaligned((777,), seed=3))
    dx = A.misaligned((777,), seed=4)
    igemm.relu_backward(dy, m, out=dx)
    np.testing.assert_array_equal(A.host(dx), np.where(reference.unpack_mask(A.host_words(m), 777), A.host(dy), 0.0))
    xb = A.misaligned((3, 5, 7, 9))
    mean, invstd = igemm.batch_norm_stats(xb, 1e-5)
    rm, rv, _ = reference.welford_stats(A.host(xb))
    np.testing.assert_allclose(A.host(mean), rm, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(A.host(invstd), 1 / np.sqrt(rv + 1e-5), rtol=1e-5)
    xi = A.misaligned((7, 9))
    x0 = A.host(xi)
    igemm.index_add(xi, 0, A.arr([6, 0, 6], "int64"), A.arr(np.ones((3, 9))))
    np.testing.assert_allclose(A.host(xi), reference.index_add(x0, 0, np.array([6, 0, 6]), np.ones((3, 9))),
                               rtol=1e-6)
    xp = A.misaligned((2, 3, 7))
    yp = igemm.prelu(xp, A.arr([0.1, 0.2, 0.3]))
    np.testing.assert_allclose(A.host(yp), reference.prelu(A.host(xp), np.array([0.1, 0.2, 0.3], np.float32)),
                               rtol=1e-6)


def ok_side_stream(A):
    """An explicit torch stream (not the current one) and a cupy stream for torch tensors."""
    torch = A.torch
    s = torch.cuda.Stream()
    y = A.randn((5000,), "float32", 23)
    torch.cuda.synchronize()
    m = igemm.relu_mask(y, stream=s)
    s.synchronize()
    np.testing.assert_array_equal(A.host_words(m), reference.pack_mask(A.host(y) > 0))
    try:
        import cupy
    except ImportError:
        return
    cs = cupy.cuda.Stream(non_blocking=True)
    m2 = igemm.relu_mask(y, stream=cs)
    cs.synchronize()
    assert torch.equal(m, m2)


OK = [
    ("conv/ieee-fp32-nchw", lambda A: ok_conv_ieee(A, "float32", "NCHW"), "both"),
    ("conv/ieee-fp32-nhwc", lambda A: ok_conv_ieee(A, "float32", "NHWC"), "both"),
    ("conv/ieee-fp32-ffma-nchw", lambda A: ok_conv_ieee(A, "float32", "NCHW", ffma=True), "gpu"),
    ("conv/ieee-fp32-ffma-nhwc", lambda A: ok_conv_ieee(A, "float32", "NHWC", ffma=True), "gpu"),
    ("conv/ieee-fp16-nhwc", lambda A: ok_conv_ieee(A, "float16", "NHWC"), "gpu"),
    ("conv/ieee-bf16-nchw", lambda A: ok_conv_ieee(A, "bfloat16", "NCHW"), "gpu"),
    ("conv/ieee-tf32-nhwc", lambda A: ok_conv_ieee(A, "float32", "NHWC", "tf32"), "gpu"),
    ("conv/mixed-residual-in-add", ok_conv_mixed_residual_in_add, "both"),
    ("conv/numpy-vectors-cuda-x", ok_numpy_vectors_with_cuda_x, "gpu"),
    ("relu/nan-inf-signed-zero", ok_relu_specials, "both"),
    ("relu/in-place", ok_relu_inplace, "both"),
    ("relu/empty", ok_relu_empty, "both"),
    ("index_add/empty-index-and-zero-size-dim", ok_index_add_empty, "both"),
    ("index_add/nan-inf-source", ok_index_add_nan, "both"),
    ("prelu/nan-inf", ok_prelu_specials, "both"),
    ("prelu/in-place", ok_prelu_inplace, "both"),
    ("prelu/empty", ok_prelu_empty, "both"),
    ("bn/empty-batch", ok_bn_empty_batch, "both"),
    ("bn/nan-inf", ok_bn_specials, "both"),
    ("all/misaligned-views", ok_misaligned_views, "gpu"),
    ("all/side-streams", ok_side_stream, "gpu"),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")     # numpy's own NaN/inf arithmetic in the references
@pytest.mark.parametrize("name, fn", [(n, f) for n, f, w in OK if w == "both"],
                         ids=[n for n, f, w in OK if w == "both"])
def test_edge_inputs_numpy(name, fn, numpy_backend):
    fn(NumpyArrays())


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name, fn", [(n, f) for n, f, w in OK], ids=[n for n, f, w in OK])
def test_edge_inputs_gpu(name, fn):
    pytest.importorskip("torch")
    A = TorchArrays()
    fn(A)
    A.sync()
    _context_is_healthy(A)


def test_nan_eps_and_inf_eps_rejected(numpy_backend):
    x = np.ones((2, 3, 4), np.float32)
    for eps in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError, match="eps"):
            igemm.batch_norm_stats(x, eps)


# ============================================================================================== launch glue (CPU)
def _driver_recorder(monkeypatch, n_slots: dict):
    """Stand-ins for the driver: kernels load as a dummy, and cuLaunchKernel records, per launch, the 64-bit
    value behind each entry of the ``void*[]`` it is handed (read while the call is in progress)."""
    import ctypes
    import types

    from cuda.bindings import driver

    from igemm import _kernel
    calls = []

    def launch(func, gx, gy, gz, bx, by, bz, smem, stream, args, extra):
        n = n_slots["n"]
        ptrs = (ctypes.c_uint64 * n).from_address(int(args))
        calls.append([ctypes.c_uint64.from_address(p).value for p in ptrs])
        return (0,)
    monkeypatch.setattr(driver, "cuLaunchKernel", launch)
    monkeypatch.setattr(_kernel, "load", lambda *a, **k: types.SimpleNamespace(handle=0))
    return calls


def _n_entries(params) -> int:
    return sum(3 if p.ctype == "fastdiv" else 1 for p in params)


def _f32(v: int) -> float:
    return float(np.array([v & 0xFFFFFFFF], np.uint32).view(np.float32)[0])


def test_index_add_launch_arguments_reach_the_driver(monkeypatch):
    """What cuLaunchKernel receives for an index_add launch: the pointers and alpha in their slots."""
    import importlib

    from igemm import _runtime
    ia = importlib.import_module("igemm.index_add")
    n = {"n": _n_entries(ia._P_MANY)}
    calls = _driver_recorder(monkeypatch, n)
    monkeypatch.setattr(ia, "_sms", lambda device_id: 132)
    plan = ia._Plan(0, "float32", "int64", 1, 10, 4, 3, ia.IndexAddConfig("many", 4))
    plan.run(_runtime.RawStream(0), 0x1000, 0x2000, 0x3000, 0.5)
    assert len(calls) == 1
    slots = calls[0]
    assert slots[:3] == [0x1000, 0x2000, 0x3000] and _f32(slots[3]) == 0.5


def test_prelu_launch_arguments_reach_the_driver(monkeypatch):
    import importlib

    from igemm import _runtime
    pm = importlib.import_module("igemm.prelu")
    n = {"n": _n_entries(pm._P_FWD)}
    calls = _driver_recorder(monkeypatch, n)
    monkeypatch.setattr(pm, "_sms", lambda device_id: 132)
    cfg = pm.forward_config(24, 3, 8, "float32", alpha_kind="channel", vec=4)
    launcher, args = pm._forward_plan.__wrapped__(0, "float32", "float32", cfg, 24, 3, 8)   # no plan cache
    launcher(_runtime.RawStream(0), args(0x1000, 0x2000, 0x3000, 0.25))
    assert len(calls) == 1
    slots = calls[0]
    assert slots[:3] == [0x1000, 0x2000, 0x3000] and _f32(slots[3]) == 0.25


def test_index_add_torch_stream_lookup(monkeypatch):
    """index_add's torch fast path resolves the current stream (a second call with a remembered geometry)."""
    import importlib
    import types
    ia = importlib.import_module("igemm.index_add")
    fake = types.SimpleNamespace(_C=types.SimpleNamespace(_cuda_getCurrentRawStream=lambda device_id: 0))
    monkeypatch.setattr(ia, "_torch", fake)
    s = ia._torch_stream(0)
    assert int(getattr(s, "handle", s)) == 0


def test_stream_device_rule():
    """A stream of another device is refused before anything is queued (the GPU row needs two GPUs)."""
    from igemm import _runtime
    with pytest.raises(ValueError, match="cuda:1 but the tensors are on cuda:0"):
        _runtime._check_stream_device(1, 0)
    _runtime._check_stream_device(0, 0)
    _runtime._check_stream_device(None, 0)          # the driver could not tell: no claim
    with pytest.raises(TypeError, match="bool"):
        _runtime.stream_handle(True, "other", 0)


@pytest.mark.gpu
def test_current_device_kept_across_devices_gpu():
    """Calls on tensors of cuda:1 run there and leave torch's current device (cuda:0) as it was -- as torch's own
    ops do; then the same calls on cuda:0 still run on cuda:0 (a device switch must not stick)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    torch.cuda.set_device(0)
    rng = np.random.default_rng(5)
    x_np = rng.standard_normal((2, 8, 9, 9)).astype(np.float32)
    w_np = rng.standard_normal((4, 8, 3, 3)).astype(np.float32)
    ref = reference.conv2d_direct(x_np.astype(np.float64), w_np.astype(np.float64), (1, 1), (1, 1), (1, 1), "NCHW")
    results = {}
    for dev in ("cuda:1", "cuda:0", "cuda:1"):
        x, w = torch.from_numpy(x_np).to(dev), torch.from_numpy(w_np).to(dev)
        y = igemm.conv2d(x, w, padding=1)
        assert torch.cuda.current_device() == 0, f"conv2d on {dev} changed the current device"
        assert y.device == x.device
        assert rel_err(to_numpy(y), ref) <= TOL["float32"], dev
        plan = Conv2dPlan(tuple(x.shape), tuple(w.shape), "float32", padding=1, device=x.device.index)
        assert torch.cuda.current_device() == 0, f"Conv2dPlan on {dev} changed the current device"
        y2 = plan(x, w)
        assert torch.equal(y, y2)
        m = igemm.relu_mask(y)
        mean, invstd = igemm.batch_norm_stats(x, 1e-5)
        xi = torch.zeros(10, device=dev)
        igemm.index_add(xi, 0, torch.tensor([1, 3], device=dev), torch.ones(2, device=dev))
        p = igemm.prelu(x, torch.tensor([0.25], device=dev))
        torch.cuda.synchronize(dev)
        assert torch.cuda.current_device() == 0, f"a call on {dev} changed the current device"
        for t in (m, mean, invstd, xi, p):
            assert t.device == x.device
        assert xi.tolist() == [0, 1, 0, 1, 0, 0, 0, 0, 0, 0]
        np.testing.assert_array_equal(to_numpy(p), np.where(x_np > 0, x_np, 0.25 * x_np).astype(np.float32))
        results.setdefault(dev, []).append(to_numpy(mean))
    np.testing.assert_array_equal(results["cuda:1"][0], results["cuda:1"][1])


@pytest.mark.gpu
def test_fresh_process_without_cuda_initialised_gpu(tmp_path):
    """In a new process where nothing has initialised CUDA yet (the driver reports no context), building a
    host plan, numpy-backend calls and a first GPU call all work, and the context guard restores "none"."""
    import subprocess
    import sys
    pytest.importorskip("torch")
    code = (
        "import numpy as np, igemm\n"
        "from igemm.conv import Conv2dPlan\n"
        "p = Conv2dPlan((1, 4, 6, 6), (2, 4, 3, 3), 'float32', padding=1, device='numpy')\n"
        "x = np.random.default_rng(0).standard_normal((1, 4, 6, 6)).astype(np.float32)\n"
        "w = np.ones((2, 4, 3, 3), np.float32)\n"
        "y = igemm.conv2d(x, w, padding=1)\n"
        "import torch\n"
        "yt = igemm.conv2d(torch.from_numpy(x).cuda(), torch.from_numpy(w).cuda(), padding=1)\n"
        "assert np.allclose(yt.cpu().numpy(), y, rtol=1e-5, atol=1e-5)\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


def test_launch_after_is_pdl_with_a_configuration_per_stream(monkeypatch):
    """Launcher.launch_after (relu_mask after a conv, sm_90+): cuLaunchKernelEx with programmatic stream
    serialization, the launcher's grid, block and shared memory, on the caller's stream; one configuration
    per stream, so that a call on another stream (another thread's) never rewrites one in use. Without
    PDL (pdl=False: before sm_90) a plain cuLaunchKernel."""
    import types

    from cuda.bindings import driver

    from igemm import _kernel
    ex, plain = [], []

    def launch_ex(cfg, func, args, extra):
        a = cfg.attrs[0]
        ex.append((cfg, int(cfg.hStream), cfg.numAttrs, a.id, a.value.programmaticStreamSerializationAllowed,
                   (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ), (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ),
                   cfg.sharedMemBytes, int(args)))
        return (0,)
    monkeypatch.setattr(driver, "cuLaunchKernelEx", launch_ex)
    monkeypatch.setattr(driver, "cuLaunchKernel", lambda *a: (plain.append(a), (0,))[1])
    args = types.SimpleNamespace(address=0x5000)
    for pdl in (True, False):
        ln = _kernel.Launcher(types.SimpleNamespace(handle=0), 7, 256, 1024, pdl=pdl)
        ln._get_ctx, ln._set_ctx, ln._ctx, ln._ctx_id = (lambda: (0, None)), (lambda c: None), None, 0
        for s in (0x11, 0x22, 0x11):
            ln.launch_after(s, args)
    assert len(plain) == 3 and len(ex) == 3
    assert [e[1] for e in ex] == [0x11, 0x22, 0x11] and ex[0][0] is ex[2][0] and ex[0][0] is not ex[1][0]
    for e in ex:
        assert e[2:] == (1, driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1,
                         (7, 1, 1), (256, 1, 1), 1024, 0x5000), e
