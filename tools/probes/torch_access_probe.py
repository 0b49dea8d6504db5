"""What torch's Python accessors and allocators cost on this host (median of N calls each timed alone, us):
the pieces a plan call's checks and its output allocation are made of.

    python tools/probes/torch_access_probe.py [N]
"""
import sys
import time

import torch


def med(fn, n):
    pc, ts = time.perf_counter_ns, []
    for i in range(n):
        t0 = pc()
        fn()
        ts.append(pc() - t0)
        if i % 200 == 199:
            torch.cuda.synchronize()
    ts.sort()
    return ts[len(ts) // 2] / 1e3


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    x = torch.randn(8, 14, 14, 64, device="cuda", dtype=torch.float16)
    ys = torch.Size((8, 14, 14, 64))
    dev = torch.device("cuda", 0)
    f16 = torch.float16
    empty = torch.empty
    tpl = torch.empty((1, 1, 1, 1), dtype=f16, device=dev).expand(ys)
    tpl_m = torch.empty(1, dtype=torch.int32, device=dev).expand(2048)
    assert torch.empty_like(tpl).is_contiguous() and torch.empty_like(tpl).shape == ys
    rows = [
        ("empty call (timer floor)", lambda: None),
        ("x.dtype", lambda: x.dtype),
        ("x.shape", lambda: x.shape),
        ("x.shape != ys", lambda: x.shape != ys),
        ("x.size()", lambda: x.size()),
        ("x.dim()", lambda: x.dim()),
        ("x.get_device()", lambda: x.get_device()),
        ("x.is_contiguous()", lambda: x.is_contiguous()),
        ("x.stride()", lambda: x.stride()),
        ("x.data_ptr()", lambda: x.data_ptr()),
        ("x.is_cuda", lambda: x.is_cuda),
        ("torch._C._cuda_getCurrentRawStream(0)", lambda: torch._C._cuda_getCurrentRawStream(0)),
        ("torch.empty(ys, dtype=, device=torch.device)", lambda: empty(ys, dtype=f16, device=dev)),
        ("torch.empty(ys, dtype=, device='cuda')", lambda: empty(ys, dtype=f16, device="cuda")),
        ("torch.empty(ys, dtype=, device=0)", lambda: empty(ys, dtype=f16, device=0)),
        ("x.new_empty(ys)", lambda: x.new_empty(ys)),
        ("torch.empty_like(x)", lambda: torch.empty_like(x)),
        ("torch.empty_like(one element expanded to ys)", lambda: torch.empty_like(tpl)),
        ("torch.empty_like(int32 one element expanded to 2048)", lambda: torch.empty_like(tpl_m)),
        ("torch.empty(2048, dtype=int32, device=dev)", lambda: empty(2048, dtype=torch.int32, device=dev)),
        ("x.new_empty(2048, dtype=int32)", lambda: x.new_empty(2048, dtype=torch.int32)),
    ]
    print("| accessor | median us |\n|---|---|")
    for name, fn in rows:
        for _ in range(200):
            fn()
        print(f"| {name} | {med(fn, n):.3f} |")


if __name__ == "__main__":
    main()
