"""The package list, found rather than written down: ``igemm`` and every package under ``igemm/``, plus the
repository's top-level ``epilogues/`` and ``csrc/`` (with any subfolders of headers), which install as
``igemm.epilogues`` and ``igemm.csrc``. Metadata and dependencies are in pyproject.toml, whose static
``[tool.setuptools] packages`` cannot both discover subpackages and map two folders into ``igemm``.
"""
from setuptools import find_namespace_packages, find_packages, setup

_DIRS = {"igemm": "igemm", "igemm.epilogues": "epilogues", "igemm.csrc": "csrc"}


def _under(prefix: str, found: list[str]) -> list[str]:
    return [prefix] + [f"{prefix}.{p}" for p in found]


_HEADERS = _under("igemm.csrc", find_namespace_packages(where="csrc", exclude=["*__pycache__*"]))
setup(packages=[*_under("igemm", find_packages(where="igemm")),
                *_under("igemm.epilogues", find_packages(where="epilogues")), *_HEADERS],
      package_dir=_DIRS,
      package_data={p: ["*.cuh", "*.h", "*.c"] for p in _HEADERS})   # the device headers, the host launch step
