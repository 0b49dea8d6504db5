// igemm conv2d backward: wgrad for few input channels (C < 64, R·S·C <= 256: a network's first convolution, whose
// C = 3 no TMA box can copy), 16-bit NHWC, sm_80 and later (mma.sync); igemm/conv/_wgrad_small.py builds the launch.
//
//   dw[k, (r, s, c)] = sum over output pixels (n, p, q) of dy[n, p, q, k] · x[n, p·sh + r·dh − ph, q·sw + s·dw − pw, c]
//
// GEMM M = K (64 channels a CTA row of the grid), N = R·S·C (every column in one CTA: 4 warps × NT blocks of 8),
// reduction over the output pixels in units of one output row's pixels. A unit loads
//   dy  its pixels × 64 channels by cp.async (zeros past the row's end and K), 16-byte chunks swizzled by the pixel
//       so that ldmatrix.trans reads them without bank conflicts (A = dy^T, channel-major);
//   x   its patch: the R input rows its pixels reach, in shared memory such that B's column (r, s, c) at pixel q
//       lies at off(r, s, c) + q·ps, two pixels a 32-bit fragment register;
// and multiplies with mma.sync m16n8k16 (fp32 accumulators). Two forms:
//   rows    (W·C % 8 == 0) a unit is a whole output row; the R input rows are copied whole by cp.async into rows
//           with zero margins (the padding), two buffers so that unit i+1 loads while unit i multiplies;
//   gather  (any geometry) a unit is 64 pixels; the patch gathered element by element, zeros outside the image.
// A CTA runs units blockIdx.x, + gridDim.x, ... and stores its fp32 partial dw (K × R·S·C) at blockIdx.x: the grid
// is the split, and grad_sm90.cuh's split_sum adds the partials in order (deterministic) into dw.
#pragma once
#include "conv/mainloop_sm80.cuh"

namespace igemm::grad {

using namespace igemm::conv;

constexpr int kSmallQB = 64;        // output pixels a gather unit
constexpr int kSmallThreads = 128;  // 4 warps; each holds all 64 rows x its NT column blocks

IGEMM_DEVICE void ldsm_x4_trans(uint32_t (&d)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.x4.trans.m8n8.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(addr));
}

IGEMM_DEVICE uint32_t pack16(uint16_t lo, uint16_t hi) { return uint32_t(lo) | (uint32_t(hi) << 16); }

// One k16 step of a unit: A = dy^T from `dys` (ldmatrix.trans: matrices (pixels 0-7 | 8-15) × (channels 0-7 | 8-15)),
// B's column block nt at pixel q from the patch at off[nt] + q·ps (ps: the patch's stride between two pixels);
// pixels from nq on read 0 (whatever lies in the patch there).
template <class T, int NT>
IGEMM_DEVICE void small_step(float (&acc)[4][NT][4], const uint8_t* dys, const uint16_t* xs, const int (&off)[NT],
                             int ps, int ks, int nq, int lane) {
  uint32_t a[4][4];
#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
    const int row = ks * 16 + (lane >> 4) * 8 + (lane & 7), ch = 2 * mi + ((lane >> 3) & 1);
    ldsm_x4_trans(a[mi], smem_u32(dys + row * 128 + ((ch ^ (row & 7)) << 4)));
  }
  const int q = ks * 16 + 2 * (lane & 3);   // this thread's B rows: pixels q, q + 1, q + 8, q + 9
  const bool tail = q + 9 >= nq;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const uint16_t* b = xs + off[nt] + q * ps;
    uint16_t v0 = b[0], v1 = b[ps], v2 = b[8 * ps], v3 = b[9 * ps];
    if (tail) {
      v0 = q < nq ? v0 : uint16_t(0);
      v1 = q + 1 < nq ? v1 : uint16_t(0);
      v2 = q + 8 < nq ? v2 : uint16_t(0);
      v3 = q + 9 < nq ? v3 : uint16_t(0);
    }
    const uint32_t bf[2] = {pack16(v0, v1), pack16(v2, v3)};
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) Mma<T>::run(acc[mi][nt], a[mi], bf);
  }
}

// dy's pixels [q0, q0 + nq) of output row row_id, 64 channels from kb, into `rows` rows of `dys` by cp.async (zeros
// past nq and K), 16-byte chunks swizzled by the pixel.
template <class P>
IGEMM_DEVICE void small_load_dy(const P& p, int row_id, int q0, int nq, int rows, uint8_t* dys, int kb, int tid) {
  const uint16_t* dy = static_cast<const uint16_t*>(p.dy);
  const uint16_t* src = dy + (int64_t(row_id) * p.Q + q0) * p.K + kb;
  for (int i = tid; i < rows * 8; i += kSmallThreads) {
    const int row = i >> 3, ch = i & 7;
    const bool ok = row < nq && kb + ch * 8 < p.K;
    cp_async_zfill<16>(dys + row * 128 + ((ch ^ (row & 7)) << 4), ok ? src + int64_t(row) * p.K + ch * 8 : dy, ok);
  }
}

// Rows: a unit is one output row (n, p), its patch the R input rows whole, each 16-byte chunks copied by cp.async
// (W·C % 8 == 0) into a shared row of ROWP elements at LEFT, whose margins (the padding) stay zero; B's (r, s, c)
// at pixel q: r·ROWP + LEFT + (q·sw + s·dw − pw)·C + c. Two buffers: unit i+1 loads while unit i multiplies.
template <class T, int NT, class P>
IGEMM_DEVICE void wgrad_small_rows(const P& p, float (&acc)[4][NT][4]) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2;
  const int kb = blockIdx.y * 64, qpad = (p.Q + 15) & ~15, dy_bytes = qpad * 128;
  const int buf_bytes = dy_bytes + p.xs_bytes, wc8 = p.W * p.C / 8;
  int off[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int j = (warp * NT + nt) * 8 + g;
    const int rs = j / p.C, c = j - rs * p.C, r = rs / p.S, s = rs - r * p.S;
    off[nt] = j < p.rsc ? r * p.ROWP + p.LEFT + (s * p.dw - p.pw) * p.C + c : 0;
  }
  for (int i = tid; i < p.xs_bytes / 2; i += kSmallThreads) {      // both patches' margins: zero, once
    reinterpret_cast<uint16_t*>(smem_raw + dy_bytes)[i] = 0;
    reinterpret_cast<uint16_t*>(smem_raw + buf_bytes + dy_bytes)[i] = 0;
  }
  __syncthreads();                          // (before any copy lands there)
  const uint16_t* x = static_cast<const uint16_t*>(p.x);
  auto load = [&](int u, uint8_t* buf) {
    int n, pr;
    p.fd_P.divmod(n, pr, u);
    small_load_dy(p, u, 0, p.Q, qpad, buf, kb, tid);
    uint16_t* xs = reinterpret_cast<uint16_t*>(buf + dy_bytes);
    for (int i = tid; i < p.R * wc8; i += kSmallThreads) {
      int r, c8;
      p.fd_WC8.divmod(r, c8, i);
      const int h = pr * p.sh - p.ph + r * p.dh;
      const bool ok = h >= 0 && h < p.H;
      cp_async_zfill<16>(xs + r * p.ROWP + p.LEFT + c8 * 8, ok ? x + (int64_t(n) * p.H + h) * p.W * p.C + c8 * 8 : x,
                         ok);
    }
    cp_async_commit();
  };
  int it = 0;
  if (blockIdx.x < p.units) load(blockIdx.x, smem_raw);
  for (int u = blockIdx.x; u < p.units; u += gridDim.x, ++it) {
    const uint8_t* buf = smem_raw + (it & 1) * buf_bytes;
    cp_async_wait<0>();
    __syncthreads();                        // (also: every warp is done with the other buffer's unit)
    if (u + int(gridDim.x) < p.units) load(u + gridDim.x, smem_raw + ((it + 1) & 1) * buf_bytes);
    const uint16_t* xs = reinterpret_cast<const uint16_t*>(buf + dy_bytes);
    for (int ks = 0; ks < qpad / 16; ++ks) small_step<T, NT>(acc, buf, xs, off, p.sw * p.C, ks, p.Q, lane);
  }
}

// Any geometry: a unit is 64 pixels of an output row, its patch (the R input rows × the WB columns its pixels
// reach) gathered element by element, transposed to [r][c][column]; B's (r, s, c) at pixel q:
// (r·C + c)·WB + q·sw + s·dw. One buffer: the CTAs an SM holds overlap each other's loads.
template <class T, int NT, class P>
IGEMM_DEVICE void wgrad_small_gather(const P& p, float (&acc)[4][NT][4]) {
  constexpr int QB = kSmallQB;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* dys = smem_raw;
  uint16_t* xs = reinterpret_cast<uint16_t*>(smem_raw + QB * 128);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2;
  const int kb = blockIdx.y * 64;
  const uint16_t* x = static_cast<const uint16_t*>(p.x);
  int off[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int j = (warp * NT + nt) * 8 + g;
    const int rs = j / p.C, c = j - rs * p.C, r = rs / p.S, s = rs - r * p.S;
    off[nt] = j < p.rsc ? (r * p.C + c) * p.WB + s * p.dw : 0;
  }
  for (int u = blockIdx.x; u < p.units; u += gridDim.x) {
    int row_id, qc, n, pr;
    p.fd_QC.divmod(row_id, qc, u);          // row_id = n·P + p
    p.fd_P.divmod(n, pr, row_id);
    const int q0 = qc * QB, nq = min(QB, p.Q - q0);
    small_load_dy(p, row_id, q0, nq, QB, dys, kb, tid);
    cp_async_commit();
    const int h0 = pr * p.sh - p.ph, w0 = q0 * p.sw - p.pw;
    for (int i = tid; i < p.R * p.WB; i += kSmallThreads) {
      int r, w;
      p.fd_WB.divmod(r, w, i);
      const int h = h0 + r * p.dh, wg = w0 + w;
      const bool ok = h >= 0 && h < p.H && wg >= 0 && wg < p.W;
      const uint16_t* src = x + ((int64_t(n) * p.H + h) * p.W + wg) * p.C;
      uint16_t* dst = xs + r * p.C * p.WB + w;
      for (int c = 0; c < p.C; ++c) dst[c * p.WB] = ok ? __ldg(src + c) : uint16_t(0);
    }
    cp_async_wait<0>();
    __syncthreads();
    for (int ks = 0; ks < (nq + 15) >> 4; ++ks) small_step<T, NT>(acc, dys, xs, off, p.sw, ks, nq, lane);
    __syncthreads();
  }
}

template <class T, int NT, bool Rows, class P>
__device__ void wgrad_small(const P& p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  float acc[4][NT][4];
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][nt][e] = 0.f;
  if constexpr (Rows) wgrad_small_rows<T, NT>(p, acc);
  else wgrad_small_gather<T, NT>(p, acc);
  const int kb = blockIdx.y * 64;

  // this CTA's partial dw: rows kb + [0, 64) of the K x R·S·C matrix at blockIdx.x
  float* y = static_cast<float*>(const_cast<void*>(p.y)) + int64_t(blockIdx.x) * p.K * p.rsc;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = kb + mi * 16 + g + (e >> 1) * 8, j = (warp * NT + nt) * 8 + 2 * t + (e & 1);
        if (m < p.K && j < p.rsc) y[int64_t(m) * p.rsc + j] = acc[mi][nt][e];
      }
}

}  // namespace igemm::grad
