"""Optional autotuning of the conv kernel choice (``Conv2dOptions(autotune=True)`` or ``IGEMM_AUTOTUNE=1``).

On the first plan for a problem, every candidate of ``_rules.candidates`` is compiled and timed
(CUDA events, median of several launches on random inputs) and the fastest is remembered per
(GPU, problem) in ``$IGEMM_CACHE_DIR/autotune.json`` (written atomically). Later plans for the same
problem on the same kind of GPU use the remembered choice whether or not autotuning is on.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import threading
import warnings

import numpy as np

from .. import _build, _runtime
from .._timing import GpuTimer
from ._rules import candidates
from ._spec import KernelSpec, validate_spec

__all__ = ["tuned_config", "autotune"]

_lock = threading.Lock()
_mem: dict | None = None


def _path():
    return _build.cache_dir() / "autotune.json"


def _load() -> dict:
    global _mem
    if _mem is None:
        try:
            _mem = json.loads(_path().read_text())
        except (OSError, ValueError):
            _mem = {}
    return _mem


def _save(db: dict) -> None:
    """Write the choices atomically; where the cache cannot be written they stay in this process (a warning)."""
    p = _path()
    try:
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix="autotune.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(db, f, indent=1, sort_keys=True)
        os.chmod(tmp, 0o644)
        os.replace(tmp, p)
    except OSError as e:
        warnings.warn(f"autotune: could not write {p} ({e}); the choices stay in this process",
                      _build.CacheWarning, stacklevel=3)


def _keys(plan) -> tuple[str, str]:
    dev = _runtime.device(plan.device_id).name
    pb = dataclasses.astuple(plan.kproblem)     # what the kernel sees (the NCHW transpose path: NHWC in)
    return f"{dev}|{plan.arch}", repr(pb)


def tuned_config(plan) -> KernelSpec | None:
    """The remembered (or, with IGEMM_AUTOTUNE=1, freshly measured) best spec for the plan's problem."""
    dkey, pkey = _keys(plan)
    with _lock:
        hit = _load().get(dkey, {}).get(pkey)
    if hit is not None:
        try:
            spec = KernelSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in hit.items()})
            if validate_spec(spec, plan.kproblem, raise_=False):
                return spec
        except TypeError:
            pass
    if not plan.options.tune:
        return None
    best = autotune(plan)
    with _lock:
        db = _load()
        db.setdefault(dkey, {})[pkey] = dataclasses.asdict(best)
        _save(db)
    return best


def autotune(plan, reps: int = 10, verbose: bool = False) -> KernelSpec:
    """Time every candidate for ``plan``'s problem and return the fastest spec."""
    verbose = bool(verbose)
    pb, kpb = plan.problem, plan.kproblem
    dev = plan.device_id
    rng = np.random.default_rng(0)
    host_dt = np.float32 if pb.dtype == "float32" else np.float16
    def rand(shape):
        a = (rng.standard_normal(shape) * 0.5).astype(host_dt)
        if pb.dtype == "bfloat16":      # reinterpret fp32 → bf16 by taking the high halves
            a = (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        d = _runtime.DeviceArray(shape, pb.dtype, dev)
        _runtime.memcpy_htod(d.ptr, a.ctypes.data, d.nbytes)
        return d
    x, w = rand(plan.x_shape), rand(plan.w_shape)
    out = _runtime.DeviceArray(plan.y_shape, pb.dtype, dev)
    res = rand(plan.y_shape) if plan.chain.residual_op is not None else None
    mask = _runtime.DeviceArray((plan.mask_words,), "uint32", dev) if plan.chain.mask else None
    timer = GpuTimer(stream=0)
    results = []
    for spec in candidates(kpb, plan.arch, plan.sms):
        try:
            p = plan.with_options(dataclasses.replace(plan.options, config=spec, autotune=False))
            kw = dict(out=out, stream=0)
            if res is not None:
                kw["residual"] = res
            if mask is not None:
                kw["mask_out"] = mask
            t = timer.time(lambda i: p(x, w, **kw), reps=reps, warmup=2)["median"]
            results.append((t, spec))
            if verbose:
                print(f"autotune {spec.name()} splits={spec.splits}: {t * 1e6:.1f} us")
        except Exception as e:  # noqa: BLE001 - a candidate that fails to compile or launch is skipped
            if verbose:
                print(f"autotune {spec.name()}: skipped ({type(e).__name__}: {str(e)[:200]})")
    if not results:
        return candidates(kpb, plan.arch, plan.sms)[0]
    return min(results, key=lambda r: r[0])[1]
