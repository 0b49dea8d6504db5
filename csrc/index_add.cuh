// igemm: index_add (torch.Tensor.index_add_ semantics) on the collapsed problem
//   x[O, D, K] (contiguous), src[O, N, K] (contiguous), index[N]:   x[o, index[i], k] += alpha * src[o, i, k]
// (O = prod of the dims before `dim`, D = x.shape[dim], K = prod of the dims after it).
//
// Kernels (igemm/index_add.py picks one; every one skips an index outside [0, D), so with the check off a
// bad index drops its rows and never faults):
//   check          first position i with index[i] outside [0, D) -> atomicMin into a status word
//                  (the host keeps it at UINT64_MAX between calls: no memset on the good path)
//   few            N <= kFewMax: the block stages the (validated) indices in shared memory once; one
//                  thread per (o, k-pack) column sweeps all N indices, U source packs in flight. A column
//                  is owned by one thread, so both variants are race-free whatever the duplicates:
//                  Atomic: fire-and-forget vector reductions into x (no load round trip);
//                  !Atomic: plain read-modify-write in index order (the default, and deterministic); when
//                  the indices are distinct, index-major: the grid sweeps two (source, x) row pairs at a
//                  time (copy-like DRAM streams), each sweep's loads issued before its stores.
//   many           one thread per source pack; (o, i, kv) from divmods of the pack number.
//   sort_tile      \  deterministic path for many indices: sort 64-bit keys (index << pos_bits | position):
//   sort_merge     /  rank-sort tiles of kSortTile in shared memory, then merge runs pairwise by rank
//                     (each key's output slot = own rank + rank in the partner run; keys are unique).
//   det_accumulate one owner per distinct index (its first sorted position) sums the source rows of its
//                  positions in ascending order, in fp32, and updates x once (no atomics).
// Packs are V elements (16 bytes when K and the pointers allow). fp16/bf16 adds: red.f16x2/.bf16x2 (and
// the .v2/.v4 vector forms on sm_90); bf16 on sm_80 goes through atomicAdd's CAS loop. Offsets are 64-bit;
// divisions use FastDiv when every dividend is < 2^31 (Wide = false), int64 division otherwise.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <type_traits>
#include "common.cuh"
#include "elementwise.cuh"

namespace igemm::index_add {

constexpr int kFewMax = 32;    // indices staged in shared memory by `few` (index_add.py: FEW_MAX)
constexpr int kSortTile = 256; // keys per block in sort_tile (== its block size)

// ----------------------------------------------------------------------------------------- elements

// Streaming (evict-first) pack load and store, for data touched once (the sweep's source and x rows).
template <class PK> struct RawOf;
template <> struct RawOf<Pack<float, 4>> { using type = uint4; };
template <> struct RawOf<Pack<float, 2>> { using type = uint2; };
template <> struct RawOf<Pack<float, 1>> { using type = unsigned int; };
template <> struct RawOf<Pack<uint16_t, 8>> { using type = uint4; };
template <> struct RawOf<Pack<uint16_t, 4>> { using type = uint2; };
template <> struct RawOf<Pack<uint16_t, 2>> { using type = unsigned int; };
template <> struct RawOf<Pack<uint16_t, 1>> { using type = unsigned short; };
template <class PK>
IGEMM_DEVICE PK ld_cs(const void* p) {
  using R = typename RawOf<PK>::type;
  const R r = __ldcs(reinterpret_cast<const R*>(p));
  return *reinterpret_cast<const PK*>(&r);
}
template <class PK>
IGEMM_DEVICE void st_cs(void* p, const PK& v) {
  using R = typename RawOf<PK>::type;
  __stcs(reinterpret_cast<R*>(p), *reinterpret_cast<const R*>(&v));
}

// f[j] = alpha * p[j]  (p aligned to the pack)
template <class T, int V>
IGEMM_DEVICE void load_scaled(const typename Elem<T>::Bits* p, float alpha, float (&f)[V]) {
  using B = typename Elem<T>::Bits;
  const Pack<B, V> pk = *reinterpret_cast<const Pack<B, V>*>(p);
#pragma unroll
  for (int j = 0; j < V; ++j) f[j] = alpha * Elem<T>::to_f(pk.v[j]);
}

// Plain read-modify-write: dst[j] = T(float(dst[j]) + f[j]).
template <class T, int V>
IGEMM_DEVICE void rmw_add(typename Elem<T>::Bits* dst, const float (&f)[V]) {
  using B = typename Elem<T>::Bits;
  Pack<B, V> pk = *reinterpret_cast<const Pack<B, V>*>(dst);
#pragma unroll
  for (int j = 0; j < V; ++j) pk.v[j] = Elem<T>::from_f(Elem<T>::to_f(pk.v[j]) + f[j]);
  *reinterpret_cast<Pack<B, V>*>(dst) = pk;
}

// Atomic dst[j] += T(f[j]) (fire-and-forget reductions; the kernels never read x after adding to it).
template <int V>
IGEMM_DEVICE void red_add_f32(float* dst, const float (&f)[V]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (V == 4) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(f[0]), "f"(f[1]), "f"(f[2]),
                 "f"(f[3]));
    return;
  }
  if constexpr (V == 2) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(f[0]), "f"(f[1]));
    return;
  }
#endif
#pragma unroll
  for (int j = 0; j < V; ++j) atomicAdd(dst + j, f[j]);
}

template <bool kHalf, int V>
IGEMM_DEVICE void red_add_16(uint16_t* dst, const uint16_t (&b)[V]) {
  if constexpr (V == 1) {
    if constexpr (kHalf) {
      asm volatile("red.global.add.noftz.f16 [%0], %1;\n" ::"l"(dst), "h"(b[0]));
    } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      asm volatile("red.global.add.noftz.bf16 [%0], %1;\n" ::"l"(dst), "h"(b[0]));
#else
      atomicAdd(reinterpret_cast<__nv_bfloat16*>(dst), __ushort_as_bfloat16(b[0]));
#endif
    }
  } else {
    static_assert(V % 2 == 0 && V <= 8, "fp16/bf16 packs of 1, 2, 4 or 8");
    uint32_t w[V / 2];
#pragma unroll
    for (int j = 0; j < V / 2; ++j) w[j] = uint32_t(b[2 * j]) | (uint32_t(b[2 * j + 1]) << 16);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (V == 8) {
      if constexpr (kHalf)
        asm volatile("red.global.add.noftz.v4.f16x2 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "r"(w[0]), "r"(w[1]),
                     "r"(w[2]), "r"(w[3]));
      else
        asm volatile("red.global.add.noftz.v4.bf16x2 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "r"(w[0]), "r"(w[1]),
                     "r"(w[2]), "r"(w[3]));
    } else if constexpr (V == 4) {
      if constexpr (kHalf)
        asm volatile("red.global.add.noftz.v2.f16x2 [%0], {%1, %2};\n" ::"l"(dst), "r"(w[0]), "r"(w[1]));
      else
        asm volatile("red.global.add.noftz.v2.bf16x2 [%0], {%1, %2};\n" ::"l"(dst), "r"(w[0]), "r"(w[1]));
    } else {
      if constexpr (kHalf)
        asm volatile("red.global.add.noftz.f16x2 [%0], %1;\n" ::"l"(dst), "r"(w[0]));
      else
        asm volatile("red.global.add.noftz.bf16x2 [%0], %1;\n" ::"l"(dst), "r"(w[0]));
    }
#else
#pragma unroll
    for (int j = 0; j < V / 2; ++j) {
      if constexpr (kHalf) {
        asm volatile("red.global.add.noftz.f16x2 [%0], %1;\n" ::"l"(dst + 2 * j), "r"(w[j]));
      } else {
        __nv_bfloat162 v;
        v.x = __ushort_as_bfloat16(b[2 * j]);
        v.y = __ushort_as_bfloat16(b[2 * j + 1]);
        atomicAdd(reinterpret_cast<__nv_bfloat162*>(dst + 2 * j), v);
      }
    }
#endif
  }
}

template <class T, int V>
IGEMM_DEVICE void red_add(typename Elem<T>::Bits* dst, const float (&f)[V]) {
  if constexpr (std::is_same<T, float>::value) {
    red_add_f32<V>(dst, f);
  } else {
    uint16_t b[V];
#pragma unroll
    for (int j = 0; j < V; ++j) b[j] = Elem<T>::from_f(f[j]);
    red_add_16<std::is_same<T, cutlass::half_t>::value, V>(dst, b);
  }
}

IGEMM_DEVICE int64_t global_thread() { return int64_t(blockIdx.x) * blockDim.x + threadIdx.x; }
IGEMM_DEVICE int64_t grid_threads() { return int64_t(gridDim.x) * blockDim.x; }

// ----------------------------------------------------------------------------------------- check
// Params: index, status (uint64, UINT64_MAX when clean), n (N), d (D).
template <class I, class Params>
__device__ void check(const Params& p) {
  const I* index = static_cast<const I*>(p.index);
  unsigned long long* status = static_cast<unsigned long long*>(const_cast<void*>(p.status));
  for (int64_t i = global_thread(); i < p.n; i += grid_threads()) {
    const int64_t d = int64_t(index[i]);
    if (d < 0 || d >= p.d) {
      atomicMin(status, static_cast<unsigned long long>(i));
      break;  // this thread's later positions are larger
    }
  }
}

// ----------------------------------------------------------------------------------------- few
// Params: x, index, src, alpha, cols (O*Kv), kv (FastDiv Kv), kv64 (Kv), n (N <= kFewMax), d (D), k (K).
template <class T, class I, int V, bool Atomic, bool Wide, class Params>
__device__ void few(const Params& p) {
  using B = typename Elem<T>::Bits;
  constexpr int U = 4;  // source packs in flight per thread
  __shared__ int64_t s_idx[kFewMax];
  const I* index = static_cast<const I*>(p.index);
  const B* src = static_cast<const B*>(p.src);
  B* x = static_cast<B*>(const_cast<void*>(p.x));
  __shared__ int s_dup;
  const int n = p.n;
  if (threadIdx.x == 0) s_dup = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t d = int64_t(index[i]);
    s_idx[i] = (d >= 0 && d < p.d) ? d : int64_t(-1);
  }
  __syncthreads();
  if constexpr (!Atomic) {
    // duplicates? (n <= kFewMax: a pairwise look-back per index)
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const int64_t d = s_idx[i];
      for (int j = 0; j < i; ++j)
        if (d >= 0 && s_idx[j] == d) s_dup = 1;
    }
    __syncthreads();
  }
  // column c's source and x bases (a column is one (o, k-pack) pair)
  auto column = [&](int64_t c, const B*& s0, B*& x0) {
    int64_t o, kv;
    if constexpr (Wide) {
      o = c / p.kv64;
      kv = c - o * p.kv64;
    } else {
      int q, r;
      p.kv.divmod(q, r, int(c));
      o = q;
      kv = r;
    }
    s0 = src + o * int64_t(n) * p.k + kv * V;
    x0 = x + o * p.d * p.k + kv * V;
  };
  if (!Atomic && !s_dup) {
    // distinct indices (the bandwidth-bound case: a few big rows), index-major: the whole grid sweeps UI
    // (source row, x row) pairs at a time, so DRAM sees a few long streams, as in a copy; a thread owns
    // the same columns in every sweep. No row is touched twice, so a sweep's x loads are independent of
    // its stores; every element is touched once: loads and stores are evict-first (.cs).
    constexpr int UI = 2;
    for (int i0 = 0; i0 < n; i0 += UI) {
      for (int64_t c = global_thread(); c < p.cols; c += grid_threads()) {
        const B* s0;
        B* x0;
        column(c, s0, x0);
        Pack<B, V> rs[UI], rx[UI];
#pragma unroll
        for (int j = 0; j < UI; ++j) {
          if (i0 + j < n && s_idx[i0 + j] >= 0) {
            rs[j] = ld_cs<Pack<B, V>>(s0 + int64_t(i0 + j) * p.k);
            rx[j] = ld_cs<Pack<B, V>>(x0 + s_idx[i0 + j] * p.k);
          }
        }
#pragma unroll
        for (int j = 0; j < UI; ++j) {
          if (i0 + j < n && s_idx[i0 + j] >= 0) {
#pragma unroll
            for (int e = 0; e < V; ++e)
              rx[j].v[e] = Elem<T>::from_f(Elem<T>::to_f(rx[j].v[e]) + p.alpha * Elem<T>::to_f(rs[j].v[e]));
            st_cs(x0 + s_idx[i0 + j] * p.k, rx[j]);
          }
        }
      }
    }
    return;
  }
  // in index order per column (duplicates, or Atomic): U source packs in flight
  for (int64_t c = global_thread(); c < p.cols; c += grid_threads()) {
    const B* s0;
    B* x0;
    column(c, s0, x0);
    for (int i0 = 0; i0 < n; i0 += U) {
      Pack<B, V> raw[U];  // raw packs (not floats): half the registers for fp16/bf16
#pragma unroll
      for (int j = 0; j < U; ++j)
        if (i0 + j < n) raw[j] = *reinterpret_cast<const Pack<B, V>*>(s0 + int64_t(i0 + j) * p.k);
#pragma unroll
      for (int j = 0; j < U; ++j) {
        if (i0 + j < n) {
          const int64_t d = s_idx[i0 + j];
          if (d >= 0) {
            float f[V];
#pragma unroll
            for (int e = 0; e < V; ++e) f[e] = p.alpha * Elem<T>::to_f(raw[j].v[e]);
            if constexpr (Atomic)
              red_add<T, V>(x0 + d * p.k, f);
            else
              rmw_add<T, V>(x0 + d * p.k, f);
          }
        }
      }
    }
  }
}

// ----------------------------------------------------------------------------------------- many
// Params: x, index, src, alpha, nvec (O*N*Kv), kv (FastDiv Kv), nidx (FastDiv N), kv64, n64, d (D), k (K).
template <class T, class I, int V, bool Wide, class Params>
__device__ void many(const Params& p) {
  using B = typename Elem<T>::Bits;
  const I* index = static_cast<const I*>(p.index);
  const B* src = static_cast<const B*>(p.src);
  B* x = static_cast<B*>(const_cast<void*>(p.x));
  for (int64_t u = global_thread(); u < p.nvec; u += grid_threads()) {
    int64_t o, i, kv;
    if constexpr (Wide) {
      const int64_t r = u / p.kv64;
      kv = u - r * p.kv64;
      o = r / p.n64;
      i = r - o * p.n64;
    } else {
      int r, k_, oo, ii;
      p.kv.divmod(r, k_, int(u));
      p.nidx.divmod(oo, ii, r);
      o = oo;
      i = ii;
      kv = k_;
    }
    float f[V];
    load_scaled<T, V>(src + u * V, p.alpha, f);   // issued with the index load, not after it
    const int64_t d = int64_t(index[i]);
    if (d < 0 || d >= p.d) continue;
    B* dst = x + (o * p.d + d) * p.k + kv * V;
    // bring x's line towards L2 while the source load is in flight: the reduction then finds it there
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(dst));
    red_add<T, V>(dst, f);
  }
}

// ----------------------------------------------------------------------------------------- sort
// Key of position i: (index[i] if it is in [0, D) else D) << pos_bits | i  -- unique, so the order is total;
// the host checks that D and N - 1 fit in 64 bits together. Invalid positions sort last, under key D.
// Params (tile): index, keys, n (N), d (D), pos_bits. Block size == kSortTile.
template <class I, class Params>
__device__ void sort_tile(const Params& p) {
  __shared__ uint64_t sk[kSortTile];
  const I* index = static_cast<const I*>(p.index);
  uint64_t* keys = static_cast<uint64_t*>(const_cast<void*>(p.keys));
  const int t = threadIdx.x;
  const int64_t ntiles = (p.n + kSortTile - 1) / kSortTile;
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {  // uniform over the block
    const int64_t base = tile * kSortTile;
    const int cnt = int(p.n - base < kSortTile ? p.n - base : kSortTile);
    uint64_t key = ~0ull;
    if (t < cnt) {
      const int64_t d = int64_t(index[base + t]);
      const uint64_t dv = (d >= 0 && d < p.d) ? uint64_t(d) : uint64_t(p.d);
      key = (dv << p.pos_bits) | uint64_t(base + t);
    }
    sk[t] = key;
    __syncthreads();
    if (t < cnt) {
      int rank = 0;
      for (int j = 0; j < cnt; ++j) rank += sk[j] < key ? 1 : 0;
      keys[base + rank] = key;
    }
    __syncthreads();
  }
}

// Number of a[0..len) strictly below key (a sorted ascending).
IGEMM_DEVICE int64_t lower_bound(const uint64_t* a, int64_t len, uint64_t key) {
  int64_t lo = 0, hi = len;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (a[mid] < key)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// One merge level: sorted runs of w = 2^log2w keys (the last may be short) -> runs of 2w.
// Params: keys_in, keys_out, n (N), log2w.
template <class Params>
__device__ void sort_merge(const Params& p) {
  const uint64_t* in = static_cast<const uint64_t*>(p.keys_in);
  uint64_t* out = static_cast<uint64_t*>(const_cast<void*>(p.keys_out));
  const int64_t w = int64_t(1) << p.log2w;
  for (int64_t g = global_thread(); g < p.n; g += grid_threads()) {
    const int64_t base = (g >> (p.log2w + 1)) << (p.log2w + 1);
    const int64_t mid = base + w < p.n ? base + w : p.n;
    const int64_t end = base + 2 * w < p.n ? base + 2 * w : p.n;
    const uint64_t key = in[g];
    if (g < mid)
      out[g + lower_bound(in + mid, end - mid, key)] = key;
    else
      out[base + (g - mid) + lower_bound(in + base, mid - base, key)] = key;
  }
}

// Params: x, src, keys (sorted), alpha, n (N), outer (O), d (D), k (K), kv (Kv = K / V), pos_bits.
// Work item t = (o, s): the group of Lanes threads owning it proceeds only if sorted position s is the first
// of its index value; lanes split the k-packs; each sums its segment's rows in position order.
template <class T, int V, int Lanes, class Params>
__device__ void det_accumulate(const Params& p) {
  using B = typename Elem<T>::Bits;
  const uint64_t* keys = static_cast<const uint64_t*>(p.keys);
  const B* src = static_cast<const B*>(p.src);
  B* x = static_cast<B*>(const_cast<void*>(p.x));
  const int64_t tid = global_thread();
  const int lane = int(tid % Lanes);
  const int64_t ngroups = grid_threads() / Lanes;
  const uint64_t pos_mask = (uint64_t(1) << p.pos_bits) - 1;
  const int64_t items = p.n * p.outer;
  for (int64_t t = tid / Lanes; t < items; t += ngroups) {
    const int64_t o = t / p.n;
    const int64_t s = t - o * p.n;
    const uint64_t d = keys[s] >> p.pos_bits;
    if (d >= uint64_t(p.d)) continue;                            // invalid indices (sorted last)
    if (s > 0 && (keys[s - 1] >> p.pos_bits) == d) continue;     // not the first of its segment
    B* xrow = x + (o * p.d + int64_t(d)) * p.k;
    const B* srow = src + o * p.n * p.k;
    for (int64_t kv = lane; kv < p.kv; kv += Lanes) {
      float acc[V];
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] = 0.f;
      for (int64_t s2 = s; s2 < p.n; ++s2) {
        const uint64_t k2 = keys[s2];
        if ((k2 >> p.pos_bits) != d) break;
        float f[V];
        load_scaled<T, V>(srow + int64_t(k2 & pos_mask) * p.k + kv * V, 1.f, f);
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] += f[j];
      }
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] *= p.alpha;
      rmw_add<T, V>(xrow + kv * V, acc);
    }
  }
}

}  // namespace igemm::index_add
