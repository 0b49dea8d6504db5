// igemm conv2d backward: the operand moves around the forward kernels that compute dgrad and wgrad
// (igemm/conv/_backward.py builds the problems).
//   grad_copy    dst[i0,i1,i2,i3] = f(src[base + sum_d (i_d + off_d) * ss_d])  where every 0 <= i_d + off_d < lim_d,
//                else 0; f is the identity, the ReLU-mask select (bit ? v : 0, the bit of the source element's
//                offset: the source is dy in its own memory order) or the BN-backward prologue
//                a[k]·select + b[k]·z + c[k] (k = i_cdim + off_cdim; z read at the source offset). Signed source
//                strides express permutes, flips and subsampling; the bounds express crops and zero padding.
//                The destination may accumulate (dst += v) and have another type (fp32 dw from 16-bit parts).
//                Tiled: a 32 x 32 tile over dims 3 (destination-contiguous) and TB (source-contiguous) goes
//                through shared memory, so both sides are coalesced (the activations' transposes of wgrad);
//                vectorised: 16 bytes a thread where dim 3 is contiguous on both sides (the pre-pass, interleave).
//   grad_dz      the pre-pass of a channels-last dy: dz = bit ? dy : 0, or a[k]·(bit ? dy : 0) + b[k]·z + c[k],
//                and optionally the select itself (a residual's gradient behind the ReLU) in the same pass.
//   grad_coefficients   a, b, c of the BN-backward prologue from the BN-backward reduction's sums.
#pragma once
#include "common.cuh"

namespace igemm::backward {

enum { kPlain = 0, kMask = 1, kBn = 2 };

template <int Mode, class TS, class P>
IGEMM_DEVICE float grad_value(const P& p, const TS* src, int64_t so, int k) {
  float v = to_float(src[so]);
  if constexpr (Mode != kPlain) {
    if (p.mask) {
      const uint32_t word = __ldg(static_cast<const uint32_t*>(p.mask) + (so >> 5));
      v = ((word >> (so & 31)) & 1u) ? v : 0.f;     // a select: inf/NaN where the bit is 0 give 0
    }
  }
  if constexpr (Mode == kBn) {
    const float* coef = static_cast<const float*>(p.coef);
    v = coef[k] * v + coef[p.K + k] * to_float(static_cast<const TS*>(p.z)[so]) + coef[2 * p.K + k];
  }
  return v;
}

// The BN prologue's channel of destination index i (a select chain: no dynamic index into i, which would put it
// in local memory).
template <class P>
IGEMM_DEVICE int channel(const P& p, const int (&i)[4]) {
  const int c = p.cdim;
  return c == 0 ? i[0] + p.off0 : c == 1 ? i[1] + p.off1 : c == 2 ? i[2] + p.off2 : i[3] + p.off3;
}

// The source offset of destination index i over its first D dims (base included), and whether those lie inside
// the source bounds.
template <int D, class P>
IGEMM_DEVICE bool source_offset(const P& p, const int (&i)[4], int64_t& so) {
  const int off[4] = {p.off0, p.off1, p.off2, p.off3};
  const int lim[4] = {p.lim0, p.lim1, p.lim2, p.lim3};
  const int64_t ss[4] = {p.ss0, p.ss1, p.ss2, p.ss3};
  so = p.base;
  bool ok = true;
#pragma unroll
  for (int d = 0; d < D; ++d) {
    const int j = i[d] + off[d];
    ok = ok && unsigned(j) < unsigned(lim[d]);
    so += int64_t(j) * ss[d];
  }
  return ok;
}

// Element (i0, i1, i2, i3): its value, 0 outside the source bounds.
template <int Mode, class TS, class P>
IGEMM_DEVICE float grad_element(const P& p, const int (&i)[4]) {
  int64_t so;
  if (!source_offset<4>(p, i, so)) return 0.f;
  return grad_value<Mode, TS>(p, static_cast<const TS*>(p.src), so, Mode == kBn ? channel(p, i) : 0);
}

template <bool Accum, class TD, class P>
IGEMM_DEVICE void grad_store(const P& p, const int (&i)[4], float v) {
  TD* dst = static_cast<TD*>(const_cast<void*>(p.dst));
  const int64_t o = int64_t(i[0]) * p.ds0 + int64_t(i[1]) * p.ds1 + int64_t(i[2]) * p.ds2 + int64_t(i[3]) * p.ds3;
  if constexpr (Accum) v += to_float(dst[o]);
  dst[o] = from_float<TD>(v);
}

// V consecutive dim-3 elements (unit stride on both sides, in bounds along dim 3): 16-byte loads and stores.
template <int Mode, bool Accum, int V, class TS, class TD, class P>
IGEMM_DEVICE void grad_vector(const P& p, int (&i)[4]) {
  struct alignas(sizeof(TS) * V) VS { TS v[V]; };
  struct alignas(sizeof(TD) * V) VD { TD v[V]; };
  int64_t so;
  const bool ok = source_offset<3>(p, i, so);      // (dim 3: unit stride, no bounds)
  so += i[3];
  float v[V];
  if (ok) {
    const VS in = *reinterpret_cast<const VS*>(static_cast<const TS*>(p.src) + so);
#pragma unroll
    for (int e = 0; e < V; ++e) v[e] = to_float(in.v[e]);
    if constexpr (Mode != kPlain) {
      if (p.mask) {                                  // V | 32 and so % V == 0: one word holds the V bits
        const uint32_t bits = __ldg(static_cast<const uint32_t*>(p.mask) + (so >> 5)) >> (so & 31);
#pragma unroll
        for (int e = 0; e < V; ++e) v[e] = ((bits >> e) & 1u) ? v[e] : 0.f;
      }
    }
    if constexpr (Mode == kBn) {
      const VS zin = *reinterpret_cast<const VS*>(static_cast<const TS*>(p.z) + so);
      const float* coef = static_cast<const float*>(p.coef);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const int k = channel(p, i) + (p.cdim == 3 ? e : 0);
        v[e] = coef[k] * v[e] + coef[p.K + k] * to_float(zin.v[e]) + coef[2 * p.K + k];
      }
    }
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) v[e] = 0.f;
  }
  VD* dst = reinterpret_cast<VD*>(static_cast<TD*>(const_cast<void*>(p.dst)) + int64_t(i[0]) * p.ds0 +
                                  int64_t(i[1]) * p.ds1 + int64_t(i[2]) * p.ds2 + i[3]);
  VD o;
  if constexpr (Accum) o = *dst;
#pragma unroll
  for (int e = 0; e < V; ++e) o.v[e] = from_float<TD>(Accum ? v[e] + to_float(o.v[e]) : v[e]);
  *dst = o;
}

// Untiled: V elements a thread (V > 1: dim 3 unit-stride on both sides, d3 % V == 0, 16-byte aligned rows),
// grid-stride over the destination in (i0, i1, i2, i3) order; the index split by magic-number division below
// 2^31 vectors (igemm/fastdiv.py; fd3 divides by d3 / V), by 64-bit division above.
template <int Mode, bool Accum, int V, class TS, class TD, class P>
IGEMM_DEVICE void grad_copy_flat(const P& p) {
  const int d3 = p.d3 / V;
  const int64_t n = int64_t(p.d0) * p.d1 * p.d2 * d3;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
    int i[4];
    if (n < (int64_t(1) << 31)) {
      int r;
      p.fd3.divmod(r, i[3], int(e));
      p.fd2.divmod(r, i[2], r);
      p.fd1.divmod(i[0], i[1], r);
    } else {
      int64_t r = e;
      i[3] = int(r % d3); r /= d3;
      i[2] = int(r % p.d2); r /= p.d2;
      i[1] = int(r % p.d1);
      i[0] = int(r / p.d1);
    }
    if constexpr (V == 1) {
      grad_store<Accum, TD>(p, i, grad_element<Mode, TS>(p, i));
    } else {
      i[3] *= V;
      grad_vector<Mode, Accum, V, TS, TD>(p, i);
    }
  }
}

// Tiled: block (32, 8); tile (32 of dim TB, 32 of dim 3): blockIdx.x, its two indices split once (32-bit); the
// other two dims O0, O1 by blockIdx.z, blockIdx.y, grid-stride (no 64-bit division anywhere). Read along TB (the
// source's contiguous dim), written along dim 3 (the destination's). (A 64 x 64 tile, 16 loads a thread in
// flight, measured slower: docs/performance.md: grad-moves-vectorised.)
template <int Mode, bool Accum, int TB, class TS, class TD, class P>
IGEMM_DEVICE void grad_copy_tiled(const P& p) {
  static_assert(TB >= 0 && TB < 3, "the tile's source dim");
  constexpr int O0 = TB == 0 ? 1 : 0, O1 = TB == 2 ? 1 : 2;     // the two other dims
  __shared__ float tile[32][33];
  const int dims[4] = {p.d0, p.d1, p.d2, p.d3};
  const int n3 = (dims[3] + 31) / 32;
  const int bb = int(blockIdx.x) / n3, b3 = int(blockIdx.x) % n3;
  int i[4];
  for (int o0 = blockIdx.z; o0 < dims[O0]; o0 += gridDim.z) {
    for (int o1 = blockIdx.y; o1 < dims[O1]; o1 += gridDim.y) {
      i[O0] = o0;
      i[O1] = o1;
      __syncthreads();
      for (int y = threadIdx.y; y < 32; y += blockDim.y) {      // read: TB fastest across the warp
        i[3] = b3 * 32 + y;
        i[TB] = bb * 32 + threadIdx.x;
        if (i[3] < dims[3] && i[TB] < dims[TB]) tile[y][threadIdx.x] = grad_element<Mode, TS>(p, i);
      }
      __syncthreads();
      for (int y = threadIdx.y; y < 32; y += blockDim.y) {      // write: dim 3 fastest across the warp
        i[TB] = bb * 32 + y;
        i[3] = b3 * 32 + threadIdx.x;
        if (i[3] < dims[3] && i[TB] < dims[TB]) grad_store<Accum, TD>(p, i, tile[threadIdx.x][y]);
      }
    }
  }
}

// Vec 0: tiled over dims TB and 3; 1: one element a thread; > 1: that many a thread (grad_vector).
template <int Mode, bool Accum, int Vec, int TB, class TS, class TD, class P>
__device__ void grad_copy(const P& p) {
  if constexpr (Vec == 0) grad_copy_tiled<Mode, Accum, TB, TS, TD>(p);
  else grad_copy_flat<Mode, Accum, Vec, TS, TD>(p);
}

// Eight 16-bit values with those whose bit (bits' low byte, LSB first) is 0 replaced by +0: a select, so a
// non-finite dy where the bit is 0 gives 0.
IGEMM_DEVICE uint4 select8(uint4 v, uint32_t bits) {
  uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 4; ++q)
    w[q] &= ((bits >> (2 * q)) & 1u ? 0xFFFFu : 0u) | ((bits >> (2 * q + 1)) & 1u ? 0xFFFF0000u : 0u);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// a[i]·g[i] + b[i]·z[i] + c[i] over eight 16-bit channels, in fp32, rounded once.
template <class T>
IGEMM_DEVICE uint4 bn_dz8(uint4 g, uint4 z, const float (&a)[8], const float (&b)[8], const float (&c)[8]) {
  const uint32_t gw[4] = {g.x, g.y, g.z, g.w}, zw[4] = {z.x, z.y, z.z, z.w};
  uint32_t o[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    o[q] = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = 2 * q + h;
      const float v = to_float(T::bitcast(uint16_t(gw[q] >> (16 * h))));
      const float zf = to_float(T::bitcast(uint16_t(zw[q] >> (16 * h))));
      o[q] |= uint32_t(from_float<T>(a[i] * v + b[i] * zf + c[i]).raw()) << (16 * h);
    }
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// The dz coefficients a, b, c (coef = [a; b; c], K floats each) of channels ch .. ch + 7 (ch % 8 == 0); Nc: through
// the read-only path (not where the same kernel wrote them).
template <bool Nc>
IGEMM_DEVICE void coefficients8(const float* coef, int K, int ch, float (&a)[8], float (&b)[8], float (&c)[8]) {
  float* dst[3] = {a, b, c};
  const float4* q4 = reinterpret_cast<const float4*>(coef);
#pragma unroll
  for (int v = 0; v < 3; ++v)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float4 q = Nc ? __ldg(q4 + (v * K + ch) / 4 + h) : q4[(v * K + ch) / 4 + h];
      dst[v][4 * h] = q.x; dst[v][4 * h + 1] = q.y; dst[v][4 * h + 2] = q.z; dst[v][4 * h + 3] = q.w;
    }
}

// dz over an [M][K] channels-last tensor (K % 8 == 0; src, dst, z, sel 16-byte aligned; coef too): Mode kMask
// dz = bit ? dy : 0; kBn dz = a[k]·(bit ? dy : 0) + b[k]·z + c[k] (no mask: every bit 1), and where `sel` is set,
// sel = bit ? dy : 0 as well. A thread owns one 8-channel chunk (the launch makes blockDim.x·gridDim.x a multiple
// of K / 8, so its coefficients stay in registers) and walks the pixels, U chunks in flight (the generic move,
// which loads the coefficients and the mask word per chunk, ran at 1.5-1.9 TB/s where K >= 256, this at 2.5-3.1:
// docs/performance.md, grad-dz-pass).
// The grid's block blk of nblk blocks of bdim threads, U chunks in flight a thread (a kernel of its own: blockIdx.x,
// blockDim.x, gridDim.x; norm_train.cuh runs them on the blocks of its own grid, with Nc false: it wrote coef itself,
// so coef is not read through the non-coherent path). Rev: each thread's pixels last to first.
template <int Mode, class T, bool Nc = true, int U = 4, bool Rev = false, class P>
__device__ void grad_dz_block(const P& p, int64_t blk, int bdim, int64_t nblk) {
  static_assert(sizeof(T) == 2 && Mode != kPlain, "16-bit; the mask or the BN prologue");
  const int kc = p.K / 8;
  const int64_t t = blk * bdim + threadIdx.x;
  const int64_t step = nblk * bdim / kc;
  const int ch = 8 * int(t % kc);
  float a[8], b[8], c[8];
  if constexpr (Mode == kBn) coefficients8<Nc>(static_cast<const float*>(p.coef), p.K, ch, a, b, c);
  const uint8_t* mask = static_cast<const uint8_t*>(p.mask);
  const uint4* src = static_cast<const uint4*>(p.src);
  const uint4* zs = static_cast<const uint4*>(p.z);
  uint4* dst = static_cast<uint4*>(const_cast<void*>(p.dst));
  uint4* sel = static_cast<uint4*>(const_cast<void*>(p.sel));
  int64_t m = t / kc, mstep = U * step;
  const int64_t iters = m < p.M ? (p.M - m + mstep - 1) / mstep : 0;
  if (Rev && iters > 1) {
    m += (iters - 1) * mstep;
    mstep = -mstep;
  }
  for (int64_t it = 0; it < iters; ++it, m += mstep) {
    uint4 d[U], z[U];
    uint32_t bits[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {             // every load of the U chunks first
      const int64_t e = (m + u * step) * p.K + ch;
      if (m + u * step < p.M) {
        d[u] = src[e / 8];
        if constexpr (Mode == kBn) z[u] = __ldcs(zs + e / 8);
        bits[u] = mask ? uint32_t(__ldg(mask + e / 8)) : 0xFFu;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t e = (m + u * step) * p.K + ch;
      if (m + u * step >= p.M) continue;
      const uint4 w = select8(d[u], bits[u]);
      if (sel) sel[e / 8] = w;
      if constexpr (Mode == kBn) {
        dst[e / 8] = bn_dz8<T>(w, z[u], a, b, c);
      } else {
        dst[e / 8] = w;
      }
    }
  }
}

template <int Mode, class T, class P>
__device__ void grad_dz(const P& p) {
  grad_dz_block<Mode, T>(p, blockIdx.x, blockDim.x, gridDim.x);
}

// a = gamma·invstd, b = -gamma·invstd³·sum_dy_xmu/count, c = gamma·invstd·(mean·invstd²·sum_dy_xmu - sum_dy)/count:
// PyTorch's BN backward (training statistics) written as dz = a·g + b·z + c, coef = [a; b; c] (3 x K floats).
template <class P>
__device__ void coefficients_at(const P& p, int k, float sum_dy, float sum_dy_xmu, float count) {
  const float* g = static_cast<const float*>(p.gamma);
  const float gamma = g ? g[k] : 1.f;
  const float is = static_cast<const float*>(p.invstd)[k], mu = static_cast<const float*>(p.mean)[k];
  const float m1 = sum_dy / count;
  const float m2 = sum_dy_xmu / count;
  float* coef = static_cast<float*>(const_cast<void*>(p.coef));
  const float a = gamma * is;
  coef[k] = a;
  coef[p.K + k] = -a * is * is * m2;
  coef[2 * p.K + k] = a * (mu * is * is * m2 - m1);
}

template <class P>
__device__ void coefficients_at(const P& p, int k, float sum_dy, float sum_dy_xmu) {
  coefficients_at(p, k, sum_dy, sum_dy_xmu, p.count);
}

// counts: the values per channel on the device (SyncBatchNorm's over every rank's batch), else the static count
template <class P>
__device__ void grad_coefficients(const P& p) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k < p.K)
    coefficients_at(p, k, static_cast<const float*>(p.sum_dy)[k], static_cast<const float*>(p.sum_dy_xmu)[k],
                    p.counts ? static_cast<const float*>(p.counts)[k] : p.count);
}

}  // namespace igemm::backward
