// A tensor as it crosses from Python into the compiled core: pointer, dtype, device, sizes,
// strides (in elements). No torch headers: the extension never links libtorch.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace vf {

enum class DType : int { f32, f64, bf16, f16, i64, i32, u8, boolean };
enum class Device : int { cpu, cuda };

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    case DType::i64: return "int64";
    case DType::i32: return "int32";
    case DType::u8: return "uint8";
    case DType::boolean: return "bool";
  }
  return "?";
}

inline int dtype_size(DType d) {
  switch (d) {
    case DType::f64: case DType::i64: return 8;
    case DType::f32: case DType::i32: return 4;
    case DType::bf16: case DType::f16: return 2;
    case DType::u8: case DType::boolean: return 1;
  }
  return 0;
}

inline bool is_float(DType d) {
  return d == DType::f32 || d == DType::f64 || d == DType::bf16 || d == DType::f16;
}

struct TensorRef {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int device_index = -1;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;  // in elements
  // Keeps the memory's owner alive while this reference exists (the Python binding stores the
  // tensor object here, so an argument record never points into freed memory).
  std::shared_ptr<const void> owner;
  // Bytes from the owner tensor's data to `data`: nonzero for a slice of a larger tensor made
  // here (a plan's destinations laid out in one buffer), 0 for a tensor converted as given.
  int64_t view_offset = 0;

  int dim() const { return static_cast<int>(sizes.size()); }
  int64_t numel() const {
    int64_t n = 1;
    for (auto s : sizes) n *= s;
    return n;
  }
  // As torch defines it: an empty tensor is contiguous whatever its strides.
  bool is_contiguous() const {
    if (numel() == 0) return true;
    int64_t expected = 1;
    for (int i = dim() - 1; i >= 0; --i) {
      if (sizes[i] != 1 && strides[i] != expected) return false;
      expected *= sizes[i];
    }
    return true;
  }
  template <typename T> T* ptr() const { return static_cast<T*>(data); }
};

// A CUDA stream handle (cudaStream_t) as the launchers receive it. From Python only a
// torch.cuda.Stream or None (CUDA's default stream, 0) converts to one, never a bare integer: a
// made-up handle would crash the driver.
struct CudaStream {
  uintptr_t handle = 0;
  operator uintptr_t() const { return handle; }
};

// Argument records list their fields once, as X(type, name, default, doc) macros; this declares
// one field of such a list (the area's bindings.cpp binds the same list to Python).
#define VF_RECORD_FIELD(type, name, init, doc) type name = init;

// "[8, 16]"
inline std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(s[i]);
  }
  return out + "]";
}

}  // namespace vf
