// Input checks for the launchers. Each message names the argument and what was expected;
// ValueError / TypeError reach Python through the exception types below.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

#include "common/tensor.h"

namespace vf {

struct ValueError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
struct TypeError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

#define VF_CHECK(cond, ...) \
  do {                      \
    if (!(cond)) throw ::vf::ValueError(::vf::cat(__VA_ARGS__)); \
  } while (0)

#define VF_CHECK_TYPE(cond, ...) \
  do {                           \
    if (!(cond)) throw ::vf::TypeError(::vf::cat(__VA_ARGS__)); \
  } while (0)

// name must be [d0, d1, ...] exactly.
inline void check_shape(const TensorRef& t, const char* name, const std::vector<int64_t>& expected,
                        const char* what = "") {
  VF_CHECK(t.sizes == expected, name, " must be a ", expected.size(), "-D tensor", what, " of shape ",
           shape_str(expected), ", got ", shape_str(t.sizes));
}

inline void check_float(const TensorRef& t, const char* name) {
  VF_CHECK_TYPE(is_float(t.dtype), name, " must be float32, float64, bfloat16 or float16, got ",
                dtype_name(t.dtype));
}

inline void check_dtype(const TensorRef& t, const char* name, DType d) {
  VF_CHECK_TYPE(t.dtype == d, name, " must be ", dtype_name(d), ", got ", dtype_name(t.dtype));
}

inline void check_mask(const TensorRef& t, const char* name) {
  VF_CHECK_TYPE(t.dtype == DType::boolean || t.dtype == DType::u8 || t.dtype == DType::i32 ||
                    t.dtype == DType::i64 || t.dtype == DType::f32,
                name, " must be bool, uint8, int32, int64 or float32, got ", dtype_name(t.dtype));
}

inline void check_contiguous(const TensorRef& t, const char* name) {
  VF_CHECK(t.is_contiguous(), name, " must be contiguous");
}

inline void check_same_device(const TensorRef& a, const char* an, const TensorRef& b, const char* bn) {
  VF_CHECK(a.device == b.device && a.device_index == b.device_index, an, " and ", bn,
           " must be on the same device");
}

}  // namespace vf
