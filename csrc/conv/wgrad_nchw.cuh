// igemm conv2d backward: the weight gradient of a 16-bit NCHW 1x1 stride-1 convolution, x and dy read where they
// lie (igemm/conv/_native_nchw.py builds the launch; docs/performance.md: wgrad-nchw-1x1).
//   dw[k, c] = sum over images n and pixels j of dy[n, k, j] · x[n, c, j]: GEMM M = K, N = C, reduction = N × P·Q,
//   a k-tile 64 pixels of one image (an image's last k-tile reads zeros past P·Q). In NCHW both operands are rows
//   of pixels: A = dy as [N][K][P·Q] and B = x as [N][C][P·Q] (3-D tiled maps, boxes of 64 pixels × 64 channels of
//   image n) land K-major, as the forward's operands do, and wgmma reads both from 128-byte swizzled rows. Units
//   (tiles × splits), the split partials and the store are WgradWork's (csrc/conv/grad_sm90.cuh).
#pragma once
#include "conv/grad_sm90.cuh"

namespace igemm::grad {

template <class TO, int BM, int BN, class P>
struct WgradNchwWork {
  static constexpr int NB = BN / 64;
  static constexpr int kStore = kStoreThreads;
  static constexpr bool kAdd = false, kMask = false, kZeros = false, kBMajorK = true;
  static constexpr int kMaskBytes = 0;
  const P& p;
  struct Unit {
    int m0, n0, nkt, kt0, z;
  };
  IGEMM_DEVICE int units() const { return wgrad_tiles<BM, BN>(p) * p.splits; }
  IGEMM_DEVICE int M(const Unit&) const { return p.M; }
  IGEMM_DEVICE int Ncol() const { return p.Ncol; }
  IGEMM_DEVICE Unit unit(int u) const {
    Unit un;
    wgrad_split<BM, BN>(p, u, [&] { return p.kt; }, un);
    return un;
  }
  // k-tile kt0 + i = pixels j·64 .. of image n: dy's rows m0 .. (A) and x's rows n0 .. (B); rows and pixels past
  // the tensors' ends read zeros
  IGEMM_DEVICE void issue(const Unit& un, int i, uint8_t* a, uint64_t* bar) const {
    int n, j;
    p.fd_T.divmod(n, j, un.kt0 + i);
    mbar_expect_tx(bar, (BM + BN) * BK * 2);
#pragma unroll
    for (int k = 0; k < BM / 64; ++k) tma_load_3d(a + k * BOX, p.tmA, bar, j * BK, un.m0 + 64 * k, n);
#pragma unroll
    for (int c = 0; c < NB; ++c) tma_load_3d(a + BM * BK * 2 + c * BOX, p.tmB, bar, j * BK, un.n0 + 64 * c, n);
  }
  IGEMM_DEVICE NoMask masker(const Unit&, int) const { return {}; }
  IGEMM_DEVICE TO* out(const Unit& un) const { return wgrad_out<TO>(p, un.z); }
  IGEMM_DEVICE int64_t row_at(const Unit&, int row) const { return int64_t(row) * p.Ncol; }
};

template <class T, class TO, int BM, int BN, int Stages, bool Ws, class P>
__device__ void wgrad_nchw(const P& p) {
  grad_run<T, TO, BM, BN, Stages, Ws, true>(WgradNchwWork<TO, BM, BN, P>{p}, p.tmA, p.tmB);
}

}  // namespace igemm::grad
