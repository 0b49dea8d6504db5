// igemm: the conv's input preparation -- batched 2-D transposes [B][rows][cols] -> [B][cols][pitch]
// (pitch >= rows; entries rows..pitch-1 are zero-filled) and channel pads [n][rows] -> [n][pitch]:
//   x  NCHW -> NHWC    (B = N, rows = C, cols = H·W, pitch = C, or 8 for C < 8)
//   w  KCRS -> KRSC    (B = K, rows = C, cols = R·S, pitch as x's)
//   x, w NHWC/KRSC with C < 8 -> C padded to 8 (pad jobs: n = pixels or K·R·S, rows = C, pitch = 8)
// Two jobs run in one launch (blocks [0, blocks0) do job 0, the rest job 1), so the preparation is a
// single kernel. Elements are moved as raw bits (T = uint16_t or uint32_t).
//
// A block moves 4096 destination-side elements; per job one of
//   kVec      (16-bit, rows % 8 == 0, cols % 8 == 0, pitch == rows, 16-byte aligned bases): a 64 x 64
//             tile through shared memory, 16-byte accesses;
//   kScalar64 a 64 x 64 tile, element accesses;  kScalar16  a 256 x 16 tile (a 3x3 filter's 9 taps);
//   kPad      4096 consecutive destination elements (no shared memory);
//   kSub      (job 0) kScalar64 reading a subsampled image: destination column c (of P·Q) is source pixel
//             (c / Q)·srow + (c % Q)·sw of an image of scols pixels -- x[:, :, ::sh, ::sw] of a 1x1
//             stride-s conv without padding, so the copy holds only the pixels the conv reads;
//   kWide     (job 0) a 4 x 1024 tile for rows <= 4 (conv1's C = 3): full 64x64 tiles would leave 60 of
//             every 64 rows empty; kWideVec the same with 16-byte accesses (16-bit, cols % 8 == 0, aligned
//             bases): a tile's destination is one contiguous run of 1024 · pitch elements.
//   kSubVec   (job 0) kSub for 16-bit x with sw == 2, W % 4 == 0 (so Q = W / 2 is even and a pair of
//             destination columns is one 8-byte source load: elements 0 and 2), pitch == rows, rows % 8 == 0,
//             aligned bases: 8-byte loads, kVec's 16-byte stores (1x1/2 512->1024 @28: scalar loads of every
//             other element moved 19 MB at ~1.2 TB/s);
//   kRowsVec  (16-bit, cols % 8 != 0 and cols <= 512 (or cols <= 16), rows % 8 == 0, pitch == rows, aligned
//             bases: a filter's KCRS -> KRSC, an image of 14 x 14 or 7 x 7 pixels) run_rows(cols) rows x all
//             cols: the tile's source is one contiguous run, read in 16-byte vectors; each destination row
//             gets 16-byte vectors of 8 rows (where kScalar16 / kScalar64 moved one 2-byte element a thread:
//             3x3 512->512's 4.7 MB filter, an NCHW dy of 196 pixels an image);
//   kScatter  (job 0) a subsampled copy's inverse, the zeros between: destination [cols][pitch] (pitch = H·W) gets at
//             pixel (h, w) source row (h / sh)·Q + w / sw where h % sh == w % sw == 0, else 0 -- the NHWC twin's dx
//             of a strided unpadded 1x1 (its stride-1 twin's) back to NCHW; 16-bit, cols % 8 == 0, an aligned
//             source: 64 x 64 destination tiles, 16-byte loads (none for the zeros), element stores; kScatterVec
//             the same with 16-byte stores (pitch % 8 == 0, an aligned destination);
//   kColsVec  its mirror (16-bit, rows % 8 != 0 and rows <= 512, cols % 8 == 0, pitch == rows, aligned bases:
//             the NHWC twin's dx of 14 x 14 or 7 x 7 pixels back to NCHW, a KRSC filter back to KCRS) all rows x
//             run_rows(rows) cols: 16-byte loads along cols, the tile's destination one contiguous run written
//             in 16-byte vectors.
//   kVecFlip  (job 1) kVec whose destination rows are reversed within groups of grp (row j goes to
//             (j / grp)·grp + grp - 1 - j % grp): a stride-1 dgrad's filter w[K][C][R·S] straight into its
//             flipped sub-convolution's KRSC, [C][R·S reversed][K], in the transpose path's own launch.
#pragma once
#include "common.cuh"

namespace igemm::xpose {

constexpr int kThreads = 256;
constexpr int kElems = 4096;                       // elements per tile
constexpr int kSmemWords = 256 * 17;               // the largest tile below, as 32-bit words
enum : int { kScalar64 = 0, kScalar16 = 1, kVec = 2, kPad = 3, kSub = 4, kWide = 5, kWideVec = 6,
             kRowsVec = 7, kSubVec = 8, kColsVec = 9, kScatter = 10, kScatterVec = 11,
             kVecFlip = 12 };   // (igemm/conv/_transpose.py)
// kRowsVec's rows a tile for cols columns (kColsVec's columns for rows rows): a multiple of 8 whose tile fits the
// shared memory, at most 256 (igemm/conv/_transpose.py: run_rows)
IGEMM_DEVICE constexpr int run_rows(int cols) {
  return (2 * kSmemWords / cols) / 8 * 8 < 256 ? (2 * kSmemWords / cols) / 8 * 8 : 256;
}

// Scalar tile of (4096 / TC) rows x TC cols (TC = 64; 16 for short rows such as a filter's R*S; 1024 for
// rows <= 4): element loads coalesced along cols, element stores coalesced along rows, through a padded
// tile. Sub: source column c of row r is at r·scols + (c / q)·srow + (c % q)·sw (else r·cols + c).
struct SubMap { int scols, q, srow, sw; };

template <class T, int TC, bool Sub = false>
IGEMM_DEVICE void tile_scalar(uint32_t* sm, const T* __restrict__ src, T* __restrict__ dst, int rows, int cols,
                              int pitch, int img, int r0, int c0, SubMap sub = {}) {
  constexpr int TR = kElems / TC, LD = TC + 1;
  static_assert(TR * LD <= kSmemWords, "tile shape");
  const int tid = threadIdx.x;
  const int64_t sstride = Sub ? sub.scols : cols;             // source elements per row
  const T* s = src + int64_t(img) * rows * sstride;
  T* d = dst + int64_t(img) * pitch * cols;
  if constexpr (TC <= kThreads) {
    // a thread keeps one column (its source offset computed once) and walks rows
    const int c = tid % TC;
    int64_t coff = c0 + c;
    if constexpr (Sub) {
      const int py = (c0 + c) / sub.q;
      coff = int64_t(py) * sub.srow + int64_t(c0 + c - py * sub.q) * sub.sw;
    }
#pragma unroll
    for (int i = 0; i < kElems / kThreads; ++i) {
      const int r = tid / TC + i * (kThreads / TC);
      if (r0 + r < rows && c0 + c < cols) sm[r * LD + c] = s[int64_t(r0 + r) * sstride + coff];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kElems / kThreads; ++i) {
      const int r = tid % TR, cc = tid / TR + i * (kThreads / TR);
      if (c0 + cc < cols && r0 + r < pitch)
        d[int64_t(c0 + cc) * pitch + r0 + r] = r0 + r < rows ? T(sm[r * LD + cc]) : T(0);
    }
  } else {                      // kWide: 4 rows of 1024 columns
    static_assert(!Sub && TR <= 32, "wide tiles");
#pragma unroll
    for (int i = 0; i < kElems / kThreads; ++i) {
      const int e = tid + i * kThreads, r = e / TC, c = e % TC;
      if (r0 + r < rows && c0 + c < cols) sm[r * LD + c] = s[int64_t(r0 + r) * cols + c0 + c];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kElems / kThreads; ++i) {
      const int e = tid + i * kThreads, r = e % TR, c = e / TR;
      if (c0 + c < cols && r0 + r < pitch)
        d[int64_t(c0 + c) * pitch + r0 + r] = r0 + r < rows ? T(sm[r * LD + c]) : T(0);
    }
  }
}

// The store phase of the 16-bit 64 x 64 tiles (kVec, kSubVec): the tile in shared memory as 32-bit words
// (two columns each, a 33-word row pitch), destination column c0 + c gets 16-byte vectors of 8 rows (with
// grp > 0 it lands on destination row (j / grp)·grp + grp - 1 - j % grp, j = c0 + c: kVecFlip).
IGEMM_DEVICE void store_vec16_tile(const uint32_t* sm, uint16_t* __restrict__ d, int rows, int cols, int r0, int c0,
                                   int grp = 0) {
  constexpr int T64 = 64, LD = 33, CH = T64 / 8;
  const int tid = threadIdx.x;
#pragma unroll
  for (int i = 0; i < T64 * CH / kThreads; ++i) {
    const int q = tid + i * kThreads, c = q / CH, j = q % CH;
    if (c0 + c >= cols || r0 + j * 8 >= rows) continue;
    uint32_t h[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) h[e] = (sm[(j * 8 + e) * LD + (c >> 1)] >> ((c & 1) * 16)) & 0xffffu;
    const uint4 v = make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16), h[6] | (h[7] << 16));
    int dc = c0 + c;
    if (grp > 0) dc += grp - 1 - 2 * (dc % grp);
    stg_stream16(d + int64_t(dc) * rows + r0 + j * 8, v);
  }
}

// kSubVec: destination columns c0..c0+63 (pixel pairs (c, c+1) of one output row: source elements 0 and 2
// of an 8-byte load at (c / Q)·srow + 2·(c % Q)) of rows r0..r0+63 of image img.
IGEMM_DEVICE void tile_sub_vec16(uint32_t* sm, const uint16_t* __restrict__ src, uint16_t* __restrict__ dst, int rows,
                                 int cols, int img, int r0, int c0, SubMap sub) {
  constexpr int T64 = 64, LD = 33;
  const int tid = threadIdx.x, pr = tid % 32, c = c0 + 2 * pr;     // this thread's destination pair
  const int py = c / sub.q;
  const uint16_t* s = src + int64_t(img) * rows * sub.scols + int64_t(py) * sub.srow + 2 * (c - py * sub.q);
#pragma unroll
  for (int i = 0; i < T64 * 32 / kThreads; ++i) {
    const int r = tid / 32 + i * (kThreads / 32);
    uint32_t word = 0;
    if (c < cols && r0 + r < rows) {
      const uint2 v = *reinterpret_cast<const uint2*>(s + int64_t(r0 + r) * sub.scols);
      word = (v.x & 0xffffu) | (v.y << 16);
    }
    sm[r * LD + pr] = word;
  }
  __syncthreads();
  store_vec16_tile(sm, dst + int64_t(img) * rows * cols, rows, cols, r0, c0);
}

// kScatter(Vec): destination channels ch0..ch0+63 x pixels px0..px0+63 of image img; m = {W, Q, sh, sw}.
template <bool Vec>
IGEMM_DEVICE void tile_scatter16(uint32_t* sm, const uint16_t* __restrict__ src, uint16_t* __restrict__ dst, int rows,
                                 int cols, int pitch, int img, int ch0, int px0, SubMap m) {
  constexpr int T64 = 64, LD = 33, CH = T64 / 8;
  const int tid = threadIdx.x;
  const uint16_t* s = src + int64_t(img) * rows * cols;
#pragma unroll
  for (int i = 0; i < T64 * CH / kThreads; ++i) {              // row r: destination pixel px0 + r, 8 channels a chunk
    const int q = tid + i * kThreads, r = q / CH, cc = q % CH, px = px0 + r;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (px < pitch && ch0 + cc * 8 < cols) {
      const int h = px / m.scols, w = px - h * m.scols;
      if (h % m.srow == 0 && w % m.sw == 0)
        v = ldg_stream16(s + int64_t((h / m.srow) * m.q + w / m.sw) * cols + ch0 + cc * 8);
    }
    uint32_t* o = sm + r * LD + cc * 4;
    o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
  }
  __syncthreads();
  uint16_t* d = dst + int64_t(img) * cols * pitch;
  if constexpr (Vec) {
    store_vec16_tile(sm, d, pitch, cols, px0, ch0);
  } else {
#pragma unroll
    for (int i = 0; i < T64 * T64 / kThreads; ++i) {
      const int e = tid + i * kThreads, r = e % T64, c = e / T64;
      if (px0 + r < pitch && ch0 + c < cols)
        d[int64_t(ch0 + c) * pitch + px0 + r] = uint16_t(sm[r * LD + (c >> 1)] >> ((c & 1) * 16));
    }
  }
}

// 16-bit 64 x 64 tile with 16-byte loads along cols and 16-byte stores along rows; kept as 32-bit words
// with a 33-word row pitch: the load-phase writes are conflict-free, the store-phase gathers at most
// 2-way conflicted.
IGEMM_DEVICE void tile_vec16(uint32_t* sm, const uint16_t* __restrict__ src, uint16_t* __restrict__ dst, int rows,
                             int cols, int img, int r0, int c0, int grp = 0) {
  constexpr int T64 = 64, LD = 33, CH = T64 / 8;   // CH: 16-byte chunks per tile row
  const int tid = threadIdx.x;
  const uint16_t* s = src + int64_t(img) * rows * cols;
  uint16_t* d = dst + int64_t(img) * rows * cols;
#pragma unroll
  for (int i = 0; i < T64 * CH / kThreads; ++i) {
    const int q = tid + i * kThreads, r = q / CH, cc = q % CH;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r0 + r < rows && c0 + cc * 8 < cols) v = ldg_stream16(s + int64_t(r0 + r) * cols + c0 + cc * 8);
    uint32_t* w = sm + r * LD + cc * 4;
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  }
  __syncthreads();
  store_vec16_tile(sm, d, rows, cols, r0, c0, grp);
}

// kWideVec: rows <= 4 source rows of 1024 pixels in, 1024 pixels x pitch channels out, both in 16-byte vectors.
IGEMM_DEVICE void tile_wide_vec16(uint32_t* sm, const uint16_t* __restrict__ src, uint16_t* __restrict__ dst, int rows,
                                  int cols, int pitch, int img, int c0) {
  constexpr int TC = 1024;
  uint16_t* sh = reinterpret_cast<uint16_t*>(sm);          // [4][1024]
  const int tid = threadIdx.x, n = min(TC, cols - c0);    // pixels in this tile (a multiple of 8)
  const uint16_t* s = src + int64_t(img) * rows * cols + c0;
  uint16_t* d = dst + (int64_t(img) * cols + c0) * pitch;
  for (int q = tid; q < rows * (TC / 8); q += kThreads) {
    const int r = q / (TC / 8), j = q % (TC / 8);
    if (j * 8 < n) *reinterpret_cast<uint4*>(sh + r * TC + j * 8) = ldg_stream16(s + int64_t(r) * cols + j * 8);
  }
  __syncthreads();
  const int total = n * pitch;
  for (int q = tid; q * 8 < total; q += kThreads) {
    uint32_t h[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int o = q * 8 + e, px = o / pitch, ch = o - px * pitch;
      h[e] = ch < rows ? sh[ch * TC + px] : 0u;
    }
    stg_stream16(d + q * 8, make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16), h[6] | (h[7] << 16)));
  }
}

// kRowsVec: rows r0..r0+run_rows(cols)-1 (all cols of each) of image img, 16-bit, rows % 8 == 0, pitch == rows.
IGEMM_DEVICE void tile_rows_vec16(uint32_t* sm, const uint16_t* __restrict__ src, uint16_t* __restrict__ dst,
                                  int rows, int cols, int img, int r0) {
  const int TR = run_rows(cols);
  uint16_t* sh = reinterpret_cast<uint16_t*>(sm);           // [n][cols], as in the source
  const int tid = threadIdx.x, n = min(TR, rows - r0);     // rows in this tile (a multiple of 8)
  const uint16_t* s = src + (int64_t(img) * rows + r0) * cols;
  for (int q = tid; q * 8 < n * cols; q += kThreads)
    *reinterpret_cast<uint4*>(sh + q * 8) = ldg_stream16(s + q * 8);
  __syncthreads();
  uint16_t* d = dst + int64_t(img) * cols * rows + r0;
  for (int q = tid; q < cols * (n / 8); q += kThreads) {     // destination row c, rows 8j..8j+7
    const int c = q / (n / 8), j = q - c * (n / 8);
    uint32_t h[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) h[e] = sh[(j * 8 + e) * cols + c];
    stg_stream16(d + int64_t(c) * rows + j * 8,
                 make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16), h[6] | (h[7] << 16)));
  }
}

// kColsVec: columns c0..c0+run_rows(rows)-1 (all rows of each) of image img, 16-bit, cols % 8 == 0, pitch == rows:
// the destination rows c0.. are one contiguous run.
IGEMM_DEVICE void tile_cols_vec16(uint32_t* sm, const uint16_t* __restrict__ src, uint16_t* __restrict__ dst,
                                  int rows, int cols, int img, int c0) {
  const int TC = run_rows(rows), n = min(TC, cols - c0), v = n / 8;     // columns in this tile (a multiple of 8)
  uint16_t* sh = reinterpret_cast<uint16_t*>(sm);           // [rows][n], as in the source
  const uint16_t* s = src + int64_t(img) * rows * cols + c0;
  for (int q = int(threadIdx.x); q < rows * v; q += kThreads) {
    const int r = q / v, j = q - r * v;
    *reinterpret_cast<uint4*>(sh + r * n + j * 8) = ldg_stream16(s + int64_t(r) * cols + j * 8);
  }
  __syncthreads();
  uint16_t* d = dst + (int64_t(img) * cols + c0) * rows;
  for (int q = int(threadIdx.x); q * 8 < n * rows; q += kThreads) {     // destination elements 8q..8q+7 of the run
    uint32_t h[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int o = q * 8 + e, c = o / rows;
      h[e] = sh[(o - c * rows) * n + c];
    }
    stg_stream16(d + q * 8,
                 make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16), h[6] | (h[7] << 16)));
  }
}

// Channel pad: block b writes destination elements [b·4096, (b+1)·4096) of [n][pitch] (n = cols here).
template <class T>
IGEMM_DEVICE void tile_pad(const T* __restrict__ src, T* __restrict__ dst, int rows, int n, int pitch, int b) {
  const int64_t total = int64_t(n) * pitch;
#pragma unroll 4
  for (int i = 0; i < kElems / kThreads; ++i) {
    const int64_t e = int64_t(b) * kElems + i * kThreads + threadIdx.x;
    if (e >= total) break;
    const int64_t px = e / pitch;
    const int c = int(e - px * pitch);
    dst[e] = c < rows ? src[px * rows + c] : T(0);
  }
}

template <int Mode> constexpr int tile_cols() { return Mode == kScalar16 || Mode == kRowsVec ? 16 : Mode == kWide || Mode == kWideVec ? 1024 : 64; }

template <class T, int Mode>
IGEMM_DEVICE void run_tile(uint32_t* sm, const void* src, void* dst, int rows, int cols, int pitch, int tr, int tc,
                           int b, SubMap sub = {}, int grp = 0) {
  if constexpr (Mode == kPad) {
    tile_pad<T>(static_cast<const T*>(src), static_cast<T*>(dst), rows, cols, pitch, b);
    return;
  } else {
    constexpr int TC = tile_cols<Mode>(), TR = Mode == kVec || Mode == kVecFlip || Mode == kSubVec ? 64 : kElems / TC;
    const int ct = b % tc, rest = b / tc;   // once per block
    const int rt = rest % tr, img = rest / tr;
    if constexpr (Mode == kRowsVec) {
      static_assert(sizeof(T) == 2, "16-byte row tiles are for 16-bit elements");
      tile_rows_vec16(sm, static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), rows, cols, img,
                      rt * run_rows(cols));
    } else if constexpr (Mode == kScatter || Mode == kScatterVec) {
      static_assert(sizeof(T) == 2, "scatter tiles are for 16-bit elements");
      tile_scatter16<Mode == kScatterVec>(sm, static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), rows,
                                          cols, pitch, img, rt * 64, ct * 64, sub);
    } else if constexpr (Mode == kColsVec) {
      static_assert(sizeof(T) == 2, "16-byte column tiles are for 16-bit elements");
      tile_cols_vec16(sm, static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), rows, cols, img,
                      ct * run_rows(rows));
    } else if constexpr (Mode == kSubVec) {
      static_assert(sizeof(T) == 2, "16-byte subsampled tiles are for 16-bit elements");
      tile_sub_vec16(sm, static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), rows, cols, img, rt * TR,
                     ct * TC, sub);
    } else if constexpr (Mode == kWideVec) {
      static_assert(sizeof(T) == 2, "16-byte wide tiles are for 16-bit elements");
      tile_wide_vec16(sm, static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), rows, cols, pitch, img,
                      ct * TC);
    } else if constexpr (Mode == kVec || Mode == kVecFlip) {
      static_assert(sizeof(T) == 2, "16-byte tiles are for 16-bit elements");
      tile_vec16(sm, static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), rows, cols, img, rt * TR,
                 ct * TC, Mode == kVecFlip ? grp : 0);
    } else {
      tile_scalar<T, TC, Mode == kSub>(sm, static_cast<const T*>(src), static_cast<T*>(dst), rows, cols, pitch,
                                       img, rt * TR, ct * TC, sub);
    }
  }
}

template <class T, int Mode0, int Mode1, class P>
__device__ void transpose2(const P& p) {
  __shared__ uint32_t sm[kSmemWords];
  const int b = blockIdx.x;
  static_assert(Mode1 != kSub && Mode1 != kSubVec && Mode1 != kWide && Mode1 != kWideVec && Mode1 != kScatter &&
                Mode1 != kScatterVec, "subsampled, scattered and wide tiles are job 0's");
  static_assert(Mode0 != kVecFlip, "flipped tiles are job 1's");
  if (b < p.blocks0)
    run_tile<T, Mode0>(sm, p.src0, const_cast<void*>(p.dst0), p.rows0, p.cols0, p.pitch0, p.tr0, p.tc0, b,
                       SubMap{p.scols0, p.q0, p.srow0, p.sw0});
  else
    run_tile<T, Mode1>(sm, p.src1, const_cast<void*>(p.dst1), p.rows1, p.cols1, p.pitch1, p.tr1, p.tc1,
                       b - p.blocks0, SubMap{}, p.grp1);
}

}  // namespace igemm::xpose
