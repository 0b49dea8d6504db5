// igemm conv2d backward: the weight gradient's native kernel (sm_90a) for 16-bit NHWC x and dy, read where they
// lie (igemm/conv/_wgrad.py builds the launch), and the sum of its split partials.
//
//   wgrad       dw[k, (r, s, c)] = sum over output pixels (n, p, q) of dy[n, p, q, k] · x[n, p·sh + r·dh − ph,
//               q·sw + s·dw − pw, c]: GEMM M = K, N = R·S·C (dw's row), reduction = N·P·Q. A k-tile is 64 pixels;
//               thread 0 fills a stage with TMA copies completing on its mbarrier: BM / 64 boxes of dy as the
//               [N·P·Q][K] matrix (tiled map: 64 pixels × 64 channels from m0) and BN / 64 boxes of x through the
//               forward's im2col map (64 pixels × 64 channels of one tap; zeros outside the image are the
//               padding, past the last image the tail). Both land with channels contiguous in 128-byte swizzled
//               rows, one row per pixel: MN-major operands of wgmma.m64nBNk16 (one warpgroup per 64 rows of M).
//               Grid (tiles, 1, splits): split z runs k-tiles [z · kt_per_split, ...) and stores its tile into
//               the z-th M × N matrix at p.y (fp32 partials, or dw itself with one split).
//   split_sum   dst (+)= the partials summed in split order (deterministic), 4 elements a thread.
#pragma once
#include "conv/tma.cuh"
#include "conv/wgmma.cuh"

namespace igemm::wgrad {

using namespace igemm::conv;

template <class T, int N> struct Atom;       // both operands MN-major (channels contiguous)
#define IGEMM_WGRAD_ATOM(T, N, NAME) \
  template <> struct Atom<T, N> { using type = gmma::NAME<gmma::Major::MN, gmma::Major::MN>; };
IGEMM_WGRAD_ATOM(cutlass::half_t, 64, MMA_64x64x16_F32F16F16_SS)
IGEMM_WGRAD_ATOM(cutlass::half_t, 128, MMA_64x128x16_F32F16F16_SS)
IGEMM_WGRAD_ATOM(cutlass::bfloat16_t, 64, MMA_64x64x16_F32BF16BF16_SS)
IGEMM_WGRAD_ATOM(cutlass::bfloat16_t, 128, MMA_64x128x16_F32BF16BF16_SS)
#undef IGEMM_WGRAD_ATOM

constexpr int BK = 64;                      // pixels a k-tile
constexpr int BOX = 64 * 64 * 2;            // one TMA box: 64 pixel rows of 64 channels (128 bytes)

template <int BM, int BN, int Stages>
constexpr int smem_bytes() { return Stages * (BM + BN) * BK * 2 + 1024; }

// Two output values (columns c, c + 1 of one row) as TO.
template <class TO>
IGEMM_DEVICE void store_pair(TO* dst, float a, float b) {
  if constexpr (sizeof(TO) == 4) {
    *reinterpret_cast<float2*>(dst) = make_float2(a, b);
  } else {
    TO v[2] = {from_float<TO>(a), from_float<TO>(b)};
    *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(v);
  }
}

template <class T, class TO, int BM, int BN, int Stages, class P>
__device__ void wgrad(const P& p) {
  static_assert(BM % 64 == 0 && (BN == 64 || BN == 128) && Stages >= 2, "64-row warpgroups, 64- or 128-wide tiles");
  constexpr int A_STAGE = BM * BK * 2, B_STAGE = BN * BK * 2, STAGE = A_STAGE + B_STAGE;
  constexpr int NACC = BN / 2, KSTEPS = BK / 16, NB = BN / 64;
  using Mma = typename Atom<T, BN>::type;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);   // SW128 atoms: 1024-aligned
  __shared__ alignas(8) uint64_t full[Stages];

  const int TN = (p.Ncol + BN - 1) / BN;
  const int m0 = (blockIdx.x / TN) * BM, n0 = (blockIdx.x % TN) * BN;
  const int KT = (p.NPQ + BK - 1) / BK;
  const int kt0 = blockIdx.z * p.kt_per_split;
  const int nkt = min(KT, kt0 + p.kt_per_split) - kt0;
  const bool leader = threadIdx.x == 0;
  // each 64-column block's tap: channel c0 and the im2col offsets (s·dw, r·dh); a block past R·S·C loads the
  // last one again (its columns are never stored)
  int bc[NB];
  uint16_t bw[NB], bh[NB];
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    int rs, r, s;
    p.fd_C.divmod(rs, bc[j], min(n0 + 64 * j, p.Ncol - 64));
    p.fd_S.divmod(r, s, rs);
    bw[j] = uint16_t(s * p.dw);
    bh[j] = uint16_t(r * p.dh);
  }
  if (leader) {
#pragma unroll
    for (int s = 0; s < Stages; ++s) mbar_init(&full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    tma_prefetch_maps(p.tmA, p.tmB);
  }
  __syncthreads();
  auto issue = [&](int kt, int buf) {       // thread 0
    const int pix = kt * BK;
    const TileOrigin o = tile_origin(p, pix);
    uint8_t* a = smem + buf * STAGE;
    mbar_expect_tx(&full[buf], STAGE);
#pragma unroll
    for (int i = 0; i < BM / 64; ++i) tma_load_2d(a + i * BOX, p.tmA, &full[buf], m0 + 64 * i, pix);
#pragma unroll
    for (int j = 0; j < NB; ++j)
      tma_load_im2col_4d(a + A_STAGE + j * BOX, p.tmB, &full[buf], bc[j], o.w0, o.h0, o.n, bw[j], bh[j]);
  };
  if (leader) {
#pragma unroll
    for (int st = 0; st < Stages - 1; ++st)
      if (st < nkt) issue(kt0 + st, st);
  }
  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
  const uint32_t sA = smem_u32(smem) + (threadIdx.x / 128) * BOX, sB = smem_u32(smem) + A_STAGE;
  // Iteration i: wait for stage i's bytes -> its wgmma group (a k16 step is 16 pixel rows, 2048 bytes, on both
  // operands) -> wait until only that group is in flight -> barrier (stage i-1 is free in every warpgroup) ->
  // thread 0 refills it with k-tile i + Stages - 1.
  for (int it = 0; it < nkt; ++it) {
    const int buf = it % Stages;
    mbar_wait(&full[buf], (it / Stages) & 1);
    const uint64_t da = desc_mn_sw128(sA + buf * STAGE), db = desc_mn_sw128(sB + buf * STAGE);
#pragma unroll
    for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks)
      gmma_issue<Mma>(da + 128 * ks, db + 128 * ks, acc, std::make_index_sequence<NACC>{});
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<1>();
#pragma unroll
    for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
    __syncthreads();
    const int nk = it + Stages - 1;
    if (leader && nk < nkt) issue(kt0 + nk, nk % Stages);
  }
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
  // (a uniform branch: the accumulators' first reads outside the last wait's basic block, else ptxas serialises
  // the mainloop's wgmmas, warning C7514)
  if (m0 >= p.M) return;
  // the accumulators as mma.sync's C fragment: warp w of warpgroup wg holds rows wg·64 + w·16 + lane/4 (+8) and,
  // per 8-column block j, columns j·8 + 2·(lane % 4) + {0, 1}
  TO* out = static_cast<TO*>(const_cast<void*>(p.y)) + int64_t(blockIdx.z) * p.M * p.Ncol;
  const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3;
  const int r0 = m0 + (threadIdx.x / 128) * 64 + w * 16 + (lane >> 2);
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int c = n0 + j * 8 + 2 * (lane & 3);
    if (c < p.Ncol) {
      if (r0 < p.M) store_pair(out + int64_t(r0) * p.Ncol + c, acc[4 * j], acc[4 * j + 1]);
      if (r0 + 8 < p.M) store_pair(out + int64_t(r0 + 8) * p.Ncol + c, acc[4 * j + 2], acc[4 * j + 3]);
    }
  }
}

// dst[i] (+)= sum over z of src[z·n + i], z = 0, 1, ... in order; n % 4 == 0, src 16-byte aligned, grid-stride.
template <bool Accum, class TD, class P>
__device__ void split_sum(const P& p) {
  const float4* src = static_cast<const float4*>(p.src);
  TD* dst = static_cast<TD*>(const_cast<void*>(p.dst));
  const int64_t n4 = p.n / 4;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    float4 s = __ldcs(src + i);
    for (int z = 1; z < p.splits; ++z) {
      const float4 t = __ldcs(src + z * n4 + i);
      s.x += t.x; s.y += t.y; s.z += t.z; s.w += t.w;
    }
    float v[4] = {s.x, s.y, s.z, s.w};
    TD* d = dst + 4 * i;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (Accum) v[e] += to_float(d[e]);
      d[e] = from_float<TD>(v[e]);
    }
  }
}

}  // namespace igemm::wgrad
