// igemm conv2d backward: the native sm_90a kernels for 16-bit NHWC tensors, read where they lie (no operand is
// moved; igemm/conv/_native.py builds the launches), and the sum of wgrad's split partials.
//
// Both are one per-tile TMA + wgmma mainloop (grad_tile): thread 0 fills each of the Stages stages with TMA copies
// completing on its mbarrier; each warpgroup multiplies its 64 rows with wgmma.m64nBNk16 straight from shared
// memory (128-byte swizzled rows), one group in flight; the tile leaves through shared memory in 16-byte vectors.
//   wgrad  dw[k, (r, s, c)] = sum over output pixels (n, p, q) of dy[n, p, q, k] · x[n, p·sh + r·dh − ph,
//          q·sw + s·dw − pw, c]: GEMM M = K, N = R·S·C (dw's row), reduction = N·P·Q, 64 pixels a k-tile. A = dy as
//          the [N·P·Q][K] matrix (tiled map: 64 pixels × 64 channels from m0), B = x through the forward's im2col
//          map (64 pixels × 64 channels of one tap; zeros outside the image are the padding). Both land channels-
//          contiguous, one row per pixel: MN-major operands. Grid (tiles, 1, splits): split z runs k-tiles
//          [z · kt_per_split, ...) and stores its tile into the z-th M × N matrix at p.y (fp32 partials, or dw
//          itself with one split).
//   dgrad  one output phase of dx (igemm/conv/_backward.py: phases_1d; stride 1 has one): the stride-1 convolution
//          of dy (padding ph, pw and dilation dh, dw of the phase) with the phase's taps of the flipped filter,
//          GEMM M = N × the sub-output's pixels, N = C, reduction = taps × K, a k-tile = one tap × 64 channels of
//          dy. A = dy through an im2col map (K-major, as the forward's A), B = w as [K][R·S][C] (tiled map: 64
//          channels of dy × 64 of x at the filter's tap lh − t·eh, lw − u·ew): MN-major. No filter move; the
//          store puts the phase's rows of the sub-output into dx (no interleave).
//   split_sum  dst (+)= wgrad's partials summed in split order (deterministic), 4 elements a thread.
#pragma once
#include "conv/tma.cuh"
#include "conv/wgmma.cuh"

namespace igemm::grad {

using namespace igemm::conv;

template <class T, int N, gmma::Major MA> struct Atom;       // B MN-major; A K- or MN-major
#define IGEMM_GRAD_ATOM(T, N, NAME) \
  template <gmma::Major MA> struct Atom<T, N, MA> { using type = gmma::NAME<MA, gmma::Major::MN>; };
IGEMM_GRAD_ATOM(cutlass::half_t, 64, MMA_64x64x16_F32F16F16_SS)
IGEMM_GRAD_ATOM(cutlass::half_t, 128, MMA_64x128x16_F32F16F16_SS)
IGEMM_GRAD_ATOM(cutlass::bfloat16_t, 64, MMA_64x64x16_F32BF16BF16_SS)
IGEMM_GRAD_ATOM(cutlass::bfloat16_t, 128, MMA_64x128x16_F32BF16BF16_SS)
#undef IGEMM_GRAD_ATOM

constexpr int BK = 64;                      // a k-tile: 64 elements of the reduction
constexpr int BOX = 64 * 64 * 2;            // one TMA box: 64 rows of 128 bytes

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

// One BM × BN tile over nkt k-tiles: `issue(i, stage)` (thread 0) fills a stage with k-tile i (A at its start, B
// at A_STAGE) and sets its mbarrier's bytes; A is K-major (AMajorK) or MN-major, B MN-major. Row `row` < M of the
// tile lands at out + row_at(row) (an element offset; negative: a row not stored), columns col < Ncol.
template <class T, class TO, int BM, int BN, int Stages, bool AMajorK, class Issue, class RowAt>
IGEMM_DEVICE void grad_tile(uint8_t* smem, uint64_t* full, const Issue& issue, int nkt, TO* out, const RowAt& row_at,
                            int m0, int n0, int M, int Ncol) {
  static_assert(BM % 64 == 0 && (BN == 64 || BN == 128) && Stages >= 2, "64-row warpgroups, 64- or 128-wide tiles");
  constexpr int A_STAGE = BM * BK * 2, STAGE = A_STAGE + BN * BK * 2;
  constexpr int NACC = BN / 2, KSTEPS = BK / 16;
  // a k16 step: +32 bytes in a K-major SW128 row, 16 rows (2048 bytes) of an MN-major tile
  constexpr int ASTEP = AMajorK ? 2 : 128, BSTEP = 128;
  using Mma = typename Atom<T, BN, AMajorK ? gmma::Major::K : gmma::Major::MN>::type;
  const bool leader = threadIdx.x == 0;
  if (leader) {
#pragma unroll
    for (int st = 0; st < Stages - 1; ++st)
      if (st < nkt) issue(st, st);
  }
  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
  const uint32_t sA = smem_u32(smem) + (threadIdx.x / 128) * BOX, sB = smem_u32(smem) + A_STAGE;
  // Iteration i: wait for stage i's bytes -> its wgmma group -> wait until only that group is in flight ->
  // barrier (stage i-1 is free in every warpgroup) -> thread 0 refills it with k-tile i + Stages - 1.
  for (int it = 0; it < nkt; ++it) {
    const int buf = it % Stages;
    mbar_wait(&full[buf], (it / Stages) & 1);
    const uint64_t da = AMajorK ? desc_sw128(sA + buf * STAGE) : desc_mn_sw128(sA + buf * STAGE);
    const uint64_t db = desc_mn_sw128(sB + buf * STAGE);
#pragma unroll
    for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks)
      gmma_issue<Mma>(da + ASTEP * ks, db + BSTEP * ks, acc, std::make_index_sequence<NACC>{});
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<1>();
#pragma unroll
    for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
    __syncthreads();
    const int nk = it + Stages - 1;
    if (leader && nk < nkt) issue(nk, nk % Stages);
  }
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
  // (a uniform branch: the accumulators' first reads outside the last wait's basic block, else ptxas serialises
  // the mainloop's wgmmas, warning C7514)
  if (m0 >= M) return;
  // The tile leaves through shared memory (the stages are free: every wgmma has completed) in 16-byte vectors,
  // whole rows per warp: the accumulators, as mma.sync's C fragment (warp w of warpgroup wg holds rows
  // wg·64 + w·16 + lane/4 (+8) and, per 8-column block j, columns j·8 + 2·(lane % 4) + {0, 1}), go in as pairs
  // first. Rows LD elements apart (16-byte multiples, rows 4 or 8 banks apart: the pair writes are conflict-free
  // for 16-bit types).
  constexpr int V = 16 / sizeof(TO), LD = BN + V;
  static_assert(BM * LD * int(sizeof(TO)) <= Stages * STAGE, "the output tile fits the stages");
  __syncthreads();                          // (every warpgroup is done with the stages)
  TO* cs = reinterpret_cast<TO*>(smem);
  const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3;
  const int rl = (threadIdx.x / 128) * 64 + w * 16 + (lane >> 2);
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int c = j * 8 + 2 * (lane & 3);
    store_pair(cs + rl * LD + c, acc[4 * j], acc[4 * j + 1]);
    store_pair(cs + (rl + 8) * LD + c, acc[4 * j + 2], acc[4 * j + 3]);
  }
  __syncthreads();
  constexpr int NT = BM * 2, VPR = BN / V;  // threads, vectors a row
  const bool whole = Ncol % V == 0;         // (else element stores at the right edge)
  for (int i = threadIdx.x; i < BM * VPR; i += NT) {
    const int r = i / VPR, c = (i % VPR) * V, row = m0 + r, col = n0 + c;
    if (row >= M || col >= Ncol) continue;
    const int64_t at = row_at(row);
    if (at < 0) continue;
    TO* dst = out + at + col;
    const TO* src = cs + r * LD + c;
    if (whole) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e)
        if (col + e < Ncol) dst[e] = src[e];
    }
  }
}

// The stages' mbarriers, initialised by thread 0 (and the maps prefetched); the dynamic shared memory 1024-aligned
// (SW128 atoms).
template <int Stages>
IGEMM_DEVICE uint8_t* grad_setup(uint64_t* full, const void* map_a, const void* map_b) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < Stages; ++s) mbar_init(&full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    tma_prefetch_maps(map_a, map_b);
  }
  __syncthreads();
  return smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
}

// The CTA's tile: blockIdx.x over ceil(M / BM) × ceil(ncol / BN) tiles, column blocks fastest.
template <int BM, int BN>
IGEMM_DEVICE TileCoord grad_tile_coord(int ncol) {
  const int tn = (ncol + BN - 1) / BN;
  return {int(blockIdx.x / tn) * BM, int(blockIdx.x % tn) * BN};
}

template <class T, class TO, int BM, int BN, int Stages, class P>
__device__ void wgrad(const P& p) {
  constexpr int NB = BN / 64, STAGE = (BM + BN) * BK * 2;
  __shared__ alignas(8) uint64_t full[Stages];
  uint8_t* smem = grad_setup<Stages>(full, p.tmA, p.tmB);
  const TileCoord tc = grad_tile_coord<BM, BN>(p.Ncol);
  const int m0 = tc.m0, n0 = tc.n0;
  const int KT = (p.NPQ + BK - 1) / BK;
  const int kt0 = blockIdx.z * p.kt_per_split;
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
  auto issue = [&](int i, int buf) {        // thread 0: k-tile kt0 + i = output pixels (kt0 + i)·64 ..
    const int pix = (kt0 + i) * BK;
    const TileOrigin o = tile_origin(p, pix);
    uint8_t* a = smem + buf * STAGE;
    mbar_expect_tx(&full[buf], STAGE);
#pragma unroll
    for (int k = 0; k < BM / 64; ++k) tma_load_2d(a + k * BOX, p.tmA, &full[buf], m0 + 64 * k, pix);
#pragma unroll
    for (int j = 0; j < NB; ++j)
      tma_load_im2col_4d(a + BM * BK * 2 + j * BOX, p.tmB, &full[buf], bc[j], o.w0, o.h0, o.n, bw[j], bh[j]);
  };
  TO* out = static_cast<TO*>(const_cast<void*>(p.y)) + int64_t(blockIdx.z) * p.M * p.Ncol;
  grad_tile<T, TO, BM, BN, Stages, false>(smem, full, issue, min(KT, kt0 + p.kt_per_split) - kt0, out,
                                          [&](int row) { return int64_t(row) * p.Ncol; }, m0, n0, p.M, p.Ncol);
}

template <class T, int BM, int BN, int Stages, class P>
__device__ void dgrad(const P& p) {
  constexpr int NB = BN / 64, STAGE = (BM + BN) * BK * 2;
  __shared__ alignas(8) uint64_t full[Stages];
  uint8_t* smem = grad_setup<Stages>(full, p.tmA, p.tmB);
  const TileCoord tc = grad_tile_coord<BM, BN>(p.C);
  const int m0 = tc.m0, n0 = tc.n0;
  const TileOrigin o = tile_origin(p, m0);    // sub-output pixel m0 -> dy coordinate of its tap (0, 0)
  auto issue = [&](int kt, int buf) {        // thread 0: k-tile kt = sub-filter tap (t, u) × dy channels kb·64 ..
    int tap, kb, t, u;
    p.fd_KB.divmod(tap, kb, kt);
    p.fd_T.divmod(t, u, tap);
    uint8_t* a = smem + buf * STAGE;
    mbar_expect_tx(&full[buf], STAGE);
    tma_load_im2col_4d(a, p.tmA, &full[buf], kb * BK, o.w0, o.h0, o.n, uint16_t(u * p.dw), uint16_t(t * p.dh));
    const int wtap = (p.lh - t * p.eh) * p.S + (p.lw - u * p.ew);     // the filter's tap, flipped
#pragma unroll
    for (int j = 0; j < NB; ++j)
      tma_load_3d(a + BM * BK * 2 + j * BOX, p.tmB, &full[buf], n0 + 64 * j, wtap, kb * BK);
  };
  // sub-output pixel (n, i, j) -> dx pixel (n, ph_h + st_h·(i − crop_h), ph_w + st_w·(j − crop_w)), rows i and
  // columns j outside the phase's [crop, crop + rows) not stored
  auto row_at = [&](int row) -> int64_t {
    int n, ij, i, j;
    p.fd_PQ.divmod(n, ij, row);
    p.fd_Q.divmod(i, j, ij);
    i -= p.crop_h;
    j -= p.crop_w;
    if (unsigned(i) >= unsigned(p.rows_h) || unsigned(j) >= unsigned(p.rows_w)) return -1;
    return ((int64_t(n) * p.H + p.ph_h + p.st_h * i) * p.W + p.ph_w + p.st_w * j) * p.C;
  };
  grad_tile<T, T, BM, BN, Stages, true>(smem, full, issue, p.KT, static_cast<T*>(const_cast<void*>(p.y)), row_at,
                                        m0, n0, p.M, p.C);
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

}  // namespace igemm::grad
