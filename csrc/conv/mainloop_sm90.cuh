// igemm conv2d forward: the sm_90a per-tile mainloops -- warpgroup MMA (wgmma) fed by the cp.async gather
// (mainloop_wgmma) or by TMA (mainloop_wgmma_tma) -- and the tile's end (finish_tile: a register epilogue, or
// the accumulators into the fp32 C tile for epilogue_smem.cuh's store phase).
//
// The gathered mainloop: BM = 64 · WM rows (one warpgroup per 64 rows), BN ∈ {64, 128, 192, 256} columns,
// BK = 64 16-bit elements (128-byte rows): the loader's XOR swizzle (chunk ^ row % 8 on 1024-byte aligned
// buffers) is exactly the SW128 K-major layout, so each warpgroup issues wgmma.m64nBNk16 with both operands
// read from shared memory through descriptors (CuTe's SM90 GMMA atoms), 4 per stage. Loads for stage
// i + Stages - 1 are in flight (cp.async) while stage i is multiplied, and one wgmma group stays in flight
// while the next stage's loads are issued; each thread fences its shared-memory writes into the async proxy
// (fence.proxy.async) before the barrier that publishes a stage to wgmma.
#pragma once
#include "conv/epilogue_smem.cuh"
#include "conv/gather.cuh"
#include "conv/wgmma.cuh"
#include "conv/tma.cuh"
#include "conv/epilogue_regs.cuh"
#include "conv/epilogue_regs_nchw.cuh"

namespace igemm::conv {

// The per-tile kernels' register epilogue: the whole CTA.
template <class Cfg, class P>
IGEMM_DEVICE void epilogue_regs(const P& p, float* acc, uint8_t* smem, int m0, int n0, const uint8_t* res_s = nullptr,
                                const ResidualPairs<Cfg>* pre = nullptr) {
  // A tile past the last row has nothing to store (uniform per CTA). The branch also ends the basic block
  // that holds the mainloop's last wgmma wait: with the accumulators' first reads in that block (the
  // identity chain has nothing else before them), ptxas 13.0 serialises every wgmma of the mainloop
  // (warning C7514; docs/performance.md: wgmma-serialised).
  if (m0 >= p.M) return;
  if constexpr (Cfg::StoreMode == kStoreRegsNCHW)
    epilogue_regs_nchw_by<Cfg, Cfg::kThreads>(p, acc, smem, regs_channel_vectors<Cfg::BN>(), threadIdx.x, m0, n0,
                                              CtaSync{}, const_cast<uint8_t*>(res_s));
  else
    epilogue_regs_by<Cfg, Cfg::kThreads>(p, acc, smem, regs_channel_vectors<Cfg::BN>(), threadIdx.x, m0, n0,
                                         CtaSync{}, res_s, pre);
}

template <class Cfg, class P>
IGEMM_DEVICE void finish_tile(const P& p, float* acc, uint8_t* smem, int m0, int n0, const uint8_t* res_s = nullptr,
                              const ResidualPairs<Cfg>* pre = nullptr) {
  if constexpr (Cfg::kRegsStore) epilogue_regs<Cfg>(p, acc, smem, m0, n0, res_s, pre);
  else acc_to_cs<Cfg>(acc, smem);
}

template <class Cfg, class P>
IGEMM_DEVICE void mainloop_wgmma(const P& p, uint8_t* smem, int m0, int n0, int kt0, int kt1) {
  using T = typename Cfg::Element;
  using L = GatherLoader<Cfg, P>;
  using Atom = typename GmmaAtom<T, Cfg::BN>::type;
  constexpr int BN = Cfg::BN, BK = Cfg::BK, S = Cfg::Stages;
  constexpr int NACC = BN / 2;              // fp32 accumulators per thread (64 × BN per warpgroup)
  constexpr int KSTEPS = BK / 16;

  uint8_t* sA = smem;
  uint8_t* sB = smem + S * L::A_STAGE;
  L ld(p, sA, sB, m0, n0);
  const int wg = threadIdx.x / 128;

  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;

  const int KT = kt1 - kt0;
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < KT) {
      ld.load(kt0 + st, st);
      ld.store_regs(st);
    }
    cp_async_commit();
  }
  const uint32_t sA_u = smem_u32(sA) + wg * 64 * 128, sB_u = smem_u32(sB);
  // Iteration i: stage i is ready → issue its wgmma group (async) → wait until only that group is in
  // flight (so stage i-1 is free in every warpgroup) → refill stage i-1 with k-tile i+S-1. The register-
  // staged part of that refill is written at the top of iteration i+1, after its loads had the MMA's
  // duration to land. Tensor cores stay busy across the barrier and the load issue.
  bool pending_regs = false;
  int pending_buf = 0;
  for (int it = 0; it < KT; ++it) {
    if (pending_regs) ld.store_regs(pending_buf);
    cp_async_wait<S - 2>();
    fence_proxy_async();
    __syncthreads();
    const int buf = it % S;
    const uint64_t da = desc_sw128(sA_u + buf * L::A_STAGE);
    const uint64_t db = desc_sw128(sB_u + buf * L::B_STAGE);
    wgmma_stage<Atom, NACC, KSTEPS>(da, db, acc);
    cute::warpgroup_wait<1>();            // the previous group (stage i-1) has finished
#pragma unroll
    for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
    if constexpr (Cfg::WM > 1) __syncthreads();   // ... in every warpgroup (B is shared)
    const int nk = it + S - 1;
    pending_buf = nk % S;
    pending_regs = nk < KT;
    if (nk < KT) ld.load(kt0 + nk, pending_buf);
    cp_async_commit();
  }
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
  cp_async_wait<0>();
  __syncthreads();

  finish_tile<Cfg>(p, acc, smem, m0, n0);
}

// The tile's end: the epilogue, or (stream-K) the fix-up first. it0: k-tiles this CTA ran before (stream-K
// runs several segments in one CTA; the stage ring and its barriers carry on, initialised once).
struct FinishTile {
  template <class Cfg, class P>
  IGEMM_DEVICE void run(const P& p, float* acc, uint8_t* smem, int m0, int n0) const {
    finish_tile<Cfg>(p, acc, smem, m0, n0);
  }
};

template <class Cfg, class P, class Fin = FinishTile>
IGEMM_DEVICE void mainloop_wgmma_tma(const P& p, uint8_t* smem, int m0, int n0, int kt0, int kt1, Fin fin = {},
                                     int it0 = 0) {
  using T = typename Cfg::Element;
  using Atom = typename GmmaAtom<T, Cfg::BN, gmma::Major::K, kMajorB<Cfg>>::type;
  using AtomMN = typename GmmaAtom<T, Cfg::BN, gmma::Major::MN, kMajorB<Cfg>>::type;
  constexpr int BN = Cfg::BN, BK = Cfg::BK, S = Cfg::Stages;
  // stage s = [A tile | B tile] at s · STAGE: a problem with KT < S k-tiles touches only its first KT
  // stages, so the plan may launch it with less shared memory (more CTAs per SM; KernelSpec.launch_smem)
  constexpr int A_STAGE = Cfg::BM * BK * 2, B_STAGE = BN * BK * 2, STAGE = A_STAGE + B_STAGE;
  constexpr int NACC = BN / 2, KSTEPS = BK / 16;
  __shared__ alignas(8) uint64_t full[S];
  uint8_t* sA = smem;
  uint8_t* sB = smem + A_STAGE;
  const int KT = kt1 - kt0;
  const bool leader = threadIdx.x == 0;
  const TileOrigin o = tile_origin(p, m0);
  if (leader && it0 == 0) {
#pragma unroll
    for (int s = 0; s < S; ++s) mbar_init(&full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    tma_prefetch_maps(p.tmA, p.tmB);
  }
  __syncthreads();                        // (and a previous segment's epilogue is done with the stages)
  auto issue = [&](int kt, int buf) {     // thread 0
    tma_issue_stage<Cfg>(p, sA + buf * STAGE, sB + buf * STAGE, &full[buf], kt, o, n0);
  };
  if (leader) {
#pragma unroll
    for (int st = 0; st < S - 1; ++st)
      if (st < KT) issue(kt0 + st, (it0 + st) % S);
  }
  // the residual tile staged in shared memory (kStageResidual / kStageResidualNchw): into stage buffer KT now
  // when the reduction is shorter than the ring (that buffer is never filled; the plan launches with KT + 1
  // stages' shared memory, KernelSpec.launch_smem), else into the first buffer the mainloop frees for good
  constexpr bool kStage = (kStageResidual<Cfg> || kStageResidualNchw<Cfg>) && std::is_same_v<Fin, FinishTile>;
  static_assert(!kStage || kResidualStageBytes<Cfg> <= STAGE, "the residual tile fits a stage");
  auto stage_residual = [&](uint8_t* dst) {
    if constexpr (kStageResidualNchw<Cfg>)
      stage_residual_nchw<Cfg, Cfg::kThreads>(p, reinterpret_cast<uint16_t*>(dst), m0, n0, threadIdx.x);
    else if constexpr (kStageResidual<Cfg>)
      stage_residual_smem<Cfg>(p, dst, m0, n0, threadIdx.x);
  };
  if constexpr (kStage)
    if (KT < S) stage_residual(smem + KT * STAGE);
  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
  const uint32_t sA_u = smem_u32(sA) + (threadIdx.x / 128) * 64 * 128, sB_u = smem_u32(sB);
  const uint32_t sA8 = smem_u32(sA) + (threadIdx.x / 128) * 64 * 16;   // kLoadTmaC8: rows of a region are 16 B
  // Iteration i: wait for stage i's bytes → issue its wgmma group → wait until only that group is in
  // flight → barrier (stage i-1 is free in every warpgroup) → thread 0 refills it with k-tile i+S-1.
  auto step = [&](int it) {
    const int buf = (it0 + it) % S;
    mbar_wait(&full[buf], ((it0 + it) / S) & 1);
    if constexpr (Cfg::LoadA == kLoadTmaC8)   // A: 8 regions of BM 16-byte rows; this warpgroup's rows
      wgmma_stage<Atom, NACC, KSTEPS, 2 * Cfg::BM>(desc_interleave(sA8 + buf * STAGE, Cfg::BM * 16, 128),
                                                    desc_sw128(sB_u + buf * STAGE), acc);
    else if constexpr (Cfg::LoadA == kLoadTmaMN)   // A MN-major: a k16 step is two 1024-byte channel groups
      wgmma_stage<AtomMN, NACC, KSTEPS, 2048 / 16, kStepB<Cfg>>(desc_mn_sw128(sA_u + buf * STAGE),
                                                                 desc_b<Cfg>(sB_u + buf * STAGE), acc);
    else
      wgmma_stage<Atom, NACC, KSTEPS, 2, kStepB<Cfg>>(desc_sw128(sA_u + buf * STAGE),
                                                      desc_b<Cfg>(sB_u + buf * STAGE), acc);
    cute::warpgroup_wait<1>();
#pragma unroll
    for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
    __syncthreads();
    const int nk = it + S - 1;
    if (leader && nk < KT) issue(kt0 + nk, (it0 + nk) % S);
  };
  // The residual's two events run between iterations:
  // - a deep reduction (the prologue prefetched nothing): the residual tile's lines into L2 half-way, after
  //   iteration KT / 2, so that the epilogue's fragment loads hit L2 instead of waiting on DRAM (a single-wave
  //   grid's CTAs all reach their epilogues together: S k-tiles before the end is too late to read the whole
  //   residual from DRAM);
  // - the staged residual (kStage), after iteration KT - S + 1, into stage (KT - S) % S, free for good from
  //   there (no k-tile left to refill it). (KT > 2·S: KT / 2 < KT - S + 1, the prefetch comes first.)
  // An iteration tests one uniform index for the next event, not both conditions (docs/performance.md:
  // residual-events). Chains without a residual keep the plain loop.
  constexpr bool kPrefetch = Cfg::kRegsStore && Cfg::Epi::kResidual && std::is_same_v<Fin, FinishTile>;
  if constexpr (kPrefetch || kStage) {
    const int ev_pf = kPrefetch && KT > 2 * S ? KT / 2 : -1, ev_st = kStage && KT >= S ? KT - S + 1 : -1;
    int next = ev_pf >= 0 ? ev_pf : ev_st >= 0 ? ev_st : KT;
    for (int it = 0; it < KT; ++it) {
      step(it);
      if (it == next) {
        if (it == ev_pf) {
          if constexpr (kPrefetch) prefetch_residual_l2<Cfg, Cfg::kThreads>(p, m0, n0, threadIdx.x);
          next = ev_st >= 0 ? ev_st : KT;
        } else {
          if constexpr (kStage) stage_residual(smem + ((KT - S) % S) * STAGE);
          next = KT;
        }
      }
    }
  } else {
    for (int it = 0; it < KT; ++it) step(it);
  }
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
  __syncthreads();                        // every stage read: the C tile may overwrite them
  if constexpr (kStage)
    finish_tile<Cfg>(p, acc, smem, m0, n0, smem + (KT >= S ? ((KT - S) % S) * STAGE : KT * STAGE));
  else
    fin.template run<Cfg>(p, acc, smem, m0, n0);
}

}  // namespace igemm::conv
