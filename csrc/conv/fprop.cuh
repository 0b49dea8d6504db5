// igemm: implicit-GEMM conv2d forward (the cuDNN paper's design), composed from its parts (csrc/conv/):
//   config.cuh              Config (tile, math, loaders, store mode, chain), its shared memory, tile order
//   gather.cuh              index mapping (magic-number division), the cp.async gather loader
//   mainloop_sm80.cuh       mma.sync tensor-op (fp16/bf16, TF32, 3xTF32) and FFMA SIMT mainloops (sm_80+)
//   epilogue_smem.cuh       split-K reduction and the fp32 C tile's store phase (epilogue chain, ReLU mask)
//   wgmma.cuh, tma.cuh      sm_90a building blocks: GMMA atoms and descriptors; TMA loads and mbarriers
//   fragment.cuh            accumulator fragments to 16-bit values, mask bytes, matrix moves, C tile layouts
//   residual.cuh            the residual prefetched, staged in shared memory or preloaded during the mainloop
//   prologue.cuh            the register epilogues' work before the mainloop (channel vectors, L2 prefetch)
//   epilogue_regs.cuh       the NHWC register epilogue (kStoreRegs)
//   epilogue_regs_nchw.cuh  the NCHW register epilogue (kStoreRegsNCHW)
//   mainloop_sm90.cuh       the per-tile wgmma mainloops: cp.async gather, or TMA (im2col-mode A, tiled B)
//   mainloop_tf32x3_sm90.cuh  strict fp32 as 3xTF32 on wgmma (cp.async gather; A's parts in registers)
//   patch.cuh               the per-tile wgmma mainloop for few-channel inputs: A built from a TMA-loaded patch
//   streamk_sm90.cuh        stream-K over the TMA mainloop (IGEMM_STREAMK)
//   persistent_sm90.cuh     the persistent warp-specialised kernel (kWgmmaWs; IGEMM_CSPLIT, IGEMM_WS_CTAS)
// The im2col matrix is never materialised: each CTA gathers BM × BK tiles of it (and BN × BK tiles of
// the filter) into `Stages` shared-memory buffers with cp.async (or TMA) while earlier stages are multiplied.
// The operands' preparation (NCHW -> NHWC transposes, channel pads, the width unfold) are separate kernels:
// transpose.cuh, unfold.cuh.
//
// Launch parameters: igemm/conv/_spec.py (CONV_PARAMS), rendered into `struct Params` by the stub. The stub's
// prelude (KernelSpec.prelude) defines IGEMM_WGMMA for the sm_90a kernels and selects a variant with
// IGEMM_STREAMK, IGEMM_CSPLIT, IGEMM_WS_CTAS or IGEMM_BN_STATS (config.cuh).
// Grid: (ceil(M / BM) · ceil(K / BN), 1, splits); each CTA computes the BM × BN output tile blockIdx.x
// (tile_coord: n-fastest) over the k-tiles [z · kt_per_split, min(KT, (z + 1) · kt_per_split)).
// The persistent kernel (kWgmmaWs): (min(tiles, SMs)). Stream-K (IGEMM_STREAMK): (SMs × CTAs per SM).
#pragma once
#include "conv/config.cuh"
#include "conv/epilogue_smem.cuh"
#include "conv/mainloop_sm80.cuh"
#if defined(IGEMM_WGMMA)
#include "conv/mainloop_sm90.cuh"
#include "conv/mainloop_tf32x3_sm90.cuh"
#include "conv/patch.cuh"
#include "conv/streamk_sm90.cuh"
#include "conv/persistent_sm90.cuh"
#endif

namespace igemm::conv {

// The combinations of a Config and the stub's macros that no kernel implements (Config itself refuses the
// combinations of its own parameters).
template <class Cfg>
struct VariantCheck {
#if !defined(IGEMM_WGMMA)
  static_assert(!Cfg::kIsWgmma, "the wgmma kernels need IGEMM_WGMMA (sm_90a)");
#endif
  static_assert(!kStreamK || (Cfg::kTma && Cfg::kMath == kWgmma && Cfg::StoreMode == kStoreRegs),
                "stream-K: the per-tile TMA wgmma kernel with the register epilogue");
  static_assert(kCsplit == 1 || (Cfg::kMath == kWgmmaWs && Cfg::WM == 1),
                "the cluster k-split: the persistent kernel with one consumer warpgroup");
  static_assert(!kWsBooks || (Cfg::kMath == kWgmmaWs && kCsplit == 1),
                "several CTAs an SM: the persistent kernel without the cluster k-split");
  static_assert(!kBnStats || (Cfg::kMath == kWgmma && Cfg::StoreMode == kStoreRegs && !kStreamK &&
                              32 % (Cfg::BN / Cfg::VecO) == 0),
                "BatchNorm statistics: the per-tile wgmma kernel's NHWC register epilogue, BN / 8 dividing 32");
  static constexpr bool value = true;
};

// One CTA per output tile (and split): the mainloop, then split-K's reduction and the store phase.
template <class Cfg, class P>
IGEMM_DEVICE void fprop_tile(const P& p, uint8_t* smem) {
  const TileCoord tc = tile_coord<Cfg>(p, blockIdx.x);
  const int m0 = tc.m0, n0 = tc.n0;
  const int KT = (p.Kred + Cfg::BK - 1) / Cfg::BK;
  const int kt0 = blockIdx.z * p.kt_per_split;
  const int kt1 = min(KT, kt0 + p.kt_per_split);
#if defined(IGEMM_WGMMA)
  if constexpr (Cfg::kRegsStore) epilogue_regs_prologue<Cfg>(p, m0, n0);
#endif
  if constexpr (Cfg::kMmaSync) {
    mainloop_tensorop<Cfg>(p, smem, m0, n0, kt0, kt1);
  } else if constexpr (Cfg::kMath == kSimt) {
    mainloop_simt<Cfg>(p, smem, m0, n0, kt0, kt1);
  } else {
#if defined(IGEMM_WGMMA)
    if constexpr (Cfg::kMath == kWgmmaTf32x3) mainloop_wgmma_tf32x3<Cfg>(p, smem, m0, n0, kt0, kt1);
    else if constexpr (Cfg::kTma) mainloop_wgmma_tma<Cfg>(p, smem, m0, n0, kt0, kt1);
    else if constexpr (Cfg::LoadA == kLoadPatch) mainloop_wgmma_patch<Cfg>(p, smem, m0, n0, kt0, kt1);
    else mainloop_wgmma<Cfg>(p, smem, m0, n0, kt0, kt1);
#endif
  }
  if constexpr (!Cfg::kRegsStore) {          // (kStoreRegs*: stored from registers, no split-K)
    float* Cs = reinterpret_cast<float*>(smem);
    if (p.splits > 1 && !splitk_reduce<Cfg>(p, Cs, blockIdx.x)) return;
    epilogue_store<Cfg>(p, Cs, m0, n0);
  }
}

template <class Cfg, class P>
__device__ void fprop(const P& p) {
  static_assert(VariantCheck<Cfg>::value);
  // a ReLU mask this kernel cannot fuse is packed by relu_mask, launched as this grid's programmatic
  // dependent: it may launch as soon as every CTA has started, and waits for this grid to finish
  if constexpr (Cfg::Epi::kMask && !Cfg::FuseMask) pdl_launch_dependents();
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* smem = smem_raw;
  if constexpr (Cfg::kAlign > 128) {   // round up (the launch reserves kAlign extra bytes)
    const uint32_t a = smem_u32(smem_raw);
    smem += (Cfg::kAlign - (a & (Cfg::kAlign - 1))) & (Cfg::kAlign - 1);
  }
  if constexpr (Cfg::kMath == kWgmmaWs) {
#if defined(IGEMM_WGMMA)
    fprop_ws<Cfg>(p, smem);
#endif
  } else {
#if defined(IGEMM_STREAMK) && defined(IGEMM_WGMMA)
    fprop_streamk<Cfg>(p, smem);
#else
    fprop_tile<Cfg>(p, smem);
#endif
  }
}

}  // namespace igemm::conv
