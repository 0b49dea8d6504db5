// igemm conv2d forward: the persistent warp-specialised kernel (kWgmmaWs), its tile schedule, the cluster
// k-split (IGEMM_CSPLIT) and the bookkeeping of several CTAs an SM (IGEMM_WS_CTAS).
//
// Grid: one CTA per SM (at most one per tile), looping over the tiles t = blockIdx.x + i · gridDim.x
// (m-major). WM consumer warpgroups take turns: tile i goes to consumer i % WM, which has its own ring of
// `Stages` stage buffers and its own C tile. One producer warp (thread 0 of warp 4·WM) walks the same tile
// sequence and fills each consumer's ring with TMA copies, waiting on the ring's "empty" barriers (128
// arrivals: every consumer thread once its wgmma group has read the stage); consumers wait on "full"
// barriers (transaction bytes). Because the producer serves the tiles in order, one consumer's mainloop
// runs while the other stores its previous tile (ping-pong): the epilogue chain, the mask and the
// residual loads overlap MMA work. Consumers synchronise only among themselves (named barriers 1..WM).
// WM = 1 (one consumer, the whole shared memory for its ring): for grids of at most one tile per SM, where
// ping-pong has nothing to overlap and deep stages pay instead -- the producer warp still keeps the loads
// ahead with no CTA barrier per k-tile, and runs on into the next tile's k-tiles during an epilogue.
// Both store phases: the fp32 C tile's (epilogue_store_by) and the register epilogues (kStoreRegs*,
// epilogue_regs_by / epilogue_regs_nchw_by: the tile's channel vectors are fetched by cp.async before its
// mainloop).
//
// The cluster k-split (kCsplit = IGEMM_CSPLIT = 2, with __cluster_dims__(2, 1, 1) on the kernel): the two
// CTAs of a cluster run the same tile, each over half of the k-tiles with its own loads (no operand is
// shared); rank 1 then writes its fp32 partial sums into rank 0's shared memory (st.shared::
// cluster, behind rank 0's "xfer_empty" handshake) and arrives on rank 0's "xfer_full" barrier (release,
// cluster scope); rank 0 adds them in fragment order and runs the epilogue. Against split-K through global
// memory: no workspace, no ticket, no fence -- twice the SMs for a grid of few tiles at the cost of one
// 64 x BN fp32 hand-over in distributed shared memory.
//
// kWsBooks (IGEMM_WS_CTAS, KernelSpec.ctas > 1: several CTAs an SM, the one k-tile 1x1 layers' kernel): the
// producer skips a ring slot's B copy when the slot holds that column block's B tile already, and the consumer
// refetches its channel vectors only when its column block changes. Compiled into that kernel only: in the one-CTA
// persistent kernels of deep reductions the same bookkeeping, even behind a branch on the k-tile count, costs
// time (docs/performance.md: ws-books).
#pragma once
#include "conv/epilogue_smem.cuh"
#include "conv/mainloop_sm90.cuh"

namespace igemm::conv {

IGEMM_DEVICE void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

struct NamedSync {
  int id;
  IGEMM_DEVICE void operator()() const { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }
};

IGEMM_DEVICE uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

IGEMM_DEVICE void cluster_sync_all() {     // every thread of both CTAs (none may have exited)
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

IGEMM_DEVICE uint32_t smem_in_rank(const void* local, uint32_t rank) {   // the same offset in CTA `rank`
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem_u32(local)), "r"(rank));
  return r;
}

IGEMM_DEVICE void mbar_arrive_remote(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

IGEMM_DEVICE void mbar_wait_cluster(uint64_t* bar, uint32_t parity) {   // acquire at cluster scope
  uint32_t done;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  } while (!done);
}

// The producer warp (its thread 0): walks the tile sequence and fills each consumer's ring with TMA copies.
template <class Cfg, class P>
IGEMM_DEVICE void ws_produce(const P& p, uint8_t* smem, uint64_t (*full)[Cfg::Stages], uint64_t (*empty)[Cfg::Stages],
                             int first, int step, int NT, int KT, int kb, int ke) {
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, S = Cfg::Stages, NC = Cfg::WM;
  constexpr int A_STAGE = BM * BK * 2, B_STAGE = BN * BK * 2, RING = S * (A_STAGE + B_STAGE);
  tma_prefetch_maps(p.tmA, p.tmB);
  int k0 = 0, k1 = 0;                             // stages filled so far, per consumer ring
  // kWsBooks, one k-tile a tile (a 1x1 conv over 64 channels): a slot's B tile is its column block's, and with
  // a grid that is a multiple of the column blocks each CTA keeps one, so a slot refilled with the column block
  // it holds skips that copy. Deeper reductions keep no such books: the producer's per-k-tile work is on their
  // critical path (docs/performance.md: ws-books).
  int held[NC][S];
#pragma unroll
  for (int c = 0; c < NC; ++c)
#pragma unroll
    for (int s = 0; s < S; ++s) held[c][s] = -1;
  for (int i = 0;; ++i) {
    const int t = first + i * step;
    if (t >= NT) break;
    const int c = NC == 1 ? 0 : i & 1;
    const auto [m0, n0] = tile_coord<Cfg>(p, t);
    const TileOrigin o = tile_origin(p, m0);
    uint8_t* ring = smem + c * RING;
    int k = c ? k1 : k0;
    for (int kt = kb; kt < ke; ++kt, ++k) {
      const int slot = k % S;
      mbar_wait(&empty[c][slot], ((k / S) & 1) ^ 1);   // a fresh barrier counts as emptied once
      bool load_b = true;
      if (kWsBooks && KT == 1) {
#pragma unroll
        for (int cc = 0; cc < NC; ++cc)            // (unrolled: the indices stay out of local memory)
#pragma unroll
          for (int s = 0; s < S; ++s)
            if (cc == c && s == slot) {
              load_b = held[cc][s] != n0;
              held[cc][s] = n0;
            }
      }
      tma_issue_stage<Cfg>(p, ring + slot * A_STAGE, ring + S * A_STAGE + slot * B_STAGE, &full[c][slot], kt, o, n0,
                           load_b);
    }
    if (c) k1 = k; else k0 = k;
  }
}

// The cluster k-split's hand-over goes through rank 0's C tile (free: its previous epilogue has released it), in
// fragment order: float4 j of thread tid at (j · 128 + tid) · 16 bytes. Rank 1 sends its partial sums (done:
// the tiles it handed over before) ...
template <class Cfg>
IGEMM_DEVICE void csplit_send(const float* acc, float* Cs, uint64_t* xfer, int done, int tid) {
  constexpr int NACC = Cfg::BN / 2;
  if (done > 0) mbar_wait_cluster(&xfer[1], (done - 1) & 1);   // rank 0 has read the previous one
  const uint32_t dst = smem_in_rank(Cs, 0);
#pragma unroll
  for (int j = 0; j < NACC / 4; ++j)
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst + (j * 128 + tid) * 16),
                 "f"(acc[4 * j]), "f"(acc[4 * j + 1]), "f"(acc[4 * j + 2]), "f"(acc[4 * j + 3]) : "memory");
  mbar_arrive_remote(smem_in_rank(&xfer[0], 0));
}

// ... and rank 0 adds them to its own (done: the tiles it received before).
template <class Cfg>
IGEMM_DEVICE void csplit_receive(float* acc, const float* Cs, uint64_t* xfer, int done, int tid) {
  constexpr int NACC = Cfg::BN / 2;
  const float4* xbuf = reinterpret_cast<const float4*>(Cs);
  mbar_wait_cluster(&xfer[0], done & 1);
#pragma unroll
  for (int j = 0; j < NACC / 4; ++j) {
    const float4 v = xbuf[j * 128 + tid];
    acc[4 * j] += v.x;
    acc[4 * j + 1] += v.y;
    acc[4 * j + 2] += v.z;
    acc[4 * j + 3] += v.w;
  }
}

// A consumer warpgroup's store phase: a register epilogue, or the accumulators through the fp32 C tile.
template <class Cfg, class P>
IGEMM_DEVICE void ws_store(const P& p, float* acc, float* Cs, float (*s_vec)[Cfg::BN], int tid, int m0, int n0,
                           NamedSync sync, uint8_t* res_s) {
  if constexpr (Cfg::StoreMode == kStoreRegs) {
    epilogue_regs_by<Cfg, 128>(p, acc, reinterpret_cast<uint8_t*>(Cs), s_vec, tid, m0, n0, sync, res_s);
  } else if constexpr (Cfg::StoreMode == kStoreRegsNCHW) {
    epilogue_regs_nchw_by<Cfg, 128>(p, acc, reinterpret_cast<uint8_t*>(Cs), s_vec, tid, m0, n0, sync, res_s);
  } else {
    acc_to_cs_rows<Cfg>(acc, Cs, 0);
    sync();
    epilogue_store_by<Cfg, 128>(p, Cs, m0, n0, tid, s_vec, sync);
  }
}

template <class Cfg, class P>
IGEMM_DEVICE void fprop_ws(const P& p, uint8_t* smem) {
  using T = typename Cfg::Element;
  using Atom = typename GmmaAtom<T, Cfg::BN, gmma::Major::K, kMajorB<Cfg>>::type;
  using AtomMN = typename GmmaAtom<T, Cfg::BN, gmma::Major::MN, kMajorB<Cfg>>::type;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, S = Cfg::Stages, NC = Cfg::WM;
  constexpr int A_STAGE = BM * BK * 2, B_STAGE = BN * BK * 2, RING = S * (A_STAGE + B_STAGE);
  constexpr int NACC = BN / 2, KSTEPS = BK / 16;
  static_assert((NC == 1 || NC == 2) && (Cfg::LoadA == kLoadTma || Cfg::LoadA == kLoadTmaMN),
                "one or two consumer warpgroups, 64-channel TMA k-tiles");
  static_assert(kCsplit == 1 || NC == 1, "the cluster k-split: one consumer warpgroup");
  __shared__ alignas(8) uint64_t full[NC][S], empty[NC][S];
  __shared__ alignas(8) uint64_t xfer[2];           // kCsplit: [0] full (rank 0's), [1] empty (rank 1's)
  __shared__ __align__(16) float s_vec[NC][3][BN];
  const int TM = (p.M + BM - 1) / BM, NT = TM * ((p.K + BN - 1) / BN);   // tiles
  const int KT = (p.Kred + BK - 1) / BK;
  // kCsplit: cluster rank r runs k-tiles [kb, ke) of tile t = cluster index + i · clusters
  const uint32_t rank = kCsplit == 1 ? 0 : cluster_rank();
  const int first = blockIdx.x / kCsplit, step = gridDim.x / kCsplit;
  const int kb = rank == 0 ? 0 : (KT + 1) / 2, ke = kCsplit == 1 || rank == 1 ? KT : (KT + 1) / 2;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
      for (int s = 0; s < S; ++s) {
        mbar_init(&full[c][s], 1);
        mbar_init(&empty[c][s], 128);
      }
    if constexpr (kCsplit == 2) {
      mbar_init(&xfer[0], 128);
      mbar_init(&xfer[1], 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if constexpr (kCsplit == 2) cluster_sync_all();   // the peer's barriers are initialised before any arrival
  else __syncthreads();
  // (broadcast from lane 0: ptxas then knows the role, and so the consumer's whole tile loop, is warp-uniform)
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0);
  if (wg == NC) {                                   // the producer warp
    if ((threadIdx.x & 31) != 0) return;
    ws_produce<Cfg>(p, smem, full, empty, first, step, NT, KT, kb, ke);
    return;
  }
  // consumer warpgroup wg
  uint8_t* ring = smem + wg * RING;
  float* Cs = reinterpret_cast<float*>(smem + NC * RING + wg * Cfg::kCsBytes);
  const uint32_t sA_u = smem_u32(ring), sB_u = smem_u32(ring + S * A_STAGE);
  const int tid = threadIdx.x - wg * 128;
  int k = 0, done = 0;                              // (done: kCsplit tiles handed over / received)
  int vec_n0 = -1;                                  // the column block whose channel vectors s_vec[wg] holds
  for (int i = wg;; i += NC) {
    const int t = first + i * step;
    if (t >= NT) break;
    const auto [m0, n0] = tile_coord<Cfg>(p, t);
    if constexpr (Cfg::kRegsStore)
      if (rank == 0) {
        epilogue_regs_prologue_by<Cfg, 128>(p, m0, n0, tid, s_vec[wg], !kWsBooks || n0 != vec_n0);
        vec_n0 = n0;
      }
    // the residual tile into the C tile's upper half (the 16-bit C tile takes the lower; both free since the
    // previous tile's epilogue ended with `sync`)
    // (not with the cluster k-split: rank 1's partial sums arrive in the whole C tile)
    // NCHW (any V: kStageResidualNchwWs): into the C tile itself, which the epilogue then builds in place
    constexpr bool kStage = (kStageResidual<Cfg> || kStageResidualNchwWs<Cfg>) && kCsplit == 1;
    uint8_t* res_s = reinterpret_cast<uint8_t*>(Cs) + (kStageResidualNchwWs<Cfg> ? 0 : BM * (BN + 8) * 2);
    if constexpr (kStage) {
      if constexpr (kStageResidualNchwWs<Cfg>)
        stage_residual_nchw<Cfg, 128>(p, reinterpret_cast<uint16_t*>(res_s), m0, n0, tid);
      else
        stage_residual_smem<Cfg>(p, res_s, m0, n0, tid);
    }
    float acc[NACC];
#pragma unroll
    for (int j = 0; j < NACC; ++j) acc[j] = 0.f;
    int prev = -1;
    for (int kt = kb; kt < ke; ++kt, ++k) {
      const int slot = k % S;
      mbar_wait(&full[wg][slot], (k / S) & 1);
      if constexpr (Cfg::LoadA == kLoadTmaMN)   // A MN-major (NCHW x in place), as in mainloop_wgmma_tma
        wgmma_stage<AtomMN, NACC, KSTEPS, 2048 / 16, kStepB<Cfg>>(desc_mn_sw128(sA_u + slot * A_STAGE),
                                                                   desc_b<Cfg>(sB_u + slot * B_STAGE), acc);
      else
        wgmma_stage<Atom, NACC, KSTEPS, 2, kStepB<Cfg>>(desc_sw128(sA_u + slot * A_STAGE),
                                                        desc_b<Cfg>(sB_u + slot * B_STAGE), acc);
      cute::warpgroup_wait<1>();
#pragma unroll
      for (int j = 0; j < NACC; ++j) cute::warpgroup_fence_operand(acc[j]);
      if (prev >= 0) mbar_arrive(&empty[wg][prev]);   // the group that read it has finished
      prev = slot;
      if constexpr (Cfg::kRegsStore && Cfg::Epi::kResidual && !kStage)   // as in mainloop_wgmma_tma
        if (rank == 0 && KT > 2 * S && kt == (kb + ke) / 2) prefetch_residual_l2<Cfg, 128>(p, m0, n0, tid);
    }
    cute::warpgroup_wait<0>();
#pragma unroll
    for (int j = 0; j < NACC; ++j) cute::warpgroup_fence_operand(acc[j]);
    if (prev >= 0) mbar_arrive(&empty[wg][prev]);
    const NamedSync sync{1 + wg};
    if constexpr (kCsplit == 2) {
      if (rank == 1) {
        csplit_send<Cfg>(acc, Cs, xfer, done, tid);
        ++done;
        continue;                                   // rank 0 stores the tile
      }
      csplit_receive<Cfg>(acc, Cs, xfer, done, tid);
      ++done;
      sync();                                       // every thread has read its partial: the epilogue may reuse Cs
    }
    ws_store<Cfg>(p, acc, Cs, s_vec[wg], tid, m0, n0, sync, kStage ? res_s : nullptr);
    sync();                                         // C tile and channel vectors free for the next tile
    if constexpr (kCsplit == 2) mbar_arrive_remote(smem_in_rank(&xfer[1], 1));   // rank 1 may hand over again
  }
  if constexpr (kCsplit == 2)
    if (rank == 1 && done > 0) mbar_wait_cluster(&xfer[1], (done - 1) & 1);   // rank 0's last arrival lands first
}

}  // namespace igemm::conv
