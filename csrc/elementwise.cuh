// igemm: storage types of the elementwise families (index_add, prelu): a float type's bits and its fp32
// conversions (Elem), and a pack of V elements loaded or stored as one vector (Pack).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "common.cuh"

namespace igemm {

template <class T> struct Elem;
template <> struct Elem<float> {
  using Bits = float;
  static IGEMM_DEVICE float to_f(float b) { return b; }
  static IGEMM_DEVICE float from_f(float f) { return f; }
};
template <> struct Elem<cutlass::half_t> {
  using Bits = uint16_t;
  static IGEMM_DEVICE float to_f(uint16_t b) { return __half2float(__ushort_as_half(b)); }
  static IGEMM_DEVICE uint16_t from_f(float f) { return __half_as_ushort(__float2half_rn(f)); }
};
template <> struct Elem<cutlass::bfloat16_t> {
  using Bits = uint16_t;
  static IGEMM_DEVICE float to_f(uint16_t b) { return __bfloat162float(__ushort_as_bfloat16(b)); }
  static IGEMM_DEVICE uint16_t from_f(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
};

template <class B, int V>
struct alignas(sizeof(B) * V) Pack { B v[V]; };

}  // namespace igemm
