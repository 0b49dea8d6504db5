import os

import numpy as np
import pytest

from igemm import _runtime

# jax takes 75% of the GPU's memory at its first use unless told not to; the suite's workers share one GPU
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _has_gpu() -> bool:
    return os.environ.get("IGEMM_BACKEND") != "numpy" and _runtime._device_count() > 0


def _gpu_count() -> int:
    return _runtime._device_count() if _has_gpu() else 0


def pytest_collection_modifyitems(config, items):
    gpu = _has_gpu()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and _gpu_count() < 2:
            item.add_marker(skip_multi)


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test id (reproducible, different per test)."""
    import zlib
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def numpy_backend():
    from igemm import set_backend
    set_backend("numpy")
    yield
    set_backend(None)
