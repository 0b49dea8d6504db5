// igemm: BatchNorm kernels, the pieces shared by norm_stats.cuh (per-channel reductions) and
// norm_elemt.cuh (elementwise forward/backward).
//
// Launch parameters follow every family's convention (common.cuh): declared once in igemm/norm.py as
// ParamSpec lists, rendered into `struct Params`; the templates below take `const Params& p`.
//
// Geometry. A tensor of N*C*HW elements, contiguous, in one of two layouts:
//   NCHW  x[n][c][hw]   the elements of channel c are N planes of HW contiguous elements
//   NHWC  x[m][c]       (m = n*HW + hw) a row of C channels; NCHW with HW == 1 is the same thing.
// Every kernel uses blocks of kThreads threads and loads V elements at a time (V*sizeof(T) <= 16 bytes,
// V | HW for NCHW, V | C for NHWC, pointers aligned to V*sizeof(T): chosen in Python).
#pragma once
#include "common.cuh"

namespace igemm::norm {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
enum : int { kNCHW = 0, kNHWC = 1 };

template <class T, int V>
struct alignas(sizeof(T) * V) Vec { T v[V]; };

// V elements at p (aligned to V*sizeof(T)); 16-byte packs take the streaming read-only path.
template <class T, int V>
IGEMM_DEVICE Vec<T, V> load_raw(const T* p) {
  Vec<T, V> r;
  if constexpr (sizeof(Vec<T, V>) == 16) {
    *reinterpret_cast<uint4*>(&r) = ldg_stream16(p);
  } else {
    r = *reinterpret_cast<const Vec<T, V>*>(p);
  }
  return r;
}

template <class T, int V>
IGEMM_DEVICE void to_floats(const Vec<T, V>& r, float* f) {
#pragma unroll
  for (int j = 0; j < V; ++j) f[j] = to_float(r.v[j]);
}

template <class T, int V>
IGEMM_DEVICE void load_vec(const T* p, float* f) {
  to_floats<T, V>(load_raw<T, V>(p), f);
}

// Round V floats to T, store them, and return the bits (stored value > 0), bit j for element j.
template <class T, int V>
IGEMM_DEVICE uint32_t store_vec(T* p, const float* f) {
  Vec<T, V> r;
  uint32_t bits = 0;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    r.v[j] = from_float<T>(f[j]);
    bits |= uint32_t(to_float(r.v[j]) > 0.f) << j;
  }
  *reinterpret_cast<Vec<T, V>*>(p) = r;
  return bits;
}

// Three floats that travel together through shuffles, shared memory and the workspace:
// Welford (a, b, c) = (count, mean, M2); sums (a, b) = (sum_dy, sum_dy_xmu).
struct Acc {
  float a, b, c;
};

IGEMM_DEVICE Acc shfl_xor(const Acc& v, int off) {
  return Acc{__shfl_xor_sync(0xffffffffu, v.a, off), __shfl_xor_sync(0xffffffffu, v.b, off),
             __shfl_xor_sync(0xffffffffu, v.c, off)};
}

// Chan et al.'s pairwise merge of (count, mean, M2); a part with count 0 contributes nothing
// (selected out, never multiplied by 0, so it cannot inject a NaN).
struct ChanMerge {
  IGEMM_DEVICE void operator()(Acc& x, const Acc& y) const {
    if (y.a == 0.f) return;
    if (x.a == 0.f) {
      x = y;
      return;
    }
    const float n = x.a + y.a;
    const float delta = y.b - x.b;
    const float r = y.a / n;
    x.b = fmaf(delta, r, x.b);
    x.c = x.c + y.c + delta * delta * x.a * r;
    x.a = n;
  }
};

struct SumMerge {
  IGEMM_DEVICE void operator()(Acc& x, const Acc& y) const {
    x.a += y.a;
    x.b += y.b;
  }
};

// Welford update of (a=count, b=mean, c=M2) with a batch of B values y[k] - K (B a power of two):
// the batch's own mean and M2 are exact two-pass sums in registers, then one Chan merge
// (one approximate reciprocal per batch instead of one division per element).
template <int B>
IGEMM_DEVICE void welford_batch(Acc& acc, const float* y, float K) {
  float d[B], t[B];
#pragma unroll
  for (int k = 0; k < B; ++k) {
    d[k] = y[k] - K;
    t[k] = d[k];
  }
#pragma unroll
  for (int w = B / 2; w >= 1; w >>= 1) {
#pragma unroll
    for (int k = 0; k < w; ++k) t[k] += t[k + w];
  }
  const float mb = t[0] * (1.f / float(B));
#pragma unroll
  for (int k = 0; k < B; ++k) {
    const float e = d[k] - mb;
    t[k] = e * e;
  }
#pragma unroll
  for (int w = B / 2; w >= 1; w >>= 1) {
#pragma unroll
    for (int k = 0; k < w; ++k) t[k] += t[k + w];
  }
  const float n = acc.a + float(B);
  const float r = __fdividef(float(B), n);
  const float delta = mb - acc.b;
  acc.b = fmaf(delta, r, acc.b);
  acc.c += t[0] + delta * delta * acc.a * r;
  acc.a = n;
}

// Reduce VS accumulators per thread over the threads that share tx = threadIdx.x & (tx_n - 1)
// (tx_n a power of two <= 32). Lanes of one warp first merge with xor shuffles (offsets tx_n..16),
// then lane tx of warp w stores to smem[w * tx_n * VS + tx * VS + j]. Fixed order: deterministic.
// Every thread of the block must call it (shuffles with the full mask, then __syncthreads).
template <int VS, class Merge>
IGEMM_DEVICE void warp_to_smem(Acc (&acc)[VS], Acc* smem, int tx_n, Merge merge) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  for (int off = tx_n; off < 32; off <<= 1) {
#pragma unroll
    for (int j = 0; j < VS; ++j) merge(acc[j], shfl_xor(acc[j], off));
  }
  if (lane < tx_n) {
#pragma unroll
    for (int j = 0; j < VS; ++j) smem[warp * tx_n * VS + lane * VS + j] = acc[j];
  }
  __syncthreads();
}

// Merge of the kWarps warp results for block-local slot i (after warp_to_smem), warps in order.
template <class Merge>
IGEMM_DEVICE Acc smem_merge(const Acc* smem, int ld, int i, Merge merge) {
  Acc r = smem[i];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) merge(r, smem[w * ld + i]);
  return r;
}

IGEMM_DEVICE void store_stat(const void* p, int64_t i, double v, bool f64) {
  if (f64) {
    static_cast<double*>(const_cast<void*>(p))[i] = v;
  } else {
    static_cast<float*>(const_cast<void*>(p))[i] = float(v);
  }
}

}  // namespace igemm::norm
