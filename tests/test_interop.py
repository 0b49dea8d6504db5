"""Frameworks in and out: the backend switch, igemm's DLPack export (outputs of jax inputs come back as jax
arrays, the memory kept alive while the consumer holds it), and producer-stream ordering (an asynchronous
producer on another stream never races the kernel)."""
from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest

import igemm
from igemm import _dlpack, _runtime


# ------------------------------------------------------------------------------------------------ backend
def test_set_backend_cuda_without_gpu_raises_at_once():
    """Item 4: ``set_backend("cuda")`` with no GPU visible raises at once, naming the cause, and leaves the
    backend as it was; with a GPU it is accepted."""
    before = igemm.get_backend()
    if _runtime._device_count() > 0:
        igemm.set_backend("cuda")
        try:
            assert igemm.get_backend() == "cuda"
        finally:
            igemm.set_backend(None)
        return
    with pytest.raises(RuntimeError, match=r"no CUDA GPU is visible.*set_backend\('numpy'\)"):
        igemm.set_backend("cuda")
    assert igemm.get_backend() == before == "numpy"
    with pytest.raises(ValueError, match="backend must be"):
        igemm.set_backend("cpu")


# ------------------------------------------------------------------------------------ DLPack, no GPU needed
_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_SetName", ctypes.pythonapi))
_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


class _Owner:
    pass


@pytest.mark.parametrize("versioned", [False, True])
def test_dlpack_capsule_keeps_owner_until_released(versioned):
    """Item 13: a capsule holds its owner until the consumer calls the deleter (consumed), or until the
    capsule itself goes (never consumed); shape, strides, dtype and device are those given."""
    name = b"dltensor_versioned" if versioned else b"dltensor"
    struct = _dlpack._DLManagedTensorVersioned if versioned else _dlpack._DLManagedTensor
    n0 = len(_dlpack._live)
    owner = _Owner()
    cap = _dlpack.capsule(owner, 0x1000, (2, 3), (3, 1), "bfloat16", 1, versioned)
    assert len(_dlpack._live) == n0 + 1
    m = struct.from_address(_get_pointer(cap, name))
    t = m.dl_tensor
    assert (t.data, t.device.device_type, t.device.device_id, t.ndim) == (0x1000, 2, 1, 2)
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (4, 16, 1)
    assert [t.shape[i] for i in range(2)] == [2, 3] and [t.strides[i] for i in range(2)] == [3, 1]
    if versioned:
        assert (m.version.major, m.flags) == (1, 0)
    del cap                                           # never consumed: released with the capsule
    gc.collect()
    assert len(_dlpack._live) == n0

    cap = _dlpack.capsule(owner, 0x1000, (4,), (1,), "float32", 0, versioned)
    addr = _get_pointer(cap, name)
    _set_name(cap, b"used_" + name)      # what a consumer does when it takes the tensor
    del cap
    gc.collect()
    assert len(_dlpack._live) == n0 + 1               # the consumer holds it
    struct.from_address(addr).deleter(addr)           # ... until it is done
    assert len(_dlpack._live) == n0


def test_dlpack_stream_argument_rules():
    """DLPack's CUDA stream values: None and 1 legacy default, 2 per-thread, -1 no ordering, 0 refused."""
    assert _dlpack.consumer_stream(None) == 1
    assert _dlpack.consumer_stream(-1) is None
    assert _dlpack.consumer_stream(2) == 2 and _dlpack.consumer_stream(0x5555) == 0x5555
    with pytest.raises(ValueError, match="ambiguous"):
        _dlpack.consumer_stream(0)
    with pytest.raises(TypeError):
        _dlpack.consumer_stream(True)
    assert _dlpack.same_stream(0, 1) and not _dlpack.same_stream(1, 2)
    assert _dlpack.dl_dtype("float16") == (2, 16) and _dlpack.dl_dtype("uint32") == (1, 32)
    with pytest.raises(BufferError):
        _dlpack.dl_dtype("complex64")


# ---------------------------------------------------------------------------------------------------- GPU
def _prelu_ref(x, alpha=0.25):
    x = np.asarray(x, np.float64)
    return np.where(x > 0, x, alpha * x)


@pytest.mark.gpu
def test_jax_inputs_give_jax_outputs():
    """Item 13: jax in, jax out (zero-copy through DLPack), for an elementwise family, a mask and a conv."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(0)
    xh = rng.standard_normal((4, 8, 6, 6)).astype(np.float32)
    x = jnp.asarray(xh)
    y = igemm.prelu(x, 0.25)
    assert isinstance(y, jax.Array) and y.dtype == jnp.float32 and y.shape == x.shape
    np.testing.assert_allclose(np.asarray(y), _prelu_ref(xh), rtol=1e-6)
    m = igemm.relu_mask(y)
    assert isinstance(m, jax.Array) and m.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(m), np.asarray(igemm.relu_mask(np.asarray(y))))
    xc = rng.standard_normal((2, 8, 8, 16)).astype(np.float16)
    wc = (rng.standard_normal((32, 3, 3, 16)) / 12).astype(np.float16)
    yc = igemm.conv2d(jnp.asarray(xc), jnp.asarray(wc), padding=1, layout="NHWC")
    assert isinstance(yc, jax.Array) and yc.dtype == jnp.float16 and yc.shape == (2, 8, 8, 32)
    from igemm import reference
    ref = reference.conv2d_im2col(xc, wc, 1, 1, 1, "NHWC")
    assert np.abs(np.asarray(yc, np.float64) - ref).max() <= 1e-2 * np.abs(ref).max()
    yb = igemm.prelu(jnp.asarray(xh, dtype=jnp.bfloat16), 0.25)
    assert isinstance(yb, jax.Array) and yb.dtype == jnp.bfloat16


@pytest.mark.gpu
def test_jax_output_outlives_igemm_allocation():
    """Item 13: the memory of a returned jax array stays alive after igemm drops its own reference, through
    later allocations that could reuse it."""
    jax = pytest.importorskip("jax")
    xh = np.arange(-512, 512, dtype=np.float32).reshape(4, 256)
    y = igemm.prelu(jax.numpy.asarray(xh), 0.25)
    gc.collect()
    junk = [igemm.prelu(jax.numpy.asarray(-xh), 0.5) for _ in range(8)]
    np.testing.assert_allclose(np.asarray(y), _prelu_ref(xh))
    del junk, y
    gc.collect()


@pytest.mark.gpu
def test_device_array_exports_through_dlpack():
    """Item 13: igemm's own DeviceArray (outputs for other producers) goes into torch and cupy zero-copy,
    with the DLPack 1.x capsule where the consumer asks for it, and keeps its memory alive there."""
    xh = np.linspace(-1, 1, 96, dtype=np.float32).reshape(8, 12)
    _, d = _runtime.to_device(_runtime.as_tensor(xh, "x"), 0, None)
    torch = pytest.importorskip("torch")
    t = torch.from_dlpack(d)
    assert t.data_ptr() == d.ptr and t.device.type == "cuda" and t.dtype == torch.float32
    cp = pytest.importorskip("cupy")
    c = cp.from_dlpack(d)
    assert int(c.data.ptr) == d.ptr
    del d
    gc.collect()
    np.testing.assert_array_equal(t.cpu().numpy(), xh)
    np.testing.assert_array_equal(cp.asnumpy(c), xh)


_SPIN = r"""
extern "C" __global__ void spin_fill(float* x, int n, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = 1.0f;
}
"""


@pytest.mark.gpu
def test_cupy_producer_on_a_busy_side_stream():
    """Item 14: a long cupy kernel on a side stream (cupy's current stream) writes x; igemm called with
    another stream must see the final values (the CUDA array interface's stream is waited for)."""
    cp = pytest.importorskip("cupy")
    n = 1 << 16
    spin = cp.RawKernel(_SPIN, "spin_fill")
    side, other = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    igemm.prelu(cp.ones(n, cp.float32), 0.25, stream=other)          # compile and load first
    other.synchronize()
    for _ in range(3):
        x = cp.zeros(n, cp.float32)
        cp.cuda.Device().synchronize()
        with side:
            spin((n // 256,), (256,), (x, np.int32(n), np.int64(200_000_000)))
            y = igemm.prelu(x, 0.25, stream=other)
        other.synchronize()
        assert float(y.min()) == 1.0, "igemm read x before the producer's stream wrote it"
        side.synchronize()


@pytest.mark.gpu
def test_jax_producer_still_computing():
    """Item 14: jax dispatches asynchronously; igemm's view of a jax array still being computed waits for
    it (``__dlpack__(stream=<launch stream>)``), also on an explicit non-default launch stream."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from cuda.core import Device

    @jax.jit
    def slow_ones(a):
        def body(i, v):
            return jnp.tanh(v @ a) * 0.0 + 1.0
        return jax.lax.fori_loop(0, 60, body, jnp.zeros((a.shape[0], a.shape[0]), a.dtype))[:, :256]

    a = jnp.asarray(np.random.default_rng(0).standard_normal((4096, 4096)).astype(np.float32))
    slow_ones(a).block_until_ready()                                   # compile
    dev = Device(0)
    dev.set_current()                                                  # (cuda.core: before create_stream)
    s = dev.create_stream()
    igemm.prelu(jnp.ones((4, 256), jnp.float32), 0.25)                 # compile and load first
    for stream in (None, s):
        x = slow_ones(a)                                               # still running when igemm is called
        y = igemm.prelu(x, 0.25, stream=stream)
        assert float(jnp.min(y)) == 1.0, "igemm read x before jax wrote it"


@pytest.mark.gpu
def test_jax_output_alive_at_interpreter_exit(tmp_path):
    """Item 13: jax may release igemm's memory (the DLPack deleter) while Python shuts down: a clean exit."""
    pytest.importorskip("jax")
    import os
    import subprocess
    import sys
    code = ("import jax.numpy as jnp, igemm\n"
            "keep = [igemm.prelu(jnp.ones((64, 64), jnp.float32), 0.25) for _ in range(4)]\n"
            "print(float(keep[-1].sum()))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "4096.0", r.stdout + r.stderr


def test_backend_variable_cuda_without_gpu_raises_at_once(monkeypatch):
    """Item 4: ``IGEMM_BACKEND=cuda`` on a machine with no GPU raises at the first call that asks, naming the
    variable, not later in a launch; an unknown value names the variable too."""
    monkeypatch.setenv("IGEMM_BACKEND", "gpu")
    with pytest.raises(ValueError, match="^IGEMM_BACKEND: must be"):
        igemm.get_backend()
    monkeypatch.setenv("IGEMM_BACKEND", "cuda")
    if _runtime._device_count() > 0:
        assert igemm.get_backend() == "cuda"
        return
    with pytest.raises(RuntimeError, match="^IGEMM_BACKEND=cuda, but no CUDA GPU is visible"):
        igemm.get_backend()
