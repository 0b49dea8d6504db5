// igemm: BatchNorm elementwise kernels.
//   bn_forward   y = act((x - mean) * (invstd * weight) + bias [+ residual]), and for Act == 2 the
//                1-bit ReLU mask of ARCHITECTURE.md (bit i%32 of word i/32 <=> stored y[i] > 0)
//   bn_backward  dx = (dy' - sum_dy/n - (x - mean) * invstd^2 * sum_dy_xmu/n) * weight * invstd
//                (PyTorch's batch_norm_backward_elemt) with dy' = mask bit ? dy : 0 (a select) when
//                Mask, and optionally d_residual = dy' (BN-Add-ReLU: the residual's gradient).
// Flat grid-stride loop over vectors of V elements in memory order: thread t of the grid visits the
// vectors v = t + k*G (G = gridDim.x * kThreads), U of them per iteration. So a warp covers 32*V
// consecutive elements per step, the 32/V lanes of one mask word are an aligned group of the warp,
// and the word is OR-ed with shuffles (V == 1: one __ballot_sync) and stored by the group's first lane.
// The channel of each vector is tracked incrementally (ChanPos), no division in the loop; for NHWC
// when every step G*V is a multiple of C (Python picks such a grid: `fixed`), each thread's channels
// never change and their coefficients are loaded once.
#pragma once
#include "norm.cuh"

namespace igemm::norm {

template <int Layout>
struct ChanPos {
  int64_t hw, c;
  template <class P>
  IGEMM_DEVICE void init(int64_t e, const P& p) {
    if constexpr (Layout == kNCHW) {
      const int64_t q = e / p.HW;
      hw = e - q * p.HW;
      c = q % p.C;
    } else {
      hw = 0;
      c = e % p.C;
    }
  }
  // advance by G*V elements: dc = (G*V / HW) % C and dhw = G*V % HW (NCHW), dc = G*V % C (NHWC)
  template <class P>
  IGEMM_DEVICE void step(const P& p) {
    c += p.dc;
    if constexpr (Layout == kNCHW) {
      hw += p.dhw;
      if (hw >= p.HW) {
        hw -= p.HW;
        ++c;
      }
    }
    if (c >= p.C) c -= p.C;
  }
};

IGEMM_DEVICE float relu_keep_nan(float t) { return (t > 0.f || t != t) ? t : 0.f; }

// One vector of bn_forward_block's: y[vu] = act(fmaf(x − mean, a, b) [+ r]) with the channels' (cm, ca, cb),
// stored where vu < NV, and for Act == 2 its bits OR-ed with the other lanes' of its mask word, which the word's
// first lane stores. Every lane of the warp calls it (the shuffles).
template <class T, int V, int CV, int Act, bool Res>
IGEMM_DEVICE void bn_forward_vec(const Vec<T, V>& rx, const Vec<T, V>& rr, const float* cm, const float* ca,
                                 const float* cb, T* y, uint32_t* mask, int64_t vu, int64_t NV, int lane) {
  float o[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int jc = CV == 1 ? 0 : j;
    float t = fmaf(to_float(rx.v[j]) - cm[jc], ca[jc], cb[jc]);
    if constexpr (Res) t += to_float(rr.v[j]);
    if constexpr (Act != 0) t = relu_keep_nan(t);
    o[j] = t;
  }
  uint32_t bits = 0;
  if (vu < NV) bits = store_vec<T, V>(y + vu * V, o);
  if constexpr (Act == 2) {
    constexpr int kLanesPerWord = 32 / V;
    uint32_t word;
    if constexpr (V == 1) {
      word = __ballot_sync(0xffffffffu, bits != 0u);
    } else {
      word = bits << ((lane % kLanesPerWord) * V);
#pragma unroll
      for (int off = 1; off < kLanesPerWord; off <<= 1) word |= __shfl_xor_sync(0xffffffffu, word, off);
    }
    if (lane % kLanesPerWord == 0 && vu < NV) mask[(vu * V) >> 5] = word;
  }
}

// Act: 0 = none, 1 = ReLU, 2 = ReLU + mask. The grid's block blk of nblk (a kernel of its own: blockIdx.x of
// gridDim.x; norm_train.cuh runs the blocks of this grid on the blocks of its own, with Nc false: its mean and
// invstd were written by the same kernel, so they are not read through the non-coherent path). Rev: each thread's
// vectors last to first (where the grid is `fixed`), so the grid walks the tensor from its end.
template <class T, int V, int Layout, int Act, bool Res, bool Nc = true, bool Rev = false, class P>
IGEMM_DEVICE void bn_forward_block(const P& p, int64_t blk, int64_t nblk) {
  constexpr int CV = Layout == kNHWC ? V : 1;  // channels per vector
  constexpr int U = (CV == 8 && Res) ? 1 : 2;   // vectors in flight per thread (U = 2 would spill there)
  const T* x = static_cast<const T*>(p.x);
  const T* res = static_cast<const T*>(p.res);
  T* y = static_cast<T*>(const_cast<void*>(p.y));
  uint32_t* mask = static_cast<uint32_t*>(const_cast<void*>(p.mask));
  const float* mean = static_cast<const float*>(p.mean);
  const float* invstd = static_cast<const float*>(p.invstd);
  const float* wt = static_cast<const float*>(p.weight);
  const float* bs = static_cast<const float*>(p.bias);
  const int64_t NV = p.NV;
  const int64_t G = nblk * kThreads;
  const int lane = threadIdx.x & 31;
  int64_t v = blk * kThreads + threadIdx.x;
  int64_t vw = v - lane;  // the warp's first vector: loop bounds are warp-uniform (shuffles below)
  ChanPos<Layout> pos;
  pos.init(v * V, p);
  float cm[CV], ca[CV], cb[CV];
  auto coef = [&](int64_t c0) {
#pragma unroll
    for (int j = 0; j < CV; ++j) {
      const int64_t c = c0 + j;
      cm[j] = Nc ? __ldg(mean + c) : mean[c];
      ca[j] = (Nc ? __ldg(invstd + c) : invstd[c]) * (wt != nullptr ? __ldg(wt + c) : 1.f);
      cb[j] = bs != nullptr ? __ldg(bs + c) : 0.f;
    }
  };
  if (p.fixed) coef(pos.c);
  int64_t step = U * G;
  const int64_t iters = vw < NV ? (NV - vw + step - 1) / step : 0;
  if (Rev && p.fixed && iters > 1) {  // (a fixed grid's channels do not move, so pos is not needed)
    vw += (iters - 1) * step;
    v += (iters - 1) * step;
    step = -step;
  }
  for (int64_t it = 0; it < iters; ++it, vw += step, v += step) {
    Vec<T, V> rx[U] = {}, rr[U] = {};
    int64_t cc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      cc[u] = pos.c;
      pos.step(p);
      const int64_t vu = v + u * G;
      if (vu < NV) {
        rx[u] = load_raw<T, V>(x + vu * V);
        if constexpr (Res) rr[u] = load_raw<T, V>(res + vu * V);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (vw + u * G < NV) {  // warp-uniform
        if (!p.fixed) coef(cc[u]);
        bn_forward_vec<T, V, CV, Act, Res>(rx[u], rr[u], cm, ca, cb, y, mask, v + u * G, NV, lane);
      }
    }
  }
}

template <class T, int V, int Layout, int Act, bool Res, class P>
IGEMM_DEVICE void bn_forward(const P& p) {
  bn_forward_block<T, V, Layout, Act, Res>(p, blockIdx.x, gridDim.x);
}

template <class T, int V, int Layout, bool Mask, bool DRes, class P>
IGEMM_DEVICE void bn_backward(const P& p) {
  constexpr int CV = Layout == kNHWC ? V : 1;
  constexpr int U = CV == 8 ? 1 : 2;  // 4 coefficients x 8 channels in registers: U = 2 would spill
  const T* dy = static_cast<const T*>(p.dy);
  const T* x = static_cast<const T*>(p.x);
  const uint32_t* mask = static_cast<const uint32_t*>(p.mask);
  T* dx = static_cast<T*>(const_cast<void*>(p.y));
  T* dres = static_cast<T*>(const_cast<void*>(p.dres));
  const float* mean = static_cast<const float*>(p.mean);
  const float* invstd = static_cast<const float*>(p.invstd);
  const float* wt = static_cast<const float*>(p.weight);
  const float* sdy = static_cast<const float*>(p.sum_dy);
  const float* sdx = static_cast<const float*>(p.sum_dy_xmu);
  const float* cnt = static_cast<const float*>(p.count);
  const int64_t NV = p.NV;
  const int64_t G = int64_t(gridDim.x) * kThreads;
  int64_t v = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  ChanPos<Layout> pos;
  pos.init(v * V, p);
  float cm[CV], cmdy[CV], cf1[CV], cf2[CV];
  auto coef = [&](int64_t c0) {
#pragma unroll
    for (int j = 0; j < CV; ++j) {
      const int64_t c = c0 + j;
      const float norm = 1.f / (cnt != nullptr ? __ldg(cnt + c * p.count_cs) : p.count_val);
      const float is = __ldg(invstd + c);
      cm[j] = __ldg(mean + c);
      cmdy[j] = __ldg(sdy + c) * norm;
      cf1[j] = is * is * __ldg(sdx + c) * norm;
      cf2[j] = (wt != nullptr ? __ldg(wt + c) : 1.f) * is;
    }
  };
  if (p.fixed) coef(pos.c);
  for (; v < NV; v += U * G) {
    Vec<T, V> rd[U] = {}, rx[U] = {};
    uint32_t bits[U];
    int64_t cc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      cc[u] = pos.c;
      pos.step(p);
      const int64_t vu = v + u * G;
      bits[u] = 0xffffffffu;
      if (vu < NV) {
        rd[u] = load_raw<T, V>(dy + vu * V);
        rx[u] = load_raw<T, V>(x + vu * V);
        if constexpr (Mask) bits[u] = __ldg(mask + ((vu * V) >> 5)) >> ((vu * V) & 31);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t vu = v + u * G;
      if (vu < NV) {
        if (!p.fixed) coef(cc[u]);
        float o[V], d[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const int jc = CV == 1 ? 0 : j;
          d[j] = (!Mask || ((bits[u] >> j) & 1u)) ? to_float(rd[u].v[j]) : 0.f;  // a select
          o[j] = (d[j] - cmdy[jc] - (to_float(rx[u].v[j]) - cm[jc]) * cf1[jc]) * cf2[jc];
        }
        store_vec<T, V>(dx + vu * V, o);
        if constexpr (DRes) store_vec<T, V>(dres + vu * V, d);
      }
    }
  }
}

}  // namespace igemm::norm
