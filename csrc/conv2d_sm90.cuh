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
#pragma unroll
    for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks)   // +32 bytes along K inside the swizzle atom
      gmma_issue<Atom>(da + 2 * ks, db + 2 * ks, acc, std::make_index_sequence<NACC>{});
    cute::warpgroup_commit_batch();
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

  // accumulators → shared C tile. Warp w of the warpgroup owns rows w*16 + lane/4 (+8); for each
  // 8-column block j the thread holds columns j*8 + 2*(lane%4) + {0, 1} (as mma.sync's C fragment).
  float* Cs = reinterpret_cast<float*>(smem);
  constexpr int LD = Cfg::kCsLd;
  const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3;
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

}  // namespace igemm::conv
