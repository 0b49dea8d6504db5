// igemm conv2d forward: the residual of the register epilogues, moved ahead of the epilogue -- its lines
// prefetched into L2, its tile staged in shared memory during the mainloop (NHWC: a swizzled tile the
// fragments read; NCHW: the 16-bit C tile itself), or its fragment pairs loaded into registers (the patch
// kernel). Which kernel uses which: kStageResidual, kStageResidualNchw(Ws), kPreloadResidual below
// (KernelSpec.residual_staged / residual_preloaded mirror them).
#pragma once
#include "conv/fragment.cuh"

namespace igemm::conv {

// The residual tile's 128-byte lines into L2, by NT threads: NHWC, the tile's rows (BN channels each);
// NCHW (kStoreRegsNCHW), its channel rows, each a run of pixels in every image plane the tile touches (every
// run, not only the first: with P·Q = 49 most of a 128-pixel row's lines lie in the next images).
template <class Cfg, int NT, class P>
IGEMM_DEVICE void prefetch_residual_l2(const P& p, int m0, int n0, int tid) {
  using RT = typename Cfg::Epi::Res;
  constexpr int BN = Cfg::BN, BM = Cfg::BM;
  const RT* res = static_cast<const RT*>(p.residual);
  const int cols = min(BN, p.K - n0), rows = min(BM, p.M - m0);
  if constexpr (Cfg::StoreMode == kStoreRegsNCHW) {
    // channel row r of the tile: pixels [m0, m0 + rows), one contiguous run in each image plane they touch
    // (P·Q = 49, a 128-pixel tile: three or four runs of up to 98 bytes), each run's lines in turn
    int img0, pq0;
    p.fd_PQ.divmod(img0, pq0, m0);
    const int64_t istep = int64_t(p.K) * p.PQ;                          // the next image, same channel
    for (int r = tid; r < cols; r += NT) {
      int64_t plane = (int64_t(img0) * p.K + n0 + r) * p.PQ;              // channel n0 + r of image img0
      for (int left = rows, pq = pq0; left > 0; plane += istep, pq = 0) {
        const int n = min(left, p.PQ - pq);
        const uintptr_t end = reinterpret_cast<uintptr_t>(res + plane + pq + n);
        // (from the run's first element, then each next line's start: only addresses inside the run)
        for (uintptr_t l = reinterpret_cast<uintptr_t>(res + plane + pq); l < end; l = (l | 127) + 1)
          asm volatile("prefetch.global.L2 [%0];\n" ::"l"(l));
        left -= n;
      }
    }
  } else {
    constexpr int LPR = (BN * int(sizeof(RT)) + 127) / 128;     // 128-byte lines per tile row
    for (int i = tid; i < rows * LPR; i += NT) {
      const int r = i / LPR, c = min((i % LPR) * (128 / int(sizeof(RT))), cols - 1);
      asm volatile("prefetch.global.L2 [%0];\n" ::"l"(res + int64_t(m0 + r) * p.K + n0 + c));
    }
  }
}

// The residual tile staged in shared memory for the NHWC register epilogue (kStoreRegs; a 16-bit residual,
// BN <= 128, so that epilogue_regs_by reads the whole tile's pairs before its first barrier): BM rows of
// BN·2 bytes, 16-byte chunk j of row r at chunk j ^ (r & 7) (a fragment read, 8 rows x 4 lanes of 4 bytes,
// hits 32 distinct banks), zeros outside the problem. The per-tile TMA kernel copies it into the first
// stage buffer its mainloop frees for good (S - 1 k-tiles before the end), the persistent kernel into the
// unused upper half of its consumer's C tile before the tile's mainloop: the residual's DRAM reads overlap
// MMA work and hold no registers, where loading it after the mainloop left them exposed (a single-wave
// grid's CTAs all reach their epilogues at once). Each warp copies the 16 rows its own fragments hold
// (cp.async, one group), so the epilogue needs the warp's own wait and a __syncwarp, no CTA barrier.
template <class Epi, bool = Epi::kResidual>
struct ResidualBytes { static constexpr int value = 0; };
template <class Epi>
struct ResidualBytes<Epi, true> { static constexpr int value = int(sizeof(typename Epi::Res)); };

template <class Cfg>
constexpr bool kStageResidual =
    Cfg::StoreMode == kStoreRegs && ResidualBytes<typename Cfg::Epi>::value == 2 && Cfg::BN <= 128;

template <class Cfg>
constexpr int kResidualStageBytes = Cfg::BM * Cfg::BN * 2;

// The patch kernel (mainloop_wgmma_patch) loads the whole tile's residual pairs into registers at the
// tile's start, beside its patch's TMA load, and hands them to the epilogue: its reduction is short (conv1:
// 3 k-tiles) and its shared memory has no room for a staged tile at 3 CTAs an SM, so that the pairs' latency
// hides behind the patch's wait instead of stalling the epilogue (docs/performance.md: patch-residual-preload).
// A 16-bit residual, BN <= 128: 2 x BN/8 registers (KernelSpec.residual_preloaded; the plan caps the registers for
// 3 CTAs an SM, and the patch kernel packs its row offsets so that nothing spills).
template <class Cfg>
constexpr bool kPreloadResidual =
    Cfg::LoadA == kLoadPatch && Cfg::StoreMode == kStoreRegs && ResidualBytes<typename Cfg::Epi>::value == 2 &&
    Cfg::BN <= 128;

// (tid: the thread's index in its CTA, or in its consumer warpgroup of the persistent kernel)
template <class Cfg, class P>
IGEMM_DEVICE void stage_residual_smem(const P& p, uint8_t* dst, int m0, int n0, int tid) {
  constexpr int NB = Cfg::BN / 8, PER_LANE = 16 * NB / 32;   // 16-byte chunks a lane copies
  using RT = typename Cfg::Epi::Res;
  const RT* res = static_cast<const RT*>(p.residual);
  const int lane = tid & 31, rbase = (tid >> 7) * 64 + ((tid >> 5) & 3) * 16;   // the warp's fragment rows
#pragma unroll 1   // (in the mainloop: see stage_residual_nchw)
  for (int i = 0; i < PER_LANE; ++i) {
    const int c = lane + 32 * i, r = rbase + c / NB, j = c % NB;
    const bool ok = m0 + r < p.M && n0 + j * 8 < p.K;
    cp_async_zfill<16>(dst + r * (Cfg::BN * 2) + ((j ^ (r & 7)) << 4),
                       ok ? res + int64_t(m0 + r) * p.K + n0 + j * 8 : res, ok);
  }
  cp_async_commit();
}

// The residual's pairs at a thread's accumulator-fragment positions (rows r0 and r0 + 8, columns 2·(lane % 4)
// + {0, 1} of each 8-column block), as raw bits (a 16-bit pair is one 32-bit load, converted by two HADD2.F32:
// element-wise Vec loads cost four PRMTs a pair, ptxas 13.0), zero outside the problem. The NHWC register
// epilogue loads G column blocks at a time: with BN <= 128 the whole tile's (2 x BN/8 registers).
template <class Cfg>
struct ResidualPairs {
  using Epi = typename Cfg::Epi;
  using RT = std::conditional_t<Epi::kResidual, typename Epi::Res, typename Cfg::ElementOut>;
  using Raw = std::conditional_t<sizeof(RT) == 2, uint32_t, epi::Vec<RT, 2>>;
  static constexpr int NB = Cfg::BN / 8;
  static constexpr int G = Epi::kResidual && NB <= 16 ? NB : 4;
  Raw a[NB], b[NB];
};

// Column blocks j0 .. j0 + G - 1 of thread tid's pairs (tid: in the CTA, or in the persistent kernel's
// consumer warpgroup).
template <class Cfg, int G, class P>
IGEMM_DEVICE void load_residual_pairs(const P& p, int m0, int n0, int tid, int j0,
                                      typename ResidualPairs<Cfg>::Raw (&ra)[G],
                                      typename ResidualPairs<Cfg>::Raw (&rb)[G]) {
  using RT = typename ResidualPairs<Cfg>::RT;
  using Raw = typename ResidualPairs<Cfg>::Raw;
  const RT* resp = static_cast<const RT*>(p.residual);
  const int lane = tid & 31, r0 = fragment_row0(tid);
  const bool ok0 = m0 + r0 < p.M, ok1 = m0 + r0 + 8 < p.M;
  const int64_t row0 = int64_t(m0 + r0) * p.K + n0, row1 = row0 + int64_t(8) * p.K;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const int c = (j0 + g) * 8 + 2 * (lane & 3);
    const bool okc = n0 + c < p.K;
    ra[g] = rb[g] = Raw{};
    if (ok0 && okc) ra[g] = *reinterpret_cast<const Raw*>(resp + row0 + c);
    if (ok1 && okc) rb[g] = *reinterpret_cast<const Raw*>(resp + row1 + c);
  }
}

// The persistent kernel (fprop_ws) stages the residual at the tile's start whatever V: its C tile is its own,
// free during the mainloop, so the residual's DRAM reads overlap the mainloop rather than follow it. With
// V = 1 (P·Q odd: 3x3 512->512 @7) these are 2-byte loads, which would otherwise follow the mainloop.
template <class Cfg>
constexpr bool kStageResidualNchwWs =
    Cfg::StoreMode == kStoreRegsNCHW && ResidualBytes<typename Cfg::Epi>::value == 2;

// The per-tile kernel stages it during the mainloop only with V >= 4 (cp.async into the swizzled tile).
template <class Cfg>
constexpr bool kStageResidualNchw = kStageResidualNchwWs<Cfg> && kNchwSwizzled<Cfg>;

// V = 1: a thread's residual pixel of channel rows i = 0..NI-1 (src: row 0's element, ostep on to the next;
// dst: its place in the unswizzled C tile, RSTEP rows on each) in batches of B 2-byte loads issued before their
// stores, zeros from row nrows on (outside the problem). A pointer stepped per load and one bound: a few
// instructions a load, not an address and a test computed for each.
template <class Cfg, int NI, int B, int RSTEP>
IGEMM_DEVICE void residual_rows_v1(const uint16_t* src, int64_t ostep, uint16_t* dst, int nrows) {
  static_assert(NI % B == 0 && !kNchwSwizzled<Cfg>, "whole batches; rows of BM + 8 pixels");
#pragma unroll 1
  for (int i0 = 0; i0 < NI; i0 += B, dst += B * RSTEP * kNchwLd<Cfg>) {
    uint16_t r[B];
#pragma unroll
    for (int k = 0; k < B; ++k, src += ostep) r[k] = i0 + k < nrows ? __ldg(src) : uint16_t(0);
#pragma unroll
    for (int k = 0; k < B; ++k) dst[k * RSTEP * kNchwLd<Cfg>] = r[k];
  }
}

// The residual tile into the NCHW C tile (the store loop's assignment: pixel vector tid % CPR of channel rows
// tid / CPR + i·RSTEP; zeros outside the problem). V >= 2: cp.async of V-pixel vectors, one group. V = 1
// (cp.async moves 4 bytes at least; the persistent kernel only): every 2-byte load issued before its store.
template <class Cfg, int NT, class P>
IGEMM_DEVICE void stage_residual_nchw(const P& p, uint16_t* ct, int m0, int n0, int tid) {
  using RT = typename Cfg::Epi::Res;
  constexpr int BN = Cfg::BN, BM = Cfg::BM, V = Cfg::VecO, CPR = BM / V, RSTEP = NT / CPR;
  static_assert(sizeof(RT) == 2, "a 16-bit residual (the 16-bit C tile)");
  const int ml = (tid % CPR) * V, nl0 = tid / CPR;
  const bool okm = m0 + ml < p.M;
  int img, pq;
  p.fd_PQ.divmod(img, pq, okm ? m0 + ml : 0);
  const int ncols = min(BN, p.K - n0);
  const RT* resp = static_cast<const RT*>(p.residual);
  const RT* src = resp + (int64_t(img) * p.K + n0 + nl0) * p.PQ + pq;
  const int64_t ostep = int64_t(RSTEP) * p.PQ;
  if constexpr (V == 1) {
    static_assert(Cfg::kMath == kWgmmaWs, "at the persistent kernel's tile start (registers to spare)");
    constexpr int NI = BN / RSTEP;                           // (all of them at once)
    residual_rows_v1<Cfg, NI, NI, RSTEP>(reinterpret_cast<const uint16_t*>(src), ostep,
                                        ct + nchw_ct_index<Cfg>(nl0, ml), okm ? (ncols - nl0 + RSTEP - 1) / RSTEP : 0);
  } else {
    // (not unrolled: in the mainloop, beside the accumulators, an unrolled loop's addresses cost registers, past
    // two CTAs an SM: docs/performance.md: residual-stage-rolled)
#pragma unroll 1
    for (int nl = nl0; nl < BN; nl += RSTEP, src += ostep) {
      const bool ok = okm && nl < ncols;
      cp_async_zfill<V * 2>(ct + nchw_ct_index<Cfg>(nl, ml), ok ? src : resp, ok);
    }
    cp_async_commit();
  }
}

}  // namespace igemm::conv
