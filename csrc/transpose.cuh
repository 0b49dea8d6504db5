// igemm: batched 2-D transpose, [B][rows][cols] -> [B][cols][rows], for the conv's NCHW transpose path:
//   x  NCHW  -> NHWC   (B = N, rows = C, cols = H·W)
//   w  KCRS  -> KRSC   (B = K, rows = C, cols = R·S)
// Two such jobs run in one launch (blocks [0, blocks0) do job 0, the rest job 1), so the conv's
// preparation is a single kernel. Elements are moved as raw bits (T = uint16_t or uint32_t).
//
// A block moves one 64 × 64 tile through shared memory (256 threads):
//   Vec (16-bit, rows % 8 == 0, cols % 8 == 0, 16-byte aligned bases): 16-byte loads along cols and
//     16-byte stores along rows; the tile is kept as 32-bit words with a 33-word row pitch, so the
//     load-phase writes are conflict-free and the store-phase gathers at most 2-way conflicted;
//   scalar: element loads and stores (coalesced along cols, then along rows) through a 64 × 65 tile.
#pragma once
#include "common.cuh"

namespace igemm::xpose {

constexpr int kTile = 64, kThreads = 256;

template <class T>
IGEMM_DEVICE void tile_scalar(const T* __restrict__ src, T* __restrict__ dst, int rows, int cols, int img,
                              int r0, int c0) {
  __shared__ uint32_t t[kTile][kTile + 1];
  const int tid = threadIdx.x, lo = tid % kTile, hi = tid / kTile;
  const T* s = src + int64_t(img) * rows * cols;
  T* d = dst + int64_t(img) * rows * cols;
#pragma unroll
  for (int i = 0; i < kTile * kTile / kThreads; ++i) {
    const int r = hi + i * (kThreads / kTile), c = c0 + lo;
    if (r0 + r < rows && c < cols) t[r][lo] = s[int64_t(r0 + r) * cols + c];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kTile * kTile / kThreads; ++i) {
    const int c = hi + i * (kThreads / kTile), r = r0 + lo;
    if (c0 + c < cols && r < rows) d[int64_t(c0 + c) * rows + r] = T(t[lo][c]);
  }
}

IGEMM_DEVICE void tile_vec16(const uint16_t* __restrict__ src, uint16_t* __restrict__ dst, int rows, int cols,
                             int img, int r0, int c0) {
  __shared__ uint32_t t[kTile][kTile / 2 + 1];
  const int tid = threadIdx.x;
  const uint16_t* s = src + int64_t(img) * rows * cols;
  uint16_t* d = dst + int64_t(img) * rows * cols;
  constexpr int CH = kTile / 8;   // 16-byte chunks per tile row
#pragma unroll
  for (int i = 0; i < kTile * CH / kThreads; ++i) {
    const int q = tid + i * kThreads, r = q / CH, cc = q % CH;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r0 + r < rows && c0 + cc * 8 < cols) v = ldg_stream16(s + int64_t(r0 + r) * cols + c0 + cc * 8);
    t[r][cc * 4] = v.x; t[r][cc * 4 + 1] = v.y; t[r][cc * 4 + 2] = v.z; t[r][cc * 4 + 3] = v.w;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kTile * CH / kThreads; ++i) {
    const int q = tid + i * kThreads, c = q / CH, j = q % CH;
    if (c0 + c >= cols || r0 + j * 8 >= rows) continue;
    uint32_t h[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) h[e] = (t[j * 8 + e][c >> 1] >> ((c & 1) * 16)) & 0xffffu;
    const uint4 v = make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16), h[6] | (h[7] << 16));
    stg_stream16(d + int64_t(c0 + c) * rows + r0 + j * 8, v);
  }
}

template <class T, bool Vec>
IGEMM_DEVICE void run_tile(const void* src, void* dst, int rows, int cols, int tr, int tc, int b) {
  const int ct = b % tc, rest = b / tc;   // once per block
  const int rt = rest % tr, img = rest / tr;
  if constexpr (Vec && sizeof(T) == 2) {
    tile_vec16(static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), rows, cols, img, rt * kTile, ct * kTile);
  } else {
    tile_scalar<T>(static_cast<const T*>(src), static_cast<T*>(dst), rows, cols, img, rt * kTile, ct * kTile);
  }
}

template <class T, bool Vec0, bool Vec1, class P>
__device__ void transpose2(const P& p) {
  const int b = blockIdx.x;
  if (b < p.blocks0) run_tile<T, Vec0>(p.src0, const_cast<void*>(p.dst0), p.rows0, p.cols0, p.tr0, p.tc0, b);
  else run_tile<T, Vec1>(p.src1, const_cast<void*>(p.dst1), p.rows1, p.cols1, p.tr1, p.tc1, b - p.blocks0);
}

}  // namespace igemm::xpose
