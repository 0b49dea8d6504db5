// igemm: direct convolution, the plain baseline of igemm/compare.py: one output element per thread, a
// loop over the C*R*S taps with fp32 accumulation, no shared memory, no tiling.
//
//   NCHW: x[N][C][H][W], w[K][C][R][S] -> y[N][K][P][Q]; thread e = ((n*K + k)*P + p)*Q + q
//   NHWC: x[N][H][W][C], w[K][R][S][C] -> y[N][P][Q][K]; thread e = ((n*P + p)*Q + q)*K + k
//
// Threads follow the output's memory order (coalesced stores); grid-stride loop. Output indices are
// decoded with igemm::FastDiv (the plan checks N*K*P*Q < 2^31); offsets into x and w are 64-bit.
#pragma once
#include "common.cuh"

namespace igemm::direct {

template <class T, bool Nhwc, class Params>
__device__ void conv(const Params& p) {
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const T* __restrict__ wt = static_cast<const T*>(p.w);
  T* y = static_cast<T*>(const_cast<void*>(p.y));
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t e64 = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e64 < p.total; e64 += stride) {
    const int e = int(e64);
    int n, k, pp, q, t;
    if constexpr (Nhwc) {
      p.fd_K.divmod(t, k, e);                      // t = (n*P + p)*Q + q
      p.fd_Q.divmod(t, q, t);
      p.fd_P.divmod(n, pp, t);
    } else {
      p.fd_Q.divmod(t, q, e);                      // t = (n*K + k)*P + p
      p.fd_P.divmod(t, pp, t);
      p.fd_K.divmod(n, k, t);
    }
    const int h0 = pp * p.sh - p.ph;
    const int w0 = q * p.sw - p.pw;
    float acc = 0.f;
    if constexpr (Nhwc) {
      const T* wk = wt + int64_t(k) * p.R * p.S * p.C;
      for (int r = 0; r < p.R; ++r) {
        const int h = h0 + r * p.dh;
        if (h < 0 || h >= p.H) continue;
        for (int s = 0; s < p.S; ++s) {
          const int w = w0 + s * p.dw;
          if (w < 0 || w >= p.W) continue;
          const T* xr = x + ((int64_t(n) * p.H + h) * p.W + w) * p.C;
          const T* wr = wk + (int64_t(r) * p.S + s) * p.C;
          for (int c = 0; c < p.C; ++c) acc += to_float(xr[c]) * to_float(wr[c]);
        }
      }
    } else {
      const T* xn = x + int64_t(n) * p.C * p.H * p.W;
      const T* wk = wt + int64_t(k) * p.C * p.R * p.S;
      for (int c = 0; c < p.C; ++c) {
        const T* xc = xn + int64_t(c) * p.H * p.W;
        const T* wc = wk + int64_t(c) * p.R * p.S;
        for (int r = 0; r < p.R; ++r) {
          const int h = h0 + r * p.dh;
          if (h < 0 || h >= p.H) continue;
          for (int s = 0; s < p.S; ++s) {
            const int w = w0 + s * p.dw;
            if (w < 0 || w >= p.W) continue;
            acc += to_float(xc[int64_t(h) * p.W + w]) * to_float(wc[r * p.S + s]);
          }
        }
      }
    }
    y[e] = from_float<T>(acc);
  }
}

}  // namespace igemm::direct
