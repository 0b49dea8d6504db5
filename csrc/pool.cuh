// igemm: 2-D max pooling of channels-last (NHWC) tensors, with a backward that needs no int64 indices.
//   maxpool_fwd  y[n, oh, ow, c] = max over the window's taps (kh, kw) inside x of x[n, oh·sh − ph + kh·dh,
//                ow·sw − pw + kw·dw, c]; with Idx also idx[n, oh, ow, c] = kh·KW + kw of that maximum, one byte:
//                PyTorch's choice (`v > max || isnan(v)` in window order: the first maximum, or the last NaN);
//                a window's first tap inside x is taken as it comes, so a window of -inf alone points at its
//                first tap (PyTorch's channels-last kernel: at the image's pixel (0, 0)).
//   maxpool_bwd  dx[n, h, w, c] = sum over the windows (oh, ow) that hold (h, w), in ascending (oh, ow) order, of
//                dy[n, oh, ow, c] where idx says the maximum was (h, w): a gather (no atomics), in fp32, in
//                PyTorch's order, so dx equals PyTorch's for the same choices (a zero's sign aside).
//   avgpool_global  y[n, c] = (sum over the H·W pixels of x[n, ·, ·, c]) · inv, inv = float(1 / (H·W)) as PyTorch's
//                mean scales its sum (adaptive_avg_pool2d to 1 x 1 is a mean); the sum in fp32 (below).
// Thread i takes V channels of one pixel (an output pixel forward, an input pixel backward), grid-stride; pixel
// and channel-vector indices by magic-number division (a pass has fewer than 2^31 vectors).
#pragma once
#include "common.cuh"

namespace igemm::pool {

template <class T, int V>
struct alignas(sizeof(T) * V) Vec { T v[V]; };

// One window tap's vector into the running maximum (m, k): PyTorch's rule, the first tap inside x taken whatever
// its value.
template <class T, int V>
IGEMM_DEVICE void take_tap(float (&m)[V], Vec<uint8_t, V>& k, const Vec<T, V>& r, uint8_t tap) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float v = to_float(r.v[j]);
    if (k.v[j] == 255 || v > m[j] || v != v) {
      m[j] = v;
      k.v[j] = tap;
    }
  }
}

// Two 16-bit values' maxima in one instruction; max.NaN: a NaN in either gives NaN (sm_80+).
template <class T>
IGEMM_DEVICE uint32_t max_nan_x2(uint32_t a, uint32_t b) {
  uint32_t d;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, cutlass::half_t>)
    asm("max.NaN.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  else
    asm("max.NaN.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
#endif
  return d;
}

// KS > 0: a KS x KS window (ResNet's 3x3, VGG's 2x2) whose taps' loads all issue before the first compare (one
// round trip to memory a pixel instead of KS² in turn; docs/performance.md: maxpool-taps-unrolled); 0: any window.
// Without the taps (inference), 16-bit values take their maxima two a instruction from -inf (docs/performance.md:
// maxpool-packed-max): PyTorch's values -- a NaN tap gives NaN, a window's first tap counts whatever its value --
// a zero's sign aside.
template <class T, int V, bool Idx, int KS, class P>
__device__ void maxpool_fwd(const P& p) {
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(const_cast<void*>(p.y));
  uint8_t* idx = static_cast<uint8_t*>(const_cast<void*>(p.idx));
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.NV; i += stride) {
    int pix, cv, t, oh, ow, n;
    p.fd_CV.divmod(pix, cv, int(i));
    p.fd_OW.divmod(t, ow, pix);
    p.fd_OH.divmod(n, oh, t);
    const int c = cv * V;
    float m[V];
    Vec<uint8_t, V> k;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      m[j] = -__int_as_float(0x7f800000);
      k.v[j] = 255;                          // (no tap yet: the first one inside x is taken whatever its value)
    }
    const int h0 = oh * p.sh - p.ph, w0 = ow * p.sw - p.pw;
    const T* xn = x + int64_t(n) * p.H * p.W * p.C + c;
    if constexpr (KS > 0) {
      Vec<T, V> r[KS][KS];
      bool in[KS][KS];
#pragma unroll
      for (int kh = 0; kh < KS; ++kh)
#pragma unroll
        for (int kw = 0; kw < KS; ++kw) {
          const int ih = h0 + kh * p.dh, iw = w0 + kw * p.dw;
          in[kh][kw] = unsigned(ih) < unsigned(p.H) && unsigned(iw) < unsigned(p.W);
          if (in[kh][kw]) r[kh][kw] = *reinterpret_cast<const Vec<T, V>*>(xn + (int64_t(ih) * p.W + iw) * p.C);
        }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
      if constexpr (!Idx && sizeof(T) == 2 && V % 2 == 0) {
        union { Vec<T, V> v; uint32_t u[V / 2]; } o;
#pragma unroll
        for (int j = 0; j < V / 2; ++j) o.u[j] = std::is_same_v<T, cutlass::half_t> ? 0xfc00fc00u : 0xff80ff80u;
#pragma unroll
        for (int kh = 0; kh < KS; ++kh)
#pragma unroll
          for (int kw = 0; kw < KS; ++kw)
            if (in[kh][kw]) {
              const uint32_t* u = reinterpret_cast<const uint32_t*>(&r[kh][kw]);
#pragma unroll
              for (int j = 0; j < V / 2; ++j) o.u[j] = max_nan_x2<T>(o.u[j], u[j]);
            }
        *reinterpret_cast<Vec<T, V>*>(y + i * V) = o.v;
        continue;
      }
#endif
#pragma unroll
      for (int kh = 0; kh < KS; ++kh)
#pragma unroll
        for (int kw = 0; kw < KS; ++kw)
          if (in[kh][kw]) take_tap<T, V>(m, k, r[kh][kw], uint8_t(kh * KS + kw));
    } else {
      for (int kh = 0; kh < p.KH; ++kh) {
        const int ih = h0 + kh * p.dh;
        if (unsigned(ih) >= unsigned(p.H)) continue;
        for (int kw = 0; kw < p.KW; ++kw) {
          const int iw = w0 + kw * p.dw;
          if (unsigned(iw) >= unsigned(p.W)) continue;
          take_tap<T, V>(m, k, *reinterpret_cast<const Vec<T, V>*>(xn + (int64_t(ih) * p.W + iw) * p.C),
                         uint8_t(kh * p.KW + kw));
        }
      }
    }
    Vec<T, V> o;
#pragma unroll
    for (int j = 0; j < V; ++j) o.v[j] = from_float<T>(m[j]);
    const int64_t at = i * V;
    *reinterpret_cast<Vec<T, V>*>(y + at) = o;
    if constexpr (Idx) *reinterpret_cast<Vec<uint8_t, V>*>(idx + at) = k;
  }
}

// MW > 0: at most MW windows a dimension hold a pixel (ResNet's 3x3 / 2: 2), so their loads all issue before the
// first add, which still goes in PyTorch's order (docs/performance.md: maxpool-bwd-unrolled); 0: any geometry.
template <class T, int V, int MW, class P>
__device__ void maxpool_bwd(const P& p) {
  const T* dy = static_cast<const T*>(p.dy);
  const uint8_t* idx = static_cast<const uint8_t*>(p.idx);
  T* dx = static_cast<T*>(const_cast<void*>(p.dx));
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int ext_h = (p.KH - 1) * p.dh + 1, ext_w = (p.KW - 1) * p.dw + 1;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.NV; i += stride) {
    int pix, cv, t, h, w, n;
    p.fd_CV.divmod(pix, cv, int(i));
    p.fd_W.divmod(t, w, pix);
    p.fd_H.divmod(n, h, t);
    const int c = cv * V;
    const int hh = h + p.ph, ww = w + p.pw;
    // the windows that hold (h, w): PyTorch's p_start / p_end
    const int oh0 = hh < ext_h ? 0 : (hh - ext_h) / p.sh + 1, oh1 = min(hh / p.sh + 1, p.OH);
    const int ow0 = ww < ext_w ? 0 : (ww - ext_w) / p.sw + 1, ow1 = min(ww / p.sw + 1, p.OW);
    float acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0.f;
    if constexpr (MW > 0) {
      Vec<uint8_t, V> ks[MW][MW];
      Vec<T, V> g[MW][MW];
      uint8_t tap[MW][MW];
      bool ok[MW][MW];
#pragma unroll
      for (int a = 0; a < MW; ++a)
#pragma unroll
        for (int b = 0; b < MW; ++b) {
          const int oh = oh0 + a, ow = ow0 + b, rh = hh - oh * p.sh, rw = ww - ow * p.sw;
          ok[a][b] = oh < oh1 && ow < ow1 && rh % p.dh == 0 && rw % p.dw == 0;
          tap[a][b] = uint8_t((rh / p.dh) * p.KW + rw / p.dw);
          if (ok[a][b]) {
            const int64_t o = ((int64_t(n) * p.OH + oh) * p.OW + ow) * p.C + c;
            ks[a][b] = *reinterpret_cast<const Vec<uint8_t, V>*>(idx + o);
            g[a][b] = *reinterpret_cast<const Vec<T, V>*>(dy + o);
          }
        }
#pragma unroll
      for (int a = 0; a < MW; ++a)
#pragma unroll
        for (int b = 0; b < MW; ++b)
          if (ok[a][b]) {
#pragma unroll
            for (int j = 0; j < V; ++j)
              if (ks[a][b].v[j] == tap[a][b]) acc[j] += to_float(g[a][b].v[j]);
          }
    }
    for (int oh = oh0; MW == 0 && oh < oh1; ++oh) {
      const int rh = hh - oh * p.sh;
      if (rh % p.dh) continue;
      for (int ow = ow0; ow < ow1; ++ow) {
        const int rw = ww - ow * p.sw;
        if (rw % p.dw) continue;
        const uint8_t tap = uint8_t((rh / p.dh) * p.KW + rw / p.dw);
        const int64_t o = ((int64_t(n) * p.OH + oh) * p.OW + ow) * p.C + c;
        const Vec<uint8_t, V> ks = *reinterpret_cast<const Vec<uint8_t, V>*>(idx + o);
        const Vec<T, V> g = *reinterpret_cast<const Vec<T, V>*>(dy + o);
#pragma unroll
        for (int j = 0; j < V; ++j)
          if (ks.v[j] == tap) acc[j] += to_float(g.v[j]);
      }
    }
    Vec<T, V> r;
#pragma unroll
    for (int j = 0; j < V; ++j) r.v[j] = from_float<T>(acc[j]);
    *reinterpret_cast<Vec<T, V>*>(dx + i * V) = r;
  }
}

// A block: kAvgVecs channel vectors of one image x kAvgLanes pixel lanes; lane l sums pixels l, l + kAvgLanes, ...
// in order (four loads in flight), then lane 0 adds the other lanes' sums in lane order. An image's pixels are
// read once; the blocks of one image share none (docs/performance.md: avgpool-global).
constexpr int kAvgVecs = 32, kAvgLanes = 8;

template <class T, int V, class P>
__device__ void avgpool_global(const P& p) {
  __shared__ float part[kAvgLanes - 1][V][kAvgVecs];
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(const_cast<void*>(p.y));
  const int tx = threadIdx.x % kAvgVecs, lane = threadIdx.x / kAvgVecs;
  const int n = blockIdx.x / p.cblocks, cv = (blockIdx.x % p.cblocks) * kAvgVecs + tx;
  float acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = 0.f;
  if (cv < p.CV) {
    const T* xp = x + int64_t(n) * p.HW * p.C + int64_t(cv) * V;
    int pix = lane;
    for (; pix + 3 * kAvgLanes < p.HW; pix += 4 * kAvgLanes) {
      Vec<T, V> r[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) r[u] = *reinterpret_cast<const Vec<T, V>*>(xp + int64_t(pix + u * kAvgLanes) * p.C);
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] += to_float(r[u].v[j]);
    }
    for (; pix < p.HW; pix += kAvgLanes) {
      const Vec<T, V> r = *reinterpret_cast<const Vec<T, V>*>(xp + int64_t(pix) * p.C);
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] += to_float(r.v[j]);
    }
  }
  if (lane > 0) {
#pragma unroll
    for (int j = 0; j < V; ++j) part[lane - 1][j][tx] = acc[j];
  }
  __syncthreads();
  if (lane == 0 && cv < p.CV) {
    Vec<T, V> o;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      float s = acc[j];
#pragma unroll
      for (int l = 0; l < kAvgLanes - 1; ++l) s += part[l][j][tx];
      o.v[j] = from_float<T>(s * p.inv);
    }
    *reinterpret_cast<Vec<T, V>*>(y + int64_t(n) * p.C + int64_t(cv) * V) = o;
  }
}

}  // namespace igemm::pool
