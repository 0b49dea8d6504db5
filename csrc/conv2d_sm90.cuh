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

template <class T, int N> struct GmmaAtom;
#define IGEMM_GMMA_ATOM(T, N, NAME) \
  template <> struct GmmaAtom<T, N> { using type = gmma::NAME<gmma::Major::K, gmma::Major::K>; };
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

template <class Cfg, class P>
IGEMM_DEVICE void epilogue_regs_prologue(const P& p, int m0, int n0) {
#if !defined(IGEMM_NO_EPI_PROLOGUE)
  using Epi = typename Cfg::Epi;
  constexpr int BN = Cfg::BN, BM = Cfg::BM, NT = Cfg::kThreads;
  if constexpr (kEarlyVectors<Cfg>) {
    float (*s_vec)[BN] = regs_channel_vectors<BN>();
    const float* src[3] = {static_cast<const float*>(p.scale), static_cast<const float*>(p.shift),
                           static_cast<const float*>(p.alpha)};
    const float dflt[3] = {1.f, 0.f, 0.f};
    for (int i = threadIdx.x; i < BN; i += NT) {
      const int n = min(n0 + i, p.K - 1);
#pragma unroll
      for (int v = 0; v < 3; ++v) {
        if (src[v]) cp_async_zfill<4>(&s_vec[v][i], src[v] + n, true);
        else s_vec[v][i] = dflt[v];
      }
    }
    cp_async_commit();
  }
  if constexpr (Epi::kResidual) {
    if ((p.Kred + Cfg::BK - 1) / Cfg::BK > 2 * Cfg::Stages) return;   // (no split-K here)
    using RT = typename Epi::Res;
    constexpr int LPR = (BN * int(sizeof(RT)) + 127) / 128;     // 128-byte lines per tile row
    const RT* res = static_cast<const RT*>(p.residual);
    const int cols = min(BN, p.K - n0), rows = min(BM, p.M - m0);
    for (int i = threadIdx.x; i < rows * LPR; i += NT) {
      const int r = i / LPR, c = min((i % LPR) * (128 / int(sizeof(RT))), cols - 1);
      asm volatile("prefetch.global.L2 [%0];\n" ::"l"(res + int64_t(m0 + r) * p.K + n0 + c));
    }
  }
#endif
}

// 0xFFFF in each 16-bit half of the result whose stored value is > 0 (false for ±0 and NaN): one set.gt
// on the packed pair, so the mask bit is exactly (stored y > 0).
template <class TO>
IGEMM_DEVICE uint32_t gt0_pair(const epi::Vec<TO, 2>& o) {
  static_assert(sizeof(TO) == 2, "16-bit outputs");
  const uint32_t u = *reinterpret_cast<const uint32_t*>(&o);
  uint32_t r;
  if constexpr (std::is_same_v<TO, cutlass::bfloat16_t>)
    asm("set.gt.u32.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(u), "r"(0u));
  else
    asm("set.gt.u32.f16x2 %0, %1, %2;" : "=r"(r) : "r"(u), "r"(0u));
  return r;
}

// Bits jj and 16 + jj (jj < 4: the pair of 8-column block jj) → bits 8·jj + 2q and 8·jj + 2q + 1 of the
// row's mask word (q = lane % 4: the pair's first column in the block is 2q). v · 0x204081 puts bit jj of a
// 4-bit v at jj + 7·k for k < 4, all 16 positions distinct (no carries); k = jj is the wanted 8·jj.
IGEMM_DEVICE uint32_t pair_bits_to_word(uint32_t b, int q) {
  const uint32_t lo = ((b & 0xFu) * 0x204081u) & 0x01010101u;
  const uint32_t hi = (((b >> 16) & 0xFu) * 0x204081u) & 0x01010101u;
  return (lo | (hi << 1)) << (2 * q);
}

// The register epilogue (kStoreRegs: NHWC output, no split-K), called where acc_to_cs would be (every
// stage read): the chain runs on the accumulators in registers (channels from the fragment layout; the
// residual's element pairs at the fragment's positions, four column blocks' worth loaded ahead),
// each value is rounded once into a 16-bit C tile in shared memory (BN + 8 elements a row: the fragment
// writes are conflict-free), the ReLU mask words are assembled in registers (one set.gt per stored pair;
// a quad of lanes holds 32 consecutive channels of a row: two shuffles; FuseMask needs K % 32 == 0) and
// stored by the quad's first lane, and the tile leaves in 16-byte vectors. Against the fp32 C tile: half
// the shared-memory bytes, and no index math, chain or mask work per vector in the store loop.
template <class Cfg, class P>
IGEMM_DEVICE void epilogue_regs(const P& p, float* acc, uint8_t* smem, int m0, int n0) {
  using TO = typename Cfg::ElementOut;
  using Epi = typename Cfg::Epi;
  constexpr int BN = Cfg::BN, BM = Cfg::BM, LDH = BN + 8, V = Cfg::VecO, CPR = BN / V;
  float (*s_vec)[BN] = regs_channel_vectors<BN>();
  const int tid = threadIdx.x;
  // A tile past the last row has nothing to store (uniform per CTA). The branch also ends the basic block
  // that holds the mainloop's last wgmma wait: with the accumulators' first reads in that block (the
  // identity chain has nothing else before them), ptxas 13.0 serialises every wgmma of the mainloop
  // (C7514) -- 3x3 512->512 @7, N=32, H100: 20 -> 34 us.
  if (m0 >= p.M) return;
  if constexpr (kEarlyVectors<Cfg>) cp_async_wait<0>();      // the prologue's channel vectors
  else if constexpr (!Epi::kEmpty) stage_channel_vectors<BN, Cfg::kThreads>(p, n0, tid, s_vec);
  __syncthreads();
  const epi::Ctx ctx{s_vec[0], s_vec[1], s_vec[2], p.alpha_scalar};
  TO* ct = reinterpret_cast<TO*>(smem);
  uint32_t* mask = static_cast<uint32_t*>(const_cast<void*>(p.mask));
  const int lane = tid & 31;
  const int r0 = (tid >> 7) * 64 + ((tid >> 5) & 3) * 16 + (lane >> 2);
  using RT = std::conditional_t<Epi::kResidual, typename Epi::Res, TO>;
  const RT* resp = static_cast<const RT*>(p.residual);
  const bool ok0 = m0 + r0 < p.M, ok1 = m0 + r0 + 8 < p.M;
  const int64_t row0 = int64_t(m0 + r0) * p.K + n0, row1 = row0 + int64_t(8) * p.K;
  constexpr int G = 4;                  // column blocks per group: their residual pairs are loaded first
  static_assert((BN / 8) % G == 0, "BN / 8 blocks in groups of 4 (one mask word)");
  uint32_t bits0 = 0, bits1 = 0;        // the 32-column mask word being assembled, rows r0 and r0 + 8
#pragma unroll
  for (int j0 = 0; j0 < BN / 8; j0 += G) {
    epi::Vec<RT, 2> ra[G], rb[G];
    if constexpr (Epi::kResidual) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const int c = (j0 + g) * 8 + 2 * (lane & 3);
        const bool okc = n0 + c < p.K;
        ra[g].v[0] = ra[g].v[1] = rb[g].v[0] = rb[g].v[1] = RT(0.f);
        if (ok0 && okc) ra[g] = *reinterpret_cast<const epi::Vec<RT, 2>*>(resp + row0 + c);
        if (ok1 && okc) rb[g] = *reinterpret_cast<const epi::Vec<RT, 2>*>(resp + row1 + c);
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int j = j0 + g;
      const int c = j * 8 + 2 * (lane & 3);
      float v[4] = {acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]};
      const int ch[4] = {c, c + 1, c, c + 1};
      float res[4] = {0.f, 0.f, 0.f, 0.f};
      if constexpr (Epi::kResidual) {
        res[0] = to_float(ra[g].v[0]);
        res[1] = to_float(ra[g].v[1]);
        res[2] = to_float(rb[g].v[0]);
        res[3] = to_float(rb[g].v[1]);
      }
      Epi::template apply<4, epi::kChPairs>(v, ch, res, ctx);
      epi::Vec<TO, 2> o0, o1;
      o0.v[0] = from_float<TO>(v[0]);
      o0.v[1] = from_float<TO>(v[1]);
      o1.v[0] = from_float<TO>(v[2]);
      o1.v[1] = from_float<TO>(v[3]);
      *reinterpret_cast<epi::Vec<TO, 2>*>(ct + r0 * LDH + c) = o0;
      *reinterpret_cast<epi::Vec<TO, 2>*>(ct + (r0 + 8) * LDH + c) = o1;
      if constexpr (Cfg::FuseMask) {
        // (stored value > 0) of the pair, as bits jj and 16 + jj (jj = j % 4) ...
        const uint32_t sel = 0x00010001u << (j & 3);
        bits0 |= gt0_pair<TO>(o0) & sel;
        bits1 |= gt0_pair<TO>(o1) & sel;
        if ((j & 3) == 3) {                 // columns (j - 3) * 8 .. j * 8 + 7: one word per row
          // ... moved to bits 8·jj + 2·(lane % 4) + {0, 1} of the word, then OR-ed over the quad
          bits0 = pair_bits_to_word(bits0, lane & 3);
          bits1 = pair_bits_to_word(bits1, lane & 3);
          bits0 |= __shfl_xor_sync(0xffffffffu, bits0, 1);
          bits0 |= __shfl_xor_sync(0xffffffffu, bits0, 2);
          bits1 |= __shfl_xor_sync(0xffffffffu, bits1, 1);
          bits1 |= __shfl_xor_sync(0xffffffffu, bits1, 2);
          const int n = n0 + (j - 3) * 8, m = m0 + r0;
          if ((lane & 3) == 0 && n < p.K) {
            if (m < p.M) mask[(int64_t(m) * p.K + n) >> 5] = bits0;
            if (m + 8 < p.M) mask[(int64_t(m + 8) * p.K + n) >> 5] = bits1;
          }
          bits0 = bits1 = 0;
        }
      }
    }
  }
  __syncthreads();
  TO* y = static_cast<TO*>(const_cast<void*>(p.y));
  const int rows = min(BM, p.M - m0);
#pragma unroll 4
  for (int v = tid; v < BM * CPR; v += Cfg::kThreads) {
    const int row = v / CPR, col = (v % CPR) * V;
    if (row < rows && n0 + col < p.K)
      *reinterpret_cast<uint4*>(y + int64_t(m0 + row) * p.K + n0 + col) =
          *reinterpret_cast<const uint4*>(ct + row * LDH + col);
  }
}

template <class Cfg, class P>
IGEMM_DEVICE void finish_tile(const P& p, float* acc, uint8_t* smem, int m0, int n0) {
  if constexpr (Cfg::StoreMode == kStoreRegs) epilogue_regs<Cfg>(p, acc, smem, m0, n0);
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
// on `bar` (the expected bytes are set first).
template <class Cfg, class P>
IGEMM_DEVICE void tma_issue_stage(const P& p, uint8_t* a_dst, uint8_t* b_dst, uint64_t* bar, int kt,
                                  const TileOrigin& o, int n0) {
  constexpr int BK = Cfg::BK;
  const int k0 = kt * BK;
  int rs, c0, r, s;
  p.fd_C.divmod(rs, c0, k0);
  p.fd_S.divmod(r, s, rs);
  mbar_expect_tx(bar, (Cfg::BM + Cfg::BN) * BK * 2);
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
  } else {
    tma_load_im2col_4d(a_dst, p.tmA, bar, c0, o.w0, o.h0, o.n, uint16_t(s * p.dw), uint16_t(r * p.dh));
  }
  tma_load_2d(b_dst, p.tmB, bar, k0, n0);
}

IGEMM_DEVICE void tma_prefetch_maps(const void* a, const void* b) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(a) : "memory");
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(b) : "memory");
}

template <class Cfg, class P>
IGEMM_DEVICE void mainloop_wgmma_tma(const P& p, uint8_t* smem, int m0, int n0, int kt0, int kt1) {
  using T = typename Cfg::Element;
  using Atom = typename GmmaAtom<T, Cfg::BN>::type;
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
  if (leader) {
#pragma unroll
    for (int s = 0; s < S; ++s) mbar_init(&full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    tma_prefetch_maps(p.tmA, p.tmB);
  }
  __syncthreads();
  auto issue = [&](int kt, int buf) {     // thread 0
    tma_issue_stage<Cfg>(p, sA + buf * STAGE, sB + buf * STAGE, &full[buf], kt, o, n0);
  };
  if (leader) {
#pragma unroll
    for (int st = 0; st < S - 1; ++st)
      if (st < KT) issue(kt0 + st, st);
  }
  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
  const uint32_t sA_u = smem_u32(sA) + (threadIdx.x / 128) * 64 * 128, sB_u = smem_u32(sB);
  const uint32_t sA8 = smem_u32(sA) + (threadIdx.x / 128) * 64 * 16;   // kLoadTmaC8: rows of a region are 16 B
  // Iteration i: wait for stage i's bytes → issue its wgmma group → wait until only that group is in
  // flight → barrier (stage i-1 is free in every warpgroup) → thread 0 refills it with k-tile i+S-1.
  for (int it = 0; it < KT; ++it) {
    const int buf = it % S;
    mbar_wait(&full[buf], (it / S) & 1);
    if constexpr (Cfg::LoadA == kLoadTmaC8)   // A: 8 regions of BM 16-byte rows; this warpgroup's rows
      wgmma_stage<Atom, NACC, KSTEPS, 2 * Cfg::BM>(desc_interleave(sA8 + buf * STAGE, Cfg::BM * 16, 128),
                                                    desc_sw128(sB_u + buf * STAGE), acc);
    else
      wgmma_stage<Atom, NACC, KSTEPS>(desc_sw128(sA_u + buf * STAGE), desc_sw128(sB_u + buf * STAGE), acc);
    cute::warpgroup_wait<1>();
#pragma unroll
    for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
    __syncthreads();
    const int nk = it + S - 1;
    if (leader && nk < KT) issue(kt0 + nk, nk % S);
  }
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
  __syncthreads();                        // every stage read: the C tile may overwrite them
  finish_tile<Cfg>(p, acc, smem, m0, n0);
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
IGEMM_DEVICE void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

struct NamedSync {
  int id;
  IGEMM_DEVICE void operator()() const { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }
};

template <class Cfg, class P>
IGEMM_DEVICE void fprop_ws(const P& p, uint8_t* smem) {
  using T = typename Cfg::Element;
  using Atom = typename GmmaAtom<T, Cfg::BN>::type;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, S = Cfg::Stages, NC = Cfg::WM;
  constexpr int A_STAGE = BM * BK * 2, B_STAGE = BN * BK * 2, RING = S * (A_STAGE + B_STAGE);
  constexpr int NACC = BN / 2, KSTEPS = BK / 16;
  static_assert(NC == 2 && Cfg::LoadA == kLoadTma, "two consumer warpgroups, 64-channel TMA k-tiles");
  __shared__ alignas(8) uint64_t full[NC][S], empty[NC][S];
  __shared__ __align__(16) float s_vec[NC][3][BN];
  const int TM = (p.M + BM - 1) / BM, NT = TM * ((p.K + BN - 1) / BN);   // tiles
  const int KT = (p.Kred + BK - 1) / BK;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
      for (int s = 0; s < S; ++s) {
        mbar_init(&full[c][s], 1);
        mbar_init(&empty[c][s], 128);
      }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == NC) {                                   // the producer warp
    if ((threadIdx.x & 31) != 0) return;
    tma_prefetch_maps(p.tmA, p.tmB);
    int k0 = 0, k1 = 0;                             // stages filled so far, per consumer ring
    for (int i = 0;; ++i) {
      const int t = blockIdx.x + i * gridDim.x;
      if (t >= NT) break;
      const int c = i & 1;
      const auto [m0, n0] = tile_coord<Cfg>(p, t);
      const TileOrigin o = tile_origin(p, m0);
      uint8_t* ring = smem + c * RING;
      int k = c ? k1 : k0;
      for (int kt = 0; kt < KT; ++kt, ++k) {
        const int slot = k % S;
        mbar_wait(&empty[c][slot], ((k / S) & 1) ^ 1);   // a fresh barrier counts as emptied once
        tma_issue_stage<Cfg>(p, ring + slot * A_STAGE, ring + S * A_STAGE + slot * B_STAGE, &full[c][slot], kt, o, n0);
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
  int k = 0;
  for (int i = wg;; i += NC) {
    const int t = blockIdx.x + i * gridDim.x;
    if (t >= NT) break;
    const auto [m0, n0] = tile_coord<Cfg>(p, t);
    float acc[NACC];
#pragma unroll
    for (int j = 0; j < NACC; ++j) acc[j] = 0.f;
    int prev = -1;
    for (int kt = 0; kt < KT; ++kt, ++k) {
      const int slot = k % S;
      mbar_wait(&full[wg][slot], (k / S) & 1);
      wgmma_stage<Atom, NACC, KSTEPS>(desc_sw128(sA_u + slot * A_STAGE), desc_sw128(sB_u + slot * B_STAGE), acc);
      cute::warpgroup_wait<1>();
#pragma unroll
      for (int j = 0; j < NACC; ++j) cute::warpgroup_fence_operand(acc[j]);
      if (prev >= 0) mbar_arrive(&empty[wg][prev]);   // the group that read it has finished
      prev = slot;
    }
    cute::warpgroup_wait<0>();
#pragma unroll
    for (int j = 0; j < NACC; ++j) cute::warpgroup_fence_operand(acc[j]);
    mbar_arrive(&empty[wg][prev]);
    acc_to_cs_rows<Cfg>(acc, Cs, 0);
    const NamedSync sync{1 + wg};
    sync();
    epilogue_store_by<Cfg, 128>(p, Cs, m0, n0, tid, s_vec[wg], sync);
    sync();                                         // C tile and channel vectors free for the next tile
  }
}

}  // namespace igemm::conv

#include "conv2d_patch.cuh"
