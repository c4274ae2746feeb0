// FP8 quantisation (fp8.h): the checks every call passes, and the CPU executor (the blocks of every job
// over threads).
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

int64_t fp8_blocks(const Fp8Job& j) { return ceil_div(j.rows, j.block_rows) * ceil_div(j.cols, j.block_cols); }

void fp8_quantize_cpu(const std::vector<Fp8Job>& jobs, int num_threads) {
  std::vector<int64_t> first{0};  // each job's first block in the flat numbering, then the total
  int64_t elements = 0;
  for (const auto& j : jobs) {
    first.push_back(first.back() + fp8_blocks(j));
    elements += j.rows * j.cols;
  }
  if (first.back() == 0) return;
  const int64_t per_block = std::max<int64_t>(1, elements / first.back());
  parallel_for(first.back(), num_threads, std::max<int64_t>(1, kMinElementsPerThread / per_block),
               [&](int64_t begin, int64_t end) {
                 for (int64_t b = begin; b < end; ++b) {
                   const size_t i = std::upper_bound(first.begin(), first.end(), b) - first.begin() - 1;
                   const Fp8Job& j = jobs[i];
                   const int64_t local = b - first[i], nbc = ceil_div(j.cols, j.block_cols);
                   VF_DISPATCH_FLOAT(static_cast<DType>(j.src_dtype), scalar_t,
                                     [&] { quantize_block<scalar_t>(j, local / nbc, local % nbc); });
                 }
               });
}

Fp8Job fp8_job(const TensorRef& src, const TensorRef& dst, const TensorRef& scale, int64_t block_rows,
               int64_t block_cols, const std::string& what) {
  const std::string s = "src" + what, d = "dst" + what, sc = "scale" + what;
  VF_CHECK(src.dim() == 2, s, " must be a 2-D tensor [rows, cols], got ", src.dim(), "-D ", shape_str(src.sizes));
  check_float(src, s.c_str());
  check_dtype(dst, d.c_str(), DType::u8);
  check_dtype(scale, sc.c_str(), DType::f32);
  const int64_t rows = src.sizes[0], cols = src.sizes[1];
  check_shape(dst, d.c_str(), {rows, cols}, " (src's shape, as uint8 bytes of float8_e4m3fn)");
  VF_CHECK(cols <= 1 || dst.strides[1] == 1, d, "'s columns must be contiguous (stride 1), got stride ",
           dst.strides[1]);
  VF_CHECK(block_rows >= 1, "block_rows must be >= 1, got ", block_rows);
  VF_CHECK(block_cols >= 0, "block_cols must be >= 0 (0: the whole row), got ", block_cols);
  if (block_cols == 0) block_cols = std::max<int64_t>(cols, 1);
  VF_CHECK(rows < (int64_t{1} << 31) && cols < (int64_t{1} << 31) &&
               std::min(block_rows, rows) * std::min(block_cols, cols) < (int64_t{1} << 31),
           s, " ", shape_str(src.sizes), ": rows, columns and a block's elements must each be < 2^31");
  check_shape(scale, sc.c_str(), {ceil_div(rows, block_rows), ceil_div(cols, block_cols)},
              " (one float32 scale per block)");
  check_same_device(src, s.c_str(), dst, d.c_str());
  check_same_device(src, s.c_str(), scale, sc.c_str());
  return Fp8Job{src.data, static_cast<int32_t>(src.dtype), src.strides[0], src.strides[1], rows, cols,
                static_cast<uint8_t*>(dst.data), dst.strides[0], static_cast<float*>(scale.data),
                scale.strides[0], scale.strides[1], block_rows, block_cols};
}

void fp8_quantize_jobs(const std::vector<Fp8Job>& jobs, Device device, int device_index, uintptr_t stream,
                       int num_threads) {
  VF_CHECK(num_threads >= 0, "num_threads must be >= 0 (0: all cores), got ", num_threads);
  std::vector<Fp8Job> work;
  for (const auto& j : jobs)
    if (j.rows > 0 && j.cols > 0) work.push_back(j);
  if (work.empty()) return;
  if (device == Device::cuda) {
#if defined(VF_WITH_CUDA)
    return fp8_quantize_cuda(work, stream, device_index);
#else
    (void)stream;
    (void)device_index;
    throw ValueError("verl_fast._C was built without CUDA; reinstall with a CUDA toolkit to use CUDA tensors");
#endif
  }
  fp8_quantize_cpu(work, num_threads);
}

void fp8_quantize(const TensorRef& src, const TensorRef& dst, const TensorRef& scale, int64_t block_rows,
                  int64_t block_cols, uintptr_t stream, int num_threads) {
  const Fp8Job job = fp8_job(src, dst, scale, block_rows, block_cols, "");
  fp8_quantize_jobs({job}, src.device, src.device_index, stream, num_threads);
}

}  // namespace vf::reshard
