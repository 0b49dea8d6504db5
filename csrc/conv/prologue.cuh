// igemm conv2d forward: the register epilogues' prologue, issued before the tile's mainloop so that none of it
// waits after the last MMA (the tile's channel vectors by cp.async, the residual's lines into L2), and the
// common start of both register epilogues.
#pragma once
#include "conv/residual.cuh"

namespace igemm::conv {

// The register epilogue's channel vectors (3 × BN floats of static shared memory, one array per kernel).
template <int BN>
IGEMM_DEVICE float (*regs_channel_vectors())[BN] {
  __shared__ __align__(16) float s_vec[3][BN];
  return s_vec;
}

// Before the mainloop (fprop_tile), so that none of it waits after the last MMA: the tile's channel
// vectors go to shared memory by cp.async (its own group; the epilogue's start waits for it), and, when the
// reduction is short (KT <= 2 · Stages: nothing else hides the residual's DRAM latency), the residual
// tile's 128-byte lines are prefetched into L2, so the epilogue's fragment loads hit L2; a deep reduction
// prefetches half-way through its mainloop instead (docs/performance.md: epi-prologue).
// NT threads (tid = 0..NT-1): the CTA's, or one consumer warpgroup's in the persistent kernel (its own
// s_vec, refilled per tile before the tile's mainloop unless it holds column block n0's already: vectors false).
template <class Cfg, int NT, class P>
IGEMM_DEVICE void epilogue_regs_prologue_by(const P& p, int m0, int n0, int tid, float (*s_vec)[Cfg::BN],
                                            bool vectors = true) {
  using Epi = typename Cfg::Epi;
  constexpr int BN = Cfg::BN;
  if constexpr (!Epi::kEmpty) if (vectors) {
    const float* src[3] = {static_cast<const float*>(p.scale), static_cast<const float*>(p.shift),
                           static_cast<const float*>(p.alpha)};
    const float dflt[3] = {1.f, 0.f, 0.f};
    for (int i = tid; i < BN; i += NT) {
      const int n = min(n0 + i, p.K - 1);
#pragma unroll
      for (int v = 0; v < 3; ++v) {
        if (src[v]) cp_async_zfill<4>(&s_vec[v][i], src[v] + n, true);
        else s_vec[v][i] = dflt[v];
      }
    }
    cp_async_commit();
  }
  if constexpr (Epi::kResidual && !kPreloadResidual<Cfg>) {
    if ((p.Kred + Cfg::BK - 1) / Cfg::BK > 2 * Cfg::Stages) return;   // (no split-K here)
    prefetch_residual_l2<Cfg, NT>(p, m0, n0, tid);
  }
}

template <class Cfg, class P>
IGEMM_DEVICE void epilogue_regs_prologue(const P& p, int m0, int n0) {
  epilogue_regs_prologue_by<Cfg, Cfg::kThreads>(p, m0, n0, threadIdx.x, regs_channel_vectors<Cfg::BN>());
}

// The register epilogues' common start: the tile's channel vectors in shared memory (the prologue's
// cp.async group), then `sync` (every stage read: the C tile may overwrite them).
template <class Cfg, class P, class Sync>
IGEMM_DEVICE epi::Ctx regs_epilogue_start(const P& p, float (*s_vec)[Cfg::BN], Sync sync) {
  if constexpr (!Cfg::Epi::kEmpty) cp_async_wait<0>();      // the prologue's channel vectors
  sync();
  return epi::Ctx{s_vec[0], s_vec[1], s_vec[2], p.alpha_scalar};
}

}  // namespace igemm::conv
