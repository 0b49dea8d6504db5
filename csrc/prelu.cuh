// igemm: PReLU forward and backward (torch.nn.functional.prelu semantics), on the collapsed view
//   x[O, C, S] contiguous: channel c of element e is (e / S) % C.
//   NCHW: O = N, C = channels, S = H*W (any trailing dims);  NHWC: O = N*H*W, C = channels, S = 1.
//   A shared alpha (a number, or a 1-element array) is C = 1.
//
// forward<T, TA, V, Mode, Wide>: y = x > 0 ? x : alpha[c] * x over packs of V elements (16 bytes when the
// pointers allow), U packs in flight per thread, grid-stride; the n % V tail in block 0. Mode:
//   kScalarVal  alpha is the float parameter
//   kScalarPtr  alpha[0], loaded once per thread
//   kPlane      S % V == 0: a pack lies in one channel -> c = (pack / (S/V)) % C, one alpha load per pack
//   kRow        S == 1, C % V == 0: a pack is V consecutive channels -> one V-wide alpha load per pack
//   kStep       otherwise: the channel of the pack's first element, then stepped element by element
// backward: dx = x > 0 ? dy : alpha[c] * dy;  dalpha[c] = sum over channel c of (x > 0 ? 0 : x * dy), in fp32,
// deterministically: each block reduces a fixed set of elements in a fixed order (thread mapping fixed by
// the grid, then a fixed tree) into partial[g * C + c], and backward_finish sums partial[0..G) in order.
//   backward_flat   shared alpha: grid-stride over packs, one partial per block (C = 1)
//   backward_plane  per channel, S > 1: block (c, g), threads (tx over the plane's packs, ty over planes)
//   backward_row    per channel, S == 1: block (channel tile, g), threads (tx over channel packs, ty over rows)
// TA (alpha's type) is T or float. Offsets are 64-bit; divisions use FastDiv when Wide is false (n < 2^31).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "common.cuh"
#include "elementwise.cuh"

namespace igemm::prelu {

enum Mode : int { kScalarVal = 0, kScalarPtr = 1, kPlane = 2, kRow = 3, kStep = 4 };
constexpr int kThreads = 256;  // every kernel's block size (backward: blockDim.x * blockDim.y)


// Streaming 16-byte accesses where the pack is 16 bytes; plain ones otherwise.
template <class B, int V>
IGEMM_DEVICE Pack<B, V> load_pack(const B* p) {
  if constexpr (sizeof(Pack<B, V>) == 16) {
    uint4 u = ldg_stream16(p);
    return *reinterpret_cast<Pack<B, V>*>(&u);
  } else {
    return *reinterpret_cast<const Pack<B, V>*>(p);
  }
}
template <class B, int V>
IGEMM_DEVICE void store_pack(B* p, const Pack<B, V>& v) {
  if constexpr (sizeof(Pack<B, V>) == 16) {
    stg_stream16(p, *reinterpret_cast<const uint4*>(&v));
  } else {
    *reinterpret_cast<Pack<B, V>*>(p) = v;
  }
}

IGEMM_DEVICE int64_t global_thread() { return int64_t(blockIdx.x) * blockDim.x + threadIdx.x; }
IGEMM_DEVICE int64_t grid_threads() { return int64_t(gridDim.x) * blockDim.x; }

template <class TA>
IGEMM_DEVICE float alpha_at(const void* alpha, int64_t c) {
  return Elem<TA>::to_f(static_cast<const typename Elem<TA>::Bits*>(alpha)[c]);
}

// The V alphas of pack v (elements v*V .. v*V+V-1); `a0` is the kernel-constant alpha of the scalar modes.
template <class TA, int V, int Mode, bool Wide, class Params>
IGEMM_DEVICE void pack_alphas(const Params& p, int64_t v, float a0, float (&a)[V]) {
  if constexpr (Mode == kScalarVal || Mode == kScalarPtr) {
#pragma unroll
    for (int j = 0; j < V; ++j) a[j] = a0;
  } else if constexpr (Mode == kPlane) {
    int64_t c;
    if constexpr (Wide) {
      c = (v / p.s_div64) % p.c;
    } else {
      const int q = p.s_div.div(int(v));
      c = q - p.c_div.div(q) * p.c_div.d;
    }
    const float ac = alpha_at<TA>(p.alpha, c);
#pragma unroll
    for (int j = 0; j < V; ++j) a[j] = ac;
  } else if constexpr (Mode == kRow) {
    int64_t c0;
    if constexpr (Wide) {
      c0 = (v % p.c_div64) * V;
    } else {
      const int iv = int(v);
      c0 = int64_t(iv - p.c_div.div(iv) * p.c_div.d) * V;
    }
    using AB = typename Elem<TA>::Bits;
    const Pack<AB, V> ap = *reinterpret_cast<const Pack<AB, V>*>(static_cast<const AB*>(p.alpha) + c0);
#pragma unroll
    for (int j = 0; j < V; ++j) a[j] = Elem<TA>::to_f(ap.v[j]);
  } else {  // kStep
    const int64_t e0 = v * V;
    int64_t q, r, c;
    if constexpr (Wide) {
      q = e0 / p.s;
      r = e0 - q * p.s;
      c = q % p.c;
    } else {
      int qi, ri;
      p.s_div.divmod(qi, ri, int(e0));
      q = qi;
      r = ri;
      c = qi - p.c_div.div(qi) * p.c_div.d;
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
      a[j] = alpha_at<TA>(p.alpha, c);
      if (++r == p.s) {
        r = 0;
        c = (c + 1 == p.c) ? 0 : c + 1;
      }
    }
  }
}

// Alpha of element e, for tails (64-bit, any mode).
template <class TA, int Mode, class Params>
IGEMM_DEVICE float elem_alpha(const Params& p, int64_t e, float a0) {
  if constexpr (Mode == kScalarVal || Mode == kScalarPtr) return a0;
  else return alpha_at<TA>(p.alpha, (e / p.s) % p.c);
}

template <class TA, int Mode, class Params>
IGEMM_DEVICE float kernel_alpha(const Params& p) {
  if constexpr (Mode == kScalarVal) return p.alpha_val;
  else if constexpr (Mode == kScalarPtr) return alpha_at<TA>(p.alpha, 0);
  else return 0.f;
}

// ----------------------------------------------------------------------------------------- forward
// Params: x, alpha, y, alpha_val, n, s, c, s_div (FastDiv: S/V for kPlane, S for kStep), c_div (FastDiv: C,
// or C/V for kRow), s_div64 (S/V), c_div64 (C/V).
template <class T, class TA, int V, int Mode, bool Wide, class Params>
__device__ void forward(const Params& p) {
  using E = Elem<T>;
  using B = typename E::Bits;
  constexpr int U = 2;
  const B* x = static_cast<const B*>(p.x);
  B* y = static_cast<B*>(const_cast<void*>(p.y));
  const float a0 = kernel_alpha<TA, Mode>(p);
  const int64_t nvec = p.n / V;
  const int64_t stride = grid_threads();
  for (int64_t v0 = global_thread(); v0 < nvec; v0 += stride * U) {
    Pack<B, V> in[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (v0 + u * stride < nvec) in[u] = load_pack<B, V>(x + (v0 + u * stride) * V);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + u * stride;
      if (v < nvec) {
        float a[V];
        pack_alphas<TA, V, Mode, Wide>(p, v, a0, a);
        Pack<B, V> out;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float xv = E::to_f(in[u].v[j]);
          out.v[j] = xv > 0.f ? in[u].v[j] : E::from_f(a[j] * xv);
        }
        store_pack<B, V>(y + v * V, out);
      }
    }
  }
  const int64_t e = nvec * V + threadIdx.x;
  if (V > 1 && blockIdx.x == 0 && e < p.n) {
    const float xv = E::to_f(x[e]);
    y[e] = xv > 0.f ? x[e] : E::from_f(elem_alpha<TA, Mode>(p, e, a0) * xv);
  }
}

// ----------------------------------------------------------------------------------------- backward
// Fixed-order sum of one float per thread over the block (kThreads threads); the result in every thread.
IGEMM_DEVICE float block_sum(float v, float* s) {
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
  s[t] = v;
  __syncthreads();
#pragma unroll
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (t < w) s[t] += s[t + w];
    __syncthreads();
  }
  const float r = s[0];
  __syncthreads();
  return r;
}

// dx for V elements and their dalpha contribution (added to acc in element order).
template <class T, int V>
IGEMM_DEVICE void bwd_pack(const Pack<typename Elem<T>::Bits, V>& dy, const Pack<typename Elem<T>::Bits, V>& x,
                           const float (&a)[V], Pack<typename Elem<T>::Bits, V>& dx, float (&acc)[V]) {
  using E = Elem<T>;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float xv = E::to_f(x.v[j]);
    const float g = E::to_f(dy.v[j]);
    if (xv > 0.f) {
      dx.v[j] = dy.v[j];
    } else {
      dx.v[j] = E::from_f(a[j] * g);
      acc[j] += xv * g;
    }
  }
}

// Shared alpha. Params: dy, x, alpha, dx, partial, alpha_val, n. Grid: G blocks of kThreads (1-D).
template <class T, class TA, int V, int Mode, class Params>
__device__ void backward_flat(const Params& p) {
  using B = typename Elem<T>::Bits;
  __shared__ float s_red[kThreads];
  const B* dy = static_cast<const B*>(p.dy);
  const B* x = static_cast<const B*>(p.x);
  B* dx = static_cast<B*>(const_cast<void*>(p.dx));
  const float a0 = kernel_alpha<TA, Mode>(p);
  float a[V];
#pragma unroll
  for (int j = 0; j < V; ++j) a[j] = a0;
  float acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = 0.f;
  const int64_t nvec = p.n / V;
  for (int64_t v = global_thread(); v < nvec; v += grid_threads()) {
    const Pack<B, V> g = load_pack<B, V>(dy + v * V), xx = load_pack<B, V>(x + v * V);
    Pack<B, V> out;
    bwd_pack<T, V>(g, xx, a, out, acc);
    store_pack<B, V>(dx + v * V, out);
  }
  const int64_t e = nvec * V + threadIdx.x;
  if (V > 1 && blockIdx.x == 0 && e < p.n) {
    Pack<B, 1> g, xx, out;
    g.v[0] = dy[e];
    xx.v[0] = x[e];
    float a1[1] = {a0}, acc1[1] = {0.f};
    bwd_pack<T, 1>(g, xx, a1, out, acc1);
    dx[e] = out.v[0];
    acc[0] += acc1[0];
  }
  float t = 0.f;
#pragma unroll
  for (int j = 0; j < V; ++j) t += acc[j];
  t = block_sum(t, s_red);
  if (threadIdx.x == 0) static_cast<float*>(const_cast<void*>(p.partial))[blockIdx.x] = t;
}

// Per channel, S > 1 (S % V == 0). Params: dy, x, alpha, dx, partial, outer (O), s, c.
// Block (blockIdx.x = channel c, blockIdx.y = g of G); threads (tx < TX over the plane's packs, ty < TY over
// planes o = g*TY + ty, + G*TY, ...).
template <class T, class TA, int V, class Params>
__device__ void backward_plane(const Params& p) {
  using B = typename Elem<T>::Bits;
  __shared__ float s_red[kThreads];
  const B* dy = static_cast<const B*>(p.dy);
  const B* x = static_cast<const B*>(p.x);
  B* dx = static_cast<B*>(const_cast<void*>(p.dx));
  const int64_t c = blockIdx.x;
  const float ac = alpha_at<TA>(p.alpha, c);
  float a[V];
#pragma unroll
  for (int j = 0; j < V; ++j) a[j] = ac;
  float acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = 0.f;
  const int64_t sv = p.s / V;
  const int64_t o_step = int64_t(gridDim.y) * blockDim.y;
  for (int64_t o = int64_t(blockIdx.y) * blockDim.y + threadIdx.y; o < p.outer; o += o_step) {
    const int64_t base = (o * p.c + c) * p.s;
    for (int64_t s = threadIdx.x; s < sv; s += blockDim.x) {
      const int64_t off = base + s * V;
      const Pack<B, V> g = load_pack<B, V>(dy + off), xx = load_pack<B, V>(x + off);
      Pack<B, V> out;
      bwd_pack<T, V>(g, xx, a, out, acc);
      store_pack<B, V>(dx + off, out);
    }
  }
  float t = 0.f;
#pragma unroll
  for (int j = 0; j < V; ++j) t += acc[j];
  t = block_sum(t, s_red);
  if (threadIdx.x == 0 && threadIdx.y == 0)
    static_cast<float*>(const_cast<void*>(p.partial))[int64_t(blockIdx.y) * p.c + c] = t;
}

// Per channel, S == 1 (C % V == 0). Params: dy, x, alpha, dx, partial, outer (rows), c.
// Block (blockIdx.x = tile of TX channel packs, blockIdx.y = g of G); threads (tx: channel pack, ty: rows
// g*TY + ty, + G*TY, ...). Each thread keeps V per-channel sums; rows reduce in ty order.
template <class T, class TA, int V, class Params>
__device__ void backward_row(const Params& p) {
  using B = typename Elem<T>::Bits;
  __shared__ float s_red[kThreads * V];
  const B* dy = static_cast<const B*>(p.dy);
  const B* x = static_cast<const B*>(p.x);
  B* dx = static_cast<B*>(const_cast<void*>(p.dx));
  const int64_t cv = p.c / V;
  const int64_t cp = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  float acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = 0.f;
  if (cp < cv) {
    float a[V];
#pragma unroll
    for (int j = 0; j < V; ++j) a[j] = alpha_at<TA>(p.alpha, cp * V + j);
    const int64_t r_step = int64_t(gridDim.y) * blockDim.y;
    for (int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y; r < p.outer; r += r_step) {
      const int64_t off = r * p.c + cp * V;
      const Pack<B, V> g = load_pack<B, V>(dy + off), xx = load_pack<B, V>(x + off);
      Pack<B, V> out;
      bwd_pack<T, V>(g, xx, a, out, acc);
      store_pack<B, V>(dx + off, out);
    }
  }
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
#pragma unroll
  for (int j = 0; j < V; ++j) s_red[t * V + j] = acc[j];
  __syncthreads();
  if (threadIdx.y == 0 && cp < cv) {
    float sum[V];
#pragma unroll
    for (int j = 0; j < V; ++j) sum[j] = 0.f;
    for (int ty = 0; ty < int(blockDim.y); ++ty) {
      const int src = ty * blockDim.x + threadIdx.x;
#pragma unroll
      for (int j = 0; j < V; ++j) sum[j] += s_red[src * V + j];
    }
    float* partial = static_cast<float*>(const_cast<void*>(p.partial)) + int64_t(blockIdx.y) * p.c + cp * V;
#pragma unroll
    for (int j = 0; j < V; ++j) partial[j] = sum[j];
  }
}

// dalpha[c] = sum_{g < G} partial[g * C + c], in g order. Params: partial, dalpha, g (G), c (C).
template <class TA, class Params>
__device__ void backward_finish(const Params& p) {
  const float* partial = static_cast<const float*>(p.partial);
  auto* dalpha = static_cast<typename Elem<TA>::Bits*>(const_cast<void*>(p.dalpha));
  for (int64_t c = global_thread(); c < p.c; c += grid_threads()) {
    float s = 0.f;
    for (int g = 0; g < p.g; ++g) s += partial[int64_t(g) * p.c + c];
    dalpha[c] = Elem<TA>::from_f(s);
  }
}

}  // namespace igemm::prelu
