// igemm conv2d forward: stream-K (IGEMM_STREAMK, KernelSpec.streamk) on the per-tile TMA wgmma mainloop.
//
// The work is T tiles × KT k-tiles = U units; CTA b of G runs units [U·b/G, U·(b+1)/G) -- equal shares,
// so a layer whose tiles are fewer than the SMs (3x3 512->512 @7, N=32: 100 tiles of 64x128, 72 k-tiles)
// keeps every SM busy. A CTA walks its range backwards, one tile segment at a time. A tile split between
// CTAs is finished (fix-up and epilogue) by the one that ran its last k-tiles (kt1 == KT): the highest
// index, for which the tile is at the start of its range, so it reaches it last. Every other contributor
// has the tile at the end of its range, ran it first, and left its fp32 partial sums in its own workspace
// slot (one per CTA) with a flag set (release). The finisher waits for each flag (acquire; their owners
// have lower indices, so they were scheduled before it: no deadlock even when the grid exceeds the
// resident CTAs), adds the partials in fragment order and clears the flag for the next launch (graph
// replays included). Slower than the per-tile kernel where measured, so it is an autotune candidate, not a
// default (docs/performance.md: streamk-candidate).
#pragma once
#include "conv/mainloop_sm90.cuh"

namespace igemm::conv {

template <class Cfg>
struct StreamKFinish {
  int b, kt0, kt1, KT;
  int64_t tb, U;             // the tile's first unit; all units
  template <class C, class P>
  IGEMM_DEVICE void run(const P& p, float* acc, uint8_t* smem, int m0, int n0) const {
    constexpr int NACC = Cfg::BN / 2, NT = Cfg::kThreads;
    float4* ws = static_cast<float4*>(const_cast<void*>(p.ws));
    int* flags = static_cast<int*>(const_cast<void*>(p.counters));
    const int tid = threadIdx.x, G = gridDim.x;
    if (kt1 < KT) {                       // the tile's later k-tiles are another CTA's: hand the sums over
      float4* mine = ws + int64_t(b) * (NACC / 4) * NT;
#pragma unroll
      for (int i = 0; i < NACC / 4; ++i)
        __stcg(mine + i * NT + tid, make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]));
      __syncthreads();
      if (tid == 0) {
        __threadfence();
        asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(flags + b), "r"(1) : "memory");
      }
      return;
    }
    if (kt0 > 0) {                        // the finisher of a split tile: CTAs b-1, b-2, ... ran its start
      for (int c = b - 1; c >= 0 && U * (c + 1) / G > tb; --c) {
        if (tid == 0) {
          int f = 0;
          do {
            asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(f) : "l"(flags + c) : "memory");
          } while (f == 0);
        }
        __syncthreads();
        const float4* src = ws + int64_t(c) * (NACC / 4) * NT;
#pragma unroll
        for (int i = 0; i < NACC / 4; ++i) {
          const float4 v = __ldcg(src + i * NT + tid);
          acc[4 * i] += v.x;
          acc[4 * i + 1] += v.y;
          acc[4 * i + 2] += v.z;
          acc[4 * i + 3] += v.w;
        }
        __syncthreads();
        if (tid == 0) flags[c] = 0;
      }
    }
    finish_tile<Cfg>(p, acc, smem, m0, n0);
  }
};

template <class Cfg, class P>
IGEMM_DEVICE void fprop_streamk(const P& p, uint8_t* smem) {
  const int T = ((p.M + Cfg::BM - 1) / Cfg::BM) * ((p.K + Cfg::BN - 1) / Cfg::BN);
  const int KT = (p.Kred + Cfg::BK - 1) / Cfg::BK;
  const int64_t U = int64_t(T) * KT, G = gridDim.x, b = blockIdx.x;
  const int64_t u0 = U * b / G, u1 = U * (b + 1) / G;
  int it0 = 0;
  for (int64_t u = u1; u > u0;) {
    const int t = int((u - 1) / KT);
    const int64_t tb = int64_t(t) * KT;
    const int kt0 = int((u0 > tb ? u0 : tb) - tb), kt1 = int(u - tb);
    const TileCoord tc = tile_coord<Cfg>(p, t);
    if (kt1 == KT) epilogue_regs_prologue<Cfg>(p, tc.m0, tc.n0);      // this CTA stores the tile
    mainloop_wgmma_tma<Cfg>(p, smem, tc.m0, tc.n0, kt0, kt1, StreamKFinish<Cfg>{int(b), kt0, kt1, KT, tb, U}, it0);
    it0 += kt1 - kt0;
    u = tb + kt0;
  }
}

}  // namespace igemm::conv
