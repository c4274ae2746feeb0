// FP8 e4m3 quantisation of a weight as the resharding engine writes it into an FP8 engine: one float32
// scale per block of the 2-D weight (128 x 128: vLLM's block-FP8 linear layers; 1 x cols: one per output
// channel), scale = amax(|block|) / 448 (1 for an all-zero block), each element x / scale rounded to the
// nearest e4m3 value (ties to even), saturated at +-448 (the "fn" format has no infinity). The source is
// any 2-D float tensor with any strides; the destination (uint8 bytes of the float8_e4m3fn tensor) and
// the scales may be views into larger tensors (a fused parameter's rows), so the copy lands in place.
// Dequantised, the block holds q * scale: the error is at most half an e4m3 step of the value (2^-4
// relative) above 2^-6 * scale, and 2^-10 * scale below it.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

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

// Checks the tensors (naming each), then quantises on the CPU (up to num_threads threads) or as one
// CUDA launch on `stream`. block_cols = 0 means the whole row (per-channel scales).
void fp8_quantize(const TensorRef& src, const TensorRef& dst, const TensorRef& scale, int64_t block_rows,
                  int64_t block_cols, uintptr_t stream, int num_threads);

void fp8_quantize_cpu(const Fp8Job& job, int num_threads);
#if defined(VF_WITH_CUDA)
void fp8_quantize_cuda(const Fp8Job& job, uintptr_t stream, int device);  // fp8.cu
#endif

}  // namespace vf::reshard
