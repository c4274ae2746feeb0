// FP8 quantisation (fp8.h): the checks every call passes, and the CPU executor (blocks over threads).
#include "reshard/fp8.h"

#include <algorithm>

#include "common/check.h"
#include "common/dispatch.h"
#include "common/parallel.h"

namespace vf::reshard {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename T>
void quantize_block(const Fp8Job& j, int64_t br, int64_t bc) {
  const T* src = static_cast<const T*>(j.src);
  const int64_t r0 = br * j.block_rows, r1 = std::min(j.rows, r0 + j.block_rows);
  const int64_t c0 = bc * j.block_cols, c1 = std::min(j.cols, c0 + j.block_cols);
  float amax = 0.0f;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(to_float(src[r * j.src_rs + c * j.src_cs])));
  const float scale = fp8_scale(amax);
  j.scale[br * j.scale_rs + bc * j.scale_cs] = scale;
  for (int64_t r = r0; r < r1; ++r) {
    uint8_t* out = j.dst + r * j.dst_rs;
    // IEEE division, as the CUDA kernel's: both round x / scale to float the same way
    for (int64_t c = c0; c < c1; ++c) out[c] = float_to_e4m3(to_float(src[r * j.src_rs + c * j.src_cs]) / scale);
  }
}

}  // namespace

void fp8_quantize_cpu(const Fp8Job& j, int num_threads) {
  const int64_t nbr = ceil_div(j.rows, j.block_rows), nbc = ceil_div(j.cols, j.block_cols);
  const int64_t per_block = j.block_rows * j.block_cols;
  VF_DISPATCH_FLOAT(static_cast<DType>(j.src_dtype), scalar_t, [&] {
    parallel_for(nbr * nbc, num_threads, std::max<int64_t>(1, kMinElementsPerThread / per_block),
                 [&](int64_t begin, int64_t end) {
                   for (int64_t b = begin; b < end; ++b) quantize_block<scalar_t>(j, b / nbc, b % nbc);
                 });
  });
}

void fp8_quantize(const TensorRef& src, const TensorRef& dst, const TensorRef& scale, int64_t block_rows,
                  int64_t block_cols, uintptr_t stream, int num_threads) {
  VF_CHECK(src.dim() == 2, "src must be a 2-D tensor [rows, cols], got ", src.dim(), "-D ", shape_str(src.sizes));
  check_float(src, "src");
  check_dtype(dst, "dst", DType::u8);
  check_dtype(scale, "scale", DType::f32);
  const int64_t rows = src.sizes[0], cols = src.sizes[1];
  check_shape(dst, "dst", {rows, cols}, " (src's shape, as uint8 bytes of float8_e4m3fn)");
  VF_CHECK(cols <= 1 || dst.strides[1] == 1, "dst's columns must be contiguous (stride 1), got stride ",
           dst.strides[1]);
  VF_CHECK(block_rows >= 1, "block_rows must be >= 1, got ", block_rows);
  VF_CHECK(block_cols >= 0, "block_cols must be >= 0 (0: the whole row), got ", block_cols);
  if (block_cols == 0) block_cols = std::max<int64_t>(cols, 1);
  check_shape(scale, "scale", {ceil_div(rows, block_rows), ceil_div(cols, block_cols)},
              " (one float32 scale per block)");
  check_same_device(src, "src", dst, "dst");
  check_same_device(src, "src", scale, "scale");
  VF_CHECK(num_threads >= 0, "num_threads must be >= 0 (0: all cores), got ", num_threads);
  if (rows == 0 || cols == 0) return;
  const Fp8Job job{src.data, static_cast<int32_t>(src.dtype), src.strides[0], src.strides[1], rows, cols,
                   static_cast<uint8_t*>(dst.data), dst.strides[0], static_cast<float*>(scale.data),
                   scale.strides[0], scale.strides[1], block_rows, block_cols};
  if (src.device == Device::cuda) {
#if defined(VF_WITH_CUDA)
    return fp8_quantize_cuda(job, stream, src.device_index);
#else
    (void)stream;
    throw ValueError("verl_fast._C was built without CUDA; reinstall with a CUDA toolkit to use CUDA tensors");
#endif
  }
  fp8_quantize_cpu(job, num_threads);
}

}  // namespace vf::reshard
