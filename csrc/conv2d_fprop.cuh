// igemm: implicit-GEMM conv2d forward (the cuDNN paper's design) for sm_80+.
//
// GEMM view: M = N·P·Q (output pixels), N = K (output channels), Kred = C·R·S, reduction order
// (r, s, c) for NHWC and (c, r, s) for NCHW, so that the filter is a plain row-major K × Kred matrix
// in both layouts. The im2col matrix A[m, k] is never materialised: each CTA gathers BM × BK tiles of it
// (and BN × BK tiles of the filter) into `Stages` shared-memory buffers with cp.async while earlier
// stages are multiplied. m → (n, p, q) and k → (r, s, c) use magic-number division (FastDiv; magic
// numbers computed in igemm/fastdiv.py and passed as launch parameters).
//
// Loads (per operand, chosen at plan time):
//   kLoadVec : one 16-byte cp.async per 16-byte chunk (NHWC with C % (16/sizeof(T)) == 0; the filter
//              with Kred % (16/sizeof(T)) == 0), zero-filled (src-size 0) for padding and tails;
//   kLoadElem: element-wise gather (NCHW activations, odd C, odd Kred): 4-byte cp.async per element for
//              fp32; for 16-bit types the elements of a chunk are loaded into registers one stage ahead
//              and written to shared memory as one 16-byte store after the current stage's MMAs.
// Math:
//   kTensorOp: mma.sync m16n8k16 (fp16/bf16) or m16n8k8 (tf32, operands rounded with cvt.rna),
//              ldmatrix from XOR-swizzled (bank-conflict-free) shared memory, fp32 accumulation;
//   kSimt:     strict fp32 FFMA, 8×8 outer products per thread (bitwise IEEE fp32 arithmetic).
// Epilogue: accumulators → shared memory (fp32) → the store phase (epilogue_store below), which applies
// the epilogue chain (epilogues.cuh) per 16-byte output vector, rounds once, stores coalesced, and
// writes the ReLU mask words it owns (no atomics).
//
// Launch parameters: see igemm/conv2d.py (CONV_PARAMS), rendered into `struct Params` by the stub.
#pragma once
#include <cute/arch/mma_sm80.hpp>
#include "common.cuh"
#include "epilogues.cuh"

namespace igemm::conv {

enum : int { kNCHW = 0, kNHWC = 1 };
enum : int { kTensorOp = 0, kSimt = 1 };
enum : int { kLoadVec = 0, kLoadElem = 1 };
enum : int { kStoreRows = 0, kStoreLinear = 1, kStoreNCHW = 2 };

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
  static constexpr int kThreads = Math_ == kTensorOp ? WM * WN * 32 : 256;
  static constexpr int EB = sizeof(Element);
  static constexpr int CE = 16 / EB;               // elements per 16-byte chunk
  // shared-memory C tile (fp32), padded against bank conflicts
  static constexpr int kCsPad = kLayout == kNHWC ? 8 : 4;
  static constexpr int kCsLd = kLayout == kNHWC ? BN + kCsPad : BM + kCsPad;
  static constexpr int kCsBytes = (kLayout == kNHWC ? BM : BN) * kCsLd * 4;
  static_assert(Stages >= 2, "at least double buffering");
  static_assert(VecO == 1 || VecO * sizeof(ElementOut) == 16, "output vectors are 16 bytes or scalar");
  static_assert(!FuseMask || Epi::kMask, "mask fusion needs a ReLU(mask=True) in the chain");
  static_assert(StoreMode != kStoreNCHW || kLayout == kNCHW, "NCHW store mode is for NCHW");
  static_assert(StoreMode == kStoreNCHW || kLayout == kNHWC, "row/linear store modes are for NHWC");
};

IGEMM_DEVICE uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

IGEMM_DEVICE void ldsm_x4(uint32_t (&d)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.x4.m8n8.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(addr));
}

IGEMM_DEVICE uint32_t to_tf32(uint32_t x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(__uint_as_float(x)));
  return r;
}

template <class T> struct Mma;
template <> struct Mma<cutlass::half_t> {
  static constexpr int kK = 16;
  IGEMM_DEVICE static void run(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    cute::SM80_16x8x16_F32F16F16F32_TN::fma(c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], b[0], b[1],
                                            c[0], c[1], c[2], c[3]);
  }
};
template <> struct Mma<cutlass::bfloat16_t> {
  static constexpr int kK = 16;
  IGEMM_DEVICE static void run(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], b[0], b[1],
                                              c[0], c[1], c[2], c[3]);
  }
};
template <> struct Mma<float> {   // TF32
  static constexpr int kK = 8;
  IGEMM_DEVICE static void run(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    cute::SM80_16x8x8_F32TF32TF32F32_TN::fma(c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], b[0], b[1],
                                             c[0], c[1], c[2], c[3]);
  }
};

// ------------------------------------------------------------------------------------ index mapping
// One output pixel (GEMM row) as the loaders need it. Rows past M get h0 = -2^30, so every (h, w)
// bounds check fails and they load zeros.
template <class T>
struct RowInfo {
  const T* img;
  int h0, w0;
};

template <class T, class P>
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
  } else {
    ri.img = x;
    ri.h0 = -(1 << 30);
    ri.w0 = 0;
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

// ------------------------------------------------------------------------------------ store phase
// Reads the fp32 C tile from shared memory, applies the epilogue chain per output vector of VecO
// elements (contiguous in memory), rounds once, stores; builds ReLU mask words from the rounded
// values (bit = y > 0) when FuseMask. Word ownership: a warp's 32 consecutive vectors cover whole,
// aligned 32-element words (guaranteed by the plan's choice of StoreMode/FuseMask).
template <class Cfg, class P>
IGEMM_DEVICE void epilogue_store(const P& p, const float* Cs, int m0, int n0) {
  using TO = typename Cfg::ElementOut;
  constexpr int V = Cfg::VecO;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, LD = Cfg::kCsLd;
  TO* y = static_cast<TO*>(const_cast<void*>(p.y));
  uint32_t* mask = static_cast<uint32_t*>(const_cast<void*>(p.mask));
  const int lane = threadIdx.x & 31;
  int nvec;
  int rows_valid = 0;
  if constexpr (Cfg::StoreMode == kStoreRows) {
    nvec = BM * (BN / V);
  } else if constexpr (Cfg::StoreMode == kStoreNCHW) {
    nvec = BN * (BM / V);
  } else {
    rows_valid = min(BM, p.M - m0);
    nvec = (rows_valid * p.K + V - 1) / V;
  }
  const int passes = (nvec + Cfg::kThreads - 1) / Cfg::kThreads;
  for (int pass = 0; pass < passes; ++pass) {
    const int v = pass * Cfg::kThreads + threadIdx.x;
    float val[V];
    int ch[V];
    int64_t off = 0;
    int nvalid = 0;            // elements of this vector inside the output (prefix)
    if (v < nvec) {
      if constexpr (Cfg::StoreMode == kStoreRows) {
        const int row = v / (BN / V), col = (v % (BN / V)) * V;
        const int m = m0 + row, n = n0 + col;
        off = int64_t(m) * p.K + n;
        if (m < p.M) nvalid = max(0, min(V, p.K - n));
#pragma unroll
        for (int e = 0; e < V; ++e) { val[e] = Cs[row * LD + col + e]; ch[e] = min(n + e, p.K - 1); }
      } else if constexpr (Cfg::StoreMode == kStoreNCHW) {
        const int nl = v / (BM / V), ml = (v % (BM / V)) * V;
        const int n = n0 + nl, m = m0 + ml;
        if constexpr (V > 1) {
          // whole vector inside one image (plan guarantees P·Q % V == 0)
          int img, pq;
          p.fd_PQ.divmod(img, pq, min(m, p.M - 1));
          off = (int64_t(img) * p.K + n) * p.PQ + pq;
          if (m < p.M && n < p.K) nvalid = V;
        } else {
          int img, pq;
          p.fd_PQ.divmod(img, pq, min(m, p.M - 1));
          off = (int64_t(img) * p.K + n) * p.PQ + pq;
          if (m < p.M && n < p.K) nvalid = 1;
        }
#pragma unroll
        for (int e = 0; e < V; ++e) { val[e] = Cs[nl * LD + ml + e]; ch[e] = min(n, p.K - 1); }
      } else {  // kStoreLinear: the CTA owns linear range [m0*K, (m0+rows_valid)*K)
        const int e0 = v * V;
        off = int64_t(m0) * p.K + e0;
        nvalid = min(V, rows_valid * p.K - e0);
        int row, col;
        p.fd_K.divmod(row, col, e0);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          val[e] = Cs[min(row, BM - 1) * LD + col];
          ch[e] = col;
          if (++col == p.K) { col = 0; ++row; }
        }
      }
    }
    uint32_t bits = 0;
    if (nvalid == V) {
      Cfg::Epi::template apply<V>(val, ch, off, p);
      epi::Vec<TO, V> o;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        o.v[e] = from_float<TO>(val[e]);
        bits |= uint32_t(to_float(o.v[e]) > 0.f) << e;
      }
      *reinterpret_cast<epi::Vec<TO, V>*>(y + off) = o;
    } else if (nvalid > 0) {
#pragma unroll
      for (int e = 0; e < V; ++e) {
        if (e < nvalid) {
          float one[1] = {val[e]};
          int c1[1] = {ch[e]};
          Cfg::Epi::template apply<1>(one, c1, off + e, p);
          TO o = from_float<TO>(one[0]);
          bits |= uint32_t(to_float(o) > 0.f) << e;
          y[off + e] = o;
        }
      }
    }
    if constexpr (Cfg::FuseMask) {
      constexpr int kLanesPerWord = 32 / V;
      uint32_t word = bits << ((lane % kLanesPerWord) * V);
#pragma unroll
      for (int o2 = 1; o2 < kLanesPerWord; o2 <<= 1) word |= __shfl_xor_sync(0xffffffffu, word, o2);
      // the word's first element is the first of the group's leader lane
      const int has = __shfl_sync(0xffffffffu, nvalid, lane - lane % kLanesPerWord);
      const int64_t woff = __shfl_sync(0xffffffffu, off, lane - lane % kLanesPerWord);
      if (lane % kLanesPerWord == 0 && has > 0) mask[woff >> 5] = word;
    }
  }
}

// ------------------------------------------------------------------------------------ tensor-op mainloop
template <class Cfg, class P>
IGEMM_DEVICE void mainloop_tensorop(const P& p, uint8_t* smem, int m0, int n0) {
  using T = typename Cfg::Element;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, S = Cfg::Stages, NT_ = Cfg::kThreads;
  constexpr int EB = Cfg::EB, CE = Cfg::CE;
  constexpr int RB = BK * EB;            // bytes per smem row
  constexpr int CPR = RB / 16;           // 16-byte chunks per row
  static_assert(CPR == 2 || CPR == 4 || CPR == 8, "rows of 32, 64 or 128 bytes");
  constexpr int SH = CPR == 8 ? 0 : (CPR == 4 ? 1 : 2);
  constexpr int A_STAGE = BM * RB, B_STAGE = BN * RB;
  constexpr int WTM = BM / Cfg::WM, WTN = BN / Cfg::WN;
  constexpr int MT = WTM / 16, NT = WTN / 8;
  static_assert(NT % 2 == 0 && MT >= 1, "warp tile");
  constexpr int KSTEP_ELEMS = Mma<T>::kK;
  constexpr int KSTEPS = BK / KSTEP_ELEMS;
  constexpr int UA = BM * CPR / NT_, UB = BN * CPR / NT_;
  static_assert(BM * CPR % NT_ == 0 && BN * CPR % NT_ == 0, "loader partition");
  constexpr int ROWSTEP = NT_ / CPR;
  constexpr bool kRegA = Cfg::LoadA == kLoadElem && EB == 2;
  constexpr bool kRegB = Cfg::LoadB == kLoadElem && EB == 2;

  uint8_t* sA = smem;
  uint8_t* sB = smem + S * A_STAGE;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp % Cfg::WM, wn = warp / Cfg::WM;
  const int chunk = tid % CPR;

  auto swz = [](int row, int ch) { return (row * CPR + (ch ^ ((row >> SH) & (CPR - 1)))) * 16; };

  // per-thread rows
  RowInfo<T> ra[UA];
  int soffA[UA];
#pragma unroll
  for (int i = 0; i < UA; ++i) {
    const int row = tid / CPR + i * ROWSTEP;
    ra[i] = row_info<T>(m0 + row, p);
    soffA[i] = swz(row, chunk);
  }
  const T* rbp[UB];
  bool rbv[UB];
  int soffB[UB];
  {
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
  uint16_t regA[kRegA ? UA : 1][kRegA ? CE : 1];
  uint16_t regB[kRegB ? UB : 1][kRegB ? CE : 1];

  const int KT = (p.Kred + BK - 1) / BK;

  // Issue the loads of k-tile kt into stage buffer `buf` (register-staged parts go to regA/regB).
  auto load_tile = [&](int kt, int buf) {
    const int k0 = kt * BK + chunk * CE;
    uint8_t* a_dst = sA + buf * A_STAGE;
    uint8_t* b_dst = sB + buf * B_STAGE;
    // ---- A (activations)
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
      KCoord kc0 = decode_k<Cfg::kLayout>(min(k0, p.Kred - 1), p);
#pragma unroll
      for (int i = 0; i < UA; ++i) {
        KCoord kc = kc0;
#pragma unroll
        for (int e = 0; e < CE; ++e) {
          int off;
          const bool ok = tap<Cfg::kLayout>(ra[i], kc, p, off) && (k0 + e < p.Kred);
          if constexpr (kRegA) {
            regA[i][e] = ok ? __ldg(reinterpret_cast<const uint16_t*>(ra[i].img + off)) : uint16_t(0);
          } else {
            cp_async_zfill<4>(a_dst + soffA[i] + e * 4, ok ? ra[i].img + off : ra[i].img, ok);
          }
          advance_k<Cfg::kLayout>(kc, p);
        }
      }
    }
    // ---- B (filter rows, contiguous along Kred)
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
  };
  auto store_regs = [&](int buf) {
    if constexpr (kRegA) {
#pragma unroll
      for (int i = 0; i < UA; ++i) {
        uint4 v;
        v.x = regA[i][0] | (uint32_t(regA[i][1]) << 16);
        v.y = regA[i][2] | (uint32_t(regA[i][3]) << 16);
        v.z = regA[i][4] | (uint32_t(regA[i][5]) << 16);
        v.w = regA[i][6] | (uint32_t(regA[i][7]) << 16);
        *reinterpret_cast<uint4*>(sA + buf * A_STAGE + soffA[i]) = v;
      }
    }
    if constexpr (kRegB) {
#pragma unroll
      for (int i = 0; i < UB; ++i) {
        uint4 v;
        v.x = regB[i][0] | (uint32_t(regB[i][1]) << 16);
        v.y = regB[i][2] | (uint32_t(regB[i][3]) << 16);
        v.z = regB[i][4] | (uint32_t(regB[i][5]) << 16);
        v.w = regB[i][6] | (uint32_t(regB[i][7]) << 16);
        *reinterpret_cast<uint4*>(sB + buf * B_STAGE + soffB[i]) = v;
      }
    }
  };

  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  // prologue: stages 0 .. S-2
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < KT) {
      load_tile(st, st);
      store_regs(st);
    }
    cp_async_commit();
  }

  const uint32_t sA_u = smem_u32(sA), sB_u = smem_u32(sB);
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<S - 2>();
    __syncthreads();
    const int nk = kt + S - 1;
    const int nbuf = nk % S;
    if (nk < KT) load_tile(nk, nbuf);
    cp_async_commit();

    const int buf = kt % S;
    const uint32_t a_base = sA_u + buf * A_STAGE, b_base = sB_u + buf * B_STAGE;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      uint32_t af[MT][4];
      uint32_t bf[NT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int row = wm * WTM + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        ldsm_x4(af[mt], a_base + swz(row, ks * 2 + (lane >> 4)));
      }
#pragma unroll
      for (int nt = 0; nt < NT; nt += 2) {
        const int row = wn * WTN + (nt + (lane >> 4)) * 8 + (lane & 7);
        uint32_t r[4];
        ldsm_x4(r, b_base + swz(row, ks * 2 + ((lane >> 3) & 1)));
        bf[nt][0] = r[0]; bf[nt][1] = r[1]; bf[nt + 1][0] = r[2]; bf[nt + 1][1] = r[3];
      }
      if constexpr (EB == 4) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e) af[mt][e] = to_tf32(af[mt][e]);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) bf[nt][e] = to_tf32(bf[nt][e]);
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) Mma<T>::run(acc[mt][nt], af[mt], bf[nt]);
    }
    if (nk < KT) store_regs(nbuf);
  }
  cp_async_wait<0>();
  __syncthreads();

  // accumulators → shared C tile
  float* Cs = reinterpret_cast<float*>(smem);
  constexpr int LD = Cfg::kCsLd;
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int r0 = wm * WTM + mt * 16 + g, c0 = wn * WTN + nt * 8 + 2 * t4;
      if constexpr (Cfg::kLayout == kNHWC) {
        *reinterpret_cast<float2*>(Cs + r0 * LD + c0) = make_float2(acc[mt][nt][0], acc[mt][nt][1]);
        *reinterpret_cast<float2*>(Cs + (r0 + 8) * LD + c0) = make_float2(acc[mt][nt][2], acc[mt][nt][3]);
      } else {
        Cs[c0 * LD + r0] = acc[mt][nt][0];
        Cs[(c0 + 1) * LD + r0] = acc[mt][nt][1];
        Cs[c0 * LD + r0 + 8] = acc[mt][nt][2];
        Cs[(c0 + 1) * LD + r0 + 8] = acc[mt][nt][3];
      }
    }
  __syncthreads();
}

// ------------------------------------------------------------------------------------ strict fp32 (FFMA)
// 256 threads as a 16 × 16 grid; thread (tm, tn) owns rows {tm*4 .. +3, 64 + tm*4 .. +3} and columns
// {tn*4 .. +3, 64 + tn*4 .. +3} of a 128 × 128 tile; BK = 8; operands stored k-major in shared memory
// (As[k][m], Bs[k][n]) so each k step reads two float4 of A and two of B for 64 FFMAs.
template <class Cfg, class P>
IGEMM_DEVICE void mainloop_simt(const P& p, uint8_t* smem, int m0, int n0) {
  constexpr int BM = 128, BN = 128, BK = 8, S = Cfg::Stages;
  static_assert(Cfg::BM == BM && Cfg::BN == BN && Cfg::BK == BK && Cfg::kThreads == 256, "SIMT tile is 128x128x8");
  constexpr int A_STAGE = BK * BM, B_STAGE = BK * BN;   // floats
  float* sA = reinterpret_cast<float*>(smem);
  float* sB = sA + S * A_STAGE;
  const int tid = threadIdx.x;
  const float* w = static_cast<const float*>(p.w);

  // Loader mapping. NHWC A: 8 consecutive threads walk k (c is contiguous); rows tid/8 + 32 i.
  // NCHW A: consecutive threads walk m (q is contiguous); k = tid/128 + 2 i.
  constexpr bool kNhwc = Cfg::kLayout == kNHWC;
  constexpr int A_ROWS = kNhwc ? 4 : 1;
  RowInfo<float> ra[A_ROWS];
  int a_row[A_ROWS];
#pragma unroll
  for (int i = 0; i < A_ROWS; ++i) {
    a_row[i] = kNhwc ? (tid / 8 + 32 * i) : (tid % 128);
    ra[i] = row_info<float>(m0 + a_row[i], p);
  }
  const float* bp[4];
  bool bv[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int n = n0 + tid / 8 + 32 * i;
    bv[i] = n < p.K;
    bp[i] = w + int64_t(bv[i] ? n : 0) * p.Kred;
  }
  const int KT = (p.Kred + BK - 1) / BK;

  auto load_tile = [&](int kt, int buf) {
    float* a_dst = sA + buf * A_STAGE;
    float* b_dst = sB + buf * B_STAGE;
    if constexpr (kNhwc) {
      const int k = kt * BK + tid % 8;
      const KCoord kc = decode_k<kNHWC>(min(k, p.Kred - 1), p);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        int off;
        const bool ok = tap<kNHWC>(ra[i], kc, p, off) && k < p.Kred;
        cp_async_zfill<4>(a_dst + (tid % 8) * BM + a_row[i], ok ? ra[i].img + off : ra[i].img, ok);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int kl = tid / 128 + 2 * i;
        const int k = kt * BK + kl;
        const KCoord kc = decode_k<kNCHW>(min(k, p.Kred - 1), p);
        int off;
        const bool ok = tap<kNCHW>(ra[0], kc, p, off) && k < p.Kred;
        cp_async_zfill<4>(a_dst + kl * BM + a_row[0], ok ? ra[0].img + off : ra[0].img, ok);
      }
    }
    const int kb = kt * BK + tid % 8;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const bool ok = bv[i] && kb < p.Kred;
      cp_async_zfill<4>(b_dst + (tid % 8) * BN + tid / 8 + 32 * i, ok ? bp[i] + kb : bp[i], ok);
    }
  };

  float acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;

#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < KT) load_tile(st, st);
    cp_async_commit();
  }
  const int tm = tid % 16, tn = tid / 16;
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<S - 2>();
    __syncthreads();
    const int nk = kt + S - 1;
    if (nk < KT) load_tile(nk, nk % S);
    cp_async_commit();
    const float* a = sA + (kt % S) * A_STAGE;
    const float* b = sB + (kt % S) * B_STAGE;
#pragma unroll
    for (int k = 0; k < BK; ++k) {
      float av[8], bw[8];
      *reinterpret_cast<float4*>(av) = *reinterpret_cast<const float4*>(a + k * BM + tm * 4);
      *reinterpret_cast<float4*>(av + 4) = *reinterpret_cast<const float4*>(a + k * BM + 64 + tm * 4);
      *reinterpret_cast<float4*>(bw) = *reinterpret_cast<const float4*>(b + k * BN + tn * 4);
      *reinterpret_cast<float4*>(bw + 4) = *reinterpret_cast<const float4*>(b + k * BN + 64 + tn * 4);
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(av[i], bw[j], acc[i][j]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  float* Cs = reinterpret_cast<float*>(smem);
  constexpr int LD = Cfg::kCsLd;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = (i < 4 ? 0 : 64) + tm * 4 + (i & 3);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int c = (j < 4 ? 0 : 64) + tn * 4 + (j & 3);
      if constexpr (kNhwc) Cs[r * LD + c] = acc[i][j];
      else Cs[c * LD + r] = acc[i][j];
    }
  }
  __syncthreads();
}

template <class Cfg>
constexpr int smem_bytes() {
  constexpr int main = Cfg::kMath == kTensorOp ? Cfg::Stages * (Cfg::BM + Cfg::BN) * Cfg::BK * Cfg::EB
                                               : Cfg::Stages * (Cfg::BM + Cfg::BN) * Cfg::BK * 4;
  return main > Cfg::kCsBytes ? main : Cfg::kCsBytes;
}

// The kernel body: one CTA computes a BM × BN tile of the output.
template <class Cfg, class P>
__device__ void fprop(const P& p) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int m0 = blockIdx.x * Cfg::BM;
  const int n0 = blockIdx.y * Cfg::BN;
  if constexpr (Cfg::kMath == kTensorOp) mainloop_tensorop<Cfg>(p, smem, m0, n0);
  else mainloop_simt<Cfg>(p, smem, m0, n0);
  epilogue_store<Cfg>(p, reinterpret_cast<const float*>(smem), m0, n0);
}

}  // namespace igemm::conv
