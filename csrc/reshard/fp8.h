// FP8 e4m3 quantisation of a weight as the resharding engine writes it into an FP8 engine: one float32
// scale per block of the 2-D weight (128 x 128: vLLM's block-FP8 linear layers; 1 x cols: one per output
// channel), scale = amax(|block|) / 448 (1 for an all-zero block), each element x / scale rounded to the
// nearest e4m3 value (ties to even), saturated at +-448 (the "fn" format has no infinity). The source is
// any 2-D float tensor with any strides; the destination (uint8 bytes of the float8_e4m3fn tensor) and
// the scales may be views into larger tensors (a fused parameter's rows), so the copy lands in place.
// One pass: each block is read once (its amax, then its bytes from what was read), and a list of
// tensors is quantised in one go (fp8_quantize_jobs: one CUDA launch per kFp8BatchJobs tensors).
// Dequantised, the block holds q * scale: the error is at most half an e4m3 step of the value (2^-4
// relative) above 2^-6 * scale, and 2^-10 * scale below it.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/tensor.h"

#if defined(__CUDACC__)
#define VF_HD __host__ __device__ __forceinline__
#else
#define VF_HD inline
#endif

namespace vf::reshard {

constexpr float kFp8Max = 448.0f;  // the largest finite e4m3fn value

// One quantisation: src [rows, cols] (element strides src_rs, src_cs) -> dst bytes (row stride dst_rs,
// columns contiguous) and scale [ceil(rows / block_rows), ceil(cols / block_cols)] (strides scale_rs,
// scale_cs). Partial blocks at the edges take the scale of what they hold.
struct Fp8Job {
  const void* src;
  int32_t src_dtype;  // vf::DType
  int64_t src_rs, src_cs;
  int64_t rows, cols;
  uint8_t* dst;
  int64_t dst_rs;
  float* scale;
  int64_t scale_rs, scale_cs;
  int64_t block_rows, block_cols;
};

VF_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

// The e4m3fn byte nearest to v (ties to even), saturated to +-448; NaN -> 0x7f (with v's sign).
VF_HD uint8_t float_to_e4m3(float v) {
  const uint32_t u = float_bits(v);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7fu;
  if (a >= 0x43e00000u) return sign | 0x7eu;  // >= 448 (inf included): saturate
  if (a < 0x3c800000u) {  // below 2^-6, e4m3's subnormals: multiples of 2^-9 (8 of them: 2^-6 itself)
    const float m = fabsf(v) * 512.0f;  // exact: a power of two
    return sign | static_cast<uint8_t>(rintf(m));  // the current rounding mode: to nearest, ties to even
  }
  // normal: keep 3 of float's 23 mantissa bits, rounding at bit 20 to nearest even (a carry moves the
  // exponent up, as it should); e4m3's exponent bias is 7 against float's 127
  const uint32_t r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  const uint32_t q = r - (120u << 3);
  return sign | static_cast<uint8_t>(q > 0x7eu ? 0x7eu : q);
}

VF_HD float fp8_scale(float amax) { return amax > 0.0f ? amax / kFp8Max : 1.0f; }

// x / scale as IEEE division rounds it, from inv = 1 / scale (correctly rounded, once per block) instead of
// a division per element: q = x * inv, then one correction with the exact remainder r = x - q * scale (an
// FMA), q + r * inv (Markstein's step); copysign keeps the sign of a zero quotient (-0 / scale is -0, the
// correction would give +0). Used where fp8_reciprocal_ok(scale) and the source is 16-bit (bfloat16,
// float16): for every (x, amax) pair of those types it gives the bytes of float_to_e4m3(x / scale), which
// python_tests/ops/test_fp8_division.py checks by running this header over all of them.
VF_HD bool fp8_reciprocal_ok(float scale) { return scale >= 0x1p-60f && scale <= 0x1p60f; }

VF_HD float fp8_divide(float x, float scale, float inv) {
#if defined(__CUDA_ARCH__)
  const float q = __fmul_rn(x, inv);  // never contracted into an FMA
  return copysignf(__fmaf_rn(__fmaf_rn(-q, scale, x), inv, q), x);
#else
  const float q = x * inv;
  return std::copysign(std::fma(std::fma(-q, scale, x), inv, q), x);
#endif
}

// The tensors of one quantisation checked (each named, `what` first: "srcs[3]" for the fourth of a list)
// and described as a job. block_cols = 0 means the whole row (per-channel scales).
Fp8Job fp8_job(const TensorRef& src, const TensorRef& dst, const TensorRef& scale, int64_t block_rows,
               int64_t block_cols, const std::string& what);

// Quantises jobs[i] for every i (their destinations disjoint): on the CPU, every block of every job over
// up to num_threads threads; on CUDA, in as few launches on `stream` as kFp8BatchJobs and the jobs'
// source dtypes allow (consecutive jobs of one dtype share a launch), with no host synchronisation.
void fp8_quantize_jobs(const std::vector<Fp8Job>& jobs, Device device, int device_index, uintptr_t stream,
                       int num_threads);

// One quantisation: fp8_job, then fp8_quantize_jobs.
void fp8_quantize(const TensorRef& src, const TensorRef& dst, const TensorRef& scale, int64_t block_rows,
                  int64_t block_cols, uintptr_t stream, int num_threads);

// How many scale blocks a job has.
int64_t fp8_blocks(const Fp8Job& job);

void fp8_quantize_cpu(const std::vector<Fp8Job>& jobs, int num_threads);
// The jobs a CUDA launch carries as its kernel parameter (within the 4 KiB every driver accepts): each
// thread block finds its job by binary search over first_block.
constexpr int kFp8BatchJobs = 32;
#if defined(VF_WITH_CUDA)
struct Fp8Batch {
  Fp8Job jobs[kFp8BatchJobs];
  int64_t first_block[kFp8BatchJobs + 1];
  int32_t count;
};
static_assert(sizeof(Fp8Batch) <= 4096, "an Fp8Batch must fit a kernel's 4 KiB of parameters");
void fp8_quantize_cuda(const std::vector<Fp8Job>& jobs, uintptr_t stream, int device);  // fp8.cu
#endif

}  // namespace vf::reshard
