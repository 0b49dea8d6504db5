// igemm conv2d forward: the sm_80+ mainloops.
//   mainloop_tensorop: mma.sync m16n8k16 (fp16/bf16) or m16n8k8 (tf32, operands rounded with cvt.rna;
//                      kTensorOp3: 3xTF32, each operand split into big + small TF32 parts),
//                      ldmatrix from the loader's swizzled buffers, fp32 accumulation;
//   mainloop_simt:     strict IEEE fp32 FFMA, 8×8 outer products per thread.
// Both run k-tiles [kt0, kt1) with `Stages` cp.async stages and leave the fp32 accumulators in the
// shared C tile (NHWC: Cs[m][n], NCHW: Cs[n][m]) for the epilogue.
#pragma once
#include <cute/arch/mma_sm80.hpp>
#include "conv/gather.cuh"

namespace igemm::conv {

IGEMM_DEVICE void ldsm_x4(uint32_t (&d)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.x4.m8n8.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(addr));
}

IGEMM_DEVICE uint32_t to_tf32(uint32_t x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(__uint_as_float(x)));
  return r;
}

// x (fp32 bits) -> big = tf32(x) in x, small = tf32(x - big) in lo, and in cross the big part the cross
// terms multiply: 0 for a non-finite x. An infinite operand then meets only the other's big part
// (big·big): the product is ±inf or NaN exactly as IEEE's (big has x's sign), never the NaN of inf times
// the other's small part (which may be 0 or of the other sign). Branch-free: with branches the MMAs no
// longer interleave across the splits (docs/performance.md: tf32x3-branch-free). A finite |x| above
// TF32's largest value (3.4014e38) rounds to an infinite big.
IGEMM_DEVICE void split_tf32(uint32_t& x, uint32_t& lo, uint32_t& cross) {
  const float f = __uint_as_float(x);
  const uint32_t big = to_tf32(x);
  const bool finite = fabsf(f) < INFINITY;
  const float small = finite ? f - __uint_as_float(big) : 0.f;     // exact
  lo = to_tf32(__float_as_uint(small));
  cross = finite ? big : 0u;
  x = big;
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

// k-step ks of a warp's A (MT row blocks of 16) and B (NT column blocks of 8) fragments, by ldmatrix from the
// loader's swizzled stage buffers at a_base and b_base.
template <class Cfg, class L, int MT, int NT>
IGEMM_DEVICE void load_fragments(uint32_t (&af)[MT][4], uint32_t (&bf)[NT][2], uint32_t a_base, uint32_t b_base,
                                 int ks, int wm, int wn, int lane) {
  constexpr int WTM = Cfg::BM / Cfg::WM, WTN = Cfg::BN / Cfg::WN;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int row = wm * WTM + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
    ldsm_x4(af[mt], a_base + L::swz(row, ks * 2 + (lane >> 4)));
  }
#pragma unroll
  for (int nt = 0; nt < NT; nt += 2) {
    const int row = wn * WTN + (nt + (lane >> 4)) * 8 + (lane & 7);
    uint32_t r[4];
    ldsm_x4(r, b_base + L::swz(row, ks * 2 + ((lane >> 3) & 1)));
    bf[nt][0] = r[0]; bf[nt][1] = r[1]; bf[nt + 1][0] = r[2]; bf[nt + 1][1] = r[3];
  }
}

// A warp's MT × NT accumulator tile (mma.sync's C fragments) into the shared fp32 C tile (layout per
// Config::kCsPixelMajor); the caller publishes it.
template <class Cfg, int MT, int NT>
IGEMM_DEVICE void warp_tile_to_cs(const float (&v4)[MT][NT][4], float* Cs, int wm, int wn, int lane) {
  constexpr int LD = Cfg::kCsLd, WTM = Cfg::BM / Cfg::WM, WTN = Cfg::BN / Cfg::WN;
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int r0 = wm * WTM + mt * 16 + g, c0 = wn * WTN + nt * 8 + 2 * t4;
      const float* v = v4[mt][nt];
      if constexpr (Cfg::kCsPixelMajor) {
        *reinterpret_cast<float2*>(Cs + r0 * LD + c0) = make_float2(v[0], v[1]);
        *reinterpret_cast<float2*>(Cs + (r0 + 8) * LD + c0) = make_float2(v[2], v[3]);
      } else {
        Cs[c0 * LD + r0] = v[0];
        Cs[(c0 + 1) * LD + r0] = v[1];
        Cs[c0 * LD + r0 + 8] = v[2];
        Cs[(c0 + 1) * LD + r0 + 8] = v[3];
      }
    }
}

template <class Cfg, class P>
IGEMM_DEVICE void mainloop_tensorop(const P& p, uint8_t* smem, int m0, int n0, int kt0, int kt1) {
  using T = typename Cfg::Element;
  using L = GatherLoader<Cfg, P>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, S = Cfg::Stages;
  constexpr int WTM = BM / Cfg::WM, WTN = BN / Cfg::WN;
  constexpr int MT = WTM / 16, NT = WTN / 8;
  static_assert(NT % 2 == 0 && MT >= 1, "warp tile");
  static_assert(Cfg::kMath != kTensorOp3 || Cfg::EB == 4, "3xTF32 is for fp32 operands");
  constexpr int KSTEPS = BK / Mma<T>::kK;

  uint8_t* sA = smem;
  uint8_t* sB = smem + S * L::A_STAGE;
  L ld(p, sA, sB, m0, n0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp % Cfg::WM, wn = warp / Cfg::WM;

  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  // 3xTF32: the tensor core adds each MMA's products into its accumulator with truncation, not rounding,
  // so a chain over a deep reduction drifts (biased, ~K/8 ulps; docs/performance.md: tf32x3-promotion).
  // Every kPromoteTiles k-tiles the MMA accumulators are added to fp32 registers with a rounded FADD and
  // restart from zero (CUTLASS's "promotion" for FP8, applied here).
  constexpr bool kPromote = Cfg::kMath == kTensorOp3;
  constexpr int kPromoteTiles = 4;
  constexpr int PM = kPromote ? MT : 1, PN = kPromote ? NT : 1;
  float sum[PM][PN][4] = {};
  auto promote = [&]() {
#pragma unroll
    for (int i = 0; i < PM; ++i)
#pragma unroll
      for (int j = 0; j < PN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          sum[i][j][e] += acc[i][j][e];
          acc[i][j][e] = 0.f;
        }
  };

  const int KT = kt1 - kt0;
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < KT) {
      ld.load(kt0 + st, st);
      ld.store_regs(st);
    }
    cp_async_commit();
  }

  const uint32_t sA_u = smem_u32(sA), sB_u = smem_u32(sB);
  for (int it = 0; it < KT; ++it) {
    cp_async_wait<S - 2>();
    __syncthreads();
    const int nk = it + S - 1;
    const int nbuf = nk % S;
    if (nk < KT) ld.load(kt0 + nk, nbuf);
    cp_async_commit();

    const int buf = it % S;
    const uint32_t a_base = sA_u + buf * L::A_STAGE, b_base = sB_u + buf * L::B_STAGE;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      uint32_t af[MT][4];
      uint32_t bf[NT][2];
      load_fragments<Cfg, L>(af, bf, a_base, b_base, ks, wm, wn, lane);
      if constexpr (Cfg::kMath == kTensorOp3) {
        // 3xTF32: x = big + small with big = tf32(x) and small = tf32(x - big) (x - big is exact);
        // a·b ≈ a_s·b_b + a_b·b_s + a_b·b_b (a_s·b_s, ~2^-22 relative, is dropped), small terms first
        uint32_t as[MT][4], bs[NT][2], ac[MT][4], bc[NT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e) split_tf32(af[mt][e], as[mt][e], ac[mt][e]);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) split_tf32(bf[nt][e], bs[nt][e], bc[nt][e]);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            Mma<T>::run(acc[mt][nt], as[mt], bc[nt]);
            Mma<T>::run(acc[mt][nt], ac[mt], bs[nt]);
            Mma<T>::run(acc[mt][nt], af[mt], bf[nt]);
          }
      } else {
        if constexpr (Cfg::EB == 4) {       // TF32: operands rounded to nearest
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
    }
    if constexpr (kPromote) {
      if (it % kPromoteTiles == kPromoteTiles - 1) promote();
    }
    if (nk < KT) ld.store_regs(nbuf);
  }
  if constexpr (kPromote) promote();
  cp_async_wait<0>();
  __syncthreads();

  if constexpr (kPromote) warp_tile_to_cs<Cfg>(sum, reinterpret_cast<float*>(smem), wm, wn, lane);
  else warp_tile_to_cs<Cfg>(acc, reinterpret_cast<float*>(smem), wm, wn, lane);
  __syncthreads();
}

// Strict fp32: 256 threads as a 16 × 16 grid; thread (tm, tn) owns rows {tm*4 .. +3, 64 + tm*4 .. +3}
// and columns {tn*4 .. +3, 64 + tn*4 .. +3} of a 128 × 128 tile; BK = 8; operands stored k-major in
// shared memory (As[k][m], Bs[k][n]) so each k step reads two float4 of A and two of B for 64 FFMAs.
template <class Cfg, class P>
IGEMM_DEVICE void mainloop_simt(const P& p, uint8_t* smem, int m0, int n0, int kt0, int kt1) {
  constexpr int BM = 128, BN = 128, BK = 8, S = Cfg::Stages;
  static_assert(Cfg::BM == BM && Cfg::BN == BN && Cfg::BK == BK && Cfg::kThreads == 256, "SIMT tile is 128x128x8");
  constexpr int A_STAGE = BK * BM, B_STAGE = BK * BN;   // floats
  float* sA = reinterpret_cast<float*>(smem);
  float* sB = sA + S * A_STAGE;
  const int tid = threadIdx.x;
  const float* w = static_cast<const float*>(p.w);

  // NHWC A: 8 consecutive threads walk k (c is contiguous); rows tid/8 + 32 i.
  // NCHW A: consecutive threads walk m (q is contiguous); k = tid/128 + 2 i.
  constexpr bool kNhwc = Cfg::kLayout == kNHWC;
  constexpr int A_ROWS = kNhwc ? 4 : 1;
  RowInfo<float> ra[A_ROWS];
  int a_row[A_ROWS];
#pragma unroll
  for (int i = 0; i < A_ROWS; ++i) {
    a_row[i] = kNhwc ? (tid / 8 + 32 * i) : (tid % 128);
    ra[i] = row_info<Cfg::kLayout, float>(m0 + a_row[i], p);
  }
  const float* bp[4];
  bool bv[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int n = n0 + tid / 8 + 32 * i;
    bv[i] = n < p.K;
    bp[i] = w + int64_t(bv[i] ? n : 0) * p.Kred;
  }

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

  const int KT = kt1 - kt0;
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < KT) load_tile(kt0 + st, st);
    cp_async_commit();
  }
  const int tm = tid % 16, tn = tid / 16;
  for (int it = 0; it < KT; ++it) {
    cp_async_wait<S - 2>();
    __syncthreads();
    const int nk = it + S - 1;
    if (nk < KT) load_tile(kt0 + nk, nk % S);
    cp_async_commit();
    const float* a = sA + (it % S) * A_STAGE;
    const float* b = sB + (it % S) * B_STAGE;
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
      if constexpr (Cfg::kCsPixelMajor) Cs[r * LD + c] = acc[i][j];
      else Cs[c * LD + r] = acc[i][j];
    }
  }
  __syncthreads();
}

}  // namespace igemm::conv
