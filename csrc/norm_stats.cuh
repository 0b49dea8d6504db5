// igemm: BatchNorm per-channel reductions.
//   stats_nchw / stats_nhwc    Welford (count, mean, M2) per (block, channel)       [kernel 1]
//   grad_nchw  / grad_nhwc     (sum dy', sum dy'*(x - mean)), dy' = mask bit ? dy : 0  [kernel 1]
//   stats_finalize / grad_finalize   per channel, merge the S block partials in slice order [kernel 2]
//                              (a warp per channel, or with *_block a block per channel)
//   gather_stats               Chan's merge of W per-rank (mean, var, count) rows, rank order
//   sum_ranks                  sum of W per-rank (sum_dy, sum_dy_xmu) rows, rank order
// No atomics anywhere: every merge has a fixed order, so results depend only on the input (and the
// grid, which depends only on the shape and the GPU). When the grid has one slice per channel (S == 1)
// kernel 1 writes the outputs itself and kernel 2 is not launched.
//
// Kernel-1 geometry (Python: igemm/norm.py `reduction_config`).
// NCHW: block b = (channel c = b / S, slice s = b % S). The channel's elements are N planes of
//   VPP = HW / V vectors; flattened, vector g = n * VPP + v (0 <= g < len = N * VPP). Slice s covers
//   g in [s*L, min(s*L + L, len)); thread t visits g = s*L + t + k*kThreads, and tracks (v, element
//   offset) incrementally: a step of kThreads vectors moves dn = kThreads / VPP planes and
//   dv = kThreads % VPP vectors, offset += doff (= dn*C*HW + dv*V); on wrap (v >= VPP) v -= VPP and
//   offset += dwrap (= C*HW - HW). The V elements of one vector belong to one channel.
// NHWC: block b = (slice s = b / gx, channel tile bx = b % gx). Thread (ty, tx) = (t >> txs,
//   t & (tx - 1)) owns the channel pack pk = bx * tx + tx (channels pk*V .. pk*V + V - 1, pk < P = C/V)
//   and the rows m = s*L + ty + k*(kThreads / tx) below min(s*L + L, len = N*HW).
// Partials: part[k][c][s] (k = 0..2, floats, k-stride C*S).
//
// Shift. Welford runs on x - K_c, K_c = x at the channel's first element (offset c * shift): a mean
// of 1e4 with a std of 1e-3 then costs nothing in fp32. Every block of a channel uses the same K_c,
// partials merge in the shifted frame, and the mean gets K_c back in double at the end.
#pragma once
#include "norm.cuh"

namespace igemm::norm {

IGEMM_DEVICE int64_t imin64(int64_t a, int64_t b) { return a < b ? a : b; }

template <int V>
struct PlaneWalk {
  int64_t v, off;
  template <class P>
  IGEMM_DEVICE void init(int64_t g, int64_t c, const P& p) {
    const int64_t n = g / p.VPP;
    v = g - n * p.VPP;
    off = (n * p.C + c) * p.HW + v * V;
  }
  template <class P>
  IGEMM_DEVICE void step(const P& p) {
    v += p.dv;
    off += p.doff;
    if (v >= p.VPP) {
      v -= p.VPP;
      off += p.dwrap;
    }
  }
};

template <class P>
IGEMM_DEVICE void write_part(const P& p, int64_t c, int s, const Acc& r) {
  float* part = static_cast<float*>(const_cast<void*>(p.part));
  const int64_t cs = int64_t(p.C) * p.S;
  const int64_t i = c * p.S + s;
  part[i] = r.a;
  part[cs + i] = r.b;
  part[2 * cs + i] = r.c;
}

IGEMM_DEVICE float invstd_of(double var, float eps) {
  // PyTorch's InvStd: 0 when var == 0 and eps == 0, else 1 / sqrt(var + eps).
  if (var == 0.0 && eps == 0.f) return 0.f;
  return float(1.0 / sqrt(var + double(eps)));
}

// Running statistics (fp32, in place): PyTorch's update with the unbiased variance.
template <class P>
IGEMM_DEVICE void update_running(const P& p, int64_t c, double mean, double var, double total) {
  if (p.run_mean == nullptr || !(total > 0.0)) return;
  float* rm = static_cast<float*>(const_cast<void*>(p.run_mean));
  float* rv = static_cast<float*>(const_cast<void*>(p.run_var));
  const double mom = double(p.momentum);
  rm[c] = float((1.0 - mom) * double(rm[c]) + mom * mean);
  if (total > 1.0) rv[c] = float((1.0 - mom) * double(rv[c]) + mom * var * total / (total - 1.0));
}

// Final per-channel statistics from the merged shifted Welford state r.
// mode 0: out0/out1/out2 = mean, biased var, count (fp32, or fp64 when f64);
// mode 1: out0/out1 = mean, invstd (fp32). Shifted = false: r's mean is the values' own (no K_c to add back).
template <class T, bool Shifted = true, class P>
IGEMM_DEVICE void stats_write(const P& p, int64_t c, const Acc& r) {
  const double total = double(p.total);
  double mean = 0.0, var = 0.0;
  if (p.total > 0) {
    mean = double(r.b);
    if constexpr (Shifted) mean += double(to_float(static_cast<const T*>(p.x)[c * p.shift]));
    var = (r.c < 0.f ? 0.0 : double(r.c)) / total;   // NaN stays NaN
  }
  if (p.mode == 0) {
    store_stat(p.out0, c, mean, p.f64);
    store_stat(p.out1, c, var, p.f64);
    store_stat(p.out2, c, total, p.f64);
  } else {
    static_cast<float*>(const_cast<void*>(p.out0))[c] = float(mean);
    static_cast<float*>(const_cast<void*>(p.out1))[c] = invstd_of(var, p.eps);
  }
  update_running(p, c, mean, var, total);
}

// sum_dy, sum_dy_xmu (fp32, or fp64 when f64); grad_weight = sum_dy_xmu * invstd and grad_bias = sum_dy
// (fp32) where those pointers are given.
template <class P>
IGEMM_DEVICE void grad_write(const P& p, int64_t c, double sdy, double sdx) {
  store_stat(p.out0, c, sdy, p.f64);
  store_stat(p.out1, c, sdx, p.f64);
  if (p.out2 != nullptr) {
    const float* invstd = static_cast<const float*>(p.invstd);
    static_cast<float*>(const_cast<void*>(p.out2))[c] = float(sdx * double(invstd[c]));
  }
  if (p.out3 != nullptr) static_cast<float*>(const_cast<void*>(p.out3))[c] = float(sdy);
}

// ------------------------------------------------------------------------------------- Welford
template <class T, int V, bool Final, class P>
IGEMM_DEVICE void stats_nchw(const P& p) {
  constexpr int U = 4;
  __shared__ Acc smem[kWarps];
  const T* x = static_cast<const T*>(p.x);
  const unsigned S = unsigned(p.S);
  const int64_t c = blockIdx.x / S;
  const int s = int(blockIdx.x - unsigned(c) * S);
  const float K = to_float(x[c * p.HW]);
  const int64_t g1 = imin64(int64_t(s) * p.L + p.L, p.len);
  int64_t g = int64_t(s) * p.L + threadIdx.x;
  PlaneWalk<V> w;
  w.init(g, c, p);
  Acc acc{0.f, 0.f, 0.f};
  for (; g + (U - 1) * kThreads < g1; g += U * kThreads) {
    Vec<T, V> raw[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      raw[u] = load_raw<T, V>(x + w.off);
      w.step(p);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float f[V];
      to_floats<T, V>(raw[u], f);
      welford_batch<V>(acc, f, K);
    }
  }
  for (; g < g1; g += kThreads) {
    float f[V];
    load_vec<T, V>(x + w.off, f);
    w.step(p);
    welford_batch<V>(acc, f, K);
  }
  Acc a1[1] = {acc};
  warp_to_smem<1>(a1, smem, 1, ChanMerge{});
  if (threadIdx.x == 0) {
    const Acc r = smem_merge(smem, 1, 0, ChanMerge{});
    if constexpr (Final) {
      stats_write<T>(p, c, r);
    } else {
      write_part(p, c, s, r);
    }
  }
}

template <class T, int V, bool Final, class P>
IGEMM_DEVICE void stats_nhwc(const P& p) {
  constexpr int U = V == 8 ? 2 : 4;  // rows per batch; 8 channels x 4 rows would spill (bf16)
  __shared__ Acc smem[kWarps * 32 * V];
  const T* x = static_cast<const T*>(p.x);
  const int tx_n = p.tx;
  const int tx = threadIdx.x & (tx_n - 1);
  const int ty = threadIdx.x >> p.txs;
  const int TY = kThreads >> p.txs;
  const unsigned gx = unsigned(p.gx);
  const int s = int(blockIdx.x / gx);
  const int bx = int(blockIdx.x - unsigned(s) * gx);
  const int pk = bx * tx_n + tx;
  const int64_t C = p.C;
  Acc acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = Acc{0.f, 0.f, 0.f};
  if (pk < p.P) {
    float K[V];
    load_vec<T, V>(x + int64_t(pk) * V, K);
    const int64_t r1 = imin64(int64_t(s) * p.L + p.L, p.len);
    int64_t r = int64_t(s) * p.L + ty;
    const T* xp = x + r * C + int64_t(pk) * V;
    const int64_t rstep = int64_t(TY) * C;
    float n = 0.f;
    for (; r + (U - 1) * TY < r1; r += U * TY) {
      Vec<T, V> raw[U];
#pragma unroll
      for (int u = 0; u < U; ++u) raw[u] = load_raw<T, V>(xp + u * rstep);
      xp += U * rstep;
      const float nn = n + float(U);
      const float rr = __fdividef(float(U), nn);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        float d[U];
#pragma unroll
        for (int u = 0; u < U; ++u) d[u] = to_float(raw[u].v[j]) - K[j];
        float mb;
        if constexpr (U == 4) {
          mb = ((d[0] + d[1]) + (d[2] + d[3])) * 0.25f;
        } else {
          static_assert(U == 2, "batch mean written for U = 2 or 4");
          mb = (d[0] + d[1]) * 0.5f;
        }
        float q = 0.f;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const float e = d[u] - mb;
          q = fmaf(e, e, q);
        }
        const float delta = mb - acc[j].b;
        acc[j].b = fmaf(delta, rr, acc[j].b);
        acc[j].c += q + delta * delta * n * rr;
      }
      n = nn;
    }
    for (; r < r1; r += TY) {
      float f[V];
      load_vec<T, V>(xp, f);
      xp += rstep;
      const float nn = n + 1.f;
      const float rr = __fdividef(1.f, nn);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float d = f[j] - K[j];
        const float delta = d - acc[j].b;
        acc[j].b = fmaf(delta, rr, acc[j].b);
        acc[j].c = fmaf(delta, d - acc[j].b, acc[j].c);
      }
      n = nn;
    }
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j].a = n;
  }
  warp_to_smem<V>(acc, smem, tx_n, ChanMerge{});
  const int i = threadIdx.x;
  if (i < tx_n * V) {
    const int64_t c = int64_t(bx) * tx_n * V + i;
    if (c < C) {
      const Acc r = smem_merge(smem, tx_n * V, i, ChanMerge{});
      if constexpr (Final) {
        stats_write<T>(p, c, r);
      } else {
        write_part(p, c, s, r);
      }
    }
  }
}

// Channel c's S partials merged by one warp (lane 0 writes the statistics).
template <class T, bool Shifted = true, class P>
IGEMM_DEVICE void stats_merge(const P& p, int64_t c, int lane) {
  const float* part = static_cast<const float*>(p.part);
  const int S = p.S;
  const int64_t cs = int64_t(p.C) * S;
  Acc r{0.f, 0.f, 0.f};
#pragma unroll 4
  for (int s = lane; s < S; s += 32) {
    const int64_t i = c * S + s;
    ChanMerge{}(r, Acc{part[i], part[cs + i], part[2 * cs + i]});
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ChanMerge{}(r, shfl_xor(r, off));
  if (lane == 0) stats_write<T, Shifted>(p, c, r);
}

template <class T, class P>
IGEMM_DEVICE void stats_finalize(const P& p) {
  const int64_t c = (int64_t(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  if (c < p.C) stats_merge<T>(p, c, threadIdx.x & 31);  // whole warps
}

// The same with a block per channel (few channels, many slices: C blocks of kThreads threads).
template <class T, class P>
IGEMM_DEVICE void stats_finalize_block(const P& p) {
  __shared__ Acc smem[kWarps];
  const int64_t c = blockIdx.x;
  const float* part = static_cast<const float*>(p.part);
  const int S = p.S;
  const int64_t cs = int64_t(p.C) * S;
  Acc r[1] = {Acc{0.f, 0.f, 0.f}};
#pragma unroll 2
  for (int s = threadIdx.x; s < S; s += kThreads) {
    const int64_t i = c * S + s;
    ChanMerge{}(r[0], Acc{part[i], part[cs + i], part[2 * cs + i]});
  }
  warp_to_smem<1>(r, smem, 1, ChanMerge{});
  if (threadIdx.x == 0) stats_write<T>(p, c, smem_merge(smem, 1, 0, ChanMerge{}));
}

// ------------------------------------------------------------------------------------- backward sums
template <class T, int V>
IGEMM_DEVICE void grad_accum(const Vec<T, V>& rd, const Vec<T, V>& rx, uint32_t bits, float mu, float& s1,
                             float& s2) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float d = ((bits >> j) & 1u) ? to_float(rd.v[j]) : 0.f;  // a select: inf/NaN masked out
    s1 += d;
    s2 = fmaf(d, to_float(rx.v[j]) - mu, s2);
  }
}

template <class T, int V, bool Final, class P>
IGEMM_DEVICE void grad_nchw(const P& p) {
  constexpr int U = 2;
  __shared__ Acc smem[kWarps];
  const T* dy = static_cast<const T*>(p.dy);
  const T* x = static_cast<const T*>(p.x);
  const uint32_t* mask = static_cast<const uint32_t*>(p.mask);
  const unsigned S = unsigned(p.S);
  const int64_t c = blockIdx.x / S;
  const int s = int(blockIdx.x - unsigned(c) * S);
  const float mu = static_cast<const float*>(p.mean)[c];
  const int64_t g1 = imin64(int64_t(s) * p.L + p.L, p.len);
  int64_t g = int64_t(s) * p.L + threadIdx.x;
  PlaneWalk<V> w;
  w.init(g, c, p);
  float s1 = 0.f, s2 = 0.f;
  for (; g + (U - 1) * kThreads < g1; g += U * kThreads) {
    Vec<T, V> rd[U], rx[U];
    uint32_t bits[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      rd[u] = load_raw<T, V>(dy + w.off);
      rx[u] = load_raw<T, V>(x + w.off);
      bits[u] = mask != nullptr ? (__ldg(mask + (w.off >> 5)) >> (w.off & 31)) : 0xffffffffu;
      w.step(p);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) grad_accum<T, V>(rd[u], rx[u], bits[u], mu, s1, s2);
  }
  for (; g < g1; g += kThreads) {
    const Vec<T, V> rd = load_raw<T, V>(dy + w.off);
    const Vec<T, V> rx = load_raw<T, V>(x + w.off);
    const uint32_t bits = mask != nullptr ? (__ldg(mask + (w.off >> 5)) >> (w.off & 31)) : 0xffffffffu;
    w.step(p);
    grad_accum<T, V>(rd, rx, bits, mu, s1, s2);
  }
  Acc a1[1] = {Acc{s1, s2, 0.f}};
  warp_to_smem<1>(a1, smem, 1, SumMerge{});
  if (threadIdx.x == 0) {
    const Acc r = smem_merge(smem, 1, 0, SumMerge{});
    if constexpr (Final) {
      grad_write(p, c, double(r.a), double(r.b));
    } else {
      write_part(p, c, s, r);
    }
  }
}

// The NHWC block's per-thread sums (thread (ty, tx): channels (bx·tx_n + tx)·V ...) merged over the warps in order
// and written as slice s's partials (Final: the outputs).
template <int V, bool Final, class P>
IGEMM_DEVICE void grad_nhwc_out(const P& p, Acc (&acc)[V], Acc* smem, int tx_n, int bx, int s) {
  warp_to_smem<V>(acc, smem, tx_n, SumMerge{});
  const int i = threadIdx.x;
  if (i < tx_n * V) {
    const int64_t c = int64_t(bx) * tx_n * V + i;
    if (c < p.C) {
      const Acc r = smem_merge(smem, tx_n * V, i, SumMerge{});
      if constexpr (Final) {
        grad_write(p, c, double(r.a), double(r.b));
      } else {
        write_part(p, c, s, r);
      }
    }
  }
}

template <class T, int V, bool Final, class P>
IGEMM_DEVICE void grad_nhwc(const P& p) {
  constexpr int U = V == 8 ? 1 : 2;  // rows per iteration; U = 2 with 8 channels would spill (bf16)
  __shared__ Acc smem[kWarps * 32 * V];
  const T* dy = static_cast<const T*>(p.dy);
  const T* x = static_cast<const T*>(p.x);
  const uint32_t* mask = static_cast<const uint32_t*>(p.mask);
  const float* mean = static_cast<const float*>(p.mean);
  const int tx_n = p.tx;
  const int tx = threadIdx.x & (tx_n - 1);
  const int ty = threadIdx.x >> p.txs;
  const int TY = kThreads >> p.txs;
  const unsigned gx = unsigned(p.gx);
  const int s = int(blockIdx.x / gx);
  const int bx = int(blockIdx.x - unsigned(s) * gx);
  const int pk = bx * tx_n + tx;
  const int64_t C = p.C;
  Acc acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = Acc{0.f, 0.f, 0.f};
  if (pk < p.P) {
    float mu[V];
#pragma unroll
    for (int j = 0; j < V; ++j) mu[j] = mean[int64_t(pk) * V + j];
    const int64_t r1 = imin64(int64_t(s) * p.L + p.L, p.len);
    int64_t r = int64_t(s) * p.L + ty;
    int64_t off = r * C + int64_t(pk) * V;
    const int64_t rstep = int64_t(TY) * C;
    for (; r < r1; r += U * TY) {
      Vec<T, V> rd[U], rx[U];
      uint32_t bits[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t o = off + u * rstep;
        if (r + u * TY < r1) {
          rd[u] = load_raw<T, V>(dy + o);
          rx[u] = load_raw<T, V>(x + o);
          bits[u] = mask != nullptr ? (__ldg(mask + (o >> 5)) >> (o & 31)) : 0xffffffffu;
        } else {
          bits[u] = 0u;  // contributes d = 0 and 0 * (x - mu) with x = 0: nothing
#pragma unroll
          for (int j = 0; j < V; ++j) rd[u].v[j] = rx[u].v[j] = from_float<T>(0.f);
        }
      }
      off += U * rstep;
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float d = ((bits[u] >> j) & 1u) ? to_float(rd[u].v[j]) : 0.f;
          acc[j].a += d;
          acc[j].b = fmaf(d, to_float(rx[u].v[j]) - mu[j], acc[j].b);
        }
      }
    }
  }
  grad_nhwc_out<V, Final>(p, acc, smem, tx_n, bx, s);
}

// Channel c's S partial sums added by one warp in fp64; every lane gets (sum_dy, sum_dy_xmu), lane 0 writes them.
template <class P>
IGEMM_DEVICE void grad_merge(const P& p, int64_t c, int lane, double& a, double& b) {
  const float* part = static_cast<const float*>(p.part);
  const int S = p.S;
  const int64_t cs = int64_t(p.C) * S;
  a = 0.0;
  b = 0.0;
#pragma unroll 4
  for (int s = lane; s < S; s += 32) {
    const int64_t i = c * S + s;
    a += double(part[i]);
    b += double(part[cs + i]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, off);
    b += __shfl_xor_sync(0xffffffffu, b, off);
  }
  if (lane == 0) grad_write(p, c, a, b);
}

template <class P>
IGEMM_DEVICE void grad_finalize(const P& p) {
  const int64_t c = (int64_t(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  if (c >= p.C) return;  // whole warps
  double a, b;
  grad_merge(p, c, threadIdx.x & 31, a, b);
}

template <class P>
IGEMM_DEVICE void grad_finalize_block(const P& p) {
  __shared__ double sa[kWarps], sb[kWarps];
  const int64_t c = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* part = static_cast<const float*>(p.part);
  const int S = p.S;
  const int64_t cs = int64_t(p.C) * S;
  double a = 0.0, b = 0.0;
  for (int s = threadIdx.x; s < S; s += kThreads) {
    const int64_t i = c * S + s;
    a += double(part[i]);
    b += double(part[cs + i]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, off);
    b += __shfl_xor_sync(0xffffffffu, b, off);
  }
  if (lane == 0) {
    sa[warp] = a;
    sb[warp] = b;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    a = sa[0];
    b = sb[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      a += sa[w];
      b += sb[w];
    }
    grad_write(p, c, a, b);
  }
}

// ------------------------------------------------------------------------------------- across ranks
// Rank w's mean/var of channel c at mean[w*rs + c] / var[w*rs + c], its count at
// cnt[w*cnt_rs + c*cnt_cs] (cnt_cs = 0: one count per rank). Ranks with count <= 0 (or NaN) are
// skipped by a select, on the device: no host synchronisation, graph-capturable. Merged in fp64.
// mode 0: out0/out1/out2 = mean, var, count (fp32, or fp64 when f64);
// mode 1: out0/out1 = mean, invstd (fp32), out2 = count (fp32) if given, running stats if given.
template <class InT, class CntT, class P>
IGEMM_DEVICE void gather_stats(const P& p) {
  const int64_t c = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= p.C) return;
  const InT* mean = static_cast<const InT*>(p.mean);
  const InT* var = static_cast<const InT*>(p.var);
  const CntT* cnt = static_cast<const CntT*>(p.cnt);
  double n = 0.0, m = 0.0, q = 0.0;
  for (int w = 0; w < p.W; ++w) {
    const double nb = double(cnt[w * p.cnt_rs + c * p.cnt_cs]);
    if (nb > 0.0) {
      const double mb = double(mean[w * p.rs + c]);
      const double vb = double(var[w * p.rs + c]);
      if (n == 0.0) {
        n = nb;
        m = mb;
        q = vb * nb;
      } else {
        const double nn = n + nb;
        const double d = mb - m;
        const double r = nb / nn;
        m += d * r;
        q += vb * nb + d * d * n * r;
        n = nn;
      }
    }
  }
  const double v = n > 0.0 ? q / n : 0.0;
  if (p.mode == 0) {
    store_stat(p.out0, c, m, p.f64);
    store_stat(p.out1, c, v, p.f64);
    store_stat(p.out2, c, n, p.f64);
  } else {
    static_cast<float*>(const_cast<void*>(p.out0))[c] = float(m);
    static_cast<float*>(const_cast<void*>(p.out1))[c] = invstd_of(v, p.eps);
    if (p.out2 != nullptr) static_cast<float*>(const_cast<void*>(p.out2))[c] = float(n);
    update_running(p, c, m, v, n);
  }
}

// Rank w's (sum_dy, sum_dy_xmu) of channel c at in[w*rs + c] and in[w*rs + C + c] (fp64); summed in
// rank order in fp64, written as fp32.
template <class P>
IGEMM_DEVICE void sum_ranks(const P& p) {
  const int64_t c = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= p.C) return;
  const double* in = static_cast<const double*>(p.mean);
  double a = 0.0, b = 0.0;
  for (int w = 0; w < p.W; ++w) {
    a += in[w * p.rs + c];
    b += in[w * p.rs + p.C + c];
  }
  static_cast<float*>(const_cast<void*>(p.out0))[c] = float(a);
  static_cast<float*>(const_cast<void*>(p.out1))[c] = float(b);
}

}  // namespace igemm::norm
