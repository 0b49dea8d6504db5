// igemm conv2d forward: the register epilogues' building blocks -- the wgmma accumulator fragment's rows,
// 16-bit packing and unpacking, the ReLU mask byte of a stored vector, 8x8 matrix moves between fragments and
// shared memory, vector stores, and the NCHW 16-bit C tile's layout.
#pragma once
#include "conv/config.cuh"

namespace igemm::conv {

// 0xFFFF in each 16-bit half of the result whose stored value is > 0 (false for ±0 and NaN): one set.gt
// on the packed pair, so the mask bit is exactly (stored y > 0).
template <class TO>
IGEMM_DEVICE uint32_t gt0_pair(uint32_t u) {
  static_assert(sizeof(TO) == 2, "16-bit outputs");
  uint32_t r;
  if constexpr (std::is_same_v<TO, cutlass::bfloat16_t>)
    asm("set.gt.u32.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(u), "r"(0u));
  else
    asm("set.gt.u32.f16x2 %0, %1, %2;" : "=r"(r) : "r"(u), "r"(0u));
  return r;
}

// The ReLU mask byte of a 16-byte vector of eight stored 16-bit values (bit e: value e > 0; false for ±0 and
// NaN). Pair k's set.gt halves keep bits 2k (low) and 16 + 2k + 1 (high): one LOP3 each; x | x >> 16 then has
// value e at bit e. The register epilogues' store loops, NHWC (8 channels) and NCHW (8 pixels of a channel).
template <class TO>
IGEMM_DEVICE uint8_t mask_byte8(const uint4& v) {
  const uint32_t x = (gt0_pair<TO>(v.x) & 0x00020001u) | (gt0_pair<TO>(v.y) & 0x00080004u) |
                     (gt0_pair<TO>(v.z) & 0x00200010u) | (gt0_pair<TO>(v.w) & 0x00800040u);
  return uint8_t(x | (x >> 16));
}

// (lo, hi) rounded to nearest-even into one packed 16-bit pair, lo in the low half: one cvt (F2FP), where
// two scalar conversions gave the pack in the other order and a PRMT to swap it back (ptxas 13.0).
template <class TO>
IGEMM_DEVICE uint32_t pack_pair(float lo, float hi) {
  static_assert(sizeof(TO) == 2, "16-bit outputs");
  uint32_t r;
  if constexpr (std::is_same_v<TO, cutlass::bfloat16_t>)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// A residual pair (raw bits for 16-bit types: the low half is the first element) as two floats.
template <class RT, class Raw>
IGEMM_DEVICE void unpack_pair(const Raw& u, float& lo, float& hi) {
  if constexpr (std::is_same_v<RT, cutlass::half_t>) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&u));
    lo = f.x;
    hi = f.y;
  } else if constexpr (std::is_same_v<RT, cutlass::bfloat16_t>) {
    lo = __uint_as_float(u << 16);
    hi = __uint_as_float(u & 0xFFFF0000u);
  } else {
    lo = to_float(u.v[0]);
    hi = to_float(u.v[1]);
  }
}

// The first of the two tile rows whose accumulators thread tid holds (the other is 8 rows on): warp w of
// warpgroup g owns rows g·64 + w·16 + lane / 4 (wgmma's accumulator layout).
IGEMM_DEVICE int fragment_row0(int tid) { return (tid >> 7) * 64 + ((tid >> 5) & 3) * 16 + ((tid & 31) >> 2); }

// Four 8x8 16-bit matrices between a warp's fragments and shared memory, one instruction (ldmatrix; stmatrix,
// sm_90): register i holds the thread's pair of matrix i (row lane / 4, columns 2·(lane % 4) + {0, 1}, the
// accumulator fragment's layout), and lane l gives the 16-byte row l % 8 of matrix l / 8. TRANS: that row is
// the matrix's column l % 8 (the NCHW C tile: one channel's 8 pixels). In the register epilogues matrix i is
// (column block 2·jp + i / 2, rows r0 | r0 + 8 by i % 2): the NCHW C tile's values (and residual) move as four
// 16-byte rows a lane instead of eight 2-byte stores (loads), the NHWC staged residual's as four instead of
// four 4-byte loads (docs/performance.md: nchw-stmatrix).
IGEMM_DEVICE void stmatrix_x4_trans(void* dst, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
               ::"r"(smem_u32(dst)), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

template <bool TRANS>
IGEMM_DEVICE void ldmatrix_x4(const void* src, uint32_t& a, uint32_t& b, uint32_t& c, uint32_t& d) {
  if constexpr (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(smem_u32(src)) : "memory");
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(smem_u32(src)) : "memory");
}

// One 16-, 8-, 4- or 2-byte global store of v at p. (As a plain assignment, the uint4 store of
// epilogue_regs_nchw_by's fused-mask variant left nvcc 13.0's front end as four st.global.u32.)
IGEMM_DEVICE void store_vec(void* p, const uint4& v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
IGEMM_DEVICE void store_vec(void* p, const uint2& v) {
  asm volatile("st.global.v2.b32 [%0], {%1, %2};\n" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}
IGEMM_DEVICE void store_vec(void* p, uint32_t v) { *static_cast<uint32_t*>(p) = v; }
IGEMM_DEVICE void store_vec(void* p, uint16_t v) { *static_cast<uint16_t*>(p) = v; }

// The NCHW register epilogue's 16-bit C tile: channel-major, BN rows. With vectors of 4 or 8 pixels: rows of
// BM pixels, the 16-byte chunk k of row nl at chunk k ^ (nl & 7) -- the fragment's 16-bit accesses (8
// consecutive pixels of 4 channels 2 apart in a warp) hit 16 distinct banks, a vector stays inside one chunk,
// a store-loop pass moves 8 rows on (the same swizzle every pass), and BM · BN · 2 bytes fit one stage buffer
// even for a 128x128 tile, so the residual can be staged in place before the mainloop ends. With 1- or
// 2-pixel vectors, rows of BM + 8 pixels, unswizzled (conflict-free as well): a pass moves 2 or 4 rows on,
// and a swizzle per pass would cost the store loop more than it saves (docs/performance.md: nchw-ctile-v1).
template <class Cfg>
constexpr bool kNchwSwizzled = Cfg::VecO >= 4;

template <class Cfg>
constexpr int kNchwLd = kNchwSwizzled<Cfg> ? Cfg::BM : Cfg::BM + 8;

template <class Cfg>
IGEMM_DEVICE int nchw_ct_index(int nl, int ml) {
  static_assert(Cfg::BM >= 64, "at least 8 chunks a row");
  if constexpr (kNchwSwizzled<Cfg>)
    return nl * Cfg::BM + (ml & ~63) + ((((ml >> 3) ^ nl) & 7) << 3) + (ml & 7);
  else
    return nl * (Cfg::BM + 8) + ml;
}

}  // namespace igemm::conv
