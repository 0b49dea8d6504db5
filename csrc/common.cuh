// igemm: device helpers shared by every kernel family.
//
// Launch-parameter convention (all families): kernels take flat scalar parameters (no struct by
// value). Each family's parameters are declared once in Python (igemm/_kernel.py: ParamSpec lists). The
// generated stub renders from that list (a) a `struct Params`, (b) the extern "C" __global__ signature
// and (c) the initialiser that rebuilds the struct on the device; the family's header templates take the
// struct as a template parameter. Python packs the values in the same order (PackedArgs) and launches
// with cuLaunchKernel. A `fastdiv` parameter travels as (int32 d, uint32 mul, uint32 shr) and is rebuilt
// as igemm::FastDiv. Pointers are `const void*` and cast by the family.
#pragma once
#include <cstdint>
#include <cutlass/numeric_types.h>
#include <cute/arch/copy_sm80.hpp>

#ifndef IGEMM_DEVICE
#define IGEMM_DEVICE __device__ __forceinline__
#endif

namespace igemm {

// Magic-number division for 0 <= n < 2^31 (igemm/fastdiv.py computes d, mul, shr on the host;
// CUTLASS FastDivmod's formula). d == 1 has mul == 0 and is special-cased (uniform branch).
struct FastDiv {
  int32_t d;
  uint32_t mul;
  uint32_t shr;
  IGEMM_DEVICE int div(int n) const {
    return d == 1 ? n : int(__umulhi(uint32_t(n), mul) >> shr);
  }
  IGEMM_DEVICE void divmod(int& q, int& r, int n) const {
    q = div(n);
    r = n - q * d;
  }
};

template <class T> IGEMM_DEVICE float to_float(T v) { return float(v); }
template <> IGEMM_DEVICE float to_float<float>(float v) { return v; }
template <class T> IGEMM_DEVICE T from_float(float v) { return T(v); }
template <> IGEMM_DEVICE float from_float<float>(float v) { return v; }

// 16-byte-or-narrower asynchronous global->shared copy, zero-filling when !pred (cp.async with
// src-size 0). Bytes must be 4, 8 or 16.
template <int Bytes>
IGEMM_DEVICE void cp_async_zfill(void* smem, const void* gmem, bool pred) {
  uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  int src = pred ? Bytes : 0;
  if constexpr (Bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(s), "l"(gmem), "n"(Bytes), "r"(src));
  }
}
IGEMM_DEVICE void cp_async_commit() { cute::cp_async_fence(); }
template <int N> IGEMM_DEVICE void cp_async_wait() { cute::cp_async_wait<N>(); }

// Read-only global load of 16 bytes, bypassing L1 allocation for streaming data.
IGEMM_DEVICE uint4 ldg_stream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
IGEMM_DEVICE void stg_stream16(void* p, uint4 v) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// Programmatic dependent launch (sm_90+; igemm/_kernel.py, Launcher.launch_after): a kernel launched
// with programmatic stream serialization may start while the kernel before it on the stream still runs,
// and waits here until that grid has finished and its writes are visible. A no-op for a kernel launched
// the usual way, and before sm_90.
IGEMM_DEVICE void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Let a programmatic dependent of this grid launch once every CTA of this grid has run this (or exited):
// its CTAs then take the SM room this grid's last wave leaves, and wait in pdl_wait.
IGEMM_DEVICE void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace igemm
