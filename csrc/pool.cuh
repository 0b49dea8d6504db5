// igemm: 2-D max pooling of channels-last (NHWC) tensors, with a backward that needs no int64 indices.
//   maxpool_fwd  y[n, oh, ow, c] = max over the window's taps (kh, kw) inside x of x[n, oh·sh − ph + kh·dh,
//                ow·sw − pw + kw·dw, c]; with Idx also idx[n, oh, ow, c] = kh·KW + kw of that maximum, one byte:
//                PyTorch's choice (`v > max || isnan(v)` in window order: the first maximum, or the last NaN);
//                a window's first tap inside x is taken as it comes, so a window of -inf alone points at its
//                first tap (PyTorch's channels-last kernel: at the image's pixel (0, 0)).
//   maxpool_bwd  dx[n, h, w, c] = sum over the windows (oh, ow) that hold (h, w), in ascending (oh, ow) order, of
//                dy[n, oh, ow, c] where idx says the maximum was (h, w): a gather (no atomics), in fp32, in
//                PyTorch's order, so dx equals PyTorch's for the same choices (a zero's sign aside);
//                maxpool_bwd_band the same from bands of dy staged in shared memory (ResNet's 3x3 / 2)
//   avgpool_global  y[n, c] = (sum over the H·W pixels of x[n, ·, ·, c]) · inv, inv = float(1 / (H·W)) as PyTorch's
//                mean scales its sum (adaptive_avg_pool2d to 1 x 1 is a mean); the sum in fp32 (below).
//   avgpool_linear  y[n, o] = sum over c of w[o, c] · m[n, c] + b[o], m = avgpool_global's y (rounded to T as
//                PyTorch's pool output is): a classifier head (pool -> flatten -> nn.Linear) as one kernel for one
//                or two images of 16 bits, in clusters of kHeadCluster CTAs (sm_90+; below).
// Thread i takes V channels of one pixel (an output pixel forward, an input pixel backward), grid-stride; pixel
// and channel-vector indices by magic-number division (a pass has fewer than 2^31 vectors).
#pragma once
#include <cooperative_groups.h>
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

// The band backward's add of one window: dy's vector g into acc (fp32) where the window's taps ks point at this
// pixel. maxpool_bwd keeps the same lines in place: through these helpers its fp32 loop ran 1.46x slower
// (docs/performance.md: maxpool-bwd-band).
template <class T, int V>
IGEMM_DEVICE void add_window(float (&acc)[V], const Vec<uint8_t, V>& ks, const Vec<T, V>& g, uint8_t tap) {
#pragma unroll
  for (int j = 0; j < V; ++j)
    if (ks.v[j] == tap) acc[j] += to_float(g.v[j]);
}

// The band backward's store: acc rounded to T, one vector.
template <class T, int V>
IGEMM_DEVICE void store_sum(T* dst, const float (&acc)[V]) {
  Vec<T, V> r;
#pragma unroll
  for (int j = 0; j < V; ++j) r.v[j] = from_float<T>(acc[j]);
  *reinterpret_cast<Vec<T, V>*>(dst) = r;
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
// SS > 0: stride SS and dilation 1 in both dimensions, known here: the window arithmetic's divisions by them are
// shifts, not a division each (docs/performance.md: maxpool-bwd-stride-known); 0: read from p.
template <class T, int V, int MW, int SS, class P>
__device__ void maxpool_bwd(const P& p) {
  const T* dy = static_cast<const T*>(p.dy);
  const uint8_t* idx = static_cast<const uint8_t*>(p.idx);
  T* dx = static_cast<T*>(const_cast<void*>(p.dx));
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int sh = SS ? SS : p.sh, sw = SS ? SS : p.sw, dh = SS ? 1 : p.dh, dw = SS ? 1 : p.dw;
  const int ext_h = (p.KH - 1) * dh + 1, ext_w = (p.KW - 1) * dw + 1;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.NV; i += stride) {
    int pix, cv, t, h, w, n;
    p.fd_CV.divmod(pix, cv, int(i));
    p.fd_W.divmod(t, w, pix);
    p.fd_H.divmod(n, h, t);
    const int c = cv * V;
    const int hh = h + p.ph, ww = w + p.pw;
    // the windows that hold (h, w): PyTorch's p_start / p_end
    const int oh0 = hh < ext_h ? 0 : (hh - ext_h) / sh + 1, oh1 = min(hh / sh + 1, p.OH);
    const int ow0 = ww < ext_w ? 0 : (ww - ext_w) / sw + 1, ow1 = min(ww / sw + 1, p.OW);
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
          const int oh = oh0 + a, ow = ow0 + b, rh = hh - oh * sh, rw = ww - ow * sw;
          ok[a][b] = oh < oh1 && ow < ow1 && rh % dh == 0 && rw % dw == 0;
          tap[a][b] = uint8_t((rh / dh) * p.KW + rw / dw);
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
      const int rh = hh - oh * sh;
      if (rh % dh) continue;
      for (int ow = ow0; ow < ow1; ++ow) {
        const int rw = ww - ow * sw;
        if (rw % dw) continue;
        const uint8_t tap = uint8_t((rh / dh) * p.KW + rw / dw);
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

// maxpool_bwd_band: the 16-bit backward where at most two windows a dimension hold a pixel, stride 2 and dilation 1
// (ResNet's 3x3 / 2), a block a band of p.band input rows of one image. The dy rows and window taps of the windows
// over the band -- contiguous in channels-last dy -- are first copied into shared memory (cp.async, 16 bytes a
// copy), then each pixel gathers from there: dy and the taps leave memory about once, where maxpool_bwd reads each
// window's once per pixel it holds, one round trip a pixel in flight (docs/performance.md: maxpool-bwd-band). The
// adds as maxpool_bwd's: the same bits. igemm/pool.py picks the band so that the rows fit kBandSmem.
constexpr int kBandSmem = 44 * 1024;

template <class T, int V, class P>
__device__ void maxpool_bwd_band(const P& p) {
  static_assert(sizeof(T) == 2 && V == 8, "16-bit values, 16-byte vectors");
  __shared__ alignas(16) uint8_t sm[kBandSmem];
  const int H = p.fd_H.d, W = p.fd_W.d, CV = p.fd_CV.d;
  const int nb = (H + p.band - 1) / p.band, n = blockIdx.x / nb, h0 = (blockIdx.x - n * nb) * p.band;
  const int h1 = min(h0 + p.band, H);
  // the band's windows: maxpool_bwd's oh0 of row h0 to its oh1 of row h1 - 1
  const int a0 = h0 + p.ph, a1 = h1 - 1 + p.ph;
  const int r0 = a0 < p.KH ? 0 : (a0 - p.KH) / 2 + 1, r1 = min(a1 / 2 + 1, p.OH);
  const int nel = max(r1 - r0, 0) * p.OW * p.C;                   // (a multiple of 16: Python's rule)
  const int64_t base = (int64_t(n) * p.OH + r0) * p.OW * p.C;
  const uint8_t* gdy = static_cast<const uint8_t*>(p.dy) + base * int64_t(sizeof(T));
  const uint8_t* gk = static_cast<const uint8_t*>(p.idx) + base;
  const T* sdy = reinterpret_cast<const T*>(sm);
  const uint8_t* sk = sm + nel * int(sizeof(T));
  const int ndy = nel * int(sizeof(T)) / 16, ncp = ndy + nel / 16;
  for (int i = threadIdx.x; i < ncp; i += blockDim.x)
    cp_async_zfill<16>(sm + 16 * i, i < ndy ? gdy + 16 * i : gk + 16 * (i - ndy), true);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  T* dx = static_cast<T*>(const_cast<void*>(p.dx)) + int64_t(n) * H * W * p.C;
  const int items = (h1 - h0) * W * CV;
  for (int i = threadIdx.x; i < items; i += blockDim.x) {
    int pix, cv, hr, w;
    p.fd_CV.divmod(pix, cv, i);
    p.fd_W.divmod(hr, w, pix);
    const int h = h0 + hr, c = cv * V, hh = h + p.ph, ww = w + p.pw;
    const int oh0 = hh < p.KH ? 0 : (hh - p.KH) / 2 + 1, oh1 = min(hh / 2 + 1, p.OH);
    const int ow0 = ww < p.KW ? 0 : (ww - p.KW) / 2 + 1, ow1 = min(ww / 2 + 1, p.OW);
    float acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0.f;
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int oh = oh0 + a, ow = ow0 + b;
        if (oh >= oh1 || ow >= ow1) continue;
        const uint8_t tap = uint8_t((hh - 2 * oh) * p.KW + ww - 2 * ow);
        const int o = ((oh - r0) * p.OW + ow) * p.C + c;
        add_window<T, V>(acc, *reinterpret_cast<const Vec<uint8_t, V>*>(sk + o),
                         *reinterpret_cast<const Vec<T, V>*>(sdy + o), tap);
      }
    store_sum<T, V>(dx + (int64_t(h) * W + w) * p.C + c, acc);
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

// The head for at most kHeadImages images. A cluster of kHeadCluster CTAs owns p.Og outputs; CTA r of it owns
// channels [r·Cs, (r + 1)·Cs): it pools them (so the cluster reads each image once), takes the dot products of its
// outputs' weight rows over them (a warp kHeadRows rows, a lane 16 bytes of each), and leaves the partial sums in
// its shared memory; after the cluster barrier CTA r sums the kHeadCluster partials of its share of the outputs in
// rank order through distributed shared memory (a fixed order: deterministic) and adds the bias. Every load a thread
// makes is in flight at once: its first weight vectors are loaded before the pooling, and its pixels eight at a time
// (docs/performance.md: classifier-head).
// NI: the images a launch takes (at most; the registers a lane keeps for its rows' sums grow with it).
constexpr int kHeadCluster = 8, kHeadImages = 2, kHeadChannels = 1024, kHeadOutputs = 128, kHeadThreads = 256;
constexpr int kHeadRows = 8;                                 // weight rows a warp takes at once
constexpr int kHeadPixels = 8;                               // pixel loads a thread has in flight

template <class T, int V, int NI, class P>
__device__ void avgpool_linear(const P& p) {
  static_assert(NI <= kHeadImages);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  __shared__ alignas(16) float pooled[NI][kHeadChannels];
  __shared__ alignas(16) float lanes[kHeadThreads][V];
  __shared__ float part[NI][kHeadOutputs];
  const cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank()), o0 = (blockIdx.x / kHeadCluster) * p.Og;
  const int c0 = rank * p.Cs, cn = max(0, min(p.Cs, p.C - c0)), nv = cn / V;
  const int og = max(0, min(p.Og, p.O - o0));
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.w);
  const int wp = threadIdx.x / 32, ln = threadIdx.x % 32;
  // this lane's first weight vectors (rows wp·kHeadRows + i, channel vector ln), in flight during the pooling
  Vec<T, V> first[kHeadRows];
#pragma unroll
  for (int i = 0; i < kHeadRows; ++i)
    if (ln < nv && wp * kHeadRows + i < og)
      first[i] = *reinterpret_cast<const Vec<T, V>*>(w + int64_t(o0 + wp * kHeadRows + i) * p.C + c0 + ln * V);
  // pool: item (n, vector) summed by p.L lanes (pixels lane, lane + L, ...), the lanes added in lane order
  const int items = p.N * nv;
  for (int t0 = 0; t0 < items * p.L; t0 += kHeadThreads) {
    const int t = t0 + threadIdx.x;
    float acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0.f;
    const int item = t % max(items, 1), lane = t / max(items, 1), n = item / max(nv, 1), cv = item % max(nv, 1);
    if (t < items * p.L) {
      const T* xp = x + int64_t(n) * p.HW * p.C + c0 + cv * V;
      for (int pix = lane; pix < p.HW; pix += kHeadPixels * p.L) {
        Vec<T, V> r[kHeadPixels];
#pragma unroll
        for (int u = 0; u < kHeadPixels; ++u)
          if (pix + u * p.L < p.HW) r[u] = *reinterpret_cast<const Vec<T, V>*>(xp + int64_t(pix + u * p.L) * p.C);
#pragma unroll
        for (int u = 0; u < kHeadPixels; ++u)
          if (pix + u * p.L < p.HW) {
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] += to_float(r[u].v[j]);
          }
      }
    }
    if (p.L == 1) {                                         // (one lane: many items, or one pixel)
      if (t < items) {
#pragma unroll
        for (int j = 0; j < V; ++j) pooled[n][cv * V + j] = to_float(from_float<T>(acc[j] * p.inv));
      }
    } else {                                                // (items · L <= kHeadThreads: one pass)
#pragma unroll
      for (int j = 0; j < V; ++j) lanes[threadIdx.x][j] = acc[j];
      __syncthreads();
      if (threadIdx.x < items) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          float s = 0.f;
          for (int l = 0; l < p.L; ++l) s += lanes[l * items + threadIdx.x][j];
          pooled[n][cv * V + j] = to_float(from_float<T>(s * p.inv));
        }
      }
    }
  }
  __syncthreads();
  // the partial dot products: warp wp takes rows wp·kHeadRows + i, then the same kHeadThreads / 32 · kHeadRows on
  for (int r0 = wp * kHeadRows; r0 < og; r0 += kHeadThreads / 32 * kHeadRows) {
    float acc[kHeadRows][NI];
#pragma unroll
    for (int i = 0; i < kHeadRows; ++i)
#pragma unroll
      for (int n = 0; n < NI; ++n) acc[i][n] = 0.f;
    for (int cv = ln; cv < nv; cv += 32) {
      Vec<T, V> r[kHeadRows];
#pragma unroll
      for (int i = 0; i < kHeadRows; ++i) {
        if (r0 == wp * kHeadRows && cv == ln)
          r[i] = first[i];
        else if (r0 + i < og)
          r[i] = *reinterpret_cast<const Vec<T, V>*>(w + int64_t(o0 + r0 + i) * p.C + c0 + cv * V);
      }
#pragma unroll
      for (int n = 0; n < NI; ++n) {
        if (n < p.N) {
          float m[V];
#pragma unroll
          for (int j = 0; j < V; j += 4) *reinterpret_cast<float4*>(m + j) =
              *reinterpret_cast<const float4*>(&pooled[n][cv * V + j]);
#pragma unroll
          for (int i = 0; i < kHeadRows; ++i)
#pragma unroll
            for (int j = 0; j < V; ++j) acc[i][n] = fmaf(to_float(r[i].v[j]), m[j], acc[i][n]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kHeadRows; ++i)
#pragma unroll
      for (int n = 0; n < NI; ++n) {
        if (n < p.N) {
          float s = acc[i][n];
#pragma unroll
          for (int d = 16; d > 0; d >>= 1) s += __shfl_xor_sync(0xffffffffu, s, d);
          if (ln == 0 && r0 + i < og) part[n][r0 + i] = s;
        }
      }
  }
  cluster.sync();
  // CTA `rank` finishes outputs [rank·share, (rank + 1)·share) of the cluster's: the partials in rank order
  const int share = (p.Og + kHeadCluster - 1) / kHeadCluster;
  const int lo = rank * share, cnt = max(0, min(share, og - lo));
  for (int t = threadIdx.x; t < p.N * cnt; t += kHeadThreads) {
    const int n = t / cnt, o = lo + t % cnt;
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < kHeadCluster; ++q) s += cluster.map_shared_rank(&part[0][0], q)[n * kHeadOutputs + o];
    if (p.b != nullptr) s += to_float(static_cast<const T*>(p.b)[o0 + o]);
    static_cast<T*>(const_cast<void*>(p.y))[int64_t(n) * p.O + o0 + o] = from_float<T>(s);
  }
  cluster.sync();                                           // (no CTA leaves while another reads its partials)
#endif
}

}  // namespace igemm::pool
