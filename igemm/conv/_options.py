"""``Conv2dOptions``: how a :class:`~igemm.Conv2dPlan` may run its problem (every field has a default that is right
for almost everyone; the fields exist for benchmarks, comparisons and the rare problem a rule does not serve)."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from ._paths import NCHW_PATHS
from ._spec import KernelSpec

__all__ = ["Conv2dOptions", "NCHW_PATHS", "UNFOLDS"]

UNFOLDS = (None, True, False, "copy", "patch")


@dataclass(frozen=True)
class Conv2dOptions:
    """Options of a convolution plan.

    Attributes:
        nchw_path: NCHW only. ``"auto"`` (default): 16-bit with C % 8 == 0 runs on the transpose path (x, and w
            unless it is 1x1, copied to NHWC by one extra kernel into plan-owned scratch, then gathered 16 bytes a
            load; y is still stored NCHW by the epilogue), which measured faster on every such ResNet-50 layer; a
            1x1 stride-1 conv with C % 64 == 0 and H*W % 64 == 0 reads NCHW x in place on Hopper. ``"native"``:
            the NCHW gather. ``"transpose"``: the transpose path.
        pad_channels: ``True`` runs 16-bit C < 8 on copies with C padded to 8 zero channels (16-byte loads). Off by
            default (``None``): it measured slower for conv1 than the element gather.
        unfold: the width unfold of few-channel inputs (C channels and an R x S filter become roundup(S*C, 16
            bytes) channels and an R x 1 filter). ``None`` (default): on for pixels under 16 bytes with S > 1,
            in shared memory on sm_90 (16-bit NHWC, dilation 1: the patch loader), else on copies. ``True``: on;
            ``"copy"`` / ``"patch"``: on, that way; ``False``: the element gather.
        config: overrides of the kernel choice: a dict of :class:`~igemm.conv.KernelSpec` fields (e.g.
            ``{"bn": 256, "splits": 2}``; ``{"math": "wgmma_ws", "bm": 64, "wm": 1}`` for the persistent kernel;
            ``igemm.conv.FFMA_CONFIG`` for strict fp32 on IEEE FFMA instead of 3xTF32) or a whole ``KernelSpec``.
            Checked when the plan is built (``NotImplementedError`` if it cannot run the problem).
        autotune: time the candidate kernels on first use and remember the fastest per GPU and problem in the
            kernel cache (``autotune.json``); ``None`` (default): ``$IGEMM_AUTOTUNE`` (``1`` turns it on).
            Remembered choices are used whether or not autotuning is on.
    """
    nchw_path: str = "auto"
    pad_channels: bool | None = None
    unfold: bool | str | None = None
    config: dict | KernelSpec | None = None
    autotune: bool | None = None

    def __post_init__(self):
        if self.nchw_path not in NCHW_PATHS:
            raise ValueError(f"nchw_path: expected one of {NCHW_PATHS}, got {self.nchw_path!r}")
        if self.pad_channels not in (None, True, False):
            raise TypeError(f"pad_channels: expected a bool or None, got {self.pad_channels!r}")
        if not any(self.unfold is u or (isinstance(u, str) and self.unfold == u) for u in UNFOLDS):
            raise ValueError(f"unfold: expected None, True, False, 'copy' or 'patch', got {self.unfold!r}")
        cfg = self.config
        if cfg is not None and not isinstance(cfg, (dict, KernelSpec)):
            raise TypeError(f"config: expected a dict of KernelSpec fields or a KernelSpec, got {type(cfg).__name__}")
        if isinstance(cfg, dict):
            bad = set(cfg) - {f.name for f in dataclasses.fields(KernelSpec)}
            if bad:
                raise ValueError(f"config: unknown fields {sorted(bad)}")
            object.__setattr__(self, "config", dict(cfg))      # (a private copy: the plan may not see later edits)
        if self.autotune not in (None, True, False):
            raise TypeError(f"autotune: expected a bool or None, got {self.autotune!r}")

    @property
    def tune(self) -> bool:
        """Whether to autotune (``autotune``, else ``$IGEMM_AUTOTUNE``)."""
        if self.autotune is not None:
            return self.autotune
        return os.environ.get("IGEMM_AUTOTUNE", "") not in ("", "0")


DEFAULT = Conv2dOptions()
