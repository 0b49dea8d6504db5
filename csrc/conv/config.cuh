// igemm conv2d forward: the kernel configuration (Config: tile shape, math, loaders, store mode, epilogue
// chain), its shared-memory budget and the static_asserts on combinations no kernel implements, and the
// output-tile order.
//
// GEMM view: M = N·P·Q (output pixels), N = K (output channels), Kred = C·R·S, reduction order
// (r, s, c) for NHWC and (c, r, s) for NCHW, so the filter is a plain row-major K × Kred matrix in both
// layouts. The output layout follows the store mode (kStoreNCHW, kStoreRegsNCHW: NCHW, else NHWC).
#pragma once
#include "common.cuh"
#include "epilogues.cuh"

namespace igemm::conv {

enum : int { kNCHW = 0, kNHWC = 1 };
// kWgmmaWs (sm_90a, TMA loads only): the persistent warp-specialised kernel: WM (1 or 2) consumer warpgroups, each
// computing its own BM × BN tiles (BM = 64), and one producer warp issuing their TMA loads (persistent_sm90.cuh).
// kTensorOp3 (fp32 only): the kTensorOp mainloop with each operand split into two TF32 parts, big + small,
// and three MMAs per product (small·big + big·small + big·big): fp32 accuracy on tensor cores (mainloop_sm80.cuh).
// kWgmmaTf32x3 (sm_90a, fp32, gathered loads): the same split on warpgroup MMAs, WM warpgroups of 64 rows, A's
// parts in registers and B's in shared memory (mainloop_tf32x3_sm90.cuh).
enum : int { kTensorOp = 0, kSimt = 1, kWgmma = 2, kWgmmaWs = 3, kTensorOp3 = 4, kWgmmaTf32x3 = 5 };
// kLoadTma (sm_90a wgmma only): one thread loads each stage with two TMA copies, the im2col-mode one for
// A (NHWC, C % 64 == 0) and a tiled one for B, completing on an mbarrier (tma.cuh).
// kLoadTmaC8: the A side of kLoadTma for 8-channel inputs (16-bit C padded to 8): a k-tile is 8 taps, one
// im2col copy each, into 8 BM × 16-byte regions (the wgmma no-swizzle K-major layout).
// kLoadPatch (sm_90a wgmma, few-channel NHWC x, with kLoadVec B): the CTA's input patch arrives once by TMA
// and each A k-tile is built from it in shared memory -- the width unfold on the fly (patch.cuh).
// kLoadTmaMN (sm_90a wgmma, with kLoadTma B): NCHW x of a 1x1 stride-1 unpadded conv with H·W % 64 == 0 and
// C % 64 == 0: the A tile is a tiled TMA copy of x as [N][C][H·W] (64 pixels × 64 channels, pixels
// contiguous), multiplied as an MN-major operand -- the NCHW input needs no transpose. As the B load (with
// kLoadTmaMN or kLoadTma A): w given as [Kred][K] (a 1x1 filter transposed: dgrad's), 64 k-rows × 64 columns a
// copy, an MN-major operand too -- dgrad's filter needs no transpose either.
enum : int { kLoadVec = 0, kLoadElem = 1, kLoadTma = 2, kLoadTmaC8 = 3, kLoadPatch = 4, kLoadTmaMN = 5 };
// kStoreRegs (sm_90a wgmma, NHWC output, no split-K): the chain runs on the accumulators in
// registers and a 16-bit C tile leaves shared memory in 16-byte vectors (epilogue_regs.cuh).
// kStoreRegsNCHW: the same for NCHW outputs (16-bit residuals staged in the C tile): a channel-major
// 16-bit C tile leaves in vectors along each channel's pixels (epilogue_regs_nchw.cuh).
enum : int { kStoreRows = 0, kStoreLinear = 1, kStoreNCHW = 2, kStoreRegs = 3, kStoreRegsNCHW = 4 };

// The kernel variants the stub's prelude selects (KernelSpec.prelude): stream-K (streamk_sm90.cuh); the
// persistent kernel's cluster k-split over kCsplit = 2 CTAs and its bookkeeping for several CTAs an SM
// (persistent_sm90.cuh); the BatchNorm statistics. fprop.cuh refuses them with a Config they do not fit.
#if defined(IGEMM_STREAMK)
constexpr bool kStreamK = true;
#else
constexpr bool kStreamK = false;
#endif
#if defined(IGEMM_CSPLIT)
constexpr int kCsplit = IGEMM_CSPLIT;
#else
constexpr int kCsplit = 1;
#endif
static_assert(kCsplit == 1 || kCsplit == 2, "the cluster k-split pairs two CTAs");
#if defined(IGEMM_WS_CTAS)
constexpr bool kWsBooks = true;
#else
constexpr bool kWsBooks = false;
#endif
// IGEMM_BN_STATS: the register epilogue also writes the output's per-tile BatchNorm statistics to p.ws
// (epilogue_regs.cuh: tile_bn_stats; the training forward reads them instead of a statistics pass over y).
#if defined(IGEMM_BN_STATS)
constexpr bool kBnStats = true;
#else
constexpr bool kBnStats = false;
#endif

template <class Element_, class ElementOut_, int Layout_, int Math_, int BM_, int BN_, int BK_, int WM_,
          int WN_, int Stages_, int LoadA_, int LoadB_, int StoreMode_, int VecO_, bool FuseMask_, class Epi_>
struct Config {
  using Element = Element_;
  using ElementOut = ElementOut_;
  using Epi = Epi_;
  static constexpr int kLayout = Layout_, kMath = Math_, BM = BM_, BN = BN_, BK = BK_, WM = WM_, WN = WN_;
  static constexpr int Stages = Stages_, LoadA = LoadA_, LoadB = LoadB_, StoreMode = StoreMode_;
  static constexpr int VecO = VecO_;
  static constexpr bool FuseMask = FuseMask_;
  // kTensorOp, kTensorOp3: WM × WN warps; kWgmma: WM warpgroups along M (64 rows each), one along N; kSimt: 256.
  static constexpr bool kMmaSync = Math_ == kTensorOp || Math_ == kTensorOp3;
  static constexpr int kThreads = kMmaSync ? WM * WN * 32
                                 : Math_ == kWgmma || Math_ == kWgmmaTf32x3 ? WM * 128
                                 : Math_ == kWgmmaWs ? WM * 128 + 32 : 256;
  static constexpr int EB = sizeof(Element);
  static constexpr int CE = 16 / EB;               // elements per 16-byte chunk
  // shared-memory C tile (fp32), padded against bank conflicts: pixel-major (BM rows of BN channels) for
  // NHWC outputs, channel-major (BN rows of BM pixels) for NCHW outputs. The output layout is the store
  // mode's, independent of the input's: an NHWC gather may store NCHW (igemm/conv/_paths.py: the transpose path).
  static constexpr bool kNchwOut = StoreMode_ == kStoreNCHW || StoreMode_ == kStoreRegsNCHW;
  static constexpr bool kRegsStore = StoreMode_ == kStoreRegs || StoreMode_ == kStoreRegsNCHW;
  static constexpr bool kCsPixelMajor = !kNchwOut;
  static constexpr int kCsPad = kCsPixelMajor ? 8 : 4;
  static constexpr int kCsLd = kCsPixelMajor ? BN + kCsPad : BM + kCsPad;
  // kWgmmaWs with a register epilogue, no residual and no cluster k-split: the C tile at the size the register
  // epilogue writes (16-bit values; NCHW: BN rows of at most BM + 8 pixels, then the mask words), not the fp32
  // tile's -- room for a third CTA an SM (ctas). A staged residual and the k-split's fp32 hand-over need the rest.
  static constexpr bool kCsCompact = Math_ == kWgmmaWs && kRegsStore && !Epi::kResidual && kCsplit == 1;
  static constexpr int kCsBytes = kCsCompact ? (kNchwOut ? BN * (BM + 8) * 2 + BN * (BM / 32) * 4 : BM * (BN + 8) * 2)
                                             : (kCsPixelMajor ? BM : BN) * kCsLd * 4;
  // (kWgmmaTf32x3: and B's small parts, double-buffered, and its cross parts)
  static constexpr int kMainBytes = Stages * (BM + BN) * BK * (Math_ == kSimt ? 4 : EB)
                                    + (Math_ == kWgmmaTf32x3 ? 3 * BN * BK * EB : 0);
  static constexpr bool kIsWgmma = Math_ == kWgmma || Math_ == kWgmmaWs || Math_ == kWgmmaTf32x3;
  static constexpr int kAlign = kIsWgmma ? 1024 : 128;   // SW128 atoms need 1024-byte alignment
  // kWgmmaWs: per consumer warpgroup its own stage ring and C tile (the producer refills the ring while the
  // consumer's epilogue reads its C tile), rings first (1024-aligned stages)
  static constexpr int kSmemBytes = (Math_ == kWgmmaWs ? WM * (kMainBytes + kCsBytes)
                                                        : (kMainBytes > kCsBytes ? kMainBytes : kCsBytes)) + kAlign;
  static_assert(Stages >= 2, "at least double buffering");
  static_assert((VecO & (VecO - 1)) == 0 && VecO * sizeof(ElementOut) <= 16, "output vectors: 2^i elements, <= 16 bytes");
  static_assert(!FuseMask || Epi::kMask, "mask fusion needs a ReLU(mask=True) in the chain");
  static_assert(kNchwOut || kLayout == kNHWC, "row/linear (NHWC) stores need an NHWC input");
  static_assert(StoreMode != kStoreRegs || (kIsWgmma && VecO * sizeof(ElementOut) == 16 && sizeof(ElementOut) == 2),
                "register epilogue: the wgmma kernels, 16-bit outputs in 16-byte vectors");
  static_assert(StoreMode != kStoreRegsNCHW || (kIsWgmma && sizeof(ElementOut) == 2 && (!FuseMask || VecO == 8)),
                "NCHW register epilogue: the wgmma kernels, 16-bit outputs, masks from 8-pixel vectors");
  static constexpr bool kTma = LoadA_ == kLoadTma || LoadA_ == kLoadTmaC8 || LoadA_ == kLoadTmaMN;
  static_assert(LoadA_ != kLoadTmaMN || (Layout_ == kNCHW && BM_ == 64 && kIsWgmma && WM_ == 1 && kNchwOut),
                "MN-major TMA A tiles: NCHW x, one 64-row warpgroup, the NCHW store");
  static_assert(kTma == (LoadB_ == kLoadTma || LoadB_ == kLoadTmaMN) &&
                    (!kTma || (kIsWgmma && (Layout_ == kNHWC || LoadA_ == kLoadTmaMN))),
                "TMA loads: both operands, wgmma, NHWC");
  static_assert(LoadB_ != kLoadTmaMN || ((LoadA_ == kLoadTmaMN || LoadA_ == kLoadTma) && BN_ <= 128),
                "MN-major TMA B tiles (w as [Kred][K]): with one-tap A tiles, at most two 64-column groups");
  static_assert(Math_ != kWgmmaWs || ((LoadA_ == kLoadTma || LoadA_ == kLoadTmaMN) && BM == 64),
                "the persistent kernel: TMA loads, 64-row tiles");
  static_assert(LoadA_ != kLoadPatch || (Math_ == kWgmma && Layout_ == kNHWC && LoadB_ == kLoadVec),
                "patch loads: the per-tile wgmma kernel, NHWC x, a gathered filter");
  static_assert(!kIsWgmma || ((EB == 2) != (Math_ == kWgmmaTf32x3) && BK * EB == 128 && BM % 64 == 0 &&
                               BN % 64 == 0 && BN <= 256),
                "wgmma: 16-bit operands (fp32 for 3xTF32), 128-byte K rows (SW128), 64-row warpgroups, BN in "
                "{64,128,192,256}");
  static_assert(Math_ != kWgmmaTf32x3 ||
                    (EB == 4 && !kTma && LoadA_ != kLoadPatch && (BN == 64 || BN == 128) && !kRegsStore),
                "3xTF32 wgmma: fp32, gathered loads, BN 64 or 128, the fp32 C tile's store");
};

IGEMM_DEVICE uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// Output tile t (of ceil(M / BM) · ceil(K / BN)) → its first row and column. n-fastest: the ceil(K / BN)
// tiles of one row block are consecutive, so CTAs in flight together read the same A rows (the
// activations, the large operand) and a 1x1 layer's input leaves DRAM once, not once per column block.
struct TileCoord {
  int m0, n0;
};

template <class Cfg, class P>
IGEMM_DEVICE TileCoord tile_coord(const P& p, int t) {
  const int TN = (p.K + Cfg::BN - 1) / Cfg::BN;
  return {(t / TN) * Cfg::BM, (t % TN) * Cfg::BN};
}

}  // namespace igemm::conv
