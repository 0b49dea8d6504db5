// igemm: epilogue functors of the conv kernel (and of any GEMM-like kernel that stores through the
// same store phase).
//
// Every op has the same shape: `apply<V, Contig>(v, ch, res, ctx)` transforms V fp32 values in place
// (Contig: kChAny; kChContig = the channels are consecutive, ch[e] = ch[0] + e, ch[0] % 4 == 0; kChPairs =
// pairs of consecutive channels, ch[2i + 1] = ch[2i] + 1 with ch[2i] even), where
// v[e] is the value of the output element at linear offset off + e (memory order of the output), ch[e]
// its output channel *relative to the CTA's first channel* (an index into ctx's per-channel vectors,
// staged in shared memory once per CTA), and res[e] the residual element at the same offset (loaded
// ahead by the store phase when the chain has an AddResidual). Ops run in fp32, in chain order; the
// output is rounded once afterwards. A chain is `Chain<Ops...>`; `Chain::kMask` says whether a ReLU
// mask is written (bit = stored y > 0), `Chain::kResidual` whether a residual is read (element type
// `Chain::Res`).
#pragma once
#include <type_traits>
#include "common.cuh"

namespace igemm::epi {

template <class T, int V>
struct alignas(sizeof(T) * V) Vec { T v[V]; };

struct Ctx {
  const float* scale;     // per-channel vectors (shared memory, 16-byte aligned), indexed by ch
  const float* shift;
  const float* alpha;
  float alpha_scalar;
};

enum : int { kChAny = 0, kChContig = 1, kChPairs = 2 };

// vec[ch[e]] for e < V; kChContig: one 16-byte read per 4 channels, kChPairs: one 8-byte read per pair.
template <int Contig, int V>
IGEMM_DEVICE void channel_values(const float* vec, const int (&ch)[V], float (&out)[V]) {
  if constexpr (Contig == kChContig && V % 4 == 0) {
#pragma unroll
    for (int e = 0; e < V; e += 4) {
      const float4 t = *reinterpret_cast<const float4*>(vec + ch[0] + e);
      out[e] = t.x; out[e + 1] = t.y; out[e + 2] = t.z; out[e + 3] = t.w;
    }
  } else if constexpr (Contig == kChPairs && V % 2 == 0) {
#pragma unroll
    for (int e = 0; e < V; e += 2) {
      const float2 t = *reinterpret_cast<const float2*>(vec + ch[e]);
      out[e] = t.x; out[e + 1] = t.y;
    }
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) out[e] = vec[ch[e]];
  }
}

// y = v * scale[ch] + shift[ch]: BatchNorm (inference) folded at plan time, Bias, or both.
struct ScaleShift {
  template <int V, int Contig>
  IGEMM_DEVICE static void apply(float (&v)[V], const int (&ch)[V], const float (&)[V], const Ctx& c) {
    float sc[V], sh[V];
    channel_values<Contig>(c.scale, ch, sc);
    channel_values<Contig>(c.shift, ch, sh);
#pragma unroll
    for (int e = 0; e < V; ++e) v[e] = fmaf(v[e], sc[e], sh[e]);
  }
};

// y = v + shift[ch] (a bias alone).
struct Shift {
  template <int V, int Contig>
  IGEMM_DEVICE static void apply(float (&v)[V], const int (&ch)[V], const float (&)[V], const Ctx& c) {
    float sh[V];
    channel_values<Contig>(c.shift, ch, sh);
#pragma unroll
    for (int e = 0; e < V; ++e) v[e] += sh[e];
  }
};

// y = v + residual (the output's shape and layout, element type T).
template <class T>
struct AddResidual {
  using Res = T;
  template <int V, int Contig>
  IGEMM_DEVICE static void apply(float (&v)[V], const int (&)[V], const float (&r)[V], const Ctx&) {
#pragma unroll
    for (int e = 0; e < V; ++e) v[e] += r[e];
  }
};

// max(v, +0) keeping a NaN (one max.NaN instruction on sm_80+); -0 and negatives give +0.
IGEMM_DEVICE float relu_keep_nan(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, 0f00000000;" : "=f"(r) : "f"(v));
  return r;
#else
  return (v > 0.f || v != v) ? v : 0.f;
#endif
}

// ReLU with PyTorch's NaN semantics (NaN stays NaN). Mask=true: the kernel writes the 1-bit mask.
template <bool Mask>
struct Relu {
  template <int V, int Contig>
  IGEMM_DEVICE static void apply(float (&v)[V], const int (&)[V], const float (&)[V], const Ctx&) {
#pragma unroll
    for (int e = 0; e < V; ++e) v[e] = relu_keep_nan(v[e]);
  }
};

// PReLU: y = v > 0 ? v : alpha * v, alpha per channel (alpha[ch]) or one scalar.
template <bool PerChannel>
struct PRelu {
  template <int V, int Contig>
  IGEMM_DEVICE static void apply(float (&v)[V], const int (&ch)[V], const float (&)[V], const Ctx& c) {
    float al[V];
    if constexpr (PerChannel) {
      channel_values<Contig>(c.alpha, ch, al);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) al[e] = c.alpha_scalar;
    }
#pragma unroll
    for (int e = 0; e < V; ++e) v[e] = v[e] > 0.f ? v[e] : al[e] * v[e];
  }
};

template <class Op> struct op_mask { static constexpr bool value = false; };
template <bool M> struct op_mask<Relu<M>> { static constexpr bool value = M; };
template <class Op> struct op_res { using type = void; };
template <class T> struct op_res<AddResidual<T>> { using type = T; };

template <class... Ops> struct first_res { using type = void; };
template <class Op, class... Ops> struct first_res<Op, Ops...> {
  using type = std::conditional_t<std::is_void_v<typename op_res<Op>::type>, typename first_res<Ops...>::type,
                                  typename op_res<Op>::type>;
};

template <class... Ops>
struct Chain {
  static constexpr bool kMask = (false || ... || op_mask<Ops>::value);
  using Res = typename first_res<Ops...>::type;
  static constexpr bool kResidual = !std::is_void_v<Res>;
  static constexpr bool kEmpty = sizeof...(Ops) == 0;     // the identity: no per-channel vectors read
  template <int V, int Contig>
  IGEMM_DEVICE static void apply(float (&v)[V], const int (&ch)[V], const float (&res)[V], const Ctx& c) {
    (Ops::template apply<V, Contig>(v, ch, res, c), ...);
  }
};

}  // namespace igemm::epi
