// igemm conv2d forward: the NCHW register epilogue (kStoreRegsNCHW).
#pragma once
#include "conv/prologue.cuh"

namespace igemm::conv {

// The register epilogue for NCHW outputs (kStoreRegsNCHW: no split-K): the chain runs on the
// accumulators as in epilogue_regs_by and each value is rounded once into a channel-major 16-bit C tile
// (nchw_ct_index), which leaves shared memory in V-pixel vectors along one channel (P·Q % V == 0: a vector
// stays inside one image's plane); a thread's pixels are the same in every pass, so its (image, pixel)
// divmod is done once. FuseMask (P·Q % 8 == 0, V = 8): each vector's mask byte from four set.gt on its
// stored pairs, stored beside it (docs/performance.md: mask-from-vectors; Config::kCsBytes still reserves
// BN · BM / 32 mask words in the compact C tile).
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
  const epi::Ctx ctx = regs_epilogue_start<Cfg>(p, s_vec, sync);   // (waits for a staged residual)
  uint16_t* ct = reinterpret_cast<uint16_t*>(res_s != nullptr ? res_s : smem);
  auto cti = [](int nl, int m) { return nchw_ct_index<Cfg>(nl, m); };
  if constexpr (Epi::kResidual) {
    if (res_s == nullptr) {
      if constexpr (V >= 2) {
        stage_residual_nchw<Cfg, NT>(p, ct, m0, n0, tid);
      } else {
        // V = 1: one 2-byte load an element, in batches of B loads in flight before their stores, not one
        // round trip to L2 per few loads (docs/performance.md: nchw-v1-residual-batches). The persistent
        // kernel's cluster k-split (one CTA an SM, registers to spare) issues them all at once; without it
        // that kernel stages them at the tile's start.
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

}  // namespace igemm::conv
