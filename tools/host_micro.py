"""Where a plan call's host time goes: each piece of the fp16 NHWC plan call timed alone (perf_counter,
best of 5 rounds of N back-to-back calls, the GPU queue drained between rounds; and the median of N calls
each timed alone with the queue kept shallow -- a deep launch queue slows the driver's own launch).

    python tools/host_micro.py [N]
"""
import ctypes
import sys
import time

import torch

import igemm
from igemm import _runtime


def t(fn, n):
    """(loop: best of 5 rounds of n back-to-back calls, the launch queue up to n deep; median: each call
    timed alone, a synchronize (untimed) every 100 calls so the queue stays shallow), in us."""
    best = 1e9
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    torch.cuda.synchronize()
    pc, ts = time.perf_counter_ns, []
    for i in range(n):
        t0 = pc()
        fn()
        ts.append(pc() - t0)
        if i % 100 == 99:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    ts.sort()
    return best * 1e6, ts[len(ts) // 2] / 1e3


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    from cuda.bindings import driver
    xl = torch.randn(8, 14, 14, 64, device="cuda", dtype=torch.float16)
    w = torch.randn(64, 3, 3, 64, device="cuda", dtype=torch.float16)
    plan = igemm.Conv2dPlan(tuple(xl.shape), tuple(w.shape), "float16", "NHWC", padding=1, device=0)
    y = plan(xl, w)
    launcher, spec, ws = plan._specs[(True, True)]
    h = torch.cuda.current_stream().cuda_stream
    raw = plan._call.__wrapped__
    lib = ctypes.CDLL("libcuda.so.1")
    f = lib.cuLaunchKernel
    f.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    fn = int(launcher.func)
    g, b = launcher.grid, launcher.block
    args = plan._args
    ctx = ctypes.c_void_p()
    from igemm import _fastlaunch
    fl = _fastlaunch.get()
    saved = _fastlaunch._state
    _fastlaunch._state = {"mod": None, "why": "off for this row"}       # a plan whose lean record has no C launch
    plan_py = igemm.Conv2dPlan(tuple(xl.shape), tuple(w.shape), "float16", "NHWC", padding=1, device=0)
    plan_py(xl, w, out=y)
    _fastlaunch._state = saved
    print(f"C fast launch: {_fastlaunch.status()}")
    from igemm import epilogues as ep
    V = [torch.rand(64, device="cuda") + 0.5 for _ in range(4)]
    plan_b = igemm.Conv2dPlan(tuple(xl.shape), tuple(w.shape), "float16", "NHWC", padding=1, device=0,
                              epilogue=ep.chain(ep.BatchNorm(*V), ep.ReLU(mask=True)))
    x_n = xl.permute(0, 3, 1, 2).contiguous()
    w_n = w.permute(0, 3, 1, 2).contiguous()
    plan_t = igemm.Conv2dPlan(tuple(x_n.shape), tuple(w_n.shape), "float16", "NCHW", padding=1, device=0)
    y_t = plan_t(x_n, w_n)
    x1 = torch.randn(8, 64, 16, 16, device="cuda", dtype=torch.float16)
    w1 = torch.randn(64, 64, 1, 1, device="cuda", dtype=torch.float16)
    plan_1 = igemm.Conv2dPlan(tuple(x1.shape), tuple(w1.shape), "float16", "NCHW", device=0)
    y_1 = plan_1(x1, w1)
    m_b = plan_b(xl, w)[1]
    w_param = torch.nn.Parameter(w, requires_grad=False)
    cs_obj = driver.CUstream(h)
    for p_, a_ in ((plan, (xl, w)), (plan_b, (xl, w)), (plan_t, (x_n, w_n)), (plan_1, (x1, w1))):
        p_(*a_)
        p_(*a_)                                   # (the second call arms the C call)
    rows = [
        ("plan call (the lean path: context current, one kernel; C launch)", lambda: plan(xl, w, out=y)),
        ("plan call, lean path with the Python launch (cuda.bindings)", lambda: plan_py(xl, w, out=y)),
        ("plan call, w an nn.Parameter", lambda: plan(xl, w_param, out=y)),
        ("plan call allocating y", lambda: plan(xl, w)),
        ("BN+ReLU(mask) plan call, out= and mask_out= given", lambda: plan_b(xl, w, out=y, mask_out=m_b)),
        ("BN+ReLU(mask) plan call allocating y and the mask", lambda: plan_b(xl, w)),
        ("NCHW 3x3 plan call (transpose + conv: two launches)", lambda: plan_t(x_n, w_n, out=y_t)),
        ("NCHW 1x1 plan call (x read in place)", lambda: plan_1(x1, w1, out=y_1)),
        ("plan._call (the general path, keeps_current_context)", lambda: plan._call(xl, w, out=y)),
        ("plan._call, no context decorator", lambda: raw(plan, xl, w, out=y)),
        ("plan._launch only", lambda: plan._launch(h, launcher, spec, ws, xl.data_ptr(), w.data_ptr(), y.data_ptr(), 0, 0, None)),
        ("Launcher call", lambda: launcher(h, args)),
        ("cuLaunchKernel via cuda.bindings (a CUstream built per call)", lambda: driver.cuLaunchKernel(launcher.func, *g, *b, launcher.smem,
                                                                          driver.CUstream(h), args.address, 0)),
        ("cuLaunchKernel via cuda.bindings, CUstream built once", lambda: driver.cuLaunchKernel(
            launcher.func, *g, *b, launcher.smem, cs_obj, args.address, 0)),
        ("cuLaunchKernel via ctypes", lambda: f(fn, *g, *b, launcher.smem, h, args.address, None)),
        ("cuLaunchKernel via the C launch (igemm_fastlaunch.raw)",
         (lambda: fl.raw(fn, *g, *b, launcher.smem, h, args.address)) if fl else (lambda: None)),
        ("cuCtxGetCurrent via cuda.bindings", lambda: driver.cuCtxGetCurrent()),
        ("cuCtxGetCurrent via ctypes", lambda: lib.cuCtxGetCurrent(ctypes.byref(ctx))),
        ("_runtime.device(0)", lambda: _runtime.device(0)),
        ("torch current raw stream", lambda: torch._C._cuda_getCurrentRawStream(0)),
        ("3 data_ptr() + 2 is_contiguous()", lambda: (xl.data_ptr(), w.data_ptr(), y.data_ptr(), xl.is_contiguous(),
                                                      w.is_contiguous())),
    ]
    cf = plan_b._cfast
    if cf is not None:
        r = cf(plan_b._cst, xl, w, None, None, None)
        print(f"BN+ReLU(mask) allocating call in C: {'no (None: the Python path)' if r is None else 'yes'}")
        rows += [("torch.empty_like(the mask's template)", lambda: torch.empty_like(plan_b._cst[14])),
                 ("torch.empty_like(x)", lambda: torch.empty_like(xl)),
                 ("C conv() allocating y and the mask, called directly",
                  lambda: cf(plan_b._cst, xl, w, None, None, None))]
    print("| piece | host us per call (loop, queue up to N deep) | median per call (queue <= 100) |\n|---|---|---|")
    for name, fn_ in rows:
        loop, med = t(fn_, n)
        print(f"| {name} | {loop:.2f} | {med:.2f} |")


if __name__ == "__main__":
    main()
