// Probe: how a tiled TMA copy lays out a 4-D box whose inner dimension is narrower than the 128-byte
// swizzle span ({TW, TH, 64 channels, 1} of an NCHW tensor, TW * 2 bytes < 128), with negative (zero-fill)
// coordinates and traversal strides. Hypothesis: the box is written densely ([c][h][w]) and the SW128
// pattern is applied to the shared-memory address (16-byte chunk ^= (offset / 128) % 8) -- then a box of
// TH x TW = 64 pixels is exactly the [64 ch][64 px] MN-major tile the kLoadTmaMN path multiplies.
//   nvcc -std=c++17 -arch=sm_90a -o tma_box_probe tma_box_probe.cu -lcuda
// Status (session 11, H100): the first launch died with "an illegal instruction"; not diagnosed (the probe
// itself may be at fault), so the hypothesis is untested.
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <vector>

__global__ void probe(const __grid_constant__ CUtensorMap tm, int w0, int h0, uint16_t* out, int n) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw;
  uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  smem += (1024 - (a & 1023)) & 1023;
  a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  __shared__ alignas(8) uint64_t bar;
  const uint32_t b = static_cast<uint32_t>(__cvta_generic_to_shared(&bar));
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(n * 2) : "memory");
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
        ::"r"(a), "l"(&tm), "r"(w0), "r"(h0), "r"(0), "r"(0), "r"(b) : "memory");
  }
  asm volatile(
      "{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n@!p bra WAIT;\n}\n" ::"r"(b) : "memory");
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = reinterpret_cast<uint16_t*>(smem)[i];
}

static int run(int W, int H, int TW, int TH, int es, int w0, int h0) {
  const int C = 64;
  std::vector<uint16_t> x(size_t(C) * H * W);
  for (int c = 0; c < C; ++c)
    for (int h = 0; h < H; ++h)
      for (int w = 0; w < W; ++w) x[(size_t(c) * H + h) * W + w] = uint16_t(1 + c * 1024 + h * 32 + w);
  uint16_t *dx, *dout;
  const int TWl = TW, THl = TH;                      // elements loaded per row / rows (after the stride)
  const int n = C * THl * TWl;
  cudaMalloc(&dx, x.size() * 2);
  cudaMalloc(&dout, n * 2);
  cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice);
  CUtensorMap tm;
  cuuint64_t dims[4] = {cuuint64_t(W), cuuint64_t(H), cuuint64_t(C), 1};
  cuuint64_t strides[3] = {cuuint64_t(W) * 2, cuuint64_t(H) * W * 2, cuuint64_t(C) * H * W * 2};
  cuuint32_t box[4] = {cuuint32_t(TW * es), cuuint32_t(TH * es), cuuint32_t(C), 1};
  cuuint32_t est[4] = {cuuint32_t(es), cuuint32_t(es), 1, 1};
  CUresult r = cuTensorMapEncodeTiled(&tm, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, dx, dims, strides, box, est,
                                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                      CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    const char* s;
    cuGetErrorString(r, &s);
    printf("W=%d H=%d box %dx%d stride %d: encode failed: %s\n", W, H, TW, TH, es, s);
    return 1;
  }
  cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, n * 2 + 1024);
  probe<<<1, 128, n * 2 + 1024>>>(tm, w0, h0, dout, n);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    printf("W=%d H=%d box %dx%d stride %d: launch failed: %s\n", W, H, TW, TH, es, cudaGetErrorString(e));
    return 1;
  }
  std::vector<uint16_t> got(n);
  cudaMemcpy(got.data(), dout, n * 2, cudaMemcpyDeviceToHost);
  int bad_addr = 0, bad_dense = 0;
  for (int c = 0; c < C; ++c)
    for (int i = 0; i < THl; ++i)
      for (int j = 0; j < TWl; ++j) {
        const int h = h0 + i * es, w = w0 + j * es;
        const uint16_t want = (h >= 0 && h < H && w >= 0 && w < W) ? x[(size_t(c) * H + h) * W + w] : 0;
        const int o = ((c * THl + i) * TWl + j) * 2;                 // dense byte offset
        const int sw = (o & ~0x70) | ((((o >> 4) & 7) ^ ((o >> 7) & 7)) << 4);   // address-based SW128
        bad_addr += got[sw / 2] != want;
        bad_dense += got[o / 2] != want;
      }
  printf("W=%d H=%d box %dx%d (traversal stride %d) at (w %d, h %d): mismatches vs address-swizzled dense box %d, "
         "vs unswizzled dense box %d (of %d)\n", W, H, TW, TH, es, w0, h0, bad_addr, bad_dense, n);
  if (bad_addr) {
    printf("  first 64 smem elements:");
    for (int i = 0; i < 64; ++i) printf(" %d", got[i]);
    printf("\n");
  }
  cudaFree(dx);
  cudaFree(dout);
  return bad_addr != 0;
}

int main() {
  int bad = 0;
  bad += run(16, 16, 8, 8, 1, -1, -1);      // 3x3-conv-like tile with a halo at the image corner
  bad += run(56, 56, 8, 8, 1, 49, 3);
  bad += run(28, 28, 16, 4, 1, -1, 25);     // partly past the bottom edge
  bad += run(28, 28, 32, 2, 1, 0, 0);
  bad += run(7, 7, 8, 8, 1, -1, -1);
  bad += run(28, 28, 8, 8, 2, 0, 0);        // 1x1 stride 2: every other pixel of every other row
  bad += run(28, 28, 16, 4, 2, 0, 16);
  printf(bad ? "PROBE: address-swizzle hypothesis FAILED\n" : "PROBE: address-swizzle hypothesis holds\n");
  return bad != 0;
}
