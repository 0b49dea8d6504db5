"""The layers the comparison runs: ResNet-50's convolutions and a sweep over filter size, stride, batch and
channels."""
from __future__ import annotations

from dataclasses import dataclass

from ._algorithms import Problem

@dataclass(frozen=True)
class Layer:
    """A square convolution: ``N x C x H x H`` input, ``K`` filters of ``R x R``, stride, padding."""
    name: str
    group: str
    N: int
    C: int
    K: int
    H: int
    R: int
    stride: int = 1
    pad: int = 0

    def problem(self, dtype: str, layout: str, precision: str = "strict") -> Problem:
        return Problem(self.N, self.C, self.H, self.H, self.K, self.R, self.R, self.stride, self.pad, 1, dtype,
                       layout, precision)


from ..layers import RESNET50

GROUPS = ("resnet50", "filter", "batch", "channels")


def layer_name(group: str, N: int, C: int, K: int, H: int, R: int, stride: int) -> str:
    tag = "r50" if group == "resnet50" else group
    return f"{tag} {R}x{R}{'/' + str(stride) if stride > 1 else ''} {C}->{K} @{H} N={N}"


def _layer(group, N, C, K, H, R, stride, pad) -> Layer:
    return Layer(layer_name(group, N, C, K, H, R, stride), group, N, C, K, H, R, stride, pad)


def resnet50(batch: int = 32) -> list[Layer]:
    return [_layer("resnet50", batch, C, K, H, R, st, pd) for _, C, K, H, R, st, pd in RESNET50]


def sweep(quick: bool = False) -> list[Layer]:
    """One factor at a time around a base layer: filter size x stride (N=8, 64->64 @56, 'same' padding),
    batch (3x3 128->128 @28) and channels (3x3 C->C @28, N=8)."""
    filters, strides = ((1, 5, 11), (1, 2)) if quick else ((1, 3, 5, 7, 11), (1, 2))
    batches = (1, 32) if quick else (1, 8, 32)
    chans = (16, 512) if quick else (16, 32, 64, 128, 256, 512)
    out = [_layer("filter", 8, 64, 64, 56, r, s, r // 2) for r in filters for s in strides]
    out += [_layer("batch", n, 128, 128, 28, 3, 1, 1) for n in batches]
    out += [_layer("channels", 8, c, c, 28, 3, 1, 1) for c in chans]
    return out


def select_layers(groups: str = "resnet50,sweep", match: str = "", batch: int = 32, quick: bool = False) -> list[Layer]:
    """Layers of the comma-separated ``groups`` (resnet50, sweep, filter, batch, channels, all), kept when
    their name contains one of the comma-separated ``match`` substrings (if given)."""
    want = []
    for g in (s.strip() for s in groups.split(",") if s.strip()):
        if g == "all":
            want += list(GROUPS)
        elif g == "sweep":
            want += ["filter", "batch", "channels"]
        elif g in GROUPS:
            want.append(g)
        else:
            raise ValueError(f"--layers: unknown group {g!r} (expected resnet50, sweep, filter, batch, channels, all)")
    layers = [l for l in resnet50(batch) + sweep(quick) if l.group in want]
    if match:
        subs = [m.strip() for m in match.split(",") if m.strip()]
        layers = [l for l in layers if any(m in l.name for m in subs)]
    return layers


def numpy_size(layer: Layer) -> Layer:
    """The small version the numpy backend runs: N 1/2/4 (for 1, <=8, more), H/8 (at least R), <=128 channels."""
    N = 1 if layer.N <= 1 else (2 if layer.N <= 8 else 4)
    H = max(layer.H // 8, layer.R)
    C, K = min(layer.C, 128), min(layer.K, 128)
    return _layer(layer.group, N, C, K, H, layer.R, layer.stride, layer.pad)


# ===================================================================================== progress
