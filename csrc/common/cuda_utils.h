// CUDA helpers for the launchers: error checks that name the kernel, a device guard, and loads of
// any supported element type as float (the dtype is uniform per tensor, so the switch costs a few
// instructions per element in memory-bound kernels and saves dozens of template instantiations).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "common/tensor.h"

namespace vf {

inline void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(err));
  }
}

// After a launch: raise with the kernel's name if the launch failed.
#define VF_CUDA_LAUNCH_CHECK(name) ::vf::cuda_check(cudaGetLastError(), "CUDA kernel " name)

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cuda_check(cudaGetDevice(&prev_), "cudaGetDevice");
    if (device >= 0 && device != prev_) cuda_check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(prev_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};

// A 2-D (or 1-D: st unused) read-only view with a runtime element type.
struct View2 {
  const void* p;
  int64_t sb, st;
  int dtype;  // vf::DType
  static View2 of(const TensorRef& t) {
    return {t.data, t.dim() > 0 ? t.strides[0] : 0, t.dim() > 1 ? t.strides[1] : 0, static_cast<int>(t.dtype)};
  }
};

__device__ __forceinline__ float load_float(const View2& v, int64_t b, int64_t t) {
  const int64_t i = b * v.sb + t * v.st;
  switch (static_cast<DType>(v.dtype)) {
    case DType::f32: return __ldg(static_cast<const float*>(v.p) + i);
    case DType::f64: return static_cast<float>(__ldg(static_cast<const double*>(v.p) + i));
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(v.p)[i]);
    case DType::f16: return __half2float(static_cast<const __half*>(v.p)[i]);
    case DType::i64: return static_cast<float>(__ldg(static_cast<const long long*>(v.p) + i));
    case DType::i32: return static_cast<float>(__ldg(static_cast<const int*>(v.p) + i));
    case DType::u8:
    case DType::boolean: return static_cast<float>(static_cast<const unsigned char*>(v.p)[i]);
  }
  return 0.0f;
}

}  // namespace vf
