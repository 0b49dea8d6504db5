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

IGEMM_DEVICE void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Accumulators → shared C tile (fp32; layout per Config::kCsPixelMajor), then a barrier. Warp w of
// warpgroup wg owns rows wg*64 + w*16 + lane/4 (+8); for each 8-column block j the thread holds columns
// j*8 + 2*(lane%4) + {0, 1} (as mma.sync's C fragment). The stage buffers it overwrites must be idle.
template <class Cfg>
IGEMM_DEVICE void acc_to_cs(const float* acc, uint8_t* smem) {
  constexpr int BN = Cfg::BN;
  float* Cs = reinterpret_cast<float*>(smem);
  constexpr int LD = Cfg::kCsLd;
  const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, wg = threadIdx.x / 128;
  const int r0 = wg * 64 + w * 16 + (lane >> 2);
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
  __syncthreads();
}

// One wgmma group over a stage (KSTEPS k16 steps along the SW128 atom), committed, not waited for.
template <class Atom, int NACC, int KSTEPS>
IGEMM_DEVICE void wgmma_stage(uint64_t da, uint64_t db, float* acc) {
#pragma unroll
  for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
  cute::warpgroup_arrive();
#pragma unroll
  for (int ks = 0; ks < KSTEPS; ++ks)   // +32 bytes along K inside the swizzle atom
    gmma_issue<Atom>(da + 2 * ks, db + 2 * ks, acc, std::make_index_sequence<NACC>{});
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

  acc_to_cs<Cfg>(acc, smem);
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

template <class Cfg, class P>
IGEMM_DEVICE void mainloop_wgmma_tma(const P& p, uint8_t* smem, int m0, int n0, int kt0, int kt1) {
  using T = typename Cfg::Element;
  using Atom = typename GmmaAtom<T, Cfg::BN>::type;
  constexpr int BN = Cfg::BN, BK = Cfg::BK, S = Cfg::Stages;
  constexpr int A_STAGE = Cfg::BM * BK * 2, B_STAGE = BN * BK * 2;
  constexpr int NACC = BN / 2, KSTEPS = BK / 16;
  __shared__ alignas(8) uint64_t full[S];
  uint8_t* sA = smem;
  uint8_t* sB = smem + S * A_STAGE;
  const int KT = kt1 - kt0;
  const bool leader = threadIdx.x == 0;
  // the tile's first output pixel m0 = (n, p, q) → the input coordinate of its tap (0, 0)
  int n, pq, pp, qq;
  p.fd_PQ.divmod(n, pq, m0);
  p.fd_Q.divmod(pp, qq, pq);
  const int h0 = pp * p.sh - p.ph, w0 = qq * p.sw - p.pw;
  if (leader) {
#pragma unroll
    for (int s = 0; s < S; ++s) mbar_init(&full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(p.tmA) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(p.tmB) : "memory");
  }
  __syncthreads();
  auto issue = [&](int kt, int buf) {     // thread 0: k-tile kt (taps (r, s), channels c0..c0+63) → buf
    const int k0 = kt * BK;
    int rs, c0, r, s;
    p.fd_C.divmod(rs, c0, k0);
    p.fd_S.divmod(r, s, rs);
    mbar_expect_tx(&full[buf], A_STAGE + B_STAGE);
    tma_load_im2col_4d(sA + buf * A_STAGE, p.tmA, &full[buf], c0, w0, h0, n, uint16_t(s * p.dw), uint16_t(r * p.dh));
    tma_load_2d(sB + buf * B_STAGE, p.tmB, &full[buf], k0, n0);
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
  // Iteration i: wait for stage i's bytes → issue its wgmma group → wait until only that group is in
  // flight → barrier (stage i-1 is free in every warpgroup) → thread 0 refills it with k-tile i+S-1.
  for (int it = 0; it < KT; ++it) {
    const int buf = it % S;
    mbar_wait(&full[buf], (it / S) & 1);
    wgmma_stage<Atom, NACC, KSTEPS>(desc_sw128(sA_u + buf * A_STAGE), desc_sw128(sB_u + buf * B_STAGE), acc);
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
  acc_to_cs<Cfg>(acc, smem);
}

}  // namespace igemm::conv
