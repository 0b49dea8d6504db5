// igemm: the width unfold -- the conv's input preparation for few-channel inputs (conv1's C = 3).
//
// A conv with C channels and an R x S filter equals a conv with C' = roundup(S*C, V) channels and an R x 1
// filter on the width-unfolded input
//   xu[n][h][q][s*C + c] = x[n][c][h][q*sw - pw + s*dw]      (0 outside the image; lanes >= S*C are 0)
// with stride (sh, 1), padding (ph, 0), dilation (dh, 1), and the filter
//   wu[k][r][0][s*C + c] = w[k][c][r][s]                     (lanes >= S*C are 0).
// With C' % V == 0 (V = 16 bytes / element size) the conv kernel's gather moves 16 bytes a load instead
// of one element, and its reduction is R*C' long (conv1: 7*24 = 168; padding C to 8 instead: 392).
//
// One job writes rows [a][b][q] of C' elements (x: a = n, b = h; w: a = k, b = r, Q = 1, stride 1, pad 0);
// the source is addressed through element strides (sa, sb, sc, sw), so NCHW and NHWC x (KCRS and KRSC w)
// share the code. A thread writes one 16-byte chunk. Two jobs run in one launch: blocks [0, blocks0) do
// job 0, the rest job 1. Elements are moved as raw bits (T = uint16_t or uint32_t).
#pragma once
#include "common.cuh"

namespace igemm::unfold {

constexpr int kThreads = 256;

template <class T>
struct Job {
  const T* src;
  T* dst;
  int64_t sa, sb, sc, sw;      // source element strides of a, b, c and the unfolded axis
  int rows;                    // destination rows: A * B * Q
  FastDiv chunks, Q, B;        // 16-byte chunks per row (C' / V), Q, B
  int C, SC;                   // channels, S * C (the lanes that hold data)
  int stride, pad, dil, width; // along the unfolded axis; width: its extent in the source
};

template <class T>
IGEMM_DEVICE void run(const Job<T>& j, int g) {
  constexpr int V = 16 / sizeof(T);
  int row, ch, ab, q, a, b;
  j.chunks.divmod(row, ch, g);
  if (row >= j.rows) return;
  j.Q.divmod(ab, q, row);
  j.B.divmod(a, b, ab);
  const T* base = j.src + a * j.sa + b * j.sb;
  const int e0 = ch * V;
  int s = e0 / j.C, c = e0 - s * j.C;
  const int w0 = q * j.stride - j.pad;
  union { uint4 v; T e[V]; } out;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    T v = T(0);
    const int w = w0 + s * j.dil;
    if (e0 + i < j.SC && w >= 0 && w < j.width) v = __ldg(base + c * j.sc + w * j.sw);
    out.e[i] = v;
    if (++c == j.C) { c = 0; ++s; }
  }
  *reinterpret_cast<uint4*>(j.dst + (int64_t(row) * j.chunks.d + ch) * V) = out.v;
}

template <class T, class P>
__device__ void unfold2(const P& p) {
  const int b = blockIdx.x;
  if (b < p.blocks0) {
    const Job<T> j{static_cast<const T*>(p.src0), static_cast<T*>(const_cast<void*>(p.dst0)), p.sa0, p.sb0, p.sc0,
                   p.sw0, p.rows0, p.chunks0, p.Q0, p.B0, p.C0, p.SC0, p.stride0, p.pad0, p.dil0, p.width0};
    run(j, b * kThreads + int(threadIdx.x));
  } else {
    const Job<T> j{static_cast<const T*>(p.src1), static_cast<T*>(const_cast<void*>(p.dst1)), p.sa1, p.sb1, p.sc1,
                   p.sw1, p.rows1, p.chunks1, p.Q1, p.B1, p.C1, p.SC1, p.stride1, p.pad1, p.dil1, p.width1};
    run(j, (b - p.blocks0) * kThreads + int(threadIdx.x));
  }
}

}  // namespace igemm::unfold
