"""SyncBatchNorm on two GPUs: two processes (torch.distributed, NCCL), uneven batches, an empty rank in
some cases; statistics and backward reductions must equal the single-process result over the concatenated
batch to fp32 rounding, be bit-identical on both ranks, and the captured-graph step must replay exactly.
The ranks run tests/_syncbn_worker.py; the CPU-tier SyncBN tests are in test_norm.py (thread communicator).
"""
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from igemm import reference

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _syncbn_worker import CASES, EPS, make_case  # noqa: E402

TIMEOUT_S = int(os.environ.get("IGEMM_SYNCBN_TIMEOUT_S", "300"))   # both ranks, all cases


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _warm_kernels(arch: str | None = None, sms: int | None = None, jobs: int | None = None):
    """Compile the instances the workers launch, in parallel, once (both ranks then load them from disk).
    Without a GPU: ``python tests/test_syncbn.py precompile sm_90a 132`` fills the cache ahead of a run."""
    from igemm import _runtime, norm
    arch = arch or _runtime.device_arch(0)
    sms = sms or int(_runtime.device_props(0).multiprocessor_count)
    stubs = [norm.stub_sum_ranks(), norm.stub_gather("float64", "float64")]
    for spec in CASES.values():
        HW = int(np.prod(spec["hw"]))
        for n in (*spec["split"], sum(spec["split"])):
            stubs += norm.instances_for(spec["layout"], n, spec["C"], HW, spec["dtype"], sms=sms)
    norm.compile_stubs(stubs, arch, jobs)


@pytest.fixture(scope="module")
def syncbn_results(tmp_path_factory):
    pytest.importorskip("torch")
    _warm_kernels()
    out = tmp_path_factory.mktemp("syncbn")
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2", NCCL_NVLS_ENABLE="0",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p))
    procs, logs = [], []
    for r in range(2):
        log = open(out / f"log-rank{r}.txt", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "_syncbn_worker.py"), str(out)],
                                      env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=log,
                                      stderr=subprocess.STDOUT, cwd=ROOT))
    timed_out = False
    for p in procs:
        try:
            p.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            timed_out = True
            for q in procs:
                q.kill()
            break
    for log in logs:
        log.close()

    def tail(r):
        text = (out / f"log-rank{r}.txt").read_text()[-4000:]
        err = out / f"errors-rank{r}.txt"
        return text + ("\n" + err.read_text()[-4000:] if err.exists() else "")

    if timed_out or any(p.returncode != 0 for p in procs):
        pytest.fail(f"SyncBN workers failed (timeout={timed_out}, rc={[p.returncode for p in procs]}):\n"
                    + "\n".join(f"=== rank {r}\n{tail(r)}" for r in range(2)))
    return [dict(np.load(out / f"rank{r}.npz", allow_pickle=False)) for r in range(2)]


def _get(res, case, key):
    err = res.get(f"{case}__error")
    if err is not None:
        pytest.fail(f"{case} raised on a rank:\n{err}")
    return res[f"{case}__{key}"]


def _close(a, b, scale, tol, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.abs(a - b) / (np.asarray(scale, np.float64) + 1e-30)
    assert np.all(err <= tol), f"{what}: max scaled difference {err.max():.3g} > {tol}"


def _bits(mask_words, numel):
    return reference.unpack_mask(mask_words, numel)


def _rounded(a, dtype):
    """The values the GPU saw: float32 data rounded to dtype, as float64."""
    import torch
    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(getattr(torch, dtype)).double().numpy()


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("case", list(CASES))
def test_syncbn_two_gpus(syncbn_results, case):
    spec = CASES[case]
    r0, r1 = syncbn_results
    for res in (r0, r1):
        _get(res, case, "mean")
    layout, dtype, C = spec["layout"], spec["dtype"], spec["C"]
    x_full, dy_full, g, b = make_case(case, spec)
    if spec.get("graph"):           # the worker replayed the graph on new data, see _syncbn_worker.py
        assert int(_get(r0, case, "graph_equal")) == 1 and int(_get(r1, case, "graph_equal")) == 1, \
            "graph replay differs from the eager step"
        x_full = x_full * 0.5 + 0.25
        lo, parts = 0, []
        for n in spec["split"]:
            parts.append(dy_full[lo:lo + n][::-1])
            lo += n
        dy_full = np.concatenate(parts)
    xs, dys = _rounded(x_full, dtype), _rounded(dy_full, dtype)
    ax = 1 if layout == "NCHW" else xs.ndim - 1

    def per_channel(a):
        return np.moveaxis(a, ax, 0).reshape(C, -1)

    # 1. identical on both ranks, bit for bit (fixed merge order, same inputs)
    for k in ("mean", "invstd", "count", "sum_dy", "sum_dy_xmu"):
        np.testing.assert_array_equal(_get(r0, case, k), _get(r1, case, k), err_msg=k)
    n_tot = sum(spec["split"]) * int(np.prod(spec["hw"]))
    assert _get(r0, case, "count").tolist() == [float(n_tot)] * C
    # 2. statistics equal the single-process ones over the concatenated batch, to fp32 rounding
    mean, invstd = _get(r0, case, "mean"), _get(r0, case, "invstd")
    smean, sinv = _get(r0, case, "single_mean"), _get(r0, case, "single_invstd")
    rm, rv, _ = reference.welford_stats(xs, layout)
    _close(mean, smean, np.abs(rm) + np.sqrt(rv), 2e-6, "mean vs single process")
    _close(invstd, sinv, sinv, 2e-6, "invstd vs single process")
    _close(mean, rm, np.abs(rm) + np.sqrt(rv), 1e-5, "mean vs float64 reference")
    _close(invstd, 1 / np.sqrt(rv + EPS), 1 / np.sqrt(rv + EPS), 1e-5, "invstd vs float64 reference")
    # 3. per-rank masks describe per-rank y exactly; concatenated, they match the single process's except
    #    where y rounds differently at 0 (statistics equal only to rounding)
    ys, masks = [], []
    for res in (r0, r1):
        y = _get(res, case, "y")
        bits = _bits(_get(res, case, "mask"), y.size).reshape(y.shape)
        np.testing.assert_array_equal(bits, y > 0)
        ys.append(y)
        masks.append(bits)
    y_cat, bits_cat = np.concatenate(ys), np.concatenate(masks)
    y1 = _get(r0, case, "single_y")
    bits1 = _bits(_get(r0, case, "single_mask"), y1.size).reshape(y1.shape)
    np.testing.assert_array_equal(bits1, y1 > 0)
    assert np.mean(bits_cat == bits1) > 0.999
    tol_e = 1e-5 if dtype == "float32" else 2e-2
    assert np.linalg.norm((y_cat - y1).ravel()) / (np.linalg.norm(y1.ravel()) + 1e-30) < tol_e
    # 4. backward sums: equal to the single process's once the (rare) flipped mask bits are accounted for,
    #    and to the float64 reference with the sync mask
    d_sync = per_channel(np.where(bits_cat, dys, 0.0))
    d_single = per_channel(np.where(bits1, dys, 0.0))
    xc = per_channel(xs)
    sc1 = np.abs(d_sync).sum(1) + 1e-30
    sc2 = (np.abs(d_sync) * np.abs(xc - rm[:, None])).sum(1) + 1e-30
    flip1 = (d_sync - d_single).sum(1)
    flip2 = ((d_sync - d_single) * (xc - smean[:, None])).sum(1)
    sdy, sdx = _get(r0, case, "sum_dy"), _get(r0, case, "sum_dy_xmu")
    _close(sdy, _get(r0, case, "single_sum_dy") + flip1, sc1, 2e-6, "sum_dy vs single process")
    _close(sdx, _get(r0, case, "single_sum_dy_xmu") + flip2, sc2, 2e-6, "sum_dy_xmu vs single process")
    _close(sdy, d_sync.sum(1), sc1, 1e-5, "sum_dy vs float64 reference")
    _close(sdx, (d_sync * (xc - mean[:, None].astype(np.float64))).sum(1), sc2, 1e-5, "sum_dy_xmu vs reference")
    # local grad_weight / grad_bias of the two ranks add up to the single-process ones
    gw = _get(r0, case, "grad_weight").astype(np.float64) + _get(r1, case, "grad_weight")
    gb = _get(r0, case, "grad_bias").astype(np.float64) + _get(r1, case, "grad_bias")
    _close(gw, _get(r0, case, "single_grad_weight") + flip2 * sinv, sc2 * sinv, 4e-6, "grad_weight, ranks summed")
    _close(gb, _get(r0, case, "single_grad_bias") + flip1, sc1, 4e-6, "grad_bias, ranks summed")
    # 5. dx: the ranks' pieces equal the single process's where the masks agree
    dx_cat = np.concatenate([_get(r0, case, "dx"), _get(r1, case, "dx")])
    dx1 = _get(r0, case, "single_dx")
    same = bits_cat == bits1
    num = np.linalg.norm((dx_cat - dx1)[same])
    assert num / (np.linalg.norm(dx1[same]) + 1e-30) < tol_e
    dref = reference.batch_norm_backward_elemt_ref(dys, xs, mean, invstd, g.astype(np.float32), sdy, sdx, n_tot,
                                                   layout, reference.pack_mask(bits_cat))
    assert np.linalg.norm((dx_cat - dref).ravel()) / (np.linalg.norm(dref.ravel()) + 1e-30) < tol_e


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "precompile":
        _warm_kernels(sys.argv[2] if len(sys.argv) > 2 else "sm_90a", int(sys.argv[3]) if len(sys.argv) > 3 else 132)
