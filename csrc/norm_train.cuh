// igemm: a training step's BatchNorm passes over a channels-last conv output z, each one cooperative launch whose
// phases are separated by grid barriers (the grid is one resident wave: Python checks the occupancy):
//   bn_train_forward   (1) Welford partials of z (stats_nhwc; or, Conv, the conv epilogue's per-tile statistics
//                      merged: tiles_merge) | (2) a warp per channel merges them: mean, invstd, running statistics
//                      (stats_merge) | (3) y = act(BN(z) [+ residual]) and the ReLU mask (bn_forward's blocks,
//                      run on this grid's blocks; on sm_90 after Conv, z staged in shared memory: TileRing)
//   bn_train_backward  (1) partial sums of dy' = bit ? dy : 0 and dy'·(z - mean) (grad_nhwc; or, Tiles, the dgrad
//                      epilogue's per-tile sums added: tiles_merge) | (2) a warp per channel adds them: sum_dy,
//                      sum_dy_xmu, dgamma, dbeta (grad_merge) and the dz coefficients a, b, c (coefficients_at) |
//                      (3) dz = a·dy' + b·z + c [and sel = dy'] (grad_dz's blocks; on sm_90 staged: TileRing)
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

// A last phase's loads staged through shared memory (sm_90; docs/performance.md: bn-train-staged). Block b of nblk
// walks Parts flat arrays of 16-byte vectors in tiles of tv <= kThreads vectors, tile k at (b + k·nblk)·tv -- the
// vectors a grid-stride loop gives thread t of block b, so a thread keeps a fixed grid's channels -- last tile
// first (the walk from the end, bn-pass-reversed); each tile of each array is a cp.async.bulk copy into a ring of
// S stages, so the loads in flight hold no registers. start() issues the first S copies: a kernel whose inputs do
// not change calls it before its other phases, which the copies then overlap (with their grid barriers).
template <int S, int Parts>
struct TileRing {
  alignas(128) uint8_t buf[S][Parts][kThreads * 16];
  uint64_t full[S];
  const uint8_t* src[Parts];
  int64_t b, nblk, NV, iters;
  int tv;

  IGEMM_DEVICE int64_t first(int64_t j) const { return (b + (iters - 1 - j) * nblk) * tv; }   // (walk step j)

  IGEMM_DEVICE void issue(int64_t j) {                       // thread 0: step j's tile into stage j % S
    const int s = int(j % S);
    const int64_t v0 = first(j);
    const uint32_t bytes = uint32_t(imin64(tv, NV - v0)) * 16u;
    mbar_expect_tx(&full[s], bytes * Parts);
#pragma unroll
    for (int q = 0; q < Parts; ++q) bulk_load(&buf[s][q][0], src[q] + v0 * 16, bytes, &full[s]);
  }

  // Thread 0 (the other threads read the geometry, the barriers and the stages only past a barrier): the
  // geometry, the barriers and the first copies.
  IGEMM_DEVICE void start(const void* const (&arrays)[Parts], int64_t blk, int64_t n, int tile, int64_t nv) {
    if (threadIdx.x != 0) return;
#pragma unroll
    for (int q = 0; q < Parts; ++q) src[q] = static_cast<const uint8_t*>(arrays[q]);
    b = blk, nblk = n, tv = tile, NV = nv;
    const int64_t tiles = (nv + tile - 1) / tile;
    iters = blk < n && blk < tiles ? (tiles - blk + n - 1) / n : 0;
    for (int st = 0; st < S; ++st) mbar_init(&full[st], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    for (int64_t j = 0; j < imin64(S, iters); ++j) issue(j);
  }

  // Step j: wait for its copies, read vector t of array q (at), then release(j) -- every thread of the block.
  IGEMM_DEVICE void wait(int64_t j) { mbar_wait(&full[j % S], uint32_t(j / S) & 1u); }
  IGEMM_DEVICE uint4 at(int64_t j, int q, int t) const {
    return reinterpret_cast<const uint4*>(&buf[j % S][q][0])[t];
  }

  IGEMM_DEVICE void release(int64_t j) {                     // every thread, after its reads of step j's stage
    __syncthreads();
    if (threadIdx.x == 0 && j + S < iters) {
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   // (the reads, before the copy's writes)
      issue(j + S);
    }
  }
};

template <class Ring>
IGEMM_DEVICE Ring& tile_ring() {                            // (static shared memory: only the kernels that stage)
  __shared__ Ring r;
  return r;
}

// The forward's ring: z (and the residual), 32 KB; started on block blockIdx.x of the elementwise grid.
template <bool Res>
using FwdRing = TileRing<Res ? 4 : 8, Res ? 2 : 1>;

template <bool Res, class P>
IGEMM_DEVICE FwdRing<Res>& fwd_ring_start(const P& p) {
  FwdRing<Res>& r = tile_ring<FwdRing<Res>>();
  if constexpr (Res) r.start({p.x, p.res}, blockIdx.x, p.ewb, kThreads, p.NV);
  else r.start({p.x}, blockIdx.x, p.ewb, kThreads, p.NV);
  return r;
}

// bn_forward_block's phase over the ring (tiles of kThreads vectors; the grid fixed), its arithmetic
// (bn_forward_vec: the same bits).
template <class T, int Act, bool Res, class P>
IGEMM_DEVICE void bn_forward_staged(const P& p, FwdRing<Res>& r) {
  const int t = threadIdx.x;
  float cm[8], ca[8], cb[8];
  const int64_t c0 = ((r.b * kThreads + t) * 8) % p.C;               // (a fixed grid: the thread's channels)
  const float* wt = static_cast<const float*>(p.weight);
  const float* bs = static_cast<const float*>(p.bias);
#pragma unroll
  for (int j = 0; j < 8; ++j) {              // (mean, invstd written by this grid: not the read-only path)
    cm[j] = static_cast<const float*>(p.mean)[c0 + j];
    ca[j] = static_cast<const float*>(p.invstd)[c0 + j] * (wt != nullptr ? wt[c0 + j] : 1.f);
    cb[j] = bs != nullptr ? bs[c0 + j] : 0.f;
  }
  T* y = static_cast<T*>(const_cast<void*>(p.y));
  uint32_t* mask = static_cast<uint32_t*>(const_cast<void*>(p.mask));
  for (int64_t j = 0; j < r.iters; ++j) {
    const int64_t v0 = r.first(j);
    r.wait(j);
    const uint4 x = r.at(j, 0, t), rs = Res ? r.at(j, 1, t) : uint4{};
    r.release(j);
    if (v0 + (t & ~31) < p.NV)              // warp-uniform
      bn_forward_vec<T, 8, 8, Act, Res>(reinterpret_cast<const Vec<T, 8>&>(x), reinterpret_cast<const Vec<T, 8>&>(rs),
                                        cm, ca, cb, y, mask, v0 + t, p.NV, t & 31);
  }
}

// Phase 3's blocks: the elementwise grid (p.ewb blocks, at most this grid's: one each) over this grid, in order;
// staged (bn_forward_staged) on sm_90 where phase 1 merges the conv's tiles (its shared memory leaves room for the
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
    if (staged) fwd_ring_start<Res>(p);
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
      bn_forward_staged<T, Act, Res>(p, tile_ring<FwdRing<Res>>());
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

// The dz pass over the ring (dy and z; tiles of p.dzt vectors, thread t < dzt its vector t, channels t % (K / 8): a
// fixed grid), grad_dz_block's arithmetic (select8, bn_dz8: the same bits).
template <class T, int S, class P>
IGEMM_DEVICE void grad_dz_staged(const P& p, TileRing<S, 2>& r) {
  using namespace igemm::backward;
  const int t = threadIdx.x;
  const bool live = t < p.dzt;
  float a[8], b[8], c[8];
  if (live) coefficients8<false>(static_cast<const float*>(p.coef), p.K, 8 * (t % (p.K / 8)), a, b, c);
  const uint8_t* mask = static_cast<const uint8_t*>(p.mask);
  uint4* dst = static_cast<uint4*>(const_cast<void*>(p.dst));
  uint4* sel = static_cast<uint4*>(const_cast<void*>(p.sel));
  for (int64_t j = 0; j < r.iters; ++j) {
    const int64_t v = r.first(j) + t;
    const bool in = live && v < r.NV;
    const uint32_t bits = in && mask ? uint32_t(__ldg(mask + v)) : 0xFFu;   // (before the wait: its latency hidden)
    r.wait(j);
    const uint4 d = r.at(j, 0, t), z = r.at(j, 1, t);
    r.release(j);
    if (in) {
      const uint4 w = select8(d, bits);
      if (sel) sel[v] = w;
      dst[v] = bn_dz8<T>(w, z, a, b, c);
    }
  }
}

// Tiles: phase 1 from the sums the dgrad that wrote dy made per tile (tiles_merge), not from dy and z. Phase 3
// staged (grad_dz_staged) on sm_90: two stages after grad_nhwc (its 24 KB of shared memory), four after tiles_merge.
template <class T, int V, bool Final, bool Tiles = false, class P>
IGEMM_DEVICE void bn_train_backward(const P& p) {
  namespace cg = cooperative_groups;
  static_assert(!(Tiles && Final), "the dgrad's tiles merge into partials");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kStages = Tiles ? 4 : 2;
  const bool staged = p.dzt <= kThreads && gridDim.x >= p.dzb;
  if (staged) tile_ring<TileRing<kStages, 2>>().start({p.src, p.z}, blockIdx.x, p.dzb, p.dzt, p.M * (p.K / 8));
#endif
  if constexpr (Tiles) tiles_merge<2>(p, SumMerge{});
  else grad_nhwc<T, V, Final>(p);
  cg::this_grid().sync();
  bn_backward_coefficients<Final>(p);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (staged) {
    grad_dz_staged<T>(p, tile_ring<TileRing<kStages, 2>>());
    return;
  }
#endif
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
