"""The conv's NCHW transpose path: x NCHW -> NHWC and w KCRS -> KRSC in one launch (``csrc/transpose.cuh``).

An NCHW plan on this path gathers its im2col tiles with 16-byte loads from the NHWC copy (the NCHW
gather moves one 2-byte element per load) and stores NCHW directly from the epilogue, so only the input
and the filter make the round trip. ``igemm/_heuristics.nchw_path`` decides when.
"""
from __future__ import annotations

from functools import lru_cache

from . import _kernel
from ._kernel import ParamSpec

__all__ = ["TransposeJob", "launch_pair", "precompile"]

PARAMS = [ParamSpec("src0", "ptr"), ParamSpec("dst0", "ptr"),
          *(ParamSpec(n + "0", "int32") for n in ("rows", "cols", "tr", "tc", "blocks")),
          ParamSpec("src1", "ptr"), ParamSpec("dst1", "ptr"),
          *(ParamSpec(n + "1", "int32") for n in ("rows", "cols", "tr", "tc"))]
_TILE, _THREADS = 64, 256


def _ctype(esize: int) -> str:
    return {2: "uint16_t", 4: "uint32_t"}[esize]


@lru_cache(maxsize=None)
def _stub(esize: int, vec0: bool, vec1: bool) -> str:
    b = lambda v: "true" if v else "false"
    return _kernel.render_kernel(include="transpose.cuh", entry="igemm_transpose2", params=PARAMS, threads=_THREADS,
                                 body=f"igemm::xpose::transpose2<{_ctype(esize)}, {b(vec0)}, {b(vec1)}>(p);")


def _name(esize: int, vec0: bool, vec1: bool) -> str:
    return f"transpose2_{esize * 8}b_{'v' if vec0 else 's'}{'v' if vec1 else 's'}"


class TransposeJob:
    """``[batch][rows][cols] -> [batch][cols][rows]`` from ``src`` to ``dst`` (element size ``esize``)."""

    __slots__ = ("batch", "rows", "cols", "tr", "tc", "blocks", "esize")

    def __init__(self, batch: int, rows: int, cols: int, esize: int):
        self.batch, self.rows, self.cols, self.esize = batch, rows, cols, esize
        self.tr, self.tc = -(-rows // _TILE), -(-cols // _TILE)
        self.blocks = batch * self.tr * self.tc
        if self.blocks >= 2 ** 31 or batch * rows * cols >= 2 ** 62:
            raise NotImplementedError(f"transpose of {batch}x{rows}x{cols} is too large")

    def vec_ok(self, src: int, dst: int) -> bool:
        """16-byte loads and stores apply: 16-bit elements, rows and cols multiples of 8, aligned bases."""
        return self.esize == 2 and self.rows % 8 == 0 and self.cols % 8 == 0 and src % 16 == 0 and dst % 16 == 0


@lru_cache(maxsize=64)
def _launcher(esize: int, vec0: bool, vec1: bool, device_id: int, blocks: int):
    k = _kernel.load(_stub(esize, vec0, vec1), _name(esize, vec0, vec1), "igemm_transpose2", device_id)
    return _kernel.Launcher(k, blocks, _THREADS)


def launch_pair(device_id: int, stream: int, job0: TransposeJob, src0: int, dst0: int,
                job1: TransposeJob | None = None, src1: int = 0, dst1: int = 0) -> None:
    """Launch one kernel that runs ``job0`` (and ``job1``, if given) on ``stream``."""
    v0 = job0.vec_ok(src0, dst0)
    v1 = job1.vec_ok(src1, dst1) if job1 is not None else False
    vals = {"src0": src0, "dst0": dst0, "rows0": job0.rows, "cols0": job0.cols, "tr0": job0.tr, "tc0": job0.tc,
            "blocks0": job0.blocks}
    blocks = job0.blocks
    if job1 is not None:
        vals.update(src1=src1, dst1=dst1, rows1=job1.rows, cols1=job1.cols, tr1=job1.tr, tc1=job1.tc)
        blocks += job1.blocks
    _launcher(job0.esize, v0, v1, device_id, blocks)(stream, _kernel.bind_args(PARAMS, vals))


def precompile(arch: str, jobs: int | None = None) -> int:
    """Compile every variant (2- and 4-byte elements x vectorised or not, per job)."""
    from . import _build
    items = [(_name(e, a, b), _stub(e, a, b)) for e in (2, 4) for a in (False, True) for b in (False, True)
             if e == 2 or not (a or b)]
    return _build.compile_many(items, arch, jobs)
