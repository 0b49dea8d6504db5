// igemm: implicit-GEMM conv2d forward (the cuDNN paper's design), composed from its parts:
//   conv2d_common.cuh   configuration, index mapping (magic-number division), the cp.async gather loader
//   conv2d_sm80.cuh     mma.sync tensor-op (fp16/bf16, TF32, 3xTF32) and FFMA SIMT mainloops (sm_80+)
//   conv2d_sm90.cuh     the wgmma mainloops (sm_90a): cp.async gather, or TMA (im2col-mode A, tiled B)
//   conv2d_patch.cuh    the wgmma mainloop for few-channel inputs: A built from a TMA-loaded input patch
//   conv2d_epilogue.cuh split-K reduction and the store phase (epilogue chain, ReLU mask)
// The im2col matrix is never materialised: each CTA gathers BM × BK tiles of it (and BN × BK tiles of
// the filter) into `Stages` shared-memory buffers with cp.async while earlier stages are multiplied.
//
// Launch parameters: igemm/conv2d.py (CONV_PARAMS), rendered into `struct Params` by the stub.
// Grid: (ceil(M / BM) · ceil(K / BN), 1, splits); each CTA computes the BM × BN output tile blockIdx.x
// (tile_coord: n-fastest) over the k-tiles [z · kt_per_split, min(KT, (z + 1) · kt_per_split)).
// The persistent kernel (kWgmmaWs): (min(tiles, SMs)). Stream-K (IGEMM_STREAMK): (SMs × CTAs per SM).
#pragma once
#include "conv2d_common.cuh"
#include "conv2d_epilogue.cuh"
#include "conv2d_sm80.cuh"
#if defined(IGEMM_WGMMA)
#include "conv2d_sm90.cuh"
#endif

namespace igemm::conv {

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
    if constexpr (Cfg::kTma) mainloop_wgmma_tma<Cfg>(p, smem, m0, n0, kt0, kt1);
    else if constexpr (Cfg::LoadA == kLoadPatch) mainloop_wgmma_patch<Cfg>(p, smem, m0, n0, kt0, kt1);
    else mainloop_wgmma<Cfg>(p, smem, m0, n0, kt0, kt1);
#else
    static_assert(Cfg::kMath != kWgmma, "the wgmma mainloop needs IGEMM_WGMMA (sm_90a)");
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
#else
    static_assert(Cfg::kMath != kWgmmaWs, "the persistent kernel needs IGEMM_WGMMA (sm_90a)");
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
