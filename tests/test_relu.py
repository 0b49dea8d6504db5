import numpy as np
import pytest

import igemm
from igemm import reference

from helpers import poison, to_numpy, to_torch


def test_pack_mask_matches_packbits(rng):
    for n in (1, 31, 32, 33, 1000, 4097):
        bits = rng.random(n) > 0.5
        m = reference.pack_mask(bits)
        assert m.dtype == np.uint32 and m.size == (n + 31) // 32
        raw = np.packbits(bits, bitorder="little")
        raw = np.pad(raw, (0, m.size * 4 - raw.size)).view("<u4")
        np.testing.assert_array_equal(m, raw)
        np.testing.assert_array_equal(reference.unpack_mask(m, n), bits)
        # bits past n are zero
        if n % 32:
            assert m[-1] >> (n % 32) == 0


def test_relu_backward_numpy_backend(numpy_backend, rng):
    y = rng.standard_normal((3, 5, 7)).astype(np.float32)
    m = igemm.relu_mask(y)
    np.testing.assert_array_equal(m, reference.pack_mask(y > 0))
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dy[0, 0, :] = np.inf
    dx = igemm.relu_backward(dy, m)
    np.testing.assert_array_equal(dx, np.where(y > 0, dy, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n", [1, 7, 32, 33, 1000, 12345, 1 << 20])
def test_relu_kernels_gpu(dtype, n, rng):
    torch = pytest.importorskip("torch")
    y_np = rng.standard_normal(n)
    y_np[::7] = 0.0
    y = to_torch(y_np, dtype)
    y_np = to_numpy(y)
    y_np[np.isnan(y_np)] = 0
    mask = poison(torch.empty(((n + 31) // 32,), dtype=torch.int32, device="cuda"))
    igemm.relu_mask(y, out=mask)
    ref = reference.pack_mask(y_np > 0)
    np.testing.assert_array_equal(mask.cpu().numpy().view(np.uint32), ref)
    m2 = igemm.relu_mask(y)
    assert m2.dtype == torch.int32
    np.testing.assert_array_equal(m2.cpu().numpy().view(np.uint32), ref)
    dy = to_torch(rng.standard_normal(n), dtype)
    dy[::5] = float("inf")
    dx = igemm.relu_backward(dy, mask)
    dy_np = dy.float().cpu().numpy()
    np.testing.assert_array_equal(dx.float().cpu().numpy(), np.where(y_np > 0, dy_np, 0))
    # unaligned views take the scalar path
    if n > 3:
        dx2 = igemm.relu_backward(dy[1:], igemm.relu_mask(y[1:]))
        np.testing.assert_array_equal(dx2.float().cpu().numpy(), np.where(y_np[1:] > 0, dy_np[1:], 0))


@pytest.mark.gpu
def test_relu_numpy_inputs_on_gpu(rng):
    y = rng.standard_normal(1000).astype(np.float32)
    m = igemm.relu_mask(y)
    assert isinstance(m, np.ndarray)
    np.testing.assert_array_equal(m, reference.pack_mask(y > 0))
