// Host-side element types and dtype dispatch for the CPU launchers.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/check.h"
#include "common/tensor.h"

namespace vf {

struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(int64_t x) { return static_cast<float>(x); }
inline float to_float(int32_t x) { return static_cast<float>(x); }
inline float to_float(uint8_t x) { return static_cast<float>(x); }
inline float to_float(bf16_t x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_float(f16_t x) {
  // IEEE half -> single, subnormals and inf/NaN included.
  const uint32_t sign = (x.bits & 0x8000u) << 16;
  uint32_t exp = (x.bits >> 10) & 0x1f, man = x.bits & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do { ++e; man <<= 1; } while (!(man & 0x400u));
    u = sign | ((112 - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T>
inline bool nonzero(T x) { return to_float(x) != 0.0f; }

// VF_DISPATCH_FLOAT(dtype, scalar_t, body): body sees scalar_t as the C++ element type.
#define VF_DISPATCH_FLOAT(DT, NAME, ...)                                                        \
  [&] {                                                                                         \
    switch (DT) {                                                                               \
      case ::vf::DType::f32: { using NAME = float; return __VA_ARGS__(); }                      \
      case ::vf::DType::f64: { using NAME = double; return __VA_ARGS__(); }                     \
      case ::vf::DType::bf16: { using NAME = ::vf::bf16_t; return __VA_ARGS__(); }              \
      case ::vf::DType::f16: { using NAME = ::vf::f16_t; return __VA_ARGS__(); }                \
      default: throw ::vf::TypeError(::vf::cat("unsupported float dtype ", dtype_name(DT)));   \
    }                                                                                           \
  }()

#define VF_DISPATCH_MASK(DT, NAME, ...)                                                         \
  [&] {                                                                                         \
    switch (DT) {                                                                               \
      case ::vf::DType::boolean:                                                                \
      case ::vf::DType::u8: { using NAME = uint8_t; return __VA_ARGS__(); }                     \
      case ::vf::DType::i32: { using NAME = int32_t; return __VA_ARGS__(); }                    \
      case ::vf::DType::i64: { using NAME = int64_t; return __VA_ARGS__(); }                    \
      case ::vf::DType::f32: { using NAME = float; return __VA_ARGS__(); }                      \
      default: throw ::vf::TypeError(::vf::cat("unsupported mask dtype ", dtype_name(DT)));    \
    }                                                                                           \
  }()

// Element (b, t) of a 2-D tensor with arbitrary strides.
template <typename T>
inline T at2(const TensorRef& x, int64_t b, int64_t t) {
  return x.ptr<const T>()[b * x.strides[0] + t * x.strides[1]];
}

}  // namespace vf
