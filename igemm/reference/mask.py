"""The 1-bit ReLU mask (ARCHITECTURE.md) and ReLU's backward, in numpy."""
from __future__ import annotations

import numpy as np

__all__ = ["pack_mask", "unpack_mask", "relu_backward"]


def pack_mask(bits) -> np.ndarray:
    """uint32[ceil(L/32)]: bit i%32 of word i//32 = bits.ravel()[i] (memory order); bits past L are 0."""
    b = np.ascontiguousarray(bits, dtype=bool).ravel()
    nwords = (b.size + 31) // 32
    packed = np.packbits(b, bitorder="little")
    buf = np.zeros(nwords * 4, dtype=np.uint8)
    buf[:packed.size] = packed
    return buf.view("<u4").astype(np.uint32)


def unpack_mask(mask, numel: int) -> np.ndarray:
    """bool[numel] from a mask (uint32 or int32 words)."""
    words = np.ascontiguousarray(mask).view(np.uint32).astype("<u4")
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:numel].astype(bool)


def relu_backward(dy, mask) -> np.ndarray:
    """dx = bit ? dy : 0 (a select: inf/NaN where the bit is 0 give 0)."""
    dy = np.asarray(dy)
    bits = unpack_mask(mask, dy.size).reshape(dy.shape)
    return np.where(bits, dy, np.zeros_like(dy))
