// igemm conv2d forward: the fp32 C tile's epilogue -- split-K reduction and the store phase.
//
// Split-K (p.splits > 1; grid.z = splits): every CTA of a tile writes its fp32 partial tile to the
// workspace, then takes a ticket; the last one sums the partials in split order (deterministic: the
// same order every run, its own partial included) into its shared C tile, resets the tile's counter
// (so the next launch or graph replay starts from zero) and runs the epilogue. No host synchronisation.
//
// Store phase: reads the fp32 C tile from shared memory, applies the epilogue chain per output vector of
// VecO elements (contiguous in memory), rounds once, stores; builds ReLU mask words from the rounded
// values (bit = y > 0) when FuseMask. Word ownership: a warp's 32 consecutive vectors cover whole,
// aligned 32-element words (the plan picks StoreMode/FuseMask so that this holds). Per-channel vectors
// are staged in shared memory once per CTA; residual vectors of G passes are loaded before any of them
// is used (G independent loads in flight).
#pragma once
#include "conv/config.cuh"

namespace igemm::conv {

// Returns false in CTAs that are not the last of their tile (they have nothing left to do).
template <class Cfg, class P>
IGEMM_DEVICE bool splitk_reduce(const P& p, float* Cs, int tile) {
  constexpr int ROWS = Cfg::kCsPixelMajor ? Cfg::BM : Cfg::BN;
  constexpr int COLS = Cfg::kCsPixelMajor ? Cfg::BN : Cfg::BM;
  constexpr int LD = Cfg::kCsLd;
  constexpr int N4 = ROWS * COLS / 4;
  __shared__ int s_last;
  float* ws = static_cast<float*>(const_cast<void*>(p.ws));
  int* counters = static_cast<int*>(const_cast<void*>(p.counters));
  float4* mine = reinterpret_cast<float4*>(ws + (int64_t(tile) * p.splits + blockIdx.z) * (ROWS * COLS));
  for (int i = threadIdx.x; i < N4; i += Cfg::kThreads) {
    const int r = i / (COLS / 4), c = (i % (COLS / 4)) * 4;
    mine[i] = *reinterpret_cast<const float4*>(Cs + r * LD + c);
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(counters + tile, 1) == p.splits - 1;
  __syncthreads();
  if (!s_last) return false;
  __threadfence();
  const float4* all = reinterpret_cast<const float4*>(ws + int64_t(tile) * p.splits * (ROWS * COLS));
  for (int i = threadIdx.x; i < N4; i += Cfg::kThreads) {
    float4 s = __ldcg(all + i);
    for (int z = 1; z < p.splits; ++z) {
      const float4 t = __ldcg(all + int64_t(z) * N4 + i);
      s.x += t.x; s.y += t.y; s.z += t.z; s.w += t.w;
    }
    const int r = i / (COLS / 4), c = (i % (COLS / 4)) * 4;
    *reinterpret_cast<float4*>(Cs + r * LD + c) = s;
  }
  if (threadIdx.x == 0) counters[tile] = 0;
  __syncthreads();
  return true;
}

// V consecutive fp32 of the C tile; 16-byte aligned when V % 4 == 0 (rows start at multiples of 4).
template <int V>
IGEMM_DEVICE void load_row(const float* src, float (&val)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int e = 0; e < V; e += 4) {
      const float4 t = *reinterpret_cast<const float4*>(src + e);
      val[e] = t.x; val[e + 1] = t.y; val[e + 2] = t.z; val[e + 3] = t.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) val[e] = src[e];
  }
}

// Where output vector v of the CTA lives: linear offset, valid prefix length, and (for the Cs read)
// its row/column in the shared tile.
template <class Cfg, class P>
struct StoreMap {
  static constexpr int V = Cfg::VecO, BM = Cfg::BM, BN = Cfg::BN;
  int nvec, rows_valid;

  IGEMM_DEVICE StoreMap(const P& p, int m0) {
    rows_valid = min(BM, p.M - m0);
    if constexpr (Cfg::StoreMode == kStoreRows) nvec = BM * (BN / V);
    else if constexpr (Cfg::StoreMode == kStoreNCHW) nvec = BN * (BM / V);
    else nvec = (rows_valid * p.K + V - 1) / V;
  }

  IGEMM_DEVICE void locate(const P& p, int v, int m0, int n0, int64_t& off, int& nvalid) const {
    off = 0;
    nvalid = 0;
    if (v >= nvec) return;
    if constexpr (Cfg::StoreMode == kStoreRows) {
      const int row = v / (BN / V), col = (v % (BN / V)) * V;
      const int m = m0 + row, n = n0 + col;
      off = int64_t(m) * p.K + n;
      if (m < p.M) nvalid = max(0, min(V, p.K - n));
    } else if constexpr (Cfg::StoreMode == kStoreNCHW) {
      const int nl = v / (BM / V), ml = (v % (BM / V)) * V;
      const int n = n0 + nl, m = m0 + ml;
      int img, pq;
      p.fd_PQ.divmod(img, pq, min(m, p.M - 1));
      off = (int64_t(img) * p.K + n) * p.PQ + pq;
      if (m < p.M && n < p.K) nvalid = V;   // V > 1 only when P·Q % V == 0: the vector is inside one image
    } else {
      const int e0 = v * V;
      off = int64_t(m0) * p.K + e0;
      nvalid = min(V, rows_valid * p.K - e0);
    }
  }

  // fp32 values and CTA-relative channels of vector v
  IGEMM_DEVICE void gather(const P& p, const float* Cs, int v, float (&val)[V], int (&ch)[V]) const {
    constexpr int LD = Cfg::kCsLd;
    if constexpr (Cfg::StoreMode == kStoreRows) {
      const int row = v / (BN / V), col = (v % (BN / V)) * V;
      load_row<V>(Cs + row * LD + col, val);
#pragma unroll
      for (int e = 0; e < V; ++e) ch[e] = col + e;
    } else if constexpr (Cfg::StoreMode == kStoreNCHW) {
      const int nl = v / (BM / V), ml = (v % (BM / V)) * V;
      load_row<V>(Cs + nl * LD + ml, val);
#pragma unroll
      for (int e = 0; e < V; ++e) ch[e] = nl;
    } else {
      int row, col;
      p.fd_K.divmod(row, col, v * V);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        val[e] = Cs[min(row, BM - 1) * LD + col];
        ch[e] = col;
        if (++col == p.K) { col = 0; ++row; }
      }
    }
  }
};

// The tile's per-channel vectors (scale, shift, alpha of channels n0..n0+BN-1) into shared memory, by NT
// threads; the caller synchronises before reading them.
template <int BN, int NT, class P>
IGEMM_DEVICE void stage_channel_vectors(const P& p, int n0, int tid, float (*s_vec)[BN]) {
  const float* sc = static_cast<const float*>(p.scale);
  const float* sh = static_cast<const float*>(p.shift);
  const float* al = static_cast<const float*>(p.alpha);
  for (int i = tid; i < BN; i += NT) {
    const int n = min(n0 + i, p.K - 1);
    s_vec[0][i] = sc ? __ldg(sc + n) : 1.f;
    s_vec[1][i] = sh ? __ldg(sh + n) : 0.f;
    s_vec[2][i] = al ? __ldg(al + n) : 0.f;
  }
}

struct CtaSync {
  IGEMM_DEVICE void operator()() const { __syncthreads(); }
};

// The store phase of one tile by NT threads (tid = 0..NT-1), which `sync` synchronises; s_vec: 3 × BN
// floats of shared memory for the per-channel vectors. The whole CTA by default; one consumer warpgroup
// of the persistent kernel (persistent_sm90.cuh) with a named barrier.
template <class Cfg, int NT, class P, class Sync>
IGEMM_DEVICE void epilogue_store_by(const P& p, const float* Cs, int m0, int n0, int tid, float (*s_vec)[Cfg::BN],
                                    Sync sync) {
  using TO = typename Cfg::ElementOut;
  using Epi = typename Cfg::Epi;
  using RT = std::conditional_t<Epi::kResidual, typename Epi::Res, TO>;
  constexpr int V = Cfg::VecO, BN = Cfg::BN, G = 4;
  stage_channel_vectors<BN, NT>(p, n0, tid, s_vec);
  sync();
  const epi::Ctx ctx{s_vec[0], s_vec[1], s_vec[2], p.alpha_scalar};
  TO* y = static_cast<TO*>(const_cast<void*>(p.y));
  const RT* resp = static_cast<const RT*>(p.residual);
  uint32_t* mask = static_cast<uint32_t*>(const_cast<void*>(p.mask));
  const int lane = tid & 31;
  const StoreMap<Cfg, P> map(p, m0);
  const int passes = (map.nvec + NT - 1) / NT;

  for (int pass0 = 0; pass0 < passes; pass0 += G) {
    int64_t off[G];
    int nvalid[G];
    epi::Vec<RT, V> rv[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      map.locate(p, (pass0 + g) * NT + tid, m0, n0, off[g], nvalid[g]);
      if constexpr (Epi::kResidual) {
        if (nvalid[g] == V) {
          rv[g] = *reinterpret_cast<const epi::Vec<RT, V>*>(resp + off[g]);
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e) rv[g].v[e] = e < nvalid[g] ? resp[off[g] + e] : RT(0.f);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      uint32_t bits = 0;
      if (nvalid[g] > 0) {
        float val[V], res[V];
        int ch[V];
        map.gather(p, Cs, (pass0 + g) * NT + tid, val, ch);
#pragma unroll
        for (int e = 0; e < V; ++e) res[e] = Epi::kResidual ? to_float(rv[g].v[e]) : 0.f;
        // channels are consecutive in rows mode, and in linear mode when K % V == 0 (no row wrap)
        if (Cfg::StoreMode == kStoreRows || (Cfg::StoreMode == kStoreLinear && p.K % V == 0))
          Epi::template apply<V, true>(val, ch, res, ctx);
        else
          Epi::template apply<V, false>(val, ch, res, ctx);
        epi::Vec<TO, V> o;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          o.v[e] = from_float<TO>(val[e]);
          bits |= uint32_t(e < nvalid[g] && to_float(o.v[e]) > 0.f) << e;
        }
        if (nvalid[g] == V) {
          *reinterpret_cast<epi::Vec<TO, V>*>(y + off[g]) = o;
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e)
            if (e < nvalid[g]) y[off[g] + e] = o.v[e];
        }
      }
      if constexpr (Cfg::FuseMask) {
        constexpr int kLanesPerWord = 32 / V;
        uint32_t word = bits << ((lane % kLanesPerWord) * V);
#pragma unroll
        for (int o2 = 1; o2 < kLanesPerWord; o2 <<= 1) word |= __shfl_xor_sync(0xffffffffu, word, o2);
        // the word's first vector is the leader's own (off, nvalid): no broadcast needed
        if (lane % kLanesPerWord == 0 && nvalid[g] > 0) mask[off[g] >> 5] = word;
      }
    }
  }
}

template <class Cfg, class P>
IGEMM_DEVICE void epilogue_store(const P& p, const float* Cs, int m0, int n0) {
  __shared__ __align__(16) float s_vec[3][Cfg::BN];
  epilogue_store_by<Cfg, Cfg::kThreads>(p, Cs, m0, n0, int(threadIdx.x), s_vec, CtaSync{});
}

}  // namespace igemm::conv
