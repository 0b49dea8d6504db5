// igemm: explicit im2col, the baseline that materialises the convolution's GEMM operand (igemm/_algorithms.py
// pairs it with one cuBLAS GEMM through nvmath-python; see igemm/compare.py).
//
//   NHWC: cols[N*P*Q][R*S*C]     row m = (n, p, q), column kk = (r, s, c)   (w[K][R][S][C] is [K][R*S*C])
//         y[NPQ][K] = cols @ w^T lands directly in y[N][P][Q][K].
//   NCHW: cols[N][C*R*S][P*Q]    row kk = (c, r, s), column (p, q)          (w[K][C][R][S] is [K][C*R*S])
//         y[n][K][PQ] = w @ cols[n] (batched, w broadcast) lands directly in y[N][K][P][Q].
//
// Both are "rows x row_len" matrices (NHWC: rows = N*P*Q, row_len = R*S*C / Vec vectors of Vec channels;
// NCHW: rows = N*C*R*S, row_len = P*Q elements, Vec = 1). A block takes `rows_per_iter` consecutive rows
// at a time (grid-stride over row groups, for_each_element); its threads sweep the group's
// rows_per_iter*row_len elements, so consecutive threads write consecutive addresses whatever the row length. Every index below 2^31 is
// decoded with igemm::FastDiv (the plan checks rows < 2^31, rows_per_iter*row_len < 2^31 and one image
// of x < 2^31 elements); offsets into x and cols are 64-bit. Padding taps are written as zeros.
#pragma once
#include "common.cuh"

namespace igemm::im2col {

template <class T, int Vec>
struct alignas(sizeof(T) * Vec) Pack { T v[Vec]; };

// f(m, j) for element j of row m, every (m, j) once: groups of rows_per_iter rows, grid-stride over groups,
// a group's rows_per_iter*row_len elements swept by the block's threads (consecutive threads, consecutive j).
template <class Params, class F>
IGEMM_DEVICE void for_each_element(const Params& p, F&& f) {
  for (int64_t g = blockIdx.x; g * p.rows_per_iter < p.rows; g += gridDim.x) {
    const int m0 = int(g * p.rows_per_iter);
    const int nloc = min(p.rows_per_iter, p.rows - m0) * p.row_len;
    for (int l = threadIdx.x; l < nloc; l += blockDim.x) {
      int mi, j;
      p.fd_L.divmod(mi, j, l);
      f(m0 + mi, j);
    }
  }
}

template <class T, int Vec, class Params>
__device__ void im2col_nhwc(const Params& p) {
  using V = Pack<T, Vec>;
  const T* x = static_cast<const T*>(p.x);
  T* cols = static_cast<T*>(const_cast<void*>(p.cols));
  const int64_t Kd = int64_t(p.R) * p.S * p.C;        // row length in elements
  for_each_element(p, [&](int m, int j) {
    int n, pq, pp, q, rs, c, r, s;
    p.fd_PQ.divmod(n, pq, m);
    p.fd_Q.divmod(pp, q, pq);
    const int kk = j * Vec;
    p.fd_C.divmod(rs, c, kk);
    p.fd_S.divmod(r, s, rs);
    const int h = pp * p.sh - p.ph + r * p.dh;
    const int w = q * p.sw - p.pw + s * p.dw;
    V v;
    if (h >= 0 && h < p.H && w >= 0 && w < p.W) {
      v = *reinterpret_cast<const V*>(x + ((int64_t(n) * p.H + h) * p.W + w) * p.C + c);
    } else {
#pragma unroll
      for (int e = 0; e < Vec; ++e) v.v[e] = T(0.f);
    }
    *reinterpret_cast<V*>(cols + int64_t(m) * Kd + kk) = v;
  });
}

template <class T, class Params>
__device__ void im2col_nchw(const Params& p) {
  const T* x = static_cast<const T*>(p.x);
  T* cols = static_cast<T*>(const_cast<void*>(p.cols));
  const int PQ = p.P * p.Q;
  for_each_element(p, [&](int m, int j) {               // m = (n, kk)
    int n, kk, c, rs, r, s, pp, q;
    p.fd_Kd.divmod(n, kk, m);
    p.fd_RS.divmod(c, rs, kk);
    p.fd_S.divmod(r, s, rs);
    p.fd_Q.divmod(pp, q, j);
    const int h = pp * p.sh - p.ph + r * p.dh;
    const int w = q * p.sw - p.pw + s * p.dw;
    T v = T(0.f);
    if (h >= 0 && h < p.H && w >= 0 && w < p.W) v = x[((int64_t(n) * p.C + c) * p.H + h) * p.W + w];
    cols[int64_t(m) * PQ + j] = v;
  });
}

}  // namespace igemm::im2col
