"""Magic-number division (Hacker's Delight 10-9, CUTLASS ``FastDivmod``), computed on the host.

For a divisor ``d >= 1`` igemm passes ``(d, mul, shr)`` to the kernel, which divides a dividend
``0 <= n < 2**31`` as ``q = __umulhi(n, mul) >> shr`` (and ``q = n`` when ``d == 1``), ``r = n - q*d``
(``csrc/common.cuh: igemm::FastDiv``). With ``p = 31 + ceil(log2 d)``, ``mul = ceil(2**p / d)`` and
``shr = p - 32``, the result is exact for every dividend in that range; plans check that every dividend
a kernel divides stays below :data:`MAX_DIVIDEND` and refuse the problem otherwise.
"""
from __future__ import annotations

import numpy as np

__all__ = ["MAX_DIVIDEND", "magic", "divmod_like_device", "div_like_device"]

#: Dividends must satisfy ``0 <= n < MAX_DIVIDEND`` (they are int32 on the device).
MAX_DIVIDEND = 2 ** 31


def _ceil_log2(d: int) -> int:
    return (d - 1).bit_length()


def magic(d: int) -> tuple[int, int, int]:
    """``(d, mul, shr)`` for divisor ``d`` (1 <= d < 2**31), exactly as the device code uses them."""
    d = int(d)
    if not 1 <= d < 2 ** 31:
        raise ValueError(f"fast division needs 1 <= divisor < 2**31, got {d}")
    if d == 1:
        return 1, 0, 0
    p = 31 + _ceil_log2(d)
    mul = -(-(1 << p) // d)                   # ceil(2**p / d)
    assert mul < 2 ** 32
    return d, mul, p - 32


def div_like_device(n, d: int):
    """Quotient computed the device's way (vectorised over a numpy array ``n``)."""
    dd, mul, shr = magic(d)
    n = np.asarray(n, dtype=np.uint64)
    if dd == 1:
        return n.astype(np.int64)
    return ((n * np.uint64(mul)) >> np.uint64(32 + shr)).astype(np.int64)


def divmod_like_device(n, d: int):
    q = div_like_device(n, d)
    return q, np.asarray(n, dtype=np.int64) - q * d
