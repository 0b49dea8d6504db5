"""The width unfold (``csrc/conv/unfold.cuh``): the conv's input preparation for few-channel inputs.

A conv with C channels and an R x S filter is run as a conv with ``C' = roundup(S*C, V)`` channels and an
R x 1 filter (``V = 16 / element size``) on copies of x and w unfolded along the width::

    xu[n, h, q, s*C + c] = x[n, c, h, q*sw - pw + s*dw]   (zero outside the image and in lanes >= S*C)
    wu[k, r, 0, s*C + c] = w[k, c, r, s]

so the conv kernel gathers 16 bytes a load (C' % V == 0) where C % V != 0 left it one element a load,
with a reduction of ``R*C'`` (conv1, 7x7, C = 3 -> C' = 24: 168; the channel pad to 8: 392). One kernel
makes both copies, reading NCHW or NHWC sources through element strides; the conv then runs NHWC in,
``layout`` out (:func:`unfolded_problem`). ``_paths.kernel_setup`` decides when.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache

from .. import _kernel
from .._kernel import ParamSpec
from ._problem import unfold_channels

__all__ = ["unfold_channels", "fits", "unfolded_problem", "UnfoldJob", "Unfolded", "precompile", "all_variants"]

_FIELDS = (("src", "ptr"), ("dst", "ptr"), ("sa", "int64"), ("sb", "int64"), ("sc", "int64"), ("sw", "int64"),
           ("rows", "int32"), ("chunks", "fastdiv"), ("Q", "fastdiv"), ("B", "fastdiv"), ("C", "int32"),
           ("SC", "int32"), ("stride", "int32"), ("pad", "int32"), ("dil", "int32"), ("width", "int32"))
PARAMS = ([ParamSpec(n + "0", t) for n, t in _FIELDS] + [ParamSpec("blocks0", "int32")]
          + [ParamSpec(n + "1", t) for n, t in _FIELDS])
_THREADS = 256
_MAX_THREADS = 2 ** 31 - 2 * _THREADS          # a job's chunks (one thread each) as FastDiv dividends


def fits(pb, esize: int) -> bool:
    """Whether the unfold (one thread per 16-byte chunk of x's copy) and the conv on the copies stay within
    32-bit index math."""
    cp = unfold_channels(pb.C, pb.S, esize)
    return (pb.N * pb.H * pb.Q * (cp * esize // 16) < _MAX_THREADS and cp * pb.H * pb.Q < 2 ** 31
            and cp * pb.R < 2 ** 31)


def unfolded_problem(pb, esize: int):
    """The problem the conv kernel runs on the unfolded copies: NHWC in (``y`` keeps ``pb``'s layout),
    W -> Q, S -> 1, C -> C', the stride, padding and dilation along the width -> 1, 0, 1."""
    return dataclasses.replace(pb, C=unfold_channels(pb.C, pb.S, esize), W=pb.Q, S=1,
                               stride=(pb.stride[0], 1), padding=(pb.padding[0], 0), dilation=(pb.dilation[0], 1),
                               layout="NHWC", out_layout=pb.y_layout)


@lru_cache(maxsize=None)
def _stub(esize: int) -> str:
    t = {2: "uint16_t", 4: "uint32_t"}[esize]
    return _kernel.render_kernel(include="conv/unfold.cuh", entry="igemm_unfold2", params=PARAMS, threads=_THREADS,
                                 body=f"igemm::unfold::unfold2<{t}>(p);")


def _name(esize: int) -> str:
    return f"unfold2_{esize * 8}b"


class UnfoldJob:
    """Rows ``[A][B][Q]`` of ``Cp`` elements: element ``s*C + c`` of row ``(a, b, q)`` is the source
    element at ``a*sa + b*sb + c*sc + w*sw`` with ``w = q*stride - pad + s*dil`` (zero unless
    ``0 <= w < width`` and ``s < S``)."""

    __slots__ = ("A", "B", "Q", "C", "S", "Cp", "strides", "stride", "pad", "dil", "width", "esize")

    def __init__(self, A, B, Q, C, S, Cp, strides, stride, pad, dil, width, esize):
        self.A, self.B, self.Q, self.C, self.S, self.Cp = A, B, Q, C, S, Cp
        self.strides, self.stride, self.pad, self.dil, self.width, self.esize = strides, stride, pad, dil, width, esize
        if Cp < S * C or Cp * esize % 16 or A * B * Q * (Cp * esize // 16) >= _MAX_THREADS:
            raise NotImplementedError(f"unfold of {A}x{B}x{Q} rows of {Cp} elements")

    @classmethod
    def for_x(cls, pb, esize: int) -> "UnfoldJob":
        """x (``pb.layout``) -> ``[N][H][Q][C']``."""
        N, C, H, W = pb.N, pb.C, pb.H, pb.W
        st = (C * H * W, W, H * W, 1) if pb.layout == "NCHW" else (H * W * C, W * C, 1, C)
        return cls(N, H, pb.Q, C, pb.S, unfold_channels(C, pb.S, esize), st, pb.stride[1], pb.padding[1],
                   pb.dilation[1], W, esize)

    @classmethod
    def for_w(cls, pb, esize: int) -> "UnfoldJob":
        """w (KCRS for NCHW, KRSC for NHWC) -> ``[K][R][1][C']``."""
        K, C, R, S = pb.K, pb.C, pb.R, pb.S
        st = (C * R * S, S, R * S, 1) if pb.layout == "NCHW" else (R * S * C, S * C, 1, C)
        return cls(K, R, 1, C, S, unfold_channels(C, S, esize), st, 1, 0, 1, S, esize)

    @property
    def chunks(self) -> int:
        return self.Cp * self.esize // 16

    @property
    def blocks(self) -> int:
        return -(-self.A * self.B * self.Q * self.chunks // _THREADS)

    def values(self, i: int, dst: int) -> dict:
        sa, sb, sc, sw = self.strides
        v = dict(dst=dst, sa=sa, sb=sb, sc=sc, sw=sw, rows=self.A * self.B * self.Q, chunks=self.chunks, Q=self.Q,
                 B=self.B, C=self.C, SC=self.S * self.C, stride=self.stride, pad=self.pad, dil=self.dil,
                 width=self.width)
        return {f"{k}{i}": val for k, val in v.items()}


@lru_cache(maxsize=16)
def _launcher(esize: int, device_id: int, blocks: int):
    k = _kernel.load(_stub(esize), _name(esize), "igemm_unfold2", device_id)
    return _kernel.Launcher(k, blocks, _THREADS)


class Unfolded:
    """A plan's unfold launch with its destinations fixed: :meth:`steps` writes both copies (the same
    interface as :class:`igemm.conv._transpose.Prepared`)."""

    __slots__ = ("launcher", "args", "s0", "s1")

    def __init__(self, device_id: int, jx: UnfoldJob | None, dst_x: int, jw: UnfoldJob, dst_w: int):
        # jx None (the patch path: the kernel unfolds x itself): every block does w's job
        nx = jx.blocks if jx is not None else 0
        vals = {**(jx or jw).values(0, dst_x if jx is not None else dst_w), **jw.values(1, dst_w), "blocks0": nx}
        self.args = _kernel.pack_args(PARAMS, vals)
        self.launcher = _launcher(jw.esize, device_id, nx + jw.blocks)
        self.s0, self.s1 = self.args.slots["src0"], self.args.slots["src1"]

    def steps(self, x: int, w: int, codes: tuple = (_kernel.SRC_X, _kernel.SRC_W)) -> list:
        """The launch step; ``codes``: what the two source slots receive (x and w)."""
        return [_kernel.Step(self.launcher, self.args, ((self.s0, codes[0], 0), (self.s1, codes[1], 0)))]


def all_variants() -> list[tuple[str, str]]:
    """(cache name, stub) of every kernel variant (2- and 4-byte elements)."""
    return [(_name(e), _stub(e)) for e in (2, 4)]


def precompile(arch: str, jobs: int | None = None) -> int:
    from .. import _build
    return _build.compile_many(all_variants(), arch, jobs)
