"""Kernel specialisation of the conv family: ``KernelSpec`` and ``choose_config(problem, arch)``.

A :class:`KernelSpec` fixes everything that is a template argument of ``igemm::conv::Config``; choosing
it is a pure function of the problem (shapes, dtypes, layout, epilogue structure, pointer alignment)
and the architecture, unit-tested without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

from ._runtime import DTYPE_CTYPE, DTYPE_SIZES

__all__ = ["ConvProblem", "KernelSpec", "choose_config"]


@dataclass(frozen=True)
class ConvProblem:
    N: int
    C: int
    H: int
    W: int
    K: int
    R: int
    S: int
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    dtype: str            # "float16" | "bfloat16" | "float32"
    layout: str           # "NCHW" | "NHWC"
    precision: str        # "strict" | "tf32" (fp32 only; 16-bit types always use tensor cores)
    epilogue: tuple = ()  # Chain.signature()
    residual_dtype: str | None = None

    @property
    def P(self) -> int:
        return (self.H + 2 * self.padding[0] - self.dilation[0] * (self.R - 1) - 1) // self.stride[0] + 1

    @property
    def Q(self) -> int:
        return (self.W + 2 * self.padding[1] - self.dilation[1] * (self.S - 1) - 1) // self.stride[1] + 1

    @property
    def M(self) -> int:
        return self.N * self.P * self.Q

    @property
    def Kred(self) -> int:
        return self.C * self.R * self.S

    @property
    def flops(self) -> int:
        return 2 * self.M * self.K * self.Kred

    @property
    def mask(self) -> bool:
        return any(sig == ("ReLU", True) for sig in self.epilogue)


@dataclass(frozen=True)
class KernelSpec:
    dtype: str
    layout: str
    math: str                 # "tensorop" | "simt"
    bm: int
    bn: int
    bk: int
    wm: int
    wn: int
    stages: int
    load_a: str               # "vec" | "elem"
    load_b: str
    store: str                # "rows" | "linear" | "nchw"
    vec_o: int
    fuse_mask: bool
    epilogue: tuple = ()      # C++ functor types, in order
    min_blocks: int = 1

    @property
    def threads(self) -> int:
        return self.wm * self.wn * 32 if self.math == "tensorop" else 256

    @property
    def smem(self) -> int:
        eb = DTYPE_SIZES[self.dtype]
        main = self.stages * (self.bm + self.bn) * self.bk * (eb if self.math == "tensorop" else 4)
        if self.layout == "NHWC":
            cs = self.bm * (self.bn + 8) * 4
        else:
            cs = self.bn * (self.bm + 4) * 4
        return max(main, cs)

    def config_type(self) -> str:
        t = DTYPE_CTYPE[self.dtype]
        ns = "igemm::conv::"
        epi = "igemm::epi::Chain<" + ", ".join(self.epilogue) + ">"
        args = [t, t, ns + ("kNHWC" if self.layout == "NHWC" else "kNCHW"),
                ns + ("kTensorOp" if self.math == "tensorop" else "kSimt"),
                self.bm, self.bn, self.bk, self.wm, self.wn, self.stages,
                ns + ("kLoadVec" if self.load_a == "vec" else "kLoadElem"),
                ns + ("kLoadVec" if self.load_b == "vec" else "kLoadElem"),
                ns + {"rows": "kStoreRows", "linear": "kStoreLinear", "nchw": "kStoreNCHW"}[self.store],
                self.vec_o, "true" if self.fuse_mask else "false", epi]
        return ns + "Config<" + ", ".join(str(a) for a in args) + ">"

    def name(self) -> str:
        return (f"conv_{self.dtype}_{self.layout}_{self.math}_{self.bm}x{self.bn}x{self.bk}_s{self.stages}"
                f"_{self.load_a}{self.load_b}_{self.store}{self.vec_o}{'_m' if self.fuse_mask else ''}")


def epilogue_functors(problem: ConvProblem) -> tuple[str, ...]:
    """C++ functor types for the problem's chain (affine group folded into one ScaleShift/Shift)."""
    out: list[str] = []
    sig = problem.epilogue
    i = 0
    while i < len(sig):
        kind = sig[i][0]
        if kind in ("BatchNorm", "Bias"):
            j = i
            has_scale = False
            while j < len(sig) and sig[j][0] in ("BatchNorm", "Bias"):
                has_scale |= sig[j][0] == "BatchNorm"
                j += 1
            out.append("igemm::epi::ScaleShift" if has_scale else "igemm::epi::Shift")
            i = j
            continue
        if kind == "Add":
            out.append(f"igemm::epi::AddResidual<{DTYPE_CTYPE[problem.residual_dtype or problem.dtype]}>")
        elif kind == "ReLU":
            out.append(f"igemm::epi::Relu<{'true' if sig[i][1] else 'false'}>")
        elif kind == "PReLU":
            out.append(f"igemm::epi::PRelu<{'true' if sig[i][1] else 'false'}>")
        else:
            raise NotImplementedError(f"epilogue op {kind}")
        i += 1
    return tuple(out)


def choose_config(pb: ConvProblem, arch: str = "sm_90a", *, x_aligned: bool = True,
                  w_aligned: bool = True) -> KernelSpec:
    """Pick the kernel for a problem. ``x_aligned``/``w_aligned``: base pointers 16-byte aligned."""
    eb = DTYPE_SIZES[pb.dtype]
    ce = 16 // eb
    simt = pb.dtype == "float32" and pb.precision == "strict"
    M, K = pb.M, pb.K
    if simt:
        math, bm, bn, bk, wm, wn, stages = "simt", 128, 128, 8, 4, 2, 3
    else:
        math = "tensorop"
        bk = 32 if eb == 2 else 16
        bm, bn = 128, 128
        if K <= 64:
            bn = 64
        # small GEMMs: shrink the M tile so that the grid covers the GPU
        sms = 132
        if (M + bm - 1) // bm * ((K + bn - 1) // bn) < sms and M > 64:
            bm = 64
        wm, wn = (2, 2) if bm == 128 else (1, 2)
        if bn == 64 and bm == 128:
            wm, wn = 2, 2
        stages = 4
    load_a = "vec" if (pb.layout == "NHWC" and pb.C % ce == 0 and x_aligned) else "elem"
    load_b = "vec" if (pb.Kred % ce == 0 and w_aligned) else "elem"
    vo = 16 // eb
    if pb.layout == "NHWC":
        if K <= bn:
            store, vec_o, fuse = "linear", vo, True
        else:
            store = "rows"
            vec_o = vo if K % vo == 0 else 1
            fuse = K % 32 == 0
    else:
        PQ = pb.P * pb.Q
        store = "nchw"
        vec_o = vo if PQ % vo == 0 else 1
        fuse = PQ % 32 == 0
    fuse = fuse and pb.mask
    return KernelSpec(pb.dtype, pb.layout, math, bm, bn, bk, wm, wn, stages, load_a, load_b, store, vec_o,
                      fuse, epilogue_functors(pb))
