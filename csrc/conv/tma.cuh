// igemm conv2d forward: TMA loads (kLoadTma, kLoadTmaC8, kLoadTmaMN) and the mbarriers they complete on.
//
// A stage is filled by two TMA copies that thread 0 issues: an im2col-mode copy of the BM × 64 A tile
// (x NHWC as a 4-D tensor map: BM consecutive output pixels from the tile's first one, 64 channels of
// tap (r, s) from channel c0, zeros outside the image and past the last image) and a tiled copy of the
// BN × 64 B tile (w as the K × Kred matrix). Both land in the SW128 K-major layout the wgmma
// descriptors read, and complete on the stage's mbarrier (transaction bytes). The tensor maps are
// encoded by the plan (igemm/conv/_tma.py) and passed as __grid_constant__ parameters. No thread computes a
// gather address: the per-k-tile work is one divmod pair for (r, s, c0) in thread 0.
#pragma once
#include "conv/config.cuh"

namespace igemm::conv {

IGEMM_DEVICE void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

IGEMM_DEVICE void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

IGEMM_DEVICE void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  } while (!done);
}

IGEMM_DEVICE void tma_load_im2col_4d(void* dst, const void* map, uint64_t* bar, int c, int w, int h, int n,
                                     uint16_t off_w, uint16_t off_h) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6], {%7, %8};\n"
      ::"r"(smem_u32(dst)), "l"(map), "r"(c), "r"(w), "r"(h), "r"(n), "r"(smem_u32(bar)), "h"(off_w), "h"(off_h)
      : "memory");
}

IGEMM_DEVICE void tma_load_3d(void* dst, const void* map, uint64_t* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(smem_u32(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar)) : "memory");
}

IGEMM_DEVICE void tma_load_2d(void* dst, const void* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(smem_u32(dst)), "l"(map), "r"(c0), "r"(c1), "r"(smem_u32(bar)) : "memory");
}

// Where the im2col copies of a tile start: its first output pixel m0 = (n, p, q) → the input coordinate
// of that pixel's tap (0, 0).
struct TileOrigin {
  int n, h0, w0;
};

template <class P>
IGEMM_DEVICE TileOrigin tile_origin(const P& p, int m0) {
  int n, pq, pp, qq;
  p.fd_PQ.divmod(n, pq, m0);
  p.fd_Q.divmod(pp, qq, pq);
  return {n, pp * p.sh - p.ph, qq * p.sw - p.pw};
}

// One thread: k-tile kt (taps (r, s), channels c0..c0+63) of the tile at (o, n0) → a_dst/b_dst, completing
// on `bar` (the expected bytes are set first). load_b false: b_dst holds that B tile already (fprop_ws).
template <class Cfg, class P>
IGEMM_DEVICE void tma_issue_stage(const P& p, uint8_t* a_dst, uint8_t* b_dst, uint64_t* bar, int kt,
                                  const TileOrigin& o, int n0, bool load_b = true) {
  constexpr int BK = Cfg::BK;
  const int k0 = kt * BK;
  int rs, c0, r, s;
  p.fd_C.divmod(rs, c0, k0);
  p.fd_S.divmod(r, s, rs);
  mbar_expect_tx(bar, (Cfg::BM + (load_b ? Cfg::BN : 0)) * BK * 2);
  if constexpr (Cfg::LoadA == kLoadTmaC8) {
    // 8 taps of 8 channels: tap j = 8·kt + i into region i. Taps past R·S read zeros: their w offset puts
    // every pixel outside the image (tma_unsupported keeps W below it).
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      int tr, ts;
      p.fd_S.divmod(tr, ts, kt * 8 + i);
      const bool ok = tr < p.R;
      tma_load_im2col_4d(a_dst + i * Cfg::BM * 16, p.tmA, bar, 0, o.w0, o.h0, o.n,
                         uint16_t(ok ? ts * p.dw : 0x4000), uint16_t(ok ? tr * p.dh : 0));
    }
  } else if constexpr (Cfg::LoadA == kLoadTmaMN) {
    // x as [N][C][H·W]: pixels from the tile's first (1x1, stride 1, no padding: (h0, w0) is the pixel)
    tma_load_3d(a_dst, p.tmA, bar, o.h0 * p.W + o.w0, k0, o.n);
  } else {
    tma_load_im2col_4d(a_dst, p.tmA, bar, c0, o.w0, o.h0, o.n, uint16_t(s * p.dw), uint16_t(r * p.dh));
  }
  if constexpr (Cfg::LoadB == kLoadTmaMN) {    // w as [Kred][K]: 64 columns × 64 k-rows a copy, 8 KB apart
    if (load_b) {
#pragma unroll
      for (int g = 0; g < Cfg::BN / 64; ++g) tma_load_2d(b_dst + g * 8192, p.tmB, bar, n0 + 64 * g, k0);
    }
  } else {
    if (load_b) tma_load_2d(b_dst, p.tmB, bar, k0, n0);
  }
}

IGEMM_DEVICE void tma_prefetch_maps(const void* a, const void* b) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(a) : "memory");
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(b) : "memory");
}

}  // namespace igemm::conv
