// igemm conv2d backward: dgrad's work for the native kernels' mainloops (csrc/conv/grad_sm90.cuh;
// igemm/conv/_native_dgrad.py builds the launch).
//   dgrad  up to four output phases of dx a launch (igemm/conv/_backward.py: phases_1d; stride 1 has one), each the
//          stride-1 convolution of dy (padding ph, pw and dilation dh, dw of the phase) with the phase's taps of the
//          flipped filter, GEMM M = N × the sub-output's pixels, N = C, reduction = taps × K, a k-tile = one tap ×
//          64 channels of dy. A = dy through the phase's im2col map (K-major, as the forward's A), B = w as
//          [K][R·S][C] (tiled map: 64 channels of dy × 64 of x at the filter's tap lh − t·eh, lw − u·ew): MN-major.
//          No filter move; the store puts the phase's rows of the sub-output into dx (no interleave). The phases'
//          tiles are one list of units, so a strided dgrad is one launch (docs/performance.md: dgrad-one-launch).
#pragma once
#include "conv/grad_sm90.cuh"

namespace igemm::grad {

// One dgrad phase of a launch: a 128-byte launch parameter (igemm/conv/_native_dgrad.py packs it, _PHASE_FIELDS): the
// sub-output's pixels M, its k-tiles KT (taps × K / 64) and first unit u0 in the launch; the stride-1
// sub-convolution's padding (ph, pw) and dilation (dh, dw); the filter's taps (lh − t·eh, lw − u·ew); where its rows
// go in dx (crop, rows, ph_h, ph_w); its divisors (sub-output pixels an image, a row; taps a row).
struct DgradPhase {
  int32_t M, KT, u0, ph, pw, dh, dw, lh, lw, eh, ew, crop_h, crop_w, rows_h, rows_w, ph_h, ph_w;
  FastDiv fd_PQ, fd_Q, fd_T;
};
static_assert(sizeof(DgradPhase) <= 128, "a phase is one 128-byte parameter");

// dgrad's units: the tiles of up to four output phases in one launch (p.nph of them, heaviest first: u0 ascending),
// every tile over all its phase's taps × K / 64 k-tiles; a phase's dy through its own im2col map. Add: dx += the
// tile (the training path's identity gradient, igemm/nn/_train_fast.py: _Link). Sums: each tile also writes the
// BatchNorm backward's sums over its rows for the layer whose output gradient dx is (sums below), and with bx that
// layer's output ReLU(BN(z)) (remake).
template <class T, int BM, int BN, bool Add, int Store, bool Mask, bool Sums, class P>
struct DgradWork {
  static constexpr int NB = BN / 64;
  // kStoreTensor: one phase whose rows are dx's (p.tmY maps dx); kStoreRowsZeros: kStoreRows and zeros()
  static constexpr int kStore = Store == kStoreRowsZeros ? kStoreRows : Store;
  static constexpr bool kAdd = Add, kMask = Mask, kZeros = Store == kStoreRowsZeros, kBMajorK = false, kSums = Sums;
  static_assert(!(Sums && Add), "the sums are of the tile as stored, not of a sum with dx");
  static constexpr int kMaskBytes = Mask ? BM * 16 : 0;     // (a stage's mask rows: 16 bytes a row of A)
  const P& p;
  struct Unit {
    int m0, n0, nkt;
    TileOrigin o;                           // sub-output pixel m0 -> dy coordinate of its tap (0, 0)
    const DgradPhase* f;                    // (in the launch's parameters)
    const void* map;                        // the phase's im2col map of dy
    const void* mmap;                       // (Mask) its im2col map of the mask
  };
  IGEMM_DEVICE const DgradPhase* phase(int i) const {
    return static_cast<const DgradPhase*>(i == 0 ? p.f0 : i == 1 ? p.f1 : i == 2 ? p.f2 : p.f3);
  }
  IGEMM_DEVICE int units() const { return p.units; }
  IGEMM_DEVICE int M(const Unit& un) const { return un.f->M; }
  IGEMM_DEVICE int Ncol() const { return p.C; }
  IGEMM_DEVICE Unit unit(int u) const {
    int i = 0;
#pragma unroll
    for (int j = 1; j < 4; ++j) i += j < p.nph && u >= phase(j)->u0;
    const DgradPhase* f = phase(i);
    const TileCoord tc = grad_tile_coord<BM, BN>(u - f->u0, p.C);
    int n, pq, pp, qq;
    f->fd_PQ.divmod(n, pq, tc.m0);
    f->fd_Q.divmod(pp, qq, pq);
    const void* mmap = nullptr;
    if constexpr (kMask) mmap = i == 0 ? p.tmM0 : i == 1 ? p.tmM1 : i == 2 ? p.tmM2 : p.tmM3;
    return {tc.m0, tc.n0, f->KT, {n, pp - f->ph, qq - f->pw}, f,
            i == 0 ? p.tmA0 : i == 1 ? p.tmA1 : i == 2 ? p.tmA2 : p.tmA3, mmap};
  }
  // k-tile kt = sub-filter tap (t, u) × dy channels kb·64 ..
  IGEMM_DEVICE void issue(const Unit& un, int kt, uint8_t* a, uint64_t* bar) const {
    const DgradPhase& f = *un.f;
    int tap, kb, t, u;
    p.fd_KB.divmod(tap, kb, kt);
    f.fd_T.divmod(t, u, tap);
    mbar_expect_tx(bar, (BM + BN) * BK * 2 + kMaskBytes);
    tma_load_im2col_4d(a, un.map, bar, kb * BK, un.o.w0, un.o.h0, un.o.n, uint16_t(u * f.dw), uint16_t(t * f.dh));
    if constexpr (kMask)                    // (words 4·(kb / 2) .. + 3 of each row's pixel: 16-byte aligned)
      tma_load_im2col_4d(a + (BM + BN) * BK * 2, un.mmap, bar, 4 * (kb >> 1), un.o.w0, un.o.h0, un.o.n,
                         uint16_t(u * f.dw), uint16_t(t * f.dh));
    const int wtap = (f.lh - t * f.eh) * p.S + (f.lw - u * f.ew);     // the filter's tap, flipped
#pragma unroll
    for (int j = 0; j < NB; ++j) tma_load_3d(a + BM * BK * 2 + j * BOX, p.tmB, bar, un.n0 + 64 * j, wtap, kb * BK);
  }
  IGEMM_DEVICE T* out(const Unit&) const { return static_cast<T*>(const_cast<void*>(p.y)); }
  // sub-output pixel (n, i, j) -> dx pixel (n, ph_h + st_h·(i − crop_h), ph_w + st_w·(j − crop_w)), rows i and
  // columns j outside the phase's [crop, crop + rows) not stored
  IGEMM_DEVICE int64_t row_at(const Unit& un, int row) const {
    const DgradPhase& f = *un.f;
    int n, ij, i, j;
    f.fd_PQ.divmod(n, ij, row);
    f.fd_Q.divmod(i, j, ij);
    i -= f.crop_h;
    j -= f.crop_w;
    if (unsigned(i) >= unsigned(f.rows_h) || unsigned(j) >= unsigned(f.rows_w)) return -1;
    return ((int64_t(n) * p.H + f.ph_h + p.st_h * i) * p.W + f.ph_w + p.st_w * j) * p.C;
  }
  // kZeros (one live phase, dx's pixels (st_h·i, st_w·j): igemm/conv/_native_dgrad.py fills_zeros): row's dx pixel
  // at element offset `at` is the corner of a st_h x st_w block of dx whose other pixels no tap reaches; f(offset)
  // for each of them inside dx
  template <class F>
  IGEMM_DEVICE void zeros(const Unit& un, int row, int64_t at, F&& f) const {
    int n, ij, i, j;
    un.f->fd_PQ.divmod(n, ij, row);
    un.f->fd_Q.divmod(i, j, ij);
    const int h0 = p.st_h * i, w0 = p.st_w * j;
    for (int a = 0; a < p.st_h && h0 + a < p.H; ++a)
      for (int b = a == 0 ? 1 : 0; b < p.st_w && w0 + b < p.W; ++b) f(at + (int64_t(a) * p.W + b) * p.C);
  }
  IGEMM_DEVICE const void* store_map() const { return p.tmY; }
  // Mask: the stage's rows of mask words (16 bytes a row of A: the pixel's words 4·(kb / 2) .. + 3, its 64
  // channels' bits the uint64 at 8·(kb % 2); K / 64 is even and a unit's k-tile i has kb % 2 == i % 2). The
  // thread's fragment rows are tile rows rl and rl + 8.
  struct Masker {
    int row, sh;                            // row rl's byte offset; 2t
    uint64_t x7[2], x6[2];                  // the rows' words >> 2t, << 7 and << 6
    uint32_t a[2][16];
    template <int Par>
    IGEMM_DEVICE void words(uint32_t sm) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        uint64_t v;
        asm volatile("ld.shared.u64 %0, [%1];\n" : "=l"(v) : "r"(sm + row + r * 8 * 16 + 8 * Par));
        v >>= sh;
        x7[r] = v << 7;
        x6[r] = v << 6;
      }
    }
    // the pair of k columns 2t + 8·h + 16·ks is bits 8·(2ks + h) + {0, 1} after >> 2t: shifted to the top of their
    // byte (<< 7, << 6), each byte's sign spreads to a 16-bit lane
    IGEMM_DEVICE void apply(int ks, uint32_t* a) const {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int j = 2 * ks + h;
          const uint32_t lo = uint32_t(j < 4 ? x7[r] : x7[r] >> 32), hi = uint32_t(j < 4 ? x6[r] : x6[r] >> 32);
          a[2 * h + r] &= lanes_of(lo, hi, j & 3, 4 + (j & 3));
        }
      }
    }
  };
  // Sums (docs/performance.md: bn-sums-in-dgrad): dx is the gradient of y = ReLU(BN(z)) of the layer before, whose
  // z (dx's shape, p.bz), ReLU mask (p.bmask: a bit an element of dx, in dx's order) and batch mean (p.bmean, fp32)
  // the tile reads; it writes, per channel, sum g and sum g·(z − mean) with g = bit ? dx : 0 over its stored rows
  // (dx as stored, 16-bit) to p.bsum[k][tile][c] (k = 0, 1; tile = u / column blocks; fp32), which that layer's
  // BatchNorm backward adds instead of reading dy and z (csrc/norm_train.cuh: tiles_merge).
  // sums_load: thread tid's (of NT = 2·BM) rows rg, rg + RG, ... of z and their mask bits, channels n0 + 8·vc ..
  // + 7 (a row not stored: bits 0, adding nothing), and those channels' means
  static constexpr int kSumsNT = 2 * BM, kSumsVN = BN / 8, kSumsRG = kSumsNT / kSumsVN, kSumsRPT = BM / kSumsRG;
  struct SumsIn {
    uint4 z[kSumsRPT];
    uint32_t bits[kSumsRPT];
    float mu[8];
  };
  IGEMM_DEVICE SumsIn sums_load(const Unit& un, int tid) const {
    const int vc = tid % kSumsVN, rg = tid / kSumsVN, col = un.n0 + 8 * vc;
    const bool live = col < p.C;
    SumsIn in;
#pragma unroll
    for (int j = 0; j < 8; ++j) in.mu[j] = live ? static_cast<const float*>(p.bmean)[col + j] : 0.f;
#pragma unroll
    for (int k = 0; k < kSumsRPT; ++k) {
      const int row = un.m0 + rg + k * kSumsRG;
      const int64_t at = live && row < un.f->M ? row_at(un, row) : -1;
      in.bits[k] = 0u;
      in.z[k] = make_uint4(0, 0, 0, 0);
      if (at >= 0) {
        in.z[k] = ldg_stream16(static_cast<const T*>(p.bz) + at + col);
        in.bits[k] = p.bmask != nullptr ? uint32_t(__ldg(static_cast<const uint8_t*>(p.bmask) + ((at + col) >> 3)))
                                        : 0xFFu;
      }
    }
    return in;
  }
  // remake (p.bx set): that layer's forward output x = ReLU(BN(z)) over the thread's rows (the training path keeps
  // z, not x: train-remake-input), for this layer's wgrad, from sums_load's z and means with the forward's arithmetic
  // on its statistics (p.binv, p.bgamma, p.bbeta; csrc/norm_elemt.cuh's bn_forward_block: the same bits), instead
  // of the remake kernel's pass over z (docs/performance.md: remake-in-dgrad)
  IGEMM_DEVICE void remake(const Unit& un, int tid, const SumsIn& in) const {
    const int vc = tid % kSumsVN, rg = tid / kSumsVN, col = un.n0 + 8 * vc;
    if (p.bx == nullptr || col >= p.C) return;
    const float* inv = static_cast<const float*>(p.binv);
    const float* gm = static_cast<const float*>(p.bgamma);
    const float* bt = static_cast<const float*>(p.bbeta);
    float a[8], b[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      a[j] = __ldg(inv + col + j) * (gm != nullptr ? __ldg(gm + col + j) : 1.f);
      b[j] = bt != nullptr ? __ldg(bt + col + j) : 0.f;
    }
    T* x = static_cast<T*>(const_cast<void*>(p.bx));
#pragma unroll
    for (int k = 0; k < kSumsRPT; ++k) {
      const int row = un.m0 + rg + k * kSumsRG;
      if (row >= un.f->M) continue;
      const T* z = reinterpret_cast<const T*>(&in.z[k]);
      uint4 o;
      T* ov = reinterpret_cast<T*>(&o);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        ov[j] = from_float<T>(epi::relu_keep_nan(fmaf(to_float(z[j]) - in.mu[j], a[j], b[j])));
      *reinterpret_cast<uint4*>(x + row_at(un, row) + col) = o;
    }
  }
  // sums: after the tile's store, from its C tile (the TMA store's: SW128 blocks of 64 columns) and sums_load's
  // `in`. Thread tid sums 8 channels (vector vc) over its rows; the lanes of a warp with the same vc, then the warps
  // in order, are added (a fixed order: the same bits every run). The remake's stores go out first.
  template <class Sync>
  IGEMM_DEVICE void sums(const Unit& un, int u, const uint8_t* cs, int tid, Sync sync, const SumsIn& in) const {
    constexpr int NT = kSumsNT, VN = kSumsVN, RG = kSumsRG, RPT = kSumsRPT, NW = NT / 32;
    __shared__ float red[2][NW][BN];
    remake(un, tid, in);
    const int vc = tid % VN, rg = tid / VN;
    float a[8], b[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) a[j] = b[j] = 0.f;
#pragma unroll
    for (int k = 0; k < RPT; ++k) {
      const int r = rg + k * RG, c = 8 * vc;
      const uint4 dv =
          *reinterpret_cast<const uint4*>(cs + (c / 64) * BM * 128 + r * 128 + ((((c % 64) / 8) ^ (r & 7)) << 4));
      const T* d = reinterpret_cast<const T*>(&dv);
      const T* z = reinterpret_cast<const T*>(&in.z[k]);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float g = (in.bits[k] >> j) & 1u ? to_float(d[j]) : 0.f;
        a[j] += g;
        b[j] = fmaf(g, to_float(z[j]) - in.mu[j], b[j]);
      }
    }
#pragma unroll
    for (int off = VN; off < 32; off <<= 1)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        a[j] += __shfl_xor_sync(0xffffffffu, a[j], off);
        b[j] += __shfl_xor_sync(0xffffffffu, b[j], off);
      }
    const int lane = tid & 31, w = tid >> 5;
    if (lane < VN) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        red[0][w][8 * lane + j] = a[j];
        red[1][w][8 * lane + j] = b[j];
      }
    }
    sync();
    const int tn = (p.C + BN - 1) / BN, T_ = p.units / tn;
    float* out = static_cast<float*>(const_cast<void*>(p.bsum)) + int64_t(u / tn) * p.C + un.n0;
    for (int i = tid; i < 2 * BN; i += NT) {
      const int k = i / BN, c = i % BN;
      if (un.n0 + c >= p.C) continue;
      float s = 0.f;
#pragma unroll
      for (int v = 0; v < NW; ++v) s += red[k][v][c];
      out[int64_t(k) * T_ * p.C + c] = s;
    }
  }
  IGEMM_DEVICE auto masker(const Unit&, int tid) const {
    if constexpr (kMask) {
      Masker mk;
      mk.row = ((tid / 128) * 64 + ((tid >> 5) & 3) * 16 + ((tid & 31) >> 2)) * 16;
      mk.sh = 2 * (tid & 3);
      return mk;
    } else {
      return NoMask{};
    }
  }
};

template <class T, int BM, int BN, int Stages, bool Ws, bool Add, int Store, bool Mask, bool Sums = false, class P>
__device__ void dgrad(const P& p) {
  static_assert(!Sums || (Ws && Store == kStoreTensor), "the sums: the persistent kernel's TMA-stored tiles");
  grad_run<T, T, BM, BN, Stages, Ws, true>(DgradWork<T, BM, BN, Add, Store, Mask, Sums, P>{p}, p.tmA0, p.tmB);
}

}  // namespace igemm::grad
