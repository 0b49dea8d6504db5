"""Variants of relu_backward's memory access, timed like bench_epilogues (CUDA graphs, 2 rotating input
sets of (16,32,112,112) fp32, median of replays), with threshold_backward and a torch copy of the same
bytes in the same run.

    python tools/probes/relu_probe.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import igemm  # noqa: E402
from igemm import _kernel  # noqa: E402
from igemm._kernel import ParamSpec  # noqa: E402

PARAMS = [ParamSpec("dy", "ptr"), ParamSpec("mask", "ptr"), ParamSpec("dx", "ptr"), ParamSpec("n", "int64")]

PRELUDE = r'''
#include "common.cuh"
namespace probe {
template <int LD> __device__ __forceinline__ uint4 ld16(const void* p, uint64_t pol) {
  uint4 v;
  if constexpr (LD == 0)
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else if constexpr (LD == 1)
    asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
  return v;
}
template <int ST> __device__ __forceinline__ void st16(void* p, uint4 v, uint64_t pol) {
  if constexpr (ST == 0)
    asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
  else if constexpr (ST == 1)
    asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
  else
    asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1,%2,%3,%4}, %5;" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(pol));
}
// MAP 0: grid-stride (the library's); MAP 1: block b owns packs [b*U*T, (b+1)*U*T)
template <int U, int LD, int ST, int MAP, class Params>
__device__ void bwd(const Params& p) {
  const float* dy = static_cast<const float*>(p.dy);
  const uint32_t* mask = static_cast<const uint32_t*>(p.mask);
  float* dx = static_cast<float*>(const_cast<void*>(p.dx));
  uint64_t pol = 0;
  if constexpr (LD == 2 || ST == 2) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  const int64_t nvec = p.n / 4;
  const int64_t stride = MAP == 0 ? int64_t(gridDim.x) * blockDim.x : int64_t(blockDim.x);
  const int64_t first = MAP == 0 ? int64_t(blockIdx.x) * blockDim.x + threadIdx.x
                                 : int64_t(blockIdx.x) * blockDim.x * U + threadIdx.x;
  const int64_t step = MAP == 0 ? U * stride : (int64_t(1) << 62);
  for (int64_t v0 = first; v0 < nvec; v0 += step) {
    uint4 in[U];
    uint32_t word[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + u * stride;
      if (v < nvec) {
        in[u] = ld16<LD>(reinterpret_cast<const uint4*>(dy) + v, pol);
        word[u] = __ldg(mask + (v >> 3));
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + u * stride;
      if (v < nvec) {
        const uint32_t bits = word[u] >> ((v * 4) & 31);
        uint4 o;
        o.x = (bits & 1u) ? in[u].x : 0u;
        o.y = (bits & 2u) ? in[u].y : 0u;
        o.z = (bits & 4u) ? in[u].z : 0u;
        o.w = (bits & 8u) ? in[u].w : 0u;
        st16<ST>(reinterpret_cast<uint4*>(dx) + v, o, pol);
      }
    }
  }
}
}  // namespace probe
'''

# (threads, U, LD, ST, MAP, min_blocks)
VARIANTS = [
    (256, 8, 0, 0, 0), (256, 4, 0, 0, 0), (256, 16, 0, 0, 0), (512, 8, 0, 0, 0), (128, 8, 0, 0, 0),
    (1024, 8, 0, 0, 0), (256, 8, 1, 0, 0), (256, 8, 0, 1, 0), (256, 8, 2, 0, 0), (256, 8, 0, 2, 0),
    (256, 8, 2, 2, 0), (256, 8, 1, 1, 0),
    (256, 1, 0, 0, 1), (256, 2, 0, 0, 1), (256, 4, 0, 0, 1), (256, 8, 0, 0, 1), (512, 4, 0, 0, 1),
    (128, 4, 0, 0, 1),
]


_BENCH = None


def timeit(fn, n_inputs):
    """Microseconds of one ``fn(i)``: benchmarks/_harness.py's CUDA-graph timing (median over replays)."""
    global _BENCH
    if _BENCH is None:
        import argparse
        import _harness
        _BENCH = _harness.Bench("relu_probe", argparse.Namespace(quick=False, reps=50, warmup=10, out="/tmp/relu_probe"))
    return _BENCH.time(fn, n_inputs) * 1e6


def main():
    shape = (16, 32, 112, 112)
    n = 16 * 32 * 112 * 112
    sets = 2
    ys = [torch.randn(shape, device="cuda") for _ in range(sets)]
    dys = [torch.randn(shape, device="cuda") for _ in range(sets)]
    msk = [igemm.relu_mask(y) for y in ys]
    dx = torch.empty(shape, device="cuda")
    ref = [torch.ops.aten.threshold_backward(dys[i], ys[i], 0.0) for i in range(sets)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    launchers = {}
    for (T, U, LD, ST, MAP) in VARIANTS:
        name = f"probe_relu_bwd_T{T}_U{U}_L{LD}_S{ST}_M{MAP}"
        stub = _kernel.render_kernel(include="relu.cuh", entry=name, params=PARAMS, threads=T, prelude=PRELUDE,
                                     body=f"probe::bwd<{U}, {LD}, {ST}, {MAP}>(p);")
        k = _kernel.load(stub, name, name, 0)
        nvec = n // 4
        if MAP == 0:
            grid = max(1, min(sms * (2048 // T), -(-nvec // (U * T))))
        else:
            grid = -(-nvec // (U * T))
        launchers[name] = (_kernel.Launcher(k, grid, T), grid)
    rows = []
    base = {}
    t_th = timeit(lambda i: torch.ops.aten.threshold_backward(dys[i], ys[i], 0.0), sets)
    t_lib = timeit(lambda i: igemm.relu_backward(dys[i], msk[i], out=dx), sets)
    t_copy = timeit(lambda i: torch.mul(dys[i], 1.0, out=dx), sets)
    for rep in range(2):
        for name, (L, grid) in launchers.items():
            def fn(i, L=L):
                L(torch.cuda.current_stream().cuda_stream, _kernel.bind_args(PARAMS, {"dy": dys[i].data_ptr(), "mask": msk[i].data_ptr(),
                                                                 "dx": dx.data_ptr(), "n": n}))
            if rep == 0:
                dx.fill_(float("nan"))
                fn(1)
                torch.cuda.synchronize()
                ok = torch.equal(dx, ref[1])
            t = timeit(fn, sets)
            base.setdefault(name, []).append(t)
            if rep == 0:
                rows.append((name, grid, ok))
    print(f"threshold_backward {t_th:.2f} us; igemm.relu_backward {t_lib:.2f} us (ratio {t_lib / t_th:.3f}); "
          f"torch.mul copy dy->dx {t_copy:.2f} us ({t_copy / t_th:.3f})")
    t_th2 = timeit(lambda i: torch.ops.aten.threshold_backward(dys[i], ys[i], 0.0), sets)
    t_lib2 = timeit(lambda i: igemm.relu_backward(dys[i], msk[i], out=dx), sets)
    print(f"again: threshold_backward {t_th2:.2f} us; igemm.relu_backward {t_lib2:.2f} us "
          f"(ratio {t_lib2 / t_th2:.3f})")
    th = (t_th + t_th2) / 2
    print("| variant | grid | exact | us (2 passes) | / threshold_backward |")
    print("|---|---|---|---|---|")
    for name, grid, ok in rows:
        ts = base[name]
        print(f"| {name} | {grid} | {ok} | {ts[0]:.2f} / {ts[1]:.2f} | {min(ts) / th:.3f} |")


if __name__ == "__main__":
    main()
