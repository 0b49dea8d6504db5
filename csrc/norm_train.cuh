// igemm: a training step's BatchNorm passes over a channels-last conv output z, each one cooperative launch whose
// phases are separated by grid barriers (the grid is one resident wave: Python checks the occupancy):
//   bn_train_forward   (1) Welford partials of z (stats_nhwc; or, Conv, the conv epilogue's per-tile statistics
//                      merged: tiles_merge) | (2) a warp per channel merges them: mean, invstd, running statistics
//                      (stats_merge) | (3) y = act(BN(z) [+ residual]) and the ReLU mask (bn_forward's blocks,
//                      run on this grid's blocks)
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

// Phase 3's blocks: the elementwise grid (p.ewb blocks, at most this grid's: one each) over this grid, in order.
// nbt (int64, may be null): BatchNorm2d's num_batches_tracked, incremented once (its add_ would be a launch).
template <class T, int V, int Act, bool Res, bool Final, bool Conv = false, class P>
IGEMM_DEVICE void bn_train_forward(const P& p) {
  namespace cg = cooperative_groups;
  static_assert(!(Conv && Final), "the conv's tiles merge into partials");
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
