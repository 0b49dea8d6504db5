// igemm conv2d backward: how the native kernels' output tile leaves (csrc/conv/grad_sm90.cuh runs them). The
// accumulators are staged as pairs in a shared-memory C tile, then stored by the threads in 16-byte vectors (wgrad),
// by a TMA store of the tile or by a bulk copy a row (dgrad; the adding twin by the copies' reduce-add), the threads
// going on while the copies read.
#pragma once
#include "conv/persistent_sm90.cuh"

namespace igemm::grad {

using namespace igemm::conv;

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

// The accumulators (as mma.sync's C fragment: warp w of warpgroup wg holds rows wg·64 + w·16 + lane/4 (+8) and, per
// 8-column block j, columns j·8 + 2·(lane % 4) + {0, 1}) into the C tile `cs` as pairs, rows LD elements apart
// (16-byte multiples, rows 4 or 8 banks apart: the pair writes are conflict-free for 16-bit types).
template <class TO, int BN>
IGEMM_DEVICE void stage_pairs(const float* acc, TO* cs, int tid) {
  constexpr int LD = BN + 16 / int(sizeof(TO));
  const int lane = tid & 31, w = (tid >> 5) & 3;
  const int rl = (tid / 128) * 64 + w * 16 + (lane >> 2);
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int c = j * 8 + 2 * (lane & 3);
    store_pair(cs + rl * LD + c, acc[4 * j], acc[4 * j + 1]);
    store_pair(cs + (rl + 8) * LD + c, acc[4 * j + 2], acc[4 * j + 3]);
  }
}

// The tile's store by the threads (wgrad's: its tile ends a long reduction, so the store is off the critical path;
// decision log wgrad-rows-not-taken): the tile staged in `cs`, then out in 16-byte vectors, whole rows per warp, by
// the NT threads of the tile's warpgroups (tid = 0..NT-1; `sync` orders them). Row `row` < M lands at
// out + row_at(row) (an element offset; negative: a row not stored), columns col < Ncol.
template <class TO, int BM, int BN, int NT, class RowAt, class Sync>
IGEMM_DEVICE void store_tile(const float* acc, TO* cs, int tid, TO* out, const RowAt& row_at, int m0, int n0, int M,
                             int Ncol, Sync sync) {
  constexpr int V = 16 / sizeof(TO), LD = BN + V;
  stage_pairs<TO, BN>(acc, cs, tid);
  sync();
  constexpr int VPR = BN / V;               // vectors a row
  const bool whole = Ncol % V == 0;         // (else element stores at the right edge)
  for (int i = tid; i < BM * VPR; i += NT) {
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

// The C tile's bytes (a 16-byte vector of padding a row).
template <class TO, int BM, int BN>
constexpr int kCTileBytes = BM * (BN + 16 / int(sizeof(TO))) * int(sizeof(TO));

// The tile's asynchronous stores: cp.async.bulk.tensor of a whole block (a tensor map), or cp.async.bulk of bytes;
// one bulk group a thread's tile; bulk_wait_read: until the thread's groups have read their shared memory (the C
// tile may be written again).
// kStoreRowsZeros: kStoreRows, and dx's pixels beside each row that no tap reaches zeroed (dgrad-fill-zeros).
enum GradStore { kStoreThreads = 0, kStoreTensor = 1, kStoreRows = 2, kStoreRowsZeros = 3 };
// Add: the copy adds into global memory (an f16 / bf16 add rounded once: what adding the stored tile as a separate
// step gives, bit for bit).
template <bool Add>
IGEMM_DEVICE void tma_store_2d(const void* map, const void* src, int c0, int c1) {
  if constexpr (Add)
    asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3}], [%1];\n"
                 ::"l"(map), "r"(smem_u32(src)), "r"(c0), "r"(c1) : "memory");
  else
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n"
                 ::"l"(map), "r"(smem_u32(src)), "r"(c0), "r"(c1) : "memory");
}
template <bool Add, class TO>
IGEMM_DEVICE void bulk_store(TO* dst, const TO* src, int bytes) {
  if constexpr (!Add)
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                 ::"l"(dst), "r"(smem_u32(src)), "r"(bytes) : "memory");
  else if constexpr (std::is_same_v<TO, cutlass::half_t>)
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.f16 [%0], [%1], %2;\n"
                 ::"l"(dst), "r"(smem_u32(src)), "r"(bytes) : "memory");
  else
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.bf16 [%0], [%1], %2;\n"
                 ::"l"(dst), "r"(smem_u32(src)), "r"(bytes) : "memory");
}
IGEMM_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
IGEMM_DEVICE void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
IGEMM_DEVICE void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// The tile's store by TMA (docs/performance.md: dgrad-tma-store): the accumulators as pairs into `cs` (1024-byte
// aligned) in the map's SW128 layout -- per 64-column block BM rows of 128 bytes, 16-byte chunk j of row r at
// j ^ (r % 8), so a warp's pair writes hit 32 distinct banks -- then thread 0 copies each block to (n0 + 64·b, m0)
// of the [M][Ncol] map, which drops the rows and columns past the tensor's end. The threads go on at once; the
// copy's reads of cs must finish (bulk_wait_read) before cs is written again.
template <class TO, int BM, int BN, bool Add, class Sync>
IGEMM_DEVICE void store_tile_tma(const float* acc, uint8_t* cs, int tid, const void* map, int m0, int n0, Sync sync) {
  static_assert(sizeof(TO) == 2, "16-bit tiles: 64 columns are one 128-byte swizzled row");
  const int lane = tid & 31, w = (tid >> 5) & 3;
  const int rl = (tid / 128) * 64 + w * 16 + (lane >> 2);
  uint8_t* row = cs + rl * 128 + 4 * (lane & 3);
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    uint8_t* at = row + (j / 8) * BM * 128 + (((j % 8) ^ (rl & 7)) << 4);
    store_pair(reinterpret_cast<TO*>(at), acc[4 * j], acc[4 * j + 1]);
    store_pair(reinterpret_cast<TO*>(at + 8 * 128), acc[4 * j + 2], acc[4 * j + 3]);   // (row rl + 8: same XOR)
  }
  fence_proxy_async();                      // (the generic-proxy writes, before the async proxy reads them)
  sync();
  if (tid == 0) {
#pragma unroll
    for (int b = 0; b < BN / 64; ++b) tma_store_2d<Add>(map, cs + b * BM * 128, n0 + 64 * b, m0);
    bulk_commit();
  }
}

// The tile's store by bulk copies, a row a thread (docs/performance.md: dgrad-bulk-rows): the accumulators into cs
// as store_tile stages them, then thread r < BM copies row r's columns < Ncol (16-byte multiples) to
// out + row_at(m0 + r) + n0 in one cp.async.bulk: any row mapping (a strided phase's rows). The threads go on at
// once; each waits for its copy's reads (bulk_wait_read) before cs is written again.
template <class TO, int BM, int BN, bool Add, class RowAt, class Sync>
IGEMM_DEVICE void store_tile_rows(const float* acc, TO* cs, int tid, TO* out, const RowAt& row_at, int m0, int n0,
                                  int M, int Ncol, Sync sync) {
  constexpr int LD = BN + 16 / int(sizeof(TO));
  stage_pairs<TO, BN>(acc, cs, tid);
  fence_proxy_async();
  sync();
  const int row = m0 + tid;
  const int64_t at = tid < BM && row < M ? row_at(row) : -1;
  if (at >= 0) {
    bulk_store<Add>(out + at + n0, cs + tid * LD, min(BN, Ncol - n0) * int(sizeof(TO)));
    bulk_commit();
  }
}

}  // namespace igemm::grad
