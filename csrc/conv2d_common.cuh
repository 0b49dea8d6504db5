// igemm conv2d forward: configuration, index mapping and the shared-memory gather loader.
//
// GEMM view: M = N·P·Q (output pixels), N = K (output channels), Kred = C·R·S, reduction order
// (r, s, c) for NHWC and (c, r, s) for NCHW, so the filter is a plain row-major K × Kred matrix in both
// layouts. The output layout follows the store mode (kStoreNCHW, kStoreRegsNCHW: NCHW, else NHWC). m → (n, p, q) and k → (r, s, c) use magic-number division (igemm::FastDiv).
#pragma once
#include "common.cuh"
#include "epilogues.cuh"

namespace igemm::conv {

enum : int { kNCHW = 0, kNHWC = 1 };
// kWgmmaWs (sm_90a, TMA loads only): the persistent warp-specialised kernel: WM (1 or 2) consumer warpgroups, each
// computing its own BM × BN tiles (BM = 64), and one producer warp issuing their TMA loads (conv2d_sm90.cuh).
// kTensorOp3 (fp32 only): the kTensorOp mainloop with each operand split into two TF32 parts, big + small,
// and three MMAs per product (small·big + big·small + big·big): fp32 accuracy on tensor cores (conv2d_sm80.cuh).
enum : int { kTensorOp = 0, kSimt = 1, kWgmma = 2, kWgmmaWs = 3, kTensorOp3 = 4 };
// kLoadTma (sm_90a wgmma only): one thread loads each stage with two TMA copies, the im2col-mode one for
// A (NHWC, C % 64 == 0) and a tiled one for B, completing on an mbarrier (conv2d_sm90.cuh).
// kLoadTmaC8: the A side of kLoadTma for 8-channel inputs (16-bit C padded to 8): a k-tile is 8 taps, one
// im2col copy each, into 8 BM × 16-byte regions (the wgmma no-swizzle K-major layout).
// kLoadPatch (sm_90a wgmma, few-channel NHWC x, with kLoadVec B): the CTA's input patch arrives once by TMA
// and each A k-tile is built from it in shared memory -- the width unfold on the fly (conv2d_patch.cuh).
// kLoadTmaMN (sm_90a wgmma, with kLoadTma B): NCHW x of a 1x1 stride-1 unpadded conv with H·W % 64 == 0 and
// C % 64 == 0: the A tile is a tiled TMA copy of x as [N][C][H·W] (64 pixels × 64 channels, pixels
// contiguous), multiplied as an MN-major operand -- the NCHW input needs no transpose.
enum : int { kLoadVec = 0, kLoadElem = 1, kLoadTma = 2, kLoadTmaC8 = 3, kLoadPatch = 4, kLoadTmaMN = 5 };
// kStoreRegs (sm_90a wgmma, NHWC output, no split-K): the chain runs on the accumulators in
// registers and a 16-bit C tile leaves shared memory in 16-byte vectors (conv2d_sm90.cuh, epilogue_regs).
// kStoreRegsNCHW: the same for NCHW outputs (16-bit residuals staged in the C tile): a channel-major
// 16-bit C tile leaves in vectors along each channel's pixels (epilogue_regs_nchw_by).
enum : int { kStoreRows = 0, kStoreLinear = 1, kStoreNCHW = 2, kStoreRegs = 3, kStoreRegsNCHW = 4 };

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
                                 : Math_ == kWgmma ? WM * 128 : Math_ == kWgmmaWs ? WM * 128 + 32 : 256;
  static constexpr int EB = sizeof(Element);
  static constexpr int CE = 16 / EB;               // elements per 16-byte chunk
  // shared-memory C tile (fp32), padded against bank conflicts: pixel-major (BM rows of BN channels) for
  // NHWC outputs, channel-major (BN rows of BM pixels) for NCHW outputs. The output layout is the store
  // mode's, independent of the input's: an NHWC gather may store NCHW (igemm/conv2d.py's transpose path).
  static constexpr bool kNchwOut = StoreMode_ == kStoreNCHW || StoreMode_ == kStoreRegsNCHW;
  static constexpr bool kRegsStore = StoreMode_ == kStoreRegs || StoreMode_ == kStoreRegsNCHW;
  static constexpr bool kCsPixelMajor = !kNchwOut;
  static constexpr int kCsPad = kCsPixelMajor ? 8 : 4;
  static constexpr int kCsLd = kCsPixelMajor ? BN + kCsPad : BM + kCsPad;
  // kWgmmaWs with a register epilogue, no residual and no cluster k-split: the C tile at the size the register
  // epilogue writes (16-bit values; NCHW: BN rows of at most BM + 8 pixels, then the mask words), not the fp32
  // tile's -- room for a third CTA an SM (ctas). A staged residual and the k-split's fp32 hand-over need the rest.
#if defined(IGEMM_CSPLIT)
  static constexpr bool kCsCompact = false;
#else
  static constexpr bool kCsCompact = Math_ == kWgmmaWs && kRegsStore && !Epi::kResidual;
#endif
  static constexpr int kCsBytes = kCsCompact ? (kNchwOut ? BN * (BM + 8) * 2 + BN * (BM / 32) * 4 : BM * (BN + 8) * 2)
                                             : (kCsPixelMajor ? BM : BN) * kCsLd * 4;
  static constexpr int kMainBytes = Stages * (BM + BN) * BK * (Math_ == kSimt ? 4 : EB);
  static constexpr bool kIsWgmma = Math_ == kWgmma || Math_ == kWgmmaWs;
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
  static_assert(kTma == (LoadB_ == kLoadTma) && (!kTma || (kIsWgmma && (Layout_ == kNHWC || LoadA_ == kLoadTmaMN))),
                "TMA loads: both operands, wgmma, NHWC");
  static_assert(Math_ != kWgmmaWs || ((LoadA_ == kLoadTma || LoadA_ == kLoadTmaMN) && BM == 64),
                "the persistent kernel: TMA loads, 64-row tiles");
  static_assert(LoadA_ != kLoadPatch || (Math_ == kWgmma && Layout_ == kNHWC && LoadB_ == kLoadVec),
                "patch loads: the per-tile wgmma kernel, NHWC x, a gathered filter");
  static_assert(!kIsWgmma || (EB == 2 && BK * EB == 128 && BM % 64 == 0 && BN % 64 == 0 && BN <= 256),
                "wgmma: 16-bit operands, 128-byte K rows (SW128), 64-row warpgroups, BN in {64,128,192,256}");
};

IGEMM_DEVICE uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// Output tile t (of ceil(M / BM) · ceil(K / BN)) → its first row and column. n-fastest: the ceil(K / BN)
// tiles of one row block are consecutive, so CTAs in flight together read the same A rows (the
// activations, the large operand) and a 1x1 layer's input leaves DRAM once, not once per column block.
// (IGEMM_RASTER_M: the former m-fastest order, for A/B measurements in tools/epi_probe.py.)
struct TileCoord {
  int m0, n0;
};

template <class Cfg, class P>
IGEMM_DEVICE TileCoord tile_coord(const P& p, int t) {
#if defined(IGEMM_RASTER_M)
  const int TM = (p.M + Cfg::BM - 1) / Cfg::BM;
  return {(t % TM) * Cfg::BM, (t / TM) * Cfg::BN};
#else
  const int TN = (p.K + Cfg::BN - 1) / Cfg::BN;
  return {(t / TN) * Cfg::BM, (t % TN) * Cfg::BN};
#endif
}

// ------------------------------------------------------------------------------------ index mapping
// One output pixel (GEMM row) as the loaders need it. Rows past M get h0 = -2^30, so every (h, w)
// bounds check fails and they load zeros.
template <class T>
struct RowInfo {
  const T* img;
  int h0, w0;
  int rowoff;   // element offset of tap (0, 0, c=0) inside the image (may be negative: padding)
};

template <int Layout, class T, class P>
IGEMM_DEVICE RowInfo<T> row_info(int m, const P& p) {
  RowInfo<T> ri;
  const T* x = static_cast<const T*>(p.x);
  if (m < p.M) {
    int n, pq, pp, qq;
    p.fd_PQ.divmod(n, pq, m);
    p.fd_Q.divmod(pp, qq, pq);
    ri.img = x + int64_t(n) * p.x_img;
    ri.h0 = pp * p.sh - p.ph;
    ri.w0 = qq * p.sw - p.pw;
    ri.rowoff = Layout == kNHWC ? (ri.h0 * p.W + ri.w0) * p.C : ri.h0 * p.W + ri.w0;
  } else {
    ri.img = x;
    ri.h0 = -(1 << 30);
    ri.w0 = 0;
    ri.rowoff = 0;
  }
  return ri;
}

struct KCoord {
  int r, s, c;
};

template <int Layout, class P>
IGEMM_DEVICE KCoord decode_k(int k, const P& p) {
  KCoord o;
  int rs;
  if constexpr (Layout == kNHWC) {
    p.fd_C.divmod(rs, o.c, k);
  } else {
    p.fd_RS.divmod(o.c, rs, k);
  }
  p.fd_S.divmod(o.r, o.s, rs);
  return o;
}

template <int Layout, class P>
IGEMM_DEVICE void advance_k(KCoord& kc, const P& p) {
  if constexpr (Layout == kNHWC) {
    if (++kc.c == p.C) { kc.c = 0; if (++kc.s == p.S) { kc.s = 0; ++kc.r; } }
  } else {
    if (++kc.s == p.S) { kc.s = 0; if (++kc.r == p.R) { kc.r = 0; ++kc.c; } }
  }
}

// Element offset of tap (r, s, c) of a row inside its image, and whether it lies inside the input.
template <int Layout, class T, class P>
IGEMM_DEVICE bool tap(const RowInfo<T>& ri, const KCoord& kc, const P& p, int& off) {
  const int h = ri.h0 + kc.r * p.dh;
  const int w = ri.w0 + kc.s * p.dw;
  const bool ok = unsigned(h) < unsigned(p.H) && unsigned(w) < unsigned(p.W);
  // unsigned arithmetic: wraps (harmlessly) for taps outside the input, whose offsets are unused
  if constexpr (Layout == kNHWC) off = int((unsigned(h) * unsigned(p.W) + unsigned(w)) * unsigned(p.C) + unsigned(kc.c));
  else off = int((unsigned(kc.c) * unsigned(p.H) + unsigned(h)) * unsigned(p.W) + unsigned(w));
  return ok;
}

// ------------------------------------------------------------------------------------ gather loader
// Fills one stage of the A (BM × BK im2col tile) and B (BN × BK filter tile) shared-memory buffers,
// both K-major with 16-byte chunks XOR-swizzled by row (for 128-byte rows this is exactly the SW128
// layout wgmma reads). Thread t owns chunk column t % CPR of rows t / CPR + i · (threads / CPR).
//   kLoadVec : one 16-byte cp.async per chunk, zero-filled (src-size 0) for padding and tails;
//   kLoadElem: element-wise: 4-byte cp.async per element (fp32), or, for 16-bit types, register loads
//              one stage ahead written as one 16-byte store by store_regs() after the MMAs.
template <class Cfg, class P>
struct GatherLoader {
  using T = typename Cfg::Element;
  static constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, NT = Cfg::kThreads;
  static constexpr int EB = Cfg::EB, CE = Cfg::CE;
  static constexpr int RB = BK * EB;            // bytes per smem row
  static constexpr int CPR = RB / 16;           // 16-byte chunks per row
  static_assert(CPR == 2 || CPR == 4 || CPR == 8, "rows of 32, 64 or 128 bytes");
  static constexpr int SH = CPR == 8 ? 0 : (CPR == 4 ? 1 : 2);
  static constexpr int A_STAGE = BM * RB, B_STAGE = BN * RB;
  static constexpr int UA = BM * CPR / NT, UB = BN * CPR / NT;
  static_assert(BM * CPR % NT == 0 && BN * CPR % NT == 0, "loader partition");
  static constexpr int ROWSTEP = NT / CPR;
  static constexpr bool kRegA = Cfg::LoadA == kLoadElem && EB == 2;
  static constexpr bool kRegB = Cfg::LoadB == kLoadElem && EB == 2;

  IGEMM_DEVICE static int swz(int row, int ch) { return (row * CPR + (ch ^ ((row >> SH) & (CPR - 1)))) * 16; }

  const P& p;
  uint8_t* sA;
  uint8_t* sB;
  int chunk;
  RowInfo<T> ra[UA];
  int soffA[UA];
  const T* rbp[UB];
  bool rbv[UB];
  int soffB[UB];
  uint16_t regA[kRegA ? UA : 1][kRegA ? CE : 1];
  uint16_t regB[kRegB ? UB : 1][kRegB ? CE : 1];

  IGEMM_DEVICE GatherLoader(const P& p_, uint8_t* sA_, uint8_t* sB_, int m0, int n0) : p(p_), sA(sA_), sB(sB_) {
    const int tid = threadIdx.x;
    chunk = tid % CPR;
#pragma unroll
    for (int i = 0; i < UA; ++i) {
      const int row = tid / CPR + i * ROWSTEP;
      ra[i] = row_info<Cfg::kLayout, T>(m0 + row, p);
      soffA[i] = swz(row, chunk);
    }
    const T* w = static_cast<const T*>(p.w);
#pragma unroll
    for (int i = 0; i < UB; ++i) {
      const int row = tid / CPR + i * ROWSTEP;
      const int n = n0 + row;
      rbv[i] = n < p.K;
      rbp[i] = w + int64_t(rbv[i] ? n : 0) * p.Kred;
      soffB[i] = swz(row, chunk);
    }
  }

  // Issue the loads of k-tile kt into stage buffer `buf` (register-staged parts go to regA/regB).
  IGEMM_DEVICE void load(int kt, int buf) {
    const int k0 = kt * BK + chunk * CE;
    uint8_t* a_dst = sA + buf * A_STAGE;
    uint8_t* b_dst = sB + buf * B_STAGE;
    if constexpr (Cfg::LoadA == kLoadVec) {
      const KCoord kc = decode_k<Cfg::kLayout>(min(k0, p.Kred - 1), p);
      const bool kok = k0 < p.Kred;
#pragma unroll
      for (int i = 0; i < UA; ++i) {
        int off;
        const bool ok = tap<Cfg::kLayout>(ra[i], kc, p, off) && kok;
        cp_async_zfill<16>(a_dst + soffA[i], ok ? ra[i].img + off : ra[i].img, ok);
      }
    } else {
      // Element gather driven by the plan's per-k table (igemm/conv2d.py: _k_table): entry k holds the
      // element offset of tap k relative to the row's origin and its (r·dh, s·dw) for the bounds checks;
      // entries past Kred have r·dh = -32768, so they always read zero.
      int tab[2 * CE];
      const int4* tp = static_cast<const int4*>(p.ktab) + (k0 >> 1);
#pragma unroll
      for (int j = 0; j < CE / 2; ++j) {
        const int4 t = __ldg(tp + j);
        tab[4 * j] = t.x; tab[4 * j + 1] = t.y; tab[4 * j + 2] = t.z; tab[4 * j + 3] = t.w;
      }
#pragma unroll
      for (int i = 0; i < UA; ++i) {
#pragma unroll
        for (int e = 0; e < CE; ++e) {
          const int rs = tab[2 * e + 1];
          const int h = ra[i].h0 + int(short(rs & 0xffff));
          const int w = ra[i].w0 + (rs >> 16);
          const bool ok = unsigned(h) < unsigned(p.H) && unsigned(w) < unsigned(p.W);
          const T* src = ra[i].img + (ok ? ra[i].rowoff + tab[2 * e] : 0);
          if constexpr (kRegA) {
            regA[i][e] = ok ? __ldg(reinterpret_cast<const uint16_t*>(src)) : uint16_t(0);
          } else {
            cp_async_zfill<4>(a_dst + soffA[i] + e * 4, src, ok);
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < UB; ++i) {
      if constexpr (Cfg::LoadB == kLoadVec) {
        const bool ok = rbv[i] && k0 < p.Kred;
        cp_async_zfill<16>(b_dst + soffB[i], ok ? rbp[i] + k0 : rbp[i], ok);
      } else {
#pragma unroll
        for (int e = 0; e < CE; ++e) {
          const bool ok = rbv[i] && (k0 + e < p.Kred);
          if constexpr (kRegB) {
            regB[i][e] = ok ? __ldg(reinterpret_cast<const uint16_t*>(rbp[i] + k0 + e)) : uint16_t(0);
          } else {
            cp_async_zfill<4>(b_dst + soffB[i] + e * 4, ok ? rbp[i] + k0 + e : rbp[i], ok);
          }
        }
      }
    }
  }

  IGEMM_DEVICE static uint4 pack8(const uint16_t (&r)[CE]) {
    uint4 v;
    v.x = r[0] | (uint32_t(r[1]) << 16);
    v.y = r[2] | (uint32_t(r[3]) << 16);
    v.z = r[4] | (uint32_t(r[5]) << 16);
    v.w = r[6] | (uint32_t(r[7]) << 16);
    return v;
  }

  // Write the register-staged elements of the last load() into stage buffer `buf`.
  IGEMM_DEVICE void store_regs(int buf) {
    if constexpr (kRegA) {
#pragma unroll
      for (int i = 0; i < UA; ++i) *reinterpret_cast<uint4*>(sA + buf * A_STAGE + soffA[i]) = pack8(regA[i]);
    }
    if constexpr (kRegB) {
#pragma unroll
      for (int i = 0; i < UB; ++i) *reinterpret_cast<uint4*>(sB + buf * B_STAGE + soffB[i]) = pack8(regB[i]);
    }
  }
};

}  // namespace igemm::conv
