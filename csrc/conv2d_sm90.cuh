// igemm conv2d forward: the sm_90a mainloop — warpgroup MMA (wgmma) fed by the same cp.async gather.
//
// BM = 64 · WM rows (one warpgroup per 64 rows), BN ∈ {64, 128, 256} columns, BK = 64 16-bit elements
// (128-byte rows): the loader's XOR swizzle (chunk ^ row % 8 on 1024-byte aligned buffers) is exactly the
// SW128 K-major layout, so each warpgroup issues wgmma.m64nBNk16 with both operands read from shared
// memory through descriptors (CuTe's SM90 GMMA atoms), 4 per stage. Loads for stage i + Stages - 1 are in
// flight (cp.async) while stage i is multiplied, and one wgmma group stays in flight while the next
// stage's loads are issued; each thread fences its shared-memory writes into the async proxy
// (fence.proxy.async) before the barrier that publishes a stage to wgmma.
#pragma once
#include <utility>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include "conv2d_common.cuh"
#include "conv2d_epilogue.cuh"

namespace igemm::conv {

namespace gmma = cute::SM90::GMMA;

// A K-major (the default) or MN-major (kLoadTmaMN: pixels contiguous); B always K-major
template <class T, int N, gmma::Major MA = gmma::Major::K> struct GmmaAtom;
#define IGEMM_GMMA_ATOM(T, N, NAME) \
  template <gmma::Major MA> struct GmmaAtom<T, N, MA> { using type = gmma::NAME<MA, gmma::Major::K>; };
IGEMM_GMMA_ATOM(cutlass::half_t, 64, MMA_64x64x16_F32F16F16_SS)
IGEMM_GMMA_ATOM(cutlass::half_t, 128, MMA_64x128x16_F32F16F16_SS)
IGEMM_GMMA_ATOM(cutlass::half_t, 192, MMA_64x192x16_F32F16F16_SS)
IGEMM_GMMA_ATOM(cutlass::half_t, 256, MMA_64x256x16_F32F16F16_SS)
IGEMM_GMMA_ATOM(cutlass::bfloat16_t, 64, MMA_64x64x16_F32BF16BF16_SS)
IGEMM_GMMA_ATOM(cutlass::bfloat16_t, 128, MMA_64x128x16_F32BF16BF16_SS)
IGEMM_GMMA_ATOM(cutlass::bfloat16_t, 192, MMA_64x192x16_F32BF16BF16_SS)
IGEMM_GMMA_ATOM(cutlass::bfloat16_t, 256, MMA_64x256x16_F32BF16BF16_SS)
#undef IGEMM_GMMA_ATOM

template <class Atom, size_t... I>
IGEMM_DEVICE void gmma_issue(uint64_t da, uint64_t db, float* acc, std::index_sequence<I...>) {
  Atom::fma(da, db, acc[I]..., gmma::ScaleOut::One);
}

// K-major, 128-byte swizzle: 8-row core groups 1024 bytes apart (SBO), LBO unused (1).
IGEMM_DEVICE uint64_t desc_sw128(uint32_t smem_addr) {
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = static_cast<uint16_t>((smem_addr & 0x3FFFF) >> 4);
  d.bitfield.leading_byte_offset_ = 1;
  d.bitfield.stride_byte_offset_ = 1024 >> 4;
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = 1;
  return d.desc_;
}

// MN-major, 128-byte swizzle (kLoadTmaMN's A): 64 contiguous pixels per 128-byte row, one row per channel;
// the 8-channel core groups 1024 bytes apart (SBO), the next 64 pixels (LBO) unused by a 64-row tile.
IGEMM_DEVICE uint64_t desc_mn_sw128(uint32_t smem_addr) {
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = static_cast<uint16_t>((smem_addr & 0x3FFFF) >> 4);
  d.bitfield.leading_byte_offset_ = 8192 >> 4;
  d.bitfield.stride_byte_offset_ = 1024 >> 4;
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = 1;
  return d.desc_;
}

// K-major, no swizzle (the INTERLEAVE layout): 8-row × 16-byte core matrices, rows 16 bytes apart, the next
// 8 rows `sbo` bytes on, the next 8 elements of K `lbo` bytes on.
IGEMM_DEVICE uint64_t desc_interleave(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = static_cast<uint16_t>((smem_addr & 0x3FFFF) >> 4);
  d.bitfield.leading_byte_offset_ = static_cast<uint16_t>(lbo >> 4);
  d.bitfield.stride_byte_offset_ = static_cast<uint16_t>(sbo >> 4);
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = 0;
  return d.desc_;
}

IGEMM_DEVICE void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Accumulators → shared C tile (fp32; layout per Config::kCsPixelMajor). Warp w of the warpgroup owns
// rows r_base + w*16 + lane/4 (+8); for each 8-column block j the thread holds columns j*8 + 2*(lane%4)
// + {0, 1} (as mma.sync's C fragment). No barrier: the caller publishes the tile.
template <class Cfg>
IGEMM_DEVICE void acc_to_cs_rows(const float* acc, float* Cs, int r_base) {
  constexpr int BN = Cfg::BN;
  constexpr int LD = Cfg::kCsLd;
  const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3;
  const int r0 = r_base + w * 16 + (lane >> 2);
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int c0 = j * 8 + 2 * (lane & 3);
    if constexpr (Cfg::kCsPixelMajor) {
      *reinterpret_cast<float2*>(Cs + r0 * LD + c0) = make_float2(acc[4 * j], acc[4 * j + 1]);
      *reinterpret_cast<float2*>(Cs + (r0 + 8) * LD + c0) = make_float2(acc[4 * j + 2], acc[4 * j + 3]);
    } else {
      Cs[c0 * LD + r0] = acc[4 * j];
      Cs[(c0 + 1) * LD + r0] = acc[4 * j + 1];
      Cs[c0 * LD + r0 + 8] = acc[4 * j + 2];
      Cs[(c0 + 1) * LD + r0 + 8] = acc[4 * j + 3];
    }
  }
}

// ... for the CTA's tile (warpgroup wg owns rows wg*64..), over the idle stage buffers, then a barrier.
template <class Cfg>
IGEMM_DEVICE void acc_to_cs(const float* acc, uint8_t* smem) {
  acc_to_cs_rows<Cfg>(acc, reinterpret_cast<float*>(smem), (threadIdx.x / 128) * 64);
  __syncthreads();
}

// The register epilogue's channel vectors (3 × BN floats of static shared memory, one array per kernel).
template <int BN>
IGEMM_DEVICE float (*regs_channel_vectors())[BN] {
  __shared__ __align__(16) float s_vec[3][BN];
  return s_vec;
}

// Before the mainloop (fprop_tile), so that none of it waits after the last MMA: the tile's channel
// vectors go to shared memory by cp.async (its own group; epilogue_regs waits for it), and, when the
// reduction is short (KT <= 2 · Stages: nothing else hides the residual's DRAM latency), the residual
// tile's 128-byte lines are prefetched into L2, so the epilogue's fragment loads hit L2. H100, N=32,
// fp16 (tools/epi_probe.py): 1x1 64->256 conv+BN+Add+ReLU+mask 60.0 -> 52.9 us; with a deep reduction
// (3x3 128->128, 18 k-tiles) the prefetch cost 1 us, hence the limit.
// (IGEMM_NO_EPI_PROLOGUE: stage the vectors in the epilogue and prefetch nothing, for A/B measurements.)
template <class Cfg>
constexpr bool kEarlyVectors =
#if defined(IGEMM_NO_EPI_PROLOGUE)
    false;
#else
    !Cfg::Epi::kEmpty;
#endif

// The residual tile's 128-byte lines into L2, by NT threads: NHWC, the tile's rows (BN channels each);
// NCHW (kStoreRegsNCHW), its channel rows, each a run of pixels in every image plane the tile touches (one
// run a row had been prefetched, from the tile's first pixel: with P·Q = 49 most of a 128-pixel row's
// lines, in the next images, were left to the epilogue's loads).
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
#if defined(IGEMM_NO_RES_STAGE)
    false;
#else
    Cfg::StoreMode == kStoreRegs && ResidualBytes<typename Cfg::Epi>::value == 2 && Cfg::BN <= 128;
#endif

template <class Cfg>
constexpr int kResidualStageBytes = Cfg::BM * Cfg::BN * 2;

// The patch kernel (mainloop_wgmma_patch) loads the whole tile's residual pairs into registers at the
// tile's start, beside its patch's TMA load, and hands them to the epilogue: its reduction is short (conv1:
// 3 k-tiles) and its shared memory has no room for a staged tile at 3 CTAs an SM, so that the pairs' latency
// hides behind the patch's wait instead of stalling the epilogue (loaded there, after an L2 prefetch at the
// tile's start, they held 426 of conv1 (c)'s 2,033 epilogue stall samples: session 21, run 11). A 16-bit
// residual, BN <= 128: 2 x BN/8 registers (KernelSpec.residual_preloaded; the plan caps the registers for
// 3 CTAs an SM, and the patch kernel packs its row offsets so that nothing spills).
template <class Cfg>
constexpr bool kPreloadResidual =
#if defined(IGEMM_NO_RES_PRELOAD)
    false;
#else
    Cfg::LoadA == kLoadPatch && Cfg::StoreMode == kStoreRegs && ResidualBytes<typename Cfg::Epi>::value == 2 &&
    Cfg::BN <= 128;
#endif

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

// NT threads (tid = 0..NT-1): the CTA's, or one consumer warpgroup's in the persistent kernel (its own
// s_vec, refilled per tile before the tile's mainloop unless it holds column block n0's already: vectors false).
template <class Cfg, int NT, class P>
IGEMM_DEVICE void epilogue_regs_prologue_by(const P& p, int m0, int n0, int tid, float (*s_vec)[Cfg::BN],
                                            bool vectors = true) {
#if !defined(IGEMM_NO_EPI_PROLOGUE)
  using Epi = typename Cfg::Epi;
  constexpr int BN = Cfg::BN;
  if constexpr (kEarlyVectors<Cfg>) if (vectors) {
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
#endif
}

template <class Cfg, class P>
IGEMM_DEVICE void epilogue_regs_prologue(const P& p, int m0, int n0) {
  epilogue_regs_prologue_by<Cfg, Cfg::kThreads>(p, m0, n0, threadIdx.x, regs_channel_vectors<Cfg::BN>());
}

// 0xFFFF in each 16-bit half of the result whose stored value is > 0 (false for ±0 and NaN): one set.gt
// on the packed pair, so the mask bit is exactly (stored y > 0).
template <class TO>
IGEMM_DEVICE uint32_t gt0_pair(uint32_t u) {
  static_assert(sizeof(TO) == 2, "16-bit outputs");
  uint32_t r;
  if constexpr (std::is_same_v<TO, cutlass::bfloat16_t>)
    asm("set.gt.u32.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(u), "r"(0u));
  else
    asm("set.gt.u32.f16x2 %0, %1, %2;" : "=r"(r) : "r"(u), "r"(0u));
  return r;
}

// The ReLU mask byte of a 16-byte vector of eight stored 16-bit values (bit e: value e > 0; false for ±0 and
// NaN). Pair k's set.gt halves keep bits 2k (low) and 16 + 2k + 1 (high): one LOP3 each; x | x >> 16 then has
// value e at bit e. The register epilogues' store loops, NHWC (8 channels) and NCHW (8 pixels of a channel).
template <class TO>
IGEMM_DEVICE uint8_t mask_byte8(const uint4& v) {
  const uint32_t x = (gt0_pair<TO>(v.x) & 0x00020001u) | (gt0_pair<TO>(v.y) & 0x00080004u) |
                     (gt0_pair<TO>(v.z) & 0x00200010u) | (gt0_pair<TO>(v.w) & 0x00800040u);
  return uint8_t(x | (x >> 16));
}

// (lo, hi) rounded to nearest-even into one packed 16-bit pair, lo in the low half: one cvt (F2FP), where
// two scalar conversions gave the pack in the other order and a PRMT to swap it back (ptxas 13.0).
template <class TO>
IGEMM_DEVICE uint32_t pack_pair(float lo, float hi) {
  static_assert(sizeof(TO) == 2, "16-bit outputs");
  uint32_t r;
  if constexpr (std::is_same_v<TO, cutlass::bfloat16_t>)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// A residual pair (raw bits for 16-bit types: the low half is the first element) as two floats.
template <class RT, class Raw>
IGEMM_DEVICE void unpack_pair(const Raw& u, float& lo, float& hi) {
  if constexpr (std::is_same_v<RT, cutlass::half_t>) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&u));
    lo = f.x;
    hi = f.y;
  } else if constexpr (std::is_same_v<RT, cutlass::bfloat16_t>) {
    lo = __uint_as_float(u << 16);
    hi = __uint_as_float(u & 0xFFFF0000u);
  } else {
    lo = to_float(u.v[0]);
    hi = to_float(u.v[1]);
  }
}

// The register epilogues' common start: the tile's channel vectors in shared memory (the prologue's
// cp.async group, or staged now), then `sync` (every stage read: the C tile may overwrite them).
template <class Cfg, int NT, class P, class Sync>
IGEMM_DEVICE epi::Ctx regs_epilogue_start(const P& p, float (*s_vec)[Cfg::BN], int tid, int n0, Sync sync) {
  if constexpr (kEarlyVectors<Cfg>) cp_async_wait<0>();      // the prologue's channel vectors
  else if constexpr (!Cfg::Epi::kEmpty) stage_channel_vectors<Cfg::BN, NT>(p, n0, tid, s_vec);
  sync();
  return epi::Ctx{s_vec[0], s_vec[1], s_vec[2], p.alpha_scalar};
}

// The first of the two tile rows whose accumulators thread tid holds (the other is 8 rows on): warp w of
// warpgroup g owns rows g·64 + w·16 + lane / 4 (wgmma's accumulator layout).
IGEMM_DEVICE int fragment_row0(int tid) { return (tid >> 7) * 64 + ((tid >> 5) & 3) * 16 + ((tid & 31) >> 2); }

// Four 8x8 16-bit matrices between a warp's fragments and shared memory, one instruction (ldmatrix; stmatrix,
// sm_90): register i holds the thread's pair of matrix i (row lane / 4, columns 2·(lane % 4) + {0, 1}, the
// accumulator fragment's layout), and lane l gives the 16-byte row l % 8 of matrix l / 8. TRANS: that row is
// the matrix's column l % 8 (the NCHW C tile: one channel's 8 pixels). In the register epilogues matrix i is
// (column block 2·jp + i / 2, rows r0 | r0 + 8 by i % 2): the NCHW C tile's values (and residual) move as four
// 16-byte rows a lane where they took eight 2-byte stores (loads), the NHWC staged residual's as four where it
// took four 4-byte loads. H100, N=32, fp16 NCHW (tools/epi_probe.py, session 20): 0.2-0.6 us off (a)/(b)/(c)
// on 3x3 128 @28, 3x3 256 @14 and 1x1/2 512->1024, the other layers within 0.5 us either way.
IGEMM_DEVICE void stmatrix_x4_trans(void* dst, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
               ::"r"(smem_u32(dst)), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

template <bool TRANS>
IGEMM_DEVICE void ldmatrix_x4(const void* src, uint32_t& a, uint32_t& b, uint32_t& c, uint32_t& d) {
  if constexpr (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(smem_u32(src)) : "memory");
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(smem_u32(src)) : "memory");
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

// One 16-, 8-, 4- or 2-byte global store of v at p. (As a plain assignment, the uint4 store of
// epilogue_regs_nchw_by's fused-mask variant left nvcc 13.0's front end as four st.global.u32.)
IGEMM_DEVICE void store_vec(void* p, const uint4& v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
IGEMM_DEVICE void store_vec(void* p, const uint2& v) {
  asm volatile("st.global.v2.b32 [%0], {%1, %2};\n" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}
IGEMM_DEVICE void store_vec(void* p, uint32_t v) { *static_cast<uint32_t*>(p) = v; }
IGEMM_DEVICE void store_vec(void* p, uint16_t v) { *static_cast<uint16_t*>(p) = v; }

// The register epilogue (kStoreRegs: NHWC output, no split-K), called where acc_to_cs would be (every
// stage read): the chain runs on the accumulators in registers (channels from the fragment layout; the
// residual's element pairs at the fragment's positions, the whole tile's loaded ahead where BN <= 128),
// each value is rounded once into a 16-bit C tile in shared memory (BN + 8 elements a row: the fragment
// writes are conflict-free), and the tile leaves in 16-byte vectors, each with its byte of the ReLU mask
// (four set.gt on the stored pairs: bit = stored y > 0; one byte store, so K % 8 == 0 is all it needs).
// Against the fp32 C tile: half the shared-memory bytes, and no index math or chain work per vector in the
// store loop. (Until session 26 the mask words were assembled from the fragments -- a quad's four lanes
// hold a row's 32 channels: bit moves and two shuffles per word and row -- about 180 instructions a thread
// on a 64x128 tile against about 100 from the vectors, in an epilogue that runs with three or four warps a
// scheduler and pays for each instruction in latency.)
// NT threads (tid = 0..NT-1, 64 rows a warpgroup) synchronised by `sync`: the CTA, or one consumer
// warpgroup of the persistent kernel; ct: the tile's C buffer; s_vec: its channel vectors.
template <class Cfg, int NT, class P, class Sync>
IGEMM_DEVICE void epilogue_regs_by(const P& p, float* acc, uint8_t* smem, float (*s_vec)[Cfg::BN], int tid,
                                   int m0, int n0, Sync sync, const uint8_t* res_s = nullptr,
                                   const ResidualPairs<Cfg>* pre = nullptr) {
  using TO = typename Cfg::ElementOut;
  using Epi = typename Cfg::Epi;
  constexpr int BN = Cfg::BN, BM = Cfg::BM, LDH = BN + 8, V = Cfg::VecO, CPR = BN / V;
  static_assert(NT % CPR == 0, "whole rows per store pass");
  const int lane = tid & 31, r0 = fragment_row0(tid);
  using RT = typename ResidualPairs<Cfg>::RT;
  // The residual pairs (load_residual_pairs) are loaded G column blocks at a time. With BN <= 128 the whole
  // tile's pairs are loaded at once, before the channel vectors' barrier: one round trip to L2 per tile (or
  // none: staged in shared memory, or preloaded by the patch kernel). In groups of four (as they once were),
  // the mask stores between groups kept each group's loads behind the previous group's work: four round
  // trips after the mainloop.
  constexpr int NB = BN / 8, G = ResidualPairs<Cfg>::G;   // column blocks: all, and per group
  static_assert(NB % G == 0 && G % 4 == 0, "BN / 8 blocks in groups of 4");
  using RawPair = typename ResidualPairs<Cfg>::Raw;
  RawPair ra[G], rb[G];
  auto load_residual = [&](int j0) {
    if constexpr (Epi::kResidual && G == NB) {
      if (pre != nullptr) {     // loaded by the mainloop (kPreloadResidual)
#pragma unroll
        for (int g = 0; g < G; ++g) {
          ra[g] = pre->a[g];
          rb[g] = pre->b[g];
        }
        return;
      }
    }
    if constexpr (kStageResidual<Cfg>) {
      if (res_s != nullptr) {   // staged (stage_residual_smem): this warp's rows, copied by this warp
        static_assert(G == NB, "the whole tile's pairs before the first barrier");
        cp_async_wait<0>();
        __syncwarp();
        // lane l: row (l / 8) % 2 · 8 + l % 8 of the warp's 16 (r & 7 = l % 8), 16-byte chunk 2·jp + l / 16
        const uint8_t* row = res_s + (r0 - (lane >> 2) + ((lane >> 3) & 1) * 8 + (lane & 7)) * (BN * 2);
        const int x = (lane >> 4) ^ (lane & 7);
#pragma unroll
        for (int jp = 0; jp < G / 2; ++jp)
          ldmatrix_x4<false>(row + (((2 * jp) ^ x) << 4), ra[2 * jp], rb[2 * jp], ra[2 * jp + 1], rb[2 * jp + 1]);
        return;
      }
    }
    if constexpr (Epi::kResidual) load_residual_pairs<Cfg, G>(p, m0, n0, tid, j0, ra, rb);
  };
  load_residual(0);
  const epi::Ctx ctx = regs_epilogue_start<Cfg, NT>(p, s_vec, tid, n0, sync);
  TO* ct = reinterpret_cast<TO*>(smem);
  // Without a residual the packed pairs go to the C tile after the whole tile's chain (kDeferStores): a
  // C-tile store between column blocks kept the next block's channel-vector loads behind it (shared memory
  // both: ptxas cannot tell them apart), a shared-memory round trip exposed per block. H100, N=32, fp16
  // (session 25, run 3): conv+BN+ReLU(mask) 1x1/2 512->1024 19.0 -> 18.7 us, 3x3 512 @7 19.15 -> 18.7,
  // conv1 74.7 -> 73.75; the registers stayed (90 on 1x1/2). With a residual it took more registers (3x3
  // 128 @28, 128x128 tile: 127 -> 140, one CTA an SM) and (c) 19.0 -> 23.4 us; the NCHW epilogue's stmatrix
  // deferred the same way took 20-40% more registers and lost up to 16 us (conv1), so neither does.
  constexpr bool kDeferStores = !Epi::kResidual;
  uint32_t po[kDeferStores ? NB : 1][2];
#pragma unroll
  for (int j0 = 0; j0 < NB; j0 += G) {
    if (j0 > 0) load_residual(j0);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int j = j0 + g;
      const int c = j * 8 + 2 * (lane & 3);
      float v[4] = {acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]};
      const int ch[4] = {c, c + 1, c, c + 1};
      float res[4] = {0.f, 0.f, 0.f, 0.f};
      if constexpr (Epi::kResidual) {
        unpack_pair<RT>(ra[g], res[0], res[1]);
        unpack_pair<RT>(rb[g], res[2], res[3]);
      }
      Epi::template apply<4, epi::kChPairs>(v, ch, res, ctx);
      // (4-byte stores: with a fused mask, stmatrix's register quads cost more moves than it saves stores --
      // the set.gt overwrites its operand -- and 1x1 64->256's conv+BN+ReLU+mask measured 1.2 us slower)
      const uint32_t o0 = pack_pair<TO>(v[0], v[1]), o1 = pack_pair<TO>(v[2], v[3]);
      if constexpr (kDeferStores) {
        po[j][0] = o0;
        po[j][1] = o1;
      } else {
        *reinterpret_cast<uint32_t*>(ct + r0 * LDH + c) = o0;
        *reinterpret_cast<uint32_t*>(ct + (r0 + 8) * LDH + c) = o1;
      }
    }
  }
  if constexpr (kDeferStores) {
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      const int c = j * 8 + 2 * (lane & 3);
      *reinterpret_cast<uint32_t*>(ct + r0 * LDH + c) = po[j][0];
      *reinterpret_cast<uint32_t*>(ct + (r0 + 8) * LDH + c) = po[j][1];
    }
  }
  sync();
  // the tile leaves in 16-byte vectors: thread tid stores column vector tid % CPR of rows tid / CPR + i·NT/CPR
  constexpr int RSTEP = NT / CPR;
  const int col = (tid % CPR) * V, rows = min(BM, p.M - m0);
  if (n0 + col < p.K) {
    const int64_t off = int64_t(m0 + tid / CPR) * p.K + n0 + col;
    TO* y = static_cast<TO*>(const_cast<void*>(p.y)) + off;
    const int64_t ystep = int64_t(RSTEP) * p.K;
    if constexpr (Cfg::FuseMask) {
      // the vector's 8 mask bits (stored value > 0: one set.gt a pair), one byte at bit offset off (K % 8 == 0)
      uint8_t* mb = static_cast<uint8_t*>(const_cast<void*>(p.mask)) + (off >> 3);
      const int64_t mstep = ystep >> 3;
#pragma unroll 4
      for (int row = tid / CPR; row < rows; row += RSTEP, y += ystep, mb += mstep) {
        const uint4 v = *reinterpret_cast<const uint4*>(ct + row * LDH + col);
        store_vec(y, v);
        *mb = mask_byte8<TO>(v);
      }
      // the tensor's last byte (K % 32 != 0 can leave its word part-filled): the rest of the word, past the
      // last element, is zero, as relu_mask leaves it -- by the thread that stored that byte
      const int64_t nbytes = (int64_t(p.M) * p.K) >> 3;
      const int last = rows - 1 - tid / CPR;             // (this thread's rows: tid / CPR + i·RSTEP)
      if ((nbytes & 3) != 0 && m0 + rows == p.M && n0 + col + V == p.K && last >= 0 && last % RSTEP == 0) {
        uint8_t* const m = static_cast<uint8_t*>(const_cast<void*>(p.mask));
        for (int64_t e = nbytes; (e & 3) != 0; ++e) m[e] = 0;
      }
    } else {
#pragma unroll 4
      for (int row = tid / CPR; row < rows; row += RSTEP, y += ystep)
        *reinterpret_cast<uint4*>(y) = *reinterpret_cast<const uint4*>(ct + row * LDH + col);
    }
  }
}

// The NCHW register epilogue's 16-bit C tile: channel-major, BN rows. With vectors of 4 or 8 pixels: rows of
// BM pixels, the 16-byte chunk k of row nl at chunk k ^ (nl & 7) -- the fragment's 16-bit accesses (8
// consecutive pixels of 4 channels 2 apart in a warp) hit 16 distinct banks, a vector stays inside one chunk,
// a store-loop pass moves 8 rows on (the same swizzle every pass), and BM · BN · 2 bytes fit one stage buffer
// even for a 128x128 tile, so the residual can be staged in place before the mainloop ends. With 1- or
// 2-pixel vectors, rows of BM + 8 pixels, unswizzled (conflict-free as well): a pass moves 2 or 4 rows on,
// and the swizzle per pass cost 3x3 512->512 @7's store loop (V = 1) 7% of the conv.
template <class Cfg>
constexpr bool kNchwSwizzled = Cfg::VecO >= 4;

template <class Cfg>
constexpr int kNchwLd = kNchwSwizzled<Cfg> ? Cfg::BM : Cfg::BM + 8;

template <class Cfg>
IGEMM_DEVICE int nchw_ct_index(int nl, int ml) {
  static_assert(Cfg::BM >= 64, "at least 8 chunks a row");
  if constexpr (kNchwSwizzled<Cfg>)
    return nl * Cfg::BM + (ml & ~63) + ((((ml >> 3) ^ nl) & 7) << 3) + (ml & 7);
  else
    return nl * (Cfg::BM + 8) + ml;
}

// The persistent kernel (fprop_ws) stages the residual at the tile's start whatever V: its C tile is its own,
// free during the mainloop, so the residual's DRAM reads overlap the mainloop rather than follow it. With
// V = 1 (P·Q odd: 3x3 512->512 @7) these are 2-byte loads, which had gone out after the mainloop.
template <class Cfg>
constexpr bool kStageResidualNchwWs =
#if defined(IGEMM_NO_RES_STAGE)
    false;
#else
    Cfg::StoreMode == kStoreRegsNCHW && ResidualBytes<typename Cfg::Epi>::value == 2;
#endif

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
    // (not unrolled: in the mainloop, beside the accumulators, an unrolled loop's addresses cost registers --
    // 3x3 128->128 @28's 128x128 tile went from 111 to 135, past two CTAs an SM)
#pragma unroll 1
    for (int nl = nl0; nl < BN; nl += RSTEP, src += ostep) {
      const bool ok = okm && nl < ncols;
      cp_async_zfill<V * 2>(ct + nchw_ct_index<Cfg>(nl, ml), ok ? src : resp, ok);
    }
    cp_async_commit();
  }
}

// The register epilogue for NCHW outputs (kStoreRegsNCHW: no split-K): the chain runs on the
// accumulators as in epilogue_regs_by and each value is rounded once into a channel-major 16-bit C tile
// (nchw_ct_index), which leaves shared memory in V-pixel vectors along one channel (P·Q % V == 0: a vector
// stays inside one image's plane); a thread's pixels are the same in every pass, so its (image, pixel)
// divmod is done once. FuseMask (P·Q % 8 == 0, V = 8): each vector's mask byte from four set.gt on its
// stored pairs, stored beside it (session 26: the words had gathered in shared memory from quad shuffles,
// then left after a barrier -- Config::kCsBytes still counts their BN · BM / 32 words).
// A residual (16-bit) fills the C tile first, in the store loop's vectors, and each fragment element reads
// its residual where it then writes its output: the same thread, the same address, in place. It is staged
// ahead (res_s: the C tile, filled by stage_residual_nchw during the mainloop -- the per-tile kernel's
// first stage freed for good (V >= 4), the persistent kernel's C tile before the tile's mainloop (any V) --
// and waited for with the channel vectors), or else here, after the mainloop (cp.async, or 2-byte loads for
// V = 1: the per-tile kernel, and the persistent one's cluster k-split).
// Against the fp32 C tile's store (kStoreNCHW, where the chain ran per vector in the store loop): half the
// shared-memory bytes, the channel vectors fetched before the mainloop, and no index math or chain work per
// vector in the store loop.
template <class Cfg, int NT, class P, class Sync>
IGEMM_DEVICE void epilogue_regs_nchw_by(const P& p, float* acc, uint8_t* smem, float (*s_vec)[Cfg::BN], int tid,
                                        int m0, int n0, Sync sync, uint8_t* res_s = nullptr) {
  using TO = typename Cfg::ElementOut;
  using Epi = typename Cfg::Epi;
  using RT = std::conditional_t<Epi::kResidual, typename Epi::Res, TO>;
  constexpr int BN = Cfg::BN, BM = Cfg::BM, V = Cfg::VecO, CPR = BM / V, RSTEP = NT / CPR;
  static_assert(NT % CPR == 0 && BN % RSTEP == 0, "whole channel rows per store pass");
  static_assert(sizeof(RT) == 2, "16-bit residuals (staged in the 16-bit C tile)");
  using VecT = std::conditional_t<V == 8, uint4, std::conditional_t<V == 4, uint2, std::conditional_t<V == 2, uint32_t, uint16_t>>>;
  // thread tid's store-loop vectors: pixel vector tid % CPR of channel rows tid / CPR + i·RSTEP
  const int ml = (tid % CPR) * V, nl0 = tid / CPR;
  const bool okm = m0 + ml < p.M;                            // (M = N·P·Q, a multiple of V)
  int img, pq;
  p.fd_PQ.divmod(img, pq, okm ? m0 + ml : 0);
  const int ncols = min(BN, p.K - n0);
  const int64_t off0 = (int64_t(img) * p.K + n0 + nl0) * p.PQ + pq, ostep = int64_t(RSTEP) * p.PQ;
  const epi::Ctx ctx = regs_epilogue_start<Cfg, NT>(p, s_vec, tid, n0, sync);   // (waits for a staged residual)
  uint16_t* ct = reinterpret_cast<uint16_t*>(res_s != nullptr ? res_s : smem);
  auto cti = [](int nl, int m) { return nchw_ct_index<Cfg>(nl, m); };
  if constexpr (Epi::kResidual) {
    if (res_s == nullptr) {
      if constexpr (V >= 2) {
        stage_residual_nchw<Cfg, NT>(p, ct, m0, n0, tid);
      } else {
        // V = 1: one 2-byte load an element, in batches of B loads in flight before their stores (the
        // loop unrolled by 8 ran its 8 batches' round trips to L2 one after another: 3x3 512->512 @7, N=32,
        // (c) cost 5.5 us more than (b)). The persistent kernel's cluster k-split (one CTA an SM, registers to
        // spare) issues them all at once; without it that kernel stages them at the tile's start.
        const uint16_t* resp = static_cast<const uint16_t*>(p.residual);
        constexpr int NI = BN / RSTEP, B = Cfg::kMath == kWgmmaWs ? NI : (NI < 16 ? NI : 16);
        residual_rows_v1<Cfg, NI, B, RSTEP>(resp + off0, ostep, ct + cti(nl0, ml),
                                           okm ? (ncols - nl0 + RSTEP - 1) / RSTEP : 0);
      }
      cp_async_wait<0>();
      sync();
    }
  }
  const int lane = tid & 31, r0 = fragment_row0(tid);
  // Column blocks 2·jp and 2·jp + 1 of the warp's 16 pixels leave (and a residual arrives) by one transposed
  // stmatrix (ldmatrix): lane l's 16-byte row is channel 16·jp + (l / 16)·8 + l % 8, pixels
  // r0 - lane / 4 + ((l / 8) % 2)·8 .. + 7 -- one C-tile chunk (the swizzle depends on the channel's low 3 bits
  // only, so block pair jp is 16·jp rows further on).
  uint16_t* const fm = ct + cti((lane >> 4) * 8 + (lane & 7), r0 - (lane >> 2) + ((lane >> 3) & 1) * 8);
#pragma unroll
  for (int jp = 0; jp < BN / 16; ++jp) {
    uint16_t* const f = fm + jp * 16 * kNchwLd<Cfg>;
    uint32_t rp[4] = {0u, 0u, 0u, 0u};   // the residual pairs: (block 2jp | 2jp+1) x (pixel r0 | r0+8)
    if constexpr (Epi::kResidual) ldmatrix_x4<true>(f, rp[0], rp[1], rp[2], rp[3]);
    uint32_t o[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int j = 2 * jp + h, c = j * 8 + 2 * (lane & 3);
      float v[4] = {acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]};
      const int ch[4] = {c, c + 1, c, c + 1};
      float res[4] = {0.f, 0.f, 0.f, 0.f};
      if constexpr (Epi::kResidual) {    // (r0, c | c+1), (r0+8, c | c+1): the pairs as unpack_pair takes them
        unpack_pair<RT>(rp[2 * h], res[0], res[1]);
        unpack_pair<RT>(rp[2 * h + 1], res[2], res[3]);
      }
      Epi::template apply<4, epi::kChPairs>(v, ch, res, ctx);
      o[2 * h] = pack_pair<TO>(v[0], v[1]);       // (r0, c | c+1)
      o[2 * h + 1] = pack_pair<TO>(v[2], v[3]);   // (r0+8, c | c+1)
    }
    stmatrix_x4_trans(f, o[0], o[1], o[2], o[3]);
  }
  sync();
  TO* y = static_cast<TO*>(const_cast<void*>(p.y));
  TO* yp = y + off0;                                         // (a pointer stepped per pass: no 64-bit IMADs)
  // FuseMask (P·Q % 8 == 0, V = 8): each vector's 8 pixels are one byte of the mask (the vector starts on a
  // byte: pq % 8 == 0), stored by the thread that stores the vector. A word at a channel row's run end also
  // holds bits of a neighbouring tile (P·Q % 32 != 0) or row: byte stores leave them alone, so every byte
  // has one writer -- no atomics, no fix-up, the same bits whatever the order.
  uint8_t* mb = Cfg::FuseMask ? static_cast<uint8_t*>(const_cast<void*>(p.mask)) + (off0 >> 3) : nullptr;
  const int64_t mstep = ostep >> 3;
  const uint16_t* const sbase = ct + cti(nl0, ml);
#pragma unroll 4
  for (int i = 0; i < BN / RSTEP; ++i, yp += ostep, mb += mstep) {
    const int nl = nl0 + i * RSTEP;
    const bool ok = okm && nl < ncols;
    // (one base and a constant step: unswizzled, or 8 rows a pass)
    static_assert(!kNchwSwizzled<Cfg> || RSTEP % 8 == 0, "the same swizzle every pass");
    const VecT o = *reinterpret_cast<const VecT*>(sbase + i * RSTEP * kNchwLd<Cfg>);
    if (ok) store_vec(yp, o);
    if constexpr (Cfg::FuseMask) {
      const uint8_t byte = mask_byte8<TO>(o);                // (V = 8: bit e, pixel ml + e)
      if (ok) *mb = byte;
    }
  }
  if constexpr (Cfg::FuseMask) {
    // the tensor's last byte (its last vector: image N - 1, pixels P·Q - 8.., channel K - 1): the rest of its
    // word, past the last element, is zero, as relu_mask leaves it -- by the thread that stored that byte
    const int64_t nbytes = (int64_t(p.M) * p.K) >> 3;
    const int last = p.K - 1 - n0 - nl0;                     // (this thread's rows: nl0 + i·RSTEP)
    if ((nbytes & 3) != 0 && okm && m0 + ml + V == p.M && last >= 0 && last < BN && last % RSTEP == 0) {
      uint8_t* const m = static_cast<uint8_t*>(const_cast<void*>(p.mask));
      for (int64_t e = nbytes; (e & 3) != 0; ++e) m[e] = 0;
    }
  }
}

// The per-tile kernel's: the whole CTA.
template <class Cfg, class P>
IGEMM_DEVICE void epilogue_regs(const P& p, float* acc, uint8_t* smem, int m0, int n0, const uint8_t* res_s = nullptr,
                                const ResidualPairs<Cfg>* pre = nullptr) {
  // A tile past the last row has nothing to store (uniform per CTA). The branch also ends the basic block
  // that holds the mainloop's last wgmma wait: with the accumulators' first reads in that block (the
  // identity chain has nothing else before them), ptxas 13.0 serialises every wgmma of the mainloop
  // (C7514) -- 3x3 512->512 @7, N=32, H100: 20 -> 34 us.
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

// One wgmma group over a stage (KSTEPS k16 steps), committed, not waited for. Each k16 step advances the A
// descriptor by ASTEP 16-byte units: 2 (+32 bytes inside the SW128 atom) or, for the no-swizzle 8-channel A
// layout, two 16-byte regions.
template <class Atom, int NACC, int KSTEPS, int ASTEP = 2>
IGEMM_DEVICE void wgmma_stage(uint64_t da, uint64_t db, float* acc) {
#pragma unroll
  for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
  cute::warpgroup_arrive();
#pragma unroll
  for (int ks = 0; ks < KSTEPS; ++ks)
    gmma_issue<Atom>(da + ASTEP * ks, db + 2 * ks, acc, std::make_index_sequence<NACC>{});
  cute::warpgroup_commit_batch();
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

// ------------------------------------------------------------------------------ TMA loads (kLoadTma)
// A stage is filled by two TMA copies that thread 0 issues: an im2col-mode copy of the BM × 64 A tile
// (x NHWC as a 4-D tensor map: BM consecutive output pixels from the tile's first one, 64 channels of
// tap (r, s) from channel c0, zeros outside the image and past the last image) and a tiled copy of the
// BN × 64 B tile (w as the K × Kred matrix). Both land in the SW128 K-major layout the wgmma
// descriptors read, and complete on the stage's mbarrier (transaction bytes). The tensor maps are
// encoded by the plan (igemm/_tma.py) and passed as __grid_constant__ parameters. No thread computes a
// gather address: the per-k-tile work is one divmod pair for (r, s, c0) in thread 0.
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
  if (load_b) tma_load_2d(b_dst, p.tmB, bar, k0, n0);
}

IGEMM_DEVICE void tma_prefetch_maps(const void* a, const void* b) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(a) : "memory");
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(b) : "memory");
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
  using Atom = typename GmmaAtom<T, Cfg::BN>::type;
  using AtomMN = typename GmmaAtom<T, Cfg::BN, gmma::Major::MN>::type;
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
      wgmma_stage<AtomMN, NACC, KSTEPS, 2048 / 16>(desc_mn_sw128(sA_u + buf * STAGE), desc_sw128(sB_u + buf * STAGE),
                                                   acc);
    else
      wgmma_stage<Atom, NACC, KSTEPS>(desc_sw128(sA_u + buf * STAGE), desc_sw128(sB_u + buf * STAGE), acc);
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
  //   grid's CTAs all reach their epilogues together: S k-tiles before the end left them ~1 us for the whole
  //   residual's DRAM reads, 3x3 128->128 @28, N=32: 6.4 MB);
  // - the staged residual (kStage), after iteration KT - S + 1, into stage (KT - S) % S, free for good from
  //   there (no k-tile left to refill it). (KT > 2·S: KT / 2 < KT - S + 1, the prefetch comes first.)
  // An iteration tests one uniform index for the next event (with both conditions tested in every iteration,
  // 3x3 256->256 @14's Add-ReLU chain spent ~16% of its warp-stall samples on them, ncu, H200). Chains
  // without a residual keep the plain loop.
#if !defined(IGEMM_NO_EPI_PROLOGUE)
  constexpr bool kPrefetch = Cfg::kRegsStore && Cfg::Epi::kResidual && std::is_same_v<Fin, FinishTile>;
#else
  constexpr bool kPrefetch = false;
#endif
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

// ------------------------------------------------------------ stream-K (IGEMM_STREAMK; the TMA kernel)
// The work is T tiles × KT k-tiles = U units; CTA b of G runs units [U·b/G, U·(b+1)/G) -- equal shares,
// so a layer whose tiles are fewer than the SMs (3x3 512->512 @7, N=32: 100 tiles of 64x128, 72 k-tiles)
// keeps every SM busy. A CTA walks its range backwards, one tile segment at a time. A tile split between
// CTAs is finished (fix-up and epilogue) by the one that ran its last k-tiles (kt1 == KT): the highest
// index, for which the tile is at the start of its range, so it reaches it last. Every other contributor
// has the tile at the end of its range, ran it first, and left its fp32 partial sums in its own workspace
// slot (one per CTA) with a flag set (release). The finisher waits for each flag (acquire; their owners
// have lower indices, so they were scheduled before it: no deadlock even when the grid exceeds the
// resident CTAs), adds the partials in fragment order and clears the flag for the next launch (graph
// replays included). Measured slower than the per-tile kernel on the H100 layers tried (3x3 512->512 @7,
// N=32: 23.9 vs 20.2 us; ncu: L2 throughput 34% -> 61%), so it is an autotune candidate, not a default.
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
  static_assert(Cfg::kTma && Cfg::kMath == kWgmma && Cfg::StoreMode == kStoreRegs,
                "stream-K: the per-tile TMA wgmma kernel with the register epilogue");
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

// ------------------------------------------------------------ persistent warp-specialised kernel (kWgmmaWs)
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
IGEMM_DEVICE void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

struct NamedSync {
  int id;
  IGEMM_DEVICE void operator()() const { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }
};

// ---- the cluster k-split (IGEMM_CSPLIT = 2, with __cluster_dims__(2, 1, 1) on the kernel)
// The two CTAs of a cluster run the same tile, each over half of the k-tiles with its own loads (no
// operand is shared); rank 1 then writes its fp32 partial sums into rank 0's shared memory (st.shared::
// cluster, behind rank 0's "xfer_empty" handshake) and arrives on rank 0's "xfer_full" barrier (release,
// cluster scope); rank 0 adds them in fragment order and runs the epilogue. Against split-K through global
// memory: no workspace, no ticket, no fence -- twice the SMs for a grid of few tiles at the cost of one
// 64 x BN fp32 hand-over in distributed shared memory.
#if defined(IGEMM_CSPLIT)
constexpr int kCsplit = IGEMM_CSPLIT;
#else
constexpr int kCsplit = 1;
#endif
static_assert(kCsplit == 1 || kCsplit == 2, "the cluster k-split pairs two CTAs");

// IGEMM_WS_CTAS (KernelSpec.ctas > 1: several CTAs an SM, the one k-tile 1x1 layers' kernel): the producer skips
// a ring slot's B copy when the slot holds that column block's B tile already, and the consumer refetches its
// channel vectors only when its column block changes (below). Compiled into that kernel only: in the one-CTA
// persistent kernels of deep reductions the same bookkeeping, even behind a branch on the k-tile count, made
// 3x3 512->512 @7 (72 k-tiles) 0.3-1.2 us slower with a residual (H200, session 20).
#if defined(IGEMM_WS_CTAS)
constexpr bool kWsBooks = true;
#else
constexpr bool kWsBooks = false;
#endif

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

template <class Cfg, class P>
IGEMM_DEVICE void fprop_ws(const P& p, uint8_t* smem) {
  using T = typename Cfg::Element;
  using Atom = typename GmmaAtom<T, Cfg::BN>::type;
  using AtomMN = typename GmmaAtom<T, Cfg::BN, gmma::Major::MN>::type;
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
    tma_prefetch_maps(p.tmA, p.tmB);
    int k0 = 0, k1 = 0;                             // stages filled so far, per consumer ring
    // kWsBooks, one k-tile a tile (a 1x1 conv over 64 channels): a slot's B tile is its column block's, and with
    // a grid that is a multiple of the column blocks each CTA keeps one, so a slot refilled with the column block
    // it holds skips that copy (H200, 1x1 64->256 @56 with BN+ReLU+mask, 3 CTAs an SM: NHWC 24.0 -> 23.0 us, NCHW
    // 27.6 -> 25.8). Deeper reductions keep no such books: the producer's per-k-tile work is on their critical
    // path (a check per k-tile cost 3x3 512->512 @7's 72 k-tiles 1.4-1.9 us).
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
        wgmma_stage<AtomMN, NACC, KSTEPS, 2048 / 16>(desc_mn_sw128(sA_u + slot * A_STAGE),
                                                     desc_sw128(sB_u + slot * B_STAGE), acc);
      else
        wgmma_stage<Atom, NACC, KSTEPS>(desc_sw128(sA_u + slot * A_STAGE), desc_sw128(sB_u + slot * B_STAGE), acc);
      cute::warpgroup_wait<1>();
#pragma unroll
      for (int j = 0; j < NACC; ++j) cute::warpgroup_fence_operand(acc[j]);
      if (prev >= 0) mbar_arrive(&empty[wg][prev]);   // the group that read it has finished
      prev = slot;
#if !defined(IGEMM_NO_EPI_PROLOGUE)
      if constexpr (Cfg::kRegsStore && Cfg::Epi::kResidual && !kStage)   // as in mainloop_wgmma_tma
        if (rank == 0 && KT > 2 * S && kt == (kb + ke) / 2) prefetch_residual_l2<Cfg, 128>(p, m0, n0, tid);
#endif
    }
    cute::warpgroup_wait<0>();
#pragma unroll
    for (int j = 0; j < NACC; ++j) cute::warpgroup_fence_operand(acc[j]);
    if (prev >= 0) mbar_arrive(&empty[wg][prev]);
    const NamedSync sync{1 + wg};
    if constexpr (kCsplit == 2) {
      // the hand-over, through rank 0's C tile (free: its previous epilogue has released it); fragment
      // order, float4 i of thread tid at (i · 128 + tid) · 16 bytes
      float4* xbuf = reinterpret_cast<float4*>(Cs);
      if (rank == 1) {
        if (done > 0) mbar_wait_cluster(&xfer[1], (done - 1) & 1);   // rank 0 has read the previous one
        const uint32_t dst = smem_in_rank(xbuf, 0);
#pragma unroll
        for (int j = 0; j < NACC / 4; ++j)
          asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst + (j * 128 + tid) * 16),
                       "f"(acc[4 * j]), "f"(acc[4 * j + 1]), "f"(acc[4 * j + 2]), "f"(acc[4 * j + 3]) : "memory");
        mbar_arrive_remote(smem_in_rank(&xfer[0], 0));
        ++done;
        continue;                                   // rank 0 stores the tile
      }
      mbar_wait_cluster(&xfer[0], done & 1);
#pragma unroll
      for (int j = 0; j < NACC / 4; ++j) {
        const float4 v = xbuf[j * 128 + tid];
        acc[4 * j] += v.x;
        acc[4 * j + 1] += v.y;
        acc[4 * j + 2] += v.z;
        acc[4 * j + 3] += v.w;
      }
      ++done;
      sync();                                       // every thread has read its partial: the epilogue may reuse Cs
    }
    if constexpr (Cfg::StoreMode == kStoreRegs) {
      epilogue_regs_by<Cfg, 128>(p, acc, reinterpret_cast<uint8_t*>(Cs), s_vec[wg], tid, m0, n0, sync,
                                 kStage ? res_s : nullptr);
    } else if constexpr (Cfg::StoreMode == kStoreRegsNCHW) {
      epilogue_regs_nchw_by<Cfg, 128>(p, acc, reinterpret_cast<uint8_t*>(Cs), s_vec[wg], tid, m0, n0, sync,
                                      kStage ? res_s : nullptr);
    } else {
      acc_to_cs_rows<Cfg>(acc, Cs, 0);
      sync();
      epilogue_store_by<Cfg, 128>(p, Cs, m0, n0, tid, s_vec[wg], sync);
    }
    sync();                                         // C tile and channel vectors free for the next tile
    if constexpr (kCsplit == 2) mbar_arrive_remote(smem_in_rank(&xfer[1], 1));   // rank 1 may hand over again
  }
  if constexpr (kCsplit == 2)
    if (rank == 1 && done > 0) mbar_wait_cluster(&xfer[1], (done - 1) & 1);   // rank 0's last arrival lands first
}

}  // namespace igemm::conv

#include "conv2d_patch.cuh"
