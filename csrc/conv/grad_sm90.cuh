// igemm conv2d backward: the native sm_90a kernels for 16-bit NHWC tensors, read where they lie (no operand is
// moved; igemm/conv/_native.py and _native_dgrad.py build the launches): their mainloops, wgrad's work and the sum
// of its split partials (dgrad's work: csrc/conv/dgrad_sm90.cuh; the NCHW 1x1 wgrad's: csrc/conv/wgrad_nchw.cuh).
//
// Both run one of two TMA + wgmma mainloops over their units of work (a tile, or a tile's split): each warpgroup
// multiplies its 64 rows with wgmma.m64nBNk16 straight from shared memory (128-byte swizzled rows), one group in
// flight, and the tile leaves through a shared-memory C tile (csrc/conv/grad_store.cuh): wgrad's by the threads in
// 16-byte vectors, dgrad's by asynchronous copies (a TMA store, or a bulk copy a row) while the threads go on.
// grad_tile: a CTA a unit, thread 0 filling the stages, a CTA barrier a k-tile. grad_ws: persistent and
// warp-specialised (a producer warp, "empty" barriers; the forward's design in persistent_sm90.cuh), the store
// through its own C tile while the next unit loads. A masked twin (Mask: the forward's ReLU bits of dy) takes A
// through the registers instead, masked there (grad_stage_rs), its mask words a TMA copy beside A's in each stage.
//   wgrad  dw[k, (r, s, c)] = sum over output pixels (n, p, q) of dy[n, p, q, k] · x[n, p·sh + r·dh − ph,
//          q·sw + s·dw − pw, c]: GEMM M = K, N = R·S·C (dw's row), reduction = N·P·Q, 64 pixels a k-tile. A = dy as
//          the [N·P·Q][K] matrix (tiled map: 64 pixels × 64 channels from m0), B = x through the forward's im2col
//          map (64 pixels × 64 channels of one tap; zeros outside the image are the padding). Both land channels-
//          contiguous, one row per pixel: MN-major operands. Units: tiles × splits; split z runs k-tiles
//          [z · kt_per_split, ...) and stores its tile into the z-th M × N matrix at p.y (fp32 partials, or dw
//          itself with one split).
//   split_sum  dst (+)= wgrad's partials summed in split order (deterministic), 4 elements a thread.
#pragma once
#include "conv/grad_store.cuh"

namespace igemm::grad {

using namespace igemm::conv;

// both operands from shared memory: A K- or MN-major, B MN-major (or K-major: csrc/conv/wgrad_nchw.cuh)
template <class T, int N, gmma::Major MA, gmma::Major MB = gmma::Major::MN> struct Atom;
#define IGEMM_GRAD_ATOM(T, N, NAME) \
  template <gmma::Major MA, gmma::Major MB> struct Atom<T, N, MA, MB> { using type = gmma::NAME<MA, MB>; };
IGEMM_GRAD_ATOM(cutlass::half_t, 64, MMA_64x64x16_F32F16F16_SS)
IGEMM_GRAD_ATOM(cutlass::half_t, 128, MMA_64x128x16_F32F16F16_SS)
IGEMM_GRAD_ATOM(cutlass::bfloat16_t, 64, MMA_64x64x16_F32BF16BF16_SS)
IGEMM_GRAD_ATOM(cutlass::bfloat16_t, 128, MMA_64x128x16_F32BF16BF16_SS)
#undef IGEMM_GRAD_ATOM
template <class T, int N> struct AtomRS;                      // A from registers (K-major fragments), B MN-major
#define IGEMM_GRAD_ATOM_RS(T, N, NAME) \
  template <> struct AtomRS<T, N> { using type = gmma::NAME<gmma::Major::K, gmma::Major::MN>; };
IGEMM_GRAD_ATOM_RS(cutlass::half_t, 64, MMA_64x64x16_F32F16F16_RS)
IGEMM_GRAD_ATOM_RS(cutlass::half_t, 128, MMA_64x128x16_F32F16F16_RS)
IGEMM_GRAD_ATOM_RS(cutlass::bfloat16_t, 64, MMA_64x64x16_F32BF16BF16_RS)
IGEMM_GRAD_ATOM_RS(cutlass::bfloat16_t, 128, MMA_64x128x16_F32BF16BF16_RS)
#undef IGEMM_GRAD_ATOM_RS

template <class Atom, size_t... I>
IGEMM_DEVICE void gmma_issue_rs(const uint32_t* a, uint64_t db, float* acc, std::index_sequence<I...>) {
  Atom::fma(a[0], a[1], a[2], a[3], db, acc[I]..., gmma::ScaleOut::One);
}

constexpr int BK = 64;                      // a k-tile: 64 elements of the reduction
constexpr int BOX = 64 * 64 * 2;            // one TMA box: 64 rows of 128 bytes

// The stages' mbarriers (full: one arrival and the bytes; empty, with n_empty > 0: n_empty arrivals), initialised
// by thread 0 (and the maps prefetched); the dynamic shared memory 1024-aligned (SW128 atoms).
// ZeroBytes (a 16-byte multiple) at ZeroAt past the aligned start are zeroed and fenced for the async proxy
// before the CTA's barrier (the source of dgrad's zero copies).
template <int Stages, int ZeroBytes = 0, int ZeroAt = 0>
IGEMM_DEVICE uint8_t* grad_setup(uint64_t* full, const void* map_a, const void* map_b, uint64_t* empty = nullptr,
                                int n_empty = 0) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  if constexpr (ZeroBytes > 0) {
    if (threadIdx.x < ZeroBytes / 16) {
      uint8_t* at = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023) + ZeroAt;
      reinterpret_cast<uint4*>(at)[threadIdx.x] = make_uint4(0, 0, 0, 0);
      fence_proxy_async();
    }
  }
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < Stages; ++s) {
      mbar_init(&full[s], 1);
      if (n_empty > 0) mbar_init(&empty[s], n_empty);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    tma_prefetch_maps(map_a, map_b);
  }
  __syncthreads();
  return smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
}

// Work::kZeros: thread tid < BM copies the zeros at `zrow` (BN of them) to the dx pixels beside the unit's row
// m0 + tid that no tap reaches, at the unit's start: the copies run beside its mainloop (dgrad-fill-zeros).
template <class TO, int BM, int BN, class Work, class Unit>
IGEMM_DEVICE void zero_rows(const Work& wk, const Unit& un, const uint8_t* zrow, int tid) {
  if constexpr (Work::kZeros) {
    const int row = un.m0 + tid;
    const int64_t at = tid < BM && row < wk.M(un) ? wk.row_at(un, row) : -1;
    if (at < 0) return;
    const int bytes = min(BN, wk.Ncol() - un.n0) * int(sizeof(TO));
    TO* out = wk.out(un) + un.n0;
    wk.zeros(un, row, at, [&](int64_t z) { bulk_store<false>(out + z, reinterpret_cast<const TO*>(zrow), bytes); });
    bulk_commit();
  }
}

// Work::kSums (dgrad's BatchNorm sums: csrc/conv/dgrad_sm90.cuh; grad_ws only): a unit's sums(unit, u, C tile,
// tid, sync, in) run after its store, on in = sums_load(unit, tid), loaded at the unit's start (in flight during its
// mainloop). Other works have no kSums.
template <class W, class = void> struct HasSums : std::false_type {};
template <class W> struct HasSums<W, std::enable_if_t<W::kSums>> : std::true_type {};

// The CTA's tile: u over ceil(M / BM) × ceil(ncol / BN) tiles, column blocks fastest.
template <int BM, int BN>
IGEMM_DEVICE TileCoord grad_tile_coord(int u, int ncol) {
  const int tn = (ncol + BN - 1) / BN;
  return {int(u / tn) * BM, int(u % tn) * BN};
}

// One wgmma group over a stage: A K-major (AMajorK) or MN-major, B MN-major (or, with BMajorK, both K-major); a k16
// step is +32 bytes in a K-major SW128 row, 16 rows (2048 bytes) of an MN-major tile.
template <class T, int BN, bool AMajorK, bool BMajorK = false>
IGEMM_DEVICE void grad_stage(uint32_t sa, uint32_t sb, float* acc) {
  using Mma = typename Atom<T, BN, AMajorK ? gmma::Major::K : gmma::Major::MN,
                            BMajorK ? gmma::Major::K : gmma::Major::MN>::type;
  constexpr int NACC = BN / 2, ASTEP = AMajorK ? 2 : 128, BSTEP = BMajorK ? 2 : 128;
  const uint64_t da = AMajorK ? desc_sw128(sa) : desc_mn_sw128(sa);
  const uint64_t db = BMajorK ? desc_sw128(sb) : desc_mn_sw128(sb);
#pragma unroll
  for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
  cute::warpgroup_arrive();
#pragma unroll
  for (int ks = 0; ks < BK / 16; ++ks)
    gmma_issue<Mma>(da + ASTEP * ks, db + BSTEP * ks, acc, std::make_index_sequence<NACC>{});
  cute::warpgroup_commit_batch();
}

// The fused mask (docs/performance.md: grad-mask-registers): A passes through the registers on its way to the
// tensor cores, masked there -- ldmatrix of the stage's A rows (K-major dgrad; MN-major wgrad: .trans), the
// fragment's pairs ANDed with their bits spread to 16-bit lanes, wgmma with A from registers (RS) -- so dy is read
// as bit ? dy : 0 (the select's bits: a zero is +0) with no dz and no shared-memory rewrite. The mask's words come
// with the stage (a TMA copy beside A's: 16 bytes a row of A, Work::kMaskBytes), and k-tile i's fragments are
// loaded and masked while k-tile i − 1's group multiplies (registers a[i % 2]).
IGEMM_DEVICE void ldsm_x4(uint32_t addr, uint32_t* r, std::false_type) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
IGEMM_DEVICE void ldsm_x4(uint32_t addr, uint32_t* r, std::true_type) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
// 16-bit lanes from two sign bits: lane 0 all-ones where byte `sa` of {b:a} has its top bit set, lane 1 by `sb`
IGEMM_DEVICE uint32_t lanes_of(uint32_t a, uint32_t b, uint32_t sa, uint32_t sb) {
  const uint32_t sel = (8u | sa) * 0x11u | ((8u | sb) * 0x11u) << 8;   // (sign-replicating selectors)
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// One stage with A through the registers, masked by mk from the stage's mask rows at sM: k-tile i's fragments
// (registers a[Par], Par = i % 2) loaded from the stage and masked while k-tile i − 1's group multiplies, then its
// four wgmmas (A from registers) one group. A's rows at sA as grad_stage's. Fragment of k16 step ks (warp w of the
// warpgroup, lane = 4·g + t): a[4ks] row g, k 2t..2t+1; a[4ks + 1] row g + 8; a[4ks + 2], a[4ks + 3] k + 8.
template <class T, int BN, bool MN, int Par, class Mk>
IGEMM_DEVICE void grad_stage_rs(uint32_t sA, uint32_t sB, uint32_t sM, float* acc, Mk& mk) {
  using Mma = typename AtomRS<T, BN>::type;
  constexpr int NACC = BN / 2;
  const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, mi = lane >> 3, x = lane & 7;
  const uint64_t db = desc_mn_sw128(sB);
  // lane's 16-byte row of matrix mi (SW128: chunk c of row r at c ^ (r % 8), and r % 8 == x): K-major, tile row
  // w·16 + (mi % 2)·8 + x, chunk 2·ks + mi / 2; MN-major (.trans), pixel 16·ks + (mi / 2)·8 + x, chunk 2w + mi % 2
  const uint32_t row = MN ? sA + ((mi >> 1) * 8 + x) * 128 : sA + (w * 16 + (mi & 1) * 8 + x) * 128;
  const int c0 = MN ? 2 * w + (mi & 1) : (mi >> 1);
  uint32_t* a = mk.a[Par];
  mk.template words<Par>(sM);
#pragma unroll
  for (int ks = 0; ks < BK / 16; ++ks) {
    ldsm_x4(MN ? row + ks * 2048 + ((c0 ^ x) << 4) : row + (((2 * ks + c0) ^ x) << 4), a + 4 * ks,
            std::integral_constant<bool, MN>{});
    mk.apply(ks, a + 4 * ks);
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) cute::warpgroup_fence_operand(a[i]);
#pragma unroll
  for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
  cute::warpgroup_arrive();
#pragma unroll
  for (int ks = 0; ks < BK / 16; ++ks)
    gmma_issue_rs<Mma>(a + 4 * ks, db + 128 * ks, acc, std::make_index_sequence<NACC>{});
  cute::warpgroup_commit_batch();
}

// No mask: the stages straight from shared memory.
struct NoMask {};

// The registers a wgmma group read stay live until it has finished (the compiler does not know it reads them
// after its issue): a fence on them after each wait.
template <int Par, class Mk>
IGEMM_DEVICE void grad_keep(Mk& mk) {
#pragma unroll
  for (int i = 0; i < 16; ++i) cute::warpgroup_fence_operand(mk.a[Par][i]);
}

// One k-tile of a unit: its wgmma group, the one before it finished on return (the previous k-tile's stage free).
template <class T, int BN, bool AMajorK, class Work, class Mk>
IGEMM_DEVICE void grad_step(Mk& mk, int it, uint32_t sa, uint32_t sb, uint32_t sm, float* acc) {
  if constexpr (Work::kMask) {
    if (it & 1) {
      grad_stage_rs<T, BN, !AMajorK, 1>(sa, sb, sm, acc, mk);
      cute::warpgroup_wait<1>();
      grad_keep<0>(mk);
    } else {
      grad_stage_rs<T, BN, !AMajorK, 0>(sa, sb, sm, acc, mk);
      cute::warpgroup_wait<1>();
      grad_keep<1>(mk);
    }
  } else {
    grad_stage<T, BN, AMajorK, Work::kBMajorK>(sa, sb, acc);
    cute::warpgroup_wait<1>();
  }
}

// After a unit's last wait: every group has finished.
template <class Work, class Mk>
IGEMM_DEVICE void grad_done(Mk& mk) {
  if constexpr (Work::kMask) {
    grad_keep<0>(mk);
    grad_keep<1>(mk);
  }
}

// A kernel's work (WgradWork; DgradWork and WgradNchwWork in their headers): units() units of work, each
// one BM × BN tile over some k-tiles; unit(u) its coordinates (m0, n0, nkt and what issue needs); issue(unit, i,
// stage, bar) (one thread) fills a stage with its k-tile i (A at the stage's start, B after BM rows) and sets the
// mbarrier's bytes; out(unit), row_at(unit, row), M(unit), Ncol say where the tile goes; kBMajorK: B K-major.
//
// The per-tile kernel (grad_tile): unit blockIdx.x. Thread 0 fills each of the Stages stages; iteration i waits for
// stage i's bytes -> its wgmma group -> waits until only that group is in flight -> barrier (stage i-1 is free in
// every warpgroup) -> thread 0 refills it with k-tile i + Stages - 1. The tile leaves through the stages.
template <class T, class TO, int BM, int BN, int Stages, bool AMajorK, class Work>
IGEMM_DEVICE void grad_tile(const Work& wk, const void* map_a, const void* map_b) {
  static_assert(BM % 64 == 0 && (BN == 64 || BN == 128) && Stages >= 2, "64-row warpgroups, 64- or 128-wide tiles");
  static_assert(!HasSums<Work>::value, "the sums run in grad_ws");
  constexpr int A_STAGE = BM * BK * 2, AB = A_STAGE + BN * BK * 2, STAGE = AB + Work::kMaskBytes, NACC = BN / 2;
  static_assert(kCTileBytes<TO, BM, BN> <= Stages * STAGE, "the output tile fits the stages");
  __shared__ alignas(8) uint64_t full[Stages];
  constexpr int ZB = Work::kZeros ? BN * int(sizeof(TO)) : 0;     // (the zeros past the stages the C tile takes)
  uint8_t* smem = grad_setup<Stages, ZB, Stages * STAGE>(full, map_a, map_b);
  const auto un = wk.unit(blockIdx.x);
  zero_rows<TO, BM, BN>(wk, un, smem + Stages * STAGE, threadIdx.x);
  const int nkt = un.nkt;
  const bool leader = threadIdx.x == 0;
  if (leader) {
#pragma unroll
    for (int st = 0; st < Stages - 1; ++st)
      if (st < nkt) wk.issue(un, st, smem + st * STAGE, &full[st]);
  }
  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
  const uint32_t sA = smem_u32(smem) + (threadIdx.x / 128) * BOX, sB = smem_u32(smem) + A_STAGE;
  auto mk = wk.masker(un, threadIdx.x);
  for (int it = 0; it < nkt; ++it) {
    const int buf = it % Stages;
    mbar_wait(&full[buf], (it / Stages) & 1);
    grad_step<T, BN, AMajorK, Work>(mk, it, sA + buf * STAGE, sB + buf * STAGE, smem_u32(smem) + buf * STAGE + AB,
                                    acc);
#pragma unroll
    for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
    __syncthreads();
    const int nk = it + Stages - 1;
    if (leader && nk < nkt) wk.issue(un, nk, smem + (nk % Stages) * STAGE, &full[nk % Stages]);
  }
  cute::warpgroup_wait<0>();
  grad_done<Work>(mk);
#pragma unroll
  for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
  // (a uniform branch: the accumulators' first reads outside the last wait's basic block, else ptxas serialises
  // the mainloop's wgmmas, warning C7514)
  if (un.m0 >= wk.M(un)) return;
  __syncthreads();                          // (every warpgroup is done with the stages: the C tile takes them)
  if constexpr (Work::kStore == kStoreTensor) {
    store_tile_tma<TO, BM, BN, Work::kAdd>(acc, smem, threadIdx.x, wk.store_map(), un.m0, un.n0, CtaSync{});
    bulk_wait_read();                       // (the shared memory outlives the copies' reads)
  } else if constexpr (Work::kStore == kStoreRows) {
    store_tile_rows<TO, BM, BN, Work::kAdd>(acc, reinterpret_cast<TO*>(smem), threadIdx.x, wk.out(un),
                                            [&](int row) { return wk.row_at(un, row); }, un.m0, un.n0, wk.M(un),
                                            wk.Ncol(), CtaSync{});
    bulk_wait_read();
  } else {
    store_tile<TO, BM, BN, BM * 2>(acc, reinterpret_cast<TO*>(smem), threadIdx.x, wk.out(un),
                                   [&](int row) { return wk.row_at(un, row); }, un.m0, un.n0, wk.M(un), wk.Ncol(),
                                   CtaSync{});
  }
}

struct ConsumerSync {                       // the consumer warpgroups of grad_ws (named barrier 1)
  int n;
  IGEMM_DEVICE void operator()() const { asm volatile("bar.sync 1, %0;\n" ::"r"(n) : "memory"); }
};

// The persistent warp-specialised kernel (grad_ws): the grid loops over the units (u = blockIdx.x + i · gridDim.x).
// A producer warp (its thread 0, after the BM / 64 consumer warpgroups) fills the ring of Stages stages, waiting
// on each stage's "empty" barrier (every consumer thread arrives once the wgmma group that read it has finished);
// the consumers wait on the "full" barriers (transaction bytes) and never on each other in the mainloop. The tile
// leaves through its own C tile after the ring, so the producer runs on into the next unit's k-tiles during a
// store.
template <class T, class TO, int BM, int BN, int Stages, bool AMajorK, class Work>
IGEMM_DEVICE void grad_ws(const Work& wk, const void* map_a, const void* map_b) {
  static_assert(BM % 64 == 0 && (BN == 64 || BN == 128) && Stages >= 2, "64-row warpgroups, 64- or 128-wide tiles");
  constexpr int A_STAGE = BM * BK * 2, AB = A_STAGE + BN * BK * 2, STAGE = AB + Work::kMaskBytes, NACC = BN / 2;
  constexpr int NT = BM * 2;
  __shared__ alignas(8) uint64_t full[Stages], empty[Stages];
  constexpr int ZB = Work::kZeros ? BN * int(sizeof(TO)) : 0, ZAT = Stages * STAGE + kCTileBytes<TO, BM, BN>;
  uint8_t* smem = grad_setup<Stages, ZB, ZAT>(full, map_a, map_b, empty, NT);   // (zeros past the C tile)
  const int units = wk.units();
  // (broadcast from lane 0: ptxas then knows the role, and so the consumers' loop, is warp-uniform)
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0);
  if (wg == BM / 64) {                      // the producer warp
    if ((threadIdx.x & 31) != 0) return;
    int k = 0;                              // stages filled so far
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
      const auto un = wk.unit(u);
      for (int i = 0; i < un.nkt; ++i, ++k) {
        const int slot = k % Stages;
        mbar_wait(&empty[slot], ((k / Stages) & 1) ^ 1);   // a fresh barrier counts as emptied once
        wk.issue(un, i, smem + slot * STAGE, &full[slot]);
      }
    }
    return;
  }
  TO* cs = reinterpret_cast<TO*>(smem + Stages * STAGE);
  const uint32_t sA = smem_u32(smem) + wg * BOX, sB = smem_u32(smem) + A_STAGE;
  int k = 0;                                // stages consumed so far
  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    const auto un = wk.unit(u);
    zero_rows<TO, BM, BN>(wk, un, smem + ZAT, threadIdx.x);
    const auto sums_in = [&] {
      if constexpr (HasSums<Work>::value) return wk.sums_load(un, int(threadIdx.x));
      else return 0;
    }();
    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
    int prev = -1;
    auto mk = wk.masker(un, threadIdx.x);
    for (int it = 0; it < un.nkt; ++it, ++k) {
      const int slot = k % Stages;
      mbar_wait(&full[slot], (k / Stages) & 1);
      grad_step<T, BN, AMajorK, Work>(mk, it, sA + slot * STAGE, sB + slot * STAGE,
                                      smem_u32(smem) + slot * STAGE + AB, acc);
#pragma unroll
      for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
      if (prev >= 0) mbar_arrive(&empty[prev]);   // the group that read it has finished
      prev = slot;
    }
    cute::warpgroup_wait<0>();
    grad_done<Work>(mk);
#pragma unroll
    for (int i = 0; i < NACC; ++i) cute::warpgroup_fence_operand(acc[i]);
    if (prev >= 0) mbar_arrive(&empty[prev]);
    if (un.m0 >= wk.M(un)) continue;        // (uniform)
    const ConsumerSync sync{NT};
    if constexpr (Work::kStore != kStoreThreads) {
      bulk_wait_read();                     // the previous unit's copies have read the C tile
      sync();
      if constexpr (Work::kStore == kStoreTensor)
        store_tile_tma<TO, BM, BN, Work::kAdd>(acc, reinterpret_cast<uint8_t*>(cs), threadIdx.x, wk.store_map(),
                                               un.m0, un.n0, sync);
      else
        store_tile_rows<TO, BM, BN, Work::kAdd>(acc, cs, threadIdx.x, wk.out(un),
                                                [&](int row) { return wk.row_at(un, row); }, un.m0, un.n0, wk.M(un),
                                                wk.Ncol(), sync);
      if constexpr (HasSums<Work>::value)
        wk.sums(un, u, reinterpret_cast<const uint8_t*>(cs), threadIdx.x, sync, sums_in);
    } else {
      store_tile<TO, BM, BN, NT>(acc, cs, threadIdx.x, wk.out(un), [&](int row) { return wk.row_at(un, row); },
                                 un.m0, un.n0, wk.M(un), wk.Ncol(), sync);
      sync();                               // the C tile is free for the next unit
    }
  }
  if constexpr (Work::kStore != kStoreThreads) bulk_wait();
}

// The kernel of a work: persistent (grad_ws) or per tile (grad_tile).
template <class T, class TO, int BM, int BN, int Stages, bool Ws, bool AMajorK, class Work>
IGEMM_DEVICE void grad_run(const Work& wk, const void* map_a, const void* map_b) {
  if constexpr (Ws) grad_ws<T, TO, BM, BN, Stages, AMajorK>(wk, map_a, map_b);
  else grad_tile<T, TO, BM, BN, Stages, AMajorK>(wk, map_a, map_b);
}

// wgrad's units (WgradWork; WgradNchwWork, csrc/conv/wgrad_nchw.cuh): tile t of split z (u = z · tiles + t) of the
// p.M × p.Ncol dw; split z runs k-tiles [z · kt_per_split, ...) of the reduction's kt and stores its tile into the
// z-th M × Ncol matrix at p.y (fp32 partials, or dw itself with one split).
template <int BM, int BN, class P>
IGEMM_DEVICE int wgrad_tiles(const P& p) {
  return ((p.M + BM - 1) / BM) * ((p.Ncol + BN - 1) / BN);
}
template <int BM, int BN, class P, class Unit, class Kt>
IGEMM_DEVICE void wgrad_split(const P& p, int u, const Kt& kt, Unit& un) {   // (kt(): the reduction's k-tiles)
  const int nt = wgrad_tiles<BM, BN>(p);
  un.z = u / nt;
  const TileCoord tc = grad_tile_coord<BM, BN>(u - un.z * nt, p.Ncol);
  un.m0 = tc.m0;
  un.n0 = tc.n0;
  un.kt0 = un.z * p.kt_per_split;
  un.nkt = min(kt(), un.kt0 + p.kt_per_split) - un.kt0;
}
template <class TO, class P>
IGEMM_DEVICE TO* wgrad_out(const P& p, int z) {
  return static_cast<TO*>(const_cast<void*>(p.y)) + int64_t(z) * p.M * p.Ncol;
}

template <class TO, int BM, int BN, bool Mask, class P>
struct WgradWork {
  static constexpr int NB = BN / 64;
  static constexpr int kStore = kStoreThreads;
  static constexpr bool kAdd = false, kMask = Mask, kZeros = false, kBMajorK = false;
  static constexpr int kMaskBytes = Mask ? BK * 16 : 0;     // (a stage's mask rows: 16 bytes a pixel)
  const P& p;
  struct Unit {
    int m0, n0, nkt, kt0, z;
    int bc[NB];                             // each 64-column block's tap: channel c0, im2col offsets (s·dw, r·dh)
    uint16_t bw[NB], bh[NB];
  };
  IGEMM_DEVICE int units() const { return wgrad_tiles<BM, BN>(p) * p.splits; }
  IGEMM_DEVICE int M(const Unit&) const { return p.M; }
  IGEMM_DEVICE int Ncol() const { return p.Ncol; }
  IGEMM_DEVICE Unit unit(int u) const {
    Unit un;
    wgrad_split<BM, BN>(p, u, [&] { return (p.NPQ + BK - 1) / BK; }, un);
    // a block past R·S·C loads the last one again (its columns are never stored)
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      int rs, r, s;
      p.fd_C.divmod(rs, un.bc[j], min(un.n0 + 64 * j, p.Ncol - 64));
      p.fd_S.divmod(r, s, rs);
      un.bw[j] = uint16_t(s * p.dw);
      un.bh[j] = uint16_t(r * p.dh);
    }
    return un;
  }
  // k-tile i = output pixels (kt0 + i)·64 ..: dy's rows (A) and x's im2col tiles of each column block's tap (B)
  IGEMM_DEVICE void issue(const Unit& un, int i, uint8_t* a, uint64_t* bar) const {
    const int pix = (un.kt0 + i) * BK;
    const TileOrigin o = tile_origin(p, pix);
    mbar_expect_tx(bar, (BM + BN) * BK * 2 + kMaskBytes);
    if constexpr (kMask)                    // (a box's first word 16-byte aligned: TMA's rule)
      tma_load_2d(a + (BM + BN) * BK * 2, p.tmM, bar, (un.m0 >> 7) * 4, pix);
#pragma unroll
    for (int k = 0; k < BM / 64; ++k) tma_load_2d(a + k * BOX, p.tmA, bar, un.m0 + 64 * k, pix);
#pragma unroll
    for (int j = 0; j < NB; ++j)
      tma_load_im2col_4d(a + BM * BK * 2 + j * BOX, p.tmB, bar, un.bc[j], o.w0, o.h0, o.n, un.bw[j], un.bh[j]);
  }
  IGEMM_DEVICE TO* out(const Unit& un) const { return wgrad_out<TO>(p, un.z); }
  // Mask: the stage's 64 pixels' words of the 128 channels from m0 rounded down to 128 (a 16-byte row a pixel:
  // p.tmM maps the mask as [N·P·Q][K / 32] words). The thread's fragment rows are channels ch and ch + 8 (one
  // word: K % 32 == 0), its k columns 16 pixels a k-tile (2t + {0, 1} + {0, 8} + 16·ks).
  struct Masker {
    int word, sh0, sh1;                     // the word's byte in a row; ch's and ch + 8's bit moved to bit 31
    uint32_t base;
    uint32_t a[2][16];
    template <int Par>
    IGEMM_DEVICE void words(uint32_t sm) { base = sm + word + 32 * (threadIdx.x & 3); }
    IGEMM_DEVICE void apply(int ks, uint32_t* a) const {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t at = base + (16 * ks + 8 * h) * 16;
        uint32_t w0, w1;
        asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(w0) : "r"(at));
        asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(w1) : "r"(at + 16));
        a[2 * h] &= lanes_of(w0 << sh0, w1 << sh0, 3, 7);      // channel ch's bits
        a[2 * h + 1] &= lanes_of(w0 << sh1, w1 << sh1, 3, 7);  // channel ch + 8's
      }
    }
  };
  IGEMM_DEVICE auto masker(const Unit& un, int tid) const {
    if constexpr (kMask) {
      Masker mk;
      const int w = (tid >> 5) & 3, b = (w & 1) * 16 + ((tid & 31) >> 2);
      mk.word = 4 * (((un.m0 >> 5) & 3) + (tid / 128) * 2 + (w >> 1));
      mk.sh0 = 31 - b;
      mk.sh1 = 23 - b;
      return mk;
    } else {
      return NoMask{};
    }
  }
  IGEMM_DEVICE int64_t row_at(const Unit&, int row) const { return int64_t(row) * p.Ncol; }
};

template <class T, class TO, int BM, int BN, int Stages, bool Ws, bool Mask, class P>
__device__ void wgrad(const P& p) {
  grad_run<T, TO, BM, BN, Stages, Ws, false>(WgradWork<TO, BM, BN, Mask, P>{p}, p.tmA, p.tmB);
}

// dst[i] (+)= sum over z of src[z·n + i], z = 0, 1, ... in order; n % 4 == 0, src 16-byte aligned, grid-stride.
// Sixteen splits' loads in flight a thread, then their adds in order (docs/performance.md: split-sum-eight).
template <bool Accum, class TD, class P>
__device__ void split_sum(const P& p) {
  const float4* src = static_cast<const float4*>(p.src);
  TD* dst = static_cast<TD*>(const_cast<void*>(p.dst));
  const int64_t n4 = p.n / 4;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    float4 s = __ldcs(src + i);
    for (int z0 = 1; z0 < p.splits; z0 += 16) {
      float4 t[16];
#pragma unroll
      for (int j = 0; j < 16; ++j)
        if (z0 + j < p.splits) t[j] = __ldcs(src + (z0 + j) * n4 + i);
#pragma unroll
      for (int j = 0; j < 16; ++j)
        if (z0 + j < p.splits) {
          s.x += t[j].x; s.y += t[j].y; s.z += t[j].z; s.w += t[j].w;
        }
    }
    float v[4] = {s.x, s.y, s.z, s.w};
    TD* d = dst + 4 * i;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (Accum) v[e] += to_float(d[e]);
      d[e] = from_float<TD>(v[e]);
    }
  }
}

}  // namespace igemm::grad
