// igemm conv2d forward: the patch loader (kLoadPatch) -- the width unfold done in shared memory.
//
// For few-channel inputs (conv1: C = 3, 7x7/2) the plan runs the conv as an R x 1 conv over the width-
// unfolded input, whose reduction index is kk = r·C' + s·C + c (C' = roundup(S·C, 8), lanes >= S·C zero:
// igemm/conv/_unfold.py). The filter is unfolded by the plan (w -> [K][R][C'], B below); x is not copied. Each CTA
// instead loads the input its BM output pixels read -- per output line (n, p) of the tile, rows
// p·sh - ph .. + R-1 of x, the columns its pixels cover, all channels -- once by TMA into shared memory
// (the "patch"), and builds every A k-tile from it there. A row's 8-lane chunk (r, s·C+c .. +7) is 8
// consecutive elements of the patch (dw = 1), so it costs five 4-byte shared loads and four funnel shifts.
//
// The patch. A line's row r holds ((count-1)·sw + S)·C elements (count: the line's pixels in the tile),
// loaded as boxes of kPatchBox elements that start kPatchStep apart (a 3-D tiled tensor map of x viewed as
// [N][H][W·C], box {kPatchBox, R, 1}; the hardware zero-fills outside the image, so padding needs no code).
// Every 8-element window that starts in [k·kPatchStep, (k+1)·kPatchStep) lies inside box k. The boxes of
// one line are consecutive slots of R × kPatchBox elements; line 0 (a partial line: the tile starts at q0)
// takes nb0 slots, each following line nbf (a full line's), the last line fits in its nbf. The plan sizes
// the region for the worst tile (KernelSpec.patch_bytes: igemm/conv/_problem.py, patch_bytes).
//
// Parameters: the kernel problem is the user's (W, C, S, sw, pw are x's), except Kred = R·C' (the unfolded
// filter's row); C' = Kred / R. Shared memory: [A: 2 buffers][B: Stages k-tiles, the whole reduction
// (the plan checks KT <= Stages), loaded once by cp.async][patch]. Each warpgroup builds and multiplies its
// own 64 A rows: the loop has no CTA-wide barrier, only the warpgroup's own (named barrier 1 + wg).
#pragma once
#include "conv/mainloop_sm90.cuh"

namespace igemm::conv {

constexpr int kPatchBox = 128;                 // elements in a box row (256 bytes)
constexpr int kPatchStep = kPatchBox - 8;      // box k covers [k·kPatchStep, k·kPatchStep + kPatchBox)
constexpr int kPatchAlign = 8;                 // box starts: whole 16 bytes of x (a line's first box starts up to 7 early)

IGEMM_DEVICE int patch_boxes(int elems) { return (elems - 1) / kPatchStep + 1; }

template <class P>
IGEMM_DEVICE int patch_line_elems(const P& p, int count) { return ((count - 1) * p.sw + p.S) * p.C; }

// Barrier 1 + wg over warpgroup wg's 128 threads (immediate ids: ptxas then reserves WM + 1 barriers, not 16)
IGEMM_DEVICE void warpgroup_sync(int wg) {
  switch (wg) {
    case 0: asm volatile("bar.sync 1, 128;\n" ::: "memory"); break;
    case 1: asm volatile("bar.sync 2, 128;\n" ::: "memory"); break;
    case 2: asm volatile("bar.sync 3, 128;\n" ::: "memory"); break;
    default: asm volatile("bar.sync 4, 128;\n" ::: "memory"); break;
  }
}

// The tile's output lines g0 .. gL (g = n·P + p = m / Q): the first starts at q0, the last ends at qL.
struct PatchTile {
  int g0, q0, gL, qL, nb0, nbf, a0, af;     // a0/af: line 0's / the other lines' box-start misalignment (elements)
  IGEMM_DEVICE int slot(int l) const { return l == 0 ? 0 : nb0 + (l - 1) * nbf; }
};

template <class Cfg, class P>
IGEMM_DEVICE PatchTile patch_tile(const P& p, int m0) {
  PatchTile t;
  p.fd_Q.divmod(t.g0, t.q0, m0);
  p.fd_Q.divmod(t.gL, t.qL, min(m0 + Cfg::BM, p.M) - 1);
  t.a0 = ((t.q0 * p.sw - p.pw) * p.C) & (kPatchAlign - 1);
  t.af = (-p.pw * p.C) & (kPatchAlign - 1);
  t.nb0 = patch_boxes(patch_line_elems(p, (t.gL == t.g0 ? t.qL + 1 : p.Q) - t.q0) + t.a0);
  t.nbf = patch_boxes(patch_line_elems(p, p.Q) + t.af);
  return t;
}

// Thread 0: every box of the tile's patch, completing on `bar`.
template <class P>
IGEMM_DEVICE void patch_issue(const P& p, const PatchTile& t, uint16_t* patch, uint64_t* bar) {
  const int slot_elems = p.R * kPatchBox;
  int boxes = 0;
  for (int g = t.g0; g <= t.gL; ++g) {
    const int qa = g == t.g0 ? t.q0 : 0, qb = g == t.gL ? t.qL : p.Q - 1;
    boxes += patch_boxes(patch_line_elems(p, qb - qa + 1) + (g == t.g0 ? t.a0 : t.af));
  }
  mbar_expect_tx(bar, uint32_t(boxes * slot_elems * 2));
  for (int g = t.g0; g <= t.gL; ++g) {
    const int qa = g == t.g0 ? t.q0 : 0, qb = g == t.gL ? t.qL : p.Q - 1;
    const int a = g == t.g0 ? t.a0 : t.af;
    const int nb = patch_boxes(patch_line_elems(p, qb - qa + 1) + a);
    int n, pq;
    p.fd_PQ.divmod(n, pq, g * p.Q);
    const int h = (g - n * p.P) * p.sh - p.ph;
    const int c0 = (qa * p.sw - p.pw) * p.C - a;      // a multiple of 8 elements
    uint16_t* dst = patch + t.slot(g - t.g0) * slot_elems;
    for (int k = 0; k < nb; ++k) tma_load_3d(dst + k * slot_elems, p.tmA, bar, c0 + k * kPatchStep, h, n);
  }
}

template <class Cfg, class P>
IGEMM_DEVICE void mainloop_wgmma_patch(const P& p, uint8_t* smem, int m0, int n0, int kt0, int kt1) {
  using T = typename Cfg::Element;
  using Atom = typename GmmaAtom<T, Cfg::BN>::type;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, S = Cfg::Stages, NT = Cfg::kThreads;
  constexpr int A_STAGE = BM * BK * 2, B_STAGE = BN * BK * 2;
  constexpr int NACC = BN / 2, KSTEPS = BK / 16;
  constexpr int UA = 64 * 8 / 128;             // A chunks a thread builds per k-tile (its warpgroup's 64 rows)
  static_assert(BK == 64 && BN * 8 % NT == 0 && Cfg::WM <= 4, "patch loads: 128-byte k-tile rows, <= 4 warpgroups");
  __shared__ alignas(8) uint64_t bar;
  uint8_t* sA = smem;
  uint8_t* sB = smem + 2 * A_STAGE;
  uint16_t* patch = reinterpret_cast<uint16_t*>(sB + S * B_STAGE);
  // (wg broadcast from lane 0: ptxas then knows it is warp-uniform, as the warpgroup's barrier needs)
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0), ch = tid % 8;
  const int KT = kt1 - kt0;
  const PatchTile pt = patch_tile<Cfg>(p, m0);
  if (tid == 0) {
    mbar_init(&bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(p.tmA) : "memory");
    patch_issue(p, pt, patch, &bar);
  }
  // the tile's residual pairs into registers, while the patch loads (kPreloadResidual)
  ResidualPairs<Cfg> res;
  if constexpr (kPreloadResidual<Cfg>)
    load_residual_pairs<Cfg, ResidualPairs<Cfg>::NB>(p, m0, n0, tid, 0, res.a, res.b);
  // B: the reduction's whole filter tile, SW128-swizzled like the gather loader's, one cp.async group
  const T* w = static_cast<const T*>(p.w);
  for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
    for (int i = 0; i < BN * 8 / NT; ++i) {
      const int row = tid / 8 + i * (NT / 8), n = n0 + row, k0 = (kt0 + kt) * BK + ch * 8;
      const bool ok = n < p.K && k0 < p.Kred;
      cp_async_zfill<16>(sB + kt * B_STAGE + (row * 8 + (ch ^ (row & 7))) * 16,
                         ok ? w + int64_t(n) * p.Kred + k0 : w, ok);
    }
  }
  cp_async_commit();
  // this thread's A rows: 64·wg + tid%128/8 + 16·i, as (patch slot element offset, element of its pixel's
  // first lane in its line), or -1 past M
  const int slot_elems = p.R * kPatchBox;
  // (with the residual preloaded, both in one register a row, rbase << 16 | rjb -- each < 2^15: the patch is
  // at most 64 KB -- so that the 16 registers the residual holds fit the 3-CTA register cap without a spill:
  // docs/performance.md: patch-packed-rows)
  constexpr bool kPack = kPreloadResidual<Cfg>;
  int rbase[UA], rjb[kPack ? 1 : UA];
#pragma unroll
  for (int i = 0; i < UA; ++i) {
    const int row = wg * 64 + (tid % 128) / 8 + 16 * i, m = m0 + row;
    int g, q;
    p.fd_Q.divmod(g, q, m);
    const int l = g - pt.g0;
    const int j = (q - (l == 0 ? pt.q0 : 0)) * p.sw * p.C + (l == 0 ? pt.a0 : pt.af);
    if constexpr (kPack) rbase[i] = m < p.M ? (pt.slot(l) * slot_elems) << 16 | j : -1;
    else {
      rbase[i] = m < p.M ? pt.slot(l) * slot_elems : -1;
      rjb[i] = j;
    }
  }
  const int cu = p.Kred / p.R, sc = p.S * p.C;
  const uint32_t* pw32 = reinterpret_cast<const uint32_t*>(patch);
  // A k-tile kt -> buffer buf (this warpgroup's rows)
  auto build = [&](int kt, int buf) {
    const int kk0 = kt * BK + ch * 8;
    const int r = kk0 / cu, lane0 = kk0 - r * cu;
    const int keep = r < p.R ? max(0, min(8, sc - lane0)) : 0;     // lanes of the chunk that hold data
    uint32_t msk[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) msk[k] = 2 * k + 1 < keep ? 0xffffffffu : (2 * k < keep ? 0x0000ffffu : 0u);
    uint8_t* dst = sA + buf * A_STAGE;
#pragma unroll
    for (int i = 0; i < UA; ++i) {
      const int row = wg * 64 + (tid % 128) / 8 + 16 * i;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (rbase[i] >= 0 && keep > 0) {
        const int e = (kPack ? rbase[i] & 0xFFFF : rjb[kPack ? 0 : i]) + lane0;
        const int bx = e / kPatchStep;
        const int idx = (kPack ? rbase[i] >> 16 : rbase[i]) + bx * slot_elems + r * kPatchBox + (e - bx * kPatchStep);
        const uint32_t* s = pw32 + (idx >> 1);
        const uint32_t sh = (idx & 1) * 16;
        const uint32_t w0 = s[0], w1 = s[1], w2 = s[2], w3 = s[3], w4 = s[4];
        v.x = __funnelshift_r(w0, w1, sh) & msk[0];
        v.y = __funnelshift_r(w1, w2, sh) & msk[1];
        v.z = __funnelshift_r(w2, w3, sh) & msk[2];
        v.w = __funnelshift_r(w3, w4, sh) & msk[3];
      }
      *reinterpret_cast<uint4*>(dst + (row * 8 + (ch ^ (row & 7))) * 16) = v;
    }
  };

  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
  __syncthreads();                          // the barrier is initialised
  mbar_wait(&bar, 0);                       // the patch has landed
  build(kt0, 0);
  cp_async_wait<0>();                       // B (and the epilogue prologue's channel vectors)
  fence_proxy_async();
  __syncthreads();                          // B from every thread; A(0)
  const uint32_t sA_u = smem_u32(sA) + wg * 64 * 128, sB_u = smem_u32(sB);
  // Iteration i: multiply buffer i%2 (async) → wait until only that group is in flight (buffer (i+1)%2 has
  // been read) → build k-tile i+1 into it, publish to this warpgroup.
  for (int it = 0; it < KT; ++it) {
    const int buf = it & 1;
    wgmma_stage<Atom, NACC, KSTEPS>(desc_sw128(sA_u + buf * A_STAGE), desc_sw128(sB_u + it * B_STAGE), acc);
    if (it + 1 < KT) {
      cute::warpgroup_wait<1>();
#pragma unroll
      for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
      build(kt0 + it + 1, buf ^ 1);
      fence_proxy_async();
      warpgroup_sync(wg);
    }
  }
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
  __syncthreads();                          // every buffer read: the C tile may overwrite them
  finish_tile<Cfg>(p, acc, smem, m0, n0, nullptr, kPreloadResidual<Cfg> ? &res : nullptr);
}

}  // namespace igemm::conv
