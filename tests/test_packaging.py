"""Packaging: the wheel holds every package and header and imports from anywhere; a source checkout exposes
``epilogues/`` and ``csrc/`` as igemm's and nothing else of the repository; the declared dependencies and
extras match the imports; the license."""
from __future__ import annotations

import ast
import os
import re
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")


def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:                          # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _files(d: Path, pattern: str = "*") -> list[Path]:
    return sorted(p for p in d.rglob(pattern) if p.is_file() and "__pycache__" not in p.parts)


def _run_isolated(code: str, paths, cwd) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python with ``-S`` (no .pth files, so no editable install of another checkout)
    and ``paths`` before the site-packages directories on sys.path."""
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, paths), *(d for d in dirs if os.path.isdir(d))]))
    return subprocess.run([sys.executable, "-S", "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


# ------------------------------------------------------------------------------------------------ the wheel
@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the checkout's sources (nothing is written into the checkout)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, src / name)
    for name in ("igemm", "epilogues", "csrc"):
        shutil.copytree(ROOT / name, src / name, ignore=_SKIP)
    try:
        import setuptools
        offline = int(setuptools.__version__.split(".")[0]) >= 77
    except ImportError:
        offline = False
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)]
    if offline:
        cmd.insert(4, "--no-build-isolation")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode and not offline:
        pytest.skip(f"setuptools>=77 is not installed and pip could not fetch it: {r.stderr[-400:]}")
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("igemm-*.whl")
    return whl


def test_wheel_holds_every_package_and_header(wheel):
    """Item 1: every module under igemm/ (subpackages found, not listed), epilogues/ as igemm.epilogues and
    every file of csrc/ (subfolders included) as igemm.csrc; nothing else of the repository; the LICENSE."""
    names = set(zipfile.ZipFile(wheel).namelist())
    want = set()
    for folder, into, pattern in (("igemm", "igemm", "*.py"), ("epilogues", "igemm/epilogues", "*.py"),
                                  ("csrc", "igemm/csrc", "*")):
        want |= {f"{into}/{p.relative_to(ROOT / folder).as_posix()}" for p in _files(ROOT / folder, pattern)}
    assert not want - names, f"missing from the wheel: {sorted(want - names)}"
    stray = sorted(n for n in names if not n.startswith(("igemm/", "igemm-")))
    assert not stray, f"outside the igemm package: {stray}"
    dist = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    assert f"{dist}/licenses/LICENSE" in names
    meta = zipfile.ZipFile(wheel).read(f"{dist}/METADATA").decode()
    assert "License-Expression: BSD-3-Clause" in meta


def test_installed_wheel_imports_from_elsewhere(wheel, tmp_path):
    """Item 1: the installed wheel, used from another directory: ``import igemm``, every public name, the
    epilogues and the headers come from the install; the repository's other folders are not importable."""
    target, cwd = tmp_path / "site", tmp_path / "elsewhere"
    cwd.mkdir()
    zipfile.ZipFile(wheel).extractall(target)
    code = f"""
import os, igemm, igemm.epilogues as ep
from igemm import _build
T = {str(target)!r}
for m in (igemm, ep):
    assert m.__file__.startswith(T), m.__file__
assert str(_build.csrc_dir()).startswith(T) and (_build.csrc_dir() / "common.cuh").is_file(), _build.csrc_dir()
missing = [n for n in igemm.__all__ if not hasattr(igemm, n)] + [n for n in ep.__all__ if not hasattr(ep, n)]
assert not missing, missing
for name in ("tools", "tests", "benchmarks"):
    try:
        __import__("igemm." + name)
    except ImportError:
        continue
    raise SystemExit("igemm." + name + " is importable")
print("ok")
"""
    r = _run_isolated(code, [target], cwd)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


# ------------------------------------------------------------------------------------------- the checkout
@pytest.mark.parametrize("isolated", [True, False], ids=["no-site-hooks", "with-site-hooks"])
def test_checkout_exposes_epilogues_and_headers_only(tmp_path, isolated):
    """Item 1: a checkout on PYTHONPATH (not installed) finds its own epilogues/ and csrc/ -- also where an
    editable install of another checkout is on the path -- and ``import igemm.tools`` fails."""
    code = f"""
import os, igemm, igemm.epilogues as ep
from igemm import _build
R = {str(ROOT)!r}
assert os.path.samefile(ep.__file__, os.path.join(R, "epilogues", "__init__.py")), ep.__file__
assert os.path.samefile(_build.csrc_dir(), os.path.join(R, "csrc")), _build.csrc_dir()
assert igemm.epilogues is ep
for name in ("tools", "tests", "benchmarks"):
    try:
        __import__("igemm." + name)
    except ModuleNotFoundError:
        continue
    raise SystemExit("igemm." + name + " is importable")
print("ok")
"""
    if isolated:
        r = _run_isolated(code, [ROOT], tmp_path)
    else:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


# ----------------------------------------------------------------------------------- dependencies, extras
#: import name -> the distributions that provide it (longest dotted prefix wins)
_PROVIDERS = {
    "numpy": {"numpy"}, "ml_dtypes": {"ml-dtypes"}, "cutlass_library": {"nvidia-cutlass"},
    "cuda.bindings": {"cuda-python", "cuda-bindings"}, "cuda.core": {"cuda-core"},
    "torch": {"torch"}, "cupy": {"cupy-cuda13x"}, "jax": {"jax"}, "nvmath": {"nvmath-python"},
    "tqdm": {"tqdm"}, "matplotlib": {"matplotlib"}, "pytest": {"pytest"}, "hypothesis": {"hypothesis"},
    "setuptools": {"setuptools"}, "torchvision": {"torchvision"},
}
# subpackages that need an extra at import (``import igemm`` never imports them: test_extra_packages_stay_apart)
_EXTRA_PACKAGES = {"igemm/nn": "torch"}

#: declared but never imported, and why
_NOT_IMPORTED = {
    "nvidia-cuda-nvcc": "toolkit: nvcc found on disk by igemm/_build.py",
    "nvidia-cuda-nvrtc": "toolkit: loaded by cuda.bindings.nvrtc",
    "nvidia-cuda-cccl": "toolkit: headers on NVRTC's include path",
    "nvidia-cuda-runtime": "toolkit: headers on NVRTC's include path",
    "nccl4py": "the communicator a caller hands to sync_batch_norm_* (used by duck typing)",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _req_name(req: str) -> str:
    return _norm(re.match(r"[A-Za-z0-9._-]+", req).group(0))


def _imports(paths, local: set[str]):
    """(file, line, dotted module, unconditional) for every absolute import of a third-party module."""
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            for m in mods:
                head = m.split(".")[0]
                if head in sys.stdlib_module_names or head in ("igemm", "epilogues") or head in local:
                    continue
                yield path.relative_to(ROOT).as_posix(), node.lineno, m, id(node) in top


def _providers(module: str):
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        hit = _PROVIDERS.get(".".join(parts[:i]))
        if hit is not None:
            return hit
    return None


def test_imports_match_declared_dependencies():
    """Item 2: every third-party import of igemm/, epilogues/ and tests/ is declared (product imports at module
    level only from the base dependencies: ``import igemm`` needs no extra), and every declared requirement is
    imported somewhere (tests/ for the ``test`` extra) or listed in _NOT_IMPORTED with its reason."""
    proj = _pyproject()["project"]
    base = {_req_name(r) for r in proj["dependencies"]}
    extras = {k: {_req_name(r) for r in v} for k, v in proj.get("optional-dependencies", {}).items()}
    declared = base.union(*extras.values())
    product = _files(ROOT / "igemm", "*.py") + _files(ROOT / "epilogues", "*.py")
    tests = _files(ROOT / "tests", "*.py")
    local = {p.stem for p in tests} | {p.parent.name for p in tests}     # (test modules and packages)
    problems, used = [], set()
    for group, paths in (("product", product), ("tests", tests)):
        for where, line, mod, unconditional in _imports(paths, local):
            dists = _providers(mod)
            if dists is None:
                problems.append(f"{where}:{line}: `{mod}` has no entry in _PROVIDERS (declare it, then add it)")
                continue
            dists = {_norm(d) for d in dists}
            used |= {(group, d) for d in dists}
            if not dists & declared:
                problems.append(f"{where}:{line}: `{mod}` comes from {sorted(dists)}, declared nowhere in pyproject")
            elif (group == "product" and unconditional and not dists & base
                  and not dists & extras.get(_EXTRA_PACKAGES.get(where.rsplit("/", 1)[0], ""), set())):
                problems.append(f"{where}:{line}: module-level `import {mod}` needs an extra: import it where used")
    for name in sorted(declared):
        group = "tests" if name in extras.get("test", set()) else "product"
        if (group, name) not in used and name not in _NOT_IMPORTED:
            problems.append(f"pyproject declares {name!r}, which no {group} module imports")
    assert not problems, "\n".join(problems)


def test_extra_packages_stay_apart():
    """``import igemm`` (and the import of every public name) does not import a subpackage that needs an extra."""
    code = ("import sys, igemm\n[getattr(igemm, n) for n in igemm.__all__]\n"
            f"print(sorted(m for m in sys.modules if m.replace('.', '/') in {sorted(_EXTRA_PACKAGES)!r}))")
    env = dict(os.environ, PYTHONPATH=str(ROOT), IGEMM_BACKEND="numpy")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------- license
def test_license_file_matches_pyproject():
    """Item 3: a BSD-3-Clause LICENSE, as pyproject declares, shipped through license-files."""
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License")
    assert "Copyright (c) 2026, the igemm developers" in text
    assert "Neither the name of the copyright holder nor the names of its" in text
    proj = _pyproject()["project"]
    assert proj["license"] == "BSD-3-Clause"
    assert "LICENSE" in proj.get("license-files", [])
