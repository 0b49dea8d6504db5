// igemm conv2d forward: the sm_90a warpgroup MMA building blocks -- CuTe's GMMA atoms per type and tile
// width, the shared-memory descriptors (SW128 K-major, SW128 MN-major, no-swizzle), one wgmma group per
// stage, and the accumulators' move into the fp32 C tile.
#pragma once
#include <utility>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include "conv/config.cuh"

namespace igemm::conv {

namespace gmma = cute::SM90::GMMA;

// A K-major (the default) or MN-major (kLoadTmaMN: pixels contiguous); B K-major or MN-major (kLoadTmaMN B)
template <class T, int N, gmma::Major MA = gmma::Major::K, gmma::Major MB = gmma::Major::K> struct GmmaAtom;
#define IGEMM_GMMA_ATOM(T, N, NAME) \
  template <gmma::Major MA, gmma::Major MB> struct GmmaAtom<T, N, MA, MB> { using type = gmma::NAME<MA, MB>; };
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

// MN-major, 128-byte swizzle (kLoadTmaMN's A, and its B): 64 contiguous pixels (columns) per 128-byte row, one
// row per channel (k); the 8-row core groups 1024 bytes apart (SBO), the next 64 pixels (columns) 8192 bytes on
// (LBO: a 64-row k-tile's copy), which a 64-row A tile does not use.
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

// A config's B operand: MN-major [Kred][K] tiles (kLoadTmaMN B) or K-major; its k16 step in 16-byte units
template <class Cfg>
inline constexpr gmma::Major kMajorB = Cfg::LoadB == kLoadTmaMN ? gmma::Major::MN : gmma::Major::K;
template <class Cfg>
inline constexpr int kStepB = Cfg::LoadB == kLoadTmaMN ? 2048 / 16 : 2;
template <class Cfg>
IGEMM_DEVICE uint64_t desc_b(uint32_t smem_addr) {
  if constexpr (Cfg::LoadB == kLoadTmaMN) return desc_mn_sw128(smem_addr);
  else return desc_sw128(smem_addr);
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

// One wgmma group over a stage (KSTEPS k16 steps), committed, not waited for. Each k16 step advances the A
// descriptor by ASTEP 16-byte units: 2 (+32 bytes inside the SW128 atom) or, for the no-swizzle 8-channel A
// layout, two 16-byte regions; the B descriptor by BSTEP (MN-major: 16 rows of 128 bytes).
template <class Atom, int NACC, int KSTEPS, int ASTEP = 2, int BSTEP = 2>
IGEMM_DEVICE void wgmma_stage(uint64_t da, uint64_t db, float* acc) {
#pragma unroll
  for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
  cute::warpgroup_arrive();
#pragma unroll
  for (int ks = 0; ks < KSTEPS; ++ks)
    gmma_issue<Atom>(da + ASTEP * ks, db + BSTEP * ks, acc, std::make_index_sequence<NACC>{});
  cute::warpgroup_commit_batch();
}

}  // namespace igemm::conv
