// igemm conv2d forward: the im2col index mapping (m -> (n, p, q), k -> (r, s, c) by magic-number division)
// and the cp.async gather loader that the mma.sync and the gathered wgmma mainloops share.
#pragma once
#include "conv/config.cuh"

namespace igemm::conv {

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
      // Element gather driven by the plan's per-k table (igemm/conv/_problem.py: k_table): entry k holds the
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
