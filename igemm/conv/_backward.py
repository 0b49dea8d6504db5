"""The convolution backward's problems: ``Conv2dGradInputPlan`` (dgrad) and ``Conv2dGradWeightPlan`` (wgrad).

On sm_90a, 16-bit NHWC problems run the native kernels (:mod:`._native`), which use dgrad's phases below; the rest
run on the forward's kernels (:class:`Conv2dPlan`, so its tile rules, wgmma/TMA mainloops and split-K), with the
operands moved by :mod:`._moves`:

- **dgrad** is a stride-1 convolution of dy with the filter flipped and its K and C swapped. A strided problem
  is split by output phase (h mod stride, w mod stride): phase (ph, pw) of dx reads only the taps r with
  ``(ph + pad - r·dil) % stride == 0``, so each phase is a stride-1 convolution of dy with that sub-filter and
  no multiply is spent on the zeros a stride puts in the transposed problem; its output is interleaved into
  dx. A phase no tap reaches is zero.
- **wgrad** ``dw[k, r, s, c] = Σ_{n,p,q} dy[n,p,q,k]·x[n, p·st + r·dil − pad, …, c]`` is a forward convolution
  with the roles turned: x as a batch of C images of N channels (zero-padded by the move), dy as K filters of
  P x Q taps, stride ``dil``, dilation ``st``; its output (C, R, S, K) is permuted into dw.

The ReLU mask (``bit ? dy : 0``) and the BN-backward prologue (``a[k]·g + b[k]·z + c[k]``) are applied where dy
is moved: in the wgrad's transpose of dy at no extra pass, before dgrad as one elementwise pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ._moves import Move, contiguous
from ._problem import geometry
from ._transpose import TransposeJob

__all__ = ["GradInputProblem", "GradWeightProblem", "Phase", "Phase1D", "phases_1d"]



@dataclass(frozen=True)
class Phase1D:
    """One output phase of dgrad along one dim: dx rows ``ph + st·i`` (i < rows) are rows ``crop + i`` of a
    stride-1 convolution of dy (padding ``pad``, dilation ``dil``) with the filter taps ``last, last − step,
    …`` (``taps`` of them; 0: no tap reaches these rows, they are zero)."""
    ph: int
    rows: int
    taps: int
    last: int = 0
    step: int = 1
    dil: int = 1
    pad: int = 0
    crop: int = 0
    out: int = 0          # the sub-convolution's output length


def phases_1d(st: int, pad: int, dil: int, R: int, H: int, P: int) -> list[Phase1D]:
    """dgrad's phases along one dim, one per ``ph < min(st, H)``."""
    out = []
    g = math.gcd(st, dil)
    step, sdil = st // g, dil // g
    for ph in range(min(st, H)):
        rows = (H - ph + st - 1) // st
        first = next((r for r in range(min(R, step)) if (ph + pad - r * dil) % st == 0), None)
        if first is None:
            out.append(Phase1D(ph, rows, 0))
            continue
        taps = len(range(first, R, step))
        last = first + (taps - 1) * step
        o_last = (ph + pad - last * dil) // st      # dy row of dx row ph through the last tap
        p = max(0, -o_last)
        while o_last + p + rows > P + 2 * p - sdil * (taps - 1):
            p += 1
        out.append(Phase1D(ph, rows, taps, last, step, sdil, p, o_last + p, P + 2 * p - sdil * (taps - 1)))
    return out


@dataclass(frozen=True)
class Phase:
    """One 2-D phase of dgrad."""
    h: Phase1D
    w: Phase1D

    @property
    def zero(self) -> bool:
        return self.h.taps == 0 or self.w.taps == 0


class _Forward:
    """The forward problem a gradient belongs to: its geometry and the three tensors' shapes."""

    def __init__(self, x_shape, w_shape, layout: str, stride, padding, dilation):
        (self.N, self.C, self.H, self.W, self.K, self.R, self.S, self.P, self.Q, self.stride, self.padding,
         self.dilation) = geometry(x_shape, w_shape, layout, stride, padding, dilation)
        self.layout = layout
        self.x_shape, self.w_shape = tuple(x_shape), tuple(w_shape)
        N, K, P, Q = self.N, self.K, self.P, self.Q
        self.dy_shape = (N, K, P, Q) if layout == "NCHW" else (N, P, Q, K)


def _nhwc_dy_move(g) -> Move:
    """An NCHW problem's dy -> (N, P, Q, K), the mask / prologue applied on the way (channel dim 3; tiled: the source
    is contiguous along Q)."""
    N, K, P, Q = g.N, g.K, g.P, g.Q
    return Move((N, P, Q, K), (K * P * Q, Q, 1, P * Q), contiguous((N, P, Q, K)), tb=2, cdim=3, K=K)


class GradInputProblem(_Forward):
    """dgrad of one forward problem: its phases, their sub-filters, sub-convolutions and interleaves."""

    def __init__(self, x_shape, w_shape, layout: str, stride, padding, dilation):
        super().__init__(x_shape, w_shape, layout, stride, padding, dilation)
        P, Q = self.P, self.Q
        hs = phases_1d(self.stride[0], self.padding[0], self.dilation[0], self.R, self.H, P)
        ws = phases_1d(self.stride[1], self.padding[1], self.dilation[1], self.S, self.W, Q)
        self.phases = [Phase(h, w) for h in hs for w in ws]
        one = self.phases[0]
        #: one phase whose sub-convolution's output is dx itself (stride 1, no crop)
        self.direct = (len(self.phases) == 1 and not one.zero and one.h.crop == 0 and one.w.crop == 0
                       and one.h.out == self.H and one.w.out == self.W)

    def nhwc(self) -> "GradInputProblem":
        """The same problem in NHWC (shapes (N, H, W, C), (K, R, S, C))."""
        return GradInputProblem((self.N, self.H, self.W, self.C), (self.K, self.R, self.S, self.C), "NHWC",
                                self.stride, self.padding, self.dilation)

    def nhwc_twin(self) -> "GradInputProblem":
        """The NHWC problem whose kernel runs an NCHW one on transposed copies: :meth:`nhwc`, or for a strided 1x1
        without padding (C % 8 == 0) the stride-1 1x1 whose dx holds only the pixels a tap reaches, scattered back
        with the zeros between (:meth:`dx_job`)."""
        if self._scatters():
            return GradInputProblem((self.N, self.P, self.Q, self.C), (self.K, 1, 1, self.C), "NHWC", 1, 0, 1)
        return self.nhwc()

    def dx_job(self) -> TransposeJob:
        """The transpose of :meth:`nhwc_twin`'s dx [N][pixels][C] into dx [N][C][HW]."""
        if self._scatters():
            return TransposeJob(self.N, self.P * self.Q, self.C, 2, pitch=self.H * self.W,
                                scatter=(self.Q, self.W, *self.stride))
        return TransposeJob(self.N, self.H * self.W, self.C, 2)

    def _scatters(self) -> bool:
        return self.R == self.S == 1 and self.padding == (0, 0) and self.stride != (1, 1) and self.C % 8 == 0

    def nhwc_moves(self) -> tuple[Move]:
        """For an NCHW problem: dy -> (N, P, Q, K) with the mask / prologue applied on the way (dy without a mask or
        prologue, w and the twin's dx take the forward's transpose kernel)."""
        return (_nhwc_dy_move(self),)

    def w_transposed_ok(self) -> bool:
        """An NCHW 1x1 stride-1 unpadded problem: its one phase's filter is w [K][C] transposed, which the TMA
        kernels can read as it lies (``Conv2dPlan(_w_mn=True)``)."""
        return (self.layout == "NCHW" and self.R == self.S == 1 and self.stride == (1, 1)
                and self.padding == (0, 0) and self.direct)

    def w_flipped_ok(self) -> bool:
        """An NCHW stride-1 problem with taps: its one phase's filter is w with K and C swapped and every tap
        flipped, which the transpose path's preparation can make from w itself (``Conv2dPlan(_w_flip=True)``)."""
        return (self.layout == "NCHW" and self.stride == (1, 1) and self.R * self.S > 1 and self.direct
                and all(ph.h.step == ph.w.step == 1 and ph.h.taps == self.R and ph.w.taps == self.S
                        and ph.h.last == self.R - 1 and ph.w.last == self.S - 1 for ph in self.phases))

    def sub_w_shape(self, ph: Phase) -> tuple:
        return ((self.C, self.K, ph.h.taps, ph.w.taps) if self.layout == "NCHW"
                else (self.C, ph.h.taps, ph.w.taps, self.K))

    def sub_y_shape(self, ph: Phase) -> tuple:
        return ((self.N, self.C, ph.h.out, ph.w.out) if self.layout == "NCHW"
                else (self.N, ph.h.out, ph.w.out, self.C))

    def sub_plan_args(self, ph: Phase) -> dict:
        """Conv2dPlan arguments of the phase's sub-convolution (x: dy)."""
        return dict(x_shape=self.dy_shape, w_shape=self.sub_w_shape(ph), layout=self.layout, stride=1,
                    padding=(ph.h.pad, ph.w.pad), dilation=(ph.h.dil, ph.w.dil))

    def filter_move(self, ph: Phase) -> Move:
        """w -> the phase's sub-filter: its taps flipped, K and C swapped."""
        if self.layout == "NCHW":     # w[K][C][R][S] -> f[C][K][Tr][Ts]
            sK, sC, sR, sS = contiguous(self.w_shape)
            src = (sC, sK, -ph.h.step * sR, -ph.w.step * sS)
        else:                         # w[K][R][S][C] -> f[C][Tr][Ts][K]
            sK, sR, sS, sC = contiguous(self.w_shape)
            src = (sC, -ph.h.step * sR, -ph.w.step * sS, sK)
        shape = self.sub_w_shape(ph)
        return Move(shape, src, contiguous(shape), base=ph.h.last * sR + ph.w.last * sS,
                    tb=0 if self.layout == "NHWC" else None)     # (NHWC: read along c, written along k)

    def interleave_move(self, ph: Phase) -> tuple[Move, int]:
        """(move, dx element offset): the phase's sub-convolution output (zeros for a zero phase) -> its rows
        and columns of dx."""
        dxs = contiguous(self.x_shape)
        sth, stw = self.stride
        ih, iw = (2, 3) if self.layout == "NCHW" else (1, 2)
        shape = list(self.x_shape)
        shape[ih], shape[iw] = ph.h.rows, ph.w.rows
        dst = list(dxs)
        dst[ih], dst[iw] = sth * dxs[ih], stw * dxs[iw]
        off = [0, 0, 0, 0]
        if ph.zero:
            lim = (0, 0, 0, 0)
            src = (0, 0, 0, 0)
        else:
            sy = self.sub_y_shape(ph)
            src, lim = contiguous(sy), sy
            off[ih], off[iw] = ph.h.crop, ph.w.crop
        return (Move(tuple(shape), tuple(src), tuple(dst), tuple(off), tuple(lim)),
                ph.h.ph * dxs[ih] + ph.w.ph * dxs[iw])


class GradWeightProblem(_Forward):
    """wgrad of one forward problem as a forward convolution with the roles turned (module doc)."""

    def __init__(self, x_shape, w_shape, layout: str, stride, padding, dilation):
        super().__init__(x_shape, w_shape, layout, stride, padding, dilation)
        N, C, K, P, Q = self.N, self.C, self.K, self.P, self.Q
        (sth, stw), (dh, dw) = self.stride, self.dilation
        #: x turned: C images of N channels, the rows the taps reach (zero-padded), so the output is R x S
        self.Hx = (self.R - 1) * dh + (P - 1) * sth + 1
        self.Wx = (self.S - 1) * dw + (Q - 1) * stw + 1
        self.xt_shape = (C, self.Hx, self.Wx, N)
        self.dyt_shape = (K, P, Q, N)
        self.yt_shape = (C, self.R, self.S, K)

    def sub_plan_args(self) -> dict:
        return dict(x_shape=self.xt_shape, w_shape=self.dyt_shape, layout="NHWC", stride=self.dilation,
                    padding=0, dilation=self.stride)

    # ---- a 1x1 unpadded problem: one GEMM over N·P·Q, one operand read in place, the other moved
    def gemm_role(self, fused: bool) -> str | None:
        """Which operand the GEMM form reads in place: ``"dy"`` (x moved, subsampled by the stride), ``"x"``
        (stride 1: dy moved, the mask / prologue applied on the way), or None (not a 1x1 unpadded problem).
        The smaller of the two is moved; ``fused`` (a mask or prologue) does not change that."""
        if not (self.R == self.S == 1 and self.padding == (0, 0)):
            return None
        if self.stride != (1, 1):
            return "dy"
        # moving dy costs a transpose, its pre-pass (the mask / prologue) a streaming copy: measured, the
        # smaller operand moved wins either way (docs/performance.md: wgrad-gemm-form)
        return "x" if self.C > self.K else "dy"

    def gemm_plan_args(self, role: str) -> dict:
        """The forward convolution that is the GEMM; the in-place operand has M = K ("dy") or C ("x") channels, the
        moved one, w' = (cols, N·P·Q), the other. NHWC: the NCHW 1x1 forward of x' = the in-place operand as
        (1, N·P·Q, M, 1) (its rows are the reduction, read as MN-major tiles); y' = (1, cols, M, 1). NCHW: the
        NHWC forward of x' = the in-place operand as one image of N rows, M columns and P·Q channels, with an
        N x 1 filter (w' as (cols, N, 1, P·Q)); y' = (1, 1, M, cols) (docs/performance.md: wgrad-nchw-taps)."""
        npq = self.N * self.P * self.Q
        m, n = (self.K, self.C) if role == "dy" else (self.C, self.K)
        if self.layout == "NCHW":
            pq = self.P * self.Q
            return dict(x_shape=(1, self.N, m, pq), w_shape=(n, self.N, 1, pq), layout="NHWC", stride=1,
                        padding=0, dilation=1)
        return dict(x_shape=(1, npq, m, 1), w_shape=(n, npq, 1, 1), layout="NCHW", stride=1, padding=0, dilation=1)

    def gemm_operand_move(self, role: str) -> Move:
        """The moved operand, as w' rows [cols][N][P·Q]: x subsampled (role "dy"), or dy (role "x": channel dim 0).
        The tiled kernel where the source is channels-last (``tb`` 0), 16-byte rows where it is NCHW."""
        N, P, Q, C, K = self.N, self.P, self.Q, self.C, self.K
        if role == "dy":
            sN, sC, sH, sW = _nchw_strides(self.x_shape, self.layout)
            shape, src = (C, N, P, Q), (sC, sN, self.stride[0] * sH, self.stride[1] * sW)
        else:
            sN, sK, sP, sQ = _nchw_strides(self.dy_shape, self.layout)
            shape, src = (K, N, P, Q), (sK, sN, sP, sQ)
        if self.layout == "NHWC":
            return Move(shape, src, contiguous(shape), tb=0, cdim=0, K=K)
        if src[2:] == (Q, 1):                 # NCHW at stride 1: rows of P·Q elements
            shape, src = (*shape[:2], 1, P * Q), (*src[:2], 0, 1)
        return Move(shape, src, contiguous(shape), cdim=0, K=K)

    def gemm_out_transposed(self, role: str) -> bool:
        """Whether y' is dw's transpose (C, K): NHWC role "dy", NCHW role "x"; else it is dw's memory (K, C)."""
        return (role == "dy") == (self.layout == "NHWC")

    def gemm_out_move(self, role: str) -> Move:
        """y' -> dw (K, 1, 1, C): a transpose where y' is (C, K) (:meth:`gemm_out_transposed`), else a copy."""
        K, C = self.K, self.C
        t = self.gemm_out_transposed(role)
        return Move((K, 1, 1, C), (1, 0, 0, K) if t else (C, 0, 0, 1), contiguous((K, 1, 1, C)), tb=0 if t else None)

    def x_move(self) -> Move:
        """x -> xt[c][h'][w'][n] = x[n][h' − pad_h][w' − pad_w][c] (zero outside x)."""
        ph, pw = self.padding
        src, tb = _turned(self.x_shape, self.layout)
        return Move(self.xt_shape, src, contiguous(self.xt_shape), off=(0, -ph, -pw, 0),
                    lim=(self.C, self.H, self.W, self.N), tb=tb)

    def dy_move(self) -> Move:
        """dy -> dyt[k][p][q][n] (the mask / BN prologue applied on the way: channel dim 0)."""
        src, tb = _turned(self.dy_shape, self.layout)
        return Move(self.dyt_shape, src, contiguous(self.dyt_shape), tb=tb, cdim=0, K=self.K)

    def w_move(self) -> Move:
        """yt[c][r][s][k] -> dw (w's layout)."""
        sC, sR, sS, sK = contiguous(self.yt_shape)
        if self.layout == "NCHW":     # dw[K][C][R][S]
            return Move(self.w_shape, (sK, sC, sR, sS), contiguous(self.w_shape), tb=0)
        return Move(self.w_shape, (sK, sR, sS, sC), contiguous(self.w_shape), tb=0)

    # ---- an NCHW problem on the native kernels: its NHWC twin, x and dy transposed to NHWC, dw moved back
    def nhwc(self) -> "GradWeightProblem":
        """The same problem in NHWC (shapes (N, H, W, C), (K, R, S, C))."""
        return GradWeightProblem((self.N, self.H, self.W, self.C), (self.K, self.R, self.S, self.C), "NHWC",
                                 self.stride, self.padding, self.dilation)

    def nhwc_twin(self) -> "GradWeightProblem":
        """The NHWC problem whose kernel runs an NCHW one on transposed copies: :meth:`nhwc`, or for a strided 1x1
        without padding the stride-1 1x1 on the pixels it reads, x[:, :, ::sh, ::sw] (:meth:`x_job`)."""
        if self._reads_sub():
            return GradWeightProblem((self.N, self.P, self.Q, self.C), (self.K, 1, 1, self.C), "NHWC", 1, 0, 1)
        return self.nhwc()

    def x_job(self):
        """The transpose of x [N][C][HW] into :meth:`nhwc_twin`'s x [N][pixels][C] (``igemm/conv/_transpose.py``)."""
        if self._reads_sub():
            sh, sw = self.stride
            return TransposeJob(self.N, self.C, self.P * self.Q, 2, sub=(self.Q, self.W, sh, sw, self.H * self.W))
        return TransposeJob(self.N, self.C, self.H * self.W, 2)

    def _reads_sub(self) -> bool:
        return self.R == self.S == 1 and self.padding == (0, 0) and self.stride != (1, 1)

    def nhwc_moves(self) -> tuple[Move, Move]:
        """For an NCHW problem: dy -> (N, P, Q, K) with the mask / prologue applied on the way (channel dim 3;
        tiled: the source is contiguous along Q), and dw' (K, R, S, C) -> dw (K, C, R, S), walked as (C, K, R, S)
        so that the tile's source-contiguous dim is 0. (x, and dy without a mask or prologue, take the forward's
        NCHW -> NHWC transpose.)"""
        C, K, R, S = self.C, self.K, self.R, self.S
        w = Move((C, K, R, S), (1, R * S * C, S * C, C), (R * S, C * R * S, S, 1), tb=0)
        return _nhwc_dy_move(self), w


def _nchw_strides(shape, layout: str) -> tuple:
    """An activation's element strides in (images, channels, rows, columns) order."""
    st = contiguous(shape)
    return st if layout == "NCHW" else (st[0], st[3], st[1], st[2])


def _turned(shape, layout: str) -> tuple:
    """An activation (x or dy) read turned, as (channels, rows, columns, images): its element strides in that order,
    and the dim its memory is contiguous along (the tiled move's ``tb``)."""
    if layout == "NCHW":
        sN, sC, sH, sW = contiguous(shape)
        return (sC, sH, sW, sN), 2
    sN, sH, sW, sC = contiguous(shape)
    return (sC, sH, sW, sN), 0
