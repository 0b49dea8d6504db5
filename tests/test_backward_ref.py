"""The float64 convolution-backward references (igemm/reference/grad.py), CPU only: the adjoint identity,
brute-force index arithmetic, PyTorch's conv2d_input/conv2d_weight and autograd, the mask/prologue
select and the BatchNorm coefficients against batch_norm_backward_elemt_ref."""
import itertools

import numpy as np
import pytest

from igemm import reference as ref
from igemm.reference import (bn_grad_coefficients_ref, conv2d_direct, conv2d_grad_input_ref, conv2d_grad_weight_ref,
                             grad_prologue_ref, pack_mask)

LAYOUTS = ("NCHW", "NHWC")

# (N, C, K, H, W, R, S, stride, padding, dilation)
CASES = [
    (1, 3, 5, 7, 9, 3, 3, 1, 1, 1),
    (2, 5, 3, 8, 8, 3, 3, 2, 0, 1),                      # floor in P: row/col 7 never read
    (1, 1, 1, 5, 6, 1, 1, 1, 0, 1),
    (1, 3, 7, 11, 9, 5, 5, 3, 2, 1),
    (2, 3, 3, 9, 12, 3, 2, (2, 1), (1, 3), (2, 1)),      # asymmetric stride/pad/dilation, R != S
    (1, 7, 5, 10, 7, 2, 4, (1, 3), (0, 2), (1, 2)),
    (1, 2, 3, 6, 5, 3, 3, 1, 3, 2),                      # padding larger than the dilated half-filter
    (1, 5, 1, 13, 10, 4, 3, 3, (3, 0), 2),
    (2, 1, 4, 4, 9, 1, 5, (3, 2), (0, 1), 1),
]
IDS = [f"c{i}" for i in range(len(CASES))]


def _to_layout(a, layout):
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1)) if layout == "NHWC" else a


def _problem(rng, case, layout, integer=False):
    """(x, w, dy, x_shape, w_shape, kwargs) in the layout; integer=True draws small integers (exact sums)."""
    N, C, K, H, W, R, S, st, pd, dl = case
    P, Q = ref.out_size(H, W, R, S, st, pd, dl)
    draw = (lambda s: rng.integers(-4, 5, s).astype(np.float64)) if integer else rng.standard_normal
    x, w, dy = (_to_layout(draw(s), layout) for s in ((N, C, H, W), (K, C, R, S), (N, K, P, Q)))
    return x, w, dy, x.shape, w.shape, dict(stride=st, padding=pd, dilation=dl, layout=layout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_adjoint_identity(rng, case, layout):
    x, w, dy, xs, ws, kw = _problem(rng, case, layout)
    y = conv2d_direct(x, w, **kw)
    dx = conv2d_grad_input_ref(dy, w, xs, **kw)
    dw = conv2d_grad_weight_ref(x, dy, ws, **kw)
    assert dx.shape == xs and dw.shape == ws and dx.dtype == dw.dtype == np.float64
    lhs = np.vdot(y, dy)
    scale = np.vdot(np.abs(y), np.abs(dy))
    assert abs(lhs - np.vdot(x, dx)) <= 1e-10 * scale
    assert abs(lhs - np.vdot(w, dw)) <= 1e-10 * scale


def _brute(x, w, dy, st, pd, dl):
    """dx, dw by explicit index arithmetic over every (n, k, p, q, c, r, s), NCHW."""
    (sh, sw), (ph, pw), (dh, dw_) = ref.pair(st), ref.pair(pd), ref.pair(dl)
    N, C, H, W = x.shape
    K, _, R, S = w.shape
    P, Q = dy.shape[2:]
    gx, gw = np.zeros_like(x), np.zeros_like(w)
    for p, q, r, s in itertools.product(range(P), range(Q), range(R), range(S)):
        h, v = p * sh - ph + r * dh, q * sw - pw + s * dw_
        if 0 <= h < H and 0 <= v < W:
            gx[:, :, h, v] += np.einsum("nk,kc->nc", dy[:, :, p, q], w[:, :, r, s])
            gw[:, :, r, s] += np.einsum("nk,nc->kc", dy[:, :, p, q], x[:, :, h, v])
    return gx, gw


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_brute_force_exact(rng, case, layout):
    """Integer-valued data: every sum is exact, so the references must match bit for bit."""
    x, w, dy, xs, ws, kw = _problem(rng, case, layout, integer=True)
    dx = conv2d_grad_input_ref(dy, w, xs, **kw)
    dw = conv2d_grad_weight_ref(x, dy, ws, **kw)
    nchw = (lambda a: a.transpose(0, 3, 1, 2)) if layout == "NHWC" else (lambda a: a)
    gx, gw = _brute(nchw(x), nchw(w), nchw(dy), kw["stride"], kw["padding"], kw["dilation"])
    np.testing.assert_array_equal(nchw(dx), gx)
    np.testing.assert_array_equal(nchw(dw), gw)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_jacobian_columns_exact(rng, layout):
    """J^T·dy with the Jacobian of conv2d_direct built column by column from unit vectors."""
    x, w, dy, xs, ws, kw = _problem(rng, (1, 2, 3, 6, 5, 3, 2, (2, 1), (1, 0), (1, 2)), layout, integer=True)
    for wrt, arg, got in (("x", x, conv2d_grad_input_ref(dy, w, xs, **kw)),
                          ("w", w, conv2d_grad_weight_ref(x, dy, ws, **kw))):
        want = np.zeros(arg.size)
        for i in range(arg.size):
            e = np.zeros(arg.size)
            e[i] = 1.0
            e = e.reshape(arg.shape)
            col = conv2d_direct(e, w, **kw) if wrt == "x" else conv2d_direct(x, e, **kw)
            want[i] = np.vdot(col, dy)
        np.testing.assert_array_equal(got.ravel(), want, err_msg=wrt)


def test_unread_rows_are_zero(rng):
    """H=8, R=3, stride 2, no padding: P=3 reads rows 0..6, so row 7 (and column 7) of dx is 0."""
    w, dy = rng.standard_normal((4, 3, 3, 3)), rng.standard_normal((2, 4, 3, 3))
    dx = conv2d_grad_input_ref(dy, w, (2, 3, 8, 8), stride=2)
    assert np.all(dx[:, :, 7, :] == 0) and np.all(dx[:, :, :, 7] == 0)
    assert np.all(dx[:, :, :7, :7] != 0)


def test_shape_validation(rng):
    w = rng.standard_normal((4, 3, 3, 3))
    with pytest.raises(ValueError):
        conv2d_grad_input_ref(np.zeros((1, 4, 5, 5)), w, (1, 3, 8, 8))      # P is 6, not 5
    with pytest.raises(ValueError):
        conv2d_grad_weight_ref(np.zeros((1, 3, 8, 8)), np.zeros((1, 4, 6, 6)), (4, 2, 3, 3))
    with pytest.raises(ValueError):
        conv2d_grad_input_ref(np.zeros((1, 4, 6, 6)), w, (1, 3, 8, 8), layout="CHWN")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_against_torch(rng, case, layout):
    torch = pytest.importorskip("torch")
    x, w, dy, xs, ws, kw = _problem(rng, case, layout)
    nchw = (lambda a: a.transpose(0, 3, 1, 2)) if layout == "NHWC" else (lambda a: a)
    t = (lambda a: torch.from_numpy(np.ascontiguousarray(nchw(a))))
    st, pd, dl = (ref.pair(kw[k]) for k in ("stride", "padding", "dilation"))
    gx = torch.nn.grad.conv2d_input(tuple(nchw(x).shape), t(w), t(dy), st, pd, dl).numpy()
    gw = torch.nn.grad.conv2d_weight(t(x), tuple(nchw(w).shape), t(dy), st, pd, dl).numpy()
    dx = nchw(conv2d_grad_input_ref(dy, w, xs, **kw))
    dw = nchw(conv2d_grad_weight_ref(x, dy, ws, **kw))
    np.testing.assert_allclose(dx, gx, rtol=1e-12, atol=1e-12 * np.abs(gx).max())
    np.testing.assert_allclose(dw, gw, rtol=1e-12, atol=1e-12 * np.abs(gw).max())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grad_prologue(rng, layout):
    shape = (2, 3, 4, 5) if layout == "NCHW" else (2, 4, 5, 3)
    ax = 1 if layout == "NCHW" else 3
    y = rng.standard_normal(shape)
    bits = y > 0
    mask = pack_mask(bits)
    dy = rng.standard_normal(shape)
    off = np.flatnonzero(~bits.ravel())
    dy.ravel()[off[:3]] = [np.nan, np.inf, -np.inf]            # non-finite where the bit is 0: selected away
    on = np.flatnonzero(bits.ravel())[0]
    dy.ravel()[on] = np.nan                                     # where the bit is 1 it passes through
    z = rng.standard_normal(shape)
    a, b, c = rng.standard_normal((3, 3))
    want_sel = np.empty(shape)
    want = np.empty(shape)
    for i, idx in enumerate(np.ndindex(*shape)):
        s = dy[idx] if bits.ravel()[i] else 0.0
        k = idx[ax]
        want_sel[idx] = s
        want[idx] = a[k] * s + b[k] * z[idx] + c[k]
    np.testing.assert_array_equal(grad_prologue_ref(dy, mask, layout=layout), want_sel)
    got = grad_prologue_ref(dy, mask, (z, a, b, c), layout=layout)
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got.ravel()[on]) and np.isfinite(np.delete(got.ravel(), on)).all()
    np.testing.assert_array_equal(grad_prologue_ref(dy, layout=layout), dy)
    with pytest.raises(ValueError):
        grad_prologue_ref(dy, mask, (z, a[:2], b, c), layout=layout)
    with pytest.raises(ValueError):
        grad_prologue_ref(dy, mask[:1], layout=layout)


def _bn_problem(rng, layout, shape=(2, 5, 4, 3)):
    """z (the conv output = BN input), the ReLU mask of BN(z)+res, dy and the backward statistics."""
    N, C, H, W = shape
    z = _to_layout(rng.standard_normal(shape) * rng.uniform(0.5, 2, (1, C, 1, 1)) + rng.uniform(-1, 1, (1, C, 1, 1)),
                   layout)
    gamma, beta = rng.uniform(0.5, 1.5, C), rng.standard_normal(C)
    res = rng.standard_normal(z.shape)
    mean, invstd = ref.batch_norm_stats_ref(z, 1e-5, layout)
    y, mask = ref.batch_norm_relu_ref(z, mean, invstd, gamma, beta, layout, residual=res)
    dy = rng.standard_normal(z.shape)
    sum_dy, sum_dy_xmu, _, _ = ref.batch_norm_backward_reduce_ref(dy, z, mean, invstd, layout, mask=mask)
    return z, gamma, beta, res, mean, invstd, mask, dy, sum_dy, sum_dy_xmu, N * H * W


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("affine", [True, False])
def test_bn_coefficients(rng, layout, affine):
    z, gamma, _, _, mean, invstd, mask, dy, sdy, sdx, n = _bn_problem(rng, layout)
    g = gamma if affine else None
    a, b, c = bn_grad_coefficients_ref(sdy, sdx, mean, invstd, g, n)
    assert a.shape == b.shape == c.shape == (z.shape[1 if layout == "NCHW" else 3],)
    got = grad_prologue_ref(dy, mask, (z, a, b, c), layout=layout)
    want = ref.batch_norm_backward_elemt_ref(dy, z, mean, invstd, g, sdy, sdx, n, layout, mask=mask)
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12 * np.abs(want).max())
    a2, b2, c2 = bn_grad_coefficients_ref(sdy, sdx, mean, invstd, g, np.full(len(sdy), float(n)))
    np.testing.assert_allclose(np.stack([a2, b2, c2]), np.stack([a, b, c]), rtol=1e-15)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_conv_bn_add_relu_backward_against_autograd(rng, layout):
    """x -> conv -> BN(training) -> + res -> ReLU; dx from the references equals torch autograd's."""
    torch = pytest.importorskip("torch")
    st, pd = (2, 1), (1, 2)
    xn, wn = rng.standard_normal((2, 3, 9, 7)), rng.standard_normal((5, 3, 3, 3))
    x, w = _to_layout(xn, layout), _to_layout(wn, layout)
    z = conv2d_direct(x, w, st, pd, 1, layout)
    zn = z.transpose(0, 3, 1, 2) if layout == "NHWC" else z
    C = zn.shape[1]
    gamma, beta = rng.uniform(0.5, 1.5, C), rng.standard_normal(C)
    res, dyn = rng.standard_normal(zn.shape), rng.standard_normal(zn.shape)
    tx = torch.tensor(xn, requires_grad=True)
    tz = torch.nn.functional.conv2d(tx, torch.tensor(wn), stride=st, padding=pd)
    tb = torch.nn.functional.batch_norm(tz, None, None, torch.tensor(gamma), torch.tensor(beta), True, 0.1, 1e-5)
    torch.relu(tb + torch.tensor(res)).backward(torch.tensor(dyn))
    mean, invstd = ref.batch_norm_stats_ref(z, 1e-5, layout)
    _, mask = ref.batch_norm_relu_ref(z, mean, invstd, gamma, beta, layout, residual=_to_layout(res, layout))
    dy = _to_layout(dyn, layout)
    sdy, sdx, _, _ = ref.batch_norm_backward_reduce_ref(dy, z, mean, invstd, layout, mask=mask)
    n = zn.shape[0] * zn.shape[2] * zn.shape[3]
    g = grad_prologue_ref(dy, mask, (z, *bn_grad_coefficients_ref(sdy, sdx, mean, invstd, gamma, n)), layout)
    dx = conv2d_grad_input_ref(g, w, x.shape, st, pd, 1, layout)
    dx = dx.transpose(0, 3, 1, 2) if layout == "NHWC" else dx
    want = tx.grad.numpy()
    np.testing.assert_allclose(dx, want, rtol=1e-9, atol=1e-11 * np.abs(want).max())
