// igemm: a training step's BatchNorm passes over a channels-last conv output z, each one cooperative launch whose
// phases are separated by grid barriers (the grid is one resident wave: Python checks the occupancy):
//   bn_train_forward   (1) Welford partials of z (stats_nhwc; or, Conv, the conv epilogue's per-tile statistics
//                      merged: tiles_merge) | (2) a warp per channel merges them: mean, invstd, running statistics
//                      (stats_merge) | (3) y = act(BN(z) [+ residual]) and the ReLU mask (bn_forward's blocks,
//                      run on this grid's blocks; on sm_90 after Conv, z staged in shared memory: FwdStages)
//   bn_train_backward  (1) partial sums of dy' = bit ? dy : 0 and dy'·(z - mean) (grad_nhwc; or, Tiles, the dgrad
//                      epilogue's per-tile sums added: tiles_merge) | (2) a warp per channel adds them: sum_dy,
//                      sum_dy_xmu, dgamma, dbeta (grad_merge) and the dz coefficients a, b, c (coefficients_at) |
//                      (3) dz = a·dy' + b·z + c [and sel = dy'] (grad_dz's blocks)
//   bn_train_backward_held  the same three phases over a tensor the grid holds in registers (up to 8 rows of 8
//                      channels a thread): dy' and z read once, phase 3 from the registers (bn-backward-held)
// The same device functions in the same order as the separate launches (norm_stats.cuh, norm_elemt.cuh,
// conv/backward.cuh), on a grid of 3 blocks an SM (the backward's 1 or 2 for a small tensor, whose phases are
// latency: igemm/_norm_train.py train_backward_blocks_per_sm; the statistics' slices, and so their fp32 rounding,
// are that grid's); one launch instead of three or four saves the host a launch call each (docs/performance.md:
// bn-train-one-launch). Final: kernel 1's grid has one slice per channel and phase 1 writes the merged results itself.
// Both last phases walk the tensor from its end (Rev), so what the next kernel reads first (the start of y or dz) is
// what they wrote last, still in L2 (docs/performance.md: bn-pass-reversed).
#pragma once
#include <cooperative_groups.h>

#include "conv/backward.cuh"
#include "conv/tma.cuh"
#include "norm_elemt.cuh"
#include "norm_stats.cuh"

namespace igemm::norm {

// Phase 1 where the conv wrote z's statistics per tile (Conv): its t[k][s][c] (k = count, mean, M2; s < p.ntiles;
// k-stride ntiles·C; csrc/conv/epilogue_regs.cuh: tile_bn_stats) merged in items of 32 channels (p.gx of them) x
// p.L tiles (p.S of them): lane = channel, warp w merges tiles w, w + 8, ... in order, then the warps in order;
// the item's result goes to part[k][c][s'] as stats_nhwc's partials do, so phase 2 is the same merge, unshifted
// (the conv's means are the values' own; z is 16-bit, whose rounding bounds mean / std). The backward's phase 1
// where the dgrad that wrote dy summed it per tile (NK = 2, SumMerge: k = sum dy', sum dy'·(z − mean);
// csrc/conv/dgrad_sm90.cuh, DgradWork::sums) is the same walk, into grad_nhwc's partials.
template <int NK, class Merge, class P>
IGEMM_DEVICE void tiles_merge(const P& p, Merge merge) {
  __shared__ Acc smem[kWarps * 32];
  const float* t = static_cast<const float*>(p.tiles);
  const int64_t C = p.C, T = p.ntiles, ks = T * C;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t b = blockIdx.x; b < int64_t(p.gx) * p.S; b += gridDim.x) {
    const int s2 = int(b / p.gx);
    const int64_t c = (b - int64_t(s2) * p.gx) * 32 + lane;
    Acc r{0.f, 0.f, 0.f};
    if (c < C) {
      const int64_t t1 = imin64(int64_t(s2) * p.L + p.L, T);
      for (int64_t s = int64_t(s2) * p.L + warp; s < t1; s += kWarps) {
        const int64_t i = s * C + c;
        merge(r, Acc{t[i], t[ks + i], NK == 3 ? t[2 * ks + i] : 0.f});
      }
    }
    smem[warp * 32 + lane] = r;
    __syncthreads();
    if (warp == 0 && c < C) write_part(p, c, s2, smem_merge(smem, 32, lane, merge));
    __syncthreads();
  }
}

using igemm::conv::mbar_expect_tx;
using igemm::conv::mbar_init;
using igemm::conv::mbar_wait;
using igemm::conv::smem_u32;

// bytes (a multiple of 16) from src to dst in shared memory, completing on bar's transaction count (sm_90)
IGEMM_DEVICE void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}

// Phase 3 staged through shared memory (sm_90; docs/performance.md: bn-fwd-staged): block b of the elementwise
// grid's nblk visits bn_forward_block's vectors -- tiles of kThreads consecutive 16-byte vectors, tile j at
// (b + j·nblk)·kThreads, thread t the tile's vector t, so its channels are the fixed grid's -- last tile first, each
// tile of z (and of the residual) a cp.async.bulk copy into a ring of kStages, so a block keeps 32 KB of loads in
// flight with no registers held for them; the first kStages copies are issued before phase 1 (z does not change:
// they overlap the statistics' phases and barriers). Then bn_forward_vec as bn_forward_block computes it.
template <class T, bool Res>
struct FwdStages {
  static constexpr int kTile = kThreads * 16, kStages = Res ? 4 : 8, kParts = Res ? 2 : 1;
  alignas(128) uint8_t buf[kStages][kParts][kTile];
  uint64_t full[kStages];
  int64_t tiles, iters;      // the tensor's tiles; this block's

  // Thread 0: copy this block's j-th tile (in the walk's order, last first) into stage j % kStages.
  template <class P>
  IGEMM_DEVICE void issue(const P& p, int64_t b, int64_t nblk, int64_t j) {
    const int s = int(j % kStages);
    const int64_t v0 = (b + (iters - 1 - j) * nblk) * kThreads;
    const uint32_t bytes = uint32_t(imin64(kThreads, p.NV - v0)) * 16u;
    mbar_expect_tx(&full[s], bytes * kParts);
    bulk_load(&buf[s][0][0], static_cast<const uint8_t*>(p.x) + v0 * 16, bytes, &full[s]);
    if constexpr (Res) bulk_load(&buf[s][1][0], static_cast<const uint8_t*>(p.res) + v0 * 16, bytes, &full[s]);
  }

  // Before phase 1 (thread 0; every thread waits past a barrier before it reads the stages).
  template <class P>
  IGEMM_DEVICE void start(const P& p, int64_t b, int64_t nblk) {
    tiles = (p.NV + kThreads - 1) / kThreads;
    iters = b < nblk && b < tiles ? (tiles - b + nblk - 1) / nblk : 0;
    if (threadIdx.x != 0) return;
    for (int s = 0; s < kStages; ++s) mbar_init(&full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    for (int64_t j = 0; j < imin64(kStages, iters); ++j) issue(p, b, nblk, j);
  }

  template <int Act, class P>
  IGEMM_DEVICE void run(const P& p, int64_t b, int64_t nblk) {
    const int lane = threadIdx.x & 31;
    const float* mean = static_cast<const float*>(p.mean);
    const float* invstd = static_cast<const float*>(p.invstd);
    const float* wt = static_cast<const float*>(p.weight);
    const float* bs = static_cast<const float*>(p.bias);
    float cm[8], ca[8], cb[8];
    const int64_t c0 = ((b * kThreads + threadIdx.x) * 8) % p.C;      // (a fixed grid: the thread's channels)
#pragma unroll
    for (int j = 0; j < 8; ++j) {            // (written by this grid: not the read-only path)
      cm[j] = mean[c0 + j];
      ca[j] = invstd[c0 + j] * (wt != nullptr ? wt[c0 + j] : 1.f);
      cb[j] = bs != nullptr ? bs[c0 + j] : 0.f;
    }
    T* y = static_cast<T*>(const_cast<void*>(p.y));
    uint32_t* mask = static_cast<uint32_t*>(const_cast<void*>(p.mask));
    for (int64_t j = 0; j < iters; ++j) {
      const int s = int(j % kStages);
      const int64_t v0 = (b + (iters - 1 - j) * nblk) * kThreads;
      mbar_wait(&full[s], uint32_t(j / kStages) & 1u);
      Vec<T, 8> rx, rr = {};
      rx = reinterpret_cast<const Vec<T, 8>*>(&buf[s][0][0])[threadIdx.x];
      if constexpr (Res) rr = reinterpret_cast<const Vec<T, 8>*>(&buf[s][1][0])[threadIdx.x];
      __syncthreads();                       // (every thread's reads of stage s done: it may be refilled)
      if (threadIdx.x == 0 && j + kStages < iters) {
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   // (the reads, before the copy's writes)
        issue(p, b, nblk, j + kStages);
      }
      if (v0 + (threadIdx.x & ~31) < p.NV)  // warp-uniform
        bn_forward_vec<T, 8, 8, Act, Res>(rx, rr, cm, ca, cb, y, mask, v0 + threadIdx.x, p.NV, lane);
    }
  }
};

// The stages of FwdStages (static shared memory: only the kernels that stage have it).
template <class T, bool Res>
IGEMM_DEVICE FwdStages<T, Res>& fwd_stages() {
  __shared__ FwdStages<T, Res> st;
  return st;
}

// Phase 3's blocks: the elementwise grid (p.ewb blocks, at most this grid's: one each) over this grid, in order;
// staged (FwdStages) on sm_90 where phase 1 merges the conv's tiles (its shared memory leaves room for the
// stages) and the grid is fixed (the thread's channels known: 8 a vector).
// nbt (int64, may be null): BatchNorm2d's num_batches_tracked, incremented once (its add_ would be a launch).
template <class T, int V, int Act, bool Res, bool Final, bool Conv = false, class P>
IGEMM_DEVICE void bn_train_forward(const P& p) {
  namespace cg = cooperative_groups;
  static_assert(!(Conv && Final), "the conv's tiles merge into partials");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kStaged = Conv && V == 8 && sizeof(T) == 2;
#else
  constexpr bool kStaged = false;
#endif
  const bool staged = kStaged && p.fixed && gridDim.x >= p.ewb;
  if constexpr (kStaged)
    if (staged) fwd_stages<T, Res>().start(p, blockIdx.x, p.ewb);
  if (p.nbt != nullptr && blockIdx.x == 0 && threadIdx.x == 0) ++*static_cast<int64_t*>(const_cast<void*>(p.nbt));
  if constexpr (Conv) tiles_merge<3>(p, ChanMerge{});
  else stats_nhwc<T, V, Final>(p);
  cg::this_grid().sync();
  if constexpr (!Final) {
    const int64_t warps = int64_t(gridDim.x) * kWarps;
    for (int64_t c = (int64_t(blockIdx.x) * kThreads + threadIdx.x) >> 5; c < p.C; c += warps)
      stats_merge<T, !Conv>(p, c, threadIdx.x & 31);  // (whole warps: c is warp-uniform)
    cg::this_grid().sync();
  }
  if constexpr (kStaged) {
    if (staged) {
      fwd_stages<T, Res>().template run<Act>(p, blockIdx.x, p.ewb);
      return;
    }
  }
  for (int64_t b = blockIdx.x; b < p.ewb; b += gridDim.x)
    bn_forward_block<T, V, kNHWC, Act, Res, false, true>(p, b, p.ewb);
}

// Phase 3's blocks: the dz pass's grid (p.dzb blocks of p.dzt <= kThreads threads) over this grid, in order, two
// chunks in flight a thread (four, as the dz kernel has, need more registers than three blocks an SM leave).
// The backward's phase 2, after phase 1's barrier: the sums (and the outputs) from the partials, and the dz
// coefficients; then the grid barrier before phase 3.
template <bool Final, class P>
IGEMM_DEVICE void bn_backward_coefficients(const P& p) {
  namespace cg = cooperative_groups;
  if constexpr (Final) {
    for (int64_t c = int64_t(blockIdx.x) * kThreads + threadIdx.x; c < p.C; c += int64_t(gridDim.x) * kThreads)
      igemm::backward::coefficients_at(p, int(c), static_cast<const float*>(p.out0)[c],
                                       static_cast<const float*>(p.out1)[c]);
  } else {
    const int64_t warps = int64_t(gridDim.x) * kWarps;
    const int lane = threadIdx.x & 31;
    for (int64_t c = (int64_t(blockIdx.x) * kThreads + threadIdx.x) >> 5; c < p.C; c += warps) {
      double a, b;
      grad_merge(p, c, lane, a, b);
      if (lane == 0) igemm::backward::coefficients_at(p, int(c), float(a), float(b));
    }
  }
  cg::this_grid().sync();
}

// Tiles: phase 1 from the sums the dgrad that wrote dy made per tile (tiles_merge), not from dy and z.
template <class T, int V, bool Final, bool Tiles = false, class P>
IGEMM_DEVICE void bn_train_backward(const P& p) {
  namespace cg = cooperative_groups;
  static_assert(!(Tiles && Final), "the dgrad's tiles merge into partials");
  if constexpr (Tiles) tiles_merge<2>(p, SumMerge{});
  else grad_nhwc<T, V, Final>(p);
  cg::this_grid().sync();
  bn_backward_coefficients<Final>(p);
  if (threadIdx.x < p.dzt)
    for (int64_t b = blockIdx.x; b < p.dzb; b += gridDim.x)
      igemm::backward::grad_dz_block<igemm::backward::kBn, T, false, 2, true>(p, b, p.dzt, p.dzb);
}

// The backward over a tensor the grid can hold (igemm/_norm_train.py: train_kernel): thread (ty, tx) of block
// (s, bx) loads its rows' dy' = bit ? dy : 0 and z once (rows s·L + ty + k·TY, k < R, channels pk·8 ... pk·8 + 7, as
// grad_nhwc visits them, so phase 1 is its arithmetic), all of them in flight at once, and keeps them in registers
// across both barriers: phase 3 computes dz (and sel = dy') from them, with no second read of dy and z
// (docs/performance.md: bn-backward-held).
template <class T, int R, bool Final, class P>
IGEMM_DEVICE void bn_train_backward_held(const P& p) {
  namespace cg = cooperative_groups;
  using igemm::backward::select8;
  constexpr int V = 8;
  __shared__ Acc smem[kWarps * 32 * V];
  const int tx_n = p.tx, tx = threadIdx.x & (tx_n - 1), ty = threadIdx.x >> p.txs, TY = kThreads >> p.txs;
  const unsigned gx = unsigned(p.gx);
  const int s = int(blockIdx.x / gx), bx = int(blockIdx.x - unsigned(s) * gx);
  const int pk = bx * tx_n + tx;
  const bool live = pk < p.P;
  const int64_t r0 = int64_t(s) * p.L + ty, r1 = imin64(int64_t(s) * p.L + p.L, p.len);
  const int64_t v0 = r0 * (p.C / V) + pk, vstep = int64_t(TY) * (p.C / V);   // in 8-channel vectors
  const uint4* dy = static_cast<const uint4*>(p.dy);
  const uint4* zs = static_cast<const uint4*>(p.x);
  const uint8_t* mask = static_cast<const uint8_t*>(p.mask);
  uint4 d[R], z[R];
  uint32_t bits[R];
#pragma unroll
  for (int k = 0; k < R; ++k) {                 // every load first
    if (live && r0 + k * TY < r1) {
      d[k] = ldg_stream16(dy + v0 + k * vstep);
      z[k] = ldg_stream16(zs + v0 + k * vstep);
      bits[k] = mask ? uint32_t(__ldg(mask + v0 + k * vstep)) : 0xFFu;
    }
  }
  Acc acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = Acc{0.f, 0.f, 0.f};
  if (live) {
    float mu[V];
#pragma unroll
    for (int j = 0; j < V; ++j) mu[j] = static_cast<const float*>(p.mean)[int64_t(pk) * V + j];
#pragma unroll
    for (int k = 0; k < R; ++k) {
      if (r0 + k * TY >= r1) break;
      d[k] = select8(d[k], bits[k]);
      const Vec<T, V>& rd = *reinterpret_cast<const Vec<T, V>*>(&d[k]);
      const Vec<T, V>& rz = *reinterpret_cast<const Vec<T, V>*>(&z[k]);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float g = to_float(rd.v[j]);
        acc[j].a += g;
        acc[j].b = fmaf(g, to_float(rz.v[j]) - mu[j], acc[j].b);
      }
    }
  }
  grad_nhwc_out<V, Final>(p, acc, smem, tx_n, bx, s);
  cg::this_grid().sync();
  bn_backward_coefficients<Final>(p);
  if (!live) return;
  float a[V], b[V], c[V];                      // (written by this grid: not the read-only path)
  igemm::backward::coefficients8<false>(static_cast<const float*>(p.coef), p.K, pk * V, a, b, c);
  uint4* out = static_cast<uint4*>(const_cast<void*>(p.dst));
  uint4* sel = static_cast<uint4*>(const_cast<void*>(p.sel));
#pragma unroll
  for (int k = 0; k < R; ++k) {
    if (r0 + k * TY >= r1) break;
    out[v0 + k * vstep] = igemm::backward::bn_dz8<T>(d[k], z[k], a, b, c);
    if (sel) sel[v0 + k * vstep] = d[k];
  }
}

}  // namespace igemm::norm
