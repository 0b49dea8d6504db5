// igemm: epilogue functors of the conv kernel (and of any GEMM-like kernel that stores through the
// same store phase).
//
// Every op has the same shape: `apply<V>(v, ch, off, p)` transforms V fp32 values in place, where
// v[e] is the accumulator-derived value of the output element at linear offset `off + e` (memory
// order of the output, NCHW or NHWC) whose output channel is ch[e]; `p` is the kernel's Params
// (fields named below). Ops run in fp32, in chain order; the output is rounded once afterwards.
// A chain is `Chain<Ops...>`; `Chain::kMask` says whether a ReLU mask is written (bit = stored y > 0).
//
// Params fields used: scale, shift, alpha (const float* [K]), alpha_scalar (float),
// residual (const void*, element type from AddResidual<T>).
#pragma once
#include "common.cuh"

namespace igemm::epi {

template <class T, int V>
struct alignas(sizeof(T) * V) Vec { T v[V]; };

// y = v * scale[ch] + shift[ch]: BatchNorm (inference) folded at plan time, Bias, or both.
struct ScaleShift {
  template <int V, class P>
  IGEMM_DEVICE static void apply(float (&v)[V], const int (&ch)[V], int64_t, const P& p) {
    const float* sc = static_cast<const float*>(p.scale);
    const float* sh = static_cast<const float*>(p.shift);
#pragma unroll
    for (int e = 0; e < V; ++e) v[e] = fmaf(v[e], __ldg(sc + ch[e]), __ldg(sh + ch[e]));
  }
};

// y = v + shift[ch] (a bias alone).
struct Shift {
  template <int V, class P>
  IGEMM_DEVICE static void apply(float (&v)[V], const int (&ch)[V], int64_t, const P& p) {
    const float* sh = static_cast<const float*>(p.shift);
#pragma unroll
    for (int e = 0; e < V; ++e) v[e] += __ldg(sh + ch[e]);
  }
};

// y = v + residual[off + e]; the residual has the output's shape and layout, element type T.
template <class T>
struct AddResidual {
  template <int V, class P>
  IGEMM_DEVICE static void apply(float (&v)[V], const int (&)[V], int64_t off, const P& p) {
    const T* r = static_cast<const T*>(p.residual) + off;
    if constexpr (V * sizeof(T) >= 4 && (V * sizeof(T)) % 4 == 0) {
      Vec<T, V> x = *reinterpret_cast<const Vec<T, V>*>(r);
#pragma unroll
      for (int e = 0; e < V; ++e) v[e] += to_float(x.v[e]);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) v[e] += to_float(r[e]);
    }
  }
};

// ReLU with PyTorch's NaN semantics (NaN stays NaN). Mask=true: the kernel writes the 1-bit mask.
template <bool Mask>
struct Relu {
  static constexpr bool kMask = Mask;
  template <int V, class P>
  IGEMM_DEVICE static void apply(float (&v)[V], const int (&)[V], int64_t, const P&) {
#pragma unroll
    for (int e = 0; e < V; ++e) v[e] = (v[e] > 0.f || v[e] != v[e]) ? v[e] : 0.f;
  }
};

// PReLU: y = v > 0 ? v : alpha * v, alpha per channel (alpha[ch]) or one scalar.
template <bool PerChannel>
struct PRelu {
  template <int V, class P>
  IGEMM_DEVICE static void apply(float (&v)[V], const int (&ch)[V], int64_t, const P& p) {
    const float* a = static_cast<const float*>(p.alpha);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      float al = PerChannel ? __ldg(a + ch[e]) : p.alpha_scalar;
      v[e] = v[e] > 0.f ? v[e] : al * v[e];
    }
  }
};

template <class Op> struct op_mask { static constexpr bool value = false; };
template <bool M> struct op_mask<Relu<M>> { static constexpr bool value = M; };

template <class... Ops>
struct Chain {
  static constexpr bool kMask = (false || ... || op_mask<Ops>::value);
  template <int V, class P>
  IGEMM_DEVICE static void apply(float (&v)[V], const int (&ch)[V], int64_t off, const P& p) {
    (Ops::template apply<V>(v, ch, off, p), ...);
  }
};

}  // namespace igemm::epi
