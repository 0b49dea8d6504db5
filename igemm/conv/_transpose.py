"""The conv's input preparation (``csrc/conv/transpose.cuh``), x and w in one launch:

* the NCHW transpose path: x NCHW -> NHWC and w KCRS -> KRSC. The plan then gathers its im2col tiles with
  16-byte loads from the NHWC copy (the NCHW gather moves one 2-byte element per load) and stores NCHW
  directly from the epilogue, so only the input and the filter make the round trip;
* the channel pad (16-bit, C < 8, either layout): x and w copied with C padded to 8 zero channels, so
  the gather uses 16-byte loads (the element gather of C = 3 is the slowest path there is);
* a 1x1 strided unpadded conv's NCHW x: only ``x[:, :, ::sh, ::sw]`` is copied (``sub``), and its inverse with
  the zeros between (``scatter``: the backward's NHWC twin's dx back to NCHW);
* the NCHW patch path's x (C <= 4): NCHW -> NHWC in 4 x 1024 tiles (then ``_unfold.Unfolded`` copies w).

``_paths.kernel_setup`` decides when.
"""
from __future__ import annotations

from functools import lru_cache

from .. import _kernel
from .._kernel import ParamSpec

__all__ = ["TransposeJob", "Prepared", "launch_pair", "precompile", "flip_ok"]

PARAMS = [ParamSpec("src0", "ptr"), ParamSpec("dst0", "ptr"),
          *(ParamSpec(n + "0", "int32") for n in ("rows", "cols", "pitch", "tr", "tc", "blocks", "scols", "q", "srow", "sw")),
          ParamSpec("src1", "ptr"), ParamSpec("dst1", "ptr"),
          *(ParamSpec(n + "1", "int32") for n in ("rows", "cols", "pitch", "tr", "tc", "grp"))]
_THREADS = 256


(SCALAR64, SCALAR16, VEC, PAD, SUB, WIDE, WIDEVEC, ROWSVEC, SUBVEC, COLSVEC, SCATTER,
 SCATTERVEC, VECFLIP) = range(13)                                              # job kinds (csrc/conv/transpose.cuh)
_TILE_COLS = {SCALAR64: 64, SCALAR16: 16, VEC: 64, SUB: 64, WIDE: 1024, WIDEVEC: 1024, SUBVEC: 64, VECFLIP: 64}
_RUN_MAX = 512          # ROWSVEC's columns / COLSVEC's rows at most: a tile's destination runs of 16 rows or more


def run_rows(n: int) -> int:
    """ROWSVEC's rows a tile for ``n`` columns (COLSVEC's columns for ``n`` rows): a multiple of 8 whose tile fits
    the kernel's shared memory (8704 elements), at most 256 (csrc/conv/transpose.cuh: run_rows)."""
    return min(256, 8704 // n // 8 * 8)


def flip_ok(rows: int, cols: int, grp: int, esize: int) -> bool:
    """Whether a flipped job (``TransposeJob(flip=grp)``) can move ``[rows][cols]``: 16-bit, both multiples of 8,
    ``cols`` whole groups."""
    return esize == 2 and grp > 0 and rows % 8 == 0 and cols % 8 == 0 and cols % grp == 0


def _ctype(esize: int) -> str:
    return {2: "uint16_t", 4: "uint32_t"}[esize]


@lru_cache(maxsize=None)
def _stub(esize: int, mode0: int, mode1: int) -> str:
    return _kernel.render_kernel(include="conv/transpose.cuh", entry="igemm_transpose2", params=PARAMS, threads=_THREADS,
                                 body=f"igemm::xpose::transpose2<{_ctype(esize)}, {mode0}, {mode1}>(p);")


def _name(esize: int, mode0: int, mode1: int) -> str:
    return f"transpose2_{esize * 8}b_{mode0}{mode1}"


class TransposeJob:
    """``[batch][rows][cols] -> [batch][cols][pitch]`` from ``src`` to ``dst`` (element size ``esize``;
    ``pitch >= rows``, the extra entries zero); with ``pad=True`` instead ``[cols][rows] -> [cols][pitch]``
    (a channel pad of ``cols`` pixels; ``batch`` must be 1). ``sub=(Q, W, sh, sw, H*W)``: the source rows
    are images of ``H*W`` pixels and destination column c is pixel ``(c // Q)*sh*W + (c % Q)*sw`` of them
    (``x[:, :, ::sh, ::sw]``, ``cols = P*Q``; job 0 of a launch only). ``scatter=(Q, W, sh, sw)``: its inverse,
    the source ``[batch][P*Q][C]`` (``rows = P*Q``, ``cols = C``; 16-bit, ``C % 8 == 0``, a 16-byte aligned
    source) into ``[batch][C][pitch = H*W]``, pixel ``(h, w)`` from source row ``(h // sh)*Q + w // sw`` where
    ``h % sh == w % sw == 0``, else zero (job 0 only). ``flip=g``: destination row ``j`` goes to
    ``(j // g)*g + g - 1 - j % g`` (a stride-1 dgrad's filter ``[K][C*R*S]`` into its sub-convolution's
    ``[C][R*S reversed][K]``; job 1 only, 16-bit, ``rows`` and ``cols`` multiples of 8, ``cols`` of ``g``,
    aligned bases: :func:`flip_ok`)."""

    __slots__ = ("batch", "rows", "cols", "esize", "pitch", "pad", "sub", "scatter", "flip", "_geo")

    def __init__(self, batch: int, rows: int, cols: int, esize: int, pitch: int | None = None, pad: bool = False,
                 sub: tuple[int, int, int, int, int] | None = None, scatter: tuple[int, int, int, int] | None = None,
                 flip: int = 0):
        self.batch, self.rows, self.cols, self.esize = batch, rows, cols, esize
        self.pitch = rows if pitch is None else pitch
        self.pad = pad
        self.sub, self.scatter, self.flip = sub, scatter, flip
        if (self.pitch < rows or (pad and batch != 1) or (sub is not None and (pad or sub[4] < cols))
                or (scatter is not None and (pad or sub is not None or esize != 2 or cols % 8))
                or (flip and (pad or sub is not None or scatter is not None or self.pitch != rows
                              or not flip_ok(rows, cols, flip, esize)))):
            raise ValueError(f"bad job: batch {batch}, rows {rows}, cols {cols}, pitch {self.pitch}, pad {pad}, "
                             f"sub {sub}, scatter {scatter}, flip {flip}")
        if sub is not None and batch * rows * sub[4] >= 2 ** 62:
            raise NotImplementedError(f"transpose of {batch}x{rows}x{sub[4]} is too large")
        if (cols >= 2 ** 31 or batch * -(-self.pitch // 64) * -(-cols // 16) >= 2 ** 31
                or batch * self.pitch * cols >= 2 ** 62):
            raise NotImplementedError(f"transpose of {batch}x{rows}x{cols} is too large")
        self._geo = {}

    def mode(self, src: int, dst: int, first: bool = True) -> int:
        """``PAD`` for pad jobs; ``SUBVEC`` (16-bit, stride 2 along W, even Q, 8-byte aligned loads) or ``SUB``
        for subsampled ones; for the first job of a launch with rows <= 4
        (conv1's C = 3) 4 x 1024 tiles, ``WIDEVEC`` (16-byte accesses: 16-bit, cols % 8 == 0, aligned bases)
        or ``WIDE``; 16-byte tiles for 16-bit elements with no padding and aligned bases: ``VEC`` (64 x 64) where
        rows and cols are multiples of 8, ``ROWSVEC`` (:func:`run_rows` rows x all cols: a filter's taps, an image
        of 196 or 49 pixels) where only rows are and cols <= 512, ``COLSVEC`` (its mirror: all rows x
        ``run_rows(rows)`` cols) where only cols are and rows <= 512; else element tiles, 256 x 16 for short rows
        (cols <= 16), 64 x 64."""
        if self.pad:
            return PAD
        if self.flip:
            if first or src % 16 or dst % 16:
                raise ValueError("flip: job 1 of a launch, with 16-byte aligned source and destination")
            return VECFLIP
        if self.scatter is not None:
            if src % 16:
                raise ValueError("scatter: the source must be 16-byte aligned")
            return SCATTERVEC if self.pitch % 8 == 0 and dst % 16 == 0 else SCATTER
        if self.sub is not None:
            q, w_, sh, sw, hw = self.sub
            if (self.esize == 2 and sw == 2 and q % 2 == 0 and 2 * q <= w_ and hw % 4 == 0 and sh * w_ % 4 == 0
                    and self.pitch == self.rows and self.rows % 8 == 0 and src % 8 == 0 and dst % 16 == 0):
                return SUBVEC       # pairs of pixels from 8-byte loads, 16-byte stores
            return SUB
        if first and self.rows <= 4 and self.pitch <= 4 and self.cols >= 1024:
            vec = self.esize == 2 and self.cols % 8 == 0 and src % 16 == 0 and dst % 16 == 0
            return WIDEVEC if vec else WIDE
        if self.esize == 2 and self.pitch == self.rows and src % 16 == 0 and dst % 16 == 0:
            r8, c8 = self.rows % 8 == 0, self.cols % 8 == 0
            if r8 and c8:
                return VEC
            if r8 and self.cols <= _RUN_MAX:
                return ROWSVEC      # the tile's source one contiguous run (docs/performance.md: transpose-run-tiles)
            if c8 and self.rows <= _RUN_MAX:
                return COLSVEC      # the tile's destination one contiguous run
        return SCALAR16 if self.cols <= 16 else SCALAR64

    def geometry(self, mode: int) -> tuple[int, int, int]:
        """(row tiles, col tiles, blocks) for a job kind."""
        g = self._geo.get(mode)
        if g is None:
            if mode == PAD:
                g = (1, 1, -(-self.cols * self.pitch // 4096))
            elif mode in (SCATTER, SCATTERVEC):       # 64 channels x 64 destination pixels
                g = (-(-self.cols // 64), -(-self.pitch // 64))
                g = (*g, self.batch * g[0] * g[1])
            else:
                if mode == ROWSVEC:
                    tr, tc = run_rows(self.cols), self.cols
                elif mode == COLSVEC:
                    tr, tc = self.pitch, run_rows(self.rows)
                else:
                    tc = _TILE_COLS[mode]
                    tr = 4096 // tc if mode not in (VEC, VECFLIP) else 64
                g = (-(-self.pitch // tr), -(-self.cols // tc), self.batch * -(-self.pitch // tr) * -(-self.cols // tc))
            self._geo[mode] = g
        return g


@lru_cache(maxsize=64)
def _launcher(esize: int, mode0: int, mode1: int, device_id: int, blocks: int):
    k = _kernel.load(_stub(esize, mode0, mode1), _name(esize, mode0, mode1), "igemm_transpose2", device_id)
    return _kernel.Launcher(k, blocks, _THREADS)


def launch_pair(device_id: int, stream: int, job0: TransposeJob, src0: int, dst0: int,
                job1: TransposeJob | None = None, src1: int = 0, dst1: int = 0) -> None:
    """Launch one kernel that runs ``job0`` (and ``job1``, if given) on ``stream`` (a one-shot :class:`Prepared`)."""
    Prepared(device_id, job0, dst0, job1, dst1)(stream, src0, src1)


class Prepared:
    """A plan's transpose launch with its destinations fixed: :meth:`steps` only picks the variant for the
    sources' alignment (kept per variant: launcher and packed arguments; the variant of each source alignment
    remembered). Not thread-safe by itself (the conv plan calls it under its lock)."""

    __slots__ = ("device_id", "job0", "dst0", "job1", "dst1", "_variants", "_by_align")

    def __init__(self, device_id: int, job0: TransposeJob, dst0: int, job1: TransposeJob | None = None, dst1: int = 0):
        if job1 is not None and (job1.sub is not None or job1.scatter is not None):
            raise ValueError("a subsampled or scattered job runs as job 0 of a launch")
        self.device_id, self.job0, self.dst0, self.job1, self.dst1 = device_id, job0, dst0, job1, dst1
        self._variants = {}
        self._by_align = {}       # (src0 % 16, src1 % 16) -> variant: a job's mode reads no other bit of a source

    def __call__(self, stream: int, src0: int, src1: int = 0) -> None:
        """Launch on ``stream`` (a one-shot call: a plan runs :meth:`steps` in its launch record)."""
        _kernel.run_steps(self.steps(src0, src1), stream, src0, src1)

    def steps(self, src0: int, src1: int, codes: tuple = (_kernel.SRC_X, _kernel.SRC_W)) -> list:
        """The launch step for sources of these alignments; ``codes``: what the two source slots receive."""
        v = self._by_align.get((src0 & 15, src1 & 15))
        if v is None:
            v = self._by_align[(src0 & 15, src1 & 15)] = self._variant(src0, src1)
        launcher, args, s0, s1 = v
        return [_kernel.Step(launcher, args, ((s0, codes[0], 0), (s1, codes[1], 0)))]

    def _variant(self, src0: int, src1: int) -> tuple:
        """(launcher, packed arguments, source slots) of the variant for these sources."""
        j0, j1 = self.job0, self.job1
        key = (j0.mode(src0, self.dst0), j1.mode(src1, self.dst1, first=False) if j1 is not None else SCALAR64)
        v = self._variants.get(key)
        if v is None:
            tr0, tc0, blocks = j0.geometry(key[0])
            vals = {"dst0": self.dst0, "rows0": j0.rows, "cols0": j0.cols, "pitch0": j0.pitch, "tr0": tr0,
                    "tc0": tc0, "blocks0": blocks}
            if j0.sub is not None:
                q, w_, sh, sw, hw = j0.sub
                vals.update(scols0=hw, q0=q, srow0=sh * w_, sw0=sw)
            if j0.scatter is not None:
                q, w_, sh, sw = j0.scatter
                vals.update(scols0=w_, q0=q, srow0=sh, sw0=sw)
            if j1 is not None:
                tr1, tc1, b1 = j1.geometry(key[1])
                vals.update(dst1=self.dst1, rows1=j1.rows, cols1=j1.cols, pitch1=j1.pitch, tr1=tr1, tc1=tc1,
                            grp1=j1.flip)
                blocks += b1
            args = _kernel.pack_args(PARAMS, vals)
            v = self._variants[key] = (_launcher(j0.esize, key[0], key[1], self.device_id, blocks), args,
                                       args.slots["src0"], args.slots["src1"])
        return v


def precompile(arch: str, jobs: int | None = None) -> int:
    """Compile every variant (2- and 4-byte elements x the tile kind of each job)."""
    from .. import _build
    return _build.compile_many(all_variants(), arch, jobs)


def all_variants() -> list[tuple[str, str]]:
    """(cache name, stub) of every kernel variant."""
    out = []
    for e in (2, 4):
        modes = (SCALAR64, SCALAR16, VEC, PAD, ROWSVEC, COLSVEC) if e == 2 else (SCALAR64, SCALAR16, PAD)
        first = modes + ((SUB, WIDE, WIDEVEC, SUBVEC, SCATTER, SCATTERVEC) if e == 2 else (SUB, WIDE))
        second = modes + ((VECFLIP,) if e == 2 else ())
        out += [(_name(e, a, b), _stub(e, a, b)) for a in first for b in second]
    return out
