// igemm: ReLU mask kernels (the mask format of ARCHITECTURE.md: bit i%32 of word i/32 is 1 exactly when
// element i, in memory order, is > 0).
//   relu_backward: dx = bit ? dy : 0   (a select: inf/NaN in dy where the bit is 0 gives 0)
//   relu_mask:     mask = pack(y > 0)  (used where a fused epilogue cannot own whole mask words)
// Vec elements per thread (16 bytes when aligned, 1 otherwise); grid-stride loops.
#pragma once
#include "common.cuh"

namespace igemm::relu {

template <class T, int Vec>
struct alignas(sizeof(T) * Vec) Pack { T v[Vec]; };

template <class T, int Vec, class Params>
__device__ void relu_backward(const Params& p) {
  const T* dy = static_cast<const T*>(p.dy);
  const uint32_t* mask = static_cast<const uint32_t*>(p.mask);
  T* dx = static_cast<T*>(const_cast<void*>(p.dx));
  constexpr int U = 8;                    // independent 16-byte loads in flight per thread
  const int64_t nvec = p.n / Vec;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t v0 = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v0 < nvec; v0 += U * stride) {
    Pack<T, Vec> in[U];
    uint32_t word[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + u * stride;
      if (v < nvec) {
        if constexpr (sizeof(Pack<T, Vec>) == 16) {   // streamed once: no L1 allocation, no L2 prefetch hint
          // (docs/performance.md: relu-backward-8-packs)
          const uint4 r = ldg_stream16(reinterpret_cast<const Pack<T, Vec>*>(dy) + v);
          in[u] = *reinterpret_cast<const Pack<T, Vec>*>(&r);
        } else {
          in[u] = reinterpret_cast<const Pack<T, Vec>*>(dy)[v];
        }
        word[u] = __ldg(mask + ((v * Vec) >> 5));
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + u * stride;
      if (v < nvec) {
        const uint32_t bits = word[u] >> ((v * Vec) & 31);
        Pack<T, Vec> out;
#pragma unroll
        for (int j = 0; j < Vec; ++j) out.v[j] = ((bits >> j) & 1u) ? in[u].v[j] : T(0.f);
        if constexpr (sizeof(Pack<T, Vec>) == 16)
          stg_stream16(reinterpret_cast<Pack<T, Vec>*>(dx) + v, *reinterpret_cast<const uint4*>(&out));
        else
          reinterpret_cast<Pack<T, Vec>*>(dx)[v] = out;
      }
    }
  }
  // tail (n % Vec elements), handled by the first threads of block 0
  const int64_t tail0 = nvec * Vec;
  if (blockIdx.x == 0 && tail0 + threadIdx.x < p.n) {
    const int64_t e = tail0 + threadIdx.x;
    uint32_t bit = (mask[e >> 5] >> (e & 31)) & 1u;
    dx[e] = bit ? dy[e] : T(0.f);
  }
}

// One warp builds 32/Vec ... words per iteration: lane l owns elements [l*Vec, l*Vec+Vec) of a
// 32*Vec-element chunk; the Vec-bit fragments of the 32/Vec lanes of a word are OR-ed with shuffles.
template <class T, int Vec, class Params>
__device__ void relu_mask(const Params& p) {
  const T* y = static_cast<const T*>(p.y);
  uint32_t* mask = static_cast<uint32_t*>(const_cast<void*>(p.mask));
  pdl_wait();   // (after a conv whose epilogue could not own whole words: launched as its dependent)
  constexpr int kLanesPerWord = 32 / Vec;
  const int lane = threadIdx.x & 31;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t nwarps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  const int64_t nwords = (p.n + 31) >> 5;
  const int64_t chunks = (nwords * 32 + 32 * Vec - 1) / (32 * Vec);
  for (int64_t c = warp; c < chunks; c += nwarps) {
    const int64_t e0 = c * 32 * Vec + int64_t(lane) * Vec;
    uint32_t frag = 0;
    if (e0 + Vec <= p.n) {
      Pack<T, Vec> in = reinterpret_cast<const Pack<T, Vec>*>(y)[e0 / Vec];
#pragma unroll
      for (int j = 0; j < Vec; ++j) frag |= uint32_t(to_float(in.v[j]) > 0.f) << j;
    } else {
#pragma unroll
      for (int j = 0; j < Vec; ++j)
        if (e0 + j < p.n) frag |= uint32_t(to_float(y[e0 + j]) > 0.f) << j;
    }
    uint32_t word = frag << ((lane % kLanesPerWord) * Vec);
#pragma unroll
    for (int off = 1; off < kLanesPerWord; off <<= 1) word |= __shfl_xor_sync(0xffffffffu, word, off);
    const int64_t w = e0 >> 5;
    if (lane % kLanesPerWord == 0 && w < nwords) mask[w] = word;
  }
}

}  // namespace igemm::relu
