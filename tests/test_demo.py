"""``python -m igemm demo``: the sizes printed are the sizes run, the rate column means something, every option
is honoured (or refused with a message), and it needs nothing beyond the base install (no torch)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# the demo as a user runs it, with torch made unimportable (the base install has none)
_NO_TORCH = "import sys, runpy; sys.modules['torch'] = None; sys.argv = ['igemm'] + sys.argv[1:]; " \
            "runpy.run_module('igemm', run_name='__main__')"


def _demo(cwd, *args, backend: str | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    import igemm
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(igemm.__file__).parent.parent),
                                                    env.get("PYTHONPATH", "")) if p)
    if backend:
        env["IGEMM_BACKEND"] = backend
    return subprocess.run([sys.executable, "-c", _NO_TORCH, "demo", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=cwd)


def _rows(out: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| layer")]


def test_demo_numpy_backend_labels_the_sizes_it_runs(tmp_path):
    """Item 7: without a GPU, the labels carry the spatial size actually run (1/8 by default), the rate
    column is GFLOP/s and non-zero, and --batch, --layout, --scale and --dtype are honoured; item 2: no torch."""
    r = _demo(tmp_path, "--batch", "2", "--layout", "NCHW", "--dtype", "float32", backend="numpy")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "N=2, float32 NCHW, numpy backend, spatial size 1/8" in r.stdout
    rows = _rows(r.stdout)
    assert len(rows) == 7 and rows[0][0] == "conv1 7x7/2 3->64 @28" and rows[1][0] == "3x3 64->64 @7"
    assert re.search(r"\|\s+GFLOP/s \|", r.stdout)
    assert all(float(row[2]) > 0 for row in rows), r.stdout
    r = _demo(tmp_path, "--scale", "16", "--dtype", "float16", backend="numpy")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "N=1, float16 NHWC, numpy backend, spatial size 1/16" in r.stdout
    assert _rows(r.stdout)[0][0] == "conv1 7x7/2 3->64 @14"


def test_demo_bfloat16_is_honoured_or_refused(tmp_path):
    """Item 7: --dtype bfloat16 runs bfloat16 (with ml_dtypes, a dependency) or says why it cannot."""
    r = _demo(tmp_path, "--dtype", "bfloat16", "--scale", "16", backend="numpy")
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        assert r.returncode == 2 and "ml_dtypes" in r.stderr, r.stdout + r.stderr
        return
    assert r.returncode == 0 and "bfloat16 NHWC, numpy backend" in r.stdout, r.stdout + r.stderr


def test_demo_refuses_bad_options(tmp_path):
    for args in (("--batch", "0"), ("--scale", "-1")):
        r = _demo(tmp_path, *args, backend="numpy")
        assert r.returncode == 2 and "positive" in r.stderr, r.stdout + r.stderr
    r = _demo(tmp_path, "--dtype", "float64", backend="numpy")
    assert r.returncode == 2 and "invalid choice" in r.stderr


@pytest.mark.gpu
def test_demo_gpu_without_torch(tmp_path):
    """Items 2 and 7: on a GPU the demo runs with torch unimportable, at the batch and dtype asked, the
    labels at full size, TFLOP/s in the rate column, every layer checked."""
    r = _demo(tmp_path, "--batch", "4", "--dtype", "bfloat16", "--layout", "NHWC")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "N=4, bfloat16 NHWC, cuda backend (" in r.stdout
    rows = _rows(r.stdout)
    assert rows[0][0] == "conv1 7x7/2 3->64 @224" and "TFLOP/s" in r.stdout
    assert all(float(row[2]) > 0 and "FAIL" not in row[-1] for row in rows), r.stdout


def test_readme_quickstarts():
    """The README's quickstart without a GPU runs as written (numpy backend); the PyTorch one compiles."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 2, len(blocks)
    import igemm
    try:
        exec(compile(blocks[0], "README quickstart (numpy)", "exec"), {})
    finally:
        igemm.set_backend(None)
    compile(blocks[1], "README quickstart (PyTorch)", "exec")


def test_train_demo_runs_and_prints_both_trainings(tmp_path):
    """``python -m igemm train-demo``: the converted model and PyTorch train side by side from the same weights
    (on the CPU: a couple of steps; on a GPU: the timed run); both losses and images/s printed."""
    pytest.importorskip("torch")
    import igemm
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(Path(igemm.__file__).parent.parent),
                                                                  os.environ.get("PYTHONPATH", "")) if p))
    r = subprocess.run([sys.executable, "-m", "igemm", "train-demo", "--steps", "4", "--batch", "8", "--data",
                        "cifar"], capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    names = ("igemm.nn.convert", "PyTorch eager")
    rows = {row[0]: row for row in _rows(r.stdout) if row[0] in names}
    assert set(rows) == set(names), r.stdout
    first = [float(rows[k][3]) for k in names]
    assert abs(first[0] - first[1]) <= 1e-2 * abs(first[1]), r.stdout        # same weights, same batch
    assert all(float(rows[k][1]) > 0 for k in rows), r.stdout
