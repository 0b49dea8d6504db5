// igemm conv2d backward: the operand moves around the forward kernels that compute dgrad and wgrad
// (igemm/conv/_backward.py builds the problems).
//   grad_copy    dst[i0,i1,i2,i3] = f(src[base + sum_d (i_d + off_d) * ss_d])  where every 0 <= i_d + off_d < lim_d,
//                else 0; f is the identity, the ReLU-mask select (bit ? v : 0, the bit of the source element's
//                offset: the source is dy in its own memory order) or the BN-backward prologue
//                a[k]·select + b[k]·z + c[k] (k = i_cdim + off_cdim; z read at the source offset). Signed source
//                strides express permutes, flips and subsampling; the bounds express crops and zero padding.
//                The destination may accumulate (dst += v) and have another type (fp32 dw from 16-bit parts).
//                kTiled: a 32 x 32 tile over dims 3 (destination-contiguous) and `tb` (source-contiguous) goes
//                through shared memory, so both sides are coalesced (the activations' transposes of wgrad).
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

// Element (i0, i1, i2, i3): its value, 0 outside the source bounds.
template <int Mode, class TS, class P>
IGEMM_DEVICE float grad_element(const P& p, const int (&i)[4]) {
  const TS* src = static_cast<const TS*>(p.src);
  const int off[4] = {p.off0, p.off1, p.off2, p.off3};
  const int lim[4] = {p.lim0, p.lim1, p.lim2, p.lim3};
  const int64_t ss[4] = {p.ss0, p.ss1, p.ss2, p.ss3};
  int64_t so = p.base;
  bool ok = true;
#pragma unroll
  for (int d = 0; d < 4; ++d) {
    const int j = i[d] + off[d];
    ok = ok && unsigned(j) < unsigned(lim[d]);
    so += int64_t(j) * ss[d];
  }
  if (!ok) return 0.f;
  return grad_value<Mode, TS>(p, src, so, i[p.cdim] + off[p.cdim]);
}

template <bool Accum, class TD, class P>
IGEMM_DEVICE void grad_store(const P& p, const int (&i)[4], float v) {
  TD* dst = static_cast<TD*>(const_cast<void*>(p.dst));
  const int64_t o = int64_t(i[0]) * p.ds0 + int64_t(i[1]) * p.ds1 + int64_t(i[2]) * p.ds2 + int64_t(i[3]) * p.ds3;
  if constexpr (Accum) v += to_float(dst[o]);
  dst[o] = from_float<TD>(v);
}

// Untiled: one element a thread, grid-stride over the destination in (i0, i1, i2, i3) order; the index split by
// magic-number division below 2^31 elements (igemm/fastdiv.py), by 64-bit division above.
template <int Mode, bool Accum, class TS, class TD, class P>
IGEMM_DEVICE void grad_copy_flat(const P& p) {
  const int64_t n = int64_t(p.d0) * p.d1 * p.d2 * p.d3;
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
      i[3] = int(r % p.d3); r /= p.d3;
      i[2] = int(r % p.d2); r /= p.d2;
      i[1] = int(r % p.d1);
      i[0] = int(r / p.d1);
    }
    grad_store<Accum, TD>(p, i, grad_element<Mode, TS>(p, i));
  }
}

// Tiled: block (32, 8); tile (tile_b, tile_3) of dims tb and 3; the other two dims, flattened, index the
// remaining tiles. Read along tb (the source's contiguous dim), written along dim 3 (the destination's).
template <int Mode, bool Accum, class TS, class TD, class P>
IGEMM_DEVICE void grad_copy_tiled(const P& p) {
  __shared__ float tile[32][33];
  const int dims[4] = {p.d0, p.d1, p.d2, p.d3};
  const int tb = p.tb;
  int o0 = -1, o1 = -1;                    // the two other dims
  for (int d = 0; d < 3; ++d) if (d != tb) { if (o0 < 0) o0 = d; else o1 = d; }
  const int nb = (dims[tb] + 31) / 32, n3 = (dims[3] + 31) / 32;
  const int64_t tiles = int64_t(nb) * n3 * dims[o0] * dims[o1];
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    int64_t r = t;
    const int b3 = int(r % n3); r /= n3;
    const int bb = int(r % nb); r /= nb;
    int i[4];
    i[o1] = int(r % dims[o1]);
    i[o0] = int(r / dims[o1]);
    __syncthreads();
    for (int y = threadIdx.y; y < 32; y += blockDim.y) {      // read: tb fastest across the warp
      i[3] = b3 * 32 + y;
      i[tb] = bb * 32 + threadIdx.x;
      if (i[3] < dims[3] && i[tb] < dims[tb]) tile[y][threadIdx.x] = grad_element<Mode, TS>(p, i);
    }
    __syncthreads();
    for (int y = threadIdx.y; y < 32; y += blockDim.y) {      // write: dim 3 fastest across the warp
      i[tb] = bb * 32 + y;
      i[3] = b3 * 32 + threadIdx.x;
      if (i[3] < dims[3] && i[tb] < dims[tb]) grad_store<Accum, TD>(p, i, tile[threadIdx.x][y]);
    }
  }
}

template <int Mode, bool Accum, bool Tiled, class TS, class TD, class P>
__device__ void grad_copy(const P& p) {
  if constexpr (Tiled) grad_copy_tiled<Mode, Accum, TS, TD>(p);
  else grad_copy_flat<Mode, Accum, TS, TD>(p);
}

// a = gamma·invstd, b = -gamma·invstd³·sum_dy_xmu/count, c = gamma·invstd·(mean·invstd²·sum_dy_xmu - sum_dy)/count:
// PyTorch's BN backward (training statistics) written as dz = a·g + b·z + c, coef = [a; b; c] (3 x K floats).
template <class P>
__device__ void grad_coefficients(const P& p) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= p.K) return;
  const float* g = static_cast<const float*>(p.gamma);
  const float gamma = g ? g[k] : 1.f;
  const float is = static_cast<const float*>(p.invstd)[k], mu = static_cast<const float*>(p.mean)[k];
  const float m1 = static_cast<const float*>(p.sum_dy)[k] / p.count;
  const float m2 = static_cast<const float*>(p.sum_dy_xmu)[k] / p.count;
  float* coef = static_cast<float*>(const_cast<void*>(p.coef));
  const float a = gamma * is;
  coef[k] = a;
  coef[p.K + k] = -a * is * is * m2;
  coef[2 * p.K + k] = a * (mu * is * is * m2 - m1);
}

}  // namespace igemm::backward
