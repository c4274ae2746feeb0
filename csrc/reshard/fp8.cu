// FP8 quantisation on the GPU (fp8.h): one thread block per scale block. The block's amax is a max
// over its threads (a warp shuffle, then shared memory), then each thread writes the bytes of the
// elements it read; a 128 x 128 bf16 block (32 KiB) is read twice, the second time from L1 / L2.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/check.h"
#include "common/cuda_utils.h"
#include "reshard/fp8.h"

namespace vf::reshard {

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) fp8_quantize_kernel(Fp8Job j, View2 src, int64_t nbc) {
  const int64_t br = blockIdx.x / nbc, bc = blockIdx.x % nbc;
  const int64_t r0 = br * j.block_rows, c0 = bc * j.block_cols;
  const int64_t h = min(j.rows - r0, j.block_rows), w = min(j.cols - c0, j.block_cols);
  const int64_t n = h * w;
  float amax = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const int64_t r = i / w, c = i - r * w;
    amax = fmaxf(amax, fabsf(load_float(src, r0 + r, c0 + c)));
  }
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  __shared__ float warp_max[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
  __syncthreads();
  if (threadIdx.x < 32) {
    amax = threadIdx.x < kThreads / 32 ? warp_max[threadIdx.x] : 0.0f;
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    if (threadIdx.x == 0) warp_max[0] = amax;
  }
  __syncthreads();
  const float scale = fp8_scale(warp_max[0]);
  if (threadIdx.x == 0) j.scale[br * j.scale_rs + bc * j.scale_cs] = scale;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const int64_t r = i / w, c = i - r * w;
    // __fdiv_rn: IEEE division whatever the compile flags, as the CPU path divides
    j.dst[(r0 + r) * j.dst_rs + c0 + c] = float_to_e4m3(__fdiv_rn(load_float(src, r0 + r, c0 + c), scale));
  }
}

}  // namespace

void fp8_quantize_cuda(const Fp8Job& j, uintptr_t stream, int device) {
  DeviceGuard guard(device);
  const int64_t nbr = (j.rows + j.block_rows - 1) / j.block_rows, nbc = (j.cols + j.block_cols - 1) / j.block_cols;
  VF_CHECK(nbr * nbc < (int64_t{1} << 31), "too many FP8 scale blocks (", nbr * nbc, ") for one launch");
  const View2 src{j.src, j.src_rs, j.src_cs, j.src_dtype};
  fp8_quantize_kernel<<<static_cast<unsigned>(nbr * nbc), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      j, src, nbc);
  VF_CUDA_LAUNCH_CHECK("fp8_quantize_kernel");
}

}  // namespace vf::reshard
