// igemm conv2d forward: the NHWC register epilogue (kStoreRegs).
#pragma once
#include "conv/prologue.cuh"

namespace igemm::conv {

// The NHWC 16-bit C tile (rows of BN + 8 elements) leaves in 16-byte vectors, each with its byte of the ReLU
// mask: thread tid stores column vector tid % CPR of rows tid / CPR + i·NT/CPR.
template <class Cfg, int NT, class P>
IGEMM_DEVICE void store_tile_nhwc(const P& p, const typename Cfg::ElementOut* ct, int tid, int m0, int n0) {
  using TO = typename Cfg::ElementOut;
  constexpr int BN = Cfg::BN, BM = Cfg::BM, LDH = BN + 8, V = Cfg::VecO, CPR = BN / V;
  constexpr int RSTEP = NT / CPR;
  const int col = (tid % CPR) * V, rows = min(BM, p.M - m0);
  if (n0 + col < p.K) {
    const int64_t off = int64_t(m0 + tid / CPR) * p.K + n0 + col;
    TO* y = static_cast<TO*>(const_cast<void*>(p.y)) + off;
    const int64_t ystep = int64_t(RSTEP) * p.K;
    if constexpr (Cfg::FuseMask) {
      // the vector's 8 mask bits (stored value > 0: one set.gt a pair), one byte at bit offset off (K % 8 == 0)
      uint8_t* mb = static_cast<uint8_t*>(const_cast<void*>(p.mask)) + (off >> 3);
      const int64_t mstep = ystep >> 3;
#pragma unroll 4
      for (int row = tid / CPR; row < rows; row += RSTEP, y += ystep, mb += mstep) {
        const uint4 v = *reinterpret_cast<const uint4*>(ct + row * LDH + col);
        store_vec(y, v);
        *mb = mask_byte8<TO>(v);
      }
      // the tensor's last byte (K % 32 != 0 can leave its word part-filled): the rest of the word, past the
      // last element, is zero, as relu_mask leaves it -- by the thread that stored that byte
      const int64_t nbytes = (int64_t(p.M) * p.K) >> 3;
      const int last = rows - 1 - tid / CPR;             // (this thread's rows: tid / CPR + i·RSTEP)
      if ((nbytes & 3) != 0 && m0 + rows == p.M && n0 + col + V == p.K && last >= 0 && last % RSTEP == 0) {
        uint8_t* const m = static_cast<uint8_t*>(const_cast<void*>(p.mask));
        for (int64_t e = nbytes; (e & 3) != 0; ++e) m[e] = 0;
      }
    } else {
#pragma unroll 4
      for (int row = tid / CPR; row < rows; row += RSTEP, y += ystep)
        *reinterpret_cast<uint4*>(y) = *reinterpret_cast<const uint4*>(ct + row * LDH + col);
    }
  }
}

// The tile's BatchNorm statistics (kBnStats, the per-tile kernels), from the 16-bit C tile after its store pass: per
// channel the count, mean and M2 of the stored values, written to p.ws as t[k][s][c] (k = count, mean, M2; tile row
// s = m0 / BM of S = ceil(M / BM); k-stride S·K): one 16-byte vector a thread, coalesced. A thread sums d = y - y0
// over its rows (y0: the tile's first row, one shift for all threads of a column, so their sums add), the lanes of
// a column add theirs by shuffles, the warps through shared memory (the C tile's bytes, after a barrier). The
// statistics are the stored (rounded) values', as a statistics pass over y would see them; csrc/norm_train.cuh
// merges the tiles (docs/performance.md: bn-stats-in-epilogue).
template <class Cfg, int NT, class P, class Sync>
IGEMM_DEVICE void tile_bn_stats(const P& p, const typename Cfg::ElementOut* ct, int tid, int m0, int n0, Sync sync) {
  using TO = typename Cfg::ElementOut;
  constexpr int BN = Cfg::BN, BM = Cfg::BM, LDH = BN + 8, V = Cfg::VecO, CPR = BN / V, RSTEP = NT / CPR;
  constexpr int NW = NT / 32;
  static_assert(V == 8 && 32 % CPR == 0, "a column's lanes in every warp, CPR apart");
  const int col = (tid % CPR) * V, rows = min(BM, p.M - m0);
  auto unpack = [](const uint4& u, float (&f)[V]) {
    unpack_pair<TO>(u.x, f[0], f[1]);
    unpack_pair<TO>(u.y, f[2], f[3]);
    unpack_pair<TO>(u.z, f[4], f[5]);
    unpack_pair<TO>(u.w, f[6], f[7]);
  };
  float y0[V], s1[V], s2[V];
  unpack(*reinterpret_cast<const uint4*>(ct + col), y0);
#pragma unroll
  for (int j = 0; j < V; ++j) s1[j] = s2[j] = 0.f;
#pragma unroll 2
  for (int row = tid / CPR; row < rows; row += RSTEP) {
    float f[V];
    unpack(*reinterpret_cast<const uint4*>(ct + row * LDH + col), f);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float d = f[j] - y0[j];
      s1[j] += d;
      s2[j] = fmaf(d, d, s2[j]);
    }
  }
#pragma unroll
  for (int off = CPR; off < 32; off <<= 1) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      s1[j] += __shfl_xor_sync(0xffffffffu, s1[j], off);
      s2[j] += __shfl_xor_sync(0xffffffffu, s2[j], off);
    }
  }
  sync();                                                 // (every read of the C tile done: its bytes are reused)
  float* red = reinterpret_cast<float*>(const_cast<TO*>(ct));   // [s1: NW][s2: NW][y0: 1] rows of BN
  const int lane = tid & 31, warp = tid / 32;
  if (lane < CPR) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      red[warp * BN + col + j] = s1[j];
      red[(NW + warp) * BN + col + j] = s2[j];
      if (warp == 0) red[2 * NW * BN + col + j] = y0[j];
    }
  }
  sync();
  const int64_t S = (p.M + BM - 1) / BM, ks = S * p.K;
  float* t = static_cast<float*>(const_cast<void*>(p.ws)) + int64_t(m0 / BM) * p.K + n0;
  const float n = float(rows);
  for (int c = tid; c < BN && n0 + c < p.K; c += NT) {
    float a = 0.f, b = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      a += red[w * BN + c];
      b += red[(NW + w) * BN + c];
    }
    const float dm = a / n;
    t[c] = n;
    t[ks + c] = red[2 * NW * BN + c] + dm;
    t[2 * ks + c] = fmaf(-a, dm, b);                      // sum (y - mean)^2 = sum d^2 - (sum d)^2 / n
  }
}

// The register epilogue (kStoreRegs: NHWC output, no split-K), called where acc_to_cs would be (every
// stage read): the chain runs on the accumulators in registers (channels from the fragment layout; the
// residual's element pairs at the fragment's positions, the whole tile's loaded ahead where BN <= 128),
// each value is rounded once into a 16-bit C tile in shared memory (BN + 8 elements a row: the fragment
// writes are conflict-free), and the tile leaves in 16-byte vectors, each with its byte of the ReLU mask
// (four set.gt on the stored pairs: bit = stored y > 0; one byte store, so K % 8 == 0 is all it needs).
// Against the fp32 C tile: half the shared-memory bytes, and no index math or chain work per vector in the
// store loop. The mask comes from the stored vectors, not from the fragments (a quad's four lanes hold a row's
// 32 channels: bit moves and shuffles per word), about half the instructions (docs/performance.md:
// mask-from-vectors).
// NT threads (tid = 0..NT-1, 64 rows a warpgroup) synchronised by `sync`: the CTA, or one consumer
// warpgroup of the persistent kernel; ct: the tile's C buffer; s_vec: its channel vectors.
template <class Cfg, int NT, class P, class Sync>
IGEMM_DEVICE void epilogue_regs_by(const P& p, float* acc, uint8_t* smem, float (*s_vec)[Cfg::BN], int tid,
                                   int m0, int n0, Sync sync, const uint8_t* res_s = nullptr,
                                   const ResidualPairs<Cfg>* pre = nullptr) {
  using TO = typename Cfg::ElementOut;
  using Epi = typename Cfg::Epi;
  constexpr int BN = Cfg::BN, LDH = BN + 8, CPR = BN / Cfg::VecO;
  static_assert(NT % CPR == 0, "whole rows per store pass");
  const int lane = tid & 31, r0 = fragment_row0(tid);
  using RT = typename ResidualPairs<Cfg>::RT;
  // The residual pairs (load_residual_pairs) are loaded G column blocks at a time. With BN <= 128 the whole
  // tile's pairs are loaded at once, before the channel vectors' barrier: one round trip to L2 per tile (or
  // none: staged in shared memory, or preloaded by the patch kernel). In groups of four, each group's loads
  // would wait behind the previous group's work: four round trips after the mainloop.
  constexpr int NB = BN / 8, G = ResidualPairs<Cfg>::G;   // column blocks: all, and per group
  static_assert(NB % G == 0 && G % 4 == 0, "BN / 8 blocks in groups of 4");
  using RawPair = typename ResidualPairs<Cfg>::Raw;
  RawPair ra[G], rb[G];
  auto load_residual = [&](int j0) {
    if constexpr (Epi::kResidual && G == NB) {
      if (pre != nullptr) {     // loaded by the mainloop (kPreloadResidual)
#pragma unroll
        for (int g = 0; g < G; ++g) {
          ra[g] = pre->a[g];
          rb[g] = pre->b[g];
        }
        return;
      }
    }
    if constexpr (kStageResidual<Cfg>) {
      if (res_s != nullptr) {   // staged (stage_residual_smem): this warp's rows, copied by this warp
        static_assert(G == NB, "the whole tile's pairs before the first barrier");
        cp_async_wait<0>();
        __syncwarp();
        // lane l: row (l / 8) % 2 · 8 + l % 8 of the warp's 16 (r & 7 = l % 8), 16-byte chunk 2·jp + l / 16
        const uint8_t* row = res_s + (r0 - (lane >> 2) + ((lane >> 3) & 1) * 8 + (lane & 7)) * (BN * 2);
        const int x = (lane >> 4) ^ (lane & 7);
#pragma unroll
        for (int jp = 0; jp < G / 2; ++jp)
          ldmatrix_x4<false>(row + (((2 * jp) ^ x) << 4), ra[2 * jp], rb[2 * jp], ra[2 * jp + 1], rb[2 * jp + 1]);
        return;
      }
    }
    if constexpr (Epi::kResidual) load_residual_pairs<Cfg, G>(p, m0, n0, tid, j0, ra, rb);
  };
  load_residual(0);
  const epi::Ctx ctx = regs_epilogue_start<Cfg>(p, s_vec, sync);
  TO* ct = reinterpret_cast<TO*>(smem);
  // Without a residual the packed pairs go to the C tile after the whole tile's chain (kDeferStores): a
  // C-tile store between column blocks kept the next block's channel-vector loads behind it (shared memory
  // both: ptxas cannot tell them apart), a shared-memory round trip exposed per block. With a residual, and
  // in the NCHW epilogue, the deferral costs registers, hence not there (docs/performance.md: regs-defer-stores).
  constexpr bool kDeferStores = !Epi::kResidual;
  uint32_t po[kDeferStores ? NB : 1][2];
#pragma unroll
  for (int j0 = 0; j0 < NB; j0 += G) {
    if (j0 > 0) load_residual(j0);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int j = j0 + g;
      const int c = j * 8 + 2 * (lane & 3);
      float v[4] = {acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]};
      const int ch[4] = {c, c + 1, c, c + 1};
      float res[4] = {0.f, 0.f, 0.f, 0.f};
      if constexpr (Epi::kResidual) {
        unpack_pair<RT>(ra[g], res[0], res[1]);
        unpack_pair<RT>(rb[g], res[2], res[3]);
      }
      Epi::template apply<4, epi::kChPairs>(v, ch, res, ctx);
      // (4-byte stores, not stmatrix: with a fused mask its register quads cost more moves than it saves
      // stores -- the set.gt overwrites its operand; docs/performance.md: nhwc-ctile-stores)
      const uint32_t o0 = pack_pair<TO>(v[0], v[1]), o1 = pack_pair<TO>(v[2], v[3]);
      if constexpr (kDeferStores) {
        po[j][0] = o0;
        po[j][1] = o1;
      } else {
        *reinterpret_cast<uint32_t*>(ct + r0 * LDH + c) = o0;
        *reinterpret_cast<uint32_t*>(ct + (r0 + 8) * LDH + c) = o1;
      }
    }
  }
  if constexpr (kDeferStores) {
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      const int c = j * 8 + 2 * (lane & 3);
      *reinterpret_cast<uint32_t*>(ct + r0 * LDH + c) = po[j][0];
      *reinterpret_cast<uint32_t*>(ct + (r0 + 8) * LDH + c) = po[j][1];
    }
  }
  sync();
  store_tile_nhwc<Cfg, NT>(p, ct, tid, m0, n0);
  if constexpr (kBnStats) tile_bn_stats<Cfg, NT>(p, ct, tid, m0, n0, sync);
}

}  // namespace igemm::conv
