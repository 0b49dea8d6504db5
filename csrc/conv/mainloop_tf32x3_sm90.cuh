// igemm conv2d forward: strict fp32 on sm_90a -- 3xTF32 on warpgroup MMAs (kWgmmaTf32x3).
//
// The cp.async gather fills K-major fp32 stages (BK = 32: 128-byte rows, the loader's swizzle is SW128). Each
// product a·b is a_s·b_c + a_c·b_s + a_b·b_b (mainloop_sm80.cuh: split_tf32; a_s·b_s, ~2^-22 relative, dropped):
//   - B's parts live in shared memory, the form wgmma reads: big is B itself (the tensor core reads an fp32 word
//     as TF32 by dropping its low bits), small in a double-buffered B-sized tile (and, for a k-tile with a
//     non-finite value, cross in another); each thread splits the B chunks it loaded itself (so no barrier
//     stands between its cp.async wait and the split); stage i + 1 is split while stage i's MMAs run;
//   - A's parts live in registers (ldmatrix of the raw fp32 tile, split there; tf32 wgmma takes A from
//     registers), 4 x 4 x 3 registers a k-tile.
// A wgmma group of 3 MMAs per k8 step (4 a k-tile), all waited for before the next k-tile's A registers are
// written.
// The accumulators are promoted into fp32 sums every 4 k-tiles (the tensor core's truncating adds drift over a
// deep reduction; mainloop_sm80.cuh: kPromote). The sums leave through the fp32 C tile (epilogue_smem.cuh).
#pragma once
#include "conv/gather.cuh"
#include "conv/mainloop_sm80.cuh"
#include "conv/wgmma.cuh"

namespace igemm::conv {

template <int N> struct Tf32RsAtom;
template <> struct Tf32RsAtom<64> { using type = gmma::MMA_64x64x8_F32TF32TF32_RS_TN<>; };
template <> struct Tf32RsAtom<128> { using type = gmma::MMA_64x128x8_F32TF32TF32_RS_TN<>; };

template <class Atom, size_t... I>
IGEMM_DEVICE void gmma_rs_issue(const uint32_t (&a)[4], uint64_t db, float* acc, std::index_sequence<I...>) {
  Atom::fma(a[0], a[1], a[2], a[3], db, acc[I]..., gmma::ScaleOut::One);
}

// B's parts for the tensor core, which reads an fp32 word as TF32 by dropping its 13 low bits: big is the word
// itself (truncated), small = tf32(x - trunc(x)) (x - trunc(x) exact: |small| < 2^-10 |x|, the product's error
// ~2^-21 as with rounding), cross = trunc(x) for finite x, else 0. Returns whether x is not finite.
IGEMM_DEVICE bool split_b_word(uint32_t x, uint32_t& small, uint32_t& cross) {
  const float f = __uint_as_float(x);
  const bool finite = fabsf(f) < INFINITY;
  const uint32_t big = x & 0xFFFFE000u;
  small = to_tf32(__float_as_uint(finite ? f - __uint_as_float(big) : 0.f));
  cross = finite ? big : 0u;
  return !finite;
}

template <class Cfg, class P>
IGEMM_DEVICE void mainloop_wgmma_tf32x3(const P& p, uint8_t* smem, int m0, int n0, int kt0, int kt1) {
  using L = GatherLoader<Cfg, P>;
  using Atom = typename Tf32RsAtom<Cfg::BN>::type;
  constexpr int BN = Cfg::BN, S = Cfg::Stages;
  constexpr int NACC = BN / 2;                  // fp32 accumulators per thread (64 x BN per warpgroup)
  constexpr int KSTEPS = Cfg::BK / 8;           // k8 steps a k-tile
  constexpr int kPromoteTiles = 4;
  static_assert(Cfg::EB == 4 && Cfg::BK == 32, "3xTF32 wgmma: fp32 operands, 128-byte rows");
  static_assert(L::UB >= 1, "each thread loads (and splits) whole B chunks");

  uint8_t* sA = smem;
  uint8_t* sB = smem + S * L::A_STAGE;
  uint8_t* sX = sB + S * L::B_STAGE;            // B's small parts (double-buffered), then the cross tile
  L ld(p, sA, sB, m0, n0);
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, wg = threadIdx.x / 128;

  // B's small parts of this thread's own chunks of stage `buf` (the ones it loaded) into small tile x; whether any
  // of them is not finite
  auto split_b = [&](int buf, int x) {
    const uint8_t* b = sB + buf * L::B_STAGE;
    uint8_t* s = sX + x * L::B_STAGE;
    bool nonfinite = false;
#pragma unroll
    for (int i = 0; i < L::UB; ++i) {
      const uint4 v = *reinterpret_cast<const uint4*>(b + ld.soffB[i]);
      uint4 lo, cr;
      nonfinite |= split_b_word(v.x, lo.x, cr.x);
      nonfinite |= split_b_word(v.y, lo.y, cr.y);
      nonfinite |= split_b_word(v.z, lo.z, cr.z);
      nonfinite |= split_b_word(v.w, lo.w, cr.w);
      *reinterpret_cast<uint4*>(s + ld.soffB[i]) = lo;
    }
    return nonfinite;
  };
  // a k-tile with a non-finite B value (rare) multiplies A's small part by the cross tile instead of B itself
  // (inf x a small part of 0 would make a NaN): its cross parts (one tile: written once the previous k-tile's
  // MMAs are done), and B's NaNs made whole words (a payload in the 13 low bits alone would read as inf)
  auto cross_b = [&](int buf) {
    uint8_t* b = sB + buf * L::B_STAGE;
    uint8_t* c = sX + 2 * L::B_STAGE;
#pragma unroll
    for (int i = 0; i < L::UB; ++i) {
      uint4 v = *reinterpret_cast<const uint4*>(b + ld.soffB[i]);
      uint4 lo, cr;
      split_b_word(v.x, lo.x, cr.x);
      split_b_word(v.y, lo.y, cr.y);
      split_b_word(v.z, lo.z, cr.z);
      split_b_word(v.w, lo.w, cr.w);
      *reinterpret_cast<uint4*>(c + ld.soffB[i]) = cr;
      v.x = isnan(__uint_as_float(v.x)) ? 0x7fffffffu : v.x;
      v.y = isnan(__uint_as_float(v.y)) ? 0x7fffffffu : v.y;
      v.z = isnan(__uint_as_float(v.z)) ? 0x7fffffffu : v.z;
      v.w = isnan(__uint_as_float(v.w)) ? 0x7fffffffu : v.w;
      *reinterpret_cast<uint4*>(b + ld.soffB[i]) = v;
    }
  };

  float acc[NACC], sum[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = sum[i] = 0.f;

  const int KT = kt1 - kt0;
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < KT) ld.load(kt0 + st, st);
    cp_async_commit();
  }
  cp_async_wait<S - 2>();                       // k-tile 0's bytes (this thread's)
  bool nonfinite = KT > 0 && split_b(0, 0);
  fence_proxy_async();
  bool cross = __syncthreads_or(nonfinite);
  if (cross) {
    cross_b(0);
    fence_proxy_async();
    __syncthreads();
  }

  const uint32_t sA_u = smem_u32(sA), sB_u = smem_u32(sB), sX_u = smem_u32(sX);
  // ldmatrix rows of this warp's 16-row slice: matrices (rows 0-7, k 0-3), (8-15, 0-3), (0-7, 4-7), (8-15, 4-7)
  const int arow = wg * 64 + warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
  for (int it = 0; it < KT; ++it) {
    const int buf = it % S;
    const uint64_t db = desc_sw128(sB_u + buf * L::B_STAGE);
    const uint64_t ds = desc_sw128(sX_u + (it & 1) * L::B_STAGE);
    const uint64_t dx = cross ? desc_sw128(sX_u + 2 * L::B_STAGE) : db;
    // per k8 step: A's parts from the raw tile (published by the previous iteration's barrier), then its three
    // MMAs as one group, so the tensor core starts on step 0 while step 1's A loads
    uint32_t af[KSTEPS][4], as[KSTEPS][4], ac[KSTEPS][4];
#pragma unroll
    for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      ldsm_x4(af[ks], sA_u + buf * L::A_STAGE + L::swz(arow, ks * 2 + (lane >> 4)));
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        split_tf32(af[ks][e], as[ks][e], ac[ks][e]);
        cute::warpgroup_fence_operand(af[ks][e]);
        cute::warpgroup_fence_operand(as[ks][e]);
        cute::warpgroup_fence_operand(ac[ks][e]);
      }
      cute::warpgroup_arrive();
      gmma_rs_issue<Atom>(as[ks], dx + 2 * ks, acc, std::make_index_sequence<NACC>{});   // small terms first
      gmma_rs_issue<Atom>(ac[ks], ds + 2 * ks, acc, std::make_index_sequence<NACC>{});
      gmma_rs_issue<Atom>(af[ks], db + 2 * ks, acc, std::make_index_sequence<NACC>{});
      cute::warpgroup_commit_batch();
    }
    // under the MMAs: refill the stage the previous k-tile used, then split the next k-tile's B
    const int nk = it + S - 1;
    if (nk < KT) ld.load(kt0 + nk, nk % S);
    cp_async_commit();
    cp_async_wait<S - 2>();                     // k-tile it + 1's bytes (this thread's)
    nonfinite = it + 1 < KT && split_b((it + 1) % S, (it + 1) & 1);
    fence_proxy_async();
    cute::warpgroup_wait<0>();
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        cute::warpgroup_fence_operand(af[ks][e]);
        cute::warpgroup_fence_operand(as[ks][e]);
        cute::warpgroup_fence_operand(ac[ks][e]);
      }
#pragma unroll
    for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
    if (it % kPromoteTiles == kPromoteTiles - 1) {
#pragma unroll
      for (int i = 0; i < NACC; ++i) {
        sum[i] += acc[i];
        acc[i] = 0.f;
      }
    }
    // stage it free for its refill; k-tile it + 1 split and loaded (and its cross parts where it needs them)
    cross = __syncthreads_or(nonfinite);
    if (cross) {
      cross_b((it + 1) % S);
      fence_proxy_async();
      __syncthreads();
    }
  }
#pragma unroll
  for (int i = 0; i < NACC; ++i) sum[i] += acc[i];
  cp_async_wait<0>();
  __syncthreads();
  acc_to_cs<Cfg>(sum, smem);
}

}  // namespace igemm::conv
