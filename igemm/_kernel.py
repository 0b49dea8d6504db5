"""One definition of each kernel family's launch parameters, the stub rendered from it, and launching.

``cuda.core.launch`` takes pointers (Python ints) and typed numpy scalars, and no struct by value.
So a family declares its parameters once, as a list of :class:`ParamSpec`; :func:`render_kernel`
generates from that list the C++ ``struct Params``, the ``extern "C" __global__`` signature and the
initialiser that rebuilds the struct on the device, and :func:`pack_args` builds the flat argument
list in the same order. The family's header only sees ``Params`` (a template parameter).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _runtime
from .fastdiv import magic

__all__ = ["ParamSpec", "render_kernel", "pack_args", "Launcher", "load"]


@dataclass(frozen=True)
class ParamSpec:
    """One launch parameter: ``ctype`` is ``ptr`` (a Python int), ``fastdiv`` (a divisor, passed as
    ``int32 d, uint32 mul, uint32 shr`` and rebuilt as ``igemm::FastDiv``), ``int32``, ``uint32``,
    ``int64`` or ``float32``."""
    name: str
    ctype: str


_NP = {"int32": np.int32, "uint32": np.uint32, "int64": np.int64, "float32": np.float32}
_C = {"int32": "int32_t", "uint32": "uint32_t", "int64": "int64_t", "float32": "float"}


def render_kernel(*, include: str, entry: str, params: list[ParamSpec], body: str, threads: int,
                  min_blocks: int | None = None, prelude: str = "") -> str:
    """The whole generated stub: include, Params struct, kernel signature and a one-line body."""
    fields, sig, init = [], [], []
    for p in params:
        if p.ctype == "ptr":
            fields.append(f"  const void* {p.name};")
            sig.append(f"const void* {p.name}")
            init.append(p.name)
        elif p.ctype == "fastdiv":
            fields.append(f"  igemm::FastDiv {p.name};")
            sig += [f"int32_t {p.name}_d", f"uint32_t {p.name}_m", f"uint32_t {p.name}_s"]
            init.append(f"igemm::FastDiv{{{p.name}_d, {p.name}_m, {p.name}_s}}")
        else:
            fields.append(f"  {_C[p.ctype]} {p.name};")
            sig.append(f"{_C[p.ctype]} {p.name}")
            init.append(p.name)
    bounds = f"__launch_bounds__({threads}{', ' + str(min_blocks) if min_blocks else ''})"
    return (f'#include "{include}"\n{prelude}\n'
            f"namespace {{\nstruct Params {{\n" + "\n".join(fields) + "\n};\n}\n"
            f'extern "C" __global__ void {bounds} {entry}({", ".join(sig)}) {{\n'
            f"  const Params p{{{', '.join(init)}}};\n  {body}\n}}\n")


def pack_args(params: list[ParamSpec], values: dict) -> list:
    """Flat launch arguments in declaration order; missing pointers are nullptr, missing scalars 0."""
    out = []
    for p in params:
        v = values.get(p.name, 0)
        if p.ctype == "ptr":
            out.append(int(v))
        elif p.ctype == "fastdiv":
            d, m, s = magic(int(v) if v else 1)
            out += [np.int32(d), np.uint32(m), np.uint32(s)]
        else:
            out.append(_NP[p.ctype](v))
    return out


class Launcher:
    """A compiled kernel and its launch configuration: ``launcher(stream, args)`` launches."""

    __slots__ = ("kernel", "config", "_launch", "grid", "block", "smem")

    def __init__(self, kernel, grid, block, smem: int = 0):
        from cuda.core import LaunchConfig, launch
        self.kernel = kernel
        self.grid, self.block, self.smem = grid, block, smem
        self.config = LaunchConfig(grid=grid, block=block, shmem_size=smem)
        self._launch = launch

    def __call__(self, stream, args) -> None:
        self._launch(stream, self.config, self.kernel, *args)


def load(stub: str, name: str, entry: str, device_id: int, smem: int = 0):
    """Compile-or-fetch the stub's kernel for ``device_id``."""
    return _runtime.get_kernel(stub, name, device_id, entry=entry, smem=smem)
