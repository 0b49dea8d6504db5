"""Magic-number division: exhaustive over divisors 1..65536 against // and %, on the CPU."""
import numpy as np
import pytest

from igemm.fastdiv import MAX_DIVIDEND, div_like_device, divmod_like_device, magic


def _grid() -> np.ndarray:
    dense = np.arange(0, 1 << 12, dtype=np.uint64)                       # every dividend < 4096
    sparse = np.linspace(0, MAX_DIVIDEND - 1, 1 << 12, dtype=np.uint64)  # across the whole range
    top = np.arange(MAX_DIVIDEND - 1024, MAX_DIVIDEND, dtype=np.uint64)  # the top of the range
    return np.unique(np.concatenate([dense, sparse, top]))


def test_all_divisors_up_to_65536():
    """Every divisor 1..65536, over a fixed grid plus, per divisor, the dividends next to multiples of it."""
    base = _grid()
    rng = np.random.default_rng(0)
    for lo in range(2, 65537, 512):
        d = np.arange(lo, min(lo + 512, 65537), dtype=np.uint64)
        # k*d - 1 and k*d for k spread over the range (where a wrong multiplier would show first)
        kmax = (MAX_DIVIDEND - 1) // d
        k = (rng.random((d.size, 64)) * kmax[:, None]).astype(np.uint64) + np.uint64(1)
        near = np.concatenate([k * d[:, None] - np.uint64(1), np.minimum(k * d[:, None], MAX_DIVIDEND - 1)], axis=1)
        n = np.concatenate([np.broadcast_to(base, (d.size, base.size)), near], axis=1)
        mags = np.array([magic(int(v)) for v in d], dtype=np.uint64)
        q = (n * mags[:, 1:2]) >> (np.uint64(32) + mags[:, 2:3])
        expect = n // d[:, None]
        if not np.array_equal(q, expect):
            i, j = np.argwhere(q != expect)[0]
            pytest.fail(f"d={d[i]}: {n[i, j]} // d gave {q[i, j]}, expected {expect[i, j]}")
    # d == 1 is special-cased on the device: q = n
    assert magic(1) == (1, 0, 0)
    np.testing.assert_array_equal(div_like_device(base, 1), base.astype(np.int64))


def test_near_multiples_of_each_divisor():
    """Dividends k*d - 1, k*d, k*d + 1 (where rounding errors would show) for sampled divisors."""
    rng = np.random.default_rng(1)
    for d in list(range(1, 2049)) + list(rng.integers(2049, MAX_DIVIDEND - 1, 2000)):
        d = int(d)
        k = np.unique(np.concatenate([np.arange(1, 64), rng.integers(1, (MAX_DIVIDEND - 2) // d + 1, 64)]))
        k = k[k * d + 1 < MAX_DIVIDEND].astype(np.int64)
        n = np.concatenate([k * d - 1, k * d, k * d + 1])
        q, r = divmod_like_device(n.astype(np.uint64), d)
        np.testing.assert_array_equal(q, n // d, err_msg=f"d={d}")
        np.testing.assert_array_equal(r, n % d, err_msg=f"d={d}")


@pytest.mark.parametrize("d", [1, 2, 4, 1 << 16, 1 << 30, 3, 7, 49, 3136, 12544, MAX_DIVIDEND - 1])
def test_edge_divisors(d):
    n = np.array([0, 1, d - 1, d, d + 1, MAX_DIVIDEND // 2, MAX_DIVIDEND - 2, MAX_DIVIDEND - 1], dtype=np.uint64)
    n = n[n < MAX_DIVIDEND]
    np.testing.assert_array_equal(div_like_device(n, d), n.astype(np.int64) // d)
    dd, mul, shr = magic(d)
    assert dd == d and 0 <= mul < 2 ** 32 and 0 <= shr < 32


@pytest.mark.parametrize("bad", [0, -1, MAX_DIVIDEND])
def test_bad_divisor(bad):
    with pytest.raises(ValueError):
        magic(bad)
