"""The problem the conv kernel runs (``Conv2dPlan.kproblem``) for the user's problem and its options: 16-bit NCHW
on the transpose path (x copied to NHWC, y stored NCHW by the epilogue) or natively gathered; pixels under 16
bytes with S > 1 on the width unfold, in shared memory (the patch loader, sm_90) or on copies; the opt-in channel
pad to 8.
"""
from __future__ import annotations

import dataclasses

from .._runtime import DTYPE_SIZES
from ._problem import PATCH_MAX_BYTES, ConvProblem, patch_bytes, unfold_channels
from ._rules import patch_config, use_tma
from ._spec import SMEM_LIMIT
from ._unfold import fits, unfolded_problem

__all__ = ["kernel_setup", "nchw_path", "kernel_channels", "kernel_problem", "use_unfold", "subsampled",
           "patch_unsupported", "NCHW_PATHS"]


def patch_unsupported(pb: ConvProblem, arch: str) -> str | None:
    """Why the patch loader (the width unfold in shared memory, csrc/conv/patch.cuh) cannot run ``pb``
    (the user's problem; None: it can)."""
    if not arch.startswith("sm_90"):
        return "the patch loader is sm_90 code (TMA, wgmma)"
    if pb.layout != "NHWC" or DTYPE_SIZES[pb.dtype] != 2:
        return "the patch loader reads 16-bit NHWC x"
    if pb.dilation != (1, 1):
        return "the patch loader needs dilation 1"
    if pb.W * pb.C * 2 % 16:
        return "the patch's tensor map needs rows of x (W*C elements) in multiples of 16 bytes"
    if pb.R > 256 or max(pb.N, pb.H, pb.W * pb.C) >= 2 ** 31 or pb.stride[1] * pb.C * 128 >= 2 ** 31:
        return "tensor too large for the patch's tensor map"
    if -(-pb.R * unfold_channels(pb.C, pb.S, 2) // 64) > 8:
        return "the patch kernel keeps the whole filter tile resident: at most 8 k-tiles"
    if patch_bytes(pb, 64) > PATCH_MAX_BYTES:
        return "the patch of a tile would exceed 64 KB of shared memory"
    spec = patch_config(dataclasses.replace(pb, patch=True), bm=64)
    if spec.smem + spec.static_smem > SMEM_LIMIT:
        return f"the patch kernel would need {spec.smem} bytes of shared memory"
    return None



NCHW_PATHS = ("auto", "native", "transpose")


def nchw_path(pb: ConvProblem, requested: str = "auto", pad: bool | None = None, arch: str | None = None) -> str:
    """How an NCHW problem runs: ``"native"`` (the NCHW gather: one 2-byte element per load for 16-bit
    types) or ``"transpose"`` (x and w transposed to NHWC/KRSC in one kernel, the 16-byte NHWC gather,
    NCHW stores from the epilogue). ``auto``: transpose for 16-bit types whose C allows 16-byte loads
    (C % 8 == 0), or that are padded (``pad=True``, see :func:`kernel_channels`) (docs/performance.md:
    nchw-transpose-path); for strict fp32 on sm_90 with C % 4 == 0, where the filter has 9+ taps at stride 1 or
    the 1x1 is strided. NHWC: always native."""
    if requested not in NCHW_PATHS:
        raise ValueError(f"nchw_path: expected one of {NCHW_PATHS}, got {requested!r}")
    if pb.layout != "NCHW":
        return "native"
    if requested != "auto":
        return requested
    if arch is not None and not pad and use_tma(pb, arch, 64):
        # a 1x1 stride-1 conv with H*W % 64 == 0 reads NCHW x directly: MN-major TMA tiles (load_a "tmamn")
        return "native"
    if DTYPE_SIZES[pb.dtype] == 4:
        # strict fp32 on Hopper's 3xTF32 wgmma kernel: the 16-byte gather wins where a pixel has 9+ taps at
        # stride 1 or its copy is subsampled (docs/performance.md: tf32x3-wgmma-nchw)
        wgmma = arch is not None and arch.startswith("sm_90") and pb.precision == "strict" and pb.C % 4 == 0
        return "transpose" if wgmma and (pb.R * pb.S >= 9 and pb.stride == (1, 1) or subsampled(pb)) else "native"
    return "transpose" if DTYPE_SIZES[pb.dtype] == 2 and (pb.C % 8 == 0 or (pad and pb.C < 8)) else "native"


def kernel_channels(pb: ConvProblem, path: str, pad: bool | None = None) -> int:
    """The channel count the conv kernel sees: 8 when a 16-bit problem with C < 8 is run on copies of x
    and w with zero channels added (``pad=True``; the gather then uses 16-byte loads instead of element
    loads), else C. Opt-in: it measured slower for conv1 than the element gather (docs/performance.md:
    channel-pad-off). The copy needs the NHWC side: an NCHW problem pads on its transpose path."""
    if not pad:
        return pb.C
    if DTYPE_SIZES[pb.dtype] != 2 or pb.C >= 8 or (pb.layout == "NCHW" and path != "transpose"):
        raise ValueError("pad_channels=True needs a 16-bit problem with C < 8 (and, for NCHW, the transpose path)")
    return 8


def subsampled(pb: ConvProblem) -> bool:
    """A 1x1 strided conv without padding reads only ``x[:, :, ::sh, ::sw]``: the NCHW transpose path copies
    just those pixels (docs/performance.md: nchw-subsampled-copy)."""
    return pb.R == pb.S == 1 and pb.padding == (0, 0) and pb.stride != (1, 1)


def kernel_problem(pb: ConvProblem, path: str, channels: int | None = None) -> ConvProblem:
    """The problem the conv kernel itself sees on ``path`` (the transpose path: NHWC in, NCHW out) with
    ``channels`` input channels (:func:`kernel_channels`)."""
    kp = pb
    if path == "transpose" and pb.layout == "NCHW":
        kp = dataclasses.replace(kp, layout="NHWC", out_layout="NCHW")
        if subsampled(pb):                  # the copy holds only x[:, :, ::sh, ::sw]: a 1x1 stride-1 conv on it
            kp = dataclasses.replace(kp, H=pb.P, W=pb.Q, stride=(1, 1), dilation=(1, 1))
    if channels is not None and channels != pb.C:
        kp = dataclasses.replace(kp, C=channels)
    return kp


def use_unfold(pb: ConvProblem, nchw: str = "auto", pad: bool | None = None, unfold: bool | None = None) -> bool:
    """Whether the plan runs on width-unfolded copies of x and w (``_unfold.py``: C -> roundup(S*C, V),
    S -> 1, so the gather moves 16 bytes a load). ``auto`` (``None``): for inputs whose pixel is under 16
    bytes (C * element size < 16: conv1's C = 3) with S > 1, either layout, unless ``pad_channels`` or an
    explicit ``nchw_path`` is asked for; 16-bit types only (docs/performance.md: width-unfold)."""
    if unfold is None:
        es = DTYPE_SIZES[pb.dtype]
        return not pad and nchw == "auto" and es == 2 and pb.C * es < 16 and pb.S > 1 and _unfold_fits(pb)
    if unfold and (pad or nchw != "auto"):
        raise ValueError("unfold=True replaces the channel pad and the NCHW paths: leave pad_channels and "
                         "nchw_path unset")
    if unfold and not _unfold_fits(pb):
        raise NotImplementedError("unfold=True: the unfolded copy of x is too large for igemm's 32-bit index math")
    return bool(unfold)


def _unfold_fits(pb: ConvProblem) -> bool:
    return fits(pb, DTYPE_SIZES[pb.dtype])


def kernel_setup(pb: ConvProblem, nchw: str = "auto", pad: bool | None = None,
                 unfold: bool | str | None = None, arch: str | None = None) -> tuple[str, ConvProblem]:
    """(path, the kernel's problem) for a plan's problem and its options: the width unfold
    (:func:`use_unfold`) as path ``"patch"`` (in shared memory: :func:`patch_unsupported`; ``arch`` given,
    ``unfold`` not ``"copy"``) or ``"unfold"`` (copies of x and w), else the NCHW path (:func:`nchw_path`;
    ``"native"`` for NHWC). ``unfold="patch"`` insists on the former."""
    if unfold not in (None, True, False, "copy", "patch"):
        raise ValueError(f"unfold: expected None, True, False, 'copy' or 'patch', got {unfold!r}")
    if use_unfold(pb, nchw, pad, bool(unfold) if unfold is not None else None):
        if unfold != "copy":
            # NCHW: on an NHWC copy of x (one transpose, C = 3: 9.6 MB for conv1 at N=32, where the unfolded
            # copy is 8x that), stored NCHW by the epilogue
            nhwc = dataclasses.replace(pb, layout="NHWC", out_layout="NCHW") if pb.layout == "NCHW" else pb
            why = patch_unsupported(nhwc, arch) if arch else "no architecture given"
            if why is None:
                return "patch", dataclasses.replace(nhwc, patch=True)
            if unfold == "patch":
                raise NotImplementedError(f"unfold='patch': {why}")
        return "unfold", unfolded_problem(pb, DTYPE_SIZES[pb.dtype])
    path = nchw_path(pb, nchw, pad, arch)
    return path, kernel_problem(pb, path, kernel_channels(pb, path, pad))

